/* safetensors.c — a strict reader (mmap) and an atomic writer of safetensors files.
 *
 * Reader: the whole file is mapped read-only; the header is parsed with cJSON and every
 * tensor entry is checked before the file is handed out. The tensors must tile the data
 * region exactly: sorted by begin offset, the first starts at 0, each starts where the
 * previous ends, the last ends at the end of the file. That one rule rejects overlaps,
 * holes, trailing bytes and truncation alike, and is what the reference implementation
 * enforces. The cJSON tree stays alive with the file: names and metadata values point
 * into it. Tensor data pointers point into the map and may be unaligned (offsets are
 * byte offsets), so every read goes through memcpy.
 *
 * Writer: "__metadata__" first, then the tensors in the caller's order at contiguous
 * offsets; the header is padded with spaces to a multiple of 8 so the data region
 * starts 8-aligned. The bytes go to "<path>.tmp.<pid>" (created exclusively: two
 * writers never share it) through an outfile (outfile.h; tensors the caller fills are
 * produced in place in its buffers, range by range), which is fsynced, renamed over
 * <path>, and the directory fsynced; on any failure the tmp file is removed and <path> is
 * left as it was. What a killed writer left ("<path>.tmp.<pid>" of a process no longer
 * running) is removed by the next write of <path>. Assumes a little-endian host (checked
 * at compile time). */
#include "engine/io/safetensors.h"

#include "engine/core/crc32c.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "engine/core/util.h"
#include "engine/io/json_file.h"
#include "engine/io/outfile.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors.c assumes a little-endian host"
#endif

#define MAX_HEADER_NBYTES ((uint64_t)100 * 1000 * 1000)
#define MAX_EXACT_DOUBLE 9007199254740992.0 /* 2^53: integers above are not exact */

struct fy_st_file {
    char *path;
    void *map;
    size_t map_nbytes;
    const uint8_t *data; /* start of the data region */
    size_t data_nbytes;
    cJSON *root;
    cJSON *meta;         /* the "__metadata__" object, or NULL */
    fy_st_tensor *tensors;
    int n;
};

typedef struct st_dtype {
    const char *name;
    size_t size;
    fy_dtype dtype;
} st_dtype;

static const st_dtype k_dtypes[] = {
    {"F64", 8, FY_DTYPE_NONE},  {"F32", 4, FY_F32},          {"F16", 2, FY_F16},
    {"BF16", 2, FY_BF16},       {"I64", 8, FY_DTYPE_NONE},   {"I32", 4, FY_DTYPE_NONE},
    {"I16", 2, FY_DTYPE_NONE},  {"I8", 1, FY_DTYPE_NONE},    {"U64", 8, FY_DTYPE_NONE},
    {"U32", 4, FY_DTYPE_NONE},  {"U16", 2, FY_DTYPE_NONE},   {"U8", 1, FY_DTYPE_NONE},
    {"BOOL", 1, FY_DTYPE_NONE}, {"F8_E4M3", 1, FY_DTYPE_NONE},
    {"F8_E5M2", 1, FY_DTYPE_NONE},
};

static const st_dtype *dtype_by_name(const char *s) {
    for (size_t i = 0; i < sizeof k_dtypes / sizeof k_dtypes[0]; i++)
        if (!strcmp(k_dtypes[i].name, s)) return &k_dtypes[i];
    return NULL;
}

static const char *dtype_str(fy_dtype t) {
    switch (t) {
    case FY_F32: return "F32";
    case FY_BF16: return "BF16";
    case FY_F16: return "F16";
    default: return NULL;
    }
}

/* A JSON number that is a non-negative integer exactly representable in a double. */
static int json_uint(const cJSON *j, uint64_t *out) {
    if (!cJSON_IsNumber(j)) return -1;
    double d = j->valuedouble;
    if (!(d >= 0.0 && d <= MAX_EXACT_DOUBLE) || d != (double)(uint64_t)d) return -1;
    *out = (uint64_t)d;
    return 0;
}

static int mul_overflows(size_t a, size_t b, size_t *out) {
    if (a != 0 && b > SIZE_MAX / a) return 1;
    *out = a * b;
    return 0;
}

/* Parses one tensor entry; on failure writes the problem into why and returns -1. */
static int parse_tensor(const cJSON *j, const uint8_t *data, size_t data_nbytes,
                        fy_st_tensor *t, uint64_t off[2], char *why, size_t cap) {
    if (!cJSON_IsObject(j)) return snprintf(why, cap, "entry is not an object"), -1;
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(j, "dtype");
    const cJSON *sh = cJSON_GetObjectItemCaseSensitive(j, "shape");
    const cJSON *of = cJSON_GetObjectItemCaseSensitive(j, "data_offsets");
    if (!dt) return snprintf(why, cap, "missing \"dtype\""), -1;
    if (!cJSON_IsString(dt)) return snprintf(why, cap, "\"dtype\" is not a string"), -1;
    const st_dtype *d = dtype_by_name(dt->valuestring);
    if (!d) return snprintf(why, cap, "unknown dtype \"%.32s\"", dt->valuestring), -1;
    if (!sh) return snprintf(why, cap, "missing \"shape\""), -1;
    if (!cJSON_IsArray(sh)) return snprintf(why, cap, "\"shape\" is not an array"), -1;
    int ndim = cJSON_GetArraySize(sh);
    if (ndim > FY_ST_MAX_DIMS)
        return snprintf(why, cap, "shape has %d dims (at most %d)", ndim, FY_ST_MAX_DIMS), -1;
    size_t nelem = 1;
    int k = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, sh) {
        uint64_t v;
        if (json_uint(e, &v) != 0)
            return snprintf(why, cap, "shape[%d] is not a non-negative integer", k), -1;
        if (v > INT64_MAX || mul_overflows(nelem, (size_t)v, &nelem))
            return snprintf(why, cap, "shape overflows"), -1;
        t->shape[k++] = (int64_t)v;
    }
    if (!of) return snprintf(why, cap, "missing \"data_offsets\""), -1;
    if (!cJSON_IsArray(of) || cJSON_GetArraySize(of) != 2 ||
        json_uint(cJSON_GetArrayItem(of, 0), &off[0]) != 0 ||
        json_uint(cJSON_GetArrayItem(of, 1), &off[1]) != 0)
        return snprintf(why, cap, "\"data_offsets\" is not [begin, end] of integers"), -1;
    if (off[0] > off[1])
        return snprintf(why, cap, "data_offsets [%" PRIu64 ", %" PRIu64 "] end before begin",
                        off[0], off[1]), -1;
    if (off[1] > data_nbytes)
        return snprintf(why, cap, "data_offsets [%" PRIu64 ", %" PRIu64 "] past the end of the "
                        "data (%zu bytes; file truncated?)", off[0], off[1], data_nbytes), -1;
    size_t nbytes;
    if (mul_overflows(nelem, d->size, &nbytes) || nbytes != off[1] - off[0])
        return snprintf(why, cap, "shape holds %zu elements of %zu bytes but data_offsets span "
                        "%" PRIu64 " bytes", nelem, d->size, off[1] - off[0]), -1;
    t->dtype_str = d->name;
    t->dtype = d->dtype;
    t->ndim = ndim;
    t->nelem = nelem;
    t->nbytes = nbytes;
    t->data = data + off[0];
    return 0;
}

static int parse_meta(const cJSON *m, char *why, size_t cap) {
    if (!cJSON_IsObject(m)) return snprintf(why, cap, "\"__metadata__\" is not an object"), -1;
    const cJSON *e;
    cJSON_ArrayForEach(e, m) {
        if (!cJSON_IsString(e))
            return snprintf(why, cap, "__metadata__ \"%.64s\" is not a string", e->string), -1;
    }
    return 0;
}

typedef struct span { uint64_t begin, end; int idx; } span;

static int cmp_span(const void *a, const void *b) {
    const span *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return x->idx - y->idx;
}

/* The exact tiling of the data region (names are unique: parse_header refused a key
 * twice before). */
static int check_layout(fy_st_file *f, span *spans, char *why, size_t cap) {
    int n = f->n;
    qsort(spans, (size_t)n, sizeof *spans, cmp_span);
    uint64_t at = 0;
    for (int i = 0; i < n; i++) {
        const char *name = f->tensors[spans[i].idx].name;
        if (spans[i].begin < at)
            return snprintf(why, cap, "tensor \"%.64s\" at [%" PRIu64 ", %" PRIu64 ") overlaps "
                            "the previous one", name, spans[i].begin, spans[i].end), -1;
        if (spans[i].begin > at)
            return snprintf(why, cap, "data bytes [%" PRIu64 ", %" PRIu64 ") belong to no tensor",
                            at, spans[i].begin), -1;
        at = spans[i].end;
    }
    if (at != f->data_nbytes)
        return snprintf(why, cap, "data bytes [%" PRIu64 ", %zu) belong to no tensor", at,
                        f->data_nbytes), -1;
    return 0;
}

static fy_status parse_header(fy_st_file *f, const char *json, size_t json_nbytes,
                              char *why, size_t cap) {
    const char *end = NULL;
    f->root = cJSON_ParseWithLengthOpts(json, json_nbytes, &end, 0);
    if (!f->root) return snprintf(why, cap, "header is not valid JSON"), FY_ERR_FORMAT;
    for (const char *p = end; p < json + json_nbytes; p++)
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r')
            return snprintf(why, cap, "junk after the header JSON"), FY_ERR_FORMAT;
    if (!cJSON_IsObject(f->root))
        return snprintf(why, cap, "header is not a JSON object"), FY_ERR_FORMAT;
    char dup[160];
    if (fy_json_duplicate(f->root, dup, sizeof dup)) /* a tensor's name, or a key in one */
        return snprintf(why, cap, "duplicate header key \"%s\" (it appears twice)", dup), FY_ERR_FORMAT;
    int n = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, f->root) n += strcmp(e->string, "__metadata__") != 0;
    f->tensors = calloc((size_t)(n ? n : 1), sizeof *f->tensors);
    span *spans = malloc((size_t)(n ? n : 1) * sizeof *spans);
    if (!f->tensors || !spans) {
        free(spans);
        return snprintf(why, cap, "out of memory"), FY_ERR_NOMEM;
    }
    cJSON_ArrayForEach(e, f->root) {
        if (!strcmp(e->string, "__metadata__")) {
            if (parse_meta(e, why, cap) != 0) goto fail;
            f->meta = (cJSON *)e;
            continue;
        }
        fy_st_tensor *t = &f->tensors[f->n];
        uint64_t off[2];
        t->name = e->string;
        char inner[200];
        if (parse_tensor(e, f->data, f->data_nbytes, t, off, inner, sizeof inner) != 0) {
            snprintf(why, cap, "tensor \"%.64s\": %s", e->string, inner);
            goto fail;
        }
        spans[f->n] = (span){off[0], off[1], f->n};
        f->n++;
    }
    if (check_layout(f, spans, why, cap) != 0) goto fail;
    free(spans);
    return FY_OK;
fail:
    free(spans);
    return FY_ERR_FORMAT;
}

fy_status fy_st_open(const char *path, fy_st_file **out) {
    *out = NULL;
    char why[400] = "";
    fy_status st = FY_ERR_FORMAT;
    fy_st_file *f = calloc(1, sizeof *f);
    if (!f || !(f->path = strdup(path))) {
        free(f);
        fy_log_error("%s: out of memory", path);
        return FY_ERR_NOMEM;
    }
    int fd = fy_open_read(path);
    struct stat sb;
    if (fd < 0 || fstat(fd, &sb) != 0) {
        snprintf(why, sizeof why, "cannot open: %s", strerror(errno));
        st = FY_ERR_IO;
        goto fail;
    }
    if (!S_ISREG(sb.st_mode)) {
        snprintf(why, sizeof why, "not a regular file");
        st = FY_ERR_IO;
        goto fail;
    }
    size_t size = (size_t)sb.st_size;
    if (size == 0) { snprintf(why, sizeof why, "file is empty"); goto fail; }
    if (size < 8) {
        snprintf(why, sizeof why, "file is %zu bytes, shorter than the 8-byte header length",
                 size);
        goto fail;
    }
    f->map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (f->map == MAP_FAILED) {
        f->map = NULL;
        snprintf(why, sizeof why, "cannot map: %s", strerror(errno));
        st = FY_ERR_IO;
        goto fail;
    }
    f->map_nbytes = size;
    close(fd);
    fd = -1;
    uint64_t hlen;
    memcpy(&hlen, f->map, 8);
    if (hlen > MAX_HEADER_NBYTES) {
        snprintf(why, sizeof why, "absurd header length %" PRIu64 " (limit %" PRIu64 ")", hlen,
                 MAX_HEADER_NBYTES);
        goto fail;
    }
    if (hlen > size - 8) {
        snprintf(why, sizeof why, "header length %" PRIu64 " exceeds the %zu bytes after it "
                 "(file truncated?)", hlen, size - 8);
        goto fail;
    }
    f->data = (const uint8_t *)f->map + 8 + hlen;
    f->data_nbytes = size - 8 - (size_t)hlen;
    st = parse_header(f, (const char *)f->map + 8, (size_t)hlen, why, sizeof why);
    if (st != FY_OK) goto fail;
    *out = f;
    return FY_OK;
fail:
    if (fd >= 0) close(fd);
    fy_log_error("%s: %s", path, why);
    fy_st_close(f);
    return st;
}

void fy_st_close(fy_st_file *f) {
    if (!f) return;
    if (f->map) munmap(f->map, f->map_nbytes);
    cJSON_Delete(f->root);
    free(f->tensors);
    free(f->path);
    free(f);
}

int fy_st_count(const fy_st_file *f) { return f->n; }

const fy_st_tensor *fy_st_at(const fy_st_file *f, int i) {
    FY_ASSERT(i >= 0 && i < f->n, "tensor index out of range");
    return &f->tensors[i];
}

const fy_st_tensor *fy_st_find(const fy_st_file *f, const char *name) {
    for (int i = 0; i < f->n; i++)
        if (!strcmp(f->tensors[i].name, name)) return &f->tensors[i];
    return NULL;
}

const char *fy_st_meta(const fy_st_file *f, const char *key) {
    if (!f->meta) return NULL;
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(f->meta, key);
    return v ? v->valuestring : NULL;
}

const char *fy_st_path(const fy_st_file *f) { return f->path; }

fy_status fy_st_read_f32(const fy_st_file *f, const fy_st_tensor *t, float *dst) {
    const uint8_t *src = t->data;
    switch (t->dtype) {
    case FY_F32:
        memcpy(dst, src, t->nbytes);
        return FY_OK;
    case FY_BF16:
        for (size_t i = 0; i < t->nelem; i++) {
            uint16_t h;
            memcpy(&h, src + 2 * i, 2);
            dst[i] = fy_bf16_to_f32(h);
        }
        return FY_OK;
    case FY_F16:
        for (size_t i = 0; i < t->nelem; i++) {
            uint16_t h;
            memcpy(&h, src + 2 * i, 2);
            dst[i] = fy_f16_to_f32(h);
        }
        return FY_OK;
    default:
        fy_log_error("%s: tensor \"%s\" has dtype %s, which cannot be read as fp32 (F32, BF16 "
                     "or F16 expected)", f->path, t->name, t->dtype_str);
        return FY_ERR_FORMAT;
    }
}

void fy_st_release(const fy_st_file *f, const fy_st_tensor *t) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    uintptr_t lo = fy_round_up((uintptr_t)t->data, page), hi = ((uintptr_t)t->data + t->nbytes) / page * page;
    (void)f;
    if (hi > lo) madvise((void *)lo, hi - lo, MADV_DONTNEED); /* advice: failure changes nothing */
}

/* ---- writer ---- */

static size_t entry_nbytes(const fy_st_entry *e) {
    size_t n = fy_dtype_size(e->dtype);
    for (int d = 0; d < e->ndim; d++)
        if (mul_overflows(n, (size_t)e->shape[d], &n)) return SIZE_MAX;
    return n;
}

static int check_entries(const char *path, const fy_st_entry *es, int n,
                         const char *const *meta, fy_st_fill_fn fill) {
    for (int i = 0; i < n; i++) {
        const fy_st_entry *e = &es[i];
        if (!e->name || !strcmp(e->name, "__metadata__")) {
            fy_log_error("%s: tensor %d has no name or the reserved name __metadata__", path, i);
            return -1;
        }
        if (!dtype_str(e->dtype) || e->ndim < 0 || e->ndim > FY_ST_MAX_DIMS) {
            fy_log_error("%s: tensor \"%s\": dtype must be F32, BF16 or F16 and ndim 0..%d",
                         path, e->name, FY_ST_MAX_DIMS);
            return -1;
        }
        for (int d = 0; d < e->ndim; d++) {
            if (e->shape[d] < 0) {
                fy_log_error("%s: tensor \"%s\": negative dimension", path, e->name);
                return -1;
            }
        }
        if (entry_nbytes(e) == SIZE_MAX || (entry_nbytes(e) > 0 && !e->data && !fill)) {
            fy_log_error("%s: tensor \"%s\": size overflows or data is NULL", path, e->name);
            return -1;
        }
        for (int j = 0; j < i; j++) {
            if (!strcmp(es[j].name, e->name)) {
                fy_log_error("%s: duplicate tensor name \"%s\"", path, e->name);
                return -1;
            }
        }
    }
    for (int i = 0; meta && meta[i]; i += 2) {
        if (!meta[i + 1]) {
            fy_log_error("%s: metadata key \"%s\" has no value", path, meta[i]);
            return -1;
        }
    }
    return 0;
}

/* The header JSON (unpadded), malloc'd; NULL when out of memory. Numbers go in as raw
 * text so offsets print as exact integers whatever their size. */
static char *build_header(const fy_st_entry *es, int n, const char *const *meta) {
    cJSON *root = cJSON_CreateObject();
    char *json = NULL;
    if (!root) return NULL;
    if (meta && meta[0]) {
        cJSON *m = cJSON_AddObjectToObject(root, "__metadata__");
        if (!m) goto done;
        for (int i = 0; meta[i]; i += 2) {
            cJSON_DeleteItemFromObjectCaseSensitive(m, meta[i]); /* last value wins */
            if (!cJSON_AddStringToObject(m, meta[i], meta[i + 1])) goto done;
        }
    }
    uint64_t at = 0;
    for (int i = 0; i < n; i++) {
        const fy_st_entry *e = &es[i];
        char shape[FY_ST_MAX_DIMS * 21 + 3], offs[48];
        size_t len = 0;
        shape[len++] = '[';
        for (int d = 0; d < e->ndim; d++)
            len += (size_t)snprintf(shape + len, sizeof shape - len, "%s%" PRId64, d ? "," : "",
                                    e->shape[d]);
        snprintf(shape + len, sizeof shape - len, "]");
        uint64_t nb = entry_nbytes(e);
        snprintf(offs, sizeof offs, "[%" PRIu64 ",%" PRIu64 "]", at, at + nb);
        at += nb;
        cJSON *t = cJSON_AddObjectToObject(root, e->name);
        if (!t || !cJSON_AddStringToObject(t, "dtype", dtype_str(e->dtype)) ||
            !cJSON_AddRawToObject(t, "shape", shape) ||
            !cJSON_AddRawToObject(t, "data_offsets", offs))
            goto done;
    }
    json = cJSON_PrintUnformatted(root);
done:
    cJSON_Delete(root);
    return json;
}

/* The 8-byte length and the header JSON padded with spaces to a multiple of 8, in one
 * malloc'd buffer of *nbytes; NULL when out of memory. */
static uint8_t *padded_header(const fy_st_entry *es, int n, const char *const *meta,
                              size_t *nbytes) {
    char *json = build_header(es, n, meta);
    if (!json) return NULL;
    size_t jlen = strlen(json), hlen = fy_round_up(jlen, 8);
    uint8_t *b = malloc(8 + hlen);
    if (b) {
        uint64_t hlen64 = hlen;
        memcpy(b, &hlen64, 8);
        memcpy(b + 8, json, jlen);
        memset(b + 8 + jlen, ' ', hlen - jlen);
        *nbytes = 8 + hlen;
    }
    free(json);
    return b;
}

/* Tensor i's bytes, produced by fill straight into the outfile's buffers (a range of whole
 * elements at a time; an element that straddles two buffers through a small bounce). */
static fy_status fill_tensor(fy_outfile *of, const fy_st_entry *e, int i, fy_st_fill_fn fill,
                             void *ctx) {
    const size_t esz = fy_dtype_size(e->dtype), nelem = entry_nbytes(e) / esz;
    for (size_t at = 0; at < nelem;) {
        void *p;
        size_t avail;
        FY_TRY(fy_outfile_span(of, &p, &avail));
        size_t k = avail / esz < nelem - at ? avail / esz : nelem - at;
        if (k == 0) {
            uint8_t one[8];
            FY_TRY(fill(ctx, i, at, 1, one));
            FY_TRY(fy_outfile_write(of, one, esz));
            at++;
            continue;
        }
        FY_TRY(fill(ctx, i, at, k, p));
        FY_TRY(fy_outfile_commit(of, k * esz));
        at += k;
    }
    return FY_OK;
}

/* Creates tmp and writes header and data to it, fsynced and closed (outfile.h: the data
 * written as it is produced, through aligned buffers, its CRC-32C into *crc when crc is
 * not NULL). On failure (logged: by fill for its own) tmp is removed. */
static fy_status write_tmp(const char *tmp, const uint8_t *header, size_t header_nbytes,
                           const fy_st_entry *es, int n, fy_st_fill_fn fill, void *ctx,
                           uint32_t *crc) {
    uint64_t total = header_nbytes;
    for (int i = 0; i < n; i++) total += entry_nbytes(&es[i]);
    fy_outfile *of;
    FY_TRY(fy_outfile_open(tmp, total, NULL, &of));
    fy_status st = fy_outfile_write(of, header, header_nbytes);
    for (int i = 0; i < n && st == FY_OK; i++) {
        if (es[i].data || entry_nbytes(&es[i]) == 0)
            st = fy_outfile_write(of, es[i].data, entry_nbytes(&es[i]));
        else
            st = fill_tensor(of, &es[i], i, fill, ctx);
    }
    if (st == FY_OK) st = fy_outfile_close(of, NULL, crc);
    else fy_outfile_abandon(of);
    if (st != FY_OK) unlink(tmp);
    return st;
}

fy_status fy_st_write(const char *path, const fy_st_entry *entries, int n,
                      const char *const *meta) {
    return fy_st_write_fill(path, entries, n, meta, NULL, NULL);
}

fy_status fy_st_write_fill(const char *path, const fy_st_entry *entries, int n,
                           const char *const *meta, fy_st_fill_fn fill, void *ctx) {
    return fy_st_write_fill_crc(path, entries, n, meta, fill, ctx, NULL);
}

/* Removes the "<path>.tmp.<pid>" files of writers no longer running (killed mid-write);
 * this process's own name too (a pid the system gave again). */
static void remove_stale_tmps(const char *path, const char *dir) {
    const char *slash = strrchr(path, '/'), *base = slash ? slash + 1 : path;
    DIR *d = opendir(dir);
    for (struct dirent *e; d && (e = readdir(d));)
        if (fy_left_by_dead_writer(e->d_name, base, ".tmp.")) unlinkat(dirfd(d), e->d_name, 0);
    if (d) closedir(d);
}

fy_status fy_st_write_fill_crc(const char *path, const fy_st_entry *entries, int n,
                               const char *const *meta, fy_st_fill_fn fill, void *ctx,
                               uint32_t *crc) {
    if (n < 0 || (n > 0 && !entries)) {
        fy_log_error("%s: bad tensor list (n = %d)", path, n);
        return FY_ERR_INVALID;
    }
    if (check_entries(path, entries, n, meta, fill) != 0) return FY_ERR_INVALID;
    fy_status st = FY_ERR_NOMEM;
    const char *what = "out of memory", *who = path;
    int dirfd = -1;
    size_t plen = strlen(path), header_nbytes = 0;
    char *tmp = malloc(plen + 32), *dir = malloc(plen + 2);
    uint8_t *header = padded_header(entries, n, meta, &header_nbytes);
    if (!tmp || !dir || !header) goto fail;
    snprintf(tmp, plen + 32, "%s.tmp.%ld", path, (long)getpid());
    memcpy(dir, path, plen + 1);
    char *slash = strrchr(dir, '/');
    if (!slash) snprintf(dir, plen + 2, ".");
    else if (slash == dir) dir[1] = '\0';
    else *slash = '\0';
    remove_stale_tmps(path, dir);

    if ((st = write_tmp(tmp, header, header_nbytes, entries, n, fill, ctx, crc)) != FY_OK)
        goto done; /* logged */
    st = FY_ERR_IO;
    what = "cannot open the directory";
    who = dir;
    dirfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dirfd < 0) {
        int err = errno;
        unlink(tmp);
        errno = err;
        goto fail;
    }
    what = "cannot rename into place";
    who = tmp;
    if (rename(tmp, path) != 0) {
        int err = errno;
        unlink(tmp);
        errno = err;
        goto fail;
    }
    if (fsync(dirfd) != 0) {
        /* the new file is in place; only its durability is in doubt */
        fy_log_error("%s: written, but fsync of directory %s failed: %s", path, dir,
                     strerror(errno));
        goto done;
    }
    st = FY_OK;
    goto done;
fail:
    if (st == FY_ERR_IO) fy_log_error("%s %s: %s", what, who, strerror(errno));
    else fy_log_error("%s: %s", path, what);
done:
    if (dirfd >= 0) close(dirfd);
    free(header);
    free(tmp);
    free(dir);
    return st;
}
