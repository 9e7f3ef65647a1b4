/* nccl_standin.h — a test-only stand-in of the emulated runtime (emu_rt.h), enough for the
 * emulated NCCL's test (test_nccl_emu.c) to run without libfy_cudart_emu.so: one worker
 * thread per process plays the device and runs fy_emu_enqueue's work in queue order (all
 * streams as one); device memory is whatever standin_dev_alloc handed out. */
#ifndef FY_NCCL_STANDIN_H
#define FY_NCCL_STANDIN_H

#include <stddef.h>

#include "tests/cuda_emu/runtime/emu_rt.h"

/* nbytes of "device memory", zeroed; standin_dev_free keeps its pages mapped (so a late
 * collective reads no fault) but fy_emu_mem_of calls it FY_EMU_INVALID from then on. */
void *standin_dev_alloc(size_t nbytes);
void standin_dev_free(void *p);

/* Waits until the worker ran everything queued so far; returns the first error a
 * function returned. Every error is sticky: the worker runs nothing after it, and
 * fy_emu_enqueue returns it. */
cudaError_t standin_sync(void);

/* Device bytes fy_emu_take holds now; its capacity is 80 GiB. */
size_t standin_taken(void);

/* Every fy_emu_report line of this process so far, each ending in '\n'. */
const char *standin_reports(void);

#endif
