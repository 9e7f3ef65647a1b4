/* test_model.c — the whole GPT-2 against an independent float64 PyTorch implementation
 * (tests/ref/gen_gpt2_ref.py; fixtures in tests/fixtures/gpt2_tiny_*), plus the model's
 * weight-file round trip and run-to-run determinism.
 *
 * Tolerances: ferry computes in fp32, the reference in float64 from the same fp32
 * initial weights and data. fp32 carries ~6e-8 relative rounding per operation; through
 * a 2-layer model the loss agrees to ~1e-6 relative and gradients to ~1e-5, so:
 *  - losses and gradient norms at every step: 1e-4 relative (the bar);
 *  - first-step gradients per tensor: ||ours - ref|| <= 1e-4 * ||ref||;
 *  - weights after 10 AdamW steps: ||ours - ref|| <= 1e-4 * ||ref|| per tensor; Adam
 *    divides by sqrt(v), so tiny gradient differences move weights by up to lr-sized
 *    steps where gradients are near zero, yet stay far below 1e-4 of the weights. */
#include <criterion/criterion.h>
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/core/dtype.h"
#include "engine/device/kernels.h"
#include "engine/io/tokens.h"
#include "engine/model/gpt2.h"
#include "engine/model/llama.h"
#include "engine/train.h"
#include "engine/trainer.h"
#include "tests/test_util.h"

static const char *fixture(const char *name) {
    static char path[4096];
    const char *dir = getenv("FERRY_FIXTURES");
    snprintf(path, sizeof path, "%s/%s", dir ? dir : "tests/fixtures", name);
    return path;
}

typedef struct ctx {
    cJSON *ref;
    fy_weights *init;
    fy_gpt2_config cfg;
    fy_model *model;
    fy_tokens *tok;
    fy_dev *dev;
    int B, T;
} ctx;

static void ctx_open(ctx *c) {
    char *text = test_read_file(fixture("gpt2_tiny_ref.json"), NULL);
    c->ref = cJSON_Parse(text);
    free(text);
    cr_assert(c->ref);
    cr_assert_eq(fy_weights_open(fixture("gpt2_tiny_init.safetensors"), &c->init), FY_OK);
    cr_assert_eq(fy_gpt2_weights_config(c->init, 4, &c->cfg), FY_OK);
    cr_assert_eq(fy_gpt2_new(&c->cfg, NULL, &c->model), FY_OK);
    const cJSON *jc = cJSON_GetObjectItem(c->ref, "config");
    cr_assert_eq(c->cfg.vocab, cJSON_GetObjectItem(jc, "vocab")->valueint);
    cr_assert_eq(c->cfg.max_seq, cJSON_GetObjectItem(jc, "max_seq")->valueint);
    cr_assert_eq(c->cfg.channels, cJSON_GetObjectItem(jc, "channels")->valueint);
    cr_assert_eq(c->cfg.layers, cJSON_GetObjectItem(jc, "layers")->valueint);
    c->B = cJSON_GetObjectItem(c->ref, "batch")->valueint;
    c->T = cJSON_GetObjectItem(c->ref, "seq")->valueint;
    cr_assert_eq(fy_tokens_open(fixture("gpt2_tiny_tokens.bin"), &c->tok), FY_OK);
    fy_dev_cfg dc = {.kind = FY_DEV_CPU, .threads = 2};
    cr_assert_eq(fy_dev_new(&dc, &c->dev), FY_OK);
}

static void ctx_close(ctx *c) {
    fy_dev_free(c->dev);
    fy_model_free(c->model);
    fy_tokens_free(c->tok);
    fy_weights_close(c->init);
    cJSON_Delete(c->ref);
}

static fy_trainer *new_trainer_accum(ctx *c, float clip, int accum) {
    const cJSON *a = cJSON_GetObjectItem(c->ref, "adamw");
    fy_trainer_cfg tc = {.model = c->model, .B = c->B, .T = c->T,
                         .beta1 = (float)cJSON_GetObjectItem(a, "beta1")->valuedouble,
                         .beta2 = (float)cJSON_GetObjectItem(a, "beta2")->valuedouble,
                         .eps = (float)cJSON_GetObjectItem(a, "eps")->valuedouble,
                         .weight_decay = (float)cJSON_GetObjectItem(a, "weight_decay")->valuedouble,
                         .clip = clip, .seed = 7, .grad_accum = accum};
    fy_trainer *tr;
    cr_assert_eq(fy_trainer_new(c->dev, &tc, &tr), FY_OK);
    cr_assert_eq(fy_trainer_load(tr, c->init), FY_OK);
    return tr;
}

static fy_trainer *new_trainer(ctx *c, float clip) { return new_trainer_accum(c, clip, 1); }

static float **host_blocks(const fy_model *m) {
    float **h = calloc((size_t)fy_model_nblocks(m), sizeof *h);
    for (int b = 0; b < fy_model_nblocks(m); b++) h[b] = calloc(fy_model_block(m, b)->nelem, sizeof(float));
    return h;
}

static void free_blocks(const fy_model *m, float **h) {
    for (int b = 0; b < fy_model_nblocks(m); b++) free(h[b]);
    free(h);
}

/* Per tensor: ||a - b|| <= tol * ||b||. With skip_key_bias, the key third of
 * attn.c_attn.bias is left out: softmax is invariant to adding a constant to every
 * score of a row, so the key bias has an exactly zero gradient and what both
 * implementations compute for it is rounding noise (~1e-9 here, ~1e-17 in float64)
 * that Adam normalises into lr-sized steps of random sign. Its zero gradient is
 * asserted in first_step_gradients_match_pytorch instead. */
static void expect_blocks_close(const fy_model *m, float **got, float **want, double tol,
                                const char *what, bool skip_key_bias) {
    for (int b = 0; b < fy_model_nblocks(m); b++) {
        const fy_block_spec *blk = fy_model_block(m, b);
        for (int i = 0; i < blk->ntensors; i++) {
            const fy_tensor_spec *t = &blk->tensors[i];
            size_t n = (size_t)t->rows * t->cols;
            double dd = 0, ww = 0;
            bool key_bias = skip_key_bias && strstr(t->name, "attn.c_attn.bias");
            size_t C = (size_t)fy_gpt2_config_of(m)->channels;
            for (size_t j = 0; j < n; j++) {
                if (key_bias && j >= C && j < 2 * C) continue;
                double g = got[b][t->offset + j], w = want[b][t->offset + j];
                dd += (g - w) * (g - w);
                ww += w * w;
            }
            if (getenv("FERRY_VERBOSE")) fprintf(stderr, "%s %s %.3g\n", what, t->name, sqrt(dd) / (sqrt(ww) + 1e-30));
            cr_expect(sqrt(dd) <= tol * sqrt(ww) + 1e-12, "%s %s: relative error %.3g > %.1g",
                      what, t->name, sqrt(dd) / (sqrt(ww) + 1e-30), tol);
        }
    }
}

Test(model, first_step_gradients_match_pytorch) {
    ctx c;
    ctx_open(&c);
    fy_trainer *tr = new_trainer(&c, 0.0f);
    const fy_model *lay = fy_trainer_model(tr);
    size_t N = (size_t)c.B * c.T;
    int32_t *x = malloc(N * 4), *y = malloc(N * 4);
    fy_loader *ld;
    cr_assert_eq(fy_loader_new(c.tok, 0, fy_tokens_count(c.tok), c.B, c.T, &ld), FY_OK);
    fy_loader_next(ld, x, y, NULL);
    fy_step_stats ss;
    cr_assert_eq(fy_trainer_step(tr, x, y, 0.0f, &ss), FY_OK); /* lr 0: weights stay */
    const cJSON *run = cJSON_GetObjectItem(cJSON_GetObjectItem(c.ref, "runs"), "noclip");
    double want_loss = cJSON_GetArrayItem(cJSON_GetObjectItem(run, "losses"), 0)->valuedouble;
    cr_expect(fabs(ss.loss - want_loss) <= 1e-5 * fabs(want_loss), "loss %.9g vs %.9g",
              ss.loss, want_loss);
    float **got = host_blocks(lay), **want = host_blocks(lay);
    for (int b = 0; b < fy_model_nblocks(lay); b++) cr_assert(fy_trainer_get_grads(tr, b, got[b]));
    fy_weights *gf;
    cr_assert_eq(fy_weights_open(fixture("gpt2_tiny_grads.safetensors"), &gf), FY_OK);
    cr_assert_eq(fy_model_load(lay, gf, want), FY_OK);
    expect_blocks_close(lay, got, want, 1e-4, "gradient", false);
    /* the key bias cannot change any softmax: its gradient is zero up to rounding */
    for (int l = 0; l < c.cfg.layers; l++) {
        fy_gpt2_layer_w g;
        fy_gpt2_layer_view(fy_model_block(lay, 1 + l), FY_F32, got[1 + l], &g);
        double kk = 0, qq = 0;
        for (int j = 0; j < c.cfg.channels; j++) {
            kk += (double)g.qkvb[c.cfg.channels + j] * g.qkvb[c.cfg.channels + j];
            qq += (double)g.qkvb[j] * g.qkvb[j];
        }
        cr_expect(sqrt(kk) <= 1e-4 * sqrt(qq), "layer %d key-bias gradient %.3g", l, sqrt(kk));
    }
    fy_weights_close(gf);
    free_blocks(lay, got);
    free_blocks(lay, want);
    fy_loader_free(ld);
    free(x);
    free(y);
    fy_trainer_free(tr);
    ctx_close(&c);
}

/* Trains 10 steps as the reference run `name` did and compares every step. */
static void check_run(const char *name, bool check_final) {
    ctx c;
    ctx_open(&c);
    const cJSON *run = cJSON_GetObjectItem(cJSON_GetObjectItem(c.ref, "runs"), name);
    float clip = (float)cJSON_GetObjectItem(run, "clip")->valuedouble;
    bool cosine = !strcmp(cJSON_GetObjectItem(run, "schedule")->valuestring, "cosine");
    int warmup = cJSON_GetObjectItem(run, "warmup")->valueint;
    double min_lr = cJSON_GetObjectItem(run, "min_lr")->valuedouble;
    double lr = cJSON_GetObjectItem(cJSON_GetObjectItem(c.ref, "adamw"), "lr")->valuedouble;
    int steps = cJSON_GetObjectItem(c.ref, "steps")->valueint;
    fy_trainer *tr = new_trainer(&c, clip);
    size_t N = (size_t)c.B * c.T;
    int32_t *x = malloc(N * 4), *y = malloc(N * 4);
    fy_loader *ld;
    cr_assert_eq(fy_loader_new(c.tok, 0, fy_tokens_count(c.tok), c.B, c.T, &ld), FY_OK);
    for (int s = 0; s < steps; s++) {
        double lr_s = fy_lr_at(s, steps, lr, min_lr, warmup, cosine);
        double want_lr = cJSON_GetArrayItem(cJSON_GetObjectItem(run, "lrs"), s)->valuedouble;
        cr_expect(fabs(lr_s - want_lr) <= 1e-12 * want_lr, "%s step %d lr %.17g vs %.17g",
                  name, s, lr_s, want_lr);
        fy_loader_next(ld, x, y, NULL);
        fy_step_stats ss;
        cr_assert_eq(fy_trainer_step(tr, x, y, (float)lr_s, &ss), FY_OK);
        double wl = cJSON_GetArrayItem(cJSON_GetObjectItem(run, "losses"), s)->valuedouble;
        double wn = cJSON_GetArrayItem(cJSON_GetObjectItem(run, "grad_norms"), s)->valuedouble;
        cr_expect(fabs(ss.loss - wl) <= 1e-4 * fabs(wl), "%s step %d: loss %.9g vs %.9g (rel %.2g)",
                  name, s, ss.loss, wl, fabs(ss.loss - wl) / wl);
        cr_expect(fabs(ss.grad_norm - wn) <= 1e-4 * fabs(wn), "%s step %d: norm %.9g vs %.9g",
                  name, s, ss.grad_norm, wn);
        if (clip > 0) cr_expect(ss.clip_coef < 1.0f, "%s step %d: clipping was not active", name, s);
        else cr_expect(ss.clip_coef == 1.0f);
    }
    if (check_final) {
        const fy_model *lay = fy_trainer_model(tr);
        float **got = host_blocks(lay), **want = host_blocks(lay);
        for (int b = 0; b < fy_model_nblocks(lay); b++) fy_trainer_get_params(tr, b, got[b]);
        fy_weights *ff;
        cr_assert_eq(fy_weights_open(fixture("gpt2_tiny_final_noclip.safetensors"), &ff), FY_OK);
        cr_assert_eq(fy_model_load(lay, ff, want), FY_OK);
        expect_blocks_close(lay, got, want, 1e-4, "final weight", true);
        fy_weights_close(ff);
        free_blocks(lay, got);
        free_blocks(lay, want);
    }
    fy_loader_free(ld);
    free(x);
    free(y);
    fy_trainer_free(tr);
    ctx_close(&c);
}

Test(model, ten_steps_match_pytorch_noclip) { check_run("noclip", true); }
Test(model, ten_steps_match_pytorch_clip) { check_run("clip", false); }
Test(model, ten_steps_match_pytorch_cosine_schedule) { check_run("cosine", false); }

/* Two identical runs give bit-identical losses and weights. */
Test(model, training_is_deterministic) {
    ctx c;
    ctx_open(&c);
    float losses[2][5];
    float **w[2];
    const fy_model *lay = NULL;
    size_t N = (size_t)c.B * c.T;
    int32_t *x = malloc(N * 4), *y = malloc(N * 4);
    for (int r = 0; r < 2; r++) {
        fy_trainer *tr = new_trainer(&c, 1.0f);
        lay = fy_trainer_model(tr);
        fy_loader *ld;
        cr_assert_eq(fy_loader_new(c.tok, 0, fy_tokens_count(c.tok), c.B, c.T, &ld), FY_OK);
        for (int s = 0; s < 5; s++) {
            fy_loader_next(ld, x, y, NULL);
            fy_step_stats ss;
            cr_assert_eq(fy_trainer_step(tr, x, y, 1e-3f, &ss), FY_OK);
            losses[r][s] = ss.loss;
        }
        w[r] = host_blocks(lay);
        for (int b = 0; b < fy_model_nblocks(lay); b++) fy_trainer_get_params(tr, b, w[r][b]);
        fy_loader_free(ld);
        if (r == 1) {
            for (int s = 0; s < 5; s++) cr_expect(losses[0][s] == losses[1][s], "step %d", s);
            for (int b = 0; b < fy_model_nblocks(lay); b++)
                cr_expect(!memcmp(w[0][b], w[1][b], fy_model_block(lay, b)->nelem * 4), "block %d", b);
            free_blocks(lay, w[0]);
            free_blocks(lay, w[1]);
        }
        fy_trainer_free(tr);
    }
    free(x);
    free(y);
    ctx_close(&c);
}

/* Save, reload into a fresh trainer: identical parameters, and the file carries the
 * config (heads) so no --heads is needed. */
Test(model, save_and_reload_is_exact) {
    ctx c;
    ctx_open(&c);
    fy_trainer *tr = new_trainer(&c, 0.0f);
    char path[] = "/tmp/ferry_test_model_XXXXXX.safetensors";
    int fd = mkstemps(path, 12);
    cr_assert(fd >= 0);
    close(fd);
    cr_assert_eq(fy_trainer_save(tr, path, NULL), FY_OK);
    fy_weights *f;
    cr_assert_eq(fy_weights_open(path, &f), FY_OK);
    fy_gpt2_config cfg;
    cr_assert_eq(fy_gpt2_weights_config(f, 0, &cfg), FY_OK);
    cr_expect(!memcmp(&cfg, &c.cfg, sizeof cfg), "the heads come from the file's config");
    cr_expect_str_eq(fy_weights_meta(f, "format"), "pt");
    cr_expect_not_null(fy_weights_config(f), "a single file carries its config (ferry.config)");
    cr_expect_null(fy_weights_find(f, "lm_head.weight", NULL), "the LM head is tied, never stored");
    const fy_model *lay = fy_trainer_model(tr);
    float **a = host_blocks(lay), **b2 = host_blocks(lay);
    for (int b = 0; b < fy_model_nblocks(lay); b++) fy_trainer_get_params(tr, b, a[b]);
    cr_assert_eq(fy_model_load(lay, f, b2), FY_OK);
    for (int b = 0; b < fy_model_nblocks(lay); b++)
        cr_expect(!memcmp(a[b], b2[b], fy_model_block(lay, b)->nelem * 4), "block %d differs", b);
    /* Conv1D tensors are stored (in, out) */
    const fy_st_tensor *t = fy_weights_find(f, "h.0.mlp.c_fc.weight", NULL);
    cr_assert_not_null(t);
    cr_expect(t->shape[0] == c.cfg.channels && t->shape[1] == 4 * c.cfg.channels);
    fy_weights_close(f);
    unlink(path);
    free_blocks(lay, a);
    free_blocks(lay, b2);
    fy_trainer_free(tr);
    ctx_close(&c);
}

/* Two accumulated micro-batches of B equal one batch of 2B, up to fp32 summation order. */
Test(model, gradient_accumulation_matches_larger_batch) {
    ctx c;
    ctx_open(&c);
    size_t N = (size_t)c.B * c.T;
    int32_t *x = malloc(2 * N * 4), *y = malloc(2 * N * 4);
    fy_loader *ld;
    cr_assert_eq(fy_loader_new(c.tok, 0, fy_tokens_count(c.tok), c.B, c.T, &ld), FY_OK);
    fy_loader_next(ld, x, y, NULL);
    fy_loader_next(ld, x + N, y + N, NULL);
    fy_trainer *tr = new_trainer_accum(&c, 0.0f, 2);
    fy_step_stats s2;
    cr_assert_eq(fy_trainer_step(tr, x, y, 0.0f, &s2), FY_OK);
    fy_step_stats a, b;
    fy_trainer *t1 = new_trainer(&c, 0.0f);
    cr_assert_eq(fy_trainer_step(t1, x, y, 0.0f, &a), FY_OK);
    cr_assert_eq(fy_trainer_step(t1, x + N, y + N, 0.0f, &b), FY_OK);
    cr_expect(fabsf(s2.loss - 0.5f * (a.loss + b.loss)) <= 1e-6f * s2.loss);
    fy_trainer_free(t1);
    fy_trainer_free(tr);
    fy_loader_free(ld);
    free(x);
    free(y);
    ctx_close(&c);
}

/* ---- the classifier over row chunks ------------------------------------------------- */

static float *dev_upload(fy_dev *d, fy_stream *s, const float *h, size_t n) {
    float *p;
    cr_assert_eq(fy_dev_alloc(d, FY_MEM_DEVICE, n * sizeof(float), "test", (void **)&p), FY_OK);
    if (h) fy_copy_async(s, p, h, n * sizeof(float), FY_H2D);
    return p;
}

static double unif(uint64_t *st) { /* splitmix64 to [0, 1) */
    uint64_t z = (*st += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return (double)((z ^ (z >> 31)) >> 11) * 0x1p-53;
}

static double rel_err(const float *got, const float *want, size_t n) {
    double d = 0, w = 0;
    for (size_t i = 0; i < n; i++) {
        d += ((double)got[i] - want[i]) * ((double)got[i] - want[i]);
        w += (double)want[i] * want[i];
    }
    return sqrt(d / (w > 0 ? w : 1));
}

/* fy_gpt2_head_step against the same kernels written out over all N rows at once (the
 * whole (N, V) logits, fy_k_crossentropy): one vocabulary chunk at this size, the same
 * products; BLAS may block the d lnf GEMM differently (beta 1 onto zeros), so agreement
 * is to fp32 rounding: 1e-5 relative. */
Test(model, gpt2_head_matches_the_kernels_written_out) {
    fy_gpt2_config cfg = {.vocab = 3000, .max_seq = 16, .channels = 8, .layers = 1, .heads = 2};
    const int B = 8, T = 16, N = B * T, C = cfg.channels, V = cfg.vocab;
    cr_assert_eq(fy_gpt2_chunks(&cfg, (size_t)N, 4).n, 1);
    fy_dev *d;
    fy_stream *s;
    fy_dev_cfg dc = {.kind = FY_DEV_CPU, .threads = 2};
    cr_assert_eq(fy_dev_new(&dc, &d), FY_OK);
    cr_assert_eq(fy_stream_new(d, "t", &s), FY_OK);
    uint64_t rng = 7;
    float *h_wte = malloc((size_t)V * C * sizeof(float)), *h_x = malloc((size_t)N * C * sizeof(float));
    int32_t *h_y = malloc((size_t)N * sizeof(int32_t));
    for (size_t i = 0; i < (size_t)V * C; i++) h_wte[i] = (float)(unif(&rng) - 0.5);
    for (size_t i = 0; i < (size_t)N * C; i++) h_x[i] = (float)(unif(&rng) * 4 - 2);
    for (int n = 0; n < N; n++) h_y[n] = (int32_t)(unif(&rng) * V) % V;
    float h_w[2 * 8];
    for (int i = 0; i < 2 * C; i++) h_w[i] = 1.0f + 0.1f * (float)i;
    fy_gpt2_head_w w = {.lnfw = dev_upload(d, s, h_w, C), .lnfb = dev_upload(d, s, h_w + C, C)};
    fy_gpt2_head_w g = {.lnfw = dev_upload(d, s, NULL, C), .lnfb = dev_upload(d, s, NULL, C)};
    /* wte and dwte take the padded vocabulary's rows (zero past V) */
    const size_t VpC = (size_t)fy_gpt2_vocab_padded(&cfg) * C;
    float *wte = dev_upload(d, s, NULL, VpC), *x = dev_upload(d, s, h_x, (size_t)N * C);
    fy_memset_async(s, wte, 0, VpC * sizeof(float));
    fy_copy_async(s, wte, h_wte, (size_t)V * C * sizeof(float), FY_H2D);
    int32_t *y;
    cr_assert_eq(fy_dev_alloc(d, FY_MEM_DEVICE, (size_t)N * 4, "y", (void **)&y), FY_OK);
    fy_copy_async(s, y, h_y, (size_t)N * 4, FY_H2D);
    fy_gpt2_head_acts a;
    fy_gpt2_head_work wk;
    fy_gpt2_head_acts_bind(&cfg, B, T, FY_F32,
                           dev_upload(d, s, NULL, fy_gpt2_head_acts_nbytes(&cfg, B, T, FY_F32) / 4), &a);
    fy_gpt2_head_work_bind(&cfg, B, T, FY_F32,
                           dev_upload(d, s, NULL, fy_gpt2_head_work_nbytes(&cfg, B, T, FY_F32) / 4), &wk);
    cr_assert_null(wk.dlnf, "fp32 storage: d lnf is its fp32 sum");
    float *dwte = dev_upload(d, s, NULL, VpC), *loss = dev_upload(d, s, NULL, 1);
    fy_memset_async(s, dwte, 0, VpC * sizeof(float));
    float *dxL = dev_upload(d, s, NULL, (size_t)N * C);
    const float dloss = 1.0f / N;
    fy_gpt2_head_step(&cfg, &w, &g, wte, dwte, x, &a, &wk, y, dloss, loss, N, dxL, B, T, s);

    float *lnf = dev_upload(d, s, NULL, (size_t)N * C), *mean = dev_upload(d, s, NULL, N);
    float *rstd = dev_upload(d, s, NULL, N), *logits = dev_upload(d, s, NULL, (size_t)N * V);
    float *losses = dev_upload(d, s, NULL, N), *rloss = dev_upload(d, s, NULL, 1);
    float *rdwte = dev_upload(d, s, NULL, (size_t)V * C), *dlnf = dev_upload(d, s, NULL, (size_t)N * C);
    float *dx = dev_upload(d, s, NULL, (size_t)N * C);
    fy_memset_async(s, rdwte, 0, (size_t)V * C * sizeof(float));
    fy_memset_async(s, dx, 0, (size_t)N * C * sizeof(float));
    fy_gpt2_head_w rg = {.lnfw = dev_upload(d, s, NULL, C), .lnfb = dev_upload(d, s, NULL, C)};
    fy_memset_async(s, rg.lnfw, 0, C * sizeof(float));
    fy_memset_async(s, rg.lnfb, 0, C * sizeof(float));
    fy_k_layernorm_fwd(lnf, mean, rstd, x, w.lnfw, w.lnfb, N, C, s);
    fy_k_matmul_fwd(logits, lnf, wte, NULL, N, C, V, s);
    fy_k_crossentropy(losses, logits, y, N, V, V, dloss, 0.0f, s);
    fy_k_mean(rloss, losses, (size_t)N, N, s);
    fy_k_matmul_bwd(dlnf, rdwte, NULL, logits, lnf, wte, N, C, V, s);
    fy_k_layernorm_bwd(dx, rg.lnfw, rg.lnfb, dlnf, x, w.lnfw, mean, rstd, N, C, s);
    fy_stream_sync(s);

    cr_expect_eq(loss[0], rloss[0], "one chunk: the loss is crossentropy's bits");
    cr_expect(!memcmp(a.losses, losses, (size_t)N * sizeof(float)), "per-position losses");
    cr_expect_leq(rel_err(dwte, rdwte, (size_t)V * C), 1e-5, "dwte");
    for (size_t i = (size_t)V * C; i < VpC; i++)
        cr_assert_eq(dwte[i], 0.0f, "the padded vocabulary's rows get no gradient ([%zu])", i);
    cr_expect_leq(rel_err(dxL, dx, (size_t)N * C), 1e-5, "d xL");
    cr_expect_leq(rel_err(g.lnfw, rg.lnfw, C), 1e-5, "d ln_f.weight");
    cr_expect_leq(rel_err(g.lnfb, rg.lnfb, C), 1e-5, "d ln_f.bias");
    free(h_wte); free(h_x); free(h_y);
    fy_stream_free(s);
    fy_dev_free(d);
}

/* The classifier's chunks: multiples of 64, even, covering the padded vocabulary, their
 * logits within the budget, bounded further where a family asks (Llama 3 8B's untied
 * lm_head: a chunk and the norm within a layer's 218M parameters). */
Test(model, vocabulary_chunks_are_even_and_bounded) {
    const size_t budget = FY_LM_LOGIT_CHUNK_NBYTES;
    const struct { size_t N; int Vp; size_t es, max_rows; } cases[] = {
        {32, 50304, 4, 0}, {8192, 50304, 2, 0}, {8192, 50304, 4, 0}, {2048, 128256, 2, 53248},
        {16384, 128256, 2, 53248}, {1u << 22, 128256, 2, 0}, {100, 64, 4, 0}, {100, 640, 4, 100}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        fy_lm_chunks c = fy_lm_chunks_of(cases[i].N, cases[i].Vp, cases[i].es, cases[i].max_rows);
        cr_expect(c.rows % 64 == 0 && c.rows >= 64 && c.n >= 1, "case %zu: %d rows x %d", i, c.rows, c.n);
        cr_expect(fy_lm_chunk_v0(c, c.n - 1) < c.Vp && fy_lm_chunk_v0(c, c.n - 1) + fy_lm_chunk_nv(c, c.n - 1) == c.Vp,
                  "case %zu: the chunks cover the rows", i);
        cr_expect(fy_lm_chunk_nv(c, c.n - 1) > c.rows - 64 * c.n || c.n == 1, "case %zu: even", i);
        if (c.rows > 64) {
            cr_expect_leq(cases[i].N * (size_t)c.rows * cases[i].es, budget, "case %zu: logits", i);
            if (cases[i].max_rows) cr_expect_leq((size_t)c.rows, cases[i].max_rows, "case %zu", i);
        }
    }
    cr_expect_eq(fy_lm_chunks_of(32, 50304, 4, 0).n, 1, "GPT-2 at 1 x 32: one chunk");
    fy_llama_config l3;
    cr_assert_eq(fy_llama_config_named("llama3-8b", &l3), FY_OK);
    fy_lm_chunks c = fy_llama_chunks(&l3, 2048, 2);
    cr_expect((size_t)c.rows * 4096 + 4096 + 64 <= 218103808, "a chunk and the norm within a layer");
    cr_expect_eq(c.n, 3);
}

/* fy_lm_head by vocabulary chunks against one pass over all logits (fy_k_crossentropy and
 * the plain GEMMs), fp32: one chunk gives the same losses bit for bit; 2, 5 and 16 chunks
 * (the running log-sum-exp rescaled at each) agree to fp32 rounding (1e-6 relative on
 * the losses, 1e-5 on the gradients). */
Test(model, vocabulary_chunks_match_one_pass) {
    const int N = 96, C = 16, V = 1000, Vp = fy_lm_vocab_padded(V);
    fy_dev *d;
    fy_stream *s;
    fy_dev_cfg dc = {.kind = FY_DEV_CPU, .threads = 2};
    cr_assert_eq(fy_dev_new(&dc, &d), FY_OK);
    cr_assert_eq(fy_stream_new(d, "t", &s), FY_OK);
    uint64_t rng = 5;
    float *hw = calloc((size_t)Vp * C, sizeof(float)), *hx = malloc((size_t)N * C * sizeof(float));
    int32_t *hy = malloc((size_t)N * 4);
    for (size_t i = 0; i < (size_t)V * C; i++) hw[i] = (float)(unif(&rng) - 0.5);
    for (size_t i = 0; i < (size_t)N * C; i++) hx[i] = (float)(unif(&rng) * 4 - 2);
    for (int n = 0; n < N; n++) hy[n] = (int32_t)(unif(&rng) * V) % V;
    hy[0] = V - 1; /* the last class, in the last chunk */
    float *w = dev_upload(d, s, hw, (size_t)Vp * C), *x = dev_upload(d, s, hx, (size_t)N * C);
    int32_t *y;
    cr_assert_eq(fy_dev_alloc(d, FY_MEM_DEVICE, (size_t)N * 4, "y", (void **)&y), FY_OK);
    fy_copy_async(s, y, hy, (size_t)N * 4, FY_H2D);
    const float dloss = 1.0f / N;
    /* the one pass */
    float *logits = dev_upload(d, s, NULL, (size_t)N * Vp), *rl = dev_upload(d, s, NULL, N);
    float *rdw = dev_upload(d, s, NULL, (size_t)Vp * C), *rdx = dev_upload(d, s, NULL, (size_t)N * C);
    fy_memset_async(s, rdw, 0, (size_t)Vp * C * 4);
    fy_k_matmul_fwd(logits, x, w, NULL, N, C, Vp, s);
    fy_k_crossentropy(rl, logits, y, N, V, Vp, dloss, 0.0f, s);
    fy_k_matmul_bwd(rdx, rdw, NULL, logits, x, w, N, C, Vp, s);
    const int caps[] = {Vp, 512, 192, 64};
    for (int i = 0; i < 4; i++) {
        fy_lm_chunks ch = fy_lm_chunks_of((size_t)N, Vp, 4, (size_t)caps[i]);
        float *lg = dev_upload(d, s, NULL, (size_t)N * ch.rows), *mx = dev_upload(d, s, NULL, N);
        float *tl = dev_upload(d, s, NULL, N), *ls = dev_upload(d, s, NULL, N);
        double *sm;
        cr_assert_eq(fy_dev_alloc(d, FY_MEM_DEVICE, (size_t)N * 8, "sum", (void **)&sm), FY_OK);
        float *dw = dev_upload(d, s, NULL, (size_t)Vp * C), *dx = dev_upload(d, s, NULL, (size_t)N * C);
        fy_memset_async(s, dw, 0, (size_t)Vp * C * 4);
        fy_lm_head_io io = {.N = N, .C = C, .V = V, .chunks = ch, .xn = x, .logits = lg, .max = mx,
                            .sum = sm, .tlogit = tl, .losses = ls, .targets = y, .dloss = dloss,
                            .dxn32 = dx};
        fy_lm_head(&io, w, dw, s);
        fy_stream_sync(s);
        cr_log_info("%d chunks of %d rows: losses %.3g, dw %.3g, dx %.3g", ch.n, ch.rows,
                    rel_err(ls, rl, N), rel_err(dw, rdw, (size_t)Vp * C), rel_err(dx, rdx, (size_t)N * C));
        if (ch.n == 1) cr_expect(!memcmp(ls, rl, (size_t)N * 4), "one chunk: crossentropy's losses");
        cr_expect_leq(rel_err(ls, rl, N), 1e-6, "%d chunks: losses", ch.n);
        cr_expect_leq(rel_err(dw, rdw, (size_t)Vp * C), 1e-5, "%d chunks: dw", ch.n);
        cr_expect_leq(rel_err(dx, rdx, (size_t)N * C), 1e-5, "%d chunks: dx", ch.n);
        for (size_t k = (size_t)V * C; k < (size_t)Vp * C; k++)
            cr_assert_eq(dw[k], 0.0f, "%d chunks: padding rows get no gradient", ch.n);
        if (i == 3) cr_expect_eq(ch.n, 16);
    }
    free(hw); free(hx); free(hy);
    fy_stream_free(s);
    fy_dev_free(d);
}

/* With bf16 storage and several vocabulary chunks, each row's gradient is one GEMM and d
 * xn is summed in fp32: against the same classifier computed in fp32 on the same (bf16)
 * inputs, dw and d xn are within bf16's rounding (2^-9 = 2e-3 relative per element;
 * bound 4e-3 relative-norm). */
Test(model, bf16_classifier_rounds_each_gradient_once) {
    const int N = 256, C = 8, V = 3000, Vp = fy_lm_vocab_padded(V);
    fy_lm_chunks ch = fy_lm_chunks_of((size_t)N, Vp, 2, 640);
    cr_assert_eq(ch.n, 5);
    fy_dev *d;
    fy_dev_cfg dc = {.kind = FY_DEV_CPU, .threads = 2};
    cr_assert_eq(fy_dev_new(&dc, &d), FY_OK);
    fy_stream *ss[2];
    cr_assert_eq(fy_stream_new(d, "fp32", &ss[0]), FY_OK);
    cr_assert_eq(fy_stream_new(d, "bf16", &ss[1]), FY_OK);
    cr_assert_eq(fy_stream_set_dtype(ss[1], FY_BF16), FY_OK);
    uint64_t rng = 11;
    const size_t n_in[2] = {(size_t)Vp * C, (size_t)N * C};
    float *f[2];
    uint16_t *h[2];
    for (int k = 0; k < 2; k++) { /* bf16-representable inputs, as fp32 and as bf16 */
        f[k] = calloc(n_in[k], sizeof(float));
        h[k] = calloc(n_in[k], 2);
        for (size_t i = 0; i < (k ? n_in[k] : (size_t)V * C); i++) {
            h[k][i] = fy_f32_to_bf16((float)(k ? unif(&rng) * 4 - 2 : unif(&rng) - 0.5));
            f[k][i] = fy_bf16_to_f32(h[k][i]);
        }
    }
    int32_t *hy = malloc((size_t)N * 4), *y;
    for (int n = 0; n < N; n++) hy[n] = (int32_t)(unif(&rng) * V) % V;
    cr_assert_eq(fy_dev_alloc(d, FY_MEM_DEVICE, (size_t)N * 4, "y", (void **)&y), FY_OK);
    fy_copy_async(ss[0], y, hy, (size_t)N * 4, FY_H2D);
    float *out[2][2]; /* [run][dw, dx] as fp32 */
    for (int run = 0; run < 2; run++) {
        fy_stream *s = ss[run];
        const size_t es = run ? 2 : 4;
        void *in[2], *lg, *dw, *dx, *dx32;
        for (int k = 0; k < 2; k++) {
            cr_assert_eq(fy_dev_alloc(d, FY_MEM_DEVICE, n_in[k] * es, "in", &in[k]), FY_OK);
            fy_copy_async(s, in[k], run ? (void *)h[k] : (void *)f[k], n_in[k] * es, FY_H2D);
        }
        cr_assert_eq(fy_dev_alloc(d, FY_MEM_DEVICE, (size_t)N * ch.rows * es, "lg", &lg), FY_OK);
        cr_assert_eq(fy_dev_alloc(d, FY_MEM_DEVICE, n_in[0] * es, "dw", &dw), FY_OK);
        cr_assert_eq(fy_dev_alloc(d, FY_MEM_DEVICE, n_in[1] * es, "dx", &dx), FY_OK);
        cr_assert_eq(fy_dev_alloc(d, FY_MEM_DEVICE, n_in[1] * 4, "dx32", &dx32), FY_OK);
        fy_memset_async(s, dw, 0, n_in[0] * es);
        float *mx = dev_upload(d, s, NULL, N), *tl = dev_upload(d, s, NULL, N), *ls = dev_upload(d, s, NULL, N);
        double *sm;
        cr_assert_eq(fy_dev_alloc(d, FY_MEM_DEVICE, (size_t)N * 8, "sum", (void **)&sm), FY_OK);
        fy_lm_head_io io = {.N = N, .C = C, .V = V, .chunks = ch, .xn = in[1], .logits = lg,
                            .max = mx, .sum = sm, .tlogit = tl, .losses = ls, .targets = y,
                            .dloss = 1.0f / N, .dxn32 = dx32, .dxn = run ? dx : NULL};
        fy_lm_head(&io, in[0], dw, s);
        fy_stream_sync(s);
        void *res[2] = {dw, run ? dx : dx32};
        for (int k = 0; k < 2; k++) {
            out[run][k] = malloc(n_in[k] * sizeof(float));
            for (size_t i = 0; i < n_in[k]; i++)
                out[run][k][i] = run ? fy_bf16_to_f32(((uint16_t *)res[k])[i]) : ((float *)res[k])[i];
        }
    }
    const double edw = rel_err(out[1][0], out[0][0], n_in[0]), edx = rel_err(out[1][1], out[0][1], n_in[1]);
    cr_log_info("bf16 vs fp32, 5 chunks: dw %.3g, d xn %.3g", edw, edx);
    cr_expect_leq(edw, 4e-3, "dw: %.3g from fp32's", edw);
    cr_expect_leq(edx, 4e-3, "d xn: %.3g from fp32's", edx);
    for (int k = 0; k < 2; k++) { free(f[k]); free(h[k]); free(out[0][k]); free(out[1][k]); }
    free(hy);
    fy_stream_free(ss[0]);
    fy_stream_free(ss[1]);
    fy_dev_free(d);
}

/* A vocabulary that is not a multiple of 64 (300: wte keeps 320 rows): training leaves
 * the padding rows exactly zero under any plan and storage type, files hold the 300 real
 * rows, and a saved run loads back to the same weights. */
Test(model, padded_vocabulary_rows_stay_zero_and_stay_out_of_files) {
    fy_gpt2_config cfg = {.vocab = 300, .max_seq = 16, .channels = 16, .layers = 1, .heads = 2};
    const int V = cfg.vocab, Vp = fy_gpt2_vocab_padded(&cfg), C = cfg.channels, B = 2, T = 16;
    cr_assert_eq(Vp, 320);
    fy_dtype dts[2] = {FY_F32, FY_BF16};
    fy_model *m;
    cr_assert_eq(fy_gpt2_new(&cfg, NULL, &m), FY_OK);
    for (int k = 0; k < 2; k++) {
        fy_plan plan;
        cr_assert_eq(fy_plan_new(m, B, 1, &plan), FY_OK);
        cr_assert_eq(fy_plan_shorthands(&plan, k ? 1.0 : 0.0, k ? 0.0 : 1.0, 0), FY_OK);
        plan.dtype = dts[k];
        fy_dev *d;
        fy_dev_cfg dc = {.kind = FY_DEV_CPU, .threads = 2};
        cr_assert_eq(fy_dev_new(&dc, &d), FY_OK);
        fy_trainer_cfg tc = {.model = m, .T = T, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
                             .weight_decay = 0.1f, .clip = 1.0f, .seed = 5, .plan = &plan};
        fy_trainer *tr;
        cr_assert_eq(fy_trainer_new(d, &tc, &tr), FY_OK);
        int32_t x[B * T], y[B * T];
        uint64_t rng = 3;
        for (int s = 0; s < 3; s++) {
            for (int i = 0; i < B * T; i++) {
                x[i] = (int32_t)(unif(&rng) * V) % V;
                y[i] = (int32_t)(unif(&rng) * V) % V;
            }
            fy_step_stats ss;
            cr_assert_eq(fy_trainer_step(tr, x, y, 1e-2f, &ss), FY_OK);
            cr_assert(!ss.skipped && isfinite(ss.loss));
        }
        const fy_model *lay = fy_trainer_model(tr);
        const fy_tensor_spec *wte = &fy_model_block(lay, 0)->tensors[0];
        cr_assert_str_eq(wte->name, "wte.weight");
        cr_assert_eq(wte->rows, V);
        cr_assert_eq(wte->alloc_rows, Vp);
        float *w = malloc(fy_model_block(lay, 0)->nelem * sizeof(float));
        fy_trainer_get_params(tr, 0, w);
        for (size_t i = (size_t)V * C; i < (size_t)Vp * C; i++)
            cr_assert_eq(w[wte->offset + i], 0.0f, "%s: padding row element %zu moved to %g",
                         fy_dtype_name(dts[k]), i, w[wte->offset + i]);
        char path[] = "/tmp/ferry-test-pad-XXXXXX.safetensors";
        int fd = mkstemps(path, 12);
        cr_assert_geq(fd, 0);
        close(fd);
        cr_assert_eq(fy_trainer_save(tr, path, NULL), FY_OK);
        fy_weights *f;
        cr_assert_eq(fy_weights_open(path, &f), FY_OK);
        const fy_st_tensor *t = fy_weights_find(f, "wte.weight", NULL);
        cr_assert_not_null(t);
        cr_expect(t->ndim == 2 && t->shape[0] == V && t->shape[1] == C,
                  "the file's wte should be (%d, %d)", V, C);
        fy_trainer *tr2;
        cr_assert_eq(fy_trainer_new(d, &tc, &tr2), FY_OK);
        cr_assert_eq(fy_trainer_load(tr2, f), FY_OK);
        float *w2 = malloc(fy_model_block(lay, 0)->nelem * sizeof(float));
        fy_trainer_get_params(tr2, 0, w2);
        cr_expect(!memcmp(w, w2, fy_model_block(lay, 0)->nelem * sizeof(float)), "%s: reloaded weights differ",
                  fy_dtype_name(dts[k]));
        fy_weights_close(f);
        unlink(path);
        free(w);
        free(w2);
        fy_trainer_free(tr2);
        fy_trainer_free(tr);
        fy_dev_free(d);
        fy_plan_free(&plan);
    }
    fy_model_free(m);
}
