/* model_io.c — a model's weights in and out, through the block specs, for every family:
 * the check that a source holds exactly the model's tensors, loading block by block
 * (transposing the tensors files store (in, out)), and saving as one safetensors file or
 * as a Hugging Face directory (config.json, shards, index), atomically, one block in
 * memory at a time. (renameat2: _GNU_SOURCE, set by the build.) */
#include "engine/model/model_impl.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/core/util.h"
#include "engine/io/json_file.h"

/* Columns [c_lo, c_hi) of src (rows, cols), transposed: dst (c_hi - c_lo, rows). In 16 x 16
 * tiles, which stay in the L1 cache at every GPT-2 stride: a row-by-row loop strides one
 * side by a whole row per element and ran at 0.1-0.8 GB/s, most of a checkpoint's CPU
 * time; these tiles at 5-9 GB/s (4x4 SSE kernels were faster on some shapes and 3x slower
 * on others). */
static void transpose_cols(float *restrict dst, const float *restrict src, int64_t rows,
                           int64_t cols, int64_t c_lo, int64_t c_hi) {
    enum { TILE = 16 };
    for (int64_t r0 = 0; r0 < rows; r0 += TILE) {
        const int64_t r1 = r0 + TILE < rows ? r0 + TILE : rows;
        for (int64_t c0 = c_lo; c0 < c_hi; c0 += TILE) {
            const int64_t c1 = c0 + TILE < c_hi ? c0 + TILE : c_hi;
            for (int64_t c = c0; c < c1; c++)
                for (int64_t r = r0; r < r1; r++) dst[(c - c_lo) * rows + r] = src[r * cols + c];
        }
    }
}

static void transpose(float *restrict dst, const float *restrict src, int64_t rows, int64_t cols) {
    transpose_cols(dst, src, rows, cols, 0, cols);
}

/* Elements [first, first + n) of src (rows, cols) transposed (the (cols, rows) matrix, row
 * after row) into dst: whole rows by tiles, the partial ones at either end (a writer's
 * buffer ends anywhere) an element at a time. */
static void transpose_range(float *restrict dst, const float *restrict src, int64_t rows,
                            int64_t cols, size_t first, size_t n) {
    const size_t R = (size_t)rows, end = first + n;
    size_t k = first;
    for (; k < end && k % R; k++) dst[k - first] = src[(k % R) * (size_t)cols + k / R];
    if (end / R > k / R) {
        transpose_cols(dst + (k - first), src, rows, cols, (int64_t)(k / R), (int64_t)(end / R));
        k = end / R * R;
    }
    for (; k < end; k++) dst[k - first] = src[(k % R) * (size_t)cols + k / R];
}

/* ---- names --------------------------------------------------------------------------- */

/* The prefix the source uses: the first accepted one under which the model's first
 * tensor exists ("" if none does: the check then names what is missing). */
static const char *prefix_of(const fy_model *m, const fy_weights *w) {
    const char *first = m->blocks[0].tensors[0].name;
    const char *const *pre = m->iface->file_prefixes;
    char full[160];
    if (fy_weights_find(w, first, NULL)) return "";
    for (int i = 0; pre && pre[i]; i++) {
        snprintf(full, sizeof full, "%s%s", pre[i], first);
        if (fy_weights_find(w, full, NULL)) return pre[i];
    }
    return "";
}

static const fy_st_tensor *find(const fy_weights *w, const char *prefix, const char *name,
                                const fy_st_file **file) {
    char full[160];
    snprintf(full, sizeof full, "%s%s", prefix, name);
    return fy_weights_find(w, full, file);
}

/* ---- checking and loading ------------------------------------------------------------ */

/* t against ts's file shape (vectors 1-D, transposed ones (in, out)) and a dtype ferry
 * reads. */
static fy_status check_tensor(const fy_st_file *f, const char *pre, const fy_tensor_spec *ts,
                              const fy_st_tensor *t) {
    if (t->dtype != FY_F32 && t->dtype != FY_BF16 && t->dtype != FY_F16) {
        fy_log_error("%s: %s%s is %s; ferry reads F32, BF16 and F16", fy_st_path(f), pre,
                     ts->name, t->dtype_str);
        return FY_ERR_FORMAT;
    }
    int64_t r = ts->transposed ? ts->cols : ts->rows, c = ts->transposed ? ts->rows : ts->cols;
    bool ok = ts->cols == 1 ? (t->ndim == 1 && t->shape[0] == ts->rows)
                            : (t->ndim == 2 && t->shape[0] == r && t->shape[1] == c);
    if (ok) return FY_OK;
    char got[96] = "";
    for (int d = 0; d < t->ndim && d < 4; d++)
        snprintf(got + strlen(got), sizeof got - strlen(got), "%s%lld", d ? "," : "",
                 (long long)t->shape[d]);
    if (ts->cols == 1)
        fy_log_error("%s: %s%s has shape (%s), the model needs (%d)", fy_st_path(f), pre,
                     ts->name, got, ts->rows);
    else
        fy_log_error("%s: %s%s has shape (%s), the model needs (%lld,%lld)", fy_st_path(f), pre,
                     ts->name, got, (long long)r, (long long)c);
    return FY_ERR_FORMAT;
}

/* The source's tensor for ts, checked; NULL (logged) if missing or unfit. */
static const fy_st_tensor *find_checked(const fy_weights *w, const char *pre,
                                        const fy_tensor_spec *ts, const fy_st_file **f) {
    const fy_st_tensor *t = find(w, pre, ts->name, f);
    if (!t) {
        fy_log_error("%s: tensor %s%s is missing", fy_weights_path(w), pre, ts->name);
        return NULL;
    }
    return check_tensor(*f, pre, ts, t) == FY_OK ? t : NULL;
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

fy_status fy_model_check_weights(const fy_model *m, const fy_weights *w) {
    const char *pre = prefix_of(m, w);
    int n = 0;
    for (int b = 0; b < m->nblocks; b++) n += m->blocks[b].ntensors;
    char (*names)[160] = malloc((size_t)n * sizeof *names);
    char **sorted = malloc((size_t)n * sizeof *sorted);
    fy_status st = names && sorted ? FY_OK : FY_ERR_NOMEM;
    for (int b = 0, k = 0; b < m->nblocks && st == FY_OK; b++)
        for (int i = 0; i < m->blocks[b].ntensors && st == FY_OK; i++, k++) {
            const fy_tensor_spec *ts = &m->blocks[b].tensors[i];
            const fy_st_file *f;
            if (!find_checked(w, pre, ts, &f)) st = FY_ERR_FORMAT;
            snprintf(names[k], sizeof names[k], "%s%s", pre, ts->name);
            sorted[k] = names[k];
        }
    if (st == FY_OK) qsort(sorted, (size_t)n, sizeof *sorted, cmp_str);
    for (int i = 0; i < fy_weights_count(w) && st == FY_OK; i++) {
        const fy_st_file *f;
        const char *name = fy_weights_at(w, i, &f)->name;
        if (bsearch(&name, sorted, (size_t)n, sizeof *sorted, cmp_str)) continue;
        if (m->iface->ignored && m->iface->ignored(m, name)) continue;
        if (m->iface->tied_to && m->iface->tied_to(m, name)) continue; /* fy_model_warn_tied */
        char shape[FY_MODEL_SIGNATURE_MAX];
        fy_model_describe(m, shape, sizeof shape);
        fy_log_error("%s: tensor %s is not a parameter of the model (%s: %s)", fy_st_path(f), name,
                     m->iface->family, shape);
        st = FY_ERR_FORMAT;
    }
    if (st == FY_ERR_NOMEM) fy_log_error("out of host memory checking %s", fy_weights_path(w));
    free(names);
    free(sorted);
    return st;
}

fy_status fy_model_load_block(const fy_model *m, const fy_weights *w, int b, float *host) {
    FY_ASSERT(b >= 0 && b < m->nblocks, "no such block");
    const char *pre = prefix_of(m, w);
    const fy_block_spec *blk = &m->blocks[b];
    float *tmp = NULL;
    size_t tmpcap = 0;
    fy_status st = FY_OK;
    memset(host, 0, blk->nelem * sizeof(float));
    for (int i = 0; i < blk->ntensors && st == FY_OK; i++) {
        const fy_tensor_spec *ts = &blk->tensors[i];
        const fy_st_file *f;
        const fy_st_tensor *t = find_checked(w, pre, ts, &f);
        if (!t) {
            st = FY_ERR_FORMAT;
            break;
        }
        float *dst = host + ts->offset;
        if (!ts->transposed) {
            st = fy_st_read_f32(f, t, dst);
            fy_st_release(f, t);
            continue;
        }
        if (t->dtype == FY_F32 && (uintptr_t)t->data % _Alignof(float) == 0) {
            /* fp32 at a float's alignment (a ferry file's always): transposed from the map */
            transpose(dst, t->data, ts->cols, ts->rows);
            fy_st_release(f, t);
            continue;
        }
        if (tmpcap < t->nelem) {
            free(tmp);
            tmp = malloc(t->nelem * sizeof(float));
            tmpcap = tmp ? t->nelem : 0;
            if (!tmp) {
                fy_log_error("out of host memory reading %s%s", pre, ts->name);
                st = FY_ERR_NOMEM;
                break;
            }
        }
        if ((st = fy_st_read_f32(f, t, tmp)) != FY_OK) break;
        fy_st_release(f, t);
        transpose(dst, tmp, ts->cols, ts->rows); /* file (in, out) -> ours (out, in) */
    }
    free(tmp);
    return st;
}

fy_status fy_model_load(const fy_model *m, const fy_weights *w, float *const *host) {
    for (int b = 0; b < m->nblocks; b++) FY_TRY(fy_model_load_block(m, w, b, host[b]));
    return FY_OK;
}

void fy_model_warn_tied(const fy_model *m, const fy_weights *w) {
    if (!m->iface->tied_to) return;
    const char *pre = prefix_of(m, w);
    for (int i = 0; i < fy_weights_count(w); i++) {
        const fy_st_file *f, *ef;
        const fy_st_tensor *t = fy_weights_at(w, i, &f);
        const char *to = m->iface->tied_to(m, t->name);
        const fy_st_tensor *e = to ? find(w, pre, to, &ef) : NULL;
        if (!e) continue;
        bool same = t->dtype_str && e->dtype_str && !strcmp(t->dtype_str, e->dtype_str) &&
                    t->ndim == e->ndim && t->nbytes == e->nbytes;
        for (int d = 0; same && d < t->ndim; d++) same = t->shape[d] == e->shape[d];
        same = same && !memcmp(t->data, e->data, t->nbytes);
        const char *hint = same ? NULL : m->iface->untie_hint; /* what to do if it mattered */
        fy_log_warn("%s: %s is not read: the model ties its head to %s%s, as transformers does, "
                    "and the stored tensor %s%s%s%s", fy_st_path(f), t->name, pre, to,
                    same ? "is a copy of it" : "differs from it: its values are dropped",
                    hint ? " (" : "", hint ? hint : "", hint ? ")" : "");
    }
}

/* ---- saving: the tensors as written -------------------------------------------------- */

typedef struct out_tensor {
    int block, index;       /* the tensor spec */
    char name[160];
    fy_st_entry e;          /* data NULL: filled when written */
} out_tensor;

typedef struct saver {
    const fy_model *m;
    fy_dtype dtype;
    fy_block_source get;
    void *ctx;
    out_tensor *ts;
    int n;
    int cached;             /* the block in buf, or -1 */
    float *buf;             /* it: one of the slots */
    float *slot[2];         /* two blocks (the largest), block b in slot[b % 2]; slot[1]
                               NULL: fetched one at a time into slot[0] */
    bool own_slots;         /* allocated here (else fy_save_opts.block_buf) */
    struct ahead *ah;       /* fetching ahead: the fetcher's state (else NULL) */
    float *tbuf;            /* bf16: one transposed tensor, fp32 */
    const out_tensor *in_tbuf; /* the one it holds, or NULL */
    out_tensor *shard;      /* the shard being written: its first tensor */
} saver;

static fy_status saver_init(saver *sv, const fy_model *m, const fy_save_opts *o,
                            fy_block_source get, void *ctx, const char *prefix) {
    memset(sv, 0, sizeof *sv);
    sv->m = m;
    sv->dtype = o && o->dtype == FY_BF16 ? FY_BF16 : FY_F32;
    sv->get = get;
    sv->ctx = ctx;
    sv->cached = -1;
    size_t maxt = 0;
    for (int b = 0; b < m->nblocks; b++) {
        sv->n += m->blocks[b].ntensors;
        for (int i = 0; i < m->blocks[b].ntensors; i++) {
            const fy_tensor_spec *ts = &m->blocks[b].tensors[i];
            size_t ne = (size_t)ts->rows * ts->cols;
            if (ts->transposed && sv->dtype == FY_BF16 && ne > maxt) maxt = ne;
        }
    }
    sv->ts = calloc((size_t)sv->n, sizeof *sv->ts);
    const size_t nblock = fy_model_max_block_nelem(m);
    sv->own_slots = !(o && o->block_buf);
    sv->slot[0] = sv->own_slots ? malloc(nblock * sizeof(float)) : o->block_buf;
    sv->slot[1] = sv->own_slots ? malloc(nblock * sizeof(float)) : o->block_buf + nblock;
    sv->tbuf = maxt ? malloc(maxt * sizeof(float)) : NULL;
    if (!sv->ts || !sv->slot[0] || (maxt && !sv->tbuf)) {
        fy_log_error("out of host memory to save the model");
        return FY_ERR_NOMEM;
    }
    for (int b = 0, k = 0; b < m->nblocks; b++)
        for (int i = 0; i < m->blocks[b].ntensors; i++, k++) {
            const fy_tensor_spec *ts = &m->blocks[b].tensors[i];
            out_tensor *t = &sv->ts[k];
            t->block = b;
            t->index = i;
            snprintf(t->name, sizeof t->name, "%s%s", prefix, ts->name);
            t->e.name = t->name;
            t->e.dtype = sv->dtype;
            if (ts->cols == 1) {
                t->e.ndim = 1;
                t->e.shape[0] = ts->rows;
            } else {
                t->e.ndim = 2;
                t->e.shape[0] = ts->transposed ? ts->cols : ts->rows;
                t->e.shape[1] = ts->transposed ? ts->rows : ts->cols;
            }
        }
    return FY_OK;
}

static void saver_free(saver *sv) {
    free(sv->ts);
    if (sv->own_slots) free(sv->slot[0]);
    if (sv->own_slots) free(sv->slot[1]);
    free(sv->tbuf);
}

size_t fy_model_save_buf_nelem(const fy_model *m) { return 2 * fy_model_max_block_nelem(m); }

/* ---- saving: blocks fetched ahead ---------------------------------------------------- */

/* The file (or directory) is written on a thread of the save's own while the caller's
 * thread, the one a trainer is driven from (get runs there), fetches the blocks in order,
 * block b into slot[b % 2]: fetching block b + 1 overlaps writing block b. The writer
 * takes block b when its first tensor's turn comes, giving back the slot of every earlier
 * block (a block without tensors is skipped so too); the fetcher waits for a slot to be
 * given back. Either side stops the other: a failed get (logged by it) fails the writer's
 * next take, a writer that finished or failed ends the fetching. */
typedef struct ahead {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int in_slot[2];         /* the block each slot holds (-1: free) */
    fy_status got;          /* get's failure */
    bool done;              /* the writer has finished (or failed) */
    fy_status (*body)(void *);
    void *arg;
    fy_status st;           /* body's */
} ahead;

/* Block b into sv->buf: fetched here, or taken from the fetcher. */
static fy_status take_block(saver *sv, int b) {
    sv->cached = -1;
    sv->in_tbuf = NULL;
    ahead *ah = sv->ah;
    if (!ah) {
        FY_TRY(sv->get(sv->ctx, b, sv->slot[0]));
        sv->buf = sv->slot[0];
        sv->cached = b;
        return FY_OK;
    }
    pthread_mutex_lock(&ah->mu);
    for (int k = 0; k < 2; k++)
        if (ah->in_slot[k] >= 0 && ah->in_slot[k] < b) ah->in_slot[k] = -1;
    pthread_cond_broadcast(&ah->cv);
    while (ah->in_slot[b % 2] != b && ah->got == FY_OK) pthread_cond_wait(&ah->cv, &ah->mu);
    const fy_status st = ah->in_slot[b % 2] == b ? FY_OK : ah->got;
    pthread_mutex_unlock(&ah->mu);
    FY_TRY(st);
    sv->buf = sv->slot[b % 2];
    sv->cached = b;
    return FY_OK;
}

static void *ahead_writer(void *arg) {
    ahead *ah = arg;
    const fy_status st = ah->body(ah->arg);
    pthread_mutex_lock(&ah->mu);
    ah->st = st;
    ah->done = true;
    pthread_cond_broadcast(&ah->cv);
    pthread_mutex_unlock(&ah->mu);
    return NULL;
}

/* body(arg), which writes through fill, on a thread while this one fetches the blocks
 * (see above); body's status, or get's failure. With one slot, or no thread to be had,
 * body runs here and fill fetches as it goes. */
static fy_status run_ahead(saver *sv, fy_status (*body)(void *), void *arg) {
    ahead ah = {.in_slot = {-1, -1}, .body = body, .arg = arg};
    pthread_t writer;
    pthread_mutex_init(&ah.mu, NULL);
    pthread_cond_init(&ah.cv, NULL);
    sv->ah = &ah;
    if (!sv->slot[1] || pthread_create(&writer, NULL, ahead_writer, &ah) != 0) {
        sv->ah = NULL;
        ah.st = body(arg);
    } else {
        for (int b = 0; b < sv->m->nblocks; b++) {
            pthread_mutex_lock(&ah.mu);
            while (ah.in_slot[b % 2] >= 0 && !ah.done) pthread_cond_wait(&ah.cv, &ah.mu);
            const bool stop = ah.done;
            pthread_mutex_unlock(&ah.mu);
            if (stop) break;
            const fy_status st = sv->get(sv->ctx, b, sv->slot[b % 2]);
            pthread_mutex_lock(&ah.mu);
            if (st == FY_OK) ah.in_slot[b % 2] = b;
            else ah.got = st;
            pthread_cond_broadcast(&ah.cv);
            pthread_mutex_unlock(&ah.mu);
            if (st != FY_OK) break;
        }
        pthread_join(writer, NULL);
        sv->ah = NULL;
    }
    pthread_mutex_destroy(&ah.mu);
    pthread_cond_destroy(&ah.cv);
    return ah.got != FY_OK ? ah.got : ah.st;
}

static size_t out_nbytes(const out_tensor *t) {
    return (size_t)t->e.shape[0] * (t->e.ndim == 2 ? (size_t)t->e.shape[1] : 1) *
           fy_dtype_size(t->e.dtype);
}

/* fy_st_fill_fn: elements [first, first + n) of tensor i of the shard being written, from
 * its block (fetched once for its tensors, which are consecutive), transposed if the file
 * stores it so (the whole tensor, on its first range), in the dtype written. */
static fy_status fill(void *ctx, int i, size_t first, size_t n, void *dst) {
    saver *sv = ctx;
    const out_tensor *t = &sv->shard[i];
    if (sv->cached != t->block) FY_TRY(take_block(sv, t->block));
    const fy_tensor_spec *ts = &sv->m->blocks[t->block].tensors[t->index];
    const float *src = sv->buf + ts->offset;
    if (ts->transposed && sv->dtype == FY_F32) { /* ours (out, in) -> file (in, out) */
        transpose_range(dst, src, ts->rows, ts->cols, first, n);
        return FY_OK;
    }
    if (ts->transposed) { /* bf16: transposed whole in fp32, then rounded range by range */
        if (sv->in_tbuf != t) transpose(sv->tbuf, src, ts->rows, ts->cols);
        sv->in_tbuf = t;
        src = sv->tbuf;
    }
    if (sv->dtype == FY_BF16) fy_f32_to_bf16_n(dst, src + first, n);
    else memcpy(dst, src + first, n * sizeof(float));
    return FY_OK;
}

/* The config.json object of the model: from's other fields kept, the family's set. */
static cJSON *model_config(const fy_model *m, const fy_save_opts *o, fy_dtype dtype) {
    const cJSON *base = o && o->from ? fy_weights_config(o->from) : NULL;
    if (!m->iface->hf_config) return NULL;
    cJSON *cfg = base ? cJSON_Duplicate(base, true) : cJSON_CreateObject();
    if (!cfg) return NULL;
    m->iface->hf_config(m, cfg);
    cJSON_DeleteItemFromObjectCaseSensitive(cfg, "torch_dtype");
    cJSON_AddStringToObject(cfg, "torch_dtype", dtype == FY_BF16 ? "bfloat16" : "float32");
    return cfg;
}

/* ---- saving one file ------------------------------------------------------------------ */

typedef struct file_job {
    saver *sv;
    const char *path;
    const fy_st_entry *es;
    const char *const *meta;
    uint32_t *crc;
} file_job;

static fy_status write_file(void *arg) {
    const file_job *j = arg;
    return fy_st_write_fill_crc(j->path, j->es, j->sv->n, j->meta, fill, j->sv, j->crc);
}

static fy_status save_file(const fy_model *m, const char *path, const fy_save_opts *o,
                           fy_block_source get, void *ctx) {
    saver sv;
    fy_status st = saver_init(&sv, m, o, get, ctx, "");
    cJSON *cfg = st == FY_OK ? model_config(m, o, sv.dtype) : NULL;
    char *cfg_text = cfg ? cJSON_PrintUnformatted(cfg) : NULL;
    if (st == FY_OK && m->iface->hf_config && !cfg_text) {
        fy_log_error("out of host memory to save the model");
        st = FY_ERR_NOMEM;
    }
    if (st == FY_OK) {
        fy_st_entry *es = malloc((size_t)sv.n * sizeof *es);
        if (!es) {
            fy_log_error("out of host memory to save the model");
            st = FY_ERR_NOMEM;
        } else {
            for (int i = 0; i < sv.n; i++) es[i] = sv.ts[i].e;
            const char *meta[] = {"format", "pt", cfg_text ? "ferry.config" : NULL, cfg_text, NULL};
            sv.shard = sv.ts;
            file_job job = {&sv, path, es, meta, o ? o->crc32c : NULL};
            st = run_ahead(&sv, write_file, &job);
            free(es);
        }
    }
    free(cfg_text);
    cJSON_Delete(cfg);
    saver_free(&sv);
    return st;
}

/* ---- saving a directory ---------------------------------------------------------------- */

/* The file that marks a directory a save is writing: a directory beside the target named
 * like a save's temporary is removed as a dead writer's only if it holds this (a user's
 * "model.old.20231231" is not ferry's); removed once the directory is in place. */
#define PARTIAL_NAME ".ferry-partial"

/* What ferry writes into a model directory, and the tokenizer and generation files it
 * copies from the one it read (weights.h). */
static bool ours(const char *name) {
    if (!strcmp(name, FY_HF_CONFIG_NAME) || !strcmp(name, FY_HF_SINGLE_NAME) ||
        !strcmp(name, FY_HF_INDEX_NAME) || !strcmp(name, PARTIAL_NAME))
        return true;
    unsigned a, b;
    char tail[32];
    if (sscanf(name, "model-%5u-of-%5u.safetensor%31s", &a, &b, tail) == 3 && !strcmp(tail, "s"))
        return true;
    for (int i = 0; fy_hf_aux_names[i]; i++)
        if (!strcmp(name, fy_hf_aux_names[i])) return true;
    return false;
}

/* dir/name, malloc'd (NULL when out of memory). */
static char *join(const char *dir, const char *name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/%s", dir, name);
    return p;
}

static bool is_safetensors_path(const char *path) {
    size_t n = strlen(path), k = strlen(".safetensors");
    return n > k && !strcmp(path + n - k, ".safetensors");
}

/* The directory a --save path names, without trailing slashes (malloc'd); NULL (logged)
 * for a path no directory can be written beside: "/", ".", "..", or ending in them. */
static char *dir_target(const char *path) {
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/') n--;
    char *d = strndup(path, n);
    if (!d) return NULL;
    const char *slash = strrchr(d, '/'), *base = slash ? slash + 1 : d;
    if (!*base || !strcmp(base, ".") || !strcmp(base, "..") || !strcmp(d, "/")) {
        fy_log_error("--save %s: name the model directory itself (not \".\", \"..\" or \"/\")", path);
        free(d);
        return NULL;
    }
    return d;
}

/* The directory holding path (malloc'd): "." for a bare name. */
static char *parent_of(const char *path) {
    const char *slash = strrchr(path, '/');
    if (!slash) return strdup(".");
    return slash == path ? strdup("/") : strndup(path, (size_t)(slash - path));
}

fy_status fy_model_save_check(const char *path) {
    struct stat sb;
    if (is_safetensors_path(path)) {
        if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode)) {
            fy_log_error("--save %s is a directory; a .safetensors name is one file", path);
            return FY_ERR_INVALID;
        }
        char *dir = parent_of(path);
        if (!dir) return FY_ERR_NOMEM;
        bool ok = stat(dir, &sb) == 0 && S_ISDIR(sb.st_mode) && access(dir, W_OK) == 0;
        if (!ok) fy_log_error("--save %s: directory %s does not exist or is not writable", path, dir);
        free(dir);
        return ok ? FY_OK : FY_ERR_INVALID;
    }
    char *target = dir_target(path);
    if (!target) return FY_ERR_INVALID;
    fy_status st = FY_OK;
    if (lstat(target, &sb) != 0) {
        char *parent = parent_of(target);
        if (errno != ENOENT) {
            fy_log_error("--save %s: %s", path, strerror(errno));
            st = FY_ERR_INVALID;
        } else if (!parent || stat(parent, &sb) != 0 || !S_ISDIR(sb.st_mode) ||
                   access(parent, W_OK) != 0) {
            fy_log_error("--save %s: directory %s does not exist or is not writable", path,
                         parent ? parent : "?");
            st = FY_ERR_INVALID;
        }
        free(parent);
        free(target);
        return st;
    }
    if (S_ISLNK(sb.st_mode)) {
        fy_log_error("--save %s is a symbolic link; give the directory it points to (a link is "
                     "never replaced)", path);
        st = FY_ERR_INVALID;
    } else if (!S_ISDIR(sb.st_mode)) {
        fy_log_error("--save %s exists and is not a directory (a model directory is written "
                     "unless the name ends in .safetensors)", path);
        st = FY_ERR_INVALID;
    }
    DIR *d = st == FY_OK ? opendir(target) : NULL;
    if (st == FY_OK && !d) {
        fy_log_error("--save %s: %s", path, strerror(errno));
        st = FY_ERR_INVALID;
    }
    for (struct dirent *e; d && (e = readdir(d)) && st == FY_OK;) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..") || ours(e->d_name)) continue;
        fy_log_error("--save %s: the directory holds %s, which ferry does not write; it replaces "
                     "only a model directory (give a new path)", path, e->d_name);
        st = FY_ERR_INVALID;
    }
    if (d) closedir(d);
    char *parent = st == FY_OK ? parent_of(target) : NULL;
    if (st == FY_OK && (!parent || access(parent, W_OK) != 0)) { /* the new one is made beside */
        fy_log_error("--save %s: directory %s is not writable", path, parent ? parent : "?");
        st = FY_ERR_INVALID;
    }
    free(parent);
    free(target);
    return st;
}

/* Removes a directory ferry wrote: the files it writes (and their temporary names),
 * then the directory if that left it empty. A symbolic link is not followed. */
static void remove_ours(const char *dir) {
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
    if (!d) {
        if (fd >= 0) close(fd);
        return;
    }
    for (struct dirent *e; (e = readdir(d));)
        if (ours(e->d_name) || strstr(e->d_name, ".tmp")) unlinkat(dirfd(d), e->d_name, 0);
    closedir(d);
    rmdir(dir);
}

/* Directories an interrupted save left beside target (target.tmp.PID of a process no
 * longer running, or this one's, still marked PARTIAL_NAME): removed as remove_ours does.
 * Anything else so named is left alone, a dead save's target.old.PID (the directory it
 * was replacing, whole) too. */
static void remove_stale(const char *target) {
    char *parent = parent_of(target);
    const char *slash = strrchr(target, '/'), *base = slash ? slash + 1 : target;
    DIR *d = parent ? opendir(parent) : NULL;
    for (struct dirent *e; d && (e = readdir(d));) {
        if (!fy_left_by_dead_writer(e->d_name, base, ".tmp.")) continue;
        char *p = join(parent, e->d_name), *mark = p ? join(p, PARTIAL_NAME) : NULL;
        struct stat sb;
        if (mark && lstat(mark, &sb) == 0 && S_ISREG(sb.st_mode)) remove_ours(p);
        free(mark);
        free(p);
    }
    if (d) closedir(d);
    free(parent);
}

static fy_status copy_file(const char *from, const char *to) {
    int in = open(from, O_RDONLY | O_CLOEXEC), out = -1;
    fy_status st = FY_ERR_IO;
    if (in < 0) goto done;
    out = open(to, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (out < 0) goto done;
    char buf[1 << 16];
    for (ssize_t n; (n = read(in, buf, sizeof buf)) != 0;) {
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) goto done;
        for (ssize_t off = 0; off < n;) {
            ssize_t k = write(out, buf + off, (size_t)(n - off));
            if (k < 0 && errno == EINTR) continue;
            if (k <= 0) goto done;
            off += k;
        }
    }
    if (fsync(out) != 0) goto done;
    st = FY_OK;
done:
    if (st != FY_OK) fy_log_error("cannot copy %s to %s: %s", from, to, strerror(errno));
    if (in >= 0) close(in);
    if (out >= 0 && close(out) != 0 && st == FY_OK) {
        fy_log_error("cannot close %s: %s", to, strerror(errno));
        st = FY_ERR_IO;
    }
    return st;
}

/* Shards (in tensor order, each at most shard_nbytes unless one tensor is larger),
 * index, config and the copied files into dir. */
static fy_status write_dir(saver *sv, const char *dir, const fy_save_opts *o) {
    const size_t cap = o && o->shard_nbytes ? o->shard_nbytes : FY_SAVE_SHARD_DEFAULT;
    int *first = malloc((size_t)(sv->n + 1) * sizeof *first), nshards = 0;
    fy_st_entry *es = malloc((size_t)sv->n * sizeof *es);
    cJSON *index = NULL, *cfg = NULL;
    char *path = NULL, name[64];
    fy_status st = first && es ? FY_OK : FY_ERR_NOMEM;
    size_t total = 0, cur = 0; /* all shards', the current shard's */
    for (int i = 0; i < sv->n && st == FY_OK; i++) {
        size_t nb = out_nbytes(&sv->ts[i]);
        if (!nshards || (cur > 0 && cur + nb > cap)) {
            first[nshards++] = i;
            cur = 0;
        }
        cur += nb;
        total += nb;
    }
    if (st == FY_OK) first[nshards] = sv->n;
    if (st == FY_OK && nshards > 1) {
        index = cJSON_CreateObject();
        cJSON *meta = index ? cJSON_AddObjectToObject(index, "metadata") : NULL;
        if (!meta || !cJSON_AddNumberToObject(meta, "total_size", (double)total) ||
            !cJSON_AddObjectToObject(index, "weight_map"))
            st = FY_ERR_NOMEM;
    }
    for (int s = 0; s < nshards && st == FY_OK; s++) {
        if (nshards == 1) snprintf(name, sizeof name, "%s", FY_HF_SINGLE_NAME);
        else snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", s + 1, nshards);
        free(path);
        if (!(path = join(dir, name))) { st = FY_ERR_NOMEM; break; }
        int n = first[s + 1] - first[s];
        for (int k = 0; k < n; k++) es[k] = sv->ts[first[s] + k].e;
        sv->shard = &sv->ts[first[s]];
        const char *meta[] = {"format", "pt", NULL};
        st = fy_st_write_fill(path, es, n, meta, fill, sv);
        cJSON *map = index ? cJSON_GetObjectItemCaseSensitive(index, "weight_map") : NULL;
        for (int k = 0; k < n && map && st == FY_OK; k++)
            if (!cJSON_AddStringToObject(map, sv->ts[first[s] + k].name, name)) st = FY_ERR_NOMEM;
    }
    free(path);
    path = NULL;
    if (st == FY_OK && index) {
        if (!(path = join(dir, FY_HF_INDEX_NAME))) st = FY_ERR_NOMEM;
        else st = fy_json_write(path, "the weights index", index);
        free(path);
        path = NULL;
    }
    if (st == FY_OK && !(cfg = model_config(sv->m, o, sv->dtype))) st = FY_ERR_NOMEM;
    if (st == FY_OK) {
        if (!(path = join(dir, FY_HF_CONFIG_NAME))) st = FY_ERR_NOMEM;
        else st = fy_json_write(path, "the model config", cfg);
        free(path);
        path = NULL;
    }
    const char *from = o && o->from ? fy_weights_dir(o->from) : NULL;
    for (int i = 0; from && fy_hf_aux_names[i] && st == FY_OK; i++) {
        char *src = join(from, fy_hf_aux_names[i]);
        struct stat sb;
        path = join(dir, fy_hf_aux_names[i]);
        if (!src || !path) st = FY_ERR_NOMEM;
        else if (stat(src, &sb) == 0 && S_ISREG(sb.st_mode)) st = copy_file(src, path);
        free(src);
        free(path);
        path = NULL;
    }
    if (st == FY_ERR_NOMEM) fy_log_error("out of host memory writing %s", dir);
    cJSON_Delete(index);
    cJSON_Delete(cfg);
    free(first);
    free(es);
    return st;
}

typedef struct dir_job {
    saver *sv;
    const char *dir;
    const fy_save_opts *o;
} dir_job;

static fy_status write_dir_job(void *arg) {
    const dir_job *j = arg;
    return write_dir(j->sv, j->dir, j->o);
}

/* The written directory tmp in place of target: renamed if target is new, else
 * exchanged with it atomically (or, where the filesystem cannot, the old one moved to
 * `old` first), and the old one removed. */
static fy_status swap_in(const char *tmp, const char *target, const char *old) {
    struct stat sb;
    if (lstat(target, &sb) != 0) {
        if (rename(tmp, target) == 0) return FY_OK;
        fy_log_error("cannot rename %s to %s: %s", tmp, target, strerror(errno));
        remove_ours(tmp);
        return FY_ERR_IO;
    }
    if (renameat2(AT_FDCWD, tmp, AT_FDCWD, target, RENAME_EXCHANGE) == 0) {
        remove_ours(tmp); /* now the old directory */
        return FY_OK;
    }
    if (rename(target, old) != 0 || rename(tmp, target) != 0) {
        fy_log_error("cannot replace %s with %s: %s", target, tmp, strerror(errno));
        if (lstat(target, &sb) != 0) rename(old, target);
        remove_ours(tmp);
        return FY_ERR_IO;
    }
    remove_ours(old);
    return FY_OK;
}

static fy_status save_dir(const fy_model *m, const char *path, const fy_save_opts *o,
                          fy_block_source get, void *ctx) {
    if (!m->iface->hf_config) {
        fy_log_error("--save %s: %s models have no Hugging Face config; save to a .safetensors "
                     "file", path, m->iface->family);
        return FY_ERR_INVALID;
    }
    FY_TRY(fy_model_save_check(path));
    char *target = dir_target(path), *parent = target ? parent_of(target) : NULL;
    char tmp[4200], old[4200];
    if (!target || !parent || strlen(target) > 4096) {
        free(target);
        free(parent);
        fy_log_error("--save %s: out of memory or too long a path", path);
        return FY_ERR_INVALID;
    }
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", target, (long)getpid());
    snprintf(old, sizeof old, "%s.old.%ld", target, (long)getpid());
    remove_stale(target);
    fy_status st = FY_OK;
    char *mark = NULL;
    if (mkdir(tmp, 0755) != 0) {
        fy_log_error("cannot create %s: %s", tmp, strerror(errno));
        st = FY_ERR_IO;
    } else if (!(mark = join(tmp, PARTIAL_NAME))) {
        st = FY_ERR_NOMEM;
    } else {
        const int fd = open(mark, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
        if (fd < 0 || close(fd) != 0) {
            fy_log_error("cannot create %s: %s", mark, strerror(errno));
            st = FY_ERR_IO;
            remove_ours(tmp);
        }
    }
    free(mark);
    saver sv;
    if (st == FY_OK) {
        st = saver_init(&sv, m, o, get, ctx, m->iface->dir_prefix ? m->iface->dir_prefix : "");
        dir_job job = {&sv, tmp, o};
        if (st == FY_OK) st = run_ahead(&sv, write_dir_job, &job);
        saver_free(&sv);
        if (st == FY_OK) st = fy_fsync_dir(tmp);
        if (st != FY_OK) remove_ours(tmp);
    }
    if (st == FY_OK) st = swap_in(tmp, target, old);
    if (st == FY_OK && (mark = join(target, PARTIAL_NAME))) { /* in place: no longer partial */
        unlink(mark);
        free(mark);
        st = fy_fsync_dir(target);
    }
    if (st == FY_OK) st = fy_fsync_dir(parent);
    free(target);
    free(parent);
    return st;
}

fy_status fy_model_save(const fy_model *m, const char *path, const fy_save_opts *o,
                        fy_block_source get, void *ctx) {
    return is_safetensors_path(path) ? save_file(m, path, o, get, ctx)
                                     : save_dir(m, path, o, get, ctx);
}

typedef struct host_src { const fy_model *m; float *const *host; } host_src;

static fy_status from_host(void *ctx, int b, float *out) {
    const host_src *h = ctx;
    memcpy(out, h->host[b], h->m->blocks[b].nelem * sizeof(float));
    return FY_OK;
}

fy_status fy_model_save_host(const fy_model *m, const char *path, const fy_save_opts *o,
                             float *const *host) {
    host_src h = {m, host};
    return fy_model_save(m, path, o, from_host, &h);
}
