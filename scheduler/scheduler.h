/* scheduler.h — task graphs run on lanes by next-use priority: executor, simulator, trace.
 *
 * A task runs on one lane (compute, h2d, d2h, cpu, comm, disk). Lanes run concurrently; each lane
 * runs one task at a time, chosen among its ready tasks (all predecessors done) by the
 * mode:
 *   priority  the smallest priority value first (next use, below)
 *   fifo      the task that became ready first (ties: lower id)
 *   serial    one task at a time over all lanes, smallest priority first
 * Priorities are "next use": a task's priority is the smallest of its own program
 * position (use_pos, for compute work; -1 for none) and its successors' priorities, so a
 * transfer or an optimizer step runs as early as the first computation that waits on it
 * needs it (across iterations when the graph spans several). Call fy_graph_prioritize
 * after building and before executing or simulating.
 *
 * Resources: pools of interchangeable units (device staging slots). A task may acquire
 * one unit of a pool when it starts (it learns which, in unit) and a task may release
 * the unit another task acquired when it ends. Units are granted in priority order within
 * a pool, whatever the mode: a task waits while a better-priority task of the same pool
 * has not started, so prefetches never take the slots that earlier work needs (no
 * deadlock when every task's needs fit the pool alone).
 *
 * A unit's hand-over: a task granted a unit learns (unit_after) which task's end freed
 * it last, so work the task queues on a device can wait for that task's work first.
 *
 * Failure: run() returns a status. When a task fails, every task of its epoch and of
 * later epochs that has not started is cancelled (never run); tasks of earlier epochs
 * run to the end (an epoch is a step: earlier steps complete, the failing one and later
 * ones do not start anything more). Dependencies never go from a later epoch to an
 * earlier one, and a unit is given back in the epoch that took it (a unit may still pass
 * from a later epoch's task to an earlier one's). Units held by cancelled epochs are
 * given back once none of their tasks runs, after the graph's drain hook (if any) has
 * waited for the work they queued; a failure in an earlier epoch while later ones are
 * cancelled widens the cancellation and drains again. The status of the failure in the
 * earliest epoch is returned; each failing task is named in one error line (its own
 * detail, or the status when it logged none).
 *
 * The executor runs tasks' run() on one thread per lane; the simulator runs the same
 * graph under the same rules on virtual time with each task's cost_ms. Both can record a
 * trace (Chrome trace event JSON, one row per lane).
 *
 * Threads: build a graph on one thread; fy_sched_execute calls run() from lane threads
 * (a task's run must only touch what its dependencies make safe). */
#ifndef FY_SCHED_H
#define FY_SCHED_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum fy_lane {
    FY_LANE_COMPUTE = 0, FY_LANE_H2D, FY_LANE_D2H, FY_LANE_CPU,
    FY_LANE_COMM, /* collectives between the processes of a data-parallel job */
    FY_LANE_DISK, /* the disk tier's reads and writes */
    FY_LANE_COUNT
} fy_lane;
typedef enum fy_sched_mode { FY_SCHED_PRIORITY = 0, FY_SCHED_FIFO, FY_SCHED_SERIAL } fy_sched_mode;

const char *fy_lane_name(fy_lane l);
int fy_sched_mode_parse(const char *s, fy_sched_mode *out);
const char *fy_sched_mode_name(fy_sched_mode m);

#define FY_SCHED_MAX_POOLS 8
#define FY_SCHED_MAX_RELEASES 4 /* units one task may give back */

typedef struct fy_task fy_task;
/* A task's work; FY_OK, or a failure (see above). */
typedef fy_status (*fy_task_fn)(void *ctx, const fy_task *t);

struct fy_task {
    /* set by the builder */
    fy_lane lane;
    int kind, block, iter;       /* for the trace name and error lines */
    int epoch;                   /* failure scope (see above); >= 0 */
    int64_t use_pos;             /* compute tasks: program position; others -1 */
    double cost_ms;              /* estimate, for the simulator */
    double bytes, flops;         /* its work, for traces: bytes it moves (copies,
                                    collectives), matmul FLOPs it computes (0: none) */
    int acquire_pool;            /* -1: none */
    int release_of[FY_SCHED_MAX_RELEASES]; /* ids of tasks whose units this one releases;
                                              -1 none */
    fy_task_fn run;
    void *ctx;
    /* filled by the graph and the schedulers */
    int64_t prio;
    int unit;                    /* unit acquired (valid while running and after) */
    int unit_after;              /* the task whose end last freed that unit, or -1 */
    int *succ, *pred;
    int nsucc, capsucc, npred, cappred;
};

typedef struct fy_graph {
    fy_task *tasks;
    int n, cap;
    int npools;
    int pool_units[FY_SCHED_MAX_POOLS];
    const char *(*kind_name)(int kind); /* for traces and error lines */
    /* after a failure, before units of cancelled tasks are given back: wait for the work
     * those tasks queued (optional) */
    void (*drain)(void *ctx);
    /* called by a lane's thread before it picks its next task, without the scheduler's
     * lock (optional): a lane whose queued work is deep enough waits there, so that its
     * next pick is made as late as possible */
    void (*lane_wait)(void *ctx, fy_lane lane);
    void *hook_ctx;      /* for drain and lane_wait */
} fy_graph;

void fy_graph_init(fy_graph *g);
void fy_graph_free(fy_graph *g);
/* Adds a copy of *t (deps empty) and returns its id, or -1 (logged) out of memory. */
int fy_graph_add(fy_graph *g, const fy_task *t);
/* `after` may start only when `before` has ended. */
fy_status fy_graph_dep(fy_graph *g, int before, int after);
int fy_graph_pool(fy_graph *g, int units); /* new pool, returns its id */
/* Next-use priorities (see above). FY_ERR_INVALID (logged) if the graph has a cycle. */
fy_status fy_graph_prioritize(fy_graph *g);

/* A task with no pools and no releases, on lane, for kind/block/iter, epoch 0. */
fy_task fy_task_make(fy_lane lane, int kind, int block, int iter, fy_task_fn run, void *ctx);
/* "bwd(3) it 2": a task's name in traces and messages. */
void fy_task_name(const fy_graph *g, const fy_task *t, char *buf, size_t cap);

/* A record of when each task ran. */
typedef struct fy_trace_rec { int task; double start_ms, end_ms; } fy_trace_rec;
typedef struct fy_sched_result {
    double makespan_ms;
    double busy_ms[FY_LANE_COUNT];
    fy_trace_rec *recs;   /* n records in start order; owned, free with fy_sched_result_free */
    int nrecs;            /* the tasks that ran (all of them, unless one failed) */
    double t0_ms;         /* executor: fy_now_ms() at the start; record times are from it */
    int failed_task;      /* the first task that failed, or -1 */
} fy_sched_result;
void fy_sched_result_free(fy_sched_result *r);

/* Runs every task once, or, after a failure, what the failure leaves to run (see above)
 * and returns the failure's status. FY_ERR_INVALID (logged) if the graph cannot finish
 * (a cycle, a task needing a pool with no units, a dependency into an earlier epoch). */
fy_status fy_sched_execute(fy_graph *g, fy_sched_mode mode, fy_sched_result *out);
/* The same, on virtual time: a task takes cost_ms. run() is not called. */
fy_status fy_sched_simulate(fy_graph *g, fy_sched_mode mode, fy_sched_result *out);

/* Chrome trace event files (open in Perfetto or chrome://tracing): one row per lane,
 * each task named "<kind>(<block>) it <iter>", with its bytes and FLOPs. A buffer collects the runs of several
 * graphs (shifted by offset_ms) and is written at once. */
typedef struct fy_trace_buf {
    char *text;
    size_t len, cap;
    int nevents;
} fy_trace_buf;
fy_status fy_trace_append(fy_trace_buf *tb, const fy_graph *g, const fy_sched_result *r,
                          double offset_ms, int iter_offset);
fy_status fy_trace_save(const fy_trace_buf *tb, const char *path, const char *label);
void fy_trace_buf_free(fy_trace_buf *tb);
/* One graph's run, written at once. */
fy_status fy_sched_write_trace(const fy_graph *g, const fy_sched_result *r, const char *path,
                               const char *label);

#ifdef __cplusplus
}
#endif
#endif
