/* cuda_backend.c — the cuda backend's memory, streams, events and copies.
 *
 * Memory: device memory comes from cudaMalloc and is zeroed before it is handed out
 * (the layers above assume zeroed allocations, as the cpu backend gives them); running
 * out is FY_ERR_DEVICE_OOM and leaves the process and the device usable. Pinned memory
 * is cudaHostAlloc'd (portable) and zeroed, host memory is the cpu backend's mapping.
 * With no --gpu-mem the budget is the free memory at open minus FY_CU_RESERVE_NBYTES
 * for what the budget does not count: cuBLASLt's and the reductions' per-stream
 * workspace (FY_CU_BLAS_WS_NBYTES + FY_CU_PART_NBYTES each) and allocator rounding.
 *
 * Streams are CUDA streams that do not synchronise with the legacy default stream;
 * each has its workspace from creation, so a kernel launch never allocates. Events are
 * CUDA events, with timing only when asked for (fy_event_new_timed). Kernels are
 * launched at once from the calling thread;
 * every call is checked, and a failure aborts naming what failed (a launch error or a
 * sticky device error is a bug, not a condition to recover from).
 *
 * Threads: CUDA's current device is per thread, so every entry point first makes this
 * device current on the calling thread (a thread-local cache makes that free). */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

#define FY_CU_RESERVE_NBYTES ((size_t)768 << 20)

void fy_cuda_fail(cudaError_t err, const char *what, const char *file, int line) {
    char hint[320];
    snprintf(hint, sizeof hint, "cuda: %s: %s (%s)", what, cudaGetErrorString(err), cudaGetErrorName(err));
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
    cudaError_t e = cudaMalloc(out, nbytes);
    if (e == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError(); /* not sticky: clear it and report */
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
    if (kind == FY_MEM_HOST) fy_host_unmap(ptr, nbytes);
    else if (kind == FY_MEM_PINNED) FY_CUDA_CHECK(cudaFreeHost(ptr), "cudaFreeHost");
    else FY_CUDA_CHECK(cudaFree(ptr), "cudaFree");
}

/* ---- streams --------------------------------------------------------------------- */

static void stream_release(fy_cu_stream *cs) {
    fy_cu_gemm_stream_free(cs);
    if (cs->blas_ws) cudaFree(cs->blas_ws);
    if (cs->part) cudaFree(cs->part);
    if (cs->st) cudaStreamDestroy(cs->st);
    free(cs);
}

static fy_status cu_stream_new(fy_stream *s) {
    make_current(s->dev);
    fy_cu_stream *cs = calloc(1, sizeof *cs);
    if (!cs) return FY_ERR_NOMEM;
    cs->dev = s->dev;
    FY_CUDA_CHECK(cudaStreamCreateWithFlags(&cs->st, cudaStreamNonBlocking), "cudaStreamCreate");
    cudaError_t e = cudaMalloc(&cs->blas_ws, FY_CU_BLAS_WS_NBYTES);
    if (e == cudaSuccess) e = cudaMalloc((void **)&cs->part, FY_CU_PART_NBYTES);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        fy_log_error("device memory: no room for the workspace of stream %s (%zu MiB)", s->name,
                     (FY_CU_BLAS_WS_NBYTES + FY_CU_PART_NBYTES) >> 20);
        stream_release(cs);
        return FY_ERR_DEVICE_OOM;
    }
    fy_status st = fy_cu_gemm_stream_init(cs);
    if (st != FY_OK) { stream_release(cs); return st; }
    s->ctx = cs;
    return FY_OK;
}

static void cu_stream_sync(fy_stream *s) {
    fy_cu_stream *cs = s->ctx;
    char what[96];
    snprintf(what, sizeof what, "work queued on stream %s", s->name);
    FY_CUDA_CHECK(cudaStreamSynchronize(cs->st), what);
}

static void cu_stream_free(fy_stream *s) {
    make_current(s->dev);
    cu_stream_sync(s);
    stream_release(s->ctx);
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
            FY_CUDA_CHECK(cudaStreamSynchronize(cs->st), "work before a host-to-host copy");
            memmove(op->p[0], op->p[1], (size_t)op->i[0]);
            break;
        }
        FY_CUDA_CHECK(cudaMemcpyAsync(op->p[0], op->p[1], (size_t)op->i[0], cudaMemcpyDefault, cs->st),
                      "cudaMemcpyAsync");
        break;
    case FY_OP_MEMSET:
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
}

/* ---- events ---------------------------------------------------------------------- */

static fy_status cu_event_new(fy_event *e) {
    make_current(e->dev);
    cudaEvent_t ev;
    FY_CUDA_CHECK(cudaEventCreateWithFlags(&ev, e->timed ? cudaEventDefault : cudaEventDisableTiming),
                  "cudaEventCreate");
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
    FY_CUDA_CHECK(cudaEventSynchronize((cudaEvent_t)e->ctx), "work before an event");
}

static bool cu_event_done(fy_event *e) {
    make_current(e->dev);
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

static fy_status cu_coll_init(fy_dev *dev, const void *id, size_t len, int rank, int size) {
    make_current(dev);
    return fy_cu_nccl_init(dev->ctx, id, len, rank, size);
}

static void cu_coll_shards(fy_stream *s, void *buf, const size_t *off, int nranks, fy_dtype dt,
                           bool gather) {
    make_current(s->dev);
    fy_cu_nccl_shards(s->dev->ctx, s->ctx, buf, off, nranks, dt, gather);
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
    size_t free_b = 0, total_b = 0;
    FY_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
    char a[32], b[32], c[32];
    if (free_b <= FY_CU_RESERVE_NBYTES) {
        fy_log_error("--device cuda: GPU %d has only %s free, less than the %zu MiB this backend "
                     "keeps for its workspace", ord, fy_fmt_size(free_b, a, sizeof a),
                     FY_CU_RESERVE_NBYTES >> 20);
        return FY_ERR_DEVICE_OOM;
    }
    size_t usable = free_b - FY_CU_RESERVE_NBYTES;
    if (dev->cfg.mem_cap_nbytes == 0 || dev->cfg.mem_cap_nbytes > usable) {
        if (dev->cfg.mem_cap_nbytes)
            fy_log_warn("--gpu-mem %s is more than GPU %d can give (%s free, less %zu MiB of "
                        "workspace): using %s", fy_fmt_size(dev->cfg.mem_cap_nbytes, a, sizeof a),
                        ord, fy_fmt_size(free_b, b, sizeof b), FY_CU_RESERVE_NBYTES >> 20,
                        fy_fmt_size(usable, c, sizeof c));
        dev->mem.cap_nbytes = usable;
    }
    fy_cu_dev *cd = calloc(1, sizeof *cd);
    if (!cd) return FY_ERR_NOMEM;
    cd->ordinal = ord;
    cd->sm_count = gpus[ord].sm_count;
    cd->math = dev->cfg.matmul == FY_MATMUL_AUTO ? FY_MATMUL_BF16 : dev->cfg.matmul;
    FY_CUDA_CHECK(cudaStreamCreateWithFlags(&cd->zero_st, cudaStreamNonBlocking), "cudaStreamCreate");
    dev->iface = &cuda_iface;
    dev->ctx = cd;
    if (dev->cfg.sim_pcie_gbps > 0)
        fy_log_warn("--sim-pcie-gbps applies to the cpu backend only; the GPU's link is real");
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    dev->threads = dev->cfg.threads > 0 ? dev->cfg.threads : (int)(ncpu > 0 ? ncpu : 1);
    snprintf(dev->name, sizeof dev->name, "cuda:%d %s (sm_%d%d, %d SMs, budget %s, %s GEMMs)",
             ord, gpus[ord].name, gpus[ord].major, gpus[ord].minor, gpus[ord].sm_count,
             fy_fmt_size(dev->mem.cap_nbytes, b, sizeof b), fy_matmul_math_name(cd->math));
    return FY_OK;
}
