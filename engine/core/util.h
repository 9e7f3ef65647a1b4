/* util.h — strict parsing of numbers and sizes, clocks, aligned allocation, a string
 * suffix test.
 *
 * The parsers accept a whole string or nothing: trailing junk, empty strings and
 * out-of-range values are errors, so a flag like "--steps 10x" is refused. */
#ifndef FY_UTIL_H
#define FY_UTIL_H

#include <stdbool.h>

#include "engine/core/status.h"
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

int fy_parse_i64(const char *s, int64_t *out);
int fy_parse_f64(const char *s, double *out);
/* "512MiB", "16GiB", "1.5GB", "4096" (bytes), "2K"; binary (KiB/MiB/GiB/TiB, K/M/G/T)
 * and decimal (KB/MB/GB/TB) units. Returns 0 on success. */
int fy_parse_size(const char *s, size_t *out);
/* Writes a human size such as "1.50 GiB" into buf. */
const char *fy_fmt_size(size_t nbytes, char *buf, size_t cap);

/* Opens path for reading without blocking on a FIFO or a device with no writer (the
 * caller's fstat then refuses what is not a regular file): the descriptor (blocking
 * reads again), or -1 with errno. */
int fy_open_read(const char *path);

/* Whether directory entry `name` is <base><tag><pid> (tag such as ".tmp.") of a writer
 * that is no longer running, or of this process (a pid the system gave again): what an
 * interrupted save left, safe to remove. */
bool fy_left_by_dead_writer(const char *name, const char *base, const char *tag);

/* A temporary file to write path through, renamed over it once complete: named
 * <path>.tmp.<pid> (into tmp, cap bytes) and created exclusively, so it is this process's
 * own and never a link (one a killed process with the same pid left is removed first).
 * Opened for writing: the descriptor, or -1 with errno. */
int fy_open_tmp(const char *path, char *tmp, size_t cap);

/* Whether a file can be written at path, checked before any work. A file (written beside
 * path and renamed over it) needs a writable directory, and an existing path must be a
 * regular file; a stream (appended to: metrics) may also be a character device or FIFO,
 * and an existing one must be writable itself. A path ending in '/' names a directory.
 * One error naming `what` (the flag) otherwise: FY_ERR_IO. */
fy_status fy_check_output(const char *path, const char *what, bool stream);

/* fsync of a directory (after creating, renaming or removing entries in it), so what was
 * done there survives a crash. FY_ERR_IO (logged) on failure. */
fy_status fy_fsync_dir(const char *path);
/* Monotonic clock in milliseconds. */
double fy_now_ms(void);
/* The CPUs this process may run on (its affinity: a launcher's binding, taskset), at
 * least 1. */
int fy_cpus_allowed(void);

static inline size_t fy_round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

/* Whether s ends with suffix (s == suffix included). */
static inline bool fy_str_ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && !memcmp(s + a - b, suffix, b);
}

#ifdef __cplusplus
}
#endif
#endif
