/* cpu_kernels.c — the cpu backend's kernels: the reference every other backend is
 * compared with. GEMMs go to BLAS (OpenBLAS's OpenMP build: called inside an OpenMP
 * region it runs serially, so attention parallelises over (b, h) itself); the rest are
 * OpenMP loops; attention is tiled over BLAS products of tiles.
 *
 * Determinism: results depend on inputs (and at most the thread count), never on timing
 * or addresses. Reductions across rows (bias, gain and embedding gradients, sums) are
 * parallelised over columns or fixed chunks, so each output is summed in one fixed order. */
#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/reduce.h"
#include "engine/device/device_impl.h"
#include "engine/device/kernels.h"
#include "engine/device/rope.h"
#include "optim_cpu/adam.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define ATT_X86 1
#endif

#define LN_EPS 1e-5f
#define COLS_PER_TASK 16 /* column tile for column-parallel reductions (one cache line) */

/* out = wte[tok] * scale (+ wpe[pos]): one rounded product, then one rounded sum; with
 * scale 1 the product is wte's value, so the sums are the unscaled ones. */
static void encoder_fwd(float *out, const int32_t *tok, const float *wte, const float *wpe,
                        const int32_t *docs, int B, int T, int C, float scale) {
    #pragma omp parallel for schedule(static)
    for (int bt = 0; bt < B * T; bt++) {
        const float *we = wte + (size_t)tok[bt] * C;
        float *o = out + (size_t)bt * C;
        if (!wpe) {
            for (int c = 0; c < C; c++) o[c] = we[c] * scale;
            continue;
        }
        const float *pe = wpe + (size_t)(bt % T - (docs ? docs[bt] : 0)) * C;
        for (int c = 0; c < C; c++) o[c] = we[c] * scale + pe[c];
    }
}

/* dwte[tok] += dout * scale, each term's product rounded before it is added (scale 1:
 * dout's values); dwpe unscaled. */
static void encoder_bwd(float *dwte, float *dwpe, const float *dout, const int32_t *tok,
                        const int32_t *docs, int B, int T, int C, float scale) {
    /* parallel over column tiles: every row of dwte/dwpe is summed in bt order */
    int ntiles = (C + COLS_PER_TASK - 1) / COLS_PER_TASK;
    #pragma omp parallel for schedule(static)
    for (int tile = 0; tile < ntiles; tile++) {
        int c0 = tile * COLS_PER_TASK, c1 = c0 + COLS_PER_TASK < C ? c0 + COLS_PER_TASK : C;
        for (int bt = 0; bt < B * T; bt++) {
            const float *d = dout + (size_t)bt * C;
            float *we = dwte + (size_t)tok[bt] * C;
            for (int c = c0; c < c1; c++) we[c] += d[c] * scale;
            if (!dwpe) continue;
            float *pe = dwpe + (size_t)(bt % T - (docs ? docs[bt] : 0)) * C;
            for (int c = c0; c < c1; c++) pe[c] += d[c];
        }
    }
}

static void layernorm_fwd(float *out, float *mean, float *rstd, const float *inp,
                          const float *w, const float *b, int N, int C) {
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * C;
        float m = 0.0f;
        for (int c = 0; c < C; c++) m += x[c];
        m /= (float)C;
        float v = 0.0f;
        for (int c = 0; c < C; c++) { float d = x[c] - m; v += d * d; }
        v /= (float)C;
        float r = 1.0f / sqrtf(v + LN_EPS);
        float *o = out + (size_t)n * C;
        for (int c = 0; c < C; c++) o[c] = (x[c] - m) * r * w[c] + b[c];
        mean[n] = m;
        rstd[n] = r;
    }
}

static void layernorm_bwd(float *dinp, float *dw, float *db, const float *dout,
                          const float *inp, const float *w, const float *mean,
                          const float *rstd, int N, int C) {
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * C, *d = dout + (size_t)n * C;
        float m = mean[n], r = rstd[n];
        float dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
        for (int c = 0; c < C; c++) {
            float norm = (x[c] - m) * r, dnorm = w[c] * d[c];
            dnorm_mean += dnorm;
            dnorm_norm_mean += dnorm * norm;
        }
        dnorm_mean /= (float)C;
        dnorm_norm_mean /= (float)C;
        float *di = dinp + (size_t)n * C;
        for (int c = 0; c < C; c++) {
            float norm = (x[c] - m) * r, dnorm = w[c] * d[c];
            di[c] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * r;
        }
    }
    int ntiles = (C + COLS_PER_TASK - 1) / COLS_PER_TASK;
    #pragma omp parallel for schedule(static)
    for (int tile = 0; tile < ntiles; tile++) {
        int c0 = tile * COLS_PER_TASK, c1 = c0 + COLS_PER_TASK < C ? c0 + COLS_PER_TASK : C;
        float sw[COLS_PER_TASK] = {0}, sb[COLS_PER_TASK] = {0};
        for (int n = 0; n < N; n++) {
            const float *x = inp + (size_t)n * C, *d = dout + (size_t)n * C;
            float m = mean[n], r = rstd[n];
            for (int c = c0; c < c1; c++) {
                sw[c - c0] += (x[c] - m) * r * d[c];
                sb[c - c0] += d[c];
            }
        }
        for (int c = c0; c < c1; c++) { dw[c] += sw[c - c0]; db[c] += sb[c - c0]; }
    }
}

/* The norm's gain w + offset (kernels.h); offset 0 keeps w's bits (w + 0 would turn a -0
 * into +0). */
static inline float gain(float w, float offset) { return offset != 0.0f ? w + offset : w; }

/* One RMSNorm row of C: o = x * r * (w + offset), r = 1 / sqrt(mean(x^2) + eps); returns r.
 * RMSNorm's rows and the per-head norms' heads alike. */
static float rms_row_fwd(float *o, const float *x, const float *w, int C, float eps,
                         float offset) {
    float ss = 0.0f;
    for (int c = 0; c < C; c++) ss += x[c] * x[c];
    float r = 1.0f / sqrtf(ss / (float)C + eps);
    for (int c = 0; c < C; c++) o[c] = x[c] * r * gain(w[c], offset);
    return r;
}

/* One row's input gradient, g = w + offset: v = r (g d) - x r^3 mean(g d x); di += v with
 * acc, else di = v. di may be d: each d[c] is read before di[c] is written. */
static void rms_row_bwd(float *di, const float *d, const float *x, const float *w, float r,
                        int C, float offset, bool acc) {
    float dot = 0.0f;
    for (int c = 0; c < C; c++) dot += gain(w[c], offset) * d[c] * x[c];
    float k = dot / (float)C * r * r * r;
    for (int c = 0; c < C; c++) {
        const float v = gain(w[c], offset) * d[c] * r - x[c] * k;
        di[c] = acc ? di[c] + v : v;
    }
}

static void rmsnorm_fwd(float *out, float *rstd, const float *inp, const float *w, int N, int C,
                        float eps, float offset) {
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++)
        rstd[n] = rms_row_fwd(out + (size_t)n * C, inp + (size_t)n * C, w, C, eps, offset);
}

/* dinp += rms_row_bwd's; dw += sum over rows of dout x r. */
static void rmsnorm_bwd(float *dinp, float *dw, const float *dout, const float *inp,
                        const float *w, const float *rstd, int N, int C, float offset) {
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++)
        rms_row_bwd(dinp + (size_t)n * C, dout + (size_t)n * C, inp + (size_t)n * C, w, rstd[n],
                    C, offset, true);
    int ntiles = (C + COLS_PER_TASK - 1) / COLS_PER_TASK;
    #pragma omp parallel for schedule(static)
    for (int tile = 0; tile < ntiles; tile++) {
        int c0 = tile * COLS_PER_TASK, c1 = c0 + COLS_PER_TASK < C ? c0 + COLS_PER_TASK : C;
        float sw[COLS_PER_TASK] = {0};
        for (int n = 0; n < N; n++) {
            const float *x = inp + (size_t)n * C, *d = dout + (size_t)n * C;
            float r = rstd[n];
            for (int c = c0; c < c1; c++) sw[c - c0] += x[c] * r * d[c];
        }
        for (int c = c0; c < c1; c++) dw[c] += sw[c - c0];
    }
}

/* Per-head RMSNorm of packed rows (kernels.h): row n's head h at n W + h hd, the NH query
 * heads (gain wq), the NKV key heads (wk), then the NKV value heads, copied. rstd (N,
 * NH+NKV). */
static void qk_norm_fwd(float *out, float *rstd, const float *inp, const float *wq,
                        const float *wk, int N, int NH, int NKV, int hd, float eps,
                        float offset) {
    const int heads = NH + NKV;
    const size_t W = (size_t)(NH + 2 * NKV) * hd;
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float *x = inp + n * W;
        float *o = out + n * W;
        for (int h = 0; h < heads; h++)
            rstd[(size_t)n * heads + h] = rms_row_fwd(o + (size_t)h * hd, x + (size_t)h * hd,
                                                      h < NH ? wq : wk, hd, eps, offset);
        if (o != x) memcpy(o + (size_t)heads * hd, x + (size_t)heads * hd, sizeof(float) * (size_t)NKV * hd);
    }
}

/* dw[c] += sum over rows n, then heads h0..h0+nh-1, of dout x r: parallel over column
 * tiles, each summed in that order whatever the thread count. */
static void qk_norm_dw(float *dw, const float *dout, const float *inp, const float *rstd, int N,
                       int h0, int nh, int heads, size_t W, int hd) {
    int ntiles = (hd + COLS_PER_TASK - 1) / COLS_PER_TASK;
    #pragma omp parallel for schedule(static)
    for (int tile = 0; tile < ntiles; tile++) {
        int c0 = tile * COLS_PER_TASK, c1 = c0 + COLS_PER_TASK < hd ? c0 + COLS_PER_TASK : hd;
        float sw[COLS_PER_TASK] = {0};
        for (int n = 0; n < N; n++)
            for (int h = h0; h < h0 + nh; h++) {
                const size_t off = n * W + (size_t)h * hd;
                const float *x = inp + off, *d = dout + off;
                float r = rstd[(size_t)n * heads + h];
                for (int c = c0; c < c1; c++) sw[c - c0] += x[c] * r * d[c];
            }
        for (int c = c0; c < c1; c++) dw[c] += sw[c - c0];
    }
}

/* The gains' gradients first, then dinp over dout's rows: dinp may be dout. */
static void qk_norm_bwd(float *dinp, float *dwq, float *dwk, const float *dout, const float *inp,
                        const float *wq, const float *wk, const float *rstd, int N, int NH,
                        int NKV, int hd, float offset) {
    const int heads = NH + NKV;
    const size_t W = (size_t)(NH + 2 * NKV) * hd;
    qk_norm_dw(dwq, dout, inp, rstd, N, 0, NH, heads, W, hd);
    qk_norm_dw(dwk, dout, inp, rstd, N, NH, NKV, heads, W, hd);
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float *d = dout + n * W, *x = inp + n * W;
        float *di = dinp + n * W;
        for (int h = 0; h < heads; h++)
            rms_row_bwd(di + (size_t)h * hd, d + (size_t)h * hd, x + (size_t)h * hd,
                        h < NH ? wq : wk, rstd[(size_t)n * heads + h], hd, offset, false);
        if (di != d) memcpy(di + (size_t)heads * hd, d + (size_t)heads * hd, sizeof(float) * (size_t)NKV * hd);
    }
}

static void matmul_fwd(float *out, const float *inp, const float *w, const float *bias,
                       int N, int C, int OC) {
    float beta = 0.0f;
    if (bias) {
        #pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++) memcpy(out + (size_t)n * OC, bias, (size_t)OC * sizeof(float));
        beta = 1.0f;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, OC, C, 1.0f, inp, C, w, C, beta,
                out, OC);
}

static void matmul_bwd(float *dinp, float *dw, float *dbias, const float *dout,
                       const float *inp, const float *w, int N, int C, int OC) {
    if (dinp)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, C, OC, 1.0f, dout, OC, w, C,
                    0.0f, dinp, C);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, C, N, 1.0f, dout, OC, inp, C,
                1.0f, dw, C);
    if (dbias) {
        int ntiles = (OC + COLS_PER_TASK - 1) / COLS_PER_TASK;
        #pragma omp parallel for schedule(static)
        for (int tile = 0; tile < ntiles; tile++) {
            int o0 = tile * COLS_PER_TASK, o1 = o0 + COLS_PER_TASK < OC ? o0 + COLS_PER_TASK : OC;
            float sb[COLS_PER_TASK] = {0};
            for (int n = 0; n < N; n++) {
                const float *d = dout + (size_t)n * OC;
                for (int o = o0; o < o1; o++) sb[o - o0] += d[o];
            }
            for (int o = o0; o < o1; o++) dbias[o] += sb[o - o0];
        }
    }
}

/* Attention over packed rows: a row of qkv (B,T,W), W = (NH + 2 NKV) hd, holds the NH
 * query heads, then the NKV key heads, then the NKV value heads; query head h reads
 * key/value head h / G, G = NH / NKV (G = 1: multi-head attention, GPT-2's).
 *
 * Tiled: tiles of ATT_BQ queries by ATT_BK keys, their products by BLAS (serial inside
 * the OpenMP region), the softmax online per query row in fp32 (running max and sum), so
 * the memory is a few tiles a thread. The forward splits over (b, head, query tile): each
 * output row is one thread's, its key tiles in order. The backward splits over (b, key
 * head, chunk of key tiles) (att_bwd_chunks: chunks only where B*NKV is under
 * ATT_BWD_TASKS and their dQ shares fit ATT_SHARES_NBYTES, their bounds from the shapes
 * alone): each runs its key tiles in order
 * and, within one, its G query heads and their query tiles in order, so dK and dV (summed
 * over query heads and tiles) have one fixed order; dQ sums over key tiles within a
 * chunk (chunk 0 in place, the others into shares of their own) and then over chunks in
 * order, whatever the thread count. A query tile's products stop at its last query's key
 * (the causal triangle past it is not computed). */
#define ATT_BQ 64
#define ATT_BK 128
#define ATT_BWD_TASKS 16 /* the backward splits keys until B*NKV*chunks reaches this */
#define ATT_SHARES_NBYTES ((size_t)64 << 20) /* and while its dQ shares take at most this:
                                                a bound whatever T, like the tiles' */

typedef struct att_dims {
    int B, T, NH, NKV, hd, G, W, window;
    float scale, softcap; /* softcap 0: none */
    const int32_t *docs;
} att_dims;

static att_dims att_dims_of(const fy_op *op, int docs_arg) {
    const int NH = (int)op->i[2], NKV = (int)op->i[3], hd = (int)op->i[4];
    return (att_dims){(int)op->i[0], (int)op->i[1], NH, NKV, hd, NH / NKV, (NH + 2 * NKV) * hd,
                      (int)op->i[5], op->f[0], op->f[1], op->p[docs_arg]};
}

/* The first key query t of sequence b sees (the last is t). */
static int att_lo(const att_dims *d, int b, int t) {
    int lo = d->docs ? d->docs[(size_t)b * d->T + t] : 0;
    if (d->window > 0 && t - d->window + 1 > lo) lo = t - d->window + 1;
    return lo;
}

/* The columns c0..c1 of the key tile j0.. (nk keys) that query t of sequence b sees;
 * none when c0 > c1. */
static void att_cols(const att_dims *d, int b, int t, int j0, int nk, int *c0, int *c1) {
    const int lo = att_lo(d, b, t);
    *c0 = (lo > j0 ? lo : j0) - j0;
    *c1 = (t < j0 + nk - 1 ? t : j0 + nk - 1) - j0;
}

/* ---- one row of a tile: the softmax's exponentials -------------------------------------
 * A row of nk scores, of which the columns c0..c1 are visible (c0 <= c1); the others
 * become 0. Two versions: the scalar one (expf, the reference, any CPU) and a 16-lane
 * AVX-512 one (picked at run time, att_wide), whose exp is Cody-Waite reduction to
 * |r| <= ln2/2 and the Taylor polynomial of degree 7 (truncation < 6e-9, below half an
 * ulp), scaled by 2^n with vscalefps (gradual underflow as expf's): within 1 ulp of the
 * correctly rounded exp at every float in [-103.9, 0] (checked exhaustively, 2026-12-03),
 * as glibc's expf. Sums run in a fixed order either way (the wide one: 16
 * lane sums, then a fixed tree), so results depend on the CPU's kind but never on the
 * threads or timing. */

/* Forward: the row's running max *m and sum *l take in the visible scores; the row
 * becomes exp(score - new max); returns the factor that rescales the row's output so
 * far, exp(old max - new max). */
static float att_fwd_row(float *sr, int nk, int c0, int c1, float *m, float *l) {
    float mx = *m;
    for (int c = c0; c <= c1; c++) mx = sr[c] > mx ? sr[c] : mx;
    const float alpha = expf(*m - mx); /* 0 on the first tile */
    float sum = 0.0f;
    for (int c = 0; c < c0; c++) sr[c] = 0.0f;
    for (int c = c0; c <= c1; c++) { sr[c] = expf(sr[c] - mx); sum += sr[c]; }
    for (int c = c1 + 1; c < nk; c++) sr[c] = 0.0f;
    *l = *l * alpha + sum;
    *m = mx;
    return alpha;
}

/* The soft cap (kernels.h) on the visible columns c0..c1 of a row of scores: each becomes
 * cap tanh(score / cap); th (may be NULL) keeps the tanh, whose derivative the backward
 * needs. A pass of its own, run only with a cap, so rows without one cost nothing more. */
static void att_cap_row(float *sr, int c0, int c1, float cap, float *th) {
    for (int c = c0; c <= c1; c++) {
        const float t = tanhf(sr[c] / cap);
        sr[c] = cap * t;
        if (th) th[c] = t;
    }
}

/* Backward: pr (scores) becomes P = exp(score - lse), dr (dP) becomes P (dP - delta). */
static void att_bwd_row(float *pr, float *dr, int nk, int c0, int c1, float lse, float delta) {
    for (int c = 0; c < nk; c++) {
        const float p = c >= c0 && c <= c1 ? expf(pr[c] - lse) : 0.0f;
        pr[c] = p;
        dr[c] = p * (dr[c] - delta);
    }
}

#ifdef ATT_X86
#define ATT_T512 __attribute__((target("avx512f")))

static inline __attribute__((always_inline)) ATT_T512 __m512 att_exp16(__m512 x) {
    /* below -104 expf is 0; the clamp also keeps -inf from making r NaN. x is the second
     * operand of each: min and max return it when it is NaN, so a NaN stays NaN (expf's) */
    x = _mm512_min_ps(_mm512_set1_ps(88.7f), _mm512_max_ps(_mm512_set1_ps(-104.0f), x));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* ln 2 = 0.693359375 (9 bits: n * it is exact) - 2.12194440e-4 */
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* the lanes of columns c..c+15 that are visible */
static inline __attribute__((always_inline)) ATT_T512 __mmask16 att_vis16(int c, int c0, int c1) {
    const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(c),
                                         _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    return _mm512_cmpge_epi32_mask(idx, _mm512_set1_epi32(c0)) &
           _mm512_cmple_epi32_mask(idx, _mm512_set1_epi32(c1));
}

static ATT_T512 float att_fwd_row_avx512(float *sr, int nk, int c0, int c1, float *m, float *l) {
    __m512 vmx = _mm512_set1_ps(*m);
    for (int c = c0 / 16 * 16; c <= c1; c += 16) {
        const __mmask16 vis = att_vis16(c, c0, c1);
        vmx = _mm512_mask_max_ps(vmx, vis, vmx, _mm512_maskz_loadu_ps(vis, sr + c));
    }
    const float mx = _mm512_reduce_max_ps(vmx); /* a max: the scalar one's bits */
    const float alpha = expf(*m - mx);
    const __m512 vm = _mm512_set1_ps(mx);
    __m512 vsum = _mm512_setzero_ps();
    for (int c = 0; c < nk; c += 16) {
        const __mmask16 in = nk - c >= 16 ? 0xffff : (__mmask16)((1u << (nk - c)) - 1);
        const __mmask16 vis = att_vis16(c, c0, c1);
        if (!vis) { _mm512_mask_storeu_ps(sr + c, in, _mm512_setzero_ps()); continue; }
        const __m512 e = _mm512_maskz_mov_ps(vis, att_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(in, sr + c), vm)));
        vsum = _mm512_add_ps(vsum, e);
        _mm512_mask_storeu_ps(sr + c, in, e);
    }
    *l = *l * alpha + _mm512_reduce_add_ps(vsum);
    *m = mx;
    return alpha;
}

static ATT_T512 void att_bwd_row_avx512(float *pr, float *dr, int nk, int c0, int c1, float lse,
                                        float delta) {
    const __m512 vl = _mm512_set1_ps(lse), vd = _mm512_set1_ps(delta);
    for (int c = 0; c < nk; c += 16) {
        const __mmask16 in = nk - c >= 16 ? 0xffff : (__mmask16)((1u << (nk - c)) - 1);
        const __mmask16 vis = att_vis16(c, c0, c1);
        if (!vis) {
            _mm512_mask_storeu_ps(pr + c, in, _mm512_setzero_ps());
            _mm512_mask_storeu_ps(dr + c, in, _mm512_setzero_ps());
            continue;
        }
        const __m512 p = _mm512_maskz_mov_ps(vis, att_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(in, pr + c), vl)));
        _mm512_mask_storeu_ps(pr + c, in, p);
        _mm512_mask_storeu_ps(dr + c, in, _mm512_mul_ps(p, _mm512_sub_ps(_mm512_maskz_loadu_ps(in, dr + c), vd)));
    }
}
#endif

/* Whether the rows take the AVX-512 path: the CPU's answer, asked once a call. */
static bool att_wide(void) {
#ifdef ATT_X86
    return __builtin_cpu_supports("avx512f");
#else
    return false;
#endif
}

/* P = softmax(mask(scale Q K^T)), Y = P V, lse = log-sum-exp of each row's scores. */
static void attention_fwd(float *out, float *lse, const float *qkv, att_dims d) {
    const int T = d.T, hd = d.hd, W = d.W, Cq = d.NH * hd, nqt = (T + ATT_BQ - 1) / ATT_BQ;
    const bool wide = att_wide();
    #pragma omp parallel
    {
        float *S = malloc(sizeof(float) * ATT_BQ * ATT_BK);
        float *acc = malloc(sizeof(float) * ATT_BQ * (size_t)hd);
        float m[ATT_BQ], l[ATT_BQ];
        FY_ASSERT(S && acc, "out of host memory for attention's tiles");
        #pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < d.B * d.NH * nqt; task++) {
            const int b = task / (d.NH * nqt), h = task / nqt % d.NH, i0 = task % nqt * ATT_BQ;
            const int nq = T - i0 < ATT_BQ ? T - i0 : ATT_BQ, kh = h / d.G;
            const float *row0 = qkv + (size_t)b * T * W;
            const float *q = row0 + (size_t)i0 * W + (size_t)h * hd;
            const float *k = row0 + Cq + (size_t)kh * hd;
            const float *v = row0 + Cq + (size_t)d.NKV * hd + (size_t)kh * hd;
            for (int r = 0; r < nq; r++) { m[r] = -INFINITY; l[r] = 0.0f; }
            memset(acc, 0, sizeof(float) * (size_t)nq * hd);
            const int j_first = att_lo(&d, b, i0) / ATT_BK * ATT_BK;
            for (int j0 = j_first; j0 < i0 + nq; j0 += ATT_BK) {
                const int nk = i0 + nq - j0 < ATT_BK ? i0 + nq - j0 : ATT_BK;
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nq, nk, hd, d.scale, q, W,
                            k + (size_t)j0 * W, W, 0.0f, S, ATT_BK);
                for (int r = 0; r < nq; r++) {
                    int c0, c1;
                    att_cols(&d, b, i0 + r, j0, nk, &c0, &c1);
                    float *sr = S + (size_t)r * ATT_BK;
                    if (c0 > c1) { memset(sr, 0, sizeof(float) * nk); continue; }
                    if (d.softcap > 0.0f) att_cap_row(sr, c0, c1, d.softcap, NULL);
                    const float alpha = wide ? att_fwd_row_avx512(sr, nk, c0, c1, &m[r], &l[r])
                                             : att_fwd_row(sr, nk, c0, c1, &m[r], &l[r]);
                    float *ar = acc + (size_t)r * hd;
                    if (alpha != 1.0f) for (int c = 0; c < hd; c++) ar[c] *= alpha;
                }
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nq, hd, nk, 1.0f, S, ATT_BK,
                            v + (size_t)j0 * W, W, 1.0f, acc, hd);
            }
            float *y = out + ((size_t)b * T + i0) * Cq + (size_t)h * hd;
            float *ls = lse + ((size_t)b * d.NH + h) * T + i0;
            for (int r = 0; r < nq; r++) {
                const float inv = 1.0f / l[r];
                for (int c = 0; c < hd; c++) y[(size_t)r * Cq + c] = acc[(size_t)r * hd + c] * inv;
                ls[r] = m[r] + logf(l[r]);
            }
        }
        free(S);
        free(acc);
    }
}

/* The backward's split of each (b, key head)'s key tiles into chunks of about equal
 * causal work (key tile j0 meets about T - j0 queries), enough for ATT_BWD_TASKS tasks in
 * all: chunk c holds tiles [first[c], first[c+1]), none empty. From the shapes alone, so
 * dQ's order of summation (chunk by chunk) never depends on the thread count. Returns
 * the number of chunks. */
static int att_bwd_chunks(const att_dims *d, int first[ATT_BWD_TASKS + 1]) {
    const int ntk = (d->T + ATT_BK - 1) / ATT_BK, pairs = d->B * d->NKV;
    const size_t share = (size_t)d->B * d->T * d->NH * d->hd * sizeof(float);
    const size_t most = 1 + ATT_SHARES_NBYTES / share; /* chunk 0 needs no share */
    int nch = (ATT_BWD_TASKS + pairs - 1) / pairs;
    nch = nch < ntk ? nch : ntk;
    nch = (size_t)nch < most ? nch : (int)most;
    double total = 0.0, acc = 0.0;
    for (int jt = 0; jt < ntk; jt++) total += d->T - jt * ATT_BK;
    first[0] = 0;
    for (int jt = 0, c = 1; c < nch; c++) {
        while (jt < ntk && acc < total * c / nch) acc += d->T - jt++ * ATT_BK;
        const int lo = first[c - 1] + 1, hi = ntk - (nch - c);
        first[c] = jt < lo ? lo : jt > hi ? hi : jt;
    }
    first[nch] = ntk;
    return nch;
}

/* dV = P^T dY, dP = dY V^T, dS = P * (dP - delta), delta = rowsum(dY * Y); dQ = scale dS K,
 * dK = scale dS^T Q, P rebuilt tile by tile from lse. With a soft cap, P is rebuilt from
 * the capped scores and dS, their gradient, becomes the raw scores' by the factor
 * 1 - tanh^2. */
static void attention_bwd(float *dqkv, float *delta, const float *dout, const float *qkv,
                          const float *out, const float *lse, att_dims d) {
    const int T = d.T, hd = d.hd, W = d.W, Cq = d.NH * hd;
    const bool wide = att_wide();
    #pragma omp parallel for schedule(static)
    for (int bt = 0; bt < d.B * T; bt++) {
        const int b = bt / T, t = bt % T;
        for (int h = 0; h < d.NH; h++) {
            const float *dy = dout + (size_t)bt * Cq + (size_t)h * hd, *y = out + (size_t)bt * Cq + (size_t)h * hd;
            float s = 0.0f;
            for (int c = 0; c < hd; c++) s += dy[c] * y[c];
            delta[((size_t)b * d.NH + h) * T + t] = s;
        }
    }
    int first[ATT_BWD_TASKS + 1];
    const int nch = att_bwd_chunks(&d, first);
    const size_t nq_all = (size_t)d.B * T * Cq;
    float *part = nch > 1 ? malloc(sizeof(float) * (nch - 1) * nq_all) : NULL; /* rows >= chunk's first key touched */
    FY_ASSERT(nch == 1 || part, "out of host memory for attention's dQ shares");
    #pragma omp parallel
    {
        float *P = malloc(sizeof(float) * ATT_BQ * ATT_BK), *dS = malloc(sizeof(float) * ATT_BQ * ATT_BK);
        float *dk = malloc(sizeof(float) * ATT_BK * (size_t)hd), *dv = malloc(sizeof(float) * ATT_BK * (size_t)hd);
        float th[ATT_BK]; /* a row's tanh of the scores over the cap */
        FY_ASSERT(P && dS && dk && dv, "out of host memory for attention's tiles");
        #pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < d.B * d.NKV * nch; task++) {
            const int b = task / nch / d.NKV, kh = task / nch % d.NKV, ch = task % nch;
            const size_t r0 = (size_t)b * T * W, koff = (size_t)Cq + (size_t)kh * hd,
                         voff = (size_t)Cq + (size_t)d.NKV * hd + (size_t)kh * hd;
            /* dQ of the group's heads: chunk 0's into dqkv, the others' into their shares */
            float *dq0 = ch == 0 ? dqkv + r0 + (size_t)kh * d.G * hd
                                 : part + (ch - 1) * nq_all + (size_t)b * T * Cq + (size_t)kh * d.G * hd;
            const int ldq = ch == 0 ? W : Cq, j_begin = first[ch] * ATT_BK;
            for (int t = ch == 0 ? 0 : j_begin; t < T; t++)
                memset(dq0 + (size_t)t * ldq, 0, sizeof(float) * (size_t)d.G * hd);
            int t_end = 0; /* queries t < t_end see keys before j0 + nk (lo is nondecreasing) */
            for (int j0 = j_begin; j0 < T && j0 < first[ch + 1] * ATT_BK; j0 += ATT_BK) {
                const int nk = T - j0 < ATT_BK ? T - j0 : ATT_BK;
                const float *k = qkv + r0 + (size_t)j0 * W + koff, *v = qkv + r0 + (size_t)j0 * W + voff;
                while (t_end < T && att_lo(&d, b, t_end) <= j0 + nk - 1) t_end++;
                memset(dk, 0, sizeof(float) * (size_t)nk * hd);
                memset(dv, 0, sizeof(float) * (size_t)nk * hd);
                for (int g = 0; g < d.G; g++) {
                    const int h = kh * d.G + g;
                    const float *ls = lse + ((size_t)b * d.NH + h) * T, *dl = delta + ((size_t)b * d.NH + h) * T;
                    for (int i0 = j0 / ATT_BQ * ATT_BQ; i0 < t_end; i0 += ATT_BQ) {
                        const int nq = t_end - i0 < ATT_BQ ? t_end - i0 : ATT_BQ;
                        /* keys past the tile's last query are hidden from all of it */
                        const int nkq = i0 + nq - j0 < nk ? i0 + nq - j0 : nk;
                        const float *q = qkv + r0 + (size_t)i0 * W + (size_t)h * hd;
                        const float *dy = dout + ((size_t)b * T + i0) * Cq + (size_t)h * hd;
                        float *dq = dq0 + (size_t)i0 * ldq + (size_t)g * hd;
                        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nq, nkq, hd, d.scale, q, W,
                                    k, W, 0.0f, P, ATT_BK);
                        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nq, nkq, hd, 1.0f, dy, Cq,
                                    v, W, 0.0f, dS, ATT_BK);
                        for (int r = 0; r < nq; r++) {
                            const int t = i0 + r;
                            int c0, c1;
                            att_cols(&d, b, t, j0, nkq, &c0, &c1);
                            float *pr = P + (size_t)r * ATT_BK, *sr = dS + (size_t)r * ATT_BK;
                            if (c0 > c1) {
                                memset(pr, 0, sizeof(float) * nkq);
                                memset(sr, 0, sizeof(float) * nkq);
                                continue;
                            }
                            if (d.softcap > 0.0f) att_cap_row(pr, c0, c1, d.softcap, th);
                            if (wide) att_bwd_row_avx512(pr, sr, nkq, c0, c1, ls[t], dl[t]);
                            else att_bwd_row(pr, sr, nkq, c0, c1, ls[t], dl[t]);
                            if (d.softcap > 0.0f)
                                for (int c = c0; c <= c1; c++) sr[c] *= 1.0f - th[c] * th[c];
                        }
                        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, nkq, hd, nq, 1.0f, P, ATT_BK,
                                    dy, Cq, 1.0f, dv, hd);
                        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nq, hd, nkq, d.scale, dS,
                                    ATT_BK, k, W, 1.0f, dq, ldq);
                        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, nkq, hd, nq, d.scale, dS,
                                    ATT_BK, q, W, 1.0f, dk, hd);
                    }
                }
                for (int r = 0; r < nk; r++) {
                    memcpy(dqkv + r0 + (size_t)(j0 + r) * W + koff, dk + (size_t)r * hd, sizeof(float) * (size_t)hd);
                    memcpy(dqkv + r0 + (size_t)(j0 + r) * W + voff, dv + (size_t)r * hd, sizeof(float) * (size_t)hd);
                }
            }
        }
        /* dQ = chunk 0's + chunk 1's + ..., in chunk order (the loop above ends in a barrier) */
        #pragma omp for schedule(static)
        for (int bt = 0; bt < (nch > 1 ? d.B * T : 0); bt++) {
            float *dq = dqkv + (size_t)bt * W;
            for (int ch = 1; ch < nch; ch++) {
                if (bt % T < first[ch] * ATT_BK) continue;
                const float *sh = part + (ch - 1) * nq_all + (size_t)bt * Cq;
                for (int c = 0; c < Cq; c++) dq[c] += sh[c];
            }
        }
        free(P);
        free(dS);
        free(dk);
        free(dv);
    }
    free(part);
}

/* Rotary embeddings on the query and key heads of packed rows (rope.h), in place, on the
 * first r->rot_dim channels of each head (resolved: fy_op_rope); the transpose (the
 * backward) with inverse != 0, at each row's place in its document (kernels.h). The
 * factors f cos and f sin for the T positions are tabulated once per call. */
static void rope(float *qkv, const int32_t *docs, int B, int T, int NH, int NKV, int hd,
                 bool inverse, const fy_rope *r) {
    const int half = r->rot_dim / 2, W = (NH + 2 * NKV) * hd, heads = NH + NKV;
    const double af = r->attn_factor;
    float *cs = malloc((size_t)T * half * 2 * sizeof *cs);
    FY_ASSERT(cs || T * half == 0, "out of host memory for rope's angles");
    for (int j = 0; j < half; j++) {
        double inv = fy_rope_inv_freq(r, j, r->rot_dim);
        for (int t = 0; t < T; t++) {
            double a = (double)t * inv;
            cs[((size_t)t * half + j) * 2] = (float)(cos(a) * af);
            cs[((size_t)t * half + j) * 2 + 1] = (float)((inverse ? -sin(a) : sin(a)) * af);
        }
    }
    #pragma omp parallel for schedule(static)
    for (int bt = 0; bt < B * T; bt++) {
        const int pos = bt % T - (docs ? docs[bt] : 0); /* its place in its document */
        const float *a = cs + (size_t)pos * half * 2;
        for (int h = 0; h < heads; h++) {
            float *x = qkv + (size_t)bt * W + (size_t)h * hd;
            for (int j = 0; j < half; j++) {
                float c = a[2 * j], sn = a[2 * j + 1], x1 = x[j], x2 = x[j + half];
                x[j] = x1 * c - x2 * sn;
                x[j + half] = x2 * c + x1 * sn;
            }
        }
    }
    free(cs);
}

#define GELU_K 0.7978845608028654f /* sqrt(2/pi) */

/* GELU, tanh approximation, and its derivative: fy_k_gelu's and GeGLU's. */
static inline float gelu_tanh(float x) {
    return 0.5f * x * (1.0f + tanhf(GELU_K * (x + 0.044715f * x * x * x)));
}
static inline float gelu_tanh_grad(float x) {
    float u = GELU_K * (x + 0.044715f * x * x * x);
    float th = tanhf(u);
    float sech2 = 1.0f - th * th;
    return 0.5f * (1.0f + th) + 0.5f * x * sech2 * GELU_K * (1.0f + 3.0f * 0.044715f * x * x);
}

static void gelu_fwd(float *out, const float *inp, size_t n) {
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) out[i] = gelu_tanh(inp[i]);
}

static void gelu_bwd(float *dinp, const float *inp, const float *dout, size_t n) {
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) dinp[i] = gelu_tanh_grad(inp[i]) * dout[i];
}

/* GLU: gu (N, 2F) holds the gate (first F) and up (last F) projections of a row;
 * out (N, F) = act(gate) * up: silu(g) = g sigmoid(g), or gelu_tanh. */
static void glu_fwd(float *out, const float *gu, size_t N, size_t F, int act) {
    #pragma omp parallel for schedule(static)
    for (size_t n = 0; n < N; n++) {
        const float *g = gu + n * 2 * F, *u = g + F;
        float *o = out + n * F;
        if (act == FY_GLU_SILU)
            for (size_t j = 0; j < F; j++) o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
        else
            for (size_t j = 0; j < F; j++) o[j] = gelu_tanh(g[j]) * u[j];
    }
}

/* dgate = dout up act'(g), dup = dout act(g), overwritten; silu'(g) = sigmoid(g) (1 + g (1 -
 * sigmoid(g))). */
static void glu_bwd(float *dgu, const float *gu, const float *dout, size_t N, size_t F, int act) {
    #pragma omp parallel for schedule(static)
    for (size_t n = 0; n < N; n++) {
        const float *g = gu + n * 2 * F, *u = g + F, *d = dout + n * F;
        float *dg = dgu + n * 2 * F, *du = dg + F;
        for (size_t j = 0; j < F; j++) {
            if (act == FY_GLU_SILU) {
                float sg = 1.0f / (1.0f + expf(-g[j]));
                dg[j] = d[j] * u[j] * sg * (1.0f + g[j] * (1.0f - sg));
                du[j] = d[j] * g[j] * sg;
            } else {
                dg[j] = d[j] * u[j] * gelu_tanh_grad(g[j]);
                du[j] = d[j] * gelu_tanh(g[j]);
            }
        }
    }
}

static void residual_fwd(float *out, const float *a, const float *b, size_t n) {
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

/* Soft-capping (kernels.h): the logit the softmax sees, z = cap tanh(l / cap), or l itself
 * with cap 0; and the gradient g of z turned into l's, g (1 - tanh^2(l / cap)). The capped
 * logits are recomputed where needed, never stored: the kernels' inputs stay the raw
 * logits. */
static inline float capped(float l, float cap) { return cap > 0.0f ? cap * tanhf(l / cap) : l; }
static inline float capped_grad(float g, float l, float cap) {
    if (!(cap > 0.0f)) return g;
    const float t = tanhf(l / cap);
    return g * (1.0f - t * t);
}

static void crossentropy(float *losses, float *logits, const int32_t *targets, int N, int V,
                         int Vp, float dloss, float cap) {
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        float *x = logits + (size_t)n * Vp;
        const int y = targets[n];
        if (y < 0) { /* a target the loss does not count (kernels.h): no loss, no gradient */
            losses[n] = 0.0f;
            if (dloss != 0.0f) memset(x, 0, (size_t)Vp * sizeof *x);
            continue;
        }
        float mx = -INFINITY;
        for (int j = 0; j < V; j++) {
            const float z = capped(x[j], cap);
            mx = z > mx ? z : mx;
        }
        double sum = 0.0;
        for (int j = 0; j < V; j++) sum += exp((double)(capped(x[j], cap) - mx));
        float lse = mx + (float)log(sum);
        losses[n] = lse - capped(x[y], cap);
        if (dloss != 0.0f) {
            float inv = (float)(1.0 / sum);
            for (int j = 0; j < V; j++) {
                float g = expf(capped(x[j], cap) - mx) * inv * dloss;
                if (j == y) g -= dloss;
                x[j] = capped_grad(g, x[j], cap);
            }
            for (int j = V; j < Vp; j++) x[j] = 0.0f;
        }
    }
}

/* fy_k_ce_chunk_fwd: per row, the chunk's max, the running max and sum rescaled to it
 * and the chunk's exps added in column order (fp64), as crossentropy's single pass. */
static void ce_chunk_fwd(const float *logits, const int32_t *targets, float *mx, double *sm,
                         float *tl, float *losses, int N, int v0, int nv, int V, float cap) {
    const int lim = V - v0 < nv ? V - v0 : nv; /* the chunk's classes */
    const bool first = v0 == 0, last = v0 + nv >= V;
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        if (targets[n] < 0) { /* not counted: its running values stay neutral */
            if (first) mx[n] = 0.0f, sm[n] = 1.0, tl[n] = 0.0f;
            if (last) losses[n] = 0.0f;
            continue;
        }
        const float *x = logits + (size_t)n * nv;
        float cm = -INFINITY;
        for (int j = 0; j < lim; j++) {
            const float z = capped(x[j], cap);
            cm = z > cm ? z : cm;
        }
        const float m = first || cm > mx[n] ? cm : mx[n];
        double s = first ? 0.0 : sm[n] * exp((double)(mx[n] - m));
        for (int j = 0; j < lim; j++) s += exp((double)(capped(x[j], cap) - m));
        const int y = targets[n] - v0;
        if (first) tl[n] = 0.0f;
        if (y >= 0 && y < lim) tl[n] = capped(x[y], cap);
        mx[n] = m;
        sm[n] = s;
        if (last) losses[n] = m + (float)log(s) - tl[n];
    }
}

static void ce_chunk_bwd(float *logits, const int32_t *targets, const float *mx, const double *sm,
                         int N, int v0, int nv, int V, float dloss, float cap) {
    const int lim = V - v0 < nv ? V - v0 : nv;
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        float *x = logits + (size_t)n * nv;
        if (targets[n] < 0) { /* not counted: no gradient */
            memset(x, 0, (size_t)nv * sizeof *x);
            continue;
        }
        const float m = mx[n], inv = (float)(1.0 / sm[n]);
        const int y = targets[n] - v0;
        for (int j = 0; j < lim; j++) {
            float g = expf(capped(x[j], cap) - m) * inv * dloss;
            if (j == y) g -= dloss;
            x[j] = capped_grad(g, x[j], cap);
        }
        for (int j = lim; j < nv; j++) x[j] = 0.0f;
    }
}

static void mean(float *out, const float *x, size_t n, int64_t div) {
    double s = 0.0;
    for (size_t i = 0; i < n; i++) s += x[i];
    out[0] = (float)(s / (double)div);
}

/* part[c]: chunk c's sum of squares (reduce.h), the chunks in parallel. */
static void sumsq_parts(double *part, const float *x, size_t n) {
    const size_t nchunks = fy_sumsq_nchunks(n);
    #pragma omp parallel for schedule(static)
    for (size_t c = 0; c < nchunks; c++) {
        size_t i0 = c * FY_SUMSQ_CHUNK;
        part[c] = fy_sumsq_chunk(x + i0, n - i0 < FY_SUMSQ_CHUNK ? n - i0 : FY_SUMSQ_CHUNK);
    }
}

static void sumsq(double *out, const float *x, size_t n) {
    size_t nchunks = fy_sumsq_nchunks(n);
    double *part = malloc((nchunks ? nchunks : 1) * sizeof *part);
    FY_ASSERT(part, "out of host memory in sumsq");
    sumsq_parts(part, x, n);
    double s = 0.0;
    for (size_t c = 0; c < nchunks; c++) s += part[c];
    free(part);
    out[0] = s;
}

#define ADAM_CHUNK 65536 /* elements per parallel piece; results do not depend on it */

static void adamw(const fy_op *op) {
    fy_adam_hparams hp = {.lr = op->f[0], .beta1 = op->f[1], .beta2 = op->f[2],
                          .eps = op->f[3], .weight_decay = op->f[4], .grad_scale = op->f[5],
                          .step = op->i[4], .check_finite = false};
    size_t n = (size_t)op->i[0];
    fy_dtype gt = (fy_dtype)op->i[1], ot = (fy_dtype)op->i[2];
    size_t gsz = fy_dtype_size(gt), osz = fy_dtype_size(ot);
    size_t nchunks = (n + ADAM_CHUNK - 1) / ADAM_CHUNK;
    #pragma omp parallel for schedule(static)
    for (size_t c = 0; c < nchunks; c++) {
        size_t i0 = c * ADAM_CHUNK, len = i0 + ADAM_CHUNK < n ? ADAM_CHUNK : n - i0;
        fy_adam_range r = {
            .param = (float *)op->p[0] + i0, .m = (float *)op->p[1] + i0,
            .v = (float *)op->p[2] + i0, .grad = (const char *)op->p[3] + i0 * gsz,
            .grad_dtype = gt,
            .param_out = op->p[4] ? (char *)op->p[4] + i0 * osz : NULL, .out_dtype = ot,
            .n = len, .decay = op->i[3] != 0};
        fy_adam_step(&hp, &r);
    }
}

/* ---- dispatch: one entry per op of the op table (ops.h), unpacking its arguments in
 * the table's order ---------------------------------------------------------------------- */

#define OP_P(k) (op->p[k])
#define OP_I(k) (op->i[k])

static void k_encoder_fwd(const fy_op *op) {
    encoder_fwd(OP_P(0), OP_P(1), OP_P(2), OP_P(3), OP_P(4), OP_I(0), OP_I(1), OP_I(2), op->f[0]);
}
static void k_encoder_bwd(const fy_op *op) {
    encoder_bwd(OP_P(0), OP_P(1), OP_P(2), OP_P(3), OP_P(4), OP_I(0), OP_I(1), OP_I(2), op->f[0]);
}
static void k_layernorm_fwd(const fy_op *op) {
    layernorm_fwd(OP_P(0), OP_P(1), OP_P(2), OP_P(3), OP_P(4), OP_P(5), OP_I(0), OP_I(1));
}
static void k_layernorm_bwd(const fy_op *op) {
    layernorm_bwd(OP_P(0), OP_P(1), OP_P(2), OP_P(3), OP_P(4), OP_P(5), OP_P(6), OP_P(7), OP_I(0), OP_I(1));
}
static void k_rmsnorm_fwd(const fy_op *op) {
    rmsnorm_fwd(OP_P(0), OP_P(1), OP_P(2), OP_P(3), OP_I(0), OP_I(1), op->f[0], op->f[1]);
}
static void k_rmsnorm_bwd(const fy_op *op) {
    rmsnorm_bwd(OP_P(0), OP_P(1), OP_P(2), OP_P(3), OP_P(4), OP_P(5), OP_I(0), OP_I(1), op->f[0]);
}
static void k_qk_norm_fwd(const fy_op *op) {
    qk_norm_fwd(OP_P(0), OP_P(1), OP_P(2), OP_P(3), OP_P(4), OP_I(0), OP_I(1), OP_I(2), OP_I(3),
                op->f[0], op->f[1]);
}
static void k_qk_norm_bwd(const fy_op *op) {
    qk_norm_bwd(OP_P(0), OP_P(1), OP_P(2), OP_P(3), OP_P(4), OP_P(5), OP_P(6), OP_P(7), OP_I(0),
                OP_I(1), OP_I(2), OP_I(3), op->f[0]);
}
static void k_matmul_fwd(const fy_op *op) { matmul_fwd(OP_P(0), OP_P(1), OP_P(2), OP_P(3), OP_I(0), OP_I(1), OP_I(2)); }
static void k_matmul_bwd(const fy_op *op) {
    matmul_bwd(OP_P(0), OP_P(1), OP_P(2), OP_P(3), OP_P(4), OP_P(5), OP_I(0), OP_I(1), OP_I(2));
}
/* dinp32 += dout @ w, dw += dout^T @ inp */
static void k_matmul_bwd_dx32(const fy_op *op) {
    const int N = OP_I(0), C = OP_I(1), OC = OP_I(2);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, C, OC, 1.0f, OP_P(2), OC, OP_P(4), C,
                1.0f, OP_P(0), C);
    matmul_bwd(NULL, OP_P(1), NULL, OP_P(2), OP_P(3), OP_P(4), N, C, OC);
}
static void k_ce_chunk_fwd(const fy_op *op) {
    ce_chunk_fwd(OP_P(0), OP_P(1), OP_P(2), OP_P(3), OP_P(4), OP_P(5), OP_I(0), OP_I(1), OP_I(2), OP_I(3),
                 op->f[0]);
}
static void k_ce_chunk_bwd(const fy_op *op) {
    ce_chunk_bwd(OP_P(0), OP_P(1), OP_P(2), OP_P(3), OP_I(0), OP_I(1), OP_I(2), OP_I(3), op->f[0],
                 op->f[1]);
}
static void k_add_f32(const fy_op *op) { residual_fwd(OP_P(0), OP_P(0), OP_P(1), (size_t)OP_I(0)); }
static void k_attention_fwd(const fy_op *op) {
    attention_fwd(OP_P(0), OP_P(1), OP_P(2), att_dims_of(op, 3));
}
static void k_attention_bwd(const fy_op *op) {
    attention_bwd(OP_P(0), OP_P(1), OP_P(2), OP_P(3), OP_P(4), OP_P(5), att_dims_of(op, 6));
}
static void k_rope(const fy_op *op) {
    const fy_rope r = fy_op_rope(op);
    rope(OP_P(0), OP_P(1), OP_I(0), OP_I(1), OP_I(2), OP_I(3), OP_I(4), OP_I(5) != 0, &r);
}
static void k_gelu_fwd(const fy_op *op) { gelu_fwd(OP_P(0), OP_P(1), (size_t)OP_I(0)); }
static void k_gelu_bwd(const fy_op *op) { gelu_bwd(OP_P(0), OP_P(1), OP_P(2), (size_t)OP_I(0)); }
static void k_glu_fwd(const fy_op *op) {
    glu_fwd(OP_P(0), OP_P(1), (size_t)OP_I(0), (size_t)OP_I(1), (int)OP_I(2));
}
static void k_glu_bwd(const fy_op *op) {
    glu_bwd(OP_P(0), OP_P(1), OP_P(2), (size_t)OP_I(0), (size_t)OP_I(1), (int)OP_I(2));
}
static void k_residual_fwd(const fy_op *op) { residual_fwd(OP_P(0), OP_P(1), OP_P(2), (size_t)OP_I(0)); }
static void k_crossentropy(const fy_op *op) {
    crossentropy(OP_P(0), OP_P(1), OP_P(2), OP_I(0), OP_I(1), OP_I(2), op->f[0], op->f[1]);
}
static void k_mean(const fy_op *op) { mean(OP_P(0), OP_P(1), (size_t)OP_I(0), OP_I(1)); }
static void k_sumsq(const fy_op *op) { sumsq(OP_P(0), OP_P(1), (size_t)OP_I(0)); }
static void k_sumsq_parts(const fy_op *op) { sumsq_parts(OP_P(0), OP_P(1), (size_t)OP_I(0)); }

#undef OP_P
#undef OP_I

typedef void (*cpu_kernel)(const fy_op *op);
static const cpu_kernel kernels[FY_OP_KERNELS] = {
    [FY_OP_ENCODER_FWD] = k_encoder_fwd, [FY_OP_ENCODER_BWD] = k_encoder_bwd,
    [FY_OP_LAYERNORM_FWD] = k_layernorm_fwd, [FY_OP_LAYERNORM_BWD] = k_layernorm_bwd,
    [FY_OP_RMSNORM_FWD] = k_rmsnorm_fwd, [FY_OP_RMSNORM_BWD] = k_rmsnorm_bwd,
    [FY_OP_QK_NORM_FWD] = k_qk_norm_fwd, [FY_OP_QK_NORM_BWD] = k_qk_norm_bwd,
    [FY_OP_MATMUL_FWD] = k_matmul_fwd, [FY_OP_MATMUL_BWD] = k_matmul_bwd,
    [FY_OP_ADD_F32] = k_add_f32,
    [FY_OP_MATMUL_BWD_DX32] = k_matmul_bwd_dx32, [FY_OP_CE_CHUNK_FWD] = k_ce_chunk_fwd,
    [FY_OP_CE_CHUNK_BWD] = k_ce_chunk_bwd,
    [FY_OP_ATTENTION_FWD] = k_attention_fwd, [FY_OP_ATTENTION_BWD] = k_attention_bwd,
    [FY_OP_ROPE] = k_rope,
    [FY_OP_GELU_FWD] = k_gelu_fwd, [FY_OP_GELU_BWD] = k_gelu_bwd,
    [FY_OP_GLU_FWD] = k_glu_fwd, [FY_OP_GLU_BWD] = k_glu_bwd,
    [FY_OP_RESIDUAL_FWD] = k_residual_fwd, [FY_OP_CROSSENTROPY] = k_crossentropy,
    [FY_OP_MEAN] = k_mean, [FY_OP_SUMSQ] = k_sumsq,
    [FY_OP_SUMSQ_PARTS] = k_sumsq_parts, [FY_OP_ADAMW] = adamw,
};

bool fy_cpu_has_kernel(fy_op_kind kind) { return kind < FY_OP_KERNELS && kernels[kind]; }

void fy_cpu_exec(const fy_op *op) {
    FY_ASSERT(op->dt == FY_DTYPE_NONE || op->dt == FY_F32, "the cpu backend's kernels are fp32");
    FY_ASSERT(fy_cpu_has_kernel(op->kind), "op not handled by the cpu backend");
    kernels[op->kind](op);
}
