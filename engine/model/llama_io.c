/* llama_io.c — a Llama model from a Hugging Face config.json and back: LlamaConfig's and
 * MistralConfig's fields (their defaults where a field is absent), the rope in both
 * forms (top-level rope_theta and rope_scaling, as published with the models, and the
 * rope_parameters newer transformers write), and every field ferry cannot honour refused
 * by name. */
#include "engine/model/llama.h"

#include <stdio.h>
#include <string.h>

#include "engine/core/util.h"
#include "engine/model/hf_config.h"
#include "engine/model/model_impl.h"

#define MAXI 1000000000

/* rope_scaling (or rope_parameters) of type default, linear or llama3. */
static fy_status read_rope(const cJSON *sc, const char *path, const char *key, fy_rope *r) {
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
    fy_log_error("%s: %s type \"%s\" is not supported (ferry: default, linear, llama3)", path, key, t);
    return FY_ERR_FORMAT;
}

/* A shape flag given with a config must agree with it. */
static fy_status agree(const char *path, const char *flag, int given, const char *key, int v) {
    if (given <= 0 || given == v) return FY_OK;
    fy_log_error("--%s %d disagrees with %s's %s %d", flag, given, path, key, v);
    return FY_ERR_INVALID;
}

fy_status fy_llama_from_weights(const fy_weights *w, const fy_model_shape *hint, fy_model **out) {
    *out = NULL;
    const cJSON *j = fy_weights_config(w);
    const char *path = fy_weights_config_path(w);
    FY_ASSERT(j, "the registry hands Llama only weights with a config");
    const cJSON *mt = cJSON_GetObjectItemCaseSensitive(j, "model_type");
    const bool mistral = cJSON_IsString(mt) && !strcmp(mt->valuestring, "mistral");
    fy_llama_config c = {0};
    double eps, theta;
    static const char *const silu[] = {"silu", "swish", NULL};
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
    if ((!hd || cJSON_IsNull(hd)) && c.channels % c.heads) {
        fy_log_error("%s: num_attention_heads %d does not divide hidden_size %d (and no head_dim "
                     "is given)", path, c.heads, c.channels);
        return FY_ERR_FORMAT;
    }
    FY_TRY(fy_hf_int(j, path, "head_dim", c.channels / c.heads, 2, 1 << 16, &c.head_dim));
    /* LlamaConfig's and MistralConfig's defaults */
    FY_TRY(fy_hf_int(j, path, "max_position_embeddings", mistral ? 131072 : 2048, 1, 1 << 30,
                     &c.max_seq));
    FY_TRY(fy_hf_float(j, path, "rms_norm_eps", 1e-6, &eps));
    c.norm_eps = (float)eps;
    FY_TRY(fy_hf_bool(j, path, "tie_word_embeddings", false, &c.tied));
    FY_TRY(fy_hf_one_of(j, path, "hidden_act", silu));
    bool bias;
    FY_TRY(fy_hf_bool(j, path, "attention_bias", false, &bias));
    if (!bias) FY_TRY(fy_hf_bool(j, path, "mlp_bias", false, &bias));
    if (bias) {
        fy_log_error("%s: attention_bias / mlp_bias: ferry's Llama has no biases", path);
        return FY_ERR_FORMAT;
    }
    /* the rope: newer transformers' rope_parameters, else the published top-level form */
    const cJSON *rp = cJSON_GetObjectItemCaseSensitive(j, "rope_parameters");
    if (cJSON_IsObject(rp)) {
        FY_TRY(fy_hf_float(rp, path, "rope_theta", 10000.0, &theta));
        FY_TRY(read_rope(rp, path, "rope_parameters", &c.rope));
    } else {
        FY_TRY(fy_hf_float(j, path, "rope_theta", 10000.0, &theta));
        const cJSON *sc = cJSON_GetObjectItemCaseSensitive(j, "rope_scaling");
        if (sc && !cJSON_IsNull(sc) && !cJSON_IsObject(sc)) {
            fy_log_error("%s: rope_scaling must be an object or null", path);
            return FY_ERR_FORMAT;
        }
        if (cJSON_IsObject(sc)) FY_TRY(read_rope(sc, path, "rope_scaling", &c.rope));
    }
    c.rope.theta = (float)theta;
    if (mistral) { /* absent: 4096 (MistralConfig's); null: none */
        const cJSON *sw = cJSON_GetObjectItemCaseSensitive(j, "sliding_window");
        if (!sw) c.sliding_window = 4096;
        else if (!cJSON_IsNull(sw)) FY_TRY(fy_hf_int(j, path, "sliding_window", 0, 1, 1 << 30, &c.sliding_window));
    }
    FY_TRY(agree(path, "heads", hint->heads, "num_attention_heads", c.heads));
    FY_TRY(agree(path, "kv-heads", hint->kv_heads, "num_key_value_heads", c.kv_heads));
    FY_TRY(agree(path, "ffn", hint->ffn, "intermediate_size", c.ffn));
    return fy_llama_new(&c, NULL, out);
}

static void write_rope(cJSON *o, const fy_rope *r) {
    fy_hf_set_string(o, "rope_type", r->type == FY_ROPE_LLAMA3 ? "llama3"
                                     : r->type == FY_ROPE_LINEAR ? "linear" : "default");
    if (r->type == FY_ROPE_DEFAULT) return;
    fy_hf_set_float(o, "factor", r->factor);
    if (r->type != FY_ROPE_LLAMA3) return;
    fy_hf_set_float(o, "low_freq_factor", r->low_freq_factor);
    fy_hf_set_float(o, "high_freq_factor", r->high_freq_factor);
    fy_hf_set_int(o, "original_max_position_embeddings", (long long)r->orig_max_pos);
}

void fy_llama_hf_config(const fy_model *m, cJSON *j) {
    const fy_llama_config *c = fy_llama_config_of(m);
    const cJSON *mt = cJSON_GetObjectItemCaseSensitive(j, "model_type");
    const bool mistral = cJSON_IsString(mt) && !strcmp(mt->valuestring, "mistral");
    fy_hf_set_architecture(j, mistral ? "MistralForCausalLM" : "LlamaForCausalLM");
    fy_hf_set_string(j, "model_type", mistral ? "mistral" : "llama");
    fy_hf_set_int(j, "vocab_size", c->vocab);
    fy_hf_set_int(j, "hidden_size", c->channels);
    fy_hf_set_int(j, "intermediate_size", c->ffn);
    fy_hf_set_int(j, "num_hidden_layers", c->layers);
    fy_hf_set_int(j, "num_attention_heads", c->heads);
    fy_hf_set_int(j, "num_key_value_heads", c->kv_heads);
    fy_hf_set_int(j, "head_dim", c->head_dim);
    fy_hf_set_int(j, "max_position_embeddings", c->max_seq);
    fy_hf_set_float(j, "rms_norm_eps", c->norm_eps);
    fy_hf_set_string(j, "hidden_act", "silu");
    fy_hf_set_bool(j, "attention_bias", false);
    fy_hf_set_bool(j, "mlp_bias", false);
    fy_hf_set_bool(j, "tie_word_embeddings", c->tied);
    if (!cJSON_GetObjectItemCaseSensitive(j, "initializer_range")) fy_hf_set_float(j, "initializer_range", 0.02f);
    fy_hf_set_float(j, "rope_theta", c->rope.theta);
    if (c->rope.type == FY_ROPE_DEFAULT) fy_hf_set_null(j, "rope_scaling");
    else write_rope(fy_hf_set_object(j, "rope_scaling"), &c->rope);
    if (cJSON_IsObject(cJSON_GetObjectItemCaseSensitive(j, "rope_parameters"))) {
        cJSON *rp = fy_hf_set_object(j, "rope_parameters"); /* the newer form, kept in step */
        fy_hf_set_float(rp, "rope_theta", c->rope.theta);
        write_rope(rp, &c->rope);
    }
    if (mistral) {
        if (c->sliding_window) fy_hf_set_int(j, "sliding_window", c->sliding_window);
        else fy_hf_set_null(j, "sliding_window");
    }
}
