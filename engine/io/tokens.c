/* tokens.c — token files (llm.c shards, plain text, globs of them) and the batch loader.
 *
 * Every file is memory-mapped read-only, whole, and its tokens are read in place as the
 * file stores them (uint8 text, uint16 v1, uint32 v7, little-endian like the files): no
 * copy of a dataset is ever made, so one larger than RAM trains. A file is judged by its
 * first four bytes and its name (see tokens.h); a shard's header is checked completely
 * (magic, version, count, exact size) with pread before the file is mapped, so no read
 * through a mapping can run past the end of its file (SIGBUS). Each error is logged once,
 * naming the file it is about.
 *
 * A fy_tokens is an array of files in stream order, each knowing the index of its first
 * token: a reader finds the file holding a position by binary search and copies runs
 * file by file. fy_tokens_from_bytes is the one copy: a byte buffer held as a text file.
 * The mappings are MADV_SEQUENTIAL (the loader and the vocabulary check read forwards,
 * and the kernel may then reclaim pages behind the reader first); the vocabulary check
 * drops the pages of each chunk it has scanned, so opening and checking a dataset does
 * not fill the resident set with it.
 *
 * A shard's companion of loss and start bits (tokens.h) is checked likewise (its header
 * against the shard's, its exact size) and mapped whole beside it.
 *
 * The loader is a cursor over [begin, end) of a token stream: it owns nothing, and
 * keeps llm.c's order (read B*T+1 at pos, advance by B*T, wrap to 0 when the next read
 * would not fit). */
#include "engine/io/tokens.h"

#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <zlib.h>

#include "engine/core/crc32c.h"
#include "engine/core/util.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "tokens.c reads little-endian token files in place"
#endif

#define SHARD_HEADER_NBYTES 1024
#define SCAN_NBYTES ((size_t)4 << 20) /* the vocabulary check's chunk; pages dropped after */

typedef struct tok_file {
    char *path;
    size_t begin;        /* index of the file's first token in the stream */
    size_t count;        /* tokens in the file */
    int tok_nbytes;      /* 1 (text), 2 (v1 shard) or 4 (v7 shard) */
    const uint8_t *toks; /* the first token: inside map, or fy_tokens.copy */
    void *map;           /* the whole file's mapping; NULL for a copy */
    size_t map_nbytes;
    const uint8_t *loss, *start; /* its companion's bits (tokens.h), or NULL */
    void *mask_map;      /* the companion's mapping */
    size_t mask_nbytes;
    uint32_t mask_crc;   /* the companion's record of the file's token bytes' CRC-32 */
} tok_file;

struct fy_tokens {
    size_t n;
    char *label;
    tok_file *files; /* (nfiles) in stream order */
    int nfiles;
    uint8_t *copy;   /* fy_tokens_from_bytes's bytes; NULL for files */
    bool masks;      /* every file has a companion */
    int packed;      /* their packing length */
};

struct fy_loader {
    const fy_tokens *t;
    size_t begin, n; /* the range is [begin, begin + n) */
    size_t bt;       /* B*T */
    size_t B;
    size_t pos;      /* offset from begin of the next batch */
};

/* Judges the file from its size and header: on success sets the token size, the count
 * and the offset of the first token; otherwise writes the problem into why. */
static fy_status classify(const char *path, int fd, size_t size, int *tok_nbytes,
                          size_t *count, off_t *data_off, char *why, size_t cap) {
    if (size == 0) return snprintf(why, cap, "file is empty"), FY_ERR_FORMAT;
    int32_t hdr[SHARD_HEADER_NBYTES / 4] = {0};
    size_t hn = size < SHARD_HEADER_NBYTES ? size : SHARD_HEADER_NBYTES;
    ssize_t r = pread(fd, hdr, hn, 0);
    if (r < 0 || (size_t)r != hn)
        return snprintf(why, cap, "cannot read: %s", r < 0 ? strerror(errno) : "short read"),
               FY_ERR_IO;
    int is_shard = size >= 4 && (hdr[0] == FY_SHARD_MAGIC_V1 || hdr[0] == FY_SHARD_MAGIC_V7);
    if (!is_shard) {
        if (fy_str_ends_with(path, ".bin")) {
            if (size < 4) return snprintf(why, cap, "bad magic: %zu-byte file is not an llm.c "
                                          "token shard", size), FY_ERR_FORMAT;
            return snprintf(why, cap, "bad magic %d: not an llm.c token shard (expected %d or "
                            "%d)", hdr[0], FY_SHARD_MAGIC_V1, FY_SHARD_MAGIC_V7), FY_ERR_FORMAT;
        }
        *tok_nbytes = 1;
        *count = size;
        *data_off = 0;
        return FY_OK;
    }
    if (size < SHARD_HEADER_NBYTES)
        return snprintf(why, cap, "truncated shard: %zu bytes, shorter than the %d-byte header",
                        size, SHARD_HEADER_NBYTES), FY_ERR_FORMAT;
    int want_version = hdr[0] == FY_SHARD_MAGIC_V1 ? 1 : 7;
    if (hdr[1] != want_version)
        return snprintf(why, cap, "bad shard version %d for magic %d (expected %d)", hdr[1],
                        hdr[0], want_version), FY_ERR_FORMAT;
    if (hdr[2] == 0) return snprintf(why, cap, "shard holds no tokens (count 0)"), FY_ERR_FORMAT;
    if (hdr[2] < 0)
        return snprintf(why, cap, "absurd token count %d in the shard header", hdr[2]),
               FY_ERR_FORMAT;
    *tok_nbytes = want_version == 1 ? 2 : 4;
    *count = (size_t)hdr[2];
    size_t expect = SHARD_HEADER_NBYTES + *count * (size_t)*tok_nbytes;
    if (size < expect)
        return snprintf(why, cap, "truncated shard: the header says %zu tokens (%zu bytes) but "
                        "the file has %zu bytes", *count, expect, size), FY_ERR_FORMAT;
    if (size > expect)
        return snprintf(why, cap, "shard size mismatch: the header says %zu tokens (%zu bytes) "
                        "but the file has %zu bytes", *count, expect, size), FY_ERR_FORMAT;
    *data_off = SHARD_HEADER_NBYTES;
    return FY_OK;
}

/* Opens a regular file for reading: its descriptor and size, or -1 with the reason in why
 * (the descriptor closed). */
static int open_regular(const char *path, size_t *size, char *why, size_t cap) {
    struct stat sb;
    int fd = fy_open_read(path);
    if (fd < 0 || fstat(fd, &sb) != 0) {
        snprintf(why, cap, "cannot open: %s", strerror(errno));
    } else if (!S_ISREG(sb.st_mode)) {
        snprintf(why, cap, "not a regular file");
    } else {
        *size = (size_t)sb.st_size;
        return fd;
    }
    if (fd >= 0) close(fd);
    return -1;
}

/* Maps one file and appends it to t. */
static fy_status load_file(fy_tokens *t, const char *path) {
    char why[256] = "";
    fy_status st = FY_ERR_IO;
    void *map = MAP_FAILED;
    size_t size = 0;
    int fd = open_regular(path, &size, why, sizeof why);
    if (fd < 0) goto fail;
    int tok_nbytes;
    size_t count;
    off_t data_off;
    st = classify(path, fd, size, &tok_nbytes, &count, &data_off, why, sizeof why);
    if (st != FY_OK) goto fail;
    map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) {
        st = errno == ENOMEM ? FY_ERR_NOMEM : FY_ERR_IO;
        snprintf(why, sizeof why, "cannot map %zu bytes: %s", size, strerror(errno));
        goto fail;
    }
    (void)madvise(map, size, MADV_SEQUENTIAL); /* a hint: its failure changes nothing */
    st = FY_ERR_NOMEM;
    snprintf(why, sizeof why, "out of memory");
    tok_file *files = realloc(t->files, (size_t)(t->nfiles + 1) * sizeof *files);
    if (!files) goto fail;
    t->files = files;
    char *name = strdup(path);
    if (!name) goto fail;
    files[t->nfiles++] = (tok_file){.path = name, .begin = t->n, .count = count,
                                    .tok_nbytes = tok_nbytes,
                                    .toks = (const uint8_t *)map + data_off, .map = map,
                                    .map_nbytes = size};
    t->n += count;
    close(fd);
    return FY_OK;
fail:
    if (map != MAP_FAILED) munmap(map, size);
    if (fd >= 0) close(fd);
    fy_log_error("%s: %s", path, why);
    return st;
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static fy_status load_glob(fy_tokens *t, const char *pattern) {
    glob_t g;
    int rc = glob(pattern, GLOB_NOSORT, NULL, &g);
    if (rc == GLOB_NOMATCH) {
        fy_log_error("%s: no files match", pattern);
        return FY_ERR_IO;
    }
    if (rc != 0) {
        fy_log_error("%s: cannot expand the pattern", pattern);
        return rc == GLOB_NOSPACE ? FY_ERR_NOMEM : FY_ERR_IO;
    }
    /* our own sort: byte order, whatever the locale */
    qsort(g.gl_pathv, g.gl_pathc, sizeof *g.gl_pathv, cmp_str);
    fy_status st = FY_OK;
    for (size_t i = 0; i < g.gl_pathc && st == FY_OK; i++) st = load_file(t, g.gl_pathv[i]);
    globfree(&g);
    return st;
}

/* ---- companions: loss and start bits ------------------------------------------------- */

static size_t bits_nbytes(size_t count) { return (count + 7) / 8; }
static bool bit_at(const uint8_t *bits, size_t i) { return (bits[i >> 3] >> (i & 7)) & 1; }

/* The companion's name for a shard's path (X.bin -> X.mask), or NULL when it has none by
 * its kind (text, or a name without .bin). */
static char *companion_path(const tok_file *f) {
    if (f->tok_nbytes == 1 || !fy_str_ends_with(f->path, ".bin")) return NULL;
    const size_t n = strlen(f->path) - 4;
    char *p = malloc(n + 6);
    if (p) {
        memcpy(p, f->path, n);
        memcpy(p + n, ".mask", 6);
    }
    return p;
}

/* Checks and maps companion `path` of file f (its S into *packed). */
static fy_status load_companion(tok_file *f, const char *path, int *packed) {
    char why[256] = "";
    fy_status st = FY_ERR_IO;
    const size_t want = SHARD_HEADER_NBYTES + 2 * bits_nbytes(f->count);
    size_t size = 0;
    int fd = open_regular(path, &size, why, sizeof why);
    if (fd < 0) goto fail;
    int32_t hdr[5] = {0};
    ssize_t r = size >= sizeof hdr ? pread(fd, hdr, sizeof hdr, 0) : 0;
    st = FY_ERR_FORMAT;
    if (r < 0) {
        st = FY_ERR_IO;
        snprintf(why, sizeof why, "cannot read: %s", strerror(errno));
    } else if (size < sizeof hdr || hdr[0] != FY_MASK_MAGIC) {
        snprintf(why, sizeof why, "bad magic: not a loss-mask file (expected %d)", FY_MASK_MAGIC);
    } else if (hdr[1] != FY_MASK_VERSION) {
        snprintf(why, sizeof why, "mask file version %d (this ferry reads %d)", hdr[1], FY_MASK_VERSION);
    } else if (hdr[2] < 0 || (size_t)hdr[2] != f->count) {
        snprintf(why, sizeof why, "its header says %d tokens, its shard %s holds %zu: they are "
                 "not from the same run", hdr[2], f->path, f->count);
    } else if (hdr[3] < 0) {
        snprintf(why, sizeof why, "absurd packing length %d in its header", hdr[3]);
    } else if (size != want) {
        snprintf(why, sizeof why, "%zu bytes where %zu tokens' masks take %zu", size, f->count, want);
    } else {
        st = FY_OK;
    }
    if (st != FY_OK) goto fail;
    void *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) {
        st = errno == ENOMEM ? FY_ERR_NOMEM : FY_ERR_IO;
        snprintf(why, sizeof why, "cannot map %zu bytes: %s", size, strerror(errno));
        goto fail;
    }
    (void)madvise(map, size, MADV_SEQUENTIAL);
    f->mask_map = map;
    f->mask_nbytes = size;
    f->loss = (const uint8_t *)map + SHARD_HEADER_NBYTES;
    f->start = f->loss + bits_nbytes(f->count);
    *packed = hdr[3];
    f->mask_crc = (uint32_t)hdr[4];
    close(fd);
    return FY_OK;
fail:
    if (fd >= 0) close(fd);
    fy_log_error("%s: %s", path, why);
    return st;
}

/* Finds and maps the files' companions: all or none (tokens.h). */
static fy_status attach_masks(fy_tokens *t) {
    int with = -1, without = -1, packed = -1;
    fy_status st = FY_OK;
    for (int i = 0; i < t->nfiles && st == FY_OK; i++) {
        char *path = companion_path(&t->files[i]);
        struct stat sb;
        if (path && lstat(path, &sb) == 0) {
            int s = 0;
            st = load_companion(&t->files[i], path, &s);
            if (st == FY_OK && packed >= 0 && s != packed) {
                fy_log_error("%s: packed into sequences of %d tokens where %s's were of %d: "
                             "tokenize them in one run", path, s, t->files[with].path, packed);
                st = FY_ERR_FORMAT;
            }
            packed = s;
            with = i;
        } else if (path && errno != ENOENT) {
            fy_log_error("%s: cannot open: %s", path, strerror(errno));
            st = FY_ERR_IO;
        } else {
            without = i;
        }
        free(path);
    }
    if (st == FY_OK && with >= 0 && without >= 0) {
        fy_log_error("%s has no loss mask (.mask) beside it, while %s has one: give data whose "
                     "shards all have masks, or none", t->files[without].path, t->files[with].path);
        st = FY_ERR_FORMAT;
    }
    t->masks = st == FY_OK && with >= 0;
    t->packed = t->masks ? packed : 0;
    /* packed sequences start at multiples of S in the stream: every shard but the last
     * holds whole ones (the last also the stream's one extra token) */
    for (int i = 0; t->masks && t->packed > 0 && i < t->nfiles - 1; i++)
        if (t->files[i].count % (size_t)t->packed) {
            fy_log_error("%s holds %zu tokens, not whole sequences of %d, and is not the data's last "
                         "shard: the sequences after it would be cut (shards of several tokenize "
                         "runs? tokenize them in one)", t->files[i].path, t->files[i].count, t->packed);
            t->masks = false;
            return FY_ERR_FORMAT;
        }
    return st;
}

static fy_status tokens_alloc(const char *label, fy_tokens **out) {
    fy_tokens *t = calloc(1, sizeof *t);
    if (!t || !(t->label = strdup(label))) {
        free(t);
        fy_log_error("%s: out of memory", label);
        return FY_ERR_NOMEM;
    }
    *out = t;
    return FY_OK;
}

fy_status fy_tokens_open(const char *path, fy_tokens **out) {
    *out = NULL;
    fy_tokens *t;
    FY_TRY(tokens_alloc(path, &t));
    fy_status st = fy_tokens_is_glob(path) ? load_glob(t, path) : load_file(t, path);
    if (st == FY_OK) st = attach_masks(t);
    if (st != FY_OK) {
        fy_tokens_free(t);
        return st;
    }
    *out = t;
    return FY_OK;
}

fy_status fy_tokens_from_bytes(const uint8_t *bytes, size_t n, const char *label,
                               fy_tokens **out) {
    *out = NULL;
    if (n == 0) {
        fy_log_error("%s: no text (0 bytes)", label);
        return FY_ERR_INVALID;
    }
    fy_tokens *t;
    FY_TRY(tokens_alloc(label, &t));
    t->copy = malloc(n);
    if ((t->files = calloc(1, sizeof *t->files))) {
        t->nfiles = 1;
        t->files[0] = (tok_file){.path = strdup(label), .begin = 0, .count = n,
                                 .tok_nbytes = 1, .toks = t->copy};
    }
    if (!t->copy || !t->files || !t->files[0].path) {
        fy_tokens_free(t);
        fy_log_error("%s: out of memory for %zu tokens", label, n);
        return FY_ERR_NOMEM;
    }
    memcpy(t->copy, bytes, n);
    t->n = n;
    *out = t;
    return FY_OK;
}

void fy_tokens_free(fy_tokens *t) {
    if (!t) return;
    for (int i = 0; i < t->nfiles; i++) {
        free(t->files[i].path);
        if (t->files[i].map) munmap(t->files[i].map, t->files[i].map_nbytes);
        if (t->files[i].mask_map) munmap(t->files[i].mask_map, t->files[i].mask_nbytes);
    }
    free(t->files);
    free(t->copy);
    free(t->label);
    free(t);
}

size_t fy_tokens_count(const fy_tokens *t) { return t->n; }
const char *fy_tokens_label(const fy_tokens *t) { return t->label; }
bool fy_tokens_has_masks(const fy_tokens *t) { return t->masks; }
int fy_tokens_packed_seq(const fy_tokens *t) { return t->packed; }

/* The file holding stream position i (i <= n; n gives the last file). */
static int file_of(const fy_tokens *t, size_t i) {
    int lo = 0, hi = t->nfiles - 1;
    while (lo < hi) {
        int mid = lo + (hi - lo + 1) / 2;
        if (t->files[mid].begin <= i) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

static uint32_t file_at(const tok_file *f, size_t i) {
    switch (f->tok_nbytes) {
    case 1: return f->toks[i];
    case 2: return ((const uint16_t *)(const void *)f->toks)[i];
    default: return ((const uint32_t *)(const void *)f->toks)[i];
    }
}

uint32_t fy_tokens_at(const fy_tokens *t, size_t i) {
    FY_ASSERT(i < t->n, "token index past the end of the data");
    const tok_file *f = &t->files[file_of(t, i)];
    return file_at(f, i - f->begin);
}

/* Tokens [off, off + k) of one file as int32; one loop per width so each vectorises. */
static void file_read(const tok_file *f, size_t off, size_t k, int32_t *dst) {
    if (f->tok_nbytes == 1) {
        const uint8_t *s = f->toks + off;
        for (size_t i = 0; i < k; i++) dst[i] = s[i];
    } else if (f->tok_nbytes == 2) {
        const uint16_t *s = (const uint16_t *)(const void *)f->toks + off;
        for (size_t i = 0; i < k; i++) dst[i] = s[i];
    } else {
        memcpy(dst, (const uint32_t *)(const void *)f->toks + off, k * sizeof *dst);
    }
}

/* The targets among a file's tokens [off, off + k) that count (loss bit set, start bit
 * not): bit by bit up to a byte boundary, then a byte at a time. */
static size_t counted_bits(const tok_file *f, size_t off, size_t k) {
    size_t n = 0, i = off, end = off + k;
    for (; i < end && (i & 7); i++) n += bit_at(f->loss, i) && !bit_at(f->start, i);
    for (; i + 8 <= end; i += 8)
        n += (size_t)__builtin_popcount((unsigned)(f->loss[i >> 3] & (uint8_t)~f->start[i >> 3]));
    for (; i < end; i++) n += bit_at(f->loss, i) && !bit_at(f->start, i);
    return n;
}

bool fy_tokens_target_counts(const fy_tokens *t, size_t i) {
    FY_ASSERT(i < t->n, "token index past the end of the data");
    if (!t->masks) return true;
    const tok_file *f = &t->files[file_of(t, i)];
    i -= f->begin;
    return bit_at(f->loss, i) && !bit_at(f->start, i);
}

bool fy_tokens_doc_starts(const fy_tokens *t, size_t i) {
    FY_ASSERT(i < t->n, "token index past the end of the data");
    if (!t->masks) return false;
    const tok_file *f = &t->files[file_of(t, i)];
    return bit_at(f->start, i - f->begin);
}

/* BODY for each file's run of tokens [begin, begin + n), in order: the file f, the run's
 * first token in it (off) and its length (k). */
#define FOR_RUNS(tk_, begin_, n_, ...)                                                       \
    do {                                                                                     \
        size_t b_ = (begin_), r_ = (n_);                                                     \
        for (int fi_ = file_of((tk_), b_); r_ > 0; fi_++) {                                  \
            const tok_file *f = &(tk_)->files[fi_];                                          \
            const size_t off = b_ - f->begin, k = f->count - off < r_ ? f->count - off : r_; \
            __VA_ARGS__;                                                                     \
            b_ += k;                                                                         \
            r_ -= k;                                                                         \
        }                                                                                    \
    } while (0)

uint32_t fy_tokens_masks_crc(const fy_tokens *t, size_t begin, size_t n, uint32_t crc) {
    FY_ASSERT(begin <= t->n && n <= t->n - begin, "token range outside the data");
    if (!t->masks) return crc;
    uint8_t buf[256];
    size_t used = 0;
    FOR_RUNS(t, begin, n, {
        for (size_t i = 0; i < k; i++) {
            buf[used++] = (uint8_t)(bit_at(f->loss, off + i) | bit_at(f->start, off + i) << 1);
            if (used == sizeof buf) crc = fy_crc32c(buf, used, crc), used = 0;
        }
    });
    return fy_crc32c(buf, used, crc);
}

void fy_tokens_read(const fy_tokens *t, size_t begin, size_t n, int32_t *dst) {
    FY_ASSERT(begin <= t->n && n <= t->n - begin, "token range outside the data");
    for (int f = file_of(t, begin); n > 0; f++) {
        const tok_file *fl = &t->files[f];
        size_t off = begin - fl->begin, k = fl->count - off < n ? fl->count - off : n;
        file_read(fl, off, k, dst);
        begin += k;
        dst += k;
        n -= k;
    }
}

/* The largest of tokens [off, off + k) of one file. */
static uint32_t file_max(const tok_file *f, size_t off, size_t k) {
    uint32_t m = 0;
    if (f->tok_nbytes == 1) {
        const uint8_t *s = f->toks + off;
        for (size_t i = 0; i < k; i++) m = s[i] > m ? s[i] : m;
    } else if (f->tok_nbytes == 2) {
        const uint16_t *s = (const uint16_t *)(const void *)f->toks + off;
        for (size_t i = 0; i < k; i++) m = s[i] > m ? s[i] : m;
    } else {
        const uint32_t *s = (const uint32_t *)(const void *)f->toks + off;
        for (size_t i = 0; i < k; i++) m = s[i] > m ? s[i] : m;
    }
    return m;
}

/* Drops the whole pages of a mapped file's tokens [off, off + k) from the process: the
 * mapping is read-only and private, so a later read faults them back from the page
 * cache (or the file) unchanged. A hint; its failure changes nothing. */
static void file_drop(const tok_file *f, size_t off, size_t k) {
    if (!f->map) return;
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t a = (uintptr_t)(f->toks + off * (size_t)f->tok_nbytes);
    uintptr_t b = (uintptr_t)(f->toks + (off + k) * (size_t)f->tok_nbytes);
    a = a / page * page;
    b = b / page * page; /* the page holding the next chunk's start stays */
    if (b > a) (void)madvise((void *)a, b - a, MADV_DONTNEED);
}

fy_status fy_tokens_check_vocab(const fy_tokens *t, int vocab) {
    if (vocab <= 0) {
        fy_log_error("%s: vocabulary size %d is not positive", t->label, vocab);
        return FY_ERR_INVALID;
    }
    for (int f = 0; f < t->nfiles; f++) {
        const tok_file *fl = &t->files[f];
        size_t chunk = SCAN_NBYTES / (size_t)fl->tok_nbytes;
        uLong crc = crc32(0L, Z_NULL, 0);
        for (size_t off = 0; off < fl->count; off += chunk) {
            size_t k = fl->count - off < chunk ? fl->count - off : chunk;
            if (file_max(fl, off, k) >= (uint32_t)vocab) {
                size_t i = off;
                while (file_at(fl, i) < (uint32_t)vocab) i++;
                fy_log_error("%s: token id %u at position %zu is not below the vocabulary "
                             "size %d", fl->path, file_at(fl, i), i, vocab);
                return FY_ERR_INVALID;
            }
            if (fl->mask_map)
                crc = crc32(crc, fl->toks + off * (size_t)fl->tok_nbytes, (uInt)(k * (size_t)fl->tok_nbytes));
            file_drop(fl, off, k);
        }
        if (fl->mask_map && (uint32_t)crc != fl->mask_crc) {
            char *mask = companion_path(fl);
            fy_log_error("%s: its tokens' CRC-32 is %08x where its loss mask %s records %08x: the "
                         "mask is another shard's (tokenize them again)", fl->path, (unsigned)crc,
                         mask ? mask : "(.mask)", (unsigned)fl->mask_crc);
            free(mask);
            return FY_ERR_FORMAT;
        }
    }
    return FY_OK;
}

fy_status fy_loader_new(const fy_tokens *t, size_t begin, size_t end, int B, int T,
                        fy_loader **out) {
    *out = NULL;
    if (B <= 0 || T <= 0) {
        fy_log_error("%s: batch %d x seq %d: sizes must be positive", t->label, B, T);
        return FY_ERR_INVALID;
    }
    if (begin > end || end > t->n) {
        fy_log_error("%s: token range [%zu, %zu) is not inside the %zu tokens", t->label, begin,
                     end, t->n);
        return FY_ERR_INVALID;
    }
    size_t bt = (size_t)B * (size_t)T;
    if (end - begin < bt + 1) {
        fy_log_error("%s: %zu tokens are too few for one batch of %d x %d (need %zu)", t->label,
                     end - begin, B, T, bt + 1);
        return FY_ERR_INVALID;
    }
    fy_loader *l = calloc(1, sizeof *l);
    if (!l) {
        fy_log_error("%s: out of memory", t->label);
        return FY_ERR_NOMEM;
    }
    *l = (fy_loader){.t = t, .begin = begin, .n = end - begin, .bt = bt, .B = (size_t)B, .pos = 0};
    *out = l;
    return FY_OK;
}

void fy_loader_free(fy_loader *l) { free(l); }

void fy_loader_next(fy_loader *l, int32_t *x, int32_t *y, int32_t *docs) {
    size_t at = l->begin + l->pos;
    fy_tokens_read(l->t, at, l->bt, x);
    memcpy(y, x + 1, (l->bt - 1) * sizeof *y);
    fy_tokens_read(l->t, at + l->bt, 1, y + l->bt - 1);
    if (l->t->masks) { /* targets y[i] are tokens at + 1 + i */
        int32_t *yy = y;
        FOR_RUNS(l->t, at + 1, l->bt, {
            for (size_t i = 0; i < k; i++)
                if (!bit_at(f->loss, off + i) || bit_at(f->start, off + i)) yy[i] = -1;
            yy += k;
        });
    }
    if (docs) {
        const size_t T = l->bt / l->B;
        size_t i = 0;
        int32_t start = 0;
        FOR_RUNS(l->t, at, l->bt, {
            for (size_t j = 0; j < k; j++, i++) {
                const int32_t t = (int32_t)(i % T);
                if (t == 0 || (l->t->masks && bit_at(f->start, off + j))) start = t;
                docs[i] = start;
            }
        });
    }
    l->pos += l->bt;
    if (l->pos + l->bt + 1 > l->n) l->pos = 0;
}

int64_t fy_loader_batch_targets(const fy_loader *l, int64_t k_batch) {
    if (!l->t->masks) return (int64_t)l->bt;
    const size_t at = l->begin + (size_t)(k_batch % (int64_t)fy_loader_batches(l)) * l->bt;
    int64_t n = 0;
    FOR_RUNS(l->t, at + 1, l->bt, { n += (int64_t)counted_bits(f, off, k); });
    return n;
}

void fy_loader_reset(fy_loader *l) { l->pos = 0; }

size_t fy_loader_pos(const fy_loader *l) { return l->pos; }

fy_status fy_loader_set_pos(fy_loader *l, size_t pos) {
    if (pos > l->n - (l->bt + 1)) {
        fy_log_error("%s: loader position %zu leaves fewer than %zu of the range's %zu tokens",
                     l->t->label, pos, l->bt + 1, l->n);
        return FY_ERR_INVALID;
    }
    l->pos = pos;
    return FY_OK;
}

size_t fy_loader_batches(const fy_loader *l) { return (l->n - 1) / l->bt; }
size_t fy_loader_batch_tokens(const fy_loader *l) { return l->bt; }

fy_status fy_loader_seek_batch(fy_loader *l, int64_t k) {
    return fy_loader_set_pos(l, (size_t)(k % (int64_t)fy_loader_batches(l)) * l->bt);
}
