/* outfile.h — a new file written front to back at the disk's speed, its CRC-32C taken on
 * the way.
 *
 * The caller fills a ring of aligned buffers (copying in with fy_outfile_write, or writing
 * in place through fy_outfile_span and fy_outfile_commit), taking the CRC of each as it
 * hands it over, while a thread writes the full ones, in order, each at its offset (a
 * multiple of the buffer size). A file of at least one buffer is written with O_DIRECT: the
 * bytes go from the buffers to the disk, not through the page cache (whose first touch of
 * fresh pages, and writeback, run slower than the disk on the machines measured:
 * bench/RESULTS.md); its last bytes (less than one 4 KiB block) go through the page cache.
 * Where the filesystem refuses O_DIRECT (tmpfs, some network filesystems), or asked to
 * (cfg->buffered), or for a file smaller than a buffer, plain write()s, each buffer's
 * writeback started as soon as it is written (sync_file_range). The bytes in the file are
 * the same either way. fy_outfile_close fsyncs.
 *
 * Errors are logged once, naming the file ("cannot write PATH: why"); after one, every
 * call returns it and nothing more is written. The caller removes a file it abandons.
 *
 * Test hooks: FERRY_TEST_OUTFILE_CHUNK=N in the environment makes the buffers N bytes
 * where the caller leaves the size to the default (the seams then fall everywhere);
 * FERRY_TEST_OUTFILE_BUFFERED=1 turns O_DIRECT off.
 *
 * Threads: one caller thread per outfile (the writer thread is the outfile's own). */
#ifndef FY_OUTFILE_H
#define FY_OUTFILE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FY_OUTFILE_CHUNK ((size_t)8 << 20) /* a buffer: large enough for the disk's full
                                              speed, small enough to overlap the filling */
#define FY_OUTFILE_ALIGN 4096              /* O_DIRECT's buffer and offset alignment */

typedef struct fy_outfile_cfg {
    size_t chunk_nbytes;   /* a buffer's bytes, a multiple of FY_OUTFILE_ALIGN (0: the default) */
    int nchunks;           /* buffers in the ring, at least 2 (0: 3) */
    bool buffered;         /* never O_DIRECT */
} fy_outfile_cfg;

typedef struct fy_outfile fy_outfile;

/* Creates path (it must not exist: O_EXCL, mode 0644) for about nbytes_hint bytes (which
 * sizes the buffers and picks the path; any count may then be written). cfg may be NULL.
 * FY_ERR_IO ("cannot create PATH: why", logged) or FY_ERR_NOMEM (logged). */
fy_status fy_outfile_open(const char *path, uint64_t nbytes_hint, const fy_outfile_cfg *cfg,
                          fy_outfile **out);
/* Appends n bytes. */
fy_status fy_outfile_write(fy_outfile *f, const void *data, size_t n);
/* Where the next bytes go in place: *p with *avail >= 1 bytes free, valid until the next
 * call on f. fy_outfile_commit(f, k) then appends the first k <= *avail of them. */
fy_status fy_outfile_span(fy_outfile *f, void **p, size_t *avail);
fy_status fy_outfile_commit(fy_outfile *f, size_t k);
/* Writes what is left, fsyncs and closes, and frees f: the bytes written and their
 * CRC-32C into *nbytes and *crc (each may be NULL). On failure (logged) f is freed too. */
fy_status fy_outfile_close(fy_outfile *f, uint64_t *nbytes, uint32_t *crc);
/* Stops, closes and frees f without finishing the file (NULL is a no-op). */
void fy_outfile_abandon(fy_outfile *f);

#ifdef __cplusplus
}
#endif
#endif
