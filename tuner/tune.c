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
        const double back = es == 4.0 ? nb : nb + P * 4.0;
        fy_trainer_set_cost(dry, FY_T_H2D_PARAM, b, xfer_ms(nb, p->h2d_gbps, p->latency_ms));
        fy_trainer_set_cost(dry, FY_T_H2D_UPDATE, b, xfer_ms(nb, p->h2d_gbps, p->latency_ms));
        fy_trainer_set_cost(dry, FY_T_D2H_GRAD, b, xfer_ms(nb, p->d2h_gbps, p->latency_ms));
        fy_trainer_set_cost(dry, FY_T_D2H_PARAM, b, xfer_ms(back, p->d2h_gbps, p->latency_ms));
        fy_trainer_set_cost(dry, FY_T_ADAM_CPU, b, adam > 0 ? P / adam * 1e3 : 1e9);
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
            fy_trainer_set_cost(dry, (fy_task_kind)k, b, ms > 0 ? ms : 0.0);
        }
    }
}

fy_status fy_tune_predict(const fy_profile *p, const fy_tune_cfg *cfg, const fy_plan *plan,
                          fy_tune_result *out) {
    memset(out, 0, sizeof *out);
    fy_trainer_cfg tc = {.model = cfg->model, .T = cfg->seq, .plan = plan};
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

static fy_status search_all(const fy_profile *p, const fy_tune_cfg *cfg, fy_tune_result *top,
                            int ntop, int *nfound, int *nevaluated);

fy_status fy_tune(const fy_profile *p, const fy_tune_cfg *cfg, fy_tune_result *top, int ntop,
                  int *nfound, int *nevaluated) {
    fy_tune_result keep[TUNE_KEEP];
    int nkeep = 0;
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

static fy_status search_all(const fy_profile *p, const fy_tune_cfg *cfg, fy_tune_result *top,
                            int ntop, int *nfound, int *nevaluated) {
    const int L = fy_model_layers(cfg->model);
    *nfound = 0;
    *nevaluated = 0;
    fy_status st = FY_OK;
    size_t best_dev = SIZE_MAX;
    for (int micro = 1; micro <= cfg->batch && st == FY_OK; micro++) {
        if (cfg->batch % micro) continue;
        for (int k1 = 0; k1 <= L && st == FY_OK; k1++)
            for (int k2 = 0; k2 <= L && st == FY_OK; k2++)
                for (int k3 = 0; k3 <= L && st == FY_OK; k3++) {
                    fy_plan plan;
                    if ((st = fy_plan_new(cfg->model, micro, cfg->batch / micro, &plan)) != FY_OK) break;
                    plan.dtype = cfg->dtype == FY_BF16 ? FY_BF16 : FY_F32;
                    st = fy_plan_shorthands(&plan, (double)k2 / L, (double)k3 / L, k1);
                    fy_mem_model mm;
                    if (st == FY_OK) fy_storage_model(cfg->model, &plan, cfg->seq, &mm);
                    bool fits = st == FY_OK && mm.device_total <= cfg->device_budget &&
                                (!cfg->host_budget || mm.host_total <= cfg->host_budget);
                    if (st == FY_OK && mm.device_total < best_dev) best_dev = mm.device_total;
                    if (fits) {
                        fy_tune_result r;
                        st = fy_tune_predict(p, cfg, &plan, &r);
                        (*nevaluated)++;
                        if (st == FY_OK) {
                            r.k1 = k1;
                            r.k2 = k2;
                            r.k3 = k3;
                            /* insert into the top list, fastest first */
                            int pos = *nfound < ntop ? *nfound : ntop;
                            while (pos > 0 && throughput(cfg, &r) > throughput(cfg, &top[pos - 1])) pos--;
                            if (pos < ntop) {
                                if (*nfound == ntop) fy_plan_free(&top[ntop - 1].plan);
                                else (*nfound)++;
                                memmove(&top[pos + 1], &top[pos], (size_t)(*nfound - 1 - pos) * sizeof *top);
                                top[pos] = r;
                            } else {
                                fy_plan_free(&r.plan);
                            }
                        }
                    }
                    fy_plan_free(&plan);
                }
    }
    if (st != FY_OK) return st;
    if (*nfound == 0) {
        char a[32], b[32];
        fy_log_error("no plan fits: the smallest needs %s of device memory, the budget is %s",
                     fy_fmt_size(best_dev, a, sizeof a), fy_fmt_size(cfg->device_budget, b, sizeof b));
        return FY_ERR_INVALID;
    }
    return FY_OK;
}
