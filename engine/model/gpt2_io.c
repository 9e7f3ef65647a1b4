/* gpt2_io.c — mapping between ferry's block buffers and Hugging Face GPT-2 tensors. */
#include "engine/model/gpt2_io.h"

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
        if (l < 0 || l >= FY_GPT2_MAX_LAYERS) {
            fy_log_error("%s: tensor %s has an implausible layer index (at most %d layers)",
                         path, name, FY_GPT2_MAX_LAYERS);
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

fy_status fy_gpt2_load_blocks(const fy_st_file *f, const fy_gpt2_layout *lay,
                              float *const *host) {
    const char *path = fy_st_path(f), *pre = prefix_of(f);
    float *tmp = NULL;
    size_t tmpcap = 0;
    fy_status st = FY_OK;
    for (int b = 0; b < lay->nblocks && st == FY_OK; b++) {
        const fy_block_spec *blk = &lay->blocks[b];
        memset(host[b], 0, blk->nelem * sizeof(float));
        for (int i = 0; i < blk->ntensors; i++) {
            const fy_tensor_spec *ts = &blk->tensors[i];
            const fy_st_tensor *t = find(f, pre, ts->name);
            if (!t) {
                fy_log_error("%s: tensor %s%s is missing", path, pre, ts->name);
                st = FY_ERR_FORMAT;
                break;
            }
            /* the file's shape: vectors 1-D, Conv1D (in, out), others (rows, cols) */
            int64_t r = ts->conv1d ? ts->cols : ts->rows, c = ts->conv1d ? ts->rows : ts->cols;
            bool ok = ts->cols == 1 ? (t->ndim == 1 && t->shape[0] == ts->rows)
                                    : (t->ndim == 2 && t->shape[0] == r && t->shape[1] == c);
            if (!ok) {
                char got[96] = "";
                for (int d = 0; d < t->ndim && d < 4; d++)
                    snprintf(got + strlen(got), sizeof got - strlen(got), "%s%lld", d ? "," : "",
                             (long long)t->shape[d]);
                if (ts->cols == 1)
                    fy_log_error("%s: %s%s has shape (%s), the model needs (%d)", path, pre,
                                 ts->name, got, ts->rows);
                else
                    fy_log_error("%s: %s%s has shape (%s), the model needs (%lld,%lld)", path,
                                 pre, ts->name, got, (long long)r, (long long)c);
                st = FY_ERR_FORMAT;
                break;
            }
            float *dst = host[b] + ts->offset;
            if (!ts->conv1d) {
                st = fy_st_read_f32(f, t, dst);
                if (st != FY_OK) break;
                continue;
            }
            if (tmpcap < t->nelem) {
                free(tmp);
                tmp = malloc(t->nelem * sizeof(float));
                tmpcap = tmp ? t->nelem : 0;
                if (!tmp) { st = FY_ERR_NOMEM; break; }
            }
            st = fy_st_read_f32(f, t, tmp);
            if (st != FY_OK) break;
            for (int64_t i0 = 0; i0 < r; i0++)      /* file (in=r, out=c) -> ours (out, in) */
                for (int64_t j = 0; j < c; j++) dst[j * r + i0] = tmp[i0 * c + j];
        }
    }
    free(tmp);
    return st;
}

fy_status fy_gpt2_save(const char *path, const fy_gpt2_layout *lay, float *const *host) {
    int n = 0;
    for (int b = 0; b < lay->nblocks; b++) n += lay->blocks[b].ntensors;
    fy_st_entry *e = calloc((size_t)n, sizeof *e);
    float **tbufs = calloc((size_t)n, sizeof *tbufs);
    fy_status st = FY_OK;
    if (!e || !tbufs) { st = FY_ERR_NOMEM; goto done; }
    int k = 0;
    for (int b = 0; b < lay->nblocks; b++) {
        const fy_block_spec *blk = &lay->blocks[b];
        for (int i = 0; i < blk->ntensors; i++, k++) {
            const fy_tensor_spec *ts = &blk->tensors[i];
            const float *src = host[b] + ts->offset;
            e[k].name = ts->name;
            e[k].dtype = FY_F32;
            if (ts->cols == 1) {
                e[k].ndim = 1;
                e[k].shape[0] = ts->rows;
                e[k].data = src;
            } else if (!ts->conv1d) {
                e[k].ndim = 2;
                e[k].shape[0] = ts->rows;
                e[k].shape[1] = ts->cols;
                e[k].data = src;
            } else {
                float *t = malloc((size_t)ts->rows * ts->cols * sizeof(float));
                if (!t) { st = FY_ERR_NOMEM; goto done; }
                tbufs[k] = t;
                for (int o = 0; o < ts->rows; o++)   /* ours (out, in) -> file (in, out) */
                    for (int in = 0; in < ts->cols; in++)
                        t[(size_t)in * ts->rows + o] = src[(size_t)o * ts->cols + in];
                e[k].ndim = 2;
                e[k].shape[0] = ts->cols;
                e[k].shape[1] = ts->rows;
                e[k].data = t;
            }
        }
    }
    char v[5][16];
    const fy_gpt2_config *c = &lay->cfg;
    snprintf(v[0], 16, "%d", c->vocab);
    snprintf(v[1], 16, "%d", c->max_seq);
    snprintf(v[2], 16, "%d", c->channels);
    snprintf(v[3], 16, "%d", c->layers);
    snprintf(v[4], 16, "%d", c->heads);
    const char *meta[] = {"format", "pt", "ferry.vocab", v[0], "ferry.max_seq", v[1],
                          "ferry.channels", v[2], "ferry.layers", v[3], "ferry.heads", v[4],
                          NULL};
    st = fy_st_write(path, e, n, meta);
done:
    if (tbufs) for (int i = 0; i < n; i++) free(tbufs[i]);
    free(tbufs);
    free(e);
    return st;
}
