/* gemm_ref.h — the emulated cuBLASLt's device half: the reference GEMM that
 * cublasLtMatmul (cublaslt_emu.cc) queues with fy_emu_enqueue. It lives in
 * libfy_cudart_emu.so, so the emulated device's process has it mapped (emu_rt.h's top).
 *
 * The product, column-major as cuBLASLt's: for each batch item,
 *   D = alpha op(A) op(B) + beta C (+ bias, one value per row of D, when bias is set),
 * op(A) m x k, op(B) k x n, C and D m x n, C of D's type; C is not read when beta is 0
 * (BLAS's rule: it need not hold numbers then).
 *
 * Arithmetic, chosen so that a result depends on the inputs alone (never on addresses,
 * workspace or threads):
 *   inputs    converted to fp32: fp32 as is (FY_EMU_GEMM_EXACT), rounded to tf32 (10
 *             mantissa bits) or bf16 (7) to nearest even first (FY_EMU_GEMM_TF32,
 *             FY_EMU_GEMM_BF16: cuBLAS's FAST_TF32 and FAST_16BF compute types); bf16
 *             inputs are exact in fp32;
 *   products  in fp32, each rounded to fp32 (exact for tf32 and bf16 inputs), summed onto
 *             a 0 accumulator in fp32 in k order (p = 0, 1, ... k-1), never fused;
 *   epilogue  t = alpha * sum, then t + beta * c when beta != 0, then t + bias[row] (bias
 *             of D's type), in fp32, rounded once to D's type (bf16: to nearest even, a
 *             NaN stays a NaN).
 * A GPU sums in another order and may fuse: results agree to fp32 rounding, not bits.
 * The file must be compiled with -ffp-contract=off (the emulation's flag), or the
 * compiler may fuse a product into its sum. */
#ifndef FY_EMU_GEMM_REF_H
#define FY_EMU_GEMM_REF_H

#include <stdbool.h>
#include <stdint.h>

#include <cuda_runtime_api.h>
#include <library_types.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum fy_emu_gemm_round {
    FY_EMU_GEMM_EXACT, /* fp32 or bf16 inputs taken as they are */
    FY_EMU_GEMM_TF32,  /* fp32 inputs rounded to tf32 */
    FY_EMU_GEMM_BF16,  /* fp32 inputs rounded to bf16 */
} fy_emu_gemm_round;

/* One cublasLtMatmul, as validated by cublaslt_emu.cc: device addresses, element counts
 * for leading dimensions and batch strides. Copied by fy_emu_enqueue, so plain data. */
typedef struct fy_emu_gemm {
    const void *A, *B, *C;
    void *D;
    const void *bias;          /* (m) of D's type, shared by every batch item; NULL: none */
    cudaDataType_t ab_type;    /* CUDA_R_32F or CUDA_R_16BF: A's and B's */
    cudaDataType_t cd_type;    /* CUDA_R_32F or CUDA_R_16BF: C's, D's and the bias's */
    fy_emu_gemm_round round;
    bool ta, tb;               /* op(A) = A^T, op(B) = B^T */
    int64_t m, n, k;
    int64_t lda, ldb, ldc, ldd;
    int64_t sA, sB, sC, sD;    /* batch strides in elements */
    int32_t batch;
    float alpha, beta;
} fy_emu_gemm;

/* The device function: runs the fy_emu_gemm at args. cudaSuccess, or
 * cudaErrorMemoryAllocation (with a report) if its fp32 panels cannot be allocated. */
cudaError_t fy_emu_gemm_dev(void *args);

#ifdef __cplusplus
}
#endif
#endif
