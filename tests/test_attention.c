/* test_attention.c — attention's mask (kernels.h: windows and packed documents) and the
 * positions that restart with each document, on the cpu backend, and the attention
 * kernels against a float64 PyTorch reference (tests/ref/gen_attn_ref.py).
 *
 * Documents: a packed sequence's rows must be each document's rows computed alone (the
 * document as a sequence of its own, without docs): bit for bit for the embedding and
 * rope (the same fp32 operations on the same operands), within a few ulps for attention
 * (its tiles start at other keys, so its sums run in another order). Windows: against a
 * host reference in double; a window of T or more is no window, bit for bit. The results
 * do not depend on the thread count (kernels.h): 1 and 2 threads give the same bits.
 *
 * The PyTorch fixtures hold only expected outputs at a fixed subset of rows; the inputs
 * are regenerated here by the script's generator (splitmix64 turned into values exact in
 * the storage type, see gen_attn_ref.py), so nothing but the results is stored. Errors
 * are measured per tensor as ||got - ref|| / ||ref|| over the stored rows, and per
 * element against bounds stated with each check. */
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/dtype.h"
#include "engine/device/kernels.h"

#include "kernel_check.h"

/* ---- helpers -------------------------------------------------------------------------- */

typedef struct attn_shape { int B, T, NH, NKV, hd; } attn_shape;

static size_t shape_nqkv(const attn_shape *s) {
    return (size_t)s->B * s->T * (s->NH + 2 * s->NKV) * s->hd;
}
static size_t shape_nout(const attn_shape *s) { return (size_t)s->B * s->T * s->NH * s->hd; }
static size_t shape_nlse(const attn_shape *s) { return (size_t)s->B * s->NH * s->T; }

/* docs (B,T) on the host from each sequence's document lengths (lens[b], 0-terminated,
 * summing to T). */
static int32_t *docs_from_lengths(int B, int T, const int lens[][8]) {
    int32_t *d = hnew((size_t)B * T * sizeof *d);
    for (int b = 0; b < B; b++) {
        int t = 0;
        for (int i = 0; i < 8 && lens[b][i]; i++) {
            cr_assert(t + lens[b][i] <= T, "sequence %d: documents past T = %d", b, T);
            for (int k = 0; k < lens[b][i]; k++) d[(size_t)b * T + t + k] = t;
            t += lens[b][i];
        }
        cr_assert_eq(t, T, "sequence %d: documents of %d positions, T = %d", b, t, T);
    }
    return d;
}

/* Results of one forward and backward, on the host in fp32 (bf16 results widened). */
typedef struct attn_res { float *out, *lse, *dqkv; } attn_res;

/* fy_k_attention_fwd, then fy_k_attention_bwd with dout, on stream s of device d, whose
 * storage type is bf16 when bf16 (then qkv and dout must be bf16 values). docs (B,T) on
 * the host or NULL. Device buffers are released before returning. */
static attn_res attn_run(fy_dev *d, fy_stream *s, bool bf16, const attn_shape *sh,
                         int window, float scale, float softcap, const int32_t *docs,
                         const float *qkv, const float *dout) {
    const size_t nq = shape_nqkv(sh), no = shape_nout(sh), nl = shape_nlse(sh);
    const size_t es = bf16 ? 2 : 4, nd = (size_t)sh->B * sh->T;
    void *d_qkv, *d_dout, *d_out, *d_lse, *d_dqkv, *d_delta, *d_docs = NULL;
    cr_assert_eq(fy_dev_alloc(d, FY_MEM_DEVICE, nq * es, "qkv", &d_qkv), FY_OK);
    cr_assert_eq(fy_dev_alloc(d, FY_MEM_DEVICE, no * es, "dout", &d_dout), FY_OK);
    cr_assert_eq(fy_dev_alloc(d, FY_MEM_DEVICE, no * es, "out", &d_out), FY_OK);
    cr_assert_eq(fy_dev_alloc(d, FY_MEM_DEVICE, nl * 4, "lse", &d_lse), FY_OK);
    cr_assert_eq(fy_dev_alloc(d, FY_MEM_DEVICE, nq * es, "dqkv", &d_dqkv), FY_OK);
    cr_assert_eq(fy_dev_alloc(d, FY_MEM_DEVICE, nl * 4, "delta", &d_delta), FY_OK);
    uint16_t *q16 = NULL, *o16 = NULL;
    if (bf16) {
        q16 = malloc(nq * 2);
        o16 = malloc(no * 2);
        cr_assert(q16 && o16);
        fy_f32_to_bf16_n(q16, qkv, nq);
        fy_f32_to_bf16_n(o16, dout, no);
    }
    fy_copy_async(s, d_qkv, bf16 ? (const void *)q16 : qkv, nq * es, FY_H2D);
    fy_copy_async(s, d_dout, bf16 ? (const void *)o16 : dout, no * es, FY_H2D);
    if (docs) {
        cr_assert_eq(fy_dev_alloc(d, FY_MEM_DEVICE, nd * 4, "docs", &d_docs), FY_OK);
        fy_copy_async(s, d_docs, docs, nd * 4, FY_H2D);
    }
    const fy_attn a = {.window = window, .scale = scale, .softcap = softcap, .docs = d_docs};
    fy_k_attention_fwd(d_out, d_lse, d_qkv, sh->B, sh->T, sh->NH, sh->NKV, sh->hd, &a, s);
    fy_k_attention_bwd(d_dqkv, d_delta, d_dout, d_qkv, d_out, d_lse, sh->B, sh->T, sh->NH, sh->NKV,
                       sh->hd, &a, s);
    attn_res r = {hnewf(no), hnewf(nl), hnewf(nq)};
    fy_copy_async(s, r.lse, d_lse, nl * 4, FY_D2H);
    if (bf16) {
        uint16_t *g16 = malloc(nq * 2);
        cr_assert(g16);
        fy_copy_async(s, o16 /* dout's staging, out's size */, d_out, no * 2, FY_D2H);
        fy_copy_async(s, g16, d_dqkv, nq * 2, FY_D2H);
        fy_stream_sync(s);
        fy_bf16_to_f32_n(r.out, o16, no);
        fy_bf16_to_f32_n(r.dqkv, g16, nq);
        free(g16);
    } else {
        fy_copy_async(s, r.out, d_out, no * 4, FY_D2H);
        fy_copy_async(s, r.dqkv, d_dqkv, nq * 4, FY_D2H);
        fy_stream_sync(s);
    }
    free(q16);
    free(o16);
    void *bufs[] = {d_qkv, d_dout, d_out, d_lse, d_dqkv, d_delta, d_docs};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) fy_dev_release(d, bufs[i]);
    return r;
}

/* Rows t0 .. t0+n-1 of sequence b of x (B,T,width) into (1,n,width). */
static float *rows_of(const float *x, int T, int width, int b, int t0, int n) {
    float *y = hnewf((size_t)n * width);
    memcpy(y, x + ((size_t)b * T + t0) * width, sizeof(float) * (size_t)n * width);
    return y;
}

/* ---- positions restart with each document --------------------------------------------- */

TestSuite(attn_docs, .init = setup, .fini = teardown, .timeout = 60);

/* Two sequences of 13: documents of 4, 1, 8 and of 6, 7 positions. */
enum { PB = 2, PT = 13 };
static const int pack_lens[PB][8] = {{4, 1, 8}, {6, 7}};

/* The learned positions: each row is wte[token] + wpe[its place in its document] (one
 * fp32 addition, as the document alone computes it); the backward, into zeros, adds each
 * row's dout into the same rows of dwte and dwpe in the same (b, t) order as the
 * documents run one after another: the same sums, bit for bit. */
Test(attn_docs, learned_positions_restart_per_document) {
    enum { C = 8, V = 11 };
    rng r = {0xd0c5};
    int32_t tok[PB * PT];
    for (int i = 0; i < PB * PT; i++) tok[i] = rng_int(&r, V);
    const int32_t *docs = docs_from_lengths(PB, PT, pack_lens);
    float *wte = dputf(hrand(&r, V * C, -1, 1), V * C);
    float *wpe = dputf(hrand(&r, PT * C, -1, 1), PT * C);
    float *dout = hrand(&r, PB * PT * C, -1, 1);
    int32_t *dtok = dnew(sizeof tok), *ddocs = dnew(sizeof tok);
    put(dtok, tok, sizeof tok);
    put(ddocs, docs, sizeof tok);
    float *out = dnewf(PB * PT * C), *dwte = dnewf(V * C), *dwpe = dnewf(PT * C);
    fy_k_encoder_fwd(out, dtok, wte, wpe, ddocs, PB, PT, C, V, 1.0f, g_s);
    fy_k_encoder_bwd(dwte, dwpe, dputf(dout, PB * PT * C), dtok, ddocs, PB, PT, C, V, 1.0f, g_s);
    float *packed = dgetf(out, PB * PT * C);
    float *one = dnewf(PT * C), *awte = dnewf(V * C), *awpe = dnewf(PT * C);
    for (int b = 0; b < PB; b++)
        for (int i = 0, t0 = 0; pack_lens[b][i]; t0 += pack_lens[b][i++]) {
            const int n = pack_lens[b][i];
            fy_k_encoder_fwd(one, dtok + b * PT + t0, wte, wpe, NULL, 1, n, C, V, 1.0f, g_s);
            fy_k_encoder_bwd(awte, awpe, dputf(dout + ((size_t)b * PT + t0) * C, n * C),
                             dtok + b * PT + t0, NULL, 1, n, C, V, 1.0f, g_s);
            char what[64];
            snprintf(what, sizeof what, "embedding rows of sequence %d, document %d", b, i);
            expect_same_bits(what, dgetf(one, n * C), packed + ((size_t)b * PT + t0) * C,
                             sizeof(float) * n * C);
        }
    expect_same_bits("dwte, packed vs document by document", dgetf(dwte, V * C),
                     dgetf(awte, V * C), sizeof(float) * V * C);
    expect_same_bits("dwpe, packed vs document by document", dgetf(dwpe, PT * C),
                     dgetf(awpe, PT * C), sizeof(float) * PT * C);
}

/* Rotary embeddings: a row is rotated by the angles of its place in its document, from
 * the same fp32 table entries (cos and sin of place * frequency in double, rounded), so
 * the forward and the inverse are the document's own, bit for bit. */
Test(attn_docs, rope_restarts_per_document) {
    enum { NH = 4, NKV = 2, hd = 8, W = (NH + 2 * NKV) * hd };
    const fy_rope rp = {.type = FY_ROPE_LLAMA3, .theta = 500000.0f, .factor = 8.0f,
                        .low_freq_factor = 1.0f, .high_freq_factor = 4.0f, .orig_max_pos = 8.0f};
    rng r = {0x20be};
    const int32_t *docs = docs_from_lengths(PB, PT, pack_lens);
    float *x = hrand(&r, PB * PT * W, -2, 2);
    int32_t *ddocs = dnew(PB * PT * sizeof(int32_t));
    put(ddocs, docs, PB * PT * sizeof(int32_t));
    for (int inverse = 0; inverse < 2; inverse++) {
        float *px = dputf(x, PB * PT * W);
        fy_k_rope(px, ddocs, PB, PT, NH, NKV, hd, inverse, &rp, g_s);
        float *packed = dgetf(px, PB * PT * W);
        for (int b = 0; b < PB; b++)
            for (int i = 0, t0 = 0; pack_lens[b][i]; t0 += pack_lens[b][i++]) {
                const int n = pack_lens[b][i];
                float *one = dputf(rows_of(x, PT, W, b, t0, n), (size_t)n * W);
                fy_k_rope(one, NULL, 1, n, NH, NKV, hd, inverse, &rp, g_s);
                char what[80];
                snprintf(what, sizeof what, "rope%s rows of sequence %d, document %d",
                         inverse ? " inverse" : "", b, i);
                expect_same_bits(what, dgetf(one, (size_t)n * W),
                                 packed + ((size_t)b * PT + t0) * W, sizeof(float) * n * W);
            }
        /* a document not at position 0 is not left at its packed position's angles */
        float *plain = dputf(x, PB * PT * W);
        fy_k_rope(plain, NULL, PB, PT, NH, NKV, hd, inverse, &rp, g_s);
        cr_expect(memcmp(dgetf(plain, PB * PT * W) + 6 * W, packed + 6 * W, sizeof(float) * W),
                  "rope with documents rotated position 6 as without them");
    }
}

/* ---- attention over packed documents --------------------------------------------------- */

/* max |a - b| over n elements. */
static double max_diff(const float *a, const float *b, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++) m = fmax(m, fabs((double)a[i] - b[i]));
    return m;
}

/* Sequences of 300 positions: documents of 1, 130, 64, 105 and of 128, 72, 100
 * positions: one of a single position, documents that start inside the cpu kernel's key
 * tiles (128) and query tiles (64), one that ends on a tile boundary. */
Test(attn_docs, attention_over_packed_documents_is_each_document_alone) {
    static const int lens[2][8] = {{1, 130, 64, 105}, {128, 72, 100}};
    const attn_shape sh = {2, 300, 4, 2, 16};
    const int W = (sh.NH + 2 * sh.NKV) * sh.hd, Cq = sh.NH * sh.hd;
    const float scale = 0.25f;
    rng r = {0xa77d};
    const int32_t *docs = docs_from_lengths(sh.B, sh.T, lens);
    float *qkv = hrand(&r, shape_nqkv(&sh), -2, 2), *dout = hrand(&r, shape_nout(&sh), -1, 1);
    attn_res p = attn_run(g_dev, g_s, false, &sh, 0, scale, 0, docs, qkv, dout);
    double worst_out = 0, worst_lse = 0, worst_g = 0;
    for (int b = 0; b < sh.B; b++)
        for (int i = 0, t0 = 0; lens[b][i]; t0 += lens[b][i++]) {
            const int n = lens[b][i];
            const attn_shape one = {1, n, sh.NH, sh.NKV, sh.hd};
            const float *qkv1 = rows_of(qkv, sh.T, W, b, t0, n);
            attn_res a = attn_run(g_dev, g_s, false, &one, 0, scale, 0, NULL, qkv1,
                                  rows_of(dout, sh.T, Cq, b, t0, n));
            worst_out = fmax(worst_out, max_diff(a.out, p.out + ((size_t)b * sh.T + t0) * Cq,
                                                 (size_t)n * Cq));
            worst_g = fmax(worst_g, max_diff(a.dqkv, p.dqkv + ((size_t)b * sh.T + t0) * W,
                                             (size_t)n * W));
            for (int h = 0; h < sh.NH; h++) {
                const float *lp = p.lse + ((size_t)b * sh.NH + h) * sh.T + t0;
                worst_lse = fmax(worst_lse, max_diff(a.lse + (size_t)h * n, lp, n));
            }
        }
    cr_log_info("packed vs alone: max |diff| out %.2e, lse %.2e, dqkv %.2e", worst_out,
                worst_lse, worst_g);
    /* The same terms summed in another order: a document's keys fall into other tiles,
     * so the running max, the rescalings and BLAS's partial sums differ, each by a few
     * ulps of the values summed: out is a convex combination of values < 2 (an ulp 2.4e-7),
     * lse < 16 (an ulp 9.5e-7), dqkv sums of <= 130 terms into gradients < 16. Measured
     * 4.6e-7, 9.5e-7, 9.5e-7 (one ulp); bounds 2e-6, 4e-6, 5e-6. */
    cr_expect(worst_out <= 2e-6, "out differs from the documents alone by %.3g", worst_out);
    cr_expect(worst_lse <= 4e-6, "lse differs from the documents alone by %.3g", worst_lse);
    cr_expect(worst_g <= 5e-6, "dqkv differs from the documents alone by %.3g", worst_g);
    /* a one-position document sees itself alone: out = v exactly (one probability, 1) */
    for (int h = 0; h < sh.NH; h++)
        for (int c = 0; c < sh.hd; c++) {
            const float v = qkv[(sh.NH + sh.NKV + h / 2) * sh.hd + c];
            cr_expect(p.out[h * sh.hd + c] == v, "out[0,0,%d,%d] %.9g is not v %.9g", h, c,
                      p.out[h * sh.hd + c], v);
        }
}

/* ---- windows ------------------------------------------------------------------------- */

/* out and lse in double (kernels.h's mask: lo(t) <= j <= t). */
static void host_attention(const float *qkv, const attn_shape *sh, int window, float scale,
                           const int32_t *docs, double *out, double *lse) {
    const int T = sh->T, hd = sh->hd, W = (sh->NH + 2 * sh->NKV) * hd, G = sh->NH / sh->NKV;
    double *p = malloc(sizeof(double) * T);
    cr_assert(p);
    for (int b = 0; b < sh->B; b++)
        for (int h = 0; h < sh->NH; h++)
            for (int t = 0; t < T; t++) {
                int lo = docs ? docs[b * T + t] : 0;
                if (window > 0 && t - window + 1 > lo) lo = t - window + 1;
                const float *q = qkv + ((size_t)b * T + t) * W + (size_t)h * hd;
                const size_t kh = (size_t)(sh->NH + h / G) * hd, vh = kh + (size_t)sh->NKV * hd;
                double mx = -INFINITY, sum = 0;
                for (int j = lo; j <= t; j++) {
                    const float *k = qkv + ((size_t)b * T + j) * W + kh;
                    double s = 0;
                    for (int d = 0; d < hd; d++) s += (double)q[d] * k[d];
                    p[j] = s * scale;
                    mx = fmax(mx, p[j]);
                }
                for (int j = lo; j <= t; j++) sum += (p[j] = exp(p[j] - mx));
                lse[((size_t)b * sh->NH + h) * T + t] = mx + log(sum);
                for (int d = 0; d < hd; d++) {
                    double y = 0;
                    for (int j = lo; j <= t; j++)
                        y += p[j] / sum * qkv[((size_t)b * T + j) * W + vh + d];
                    out[((size_t)b * T + t) * sh->NH * hd + (size_t)h * hd + d] = y;
                }
            }
    free(p);
}

static void check_window_host(int window, const int lens[][8], uint64_t seed) {
    const attn_shape sh = {2, 200, 4, 2, 16};
    const float scale = 0.25f;
    rng r = {seed};
    const int32_t *docs = lens ? docs_from_lengths(sh.B, sh.T, lens) : NULL;
    float *qkv = hrand(&r, shape_nqkv(&sh), -1.5f, 1.5f), *dout = hrand(&r, shape_nout(&sh), -1, 1);
    attn_res g = attn_run(g_dev, g_s, false, &sh, window, scale, 0, docs, qkv, dout);
    double *out = malloc(sizeof(double) * shape_nout(&sh));
    double *lse = malloc(sizeof(double) * shape_nlse(&sh));
    cr_assert(out && lse);
    host_attention(qkv, &sh, window, scale, docs, out, lse);
    double eo = 0, el = 0;
    for (size_t i = 0; i < shape_nout(&sh); i++) eo = fmax(eo, fabs(g.out[i] - out[i]));
    for (size_t i = 0; i < shape_nlse(&sh); i++) el = fmax(el, fabs(g.lse[i] - lse[i]));
    cr_log_info("window %d%s: max |out - host| %.2e, |lse - host| %.2e", window,
                docs ? " with documents" : "", eo, el);
    /* Scores |s| <= 16 * 1.5^2 / 4 = 9 from fp32 dots of 16 products (error <= ~16u of
     * sum|q k| / 4 <= 9: 9e-6 in the worst case, ~1e-6 typical), then fp32 exps and sums of
     * <= 200 terms (a few ulps relative) and one logf: lse within 1e-5 of the double
     * one; out is a convex combination of values < 1.5 with probabilities off by the
     * score errors relative: 1e-5. Measured <= 6.9e-7 (lse), 2.8e-7 (out). */
    cr_expect(el <= 1e-5, "window %d: lse off the host double by %.3g", window, el);
    cr_expect(eo <= 1e-5, "window %d: out off the host double by %.3g", window, eo);
    free(out);
    free(lse);
}

Test(attn_docs, window_matches_host_double) {
    static const int lens[2][8] = {{3, 90, 107}, {150, 1, 49}};
    check_window_host(37, NULL, 0x3701);
    check_window_host(1, NULL, 0x0101);   /* each query sees itself only */
    check_window_host(129, NULL, 0x1291); /* more than a key tile */
    check_window_host(37, lens, 0x3702);  /* and documents */
}

/* lo(t) = max(doc start, t - w + 1): a window of T or more moves no lo, and the kernels
 * skip the same tiles, so the bits are no window's. */
Test(attn_docs, window_of_T_or_more_is_no_window_bit_for_bit) {
    static const int lens[2][8] = {{70, 130}, {200}};
    const attn_shape sh = {2, 200, 4, 2, 16};
    rng r = {0x77};
    float *qkv = hrand(&r, shape_nqkv(&sh), -2, 2), *dout = hrand(&r, shape_nout(&sh), -1, 1);
    for (int with_docs = 0; with_docs < 2; with_docs++) {
        const int32_t *docs = with_docs ? docs_from_lengths(sh.B, sh.T, lens) : NULL;
        attn_res none = attn_run(g_dev, g_s, false, &sh, 0, 0.25f, 0, docs, qkv, dout);
        const int windows[] = {sh.T, sh.T + 1, 1 << 20};
        for (int i = 0; i < 3; i++) {
            attn_res w = attn_run(g_dev, g_s, false, &sh, windows[i], 0.25f, 0, docs, qkv, dout);
            char what[80];
            snprintf(what, sizeof what, "window %d%s: out", windows[i], with_docs ? ", docs" : "");
            expect_same_bits(what, w.out, none.out, shape_nout(&sh) * sizeof(float));
            snprintf(what, sizeof what, "window %d%s: lse", windows[i], with_docs ? ", docs" : "");
            expect_same_bits(what, w.lse, none.lse, shape_nlse(&sh) * sizeof(float));
            snprintf(what, sizeof what, "window %d%s: dqkv", windows[i], with_docs ? ", docs" : "");
            expect_same_bits(what, w.dqkv, none.dqkv, shape_nqkv(&sh) * sizeof(float));
        }
    }
}

/* ---- determinism --------------------------------------------------------------------- */

/* kernels.h: results depend on the thread count at most on the cpu backend, and the
 * attention kernels' own orders (a row's key tiles in order; a key head's key tiles,
 * query heads and query tiles in order) do not depend on it at all. */
Test(attn_docs, same_bits_with_one_and_two_threads) {
    static const int lens[2][8] = {{1, 130, 64, 105, 300}, {200, 100, 300}};
    const attn_shape sh = {2, 600, 4, 2, 16};
    rng r = {0x1b2};
    const int32_t *docs = docs_from_lengths(sh.B, sh.T, lens);
    float *qkv = hrand(&r, shape_nqkv(&sh), -2, 2), *dout = hrand(&r, shape_nout(&sh), -1, 1);
    fy_dev *d1 = open_dev(0, 0, 1);
    fy_stream *s1;
    cr_assert_eq(fy_stream_new(d1, "one thread", &s1), FY_OK);
    /* the last with a soft cap: scores up to 16 * 2^2 / 4 = 16 bent by a cap of 2 */
    const int windows[] = {0, 100, 100};
    const float caps[] = {0.0f, 0.0f, 2.0f};
    for (int i = 0; i < 3; i++) {
        attn_res two = attn_run(g_dev, g_s, false, &sh, windows[i], 0.25f, caps[i], docs, qkv, dout);
        attn_res one = attn_run(d1, s1, false, &sh, windows[i], 0.25f, caps[i], docs, qkv, dout);
        char what[64];
        snprintf(what, sizeof what, "window %d cap %g: out, 1 vs 2 threads", windows[i], caps[i]);
        expect_same_bits(what, one.out, two.out, shape_nout(&sh) * sizeof(float));
        snprintf(what, sizeof what, "window %d cap %g: lse, 1 vs 2 threads", windows[i], caps[i]);
        expect_same_bits(what, one.lse, two.lse, shape_nlse(&sh) * sizeof(float));
        snprintf(what, sizeof what, "window %d cap %g: dqkv, 1 vs 2 threads", windows[i], caps[i]);
        expect_same_bits(what, one.dqkv, two.dqkv, shape_nqkv(&sh) * sizeof(float));
    }
    fy_stream_free(s1);
    fy_dev_free(d1);
}

/* ---- against the float64 PyTorch reference (tests/ref/gen_attn_ref.py) ------------------ */

/* The script's cases (its CASES, in the same words): document lengths per sequence,
 * 0-terminated, none for one document a sequence; the scale is 1/sqrt(hd) times scale_mul,
 * and softcap 0 is none. */
typedef struct attn_case {
    const char *name;
    attn_shape sh;
    int window;
    int lens[2][8];
    bool bf16;
    uint32_t seed;
    float scale_mul, softcap;
} attn_case;

static const attn_case attn_cases[] = {
    {"causal_4096", {1, 4096, 4, 2, 32}, 0, {{0}}, false, 4096, 1, 0},
    {"window", {2, 1000, 8, 2, 32}, 300, {{0}}, false, 300, 1, 0},
    {"docs", {2, 1024, 4, 2, 64}, 0, {{1, 200, 64, 128, 77, 300, 254}, {500, 1, 1, 130, 392}},
     false, 1024, 1, 0},
    {"window_docs_4096", {2, 4096, 4, 2, 32}, 512,
     {{700, 1, 1500, 63, 129, 1703}, {128, 3000, 968}}, false, 512, 1, 0},
    {"window_docs_4096_bf16", {2, 4096, 4, 2, 32}, 512,
     {{700, 1, 1500, 63, 129, 1703}, {128, 3000, 968}}, true, 513, 1, 0},
    {"causal_mqa_bf16", {2, 777, 4, 1, 32}, 0, {{0}}, true, 777, 1, 0},
    {"softcap", {2, 1000, 8, 2, 32}, 300, {{0}}, false, 50, 16.0f, 50.0f},
};

#define ATTN_MAGIC 0x54415946u /* "FYAT" */

/* The script's inputs: splitmix64 from state seed, each output z made a value in (-a, a)
 * exact in the storage type, a * (2u + 1 - 2^bits) / 2^bits with u = z >> (64 - bits),
 * bits 24 (fp32) or 8 (bf16). */
static float *exact_uniform(uint64_t seed, size_t n, float a, bool bf16) {
    const int bits = bf16 ? 8 : 24;
    rng r = {seed};
    float *x = hnewf(n);
    for (size_t i = 0; i < n; i++) {
        const int64_t u = (int64_t)(rng_u64(&r) >> (64 - bits));
        x[i] = (float)(2 * u + 1 - ((int64_t)1 << bits)) * ldexpf(a, -bits);
    }
    return x;
}

/* FNV-1a 64 over the docs array's int32 little-endian bytes (the script's docs_hash). */
static uint64_t docs_hash(const int32_t *docs, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; docs && i < n; i++)
        for (int k = 0; k < 4; k++)
            h = (h ^ (((uint32_t)docs[i] >> (8 * k)) & 0xff)) * 0x100000001b3ull;
    return docs ? h : 0;
}

/* The stored rows: t % 61 == 0, the last 64 positions, a document's first and last. */
static bool row_kept(const int32_t *docs, int T, int b, int t) {
    const int32_t *d = docs ? docs + (size_t)b * T : NULL;
    return t % 61 == 0 || t >= T - 64 || (d && (d[t] == t || t == T - 1 || d[t + 1] == t + 1));
}

/* A tensor's tolerance: err = ||got - ref|| / ||ref|| <= norm, and every element
 * |got - ref| <= rel |ref| + abs_rms rms(ref) + abs. */
typedef struct attn_tol { double norm, rel, abs_rms, abs; } attn_tol;

/* U_BF16: bf16's unit roundoff (8 significant bits, round to nearest): a result rounded
 * once to bf16 is within U_BF16 of it, relatively. */
#define U_BF16 0x1p-8

/* fp32 (index: out, lse, dq, dk, dv). out, dq, dk and dv are sums of up to T = 4096
 * terms (P v, P dout, dS k, dS q) over fp32 BLAS tiles and an online softmax whose
 * probabilities carry the scores' errors (fp32 dots of hd <= 64 products, scores of a
 * few units): norm-wise ~sqrt(T) u ~ 4e-6 at most; measured 2e-7..5e-7; bound 1e-5.
 * Per element the error follows the terms, whose size is the tensor's typical element,
 * not the element itself (a sum that cancels to ~0 keeps its terms' rounding), hence a
 * part in units of the tensor's rms: measured <= 7.4e-6 rms past 1e-5 |ref|; 5e-5 rms.
 * lse = max + log of an fp32 sum of <= 4096 terms <= 1 (the sum's relative error becomes
 * lse's absolute one): measured <= 1e-6 absolute; 1e-5.
 * With Gemma 2's soft cap of 50 (the softcap case: scale 16 / sqrt(hd), raw scores of rms
 * 21 up to 98, a quarter past 25 and 2% past the cap) the capped scores near 50 carry
 * absolute errors of a few of their ulps (3.8e-6) from tanhf and the products, which the
 * exponentials turn into relative errors of the probabilities, and dS is scaled by the
 * tanh's slope (down to 0.07) from scores of that error: measured norm-wise 9.4e-7 (out),
 * 1.4e-6 to 2e-6 (dq, dk, dv), per element <= 1.3e-5 rms: fp32's bounds. lse, now ~50
 * (an ulp 3.8e-6), is off by up to 7.5e-6, two ulps: bound 1e-5 plus 4 ulps, 5e-7 |lse|. */
static const attn_tol tol_f32[5] = {
    {1e-5, 1e-5, 5e-5, 0}, {1e-5, 0, 0, 1e-5}, {1e-5, 1e-5, 5e-5, 0}, {1e-5, 1e-5, 5e-5, 0},
    {1e-5, 1e-5, 5e-5, 0}};
static const attn_tol tol_cap[5] = {
    {1e-5, 1e-5, 5e-5, 0}, {1e-5, 5e-7, 0, 1e-5}, {1e-5, 1e-5, 5e-5, 0}, {1e-5, 1e-5, 5e-5, 0},
    {1e-5, 1e-5, 5e-5, 0}};
/* bf16 storage: the inputs are exact bf16 values, the arithmetic fp32, each output
 * rounded once. out and dv: their fp32 result rounded, so within U_BF16 of it per element
 * and in norm, plus fp32's error (measured in norm: out 8.9e-4 and 9.8e-4, dv 1.5e-3 and
 * 1.8e-3 in the two cases; past U_BF16 |ref| no element is off by more than 5e-8 rms).
 * lse stays fp32: fp32's bounds. dq and dk also see out rounded: delta = rowsum(dout *
 * out) moves by up to U_BF16 sum |dout out|, and with it dS = P (dP - delta), by P times
 * that: a second error of U_BF16's order in norm (bound 2 U_BF16; measured dq 1.8e-3 and
 * 1.7e-3, dk 2.5e-3 and 1.9e-3). Per element that part follows the row's delta (dq) or
 * the attending queries' (dk), not the element: measured up to 0.014 rms (dq) and 0.037
 * rms (dk) past U_BF16 |ref|; 16 U_BF16 = 0.0625 rms. */
static const attn_tol tol_bf16[5] = {
    {U_BF16 + 1e-5, U_BF16 + 1e-5, 5e-5, 0}, {1e-5, 0, 0, 1e-5},
    {2 * U_BF16, U_BF16 + 1e-5, 16 * U_BF16, 0}, {2 * U_BF16, U_BF16 + 1e-5, 16 * U_BF16, 0},
    {U_BF16 + 1e-5, U_BF16 + 1e-5, 5e-5, 0}};

/* Checks one tensor against its tolerance; logs the error and the worst element's
 * distance past the bound's relative part, in units of rms(ref). */
static void expect_close(const char *cname, const char *tname, const float *got,
                         const float *ref, size_t n, const attn_tol *tol) {
    double e2 = 0, r2 = 0, past = 0;
    for (size_t i = 0; i < n; i++) r2 += (double)ref[i] * ref[i];
    const double rms = sqrt(r2 / n);
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < n; i++) {
        const double d = fabs((double)got[i] - ref[i]);
        e2 += d * d;
        past = fmax(past, (d - tol->rel * fabs(ref[i])) / rms);
        const double bound = tol->rel * fabs(ref[i]) + tol->abs_rms * rms + tol->abs;
        if (!(d <= bound) && bad++ == 0) first = i;
    }
    const double err = sqrt(e2 / r2);
    cr_log_info("%-22s %-3s ||got - ref|| / ||ref|| = %.2e (tol %.1e), worst element %.1e rms "
                "past %.1e |ref|", cname, tname, err, tol->norm, past, tol->rel);
    cr_expect(err <= tol->norm, "%s %s: ||got - ref|| / ||ref|| = %.3g > %.3g", cname, tname,
              err, tol->norm);
    cr_expect(bad == 0, "%s %s: %zu of %zu elements past the bound, first [%zu] = %.9g, "
              "reference %.9g", cname, tname, bad, n, first, got[first], ref[first]);
}

static void *read_fixture(const char *name, size_t *nbytes) {
    const char *dir = getenv("FERRY_FIXTURES");
    cr_assert_not_null(dir, "FERRY_FIXTURES must name tests/fixtures");
    char path[1024];
    snprintf(path, sizeof path, "%s/attn_%s.bin", dir, name);
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "cannot open %s (tests/ref/gen_attn_ref.py writes it)", path);
    fseek(f, 0, SEEK_END);
    *nbytes = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    void *b = hnew(*nbytes);
    cr_assert_eq(fread(b, 1, *nbytes, f), *nbytes, "cannot read %s", path);
    fclose(f);
    return b;
}

static void check_case(const attn_case *c) {
    const attn_shape *sh = &c->sh;
    const int T = sh->T, W = (sh->NH + 2 * sh->NKV) * sh->hd, Cq = sh->NH * sh->hd;
    const int Ck = sh->NKV * sh->hd;
    const float scale = 1.0f / sqrtf((float)sh->hd) * c->scale_mul;
    const int32_t *docs = c->lens[0][0] ? docs_from_lengths(sh->B, T, c->lens) : NULL;
    size_t nbytes;
    const void *file = read_fixture(c->name, &nbytes);
    const uint32_t *hdr = file; /* little-endian, as the machines we run on */
    cr_assert_geq(nbytes, 64, "attn_%s.bin: %zu bytes, no header", c->name, nbytes);
    const uint64_t h = docs_hash(docs, (size_t)sh->B * T);
    uint32_t scale_bits, cap_bits;
    memcpy(&scale_bits, &scale, 4);
    memcpy(&cap_bits, &c->softcap, 4);
    const uint32_t want[15] = {ATTN_MAGIC, 1, (uint32_t)sh->B, (uint32_t)T, (uint32_t)sh->NH,
                               (uint32_t)sh->NKV, (uint32_t)sh->hd, (uint32_t)c->window,
                               c->bf16, c->seed, hdr[10], scale_bits, (uint32_t)h,
                               (uint32_t)(h >> 32), cap_bits};
    for (int i = 0; i < 15; i++)
        cr_assert_eq(hdr[i], want[i], "attn_%s.bin: header word %d is %u, this test's case "
                     "has %u (regenerate with tests/ref/gen_attn_ref.py, or align the cases)",
                     c->name, i, hdr[i], want[i]);
    const size_t nrows = hdr[10];
    const int32_t *rows = (const int32_t *)(hdr + 16);
    const float *ref = (const float *)(hdr + 16 + nrows);
    const float *r_out = ref, *r_lse = r_out + nrows * Cq, *r_dq = r_lse + nrows * sh->NH;
    const float *r_dk = r_dq + nrows * Cq, *r_dv = r_dk + nrows * Ck;
    cr_assert_eq(nbytes, (16 + nrows + nrows * (2 * Cq + sh->NH + 2 * Ck)) * 4,
                 "attn_%s.bin: %zu bytes", c->name, nbytes);
    size_t k = 0;
    for (int b = 0; b < sh->B; b++)
        for (int t = 0; t < T; t++)
            if (row_kept(docs, T, b, t)) {
                cr_assert(k < nrows && rows[k] == b * T + t, "attn_%s.bin: stored row %zu is "
                          "not (%d, %d)", c->name, k, b, t);
                k++;
            }
    cr_assert_eq(k, nrows, "attn_%s.bin: %zu rows, the rule keeps %zu", c->name, nrows, k);

    const float *qkv = exact_uniform(c->seed, shape_nqkv(sh), 2.0f, c->bf16);
    const float *dout = exact_uniform((uint64_t)c->seed + 1, shape_nout(sh), 1.0f, c->bf16);
    fy_stream *s = g_s;
    if (c->bf16) {
        cr_assert_eq(fy_stream_new(g_dev, "bf16", &s), FY_OK);
        cr_assert_eq(fy_stream_set_dtype(s, FY_BF16), FY_OK);
    }
    attn_res g = attn_run(g_dev, s, c->bf16, sh, c->window, scale, c->softcap, docs, qkv, dout);
    if (c->bf16) fy_stream_free(s);
    /* the kernel's results at the stored rows, in the file's layout */
    float *got = hnewf(nrows * (2 * Cq + sh->NH + 2 * Ck));
    float *g_out = got, *g_lse = g_out + nrows * Cq, *g_dq = g_lse + nrows * sh->NH;
    float *g_dk = g_dq + nrows * Cq, *g_dv = g_dk + nrows * Ck;
    for (size_t i = 0; i < nrows; i++) {
        const size_t bt = (size_t)rows[i], b = bt / T, t = bt % T;
        memcpy(g_out + i * Cq, g.out + bt * Cq, sizeof(float) * Cq);
        for (int hh = 0; hh < sh->NH; hh++)
            g_lse[i * sh->NH + hh] = g.lse[(b * sh->NH + hh) * T + t];
        memcpy(g_dq + i * Cq, g.dqkv + bt * W, sizeof(float) * Cq);
        memcpy(g_dk + i * Ck, g.dqkv + bt * W + Cq, sizeof(float) * Ck);
        memcpy(g_dv + i * Ck, g.dqkv + bt * W + Cq + Ck, sizeof(float) * Ck);
    }
    struct { const char *name; const float *got, *ref; size_t n; } t[] = {
        {"out", g_out, r_out, nrows * Cq}, {"lse", g_lse, r_lse, nrows * sh->NH},
        {"dq", g_dq, r_dq, nrows * Cq}, {"dk", g_dk, r_dk, nrows * Ck},
        {"dv", g_dv, r_dv, nrows * Ck}};
    for (int i = 0; i < 5; i++)
        expect_close(c->name, t[i].name, t[i].got, t[i].ref, t[i].n,
                     c->bf16 ? &tol_bf16[i] : c->softcap > 0 ? &tol_cap[i] : &tol_f32[i]);
}

TestSuite(attn_torch, .init = setup, .fini = teardown, .timeout = 120);

Test(attn_torch, causal_4096) { check_case(&attn_cases[0]); }
Test(attn_torch, window) { check_case(&attn_cases[1]); }
Test(attn_torch, docs) { check_case(&attn_cases[2]); }
Test(attn_torch, window_docs_4096) { check_case(&attn_cases[3]); }
Test(attn_torch, window_docs_4096_bf16) { check_case(&attn_cases[4]); }
Test(attn_torch, causal_mqa_bf16) { check_case(&attn_cases[5]); }
Test(attn_torch, softcap) { check_case(&attn_cases[6]); }
