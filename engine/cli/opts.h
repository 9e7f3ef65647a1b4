/* opts.h — every command-line option of every ferry command, in one table.
 *
 * The table (opts.c) gives each flag its type, default, range, the commands that take
 * it and its help text; the same table parses argv (defaults are parsed like user input),
 * checks ranges and prints --help, so a flag cannot be documented one way and parsed
 * another. Errors are one line naming the flag and the problem. */
#ifndef FY_OPTS_H
#define FY_OPTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/core/status.h"
#include "engine/device/device.h"
#include "scheduler/scheduler.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { FY_CMD_TRAIN = 1 << 0, FY_CMD_EVAL = 1 << 1, FY_CMD_INFO = 1 << 2, FY_CMD_PROBE = 1 << 3,
       FY_CMD_TUNE = 1 << 4, FY_CMD_SWEEP = 1 << 5 };

typedef struct fy_opts {
    /* device */
    const char *device;
    const char *matmul;
    const char *dtype;
    size_t gpu_mem;            /* this process's (train in a job: its rank's entry) */
    const char *gpu_mem_list;  /* --gpu-mem S0,S1,...: a job's, one per rank; NULL: one value */
    double sim_pcie_gbps;
    const char *sim_slowdown;  /* per rank, comma-separated */
    int64_t threads;
    /* model */
    const char *model;
    const char *init;
    int64_t heads, layers, channels, vocab, max_seq; /* 0: the named model's */
    int64_t kv_heads, ffn;                           /* Llama's; 0: the named model's */
    /* data */
    const char *data;
    const char *val_data;
    double val_split;
    int64_t batch, seq, grad_accum;
    int64_t chunk_tokens;      /* a layer's position-wise work per chunk (model.h) */
    const char *doc_mask;      /* none | eot[=ID] | bos[=ID] */
    const char *batch_shares;  /* equal | auto | n0,n1,... */
    /* schedule and optimizer */
    int64_t steps;
    double lr, min_lr;
    const char *lr_schedule;
    int64_t warmup;
    double weight_decay, beta1, beta2, eps, clip;
    int64_t seed;
    /* placement plan */
    const char *plan;
    const char *save_plan;
    double offload_params, offload_optim, speculate, disk_optim, offload_acts;
    const char *disk_dir;      /* the disk tier's scratch directory (train; probe: to measure) */
    size_t disk_mem;           /* its budget (0: the filesystem's free space) */
    int64_t ckpt_layers;
    bool dry_run;
    /* scheduling */
    const char *schedule;
    const char *trace;
    int64_t adam_threads;
    int64_t ranks;             /* tune: plan each rank of a job of this many */
    bool predict;
    /* probe and tune */
    const char *profile;
    const char *out;
    size_t host_mem;
    size_t pinned_mem;
    const char *grid;
    bool simulate;
    bool capacity;
    size_t disk_probe_size;
    /* evaluation and output */
    int64_t val_every, val_batches, batches, log_every;
    const char *save;
    const char *save_dtype;
    size_t save_shard_size;
    const char *metrics;
    const char *ckpt_dir;
    int64_t ckpt_every, ckpt_keep;
    bool ckpt_sync;
    const char *resume; /* NULL: not given; "": the latest in ckpt_dir; else a checkpoint */
    bool quiet;
    unsigned set_mask[4]; /* which table entries the user gave (bit per entry) */
} fy_opts;

/* Parses argv[first..argc) for command cmd (FY_CMD_*) into o, defaults first.
 * Returns 0, 1 if --help was printed, or -1 after logging one error line. */
int fy_opts_parse(fy_opts *o, unsigned cmd, int argc, char **argv, int first);
/* Whether the user gave flag `name` (without dashes). */
bool fy_opts_given(const fy_opts *o, const char *name);
/* The device the options ask for. --device auto is cuda when a GPU is present and
 * --sim-pcie-gbps is not set, else cpu (with a notice unless --quiet). With need_gpu,
 * --device cuda on a machine without a usable GPU is an error (logged) here, before any
 * work; without it (planning: --dry-run, tune) the kind is returned as asked. */
fy_status fy_opts_dev_cfg(const fy_opts *o, bool need_gpu, fy_dev_cfg *out);
/* --dtype: fp32, bf16, or auto = bf16 on kind cuda, fp32 on cpu. */
fy_dtype fy_opts_dtype(const fy_opts *o, fy_dev_kind kind);
/* --schedule: the task order a run uses (train) and the simulator predicts (tune, sweep,
 * train --plan auto); priority when unset. The option table checked the name. */
fy_sched_mode fy_opts_schedule(const fy_opts *o);
/* The kind --device names, auto resolved by looking for a GPU (no notice, no error). */
fy_dev_kind fy_opts_dev_kind(const fy_opts *o);
void fy_opts_help(unsigned cmd, const char *usage);
/* The value of string option `name` (NULL when unset; "" for --resume without a PATH). */
const char *fy_opts_str(const fy_opts *o, const char *name);
/* Whether command cmd (FY_CMD_*) takes option `name`. */
bool fy_opts_takes(unsigned cmd, const char *name);
/* A per-rank flag's value (--gpu-mem, --profile): how many comma-separated values it
 * gives, and rank `rank`'s of a job of `world` (the one value when it gives one, else
 * its rank-th), into out; one error line naming the flag when it gives neither one nor
 * world values, or rank's is empty or longer than cap - 1. */
int fy_opts_list_count(const char *value);
fy_status fy_opts_rank_item(const char *flag, const char *value, int world, int rank, char *out,
                            size_t cap);
/* The table, for tests: how many options, and option i's name, metavar (NULL for a switch)
 * and the commands that take it. */
int fy_opts_count(void);
void fy_opts_at(int i, const char **name, const char **metavar, unsigned *cmds);

/* Every file and directory the command's flags name, read and written, checked against
 * each other before anything is written (engine/io/paths.h; opts_paths.c): FY_ERR_USAGE
 * after one error line naming both flags when an output would land on an input or on
 * another output. --save may replace --init (a fine-tune in place). */
fy_status fy_opts_check_paths(const fy_opts *o, unsigned cmd);
/* Whether option `name` names a path that fy_opts_check_paths registers. */
bool fy_opts_is_path(const char *name);

#ifdef __cplusplus
}
#endif
#endif
