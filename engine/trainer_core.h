/* trainer_core.h — the trainer's state, shared by its parts: trainer.c (construction,
 * weights), trainer_state.c (a block's state read and written, a sharded job's gathered
 * on rank 0), step_exec.c (the executor: windows of the step graph) and step_run.c (the
 * tasks' runners). Not a public header. */
#ifndef FY_TRAINER_CORE_H
#define FY_TRAINER_CORE_H

#include <stdatomic.h>

#include "engine/step_build.h"
#include "engine/trainer.h"
#include "optim_cpu/adam_pool.h"
#include "scheduler/scheduler.h"

/* How many tasks a device lane may have queued and not done: one running, one waiting
 * behind it, so the device never idles for the host, while each next pick is made late
 * (bench/RESULTS.md: deeper queues commit transfers to an order a task ready a moment
 * later cannot jump). */
#define FY_RUN_AHEAD 2

/* The executor's state: the window being run and what its tasks bind to. */
typedef struct fy_exec {
    fy_batch_fn next_batch;
    void *batch_ctx;
    const float *lrs;
    fy_step_stats *stats;
    int64_t *adam_step;      /* per step of the window: the update's step number */
    int64_t *step_targets;   /* per step of the window: the targets it counts (over the
                                job), its mean loss's divisor */
    float *eval_losses;      /* evaluation: per batch */
    int64_t *eval_counts;    /* evaluation: per batch, its targets counted (at its load) */
    bool eval;               /* the window evaluates (batches number from eval_base) */
    int64_t eval_base;
    const fy_step_graph *sg; /* the window's graph */
    fy_event **ev_start, **ev_end; /* per task of the graph: around its queued work */
    int nev;
    fy_event *ev_anchor;     /* the window's time origin on the device */
    double *host_start;      /* per task of the graph: host tasks' start after their waits */
    int nhost_start;
    /* per device lane: the tasks whose queued work may not be done yet, oldest first */
    int ahead[FY_LANE_COUNT][FY_RUN_AHEAD];
    int nahead[FY_LANE_COUNT];
    int rows_fetch_last;     /* the window's last row-staged fetch (its copy reads the
                                pinned rows buffer), or -1 */
    /* (its working buffers are allocated with the storage: fy_storage.win) */
    int nrows[2];            /* per token buffer: the row-staged block's rows */
    /* speculative updates (step_run.c), read and written on the cpu lane only */
    bool *spec_wrote;        /* per block: its speculative update wrote its spare side
                                (and, with the master apart, its host weights), not yet
                                committed */
    double spec_ss;          /* the sums of squares of this step's blocks updated so far */
    int normed;              /* the window's last step whose norm is known, -1 none */
    bool prev_clipped;       /* the last step whose norm is known clipped or was skipped */
} fy_exec;

struct fy_trainer {
    fy_dev *dev;
    fy_stream *s;            /* compute lane */
    fy_stream *s_h2d, *s_d2h;/* transfer lanes */
    fy_stream *s_comm;       /* the comm lane's, with device collectives (else NULL: the
                                lane's work is host work) */
    fy_trainer_cfg cfg;
    const fy_model *model;
    fy_plan plan;
    fy_storage *st;
    const fy_layout *L;      /* the storage's layout: where every state is */
    fy_adam_pool *pool;      /* cpu optimizer threads, if any block needs them */
    int64_t steps_done;      /* updates applied (skipped steps do not count) */
    int64_t micro_base;      /* micro-batches of the steps run before this window */
    bool broken;             /* a failed window left a step partly applied */
    fy_comm *comm;           /* data parallel (NULL: alone) */
    int world, rank;         /* the job's processes, this one's rank */
    int64_t micro_first, micro_total; /* a step's micro-batches over the job, and this
                                 rank's first (trainer.h) */
    size_t *part_region;     /* sharded: where each rank's norm chunk sums start in
                                parts_host (world + 1 entries) */
    size_t *part_base;       /* sharded: per block, where its chunk sums start in this
                                rank's (the same offsets in parts_dev) */
    fy_cost_table costs;     /* measured durations per (kind, block) */
    fy_exec ex;
    /* the test hook: claimed (atomically: lanes run concurrently) by the one task it hits */
    struct { atomic_bool armed; int kind, block; int64_t micro; fy_status st; } inject;
};

/* Block facts every part asks for. */
static inline int fy_tr_nblocks(const fy_trainer *tr) { return tr->L->nblocks; }
static inline const fy_block_layout *fy_tr_blk(const fy_trainer *tr, int b) {
    return &tr->L->blocks[b];
}
/* Block b's shard bounds over the job's ranks: off[0..world] (layout.h). */
static inline void fy_tr_shards(const fy_trainer *tr, int b, size_t *off) {
    fy_shard_bounds(tr->L->blocks[b].nelem, tr->world, off);
}
/* The storage type of weights, gradients and activations on the device, and its size. */
static inline fy_dtype fy_tr_dt(const fy_trainer *tr) { return tr->L->dtype; }
static inline size_t fy_tr_es(const fy_trainer *tr) { return tr->L->es; }
/* Block b's copy in the storage type, in bytes. */
static inline size_t fy_tr_nbytes(const fy_trainer *tr, int b) {
    return tr->L->blocks[b].nelem * tr->L->es;
}
/* Block b's state s (its buffer), or element i of the block in it. */
static inline void *fy_tr_ptr(const fy_trainer *tr, int b, fy_state s) {
    return fy_storage_ptr(tr->st, b, s);
}
static inline void *fy_tr_at(const fy_trainer *tr, int b, fy_state s, size_t i) {
    return fy_storage_at(tr->st, b, s, i);
}
static inline bool fy_tr_on_device(const fy_trainer *tr, int b, fy_state s) {
    return fy_layout_state(tr->L, b, s)->tier == FY_TIER_DEVICE;
}

/* State s of block b, fp32 values of its range at host + lo (trainer_state.c): read back
 * (widened from its dtype), or written (fp32 states of their own). FY_ERR_IO (logged)
 * when it is on disk and the scratch file fails. */
fy_status fy_trainer_read_state(fy_trainer *tr, int b, fy_state s, float *host);
fy_status fy_trainer_write_state(fy_trainer *tr, int b, fy_state s, const float *host);
/* The elements of one disk state a disk slot holds (its part: storage.h). */
static inline size_t fy_tr_disk_piece(const fy_trainer *tr) {
    return tr->st->disk_ring.nbytes / FY_DISK_STATES / sizeof(float);
}
/* Elements [lo, lo + n) of block b's disk state s (n at most fy_tr_disk_piece) between
 * the scratch file and the first disk slot (written from it, padded with zeros to the
 * file's 4 KiB; or read into it): only between windows, when no task uses that slot.
 * FY_ERR_IO (logged by the disk). */
fy_status fy_trainer_disk_piece(fy_trainer *tr, int b, fy_state s, size_t lo, size_t n, bool write);
/* A disk state's range (its place's lo..hi) read into, or written from, host + lo, a
 * piece at a time (fy_trainer_disk_piece). */
fy_status fy_trainer_disk_state(fy_trainer *tr, int b, fy_state s, float *host, bool write);

/* A sharded job's rank: where each rank's norm chunk sums go (part_region, part_base;
 * trainer_state.c). */
fy_status fy_trainer_setup_parts(fy_trainer *tr);

/* The executor (step_exec.c): runs graph sg (built for this trainer's layout) on its
 * lanes, with events around every task, and gives the records the device's times. */
fy_status fy_exec_run(fy_trainer *tr, fy_step_graph *sg, fy_sched_result *res);
/* The executor's state for a new trainer (its working buffers' initial values). */
fy_status fy_exec_init(fy_trainer *tr);
/* Frees the executor's per-task state (events, host times). */
void fy_exec_free(fy_exec *ex);
/* Host work inside device-lane task `id` (a fetch gathering rows from host memory) waits
 * here for its predecessors' work on the other device lanes (a d2h_param writing those
 * host weights): its stream's waits order only the device's work. */
void fy_exec_host_after(const fy_trainer *tr, int id);
/* The runner of each task kind (step_run.c), and the step number of a task. */
typedef fy_status (*fy_runner)(fy_trainer *tr, int id, const fy_task *t, const fy_step_task *p);
extern const fy_runner fy_runners[FY_T_COUNT];
/* The batch number next_batch is asked for (step_run.c). */
int64_t fy_exec_abs_micro(const fy_trainer *tr, const fy_step_task *p);
/* After a failed window: a block whose gradient landed in its host weights gets them
 * back from its master (step_run.c), and a job's shards of them from their owners. */
void fy_run_restore_weights(fy_trainer *tr, int b);
/* Whether task t, run, applied part of its step's update (an adam task, a commit). */
bool fy_run_applies(const fy_trainer *tr, const fy_task *t);
fy_status fy_run_gather_weights(fy_trainer *tr, int b);

#endif
