/* layout.h — where every state of a training run lives: one table, computed, then asked.
 *
 * Design. A run's placement questions ("where is block b's fp32 master?", "does its
 * gradient share the host weights' buffer?", "which staging ring does it use?") have one
 * answer each, computed once by fy_layout_new from (model, plan, T, training, world,
 * rank) and allocating no state: the tuner computes layouts by the hundred thousand,
 * storage (storage.h) allocates what one of them lists, and the trainer, the step graph
 * and the checkpoint code ask it. Nothing else derives placement from the plan.
 *
 * Per block, each state has a place (fy_place): a tier, a dtype, the range of the
 * block's elements its buffer holds (whole, or this rank's shard), and whether it is a
 * buffer of its own or another state's:
 *   WEIGHTS       the copy compute reads, in the storage type, on the device: resident
 *                 blocks (streamed ones are fetched into staging slots from HOST_WEIGHTS)
 *   MASTER        the fp32 weights the update changes: on the device (a resident block
 *                 updated there), or in host memory; with fp32 storage it is the WEIGHTS
 *                 or HOST_WEIGHTS buffer itself (same_as), but for a block updated on the
 *                 CPU in a job with one micro-batch a step, whose gradient lands in its
 *                 host weights: its shard's master then has a buffer of its own
 *   HOST_WEIGHTS  the storage type's copy in host memory: a streamed block's source for
 *                 fetches, a cpu-updated block's output (sent to WEIGHTS after the update)
 *   GRAD          the step's gradient: a device accumulator (updated on the device), or
 *                 host memory (updated on the CPU); with one micro-batch a step and the
 *                 master apart, HOST_WEIGHTS' buffer (same_as: the gradient lands there
 *                 once the step's reads of the weights are done, and CPU AdamW reads each
 *                 element before it writes the weight over it, so a fully offloaded bf16
 *                 run holds 14 bytes a parameter on the host, not 16)
 *   M, V          AdamW's moments, fp32, where the update runs, this rank's shard
 *   SPARE_MASTER, SPARE_M, SPARE_V
 *                 a speculative update's (plan.h) other side: it writes the new master
 *                 and moments there, beside the ones it keeps, and when the step's norm
 *                 says they are the update, storage swaps the two sides
 *                 (fy_storage_swap_spare); the spare master is where the master's buffer
 *                 is (the host weights' pinned buffer with fp32 storage, which then
 *                 swaps with it). Its GRAD is never the host weights' buffer (a redone
 *                 update reads it again)
 *   SAVED         the block's saved activations, on the device: an opaque area of the
 *                 model's (its range is bytes, its dtype none), a kept block's own, a
 *                 recomputed block's the one area every recomputed block shares (storage
 *                 allocates it once; same_as does not say it)
 *   HOST_ACTS     the block's output in pinned host memory (bytes, like SAVED), when the
 *                 next block offloads its input (below); its device copy is then a slot
 *                 of the activation ring, not a buffer of its own
 * Tiers: FY_TIER_PINNED is host memory the device copies to or from (pinned up to the
 * run's cap, storage.c); FY_TIER_HOST is host memory only the CPU touches; FY_TIER_DISK
 * is the run's scratch file (offload/disk.h), which only the disk lane's tasks read and
 * write. A disk block (plan.h: disk) keeps its shard's MASTER, M and V there, each a
 * region of the file; its update runs a chunk at a time (disk_chunk elements of its
 * shard, fy_layout_disk_range): the chunk's master and moments are read into a host slot
 * of the disk ring, updated there (the gradient and the host weights are in host memory
 * as for any cpu-updated block) and written back. Its master is always a buffer of its
 * own, so with one micro-batch a step its gradient lands in its host weights.
 *
 * Offloaded activations (plan.h: acts offload): a layer that recomputes keeps only its
 * input, the previous block's output; when it offloads, that output lives in pinned
 * host memory (HOST_ACTS below, per block whose output it is) and on the device only in
 * a slot of the activation ring: written there by the forward, sent to the host after
 * the layer's forward has read it, fetched into a slot before the layer's recompute and
 * given back after its backward.
 *
 * Data parallel (ZeRO): with world > 1 in training, each block's elements are cut into
 * `world` contiguous shards in whole norm chunks (FY_SUMSQ_CHUNK, core/reduce.h; each
 * rank's chunk sums of the summed gradient then make the whole norm in the one-process
 * order), as even as chunks allow; rank r holds shard r of the master (when it is apart
 * from the weights), m and v, indexed from its lo; weights and gradients stay whole.
 * rank -1 plans a job: each block's largest shard (the most any rank holds).
 *
 * Threads: a layout is read-only once made. */
#ifndef FY_LAYOUT_H
#define FY_LAYOUT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/core/dtype.h"
#include "engine/core/status.h"
#include "engine/model/lm_head.h"
#include "engine/model/model.h"
#include "offload/plan.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum fy_state {
    FY_STATE_WEIGHTS = 0, FY_STATE_MASTER, FY_STATE_HOST_WEIGHTS, FY_STATE_GRAD, FY_STATE_M,
    FY_STATE_V, FY_STATE_SPARE_MASTER, FY_STATE_SPARE_M, FY_STATE_SPARE_V, FY_STATE_SAVED,
    FY_STATE_HOST_ACTS, FY_STATES
} fy_state;

typedef enum fy_tier { FY_TIER_NONE = 0, FY_TIER_DEVICE, FY_TIER_PINNED, FY_TIER_HOST, FY_TIER_DISK } fy_tier;

/* What the memory model sums a buffer under. */
typedef enum fy_mem_cat {
    FY_CAT_PARAMS = 0, FY_CAT_GRADS, FY_CAT_OPTIM, FY_CAT_ACTS, FY_CAT_STAGING,
    FY_CAT_WORKSPACE, FY_CAT_COUNT
} fy_mem_cat;

typedef struct fy_place {
    fy_tier tier;        /* FY_TIER_NONE: the block has no such state in this run */
    fy_dtype dtype;
    size_t lo, hi;       /* the block's elements the buffer holds, indexed from lo */
    fy_mem_cat cat;
    bool sharded;        /* it holds this rank's shard of a job's state, not the block */
    int8_t same_as;      /* -1: a buffer of its own; else the state whose buffer it is */
} fy_place;

/* The staging rings, each for weights and for gradients: streamed weights are fetched
 * into slots, and gradients that leave the device (updated on the CPU) or accumulate
 * (grad_accum > 1) are computed into slots. The layer ring, sized for the largest layer,
 * serves the layers and every other block no larger; the large ring serves the blocks
 * larger than a layer (an embedding, a classifier), so a vocabulary of 128K never sizes
 * the layers' slots. Each ring has the least slots that let the serial order run; the
 * layer ring has the plan's prefetch depth more, so transfers run ahead of compute. The
 * large ring needs none: its blocks are used once or twice a micro-batch, with a run of
 * layers between. The slots are buffers only: the scheduler's pools grant them to tasks
 * (engine/step_build.c). */
typedef enum fy_ring_id { FY_RING_LAYER = 0, FY_RING_LARGE, FY_RINGS } fy_ring_id;

/* How a streamed block's staged copies (its fetches, its staged gradients) cut it. */
typedef enum fy_staging {
    FY_STAGE_WHOLE = 0,
    FY_STAGE_ROWS,     /* a row table (model.h: gather) streamed and updated on the CPU:
                          its passes get only the micro-batch's rows (the distinct tokens
                          in increasing order), gathered on the host into a pinned buffer;
                          its gradient comes back as those rows and is scattered into
                          GRAD. Each row's gradient is the same sum in the same order as
                          the whole table's, and the norm is taken on the host over the
                          whole scattered gradient, so the arithmetic is the whole
                          table's (Llama 3 8B at 1 x 2048: 16 MiB staged, not 1 GiB) */
    FY_STAGE_CHUNKS    /* a vocab_chunks head streamed and updated on the CPU: its loss
                          pass runs one vocabulary chunk at a time, each staged copy a
                          chunk view (model.h), so a fully streamed plan's device memory
                          is a few layers, the activations and a chunk whatever the
                          vocabulary. With its gradient in its host weights, each chunk's
                          rows land there once that chunk's reads are done, its other
                          tensors (which every chunk reads) with the last chunk */
} fy_staging;

typedef struct fy_block_layout {
    size_t nelem;
    size_t lo, hi;             /* the shard whose update this rank runs (0, nelem alone) */
    fy_place place[FY_STATES];
    fy_update_at update;
    bool streamed;             /* fetched into staging slots for each use */
    bool recompute;            /* its forward runs again before its backward */
    bool speculate;            /* its CPU update may start before the norm (SPARE_*) */
    bool disk;                 /* its master and moments are on disk (above) */
    int disk_chunks;           /* disk: the chunks of its shard (0: an empty shard) */
    bool offload_in;           /* its input (the previous block's output) is offloaded */
    bool out_offloaded;        /* its output is the next block's offloaded input */
    bool grad_staged;          /* each micro-batch's gradient is computed into a staging
                                  slot (updated on the CPU, or accumulated) */
    fy_staging staging;
    size_t stage_nelem;        /* elements of a staged copy: nelem, or min(rows, B*T) rows,
                                  or a chunk view */
    bool fwd_rows;             /* streamed, its forward's fetch is just the micro-batch's
                                  rows (model.h: rows_fwd), as a row-staged block's fetches
                                  are; another block linking to it (a tied head) fetches
                                  it whole, once */
    size_t rows_nelem;         /* elements of a fetch of rows: min(rows, B*T) rows */
    bool split_grad;           /* a fwd_rows table updated on the CPU that a later block
                                  links to (a tied head): its gradient leaves the device in
                                  two parts, the rows its own backward does not touch once
                                  the head has written them (during the layers' backward),
                                  and the micro-batch's rows after its own backward; each
                                  row's value is the whole copy's */
    fy_ring_id ring;
    size_t fetch_nbytes;       /* the parameter slot a fetch of it needs (streamed) */
    size_t saved_nbytes, out_nbytes; /* its activations (model.h) */
} fy_block_layout;

typedef struct fy_layout {
    const fy_model *model;
    int nblocks, B, T, accum, world, rank;
    bool training;
    fy_dtype dtype;            /* storage of weights, gradients, activations on the device */
    size_t es;                 /* its size */
    fy_block_layout *blocks;
    int cap;                   /* blocks' allocated entries (fy_layout_renew reuses them) */
    struct { int n; size_t nbytes; } param_ring[FY_RINGS], grad_ring[FY_RINGS];
    struct { int n; size_t nbytes; } disk_ring; /* host slots of a disk chunk's master and
                                  moments (3 x disk_chunk fp32, or the largest shard's) */
    struct { int n; size_t nbytes; } act_ring;  /* device slots of offloaded inputs */
    size_t disk_chunk;         /* elements of a disk chunk (plan.h) */
    size_t landing_nbytes;     /* the host landing slot: a micro-batch's gradient the host
                                  adds (accumulation) or scatters (rows) into GRAD */
    int rows_block;            /* the block whose fetches may be rows (FY_STAGE_ROWS, or
                                  fwd_rows; at most one: the embedding), -1 */
    fy_lm_chunks head_chunks;  /* the head's vocabulary chunks (FY_STAGE_CHUNKS) */
    size_t shared_saved_nbytes;/* the saved area recomputed blocks share */
    size_t work_nbytes, dx_nbytes; /* the shared workspace and activation gradient */
    int tok_parts;             /* token arrays per buffer: inputs, targets (and the inputs
                                  renumbered into a row-staged block's rows), then the
                                  positions' document starts (kernels.h; filled when the
                                  run masks documents) */
    int docs_part;             /* that last array's index */
    size_t nparts;             /* sharded: every rank's norm chunk sums */
    size_t own_parts;          /* sharded: this rank's (planning: the largest shards') */
} fy_layout;

/* The layout of a run under plan (checked against m); no memory but its own tables.
 * world: the job's ranks (1 alone), rank its rank (-1: planning a job's rank). Without
 * training, only what evaluation needs: weights, masters of streamed blocks,
 * activations. */
fy_status fy_layout_new(const fy_model *m, const fy_plan *plan, int T, bool training, int world,
                        int rank, fy_layout *out);
/* The same into a layout made before (or zeroed), reusing its table: the tuner makes
 * layouts by the hundred thousand. On failure L is still freeable. */
fy_status fy_layout_renew(const fy_model *m, const fy_plan *plan, int T, bool training, int world,
                          int rank, fy_layout *L);
void fy_layout_free(fy_layout *L);

static inline const fy_place *fy_layout_state(const fy_layout *L, int b, fy_state s) {
    return &L->blocks[b].place[s];
}
static inline bool fy_layout_has(const fy_layout *L, int b, fy_state s) {
    return L->blocks[b].place[s].tier != FY_TIER_NONE;
}
/* State s has a buffer of its own (not another state's). */
static inline bool fy_layout_owns(const fy_layout *L, int b, fy_state s) {
    return fy_layout_has(L, b, s) && L->blocks[b].place[s].same_as < 0;
}
/* The state whose buffer s is (s itself when it owns one). */
static inline fy_state fy_layout_buffer_of(const fy_layout *L, int b, fy_state s) {
    const int o = L->blocks[b].place[s].same_as;
    return o < 0 ? s : (fy_state)o;
}
/* The weights an update writes and the allgather of a job makes whole: the device copy of
 * a resident block updated there, else the host copy. */
static inline fy_state fy_layout_updated_weights(const fy_layout *L, int b) {
    const fy_block_layout *bl = &L->blocks[b];
    return bl->update == FY_UPDATE_DEVICE && !bl->streamed ? FY_STATE_WEIGHTS : FY_STATE_HOST_WEIGHTS;
}
/* A job's training run: each rank holds its shard of the masters and moments (above). */
static inline bool fy_layout_sharded(const fy_layout *L) { return L->training && L->world > 1; }
/* Block b's gradient lands in its host weights' buffer (GRAD same as HOST_WEIGHTS): after
 * the copy and until its update, that buffer holds the gradient, not weights. */
static inline bool fy_layout_grad_in_weights(const fy_layout *L, int b) {
    return fy_layout_buffer_of(L, b, FY_STATE_GRAD) == FY_STATE_HOST_WEIGHTS;
}
/* Whether the master's buffer holds a shard (not the whole block): rank 0 gathers it. */
static inline bool fy_layout_master_sharded(const fy_layout *L, int b) {
    return L->blocks[b].place[FY_STATE_MASTER].sharded;
}
/* The bytes of a place's own buffer (0: none, or another state's). */
static inline size_t fy_place_nbytes(const fy_place *p) {
    return p->tier == FY_TIER_NONE || p->same_as >= 0 ? 0 : (p->hi - p->lo) * fy_dtype_size(p->dtype);
}
/* Chunk c of disk block b's shard: its elements [*lo, *hi). */
static inline void fy_layout_disk_range(const fy_layout *L, int b, int c, size_t *lo, size_t *hi) {
    const fy_block_layout *bl = &L->blocks[b];
    *lo = bl->lo + (size_t)c * L->disk_chunk;
    *hi = *lo + L->disk_chunk < bl->hi ? *lo + L->disk_chunk : bl->hi;
}
/* The disk states, in the order a disk slot holds their chunks. */
#define FY_DISK_STATES 3
extern const fy_state fy_disk_states[FY_DISK_STATES]; /* MASTER, M, V */
const char *fy_state_name(fy_state s);
const char *fy_tier_name(fy_tier t);

/* Block shards: off[0..shards] are a block of nelem elements' shard bounds (above). */
#define FY_MAX_SHARDS 1024 /* a job's ranks, at most */
void fy_shard_bounds(size_t nelem, int shards, size_t *off);
/* The norm chunks of shard r (the last one of a block may be partial). */
size_t fy_shard_nchunks(size_t nelem, int shards, int r);

#ifdef __cplusplus
}
#endif
#endif
