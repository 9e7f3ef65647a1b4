/* step_build.h — the step graph's builder: training steps and evaluation as task graphs,
 * from a layout alone.
 *
 * Design. The step graph has three parts: this builder (typed tasks, no device), the
 * executor (engine/step_exec.c: binds tasks to streams and lanes, owns the window's
 * state, runs the runners of engine/step_run.c) and the trainer (device, streams,
 * storage, optimizer pool, counters). The builder reads only a layout (offload/layout.h)
 * and writes a graph whose every task has a kind (engine/tasks.h), a block, a typed
 * payload, and its work (fy_task: the bytes it moves, the matmul FLOPs it computes); the simulator and the tuner run its output directly,
 * with costs from a cost table (measured by a trainer, or the tuner's model).
 *
 * For each step of a window and each micro-batch m of it:
 *   forward   load(m); h2d_param(b) for streamed blocks; fwd(b): the embedding, layers
 *   head      grad_zero(l) for a staged block l the head adds into before l's own
 *             backward (its links); head(m): forward, loss, backward (a chunked head: one
 *             task per vocabulary chunk, the last with its chunk's backward)
 *   backward  bwd(head, k) for a chunked head's earlier chunks; recompute(b); bwd(b):
 *             layers, then the embedding; d2h_grad(b) for blocks updated on the CPU
 * and once per step: reduce(b) (data parallel), norm, adam_gpu(b) (with h2d_param and
 * d2h_param around it when streamed) or adam_cpu(b) (and commit(b) when speculative),
 * allgather(b) (data parallel), h2d_update(b) for resident blocks updated on the CPU.
 * A disk block's update is per chunk of its shard (layout.h): disk_read(b, c) into a
 * disk slot, adam_cpu(b, c), disk_write(b, c); reads run ahead as far as the disk ring's
 * slots allow, from the previous step's write of the same chunk on.
 * An offloaded input (layout.h: offload_in) lives in an act-ring slot: the previous
 * block's forward takes one for its output, d2h_act(b) sends it to the host after
 * fwd(b) and gives it back; in backward h2d_act(b) fetches it into a slot before
 * recompute(b), which bwd(b) gives back, or, when the previous block recomputes too,
 * that block's recompute (it writes its output there again: the same bits).
 * Evaluation: forward, head, and collect(m).
 *
 * Each byte crosses once where it can: a recomputed layer's fetch serves its recompute
 * and its backward; an embedding's backward reads no weights and fetches none; a
 * fwd_rows table's forward fetches the micro-batch's rows, and a tied head fetches it
 * whole; a split table's gradient leaves in two parts (layout.h). Passes' fetches are
 * chained in program order, so the copy lane takes them in the order compute uses them.
 *
 * Dependencies are the data flow (each read after its write) plus the reuse of buffers
 * (a write after the previous reads: activations, the recompute area, token buffers, the
 * landing slot). Compute tasks' program positions give the next-use priorities across the
 * window's steps: after backward, block 0's gradient copy and update come first because
 * the next forward needs block 0 first. Staging slots are the scheduler's pools.
 *
 * Exactness: clipping needs the global norm before any update, so every update of step t
 * waits for norm(t) (the norm barrier; without it, a prediction measures what exact
 * clipping costs in overlap), except a speculative block's (plan.h): its adam_cpu runs
 * once its gradient is on the host and the previous step's norm has counted the steps,
 * into its spare side, and its commit(b) after norm(t) keeps, redoes or undoes it; the
 * block's next use waits for the commit.
 *
 * Threads: a graph is built and priced on one thread. */
#ifndef FY_STEP_BUILD_H
#define FY_STEP_BUILD_H

#include <stdbool.h>

#include "engine/tasks.h"
#include "offload/layout.h"
#include "scheduler/scheduler.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FY_PASS_LINKS FY_MODEL_MAX_LINKS

/* Where a backward pass writes a block's gradient: the staging unit task `unit_task`
 * took (a grad_zero, or the pass itself), or, with -1, the block's GRAD accumulator on
 * the device. writes_first: the pass writes it first in its micro-batch, so it zeroes it
 * (a unit it took itself always; the accumulator on the step's first micro-batch). */
typedef struct fy_grad_at { int unit_task; bool writes_first; } fy_grad_at;

/* A task's payload: the member of its kind. */
typedef struct fy_step_task {
    int micro;                 /* micro-batch in the window; per-step tasks: the step's last */
    int chunk;                 /* a chunked head's tasks: the vocabulary chunk; else -1 */
    union {
        struct { int reuse; } load;             /* the load that last used its host buffer */
        struct {                                /* h2d_param */
            bool for_update;                    /* the master, for a device update */
            bool rows;                          /* only the micro-batch's rows (layout.h:
                                                   a row-staged block's, a fwd_rows one's
                                                   forward) */
        } fetch;
        struct {                                /* fwd, recompute, head, bwd */
            int fetch;                          /* the block's fetch task, -1 resident */
            int link_fetch[FY_PASS_LINKS];      /* the linked blocks' fetches */
            fy_grad_at grad;                    /* head, bwd: the block's gradient */
            fy_grad_at link_grad[FY_PASS_LINKS];/* head, bwd: the linked blocks' */
            bool train;                         /* head: training (else evaluation) */
            int in_unit, out_unit;              /* the tasks whose act-ring units hold its
                                                   input and output (offloaded; -1: the
                                                   block's own buffers) */
        } pass;
        struct { int unit_task; } act;          /* d2h_act, h2d_act: the task whose act-ring
                                                   unit holds the input copied */
        struct {                                /* d2h_grad */
            int unit_task;                      /* the task whose unit holds the gradient */
            int part;                           /* a split tied table's (layout.h:
                                                   split_grad): 1 the rows the micro-batch's
                                                   tokens do not choose, after the head;
                                                   2 those they do, after its own backward;
                                                   0 the whole gradient */
        } d2h_grad;
        struct { int fetch; } update;           /* adam_gpu, d2h_param: the update's fetch,
                                                   -1 resident */
    } u;
} fy_step_task;

typedef struct fy_step_graph {
    fy_graph g;                /* tasks' run and ctx are NULL: the executor binds them */
    fy_step_task *task;        /* per task of g */
    int cap;
} fy_step_graph;

/* nsteps training steps (each an epoch of the scheduler), or nbatches evaluation
 * batches (each an epoch), under layout L. The graph is prioritized and unpriced. */
fy_status fy_step_build_train(const fy_layout *L, int nsteps, bool norm_barrier, fy_step_graph *out);
fy_status fy_step_build_eval(const fy_layout *L, int nbatches, fy_step_graph *out);
void fy_step_graph_free(fy_step_graph *sg);

/* Mean durations per (task kind, block): measured by a trainer, or the tuner's model.
 * Tasks of no block (load, norm, collect) use block -1. */
typedef struct fy_cost_table { int nblocks; double *sum_count; } fy_cost_table;
fy_status fy_cost_table_init(fy_cost_table *c, int nblocks);
void fy_cost_table_free(fy_cost_table *c);
void fy_cost_reset(fy_cost_table *c);
void fy_cost_add(fy_cost_table *c, fy_task_kind kind, int block, double ms);
void fy_cost_set(fy_cost_table *c, fy_task_kind kind, int block, double ms);
double fy_cost_mean(const fy_cost_table *c, fy_task_kind kind, int block); /* -1: none */

/* Every task's cost_ms from c: its kind's mean on its block (none: the scheduler's
 * default, fy_task_make); a fetch's and a gradient copy's by its bytes over the block's
 * staged copy's (a master for a device update, a fwd_rows block's rows, a split table's
 * parts): their costs are kept per staged copy (fy_step_copy_scale: a measured copy is
 * divided by it before it is added); a disk chunk's tasks by its share of the shard
 * (costs are kept per whole shard). */
void fy_step_graph_price(fy_step_graph *sg, const fy_layout *L, const fy_cost_table *c);
/* That scale of a task (1 but for fetches, gradient copies and disk chunks' tasks). */
double fy_step_copy_scale(const fy_step_graph *sg, const fy_layout *L, int task);
/* A step graph's work per lane (the sum of its tasks' costs). */
void fy_step_graph_busy(const fy_step_graph *sg, double busy_ms[FY_LANE_COUNT]);

#ifdef __cplusplus
}
#endif
#endif
