/* cuda_impl.h — what the cuda backend's files share: the device and stream state, the
 * error check, and the entry points between cuda_backend.c (memory, streams, events,
 * copies), cuda_gemm.c (cuBLASLt, and the matmul ops built on it) and cuda_kernels.cu
 * (the hand-written kernels, attention's included). Included by those files only; it may
 * name CUDA types.
 *
 * Every kernel's tensors are in the stream's storage type (fy_stream_set_dtype): fp32
 * or bf16, always accumulated in fp32. Kernels never use atomics, so each result
 * depends on the inputs and shapes alone, never on timing or on where buffers live:
 * the offload invariance holds on this backend too. */
#ifndef FY_CUDA_IMPL_H
#define FY_CUDA_IMPL_H

#include <cuda_runtime_api.h>

#include "engine/device/device_impl.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Aborts with the file, line, what failed ("kernel layernorm_fwd", "cudaMemcpyAsync on
 * stream h2d") and CUDA's message, unless err is cudaSuccess. For bugs and sticky device
 * errors only: out-of-memory is a status (see cuda_backend.c). */
#define FY_CUDA_CHECK(err, what) \
    do { cudaError_t fy_e_ = (err); if (fy_e_ != cudaSuccess) fy_cuda_fail(fy_e_, (what), __FILE__, __LINE__); } while (0)
void fy_cuda_fail(cudaError_t err, const char *what, const char *file, int line);

/* Per stream workspace, allocated with the stream: cuBLASLt's workspace and the partial
 * sums of two-pass reductions. Outside the device budget: the backend's reserve holds
 * four streams' (FY_CU_RESERVE_NBYTES in cuda_backend.c), more come out of the budget. */
#define FY_CU_BLAS_WS_NBYTES ((size_t)32 << 20)
#define FY_CU_PART_NBYTES ((size_t)16 << 20)

typedef struct fy_cu_gemm_cache fy_cu_gemm_cache;

typedef struct fy_cu_stream {
    cudaStream_t st;
    fy_dev *dev;
    void *blas_ws;            /* FY_CU_BLAS_WS_NBYTES */
    float *part;              /* FY_CU_PART_NBYTES of reduction partials */
    void *lt;                 /* this stream's cublasLtHandle_t */
    fy_cu_gemm_cache *cache;  /* matmul descriptors and algorithms by shape */
} fy_cu_stream;

/* The device. The memory fields are cuda_backend.c's (its top says how the budget is
 * kept honest), guarded by the fy_dev's mutex. */
typedef struct fy_cu_dev {
    int ordinal;
    int sm_count;
    fy_matmul_math math;      /* resolved: never FY_MATMUL_AUTO */
    cudaStream_t zero_st;     /* zeroes fresh allocations */
    void *nccl;               /* the job's ncclComm_t (cuda_nccl.c), or NULL */
    int rank;                 /* this process's rank in the communicator, if any */
    size_t asked_nbytes;      /* --gpu-mem, or 0 */
    size_t limit_nbytes;      /* the most device memory ferry's allocations may hold */
    size_t pages_nbytes;      /* what its buffers hold, in whole pages */
    size_t nccl_nbytes;       /* what NCCL's communicator took */
    int nstreams;             /* streams, each holding its workspace */
} fy_cu_dev;

/* cuda_kernels.cu: the ops that are not GEMMs (encoder, the norms, attention, rope, gelu
 * and the GLUs, residual, cross-entropy, mean, sumsq, adamw). */
void fy_cu_exec_kernel(fy_cu_stream *cs, const fy_op *op);
/* dst (C) += column sums of x (N, C), tensors of type dt, in a fixed order. */
void fy_cu_colsum_acc(fy_cu_stream *cs, fy_dtype dt, void *dst, const void *x, int N, int C);
/* out (N, C) = bias broadcast over rows. */
void fy_cu_bias_fill(fy_cu_stream *cs, fy_dtype dt, void *out, const void *bias, int N, int C);
/* A library of the toolkit loaded with dlopen, from the toolkit's directory, else by its
 * soname on the library path; NULL, with "cannot load <what> (<soname>): <why>" in err, if
 * neither loads.
 * FY_CU_SYM then loads one of its functions into a table of pointers typed like them,
 * or says "<what> lacks <name>" in err and returns from the (void) loader. */
void *fy_cu_dlopen(const char *soname, const char *what, char *err, size_t cap);
#define FY_CU_SYM(h, table, f, what, err)                                                \
    if (!(*(void **)&(table).f = dlsym((h), #f))) {                                     \
        snprintf((err), sizeof(err), "%s lacks %s", (what), #f);                       \
        return;                                                                         \
    }

/* cuda_nccl.c: the job's collectives (NCCL, loaded with dlopen; a build without nccl.h
 * has none, and says so when a job asks for them). */
fy_status fy_cu_nccl_id(void *id, size_t cap, size_t *len);
fy_status fy_cu_nccl_init(fy_cu_dev *cd, const void *id, size_t len, int rank, int size);
void fy_cu_nccl_free(fy_cu_dev *cd);
/* Where cd has a communicator: if NCCL reports an asynchronous error (a peer died, the
 * network failed), aborts the communicator and ends the process with one error line
 * naming it, so the job ends instead of waiting forever. Cheap: called between polls. */
void fy_cu_nccl_poll(fy_cu_dev *cd);
void fy_cu_nccl_shards(fy_cu_dev *cd, fy_cu_stream *cs, void *buf, const size_t *off, int nranks,
                       fy_dtype dt, bool gather);

/* cuda_gemm.c: the GEMM ops (matmul) and the cuBLASLt library. */
void fy_cu_exec_gemm_op(fy_cu_stream *cs, const fy_op *op);
/* Loads cuBLASLt (dlopen, once per process). FY_ERR_UNSUPPORTED (logged) if missing. */
fy_status fy_cu_blas_load(void);
fy_status fy_cu_gemm_stream_init(fy_cu_stream *cs);
void fy_cu_gemm_stream_free(fy_cu_stream *cs);

#ifdef __cplusplus
}
#endif
#endif
