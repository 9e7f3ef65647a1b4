/* kernels.c — kernel launchers: each packs its arguments into a fy_op, in launcher
 * order, and hands it to the stream's backend. The unpacking side is the backend's
 * (cpu/cpu_kernels.c). */
#include "engine/device/kernels.h"

#include "engine/device/device_impl.h"

/* Every kernel's op carries the stream's storage type. */
static void launch(fy_stream *s, const fy_op *op) {
    fy_op o = *op;
    o.dt = s->dtype;
    s->dev->iface->launch(s, &o);
}

#define P(x) ((void *)(x))

void fy_k_encoder_fwd(float *out, const int32_t *tokens, const float *wte, const float *wpe,
                      int B, int T, int C, int V, fy_stream *s) {
    launch(s, &(fy_op){FY_OP_ENCODER_FWD, {out, P(tokens), P(wte), P(wpe)}, {B, T, C, V}, {0}, 0});
}

void fy_k_encoder_bwd(float *dwte, float *dwpe, const float *dout, const int32_t *tokens,
                      int B, int T, int C, int V, fy_stream *s) {
    launch(s, &(fy_op){FY_OP_ENCODER_BWD, {dwte, dwpe, P(dout), P(tokens)}, {B, T, C, V}, {0}, 0});
}

void fy_k_layernorm_fwd(float *out, float *mean, float *rstd, const float *inp,
                        const float *w, const float *b, int N, int C, fy_stream *s) {
    launch(s, &(fy_op){FY_OP_LAYERNORM_FWD, {out, mean, rstd, P(inp), P(w), P(b)}, {N, C}, {0}, 0});
}

void fy_k_layernorm_bwd(float *dinp, float *dw, float *db, const float *dout,
                        const float *inp, const float *w, const float *mean,
                        const float *rstd, int N, int C, fy_stream *s) {
    launch(s, &(fy_op){FY_OP_LAYERNORM_BWD,
                       {dinp, dw, db, P(dout), P(inp), P(w), P(mean), P(rstd)}, {N, C}, {0}, 0});
}

void fy_k_matmul_fwd(float *out, const float *inp, const float *w, const float *bias,
                     int N, int C, int OC, fy_stream *s) {
    launch(s, &(fy_op){FY_OP_MATMUL_FWD, {out, P(inp), P(w), P(bias)}, {N, C, OC}, {0}, 0});
}

void fy_k_matmul_bwd(float *dinp, float *dw, float *dbias, const float *dout,
                     const float *inp, const float *w, int N, int C, int OC, fy_stream *s) {
    launch(s, &(fy_op){FY_OP_MATMUL_BWD, {dinp, dw, dbias, P(dout), P(inp), P(w)},
                       {N, C, OC}, {0}, 0});
}

void fy_k_matmul_bwd_f32acc(float *dinp, float *dw32, const float *dout, const float *inp,
                            const float *w, int N, int C, int OC, fy_stream *s) {
    launch(s, &(fy_op){FY_OP_MATMUL_BWD, {dinp, dw32, NULL, P(dout), P(inp), P(w)},
                       {N, C, OC, 1}, {0}, 0});
}

void fy_k_add_f32(float *dst, const float *src, size_t n, fy_stream *s) {
    launch(s, &(fy_op){FY_OP_ADD_F32, {dst, P(src)}, {(int64_t)n}, {0}, 0});
}

void fy_k_attention_fwd(float *out, float *att, const float *qkv, int B, int T, int C,
                        int NH, fy_stream *s) {
    launch(s, &(fy_op){FY_OP_ATTENTION_FWD, {out, att, P(qkv)}, {B, T, C, NH}, {0}, 0});
}

void fy_k_attention_bwd(float *dqkv, float *scratch, const float *dout, const float *qkv,
                        const float *att, int B, int T, int C, int NH, fy_stream *s) {
    launch(s, &(fy_op){FY_OP_ATTENTION_BWD, {dqkv, scratch, P(dout), P(qkv), P(att)},
                       {B, T, C, NH}, {0}, 0});
}

void fy_k_gelu_fwd(float *out, const float *inp, size_t n, fy_stream *s) {
    launch(s, &(fy_op){FY_OP_GELU_FWD, {out, P(inp)}, {(int64_t)n}, {0}, 0});
}

void fy_k_gelu_bwd(float *dinp, const float *inp, const float *dout, size_t n, fy_stream *s) {
    launch(s, &(fy_op){FY_OP_GELU_BWD, {dinp, P(inp), P(dout)}, {(int64_t)n}, {0}, 0});
}

void fy_k_residual_fwd(float *out, const float *a, const float *b, size_t n, fy_stream *s) {
    launch(s, &(fy_op){FY_OP_RESIDUAL_FWD, {out, P(a), P(b)}, {(int64_t)n}, {0}, 0});
}

void fy_k_crossentropy(float *losses, float *logits, const int32_t *targets, int N, int V,
                       int Vp, float dloss, fy_stream *s) {
    FY_ASSERT(Vp >= V, "crossentropy: rows shorter than the classes");
    launch(s, &(fy_op){FY_OP_CROSSENTROPY, {losses, logits, P(targets)}, {N, V, Vp}, {dloss}, 0});
}

void fy_k_mean(float *out, const float *x, size_t n, fy_stream *s) {
    launch(s, &(fy_op){FY_OP_MEAN, {out, P(x)}, {(int64_t)n}, {0}, 0});
}

void fy_k_sumsq(double *out, const float *x, size_t n, fy_stream *s) {
    launch(s, &(fy_op){FY_OP_SUMSQ, {out, P(x)}, {(int64_t)n}, {0}, 0});
}

void fy_k_adamw(const fy_adam_hparams *hp, const fy_adam_range *r, fy_stream *s) {
    FY_ASSERT(!hp->check_finite, "fy_k_adamw does not check gradients; check the norm");
    launch(s, &(fy_op){FY_OP_ADAMW,
                       {r->param, r->m, r->v, P(r->grad), r->param_out},
                       {(int64_t)r->n, r->grad_dtype, r->out_dtype, r->decay, hp->step},
                       {hp->lr, hp->beta1, hp->beta2, hp->eps, hp->weight_decay,
                        hp->grad_scale}, 0});
}
