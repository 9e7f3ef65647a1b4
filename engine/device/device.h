/* device.h — the device interface every layer above computes through.
 *
 * A device has three kinds of memory (device, host-pinned, host), in-order streams,
 * events that order streams, asynchronous copies, host functions run in stream order,
 * and the kernels of kernels.h. Two backends implement it, chosen at run time:
 *
 *  - cpu: the reference and the test bed. Device memory is host memory under a capacity
 *    cap, so offload logic is exercised for real; each stream is a worker thread that
 *    runs its queue in order; copies between host and device memory can be throttled to
 *    a bandwidth (emulated PCIe) so overlap is real and measurable on a CPU-only machine.
 *  - cuda: streams and events are CUDA's; GEMMs go through cuBLASLt, the other kernels are
 *    hand-written (cuda/). Compiled wherever nvcc exists, run where a GPU does.
 *
 * Memory: every allocation of kind FY_MEM_DEVICE counts against the device's capacity
 * (cfg.mem_cap_nbytes); exceeding it is FY_ERR_DEVICE_OOM with one logged line saying
 * what did not fit and by how much, never an abort. Big buffers are pre-touched (and
 * zeroed) at allocation, so first use pays no page faults.
 *
 * Threads: a fy_dev may be used from any thread for allocation and stream creation.
 * A stream must be fed (kernels, copies, records) from one thread at a time. Pointers
 * handed to stream work must stay valid until the work completes (sync or an event).
 *
 * This header is plain C and never mentions CUDA types. */
#ifndef FY_DEVICE_H
#define FY_DEVICE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/core/dtype.h"
#include "engine/core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum fy_dev_kind { FY_DEV_CPU = 0, FY_DEV_CUDA } fy_dev_kind;

typedef enum fy_mem_kind {
    FY_MEM_DEVICE = 0, /* counted against the device capacity */
    FY_MEM_PINNED,     /* host memory the device can copy from at full speed */
    FY_MEM_HOST,       /* ordinary host memory */
} fy_mem_kind;

typedef enum fy_copy_dir { FY_H2D = 0, FY_D2H, FY_D2D, FY_H2H } fy_copy_dir;

/* How fp32 GEMMs compute on the cuda backend (bf16 tensors always use bf16 tensor cores
 * with fp32 accumulation). The cpu backend computes in fp32 only. */
typedef enum fy_matmul_math {
    FY_MATMUL_AUTO = 0, /* cuda: BF16; cpu: FP32 */
    FY_MATMUL_FP32,     /* exact fp32 products */
    FY_MATMUL_TF32,     /* tf32 tensor cores, fp32 accumulation */
    FY_MATMUL_BF16,     /* inputs rounded to bf16 on tensor cores, fp32 accumulation */
} fy_matmul_math;

typedef struct fy_dev_cfg {
    fy_dev_kind kind;
    size_t mem_cap_nbytes; /* device memory capacity; 0 = the backend's own (cpu: no cap) */
    double sim_pcie_gbps;  /* cpu: throttle H2D/D2H copies to this many GB/s; 0 = off */
    double sim_slowdown;   /* cpu: kernels take this many times their time (a slower
                              device, for unlike ranks of a job); 0 or 1 = off */
    int threads;           /* cpu: kernel threads; 0 = all online cores */
    int ordinal;           /* cuda: which GPU */
    fy_matmul_math matmul; /* cuda: fp32 GEMM arithmetic */
    size_t pinned_cap_nbytes; /* page-locked host memory a run may take; 0 = the default,
                                 half the machine's memory (fy_dev_pinned_cap) */
} fy_dev_cfg;

typedef struct fy_dev fy_dev;
typedef struct fy_stream fy_stream;
typedef struct fy_event fy_event;

/* Opens a device. FY_ERR_UNSUPPORTED (logged) if the backend is not compiled in or no
 * such device exists. */
fy_status fy_dev_new(const fy_dev_cfg *cfg, fy_dev **out);
void fy_dev_free(fy_dev *dev); /* frees all remaining allocations, streams must be freed */

fy_dev_kind fy_dev_get_kind(const fy_dev *dev);
/* The pinned-memory cap of a device configuration: its own, or half the physical memory
 * (pinned pages cannot be swapped or moved; pinning most of a machine starves it). */
size_t fy_dev_cfg_pinned_cap(const fy_dev_cfg *cfg);
size_t fy_dev_pinned_cap(const fy_dev *dev);
const char *fy_dev_name(const fy_dev *dev);
int fy_dev_threads(const fy_dev *dev);

/* Allocates nbytes (zeroed, pre-touched, 64-byte aligned at least) of the given kind.
 * `what` names the buffer in error messages ("layer 3 parameters"). */
fy_status fy_dev_alloc(fy_dev *dev, fy_mem_kind kind, size_t nbytes, const char *what,
                       void **out);
/* Frees an allocation made by fy_dev_alloc; NULL is a no-op. */
void fy_dev_release(fy_dev *dev, void *ptr);

typedef struct fy_dev_mem_stats {
    size_t cap_nbytes;       /* device capacity (0 = unlimited) */
    size_t used_nbytes[3];   /* by fy_mem_kind, now */
    size_t peak_nbytes[3];   /* by fy_mem_kind, high-water mark */
} fy_dev_mem_stats;
void fy_dev_mem_stats_get(const fy_dev *dev, fy_dev_mem_stats *out);
void fy_dev_mem_reset_peak(fy_dev *dev);

/* Streams: in-order queues of work. */
fy_status fy_stream_new(fy_dev *dev, const char *name, fy_stream **out);
void fy_stream_free(fy_stream *s); /* waits for queued work first; NULL is a no-op */
fy_dev *fy_stream_dev(const fy_stream *s);
/* Blocks until all work queued on s so far has completed. */
void fy_stream_sync(fy_stream *s);
/* The storage type of the tensors kernels on s read and write (kernels.h says which
 * arguments follow it): FY_F32 (the default) or FY_BF16 (both backends; the cpu backend
 * widens bf16 tensors to fp32 around its fp32 kernels). FY_ERR_UNSUPPORTED (logged) for
 * any other type. Set it before queueing work. */
fy_status fy_stream_set_dtype(fy_stream *s, fy_dtype t);

/* Collectives between the devices of a data-parallel job, where the backend has them (the
 * cuda backend: NCCL; the cpu backend: none, engine/comm sums host memory over MPI).
 * Rank 0 makes an id (at most FY_COLL_ID_BYTES), every rank joins with it, then
 * reduce-scatters and all-gathers run on streams, in the job's order of calls. */
#define FY_COLL_ID_BYTES 256
bool fy_dev_has_collectives(const fy_dev *dev);
fy_status fy_dev_coll_id(fy_dev *dev, void *id, size_t cap, size_t *len);
fy_status fy_dev_coll_init(fy_dev *dev, const void *id, size_t len, int rank, int size);
/* The sharded collectives (engine/comm/comm.h's, on device memory), queued on s: buf's
 * elements of dt (F32, BF16) cut at off[0..nranks]; reduce_scatter leaves this rank's
 * shard summed over the ranks (in the backend's order), allgather gives every shard its
 * owner's values. */
void fy_coll_reduce_scatter_async(fy_stream *s, void *buf, const size_t *off, int nranks, fy_dtype dt);
void fy_coll_allgather_async(fy_stream *s, void *buf, const size_t *off, int nranks, fy_dtype dt);
fy_dtype fy_stream_dtype(const fy_stream *s);

/* Events: record captures the work queued on s so far; wait makes later work on s
 * wait for it; sync blocks the caller. An event never recorded counts as complete.
 * As in CUDA, a wait (or sync) refers to the latest record submitted before it: a
 * record made afterwards does not hold it back. */
fy_status fy_event_new(fy_dev *dev, fy_event **out);
/* An event that also records when the device reached it (CUDA: a timing event). */
fy_status fy_event_new_timed(fy_dev *dev, fy_event **out);
/* Milliseconds from when the device reached `from`'s latest record to `to`'s; both
 * timed, recorded and complete (negative if `to` came first). */
double fy_event_elapsed_ms(fy_event *from, fy_event *to);
void fy_event_free(fy_event *e);
void fy_event_record(fy_event *e, fy_stream *s);
void fy_stream_wait_event(fy_stream *s, fy_event *e);
void fy_event_sync(fy_event *e);
bool fy_event_done(fy_event *e);

/* Copies nbytes from src to dst in stream order. dir says which memories are involved
 * (the cpu backend throttles H2D and D2H when sim_pcie_gbps is set). */
void fy_copy_async(fy_stream *s, void *dst, const void *src, size_t nbytes, fy_copy_dir dir);
void fy_memset_async(fy_stream *s, void *dst, int byte, size_t nbytes);
/* Runs fn(arg) on the host in stream order (after earlier work, before later work).
 * fn must not call the device interface (CUDA forbids API calls from stream callbacks)
 * and must not wait for other work queued on any stream of the device. */
void fy_stream_host_fn(fy_stream *s, void (*fn)(void *arg), void *arg);

/* Which backends this build has, for `ferry info`. */
bool fy_dev_kind_compiled(fy_dev_kind kind);
const char *fy_dev_kind_name(fy_dev_kind kind);
int fy_dev_parse_kind(const char *s, fy_dev_kind *out);
const char *fy_matmul_math_name(fy_matmul_math m);
int fy_matmul_math_parse(const char *s, fy_matmul_math *out); /* -1 if unknown */

typedef struct fy_gpu_info {
    char name[96];
    int major, minor;        /* compute capability */
    int sm_count;
    size_t total_nbytes;
} fy_gpu_info;

/* The GPUs the cuda backend can use: their number (0 when the backend is not compiled
 * in, or there is no driver or no GPU), the first `max` of them described in out, and
 * when there are none, why (one phrase) in why. Loads the CUDA driver but creates no
 * context; still, never call it in a process that forks afterwards to use CUDA. */
int fy_dev_gpus(fy_gpu_info *out, int max, char *why, size_t whylen);
/* The CUDA runtime version this build was compiled against ("13.0"), or "". */
const char *fy_dev_cuda_version(void);
/* Whether the cuda backend runs on the emulated CUDA runtime (-Dcuda=emulated: the CPU
 * plays the GPU, cuBLASLt and NCCL; for tests). */
bool fy_dev_cuda_emulated(void);

#ifdef __cplusplus
}
#endif
#endif
