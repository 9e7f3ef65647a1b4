/* nccl_dev.cc — the emulated NCCL's device half (nccl_dev.h), in libfy_cudart_emu.so: the
 * collectives as each rank's emulated device runs them, and the waiting both halves share.
 *
 * A collective, on every rank's device: post the call in the rank's slot, meet (barrier),
 * check that every rank posted the same call, then move the data a staging buffer
 * (FY_NCCL_STAGE_NBYTES) at a time, two barriers a chunk: every rank (reduce) or the root
 * (broadcast) fills its buffer; then the root sums the buffers into its recvbuff, or every
 * other rank copies the root's out. A barrier that does not come (a peer gone, or one that
 * destroyed its communicator) or calls that differ set the rank's asynchronous error, and
 * the collective waits for ncclCommAbort, as a hung NCCL kernel would. A peer gone is
 * found here on one machine, where NCCL reports it only over a network (inside a node
 * its kernels spin, NVIDIA/nccl#279): the emulation is kinder there, so that the
 * backend's polling of the asynchronous error has something to find.
 *
 * The sum is NCCL's ring order: from the rank after the root around to the root, in the
 * data type, each addition rounded (a bf16 partial sum is bf16 on the wire, added in fp32
 * and rounded: __hadd2). Two ranks give a + b exactly, the bits one process gets adding
 * them; three or more differ from a rank-order sum by rounding, as on GPUs. */
#include "tests/cuda_emu/runtime/nccl_dev.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <deque>
#include <mutex>

#include <nccl.h>

#include "tests/cuda_emu/runtime/emu_rt.h"
extern "C" {
#include "engine/core/dtype.h"
}

/* ---- shared by the two halves --------------------------------------------------- */

extern "C" double fy_nccl_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

extern "C" void fy_nccl_ring(fy_nccl_seg *s) {
    __atomic_add_fetch(&s->bell, 1, __ATOMIC_SEQ_CST);
    syscall(SYS_futex, &s->bell, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

extern "C" void fy_nccl_sleep(fy_nccl_seg *s, uint32_t seen, double sec) {
    if (sec <= 0) return;
    struct timespec ts = {(time_t)sec, (long)((sec - (double)(time_t)sec) * 1e9)};
    syscall(SYS_futex, &s->bell, FUTEX_WAIT, seen, &ts, NULL, 0);
}

/* Whether process pid has ended: no such process, or a zombie nobody reaped yet. */
static bool ended(int pid) {
    if (pid <= 0) return false;
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return kill(pid, 0) != 0 && errno == ESRCH;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return true;
    buf[n] = 0;
    const char *p = strrchr(buf, ')'); /* the state follows the command's name */
    return p && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X');
}

static uint32_t counter(const fy_nccl_slot *q, size_t field) {
    return __atomic_load_n((const uint32_t *)((const char *)q + field), __ATOMIC_SEQ_CST);
}
static bool reached(const fy_nccl_slot *q, size_t field, uint32_t target) {
    return (int32_t)(counter(q, field) - target) >= 0;
}

/* Why rank q, not at target yet, never will be: FY_NCCL_MET if nothing says so. Its
 * counter is read again after its state and processes, which it changes after the
 * counter: a rank that got there and then left is not late. */
static fy_nccl_met why_late(fy_nccl_slot *q, size_t field, uint32_t target) {
    int st = __atomic_load_n(&q->state, __ATOMIC_SEQ_CST);
    bool gone = st == FY_NCCL_ABORTED || st == FY_NCCL_FAILED ||
                ended(__atomic_load_n(&q->host_pid, __ATOMIC_SEQ_CST)) ||
                ended(__atomic_load_n(&q->dev_pid, __ATOMIC_SEQ_CST));
    if (reached(q, field, target)) return FY_NCCL_MET;
    return st == FY_NCCL_LEFT ? FY_NCCL_QUIT : gone ? FY_NCCL_GONE : FY_NCCL_MET;
}

extern "C" fy_nccl_met fy_nccl_wait(fy_nccl_seg *s, int self, size_t field, uint32_t target,
                                    double deadline_s, int *who) {
    double look = fy_nccl_now() + 0.1;
    for (;;) {
        uint32_t seen = __atomic_load_n(&s->bell, __ATOMIC_SEQ_CST);
        int late = -1;
        for (int q = 0; q < s->nranks && late < 0; q++)
            if (!reached(fy_nccl_slot_of(s, q), field, target)) late = q;
        if (late < 0) return FY_NCCL_MET;
        if (__atomic_load_n(&fy_nccl_slot_of(s, self)->state, __ATOMIC_SEQ_CST) > FY_NCCL_IN)
            return FY_NCCL_STOPPED;
        double now = fy_nccl_now();
        if (now >= look) {
            look = now + 0.1;
            for (int q = 0; q < s->nranks; q++) {
                fy_nccl_met m = q == self ? FY_NCCL_MET : why_late(fy_nccl_slot_of(s, q), field, target);
                if (m != FY_NCCL_MET) {
                    *who = q;
                    return m;
                }
            }
        }
        if (deadline_s > 0 && now >= deadline_s) {
            *who = late;
            return FY_NCCL_LATE;
        }
        double nap = look - now;
        if (deadline_s > 0 && deadline_s - now < nap) nap = deadline_s - now;
        fy_nccl_sleep(s, seen, nap);
    }
}

extern "C" const char *fy_nccl_dtype_name(int t) {
    static const char *const names[ncclNumTypes] = {
        "ncclInt8",    "ncclUint8",   "ncclInt32",   "ncclUint32",     "ncclInt64",     "ncclUint64",
        "ncclFloat16", "ncclFloat32", "ncclFloat64", "ncclBfloat16", "ncclFloat8e4m3", "ncclFloat8e5m2"};
    return t >= 0 && t < ncclNumTypes ? names[t] : "?";
}

extern "C" size_t fy_nccl_dtype_size(int t) {
    static const unsigned char sizes[ncclNumTypes] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1};
    return t >= 0 && t < ncclNumTypes ? sizes[t] : 0;
}

extern "C" const char *fy_nccl_op_name(int op) {
    static const char *const names[ncclNumOps] = {"ncclSum", "ncclProd", "ncclMax", "ncclMin", "ncclAvg"};
    return op >= 0 && op < ncclNumOps ? names[op] : "?";
}

/* ---- the device's mappings ---------------------------------------------------------- */

/* A communicator's segment as this device process maps it. users: collectives running on
 * it now (one per stream at most); the last one out unmaps it once the host left. */
struct dev_map {
    char name[FY_NCCL_NAME_MAX];
    fy_nccl_seg *seg;
    size_t nbytes;
    int users;
    bool left;
};
static std::mutex maps_mu;
static std::deque<dev_map> maps; /* grows only: an entry's address stays valid */

static dev_map *find_map(const char *name) {
    for (dev_map &m : maps)
        if (!strcmp(m.name, name)) return &m;
    return nullptr;
}

static cudaError_t join(const fy_nccl_args *a) {
    int fd = shm_open(a->name, O_RDWR | O_CLOEXEC, 0);
    struct stat sb;
    void *p = MAP_FAILED;
    if (fd >= 0 && fstat(fd, &sb) == 0)
        p = mmap(NULL, (size_t)sb.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (fd >= 0) close(fd);
    /* unlinked before every device joined: the host's ncclCommInitRank failed meanwhile */
    if (fd < 0 && errno == ENOENT) return cudaSuccess;
    if (p == MAP_FAILED) {
        fy_emu_report("ncclCommInitRank: rank %d's device cannot map the communicator's segment "
                      "%s: %s", a->rank, a->name, strerror(errno));
        return cudaErrorLaunchFailure;
    }
    fy_nccl_seg *s = (fy_nccl_seg *)p;
    fy_nccl_slot *me = fy_nccl_slot_of(s, a->rank);
    __atomic_store_n(&me->dev_pid, (int32_t)getpid(), __ATOMIC_SEQ_CST);
    __atomic_store_n(&me->dev_in, 1u, __ATOMIC_SEQ_CST);
    fy_nccl_ring(s);
    std::lock_guard<std::mutex> g(maps_mu);
    dev_map m = {};
    snprintf(m.name, sizeof m.name, "%s", a->name);
    m.seg = s;
    m.nbytes = (size_t)sb.st_size;
    maps.push_back(m);
    return cudaSuccess;
}

static void unmap_if_unused(dev_map *m) {
    if (!m->left || m->users || !m->seg) return;
    munmap(m->seg, m->nbytes);
    m->seg = nullptr;
}

static cudaError_t leave(const fy_nccl_args *a) {
    std::lock_guard<std::mutex> g(maps_mu);
    dev_map *m = find_map(a->name);
    if (m) {
        m->left = true;
        unmap_if_unused(m);
    }
    return cudaSuccess;
}

/* ---- a collective ------------------------------------------------------------------- */

static const char *kind_name(int kind) { return kind == FY_NCCL_REDUCE ? "ncclReduce" : "ncclBroadcast"; }

/* "ncclReduce #3 (count 10, ncclFloat32, ncclSum, root 0)" */
static void describe(const fy_nccl_call *c, char *buf, size_t cap) {
    if (c->kind == FY_NCCL_REDUCE)
        snprintf(buf, cap, "%s #%llu (count %llu, %s, %s, root %d)", kind_name(c->kind),
                 (unsigned long long)c->seq, (unsigned long long)c->count,
                 fy_nccl_dtype_name(c->dtype), fy_nccl_op_name(c->op), c->root);
    else
        snprintf(buf, cap, "%s #%llu (count %llu, %s, root %d)", kind_name(c->kind),
                 (unsigned long long)c->seq, (unsigned long long)c->count,
                 fy_nccl_dtype_name(c->dtype), c->root);
}

/* One rank's device in one collective. */
struct coll {
    fy_nccl_seg *s;
    const fy_nccl_args *a;
    fy_nccl_slot *me;
    char what[160];
};

/* The collective cannot complete: records the asynchronous error (the first one
 * stays), then waits, as the hung kernel it stands for, until ncclCommAbort. */
static cudaError_t hang(coll *c, ncclResult_t err) {
    int none = ncclSuccess;
    __atomic_compare_exchange_n(&c->me->err, &none, (int)err, false, __ATOMIC_SEQ_CST,
                                __ATOMIC_SEQ_CST);
    fy_nccl_ring(c->s);
    for (;;) {
        uint32_t seen = __atomic_load_n(&c->s->bell, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&c->me->state, __ATOMIC_SEQ_CST) > FY_NCCL_IN) return cudaSuccess;
        fy_nccl_sleep(c->s, seen, 1.0);
    }
}

/* Meets every rank's device: true if all came; false if this communicator was aborted
 * meanwhile or a peer never will come, then *ret is what the collective returns. */
static bool barrier(coll *c, cudaError_t *ret) {
    uint32_t t = __atomic_add_fetch(&c->me->step, 1u, __ATOMIC_SEQ_CST);
    fy_nccl_ring(c->s);
    int who = -1;
    fy_nccl_met m = fy_nccl_wait(c->s, c->a->rank, offsetof(fy_nccl_slot, step), t, 0, &who);
    if (m == FY_NCCL_MET) return true;
    if (m == FY_NCCL_STOPPED) {
        *ret = cudaSuccess;
        return false;
    }
    if (m == FY_NCCL_QUIT) {
        fy_emu_report("%s on rank %d: rank %d destroyed its communicator instead: the ranks "
                      "issued different numbers of collectives, on which NCCL hangs",
                      c->what, c->a->rank, who);
        *ret = hang(c, ncclInvalidUsage);
    } else {
        fy_emu_report("%s on rank %d: rank %d is gone (its process ended, or it aborted or "
                      "failed its communicator)", c->what, c->a->rank, who);
        *ret = hang(c, ncclRemoteError);
    }
    return false;
}

/* True if every rank posted this rank's call; else reports the first that did not. */
static bool calls_agree(coll *c) {
    const fy_nccl_call *mine = &c->a->call;
    for (int q = 0; q < c->s->nranks; q++) {
        const fy_nccl_call *o = &fy_nccl_slot_of(c->s, q)->call;
        if (o->seq == mine->seq && o->kind == mine->kind && o->count == mine->count &&
            o->dtype == mine->dtype && o->op == mine->op && o->root == mine->root)
            continue;
        char theirs[160];
        describe(o, theirs, sizeof theirs);
        fy_emu_report("%s on rank %d does not match rank %d's %s: NCCL hangs or corrupts data "
                      "when ranks issue different collectives", c->what, c->a->rank, q, theirs);
        return false;
    }
    return true;
}

/* The root's sum of n elements of every rank's staging buffer, chunk byte offset 0, into
 * out: NCCL's ring order (the top of the file). */
static void sum_chunk(coll *c, void *out, size_t n) {
    const int nr = c->s->nranks, root = c->a->call.root;
    const size_t es = fy_nccl_dtype_size(c->a->call.dtype);
    memcpy(out, fy_nccl_stage(c->s, (root + 1) % nr), n * es);
    for (int j = 2; j <= nr; j++) {
        const void *in = fy_nccl_stage(c->s, (root + j) % nr);
        if (c->a->call.dtype == ncclFloat32) {
            float *o = (float *)out;
            const float *x = (const float *)in;
            for (size_t i = 0; i < n; i++) o[i] += x[i];
        } else { /* ncclBfloat16: nccl_emu.cc lets no other type through */
            uint16_t *o = (uint16_t *)out;
            const uint16_t *x = (const uint16_t *)in;
            for (size_t i = 0; i < n; i++)
                o[i] = fy_f32_to_bf16(fy_bf16_to_f32(o[i]) + fy_bf16_to_f32(x[i]));
        }
    }
}

/* False (after reporting) if [p, p + nbytes) is no longer device or pinned memory: freed,
 * or reallocated smaller, between the call and the collective's turn on its stream. */
static bool still_device(coll *c, const void *p, size_t nbytes, const char *name) {
    fy_emu_mem k = fy_emu_mem_of(p, nbytes);
    if (k == FY_EMU_DEVICE || k == FY_EMU_PINNED) return true;
    fy_emu_report("%s on rank %d: its %s [%p, +%zu) is not device memory when the collective "
                  "runs (freed before it?)", c->what, c->a->rank, name, p, nbytes);
    return false;
}

static cudaError_t run(coll *c) {
    const fy_nccl_call *call = &c->a->call;
    const int self = c->a->rank, root = call->root;
    const bool reduce = call->kind == FY_NCCL_REDUCE;
    const size_t es = fy_nccl_dtype_size(call->dtype), nbytes = call->count * es;
    const char *send = (const char *)c->a->sendbuff;
    char *recv = (char *)c->a->recvbuff;
    /* this rank's earlier collectives first (they may be queued on other streams) */
    for (;;) {
        uint32_t seen = __atomic_load_n(&c->s->bell, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&c->me->done, __ATOMIC_SEQ_CST) + 1 >= call->seq) break;
        if (__atomic_load_n(&c->me->state, __ATOMIC_SEQ_CST) > FY_NCCL_IN) return cudaSuccess;
        fy_nccl_sleep(c->s, seen, 1.0);
    }
    if (__atomic_load_n(&c->me->state, __ATOMIC_SEQ_CST) > FY_NCCL_IN) return cudaSuccess;
    const bool sends = reduce || self == root, receives = !reduce || self == root;
    if ((sends && !still_device(c, send, nbytes, "sendbuff")) ||
        (receives && !still_device(c, recv, nbytes, "recvbuff"))) {
        int none = ncclSuccess;
        __atomic_compare_exchange_n(&c->me->err, &none, (int)ncclUnhandledCudaError, false,
                                    __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
        __atomic_store_n(&c->me->state, (int32_t)FY_NCCL_FAILED, __ATOMIC_SEQ_CST);
        fy_nccl_ring(c->s);
        return cudaErrorIllegalAddress;
    }
    c->me->call = *call;
    cudaError_t ret = cudaSuccess;
    if (!barrier(c, &ret)) return ret;
    if (!calls_agree(c)) return hang(c, ncclInvalidUsage);
    char *mine = fy_nccl_stage(c->s, self), *roots = fy_nccl_stage(c->s, root);
    for (size_t off = 0; off < nbytes; off += FY_NCCL_STAGE_NBYTES) {
        const size_t k = nbytes - off < FY_NCCL_STAGE_NBYTES ? nbytes - off : FY_NCCL_STAGE_NBYTES;
        if (reduce) memcpy(mine, send + off, k);
        else if (self == root) memcpy(roots, send + off, k);
        if (!barrier(c, &ret)) return ret;
        if (reduce && self == root) sum_chunk(c, recv + off, k / es);
        else if (!reduce && (self != root || send != recv)) memcpy(recv + off, roots, k);
        if (!barrier(c, &ret)) return ret;
    }
    __atomic_store_n(&c->me->done, call->seq, __ATOMIC_SEQ_CST);
    fy_nccl_ring(c->s);
    return cudaSuccess;
}

static cudaError_t collective(const fy_nccl_args *a) {
    dev_map *m;
    {
        std::lock_guard<std::mutex> g(maps_mu);
        m = find_map(a->name);
        if (!m) {
            fy_emu_report("%s on rank %d: a communicator this device never joined",
                          kind_name(a->kind), a->rank);
            return cudaErrorLaunchFailure;
        }
        /* a communicator already aborted: NCCL drops the work it had queued */
        if (m->left) return cudaSuccess;
        m->users++;
    }
    coll c = {m->seg, a, fy_nccl_slot_of(m->seg, a->rank), {0}};
    describe(&a->call, c.what, sizeof c.what);
    cudaError_t ret = run(&c);
    std::lock_guard<std::mutex> g(maps_mu);
    m->users--;
    unmap_if_unused(m);
    return ret;
}

extern "C" cudaError_t fy_emu_nccl_dev(void *args) {
    const fy_nccl_args *a = (const fy_nccl_args *)args;
    switch (a->kind) {
    case FY_NCCL_JOIN: return join(a);
    case FY_NCCL_LEAVE: return leave(a);
    case FY_NCCL_PROBE: return cudaSuccess;
    default: return collective(a);
    }
}
