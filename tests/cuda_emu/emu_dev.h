/* emu_dev.h — a device for the kernel tests where there is no GPU: the cpu backend
 * (memory, streams, copies, events, and the matmul ops, which are cuBLASLt's on a GPU and
 * stay GPU-only) whose other kernels (attention's included) run as the cuda backend runs them, from
 * engine/device/cuda/cuda_kernels.cu, under the CPU emulation (cuda_emu.h). Each kernel
 * op runs in the stream's order (a host function on the cpu stream), three times: its
 * threads forward, reversed and shuffled between barriers, from the same inputs; results
 * that differ are a race, which aborts naming the kernel and the order. */
#ifndef FY_TEST_EMU_DEV_H
#define FY_TEST_EMU_DEV_H

#include "engine/device/device.h"

#ifdef __cplusplus
extern "C" {
#endif

fy_status fy_emu_dev_new(const fy_dev_cfg *cfg, fy_dev **out);
/* Whether kernel op `kind` runs emulated on that device (false: the cpu backend's). */
bool fy_emu_dev_emulates(int kind);

/* The race check, fy_emu_check_orders, is cuda_emu.h's. */

#ifdef __cplusplus
}
#endif
#endif
