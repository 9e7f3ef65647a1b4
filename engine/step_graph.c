/* step_graph.c — training steps as a task graph for the scheduler.
 *
 * For each step of a window and each micro-batch m of it:
 *   load(m)            h2d      next batch into the token buffer m%2
 *   h2d_param(b)       h2d      streamed block b's parameters into a staging slot
 *   fwd(b)             compute  embedding, then each layer
 *   gopen(0)           compute  a zeroed gradient slot for the embedding (staged only)
 *   head(m)            compute  ln_f, logits, loss and their backward (wte is tied)
 *   recompute(b)       compute  a checkpointed layer's forward again
 *   bwd(b)             compute  layers, then the embedding
 *   d2h_grad(b)        d2h      a cpu-optimised block's gradient to the host
 * and once per step:
 *   norm(t)            cpu      global gradient norm, clip coefficient, mean loss
 *   adam_gpu(b)        compute  (with h2d_param and d2h_param around it when streamed)
 *   adam_cpu(b)        cpu      optim_cpu on the host master
 *   h2d_update(b)      h2d      updated weights back to a resident block
 *
 * Dependencies are the data flow (each read after its write) plus the reuse of buffers
 * (a write after the previous reads: activations, the recompute buffer, token buffers,
 * the host landing slot). The compute tasks' program positions give the next-use
 * priorities, across the steps of the window: after backward, block 0's gradient copy
 * and update come first because the next forward needs block 0 first.
 *
 * Exactness: clipping needs the global norm before any update, so every update of step
 * t waits for norm(t) (the "norm barrier"; fy_trainer_predict can simulate the graph
 * without it to measure what exact clipping costs in overlap); the arithmetic is that of the serial schedule, task by task, so
 * every schedule mode gives bit-identical results. Each task ends by synchronising its
 * lane's stream, so a finished task's results are complete. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/dtype.h"
#include "engine/core/reduce.h"
#include "engine/core/util.h"
#include "engine/device/kernels.h"
#include "engine/trainer_impl.h"

static const char *kind_names[FY_T_COUNT] = {
    "load", "h2d_param", "fwd", "gopen", "head", "recompute", "bwd", "d2h_grad", "norm",
    "adam_gpu", "d2h_param", "adam_cpu", "h2d_update"};

const char *fy_task_kind_name(int kind) {
    return kind >= 0 && kind < FY_T_COUNT ? kind_names[kind] : "?";
}

/* ---- helpers shared by the runners --------------------------------------------------- */

static int accum(const fy_trainer *tr) { return tr->plan.grad_accum; }
static bool staged(const fy_trainer *tr, int b) { return tr->st->chunks[b].needs_grad_staging; }

/* The staging slot a task of the window acquired. */
static float *param_unit(const fy_trainer *tr, int task) {
    return tr->st->param_slots[tr->graph->tasks[task].unit].buf;
}
static float *grad_unit(const fy_trainer *tr, int task) {
    return tr->st->grad_slots[tr->graph->tasks[task].unit].buf;
}
static int task_id(const fy_trainer *tr, const fy_task *t) { return (int)(t - tr->graph->tasks); }

/* Block b's parameters: the slot of fetch task `fetch`, or the resident copy. */
static float *params_for(const fy_trainer *tr, int b, int fetch) {
    return fetch >= 0 ? param_unit(tr, fetch) : tr->st->chunks[b].param_dev;
}

static int32_t *tokens_dev(const fy_trainer *tr, int64_t m) {
    size_t N = (size_t)tr->plan.micro_batch * tr->cfg.T;
    return tr->st->tok_dev + (size_t)(m % 2) * 2 * N;
}

/* The gradient buffer block b's compute task writes in micro-batch a: a staging slot
 * (`slot_task`'s unit, zeroed) or the device accumulator (zeroed on the first one). */
static float *grad_open(fy_trainer *tr, int b, int a, int slot_task) {
    float *g = staged(tr, b) ? grad_unit(tr, slot_task) : tr->st->chunks[b].grad_dev;
    if (staged(tr, b) || a == 0) fy_memset_async(tr->s, g, 0, fy_tr_nbytes(tr, b));
    return g;
}

/* Micro-batch a's gradient of block b is complete in g: a staged gpu-optimised block adds
 * it into its device accumulator (the first micro-batch copies), and on the last
 * micro-batch the sum of squares is taken where the final gradient is (on the host, by
 * d2h_grad, when a cpu-optimised block accumulates there). */
static void grad_close(fy_trainer *tr, int b, int a, float *g) {
    const fy_chunk *c = &tr->st->chunks[b];
    fy_storage *st = tr->st;
    if (!fy_tr_cpu_optim(tr, b) && staged(tr, b)) {
        if (a == 0) fy_copy_async(tr->s, c->grad_dev, g, fy_tr_nbytes(tr, b), FY_D2D);
        else fy_k_residual_fwd(c->grad_dev, c->grad_dev, g, c->nelem, tr->s);
    }
    if (a != accum(tr) - 1) return;
    const float *final = !fy_tr_cpu_optim(tr, b) ? c->grad_dev : accum(tr) == 1 ? g : NULL;
    if (!final) return;
    fy_k_sumsq(st->sumsq_dev + b, final, c->nelem, tr->s);
    fy_copy_async(tr->s, st->sumsq_host + b, st->sumsq_dev + b, sizeof(double), FY_D2H);
}

/* ---- runners: each does its block's work on its lane and waits for it ----------------- */

static void run_load(void *ctx, const fy_task *t) {
    fy_trainer *tr = ctx;
    const size_t N = (size_t)tr->plan.micro_batch * tr->cfg.T;
    int32_t *h = tr->st->tok_host + (size_t)(t->iter % 2) * 2 * N;
    tr->next_batch(tr->batch_ctx, tr->micro_base + t->iter, h, h + N);
    fy_copy_async(tr->s_h2d, tokens_dev(tr, t->iter), h, 2 * N * sizeof(int32_t), FY_H2D);
    fy_stream_sync(tr->s_h2d);
}

/* h2d_param: the storage type's copy for compute; for a device update (arg2 = 1) with
 * bf16 storage, the fp32 master (the bf16 copy the update writes follows it in the slot). */
static void run_h2d_param(void *ctx, const fy_task *t) {
    fy_trainer *tr = ctx;
    const fy_chunk *c = &tr->st->chunks[t->block];
    float *slot = tr->st->param_slots[t->unit].buf;
    if (t->arg2 == 1 && fy_tr_lp(tr))
        fy_copy_async(tr->s_h2d, slot, c->param_host, fy_tr_master_nbytes(tr, t->block), FY_H2D);
    else
        fy_copy_async(tr->s_h2d, slot, c->param_lp, fy_tr_nbytes(tr, t->block), FY_H2D);
    fy_stream_sync(tr->s_h2d);
}

/* fwd and recompute: arg = fetch task or -1. */
static void run_fwd(void *ctx, const fy_task *t) {
    fy_trainer *tr = ctx;
    const fy_gpt2_config *mc = &tr->cfg.model;
    fy_storage *st = tr->st;
    const int B = tr->plan.micro_batch, T = tr->cfg.T, b = t->block;
    float *w = params_for(tr, b, t->arg);
    if (b == 0) {
        fy_gpt2_embed_w ew;
        fy_gpt2_embed_view(&tr->lay.blocks[0], fy_tr_dt(tr), w, &ew);
        fy_gpt2_embed_fwd(mc, &ew, tokens_dev(tr, t->iter), st->x0, B, T, tr->s);
    } else {
        fy_gpt2_layer_w lw;
        fy_gpt2_layer_view(&tr->lay.blocks[b], fy_tr_dt(tr), w, &lw);
        fy_gpt2_layer_fwd(mc, &lw, &st->acts[b - 1], fy_tr_layer_input(tr, b - 1), &st->sc, B, T, tr->s);
    }
    fy_stream_sync(tr->s);
}

static void run_gopen(void *ctx, const fy_task *t) {
    fy_trainer *tr = ctx;
    fy_memset_async(tr->s, tr->st->grad_slots[t->unit].buf, 0, fy_tr_nbytes(tr, t->block));
    fy_stream_sync(tr->s);
}

/* head: arg = head fetch, arg2 = embedding fetch (or -1). Forward, loss, backward. */
static void run_head(void *ctx, const fy_task *t) {
    fy_trainer *tr = ctx;
    const fy_gpt2_config *mc = &tr->cfg.model;
    fy_storage *st = tr->st;
    const int B = tr->plan.micro_batch, T = tr->cfg.T, L = mc->layers, h = L + 1;
    const int a = (int)(t->iter % accum(tr));
    const int32_t *y = tokens_dev(tr, t->iter) + (size_t)B * T;
    fy_gpt2_head_w hw, hg;
    fy_gpt2_embed_w ew, eg;
    fy_gpt2_head_view(&tr->lay.blocks[h], fy_tr_dt(tr), params_for(tr, h, t->arg), &hw);
    fy_gpt2_embed_view(&tr->lay.blocks[0], fy_tr_dt(tr), params_for(tr, 0, t->arg2), &ew);
    float dloss = (float)(1.0 / ((double)B * T * accum(tr)));
    int gopen = tr->gopen_id[t->iter];
    float *g0 = gopen >= 0 ? grad_unit(tr, gopen) : st->chunks[0].grad_dev;
    if (gopen < 0 && a == 0) fy_memset_async(tr->s, g0, 0, fy_tr_nbytes(tr, 0));
    fy_gpt2_embed_view(&tr->lay.blocks[0], fy_tr_dt(tr), g0, &eg);
    float *gh = grad_open(tr, h, a, task_id(tr, t));
    fy_gpt2_head_view(&tr->lay.blocks[h], fy_tr_dt(tr), gh, &hg);
    fy_gpt2_head_step(mc, &hw, &hg, ew.wte, eg.wte, st->dwte32, st->acts[L - 1].out, &st->head,
                      y, dloss, st->loss_dev + a, &st->sc, B, T, tr->s);
    fy_copy_async(tr->s, st->loss_host + a, st->loss_dev + a, sizeof(float), FY_D2H);
    grad_close(tr, h, a, gh);
    fy_stream_sync(tr->s);
}

/* bwd: arg = fetch task or -1 (layers); the embedding's gradient is its gopen slot. */
static void run_bwd(void *ctx, const fy_task *t) {
    fy_trainer *tr = ctx;
    const fy_gpt2_config *mc = &tr->cfg.model;
    fy_storage *st = tr->st;
    const int B = tr->plan.micro_batch, T = tr->cfg.T, b = t->block;
    const int a = (int)(t->iter % accum(tr));
    if (b == 0) {
        int gopen = tr->gopen_id[t->iter];
        float *g0 = gopen >= 0 ? grad_unit(tr, gopen) : st->chunks[0].grad_dev;
        fy_gpt2_embed_w eg;
        fy_gpt2_embed_view(&tr->lay.blocks[0], fy_tr_dt(tr), g0, &eg);
        fy_gpt2_embed_bwd(mc, &eg, tokens_dev(tr, t->iter), &st->sc, B, T, tr->s);
        grad_close(tr, 0, a, g0);
    } else {
        fy_gpt2_layer_w w, g;
        fy_gpt2_layer_view(&tr->lay.blocks[b], fy_tr_dt(tr), params_for(tr, b, t->arg), &w);
        float *gb = grad_open(tr, b, a, task_id(tr, t));
        fy_gpt2_layer_view(&tr->lay.blocks[b], fy_tr_dt(tr), gb, &g);
        fy_gpt2_layer_bwd(mc, &w, &g, &st->acts[b - 1], fy_tr_layer_input(tr, b - 1), &st->sc, B, T, tr->s);
        grad_close(tr, b, a, gb);
    }
    fy_stream_sync(tr->s);
}

/* d2h_grad: arg = the task holding the gradient slot. The first micro-batch lands in
 * grad_host, later ones in the landing slot and are added there. */
static void run_d2h_grad(void *ctx, const fy_task *t) {
    fy_trainer *tr = ctx;
    const int b = t->block, a = (int)(t->iter % accum(tr));
    const fy_chunk *c = &tr->st->chunks[b];
    float *g = grad_unit(tr, t->arg);
    float *dst = a == 0 ? c->grad_host : tr->st->grad_host_tmp;
    fy_copy_async(tr->s_d2h, dst, g, fy_tr_nbytes(tr, b), FY_D2H);
    fy_stream_sync(tr->s_d2h);
    /* the device's accumulation, on the host: fp32 sums, rounded to the storage type */
    if (a > 0 && fy_tr_lp(tr)) {
        uint16_t *acc = (uint16_t *)c->grad_host;
        const uint16_t *add = (const uint16_t *)dst;
        for (size_t i = 0; i < c->nelem; i++)
            acc[i] = fy_f32_to_bf16(fy_bf16_to_f32(acc[i]) + fy_bf16_to_f32(add[i]));
    } else if (a > 0) {
        for (size_t i = 0; i < c->nelem; i++) c->grad_host[i] = c->grad_host[i] + dst[i];
    }
    if (a == accum(tr) - 1 && accum(tr) > 1)
        tr->st->sumsq_host[b] = fy_tr_lp(tr) ? fy_sumsq_bf16((const uint16_t *)c->grad_host, c->nelem)
                                             : fy_sumsq(c->grad_host, c->nelem);
}

/* The step of the window a task belongs to (tasks carry their micro-batch). */
static int step_of(const fy_trainer *tr, const fy_task *t) { return t->iter / accum(tr); }

static void run_norm(void *ctx, const fy_task *t) {
    fy_trainer *tr = ctx;
    fy_storage *st = tr->st;
    fy_step_stats *out = &tr->stats[step_of(tr, t)];
    double ss = 0.0, loss = 0.0;
    for (int b = 0; b < tr->lay.nblocks; b++) ss += st->sumsq_host[b];
    for (int a = 0; a < accum(tr); a++) loss += st->loss_host[a];
    float norm = (float)sqrt(ss);
    out->loss = (float)(loss / accum(tr));
    out->grad_norm = norm;
    out->clip_coef = 1.0f;
    out->skipped = !isfinite(norm);
    if (!out->skipped && tr->cfg.clip > 0.0f) {
        float coef = tr->cfg.clip / (norm + 1e-6f);
        if (coef < 1.0f) out->clip_coef = coef;
    }
    if (!out->skipped) tr->steps_done++;
    tr->adam_step[step_of(tr, t)] = tr->steps_done;
}

static fy_adam_hparams hparams(const fy_trainer *tr, int step) {
    return (fy_adam_hparams){.lr = tr->lrs[step], .beta1 = tr->cfg.beta1,
                             .beta2 = tr->cfg.beta2, .eps = tr->cfg.eps,
                             .weight_decay = tr->cfg.weight_decay,
                             .step = tr->adam_step[step],
                             .grad_scale = tr->stats[step].clip_coef};
}

/* The two AdamW ranges of block b: tensors with weight decay first, then the others. */
static void adam_ranges(const fy_trainer *tr, int b, size_t off[2], size_t len[2]) {
    const fy_block_spec *blk = &tr->lay.blocks[b];
    off[0] = 0;
    len[0] = blk->decay_nelem;
    off[1] = blk->decay_nelem;
    len[1] = blk->nelem - blk->decay_nelem;
}

/* adam_gpu: arg = fetch task or -1. The fp32 master is updated; with bf16 storage the
 * update also writes the bf16 copy (the resident one, or the slot's second part). */
static void run_adam_gpu(void *ctx, const fy_task *t) {
    fy_trainer *tr = ctx;
    if (tr->stats[step_of(tr, t)].skipped) return;
    const int b = t->block;
    const fy_chunk *c = &tr->st->chunks[b];
    fy_adam_hparams hp = hparams(tr, step_of(tr, t));
    float *w = params_for(tr, b, t->arg);
    void *out = NULL;
    if (fy_tr_lp(tr) && t->arg >= 0) out = (char *)w + fy_tr_master_nbytes(tr, b);
    else if (fy_tr_lp(tr)) { out = c->param_dev; w = c->master_dev; }
    size_t off[2], len[2];
    adam_ranges(tr, b, off, len);
    for (int k = 0; k < 2; k++) {
        if (!len[k]) continue;
        size_t o = off[k];
        fy_adam_range r = {.param = w + o, .m = c->m + o, .v = c->v + o,
                           .grad = fy_tr_at(tr, c->grad_dev, o), .grad_dtype = fy_tr_dt(tr),
                           .param_out = out ? fy_tr_at(tr, out, o) : NULL,
                           .out_dtype = fy_tr_dt(tr), .n = len[k], .decay = k == 0};
        fy_k_adamw(&hp, &r, tr->s);
    }
    fy_stream_sync(tr->s);
}

/* d2h_param: arg = the fetch task whose slot holds the updated weights (and, with bf16
 * storage, their bf16 copy after them). */
static void run_d2h_param(void *ctx, const fy_task *t) {
    fy_trainer *tr = ctx;
    /* a skipped update wrote nothing: the host copies are current (with bf16 storage the
     * slot's second part holds stale bytes) */
    if (tr->stats[step_of(tr, t)].skipped) return;
    const fy_chunk *c = &tr->st->chunks[t->block];
    char *slot = (char *)param_unit(tr, t->arg);
    fy_copy_async(tr->s_d2h, c->param_host, slot, fy_tr_master_nbytes(tr, t->block), FY_D2H);
    if (fy_tr_lp(tr))
        fy_copy_async(tr->s_d2h, c->param_lp, slot + fy_tr_master_nbytes(tr, t->block),
                      fy_tr_nbytes(tr, t->block), FY_D2H);
    fy_stream_sync(tr->s_d2h);
}

static void run_adam_cpu(void *ctx, const fy_task *t) {
    fy_trainer *tr = ctx;
    if (tr->stats[step_of(tr, t)].skipped) return;
    const int b = t->block;
    const fy_chunk *c = &tr->st->chunks[b];
    fy_adam_hparams hp = hparams(tr, step_of(tr, t));
    size_t off[2], len[2];
    adam_ranges(tr, b, off, len);
    for (int k = 0; k < 2; k++) {
        if (!len[k]) continue;
        size_t o = off[k];
        fy_adam_range r = {.param = c->param_host + o, .m = c->m + o, .v = c->v + o,
                           .grad = fy_tr_at(tr, c->grad_host, o), .grad_dtype = fy_tr_dt(tr),
                           .param_out = fy_tr_lp(tr) ? fy_tr_at(tr, c->param_lp, o) : NULL,
                           .out_dtype = fy_tr_dt(tr), .n = len[k], .decay = k == 0};
        fy_status s = fy_adam_pool_step(tr->pool, &hp, &r);
        FY_ASSERT(s == FY_OK, "a cpu AdamW step without check_finite cannot fail");
    }
}

static void run_h2d_update(void *ctx, const fy_task *t) {
    fy_trainer *tr = ctx;
    const fy_chunk *c = &tr->st->chunks[t->block];
    fy_copy_async(tr->s_h2d, c->param_dev, c->param_lp, fy_tr_nbytes(tr, t->block), FY_H2D);
    fy_stream_sync(tr->s_h2d);
}

/* ---- the graph ---------------------------------------------------------------------- */

/* The (sum, count) of measured durations of tasks of this kind and block. */
static double *cost_slot(fy_trainer *tr, int kind, int block) {
    int nb = tr->lay.nblocks;
    int col = block >= 0 && block < nb ? block : nb;
    return tr->cost_ms + 2 * ((size_t)kind * (nb + 1) + col);
}

double fy_trainer_cost(const fy_trainer *tr, fy_task_kind kind, int block) {
    const double *c = cost_slot((fy_trainer *)tr, kind, block);
    return c[1] > 0 ? c[0] / c[1] : -1.0;
}

void fy_trainer_reset_costs(fy_trainer *tr) {
    memset(tr->cost_ms, 0, (size_t)FY_T_COUNT * (tr->lay.nblocks + 1) * 2 * sizeof *tr->cost_ms);
}

void fy_trainer_set_cost(fy_trainer *tr, fy_task_kind kind, int block, double ms) {
    double *c = cost_slot(tr, kind, block);
    c[0] = ms;
    c[1] = 1;
}

typedef struct builder {
    fy_trainer *tr;
    fy_graph *g;
    int ppool, gpool;
    int64_t pos;            /* next program position of a compute task */
    fy_status st;
} builder;

static int add(builder *bd, fy_lane lane, int kind, int block, int iter, fy_task_fn run) {
    fy_task t = fy_task_make(lane, kind, block, iter, run, bd->tr);
    if (lane == FY_LANE_COMPUTE) t.use_pos = bd->pos++;
    double *c = cost_slot(bd->tr, kind, block);
    if (c[1] > 0) t.cost_ms = c[0] / c[1];
    int id = fy_graph_add(bd->g, &t);
    if (id < 0) bd->st = FY_ERR_NOMEM;
    return id;
}

static void dep(builder *bd, int before, int after) {
    if (before < 0 || after < 0 || bd->st != FY_OK) return;
    fy_status s = fy_graph_dep(bd->g, before, after);
    if (s != FY_OK) bd->st = s;
}

/* A fetch of streamed block b's parameters after `ready`, or -1 if b is resident. */
static int fetch(builder *bd, int b, int iter, int ready) {
    if (!fy_tr_streamed(bd->tr, b)) return -1;
    int f = add(bd, FY_LANE_H2D, FY_T_H2D_PARAM, b, iter, run_h2d_param);
    if (f >= 0) bd->g->tasks[f].acquire_pool = bd->ppool;
    dep(bd, ready, f);
    return f;
}

/* At its end, `task` gives back the unit `holder` acquired (no-op for -1). */
static void releases(builder *bd, int task, int holder) {
    if (task < 0 || holder < 0) return;
    int *r = bd->g->tasks[task].release_of;
    for (int i = 0; i < 3; i++)
        if (r[i] < 0) { r[i] = holder; return; }
    FY_ASSERT(0, "a task releases at most three units");
}

/* Builds nsteps steps. ready[b]: the task after which block b's parameters are current
 * for the next use (-1 at the window's start). */
static fy_status build(fy_trainer *tr, fy_graph *g, int nsteps, bool barrier) {
    const int L = tr->cfg.model.layers, nb = L + 2, h = L + 1, A = accum(tr);
    builder bd = {.tr = tr, .g = g};
    fy_graph_init(g);
    g->kind_name = fy_task_kind_name;
    bd.ppool = fy_graph_pool(g, tr->st->nparam_slots);
    bd.gpool = fy_graph_pool(g, tr->st->ngrad_slots);
    int *ready = malloc((size_t)nb * sizeof *ready);
    int *last_bwd = malloc((size_t)nb * sizeof *last_bwd);   /* previous micro's bwd per block */
    int *final_grad = malloc((size_t)nb * sizeof *final_grad); /* task finishing b's gradient */
    int *last_d2h = malloc((size_t)nb * sizeof *last_d2h);
    if (!ready || !last_bwd || !final_grad || !last_d2h) {
        free(ready); free(last_bwd); free(final_grad); free(last_d2h);
        return FY_ERR_NOMEM;
    }
    for (int b = 0; b < nb; b++) ready[b] = last_bwd[b] = last_d2h[b] = -1;
    int shared_user = -1; /* last task that used the recompute buffer */
    int prev_norm = -1;
    int64_t m = 0;
    int load_war[2] = {-1, -1}, prev_load = -1;
    for (int t = 0; t < nsteps; t++) {
        int heads[FY_PLAN_MAX_ACCUM];
        for (int a = 0; a < A; a++, m++) {
            int load = add(&bd, FY_LANE_H2D, FY_T_LOAD, -1, (int)m, run_load);
            dep(&bd, load_war[m % 2], load);
            dep(&bd, prev_load, load); /* batches are read from the loader in order */
            prev_load = load;
            /* forward */
            int f = fetch(&bd, 0, (int)m, ready[0]);
            int fw = add(&bd, FY_LANE_COMPUTE, FY_T_FWD, 0, (int)m, run_fwd);
            if (fw >= 0) g->tasks[fw].arg = f;
            releases(&bd, fw, f);
            dep(&bd, f, fw); dep(&bd, load, fw); dep(&bd, ready[0], fw);
            dep(&bd, last_bwd[1], fw); /* x0 is reused: layer 0 of the last micro-batch read it */
            int prev = fw;
            for (int b = 1; b <= L; b++) {
                f = fetch(&bd, b, (int)m, ready[b]);
                int x = add(&bd, FY_LANE_COMPUTE, FY_T_FWD, b, (int)m, run_fwd);
                if (x >= 0) g->tasks[x].arg = f;
                releases(&bd, x, f);
                dep(&bd, f, x); dep(&bd, prev, x); dep(&bd, ready[b], x);
                dep(&bd, last_bwd[b], x); /* its activations are reused */
                if (tr->plan.blocks[b].acts == FY_ACTS_RECOMPUTE) { dep(&bd, shared_user, x); shared_user = x; }
                prev = x;
            }
            /* head: forward, loss and backward together (they need the same weights) */
            int gopen = -1;
            if (staged(tr, 0)) {
                gopen = add(&bd, FY_LANE_COMPUTE, FY_T_GOPEN, 0, (int)m, run_gopen);
                if (gopen >= 0) g->tasks[gopen].acquire_pool = bd.gpool;
                dep(&bd, prev, gopen);
            }
            tr->gopen_id[m] = gopen;
            int fh = fetch(&bd, h, (int)m, ready[h]), f0 = fetch(&bd, 0, (int)m, ready[0]);
            int hd = add(&bd, FY_LANE_COMPUTE, FY_T_HEAD, h, (int)m, run_head);
            if (hd >= 0) {
                g->tasks[hd].arg = fh;
                g->tasks[hd].arg2 = f0;
                if (staged(tr, h)) g->tasks[hd].acquire_pool = bd.gpool;
            }
            releases(&bd, hd, fh);
            releases(&bd, hd, f0);
            dep(&bd, fh, hd); dep(&bd, f0, hd); dep(&bd, prev, hd); dep(&bd, gopen, hd);
            dep(&bd, ready[h], hd); dep(&bd, ready[0], hd); dep(&bd, last_bwd[h], hd);
            heads[a] = hd;
            /* backward from the head down; each block's gradient then leaves its slot
             * (d2h for cpu blocks) or is closed on the device in the task itself */
            prev = hd;
            for (int b = h; b >= 0; b--) {
                int gt = hd;
                if (b < h) {
                    int fb = b ? fetch(&bd, b, (int)m, ready[b]) : -1;
                    int rc = -1;
                    if (b && tr->plan.blocks[b].acts == FY_ACTS_RECOMPUTE) {
                        rc = add(&bd, FY_LANE_COMPUTE, FY_T_RECOMPUTE, b, (int)m, run_fwd);
                        if (rc >= 0) g->tasks[rc].arg = fb;
                        dep(&bd, fb, rc); dep(&bd, prev, rc); dep(&bd, shared_user, rc);
                    }
                    gt = add(&bd, FY_LANE_COMPUTE, FY_T_BWD, b, (int)m, run_bwd);
                    if (gt >= 0) {
                        g->tasks[gt].arg = fb;
                        if (b && staged(tr, b)) g->tasks[gt].acquire_pool = bd.gpool;
                    }
                    releases(&bd, gt, fb);
                    dep(&bd, fb, gt); dep(&bd, rc, gt); dep(&bd, prev, gt);
                    if (rc >= 0) shared_user = gt;
                    prev = gt;
                }
                last_bwd[b] = gt;
                final_grad[b] = gt;
                if (!staged(tr, b)) continue;
                int holder = b == 0 ? gopen : gt; /* whose unit holds b's gradient */
                if (!fy_tr_cpu_optim(tr, b)) {
                    releases(&bd, gt, holder); /* closed into grad_dev inside gt */
                    continue;
                }
                int d = add(&bd, FY_LANE_D2H, FY_T_D2H_GRAD, b, (int)m, run_d2h_grad);
                if (d >= 0) g->tasks[d].arg = holder;
                releases(&bd, d, holder);
                dep(&bd, gt, d); dep(&bd, last_d2h[b], d); /* host adds in micro-batch order */
                last_d2h[b] = d;
                if (A > 1) final_grad[b] = d;
            }
            load_war[m % 2] = last_bwd[0];
        }
        /* norm, then every block's update */
        const int tm = t * A + A - 1; /* per-step tasks carry the step's last micro-batch */
        int nm = add(&bd, FY_LANE_CPU, FY_T_NORM, -1, tm, run_norm);
        for (int b = 0; b < nb; b++) {
            dep(&bd, final_grad[b], nm);
            dep(&bd, last_d2h[b], nm);
        }
        for (int a = 0; a < A; a++) dep(&bd, heads[a], nm);
        dep(&bd, prev_norm, nm);
        prev_norm = nm;
        /* updates, created in the order gradients complete (head, layers down, embedding):
         * fifo runs them so; priority reorders them by next use (block 0 first). They are
         * not program uses themselves: their priority is that of the next forward. */
        for (int b = nb - 1; b >= 0; b--) {
            if (fy_tr_cpu_optim(tr, b)) {
                int ad = add(&bd, FY_LANE_CPU, FY_T_ADAM_CPU, b, tm, run_adam_cpu);
                dep(&bd, barrier ? nm : -1, ad); dep(&bd, last_d2h[b], ad);
                ready[b] = ad;
                if (!fy_tr_streamed(tr, b)) {
                    int up = add(&bd, FY_LANE_H2D, FY_T_H2D_UPDATE, b, tm, run_h2d_update);
                    dep(&bd, ad, up);
                    ready[b] = up;
                }
            } else {
                int f = fetch(&bd, b, tm, ready[b]);
                if (f >= 0) { /* a fetch for the update: the master (4 bytes an element) */
                    g->tasks[f].arg2 = 1;
                    g->tasks[f].cost_ms *= 4.0 / (double)tr->st->es;
                }
                int ad = add(&bd, FY_LANE_COMPUTE, FY_T_ADAM_GPU, b, tm, run_adam_gpu);
                if (ad >= 0) {
                    g->tasks[ad].arg = f;
                    g->tasks[ad].use_pos = -1;
                }
                dep(&bd, f, ad); dep(&bd, barrier ? nm : -1, ad); dep(&bd, final_grad[b], ad);
                ready[b] = ad;
                if (f >= 0) {
                    int d = add(&bd, FY_LANE_D2H, FY_T_D2H_PARAM, b, tm, run_d2h_param);
                    if (d >= 0) g->tasks[d].arg = f;
                    releases(&bd, d, f);
                    dep(&bd, ad, d);
                    ready[b] = d;
                }
            }
        }
    }
    free(ready); free(last_bwd); free(final_grad); free(last_d2h);
    if (bd.st != FY_OK) return bd.st;
    return fy_graph_prioritize(g);
}

/* ---- running a window ---------------------------------------------------------------- */

static fy_status window_begin(fy_trainer *tr, int nsteps, const float *lrs, fy_step_stats *stats) {
    tr->adam_step = calloc((size_t)nsteps, sizeof *tr->adam_step);
    tr->gopen_id = calloc((size_t)nsteps * accum(tr), sizeof *tr->gopen_id);
    if (!tr->adam_step || !tr->gopen_id) {
        free(tr->adam_step);
        free(tr->gopen_id);
        return FY_ERR_NOMEM;
    }
    tr->lrs = lrs;
    tr->stats = stats;
    memset(stats, 0, (size_t)nsteps * sizeof *stats);
    return FY_OK;
}

static void window_end(fy_trainer *tr) {
    free(tr->adam_step);
    free(tr->gopen_id);
    tr->adam_step = NULL;
    tr->gopen_id = NULL;
    tr->graph = NULL;
}

/* Step times from the records: a step ends with its last task. */
static void step_times(const fy_trainer *tr, const fy_graph *g, const fy_sched_result *r,
                       int nsteps, fy_step_stats *stats) {
    double *end = calloc((size_t)nsteps, sizeof *end);
    if (!end) return;
    for (int i = 0; i < r->nrecs; i++) {
        int s = g->tasks[r->recs[i].task].iter / accum(tr);
        if (s >= 0 && s < nsteps && r->recs[i].end_ms > end[s]) end[s] = r->recs[i].end_ms;
    }
    double prev = 0.0;
    for (int s = 0; s < nsteps; s++) {
        if (end[s] < prev) end[s] = prev;
        stats[s].step_ms = end[s] - prev;
        prev = end[s];
    }
    free(end);
}

fy_status fy_trainer_run(fy_trainer *tr, int nsteps, const float *lrs, fy_batch_fn next_batch,
                         void *ctx, fy_step_stats *stats, fy_sched_result *trace,
                         fy_graph *graph_out) {
    if (nsteps <= 0) return FY_OK;
    FY_ASSERT(!tr->cfg.eval_only, "an evaluation-only trainer cannot train");
    FY_TRY(window_begin(tr, nsteps, lrs, stats));
    tr->next_batch = next_batch;
    tr->batch_ctx = ctx;
    fy_graph g;
    fy_status st = build(tr, &g, nsteps, true);
    fy_sched_result res = {0};
    if (st == FY_OK) {
        tr->graph = &g;
        st = fy_sched_execute(&g, tr->cfg.schedule, &res);
    }
    if (st == FY_OK) {
        step_times(tr, &g, &res, nsteps, stats);
        for (int i = 0; i < res.nrecs; i++) {
            const fy_task *t = &g.tasks[res.recs[i].task];
            double *c = cost_slot(tr, t->kind, t->block);
            c[0] += res.recs[i].end_ms - res.recs[i].start_ms;
            c[1] += 1;
        }
        tr->micro_base += (int64_t)nsteps * accum(tr);
    }
    window_end(tr);
    if (trace && graph_out && st == FY_OK) {
        *trace = res;
        *graph_out = g;
    } else {
        fy_sched_result_free(&res);
        fy_graph_free(&g);
    }
    return st;
}

fy_status fy_trainer_predict(fy_trainer *tr, int nsteps, fy_sched_mode mode, bool norm_barrier,
                             fy_sched_result *out) {
    fy_step_stats *stats = calloc((size_t)nsteps, sizeof *stats);
    float *lrs = calloc((size_t)nsteps, sizeof *lrs);
    if (!stats || !lrs) { free(stats); free(lrs); return FY_ERR_NOMEM; }
    fy_status st = window_begin(tr, nsteps, lrs, stats);
    fy_graph g;
    if (st == FY_OK) {
        st = build(tr, &g, nsteps, norm_barrier);
        if (st == FY_OK) st = fy_sched_simulate(&g, mode, out);
        fy_graph_free(&g);
        window_end(tr);
    }
    free(stats);
    free(lrs);
    return st;
}

typedef struct arrays { const int32_t *x, *y; size_t N; int64_t base; } arrays;

static void from_arrays(void *ctx, int64_t micro, int32_t *x, int32_t *y) {
    const arrays *a = ctx;
    size_t off = (size_t)(micro - a->base) * a->N;
    memcpy(x, a->x + off, a->N * sizeof(int32_t));
    memcpy(y, a->y + off, a->N * sizeof(int32_t));
}

fy_status fy_trainer_step(fy_trainer *tr, const int32_t *x, const int32_t *y, float lr,
                          fy_step_stats *out) {
    arrays a = {x, y, (size_t)tr->plan.micro_batch * tr->cfg.T, tr->micro_base};
    fy_status st = fy_trainer_run(tr, 1, &lr, from_arrays, &a, out, NULL, NULL);
    if (st == FY_OK && out->skipped)
        fy_log_warn("step %lld: gradient norm is %g; update skipped",
                    (long long)tr->steps_done + 1, out->grad_norm);
    return st;
}
