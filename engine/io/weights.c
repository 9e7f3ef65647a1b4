/* weights.c — opening a model's weights (weights.h): the path's kind, the index and its
 * shards checked against each other, one sorted table of every tensor for lookups, and
 * the config. */
#include "engine/io/weights.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "engine/core/util.h"
#include "engine/io/json_file.h"

typedef struct entry {
    const char *name;
    int file;
    const fy_st_tensor *t;
} entry;

struct fy_weights {
    char *path, *dir;
    fy_st_file **files;
    int nfiles;
    entry *all;    /* shard order */
    entry *sorted; /* by name */
    int n;
    cJSON *config;
    char *config_path;
};

static char *dup_printf(const char *fmt, const char *a, const char *b) {
    size_t n = strlen(fmt) + strlen(a) + (b ? strlen(b) : 0) + 1;
    char *s = malloc(n);
    if (s) snprintf(s, n, fmt, a, b ? b : "");
    return s;
}

static bool is_file(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

/* Whether the shard at path is the file name a weight_map gives. */
static bool is_shard(const fy_st_file *f, const char *name) {
    const char *path = fy_st_path(f), *slash = strrchr(path, '/');
    return !strcmp(slash ? slash + 1 : path, name);
}

static int cmp_entry(const void *a, const void *b) {
    return strcmp(((const entry *)a)->name, ((const entry *)b)->name);
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Adds an opened shard to w. */
static fy_status add_file(fy_weights *w, fy_st_file *f) {
    fy_st_file **files = realloc(w->files, (size_t)(w->nfiles + 1) * sizeof *files);
    if (!files) { fy_st_close(f); return FY_ERR_NOMEM; }
    w->files = files;
    w->files[w->nfiles++] = f;
    return FY_OK;
}

/* The table of every tensor, and no name in two shards. */
static fy_status build_table(fy_weights *w) {
    int n = 0;
    for (int i = 0; i < w->nfiles; i++) n += fy_st_count(w->files[i]);
    w->all = calloc((size_t)(n ? n : 1), sizeof *w->all);
    w->sorted = calloc((size_t)(n ? n : 1), sizeof *w->sorted);
    if (!w->all || !w->sorted) return FY_ERR_NOMEM;
    for (int i = 0, k = 0; i < w->nfiles; i++)
        for (int j = 0; j < fy_st_count(w->files[i]); j++, k++) {
            const fy_st_tensor *t = fy_st_at(w->files[i], j);
            w->all[k] = (entry){t->name, i, t};
        }
    w->n = n;
    memcpy(w->sorted, w->all, (size_t)n * sizeof *w->all);
    qsort(w->sorted, (size_t)n, sizeof *w->sorted, cmp_entry);
    for (int k = 1; k < n; k++)
        if (!strcmp(w->sorted[k].name, w->sorted[k - 1].name)) {
            fy_log_error("%s: tensor %s is in two shards, %s and %s", w->path, w->sorted[k].name,
                         fy_st_path(w->files[w->sorted[k - 1].file]),
                         fy_st_path(w->files[w->sorted[k].file]));
            return FY_ERR_FORMAT;
        }
    return FY_OK;
}

const char *const fy_hf_aux_names[] = {
    "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", NULL,
};

/* The shard an index's weight_map entry names: a plain .safetensors file name in the
 * index's directory; NULL if it is not one. */
static const char *shard_name(const cJSON *e) {
    const char *s = cJSON_IsString(e) ? e->valuestring : NULL;
    return s && *s && !strchr(s, '/') && strcmp(s, ".") && strcmp(s, "..") &&
           fy_str_ends_with(s, ".safetensors") ? s : NULL;
}

static fy_status open_index(fy_weights *w, const char *index) {
    cJSON *root = NULL;
    FY_TRY(fy_json_read(index, "the weights index", &root));
    fy_status st = FY_ERR_FORMAT;
    const char **names = NULL;
    const cJSON *map = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    if (!cJSON_IsObject(map) || !map->child) {
        fy_log_error("%s: no weight_map object naming the tensors' shards", index);
        goto done;
    }
    int nmap = cJSON_GetArraySize(map), nnames = 0;
    names = calloc((size_t)nmap, sizeof *names);
    if (!names) { st = FY_ERR_NOMEM; goto done; }
    for (const cJSON *e = map->child; e; e = e->next) {
        if (!shard_name(e)) {
            fy_log_error("%s: weight_map[\"%s\"] is not a .safetensors file name in the index's "
                         "directory", index, e->string);
            goto done;
        }
        names[nnames++] = e->valuestring;
    }
    qsort(names, (size_t)nnames, sizeof *names, cmp_str);
    for (int i = 0; i < nnames; i++) {
        if (i && !strcmp(names[i], names[i - 1])) continue;
        char *path = dup_printf("%s/%s", w->dir, names[i]);
        if (!path) { st = FY_ERR_NOMEM; goto done; }
        if (!is_file(path)) {
            const char *tensor = "";
            for (const cJSON *e = map->child; e; e = e->next)
                if (!strcmp(e->valuestring, names[i])) { tensor = e->string; break; }
            fy_log_error("%s: shard %s (named for tensor %s) is missing", index, names[i], tensor);
            free(path);
            goto done;
        }
        fy_st_file *f;
        st = fy_st_open(path, &f);
        free(path);
        if (st != FY_OK || (st = add_file(w, f)) != FY_OK) goto done;
        st = FY_ERR_FORMAT;
    }
    /* every map entry where it says, every shard tensor in the map */
    for (const cJSON *e = map->child; e; e = e->next) {
        int k = 0;
        while (k < w->nfiles && !is_shard(w->files[k], e->valuestring)) k++;
        if (!fy_st_find(w->files[k], e->string)) {
            fy_log_error("%s: tensor %s is not in %s, the shard the index names for it", index,
                         e->string, e->valuestring);
            goto done;
        }
    }
    for (int k = 0; k < w->nfiles; k++)
        for (int j = 0; j < fy_st_count(w->files[k]); j++) {
            const char *name = fy_st_at(w->files[k], j)->name;
            const cJSON *e = cJSON_GetObjectItemCaseSensitive(map, name);
            if (!cJSON_IsString(e) || !is_shard(w->files[k], e->valuestring)) {
                fy_log_error("%s: tensor %s of %s is %s", index, name, fy_st_path(w->files[k]),
                             e ? "mapped to another shard" : "not in the index");
                goto done;
            }
        }
    st = FY_OK;
done:
    free(names);
    cJSON_Delete(root);
    return st;
}

/* A directory's or an index's config.json (required), or the one beside a bare file
 * (optional: one without a model_type is some other program's and is left alone). */
static fy_status read_config(fy_weights *w, const char *path, bool required) {
    if (!is_file(path)) {
        if (!required) return FY_OK;
        fy_log_error("%s: no %s saying what model the weights are", w->path, FY_HF_CONFIG_NAME);
        return FY_ERR_FORMAT;
    }
    FY_TRY(fy_json_read(path, "the model config", &w->config));
    if (!cJSON_IsObject(w->config)) {
        fy_log_error("%s: not a JSON object", path);
        return FY_ERR_FORMAT;
    }
    if (!required && !cJSON_IsString(cJSON_GetObjectItemCaseSensitive(w->config, "model_type"))) {
        fy_log_info("%s: no model_type: not a model config, ignored", path);
        cJSON_Delete(w->config);
        w->config = NULL;
        return FY_OK;
    }
    return (w->config_path = strdup(path)) ? FY_OK : FY_ERR_NOMEM;
}

/* A file's own config: ferry's single-file saves carry config.json in their metadata. */
static fy_status meta_config(fy_weights *w) {
    const char *text = fy_st_meta(w->files[0], "ferry.config");
    if (!text) return FY_OK;
    w->config = cJSON_Parse(text);
    if (!cJSON_IsObject(w->config)) {
        fy_log_error("%s: metadata ferry.config is not a JSON object", w->path);
        return FY_ERR_FORMAT;
    }
    char dup[160];
    if (fy_json_duplicate(w->config, dup, sizeof dup)) {
        fy_log_error("%s: metadata ferry.config holds key \"%s\" twice; JSON readers disagree on "
                     "which one counts: keep one", w->path, dup);
        return FY_ERR_FORMAT;
    }
    return (w->config_path = dup_printf("%s (ferry.config)", w->path, NULL)) ? FY_OK : FY_ERR_NOMEM;
}

static fy_status open_path(fy_weights *w, const char *path) {
    struct stat sb;
    if (stat(path, &sb) != 0) {
        fy_log_error("%s: %s", path, strerror(errno));
        return FY_ERR_IO;
    }
    char *buf = NULL;
    fy_status st;
    if (S_ISDIR(sb.st_mode)) {
        w->dir = strdup(path);
        if (!w->dir || !(buf = dup_printf("%s/%s", path, FY_HF_INDEX_NAME))) return FY_ERR_NOMEM;
        if (is_file(buf)) {
            st = open_index(w, buf);
        } else {
            free(buf);
            if (!(buf = dup_printf("%s/%s", path, FY_HF_SINGLE_NAME))) return FY_ERR_NOMEM;
            if (!is_file(buf)) {
                fy_log_error("%s: a model directory holds %s or %s; this one has neither (ferry "
                             "reads safetensors only)", path, FY_HF_SINGLE_NAME, FY_HF_INDEX_NAME);
                free(buf);
                return FY_ERR_FORMAT;
            }
            fy_st_file *f;
            st = fy_st_open(buf, &f);
            if (st == FY_OK) st = add_file(w, f);
        }
        free(buf);
        if (st != FY_OK || !(buf = dup_printf("%s/%s", path, FY_HF_CONFIG_NAME))) return st ? st : FY_ERR_NOMEM;
        st = read_config(w, buf, true);
        free(buf);
        return st;
    }
    const char *slash = strrchr(path, '/');
    w->dir = slash ? strndup(path, (size_t)(slash - path) + (slash == path)) : strdup(".");
    if (!w->dir) return FY_ERR_NOMEM;
    bool index = fy_str_ends_with(path, ".json");
    if (index) {
        st = open_index(w, path);
    } else {
        fy_st_file *f;
        st = fy_st_open(path, &f);
        if (st == FY_OK) st = add_file(w, f);
        if (st == FY_OK) st = meta_config(w);
    }
    if (st != FY_OK || w->config) return st;
    if (!(buf = dup_printf("%s/%s", w->dir, FY_HF_CONFIG_NAME))) return FY_ERR_NOMEM;
    st = read_config(w, buf, index);
    free(buf);
    return st;
}

fy_status fy_weights_open(const char *path, fy_weights **out) {
    *out = NULL;
    const unsigned errors = fy_log_error_count();
    fy_weights *w = calloc(1, sizeof *w);
    fy_status st = w && (w->path = strdup(path)) ? open_path(w, path) : FY_ERR_NOMEM;
    if (st == FY_OK) st = build_table(w);
    /* out of memory here, unless a callee said so already */
    if (st == FY_ERR_NOMEM && fy_log_error_count() == errors) fy_log_error("%s: out of memory", path);
    if (st != FY_OK) { fy_weights_close(w); return st; }
    *out = w;
    return FY_OK;
}

void fy_weights_close(fy_weights *w) {
    if (!w) return;
    for (int i = 0; i < w->nfiles; i++) fy_st_close(w->files[i]);
    free(w->files);
    free(w->all);
    free(w->sorted);
    cJSON_Delete(w->config);
    free(w->config_path);
    free(w->dir);
    free(w->path);
    free(w);
}

const char *fy_weights_path(const fy_weights *w) { return w->path; }
const char *fy_weights_dir(const fy_weights *w) { return w->dir; }
int fy_weights_count(const fy_weights *w) { return w->n; }

const fy_st_tensor *fy_weights_at(const fy_weights *w, int i, const fy_st_file **file) {
    FY_ASSERT(i >= 0 && i < w->n, "tensor index out of range");
    if (file) *file = w->files[w->all[i].file];
    return w->all[i].t;
}

const fy_st_tensor *fy_weights_find(const fy_weights *w, const char *name,
                                    const fy_st_file **file) {
    entry key = {.name = name};
    const entry *e = bsearch(&key, w->sorted, (size_t)w->n, sizeof *w->sorted, cmp_entry);
    if (e && file) *file = w->files[e->file];
    return e ? e->t : NULL;
}

const char *fy_weights_meta(const fy_weights *w, const char *key) {
    return w->nfiles ? fy_st_meta(w->files[0], key) : NULL;
}

const cJSON *fy_weights_config(const fy_weights *w) { return w->config; }
const char *fy_weights_config_path(const fy_weights *w) { return w->config_path; }

/* ---- the files of a path, unopened ------------------------------------------------------ */

/* dir/name to fn if it is a file. */
static fy_status file_to(fy_weights_file_fn fn, void *ctx, const char *dir, const char *name) {
    char *path = dup_printf("%s/%s", dir, name);
    if (!path) return FY_ERR_NOMEM;
    fy_status st = is_file(path) ? fn(ctx, path) : FY_OK;
    free(path);
    return st;
}

/* The index and the shards it names, to fn; an index that does not parse names only
 * itself. */
static fy_status index_files(fy_weights_file_fn fn, void *ctx, const char *dir, const char *index) {
    FY_TRY(fn(ctx, index));
    cJSON *root = fy_json_try_read(index);
    const cJSON *map = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    fy_status st = FY_OK;
    for (const cJSON *e = cJSON_IsObject(map) ? map->child : NULL; e && st == FY_OK; e = e->next)
        if (shard_name(e)) st = file_to(fn, ctx, dir, shard_name(e));
    cJSON_Delete(root);
    return st;
}

fy_status fy_weights_files(const char *path, fy_weights_file_fn fn, void *ctx) {
    struct stat sb;
    if (stat(path, &sb) != 0) return FY_OK;
    const char *slash = strrchr(path, '/');
    char *dir = S_ISDIR(sb.st_mode) ? strdup(path)
                : slash ? strndup(path, (size_t)(slash - path) + (slash == path)) : strdup(".");
    if (!dir) return FY_ERR_NOMEM;
    fy_status st = FY_OK;
    char *index = S_ISDIR(sb.st_mode) ? dup_printf("%s/%s", dir, FY_HF_INDEX_NAME) : NULL;
    if (S_ISDIR(sb.st_mode) && !index) st = FY_ERR_NOMEM;
    else if (index && is_file(index)) st = index_files(fn, ctx, dir, index);
    else if (index) st = file_to(fn, ctx, dir, FY_HF_SINGLE_NAME);
    else if (fy_str_ends_with(path, ".json")) st = index_files(fn, ctx, dir, path);
    else st = fn(ctx, path);
    free(index);
    if (st == FY_OK) st = file_to(fn, ctx, dir, FY_HF_CONFIG_NAME);
    for (int i = 0; fy_hf_aux_names[i] && st == FY_OK; i++)
        st = file_to(fn, ctx, dir, fy_hf_aux_names[i]);
    free(dir);
    return st;
}
