/* test_offload.c — placement plans: files and shorthands, the invariance (every plan
 * gives bit-identical losses and weights to the all-resident plan on the cpu backend),
 * the memory model against the measured device peak, and device budgets. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/core/dtype.h"
#include "engine/io/corpus.h"
#include "engine/model/gpt2.h"
#include "engine/io/tokens.h"
#include "engine/trainer.h"
#include "engine/step_build.h"
#include "offload/plan.h"
#include "offload/storage.h"
#include "tests/plan_runs.h"
#include "tests/test_util.h"

/* A small model with 4 layers, so "half" is 2 layers; byte-level. */
static const fy_gpt2_config small_cfg = {.vocab = 256, .max_seq = 32, .channels = 32,
                                         .layers = 4, .heads = 4};
/* The GPT-2 of a config (the test frees it). */
static fy_model *new_model(const fy_gpt2_config *cfg) {
    fy_model *m;
    cr_assert_eq(fy_gpt2_new(cfg, NULL, &m), FY_OK);
    return m;
}

/* plan_runs.h's routines for a GPT-2 config. */
static fy_status train_mode(const fy_gpt2_config *cfg, const fy_plan *plan, size_t cap,
                            fy_sched_mode mode, int nan_at, result *res) {
    fy_model *m = new_model(cfg);
    fy_status st = plan_train(m, plan, cap, mode, nan_at, res);
    fy_model_free(m);
    return st;
}

static fy_status train(const fy_gpt2_config *cfg, const fy_plan *plan, size_t cap, result *res) {
    return train_mode(cfg, plan, cap, FY_SCHED_PRIORITY, -1, res);
}

static fy_plan make_plan(const fy_gpt2_config *cfg, int B, int accum, double p, double o, int k) {
    fy_model *m = new_model(cfg);
    fy_plan plan = plan_of(m, B, accum, p, o, k, FY_F32);
    fy_model_free(m);
    return plan;
}

/* Runs one of plan_runs.h's invariance routines on small_cfg's model. */
#define ON_SMALL(call) do { fy_model *m = new_model(&small_cfg); call; fy_model_free(m); } while (0)

Test(offload, every_plan_is_bit_identical_to_all_resident, .timeout = 300) {
    ON_SMALL(every_plan_is_bit_identical(m, FY_F32));
}

Test(offload, disk_and_offloaded_activations_are_bit_identical, .timeout = 300) {
    ON_SMALL(tiered_plans_are_bit_identical(m, FY_F32));
    ON_SMALL(tiered_plans_are_bit_identical(m, FY_BF16));
}

/* A vocabulary larger than a layer (2048 x 32 against 12.6K a layer): the embedding
 * streams through a ring of its own, sized for it, the layers' ring is sized for a layer
 * (and gets the prefetch slot), and every plan is still bit-identical to all-resident,
 * with and without accumulation. */
static const fy_gpt2_config wide_vocab_cfg = {.vocab = 2048, .max_seq = 32, .channels = 32,
                                              .layers = 4, .heads = 4};

Test(offload, a_large_embedding_gets_its_own_ring, .timeout = 300) {
    fy_model *m = new_model(&wide_vocab_cfg);
    const size_t embed = fy_model_block(m, 0)->nelem, layer = fy_model_block(m, 1)->nelem;
    cr_assert_gt(embed, layer);
    fy_plan p = plan_of(m, 2, 1, 1, 1, 4, FY_F32);
    fy_layout L, *st = &L;
    cr_assert_eq(fy_layout_new(m, &p, T_SEQ, true, 1, 0, &L), FY_OK);
    cr_expect_eq(L.blocks[0].ring, FY_RING_LARGE);
    cr_expect_eq(L.blocks[1].ring, FY_RING_LAYER);
    cr_expect_eq(L.blocks[p.nblocks - 1].ring, FY_RING_LAYER, "GPT-2's head (ln_f) is small");
    /* the tied head fetches the embedding: one slot, and one for its gradient (opened by
     * the head, closed by the embedding's backward) */
    cr_expect_eq(st->param_ring[FY_RING_LARGE].n, 1);
    cr_expect_eq(st->grad_ring[FY_RING_LARGE].n, 1);
    cr_expect_eq(st->param_ring[FY_RING_LARGE].nbytes, embed * sizeof(float));
    cr_expect_eq(st->param_ring[FY_RING_LAYER].n, 1 + p.prefetch);
    cr_expect_eq(st->param_ring[FY_RING_LAYER].nbytes, layer * sizeof(float));
    cr_expect_eq(st->grad_ring[FY_RING_LAYER].nbytes, layer * sizeof(float));
    fy_layout_free(&L);
    fy_plan_free(&p);
    every_plan_is_bit_identical(m, FY_F32);
    every_plan_is_bit_identical(m, FY_BF16);
    result ref;
    accumulated_plans_are_bit_identical(m, FY_BF16, &ref);
    result_free(&ref);
    fy_model_free(m);
}

/* Pinned memory holds the buffers the device copies (bf16 weights and gradients, tokens),
 * not the AdamW moments or the fp32 masters only the CPU reads; a cap below that moves
 * the buffers past it to pageable memory, and the run is the same bit for bit. The
 * measured pinned peak is the model's either way. */
Test(offload, pinned_memory_holds_only_what_is_copied_and_is_capped, .timeout = 120) {
    fy_model *m = new_model(&wide_vocab_cfg);
    fy_plan p = plan_of(m, 2, 1, 1, 1, 4, FY_BF16);
    fy_mem_model mm;
    fy_storage_model(m, &p, T_SEQ, &mm);
    const size_t P = fy_model_num_params(m);
    /* bf16 weights (the gradients share them) and the small transfer buffers */
    cr_expect(mm.host_pinned >= 2 * P && mm.host_pinned < 2 * P + (P / 4),
              "pinned %zu bytes for %zu parameters", mm.host_pinned, P);
    cr_expect(mm.host_total - mm.host_pinned >= 12 * P, "master, m and v are pageable");
    cr_expect_eq(mm.pinned_over, 0);
    result free_run, capped;
    g_pinned_cap = 0;
    cr_assert_eq(plan_train(m, &p, 0, FY_SCHED_PRIORITY, -1, &free_run), FY_OK);
    cr_expect_eq(free_run.pinned, mm.host_pinned);
    g_pinned_cap = mm.host_pinned / 2;
    cr_assert_eq(plan_train(m, &p, 0, FY_SCHED_PRIORITY, -1, &capped), FY_OK);
    g_pinned_cap = 0;
    expect_identical(&free_run, &capped, "pinned cap");
    cr_expect(capped.pinned <= mm.host_pinned / 2 && capped.pinned > 0, "pinned %zu under a cap of %zu",
              capped.pinned, mm.host_pinned / 2);
    cr_expect_eq(capped.pinned, capped.pinned_model);
    result_free(&free_run);
    result_free(&capped);
    fy_plan_free(&p);
    fy_model_free(m);
}

Test(offload, irregular_plans_are_bit_identical, .timeout = 120) {
    ON_SMALL(irregular_plan_is_bit_identical(m, FY_F32));
}

/* Accumulated plans are invariant, and 2 micro-batches x 2 agree with one batch of 4 to
 * fp32 summation order: the loss is a mean of two halves instead of one mean, gradients
 * are two sums added instead of one sum, so results differ by a few ulps (bound 1e-6
 * relative). */
Test(offload, accumulation_invariance_and_batch_equivalence, .timeout = 120) {
    const fy_gpt2_config *cfg = &small_cfg;
    result ref;
    ON_SMALL(accumulated_plans_are_bit_identical(m, FY_F32, &ref));
    fy_plan big = make_plan(cfg, 4, 1, 0, 0, 0);
    result one;
    cr_assert_eq(train(cfg, &big, 0, &one), FY_OK);
    for (int s = 0; s < STEPS; s++) {
        cr_expect(fabsf(one.loss[s] - ref.loss[s]) <= 1e-6f * one.loss[s],
                  "step %d: batch 4 loss %.9g, 2x2 %.9g", s, one.loss[s], ref.loss[s]);
        cr_expect(fabsf(one.norm[s] - ref.norm[s]) <= 1e-5f * one.norm[s],
                  "step %d: batch 4 norm %.9g, 2x2 %.9g", s, one.norm[s], ref.norm[s]);
    }
    result_free(&one);
    result_free(&ref);
    fy_plan_free(&big);
}

/* Under a budget below the all-resident plan's need, that plan fails with the budget
 * error while the fully offloaded plan trains; the model's full training state
 * (parameters, gradients, two moments) is more than 4x the budget. */
Test(offload, budget_refuses_resident_and_offloaded_plan_trains, .timeout = 120) {
    const fy_gpt2_config cfg = {.vocab = 256, .max_seq = 32, .channels = 128, .layers = 8,
                                .heads = 4};
    fy_model *m = new_model(&cfg);
    fy_plan off = make_plan(&cfg, 2, 1, 1, 1, 8), res = make_plan(&cfg, 2, 1, 0, 0, 0);
    fy_mem_model m_off, m_res;
    fy_storage_model(m, &off, T_SEQ, &m_off);
    fy_storage_model(m, &res, T_SEQ, &m_res);
    size_t budget = m_off.device_total;
    size_t state = 0;
    for (int b = 0; b < fy_model_nblocks(m); b++) state += 4 * fy_model_block(m, b)->nelem * sizeof(float);
    cr_assert(state >= 4 * budget, "full state %zu is not 4x the budget %zu", state, budget);
    cr_assert(m_res.device_total > budget);
    result r;
    fy_status st = train(&cfg, &res, budget, &r);
    cr_expect_eq(st, FY_ERR_DEVICE_OOM);
    cr_expect(strstr(fy_last_error(), "budget") && strstr(fy_last_error(), "short by"),
              "error: %s", fy_last_error());
    cr_assert_eq(train(&cfg, &off, budget, &r), FY_OK);
    cr_expect(r.peak <= budget);
    cr_expect(r.loss[STEPS - 1] < r.loss[0], "loss should fall: %g -> %g", r.loss[0],
              r.loss[STEPS - 1]);
    result_free(&r);
    fy_plan_free(&off);
    fy_plan_free(&res);
    fy_model_free(m);
}

/* A GPT-2 of L layers, for plan files and shorthands. */
static fy_model *model_with_layers(int L) {
    fy_gpt2_config cfg = {.vocab = 256, .max_seq = 32, .channels = 32, .layers = L, .heads = 4};
    return new_model(&cfg);
}

Test(plan, shorthands_follow_autohete) {
    fy_plan p;
    fy_model *m = model_with_layers(12);
    cr_assert_eq(fy_plan_new(m, 8, 1, &p), FY_OK);
    fy_model_free(m);
    cr_assert_eq(fy_plan_shorthands(&p, 0.25, 0.5, 3), FY_OK);
    for (int l = 0; l < 12; l++) {
        cr_expect_eq(p.blocks[1 + l].weights, l < 3 ? FY_ON_HOST : FY_ON_DEVICE, "l %d", l);
        cr_expect_eq(p.blocks[1 + l].update, l >= 6 ? FY_UPDATE_CPU : FY_UPDATE_DEVICE, "l %d", l);
        cr_expect_eq(p.blocks[1 + l].acts, l < 3 ? FY_ACTS_RECOMPUTE : FY_ACTS_KEEP, "l %d", l);
    }
    cr_expect_eq(p.blocks[0].weights, FY_ON_DEVICE);
    cr_expect_eq(p.blocks[13].update, FY_UPDATE_DEVICE);
    cr_assert_eq(fy_plan_shorthands(&p, 0.1, 1.0, 0), FY_OK); /* ceil(1.2) = 2 layers */
    cr_expect_eq(p.blocks[2].weights, FY_ON_HOST);
    cr_expect_eq(p.blocks[3].weights, FY_ON_DEVICE);
    cr_expect_eq(p.blocks[0].update, FY_UPDATE_CPU, "ratio 1 moves the embedding too");
    cr_expect_eq(p.blocks[13].update, FY_UPDATE_CPU, "ratio 1 moves the head too");
    cr_expect_eq(fy_plan_shorthands(&p, 1.5, 0, 0), FY_ERR_INVALID);
    cr_expect_eq(fy_plan_shorthands(&p, 0, 0, 13), FY_ERR_INVALID);
    fy_plan_free(&p);
}

static char *tmpfile_with(const char *text) {
    static char path[64];
    snprintf(path, sizeof path, "/tmp/ferry_plan_XXXXXX");
    int fd = mkstemp(path);
    cr_assert(fd >= 0);
    cr_assert(write(fd, text, strlen(text)) == (ssize_t)strlen(text));
    close(fd);
    return path;
}

Test(plan, json_round_trip) {
    fy_plan p, q;
    fy_model *m4 = model_with_layers(4), *m5 = model_with_layers(5);
    cr_assert_eq(fy_plan_new(m4, 3, 2, &p), FY_OK);
    cr_assert_eq(fy_plan_shorthands(&p, 0.5, 1, 1), FY_OK);
    p.blocks[3].acts = FY_ACTS_RECOMPUTE;
    p.dtype = FY_BF16;
    char *path = tmpfile_with("");
    cr_assert_eq(fy_plan_save(path, &p), FY_OK);
    cr_assert_eq(fy_plan_load(path, m4, &q), FY_OK);
    cr_expect(fy_plan_equal(&p, &q));
    cr_expect_eq(q.dtype, FY_BF16);
    fy_plan_free(&q);
    cr_expect_eq(fy_plan_load(path, m5, &q), FY_ERR_FORMAT, "a plan for 4 layers on 5");
    unlink(path);
    fy_plan_free(&p);
    fy_plan_free(&q);
    fy_model_free(m4);
    fy_model_free(m5);
}

/* A version 1 file (params, optim) loads as it always did and means what its version 2
 * equivalent (weights, update, and the states that follow) means; version 2 may leave
 * master, grad and moments out; a saved plan is version 2 and says every state's place. */
Test(plan, version_1_files_mean_what_they_meant) {
    fy_model *m1 = model_with_layers(1);
    const char *v1 =
        "{\"format\":\"ferry-plan\",\"version\":1,\"layers\":1,\"micro_batch\":2,\"grad_accum\":1,\"blocks\":["
        "{\"block\":\"embed\",\"params\":\"streamed\",\"optim\":\"gpu\",\"acts\":\"keep\"},"
        "{\"block\":\"layer.0\",\"params\":\"resident\",\"optim\":\"cpu\",\"acts\":\"recompute\"},"
        "{\"block\":\"head\",\"params\":\"resident\",\"optim\":\"gpu\",\"acts\":\"keep\"}]}";
    const char *v2 =
        "{\"format\":\"ferry-plan\",\"version\":2,\"layers\":1,\"micro_batch\":2,\"grad_accum\":1,\"blocks\":["
        "{\"block\":\"embed\",\"weights\":\"host\",\"update\":\"gpu\",\"master\":\"host\",\"grad\":\"device\","
        "\"moments\":\"device\",\"acts\":\"keep\"},"
        "{\"block\":\"layer.0\",\"weights\":\"device\",\"update\":\"cpu\",\"acts\":\"recompute\"},"
        "{\"block\":\"head\",\"weights\":\"device\",\"update\":\"gpu\",\"master\":\"device\",\"acts\":\"keep\"}]}";
    fy_plan a, b, c;
    char *pa = tmpfile_with(v1), *pb = tmpfile_with(v2);
    cr_assert_eq(fy_plan_load(pa, m1, &a), FY_OK);
    cr_assert_eq(fy_plan_load(pb, m1, &b), FY_OK);
    cr_expect(fy_plan_equal(&a, &b));
    cr_expect_eq(a.blocks[0].weights, FY_ON_HOST);
    cr_expect_eq(a.blocks[1].update, FY_UPDATE_CPU);
    cr_expect_eq(fy_plan_where(&a.blocks[0], FY_PLAN_MASTER), FY_ON_HOST,
                 "a streamed block updated on the device keeps its master on the host");
    cr_expect_eq(fy_plan_where(&a.blocks[0], FY_PLAN_MOMENTS), FY_ON_DEVICE);
    cr_expect_eq(fy_plan_where(&a.blocks[1], FY_PLAN_GRAD), FY_ON_HOST);
    cr_assert_eq(fy_plan_save(pa, &a), FY_OK);
    cr_assert_eq(fy_plan_load(pa, m1, &c), FY_OK);
    cr_expect(fy_plan_equal(&a, &c));
    FILE *f = fopen(pa, "r");
    char text[4096] = {0};
    cr_assert(f && fread(text, 1, sizeof text - 1, f) > 0);
    fclose(f);
    cr_expect(strstr(text, "\"version\":\t2") && strstr(text, "\"moments\":\t\"host\""), "%s", text);
    unlink(pa);
    unlink(pb);
    fy_plan_free(&a);
    fy_plan_free(&b);
    fy_plan_free(&c);
    fy_model_free(m1);
}

Test(plan, bad_files_are_refused) {
    const char *bad[] = {
        "not json",
        "{\"format\":\"other\",\"layers\":1,\"micro_batch\":1,\"grad_accum\":1,\"blocks\":[]}",
        "{\"format\":\"ferry-plan\",\"layers\":1,\"micro_batch\":0,\"grad_accum\":1,\"blocks\":[]}",
        "{\"format\":\"ferry-plan\",\"layers\":1,\"micro_batch\":1,\"grad_accum\":1,\"dtype\":\"fp16\","
        "\"blocks\":[{\"block\":\"embed\",\"params\":\"resident\",\"optim\":\"gpu\",\"acts\":\"keep\"},"
        "{\"block\":\"layer.0\",\"params\":\"resident\",\"optim\":\"gpu\",\"acts\":\"keep\"},"
        "{\"block\":\"head\",\"params\":\"resident\",\"optim\":\"gpu\",\"acts\":\"keep\"}]}",
        "{\"format\":\"ferry-plan\",\"layers\":1,\"micro_batch\":1,\"grad_accum\":1,\"blocks\":[]}",
        "{\"format\":\"ferry-plan\",\"layers\":1,\"micro_batch\":1,\"grad_accum\":1,\"blocks\":["
        "{\"block\":\"embed\",\"params\":\"resident\",\"optim\":\"gpu\",\"acts\":\"keep\"},"
        "{\"block\":\"layer.0\",\"params\":\"floating\",\"optim\":\"gpu\",\"acts\":\"keep\"},"
        "{\"block\":\"head\",\"params\":\"resident\",\"optim\":\"gpu\",\"acts\":\"keep\"}]}",
        "{\"format\":\"ferry-plan\",\"layers\":1,\"micro_batch\":1,\"grad_accum\":1,\"blocks\":["
        "{\"block\":\"embed\",\"params\":\"resident\",\"optim\":\"gpu\",\"acts\":\"recompute\"},"
        "{\"block\":\"layer.0\",\"params\":\"resident\",\"optim\":\"gpu\",\"acts\":\"keep\"},"
        "{\"block\":\"head\",\"params\":\"resident\",\"optim\":\"gpu\",\"acts\":\"keep\"}]}",
        "{\"format\":\"ferry-plan\",\"layers\":1,\"micro_batch\":1,\"grad_accum\":1,\"blocks\":["
        "{\"block\":\"head\",\"params\":\"resident\",\"optim\":\"gpu\",\"acts\":\"keep\"},"
        "{\"block\":\"layer.0\",\"params\":\"resident\",\"optim\":\"gpu\",\"acts\":\"keep\"},"
        "{\"block\":\"embed\",\"params\":\"resident\",\"optim\":\"gpu\",\"acts\":\"keep\"}]}",
        /* version 2: a state where ferry does not keep it, version 1's keys, an unknown
         * version */
        "{\"format\":\"ferry-plan\",\"version\":2,\"layers\":1,\"micro_batch\":1,\"grad_accum\":1,\"blocks\":["
        "{\"block\":\"embed\",\"weights\":\"device\",\"update\":\"gpu\",\"acts\":\"keep\"},"
        "{\"block\":\"layer.0\",\"weights\":\"device\",\"update\":\"cpu\",\"moments\":\"device\",\"acts\":\"keep\"},"
        "{\"block\":\"head\",\"weights\":\"device\",\"update\":\"gpu\",\"acts\":\"keep\"}]}",
        "{\"format\":\"ferry-plan\",\"version\":2,\"layers\":1,\"micro_batch\":1,\"grad_accum\":1,\"blocks\":["
        "{\"block\":\"embed\",\"params\":\"resident\",\"optim\":\"gpu\",\"acts\":\"keep\"},"
        "{\"block\":\"layer.0\",\"params\":\"resident\",\"optim\":\"gpu\",\"acts\":\"keep\"},"
        "{\"block\":\"head\",\"params\":\"resident\",\"optim\":\"gpu\",\"acts\":\"keep\"}]}",
        "{\"format\":\"ferry-plan\",\"version\":3,\"layers\":1,\"micro_batch\":1,\"grad_accum\":1,\"blocks\":["
        "{\"block\":\"embed\",\"weights\":\"device\",\"update\":\"gpu\",\"acts\":\"keep\"},"
        "{\"block\":\"layer.0\",\"weights\":\"device\",\"update\":\"gpu\",\"acts\":\"keep\"},"
        "{\"block\":\"head\",\"weights\":\"device\",\"update\":\"gpu\",\"acts\":\"keep\"}]}",
    };

    fy_model *m1 = model_with_layers(1);
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        fy_plan p;
        char *path = tmpfile_with(bad[i]);
        cr_expect_eq(fy_plan_load(path, m1, &p), FY_ERR_FORMAT, "case %zu accepted", i);
        cr_expect(strstr(fy_last_error(), path) != NULL, "case %zu: error names no file: %s", i,
                  fy_last_error());
        unlink(path);
    }
    fy_plan p;
    cr_expect_eq(fy_plan_load("/nonexistent/plan.json", m1, &p), FY_ERR_IO);
    fy_model_free(m1);
}

/* Every schedule mode runs the same arithmetic: serial, fifo and priority give
 * bit-identical results for offloaded plans, with and without accumulation. */
Test(offload, every_schedule_mode_is_bit_identical, .timeout = 120) {
    const fy_gpt2_config *cfg = &small_cfg;
    fy_plan base = make_plan(cfg, 2, 1, 0, 0, 0);
    result ref;
    cr_assert_eq(train_mode(cfg, &base, 0, FY_SCHED_SERIAL, -1, &ref), FY_OK);
    const double plans[][4] = {{1, 1, 4, 1}, {0.5, 0.5, 2, 1}, {1, 0, 0, 1}, {0, 1, 0, 1}};
    const fy_sched_mode modes[] = {FY_SCHED_SERIAL, FY_SCHED_FIFO, FY_SCHED_PRIORITY};
    for (int i = 0; i < 4; i++)
        for (int m = 0; m < 3; m++) {
            fy_plan p = make_plan(cfg, 2, 1, plans[i][0], plans[i][1], (int)plans[i][2]);
            p.prefetch = m; /* deeper rings change the overlap, never the numbers */
            result r;
            char what[96];
            snprintf(what, sizeof what, "plan %d under %s, prefetch %d", i,
                     fy_sched_mode_name(modes[m]), m);
            cr_assert_eq(train_mode(cfg, &p, 0, modes[m], -1, &r), FY_OK, "%s", what);
            expect_identical(&ref, &r, what);
            result_free(&r);
            fy_plan_free(&p);
        }
    fy_plan acc = make_plan(cfg, 2, 2, 1, 1, 2), acc0 = make_plan(cfg, 2, 2, 0, 0, 0);
    result ra, rb;
    cr_assert_eq(train_mode(cfg, &acc0, 0, FY_SCHED_SERIAL, -1, &ra), FY_OK);
    cr_assert_eq(train_mode(cfg, &acc, 0, FY_SCHED_FIFO, -1, &rb), FY_OK);
    expect_identical(&ra, &rb, "accumulated, fifo");
    result_free(&ra);
    result_free(&rb);
    fy_plan_free(&acc);
    fy_plan_free(&acc0);
    result_free(&ref);
    fy_plan_free(&base);
}

/* ---- bf16 storage ---------------------------------------------------------------------
 * The cpu backend runs the GPU's bf16 data path (bf16 parameters, gradients and
 * activations on the device; fp32 masters and moments wherever the optimizer runs), so
 * its invariance is checked here too: every plan is bit-identical to the bf16
 * all-resident plan and its memory model exact. */

static fy_plan make_plan_bf16(const fy_gpt2_config *cfg, int B, int accum, double p, double o, int k) {
    fy_plan plan = make_plan(cfg, B, accum, p, o, k);
    plan.dtype = FY_BF16;
    return plan;
}

Test(bf16, every_plan_is_bit_identical_to_all_resident, .timeout = 300) {
    ON_SMALL(every_plan_is_bit_identical(m, FY_BF16));
}

Test(bf16, irregular_plans_are_bit_identical, .timeout = 120) {
    ON_SMALL(irregular_plan_is_bit_identical(m, FY_BF16));
}

/* Accumulation: the host adds cpu-optimised blocks' micro-batch gradients as the device
 * does (fp32 sums rounded to bf16). */
Test(bf16, accumulated_plans_are_bit_identical, .timeout = 120) {
    result ref;
    ON_SMALL(accumulated_plans_are_bit_identical(m, FY_BF16, &ref));
    result_free(&ref);
}

/* bf16 storage trains the same model: bf16 keeps 8 bits of mantissa, so activations and
 * gradients carry ~2e-3 relative rounding. Over 5 steps of this 4-layer model (lr 1e-2)
 * the losses stay within 5e-3 relative of fp32's (measured <= 4.5e-4) and the gradient
 * norms within 2e-2 (measured <= 3.2e-3). Weights: Adam turns a gradient's rounding into
 * a whole lr-sized step wherever the gradient is near zero (m/sqrt(v) flips), so after 5
 * steps of 1e-2 on weights of ~0.02 blocks differ by 1.3-2.9e-2 relative-norm; the bound
 * 0.1 still catches a lost or doubled update (a difference the size of the updates
 * themselves, ~0.5). And the device holds less: parameters, gradients and activations
 * take half the bytes. */
Test(bf16, trains_like_fp32_in_less_device_memory, .timeout = 120) {
    const fy_gpt2_config *cfg = &small_cfg;
    fy_plan p32 = make_plan(cfg, 2, 1, 0, 0, 0), p16 = make_plan_bf16(cfg, 2, 1, 0, 0, 0);
    result a, b;
    cr_assert_eq(train(cfg, &p32, 0, &a), FY_OK);
    cr_assert_eq(train(cfg, &p16, 0, &b), FY_OK);
    for (int s = 0; s < STEPS; s++) {
        cr_expect(fabsf(a.loss[s] - b.loss[s]) <= 5e-3f * a.loss[s], "step %d loss fp32 %.6g bf16 %.6g",
                  s, a.loss[s], b.loss[s]);
        cr_log_info("step %d: loss fp32 %.6g bf16 %.6g (%.2g), norm %.6g vs %.6g (%.2g)", s,
                    a.loss[s], b.loss[s], fabsf(a.loss[s] - b.loss[s]) / a.loss[s], a.norm[s],
                    b.norm[s], fabsf(a.norm[s] - b.norm[s]) / a.norm[s]);
        cr_expect(fabsf(a.norm[s] - b.norm[s]) <= 2e-2f * a.norm[s], "step %d norm fp32 %.6g bf16 %.6g",
                  s, a.norm[s], b.norm[s]);
    }
    for (int bl = 0; bl < a.nblocks; bl++) {
        double d = 0, w = 0;
        for (size_t i = 0; i < a.nelem[bl]; i++) {
            d += ((double)a.w[bl][i] - b.w[bl][i]) * ((double)a.w[bl][i] - b.w[bl][i]);
            w += (double)a.w[bl][i] * a.w[bl][i];
        }
        cr_expect(sqrt(d) <= 0.1 * sqrt(w), "block %d weights differ by %.3g relative", bl,
                  sqrt(d / w));
    }
    cr_expect(b.peak < a.peak, "bf16 device peak %zu, fp32 %zu", b.peak, a.peak);
    result_free(&a);
    result_free(&b);
    fy_plan_free(&p32);
    fy_plan_free(&p16);
}

/* ---- a skipped step under offload -----------------------------------------------------
 * A non-finite gradient norm skips the update everywhere; nothing may change then, on any
 * copy of any block. A NaN planted in one weight (the head's ln_f gain, every copy of it:
 * fp32 masters and the storage type's copies) for one step makes that step skip; with the
 * weight restored, the following steps must continue exactly as the all-resident plan's
 * do. (With bf16 storage a streamed block's skipped device update once sent stale slot
 * bytes back as its bf16 copy, and the run never recovered.) */

enum { SKIP_AT = 2 }; /* the step a planted NaN makes skip; two steps follow it */

static void skipped_step_leaves_every_plan_on_track(fy_dtype dt) {
    const fy_gpt2_config *cfg = &small_cfg;
    fy_plan base = make_plan(cfg, 2, 1, 0, 0, 0);
    base.dtype = dt;
    result ref;
    cr_assert_eq(train_mode(cfg, &base, 0, FY_SCHED_PRIORITY, SKIP_AT, &ref), FY_OK);
    for (int s = 0; s < STEPS; s++)
        cr_assert_eq(ref.skipped[s], s == SKIP_AT, "step %d skipped: %d", s, ref.skipped[s]);
    cr_assert(isfinite(ref.loss[STEPS - 1]), "all-resident recovers after the skip");
    const double plans[][3] = {{1, 0, 0}, {1, 1, 0}, {0, 1, 0}, {0.5, 0.5, 2}};
    for (int i = 0; i < 4; i++) {
        fy_plan p = make_plan(cfg, 2, 1, plans[i][0], plans[i][1], (int)plans[i][2]);
        p.dtype = dt;
        result r;
        cr_assert_eq(train_mode(cfg, &p, 0, FY_SCHED_PRIORITY, SKIP_AT, &r), FY_OK);
        for (int s = 0; s < STEPS; s++)
            cr_expect(r.skipped[s] == ref.skipped[s] && (s == SKIP_AT || r.loss[s] == ref.loss[s]),
                      "%s, plan %d: step %d loss %.9g (skipped %d), all-resident %.9g",
                      fy_dtype_name(dt), i, s, r.loss[s], r.skipped[s], ref.loss[s]);
        for (int b = 0; b < ref.nblocks; b++)
            cr_expect(!memcmp(r.w[b], ref.w[b], ref.nelem[b] * sizeof(float)),
                      "%s, plan %d: block %d weights differ", fy_dtype_name(dt), i, b);
        result_free(&r);
        fy_plan_free(&p);
    }
    result_free(&ref);
    fy_plan_free(&base);
}

Test(offload, skipped_step_leaves_every_plan_on_track, .timeout = 120) {
    skipped_step_leaves_every_plan_on_track(FY_F32);
}

Test(bf16, skipped_step_leaves_every_plan_on_track, .timeout = 120) {
    skipped_step_leaves_every_plan_on_track(FY_BF16);
}

/* ---- speculative updates ----------------------------------------------------------------
 * A speculative block's CPU update runs before the step's norm is known, into its spare
 * side, and its commit keeps it, redoes it (the step clips) or undoes it (skipped): the
 * results are the non-speculative plan's bit for bit whether clipping never fires (kept),
 * fires late (speculated, then redone), or fires early (known before any speculation:
 * none), and when the norm is not finite after the speculation (undone). Each case is
 * checked to have taken its path, so the test cannot pass by never speculating. */
typedef enum { NEVER, LATE, EARLY, NAN_NORM } clip_case;
static const char *clip_case_names[] = {"never clips", "clips late", "clips early", "NaN norm"};

static void speculation_is_exact(fy_dtype dt, int accum) {
    fy_model *m = new_model(&small_cfg);
    /* without clipping (the never case's reference), for the norms that place the late
     * case's threshold below every step's */
    g_clip = 0.0f;
    fy_plan plain = plan_of(m, 2, accum, 0.5, 1, 1, dt);
    result free_run;
    cr_assert_eq(plan_train(m, &plain, 0, FY_SCHED_PRIORITY, -1, &free_run), FY_OK);
    float min_norm = free_run.norm[0];
    for (int s = 1; s < STEPS; s++) if (free_run.norm[s] < min_norm) min_norm = free_run.norm[s];
    for (int c = NEVER; c <= NAN_NORM; c++) {
        g_clip = c == NEVER ? 0.0f : c == LATE ? 0.9f * min_norm : c == EARLY ? 1e-6f : 1e6f;
        g_nan_norm_step = c == NAN_NORM ? 3 : 0;
        result ref;
        if (c == NEVER) ref = free_run;
        else cr_assert_eq(plan_train(m, &plain, 0, FY_SCHED_PRIORITY, -1, &ref), FY_OK);
        /* every cpu update speculative; and (never) the upper half only, beside
         * non-speculative ones */
        for (int variant = 0; variant < (c == NEVER ? 2 : 1); variant++) {
            fy_plan spec = plan_of(m, 2, accum, 0.5, 1, 1, dt);
            cr_assert_eq(fy_plan_speculate(&spec, variant ? 0.5 : 1.0), FY_OK);
            result r;
            char what[128];
            snprintf(what, sizeof what, "%s accum %d, %s, speculate %s", fy_dtype_name(dt), accum,
                     clip_case_names[c], variant ? "half the layers" : "all");
            cr_assert_eq(plan_train(m, &spec, 0, FY_SCHED_PRIORITY, -1, &r), FY_OK, "%s", what);
            expect_identical(&ref, &r, what);
            int speculated = 0, kept = 0, redone_clipped = 0;
            for (int s = 0; s < STEPS; s++) {
                cr_expect_eq(ref.speculated[s], 0, "%s: the plain plan speculated", what);
                cr_expect(r.kept[s] <= r.speculated[s]);
                speculated += r.speculated[s];
                kept += r.kept[s];
                redone_clipped += r.speculated[s] > r.kept[s] && !r.skipped[s] && r.clip_coef[s] < 1.0f;
            }
            switch (c) {
            case NEVER:
                cr_expect(speculated > 0 && kept == speculated, "%s: %d speculated, %d kept", what,
                          speculated, kept);
                break;
            case LATE:
                cr_expect(redone_clipped > 0, "%s: no step speculated and then clipped (%d "
                          "speculated, %d kept)", what, speculated, kept);
                break;
            case EARLY:
                cr_expect_eq(speculated, 0, "%s: speculated though the first gradient clips", what);
                break;
            case NAN_NORM:
                cr_expect(r.skipped[2] && r.speculated[2] > 0 && r.kept[2] == 0,
                          "%s: step 3 skipped %d, %d speculated, %d kept", what, r.skipped[2],
                          r.speculated[2], r.kept[2]);
                cr_expect(isfinite(r.loss[STEPS - 1]));
                break;
            }
            result_free(&r);
            fy_plan_free(&spec);
        }
        if (c != NEVER) result_free(&ref);
    }
    result_free(&free_run);
    g_clip = 1.0f;
    g_nan_norm_step = 0;
    fy_plan_free(&plain);
    fy_model_free(m);
}

Test(speculate, exact_in_fp32, .timeout = 240) { speculation_is_exact(FY_F32, 1); }

Test(speculate, exact_in_bf16_accumulated, .timeout = 240) { speculation_is_exact(FY_BF16, 2); }

/* The spare side is in the memory model (12 bytes a parameter of the speculative blocks,
 * 2 more with bf16 storage and one micro-batch, whose gradient then leaves the host
 * weights' buffer), and the layout refuses speculation in a job. */
Test(speculate, costs_its_spare_side_and_needs_one_process) {
    fy_model *m = new_model(&small_cfg);
    for (int v = 0; v < 2; v++) {
        const fy_dtype dt = v ? FY_BF16 : FY_F32;
        fy_plan p = plan_of(m, 2, 1, 0.5, 1, 0, dt), q = plan_of(m, 2, 1, 0.5, 1, 0, dt);
        cr_assert_eq(fy_plan_speculate(&q, 1.0), FY_OK);
        fy_mem_model a, b;
        fy_storage_model(m, &p, T_SEQ, &a);
        fy_storage_model(m, &q, T_SEQ, &b);
        const size_t P = fy_model_num_params(m), extra = 12 * P + (v ? 2 * P : 0);
        cr_expect(b.host_total >= a.host_total + extra && b.host_total < a.host_total + extra + 64 * 1024,
                  "%s: host %zu, without speculation %zu, expected %zu more", fy_dtype_name(dt),
                  b.host_total, a.host_total, extra);
        cr_expect_eq(b.device_total, a.device_total);
        fy_layout L;
        fy_log_set_level(FY_LOG_QUIET);
        cr_expect_eq(fy_layout_new(m, &q, T_SEQ, true, 2, 0, &L), FY_ERR_INVALID);
        fy_log_set_level(FY_LOG_INFO);
        cr_assert_eq(fy_layout_new(m, &q, T_SEQ, true, 1, 0, &L), FY_OK);
        for (int bl = 0; bl < L.nblocks; bl++)
            cr_expect(!fy_layout_grad_in_weights(&L, bl), "block %d: a speculative gradient is apart", bl);
        fy_layout_free(&L);
        fy_plan_free(&p);
        fy_plan_free(&q);
    }
    fy_model_free(m);
}

/* ---- failures ----------------------------------------------------------------------------
 * A task that fails stops its step and the later ones of the window; the steps before it
 * finish. A failure before a step's update leaves the trainer exactly where those steps
 * left it: running the rest of the window again gives the bits of a run that never
 * failed. A failure inside an update (some blocks updated, others not) leaves it broken:
 * it refuses to go on, and can be freed. Either way: one error line, naming the task. */

typedef struct failing_run {
    fy_dev *dev;
    fy_model *model;
    fy_trainer *tr;
    fy_tokens *tok;
    fy_loader *ld;
} failing_run;

static fy_status batch_at(void *ctx, int64_t micro, int32_t *x, int32_t *y, int32_t *docs) {
    FY_TRY(fy_loader_seek_batch(ctx, micro));
    fy_loader_next(ctx, x, y, docs);
    return FY_OK;
}

static void failing_open(failing_run *f, const fy_plan *plan) {
    fy_dev_cfg dc = {.kind = FY_DEV_CPU, .threads = 2};
    cr_assert_eq(fy_dev_new(&dc, &f->dev), FY_OK);
    f->model = new_model(&small_cfg);
    fy_trainer_cfg tc = {.model = f->model, .T = T_SEQ, .beta1 = 0.9f, .beta2 = 0.95f,
                         .eps = 1e-8f, .weight_decay = 0.1f, .clip = g_clip, .seed = 11,
                         .plan = plan, .test_speculate_first = true};
    cr_assert_eq(fy_trainer_new(f->dev, &tc, &f->tr), FY_OK);
    f->tok = test_corpus();
    cr_assert_eq(fy_loader_new(f->tok, 0, fy_tokens_count(f->tok), plan->micro_batch, T_SEQ,
                               &f->ld), FY_OK);
}

static void failing_close(failing_run *f) {
    fy_loader_free(f->ld);
    fy_tokens_free(f->tok);
    fy_trainer_free(f->tr);
    fy_model_free(f->model);
    fy_dev_free(f->dev);
}

/* Steps [first, first + n) of the run's learning rates (0.01 falling by 1e-3 a step). */
static fy_status failing_window(failing_run *f, int first, int n, fy_step_stats *stats,
                                int *completed) {
    float lrs[STEPS];
    for (int i = 0; i < n; i++) lrs[i] = 1e-2f - 1e-3f * (float)(first + i);
    fy_window w = {.nsteps = n, .lrs = lrs, .next_batch = batch_at, .batch_ctx = f->ld,
                   .stats = stats};
    fy_status st = fy_trainer_run(f->tr, &w);
    *completed = w.completed;
    return st;
}

/* The window with stderr captured: the status, and the error lines in err. */
static fy_status failing_window_captured(failing_run *f, int first, int n, fy_step_stats *stats,
                                         int *completed, char *err, size_t cap) {
    char path[] = "/tmp/ferry-test-stderr-XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    fflush(stderr);
    int saved = dup(2);
    dup2(fd, 2);
    fy_status st = failing_window(f, first, n, stats, completed);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    lseek(fd, 0, SEEK_SET);
    ssize_t len = read(fd, err, cap - 1);
    err[len > 0 ? len : 0] = 0;
    close(fd);
    unlink(path);
    return st;
}

static int count_lines(const char *text, const char *prefix) {
    int n = 0;
    for (const char *l = text; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL)
        n += !strncmp(l, prefix, strlen(prefix));
    return n;
}

typedef struct injection {
    const char *what;
    double params, optim;  /* the plan's shorthands */
    fy_task_kind kind;
    int block;             /* -1: any */
    bool breaks;           /* inside an update: the trainer cannot go on */
    bool bf16;             /* bf16 storage (cpu-optimised blocks' gradients then land in
                              their bf16 weights' buffer: layout.h, GRAD the same as HOST_WEIGHTS) */
    double speculate;      /* fy_plan_speculate's ratio (0: none) */
} injection;

enum { FAIL_AT = 2 }; /* the step whose task fails */

/* The uninterrupted run of plan: losses and weights after STEPS steps in one window. */
static void unbroken_run(const fy_plan *plan, float *loss, float **w) {
    failing_run f;
    failing_open(&f, plan);
    fy_step_stats stats[STEPS];
    int done;
    cr_assert_eq(failing_window(&f, 0, STEPS, stats, &done), FY_OK);
    cr_assert_eq(done, STEPS);
    for (int s = 0; s < STEPS; s++) loss[s] = stats[s].loss;
    for (int b = 0; b < fy_model_nblocks(f.model); b++) fy_trainer_get_params(f.tr, b, w[b]);
    failing_close(&f);
}

static void check_injection(const injection *in) {
    fy_plan plan = make_plan(&small_cfg, 2, 1, in->params, in->optim, 0);
    if (in->bf16) plan.dtype = FY_BF16;
    cr_assert_eq(fy_plan_speculate(&plan, in->speculate), FY_OK);
    fy_model *m = new_model(&small_cfg);
    const int nb = fy_model_nblocks(m);
    float want_loss[STEPS], **want_w = calloc((size_t)nb, sizeof *want_w);
    float **got_w = calloc((size_t)nb, sizeof *got_w);
    for (int b = 0; b < nb; b++) {
        want_w[b] = malloc(fy_model_block(m, b)->nelem * sizeof(float));
        got_w[b] = malloc(fy_model_block(m, b)->nelem * sizeof(float));
    }
    unbroken_run(&plan, want_loss, want_w);

    failing_run f;
    failing_open(&f, &plan);
    fy_trainer_inject_failure(f.tr, in->kind, in->block, FAIL_AT, FY_ERR_IO);
    fy_step_stats stats[STEPS];
    int done = -1;
    char err[8192];
    fy_status st = failing_window_captured(&f, 0, STEPS, stats, &done, err, sizeof err);
    cr_expect_eq(st, FY_ERR_IO, "%s: status %s", in->what, fy_status_str(st));
    cr_expect_eq(done, FAIL_AT, "%s: %d steps completed, expected %d", in->what, done, FAIL_AT);
    cr_expect_eq(count_lines(err, "ferry: error:"), 1, "%s: one error line expected:\n%s",
                 in->what, err);
    char name[64];
    snprintf(name, sizeof name, "ferry: error: %s(", fy_task_kind_name(in->kind));
    cr_expect(strstr(err, name) && strstr(err, "injected failure"),
              "%s: the error line should name the task:\n%s", in->what, err);
    for (int s = 0; s < done; s++)
        cr_expect(stats[s].loss == want_loss[s], "%s: step %d before the failure: loss %.9g vs %.9g",
                  in->what, s, stats[s].loss, want_loss[s]);
    cr_expect(!in->speculate || stats[done - 1].kept > 0, "%s: nothing speculated", in->what);
    if (in->breaks) {
        cr_expect(strstr(err, "ferry: warning:") != NULL, "%s: a broken trainer says so", in->what);
        st = failing_window_captured(&f, done, STEPS - done, stats, &done, err, sizeof err);
        cr_expect_eq(st, FY_ERR_INVALID, "%s: a broken trainer must refuse to go on", in->what);
        cr_expect_eq(count_lines(err, "ferry: error:"), 1, "%s: one error line:\n%s", in->what, err);
    } else {
        /* the rest of the window again: the bits of the run that never failed */
        cr_assert_eq(failing_window(&f, done, STEPS - done, stats + done, &done), FY_OK, "%s",
                     in->what);
        cr_expect_eq(fy_trainer_micro_done(f.tr), (int64_t)STEPS);
        for (int s = FAIL_AT; s < STEPS; s++)
            cr_expect(stats[s].loss == want_loss[s], "%s: step %d after the retry: loss %.9g vs %.9g",
                      in->what, s, stats[s].loss, want_loss[s]);
        for (int b = 0; b < nb; b++) {
            fy_trainer_get_params(f.tr, b, got_w[b]);
            cr_expect(!memcmp(got_w[b], want_w[b], fy_model_block(m, b)->nelem * sizeof(float)),
                      "%s: block %d weights differ after the retry", in->what, b);
        }
    }
    failing_close(&f);
    for (int b = 0; b < nb; b++) { free(want_w[b]); free(got_w[b]); }
    free(want_w);
    free(got_w);
    fy_model_free(m);
    fy_plan_free(&plan);
}

/* Failures before the update, on every lane: compute, h2d, d2h, cpu. */
Test(failure, before_the_update_every_lane_retries_exactly, .timeout = 120) {
    const injection cases[] = {
        {"load (h2d)", 0, 0, FY_T_LOAD, -1, false, false, 0},
        {"h2d_param (h2d)", 1, 0, FY_T_H2D_PARAM, 2, false, false, 0},
        {"fwd (compute)", 0.5, 0.5, FY_T_FWD, 3, false, false, 0},
        {"head (compute)", 0, 0, FY_T_HEAD, -1, false, false, 0},
        {"bwd (compute)", 0.5, 1, FY_T_BWD, 0, false, false, 0},
        {"d2h_grad (d2h)", 0, 1, FY_T_D2H_GRAD, 2, false, false, 0},
        {"norm (cpu)", 0.5, 0.5, FY_T_NORM, -1, false, false, 0},
        /* the first update of the step to run (block 0's: next use) applies nothing */
        {"the step's first adam_cpu (cpu)", 0, 1, FY_T_ADAM_CPU, 0, false, false, 0},
        /* bf16: the gradients of blocks 1.. are in their weights' buffers when it fails */
        {"bf16: the step's first adam_cpu (cpu)", 1, 1, FY_T_ADAM_CPU, 0, false, true, 0},
        {"bf16: norm (cpu)", 1, 1, FY_T_NORM, -1, false, true, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) check_injection(&cases[i]);
}

/* Failures once a step's update has begun: the trainer is broken. */
Test(failure, inside_an_update_breaks_the_trainer, .timeout = 120) {
    const int head = small_cfg.layers + 1;
    const injection cases[] = {
        {"a later adam_cpu (cpu)", 0, 1, FY_T_ADAM_CPU, head, true, false, 0},
        {"h2d_update (h2d)", 0, 1, FY_T_H2D_UPDATE, head, true, false, 0},
        {"a later adam_gpu (compute)", 0, 0, FY_T_ADAM_GPU, head, true, false, 0},
        {"d2h_param (d2h)", 1, 0, FY_T_D2H_PARAM, 1, true, false, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) check_injection(&cases[i]);
}

/* Speculative updates (plan.h): a failure before the step's first commit (a speculative
 * update, a gradient copy, the norm, the first commit itself: block 0's, which the next
 * forward needs first) applies nothing, and the retried steps are the unbroken run's bits
 * (the speculations written are dropped, the bf16 copies they wrote rebuilt from the
 * masters); one inside a later commit breaks the trainer. The trainer's test hook makes
 * every speculation run before its step's norm (failing_open). Cases from the review of
 * issue 28. */
Test(failure, around_speculative_updates, .timeout = 120) {
    const int head = small_cfg.layers + 1;
    const injection cases[] = {
        {"spec: norm", 1, 1, FY_T_NORM, -1, false, false, 1},
        {"spec bf16: norm", 1, 1, FY_T_NORM, -1, false, true, 1},
        {"spec: the head's speculative adam_cpu", 1, 1, FY_T_ADAM_CPU, head, false, false, 1},
        {"spec bf16: the head's speculative adam_cpu", 1, 1, FY_T_ADAM_CPU, head, false, true, 1},
        {"spec: d2h_grad of block 0", 1, 1, FY_T_D2H_GRAD, 0, false, false, 1},
        {"spec bf16: d2h_grad of block 0", 1, 1, FY_T_D2H_GRAD, 0, false, true, 1},
        {"spec: the first commit", 0, 1, FY_T_COMMIT, 0, false, false, 1},
        {"spec bf16: the first commit", 1, 1, FY_T_COMMIT, 0, false, true, 1},
        {"spec: a later commit", 0, 1, FY_T_COMMIT, head, true, false, 1},
    };
    g_clip = 1e6f; /* clipping on, never firing: every step speculates */
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) check_injection(&cases[i]);
    g_clip = 1.0f;
}

/* Evaluation runs through the same graph and pools: a streamed plan evaluates the same
 * bits as all-resident, and a batch's evaluated loss is the loss its training step
 * reports (the same forward, before the update). */
Test(eval, streamed_plans_evaluate_the_same_bits_as_training, .timeout = 60) {
    const double plans[][2] = {{0, 0}, {1, 0}, {0.5, 1}};
    float first = NAN;
    for (int i = 0; i < 3; i++) {
        fy_plan plan = make_plan(&small_cfg, 2, 1, plans[i][0], plans[i][1], i);
        failing_run f;
        failing_open(&f, &plan);
        float losses[6];
        cr_assert_eq(fy_trainer_eval_run(f.tr, 6, batch_at, f.ld, losses, NULL), FY_OK);
        if (i == 0) first = losses[0];
        cr_expect(losses[0] == first, "plan %d: eval loss %.9g vs all-resident %.9g", i,
                  losses[0], first);
        fy_step_stats ss[1];
        int done;
        cr_assert_eq(failing_window(&f, 0, 1, ss, &done), FY_OK);
        cr_expect(ss[0].loss == losses[0], "plan %d: training loss %.9g, evaluated %.9g", i,
                  ss[0].loss, losses[0]);
        for (int k = 1; k < 6; k++) cr_expect(isfinite(losses[k]) && losses[k] != losses[0]);
        failing_close(&f);
        fy_plan_free(&plan);
    }
}

/* ---- the layout ------------------------------------------------------------------------ */

/* Every state's place agrees with the plan (the master, gradient and moments where
 * fy_plan_where says, device or not), an alias's owner is a buffer of its own with the
 * same dtype and range, the moments hold exactly the rank's shard and the ranks' shards
 * tile each block, and the layout is a pure function: made twice, the same bytes. Over
 * every placement of every block (irregular plans), both storage types, accumulation, and
 * jobs of 1 to 3 ranks (and planning: rank -1). */
static void check_layout(const fy_model *m, const fy_plan *p, int world, int rank) {
    fy_layout L, again;
    cr_assert_eq(fy_layout_new(m, p, 16, true, world, rank, &L), FY_OK);
    cr_assert_eq(fy_layout_new(m, p, 16, true, world, rank, &again), FY_OK);
    cr_expect(!memcmp(L.blocks, again.blocks, (size_t)L.nblocks * sizeof *L.blocks), "a pure function");
    const fy_plan_state ps[] = {FY_PLAN_MASTER, FY_PLAN_GRAD, FY_PLAN_MOMENTS, FY_PLAN_MOMENTS};
    const fy_state ss[] = {FY_STATE_MASTER, FY_STATE_GRAD, FY_STATE_M, FY_STATE_V};
    for (int b = 0; b < L.nblocks; b++) {
        const fy_block_layout *bl = &L.blocks[b];
        for (int k = 0; k < 4; k++) {
            const fy_place *pl = fy_layout_state(&L, b, ss[k]);
            const bool dev = fy_plan_where(&p->blocks[b], ps[k]) == FY_ON_DEVICE;
            cr_assert(pl->tier != FY_TIER_NONE, "block %d has its %s", b, fy_state_name(ss[k]));
            cr_expect_eq(pl->tier == FY_TIER_DEVICE, dev, "block %d %s on %s", b, fy_state_name(ss[k]),
                         fy_tier_name(pl->tier));
        }
        for (int s = 0; s < FY_STATES; s++) {
            if (fy_layout_owns(&L, b, (fy_state)s) || !fy_layout_has(&L, b, (fy_state)s)) continue;
            const fy_state o = fy_layout_buffer_of(&L, b, (fy_state)s);
            const fy_place *pl = fy_layout_state(&L, b, (fy_state)s), *po = fy_layout_state(&L, b, o);
            cr_expect(fy_layout_owns(&L, b, o) && pl->dtype == po->dtype && pl->lo == po->lo &&
                      pl->hi == po->hi && pl->tier == po->tier, "block %d: %s is %s's buffer", b,
                      fy_state_name((fy_state)s), fy_state_name(o));
        }
        const fy_place *mp = fy_layout_state(&L, b, FY_STATE_M);
        cr_expect(mp->lo == bl->lo && mp->hi == bl->hi && mp->sharded == (world > 1));
        cr_expect_eq(bl->streamed, p->blocks[b].weights == FY_ON_HOST);
        cr_expect_eq(fy_layout_has(&L, b, FY_STATE_WEIGHTS), !bl->streamed);
        if (world > 1 && rank >= 0) { /* the ranks' shards tile the block */
            size_t off[FY_MAX_SHARDS + 1];
            fy_shard_bounds(bl->nelem, world, off);
            cr_expect(off[0] == 0 && off[world] == bl->nelem && bl->lo == off[rank] && bl->hi == off[rank + 1]);
        }
    }
    fy_layout_free(&L);
    fy_layout_free(&again);
}

Test(layout, every_state_is_where_the_plan_says, .timeout = 60) {
    fy_model *m = new_model(&small_cfg);
    const int nb = fy_model_nblocks(m);
    for (int pattern = 0; pattern < 64; pattern++)
        for (int v = 0; v < 4; v++) {
            fy_plan p = plan_of(m, 2, v % 2 ? 2 : 1, 0, 0, 0, v < 2 ? FY_F32 : FY_BF16);
            for (int b = 0; b < nb; b++) { /* a different placement per block and pattern */
                const int bits = (pattern * 7 + b * 3) % 4;
                p.blocks[b].weights = bits & 1 ? FY_ON_HOST : FY_ON_DEVICE;
                p.blocks[b].update = bits & 2 ? FY_UPDATE_CPU : FY_UPDATE_DEVICE;
            }
            for (int world = 1; world <= 3; world++)
                for (int rank = world > 1 ? -1 : 0; rank < world; rank++) check_layout(m, &p, world, rank);
            fy_plan_free(&p);
        }
    fy_model_free(m);
}

/* The layout's memory model counts every buffer a state owns, under its category and
 * on its side (device, or host). */
Test(layout, the_memory_model_counts_every_state, .timeout = 60) {
    fy_model *m = new_model(&small_cfg);
    for (int v = 0; v < 4; v++) {
        fy_plan p = plan_of(m, 2, 1, v & 1 ? 1 : 0.5, v & 2 ? 1 : 0.5, 2, v < 2 ? FY_F32 : FY_BF16);
        fy_layout L;
        cr_assert_eq(fy_layout_new(m, &p, 16, true, 1, 0, &L), FY_OK);
        size_t dev[FY_CAT_COUNT] = {0}, host[FY_CAT_COUNT] = {0};
        for (int b = 0; b < L.nblocks; b++)
            for (int s = 0; s < FY_STATE_SAVED; s++) {
                const fy_place *pl = fy_layout_state(&L, b, (fy_state)s);
                (pl->tier == FY_TIER_DEVICE ? dev : host)[pl->cat] += fy_place_nbytes(pl);
            }
        fy_mem_model mm;
        fy_layout_memory(&L, SIZE_MAX, &mm);
        for (int c = FY_CAT_PARAMS; c <= FY_CAT_OPTIM; c++) {
            cr_expect_eq(mm.device[c], dev[c], "v %d device %s", v, fy_mem_cat_name((fy_mem_cat)c));
            cr_expect(mm.host[c] >= host[c] && mm.host[c] < host[c] + 64 * 1024, "v %d host %s: %zu of %zu",
                      v, fy_mem_cat_name((fy_mem_cat)c), mm.host[c], host[c]);
        }
        fy_layout_free(&L);
        fy_plan_free(&p);
    }
    fy_model_free(m);
}

/* The builder's tasks carry their work: a step's matmul FLOPs are every block's forward
 * and backward, the recomputed layers' forwards again and the head's loss pass (whole, or
 * cut into vocabulary chunks), and its fetches move each streamed block's staged copy once
 * per pass that reads it (a recompute and its backward share one); built from the layout
 * alone. */
Test(step_graph, tasks_carry_their_bytes_and_flops, .timeout = 60) {
    fy_model *m = new_model(&small_cfg);
    const int nb = fy_model_nblocks(m), L4 = fy_model_layers(m);
    for (int v = 0; v < 2; v++) {
        fy_plan p = plan_of(m, 2, 1, v ? 1 : 0, v ? 1 : 0, v ? L4 : 0, FY_F32);
        fy_layout L;
        cr_assert_eq(fy_layout_new(m, &p, 16, true, 1, 0, &L), FY_OK);
        fy_step_graph sg;
        cr_assert_eq(fy_step_build_train(&L, 1, true, &sg), FY_OK);
        double flops = 0, want = 0, fetched = 0;
        for (int i = 0; i < sg.g.n; i++) {
            flops += sg.g.tasks[i].flops;
            if (sg.g.tasks[i].kind == FY_T_H2D_PARAM) fetched += sg.g.tasks[i].bytes;
        }
        for (int b = 0; b < nb; b++) {
            fy_cost c;
            const bool head = fy_model_block(m, b)->kind == FY_BLOCK_HEAD;
            fy_model_cost(m, b, head ? FY_PASS_LOSS : FY_PASS_FWD, 2, 16, 4, &c);
            want += c.flops * (p.blocks[b].acts == FY_ACTS_RECOMPUTE ? 2 : 1);
            if (head) continue;
            fy_model_cost(m, b, FY_PASS_BWD, 2, 16, 4, &c);
            want += c.flops;
        }
        cr_expect(fabs(flops - want) <= 1e-9 * want, "v %d: %g flops, want %g", v, flops, want);
        cr_expect(v || fetched == 0, "all resident: nothing fetched");
        if (v) { /* streamed, recomputed and updated on the CPU: a layer crosses twice (its
                    forward; its recompute and backward together), the embedding once (its
                    backward reads no weights), the head once with the tied embedding it
                    links to */
            double want_bytes = 0;
            for (int b = 0; b < nb; b++) {
                const fy_block_spec *blk = fy_model_block(m, b);
                const int passes = blk->kind == FY_BLOCK_LAYER ? 2 : 1;
                want_bytes += passes * (double)L.blocks[b].stage_nelem * 4;
                for (int k = 0; k < blk->nlinks; k++)
                    want_bytes += (double)L.blocks[blk->links[k]].stage_nelem * 4;
            }
            cr_expect_eq(fetched, want_bytes, "v %d: %g bytes fetched, want %g", v, fetched, want_bytes);
        }
        fy_step_graph_free(&sg);
        fy_layout_free(&L);
        fy_plan_free(&p);
    }
    fy_model_free(m);
}
