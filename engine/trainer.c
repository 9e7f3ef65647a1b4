/* trainer.c — the training step under a placement plan, in serial order on one stream.
 *
 * Per micro-batch: forward block by block (streamed blocks fetched into a staging slot
 * just before use and released after), the head's loss and logit gradients, then
 * backward from the head to the embedding (recomputing checkpointed layers first). Each
 * block's gradient for the micro-batch is produced into a zeroed buffer: its device
 * accumulator directly when nothing needs staging, else a staging slot whose contents
 * are copied (first micro-batch) or added (later ones) into the accumulator on the device
 * or, for cpu-optimised blocks, on the host. After the last micro-batch: the gradient
 * norm, the clip coefficient, and the AdamW update of every block where its optimizer
 * lives. */
#include "engine/trainer.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/reduce.h"
#include "engine/device/kernels.h"
#include "engine/model/gpt2_io.h"
#include "optim_cpu/adam_pool.h"

struct fy_trainer {
    fy_dev *dev;
    fy_stream *s;
    fy_trainer_cfg cfg;
    fy_gpt2_layout lay;
    fy_plan plan;
    fy_storage *st;
    fy_adam_pool *pool;      /* cpu optimizer threads, if any block needs them */
    float **fetched;         /* per block: device parameters while fetched */
    float **gbuf;            /* per block: this micro-batch's gradient buffer */
    int64_t steps_done;
};

static bool streamed(const fy_trainer *tr, int b) {
    return tr->plan.blocks[b].params == FY_PARAMS_STREAMED;
}
static bool cpu_optim(const fy_trainer *tr, int b) {
    return tr->plan.blocks[b].optim == FY_OPTIM_CPU;
}
static size_t nbytes_of(const fy_trainer *tr, int b) {
    return tr->lay.blocks[b].nelem * sizeof(float);
}

/* Block b's parameters on the device: resident, or copied into a staging slot. */
static float *fetch(fy_trainer *tr, int b) {
    const fy_chunk *c = &tr->st->chunks[b];
    if (!streamed(tr, b)) return c->param_dev;
    FY_ASSERT(!tr->fetched[b], "block fetched twice");
    float *slot = fy_storage_param_slot(tr->st, b);
    fy_copy_async(tr->s, slot, c->param_host, nbytes_of(tr, b), FY_H2D);
    tr->fetched[b] = slot;
    return slot;
}

/* Stream order guarantees the slot's next copy runs after this block's kernels. */
static void unfetch(fy_trainer *tr, int b) {
    if (!streamed(tr, b)) return;
    fy_storage_release_param(tr->st, b);
    tr->fetched[b] = NULL;
}

/* Where block b's gradient for this micro-batch is produced (zeroed). */
static float *grad_begin(fy_trainer *tr, int b) {
    const fy_chunk *c = &tr->st->chunks[b];
    if (!c->needs_grad_staging) return c->grad_dev; /* zeroed at the step's start */
    float *g = fy_storage_grad_slot(tr->st, b);
    fy_memset_async(tr->s, g, 0, nbytes_of(tr, b));
    tr->gbuf[b] = g;
    return g;
}

/* Moves micro-batch `a`'s gradient of block b into its accumulator. */
static void grad_end(fy_trainer *tr, int b, int a) {
    const fy_chunk *c = &tr->st->chunks[b];
    if (!c->needs_grad_staging) return;
    float *g = tr->gbuf[b];
    size_t n = c->nelem;
    if (cpu_optim(tr, b)) {
        if (a == 0) {
            fy_copy_async(tr->s, c->grad_host, g, n * sizeof(float), FY_D2H);
        } else {
            float *land = tr->st->grad_host_tmp;
            fy_copy_async(tr->s, land, g, n * sizeof(float), FY_D2H);
            fy_stream_sync(tr->s);
            for (size_t i = 0; i < n; i++) c->grad_host[i] = c->grad_host[i] + land[i];
        }
    } else if (a == 0) {
        fy_copy_async(tr->s, c->grad_dev, g, n * sizeof(float), FY_D2D);
    } else {
        fy_k_residual_fwd(c->grad_dev, c->grad_dev, g, n, tr->s);
    }
    fy_storage_release_grad(tr->st, b);
    tr->gbuf[b] = NULL;
}

static const float *layer_input(const fy_trainer *tr, int l) {
    return l ? tr->st->acts[l - 1].out : tr->st->x0;
}

static void forward(fy_trainer *tr, float dloss, float *loss_out) {
    const fy_gpt2_config *mc = &tr->cfg.model;
    fy_storage *st = tr->st;
    const int B = tr->plan.micro_batch, T = tr->cfg.T, L = mc->layers;
    const int32_t *x = st->tok_dev, *y = st->tok_dev + (size_t)B * T;
    fy_gpt2_embed_w ew;
    fy_gpt2_embed_view(&tr->lay.blocks[0], fetch(tr, 0), &ew);
    fy_gpt2_embed_fwd(mc, &ew, x, st->x0, B, T, tr->s);
    unfetch(tr, 0);
    for (int l = 0; l < L; l++) {
        fy_gpt2_layer_w w;
        fy_gpt2_layer_view(&tr->lay.blocks[1 + l], fetch(tr, 1 + l), &w);
        fy_gpt2_layer_fwd(mc, &w, &st->acts[l], layer_input(tr, l), &st->sc, B, T, tr->s);
        unfetch(tr, 1 + l);
    }
    fy_gpt2_head_w hw;
    fy_gpt2_head_view(&tr->lay.blocks[L + 1], fetch(tr, L + 1), &hw);
    fy_gpt2_embed_view(&tr->lay.blocks[0], fetch(tr, 0), &ew);
    fy_gpt2_head_fwd(mc, &hw, ew.wte, st->acts[L - 1].out, &st->head, y, dloss, loss_out, B, T,
                     tr->s);
    /* a training step keeps the head and embedding fetched for the head's backward */
    if (dloss == 0.0f) {
        unfetch(tr, L + 1);
        unfetch(tr, 0);
    }
}

static void backward(fy_trainer *tr, int a) {
    const fy_gpt2_config *mc = &tr->cfg.model;
    fy_storage *st = tr->st;
    const int B = tr->plan.micro_batch, T = tr->cfg.T, L = mc->layers;
    float *w0 = streamed(tr, 0) ? tr->fetched[0] : st->chunks[0].param_dev;
    float *wh = streamed(tr, L + 1) ? tr->fetched[L + 1] : st->chunks[L + 1].param_dev;
    fy_gpt2_embed_w ew, eg;
    fy_gpt2_head_w hw, hg;
    fy_gpt2_embed_view(&tr->lay.blocks[0], w0, &ew);
    fy_gpt2_embed_view(&tr->lay.blocks[0], grad_begin(tr, 0), &eg);
    fy_gpt2_head_view(&tr->lay.blocks[L + 1], wh, &hw);
    fy_gpt2_head_view(&tr->lay.blocks[L + 1], grad_begin(tr, L + 1), &hg);
    fy_gpt2_head_bwd(mc, &hw, &hg, ew.wte, eg.wte, st->acts[L - 1].out, &st->head, &st->sc, B, T,
                     tr->s);
    unfetch(tr, L + 1);
    unfetch(tr, 0);
    grad_end(tr, L + 1, a);
    for (int l = L - 1; l >= 0; l--) {
        fy_gpt2_layer_w w, g;
        fy_gpt2_layer_view(&tr->lay.blocks[1 + l], fetch(tr, 1 + l), &w);
        if (tr->plan.blocks[1 + l].acts == FY_ACTS_RECOMPUTE)
            fy_gpt2_layer_fwd(mc, &w, &st->acts[l], layer_input(tr, l), &st->sc, B, T, tr->s);
        fy_gpt2_layer_view(&tr->lay.blocks[1 + l], grad_begin(tr, 1 + l), &g);
        fy_gpt2_layer_bwd(mc, &w, &g, &st->acts[l], layer_input(tr, l), &st->sc, B, T, tr->s);
        unfetch(tr, 1 + l);
        grad_end(tr, 1 + l, a);
    }
    fy_gpt2_embed_bwd(mc, &eg, st->tok_dev, &st->sc, B, T, tr->s);
    grad_end(tr, 0, a);
}

/* ---- construction ------------------------------------------------------------------ */

static fy_status upload_params(fy_trainer *tr, float *const *host) {
    for (int b = 0; b < tr->lay.nblocks; b++) {
        const fy_chunk *c = &tr->st->chunks[b];
        if (c->param_host) memcpy(c->param_host, host[b], nbytes_of(tr, b));
        if (c->param_dev) fy_copy_async(tr->s, c->param_dev, host[b], nbytes_of(tr, b), FY_H2D);
    }
    fy_stream_sync(tr->s);
    return FY_OK;
}

static float **host_blocks_new(const fy_gpt2_layout *lay) {
    float **h = calloc((size_t)lay->nblocks, sizeof *h);
    if (!h) return NULL;
    for (int b = 0; b < lay->nblocks; b++)
        if (!(h[b] = malloc(lay->blocks[b].nelem * sizeof(float)))) {
            for (int k = 0; k < b; k++) free(h[k]);
            free(h);
            return NULL;
        }
    return h;
}

static void host_blocks_free(const fy_gpt2_layout *lay, float **h) {
    if (!h) return;
    for (int b = 0; b < lay->nblocks; b++) free(h[b]);
    free(h);
}

fy_status fy_trainer_new(fy_dev *dev, const fy_trainer_cfg *cfg, fy_trainer **out) {
    *out = NULL;
    fy_trainer *tr = calloc(1, sizeof *tr);
    if (!tr) return FY_ERR_NOMEM;
    tr->dev = dev;
    tr->cfg = *cfg;
    tr->cfg.plan = NULL;
    float **host = NULL;
    fy_status st = fy_gpt2_layout_new(&cfg->model, &tr->lay);
    if (st != FY_OK) goto fail;
    if (cfg->plan) {
        if (cfg->plan->layers != cfg->model.layers) {
            fy_log_error("the plan is for %d layers, the model has %d", cfg->plan->layers,
                         cfg->model.layers);
            st = FY_ERR_INVALID;
            goto fail;
        }
        st = fy_plan_copy(cfg->plan, &tr->plan);
    } else {
        st = fy_plan_new(cfg->model.layers, cfg->B, cfg->grad_accum > 0 ? cfg->grad_accum : 1,
                         &tr->plan);
    }
    if (st != FY_OK) goto fail;
    tr->cfg.B = tr->plan.micro_batch;
    tr->cfg.grad_accum = tr->plan.grad_accum;
    if ((st = fy_stream_new(dev, "compute", &tr->s)) != FY_OK) goto fail;
    if ((st = fy_storage_new(dev, &tr->lay, &tr->plan, cfg->T, &tr->st)) != FY_OK) goto fail;
    tr->fetched = calloc((size_t)tr->lay.nblocks, sizeof *tr->fetched);
    tr->gbuf = calloc((size_t)tr->lay.nblocks, sizeof *tr->gbuf);
    if (!tr->fetched || !tr->gbuf) { st = FY_ERR_NOMEM; goto fail; }
    for (int b = 0; b < tr->lay.nblocks; b++)
        if (cpu_optim(tr, b)) {
            if ((st = fy_adam_pool_new(fy_dev_threads(dev), &tr->pool)) != FY_OK) goto fail;
            break;
        }
    if (!(host = host_blocks_new(&tr->lay))) { st = FY_ERR_NOMEM; goto fail; }
    for (int b = 0; b < tr->lay.nblocks; b++)
        fy_gpt2_init_block(&cfg->model, &tr->lay.blocks[b], cfg->seed, host[b]);
    if ((st = upload_params(tr, host)) != FY_OK) goto fail;
    host_blocks_free(&tr->lay, host);
    *out = tr;
    return FY_OK;
fail:
    host_blocks_free(&tr->lay, host);
    fy_trainer_free(tr);
    return st;
}

void fy_trainer_free(fy_trainer *tr) {
    if (!tr) return;
    if (tr->s) fy_stream_sync(tr->s);
    fy_stream_free(tr->s);
    fy_storage_free(tr->st);
    fy_adam_pool_free(tr->pool);
    free(tr->fetched);
    free(tr->gbuf);
    fy_plan_free(&tr->plan);
    fy_gpt2_layout_free(&tr->lay);
    free(tr);
}

const fy_gpt2_layout *fy_trainer_layout(const fy_trainer *tr) { return &tr->lay; }
int64_t fy_trainer_steps_done(const fy_trainer *tr) { return tr->steps_done; }
const fy_storage *fy_trainer_storage(const fy_trainer *tr) { return tr->st; }

fy_status fy_trainer_load(fy_trainer *tr, const fy_st_file *f) {
    float **h = host_blocks_new(&tr->lay);
    if (!h) return FY_ERR_NOMEM;
    fy_status st = fy_gpt2_load_blocks(f, &tr->lay, h);
    if (st == FY_OK) st = upload_params(tr, h);
    host_blocks_free(&tr->lay, h);
    return st;
}

fy_status fy_trainer_save(fy_trainer *tr, const char *path) {
    float **h = host_blocks_new(&tr->lay);
    if (!h) return FY_ERR_NOMEM;
    for (int b = 0; b < tr->lay.nblocks; b++) fy_trainer_get_params(tr, b, h[b]);
    fy_status st = fy_gpt2_save(path, &tr->lay, h);
    host_blocks_free(&tr->lay, h);
    return st;
}

void fy_trainer_get_params(fy_trainer *tr, int b, float *host) {
    const fy_chunk *c = &tr->st->chunks[b];
    fy_stream_sync(tr->s);
    if (c->param_host) memcpy(host, c->param_host, nbytes_of(tr, b)); /* the master */
    else fy_copy_async(tr->s, host, c->param_dev, nbytes_of(tr, b), FY_D2H);
    fy_stream_sync(tr->s);
}

void fy_trainer_get_grads(fy_trainer *tr, int b, float *host) {
    const fy_chunk *c = &tr->st->chunks[b];
    fy_stream_sync(tr->s);
    if (c->grad_host) memcpy(host, c->grad_host, nbytes_of(tr, b));
    else fy_copy_async(tr->s, host, c->grad_dev, nbytes_of(tr, b), FY_D2H);
    fy_stream_sync(tr->s);
}

/* ---- the step ---------------------------------------------------------------------- */

static void upload_tokens(fy_trainer *tr, const int32_t *x, const int32_t *y) {
    const size_t N = (size_t)tr->plan.micro_batch * tr->cfg.T;
    fy_stream_sync(tr->s); /* the staging buffer is reused: the last copy must be done */
    memcpy(tr->st->tok_host, x, N * sizeof(int32_t));
    memcpy(tr->st->tok_host + N, y, N * sizeof(int32_t));
    fy_copy_async(tr->s, tr->st->tok_dev, tr->st->tok_host, 2 * N * sizeof(int32_t), FY_H2D);
}

/* The sum of squares of every block's gradient, block by block in order. */
static double grad_sumsq(fy_trainer *tr) {
    fy_storage *st = tr->st;
    const int nb = tr->lay.nblocks;
    for (int b = 0; b < nb; b++)
        if (!cpu_optim(tr, b)) fy_k_sumsq(st->sumsq_dev + b, st->chunks[b].grad_dev, st->chunks[b].nelem, tr->s);
    fy_copy_async(tr->s, st->sumsq_host, st->sumsq_dev, (size_t)nb * sizeof(double), FY_D2H);
    fy_stream_sync(tr->s);
    double ss = 0.0;
    for (int b = 0; b < nb; b++) {
        if (cpu_optim(tr, b)) st->sumsq_host[b] = fy_sumsq(st->chunks[b].grad_host, st->chunks[b].nelem);
        ss += st->sumsq_host[b];
    }
    return ss;
}

static fy_status update(fy_trainer *tr, const fy_adam_hparams *hp) {
    for (int b = 0; b < tr->lay.nblocks; b++) {
        const fy_block_spec *blk = &tr->lay.blocks[b];
        const fy_chunk *c = &tr->st->chunks[b];
        size_t split[3] = {0, blk->decay_nelem, blk->nelem};
        if (cpu_optim(tr, b)) {
            fy_stream_sync(tr->s); /* the gradient's copy to the host is done */
            for (int part = 0; part < 2; part++) {
                size_t o = split[part], n = split[part + 1] - split[part];
                if (!n) continue;
                fy_adam_range r = {.param = c->param_host + o, .m = c->m + o, .v = c->v + o,
                                   .grad = c->grad_host + o, .grad_dtype = FY_F32, .n = n,
                                   .decay = part == 0};
                FY_TRY(fy_adam_pool_step(tr->pool, hp, &r));
            }
            if (c->param_dev)
                fy_copy_async(tr->s, c->param_dev, c->param_host, nbytes_of(tr, b), FY_H2D);
            continue;
        }
        float *w = fetch(tr, b);
        for (int part = 0; part < 2; part++) {
            size_t o = split[part], n = split[part + 1] - split[part];
            if (!n) continue;
            fy_adam_range r = {.param = w + o, .m = c->m + o, .v = c->v + o,
                               .grad = c->grad_dev + o, .grad_dtype = FY_F32, .n = n,
                               .decay = part == 0};
            fy_k_adamw(hp, &r, tr->s);
        }
        if (streamed(tr, b)) fy_copy_async(tr->s, c->param_host, w, nbytes_of(tr, b), FY_D2H);
        unfetch(tr, b);
    }
    fy_stream_sync(tr->s);
    return FY_OK;
}

fy_status fy_trainer_step(fy_trainer *tr, const int32_t *x, const int32_t *y, float lr,
                          fy_step_stats *out) {
    const int accum = tr->plan.grad_accum;
    const size_t N = (size_t)tr->plan.micro_batch * tr->cfg.T;
    fy_storage *st = tr->st;
    for (int b = 0; b < tr->lay.nblocks; b++)
        if (!st->chunks[b].needs_grad_staging)
            fy_memset_async(tr->s, st->chunks[b].grad_dev, 0, nbytes_of(tr, b));
    float dloss = (float)(1.0 / ((double)N * accum));
    for (int a = 0; a < accum; a++) {
        upload_tokens(tr, x + a * N, y + a * N);
        forward(tr, dloss, st->loss_dev + a);
        backward(tr, a);
    }
    fy_copy_async(tr->s, st->loss_host, st->loss_dev, (size_t)accum * sizeof(float), FY_D2H);
    double ss = grad_sumsq(tr); /* syncs the stream */
    double loss = 0.0;
    for (int a = 0; a < accum; a++) loss += st->loss_host[a];
    float norm = (float)sqrt(ss);
    out->loss = (float)(loss / accum);
    out->grad_norm = norm;
    out->clip_coef = 1.0f;
    out->skipped = !isfinite(norm);
    if (out->skipped) {
        fy_log_warn("step %lld: gradient norm is %g; update skipped",
                    (long long)tr->steps_done + 1, norm);
        return FY_OK;
    }
    if (tr->cfg.clip > 0.0f) {
        float coef = tr->cfg.clip / (norm + 1e-6f);
        if (coef < 1.0f) out->clip_coef = coef;
    }
    tr->steps_done++;
    fy_adam_hparams hp = {.lr = lr, .beta1 = tr->cfg.beta1, .beta2 = tr->cfg.beta2,
                          .eps = tr->cfg.eps, .weight_decay = tr->cfg.weight_decay,
                          .step = tr->steps_done, .grad_scale = out->clip_coef};
    return update(tr, &hp);
}

fy_status fy_trainer_eval(fy_trainer *tr, const int32_t *x, const int32_t *y, float *loss) {
    upload_tokens(tr, x, y);
    forward(tr, 0.0f, tr->st->loss_dev);
    fy_copy_async(tr->s, tr->st->loss_host, tr->st->loss_dev, sizeof(float), FY_D2H);
    fy_stream_sync(tr->s);
    *loss = tr->st->loss_host[0];
    return FY_OK;
}
