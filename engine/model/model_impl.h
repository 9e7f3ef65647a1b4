/* model_impl.h — what a model family implements; included by families and model.c only.
 *
 * A family fills a fy_model_iface and builds its models with fy_model_create: the block
 * specs (kinds, tensors, links) are data the wrapper owns and checks once (a chain of an
 * embedding, layers and a head; links only to earlier blocks; tensor offsets placed by
 * fy_model_place_tensors). The wrapper (model.c) owns the accessors, the checks and the
 * weights files, which it reads and writes through the tensor specs; the family gives
 * the passes, the activation sizes, the costs and the initialisation.
 *
 * Registry: the families ferry knows by name are listed in model.c (named configs and
 * file recognition); a family used only in tests builds its models directly. */
#ifndef FY_MODEL_IMPL_H
#define FY_MODEL_IMPL_H

#include "engine/model/model.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fy_model_iface {
    const char *family;
    void (*free)(void *ctx);
    /* the shape in words, as fy_model_describe */
    void (*describe)(const fy_model *m, char *buf, size_t cap);
    fy_status (*check_seq)(const fy_model *m, int64_t T);
    void (*acts)(const fy_model *m, int b, int B, int T, fy_dtype dt, bool training,
                 fy_act_sizes *out);
    void (*forward)(const fy_model *m, int b, const fy_block_io *io, fy_stream *s);
    void (*backward)(const fy_model *m, int b, const fy_block_io *io, fy_stream *s);
    void (*loss)(const fy_model *m, int b, const fy_block_io *io, fy_stream *s);
    /* a vocab_chunks head's chunks (may be NULL when no block has vocab_chunks) */
    fy_lm_chunks (*head_chunks)(const fy_model *m, int B, int T, fy_dtype dt);
    void (*init_block)(const fy_model *m, int b, uint64_t seed, float *host);
    void (*cost)(const fy_model *m, int b, fy_pass pass, int B, int T, double es, fy_cost *out);
    /* weights files: name prefixes accepted on load ("transformer.") besides none,
     * NULL-terminated (may be NULL); the prefix a directory ferry writes gives every name
     * ("transformer." for GPT-2's, so transformers' LMHead classes find them all); tensors
     * a file may hold that are not parameters (buffers), skipped on load (may be NULL);
     * a stored tensor the model ties to one of its parameters instead of reading it (a
     * tied head's lm_head.weight): that parameter's name, or NULL (may be NULL), and what
     * a user who wants that tensor trained can do (for the warning); the
     * config.json fields that rebuild the model, set in cfg (an object that may already
     * hold other keys, kept) */
    const char *const *file_prefixes;
    const char *dir_prefix;
    bool (*ignored)(const fy_model *m, const char *name);
    const char *(*tied_to)(const fy_model *m, const char *name);
    const char *untie_hint;
    void (*hf_config)(const fy_model *m, cJSON *cfg);
} fy_model_iface;

struct fy_model {
    const fy_model_iface *iface;
    void *ctx;
    char name[48];
    int nblocks, layers, vocab;
    int chunk;          /* positions a layer's position-wise work runs on at once
                           (fy_model_chunk) */
    int head_dim;       /* its attention's widest head (fy_model_head_dim; the family sets
                           it after fy_model_create) */
    size_t num_params;
    fy_block_spec *blocks;
};

/* Takes ownership of ctx (freed by iface->free) and blocks (nblocks specs, calloc'd);
 * checks the chain and the links. FY_ERR_INVALID (logged) if they are wrong; ctx and
 * blocks are freed then too. */
fy_status fy_model_create(const fy_model_iface *iface, void *ctx, const char *name,
                          fy_block_spec *blocks, int nblocks, int vocab, size_t num_params,
                          fy_model **out);

/* Adds a tensor to a block spec (FY_ASSERT on overflow). */
void fy_model_add_tensor(fy_block_spec *blk, const char *name, int rows, int cols, bool decay,
                         bool transposed);
/* Marks the tensor added last as packed after the one before it (fy_tensor_spec.packed):
 * both must have the same columns and weight decay. */
void fy_model_pack_last(fy_block_spec *blk);
/* Places a block's tensors: decayed ones first (in order), then the rest, each at a
 * multiple of 16 elements unless packed; sets nelem and decay_nelem. */
void fy_model_place_tensors(fy_block_spec *blk);

/* A block buffer (nelem elements of type dt) seen as its n tensors, in spec order: a
 * family's weight struct of float pointers filled as an array (NULL base: all NULL). */
void fy_model_view(const fy_block_spec *blk, fy_dtype dt, const void *base, float **fields, int n);
/* The same for a chunk view of a vocab_chunks head (model.h): its classifier rows region
 * holds `rows` rows. */
void fy_model_chunk_view(const fy_block_spec *blk, fy_dtype dt, const void *base, int rows,
                         float **fields, int n);

/* Rows [r0, ...) of a row-major tensor of `width` es-byte elements a row: where a layer's
 * sequence chunk starts in an activation. */
static inline float *fy_rows(const void *x, size_t r0, size_t width, size_t es) {
    return (float *)((const char *)x + r0 * width * es);
}

/* The (query, key) pairs a sequence of T attends over, causal, with a window of w keys
 * (0: none): the tiled attention's work is about this many score products (the tiles
 * along the mask's edges add a little). Packed documents would make it fewer; the costs
 * assume one document a sequence. */
double fy_attn_pairs(int T, int window);

/* p[0..n) ~ N(0, std), from a stream of its own seeded by (seed, block, tensor), so a
 * block's initialisation does not depend on the order blocks are initialised in. */
void fy_model_fill_normal(float *p, size_t n, double std, uint64_t seed, int block, int tensor);

/* Activation structs bound to consecutive 64-byte aligned pieces of one buffer: the
 * X-macro lists (field, elements, type) with type S (the storage type, es bytes) or F
 * (fp32); a field of no elements is bound to NULL. Families use these to size and bind
 * their out/saved/work areas. */
#define FY_ACT_ES_S(es) (es)
#define FY_ACT_ES_F(es) sizeof(float)
#define FY_ACT_ES_D(es) sizeof(double) /* fp64: the field's float pointer is cast */
#define FY_ACT_FIELD(field, size, type) float *field;
#define FY_ACT_SIZE(field, size, type) total += fy_round_up((size) * FY_ACT_ES_##type(es), 64);
#define FY_ACT_BIND(field, size, type) \
    out->field = base && (size) != 0 ? (float *)((char *)base + off) : NULL; \
    off += fy_round_up((size) * FY_ACT_ES_##type(es), 64);

#ifdef __cplusplus
}
#endif
#endif
