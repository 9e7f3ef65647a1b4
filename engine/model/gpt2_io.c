/* gpt2_io.c — recognising a GPT-2 weights file and reading its shape: vocabulary and
 * channels from wte, positions from wpe, layers from the h.{i} present; the heads from
 * the caller, the file's ferry.heads metadata, or n_head of a config.json beside it.
 * (The tensors themselves are read through the block specs, in model.c.) */
#include "engine/model/gpt2.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/util.h"

static const char *prefix_of(const fy_st_file *f) {
    return fy_st_find(f, "transformer.wte.weight") ? "transformer." : "";
}

static const fy_st_tensor *find(const fy_st_file *f, const char *prefix, const char *name) {
    char full[96];
    snprintf(full, sizeof full, "%s%s", prefix, name);
    return fy_st_find(f, full);
}

static int heads_from_config_json(const char *st_path) {
    char path[4096];
    const char *slash = strrchr(st_path, '/');
    int dirlen = slash ? (int)(slash - st_path) : 0;
    snprintf(path, sizeof path, "%.*s%sconfig.json", dirlen, st_path, slash ? "/" : "");
    FILE *fp = fopen(path, "rb");
    if (!fp) return 0;
    char buf[65536];
    size_t n = fread(buf, 1, sizeof buf - 1, fp);
    fclose(fp);
    buf[n] = 0;
    cJSON *j = cJSON_Parse(buf);
    int heads = 0;
    const cJSON *h = j ? cJSON_GetObjectItemCaseSensitive(j, "n_head") : NULL;
    if (cJSON_IsNumber(h) && h->valuedouble > 0 && h->valuedouble < 1e6) heads = (int)h->valuedouble;
    cJSON_Delete(j);
    if (heads) fy_log_info("%s: n_head %d", path, heads);
    return heads;
}

bool fy_gpt2_recognise(const fy_st_file *f) {
    return fy_st_find(f, "wte.weight") || fy_st_find(f, "transformer.wte.weight");
}

fy_status fy_gpt2_file_config(const fy_st_file *f, int heads_flag, fy_gpt2_config *out) {
    const char *path = fy_st_path(f), *pre = prefix_of(f);
    const fy_st_tensor *wte = find(f, pre, "wte.weight"), *wpe = find(f, pre, "wpe.weight");
    if (!wte || !wpe || wte->ndim != 2 || wpe->ndim != 2 || wte->shape[1] != wpe->shape[1]) {
        fy_log_error("%s: not a GPT-2 weights file (needs 2-D wte.weight and wpe.weight "
                     "of equal width)", path);
        return FY_ERR_FORMAT;
    }
    /* layers: one past the highest h.{i}; every layer below it must be there */
    int layers = 0;
    for (int i = 0; i < fy_st_count(f); i++) {
        const char *name = fy_st_at(f, i)->name;
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
    for (int l = 0; l < layers; l++) {
        char name[64];
        snprintf(name, sizeof name, "h.%d.ln_1.weight", l);
        if (!find(f, pre, name)) {
            fy_log_error("%s: tensor %s%s is missing (the file has layers up to h.%d)", path,
                         pre, name, layers - 1);
            return FY_ERR_FORMAT;
        }
    }
    int heads = heads_flag;
    const char *meta = fy_st_meta(f, "ferry.heads");
    if (heads <= 0 && meta) heads = atoi(meta);
    if (heads <= 0) heads = heads_from_config_json(path);
    if (heads <= 0) {
        fy_log_error("%s does not say how many attention heads the model has: pass --heads N",
                     path);
        return FY_ERR_INVALID;
    }
    if (wte->shape[0] > (1 << 30) || wte->shape[1] > (1 << 20) || wpe->shape[0] > (1 << 24)) {
        fy_log_error("%s: implausible model shape", path);
        return FY_ERR_FORMAT;
    }
    *out = (fy_gpt2_config){.vocab = (int)wte->shape[0], .max_seq = (int)wpe->shape[0],
                            .channels = (int)wte->shape[1], .layers = layers, .heads = heads};
    if (layers == 0) {
        fy_log_error("%s: no transformer layers (h.0.*) found", path);
        return FY_ERR_FORMAT;
    }
    return fy_gpt2_config_check(out);
}

fy_status fy_gpt2_from_file(const fy_st_file *f, const fy_model_shape *hint, fy_model **out) {
    *out = NULL;
    fy_gpt2_config cfg;
    FY_TRY(fy_gpt2_file_config(f, hint->heads, &cfg));
    return fy_gpt2_new(&cfg, NULL, out);
}
