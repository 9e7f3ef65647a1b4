/* sweep_cmd.h — `ferry sweep`: a grid of offload configurations, measured or simulated,
 * beside the tuner's predictions (sweep.csv, summary.txt, plots). */
#ifndef FY_SWEEP_CMD_H
#define FY_SWEEP_CMD_H

#include <stdbool.h>

#include "engine/cli/opts.h"

int fy_sweep_main(const fy_opts *o);
/* Whether name, directly under a sweep's output directory, is a file the sweep writes
 * (sweep.csv, summary.txt, the plots); it leaves the others alone. */
bool fy_sweep_owns(const char *name);

#endif
