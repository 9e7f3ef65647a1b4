/* tune.c — the cost model and the exhaustive search over AutoHete's plan space. */
#include "tuner/tune.h"

#include "engine/core/util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static double xfer_ms(double nbytes, double gbps, double latency_ms) {
    return nbytes / (gbps * 1e9) * 1e3 + latency_ms;
}

/* What the cost rules read: the profile, the layout, whether the profile's measured
 * block costs are for this model, and CPU AdamW's throughput (params/s). */
typedef struct costing {
    const fy_profile *p;
    const fy_layout *L;
    bool measured;
    double adam, es;
} costing;

/* Analytic device cost of kind on block b: the model's matmul FLOPs for the pass at the
 * effective throughput plus its memory traffic at the device's bandwidth, with
 * parameters, gradients and activations of es bytes (the storage type). Zeroing a
 * gradient slot moves it once; AdamW moves 28 bytes an element either way: fp32
 * weights, m and v read and written (24) plus the gradient in and, with bf16 storage,
 * the bf16 copy out (4 for fp32 storage, 2 + 2 for bf16). */
static double analytic_ms(const costing *c, int kind, int b) {
    const fy_profile *p = c->p;
    const fy_model *m = c->L->model;
    const int B = c->L->B, T = c->L->T;
    const double es = c->es, P = (double)fy_model_block(m, b)->nelem;
    const double flop_s = p->compute_tflops * 1e12, byte_s = p->device_mem_gbps * 1e9;
    fy_cost cost;
    switch (kind) {
    case FY_T_FWD:
    case FY_T_RECOMPUTE: fy_model_cost(m, b, FY_PASS_FWD, B, T, es, &cost); break;
    case FY_T_BWD: fy_model_cost(m, b, FY_PASS_BWD, B, T, es, &cost); break;
    case FY_T_HEAD: fy_model_cost(m, b, FY_PASS_LOSS, B, T, es, &cost); break;
    case FY_T_GRAD_ZERO: return 1e3 * es * P / byte_s;
    case FY_T_ADAM_GPU: return 1e3 * 28.0 * P / byte_s;
    default: return 0.0;
    }
    return 1e3 * (cost.flops / flop_s + cost.bytes / byte_s);
}

/* The rules, one per cost column of the kinds' table (engine/tasks.h): a task's duration
 * in ms, or NAN where the rule does not price the kind on that block (block -1: the
 * tasks of no block). Transfers move the storage type's copies. */
static double block_nbytes(const costing *c, int b) {
    return (double)c->L->blocks[b].nelem * c->es;
}
/* The elements of a block's update, and their share of it: a job's rank updates its
 * shard only (layout.h). */
static double own_of(const costing *c, int b) {
    return (double)(c->L->blocks[b].hi - c->L->blocks[b].lo);
}
static double share_of(const costing *c, int b) {
    const double P = (double)c->L->blocks[b].nelem;
    return P > 0 ? own_of(c, b) / P : 1.0;
}
static double stage_of(const costing *c, int b) {
    return (double)c->L->blocks[b].stage_nelem * c->es;
}

static double cost_tokens(const costing *c, fy_task_kind k, int b) {
    return b < 0 ? xfer_ms(8.0 * c->L->B * c->L->T, c->p->h2d_gbps, c->p->latency_ms) : NAN;
}

/* The norm (a sum over the blocks), and a commit that swaps a speculative block's sides
 * (the prediction assumes speculation holds: a step that clips or is skipped redoes
 * its speculated updates after the norm, step_build.h). */
static double cost_fixed(const costing *c, fy_task_kind k, int b) {
    if (k == FY_T_NORM) return b < 0 ? 0.01 : NAN;
    return k == FY_T_COMMIT && b >= 0 ? 0.01 : NAN;
}

/* A fetch moves the block's staged copy (a row-staged block its micro-batch's rows, at
 * most B*T of them; a chunked head a chunk). A device update's fetch of a bf16 block's
 * master is priced from it by its bytes (step_build.h). */
static double cost_fetch(const costing *c, fy_task_kind k, int b) {
    return b < 0 ? NAN : xfer_ms(stage_of(c, b), c->p->h2d_gbps, c->p->latency_ms);
}

static double cost_send(const costing *c, fy_task_kind k, int b) {
    return b < 0 ? NAN : xfer_ms(block_nbytes(c, b), c->p->h2d_gbps, c->p->latency_ms);
}

/* A gradient to the host; the host then zeroes, scatters into and sums a row-staged
 * block's whole gradient once a step, two passes where AdamW makes about eight; a
 * chunked head's chunks land on the host and the last takes the whole gradient's norm
 * (the same pass, spread over its K copies). */
static double cost_grad_out(const costing *c, fy_task_kind k, int b) {
    if (b < 0) return NAN;
    const fy_block_layout *bl = &c->L->blocks[b];
    const double P = (double)bl->nelem;
    const double host_pass = c->adam > 0 ? P / c->adam * 1e3 / 4.0 : 0.0;
    const double scatter = bl->staging == FY_STAGE_ROWS ? host_pass / c->L->accum
                         : bl->staging == FY_STAGE_CHUNKS ? host_pass / 2.0 / c->L->head_chunks.n
                                                          : 0.0;
    return xfer_ms(stage_of(c, b), c->p->d2h_gbps, c->p->latency_ms) + scatter;
}

/* A streamed device update's return: its shard's copy and, with bf16 storage, its fp32
 * master. */
static double cost_master_out(const costing *c, fy_task_kind k, int b) {
    if (b < 0) return NAN;
    const double nb = block_nbytes(c, b), P = (double)c->L->blocks[b].nelem;
    const double back = (c->es == 4.0 ? nb : nb + P * 4.0) * share_of(c, b);
    return xfer_ms(back, c->p->d2h_gbps, c->p->latency_ms);
}

static double cost_host_adam(const costing *c, fy_task_kind k, int b) {
    if (b < 0) return NAN;
    return c->adam > 0 ? own_of(c, b) / c->adam * 1e3 : 1e9;
}

/* Device work: the profile's measured block cost (a + b * micro-batch) when it is for
 * this model, else the analytic one; a rank's AdamW on its share; a chunked head's loss
 * pass by K chunks: K head tasks, a forward each (a third of a chunk's share of the
 * pass) and the last also its backward (two thirds), priced at their mean, (K + 2) /
 * (3K) of the pass over K tasks; then K - 1 backward tasks (recompute and backward: a
 * chunk's whole share). */
static double device_ms(const costing *c, fy_task_kind k, int b) {
    const fy_profile *p = c->p;
    const fy_block_kind bk = fy_model_block(c->L->model, b)->kind;
    double ms;
    if (c->measured && (p->block_a[k][bk] != 0 || p->block_b[k][bk] != 0))
        ms = p->block_a[k][bk] + p->block_b[k][bk] * c->L->B;
    else
        ms = analytic_ms(c, k, b);
    if (k == FY_T_ADAM_GPU) ms *= share_of(c, b);
    return ms > 0 ? ms : 0.0;
}

static double cost_device(const costing *c, fy_task_kind k, int b) {
    if (b < 0) return NAN;
    if (c->L->blocks[b].staging != FY_STAGE_CHUNKS || (k != FY_T_HEAD && k != FY_T_BWD))
        return device_ms(c, k, b);
    const double loss = device_ms(c, FY_T_HEAD, b), K = c->L->head_chunks.n;
    return k == FY_T_HEAD ? loss * (K + 2.0) / (3.0 * K * K) : loss / K;
}

/* A job's collectives: each rank moves (N-1)/N of the block, over the device's
 * collectives where the buffer is device memory, else over MPI in host memory (a
 * cpu-updated block's gradient; its weights and a streamed block's), where the reduce
 * also takes its shard's chunk sums (a pass of the host). */
static double cost_collective(const costing *c, fy_task_kind k, int b) {
    if (b < 0 || c->L->world <= 1) return NAN;
    const fy_profile *p = c->p;
    const double N = c->L->world, moved = block_nbytes(c, b) * (N - 1.0) / N;
    const bool grad_host = fy_layout_state(c->L, b, FY_STATE_GRAD)->tier != FY_TIER_DEVICE;
    const bool weights_host = fy_layout_updated_weights(c->L, b) == FY_STATE_HOST_WEIGHTS;
    const double dev_ms = p->coll_gbps > 0 ? xfer_ms(moved, p->coll_gbps, p->coll_latency_ms) : 1e9;
    const double host_ms = p->coll_host_gbps > 0
                               ? xfer_ms(moved, p->coll_host_gbps, p->coll_host_latency_ms) : 1e9;
    const double parts = c->adam > 0 ? own_of(c, b) / c->adam * 1e3 / 4.0 : 0.0;
    if (k == FY_T_REDUCE) return grad_host ? host_ms + parts : dev_ms;
    return weights_host ? host_ms : dev_ms;
}

/* The disk tier: a disk block's shard of master and moments read and written once a
 * step at the profile's sequential rates (costs are per shard; each chunk's task takes
 * its share, step_build.h); not known (not probed): prohibitive. */
static double disk_ms(const costing *c, int b, double gbps) {
    if (b < 0 || !c->L->blocks[b].disk_chunks) return NAN;
    const double bytes = FY_DISK_STATES * own_of(c, b) * sizeof(float);
    return gbps > 0 ? xfer_ms(bytes, gbps, 0.0) : 1e9;
}
static double cost_disk_in(const costing *c, fy_task_kind k, int b) { return disk_ms(c, b, c->p->disk_read_gbps); }
static double cost_disk_out(const costing *c, fy_task_kind k, int b) { return disk_ms(c, b, c->p->disk_write_gbps); }

/* An offloaded layer's input (the previous block's output) to the host and back. */
static double cost_act_copy(const costing *c, fy_task_kind k, int b) {
    if (b <= 0 || !c->L->blocks[b].offload_in) return NAN;
    const double nbytes = (double)c->L->blocks[b - 1].out_nbytes;
    return xfer_ms(nbytes, k == FY_T_D2H_ACT ? c->p->d2h_gbps : c->p->h2d_gbps, c->p->latency_ms);
}

typedef double (*cost_rule)(const costing *c, fy_task_kind k, int b);
#define X_RULE(id, name, lane, cost) [FY_T_##id] = cost_##cost,
static const cost_rule rules[FY_T_COUNT] = {FY_TASK_KINDS(X_RULE)};
#undef X_RULE

void fy_tune_costs(const fy_profile *p, const fy_layout *L, int adam_threads, fy_cost_table *out) {
    char sig[256];
    fy_model_signature(L->model, sig, sizeof sig);
    const costing c = {.p = p, .L = L, .es = (double)L->es,
                       .measured = p->has_blocks && p->block_seq == L->T && p->block_dtype == L->dtype &&
                                   !strcmp(p->block_model, sig),
                       .adam = fy_profile_adam_gparams(p, adam_threads) * 1e9};
    for (int k = 0; k < FY_T_COUNT; k++)
        for (int b = -1; b < L->nblocks; b++) {
            const double ms = rules[k](&c, (fy_task_kind)k, b);
            if (!isnan(ms)) fy_cost_set(out, (fy_task_kind)k, b, ms);
        }
}

/* The layout of plan for the tuner's job (alone, or a rank of cfg->ranks: each block's
 * largest shard, the most any rank holds), into L (made before, or zeroed: its table is
 * reused). */
static fy_status plan_layout(const fy_tune_cfg *cfg, const fy_plan *plan, fy_layout *L) {
    return fy_layout_renew(cfg->model, plan, cfg->seq, true, cfg->ranks > 1 ? cfg->ranks : 1, -1, L);
}

/* The training graph of nsteps under plan, priced by the profile. */
static fy_status priced_graph(const fy_profile *p, const fy_tune_cfg *cfg, const fy_layout *L,
                              int nsteps, fy_step_graph *sg) {
    fy_cost_table costs;
    FY_TRY(fy_cost_table_init(&costs, L->nblocks));
    fy_tune_costs(p, L, cfg->adam_threads, &costs);
    fy_status st = fy_step_build_train(L, nsteps, true, sg);
    if (st == FY_OK) fy_step_graph_price(sg, L, &costs);
    fy_cost_table_free(&costs);
    return st;
}

/* Plan simulated over cfg->window steps: its prediction into out, and with `trace`, the
 * simulated run as a Chrome trace there. */
static fy_status simulate(const fy_profile *p, const fy_tune_cfg *cfg, const fy_plan *plan,
                          const char *trace, fy_tune_result *out) {
    memset(out, 0, sizeof *out);
    fy_layout L = {0};
    FY_TRY(plan_layout(cfg, plan, &L));
    fy_layout_memory(&L, SIZE_MAX, &out->mem);
    const int w = cfg->window > 0 ? cfg->window : 20;
    fy_step_graph sg;
    fy_sched_result r;
    fy_status st = priced_graph(p, cfg, &L, w, &sg);
    if (st == FY_OK) {
        st = fy_sched_simulate(&sg.g, cfg->schedule, &r);
        if (st == FY_OK && trace &&
            (st = fy_sched_write_trace(&sg.g, &r, trace, "ferry tune (simulated)")) != FY_OK)
            fy_sched_result_free(&r);
        fy_step_graph_free(&sg);
    }
    if (st == FY_OK) {
        out->step_ms = r.makespan_ms / w;
        for (int l = 0; l < FY_LANE_COUNT; l++) out->busy_ms[l] = r.busy_ms[l] / w;
        fy_sched_result_free(&r);
        st = fy_plan_copy(plan, &out->plan);
    }
    fy_layout_free(&L);
    return st;
}

fy_status fy_tune_predict(const fy_profile *p, const fy_tune_cfg *cfg, const fy_plan *plan,
                          fy_tune_result *out) {
    return simulate(p, cfg, plan, NULL, out);
}

fy_status fy_tune_trace(const fy_profile *p, const fy_tune_cfg *cfg, const fy_plan *plan,
                        const char *path) {
    fy_tune_result r;
    FY_TRY(simulate(p, cfg, plan, path, &r));
    fy_plan_free(&r.plan);
    return FY_OK;
}

/* Tokens per millisecond: the objective (micro-batch and accumulation vary, the batch
 * does not, so step time alone would do; this keeps the comparison explicit). */
static double throughput(const fy_tune_cfg *cfg, const fy_tune_result *r) {
    return (double)cfg->batch * cfg->seq / r->step_ms;
}

double fy_tune_offload_ms(const fy_tune_result *r) {
    return r->busy_ms[FY_LANE_H2D] + r->busy_ms[FY_LANE_D2H] + r->busy_ms[FY_LANE_CPU];
}

int fy_tune_pick(const fy_tune_result *r, int n, double margin) {
    int fastest = 0;
    for (int i = 1; i < n; i++) if (r[i].step_ms < r[fastest].step_ms) fastest = i;
    int pick = fastest;
    for (int i = 0; i < n; i++)
        if (r[i].step_ms <= r[fastest].step_ms * (1.0 + margin) &&
            fy_tune_offload_ms(&r[i]) < fy_tune_offload_ms(&r[pick]))
            pick = i;
    return pick;
}

#define TUNE_KEEP 64 /* candidates kept for the tie-break */

/* A point of the search space: micro-batch, recomputed (k1), streamed (k2) and
 * cpu-optimised (k3) layers, and of the cpu updates those among the last k4 layers
 * speculative (k4 = L: the embedding's and head's too); lb: its busiest lane's work in a
 * step (ms), which bounds its step time from below; ntasks: its step graph's tasks. */
typedef struct cand { int micro, k1, k2, k3, k4, k5, k6; double lb; int ntasks; } cand;

#define FY_TUNE_MAX_PREFETCH 3

static fy_status point_plan(const fy_tune_cfg *cfg, const cand *c, fy_plan *out) {
    const int L = fy_model_layers(cfg->model);
    FY_TRY(fy_plan_new(cfg->model, c->micro, cfg->batch / c->micro, out));
    out->dtype = cfg->dtype == FY_BF16 ? FY_BF16 : FY_F32;
    fy_status st = fy_plan_shorthands(out, L ? (double)c->k2 / L : 0, L ? (double)c->k3 / L : 0, c->k1);
    if (st == FY_OK) st = fy_plan_speculate(out, L ? (double)c->k4 / L : 0);
    if (st == FY_OK && c->k6) st = fy_plan_offload_acts(out, L ? (double)c->k6 / L : 0);
    if (st == FY_OK && c->k5) st = fy_plan_disk(out, L ? (double)c->k5 / L : 0);
    if (st != FY_OK) fy_plan_free(out);
    return st;
}

/* A point's memory model, through the search's layout L. */
static fy_status point_mem(const fy_tune_cfg *cfg, const cand *c, fy_layout *L, fy_mem_model *mm) {
    fy_plan plan;
    FY_TRY(point_plan(cfg, c, &plan));
    fy_status st = plan_layout(cfg, &plan, L);
    if (st == FY_OK) fy_layout_memory(L, SIZE_MAX, mm);
    fy_plan_free(&plan);
    return st;
}

typedef struct cands { cand *v; int n, cap; } cands;

static fy_status push(cands *cs, cand c) {
    if (cs->n == cs->cap) {
        int ncap = cs->cap ? 2 * cs->cap : 256;
        cand *v = realloc(cs->v, (size_t)ncap * sizeof *v);
        if (!v) return FY_ERR_NOMEM;
        cs->v = v;
        cs->cap = ncap;
    }
    cs->v[cs->n++] = c;
    return FY_OK;
}

/* The least count a point's field *k in [0, hi] takes for its memory to fit
 * (fits(mm) true); the memory shrinks as it grows. false: not even hi fits. */
static fy_status least_fitting(const fy_tune_cfg *cfg, fy_layout *lay, cand *c, int *k, int hi,
                               bool (*fits)(const fy_tune_cfg *, const fy_mem_model *), bool *ok) {
    fy_mem_model mm;
    *k = hi;
    FY_TRY(point_mem(cfg, c, lay, &mm));
    if (!(*ok = fits(cfg, &mm))) return FY_OK;
    int lo = 0;
    while (lo < hi) {
        *k = lo + (hi - lo) / 2;
        FY_TRY(point_mem(cfg, c, lay, &mm));
        if (fits(cfg, &mm)) hi = *k;
        else lo = *k + 1;
    }
    *k = hi;
    return FY_OK;
}
static bool host_fits(const fy_tune_cfg *cfg, const fy_mem_model *mm) {
    return (!cfg->host_budget || mm->host_total <= cfg->host_budget) && mm->disk_total <= cfg->disk_budget;
}
static bool device_fits(const fy_tune_cfg *cfg, const fy_mem_model *mm) {
    return mm->device_total <= cfg->device_budget && host_fits(cfg, mm);
}

/* The memory frontier. The memory model is monotone in the counts: device memory falls
 * as k1, k2 or k3 grows, host memory grows with k2 and k3 and does not depend on k1. A
 * point that offloads at least as much as another in every count is not faster (more
 * recomputation, more transfers), so for each micro-batch and k3 (the cpu optimizer can
 * hide under compute, so k3 has no such order) only the staircase of fitting points
 * where more streaming buys less recomputation is kept: walking k2 up, the least k1 that
 * fits, kept when it is less than the last kept one. Each (micro, k3) costs O(L) memory
 * models. With `any`, only whether a point fits: it stops at the first, trying first
 * micro-batch 1 (the least device memory) and the whole batch (no accumulation: the least
 * host memory with bf16 storage, whose gradients then share the weights' buffers). With
 * a disk budget, a point over the host budget keeps the fewest of its cpu-updated
 * layers' state on disk that fits (k5); the all-streamed point over the device budget
 * offloads the fewest layers' inputs that fit (k6; they then recompute whatever k1 says). */
static fy_status frontier_micro(const fy_tune_cfg *cfg, int micro, bool any, fy_layout *lay,
                                cands *out) {
    const int L = fy_model_layers(cfg->model);
    const size_t dev = cfg->device_budget, host = cfg->host_budget ? cfg->host_budget : SIZE_MAX;
    for (int k3 = 0; k3 <= L; k3++) {
        int k1 = L, last_k1 = L + 1;
        /* the least device memory this k3 allows, every layer recomputed and its input
         * offloaded, streaming all (or none: the staging ring can outweigh a small model's
         * resident layers): over the budget, no point of it fits (with a disk budget many
         * k3 are, and each would cost L points) */
        fy_mem_model all, none;
        FY_TRY(point_mem(cfg, &(cand){.micro = micro, .k1 = L, .k2 = L, .k3 = k3, .k6 = L}, lay, &all));
        FY_TRY(point_mem(cfg, &(cand){.micro = micro, .k1 = L, .k2 = 0, .k3 = k3, .k6 = L}, lay, &none));
        if (all.device_total > dev && none.device_total > dev) continue;
        /* k2 up from 0; with `any`, k2 = L (the least device memory) first */
        for (int i = any ? -1 : 0; i <= L; i++) {
            const int k2 = i < 0 ? L : i;
            fy_mem_model mm;
            cand c = {micro, k1, k2, k3, 0, 0, 0, 0, 0};
            FY_TRY(point_mem(cfg, &c, lay, &mm));
            bool ok = mm.host_total <= host;
            if (!ok && cfg->disk_budget && k3) /* the fewest cpu-updated layers on disk */
                FY_TRY(least_fitting(cfg, lay, &c, &c.k5, k3, host_fits, &ok));
            if (!ok) {
                if (i < 0) continue;
                /* more cpu optimizer: more host memory, unless more of it can go to disk */
                if (k2 == 0 && !cfg->disk_budget) return FY_OK;
                break;                     /* more streaming: more host memory */
            }
            if (c.k5) FY_TRY(point_mem(cfg, &c, lay, &mm)); /* with its state on disk */
            if (mm.device_total > dev && k2 == L) /* the fewest layers' inputs on the host */
                FY_TRY(least_fitting(cfg, lay, &c, &c.k6, L, device_fits, &ok));
            else ok = mm.device_total <= dev;
            if (!ok) continue;
            if (any) return push(out, c); /* whether one fits: this one does */
            for (; c.k1 > 0; c.k1--) { /* the least recomputation that still fits */
                cand d = c;
                d.k1--;
                FY_TRY(point_mem(cfg, &d, lay, &mm));
                if (mm.device_total > dev) break;
            }
            k1 = c.k1;
            if (k1 < last_k1) {
                FY_TRY(push(out, c));
                if (any) return FY_OK;
                last_k1 = k1;
            }
            if (k1 == 0) break; /* more streaming from here on only adds transfers */
        }
    }
    return FY_OK;
}

/* Speculation (plan.h) costs host memory only and lets the CPU's updates start during
 * the backward: each frontier point is also tried speculating as many cpu updates as the
 * host budget allows, the last k4 layers' (their gradients reach the host first; host
 * memory grows with k4). It is not always faster (a commit is one more task on the cpu
 * lane, which a small model's step feels), so both are simulated. Not in a job. */
static fy_status most_speculation(const fy_tune_cfg *cfg, fy_layout *lay, cand *c) {
    size_t host = cfg->host_budget ? cfg->host_budget : SIZE_MAX;
    if (cfg->spec_host_cap && cfg->spec_host_cap < host) host = cfg->spec_host_cap;
    c->k4 = 0;
    if (cfg->ranks > 1 || c->k3 == 0 || c->k5) return FY_OK; /* disk: host memory is short */
    int lo = 0, hi = c->k3; /* the cpu-updated layers are the last k3 */
    while (lo < hi) {
        cand d = *c;
        d.k4 = lo + (hi - lo + 1) / 2;
        fy_mem_model mm;
        FY_TRY(point_mem(cfg, &d, lay, &mm));
        if (mm.host_total <= host) lo = d.k4;
        else hi = d.k4 - 1;
    }
    c->k4 = lo;
    return FY_OK;
}

static fy_status frontier(const fy_tune_cfg *cfg, bool any, fy_layout *lay, cands *out) {
    /* micro-batch 1 and the whole batch first, then the other divisors */
    for (int pass = 0; pass < 2; pass++)
        for (int micro = 1; micro <= cfg->batch; micro++) {
            const bool ends = micro == 1 || micro == cfg->batch;
            if (cfg->batch % micro || ends != (pass == 0) || (cfg->micro && micro != cfg->micro))
                continue;
            FY_TRY(frontier_micro(cfg, micro, any, lay, out));
            if (any && out->n) return FY_OK;
        }
    return FY_OK;
}

/* The window simulated for a plan: cfg->window steps, fewer for large graphs (the
 * prediction is the steady state, reached after the first step or two; 20000 tasks keep
 * one simulation within ~10 ms), at least 4. */
static int window_for(const fy_tune_cfg *cfg, int tasks_per_step) {
    const int w = cfg->window > 0 ? cfg->window : 20;
    const int fit = tasks_per_step > 0 ? 20000 / tasks_per_step : w;
    if (fit >= w) return w;
    return fit > 4 ? fit : (w < 4 ? w : 4);
}

static fy_status lower_bound(const fy_profile *p, const fy_tune_cfg *cfg, fy_layout *lay, cand *c) {
    fy_plan plan;
    FY_TRY(point_plan(cfg, c, &plan));
    fy_step_graph sg;
    fy_status st = plan_layout(cfg, &plan, lay);
    if (st == FY_OK) st = priced_graph(p, cfg, lay, 1, &sg);
    if (st == FY_OK) {
        double busy[FY_LANE_COUNT];
        fy_step_graph_busy(&sg, busy);
        c->ntasks = sg.g.n;
        c->lb = 0.0;
        for (int l = 0; l < FY_LANE_COUNT; l++) if (busy[l] > c->lb) c->lb = busy[l];
        fy_step_graph_free(&sg);
    }
    fy_plan_free(&plan);
    return st;
}

static int by_lb(const void *a, const void *b) {
    const cand *x = a, *y = b;
    return (x->lb > y->lb) - (x->lb < y->lb);
}

/* Inserts r into top (fastest first, at most ntop; r is freed if it does not enter). */
static void keep_top(const fy_tune_cfg *cfg, fy_tune_result *top, int ntop, int *nfound,
                     fy_tune_result *r) {
    int pos = *nfound < ntop ? *nfound : ntop;
    while (pos > 0 && throughput(cfg, r) > throughput(cfg, &top[pos - 1])) pos--;
    if (pos >= ntop) { fy_plan_free(&r->plan); return; }
    if (*nfound == ntop) fy_plan_free(&top[ntop - 1].plan);
    else (*nfound)++;
    memmove(&top[pos + 1], &top[pos], (size_t)(*nfound - 1 - pos) * sizeof *top);
    top[pos] = *r;
}

/* When nothing fits, one error naming the budget and the least it would take: the host's
 * floor is the all-resident plan's (host memory grows with k2 and k3), the device's is
 * everything offloaded at micro-batch 1; when each alone can be met, the least host
 * memory of a plan within the device budget (per micro-batch and k3, the least streaming
 * that fits the device with every layer recomputed). */
static fy_status no_plan_fits(const fy_tune_cfg *cfg, fy_layout *lay) {
    const int L = fy_model_layers(cfg->model);
    char a[32], b[32], c[32];
    fy_mem_model mm;
    size_t host_floor = SIZE_MAX, host_fit = SIZE_MAX;
    for (int micro = 1; micro <= cfg->batch; micro++) {
        if (cfg->batch % micro || (cfg->micro && micro != cfg->micro)) continue;
        FY_TRY(point_mem(cfg, &(cand){.micro = micro}, lay, &mm));
        if (mm.host_total < host_floor) host_floor = mm.host_total;
    }
    FY_TRY(point_mem(cfg, &(cand){.micro = cfg->micro ? cfg->micro : 1, .k1 = L, .k2 = L, .k3 = L}, lay, &mm));
    const size_t dev_floor = mm.device_total;
    if (cfg->host_budget && host_floor > cfg->host_budget) {
        fy_log_error("no plan fits the host budget: the smallest needs %s of host memory, the "
                     "budget (--host-mem) is %s", fy_fmt_size(host_floor, a, sizeof a),
                     fy_fmt_size(cfg->host_budget, b, sizeof b));
        return FY_ERR_INVALID;
    }
    if (dev_floor > cfg->device_budget) {
        fy_log_error("no plan fits the device budget: the smallest needs %s of device memory, "
                     "the budget is %s", fy_fmt_size(dev_floor, a, sizeof a),
                     fy_fmt_size(cfg->device_budget, b, sizeof b));
        return FY_ERR_INVALID;
    }
    for (int micro = 1; micro <= cfg->batch; micro++) {
        if (cfg->batch % micro || (cfg->micro && micro != cfg->micro)) continue;
        for (int k3 = 0; k3 <= L; k3++)
            for (int k2 = 0; k2 <= L; k2++) {
                FY_TRY(point_mem(cfg, &(cand){.micro = micro, .k1 = L, .k2 = k2, .k3 = k3}, lay, &mm));
                if (mm.device_total > cfg->device_budget) continue;
                if (mm.host_total < host_fit) host_fit = mm.host_total;
                break;
            }
    }
    fy_log_error("no plan fits both budgets: within the device budget of %s, the smallest needs "
                 "%s of host memory; the host budget (--host-mem) is %s",
                 fy_fmt_size(cfg->device_budget, a, sizeof a), fy_fmt_size(host_fit, b, sizeof b),
                 fy_fmt_size(cfg->host_budget, c, sizeof c));
    return FY_ERR_INVALID;
}

/* Point c simulated at the least prefetch depth, and, when that is within the tie
 * margin of the best so far, at deeper ones while the device budget allows and each
 * is faster (a deeper layer ring lets streamed layers' fetches run further ahead): the
 * fastest into r. */
static fy_status predict_prefetch(const fy_profile *p, const fy_tune_cfg *cfg, const cand *c,
                                  double best, fy_layout *lay, fy_tune_result *r, int *nevaluated) {
    fy_tune_cfg wc = *cfg;
    wc.window = window_for(cfg, c->ntasks);
    bool have = false;
    for (int pf = 1; pf <= FY_TUNE_MAX_PREFETCH; pf++) {
        fy_plan plan;
        FY_TRY(point_plan(cfg, c, &plan));
        plan.prefetch = pf;
        fy_status st = FY_OK;
        if (pf > 1) { /* the frontier's points fit at the least depth */
            fy_mem_model mm;
            st = plan_layout(cfg, &plan, lay);
            if (st == FY_OK) fy_layout_memory(lay, SIZE_MAX, &mm);
            if (st != FY_OK || mm.device_total > cfg->device_budget) {
                fy_plan_free(&plan);
                return st;
            }
        }
        fy_tune_result t;
        st = fy_tune_predict(p, &wc, &plan, &t);
        fy_plan_free(&plan);
        FY_TRY(st);
        (*nevaluated)++;
        if (have && !(t.step_ms < r->step_ms * 0.995)) { /* no better: the shallower */
            fy_plan_free(&t.plan);
            return FY_OK;
        }
        if (have) fy_plan_free(&r->plan);
        *r = t;
        have = true;
        if (r->step_ms > best * (1.0 + cfg->tie_margin)) return FY_OK; /* not a contender */
    }
    return FY_OK;
}

/* The frontier's points in order of their lower bounds, each simulated, until the bound
 * passes the fastest prediction by more than the tie margin: no later point can be the
 * fastest or tie with it, so the pick is the exhaustive search's (on the frontier). */
static fy_status search_all(const fy_profile *p, const fy_tune_cfg *cfg, fy_tune_result *top,
                            int ntop, int *nfound, int *nevaluated) {
    *nfound = 0;
    *nevaluated = 0;
    cands cs = {0};
    fy_layout lay = {0};
    fy_status st = frontier(cfg, false, &lay, &cs);
    for (int i = 0, n = cs.n; st == FY_OK && i < n; i++) {
        cand c = cs.v[i];
        st = most_speculation(cfg, &lay, &c);
        if (st == FY_OK && c.k4 > 0) st = push(&cs, c);
    }
    for (int i = 0; st == FY_OK && i < cs.n; i++) st = lower_bound(p, cfg, &lay, &cs.v[i]);
    if (st == FY_OK && cs.n > 1) qsort(cs.v, (size_t)cs.n, sizeof *cs.v, by_lb);
    double best = INFINITY, last_report = fy_now_ms();
    for (int i = 0; st == FY_OK && i < cs.n; i++) {
        const cand *c = &cs.v[i];
        if (c->lb > best * (1.0 + cfg->tie_margin)) break;
        fy_tune_result r;
        if ((st = predict_prefetch(p, cfg, c, best, &lay, &r, nevaluated)) != FY_OK) break;
        r.k1 = c->k1;
        r.k2 = c->k2;
        r.k3 = c->k3;
        r.k4 = c->k4;
        r.k5 = c->k5;
        r.k6 = c->k6;
        if (r.step_ms < best) best = r.step_ms;
        keep_top(cfg, top, ntop, nfound, &r);
        if (cfg->progress && fy_now_ms() - last_report > 500) {
            cfg->progress(cfg->progress_ctx, i + 1, cs.n, best);
            last_report = fy_now_ms();
        }
    }
    free(cs.v);
    if (st == FY_OK && cfg->progress) cfg->progress(cfg->progress_ctx, -1, cs.n, best);
    if (st == FY_OK && *nfound == 0) st = no_plan_fits(cfg, &lay);
    fy_layout_free(&lay);
    return st;
}

fy_status fy_tune(const fy_profile *p, const fy_tune_cfg *cfg, fy_tune_result *top, int ntop,
                  int *nfound, int *nevaluated) {
    fy_tune_result keep[TUNE_KEEP];
    int nkeep = 0;
    if (cfg->ranks > 1 && !(p->coll_gbps > 0)) {
        fy_log_error("profile %s has no figure for the collectives between a job's ranks: probe "
                     "under the launcher (mpirun -np %d ferry probe), or use a named profile",
                     p->name, cfg->ranks);
        return FY_ERR_INVALID;
    }
    FY_TRY(search_all(p, cfg, keep, TUNE_KEEP, &nkeep, nevaluated));
    /* the pick first, then the rest fastest first */
    int pick = fy_tune_pick(keep, nkeep, cfg->tie_margin);
    fy_tune_result chosen = keep[pick];
    memmove(&keep[1], &keep[0], (size_t)pick * sizeof *keep);
    keep[0] = chosen;
    *nfound = nkeep < ntop ? nkeep : ntop;
    memcpy(top, keep, (size_t)*nfound * sizeof *top);
    for (int i = *nfound; i < nkeep; i++) fy_plan_free(&keep[i].plan);
    return FY_OK;
}

bool fy_tune_fits(const fy_tune_cfg *cfg) {
    cands cs = {0};
    fy_layout lay = {0};
    fy_status st = frontier(cfg, true, &lay, &cs);
    const bool any = st == FY_OK && cs.n > 0;
    fy_layout_free(&lay);
    free(cs.v);
    return any;
}
