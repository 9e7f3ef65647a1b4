/* model.h — the model interface: everything the engine above engine/model knows of a
 * model. A model is {iface, ctx} (model_impl.h), as the device backends are; a family
 * (GPT-2 today) implements the interface, and storage, plans, the step graph, the trainer
 * and the tuner reach models only through these functions.
 *
 * Blocks are the unit of offload, transfer and optimizer work. A model is a chain of
 * blocks: an embedding (tokens in), layers, and a head (loss out), in that order; each
 * block's kind is a field of its spec. A block's parameters are one contiguous buffer;
 * its spec lists the tensors in it (name, shape, offset, weight decay) and, for a block
 * whose computation uses another block's parameters (a head tied to the embedding), the
 * links: the earlier blocks whose parameters it reads and whose gradients it adds into.
 *
 * Activations, per block and micro-batch (fy_model_acts), in three parts:
 *   out    the block's output, the next block's input: kept from the block's forward to
 *          the next block's backward, also when the block is recomputed ("kept under
 *          recompute");
 *   saved  what the block's backward needs besides its input: kept from its forward to
 *          its backward ("kept" = out + saved), or rebuilt by recomputing the block
 *          into a buffer that recomputed blocks share;
 *   work   transient workspace of the block's tasks, one buffer shared by every block.
 * The activation gradient flowing between blocks (dx) is one buffer of the largest out.
 *
 * Passes, all on device views (fy_block_io), queued on a stream, returning at once:
 *   forward   an embedding or layer block: out from in (or from tokens), filling saved;
 *             recompute is the same call (the block's output comes out the same bits);
 *   backward  an embedding or layer block: dx holds d out on entry and d in on return;
 *             parameter gradients (and its links' gradients) accumulate (+=);
 *   loss      a head block: per-position losses of its input against the targets and
 *             their mean; with dloss != 0 also the backward, fused (dx = d in), so a
 *             head's logits never need to be kept.
 * Every result depends only on the inputs and shapes, never on where buffers live: so
 * every placement of blocks computes the same bits.
 *
 * Threads: a model is immutable after creation; any thread may use it. */
#ifndef FY_MODEL_H
#define FY_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "engine/core/dtype.h"
#include "engine/core/status.h"
#include "engine/device/device.h"
#include "engine/io/weights.h"
#include "engine/model/lm_head.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FY_MODEL_MAX_TENSORS 16
#define FY_MODEL_MAX_LINKS 2
#define FY_MODEL_MAX_LAYERS 4096

/* An embedding's backward reads no parameters (a streamed one is not fetched for it:
 * io->params is then NULL). */
typedef enum fy_block_kind { FY_BLOCK_EMBED = 0, FY_BLOCK_LAYER, FY_BLOCK_HEAD, FY_BLOCK_KINDS } fy_block_kind;
const char *fy_block_kind_name(fy_block_kind k); /* "embed", "layer", "head" */

typedef struct fy_tensor_spec {
    char name[64];      /* the family's file name (Hugging Face's, without a prefix) */
    int rows, cols;     /* (out, in) like torch.nn.Linear; cols == 1: a vector */
    int alloc_rows;     /* rows in memory: rows, or more for padding (kept zero) */
    size_t offset;      /* elements from the block's start, a multiple of 16; tensors with
                           weight decay first, so a block is two optimizer ranges */
    bool decay;         /* AdamW's weight decay applies */
    bool transposed;    /* files store it (in, out) */
    bool packed;        /* placed right after the previous tensor, no padding between:
                           tensors of one fused GEMM (Llama's q, k, v; gate, up) */
} fy_tensor_spec;

typedef struct fy_block_spec {
    fy_block_kind kind;
    int layer;          /* FY_BLOCK_LAYER: 0..L-1; else -1 */
    char name[24];      /* "embed", "layer.3", "head": plan files and messages */
    int ntensors;
    fy_tensor_spec tensors[FY_MODEL_MAX_TENSORS];
    size_t nelem;       /* elements of the block buffer, padding included */
    size_t decay_nelem; /* [0, decay_nelem) has weight decay, the rest not */
    int nlinks;         /* earlier blocks whose parameters every pass of this block reads
                           and whose gradients its backward adds into (tied weights) */
    int links[FY_MODEL_MAX_LINKS];
    bool gather;        /* a table of rows read by token (an untied embedding: one tensor,
                           no block links to it): its forward reads only the rows of
                           io->tokens, its backward reads no parameters and adds only into
                           those rows of grads. A streamed block's passes may then be given
                           a table of just the micro-batch's rows, with the tokens
                           renumbered into it (fy_block_io.tokens), and give back the
                           gradient of those rows alone */
    bool rows_fwd;      /* its forward reads only the rows of io->tokens (a one-table
                           embedding, tied or not; implied by gather): a streamed block's
                           forward may be given just the micro-batch's rows, tokens
                           renumbered into them, as a gather block's passes are */
    bool vocab_chunks;  /* a head whose tensor at offset 0 (Vp rows) is its own
                           classifier, which its loss pass can take by vocabulary chunks
                           (fy_model_head_chunks; fy_block_io.chunk): a streamed head then
                           needs one chunk on the device at a time, not the whole matrix */
} fy_block_spec;

typedef struct fy_model fy_model;

/* Named shapes and overrides: 0 keeps the named model's value. */
typedef struct fy_model_shape {
    int vocab, max_seq, channels, layers, heads;
    int kv_heads, ffn; /* Llama's key/value heads and MLP width */
} fy_model_shape;

/* A named model (see fy_model_names) with the overrides of `over` (may be NULL).
 * FY_ERR_INVALID (logged) for an unknown name or a bad shape. */
fy_status fy_model_named(const char *name, const fy_model_shape *over, fy_model **out);
/* The named models of every family, comma-separated, for --help and errors. */
const char *fy_model_names(void);
/* The named models whose widths a capacity table fills with as many layers as fit
 * (real sizes of families whose layer count is free), comma-separated. */
const char *fy_model_width_names(void);
/* The families and their named models, a line each ("llama: llama-tiny, ..."), and the
 * config.json model types they read, for `ferry info`. */
void fy_model_print_families(FILE *fp);
void fy_model_free(fy_model *m); /* NULL is a no-op */

const char *fy_model_family(const fy_model *m);
/* Sequence chunks: a layer runs its position-wise work (norms, projections, the MLP and
 * their gradients) on at most this many of a micro-batch's B*T positions at a time, so its
 * workspace is bounded by a chunk, not by the sequence (attention needs the whole
 * sequence's q, k and v, and keeps O(T) of its own). FY_MODEL_CHUNK by default (chosen so a
 * chunk's GEMMs still run at full speed); results depend on it (the order in which the
 * chunks' parameter gradients add up), so every plan of a run uses the same. */
#define FY_MODEL_CHUNK 4096
int fy_model_chunk(const fy_model *m);
/* The channels of its attention's heads (kernels.h: FY_ATTN_MAX_HEAD; the cuda backend's
 * limit is lower with fp32 storage: fy_attn_max_head); 0 without attention. */
int fy_model_head_dim(const fy_model *m);
void fy_model_set_chunk(fy_model *m, int positions);
/* The name it was created under ("gpt2-124m"), or the family for a free shape. */
const char *fy_model_name(const fy_model *m);
/* "vocab 50257, positions 1024, channels 768, layers 12, heads 12" */
void fy_model_describe(const fy_model *m, char *buf, size_t cap);
/* A string equal for equal models and different otherwise ("gpt2: vocab 50257, ..."):
 * what profiles record their measured block costs for, and checkpoints their model; at
 * most FY_MODEL_SIGNATURE_MAX bytes with the NUL. */
#define FY_MODEL_SIGNATURE_MAX 640
void fy_model_signature(const fy_model *m, char *buf, size_t cap);
bool fy_model_same(const fy_model *a, const fy_model *b);

int fy_model_nblocks(const fy_model *m);
const fy_block_spec *fy_model_block(const fy_model *m, int b);
int fy_model_layers(const fy_model *m);  /* blocks of kind FY_BLOCK_LAYER */
int fy_model_vocab(const fy_model *m);   /* token ids must be below it */
size_t fy_model_num_params(const fy_model *m); /* without padding */
size_t fy_model_max_block_nelem(const fy_model *m); /* the largest block's nelem */
/* FY_ERR_INVALID (logged) if sequences of T tokens do not fit the model. */
fy_status fy_model_check_seq(const fy_model *m, int64_t T);

/* ---- activations and passes -------------------------------------------------------- */

typedef struct fy_act_sizes {
    size_t out, saved, work; /* bytes; see the top */
} fy_act_sizes;

/* Block b's activation bytes for a micro-batch of B x T in storage type dt (F32 or
 * BF16), for training (with backward) or evaluation. */
void fy_model_acts(const fy_model *m, int b, int B, int T, fy_dtype dt, bool training,
                   fy_act_sizes *out);

/* Device views of one block's pass. Tensors are in the stream's storage type except the
 * loss (fp32) and token ids (int32). */
typedef struct fy_block_io {
    int B, T;
    const void *params;                           /* the block's parameters */
    void *grads;                                  /* its gradient (+=); backward and loss */
    const void *link_params[FY_MODEL_MAX_LINKS];  /* the linked blocks' parameters */
    void *link_grads[FY_MODEL_MAX_LINKS];         /* the linked blocks' gradients (+=) */
    const void *in;                               /* the previous block's out; NULL first */
    void *out;                                    /* this block's out (act sizes .out) */
    void *saved;                                  /* .saved bytes */
    void *work;                                   /* .work bytes (the largest of all) */
    void *dx;                                     /* backward: d out in, d in out */
    const int32_t *tokens;                        /* (B, T): embedding input */
    const int32_t *docs;                          /* (B, T): each position's document
                                                     start (kernels.h), or NULL: one
                                                     document a sequence */
    int table_rows;                               /* a gathered pass of a gather block:
                                                     the rows params and grads hold (the
                                                     tokens are renumbered into them);
                                                     0: the whole table */
    const int32_t *targets;                       /* (B, T): head; a negative one is not
                                                     counted (kernels.h: the loss mask) */
    float dloss;                                  /* loss: 0 evaluates; else the loss's
                                                     scale (1 / the step's targets for a
                                                     mean), and the backward runs too */
    float *loss;                                  /* loss: device fp32, the sum of the
                                                     losses / loss_div */
    int64_t loss_div;                             /* loss: the targets counted (evaluation:
                                                     the batch's; training: the step's, so
                                                     the micro-batches' losses add up to
                                                     the step's mean); 0: B*T */
    bool chunked;                                 /* loss of a vocab_chunks head: one
                                                     chunk (below), not the whole pass */
    int chunk;                                    /* chunked: the chunk, k */
    bool chunk_bwd;                               /* chunked: its backward */
} fy_block_io;

/* The loss's divisor (loss_div, its default B*T). */
static inline int64_t fy_block_loss_div(const fy_block_io *io) {
    return io->loss_div > 0 ? io->loss_div : (int64_t)io->B * io->T;
}

/* A vocab_chunks head's loss, chunk by chunk (lm_head.h's order), with K chunks:
 *   chunk k forward (chunked, chunk_bwd false), k = 0..K-1: k = 0 first runs what precedes the
 *     classifier, k = K-1 writes the loss; in training (dloss != 0) chunk K-1 also runs
 *     its backward on the logits it just made;
 *   chunk k backward (chunk_bwd true, dloss != 0), k = K-2..0: k = 0 ends with d in (dx)
 *     and the gradients of the head's other tensors.
 * params and grads are then chunk views: the classifier's rows of chunk k (the chunk's
 * rows region holds `rows` rows, fy_lm_chunks), followed by the block's other tensors
 * (fy_model_chunk_view); grads is zeroed by the caller for every chunk. The whole pass
 * (chunked false) computes the same bits. */
fy_lm_chunks fy_model_head_chunks(const fy_model *m, int B, int T, fy_dtype dt);
/* Elements of a chunk view of vocab_chunks block b with chunks c. */
size_t fy_model_chunk_view_nelem(const fy_model *m, int b, fy_lm_chunks c);
/* Element offsets, in block b's buffer, of the classifier rows of chunk k and of the
 * other tensors (which a chunk view holds after `rows` rows). */
void fy_model_chunk_ranges(const fy_model *m, int b, fy_lm_chunks c, int k, size_t *rows_off,
                           size_t *rows_nelem, size_t *tail_off, size_t *tail_nelem);

void fy_model_forward(const fy_model *m, int b, const fy_block_io *io, fy_stream *s);
void fy_model_backward(const fy_model *m, int b, const fy_block_io *io, fy_stream *s);
void fy_model_loss(const fy_model *m, int b, const fy_block_io *io, fy_stream *s);

/* The family's initialisation of block b into host fp32 memory (nelem floats, padding
 * zero), the same for a seed whatever the order blocks are initialised in. */
void fy_model_init_block(const fy_model *m, int b, uint64_t seed, float *host);

/* ---- costs, for the tuner's analytic model ------------------------------------------- */

typedef enum fy_pass { FY_PASS_FWD = 0, FY_PASS_BWD, FY_PASS_LOSS } fy_pass;
typedef struct fy_cost {
    double flops;  /* matmul FLOPs */
    double bytes;  /* device memory traffic besides the GEMMs' operands */
} fy_cost;
/* Work of one pass of block b over a B x T micro-batch with es-byte storage (LOSS: the
 * head's forward and backward together). */
void fy_model_cost(const fy_model *m, int b, fy_pass pass, int B, int T, double es,
                   fy_cost *out);

/* ---- weights: files and Hugging Face directories (model_io.c) ------------------------ */

/* The model a weights source holds (weights.h): its family from config.json's model_type
 * (gpt2; llama; mistral, whose sliding window then bounds the sequence) or, without a
 * config, from its tensors (GPT-2's; `hint` gives what such a file may not say: the
 * heads); then fy_model_check_weights, and a warning for each stored tensor the model
 * ties instead of reading (fy_model_warn_tied). FY_ERR_FORMAT / FY_ERR_INVALID (one logged
 * line naming the file and the field or tensor). */
fy_status fy_model_from_weights(const fy_weights *w, const fy_model_shape *hint, fy_model **out);
/* Whether w holds exactly the model's tensors: each with the model's shape and a type
 * ferry reads (F32, BF16, F16), and nothing else but buffers the family skips and tensors
 * it ties to a parameter (a tied head's stored lm_head.weight). */
fy_status fy_model_check_weights(const fy_model *m, const fy_weights *w);
/* One warning for each tensor of w the model ties to a parameter instead of reading (a
 * tied head's lm_head.weight, which transformers drops the same way): it names the tensor
 * and says whether it is a byte-for-byte copy of the parameter or differs (then its
 * values are lost). Compares the two mapped tensors once (reads both from the file). */
void fy_model_warn_tied(const fy_model *m, const fy_weights *w);
/* Reads block b's tensors from w into host (nelem floats, padding zero): one block at a
 * time, so loading a model needs one block of memory besides the model's own. */
fy_status fy_model_load_block(const fy_model *m, const fy_weights *w, int b, float *host);
/* Every block into host[b]. */
fy_status fy_model_load(const fy_model *m, const fy_weights *w, float *const *host);

/* A block's parameters for saving: fills host (nelem floats) with block b's. */
typedef fy_status (*fy_block_source)(void *ctx, int b, float *host);

#define FY_SAVE_SHARD_DEFAULT ((size_t)5000000000) /* 5 GB, as transformers */

typedef struct fy_save_opts {
    fy_dtype dtype;          /* F32 (also for NONE) or BF16 */
    size_t shard_nbytes;     /* a directory's shards at most (0: FY_SAVE_SHARD_DEFAULT); a
                                larger tensor gets a shard of its own */
    const fy_weights *from;  /* the weights the model was read from, or NULL: a directory
                                written keeps the other fields of their config.json (token
                                ids, ...) and gets copies of their tokenizer files */
    uint32_t *crc32c;        /* a single .safetensors file: if not NULL, gets the CRC-32C of
                                the file written */
    float *block_buf;        /* fy_model_save_buf_nelem floats that blocks are fetched into,
                                the caller's (one saving several files passes the same:
                                fresh pages cost more to touch than to fill), or NULL: the
                                save allocates its own */
} fy_save_opts;

/* The floats of fy_save_opts.block_buf: two of the largest block (a save fetches the next
 * block while it writes one). */
size_t fy_model_save_buf_nelem(const fy_model *m);

/* Writes the model's parameters, fetched block by block from get, in order, on the calling
 * thread (a thread of the save's own writes meanwhile; get must not wait for it). A path
 * ending in .safetensors is one file (its config in metadata "ferry.config"); any other
 * path is a Hugging Face directory: config.json (with torch_dtype), model.safetensors or shards
 * model-0000i-of-0000n.safetensors of at most o->shard_nbytes with
 * model.safetensors.index.json, that transformers' from_pretrained loads with no key
 * missing or unexpected. Atomic: a directory is written beside the path, fsynced and
 * renamed over it; an existing path is replaced only when it holds nothing but what ferry
 * writes (fy_model_save_check). FY_ERR_IO / FY_ERR_INVALID (logged). */
fy_status fy_model_save(const fy_model *m, const char *path, const fy_save_opts *o,
                        fy_block_source get, void *ctx);
/* The same from every block's buffer host[b]. */
fy_status fy_model_save_host(const fy_model *m, const char *path, const fy_save_opts *o,
                             float *const *host);
/* Whether fy_model_save may write path (checked before a run, so a long run does not end
 * unable to save): a .safetensors path in a directory that exists, not a directory
 * itself; any other path new, or a directory holding only what ferry writes.
 * FY_ERR_INVALID (logged). */
fy_status fy_model_save_check(const char *path);

#ifdef __cplusplus
}
#endif
#endif
