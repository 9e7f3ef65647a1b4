/* tokens.c — token files (llm.c shards, plain text, globs of them) and the batch loader.
 *
 * Every file is read whole into one uint32 array, converted in fixed-size chunks so a
 * uint16 shard never needs a second copy. A file is judged by its first four bytes and
 * its name (see tokens.h); a shard's header is checked completely (magic, version,
 * count, exact size) before any token is read. Each error is logged once, naming the
 * file it is about. The token array remembers where each file of a glob begins, so a
 * vocabulary error can name the file and the position inside it.
 *
 * The loader is a cursor over [begin, end) of a token array: it owns nothing, and
 * keeps llm.c's order (read B*T+1 at pos, advance by B*T, wrap to 0 when the next read
 * would not fit). */
#include "engine/io/tokens.h"

#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define SHARD_HEADER_NBYTES 1024
#define CHUNK_NBYTES (1 << 16)

typedef struct tok_file {
    char *path;
    size_t begin; /* index of the file's first token */
} tok_file;

struct fy_tokens {
    uint32_t *data;
    size_t n;
    char *label;
    tok_file *files;
    int nfiles;
};

struct fy_loader {
    const fy_tokens *t;
    size_t begin, n; /* the range is [begin, begin + n) */
    size_t bt;       /* B*T */
    size_t pos;      /* offset from begin of the next batch */
};

static int ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && !strcmp(s + a - b, suffix);
}

/* Reads count tokens of tok_nbytes (1, 2 or 4, little-endian) at byte offset off of fd
 * into dst. */
static int read_tokens(int fd, off_t off, size_t count, int tok_nbytes, uint32_t *dst) {
    uint8_t buf[CHUNK_NBYTES];
    size_t per_chunk = CHUNK_NBYTES / (size_t)tok_nbytes;
    for (size_t done = 0; done < count;) {
        size_t k = count - done < per_chunk ? count - done : per_chunk;
        size_t want = k * (size_t)tok_nbytes, got = 0;
        while (got < want) {
            ssize_t r = pread(fd, buf + got, want - got, off + (off_t)got);
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) return -1;
            got += (size_t)r;
        }
        if (tok_nbytes == 4) {
            memcpy(dst + done, buf, want);
        } else if (tok_nbytes == 2) {
            for (size_t i = 0; i < k; i++)
                dst[done + i] = (uint32_t)buf[2 * i] | (uint32_t)buf[2 * i + 1] << 8;
        } else {
            for (size_t i = 0; i < k; i++) dst[done + i] = buf[i];
        }
        off += (off_t)want;
        done += k;
    }
    return 0;
}

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
        if (ends_with(path, ".bin")) {
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

/* Appends the tokens of one file to t. */
static fy_status load_file(fy_tokens *t, const char *path) {
    char why[256] = "";
    fy_status st = FY_ERR_IO;
    struct stat sb;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0 || fstat(fd, &sb) != 0) {
        snprintf(why, sizeof why, "cannot open: %s", strerror(errno));
        goto fail;
    }
    if (!S_ISREG(sb.st_mode)) {
        snprintf(why, sizeof why, "not a regular file");
        goto fail;
    }
    int tok_nbytes;
    size_t count;
    off_t data_off;
    st = classify(path, fd, (size_t)sb.st_size, &tok_nbytes, &count, &data_off, why, sizeof why);
    if (st != FY_OK) goto fail;
    st = FY_ERR_NOMEM;
    snprintf(why, sizeof why, "out of memory for %zu tokens", t->n + count);
    uint32_t *data = realloc(t->data, (t->n + count) * sizeof *data);
    if (!data) goto fail;
    t->data = data;
    tok_file *files = realloc(t->files, (size_t)(t->nfiles + 1) * sizeof *files);
    if (!files) goto fail;
    t->files = files;
    if (!(files[t->nfiles].path = strdup(path))) goto fail;
    files[t->nfiles].begin = t->n;
    t->nfiles++;
    errno = 0;
    if (read_tokens(fd, data_off, count, tok_nbytes, t->data + t->n) != 0) {
        snprintf(why, sizeof why, "cannot read: %s", errno ? strerror(errno) : "short read");
        st = FY_ERR_IO;
        goto fail;
    }
    t->n += count;
    close(fd);
    return FY_OK;
fail:
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
    fy_status st = strpbrk(path, "*?[") ? load_glob(t, path) : load_file(t, path);
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
    t->data = malloc(n * sizeof *t->data);
    t->files = malloc(sizeof *t->files);
    if (!t->data || !t->files || !(t->files[0].path = strdup(label))) {
        if (t->files) t->files[0].path = NULL;
        t->nfiles = t->files ? 1 : 0;
        fy_tokens_free(t);
        fy_log_error("%s: out of memory for %zu tokens", label, n);
        return FY_ERR_NOMEM;
    }
    t->files[0].begin = 0;
    t->nfiles = 1;
    for (size_t i = 0; i < n; i++) t->data[i] = bytes[i];
    t->n = n;
    *out = t;
    return FY_OK;
}

void fy_tokens_free(fy_tokens *t) {
    if (!t) return;
    for (int i = 0; i < t->nfiles; i++) free(t->files[i].path);
    free(t->files);
    free(t->data);
    free(t->label);
    free(t);
}

size_t fy_tokens_count(const fy_tokens *t) { return t->n; }
const uint32_t *fy_tokens_data(const fy_tokens *t) { return t->data; }
const char *fy_tokens_label(const fy_tokens *t) { return t->label; }

fy_status fy_tokens_check_vocab(const fy_tokens *t, int vocab) {
    if (vocab <= 0) {
        fy_log_error("%s: vocabulary size %d is not positive", t->label, vocab);
        return FY_ERR_INVALID;
    }
    for (size_t i = 0; i < t->n; i++) {
        if (t->data[i] < (uint32_t)vocab) continue;
        int f = 0;
        while (f + 1 < t->nfiles && t->files[f + 1].begin <= i) f++;
        fy_log_error("%s: token id %u at position %zu is not below the vocabulary size %d",
                     t->files[f].path, t->data[i], i - t->files[f].begin, vocab);
        return FY_ERR_INVALID;
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
    *l = (fy_loader){.t = t, .begin = begin, .n = end - begin, .bt = bt, .pos = 0};
    *out = l;
    return FY_OK;
}

void fy_loader_free(fy_loader *l) { free(l); }

void fy_loader_next(fy_loader *l, int32_t *x, int32_t *y) {
    const uint32_t *src = l->t->data + l->begin + l->pos;
    for (size_t i = 0; i < l->bt; i++) {
        x[i] = (int32_t)src[i];
        y[i] = (int32_t)src[i + 1];
    }
    l->pos += l->bt;
    if (l->pos + l->bt + 1 > l->n) l->pos = 0;
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
