/* gpt2.c — the GPT-2 family: configs, the block specs, initialisation, activation sizes,
 * costs, and the per-block passes as straight sequences of kernel launches; and the
 * model-interface functions that bind a block's device views to them. */
#include "engine/model/gpt2.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/util.h"
#include "engine/device/kernels.h"
#include "engine/model/lm_head.h"
#include "engine/model/model_impl.h"

static const struct { const char *name; fy_gpt2_config cfg; } named[] = {
    {"gpt2-tiny", {256, 128, 64, 2, 4}},
    {"gpt2-mini", {256, 256, 128, 4, 4}},
    {"gpt2-small-byte", {256, 256, 384, 6, 6}},
    {"gpt2-124m", {50257, 1024, 768, 12, 12}},
    {"gpt2-350m", {50257, 1024, 1024, 24, 16}},
    {"gpt2-774m", {50257, 1024, 1280, 36, 20}},
    {"gpt2-1558m", {50257, 1024, 1600, 48, 25}},
};

fy_status fy_gpt2_config_named(const char *name, fy_gpt2_config *out) {
    for (size_t i = 0; i < sizeof named / sizeof named[0]; i++)
        if (!strcmp(name, named[i].name)) { *out = named[i].cfg; return FY_OK; }
    fy_log_error("unknown model '%s' (known: %s)", name, fy_gpt2_config_names());
    return FY_ERR_INVALID;
}

const char *fy_gpt2_config_names(void) {
    return "gpt2-tiny, gpt2-mini, gpt2-small-byte, gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1558m";
}

fy_status fy_gpt2_config_check(const fy_gpt2_config *c) {
    if (c->vocab <= 0 || c->max_seq <= 0 || c->channels <= 0 || c->layers <= 0 || c->heads <= 0) {
        fy_log_error("model shape must be positive: vocab %d, max_seq %d, channels %d, "
                     "layers %d, heads %d", c->vocab, c->max_seq, c->channels, c->layers, c->heads);
        return FY_ERR_INVALID;
    }
    if (c->layers > FY_MODEL_MAX_LAYERS) {
        fy_log_error("model: %d layers is more than the %d ferry supports", c->layers,
                     FY_MODEL_MAX_LAYERS);
        return FY_ERR_INVALID;
    }
    if (c->channels % c->heads) {
        fy_log_error("heads (%d) must divide channels (%d)", c->heads, c->channels);
        return FY_ERR_INVALID;
    }
    if (c->channels / c->heads > FY_ATTN_MAX_HEAD) {
        fy_log_error("%d heads of %d channels: ferry's attention takes heads of at most %d "
                     "(more heads)", c->heads, c->channels, FY_ATTN_MAX_HEAD);
        return FY_ERR_INVALID;
    }
    return FY_OK;
}

fy_status fy_gpt2_check_seq(const fy_gpt2_config *cfg, int64_t T) {
    if (T > cfg->max_seq) {
        fy_log_error("--seq %lld is longer than the model's %d positions", (long long)T,
                     cfg->max_seq);
        return FY_ERR_INVALID;
    }
    return FY_OK;
}

size_t fy_gpt2_num_params(const fy_gpt2_config *c) {
    size_t C = (size_t)c->channels;
    return (size_t)c->vocab * C + (size_t)c->max_seq * C + 2 * C +
           (size_t)c->layers * (12 * C * C + 13 * C);
}

/* ---- views ------------------------------------------------------------------------- */

void fy_gpt2_layer_view(const fy_block_spec *blk, fy_dtype dt, const void *base, fy_gpt2_layer_w *out) {
    fy_model_view(blk, dt, base, (float **)out, sizeof *out / sizeof(float *));
}
void fy_gpt2_embed_view(const fy_block_spec *blk, fy_dtype dt, const void *base, fy_gpt2_embed_w *out) {
    fy_model_view(blk, dt, base, (float **)out, sizeof *out / sizeof(float *));
}
void fy_gpt2_head_view(const fy_block_spec *blk, fy_dtype dt, const void *base, fy_gpt2_head_w *out) {
    fy_model_view(blk, dt, base, (float **)out, sizeof *out / sizeof(float *));
}

/* ---- activations ------------------------------------------------------------------ */

#define DIMS const size_t N = (size_t)B * T, C = (size_t)cfg->channels, V = (size_t)cfg->vocab, \
                          Vp = (size_t)fy_gpt2_vocab_padded(cfg), NH = (size_t)cfg->heads, \
                          es = fy_dtype_size(dt == FY_DTYPE_NONE ? FY_F32 : dt); \
             (void)N; (void)C; (void)V; (void)Vp; (void)NH; (void)es

size_t fy_gpt2_layer_acts_nbytes(const fy_gpt2_config *cfg, int B, int T, fy_dtype dt) {
    DIMS; size_t total = 0; FY_GPT2_LAYER_ACTS(FY_ACT_SIZE) return total;
}
size_t fy_gpt2_layer_work_nbytes(const fy_gpt2_config *cfg, int B, int T, int chunk, fy_dtype dt) {
    DIMS; const size_t Nc = N < (size_t)chunk ? N : (size_t)chunk;
    size_t total = 0; FY_GPT2_LAYER_WORK(FY_ACT_SIZE) return total;
}
size_t fy_gpt2_head_acts_nbytes(const fy_gpt2_config *cfg, int B, int T, fy_dtype dt) {
    DIMS; size_t total = 0; FY_GPT2_HEAD_ACTS(FY_ACT_SIZE) return total;
}
size_t fy_gpt2_head_work_nbytes(const fy_gpt2_config *cfg, int B, int T, fy_dtype dt) {
    DIMS; size_t total = 0; FY_GPT2_HEAD_WORK(FY_ACT_SIZE) return total;
}
size_t fy_gpt2_head_work_eval_nbytes(const fy_gpt2_config *cfg, int B, int T, fy_dtype dt) {
    DIMS; return fy_round_up((size_t)N * (size_t)fy_gpt2_chunks(cfg, N, es).rows * es, 64);
}
void fy_gpt2_layer_acts_bind(const fy_gpt2_config *cfg, int B, int T, fy_dtype dt, void *base,
                             fy_gpt2_layer_acts *out) {
    DIMS; size_t off = 0; FY_GPT2_LAYER_ACTS(FY_ACT_BIND)
}
void fy_gpt2_layer_work_bind(const fy_gpt2_config *cfg, int B, int T, int chunk, fy_dtype dt, void *base,
                             fy_gpt2_layer_work *out) {
    DIMS; const size_t Nc = N < (size_t)chunk ? N : (size_t)chunk;
    size_t off = 0; FY_GPT2_LAYER_WORK(FY_ACT_BIND)
    out->rows = (int)Nc;
}
void fy_gpt2_head_acts_bind(const fy_gpt2_config *cfg, int B, int T, fy_dtype dt, void *base,
                            fy_gpt2_head_acts *out) {
    DIMS; size_t off = 0; FY_GPT2_HEAD_ACTS(FY_ACT_BIND)
}
void fy_gpt2_head_work_bind(const fy_gpt2_config *cfg, int B, int T, fy_dtype dt, void *base,
                            fy_gpt2_head_work *out) {
    DIMS; size_t off = 0; FY_GPT2_HEAD_WORK(FY_ACT_BIND)
}

/* ---- forward ---------------------------------------------------------------------- */

void fy_gpt2_embed_fwd(const fy_gpt2_config *cfg, const fy_gpt2_embed_w *w,
                       const int32_t *tokens, const int32_t *docs, float *x0, int B, int T,
                       fy_stream *s) {
    fy_k_encoder_fwd(x0, tokens, w->wte, w->wpe, docs, B, T, cfg->channels, cfg->vocab, 1.0f, s);
}

void fy_gpt2_layer_fwd(const fy_gpt2_config *cfg, const fy_gpt2_layer_w *w,
                       fy_gpt2_layer_acts *a, const float *x_in, fy_gpt2_layer_work *wk,
                       const int32_t *docs, int B, int T, fy_stream *s) {
    const int C = cfg->channels, NH = cfg->heads, N = B * T, Nc = wk->rows;
    const fy_attn at = {.scale = 1.0f / sqrtf((float)(C / NH)), .docs = docs};
    const size_t NC = (size_t)N * C, es = fy_dtype_size(fy_stream_dtype(s));
    fy_k_layernorm_fwd(a->ln1, a->ln1_mean, a->ln1_rstd, x_in, w->ln1w, w->ln1b, N, C, s);
    fy_k_matmul_fwd(a->qkv, a->ln1, w->qkvw, w->qkvb, N, C, 3 * C, s);
    fy_k_attention_fwd(a->atty, a->lse, a->qkv, B, T, NH, NH, C / NH, &at, s);
    for (int r = 0; r < N; r += Nc) { /* the projections by sequence chunks (wk->proj) */
        const int n = N - r < Nc ? N - r : Nc;
        fy_k_matmul_fwd(wk->proj, fy_rows(a->atty, r, C, es), w->attprojw, w->attprojb, n, C, C, s);
        fy_k_residual_fwd(fy_rows(a->res2, r, C, es), fy_rows(x_in, r, C, es), wk->proj,
                          (size_t)n * C, s);
    }
    fy_k_layernorm_fwd(a->ln2, a->ln2_mean, a->ln2_rstd, a->res2, w->ln2w, w->ln2b, N, C, s);
    fy_k_matmul_fwd(a->fch, a->ln2, w->fcw, w->fcb, N, C, 4 * C, s);
    fy_k_gelu_fwd(a->fch_gelu, a->fch, NC * 4, s);
    for (int r = 0; r < N; r += Nc) {
        const int n = N - r < Nc ? N - r : Nc;
        fy_k_matmul_fwd(wk->proj, fy_rows(a->fch_gelu, r, 4 * C, es), w->fcprojw, w->fcprojb, n,
                        4 * C, C, s);
        fy_k_residual_fwd(fy_rows(a->out, r, C, es), fy_rows(a->res2, r, C, es), wk->proj,
                          (size_t)n * C, s);
    }
}

static fy_lm_chunks head_chunks(const fy_gpt2_config *cfg, int N, fy_stream *s) {
    return fy_gpt2_chunks(cfg, (size_t)N, fy_dtype_size(fy_stream_dtype(s)));
}

void fy_gpt2_head_fwd(const fy_gpt2_config *cfg, const fy_gpt2_head_w *w, const float *wte,
                      const float *xL, fy_gpt2_head_acts *a, fy_gpt2_head_work *wk,
                      const int32_t *targets, float *loss_out, int64_t loss_div, int B, int T,
                      fy_stream *s) {
    const int C = cfg->channels, N = B * T;
    fy_k_layernorm_fwd(a->lnf, a->lnf_mean, a->lnf_rstd, xL, w->lnfw, w->lnfb, N, C, s);
    fy_lm_head(&(fy_lm_head_io){.N = N, .C = C, .V = cfg->vocab, .chunks = head_chunks(cfg, N, s),
                                .xn = a->lnf, .logits = wk->logits, .max = a->lse_max,
                                .sum = (double *)a->lse_sum, .tlogit = a->tlogit,
                                .losses = a->losses, .targets = targets},
               wte, NULL, s);
    fy_k_mean(loss_out, a->losses, (size_t)N, loss_div, s);
}

/* ---- backward --------------------------------------------------------------------- */

void fy_gpt2_head_step(const fy_gpt2_config *cfg, const fy_gpt2_head_w *w,
                       fy_gpt2_head_w *g, const float *wte, float *dwte, const float *xL,
                       fy_gpt2_head_acts *a, fy_gpt2_head_work *wk, const int32_t *targets,
                       float dloss, float *loss_out, int64_t loss_div, float *dx, int B, int T,
                       fy_stream *s) {
    const int C = cfg->channels, N = B * T;
    fy_k_layernorm_fwd(a->lnf, a->lnf_mean, a->lnf_rstd, xL, w->lnfw, w->lnfb, N, C, s);
    fy_lm_head(&(fy_lm_head_io){.N = N, .C = C, .V = cfg->vocab, .chunks = head_chunks(cfg, N, s),
                                .xn = a->lnf, .logits = wk->logits, .max = a->lse_max,
                                .sum = (double *)a->lse_sum, .tlogit = a->tlogit,
                                .losses = a->losses, .targets = targets, .dloss = dloss,
                                .dxn32 = wk->dlnf32, .dxn = wk->dlnf},
               wte, dwte, s);
    fy_k_mean(loss_out, a->losses, (size_t)N, loss_div, s);
    fy_memset_async(s, dx, 0, (size_t)N * C * fy_dtype_size(fy_stream_dtype(s)));
    fy_k_layernorm_bwd(dx, g->lnfw, g->lnfb, wk->dlnf ? wk->dlnf : wk->dlnf32, xL, w->lnfw,
                       a->lnf_mean, a->lnf_rstd, N, C, s);
}

void fy_gpt2_layer_bwd(const fy_gpt2_config *cfg, const fy_gpt2_layer_w *w,
                       fy_gpt2_layer_w *g, const fy_gpt2_layer_acts *a, const float *x_in,
                       fy_gpt2_layer_work *wk, float *dx, const int32_t *docs, int B, int T,
                       fy_stream *s) {
    const int C = cfg->channels, NH = cfg->heads, N = B * T, Nc = wk->rows;
    const size_t es = fy_dtype_size(fy_stream_dtype(s));
    const fy_attn at = {.scale = 1.0f / sqrtf((float)(C / NH)), .docs = docs};
    /* MLP: out = res2 + fcproj(gelu(fc(ln2(res2)))), by sequence chunks, last first */
    for (int r = (N - 1) / Nc * Nc; r >= 0; r -= Nc) {
        const int n = N - r < Nc ? N - r : Nc;
        fy_k_matmul_bwd(wk->dfch_gelu, g->fcprojw, g->fcprojb, fy_rows(dx, r, C, es),
                        fy_rows(a->fch_gelu, r, 4 * C, es), w->fcprojw, n, 4 * C, C, s);
        fy_k_gelu_bwd(wk->dfch, fy_rows(a->fch, r, 4 * C, es), wk->dfch_gelu, (size_t)n * 4 * C, s);
        fy_k_matmul_bwd(wk->dln, g->fcw, g->fcb, wk->dfch, fy_rows(a->ln2, r, C, es), w->fcw, n, C,
                        4 * C, s);
        fy_k_layernorm_bwd(fy_rows(dx, r, C, es), g->ln2w, g->ln2b, wk->dln,
                           fy_rows(a->res2, r, C, es), w->ln2w, a->ln2_mean + r, a->ln2_rstd + r,
                           n, C, s);
    }
    /* attention: res2 = x_in + attproj(attn(qkv(ln1(x_in)))) */
    fy_k_matmul_bwd(wk->datty, g->attprojw, g->attprojb, dx, a->atty, w->attprojw,
                    N, C, C, s);
    fy_k_attention_bwd(wk->dqkv, wk->delta, wk->datty, a->qkv, a->atty, a->lse, B, T, NH, NH,
                       C / NH, &at, s);
    for (int r = (N - 1) / Nc * Nc; r >= 0; r -= Nc) {
        const int n = N - r < Nc ? N - r : Nc;
        fy_k_matmul_bwd(wk->dln, g->qkvw, g->qkvb, fy_rows(wk->dqkv, r, 3 * C, es),
                        fy_rows(a->ln1, r, C, es), w->qkvw, n, C, 3 * C, s);
        fy_k_layernorm_bwd(fy_rows(dx, r, C, es), g->ln1w, g->ln1b, wk->dln,
                           fy_rows(x_in, r, C, es), w->ln1w, a->ln1_mean + r, a->ln1_rstd + r, n,
                           C, s);
    }
}

void fy_gpt2_embed_bwd(const fy_gpt2_config *cfg, fy_gpt2_embed_w *g, const int32_t *tokens,
                       const int32_t *docs, const float *dx, int B, int T, fy_stream *s) {
    fy_k_encoder_bwd(g->wte, g->wpe, dx, tokens, docs, B, T, cfg->channels, cfg->vocab, 1.0f, s);
}

/* ---- init ------------------------------------------------------------------------- */

/* Weights N(0, 0.02), residual projections N(0, 0.02/sqrt(2L)), biases 0, norm gains 1.
 * Each tensor draws from its own stream seeded by (seed, block, tensor). */
static void init_block(const fy_model *m, int b, uint64_t seed, float *host) {
    const fy_gpt2_config *cfg = fy_gpt2_config_of(m);
    const fy_block_spec *blk = fy_model_block(m, b);
    for (int i = 0; i < blk->ntensors; i++) {
        const fy_tensor_spec *t = &blk->tensors[i];
        float *p = host + t->offset;
        size_t n = (size_t)t->rows * t->cols;
        bool gain = strstr(t->name, ".weight") != NULL; /* vectors: gains or biases */
        if (t->cols == 1) { /* biases 0, norm gains 1 */
            if (gain) for (size_t j = 0; j < n; j++) p[j] = 1.0f;
            continue;
        }
        double std = 0.02;
        if (strstr(t->name, "c_proj.weight")) std = 0.02 / sqrt(2.0 * cfg->layers);
        fy_model_fill_normal(p, n, std, seed, b, i);
    }
}

/* ---- the model interface ------------------------------------------------------------- */

typedef struct gpt2 { fy_gpt2_config cfg; } gpt2;

const fy_gpt2_config *fy_gpt2_config_of(const fy_model *m) {
    FY_ASSERT(!strcmp(fy_model_family(m), "gpt2"), "not a GPT-2 model");
    return &((const gpt2 *)m->ctx)->cfg;
}

static void describe(const fy_model *m, char *buf, size_t cap) {
    const fy_gpt2_config *c = fy_gpt2_config_of(m);
    snprintf(buf, cap, "vocab %d, positions %d, channels %d, layers %d, heads %d", c->vocab,
             c->max_seq, c->channels, c->layers, c->heads);
}

static fy_status check_seq(const fy_model *m, int64_t T) {
    return fy_gpt2_check_seq(fy_gpt2_config_of(m), T);
}

static void acts(const fy_model *m, int b, int B, int T, fy_dtype dt, bool training,
                 fy_act_sizes *out) {
    const fy_gpt2_config *cfg = fy_gpt2_config_of(m);
    const size_t NC = fy_round_up((size_t)B * T * cfg->channels * fy_dtype_size(dt), 64);
    switch (m->blocks[b].kind) {
    case FY_BLOCK_EMBED: out->out = NC; break;
    case FY_BLOCK_LAYER:
        out->out = NC;
        out->saved = fy_gpt2_layer_acts_nbytes(cfg, B, T, dt);
        out->work = fy_gpt2_layer_work_nbytes(cfg, B, T, m->chunk, dt);
        break;
    case FY_BLOCK_HEAD:
        out->saved = fy_gpt2_head_acts_nbytes(cfg, B, T, dt);
        out->work = training ? fy_gpt2_head_work_nbytes(cfg, B, T, dt)
                             : fy_gpt2_head_work_eval_nbytes(cfg, B, T, dt);
        break;
    default: break;
    }
}

static void forward(const fy_model *m, int b, const fy_block_io *io, fy_stream *s) {
    const fy_gpt2_config *cfg = fy_gpt2_config_of(m);
    const fy_block_spec *blk = &m->blocks[b];
    const fy_dtype dt = fy_stream_dtype(s);
    if (blk->kind == FY_BLOCK_EMBED) {
        fy_gpt2_embed_w w;
        fy_gpt2_embed_view(blk, dt, io->params, &w);
        fy_gpt2_embed_fwd(cfg, &w, io->tokens, io->docs, io->out, io->B, io->T, s);
        return;
    }
    fy_gpt2_layer_w w;
    fy_gpt2_layer_acts a;
    fy_gpt2_layer_work wk;
    fy_gpt2_layer_view(blk, dt, io->params, &w);
    fy_gpt2_layer_acts_bind(cfg, io->B, io->T, dt, io->saved, &a);
    a.out = io->out;
    fy_gpt2_layer_work_bind(cfg, io->B, io->T, m->chunk, dt, io->work, &wk);
    fy_gpt2_layer_fwd(cfg, &w, &a, io->in, &wk, io->docs, io->B, io->T, s);
}

static void backward(const fy_model *m, int b, const fy_block_io *io, fy_stream *s) {
    const fy_gpt2_config *cfg = fy_gpt2_config_of(m);
    const fy_block_spec *blk = &m->blocks[b];
    const fy_dtype dt = fy_stream_dtype(s);
    if (blk->kind == FY_BLOCK_EMBED) {
        fy_gpt2_embed_w g;
        fy_gpt2_embed_view(blk, dt, io->grads, &g);
        fy_gpt2_embed_bwd(cfg, &g, io->tokens, io->docs, io->dx, io->B, io->T, s);
        return;
    }
    fy_gpt2_layer_w w, g;
    fy_gpt2_layer_acts a;
    fy_gpt2_layer_work wk;
    fy_gpt2_layer_view(blk, dt, io->params, &w);
    fy_gpt2_layer_view(blk, dt, io->grads, &g);
    fy_gpt2_layer_acts_bind(cfg, io->B, io->T, dt, io->saved, &a);
    a.out = io->out;
    fy_gpt2_layer_work_bind(cfg, io->B, io->T, m->chunk, dt, io->work, &wk);
    fy_gpt2_layer_bwd(cfg, &w, &g, &a, io->in, &wk, io->dx, io->docs, io->B, io->T, s);
}

/* The head: ln_f, then the classifier on the tied wte (link 0, the embedding). */
static void loss(const fy_model *m, int b, const fy_block_io *io, fy_stream *s) {
    const fy_gpt2_config *cfg = fy_gpt2_config_of(m);
    const fy_block_spec *blk = &m->blocks[b], *emb = &m->blocks[blk->links[0]];
    const fy_dtype dt = fy_stream_dtype(s);
    fy_gpt2_head_w w, g;
    fy_gpt2_embed_w ew, eg;
    fy_gpt2_head_acts a;
    fy_gpt2_head_view(blk, dt, io->params, &w);
    fy_gpt2_embed_view(emb, dt, io->link_params[0], &ew);
    fy_gpt2_head_acts_bind(cfg, io->B, io->T, dt, io->saved, &a);
    fy_gpt2_head_work wk; /* evaluation's workspace holds the logits alone */
    fy_gpt2_head_work_bind(cfg, io->B, io->T, dt, io->work, &wk);
    if (io->dloss == 0.0f) {
        fy_gpt2_head_fwd(cfg, &w, ew.wte, io->in, &a, &wk, io->targets, io->loss,
                         fy_block_loss_div(io), io->B, io->T, s);
        return;
    }
    fy_gpt2_head_view(blk, dt, io->grads, &g);
    fy_gpt2_embed_view(emb, dt, io->link_grads[0], &eg);
    fy_gpt2_head_step(cfg, &w, &g, ew.wte, eg.wte, io->in, &a, &wk, io->targets, io->dloss,
                      io->loss, fy_block_loss_div(io), io->dx, io->B, io->T, s);
}

/* Matmul FLOPs at the effective throughput plus memory traffic: a layer's forward is
 * 2*N*P for its weights plus 4*B*C per attended (query, key) pair (two products of hd per
 * head: the scores and the values; causal, about T^2/2 pairs, model_impl.h), and moves its
 * parameters once and ~20 activations of N*C; backward twice the weights' FLOPs and 3.5
 * times the attention's (the cuda kernels' seven products: the scores and dP rebuilt in
 * both the dK/dV and the dQ pass, dV, dK, dQ; the cpu's five cost less than this says),
 * six passes over the parameters and
 * ~40 activations; the embedding moves 3 activations either way; the head's classifier
 * is 6*N*C*V FLOPs (forward and both backward products) over 4 passes of the logits. */
static void cost(const fy_model *m, int b, fy_pass pass, int B, int T, double es, fy_cost *out) {
    const fy_gpt2_config *cfg = fy_gpt2_config_of(m);
    const fy_block_spec *blk = &m->blocks[b];
    const double N = (double)B * T, C = cfg->channels, V = cfg->vocab, P = (double)blk->nelem;
    const double att = 4.0 * B * C * fy_attn_pairs(T, 0);
    const double fwd_flops = 2.0 * N * P + att;
    if (blk->kind == FY_BLOCK_EMBED) {
        out->bytes = 3.0 * N * C * es;
    } else if (blk->kind == FY_BLOCK_HEAD) {
        out->flops = 6.0 * N * C * V;
        out->bytes = 4.0 * N * V * es;
    } else if (pass == FY_PASS_BWD) {
        out->flops = 2.0 * (fwd_flops - att) + 3.5 * att;
        out->bytes = 6.0 * es * P + 40.0 * N * C * es;
    } else {
        out->flops = fwd_flops;
        out->bytes = es * P + 20.0 * N * C * es;
    }
}

/* Buffers older checkpoints hold: the causal mask and its fill value. */
static bool ignored(const fy_model *m, const char *name) {
    (void)m;
    size_t n = strlen(name);
    return (n > 10 && !strcmp(name + n - 10, ".attn.bias")) ||
           (n > 17 && !strcmp(name + n - 17, ".attn.masked_bias"));
}

/* GPT-2's head is the token embedding: a stored lm_head.weight is a copy of it (or, if it
 * differs, not what GPT2LMHeadModel computes with either). */
static const char *tied_to(const fy_model *m, const char *name) {
    (void)m;
    return !strcmp(name, "lm_head.weight") ? "wte.weight" : NULL;
}

static void gpt2_free(void *ctx) { free(ctx); }

static const char *const prefixes[] = {"", "transformer.", NULL};

static const fy_model_iface gpt2_iface = {
    .family = "gpt2",
    .free = gpt2_free,
    .describe = describe,
    .check_seq = check_seq,
    .acts = acts,
    .forward = forward,
    .backward = backward,
    .loss = loss,
    .init_block = init_block,
    .cost = cost,
    .file_prefixes = prefixes,
    .dir_prefix = "transformer.",
    .ignored = ignored,
    .tied_to = tied_to,
    .untie_hint = "GPT-2's head is always its token embedding",
    .hf_config = fy_gpt2_hf_config,
};

fy_status fy_gpt2_new(const fy_gpt2_config *cfg, const char *name, fy_model **out) {
    *out = NULL;
    FY_TRY(fy_gpt2_config_check(cfg));
    const int V = cfg->vocab, maxT = cfg->max_seq, C = cfg->channels, L = cfg->layers;
    gpt2 *ctx = malloc(sizeof *ctx);
    fy_block_spec *blocks = calloc((size_t)L + 2, sizeof *blocks);
    if (!ctx || !blocks) { free(ctx); free(blocks); return FY_ERR_NOMEM; }
    ctx->cfg = *cfg;
    char tname[64];
#define ADD(field, hf, rows, cols, decay, conv1d) fy_model_add_tensor(blk, hf, rows, cols, decay, conv1d);
    fy_block_spec *blk = &blocks[0];
    blk->kind = FY_BLOCK_EMBED;
    FY_GPT2_EMBED_PARAMS(ADD)
    blk->tensors[0].alloc_rows = fy_gpt2_vocab_padded(cfg); /* wte: see fy_gpt2_vocab_padded */
#undef ADD
#define ADD(field, hf, rows, cols, decay, conv1d) \
    snprintf(tname, sizeof tname, "h.%d.%s", l, hf); fy_model_add_tensor(blk, tname, rows, cols, decay, conv1d);
    for (int l = 0; l < L; l++) {
        blk = &blocks[1 + l];
        blk->kind = FY_BLOCK_LAYER;
        blk->layer = l;
        FY_GPT2_LAYER_PARAMS(ADD)
    }
#undef ADD
#define ADD(field, hf, rows, cols, decay, conv1d) fy_model_add_tensor(blk, hf, rows, cols, decay, conv1d);
    blk = &blocks[L + 1];
    blk->kind = FY_BLOCK_HEAD;
    FY_GPT2_HEAD_PARAMS(ADD)
    blk->nlinks = 1; /* the classifier is wte: tied to the embedding */
    blk->links[0] = 0;
#undef ADD
    (void)V; (void)maxT;
    for (int b = 0; b < L + 2; b++) fy_model_place_tensors(&blocks[b]);
    FY_TRY(fy_model_create(&gpt2_iface, ctx, name, blocks, L + 2, V, fy_gpt2_num_params(cfg), out));
    (*out)->head_dim = cfg->channels / cfg->heads;
    return FY_OK;
}

fy_status fy_gpt2_named(const char *name, const fy_model_shape *over, fy_model **out) {
    *out = NULL;
    fy_gpt2_config cfg;
    size_t i = 0;
    for (; i < sizeof named / sizeof named[0]; i++)
        if (!strcmp(name, named[i].name)) break;
    if (i == sizeof named / sizeof named[0]) return FY_ERR_UNSUPPORTED;
    cfg = named[i].cfg;
    if ((over->kv_heads > 0 && over->kv_heads != (over->heads > 0 ? over->heads : cfg.heads)) ||
        (over->ffn > 0 && over->ffn != 4 * (over->channels > 0 ? over->channels : cfg.channels))) {
        fy_log_error("--kv-heads and --ffn shape Llama models; GPT-2's key/value heads are its "
                     "heads and its MLP is 4 x channels");
        return FY_ERR_INVALID;
    }
    if (over->heads > 0) cfg.heads = over->heads;
    if (over->layers > 0) cfg.layers = over->layers;
    if (over->channels > 0) cfg.channels = over->channels;
    if (over->vocab > 0) cfg.vocab = over->vocab;
    if (over->max_seq > 0) cfg.max_seq = over->max_seq;
    bool same = !memcmp(&cfg, &named[i].cfg, sizeof cfg);
    return fy_gpt2_new(&cfg, same ? name : NULL, out);
}
