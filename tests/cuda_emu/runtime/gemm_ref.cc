/* gemm_ref.cc — the reference GEMM of the emulated cuBLASLt (gemm_ref.h), run in the
 * emulated device's process.
 *
 * Blocked for the cache: a block of NC columns of op(B) and then, one after another,
 * blocks of MC rows of op(A) are converted to fp32 panels (the compute type's rounding
 * applied there, once per element), and each MC x NR tile of D is summed in registers
 * and L1 over the whole of k before its epilogue. Blocking changes which elements are
 * computed when, never the order of one element's sum, so the bits do not depend on
 * the block sizes. One thread: deterministic by construction. */
#include "tests/cuda_emu/runtime/gemm_ref.h"

#include <stdlib.h>
#include <string.h>

#include "engine/core/dtype.h"
#include "tests/cuda_emu/runtime/emu_rt.h"

/* a tile of D is MC rows by NR columns; op(B) is converted NC columns at a time */
static constexpr int64_t MC = 64, NR = 4, NC = 256;

/* f rounded to nearest even with its `drop` low mantissa bits cleared; Inf and NaN as
 * they are (a finite value may round up to Inf, as the conversion does). */
static float round_bits(float f, int drop) {
    uint32_t u = fy_f32_bits(f);
    if ((u & 0x7fffffffu) >= 0x7f800000u) return f;
    u += (1u << (drop - 1)) - 1u + ((u >> drop) & 1u);
    return fy_bits_f32(u & ~((1u << drop) - 1u));
}

/* Element (r, c) of the stored matrix at p (column-major, leading dimension ld), in fp32
 * as the compute type takes it. */
static inline float load_in(const fy_emu_gemm *g, const void *p, int64_t r, int64_t c, int64_t ld) {
    int64_t at = r + c * ld;
    if (g->ab_type == CUDA_R_16BF) return fy_bf16_to_f32(((const uint16_t *)p)[at]);
    float v = ((const float *)p)[at];
    if (g->round == FY_EMU_GEMM_TF32) return round_bits(v, 13);
    if (g->round == FY_EMU_GEMM_BF16) return round_bits(v, 16);
    return v;
}

/* A panel of op(B)'s columns [j0, j0 + nc), column by column: bp[jj * k + p]. */
static void pack_b(const fy_emu_gemm *g, const void *B, int64_t j0, int64_t nc, float *bp) {
    for (int64_t jj = 0; jj < nc; jj++)
        for (int64_t p = 0; p < g->k; p++)
            bp[jj * g->k + p] = g->tb ? load_in(g, B, j0 + jj, p, g->ldb) : load_in(g, B, p, j0 + jj, g->ldb);
}

/* A panel of op(A)'s rows [i0, i0 + mc), p by p: ap[p * MC + ii]; rows past mc are 0. */
static void pack_a(const fy_emu_gemm *g, const void *A, int64_t i0, int64_t mc, float *ap) {
    for (int64_t p = 0; p < g->k; p++) {
        float *row = ap + p * MC;
        for (int64_t ii = 0; ii < mc; ii++)
            row[ii] = g->ta ? load_in(g, A, p, i0 + ii, g->lda) : load_in(g, A, i0 + ii, p, g->lda);
        for (int64_t ii = mc; ii < MC; ii++) row[ii] = 0.0f;
    }
}

static inline float load_cd(const fy_emu_gemm *g, const void *p, int64_t at) {
    return g->cd_type == CUDA_R_16BF ? fy_bf16_to_f32(((const uint16_t *)p)[at]) : ((const float *)p)[at];
}

/* The epilogue of D's tile at (i0, j0): acc[jj][ii] is the sum of element
 * (i0 + ii, j0 + jj). */
static void store_tile(const fy_emu_gemm *g, const void *C, void *D, int64_t i0, int64_t mc,
                       int64_t j0, int64_t nr, const float (*acc)[MC]) {
    for (int64_t jj = 0; jj < nr; jj++)
        for (int64_t ii = 0; ii < mc; ii++) {
            int64_t i = i0 + ii, j = j0 + jj;
            float t = g->alpha * acc[jj][ii];
            if (g->beta != 0.0f) t = t + g->beta * load_cd(g, C, i + j * g->ldc);
            if (g->bias) t = t + load_cd(g, g->bias, i);
            int64_t at = i + j * g->ldd;
            if (g->cd_type == CUDA_R_16BF) ((uint16_t *)D)[at] = fy_f32_to_bf16(t);
            else ((float *)D)[at] = t;
        }
}

/* The MC x nr tiles of one op(A) panel against one op(B) panel of nc columns. */
static void panel_product(const fy_emu_gemm *g, const float *ap, const float *bp, const void *C,
                          void *D, int64_t i0, int64_t mc, int64_t j0, int64_t nc) {
    const int64_t k = g->k;
    for (int64_t jb = 0; jb < nc; jb += NR) {
        const int64_t nr = nc - jb < NR ? nc - jb : NR;
        float acc[NR][MC];
        memset(acc, 0, sizeof acc);
        for (int64_t p = 0; p < k; p++) {
            const float *a = ap + p * MC;
            for (int64_t jj = 0; jj < nr; jj++) {
                const float b = bp[(jb + jj) * k + p];
                for (int ii = 0; ii < MC; ii++) acc[jj][ii] = acc[jj][ii] + a[ii] * b;
            }
        }
        store_tile(g, C, D, i0, mc, j0 + jb, nr, acc);
    }
}

/* Panels of this thread, grown to the largest GEMM it has run and kept (the device's
 * process runs GEMMs until it ends). */
static thread_local float *tl_panels;
static thread_local size_t tl_panels_nelem;

static float *panels(size_t nelem) {
    if (nelem <= tl_panels_nelem) return tl_panels;
    float *p = (float *)realloc(tl_panels, nelem * sizeof(float));
    if (!p) return NULL;
    tl_panels = p;
    tl_panels_nelem = nelem;
    return p;
}

extern "C" cudaError_t fy_emu_gemm_dev(void *args) {
    const fy_emu_gemm *g = (const fy_emu_gemm *)args;
    const size_t ab_es = g->ab_type == CUDA_R_16BF ? 2 : 4, cd_es = g->cd_type == CUDA_R_16BF ? 2 : 4;
    const size_t a_nelem = (size_t)MC * (size_t)g->k, b_nelem = (size_t)NC * (size_t)g->k;
    float *ap = panels(a_nelem + b_nelem);
    if (!ap) {
        fy_emu_report("cublasLtMatmul: no host memory for %zu bytes of fp32 panels (k=%lld)",
                      (a_nelem + b_nelem) * sizeof(float), (long long)g->k);
        return cudaErrorMemoryAllocation;
    }
    float *bp = ap + a_nelem;
    for (int32_t b = 0; b < g->batch; b++) {
        const char *A = (const char *)g->A + (size_t)(b * g->sA) * ab_es;
        const char *B = (const char *)g->B + (size_t)(b * g->sB) * ab_es;
        const char *C = (const char *)g->C + (size_t)(b * g->sC) * cd_es;
        char *D = (char *)g->D + (size_t)(b * g->sD) * cd_es;
        for (int64_t j0 = 0; j0 < g->n; j0 += NC) {
            const int64_t nc = g->n - j0 < NC ? g->n - j0 : NC;
            pack_b(g, B, j0, nc, bp);
            for (int64_t i0 = 0; i0 < g->m; i0 += MC) {
                const int64_t mc = g->m - i0 < MC ? g->m - i0 : MC;
                pack_a(g, A, i0, mc, ap);
                panel_product(g, ap, bp, C, D, i0, mc, j0, nc);
            }
        }
    }
    return cudaSuccess;
}
