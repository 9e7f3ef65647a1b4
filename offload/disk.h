/* disk.h — the disk tier's scratch file: one preallocated file per process under
 * --disk-dir, read and written in large aligned pieces by a small pool of threads.
 *
 * Design. A run that keeps optimizer state on disk (layout.h: FY_TIER_DISK) asks for one
 * scratch file of the bytes its layout lists. The file is created under the directory
 * the user named, which must exist and hold nothing (anything there is someone's: it is
 * refused, never touched), preallocated in full (posix_fallocate: a full disk is one
 * error when the run starts, not in its hundredth step), and unlinked at once: it has no
 * name while the run holds it, so however the run ends (an error, a signal, SIGKILL) the
 * directory is left as it was and the space is returned when the process exits.
 *
 * I/O is direct (O_DIRECT: no page cache, so reading 12 bytes a parameter back does not
 * evict the host's working set and runs at the device's speed) where the filesystem
 * allows it, else buffered, said once (fy_disk_direct). Every offset, length and buffer
 * given to fy_disk_read / fy_disk_write is a multiple of FY_DISK_ALIGN (the caller pads;
 * fy_disk_align_up). A call cuts its range into pieces of at most FY_DISK_PIECE bytes
 * and keeps up to `qdepth` of them in flight on the pool's threads, returning when all
 * are done: a queue depth of qdepth, which the probe measures at (fy_disk_bench).
 *
 * Errors: an I/O error or short transfer is FY_ERR_IO, logged once as one line naming
 * the directory's file and the offset (the file has no name after the unlink, so it is
 * named as DIR/<its name when created> (unlinked)). Test hook: with
 * FERRY_TEST_DISK_FAIL_AT=K in the environment, the process's K-th read or write (from
 * 1, counted over all fy_disk objects) fails with EIO.
 *
 * Threads: fy_disk_read/fy_disk_write may be called from several threads at once (each
 * call waits for its own pieces); open and close from one. */
#ifndef FY_DISK_H
#define FY_DISK_H

#include <stdbool.h>
#include <stddef.h>

#include "engine/core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FY_DISK_ALIGN ((size_t)4096)
#define FY_DISK_PIECE ((size_t)8 << 20)  /* bytes of one request in flight */
#define FY_DISK_QDEPTH 4                 /* default requests in flight per call */

typedef struct fy_disk fy_disk;

static inline size_t fy_disk_align_up(size_t n) {
    return (n + FY_DISK_ALIGN - 1) & ~(FY_DISK_ALIGN - 1);
}

/* FY_OK if dir is an existing, writable directory that holds nothing; else FY_ERR_IO
 * (logged once: "--disk-dir DIR: ..." naming what is wrong, e.g. the first entry it
 * holds). Checked before any work. */
fy_status fy_disk_check_dir(const char *dir);

/* Creates the scratch file for rank `rank` (0 alone) under dir, nbytes (rounded up to
 * FY_DISK_ALIGN) preallocated, unlinked; qdepth threads (0: FY_DISK_QDEPTH).
 * FY_ERR_IO (logged once, naming the file and the bytes: a full disk, no permission)
 * or FY_ERR_NOMEM. nbytes 0, a negative rank or a qdepth outside 0..256 is refused
 * (FY_ERR_INVALID: a bug). */
fy_status fy_disk_open(const char *dir, int rank, size_t nbytes, int qdepth, fy_disk **out);
/* Closes the file (its space is returned) and stops the pool. NULL is a no-op. */
void fy_disk_close(fy_disk *d);

/* n bytes at offset off into/from buf (all multiples of FY_DISK_ALIGN, within the file).
 * FY_ERR_IO (logged) on an I/O error or a short transfer. */
fy_status fy_disk_read(fy_disk *d, size_t off, void *buf, size_t n);
fy_status fy_disk_write(fy_disk *d, size_t off, const void *buf, size_t n);

size_t fy_disk_nbytes(const fy_disk *d);   /* the file's size */
bool fy_disk_direct(const fy_disk *d);     /* whether I/O bypasses the page cache */
const char *fy_disk_name(const fy_disk *d);/* "DIR/ferry-scratch-<pid>-r<rank>" */

/* Sequential write then read bandwidth, GB/s (1e9 bytes), of a scratch file of nbytes
 * in dir through this path at queue depth qdepth (the probe's measurement: the file
 * is written, fsynced, then read back; with buffered I/O the page cache is dropped for
 * it first with posix_fadvise, so the read is the disk's). FY_ERR_IO (logged). */
fy_status fy_disk_bench(const char *dir, size_t nbytes, int qdepth, double *write_gbps,
                        double *read_gbps);

/* An aligned host buffer of n bytes (rounded up to FY_DISK_ALIGN), touched; free with
 * free(). NULL when out of memory. */
void *fy_disk_buffer(size_t n);

#ifdef __cplusplus
}
#endif
#endif
