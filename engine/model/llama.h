/* llama.h — the Llama family behind the model interface (model.h), and the families that
 * are Llama with switches: Mistral, Qwen2 and Qwen2.5, Qwen3, Gemma 2, Gemma 3 (its text
 * model) and Phi-3 (Phi-3.5, Phi-4 mini). One implementation; a config's fields say what
 * differs (fy_llama_config), its arch only which names and config.json it reads and writes.
 *
 * Semantics are Hugging Face's modeling code for each (LlamaForCausalLM's, and the
 * others' where they differ): token embeddings without learned positions (Gemma: times
 * sqrt(hidden_size) in the storage type); pre-norm layers, x += o_proj(attn(rope(q, k), v))
 * over RMSNorm(x), then x += down_proj(act(gate_proj(h)) * up_proj(h)) over RMSNorm(x)
 * (act SiLU, or Gemma's tanh GELU); Gemma's sandwich norms also normalise the attention's
 * and the MLP's outputs before they are added; RMSNorm with the config's eps and a gain w,
 * or Gemma's 1 + w; biases on q, k and v for Qwen2, none elsewhere; Qwen3's and Gemma 3's
 * per-head RMSNorm of q and k before the rotation; rotary embeddings with rope_theta and
 * rope_scaling (none, linear, llama3, Phi-3's longrope; partial rotation), Gemma 3's local
 * layers with their own base; grouped-query attention (kv_heads dividing heads; head_dim
 * from the config, else channels / heads), causal, windowed on the layers a pattern marks
 * local (Mistral and Phi-3: every layer; Gemma 2: every other; Gemma 3: five of six),
 * scaled by 1/sqrt(head_dim) or Gemma's query_pre_attn_scalar^-1/2, its scores soft-capped
 * by Gemma 2; a final RMSNorm; the classifier lm_head, or the embedding when tied; Gemma
 * 2's logits soft-capped; mean cross-entropy over all B*T positions, no dropout.
 *
 * Blocks: the embedding (embed_tokens), the L layers, the head (norm and, untied,
 * lm_head; tied, it links to the embedding). Tensor names are Hugging Face's, in full
 * ("model.layers.{i}.self_attn.q_proj.weight"). In memory q, k and v are packed into one
 * (NH + 2 NKV) hd x C matrix (and their biases into one vector), and gate and up into one
 * 2F x C matrix (model.h's packed tensors), so each is one GEMM; Phi-3 publishes them
 * packed so (qkv_proj, gate_up_proj).
 *
 * Activations: a layer keeps its norms' outputs and rstd, the roped q, k and v (and, with
 * q/k norms, the projections before them), the attention's output and log-sum-exp, the
 * residual between its halves, the gate and up projections (and, with sandwich norms, the
 * attention's and MLP's outputs before their norms); act(gate) * up is rebuilt in the
 * backward rather than kept. */
#ifndef FY_LLAMA_H
#define FY_LLAMA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/core/status.h"
#include "engine/device/kernels.h"
#include "engine/device/rope.h"
#include "engine/model/lm_head.h"
#include "engine/model/model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Which published family a config is: its tensor names and its config.json. */
typedef enum fy_llama_arch {
    FY_ARCH_LLAMA = 0, FY_ARCH_MISTRAL, FY_ARCH_QWEN2, FY_ARCH_QWEN3, FY_ARCH_GEMMA2,
    FY_ARCH_GEMMA3, FY_ARCH_PHI3
} fy_llama_arch;

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
    fy_rope rope;       /* the (global) layers' rotation; longrope: ext holds the short factors */
    bool tied;          /* tie_word_embeddings */
    int sliding_window; /* 0 for none: on a local layer query t sees keys t - w < j <= t */
    /* the switches (all zero: Llama) */
    fy_llama_arch arch;
    int local_pattern;  /* 0: every layer local (windowed when sliding_window); p: layer l is
                           global when (l + 1) % p == 0 (Gemma 2: 2, Gemma 3: 6) */
    fy_rope rope_local; /* a local layer's rotation under a pattern (Gemma 3's
                           rope_local_base_freq; Gemma 2's is rope) */
    float rope_long[FY_ROPE_MAX_PAIRS]; /* longrope's long factors, used for sequences
                                           longer than rope.orig_max_pos */
    bool qkv_bias;      /* biases on q, k and v (Qwen2) */
    bool qk_norm;       /* per-head RMSNorm of q and k before the rotation (Qwen3, Gemma 3) */
    bool sandwich;      /* norms on the attention's and MLP's outputs too (Gemma) */
    float norm_offset;  /* RMSNorm's gain is w + norm_offset (Gemma: 1) */
    fy_glu_act act;     /* the MLP's gate activation */
    bool embed_scale;   /* embeddings times sqrt(C) (Gemma) */
    float query_scalar; /* scores scaled by query_scalar^-1/2; 0: head_dim (Gemma's
                           query_pre_attn_scalar) */
    float attn_softcap; /* scores s become cap tanh(s / cap); 0: none (Gemma 2) */
    float final_softcap;/* the logits likewise (Gemma 2) */
} fy_llama_config;

/* The window of layer l (0: none) and its rotation for sequences of T positions. */
int fy_llama_layer_window(const fy_llama_config *cfg, int l);
fy_rope fy_llama_layer_rope(const fy_llama_config *cfg, int l, int T);
/* The arch's model_type and transformers class ("qwen2", "Qwen2ForCausalLM"). */
const char *fy_llama_arch_type(fy_llama_arch a);
const char *fy_llama_arch_class(fy_llama_arch a);

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
