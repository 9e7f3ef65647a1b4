/* test_io.c — safetensors, token files, the batch loader and the generated corpus.
 *
 * Every test works in its own temporary directory (made in .init, removed in .fini) and
 * writes the files it reads, byte by byte where the point is the format, so nothing here
 * depends on a committed fixture. Error cases check the status, that nothing was handed
 * out, and that exactly one line was logged naming the file and the problem (stderr is
 * captured through a file for that). Also here: CRC-32C, the checkpoint state parser, the
 * outfile (every path it writes by), and the model writer's bytes pinned across its
 * rewrites. */
#include <criterion/criterion.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#include "engine/checkpoint.h"
#include "engine/core/crc32c.h"
#include "engine/core/dtype.h"
#include "engine/core/status.h"
#include "engine/io/corpus.h"
#include "engine/io/outfile.h"
#include "engine/io/safetensors.h"
#include "engine/io/tokens.h"
#include "tests/test_util.h"

/* ---- temporary directory, files, stderr capture ---- */

static char g_dir[64];

static void make_dir(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/ferry-test-io-XXXXXX");
    cr_assert_not_null(mkdtemp(g_dir), "mkdtemp: %s", strerror(errno));
}

static void remove_dir(void) {
    chmod(g_dir, 0700);
    test_remove_tree(g_dir);
}

/* A path inside the test directory. */
static const char *P(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    const char *p = test_vpath(g_dir, fmt, ap);
    va_end(ap);
    return p;
}

/* The temporary file a write of `name` in the test directory uses from this process. */
static const char *tmp_of(const char *name) { return P("%s.tmp.%ld", name, (long)getpid()); }

static void write_file(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "cannot create %s", path);
    cr_assert_eq(fwrite(data, 1, n, f), n);
    cr_assert_eq(fclose(f), 0);
}

static int exists(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0;
}

static int g_saved_fd = -1;
static char g_cap_path[128];

static void capture_begin(void) {
    snprintf(g_cap_path, sizeof g_cap_path, "/tmp/ferry-test-io-stderr-%d", (int)getpid());
    fflush(stderr);
    g_saved_fd = dup(2);
    int fd = open(g_cap_path, O_RDWR | O_CREAT | O_TRUNC, 0600);
    cr_assert(fd >= 0 && g_saved_fd >= 0);
    dup2(fd, 2);
    close(fd);
}

/* Ends the capture; returns what was written to stderr (static buffer). */
static const char *capture_end(void) {
    static char out[8192];
    fflush(stderr);
    dup2(g_saved_fd, 2);
    close(g_saved_fd);
    FILE *f = fopen(g_cap_path, "rb");
    size_t n = f ? fread(out, 1, sizeof out - 1, f) : 0;
    if (f) fclose(f);
    out[n] = '\0';
    unlink(g_cap_path);
    return out;
}

/* Exactly one "ferry: error:" line that contains every given word (NULL-terminated). */
static void assert_one_error(const char *log, ...) {
    int lines = 0;
    for (const char *p = log; *p; p++) lines += *p == '\n';
    cr_assert_eq(lines, 1, "expected one logged line, got %d:\n%s", lines, log);
    cr_assert(!strncmp(log, "ferry: error: ", 14), "not an error line: %s", log);
    va_list ap;
    va_start(ap, log);
    for (const char *w = va_arg(ap, const char *); w; w = va_arg(ap, const char *))
        cr_assert_not_null(strstr(log, w), "\"%s\" missing from: %s", w, log);
    va_end(ap);
}

/* ---- safetensors ---- */

TestSuite(safetensors, .init = make_dir, .fini = remove_dir);

/* A file with the given header length field, header text and data bytes. */
static void st_raw_len(const char *path, uint64_t hlen, const char *json, const void *data,
                       size_t data_n) {
    size_t jn = strlen(json);
    uint8_t *b = calloc(1, 8 + jn + data_n + 1);
    memcpy(b, &hlen, 8);
    memcpy(b + 8, json, jn);
    if (data_n) memcpy(b + 8 + jn, data, data_n);
    write_file(path, b, 8 + jn + data_n);
    free(b);
}

static void st_raw(const char *path, const char *json, size_t data_n) {
    uint8_t zeros[256] = {0};
    cr_assert(data_n <= sizeof zeros);
    st_raw_len(path, strlen(json), json, zeros, data_n);
}

/* fy_st_open fails with `want`, hands out nothing and logs one line with the path and
 * the keyword. */
static void expect_open_fails(const char *path, fy_status want, const char *keyword) {
    fy_st_file *f = (fy_st_file *)(uintptr_t)1;
    capture_begin();
    fy_status st = fy_st_open(path, &f);
    const char *log = capture_end();
    cr_assert_eq(st, want, "%s: status %s, want %s (log: %s)", keyword, fy_status_str(st),
                 fy_status_str(want), log);
    cr_assert_null(f);
    assert_one_error(log, path, keyword, NULL);
}

Test(safetensors, round_trip_dtypes_shapes_metadata) {
    float a[6] = {1.0f, -2.5f, 3.25f, 1e-30f, -0.0f, 123456.789f};
    float scalar = 42.5f;
    const float bvals[4] = {1.0f, -2.5f, 0.15625f, 1.7014118346046923e38f}; /* exact in bf16 */
    const float hvals[8] = {0.5f, -3.25f, 1024.0f, 6.103515625e-05f, /* exact in fp16 */
                            5.9604644775390625e-08f, -65504.0f, 0.0f, 7.0f};
    uint16_t b[4], h[8];
    for (int i = 0; i < 4; i++) b[i] = fy_f32_to_bf16(bvals[i]);
    for (int i = 0; i < 8; i++) h[i] = fy_f32_to_f16(hvals[i]);
    fy_st_entry es[] = {
        {.name = "h.0.attn.c_attn.weight", .dtype = FY_F32, .ndim = 2, .shape = {2, 3}, .data = a},
        {.name = "scalar", .dtype = FY_F32, .ndim = 0, .data = &scalar},
        {.name = "b", .dtype = FY_BF16, .ndim = 1, .shape = {4}, .data = b},
        {.name = "h", .dtype = FY_F16, .ndim = 3, .shape = {2, 2, 2}, .data = h},
        {.name = "empty", .dtype = FY_F32, .ndim = 2, .shape = {0, 5}, .data = NULL},
    };
    const char *meta[] = {"format", "pt", "ferry.n_layer", "2", NULL};
    const char *path = P("m.safetensors");
    cr_assert_eq(fy_st_write(path, es, 5, meta), FY_OK);

    fy_st_file *f;
    cr_assert_eq(fy_st_open(path, &f), FY_OK);
    cr_assert_str_eq(fy_st_path(f), path);
    cr_assert_eq(fy_st_count(f), 5);
    const char *dts[] = {"F32", "F32", "BF16", "F16", "F32"};
    const fy_dtype dt[] = {FY_F32, FY_F32, FY_BF16, FY_F16, FY_F32};
    const size_t nelem[] = {6, 1, 4, 8, 0};
    for (int i = 0; i < 5; i++) {
        const fy_st_tensor *t = fy_st_at(f, i);
        cr_assert_str_eq(t->name, es[i].name, "tensor %d out of order", i);
        cr_assert_str_eq(t->dtype_str, dts[i]);
        cr_assert_eq(t->dtype, dt[i]);
        cr_assert_eq(t->ndim, es[i].ndim);
        for (int d = 0; d < t->ndim; d++) cr_assert_eq(t->shape[d], es[i].shape[d]);
        cr_assert_eq(t->nelem, nelem[i]);
        cr_assert_eq(t->nbytes, nelem[i] * fy_dtype_size(dt[i]));
        if (t->nbytes) cr_assert_eq(memcmp(t->data, es[i].data, t->nbytes), 0);
    }
    float out[8];
    cr_assert_eq(fy_st_read_f32(f, fy_st_find(f, "h.0.attn.c_attn.weight"), out), FY_OK);
    for (int i = 0; i < 6; i++) cr_assert_eq(fy_f32_bits(out[i]), fy_f32_bits(a[i]));
    cr_assert_eq(fy_st_read_f32(f, fy_st_find(f, "scalar"), out), FY_OK);
    cr_assert_eq(out[0], 42.5f);
    cr_assert_eq(fy_st_read_f32(f, fy_st_find(f, "b"), out), FY_OK);
    for (int i = 0; i < 4; i++) cr_assert_eq(out[i], bvals[i], "bf16 %d: %g", i, out[i]);
    cr_assert_eq(fy_st_read_f32(f, fy_st_find(f, "h"), out), FY_OK);
    for (int i = 0; i < 8; i++) cr_assert_eq(out[i], hvals[i], "f16 %d: %g", i, out[i]);
    cr_assert_str_eq(fy_st_meta(f, "format"), "pt");
    cr_assert_str_eq(fy_st_meta(f, "ferry.n_layer"), "2");
    cr_assert_null(fy_st_meta(f, "absent"));
    cr_assert_null(fy_st_find(f, "absent"));
    fy_st_close(f);
}

Test(safetensors, writer_layout_metadata_first_padded_contiguous) {
    float x[3] = {1, 2, 3};
    uint16_t y[5] = {1, 2, 3, 4, 5};
    float z[1] = {9};
    fy_st_entry es[] = {
        {.name = "zeta", .dtype = FY_F32, .ndim = 1, .shape = {3}, .data = x},
        {.name = "alpha", .dtype = FY_BF16, .ndim = 1, .shape = {5}, .data = y},
        {.name = "mid", .dtype = FY_F32, .ndim = 1, .shape = {1}, .data = z},
    };
    const char *meta[] = {"format", "pt", NULL};
    const char *path = P("layout.safetensors");
    cr_assert_eq(fy_st_write(path, es, 3, meta), FY_OK);
    size_t n;
    uint8_t *b = (uint8_t *)test_read_file(path, &n);
    uint64_t hlen;
    memcpy(&hlen, b, 8);
    cr_assert_eq(hlen % 8, 0, "header length %llu not a multiple of 8", (unsigned long long)hlen);
    cr_assert_eq(n, 8 + hlen + 12 + 10 + 4);
    cr_assert(!strncmp((char *)b + 8, "{\"__metadata__\":", 16), "metadata not first");
    /* padding after the closing brace is spaces only */
    size_t end = 8 + hlen;
    while (b[end - 1] == ' ') end--;
    cr_assert_eq(b[end - 1], '}');
    /* data in the given order, contiguous, right after the header */
    cr_assert_eq(memcmp(b + 8 + hlen, x, 12), 0);
    cr_assert_eq(memcmp(b + 8 + hlen + 12, y, 10), 0);
    cr_assert_eq(memcmp(b + 8 + hlen + 22, z, 4), 0);
    free(b);
    fy_st_file *f;
    cr_assert_eq(fy_st_open(path, &f), FY_OK);
    cr_assert_str_eq(fy_st_at(f, 0)->name, "zeta");
    cr_assert_str_eq(fy_st_at(f, 1)->name, "alpha");
    cr_assert_str_eq(fy_st_at(f, 2)->name, "mid");
    fy_st_close(f);
}

Test(safetensors, no_metadata_when_none_given) {
    float x = 1;
    fy_st_entry e = {.name = "x", .dtype = FY_F32, .ndim = 0, .data = &x};
    const char *path = P("nometa.safetensors");
    cr_assert_eq(fy_st_write(path, &e, 1, NULL), FY_OK);
    size_t n;
    uint8_t *b = (uint8_t *)test_read_file(path, &n);
    b[n] = 0;
    cr_assert_null(strstr((char *)b + 8, "__metadata__"));
    free(b);
    fy_st_file *f;
    cr_assert_eq(fy_st_open(path, &f), FY_OK);
    cr_assert_null(fy_st_meta(f, "format"));
    cr_assert_eq(fy_st_count(f), 1);
    fy_st_close(f);
}

Test(safetensors, many_tensors_round_trip) {
    enum { NT = 1000 };
    static fy_st_entry es[NT];
    static char names[NT][32];
    static float vals[NT][4];
    for (int i = 0; i < NT; i++) {
        snprintf(names[i], sizeof names[i], "h.%d.mlp.c_fc.bias", i);
        int len = 1 + i % 4;
        for (int k = 0; k < len; k++) vals[i][k] = (float)(i * 10 + k);
        es[i] = (fy_st_entry){.name = names[i], .dtype = FY_F32, .ndim = 1, .shape = {len},
                              .data = vals[i]};
    }
    const char *path = P("many.safetensors");
    cr_assert_eq(fy_st_write(path, es, NT, NULL), FY_OK);
    fy_st_file *f;
    cr_assert_eq(fy_st_open(path, &f), FY_OK);
    cr_assert_eq(fy_st_count(f), NT);
    for (int i = NT - 1; i >= 0; i--) {
        const fy_st_tensor *t = fy_st_find(f, names[i]);
        cr_assert_not_null(t, "%s not found", names[i]);
        cr_assert_eq(t->nelem, (size_t)(1 + i % 4));
        float out[4];
        cr_assert_eq(fy_st_read_f32(f, t, out), FY_OK);
        for (size_t k = 0; k < t->nelem; k++) cr_assert_eq(out[k], vals[i][k]);
    }
    fy_st_close(f);
}

/* A file as another writer lays it out: keys sorted, data in a different order than the
 * keys, an integer tensor, no padding. */
Test(safetensors, reads_hand_built_file_and_refuses_int_as_f32) {
    const char *json = "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]},"
                       "\"b\":{\"dtype\":\"I32\",\"shape\":[2],\"data_offsets\":[0,8]}}";
    int32_t ints[2] = {-7, 1 << 30};
    float one = 0.75f;
    uint8_t data[12];
    memcpy(data, ints, 8);
    memcpy(data + 8, &one, 4);
    const char *path = P("hand.safetensors");
    st_raw_len(path, strlen(json), json, data, 12);
    fy_st_file *f;
    cr_assert_eq(fy_st_open(path, &f), FY_OK);
    cr_assert_eq(fy_st_count(f), 2);
    const fy_st_tensor *a = fy_st_find(f, "a"), *b = fy_st_find(f, "b");
    float out[2];
    cr_assert_eq(fy_st_read_f32(f, a, out), FY_OK);
    cr_assert_eq(out[0], 0.75f);
    cr_assert_eq(b->dtype, FY_DTYPE_NONE);
    cr_assert_str_eq(b->dtype_str, "I32");
    cr_assert_eq(memcmp(b->data, ints, 8), 0);
    capture_begin();
    fy_status st = fy_st_read_f32(f, b, out);
    const char *log = capture_end();
    cr_assert_eq(st, FY_ERR_FORMAT);
    assert_one_error(log, path, "\"b\"", "I32", NULL);
    fy_st_close(f);
}

Test(safetensors, writer_rejects_bad_entries_and_writes_nothing) {
    float x = 1;
    fy_st_entry dup[] = {
        {.name = "x", .dtype = FY_F32, .ndim = 0, .data = &x},
        {.name = "x", .dtype = FY_F32, .ndim = 0, .data = &x},
    };
    fy_st_entry none = {.name = "y", .dtype = FY_DTYPE_NONE, .ndim = 0, .data = &x};
    fy_st_entry neg = {.name = "z", .dtype = FY_F32, .ndim = 1, .shape = {-1}, .data = &x};
    const char *odd_meta[] = {"format", NULL};
    const char *path = P("bad.safetensors");
    capture_begin();
    fy_status s1 = fy_st_write(path, dup, 2, NULL);
    fy_status s2 = fy_st_write(path, &none, 1, NULL);
    fy_status s3 = fy_st_write(path, &neg, 1, NULL);
    fy_status s4 = fy_st_write(path, dup, 1, odd_meta);
    const char *log = capture_end();
    cr_assert_eq(s1, FY_ERR_INVALID);
    cr_assert_eq(s2, FY_ERR_INVALID);
    cr_assert_eq(s3, FY_ERR_INVALID);
    cr_assert_eq(s4, FY_ERR_INVALID);
    cr_assert_not_null(strstr(log, "duplicate"), "%s", log);
    cr_assert(!exists(path) && !exists(tmp_of("bad.safetensors")));
}

Test(safetensors, overwrite_replaces_and_leaves_no_tmp) {
    float x = 1, y = 2;
    fy_st_entry e = {.name = "x", .dtype = FY_F32, .ndim = 0, .data = &x};
    const char *path = P("w.safetensors");
    cr_assert_eq(fy_st_write(path, &e, 1, NULL), FY_OK);
    e.data = &y;
    cr_assert_eq(fy_st_write(path, &e, 1, NULL), FY_OK);
    cr_assert(!exists(tmp_of("w.safetensors")));
    fy_st_file *f;
    cr_assert_eq(fy_st_open(path, &f), FY_OK);
    float out;
    cr_assert_eq(fy_st_read_f32(f, fy_st_at(f, 0), &out), FY_OK);
    cr_assert_eq(out, 2.0f);
    fy_st_close(f);
}

/* Writes an "old" file, then makes a write fail; the old bytes must survive. */
static void write_old(const char *path, uint8_t **old, size_t *old_n) {
    float x = 123;
    fy_st_entry e = {.name = "old", .dtype = FY_F32, .ndim = 0, .data = &x};
    cr_assert_eq(fy_st_write(path, &e, 1, NULL), FY_OK);
    *old = (uint8_t *)test_read_file(path, old_n);
}

static void assert_unchanged(const char *path, const uint8_t *old, size_t old_n) {
    size_t n;
    uint8_t *now = (uint8_t *)test_read_file(path, &n);
    cr_assert(n == old_n && !memcmp(now, old, n), "%s was modified by a failed write", path);
    free(now);
}

static fy_st_entry big_entry(void) {
    static float big[64 * 1024];
    for (size_t i = 0; i < 64 * 1024; i++) big[i] = (float)i;
    return (fy_st_entry){.name = "big", .dtype = FY_F32, .ndim = 1, .shape = {64 * 1024},
                         .data = big};
}

/* What a killed writer left (<path>.tmp.<pid> of a process no longer running) is removed
 * by the next write of <path>; a running writer's (pid 1 here) is left alone. */
Test(safetensors, a_killed_writers_tmp_is_removed_by_the_next_write) {
    pid_t child = fork();
    cr_assert(child >= 0);
    if (child == 0) _exit(0);
    cr_assert_eq(waitpid(child, NULL, 0), child); /* its pid names no process now */
    const char *dead = P("w.safetensors.tmp.%ld", (long)child), *live = P("w.safetensors.tmp.1");
    write_file(dead, "partial", 7);
    write_file(live, "partial", 7);
    float x = 1;
    fy_st_entry e = {.name = "x", .dtype = FY_F32, .ndim = 0, .data = &x};
    cr_assert_eq(fy_st_write(P("w.safetensors"), &e, 1, NULL), FY_OK);
    cr_expect(!exists(dead), "the dead writer's tmp file is still there");
    cr_expect(exists(live), "a running process's tmp file was removed");
}

Test(safetensors, failed_create_leaves_existing_file_intact) {
    const char *path = P("keep.safetensors");
    uint8_t *old;
    size_t old_n;
    write_old(path, &old, &old_n);
    cr_assert_eq(mkdir(tmp_of("keep.safetensors"), 0700), 0); /* the tmp name is taken */
    fy_st_entry e = big_entry();
    capture_begin();
    fy_status st = fy_st_write(path, &e, 1, NULL);
    const char *log = capture_end();
    cr_assert_eq(st, FY_ERR_IO);
    assert_one_error(log, "keep.safetensors.tmp", NULL);
    assert_unchanged(path, old, old_n);
    free(old);
}

Test(safetensors, failed_write_midway_removes_tmp_and_keeps_existing) {
    const char *path = P("fsize.safetensors");
    uint8_t *old;
    size_t old_n;
    write_old(path, &old, &old_n);
    /* a file size limit makes write() fail part way (EFBIG), even for root */
    signal(SIGXFSZ, SIG_IGN);
    struct rlimit rl = {.rlim_cur = 4096, .rlim_max = RLIM_INFINITY};
    cr_assert_eq(setrlimit(RLIMIT_FSIZE, &rl), 0);
    fy_st_entry e = big_entry();
    capture_begin();
    fy_status st = fy_st_write(path, &e, 1, NULL);
    const char *log = capture_end();
    cr_assert_eq(st, FY_ERR_IO);
    assert_one_error(log, "fsize.safetensors.tmp", "cannot write", NULL);
    cr_assert(!exists(tmp_of("fsize.safetensors")), "tmp file left behind");
    assert_unchanged(path, old, old_n);
    free(old);
}

Test(safetensors, unwritable_directory_leaves_existing_file_intact) {
    if (geteuid() == 0) {
        remove_dir(); /* .fini does not run after a skip */
        cr_skip_test("root ignores directory permissions");
    }
    const char *path = P("ro.safetensors");
    uint8_t *old;
    size_t old_n;
    write_old(path, &old, &old_n);
    cr_assert_eq(chmod(g_dir, 0500), 0);
    fy_st_entry e = big_entry();
    capture_begin();
    fy_status st = fy_st_write(path, &e, 1, NULL);
    const char *log = capture_end();
    chmod(g_dir, 0700);
    cr_assert_eq(st, FY_ERR_IO);
    assert_one_error(log, "ro.safetensors.tmp", NULL);
    assert_unchanged(path, old, old_n);
    free(old);
}

Test(safetensors, write_into_missing_directory_fails) {
    float x = 1;
    fy_st_entry e = {.name = "x", .dtype = FY_F32, .ndim = 0, .data = &x};
    const char *path = P("no/such/dir/x.safetensors");
    capture_begin();
    fy_status st = fy_st_write(path, &e, 1, NULL);
    const char *log = capture_end();
    cr_assert_eq(st, FY_ERR_IO);
    assert_one_error(log, path, NULL);
}

Test(safetensors, missing_empty_short_and_truncated_files) {
    expect_open_fails(P("absent.safetensors"), FY_ERR_IO, "cannot open");
    write_file(P("empty.safetensors"), "", 0);
    expect_open_fails(P("empty.safetensors"), FY_ERR_FORMAT, "empty");
    write_file(P("short.safetensors"), "\x10\0\0\0\0", 5);
    expect_open_fails(P("short.safetensors"), FY_ERR_FORMAT, "shorter than");
    /* header length says more than the file holds */
    st_raw_len(P("hlen.safetensors"), 1000, "{}", NULL, 0);
    expect_open_fails(P("hlen.safetensors"), FY_ERR_FORMAT, "exceeds");
    st_raw_len(P("absurd.safetensors"), (uint64_t)1 << 40, "{}", NULL, 0);
    expect_open_fails(P("absurd.safetensors"), FY_ERR_FORMAT, "absurd header length");
    st_raw_len(P("absurd2.safetensors"), 100000001, "{}", NULL, 0);
    expect_open_fails(P("absurd2.safetensors"), FY_ERR_FORMAT, "absurd header length");

    /* a valid file cut short: the last tensor runs past the end */
    float x[4] = {1, 2, 3, 4};
    fy_st_entry e = {.name = "x", .dtype = FY_F32, .ndim = 1, .shape = {4}, .data = x};
    const char *path = P("cut.safetensors");
    cr_assert_eq(fy_st_write(path, &e, 1, NULL), FY_OK);
    size_t n;
    uint8_t *b = (uint8_t *)test_read_file(path, &n);
    write_file(path, b, n - 3);
    free(b);
    expect_open_fails(path, FY_ERR_FORMAT, "past the end");
    /* cut inside the header */
    b = (uint8_t *)test_read_file(path, &n);
    write_file(path, b, 20);
    free(b);
    expect_open_fails(path, FY_ERR_FORMAT, "exceeds");
}

/* Header JSON cases: each is rejected with one line naming the file and the problem. */
Test(safetensors, malformed_headers) {
    static const struct { const char *json; size_t data_n; const char *keyword; } cases[] = {
        {"{not json", 0, "not valid JSON"},
        {"", 0, "not valid JSON"},
        {"[1,2]", 0, "not a JSON object"},
        {"{} x", 0, "junk"},
        {"{\"a\":3}", 0, "not an object"},
        {"{\"a\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "missing \"dtype\""},
        {"{\"a\":{\"dtype\":4,\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "not a string"},
        {"{\"a\":{\"dtype\":\"F31\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "unknown dtype"},
        {"{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4, "missing \"shape\""},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":1,\"data_offsets\":[0,4]}}", 4, "not an array"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4, "shape[0]"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,4]}}", 4, "shape[0]"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1,\"2\"],\"data_offsets\":[0,8]}}", 8, "shape[1]"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}", 4,
         "dims"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4, "missing \"data_offsets\""},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]}}", 4, "data_offsets"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[\"0\",4]}}", 4, "data_offsets"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[4,0]}}", 4, "end before begin"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 4, "past the end"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8, "elements"},
        {"{\"a\":{\"dtype\":\"BF16\",\"shape\":[2,2],\"data_offsets\":[0,4]}}", 4, "elements"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12, "overlaps"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}", 12, "no tensor"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 8, "no tensor"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8, "no tensor"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
         "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8, "duplicate"},
        {"{\"__metadata__\":{\"k\":1},"
         "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "not a string"},
        {"{\"__metadata__\":[],"
         "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "not an object"},
        {"{\"__metadata__\":{},\"__metadata__\":{},"
         "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "duplicate"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *path = P("bad%zu.safetensors", i);
        st_raw(path, cases[i].json, cases[i].data_n);
        expect_open_fails(path, FY_ERR_FORMAT, cases[i].keyword);
    }
}

Test(safetensors, trailing_whitespace_in_header_is_accepted) {
    const char *json = "{\"a\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4]}}   \n ";
    const char *path = P("ws.safetensors");
    st_raw(path, json, 4);
    fy_st_file *f;
    cr_assert_eq(fy_st_open(path, &f), FY_OK);
    cr_assert_eq(fy_st_at(f, 0)->ndim, 0);
    cr_assert_eq(fy_st_at(f, 0)->nelem, 1);
    fy_st_close(f);
}

/* ---- token files ---- */

TestSuite(tokens, .init = make_dir, .fini = remove_dir);

static void write_shard(const char *path, int32_t magic, int32_t version, int32_t count,
                        const uint32_t *toks, size_t ntoks, int tok_nbytes) {
    int32_t hdr[256] = {magic, version, count};
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    cr_assert_eq(fwrite(hdr, 4, 256, f), 256);
    for (size_t i = 0; i < ntoks; i++) {
        uint8_t b[4] = {(uint8_t)toks[i], (uint8_t)(toks[i] >> 8), (uint8_t)(toks[i] >> 16),
                        (uint8_t)(toks[i] >> 24)};
        cr_assert_eq(fwrite(b, 1, (size_t)tok_nbytes, f), (size_t)tok_nbytes);
    }
    cr_assert_eq(fclose(f), 0);
}

static void write_v1(const char *path, const uint32_t *toks, size_t n) {
    write_shard(path, FY_SHARD_MAGIC_V1, 1, (int32_t)n, toks, n, 2);
}
static void write_v7(const char *path, const uint32_t *toks, size_t n) {
    write_shard(path, FY_SHARD_MAGIC_V7, 7, (int32_t)n, toks, n, 4);
}

/* t holds exactly want[0..n), read one at a time and as one run. */
static void expect_tokens(const fy_tokens *t, const uint32_t *want, size_t n) {
    cr_assert_eq(fy_tokens_count(t), n);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(fy_tokens_at(t, i), want[i], "token %zu: %u != %u", i,
                     fy_tokens_at(t, i), want[i]);
    int32_t *run = malloc(n * sizeof *run);
    fy_tokens_read(t, 0, n, run);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq((uint32_t)run[i], want[i], "read token %zu: %u != %u", i,
                     (uint32_t)run[i], want[i]);
    free(run);
}

static void expect_tokens_fail(const char *path, fy_status want, const char *keyword,
                               const char *names) {
    fy_tokens *t = (fy_tokens *)(uintptr_t)1;
    capture_begin();
    fy_status st = fy_tokens_open(path, &t);
    const char *log = capture_end();
    cr_assert_eq(st, want, "%s: status %s (log: %s)", keyword, fy_status_str(st), log);
    cr_assert_null(t);
    assert_one_error(log, names ? names : path, keyword, NULL);
}

Test(tokens, shard_v1_round_trip) {
    const uint32_t toks[] = {0, 1, 255, 256, 50256, 65535, 12345};
    const char *path = P("v1.bin");
    write_v1(path, toks, 7);
    fy_tokens *t;
    cr_assert_eq(fy_tokens_open(path, &t), FY_OK);
    expect_tokens(t, toks, 7);
    cr_assert_str_eq(fy_tokens_label(t), path);
    fy_tokens_free(t);
}

Test(tokens, shard_v7_round_trip) {
    const uint32_t toks[] = {0, 65536, 128255, 1u << 31, 4294967295u, 7};
    const char *path = P("v7.bin");
    write_v7(path, toks, 6);
    fy_tokens *t;
    cr_assert_eq(fy_tokens_open(path, &t), FY_OK);
    expect_tokens(t, toks, 6);
    fy_tokens_free(t);
}

Test(tokens, large_shard_crosses_pages) {
    enum { NTOK = 100003 };
    static uint32_t toks[NTOK];
    for (size_t i = 0; i < NTOK; i++) toks[i] = (uint32_t)(i * 2654435761u) & 0xffff;
    write_v1(P("big.bin"), toks, NTOK);
    fy_tokens *t;
    cr_assert_eq(fy_tokens_open(P("big.bin"), &t), FY_OK);
    expect_tokens(t, toks, NTOK);
    fy_tokens_free(t);
}

Test(tokens, text_file_bytes_are_tokens) {
    uint8_t bytes[300];
    for (int i = 0; i < 300; i++) bytes[i] = (uint8_t)(i * 7 + 3);
    const char *path = P("text.txt");
    write_file(path, bytes, 300);
    fy_tokens *t;
    cr_assert_eq(fy_tokens_open(path, &t), FY_OK);
    cr_assert_eq(fy_tokens_count(t), 300);
    for (int i = 0; i < 300; i++) cr_assert_eq(fy_tokens_at(t, (size_t)i), bytes[i]);
    fy_tokens_free(t);
    /* a short file with no extension is text too */
    write_file(P("tiny"), "hi", 2);
    cr_assert_eq(fy_tokens_open(P("tiny"), &t), FY_OK);
    const uint32_t want[] = {'h', 'i'};
    expect_tokens(t, want, 2);
    fy_tokens_free(t);
}

Test(tokens, from_bytes_copies_and_refuses_empty) {
    uint8_t b[3] = {'a', 200, '\n'};
    fy_tokens *t;
    cr_assert_eq(fy_tokens_from_bytes(b, 3, "corpus", &t), FY_OK);
    b[0] = 'z'; /* a copy: later changes to the buffer do not show */
    const uint32_t want[] = {'a', 200, '\n'};
    expect_tokens(t, want, 3);
    cr_assert_str_eq(fy_tokens_label(t), "corpus");
    fy_tokens_free(t);
    capture_begin();
    fy_status st = fy_tokens_from_bytes(b, 0, "nothing", &t);
    const char *log = capture_end();
    cr_assert_eq(st, FY_ERR_INVALID);
    cr_assert_null(t);
    assert_one_error(log, "nothing", NULL);
}

Test(tokens, missing_and_empty_files) {
    expect_tokens_fail(P("absent.bin"), FY_ERR_IO, "cannot open", NULL);
    write_file(P("empty.bin"), "", 0);
    expect_tokens_fail(P("empty.bin"), FY_ERR_FORMAT, "empty", NULL);
    write_file(P("empty.txt"), "", 0);
    expect_tokens_fail(P("empty.txt"), FY_ERR_FORMAT, "empty", NULL);
    cr_assert_eq(mkdir(P("adir"), 0700), 0);
    expect_tokens_fail(P("adir"), FY_ERR_IO, "not a regular file", NULL);
}

Test(tokens, bin_without_magic_is_refused) {
    uint8_t junk[2000];
    for (int i = 0; i < 2000; i++) junk[i] = (uint8_t)i;
    write_file(P("junk.bin"), junk, sizeof junk);
    expect_tokens_fail(P("junk.bin"), FY_ERR_FORMAT, "bad magic", NULL);
    write_file(P("small.bin"), "ab", 2);
    expect_tokens_fail(P("small.bin"), FY_ERR_FORMAT, "bad magic", NULL);
}

Test(tokens, bad_shards_are_refused) {
    const uint32_t toks[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
    /* count says 10, only 9 tokens present */
    write_shard(P("trunc.bin"), FY_SHARD_MAGIC_V1, 1, 10, toks, 9, 2);
    expect_tokens_fail(P("trunc.bin"), FY_ERR_FORMAT, "truncated", NULL);
    write_shard(P("trunc7.bin"), FY_SHARD_MAGIC_V7, 7, 10, toks, 10, 2); /* uint16 in a v7 */
    expect_tokens_fail(P("trunc7.bin"), FY_ERR_FORMAT, "truncated", NULL);
    write_shard(P("long.bin"), FY_SHARD_MAGIC_V1, 1, 9, toks, 10, 2);
    expect_tokens_fail(P("long.bin"), FY_ERR_FORMAT, "size mismatch", NULL);
    write_shard(P("ver1.bin"), FY_SHARD_MAGIC_V1, 7, 10, toks, 10, 2);
    expect_tokens_fail(P("ver1.bin"), FY_ERR_FORMAT, "version 7", NULL);
    write_shard(P("ver7.bin"), FY_SHARD_MAGIC_V7, 1, 10, toks, 10, 4);
    expect_tokens_fail(P("ver7.bin"), FY_ERR_FORMAT, "version 1", NULL);
    write_shard(P("zero.bin"), FY_SHARD_MAGIC_V1, 1, 0, toks, 0, 2);
    expect_tokens_fail(P("zero.bin"), FY_ERR_FORMAT, "count 0", NULL);
    write_shard(P("neg.bin"), FY_SHARD_MAGIC_V7, 7, -5, toks, 0, 4);
    expect_tokens_fail(P("neg.bin"), FY_ERR_FORMAT, "absurd", NULL);
    write_shard(P("huge.bin"), FY_SHARD_MAGIC_V7, 7, 2147483647, toks, 10, 4);
    expect_tokens_fail(P("huge.bin"), FY_ERR_FORMAT, "truncated", NULL);
    /* a header cut short */
    int32_t hdr[10] = {FY_SHARD_MAGIC_V1, 1, 3};
    write_file(P("hdr.bin"), hdr, sizeof hdr);
    expect_tokens_fail(P("hdr.bin"), FY_ERR_FORMAT, "shorter than the 1024-byte header", NULL);
    /* the magic makes any file a shard, whatever its name */
    write_shard(P("shard.tok"), FY_SHARD_MAGIC_V7, 7, 10, toks, 3, 4);
    expect_tokens_fail(P("shard.tok"), FY_ERR_FORMAT, "truncated", NULL);
}

Test(tokens, glob_reads_shards_sorted_as_one_stream) {
    const uint32_t a[] = {10, 11, 12}, b[] = {20, 70000}, c[] = {30, 31, 32, 33};
    /* created out of order; v1 and v7 mixed */
    write_v7(P("d_002.bin"), c, 4);
    write_v1(P("d_000.bin"), a, 3);
    write_v7(P("d_001.bin"), b, 2);
    write_v1(P("other_000.bin"), a, 3); /* does not match */
    fy_tokens *t;
    const char *pattern = P("d_*.bin");
    cr_assert_eq(fy_tokens_open(pattern, &t), FY_OK);
    const uint32_t want[] = {10, 11, 12, 20, 70000, 30, 31, 32, 33};
    expect_tokens(t, want, 9);
    cr_assert_str_eq(fy_tokens_label(t), pattern);
    fy_tokens_free(t);
    cr_assert_eq(fy_tokens_open(P("d_00[02].bin"), &t), FY_OK);
    const uint32_t want2[] = {10, 11, 12, 30, 31, 32, 33};
    expect_tokens(t, want2, 7);
    fy_tokens_free(t);
}

/* Shards of both widths and very different lengths (1 token; a page and a token), read
 * as one stream: every token, runs that start and end on either side of each boundary,
 * runs over three and more files, and the loader's batches across them. */
Test(tokens, glob_of_v1_and_v7_shards_reads_across_boundaries) {
    const size_t lens[] = {1, 2049, 2, 30011, 1, 7000, 3};
    enum { NF = sizeof lens / sizeof lens[0] };
    size_t n = 0, begins[NF];
    for (int f = 0; f < NF; f++) begins[f] = n, n += lens[f];
    uint32_t *want = malloc(n * sizeof *want);
    for (int f = 0; f < NF; f++) {
        uint32_t *w = want + begins[f];
        for (size_t i = 0; i < lens[f]; i++) {
            uint32_t h = (uint32_t)(begins[f] + i) * 2654435761u;
            w[i] = f % 2 ? h | 1u << 16 : h >> 16; /* v7 ids all above uint16 */
        }
        if (f % 2) write_v7(P("m_%03d.bin", f), w, lens[f]);
        else write_v1(P("m_%03d.bin", f), w, lens[f]);
    }
    fy_tokens *t;
    cr_assert_eq(fy_tokens_open(P("m_*.bin"), &t), FY_OK);
    expect_tokens(t, want, n);
    int32_t *run = malloc(n * sizeof *run);
    const size_t lengths[] = {0, 1, 2, 3, 7, 2051, 4100, 32065};
    for (int f = 0; f < NF; f++) {
        for (size_t d = 0; d < 7; d++) {
            if (begins[f] + d < 3) continue;
            size_t at = begins[f] + d - 3;
            for (size_t k = 0; k < sizeof lengths / sizeof lengths[0]; k++) {
                if (at + lengths[k] > n) continue;
                memset(run, 0x55, n * sizeof *run);
                fy_tokens_read(t, at, lengths[k], run);
                for (size_t i = 0; i < lengths[k]; i++)
                    cr_assert_eq((uint32_t)run[i], want[at + i], "read [%zu, +%zu) token %zu",
                                 at, lengths[k], i);
                cr_assert_eq(run[lengths[k]], 0x55555555, "read past [%zu, +%zu)", at,
                             lengths[k]);
            }
        }
    }
    fy_tokens_read(t, n, 0, run); /* an empty run at the very end */
    /* batches of 2 x 1100 span up to three shards; the last pass wraps */
    fy_loader *l;
    cr_assert_eq(fy_loader_new(t, 0, n, 2, 1100, &l), FY_OK);
    size_t bt = 2200, nb = (n - 1) / bt;
    int32_t *x = malloc(bt * sizeof *x), *y = malloc(bt * sizeof *y);
    for (size_t s = 0; s < nb + 3; s++) {
        fy_loader_next(l, x, y, NULL);
        size_t at = (s % nb) * bt;
        for (size_t i = 0; i < bt; i++) {
            cr_assert_eq((uint32_t)x[i], want[at + i], "step %zu x[%zu]", s, i);
            cr_assert_eq((uint32_t)y[i], want[at + i + 1], "step %zu y[%zu]", s, i);
        }
    }
    free(x);
    free(y);
    fy_loader_free(l);
    free(run);
    free(want);
    fy_tokens_free(t);
}

/* Resident pages of this process, in bytes (/proc/self/statm's second field). */
static size_t resident_nbytes(void) {
    FILE *f = fopen("/proc/self/statm", "r");
    cr_assert_not_null(f);
    unsigned long size, resident;
    cr_assert_eq(fscanf(f, "%lu %lu", &size, &resident), 2);
    fclose(f);
    return (size_t)resident * (size_t)sysconf(_SC_PAGESIZE);
}

static size_t max_resident_nbytes(void) {
    struct rusage ru;
    cr_assert_eq(getrusage(RUSAGE_SELF, &ru), 0);
    return (size_t)ru.ru_maxrss * 1024; /* Linux reports KiB */
}

/* A 64 MiB v7 shard is mapped, not copied: opening it, checking its vocabulary (a scan
 * of every token) and reading batches leaves the resident set (now and at its peak)
 * within 8 MiB of where it was. A copy, as tokens.c made before, grows it by the
 * file's 64 MiB; the mapped reads keep at most one 4 MiB chunk of the scan mapped at a
 * time (its pages are dropped once scanned) plus the pages the batches touched (128 KiB
 * here) and the kernel's fault-around, so 8 MiB is an eighth of the file with room to
 * spare. The scan's first offender is found past its first chunk and at the last token,
 * and tokens read after the pages were dropped are still right. */
Test(tokens, large_shard_is_mapped_not_copied) {
    enum { NTOK = 16 << 20, PER_WRITE = 1 << 18 };
    const size_t chunk = (4 << 20) / 4; /* tokens of the scan's first chunk */
    const char *path = P("large.bin");
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    int32_t hdr[256] = {FY_SHARD_MAGIC_V7, 7, NTOK};
    cr_assert_eq(fwrite(hdr, 4, 256, f), 256);
    uint32_t *buf = malloc(PER_WRITE * sizeof *buf); /* written a piece at a time */
    for (size_t at = 0; at < NTOK; at += PER_WRITE) {
        for (size_t i = 0; i < PER_WRITE; i++) buf[i] = (uint32_t)((at + i) % 50000);
        if (at <= chunk + 3 && chunk + 3 < at + PER_WRITE) buf[chunk + 3 - at] = 60000;
        if (at + PER_WRITE == NTOK) buf[PER_WRITE - 1] = 70000;
        cr_assert_eq(fwrite(buf, 4, PER_WRITE, f), PER_WRITE);
    }
    free(buf);
    cr_assert_eq(fclose(f), 0);

    size_t rss0 = resident_nbytes(), max0 = max_resident_nbytes();
    fy_tokens *t;
    cr_assert_eq(fy_tokens_open(path, &t), FY_OK);
    cr_assert_eq(fy_tokens_count(t), NTOK);
    cr_assert_eq(fy_tokens_check_vocab(t, 70001), FY_OK);
    fy_loader *l;
    cr_assert_eq(fy_loader_new(t, 0, NTOK, 4, 1024, &l), FY_OK);
    static int32_t x[4096], y[4096];
    for (int s = 0; s < 8; s++) {
        fy_loader_next(l, x, y, NULL);
        for (size_t i = 0; i < 4096; i++)
            cr_assert_eq(x[i], (int32_t)((size_t)s * 4096 + i) % 50000, "step %d x[%zu]", s, i);
    }
    size_t rss1 = resident_nbytes(), max1 = max_resident_nbytes();
    const size_t bound = 8 << 20;
    cr_assert_lt(rss1 - (rss1 > rss0 ? rss0 : rss1), bound,
                 "resident set grew by %zu KiB (from %zu KiB)", (rss1 - rss0) >> 10, rss0 >> 10);
    cr_assert_lt(max1 - max0, bound, "peak resident set grew by %zu KiB (from %zu KiB)",
                 (max1 - max0) >> 10, max0 >> 10);

    capture_begin();
    fy_status st = fy_tokens_check_vocab(t, 65536);
    const char *log = capture_end();
    cr_assert_eq(st, FY_ERR_INVALID);
    assert_one_error(log, path, "token id 70000", "position 16777215", NULL);
    capture_begin();
    st = fy_tokens_check_vocab(t, 50000);
    log = capture_end();
    cr_assert_eq(st, FY_ERR_INVALID);
    assert_one_error(log, path, "token id 60000", "position 1048579", NULL);
    cr_assert_eq(fy_tokens_at(t, chunk + 3), 60000);
    cr_assert_eq(fy_tokens_at(t, chunk + 4), (chunk + 4) % 50000);
    cr_assert_eq(fy_tokens_at(t, NTOK - 1), 70000);
    fy_loader_free(l);
    fy_tokens_free(t);
}

Test(tokens, glob_errors_name_the_file) {
    expect_tokens_fail(P("nothing_*.bin"), FY_ERR_IO, "no files match", NULL);
    const uint32_t a[] = {1, 2, 3};
    write_v1(P("s_000.bin"), a, 3);
    write_shard(P("s_001.bin"), FY_SHARD_MAGIC_V1, 1, 5, a, 3, 2);
    write_v1(P("s_002.bin"), a, 3);
    expect_tokens_fail(P("s_*.bin"), FY_ERR_FORMAT, "truncated", P("s_001.bin"));
}

Test(tokens, check_vocab_names_first_offender) {
    const uint32_t toks[] = {1, 2, 3, 4, 5, 6, 7, 300, 9, 400};
    const char *path = P("v.bin");
    write_v1(path, toks, 10);
    fy_tokens *t;
    cr_assert_eq(fy_tokens_open(path, &t), FY_OK);
    capture_begin();
    fy_status st = fy_tokens_check_vocab(t, 256);
    const char *log = capture_end();
    cr_assert_eq(st, FY_ERR_INVALID);
    assert_one_error(log, path, "token id 300", "position 7", "256", NULL);
    cr_assert_eq(fy_tokens_check_vocab(t, 401), FY_OK);
    capture_begin();
    st = fy_tokens_check_vocab(t, 400);
    log = capture_end();
    cr_assert_eq(st, FY_ERR_INVALID);
    assert_one_error(log, "token id 400", "position 9", NULL);
    fy_tokens_free(t);
}

Test(tokens, check_vocab_in_a_glob_names_the_shard_and_its_position) {
    const uint32_t a[] = {1, 2, 3}, b[] = {4, 5, 6, 999, 7};
    write_v1(P("g_0.bin"), a, 3);
    write_v1(P("g_1.bin"), b, 5);
    fy_tokens *t;
    cr_assert_eq(fy_tokens_open(P("g_*.bin"), &t), FY_OK);
    capture_begin();
    fy_status st = fy_tokens_check_vocab(t, 512);
    const char *log = capture_end();
    cr_assert_eq(st, FY_ERR_INVALID);
    assert_one_error(log, P("g_1.bin"), "token id 999", "position 3", NULL);
    fy_tokens_free(t);
}

/* ---- loader ---- */

TestSuite(loader, .init = make_dir, .fini = remove_dir);

/* Tokens 0..n-1, so a token's value is its position. */
static fy_tokens *iota(size_t n) {
    uint32_t *v = malloc(n * sizeof *v);
    for (size_t i = 0; i < n; i++) v[i] = (uint32_t)i;
    const char *path = P("iota%zu.bin", n);
    write_v7(path, v, n);
    free(v);
    fy_tokens *t;
    cr_assert_eq(fy_tokens_open(path, &t), FY_OK);
    return t;
}

static void expect_batch(fy_loader *l, int bt, int32_t first) {
    int32_t x[64], y[64];
    fy_loader_next(l, x, y, NULL);
    for (int i = 0; i < bt; i++) {
        cr_assert_eq(x[i], first + i, "x[%d] = %d, want %d", i, x[i], first + i);
        cr_assert_eq(y[i], first + i + 1, "y[%d] = %d, want %d", i, y[i], first + i + 1);
    }
}

Test(loader, llm_c_order_shift_advance_wrap) {
    fy_tokens *t = iota(20);
    fy_loader *l;
    cr_assert_eq(fy_loader_new(t, 0, 20, 2, 3, &l), FY_OK);
    cr_assert_eq(fy_loader_batches(l), 3); /* (20 - 1) / 6 */
    cr_assert_eq(fy_loader_pos(l), 0);
    expect_batch(l, 6, 0);
    cr_assert_eq(fy_loader_pos(l), 6);
    expect_batch(l, 6, 6);
    cr_assert_eq(fy_loader_pos(l), 12);
    expect_batch(l, 6, 12); /* reads tokens 12..18: 19 of 20 needed, still fits */
    cr_assert_eq(fy_loader_pos(l), 0, "18 + 7 > 20 must wrap");
    expect_batch(l, 6, 0);
    fy_loader_free(l);
    fy_tokens_free(t);
}

Test(loader, sub_range_is_respected) {
    fy_tokens *t = iota(30);
    fy_loader *l;
    cr_assert_eq(fy_loader_new(t, 5, 20, 2, 3, &l), FY_OK);
    cr_assert_eq(fy_loader_batches(l), 2); /* (15 - 1) / 6 */
    expect_batch(l, 6, 5);
    expect_batch(l, 6, 11);
    expect_batch(l, 6, 5);
    fy_loader_free(l);
    fy_tokens_free(t);
}

/* Over several passes, step s reads the batch (s mod batches) * B*T of the range. */
Test(loader, many_steps_follow_the_closed_form) {
    fy_tokens *t = iota(1000);
    const int shapes[][4] = {{1, 1, 0, 1000}, {4, 8, 0, 1000}, {3, 7, 100, 950}, {8, 8, 0, 65},
                             {2, 16, 17, 50}};
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
        int B = shapes[k][0], T = shapes[k][1], begin = shapes[k][2], end = shapes[k][3];
        size_t bt = (size_t)B * T, nb = (size_t)(end - begin - 1) / bt;
        fy_loader *l;
        cr_assert_eq(fy_loader_new(t, (size_t)begin, (size_t)end, B, T, &l), FY_OK);
        cr_assert_eq(fy_loader_batches(l), nb);
        int32_t *x = malloc(bt * 4), *y = malloc(bt * 4);
        for (size_t s = 0; s < 3 * nb + 2; s++) {
            fy_loader_next(l, x, y, NULL);
            size_t at = (size_t)begin + (s % nb) * bt;
            for (size_t i = 0; i < bt; i++) {
                cr_assert_eq((size_t)x[i], at + i, "shape %zu step %zu x[%zu]", k, s, i);
                cr_assert_eq((size_t)y[i], at + i + 1, "shape %zu step %zu y[%zu]", k, s, i);
            }
        }
        free(x);
        free(y);
        fy_loader_free(l);
    }
    fy_tokens_free(t);
}

Test(loader, exact_fit_range_repeats_one_batch) {
    fy_tokens *t = iota(13);
    fy_loader *l;
    cr_assert_eq(fy_loader_new(t, 0, 13, 3, 4, &l), FY_OK);
    cr_assert_eq(fy_loader_batches(l), 1);
    for (int s = 0; s < 3; s++) expect_batch(l, 12, 0);
    fy_loader_free(l);
    fy_tokens_free(t);
}

Test(loader, set_pos_reset_and_resume) {
    fy_tokens *t = iota(100);
    fy_loader *a, *b;
    cr_assert_eq(fy_loader_new(t, 0, 100, 2, 5, &a), FY_OK);
    cr_assert_eq(fy_loader_new(t, 0, 100, 2, 5, &b), FY_OK);
    int32_t x[10], y[10], x2[10], y2[10];
    for (int s = 0; s < 4; s++) fy_loader_next(a, x, y, NULL);
    cr_assert_eq(fy_loader_pos(a), 40);
    /* a checkpoint: b resumes where a stands and both continue identically */
    cr_assert_eq(fy_loader_set_pos(b, fy_loader_pos(a)), FY_OK);
    for (int s = 0; s < 12; s++) {
        fy_loader_next(a, x, y, NULL);
        fy_loader_next(b, x2, y2, NULL);
        cr_assert(!memcmp(x, x2, sizeof x) && !memcmp(y, y2, sizeof y), "step %d differs", s);
    }
    cr_assert_eq(fy_loader_set_pos(a, 3), FY_OK);
    expect_batch(a, 10, 3);
    fy_loader_reset(a);
    cr_assert_eq(fy_loader_pos(a), 0);
    expect_batch(a, 10, 0);
    /* 89 + 11 = 100 fits; 90 does not */
    cr_assert_eq(fy_loader_set_pos(a, 89), FY_OK);
    expect_batch(a, 10, 89);
    size_t before = fy_loader_pos(a);
    capture_begin();
    fy_status st = fy_loader_set_pos(a, 90);
    const char *log = capture_end();
    cr_assert_eq(st, FY_ERR_INVALID);
    assert_one_error(log, "90", NULL);
    cr_assert_eq(fy_loader_pos(a), before);
    fy_loader_free(a);
    fy_loader_free(b);
    fy_tokens_free(t);
}

/* The same bytes as a mapped text file and as fy_tokens_from_bytes's copy give the same
 * batches, step for step, over whole and partial ranges and through the wrap. */
Test(loader, mapped_text_file_gives_the_same_batches_as_a_copy) {
    enum { N = 100003 };
    static uint8_t bytes[N];
    for (size_t i = 0; i < N; i++) bytes[i] = (uint8_t)((i * 2654435761u) >> 13);
    const char *path = P("text.txt");
    write_file(path, bytes, N);
    fy_tokens *mapped, *copied;
    cr_assert_eq(fy_tokens_open(path, &mapped), FY_OK);
    cr_assert_eq(fy_tokens_from_bytes(bytes, N, "copy", &copied), FY_OK);
    cr_assert_eq(fy_tokens_count(mapped), fy_tokens_count(copied));
    const int shapes[][4] = {{1, 1, 0, 200}, {4, 64, 0, N}, {3, 1000, 17, N - 5},
                             {8, 1024, 0, N}, {2, 4097, 4095, 50000}};
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
        int B = shapes[k][0], T = shapes[k][1];
        size_t begin = (size_t)shapes[k][2], end = (size_t)shapes[k][3], bt = (size_t)B * T;
        fy_loader *a, *b;
        cr_assert_eq(fy_loader_new(mapped, begin, end, B, T, &a), FY_OK);
        cr_assert_eq(fy_loader_new(copied, begin, end, B, T, &b), FY_OK);
        size_t nb = fy_loader_batches(a), steps = nb < 40 ? 2 * nb + 3 : 43;
        int32_t *xa = malloc(bt * 4), *ya = malloc(bt * 4), *xb = malloc(bt * 4),
                *yb = malloc(bt * 4);
        for (size_t s = 0; s < steps; s++) {
            fy_loader_next(a, xa, ya, NULL);
            fy_loader_next(b, xb, yb, NULL);
            cr_assert(!memcmp(xa, xb, bt * 4) && !memcmp(ya, yb, bt * 4),
                      "shape %zu step %zu differs", k, s);
            size_t at = begin + (s % nb) * bt;
            cr_assert_eq(xa[0], bytes[at], "shape %zu step %zu", k, s);
            cr_assert_eq(ya[bt - 1], bytes[at + bt], "shape %zu step %zu", k, s);
        }
        free(xa); free(ya); free(xb); free(yb);
        fy_loader_free(a);
        fy_loader_free(b);
    }
    fy_tokens_free(mapped);
    fy_tokens_free(copied);
}

static void expect_loader_fails(const fy_tokens *t, size_t begin, size_t end, int B, int T,
                                const char *keyword) {
    fy_loader *l = (fy_loader *)(uintptr_t)1;
    capture_begin();
    fy_status st = fy_loader_new(t, begin, end, B, T, &l);
    const char *log = capture_end();
    cr_assert_eq(st, FY_ERR_INVALID, "%s", keyword);
    cr_assert_null(l);
    assert_one_error(log, fy_tokens_label(t), keyword, NULL);
}

Test(loader, bad_ranges_and_sizes) {
    fy_tokens *t = iota(20);
    expect_loader_fails(t, 0, 20, 4, 5, "too few"); /* needs 21 */
    expect_loader_fails(t, 10, 20, 2, 5, "too few");
    expect_loader_fails(t, 0, 20, 0, 5, "positive");
    expect_loader_fails(t, 0, 20, 2, -1, "positive");
    expect_loader_fails(t, 0, 21, 1, 1, "not inside");
    expect_loader_fails(t, 15, 10, 1, 1, "not inside");
    fy_loader *l;
    cr_assert_eq(fy_loader_new(t, 0, 20, 1, 19, &l), FY_OK); /* exactly B*T+1 */
    fy_loader_free(l);
    fy_tokens_free(t);
}

/* ---- loss masks and documents (companion .mask files) ---- */

TestSuite(masks, .init = make_dir, .fini = remove_dir);

/* A companion: header {magic, version, count, S}, then the loss and start bits of n
 * tokens (bit i of byte i/8, least significant first), then `extra` more bytes (negative:
 * that many fewer). */
static void write_mask_raw(const char *path, int32_t magic, int32_t version, int32_t count,
                           int32_t S, const uint8_t *loss, const uint8_t *start, size_t n,
                           long extra) {
    const size_t nb = (n + 7) / 8, size = 1024 + 2 * nb;
    uint8_t *b = calloc(1, size + (extra > 0 ? (size_t)extra : 0));
    int32_t hdr[256] = {magic, version, count, S};
    memcpy(b, hdr, sizeof hdr);
    for (size_t i = 0; i < n; i++) {
        if (loss[i]) b[1024 + (i >> 3)] |= (uint8_t)(1u << (i & 7));
        if (start[i]) b[1024 + nb + (i >> 3)] |= (uint8_t)(1u << (i & 7));
    }
    write_file(path, b, (size_t)((long)size + extra));
    free(b);
}

static void write_mask(const char *path, int32_t S, const uint8_t *loss, const uint8_t *start,
                       size_t n) {
    write_mask_raw(path, FY_MASK_MAGIC, FY_MASK_VERSION, (int32_t)n, S, loss, start, n, 0);
}

/* The masked stream of the tests below: tokens whose value is their position (v7), loss
 * bits at random (about half), documents starting at random (about 1 in 5) and at each
 * multiple of S, a few tokens with both bits (a document's first token never counts). */
typedef struct masked_data {
    size_t n;
    uint32_t *tok;
    uint8_t *loss, *start;
} masked_data;

static masked_data masked_stream(size_t n, size_t S, uint64_t seed) {
    masked_data d = {n, malloc(n * 4), malloc(n), malloc(n)};
    uint64_t s = seed;
    for (size_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        const unsigned r = (unsigned)(s >> 33);
        d.tok[i] = (uint32_t)i;
        d.loss[i] = (uint8_t)(r & 1);
        d.start[i] = (uint8_t)(i % S == 0 || (r >> 1) % 5 == 0);
    }
    return d;
}

static void masked_free(masked_data *d) { free(d->tok); free(d->loss); free(d->start); }

/* Shards of d cut at cuts[0..ncut) (d_000.bin, ...), each with its companion of S. */
static void write_masked_shards(const masked_data *d, const size_t *cuts, int ncut, int32_t S) {
    size_t b = 0;
    for (int f = 0; f <= ncut; f++) {
        const size_t e = f < ncut ? cuts[f] : d->n;
        write_v7(P("d_%03d.bin", f), d->tok + b, e - b);
        write_mask(P("d_%03d.mask", f), S, d->loss + b, d->start + b, e - b);
        b = e;
    }
}

static bool counts_at(const masked_data *d, size_t i) { return d->loss[i] && !d->start[i]; }

/* Every batch of B x T from the loader (its order wraps: 2 passes) against the bits:
 * x the tokens, y the next token or -1 where it does not count, docs each position's
 * document start in its row (0 at a row's start), batch_targets the y >= 0. */
static void expect_masked_batches(const fy_tokens *t, const masked_data *d, size_t begin,
                                  size_t end, int B, int T) {
    fy_loader *l;
    cr_assert_eq(fy_loader_new(t, begin, end, B, T, &l), FY_OK);
    const size_t bt = (size_t)B * T, nb = fy_loader_batches(l);
    int32_t *x = malloc(bt * 4), *y = malloc(bt * 4), *docs = malloc(bt * 4);
    for (size_t s = 0; s < 2 * nb; s++) {
        const size_t at = begin + (s % nb) * bt;
        fy_loader_next(l, x, y, docs);
        int64_t counted = 0;
        for (size_t i = 0; i < bt; i++) {
            const size_t row = i / (size_t)T, col = i % (size_t)T;
            cr_assert_eq((size_t)x[i], at + i, "B %d T %d batch %zu x[%zu]", B, T, s, i);
            const int32_t want = counts_at(d, at + i + 1) ? (int32_t)(at + i + 1) : -1;
            cr_assert_eq(y[i], want, "B %d T %d batch %zu y[%zu] = %d, want %d", B, T, s, i, y[i], want);
            counted += y[i] >= 0;
            size_t ds = col;
            while (ds > 0 && !d->start[at + row * (size_t)T + ds]) ds--;
            cr_assert_eq((size_t)docs[i], ds, "B %d T %d batch %zu docs[%zu] = %d, want %zu", B, T,
                         s, i, docs[i], ds);
        }
        cr_assert_eq(fy_loader_batch_targets(l, (int64_t)(s % nb)), counted,
                     "B %d T %d batch %zu: batch_targets", B, T, s);
        cr_assert_eq(fy_loader_batch_targets(l, (int64_t)s), counted, "k past a pass wraps");
    }
    free(x); free(y); free(docs);
    fy_loader_free(l);
}

/* Three shards (the cuts inside batches and rows: masks of unpacked data, S = 0), read as
 * one masked stream: the bits through fy_tokens_target_counts and fy_tokens_doc_starts, and
 * the loader's y, docs and counts over every batch of several shapes, whole range and a
 * sub-range. */
Test(masks, loader_gives_uncounted_targets_as_minus_one_and_the_data_documents) {
    masked_data d = masked_stream(1000, 8, 11);
    const size_t cuts[] = {203, 517};
    write_masked_shards(&d, cuts, 2, 0);
    fy_tokens *t;
    cr_assert_eq(fy_tokens_open(P("d_*.bin"), &t), FY_OK);
    expect_tokens(t, d.tok, d.n);
    cr_assert(fy_tokens_has_masks(t));
    cr_assert_eq(fy_tokens_packed_seq(t), 0);
    for (size_t i = 0; i < d.n; i++) {
        cr_assert_eq(fy_tokens_target_counts(t, i), counts_at(&d, i), "target %zu", i);
        cr_assert_eq(fy_tokens_doc_starts(t, i), d.start[i] != 0, "start %zu", i);
    }
    expect_masked_batches(t, &d, 0, d.n, 2, 8);
    expect_masked_batches(t, &d, 0, d.n, 3, 16);
    expect_masked_batches(t, &d, 0, d.n, 1, 64);
    expect_masked_batches(t, &d, 150, 700, 4, 8); /* across both cuts */
    fy_tokens_free(t);
    masked_free(&d);
}

/* A start bit makes the token's target uncounted even with its loss bit set; a document
 * restarts at each row whatever the bits. */
Test(masks, a_start_bit_wins_over_the_loss_bit_and_rows_restart_documents) {
    enum { N = 17 };
    uint32_t tok[N];
    uint8_t loss[N], start[N];
    for (int i = 0; i < N; i++) tok[i] = (uint32_t)(100 + i), loss[i] = 1, start[i] = 0;
    start[0] = start[3] = start[6] = 1; /* documents at 0, 3 and 6; none at 8 */
    write_v7(P("s.bin"), tok, N);
    write_mask(P("s.mask"), 0, loss, start, N);
    fy_tokens *t;
    cr_assert_eq(fy_tokens_open(P("s.bin"), &t), FY_OK);
    cr_assert_eq(fy_tokens_packed_seq(t), 0);
    fy_loader *l;
    cr_assert_eq(fy_loader_new(t, 0, N, 2, 8, &l), FY_OK);
    int32_t x[16], y[16], docs[16];
    fy_loader_next(l, x, y, docs);
    /* targets are tokens 1..16: 3 and 6 do not count */
    const int32_t wy[16] = {101, 102, -1, 104, 105, -1, 107, 108,
                            109, 110, 111, 112, 113, 114, 115, 116};
    const int32_t wd[16] = {0, 0, 0, 3, 3, 3, 6, 6, 0, 0, 0, 0, 0, 0, 0, 0};
    cr_assert_arr_eq(y, wy, sizeof y);
    cr_assert_arr_eq(docs, wd, sizeof docs);
    cr_assert_eq(fy_loader_batch_targets(l, 0), 14);
    fy_loader_free(l);
    fy_tokens_free(t);
}

/* Plain shards (no companion) read as before: no masks, y the next tokens, one document a
 * row, every target counted, no CRC of bits. */
Test(masks, shards_without_companions_read_as_before) {
    masked_data d = masked_stream(300, 8, 5);
    write_v7(P("p_000.bin"), d.tok, 120);
    write_v1(P("p_001.bin"), d.tok + 120, 180);
    fy_tokens *t;
    cr_assert_eq(fy_tokens_open(P("p_*.bin"), &t), FY_OK);
    cr_assert(!fy_tokens_has_masks(t));
    cr_assert_eq(fy_tokens_packed_seq(t), 0);
    cr_assert_eq(fy_tokens_masks_crc(t, 0, 300, 0x1234u), 0x1234u);
    for (size_t i = 0; i < 300; i++) {
        cr_assert(fy_tokens_target_counts(t, i));
        cr_assert(!fy_tokens_doc_starts(t, i));
    }
    fy_loader *l;
    cr_assert_eq(fy_loader_new(t, 0, 300, 3, 10, &l), FY_OK);
    int32_t x[30], y[30], docs[30];
    for (size_t s = 0; s < fy_loader_batches(l); s++) {
        memset(docs, 0x55, sizeof docs);
        fy_loader_next(l, x, y, docs);
        for (int i = 0; i < 30; i++) {
            cr_assert_eq(x[i], (int32_t)(s * 30 + (size_t)i));
            cr_assert_eq(y[i], (int32_t)(s * 30 + (size_t)i + 1));
            cr_assert_eq(docs[i], 0, "batch %zu docs[%d] = %d", s, i, docs[i]);
        }
        cr_assert_eq(fy_loader_batch_targets(l, (int64_t)s), 30);
    }
    fy_loader_free(l);
    fy_tokens_free(t);
    masked_free(&d);
}

/* The CRC of the bits tells two stream's masks apart by a single bit, loss or start, and
 * only over a range that holds it. */
Test(masks, masks_crc_changes_with_one_bit) {
    masked_data d = masked_stream(400, 8, 3);
    const size_t cuts[] = {150};
    write_masked_shards(&d, cuts, 1, 0);
    fy_tokens *t;
    cr_assert_eq(fy_tokens_open(P("d_*.bin"), &t), FY_OK);
    const uint32_t whole = fy_tokens_masks_crc(t, 0, 400, 0), head = fy_tokens_masks_crc(t, 0, 200, 0);
    cr_assert_eq(fy_tokens_masks_crc(t, 0, 400, 0), whole, "not deterministic");
    cr_assert_eq(fy_tokens_masks_crc(t, 200, 200, head), whole, "does not continue");
    fy_tokens_free(t);
    for (int which = 0; which < 2; which++) {
        uint8_t *bits = which ? d.start : d.loss;
        bits[300] ^= 1;
        write_masked_shards(&d, cuts, 1, 0);
        cr_assert_eq(fy_tokens_open(P("d_*.bin"), &t), FY_OK);
        cr_expect_neq(fy_tokens_masks_crc(t, 0, 400, 0), whole, "%s bit 300 flipped: the same CRC",
                      which ? "start" : "loss");
        cr_expect_eq(fy_tokens_masks_crc(t, 0, 200, 0), head, "a range without the bit changed");
        fy_tokens_free(t);
        bits[300] ^= 1;
    }
    masked_free(&d);
}

/* Every malformed companion is refused with one error naming the .mask file. */
Test(masks, bad_companions_are_refused_naming_the_mask_file) {
    masked_data d = masked_stream(100, 8, 7);
    write_v7(P("b.bin"), d.tok, 100);
    const char *bin = P("b.bin"), *mask = P("b.mask");
    write_mask_raw(mask, 20261204, 1, 100, 8, d.loss, d.start, 100, 0);
    expect_tokens_fail(bin, FY_ERR_FORMAT, "bad magic", mask);
    write_file(mask, "\x33\x2b", 2); /* shorter than a header's first ints */
    expect_tokens_fail(bin, FY_ERR_FORMAT, "bad magic", mask);
    write_mask_raw(mask, FY_MASK_MAGIC, 2, 100, 8, d.loss, d.start, 100, 0);
    expect_tokens_fail(bin, FY_ERR_FORMAT, "version 2", mask);
    write_mask_raw(mask, FY_MASK_MAGIC, 1, 99, 8, d.loss, d.start, 99, 0);
    expect_tokens_fail(bin, FY_ERR_FORMAT, "99 tokens", mask);
    write_mask_raw(mask, FY_MASK_MAGIC, 1, -5, 8, d.loss, d.start, 100, 0);
    expect_tokens_fail(bin, FY_ERR_FORMAT, "-5 tokens", mask);
    write_mask_raw(mask, FY_MASK_MAGIC, 1, 100, -32, d.loss, d.start, 100, 0);
    expect_tokens_fail(bin, FY_ERR_FORMAT, "packing length -32", mask);
    write_mask_raw(mask, FY_MASK_MAGIC, 1, 100, 8, d.loss, d.start, 100, -1);
    expect_tokens_fail(bin, FY_ERR_FORMAT, "bytes where", mask);
    write_mask_raw(mask, FY_MASK_MAGIC, 1, 100, 8, d.loss, d.start, 100, -26); /* the start bits */
    expect_tokens_fail(bin, FY_ERR_FORMAT, "bytes where", mask);
    write_mask_raw(mask, FY_MASK_MAGIC, 1, 100, 8, d.loss, d.start, 100, 1);
    expect_tokens_fail(bin, FY_ERR_FORMAT, "bytes where", mask);
    write_mask_raw(mask, FY_MASK_MAGIC, 1, 100, 8, d.loss, d.start, 100, 0);
    chmod(mask, 0);
    if (access(mask, R_OK) != 0) /* root reads it anyway */
        expect_tokens_fail(bin, FY_ERR_IO, "cannot open", mask);
    chmod(mask, 0644);
    cr_assert_eq(unlink(mask), 0);
    cr_assert_eq(mkdir(mask, 0755), 0);
    expect_tokens_fail(bin, FY_ERR_IO, "not a regular file", mask);
    rmdir(mask);
    /* the control: the same, well formed */
    write_mask_raw(mask, FY_MASK_MAGIC, 1, 100, 8, d.loss, d.start, 100, 0);
    fy_tokens *t;
    cr_assert_eq(fy_tokens_open(bin, &t), FY_OK);
    cr_assert(fy_tokens_has_masks(t));
    fy_tokens_free(t);
    masked_free(&d);
}

/* A glob's shards have companions all or none, of one packing length: the error names
 * the shard without one, or the companion of another length. */
Test(masks, a_glob_mixing_companions_or_packings_is_refused) {
    masked_data d = masked_stream(300, 8, 9);
    const size_t cuts[] = {100, 200};
    write_masked_shards(&d, cuts, 2, 8);
    unlink(P("d_001.mask"));
    expect_tokens_fail(P("d_*.bin"), FY_ERR_FORMAT, "no loss mask", P("d_001.bin"));
    write_masked_shards(&d, cuts, 2, 8);
    unlink(P("d_000.mask"));
    expect_tokens_fail(P("d_*.bin"), FY_ERR_FORMAT, "no loss mask", P("d_000.bin"));
    write_masked_shards(&d, cuts, 2, 8);
    write_mask(P("d_001.mask"), 16, d.loss + 100, d.start + 100, 100);
    expect_tokens_fail(P("d_*.bin"), FY_ERR_FORMAT, "packed into sequences of 16", P("d_001.mask"));
    write_mask(P("d_001.mask"), 0, d.loss + 100, d.start + 100, 100);
    expect_tokens_fail(P("d_*.bin"), FY_ERR_FORMAT, "packed into sequences of 0", P("d_001.mask"));
    /* packed: a shard but the last holding part of a sequence (the streams of two runs) */
    write_masked_shards(&d, cuts, 2, 8);
    expect_tokens_fail(P("d_*.bin"), FY_ERR_FORMAT, P("d_000.bin"), "not whole sequences of 8");
    const size_t whole[] = {96, 200};
    write_masked_shards(&d, whole, 2, 8);
    fy_tokens *t;
    cr_assert_eq(fy_tokens_open(P("d_*.bin"), &t), FY_OK);
    cr_assert_eq(fy_tokens_packed_seq(t), 8);
    fy_tokens_free(t);
    masked_free(&d);
}

/* The mask's record of its shard's token CRC (tokens.h: header[4]): the data check passes
 * with the right one and refuses another shard's mask of the same length, naming both. */
Test(masks, a_mask_of_another_shard_is_refused_by_its_token_crc) {
    uint32_t a[64], b[64];
    uint8_t loss[64] = {0}, start[64] = {1};
    for (int i = 0; i < 64; i++) a[i] = (uint32_t)i, b[i] = (uint32_t)(63 - i), loss[i] = i % 2;
    write_v1(P("a.bin"), a, 64);
    write_mask(P("a.mask"), 0, loss, start, 64);
    uint16_t a16[64], b16[64];
    for (int i = 0; i < 64; i++) a16[i] = (uint16_t)a[i], b16[i] = (uint16_t)b[i];
    const uint32_t crc_a = (uint32_t)crc32(0L, (const Bytef *)a16, sizeof a16);
    const uint32_t crc_b = (uint32_t)crc32(0L, (const Bytef *)b16, sizeof b16);
    int fd = open(P("a.mask"), O_WRONLY);
    cr_assert_geq(fd, 0);
    cr_assert_eq(pwrite(fd, &crc_a, 4, 16), 4);
    fy_tokens *t;
    cr_assert_eq(fy_tokens_open(P("a.bin"), &t), FY_OK);
    cr_assert_eq(fy_tokens_check_vocab(t, 256), FY_OK);
    fy_tokens_free(t);
    cr_assert_eq(pwrite(fd, &crc_b, 4, 16), 4); /* now the mask of b's tokens */
    close(fd);
    cr_assert_eq(fy_tokens_open(P("a.bin"), &t), FY_OK);
    capture_begin();
    fy_status st = fy_tokens_check_vocab(t, 256);
    const char *log = capture_end();
    cr_assert_eq(st, FY_ERR_FORMAT);
    assert_one_error(log, P("a.bin"), P("a.mask"), "CRC", NULL);
    fy_tokens_free(t);
}

/* ---- corpus ---- */

static uint8_t *corpus(size_t n, uint64_t seed) {
    uint8_t *b;
    cr_assert_eq(fy_corpus_generate(n, seed, &b), FY_OK);
    cr_assert_not_null(b);
    return b;
}

Test(corpus, same_seed_same_bytes_other_seed_other_bytes) {
    size_t n = 1 << 20;
    uint8_t *a = corpus(n, 1), *b = corpus(n, 1), *c = corpus(n, 2);
    cr_assert_eq(memcmp(a, b, n), 0);
    size_t differ = 0;
    for (size_t i = 0; i < 4096; i++) differ += a[i] != c[i];
    cr_assert_gt(differ, 1000, "seeds 1 and 2 agree on %zu of 4096 bytes", 4096 - differ);
    free(a);
    free(b);
    free(c);
}

/* The bytes are pinned: a change to the grammar or the PRNG changes the default corpus,
 * and so every loss a user has seen on it; update the hash only on purpose. */
Test(corpus, output_is_pinned_across_machines) {
    size_t n = 1 << 20;
    uint8_t *a = corpus(n, 1);
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++) h = (h ^ a[i]) * 0x100000001b3ull;
    cr_assert_eq(h, 0x5738265d01d375ebull, "corpus hash is 0x%016llx", (unsigned long long)h);
    free(a);
}

Test(corpus, exact_length_and_prefix_property) {
    const size_t sizes[] = {0, 1, 7, 1000, 12345, 300000};
    uint8_t *full = corpus(300000, 99);
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        uint8_t *b = corpus(sizes[k], 99);
        cr_assert_eq(memcmp(b, full, sizes[k]), 0, "%zu bytes are not a prefix", sizes[k]);
        free(b);
    }
    free(full);
}

Test(corpus, structure_of_prose_and_play) {
    size_t n = 2 << 20;
    uint8_t *b = corpus(n, 5);
    size_t speakers = 0, enters = 0, blank = 0, lines = 0, longest = 0, quotes = 0;
    size_t start = 0;
    for (size_t i = 0; i < n; i++) {
        uint8_t c = b[i];
        cr_assert((c >= 32 && c < 127) || c == '\n', "byte %zu is 0x%02x", i, c);
        quotes += c == '"';
        if (c != '\n') continue;
        size_t len = i - start;
        const char *s = (const char *)b + start;
        lines++;
        if (len == 0) blank++;
        if (len > longest) longest = len;
        if (len >= 3 && s[len - 1] == ':') {
            int caps = 1;
            for (size_t k = 0; k + 1 < len; k++) caps &= s[k] >= 'A' && s[k] <= 'Z';
            speakers += caps;
        }
        enters += len > 6 && !strncmp(s, "Enter ", 6);
        start = i + 1;
    }
    cr_assert_gt(speakers, 5000, "speaker lines: %zu", speakers);
    cr_assert_gt(enters, 500);
    cr_assert_gt(blank, lines / 5, "paragraphs: %zu blank of %zu lines", blank, lines);
    cr_assert_leq(longest, 80, "a line of %zu bytes", longest);
    cr_assert_gt(quotes, 1000);
    cr_assert_eq(quotes % 2, 0, "unbalanced quotes");
    /* sentences start with a capital */
    for (size_t i = 0; i + 2 < n; i++) {
        if ((b[i] == '.' || b[i] == '?' || b[i] == '!') && b[i + 1] == ' ')
            cr_assert((b[i + 2] >= 'A' && b[i + 2] <= 'Z') || b[i + 2] == '"',
                      "lower case after '%c' at %zu", b[i], i);
    }
    free(b);
}

/* Predictable but not trivial: the unigram entropy is English-like, the next byte given
 * two bytes of context is much more certain, and lines seldom repeat. */
Test(corpus, entropy_and_variety) {
    size_t n = 2 << 20;
    uint8_t *b = corpus(n, 3);
    static double c1[256];
    memset(c1, 0, sizeof c1);
    for (size_t i = 0; i < n; i++) c1[b[i]]++;
    double h1 = 0;
    for (int i = 0; i < 256; i++)
        if (c1[i] > 0) h1 -= c1[i] / (double)n * log(c1[i] / (double)n);
    /* H(next | two previous), over the 128 ASCII values */
    static double ctx[128 * 128];
    memset(ctx, 0, sizeof ctx);
    double *c3x = calloc(128 * 128 * 128, sizeof *c3x);
    for (size_t i = 2; i < n; i++) {
        ctx[b[i - 2] * 128 + b[i - 1]]++;
        c3x[(b[i - 2] * 128 + b[i - 1]) * 128 + b[i]]++;
    }
    double h3 = 0, m = (double)(n - 2);
    for (size_t k = 0; k < 128 * 128 * 128; k++)
        if (c3x[k] > 0) h3 -= c3x[k] / m * log(c3x[k] / ctx[k / 128]);
    free(c3x);
    cr_assert(h1 > 2.8 && h1 < 3.6, "unigram entropy %.3f nats", h1);
    cr_assert_lt(h3, h1 - 1.0, "H(next|2) %.3f vs unigram %.3f", h3, h1);
    cr_assert_gt(h3, 0.8, "too predictable: H(next|2) %.3f", h3);
    /* long lines are nearly all distinct */
    size_t nlong = 0, ndup = 0;
    const char **ls = malloc(sizeof *ls * (n / 40 + 1));
    size_t start = 0;
    for (size_t i = 0; i < n; i++) {
        if (b[i] != '\n') continue;
        b[i] = '\0';
        if (i - start >= 40) ls[nlong++] = (const char *)b + start;
        start = i + 1;
    }
    for (size_t i = 0; i < nlong; i += 50)
        for (size_t j = 0; j < nlong; j++)
            if (j != i && !strcmp(ls[i], ls[j])) { ndup++; break; }
    cr_assert_lt(ndup * 50, nlong / 20, "%zu of %zu sampled long lines repeat", ndup,
                 nlong / 50);
    free(ls);
    free(b);
}

/* ---- CRC-32C and checkpoint states ---- */

/* The check value of the CRC-32C catalogue entry, the iSCSI test vectors of RFC 3720
 * (B.4), and continuation: a CRC taken in pieces equals the CRC of the whole, at every
 * split and alignment (the word loop and the byte tail). */
Test(checkpoint, crc32c_known_values_and_continuation) {
    cr_expect_eq(fy_crc32c("123456789", 9, 0), 0xE3069283u);
    uint8_t b[64];
    memset(b, 0, 32);
    cr_expect_eq(fy_crc32c(b, 32, 0), 0x8A9136AAu);
    memset(b, 0xff, 32);
    cr_expect_eq(fy_crc32c(b, 32, 0), 0x62A8AB43u);
    for (int i = 0; i < 32; i++) b[i] = (uint8_t)i;
    cr_expect_eq(fy_crc32c(b, 32, 0), 0x46DD794Eu);
    cr_expect_eq(fy_crc32c(b, 0, 0), 0u);
    for (int i = 0; i < 64; i++) b[i] = (uint8_t)(i * 37 + 11);
    const uint32_t whole = fy_crc32c(b, 64, 0);
    for (int cut = 0; cut <= 64; cut++)
        cr_expect_eq(fy_crc32c(b + cut, (size_t)(64 - cut), fy_crc32c(b, (size_t)cut, 0)), whole,
                     "split at %d", cut);
}

static const char *STATE_OK =
    "{\"format\":\"ferry-checkpoint\",\"version\":1,\"ferry\":\"v\",\"step\":12,"
    "\"updates\":11,\"skipped_run\":0,\"loss\":2.5,\"val_loss\":null,\"config\":{},"
    "\"files\":[{\"name\":\"model.safetensors\",\"bytes\":10,\"crc32c\":\"0000abcd\"},"
    "{\"name\":\"optimizer.exp_avg.safetensors\",\"bytes\":10,\"crc32c\":\"00000001\"},"
    "{\"name\":\"optimizer.exp_avg_sq.safetensors\",\"bytes\":10,\"crc32c\":\"ffffffff\"}]}";

/* text (a JSON object) with its "state_crc32c" as the writer computes it: of the compact
 * text without the field (into out, cap bytes). Text that is not JSON is copied as is. */
static void with_own_crc(const char *text, char *out, size_t cap) {
    cJSON *j = cJSON_Parse(text);
    if (!j) {
        snprintf(out, cap, "%s", text);
        return;
    }
    char *compact = cJSON_PrintUnformatted(j), hex[16];
    snprintf(hex, sizeof hex, "%08x", fy_crc32c(compact, strlen(compact), 0));
    cJSON_AddStringToObject(j, "state_crc32c", hex);
    char *all = cJSON_Print(j);
    snprintf(out, cap, "%s", all);
    free(compact);
    free(all);
    cJSON_Delete(j);
}

/* STATE_OK with the first occurrence of `from` replaced by `to`, checksummed. */
static fy_status parse_edited(const char *from, const char *to, char *why) {
    char text[2048], sealed[4096];
    const char *at = strstr(STATE_OK, from);
    cr_assert_not_null(at, "%s not in the state", from);
    snprintf(text, sizeof text, "%.*s%s%s", (int)(at - STATE_OK), STATE_OK, to, at + strlen(from));
    with_own_crc(text, sealed, sizeof sealed);
    fy_ckpt_state s;
    fy_status st = fy_ckpt_state_parse(sealed, strlen(sealed), &s, why, 128);
    if (st == FY_OK) fy_ckpt_state_free(&s);
    return st;
}

Test(checkpoint, state_parser_reads_a_state_and_refuses_bad_ones) {
    fy_ckpt_state s;
    char why[128], ok[4096];
    with_own_crc(STATE_OK, ok, sizeof ok);
    cr_assert_eq(fy_ckpt_state_parse(ok, strlen(ok), &s, why, sizeof why), FY_OK, "%s", why);
    cr_expect_eq(s.info.step, 12);
    cr_expect_eq(s.info.updates, 11);
    cr_expect(isnan(s.info.val_loss) && s.info.loss == 2.5);
    cr_expect_eq(s.nfiles, 3);
    cr_expect_eq(s.files[0].crc, 0xabcdu);
    cr_expect_eq(s.files[2].crc, 0xffffffffu);
    fy_ckpt_state_free(&s);
    static const struct { const char *from, *to, *why; } bad[] = {
        {"ferry-checkpoint", "ferry-plan", "format"},
        {"\"version\":1", "\"version\":2", "version"},
        {"\"step\":12", "\"step\":-1", "step"},
        {"\"step\":12", "\"step\":1.5", "step"},
        {"\"updates\":11", "\"updates\":13", "updates"},
        {"\"loss\":2.5", "\"loss\":\"x\"", "loss"},
        {"\"config\":{}", "\"config\":[]", "config"},
        {"model.safetensors", "../../etc/passwd", "not a checkpoint's"},
        {"optimizer.exp_avg.safetensors", "model.safetensors", "twice"},
        {"0000abcd", "abcd", "crc32c"},
        {"0000abcd", "0000abcg", "crc32c"},
        {"0000abcd", " 000abcd", "crc32c"},
        {"0000abcd", "0x00abcd", "crc32c"},
        {"0000abcd", "-000abcd", "crc32c"},
        {"\"bytes\":10", "\"bytes\":-10", "bytes"},
        {"{\"name\":\"optimizer.exp_avg_sq.safetensors\",\"bytes\":10,\"crc32c\":\"ffffffff\"}",
         "{}", "not a checkpoint's"},
        {",{\"name\":\"optimizer.exp_avg_sq.safetensors\",\"bytes\":10,\"crc32c\":\"ffffffff\"}",
         "", "missing"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        memset(why, 0, sizeof why);
        cr_expect_eq(parse_edited(bad[i].from, bad[i].to, why), FY_ERR_FORMAT, "case %zu accepted", i);
        cr_expect_not_null(strstr(why, bad[i].why), "case %zu: '%s' does not say %s", i, why, bad[i].why);
    }
    /* an edit after sealing: the state's own checksum catches it; none at all is refused */
    char *at = strstr(ok, "11");
    cr_assert_not_null(at);
    at[1] = '0';
    cr_expect_eq(fy_ckpt_state_parse(ok, strlen(ok), &s, why, sizeof why), FY_ERR_FORMAT);
    cr_expect_not_null(strstr(why, "own checksum"), "%s", why);
    cr_expect_eq(fy_ckpt_state_parse(STATE_OK, strlen(STATE_OK), &s, why, sizeof why), FY_ERR_FORMAT);
    cr_expect_not_null(strstr(why, "state_crc32c"), "%s", why);
    cr_expect_eq(fy_ckpt_state_parse("[1", 2, &s, why, sizeof why), FY_ERR_FORMAT);
    cr_expect_eq(fy_ckpt_state_parse("", 0, &s, why, sizeof why), FY_ERR_FORMAT);
}

/* ---- the model writer's bytes ---- */

TestSuite(model_save, .init = make_dir, .fini = remove_dir);

/* Block b's element i: an exact function of (b, i) (a 24-bit integer scaled by a power of
 * two, minus one: every step exact), so the bytes written depend on no machine. */
static fy_status pattern_block(void *ctx, int b, float *host) {
    const fy_model *m = ctx;
    const size_t n = fy_model_block(m, b)->nelem;
    for (size_t i = 0; i < n; i++) {
        uint32_t h = (uint32_t)(i * 2654435761u) ^ (uint32_t)(b * 40503u + 17u);
        h ^= h >> 15;
        host[i] = ldexpf((float)(h & 0xffffff), -23) - 1.0f;
    }
    return FY_OK;
}

/* The size and CRC-32C of a file. */
static void file_sum(const char *path, size_t *n, uint32_t *crc) {
    char *b = test_read_file(path, n);
    cr_assert_not_null(b, "cannot read %s", path);
    *crc = fy_crc32c(b, *n, 0);
    free(b);
}

static void check_pinned_saves(int path_kind);

/* What fy_model_save writes (single files in fp32 and bf16, with the CRC it reports, and
 * a directory of shards) is byte for byte what the writer wrote before it streamed through
 * aligned buffers on a thread (sizes and CRC-32Cs taken from files written by commit
 * 2fd90db). The models are large enough for several of the writer's buffers and have
 * tensors of odd sizes; a GPT-2's Conv1D tensors are transposed on the way out. */
Test(model_save, bytes_are_those_of_the_previous_writer) {
    /* the default buffers, and 12 KiB ones (seams inside most tensors, transposed ones
     * too) direct and through the page cache (outfile.h's test hooks) */
    static const char *const chunk[] = {NULL, "12288", "12288"};
    for (int path = 0; path < 3; path++) {
        if (chunk[path]) setenv("FERRY_TEST_OUTFILE_CHUNK", chunk[path], 1);
        if (path == 2) setenv("FERRY_TEST_OUTFILE_BUFFERED", "1", 1);
        check_pinned_saves(path);
    }
    unsetenv("FERRY_TEST_OUTFILE_CHUNK");
    unsetenv("FERRY_TEST_OUTFILE_BUFFERED");
}

static void check_pinned_saves(int path_kind) {
    static const struct {
        const char *model, *file;
        fy_model_shape shape;
        fy_dtype dtype;
        size_t shard;
        size_t nbytes;
        uint32_t crc;
    } cases[] = {
        {"gpt2-tiny", "g32.safetensors", {4099, 67, 256, 4, 4, 0, 0}, FY_F32, 0, 16909064,
         0xdcbff85au},
        {"gpt2-tiny", "g16.safetensors", {4099, 67, 256, 4, 4, 0, 0}, FY_BF16, 0, 8456968,
         0x9399dc92u},
        {"gpt2-tiny", "gdir/model-00002-of-00004.safetensors", {4099, 67, 256, 4, 4, 0, 0},
         FY_F32, 6000000, 5265152, 0xb46d5ad6u},
        {"llama-tiny", "l32.safetensors", {3001, 64, 320, 3, 5, 1, 867}, FY_F32, 0, 20632176,
         0xa399d870u},
        {"llama-tiny", "l16.safetensors", {3001, 64, 320, 3, 5, 1, 867}, FY_BF16, 0, 10317944,
         0x9fc72461u},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        fy_model *m;
        cr_assert_eq(fy_model_named(cases[k].model, &cases[k].shape, &m), FY_OK, "%s",
                     fy_last_error());
        uint32_t reported = 0;
        const char *file = P("%d-%s", path_kind, cases[k].file), *path = file;
        char dir[256];
        if (cases[k].shard) {
            snprintf(dir, sizeof dir, "%s", file);
            *strrchr(dir, '/') = 0;
            path = dir;
        }
        const fy_save_opts o = {.dtype = cases[k].dtype, .shard_nbytes = cases[k].shard,
                                .crc32c = cases[k].shard ? NULL : &reported};
        cr_assert_eq(fy_model_save(m, path, &o, pattern_block, m), FY_OK, "%s", fy_last_error());
        size_t n;
        uint32_t crc;
        file_sum(file, &n, &crc);
        if (!cases[k].shard)
            cr_expect_eq(reported, crc, "%s (writer %d): the CRC reported", cases[k].file, path_kind);
        cr_expect_eq(n, cases[k].nbytes, "%s (writer %d): %zu bytes, were %zu", cases[k].file,
                     path_kind, n, cases[k].nbytes);
        cr_expect_eq(crc, cases[k].crc, "%s (writer %d): CRC-32C %08x, was %08x", cases[k].file,
                     path_kind, crc, cases[k].crc);
        fy_model_free(m);
    }
}

/* ---- outfile ---- */

TestSuite(outfile, .init = make_dir, .fini = remove_dir);

static uint64_t g_rand = 88172645463325252u;
static uint64_t rand64(void) { return test_xorshift64(&g_rand); }

/* n random bytes appended to a new file through cfg, in pieces of random sizes, copied in
 * or written in place by turns; the file, the count and the CRC are those bytes'. */
static void outfile_round_trip(const char *path, size_t n, uint64_t hint, const fy_outfile_cfg *cfg) {
    uint8_t *want = malloc(n + 1);
    for (size_t i = 0; i < n; i++) want[i] = (uint8_t)rand64();
    fy_outfile *f;
    cr_assert_eq(fy_outfile_open(path, hint, cfg, &f), FY_OK, "%s", fy_last_error());
    for (size_t at = 0; at < n;) {
        size_t k = (size_t)(rand64() % 9000) + 1;
        if (k > n - at) k = n - at;
        if (rand64() & 1) {
            cr_assert_eq(fy_outfile_write(f, want + at, k), FY_OK);
        } else {
            void *p;
            size_t avail;
            cr_assert_eq(fy_outfile_span(f, &p, &avail), FY_OK);
            cr_assert_geq(avail, 1);
            if (k > avail) k = avail;
            memcpy(p, want + at, k);
            cr_assert_eq(fy_outfile_commit(f, k), FY_OK);
        }
        at += k;
    }
    uint64_t nbytes = 0;
    uint32_t crc = 0;
    cr_assert_eq(fy_outfile_close(f, &nbytes, &crc), FY_OK, "%s", fy_last_error());
    size_t got_n;
    uint8_t *got = (uint8_t *)test_read_file(path, &got_n);
    cr_assert_eq(got_n, n, "%s: %zu bytes, %zu written", path, got_n, n);
    cr_assert(!memcmp(got, want, n), "%s: the bytes differ", path);
    cr_assert_eq(nbytes, n);
    cr_assert_eq(crc, fy_crc32c_portable(want, n, 0), "%s: the CRC", path);
    free(got);
    free(want);
}

/* Every path gives the file the bytes appended: one small buffer (the count under the
 * hint, at it, past it), rings of two and three buffers direct (lengths ending on a 4 KiB
 * block, inside one, on a buffer) and through the page cache. */
Test(outfile, every_path_writes_the_bytes_appended) {
    const fy_outfile_cfg direct2 = {.chunk_nbytes = 8192, .nchunks = 2};
    const fy_outfile_cfg direct3 = {.chunk_nbytes = 12288, .nchunks = 3};
    const fy_outfile_cfg buffered = {.chunk_nbytes = 12288, .nchunks = 3, .buffered = true};
    const struct { size_t n; uint64_t hint; const fy_outfile_cfg *cfg; } cases[] = {
        {0, 0, NULL}, {1, 1, NULL}, {5000, 100000, NULL}, {100000, 100000, NULL},
        {300000, 100000, NULL},
        {0, 1 << 20, &direct2}, {4096, 1 << 20, &direct2}, {8192, 1 << 20, &direct2},
        {200000, 1 << 20, &direct2}, {200000 + 4096 * 3, 1 << 20, &direct2},
        {262144 + 77, 1 << 20, &direct3}, {12288 * 20, 1 << 20, &direct3},
        {262144 + 77, 1 << 20, &buffered}, {5, 1 << 20, &buffered},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++)
        outfile_round_trip(P("f%zu", k), cases[k].n, cases[k].hint, cases[k].cfg);
}

/* A write the system refuses midway (a file size limit: EFBIG on a direct write of the
 * ring) fails the file with one logged line naming it; the calls after it return it. */
Test(outfile, a_failed_write_is_logged_once_and_sticks) {
    signal(SIGXFSZ, SIG_IGN);
    struct rlimit rl = {.rlim_cur = 65536, .rlim_max = RLIM_INFINITY};
    cr_assert_eq(setrlimit(RLIMIT_FSIZE, &rl), 0);
    const fy_outfile_cfg cfg = {.chunk_nbytes = 16384, .nchunks = 2};
    static uint8_t data[1 << 20];
    const char *path = P("big");
    fy_outfile *f;
    cr_assert_eq(fy_outfile_open(path, sizeof data, &cfg, &f), FY_OK);
    capture_begin();
    fy_status st = FY_OK;
    for (size_t at = 0; at < sizeof data && st == FY_OK; at += 4096)
        st = fy_outfile_write(f, data + at, 4096);
    const fy_status closed = fy_outfile_close(f, NULL, NULL);
    const char *log = capture_end();
    cr_assert_eq(closed, FY_ERR_IO);
    assert_one_error(log, path, "cannot write", NULL);
}

/* The file must be new; one that exists is left as it was. */
Test(outfile, an_existing_file_is_not_replaced) {
    const char *path = P("old");
    write_file(path, "keep", 4);
    fy_outfile *f = (fy_outfile *)(uintptr_t)1;
    capture_begin();
    fy_status st = fy_outfile_open(path, 1 << 24, NULL, &f);
    const char *log = capture_end();
    cr_assert_eq(st, FY_ERR_IO);
    cr_assert_null(f);
    assert_one_error(log, path, "cannot create", NULL);
    size_t n;
    char *b = test_read_file(path, &n);
    cr_assert(n == 4 && !memcmp(b, "keep", 4));
    free(b);
}

/* Abandoned with buffers queued and one half filled: the writer thread stops, nothing is
 * logged (the caller removes the file). */
Test(outfile, abandoned_midway) {
    const fy_outfile_cfg cfg = {.chunk_nbytes = 8192, .nchunks = 3};
    static uint8_t data[100000];
    fy_outfile *f;
    cr_assert_eq(fy_outfile_open(P("gone"), 1 << 20, &cfg, &f), FY_OK);
    capture_begin();
    cr_assert_eq(fy_outfile_write(f, data, sizeof data), FY_OK);
    fy_outfile_abandon(f);
    fy_outfile_abandon(NULL);
    const char *log = capture_end();
    cr_assert_str_empty(log);
}

/* A block source that fails at block `fail_at` (logging, as a source does). */
typedef struct failing_src { const fy_model *m; int fail_at, calls; } failing_src;

static fy_status failing_block(void *ctx, int b, float *host) {
    failing_src *s = ctx;
    s->calls++;
    if (b == s->fail_at) {
        fy_log_error("block %d cannot be had", b);
        return FY_ERR_DEVICE;
    }
    return pattern_block((void *)s->m, b, host);
}

/* The save fetches blocks on the caller's thread while its own thread writes: a source
 * that fails (first block, midway, last) fails the save with its status and its one line,
 * leaves no file or temporary behind, and is not called again after; a writer that fails
 * (a file size limit, 1 MiB into a 17 MB file) stops the fetching. Single files and
 * directories. */
Test(model_save, a_failing_source_or_writer_stops_both_sides) {
    fy_model *m;
    const fy_model_shape shape = {4099, 67, 256, 4, 4, 0, 0};
    cr_assert_eq(fy_model_named("gpt2-tiny", &shape, &m), FY_OK);
    const int nb = fy_model_nblocks(m);
    const int fail_at[] = {0, 2, nb - 1};
    for (size_t k = 0; k < 3; k++)
        for (int dir = 0; dir < 2; dir++) {
            failing_src s = {m, fail_at[k], 0};
            const char *path = dir ? P("d%zu", k) : P("f%zu.safetensors", k);
            capture_begin();
            fy_status st = fy_model_save(m, path, NULL, failing_block, &s);
            const char *log = capture_end();
            cr_assert_eq(st, FY_ERR_DEVICE, "%s: %s", path, fy_status_str(st));
            assert_one_error(log, "cannot be had", NULL);
            cr_assert_eq(s.calls, fail_at[k] + 1, "%s: the source was called %d times", path, s.calls);
            cr_assert(!exists(path), "%s was written", path);
        }
    DIR *d = opendir(g_dir);
    for (struct dirent *e; (e = readdir(d));)
        cr_assert(e->d_name[0] == '.', "%s left behind", e->d_name);
    closedir(d);
    signal(SIGXFSZ, SIG_IGN);
    struct rlimit rl = {.rlim_cur = 1 << 20, .rlim_max = RLIM_INFINITY};
    cr_assert_eq(setrlimit(RLIMIT_FSIZE, &rl), 0);
    setenv("FERRY_TEST_OUTFILE_CHUNK", "65536", 1); /* a ring far smaller than the file */
    failing_src s = {m, -1, 0};
    capture_begin();
    fy_status st = fy_model_save(m, P("big.safetensors"), NULL, failing_block, &s);
    const char *log = capture_end();
    cr_assert_eq(st, FY_ERR_IO);
    assert_one_error(log, "big.safetensors", "cannot write", NULL);
    cr_assert_lt(s.calls, nb, "the source was called for every block after the writer failed");
    fy_model_free(m);
}

/* Loading reads back what saving wrote, block for block: a GPT-2 (Conv1D tensors
 * transposed on the way in, straight from the map when at a float's alignment) from the
 * writer's file, and from a hand-built file whose tensors all sit 2 bytes off a float's
 * alignment (a one-element BF16 tensor first: read through a copy). */
Test(model_save, load_reads_back_what_was_saved_aligned_or_not) {
    fy_model *m;
    const fy_model_shape shape = {1031, 35, 96, 2, 3, 0, 0};
    cr_assert_eq(fy_model_named("gpt2-tiny", &shape, &m), FY_OK);
    const int nb = fy_model_nblocks(m);
    const size_t maxn = fy_model_max_block_nelem(m);
    float *want = malloc(maxn * sizeof(float)), *got = malloc(maxn * sizeof(float));
    cr_assert_eq(fy_model_save(m, P("a.safetensors"), NULL, pattern_block, m), FY_OK);
    /* the same tensors behind a 2-byte one */
    fy_weights *w;
    cr_assert_eq(fy_weights_open(P("a.safetensors"), &w), FY_OK);
    const int n = fy_weights_count(w);
    fy_st_entry *es = calloc((size_t)n + 1, sizeof *es);
    const uint16_t one = 0x3f80;
    es[0] = (fy_st_entry){.name = "zz.pad", .dtype = FY_BF16, .ndim = 1, .shape = {1}, .data = &one};
    for (int i = 0; i < n; i++) {
        const fy_st_file *f;
        const fy_st_tensor *t = fy_weights_at(w, i, &f);
        es[i + 1] = (fy_st_entry){.name = t->name, .dtype = t->dtype, .ndim = t->ndim, .data = t->data};
        memcpy(es[i + 1].shape, t->shape, sizeof t->shape[0] * (size_t)t->ndim);
    }
    cr_assert_eq(fy_st_write(P("b.safetensors"), es, n + 1, NULL), FY_OK);
    free(es);
    for (int k = 0; k < 2; k++) {
        fy_weights *r = w;
        if (k == 1) cr_assert_eq(fy_weights_open(P("b.safetensors"), &r), FY_OK);
        bool off = false;
        for (int i = 0; i < fy_weights_count(r); i++) {
            const fy_st_file *f;
            const fy_st_tensor *t = fy_weights_at(r, i, &f);
            off |= t->dtype == FY_F32 && (uintptr_t)t->data % 4 != 0;
        }
        cr_assert_eq(off, k == 1, "file %d: its fp32 tensors %s aligned", k, off ? "are not" : "are");
        for (int b = 0; b < nb; b++) {
            const fy_block_spec *blk = fy_model_block(m, b);
            pattern_block(m, b, want);
            cr_assert_eq(fy_model_load_block(m, r, b, got), FY_OK, "%s", fy_last_error());
            for (int t = 0; t < blk->ntensors; t++) { /* (the padding between reads as 0) */
                const fy_tensor_spec *ts = &blk->tensors[t];
                const size_t o = ts->offset, n = (size_t)ts->rows * ts->cols;
                cr_assert(!memcmp(got + o, want + o, n * sizeof(float)), "file %d: %s differs", k,
                          ts->name);
            }
        }
        if (k == 1) fy_weights_close(r);
    }
    fy_weights_close(w);
    free(want);
    free(got);
    fy_model_free(m);
}
