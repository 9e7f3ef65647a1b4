/* model.c — the model interface's wrapper: the family registry (named models, weights
 * files), the checks every model passes at creation, the accessors, and the weights files,
 * read and written through the block specs (so every family gets the same checks: shapes,
 * missing tensors, dtypes, atomic writes). */
#include "engine/model/model_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/util.h"
#include "engine/model/gpt2.h"

#define ALIGN_ELEMS 16

/* ---- registry ---------------------------------------------------------------------- */

typedef struct family {
    const char *name;
    /* FY_ERR_UNSUPPORTED, not logged, if the name is not this family's */
    fy_status (*named)(const char *name, const fy_model_shape *over, fy_model **out);
    const char *(*names)(void);
    /* true if the file holds this family's tensors */
    bool (*recognise)(const fy_st_file *f);
    fy_status (*from_file)(const fy_st_file *f, const fy_model_shape *hint, fy_model **out);
} family;

static const family families[] = {
    {"gpt2", fy_gpt2_named, fy_gpt2_config_names, fy_gpt2_recognise, fy_gpt2_from_file},
};
#define NFAMILIES (int)(sizeof families / sizeof families[0])

const char *fy_model_names(void) {
    static char buf[1024];
    if (!buf[0])
        for (int i = 0; i < NFAMILIES; i++)
            snprintf(buf + strlen(buf), sizeof buf - strlen(buf), "%s%s", i ? ", " : "",
                     families[i].names());
    return buf;
}

fy_status fy_model_named(const char *name, const fy_model_shape *over, fy_model **out) {
    *out = NULL;
    fy_model_shape none = {0};
    for (int i = 0; i < NFAMILIES; i++) {
        fy_status st = families[i].named(name, over ? over : &none, out);
        if (st != FY_ERR_UNSUPPORTED) return st;
    }
    fy_log_error("unknown model '%s' (known: %s)", name, fy_model_names());
    return FY_ERR_INVALID;
}

fy_status fy_model_from_file(const fy_st_file *f, const fy_model_shape *hint, fy_model **out) {
    *out = NULL;
    fy_model_shape none = {0};
    for (int i = 0; i < NFAMILIES; i++)
        if (families[i].recognise(f)) return families[i].from_file(f, hint ? hint : &none, out);
    /* no family's tensors: let the first family say what it looked for */
    return families[0].from_file(f, hint ? hint : &none, out);
}

/* ---- creation and checks ----------------------------------------------------------- */

void fy_model_add_tensor(fy_block_spec *blk, const char *name, int rows, int cols, bool decay,
                         bool transposed) {
    FY_ASSERT(blk->ntensors < FY_MODEL_MAX_TENSORS, "too many tensors in a block");
    fy_tensor_spec *t = &blk->tensors[blk->ntensors++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->rows = rows;
    t->alloc_rows = rows;
    t->cols = cols;
    t->decay = decay;
    t->transposed = transposed;
}

void fy_model_place_tensors(fy_block_spec *blk) {
    blk->nelem = 0;
    for (int pass = 1; pass >= 0; pass--) {
        for (int i = 0; i < blk->ntensors; i++) {
            fy_tensor_spec *t = &blk->tensors[i];
            if ((int)t->decay != pass) continue;
            t->offset = blk->nelem;
            blk->nelem += fy_round_up((size_t)t->alloc_rows * (size_t)t->cols, ALIGN_ELEMS);
        }
        if (pass == 1) blk->decay_nelem = blk->nelem;
    }
}

static const char *kind_names[FY_BLOCK_KINDS] = {"embed", "layer", "head"};
const char *fy_block_kind_name(fy_block_kind k) {
    return (unsigned)k < FY_BLOCK_KINDS ? kind_names[k] : "?";
}

/* The chain: one embedding first, one head last, layers between; links point back. */
static fy_status check_blocks(const fy_block_spec *blocks, int n) {
    if (n < 2 || blocks[0].kind != FY_BLOCK_EMBED || blocks[n - 1].kind != FY_BLOCK_HEAD) {
        fy_log_error("model: blocks must run from an embedding to a head");
        return FY_ERR_INVALID;
    }
    for (int b = 0; b < n; b++) {
        const fy_block_spec *blk = &blocks[b];
        if ((b > 0 && b < n - 1 && blk->kind != FY_BLOCK_LAYER) || blk->nelem == 0 ||
            blk->nlinks < 0 || blk->nlinks > FY_MODEL_MAX_LINKS) {
            fy_log_error("model: block %d (%s) is malformed", b, blk->name);
            return FY_ERR_INVALID;
        }
        for (int k = 0; k < blk->nlinks; k++)
            if (blk->links[k] < 0 || blk->links[k] >= b) {
                fy_log_error("model: block %s links to block %d; links point to earlier blocks",
                             blk->name, blk->links[k]);
                return FY_ERR_INVALID;
            }
    }
    return FY_OK;
}

fy_status fy_model_create(const fy_model_iface *iface, void *ctx, const char *name,
                          fy_block_spec *blocks, int nblocks, int vocab, size_t num_params,
                          fy_model **out) {
    *out = NULL;
    fy_status st = check_blocks(blocks, nblocks);
    fy_model *m = st == FY_OK ? calloc(1, sizeof *m) : NULL;
    if (st == FY_OK && !m) st = FY_ERR_NOMEM;
    if (st != FY_OK) {
        if (iface->free) iface->free(ctx);
        free(blocks);
        return st;
    }
    m->iface = iface;
    m->ctx = ctx;
    snprintf(m->name, sizeof m->name, "%s", name && *name ? name : iface->family);
    m->blocks = blocks;
    m->nblocks = nblocks;
    m->vocab = vocab;
    m->num_params = num_params;
    for (int b = 0; b < nblocks; b++) {
        fy_block_spec *blk = &blocks[b];
        if (blk->kind == FY_BLOCK_LAYER) m->layers++;
        if (blk->kind != FY_BLOCK_LAYER) blk->layer = -1;
        if (blk->kind == FY_BLOCK_LAYER) snprintf(blk->name, sizeof blk->name, "layer.%d", blk->layer);
        else snprintf(blk->name, sizeof blk->name, "%s", kind_names[blk->kind]);
    }
    *out = m;
    return FY_OK;
}

void fy_model_free(fy_model *m) {
    if (!m) return;
    if (m->iface->free) m->iface->free(m->ctx);
    free(m->blocks);
    free(m);
}

/* ---- accessors --------------------------------------------------------------------- */

const char *fy_model_family(const fy_model *m) { return m->iface->family; }
const char *fy_model_name(const fy_model *m) { return m->name; }
void fy_model_describe(const fy_model *m, char *buf, size_t cap) { m->iface->describe(m, buf, cap); }

void fy_model_signature(const fy_model *m, char *buf, size_t cap) {
    char d[256];
    m->iface->describe(m, d, sizeof d);
    snprintf(buf, cap, "%s: %s", m->iface->family, d);
}

bool fy_model_same(const fy_model *a, const fy_model *b) {
    char sa[320], sb[320];
    fy_model_signature(a, sa, sizeof sa);
    fy_model_signature(b, sb, sizeof sb);
    return !strcmp(sa, sb);
}

int fy_model_nblocks(const fy_model *m) { return m->nblocks; }
int fy_model_layers(const fy_model *m) { return m->layers; }
int fy_model_vocab(const fy_model *m) { return m->vocab; }
size_t fy_model_num_params(const fy_model *m) { return m->num_params; }

const fy_block_spec *fy_model_block(const fy_model *m, int b) {
    FY_ASSERT(b >= 0 && b < m->nblocks, "no such block");
    return &m->blocks[b];
}

fy_status fy_model_check_seq(const fy_model *m, int64_t T) { return m->iface->check_seq(m, T); }

void fy_model_acts(const fy_model *m, int b, int B, int T, fy_dtype dt, bool training,
                   fy_act_sizes *out) {
    memset(out, 0, sizeof *out);
    m->iface->acts(m, b, B, T, dt == FY_DTYPE_NONE ? FY_F32 : dt, training, out);
}

void fy_model_forward(const fy_model *m, int b, const fy_block_io *io, fy_stream *s) {
    FY_ASSERT(m->blocks[b].kind != FY_BLOCK_HEAD, "a head runs fy_model_loss");
    m->iface->forward(m, b, io, s);
}

void fy_model_backward(const fy_model *m, int b, const fy_block_io *io, fy_stream *s) {
    FY_ASSERT(m->blocks[b].kind != FY_BLOCK_HEAD, "a head's backward is fy_model_loss");
    m->iface->backward(m, b, io, s);
}

void fy_model_loss(const fy_model *m, int b, const fy_block_io *io, fy_stream *s) {
    FY_ASSERT(m->blocks[b].kind == FY_BLOCK_HEAD, "only a head computes the loss");
    m->iface->loss(m, b, io, s);
}

void fy_model_init_block(const fy_model *m, int b, uint64_t seed, float *host) {
    memset(host, 0, m->blocks[b].nelem * sizeof(float));
    m->iface->init_block(m, b, seed, host);
}

void fy_model_cost(const fy_model *m, int b, fy_pass pass, int B, int T, double es,
                   fy_cost *out) {
    memset(out, 0, sizeof *out);
    m->iface->cost(m, b, pass, B, T, es, out);
}

/* ---- weights files ------------------------------------------------------------------ */

/* The prefix the file uses: the first one under which the model's first tensor exists. */
static const char *prefix_of(const fy_model *m, const fy_st_file *f) {
    const char *first = m->blocks[0].tensors[0].name;
    const char *const *pre = m->iface->file_prefixes;
    for (int i = 0; pre && pre[i]; i++) {
        char full[160];
        snprintf(full, sizeof full, "%s%s", pre[i], first);
        if (fy_st_find(f, full)) return pre[i];
    }
    return "";
}

static const fy_st_tensor *find(const fy_st_file *f, const char *prefix, const char *name) {
    char full[160];
    snprintf(full, sizeof full, "%s%s", prefix, name);
    return fy_st_find(f, full);
}

/* Checks t against ts's file shape (vectors 1-D, transposed ones (in, out)). */
static fy_status check_shape(const fy_st_file *f, const char *pre, const fy_tensor_spec *ts,
                             const fy_st_tensor *t) {
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

fy_status fy_model_load(const fy_model *m, const fy_st_file *f, float *const *host) {
    const char *path = fy_st_path(f), *pre = prefix_of(m, f);
    float *tmp = NULL;
    size_t tmpcap = 0;
    fy_status st = FY_OK;
    for (int b = 0; b < m->nblocks && st == FY_OK; b++) {
        const fy_block_spec *blk = &m->blocks[b];
        memset(host[b], 0, blk->nelem * sizeof(float));
        for (int i = 0; i < blk->ntensors && st == FY_OK; i++) {
            const fy_tensor_spec *ts = &blk->tensors[i];
            const fy_st_tensor *t = find(f, pre, ts->name);
            if (!t) {
                fy_log_error("%s: tensor %s%s is missing", path, pre, ts->name);
                st = FY_ERR_FORMAT;
                break;
            }
            if ((st = check_shape(f, pre, ts, t)) != FY_OK) break;
            float *dst = host[b] + ts->offset;
            if (!ts->transposed) {
                st = fy_st_read_f32(f, t, dst);
                continue;
            }
            if (tmpcap < t->nelem) {
                free(tmp);
                tmp = malloc(t->nelem * sizeof(float));
                tmpcap = tmp ? t->nelem : 0;
                if (!tmp) { st = FY_ERR_NOMEM; break; }
            }
            if ((st = fy_st_read_f32(f, t, tmp)) != FY_OK) break;
            const int64_t r = ts->cols, c = ts->rows; /* file (in, out) -> ours (out, in) */
            for (int64_t i0 = 0; i0 < r; i0++)
                for (int64_t j = 0; j < c; j++) dst[j * r + i0] = tmp[i0 * c + j];
        }
    }
    free(tmp);
    return st;
}

fy_status fy_model_save(const fy_model *m, const char *path, float *const *host) {
    int n = 0;
    for (int b = 0; b < m->nblocks; b++) n += m->blocks[b].ntensors;
    fy_st_entry *e = calloc((size_t)n, sizeof *e);
    float **tbufs = calloc((size_t)n, sizeof *tbufs);
    fy_status st = FY_OK;
    if (!e || !tbufs) { st = FY_ERR_NOMEM; goto done; }
    int k = 0;
    for (int b = 0; b < m->nblocks; b++) {
        const fy_block_spec *blk = &m->blocks[b];
        for (int i = 0; i < blk->ntensors; i++, k++) {
            const fy_tensor_spec *ts = &blk->tensors[i];
            const float *src = host[b] + ts->offset;
            e[k].name = ts->name;
            e[k].dtype = FY_F32;
            if (ts->cols == 1) {
                e[k].ndim = 1;
                e[k].shape[0] = ts->rows;
                e[k].data = src;
            } else if (!ts->transposed) {
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
    enum { META_CAP = 32 };
    const char *meta[META_CAP + 1] = {"format", "pt"};
    char vals[META_CAP / 2][32];
    if (m->iface->file_meta) m->iface->file_meta(m, meta + 2, META_CAP - 2, vals);
    meta[META_CAP] = NULL;
    st = fy_st_write(path, e, n, meta);
done:
    if (tbufs) for (int i = 0; i < n; i++) free(tbufs[i]);
    free(tbufs);
    free(e);
    return st;
}
