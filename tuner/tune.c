/* tune.c — the cost model and the exhaustive search over AutoHete's plan space. */
#include "tuner/tune.h"

#include "engine/core/util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static double xfer_ms(double nbytes, double gbps, double latency_ms) {
    return nbytes / (gbps * 1e9) * 1e3 + latency_ms;
}

/* Analytic compute cost of kind on block b: the model's matmul FLOPs for the pass at the
 * effective throughput plus its memory traffic at the device's bandwidth, with
 * parameters, gradients and activations of es bytes (the storage type). Zeroing a
 * gradient slot moves it once; AdamW moves 28 bytes an element either way: fp32
 * weights, m and v read and written (24) plus the gradient in and, with bf16 storage,
 * the bf16 copy out (4 for fp32 storage, 2 + 2 for bf16). */
static double analytic_ms(const fy_profile *p, const fy_model *m, int kind, int b, int B, int T,
                          double es) {
    const double P = (double)fy_model_block(m, b)->nelem;
    const double flop_s = p->compute_tflops * 1e12, byte_s = p->device_mem_gbps * 1e9;
    fy_cost c;
    switch (kind) {
    case FY_T_FWD:
    case FY_T_RECOMPUTE: fy_model_cost(m, b, FY_PASS_FWD, B, T, es, &c); break;
    case FY_T_BWD: fy_model_cost(m, b, FY_PASS_BWD, B, T, es, &c); break;
    case FY_T_HEAD: fy_model_cost(m, b, FY_PASS_LOSS, B, T, es, &c); break;
    case FY_T_GOPEN: return 1e3 * es * P / byte_s;
    case FY_T_ADAM_GPU: return 1e3 * 28.0 * P / byte_s;
    default: return 0.0;
    }
    return 1e3 * (c.flops / flop_s + c.bytes / byte_s);
}

void fy_tune_costs(const fy_profile *p, fy_trainer *dry, int adam_threads) {
    const fy_model *m = fy_trainer_model(dry);
    const fy_storage *st = fy_trainer_storage(dry);
    const int B = st->plan.micro_batch, T = st->T;
    char sig[256];
    fy_model_signature(m, sig, sizeof sig);
    const bool measured = p->has_blocks && p->block_seq == T && p->block_dtype == st->dtype &&
                          !strcmp(p->block_model, sig);
    double adam = fy_profile_adam_gparams(p, adam_threads) * 1e9;
    fy_trainer_set_cost(dry, FY_T_LOAD, -1, xfer_ms(8.0 * B * T, p->h2d_gbps, p->latency_ms));
    fy_trainer_set_cost(dry, FY_T_NORM, -1, 0.01);
    /* transfers move the storage type's copies; a device update of a streamed block with
     * bf16 storage also returns the fp32 master (its fetch, costed as a compute fetch,
     * moves the master too: the model undercounts that one) */
    const double es = (double)st->es;
    for (int b = 0; b < fy_model_nblocks(m); b++) {
        const double P = (double)fy_model_block(m, b)->nelem, nb = P * es;
        /* a job's rank updates its shard only (storage.h): AdamW and a streamed device
         * update's return move share of the block */
        const double own = (double)(st->chunks[b].hi - st->chunks[b].lo), share = P > 0 ? own / P : 1.0;
        const double back = (es == 4.0 ? nb : nb + P * 4.0) * share;
        /* a gathered block moves its micro-batch's rows (at most B*T of them); the host
         * then zeroes, scatters into and sums its whole gradient once a step, two passes
         * where AdamW makes about eight; a chunked head's chunks land on the host and the
         * last takes the whole gradient's norm (the same pass, spread over its K copies) */
        const double stage = (double)st->chunks[b].stage_nelem * es;
        const double host_pass = adam > 0 ? P / adam * 1e3 / 4.0 : 0.0;
        const double scatter = st->chunks[b].gathered ? host_pass / st->plan.grad_accum
                             : st->chunks[b].chunked ? host_pass / 2.0 / st->head_chunks.n
                                                     : 0.0;
        fy_trainer_set_cost(dry, FY_T_H2D_PARAM, b, xfer_ms(stage, p->h2d_gbps, p->latency_ms));
        fy_trainer_set_cost(dry, FY_T_H2D_UPDATE, b, xfer_ms(nb, p->h2d_gbps, p->latency_ms));
        fy_trainer_set_cost(dry, FY_T_D2H_GRAD, b,
                            xfer_ms(stage, p->d2h_gbps, p->latency_ms) + scatter);
        fy_trainer_set_cost(dry, FY_T_D2H_PARAM, b, xfer_ms(back, p->d2h_gbps, p->latency_ms));
        fy_trainer_set_cost(dry, FY_T_ADAM_CPU, b, adam > 0 ? own / adam * 1e3 : 1e9);
        static const int compute[] = {FY_T_FWD, FY_T_RECOMPUTE, FY_T_BWD, FY_T_HEAD, FY_T_GOPEN,
                                      FY_T_ADAM_GPU};
        for (size_t i = 0; i < sizeof compute / sizeof compute[0]; i++) {
            int k = compute[i];
            fy_block_kind c = fy_model_block(m, b)->kind;
            double ms;
            if (measured && (p->block_a[k][c] != 0 || p->block_b[k][c] != 0))
                ms = p->block_a[k][c] + p->block_b[k][c] * B;
            else
                ms = analytic_ms(p, m, k, b, B, T, es);
            if (k == FY_T_ADAM_GPU) ms *= share;
            fy_trainer_set_cost(dry, (fy_task_kind)k, b, ms > 0 ? ms : 0.0);
        }
        if (st->plan.shards > 1) {
            /* a job's collectives: each rank moves (N-1)/N of the block, over the device's
             * collectives where the buffer is device memory, else over MPI in host memory
             * (a cpu-optimised block's gradient; its weights and a streamed block's),
             * where the reduce also takes its shard's chunk sums (a pass of the host) */
            const double N = st->plan.shards, moved = nb * (N - 1.0) / N;
            const bool cpu = st->plan.blocks[b].optim == FY_OPTIM_CPU;
            const bool host_w = cpu || st->plan.blocks[b].params == FY_PARAMS_STREAMED;
            const double dev_ms = p->coll_gbps > 0 ? xfer_ms(moved, p->coll_gbps, p->coll_latency_ms) : 1e9;
            const double host_ms = p->coll_host_gbps > 0
                                       ? xfer_ms(moved, p->coll_host_gbps, p->coll_host_latency_ms) : 1e9;
            const double parts = adam > 0 ? own / adam * 1e3 / 4.0 : 0.0;
            fy_trainer_set_cost(dry, FY_T_REDUCE, b, cpu ? host_ms + parts : dev_ms);
            fy_trainer_set_cost(dry, FY_T_ALLGATHER, b, host_w ? host_ms : dev_ms);
        }
        if (st->chunks[b].chunked) {
            /* its loss pass by K chunks: K head tasks, a forward each (a third of a
             * chunk's share of the pass) and the last also its backward (two thirds),
             * costed at their mean, (K + 2) / (3K) of the pass over K tasks; then K - 1
             * backward tasks (recompute and backward: a chunk's whole share) */
            const double loss = fy_trainer_cost(dry, FY_T_HEAD, b), K = st->head_chunks.n;
            fy_trainer_set_cost(dry, FY_T_HEAD, b, loss * (K + 2.0) / (3.0 * K * K));
            fy_trainer_set_cost(dry, FY_T_BWD, b, loss / K);
        }
    }
}

fy_status fy_tune_predict(const fy_profile *p, const fy_tune_cfg *cfg, const fy_plan *plan,
                          fy_tune_result *out) {
    memset(out, 0, sizeof *out);
    fy_trainer_cfg tc = {.model = cfg->model, .T = cfg->seq, .plan = plan, .plan_ranks = cfg->ranks};
    fy_trainer *dry;
    FY_TRY(fy_trainer_new_dry(&tc, &dry));
    out->mem = fy_trainer_storage(dry)->mem;
    fy_tune_costs(p, dry, cfg->adam_threads);
    int w = cfg->window > 0 ? cfg->window : 20;
    fy_sched_result r;
    fy_status st = fy_trainer_predict(dry, w, FY_SCHED_PRIORITY, true, &r);
    if (st == FY_OK) {
        out->step_ms = r.makespan_ms / w;
        for (int l = 0; l < FY_LANE_COUNT; l++) out->busy_ms[l] = r.busy_ms[l] / w;
        fy_sched_result_free(&r);
        st = fy_plan_copy(plan, &out->plan);
    }
    fy_trainer_free(dry);
    return st;
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
 * cpu-optimised (k3) layers; lb: its busiest lane's work in a step (ms), which bounds its
 * step time from below; ntasks: its step graph's tasks. */
typedef struct cand { int micro, k1, k2, k3; double lb; int ntasks; } cand;

static fy_status point_plan(const fy_tune_cfg *cfg, const cand *c, fy_plan *out) {
    const int L = fy_model_layers(cfg->model);
    FY_TRY(fy_plan_new(cfg->model, c->micro, cfg->batch / c->micro, out));
    out->dtype = cfg->dtype == FY_BF16 ? FY_BF16 : FY_F32;
    if (cfg->ranks > 1) { /* every block's largest shard: the most any rank holds */
        out->shards = cfg->ranks;
        out->shard = -1;
    }
    fy_status st = fy_plan_shorthands(out, L ? (double)c->k2 / L : 0, L ? (double)c->k3 / L : 0, c->k1);
    if (st != FY_OK) fy_plan_free(out);
    return st;
}

static fy_status point_mem(const fy_tune_cfg *cfg, const cand *c, fy_mem_model *mm) {
    fy_plan plan;
    FY_TRY(point_plan(cfg, c, &plan));
    fy_storage_model(cfg->model, &plan, cfg->seq, mm);
    fy_plan_free(&plan);
    return FY_OK;
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

/* The memory frontier. The memory model is monotone in the counts: device memory falls
 * as k1, k2 or k3 grows, host memory grows with k2 and k3 and does not depend on k1. A
 * point that offloads at least as much as another in every count is not faster (more
 * recomputation, more transfers), so for each micro-batch and k3 (the cpu optimizer can
 * hide under compute, so k3 has no such order) only the staircase of fitting points
 * where more streaming buys less recomputation is kept: walking k2 up, the least k1 that
 * fits, kept when it is less than the last kept one. Each (micro, k3) costs O(L) memory
 * models. With `any`, only whether a point fits: it stops at the first, trying first
 * micro-batch 1 (the least device memory) and the whole batch (no accumulation: the least
 * host memory with bf16 storage, whose gradients then share the weights' buffers). */
static fy_status frontier_micro(const fy_tune_cfg *cfg, int micro, bool any, cands *out) {
    const int L = fy_model_layers(cfg->model);
    const size_t dev = cfg->device_budget, host = cfg->host_budget ? cfg->host_budget : SIZE_MAX;
    for (int k3 = 0; k3 <= L; k3++) {
        int k1 = L, last_k1 = L + 1;
        for (int k2 = 0; k2 <= L; k2++) {
            fy_mem_model mm;
            cand c = {micro, k1, k2, k3, 0, 0};
            FY_TRY(point_mem(cfg, &c, &mm));
            if (mm.host_total > host) {
                if (k2 == 0) return FY_OK; /* more cpu optimizer: more host memory */
                break;                     /* more streaming: more host memory */
            }
            if (mm.device_total > dev) continue;
            for (; c.k1 > 0; c.k1--) { /* the least recomputation that still fits */
                cand d = c;
                d.k1--;
                FY_TRY(point_mem(cfg, &d, &mm));
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

static fy_status frontier(const fy_tune_cfg *cfg, bool any, cands *out) {
    /* micro-batch 1 and the whole batch first, then the other divisors */
    for (int pass = 0; pass < 2; pass++)
        for (int micro = 1; micro <= cfg->batch; micro++) {
            const bool ends = micro == 1 || micro == cfg->batch;
            if (cfg->batch % micro || ends != (pass == 0)) continue;
            FY_TRY(frontier_micro(cfg, micro, any, out));
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

static fy_status lower_bound(const fy_profile *p, const fy_tune_cfg *cfg, cand *c) {
    fy_plan plan;
    FY_TRY(point_plan(cfg, c, &plan));
    fy_trainer_cfg tc = {.model = cfg->model, .T = cfg->seq, .plan = &plan, .plan_ranks = cfg->ranks};
    fy_trainer *dry;
    fy_status st = fy_trainer_new_dry(&tc, &dry);
    if (st == FY_OK) {
        fy_tune_costs(p, dry, cfg->adam_threads);
        double busy[FY_LANE_COUNT];
        st = fy_trainer_step_work(dry, busy, &c->ntasks);
        c->lb = 0.0;
        for (int l = 0; l < FY_LANE_COUNT; l++) if (busy[l] > c->lb) c->lb = busy[l];
        fy_trainer_free(dry);
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
static fy_status no_plan_fits(const fy_tune_cfg *cfg) {
    const int L = fy_model_layers(cfg->model);
    char a[32], b[32], c[32];
    fy_mem_model mm;
    size_t host_floor = SIZE_MAX, host_fit = SIZE_MAX;
    for (int micro = 1; micro <= cfg->batch; micro++) {
        if (cfg->batch % micro) continue;
        FY_TRY(point_mem(cfg, &(cand){micro, 0, 0, 0, 0, 0}, &mm));
        if (mm.host_total < host_floor) host_floor = mm.host_total;
    }
    FY_TRY(point_mem(cfg, &(cand){1, L, L, L, 0, 0}, &mm));
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
        if (cfg->batch % micro) continue;
        for (int k3 = 0; k3 <= L; k3++)
            for (int k2 = 0; k2 <= L; k2++) {
                FY_TRY(point_mem(cfg, &(cand){micro, L, k2, k3, 0, 0}, &mm));
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

/* The frontier's points in order of their lower bounds, each simulated, until the bound
 * passes the fastest prediction by more than the tie margin: no later point can be the
 * fastest or tie with it, so the pick is the exhaustive search's (on the frontier). */
static fy_status search_all(const fy_profile *p, const fy_tune_cfg *cfg, fy_tune_result *top,
                            int ntop, int *nfound, int *nevaluated) {
    *nfound = 0;
    *nevaluated = 0;
    cands cs = {0};
    fy_status st = frontier(cfg, false, &cs);
    for (int i = 0; st == FY_OK && i < cs.n; i++) st = lower_bound(p, cfg, &cs.v[i]);
    if (st == FY_OK && cs.n > 1) qsort(cs.v, (size_t)cs.n, sizeof *cs.v, by_lb);
    double best = INFINITY, last_report = fy_now_ms();
    for (int i = 0; st == FY_OK && i < cs.n; i++) {
        const cand *c = &cs.v[i];
        if (c->lb > best * (1.0 + cfg->tie_margin)) break;
        fy_plan plan;
        if ((st = point_plan(cfg, c, &plan)) != FY_OK) break;
        fy_tune_cfg wc = *cfg;
        wc.window = window_for(cfg, c->ntasks);
        fy_tune_result r;
        st = fy_tune_predict(p, &wc, &plan, &r);
        fy_plan_free(&plan);
        if (st != FY_OK) break;
        (*nevaluated)++;
        r.k1 = c->k1;
        r.k2 = c->k2;
        r.k3 = c->k3;
        if (r.step_ms < best) best = r.step_ms;
        keep_top(cfg, top, ntop, nfound, &r);
        if (cfg->progress && fy_now_ms() - last_report > 500) {
            cfg->progress(cfg->progress_ctx, i + 1, cs.n, best);
            last_report = fy_now_ms();
        }
    }
    free(cs.v);
    if (st != FY_OK) return st;
    if (cfg->progress) cfg->progress(cfg->progress_ctx, -1, cs.n, best);
    if (*nfound == 0) return no_plan_fits(cfg);
    return FY_OK;
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
    fy_status st = frontier(cfg, true, &cs);
    const bool any = st == FY_OK && cs.n > 0;
    free(cs.v);
    return any;
}
