/* tune_cmd.h — `ferry probe`, `ferry tune`, and the `--plan auto` of `ferry train`. */
#ifndef FY_TUNE_CMD_H
#define FY_TUNE_CMD_H

#include "engine/cli/opts.h"
#include "engine/comm/comm.h"
#include "engine/model/model.h"
#include "offload/plan.h"
#include "tuner/profile.h"
#include "tuner/tune.h"

#ifdef __cplusplus
extern "C" {
#endif

int fy_probe_main(const fy_opts *o);
int fy_tune_main(const fy_opts *o);
/* --plan auto in one process: the profile (given, cached, or probed now and cached),
 * then the search. (A job's plans: job_cmd.h.) */
fy_status fy_tune_auto_plan(const fy_opts *o, const fy_model *m, fy_plan *out);
/* A job's rank's profile, collectively over comm: its --profile entry (one for every
 * rank, or one per rank: the caller checked the count), else its device's cached probe of this model and job, else a
 * probe now by every rank (the collectives between them too), cached. Refused with one
 * error line, from one rank, when a rank's profile knows no collectives. */
fy_status fy_tune_rank_profile(const fy_opts *o, const fy_model *m, fy_comm *comm, fy_profile *p);
/* The search's configuration for this process's options under profile p: a batch of
 * --batch x --grad-accum sequences, the device budget --gpu-mem or else the profile's
 * device memory (what the backend gives a run), the CPU optimizer's threads
 * --adam-threads, --threads or the profile's cores. */
fy_tune_cfg fy_tune_cfg_of(const fy_opts *o, const fy_model *m, const fy_profile *p);
/* FY_ERR_USAGE (logged) when tc has a disk budget and profile p no disk rates to cost it. */
fy_status fy_tune_check_disk(const fy_tune_cfg *tc, const fy_profile *p);
/* The profile: --profile (file or name), else this machine's cached probe if it measured
 * this model and sequence length, else a probe now (then cached). */
fy_status fy_tune_auto_profile(const fy_opts *o, const fy_model *m, fy_profile *p);
/* This machine's cached profile: $XDG_CACHE_HOME/ferry/profile-<host>.json (or
 * ~/.cache/ferry/..., /tmp/ferry-cache/...), into buf; nothing is created. */
fy_status fy_tune_cache_path(char *buf, size_t cap);
/* The named model with the shape overrides of o (no weights file), checked against
 * --seq; the caller frees it. */
fy_status fy_opts_model(const fy_opts *o, fy_model **out);

#ifdef __cplusplus
}
#endif
#endif
