/* lm_head.h — the language-model classifier the families share: logits of the final
 * normed activations against a (Vp, C) matrix (GPT-2's tied wte, Llama's lm_head or
 * tied embed_tokens), their softmax cross-entropy against the targets, and in training
 * its backward, fused chunk by chunk so the logits of a whole batch never exist at once.
 *
 * Vocabulary padding: the classifier keeps Vp = V rounded up to 64 rows in memory (GPT-2's
 * 50257 -> 50304, as llm.c), the rows past V zero and staying zero (no token selects
 * them and their logits are left out of the softmax, so their gradients are zero), so
 * every GEMM of the classifier gets aligned rows. Files hold the V real rows.
 *
 * Chunks: at most FY_LM_LOGIT_CHUNK_NBYTES of logits in the storage type (es bytes each):
 * 333 rows of GPT-2's vocabulary in fp32, 667 in bf16, where the whole batch of B=8,
 * T=1024 would take 1.6 GiB in fp32. Each chunk adds its share into the classifier's
 * gradient, so fewer chunks also mean fewer roundings of a bf16 gradient: with several
 * chunks and bf16 storage the shares are summed in an fp32 (Vp, C) accumulator (dw32) and
 * rounded once. That accumulator is as large as an fp32 classifier (2.1 GB for Llama 3's
 * 128256 x 4096), so a bf16 training step takes all N rows in one chunk whenever their
 * logits take no more than a chunk and the accumulator would (fy_lm_one_chunk; Llama 3 8B
 * at 1 x 2048: 525 MB of logits instead of 67 MB and 2.1 GB): one chunk rounds once
 * without it. Those logits are training workspace; evaluation, which has no gradient,
 * always goes by chunks. The chunking depends on N, V, C, the storage type and training
 * only, never on the plan, so every plan computes the same sums. */
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

#define FY_LM_LOGIT_CHUNK_NBYTES ((size_t)64 << 20)
/* Rows of logits a chunk holds (at most N). */
static inline size_t fy_lm_logit_rows(size_t N, size_t Vp, size_t es) {
    size_t rows = FY_LM_LOGIT_CHUNK_NBYTES / es / Vp;
    if (rows < 1) rows = 1;
    return rows < N ? rows : N;
}
/* Whether a bf16 training step takes all N rows in one chunk (logits_all) rather than
 * chunks and the fp32 accumulator. */
static inline bool fy_lm_one_chunk(size_t N, size_t Vp, size_t C, size_t es) {
    const size_t rows = fy_lm_logit_rows(N, Vp, es);
    return es == 2 && rows < N && N * Vp * es <= rows * Vp * es + Vp * C * sizeof(float);
}
/* Whether a bf16 training step sums the chunks' gradient shares in dw32. */
static inline bool fy_lm_acc32(size_t N, size_t Vp, size_t C, size_t es) {
    return es == 2 && fy_lm_logit_rows(N, Vp, es) < N && !fy_lm_one_chunk(N, Vp, C, es);
}

/* Device views, tensors in the stream's storage type unless said. */
typedef struct fy_lm_head_io {
    int N, C, V;            /* rows, channels, classes (the classifier has Vp rows) */
    const float *xn;        /* (N, C) the normed activations */
    const float *w;         /* (Vp, C) the classifier */
    float *logits;          /* fy_lm_logit_rows(N, Vp, es) x Vp: one chunk */
    float *logits_all;      /* training with fy_lm_one_chunk: (N, Vp); else NULL */
    float *losses;          /* (N) fp32: per-position losses */
    const int32_t *targets; /* (N) */
    float dloss;            /* 0: evaluate only; else the loss's scale, and the backward */
    float *dw;              /* training: (Vp, C) += the classifier's gradient */
    float *dw32;            /* training with bf16 storage in several chunks (fy_lm_acc32):
                               (Vp, C) fp32 workspace where the chunks' shares are summed
                               before one rounding; else NULL */
    float *dxn;             /* training: (N, C) = d xn, overwritten */
} fy_lm_head_io;

/* Queues the classifier on s: losses, and with dloss != 0 dw and dxn. */
void fy_lm_head(const fy_lm_head_io *io, fy_stream *s);

#ifdef __cplusplus
}
#endif
#endif
