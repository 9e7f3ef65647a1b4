/* trainer.h — the state of one model being trained on one device, and one optimizer
 * step over it.
 *
 * A trainer owns, per block (embedding, each layer, head), the parameters, gradients
 * and AdamW moments, and the activations and workspace for micro-batches of B x T. A
 * step runs forward and backward over `accum` micro-batches (gradients add up; the loss
 * is the mean over all of them), takes the global gradient norm (summed per block in
 * block order, so it is the same under any placement), clips, and updates every block.
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

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fy_trainer_cfg {
    fy_gpt2_config model;
    int B, T;          /* micro-batch */
    float beta1, beta2, eps, weight_decay;
    float clip;        /* global-norm clipping threshold; 0 = off */
    uint64_t seed;     /* initialisation when no weights are loaded */
} fy_trainer_cfg;

typedef struct fy_step_stats {
    float loss;        /* mean over the step's micro-batches */
    float grad_norm;   /* before clipping */
    float clip_coef;   /* applied scale (1 when not clipped) */
    bool skipped;      /* non-finite gradients: no update */
} fy_step_stats;

typedef struct fy_trainer fy_trainer;

/* Allocates everything on dev and initialises the weights from cfg->seed. */
fy_status fy_trainer_new(fy_dev *dev, const fy_trainer_cfg *cfg, fy_trainer **out);
void fy_trainer_free(fy_trainer *tr); /* NULL is a no-op */

const fy_gpt2_layout *fy_trainer_layout(const fy_trainer *tr);

/* Replaces the weights with a file's (shape checked against the trainer's model). */
fy_status fy_trainer_load(fy_trainer *tr, const fy_st_file *f);
fy_status fy_trainer_save(fy_trainer *tr, const char *path);

/* One optimizer step over accum micro-batches: x and y hold accum*B*T tokens each
 * (host memory), micro-batch after micro-batch. */
fy_status fy_trainer_step(fy_trainer *tr, const int32_t *x, const int32_t *y, int accum,
                          float lr, fy_step_stats *out);
/* Mean loss of one B x T batch, no gradients. */
fy_status fy_trainer_eval(fy_trainer *tr, const int32_t *x, const int32_t *y, float *loss);

/* Copies block b's parameters or current gradients to host (blocks[b].nelem floats). */
void fy_trainer_get_params(fy_trainer *tr, int b, float *host);
void fy_trainer_get_grads(fy_trainer *tr, int b, float *host);
int64_t fy_trainer_steps_done(const fy_trainer *tr);

#ifdef __cplusplus
}
#endif
#endif
