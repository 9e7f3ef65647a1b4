/* storage.h — the chunk table: where every byte of a training run lives under a plan,
 * and the memory model that predicts it.
 *
 * For each block the chunk says where its parameters, gradients and AdamW moments are:
 *   param_dev   resident blocks: the device copy (persistent)
 *   param_host  streamed or cpu-optimised blocks: the fp32 master in the host arena
 *   param_lp    streamed or cpu-optimised blocks: the host copy in the storage type,
 *               what is copied to the device (the master itself when that is fp32)
 *   master_dev  resident gpu-optimised blocks with bf16 storage: the fp32 master
 *               (with fp32 storage param_dev is the master)
 *   grad_dev    gpu-optimised blocks: the device accumulator
 *   grad_host   cpu-optimised blocks: the host accumulator; with bf16 storage and one
 *               micro-batch a step, param_lp itself (grad_in_lp): the gradient lands
 *               there once every read of the step's parameters is done (a chunked
 *               head's: each chunk's rows once that chunk's reads are done, and its
 *               other tensors, which every chunk's fetch reads, with the last chunk,
 *               after the last fetch), and CPU AdamW
 *               reads it element by element as it writes the updated bf16 copy in its
 *               place, so a fully offloaded bf16 run holds 14 bytes a parameter on the
 *               host (fp32 master, m, v; one bf16 buffer) instead of 16
 *   m, v        on the device (gpu optimiser) or in the host arena (cpu optimiser)
 * Parameters on the device, gradients and activations are in the plan's storage type
 * (plan->dtype); masters and moments are fp32. With bf16 storage, a streamed block's
 * update on the device fetches its fp32 master into the slot, followed by room for the
 * bf16 copy the update writes out.
 * Streamed parameters are fetched into device staging slots; gradients that must leave
 * the device (cpu optimiser) or be accumulated (grad_accum > 1) are computed into
 * gradient staging slots. Slots come in two rings, each for parameters and gradients:
 * the layer ring, sized for the largest layer, serves the layers and every other block
 * no larger than one; the large ring serves the blocks larger than a layer (an
 * embedding, a classifier), so a vocabulary of 128K never sizes the layers' slots. The
 * slots are buffers only: the scheduler's pools grant them to tasks (step_graph.c).
 * Each ring has the least slots that let the serial order run; the layer ring has the
 * plan's prefetch depth more, so transfers run ahead of compute. The large ring needs
 * none: its blocks are used once or twice a micro-batch, with a run of layers between
 * (an embedding's fetch for the head overlaps the layers' forward).
 * A streamed row table (an untied embedding) optimised on the CPU is gathered: its
 * forward gets only the rows of the micro-batch's tokens (gathered on the host into a
 * pinned buffer and copied), and its backward gives back only those rows' gradient,
 * which the host scatters into the block's gradient; its staged copies then take
 * min(padded vocabulary, B*T) rows (Llama 3 8B at 1 x 2048: 16 MiB instead of 1 GiB),
 * which the layer ring serves when they are no larger than a layer. The rows are the distinct tokens in increasing order, and each
 * row's gradient is the same sum in the same order as in the whole table, so the
 * arithmetic is the whole table's (the gradient norm is taken on the host over the
 * whole scattered gradient, as for accumulated blocks).
 * A streamed untied classifier optimised on the CPU (a vocab_chunks head) is chunked:
 * its loss pass runs as one task per vocabulary chunk forward and one per chunk backward
 * (step_graph.c), each fetching its chunk's rows (and the head's small other tensors)
 * and giving back their gradient, so the head also takes layer-sized slots, and a fully
 * streamed plan's device memory is a few layers, the activations and a chunk whatever
 * the vocabulary.
 * Activations are opaque buffers sized by the model (fy_model_acts): every block owns its
 * output; a kept block owns its saved area, recomputed blocks share one saved area that
 * forward and recompute overwrite; one workspace (the largest block's) and one
 * activation-gradient buffer (the largest output) serve every block.
 *
 * Everything is allocated once, in fy_storage_new, through one function that also feeds
 * the memory model, so the model is the allocation list itself: fy_storage_model() with
 * no device gives the same numbers as the device's measured peak. No allocation happens
 * during training steps. Host block state comes from two arenas: the buffers the device
 * copies to or from (bf16 weights, gradients, a streamed device-updated block's master,
 * tokens) from a pinned one, up to the device's pinned cap (--pinned-mem; the buffers
 * past it go pageable, with one warning), and the buffers only the CPU touches (AdamW
 * moments, a cpu-optimised block's fp32 master) from a pageable one: pinning is for DMA,
 * and pinning what no copy reads only takes memory the system cannot page. The pinned
 * arena is pageable, with one warning, if the system refuses to pin it.
 *
 * Threads: used from the thread driving the trainer. */
#ifndef FY_STORAGE_H
#define FY_STORAGE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "engine/device/device.h"
#include "engine/model/model.h"
#include "offload/plan.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum fy_mem_cat {
    FY_CAT_PARAMS = 0, FY_CAT_GRADS, FY_CAT_OPTIM, FY_CAT_ACTS, FY_CAT_STAGING,
    FY_CAT_WORKSPACE, FY_CAT_COUNT
} fy_mem_cat;

typedef struct fy_mem_model {
    size_t device[FY_CAT_COUNT];
    size_t host[FY_CAT_COUNT];
    size_t device_total, host_total;
    size_t host_pinned;       /* of host_total, in the pinned arena */
    size_t pinned_over;       /* buffers the device copies that the pinned cap left pageable */
} fy_mem_model;

/* The staging rings. */
typedef enum fy_ring_id { FY_RING_LAYER = 0, FY_RING_LARGE, FY_RINGS } fy_ring_id;

typedef struct fy_ring {
    void **slots;
    int n;
    size_t nbytes;            /* each slot's */
} fy_ring;

typedef struct fy_chunk {
    size_t nelem;
    fy_ring_id ring;          /* the rings its staged parameters and gradients use */
    float *param_dev, *param_host, *param_lp, *master_dev;
    float *grad_dev, *grad_host;
    float *m, *v;
    bool needs_grad_staging;  /* grads computed into a staging slot */
    bool grad_in_lp;          /* grad_host is param_lp (in a job, the shards this rank
                                 does not own hold its gradient until the allgather brings
                                 their owners' weights): between the gradient's copy and
                                 the update param_lp holds the gradient, not weights */
    bool gathered;            /* a streamed row table (model.h: gather) whose passes get
                                 only the micro-batch's rows: staged copies hold
                                 stage_nelem elements (see fy_storage.gather) */
    bool chunked;             /* a streamed vocab_chunks head (model.h) whose passes take
                                 one vocabulary chunk at a time (fy_storage.head_chunks):
                                 its staged copies are chunk views */
    size_t stage_nelem;       /* elements of its staged copies: nelem; for a gathered
                                 block min(rows, B*T) rows; for a chunked head a chunk view */
    bool apart;               /* its fp32 master is apart from param_lp, the copy compute
                                 reads: with bf16 storage, and in a sharded fp32 run for a
                                 cpu-optimised block with one micro-batch a step, whose
                                 gradient then lands in param_lp (grad_in_lp) as a bf16
                                 run's does: 4 + 12/N host bytes a parameter, not 4 + 4 +
                                 8/N */
    size_t lo, hi;            /* the elements of its shard: whose optimizer state this
                                 process holds and updates (0, nelem unless sharded) */
} fy_chunk;

/* A block's activations on the device (model.h: out and saved). */
typedef struct fy_block_acts {
    void *out;
    void *saved;              /* own, or the area recomputed blocks share */
} fy_block_acts;

typedef struct fy_storage {
    fy_dev *dev;
    const fy_model *model;
    fy_plan plan;             /* own copy */
    int B, T;
    bool training;
    fy_chunk *chunks;         /* nblocks */
    fy_ring param_ring[FY_RINGS], grad_ring[FY_RINGS];
    fy_dtype dtype;           /* the plan's storage type (F32 or BF16) */
    size_t es;                /* its size in bytes */
    fy_block_acts *acts;      /* nblocks */
    void *work;               /* the blocks' shared workspace */
    void *dx;                 /* the activation gradient between blocks */
    int tok_parts;            /* arrays per token buffer: inputs, targets, and with a
                                 gathered block the inputs renumbered into its rows */
    int32_t *tok_dev;         /* 2 x (tok_parts,B,T): double-buffered */
    int32_t *tok_host;        /* pinned staging, same shape */
    fy_lm_chunks head_chunks; /* the head's vocabulary chunks, if it is chunked */
    struct {                  /* the gathered block (at most one: the embedding) */
        int block;            /* -1: none */
        int32_t *rows;        /* host, 2 x (B*T): per token buffer, the distinct tokens of
                                 its inputs in increasing order, the rows its passes get */
        int nrows[2];
        int32_t *map;         /* host scratch, a row table's rows: -1, or its gathered row */
        void *host;           /* pinned: the rows gathered for a fetch (stage_nelem) */
    } gather;
    size_t nparts;            /* sharded: the chunk sums of every block (over all ranks) */
    double *parts_dev;        /* sharded: this rank's chunk sums of its shards, block by block */
    double *parts_host;       /* sharded: every rank's, rank by rank (each as parts_dev) */
    float *loss_dev, *loss_host;      /* one per micro-batch */
    double *sumsq_dev, *sumsq_host;   /* one per block */
    float *grad_host_tmp;     /* host landing slot: a micro-batch's gradient of a
                                 cpu-optimised block that the host adds (accumulation) or
                                 scatters (a gathered block) into grad_host */
    void *arena[2];           /* host state: the pageable [0] and the pinned [1] arena */
    size_t arena_nbytes[2];
    bool arena_pinned;        /* the pinned arena is pinned (the system may refuse) */
    void **allocs;            /* device-interface allocations, for freeing */
    int nallocs, capallocs;
    fy_mem_model mem;         /* the memory model: what this storage allocated */
} fy_storage;

/* Data parallel: a training run with plan->shards > 1 is sharded (ZeRO): each block's
 * elements are cut into plan->shards contiguous shards in whole norm chunks
 * (FY_SUMSQ_CHUNK, core/reduce.h; so each rank's chunk sums of the summed gradient
 * make the whole norm, in the one-process order), as even as chunks allow, and this
 * process (shard plan->shard) holds only its shard [lo, hi) of the fp32 master weights
 * and the AdamW moments, wherever the plan puts them: m and v, the masters apart from
 * what compute reads (fy_chunk.apart: master_dev, param_host) hold hi - lo elements,
 * indexed from lo. What compute
 * reads (param_dev, param_lp, and where the master is not apart param_host, which is
 * then the master) and the gradients stay whole: each rank computes the whole gradient
 * of its micro-batches, the shards' owners get them summed (reduce-scatter), update
 * their shard, and the updated weights are gathered from every owner (step_graph.c).
 * A fully offloaded run then holds 2 + 12/N (bf16) or 4 + 12/N (fp32) bytes a parameter
 * on each of N ranks' hosts instead of 14 or 16. off[0..shards] are block nelem's shard
 * bounds. */
void fy_shard_bounds(size_t nelem, int shards, size_t *off);
/* The norm chunks of shard r (the last one of a block may be partial). */
size_t fy_shard_nchunks(size_t nelem, int shards, int r);

/* Allocates all storage of a run under plan (micro-batch plan->micro_batch x T). Without
 * training, only what evaluation needs: parameters, activations, workspace (no
 * gradients, moments or gradient staging). */
fy_status fy_storage_new(fy_dev *dev, const fy_model *m, const fy_plan *plan, int T,
                         bool training, fy_storage **out);
/* The same tables (chunk flags, ring sizes, memory model) without any memory: for
 * planning (the tuner simulates candidate plans on it). Its buffers are all NULL. */
fy_status fy_storage_dry(const fy_model *m, const fy_plan *plan, int T, bool training,
                         fy_storage **out);
void fy_storage_free(fy_storage *st);

/* The memory model of a plan without allocating anything (training, or evaluation). */
void fy_storage_model(const fy_model *m, const fy_plan *plan, int T, fy_mem_model *out);
void fy_storage_model_for(const fy_model *m, const fy_plan *plan, int T, bool training,
                          fy_mem_model *out);
/* The same under a pinned-memory cap (the others: no cap). */
void fy_storage_model_pinned(const fy_model *m, const fy_plan *plan, int T, bool training,
                             size_t pinned_cap, fy_mem_model *out);
void fy_mem_model_print(const fy_mem_model *m, FILE *f);
const char *fy_mem_cat_name(fy_mem_cat c);

#ifdef __cplusplus
}
#endif
#endif
