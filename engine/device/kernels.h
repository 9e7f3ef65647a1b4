/* kernels.h — the kernels of the model families' blocks (GPT-2's and Llama's), launched
 * on a stream.
 *
 * Launchers follow llm.c's order: outputs, inputs, sizes, then the stream. Tensors are
 * row-major, in device memory; shapes are in the comments with llm.c's letters: B batch,
 * T time, C channels, NH heads, V vocabulary, N = B*T rows, OC output channels. Weights
 * are (OC, C) like torch.nn.Linear (the safetensors loader transposes Hugging Face's
 * Conv1D (in, out) layout).
 *
 * Storage type: tensors are in the stream's storage type (fy_stream_set_dtype: fp32 by
 * default, or bf16), arithmetic is fp32. Always fp32 whatever the
 * stream's type: layernorm's mean and rstd, crossentropy's losses, fy_k_mean's input
 * and output, and AdamW's master weights and moments (its gradients and copies out have
 * their own types in fy_adam_range); fy_k_sumsq's result is a double; tokens and targets
 * are int32. The pointer types below say float for the storage type.
 *
 * Accumulation: parameter gradients always accumulate (+=), so micro-batches add up and
 * a step starts by zeroing them. Activation gradients are overwritten unless a launcher
 * says "accumulates" (layernorm's dinp, which sits on the residual stream).
 *
 * Determinism: every kernel's result depends only on its inputs and shapes (and, on the
 * cpu backend, the thread count), never on timing or on where the buffers live;
 * reductions over rows (bias and norm-gain gradients, embedding scatter, sums) run in a
 * fixed order on both backends, without atomics. */
#ifndef FY_KERNELS_H
#define FY_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/device/device.h"
#include "engine/device/rope.h"
#include "optim_cpu/adam.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Positions and documents: a sequence may pack several documents. docs (B,T), int32 in
 * device memory, or NULL for one document a sequence: docs[b,t] is where position t's
 * document starts in its sequence (0 <= docs[b,t] <= t, and a new document starts where
 * docs changes: docs[b,t] is t or docs[b,t-1]). A position's place in its document,
 * t - docs[b,t], is what learned positions and rotary embeddings see, and attention never
 * looks across a document's start. */

/* out (B,T,C) = wte[tokens] (V,C) * scale + wpe[pos] (maxT,C), pos = t - docs[b,t] (t
 * without docs); wpe may be NULL (no learned positions: Llama's). scale is the embedding's
 * multiplier (Gemma's sqrt(hidden size), rounded by the caller; 1 for the others, which
 * is exact: the products are wte's values). Tokens must be < V (checked by the data
 * layer, not here). */
void fy_k_encoder_fwd(float *out, const int32_t *tokens, const float *wte, const float *wpe,
                      const int32_t *docs, int B, int T, int C, int V, float scale,
                      fy_stream *s);
/* dwte (V,C): dwte[tokens[b,t]] += dout[b,t] * scale, the scale applied to each term
 * (each fp32 product, then the sum in position order; scale 1 adds dout's values);
 * dwpe[pos] += dout[b,t], unscaled (dwpe may be NULL, as wpe in the forward). Each row's
 * sum is formed in fp32 before it meets a bf16 dwte (so a frequent token's gradient is
 * not rounded once per position). */
void fy_k_encoder_bwd(float *dwte, float *dwpe, const float *dout, const int32_t *tokens,
                      const int32_t *docs, int B, int T, int C, int V, float scale,
                      fy_stream *s);

/* out (N,C) = (inp - mean) * rstd * w + b, eps 1e-5; saves mean, rstd (N). */
void fy_k_layernorm_fwd(float *out, float *mean, float *rstd, const float *inp,
                        const float *w, const float *b, int N, int C, fy_stream *s);
/* dinp (N,C) accumulates; dw, db (C) accumulate. */
void fy_k_layernorm_bwd(float *dinp, float *dw, float *db, const float *dout,
                        const float *inp, const float *w, const float *mean,
                        const float *rstd, int N, int C, fy_stream *s);

/* RMSNorm: out (N,C) = inp * rstd * (w + offset), rstd = 1/sqrt(mean(inp^2) + eps);
 * saves rstd (N). offset: 0 for a plain gain (Llama's), 1 for Gemma's (1 + w); the sum
 * w + offset is formed in fp32 per channel. */
void fy_k_rmsnorm_fwd(float *out, float *rstd, const float *inp, const float *w, int N, int C,
                      float eps, float offset, fy_stream *s);
/* dinp (N,C) accumulates, with (w + offset) as the gain; dw (C) accumulates (the sum over
 * rows of dout * inp * rstd: the offset does not enter it). */
void fy_k_rmsnorm_bwd(float *dinp, float *dw, const float *dout, const float *inp,
                      const float *w, const float *rstd, int N, int C, float offset,
                      fy_stream *s);

/* Per-head RMSNorm of the query and key heads (Qwen3's and Gemma 3's q_norm and k_norm,
 * before the rotary embeddings) on packed rows inp (N,W), W = (NH + 2 NKV) hd, laid out
 * as attention's qkv (below): each query head's hd channels become x * rstd * (wq +
 * offset), each key head's x * rstd * (wk + offset), rstd = 1/sqrt(mean over the head's
 * channels of x^2 + eps); the value heads are copied unchanged. out (N,W) overwritten;
 * rstd (N, NH+NKV) fp32, the query heads' then the key heads' of each row. wq, wk (hd)
 * are shared by all query heads, all key heads. */
void fy_k_qk_norm_fwd(float *out, float *rstd, const float *inp, const float *wq,
                      const float *wk, int N, int NH, int NKV, int hd, float eps, float offset,
                      fy_stream *s);
/* dinp (N,W) overwritten (each head as fy_k_rmsnorm_bwd's dinp with its gain; the value
 * heads' gradient is dout's); dwq, dwk (hd) accumulate, summed over rows and heads in a
 * fixed order independent of the thread count. dinp may be dout (in place: the layer's
 * gradient of the packed rows is turned into its input's where it lies). */
void fy_k_qk_norm_bwd(float *dinp, float *dwq, float *dwk, const float *dout, const float *inp,
                      const float *wq, const float *wk, const float *rstd, int N, int NH,
                      int NKV, int hd, float offset, fy_stream *s);

/* out (N,OC) = inp (N,C) @ w^T (OC,C) + bias (OC, may be NULL). */
void fy_k_matmul_fwd(float *out, const float *inp, const float *w, const float *bias,
                     int N, int C, int OC, fy_stream *s);
/* dinp (N,C) = dout @ w (overwritten; may be NULL to skip); dw (OC,C) += dout^T @ inp;
 * dbias (OC) += column sums of dout (may be NULL). */
void fy_k_matmul_bwd(float *dinp, float *dw, float *dbias, const float *dout,
                     const float *inp, const float *w, int N, int C, int OC, fy_stream *s);

/* As fy_k_matmul_bwd without a bias, but dinp32 (N,C) is fp32 whatever the stream's
 * storage type and accumulates (+=): a bf16 run sums the shares of several GEMMs (the
 * classifier's vocabulary chunks) before one rounding. */
void fy_k_matmul_bwd_dx32(float *dinp32, float *dw, const float *dout, const float *inp,
                          const float *w, int N, int C, int OC, fy_stream *s);
/* dst (n, the storage type) += src (n, fp32), rounded once. */
void fy_k_add_f32(float *dst, const float *src, size_t n, fy_stream *s);

/* Causal self-attention with NH query heads and NKV key/value heads of hd channels
 * (NKV divides NH; query head h reads key/value head h / (NH/NKV): grouped-query
 * attention, and multi-head for NKV = NH). qkv (B,T,W), W = (NH + 2 NKV) hd, packs each
 * position's NH query heads, NKV key heads and NKV value heads, heads contiguous (GPT-2's
 * (B,T,3C) with NKV = NH, hd = C/NH).
 *
 * The mask: query t sees key j when j <= t, j >= docs[b,t] (docs may be NULL: see the
 * top) and, with a window w > 0, t - j < w (w keys, itself among them: Hugging Face's
 * sliding_window). Scores are q.k * scale (1/sqrt(hd), or the family's own), then, with a
 * soft cap c > 0 (Gemma 2's attn_logit_softcapping), c tanh(score / c), before the mask and
 * the softmax; the backward multiplies the capped scores' gradient by 1 - (score / c)^2
 * of the capped score, the tanh's derivative.
 *
 * Tiled (FlashAttention's algorithm): nothing of size T x T is ever stored. The forward
 * keeps, per query row, a running max and sum of the softmax in fp32 over key tiles, and
 * saves the row's log-sum-exp of the scores (capped, with a cap), lse (B,NH,T) fp32, for the backward,
 * which rebuilds the probabilities tile by tile from it. Tiles the mask hides entirely
 * (above the diagonal, before the window or the document) are skipped.
 *
 * Heads of at most FY_ATTN_MAX_HEAD channels (the cuda kernels' widest tile; 128 there with
 * fp32 storage); the families refuse wider ones when a model is built. */
#define FY_ATTN_MAX_HEAD 256
/* The widest head a device of this kind runs with storage type dt. */
int fy_attn_max_head(fy_dev_kind kind, fy_dtype dt);

typedef struct fy_attn {
    int window;           /* 0: none */
    float scale;          /* the scores' factor */
    float softcap;        /* 0: none; > 0: scores become softcap tanh(score / softcap) */
    const int32_t *docs;  /* (B,T) or NULL */
} fy_attn;

/* out (B,T,NH*hd), lse (B,NH,T) overwritten. */
void fy_k_attention_fwd(float *out, float *lse, const float *qkv, int B, int T, int NH, int NKV,
                        int hd, const fy_attn *a, fy_stream *s);
/* dqkv (B,T,W) overwritten (a key/value head's gradient sums its query heads' shares in
 * head order) from dout (B,T,NH*hd), the forward's qkv, out and lse; delta (B,NH,T) fp32 is
 * workspace (each row's sum of dout * out). */
void fy_k_attention_bwd(float *dqkv, float *delta, const float *dout, const float *qkv,
                        const float *out, const float *lse, int B, int T, int NH, int NKV,
                        int hd, const fy_attn *a, fy_stream *s);

/* Rotary position embeddings (rope.h) on the query and key heads of packed rows qkv
 * (B,T,W) as fy_k_attention_fwd's, in place, at position t - docs[b,t] (docs may be NULL:
 * t), on the first rope->rot_dim channels of each head (0: all hd; even, at most hd);
 * inverse: the transpose, the backward (the opposite rotation times the same attention
 * factor: the inverse only when the factor is 1). The value heads and the channels past
 * rot_dim are left alone. */
void fy_k_rope(float *qkv, const int32_t *docs, int B, int T, int NH, int NKV, int hd,
               bool inverse, const fy_rope *rope, fy_stream *s);

/* GELU, tanh approximation. */
void fy_k_gelu_fwd(float *out, const float *inp, size_t n, fy_stream *s);
/* dinp = dout * gelu'(inp), overwritten. */
void fy_k_gelu_bwd(float *dinp, const float *inp, const float *dout, size_t n, fy_stream *s);

/* A gated linear unit's activation: silu(g) = g sigmoid(g) (SwiGLU: Llama's, Qwen's,
 * Mistral's, Phi-3's) or GELU's tanh approximation as fy_k_gelu_fwd's (GeGLU with
 * Hugging Face's "gelu_pytorch_tanh": Gemma's). */
typedef enum fy_glu_act { FY_GLU_SILU = 0, FY_GLU_GELU_TANH = 1 } fy_glu_act;

/* GLU: gu (N,2F) holds each row's gate (first F) and up (last F) projections;
 * out (N,F) = act(gate) * up. */
void fy_k_glu_fwd(float *out, const float *gu, int N, int F, fy_glu_act act, fy_stream *s);
/* dgu (N,2F) overwritten: dgate = dout * up * act'(gate), dup = dout * act(gate). */
void fy_k_glu_bwd(float *dgu, const float *gu, const float *dout, int N, int F, fy_glu_act act,
                  fy_stream *s);

/* out = a + b (n). */
void fy_k_residual_fwd(float *out, const float *a, const float *b, size_t n, fy_stream *s);

/* Final logit soft-capping (Gemma 2's final_logit_softcapping), in every cross-entropy
 * kernel below: with softcap > 0 each raw logit l is replaced by z = softcap * tanh(l /
 * softcap), in fp32 in that order (divide, tanh, multiply: transformers' order), before
 * the softmax and the loss; the gradient written in place of l is then dL/dz * (1 -
 * tanh^2(l / softcap)). softcap 0: none, the raw logits, the same bits as without it. */

/* Targets the loss does not count: in every cross-entropy kernel below a negative target
 * (the data's loss mask, as torch's ignore_index) gives the row a loss of 0 and, in the
 * backward, a gradient row of 0; its logits are not read.
 *
 * Softmax cross-entropy over rows of logits (N,Vp) with targets (N): the first V of each
 * row's Vp columns are the classes (Vp >= V pads rows for aligned GEMMs; the padding is
 * ignored). losses (N) = logsumexp - logit[target] (of the capped logits, see above). If
 * dloss != 0 the logits are overwritten in place with their gradient (softmax - onehot) *
 * dloss (for a mean loss, dloss = 1/N; times the cap's derivative), and the padding
 * columns with 0. */
void fy_k_crossentropy(float *losses, float *logits, const int32_t *targets, int N, int V,
                       int Vp, float dloss, float softcap, fy_stream *s);

/* Softmax cross-entropy by vocabulary chunks (an online log-sum-exp): logits (N,nv) are
 * the columns [v0, v0+nv) of rows whose first V columns are the classes (columns past V
 * are padding, ignored). Per row, fp32 max, fp64 sum of exp(logit - max) and the
 * target's logit run over the chunks in order: the chunk with v0 == 0 starts them, later
 * ones rescale the sum to a new max and add theirs; the chunk holding class V-1 (v0 + nv
 * >= V) writes losses = max + log(sum) - logit[target]. With softcap > 0 every logit
 * here is the capped one (tlogit keeps the capped target logit). One chunk of all Vp
 * columns gives fy_k_crossentropy's arithmetic. softcap must be the same in every chunk
 * and in the backward. */
void fy_k_ce_chunk_fwd(const float *logits, const int32_t *targets, float *max, double *sum,
                       float *tlogit, float *losses, int N, int v0, int nv, int V,
                       float softcap, fy_stream *s);
/* After every chunk's forward: logits (N,nv) become (softmax - onehot) * dloss in place
 * (times the cap's derivative with softcap > 0), the padding columns 0. */
void fy_k_ce_chunk_bwd(float *logits, const int32_t *targets, const float *max,
                       const double *sum, int N, int v0, int nv, int V, float dloss,
                       float softcap, fy_stream *s);

/* out[0] = sum(x) / div (div > 0: n for the mean; a masked loss's count of targets, or a
 * step's), summed in double in a fixed order (the cpu backend: index order). x and out
 * are fp32 whatever the stream's storage type. */
void fy_k_mean(float *out, const float *x, size_t n, int64_t div, fy_stream *s);
/* out[0] = sum(x*x) in double, in a fixed order independent of the thread count. */
void fy_k_sumsq(double *out, const float *x, size_t n, fy_stream *s);
/* Its chunk sums (core/reduce.h): out[c] for each chunk c of x, ceil(n / FY_SUMSQ_CHUNK)
 * of them, fy_sumsq_parts's bits; fy_k_sumsq's result is their sum in chunk order. */
void fy_k_sumsq_parts(double *out, const void *x, size_t n, fy_stream *s);

/* AdamW on device-resident state (the "GPU optimizer" blocks): optim_cpu's contract
 * (adam.h), bit-identical to fy_adam_step on the same range. hp->check_finite is not
 * supported here (the caller checks the gradient norm). */
void fy_k_adamw(const fy_adam_hparams *hp, const fy_adam_range *r, fy_stream *s);

#ifdef __cplusplus
}
#endif
#endif
