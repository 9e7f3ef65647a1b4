/* job_cmd.h — a job whose ranks differ, from the command line: `ferry tune` with a
 * profile or a device budget per rank, and `ferry train` under a launcher with --plan
 * auto or --batch-shares auto (each rank its own plan and its share of the step:
 * tuner/job.h). */
#ifndef FY_JOB_CMD_H
#define FY_JOB_CMD_H

#include "engine/cli/opts.h"
#include "engine/comm/comm.h"
#include "engine/model/model.h"
#include "offload/plan.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Whether `ferry tune`'s options describe a job of unlike ranks: a --profile or a
 * --gpu-mem per rank. */
bool fy_tune_is_job(const fy_opts *o);
/* ferry tune for such a job: the ranks' own plans and shares, against equal shares and
 * against one plan for every rank, predicted. Returns the exit status. */
int fy_tune_job_main(const fy_opts *o, const fy_model *m);

/* A training job's plans and shares, collectively: each rank's profile (job's, cached or
 * probed: fy_tune_rank_profile) with its --sim-slowdown (slowdown[rank], or NULL), its
 * device budget (o->gpu_mem, its own entry), on every rank; rank 0 searches the job
 * (search: each rank's plan; else the plan each rank has; balance: the shares by the
 * predictions, else equal) and prints it; every rank gets its own. On return *plan is
 * this rank's with grad_accum its micro-batches a step. */
fy_status fy_job_plans(const fy_opts *o, const fy_model *m, fy_comm *comm, const double *slowdown,
                       bool search, bool balance, fy_plan *plan);

#ifdef __cplusplus
}
#endif
#endif
