/* job.h — a data-parallel job whose ranks differ (HexiScale's problem): each rank's plan
 * from its own profile and device budget, and each rank's share of the step's
 * micro-batches, so that the slowest rank's step, which is the job's, is as short as the
 * predictions allow.
 *
 * Every rank's micro-batches have one size: a job is exact (bit-identical to one process
 * accumulating the same micro-batches in the same order) only when they do, since a
 * micro-batch of 2 sums its weight gradients in one GEMM where two of 1 sum them in two.
 * So the search is over that size (each that cuts the job's step into whole micro-batches,
 * at least one a rank; with equal shares, each divisor of a rank's batch), then per rank over its
 * plans (tune.h: its own profile, budget, and the job's sharded state and collectives) and
 * over the ranks' counts: rank r's step takes T_r(n) for n micro-batches, about a_r + b_r n
 * under one plan; the counts that minimise max_r T_r(n_r) with sum n_r fixed are found by
 * giving each next micro-batch to the rank whose step it lengthens least, each rank's plan
 * is searched again for its count, and that repeats until the counts hold (at most
 * JOB_ROUNDS rounds; the best job seen is kept). The job's step is predicted as its
 * slowest rank's simulated step: the ranks meet at every block's collectives, and with
 * the counts balanced they arrive together, so the waits the rank-wise simulation leaves
 * out are small (bench/RESULTS.md measures it on the cpu backend). */
#ifndef FY_JOB_H
#define FY_JOB_H

#include <stdbool.h>
#include <stddef.h>

#include "tuner/tune.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fy_job_rank {
    const fy_profile *profile; /* the rank's machine (a --sim-slowdown applied: profile.h) */
    size_t device_budget;      /* bytes */
    int adam_threads;
    const fy_plan *plan;       /* the rank's own plan (its micro_batch fixes the job's); NULL:
                                  searched */
} fy_job_rank;

typedef enum fy_job_shares {
    FY_JOB_EQUAL,    /* every rank rank_batch / micro micro-batches */
    FY_JOB_BALANCED, /* by the predictions, as above */
} fy_job_shares;

typedef struct fy_job_cfg {
    const fy_model *model;
    int seq;
    int rank_batch;        /* sequences a rank takes a step with equal shares: the job's step
                              is nranks * rank_batch sequences whatever the shares */
    int nranks;
    const fy_job_rank *ranks;
    size_t host_budget;    /* bytes, each rank's; 0: no limit */
    fy_dtype dtype;
    fy_job_shares shares;
    bool one_plan;         /* every rank runs one plan: the best that fits the smallest
                              budget (the job ferry ran before per-rank plans; a baseline) */
    int window;            /* steps simulated per prediction (tune.h) */
    fy_sched_mode schedule; /* the simulator's task order (tune.h) */
    double tie_margin;
} fy_job_cfg;

typedef struct fy_job_result {
    int micro;              /* sequences a micro-batch, every rank's */
    double step_ms;         /* predicted: the slowest rank's step */
    int nranks;
    fy_tune_result *rank;   /* per rank: its plan (grad_accum = its micro-batches a step),
                               predicted step and memory; k1..k4 when searched */
    int evaluated;          /* rank plans predicted or searched, for the report */
} fy_job_result;

/* The collectives of a job run at its slowest link: every profile's collective
 * bandwidths (device and host memory) become the least of them and their latencies the
 * largest (fy_tune_job prices its ranks so, on copies of their profiles). */
void fy_job_share_links(fy_profile *const *profiles, int n);

/* Searches the job: out filled (fy_job_result_free). FY_ERR_INVALID with one error line
 * naming the rank when a rank has no plan within its budgets at any micro-batch size, or
 * when fixed plans disagree on the micro-batch size. */
fy_status fy_tune_job(const fy_job_cfg *cfg, fy_job_result *out);
void fy_job_result_free(fy_job_result *r);

/* The counts n[0..nranks) (each at least 1 and at most FY_PLAN_MAX_ACCUM, summing to
 * total) that minimise max_r (a[r] + b[r] * n[r]) for b[r] >= 0: each next one goes to the
 * rank whose time it raises least (ties: the lower rank). FY_ERR_INVALID when total is
 * below nranks or above nranks * FY_PLAN_MAX_ACCUM. */
fy_status fy_job_balance(const double *a, const double *b, int nranks, int total, int *n);

#ifdef __cplusplus
}
#endif
#endif
