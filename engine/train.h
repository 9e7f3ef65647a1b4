/* train.h — the commands that drive a trainer: `ferry train` and `ferry eval`.
 *
 * train: resolves the model (named config or weights file), the data (files or the
 * embedded corpus, with validation), the device, then runs the optimizer steps with the
 * learning-rate schedule, printing a line per step (or a progress display on long runs),
 * writing JSON Lines metrics, evaluating, and saving the weights.
 * eval: the mean loss of a weights file over a data file, printed last as JSON. */
#ifndef FY_TRAIN_H
#define FY_TRAIN_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/cli/opts.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Learning rate at 0-based step s of `steps`: constant, or linear warmup over `warmup`
 * steps ((s+1)/warmup * lr) then cosine from lr down to min_lr at the last step. */
double fy_lr_at(int64_t s, int64_t steps, double lr, double min_lr, int64_t warmup,
                bool cosine);

/* Each returns the process exit code (0 success, 1 failure after one logged error). */
int fy_train_main(const fy_opts *o);
int fy_eval_main(const fy_opts *o);

#ifdef __cplusplus
}
#endif
#endif
