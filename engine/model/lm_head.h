/* lm_head.h — the language-model classifier the families share: logits of the final
 * normed activations against a (Vp, C) matrix (GPT-2's tied wte, Llama's lm_head or
 * tied embed_tokens), their softmax cross-entropy against the targets, and in training
 * its backward, by vocabulary chunks, so neither the logits of a whole batch nor (when
 * the classifier streams) the whole matrix ever need to be on the device at once.
 *
 * Vocabulary padding: the classifier keeps Vp = V rounded up to 64 rows in memory (GPT-2's
 * 50257 -> 50304, as llm.c), the rows past V zero and staying zero (no token selects
 * them and their logits are left out of the softmax, so their gradients are zero), so
 * every GEMM of the classifier gets aligned rows. Files hold the V real rows.
 *
 * Chunks: the classifier's rows are cut into K chunks of at most `rows` (fy_lm_chunks:
 * a multiple of 64, the chunks as even as that allows). A chunk's logits for all N
 * positions take at most FY_LM_LOGIT_CHUNK_NBYTES (but a chunk has at least 64 rows,
 * which take more past 2^20 positions in fp32, 2^21 in bf16), and a family may bound the rows
 * further so that a chunk of the matrix is no larger than a layer (an untied classifier,
 * which streams through the layers' slots chunk by chunk). The forward runs the chunks
 * in order with an online log-sum-exp (a running max and fp64 sum per position,
 * fy_k_ce_chunk_fwd); the loss is known after the last. The backward runs them from
 * the last to the first: each recomputes its logits (the last one's are still in the
 * buffer when forward and backward run together), turns them into their gradient, and
 * gives its rows' gradient dw_k = dlogits_k^T xn in one GEMM over all N positions, so a
 * bf16 classifier gradient is rounded once without an fp32 copy of the matrix; d xn sums
 * the chunks' shares in an fp32 (N, C) accumulator and is rounded once. Recomputing
 * costs K-1 of the K forward GEMMs again (GPT-2 124M at 8 x 1024: a quarter more
 * classifier FLOPs in bf16).
 * The chunking depends on N, V, C, the storage type and the family's bound only, never
 * on the plan, so every plan computes the same sums. */
#ifndef FY_LM_HEAD_H
#define FY_LM_HEAD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/device/device.h"

#ifdef __cplusplus
extern "C" {
#endif

static inline int fy_lm_vocab_padded(int V) { return (V + 63) / 64 * 64; }

#define FY_LM_LOGIT_CHUNK_NBYTES ((size_t)256 << 20)

typedef struct fy_lm_chunks {
    int rows;   /* rows of every chunk but the last (a multiple of 64) */
    int n;      /* chunks */
    int Vp;     /* the classifier's rows */
} fy_lm_chunks;

/* The chunks of a Vp-row classifier for N positions in es-byte storage, at most max_rows
 * rows each (0: no bound but the logits'). */
static inline fy_lm_chunks fy_lm_chunks_of(size_t N, int Vp, size_t es, size_t max_rows) {
    size_t cap = FY_LM_LOGIT_CHUNK_NBYTES / es / (N ? N : 1);
    if (max_rows && max_rows < cap) cap = max_rows;
    cap = cap / 64 * 64;
    if (cap < 64) cap = 64;
    const size_t k = ((size_t)Vp + cap - 1) / cap;
    const size_t rows = ((size_t)Vp + k - 1) / k;
    fy_lm_chunks c = {(int)((rows + 63) / 64 * 64), 0, Vp};
    c.n = (Vp + c.rows - 1) / c.rows;
    return c;
}
static inline int fy_lm_chunk_v0(fy_lm_chunks c, int k) { return k * c.rows; }
static inline int fy_lm_chunk_nv(fy_lm_chunks c, int k) {
    return k < c.n - 1 ? c.rows : c.Vp - k * c.rows;
}

/* Device views, tensors in the stream's storage type unless said. */
typedef struct fy_lm_head_io {
    int N, C, V;            /* rows, channels, classes (the classifier has Vp rows) */
    fy_lm_chunks chunks;
    const float *xn;        /* (N, C) the normed activations */
    float *logits;          /* (N, chunks.rows): one chunk's logits */
    float *max;             /* (N) fp32 \                                         */
    double *sum;            /* (N) fp64  > the running log-sum-exp and the target's logit, */
    float *tlogit;          /* (N) fp32 /  kept from the forward to the backward        */
    float *losses;          /* (N) fp32: per-position losses, after the last chunk */
    const int32_t *targets; /* (N) */
    float dloss;            /* training: the loss's scale */
    float softcap;          /* final logit soft-capping (kernels.h): z = softcap tanh(l /
                               softcap) before the softmax; 0: none */
    float *dxn32;           /* training: (N, C) fp32, d xn summed over the chunks */
    float *dxn;             /* training with bf16 storage: (N, C) = dxn32 rounded; with
                               fp32 storage NULL (dxn32 is d xn) */
} fy_lm_head_io;

/* Chunk k's forward: its logits against w_k (its rows, (nv, C)), the running
 * log-sum-exp; the last chunk writes the losses. Chunks in order 0..K-1. */
void fy_lm_head_fwd_chunk(const fy_lm_head_io *io, int k, const float *w_k, fy_stream *s);
/* Chunk k's backward, after every forward, chunks in order K-1..0: dw_k ((nv, C),
 * storage type) += its rows' gradient, dxn32 += its share (the first, k = K-1, starts
 * it; the last, k = 0, rounds it into dxn). `fresh`: the logits buffer still holds
 * chunk k's from its forward (it ran last), so they are not recomputed. */
void fy_lm_head_bwd_chunk(const fy_lm_head_io *io, int k, const float *w_k, float *dw_k,
                          bool fresh, fy_stream *s);
/* The whole classifier w ((Vp, C)): every chunk's forward, and with dloss != 0 every
 * chunk's backward into dw ((Vp, C), +=). */
void fy_lm_head(const fy_lm_head_io *io, const float *w, float *dw, fy_stream *s);

#ifdef __cplusplus
}
#endif
#endif
