/* llama.c — the Llama family: named configs, the block specs, initialisation, activation
 * sizes, costs, and the per-block passes as straight sequences of kernel launches (the
 * config.json side is llama_io.c). */
#include "engine/model/llama.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/crc32c.h"
#include "engine/core/util.h"
#include "engine/device/kernels.h"
#include "engine/model/lm_head.h"
#include "engine/model/model_impl.h"

#define ROPE(th) {.type = FY_ROPE_DEFAULT, .theta = th}
#define ROPE_L3(f) {.type = FY_ROPE_LLAMA3, .theta = 500000.0f, .factor = f, .low_freq_factor = 1.0f, \
                    .high_freq_factor = 4.0f, .orig_max_pos = 8192.0f}
#define ROPE_LIN(th, f) {.type = FY_ROPE_LINEAR, .theta = th, .factor = f}
/* A Llama of shape V, maxT, C, L, NH, NKV, hd, F, eps; the switches follow it. */
#define SHAPE(V, T, C, L, NH, NKV, hd, F, eps) \
    .vocab = V, .max_seq = T, .channels = C, .layers = L, .heads = NH, .kv_heads = NKV, \
    .head_dim = hd, .ffn = F, .norm_eps = eps
#define QWEN2 .arch = FY_ARCH_QWEN2, .qkv_bias = true, .rope = ROPE(1000000.0f)
#define QWEN3 .arch = FY_ARCH_QWEN3, .qk_norm = true, .rope = ROPE(1000000.0f)
#define GEMMA .sandwich = true, .norm_offset = 1.0f, .act = FY_GLU_GELU_TANH, \
              .embed_scale = true, .tied = true
#define GEMMA2(qs, w) .arch = FY_ARCH_GEMMA2, GEMMA, .rope = ROPE(10000.0f), .rope_local = ROPE(10000.0f), \
                      .sliding_window = w, .local_pattern = 2, .query_scalar = qs, \
                   .attn_softcap = 50.0f, .final_softcap = 30.0f
#define GEMMA3(qs, w) .arch = FY_ARCH_GEMMA3, GEMMA, .qk_norm = true, .rope_local = ROPE(10000.0f), \
                      .sliding_window = w, .local_pattern = 6, .query_scalar = qs

/* The published shapes: Hugging Face's config.json of each (Llama 3 8B and 70B as 3.1,
 * whose rope scaling reaches 131072 positions; Qwen2.5 as the base models; Mistral 7B as
 * v0.1, with its window; Phi-3 mini as the 4k model). Their parameter counts are checked
 * against the published ones in tests/test_llama_model.c. phi4-mini rotates 96 of its 128
 * channels as published, but its longrope factors come only with its config.json (--init
 * DIR): the named shape rotates without them. */
/* width: a capacity table fills the model's width with as many layers as fit; not for the
 * widths under 1.5K channels, whose hundreds of thin layers are no model anyone trains
 * (and take the tuner long to search). */
static const struct { const char *name; bool width; fy_llama_config cfg; } named[] = {
    {"llama-tiny", false, {SHAPE(256, 1024, 128, 4, 4, 2, 32, 384, 1e-5f), .rope = ROPE(10000.0f)}},
    {"llama3.2-1b", true, {SHAPE(128256, 131072, 2048, 16, 32, 8, 64, 8192, 1e-5f), .rope = ROPE_L3(32.0f), .tied = true}},
    {"llama3.2-3b", true, {SHAPE(128256, 131072, 3072, 28, 24, 8, 128, 8192, 1e-5f), .rope = ROPE_L3(32.0f), .tied = true}},
    {"llama3-8b", true, {SHAPE(128256, 131072, 4096, 32, 32, 8, 128, 14336, 1e-5f), .rope = ROPE_L3(8.0f)}},
    {"llama2-7b", true, {SHAPE(32000, 4096, 4096, 32, 32, 32, 128, 11008, 1e-5f), .rope = ROPE(10000.0f)}},
    {"llama2-13b", true, {SHAPE(32000, 4096, 5120, 40, 40, 40, 128, 13824, 1e-5f), .rope = ROPE(10000.0f)}},
    {"llama3-70b", true, {SHAPE(128256, 131072, 8192, 80, 64, 8, 128, 28672, 1e-5f), .rope = ROPE_L3(8.0f)}},
    /* tiny shapes of each family, for tests */
    {"qwen2.5-tiny", false, {SHAPE(256, 1024, 128, 4, 4, 2, 32, 384, 1e-6f), QWEN2, .tied = true}},
    {"qwen3-tiny", false, {SHAPE(256, 1024, 128, 4, 4, 2, 48, 384, 1e-6f), QWEN3}},
    {"mistral-tiny", false, {SHAPE(256, 1024, 128, 4, 4, 2, 48, 384, 1e-5f), .arch = FY_ARCH_MISTRAL,
                             .rope = ROPE(10000.0f), .sliding_window = 64}},
    {"gemma2-tiny", false, {SHAPE(256, 1024, 128, 4, 4, 2, 32, 384, 1e-6f), GEMMA2(24.0f, 64)}},
    {"gemma3-tiny", false, {SHAPE(256, 1024, 128, 6, 4, 2, 32, 384, 1e-6f), GEMMA3(32.0f, 64),
                            .rope = ROPE_LIN(1000000.0f, 8.0f)}},
    {"phi3-tiny", false, {SHAPE(256, 1024, 128, 4, 4, 2, 32, 384, 1e-5f), .arch = FY_ARCH_PHI3,
                          .rope = {.type = FY_ROPE_DEFAULT, .theta = 10000.0f, .rot_dim = 24},
                          .sliding_window = 64}},
    {"qwen2.5-0.5b", false, {SHAPE(151936, 32768, 896, 24, 14, 2, 64, 4864, 1e-6f), QWEN2, .tied = true}},
    {"qwen2.5-7b", true, {SHAPE(152064, 131072, 3584, 28, 28, 4, 128, 18944, 1e-6f), QWEN2}},
    {"qwen2.5-14b", true, {SHAPE(152064, 131072, 5120, 48, 40, 8, 128, 13824, 1e-5f), QWEN2}},
    {"qwen2.5-32b", true, {SHAPE(152064, 131072, 5120, 64, 40, 8, 128, 27648, 1e-5f), QWEN2}},
    {"qwen3-0.6b", false, {SHAPE(151936, 40960, 1024, 28, 16, 8, 128, 3072, 1e-6f), QWEN3, .tied = true}},
    {"qwen3-8b", true, {SHAPE(151936, 40960, 4096, 36, 32, 8, 128, 12288, 1e-6f), QWEN3}},
    {"qwen3-14b", true, {SHAPE(151936, 40960, 5120, 40, 40, 8, 128, 17408, 1e-6f), QWEN3}},
    {"qwen3-32b", true, {SHAPE(151936, 40960, 5120, 64, 64, 8, 128, 25600, 1e-6f), QWEN3}},
    {"mistral-7b", true, {SHAPE(32000, 32768, 4096, 32, 32, 8, 128, 14336, 1e-5f), .arch = FY_ARCH_MISTRAL,
                          .rope = ROPE(10000.0f), .sliding_window = 4096}},
    {"mistral-nemo-12b", true, {SHAPE(131072, 1024000, 5120, 40, 32, 8, 128, 14336, 1e-5f),
                                .arch = FY_ARCH_MISTRAL, .rope = ROPE(1000000.0f)}},
    {"gemma2-2b", true, {SHAPE(256000, 8192, 2304, 26, 8, 4, 256, 9216, 1e-6f), GEMMA2(256.0f, 4096)}},
    {"gemma2-9b", true, {SHAPE(256000, 8192, 3584, 42, 16, 8, 256, 14336, 1e-6f), GEMMA2(256.0f, 4096)}},
    {"gemma2-27b", true, {SHAPE(256000, 8192, 4608, 46, 32, 16, 128, 36864, 1e-6f), GEMMA2(144.0f, 4096)}},
    {"gemma3-1b", false, {SHAPE(262144, 32768, 1152, 26, 4, 1, 256, 6912, 1e-6f), GEMMA3(256.0f, 512),
                         .rope = ROPE(1000000.0f)}},
    {"gemma3-4b", true, {SHAPE(262208, 131072, 2560, 34, 8, 4, 256, 10240, 1e-6f), GEMMA3(256.0f, 1024),
                         .rope = ROPE_LIN(1000000.0f, 8.0f)}},
    {"gemma3-12b", true, {SHAPE(262208, 131072, 3840, 48, 16, 8, 256, 15360, 1e-6f), GEMMA3(256.0f, 1024),
                          .rope = ROPE_LIN(1000000.0f, 8.0f)}},
    {"gemma3-27b", true, {SHAPE(262208, 131072, 5376, 62, 32, 16, 128, 21504, 1e-6f), GEMMA3(168.0f, 1024),
                          .rope = ROPE_LIN(1000000.0f, 8.0f)}},
    {"phi3-mini", true, {SHAPE(32064, 4096, 3072, 32, 32, 32, 96, 8192, 1e-5f), .arch = FY_ARCH_PHI3,
                         .rope = ROPE(10000.0f), .sliding_window = 2047}},
    {"phi4-mini", true, {SHAPE(200064, 131072, 3072, 32, 24, 8, 128, 8192, 1e-5f), .arch = FY_ARCH_PHI3,
                         .rope = {.type = FY_ROPE_DEFAULT, .theta = 10000.0f, .rot_dim = 96},
                         .sliding_window = 262144, .tied = true}},
};
#define NNAMED (int)(sizeof named / sizeof named[0])

fy_status fy_llama_config_named(const char *name, fy_llama_config *out) {
    for (int i = 0; i < NNAMED; i++)
        if (!strcmp(name, named[i].name)) { *out = named[i].cfg; return FY_OK; }
    return FY_ERR_UNSUPPORTED;
}

static const char *names_of(bool width_only) {
    static char all[1024], widths[1024];
    char *buf = width_only ? widths : all;
    if (!buf[0]) {
        size_t n = 0;
        for (int i = 0; i < NNAMED; i++)
            if (!width_only || named[i].width)
                n += (size_t)snprintf(buf + n, 1024 - n, "%s%s", n ? ", " : "", named[i].name);
    }
    return buf;
}

const char *fy_llama_config_names(void) { return names_of(false); }
const char *fy_llama_width_names(void) { return names_of(true); }

static const struct { const char *type, *cls; } arch_names[] = {
    [FY_ARCH_LLAMA] = {"llama", "LlamaForCausalLM"},
    [FY_ARCH_MISTRAL] = {"mistral", "MistralForCausalLM"},
    [FY_ARCH_QWEN2] = {"qwen2", "Qwen2ForCausalLM"},
    [FY_ARCH_QWEN3] = {"qwen3", "Qwen3ForCausalLM"},
    [FY_ARCH_GEMMA2] = {"gemma2", "Gemma2ForCausalLM"},
    [FY_ARCH_GEMMA3] = {"gemma3_text", "Gemma3ForCausalLM"},
    [FY_ARCH_PHI3] = {"phi3", "Phi3ForCausalLM"},
};

const char *fy_llama_arch_type(fy_llama_arch a) { return arch_names[a].type; }
const char *fy_llama_arch_class(fy_llama_arch a) { return arch_names[a].cls; }

int fy_llama_layer_window(const fy_llama_config *c, int l) {
    if (c->local_pattern > 0 && (l + 1) % c->local_pattern == 0) return 0;
    return c->sliding_window;
}

fy_rope fy_llama_layer_rope(const fy_llama_config *c, int l, int T) {
    fy_rope r = c->local_pattern > 0 && (l + 1) % c->local_pattern ? c->rope_local : c->rope;
    if (r.type == FY_ROPE_LONGROPE && (float)T > r.orig_max_pos) /* transformers' choice */
        memcpy(r.ext, c->rope_long, sizeof r.ext);
    return r;
}

/* A rotation's parameters; what names it in messages. */
static fy_status rope_check(const fy_rope *r, int hd, const float *long_factors, const char *what) {
    const bool scaled = r->type == FY_ROPE_LINEAR || r->type == FY_ROPE_LLAMA3;
    if (!(r->theta > 0.0f && r->theta <= 1e30f)) {
        fy_log_error("%s: rope_theta (%g) must be positive", what, r->theta);
        return FY_ERR_INVALID;
    }
    if (scaled && !(r->factor > 0.0f && r->factor <= 1e6f)) {
        fy_log_error("%s: implausible rope scaling factor (%g)", what, r->factor);
        return FY_ERR_INVALID;
    }
    if (r->type == FY_ROPE_LLAMA3 && !(r->low_freq_factor > 0.0f && r->high_freq_factor > r->low_freq_factor &&
                                       r->orig_max_pos > 0.0f && r->orig_max_pos <= (float)(1 << 30))) {
        fy_log_error("%s: llama3 rope scaling needs 0 < low_freq_factor (%g) < high_freq_factor "
                     "(%g) and original_max_position_embeddings > 0 (%g)", what,
                     r->low_freq_factor, r->high_freq_factor, r->orig_max_pos);
        return FY_ERR_INVALID;
    }
    if (r->rot_dim < 0 || r->rot_dim > hd || r->rot_dim % 2) {
        fy_log_error("%s: %d rotated channels of a %d-channel head (partial_rotary_factor): "
                     "must be even and at most the head's", what, r->rot_dim, hd);
        return FY_ERR_INVALID;
    }
    if (!(r->attn_factor >= 0.0f && r->attn_factor <= 1e3f)) {
        fy_log_error("%s: implausible rope attention_factor (%g)", what, r->attn_factor);
        return FY_ERR_INVALID;
    }
    if (r->type == FY_ROPE_LONGROPE) {
        const int pairs = (r->rot_dim ? r->rot_dim : hd) / 2;
        if (!(r->orig_max_pos > 0.0f) || pairs > FY_ROPE_MAX_PAIRS) {
            fy_log_error("%s: longrope needs original_max_position_embeddings > 0 and at most "
                         "%d rotated pairs (%d)", what, FY_ROPE_MAX_PAIRS, pairs);
            return FY_ERR_INVALID;
        }
        for (int j = 0; j < pairs; j++)
            if (!(r->ext[j] > 0.0f && r->ext[j] <= 1e6f) ||
                !(long_factors[j] > 0.0f && long_factors[j] <= 1e6f)) {
                fy_log_error("%s: longrope factor %d must be positive (short %g, long %g)", what,
                             j, r->ext[j], long_factors[j]);
                return FY_ERR_INVALID;
            }
    }
    return FY_OK;
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
    if (!(c->norm_eps > 0.0f)) {
        fy_log_error("rms_norm_eps (%g) must be positive", c->norm_eps);
        return FY_ERR_INVALID;
    }
    FY_TRY(rope_check(&c->rope, c->head_dim, c->rope_long, "the rope"));
    if (c->local_pattern > 0 && c->rope_local.theta != 0.0f) /* 0: the same as rope */
        FY_TRY(rope_check(&c->rope_local, c->head_dim, c->rope_long, "the local layers' rope"));
    if (c->sliding_window < 0 || c->local_pattern < 0) {
        fy_log_error("sliding window (%d) and its layer pattern (%d) must not be negative",
                     c->sliding_window, c->local_pattern);
        return FY_ERR_INVALID;
    }
    if ((unsigned)c->arch > FY_ARCH_PHI3 || (c->act != FY_GLU_SILU && c->act != FY_GLU_GELU_TANH)) {
        fy_log_error("unknown model arch (%d) or activation (%d)", (int)c->arch, (int)c->act);
        return FY_ERR_INVALID;
    }
    if (!(c->norm_offset >= 0.0f && c->norm_offset <= 1.0f) || !(c->query_scalar >= 0.0f && c->query_scalar <= 1e9f) ||
        !(c->attn_softcap >= 0.0f && c->attn_softcap <= 1e9f) ||
        !(c->final_softcap >= 0.0f && c->final_softcap <= 1e9f)) {
        fy_log_error("implausible norm offset (%g), query_pre_attn_scalar (%g) or soft-caps "
                     "(%g, %g)", c->norm_offset, c->query_scalar, c->attn_softcap, c->final_softcap);
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
    const size_t layer = 2 * C + C * (Q + 2 * KV) + Q * C + 3 * C * F +
                         (c->qkv_bias ? Q + 2 * KV : 0) + (c->qk_norm ? 2 * (size_t)c->head_dim : 0) +
                         (c->sandwich ? 2 * C : 0);
    return V * C + (size_t)c->layers * layer + C + (c->tied ? 0 : V * C);
}

/* ---- parameters, views, activations ---------------------------------------------------- */

/* X(field, present, hf_name, rows, cols, weight_decay, packed after the previous), with
 * cfg, C, Q = NH hd, KV = NKV hd, W = Q + 2 KV, hd, F and PHI in scope. Phi-3 publishes q, k
 * and v as one qkv_proj and gate and up as one gate_up_proj (the packed forms); Gemma's
 * post_attention_layernorm normalises the attention's output, Llama's the MLP's input. */
#define LAYER_PARAMS(X)                                                                       \
    X(ln1, 1, "input_layernorm.weight", C, 1, 0, 0)                                           \
    X(wq, 1, PHI ? "self_attn.qkv_proj.weight" : "self_attn.q_proj.weight", PHI ? W : Q, C, 1, 0) \
    X(wk, !PHI, "self_attn.k_proj.weight", KV, C, 1, 1)                                       \
    X(wv, !PHI, "self_attn.v_proj.weight", KV, C, 1, 1)                                       \
    X(bq, cfg->qkv_bias, "self_attn.q_proj.bias", Q, 1, 0, 0)                                 \
    X(bk, cfg->qkv_bias, "self_attn.k_proj.bias", KV, 1, 0, 1)                                \
    X(bv, cfg->qkv_bias, "self_attn.v_proj.bias", KV, 1, 0, 1)                                \
    X(qn, cfg->qk_norm, "self_attn.q_norm.weight", hd, 1, 0, 0)                               \
    X(kn, cfg->qk_norm, "self_attn.k_norm.weight", hd, 1, 0, 0)                               \
    X(wo, 1, "self_attn.o_proj.weight", C, Q, 1, 0)                                           \
    X(lnpa, cfg->sandwich, "post_attention_layernorm.weight", C, 1, 0, 0)                     \
    X(ln2, 1, cfg->sandwich ? "pre_feedforward_layernorm.weight" : "post_attention_layernorm.weight", \
      C, 1, 0, 0)                                                                             \
    X(wgate, 1, PHI ? "mlp.gate_up_proj.weight" : "mlp.gate_proj.weight", PHI ? 2 * F : F, C, 1, 0) \
    X(wup, !PHI, "mlp.up_proj.weight", F, C, 1, 1)                                            \
    X(wdown, 1, "mlp.down_proj.weight", C, F, 1, 0)                                           \
    X(lnpf, cfg->sandwich, "post_feedforward_layernorm.weight", C, 1, 0, 0)
#define PARAM_DIMS(cfg)                                                                         \
    const int C = (cfg)->channels, hd = (cfg)->head_dim, Q = (cfg)->heads * hd,                 \
              KV = (cfg)->kv_heads * hd, W = Q + 2 * KV, F = (cfg)->ffn;                        \
    const bool PHI = (cfg)->arch == FY_ARCH_PHI3;                                               \
    (void)C; (void)Q; (void)KV; (void)W; (void)F; (void)PHI
#define FIELD(field, ...) float *field;
typedef struct layer_w { LAYER_PARAMS(FIELD) } layer_w; /* absent tensors NULL */
typedef struct head_w { float *norm, *lm_head; } head_w; /* lm_head absent when tied */

/* A layer block's buffer (params or grads) as its tensors. */
static void layer_view(const fy_llama_config *cfg, const fy_block_spec *blk, fy_dtype dt,
                       const void *base, layer_w *w) {
    PARAM_DIMS(cfg);
    float *p[FY_MODEL_MAX_TENSORS];
    fy_model_view(blk, dt, base, p, blk->ntensors);
    int i = 0;
#define VIEW(field, present, ...) w->field = (present) ? p[i++] : NULL;
    LAYER_PARAMS(VIEW)
#undef VIEW
}

/* Whether a layer's MLP recomputes its gate and up projections (gu, N x 2F) in the
 * backward, chunk by chunk from the saved ln2 rows, rather than keeping them from the
 * forward: when the sequence is chunked (N > Nc), whose saved area gu would otherwise
 * dominate (7 GiB of Llama 3 8B's at 128K positions, in bf16), and which nothing else
 * bounds (a recomputed layer still holds its saved area whole). Within one chunk (N <=
 * Nc) gu is kept: it is at most a chunk's, layer checkpointing already trades compute for
 * memory at that scale, and recomputing would add a third to the MLP's backward FLOPs
 * (4 N C F of 12 N C F) for every short-sequence run. Forward and recomputation run the
 * same GEMM (the chunk's rows into the same workspace), so they compute the same bits on
 * any deterministic backend; the forward does not take gu from one GEMM over all N rows,
 * whose row blocks need not have a chunk's bits (OpenBLAS's do not). N, chunk: positions
 * of the micro-batch and of a chunk. */
static bool gu_recomputed(size_t N, size_t chunk) { return N > chunk; }

/* A layer's saved activations (qkv holds the normed and roped q and k; qkvr the
 * projections before the q/k norms; gu absent when recomputed) and workspace; eval needs
 * only the first three work fields (proj, act and a recomputed layer's gu), training all.
 * The position-wise work runs by sequence chunks of Nc rows (model.h: fy_model_chunk), so
 * its buffers hold a chunk; the attention's gradients (datty, dqkv) hold every row, as
 * attention needs them whole. */
#define LAYER_ACTS(X)                                        \
    X(ln1, N * C, S)                                         \
    X(rstd1, N, F)                                           \
    X(qkvr, cfg->qk_norm ? N * W : 0, S)                     \
    X(rstdqk, cfg->qk_norm ? N * (NH + NKV) : 0, F)          \
    X(qkv, N * W, S)                                         \
    X(lse, (size_t)B * NH * T, F)                            \
    X(atty, N * Q, S)                                        \
    X(po, cfg->sandwich ? N * C : 0, S)                      \
    X(rstdpa, cfg->sandwich ? N : 0, F)                      \
    X(res2, N * C, S)                                        \
    X(ln2, N * C, S)                                         \
    X(rstd2, N, F)                                           \
    X(gu, gu_recomputed(N, chunk) ? 0 : N * 2 * Fn, S)       \
    X(pd, cfg->sandwich ? N * C : 0, S)                      \
    X(rstdpf, cfg->sandwich ? N : 0, F)
#define LAYER_WORK_EVAL(X)               \
    X(proj, Nc * C, S)                   \
    X(act, Nc * Fn, S)                   \
    X(gu, gu_recomputed(N, chunk) ? Nc * 2 * Fn : 0, S)
#define LAYER_WORK(X)                    \
    LAYER_WORK_EVAL(X)                   \
    X(dln, Nc * C, S)                    \
    X(dpost, cfg->sandwich ? Nc * C : 0, S) \
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
                 C = (size_t)cfg->channels, NH = (size_t)cfg->heads,                        \
                 NKV = (size_t)cfg->kv_heads, hd = (size_t)cfg->head_dim, Q = NH * hd,      \
                 W = (NH + 2 * NKV) * hd, Fn = (size_t)cfg->ffn,                            \
                 Vp = (size_t)fy_lm_vocab_padded(cfg->vocab),                               \
                 es = fy_dtype_size(dt == FY_DTYPE_NONE ? FY_F32 : dt);                    \
    (void)N; (void)Nc; (void)C; (void)NKV; (void)Q; (void)W; (void)Fn; (void)Vp; (void)es

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

/* Layer l's attention: its window, the scores' scale and cap. */
static fy_attn attn_of(const fy_llama_config *cfg, int l, const int32_t *docs) {
    const double qs = cfg->query_scalar > 0.0f ? cfg->query_scalar : cfg->head_dim;
    return (fy_attn){.window = fy_llama_layer_window(cfg, l), .scale = (float)(1.0 / sqrt(qs)),
                     .softcap = cfg->attn_softcap, .docs = docs};
}

/* Gemma's embedding factor, sqrt(C) in the storage type as transformers rounds it. */
static float embed_scale(const fy_llama_config *cfg, fy_dtype dt) {
    if (!cfg->embed_scale) return 1.0f;
    const float v = (float)sqrt((double)cfg->channels);
    return dt == FY_BF16 ? fy_bf16_to_f32(fy_f32_to_bf16(v)) : v;
}

/* What a layer's passes need besides its buffers. */
typedef struct layer_ctx {
    const fy_llama_config *cfg;
    fy_attn at;
    fy_rope rope;
    const int32_t *docs;
    int B, T, Nc;
} layer_ctx;

/* The attention's or MLP's output rows [r, r+n), y (n,C), added to res into out; under
 * sandwich norms y is normalised first (into tmp, its rstd saved at rstd + r). */
static void add_output(const layer_ctx *c, float *out, const float *res, const float *y,
                       float *rstd, const float *gain, int r, int n, float *tmp, fy_stream *s) {
    const fy_llama_config *cfg = c->cfg;
    const int C = cfg->channels;
    const size_t es = fy_dtype_size(fy_stream_dtype(s));
    if (cfg->sandwich) {
        fy_k_rmsnorm_fwd(tmp, rstd + r, y, gain, n, C, cfg->norm_eps, cfg->norm_offset, s);
        y = tmp;
    }
    fy_k_residual_fwd(fy_rows(out, r, C, es), fy_rows(res, r, C, es), y, (size_t)n * C, s);
}

/* x_out = x_in + attn(rmsnorm(x_in)); then + mlp(rmsnorm(.)), the attention's output
 * projection and the MLP by chunks of Nc rows. */
static void layer_fwd(const layer_ctx *c, const layer_w *w, layer_acts *a, layer_work *wk,
                      const float *x_in, float *x_out, fy_stream *s) {
    const fy_llama_config *cfg = c->cfg;
    const int C = cfg->channels, NH = cfg->heads, NKV = cfg->kv_heads, hd = cfg->head_dim,
              F = cfg->ffn, N = c->B * c->T, W = (NH + 2 * NKV) * hd, Q = NH * hd, Nc = c->Nc;
    const size_t es = fy_dtype_size(fy_stream_dtype(s));
    const float eps = cfg->norm_eps, off = cfg->norm_offset;
    fy_k_rmsnorm_fwd(a->ln1, a->rstd1, x_in, w->ln1, N, C, eps, off, s);
    /* q, k, v packed (and their biases) */
    fy_k_matmul_fwd(cfg->qk_norm ? a->qkvr : a->qkv, a->ln1, w->wq, w->bq, N, C, W, s);
    if (cfg->qk_norm)
        fy_k_qk_norm_fwd(a->qkv, a->rstdqk, a->qkvr, w->qn, w->kn, N, NH, NKV, hd, eps, off, s);
    fy_k_rope(a->qkv, c->docs, c->B, c->T, NH, NKV, hd, false, &c->rope, s);
    fy_k_attention_fwd(a->atty, a->lse, a->qkv, c->B, c->T, NH, NKV, hd, &c->at, s);
    for (int r = 0; r < N; r += Nc) {
        const int n = N - r < Nc ? N - r : Nc;
        float *po = cfg->sandwich ? fy_rows(a->po, r, C, es) : wk->proj;
        fy_k_matmul_fwd(po, fy_rows(a->atty, r, Q, es), w->wo, NULL, n, Q, C, s);
        add_output(c, a->res2, x_in, po, a->rstdpa, w->lnpa, r, n, wk->proj, s);
    }
    fy_k_rmsnorm_fwd(a->ln2, a->rstd2, a->res2, w->ln2, N, C, eps, off, s);
    const bool regu = gu_recomputed((size_t)N, (size_t)Nc);
    for (int r = 0; r < N; r += Nc) {
        const int n = N - r < Nc ? N - r : Nc;
        float *pd = cfg->sandwich ? fy_rows(a->pd, r, C, es) : wk->proj;
        float *gu = regu ? wk->gu : fy_rows(a->gu, r, 2 * (size_t)F, es); /* gate, up packed */
        fy_k_matmul_fwd(gu, fy_rows(a->ln2, r, C, es), w->wgate, NULL, n, C, 2 * F, s);
        fy_k_glu_fwd(wk->act, gu, n, F, cfg->act, s);
        fy_k_matmul_fwd(pd, wk->act, w->wdown, NULL, n, F, C, s);
        add_output(c, x_out, a->res2, pd, a->rstdpf, w->lnpf, r, n, wk->proj, s);
    }
}

/* The gradient reaching an output's projection, rows [r, r+n): dx's rows, or, under
 * sandwich norms, their backward through the post-norm (into tmp). */
static const float *output_grad(const layer_ctx *c, const float *dxr, const float *post,
                                const float *rstd, const float *gain, float *dgain, int r,
                                int n, float *tmp, fy_stream *s) {
    const fy_llama_config *cfg = c->cfg;
    const int C = cfg->channels;
    if (!cfg->sandwich) return dxr;
    fy_memset_async(s, tmp, 0, (size_t)n * C * fy_dtype_size(fy_stream_dtype(s)));
    fy_k_rmsnorm_bwd(tmp, dgain, dxr, post, gain, rstd + r, n, C, cfg->norm_offset, s);
    return tmp;
}

/* dx holds d x_out on entry and d x_in on return (the norms' backwards add into it). The
 * MLP and the norms by chunks of Nc rows, last chunk first (the reverse of the forward),
 * each chunk's gu computed again first when not kept (gu_recomputed). */
static void layer_bwd(const layer_ctx *c, const layer_w *w, layer_w *g, const layer_acts *a,
                      layer_work *wk, const float *x_in, float *dx, fy_stream *s) {
    const fy_llama_config *cfg = c->cfg;
    const int C = cfg->channels, NH = cfg->heads, NKV = cfg->kv_heads, hd = cfg->head_dim,
              F = cfg->ffn, N = c->B * c->T, W = (NH + 2 * NKV) * hd, Q = NH * hd, Nc = c->Nc;
    const size_t es = fy_dtype_size(fy_stream_dtype(s));
    const float off = cfg->norm_offset;
    const bool regu = gu_recomputed((size_t)N, (size_t)Nc);
    for (int r = (N - 1) / Nc * Nc; r >= 0; r -= Nc) {
        const int n = N - r < Nc ? N - r : Nc;
        const float *ln2 = fy_rows(a->ln2, r, C, es);
        const float *gu = regu ? wk->gu : fy_rows(a->gu, r, 2 * (size_t)F, es);
        if (regu) fy_k_matmul_fwd(wk->gu, ln2, w->wgate, NULL, n, C, 2 * F, s); /* the forward's */
        float *dxr = fy_rows(dx, r, C, es);
        const float *dout = output_grad(c, dxr, cfg->sandwich ? fy_rows(a->pd, r, C, es) : NULL,
                                        a->rstdpf, w->lnpf, g->lnpf, r, n, wk->dpost, s);
        fy_k_glu_fwd(wk->act, gu, n, F, cfg->act, s); /* rebuilt, not kept */
        fy_k_matmul_bwd(wk->dact, g->wdown, NULL, dout, wk->act, w->wdown, n, F, C, s);
        fy_k_glu_bwd(wk->dgu, gu, wk->dact, n, F, cfg->act, s);
        fy_k_matmul_bwd(wk->dln, g->wgate, NULL, wk->dgu, ln2, w->wgate, n, C, 2 * F, s);
        fy_k_rmsnorm_bwd(dxr, g->ln2, wk->dln, fy_rows(a->res2, r, C, es), w->ln2, a->rstd2 + r,
                         n, C, off, s);
    }
    if (!cfg->sandwich) {
        fy_k_matmul_bwd(wk->datty, g->wo, NULL, dx, a->atty, w->wo, N, Q, C, s);
    } else {
        for (int r = (N - 1) / Nc * Nc; r >= 0; r -= Nc) {
            const int n = N - r < Nc ? N - r : Nc;
            const float *dout = output_grad(c, fy_rows(dx, r, C, es), fy_rows(a->po, r, C, es),
                                            a->rstdpa, w->lnpa, g->lnpa, r, n, wk->dpost, s);
            fy_k_matmul_bwd(fy_rows(wk->datty, r, Q, es), g->wo, NULL, dout,
                            fy_rows(a->atty, r, Q, es), w->wo, n, Q, C, s);
        }
    }
    fy_k_attention_bwd(wk->dqkv, wk->delta, wk->datty, a->qkv, a->atty, a->lse, c->B, c->T, NH,
                       NKV, hd, &c->at, s);
    fy_k_rope(wk->dqkv, c->docs, c->B, c->T, NH, NKV, hd, true, &c->rope, s);
    if (cfg->qk_norm) /* in place: dqkv becomes the projections' gradient */
        fy_k_qk_norm_bwd(wk->dqkv, g->qn, g->kn, wk->dqkv, a->qkvr, w->qn, w->kn, a->rstdqk, N,
                         NH, NKV, hd, off, s);
    for (int r = (N - 1) / Nc * Nc; r >= 0; r -= Nc) {
        const int n = N - r < Nc ? N - r : Nc;
        fy_k_matmul_bwd(wk->dln, g->wq, g->bq, fy_rows(wk->dqkv, r, W, es),
                        fy_rows(a->ln1, r, C, es), w->wq, n, C, W, s);
        fy_k_rmsnorm_bwd(fy_rows(dx, r, C, es), g->ln1, wk->dln, fy_rows(x_in, r, C, es), w->ln1,
                         a->rstd1 + r, n, C, off, s);
    }
}

/* ---- the model interface ------------------------------------------------------------- */

typedef struct llama { fy_llama_config cfg; } llama;

const fy_llama_config *fy_llama_config_of(const fy_model *m) {
    FY_ASSERT(!strcmp(fy_model_family(m), "llama"), "not a Llama model");
    return &((const llama *)m->ctx)->cfg;
}

/* A rotation in words; longrope's factor lists by their checksum (two models with other
 * factors must not describe alike: a checkpoint's model is its description). */
static int describe_rope(const fy_llama_config *c, const fy_rope *r, char *buf, size_t cap) {
    int n;
    if (r->type == FY_ROPE_LLAMA3)
        n = snprintf(buf, cap, "rope %g llama3 (factor %g, low %g, high %g, original %g)",
                     r->theta, r->factor, r->low_freq_factor, r->high_freq_factor, r->orig_max_pos);
    else if (r->type == FY_ROPE_LINEAR)
        n = snprintf(buf, cap, "rope %g linear (factor %g)", r->theta, r->factor);
    else if (r->type == FY_ROPE_LONGROPE)
        n = snprintf(buf, cap, "rope %g longrope (original %g, attention %g, factors %08x)",
                     r->theta, r->orig_max_pos, r->attn_factor,
                     fy_crc32c(c->rope_long, sizeof c->rope_long,
                               fy_crc32c(r->ext, sizeof r->ext, 0)));
    else
        n = snprintf(buf, cap, "rope %g", r->theta);
    if (r->rot_dim && n >= 0 && (size_t)n < cap)
        n += snprintf(buf + n, cap - (size_t)n, " on %d channels", r->rot_dim);
    return n;
}

static void describe(const fy_model *m, char *buf, size_t cap) {
    const fy_llama_config *c = fy_llama_config_of(m);
    char rope[224], local[240] = "", window[64] = "", sw[160] = "";
    describe_rope(c, &c->rope, rope, sizeof rope);
    if (c->local_pattern > 0) {
        char lr[200];
        describe_rope(c, &c->rope_local, lr, sizeof lr);
        snprintf(local, sizeof local, ", local layers %s", lr);
    }
    if (c->sliding_window) {
        if (c->local_pattern > 0)
            snprintf(window, sizeof window, ", window %d on %d of %d layers", c->sliding_window,
                     c->local_pattern - 1, c->local_pattern);
        else
            snprintf(window, sizeof window, ", window %d", c->sliding_window);
    }
    snprintf(sw, sizeof sw, "%s%s%s%s%s", c->qkv_bias ? ", qkv biases" : "",
             c->qk_norm ? ", q/k norms" : "", c->sandwich ? ", sandwich norms" : "",
             c->act == FY_GLU_GELU_TANH ? ", GeGLU" : "", c->embed_scale ? ", scaled embedding" : "");
    /* Llama's and Mistral's words as before the other families (checkpoints compare them) */
    char arch[32] = "";
    if (c->arch != FY_ARCH_LLAMA && c->arch != FY_ARCH_MISTRAL)
        snprintf(arch, sizeof arch, "%s: ", fy_llama_arch_type(c->arch));
    size_t n = (size_t)snprintf(buf, cap, "%svocab %d, positions %d, channels %d, layers %d, "
             "heads %d, kv heads %d, head dim %d, ffn %d, eps %g, %s%s, %s%s%s",
             arch, c->vocab, c->max_seq, c->channels, c->layers, c->heads,
             c->kv_heads, c->head_dim, c->ffn, c->norm_eps, rope, local,
             c->tied ? "tied" : "untied", window, sw);
    if (n < cap && c->query_scalar > 0.0f)
        n += (size_t)snprintf(buf + n, cap - n, ", query scalar %g", c->query_scalar);
    if (n < cap && (c->attn_softcap > 0.0f || c->final_softcap > 0.0f))
        snprintf(buf + n, cap - n, ", soft-caps %g (scores), %g (logits)", c->attn_softcap,
                 c->final_softcap);
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

static layer_ctx layer_ctx_of(const fy_model *m, int l, const fy_block_io *io) {
    const fy_llama_config *cfg = fy_llama_config_of(m);
    return (layer_ctx){.cfg = cfg, .at = attn_of(cfg, l, io->docs),
                       .rope = fy_llama_layer_rope(cfg, l, io->T), .docs = io->docs, .B = io->B,
                       .T = io->T, .Nc = m->chunk};
}

static void forward(const fy_model *m, int b, const fy_block_io *io, fy_stream *s) {
    const fy_llama_config *cfg = fy_llama_config_of(m);
    const fy_block_spec *blk = &m->blocks[b];
    const fy_dtype dt = fy_stream_dtype(s);
    if (blk->kind == FY_BLOCK_EMBED) {
        fy_k_encoder_fwd(io->out, io->tokens, io->params, NULL, NULL, io->B, io->T, cfg->channels,
                         io->table_rows ? io->table_rows : cfg->vocab, embed_scale(cfg, dt), s);
        return;
    }
    layer_w w;
    layer_acts a;
    layer_work wk;
    layer_view(cfg, blk, dt, io->params, &w);
    layer_acts_bind(cfg, io->B, io->T, m->chunk, dt, io->saved, &a);
    layer_work_bind(cfg, io->B, io->T, m->chunk, dt, io->work, &wk);
    const layer_ctx c = layer_ctx_of(m, blk->layer, io);
    layer_fwd(&c, &w, &a, &wk, io->in, io->out, s);
}

static void backward(const fy_model *m, int b, const fy_block_io *io, fy_stream *s) {
    const fy_llama_config *cfg = fy_llama_config_of(m);
    const fy_block_spec *blk = &m->blocks[b];
    const fy_dtype dt = fy_stream_dtype(s);
    if (blk->kind == FY_BLOCK_EMBED) {
        fy_k_encoder_bwd(io->grads, NULL, io->dx, io->tokens, NULL, io->B, io->T, cfg->channels,
                         io->table_rows ? io->table_rows : cfg->vocab, embed_scale(cfg, dt), s);
        return;
    }
    layer_w w, g;
    layer_acts a;
    layer_work wk;
    layer_view(cfg, blk, dt, io->params, &w);
    layer_view(cfg, blk, dt, io->grads, &g);
    layer_acts_bind(cfg, io->B, io->T, m->chunk, dt, io->saved, &a);
    layer_work_bind(cfg, io->B, io->T, m->chunk, dt, io->work, &wk);
    const layer_ctx c = layer_ctx_of(m, blk->layer, io);
    layer_bwd(&c, &w, &g, &a, &wk, io->in, io->dx, s);
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
        .dxn = wk.dlnf, .softcap = cfg->final_softcap};
    const bool first = !io->chunked || (io->chunk == 0 && !io->chunk_bwd);
    if (first) fy_k_rmsnorm_fwd(a.lnf, a.rstdf, io->in, w.norm, N, C, cfg->norm_eps, cfg->norm_offset, s);
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
    if (!io->chunked || (!io->chunk_bwd && io->chunk == ch.n - 1)) fy_k_mean(io->loss, a.losses, (size_t)N, fy_block_loss_div(io), s);
    if (io->dloss == 0.0f || (io->chunked && io->chunk > 0)) return;
    fy_memset_async(s, io->dx, 0, (size_t)N * C * fy_dtype_size(dt));
    fy_k_rmsnorm_bwd(io->dx, g.norm, wk.dlnf ? wk.dlnf : lio.dxn32, io->in, w.norm, a.rstdf, N, C,
                     cfg->norm_offset, s);
}

static fy_lm_chunks head_chunks(const fy_model *m, int B, int T, fy_dtype dt) {
    return fy_llama_chunks(fy_llama_config_of(m), (size_t)B * T, fy_dtype_size(dt));
}

/* Weights N(0, 0.02) (Hugging Face's initializer_range), biases 0, norm gains 1 (Gemma's
 * w of 1 + w: 0). */
static void init_block(const fy_model *m, int b, uint64_t seed, float *host) {
    const fy_block_spec *blk = fy_model_block(m, b);
    const float gain = 1.0f - fy_llama_config_of(m)->norm_offset;
    for (int i = 0; i < blk->ntensors; i++) {
        const fy_tensor_spec *t = &blk->tensors[i];
        float *p = host + t->offset;
        size_t n = (size_t)t->rows * t->cols;
        if (t->cols == 1) {
            const float v = fy_str_ends_with(t->name, ".bias") ? 0.0f : gain;
            for (size_t j = 0; j < n; j++) p[j] = v;
            continue;
        }
        fy_model_fill_normal(p, n, 0.02, seed, b, i);
    }
}

/* As GPT-2's (gpt2.c): a layer's forward is 2*N*P for its weights plus 4*B*NH*hd per
 * attended (query, key) pair (windowed: fewer) and moves its parameters once and its saved
 * activations about twice; backward twice the weights' FLOPs and 3.5 times the
 * attention's (as GPT-2's), six passes over the parameters and twice the traffic; the
 * head's classifier 6*N*C*V FLOPs over 4 passes of the logits. A recomputed gu
 * (gu_recomputed) adds its GEMM, 4*N*C*F, to the backward, and its rows still count as
 * activations moved (written and read as when kept). */
static void cost(const fy_model *m, int b, fy_pass pass, int B, int T, double es, fy_cost *out) {
    const fy_llama_config *cfg = fy_llama_config_of(m);
    const fy_block_spec *blk = &m->blocks[b];
    const double N = (double)B * T, C = cfg->channels, V = cfg->vocab, P = (double)blk->nelem;
    const int window = blk->kind == FY_BLOCK_LAYER ? fy_llama_layer_window(cfg, blk->layer) : 0;
    const double att = 4.0 * B * cfg->heads * cfg->head_dim * fy_attn_pairs(T, window);
    const double fwd_flops = 2.0 * N * P + att;
    const bool regu = gu_recomputed((size_t)N, (size_t)m->chunk);
    const double gu_flops = regu ? 4.0 * N * C * cfg->ffn : 0.0;
    const double acts_bytes = (double)layer_acts_nbytes(cfg, B, T, m->chunk, es <= 2.0 ? FY_BF16 : FY_F32) +
                              (regu ? N * 2.0 * cfg->ffn * es : 0.0);
    if (blk->kind == FY_BLOCK_EMBED) {
        out->bytes = 3.0 * N * C * es;
    } else if (blk->kind == FY_BLOCK_HEAD) {
        out->flops = 6.0 * N * C * V;
        out->bytes = 4.0 * N * V * es;
    } else if (pass == FY_PASS_BWD) {
        out->flops = 2.0 * (fwd_flops - att) + 3.5 * att + gu_flops;
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
    const int V = cfg->vocab, L = cfg->layers;
    PARAM_DIMS(cfg);
    llama *ctx = malloc(sizeof *ctx);
    fy_block_spec *blocks = calloc((size_t)L + 2, sizeof *blocks);
    if (!ctx || !blocks) { free(ctx); free(blocks); return FY_ERR_NOMEM; }
    ctx->cfg = *cfg;
    if (ctx->cfg.local_pattern > 0 && !(ctx->cfg.rope_local.theta > 0.0f)) ctx->cfg.rope_local = cfg->rope;
    cfg = &ctx->cfg;
    fy_block_spec *blk = &blocks[0];
    blk->kind = FY_BLOCK_EMBED;
    fy_model_add_tensor(blk, "model.embed_tokens.weight", V, C, true, false);
    blk->tensors[0].alloc_rows = fy_lm_vocab_padded(V);
    blk->gather = !cfg->tied; /* tied, the head reads the whole table anyway */
    blk->rows_fwd = true;      /* its forward reads the tokens' rows, tied or not */
    char tname[64];
#define ADD(field, present, hf, rows, cols, decay, packed)                        \
    if (present) {                                                                 \
        snprintf(tname, sizeof tname, "model.layers.%d.%s", l, hf);                \
        fy_model_add_tensor(blk, tname, rows, cols, decay, false);                 \
        if (packed) fy_model_pack_last(blk);                                       \
    }
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
        const int hd = cfg.channels / cfg.heads;
        if (cfg.rope.rot_dim) { /* the same share of the head rotated, even, at least a pair */
            const int rot = (int)((int64_t)cfg.rope.rot_dim * hd / cfg.head_dim) & ~1;
            cfg.rope.rot_dim = cfg.rope_local.rot_dim = rot < 2 ? 2 : rot;
        }
        cfg.head_dim = hd;
    }
    bool same = !memcmp(&cfg, &base, sizeof cfg);
    return fy_llama_new(&cfg, same ? name : NULL, out);
}
