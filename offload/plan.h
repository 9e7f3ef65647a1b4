/* plan.h — where each block's state lives and what is recomputed: the placement plan.
 *
 * Per block of the model (an embedding, layers, a head; model.h):
 *   params  resident  parameters stay in device memory
 *           streamed  parameters live in host memory and are copied into a device
 *                     staging slot for each use (forward, recompute, backward, update)
 *   optim   gpu       gradients accumulate in device memory, AdamW moments live there
 *                     and the update runs on the device
 *           cpu       gradients go to host memory after the block's backward, moments
 *                     and the fp32 master weights live there, optim_cpu updates them and
 *                     the new weights go back to the device (resident blocks)
 *   acts    keep      the layer's activations stay until its backward
 *           recompute only the layer's output is kept; backward reruns its forward
 *                     (layers only: the embedding and head always keep theirs)
 * plus the micro-batch size, the number of micro-batches accumulated per step, and the
 * storage type of what the device computes on (parameters, gradients, activations):
 * fp32, or bf16 (fp32 master weights and moments then stay wherever the optimizer is).
 *
 * Every plan computes the same numbers: on the cpu backend losses and weights are
 * bit-identical to the all-resident plan's (tests/test_offload.c).
 *
 * Plans are JSON files (fy_plan_load / fy_plan_save):
 *   {"format": "ferry-plan", "version": 1, "layers": L, "micro_batch": B, "grad_accum": N,
 *    "prefetch": 1, "dtype": "fp32",
 *    "blocks": [{"block": "embed", "params": "resident", "optim": "gpu", "acts": "keep"},
 *               {"block": "layer.0", ...}, ..., {"block": "head", ...}]} */
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

typedef enum fy_params_place { FY_PARAMS_RESIDENT = 0, FY_PARAMS_STREAMED } fy_params_place;
typedef enum fy_optim_place { FY_OPTIM_GPU = 0, FY_OPTIM_CPU } fy_optim_place;
typedef enum fy_acts_policy { FY_ACTS_KEEP = 0, FY_ACTS_RECOMPUTE } fy_acts_policy;

#define FY_PLAN_MAX_ACCUM 1024

typedef struct fy_block_plan {
    fy_block_kind kind;    /* the model's block (fixed at fy_plan_new) */
    int layer;             /* layers: 0..L-1; else -1 */
    fy_params_place params;
    fy_optim_place optim;
    fy_acts_policy acts;
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
} fy_plan;

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

/* A plan file for model m: its blocks must be m's, by name and order. */
fy_status fy_plan_load(const char *path, const fy_model *m, fy_plan *out);
fy_status fy_plan_save(const char *path, const fy_plan *p);
/* The plan file's JSON object (NULL when out of memory; free with cJSON_Delete). */
struct cJSON *fy_plan_json(const fy_plan *p);

/* FY_ERR_INVALID (logged) unless plan p fits model m (its blocks, recompute on layers
 * only, sizes in range). */
fy_status fy_plan_check(const fy_plan *p, const fy_model *m);
/* "params streamed: layers 0-5 | optim cpu: layers 6-11, embed, head | recompute: none" */
void fy_plan_describe(const fy_plan *p, char *buf, size_t cap);
bool fy_plan_equal(const fy_plan *a, const fy_plan *b);

#ifdef __cplusplus
}
#endif
#endif
