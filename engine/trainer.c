/* trainer.c — the all-resident training step: every block's parameters, gradients and
 * AdamW states in device memory, forward and backward on one compute stream. */
#include "engine/trainer.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/device/kernels.h"
#include "engine/model/gpt2_io.h"

typedef struct block_state {
    float *param, *grad, *m, *v; /* device, blocks[b].nelem floats each */
} block_state;

struct fy_trainer {
    fy_dev *dev;
    fy_stream *s;
    fy_trainer_cfg cfg;
    fy_gpt2_layout lay;
    block_state *blocks;
    fy_gpt2_layer_acts *acts;    /* per layer */
    fy_gpt2_head_acts head;
    fy_gpt2_scratch sc;
    float *x0;                   /* (B,T,C) embedding output */
    int32_t *tok_dev;            /* (2,B,T): inputs then targets */
    int32_t *tok_host;           /* pinned staging for tok_dev */
    float *loss_dev;             /* one mean loss per micro-batch (up to max_accum) */
    double *sumsq_dev;           /* one per block */
    float *loss_host;
    double *sumsq_host;
    int max_accum;
    int64_t steps_done;
};

#define MAX_ACCUM 1024

static fy_status alloc_dev(fy_trainer *tr, size_t nbytes, const char *what, void **out) {
    return fy_dev_alloc(tr->dev, FY_MEM_DEVICE, nbytes, what, out);
}

static fy_status upload_init(fy_trainer *tr) {
    size_t maxn = 0;
    for (int b = 0; b < tr->lay.nblocks; b++)
        if (tr->lay.blocks[b].nelem > maxn) maxn = tr->lay.blocks[b].nelem;
    float *host = malloc(maxn * sizeof(float));
    if (!host) return FY_ERR_NOMEM;
    for (int b = 0; b < tr->lay.nblocks; b++) {
        const fy_block_spec *blk = &tr->lay.blocks[b];
        fy_gpt2_init_block(&tr->cfg.model, blk, tr->cfg.seed, host);
        fy_copy_async(tr->s, tr->blocks[b].param, host, blk->nelem * sizeof(float), FY_H2D);
        fy_stream_sync(tr->s); /* host is reused for the next block */
    }
    free(host);
    return FY_OK;
}

fy_status fy_trainer_new(fy_dev *dev, const fy_trainer_cfg *cfg, fy_trainer **out) {
    *out = NULL;
    fy_trainer *tr = calloc(1, sizeof *tr);
    if (!tr) return FY_ERR_NOMEM;
    tr->dev = dev;
    tr->cfg = *cfg;
    tr->max_accum = MAX_ACCUM;
    fy_status st = fy_gpt2_layout_new(&cfg->model, &tr->lay);
    if (st != FY_OK) goto fail;
    const fy_gpt2_config *mc = &cfg->model;
    const int B = cfg->B, T = cfg->T, L = mc->layers;
    char what[64];
    if ((st = fy_stream_new(dev, "compute", &tr->s)) != FY_OK) goto fail;
    tr->blocks = calloc((size_t)tr->lay.nblocks, sizeof *tr->blocks);
    tr->acts = calloc((size_t)L, sizeof *tr->acts);
    if (!tr->blocks || !tr->acts) { st = FY_ERR_NOMEM; goto fail; }
    for (int b = 0; b < tr->lay.nblocks; b++) {
        size_t nb = tr->lay.blocks[b].nelem * sizeof(float);
        static const char *names[] = {"parameters", "gradients", "Adam m", "Adam v"};
        float **bufs[] = {&tr->blocks[b].param, &tr->blocks[b].grad, &tr->blocks[b].m,
                          &tr->blocks[b].v};
        for (int k = 0; k < 4; k++) {
            snprintf(what, sizeof what, "block %d %s", b, names[k]);
            if ((st = alloc_dev(tr, nb, what, (void **)bufs[k])) != FY_OK) goto fail;
        }
    }
    size_t layer_n = fy_gpt2_layer_acts_nelem(mc, B, T);
    for (int l = 0; l < L; l++) {
        float *base;
        snprintf(what, sizeof what, "layer %d activations", l);
        if ((st = alloc_dev(tr, layer_n * sizeof(float), what, (void **)&base)) != FY_OK) goto fail;
        fy_gpt2_layer_acts_bind(mc, B, T, base, &tr->acts[l]);
    }
    float *base;
    if ((st = alloc_dev(tr, fy_gpt2_head_acts_nelem(mc, B, T) * sizeof(float),
                        "head activations", (void **)&base)) != FY_OK) goto fail;
    fy_gpt2_head_acts_bind(mc, B, T, base, &tr->head);
    if ((st = alloc_dev(tr, fy_gpt2_scratch_nelem(mc, B, T) * sizeof(float),
                        "backward workspace", (void **)&base)) != FY_OK) goto fail;
    fy_gpt2_scratch_bind(mc, B, T, base, &tr->sc);
    const size_t N = (size_t)B * T;
    if ((st = alloc_dev(tr, N * mc->channels * sizeof(float), "embedding output",
                        (void **)&tr->x0)) != FY_OK ||
        (st = alloc_dev(tr, 2 * N * sizeof(int32_t), "tokens", (void **)&tr->tok_dev)) != FY_OK ||
        (st = alloc_dev(tr, MAX_ACCUM * sizeof(float), "losses", (void **)&tr->loss_dev)) != FY_OK ||
        (st = alloc_dev(tr, (size_t)tr->lay.nblocks * sizeof(double), "norms",
                        (void **)&tr->sumsq_dev)) != FY_OK ||
        (st = fy_dev_alloc(dev, FY_MEM_PINNED, 2 * N * sizeof(int32_t), "token staging",
                           (void **)&tr->tok_host)) != FY_OK ||
        (st = fy_dev_alloc(dev, FY_MEM_PINNED, MAX_ACCUM * sizeof(float), "loss staging",
                           (void **)&tr->loss_host)) != FY_OK ||
        (st = fy_dev_alloc(dev, FY_MEM_PINNED, (size_t)tr->lay.nblocks * sizeof(double),
                           "norm staging", (void **)&tr->sumsq_host)) != FY_OK)
        goto fail;
    if ((st = upload_init(tr)) != FY_OK) goto fail;
    *out = tr;
    return FY_OK;
fail:
    fy_trainer_free(tr);
    return st;
}

void fy_trainer_free(fy_trainer *tr) {
    if (!tr) return;
    if (tr->s) fy_stream_sync(tr->s);
    fy_stream_free(tr->s);
    /* device buffers go back with the device's registry in release order */
    if (tr->blocks)
        for (int b = 0; b < tr->lay.nblocks; b++) {
            fy_dev_release(tr->dev, tr->blocks[b].param);
            fy_dev_release(tr->dev, tr->blocks[b].grad);
            fy_dev_release(tr->dev, tr->blocks[b].m);
            fy_dev_release(tr->dev, tr->blocks[b].v);
        }
    if (tr->acts)
        for (int l = 0; l < tr->lay.cfg.layers; l++) fy_dev_release(tr->dev, tr->acts[l].ln1);
    fy_dev_release(tr->dev, tr->head.lnf);
    fy_dev_release(tr->dev, tr->sc.proj);
    fy_dev_release(tr->dev, tr->x0);
    fy_dev_release(tr->dev, tr->tok_dev);
    fy_dev_release(tr->dev, tr->loss_dev);
    fy_dev_release(tr->dev, tr->sumsq_dev);
    fy_dev_release(tr->dev, tr->tok_host);
    fy_dev_release(tr->dev, tr->loss_host);
    fy_dev_release(tr->dev, tr->sumsq_host);
    free(tr->blocks);
    free(tr->acts);
    fy_gpt2_layout_free(&tr->lay);
    free(tr);
}

const fy_gpt2_layout *fy_trainer_layout(const fy_trainer *tr) { return &tr->lay; }
int64_t fy_trainer_steps_done(const fy_trainer *tr) { return tr->steps_done; }

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

fy_status fy_trainer_load(fy_trainer *tr, const fy_st_file *f) {
    float **h = host_blocks_new(&tr->lay);
    if (!h) return FY_ERR_NOMEM;
    fy_status st = fy_gpt2_load_blocks(f, &tr->lay, h);
    if (st == FY_OK) {
        for (int b = 0; b < tr->lay.nblocks; b++)
            fy_copy_async(tr->s, tr->blocks[b].param, h[b],
                          tr->lay.blocks[b].nelem * sizeof(float), FY_H2D);
        fy_stream_sync(tr->s);
    }
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
    fy_copy_async(tr->s, host, tr->blocks[b].param, tr->lay.blocks[b].nelem * sizeof(float), FY_D2H);
    fy_stream_sync(tr->s);
}

void fy_trainer_get_grads(fy_trainer *tr, int b, float *host) {
    fy_copy_async(tr->s, host, tr->blocks[b].grad, tr->lay.blocks[b].nelem * sizeof(float), FY_D2H);
    fy_stream_sync(tr->s);
}

/* Forward through every block; with dloss != 0 the logits become their gradients. */
static void forward(fy_trainer *tr, float dloss, float *loss_out) {
    const fy_gpt2_config *mc = &tr->cfg.model;
    const int B = tr->cfg.B, T = tr->cfg.T, L = mc->layers;
    const int32_t *x = tr->tok_dev, *y = tr->tok_dev + (size_t)B * T;
    fy_gpt2_embed_w ew;
    fy_gpt2_embed_view(&tr->lay.blocks[0], tr->blocks[0].param, &ew);
    fy_gpt2_embed_fwd(mc, &ew, x, tr->x0, B, T, tr->s);
    for (int l = 0; l < L; l++) {
        fy_gpt2_layer_w w;
        fy_gpt2_layer_view(&tr->lay.blocks[1 + l], tr->blocks[1 + l].param, &w);
        fy_gpt2_layer_fwd(mc, &w, &tr->acts[l], l ? tr->acts[l - 1].out : tr->x0, &tr->sc, B,
                          T, tr->s);
    }
    fy_gpt2_head_w hw;
    fy_gpt2_head_view(&tr->lay.blocks[L + 1], tr->blocks[L + 1].param, &hw);
    fy_gpt2_head_fwd(mc, &hw, ew.wte, tr->acts[L - 1].out, &tr->head, y, dloss, loss_out, B, T,
                     tr->s);
}

static void backward(fy_trainer *tr) {
    const fy_gpt2_config *mc = &tr->cfg.model;
    const int B = tr->cfg.B, T = tr->cfg.T, L = mc->layers;
    fy_gpt2_embed_w ew, eg;
    fy_gpt2_embed_view(&tr->lay.blocks[0], tr->blocks[0].param, &ew);
    fy_gpt2_embed_view(&tr->lay.blocks[0], tr->blocks[0].grad, &eg);
    fy_gpt2_head_w hw, hg;
    fy_gpt2_head_view(&tr->lay.blocks[L + 1], tr->blocks[L + 1].param, &hw);
    fy_gpt2_head_view(&tr->lay.blocks[L + 1], tr->blocks[L + 1].grad, &hg);
    fy_gpt2_head_bwd(mc, &hw, &hg, ew.wte, eg.wte, tr->acts[L - 1].out, &tr->head, &tr->sc, B,
                     T, tr->s);
    for (int l = L - 1; l >= 0; l--) {
        fy_gpt2_layer_w w, g;
        fy_gpt2_layer_view(&tr->lay.blocks[1 + l], tr->blocks[1 + l].param, &w);
        fy_gpt2_layer_view(&tr->lay.blocks[1 + l], tr->blocks[1 + l].grad, &g);
        fy_gpt2_layer_bwd(mc, &w, &g, &tr->acts[l], l ? tr->acts[l - 1].out : tr->x0, &tr->sc,
                          B, T, tr->s);
    }
    fy_gpt2_embed_bwd(mc, &eg, tr->tok_dev, &tr->sc, B, T, tr->s);
}

static void upload_tokens(fy_trainer *tr, const int32_t *x, const int32_t *y) {
    const size_t N = (size_t)tr->cfg.B * tr->cfg.T;
    /* the staging buffer is reused by the next micro-batch: wait for the previous copy */
    fy_stream_sync(tr->s);
    memcpy(tr->tok_host, x, N * sizeof(int32_t));
    memcpy(tr->tok_host + N, y, N * sizeof(int32_t));
    fy_copy_async(tr->s, tr->tok_dev, tr->tok_host, 2 * N * sizeof(int32_t), FY_H2D);
}

fy_status fy_trainer_step(fy_trainer *tr, const int32_t *x, const int32_t *y, int accum,
                          float lr, fy_step_stats *out) {
    if (accum < 1 || accum > tr->max_accum) {
        fy_log_error("gradient accumulation must be 1..%d, got %d", tr->max_accum, accum);
        return FY_ERR_INVALID;
    }
    const size_t N = (size_t)tr->cfg.B * tr->cfg.T;
    const int nb = tr->lay.nblocks;
    for (int b = 0; b < nb; b++)
        fy_memset_async(tr->s, tr->blocks[b].grad, 0, tr->lay.blocks[b].nelem * sizeof(float));
    float dloss = (float)(1.0 / ((double)N * accum));
    for (int a = 0; a < accum; a++) {
        upload_tokens(tr, x + a * N, y + a * N);
        forward(tr, dloss, tr->loss_dev + a);
        backward(tr);
    }
    for (int b = 0; b < nb; b++)
        fy_k_sumsq(tr->sumsq_dev + b, tr->blocks[b].grad, tr->lay.blocks[b].nelem, tr->s);
    fy_copy_async(tr->s, tr->loss_host, tr->loss_dev, (size_t)accum * sizeof(float), FY_D2H);
    fy_copy_async(tr->s, tr->sumsq_host, tr->sumsq_dev, (size_t)nb * sizeof(double), FY_D2H);
    fy_stream_sync(tr->s);

    double loss = 0.0, ss = 0.0;
    for (int a = 0; a < accum; a++) loss += tr->loss_host[a];
    for (int b = 0; b < nb; b++) ss += tr->sumsq_host[b];
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
    for (int b = 0; b < nb; b++) {
        const fy_block_spec *blk = &tr->lay.blocks[b];
        block_state *bs = &tr->blocks[b];
        size_t split[3] = {0, blk->decay_nelem, blk->nelem};
        for (int part = 0; part < 2; part++) {
            size_t o = split[part], n = split[part + 1] - split[part];
            if (!n) continue;
            fy_adam_range r = {.param = bs->param + o, .m = bs->m + o, .v = bs->v + o,
                               .grad = bs->grad + o, .grad_dtype = FY_F32, .n = n,
                               .decay = part == 0};
            fy_k_adamw(&hp, &r, tr->s);
        }
    }
    fy_stream_sync(tr->s);
    return FY_OK;
}

fy_status fy_trainer_eval(fy_trainer *tr, const int32_t *x, const int32_t *y, float *loss) {
    upload_tokens(tr, x, y);
    forward(tr, 0.0f, tr->loss_dev);
    fy_copy_async(tr->s, tr->loss_host, tr->loss_dev, sizeof(float), FY_D2H);
    fy_stream_sync(tr->s);
    *loss = tr->loss_host[0];
    return FY_OK;
}
