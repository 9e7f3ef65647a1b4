/* test_family.c — the model interface (engine/model/model.h) is real: a third family,
 * a toy MLP language model written only for the tests (tests/toy_family.h), trains
 * through the same trainer, plans, scheduler and tuner as GPT-2 and Llama, with nothing
 * outside engine/model and tests/ knowing it; and the interface's own contract (a
 * block's passes on device views give the loss's gradient) holds for every family, GPT-2
 * and Llama included. */
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/model/gpt2.h"
#include "engine/model/llama.h"
#include "tests/plan_runs.h"
#include "tests/toy_family.h"
#include "tuner/tune.h"

static const toy_cfg untied = {.vocab = 256, .max_seq = 32, .channels = 24, .hidden = 48,
                               .layers = 4, .tied = false};
static const toy_cfg tied = {.vocab = 256, .max_seq = 32, .channels = 24, .hidden = 48,
                             .layers = 4, .tied = true};

static fy_model *toy(const toy_cfg *c) {
    fy_model *m;
    cr_assert_eq(toy_new(c, &m), FY_OK);
    return m;
}

/* ---- the interface's contract: passes give the loss's gradient ---------------------------
 * Every block's forward, then the head's loss; its gradient by the head's loss pass with
 * dloss = 1/N and every backward in reverse, through fy_block_io views only (the
 * storage's job done by hand here), against central differences of the loss. fp32 on the
 * cpu backend: the loss carries ~1e-7 relative rounding, so with h = 1e-2 the differences
 * are good to ~1e-5 absolute, and curvature adds O(h^2); over 6 coordinates per block the
 * relative error of the gradient is ~1e-3 (bound 2e-2). */

typedef struct views {
    fy_dev *dev;
    fy_stream *s;
    const fy_model *m;
    int B, T, nb;
    float **params, **grads, **host;
    void **out, **saved, *work, *dx;
    int32_t *tok;
    float *loss, *loss_host;
} views;

static void *dalloc(views *v, size_t n) {
    void *p;
    cr_assert_eq(fy_dev_alloc(v->dev, FY_MEM_DEVICE, n ? n : 64, "test", &p), FY_OK);
    return p;
}

static void views_open(views *v, const fy_model *m, int B, int T) {
    memset(v, 0, sizeof *v);
    fy_dev_cfg dc = {.kind = FY_DEV_CPU, .threads = 2};
    cr_assert_eq(fy_dev_new(&dc, &v->dev), FY_OK);
    cr_assert_eq(fy_stream_new(v->dev, "views", &v->s), FY_OK);
    v->m = m;
    v->B = B;
    v->T = T;
    v->nb = fy_model_nblocks(m);
    v->params = calloc((size_t)v->nb, sizeof *v->params);
    v->grads = calloc((size_t)v->nb, sizeof *v->grads);
    v->host = calloc((size_t)v->nb, sizeof *v->host);
    v->out = calloc((size_t)v->nb, sizeof *v->out);
    v->saved = calloc((size_t)v->nb, sizeof *v->saved);
    size_t work = 0, outmax = 0;
    for (int b = 0; b < v->nb; b++) {
        size_t n = fy_model_block(m, b)->nelem;
        v->host[b] = calloc(n, sizeof(float));
        fy_model_init_block(m, b, 5, v->host[b]);
        /* vectors too: gains and biases away from their initial 0 or 1 */
        for (int i = 0; i < fy_model_block(m, b)->ntensors; i++) {
            const fy_tensor_spec *t = &fy_model_block(m, b)->tensors[i];
            if (t->cols == 1)
                for (int r = 0; r < t->rows; r++) v->host[b][t->offset + r] += 0.1f * sinf((float)(r + 3 * b));
        }
        v->params[b] = dalloc(v, n * sizeof(float));
        v->grads[b] = dalloc(v, n * sizeof(float));
        fy_act_sizes a;
        fy_model_acts(m, b, B, T, FY_F32, true, &a);
        v->out[b] = a.out ? dalloc(v, a.out) : NULL;
        v->saved[b] = a.saved ? dalloc(v, a.saved) : NULL;
        if (a.work > work) work = a.work;
        if (a.out > outmax) outmax = a.out;
    }
    v->work = dalloc(v, work);
    v->dx = dalloc(v, outmax);
    const size_t N = (size_t)B * T;
    v->tok = dalloc(v, 2 * N * sizeof(int32_t));
    int32_t *h = malloc(2 * N * sizeof(int32_t));
    uint64_t st = 99;
    for (size_t i = 0; i < 2 * N; i++) h[i] = (int32_t)(toy_mix(&st) % (uint64_t)fy_model_vocab(m));
    fy_copy_async(v->s, v->tok, h, 2 * N * sizeof(int32_t), FY_H2D);
    fy_stream_sync(v->s);
    free(h);
    v->loss = dalloc(v, sizeof(float));
    v->loss_host = malloc(sizeof(float));
}

static void views_close(views *v) {
    for (int b = 0; b < v->nb; b++) free(v->host[b]);
    free(v->params); free(v->grads); free(v->host); free(v->out); free(v->saved);
    free(v->loss_host);
    fy_stream_free(v->s);
    fy_dev_free(v->dev);
}

static fy_block_io io_of(views *v, int b, float dloss) {
    const fy_block_spec *blk = fy_model_block(v->m, b);
    fy_block_io io = {.B = v->B, .T = v->T, .params = v->params[b], .grads = v->grads[b],
                      .in = b ? v->out[b - 1] : NULL, .out = v->out[b], .saved = v->saved[b],
                      .work = v->work, .dx = v->dx, .tokens = v->tok,
                      .targets = v->tok + (size_t)v->B * v->T, .dloss = dloss, .loss = v->loss};
    for (int k = 0; k < blk->nlinks; k++) {
        io.link_params[k] = v->params[blk->links[k]];
        io.link_grads[k] = v->grads[blk->links[k]];
    }
    return io;
}

/* The loss of the host parameters; with grads, the gradients too (into v->grads). */
static double views_run(views *v, bool grads) {
    for (int b = 0; b < v->nb; b++) {
        size_t nbytes = fy_model_block(v->m, b)->nelem * sizeof(float);
        fy_copy_async(v->s, v->params[b], v->host[b], nbytes, FY_H2D);
        if (grads) fy_memset_async(v->s, v->grads[b], 0, nbytes);
    }
    for (int b = 0; b < v->nb - 1; b++) {
        fy_block_io io = io_of(v, b, 0);
        fy_model_forward(v->m, b, &io, v->s);
    }
    fy_block_io head = io_of(v, v->nb - 1, grads ? 1.0f / (float)(v->B * v->T) : 0.0f);
    fy_model_loss(v->m, v->nb - 1, &head, v->s);
    for (int b = v->nb - 2; grads && b >= 0; b--) {
        fy_block_io io = io_of(v, b, 0);
        fy_model_backward(v->m, b, &io, v->s);
    }
    fy_copy_async(v->s, v->loss_host, v->loss, sizeof(float), FY_D2H);
    fy_stream_sync(v->s);
    return *v->loss_host;
}

static void interface_gradients_match_fd(const fy_model *m) {
    views v;
    views_open(&v, m, 2, 8);
    views_run(&v, true);
    uint64_t st = 4242;
    for (int b = 0; b < v.nb; b++) {
        const size_t n = fy_model_block(m, b)->nelem;
        float *g = malloc(n * sizeof(float));
        fy_copy_async(v.s, g, v.grads[b], n * sizeof(float), FY_D2H);
        fy_stream_sync(v.s);
        double dd = 0, gg = 0;
        for (int k = 0; k < 6; k++) {
            /* a coordinate of a tensor's real rows (not padding) */
            const fy_block_spec *blk = fy_model_block(m, b);
            const fy_tensor_spec *t = &blk->tensors[toy_mix(&st) % (uint64_t)blk->ntensors];
            size_t j = t->offset + toy_mix(&st) % ((uint64_t)t->rows * t->cols);
            const float h = 1e-2f, w0 = v.host[b][j];
            v.host[b][j] = w0 + h;
            double lp = views_run(&v, false);
            v.host[b][j] = w0 - h;
            double lm = views_run(&v, false);
            v.host[b][j] = w0;
            double fd = (lp - lm) / (2.0 * h);
            dd += (fd - g[j]) * (fd - g[j]);
            gg += (double)g[j] * g[j];
        }
        double err = sqrt(dd / (gg > 0 ? gg : 1e-30));
        cr_log_info("%s block %d: gradient against finite differences %.2e", fy_model_name(m), b, err);
        cr_expect(err <= 2e-2 || sqrt(dd) < 1e-4, "%s block %s: relative error %.3g",
                  fy_model_name(m), fy_model_block(m, b)->name, err);
        free(g);
    }
    views_close(&v);
}

Test(family, interface_gradients_match_finite_differences, .timeout = 120) {
    fy_model *a = toy(&untied), *b = toy(&tied), *g, *l1, *l2;
    fy_gpt2_config gc = {.vocab = 64, .max_seq = 16, .channels = 16, .layers = 2, .heads = 2};
    cr_assert_eq(fy_gpt2_new(&gc, NULL, &g), FY_OK);
    /* Llama untied with grouped-query heads, head_dim not channels / heads, and llama3
     * rope scaling; and tied, multi-head, plain rope */
    fy_llama_config lc = {.vocab = 64, .max_seq = 16, .channels = 16, .layers = 2, .heads = 4,
                          .kv_heads = 2, .head_dim = 6, .ffn = 24, .norm_eps = 1e-5f,
                          .rope = {.type = FY_ROPE_LLAMA3, .theta = 500000.0f, .factor = 8.0f,
                                   .low_freq_factor = 0.125f, .high_freq_factor = 1.0f,
                                   .orig_max_pos = 8.0f}};
    cr_assert_eq(fy_llama_new(&lc, NULL, &l1), FY_OK);
    lc = (fy_llama_config){.vocab = 64, .max_seq = 16, .channels = 16, .layers = 2, .heads = 2,
                           .kv_heads = 2, .head_dim = 8, .ffn = 40, .norm_eps = 1e-6f,
                           .rope = {.type = FY_ROPE_DEFAULT, .theta = 10000.0f}, .tied = true};
    cr_assert_eq(fy_llama_new(&lc, NULL, &l2), FY_OK);
    interface_gradients_match_fd(a);
    interface_gradients_match_fd(b);
    interface_gradients_match_fd(g);
    interface_gradients_match_fd(l1);
    interface_gradients_match_fd(l2);
    fy_model_free(a);
    fy_model_free(b);
    fy_model_free(g);
    fy_model_free(l1);
    fy_model_free(l2);
}

/* ---- the same trainer, plans and scheduler ---------------------------------------------- */

Test(family, every_plan_is_bit_identical_to_all_resident, .timeout = 300) {
    fy_model *m = toy(&untied);
    every_plan_is_bit_identical(m, FY_F32);
    fy_model_free(m);
}

Test(family, disk_and_offloaded_activations_are_bit_identical, .timeout = 300) {
    fy_model *m = toy(&tied);
    tiered_plans_are_bit_identical(m, FY_BF16);
    fy_model_free(m);
}

Test(family, tied_plans_bit_identical_in_fp32_and_bf16, .timeout = 300) {
    fy_model *m = toy(&tied);
    every_plan_is_bit_identical(m, FY_BF16);
    irregular_plan_is_bit_identical(m, FY_F32);
    result ref;
    accumulated_plans_are_bit_identical(m, FY_F32, &ref);
    result_free(&ref);
    fy_model_free(m);
}

/* A block may link to more than one earlier block (FY_MODEL_MAX_LINKS): the tied toy's
 * head made to link to layer 0 as well (which its loss leaves alone) trains under every
 * accumulated plan, everything streamed included, bit-identical to all-resident: a pass
 * then gives back three fetches and its gradient slot. */
Test(family, a_block_with_two_links_trains_under_every_plan, .timeout = 120) {
    fy_model *m = toy(&tied);
    fy_block_spec *head = &m->blocks[m->nblocks - 1]; /* white box: before any use */
    head->links[head->nlinks++] = 1;
    cr_assert_eq(head->nlinks, FY_MODEL_MAX_LINKS);
    result ref;
    accumulated_plans_are_bit_identical(m, FY_F32, &ref);
    result_free(&ref);
    irregular_plan_is_bit_identical(m, FY_BF16);
    fy_model_free(m);
}

/* It learns (the loss falls well below the uniform log 256 = 5.55), evaluates through the
 * graph to the loss its step reports, saves under its own names and loads back exactly. */
Test(family, trains_evaluates_saves_and_loads, .timeout = 120) {
    fy_model *m = toy(&untied);
    fy_plan plan = plan_of(m, 4, 1, 0.5, 0.5, 2, FY_F32);
    fy_dev_cfg dc = {.kind = FY_DEV_CPU, .threads = 2};
    fy_dev *dev;
    cr_assert_eq(fy_dev_new(&dc, &dev), FY_OK);
    fy_trainer_cfg tc = {.model = m, .T = T_SEQ, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
                         .weight_decay = 0.0f, .clip = 1.0f, .seed = 3, .plan = &plan};
    fy_trainer *tr;
    cr_assert_eq(fy_trainer_new(dev, &tc, &tr), FY_OK);
    fy_tokens *tok = test_corpus();
    fy_loader *ld;
    cr_assert_eq(fy_loader_new(tok, 0, fy_tokens_count(tok), 4, T_SEQ, &ld), FY_OK);
    const size_t N = 4 * T_SEQ;
    int32_t *x = malloc(N * 4), *y = malloc(N * 4);
    float first = 0, last = 0;
    for (int s = 0; s < 60; s++) {
        fy_loader_next(ld, x, y, NULL);
        float eval;
        cr_assert_eq(fy_trainer_eval(tr, x, y, &eval), FY_OK);
        fy_step_stats ss;
        cr_assert_eq(fy_trainer_step(tr, x, y, 3e-3f, &ss), FY_OK);
        cr_expect(eval == ss.loss, "step %d: evaluated %.9g, trained %.9g", s, eval, ss.loss);
        if (s == 0) first = ss.loss;
        last = ss.loss;
    }
    cr_log_info("toy family: loss %.4f -> %.4f over 60 steps", first, last);
    cr_expect(first > 5.0f && last < 3.5f, "the loss should fall: %.4f -> %.4f", first, last);
    char path[] = "/tmp/ferry-test-toy-XXXXXX.safetensors";
    int fd = mkstemps(path, 12);
    cr_assert_geq(fd, 0);
    close(fd);
    cr_assert_eq(fy_trainer_save(tr, path, NULL), FY_OK);
    fy_weights *f;
    cr_assert_eq(fy_weights_open(path, &f), FY_OK);
    cr_expect_not_null(fy_weights_find(f, "mlp.3.down.weight", NULL), "the family's own tensor names");
    fy_trainer *tr2;
    cr_assert_eq(fy_trainer_new(dev, &tc, &tr2), FY_OK);
    cr_assert_eq(fy_trainer_load(tr2, f), FY_OK);
    for (int b = 0; b < fy_model_nblocks(m); b++) {
        size_t n = fy_model_block(m, b)->nelem;
        float *w1 = malloc(n * 4), *w2 = malloc(n * 4);
        fy_trainer_get_params(tr, b, w1);
        fy_trainer_get_params(tr2, b, w2);
        cr_expect(!memcmp(w1, w2, n * 4), "block %d reloaded differently", b);
        free(w1);
        free(w2);
    }
    fy_weights_close(f);
    unlink(path);
    free(x);
    free(y);
    fy_loader_free(ld);
    fy_tokens_free(tok);
    fy_trainer_free(tr2);
    fy_trainer_free(tr);
    fy_dev_free(dev);
    fy_plan_free(&plan);
    fy_model_free(m);
}

/* ---- the tuner ---------------------------------------------------------------------------- */

/* With the analytic costs from the family's FLOPs and bytes, the tuner searches the toy's
 * plans under a budget below its all-resident need: every plan returned fits, the pick's
 * predicted memory is its storage walk's, and the plan trains like all-resident. */
Test(family, the_tuner_plans_it_within_budget, .timeout = 120) {
    fy_model *m = toy(&tied);
    fy_profile p;
    memset(&p, 0, sizeof p);
    p.h2d_gbps = p.d2h_gbps = p.duplex_h2d_gbps = p.duplex_d2h_gbps = 10;
    p.latency_ms = 0.01;
    p.device_mem_gib = 1;
    p.cores = 2;
    p.adam_threads_max = 2;
    p.adam_gparams[1] = 1;
    p.adam_gparams[2] = 2;
    p.compute_tflops = 0.05;
    p.device_mem_gbps = 20;
    fy_plan all = plan_of(m, 2, 1, 0, 0, 0, FY_F32);
    fy_mem_model resident;
    fy_storage_model(m, &all, T_SEQ, &resident);
    fy_tune_cfg c = {.model = m, .batch = 2, .seq = T_SEQ, .adam_threads = 2, .window = 4,
                     .device_budget = resident.device_total * 3 / 4,
                     .tie_margin = FY_TUNE_TIE_MARGIN};
    fy_tune_result top[5];
    int n, ne;
    cr_assert_eq(fy_tune(&p, &c, top, 5, &n, &ne), FY_OK);
    cr_assert(n >= 1 && ne >= 1, "%d plans found of %d evaluated", n, ne);
    for (int i = 0; i < n; i++) cr_expect_leq(top[i].mem.device_total, c.device_budget);
    fy_mem_model mm;
    fy_storage_model(m, &top[0].plan, T_SEQ, &mm);
    cr_expect_eq(top[0].mem.device_total, mm.device_total);
    cr_expect_gt(top[0].step_ms, 0.0);
    result a, b;
    cr_assert_eq(plan_train(m, &all, 0, FY_SCHED_PRIORITY, -1, &a), FY_OK);
    cr_assert_eq(plan_train(m, &top[0].plan, c.device_budget, FY_SCHED_PRIORITY, -1, &b), FY_OK);
    expect_identical(&a, &b, "the tuner's plan");
    cr_expect_leq(b.peak, c.device_budget);
    result_free(&a);
    result_free(&b);
    for (int i = 0; i < n; i++) fy_plan_free(&top[i].plan);
    fy_plan_free(&all);
    fy_model_free(m);
}
