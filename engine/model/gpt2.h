/* gpt2.h — GPT-2, the first model family behind the model interface (model.h): its
 * configs, parameter table, activation structs and per-block passes.
 *
 * Semantics are Hugging Face GPT2LMHeadModel's: learned token and position embeddings,
 * pre-norm layers (x += attn(ln_1(x)); x += mlp(ln_2(x))), LayerNorm eps 1e-5, GELU tanh
 * approximation, causal attention scaled by 1/sqrt(head_dim), final ln_f, LM head tied to
 * the token embedding, mean cross-entropy over all B*T positions, no dropout.
 *
 * Blocks: the embedding (wte, wpe), the L layers, the head (ln_f). The head's classifier
 * uses wte: the head links to the embedding (reads its parameters, adds into its
 * gradient). Tensor names are Hugging Face's ("h.{i}.attn.c_attn.weight"; "transformer."
 * accepted on load), Conv1D weights are stored (in, out), lm_head is tied and not stored.
 *
 * The functions below the model constructor are the family's internals, exported for the
 * model-layer tests: every function takes device pointers and a stream and only queues
 * kernels. */
#ifndef FY_GPT2_H
#define FY_GPT2_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/core/dtype.h"
#include "engine/core/status.h"
#include "engine/device/device.h"
#include "engine/model/lm_head.h"
#include "engine/model/model.h"

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
/* The vocabulary padded for the classifier (lm_head.h): wte keeps Vp rows in memory. */
static inline int fy_gpt2_vocab_padded(const fy_gpt2_config *cfg) {
    return fy_lm_vocab_padded(cfg->vocab);
}
/* FY_ERR_INVALID (logged) if sequences of length T do not fit the model's positions. */
fy_status fy_gpt2_check_seq(const fy_gpt2_config *cfg, int64_t T);

/* The family's model (model.h) of a config; name may be NULL (a free shape).
 * FY_ERR_INVALID (logged) for a bad config. */
fy_status fy_gpt2_new(const fy_gpt2_config *cfg, const char *name, fy_model **out);
/* The config of a GPT-2 model (which must be one). */
const fy_gpt2_config *fy_gpt2_config_of(const fy_model *m);
/* The registry's hooks (model.c): a named config with overrides (FY_ERR_UNSUPPORTED,
 * silently, if the name is not GPT-2's); whether weights without a config hold GPT-2
 * tensors; the model of weights; the config.json fields (gpt2_io.c). */
fy_status fy_gpt2_named(const char *name, const fy_model_shape *over, fy_model **out);
bool fy_gpt2_recognise(const fy_weights *w);
fy_status fy_gpt2_from_weights(const fy_weights *w, const fy_model_shape *hint, fy_model **out);
void fy_gpt2_hf_config(const fy_model *m, cJSON *cfg);
/* The shape weights hold: vocab and channels from wte, positions from wpe, layers from
 * the h.{i} present. Heads: heads_flag if > 0, else the config's n_head (which must agree
 * with the tensors and heads_flag), else ferry.heads metadata; otherwise FY_ERR_INVALID
 * asking for --heads. */
fy_status fy_gpt2_weights_config(const fy_weights *w, int heads_flag, fy_gpt2_config *out);

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

/* Block b's buffer seen as its tensors: base holds nelem elements of type dt (F32 or
 * BF16; the fields are typed float, meaning "of the buffer's type", as in kernels.h). */
void fy_gpt2_layer_view(const fy_block_spec *blk, fy_dtype dt, const void *base, fy_gpt2_layer_w *out);
void fy_gpt2_embed_view(const fy_block_spec *blk, fy_dtype dt, const void *base, fy_gpt2_embed_w *out);
void fy_gpt2_head_view(const fy_block_spec *blk, fy_dtype dt, const void *base, fy_gpt2_head_w *out);

/* Activations of one layer for a micro-batch of B x T (N = B*T): what the layer keeps for
 * its backward (its saved area). The layer's output (N*C elements, the next layer's
 * input) is not in this list: it is `out`, bound apart, because a recomputed layer keeps
 * its output but shares everything else.
 * X(field, elements, type): S = the storage type, F = always fp32 (kernels.h). */
#define FY_GPT2_LAYER_ACTS(X)             \
    X(ln1, (size_t)N * C, S)               \
    X(ln1_mean, (size_t)N, F)              \
    X(ln1_rstd, (size_t)N, F)              \
    X(qkv, (size_t)N * 3 * C, S)           \
    X(lse, (size_t)B * NH * T, F)          \
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

/* A layer's transient workspace: the projections' output in forward, the activation
 * gradients inside its backward. The position-wise work runs by sequence chunks of Nc rows
 * (model.h: fy_model_chunk; `rows` below), so those buffers hold a chunk; the attention's
 * gradients hold every row. */
#define FY_GPT2_LAYER_WORK(X)             \
    X(proj, (size_t)Nc * C, S)             \
    X(dln, (size_t)Nc * C, S)              \
    X(datty, (size_t)N * C, S)             \
    X(dqkv, (size_t)N * 3 * C, S)          \
    X(dfch, (size_t)Nc * 4 * C, S)         \
    X(dfch_gelu, (size_t)Nc * 4 * C, S)    \
    X(delta, (size_t)B * NH * T, F)
typedef struct fy_gpt2_layer_work {
    FY_GPT2_LAYER_WORK(FY_GPT2_ACT_FIELD)
    int rows; /* Nc: the rows of a chunk, set by the bind */
} fy_gpt2_layer_work;

/* The classifier's vocabulary chunks for N positions in es-byte storage (lm_head.h):
 * the tied wte is read whole, so only the logits bound them. */
static inline fy_lm_chunks fy_gpt2_chunks(const fy_gpt2_config *cfg, size_t N, size_t es) {
    return fy_lm_chunks_of(N, fy_gpt2_vocab_padded(cfg), es, 0);
}

/* The head's activations (its saved area, used within its loss pass): the final norm,
 * the classifier's running log-sum-exp (lse_sum fp64) and per-position losses. */
#define FY_GPT2_HEAD_ACTS(X)                            \
    X(lnf, (size_t)N * C, S)                             \
    X(lnf_mean, (size_t)N, F)                            \
    X(lnf_rstd, (size_t)N, F)                            \
    X(losses, (size_t)N, F)                              \
    X(lse_max, (size_t)N, F)                             \
    X(lse_sum, (size_t)N, D)                             \
    X(tlogit, (size_t)N, F)
typedef struct fy_gpt2_head_acts { FY_GPT2_HEAD_ACTS(FY_GPT2_ACT_FIELD) } fy_gpt2_head_acts;

/* The head's workspace (shared with the layers'): one vocabulary chunk of logits
 * (overwritten by their gradient in a training step); in training also d lnf summed over
 * the classifier's chunks in fp32, and with bf16 storage d lnf rounded once. Evaluation's
 * is the logits alone (the first field). */
#define FY_GPT2_HEAD_WORK(X)                             \
    X(logits, (size_t)N * (size_t)fy_gpt2_chunks(cfg, N, es).rows, S) \
    X(dlnf32, (size_t)N * C, F)                          \
    X(dlnf, es == 2 ? (size_t)N * C : 0, S)
typedef struct fy_gpt2_head_work { FY_GPT2_HEAD_WORK(FY_GPT2_ACT_FIELD) } fy_gpt2_head_work;

/* Bytes needed for each struct with storage type dt (every field 64-byte aligned), and
 * binding the fields to consecutive pieces of a buffer of that size (a layer's `out` is
 * left alone). The head's work is its training workspace. */
size_t fy_gpt2_layer_acts_nbytes(const fy_gpt2_config *cfg, int B, int T, fy_dtype dt);
/* chunk: the positions of a sequence chunk (fy_model_chunk) */
size_t fy_gpt2_layer_work_nbytes(const fy_gpt2_config *cfg, int B, int T, int chunk, fy_dtype dt);
size_t fy_gpt2_head_acts_nbytes(const fy_gpt2_config *cfg, int B, int T, fy_dtype dt);
size_t fy_gpt2_head_work_nbytes(const fy_gpt2_config *cfg, int B, int T, fy_dtype dt);
size_t fy_gpt2_head_work_eval_nbytes(const fy_gpt2_config *cfg, int B, int T, fy_dtype dt);
void fy_gpt2_layer_acts_bind(const fy_gpt2_config *cfg, int B, int T, fy_dtype dt, void *base,
                             fy_gpt2_layer_acts *out);
void fy_gpt2_layer_work_bind(const fy_gpt2_config *cfg, int B, int T, int chunk, fy_dtype dt, void *base,
                             fy_gpt2_layer_work *out);
void fy_gpt2_head_acts_bind(const fy_gpt2_config *cfg, int B, int T, fy_dtype dt, void *base,
                            fy_gpt2_head_acts *out);
void fy_gpt2_head_work_bind(const fy_gpt2_config *cfg, int B, int T, fy_dtype dt, void *base,
                            fy_gpt2_head_work *out);

/* Forward and backward, block by block. All pointers are device memory; each call
 * queues kernels on s and returns at once. Gradients (g, dwte, ...) accumulate. */
/* docs: (B,T) document starts or NULL (kernels.h), in every pass below that takes it. */
void fy_gpt2_embed_fwd(const fy_gpt2_config *cfg, const fy_gpt2_embed_w *w,
                       const int32_t *tokens, const int32_t *docs, float *x0, int B, int T,
                       fy_stream *s);
/* x_out = layer(x_in); x_out is a->out. */
void fy_gpt2_layer_fwd(const fy_gpt2_config *cfg, const fy_gpt2_layer_w *w,
                       fy_gpt2_layer_acts *a, const float *x_in, fy_gpt2_layer_work *wk,
                       const int32_t *docs, int B, int T, fy_stream *s);
/* Evaluation: per-position losses and loss_out[0] = their sum / loss_div (the targets
 * counted: their mean; kernels.h: a negative target is not counted). */
void fy_gpt2_head_fwd(const fy_gpt2_config *cfg, const fy_gpt2_head_w *w, const float *wte,
                      const float *xL, fy_gpt2_head_acts *a, fy_gpt2_head_work *wk,
                      const int32_t *targets, float *loss_out, int64_t loss_div, int B, int T,
                      fy_stream *s);
/* A training step's head, forward and backward fused chunk by chunk: losses and
 * loss_out[0] as fy_gpt2_head_fwd, the loss scaled by dloss (1 / the step's targets for a
 * mean loss) differentiated: dwte += the classifier's part, g accumulates, dx = d xL. */
void fy_gpt2_head_step(const fy_gpt2_config *cfg, const fy_gpt2_head_w *w,
                       fy_gpt2_head_w *g, const float *wte, float *dwte, const float *xL,
                       fy_gpt2_head_acts *a, fy_gpt2_head_work *wk, const int32_t *targets,
                       float dloss, float *loss_out, int64_t loss_div, float *dx, int B, int T,
                       fy_stream *s);
/* dx holds d x_out on entry and d x_in on return. */
void fy_gpt2_layer_bwd(const fy_gpt2_config *cfg, const fy_gpt2_layer_w *w,
                       fy_gpt2_layer_w *g, const fy_gpt2_layer_acts *a, const float *x_in,
                       fy_gpt2_layer_work *wk, float *dx, const int32_t *docs, int B, int T,
                       fy_stream *s);
/* From dx = d x0: dwte and dwpe accumulate. */
void fy_gpt2_embed_bwd(const fy_gpt2_config *cfg, fy_gpt2_embed_w *g, const int32_t *tokens,
                       const int32_t *docs, const float *dx, int B, int T, fy_stream *s);

#ifdef __cplusplus
}
#endif
#endif
