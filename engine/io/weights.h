/* weights.h — a model's weights as a user has them: one safetensors file; a Hugging Face
 * index (model.safetensors.index.json) with its shards; or a directory holding either,
 * with the config.json that says what the model is. Every shard is memory-mapped
 * (safetensors.h) and read tensor by tensor, so loading costs no memory beyond the
 * buffers the tensors are read into.
 *
 * The config: a directory's config.json, or the one beside an index or a file; for a
 * file, its "ferry.config" metadata (ferry's single-file saves) comes first. None is an
 * error for a directory or an index, and allowed for a file (GPT-2 files without one are
 * recognised by their tensors).
 *
 * Consistency, checked at open (FY_ERR_FORMAT, one logged line naming the file and what is
 * wrong): the index's weight_map names shards that exist and are sound, and each tensor
 * is in the shard it names; every tensor of a shard is in the map; no name is in two
 * shards. */
#ifndef FY_WEIGHTS_H
#define FY_WEIGHTS_H

#include <cjson/cJSON.h>

#include "engine/core/status.h"
#include "engine/io/safetensors.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FY_HF_INDEX_NAME "model.safetensors.index.json"
#define FY_HF_SINGLE_NAME "model.safetensors"
#define FY_HF_CONFIG_NAME "config.json"

/* The tokenizer and generation files of a model directory, which a directory save copies
 * from the one it read (NULL-terminated). */
extern const char *const fy_hf_aux_names[];

typedef struct fy_weights fy_weights;

/* path: a .safetensors file, an index file, or a directory with config.json and either
 * model.safetensors or the index. FY_ERR_IO / FY_ERR_FORMAT (logged). */
fy_status fy_weights_open(const char *path, fy_weights **out);
void fy_weights_close(fy_weights *w); /* NULL is a no-op */

/* Every file of path that fy_weights_open reads or a directory save copies, each to fn
 * (stopping at its first failure, returned): the .safetensors file, or the index and the
 * shards it names; the config.json of the directory; the fy_hf_aux_names there. Only what
 * exists; nothing is opened but the index, nothing is logged (a path that does not open
 * names what it can, and fy_weights_open says what is wrong). */
typedef fy_status (*fy_weights_file_fn)(void *ctx, const char *path);
fy_status fy_weights_files(const char *path, fy_weights_file_fn fn, void *ctx);

const char *fy_weights_path(const fy_weights *w); /* as given */
/* The directory the files are in ("." for a bare file name). */
const char *fy_weights_dir(const fy_weights *w);

/* Every tensor of every shard, in shard order; *file (if not NULL) gets its shard. */
int fy_weights_count(const fy_weights *w);
const fy_st_tensor *fy_weights_at(const fy_weights *w, int i, const fy_st_file **file);
/* The tensor of that name, or NULL. */
const fy_st_tensor *fy_weights_find(const fy_weights *w, const char *name,
                                    const fy_st_file **file);
/* The first shard's metadata value, or NULL. */
const char *fy_weights_meta(const fy_weights *w, const char *key);

/* The config (NULL if none) and where it came from (a path, or "<file> (ferry.config)"). */
const cJSON *fy_weights_config(const fy_weights *w);
const char *fy_weights_config_path(const fy_weights *w);

#ifdef __cplusplus
}
#endif
#endif
