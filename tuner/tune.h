/* tune.h — cost model and plan search.
 *
 * The cost model gives every task of the step graph a duration from a profile: transfers
 * are bytes over the measured bandwidth plus latency, CPU AdamW is parameters over the
 * measured throughput for the thread count, a data-parallel job's reduce-scatter and
 * all-gather of a block are its bytes in the storage type times (N - 1) / N over the
 * profile's collective bandwidth plus its latency, and compute is the profile's measured block
 * costs (a + b * micro-batch, for the same model shape and sequence length) or, without
 * them, an analytic estimate from the effective matmul throughput and memory bandwidth.
 * The search walks AutoHete's space (recompute the first k1 layers, stream the first k2,
 * CPU optimizer for the last k3, so the optimizer state is split between the device and
 * the host) times the micro-batch sizes that divide the batch; each point speculates the
 * cpu updates of as many of the last layers as the host budget allows (plan.h); the
 * contenders are also tried with a deeper prefetch while the device budget allows. It keeps the memory
 * frontier (tune.c: for each micro-batch and k3, the fitting points where more streaming
 * buys less recomputation; the memory model is monotone in the counts), bounds each
 * point's step time from below by its busiest lane's work, and predicts the points in
 * the order of their bounds on the scheduler's simulator (the same graph, under the
 * schedule training runs: cfg->schedule) until the bound passes the fastest prediction
 * by more than the tie margin. Predictions within that margin of the fastest (the
 * model's error) are ties, settled for the plan that moves the least work off the
 * compute lane. It never returns a plan that does not fit.
 * The tiers past host memory extend the space only where it runs out: a point whose
 * host memory is over the budget keeps the master and moments of as few of its last
 * cpu-updated layers on disk as bring it within (k5, when a disk budget is given; no
 * speculation then), and when even every layer streamed and recomputed is over the
 * device budget, the inputs of as few of the first layers as bring it within are
 * offloaded to the host (k6). Both are costed: the disk lane at the profile's disk
 * rates, the activations' copies on the transfer lanes. */
#ifndef FY_TUNE_H
#define FY_TUNE_H

#include <stdbool.h>
#include <stddef.h>

#include "engine/step_build.h"
#include "offload/layout.h"
#include "offload/plan.h"
#include "offload/storage.h"
#include "tuner/profile.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The cost table of a run under layout L from the profile: every (task kind, block) the
 * step graph can hold, each by its kind's rule (engine/tasks.h: the cost column). */
void fy_tune_costs(const fy_profile *p, const fy_layout *L, int adam_threads, fy_cost_table *out);

/* Predictions closer than this are ties: the sweeps in bench/RESULTS.md put the cost
 * model's median error at ~4% and show it under-predicting plans that add transfers and
 * CPU work, so a tie goes to the plan that adds the least. */
#define FY_TUNE_TIE_MARGIN 0.06

typedef struct fy_tune_cfg {
    const fy_model *model;
    int batch;             /* tokens per step = batch * seq (micro-batch * accumulation) */
    int micro;             /* the micro-batch size, fixed (it divides batch); 0: searched,
                              every divisor of batch */
    int seq;
    size_t device_budget;  /* bytes */
    size_t host_budget;    /* bytes; 0 = no limit */
    size_t disk_budget;    /* bytes of the disk tier (plan.h: disk); 0 = no disk tier */
    size_t spec_host_cap;  /* bytes: speculation (plan.h) never takes a plan's host memory
                              past this (0 = only the host budget binds): a run on this
                              machine gets no more than it has */
    int adam_threads;
    int window;            /* steps simulated per candidate */
    fy_dtype dtype;        /* the plans' device storage type (NONE = fp32) */
    int ranks;             /* plans for each rank of a data-parallel job of this many
                              processes (0, 1: one process): batch is a rank's, the
                              optimizer state is sharded (a rank's largest shards are
                              budgeted) and the reduce-scatters and all-gathers are costed
                              from the profile's collectives */
    fy_sched_mode schedule; /* the simulator's task order (zero: priority, training's
                              default) */
    double tie_margin;     /* plans predicted within this fraction of the fastest count as
                              ties, settled for the one that moves the least work off the
                              compute lane (0: the fastest prediction wins) */
    /* optional: called about twice a second while plans are simulated (done of total
     * candidates, the fastest prediction so far) and once at the end (done = -1) */
    void (*progress)(void *ctx, int done, int total, double best_ms);
    void *progress_ctx;
} fy_tune_cfg;

typedef struct fy_tune_result {
    fy_plan plan;
    double step_ms;            /* predicted, steady state */
    double busy_ms[FY_LANE_COUNT];
    fy_mem_model mem;
    int k1, k2, k3;
    int k4;                    /* of the cpu updates, those of the last k4 layers speculate */
    int k5;                    /* of the cpu updates, the last k5 layers' state on disk */
    int k6;                    /* the first k6 layers' inputs offloaded to the host */
} fy_tune_result;

/* Searches and returns the best `ntop` plans in top[] (fastest first; the caller frees
 * each plan with fy_plan_free), *nfound how many. FY_ERR_INVALID (logged) if no plan fits
 * the budgets. */
fy_status fy_tune(const fy_profile *p, const fy_tune_cfg *cfg, fy_tune_result *top, int ntop,
                  int *nfound, int *nevaluated);

/* Work a plan moves off the compute lane per step (transfer and CPU lanes' busy ms):
 * the tie-break, since the cost model under-predicts the contention that work causes. */
double fy_tune_offload_ms(const fy_tune_result *r);
/* Index of the pick among n predictions: the least offload within (1 + margin) of the
 * fastest. */
int fy_tune_pick(const fy_tune_result *r, int n, double margin);

/* Whether any plan of the search space fits both budgets (memory models only: no
 * simulation). */
bool fy_tune_fits(const fy_tune_cfg *cfg);

/* Predicts one plan (memory model and step time). */
fy_status fy_tune_predict(const fy_profile *p, const fy_tune_cfg *cfg, const fy_plan *plan,
                          fy_tune_result *out);

/* The simulated run of plan (cfg->window steps, as predicted) as a Chrome trace at path. */
fy_status fy_tune_trace(const fy_profile *p, const fy_tune_cfg *cfg, const fy_plan *plan,
                        const char *path);

#ifdef __cplusplus
}
#endif
#endif
