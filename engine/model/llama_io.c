/* llama_io.c — a model of the Llama family from a Hugging Face config.json and back, for
 * each model_type it covers (llama.h): the fields of LlamaConfig, MistralConfig,
 * Qwen2Config, Qwen3Config, Gemma2Config, Gemma3TextConfig and Phi3Config, their defaults
 * where a field is absent (transformers' own), the rope in both forms (top-level
 * rope_theta and rope_scaling, as published with the models, and the rope_parameters
 * newer transformers write), and every field that would change the math and ferry cannot
 * honour refused by name before anything is allocated. */
#include "engine/model/llama.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/util.h"
#include "engine/model/hf_config.h"
#include "engine/model/model_impl.h"

#define MAXI 1000000000

/* What differs in each config class: transformers' defaults. */
static const struct arch_info {
    int max_pos;        /* max_position_embeddings */
    double eps, theta;  /* rms_norm_eps, rope_theta */
    bool tied;          /* tie_word_embeddings */
    int head_dim;       /* head_dim; 0: hidden_size / num_attention_heads */
} arch_info[] = {
    [FY_ARCH_LLAMA] = {2048, 1e-6, 10000.0, false, 0},
    [FY_ARCH_MISTRAL] = {131072, 1e-6, 10000.0, false, 0},
    [FY_ARCH_QWEN2] = {32768, 1e-6, 10000.0, false, 0},
    [FY_ARCH_QWEN3] = {32768, 1e-6, 10000.0, false, 128},
    [FY_ARCH_GEMMA2] = {8192, 1e-6, 10000.0, true, 256},
    [FY_ARCH_GEMMA3] = {131072, 1e-6, 1000000.0, true, 256},
    [FY_ARCH_PHI3] = {4096, 1e-5, 10000.0, false, 0},
};
/* Phi3Config's original_max_position_embeddings (longrope's). */
#define PHI3_ORIG_MAX_POS 4096

static bool arch_of(const char *type, fy_llama_arch *out) {
    for (int a = FY_ARCH_LLAMA; a <= FY_ARCH_PHI3; a++)
        if (!strcmp(type, fy_llama_arch_type((fy_llama_arch)a))) { *out = (fy_llama_arch)a; return true; }
    return false;
}

/* rope_scaling (or rope_parameters) of type default, linear, llama3 or longrope (Phi-3's,
 * also called su); longrope's factor lists have one entry a rotated pair. */
static fy_status read_rope(const cJSON *sc, const char *path, const char *key, int pairs,
                           fy_rope *r, float *long_factors) {
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(sc, "rope_type");
    if (!type) type = cJSON_GetObjectItemCaseSensitive(sc, "type"); /* the older name */
    if (!cJSON_IsString(type)) {
        fy_log_error("%s: %s has no rope_type (or type) saying how it scales", path, key);
        return FY_ERR_FORMAT;
    }
    const char *t = type->valuestring;
    double v;
    if (!strcmp(t, "default")) {
        r->type = FY_ROPE_DEFAULT;
        return FY_OK;
    }
    if (!strcmp(t, "linear")) {
        r->type = FY_ROPE_LINEAR;
        FY_TRY(fy_hf_float(sc, path, "factor", 0, &v));
        r->factor = (float)v;
        return FY_OK;
    }
    if (!strcmp(t, "llama3")) {
        r->type = FY_ROPE_LLAMA3;
        FY_TRY(fy_hf_float(sc, path, "factor", 0, &v));
        r->factor = (float)v;
        FY_TRY(fy_hf_float(sc, path, "low_freq_factor", 0, &v));
        r->low_freq_factor = (float)v;
        FY_TRY(fy_hf_float(sc, path, "high_freq_factor", 0, &v));
        r->high_freq_factor = (float)v;
        FY_TRY(fy_hf_float(sc, path, "original_max_position_embeddings", 0, &v));
        r->orig_max_pos = (float)v;
        return FY_OK;
    }
    if ((!strcmp(t, "longrope") || !strcmp(t, "su")) && long_factors) {
        if (pairs > FY_ROPE_MAX_PAIRS) {
            fy_log_error("%s: %s: longrope over %d rotated pairs is more than ferry's %d", path,
                         key, pairs, FY_ROPE_MAX_PAIRS);
            return FY_ERR_FORMAT;
        }
        r->type = FY_ROPE_LONGROPE;
        FY_TRY(fy_hf_float_array(sc, path, "short_factor", pairs, r->ext));
        FY_TRY(fy_hf_float_array(sc, path, "long_factor", pairs, long_factors));
        const cJSON *af = cJSON_GetObjectItemCaseSensitive(sc, "attention_factor");
        if (af && !cJSON_IsNull(af)) { /* absent: from the sizes (read_ropes) */
            FY_TRY(fy_hf_float(sc, path, "attention_factor", 0, &v));
            r->attn_factor = (float)v;
        }
        return FY_OK;
    }
    fy_log_error("%s: %s type \"%s\" is not supported (ferry: default, linear, llama3%s)", path,
                 key, t, long_factors ? ", longrope" : "");
    return FY_ERR_FORMAT;
}

/* A shape flag given with a config must agree with it. */
static fy_status agree(const char *path, const char *flag, int given, const char *key, int v) {
    if (given <= 0 || given == v) return FY_OK;
    fy_log_error("--%s %d disagrees with %s's %s %d", flag, given, path, key, v);
    return FY_ERR_INVALID;
}

/* layer_types, when given: Gemma's repeating pattern of sliding layers closed by a full
 * one (local_pattern p: layer l is full when (l + 1) % p == 0; every layer sliding: 0);
 * elsewhere every layer full. */
static fy_status read_layer_types(const cJSON *j, const char *path, fy_llama_config *c,
                                  bool gemma) {
    const cJSON *lt = cJSON_GetObjectItemCaseSensitive(j, "layer_types");
    if (!lt || cJSON_IsNull(lt)) return FY_OK;
    if (!cJSON_IsArray(lt) || cJSON_GetArraySize(lt) != c->layers) {
        fy_log_error("%s: layer_types must list the %d layers", path, c->layers);
        return FY_ERR_FORMAT;
    }
    int first_full = 0, l = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, lt) { /* the pattern's period: the first full layer */
        if (!cJSON_IsString(e) || (strcmp(e->valuestring, "full_attention") &&
                                   strcmp(e->valuestring, "sliding_attention"))) {
            fy_log_error("%s: layer_types[%d] must be \"full_attention\" or \"sliding_attention\"",
                         path, l);
            return FY_ERR_FORMAT;
        }
        if (!first_full && !strcmp(e->valuestring, "full_attention")) first_full = l + 1;
        l++;
    }
    const int p = first_full;
    l = 0;
    cJSON_ArrayForEach(e, lt) {
        const bool full = !strcmp(e->valuestring, "full_attention");
        const bool want = gemma ? p > 0 && (l + 1) % p == 0 : true;
        if (full != want) {
            fy_log_error("%s: layer_types: ferry takes %s (layer %d is \"%s\")", path,
                         gemma ? "a repeating pattern of sliding layers each closed by a full one"
                               : "full attention on every layer", l, e->valuestring);
            return FY_ERR_FORMAT;
        }
        l++;
    }
    /* p == 1: every layer full; none full: every layer sliding (a period past the last) */
    if (gemma) c->local_pattern = p ? p : c->layers + 1;
    return FY_OK;
}

/* The window: Mistral's (absent: 4096, MistralConfig's; null: none), Phi-3's (absent or
 * null: none), Gemma's (absent: 4096; with a pattern), Qwen's only with use_sliding_window,
 * which ferry refuses. */
static fy_status read_window(const cJSON *j, const char *path, fy_llama_config *c) {
    const cJSON *sw = cJSON_GetObjectItemCaseSensitive(j, "sliding_window");
    bool on = false;
    switch (c->arch) {
    case FY_ARCH_QWEN2:
    case FY_ARCH_QWEN3:
        FY_TRY(fy_hf_bool(j, path, "use_sliding_window", false, &on));
        if (on) {
            fy_log_error("%s: use_sliding_window true is not supported (ferry: Qwen's layers "
                         "attend to the whole sequence)", path);
            return FY_ERR_FORMAT;
        }
        return read_layer_types(j, path, c, false);
    case FY_ARCH_LLAMA: return read_layer_types(j, path, c, false);
    case FY_ARCH_GEMMA2:
    case FY_ARCH_GEMMA3:
        c->local_pattern = c->arch == FY_ARCH_GEMMA2 ? 2 : 6;
        if (c->arch == FY_ARCH_GEMMA3)
            FY_TRY(fy_hf_int(j, path, "sliding_window_pattern", 6, 1, 1 << 20, &c->local_pattern));
        FY_TRY(fy_hf_int(j, path, "sliding_window", 4096, 1, 1 << 30, &c->sliding_window));
        return read_layer_types(j, path, c, true);
    case FY_ARCH_MISTRAL:
        if (!sw) { c->sliding_window = 4096; return FY_OK; }
        break;
    case FY_ARCH_PHI3: break;
    }
    if (sw && !cJSON_IsNull(sw)) FY_TRY(fy_hf_int(j, path, "sliding_window", 0, 1, 1 << 30, &c->sliding_window));
    return FY_OK;
}

/* longrope's attention factor when the config gives none (transformers'
 * _compute_longrope_parameters: from the ratio of the positions to the original ones). */
static float longrope_attn_factor(int max_seq, int orig) {
    const double factor = (double)max_seq / orig;
    return factor <= 1.0 ? 1.0f : (float)sqrt(1.0 + log(factor) / log((double)orig));
}

/* The rotation: rope_parameters (newer transformers) or rope_theta and rope_scaling;
 * Phi-3's partial rotation and longrope's attention factor; Gemma 3's local layers' base. */
static fy_status read_ropes(const cJSON *j, const char *path, fy_llama_config *c) {
    const struct arch_info *ai = &arch_info[c->arch];
    double theta, prf;
    FY_TRY(fy_hf_float(j, path, "partial_rotary_factor", 1.0, &prf));
    if (prf != 1.0 && c->arch != FY_ARCH_PHI3) {
        fy_log_error("%s: partial_rotary_factor %g is not supported for %s (ferry: 1)", path, prf,
                     fy_llama_arch_type(c->arch));
        return FY_ERR_FORMAT;
    }
    if (prf > 1.0) {
        fy_log_error("%s: partial_rotary_factor %g must be at most 1", path, prf);
        return FY_ERR_FORMAT;
    }
    const int rot = (int)(c->head_dim * prf); /* transformers' int(head_dim * factor) */
    if (rot < 2 || rot % 2) {
        fy_log_error("%s: partial_rotary_factor %g rotates %d of %d channels (ferry: an even "
                     "number, at least 2)", path, prf, rot, c->head_dim);
        return FY_ERR_FORMAT;
    }
    c->rope.rot_dim = rot == c->head_dim ? 0 : rot;
    float *long_factors = c->arch == FY_ARCH_PHI3 ? c->rope_long : NULL;
    const cJSON *rp = cJSON_GetObjectItemCaseSensitive(j, "rope_parameters");
    const cJSON *rp_local = NULL;
    if (cJSON_IsObject(rp) && cJSON_GetObjectItemCaseSensitive(rp, "full_attention")) {
        /* transformers 5's per-kind form (Gemma 3): full and sliding layers' rotations */
        rp_local = cJSON_GetObjectItemCaseSensitive(rp, "sliding_attention");
        rp = cJSON_GetObjectItemCaseSensitive(rp, "full_attention");
        if (!cJSON_IsObject(rp) || (rp_local && !cJSON_IsObject(rp_local))) {
            fy_log_error("%s: rope_parameters' full_attention and sliding_attention must be objects", path);
            return FY_ERR_FORMAT;
        }
    }
    if (cJSON_IsObject(rp)) {
        FY_TRY(fy_hf_float(rp, path, "rope_theta", ai->theta, &theta));
        FY_TRY(read_rope(rp, path, "rope_parameters", rot / 2, &c->rope, long_factors));
    } else {
        FY_TRY(fy_hf_float(j, path, "rope_theta", ai->theta, &theta));
        const cJSON *sc = cJSON_GetObjectItemCaseSensitive(j, "rope_scaling");
        if (sc && !cJSON_IsNull(sc) && !cJSON_IsObject(sc)) {
            fy_log_error("%s: rope_scaling must be an object or null", path);
            return FY_ERR_FORMAT;
        }
        if (cJSON_IsObject(sc)) FY_TRY(read_rope(sc, path, "rope_scaling", rot / 2, &c->rope, long_factors));
    }
    c->rope.theta = (float)theta;
    if (c->rope.type == FY_ROPE_LONGROPE) { /* transformers' _compute_longrope_parameters */
        int orig;
        FY_TRY(fy_hf_int(j, path, "original_max_position_embeddings", PHI3_ORIG_MAX_POS, 1,
                         1 << 30, &orig));
        c->rope.orig_max_pos = (float)orig;
        if (!(c->rope.attn_factor > 0.0f)) c->rope.attn_factor = longrope_attn_factor(c->max_seq, orig);
    }
    if (rp_local) { /* the sliding layers' own */
        FY_TRY(fy_hf_float(rp_local, path, "rope_theta", 10000.0, &theta));
        FY_TRY(read_rope(rp_local, path, "rope_parameters", rot / 2, &c->rope_local, NULL));
        c->rope_local.theta = (float)theta;
        c->rope_local.rot_dim = c->rope.rot_dim;
    } else if (c->arch == FY_ARCH_GEMMA3) { /* the local layers: their own base, no scaling */
        double local;
        FY_TRY(fy_hf_float(j, path, "rope_local_base_freq", 10000.0, &local));
        c->rope_local = (fy_rope){.type = FY_ROPE_DEFAULT, .theta = (float)local};
    } else {
        c->rope_local = c->rope;
    }
    return FY_OK;
}

/* Gemma's switches: its activation, norms and scales, the soft-caps (null: none). */
static fy_status read_gemma(const cJSON *j, const char *path, fy_llama_config *c) {
    static const char *const gelu_tanh[] = {"gelu_pytorch_tanh", NULL};
    const bool g2 = c->arch == FY_ARCH_GEMMA2;
    double v;
    FY_TRY(fy_hf_one_of(j, path, "hidden_activation", gelu_tanh));
    c->act = FY_GLU_GELU_TANH;
    c->sandwich = true;
    c->norm_offset = 1.0f;
    c->embed_scale = true;
    c->qk_norm = !g2;
    FY_TRY(fy_hf_float(j, path, "query_pre_attn_scalar", 256.0, &v));
    c->query_scalar = (float)v;
    const struct { const char *key; double def; float *out; } caps[] = { /* def 0: none */
        {"attn_logit_softcapping", g2 ? 50.0 : 0.0, &c->attn_softcap},
        {"final_logit_softcapping", g2 ? 30.0 : 0.0, &c->final_softcap},
    };
    for (int i = 0; i < 2; i++) {
        const cJSON *f = cJSON_GetObjectItemCaseSensitive(j, caps[i].key);
        if (cJSON_IsNull(f) || (!f && caps[i].def == 0.0)) continue; /* none */
        FY_TRY(fy_hf_float(j, path, caps[i].key, caps[i].def, &v));
        *caps[i].out = (float)v;
    }
    bool bidir;
    FY_TRY(fy_hf_bool(j, path, "use_bidirectional_attention", false, &bidir));
    if (bidir) {
        fy_log_error("%s: use_bidirectional_attention true is not supported (ferry trains causal "
                     "language models)", path);
        return FY_ERR_FORMAT;
    }
    return FY_OK;
}

fy_status fy_llama_from_weights(const fy_weights *w, const fy_model_shape *hint, fy_model **out) {
    *out = NULL;
    const cJSON *j = fy_weights_config(w);
    const char *path = fy_weights_config_path(w);
    FY_ASSERT(j, "the registry hands Llama only weights with a config");
    const cJSON *mt = cJSON_GetObjectItemCaseSensitive(j, "model_type");
    fy_llama_config c = {0};
    FY_ASSERT(cJSON_IsString(mt), "the registry checked model_type");
    if (!strcmp(mt->valuestring, "gemma3")) {
        fy_log_error("%s: model_type gemma3 is Gemma 3's image-and-text model; ferry trains its "
                     "text model (Gemma3ForCausalLM, model_type gemma3_text)", path);
        return FY_ERR_FORMAT;
    }
    FY_ASSERT(arch_of(mt->valuestring, &c.arch), "the registry passes only the family's types");
    const struct arch_info *ai = &arch_info[c.arch];
    const bool gemma = c.arch == FY_ARCH_GEMMA2 || c.arch == FY_ARCH_GEMMA3;
    double eps;
    FY_TRY(fy_hf_int(j, path, "vocab_size", -1, 1, MAXI, &c.vocab));
    FY_TRY(fy_hf_int(j, path, "hidden_size", -1, 1, 1 << 20, &c.channels));
    FY_TRY(fy_hf_int(j, path, "intermediate_size", -1, 1, 1 << 24, &c.ffn));
    FY_TRY(fy_hf_int(j, path, "num_hidden_layers", -1, 1, FY_MODEL_MAX_LAYERS, &c.layers));
    FY_TRY(fy_hf_int(j, path, "num_attention_heads", -1, 1, 1 << 16, &c.heads));
    FY_TRY(fy_hf_int(j, path, "num_key_value_heads", c.heads, 1, 1 << 16, &c.kv_heads));
    if (c.heads % c.kv_heads) {
        fy_log_error("%s: num_key_value_heads %d does not divide num_attention_heads %d", path,
                     c.kv_heads, c.heads);
        return FY_ERR_FORMAT;
    }
    const cJSON *hd = cJSON_GetObjectItemCaseSensitive(j, "head_dim");
    if ((!hd || cJSON_IsNull(hd)) && !ai->head_dim && c.channels % c.heads) {
        fy_log_error("%s: num_attention_heads %d does not divide hidden_size %d (and no head_dim "
                     "is given)", path, c.heads, c.channels);
        return FY_ERR_FORMAT;
    }
    FY_TRY(fy_hf_int(j, path, "head_dim", ai->head_dim ? ai->head_dim : c.channels / c.heads, 2,
                     1 << 16, &c.head_dim));
    FY_TRY(fy_hf_int(j, path, "max_position_embeddings", ai->max_pos, 1, 1 << 30, &c.max_seq));
    FY_TRY(fy_hf_float(j, path, "rms_norm_eps", ai->eps, &eps));
    c.norm_eps = (float)eps;
    FY_TRY(fy_hf_bool(j, path, "tie_word_embeddings", ai->tied, &c.tied));
    if (gemma) {
        FY_TRY(read_gemma(j, path, &c));
    } else {
        static const char *const silu[] = {"silu", "swish", NULL};
        FY_TRY(fy_hf_one_of(j, path, "hidden_act", silu));
        c.act = FY_GLU_SILU;
        c.qkv_bias = c.arch == FY_ARCH_QWEN2; /* Qwen2's q, k and v always have biases */
        c.qk_norm = c.arch == FY_ARCH_QWEN3;
    }
    /* biases beyond Qwen2's q, k and v: none of these families has them */
    static const char *const bias_keys[] = {"attention_bias", "mlp_bias"};
    for (int i = 0; i < 2; i++) {
        bool bias;
        FY_TRY(fy_hf_bool(j, path, bias_keys[i], false, &bias));
        if (bias) {
            fy_log_error("%s: %s true is not supported (ferry: %s)", path, bias_keys[i],
                         c.arch == FY_ARCH_QWEN2 ? "Qwen2's biases on q, k and v only" : "no biases");
            return FY_ERR_FORMAT;
        }
    }
    static const char *const dropouts[] = {"attention_dropout", "resid_pdrop", "embd_pdrop",
                                           "hidden_dropout", "dropout"};
    for (size_t i = 0; i < sizeof dropouts / sizeof dropouts[0]; i++)
        FY_TRY(fy_hf_zero(j, path, dropouts[i], "ferry trains without dropout"));
    const cJSON *experts = cJSON_GetObjectItemCaseSensitive(j, "num_local_experts");
    if (!experts) experts = cJSON_GetObjectItemCaseSensitive(j, "num_experts");
    if (experts && !cJSON_IsNull(experts) && !(cJSON_IsNumber(experts) && experts->valuedouble <= 1)) {
        fy_log_error("%s: %s: mixtures of experts are not supported", path, experts->string);
        return FY_ERR_FORMAT;
    }
    FY_TRY(read_ropes(j, path, &c));
    FY_TRY(read_window(j, path, &c));
    FY_TRY(agree(path, "heads", hint->heads, "num_attention_heads", c.heads));
    FY_TRY(agree(path, "kv-heads", hint->kv_heads, "num_key_value_heads", c.kv_heads));
    FY_TRY(agree(path, "ffn", hint->ffn, "intermediate_size", c.ffn));
    return fy_llama_new(&c, NULL, out);
}

/* A rotation's scaling into o; longrope as Phi-3's configs give it (transformers' Phi3Config
 * takes exactly type, short_factor and long_factor: the attention factor only when it is
 * not the one the sizes give). */
static void write_rope(cJSON *o, const fy_llama_config *c, const fy_rope *r, int pairs) {
    static const char *const types[] = {[FY_ROPE_DEFAULT] = "default", [FY_ROPE_LINEAR] = "linear",
                                        [FY_ROPE_LLAMA3] = "llama3", [FY_ROPE_LONGROPE] = "longrope"};
    fy_hf_set_string(o, r->type == FY_ROPE_LONGROPE ? "type" : "rope_type", types[r->type]);
    if (r->type == FY_ROPE_LINEAR || r->type == FY_ROPE_LLAMA3) fy_hf_set_float(o, "factor", r->factor);
    if (r->type == FY_ROPE_LLAMA3) {
        fy_hf_set_float(o, "low_freq_factor", r->low_freq_factor);
        fy_hf_set_float(o, "high_freq_factor", r->high_freq_factor);
        fy_hf_set_int(o, "original_max_position_embeddings", (long long)r->orig_max_pos);
    }
    if (r->type == FY_ROPE_LONGROPE) {
        fy_hf_set_float_array(o, "short_factor", r->ext, pairs);
        fy_hf_set_float_array(o, "long_factor", c->rope_long, pairs);
        if (r->attn_factor != longrope_attn_factor(c->max_seq, (int)r->orig_max_pos))
            fy_hf_set_float(o, "attention_factor", r->attn_factor);
    }
}

void fy_llama_hf_config(const fy_model *m, cJSON *j) {
    const fy_llama_config *c = fy_llama_config_of(m);
    const bool gemma = c->arch == FY_ARCH_GEMMA2 || c->arch == FY_ARCH_GEMMA3;
    const int pairs = (c->rope.rot_dim ? c->rope.rot_dim : c->head_dim) / 2;
    fy_hf_set_architecture(j, fy_llama_arch_class(c->arch));
    fy_hf_set_string(j, "model_type", fy_llama_arch_type(c->arch));
    fy_hf_set_int(j, "vocab_size", c->vocab);
    fy_hf_set_int(j, "hidden_size", c->channels);
    fy_hf_set_int(j, "intermediate_size", c->ffn);
    fy_hf_set_int(j, "num_hidden_layers", c->layers);
    fy_hf_set_int(j, "num_attention_heads", c->heads);
    fy_hf_set_int(j, "num_key_value_heads", c->kv_heads);
    fy_hf_set_int(j, "head_dim", c->head_dim);
    fy_hf_set_int(j, "max_position_embeddings", c->max_seq);
    fy_hf_set_float(j, "rms_norm_eps", c->norm_eps);
    fy_hf_set_string(j, gemma ? "hidden_activation" : "hidden_act",
                     gemma ? "gelu_pytorch_tanh" : "silu");
    if (c->arch != FY_ARCH_QWEN2 && c->arch != FY_ARCH_PHI3) fy_hf_set_bool(j, "attention_bias", false);
    if (c->arch == FY_ARCH_LLAMA) fy_hf_set_bool(j, "mlp_bias", false);
    fy_hf_set_bool(j, "tie_word_embeddings", c->tied);
    if (!cJSON_GetObjectItemCaseSensitive(j, "initializer_range")) fy_hf_set_float(j, "initializer_range", 0.02f);
    fy_hf_set_float(j, "rope_theta", c->rope.theta);
    if (c->rope.type == FY_ROPE_DEFAULT) fy_hf_set_null(j, "rope_scaling");
    else write_rope(fy_hf_set_object(j, "rope_scaling"), c, &c->rope, pairs);
    const cJSON *old_rp = cJSON_GetObjectItemCaseSensitive(j, "rope_parameters");
    if (cJSON_IsObject(old_rp)) { /* the newer form, kept in step */
        const bool per_kind = cJSON_GetObjectItemCaseSensitive(old_rp, "full_attention") != NULL;
        cJSON *rp = fy_hf_set_object(j, "rope_parameters");
        cJSON *full = per_kind ? fy_hf_set_object(rp, "full_attention") : rp;
        fy_hf_set_float(full, "rope_theta", c->rope.theta);
        write_rope(full, c, &c->rope, pairs);
        if (per_kind) {
            cJSON *local = fy_hf_set_object(rp, "sliding_attention");
            fy_hf_set_float(local, "rope_theta", c->rope_local.theta);
            write_rope(local, c, &c->rope_local, pairs);
        }
    }
    if (c->rope.rot_dim) fy_hf_set_float(j, "partial_rotary_factor", (float)c->rope.rot_dim / (float)c->head_dim);
    if (c->rope.type == FY_ROPE_LONGROPE)
        fy_hf_set_int(j, "original_max_position_embeddings", (long long)c->rope.orig_max_pos);
    switch (c->arch) {
    case FY_ARCH_QWEN2:
    case FY_ARCH_QWEN3: fy_hf_set_bool(j, "use_sliding_window", false); break;
    case FY_ARCH_MISTRAL:
    case FY_ARCH_PHI3:
        if (c->sliding_window) fy_hf_set_int(j, "sliding_window", c->sliding_window);
        else fy_hf_set_null(j, "sliding_window");
        break;
    case FY_ARCH_GEMMA2:
    case FY_ARCH_GEMMA3: {
        fy_hf_set_float(j, "query_pre_attn_scalar", c->query_scalar > 0.0f ? c->query_scalar : (float)c->head_dim);
        if (c->attn_softcap > 0.0f) fy_hf_set_float(j, "attn_logit_softcapping", c->attn_softcap);
        else fy_hf_set_null(j, "attn_logit_softcapping");
        if (c->final_softcap > 0.0f) fy_hf_set_float(j, "final_logit_softcapping", c->final_softcap);
        else fy_hf_set_null(j, "final_logit_softcapping");
        if (c->arch == FY_ARCH_GEMMA3) fy_hf_set_float(j, "rope_local_base_freq", c->rope_local.theta);
        /* the window on every layer of a pattern's (a huge one where none) */
        fy_hf_set_int(j, "sliding_window", c->sliding_window ? c->sliding_window : c->max_seq);
        const char **types = malloc((size_t)c->layers * sizeof *types);
        if (!types) break; /* out of memory: transformers then derives them from the pattern */
        for (int l = 0; l < c->layers; l++)
            types[l] = !c->local_pattern || (l + 1) % c->local_pattern ? "sliding_attention"
                                                                       : "full_attention";
        fy_hf_set_string_array(j, "layer_types", types, c->layers);
        free(types);
        if (c->arch == FY_ARCH_GEMMA3) fy_hf_set_int(j, "sliding_window_pattern", c->local_pattern ? c->local_pattern : 1);
        break;
    }
    case FY_ARCH_LLAMA: break;
    }
}
