/* outfile.c — a file written through a ring of aligned buffers by a thread of its own,
 * O_DIRECT where the filesystem allows (outfile.h).
 *
 * The ring: the caller fills buffer `cur`; a full one is added to the CRC and handed to the
 * writer (queued + 1) when the next byte needs room, and the caller moves on to the next
 * buffer once fewer than nbuf are queued. The writer takes them in order from `head` and
 * writes each at `written`, a multiple of the buffer size, so every O_DIRECT write is
 * aligned in memory, in offset and in length. The last, partial buffer is written by the
 * caller after the writer has stopped: its aligned part direct, the rest (under 4 KiB)
 * through the page cache (O_DIRECT cleared: an unaligned length would be refused), so the
 * file is never longer than what was appended and needs no truncation. A file smaller than
 * one buffer has one buffer of its size, no thread, and plain writes.
 *
 * Invariants: the bytes reach the file in the order appended, each once; the CRC is of
 * those bytes in that order; after the first error nothing more is written and every call
 * returns it (logged once, by the caller's thread). */
#include "engine/io/outfile.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "engine/core/crc32c.h"
#include "engine/core/util.h"

struct fy_outfile {
    char *path;
    int fd;
    size_t chunk;             /* a buffer's bytes */
    int nbuf;
    uint8_t *mem;             /* nbuf buffers, FY_OUTFILE_ALIGN-aligned */
    bool mapped;              /* from ring_get (else aligned_alloc: a small file's one) */
    fy_status st;             /* the first error, once logged (the caller's) */
    /* the caller's */
    int cur;                  /* the buffer being filled */
    size_t used;              /* its bytes */
    uint64_t nbytes;          /* bytes appended */
    uint32_t crc;             /* of the buffers handed off */
    /* the writer's: its thread's while it runs, the caller's otherwise */
    int head;                 /* the next buffer to write */
    uint64_t written;         /* where it goes */
    bool direct;              /* O_DIRECT set on fd */
    /* shared, under mu */
    bool threaded;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int queued;               /* buffers handed to the writer, not yet written */
    bool done;                /* no more will come */
    int err;                  /* the first failure's errno (0: none) and what failed */
    const char *err_what;
};

static uint8_t *buf(const fy_outfile *f, int i) { return f->mem + (size_t)i * f->chunk; }

/* The rings' memory: mapped (page-aligned), and the last one freed kept for the next
 * outfile of its size. Fresh pages cost more to touch than the disk takes to write them on
 * the machines measured (0.7-1.7 GB/s; bench/RESULTS.md), and a checkpoint writes three
 * files in a row; one ring stays mapped once a large file has been written. */
static pthread_mutex_t g_ring_mu = PTHREAD_MUTEX_INITIALIZER;
static uint8_t *g_ring;
static size_t g_ring_nbytes;

static uint8_t *ring_get(size_t nbytes) {
    pthread_mutex_lock(&g_ring_mu);
    uint8_t *p = g_ring_nbytes == nbytes ? g_ring : NULL;
    if (p) g_ring = NULL, g_ring_nbytes = 0;
    pthread_mutex_unlock(&g_ring_mu);
    if (p) return p;
    p = mmap(NULL, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
    return p;
}

static void ring_put(uint8_t *p, size_t nbytes) {
    if (!p) return;
    pthread_mutex_lock(&g_ring_mu);
    uint8_t *old = g_ring;
    size_t old_nbytes = g_ring_nbytes;
    g_ring = p, g_ring_nbytes = nbytes;
    pthread_mutex_unlock(&g_ring_mu);
    if (old) munmap(old, old_nbytes);
}

/* n bytes at off; 0 or the errno, with *done the bytes written before it. */
static int pwrite_all(int fd, const uint8_t *p, size_t n, uint64_t off, size_t *done) {
    *done = 0;
    while (*done < n) {
        ssize_t w = pwrite(fd, p + *done, n - *done, (off_t)(off + *done));
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) return errno;
        if (w == 0) return EIO;
        *done += (size_t)w;
    }
    return 0;
}

static void clear_direct(fy_outfile *f) {
    int fl = fcntl(f->fd, F_GETFL);
    if (fl >= 0) fcntl(f->fd, F_SETFL, fl & ~O_DIRECT);
    f->direct = false;
}

/* Buffer bytes p[0, n) at `written` (p at a buffer's start): written (the aligned part
 * direct while O_DIRECT holds; a filesystem that refuses it turns it off for good), the
 * writeback of plain writes started. 0 or the errno. */
static int put(fy_outfile *f, const uint8_t *p, size_t n) {
    size_t done = 0;
    if (f->direct) {
        const size_t a = n / FY_OUTFILE_ALIGN * FY_OUTFILE_ALIGN;
        int e = a ? pwrite_all(f->fd, p, a, f->written, &done) : 0;
        if (e && e != EINVAL) return e;
        p += done;
        n -= done;
        f->written += done;
        if (n) clear_direct(f); /* the unaligned tail, or O_DIRECT refused (EINVAL) */
    }
    if (!n) return 0;
    int e = pwrite_all(f->fd, p, n, f->written, &done);
    if (!e && n == f->chunk) sync_file_range(f->fd, (off_t)f->written, (off_t)n, SYNC_FILE_RANGE_WRITE);
    f->written += done;
    return e;
}

static void *writer_main(void *arg) {
    fy_outfile *f = arg;
    pthread_mutex_lock(&f->mu);
    for (;;) {
        while (!f->queued && !f->done) pthread_cond_wait(&f->cv, &f->mu);
        if (!f->queued) break;
        const int failed = f->err;
        pthread_mutex_unlock(&f->mu);
        const int e = failed ? 0 : put(f, buf(f, f->head), f->chunk);
        pthread_mutex_lock(&f->mu);
        if (e && !f->err) {
            f->err = e;
            f->err_what = "cannot write";
        }
        f->head = (f->head + 1) % f->nbuf;
        f->queued--;
        pthread_cond_broadcast(&f->cv);
    }
    pthread_mutex_unlock(&f->mu);
    return NULL;
}

/* The error e (errno) of what, logged once; f->st from then on. */
static fy_status fail(fy_outfile *f, int e, const char *what) {
    if (f->st == FY_OK) {
        fy_log_error("%s %s: %s", what, f->path, strerror(e));
        f->st = FY_ERR_IO;
    }
    return f->st;
}

fy_status fy_outfile_open(const char *path, uint64_t nbytes_hint, const fy_outfile_cfg *cfg,
                          fy_outfile **out) {
    *out = NULL;
    fy_outfile_cfg c = cfg ? *cfg : (fy_outfile_cfg){0};
    const char *hook = getenv("FERRY_TEST_OUTFILE_CHUNK"); /* outfile.h */
    if (hook && !c.chunk_nbytes) c.chunk_nbytes = (size_t)strtoull(hook, NULL, 10);
    if (getenv("FERRY_TEST_OUTFILE_BUFFERED")) c.buffered = true;
    fy_outfile *f = calloc(1, sizeof *f);
    if (!f || !(f->path = strdup(path))) {
        free(f);
        fy_log_error("out of host memory to write %s", path);
        return FY_ERR_NOMEM;
    }
    f->chunk = c.chunk_nbytes ? fy_round_up(c.chunk_nbytes, FY_OUTFILE_ALIGN) : FY_OUTFILE_CHUNK;
    f->nbuf = c.nchunks >= 2 ? c.nchunks : 3;
    const bool small = nbytes_hint < f->chunk;
    if (small) { /* one buffer of the file's size, written when full or closed */
        f->chunk = fy_round_up(nbytes_hint ? (size_t)nbytes_hint : 1, FY_OUTFILE_ALIGN);
        f->nbuf = 1;
    }
    f->fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (f->fd < 0) {
        fy_log_error("cannot create %s: %s", path, strerror(errno));
        free(f->path);
        free(f);
        return FY_ERR_IO;
    }
    f->mem = small ? aligned_alloc(FY_OUTFILE_ALIGN, f->chunk) : ring_get((size_t)f->nbuf * f->chunk);
    f->mapped = !small;
    pthread_mutex_init(&f->mu, NULL);
    pthread_cond_init(&f->cv, NULL);
    if (!f->mem) {
        fy_log_error("out of host memory to write %s", path);
        fy_outfile_abandon(f);
        return FY_ERR_NOMEM;
    }
    if (!small && !c.buffered) { /* refused (EINVAL) by filesystems without direct I/O */
        const int fl = fcntl(f->fd, F_GETFL);
        f->direct = fl >= 0 && fcntl(f->fd, F_SETFL, fl | O_DIRECT) == 0;
    }
    f->threaded = !small && pthread_create(&f->thread, NULL, writer_main, f) == 0;
    *out = f;
    return FY_OK;
}

/* Buffer cur (full) to the writer, and the next buffer free to fill. Its CRC is taken
 * here, by the caller, whose bytes are still in the cache and who has time to spare while
 * the disk is the bottleneck (on the writer thread it held up every write by as long). */
static fy_status handoff(fy_outfile *f) {
    f->crc = fy_crc32c(buf(f, f->cur), f->used, f->crc);
    if (!f->threaded) {
        const int e = put(f, buf(f, f->cur), f->used);
        f->used = 0;
        return e ? fail(f, e, "cannot write") : FY_OK;
    }
    pthread_mutex_lock(&f->mu);
    f->queued++;
    pthread_cond_broadcast(&f->cv);
    while (f->queued == f->nbuf && !f->err) pthread_cond_wait(&f->cv, &f->mu);
    const int e = f->err;
    const char *what = f->err_what;
    pthread_mutex_unlock(&f->mu);
    f->cur = (f->cur + 1) % f->nbuf;
    f->used = 0;
    return e ? fail(f, e, what) : FY_OK;
}

fy_status fy_outfile_span(fy_outfile *f, void **p, size_t *avail) {
    if (f->st != FY_OK) return f->st;
    if (f->used == f->chunk) FY_TRY(handoff(f));
    *p = buf(f, f->cur) + f->used;
    *avail = f->chunk - f->used;
    return FY_OK;
}

fy_status fy_outfile_commit(fy_outfile *f, size_t k) {
    FY_ASSERT(k <= f->chunk - f->used, "committed more than the span");
    f->used += k;
    f->nbytes += k;
    return f->st;
}

fy_status fy_outfile_write(fy_outfile *f, const void *data, size_t n) {
    const uint8_t *s = data;
    while (n > 0) {
        void *p;
        size_t avail;
        FY_TRY(fy_outfile_span(f, &p, &avail));
        const size_t k = n < avail ? n : avail;
        memcpy(p, s, k);
        fy_outfile_commit(f, k);
        s += k;
        n -= k;
    }
    return f->st;
}

/* Stops the writer thread once it has written what is queued (abandon: writing nothing
 * more). */
static void stop_writer(fy_outfile *f, bool abandon) {
    if (!f->threaded) return;
    pthread_mutex_lock(&f->mu);
    f->done = true;
    if (abandon && !f->err) f->err = ECANCELED;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
    pthread_join(f->thread, NULL);
    f->threaded = false;
}

static void release(fy_outfile *f) {
    if (f->fd >= 0) close(f->fd);
    pthread_mutex_destroy(&f->mu);
    pthread_cond_destroy(&f->cv);
    if (f->mapped) ring_put(f->mem, (size_t)f->nbuf * f->chunk);
    else free(f->mem);
    free(f->path);
    free(f);
}

fy_status fy_outfile_close(fy_outfile *f, uint64_t *nbytes, uint32_t *crc) {
    stop_writer(f, false);
    if (f->err && f->st == FY_OK) fail(f, f->err, f->err_what);
    int e = 0;
    if (f->st == FY_OK && f->used) {
        f->crc = fy_crc32c(buf(f, f->cur), f->used, f->crc);
        if ((e = put(f, buf(f, f->cur), f->used)) != 0) fail(f, e, "cannot write");
    }
    if (f->st == FY_OK && fsync(f->fd) != 0) fail(f, errno, "cannot fsync");
    if (f->st == FY_OK) {
        const int rc = close(f->fd);
        f->fd = -1;
        if (rc != 0) fail(f, errno, "cannot close");
    }
    if (nbytes) *nbytes = f->nbytes;
    if (crc) *crc = f->crc;
    const fy_status st = f->st;
    release(f);
    return st;
}

void fy_outfile_abandon(fy_outfile *f) {
    if (!f) return;
    stop_writer(f, true);
    release(f);
}
