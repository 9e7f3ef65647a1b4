/* gpt2.h — GPT-2: configs, the parameter table, and per-block forward/backward.
 *
 * Semantics are Hugging Face GPT2LMHeadModel's: learned token and position embeddings,
 * pre-norm layers (x += attn(ln_1(x)); x += mlp(ln_2(x))), LayerNorm eps 1e-5, GELU tanh
 * approximation, causal attention scaled by 1/sqrt(head_dim), final ln_f, LM head tied to
 * the token embedding, mean cross-entropy over all B*T positions, no dropout.
 *
 * Blocks are the unit of offload, transfer and optimizer work: block 0 is the embedding
 * (wte, wpe), blocks 1..L the transformer layers, block L+1 the head (ln_f; its matmul
 * uses wte from block 0, so the head needs block 0's parameters and adds into its
 * gradient). A block's parameters are one contiguous fp32 buffer; the layout table below
 * gives each tensor's offset (aligned to 16 floats), shape and Hugging Face name, and is
 * the one source of truth for views, the optimizer's weight-decay split and file I/O.
 *
 * This module knows nothing of offload: every function takes device pointers and a
 * stream, and only queues kernels. */
#ifndef FY_GPT2_H
#define FY_GPT2_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/core/dtype.h"
#include "engine/core/status.h"
#include "engine/device/device.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fy_gpt2_config {
    int vocab;    /* V */
    int max_seq;  /* maxT, the number of learned positions */
    int channels; /* C */
    int layers;   /* L */
    int heads;    /* NH; must divide C */
} fy_gpt2_config;

/* Named configs: gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1558m (V 50257, maxT 1024) and the
 * byte-level ones for tests and the demo: gpt2-tiny, gpt2-mini, gpt2-small-byte (V 256). */
fy_status fy_gpt2_config_named(const char *name, fy_gpt2_config *out);
/* A comma-separated list of the names, for --help. */
const char *fy_gpt2_config_names(void);
/* FY_ERR_INVALID (logged) for non-positive sizes or heads not dividing channels. */
fy_status fy_gpt2_config_check(const fy_gpt2_config *cfg);
size_t fy_gpt2_num_params(const fy_gpt2_config *cfg); /* without alignment padding */
/* The vocabulary rounded up to a multiple of 64 (GPT-2's 50257 -> 50304, as llm.c): wte
 * keeps Vp rows in memory (the rows past V are zero and stay zero: no token selects them
 * and their logits are left out of the softmax, so their gradients are zero), so the
 * logits' rows are Vp long and every GEMM of the classifier gets aligned rows. Files hold
 * the V real rows. */
static inline int fy_gpt2_vocab_padded(const fy_gpt2_config *cfg) {
    return (cfg->vocab + 63) / 64 * 64;
}
/* FY_ERR_INVALID (logged) if sequences of length T do not fit the model's positions. */
fy_status fy_gpt2_check_seq(const fy_gpt2_config *cfg, int64_t T);

/* Parameters of one layer, in table order (the struct is filled as an array). */
#define FY_GPT2_LAYER_PARAMS(X)                                    \
    X(ln1w, "ln_1.weight", C, 1, 0, 0)                              \
    X(ln1b, "ln_1.bias", C, 1, 0, 0)                                \
    X(qkvw, "attn.c_attn.weight", 3 * C, C, 1, 1)                   \
    X(qkvb, "attn.c_attn.bias", 3 * C, 1, 0, 0)                     \
    X(attprojw, "attn.c_proj.weight", C, C, 1, 1)                   \
    X(attprojb, "attn.c_proj.bias", C, 1, 0, 0)                     \
    X(ln2w, "ln_2.weight", C, 1, 0, 0)                              \
    X(ln2b, "ln_2.bias", C, 1, 0, 0)                                \
    X(fcw, "mlp.c_fc.weight", 4 * C, C, 1, 1)                       \
    X(fcb, "mlp.c_fc.bias", 4 * C, 1, 0, 0)                         \
    X(fcprojw, "mlp.c_proj.weight", C, 4 * C, 1, 1)                 \
    X(fcprojb, "mlp.c_proj.bias", C, 1, 0, 0)
/* X(field, hf_name, rows, cols, weight_decay, conv1d): the internal shape is
 * (rows, cols) = (out, in) like torch.nn.Linear; cols == 1 means a vector. conv1d marks
 * tensors Hugging Face stores transposed, as (in, out). */
#define FY_GPT2_EMBED_PARAMS(X)                                    \
    X(wte, "wte.weight", V, C, 1, 0)                                \
    X(wpe, "wpe.weight", maxT, C, 1, 0)
#define FY_GPT2_HEAD_PARAMS(X)                                     \
    X(lnfw, "ln_f.weight", C, 1, 0, 0)                              \
    X(lnfb, "ln_f.bias", C, 1, 0, 0)

#define FY_GPT2_FIELD(field, ...) float *field;
typedef struct fy_gpt2_layer_w { FY_GPT2_LAYER_PARAMS(FY_GPT2_FIELD) } fy_gpt2_layer_w;
typedef struct fy_gpt2_embed_w { FY_GPT2_EMBED_PARAMS(FY_GPT2_FIELD) } fy_gpt2_embed_w;
typedef struct fy_gpt2_head_w { FY_GPT2_HEAD_PARAMS(FY_GPT2_FIELD) } fy_gpt2_head_w;

typedef enum fy_block_kind { FY_BLOCK_EMBED = 0, FY_BLOCK_LAYER, FY_BLOCK_HEAD } fy_block_kind;

typedef struct fy_tensor_spec {
    char name[48];  /* Hugging Face name without the "transformer." prefix */
    int rows, cols; /* internal shape; cols == 1 for vectors */
    int alloc_rows; /* rows of memory it takes: rows, or the padded vocabulary for wte */
    size_t offset;  /* in floats from the block's start, a multiple of 16; decayed
                       tensors first, so a block is two optimizer ranges */
    bool decay;     /* weight decay applies (2-D tensors) */
    bool conv1d;    /* stored transposed (in, out) in Hugging Face files */
} fy_tensor_spec;

#define FY_GPT2_MAX_TENSORS 12
#define FY_GPT2_MAX_LAYERS 4096

typedef struct fy_block_spec {
    fy_block_kind kind;
    int layer;               /* for FY_BLOCK_LAYER: 0..L-1 */
    int ntensors;
    fy_tensor_spec tensors[FY_GPT2_MAX_TENSORS];
    size_t nelem;            /* floats in the block buffer, padding included */
    size_t decay_nelem;      /* tensors with weight decay come first: [0, decay_nelem) */
} fy_block_spec;

typedef struct fy_gpt2_layout {
    fy_gpt2_config cfg;
    int nblocks;             /* L + 2 */
    fy_block_spec *blocks;   /* [0] embed, [1..L] layers, [L+1] head */
} fy_gpt2_layout;

fy_status fy_gpt2_layout_new(const fy_gpt2_config *cfg, fy_gpt2_layout *out);
void fy_gpt2_layout_free(fy_gpt2_layout *lay);
/* Block b's buffer seen as its tensors: base holds nelem elements of type dt (F32 or
 * BF16; the fields are typed float, meaning "of the buffer's type", as in kernels.h). */
void fy_gpt2_layer_view(const fy_block_spec *blk, fy_dtype dt, void *base, fy_gpt2_layer_w *out);
void fy_gpt2_embed_view(const fy_block_spec *blk, fy_dtype dt, void *base, fy_gpt2_embed_w *out);
void fy_gpt2_head_view(const fy_block_spec *blk, fy_dtype dt, void *base, fy_gpt2_head_w *out);

/* GPT-2's initialisation into a host buffer of blk->nelem floats: weights N(0, 0.02),
 * residual projections N(0, 0.02/sqrt(2L)), biases 0, norm gains 1. Each tensor draws
 * from its own stream seeded by (seed, block, tensor), so it does not depend on order. */
void fy_gpt2_init_block(const fy_gpt2_config *cfg, const fy_block_spec *blk, uint64_t seed,
                        float *host);

/* Activations of one layer for a micro-batch of B x T (N = B*T). The layer's output
 * (N*C elements, the next layer's input) is not in this list: it is `out`, bound by the
 * caller, because a recomputed layer keeps its output but shares everything else.
 * X(field, elements, type): S = the storage type, F = always fp32 (kernels.h). */
#define FY_GPT2_LAYER_ACTS(X)             \
    X(ln1, (size_t)N * C, S)               \
    X(ln1_mean, (size_t)N, F)              \
    X(ln1_rstd, (size_t)N, F)              \
    X(qkv, (size_t)N * 3 * C, S)           \
    X(att, (size_t)B * NH * T * T, S)      \
    X(atty, (size_t)N * C, S)              \
    X(res2, (size_t)N * C, S)              \
    X(ln2, (size_t)N * C, S)               \
    X(ln2_mean, (size_t)N, F)              \
    X(ln2_rstd, (size_t)N, F)              \
    X(fch, (size_t)N * 4 * C, S)           \
    X(fch_gelu, (size_t)N * 4 * C, S)
#define FY_GPT2_ACT_FIELD(field, size, type) float *field;
typedef struct fy_gpt2_layer_acts {
    FY_GPT2_LAYER_ACTS(FY_GPT2_ACT_FIELD)
    float *out; /* (N, C), bound separately */
} fy_gpt2_layer_acts;

/* The classifier runs over row chunks of the N positions, so the logits of the whole
 * batch never exist at once: a chunk holds at most FY_GPT2_LOGIT_CHUNK_NBYTES of logits
 * in the storage type (es bytes each): 333 rows of GPT-2's vocabulary in fp32, 667 in
 * bf16, where the whole batch of B=8, T=1024 would take 1.6 GiB in fp32. Each chunk adds
 * its share into dwte, so fewer chunks also mean fewer roundings of a bf16 dwte. The
 * chunking depends on N, V and the storage type only, never on the plan, so every plan
 * computes the same sums. */
#define FY_GPT2_LOGIT_CHUNK_NBYTES ((size_t)64 << 20)
static inline size_t fy_gpt2_logit_rows(size_t N, size_t V, size_t es) {
    size_t rows = FY_GPT2_LOGIT_CHUNK_NBYTES / es / V;
    if (rows < 1) rows = 1;
    return rows < N ? rows : N;
}

/* The head's activations: the final norm, one chunk of logits (overwritten by their
 * gradient in a training step) and per-position losses. */
#define FY_GPT2_HEAD_ACTS(X)                            \
    X(lnf, (size_t)N * C, S)                             \
    X(lnf_mean, (size_t)N, F)                            \
    X(lnf_rstd, (size_t)N, F)                            \
    X(logits, fy_gpt2_logit_rows(N, Vp, es) * Vp, S)     \
    X(losses, (size_t)N, F)
typedef struct fy_gpt2_head_acts { FY_GPT2_HEAD_ACTS(FY_GPT2_ACT_FIELD) } fy_gpt2_head_acts;

/* Workspace shared by all layers in backward (and the projection output in forward). */
#define FY_GPT2_SCRATCH(X)                \
    X(proj, (size_t)N * C, S)              \
    X(dres, (size_t)N * C, S)              \
    X(dln, (size_t)N * C, S)               \
    X(datty, (size_t)N * C, S)             \
    X(dqkv, (size_t)N * 3 * C, S)          \
    X(dfch, (size_t)N * 4 * C, S)          \
    X(dfch_gelu, (size_t)N * 4 * C, S)     \
    X(datt, (size_t)B * NH * T * T, S)
typedef struct fy_gpt2_scratch { FY_GPT2_SCRATCH(FY_GPT2_ACT_FIELD) } fy_gpt2_scratch;

/* Bytes needed for each struct with storage type dt (every field 64-byte aligned), and
 * binding the fields to consecutive pieces of a buffer of that size (a layer's `out` is
 * left alone). */
size_t fy_gpt2_layer_acts_nbytes(const fy_gpt2_config *cfg, int B, int T, fy_dtype dt);
size_t fy_gpt2_head_acts_nbytes(const fy_gpt2_config *cfg, int B, int T, fy_dtype dt);
size_t fy_gpt2_scratch_nbytes(const fy_gpt2_config *cfg, int B, int T, fy_dtype dt);
void fy_gpt2_layer_acts_bind(const fy_gpt2_config *cfg, int B, int T, fy_dtype dt, void *base,
                             fy_gpt2_layer_acts *out);
void fy_gpt2_head_acts_bind(const fy_gpt2_config *cfg, int B, int T, fy_dtype dt, void *base,
                            fy_gpt2_head_acts *out);
void fy_gpt2_scratch_bind(const fy_gpt2_config *cfg, int B, int T, fy_dtype dt, void *base,
                          fy_gpt2_scratch *out);

/* Forward and backward, block by block. All pointers are device memory; each call
 * queues kernels on s and returns at once. Gradients (g, dwte, ...) accumulate. */
void fy_gpt2_embed_fwd(const fy_gpt2_config *cfg, const fy_gpt2_embed_w *w,
                       const int32_t *tokens, float *x0, int B, int T, fy_stream *s);
/* x_out = layer(x_in); x_out is a->out. */
void fy_gpt2_layer_fwd(const fy_gpt2_config *cfg, const fy_gpt2_layer_w *w,
                       fy_gpt2_layer_acts *a, const float *x_in, fy_gpt2_scratch *sc,
                       int B, int T, fy_stream *s);
/* Evaluation: per-position losses and loss_out[0] = their mean. */
void fy_gpt2_head_fwd(const fy_gpt2_config *cfg, const fy_gpt2_head_w *w, const float *wte,
                      const float *xL, fy_gpt2_head_acts *a, const int32_t *targets,
                      float *loss_out, int B, int T, fy_stream *s);
/* A training step's head, forward and backward fused chunk by chunk: losses and
 * loss_out[0] as fy_gpt2_head_fwd, the loss scaled by dloss (1/(B*T*accum) for a mean
 * loss) differentiated: dwte += the classifier's part, g accumulates, sc->dres = d xL.
 * dwte32 (Vp*C fp32, or NULL): where the chunks' dwte shares are summed before they are
 * added to dwte once; for bf16 storage, so dwte is rounded once, not once a chunk. */
void fy_gpt2_head_step(const fy_gpt2_config *cfg, const fy_gpt2_head_w *w,
                       fy_gpt2_head_w *g, const float *wte, float *dwte, float *dwte32,
                       const float *xL, fy_gpt2_head_acts *a, const int32_t *targets,
                       float dloss, float *loss_out, fy_gpt2_scratch *sc, int B, int T,
                       fy_stream *s);
/* sc->dres holds d x_out on entry and d x_in on return. */
void fy_gpt2_layer_bwd(const fy_gpt2_config *cfg, const fy_gpt2_layer_w *w,
                       fy_gpt2_layer_w *g, const fy_gpt2_layer_acts *a, const float *x_in,
                       fy_gpt2_scratch *sc, int B, int T, fy_stream *s);
/* From sc->dres = d x0: dwte and dwpe accumulate. */
void fy_gpt2_embed_bwd(const fy_gpt2_config *cfg, fy_gpt2_embed_w *g, const int32_t *tokens,
                       const fy_gpt2_scratch *sc, int B, int T, fy_stream *s);

#ifdef __cplusplus
}
#endif
#endif
