/* gpt2_io.c — a GPT-2 model from its weights and back to config.json. The shape is read
 * from the tensors (vocabulary and channels from wte, positions from wpe, layers from the
 * h.{i} present); the heads from the caller, the config (a directory's config.json,
 * ferry.config metadata, or a config.json beside a file), or the older ferry.heads
 * metadata. A config must agree with the tensors and ask for nothing ferry's GPT-2 does
 * not compute (another activation, layernorm eps, untied head, MLP width). (The tensors
 * themselves are read through the block specs, in model_io.c.) */
#include "engine/model/gpt2.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/util.h"
#include "engine/model/hf_config.h"

static const char *prefix_of(const fy_weights *w) {
    return fy_weights_find(w, "transformer.wte.weight", NULL) ? "transformer." : "";
}

static const fy_st_tensor *find(const fy_weights *w, const char *prefix, const char *name) {
    char full[96];
    snprintf(full, sizeof full, "%s%s", prefix, name);
    return fy_weights_find(w, full, NULL);
}

bool fy_gpt2_recognise(const fy_weights *w) {
    return fy_weights_find(w, "wte.weight", NULL) || fy_weights_find(w, "transformer.wte.weight", NULL);
}

/* A config field the tensors also say: equal, or absent. */
static fy_status agree(const cJSON *j, const char *path, const char *key, int v) {
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(j, key);
    if (!f || cJSON_IsNull(f)) return FY_OK;
    if (cJSON_IsNumber(f) && f->valuedouble == v) return FY_OK;
    fy_log_error("%s: %s is %g but the weights have %d", path, key,
                 cJSON_IsNumber(f) ? f->valuedouble : NAN, v);
    return FY_ERR_FORMAT;
}

/* What a config may ask that ferry's GPT-2 does not compute. */
static fy_status check_config(const cJSON *j, const char *path, const fy_gpt2_config *c,
                              int *heads) {
    static const char *const acts[] = {"gelu_new", "gelu_pytorch_tanh", "gelu_fast", NULL};
    FY_TRY(fy_hf_one_of(j, path, "activation_function", acts));
    double eps;
    bool tied;
    FY_TRY(fy_hf_float(j, path, "layer_norm_epsilon", 1e-5, &eps));
    if (fabs(eps - 1e-5) > 1e-12) {
        fy_log_error("%s: layer_norm_epsilon %g: ferry's GPT-2 layernorm uses 1e-05", path, eps);
        return FY_ERR_FORMAT;
    }
    FY_TRY(fy_hf_bool(j, path, "tie_word_embeddings", true, &tied));
    if (!tied) {
        fy_log_error("%s: tie_word_embeddings false: ferry's GPT-2 ties lm_head to wte", path);
        return FY_ERR_FORMAT;
    }
    FY_TRY(agree(j, path, "vocab_size", c->vocab));
    FY_TRY(agree(j, path, "n_embd", c->channels));
    FY_TRY(agree(j, path, "n_layer", c->layers));
    FY_TRY(agree(j, path, "n_positions", c->max_seq));
    FY_TRY(agree(j, path, "n_inner", 4 * c->channels));
    return fy_hf_int(j, path, "n_head", 0, 1, 1 << 16, heads);
}

fy_status fy_gpt2_weights_config(const fy_weights *w, int heads_flag, fy_gpt2_config *out) {
    const char *path = fy_weights_path(w), *pre = prefix_of(w);
    const fy_st_tensor *wte = find(w, pre, "wte.weight"), *wpe = find(w, pre, "wpe.weight");
    if (!wte || !wpe || wte->ndim != 2 || wpe->ndim != 2 || wte->shape[1] != wpe->shape[1]) {
        fy_log_error("%s: not GPT-2 weights (needs 2-D wte.weight and wpe.weight of equal "
                     "width)", path);
        return FY_ERR_FORMAT;
    }
    if (wte->shape[0] > (1 << 30) || wte->shape[1] > (1 << 20) || wpe->shape[0] > (1 << 24)) {
        fy_log_error("%s: implausible model shape", path);
        return FY_ERR_FORMAT;
    }
    /* layers: one past the highest h.{i}; every layer below it must be there */
    int layers = 0;
    for (int i = 0; i < fy_weights_count(w); i++) {
        const char *name = fy_weights_at(w, i, NULL)->name;
        if (strncmp(name, pre, strlen(pre)) || strncmp(name + strlen(pre), "h.", 2)) continue;
        const char *digits = name + strlen(pre) + 2;
        char *end;
        long l = strtol(digits, &end, 10);
        if (end == digits || *end != '.') continue;
        if (l < 0 || l >= FY_MODEL_MAX_LAYERS) {
            fy_log_error("%s: tensor %s has an implausible layer index (at most %d layers)",
                         path, name, FY_MODEL_MAX_LAYERS);
            return FY_ERR_FORMAT;
        }
        if ((int)l + 1 > layers) layers = (int)l + 1;
    }
    if (layers == 0) {
        fy_log_error("%s: no transformer layers (h.0.*) found", path);
        return FY_ERR_FORMAT;
    }
    for (int l = 0; l < layers; l++) {
        char name[64];
        snprintf(name, sizeof name, "h.%d.ln_1.weight", l);
        if (!find(w, pre, name)) {
            fy_log_error("%s: tensor %s%s is missing (the weights have layers up to h.%d)", path,
                         pre, name, layers - 1);
            return FY_ERR_FORMAT;
        }
    }
    *out = (fy_gpt2_config){.vocab = (int)wte->shape[0], .max_seq = (int)wpe->shape[0],
                            .channels = (int)wte->shape[1], .layers = layers};
    int heads = 0;
    const cJSON *j = fy_weights_config(w);
    if (j) FY_TRY(check_config(j, fy_weights_config_path(w), out, &heads));
    if (heads_flag > 0 && heads > 0 && heads_flag != heads) {
        fy_log_error("--heads %d disagrees with %s's n_head %d", heads_flag,
                     fy_weights_config_path(w), heads);
        return FY_ERR_INVALID;
    }
    if (heads_flag > 0) heads = heads_flag;
    const char *meta = fy_weights_meta(w, "ferry.heads"); /* files of older ferry versions */
    if (heads <= 0 && meta) {
        int64_t h;
        if (fy_parse_i64(meta, &h) != 0 || h < 1 || h > 65536) {
            fy_log_error("%s: ferry.heads is not a head count from 1 to 65536", path);
            return FY_ERR_FORMAT;
        }
        heads = (int)h;
    }
    if (heads <= 0) {
        fy_log_error("%s does not say how many attention heads the model has: pass --heads N",
                     path);
        return FY_ERR_INVALID;
    }
    out->heads = heads;
    return fy_gpt2_config_check(out);
}

fy_status fy_gpt2_from_weights(const fy_weights *w, const fy_model_shape *hint, fy_model **out) {
    *out = NULL;
    fy_gpt2_config cfg;
    FY_TRY(fy_gpt2_weights_config(w, hint->heads, &cfg));
    return fy_gpt2_new(&cfg, NULL, out);
}

void fy_gpt2_hf_config(const fy_model *m, cJSON *j) {
    const fy_gpt2_config *c = fy_gpt2_config_of(m);
    fy_hf_set_architecture(j, "GPT2LMHeadModel");
    fy_hf_set_string(j, "model_type", "gpt2");
    fy_hf_set_int(j, "vocab_size", c->vocab);
    fy_hf_set_int(j, "n_positions", c->max_seq);
    fy_hf_set_int(j, "n_embd", c->channels);
    fy_hf_set_int(j, "n_layer", c->layers);
    fy_hf_set_int(j, "n_head", c->heads);
    fy_hf_set_null(j, "n_inner");
    fy_hf_set_string(j, "activation_function", "gelu_new");
    fy_hf_set_float(j, "layer_norm_epsilon", 1e-5f);
    fy_hf_set_bool(j, "tie_word_embeddings", true);
    /* ferry trains without dropout; a config read keeps its own */
    static const char *const drops[] = {"resid_pdrop", "embd_pdrop", "attn_pdrop"};
    for (int i = 0; i < 3; i++)
        if (!cJSON_GetObjectItemCaseSensitive(j, drops[i])) fy_hf_set_float(j, drops[i], 0.0f);
}
