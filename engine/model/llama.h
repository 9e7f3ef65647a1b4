/* llama.h — the Llama family behind the model interface (model.h): Llama 2 and 3 and the
 * models of their shape (Mistral v0.1's sliding window among them).
 *
 * Semantics are Hugging Face LlamaForCausalLM's: token embeddings without learned
 * positions; pre-norm layers, x += o_proj(attn(rope(q, k), v)) over RMSNorm(x), then
 * x += down_proj(silu(gate_proj(h)) * up_proj(h)) over RMSNorm(x); RMSNorm with the
 * config's eps and a gain, no bias anywhere; rotary embeddings on the queries and keys
 * with rope_theta and rope_scaling (none, linear or llama3), rotate_half pairs (rope.h);
 * grouped-query attention (kv_heads dividing heads; head_dim from the config, else
 * channels / heads), causal (and windowed with a sliding_window), scaled by 1/sqrt(head_dim); a final RMSNorm; the classifier
 * lm_head, or the embedding when tie_word_embeddings (Llama 3.2 1B and 3B); mean
 * cross-entropy over all B*T positions, no dropout.
 *
 * Blocks: the embedding (embed_tokens), the L layers, the head (norm and, untied,
 * lm_head; tied, it links to the embedding). Tensor names are Hugging Face's, in full
 * ("model.layers.{i}.self_attn.q_proj.weight"). In memory q, k and v are packed into one
 * (NH + 2 NKV) hd x C matrix, and gate and up into one 2F x C matrix (model.h's packed
 * tensors), so each is one GEMM.
 *
 * Activations: a layer keeps its norms' outputs and rstd, the roped q, k and v, the
 * attention probabilities and output, the residual between its halves, and the gate and
 * up projections; silu(gate) * up is rebuilt in the backward rather than kept. */
#ifndef FY_LLAMA_H
#define FY_LLAMA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/core/status.h"
#include "engine/device/rope.h"
#include "engine/model/lm_head.h"
#include "engine/model/model.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fy_llama_config {
    int vocab;          /* V */
    int max_seq;        /* max_position_embeddings: sequences may not be longer */
    int channels;       /* C, hidden_size */
    int layers;         /* L */
    int heads;          /* NH, num_attention_heads */
    int kv_heads;       /* NKV, num_key_value_heads; divides NH */
    int head_dim;       /* hd; NH * hd need not be C */
    int ffn;            /* F, intermediate_size */
    float norm_eps;     /* rms_norm_eps */
    fy_rope rope;
    bool tied;          /* tie_word_embeddings */
    int sliding_window; /* Mistral's; 0 for none: query t sees keys t - w < j <= t */
} fy_llama_config;

/* Named configs (fy_llama_config_names); FY_ERR_UNSUPPORTED, silently, for another name. */
fy_status fy_llama_config_named(const char *name, fy_llama_config *out);
const char *fy_llama_config_names(void);
/* The named configs of real sizes (a capacity table fills their widths with layers). */
const char *fy_llama_width_names(void);
/* FY_ERR_INVALID (logged) for a shape ferry cannot build. */
fy_status fy_llama_config_check(const fy_llama_config *cfg);
size_t fy_llama_num_params(const fy_llama_config *cfg); /* without padding */
/* The classifier's vocabulary chunks for N positions in es-byte storage (lm_head.h). */
fy_lm_chunks fy_llama_chunks(const fy_llama_config *cfg, size_t N, size_t es);

/* The family's model of a config; name may be NULL (a free shape). */
fy_status fy_llama_new(const fy_llama_config *cfg, const char *name, fy_model **out);
const fy_llama_config *fy_llama_config_of(const fy_model *m);
/* The registry's hooks (model.c): a named config with overrides (heads and channels
 * recompute head_dim; kv_heads, ffn as given); a model from a Hugging Face config.json
 * (llama_io.c). */
fy_status fy_llama_named(const char *name, const fy_model_shape *over, fy_model **out);
fy_status fy_llama_from_weights(const fy_weights *w, const fy_model_shape *hint, fy_model **out);
/* The config.json fields of a model, into cfg (an object; keys ferry does not know are
 * left as they are). */
void fy_llama_hf_config(const fy_model *m, cJSON *cfg);

#ifdef __cplusplus
}
#endif
#endif
