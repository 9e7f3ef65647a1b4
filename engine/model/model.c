/* model.c — the model interface's wrapper: the family registry (named models, weights
 * files), the checks every model passes at creation, the accessors, and the weights files,
 * read and written through the block specs (so every family gets the same checks: shapes,
 * missing tensors, dtypes, atomic writes). */
#include "engine/model/model_impl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/util.h"
#include "engine/model/gpt2.h"
#include "engine/model/llama.h"

#define ALIGN_ELEMS 16

/* ---- registry ---------------------------------------------------------------------- */

typedef struct family {
    const char *name;
    /* config.json model types it reads, NULL-terminated */
    const char *const *model_types;
    /* FY_ERR_UNSUPPORTED, not logged, if the name is not this family's */
    fy_status (*named)(const char *name, const fy_model_shape *over, fy_model **out);
    const char *(*names)(void);
    /* its named models whose widths a capacity table fills with layers (NULL: none) */
    const char *(*widths)(void);
    /* true if weights without a config hold this family's tensors (NULL: never) */
    bool (*recognise)(const fy_weights *w);
    fy_status (*from_weights)(const fy_weights *w, const fy_model_shape *hint, fy_model **out);
} family;

static const char *const gpt2_types[] = {"gpt2", NULL};
static const char *const llama_types[] = {"llama", "mistral", "qwen2", "qwen3", "gemma2",
                                           "gemma3_text", "gemma3", "phi3", NULL};

static const family families[] = {
    {"gpt2", gpt2_types, fy_gpt2_named, fy_gpt2_config_names, NULL, fy_gpt2_recognise,
     fy_gpt2_from_weights},
    {"llama", llama_types, fy_llama_named, fy_llama_config_names, fy_llama_width_names, NULL,
     fy_llama_from_weights},
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

const char *fy_model_width_names(void) {
    static char buf[1024];
    if (!buf[0])
        for (int i = 0; i < NFAMILIES; i++)
            if (families[i].widths)
                snprintf(buf + strlen(buf), sizeof buf - strlen(buf), "%s%s", buf[0] ? ", " : "",
                         families[i].widths());
    return buf;
}

void fy_model_print_families(FILE *fp) {
    for (int i = 0; i < NFAMILIES; i++) {
        fprintf(fp, "  %-6s %s\n         config.json model_type:", families[i].name,
                families[i].names());
        for (int k = 0; families[i].model_types[k]; k++) fprintf(fp, " %s", families[i].model_types[k]);
        fprintf(fp, "\n");
    }
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

/* The family of a config.json, or NULL (logged). */
static const family *family_of_config(const fy_weights *w) {
    const char *path = fy_weights_config_path(w);
    const cJSON *mt = cJSON_GetObjectItemCaseSensitive(fy_weights_config(w), "model_type");
    if (!cJSON_IsString(mt)) {
        fy_log_error("%s: no model_type saying what model this is", path);
        return NULL;
    }
    char known[128] = "";
    for (int i = 0; i < NFAMILIES; i++)
        for (int k = 0; families[i].model_types[k]; k++) {
            if (!strcmp(mt->valuestring, families[i].model_types[k])) return &families[i];
            snprintf(known + strlen(known), sizeof known - strlen(known), "%s%s",
                     known[0] ? ", " : "", families[i].model_types[k]);
        }
    fy_log_error("%s: model_type \"%s\" is not one ferry trains (%s)", path, mt->valuestring,
                 known);
    return NULL;
}

fy_status fy_model_from_weights(const fy_weights *w, const fy_model_shape *hint, fy_model **out) {
    *out = NULL;
    fy_model_shape none = {0};
    const family *fam = NULL;
    if (fy_weights_config(w)) {
        if (!(fam = family_of_config(w))) return FY_ERR_FORMAT;
    } else {
        for (int i = 0; i < NFAMILIES && !fam; i++)
            if (families[i].recognise && families[i].recognise(w)) fam = &families[i];
        if (!fam) {
            fy_log_error("%s: no config.json beside it and no GPT-2 tensors (wte.weight): ferry "
                         "cannot tell what model it holds", fy_weights_path(w));
            return FY_ERR_FORMAT;
        }
    }
    FY_TRY(fam->from_weights(w, hint ? hint : &none, out));
    fy_status st = fy_model_check_weights(*out, w);
    if (st != FY_OK) {
        fy_model_free(*out);
        *out = NULL;
        return st;
    }
    fy_model_warn_tied(*out, w);
    return FY_OK;
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

void fy_model_pack_last(fy_block_spec *blk) {
    FY_ASSERT(blk->ntensors >= 2, "a packed tensor follows another");
    fy_tensor_spec *t = &blk->tensors[blk->ntensors - 1], *prev = t - 1;
    FY_ASSERT(t->cols == prev->cols && t->decay == prev->decay && !t->transposed,
              "packed tensors share their columns and weight decay");
    t->packed = true;
}

void fy_model_place_tensors(fy_block_spec *blk) {
    size_t end = 0; /* where the previous tensor ends */
    for (int pass = 1; pass >= 0; pass--) {
        for (int i = 0; i < blk->ntensors; i++) {
            fy_tensor_spec *t = &blk->tensors[i];
            if ((int)t->decay != pass) continue;
            if (!t->packed) end = fy_round_up(end, ALIGN_ELEMS);
            t->offset = end;
            end += (size_t)t->alloc_rows * (size_t)t->cols;
        }
        end = fy_round_up(end, ALIGN_ELEMS);
        if (pass == 1) blk->decay_nelem = end;
    }
    blk->nelem = end;
}

void fy_model_view(const fy_block_spec *blk, fy_dtype dt, const void *base, float **fields, int n) {
    FY_ASSERT(blk->ntensors == n, "block kind does not match the view");
    const size_t es = fy_dtype_size(dt == FY_DTYPE_NONE ? FY_F32 : dt);
    for (int i = 0; i < n; i++)
        fields[i] = base ? (float *)((char *)base + blk->tensors[i].offset * es) : NULL;
}

static uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double uniform01(uint64_t *s) { return ((double)(splitmix64(s) >> 11) + 0.5) * 0x1p-53; }

void fy_model_fill_normal(float *p, size_t n, double std, uint64_t seed, int block, int tensor) {
    uint64_t st = seed ^ (0x5851f42d4c957f2dull * (uint64_t)(block + 1)) ^
                  (0x2545f4914f6cdd1dull * (uint64_t)(tensor + 1));
    for (size_t j = 0; j < n; j += 2) { /* Box-Muller, two normals per draw */
        double u1 = uniform01(&st), u2 = uniform01(&st);
        double r = sqrt(-2.0 * log(u1)), a = 2.0 * M_PI * u2;
        p[j] = (float)(std * r * cos(a));
        if (j + 1 < n) p[j + 1] = (float)(std * r * sin(a));
    }
}

/* A vocab_chunks head's classifier: its tensor at offset 0 (the others follow it). */
static const fy_tensor_spec *cls_tensor(const fy_block_spec *blk) {
    for (int i = 0; i < blk->ntensors; i++)
        if (blk->tensors[i].offset == 0) return &blk->tensors[i];
    FY_ASSERT(0, "a block has a tensor at its start");
    return NULL;
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
            if (blk->links[k] < 0 || blk->links[k] >= b || blocks[blk->links[k]].gather) {
                fy_log_error("model: block %s links to block %d; links point to earlier "
                             "blocks that are not row tables", blk->name, blk->links[k]);
                return FY_ERR_INVALID;
            }
        if (blk->vocab_chunks && (b != n - 1 || blk->nlinks || cls_tensor(blk)->cols < 2 ||
                                  cls_tensor(blk)->alloc_rows % 64)) {
            fy_log_error("model: block %s: only an unlinked head whose first tensor is its "
                         "classifier takes vocabulary chunks", blk->name);
            return FY_ERR_INVALID;
        }
        if ((blk->gather || blk->rows_fwd) && (b != 0 || blk->ntensors != 1 || blk->tensors[0].offset != 0)) {
            fy_log_error("model: block %s: only the embedding can be a row table, of one tensor",
                         blk->name);
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
    m->chunk = FY_MODEL_CHUNK;
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

void fy_model_chunk_view(const fy_block_spec *blk, fy_dtype dt, const void *base, int rows,
                         float **fields, int n) {
    FY_ASSERT(blk->ntensors == n && blk->vocab_chunks, "a chunk view of a vocab_chunks head");
    const size_t es = fy_dtype_size(dt == FY_DTYPE_NONE ? FY_F32 : dt);
    const fy_tensor_spec *cls = cls_tensor(blk);
    const size_t skip = (size_t)(cls->alloc_rows - rows) * cls->cols;
    for (int i = 0; i < n; i++) {
        const size_t off = blk->tensors[i].offset;
        fields[i] = base ? (float *)((char *)base + (off ? off - skip : 0) * es) : NULL;
    }
}

fy_lm_chunks fy_model_head_chunks(const fy_model *m, int B, int T, fy_dtype dt) {
    FY_ASSERT(m->iface->head_chunks, "a model without vocab_chunks heads has no chunks");
    return m->iface->head_chunks(m, B, T, dt == FY_DTYPE_NONE ? FY_F32 : dt);
}

void fy_model_chunk_ranges(const fy_model *m, int b, fy_lm_chunks c, int k, size_t *rows_off,
                           size_t *rows_nelem, size_t *tail_off, size_t *tail_nelem) {
    const fy_block_spec *blk = &m->blocks[b];
    const fy_tensor_spec *cls = cls_tensor(blk);
    const size_t C = (size_t)cls->cols, whole = (size_t)cls->alloc_rows * C;
    *rows_off = (size_t)fy_lm_chunk_v0(c, k) * C;
    *rows_nelem = (size_t)fy_lm_chunk_nv(c, k) * C;
    *tail_off = whole;
    *tail_nelem = blk->nelem - whole;
}

size_t fy_model_chunk_view_nelem(const fy_model *m, int b, fy_lm_chunks c) {
    const fy_tensor_spec *cls = cls_tensor(&m->blocks[b]);
    const size_t C = (size_t)cls->cols;
    return (size_t)c.rows * C + m->blocks[b].nelem - (size_t)cls->alloc_rows * C;
}

/* ---- accessors --------------------------------------------------------------------- */

const char *fy_model_family(const fy_model *m) { return m->iface->family; }
const char *fy_model_name(const fy_model *m) { return m->name; }
void fy_model_describe(const fy_model *m, char *buf, size_t cap) { m->iface->describe(m, buf, cap); }

void fy_model_signature(const fy_model *m, char *buf, size_t cap) {
    char d[FY_MODEL_SIGNATURE_MAX - 16];
    m->iface->describe(m, d, sizeof d);
    snprintf(buf, cap, "%s: %s", m->iface->family, d);
}

bool fy_model_same(const fy_model *a, const fy_model *b) {
    char sa[FY_MODEL_SIGNATURE_MAX], sb[FY_MODEL_SIGNATURE_MAX];
    fy_model_signature(a, sa, sizeof sa);
    fy_model_signature(b, sb, sizeof sb);
    return !strcmp(sa, sb);
}

int fy_model_nblocks(const fy_model *m) { return m->nblocks; }
int fy_model_layers(const fy_model *m) { return m->layers; }
int fy_model_vocab(const fy_model *m) { return m->vocab; }
int fy_model_chunk(const fy_model *m) { return m->chunk; }
int fy_model_head_dim(const fy_model *m) { return m->head_dim; }
void fy_model_set_chunk(fy_model *m, int positions) {
    FY_ASSERT(positions > 0, "a chunk holds at least one position");
    m->chunk = positions;
}

double fy_attn_pairs(int T, int window) {
    const double t = T, w = window;
    if (window <= 0 || window >= T) return t * (t + 1) / 2;
    return w * (w + 1) / 2 + (t - w) * w;
}
size_t fy_model_num_params(const fy_model *m) { return m->num_params; }

size_t fy_model_max_block_nelem(const fy_model *m) {
    size_t max = 0;
    for (int b = 0; b < m->nblocks; b++)
        if (m->blocks[b].nelem > max) max = m->blocks[b].nelem;
    return max;
}

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
