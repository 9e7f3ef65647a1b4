/* kernels.c — kernel launchers: each packs its arguments into a fy_op in launcher order,
 * checked against the op table (ops.h), and hands it to the stream's backend. The
 * unpacking side is the backend's (cpu/cpu_kernels.c, cuda/). */
#include "engine/device/kernels.h"

#include <math.h>
#include <string.h>

#include "engine/device/device_impl.h"

/* The tensor, integer and float arguments as arrays with their counts. */
#define PTRS(...) (void *const[]){__VA_ARGS__}, (int)(sizeof((void *const[]){__VA_ARGS__}) / sizeof(void *))
#define INTS(...) (const int64_t[]){__VA_ARGS__}, (int)(sizeof((const int64_t[]){__VA_ARGS__}) / sizeof(int64_t))
#define FLTS(...) (const float[]){__VA_ARGS__}, (int)(sizeof((const float[]){__VA_ARGS__}) / sizeof(float))
#define NO_FLTS NULL, 0
#define P(x) ((void *)(x))

/* Every kernel's op carries the stream's storage type. */
static void launch(fy_stream *s, fy_op_kind kind, void *const *p, int np, const int64_t *i,
                   int ni, const float *f, int nf) {
    fy_op op;
    fy_op_pack(&op, kind, p, np, i, ni, f, nf);
    op.dt = s->dtype;
    s->dev->iface->launch(s, &op);
}

void fy_k_encoder_fwd(float *out, const int32_t *tokens, const float *wte, const float *wpe,
                      const int32_t *docs, int B, int T, int C, int V, float scale,
                      fy_stream *s) {
    launch(s, FY_OP_ENCODER_FWD, PTRS(out, P(tokens), P(wte), P(wpe), P(docs)), INTS(B, T, C, V),
           FLTS(scale));
}

void fy_k_encoder_bwd(float *dwte, float *dwpe, const float *dout, const int32_t *tokens,
                      const int32_t *docs, int B, int T, int C, int V, float scale,
                      fy_stream *s) {
    launch(s, FY_OP_ENCODER_BWD, PTRS(dwte, dwpe, P(dout), P(tokens), P(docs)), INTS(B, T, C, V),
           FLTS(scale));
}

void fy_k_layernorm_fwd(float *out, float *mean, float *rstd, const float *inp,
                        const float *w, const float *b, int N, int C, fy_stream *s) {
    launch(s, FY_OP_LAYERNORM_FWD, PTRS(out, mean, rstd, P(inp), P(w), P(b)), INTS(N, C), NO_FLTS);
}

void fy_k_layernorm_bwd(float *dinp, float *dw, float *db, const float *dout,
                        const float *inp, const float *w, const float *mean,
                        const float *rstd, int N, int C, fy_stream *s) {
    launch(s, FY_OP_LAYERNORM_BWD, PTRS(dinp, dw, db, P(dout), P(inp), P(w), P(mean), P(rstd)),
           INTS(N, C), NO_FLTS);
}

void fy_k_rmsnorm_fwd(float *out, float *rstd, const float *inp, const float *w, int N, int C,
                      float eps, float offset, fy_stream *s) {
    launch(s, FY_OP_RMSNORM_FWD, PTRS(out, rstd, P(inp), P(w)), INTS(N, C), FLTS(eps, offset));
}

void fy_k_rmsnorm_bwd(float *dinp, float *dw, const float *dout, const float *inp,
                      const float *w, const float *rstd, int N, int C, float offset,
                      fy_stream *s) {
    launch(s, FY_OP_RMSNORM_BWD, PTRS(dinp, dw, P(dout), P(inp), P(w), P(rstd)), INTS(N, C),
           FLTS(offset));
}

void fy_k_qk_norm_fwd(float *out, float *rstd, const float *inp, const float *wq,
                      const float *wk, int N, int NH, int NKV, int hd, float eps, float offset,
                      fy_stream *s) {
    FY_ASSERT(NH > 0 && NKV > 0 && hd > 0, "qk_norm: heads and a head size, all positive");
    launch(s, FY_OP_QK_NORM_FWD, PTRS(out, rstd, P(inp), P(wq), P(wk)), INTS(N, NH, NKV, hd),
           FLTS(eps, offset));
}

void fy_k_qk_norm_bwd(float *dinp, float *dwq, float *dwk, const float *dout, const float *inp,
                      const float *wq, const float *wk, const float *rstd, int N, int NH,
                      int NKV, int hd, float offset, fy_stream *s) {
    FY_ASSERT(NH > 0 && NKV > 0 && hd > 0, "qk_norm: heads and a head size, all positive");
    launch(s, FY_OP_QK_NORM_BWD, PTRS(dinp, dwq, dwk, P(dout), P(inp), P(wq), P(wk), P(rstd)),
           INTS(N, NH, NKV, hd), FLTS(offset));
}

void fy_k_matmul_fwd(float *out, const float *inp, const float *w, const float *bias,
                     int N, int C, int OC, fy_stream *s) {
    launch(s, FY_OP_MATMUL_FWD, PTRS(out, P(inp), P(w), P(bias)), INTS(N, C, OC), NO_FLTS);
}

void fy_k_matmul_bwd(float *dinp, float *dw, float *dbias, const float *dout,
                     const float *inp, const float *w, int N, int C, int OC, fy_stream *s) {
    launch(s, FY_OP_MATMUL_BWD, PTRS(dinp, dw, dbias, P(dout), P(inp), P(w)), INTS(N, C, OC),
           NO_FLTS);
}

void fy_k_matmul_bwd_dx32(float *dinp32, float *dw, const float *dout, const float *inp,
                          const float *w, int N, int C, int OC, fy_stream *s) {
    launch(s, FY_OP_MATMUL_BWD_DX32, PTRS(dinp32, dw, P(dout), P(inp), P(w)), INTS(N, C, OC),
           NO_FLTS);
}

void fy_k_add_f32(float *dst, const float *src, size_t n, fy_stream *s) {
    launch(s, FY_OP_ADD_F32, PTRS(dst, P(src)), INTS((int64_t)n), NO_FLTS);
}

int fy_attn_max_head(fy_dev_kind kind, fy_dtype dt) {
    return kind == FY_DEV_CUDA && dt != FY_BF16 ? 128 : FY_ATTN_MAX_HEAD; /* cuda_attention.cuh */
}

static void attn_check(int NH, int NKV, int hd, const fy_attn *a) {
    FY_ASSERT(NKV > 0 && NH % NKV == 0, "attention: key/value heads must divide the heads");
    FY_ASSERT(hd > 0 && a->window >= 0, "attention: a positive head size, a window of >= 0");
    FY_ASSERT(a->softcap >= 0.0f && isfinite(a->softcap), "attention: a soft cap of 0 (none) or more");
}

void fy_k_attention_fwd(float *out, float *lse, const float *qkv, int B, int T, int NH, int NKV,
                        int hd, const fy_attn *a, fy_stream *s) {
    attn_check(NH, NKV, hd, a);
    launch(s, FY_OP_ATTENTION_FWD, PTRS(out, lse, P(qkv), P(a->docs)),
           INTS(B, T, NH, NKV, hd, a->window), FLTS(a->scale, a->softcap));
}

void fy_k_attention_bwd(float *dqkv, float *delta, const float *dout, const float *qkv,
                        const float *out, const float *lse, int B, int T, int NH, int NKV,
                        int hd, const fy_attn *a, fy_stream *s) {
    attn_check(NH, NKV, hd, a);
    launch(s, FY_OP_ATTENTION_BWD, PTRS(dqkv, delta, P(dout), P(qkv), P(out), P(lse), P(a->docs)),
           INTS(B, T, NH, NKV, hd, a->window), FLTS(a->scale, a->softcap));
}

/* rot_dim 0 and attn_factor 0 are resolved here (all hd channels, 1), so the backends
 * read the values they use (device_impl.h's fy_op_rope). */
void fy_k_rope(float *qkv, const int32_t *docs, int B, int T, int NH, int NKV, int hd,
               bool inverse, const fy_rope *r, fy_stream *s) {
    const int d = r->rot_dim ? r->rot_dim : hd;
    const float af = r->attn_factor != 0.0f ? r->attn_factor : 1.0f;
    FY_ASSERT(d > 0 && d % 2 == 0 && d <= hd, "rope: rotated channels even, at most hd");
    FY_ASSERT(af > 0.0f && isfinite(af), "rope: the attention factor must be positive");
    if (r->type == FY_ROPE_LONGROPE) {
        FY_ASSERT(d / 2 <= FY_ROPE_MAX_PAIRS, "longrope: at most FY_ROPE_MAX_PAIRS pairs");
        for (int j = 0; j < d / 2; j++)
            FY_ASSERT(r->ext[j] > 0.0f && isfinite(r->ext[j]), "longrope: positive pair factors");
    }
    float f[6 + FY_ROPE_MAX_PAIRS] = {r->theta, r->factor, r->low_freq_factor,
                                      r->high_freq_factor, r->orig_max_pos, af};
    memcpy(f + 6, r->ext, sizeof r->ext);
    launch(s, FY_OP_ROPE, PTRS(qkv, P(docs)), INTS(B, T, NH, NKV, hd, inverse, r->type, d), f,
           6 + FY_ROPE_MAX_PAIRS);
}

void fy_k_gelu_fwd(float *out, const float *inp, size_t n, fy_stream *s) {
    launch(s, FY_OP_GELU_FWD, PTRS(out, P(inp)), INTS((int64_t)n), NO_FLTS);
}

void fy_k_gelu_bwd(float *dinp, const float *inp, const float *dout, size_t n, fy_stream *s) {
    launch(s, FY_OP_GELU_BWD, PTRS(dinp, P(inp), P(dout)), INTS((int64_t)n), NO_FLTS);
}

static void glu_check(fy_glu_act act) {
    FY_ASSERT(act == FY_GLU_SILU || act == FY_GLU_GELU_TANH, "glu: an unknown activation");
}

void fy_k_glu_fwd(float *out, const float *gu, int N, int F, fy_glu_act act, fy_stream *s) {
    glu_check(act);
    launch(s, FY_OP_GLU_FWD, PTRS(out, P(gu)), INTS(N, F, act), NO_FLTS);
}

void fy_k_glu_bwd(float *dgu, const float *gu, const float *dout, int N, int F, fy_glu_act act,
                  fy_stream *s) {
    glu_check(act);
    launch(s, FY_OP_GLU_BWD, PTRS(dgu, P(gu), P(dout)), INTS(N, F, act), NO_FLTS);
}

void fy_k_residual_fwd(float *out, const float *a, const float *b, size_t n, fy_stream *s) {
    launch(s, FY_OP_RESIDUAL_FWD, PTRS(out, P(a), P(b)), INTS((int64_t)n), NO_FLTS);
}

void fy_k_crossentropy(float *losses, float *logits, const int32_t *targets, int N, int V,
                       int Vp, float dloss, float softcap, fy_stream *s) {
    FY_ASSERT(Vp >= V, "crossentropy: rows shorter than the classes");
    FY_ASSERT(softcap >= 0.0f, "crossentropy: a negative soft cap");
    launch(s, FY_OP_CROSSENTROPY, PTRS(losses, logits, P(targets)), INTS(N, V, Vp),
           FLTS(dloss, softcap));
}

void fy_k_ce_chunk_fwd(const float *logits, const int32_t *targets, float *max, double *sum,
                       float *tlogit, float *losses, int N, int v0, int nv, int V,
                       float softcap, fy_stream *s) {
    FY_ASSERT(v0 >= 0 && v0 < V && nv > 0, "ce_chunk_fwd: a chunk outside the classes");
    FY_ASSERT(softcap >= 0.0f, "ce_chunk_fwd: a negative soft cap");
    launch(s, FY_OP_CE_CHUNK_FWD, PTRS(P(logits), P(targets), max, sum, tlogit, losses),
           INTS(N, v0, nv, V), FLTS(softcap));
}

void fy_k_ce_chunk_bwd(float *logits, const int32_t *targets, const float *max,
                       const double *sum, int N, int v0, int nv, int V, float dloss,
                       float softcap, fy_stream *s) {
    FY_ASSERT(v0 >= 0 && v0 < V && nv > 0, "ce_chunk_bwd: a chunk outside the classes");
    FY_ASSERT(softcap >= 0.0f, "ce_chunk_bwd: a negative soft cap");
    launch(s, FY_OP_CE_CHUNK_BWD, PTRS(logits, P(targets), P(max), P(sum)), INTS(N, v0, nv, V),
           FLTS(dloss, softcap));
}

void fy_k_mean(float *out, const float *x, size_t n, int64_t div, fy_stream *s) {
    FY_ASSERT(div > 0, "mean: a divisor that is not positive");
    launch(s, FY_OP_MEAN, PTRS(out, P(x)), INTS((int64_t)n, div), NO_FLTS);
}

void fy_k_sumsq(double *out, const float *x, size_t n, fy_stream *s) {
    launch(s, FY_OP_SUMSQ, PTRS(out, P(x)), INTS((int64_t)n), NO_FLTS);
}

void fy_k_sumsq_parts(double *out, const void *x, size_t n, fy_stream *s) {
    launch(s, FY_OP_SUMSQ_PARTS, PTRS(out, P(x)), INTS((int64_t)n), NO_FLTS);
}

void fy_k_adamw(const fy_adam_hparams *hp, const fy_adam_range *r, fy_stream *s) {
    FY_ASSERT(!hp->check_finite, "fy_k_adamw does not check gradients; check the norm");
    launch(s, FY_OP_ADAMW, PTRS(r->param, r->m, r->v, P(r->grad), r->param_out),
           INTS((int64_t)r->n, r->grad_dtype, r->out_dtype, r->decay, hp->step),
           FLTS(hp->lr, hp->beta1, hp->beta2, hp->eps, hp->weight_decay, hp->grad_scale));
}
