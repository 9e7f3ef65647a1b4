/* disk.c — the disk tier's scratch file (see disk.h): one preallocated, unlinked file per
 * process, read and written through a pool of threads.
 *
 * The pool. fy_disk_open starts qdepth threads that serve one queue of calls. A call
 * (fy_disk_read / fy_disk_write) lives on its caller's stack: it is queued, the threads
 * take its pieces (at most FY_DISK_PIECE bytes each, from its front) one at a time, and
 * the caller sleeps on the call's own condition variable until its last piece is done.
 * A call with pieces left goes back to the queue's tail after each one it gives, so
 * callers on several threads share the pool round-robin. At most qdepth pieces are in
 * flight over all calls: one per thread.
 *
 * Invariants (under mu): a call is queued exactly while next_off < end; pending counts
 * its pieces not yet done, claimed or not; a thread touches a call only between claiming
 * a piece and counting it done, so the caller may leave once pending is 0. After a
 * piece fails, the call's remaining pieces are counted done without I/O: the caller
 * gets the first failure, logged once by the caller's thread.
 *
 * Opening: the file is created exclusively, its name removed at once (a run that dies
 * leaves nothing under the directory), then preallocated. O_DIRECT is asked of the open
 * file with fcntl (F_SETFL): a filesystem without direct I/O answers EINVAL there, and
 * the file stays buffered (fy_disk_direct). Asking at open(2) instead creates the file
 * before refusing the flag, and a second exclusive create of the name then fails. */
#include "offload/disk.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/core/util.h"

#define QDEPTH_MAX 256
#define BENCH_CHUNK ((size_t)64 << 20) /* bytes a bench call moves: amortises the drain */
#define SHORT_READ (-1)                /* a transfer's error: a read gave 0 bytes */

typedef struct disk_call {
    struct disk_call *next; /* in the queue */
    bool write;
    char *buf;              /* holds bytes [off, end) of the file */
    size_t off, end;
    size_t next_off;        /* the first byte no thread has claimed */
    size_t pending;         /* pieces not done yet */
    int err;                /* the first failure: an errno or SHORT_READ; 0: none */
    size_t err_off, err_len;/* the piece that failed */
    pthread_cond_t done;    /* signalled when pending reaches 0 */
} disk_call;

struct fy_disk {
    int fd;
    size_t nbytes;
    bool direct;
    pthread_mutex_t mu;
    pthread_cond_t work;    /* a call was queued, or stop */
    disk_call *head, *tail;
    bool stop;
    int nthreads;           /* started */
    pthread_t *threads;
    char name[4096];
};

/* Calls over all fy_disk objects, for FERRY_TEST_DISK_FAIL_AT. */
static atomic_ulong g_calls;

static void enqueue(fy_disk *d, disk_call *c) {
    c->next = NULL;
    if (d->tail) d->tail->next = c;
    else d->head = c;
    d->tail = c;
}

/* Moves len bytes at file offset off, retrying after EINTR and short transfers: 0, an
 * errno, or SHORT_READ; *done gets the bytes moved. */
static int transfer(int fd, bool write, char *buf, size_t len, size_t off, size_t *done) {
    *done = 0;
    while (*done < len) {
        const ssize_t r = write ? pwrite(fd, buf + *done, len - *done, (off_t)(off + *done))
                                : pread(fd, buf + *done, len - *done, (off_t)(off + *done));
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return errno;
        if (r == 0) return write ? EIO : SHORT_READ; /* no progress: never loop on it */
        *done += (size_t)r;
    }
    return 0;
}

static void *worker(void *arg) {
    fy_disk *d = arg;
    pthread_mutex_lock(&d->mu);
    for (;;) {
        while (!d->head && !d->stop) pthread_cond_wait(&d->work, &d->mu);
        disk_call *c = d->head;
        if (!c) break; /* stopped with nothing queued */
        const size_t off = c->next_off;
        const size_t len = c->end - off < FY_DISK_PIECE ? c->end - off : FY_DISK_PIECE;
        c->next_off += len;
        d->head = c->next;
        if (!d->head) d->tail = NULL;
        if (c->next_off < c->end) enqueue(d, c); /* its next piece after the other calls' */
        const bool skip = c->err != 0;
        pthread_mutex_unlock(&d->mu);
        size_t moved = 0;
        const int err = skip ? 0 : transfer(d->fd, c->write, c->buf + (off - c->off), len, off, &moved);
        pthread_mutex_lock(&d->mu);
        if (err && !c->err) {
            c->err = err;
            c->err_off = off;
            c->err_len = len;
        }
        if (--c->pending == 0) pthread_cond_signal(&c->done);
    }
    pthread_mutex_unlock(&d->mu);
    return NULL;
}

static fy_status io_error(const fy_disk *d, bool write, size_t off, size_t n, int err) {
    char sz[32];
    fy_log_error("I/O error %s %s at offset %zu of %s (unlinked): %s", write ? "writing" : "reading",
                 fy_fmt_size(n, sz, sizeof sz), off, d->name,
                 err == SHORT_READ ? "end of file (a read gave 0 bytes)" : strerror(err));
    return FY_ERR_IO;
}

/* Whether this call is the one FERRY_TEST_DISK_FAIL_AT names (counted from 1). */
static bool test_fail_now(void) {
    const unsigned long k = atomic_fetch_add(&g_calls, 1) + 1;
    const char *at = getenv("FERRY_TEST_DISK_FAIL_AT");
    return at && *at && strtoul(at, NULL, 10) == k;
}

static fy_status rw(fy_disk *d, bool write, size_t off, void *buf, size_t n) {
    FY_ASSERT(off % FY_DISK_ALIGN == 0 && n % FY_DISK_ALIGN == 0 &&
                  (uintptr_t)buf % FY_DISK_ALIGN == 0,
              "disk I/O takes offsets, lengths and buffers aligned to FY_DISK_ALIGN "
              "(fy_disk_align_up, fy_disk_buffer)");
    FY_ASSERT(off <= d->nbytes && n <= d->nbytes - off, "disk I/O past the scratch file's end");
    if (test_fail_now()) return io_error(d, write, off, n, EIO);
    if (!n) return FY_OK;
    disk_call c = {.write = write, .buf = buf, .off = off, .end = off + n, .next_off = off,
                   .pending = (n + FY_DISK_PIECE - 1) / FY_DISK_PIECE};
    pthread_cond_init(&c.done, NULL);
    pthread_mutex_lock(&d->mu);
    enqueue(d, &c);
    pthread_cond_broadcast(&d->work);
    while (c.pending) pthread_cond_wait(&c.done, &d->mu);
    pthread_mutex_unlock(&d->mu);
    pthread_cond_destroy(&c.done);
    return c.err ? io_error(d, write, c.err_off, c.err_len, c.err) : FY_OK;
}

fy_status fy_disk_read(fy_disk *d, size_t off, void *buf, size_t n) { return rw(d, false, off, buf, n); }

fy_status fy_disk_write(fy_disk *d, size_t off, const void *buf, size_t n) {
    return rw(d, true, off, (void *)buf, n); /* only read from */
}

size_t fy_disk_nbytes(const fy_disk *d) { return d->nbytes; }
bool fy_disk_direct(const fy_disk *d) { return d->direct; }
const char *fy_disk_name(const fy_disk *d) { return d->name; }

fy_status fy_disk_check_dir(const char *dir) {
    struct stat sb;
    if (stat(dir, &sb) != 0) {
        if (errno == ENOENT) fy_log_error("--disk-dir %s: no such directory", dir);
        else fy_log_error("--disk-dir %s: %s", dir, strerror(errno));
        return FY_ERR_IO;
    }
    if (!S_ISDIR(sb.st_mode)) {
        fy_log_error("--disk-dir %s: not a directory", dir);
        return FY_ERR_IO;
    }
    if (access(dir, W_OK | X_OK) != 0) {
        fy_log_error("--disk-dir %s: not writable (%s)", dir, strerror(errno));
        return FY_ERR_IO;
    }
    DIR *dp = opendir(dir);
    if (!dp) {
        fy_log_error("--disk-dir %s: cannot list it: %s", dir, strerror(errno));
        return FY_ERR_IO;
    }
    fy_status st = FY_OK;
    for (struct dirent *e; st == FY_OK && (e = readdir(dp));) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        fy_log_error("--disk-dir %s: holds %s (the disk tier's directory must be empty: its "
                     "scratch files are created and removed by the run)", dir, e->d_name);
        st = FY_ERR_IO;
    }
    closedir(dp);
    return st;
}

/* Stops the pool's started threads and frees d (its file closed). */
static void disk_free(fy_disk *d) {
    pthread_mutex_lock(&d->mu);
    d->stop = true;
    pthread_cond_broadcast(&d->work);
    pthread_mutex_unlock(&d->mu);
    for (int i = 0; i < d->nthreads; i++) pthread_join(d->threads[i], NULL);
    free(d->threads);
    pthread_cond_destroy(&d->work);
    pthread_mutex_destroy(&d->mu);
    if (d->fd >= 0) close(d->fd);
    free(d);
}

void fy_disk_close(fy_disk *d) {
    if (d) disk_free(d);
}

/* Creates, unlinks and preallocates d's file. */
static fy_status create_file(fy_disk *d) {
    d->fd = open(d->name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (d->fd < 0) {
        fy_log_error("cannot create the disk tier's scratch file %s: %s", d->name, strerror(errno));
        return FY_ERR_IO;
    }
    if (unlink(d->name) != 0) {
        fy_log_error("cannot unlink the disk tier's scratch file %s: %s", d->name, strerror(errno));
        return FY_ERR_IO;
    }
    const int fl = fcntl(d->fd, F_GETFL);
    d->direct = fl >= 0 && fcntl(d->fd, F_SETFL, fl | O_DIRECT) == 0;
    int err;
    while ((err = posix_fallocate(d->fd, 0, (off_t)d->nbytes)) == EINTR) {}
    if (err) {
        char sz[32];
        fy_log_error("cannot preallocate %s for the disk tier's scratch file %s (unlinked): %s",
                     fy_fmt_size(d->nbytes, sz, sizeof sz), d->name, strerror(err));
        return FY_ERR_IO;
    }
    return FY_OK;
}

fy_status fy_disk_open(const char *dir, int rank, size_t nbytes, int qdepth, fy_disk **out) {
    *out = NULL;
    if (!nbytes || rank < 0 || qdepth < 0 || qdepth > QDEPTH_MAX || nbytes > SIZE_MAX - FY_DISK_ALIGN) {
        fy_log_error("the disk tier's scratch file: %zu bytes, rank %d, queue depth %d (bytes "
                     "must be positive, the depth 0..%d)", nbytes, rank, qdepth, QDEPTH_MAX);
        return FY_ERR_INVALID;
    }
    fy_disk *d = calloc(1, sizeof *d);
    if (!d) {
        fy_log_error("out of memory opening the disk tier's scratch file");
        return FY_ERR_NOMEM;
    }
    d->fd = -1;
    d->nbytes = fy_disk_align_up(nbytes);
    pthread_mutex_init(&d->mu, NULL);
    pthread_cond_init(&d->work, NULL);
    const int w = snprintf(d->name, sizeof d->name, "%s/ferry-scratch-%ld-r%d", dir, (long)getpid(), rank);
    if (w < 0 || (size_t)w >= sizeof d->name) {
        fy_log_error("--disk-dir %.200s...: the path is too long", dir);
        disk_free(d);
        return FY_ERR_INVALID;
    }
    fy_status st = create_file(d);
    const int nthreads = qdepth ? qdepth : FY_DISK_QDEPTH;
    if (st == FY_OK && !(d->threads = calloc((size_t)nthreads, sizeof *d->threads))) {
        fy_log_error("out of memory opening the disk tier's scratch file");
        st = FY_ERR_NOMEM;
    }
    while (st == FY_OK && d->nthreads < nthreads) {
        const int err = pthread_create(&d->threads[d->nthreads], NULL, worker, d);
        if (err) {
            fy_log_error("cannot start the disk tier's I/O threads: %s", strerror(err));
            st = FY_ERR_NOMEM;
        } else {
            d->nthreads++;
        }
    }
    if (st != FY_OK) {
        disk_free(d);
        return st;
    }
    *out = d;
    return FY_OK;
}

/* fdatasync of d's file: what was written is on the device. */
static fy_status disk_sync(fy_disk *d) {
    int r;
    while ((r = fdatasync(d->fd)) != 0 && errno == EINTR) {}
    if (r == 0) return FY_OK;
    fy_log_error("cannot sync %s (unlinked): %s", d->name, strerror(errno));
    return FY_ERR_IO;
}

/* The whole file in calls of chunk bytes from buf: ms taken. */
static fy_status sweep(fy_disk *d, bool write, char *buf, size_t chunk, double *ms) {
    const double t0 = fy_now_ms();
    for (size_t off = 0; off < d->nbytes; off += chunk) {
        const size_t n = d->nbytes - off < chunk ? d->nbytes - off : chunk;
        FY_TRY(write ? fy_disk_write(d, off, buf, n) : fy_disk_read(d, off, buf, n));
    }
    if (write) FY_TRY(disk_sync(d));
    *ms = fy_now_ms() - t0;
    return FY_OK;
}

fy_status fy_disk_bench(const char *dir, size_t nbytes, int qdepth, double *write_gbps,
                        double *read_gbps) {
    *write_gbps = *read_gbps = 0;
    fy_disk *d;
    FY_TRY(fy_disk_open(dir, 0, nbytes, qdepth, &d));
    size_t chunk = (size_t)d->nthreads * FY_DISK_PIECE; /* every thread busy within a call */
    if (chunk < BENCH_CHUNK) chunk = BENCH_CHUNK;
    if (chunk > d->nbytes) chunk = d->nbytes;
    char *buf = fy_disk_buffer(chunk);
    if (!buf) {
        char sz[32];
        fy_log_error("out of memory for the disk bench's buffer (%s)", fy_fmt_size(chunk, sz, sizeof sz));
        fy_disk_close(d);
        return FY_ERR_NOMEM;
    }
    for (size_t i = 0; i < chunk; i++) buf[i] = (char)(i * 131 + 7); /* not zeros */
    double wms = 0, rms = 0;
    fy_status st = sweep(d, true, buf, chunk, &wms);
    /* buffered: what was written is clean in the page cache; dropped, the read is the disk's */
    if (st == FY_OK && !d->direct) posix_fadvise(d->fd, 0, 0, POSIX_FADV_DONTNEED);
    if (st == FY_OK) st = sweep(d, false, buf, chunk, &rms);
    if (st == FY_OK) {
        *write_gbps = (double)d->nbytes / (wms > 1e-3 ? wms : 1e-3) / 1e6;
        *read_gbps = (double)d->nbytes / (rms > 1e-3 ? rms : 1e-3) / 1e6;
    }
    free(buf);
    fy_disk_close(d);
    return st;
}

void *fy_disk_buffer(size_t n) {
    if (n > SIZE_MAX - FY_DISK_ALIGN) return NULL;
    const size_t nbytes = n ? fy_disk_align_up(n) : FY_DISK_ALIGN;
    void *p = aligned_alloc(FY_DISK_ALIGN, nbytes);
    if (p) memset(p, 0, nbytes);
    return p;
}
