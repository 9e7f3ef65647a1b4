/* plan_runs.h — training a model under placement plans on the cpu backend and comparing
 * the runs: the offload invariance (every plan gives the all-resident plan's losses and
 * weights, bit for bit, and a memory model equal to the measured device peak), one
 * routine for every model family (test_offload.c: GPT-2; test_family.c: a toy family).
 * Include after <criterion/criterion.h>; the including file is a test program (statics). */
#ifndef FY_PLAN_RUNS_H
#define FY_PLAN_RUNS_H

#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/core/dtype.h"
#include "engine/model/model.h"
#include "engine/trainer.h"
#include "engine/trainer_core.h" /* white box: the copies of a block, to plant a NaN */
#include "offload/disk.h"
#include "offload/plan.h"
#include "offload/storage.h"
#include "tests/test_util.h"

enum { T_SEQ = 16, STEPS = 5 };

typedef struct result {
    float loss[STEPS];
    float norm[STEPS];
    bool skipped[STEPS];
    float clip_coef[STEPS];
    int speculated[STEPS], kept[STEPS]; /* speculative updates run, and kept */
    int nblocks;
    size_t *nelem;   /* per block */
    float **w;       /* final parameters per block */
    size_t peak, model, staging;
    size_t pinned, pinned_model;  /* measured pinned peak; the model's, under g_pinned_cap */
    size_t disk, disk_model;      /* the scratch file's size; the model's disk bytes */
    int gathered;    /* the block whose passes got only the micro-batch's rows, or -1 */
    int head_chunks; /* the chunks a chunked head's passes took, or 0 */
} result;

/* The pinned-memory cap of plan_train's devices (0: the default). */
static size_t g_pinned_cap;
/* plan_train's clip threshold (0: off), and the step (1-based) whose norm the trainer's
 * test hook makes NaN (0: none). */
static float g_clip = 1.0f;
static int g_nan_norm_step;
/* plan_train's packed documents (trainer.h; default none). */
static fy_doc_mask g_docs;
/* plan_train's disk tier directory (a plan with state on disk needs one). */
static const char *g_disk_dir;

/* Planting a NaN in every copy of one weight of block b (the layout's weights, host
 * weights and master: fp32 masters and the storage type's copies), and taking it out
 * again. */
typedef struct planted { void *p; bool half; uint32_t saved; } planted;

static int plant_nan(fy_trainer *tr, int b, planted out[4]) {
    const fy_layout *L = fy_trainer_layout(tr);
    const fy_state states[3] = {FY_STATE_WEIGHTS, FY_STATE_HOST_WEIGHTS, FY_STATE_MASTER};
    void *ptrs[4] = {0};
    bool half[4] = {0};
    for (int k = 0; k < 3; k++) {
        if (!fy_layout_owns(L, b, states[k])) continue;
        ptrs[k] = fy_storage_ptr(fy_trainer_storage(tr), b, states[k]);
        half[k] = fy_layout_state(L, b, states[k])->dtype == FY_BF16;
    }
    int n = 0;
    for (int k = 0; k < 4; k++) {
        if (!ptrs[k]) continue;
        out[n] = (planted){ptrs[k], half[k], 0};
        if (half[k]) {
            out[n].saved = *(uint16_t *)ptrs[k];
            *(uint16_t *)ptrs[k] = fy_f32_to_bf16(NAN);
        } else {
            memcpy(&out[n].saved, ptrs[k], 4);
            *(float *)ptrs[k] = NAN;
        }
        n++;
    }
    return n;
}

static void unplant(const planted *pl, int n) {
    for (int k = 0; k < n; k++) {
        if (pl[k].half) *(uint16_t *)pl[k].p = (uint16_t)pl[k].saved;
        else memcpy(pl[k].p, &pl[k].saved, 4);
    }
}

/* Trains STEPS steps of model m under `plan` on a fresh cpu device; cap 0 = unlimited.
 * With nan_at >= 0, a NaN sits in the head block's first weight (every copy) during that
 * step. */
static fy_status plan_train(const fy_model *m, const fy_plan *plan, size_t cap,
                            fy_sched_mode mode, int nan_at, result *res) {
    fy_dev_cfg dc = {.kind = FY_DEV_CPU, .threads = 2, .mem_cap_nbytes = cap,
                     .pinned_cap_nbytes = g_pinned_cap};
    fy_dev *dev;
    cr_assert_eq(fy_dev_new(&dc, &dev), FY_OK);
    fy_trainer_cfg tc = {.model = m, .T = T_SEQ, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
                         .weight_decay = 0.1f, .clip = g_clip, .seed = 11, .plan = plan,
                         .schedule = mode, .test_nan_step = g_nan_norm_step, .docs = g_docs,
                         .disk_dir = g_disk_dir,
                         .test_speculate_first = true}; /* speculation, whatever the timing */
    fy_trainer *tr;
    fy_status st = fy_trainer_new(dev, &tc, &tr);
    if (st != FY_OK) {
        fy_dev_free(dev);
        return st;
    }
    fy_tokens *tok = test_corpus();
    const int B = plan->micro_batch, A = plan->grad_accum;
    const size_t N = (size_t)B * T_SEQ;
    fy_loader *ld;
    cr_assert_eq(fy_loader_new(tok, 0, fy_tokens_count(tok), B, T_SEQ, &ld), FY_OK);
    int32_t *x = malloc(N * A * 4), *y = malloc(N * A * 4);
    for (int s = 0; s < STEPS; s++) {
        for (int a = 0; a < A; a++) fy_loader_next(ld, x + a * N, y + a * N, NULL);
        planted pl[4];
        int npl = s == nan_at ? plant_nan(tr, fy_model_nblocks(m) - 1, pl) : 0;
        fy_step_stats ss;
        cr_assert_eq(fy_trainer_step(tr, x, y, 1e-2f, &ss), FY_OK);
        unplant(pl, npl);
        res->loss[s] = ss.loss;
        res->norm[s] = ss.grad_norm;
        res->skipped[s] = ss.skipped;
        res->clip_coef[s] = ss.clip_coef;
        res->speculated[s] = ss.speculated;
        res->kept[s] = ss.kept;
    }
    const fy_layout *L = fy_trainer_layout(tr);
    res->gathered = L->rows_block;
    res->head_chunks = L->blocks[fy_model_nblocks(m) - 1].staging == FY_STAGE_CHUNKS ? L->head_chunks.n : 0;
    res->nblocks = fy_model_nblocks(m);
    res->w = calloc((size_t)res->nblocks, sizeof *res->w);
    res->nelem = calloc((size_t)res->nblocks, sizeof *res->nelem);
    for (int b = 0; b < res->nblocks; b++) {
        res->nelem[b] = fy_model_block(m, b)->nelem;
        res->w[b] = malloc(res->nelem[b] * sizeof(float));
        fy_trainer_get_params(tr, b, res->w[b]);
    }
    fy_dev_mem_stats ms;
    fy_dev_mem_stats_get(dev, &ms);
    res->peak = ms.peak_nbytes[FY_MEM_DEVICE];
    fy_mem_model mm;
    fy_storage_model(m, plan, T_SEQ, &mm);
    res->model = mm.device_total;
    res->disk = fy_trainer_storage(tr)->disk ? fy_disk_nbytes(fy_trainer_storage(tr)->disk) : 0;
    res->disk_model = mm.disk_total;
    res->staging = mm.device[FY_CAT_STAGING];
    res->pinned = ms.peak_nbytes[FY_MEM_PINNED];
    fy_storage_model_pinned(m, plan, T_SEQ, true, fy_dev_cfg_pinned_cap(&dc), &mm);
    res->pinned_model = mm.host_pinned;
    free(x);
    free(y);
    fy_loader_free(ld);
    fy_tokens_free(tok);
    fy_trainer_free(tr);
    fy_dev_free(dev);
    return FY_OK;
}

static void result_free(result *r) {
    for (int b = 0; b < r->nblocks; b++) free(r->w[b]);
    free(r->w);
    free(r->nelem);
}

/* Model m's plan from AutoHete's shorthands, storage type dt. */
static fy_plan plan_of(const fy_model *m, int B, int accum, double p, double o, int k,
                       fy_dtype dt) {
    fy_plan plan;
    cr_assert_eq(fy_plan_new(m, B, accum, &plan), FY_OK);
    cr_assert_eq(fy_plan_shorthands(&plan, p, o, k), FY_OK);
    plan.dtype = dt;
    return plan;
}

static void expect_identical(const result *a, const result *b, const char *what) {
    for (int s = 0; s < STEPS; s++) {
        cr_expect(a->loss[s] == b->loss[s], "%s: step %d loss %.9g vs %.9g", what, s, b->loss[s],
                  a->loss[s]);
        cr_expect(!memcmp(&a->norm[s], &b->norm[s], sizeof(float)), "%s: step %d norm differs",
                  what, s);
    }
    cr_assert_eq(a->nblocks, b->nblocks);
    for (int bl = 0; bl < a->nblocks; bl++)
        cr_expect(!memcmp(a->w[bl], b->w[bl], a->nelem[bl] * sizeof(float)),
                  "%s: block %d weights differ", what, bl);
}

/* Every combination of parameters streamed 0/50/100%, optimizer on the CPU 0/50/100%
 * and recomputation of none/half/all layers, with storage type dt: bit-identical to the
 * all-resident plan of that type, and the memory model equals the measured device peak
 * (the bar is 5%; by construction it is exact, and the test holds it to that). */
static void every_plan_is_bit_identical(const fy_model *m, fy_dtype dt) {
    const int L = fy_model_layers(m);
    fy_plan base = plan_of(m, 2, 1, 0, 0, 0, dt);
    result ref;
    cr_assert_eq(plan_train(m, &base, 0, FY_SCHED_PRIORITY, -1, &ref), FY_OK);
    cr_expect(ref.peak == ref.model, "all-resident: peak %zu, model %zu", ref.peak, ref.model);
    const double ratios[] = {0, 0.5, 1};
    const int ckpts[] = {0, L / 2, L};
    int n = 0;
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 3; j++)
            for (int k = 0; k < 3; k++) {
                if (!i && !j && !k) continue;
                fy_plan p = plan_of(m, 2, 1, ratios[i], ratios[j], ckpts[k], dt);
                result r;
                char what[128];
                snprintf(what, sizeof what, "%s %s: params %.1f optim %.1f ckpt %d",
                         fy_model_family(m), fy_dtype_name(dt), ratios[i], ratios[j], ckpts[k]);
                cr_assert_eq(plan_train(m, &p, 0, FY_SCHED_PRIORITY, -1, &r), FY_OK, "%s", what);
                expect_identical(&ref, &r, what);
                cr_expect(r.peak == r.model, "%s: device peak %zu, model %zu", what, r.peak, r.model);
                /* the plan really moved state off the device: all but staging shrank */
                cr_expect(r.peak - r.staging < ref.peak, "%s: device peak %zu (staging %zu) "
                          "not below all-resident %zu", what, r.peak, r.staging, ref.peak);
                result_free(&r);
                fy_plan_free(&p);
                n++;
            }
    cr_expect_eq(n, 26);
    result_free(&ref);
    fy_plan_free(&base);
}

/* Hand-written per-block patterns the shorthands cannot express. */
static void irregular_plan_is_bit_identical(const fy_model *m, fy_dtype dt) {
    fy_plan base = plan_of(m, 2, 1, 0, 0, 0, dt);
    result ref;
    cr_assert_eq(plan_train(m, &base, 0, FY_SCHED_PRIORITY, -1, &ref), FY_OK);
    fy_plan p = plan_of(m, 2, 1, 0, 0, 0, dt);
    for (int b = 0; b < p.nblocks; b++) {
        p.blocks[b].weights = b % 2 ? FY_ON_HOST : FY_ON_DEVICE;
        p.blocks[b].update = b % 3 ? FY_UPDATE_CPU : FY_UPDATE_DEVICE;
        if (p.blocks[b].kind == FY_BLOCK_LAYER)
            p.blocks[b].acts = b % 2 ? FY_ACTS_KEEP : FY_ACTS_RECOMPUTE;
    }
    p.blocks[0].weights = FY_ON_HOST; /* the embedding streamed, gpu optimizer */
    result r;
    cr_assert_eq(plan_train(m, &p, 0, FY_SCHED_PRIORITY, -1, &r), FY_OK);
    expect_identical(&ref, &r, "irregular");
    result_free(&r);
    result_free(&ref);
    fy_plan_free(&p);
    fy_plan_free(&base);
}

/* With gradient accumulation (2 micro-batches of 2) every plan still matches
 * all-resident bit for bit, with storage type dt; ref receives the all-resident run. */
static void accumulated_plans_are_bit_identical(const fy_model *m, fy_dtype dt, result *ref) {
    const int L = fy_model_layers(m);
    fy_plan acc = plan_of(m, 2, 2, 0, 0, 0, dt);
    cr_assert_eq(plan_train(m, &acc, 0, FY_SCHED_PRIORITY, -1, ref), FY_OK);
    const double ratios[][3] = {{1, 1, L}, {0.5, 0.5, L / 2}, {0, 1, 0}, {1, 0, 0}};
    for (int i = 0; i < 4; i++) {
        fy_plan p = plan_of(m, 2, 2, ratios[i][0], ratios[i][1], (int)ratios[i][2], dt);
        result r;
        cr_assert_eq(plan_train(m, &p, 0, FY_SCHED_PRIORITY, -1, &r), FY_OK);
        expect_identical(ref, &r, fy_dtype_name(dt));
        cr_expect(r.peak == r.model);
        result_free(&r);
        fy_plan_free(&p);
    }
    fy_plan_free(&acc);
}

/* A directory the test owns, empty, for the disk tier (removed by dir_done). */
static char *disk_dir_new(void) {
    char *d = strdup("/tmp/ferry-test-disk-XXXXXX");
    cr_assert(d && mkdtemp(d));
    return d;
}
/* The run left its directory as it found it (the scratch file is gone); removed. */
static void disk_dir_done(char *d) {
    DIR *dir = opendir(d);
    cr_assert(dir);
    int n = 0;
    for (struct dirent *e; (e = readdir(dir));) n += strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    closedir(dir);
    cr_expect_eq(n, 0, "the disk tier left %d entries in %s", n, d);
    rmdir(d);
    free(d);
}

/* The tiers past device and host memory (plan.h: disk, acts offload) with storage type
 * dt: optimizer state on disk (in chunks of 1024 elements, so every block is several;
 * all of it, half of it), offloaded layer inputs (every layer, the first half, every
 * other one between kept layers), with one and two micro-batches a step, a step whose
 * norm is NaN (skipped: the disk chunks restore the host weights) and clipped steps: each
 * bit-identical to all-resident; the device peak equals the memory model, the scratch
 * file is the model's disk bytes, and the directory is empty after. */
static void tiered_plans_are_bit_identical(const fy_model *m, fy_dtype dt) {
    const int L = fy_model_layers(m);
    char *dir = disk_dir_new();
    g_disk_dir = dir;
    struct { double p, o, disk, acts; int ckpt, accum; bool alternate; const char *what; } cases[] = {
        {1, 1, 1, 1, 0, 1, false, "everything offloaded, state on disk"},
        {1, 1, 1, 1, 0, 2, false, "the same, accumulated"},
        {0.5, 1, 0.5, 0.5, L / 2, 1, false, "half on disk, half offloaded"},
        {0, 1, 1, 0, 0, 2, false, "resident weights, state on disk, accumulated"},
        {1, 0.5, 0, 1, 0, 1, true, "every other layer's input offloaded"},
    };
    /* each case as it is, then some with clipped steps (clip 0.05) or a skipped one */
    const struct { int i; float clip; int nan; } runs[] = {
        {0, 1.0f, 0}, {1, 1.0f, 0}, {2, 1.0f, 0}, {3, 1.0f, 0}, {4, 1.0f, 0},
        {0, 0.05f, 0}, {0, 1.0f, 2}, {3, 1.0f, 2}, {2, 0.05f, 0}};
    for (size_t k = 0; k < sizeof runs / sizeof runs[0]; k++) {
        const int i = runs[k].i, A = cases[i].accum, nan = runs[k].nan;
        g_clip = runs[k].clip;
        g_nan_norm_step = nan;
        fy_plan base = plan_of(m, 2, A, 0, 0, 0, dt);
        result ref, r;
        cr_assert_eq(plan_train(m, &base, 0, FY_SCHED_PRIORITY, -1, &ref), FY_OK);
        fy_plan p = plan_of(m, 2, A, cases[i].p, cases[i].o, cases[i].ckpt, dt);
        cr_assert_eq(fy_plan_offload_acts(&p, cases[i].acts), FY_OK);
        cr_assert_eq(fy_plan_disk(&p, cases[i].disk), FY_OK);
        for (int b = 0; b < p.nblocks && cases[i].alternate; b++)
            if (p.blocks[b].kind == FY_BLOCK_LAYER && p.blocks[b].layer % 2)
                p.blocks[b].acts = FY_ACTS_KEEP;
        p.disk_chunk = FY_DISK_CHUNK_ALIGN;
        char what[192];
        snprintf(what, sizeof what, "%s %s %s, clip %g%s", fy_model_family(m), fy_dtype_name(dt),
                 cases[i].what, (double)g_clip, nan ? ", step 2 NaN" : "");
        cr_assert_eq(plan_train(m, &p, 0, FY_SCHED_PRIORITY, -1, &r), FY_OK, "%s", what);
        expect_identical(&ref, &r, what);
        for (int s = 0; s < STEPS; s++)
            cr_expect_eq(r.skipped[s], nan && s == nan - 1, "%s: step %d skipped?", what, s + 1);
        cr_expect(g_clip == 1.0f || r.clip_coef[0] < 1.0f, "%s: the step clipped", what);
        cr_expect(r.peak == r.model, "%s: device peak %zu, model %zu", what, r.peak, r.model);
        cr_expect(r.disk == r.disk_model, "%s: scratch file %zu bytes, model %zu", what, r.disk,
                  r.disk_model);
        cr_expect_eq(r.disk > 0, cases[i].disk > 0, "%s", what);
        result_free(&r);
        result_free(&ref);
        fy_plan_free(&p);
        fy_plan_free(&base);
    }
    g_clip = 1.0f;
    g_nan_norm_step = 0;
    g_disk_dir = NULL;
    disk_dir_done(dir);
}

#endif
