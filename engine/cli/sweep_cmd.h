/* sweep_cmd.h — `ferry sweep`: a grid of offload configurations, measured or simulated,
 * beside the tuner's predictions (sweep.csv, summary.txt, plots). */
#ifndef FY_SWEEP_CMD_H
#define FY_SWEEP_CMD_H

#include "engine/cli/opts.h"

int fy_sweep_main(const fy_opts *o);

#endif
