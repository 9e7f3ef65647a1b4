/* tasks.h — the step graph's task kinds: one table that everything else reads.
 *
 * FY_TASK_KINDS(X) lists each kind once as X(ID, name, lane, cost): its enum (FY_T_ID),
 * its stable public name (profile files, traces and error lines use it; a name keeps its
 * meaning: only `gopen`, which no profile stored, became `grad_zero`), the lane it runs
 * on, and the rule the tuner prices it by (cost_<rule> in tuner/tune.c). The runner of
 * kind `name` is run_<name> (engine/step_run.c); the builder (engine/step_build.c) makes
 * the tasks.
 *
 *   load        h2d      a micro-batch's tokens into a token buffer (and a row-staged
 *                        block's rows: its distinct tokens)
 *   h2d_param   h2d      a streamed block's weights into a staging slot (its rows, a
 *                        chunk); for a device update, its master
 *   fwd         compute  a block's forward
 *   grad_zero   compute  a zeroed staging slot for a block's gradient that a later
 *                        block's backward adds into first (its links)
 *   head        compute  the head's loss pass: forward, loss and (training) backward; a
 *                        chunked head's, one task per vocabulary chunk
 *   recompute   compute  a recomputed layer's forward again, before its backward
 *   bwd         compute  a block's backward (a chunked head's earlier chunks')
 *   d2h_grad    d2h      a cpu-updated block's gradient to the host
 *   norm        cpu      the step's global gradient norm, clip coefficient, mean loss
 *   adam_gpu    compute  AdamW on the device
 *   d2h_param   d2h      a streamed device-updated block's master (and copy) back
 *   adam_cpu    cpu      AdamW on the host (optim_cpu); a speculative block's (plan.h) may
 *                        run before the norm, into its spare side
 *   commit      cpu      a speculative block's update, once the norm is known: its sides
 *                        swapped, or the update redone (clipped) or undone (skipped)
 *   h2d_update  h2d      a cpu-updated resident block's weights back to the device
 *   collect     cpu      an evaluated batch's loss
 *   reduce      comm     data parallel: a block's gradient summed into each shard's owner
 *   allgather   comm     data parallel: each shard's updated weights from its owner
 *   disk_read   disk     a disk block's chunk of master and moments into a host slot
 *                        (adam_cpu then updates that chunk: one task per chunk)
 *   disk_write  disk     the chunk's updated master and moments back to the file
 *   d2h_act     d2h      an offloaded layer's input to pinned host memory, after its
 *                        forward
 *   h2d_act     h2d      that input back into a device slot, before its recompute */
#ifndef FY_TASKS_H
#define FY_TASKS_H

#include "scheduler/scheduler.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FY_TASK_KINDS(X)                                   \
    X(LOAD, load, FY_LANE_H2D, tokens)                     \
    X(H2D_PARAM, h2d_param, FY_LANE_H2D, fetch)            \
    X(FWD, fwd, FY_LANE_COMPUTE, device)                   \
    X(GRAD_ZERO, grad_zero, FY_LANE_COMPUTE, device)       \
    X(HEAD, head, FY_LANE_COMPUTE, device)                 \
    X(RECOMPUTE, recompute, FY_LANE_COMPUTE, device)       \
    X(BWD, bwd, FY_LANE_COMPUTE, device)                   \
    X(D2H_GRAD, d2h_grad, FY_LANE_D2H, grad_out)           \
    X(NORM, norm, FY_LANE_CPU, fixed)                      \
    X(ADAM_GPU, adam_gpu, FY_LANE_COMPUTE, device)         \
    X(D2H_PARAM, d2h_param, FY_LANE_D2H, master_out)       \
    X(ADAM_CPU, adam_cpu, FY_LANE_CPU, host_adam)          \
    X(H2D_UPDATE, h2d_update, FY_LANE_H2D, send)           \
    X(COMMIT, commit, FY_LANE_CPU, fixed)                  \
    X(COLLECT, collect, FY_LANE_CPU, fixed)                \
    X(REDUCE, reduce, FY_LANE_COMM, collective)            \
    X(ALLGATHER, allgather, FY_LANE_COMM, collective)      \
    X(DISK_READ, disk_read, FY_LANE_DISK, disk_in)         \
    X(DISK_WRITE, disk_write, FY_LANE_DISK, disk_out)      \
    X(D2H_ACT, d2h_act, FY_LANE_D2H, act_copy)             \
    X(H2D_ACT, h2d_act, FY_LANE_H2D, act_copy)

typedef enum fy_task_kind {
#define FY_X_ENUM(id, name, lane, cost) FY_T_##id,
    FY_TASK_KINDS(FY_X_ENUM)
#undef FY_X_ENUM
    FY_T_COUNT
} fy_task_kind;

/* The kind's public name ("?" out of range), and its lane. */
const char *fy_task_kind_name(int kind);
fy_lane fy_task_kind_lane(fy_task_kind kind);

#ifdef __cplusplus
}
#endif
#endif
