/* paths.h — every file a command reads and every file or directory it writes, checked
 * against each other before anything is written, so that no output ever lands on an
 * input or on another output.
 *
 * A command registers what its flags name (the CLI expands them: --init into its config,
 * index, shards and tokenizer files; --data's glob into its matches), then asks once.
 * Each path is resolved as the kernel would resolve it when written: its directory through
 * realpath, then its last component followed link by link (a dangling link resolves to
 * where it points), and the file it names, if any, by device and inode. Two entries
 * collide when
 *   - they are one file: one resolved path, or one device and inode (hard links);
 *   - one lies inside a directory the other writes whole (--save DIR replaces every name
 *     under DIR), or inside a name that a directory's writer owns (--checkpoint-dir's
 *     step-N directories and `latest`: the first component below the directory, asked of
 *     the writer through `owns`);
 *   - one is named as a temporary of a file the other writes (<name>.tmp.<digits>, which
 *     a save removes as a dead writer's);
 *   - an output would be one of the files an input's glob matches (written first, it
 *     would be read as data), or a directory output would change which files those are
 *     (it is the glob's directory, or holds it, or would create it).
 * Inputs never collide with inputs; entries of one flag are never compared; a writer and
 * a reader the caller allows (--save onto --init: a fine-tune in place) are not compared.
 * A collision is one error line naming both flags and both paths: FY_ERR_USAGE.
 *
 * Nothing here writes or creates anything; paths that do not exist are compared by name.
 * Threads: one thread per fy_paths. */
#ifndef FY_PATHS_H
#define FY_PATHS_H

#include <stdbool.h>

#include "engine/core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What a command does with a path it writes. */
typedef enum fy_path_write {
    FY_PATH_NONE = 0, /* not written (an input only) */
    FY_PATH_FILE,     /* a file written whole: beside it, then renamed over it */
    FY_PATH_STREAM,   /* a file appended to in place (and cut back on a resume) */
    FY_PATH_DIR,      /* a directory replaced whole: every name under it is the output's */
    FY_PATH_DIR_NAMES /* a directory of which the writer creates, replaces and removes the
                         names `owns` accepts, and leaves the others alone */
} fy_path_write;

typedef struct fy_paths fy_paths;

fy_status fy_paths_new(fy_paths **out);
void fy_paths_free(fy_paths *p); /* NULL is a no-op */

/* A file a command reads. `flag` labels it in messages ("--data", "--init"; a string
 * that outlives p); `path` as the user gave it. */
fy_status fy_paths_read(fy_paths *p, const char *flag, const char *path);
/* A glob the command expands and reads (tokens.h's rule): every file it matches now is
 * read, and an output a later match would be is refused. */
fy_status fy_paths_read_glob(fy_paths *p, const char *flag, const char *pattern);
/* A path the command writes as `how` says. `what` says in messages what the writer does
 * to it ("a directory the save replaces whole"); owns (DIR_NAMES only) tells the names
 * under the directory that are the writer's. With `reads` the command also reads it
 * first (a cache it may rewrite). */
fy_status fy_paths_write(fy_paths *p, const char *flag, const char *path, fy_path_write how,
                         const char *what, bool (*owns)(const char *name), bool reads);
/* The writer of flag `out` may land on what flag `in` reads (both labels as registered). */
fy_status fy_paths_allow(fy_paths *p, const char *out, const char *in);

/* Every pair, in registration order: FY_OK, or FY_ERR_USAGE after one logged line naming
 * the first collision's two flags and paths. FY_ERR_NOMEM (logged) if a path could not
 * be resolved for want of memory. */
fy_status fy_paths_check(const fy_paths *p);

/* Whether paths a and b resolve to one file or directory (as above: one resolved path, or
 * one device and inode). */
bool fy_paths_same(const char *a, const char *b);

#ifdef __cplusplus
}
#endif
#endif
