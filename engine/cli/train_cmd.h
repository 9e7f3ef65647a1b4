/* train_cmd.h — `ferry train` and `ferry eval`: the options resolved into a model, a plan
 * and a device, handed to the training loop (engine/train.h). */
#ifndef FY_TRAIN_CMD_H
#define FY_TRAIN_CMD_H

#include "engine/cli/opts.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Each returns the process exit code (0 success, 1 failure after one logged error). */
int fy_train_main(const fy_opts *o);
int fy_eval_main(const fy_opts *o);

#ifdef __cplusplus
}
#endif
#endif
