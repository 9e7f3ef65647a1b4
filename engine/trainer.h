/* trainer.h — one model being trained on one device under a placement plan, and the
 * optimizer steps over it.
 *
 * A trainer owns the storage of a run: the layout under its plan says where each
 * block's weights, master, gradient and AdamW moments live (offload/layout.h) and the
 * storage allocates them with staging slots and activations (offload/storage.h). It
 * knows the model only through the model interface (engine/model/model.h). A step runs
 * forward and backward over the plan's micro-batches, fetching streamed blocks into
 * staging slots, recomputing checkpointed layers in backward and sending the gradients
 * of cpu-optimised blocks to the host; it takes the global gradient norm (summed per
 * block in block order), clips, and updates every block where its optimizer lives,
 * sending updated weights back to the device. Steps run as a task graph on the
 * scheduler's lanes (built by step_build.c, run by step_exec.c), several in flight as
 * dependencies allow; evaluation runs through the same graph builder and staging pools.
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
 * Failure: a task that fails (its batch cannot be read, an injected fault) ends the window
 * with one error line naming the task. Steps before the failing one complete; the failing
 * step and later ones apply nothing, so the trainer can be retried (the same window
 * again continues exactly where it stopped: micro-batch numbers are absolute) or freed.
 * Only a failure inside the update of a step (which changes some blocks' weights and not
 * others) leaves the trainer broken: every later call but free refuses.
 *
 * Threads: a trainer is driven from one thread. */
#ifndef FY_TRAINER_H
#define FY_TRAINER_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "engine/comm/comm.h"
#include "engine/device/device.h"
#include "engine/io/safetensors.h"
#include "engine/model/model.h"
#include "offload/plan.h"
#include "offload/layout.h"
#include "offload/storage.h"
#include "engine/tasks.h"
#include "scheduler/scheduler.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Packed documents in the token stream (kernels.h: docs): none, or a document ends at each
 * `token` (FY_DOCS_EOT: the next position starts the next one), or starts at each `token`
 * (FY_DOCS_BOS), or the data says where each starts (FY_DOCS_DATA: the batch function
 * gives them, from the files' document starts, io/tokens.h). The trainer finds each
 * micro-batch's document starts from its inputs (or takes the data's); attention never
 * crosses them and positions restart at them. */
typedef enum fy_docs_kind { FY_DOCS_NONE = 0, FY_DOCS_EOT, FY_DOCS_BOS, FY_DOCS_DATA } fy_docs_kind;
typedef struct fy_doc_mask { fy_docs_kind kind; int32_t token; } fy_doc_mask;

/* The document starts of n rows of T inputs (docs[b*T + t], kernels.h) under mask m. */
void fy_doc_starts(const fy_doc_mask *m, const int32_t *tokens, int n, int T, int32_t *docs);

typedef struct fy_trainer_cfg {
    const fy_model *model; /* borrowed: must outlive the trainer */
    int B, T;          /* micro-batch (B is taken from the plan when one is given) */
    int grad_accum;    /* micro-batches per step (0 = 1; taken from the plan if given) */
    const fy_plan *plan; /* NULL: everything resident on the device */
    const char *disk_dir; /* the disk tier's scratch directory (offload/disk.h); needed
                             when the plan keeps state on disk */
    float beta1, beta2, eps, weight_decay;
    float clip;        /* global-norm clipping threshold; 0 = off */
    uint64_t seed;     /* initialisation when no weights are given */
    const fy_weights *weights; /* start from these (checked against the model), read one
                                  block at a time; NULL: initialised from seed */
    fy_sched_mode schedule; /* how the step's tasks are ordered (default priority) */
    int adam_threads;  /* cpu optimizer threads (0 = the device's thread count) */
    bool eval_only;    /* evaluation only: no gradients, moments or optimizer threads */
    fy_doc_mask docs;  /* packed documents (default none) */
    int micro_first, micro_total; /* data parallel with unequal shares (below) */
    atomic_int *stop;  /* data parallel: a stop request (non-zero: a signal came), decided
                          by all ranks together at each step's norm (that step then
                          applies nothing, FY_INTERRUPTED); may be NULL */
    int64_t test_nan_step; /* test hook: step n (1-based, counted over the run) takes its
                          gradient norm as NaN, so it is skipped (0: none) */
    bool test_speculate_first; /* test hook: each step's norm waits for its speculative
                                  updates (plan.h), so every one of them runs before the
                                  norm is known, whatever the timing: the path tests of
                                  speculation must take (the results are the same) */
    fy_comm *comm;     /* data parallel: the job's processes (borrowed; NULL: this process
                          alone). Each step is micro_total micro-batches (0: size x
                          grad_accum): this rank runs its grad_accum of them, from
                          micro_first on (0 with micro_total 0: rank x grad_accum), and
                          next_batch's numbers are the step's global ones;
                          the optimizer state is sharded (layout.h): each block's
                          gradient is summed over the ranks in rank order into each
                          shard's owner (comm.h; in a GPU's memory by NCCL, in its
                          order), the losses likewise, each rank updates its shards and
                          gathers the others' updated weights */
} fy_trainer_cfg;

typedef struct fy_step_stats {
    float loss;        /* mean over the step's counted targets (every micro-batch's, every
                          rank's) */
    int64_t targets;   /* the targets counted (B*T x the micro-batches without a loss
                          mask); none: the step applies nothing (skipped) */
    float grad_norm;   /* before clipping */
    float clip_coef;   /* applied scale (1 when not clipped) */
    bool skipped;      /* non-finite gradients, or no target counted: no update */
    int speculated;    /* blocks whose update ran before the norm (plan.h: speculate) */
    int kept;          /* of them, those whose speculation was the update (the others were
                          redone, or undone when skipped) */
    double step_ms;    /* from the end of the previous step's last task to this one's (the
                          window's first: from the window's start) */
    double done_ms;    /* when its last task ended, on fy_now_ms()'s clock */
} fy_step_stats;

/* Fills x and y (B*T tokens each, host memory) with micro-batch number `micro`: training
 * counts micro-batches from the trainer's first step (a retried window asks for the same
 * numbers again), evaluation from 0 in each call. A target the loss does not count is
 * negative (the data's loss mask: kernels.h). docs is NULL, or with FY_DOCS_DATA (B*T)
 * to fill with each position's document start (kernels.h). Called from the transfer
 * lane's thread, in order. A failure (logged) ends the window. */
typedef fy_status (*fy_batch_fn)(void *ctx, int64_t micro, int32_t *x, int32_t *y,
                                 int32_t *docs);
/* The targets micro-batch `micro` (numbered as fy_batch_fn's) counts: its y's that are not
 * negative. Any micro-batch of a step may be asked for, from any thread, before its batch
 * is read: a step's mean loss divides by the count over all its micro-batches, on every
 * rank, before their gradients exist. */
typedef int64_t (*fy_targets_fn)(void *ctx, int64_t micro);

typedef struct fy_trainer fy_trainer;

/* Allocates everything on dev and fills the weights from cfg->weights, or initialises
 * them from cfg->seed, a block at a time (one block of host memory besides the plan's). */
fy_status fy_trainer_new(fy_dev *dev, const fy_trainer_cfg *cfg, fy_trainer **out);
void fy_trainer_free(fy_trainer *tr); /* NULL is a no-op */

/* The mean measured duration of tasks of kind on block (-1: no block), or -1 if none
 * ran. Durations are the device's (between events around the task's work) for tasks on
 * device lanes. */
double fy_trainer_cost(const fy_trainer *tr, fy_task_kind kind, int block);
/* Forgets the measured durations (e.g. after warm-up steps). */
void fy_trainer_reset_costs(fy_trainer *tr);

const fy_model *fy_trainer_model(const fy_trainer *tr);
const fy_plan *fy_trainer_plan(const fy_trainer *tr); /* the plan it runs (its own copy) */
const fy_layout *fy_trainer_layout(const fy_trainer *tr); /* where its states live */

/* Replaces the weights with w's (every tensor checked against the model), a block at a
 * time. */
fy_status fy_trainer_load(fy_trainer *tr, const fy_weights *w);
/* Writes the weights (the fp32 masters) to path as fy_model_save, a block at a time. */
fy_status fy_trainer_save(fy_trainer *tr, const char *path, const fy_save_opts *o);

/* A window: nsteps optimizer steps run as one task graph. */
typedef struct fy_window {
    int nsteps;
    const float *lrs;          /* nsteps learning rates */
    fy_batch_fn next_batch;
    fy_targets_fn targets;     /* with batch_ctx; NULL: every target counts (no y is
                                  negative) */
    void *batch_ctx;
    fy_step_stats *stats;      /* out: nsteps (on failure, the first `completed`) */
    int completed;             /* out: steps applied (nsteps, unless a task failed) */
    fy_sched_result *trace;    /* optional out: the task records (free with
                                  fy_sched_result_free); with graph */
    fy_graph *graph;           /* optional out: the graph (free with fy_graph_free) */
} fy_window;

/* Runs a window. On a task failure the status is the task's (see the top). */
fy_status fy_trainer_run(fy_trainer *tr, fy_window *w);

/* Predicts, on the simulator, the run of nsteps steps under mode from the mean task
 * durations measured by earlier runs (tasks never measured take the scheduler's
 * default). Without norm_barrier, updates wait only for their own gradients (not what
 * training does: exact clipping and skipping a non-finite step need the global norm
 * first), which measures what the barrier costs. */
fy_status fy_trainer_predict(fy_trainer *tr, int nsteps, fy_sched_mode mode, bool norm_barrier,
                             fy_sched_result *out);

/* One optimizer step over the plan's grad_accum micro-batches: x and y hold
 * grad_accum*B*T tokens each (host memory), micro-batch after micro-batch; a negative y
 * is a target the loss does not count. */
fy_status fy_trainer_step(fy_trainer *tr, const int32_t *x, const int32_t *y, float lr,
                          fy_step_stats *out);
/* The mean loss of each of nbatches B x T batches (from next_batch, numbered from 0) over
 * its counted targets (0 for a batch with none), no gradients, into losses[nbatches], and
 * the targets counted into counts[nbatches] (may be NULL). */
fy_status fy_trainer_eval_run(fy_trainer *tr, int nbatches, fy_batch_fn next_batch, void *ctx,
                              float *losses, int64_t *counts);
/* Mean loss of one B x T batch, no gradients. */
fy_status fy_trainer_eval(fy_trainer *tr, const int32_t *x, const int32_t *y, float *loss);

/* Copies block b's parameters (the fp32 master) or current gradients to host
 * (fy_model_block(m, b)->nelem floats). A block whose gradient shares its bf16 weights'
 * buffer (layout.h: GRAD the same as HOST_WEIGHTS) has none after its update: false,
 * nothing copied. In a data-parallel job the optimizer state is sharded (layout.h): a bf16 run's masters
 * and every run's moments are gathered on rank 0 from their owners, which meanwhile run
 * fy_trainer_serve, until rank 0's fy_trainer_serve_end (other ranks may not call these
 * getters for them); a gradient outside this rank's shard is its own micro-batches'. */
fy_status fy_trainer_get_params(fy_trainer *tr, int b, float *host);
bool fy_trainer_get_grads(fy_trainer *tr, int b, float *host);
/* Block b's AdamW moments (fp32, nelem each) into host m and v (either may be NULL), or
 * replaced from them (a sharded job's rank keeps its shard): what a checkpoint stores and
 * restores, wherever the plan keeps them. These and fy_trainer_get_params fail
 * (FY_ERR_IO, logged) only when the state is on disk and the scratch file does. */
fy_status fy_trainer_get_moments(fy_trainer *tr, int b, float *m, float *v);
fy_status fy_trainer_set_moments(fy_trainer *tr, int b, const float *m, const float *v);
/* A sharded job's ranks but 0: sends this rank's shards as rank 0's getters ask, until
 * rank 0 ends (FY_ERR_IO when it says its save failed). FY_OK at once elsewhere. */
fy_status fy_trainer_serve(fy_trainer *tr);
/* Rank 0: the end of its getters' requests (failed: its save failed); a no-op elsewhere. */
fy_status fy_trainer_serve_end(fy_trainer *tr, bool failed);
/* Sets the counters a checkpoint restores: the updates applied (AdamW's bias correction
 * counts them) and the micro-batches of the steps run (the next window's first
 * micro-batch number, so batches continue where the checkpointed run was). */
void fy_trainer_set_progress(fy_trainer *tr, int64_t steps_done, int64_t micro_done);
int64_t fy_trainer_steps_done(const fy_trainer *tr);   /* updates applied */
int64_t fy_trainer_micro_done(const fy_trainer *tr);   /* micro-batches of finished steps */
const fy_storage *fy_trainer_storage(const fy_trainer *tr);

/* Test hook: the next task of `kind` on `block` (-1: any) of absolute micro-batch `micro`
 * (per-step tasks carry their step's last micro-batch; evaluation counts its own) fails
 * with status st after logging "injected failure", before it queues any work. */
void fy_trainer_inject_failure(fy_trainer *tr, fy_task_kind kind, int block, int64_t micro,
                               fy_status st);

#ifdef __cplusplus
}
#endif
#endif
