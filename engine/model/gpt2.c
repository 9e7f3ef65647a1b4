/* gpt2.c — GPT-2 configs, the block layout, initialisation, and the per-block forward
 * and backward passes as straight sequences of kernel launches. */
#include "engine/model/gpt2.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/util.h"
#include "engine/device/kernels.h"

#define ALIGN_FLOATS 16

static const struct { const char *name; fy_gpt2_config cfg; } named[] = {
    {"gpt2-tiny", {256, 128, 64, 2, 4}},
    {"gpt2-mini", {256, 256, 128, 4, 4}},
    {"gpt2-small-byte", {256, 256, 384, 6, 6}},
    {"gpt2-124m", {50257, 1024, 768, 12, 12}},
    {"gpt2-350m", {50257, 1024, 1024, 24, 16}},
    {"gpt2-774m", {50257, 1024, 1280, 36, 20}},
    {"gpt2-1558m", {50257, 1024, 1600, 48, 25}},
};

fy_status fy_gpt2_config_named(const char *name, fy_gpt2_config *out) {
    for (size_t i = 0; i < sizeof named / sizeof named[0]; i++)
        if (!strcmp(name, named[i].name)) { *out = named[i].cfg; return FY_OK; }
    fy_log_error("unknown model '%s' (known: %s)", name, fy_gpt2_config_names());
    return FY_ERR_INVALID;
}

const char *fy_gpt2_config_names(void) {
    return "gpt2-tiny, gpt2-mini, gpt2-small-byte, gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1558m";
}

fy_status fy_gpt2_config_check(const fy_gpt2_config *c) {
    if (c->vocab <= 0 || c->max_seq <= 0 || c->channels <= 0 || c->layers <= 0 || c->heads <= 0) {
        fy_log_error("model shape must be positive: vocab %d, max_seq %d, channels %d, "
                     "layers %d, heads %d", c->vocab, c->max_seq, c->channels, c->layers, c->heads);
        return FY_ERR_INVALID;
    }
    if (c->channels % c->heads) {
        fy_log_error("heads (%d) must divide channels (%d)", c->heads, c->channels);
        return FY_ERR_INVALID;
    }
    return FY_OK;
}

fy_status fy_gpt2_check_seq(const fy_gpt2_config *cfg, int64_t T) {
    if (T > cfg->max_seq) {
        fy_log_error("--seq %lld is longer than the model's %d positions", (long long)T,
                     cfg->max_seq);
        return FY_ERR_INVALID;
    }
    return FY_OK;
}

size_t fy_gpt2_num_params(const fy_gpt2_config *c) {
    size_t C = (size_t)c->channels;
    return (size_t)c->vocab * C + (size_t)c->max_seq * C + 2 * C +
           (size_t)c->layers * (12 * C * C + 13 * C);
}

/* ---- layout ------------------------------------------------------------------------ */

static void add_tensor(fy_block_spec *blk, const char *name, int rows, int cols, int decay,
                       int conv1d) {
    FY_ASSERT(blk->ntensors < FY_GPT2_MAX_TENSORS, "too many tensors in a block");
    fy_tensor_spec *t = &blk->tensors[blk->ntensors++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->rows = rows;
    t->alloc_rows = rows;
    t->cols = cols;
    t->decay = decay;
    t->conv1d = conv1d;
}

/* Offsets: decayed tensors first (in table order), then the others. */
static void place_tensors(fy_block_spec *blk) {
    blk->nelem = 0;
    for (int pass = 1; pass >= 0; pass--) {
        for (int i = 0; i < blk->ntensors; i++) {
            fy_tensor_spec *t = &blk->tensors[i];
            if ((int)t->decay != pass) continue;
            t->offset = blk->nelem;
            blk->nelem += fy_round_up((size_t)t->alloc_rows * (size_t)t->cols, ALIGN_FLOATS);
        }
        if (pass == 1) blk->decay_nelem = blk->nelem;
    }
}

fy_status fy_gpt2_layout_new(const fy_gpt2_config *cfg, fy_gpt2_layout *out) {
    memset(out, 0, sizeof *out);
    FY_TRY(fy_gpt2_config_check(cfg));
    const int V = cfg->vocab, maxT = cfg->max_seq, C = cfg->channels, L = cfg->layers;
    out->cfg = *cfg;
    out->nblocks = L + 2;
    out->blocks = calloc((size_t)out->nblocks, sizeof *out->blocks);
    if (!out->blocks) return FY_ERR_NOMEM;
    char name[48];
#define ADD(field, hf, rows, cols, decay, conv1d) add_tensor(blk, hf, rows, cols, decay, conv1d);
    fy_block_spec *blk = &out->blocks[0];
    blk->kind = FY_BLOCK_EMBED;
    FY_GPT2_EMBED_PARAMS(ADD)
    blk->tensors[0].alloc_rows = fy_gpt2_vocab_padded(cfg); /* wte: see fy_gpt2_vocab_padded */
#undef ADD
#define ADD(field, hf, rows, cols, decay, conv1d) \
    snprintf(name, sizeof name, "h.%d.%s", l, hf); add_tensor(blk, name, rows, cols, decay, conv1d);
    for (int l = 0; l < L; l++) {
        blk = &out->blocks[1 + l];
        blk->kind = FY_BLOCK_LAYER;
        blk->layer = l;
        FY_GPT2_LAYER_PARAMS(ADD)
    }
#undef ADD
#define ADD(field, hf, rows, cols, decay, conv1d) add_tensor(blk, hf, rows, cols, decay, conv1d);
    blk = &out->blocks[L + 1];
    blk->kind = FY_BLOCK_HEAD;
    FY_GPT2_HEAD_PARAMS(ADD)
#undef ADD
    (void)name;
    for (int b = 0; b < out->nblocks; b++) place_tensors(&out->blocks[b]);
    return FY_OK;
}

void fy_gpt2_layout_free(fy_gpt2_layout *lay) {
    free(lay->blocks);
    lay->blocks = NULL;
}

static void view(const fy_block_spec *blk, fy_dtype dt, void *base, float **fields, int n) {
    FY_ASSERT(blk->ntensors == n, "block kind does not match the view");
    const size_t es = fy_dtype_size(dt == FY_DTYPE_NONE ? FY_F32 : dt);
    for (int i = 0; i < n; i++) fields[i] = (float *)((char *)base + blk->tensors[i].offset * es);
}

void fy_gpt2_layer_view(const fy_block_spec *blk, fy_dtype dt, void *base, fy_gpt2_layer_w *out) {
    view(blk, dt, base, (float **)out, sizeof *out / sizeof(float *));
}
void fy_gpt2_embed_view(const fy_block_spec *blk, fy_dtype dt, void *base, fy_gpt2_embed_w *out) {
    view(blk, dt, base, (float **)out, sizeof *out / sizeof(float *));
}
void fy_gpt2_head_view(const fy_block_spec *blk, fy_dtype dt, void *base, fy_gpt2_head_w *out) {
    view(blk, dt, base, (float **)out, sizeof *out / sizeof(float *));
}

/* ---- init ------------------------------------------------------------------------- */

static uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double uniform01(uint64_t *s) { return ((double)(splitmix64(s) >> 11) + 0.5) * 0x1p-53; }

void fy_gpt2_init_block(const fy_gpt2_config *cfg, const fy_block_spec *blk, uint64_t seed,
                        float *host) {
    memset(host, 0, blk->nelem * sizeof(float));
    int block_index = blk->kind == FY_BLOCK_EMBED ? 0
                      : blk->kind == FY_BLOCK_LAYER ? 1 + blk->layer : 1 + cfg->layers;
    for (int i = 0; i < blk->ntensors; i++) {
        const fy_tensor_spec *t = &blk->tensors[i];
        float *p = host + t->offset;
        size_t n = (size_t)t->rows * t->cols;
        bool gain = strstr(t->name, ".weight") != NULL; /* vectors: gains or biases */
        if (t->cols == 1) { /* biases 0, norm gains 1 */
            if (gain) for (size_t j = 0; j < n; j++) p[j] = 1.0f;
            continue;
        }
        double std = 0.02;
        if (strstr(t->name, "c_proj.weight")) std = 0.02 / sqrt(2.0 * cfg->layers);
        uint64_t st = seed ^ (0x5851f42d4c957f2dull * (uint64_t)(block_index + 1)) ^
                      (0x2545f4914f6cdd1dull * (uint64_t)(i + 1));
        for (size_t j = 0; j < n; j += 2) { /* Box-Muller, two normals per draw */
            double u1 = uniform01(&st), u2 = uniform01(&st);
            double r = sqrt(-2.0 * log(u1)), a = 2.0 * M_PI * u2;
            p[j] = (float)(std * r * cos(a));
            if (j + 1 < n) p[j + 1] = (float)(std * r * sin(a));
        }
    }
}

/* ---- activations ------------------------------------------------------------------ */

/* Field sizes in bytes: S fields in the storage type (es bytes), F fields fp32; each
 * field starts 64-byte aligned. */
#define ES_S es
#define ES_F sizeof(float)
#define SIZE_FIELD(field, size, type) total += fy_round_up((size) * ES_##type, 64);
#define BIND_FIELD(field, size, type) out->field = (float *)((char *)base + off); \
                                      off += fy_round_up((size) * ES_##type, 64);
#define DIMS const size_t N = (size_t)B * T, C = (size_t)cfg->channels, V = (size_t)cfg->vocab, \
                          Vp = (size_t)fy_gpt2_vocab_padded(cfg), NH = (size_t)cfg->heads, \
                          es = fy_dtype_size(dt == FY_DTYPE_NONE ? FY_F32 : dt); \
             (void)N; (void)C; (void)V; (void)Vp; (void)NH; (void)es

size_t fy_gpt2_layer_acts_nbytes(const fy_gpt2_config *cfg, int B, int T, fy_dtype dt) {
    DIMS; size_t total = 0; FY_GPT2_LAYER_ACTS(SIZE_FIELD) return total;
}
size_t fy_gpt2_head_acts_nbytes(const fy_gpt2_config *cfg, int B, int T, fy_dtype dt) {
    DIMS; size_t total = 0; FY_GPT2_HEAD_ACTS(SIZE_FIELD) return total;
}
size_t fy_gpt2_scratch_nbytes(const fy_gpt2_config *cfg, int B, int T, fy_dtype dt) {
    DIMS; size_t total = 0; FY_GPT2_SCRATCH(SIZE_FIELD) return total;
}
void fy_gpt2_layer_acts_bind(const fy_gpt2_config *cfg, int B, int T, fy_dtype dt, void *base,
                             fy_gpt2_layer_acts *out) {
    DIMS; size_t off = 0; FY_GPT2_LAYER_ACTS(BIND_FIELD)
}
void fy_gpt2_head_acts_bind(const fy_gpt2_config *cfg, int B, int T, fy_dtype dt, void *base,
                            fy_gpt2_head_acts *out) {
    DIMS; size_t off = 0; FY_GPT2_HEAD_ACTS(BIND_FIELD)
}
void fy_gpt2_scratch_bind(const fy_gpt2_config *cfg, int B, int T, fy_dtype dt, void *base,
                          fy_gpt2_scratch *out) {
    DIMS; size_t off = 0; FY_GPT2_SCRATCH(BIND_FIELD)
}

/* ---- forward ---------------------------------------------------------------------- */

void fy_gpt2_embed_fwd(const fy_gpt2_config *cfg, const fy_gpt2_embed_w *w,
                       const int32_t *tokens, float *x0, int B, int T, fy_stream *s) {
    fy_k_encoder_fwd(x0, tokens, w->wte, w->wpe, B, T, cfg->channels, cfg->vocab, s);
}

void fy_gpt2_layer_fwd(const fy_gpt2_config *cfg, const fy_gpt2_layer_w *w,
                       fy_gpt2_layer_acts *a, const float *x_in, fy_gpt2_scratch *sc,
                       int B, int T, fy_stream *s) {
    const int C = cfg->channels, NH = cfg->heads, N = B * T;
    const size_t NC = (size_t)N * C;
    fy_k_layernorm_fwd(a->ln1, a->ln1_mean, a->ln1_rstd, x_in, w->ln1w, w->ln1b, N, C, s);
    fy_k_matmul_fwd(a->qkv, a->ln1, w->qkvw, w->qkvb, N, C, 3 * C, s);
    fy_k_attention_fwd(a->atty, a->att, a->qkv, B, T, C, NH, s);
    fy_k_matmul_fwd(sc->proj, a->atty, w->attprojw, w->attprojb, N, C, C, s);
    fy_k_residual_fwd(a->res2, x_in, sc->proj, NC, s);
    fy_k_layernorm_fwd(a->ln2, a->ln2_mean, a->ln2_rstd, a->res2, w->ln2w, w->ln2b, N, C, s);
    fy_k_matmul_fwd(a->fch, a->ln2, w->fcw, w->fcb, N, C, 4 * C, s);
    fy_k_gelu_fwd(a->fch_gelu, a->fch, NC * 4, s);
    fy_k_matmul_fwd(sc->proj, a->fch_gelu, w->fcprojw, w->fcprojb, N, 4 * C, C, s);
    fy_k_residual_fwd(a->out, a->res2, sc->proj, NC, s);
}

/* The classifier over row chunks: logits, their loss and, with dloss != 0, their
 * gradient in place, which gives dlnf's rows and dwte's share before the next chunk
 * reuses the buffer. */
static void classifier(const fy_gpt2_config *cfg, const float *wte, float *dwte,
                       float *dwte32, fy_gpt2_head_acts *a, const int32_t *targets, float dloss,
                       float *dlnf, int N, fy_stream *s) {
    const int C = cfg->channels, V = cfg->vocab, Vp = fy_gpt2_vocab_padded(cfg);
    const size_t es = fy_dtype_size(fy_stream_dtype(s)); /* lnf and dlnf are stored so */
    const int rows = (int)fy_gpt2_logit_rows((size_t)N, (size_t)Vp, es);
    for (int r0 = 0; r0 < N; r0 += rows) {
        const int n = N - r0 < rows ? N - r0 : rows;
        const float *lnf = (const float *)((const char *)a->lnf + (size_t)r0 * C * es);
        fy_k_matmul_fwd(a->logits, lnf, wte, NULL, n, C, Vp, s); /* wte's Vp rows */
        fy_k_crossentropy(a->losses + r0, a->logits, targets + r0, n, V, Vp, dloss, s);
        float *dlnf_rows = (float *)((char *)dlnf + (size_t)r0 * C * es);
        if (dloss != 0.0f && dwte32)
            fy_k_matmul_bwd_f32acc(dlnf_rows, dwte32, a->logits, lnf, wte, n, C, Vp, s);
        else if (dloss != 0.0f)
            fy_k_matmul_bwd(dlnf_rows, dwte, NULL, a->logits, lnf, wte, n, C, Vp, s);
    }
}

void fy_gpt2_head_fwd(const fy_gpt2_config *cfg, const fy_gpt2_head_w *w, const float *wte,
                      const float *xL, fy_gpt2_head_acts *a, const int32_t *targets,
                      float *loss_out, int B, int T, fy_stream *s) {
    const int C = cfg->channels, N = B * T;
    fy_k_layernorm_fwd(a->lnf, a->lnf_mean, a->lnf_rstd, xL, w->lnfw, w->lnfb, N, C, s);
    classifier(cfg, wte, NULL, NULL, a, targets, 0.0f, NULL, N, s);
    fy_k_mean(loss_out, a->losses, (size_t)N, s);
}

/* ---- backward --------------------------------------------------------------------- */

void fy_gpt2_head_step(const fy_gpt2_config *cfg, const fy_gpt2_head_w *w,
                       fy_gpt2_head_w *g, const float *wte, float *dwte, float *dwte32,
                       const float *xL, fy_gpt2_head_acts *a, const int32_t *targets,
                       float dloss, float *loss_out, fy_gpt2_scratch *sc, int B, int T,
                       fy_stream *s) {
    const int C = cfg->channels, N = B * T;
    const size_t VC = (size_t)fy_gpt2_vocab_padded(cfg) * C;
    fy_k_layernorm_fwd(a->lnf, a->lnf_mean, a->lnf_rstd, xL, w->lnfw, w->lnfb, N, C, s);
    if (dwte32) fy_memset_async(s, dwte32, 0, VC * sizeof(float));
    classifier(cfg, wte, dwte, dwte32, a, targets, dloss, sc->dln, N, s);
    if (dwte32) fy_k_add_f32(dwte, dwte32, VC, s);
    fy_k_mean(loss_out, a->losses, (size_t)N, s);
    fy_memset_async(s, sc->dres, 0, (size_t)N * C * fy_dtype_size(fy_stream_dtype(s)));
    fy_k_layernorm_bwd(sc->dres, g->lnfw, g->lnfb, sc->dln, xL, w->lnfw, a->lnf_mean,
                       a->lnf_rstd, N, C, s);
}

void fy_gpt2_layer_bwd(const fy_gpt2_config *cfg, const fy_gpt2_layer_w *w,
                       fy_gpt2_layer_w *g, const fy_gpt2_layer_acts *a, const float *x_in,
                       fy_gpt2_scratch *sc, int B, int T, fy_stream *s) {
    const int C = cfg->channels, NH = cfg->heads, N = B * T;
    /* MLP: out = res2 + fcproj(gelu(fc(ln2(res2)))) */
    fy_k_matmul_bwd(sc->dfch_gelu, g->fcprojw, g->fcprojb, sc->dres, a->fch_gelu, w->fcprojw,
                    N, 4 * C, C, s);
    fy_k_gelu_bwd(sc->dfch, a->fch, sc->dfch_gelu, (size_t)N * 4 * C, s);
    fy_k_matmul_bwd(sc->dln, g->fcw, g->fcb, sc->dfch, a->ln2, w->fcw, N, C, 4 * C, s);
    fy_k_layernorm_bwd(sc->dres, g->ln2w, g->ln2b, sc->dln, a->res2, w->ln2w, a->ln2_mean,
                       a->ln2_rstd, N, C, s);
    /* attention: res2 = x_in + attproj(attn(qkv(ln1(x_in)))) */
    fy_k_matmul_bwd(sc->datty, g->attprojw, g->attprojb, sc->dres, a->atty, w->attprojw,
                    N, C, C, s);
    fy_k_attention_bwd(sc->dqkv, sc->datt, sc->datty, a->qkv, a->att, B, T, C, NH, s);
    fy_k_matmul_bwd(sc->dln, g->qkvw, g->qkvb, sc->dqkv, a->ln1, w->qkvw, N, C, 3 * C, s);
    fy_k_layernorm_bwd(sc->dres, g->ln1w, g->ln1b, sc->dln, x_in, w->ln1w, a->ln1_mean,
                       a->ln1_rstd, N, C, s);
}

void fy_gpt2_embed_bwd(const fy_gpt2_config *cfg, fy_gpt2_embed_w *g, const int32_t *tokens,
                       const fy_gpt2_scratch *sc, int B, int T, fy_stream *s) {
    fy_k_encoder_bwd(g->wte, g->wpe, sc->dres, tokens, B, T, cfg->channels, cfg->vocab, s);
}
