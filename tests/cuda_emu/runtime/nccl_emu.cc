/* nccl_emu.cc — NCCL's subset that ferry calls (engine/device/cuda/cuda_nccl.c) for the
 * emulated CUDA build: libnccl.so.2, loaded with dlopen as the real one is. The host half:
 * communicators, argument checks, groups; the collectives run on each rank's emulated
 * device (nccl_dev.cc), queued on their stream with fy_emu_enqueue.
 *
 * Semantics are NCCL's documented ones, checked more strictly where NCCL leaves a misuse
 * undefined or hanging: every pointer is checked (NCCL checks only with NCCL_CHECK_POINTERS),
 * ranks whose n-th collectives differ get ncclInvalidUsage as their asynchronous error (NCCL
 * hangs or corrupts), and a call on a destroyed communicator returns ncclInvalidUsage (its
 * struct is therefore never freed, only emptied and listed: a hundred bytes a communicator).
 * Reductions: ncclSum on ncclFloat32 and ncclBfloat16 (ferry's); a group's calls all on one
 * stream (ferry's); the rest returns ncclInvalidArgument with a line saying it is not
 * emulated. Every misuse caught is one fy_emu_report line.
 *
 * Not thread-safe for one communicator, as NCCL is not; groups are per thread, as NCCL's. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <vector>

#include <nccl.h>

#include "tests/cuda_emu/runtime/emu_rt.h"
#include "tests/cuda_emu/runtime/nccl_dev.h"

#define COMM_MAGIC 0x6d6d6f632d6c6363ull
#define GROUP_MAX 2048 /* NCCL's limit on the calls of one group */

struct ncclComm {
    uint64_t magic;
    bool destroyed;   /* by ncclCommDestroy or ncclCommAbort: every call fails */
    int rank, nranks;
    char name[FY_NCCL_NAME_MAX];
    fy_nccl_seg *seg; /* the host's mapping */
    size_t seg_nbytes;
    uint64_t issued;  /* collectives queued on the device */
    size_t charged;   /* device bytes taken (fy_emu_take) */
    ncclComm *next_destroyed;
};

/* The destroyed communicators, kept (reachable, for leak checkers) so that a call on one
 * is known for what it is. */
static ncclComm *destroyed_comms;
static pthread_mutex_t destroyed_mu = PTHREAD_MUTEX_INITIALIZER;

/* A collective checked and waiting to be queued (at once, or at the group's end). */
struct pending {
    ncclComm_t comm;
    fy_nccl_call call;
    const void *send;
    void *recv;
    cudaStream_t stream;
};

/* This thread's group: ncclGroupStart's depth, its calls, and the first error among them
 * (which fails ncclGroupEnd and drops the calls, as NCCL's does). */
static thread_local int group_depth;
static thread_local std::vector<pending> group_calls;
static thread_local ncclResult_t group_error;

/* The device memory NCCL takes for a communicator's buffers (channels x peers x
 * protocols): measured 544 MB for two A100s over NVLink, 688 MB for more ranks (NVIDIA/nccl
 * issue 964). The emulation's own staging buffers live in shared host memory instead. */
static size_t charge_nbytes(int nranks) { return (size_t)(nranks <= 2 ? 544 : 688) << 20; }

/* Seconds ncclCommInitRank waits for every rank: $FY_NCCL_EMU_INIT_S, else 120. */
static double init_timeout_s(void) {
    const char *e = getenv("FY_NCCL_EMU_INIT_S");
    double t = e ? atof(e) : 0;
    return t > 0 ? t : 120;
}

/* ---- the id and the segment --------------------------------------------------------- */

/* An id: FY_NCCL_ID_MAGIC, then the segment's name, NUL-terminated. */
typedef struct id_layout {
    uint64_t magic;
    char name[FY_NCCL_NAME_MAX];
} id_layout;

extern "C" ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId) {
    if (!uniqueId) {
        fy_emu_report("ncclGetUniqueId: uniqueId is NULL");
        return ncclInvalidArgument;
    }
    static unsigned counter;
    uint64_t r = 0;
    if (getrandom(&r, sizeof r, 0) != (ssize_t)sizeof r) r = (uint64_t)time(NULL) ^ (uint64_t)clock();
    id_layout id = {};
    id.magic = FY_NCCL_ID_MAGIC;
    snprintf(id.name, sizeof id.name, "/fy-nccl-%d-%u-%016llx", (int)getpid(),
             __atomic_add_fetch(&counter, 1u, __ATOMIC_SEQ_CST), (unsigned long long)r);
    memset(uniqueId, 0, sizeof *uniqueId);
    memcpy(uniqueId->internal, &id, sizeof id);
    return ncclSuccess;
}

/* Maps a segment of `bytes` from fd. */
static fy_nccl_seg *map_fd(int fd, size_t bytes) {
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    return p == MAP_FAILED ? nullptr : (fy_nccl_seg *)p;
}

/* Creates the segment of `name` for nranks, or opens the one another rank created and
 * checks it is for nranks; waits for its header until deadline. */
static ncclResult_t seg_open(const char *name, int rank, int nranks, double deadline,
                             fy_nccl_seg **out, size_t *bytes) {
    const size_t want = fy_nccl_seg_nbytes(nranks);
    int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd >= 0) {
        int e = posix_fallocate(fd, 0, (off_t)want);
        fy_nccl_seg *s = e ? nullptr : map_fd(fd, want);
        close(fd);
        if (!s) {
            shm_unlink(name);
            fy_emu_report("ncclCommInitRank: no room for the communicator's %zu MiB in /dev/shm: %s",
                          want >> 20, strerror(e ? e : errno));
            return ncclSystemError;
        }
        s->nranks = nranks;
        __atomic_store_n(&s->magic, FY_NCCL_SEG_MAGIC, __ATOMIC_SEQ_CST);
        fy_nccl_ring(s);
        *out = s;
        *bytes = want;
        return ncclSuccess;
    }
    if (errno == EEXIST) fd = shm_open(name, O_RDWR | O_CLOEXEC, 0);
    if (fd < 0) {
        fy_emu_report("ncclCommInitRank: cannot open the communicator's segment %s: %s", name,
                      strerror(errno));
        return ncclSystemError;
    }
    /* the creator sizes it, then writes its header */
    struct stat sb;
    fy_nccl_seg *s = nullptr;
    while (!s || __atomic_load_n(&s->magic, __ATOMIC_SEQ_CST) != FY_NCCL_SEG_MAGIC) {
        if (!s && fstat(fd, &sb) == 0 && (size_t)sb.st_size >= sizeof(fy_nccl_seg))
            s = map_fd(fd, (size_t)sb.st_size);
        if (fy_nccl_now() >= deadline) {
            if (s) munmap(s, (size_t)sb.st_size);
            close(fd);
            fy_emu_report("ncclCommInitRank: rank %d found the communicator's segment %s never "
                          "set up", rank, name);
            return ncclSystemError;
        }
        usleep(1000);
    }
    close(fd);
    if (s->nranks != nranks) {
        fy_emu_report("ncclCommInitRank: rank %d says the communicator has %d ranks; the rank "
                      "that created it said %d", rank, nranks, s->nranks);
        munmap(s, (size_t)sb.st_size);
        return ncclInvalidArgument;
    }
    *out = s;
    *bytes = (size_t)sb.st_size;
    return ncclSuccess;
}

/* What a failed wait at init returns, after one line saying why. */
static ncclResult_t init_failed(fy_nccl_met m, int rank, int who, const char *what, double t) {
    if (m == FY_NCCL_LATE) {
        fy_emu_report("ncclCommInitRank: rank %d waited %.0f s for rank %d's %s", rank, t, who, what);
        return ncclSystemError;
    }
    fy_emu_report("ncclCommInitRank: rank %d: rank %d is gone before the communicator was made",
                  rank, who);
    return ncclRemoteError;
}

/* Queues the device half's kind of work for comm's rank on stream st. */
static cudaError_t enqueue(ncclComm_t comm, fy_nccl_kind kind, const fy_nccl_call *call,
                           const void *send, void *recv, cudaStream_t st, const char *what) {
    fy_nccl_args a = {};
    memcpy(a.name, comm->name, sizeof a.name);
    a.kind = kind;
    a.rank = comm->rank;
    if (call) a.call = *call;
    a.sendbuff = send;
    a.recvbuff = recv;
    return fy_emu_enqueue(st, fy_emu_nccl_dev, &a, sizeof a, what);
}

/* Leaves the segment in state (FY_NCCL_LEFT, _ABORTED): the device unmaps it once its
 * collectives on it returned; nothing of it stays (the name too, if init failed before
 * unlinking it). */
static void comm_leave(ncclComm_t comm, fy_nccl_state state, bool device_joined) {
    fy_nccl_slot *me = fy_nccl_slot_of(comm->seg, comm->rank);
    __atomic_store_n(&me->state, (int32_t)state, __ATOMIC_SEQ_CST);
    fy_nccl_ring(comm->seg);
    if (device_joined) enqueue(comm, FY_NCCL_LEAVE, NULL, NULL, NULL, NULL, "ncclCommDestroy");
    munmap(comm->seg, comm->seg_nbytes);
    comm->seg = nullptr;
    shm_unlink(comm->name);
    fy_emu_give(comm->charged);
    comm->charged = 0;
}

/* Ends comm for its user (ncclCommDestroy, ncclCommAbort): left in state, then listed. */
static void comm_end(ncclComm_t comm, fy_nccl_state state) {
    comm_leave(comm, state, true);
    comm->destroyed = true;
    pthread_mutex_lock(&destroyed_mu);
    comm->next_destroyed = destroyed_comms;
    destroyed_comms = comm;
    pthread_mutex_unlock(&destroyed_mu);
}

/* Takes rank c->rank's slot in c's segment and waits until every rank's host, then every
 * rank's device, joined; on failure leaves, undoing all but c's allocation. */
static ncclResult_t meet(ncclComm_t c, double deadline, double t) {
    fy_nccl_slot *me = fy_nccl_slot_of(c->seg, c->rank);
    uint32_t none = 0;
    if (!__atomic_compare_exchange_n(&me->host_in, &none, 1u, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
        fy_emu_report("ncclCommInitRank: two processes joined as rank %d", c->rank);
        munmap(c->seg, c->seg_nbytes);
        fy_emu_give(c->charged);
        return ncclInvalidUsage;
    }
    __atomic_store_n(&me->host_pid, (int32_t)getpid(), __ATOMIC_SEQ_CST);
    __atomic_store_n(&me->state, (int32_t)FY_NCCL_IN, __ATOMIC_SEQ_CST);
    fy_nccl_ring(c->seg);
    ncclResult_t r = ncclSuccess;
    int who = -1;
    bool joined = false;
    fy_nccl_met m = fy_nccl_wait(c->seg, c->rank, offsetof(fy_nccl_slot, host_in), 1, deadline, &who);
    if (m != FY_NCCL_MET) {
        r = init_failed(m, c->rank, who, "host process", t);
    } else if (enqueue(c, FY_NCCL_JOIN, NULL, NULL, NULL, NULL, "ncclCommInitRank") != cudaSuccess) {
        fy_emu_report("ncclCommInitRank: rank %d's device takes no work", c->rank);
        r = ncclUnhandledCudaError;
    } else {
        joined = true;
        m = fy_nccl_wait(c->seg, c->rank, offsetof(fy_nccl_slot, dev_in), 1, deadline, &who);
        if (m != FY_NCCL_MET) r = init_failed(m, c->rank, who, "device process", t);
    }
    if (r != ncclSuccess) comm_leave(c, FY_NCCL_ABORTED, joined);
    return r;
}

extern "C" ncclResult_t ncclCommInitRank(ncclComm_t *out, int nranks, ncclUniqueId commId, int rank) {
    if (!out) {
        fy_emu_report("ncclCommInitRank: comm is NULL");
        return ncclInvalidArgument;
    }
    *out = nullptr;
    if (group_depth > 0) {
        fy_emu_report("ncclCommInitRank inside a group is not emulated (it waits for the other "
                      "ranks at once)");
        return ncclInvalidUsage;
    }
    if (nranks < 1 || rank < 0 || rank >= nranks) {
        fy_emu_report("ncclCommInitRank: rank %d of %d ranks", rank, nranks);
        return ncclInvalidArgument;
    }
    id_layout id;
    memcpy(&id, commId.internal, sizeof id);
    if (id.magic != FY_NCCL_ID_MAGIC || !memchr(id.name, 0, sizeof id.name)) {
        fy_emu_report("ncclCommInitRank: an ncclUniqueId that ncclGetUniqueId did not make");
        return ncclInvalidArgument;
    }
    ncclComm_t c = (ncclComm_t)calloc(1, sizeof *c);
    if (!c) return ncclSystemError;
    c->magic = COMM_MAGIC;
    c->rank = rank;
    c->nranks = nranks;
    memcpy(c->name, id.name, sizeof c->name);
    c->charged = charge_nbytes(nranks);
    if (fy_emu_take(c->charged) != cudaSuccess) {
        fy_emu_report("ncclCommInitRank: no device memory for NCCL's buffers (%zu MiB)", c->charged >> 20);
        free(c);
        return ncclUnhandledCudaError;
    }
    const double t = init_timeout_s(), deadline = fy_nccl_now() + t;
    ncclResult_t r = seg_open(c->name, rank, nranks, deadline, &c->seg, &c->seg_nbytes);
    if (r != ncclSuccess) {
        fy_emu_give(c->charged);
        free(c);
        return r;
    }
    if ((r = meet(c, deadline, t)) != ncclSuccess) {
        free(c);
        return r;
    }
    shm_unlink(c->name); /* every process of every rank has it mapped */
    *out = c;
    return ncclSuccess;
}

/* ---- calls on a communicator ---------------------------------------------------------- */

/* ncclSuccess if comm is a live communicator. */
static ncclResult_t comm_check(ncclComm_t comm, const char *fn) {
    if (!comm || comm->magic != COMM_MAGIC) {
        fy_emu_report("%s: %s", fn, comm ? "not a communicator" : "comm is NULL");
        return ncclInvalidArgument;
    }
    if (comm->destroyed) {
        fy_emu_report("%s: a communicator already destroyed or aborted", fn);
        return ncclInvalidUsage;
    }
    return ncclSuccess;
}

static ncclResult_t async_error(ncclComm_t comm) {
    const fy_nccl_slot *me = fy_nccl_slot_of(comm->seg, comm->rank);
    return (ncclResult_t)__atomic_load_n(&me->err, __ATOMIC_SEQ_CST);
}

extern "C" ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError) {
    ncclResult_t r = comm_check(comm, "ncclCommGetAsyncError");
    if (r != ncclSuccess) return r;
    if (!asyncError) {
        fy_emu_report("ncclCommGetAsyncError: asyncError is NULL");
        return ncclInvalidArgument;
    }
    *asyncError = async_error(comm);
    return ncclSuccess;
}

extern "C" ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    if (!comm) return ncclSuccess;
    ncclResult_t r = comm_check(comm, "ncclCommDestroy");
    if (r != ncclSuccess) return r;
    /* NCCL completes what was issued first; a collective that met an error never does, nor
     * one queued on a device that failed (fy_emu_enqueue then returns its sticky error) */
    fy_nccl_seg *s = comm->seg;
    fy_nccl_slot *me = fy_nccl_slot_of(s, comm->rank);
    for (;;) {
        uint32_t seen = __atomic_load_n(&s->bell, __ATOMIC_SEQ_CST);
        if ((r = async_error(comm)) != ncclSuccess) break;
        if (__atomic_load_n(&me->done, __ATOMIC_SEQ_CST) >= comm->issued) break;
        cudaError_t e = enqueue(comm, FY_NCCL_PROBE, NULL, NULL, NULL, NULL, "ncclCommDestroy");
        if (e != cudaSuccess) {
            fy_emu_report("ncclCommDestroy on rank %d: the device failed (cudaError_t %d) "
                          "before its collectives ran", comm->rank, (int)e);
            comm_end(comm, FY_NCCL_ABORTED);
            return ncclUnhandledCudaError;
        }
        fy_nccl_sleep(s, seen, 1.0);
    }
    if (r != ncclSuccess) {
        fy_emu_report("ncclCommDestroy on rank %d after the asynchronous error \"%s\": NCCL waits "
                      "for collectives that never complete; ncclCommAbort is the call after an "
                      "error", comm->rank, ncclGetErrorString(r));
        comm_end(comm, FY_NCCL_ABORTED);
        return r;
    }
    comm_end(comm, FY_NCCL_LEFT);
    return ncclSuccess;
}

extern "C" ncclResult_t ncclCommAbort(ncclComm_t comm) {
    if (!comm) return ncclSuccess;
    ncclResult_t r = comm_check(comm, "ncclCommAbort");
    if (r != ncclSuccess) return r;
    comm_end(comm, FY_NCCL_ABORTED);
    return ncclSuccess;
}

/* ---- collectives and groups ------------------------------------------------------------ */

/* NCCL's argument checks (ArgsCheck) and the emulation's stricter ones, then the pointers:
 * each buffer the rank reads or writes lies in device or pinned memory, count elements
 * long; sendbuff and recvbuff are the same buffer or apart. */
static ncclResult_t check_call(const char *fn, const pending *p) {
    const fy_nccl_call *c = &p->call;
    ncclResult_t r = comm_check(p->comm, fn);
    if (r != ncclSuccess) return r;
    if ((r = async_error(p->comm)) != ncclSuccess) return r; /* as NCCL's ncclCommEnsureReady */
    const size_t es = fy_nccl_dtype_size(c->dtype);
    const char *bad = nullptr;
    char why[96];
    if (c->root < 0 || c->root >= p->comm->nranks) {
        snprintf(why, sizeof why, "root %d of %d ranks", c->root, p->comm->nranks);
        bad = why;
    } else if (!es) {
        snprintf(why, sizeof why, "datatype %d", c->dtype);
        bad = why;
    } else if (c->op < 0 || c->op >= ncclNumOps) {
        snprintf(why, sizeof why, "reduction op %d", c->op);
        bad = why;
    } else if (c->count > SIZE_MAX / es) {
        bad = "a count whose bytes overflow";
    }
    if (bad) {
        fy_emu_report("%s: %s", fn, bad);
        return ncclInvalidArgument;
    }
    if (c->kind == FY_NCCL_REDUCE && (c->op != ncclSum || (c->dtype != ncclFloat32 && c->dtype != ncclBfloat16))) {
        fy_emu_report("%s: %s on %s is not emulated (ncclSum on ncclFloat32 and ncclBfloat16 is)",
                      fn, fy_nccl_op_name(c->op), fy_nccl_dtype_name(c->dtype));
        return ncclInvalidArgument;
    }
    const size_t nbytes = c->count * es;
    const bool root = p->comm->rank == c->root, reduce = c->kind == FY_NCCL_REDUCE;
    const bool sends = reduce || root, receives = !reduce || root;
    struct { const char *name; const void *ptr; bool used; } bufs[2] = {
        {"sendbuff", p->send, sends}, {"recvbuff", p->recv, receives}};
    for (int k = 0; k < 2 && c->count; k++) {
        if (!bufs[k].used) continue;
        fy_emu_mem m = fy_emu_mem_of(bufs[k].ptr, nbytes);
        if (m != FY_EMU_DEVICE && m != FY_EMU_PINNED) {
            fy_emu_report("%s on rank %d: %s [%p, +%zu) is %s", fn, p->comm->rank, bufs[k].name,
                          bufs[k].ptr, nbytes,
                          m == FY_EMU_PAGEABLE ? "host memory CUDA did not allocate"
                                               : "not inside one live allocation");
            return ncclInvalidArgument;
        }
    }
    const char *s = (const char *)p->send, *d = (const char *)p->recv;
    if (sends && receives && c->count && s != d && s < d + nbytes && d < s + nbytes) {
        fy_emu_report("%s on rank %d: sendbuff and recvbuff overlap without being the same buffer",
                      fn, p->comm->rank);
        return ncclInvalidArgument;
    }
    return ncclSuccess;
}

static ncclResult_t launch(pending *p) {
    p->call.seq = p->comm->issued + 1;
    const char *fn = p->call.kind == FY_NCCL_REDUCE ? "ncclReduce" : "ncclBroadcast";
    if (enqueue(p->comm, (fy_nccl_kind)p->call.kind, &p->call, p->send, p->recv, p->stream, fn) != cudaSuccess) {
        fy_emu_report("%s on rank %d: its stream takes no work", fn, p->comm->rank);
        return ncclUnhandledCudaError;
    }
    p->comm->issued++;
    return ncclSuccess;
}

static ncclResult_t collective(const char *fn, pending p) {
    ncclResult_t r = check_call(fn, &p);
    if (r == ncclSuccess && p.call.count == 0) return ncclSuccess; /* NCCL drops empty ones */
    if (r == ncclSuccess && group_depth > 0 && group_calls.size() >= GROUP_MAX) {
        fy_emu_report("%s: more than NCCL's %d calls in one group", fn, GROUP_MAX);
        r = ncclInvalidUsage;
    }
    if (r != ncclSuccess) {
        if (group_depth > 0 && group_error == ncclSuccess) group_error = r;
        return r;
    }
    if (group_depth == 0) return launch(&p);
    group_calls.push_back(p);
    return ncclSuccess;
}

extern "C" ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count,
                                   ncclDataType_t datatype, ncclRedOp_t op, int root,
                                   ncclComm_t comm, cudaStream_t stream) {
    pending p = {comm, {0, FY_NCCL_REDUCE, (int32_t)datatype, (int32_t)op, root, count},
                 sendbuff, recvbuff, stream};
    return collective("ncclReduce", p);
}

extern "C" ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count,
                                      ncclDataType_t datatype, int root, ncclComm_t comm,
                                      cudaStream_t stream) {
    pending p = {comm, {0, FY_NCCL_BROADCAST, (int32_t)datatype, (int32_t)ncclSum, root, count},
                 sendbuff, recvbuff, stream};
    return collective("ncclBroadcast", p);
}

extern "C" ncclResult_t ncclGroupStart(void) {
    group_depth++;
    return ncclSuccess;
}

/* The outermost ncclGroupEnd queues the group's calls in call order. */
extern "C" ncclResult_t ncclGroupEnd(void) {
    if (group_depth == 0) {
        fy_emu_report("ncclGroupEnd without ncclGroupStart");
        return ncclInvalidUsage;
    }
    if (--group_depth > 0) return ncclSuccess;
    std::vector<pending> calls;
    calls.swap(group_calls);
    ncclResult_t r = group_error;
    group_error = ncclSuccess;
    for (size_t i = 1; i < calls.size() && r == ncclSuccess; i++) {
        if (calls[i].stream != calls[0].stream) {
            fy_emu_report("ncclGroupEnd: a group over several streams is not emulated (NCCL "
                          "joins them: every stream waits for the whole group)");
            r = ncclInvalidUsage;
        }
    }
    for (size_t i = 0; i < calls.size() && r == ncclSuccess; i++) {
        r = comm_check(calls[i].comm, "ncclGroupEnd");
        if (r == ncclSuccess) r = launch(&calls[i]);
    }
    return r;
}

/* ---- the library -------------------------------------------------------------------------- */

extern "C" const char *ncclGetErrorString(ncclResult_t result) {
    switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
    }
}

extern "C" ncclResult_t ncclGetVersion(int *version) {
    if (!version) {
        fy_emu_report("ncclGetVersion: version is NULL");
        return ncclInvalidArgument;
    }
    *version = NCCL_VERSION_CODE;
    return ncclSuccess;
}
