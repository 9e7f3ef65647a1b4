/* test_device.c — the device interface (engine/device/device.h) and the GPT-2 kernels
 * (kernels.h, and the layer built from them in engine/model/gpt2.h) on the cpu backend.
 *
 * Kernels: every backward is checked against central finite differences of its forward;
 * the forwards are checked against host references in double; the accumulation rules of
 * kernels.h (parameter gradients and layernorm's dinp add, other activation gradients
 * are overwritten) are checked directly; results must not change from run to run or with
 * the buffers' addresses. Device: stream order, events across streams, copies in every
 * direction, memsets, zeroed allocations, the capacity cap and its error, usage counters,
 * and the emulated PCIe link (lower bounds on copy time: a property of the emulation).
 *
 * Finite differences. The objective is L = sum(out * R) with R fixed and random, summed
 * in double on the host from the kernel's fp32 output; the analytic gradient is the
 * backward kernel's with dout = R. For a coordinate x_i the numeric gradient is
 * (L(x_i + h) - L(x_i - h)) / (x_i+h - x_i-h), the denominator taken from the fp32 values
 * actually stored. Over the checked coordinates we require
 *     ||num - ana|| <= tol * ||ana||.
 * The error of num has two parts: fp32 rounding in the forward, about u*|L_affected|/h
 * (u = 2^-24, L_affected the part of L the coordinate moves), and the curvature term
 * h^2/6 * f'''. For kernels linear in the perturbed input the second part is zero, so h
 * is large and tol tight; for the others h ~ u^(1/3) * scale ~ 5e-3..1e-2 balances the
 * two. Each tolerance below says what it covers.
 *
 * Every test opens its own device (Criterion forks per test): cpu, 2 threads. Each
 * suite has a 60 s timeout so that a lost wake-up or a wait that never ends fails the
 * test instead of hanging the run; every test takes well under 2 s on an idle machine. */
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <float.h>
#include <signal.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/core/util.h"
#include "engine/device/device.h"
#include "engine/device/device_impl.h" /* white box: the op table, ops launched as ops */
#include "engine/device/kernels.h"
#include "engine/model/gpt2.h"
#include "optim_cpu/adam.h"

#include "kernel_check.h"

/* ---- kernel objectives ------------------------------------------------------------- */

typedef struct enc_ctx {
    float *out, *wte, *wpe;
    int32_t *tok;
    const float *R;
    float *tmp;
    int B, T, C, V;
} enc_ctx;
static double enc_obj(void *p) {
    enc_ctx *c = p;
    fy_k_encoder_fwd(c->out, c->tok, c->wte, c->wpe, NULL, c->B, c->T, c->C, c->V, 1.0f, g_s);
    return dot_dev(c->out, c->R, c->tmp, (size_t)c->B * c->T * c->C);
}

typedef struct ln_ctx {
    float *out, *mean, *rstd, *inp, *w, *b;
    const float *R;
    float *tmp;
    int N, C;
} ln_ctx;
static double ln_obj(void *p) {
    ln_ctx *c = p;
    fy_k_layernorm_fwd(c->out, c->mean, c->rstd, c->inp, c->w, c->b, c->N, c->C, g_s);
    return dot_dev(c->out, c->R, c->tmp, (size_t)c->N * c->C);
}

typedef struct mm_ctx {
    float *out, *inp, *w, *bias;
    const float *R;
    float *tmp;
    int N, C, OC;
} mm_ctx;
static double mm_obj(void *p) {
    mm_ctx *c = p;
    fy_k_matmul_fwd(c->out, c->inp, c->w, c->bias, c->N, c->C, c->OC, g_s);
    return dot_dev(c->out, c->R, c->tmp, (size_t)c->N * c->OC);
}

/* The objective reads out only: lse is the backward's input, not a second output. */
typedef struct att_ctx {
    float *out, *lse, *qkv;
    const float *R;
    float *tmp;
    int B, T, C, NH;
    fy_attn mask;
} att_ctx;
static double att_obj(void *p) {
    att_ctx *c = p;
    fy_k_attention_fwd(c->out, c->lse, c->qkv, c->B, c->T, c->NH, c->NH, c->C / c->NH, &c->mask,
                       g_s);
    return dot_dev(c->out, c->R, c->tmp, (size_t)c->B * c->T * c->C);
}

typedef struct gelu_ctx {
    float *out, *inp;
    const float *R;
    float *tmp;
    size_t n;
} gelu_ctx;
static double gelu_obj(void *p) {
    gelu_ctx *c = p;
    fy_k_gelu_fwd(c->out, c->inp, c->n, g_s);
    return dot_dev(c->out, c->R, c->tmp, c->n);
}

/* The mean loss: crossentropy's backward takes a scalar dloss, i.e. R = 1/N everywhere. */
typedef struct ce_ctx {
    float *losses, *logits;
    int32_t *targets;
    float *tmp;
    int N, V;
    float softcap;
} ce_ctx;
static double ce_obj(void *p) {
    ce_ctx *c = p;
    fy_k_crossentropy(c->losses, c->logits, c->targets, c->N, c->V, c->V, 0.0f, c->softcap, g_s);
    get(c->tmp, c->losses, (size_t)c->N * sizeof(float));
    double L = 0.0;
    for (int n = 0; n < c->N; n++) L += c->tmp[n];
    return L / c->N;
}

/* ---- finite differences: kernels --------------------------------------------------- */

TestSuite(kernel_grad, .init = setup, .fini = teardown, .timeout = 60);

Test(kernel_grad, encoder_bwd_matches_fd) {
    enum { B = 2, T = 6, C = 8, V = 11, maxT = 8 };
    rng r = {101};
    int32_t tok[B * T];
    /* 12 positions over 10 tokens: some repeat (the scatter must add); token V-1 never
     * occurs and positions >= T are unused, so their gradients must stay zero. */
    for (int i = 0; i < B * T; i++) tok[i] = rng_int(&r, V - 1);
    float *R = hrand(&r, B * T * C, -1, 1);
    enc_ctx c = {.out = dnewf(B * T * C), .wte = dputf(hrand(&r, V * C, -1, 1), V * C),
                 .wpe = dputf(hrand(&r, maxT * C, -1, 1), maxT * C), .tok = dnew(sizeof tok),
                 .R = R, .tmp = hnewf(B * T * C), .B = B, .T = T, .C = C, .V = V};
    put(c.tok, tok, sizeof tok);
    float *dwte = dnewf(V * C), *dwpe = dnewf(maxT * C);
    fy_k_encoder_bwd(dwte, dwpe, dputf(R, B * T * C), c.tok, NULL, B, T, C, V, 1.0f, g_s);
    float *ana_wte = dgetf(dwte, V * C), *ana_wpe = dgetf(dwpe, maxT * C);
    /* Linear in wte and wpe: central differences are exact for any h, leaving only the
     * rounding of out = wte + wpe (u*|out| <= 1.2e-7 for each of <= 12 outputs a
     * coordinate feeds) over 2h = 1: ~1e-6 absolute on gradients of order 1. */
    expect_fd(enc_obj, &c, &(fd_check){"encoder dwte", c.wte, V * C, ana_wte, 0.5f, 1000, 1e-4});
    expect_fd(enc_obj, &c, &(fd_check){"encoder dwpe", c.wpe, maxT * C, ana_wpe, 0.5f, 1000, 1e-4});
}

Test(kernel_grad, layernorm_bwd_matches_fd) {
    enum { N = 14, C = 24 }; /* C = 24: one full and one partial column tile of 16 */
    rng r = {202};
    float *inp = hnewf(N * C);
    for (int n = 0; n < N; n++) {
        float off = rng_unif(&r, -2, 2), scale = rng_unif(&r, 0.5f, 2);
        for (int c = 0; c < C; c++) inp[n * C + c] = off + scale * rng_unif(&r, -1, 1);
    }
    float *R = hrand(&r, N * C, -1, 1);
    ln_ctx c = {.out = dnewf(N * C), .mean = dnewf(N), .rstd = dnewf(N),
                .inp = dputf(inp, N * C), .w = dputf(hrand(&r, C, 0.5f, 1.5f), C),
                .b = dputf(hrand(&r, C, -0.5f, 0.5f), C), .R = R, .tmp = hnewf(N * C),
                .N = N, .C = C};
    ln_obj(&c);
    float *dinp = dnewf(N * C), *dw = dnewf(C), *db = dnewf(C);
    fy_k_layernorm_bwd(dinp, dw, db, dputf(R, N * C), c.inp, c.w, c.mean, c.rstd, N, C, g_s);
    float *ana_inp = dgetf(dinp, N * C), *ana_w = dgetf(dw, C), *ana_b = dgetf(db, C);
    /* Nonlinear in inp (rstd <= 2.5): h = 5e-3. Rounding: a coordinate moves one row of
     * 24 outputs of size ~2, ~sqrt(24)*2u*2 / 2h ~ 1e-4 of gradients ~1; curvature
     * h^2/6 * rstd^3 ~ 6e-5. Measured ~4e-5; tol 2e-3. */
    expect_fd(ln_obj, &c, &(fd_check){"layernorm dinp", c.inp, N * C, ana_inp, 5e-3f, 128, 2e-3});
    /* Linear in w and b: exact up to rounding of ~N outputs over 2h = 1, ~1e-6. */
    expect_fd(ln_obj, &c, &(fd_check){"layernorm dw", c.w, C, ana_w, 0.5f, 1000, 1e-4});
    expect_fd(ln_obj, &c, &(fd_check){"layernorm db", c.b, C, ana_b, 0.5f, 1000, 1e-4});
}

static void check_matmul_fd(bool with_bias) {
    enum { N = 12, C = 12, OC = 20 }; /* OC = 20: a partial column tile for dbias */
    rng r = {with_bias ? 303u : 304u};
    float *R = hrand(&r, N * OC, -1, 1);
    mm_ctx c = {.out = dnewf(N * OC), .inp = dputf(hrand(&r, N * C, -1, 1), N * C),
                .w = dputf(hrand(&r, OC * C, -1, 1), OC * C),
                .bias = with_bias ? dputf(hrand(&r, OC, -1, 1), OC) : NULL,
                .R = R, .tmp = hnewf(N * OC), .N = N, .C = C, .OC = OC};
    float *dinp = dnewf(N * C), *dw = dnewf(OC * C), *dbias = with_bias ? dnewf(OC) : NULL;
    fy_k_matmul_bwd(dinp, dw, dbias, dputf(R, N * OC), c.inp, c.w, N, C, OC, g_s);
    /* Linear in each of inp, w and bias: exact for any h up to rounding of the outputs,
     * (C+1)u * sum|terms| ~ 1e-6 each, a few of them per coordinate, over 2h = 0.5:
     * ~1e-6 relative. */
    expect_fd(mm_obj, &c, &(fd_check){"matmul dinp", c.inp, N * C, dgetf(dinp, N * C),
                                      0.25f, 1000, 1e-4});
    expect_fd(mm_obj, &c, &(fd_check){"matmul dw", c.w, OC * C, dgetf(dw, OC * C), 0.25f,
                                      1000, 1e-4});
    if (with_bias)
        expect_fd(mm_obj, &c, &(fd_check){"matmul dbias", c.bias, OC, dgetf(dbias, OC), 0.25f,
                                          1000, 1e-4});
}

Test(kernel_grad, matmul_bwd_matches_fd_with_bias) { check_matmul_fd(true); }
Test(kernel_grad, matmul_bwd_matches_fd_without_bias) { check_matmul_fd(false); }

/* Two sequences of 7 positions packing documents of 3, 3, 1 and 1, 4, 2 positions
 * (kernels.h's docs: each position's document start). */
static const int32_t fd_docs[2 * 7] = {0, 0, 0, 3, 3, 3, 6, 0, 1, 1, 1, 1, 5, 5};

static void check_attention_fd(int window, bool docs, uint64_t seed) {
    enum { B = 2, T = 7, C = 16, NH = 2 };
    rng r = {seed};
    float *R = hrand(&r, B * T * C, -1, 1);
    int32_t *ddocs = NULL;
    if (docs) {
        ddocs = dnew(sizeof fd_docs);
        put(ddocs, fd_docs, sizeof fd_docs);
    }
    att_ctx c = {.out = dnewf(B * T * C), .lse = dnewf(B * NH * T),
                 .qkv = dputf(hrand(&r, B * T * 3 * C, -1.5f, 1.5f), B * T * 3 * C),
                 .R = R, .tmp = hnewf(B * T * C), .B = B, .T = T, .C = C, .NH = NH,
                 .mask = {.window = window, .scale = 1.0f / sqrtf(C / NH), .docs = ddocs}};
    att_obj(&c);
    float *dqkv = dnewf(B * T * 3 * C), *delta = dnewf(B * NH * T);
    fy_k_attention_bwd(dqkv, delta, dputf(R, B * T * C), c.qkv, c.out, c.lse, B, T, NH, NH,
                       C / NH, &c.mask, g_s);
    /* Softmax is smooth on the scale of the scores (~1): h = 5e-3 on inputs of ~1.
     * Rounding: a coordinate moves up to T*hs = 56 outputs of ~1, ~sqrt(56)*2u / 2h
     * ~ 2e-4 of gradients ~0.5, less as errors of different outputs cancel (measured
     * ~3e-5); curvature h^2/6 ~ 4e-6. tol 1e-3. A mask only removes terms. */
    char name[64];
    snprintf(name, sizeof name, "attention dqkv (window %d%s)", window, docs ? ", docs" : "");
    expect_fd(att_obj, &c, &(fd_check){name, c.qkv, B * T * 3 * C, dgetf(dqkv, B * T * 3 * C),
                                       5e-3f, 128, 1e-3});
}

Test(kernel_grad, attention_bwd_matches_fd) {
    check_attention_fd(0, false, 404); /* causal */
    check_attention_fd(3, false, 405); /* each query sees itself and 2 keys before */
    check_attention_fd(0, true, 406);  /* packed documents */
    check_attention_fd(2, true, 407);  /* both */
}

Test(kernel_grad, gelu_bwd_matches_fd) {
    enum { n = 96 };
    rng r = {505};
    float *x = hrand(&r, n, -4, 4);
    x[0] = 0.0f; x[1] = -0.7f; x[2] = 3.5f; /* the flat, curved and saturated parts */
    float *R = hrand(&r, n, -1, 1);
    gelu_ctx c = {.out = dnewf(n), .inp = dputf(x, n), .R = R, .tmp = hnewf(n), .n = n};
    float *dinp = dnewf(n);
    fy_k_gelu_bwd(dinp, c.inp, dputf(R, n), n, g_s);
    /* Elementwise: rounding ~2u*|out| (tanhf is within ~2 ulp) <= 1e-6 over 2h = 1e-2:
     * 1e-4; curvature h^2/6 * |gelu'''| (<= ~1) ~ 4e-6. tol 1e-3. */
    expect_fd(gelu_obj, &c, &(fd_check){"gelu dinp", c.inp, n, dgetf(dinp, n), 5e-3f, 1000,
                                        1e-3});
}

Test(kernel_grad, crossentropy_dlogits_match_fd) {
    enum { N = 12, V = 11 };
    rng r = {606};
    int32_t tgt[N];
    for (int n = 0; n < N; n++) tgt[n] = rng_int(&r, V);
    float *logits = hrand(&r, N * V, -3, 3);
    ce_ctx c = {.losses = dnewf(N), .logits = dputf(logits, N * V), .targets = dnew(sizeof tgt),
                .tmp = hnewf(N), .N = N, .V = V};
    put(c.targets, tgt, sizeof tgt);
    float *dlogits = dputf(logits, N * V);
    fy_k_crossentropy(dnewf(N), dlogits, c.targets, N, V, V, 1.0f / N, 0.0f, g_s);
    /* L = mean loss ~2.4. Rounding: one loss moves, ~3u*2.4/N / 2h ~ 6e-7 of gradients
     * ~(1/V)/N ~ 8e-3: 1e-4; curvature h^2/6 * |lse'''| (<= 0.4) / N ~ 1e-7. tol 2e-3. */
    expect_fd(ce_obj, &c, &(fd_check){"crossentropy dlogits", c.logits, N * V,
                                      dgetf(dlogits, N * V), 1e-2f, 1000, 2e-3});
}

Test(kernel_grad, crossentropy_losses_and_grads_match_host_log_softmax) {
    enum { N = 12, V = 11 };
    rng r = {607};
    int32_t tgt[N];
    for (int n = 0; n < N; n++) tgt[n] = rng_int(&r, V);
    float *logits = hrand(&r, N * V, -4, 4);
    for (int j = 0; j < V; j++) { logits[0 * V + j] += 90.0f; logits[1 * V + j] -= 90.0f; }
    int32_t *dtgt = dnew(sizeof tgt);
    put(dtgt, tgt, sizeof tgt);
    float *dlog = dputf(logits, N * V), *dloss = dnewf(N);
    const float scale = 1.0f / N;
    fy_k_crossentropy(dloss, dlog, dtgt, N, V, V, scale, 0.0f, g_s);
    float *losses = dgetf(dloss, N), *grad = dgetf(dlog, N * V);
    for (int n = 0; n < N; n++) {
        const float *x = logits + n * V;
        double mx = -INFINITY, sum = 0.0;
        for (int j = 0; j < V; j++) mx = fmax(mx, x[j]);
        for (int j = 0; j < V; j++) sum += exp((double)x[j] - mx);
        double lse = mx + log(sum), want = lse - x[tgt[n]];
        /* fp32: lse is rounded once or twice and then the target logit is subtracted,
         * so the error is a few ulps of |lse| (rows 0 and 1 are offset by +-90). */
        double tol = 4 * U_F32 * (fabs(lse) + fabs(want));
        cr_expect(fabs(losses[n] - want) <= tol, "loss[%d] = %.9g, host log-softmax %.9g",
                  n, losses[n], want);
        for (int j = 0; j < V; j++) {
            double g = (exp((double)x[j] - lse) - (j == tgt[n])) * scale;
            /* expf, two products and the -dloss each add <= ~1 ulp of dloss */
            cr_expect(fabs(grad[n * V + j] - g) <= 8 * U_F32 * scale,
                      "dlogits[%d,%d] = %.9g, host %.9g", n, j, grad[n * V + j], g);
        }
    }
}

/* Rows padded past the classes (the model's vocabulary padding): the padding stays out
 * of the softmax (losses and the classes' gradients are the unpadded rows' bits) and its
 * gradient is 0. */
Test(kernel_grad, crossentropy_ignores_and_zeroes_row_padding) {
    enum { N = 5, V = 11, Vp = 16 };
    rng r = {617};
    int32_t tgt[N];
    for (int n = 0; n < N; n++) tgt[n] = rng_int(&r, V);
    float *plain = hrand(&r, N * V, -4, 4), *padded = hnewf(N * Vp);
    for (int n = 0; n < N; n++)
        for (int j = 0; j < Vp; j++) padded[n * Vp + j] = j < V ? plain[n * V + j] : 60.0f;
    int32_t *dtgt = dnew(sizeof tgt);
    put(dtgt, tgt, sizeof tgt);
    float *dp = dputf(plain, N * V), *dq = dputf(padded, N * Vp), *lp = dnewf(N), *lq = dnewf(N);
    fy_k_crossentropy(lp, dp, dtgt, N, V, V, 1.0f / N, 0.0f, g_s);
    fy_k_crossentropy(lq, dq, dtgt, N, V, Vp, 1.0f / N, 0.0f, g_s);
    float *gp = dgetf(dp, N * V), *gq = dgetf(dq, N * Vp);
    cr_expect_arr_eq(dgetf(lq, N), dgetf(lp, N), N * sizeof(float), "losses differ with padding");
    for (int n = 0; n < N; n++)
        for (int j = 0; j < Vp; j++) {
            float want = j < V ? gp[n * V + j] : 0.0f;
            cr_expect(gq[n * Vp + j] == want, "dlogits[%d,%d] = %.9g, want %.9g", n, j,
                      gq[n * Vp + j], want);
        }
}

/* Gemma 2's final logit soft-capping: the losses and gradients of z = cap tanh(l / cap)
 * against a host reference in double, the gradient against finite differences of the
 * capped loss, and the vocabulary-chunked kernels: one chunk of all columns is
 * crossentropy's arithmetic (the same bits), three chunks the same sums in another
 * grouping; tlogit is the capped target logit. Logits in [-12, 12] with a cap of 5: the
 * curved and the saturated parts of tanh, and padded rows. */
Test(kernel_grad, softcapped_crossentropy_matches_host_double_fd_and_chunks) {
    enum { N = 6, V = 23, Vp = 32 };
    const float cap = 5.0f, dloss = 1.0f / N;
    rng r = {609};
    int32_t tgt[N];
    for (int n = 0; n < N; n++) tgt[n] = rng_int(&r, V);
    float *logits = hrand(&r, N * Vp, -12, 12);
    int32_t *dtgt = dnew(sizeof tgt);
    put(dtgt, tgt, sizeof tgt);
    float *dlog = dputf(logits, N * Vp), *dl = dnewf(N);
    fy_k_crossentropy(dl, dlog, dtgt, N, V, Vp, dloss, cap, g_s);
    float *losses = dgetf(dl, N), *grad = dgetf(dlog, N * Vp);
    for (int n = 0; n < N; n++) {
        const float *x = logits + n * Vp;
        double z[V], mx = -INFINITY, sum = 0.0;
        for (int j = 0; j < V; j++) { z[j] = cap * tanh(x[j] / (double)cap); mx = fmax(mx, z[j]); }
        for (int j = 0; j < V; j++) sum += exp(z[j] - mx);
        double lse = mx + log(sum), want = lse - z[tgt[n]];
        /* each capped logit is off by a few ulps of cap (tanhf, a division, a product:
         * ~4u * 5), the loss by that and a few ulps of |lse| */
        double tol = 4 * U_F32 * (fabs(lse) + fabs(want)) + 8 * U_F32 * cap;
        cr_expect(fabs(losses[n] - want) <= tol, "capped loss[%d] = %.9g, host %.9g", n, losses[n], want);
        for (int j = 0; j < Vp; j++) {
            if (j >= V) {
                cr_expect(grad[n * Vp + j] == 0.0f, "padding [%d,%d] got %g", n, j, grad[n * Vp + j]);
                continue;
            }
            double t = tanh(x[j] / (double)cap);
            double g = (exp(z[j] - lse) - (j == tgt[n])) * dloss * (1 - t * t);
            /* crossentropy_losses_and_grads_match_host_log_softmax's bound, the softmax's
             * arguments off by ~8u cap more (exp's relative error ~8u cap), and 1 - t^2 with
             * a few ulps of 1 */
            cr_expect(fabs(grad[n * Vp + j] - g) <= (8 + 16 * cap) * U_F32 * dloss,
                      "capped dlogits[%d,%d] = %.9g, host %.9g", n, j, grad[n * Vp + j], g);
        }
    }
    /* finite differences of the capped mean loss (the unpadded rows): as
     * crossentropy_dlogits_match_fd's, the curvature now also the cap's (tanh''' / cap^2 <=
     * 0.08): tol 2e-3 */
    float *plain = hnewf(N * V);
    for (int n = 0; n < N; n++) memcpy(plain + n * V, logits + n * Vp, V * sizeof(float));
    ce_ctx c = {.losses = dnewf(N), .logits = dputf(plain, N * V), .targets = dtgt, .tmp = hnewf(N),
                .N = N, .V = V, .softcap = cap};
    float *dplain = dputf(plain, N * V);
    fy_k_crossentropy(dnewf(N), dplain, dtgt, N, V, V, dloss, cap, g_s);
    expect_fd(ce_obj, &c, &(fd_check){"capped crossentropy dlogits", c.logits, N * V,
                                      dgetf(dplain, N * V), 1e-2f, 1000, 2e-3});
    /* the chunked kernels: one chunk of Vp columns, and chunks of 8, 8 and 16 */
    float *mx = dnewf(N), *tl = dnewf(N), *cl = dnewf(N);
    double *sm = dnew(N * sizeof(double));
    float *one = dputf(logits, N * Vp);
    fy_k_ce_chunk_fwd(one, dtgt, mx, sm, tl, cl, N, 0, Vp, V, cap, g_s);
    expect_same_bits("one chunk's capped losses", dgetf(cl, N), losses, N * sizeof(float));
    float *htl = dgetf(tl, N);
    for (int n = 0; n < N; n++) {
        float want = cap * tanhf(logits[n * Vp + tgt[n]] / cap);
        cr_expect(htl[n] == want, "tlogit[%d] = %.9g, the capped target logit %.9g", n, htl[n], want);
    }
    fy_k_ce_chunk_bwd(one, dtgt, mx, sm, N, 0, Vp, V, dloss, cap, g_s);
    expect_same_bits("one chunk's capped dlogits", dgetf(one, N * Vp), grad, N * Vp * sizeof(float));
    static const int v0s[3] = {0, 8, 16}, nvs[3] = {8, 8, 16};
    float *part[3];
    for (int k = 0; k < 3; k++) {
        float *h = hnewf(N * nvs[k]);
        for (int n = 0; n < N; n++) memcpy(h + n * nvs[k], logits + n * Vp + v0s[k], nvs[k] * sizeof(float));
        part[k] = dputf(h, N * nvs[k]);
        fy_k_ce_chunk_fwd(part[k], dtgt, mx, sm, tl, cl, N, v0s[k], nvs[k], V, cap, g_s);
    }
    float *chl = dgetf(cl, N);
    for (int k = 2; k >= 0; k--) {
        fy_k_ce_chunk_bwd(part[k], dtgt, mx, sm, N, v0s[k], nvs[k], V, dloss, cap, g_s);
        float *g = dgetf(part[k], N * nvs[k]);
        for (int n = 0; n < N; n++)
            for (int j = 0; j < nvs[k]; j++) {
                /* the same exps, the fp64 sum rescaled between chunks: ~1e-7 of dloss */
                float want = grad[n * Vp + v0s[k] + j];
                cr_expect(fabs(g[n * nvs[k] + j] - want) <= 1e-6 * dloss,
                          "chunk %d dlogits[%d,%d] = %.9g, one pass %.9g", k, n, j, g[n * nvs[k] + j], want);
            }
    }
    for (int n = 0; n < N; n++)
        cr_expect(fabs(chl[n] - losses[n]) <= 4 * U_F32 * (fabs(losses[n]) + 20),
                  "chunked capped loss[%d] = %.9g, one pass %.9g", n, chl[n], losses[n]);
}

Test(kernel_grad, crossentropy_with_zero_dloss_leaves_logits) {
    enum { N = 6, V = 11 };
    rng r = {608};
    int32_t tgt[N] = {0, 10, 3, 3, 7, 1};
    float *logits = hrand(&r, N * V, -3, 3);
    int32_t *dtgt = dnew(sizeof tgt);
    put(dtgt, tgt, sizeof tgt);
    float *dlog = dputf(logits, N * V);
    fy_k_crossentropy(dnewf(N), dlog, dtgt, N, V, V, 0.0f, 0.0f, g_s);
    expect_same_bits("logits after dloss = 0", dgetf(dlog, N * V), logits, N * V * sizeof(float));
}

/* Negative targets (the data's loss mask, kernels.h): such a row's loss is 0 and its
 * gradient row 0, its padding included, whatever its logits (NaN here: not read); every
 * other row has the bits of the same kernel run on those rows alone (rows are
 * independent), plain and soft-capped. */
enum { MN = 9, MV = 23, MVP = 32 };
static const int32_t mask_tgt[MN] = {4, -1, 22, 0, -1, 17, 9, 3, -1};

/* The rows of mask_tgt's counted targets, compacted (rows of width w): their count. */
static int compact_rows(float *dst, int32_t *tdst, const float *src, int w) {
    int k = 0;
    for (int n = 0; n < MN; n++) {
        if (mask_tgt[n] < 0) continue;
        memcpy(dst + (size_t)k * w, src + (size_t)n * w, (size_t)w * sizeof(float));
        tdst[k++] = mask_tgt[n];
    }
    return k;
}

/* The losses (MN) and gradient (MN x w) of rows with uncounted targets against the
 * compacted run's (lc, gc: k rows). */
static void expect_masked_rows(const char *what, const float *l, const float *g, const float *lc,
                               const float *gc, int w) {
    int k = 0;
    for (int n = 0; n < MN; n++) {
        if (mask_tgt[n] < 0) {
            cr_expect(l[n] == 0.0f, "%s: row %d's loss is %g, not 0", what, n, l[n]);
            for (int j = 0; j < w; j++)
                cr_expect(g[n * w + j] == 0.0f, "%s: row %d's gradient [%d] is %g, not 0", what, n,
                          j, g[n * w + j]);
            continue;
        }
        cr_expect(!memcmp(&l[n], &lc[k], sizeof(float)), "%s: row %d's loss %.9g, alone %.9g", what,
                  n, l[n], lc[k]);
        cr_expect(!memcmp(g + n * w, gc + k * w, (size_t)w * sizeof(float)),
                  "%s: row %d's gradient differs from the row's alone", what, n);
        k++;
    }
}

/* The rows of the masked-target tests: random logits (NaN in the rows whose target does
 * not count: they must not be read), the counted rows alone (clog, k of them), and both
 * target lists on the device (dt: mask_tgt; dct: the counted ones). */
typedef struct masked_rows { float *logits, *clog; int k; int32_t *dt, *dct; } masked_rows;

static masked_rows masked_rows_new(uint64_t seed) {
    rng r = {seed};
    masked_rows m = {.logits = hrand(&r, MN * MVP, -6, 6), .clog = hnewf(MN * MVP)};
    for (int n = 0; n < MN; n++)
        if (mask_tgt[n] < 0)
            for (int j = 0; j < MVP; j++) m.logits[n * MVP + j] = NAN;
    int32_t ctgt[MN];
    m.k = compact_rows(m.clog, ctgt, m.logits, MVP);
    m.dt = dnew(sizeof mask_tgt);
    m.dct = dnew(sizeof ctgt);
    put(m.dt, mask_tgt, sizeof mask_tgt);
    put(m.dct, ctgt, (size_t)m.k * sizeof(int32_t));
    return m;
}

Test(kernel_grad, crossentropy_negative_targets_give_zero_rows_and_leave_the_others) {
    for (int capped = 0; capped < 2; capped++) {
        const float cap = capped ? 5.0f : 0.0f, dloss = 1.0f / 6;
        const masked_rows m = masked_rows_new(619 + (uint64_t)capped);
        float *dl = dputf(m.logits, MN * MVP), *dcl = dputf(m.clog, (size_t)m.k * MVP);
        float *loss = dnewf(MN), *closs = dnewf(MN);
        fy_k_crossentropy(loss, dl, m.dt, MN, MV, MVP, dloss, cap, g_s);
        fy_k_crossentropy(closs, dcl, m.dct, m.k, MV, MVP, dloss, cap, g_s);
        const char *what = capped ? "capped crossentropy" : "crossentropy";
        expect_masked_rows(what, dgetf(loss, MN), dgetf(dl, MN * MVP), dgetf(closs, m.k),
                           dgetf(dcl, (size_t)m.k * MVP), MVP);
        /* the forward alone (dloss 0) gives the same losses */
        float *dl0 = dputf(m.logits, MN * MVP), *loss0 = dnewf(MN);
        fy_k_crossentropy(loss0, dl0, m.dt, MN, MV, MVP, 0.0f, cap, g_s);
        expect_same_bits("losses without the backward", dgetf(loss0, MN), dgetf(loss, MN),
                         MN * sizeof(float));
    }
}

/* The vocabulary-chunked kernels (chunks of 8, 8 and 16 columns of 23 classes padded to
 * 32): the same, each chunk's gradient rows of uncounted targets 0, the other rows the
 * chunked run's on those rows alone. */
Test(kernel_grad, chunked_crossentropy_negative_targets_give_zero_rows_and_leave_the_others) {
    static const int v0s[3] = {0, 8, 16}, nvs[3] = {8, 8, 16};
    for (int capped = 0; capped < 2; capped++) {
        const float cap = capped ? 5.0f : 0.0f, dloss = 1.0f / 6;
        const masked_rows m = masked_rows_new(629 + (uint64_t)capped);
        float *mx = dnewf(MN), *tl = dnewf(MN), *loss = dnewf(MN);
        float *cmx = dnewf(MN), *ctl = dnewf(MN), *closs = dnewf(MN);
        double *sm = dnew(MN * sizeof(double)), *csm = dnew(MN * sizeof(double));
        float *part[3], *cpart[3];
        for (int c = 0; c < 3; c++) {
            float *h = hnewf(MN * nvs[c]), *hc = hnewf(MN * nvs[c]);
            for (int n = 0; n < MN; n++)
                memcpy(h + n * nvs[c], m.logits + n * MVP + v0s[c], nvs[c] * sizeof(float));
            for (int n = 0; n < m.k; n++)
                memcpy(hc + n * nvs[c], m.clog + n * MVP + v0s[c], nvs[c] * sizeof(float));
            part[c] = dputf(h, MN * nvs[c]);
            cpart[c] = dputf(hc, (size_t)m.k * nvs[c]);
            fy_k_ce_chunk_fwd(part[c], m.dt, mx, sm, tl, loss, MN, v0s[c], nvs[c], MV, cap, g_s);
            fy_k_ce_chunk_fwd(cpart[c], m.dct, cmx, csm, ctl, closs, m.k, v0s[c], nvs[c], MV, cap, g_s);
        }
        const float *hl = dgetf(loss, MN), *hcl = dgetf(closs, m.k);
        for (int c = 2; c >= 0; c--) {
            fy_k_ce_chunk_bwd(part[c], m.dt, mx, sm, MN, v0s[c], nvs[c], MV, dloss, cap, g_s);
            fy_k_ce_chunk_bwd(cpart[c], m.dct, cmx, csm, m.k, v0s[c], nvs[c], MV, dloss, cap, g_s);
            char what[64];
            snprintf(what, sizeof what, "%schunk %d", capped ? "capped " : "", c);
            expect_masked_rows(what, hl, dgetf(part[c], MN * nvs[c]), hcl,
                               dgetf(cpart[c], (size_t)m.k * nvs[c]), nvs[c]);
        }
    }
}

/* ---- finite differences: the GPT-2 layer ------------------------------------------- */

typedef struct layer_fix {
    fy_gpt2_config cfg;
    fy_model *model;
    const fy_block_spec *blk;
    int B, T;
    size_t NC;
    float *wbase, *gbase, *x_in, *dx;
    fy_gpt2_layer_w w, g;
    fy_gpt2_layer_acts a;
    fy_gpt2_layer_work wk;
    const float *R;
    float *tmp;
} layer_fix;

/* A 1-layer GPT-2 (C 16, NH 2) with parameters drawn so every nonlinearity works in
 * its curved range: gains 1 +- 0.3, biases +- 0.2, weights of unit output variance. */
/* chunk: the positions of the layer's sequence chunks (fy_model_chunk). */
static void layer_fix_init(layer_fix *f, uint64_t seed, int chunk) {
    memset(f, 0, sizeof *f);
    f->cfg = (fy_gpt2_config){.vocab = 11, .max_seq = 8, .channels = 16, .layers = 1, .heads = 2};
    f->B = 2;
    f->T = 5;
    f->NC = (size_t)f->B * f->T * f->cfg.channels;
    cr_assert_eq(fy_gpt2_new(&f->cfg, NULL, &f->model), FY_OK);
    f->blk = fy_model_block(f->model, 1);
    rng r = {seed};
    float *host = hnewf(f->blk->nelem);
    for (int i = 0; i < f->blk->ntensors; i++) {
        const fy_tensor_spec *t = &f->blk->tensors[i];
        float *p = host + t->offset;
        size_t n = (size_t)t->rows * t->cols;
        bool gain = t->cols == 1 && strstr(t->name, ".weight");
        float a = t->cols == 1 ? (gain ? 0.3f : 0.2f) : sqrtf(3.0f / t->cols);
        for (size_t j = 0; j < n; j++) p[j] = (gain ? 1.0f : 0.0f) + rng_unif(&r, -a, a);
    }
    f->wbase = dputf(host, f->blk->nelem);
    f->gbase = dnewf(f->blk->nelem);
    fy_gpt2_layer_view(f->blk, FY_F32, f->wbase, &f->w);
    fy_gpt2_layer_view(f->blk, FY_F32, f->gbase, &f->g);
    fy_gpt2_layer_acts_bind(&f->cfg, f->B, f->T, FY_F32,
                            dnew(fy_gpt2_layer_acts_nbytes(&f->cfg, f->B, f->T, FY_F32)), &f->a);
    f->a.out = dnewf(f->NC); /* the output is bound apart from the other activations */
    fy_gpt2_layer_work_bind(&f->cfg, f->B, f->T, chunk, FY_F32,
                            dnew(fy_gpt2_layer_work_nbytes(&f->cfg, f->B, f->T, chunk, FY_F32)), &f->wk);
    f->dx = dnewf(f->NC);
    f->x_in = dputf(hrand(&r, f->NC, -1.5f, 1.5f), f->NC);
    f->R = hrand(&r, f->NC, -1, 1);
    f->tmp = hnewf(f->NC);
}

static double layer_obj(void *p) {
    layer_fix *f = p;
    fy_gpt2_layer_fwd(&f->cfg, &f->w, &f->a, f->x_in, &f->wk, NULL, f->B, f->T, g_s);
    return dot_dev(f->a.out, f->R, f->tmp, f->NC);
}

/* Backward with d out = R; parameter gradients add into gbase. Returns d x_in. */
static float *layer_bwd(layer_fix *f) {
    put(f->dx, f->R, f->NC * sizeof(float));
    fy_gpt2_layer_bwd(&f->cfg, &f->w, &f->g, &f->a, f->x_in, &f->wk, f->dx, NULL, f->B, f->T,
                      g_s);
    return dgetf(f->dx, f->NC);
}

Test(kernel_grad, gpt2_layer_bwd_matches_fd) {
    layer_fix f;
    layer_fix_init(&f, 707, 4); /* chunks of 4 of the 10 positions (4, 4, 2): the chunked loops */
    layer_obj(&f);
    float *ana_x = layer_bwd(&f);
    float *ana_p = dgetf(f.gbase, f.blk->nelem);
    /* Ten kernels deep: rounding of out (~2 over 80 outputs) grows to ~10u per output,
     * ~sqrt(80)*10u*2 / 2h ~ 2e-4 absolute at h = 5e-3 against gradients of 0.1..3, so
     * ~1e-4 relative; curvature h^2/6 * O(1-10) ~ 4e-5. Measured <= 1.3e-4; tol 2e-3.
     * 24 coordinates per tensor (32 of x_in) keep the test well under a second. */
    const double tol = 2e-3;
    expect_fd(layer_obj, &f, &(fd_check){"layer d x_in", f.x_in, f.NC, ana_x, 5e-3f, 32, tol});
    for (int i = 0; i < f.blk->ntensors; i++) {
        const fy_tensor_spec *t = &f.blk->tensors[i];
        expect_fd(layer_obj, &f, &(fd_check){t->name, f.wbase + t->offset,
                                             (size_t)t->rows * t->cols, ana_p + t->offset,
                                             5e-3f, 24, tol});
    }
    fy_model_free(f.model);
}

/* ---- accumulation rules ------------------------------------------------------------ */

TestSuite(accumulate, .init = setup, .fini = teardown, .timeout = 60);

Test(accumulate, encoder_bwd_adds_into_dwte_dwpe) {
    enum { B = 2, T = 6, C = 8, V = 11 };
    rng r = {111};
    int32_t tok[B * T];
    for (int i = 0; i < B * T; i++) tok[i] = rng_int(&r, V);
    int32_t *dtok = dnew(sizeof tok);
    put(dtok, tok, sizeof tok);
    float *dout = dputf(hrand(&r, B * T * C, -1, 1), B * T * C);
    float *dwte = dnewf(V * C), *dwpe = dnewf(T * C);
    fy_k_encoder_bwd(dwte, dwpe, dout, dtok, NULL, B, T, C, V, 1.0f, g_s);
    float *wte1 = dgetf(dwte, V * C), *wpe1 = dgetf(dwpe, T * C);
    fy_k_encoder_bwd(dwte, dwpe, dout, dtok, NULL, B, T, C, V, 1.0f, g_s);
    expect_accumulated("encoder dwte", dgetf(dwte, V * C), wte1, wte1, V * C);
    expect_accumulated("encoder dwpe", dgetf(dwpe, T * C), wpe1, wpe1, T * C);
}

Test(accumulate, layernorm_bwd_adds_into_dinp_dw_db) {
    enum { N = 10, C = 24 };
    rng r = {222};
    float *inp = dputf(hrand(&r, N * C, -2, 2), N * C), *w = dputf(hrand(&r, C, 0.5f, 1.5f), C);
    float *b = dputf(hrand(&r, C, -1, 1), C), *out = dnewf(N * C), *mean = dnewf(N);
    float *rstd = dnewf(N), *dout = dputf(hrand(&r, N * C, -1, 1), N * C);
    fy_k_layernorm_fwd(out, mean, rstd, inp, w, b, N, C, g_s);
    /* into zeros: the increment itself */
    float *dinp = dnewf(N * C), *dw = dnewf(C), *db = dnewf(C);
    fy_k_layernorm_bwd(dinp, dw, db, dout, inp, w, mean, rstd, N, C, g_s);
    float *inc_inp = dgetf(dinp, N * C), *inc_w = dgetf(dw, C), *inc_b = dgetf(db, C);
    /* into prefilled buffers: base + increment */
    float *base_inp = hrand(&r, N * C, -1, 1), *base_w = hrand(&r, C, -1, 1);
    float *base_b = hrand(&r, C, -1, 1);
    put(dinp, base_inp, N * C * sizeof(float));
    put(dw, base_w, C * sizeof(float));
    put(db, base_b, C * sizeof(float));
    fy_k_layernorm_bwd(dinp, dw, db, dout, inp, w, mean, rstd, N, C, g_s);
    expect_accumulated("layernorm dinp", dgetf(dinp, N * C), base_inp, inc_inp, N * C);
    expect_accumulated("layernorm dw", dgetf(dw, C), base_w, inc_w, C);
    expect_accumulated("layernorm db", dgetf(db, C), base_b, inc_b, C);
}

Test(accumulate, matmul_bwd_adds_into_dw_dbias) {
    enum { N = 12, C = 12, OC = 20 };
    rng r = {333};
    float *inp = dputf(hrand(&r, N * C, -1, 1), N * C);
    float *w = dputf(hrand(&r, OC * C, -1, 1), OC * C);
    float *dout = dputf(hrand(&r, N * OC, -1, 1), N * OC);
    float *dinp = dnewf(N * C), *dw = dnewf(OC * C), *dbias = dnewf(OC);
    fy_k_matmul_bwd(dinp, dw, dbias, dout, inp, w, N, C, OC, g_s);
    float *w1 = dgetf(dw, OC * C), *b1 = dgetf(dbias, OC);
    fy_k_matmul_bwd(dinp, dw, dbias, dout, inp, w, N, C, OC, g_s);
    expect_accumulated("matmul dw", dgetf(dw, OC * C), w1, w1, OC * C);
    expect_accumulated("matmul dbias", dgetf(dbias, OC), b1, b1, OC);
}

Test(accumulate, matmul_bwd_overwrites_dinp) {
    enum { N = 12, C = 12, OC = 20 };
    rng r = {334};
    float *inp = dputf(hrand(&r, N * C, -1, 1), N * C);
    float *w = dputf(hrand(&r, OC * C, -1, 1), OC * C);
    float *dout = dputf(hrand(&r, N * OC, -1, 1), N * OC);
    float *dinp = dnewf(N * C);
    fy_k_matmul_bwd(dinp, dnewf(OC * C), NULL, dout, inp, w, N, C, OC, g_s);
    float *clean = dgetf(dinp, N * C);
    put(dinp, hrand(&r, N * C, 100, 1000), N * C * sizeof(float)); /* stale contents */
    fy_k_matmul_bwd(dinp, dnewf(OC * C), NULL, dout, inp, w, N, C, OC, g_s);
    expect_same_bits("matmul dinp over stale contents", dgetf(dinp, N * C), clean,
                     N * C * sizeof(float));
}

Test(accumulate, matmul_bwd_without_dinp_gives_same_dw) {
    enum { N = 12, C = 12, OC = 20 };
    rng r = {335};
    float *inp = dputf(hrand(&r, N * C, -1, 1), N * C);
    float *w = dputf(hrand(&r, OC * C, -1, 1), OC * C);
    float *dout = dputf(hrand(&r, N * OC, -1, 1), N * OC);
    float *dw1 = dnewf(OC * C), *dw2 = dnewf(OC * C), *db1 = dnewf(OC), *db2 = dnewf(OC);
    fy_k_matmul_bwd(dnewf(N * C), dw1, db1, dout, inp, w, N, C, OC, g_s);
    fy_k_matmul_bwd(NULL, dw2, db2, dout, inp, w, N, C, OC, g_s);
    expect_same_bits("matmul dw with dinp NULL", dgetf(dw2, OC * C), dgetf(dw1, OC * C),
                     OC * C * sizeof(float));
    expect_same_bits("matmul dbias with dinp NULL", dgetf(db2, OC), dgetf(db1, OC),
                     OC * sizeof(float));
}

Test(accumulate, attention_bwd_overwrites_dqkv) {
    enum { B = 2, T = 6, C = 16, NH = 2 };
    rng r = {444};
    const fy_attn mask = {.window = 0, .scale = 1.0f / sqrtf(C / NH), .docs = NULL};
    float *qkv = dputf(hrand(&r, B * T * 3 * C, -1, 1), B * T * 3 * C);
    float *out = dnewf(B * T * C), *lse = dnewf(B * NH * T);
    float *dout = dputf(hrand(&r, B * T * C, -1, 1), B * T * C);
    fy_k_attention_fwd(out, lse, qkv, B, T, NH, NH, C / NH, &mask, g_s);
    float *dqkv = dnewf(B * T * 3 * C), *delta = dnewf(B * NH * T);
    fy_k_attention_bwd(dqkv, delta, dout, qkv, out, lse, B, T, NH, NH, C / NH, &mask, g_s);
    float *clean = dgetf(dqkv, B * T * 3 * C);
    /* stale contents in dqkv and in the workspace delta */
    put(dqkv, hrand(&r, B * T * 3 * C, 100, 1000), B * T * 3 * C * sizeof(float));
    put(delta, hrand(&r, B * NH * T, 100, 1000), B * NH * T * sizeof(float));
    fy_k_attention_bwd(dqkv, delta, dout, qkv, out, lse, B, T, NH, NH, C / NH, &mask, g_s);
    expect_same_bits("attention dqkv over stale contents", dgetf(dqkv, B * T * 3 * C), clean,
                     B * T * 3 * C * sizeof(float));
}

Test(accumulate, gelu_bwd_overwrites_dinp) {
    enum { n = 200 };
    rng r = {555};
    float *x = dputf(hrand(&r, n, -4, 4), n), *dout = dputf(hrand(&r, n, -1, 1), n);
    float *dinp = dnewf(n);
    fy_k_gelu_bwd(dinp, x, dout, n, g_s);
    float *clean = dgetf(dinp, n);
    put(dinp, hrand(&r, n, 100, 1000), n * sizeof(float));
    fy_k_gelu_bwd(dinp, x, dout, n, g_s);
    expect_same_bits("gelu dinp over stale contents", dgetf(dinp, n), clean, n * sizeof(float));
}

Test(accumulate, gpt2_layer_bwd_adds_param_grads) {
    layer_fix f;
    layer_fix_init(&f, 777, FY_MODEL_CHUNK); /* one chunk: a gradient's one GEMM adds exactly */
    layer_obj(&f);
    float *dx1 = layer_bwd(&f);
    float *g1 = dgetf(f.gbase, f.blk->nelem);
    float *dx2 = layer_bwd(&f);
    float *g2 = dgetf(f.gbase, f.blk->nelem);
    for (int i = 0; i < f.blk->ntensors; i++) {
        const fy_tensor_spec *t = &f.blk->tensors[i];
        size_t off = t->offset, n = (size_t)t->rows * t->cols;
        expect_accumulated(t->name, g2 + off, g1 + off, g1 + off, n);
    }
    /* d x_in is an activation gradient: the same both times, not doubled */
    expect_same_bits("layer d x_in on the second backward", dx2, dx1, f.NC * sizeof(float));
    fy_model_free(f.model);
}

/* ---- forwards against host references ---------------------------------------------- */

TestSuite(kernel_fwd, .init = setup, .fini = teardown, .timeout = 60);

Test(kernel_fwd, encoder_and_residual_are_exact_sums) {
    enum { B = 2, T = 5, C = 12, V = 11 };
    rng r = {121};
    int32_t tok[B * T];
    for (int i = 0; i < B * T; i++) tok[i] = rng_int(&r, V);
    int32_t *dtok = dnew(sizeof tok);
    put(dtok, tok, sizeof tok);
    float *wte = hrand(&r, V * C, -1, 1), *wpe = hrand(&r, T * C, -1, 1);
    float *out = dnewf(B * T * C);
    fy_k_encoder_fwd(out, dtok, dputf(wte, V * C), dputf(wpe, T * C), NULL, B, T, C, V, 1.0f, g_s);
    float *got = dgetf(out, B * T * C), *want = hnewf(B * T * C);
    for (int bt = 0; bt < B * T; bt++)
        for (int c = 0; c < C; c++) want[bt * C + c] = wte[tok[bt] * C + c] + wpe[(bt % T) * C + c];
    /* one fp32 addition per element: the host's sum has the same bits */
    expect_same_bits("encoder out", got, want, B * T * C * sizeof(float));
    float *a = hrand(&r, 100, -1, 1), *b = hrand(&r, 100, -1, 1), *sum = dnewf(100);
    fy_k_residual_fwd(sum, dputf(a, 100), dputf(b, 100), 100, g_s);
    for (int i = 0; i < 100; i++) want[i] = a[i] + b[i];
    expect_same_bits("residual out", dgetf(sum, 100), want, 100 * sizeof(float));
}

Test(kernel_fwd, layernorm_matches_host_double) {
    enum { N = 9, C = 24 };
    rng r = {131};
    float *x = hrand(&r, N * C, -2, 2), *w = hrand(&r, C, 0.5f, 1.5f), *b = hrand(&r, C, -1, 1);
    float *out = dnewf(N * C), *mean = dnewf(N), *rstd = dnewf(N);
    fy_k_layernorm_fwd(out, mean, rstd, dputf(x, N * C), dputf(w, C), dputf(b, C), N, C, g_s);
    float *go = dgetf(out, N * C), *gm = dgetf(mean, N), *gr = dgetf(rstd, N);
    for (int n = 0; n < N; n++) {
        double m = 0, v = 0;
        for (int c = 0; c < C; c++) m += x[n * C + c];
        m /= C;
        for (int c = 0; c < C; c++) v += (x[n * C + c] - m) * (x[n * C + c] - m);
        double rs = 1.0 / sqrt(v / C + 1e-5);
        /* fp32 sums of C = 24 terms: <= C*u relative on mean and variance, 1e-5 covers
         * it with margin; outputs are ~2, hence 2e-5 absolute there */
        cr_expect(fabs(gm[n] - m) <= 1e-5 * (1 + fabs(m)), "mean[%d] %.9g vs %.9g", n, gm[n], m);
        cr_expect(fabs(gr[n] - rs) <= 1e-5 * rs, "rstd[%d] %.9g vs %.9g", n, gr[n], rs);
        for (int c = 0; c < C; c++) {
            double want = (x[n * C + c] - m) * rs * w[c] + b[c];
            cr_expect(fabs(go[n * C + c] - want) <= 2e-5, "out[%d,%d] %.9g vs %.9g", n, c,
                      go[n * C + c], want);
        }
    }
}

static void check_matmul_fwd(bool with_bias) {
    enum { N = 7, C = 24, OC = 20 };
    rng r = {with_bias ? 141u : 142u};
    float *x = hrand(&r, N * C, -1, 1), *w = hrand(&r, OC * C, -1, 1), *bias = hrand(&r, OC, -1, 1);
    float *out = dnewf(N * OC);
    fy_k_matmul_fwd(out, dputf(x, N * C), dputf(w, OC * C), with_bias ? dputf(bias, OC) : NULL,
                    N, C, OC, g_s);
    float *got = dgetf(out, N * OC);
    for (int n = 0; n < N; n++)
        for (int o = 0; o < OC; o++) {
            double s = with_bias ? bias[o] : 0.0, mag = fabs(s);
            for (int c = 0; c < C; c++) {
                s += (double)x[n * C + c] * w[o * C + c];
                mag += fabs((double)x[n * C + c] * w[o * C + c]);
            }
            /* the classical bound for an fp32 dot product of C+1 terms: (C+1)u sum|terms| */
            cr_expect(fabs(got[n * OC + o] - s) <= (C + 2) * U_F32 * mag,
                      "out[%d,%d] %.9g vs %.9g (bias %d)", n, o, got[n * OC + o], s, with_bias);
        }
}

Test(kernel_fwd, matmul_with_bias_matches_host_double) { check_matmul_fwd(true); }
Test(kernel_fwd, matmul_without_bias_matches_host_double) { check_matmul_fwd(false); }

Test(kernel_fwd, attention_matches_host_double) {
    enum { B = 2, T = 6, C = 16, NH = 2, hs = C / NH };
    rng r = {151};
    const fy_attn mask = {.window = 0, .scale = 1.0f / sqrtf(hs), .docs = NULL};
    float *qkv = hrand(&r, B * T * 3 * C, -1.5f, 1.5f);
    float *out = dnewf(B * T * C), *lse = dnewf(B * NH * T);
    put(lse, hrand(&r, B * NH * T, 5, 6), B * NH * T * sizeof(float)); /* stale */
    fy_k_attention_fwd(out, lse, dputf(qkv, B * T * 3 * C), B, T, NH, NH, C / NH, &mask, g_s);
    float *go = dgetf(out, B * T * C), *gl = dgetf(lse, B * NH * T);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < T; t++) {
                const float *q = qkv + (b * T + t) * 3 * C + h * hs;
                double p[T], mx = -INFINITY, sum = 0;
                for (int j = 0; j <= t; j++) {
                    const float *k = qkv + (b * T + j) * 3 * C + C + h * hs;
                    double s = 0;
                    for (int d = 0; d < hs; d++) s += (double)q[d] * k[d];
                    p[j] = s / sqrt((double)hs);
                    mx = fmax(mx, p[j]);
                }
                for (int j = 0; j <= t; j++) sum += (p[j] = exp(p[j] - mx));
                const double want_lse = mx + log(sum);
                const float got_lse = gl[(b * NH + h) * T + t];
                /* scores |s| <= 8 * 1.5^2 / sqrt(8) ~ 6.4 from an fp32 dot of 8 terms
                 * scaled (<= ~9u relative each, <= 6e-6 absolute), an fp32 running max,
                 * expf and a sum of <= 6 terms and one logf: a few 1e-7 beside the score
                 * error (measured <= 1.5e-7); 1e-5 */
                cr_expect(fabs(got_lse - want_lse) <= 1e-5, "lse[%d,%d,%d] %.9g vs %.9g", b,
                          h, t, got_lse, want_lse);
                for (int d = 0; d < hs; d++) {
                    double y = 0;
                    for (int j = 0; j <= t; j++)
                        y += p[j] / sum * qkv[(b * T + j) * 3 * C + 2 * C + h * hs + d];
                    float got = go[(b * T + t) * C + h * hs + d];
                    /* a convex combination of values <= 1.5 with probabilities off by
                     * a few 1e-6 relative (the score errors above; measured <= 1.3e-7):
                     * 1e-5 */
                    cr_expect(fabs(got - y) <= 1e-5, "out[%d,%d,%d] %.9g vs %.9g", b, t,
                              h * hs + d, got, y);
                }
            }
}

Test(kernel_fwd, gelu_matches_host_double) {
    enum { n = 257 };
    rng r = {161};
    float *x = hrand(&r, n, -6, 6);
    float *out = dnewf(n);
    fy_k_gelu_fwd(out, dputf(x, n), n, g_s);
    float *got = dgetf(out, n);
    for (int i = 0; i < n; i++) {
        double xi = x[i];
        double want = 0.5 * xi * (1 + tanh(0.7978845608028654 * (xi + 0.044715 * xi * xi * xi)));
        /* tanhf within ~2 ulp and a handful of fp32 roundings on values <= |x| */
        cr_expect(fabs(got[i] - want) <= 8 * U_F32 * (1 + fabs(xi)), "gelu(%.9g) = %.9g vs %.9g",
                  xi, got[i], want);
    }
}

Test(kernel_fwd, mean_and_sumsq_match_host_double) {
    enum { n = 100003 }; /* several sumsq chunks and a ragged tail */
    rng r = {171};
    float *x = hrand(&r, n, -3, 3);
    float *dx = dputf(x, n), *dmean = dnewf(1);
    double *dsq = dnew(sizeof(double));
    fy_k_mean(dmean, dx, n, (int64_t)n, g_s);
    fy_k_sumsq(dsq, dx, n, g_s);
    float mean;
    double sq;
    get(&mean, dmean, sizeof mean);
    get(&sq, dsq, sizeof sq);
    double s = 0, s2 = 0;
    for (int i = 0; i < n; i++) { s += x[i]; s2 += (double)x[i] * x[i]; }
    /* kernels.h: the mean is summed in double in index order, so it has these bits */
    cr_expect(mean == (float)(s / n), "mean %.9g vs %.9g", mean, (float)(s / n));
    /* double sums of 1e5 positive terms in another order: ~1e5 * 1.1e-16 relative */
    cr_expect(fabs(sq - s2) <= 1e-10 * s2, "sumsq %.17g vs %.17g", sq, s2);
}

/* A given divisor (a masked loss's count of targets): the same index-order double sum,
 * divided by it, whatever n; a divisor of n is the mean. */
Test(kernel_fwd, mean_divides_by_the_given_divisor) {
    enum { n = 1003 };
    rng r = {172};
    float *x = hrand(&r, n, -3, 3);
    float *dx = dputf(x, n), *dout = dnewf(1);
    double s = 0;
    for (int i = 0; i < n; i++) s += x[i];
    static const int64_t divs[] = {1, 37, n, 4 * n + 1, (int64_t)1 << 40};
    for (size_t k = 0; k < sizeof divs / sizeof divs[0]; k++) {
        fy_k_mean(dout, dx, n, divs[k], g_s);
        float got;
        get(&got, dout, sizeof got);
        const float want = (float)(s / (double)divs[k]);
        cr_expect(!memcmp(&got, &want, sizeof got), "sum / %lld: %.9g, want %.9g",
                  (long long)divs[k], got, want);
    }
    /* the first 10 of them, by 4 (a micro-batch's losses over the step's count) */
    fy_k_mean(dout, dx, 10, 4, g_s);
    float got;
    get(&got, dout, sizeof got);
    double s10 = 0;
    for (int i = 0; i < 10; i++) s10 += x[i];
    cr_expect(got == (float)(s10 / 4), "sum of 10 / 4: %.9g, want %.9g", got, (float)(s10 / 4));
}

Test(kernel_fwd, adamw_kernel_bit_identical_to_fy_adam_step) {
    const size_t n = 150001; /* three of the kernel's parallel chunks, a ragged tail */
    rng r = {181};
    float *p = hrand(&r, n, -1, 1), *m = hrand(&r, n, -0.01f, 0.01f);
    float *v = hrand(&r, n, 0, 1e-4f), *grad = hrand(&r, n, -0.1f, 0.1f);
    fy_adam_hparams hp = {.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
                          .weight_decay = 0.1f, .step = 7, .grad_scale = 0.5f};
    fy_adam_range dr = {.param = dputf(p, n), .m = dputf(m, n), .v = dputf(v, n),
                        .grad = dputf(grad, n), .grad_dtype = FY_F32, .n = n, .decay = true};
    fy_k_adamw(&hp, &dr, g_s);
    fy_stream_sync(g_s);
    fy_adam_range hr = {.param = p, .m = m, .v = v, .grad = grad, .grad_dtype = FY_F32,
                        .n = n, .decay = true};
    cr_assert_eq(fy_adam_step(&hp, &hr), FY_OK);
    expect_same_bits("adamw param", dgetf(dr.param, n), p, n * sizeof(float));
    expect_same_bits("adamw m", dgetf(dr.m, n), m, n * sizeof(float));
    expect_same_bits("adamw v", dgetf(dr.v, n), v, n * sizeof(float));
}

/* ---- determinism ------------------------------------------------------------------- */

/* Every kernel once, on one set of tensors laid out in one device buffer with a chosen
 * misalignment: tensor k starts at base + off + sum over earlier tensors of
 * (round_up(n, 16) + gap) floats. */
enum { KB = 2, KT = 7, KC = 16, KNH = 2, KV = 11, KN = KB * KT, KOC = 20 };
#define KSET(X)                                                                           \
    X(tok, KN, 1) X(wte, KV * KC, 1) X(wpe, KT * KC, 1) X(enc_dout, KN * KC, 1)           \
    X(enc_out, KN * KC, 0) X(dwte, KV * KC, 0) X(dwpe, KT * KC, 0)                        \
    X(ln_inp, KN * KC, 1) X(ln_w, KC, 1) X(ln_b, KC, 1) X(ln_dout, KN * KC, 1)            \
    X(ln_out, KN * KC, 0) X(ln_mean, KN, 0) X(ln_rstd, KN, 0) X(ln_dinp, KN * KC, 0)      \
    X(ln_dw, KC, 0) X(ln_db, KC, 0)                                                       \
    X(mm_inp, KN * KC, 1) X(mm_w, KOC * KC, 1) X(mm_bias, KOC, 1) X(mm_dout, KN * KOC, 1) \
    X(mm_out, KN * KOC, 0) X(mm_dinp, KN * KC, 0) X(mm_dw, KOC * KC, 0) X(mm_dbias, KOC, 0) \
    X(qkv, KN * 3 * KC, 1) X(att_dout, KN * KC, 1) X(att_out, KN * KC, 0)                 \
    X(att_lse, KB * KNH * KT, 0) X(dqkv, KN * 3 * KC, 0) X(att_delta, KB * KNH * KT, 2)    \
    X(gelu_inp, KN * 4 * KC, 1) X(gelu_dout, KN * 4 * KC, 1) X(gelu_out, KN * 4 * KC, 0)  \
    X(gelu_dinp, KN * 4 * KC, 0) X(res_out, KN * KC, 0)                                   \
    X(logits, KN * KV, 1) X(targets, KN, 1) X(losses, KN, 0) X(mean_out, 1, 0)
/* role: 1 input, 0 output, 2 workspace (contents not part of any contract) */

enum {
#define KSET_ID(name, n, role) K_##name,
    KSET(KSET_ID)
#undef KSET_ID
    K_COUNT
};
static const size_t kset_n[] = {
#define KSET_N(name, n, role) n,
    KSET(KSET_N)
#undef KSET_N
};
static const int kset_role[] = {
#define KSET_ROLE(name, n, role) role,
    KSET(KSET_ROLE)
#undef KSET_ROLE
};
static const char *kset_name[] = {
#define KSET_NAME(name, n, role) #name,
    KSET(KSET_NAME)
#undef KSET_NAME
};

static size_t kset_span(size_t gap) {
    size_t total = 0;
    for (int k = 0; k < K_COUNT; k++) total += fy_round_up(kset_n[k], 16) + gap;
    return total;
}

/* Host images of the inputs (token ids stored as int32 bits in the float slots). */
static void kset_inputs(float *img[K_COUNT]) {
    rng r = {999};
    for (int k = 0; k < K_COUNT; k++) {
        img[k] = kset_role[k] == 1 ? hrand(&r, kset_n[k], -1.5f, 1.5f) : NULL;
    }
    for (int i = 0; i < KN; i++) {
        int32_t t = rng_int(&r, KV), y = rng_int(&r, KV);
        memcpy(&img[K_tok][i], &t, 4);
        memcpy(&img[K_targets][i], &y, 4);
    }
    for (int c = 0; c < KC; c++) img[K_ln_w][c] += 1.0f;
}

/* Runs every kernel with the tensors at base + off (gap floats between them) and returns
 * host copies of all tensors afterwards; sumsq goes to its own (aligned) slot. */
static void kset_run(float *const img[K_COUNT], float *base, size_t off, size_t gap,
                     float *res[K_COUNT], double *sumsq) {
    float *t[K_COUNT];
    size_t at = off;
    for (int k = 0; k < K_COUNT; k++) {
        t[k] = base + at;
        at += fy_round_up(kset_n[k], 16) + gap;
    }
    fy_memset_async(g_s, base, 0, at * sizeof(float));
    for (int k = 0; k < K_COUNT; k++)
        if (img[k]) fy_copy_async(g_s, t[k], img[k], kset_n[k] * sizeof(float), FY_H2D);
#define T(name) t[K_##name]
    const int32_t *tok = (const int32_t *)T(tok), *tgt = (const int32_t *)T(targets);
    fy_k_encoder_fwd(T(enc_out), tok, T(wte), T(wpe), NULL, KB, KT, KC, KV, 1.0f, g_s);
    fy_k_encoder_bwd(T(dwte), T(dwpe), T(enc_dout), tok, NULL, KB, KT, KC, KV, 1.0f, g_s);
    fy_k_layernorm_fwd(T(ln_out), T(ln_mean), T(ln_rstd), T(ln_inp), T(ln_w), T(ln_b), KN, KC, g_s);
    fy_k_layernorm_bwd(T(ln_dinp), T(ln_dw), T(ln_db), T(ln_dout), T(ln_inp), T(ln_w),
                       T(ln_mean), T(ln_rstd), KN, KC, g_s);
    fy_k_matmul_fwd(T(mm_out), T(mm_inp), T(mm_w), T(mm_bias), KN, KC, KOC, g_s);
    fy_k_matmul_bwd(T(mm_dinp), T(mm_dw), T(mm_dbias), T(mm_dout), T(mm_inp), T(mm_w), KN, KC,
                    KOC, g_s);
    const fy_attn mask = {.window = 0, .scale = 1.0f / sqrtf(KC / KNH), .docs = NULL};
    fy_k_attention_fwd(T(att_out), T(att_lse), T(qkv), KB, KT, KNH, KNH, KC / KNH, &mask, g_s);
    fy_k_attention_bwd(T(dqkv), T(att_delta), T(att_dout), T(qkv), T(att_out), T(att_lse), KB, KT,
                       KNH, KNH, KC / KNH, &mask, g_s);
    fy_k_gelu_fwd(T(gelu_out), T(gelu_inp), KN * 4 * KC, g_s);
    fy_k_gelu_bwd(T(gelu_dinp), T(gelu_inp), T(gelu_dout), KN * 4 * KC, g_s);
    fy_k_residual_fwd(T(res_out), T(att_out), T(ln_out), KN * KC, g_s);
    fy_k_crossentropy(T(losses), T(logits), tgt, KN, KV, KV, 1.0f / KN, 0.0f, g_s);
    fy_k_mean(T(mean_out), T(losses), KN, KN, g_s);
    double *dsq = dnew(sizeof(double));
    fy_k_sumsq(dsq, T(gelu_dinp), KN * 4 * KC, g_s);
#undef T
    for (int k = 0; k < K_COUNT; k++) {
        res[k] = hnewf(kset_n[k]);
        fy_copy_async(g_s, res[k], t[k], kset_n[k] * sizeof(float), FY_D2H);
    }
    fy_copy_async(g_s, sumsq, dsq, sizeof *sumsq, FY_D2H);
    fy_stream_sync(g_s);
    fy_dev_release(g_dev, dsq);
}

static void kset_expect_same(const char *what, float *const a[K_COUNT], float *const b[K_COUNT],
                             double sa, double sb) {
    for (int k = 0; k < K_COUNT; k++) {
        if (kset_role[k] == 2) continue;
        cr_expect(memcmp(a[k], b[k], kset_n[k] * sizeof(float)) == 0,
                  "%s: %s differs bitwise", what, kset_name[k]);
    }
    cr_expect(memcmp(&sa, &sb, sizeof sa) == 0, "%s: sumsq differs bitwise", what);
}

TestSuite(determinism, .init = setup, .fini = teardown, .timeout = 60);

Test(determinism, every_kernel_bit_identical_when_rerun) {
    float *img[K_COUNT], *r1[K_COUNT], *r2[K_COUNT];
    double s1, s2;
    kset_inputs(img);
    float *base = dnewf(kset_span(0));
    kset_run(img, base, 0, 0, r1, &s1);
    kset_run(img, base, 0, 0, r2, &s2);
    kset_expect_same("same buffers, second run", r1, r2, s1, s2);
}

Test(determinism, kernel_results_independent_of_buffer_addresses) {
    float *img[K_COUNT], *r1[K_COUNT], *r2[K_COUNT];
    double s1, s2;
    kset_inputs(img);
    float *base = dnewf(kset_span(0));
    kset_run(img, base, 0, 0, r1, &s1);
    /* every tensor 64-byte aligned before; now 4, 12, 20, ... bytes off, in another
     * allocation, and then with odd gaps so neighbours shift differently */
    static const size_t offs[][2] = {{1, 0}, {3, 5}, {7, 1}};
    for (int i = 0; i < 3; i++) {
        size_t off = offs[i][0], gap = offs[i][1];
        float *other = dnewf(kset_span(gap) + 2 * off);
        kset_run(img, other, off, gap, r2, &s2);
        char what[64];
        snprintf(what, sizeof what, "offset %zu floats, gap %zu", off, gap);
        kset_expect_same(what, r1, r2, s1, s2);
        fy_dev_release(g_dev, other);
    }
}

Test(determinism, gpt2_layer_fwd_bwd_bit_identical_when_rerun) {
    layer_fix f;
    layer_fix_init(&f, 717, FY_MODEL_CHUNK);
    size_t na = fy_gpt2_layer_acts_nbytes(&f.cfg, f.B, f.T, FY_F32) / sizeof(float);
    float *acts[2], *dx[2], *grads[2];
    for (int run = 0; run < 2; run++) {
        fy_memset_async(g_s, f.gbase, 0, f.blk->nelem * sizeof(float));
        layer_obj(&f);
        acts[run] = dgetf(f.a.ln1, na);
        dx[run] = layer_bwd(&f);
        grads[run] = dgetf(f.gbase, f.blk->nelem);
    }
    expect_same_bits("layer activations", acts[0], acts[1], na * sizeof(float));
    expect_same_bits("layer d x_in", dx[0], dx[1], f.NC * sizeof(float));
    expect_same_bits("layer parameter gradients", grads[0], grads[1],
                     f.blk->nelem * sizeof(float));
    fy_model_free(f.model);
}

Test(determinism, sumsq_and_mean_independent_of_thread_count) {
    const size_t n = 300007;
    rng r = {191};
    float *x = hrand(&r, n, -2, 2);
    double sq[2];
    float mean[2];
    for (int i = 0; i < 2; i++) {
        fy_dev *d = i == 0 ? g_dev : open_dev(0, 0, 1);
        fy_stream *s = g_s;
        if (i == 1) cr_assert_eq(fy_stream_new(d, "one thread", &s), FY_OK);
        void *dx, *dsq, *dm;
        cr_assert_eq(fy_dev_alloc(d, FY_MEM_DEVICE, n * sizeof(float), "x", &dx), FY_OK);
        cr_assert_eq(fy_dev_alloc(d, FY_MEM_DEVICE, sizeof(double), "sq", &dsq), FY_OK);
        cr_assert_eq(fy_dev_alloc(d, FY_MEM_DEVICE, sizeof(float), "mean", &dm), FY_OK);
        fy_copy_async(s, dx, x, n * sizeof(float), FY_H2D);
        fy_k_sumsq(dsq, dx, n, s);
        fy_k_mean(dm, dx, n, (int64_t)n, s);
        fy_copy_async(s, &sq[i], dsq, sizeof(double), FY_D2H);
        fy_copy_async(s, &mean[i], dm, sizeof(float), FY_D2H);
        fy_stream_sync(s);
        if (i == 1) { fy_stream_free(s); fy_dev_free(d); }
    }
    cr_expect(memcmp(&sq[0], &sq[1], sizeof(double)) == 0, "sumsq: 2 threads %.17g, 1 thread %.17g",
              sq[0], sq[1]);
    cr_expect(memcmp(&mean[0], &mean[1], sizeof(float)) == 0, "mean: 2 threads %.9g, 1 thread %.9g",
              mean[0], mean[1]);
}

/* ---- streams and events ------------------------------------------------------------ */


/* ---- device semantics: the suite every backend runs (tests/device_suite.h) ----------- */

static fy_dev *suite_open(size_t cap_nbytes) {
    fy_dev_cfg dc = {.kind = FY_DEV_CPU, .threads = 2, .mem_cap_nbytes = cap_nbytes};
    fy_dev *d;
    cr_assert_eq(fy_dev_new(&dc, &d), FY_OK);
    return d;
}
#include "tests/device_suite.h"

/* ---- memory ------------------------------------------------------------------------ */

TestSuite(memory, .fini = teardown, .timeout = 60);

Test(memory, used_and_peak_accounting, .init = setup) {
    void *a, *b, *c;
    fy_dev_mem_stats ms;
    fy_dev_mem_stats_get(g_dev, &ms);
    size_t used0 = ms.used_nbytes[FY_MEM_DEVICE];
    cr_assert_eq(fy_dev_alloc(g_dev, FY_MEM_DEVICE, 1u << 20, "a", &a), FY_OK);
    cr_assert_eq(fy_dev_alloc(g_dev, FY_MEM_DEVICE, 2u << 20, "b", &b), FY_OK);
    fy_dev_mem_stats_get(g_dev, &ms);
    cr_expect_eq(ms.used_nbytes[FY_MEM_DEVICE], used0 + (3u << 20));
    cr_expect_eq(ms.peak_nbytes[FY_MEM_DEVICE], used0 + (3u << 20));
    fy_dev_release(g_dev, b);
    fy_dev_mem_stats_get(g_dev, &ms);
    cr_expect_eq(ms.used_nbytes[FY_MEM_DEVICE], used0 + (1u << 20), "release not subtracted");
    cr_expect_eq(ms.peak_nbytes[FY_MEM_DEVICE], used0 + (3u << 20), "peak fell on release");
    cr_assert_eq(fy_dev_alloc(g_dev, FY_MEM_PINNED, 4u << 20, "c", &c), FY_OK);
    fy_dev_mem_stats_get(g_dev, &ms);
    cr_expect_eq(ms.used_nbytes[FY_MEM_PINNED], 4u << 20, "pinned not counted by kind");
    cr_expect_eq(ms.used_nbytes[FY_MEM_DEVICE], used0 + (1u << 20), "pinned counted as device");
    fy_dev_mem_reset_peak(g_dev);
    fy_dev_mem_stats_get(g_dev, &ms);
    cr_expect_eq(ms.peak_nbytes[FY_MEM_DEVICE], used0 + (1u << 20), "reset_peak: peak != used");
    cr_expect_eq(ms.peak_nbytes[FY_MEM_PINNED], 4u << 20);
    fy_dev_release(g_dev, a);
    fy_dev_release(g_dev, c);
    fy_dev_release(g_dev, NULL); /* no-op */
    fy_dev_mem_stats_get(g_dev, &ms);
    cr_expect_eq(ms.used_nbytes[FY_MEM_DEVICE], used0);
    cr_expect_eq(ms.used_nbytes[FY_MEM_PINNED], 0);
}

/* ---- the emulated PCIe link -------------------------------------------------------- */

/* The link books nbytes / bandwidth per direction and a copy completes no earlier than
 * its booking ends, so these are lower bounds (exact properties of the emulation, less
 * 1% for clock rounding). The upper bounds only tell sharing from overlapping and are
 * generous: a quarter of a GB/s makes each copy ~84 ms, far above scheduling noise. */

typedef struct pcie_bufs { void *host[2], *dev[2]; } pcie_bufs;
static void pcie_alloc(pcie_bufs *p, size_t n) {
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(fy_dev_alloc(g_dev, FY_MEM_PINNED, n, "pinned", &p->host[i]), FY_OK);
        cr_assert_eq(fy_dev_alloc(g_dev, FY_MEM_DEVICE, n, "device", &p->dev[i]), FY_OK);
    }
}

Test(memory, pcie_throttle_h2d_takes_bytes_over_bandwidth) {
    setup_with(0, 1.0);
    const size_t n = 20u << 20;
    const double want_ms = (double)n / 1e9 * 1e3; /* 1 GB/s: 20.97 ms */
    pcie_bufs p;
    pcie_alloc(&p, n);
    memset(p.host[0], 0x3C, n);
    double t0 = fy_now_ms();
    fy_copy_async(g_s, p.dev[0], p.host[0], n, FY_H2D);
    fy_stream_sync(g_s);
    double h2d = fy_now_ms() - t0;
    t0 = fy_now_ms();
    fy_copy_async(g_s, p.host[1], p.dev[0], n, FY_D2H);
    fy_stream_sync(g_s);
    double d2h = fy_now_ms() - t0;
    cr_expect(h2d >= 0.99 * want_ms, "20 MiB H2D at 1 GB/s took %.2f ms < %.2f ms", h2d, want_ms);
    cr_expect(d2h >= 0.99 * want_ms, "20 MiB D2H at 1 GB/s took %.2f ms < %.2f ms", d2h, want_ms);
    cr_expect(memcmp(p.host[1], p.host[0], n) == 0, "throttled copies corrupted the data");
}

static double time_two_copies(fy_stream *b, pcie_bufs *p, size_t n, fy_copy_dir d0,
                              fy_copy_dir d1) {
    double t0 = fy_now_ms();
    if (d0 == FY_H2D) fy_copy_async(g_s, p->dev[0], p->host[0], n, d0);
    else fy_copy_async(g_s, p->host[0], p->dev[0], n, d0);
    if (d1 == FY_H2D) fy_copy_async(b, p->dev[1], p->host[1], n, d1);
    else fy_copy_async(b, p->host[1], p->dev[1], n, d1);
    fy_stream_sync(g_s);
    fy_stream_sync(b);
    return fy_now_ms() - t0;
}

Test(memory, pcie_same_direction_shares_opposite_directions_overlap) {
    setup_with(0, 0.25);
    const size_t n = 20u << 20;
    const double one_ms = (double)n / 0.25e9 * 1e3; /* 83.9 ms */
    fy_stream *b;
    cr_assert_eq(fy_stream_new(g_dev, "b", &b), FY_OK);
    pcie_bufs p;
    pcie_alloc(&p, n);
    double t_one = fy_now_ms();
    fy_copy_async(g_s, p.dev[0], p.host[0], n, FY_H2D);
    fy_stream_sync(g_s);
    t_one = fy_now_ms() - t_one;
    double t_same = time_two_copies(b, &p, n, FY_H2D, FY_H2D);
    double t_dup = time_two_copies(b, &p, n, FY_H2D, FY_D2H);
    cr_log_info("pcie: one H2D %.1f ms, two H2D %.1f ms, H2D + D2H %.1f ms (one = %.1f ms)",
                t_one, t_same, t_dup, one_ms);
    cr_expect(t_one >= 0.99 * one_ms, "one H2D took %.1f ms < %.1f ms", t_one, one_ms);
    cr_expect(t_same >= 0.99 * 2 * one_ms, "two concurrent H2D copies took %.1f ms, less than "
              "twice one (%.1f ms): they did not share the link", t_same, 2 * one_ms);
    cr_expect(t_same <= 3.0 * one_ms, "two concurrent H2D copies took %.1f ms, over 3x one",
              t_same);
    cr_expect(t_dup >= 0.99 * one_ms, "H2D + D2H took %.1f ms < one copy", t_dup);
    cr_expect(t_dup <= 1.5 * one_ms, "H2D + D2H on two streams took %.1f ms, not overlapped "
              "(one copy: %.1f ms)", t_dup, one_ms);
    fy_stream_free(b);
}

/* ---- bf16 storage on the cpu backend ------------------------------------------------
 * A bf16 stream's kernels mean: widen the bf16 tensors, compute in fp32, round the
 * outputs to bf16. Each kernel runs on an fp32 stream over the bf16 values widened and
 * on a bf16 stream over the bf16 values; every output (accumulated ones included) must
 * be the fp32 result rounded, bit for bit, and the fp32-only arguments (norm statistics,
 * losses, the double sum of squares) must equal the fp32 run's exactly. */

/* d16 holds bf16 values; it is typed float because kernels.h's float pointers mean "the
 * stream's storage type" */
typedef struct bpair { float *d32, *d16; size_t n; } bpair;

static fy_stream *g_s16;

static void setup_bf16(void) {
    setup();
    cr_assert_eq(fy_stream_new(g_dev, "bf16", &g_s16), FY_OK);
    cr_assert_eq(fy_stream_set_dtype(g_s16, FY_BF16), FY_OK);
}
static void teardown_bf16(void) {
    fy_stream_free(g_s16);
    teardown();
}

/* Random bf16 values in [lo, hi) (zeros if lo == hi), on both streams' buffers. */
static bpair bpair_new(rng *r, size_t n, float lo, float hi) {
    float *h = hnewf(n);
    uint16_t *h16 = hnew(n * 2);
    for (size_t i = 0; i < n; i++) {
        h16[i] = fy_f32_to_bf16(lo == hi ? lo : rng_unif(r, lo, hi));
        h[i] = fy_bf16_to_f32(h16[i]);
    }
    bpair p = {dputf(h, n), dnew(n * 2), n};
    put(p.d16, h16, n * 2);
    return p;
}

static void bpair_expect_rounded(const bpair *p, const char *what) {
    fy_stream_sync(g_s16);
    fy_stream_sync(g_s);
    float *f = dgetf(p->d32, p->n);
    uint16_t *b = hnew(p->n * 2);
    get(b, p->d16, p->n * 2);
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < p->n; i++)
        if (b[i] != fy_f32_to_bf16(f[i]) && bad++ == 0) first = i;
    cr_expect_eq(bad, 0, "%s: %zu of %zu elements are not the fp32 result rounded (first %zu: "
                 "%04x, fp32 %.9g)", what, bad, p->n, first, b[first], f[first]);
}

/* An output used as an input next: the fp32 side continues from the rounded values. */
static void bpair_resync(bpair *p) {
    fy_stream_sync(g_s16);
    uint16_t *h16 = hnew(p->n * 2);
    get(h16, p->d16, p->n * 2);
    float *h = hnewf(p->n);
    for (size_t i = 0; i < p->n; i++) h[i] = fy_bf16_to_f32(h16[i]);
    put(p->d32, h, p->n * sizeof(float));
}

TestSuite(bf16_storage, .init = setup_bf16, .fini = teardown_bf16, .timeout = 60);

Test(bf16_storage, matmul_layernorm_gelu_residual_round_the_fp32_results) {
    rng r = {0xbf16};
    const int N = 24, C = 16, OC = 40;
    bpair inp = bpair_new(&r, N * C, -2, 2), w = bpair_new(&r, OC * C, -1, 1);
    bpair bias = bpair_new(&r, OC, -1, 1), out = bpair_new(&r, N * OC, 0, 0);
    bpair dout = bpair_new(&r, N * OC, -1, 1), dinp = bpair_new(&r, N * C, 0, 0);
    bpair dw = bpair_new(&r, OC * C, -1, 1), dbias = bpair_new(&r, OC, -1, 1); /* accumulate */
    fy_k_matmul_fwd(out.d32, inp.d32, w.d32, bias.d32, N, C, OC, g_s);
    fy_k_matmul_fwd(out.d16, inp.d16, w.d16, bias.d16, N, C, OC, g_s16);
    fy_k_matmul_bwd(dinp.d32, dw.d32, dbias.d32, dout.d32, inp.d32, w.d32, N, C, OC, g_s);
    fy_k_matmul_bwd(dinp.d16, dw.d16, dbias.d16, dout.d16, inp.d16, w.d16, N, C, OC, g_s16);
    bpair_expect_rounded(&out, "matmul out");
    bpair_expect_rounded(&dinp, "matmul dinp");
    bpair_expect_rounded(&dw, "matmul dw (accumulated)");
    bpair_expect_rounded(&dbias, "matmul dbias (accumulated)");

    bpair ln = bpair_new(&r, N * C, 0, 0), g = bpair_new(&r, C, 0.5f, 1.5f), b = bpair_new(&r, C, -1, 1);
    float *mean32 = dnewf(N), *rstd32 = dnewf(N), *mean16 = dnewf(N), *rstd16 = dnewf(N);
    fy_k_layernorm_fwd(ln.d32, mean32, rstd32, inp.d32, g.d32, b.d32, N, C, g_s);
    fy_k_layernorm_fwd(ln.d16, mean16, rstd16, inp.d16, g.d16, b.d16, N, C, g_s16);
    bpair dln = bpair_new(&r, N * C, -1, 1), dx = bpair_new(&r, N * C, -1, 1);
    bpair dg = bpair_new(&r, C, -1, 1), db = bpair_new(&r, C, -1, 1);
    fy_k_layernorm_bwd(dx.d32, dg.d32, db.d32, dln.d32, inp.d32, g.d32, mean32, rstd32, N, C, g_s);
    fy_k_layernorm_bwd(dx.d16, dg.d16, db.d16, dln.d16, inp.d16, g.d16, mean16, rstd16, N, C, g_s16);
    bpair_expect_rounded(&ln, "layernorm out");
    bpair_expect_rounded(&dx, "layernorm dinp (accumulated)");
    bpair_expect_rounded(&dg, "layernorm dw");
    bpair_expect_rounded(&db, "layernorm db");
    cr_expect_arr_eq(dgetf(mean16, N), dgetf(mean32, N), N * sizeof(float), "mean stays fp32");
    cr_expect_arr_eq(dgetf(rstd16, N), dgetf(rstd32, N), N * sizeof(float), "rstd stays fp32");

    bpair ge = bpair_new(&r, N * C, 0, 0), dge = bpair_new(&r, N * C, 0, 0);
    fy_k_gelu_fwd(ge.d32, inp.d32, (size_t)N * C, g_s);
    fy_k_gelu_fwd(ge.d16, inp.d16, (size_t)N * C, g_s16);
    fy_k_gelu_bwd(dge.d32, inp.d32, dln.d32, (size_t)N * C, g_s);
    fy_k_gelu_bwd(dge.d16, inp.d16, dln.d16, (size_t)N * C, g_s16);
    bpair_expect_rounded(&ge, "gelu");
    bpair_expect_rounded(&dge, "gelu dinp");
    /* in place, as gradient accumulation uses it: out == a */
    bpair_resync(&ge);
    fy_k_residual_fwd(dln.d32, dln.d32, ge.d32, (size_t)N * C, g_s);
    fy_k_residual_fwd(dln.d16, dln.d16, ge.d16, (size_t)N * C, g_s16);
    bpair_expect_rounded(&dln, "residual in place");
}

Test(bf16_storage, attention_encoder_crossentropy_sumsq_round_the_fp32_results) {
    rng r = {0x5eed16};
    const int B = 2, T = 9, C = 16, NH = 4, V = 50;
    const fy_attn mask = {.window = 0, .scale = 0.5f, .docs = NULL};
    bpair qkv = bpair_new(&r, B * T * 3 * C, -2, 2), y = bpair_new(&r, B * T * C, 0, 0);
    bpair dy = bpair_new(&r, B * T * C, -1, 1), dqkv = bpair_new(&r, B * T * 3 * C, 0, 0);
    float *lse32 = dnewf(B * NH * T), *lse16 = dnewf(B * NH * T);
    float *delta32 = dnewf(B * NH * T), *delta16 = dnewf(B * NH * T);
    fy_k_attention_fwd(y.d32, lse32, qkv.d32, B, T, NH, NH, C / NH, &mask, g_s);
    fy_k_attention_fwd(y.d16, lse16, qkv.d16, B, T, NH, NH, C / NH, &mask, g_s16);
    bpair_expect_rounded(&y, "attention out");
    cr_expect_arr_eq(dgetf(lse16, B * NH * T), dgetf(lse32, B * NH * T),
                     B * NH * T * sizeof(float), "attention lse stays fp32");
    bpair_resync(&y); /* backward from the same (rounded) output on both sides */
    fy_k_attention_bwd(dqkv.d32, delta32, dy.d32, qkv.d32, y.d32, lse32, B, T, NH, NH, C / NH,
                       &mask, g_s);
    fy_k_attention_bwd(dqkv.d16, delta16, dy.d16, qkv.d16, y.d16, lse16, B, T, NH, NH, C / NH,
                       &mask, g_s16);
    bpair_expect_rounded(&dqkv, "attention dqkv");
    cr_expect_arr_eq(dgetf(delta16, B * NH * T), dgetf(delta32, B * NH * T),
                     B * NH * T * sizeof(float), "attention delta stays fp32");

    int32_t tok[2 * 9];
    for (int i = 0; i < B * T; i++) tok[i] = rng_int(&r, V);
    int32_t *dtok = dnew(sizeof tok);
    put(dtok, tok, sizeof tok);
    bpair wte = bpair_new(&r, V * C, -1, 1), wpe = bpair_new(&r, T * C, -1, 1);
    bpair x0 = bpair_new(&r, B * T * C, 0, 0);
    fy_k_encoder_fwd(x0.d32, dtok, wte.d32, wpe.d32, NULL, B, T, C, V, 1.0f, g_s);
    fy_k_encoder_fwd(x0.d16, dtok, wte.d16, wpe.d16, NULL, B, T, C, V, 1.0f, g_s16);
    bpair_expect_rounded(&x0, "encoder out");
    fy_k_encoder_bwd(wte.d32, wpe.d32, dy.d32, dtok, NULL, B, T, C, V, 1.0f, g_s);
    fy_k_encoder_bwd(wte.d16, wpe.d16, dy.d16, dtok, NULL, B, T, C, V, 1.0f, g_s16);
    bpair_expect_rounded(&wte, "encoder dwte (accumulated)");
    bpair_expect_rounded(&wpe, "encoder dwpe (accumulated)");

    bpair logits = bpair_new(&r, B * T * V, -3, 3);
    float *l32 = dnewf(B * T), *l16 = dnewf(B * T);
    fy_k_crossentropy(l32, logits.d32, dtok, B * T, V, V, 1.0f / (B * T), 0.0f, g_s);
    fy_k_crossentropy(l16, logits.d16, dtok, B * T, V, V, 1.0f / (B * T), 0.0f, g_s16);
    bpair_expect_rounded(&logits, "crossentropy dlogits (in place)");
    cr_expect_arr_eq(dgetf(l16, B * T), dgetf(l32, B * T), B * T * sizeof(float), "losses stay fp32");

    double *s32 = dnew(sizeof(double)), *s16 = dnew(sizeof(double)), h32, h16v;
    fy_k_sumsq(s32, qkv.d32, qkv.n, g_s);
    fy_k_sumsq(s16, qkv.d16, qkv.n, g_s16);
    fy_stream_sync(g_s16);
    get(&h32, s32, sizeof h32);
    get(&h16v, s16, sizeof h16v);
    cr_expect_eq(h16v, h32, "the sum of squares of bf16 values is the double sum of their widening");
}

/* ---- the op table ----------------------------------------------------------------------
 * Every kernel of the op table (ops.h), launched as an op built from the table alone:
 * the cpu backend implements it, and on a bf16 stream each storage-typed output is the
 * fp32 kernel's result on the widened inputs, rounded, bit for bit, while the other
 * outputs (fp32 statistics, losses, a double sum) are the fp32 run's exactly. The widening
 * reads the same table, so an op whose table entry is wrong fails here. Each op needs a
 * case below (its integer arguments): adding an op without one fails too. */

typedef struct op_case { fy_op_kind kind; int64_t i[8]; float f[8]; } op_case;

static const op_case op_cases[] = {
    {FY_OP_ENCODER_FWD, {2, 5, 8, 11}, {1.0f}},
    {FY_OP_ENCODER_FWD, {2, 5, 8, 11}, {2.75f}}, /* a scaled embedding (Gemma's) */
    {FY_OP_ENCODER_BWD, {2, 5, 8, 11}, {2.75f}},
    {FY_OP_LAYERNORM_FWD, {10, 8}, {0}},
    {FY_OP_LAYERNORM_BWD, {10, 8}, {0}},
    {FY_OP_MATMUL_FWD, {10, 8, 12}, {0}},
    {FY_OP_MATMUL_BWD, {10, 8, 12}, {0}},
    {FY_OP_MATMUL_BWD_DX32, {10, 8, 12}, {0}},
    {FY_OP_CE_CHUNK_FWD, {6, 0, 16, 11}, {0}},  /* the first chunk: starts the sums */
    {FY_OP_CE_CHUNK_FWD, {6, 64, 64, 100}, {0}}, /* a later one, padding past class 99 */
    {FY_OP_CE_CHUNK_FWD, {6, 64, 64, 100}, {0.5f}}, /* soft-capped */
    {FY_OP_CE_CHUNK_BWD, {6, 64, 64, 100}, {1.0f / 6}},
    {FY_OP_CE_CHUNK_BWD, {6, 64, 64, 100}, {1.0f / 6, 0.5f}},
    {FY_OP_ADD_F32, {37}, {0}},
    {FY_OP_RMSNORM_FWD, {10, 8}, {1e-5f}},
    {FY_OP_RMSNORM_FWD, {10, 8}, {1e-5f, 1.0f}}, /* Gemma's (1 + w) */
    {FY_OP_RMSNORM_BWD, {10, 8}, {0}},
    {FY_OP_RMSNORM_BWD, {10, 8}, {1.0f}},
    {FY_OP_QK_NORM_FWD, {5, 4, 2, 8}, {1e-6f, 1.0f}}, /* 4 query heads, 2 key and value */
    {FY_OP_QK_NORM_BWD, {5, 4, 2, 8}, {0}},
    {FY_OP_ATTENTION_FWD, {2, 5, 4, 2, 4, 0}, {0.5f}}, /* grouped: 4 query heads, 2 key/value */
    {FY_OP_ATTENTION_BWD, {2, 5, 4, 2, 4, 0}, {0.5f}},
    {FY_OP_ATTENTION_FWD, {2, 70, 4, 2, 4, 9}, {0.5f}}, /* a window, two query tiles */
    {FY_OP_ATTENTION_BWD, {2, 70, 4, 2, 4, 9}, {0.5f}},
    {FY_OP_ROPE, {2, 5, 4, 2, 4, 0, FY_ROPE_LLAMA3}, {500000.0f, 8.0f, 1.0f, 4.0f, 8.0f}},
    {FY_OP_GLU_FWD, {10, 6, FY_GLU_SILU}, {0}},
    {FY_OP_GLU_BWD, {10, 6, FY_GLU_SILU}, {0}},
    {FY_OP_GLU_FWD, {10, 6, FY_GLU_GELU_TANH}, {0}},
    {FY_OP_GLU_BWD, {10, 6, FY_GLU_GELU_TANH}, {0}},
    {FY_OP_GELU_FWD, {37}, {0}},
    {FY_OP_GELU_BWD, {37}, {0}},
    {FY_OP_RESIDUAL_FWD, {37}, {0}},
    {FY_OP_CROSSENTROPY, {6, 11, 16}, {1.0f / 6}},
    {FY_OP_CROSSENTROPY, {6, 11, 16}, {1.0f / 6, 0.5f}},
    {FY_OP_MEAN, {37}, {0}},
    {FY_OP_SUMSQ, {37}, {0}},
    {FY_OP_SUMSQ_PARTS, {40000}, {0}}, /* a whole chunk, a part of one */
    {FY_OP_ADAMW, {37, FY_BF16, FY_BF16, 1, 3}, {1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 1.0f}},
};

/* The integer ids an I32 argument of op c holds: below the vocabulary. */
static int32_t id_bound(const op_case *c) {
    const bool fourth = c->kind == FY_OP_ENCODER_FWD || c->kind == FY_OP_ENCODER_BWD ||
                        c->kind == FY_OP_CE_CHUNK_FWD || c->kind == FY_OP_CE_CHUNK_BWD;
    return (int32_t)(fourth ? c->i[3] : c->i[1]);
}

static size_t elem_size(fy_dtype t, fy_arg_type a) {
    return a == FY_ARG_F64 ? 8 : a == FY_ARG_I32 ? 4 : fy_dtype_size(t);
}

static void check_op_case(const op_case *c) {
    const fy_op_desc *d = fy_op_desc_of(c->kind);
    const int n = fy_op_nargs(c->kind);
    cr_assert(fy_cpu_has_kernel(c->kind), "%s: no cpu kernel", d->name);
    rng r = {0x0b7ab1e + (uint64_t)c->kind};
    fy_op ops[2]; /* [0] fp32, [1] bf16 */
    for (int run = 0; run < 2; run++) {
        memset(&ops[run], 0, sizeof ops[run]);
        ops[run].kind = c->kind;
        ops[run].dt = run ? FY_BF16 : FY_F32;
        memcpy(ops[run].i, c->i, sizeof c->i);
        memcpy(ops[run].f, c->f, sizeof c->f);
    }
    void *host32[FY_OP_MAX_ARGS];
    for (int k = 0; k < n; k++) {
        const fy_op_arg *a = &d->args[k];
        size_t len = fy_op_arg_nelem(&ops[0], k);
        /* values every kernel takes: positive statistics, valid ids, bf16-representable */
        float *h = hnewf(len ? len : 1);
        for (size_t e = 0; e < len; e++) {
            float x = !strcmp(a->name, "rstd") ? rng_unif(&r, 0.5f, 2.0f)
                      : !strcmp(a->name, "v") ? rng_unif(&r, 0.0f, 1e-3f) : rng_unif(&r, -1, 1);
            h[e] = fy_bf16_to_f32(fy_f32_to_bf16(x));
        }
        host32[k] = h;
        for (int run = 0; run < 2; run++) {
            fy_dtype t = fy_op_arg_dtype(&ops[run], k);
            void *buf = dnew((len ? len : 1) * elem_size(t, a->type));
            if (a->type == FY_ARG_I32 && !strcmp(a->name, "docs")) {
                /* document starts (kernels.h), (B,T) with T = i[1]: a new document at
                 * t = 0 and then at one position in four */
                int32_t *docs = hnew(len * 4 + 4);
                rng ri = {7 + (uint64_t)k};
                const int T = (int)c->i[1];
                for (size_t e = 0; e < len; e++) {
                    const int t = (int)(e % (size_t)T);
                    docs[e] = t == 0 || rng_int(&ri, 4) == 0 ? t : docs[e - 1];
                }
                put(buf, docs, len * 4);
            } else if (a->type == FY_ARG_I32) {
                int32_t *ids = hnew(len * 4 + 4);
                rng ri = {7 + (uint64_t)k};
                for (size_t e = 0; e < len; e++) ids[e] = (int32_t)(rng_u64(&ri) % (uint64_t)id_bound(c));
                put(buf, ids, len * 4);
            } else if (a->type != FY_ARG_F64 && t == FY_BF16) {
                uint16_t *h16 = hnew(len * 2 + 2);
                fy_f32_to_bf16_n(h16, h, len);
                put(buf, h16, len * 2);
            } else if (a->type != FY_ARG_F64) {
                put(buf, h, len * 4);
            } else { /* fp64 inputs: positive sums (the classifier's running exp sums) */
                double *hd = hnew(len * 8 + 8);
                for (size_t e = 0; e < len; e++) hd[e] = 1.5 + h[e];
                put(buf, hd, len * 8);
            }
            ops[run].p[k] = buf;
        }
    }
    for (int run = 0; run < 2; run++) g_dev->iface->launch(g_s, &ops[run]);
    fy_stream_sync(g_s);
    for (int k = 0; k < n; k++) {
        const fy_op_arg *a = &d->args[k];
        if (!(a->role & FY_ARG_OUT)) continue;
        size_t len = fy_op_arg_nelem(&ops[0], k);
        fy_dtype t16 = fy_op_arg_dtype(&ops[1], k), t32 = fy_op_arg_dtype(&ops[0], k);
        size_t nb32 = len * elem_size(t32, a->type), nb16 = len * elem_size(t16, a->type);
        void *g32 = hnew(nb32 + 8), *g16 = hnew(nb16 + 8);
        get(g32, ops[0].p[k], nb32);
        get(g16, ops[1].p[k], nb16);
        if (a->type == FY_ARG_S) {
            size_t bad = 0;
            for (size_t e = 0; e < len; e++)
                bad += ((uint16_t *)g16)[e] != fy_f32_to_bf16(((float *)g32)[e]);
            cr_expect_eq(bad, 0, "%s %s: %zu of %zu elements are not the fp32 result rounded",
                         d->name, a->name, bad, len);
        } else if (t16 == t32) {
            cr_expect(!memcmp(g16, g32, nb32), "%s %s: not the fp32 run's bits", d->name, a->name);
        }
    }
    (void)host32;
}

Test(op_table, every_op_runs_on_the_cpu_and_keeps_the_bf16_contract, .init = setup, .fini = teardown) {
    bool covered[FY_OP_KERNELS] = {0};
    for (size_t c = 0; c < sizeof op_cases / sizeof op_cases[0]; c++) {
        covered[op_cases[c].kind] = true;
        check_op_case(&op_cases[c]);
    }
    for (int k = 0; k < FY_OP_KERNELS; k++)
        cr_expect(covered[k], "op %s has no case in op_cases", fy_op_name((fy_op_kind)k));
}

/* A launcher packs what the table lists: every launcher's op has the table's counts and
 * its required tensors (checked by fy_op_pack, which aborts otherwise); a missing
 * required tensor is a bug that stops the process. */
Test(op_table, a_launch_without_a_required_tensor_aborts, .init = setup, .fini = teardown,
     .signal = SIGABRT) {
    float *x = dnewf(8);
    fy_k_gelu_fwd(NULL, x, 8, g_s);
}
