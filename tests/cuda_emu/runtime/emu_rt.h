/* emu_rt.h — the inside of the emulated CUDA runtime (a -Dcuda=emulated build), shared by
 * its three parts:
 *   libfy_cudart_emu.so  the CUDA runtime's subset ferry calls (cudart_emu.cc), and the
 *                        emulated device: a process of its own, forked at the first runtime
 *                        call, where device memory is mapped and pinned memory is shared;
 *                        the host process has nothing mapped at device addresses;
 *   libcublasLt.so.13    cuBLASLt's subset (cublaslt_emu.cc), loaded by cuda_gemm.c with
 *                        dlopen as the real one is;
 *   libnccl.so.2         NCCL's subset (nccl_emu.cc), loaded by cuda_nccl.c likewise.
 * The two libraries are loaded after the device process started, so none of their code is
 * mapped there: what they run on the device (the reference GEMM, the collectives' device
 * half) lives in libfy_cudart_emu.so (gemm_ref.cc, nccl_dev.cc), which both processes map.
 *
 * Included by C and C++; it names the toolkit's own types (cuda_runtime_api.h), so the
 * emulation's codes and structures are CUDA's. */
#ifndef FY_EMU_RT_H
#define FY_EMU_RT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- work on the device ------------------------------------------------------------ */

/* A function the device runs: in the device's process, in stream order, on its own copy
 * of the arguments. It returns cudaSuccess or the error the work met, which becomes the
 * stream's error (cudaErrorIllegalAddress and cudaErrorLaunchFailure are sticky: every
 * later call of the process returns them, as CUDA's do). fn must live in
 * libfy_cudart_emu.so or the ferry binary (see the top). */
typedef cudaError_t (*fy_emu_dev_fn)(void *args);
#define FY_EMU_ARGS_MAX 2048

/* Queues fn on stream s (NULL: the legacy default stream) with a copy of args[0, nbytes);
 * `what` names the work in errors ("cublasLtMatmul", "ncclReduce"). Returns at once; the
 * error of an earlier call (sticky) or cudaErrorInvalidResourceHandle for a destroyed or
 * unknown stream. */
cudaError_t fy_emu_enqueue(cudaStream_t s, fy_emu_dev_fn fn, const void *args, size_t nbytes,
                           const char *what);

/* ---- memory ----------------------------------------------------------------------- */

typedef enum fy_emu_mem {
    FY_EMU_PAGEABLE, /* host memory the runtime did not allocate */
    FY_EMU_PINNED,   /* inside one live cudaHostAlloc/cudaMallocHost allocation */
    FY_EMU_DEVICE,   /* inside one live cudaMalloc allocation */
    FY_EMU_INVALID,  /* in the device's or the pinned arena's range, but not wholly inside
                        one live allocation (freed, out of bounds, straddling two) */
} fy_emu_mem;

/* Where [p, p + nbytes) lies. Callable from both processes. */
fy_emu_mem fy_emu_mem_of(const void *p, size_t nbytes);

/* Device memory the libraries take for themselves (a cuBLASLt handle's, NCCL's buffers),
 * counted as cudaMemGetInfo counts it: cudaErrorMemoryAllocation if it does not fit. */
cudaError_t fy_emu_take(size_t nbytes);
void fy_emu_give(size_t nbytes);

/* ---- errors ------------------------------------------------------------------------ */

/* One line on stderr, "cuda emulation: <message>", for a misuse the emulation caught
 * (the call then returns CUDA's error for it, or the stream fails). */
void fy_emu_report(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* True in the emulated device's process (the functions of fy_emu_enqueue run there). */
bool fy_emu_on_device(void);

#ifdef __cplusplus
}
#endif
#endif
