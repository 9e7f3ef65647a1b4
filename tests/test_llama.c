/* test_llama.c — the Llama family on the cpu backend: its kernels (RMSNorm, rotary
 * embeddings, grouped-query attention, SwiGLU, the embedding without positions) against
 * finite differences and host references in double, with kernels.h's accumulation rules;
 * then the model (engine/model/llama.h) against the float64 PyTorch reference's fixtures
 * (tests/ref/gen_llama_ref.py), the interface's passes against finite differences, and
 * every plan against the all-resident one, bit for bit.
 *
 * Finite differences and their tolerances follow test_device.c's rule (see its header):
 * ||num - ana|| <= tol ||ana|| over the checked coordinates, tol derived next to each
 * check from the rounding of the forward and the curvature. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine/device/kernels.h"

#include "kernel_check.h"

TestSuite(llama_kernels, .init = setup, .fini = teardown, .timeout = 60);

/* ---- RMSNorm ------------------------------------------------------------------------- */

typedef struct rms_ctx {
    float *out, *rstd, *inp, *w;
    const float *R;
    float *tmp;
    int N, C;
    float eps, offset;
} rms_ctx;
static double rms_obj(void *p) {
    rms_ctx *c = p;
    fy_k_rmsnorm_fwd(c->out, c->rstd, c->inp, c->w, c->N, c->C, c->eps, c->offset, g_s);
    return dot_dev(c->out, c->R, c->tmp, (size_t)c->N * c->C);
}

static float *rows_with_offsets(rng *r, int N, int C) {
    float *x = hnewf((size_t)N * C);
    for (int n = 0; n < N; n++) {
        float off = rng_unif(r, -1, 1), scale = rng_unif(r, 0.5f, 2);
        for (int c = 0; c < C; c++) x[n * C + c] = off + scale * rng_unif(r, -1, 1);
    }
    return x;
}

Test(llama_kernels, rmsnorm_bwd_matches_fd) {
    enum { N = 14, C = 24 }; /* C = 24: one full and one partial column tile of 16 */
    rng r = {1201};
    float *R = hrand(&r, N * C, -1, 1);
    rms_ctx c = {.out = dnewf(N * C), .rstd = dnewf(N), .inp = dputf(rows_with_offsets(&r, N, C), N * C),
                 .w = dputf(hrand(&r, C, 0.5f, 1.5f), C), .R = R, .tmp = hnewf(N * C), .N = N,
                 .C = C, .eps = 1e-5f};
    rms_obj(&c);
    float *dinp = dnewf(N * C), *dw = dnewf(C);
    fy_k_rmsnorm_bwd(dinp, dw, dputf(R, N * C), c.inp, c.w, c.rstd, N, C, 0.0f, g_s);
    /* Nonlinear in inp (rstd <= ~2.5), as layernorm's: h = 5e-3; rounding ~1e-4 of
     * gradients ~1, curvature h^2/6 rstd^3 ~ 6e-5. tol 2e-3. */
    expect_fd(rms_obj, &c, &(fd_check){"rmsnorm dinp", c.inp, N * C, dgetf(dinp, N * C), 5e-3f,
                                       128, 2e-3});
    /* Linear in w: exact up to the rounding of ~N outputs over 2h = 1: ~1e-6. */
    expect_fd(rms_obj, &c, &(fd_check){"rmsnorm dw", c.w, C, dgetf(dw, C), 0.5f, 1000, 1e-4});
}

Test(llama_kernels, rmsnorm_matches_host_double_and_accumulates) {
    enum { N = 9, C = 40 };
    const float eps = 1e-6f;
    rng r = {1202};
    float *x = rows_with_offsets(&r, N, C), *w = hrand(&r, C, 0.5f, 1.5f);
    float *out = dnewf(N * C), *rstd = dnewf(N), *dx = dnewf(N * C), *dw = dnewf(C);
    float *dinp0 = hrand(&r, N * C, -1, 1), *dw0 = hrand(&r, C, -1, 1);
    put(dx, dinp0, N * C * sizeof(float));
    put(dw, dw0, C * sizeof(float));
    float *dx_ = dputf(x, N * C), *dw_ = dputf(w, C);
    fy_k_rmsnorm_fwd(out, rstd, dx_, dw_, N, C, eps, 0.0f, g_s);
    float *go = dgetf(out, N * C), *gr = dgetf(rstd, N);
    for (int n = 0; n < N; n++) {
        double ss = 0;
        for (int c = 0; c < C; c++) ss += (double)x[n * C + c] * x[n * C + c];
        double rs = 1.0 / sqrt(ss / C + eps);
        /* an fp32 sum of 40 squares and a square root: a few ulps */
        cr_expect(fabs(gr[n] - rs) <= 8 * U_F32 * rs, "rstd[%d] %.9g vs %.9g", n, gr[n], rs);
        for (int c = 0; c < C; c++) {
            double want = x[n * C + c] * rs * w[c];
            cr_expect(fabs(go[n * C + c] - want) <= 1e-6 * (1 + fabs(want)),
                      "out[%d,%d] %.9g vs %.9g", n, c, go[n * C + c], want);
        }
    }
    /* the backward adds into dinp and dw: compare with a run into zeroed buffers */
    float *R = dputf(hrand(&r, N * C, -1, 1), N * C);
    fy_k_rmsnorm_bwd(dx, dw, R, dx_, dw_, rstd, N, C, 0.0f, g_s);
    float *z1 = dnewf(N * C), *z2 = dnewf(C);
    fy_k_rmsnorm_bwd(z1, z2, R, dx_, dw_, rstd, N, C, 0.0f, g_s);
    expect_accumulated("rmsnorm dinp", dgetf(dx, N * C), dinp0, dgetf(z1, N * C), N * C);
    expect_accumulated("rmsnorm dw", dgetf(dw, C), dw0, dgetf(z2, C), C);
}

/* Gemma's (1 + w) gain: w stored near 0, the offset 1 added in the kernel. The forward
 * against a host reference in double, the backward against finite differences, and dw is
 * the offset-free formula: the same bits as with offset 0. */
Test(llama_kernels, rmsnorm_with_offset_matches_host_double_and_fd) {
    enum { N = 14, C = 24 };
    const float eps = 1e-6f, offset = 1.0f;
    rng r = {1203};
    float *R = hrand(&r, N * C, -1, 1), *x = rows_with_offsets(&r, N, C);
    float *w = hrand(&r, C, -0.5f, 0.5f);
    rms_ctx c = {.out = dnewf(N * C), .rstd = dnewf(N), .inp = dputf(x, N * C), .w = dputf(w, C),
                 .R = R, .tmp = hnewf(N * C), .N = N, .C = C, .eps = eps, .offset = offset};
    rms_obj(&c);
    float *go = dgetf(c.out, N * C);
    for (int n = 0; n < N; n++) {
        double ss = 0;
        for (int k = 0; k < C; k++) ss += (double)x[n * C + k] * x[n * C + k];
        double rs = 1.0 / sqrt(ss / C + eps);
        for (int k = 0; k < C; k++) {
            double want = x[n * C + k] * rs * ((double)w[k] + 1.0);
            /* rmsnorm_matches_host_double's bound: the gain's sum w + 1 adds one rounding */
            cr_expect(fabs(go[n * C + k] - want) <= 1e-6 * (1 + fabs(want)),
                      "out[%d,%d] %.9g vs %.9g", n, k, go[n * C + k], want);
        }
    }
    float *dinp = dnewf(N * C), *dw = dnewf(C), *dinp0 = dnewf(N * C), *dw0 = dnewf(C);
    float *dR = dputf(R, N * C);
    fy_k_rmsnorm_bwd(dinp, dw, dR, c.inp, c.w, c.rstd, N, C, offset, g_s);
    fy_k_rmsnorm_bwd(dinp0, dw0, dR, c.inp, c.w, c.rstd, N, C, 0.0f, g_s);
    /* the bounds of rmsnorm_bwd_matches_fd: the gains (0.5..1.5) are the same size */
    expect_fd(rms_obj, &c, &(fd_check){"rmsnorm (1+w) dinp", c.inp, N * C, dgetf(dinp, N * C),
                                       5e-3f, 128, 2e-3});
    expect_fd(rms_obj, &c, &(fd_check){"rmsnorm (1+w) dw", c.w, C, dgetf(dw, C), 0.5f, 1000, 1e-4});
    expect_same_bits("rmsnorm dw with and without the offset", dgetf(dw, C), dgetf(dw0, C),
                     C * sizeof(float));
}

/* ---- per-head norms of q and k ------------------------------------------------------------
 * Packed rows of NH = 4 query, NKV = 2 key and 2 value heads of hd = 24 channels (one full
 * and one partial column tile of the gains' reduction); each head with its own offset and
 * scale, so every head's rstd differs. */
enum { QN = 5, QNH = 4, QNKV = 2, QHD = 24, QW = (QNH + 2 * QNKV) * QHD, QHEADS = QNH + QNKV };

typedef struct qkn_ctx {
    float *out, *rstd, *inp, *wq, *wk;
    const float *R;
    float *tmp;
    int N;
    float eps, offset;
} qkn_ctx;
static double qkn_obj(void *p) {
    qkn_ctx *c = p;
    fy_k_qk_norm_fwd(c->out, c->rstd, c->inp, c->wq, c->wk, c->N, QNH, QNKV, QHD, c->eps,
                     c->offset, g_s);
    return dot_dev(c->out, c->R, c->tmp, (size_t)c->N * QW);
}

static void check_qk_norm(float offset, uint64_t seed) {
    const int N = QN;
    const float eps = 1e-6f;
    rng r = {seed};
    float *x = rows_with_offsets(&r, N * (QNH + 2 * QNKV), QHD); /* a "row" per head */
    float *wq = hrand(&r, QHD, 0.5f - offset, 1.5f - offset);
    float *wk = hrand(&r, QHD, 0.5f - offset, 1.5f - offset);
    float *R = hrand(&r, (size_t)N * QW, -1, 1);
    qkn_ctx c = {.out = dnewf(N * QW), .rstd = dnewf(N * QHEADS), .inp = dputf(x, N * QW),
                 .wq = dputf(wq, QHD), .wk = dputf(wk, QHD), .R = R, .tmp = hnewf(N * QW), .N = N,
                 .eps = eps, .offset = offset};
    qkn_obj(&c);
    float *go = dgetf(c.out, N * QW), *gr = dgetf(c.rstd, N * QHEADS);
    for (int n = 0; n < N; n++)
        for (int h = 0; h < QNH + 2 * QNKV; h++) {
            const float *xh = x + (size_t)n * QW + h * QHD, *oh = go + (size_t)n * QW + h * QHD;
            if (h >= QHEADS) {
                cr_expect(!memcmp(oh, xh, QHD * sizeof(float)), "value head %d of row %d not copied", h, n);
                continue;
            }
            const float *w = h < QNH ? wq : wk;
            double ss = 0;
            for (int k = 0; k < QHD; k++) ss += (double)xh[k] * xh[k];
            double rs = 1.0 / sqrt(ss / QHD + eps);
            /* rmsnorm_matches_host_double's bounds: an fp32 sum of 24 squares, a root */
            cr_expect(fabs(gr[n * QHEADS + h] - rs) <= 8 * U_F32 * rs, "rstd[%d,%d] %.9g vs %.9g",
                      n, h, gr[n * QHEADS + h], rs);
            for (int k = 0; k < QHD; k++) {
                double want = xh[k] * rs * ((double)w[k] + offset);
                cr_expect(fabs(oh[k] - want) <= 1e-6 * (1 + fabs(want)), "out[%d, head %d, %d] %.9g vs %.9g",
                          n, h, k, oh[k], want);
            }
        }
    /* dinp is overwritten (garbage first), dwq and dwk accumulate (random bases) */
    float *dinp = dputf(hrand(&r, N * QW, -9, 9), N * QW);
    float *bq = hrand(&r, QHD, -1, 1), *bk = hrand(&r, QHD, -1, 1);
    float *dwq = dputf(bq, QHD), *dwk = dputf(bk, QHD), *zq = dnewf(QHD), *zk = dnewf(QHD);
    float *dR = dputf(R, N * QW);
    fy_k_qk_norm_bwd(dinp, dwq, dwk, dR, c.inp, c.wq, c.wk, c.rstd, N, QNH, QNKV, QHD, offset, g_s);
    float *zinp = dnewf(N * QW);
    fy_k_qk_norm_bwd(zinp, zq, zk, dR, c.inp, c.wq, c.wk, c.rstd, N, QNH, QNKV, QHD, offset, g_s);
    float *gdinp = dgetf(dinp, N * QW);
    expect_same_bits("qk_norm dinp (overwritten)", gdinp, dgetf(zinp, N * QW), N * QW * sizeof(float));
    expect_accumulated("qk_norm dwq", dgetf(dwq, QHD), bq, dgetf(zq, QHD), QHD);
    expect_accumulated("qk_norm dwk", dgetf(dwk, QHD), bk, dgetf(zk, QHD), QHD);
    for (int n = 0; n < N; n++)
        cr_expect(!memcmp(gdinp + (size_t)n * QW + QHEADS * QHD, R + (size_t)n * QW + QHEADS * QHD,
                          QNKV * QHD * sizeof(float)), "row %d: value heads' dinp is not dout", n);
    /* rmsnorm_bwd_matches_fd's bounds, head by head: nonlinear in inp (rstd <= ~2.5),
     * h = 5e-3, tol 2e-3; linear in the gains (each sums N * 4 or N * 2 heads), 1e-4 */
    expect_fd(qkn_obj, &c, &(fd_check){"qk_norm dinp", c.inp, N * QW, gdinp, 5e-3f, 160, 2e-3});
    expect_fd(qkn_obj, &c, &(fd_check){"qk_norm dwq", c.wq, QHD, dgetf(zq, QHD), 0.5f, 1000, 1e-4});
    expect_fd(qkn_obj, &c, &(fd_check){"qk_norm dwk", c.wk, QHD, dgetf(zk, QHD), 0.5f, 1000, 1e-4});
    /* in place: dout's buffer becomes dinp, with the same bits, and the same gains' sums */
    float *io = dputf(R, N * QW), *iq = dnewf(QHD), *ik = dnewf(QHD);
    fy_k_qk_norm_bwd(io, iq, ik, io, c.inp, c.wq, c.wk, c.rstd, N, QNH, QNKV, QHD, offset, g_s);
    expect_same_bits("qk_norm dinp in place", dgetf(io, N * QW), gdinp, N * QW * sizeof(float));
    expect_same_bits("qk_norm dwq in place", dgetf(iq, QHD), dgetf(zq, QHD), QHD * sizeof(float));
    expect_same_bits("qk_norm dwk in place", dgetf(ik, QHD), dgetf(zk, QHD), QHD * sizeof(float));
}

Test(llama_kernels, qk_norm_matches_host_double_and_fd) { check_qk_norm(0.0f, 1301); }
Test(llama_kernels, qk_norm_with_offset_matches_host_double_and_fd) { check_qk_norm(1.0f, 1302); }

/* The gains' sums run over rows and heads in one order whatever the thread count: 1 and
 * 2 threads give the same bits (N = 200 rows: every thread has rows and column tiles). */
Test(llama_kernels, qk_norm_independent_of_thread_count) {
    enum { N = 200 };
    rng r = {1303};
    float *x = rows_with_offsets(&r, N * (QNH + 2 * QNKV), QHD), *R = hrand(&r, N * QW, -1, 1);
    float *wq = hrand(&r, QHD, 0.5f, 1.5f), *wk = hrand(&r, QHD, 0.5f, 1.5f);
    float *res[2][4];
    for (int i = 0; i < 2; i++) {
        fy_dev *d = i == 0 ? g_dev : open_dev(0, 0, 1);
        fy_stream *s = g_s;
        if (i == 1) cr_assert_eq(fy_stream_new(d, "one thread", &s), FY_OK);
        const size_t nb[8] = {N * QW, N * QW, N * QHEADS, QHD, QHD, QHD, QHD, N * QW};
        float *t[8];
        for (int k = 0; k < 8; k++) {
            void *p;
            cr_assert_eq(fy_dev_alloc(d, FY_MEM_DEVICE, nb[k] * sizeof(float), "t", &p), FY_OK);
            t[k] = p;
        }
        fy_copy_async(s, t[0], x, N * QW * sizeof(float), FY_H2D);
        fy_copy_async(s, t[3], wq, QHD * sizeof(float), FY_H2D);
        fy_copy_async(s, t[4], wk, QHD * sizeof(float), FY_H2D);
        fy_copy_async(s, t[7], R, N * QW * sizeof(float), FY_H2D);
        fy_k_qk_norm_fwd(t[1], t[2], t[0], t[3], t[4], N, QNH, QNKV, QHD, 1e-6f, 1.0f, s);
        fy_k_qk_norm_bwd(t[7], t[5], t[6], t[7], t[0], t[3], t[4], t[2], N, QNH, QNKV, QHD, 1.0f, s);
        const int keep[4] = {1, 7, 5, 6};
        for (int k = 0; k < 4; k++) {
            res[i][k] = hnewf(nb[keep[k]]);
            fy_copy_async(s, res[i][k], t[keep[k]], nb[keep[k]] * sizeof(float), FY_D2H);
        }
        fy_stream_sync(s);
        if (i == 1) { fy_stream_free(s); fy_dev_free(d); }
    }
    static const char *const names[4] = {"out", "dinp", "dwq", "dwk"};
    const size_t n[4] = {N * QW, N * QW, QHD, QHD};
    for (int k = 0; k < 4; k++) expect_same_bits(names[k], res[0][k], res[1][k], n[k] * sizeof(float));
}

/* ---- rotary embeddings -------------------------------------------------------------- */

/* The frequencies as Hugging Face's _compute_*_parameters write them for a rotation of d
 * channels: the whole vector of base frequencies, then the three llama3 bands by
 * wavelength; longrope's 1 / (ext * theta^(2j/d)). */
static void host_inv_freq(int d, const fy_rope *rp, double *inv) {
    for (int j = 0; j < d / 2; j++) inv[j] = 1.0 / pow(rp->theta, (2.0 * j) / d);
    if (rp->type == FY_ROPE_LONGROPE)
        for (int j = 0; j < d / 2; j++) inv[j] = 1.0 / (rp->ext[j] * pow(rp->theta, (2.0 * j) / d));
    if (rp->type == FY_ROPE_LINEAR)
        for (int j = 0; j < d / 2; j++) inv[j] /= rp->factor;
    if (rp->type != FY_ROPE_LLAMA3) return;
    double low_wl = rp->orig_max_pos / rp->low_freq_factor;
    double high_wl = rp->orig_max_pos / rp->high_freq_factor;
    for (int j = 0; j < d / 2; j++) {
        double wl = 2 * M_PI / inv[j];
        double scaled = wl > low_wl ? inv[j] / rp->factor : inv[j];
        bool medium = !(wl < high_wl) && !(wl > low_wl);
        if (medium) {
            double sm = (rp->orig_max_pos / wl - rp->low_freq_factor) /
                        (rp->high_freq_factor - rp->low_freq_factor);
            scaled = (1 - sm) * scaled / rp->factor + sm * scaled;
        }
        inv[j] = scaled;
    }
}

/* Phi-3's apply_rotary_pos_emb: the first d channels (rot_dim, or hd) rotated by
 * rotate_half and scaled by the attention factor f (cos and sin are f times theirs),
 * q' = f (q cos + rotate_half(q) sin), rotate_half(x) = cat(-x2, x1); the channels past d
 * passed through. In double, each result rounded once. */
static void host_rope(float *qkv, int B, int T, int NH, int NKV, int hd, const fy_rope *rp) {
    const int d = rp->rot_dim ? rp->rot_dim : hd, half = d / 2, W = (NH + 2 * NKV) * hd;
    const double f = rp->attn_factor != 0.0f ? rp->attn_factor : 1.0;
    double inv[FY_ROPE_MAX_PAIRS];
    host_inv_freq(d, rp, inv);
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int h = 0; h < NH + NKV; h++) {
                float *x = qkv + ((size_t)b * T + t) * W + (size_t)h * hd;
                double y[2 * FY_ROPE_MAX_PAIRS];
                for (int c = 0; c < d; c++) {
                    double a = t * inv[c % half];
                    double rot = c < half ? -x[c + half] : x[c - half];
                    y[c] = f * cos(a) * x[c] + f * sin(a) * rot;
                }
                for (int c = 0; c < d; c++) x[c] = (float)y[c];
            }
}

static const fy_rope rope_llama3 = {.type = FY_ROPE_LLAMA3, .theta = 500000.0f, .factor = 8.0f,
                                    .low_freq_factor = 1.0f, .high_freq_factor = 4.0f,
                                    .orig_max_pos = 8.0f};
static const fy_rope rope_plain = {.type = FY_ROPE_DEFAULT, .theta = 10000.0f};
static const fy_rope rope_linear = {.type = FY_ROPE_LINEAR, .theta = 10000.0f, .factor = 4.0f};

/* Phi-3's longrope on a rotation of d channels (0: all) with attention factor f:
 * distinct per-pair factors from 1 to ~8.5 (Phi-3's lists grow from 1 to tens). */
static fy_rope rope_longrope(int d, int hd, float f) {
    fy_rope rp = {.type = FY_ROPE_LONGROPE, .theta = 10000.0f, .rot_dim = d, .attn_factor = f};
    const int half = (d ? d : hd) / 2;
    for (int j = 0; j < half; j++) rp.ext[j] = 1.0f + 7.5f * (float)(j * j) / (float)(half * half);
    return rp;
}

/* hd 32; rot_dim 24 is Phi-4-mini's share (3/4 of the head). f = sqrt(1 + ln 32 / ln 4096),
 * Phi-3's attention factor for 32x its original length, rounded. */
#define PHI_F 1.19023807f

static void check_rope_host(const fy_rope *rp, const char *what) {
    enum { B = 2, T = 40, NH = 4, NKV = 2, hd = 32, W = (NH + 2 * NKV) * hd };
    const int d = rp->rot_dim ? rp->rot_dim : hd;
    const double f = rp->attn_factor != 0.0f ? rp->attn_factor : 1.0;
    rng r = {1301};
    float *x = hrand(&r, B * T * W, -2, 2), *want = hnewf(B * T * W);
    memcpy(want, x, sizeof(float) * B * T * W);
    host_rope(want, B, T, NH, NKV, hd, rp);
    float *dx = dputf(x, B * T * W);
    fy_k_rope(dx, NULL, B, T, NH, NKV, hd, false, rp, g_s);
    float *got = dgetf(dx, B * T * W);
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < (size_t)B * T * W; i++) {
        const int h = (int)(i % W) / hd, c = (int)(i % W) % hd;
        if (h >= NH + NKV || c >= d) { /* value heads, channels past d: untouched */
            if (memcmp(&got[i], &x[i], 4)) { if (!bad++) first = i; }
            continue;
        }
        /* two products of inputs <= 2 by fp32 f cos and f sin (each within an ulp of the
         * double ones) and their sum: ~4 ulps of 4 f */
        if (!(fabs(got[i] - want[i]) <= 16 * U_F32 * 4 * f)) { if (!bad++) first = i; }
    }
    cr_expect_eq(bad, 0, "rope %s: %zu elements differ from Hugging Face's rotate_half in "
                 "double; first [%zu] = %.9g, want %.9g", what, bad, first, got[first], want[first]);
}

Test(llama_kernels, rope_matches_rotate_half_in_double) {
    check_rope_host(&rope_llama3, "llama3");
    check_rope_host(&rope_plain, "default");
    check_rope_host(&rope_linear, "linear");
    const fy_rope partial = {.type = FY_ROPE_DEFAULT, .theta = 10000.0f, .rot_dim = 24};
    check_rope_host(&partial, "default, 24 of 32 channels");
    const fy_rope scaled = {.type = FY_ROPE_LINEAR, .theta = 10000.0f, .factor = 4.0f,
                            .attn_factor = PHI_F};
    check_rope_host(&scaled, "linear, attention factor");
    fy_rope lr = rope_longrope(0, 32, PHI_F);
    check_rope_host(&lr, "longrope, attention factor");
    lr = rope_longrope(24, 32, PHI_F);
    check_rope_host(&lr, "longrope, 24 of 32 channels, attention factor");
    lr = rope_longrope(24, 32, 0.0f);
    check_rope_host(&lr, "longrope, 24 of 32 channels, no attention factor");
}

/* The llama3 bands: with theta 5e5, hd 128 and Llama 3.1's scaling (8, 1, 4, 8192), the
 * first pair keeps its frequency (wavelength 2 pi < 2048), the last is divided by 8
 * (wavelength > 8192), and one between is blended. */
Test(llama_kernels, rope_llama3_frequency_bands) {
    const fy_rope rp = {.type = FY_ROPE_LLAMA3, .theta = 500000.0f, .factor = 8.0f,
                        .low_freq_factor = 1.0f, .high_freq_factor = 4.0f, .orig_max_pos = 8192.0f};
    double host[64];
    host_inv_freq(128, &rp, host);
    int blended = 0;
    for (int j = 0; j < 64; j++) {
        double got = fy_rope_inv_freq(&rp, j, 128);
        double base = pow(500000.0, -2.0 * j / 128);
        cr_expect(fabs(got - host[j]) <= 1e-15 * base, "inv_freq[%d] %.17g vs %.17g", j, got, host[j]);
        blended += got < base * 0.999 && got > base / 8 * 1.001;
    }
    cr_expect_eq(fy_rope_inv_freq(&rp, 0, 128), 1.0);
    double last = pow(500000.0, -126.0 / 128);
    cr_expect(fabs(fy_rope_inv_freq(&rp, 63, 128) - last / 8) <= 1e-18);
    cr_expect_gt(blended, 0, "no pair in the blended band");
}

/* Partial rotary: the frequencies of a rotation of d channels are theta^(-2j/d), over d
 * and not over the head (Hugging Face's dim = head_dim * partial_rotary_factor); longrope
 * divides pair j's by ext[j]. */
Test(llama_kernels, rope_frequencies_over_the_rotated_channels) {
    const fy_rope partial = {.type = FY_ROPE_DEFAULT, .theta = 10000.0f, .rot_dim = 96};
    const fy_rope lr = rope_longrope(96, 128, PHI_F);
    for (int j = 0; j < 48; j++) {
        const double want = pow(10000.0, -2.0 * j / 96);
        cr_expect(fabs(fy_rope_inv_freq(&partial, j, 96) - want) <= 1e-15 * want,
                  "inv_freq[%d] of 96 channels", j);
        cr_expect(fabs(fy_rope_inv_freq(&lr, j, 96) * lr.ext[j] - want) <= 1e-15 * want,
                  "longrope inv_freq[%d] times ext[%d]", j, j);
    }
}

/* rope (forward) and its transpose (inverse) with parameters rp, device buffers. */
typedef struct rope_ctx {
    float *x, *y;
    const float *R;
    float *tmp;
    int B, T, NH, NKV, hd;
    size_t n;
    const fy_rope *rp;
} rope_ctx;
static double rope_obj(void *p) {
    rope_ctx *c = p;
    fy_copy_async(g_s, c->y, c->x, c->n * sizeof(float), FY_D2D);
    fy_k_rope(c->y, NULL, c->B, c->T, c->NH, c->NKV, c->hd, false, c->rp, g_s);
    return dot_dev(c->y, c->R, c->tmp, c->n);
}

/* The transpose is the backward: the gradient of sum(rope(x) R) is rope^T(R), which is f
 * times the inverse rotation (f^-1 times the inverse would be wrong by f^2), so rope^T
 * after rope gives f^2 x on the rotated channels and x elsewhere. */
static void check_rope_backward(const fy_rope *rp, const char *what) {
    enum { B = 2, T = 9, NH = 4, NKV = 1, hd = 16, W = (NH + 2 * NKV) * hd, n = B * T * W };
    const int d = rp->rot_dim ? rp->rot_dim : hd;
    const double f = rp->attn_factor != 0.0f ? rp->attn_factor : 1.0;
    rng r = {1302};
    float *R = hrand(&r, n, -1, 1), *x = hrand(&r, n, -1, 1);
    rope_ctx c = {.x = dputf(x, n), .y = dnewf(n), .R = R, .tmp = hnewf(n), .B = B, .T = T,
                  .NH = NH, .NKV = NKV, .hd = hd, .n = n, .rp = rp};
    float *g = dputf(R, n);
    fy_k_rope(g, NULL, B, T, NH, NKV, hd, true, rp, g_s);
    /* Linear in x: exact for any h up to the rounding of the outputs (~u each, two per
     * coordinate) over 2h = 1. */
    char name[96];
    snprintf(name, sizeof name, "rope dx, %s", what);
    expect_fd(rope_obj, &c, &(fd_check){name, c.x, n, dgetf(g, n), 0.5f, 1000, 1e-5});
    float *y = dputf(x, n);
    fy_k_rope(y, NULL, B, T, NH, NKV, hd, false, rp, g_s);
    fy_k_rope(y, NULL, B, T, NH, NKV, hd, true, rp, g_s);
    float *back = dgetf(y, n);
    double worst = 0;
    for (int i = 0; i < n; i++) {
        const int h = i % W / hd, ch = i % W % hd;
        const double want = h < NH + NKV && ch < d ? f * f * x[i] : x[i];
        worst = fmax(worst, fabs(back[i] - want));
    }
    /* two rotations of values <= 1 scaled by f: a few ulps of f^2 */
    cr_expect(worst <= 1e-6 * f * f, "rope %s: its transpose after it is off f^2 x by %.3g",
              what, worst);
}

/* <A x, y> = <x, A^T y> for the rope A and its transpose, in double over the fp32 results:
 * each of those is within ~2 ulps of the exact one, so the two sums agree to ~4 u of the
 * sums of |terms|. */
static void check_rope_adjoint(const fy_rope *rp, const char *what) {
    enum { B = 2, T = 33, NH = 4, NKV = 2, hd = 32, W = (NH + 2 * NKV) * hd, n = B * T * W };
    rng r = {1303};
    float *x = hrand(&r, n, -1, 1), *y = hrand(&r, n, -1, 1);
    float *dx = dputf(x, n), *dy = dputf(y, n);
    fy_k_rope(dx, NULL, B, T, NH, NKV, hd, false, rp, g_s);
    fy_k_rope(dy, NULL, B, T, NH, NKV, hd, true, rp, g_s);
    const float *ax = dgetf(dx, n), *aty = dgetf(dy, n);
    double l = 0, rr = 0, mag = 0;
    for (int i = 0; i < n; i++) {
        l += (double)ax[i] * y[i];
        rr += (double)x[i] * aty[i];
        mag += fabs((double)ax[i] * y[i]) + fabs((double)x[i] * aty[i]);
    }
    cr_log_info("rope %s: <A x, y> %.9g, <x, A^T y> %.9g, |diff| / sum|terms| %.2e", what, l,
                rr, fabs(l - rr) / mag);
    cr_expect(fabs(l - rr) <= 8 * U_F32 * mag, "rope %s: <A x, y> = %.9g but <x, A^T y> = %.9g",
              what, l, rr);
}

Test(llama_kernels, rope_inverse_is_the_backward_and_the_adjoint) {
    const fy_rope partial = {.type = FY_ROPE_LLAMA3, .theta = 500000.0f, .factor = 8.0f,
                             .low_freq_factor = 1.0f, .high_freq_factor = 4.0f,
                             .orig_max_pos = 8.0f, .rot_dim = 12, .attn_factor = PHI_F};
    const fy_rope lr16 = rope_longrope(12, 16, PHI_F), lr32 = rope_longrope(24, 32, PHI_F);
    check_rope_backward(&rope_llama3, "llama3");
    check_rope_backward(&partial, "llama3, 12 of 16 channels, attention factor");
    check_rope_backward(&lr16, "longrope, 12 of 16 channels, attention factor");
    check_rope_adjoint(&rope_llama3, "llama3");
    check_rope_adjoint(&lr32, "longrope, 24 of 32 channels, attention factor");
}

/* ---- grouped-query attention -------------------------------------------------------- */

/* The objective reads out only (lse is the backward's input). */
typedef struct gqa_ctx {
    float *out, *lse, *qkv;
    const float *R;
    float *tmp;
    int B, T, NH, NKV, hd;
    fy_attn mask;
} gqa_ctx;
static double gqa_obj(void *p) {
    gqa_ctx *c = p;
    fy_k_attention_fwd(c->out, c->lse, c->qkv, c->B, c->T, c->NH, c->NKV, c->hd, &c->mask, g_s);
    return dot_dev(c->out, c->R, c->tmp, (size_t)c->B * c->T * c->NH * c->hd);
}

static void check_gqa_fd(int NKV, uint64_t seed) {
    enum { B = 2, T = 7, NH = 4, hd = 4 };
    const int W = (NH + 2 * NKV) * hd, nq = B * T * W, nout = B * T * NH * hd;
    rng r = {seed};
    float *R = hrand(&r, nout, -1, 1);
    gqa_ctx c = {.out = dnewf(nout), .lse = dnewf(B * NH * T),
                 .qkv = dputf(hrand(&r, nq, -1.5f, 1.5f), nq), .R = R, .tmp = hnewf(nout),
                 .B = B, .T = T, .NH = NH, .NKV = NKV, .hd = hd,
                 .mask = {.window = 0, .scale = 0.5f, .docs = NULL}};
    gqa_obj(&c);
    float *dqkv = dnewf(nq), *delta = dnewf(B * NH * T);
    fy_k_attention_bwd(dqkv, delta, dputf(R, nout), c.qkv, c.out, c.lse, B, T, NH, NKV, hd,
                       &c.mask, g_s);
    /* As GPT-2's attention (test_device.c): h = 5e-3 on inputs ~1, a coordinate of a
     * shared key or value head moves NH/NKV heads' outputs, so rounding grows by up to
     * sqrt(4); measured ~5e-5. tol 1e-3. */
    char name[48];
    snprintf(name, sizeof name, "attention dqkv (NKV %d)", NKV);
    expect_fd(gqa_obj, &c, &(fd_check){name, c.qkv, (size_t)nq, dgetf(dqkv, nq), 5e-3f, 160, 1e-3});
}

Test(llama_kernels, grouped_query_attention_bwd_matches_fd) {
    check_gqa_fd(2, 1401); /* two query heads per key/value head */
    check_gqa_fd(1, 1402); /* multi-query */
}

/* Grouped-query attention is multi-head attention with each key/value head repeated for
 * its query heads (Hugging Face's repeat_kv): the outputs agree, and a shared head's
 * gradient is the sum of its copies'. */
Test(llama_kernels, grouped_query_attention_is_repeated_kv) {
    enum { B = 2, T = 6, NH = 6, NKV = 2, G = NH / NKV, hd = 8 };
    enum { Wg = (NH + 2 * NKV) * hd, Wm = 3 * NH * hd, nout = B * T * NH * hd };
    rng r = {1403};
    float *g = hrand(&r, B * T * Wg, -1.5f, 1.5f), *m = hnewf(B * T * Wm);
    for (int bt = 0; bt < B * T; bt++)
        for (int h = 0; h < NH; h++)
            for (int d = 0; d < hd; d++) {
                const float *row = g + (size_t)bt * Wg;
                float *mrow = m + (size_t)bt * Wm;
                mrow[h * hd + d] = row[h * hd + d];
                mrow[NH * hd + h * hd + d] = row[NH * hd + (h / G) * hd + d];
                mrow[2 * NH * hd + h * hd + d] = row[(NH + NKV) * hd + (h / G) * hd + d];
            }
    float *dg = dputf(g, B * T * Wg), *dm = dputf(m, B * T * Wm);
    const fy_attn mask = {.window = 0, .scale = 1.0f / sqrtf(hd), .docs = NULL};
    float *og = dnewf(nout), *om = dnewf(nout), *lg = dnewf(B * NH * T), *lm = dnewf(B * NH * T);
    fy_k_attention_fwd(og, lg, dg, B, T, NH, NKV, hd, &mask, g_s);
    fy_k_attention_fwd(om, lm, dm, B, T, NH, NH, hd, &mask, g_s);
    float *hog = dgetf(og, nout), *hom = dgetf(om, nout);
    for (int i = 0; i < nout; i++) /* the same products in the same order */
        cr_expect(fabs(hog[i] - hom[i]) <= 1e-6, "out[%d] %.9g vs %.9g", i, hog[i], hom[i]);
    float *hlg = dgetf(lg, B * NH * T), *hlm = dgetf(lm, B * NH * T);
    for (int i = 0; i < B * NH * T; i++) /* likewise: a few ulps of |lse| <= ~5 */
        cr_expect(fabs(hlg[i] - hlm[i]) <= 1e-6, "lse[%d] %.9g vs %.9g", i, hlg[i], hlm[i]);
    float *dy = dputf(hrand(&r, nout, -1, 1), nout);
    float *gg = dnewf(B * T * Wg), *gm = dnewf(B * T * Wm), *delta = dnewf(B * NH * T);
    fy_k_attention_bwd(gg, delta, dy, dg, og, lg, B, T, NH, NKV, hd, &mask, g_s);
    fy_k_attention_bwd(gm, delta, dy, dm, om, lm, B, T, NH, NH, hd, &mask, g_s);
    float *hgg = dgetf(gg, B * T * Wg), *hgm = dgetf(gm, B * T * Wm);
    double worst = 0;
    for (int bt = 0; bt < B * T; bt++)
        for (int d = 0; d < hd; d++) {
            const float *rg = hgg + (size_t)bt * Wg, *rm = hgm + (size_t)bt * Wm;
            for (int h = 0; h < NH; h++) worst = fmax(worst, fabs(rg[h * hd + d] - rm[h * hd + d]));
            for (int kh = 0; kh < NKV; kh++) {
                double sk = 0, sv = 0;
                for (int g2 = 0; g2 < G; g2++) {
                    sk += rm[NH * hd + (kh * G + g2) * hd + d];
                    sv += rm[2 * NH * hd + (kh * G + g2) * hd + d];
                }
                worst = fmax(worst, fabs(rg[NH * hd + kh * hd + d] - sk));
                worst = fmax(worst, fabs(rg[(NH + NKV) * hd + kh * hd + d] - sv));
            }
        }
    /* sums of G = 3 fp32 shares of size ~1 added in another order: a few ulps */
    cr_expect(worst <= 1e-5, "grouped gradients differ from the repeated heads' by %.3g", worst);
}

/* ---- SwiGLU and the embedding --------------------------------------------------------- */

typedef struct glu_ctx {
    float *out, *gu;
    const float *R;
    float *tmp;
    int N, F;
    fy_glu_act act;
} glu_ctx;
static double glu_obj(void *p) {
    glu_ctx *c = p;
    fy_k_glu_fwd(c->out, c->gu, c->N, c->F, c->act, g_s);
    return dot_dev(c->out, c->R, c->tmp, (size_t)c->N * c->F);
}

/* The activations in double: silu, and GELU's tanh approximation (transformers'
 * gelu_pytorch_tanh). */
static double host_glu_act(double g, fy_glu_act act) {
    if (act == FY_GLU_SILU) return g / (1 + exp(-g));
    return 0.5 * g * (1 + tanh(sqrt(2 / M_PI) * (g + 0.044715 * g * g * g)));
}

static void check_glu(fy_glu_act act, uint64_t seed) {
    enum { N = 6, F = 20 };
    rng r = {seed};
    float *gu = hrand(&r, N * 2 * F, -4, 4);
    gu[0] = 0.0f; gu[1] = -1.28f; gu[2] = 6.0f; /* flat, silu's minimum (gelu's near -0.75), saturated */
    gu[3] = -0.75f;
    float *R = hrand(&r, N * F, -1, 1);
    glu_ctx c = {.out = dnewf(N * F), .gu = dputf(gu, N * 2 * F), .R = R, .tmp = hnewf(N * F),
                 .N = N, .F = F, .act = act};
    const char *name = act == FY_GLU_SILU ? "swiglu" : "geglu";
    glu_obj(&c);
    float *out = dgetf(c.out, N * F);
    for (int n = 0; n < N; n++)
        for (int j = 0; j < F; j++) {
            double g = gu[n * 2 * F + j], u = gu[n * 2 * F + F + j];
            double want = host_glu_act(g, act) * u;
            /* expf or tanhf (a few ulps), a handful of products and a sum: a few ulps of
             * |want| <= 16; GELU's 1 + tanh cancels for negative g, leaving an error of a
             * few ulps of 1 times 0.5 |g u| */
            double scale = fabs(want) + 1e-3 + (act == FY_GLU_GELU_TANH ? 0.5 * fabs(g * u) : 0.0);
            cr_expect(fabs(out[n * F + j] - want) <= 8 * U_F32 * scale,
                      "%s[%d,%d] %.9g vs %.9g", name, n, j, out[n * F + j], want);
        }
    float *dgu = dnewf(N * 2 * F);
    fy_k_glu_bwd(dgu, c.gu, dputf(R, N * F), N, F, act, g_s);
    /* Elementwise: rounding ~3u|out| (<= 16) over 2h = 1e-2 ~ 1e-5 absolute against
     * gradients ~1; curvature h^2/6 |act'''| (silu's <= 0.5, gelu's <= 1.5) |u| (<= 4)
     * ~ 3e-5. tol 1e-3. */
    expect_fd(glu_obj, &c, &(fd_check){name, c.gu, N * 2 * F, dgetf(dgu, N * 2 * F), 5e-3f, 1000,
                                       1e-3});
}

Test(llama_kernels, swiglu_matches_host_double_and_fd) { check_glu(FY_GLU_SILU, 1501); }
Test(llama_kernels, geglu_matches_host_double_and_fd) { check_glu(FY_GLU_GELU_TANH, 1502); }

/* GeGLU's activation is fy_k_gelu's: the gate through gelu_fwd, times up, gives the same
 * bits, and so do the gradients through gelu_bwd. */
Test(llama_kernels, geglu_is_gelu_times_up) {
    enum { N = 4, F = 33 };
    rng r = {1503};
    float *gu = hrand(&r, N * 2 * F, -5, 5), *d = hrand(&r, N * F, -1, 1);
    float *dgu = dputf(gu, N * 2 * F), *out = dnewf(N * F), *dd = dputf(d, N * F);
    float *grad = dnewf(N * 2 * F);
    fy_k_glu_fwd(out, dgu, N, F, FY_GLU_GELU_TANH, g_s);
    fy_k_glu_bwd(grad, dgu, dd, N, F, FY_GLU_GELU_TANH, g_s);
    float *gate = hnewf(N * F), *up = hnewf(N * F), *dup = hnewf(N * F);
    for (int n = 0; n < N; n++)
        for (int j = 0; j < F; j++) {
            gate[n * F + j] = gu[n * 2 * F + j];
            up[n * F + j] = gu[n * 2 * F + F + j];
            dup[n * F + j] = d[n * F + j] * up[n * F + j]; /* dout * up: gelu_bwd's dout */
        }
    float *dg = dputf(gate, N * F), *ge = dnewf(N * F), *dge = dnewf(N * F);
    fy_k_gelu_fwd(ge, dg, N * F, g_s);
    fy_k_gelu_bwd(dge, dg, dputf(dup, N * F), N * F, g_s);
    float *o = dgetf(out, N * F), *g = dgetf(grad, N * 2 * F), *hge = dgetf(ge, N * F);
    float *hdge = dgetf(dge, N * F);
    for (int n = 0; n < N; n++)
        for (int j = 0; j < F; j++) {
            const int k = n * F + j;
            cr_expect(o[k] == hge[k] * up[k], "out[%d,%d] %.9g, gelu * up %.9g", n, j, o[k], hge[k] * up[k]);
            cr_expect(g[n * 2 * F + j] == hdge[k], "dgate[%d,%d] %.9g, gelu_bwd %.9g", n, j,
                      g[n * 2 * F + j], hdge[k]);
            cr_expect(g[n * 2 * F + F + j] == d[k] * hge[k], "dup[%d,%d] %.9g, dout * gelu %.9g", n, j,
                      g[n * 2 * F + F + j], d[k] * hge[k]);
        }
}

typedef struct emb_ctx {
    float *out, *wte;
    int32_t *tok;
    const float *R;
    float *tmp;
    int B, T, C, V;
    float scale; /* 0 in the unscaled tests: read as 1 */
} emb_ctx;
static double emb_obj(void *p) {
    emb_ctx *c = p;
    fy_k_encoder_fwd(c->out, c->tok, c->wte, NULL, NULL, c->B, c->T, c->C, c->V,
                     c->scale ? c->scale : 1.0f, g_s);
    return dot_dev(c->out, c->R, c->tmp, (size_t)c->B * c->T * c->C);
}

/* Without learned positions the embedding is a row lookup: exact copies, and the
 * backward adds each row's dout into its token's row. */
Test(llama_kernels, embedding_without_positions_is_a_lookup) {
    enum { B = 2, T = 5, C = 12, V = 9 };
    rng r = {1601};
    int32_t tok[B * T];
    for (int i = 0; i < B * T; i++) tok[i] = rng_int(&r, V - 1);
    float *wte = hrand(&r, V * C, -1, 1), *R = hrand(&r, B * T * C, -1, 1);
    emb_ctx c = {.out = dnewf(B * T * C), .wte = dputf(wte, V * C), .tok = dnew(sizeof tok),
                 .R = R, .tmp = hnewf(B * T * C), .B = B, .T = T, .C = C, .V = V};
    put(c.tok, tok, sizeof tok);
    emb_obj(&c);
    float *out = dgetf(c.out, B * T * C);
    for (int i = 0; i < B * T; i++)
        cr_expect(!memcmp(out + i * C, wte + tok[i] * C, C * sizeof(float)), "row %d is not wte[%d]",
                  i, tok[i]);
    float *dwte = dnewf(V * C), *base = hrand(&r, V * C, -1, 1);
    put(dwte, base, V * C * sizeof(float));
    float *dR = dputf(R, B * T * C);
    fy_k_encoder_bwd(dwte, NULL, dR, c.tok, NULL, B, T, C, V, 1.0f, g_s);
    float *zero = dnewf(V * C);
    fy_k_encoder_bwd(zero, NULL, dR, c.tok, NULL, B, T, C, V, 1.0f, g_s);
    expect_accumulated("embedding dwte", dgetf(dwte, V * C), base, dgetf(zero, V * C), V * C);
    /* linear: exact up to the rounding of out over 2h = 1 */
    expect_fd(emb_obj, &c, &(fd_check){"embedding dwte", c.wte, V * C, dgetf(zero, V * C), 0.5f,
                                       1000, 1e-5});
}

/* Gemma's scaled embedding: out = wte[tok] * scale (+ wpe[pos]), one rounded product then
 * one rounded sum, so a host fp32 computation in the same order gives the same bits; the
 * backward adds each term's rounded product dout * scale in position order (the same
 * bits again), and dwpe is unscaled. scale 1 is exact: the plain lookup's bits. */
Test(llama_kernels, scaled_embedding_is_rounded_products) {
    enum { B = 2, T = 5, C = 12, V = 9 };
    const float scale = 6.92820323f; /* sqrt(48) rounded to fp32, as the caller does */
    rng r = {1602};
    int32_t tok[B * T];
    for (int i = 0; i < B * T; i++) tok[i] = rng_int(&r, V - 1);
    float *wte = hrand(&r, V * C, -1, 1), *wpe = hrand(&r, T * C, -1, 1);
    float *R = hrand(&r, B * T * C, -1, 1);
    int32_t *dtok = dnew(sizeof tok);
    put(dtok, tok, sizeof tok);
    float *dwte_ = dputf(wte, V * C), *dwpe_ = dputf(wpe, T * C), *out = dnewf(B * T * C);
    for (int pos = 0; pos < 2; pos++) {
        fy_k_encoder_fwd(out, dtok, dwte_, pos ? dwpe_ : NULL, NULL, B, T, C, V, scale, g_s);
        float *o = dgetf(out, B * T * C);
        size_t bad = 0;
        for (int i = 0; i < B * T; i++)
            for (int k = 0; k < C; k++) {
                float p = wte[tok[i] * C + k] * scale;
                float want = pos ? p + wpe[(i % T) * C + k] : p;
                bad += memcmp(&o[i * C + k], &want, sizeof want) != 0;
            }
        cr_expect(bad == 0, "scaled embedding%s: %zu elements are not the fp32 product%s", pos ? " + wpe" : "",
                  bad, pos ? " plus wpe" : "");
    }
    float *base = hrand(&r, V * C, -1, 1), *pbase = hrand(&r, T * C, -1, 1);
    float *dwte = dputf(base, V * C), *dwpe = dputf(pbase, T * C);
    fy_k_encoder_bwd(dwte, dwpe, dputf(R, B * T * C), dtok, NULL, B, T, C, V, scale, g_s);
    float *want = hnewf(V * C), *pwant = hnewf(T * C);
    memcpy(want, base, V * C * sizeof(float));
    memcpy(pwant, pbase, T * C * sizeof(float));
    for (int i = 0; i < B * T; i++)
        for (int k = 0; k < C; k++) {
            want[tok[i] * C + k] += R[i * C + k] * scale;
            pwant[(i % T) * C + k] += R[i * C + k];
        }
    expect_same_bits("scaled dwte", dgetf(dwte, V * C), want, V * C * sizeof(float));
    expect_same_bits("dwpe (unscaled)", dgetf(dwpe, T * C), pwant, T * C * sizeof(float));
    /* against finite differences of the scaled forward: linear, exact up to the rounding of
     * out (|out| <= 7) over 2h = 1 */
    emb_ctx c = {.out = out, .wte = dwte_, .tok = dtok, .R = R, .tmp = hnewf(B * T * C), .B = B,
                 .T = T, .C = C, .V = V, .scale = scale};
    float *g = dnewf(V * C);
    fy_k_encoder_bwd(g, NULL, dputf(R, B * T * C), dtok, NULL, B, T, C, V, scale, g_s);
    expect_fd(emb_obj, &c, &(fd_check){"scaled embedding dwte", c.wte, V * C, dgetf(g, V * C), 0.5f,
                                       1000, 1e-5});
}
