/* json_file.h — small JSON files (plans, profiles): read whole and parse; print and write
 * atomically (a temporary name, then rename, so an existing file is never half-written). */
#ifndef FY_JSON_FILE_H
#define FY_JSON_FILE_H

#include <stdbool.h>
#include <stddef.h>

#include <cjson/cJSON.h>

#include "engine/core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FY_JSON_MAX_BYTES (1u << 20)

/* Whether an object anywhere in root holds a key twice (cJSON keeps both and its lookups
 * find the first; Python's json, and so transformers, keeps the last: the two would read
 * different values from one file). The first such key in document order, as a path
 * ("rope_scaling.factor", "blocks[3].params"), goes into where (cap bytes). */
bool fy_json_duplicate(const cJSON *root, char *where, size_t cap);
/* Parses path into *out (caller frees with cJSON_Delete). FY_ERR_IO (logged: "cannot open
 * <what> <path>") if unreadable; FY_ERR_FORMAT (logged) if not JSON, too large, or holding
 * a key twice in one object (fy_json_duplicate). */
fy_status fy_json_read(const char *path, const char *what, cJSON **out);
/* The same file's text (malloc'd, NUL-terminated, n bytes), unparsed: for a parser of
 * its own (the checkpoint state's). The same errors, logged. */
fy_status fy_json_read_text(const char *path, const char *what, char **text, size_t *n);
/* The same file parsed, or NULL without a word if it cannot be read or parsed: for a
 * listing whose reader reports the problem later (weights.h: fy_weights_files). */
cJSON *fy_json_try_read(const char *path);
/* Writes root (pretty-printed) to path atomically. FY_ERR_IO (logged) on failure. */
fy_status fy_json_write(const char *path, const char *what, const cJSON *root);

#ifdef __cplusplus
}
#endif
#endif
