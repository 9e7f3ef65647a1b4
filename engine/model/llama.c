/* llama.c — the Llama family: named configs, the block specs, initialisation, activation
 * sizes, costs, and the per-block passes as straight sequences of kernel launches (the
 * config.json side is llama_io.c). */
#include "engine/model/llama.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/util.h"
#include "engine/device/kernels.h"
#include "engine/model/lm_head.h"
#include "engine/model/model_impl.h"

#define ROPE_NONE(base) {.type = FY_ROPE_DEFAULT, .theta = base}
#define ROPE_L3(scale) {.type = FY_ROPE_LLAMA3, .theta = 500000.0f, .factor = scale, \
    .low_freq_factor = 1.0f, .high_freq_factor = 4.0f, .orig_max_pos = 8192.0f}

/* The published shapes (Hugging Face's config.json of each; Llama 3 8B and 70B as 3.1,
 * whose rope scaling reaches 131072 positions). */
static const struct { const char *name; fy_llama_config cfg; } named[] = {
    /* name           V       maxT    C     L   NH  NKV  hd   F      eps   rope              tied */
    {"llama-tiny",   {256,    1024,   128,  4,  4,  2,   32,  384,   1e-5f, ROPE_NONE(10000.0f), false, 0}},
    {"llama3.2-1b",  {128256, 131072, 2048, 16, 32, 8,   64,  8192,  1e-5f, ROPE_L3(32.0f), true, 0}},
    {"llama3.2-3b",  {128256, 131072, 3072, 28, 24, 8,   128, 8192,  1e-5f, ROPE_L3(32.0f), true, 0}},
    {"llama3-8b",    {128256, 131072, 4096, 32, 32, 8,   128, 14336, 1e-5f, ROPE_L3(8.0f), false, 0}},
    {"llama2-7b",    {32000,  4096,   4096, 32, 32, 32,  128, 11008, 1e-5f, ROPE_NONE(10000.0f), false, 0}},
    {"llama2-13b",   {32000,  4096,   5120, 40, 40, 40,  128, 13824, 1e-5f, ROPE_NONE(10000.0f), false, 0}},
    {"llama3-70b",   {128256, 131072, 8192, 80, 64, 8,   128, 28672, 1e-5f, ROPE_L3(8.0f), false, 0}},
};
#define NNAMED (int)(sizeof named / sizeof named[0])

fy_status fy_llama_config_named(const char *name, fy_llama_config *out) {
    for (int i = 0; i < NNAMED; i++)
        if (!strcmp(name, named[i].name)) { *out = named[i].cfg; return FY_OK; }
    return FY_ERR_UNSUPPORTED;
}

const char *fy_llama_config_names(void) {
    return "llama-tiny, llama3.2-1b, llama3.2-3b, llama3-8b, llama2-7b, llama2-13b, llama3-70b";
}

const char *fy_llama_width_names(void) {
    return "llama3.2-1b, llama3.2-3b, llama3-8b, llama2-7b, llama2-13b, llama3-70b";
}

fy_status fy_llama_config_check(const fy_llama_config *c) {
    if (c->vocab <= 0 || c->max_seq <= 0 || c->channels <= 0 || c->layers <= 0 || c->heads <= 0 ||
        c->kv_heads <= 0 || c->head_dim <= 0 || c->ffn <= 0) {
        fy_log_error("model shape must be positive: vocab %d, max_seq %d, channels %d, layers %d, "
                     "heads %d, kv heads %d, head dim %d, ffn %d", c->vocab, c->max_seq,
                     c->channels, c->layers, c->heads, c->kv_heads, c->head_dim, c->ffn);
        return FY_ERR_INVALID;
    }
    if (c->layers > FY_MODEL_MAX_LAYERS) {
        fy_log_error("model: %d layers is more than the %d ferry supports", c->layers,
                     FY_MODEL_MAX_LAYERS);
        return FY_ERR_INVALID;
    }
    if (c->heads % c->kv_heads) {
        fy_log_error("key/value heads (%d) must divide the attention heads (%d)", c->kv_heads,
                     c->heads);
        return FY_ERR_INVALID;
    }
    if (c->head_dim > FY_ATTN_MAX_HEAD) {
        fy_log_error("the head dimension (%d) is more than the %d ferry's attention takes",
                     c->head_dim, FY_ATTN_MAX_HEAD);
        return FY_ERR_INVALID;
    }
    if (c->head_dim % 2) {
        fy_log_error("the head dimension (%d) must be even for rotary embeddings", c->head_dim);
        return FY_ERR_INVALID;
    }
    /* sizes must fit the kernels' int arguments: the widest row, the classifier */
    if ((int64_t)(c->heads + 2 * c->kv_heads) * c->head_dim > (1 << 24) || c->ffn > (1 << 24) ||
        c->channels > (1 << 20) || c->vocab > (1 << 30)) {
        fy_log_error("implausible model shape (channels %d, heads %d x %d, ffn %d, vocab %d)",
                     c->channels, c->heads, c->head_dim, c->ffn, c->vocab);
        return FY_ERR_INVALID;
    }
    if (!(c->norm_eps > 0.0f) || !(c->rope.theta > 0.0f)) {
        fy_log_error("rms_norm_eps (%g) and rope_theta (%g) must be positive", c->norm_eps,
                     c->rope.theta);
        return FY_ERR_INVALID;
    }
    const fy_rope *r = &c->rope;
    if ((r->type == FY_ROPE_LINEAR || r->type == FY_ROPE_LLAMA3) && !(r->factor > 0.0f)) {
        fy_log_error("rope scaling factor (%g) must be positive", r->factor);
        return FY_ERR_INVALID;
    }
    if (!(r->theta <= 1e30f) || ((r->type == FY_ROPE_LINEAR || r->type == FY_ROPE_LLAMA3) && !(r->factor <= 1e6f))) {
        fy_log_error("implausible rope_theta (%g) or scaling factor (%g)", r->theta, r->factor);
        return FY_ERR_INVALID;
    }
    if (r->type == FY_ROPE_LLAMA3 && !(r->low_freq_factor > 0.0f && r->high_freq_factor > r->low_freq_factor &&
                                       r->orig_max_pos > 0.0f && r->orig_max_pos <= (float)(1 << 30))) {
        fy_log_error("llama3 rope scaling needs 0 < low_freq_factor (%g) < high_freq_factor (%g) "
                     "and original_max_position_embeddings > 0 (%g)", r->low_freq_factor,
                     r->high_freq_factor, r->orig_max_pos);
        return FY_ERR_INVALID;
    }
    if (c->sliding_window < 0) {
        fy_log_error("sliding window (%d) must not be negative", c->sliding_window);
        return FY_ERR_INVALID;
    }
    return FY_OK;
}

/* The classifier's chunks (lm_head.h): an untied lm_head streams by chunks through the
 * layers' slots, so a chunk and the head's norm fit in a layer's parameters. */
fy_lm_chunks fy_llama_chunks(const fy_llama_config *c, size_t N, size_t es) {
    const size_t Q = (size_t)c->heads * c->head_dim, KV = (size_t)c->kv_heads * c->head_dim;
    const size_t layer_rows = (Q + 2 * KV) + Q + 3 * (size_t)c->ffn; /* a layer's, less 2C, / C */
    return fy_lm_chunks_of(N, fy_lm_vocab_padded(c->vocab), es, c->tied ? 0 : layer_rows);
}

size_t fy_llama_num_params(const fy_llama_config *c) {
    const size_t C = (size_t)c->channels, Q = (size_t)c->heads * c->head_dim,
                 KV = (size_t)c->kv_heads * c->head_dim, F = (size_t)c->ffn, V = (size_t)c->vocab;
    const size_t layer = 2 * C + C * (Q + 2 * KV) + Q * C + 3 * C * F;
    return V * C + (size_t)c->layers * layer + C + (c->tied ? 0 : V * C);
}

/* ---- parameters, views, activations ---------------------------------------------------- */

/* X(field, hf_name, rows, cols, weight_decay, packed after the previous) */
#define LAYER_PARAMS(X)                                              \
    X(ln1, "input_layernorm.weight", C, 1, 0, 0)                     \
    X(wq, "self_attn.q_proj.weight", NH * hd, C, 1, 0)               \
    X(wk, "self_attn.k_proj.weight", NKV * hd, C, 1, 1)              \
    X(wv, "self_attn.v_proj.weight", NKV * hd, C, 1, 1)              \
    X(wo, "self_attn.o_proj.weight", C, NH * hd, 1, 0)               \
    X(ln2, "post_attention_layernorm.weight", C, 1, 0, 0)            \
    X(wgate, "mlp.gate_proj.weight", F, C, 1, 0)                     \
    X(wup, "mlp.up_proj.weight", F, C, 1, 1)                         \
    X(wdown, "mlp.down_proj.weight", C, F, 1, 0)
#define FIELD(field, ...) float *field;
typedef struct layer_w { LAYER_PARAMS(FIELD) } layer_w;
typedef struct head_w { float *norm, *lm_head; } head_w; /* lm_head absent when tied */

/* A layer's saved activations (qkv holds the roped q and k) and workspace; eval needs
 * only the first two work fields (proj, act), training all. The position-wise work runs by
 * sequence chunks of Nc rows (model.h: fy_model_chunk), so its buffers hold a chunk; the
 * attention's gradients (datty, dqkv) hold every row, as attention needs them whole. */
#define LAYER_ACTS(X)                    \
    X(ln1, N * C, S)                     \
    X(rstd1, N, F)                       \
    X(qkv, N * W, S)                     \
    X(lse, (size_t)B * NH * T, F)        \
    X(atty, N * Q, S)                    \
    X(res2, N * C, S)                    \
    X(ln2, N * C, S)                     \
    X(rstd2, N, F)                       \
    X(gu, N * 2 * Fn, S)
#define LAYER_WORK_EVAL(X)               \
    X(proj, Nc * C, S)                   \
    X(act, Nc * Fn, S)
#define LAYER_WORK(X)                    \
    LAYER_WORK_EVAL(X)                   \
    X(dln, Nc * C, S)                    \
    X(datty, N * Q, S)                   \
    X(dqkv, N * W, S)                    \
    X(dgu, Nc * 2 * Fn, S)               \
    X(dact, Nc * Fn, S)                  \
    X(delta, (size_t)B * NH * T, F)
/* The head's saved activations (the classifier's running log-sum-exp among them); in
 * training the fp32 accumulator of d lnf (lm_head.h), which an untied head keeps in its
 * saved area (a chunked head's backward is several tasks) and a tied one in the shared
 * workspace; and its training workspace, d lnf rounded to bf16. */
#define HEAD_ACTS(X)                            \
    X(lnf, N * C, S)                            \
    X(rstdf, N, F)                              \
    X(losses, N, F)                             \
    X(lse_max, N, F)                            \
    X(lse_sum, N, D)                            \
    X(tlogit, N, F)
#define HEAD_TRAIN(X)                           \
    X(dlnf32, cfg->tied ? 0 : N * C, F)
#define HEAD_WORK_EVAL(X)                       \
    X(logits, N * (size_t)fy_llama_chunks(cfg, N, es).rows, S)
#define HEAD_WORK(X)                            \
    HEAD_WORK_EVAL(X)                           \
    X(dlnf32_work, cfg->tied ? N * C : 0, F)    \
    X(dlnf, es == 2 ? N * C : 0, S)

typedef struct layer_acts { LAYER_ACTS(FY_ACT_FIELD) } layer_acts;
typedef struct layer_work { LAYER_WORK(FY_ACT_FIELD) } layer_work;
typedef struct head_acts { HEAD_ACTS(FY_ACT_FIELD) HEAD_TRAIN(FY_ACT_FIELD) } head_acts;
typedef struct head_work { HEAD_WORK(FY_ACT_FIELD) } head_work;
#define HEAD_ALL(X) HEAD_ACTS(X) HEAD_TRAIN(X)

#define DIMS                                                                                \
    const size_t N = (size_t)B * T, Nc = N < (size_t)chunk ? N : (size_t)chunk,              \
                 C = (size_t)cfg->channels, NH = (size_t)cfg->heads,     \
                 hd = (size_t)cfg->head_dim, Q = NH * hd,                                   \
                 W = (NH + 2 * (size_t)cfg->kv_heads) * hd, Fn = (size_t)cfg->ffn,           \
                 Vp = (size_t)fy_lm_vocab_padded(cfg->vocab),                               \
                 es = fy_dtype_size(dt == FY_DTYPE_NONE ? FY_F32 : dt);                    \
    (void)N; (void)Nc; (void)C; (void)Q; (void)W; (void)Fn; (void)Vp; (void)es

#define SIZE_FN(name, LIST)                                                                 \
    static size_t name(const fy_llama_config *cfg, int B, int T, int chunk, fy_dtype dt) {  \
        DIMS; size_t total = 0; LIST(FY_ACT_SIZE) return total;                            \
    }
#define BIND_FN(name, type, LIST)                                                          \
    static void name(const fy_llama_config *cfg, int B, int T, int chunk, fy_dtype dt,      \
                     void *base, type *out) {                                              \
        DIMS; size_t off = 0; LIST(FY_ACT_BIND)                                            \
    }
SIZE_FN(layer_acts_nbytes, LAYER_ACTS)
SIZE_FN(layer_work_nbytes, LAYER_WORK)
SIZE_FN(layer_work_eval_nbytes, LAYER_WORK_EVAL)
SIZE_FN(head_acts_nbytes, HEAD_ACTS)
SIZE_FN(head_train_nbytes, HEAD_ALL)
SIZE_FN(head_work_nbytes, HEAD_WORK)
SIZE_FN(head_work_eval_nbytes, HEAD_WORK_EVAL)
BIND_FN(layer_acts_bind, layer_acts, LAYER_ACTS)
BIND_FN(layer_work_bind, layer_work, LAYER_WORK)
BIND_FN(head_acts_bind, head_acts, HEAD_ALL)
BIND_FN(head_work_bind, head_work, HEAD_WORK)

/* ---- the passes ---------------------------------------------------------------------- */

static fy_attn attn_of(const fy_llama_config *cfg, const int32_t *docs) {
    return (fy_attn){.window = cfg->sliding_window, .scale = 1.0f / sqrtf((float)cfg->head_dim),
                     .docs = docs};
}

/* x_out = x_in + attn(rmsnorm(x_in)); then + mlp(rmsnorm(.)), the attention's output
 * projection and the MLP by chunks of Nc rows. */
static void layer_fwd(const fy_llama_config *cfg, const layer_w *w, layer_acts *a,
                      layer_work *wk, const float *x_in, float *x_out, const int32_t *docs,
                      int B, int T, int Nc, fy_stream *s) {
    const int C = cfg->channels, NH = cfg->heads, NKV = cfg->kv_heads, hd = cfg->head_dim,
              F = cfg->ffn, N = B * T, W = (NH + 2 * NKV) * hd, Q = NH * hd;
    const size_t es = fy_dtype_size(fy_stream_dtype(s));
    const fy_attn at = attn_of(cfg, docs);
    fy_k_rmsnorm_fwd(a->ln1, a->rstd1, x_in, w->ln1, N, C, cfg->norm_eps, s);
    fy_k_matmul_fwd(a->qkv, a->ln1, w->wq, NULL, N, C, W, s); /* q, k, v packed */
    fy_k_rope(a->qkv, docs, B, T, NH, NKV, hd, false, &cfg->rope, s);
    fy_k_attention_fwd(a->atty, a->lse, a->qkv, B, T, NH, NKV, hd, &at, s);
    for (int r = 0; r < N; r += Nc) {
        const int n = N - r < Nc ? N - r : Nc;
        fy_k_matmul_fwd(wk->proj, fy_rows(a->atty, r, Q, es), w->wo, NULL, n, Q, C, s);
        fy_k_residual_fwd(fy_rows(a->res2, r, C, es), fy_rows(x_in, r, C, es), wk->proj,
                          (size_t)n * C, s);
    }
    fy_k_rmsnorm_fwd(a->ln2, a->rstd2, a->res2, w->ln2, N, C, cfg->norm_eps, s);
    fy_k_matmul_fwd(a->gu, a->ln2, w->wgate, NULL, N, C, 2 * F, s); /* gate, up packed */
    for (int r = 0; r < N; r += Nc) {
        const int n = N - r < Nc ? N - r : Nc;
        fy_k_swiglu_fwd(wk->act, fy_rows(a->gu, r, 2 * (size_t)F, es), n, F, s);
        fy_k_matmul_fwd(wk->proj, wk->act, w->wdown, NULL, n, F, C, s);
        fy_k_residual_fwd(fy_rows(x_out, r, C, es), fy_rows(a->res2, r, C, es), wk->proj,
                          (size_t)n * C, s);
    }
}

/* dx holds d x_out on entry and d x_in on return (the norms' backwards add into it). The
 * MLP and the norms by chunks of Nc rows, last chunk first (the reverse of the forward). */
static void layer_bwd(const fy_llama_config *cfg, const layer_w *w, layer_w *g,
                      const layer_acts *a, layer_work *wk, const float *x_in, float *dx,
                      const int32_t *docs, int B, int T, int Nc, fy_stream *s) {
    const int C = cfg->channels, NH = cfg->heads, NKV = cfg->kv_heads, hd = cfg->head_dim,
              F = cfg->ffn, N = B * T, W = (NH + 2 * NKV) * hd, Q = NH * hd;
    const size_t es = fy_dtype_size(fy_stream_dtype(s));
    const fy_attn at = attn_of(cfg, docs);
    for (int r = (N - 1) / Nc * Nc; r >= 0; r -= Nc) {
        const int n = N - r < Nc ? N - r : Nc;
        const float *gu = fy_rows(a->gu, r, 2 * (size_t)F, es);
        float *dxr = fy_rows(dx, r, C, es);
        fy_k_swiglu_fwd(wk->act, gu, n, F, s); /* rebuilt, not kept */
        fy_k_matmul_bwd(wk->dact, g->wdown, NULL, dxr, wk->act, w->wdown, n, F, C, s);
        fy_k_swiglu_bwd(wk->dgu, gu, wk->dact, n, F, s);
        fy_k_matmul_bwd(wk->dln, g->wgate, NULL, wk->dgu, fy_rows(a->ln2, r, C, es), w->wgate, n,
                        C, 2 * F, s);
        fy_k_rmsnorm_bwd(dxr, g->ln2, wk->dln, fy_rows(a->res2, r, C, es), w->ln2, a->rstd2 + r,
                         n, C, s);
    }
    fy_k_matmul_bwd(wk->datty, g->wo, NULL, dx, a->atty, w->wo, N, Q, C, s);
    fy_k_attention_bwd(wk->dqkv, wk->delta, wk->datty, a->qkv, a->atty, a->lse, B, T, NH, NKV,
                       hd, &at, s);
    fy_k_rope(wk->dqkv, docs, B, T, NH, NKV, hd, true, &cfg->rope, s);
    for (int r = (N - 1) / Nc * Nc; r >= 0; r -= Nc) {
        const int n = N - r < Nc ? N - r : Nc;
        fy_k_matmul_bwd(wk->dln, g->wq, NULL, fy_rows(wk->dqkv, r, W, es),
                        fy_rows(a->ln1, r, C, es), w->wq, n, C, W, s);
        fy_k_rmsnorm_bwd(fy_rows(dx, r, C, es), g->ln1, wk->dln, fy_rows(x_in, r, C, es), w->ln1,
                         a->rstd1 + r, n, C, s);
    }
}

/* ---- the model interface ------------------------------------------------------------- */

typedef struct llama { fy_llama_config cfg; } llama;

const fy_llama_config *fy_llama_config_of(const fy_model *m) {
    FY_ASSERT(!strcmp(fy_model_family(m), "llama"), "not a Llama model");
    return &((const llama *)m->ctx)->cfg;
}

static void describe(const fy_model *m, char *buf, size_t cap) {
    const fy_llama_config *c = fy_llama_config_of(m);
    const fy_rope *r = &c->rope;
    char rope[160], window[32] = "";
    if (r->type == FY_ROPE_LLAMA3)
        snprintf(rope, sizeof rope, "rope %g llama3 (factor %g, low %g, high %g, original %g)",
                 r->theta, r->factor, r->low_freq_factor, r->high_freq_factor, r->orig_max_pos);
    else if (r->type == FY_ROPE_LINEAR)
        snprintf(rope, sizeof rope, "rope %g linear (factor %g)", r->theta, r->factor);
    else
        snprintf(rope, sizeof rope, "rope %g", r->theta);
    if (c->sliding_window) snprintf(window, sizeof window, ", window %d", c->sliding_window);
    snprintf(buf, cap, "vocab %d, positions %d, channels %d, layers %d, heads %d, kv heads %d, "
             "head dim %d, ffn %d, eps %g, %s, %s%s", c->vocab, c->max_seq, c->channels,
             c->layers, c->heads, c->kv_heads, c->head_dim, c->ffn, c->norm_eps, rope,
             c->tied ? "tied" : "untied", window);
}

static fy_status check_seq(const fy_model *m, int64_t T) {
    const fy_llama_config *c = fy_llama_config_of(m);
    if (T > c->max_seq) {
        fy_log_error("--seq %lld is longer than the model's %d positions", (long long)T,
                     c->max_seq);
        return FY_ERR_INVALID;
    }
    return FY_OK;
}

static void acts(const fy_model *m, int b, int B, int T, fy_dtype dt, bool training,
                 fy_act_sizes *out) {
    const fy_llama_config *cfg = fy_llama_config_of(m);
    const size_t NC = fy_round_up((size_t)B * T * cfg->channels * fy_dtype_size(dt), 64);
    switch (m->blocks[b].kind) {
    case FY_BLOCK_EMBED: out->out = NC; break;
    case FY_BLOCK_LAYER:
        out->out = NC;
        out->saved = layer_acts_nbytes(cfg, B, T, m->chunk, dt);
        out->work = training ? layer_work_nbytes(cfg, B, T, m->chunk, dt)
                             : layer_work_eval_nbytes(cfg, B, T, m->chunk, dt);
        break;
    case FY_BLOCK_HEAD:
        out->saved = training ? head_train_nbytes(cfg, B, T, m->chunk, dt)
                              : head_acts_nbytes(cfg, B, T, m->chunk, dt);
        out->work = training ? head_work_nbytes(cfg, B, T, m->chunk, dt)
                             : head_work_eval_nbytes(cfg, B, T, m->chunk, dt);
        break;
    default: break;
    }
}

static void forward(const fy_model *m, int b, const fy_block_io *io, fy_stream *s) {
    const fy_llama_config *cfg = fy_llama_config_of(m);
    const fy_block_spec *blk = &m->blocks[b];
    const fy_dtype dt = fy_stream_dtype(s);
    if (blk->kind == FY_BLOCK_EMBED) {
        fy_k_encoder_fwd(io->out, io->tokens, io->params, NULL, NULL, io->B, io->T, cfg->channels,
                         io->table_rows ? io->table_rows : cfg->vocab, s);
        return;
    }
    layer_w w;
    layer_acts a;
    layer_work wk;
    fy_model_view(blk, dt, io->params, (float **)&w, sizeof w / sizeof(float *));
    layer_acts_bind(cfg, io->B, io->T, m->chunk, dt, io->saved, &a);
    layer_work_bind(cfg, io->B, io->T, m->chunk, dt, io->work, &wk);
    layer_fwd(cfg, &w, &a, &wk, io->in, io->out, io->docs, io->B, io->T, m->chunk, s);
}

static void backward(const fy_model *m, int b, const fy_block_io *io, fy_stream *s) {
    const fy_llama_config *cfg = fy_llama_config_of(m);
    const fy_block_spec *blk = &m->blocks[b];
    const fy_dtype dt = fy_stream_dtype(s);
    if (blk->kind == FY_BLOCK_EMBED) {
        fy_k_encoder_bwd(io->grads, NULL, io->dx, io->tokens, NULL, io->B, io->T, cfg->channels,
                         io->table_rows ? io->table_rows : cfg->vocab, s);
        return;
    }
    layer_w w, g;
    layer_acts a;
    layer_work wk;
    fy_model_view(blk, dt, io->params, (float **)&w, sizeof w / sizeof(float *));
    fy_model_view(blk, dt, io->grads, (float **)&g, sizeof g / sizeof(float *));
    layer_acts_bind(cfg, io->B, io->T, m->chunk, dt, io->saved, &a);
    layer_work_bind(cfg, io->B, io->T, m->chunk, dt, io->work, &wk);
    layer_bwd(cfg, &w, &g, &a, &wk, io->in, io->dx, io->docs, io->B, io->T, m->chunk, s);
}

/* The head: the final norm, then the classifier: lm_head, or the embedding (link 0)
 * when tied; the whole pass, or one chunk of an untied lm_head (model.h's order). */
static void loss(const fy_model *m, int b, const fy_block_io *io, fy_stream *s) {
    const fy_llama_config *cfg = fy_llama_config_of(m);
    const fy_block_spec *blk = &m->blocks[b];
    const fy_dtype dt = fy_stream_dtype(s);
    const int C = cfg->channels, N = io->B * io->T;
    const fy_lm_chunks ch = fy_llama_chunks(cfg, (size_t)N, fy_dtype_size(dt));
    head_w w = {0}, g = {0};
    head_acts a;
    head_work wk = {0};
    if (io->chunked) {
        fy_model_chunk_view(blk, dt, io->params, ch.rows, (float **)&w, blk->ntensors);
        fy_model_chunk_view(blk, dt, io->grads, ch.rows, (float **)&g, blk->ntensors);
    } else {
        fy_model_view(blk, dt, io->params, (float **)&w, blk->ntensors);
        fy_model_view(blk, dt, io->grads, (float **)&g, blk->ntensors);
    }
    head_acts_bind(cfg, io->B, io->T, m->chunk, dt, io->saved, &a);
    head_work_bind(cfg, io->B, io->T, m->chunk, dt, io->work, &wk);
    if (io->dloss == 0.0f) { /* evaluation's areas end before these */
        a.dlnf32 = NULL;
        wk.dlnf32_work = wk.dlnf = NULL;
    }
    const fy_lm_head_io lio = {
        .N = N, .C = C, .V = cfg->vocab, .chunks = ch, .xn = a.lnf, .logits = wk.logits,
        .max = a.lse_max, .sum = (double *)a.lse_sum, .tlogit = a.tlogit, .losses = a.losses,
        .targets = io->targets, .dloss = io->dloss, .dxn32 = a.dlnf32 ? a.dlnf32 : wk.dlnf32_work,
        .dxn = wk.dlnf};
    const bool first = !io->chunked || (io->chunk == 0 && !io->chunk_bwd);
    if (first) fy_k_rmsnorm_fwd(a.lnf, a.rstdf, io->in, w.norm, N, C, cfg->norm_eps, s);
    if (!io->chunked) {
        fy_lm_head(&lio, cfg->tied ? io->link_params[0] : w.lm_head,
                   cfg->tied ? io->link_grads[0] : g.lm_head, s);
    } else if (!io->chunk_bwd) {
        fy_lm_head_fwd_chunk(&lio, io->chunk, w.lm_head, s);
        if (io->chunk < ch.n - 1) return;
        if (io->dloss != 0.0f) fy_lm_head_bwd_chunk(&lio, io->chunk, w.lm_head, g.lm_head, true, s);
    } else {
        fy_lm_head_bwd_chunk(&lio, io->chunk, w.lm_head, g.lm_head, false, s);
    }
    if (!io->chunked || (!io->chunk_bwd && io->chunk == ch.n - 1)) fy_k_mean(io->loss, a.losses, (size_t)N, s);
    if (io->dloss == 0.0f || (io->chunked && io->chunk > 0)) return;
    fy_memset_async(s, io->dx, 0, (size_t)N * C * fy_dtype_size(dt));
    fy_k_rmsnorm_bwd(io->dx, g.norm, wk.dlnf ? wk.dlnf : lio.dxn32, io->in, w.norm, a.rstdf, N, C, s);
}

static fy_lm_chunks head_chunks(const fy_model *m, int B, int T, fy_dtype dt) {
    return fy_llama_chunks(fy_llama_config_of(m), (size_t)B * T, fy_dtype_size(dt));
}

/* Weights N(0, 0.02) (Hugging Face's initializer_range), norm gains 1. */
static void init_block(const fy_model *m, int b, uint64_t seed, float *host) {
    const fy_block_spec *blk = fy_model_block(m, b);
    for (int i = 0; i < blk->ntensors; i++) {
        const fy_tensor_spec *t = &blk->tensors[i];
        float *p = host + t->offset;
        size_t n = (size_t)t->rows * t->cols;
        if (t->cols == 1) {
            for (size_t j = 0; j < n; j++) p[j] = 1.0f;
            continue;
        }
        fy_model_fill_normal(p, n, 0.02, seed, b, i);
    }
}

/* As GPT-2's (gpt2.c): a layer's forward is 2*N*P for its weights plus 4*B*NH*hd per
 * attended (query, key) pair (windowed: fewer) and moves its parameters once and its saved
 * activations about twice; backward twice the weights' FLOPs and 3.5 times the
 * attention's (as GPT-2's), six passes over the parameters and twice the traffic; the
 * head's classifier 6*N*C*V FLOPs over 4 passes of the logits. */
static void cost(const fy_model *m, int b, fy_pass pass, int B, int T, double es, fy_cost *out) {
    const fy_llama_config *cfg = fy_llama_config_of(m);
    const fy_block_spec *blk = &m->blocks[b];
    const double N = (double)B * T, C = cfg->channels, V = cfg->vocab, P = (double)blk->nelem;
    const double att = 4.0 * B * cfg->heads * cfg->head_dim * fy_attn_pairs(T, cfg->sliding_window);
    const double fwd_flops = 2.0 * N * P + att;
    const double acts_bytes = (double)layer_acts_nbytes(cfg, B, T, m->chunk, es <= 2.0 ? FY_BF16 : FY_F32);
    if (blk->kind == FY_BLOCK_EMBED) {
        out->bytes = 3.0 * N * C * es;
    } else if (blk->kind == FY_BLOCK_HEAD) {
        out->flops = 6.0 * N * C * V;
        out->bytes = 4.0 * N * V * es;
    } else if (pass == FY_PASS_BWD) {
        out->flops = 2.0 * (fwd_flops - att) + 3.5 * att;
        out->bytes = 6.0 * es * P + 4.0 * acts_bytes;
    } else {
        out->flops = fwd_flops;
        out->bytes = es * P + 2.0 * acts_bytes;
    }
}

/* Buffers some checkpoints hold besides the parameters. */
static bool ignored(const fy_model *m, const char *name) {
    (void)m;
    return fy_str_ends_with(name, "rotary_emb.inv_freq");
}

/* A tied model's stored lm_head is the embedding (transformers ties it the same way). */
static const char *tied_to(const fy_model *m, const char *name) {
    return fy_llama_config_of(m)->tied && !strcmp(name, "lm_head.weight") ? "model.embed_tokens.weight" : NULL;
}

static void llama_free(void *ctx) { free(ctx); }

static const fy_model_iface llama_iface = {
    .family = "llama",
    .free = llama_free,
    .describe = describe,
    .check_seq = check_seq,
    .acts = acts,
    .forward = forward,
    .backward = backward,
    .loss = loss,
    .head_chunks = head_chunks,
    .init_block = init_block,
    .cost = cost,
    .dir_prefix = "",
    .ignored = ignored,
    .tied_to = tied_to,
    .untie_hint = "an untied head needs tie_word_embeddings false in config.json",
    .hf_config = fy_llama_hf_config,
};

fy_status fy_llama_new(const fy_llama_config *cfg, const char *name, fy_model **out) {
    *out = NULL;
    FY_TRY(fy_llama_config_check(cfg));
    const int V = cfg->vocab, C = cfg->channels, L = cfg->layers, NH = cfg->heads,
              NKV = cfg->kv_heads, hd = cfg->head_dim, F = cfg->ffn;
    llama *ctx = malloc(sizeof *ctx);
    fy_block_spec *blocks = calloc((size_t)L + 2, sizeof *blocks);
    if (!ctx || !blocks) { free(ctx); free(blocks); return FY_ERR_NOMEM; }
    ctx->cfg = *cfg;
    fy_block_spec *blk = &blocks[0];
    blk->kind = FY_BLOCK_EMBED;
    fy_model_add_tensor(blk, "model.embed_tokens.weight", V, C, true, false);
    blk->tensors[0].alloc_rows = fy_lm_vocab_padded(V);
    blk->gather = !cfg->tied; /* tied, the head reads the whole table anyway */
    blk->rows_fwd = true;      /* its forward reads the tokens' rows, tied or not */
    char tname[64];
#define ADD(field, hf, rows, cols, decay, packed)                                  \
    snprintf(tname, sizeof tname, "model.layers.%d.%s", l, hf);                    \
    fy_model_add_tensor(blk, tname, rows, cols, decay, false);                     \
    if (packed) fy_model_pack_last(blk);
    for (int l = 0; l < L; l++) {
        blk = &blocks[1 + l];
        blk->kind = FY_BLOCK_LAYER;
        blk->layer = l;
        LAYER_PARAMS(ADD)
    }
#undef ADD
    blk = &blocks[L + 1];
    blk->kind = FY_BLOCK_HEAD;
    fy_model_add_tensor(blk, "model.norm.weight", C, 1, false, false);
    if (cfg->tied) {
        blk->nlinks = 1;
        blk->links[0] = 0;
    } else {
        fy_model_add_tensor(blk, "lm_head.weight", V, C, true, false);
        blk->tensors[1].alloc_rows = fy_lm_vocab_padded(V);
        blk->vocab_chunks = true;
    }
    for (int b = 0; b < L + 2; b++) fy_model_place_tensors(&blocks[b]);
    FY_TRY(fy_model_create(&llama_iface, ctx, name, blocks, L + 2, V, fy_llama_num_params(cfg),
                           out));
    (*out)->head_dim = hd;
    return FY_OK;
}

fy_status fy_llama_named(const char *name, const fy_model_shape *over, fy_model **out) {
    *out = NULL;
    fy_llama_config cfg;
    FY_TRY(fy_llama_config_named(name, &cfg));
    const fy_llama_config base = cfg;
    if (over->vocab > 0) cfg.vocab = over->vocab;
    if (over->max_seq > 0) cfg.max_seq = over->max_seq;
    if (over->layers > 0) cfg.layers = over->layers;
    if (over->kv_heads > 0) cfg.kv_heads = over->kv_heads;
    if (over->ffn > 0) cfg.ffn = over->ffn;
    if (over->channels > 0 || over->heads > 0) { /* the heads split the channels anew */
        if (over->channels > 0) cfg.channels = over->channels;
        if (over->heads > 0) cfg.heads = over->heads;
        if (cfg.channels % cfg.heads) {
            fy_log_error("heads (%d) must divide channels (%d)", cfg.heads, cfg.channels);
            return FY_ERR_INVALID;
        }
        cfg.head_dim = cfg.channels / cfg.heads;
    }
    bool same = !memcmp(&cfg, &base, sizeof cfg);
    return fy_llama_new(&cfg, same ? name : NULL, out);
}
