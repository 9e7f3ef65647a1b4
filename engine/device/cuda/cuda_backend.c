/* cuda_backend.c — the cuda backend's memory, streams, events and copies.
 *
 * Memory: device memory comes from cudaMalloc and is zeroed before it is handed out
 * (the layers above assume zeroed allocations, as the cpu backend gives them); running
 * out is FY_ERR_DEVICE_OOM and leaves the process and the device usable. Pinned memory
 * is cudaHostAlloc'd (portable) and zeroed, host memory is the cpu backend's mapping
 * (pageable: CUDA copies from and to it, but sets it only where the GPU can reach
 * pageable memory, so its memsets are done here, in stream order).
 * The budget is honest about what it does not count (the reserve below): with no
 * --gpu-mem it is the free memory at open, measured once the context and ferry's kernels
 * are loaded, less the reserve; NCCL's buffers are measured when the communicator is
 * made and taken out of it; and every cudaMalloc of the backend is counted in whole
 * pages against what ferry may hold, so its buffers never take the memory the libraries
 * still need (a kernel's first launch would fail then, under an unrelated name).
 *
 * Streams are CUDA streams that do not synchronise with the legacy default stream;
 * each has its workspace from creation, so a kernel launch never allocates. Events are
 * CUDA events with blocking waits, with timing only when asked for
 * (fy_event_new_timed). Kernels are launched at once from the calling thread; every call
 * is checked, and a failure aborts naming what failed (a launch error or a sticky device
 * error is a bug, not a condition to recover from). An error of earlier work surfaces
 * at a later call: FERRY_CUDA_SYNC=1 (read at open) makes every launch wait for its
 * stream, so the failing kernel is the one named. Where the device has a communicator,
 * waits poll NCCL's asynchronous errors, so a failure NCCL reports (a peer lost over the
 * network, a communicator's error) ends the job instead of hanging it; a peer that hangs
 * inside one node may not be reported by NCCL at all (its kernels spin), and a rank
 * that dies under mpirun ends the job through mpirun.
 *
 * Threads: CUDA's current device is per thread, so every entry point first makes this
 * device current on the calling thread (a thread-local cache makes that free). */
#include <ctype.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine/core/util.h"
#include "engine/device/cuda/cuda_impl.h"

/* The toolkit's directory first: its libraries are the ones this build was compiled and
 * tested against (an older one of the same major on the library path, from a distribution
 * or a Python wheel, may lack what the headers promised). Then the library path, for a
 * binary run where its toolkit is not installed. */
void *fy_cu_dlopen(const char *soname, const char *what, char *err, size_t cap) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", FY_CUDA_LIBDIR, soname);
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) h = dlopen(soname, RTLD_NOW | RTLD_LOCAL);
    if (!h) snprintf(err, cap, "cannot load %s (%s, neither from %s nor the library path): %s",
                     what, soname, FY_CUDA_LIBDIR, dlerror());
    return h;
}

/* ---- the reserve -------------------------------------------------------------------
 * Of the free memory at open, the budget leaves out:
 *   FY_CU_LIBS_NBYTES       never held by ferry's allocations: what the libraries take
 *                           after open — kernels loaded at their first launch (CUDA 12.2+
 *                           loads each lazily: ferry's are a few MiB, cuBLASLt's a few
 *                           MiB per algorithm it picks), cuBLASLt's handles, the driver's
 *                           own growth;
 *   FY_CU_ROUNDING_NBYTES   cudaMalloc maps whole 2 MiB pages while the budget counts the
 *                           bytes asked for: 160 buffers' rounding at the worst;
 *   FY_CU_STREAMS_RESERVED  streams' workspace: a trainer's compute, h2d, d2h and comm
 *                           streams (48 MiB each); more are taken out of the budget.
 * 768 MiB in all (the README's number). ferry's allocations (buffers in whole pages,
 * workspace, NCCL's buffers as measured) may hold the free memory at open less
 * FY_CU_LIBS_NBYTES, and are refused past it. */
#define FY_CU_PAGE_NBYTES ((size_t)2 << 20)
#define FY_CU_LIBS_NBYTES ((size_t)256 << 20)
#define FY_CU_ROUNDING_NBYTES ((size_t)320 << 20)
#define FY_CU_STREAM_WS_NBYTES (FY_CU_BLAS_WS_NBYTES + FY_CU_PART_NBYTES)
#define FY_CU_STREAMS_RESERVED 4
#define FY_CU_RESERVE_NBYTES \
    (FY_CU_LIBS_NBYTES + FY_CU_ROUNDING_NBYTES + FY_CU_STREAMS_RESERVED * FY_CU_STREAM_WS_NBYTES)
_Static_assert(FY_CU_STREAM_WS_NBYTES % FY_CU_PAGE_NBYTES == 0, "workspace in whole pages");

/* ---- errors -------------------------------------------------------------------------- */

/* The errors of work that ran on the device. They are sticky (every later call returns
 * them), so they name whatever call came next. */
static bool from_earlier_work(cudaError_t e) {
    switch (e) {
    case cudaErrorIllegalAddress: case cudaErrorLaunchFailure: case cudaErrorLaunchTimeout:
    case cudaErrorHardwareStackError: case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress: case cudaErrorInvalidAddressSpace: case cudaErrorInvalidPc:
    case cudaErrorAssert: case cudaErrorECCUncorrectable: case cudaErrorNvlinkUncorrectable:
    case cudaErrorContained: case cudaErrorTensorMemoryLeak:
        return true;
    default:
        return false;
    }
}

/* FERRY_CUDA_SYNC=1: every op waits for its stream (read and checked at a device's open,
 * read_sync_env; the environment is the process's, so one flag serves every device). */
static bool g_sync_each;

void fy_cuda_fail(cudaError_t err, const char *what, const char *file, int line) {
    char hint[512];
    snprintf(hint, sizeof hint, "cuda: %s: %s (%s)%s", what, cudaGetErrorString(err), cudaGetErrorName(err),
             from_earlier_work(err) && !g_sync_each
                 ? "; the failing work may be any queued before this call: FERRY_CUDA_SYNC=1 "
                   "waits after each launch and names the one that failed"
                 : "");
    fy_abort_at(file, line, "cudaSuccess", hint);
}

static _Thread_local int tl_current = -1;

static void make_current(const fy_dev *dev) {
    const fy_cu_dev *cd = dev->ctx;
    if (tl_current != cd->ordinal) {
        FY_CUDA_CHECK(cudaSetDevice(cd->ordinal), "cudaSetDevice");
        tl_current = cd->ordinal;
    }
}

static const char *why_none(cudaError_t e) {
    switch (e) {
    case cudaErrorNoDevice: return "no CUDA GPU found";
    case cudaErrorInsufficientDriver:
        return "no NVIDIA driver on this machine, or one too old for this build's CUDA runtime";
    default: return cudaGetErrorString(e);
    }
}

int fy_cuda_gpus(fy_gpu_info *out, int max, char *why, size_t whylen) {
    /* A runtime runs on drivers of its major version and later (CUDA's minor version
     * compatibility): 13.x needs a driver for 13.0 or newer. */
    const int need = CUDART_VERSION / 1000 * 1000;
    int drv = 0;
    if (cudaDriverGetVersion(&drv) == cudaSuccess && drv > 0 && drv < need) {
        snprintf(why, whylen, "the NVIDIA driver supports CUDA %d.%d, this build needs %d.0: "
                 "update the driver", drv / 1000, drv % 1000 / 10, need / 1000);
        return 0;
    }
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        (void)cudaGetLastError();
        snprintf(why, whylen, "%s", why_none(e == cudaSuccess ? cudaErrorNoDevice : e));
        return 0;
    }
    for (int i = 0; i < n && i < max; i++) {
        struct cudaDeviceProp p;
        FY_CUDA_CHECK(cudaGetDeviceProperties(&p, i), "cudaGetDeviceProperties");
        memset(&out[i], 0, sizeof out[i]);
        size_t len = strnlen(p.name, sizeof out[i].name - 1);
        memcpy(out[i].name, p.name, len);
        out[i].name[len] = 0;
        out[i].major = p.major;
        out[i].minor = p.minor;
        out[i].sm_count = p.multiProcessorCount;
        out[i].total_nbytes = p.totalGlobalMem;
    }
    if (whylen) why[0] = 0;
    return n;
}

/* ---- memory ---------------------------------------------------------------------- */

static size_t device_free(void) {
    size_t free_b = 0, total_b = 0;
    FY_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
    return free_b;
}

/* What ferry's allocations hold: buffers in whole pages, every stream's workspace, NCCL's
 * buffers. Under dev->mu. */
static size_t held(const fy_cu_dev *cd) {
    return cd->pages_nbytes + (size_t)cd->nstreams * FY_CU_STREAM_WS_NBYTES + cd->nccl_nbytes;
}

/* The budget: what ferry may hold less the rounding margin, the reserved streams'
 * workspace and what is held outside the budget's count (other streams' workspace,
 * NCCL's buffers); --gpu-mem if less. Under dev->mu. */
static void budget_set(fy_dev *dev) {
    const fy_cu_dev *cd = dev->ctx;
    const int extra = cd->nstreams > FY_CU_STREAMS_RESERVED ? cd->nstreams - FY_CU_STREAMS_RESERVED : 0;
    const size_t keep = FY_CU_ROUNDING_NBYTES + FY_CU_STREAMS_RESERVED * FY_CU_STREAM_WS_NBYTES +
                        (size_t)extra * FY_CU_STREAM_WS_NBYTES + cd->nccl_nbytes;
    size_t cap = cd->limit_nbytes > keep ? cd->limit_nbytes - keep : 0;
    if (cd->asked_nbytes && cd->asked_nbytes < cap) cap = cd->asked_nbytes;
    dev->mem.cap_nbytes = cap ? cap : 1; /* 0 would mean no cap */
}

/* Counts a new stream's workspace: false, counting nothing, past the limit. */
static bool take_workspace(fy_dev *dev) {
    fy_cu_dev *cd = dev->ctx;
    pthread_mutex_lock(&dev->mu);
    const bool fits = held(cd) + FY_CU_STREAM_WS_NBYTES <= cd->limit_nbytes;
    if (fits) {
        cd->nstreams++;
        budget_set(dev);
    }
    pthread_mutex_unlock(&dev->mu);
    return fits;
}

static void give_workspace(fy_dev *dev) {
    fy_cu_dev *cd = dev->ctx;
    pthread_mutex_lock(&dev->mu);
    cd->nstreams--;
    budget_set(dev);
    pthread_mutex_unlock(&dev->mu);
}

/* Counts a buffer of nbytes in whole pages: false, counting nothing and saying why, past
 * the limit (the rounding of many buffers outgrew the margin; the wrapper's error line
 * names the buffer). */
static bool take_pages(fy_dev *dev, size_t nbytes) {
    fy_cu_dev *cd = dev->ctx;
    const size_t cost = fy_round_up(nbytes, FY_CU_PAGE_NBYTES);
    pthread_mutex_lock(&dev->mu);
    /* the reserved streams not made yet keep their workspace's room */
    const int unmade = cd->nstreams < FY_CU_STREAMS_RESERVED ? FY_CU_STREAMS_RESERVED - cd->nstreams : 0;
    const bool fits = held(cd) + cost + (size_t)unmade * FY_CU_STREAM_WS_NBYTES <= cd->limit_nbytes;
    if (fits) cd->pages_nbytes += cost;
    /* the buffers' sizes, this one's included: the wrapper counted it already */
    const size_t pages = cd->pages_nbytes + (fits ? 0 : cost), used = dev->mem.used_nbytes[FY_MEM_DEVICE];
    pthread_mutex_unlock(&dev->mu);
    if (!fits) {
        char a[32], b[32];
        fy_log_warn("device memory: cudaMalloc's 2 MiB pages would make ferry's buffers hold "
                    "%s more than their sizes, past the %s margin the budget keeps for it "
                    "(offload more, or a smaller --gpu-mem)",
                    fy_fmt_size(pages > used ? pages - used : 0, a, sizeof a),
                    fy_fmt_size(FY_CU_ROUNDING_NBYTES, b, sizeof b));
    }
    return fits;
}

static void give_pages(fy_dev *dev, size_t nbytes) {
    fy_cu_dev *cd = dev->ctx;
    pthread_mutex_lock(&dev->mu);
    cd->pages_nbytes -= fy_round_up(nbytes, FY_CU_PAGE_NBYTES);
    pthread_mutex_unlock(&dev->mu);
}

/* Zeroes (and so touches) host memory with `threads` threads, 2 MiB at a time. */
static void zero_host(void *p, size_t nbytes, int threads) {
    const size_t piece = (size_t)2 << 20, npieces = (nbytes + piece - 1) / piece;
    #pragma omp parallel for schedule(static) num_threads(threads) if (npieces > 8)
    for (size_t i = 0; i < npieces; i++) {
        size_t off = i * piece;
        memset((char *)p + off, 0, nbytes - off < piece ? nbytes - off : piece);
    }
}

static fy_status cu_alloc(fy_dev *dev, fy_mem_kind kind, size_t nbytes, void **out) {
    fy_cu_dev *cd = dev->ctx;
    make_current(dev);
    *out = NULL;
    if (kind == FY_MEM_HOST) return fy_host_map(nbytes, dev->threads, out);
    if (kind == FY_MEM_PINNED) {
        cudaError_t e = cudaHostAlloc(out, nbytes, cudaHostAllocPortable);
        if (e != cudaSuccess) {
            (void)cudaGetLastError();
            *out = NULL;
            return FY_ERR_NOMEM;
        }
        zero_host(*out, nbytes, dev->threads);
        return FY_OK;
    }
    if (!take_pages(dev, nbytes)) return FY_ERR_DEVICE_OOM;
    cudaError_t e = cudaMalloc(out, nbytes);
    if (e == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError(); /* not sticky: clear it and report */
        give_pages(dev, nbytes);
        *out = NULL;
        return FY_ERR_DEVICE_OOM;
    }
    FY_CUDA_CHECK(e, "cudaMalloc");
    FY_CUDA_CHECK(cudaMemsetAsync(*out, 0, nbytes, cd->zero_st), "zeroing a new allocation");
    FY_CUDA_CHECK(cudaStreamSynchronize(cd->zero_st), "zeroing a new allocation");
    return FY_OK;
}

static void cu_release(fy_dev *dev, fy_mem_kind kind, void *ptr, size_t nbytes) {
    make_current(dev);
    if (kind == FY_MEM_HOST) {
        fy_host_unmap(ptr, nbytes);
    } else if (kind == FY_MEM_PINNED) {
        FY_CUDA_CHECK(cudaFreeHost(ptr), "cudaFreeHost");
    } else {
        FY_CUDA_CHECK(cudaFree(ptr), "cudaFree");
        give_pages(dev, nbytes);
    }
}

/* True for host memory CUDA neither allocated nor registered (FY_MEM_HOST's). */
static bool pageable(const void *p) {
    struct cudaPointerAttributes a;
    FY_CUDA_CHECK(cudaPointerGetAttributes(&a, p), "cudaPointerGetAttributes");
    return a.type == cudaMemoryTypeUnregistered;
}

/* ---- waits ----------------------------------------------------------------------------- */

/* Waits for stream st (or, st NULL, event ev) and returns how its work ended. A blocking
 * wait, but where the device has a communicator CUDA's wait could never return: a
 * collective whose peer died waits for it forever. There the wait queries, sleeping
 * 10 us, doubling to 200 us, between queries (a wait ends at most 200 us late, and a
 * sleeping thread leaves the cores to the CPU optimizer), and polls NCCL's errors. */
static cudaError_t wait_for(fy_cu_dev *cd, cudaStream_t st, cudaEvent_t ev) {
    if (!cd->nccl) return st ? cudaStreamSynchronize(st) : cudaEventSynchronize(ev);
    long ns = 10000;
    for (;;) {
        const cudaError_t r = st ? cudaStreamQuery(st) : cudaEventQuery(ev);
        if (r != cudaErrorNotReady) return r;
        fy_cu_nccl_poll(cd);
        struct timespec ts = {0, ns};
        nanosleep(&ts, NULL);
        if (ns < 200000) ns = ns * 2 < 200000 ? ns * 2 : 200000;
    }
}

/* ---- streams --------------------------------------------------------------------- */

/* Frees what cu_stream_new made, after it counted the workspace. */
static void stream_release(fy_cu_stream *cs) {
    fy_cu_gemm_stream_free(cs);
    if (cs->blas_ws) cudaFree(cs->blas_ws);
    if (cs->part) cudaFree(cs->part);
    if (cs->st) cudaStreamDestroy(cs->st);
    give_workspace(cs->dev);
    free(cs);
}

static fy_status no_room(const fy_stream *s) {
    fy_log_error("device memory: no room for the workspace of stream %s (%zu MiB)", s->name,
                 FY_CU_STREAM_WS_NBYTES >> 20);
    return FY_ERR_DEVICE_OOM;
}

static fy_status cu_stream_new(fy_stream *s) {
    make_current(s->dev);
    fy_cu_stream *cs = calloc(1, sizeof *cs);
    if (!cs) return FY_ERR_NOMEM;
    cs->dev = s->dev;
    if (!take_workspace(s->dev)) {
        free(cs);
        return no_room(s);
    }
    FY_CUDA_CHECK(cudaStreamCreateWithFlags(&cs->st, cudaStreamNonBlocking), "cudaStreamCreate");
    cudaError_t e = cudaMalloc(&cs->blas_ws, FY_CU_BLAS_WS_NBYTES);
    if (e == cudaSuccess) e = cudaMalloc((void **)&cs->part, FY_CU_PART_NBYTES);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        stream_release(cs);
        return no_room(s);
    }
    fy_status st = fy_cu_gemm_stream_init(cs);
    if (st != FY_OK) { stream_release(cs); return st; }
    s->ctx = cs;
    return FY_OK;
}

static void cu_stream_sync(fy_stream *s) {
    fy_cu_stream *cs = s->ctx;
    make_current(s->dev);
    char what[96];
    snprintf(what, sizeof what, "work queued on stream %s", s->name);
    FY_CUDA_CHECK(wait_for(s->dev->ctx, cs->st, NULL), what);
}

static void cu_stream_free(fy_stream *s) {
    cu_stream_sync(s);
    stream_release(s->ctx);
}

/* FERRY_CUDA_SYNC=1: waits for the work just queued on s, naming it (`what`, then "on
 * stream <name>") if its stream failed. */
static void check_queued(fy_stream *s, const char *what) {
    char full[128];
    snprintf(full, sizeof full, "%s on stream %s", what, s->name);
    FY_CUDA_CHECK(wait_for(s->dev->ctx, ((fy_cu_stream *)s->ctx)->st, NULL), full);
}

/* check_queued for an op: "kernel layernorm_fwd", "operation copy". */
static void check_op(fy_stream *s, const fy_op *op) {
    char name[32], what[64];
    const char *n = fy_op_name(op->kind);
    size_t k = 0;
    for (; n[k] && k < sizeof name - 1; k++) name[k] = (char)tolower((unsigned char)n[k]);
    name[k] = 0;
    snprintf(what, sizeof what, "%s %s", op->kind < FY_OP_KERNELS ? "kernel" : "operation", name);
    check_queued(s, what);
}

static void cu_launch(fy_stream *s, const fy_op *op) {
    fy_cu_stream *cs = s->ctx;
    make_current(s->dev);
    switch (op->kind) {
    case FY_OP_COPY:
        if (op->i[1] == FY_H2H) {
            /* CUDA does not promise that a host-to-host cudaMemcpyAsync waits for the
             * stream's earlier work: drain it, then copy here (later work is queued after
             * this returns, so stream order holds) */
            FY_CUDA_CHECK(wait_for(s->dev->ctx, cs->st, NULL), "work before a host-to-host copy");
            memmove(op->p[0], op->p[1], (size_t)op->i[0]);
            break;
        }
        FY_CUDA_CHECK(cudaMemcpyAsync(op->p[0], op->p[1], (size_t)op->i[0], cudaMemcpyDefault, cs->st),
                      "cudaMemcpyAsync");
        break;
    case FY_OP_MEMSET:
        if (pageable(op->p[0])) {
            /* cudaMemsetAsync sets device and pinned memory; pageable memory only where the
             * GPU reaches it (HMM or ATS), which few machines have: set it here, in stream
             * order as the host-to-host copy above */
            FY_CUDA_CHECK(wait_for(s->dev->ctx, cs->st, NULL), "work before a host memset");
            memset(op->p[0], (int)op->i[1], (size_t)op->i[0]);
            break;
        }
        FY_CUDA_CHECK(cudaMemsetAsync(op->p[0], (int)op->i[1], (size_t)op->i[0], cs->st), "cudaMemsetAsync");
        break;
    case FY_OP_HOST_FN: {
        void (*fn)(void *);
        memcpy(&fn, &op->p[0], sizeof fn);
        FY_CUDA_CHECK(cudaLaunchHostFunc(cs->st, fn, op->p[1]), "cudaLaunchHostFunc");
        break;
    }
    case FY_OP_MATMUL_FWD: case FY_OP_MATMUL_BWD: case FY_OP_MATMUL_BWD_DX32:
        fy_cu_exec_gemm_op(cs, op);
        break;
    default:
        fy_cu_exec_kernel(cs, op);
    }
    if (g_sync_each) check_op(s, op);
}

/* ---- events ---------------------------------------------------------------------- */

static fy_status cu_event_new(fy_event *e) {
    make_current(e->dev);
    cudaEvent_t ev;
    /* a waiting thread sleeps (an event's wait spins unless asked not to): the lanes
     * wait on events while the CPU optimizer wants every core */
    const unsigned flags = cudaEventBlockingSync | (e->timed ? 0 : cudaEventDisableTiming);
    FY_CUDA_CHECK(cudaEventCreateWithFlags(&ev, flags), "cudaEventCreate");
    e->ctx = ev;
    return FY_OK;
}

static void cu_event_free(fy_event *e) {
    make_current(e->dev);
    FY_CUDA_CHECK(cudaEventDestroy((cudaEvent_t)e->ctx), "cudaEventDestroy");
}

static void cu_event_record(fy_event *e, fy_stream *s) {
    make_current(s->dev);
    FY_CUDA_CHECK(cudaEventRecord((cudaEvent_t)e->ctx, ((fy_cu_stream *)s->ctx)->st), "cudaEventRecord");
}

static void cu_stream_wait_event(fy_stream *s, fy_event *e) {
    make_current(s->dev);
    FY_CUDA_CHECK(cudaStreamWaitEvent(((fy_cu_stream *)s->ctx)->st, (cudaEvent_t)e->ctx, 0),
                  "cudaStreamWaitEvent");
}

static void cu_event_sync(fy_event *e) {
    make_current(e->dev);
    FY_CUDA_CHECK(wait_for(e->dev->ctx, NULL, (cudaEvent_t)e->ctx), "work before an event");
}

static bool cu_event_done(fy_event *e) {
    fy_cu_dev *cd = e->dev->ctx;
    make_current(e->dev);
    if (cd->nccl) fy_cu_nccl_poll(cd); /* callers poll this in their own wait loops */
    cudaError_t r = cudaEventQuery((cudaEvent_t)e->ctx);
    if (r == cudaErrorNotReady) return false;
    FY_CUDA_CHECK(r, "work before an event");
    return true;
}

static double cu_event_elapsed_ms(fy_event *from, fy_event *to) {
    make_current(from->dev);
    float ms = 0.0f;
    FY_CUDA_CHECK(cudaEventElapsedTime(&ms, (cudaEvent_t)from->ctx, (cudaEvent_t)to->ctx),
                  "cudaEventElapsedTime");
    return ms;
}

static void cu_free(fy_dev *dev) {
    fy_cu_dev *cd = dev->ctx;
    make_current(dev);
    fy_cu_nccl_free(cd);
    if (cd->zero_st) cudaStreamDestroy(cd->zero_st);
    free(cd);
}

/* ---- collectives (cuda_nccl.c) ------------------------------------------------------ */

static fy_status cu_coll_id(fy_dev *dev, void *id, size_t cap, size_t *len) {
    make_current(dev);
    return fy_cu_nccl_id(id, cap, len);
}

/* NCCL's buffers are device memory the budget did not count: measured around the
 * communicator's creation (nothing else allocates then: a trainer attaches it before its
 * buffers) and taken out of the budget. */
static fy_status cu_coll_init(fy_dev *dev, const void *id, size_t len, int rank, int size) {
    fy_cu_dev *cd = dev->ctx;
    make_current(dev);
    const size_t before = device_free();
    FY_TRY(fy_cu_nccl_init(cd, id, len, rank, size));
    const size_t after = device_free();
    pthread_mutex_lock(&dev->mu);
    cd->nccl_nbytes = before > after ? before - after : 0;
    const bool fits = held(cd) <= cd->limit_nbytes;
    budget_set(dev);
    const size_t cap = dev->mem.cap_nbytes, used = dev->mem.used_nbytes[FY_MEM_DEVICE];
    pthread_mutex_unlock(&dev->mu);
    char a[32], b[32], c[32];
    fy_fmt_size(cd->nccl_nbytes, a, sizeof a);
    fy_fmt_size(cap, b, sizeof b);
    if (!fits) {
        fy_log_error("device memory: NCCL's buffers take %s of GPU %d, more than it had left "
                     "beside ferry's buffers and workspace", a, cd->ordinal);
        return FY_ERR_DEVICE_OOM;
    }
    if (used > cap) {
        fy_log_error("device memory: NCCL's buffers take %s of GPU %d, which leaves a budget of "
                     "%s, less than the %s already allocated", a, cd->ordinal, b,
                     fy_fmt_size(used, c, sizeof c));
        return FY_ERR_DEVICE_OOM;
    }
    fy_log_info("cuda: NCCL's buffers take %s of GPU %d; the budget is now %s", a, cd->ordinal, b);
    return FY_OK;
}

static void cu_coll_shards(fy_stream *s, void *buf, const size_t *off, int nranks, fy_dtype dt,
                           bool gather) {
    make_current(s->dev);
    fy_cu_nccl_shards(s->dev->ctx, s->ctx, buf, off, nranks, dt, gather);
    if (g_sync_each) check_queued(s, gather ? "NCCL gather" : "NCCL reduce");
}

static const fy_dev_iface cuda_iface = {
    .name = "cuda",
    .dtypes = 1u << FY_F32 | 1u << FY_BF16,
    .free = cu_free,
    .alloc = cu_alloc,
    .release = cu_release,
    .stream_new = cu_stream_new,
    .stream_free = cu_stream_free,
    .stream_sync = cu_stream_sync,
    .launch = cu_launch,
    .event_new = cu_event_new,
    .event_free = cu_event_free,
    .event_record = cu_event_record,
    .stream_wait_event = cu_stream_wait_event,
    .event_sync = cu_event_sync,
    .event_done = cu_event_done,
    .event_elapsed_ms = cu_event_elapsed_ms,
    .coll_id = cu_coll_id,
    .coll_init = cu_coll_init,
    .coll_shards = cu_coll_shards,
};

/* FERRY_CUDA_SYNC: unset or 0, or 1 to wait after every launch (g_sync_each). */
static fy_status read_sync_env(void) {
    const char *v = getenv("FERRY_CUDA_SYNC");
    g_sync_each = v && !strcmp(v, "1");
    if (v && *v && strcmp(v, "0") && strcmp(v, "1")) {
        fy_log_error("FERRY_CUDA_SYNC=%s: 1 waits after every launch and names a failing "
                     "kernel, 0 (or unset) does not", v);
        return FY_ERR_INVALID;
    }
    return FY_OK;
}

/* Makes what takes device memory at the first launch exist before the budget is measured:
 * an empty kernel of ferry's (a bias fill of no rows) loads its module, and the first
 * launch sets up the context's launch resources. */
static void warm_up(fy_cu_dev *cd) {
    fy_cu_stream cs;
    memset(&cs, 0, sizeof cs);
    cs.st = cd->zero_st;
    fy_cu_bias_fill(&cs, FY_F32, NULL, NULL, 0, 0);
    FY_CUDA_CHECK(cudaStreamSynchronize(cd->zero_st), "kernel warm-up");
}

fy_status fy_cuda_dev_init(fy_dev *dev) {
    fy_gpu_info gpus[16];
    char why[160];
    int n = fy_cuda_gpus(gpus, 16, why, sizeof why);
    if (n == 0) {
        fy_log_error("--device cuda: %s", why);
        return FY_ERR_UNSUPPORTED;
    }
    int ord = dev->cfg.ordinal;
    if (ord < 0 || ord >= n || ord >= 16) {
        fy_log_error("--device cuda: GPU %d does not exist (this machine has %d)", ord, n);
        return FY_ERR_UNSUPPORTED;
    }
    FY_TRY(read_sync_env());
    FY_TRY(fy_cu_blas_load());
    /* Waiting threads sleep instead of spinning: the scheduler's lanes wait on streams
     * while the CPU optimizer wants every core. A failure costs only spinning. */
    FY_CUDA_CHECK(cudaSetDevice(ord), "cudaSetDevice");
    tl_current = ord;
    cudaError_t fe = cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync);
    if (fe != cudaSuccess) {
        (void)cudaGetLastError();
        fy_log_warn("cuda: cannot make waits block (%s); waiting threads will spin",
                    cudaGetErrorString(fe));
    }
    fy_cu_dev *cd = calloc(1, sizeof *cd);
    if (!cd) return FY_ERR_NOMEM;
    cd->ordinal = ord;
    cd->sm_count = gpus[ord].sm_count;
    cd->math = dev->cfg.matmul == FY_MATMUL_AUTO ? FY_MATMUL_BF16 : dev->cfg.matmul;
    FY_CUDA_CHECK(cudaStreamCreateWithFlags(&cd->zero_st, cudaStreamNonBlocking), "cudaStreamCreate");
    warm_up(cd);
    const size_t free_b = device_free();
    char a[32], b[32], c[32];
    if (free_b <= FY_CU_RESERVE_NBYTES) {
        fy_log_error("--device cuda: GPU %d has only %s free, less than the %zu MiB this backend "
                     "keeps for its workspace and the libraries", ord, fy_fmt_size(free_b, a, sizeof a),
                     FY_CU_RESERVE_NBYTES >> 20);
        cudaStreamDestroy(cd->zero_st);
        free(cd);
        return FY_ERR_DEVICE_OOM;
    }
    cd->limit_nbytes = free_b - FY_CU_LIBS_NBYTES;
    cd->asked_nbytes = dev->cfg.mem_cap_nbytes;
    dev->iface = &cuda_iface;
    dev->ctx = cd;
    budget_set(dev); /* no other thread has the device yet */
    if (cd->asked_nbytes > dev->mem.cap_nbytes)
        fy_log_warn("--gpu-mem %s is more than GPU %d can give (%s free, less %zu MiB kept for "
                    "workspace and the libraries): using %s", fy_fmt_size(cd->asked_nbytes, a, sizeof a),
                    ord, fy_fmt_size(free_b, b, sizeof b), FY_CU_RESERVE_NBYTES >> 20,
                    fy_fmt_size(dev->mem.cap_nbytes, c, sizeof c));
    if (dev->cfg.sim_pcie_gbps > 0)
        fy_log_warn("--sim-pcie-gbps applies to the cpu backend only; the GPU's link is real");
    if (g_sync_each)
        fy_log_warn("FERRY_CUDA_SYNC=1: every launch waits for its stream (slow; for finding "
                    "a failing kernel)");
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    dev->threads = dev->cfg.threads > 0 ? dev->cfg.threads : (int)(ncpu > 0 ? ncpu : 1);
    snprintf(dev->name, sizeof dev->name, "cuda:%d %s (sm_%d%d, %d SMs, budget %s, %s GEMMs)",
             ord, gpus[ord].name, gpus[ord].major, gpus[ord].minor, gpus[ord].sm_count,
             fy_fmt_size(dev->mem.cap_nbytes, b, sizeof b), fy_matmul_math_name(cd->math));
    return FY_OK;
}
