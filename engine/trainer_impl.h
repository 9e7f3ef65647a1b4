/* trainer_impl.h — the trainer's state, shared by trainer.c (construction, weights,
 * evaluation) and step_graph.c (the training step as a task graph). Not a public header. */
#ifndef FY_TRAINER_IMPL_H
#define FY_TRAINER_IMPL_H

#include "engine/trainer.h"
#include "optim_cpu/adam_pool.h"
#include "scheduler/scheduler.h"

struct fy_trainer {
    fy_dev *dev;
    fy_stream *s;            /* compute lane */
    fy_stream *s_h2d, *s_d2h;/* transfer lanes */
    fy_trainer_cfg cfg;
    fy_gpt2_layout lay;
    fy_plan plan;
    fy_storage *st;
    fy_adam_pool *pool;      /* cpu optimizer threads, if any block needs them */
    float **fetched;         /* eval only: per block, device parameters while fetched */
    int64_t steps_done;      /* updates applied (skipped steps do not count) */
    /* the window being run by fy_trainer_run */
    fy_batch_fn next_batch;
    void *batch_ctx;
    const float *lrs;
    fy_step_stats *stats;
    int64_t *adam_step;      /* per step of the window: the update's step number */
    int64_t micro_base;      /* micro-batches run before this window */
    const fy_graph *graph;   /* the window's graph, for runners that look up related tasks */
    int *gopen_id;           /* per micro-batch of the window: the embedding's gopen task */
    /* measured durations per (kind, block): sum and count, FY_T_COUNT x (nblocks + 1)
     * pairs; tasks of no block (load, norm) use the last column */
    double *cost_ms;
};

/* Block facts both halves of the trainer ask for. */
static inline bool fy_tr_streamed(const fy_trainer *tr, int b) {
    return tr->plan.blocks[b].params == FY_PARAMS_STREAMED;
}
static inline bool fy_tr_cpu_optim(const fy_trainer *tr, int b) {
    return tr->plan.blocks[b].optim == FY_OPTIM_CPU;
}
/* The storage type of parameters, gradients and activations on the device. */
static inline fy_dtype fy_tr_dt(const fy_trainer *tr) { return tr->st->dtype; }
static inline bool fy_tr_lp(const fy_trainer *tr) { return tr->st->dtype != FY_F32; }
/* Block b's device copy (parameters, gradients) in bytes; its fp32 master in bytes. */
static inline size_t fy_tr_nbytes(const fy_trainer *tr, int b) {
    return tr->lay.blocks[b].nelem * tr->st->es;
}
static inline size_t fy_tr_master_nbytes(const fy_trainer *tr, int b) {
    return tr->lay.blocks[b].nelem * sizeof(float);
}
/* Element i of a buffer of the storage type. */
static inline float *fy_tr_at(const fy_trainer *tr, const void *base, size_t i) {
    return (float *)((char *)base + i * tr->st->es);
}
/* Layer l's input: the previous layer's output, or the embedding's. */
static inline const float *fy_tr_layer_input(const fy_trainer *tr, int l) {
    return l ? tr->st->acts[l - 1].out : tr->st->x0;
}

/* The plan (a copy of cfg->plan, or all-resident from cfg) and layout of a new trainer;
 * also fixes cfg.B and cfg.grad_accum to the plan's. */
fy_status fy_trainer_setup_plan(fy_trainer *tr, const fy_trainer_cfg *cfg);

#endif
