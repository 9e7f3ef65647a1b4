/* toy_family.h — a second model family, written only for the tests, to show the model
 * interface is real: an MLP language model (no attention, no norms) that trains through
 * the same trainer, plans, scheduler and tuner as GPT-2, with no change outside
 * engine/model and tests/.
 *
 *   embedding  x = tok[token] + pos[t]                     tok (V, C), pos (maxT, C)
 *   layer l    x += down(gelu(up(x)))                      up (H, C) + bias, down (C, H) + bias
 *   head       loss = crossentropy(x @ W^T + b, targets)   W = out (V, C), or tok when tied
 * Tied, the head links to the embedding (reads tok, adds into its gradient), as GPT-2's
 * does, through the interface's links; untied, the head owns its classifier.
 *
 * It is built from the device kernels (kernels.h) only. Tensor names are its own
 * ("tok.weight", "mlp.3.up.weight", ...). */
#ifndef FY_TOY_FAMILY_H
#define FY_TOY_FAMILY_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/util.h"
#include "engine/device/kernels.h"
#include "engine/model/model_impl.h"

typedef struct toy_cfg { int vocab, max_seq, channels, hidden, layers; bool tied; } toy_cfg;

static const toy_cfg *toy_cfg_of(const fy_model *m) { return m->ctx; }

/* Views of a block's buffer (dt-typed) as its tensors, in table order. */
static void toy_view(const fy_block_spec *blk, fy_dtype dt, const void *base, float **t) {
    const size_t es = fy_dtype_size(dt);
    for (int i = 0; i < blk->ntensors; i++)
        t[i] = base ? (float *)((char *)base + blk->tensors[i].offset * es) : NULL;
}

/* Activations: a layer keeps h = up(x) and g = gelu(h); its work holds the projection
 * in forward and dg, dh, the branch's d x in backward; the head keeps the logits and the
 * per-position losses (fp32). */
#define TOY_LAYER_SAVED(X) X(h, (size_t)N * H, S) X(g, (size_t)N * H, S)
#define TOY_LAYER_WORK(X) X(tmp, (size_t)N * C, S) X(dg, (size_t)N * H, S) X(dh, (size_t)N * H, S)
#define TOY_HEAD_SAVED(X) X(logits, (size_t)N * V, S) X(losses, (size_t)N, F)
typedef struct toy_layer_saved { TOY_LAYER_SAVED(FY_ACT_FIELD) } toy_layer_saved;
typedef struct toy_layer_work { TOY_LAYER_WORK(FY_ACT_FIELD) } toy_layer_work;
typedef struct toy_head_saved { TOY_HEAD_SAVED(FY_ACT_FIELD) } toy_head_saved;

#define TOY_DIMS(m, B, T, dt) \
    const toy_cfg *cfg = toy_cfg_of(m); \
    const size_t N = (size_t)(B) * (T), C = (size_t)cfg->channels, H = (size_t)cfg->hidden, \
                 V = (size_t)cfg->vocab, es = fy_dtype_size(dt); \
    (void)N; (void)C; (void)H; (void)V; (void)es

static void toy_bind_layer(const fy_model *m, int B, int T, fy_dtype dt, void *saved, void *work,
                           toy_layer_saved *s, toy_layer_work *w) {
    TOY_DIMS(m, B, T, dt);
    size_t off = 0;
    { toy_layer_saved *out = s; void *base = saved; TOY_LAYER_SAVED(FY_ACT_BIND) }
    off = 0;
    { toy_layer_work *out = w; void *base = work; TOY_LAYER_WORK(FY_ACT_BIND) }
}

static void toy_acts(const fy_model *m, int b, int B, int T, fy_dtype dt, bool training,
                     fy_act_sizes *out) {
    TOY_DIMS(m, B, T, dt);
    size_t total = 0;
    switch (m->blocks[b].kind) {
    case FY_BLOCK_EMBED: out->out = fy_round_up(N * C * es, 64); break;
    case FY_BLOCK_LAYER:
        out->out = fy_round_up(N * C * es, 64);
        TOY_LAYER_SAVED(FY_ACT_SIZE)
        out->saved = total;
        total = 0;
        TOY_LAYER_WORK(FY_ACT_SIZE)
        out->work = total;
        break;
    default:
        TOY_HEAD_SAVED(FY_ACT_SIZE)
        out->saved = total;
    }
}

static void toy_forward(const fy_model *m, int b, const fy_block_io *io, fy_stream *s) {
    const fy_dtype dt = fy_stream_dtype(s);
    TOY_DIMS(m, io->B, io->T, dt);
    float *w[4];
    toy_view(&m->blocks[b], dt, io->params, w);
    if (m->blocks[b].kind == FY_BLOCK_EMBED) {
        fy_k_encoder_fwd(io->out, io->tokens, w[0], w[1], io->docs, io->B, io->T, (int)C, (int)V, 1.0f, s);
        return;
    }
    toy_layer_saved a;
    toy_layer_work k;
    toy_bind_layer(m, io->B, io->T, dt, io->saved, io->work, &a, &k);
    /* w: up.weight, down.weight (decayed first), up.bias, down.bias */
    fy_k_matmul_fwd(a.h, io->in, w[0], w[2], (int)N, (int)C, (int)H, s);
    fy_k_gelu_fwd(a.g, a.h, N * H, s);
    fy_k_matmul_fwd(k.tmp, a.g, w[1], w[3], (int)N, (int)H, (int)C, s);
    fy_k_residual_fwd(io->out, io->in, k.tmp, N * C, s);
}

static void toy_backward(const fy_model *m, int b, const fy_block_io *io, fy_stream *s) {
    const fy_dtype dt = fy_stream_dtype(s);
    TOY_DIMS(m, io->B, io->T, dt);
    float *w[4], *g[4];
    toy_view(&m->blocks[b], dt, io->params, w);
    toy_view(&m->blocks[b], dt, io->grads, g);
    if (m->blocks[b].kind == FY_BLOCK_EMBED) {
        fy_k_encoder_bwd(g[0], g[1], io->dx, io->tokens, io->docs, io->B, io->T, (int)C, (int)V, 1.0f, s);
        return;
    }
    toy_layer_saved a;
    toy_layer_work k;
    toy_bind_layer(m, io->B, io->T, dt, io->saved, io->work, &a, &k);
    fy_k_matmul_bwd(k.dg, g[1], g[3], io->dx, a.g, w[1], (int)N, (int)H, (int)C, s);
    fy_k_gelu_bwd(k.dh, a.h, k.dg, N * H, s);
    fy_k_matmul_bwd(k.tmp, g[0], g[2], k.dh, io->in, w[0], (int)N, (int)C, (int)H, s);
    fy_k_residual_fwd(io->dx, io->dx, k.tmp, N * C, s); /* d in = d out + the branch's */
}

static void toy_loss(const fy_model *m, int b, const fy_block_io *io, fy_stream *s) {
    const fy_dtype dt = fy_stream_dtype(s);
    TOY_DIMS(m, io->B, io->T, dt);
    float *w[2], *g[2], *emb[2], *gemb[2] = {0};
    toy_view(&m->blocks[b], dt, io->params, w);
    toy_view(&m->blocks[b], dt, io->grads, g);
    size_t off = 0;
    toy_head_saved a, *out = &a;
    void *base = io->saved;
    TOY_HEAD_SAVED(FY_ACT_BIND)
    /* the classifier: the head's own (out.weight, out.bias), or tok (link 0) and out.bias */
    const float *W = w[0], *bias = cfg->tied ? w[0] : w[1];
    float *gW = g[0], *gbias = cfg->tied ? g[0] : g[1];
    if (cfg->tied) {
        toy_view(&m->blocks[m->blocks[b].links[0]], dt, io->link_params[0], emb);
        toy_view(&m->blocks[m->blocks[b].links[0]], dt, io->link_grads[0], gemb);
        W = emb[0];
        gW = gemb[0];
    }
    fy_k_matmul_fwd(a.logits, io->in, W, bias, (int)N, (int)C, (int)V, s);
    fy_k_crossentropy(a.losses, a.logits, io->targets, (int)N, (int)V, (int)V, io->dloss, 0.0f, s);
    fy_k_mean(io->loss, a.losses, N, fy_block_loss_div(io), s);
    if (io->dloss != 0.0f)
        fy_k_matmul_bwd(io->dx, gW, gbias, a.logits, io->in, W, (int)N, (int)C, (int)V, s);
}

static uint64_t toy_mix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Matrices uniform with variance 1/(3 fan-in), vectors zero. */
static void toy_init_block(const fy_model *m, int b, uint64_t seed, float *host) {
    const fy_block_spec *blk = &m->blocks[b];
    for (int i = 0; i < blk->ntensors; i++) {
        const fy_tensor_spec *t = &blk->tensors[i];
        if (t->cols == 1) continue;
        uint64_t st = seed ^ (0x9e37ull * (uint64_t)(b + 1)) ^ (0x85ebull * (uint64_t)(i + 1));
        const double a = 1.0 / sqrt((double)t->cols);
        for (size_t j = 0; j < (size_t)t->rows * t->cols; j++)
            host[t->offset + j] = (float)(a * ((double)(toy_mix(&st) >> 11) * 0x1p-53 * 2.0 - 1.0));
    }
}

static void toy_cost(const fy_model *m, int b, fy_pass pass, int B, int T, double es, fy_cost *out) {
    const toy_cfg *c = toy_cfg_of(m);
    const double N = (double)B * T, P = (double)m->blocks[b].nelem;
    switch (m->blocks[b].kind) {
    case FY_BLOCK_EMBED: out->bytes = 3.0 * N * c->channels * es; break;
    case FY_BLOCK_HEAD:
        out->flops = 6.0 * N * c->channels * c->vocab;
        out->bytes = 4.0 * N * c->vocab * es;
        break;
    default:
        out->flops = (pass == FY_PASS_BWD ? 4.0 : 2.0) * N * P;
        out->bytes = (pass == FY_PASS_BWD ? 3.0 : 1.0) * es * P + 4.0 * N * c->hidden * es;
    }
}

static void toy_describe(const fy_model *m, char *buf, size_t cap) {
    const toy_cfg *c = toy_cfg_of(m);
    snprintf(buf, cap, "vocab %d, positions %d, channels %d, hidden %d, layers %d, %s", c->vocab,
             c->max_seq, c->channels, c->hidden, c->layers, c->tied ? "tied" : "untied");
}

static fy_status toy_check_seq(const fy_model *m, int64_t T) {
    if (T <= toy_cfg_of(m)->max_seq) return FY_OK;
    fy_log_error("--seq %lld is longer than the model's %d positions", (long long)T,
                 toy_cfg_of(m)->max_seq);
    return FY_ERR_INVALID;
}

static const fy_model_iface toy_iface = {
    .family = "toy-mlp",
    .free = free,
    .describe = toy_describe,
    .check_seq = toy_check_seq,
    .acts = toy_acts,
    .forward = toy_forward,
    .backward = toy_backward,
    .loss = toy_loss,
    .init_block = toy_init_block,
    .cost = toy_cost,
};

static fy_status toy_new(const toy_cfg *cfg, fy_model **out) {
    const int L = cfg->layers, V = cfg->vocab, C = cfg->channels, H = cfg->hidden;
    toy_cfg *ctx = malloc(sizeof *ctx);
    fy_block_spec *blocks = calloc((size_t)L + 2, sizeof *blocks);
    if (!ctx || !blocks) { free(ctx); free(blocks); return FY_ERR_NOMEM; }
    *ctx = *cfg;
    blocks[0].kind = FY_BLOCK_EMBED;
    fy_model_add_tensor(&blocks[0], "tok.weight", V, C, true, false);
    fy_model_add_tensor(&blocks[0], "pos.weight", cfg->max_seq, C, true, false);
    char name[64];
    for (int l = 0; l < L; l++) {
        fy_block_spec *blk = &blocks[1 + l];
        blk->kind = FY_BLOCK_LAYER;
        blk->layer = l;
        snprintf(name, sizeof name, "mlp.%d.up.weight", l);
        fy_model_add_tensor(blk, name, H, C, true, false);
        snprintf(name, sizeof name, "mlp.%d.down.weight", l);
        fy_model_add_tensor(blk, name, C, H, true, false);
        snprintf(name, sizeof name, "mlp.%d.up.bias", l);
        fy_model_add_tensor(blk, name, H, 1, false, false);
        snprintf(name, sizeof name, "mlp.%d.down.bias", l);
        fy_model_add_tensor(blk, name, C, 1, false, false);
    }
    fy_block_spec *head = &blocks[L + 1];
    head->kind = FY_BLOCK_HEAD;
    if (cfg->tied) {
        fy_model_add_tensor(head, "out.bias", V, 1, false, false);
        head->nlinks = 1;
        head->links[0] = 0;
    } else {
        fy_model_add_tensor(head, "out.weight", V, C, true, false);
        fy_model_add_tensor(head, "out.bias", V, 1, false, false);
    }
    size_t np = 0;
    for (int b = 0; b < L + 2; b++) {
        fy_model_place_tensors(&blocks[b]);
        for (int i = 0; i < blocks[b].ntensors; i++)
            np += (size_t)blocks[b].tensors[i].rows * blocks[b].tensors[i].cols;
    }
    return fy_model_create(&toy_iface, ctx, cfg->tied ? "toy-mlp-tied" : "toy-mlp", blocks, L + 2,
                           V, np, out);
}

#endif
