/* trainer.h — one model being trained on one device under a placement plan, and one
 * optimizer step over it.
 *
 * A trainer owns the storage of a run (offload/storage.h: each block's parameters,
 * gradients and AdamW moments where the plan puts them, staging slots, activations).
 * A step runs forward and backward over the plan's micro-batches, fetching streamed
 * blocks into staging slots, recomputing checkpointed layers in backward and sending the
 * gradients of cpu-optimised blocks to the host; it takes the global gradient norm
 * (summed per block in block order), clips, and updates every block where its optimizer
 * lives, sending updated weights back to the device. The step runs as a task graph on
 * the scheduler's lanes (step_graph.c), several steps in flight as dependencies allow.
 *
 * Invariance: every plan computes the same floating-point operations in the same order
 * (micro-batch gradients are produced into zeroed buffers and accumulated with one add
 * per element wherever they live; device and host AdamW and norms share their
 * arithmetic), so on the cpu backend losses and weights are bit-identical across plans.
 *
 * Clipping follows torch.nn.utils.clip_grad_norm_: coef = clip / (norm + 1e-6), applied
 * when below 1. A non-finite norm skips the update (nothing changes, the step counter
 * does not advance) and is reported in the stats.
 *
 * Threads: a trainer is driven from one thread. */
#ifndef FY_TRAINER_H
#define FY_TRAINER_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/device/device.h"
#include "engine/io/safetensors.h"
#include "engine/model/gpt2.h"
#include "offload/plan.h"
#include "offload/storage.h"
#include "scheduler/scheduler.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fy_trainer_cfg {
    fy_gpt2_config model;
    int B, T;          /* micro-batch (B is taken from the plan when one is given) */
    int grad_accum;    /* micro-batches per step (0 = 1; taken from the plan if given) */
    const fy_plan *plan; /* NULL: everything resident on the device */
    float beta1, beta2, eps, weight_decay;
    float clip;        /* global-norm clipping threshold; 0 = off */
    uint64_t seed;     /* initialisation when no weights are loaded */
    fy_sched_mode schedule; /* how the step's tasks are ordered (default priority) */
    int adam_threads;  /* cpu optimizer threads (0 = the device's thread count) */
    bool eval_only;    /* evaluation only: no gradients, moments or optimizer threads */
} fy_trainer_cfg;

typedef struct fy_step_stats {
    float loss;        /* mean over the step's micro-batches */
    float grad_norm;   /* before clipping */
    float clip_coef;   /* applied scale (1 when not clipped) */
    bool skipped;      /* non-finite gradients: no update */
    double step_ms;    /* from the end of the previous step's last task to this one's */
} fy_step_stats;

/* Fills x and y (B*T tokens each, host memory) with global micro-batch number `micro`.
 * Called from the transfer lane's thread, in micro-batch order. */
typedef void (*fy_batch_fn)(void *ctx, int64_t micro, int32_t *x, int32_t *y);

typedef struct fy_trainer fy_trainer;

/* Allocates everything on dev and initialises the weights from cfg->seed. */
fy_status fy_trainer_new(fy_dev *dev, const fy_trainer_cfg *cfg, fy_trainer **out);
void fy_trainer_free(fy_trainer *tr); /* NULL is a no-op */

/* A trainer for planning only: the plan, its storage tables and memory model, and a task
 * cost table, with no device and no memory. fy_trainer_predict works on it (after
 * fy_trainer_set_cost); nothing else may be called but fy_trainer_storage/layout/free. */
fy_status fy_trainer_new_dry(const fy_trainer_cfg *cfg, fy_trainer **out);

/* Task kinds of the step graph, for cost tables (see step_graph.c). */
typedef enum fy_task_kind {
    FY_T_LOAD = 0, FY_T_H2D_PARAM, FY_T_FWD, FY_T_GOPEN, FY_T_HEAD, FY_T_RECOMPUTE, FY_T_BWD,
    FY_T_D2H_GRAD, FY_T_NORM, FY_T_ADAM_GPU, FY_T_D2H_PARAM, FY_T_ADAM_CPU, FY_T_H2D_UPDATE,
    FY_T_COUNT
} fy_task_kind;
const char *fy_task_kind_name(int kind);

/* The mean measured duration of tasks of kind on block (-1: no block), or -1 if none
 * ran; and setting it (a planning trainer's cost model). */
double fy_trainer_cost(const fy_trainer *tr, fy_task_kind kind, int block);
void fy_trainer_set_cost(fy_trainer *tr, fy_task_kind kind, int block, double ms);
/* Forgets the measured durations (e.g. after warm-up steps). */
void fy_trainer_reset_costs(fy_trainer *tr);

const fy_gpt2_layout *fy_trainer_layout(const fy_trainer *tr);

/* Replaces the weights with a file's (shape checked against the trainer's model). */
fy_status fy_trainer_load(fy_trainer *tr, const fy_st_file *f);
fy_status fy_trainer_save(fy_trainer *tr, const char *path);

/* Runs nsteps optimizer steps as one task graph (steps overlap as dependencies allow),
 * with learning rates lrs[nsteps], micro-batches from next_batch, and fills stats[nsteps].
 * If trace is set, the run's task records are kept there (free with
 * fy_sched_result_free) and *graph_out gets the graph (free with fy_graph_free). */
fy_status fy_trainer_run(fy_trainer *tr, int nsteps, const float *lrs, fy_batch_fn next_batch,
                         void *ctx, fy_step_stats *stats, fy_sched_result *trace,
                         fy_graph *graph_out);

/* Predicts, on the simulator, the run of nsteps steps under mode from the mean task
 * durations measured by earlier fy_trainer_run calls. Without norm_barrier, updates wait
 * only for their own gradients (not what training does: exact clipping and skipping a
 * non-finite step need the global norm first), which measures what the barrier costs. */
fy_status fy_trainer_predict(fy_trainer *tr, int nsteps, fy_sched_mode mode, bool norm_barrier,
                             fy_sched_result *out);

/* One optimizer step over the plan's grad_accum micro-batches: x and y hold
 * grad_accum*B*T tokens each (host memory), micro-batch after micro-batch. */
fy_status fy_trainer_step(fy_trainer *tr, const int32_t *x, const int32_t *y, float lr,
                          fy_step_stats *out);
/* Mean loss of one B x T batch, no gradients. */
fy_status fy_trainer_eval(fy_trainer *tr, const int32_t *x, const int32_t *y, float *loss);

/* Copies block b's parameters or current gradients to host (blocks[b].nelem floats). */
void fy_trainer_get_params(fy_trainer *tr, int b, float *host);
void fy_trainer_get_grads(fy_trainer *tr, int b, float *host);
int64_t fy_trainer_steps_done(const fy_trainer *tr);
const fy_storage *fy_trainer_storage(const fy_trainer *tr);

#ifdef __cplusplus
}
#endif
#endif
