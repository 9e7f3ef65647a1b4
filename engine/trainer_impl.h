/* trainer_impl.h — the trainer's state, shared by trainer.c (construction, weights,
 * reading back) and step_graph.c (training and evaluation as task graphs). Not a public
 * header. */
#ifndef FY_TRAINER_IMPL_H
#define FY_TRAINER_IMPL_H

#include <stdatomic.h>

#include "engine/trainer.h"
#include "optim_cpu/adam_pool.h"
#include "scheduler/scheduler.h"

typedef struct sg_task sg_task; /* a task's typed payload (step_graph.c) */

/* How many tasks a device lane may have queued and not done: one running, one waiting
 * behind it, so the device never idles for the host, while each next pick is made late
 * (bench/RESULTS.md: deeper queues commit transfers to an order a task ready a moment
 * later cannot jump). */
#define FY_RUN_AHEAD 2

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
    fy_adam_pool *pool;      /* cpu optimizer threads, if any block needs them */
    int64_t steps_done;      /* updates applied (skipped steps do not count) */
    int64_t micro_base;      /* micro-batches of the steps run before this window */
    bool broken;             /* a failed window left a step partly applied */
    /* the window being run (step_graph.c) */
    fy_batch_fn next_batch;
    void *batch_ctx;
    const float *lrs;
    fy_step_stats *stats;
    int64_t *adam_step;      /* per step of the window: the update's step number */
    float *eval_losses;      /* evaluation: per batch */
    bool eval;               /* the window evaluates (batches number from eval_base) */
    int64_t eval_base;
    const fy_graph *graph;   /* the window's graph, for runners that look up related tasks */
    sg_task *sgt;            /* per task of the graph: its payload */
    int sgt_cap;
    fy_event **ev_start, **ev_end; /* per task of the graph: around its queued work */
    int nev;
    fy_event *ev_anchor;     /* the window's time origin on the device */
    fy_comm *comm;           /* data parallel (NULL: alone) */
    size_t *part_region;     /* sharded: where each rank's norm chunk sums start in
                                parts_host (world + 1 entries) */
    size_t *part_base;       /* sharded: per block, where its chunk sums start in this
                                rank's (the same offsets in parts_dev) */
    int world, rank;         /* the job's processes, this one's rank */
    int64_t micro_first, micro_total; /* a step's micro-batches over the job, and this
                                 rank's first (trainer.h) */
    int gather_last;         /* the window's last gathered fetch (its copy reads the
                                pinned rows buffer), or -1 */
    double *host_start;      /* per task of the graph: host tasks' start after their waits */
    int nhost_start;
    /* per device lane: the tasks whose queued work may not be done yet, oldest first */
    int ahead[FY_LANE_COUNT][FY_RUN_AHEAD];
    int nahead[FY_LANE_COUNT];
    /* measured durations per (kind, block): sum and count, FY_T_COUNT x (nblocks + 1)
     * pairs; tasks of no block (load, norm) use the last column */
    double *cost_ms;
    /* the test hook: claimed (atomically: lanes run concurrently) by the one task it hits */
    struct { atomic_bool armed; int kind, block; int64_t micro; fy_status st; } inject;
};

/* Block facts both halves of the trainer ask for. */
static inline bool fy_tr_streamed(const fy_trainer *tr, int b) {
    return tr->plan.blocks[b].params == FY_PARAMS_STREAMED;
}
static inline bool fy_tr_cpu_optim(const fy_trainer *tr, int b) {
    return tr->plan.blocks[b].optim == FY_OPTIM_CPU;
}
static inline int fy_tr_nblocks(const fy_trainer *tr) { return tr->plan.nblocks; }
static inline const fy_block_spec *fy_tr_block(const fy_trainer *tr, int b) {
    return fy_model_block(tr->model, b);
}
/* Block b's shard bounds over the job's ranks: off[0..world] (storage.h). */
static inline void fy_tr_shards(const fy_trainer *tr, int b, size_t *off) {
    fy_shard_bounds(tr->st->chunks[b].nelem, tr->world, off);
}
/* The storage type of parameters, gradients and activations on the device. */
static inline fy_dtype fy_tr_dt(const fy_trainer *tr) { return tr->st->dtype; }
static inline bool fy_tr_lp(const fy_trainer *tr) { return tr->st->dtype != FY_F32; }
/* Block b's device copy (parameters, gradients) in bytes; its fp32 master in bytes. */
static inline size_t fy_tr_nbytes(const fy_trainer *tr, int b) {
    return fy_tr_block(tr, b)->nelem * tr->st->es;
}
static inline size_t fy_tr_master_nbytes(const fy_trainer *tr, int b) {
    return fy_tr_block(tr, b)->nelem * sizeof(float);
}
/* Element i of a buffer of the storage type. */
static inline float *fy_tr_at(const fy_trainer *tr, const void *base, size_t i) {
    return (float *)((char *)base + i * tr->st->es);
}

/* The plan (a copy of cfg->plan, or all-resident from cfg) of a new trainer, checked
 * against the model; also fixes cfg.B and cfg.grad_accum to the plan's. */
fy_status fy_trainer_setup_plan(fy_trainer *tr, const fy_trainer_cfg *cfg);
/* Frees the step graph's per-task state (payloads, events). */
void fy_trainer_graph_free(fy_trainer *tr);

#endif
