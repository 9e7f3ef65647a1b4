/* plan.h — what a run places where, per block: the placement plan.
 *
 * Per block of the model (an embedding, layers, a head; model.h), where each of its
 * states lives and where its update runs:
 *   weights   device: resident (the copy compute reads stays in device memory)
 *             host: streamed (the copy lives in host memory and is fetched into a
 *             device staging slot for each use: forward, recompute, backward, update)
 *   update    gpu: AdamW runs on the device; cpu: optim_cpu runs it on the host, and the
 *             new weights go back to the device (resident blocks)
 *   master    the fp32 weights the update changes, where the update runs (a streamed
 *             block updated on the device keeps its master on the host; its update
 *             fetches it)
 *   grad      the step's gradient: where the update runs
 *   moments   AdamW's m and v: where the update runs
 *   acts      keep: the layer's activations stay until its backward; recompute: only
 *             its input is kept and backward reruns its forward (layers only); offload:
 *             recompute, with that input in pinned host memory, sent after its forward
 *             and fetched before its recompute (layers only)
 *   speculate with the update on the CPU: it may start as soon as the block's gradient
 *             is on the host, before the step's norm is known, writing its new master
 *             and moments beside the ones it keeps until the norm says the unclipped,
 *             finite update was the update (engine/step_build.h); 12 host bytes a
 *             parameter more (14 with bf16 storage, whose gradient then has a buffer
 *             apart from the host weights). One process only: a job's norm is known
 *             only after its reduces
 *   disk      with the update on the CPU: the fp32 master and AdamW's moments live in
 *             the run's scratch file under --disk-dir (offload/disk.h), read a chunk at
 *             a time (disk_chunk elements) into a host slot ahead of the update and
 *             written back after it; the master is then always a buffer of its own (with
 *             fp32 storage too: the host weights are a copy), so the gradient lands in
 *             the host weights with one micro-batch a step. Not with speculate
 * The plan chooses weights, update and acts; master, grad and moments follow from them
 * (fy_plan_where) and plan files state them, so a plan says per block where everything
 * lives. Exactly how (pinned or pageable host memory, shards, which buffers are shared)
 * is the layout's (layout.h), computed from the plan.
 * Plus the micro-batch size, the number of micro-batches accumulated per step, and the
 * storage type of what the device computes on (weights, gradients, activations): fp32,
 * or bf16 (fp32 masters and moments then stay wherever the update runs).
 *
 * Every plan computes the same numbers: on the cpu backend losses and weights are
 * bit-identical to the all-resident plan's (tests/test_offload.c).
 *
 * Plans are JSON files (fy_plan_load / fy_plan_save), version 2:
 *   {"format": "ferry-plan", "version": 2, "layers": L, "micro_batch": B, "grad_accum": N,
 *    "prefetch": 1, "dtype": "fp32",
 *    "blocks": [{"block": "embed", "weights": "device", "update": "gpu", "master": "device",
 *                "grad": "device", "moments": "device", "acts": "keep"},
 *               {"block": "layer.9", "weights": "host", "update": "cpu", "master": "disk",
 *                "grad": "host", "moments": "disk", "acts": "offload"},
 *               {"block": "layer.5", "weights": "host", "update": "cpu", ..., "speculate": true},
 *               {"block": "layer.0", ...}, ..., {"block": "head", ...}]}
 * master, grad and moments may be left out (they follow); given, they must be where they
 * follow, but "disk" for the master and moments of a cpu update puts them on disk (both
 * say it, or the one said does); "speculate" is said when true (cpu updates only);
 * "disk_chunk" (elements) when not the default. Version 1 files ("params": "resident"|"streamed", "optim": "gpu"|"cpu") load
 * as they always did. */
#ifndef FY_PLAN_H
#define FY_PLAN_H

#include <stdbool.h>
#include <stddef.h>

#include "engine/core/dtype.h"
#include "engine/core/status.h"
#include "engine/model/model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Where a state lives, as a plan says it. */
typedef enum fy_where { FY_ON_DEVICE = 0, FY_ON_HOST, FY_ON_DISK, FY_WHERES } fy_where;
/* Where a block's update runs. */
typedef enum fy_update_at { FY_UPDATE_DEVICE = 0, FY_UPDATE_CPU } fy_update_at;
typedef enum fy_acts_policy { FY_ACTS_KEEP = 0, FY_ACTS_RECOMPUTE, FY_ACTS_OFFLOAD } fy_acts_policy;
/* The states a plan file names beside the weights (fy_plan_where). */
typedef enum fy_plan_state { FY_PLAN_MASTER = 0, FY_PLAN_GRAD, FY_PLAN_MOMENTS, FY_PLAN_STATES } fy_plan_state;

#define FY_PLAN_MAX_ACCUM 1024

typedef struct fy_block_plan {
    fy_block_kind kind;    /* the model's block (fixed at fy_plan_new) */
    int layer;             /* layers: 0..L-1; else -1 */
    fy_where weights;      /* the copy compute reads: resident, or streamed from the host */
    fy_update_at update;
    fy_acts_policy acts;
    bool speculate;        /* update cpu: starts before the norm is known (above) */
    bool disk;             /* update cpu: its fp32 master and moments on disk (above) */
} fy_block_plan;

typedef struct fy_plan {
    int nblocks;           /* the model's blocks, in its order */
    int layers;            /* how many of them are layers */
    fy_block_plan *blocks;
    int micro_batch;       /* B */
    int grad_accum;        /* micro-batches per optimizer step */
    int prefetch;          /* staging slots beyond the serial minimum, so transfers can
                              run ahead of compute (default 1; 0 = least device memory) */
    fy_dtype dtype;        /* device storage: FY_F32 (default) or FY_BF16; FY_DTYPE_NONE
                              (a plan file without "dtype") means the run's default, and
                              is stored as fp32 */
    size_t disk_chunk;     /* elements of a disk block's shard read, updated and written
                              back at once (a multiple of 1024; 0: FY_DISK_CHUNK) */
} fy_plan;

/* The default disk chunk: 32M elements, 384 MiB of master and moments in a host slot. */
#define FY_DISK_CHUNK ((size_t)32 << 20)
#define FY_DISK_CHUNK_ALIGN ((size_t)1024) /* elements: 4 KiB of fp32, direct I/O's unit */

/* The all-resident plan for model m: everything on the device, nothing recomputed. */
fy_status fy_plan_new(const fy_model *m, int micro_batch, int grad_accum, fy_plan *out);
void fy_plan_free(fy_plan *p);
fy_status fy_plan_copy(const fy_plan *src, fy_plan *dst);

/* AutoHete's shorthands, on the layer blocks: stream the parameters of the first
 * ceil(params_ratio*L) layers, run the optimizer of the last ceil(optim_ratio*L) layers
 * on the CPU, recompute the first ckpt_layers layers. A ratio of 1 also moves the
 * embedding and head blocks (all of the model's parameters / optimizer). Ratios in
 * [0, 1], ckpt_layers in [0, L]; FY_ERR_INVALID (logged) otherwise. */
fy_status fy_plan_shorthands(fy_plan *p, double params_ratio, double optim_ratio,
                             int ckpt_layers);

/* Speculative CPU updates (above) for the cpu-updated blocks among the last
 * ceil(ratio*L) layers (a ratio of 1: also the embedding and the head), whose gradients
 * reach the host first; the others' are not. ratio in [0, 1]; FY_ERR_INVALID (logged)
 * otherwise. */
fy_status fy_plan_speculate(fy_plan *p, double ratio);

/* A plan file for model m: its blocks must be m's, by name and order. */
fy_status fy_plan_load(const char *path, const fy_model *m, fy_plan *out);
fy_status fy_plan_save(const char *path, const fy_plan *p);
/* The plan file's JSON object (NULL when out of memory; free with cJSON_Delete). */
struct cJSON *fy_plan_json(const fy_plan *p);

/* The master and moments of a fraction of the cpu-updated blocks on disk: those among
 * the last ceil(ratio*L) layers (whose gradients reach the host first and whose weights
 * the next forward needs last), and with a ratio of 1 the embedding and the head too.
 * ratio in [0, 1]; FY_ERR_INVALID (logged) otherwise, or when a chosen block speculates. */
fy_status fy_plan_disk(fy_plan *p, double ratio);
/* The inputs of the first ceil(ratio*L) layers offloaded to the host (acts offload: they
 * recompute). ratio in [0, 1]; FY_ERR_INVALID (logged) otherwise. */
fy_status fy_plan_offload_acts(fy_plan *p, double ratio);
/* Whether any block keeps its optimizer state on disk. */
bool fy_plan_uses_disk(const fy_plan *p);

/* FY_ERR_INVALID (logged) unless plan p fits model m (its blocks, recompute on layers
 * only, sizes in range). */
fy_status fy_plan_check(const fy_plan *p, const fy_model *m);
/* Where block plan bp keeps state s (the master, the gradient, the moments): where its
 * update runs, but a streamed block updated on the device keeps its master on the host,
 * and a disk block (update cpu) its master and moments on disk. */
fy_where fy_plan_where(const fy_block_plan *bp, fy_plan_state s);

/* "params streamed: layers 0-5 | optim cpu: layers 6-11, embed, head | recompute: none" */
void fy_plan_describe(const fy_plan *p, char *buf, size_t cap);
bool fy_plan_equal(const fy_plan *a, const fy_plan *b);

#ifdef __cplusplus
}
#endif
#endif
