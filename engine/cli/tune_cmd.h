/* tune_cmd.h — `ferry probe`, `ferry tune`, and the `--plan auto` of `ferry train`. */
#ifndef FY_TUNE_CMD_H
#define FY_TUNE_CMD_H

#include "engine/cli/opts.h"
#include "engine/comm/comm.h"
#include "engine/model/model.h"
#include "offload/plan.h"
#include "tuner/profile.h"

#ifdef __cplusplus
extern "C" {
#endif

int fy_probe_main(const fy_opts *o);
int fy_tune_main(const fy_opts *o);
/* --plan auto: the profile (given, cached, or probed now and cached), then the search. In
 * a job (comm of several processes) rank 0 finds the profile, every rank probes if it
 * must (the collectives between them too), rank 0 searches for a rank's plan of the job
 * and every rank gets it. */
fy_status fy_tune_auto_plan(const fy_opts *o, const fy_model *m, fy_comm *comm, fy_plan *out);
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
