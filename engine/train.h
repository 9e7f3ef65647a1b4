/* train.h — the training loop and evaluation over data files, for a model and a plan the
 * caller resolved (the `ferry` command translates its options into these configs).
 *
 * fy_train: opens the data (files or the embedded corpus, with validation), the device
 * and a trainer, then runs the optimizer steps in windows (a window is one task graph;
 * it ends at a validation point), with the learning-rate schedule; prints a line per step
 * (or a progress display on long runs), appends JSON Lines metrics, evaluates, saves the
 * weights and the trace, and reports. fy_eval: the mean loss of weights over a data file
 * (over the targets its loss masks count, where it has them: tokens.h).
 * Both log their errors once and return a status. */
#ifndef FY_TRAIN_H
#define FY_TRAIN_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "engine/comm/comm.h"
#include "engine/device/device.h"
#include "engine/model/model.h"
#include "engine/trainer.h"
#include "offload/plan.h"
#include "offload/storage.h"
#include "scheduler/scheduler.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fy_train_cfg {
    /* what is trained */
    const fy_model *model;
    const fy_plan *plan;        /* micro-batch, accumulation, placement, storage type */
    const char *disk_dir;       /* the disk tier's directory (the plan keeps state on disk) */
    int seq;                    /* T */
    const fy_weights *init;     /* weights to start from, or NULL: initialised from seed */
    fy_comm *comm;              /* data parallel: the job's processes (NULL: alone); a step
                                   is then micro_total micro-batches (0: size x grad_accum),
                                   this rank's from micro_first (trainer.h), and
                                   only rank 0 should be given outputs (metrics, save,
                                   trace); rank 0 keeps the checkpoints (the other ranks
                                   serve it their shards of the optimizer state) and tells
                                   the others which to resume */
    int micro_first, micro_total;
    char sum_groups[96];        /* how the step's gradient is summed, for checkpoints: ""
                                   in micro-batch order (one process, or a job whose ranks
                                   after the first take one micro-batch each), else each
                                   rank's count ("2,2"): its micro-batches summed first */
    int64_t test_nan_step;      /* test hook (trainer.h): this step's norm is not finite */
    /* data: text or token shards; NULL data: the embedded corpus (with its own
     * validation text unless val_data is given) */
    const char *data, *val_data;
    double val_split;           /* without val_data: the last fraction of data */
    fy_doc_mask docs;           /* packed documents (trainer.h), in training and validation */
    /* the optimizer and its schedule */
    int64_t steps;
    double lr, min_lr;
    bool cosine;                /* linear warmup, then cosine to min_lr (else constant) */
    int64_t warmup;
    float weight_decay, beta1, beta2, eps, clip;
    uint64_t seed;
    /* where and how it runs */
    fy_dev_cfg dev;
    fy_sched_mode schedule;
    int adam_threads;
    /* evaluation and output */
    int64_t val_every, val_batches;  /* 0: validate only at the end */
    int64_t log_every;               /* 0: every step up to 100 steps, else 1/50 of the run */
    const char *save;                /* weights at the end (NULL: none) */
    fy_save_opts save_opts;          /* their type, shards, and the weights read (init) */
    const char *metrics;             /* JSON Lines appended per step (NULL: none) */
    const char *trace;               /* Chrome trace of every task (NULL: none) */
    bool predict;                    /* simulate every schedule with the measured times */
    bool quiet;
    /* checkpoints (engine/checkpoint.h) */
    const char *ckpt_dir;            /* NULL: none */
    int64_t ckpt_every;              /* steps between checkpoints (0: only at the end and
                                        when interrupted) */
    int ckpt_keep;                   /* checkpoints kept (0: 2) */
    const char *resume;              /* NULL: start afresh; "": from ckpt_dir's latest (or
                                        afresh when it has none yet); else a checkpoint */
    bool ckpt_sync;                  /* write checkpoints before going on, never from a
                                        snapshot in the background */
    size_t host_budget;              /* --host-mem (0: none): a snapshot must fit in it
                                        beside the plan's host state */
} fy_train_cfg;

/* Set, from a signal handler, to the signal's number: the run stops after the step in
 * progress, writes a checkpoint (with ckpt_dir), and fy_train returns FY_INTERRUPTED.
 * Atomic (lock-free, so a handler may store it): the transfer lane's thread reads it. */
extern atomic_int fy_train_stop_signal;

/* With checkpoints: resuming continues bit-exactly (every plan, every window split: the
 * data of step s is the same whatever came before, and the moments, counters and the
 * masters are restored), as a run that was never stopped. A resumed run's configuration
 * is checked against the checkpoint's: another model, sequence length, step size (in
 * sequences) or training data is refused; other changes (the plan, the micro-batch
 * split, hyperparameters, --steps) are allowed with a warning each where they make the
 * run differ from an uninterrupted one. A --metrics file loses the lines the stopped run
 * wrote after the checkpoint's step (this run writes them again). */
fy_status fy_train(const fy_train_cfg *cfg);

typedef struct fy_eval_cfg {
    const fy_model *model;
    const fy_weights *weights;
    const char *data;
    int batch, seq;
    int64_t batches;            /* 0: one pass over the data */
    fy_doc_mask docs;           /* packed documents (trainer.h) */
    fy_dtype dtype;             /* device storage */
    fy_dev_cfg dev;
} fy_eval_cfg;

typedef struct fy_eval_result {
    float loss;        /* the mean over every counted target evaluated */
    int64_t batches, tokens;
    int64_t targets;   /* the targets counted (tokens, without loss masks) */
    bool masked;       /* the data has loss masks */
} fy_eval_result;

fy_status fy_eval(const fy_eval_cfg *cfg, fy_eval_result *out);

/* Learning rate at 0-based step s of `steps`: constant, or linear warmup over `warmup`
 * steps ((s+1)/warmup * lr) then cosine from lr down to min_lr at the last step. */
double fy_lr_at(int64_t s, int64_t steps, double lr, double min_lr, int64_t warmup,
                bool cosine);

/* "plan    micro-batch B x A accumulated | ..." and the plan's memory model (from
 * fy_storage_model), as printed before training and by a dry run. */
void fy_train_print_plan(const fy_plan *plan, const fy_mem_model *mm, FILE *f);

#ifdef __cplusplus
}
#endif
#endif
