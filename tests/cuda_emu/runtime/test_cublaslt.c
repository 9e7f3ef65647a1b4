/* test_cublaslt.c — the emulated cuBLASLt (cublaslt_emu.cc, gemm_ref.cc) through its
 * public API and the CUDA runtime's, as cuda_gemm.c calls it; built against the stand-in
 * runtime test_cublaslt_rt.c, it needs nothing of the emulated device.
 *
 * The products: the GEMMs cuda_gemm.c builds (the forward with its bias epilogue; the
 * backward's dinp with beta 0 over an output full of NaN, which must not be read, and its
 * fp32 dinp accumulated with beta 1 from bf16 inputs; dw with beta 1), in fp32, tf32 and
 * bf16 math and bf16 storage, and a strided batch with padded leading dimensions, against
 * a float64 product of the same stored inputs. Tolerance per element, S = |alpha| sum|a b|:
 *   S (k + 2) 2^-24         fp32 products and k sums, each rounded once (a bound);
 * + S 2^-10 or S 2^-7       inputs rounded to tf32 or bf16 (two factors of 2^-11, 2^-8);
 * + (|beta c| + |bias|) 2^-23   the epilogue's two additions;
 * + |d| 2^-24 or |d| 2^-8   rounding to fp32 or bf16 storage (half an ulp);
 * far below what a wrong transpose, stride or row gives (order 1). The rounding itself is
 * pinned bit for bit on values chosen for it (ties to even, tf32 and bf16 inputs, NaN).
 * A product depends on its inputs alone: the same problem at other addresses and across
 * the reference's block edges gives the same bits.
 *
 * The misuses, each refused with cuBLASLt's status and one "cuda emulation:" line naming
 * the problem: types the documentation's table does not list, an order not emulated,
 * ld < rows, shapes that make no product, batch counts that differ, a workspace smaller
 * than the algorithm's, pointers less aligned than promised (also by default: 256
 * bytes), an extent past the end of its allocation, a bias epilogue without a bias, an
 * in-place call with two layouts, an output overlapping an input, alpha in device memory,
 * an algorithm found for another problem, a destroyed handle, attributes of the wrong
 * size or unknown. */
#include <criterion/criterion.h>

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "engine/core/dtype.h"

/* ---- helpers ------------------------------------------------------------------------- */

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static float frand(void) { /* [-1, 1) with a full mantissa */
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (float)((double)(g_rng >> 11) / (double)(1ull << 52) - 1.0);
}

static void *dev_alloc(size_t nbytes) {
    void *p = NULL;
    cr_assert_eq(cudaMalloc(&p, nbytes), cudaSuccess);
    return p;
}

static void *dev_from(const void *host, size_t nbytes) {
    void *p = dev_alloc(nbytes);
    cr_assert_eq(cudaMemcpy(p, host, nbytes, cudaMemcpyHostToDevice), cudaSuccess);
    return p;
}

/* stderr into a file the test reads back */
static FILE *g_err;
static void capture_stderr(void) {
    g_err = tmpfile();
    cr_assert(g_err);
    fflush(stderr);
    cr_assert(dup2(fileno(g_err), 2) >= 0);
}

static bool stderr_has(const char *needle) {
    static char text[8192];
    fflush(stderr);
    rewind(g_err);
    size_t n = fread(text, 1, sizeof text - 1, g_err);
    text[n] = 0;
    return strstr(text, "cuda emulation: ") && strstr(text, needle);
}

static cublasLtMatrixLayout_t layout(cudaDataType_t t, uint64_t rows, uint64_t cols, int64_t ld, int32_t batch,
                                     int64_t stride) {
    cublasLtMatrixLayout_t l;
    cr_assert_eq(cublasLtMatrixLayoutCreate(&l, t, rows, cols, ld), CUBLAS_STATUS_SUCCESS);
    if (batch > 1) {
        cr_assert_eq(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof batch), 0);
        cr_assert_eq(
            cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride),
            0);
    }
    return l;
}

static void desc_set(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t a, const void *v, size_t n) {
    cr_assert_eq(cublasLtMatmulDescSetAttribute(d, a, v, n), CUBLAS_STATUS_SUCCESS);
}

static void pref_set(cublasLtMatmulPreference_t p, cublasLtMatmulPreferenceAttributes_t a, uint32_t v) {
    cr_assert_eq(cublasLtMatmulPreferenceSetAttribute(p, a, &v, sizeof v), CUBLAS_STATUS_SUCCESS);
}

/* cuda_gemm.c's alignment class: the largest power of two up to 16 dividing the
 * address, ld and batch stride in bytes */
static uint32_t align_class(const void *p, int64_t ld, int64_t stride, size_t es) {
    uintptr_t bits = (uintptr_t)p | (uintptr_t)(ld * (int64_t)es) | (uintptr_t)(stride * (int64_t)es) | 16u;
    return (uint32_t)(bits & (~bits + 1));
}

/* ---- products against float64 --------------------------------------------------------- */

typedef struct gemm_case {
    cublasComputeType_t compute;
    cudaDataType_t ab, cd; /* A's and B's type; C's, D's and the bias's */
    bool ta, tb;
    int m, n, k, batch;
    float alpha, beta;
    bool bias;
    int pad;    /* elements added to every ld and batch stride */
    bool nan_d; /* D (= C) full of NaN before a beta 0 product */
} gemm_case;

typedef struct mat {
    int rows, cols, ld;
    int64_t stride;
    size_t es, nelem;
    float *val; /* the stored values, as floats */
    void *host; /* as stored */
    void *dev;
} mat;

static void mat_make(mat *x, cudaDataType_t t, int rows, int cols, int batch, int pad, bool fill) {
    x->rows = rows;
    x->cols = cols;
    x->ld = rows + pad;
    x->stride = (int64_t)x->ld * cols + pad;
    x->es = t == CUDA_R_16BF ? 2 : 4;
    x->nelem = (size_t)(x->stride * (batch - 1) + (int64_t)x->ld * (cols - 1) + rows);
    x->val = calloc(x->nelem, sizeof(float));
    x->host = calloc(x->nelem, x->es);
    cr_assert(x->val && x->host);
    for (size_t i = 0; i < x->nelem && fill; i++) {
        float v = frand();
        if (t == CUDA_R_16BF) {
            uint16_t h = fy_f32_to_bf16(v);
            ((uint16_t *)x->host)[i] = h;
            x->val[i] = fy_bf16_to_f32(h);
        } else {
            ((float *)x->host)[i] = x->val[i] = v;
        }
    }
    x->dev = dev_from(x->host, x->nelem * x->es);
}

static void mat_free(mat *x) {
    free(x->val);
    free(x->host);
    cudaFree(x->dev);
}

static float mat_at(const mat *x, bool t, int b, int i, int j) { /* op(x)(i, j) of item b */
    return t ? x->val[b * x->stride + j + (int64_t)i * x->ld] : x->val[b * x->stride + i + (int64_t)j * x->ld];
}

/* Runs c through the descriptors cuda_gemm.c builds; returns D as stored (malloc). */
static void *run_case(const gemm_case *c, mat *A, mat *B, mat *D, mat *bias) {
    cublasLtHandle_t h;
    cr_assert_eq(cublasLtCreate(&h), CUBLAS_STATUS_SUCCESS);
    cublasLtMatmulDesc_t desc;
    cr_assert_eq(cublasLtMatmulDescCreate(&desc, c->compute, CUDA_R_32F), CUBLAS_STATUS_SUCCESS);
    cublasOperation_t oa = c->ta ? CUBLAS_OP_T : CUBLAS_OP_N, ob = c->tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    desc_set(desc, CUBLASLT_MATMUL_DESC_TRANSA, &oa, sizeof oa);
    desc_set(desc, CUBLASLT_MATMUL_DESC_TRANSB, &ob, sizeof ob);
    if (c->bias) {
        cublasLtEpilogue_t ep = CUBLASLT_EPILOGUE_BIAS;
        desc_set(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof ep);
        desc_set(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias->dev, sizeof bias->dev);
    }
    cublasLtMatrixLayout_t la = layout(c->ab, A->rows, A->cols, A->ld, c->batch, A->stride);
    cublasLtMatrixLayout_t lb = layout(c->ab, B->rows, B->cols, B->ld, c->batch, B->stride);
    cublasLtMatrixLayout_t ld = layout(c->cd, D->rows, D->cols, D->ld, c->batch, D->stride);
    cublasLtMatmulPreference_t pref;
    cr_assert_eq(cublasLtMatmulPreferenceCreate(&pref), CUBLAS_STATUS_SUCCESS);
    uint64_t ws_nbytes = 1 << 20;
    cr_assert_eq(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_nbytes,
                                                      sizeof ws_nbytes),
                 0);
    int64_t sb = c->batch > 1 ? 1 : 0;
    pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_class(A->dev, A->ld, sb * A->stride, A->es));
    pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_class(B->dev, B->ld, sb * B->stride, B->es));
    pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_class(D->dev, D->ld, sb * D->stride, D->es));
    pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_class(D->dev, D->ld, sb * D->stride, D->es));
    pref_set(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE);
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    cr_assert_eq(cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, ld, ld, pref, 1, &res, &found), CUBLAS_STATUS_SUCCESS);
    cr_assert_eq(found, 1);
    cr_assert_leq(res.workspaceSize, ws_nbytes);
    void *ws = dev_alloc(ws_nbytes);
    cr_assert_eq(cublasLtMatmul(h, desc, &c->alpha, A->dev, la, B->dev, lb, &c->beta, D->dev, ld, D->dev, ld, &res.algo,
                                ws, ws_nbytes, 0),
                 CUBLAS_STATUS_SUCCESS);
    cr_assert_eq(cudaDeviceSynchronize(), cudaSuccess);
    void *out = malloc(D->nelem * D->es);
    cr_assert(out);
    cr_assert_eq(cudaMemcpy(out, D->dev, D->nelem * D->es, cudaMemcpyDeviceToHost), cudaSuccess);
    cudaFree(ws);
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatmulDescDestroy(desc);
    cr_assert_eq(cublasLtDestroy(h), CUBLAS_STATUS_SUCCESS);
    return out;
}

static void check_case(const gemm_case *c) {
    mat A, B, D, bias;
    mat_make(&A, c->ab, c->ta ? c->k : c->m, c->ta ? c->m : c->k, c->batch, c->pad, true);
    mat_make(&B, c->ab, c->tb ? c->n : c->k, c->tb ? c->k : c->n, c->batch, c->pad, true);
    mat_make(&D, c->cd, c->m, c->n, c->batch, c->pad, !c->nan_d);
    mat_make(&bias, c->cd, c->m, 1, 1, 0, true);
    if (c->nan_d) {
        memset(D.host, 0xff, D.nelem * D.es); /* NaN in fp32 and bf16 */
        cr_assert_eq(cudaMemcpy(D.dev, D.host, D.nelem * D.es, cudaMemcpyHostToDevice), cudaSuccess);
    }
    void *out = run_case(c, &A, &B, &D, &bias);
    double in_rel = 0.0; /* inputs rounded by the compute type */
    if (c->compute == CUBLAS_COMPUTE_32F_FAST_TF32) in_rel = 0x1p-10;
    if (c->compute == CUBLAS_COMPUTE_32F_FAST_16BF) in_rel = 0x1p-7;
    const double out_rel = c->cd == CUDA_R_16BF ? 0x1p-8 : 0x1p-24;
    for (int b = 0; b < c->batch; b++)
        for (int j = 0; j < c->n; j++)
            for (int i = 0; i < c->m; i++) {
                double sum = 0, mag = 0;
                for (int p = 0; p < c->k; p++) {
                    double t = (double)mat_at(&A, c->ta, b, i, p) * (double)mat_at(&B, c->tb, b, p, j);
                    sum += t;
                    mag += fabs(t);
                }
                const int64_t at = b * D.stride + i + (int64_t)j * D.ld;
                double cv = c->beta != 0.0f ? (double)c->beta * D.val[at] : 0.0, bv = c->bias ? bias.val[i] : 0.0;
                double ref = (double)c->alpha * sum + cv + bv;
                double S = fabs(c->alpha) * mag;
                double tol = S * (c->k + 2) * 0x1p-24 + S * in_rel + (fabs(cv) + fabs(bv)) * 0x1p-23;
                tol += (fabs(ref) + tol) * out_rel + 1e-30;
                double got = c->cd == CUDA_R_16BF ? fy_bf16_to_f32(((uint16_t *)out)[at]) : ((float *)out)[at];
                cr_assert(fabs(got - ref) <= tol, "batch %d D(%d, %d) = %.9g, float64 %.9g, tolerance %.3g", b, i, j,
                          got, ref, tol);
            }
    free(out);
    mat_free(&A);
    mat_free(&B);
    mat_free(&D);
    mat_free(&bias);
}

Test(cublaslt_gemm, forward_bias_fp32) { /* out^T = w^T' inp^T + bias: ta, m = OC, n = N, k = C */
    check_case(&(gemm_case){CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_32F, true, false, 48, 20, 36, 1, 1.0f, 0.0f, true, 0,
                            false});
}

Test(cublaslt_gemm, forward_bias_bf16) {
    check_case(&(gemm_case){CUBLAS_COMPUTE_32F, CUDA_R_16BF, CUDA_R_16BF, true, false, 48, 20, 36, 1, 1.0f, 0.0f, true,
                            0, false});
}

Test(cublaslt_gemm, dinp_beta0_output_not_read) { /* dinp^T = w^T dout^T: m = C, n = N, k = OC */
    check_case(&(gemm_case){CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_32F, false, false, 36, 20, 48, 1, 1.0f, 0.0f, false,
                            0, true});
    check_case(&(gemm_case){CUBLAS_COMPUTE_32F, CUDA_R_16BF, CUDA_R_16BF, false, false, 36, 20, 48, 1, 1.0f, 0.0f,
                            false, 0, true});
}

Test(cublaslt_gemm, dinp_fp32_accumulated_from_bf16) {
    check_case(&(gemm_case){CUBLAS_COMPUTE_32F, CUDA_R_16BF, CUDA_R_32F, false, false, 36, 20, 48, 1, 1.0f, 1.0f, false,
                            0, false});
}

Test(cublaslt_gemm, dw_beta1) { /* dw^T += inp^T dout: tb, m = C, n = OC, k = N */
    check_case(&(gemm_case){CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_32F, false, true, 36, 48, 20, 1, 1.0f, 1.0f, false,
                            0, false});
    check_case(&(gemm_case){CUBLAS_COMPUTE_32F, CUDA_R_16BF, CUDA_R_16BF, false, true, 36, 48, 20, 1, 1.0f, 1.0f, false,
                            0, false});
}

Test(cublaslt_gemm, tf32_and_bf16_math) {
    check_case(&(gemm_case){CUBLAS_COMPUTE_32F_FAST_TF32, CUDA_R_32F, CUDA_R_32F, true, false, 48, 20, 36, 1, 1.0f,
                            0.0f, true, 0, false});
    check_case(&(gemm_case){CUBLAS_COMPUTE_32F_FAST_TF32, CUDA_R_32F, CUDA_R_32F, false, true, 36, 48, 20, 1, 1.0f,
                            1.0f, false, 0, false});
    check_case(&(gemm_case){CUBLAS_COMPUTE_32F_FAST_16BF, CUDA_R_32F, CUDA_R_32F, false, false, 36, 20, 48, 1, 1.0f,
                            0.0f, false, 0, false});
}

Test(cublaslt_gemm, batched_strided_padded) {
    check_case(&(gemm_case){CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_32F, true, true, 17, 9, 13, 3, 0.5f, -2.0f, false, 3,
                            false});
    check_case(&(gemm_case){CUBLAS_COMPUTE_32F, CUDA_R_16BF, CUDA_R_16BF, false, true, 17, 9, 13, 4, 1.0f, 0.0f, true,
                            2, false});
}

/* past the reference's blocks (64 rows, 4 and 256 columns), ragged, at two addresses */
Test(cublaslt_gemm, deterministic_across_blocks_and_addresses) {
    const gemm_case c = {
        CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_32F, true, false, 70, 261, 33, 1, 1.0f, 0.0f, true, 1, false};
    check_case(&c);
    uint64_t seed = g_rng;
    mat A, B, D, bias;
    mat_make(&A, c.ab, c.k, c.m, 1, 1, true);
    mat_make(&B, c.ab, c.k, c.n, 1, 1, true);
    mat_make(&D, c.cd, c.m, c.n, 1, 1, true);
    mat_make(&bias, c.cd, c.m, 1, 1, 0, true);
    void *first = run_case(&c, &A, &B, &D, &bias);
    g_rng = seed;
    void *pad = dev_alloc(4096 + 64); /* moves every later allocation */
    mat A2, B2, D2, bias2;
    mat_make(&A2, c.ab, c.k, c.m, 1, 1, true);
    mat_make(&B2, c.ab, c.k, c.n, 1, 1, true);
    mat_make(&D2, c.cd, c.m, c.n, 1, 1, true);
    mat_make(&bias2, c.cd, c.m, 1, 1, 0, true);
    cr_assert_neq(A.dev, A2.dev);
    void *second = run_case(&c, &A2, &B2, &D2, &bias2);
    cr_assert_eq(memcmp(first, second, D.nelem * D.es), 0);
    free(first);
    free(second);
    cudaFree(pad);
    mat *all[] = {&A, &B, &D, &bias, &A2, &B2, &D2, &bias2};
    for (int i = 0; i < 8; i++) mat_free(all[i]);
}

/* One element: D = a * b (k = 1) or a0 * b0 + a1 * b1 (k = 2), as stored bits. */
static uint32_t tiny(cublasComputeType_t ct, cudaDataType_t ab, cudaDataType_t cd, const void *a, const void *b,
                     int k) {
    size_t es = ab == CUDA_R_16BF ? 2 : 4;
    mat A = {.rows = 1, .cols = k, .ld = 1, .es = es, .nelem = (size_t)k, .dev = dev_from(a, es * k)};
    mat B = {.rows = k, .cols = 1, .ld = k, .es = es, .nelem = (size_t)k, .dev = dev_from(b, es * k)};
    mat D;
    mat_make(&D, cd, 1, 1, 1, 0, true);
    gemm_case c = {ct, ab, cd, false, false, 1, 1, k, 1, 1.0f, 0.0f, false, 0, false};
    void *out = run_case(&c, &A, &B, &D, NULL);
    uint32_t bits = cd == CUDA_R_16BF ? *(uint16_t *)out : *(uint32_t *)out;
    free(out);
    mat_free(&D);
    cudaFree(A.dev);
    cudaFree(B.dev);
    return bits;
}

Test(cublaslt_gemm, input_rounding_by_compute_type) {
    const float one = 1.0f;
    const float x = 1.0f + 0x1p-11f + 0x1p-20f; /* over half a tf32 ulp, under half a bf16 ulp */
    const float tie = 1.0f + 0x1p-11f;          /* half a tf32 ulp: ties to even, down */
    cr_assert_eq(tiny(CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_32F, &x, &one, 1), fy_f32_bits(x));
    cr_assert_eq(tiny(CUBLAS_COMPUTE_32F_FAST_TF32, CUDA_R_32F, CUDA_R_32F, &x, &one, 1), fy_f32_bits(1.0f + 0x1p-10f));
    cr_assert_eq(tiny(CUBLAS_COMPUTE_32F_FAST_TF32, CUDA_R_32F, CUDA_R_32F, &tie, &one, 1), fy_f32_bits(1.0f));
    cr_assert_eq(tiny(CUBLAS_COMPUTE_32F_FAST_16BF, CUDA_R_32F, CUDA_R_32F, &x, &one, 1), fy_f32_bits(1.0f));
}

Test(cublaslt_gemm, bf16_output_ties_to_even_and_nan) {
    const uint16_t b[2] = {0x3f80, 0x3f80};                                            /* 1, 1 */
    const uint16_t half_ulp[2] = {0x3f80, 0x3b80}, three_halves[2] = {0x3f80, 0x3c40}; /* 1 and 2^-8, 3 2^-8 */
    const uint16_t nan[2] = {0x7fc1, 0x3f80};
    cr_assert_eq(tiny(CUBLAS_COMPUTE_32F, CUDA_R_16BF, CUDA_R_16BF, half_ulp, b, 2), 0x3f80);     /* 1 + 2^-8: to 1 */
    cr_assert_eq(tiny(CUBLAS_COMPUTE_32F, CUDA_R_16BF, CUDA_R_16BF, three_halves, b, 2), 0x3f82); /* to 1 + 2^-6 */
    uint32_t n = tiny(CUBLAS_COMPUTE_32F, CUDA_R_16BF, CUDA_R_16BF, nan, b, 2);
    cr_assert((n & 0x7f80) == 0x7f80 && (n & 0x7f), "NaN stays NaN: 0x%x", n);
}

/* ---- misuses ---------------------------------------------------------------------------- */

/* A valid fp32 problem, D (m x n) = A (m x k) B (k x n), C == D, everything 16-byte
 * aligned and promised so; a test breaks one thing. */
typedef struct fix {
    cublasLtHandle_t h;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, lc, ld;
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulHeuristicResult_t res;
    float *A, *B, *D, *bias;
    void *ws;
    size_t ws_nbytes;
    float alpha, beta;
} fix;

enum { FM = 8, FN = 8, FK = 8 };

static void fix_init(fix *f, cudaDataType_t t, cublasComputeType_t ct) {
    memset(f, 0, sizeof *f);
    capture_stderr();
    cr_assert_eq(cublasLtCreate(&f->h), CUBLAS_STATUS_SUCCESS);
    cr_assert_eq(cublasLtMatmulDescCreate(&f->desc, ct, CUDA_R_32F), CUBLAS_STATUS_SUCCESS);
    f->la = layout(t, FM, FK, FM, 1, 0);
    f->lb = layout(t, FK, FN, FK, 1, 0);
    f->lc = layout(CUDA_R_32F, FM, FN, FM, 1, 0);
    f->ld = layout(CUDA_R_32F, FM, FN, FM, 1, 0);
    cr_assert_eq(cublasLtMatmulPreferenceCreate(&f->pref), CUBLAS_STATUS_SUCCESS);
    f->ws_nbytes = 4096;
    cr_assert_eq(cublasLtMatmulPreferenceSetAttribute(f->pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                      &(uint64_t){4096}, sizeof(uint64_t)),
                 0);
    for (int a = CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES; a <= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES; a++)
        pref_set(f->pref, a, 16);
    f->A = dev_alloc(4 * FM * FK + 64);
    f->B = dev_alloc(4 * FK * FN + 64);
    f->D = dev_alloc(4 * FM * FN + 64);
    f->bias = dev_alloc(4 * FM + 64);
    f->ws = dev_alloc(f->ws_nbytes);
    f->alpha = 1.0f;
    f->beta = 0.0f;
}

static cublasStatus_t fix_heuristic(fix *f) {
    int found = -1;
    cublasStatus_t s =
        cublasLtMatmulAlgoGetHeuristic(f->h, f->desc, f->la, f->lb, f->lc, f->ld, f->pref, 1, &f->res, &found);
    cr_assert_eq(found, s == CUBLAS_STATUS_SUCCESS ? 1 : 0);
    return s;
}

static cublasStatus_t fix_matmul(fix *f) {
    return cublasLtMatmul(f->h, f->desc, &f->alpha, f->A, f->la, f->B, f->lb, &f->beta, f->D, f->lc, f->D, f->ld,
                          &f->res.algo, f->ws, f->ws_nbytes, 0);
}

static void fix_ready(fix *f) { cr_assert_eq(fix_heuristic(f), CUBLAS_STATUS_SUCCESS); }

Test(cublaslt_misuse, the_fixture_is_valid) {
    fix f;
    fix_init(&f, CUDA_R_32F, CUBLAS_COMPUTE_32F);
    fix_ready(&f);
    cr_assert_eq(fix_matmul(&f), CUBLAS_STATUS_SUCCESS);
    cr_assert_eq(cudaDeviceSynchronize(), cudaSuccess);
    cr_assert_not(stderr_has(""));
}

Test(cublaslt_misuse, types_not_in_the_table) {
    fix f;
    fix_init(&f, CUDA_R_16BF, CUBLAS_COMPUTE_32F);
    uint32_t t = CUDA_R_16F; /* A 16BF, C and D 16F */
    cr_assert_eq(cublasLtMatrixLayoutSetAttribute(f.lc, CUBLASLT_MATRIX_LAYOUT_TYPE, &t, sizeof t), 0);
    cr_assert_eq(cublasLtMatrixLayoutSetAttribute(f.ld, CUBLASLT_MATRIX_LAYOUT_TYPE, &t, sizeof t), 0);
    cr_assert_eq(fix_heuristic(&f), CUBLAS_STATUS_NOT_SUPPORTED);
    cr_assert(stderr_has("not in cublasLtMatmul's table"));
}

Test(cublaslt_misuse, fast_tf32_takes_fp32_only) {
    fix f;
    fix_init(&f, CUDA_R_16BF, CUBLAS_COMPUTE_32F_FAST_TF32);
    cr_assert_eq(fix_heuristic(&f), CUBLAS_STATUS_NOT_SUPPORTED);
    cr_assert(stderr_has("not in cublasLtMatmul's table"));
}

Test(cublaslt_misuse, c_and_d_types_differ) {
    fix f;
    fix_init(&f, CUDA_R_16BF, CUBLAS_COMPUTE_32F);
    uint32_t t = CUDA_R_16BF;
    cr_assert_eq(cublasLtMatrixLayoutSetAttribute(f.ld, CUBLASLT_MATRIX_LAYOUT_TYPE, &t, sizeof t), 0);
    cr_assert_eq(fix_heuristic(&f), CUBLAS_STATUS_NOT_SUPPORTED);
    cr_assert(stderr_has("C's for D"));
}

Test(cublaslt_misuse, row_order_not_emulated) {
    fix f;
    fix_init(&f, CUDA_R_32F, CUBLAS_COMPUTE_32F);
    int32_t o = CUBLASLT_ORDER_ROW;
    cr_assert_eq(cublasLtMatrixLayoutSetAttribute(f.la, CUBLASLT_MATRIX_LAYOUT_ORDER, &o, sizeof o), 0);
    cr_assert_eq(fix_heuristic(&f), CUBLAS_STATUS_NOT_SUPPORTED);
    cr_assert(stderr_has("only CUBLASLT_ORDER_COL"));
}

Test(cublaslt_misuse, ld_less_than_rows) {
    fix f;
    fix_init(&f, CUDA_R_32F, CUBLAS_COMPUTE_32F);
    int64_t ld = FM - 1;
    cr_assert_eq(cublasLtMatrixLayoutSetAttribute(f.la, CUBLASLT_MATRIX_LAYOUT_LD, &ld, sizeof ld), 0);
    cr_assert_eq(fix_heuristic(&f), CUBLAS_STATUS_INVALID_VALUE);
    cr_assert(stderr_has("A's ld 7 is less than its 8 rows"));
}

Test(cublaslt_misuse, shapes_make_no_product) {
    fix f;
    fix_init(&f, CUDA_R_32F, CUBLAS_COMPUTE_32F);
    uint64_t cols = FK + 1; /* op(A) m x (k + 1) against op(B) k x n */
    cr_assert_eq(cublasLtMatrixLayoutSetAttribute(f.la, CUBLASLT_MATRIX_LAYOUT_COLS, &cols, sizeof cols), 0);
    cr_assert_eq(fix_heuristic(&f), CUBLAS_STATUS_INVALID_VALUE);
    cr_assert(stderr_has("do not make one product"));
}

Test(cublaslt_misuse, batch_counts_differ) {
    fix f;
    fix_init(&f, CUDA_R_32F, CUBLAS_COMPUTE_32F);
    int32_t b = 2;
    cr_assert_eq(cublasLtMatrixLayoutSetAttribute(f.lb, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &b, sizeof b), 0);
    cr_assert_eq(fix_heuristic(&f), CUBLAS_STATUS_INVALID_VALUE);
    cr_assert(stderr_has("B's batch count 2 is not D's 1"));
}

Test(cublaslt_misuse, workspace_smaller_than_the_algos) {
    fix f;
    fix_init(&f, CUDA_R_32F, CUBLAS_COMPUTE_32F);
    fix_ready(&f);
    cr_assert_eq(f.res.workspaceSize, 4096);
    f.ws_nbytes = 4095;
    cr_assert_eq(fix_matmul(&f), CUBLAS_STATUS_INVALID_VALUE);
    cr_assert(stderr_has("a workspace of 4095 bytes for an algo that takes 4096"));
}

Test(cublaslt_misuse, pointer_less_aligned_than_promised) {
    fix f;
    fix_init(&f, CUDA_R_32F, CUBLAS_COMPUTE_32F);
    fix_ready(&f);
    f.A += 1; /* 4-byte aligned, 16 promised; still inside its allocation */
    cr_assert_eq(fix_matmul(&f), CUBLAS_STATUS_INVALID_VALUE);
    cr_assert(stderr_has("A at"));
    cr_assert(stderr_has("MIN_ALIGNMENT_A_BYTES 16"));
}

Test(cublaslt_misuse, default_alignment_promise_is_256) {
    fix f;
    fix_init(&f, CUDA_R_32F, CUBLAS_COMPUTE_32F);
    cr_assert_eq(cublasLtMatmulPreferenceDestroy(f.pref), CUBLAS_STATUS_SUCCESS);
    cr_assert_eq(cublasLtMatmulPreferenceCreate(&f.pref), CUBLAS_STATUS_SUCCESS);
    fix_ready(&f);
    f.ws_nbytes = 0;
    cr_assert_eq(fix_matmul(&f), CUBLAS_STATUS_SUCCESS); /* cudaMalloc's are 256-byte aligned */
    f.D += 4;                                            /* 16 */
    cr_assert_eq(fix_matmul(&f), CUBLAS_STATUS_INVALID_VALUE);
    cr_assert(stderr_has("MIN_ALIGNMENT_C_BYTES 256"));
}

Test(cublaslt_misuse, no_algo_means_the_default_preferences) {
    fix f;
    fix_init(&f, CUDA_R_32F, CUBLAS_COMPUTE_32F);
    /* no workspace, 256-byte alignment */
    cr_assert_eq(cublasLtMatmul(f.h, f.desc, &f.alpha, f.A, f.la, f.B, f.lb, &f.beta, f.D, f.lc, f.D, f.ld, NULL, NULL,
                                0, 0),
                 CUBLAS_STATUS_SUCCESS);
    cr_assert_eq(cublasLtMatmul(f.h, f.desc, &f.alpha, f.A + 4, f.la, f.B, f.lb, &f.beta, f.D, f.lc, f.D, f.ld, NULL,
                                NULL, 0, 0),
                 CUBLAS_STATUS_INVALID_VALUE);
    cr_assert(stderr_has("MIN_ALIGNMENT_A_BYTES 256"));
}

Test(cublaslt_misuse, extent_past_the_allocation) {
    fix f;
    fix_init(&f, CUDA_R_32F, CUBLAS_COMPUTE_32F);
    fix_ready(&f);
    f.B = dev_alloc(4 * FK * FN - 4); /* one element short */
    cr_assert_eq(fix_matmul(&f), CUBLAS_STATUS_INVALID_VALUE);
    cr_assert(stderr_has("B ["));
    cr_assert(stderr_has("not wholly inside one live device allocation"));
    cudaFree(f.D);
    f.B = dev_alloc(4 * FK * FN); /* a freed output (C == D: C is checked first) */
    cr_assert_eq(fix_matmul(&f), CUBLAS_STATUS_INVALID_VALUE);
    cr_assert(stderr_has("C ["));
}

Test(cublaslt_misuse, bias_epilogue_without_a_bias) {
    fix f;
    fix_init(&f, CUDA_R_32F, CUBLAS_COMPUTE_32F);
    cublasLtEpilogue_t ep = CUBLASLT_EPILOGUE_BIAS;
    desc_set(f.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof ep);
    fix_ready(&f);
    cr_assert_eq(fix_matmul(&f), CUBLAS_STATUS_INVALID_VALUE);
    cr_assert(stderr_has("CUBLASLT_EPILOGUE_BIAS without a bias pointer"));
}

Test(cublaslt_misuse, bias_less_aligned_than_the_heuristic_saw) {
    fix f;
    fix_init(&f, CUDA_R_32F, CUBLAS_COMPUTE_32F);
    cublasLtEpilogue_t ep = CUBLASLT_EPILOGUE_BIAS;
    desc_set(f.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof ep);
    desc_set(f.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &f.bias, sizeof f.bias);
    fix_ready(&f);
    cr_assert_eq(fix_matmul(&f), CUBLAS_STATUS_SUCCESS);
    float *moved = f.bias + 1;
    desc_set(f.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &moved, sizeof moved);
    cr_assert_eq(fix_matmul(&f), CUBLAS_STATUS_INVALID_VALUE);
    cr_assert(stderr_has("the bias at"));
}

Test(cublaslt_misuse, in_place_with_two_layouts) {
    fix f;
    fix_init(&f, CUDA_R_32F, CUBLAS_COMPUTE_32F);
    fix_ready(&f);
    int64_t ld = FM + 4; /* C's layout wider than D's, over an allocation that holds it */
    f.D = dev_alloc(4 * (FM + 4) * FN);
    cr_assert_eq(cublasLtMatrixLayoutSetAttribute(f.lc, CUBLASLT_MATRIX_LAYOUT_LD, &ld, sizeof ld), 0);
    cr_assert_eq(fix_matmul(&f), CUBLAS_STATUS_INVALID_VALUE);
    cr_assert(stderr_has("C == D (in place) with C's layout not D's"));
}

Test(cublaslt_misuse, output_overlaps_an_input) {
    fix f;
    fix_init(&f, CUDA_R_32F, CUBLAS_COMPUTE_32F);
    fix_ready(&f);
    f.D = f.A; /* same shape and type: a valid in-place-looking call that races on a GPU */
    cr_assert_eq(fix_matmul(&f), CUBLAS_STATUS_INVALID_VALUE);
    cr_assert(stderr_has("D overlaps A"));
}

Test(cublaslt_misuse, interleaved_columns_do_not_overlap) {
    fix f;
    fix_init(&f, CUDA_R_32F, CUBLAS_COMPUTE_32F);
    /* A and D as the two halves of every column of one 2m x k buffer: they interleave
     * but share no element */
    float *both = dev_alloc(4 * 2 * FM * FK);
    int64_t ld = 2 * FM;
    cr_assert_eq(cublasLtMatrixLayoutSetAttribute(f.la, CUBLASLT_MATRIX_LAYOUT_LD, &ld, sizeof ld), 0);
    cr_assert_eq(cublasLtMatrixLayoutSetAttribute(f.lc, CUBLASLT_MATRIX_LAYOUT_LD, &ld, sizeof ld), 0);
    cr_assert_eq(cublasLtMatrixLayoutSetAttribute(f.ld, CUBLASLT_MATRIX_LAYOUT_LD, &ld, sizeof ld), 0);
    fix_ready(&f);
    f.A = both;
    f.D = both + FM;
    cr_assert_eq(fix_matmul(&f), CUBLAS_STATUS_SUCCESS);
    f.D = both + FM - 1; /* one row lower: D's first row is A's last (D now 4-byte aligned) */
    pref_set(f.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, 4);
    pref_set(f.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, 4);
    fix_ready(&f);
    cr_assert_eq(fix_matmul(&f), CUBLAS_STATUS_INVALID_VALUE);
    cr_assert(stderr_has("D overlaps A"));
}

Test(cublaslt_misuse, alpha_in_device_memory) {
    fix f;
    fix_init(&f, CUDA_R_32F, CUBLAS_COMPUTE_32F);
    fix_ready(&f);
    cr_assert_eq(cublasLtMatmul(f.h, f.desc, f.bias, f.A, f.la, f.B, f.lb, &f.beta, f.D, f.lc, f.D, f.ld, &f.res.algo,
                                f.ws, f.ws_nbytes, 0),
                 CUBLAS_STATUS_INVALID_VALUE);
    cr_assert(stderr_has("alpha at"));
    cr_assert(stderr_has("CUBLASLT_POINTER_MODE_HOST"));
}

Test(cublaslt_misuse, algo_found_for_another_problem) {
    fix f;
    fix_init(&f, CUDA_R_32F, CUBLAS_COMPUTE_32F);
    fix_ready(&f);
    cublasOperation_t t = CUBLAS_OP_T; /* square, so the shapes still make a product */
    desc_set(f.desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t);
    cr_assert_eq(fix_matmul(&f), CUBLAS_STATUS_INVALID_VALUE);
    cr_assert(stderr_has("the algo was found for other types, transposes or epilogue"));
    cublasLtMatmulAlgo_t junk;
    memset(&junk, 0x5a, sizeof junk);
    cr_assert_eq(cublasLtMatmul(f.h, f.desc, &f.alpha, f.A, f.la, f.B, f.lb, &f.beta, f.D, f.lc, f.D, f.ld, &junk, f.ws,
                                f.ws_nbytes, 0),
                 CUBLAS_STATUS_INVALID_VALUE);
    cr_assert(stderr_has("not one cublasLtMatmulAlgoGetHeuristic returned"));
}

Test(cublaslt_misuse, destroyed_handle_and_descriptor) {
    fix f;
    fix_init(&f, CUDA_R_32F, CUBLAS_COMPUTE_32F);
    cr_assert_eq(cublasLtMatrixLayoutDestroy(f.lb), CUBLAS_STATUS_SUCCESS);
    cr_assert_eq(fix_heuristic(&f), CUBLAS_STATUS_INVALID_VALUE);
    cr_assert(stderr_has("Bdesc"));
    cr_assert_eq(cublasLtMatrixLayoutDestroy(f.lb), CUBLAS_STATUS_INVALID_VALUE);
    cr_assert_eq(cublasLtDestroy(f.h), CUBLAS_STATUS_SUCCESS);
    cr_assert_eq(fix_heuristic(&f), CUBLAS_STATUS_NOT_INITIALIZED);
    cr_assert_eq(cublasLtDestroy(f.h), CUBLAS_STATUS_NOT_INITIALIZED);
}

Test(cublaslt_misuse, attributes_of_wrong_size_unknown_or_out_of_range) {
    fix f;
    fix_init(&f, CUDA_R_32F, CUBLAS_COMPUTE_32F);
    int64_t wide = CUBLAS_OP_T;
    cr_assert_eq(cublasLtMatmulDescSetAttribute(f.desc, CUBLASLT_MATMUL_DESC_TRANSA, &wide, sizeof wide),
                 CUBLAS_STATUS_INVALID_VALUE);
    cr_assert(stderr_has("CUBLASLT_MATMUL_DESC_TRANSA takes 4 bytes, given 8"));
    int32_t v = 0;
    cr_assert_eq(cublasLtMatmulDescSetAttribute(f.desc, (cublasLtMatmulDescAttributes_t)9999, &v, sizeof v),
                 CUBLAS_STATUS_INVALID_VALUE);
    cr_assert_eq(cublasLtMatrixLayoutSetAttribute(f.la, (cublasLtMatrixLayoutAttribute_t)9999, &v, sizeof v),
                 CUBLAS_STATUS_INVALID_VALUE);
    cr_assert_eq(cublasLtMatmulPreferenceSetAttribute(f.pref, (cublasLtMatmulPreferenceAttributes_t)9999, &v, sizeof v),
                 CUBLAS_STATUS_INVALID_VALUE);
    uint32_t gelu = CUBLASLT_EPILOGUE_GELU_BIAS;
    cr_assert_eq(cublasLtMatmulDescSetAttribute(f.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &gelu, sizeof gelu),
                 CUBLAS_STATUS_INVALID_VALUE);
    int32_t batch = 0;
    cr_assert_eq(cublasLtMatrixLayoutSetAttribute(f.la, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof batch),
                 CUBLAS_STATUS_INVALID_VALUE);
    uint32_t three = 3;
    cr_assert_eq(
        cublasLtMatmulPreferenceSetAttribute(f.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &three, sizeof three),
        CUBLAS_STATUS_INVALID_VALUE);
    cr_assert_eq(cublasLtMatmulDescSetAttribute(f.desc, CUBLASLT_MATMUL_DESC_TRANSA, NULL, 4),
                 CUBLAS_STATUS_INVALID_VALUE);
    /* and the descriptor still works */
    fix_ready(&f);
    cr_assert_eq(fix_matmul(&f), CUBLAS_STATUS_SUCCESS);
}

/* ---- the library ---------------------------------------------------------------------- */

Test(cublaslt_api, a_handle_holds_device_memory) {
    size_t free0, free1, free2, total;
    cr_assert_eq(cudaMemGetInfo(&free0, &total), cudaSuccess);
    cublasLtHandle_t h;
    cr_assert_eq(cublasLtCreate(&h), CUBLAS_STATUS_SUCCESS);
    cr_assert_eq(cudaMemGetInfo(&free1, &total), cudaSuccess);
    cr_assert_lt(free1, free0);
    cr_assert_eq(cublasLtDestroy(h), CUBLAS_STATUS_SUCCESS);
    cr_assert_eq(cudaMemGetInfo(&free2, &total), cudaSuccess);
    cr_assert_eq(free2, free0);
}

Test(cublaslt_api, version_and_its_override) {
    unsetenv("FERRY_EMU_CUBLAS_VERSION");
    cr_assert_eq(cublasLtGetVersion(), CUBLAS_VERSION);
    cr_assert_eq(cublasLtGetVersion() / 10000, CUBLAS_VER_MAJOR);
    setenv("FERRY_EMU_CUBLAS_VERSION", "120800", 1);
    cr_assert_eq(cublasLtGetVersion(), 120800);
    capture_stderr();
    setenv("FERRY_EMU_CUBLAS_VERSION", "12.8", 1);
    cr_assert_eq(cublasLtGetVersion(), CUBLAS_VERSION);
    cr_assert(stderr_has("FERRY_EMU_CUBLAS_VERSION=12.8 is not a version"));
}

Test(cublaslt_api, status_strings) {
    cr_assert_str_eq(cublasLtGetStatusString(CUBLAS_STATUS_NOT_SUPPORTED),
                     "the requested functionality is not supported");
    cr_assert_str_neq(cublasLtGetStatusString(CUBLAS_STATUS_INVALID_VALUE),
                      cublasLtGetStatusString(CUBLAS_STATUS_SUCCESS));
}
