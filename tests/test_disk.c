/* test_disk.c — the disk tier's scratch file (offload/disk.h).
 *
 * Every test works in its own temporary directory (made in .init, removed in .fini): the
 * scratch directory is <it>/disk, so notes and other files can sit beside it without
 * making it non-empty. Data is a pattern of the file offset and a seed, so a byte read
 * from the wrong place, or a piece left unread, is caught wherever it lands. Error cases
 * check the status and that exactly one line was logged naming the problem. What must
 * not touch the test process (a file-size limit, the failure hook's environment, an
 * abort) runs in a forked child that reports through its exit status. */
#include <criterion/criterion.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "engine/core/status.h"
#include "offload/disk.h"
#include "tests/test_util.h"

#define MiB ((size_t)1 << 20)
#define PIECE FY_DISK_PIECE

static char g_dir[64];
static char g_disk[96]; /* g_dir/disk: the scratch directory */

static void make_dir(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/ferry-test-disk-XXXXXX");
    cr_assert_not_null(mkdtemp(g_dir), "mkdtemp: %s", strerror(errno));
    snprintf(g_disk, sizeof g_disk, "%s/disk", g_dir);
    cr_assert_eq(mkdir(g_disk, 0755), 0, "mkdir %s: %s", g_disk, strerror(errno));
}

static void remove_dir(void) { test_remove_tree(g_dir); }

TestSuite(disk, .init = make_dir, .fini = remove_dir);

/* Entries of dir other than . and .. */
static int entries(const char *dir) {
    DIR *d = opendir(dir);
    cr_assert_not_null(d, "opendir %s: %s", dir, strerror(errno));
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) n++;
    closedir(d);
    return n;
}

/* The pattern's 8 bytes at file offset off (a multiple of 8) for seed. */
static uint64_t word(size_t off, uint64_t seed) {
    return ((uint64_t)off + 1) * 0x9E3779B97F4A7C15ull ^ (seed << 56 | seed);
}

/* buf holds the file's bytes [off, off + n) of pattern seed. */
static void fill(void *buf, size_t off, size_t n, uint64_t seed) {
    uint64_t *w = buf;
    for (size_t i = 0; i < n / 8; i++) w[i] = word(off + 8 * i, seed);
}

/* The first offset in [off, off + n) where buf departs from pattern seed (seed 0 with
 * zero: zeros), or SIZE_MAX. */
static size_t mismatch(const void *buf, size_t off, size_t n, uint64_t seed, bool zero) {
    const uint64_t *w = buf;
    for (size_t i = 0; i < n / 8; i++)
        if (w[i] != (zero ? 0 : word(off + 8 * i, seed))) return off + 8 * i;
    return SIZE_MAX;
}

static fy_disk *open_disk(size_t nbytes, int qdepth) {
    fy_disk *d;
    cr_assert_eq(fy_disk_open(g_disk, 0, nbytes, qdepth, &d), FY_OK, "%s", fy_last_error());
    return d;
}

/* [off, off + n) written with seed and read back into a fresh buffer. */
static void round_trip(fy_disk *d, size_t off, size_t n, uint64_t seed) {
    char *w = fy_disk_buffer(n), *r = fy_disk_buffer(n);
    cr_assert(w && r);
    fill(w, off, n, seed);
    cr_assert_eq(fy_disk_write(d, off, w, n), FY_OK, "%s", fy_last_error());
    cr_assert_eq(fy_disk_read(d, off, r, n), FY_OK, "%s", fy_last_error());
    const size_t bad = mismatch(r, off, n, seed, false);
    cr_assert_eq(bad, SIZE_MAX, "%zu bytes at %zu: wrong byte read back at offset %zu", n, off, bad);
    free(w);
    free(r);
}

/* Sizes around a piece, at offsets that do not start a piece, at three queue depths:
 * one piece, a piece less and more than one (a call's last piece is short), several. */
Test(disk, round_trips_at_several_sizes_and_depths) {
    static const int depths[] = {1, 3, 8};
    static const size_t sizes[] = {4096, PIECE - 4096, PIECE, PIECE + 4096, 3 * PIECE + 12288};
    for (size_t q = 0; q < sizeof depths / sizeof depths[0]; q++) {
        fy_disk *d = open_disk(40 * MiB, depths[q]);
        cr_assert_eq(fy_disk_nbytes(d), 40 * MiB);
        for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
            round_trip(d, MiB + 4096 * (i + 1), sizes[i], 1 + i + 10 * q);
        fy_disk_close(d);
    }
}

/* The file's size is rounded up to FY_DISK_ALIGN; what was never written reads as zeros
 * (it is preallocated, not a hole the read runs off the end of). */
Test(disk, size_is_aligned_and_unwritten_bytes_read_zero) {
    fy_disk *d = open_disk(3 * PIECE + 100, 2);
    const size_t n = fy_disk_nbytes(d);
    cr_assert_eq(n, fy_disk_align_up(3 * PIECE + 100));
    char *r = fy_disk_buffer(n);
    memset(r, 0xab, n);
    cr_assert_eq(fy_disk_read(d, 0, r, n), FY_OK, "%s", fy_last_error());
    cr_assert_eq(mismatch(r, 0, n, 0, true), SIZE_MAX);
    free(r);
    fy_disk_close(d);
}

/* A whole file in one call, then ranges in the middle that cross piece boundaries read
 * and overwritten: each read gives exactly its range, an overwrite changes only its own. */
Test(disk, ranges_in_the_middle_cross_pieces) {
    const size_t N = 5 * PIECE;
    fy_disk *d = open_disk(N, 4);
    char *all = fy_disk_buffer(N), *r = fy_disk_buffer(N);
    fill(all, 0, N, 7);
    cr_assert_eq(fy_disk_write(d, 0, all, N), FY_OK, "%s", fy_last_error());
    const size_t off = PIECE - 4096, n = 2 * PIECE + 8192;
    cr_assert_eq(fy_disk_read(d, off, r, n), FY_OK, "%s", fy_last_error());
    cr_assert_eq(mismatch(r, off, n, 7, false), SIZE_MAX);
    fill(r, off, n, 9);
    cr_assert_eq(fy_disk_write(d, off, r, n), FY_OK, "%s", fy_last_error());
    cr_assert_eq(fy_disk_read(d, 0, all, N), FY_OK, "%s", fy_last_error());
    cr_assert_eq(mismatch(all, 0, off, 7, false), SIZE_MAX, "before the overwrite");
    cr_assert_eq(mismatch(all + off, off, n, 9, false), SIZE_MAX, "the overwrite");
    cr_assert_eq(mismatch(all + off + n, off + n, N - off - n, 7, false), SIZE_MAX, "after it");
    free(all);
    free(r);
    fy_disk_close(d);
}

/* ---- concurrent callers ---------------------------------------------------------------- */

#define CALLERS 3
#define RANGE (2 * PIECE + 3 * 4096) /* a caller's bytes: not a whole number of pieces */

typedef struct caller {
    fy_disk *d;
    int i;
    size_t bad; /* the first wrong offset, SIZE_MAX: none; 0 with failed: a call failed */
    bool failed;
} caller;

/* Caller i writes its range in three calls of unlike sizes, then reads it whole, over
 * and over: the pool serves the three at once. */
static void *caller_main(void *arg) {
    caller *c = arg;
    const size_t off = (size_t)c->i * RANGE;
    char *w = fy_disk_buffer(RANGE), *r = fy_disk_buffer(RANGE);
    c->bad = SIZE_MAX;
    for (int rep = 0; rep < 4 && !c->failed && c->bad == SIZE_MAX; rep++) {
        const uint64_t seed = 100 + 10 * (uint64_t)c->i + (uint64_t)rep;
        fill(w, off, RANGE, seed);
        const size_t cut[4] = {0, 4096, PIECE + 8192, RANGE};
        for (int k = 0; k < 3 && !c->failed; k++)
            c->failed = fy_disk_write(c->d, off + cut[k], w + cut[k], cut[k + 1] - cut[k]) != FY_OK;
        if (!c->failed) c->failed = fy_disk_read(c->d, off, r, RANGE) != FY_OK;
        if (!c->failed) c->bad = mismatch(r, off, RANGE, seed, false);
    }
    free(w);
    free(r);
    return NULL;
}

Test(disk, concurrent_callers_on_disjoint_ranges) {
    fy_disk *d = open_disk(CALLERS * RANGE, 2); /* fewer threads than callers */
    caller c[CALLERS];
    pthread_t t[CALLERS];
    for (int i = 0; i < CALLERS; i++) {
        c[i] = (caller){.d = d, .i = i};
        cr_assert_eq(pthread_create(&t[i], NULL, caller_main, &c[i]), 0);
    }
    for (int i = 0; i < CALLERS; i++) pthread_join(t[i], NULL);
    for (int i = 0; i < CALLERS; i++) {
        cr_assert(!c[i].failed, "caller %d: a call failed", i);
        cr_assert_eq(c[i].bad, SIZE_MAX, "caller %d read a wrong byte at offset %zu", i, c[i].bad);
    }
    /* and the file as a whole holds each caller's last pattern */
    char *all = fy_disk_buffer(CALLERS * RANGE);
    cr_assert_eq(fy_disk_read(d, 0, all, CALLERS * RANGE), FY_OK, "%s", fy_last_error());
    for (int i = 0; i < CALLERS; i++)
        cr_assert_eq(mismatch(all + (size_t)i * RANGE, (size_t)i * RANGE, RANGE, 100 + 10 * (uint64_t)i + 3, false),
                     SIZE_MAX, "caller %d's range", i);
    free(all);
    fy_disk_close(d);
}

/* ---- the file's name ------------------------------------------------------------------- */

/* The file has no name while it is open (the directory stays empty, so a second run's
 * check passes), none after, and it is named after the process and the rank. */
Test(disk, the_file_leaves_no_name) {
    fy_disk *d;
    cr_assert_eq(fy_disk_open(g_disk, 3, 2 * PIECE, 0, &d), FY_OK, "%s", fy_last_error());
    char want[256];
    snprintf(want, sizeof want, "%s/ferry-scratch-%ld-r3", g_disk, (long)getpid());
    cr_assert_str_eq(fy_disk_name(d), want);
    cr_assert_eq(entries(g_disk), 0, "the scratch file has a name while open");
    cr_assert_eq(fy_disk_check_dir(g_disk), FY_OK, "%s", fy_last_error());
    round_trip(d, 0, 2 * PIECE, 5);
    fy_disk_close(d);
    cr_assert_eq(entries(g_disk), 0);
    fy_disk_close(NULL); /* a no-op */
}

/* ---- refusals -------------------------------------------------------------------------- */

/* call fails with want after logging exactly one error that mentions kw. */
#define EXPECT_ONE_ERROR(call, want, kw) do { \
        const unsigned before_ = fy_log_error_count(); \
        cr_assert_eq((call), (want), "%s: status", #call); \
        cr_assert_eq(fy_log_error_count() - before_, 1u, "%s: %u error lines", #call, \
                     fy_log_error_count() - before_); \
        cr_assert_not_null(strstr(fy_last_error(), (kw)), "%s: the error does not say '%s': %s", \
                           #call, (kw), fy_last_error()); \
    } while (0)

Test(disk, check_dir_refuses_what_is_not_an_empty_directory) {
    const unsigned before = fy_log_error_count();
    cr_assert_eq(fy_disk_check_dir(g_disk), FY_OK, "%s", fy_last_error());
    cr_assert_eq(fy_log_error_count(), before, "an empty directory logged an error");
    char path[256];
    snprintf(path, sizeof path, "%s/foo", g_disk);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fclose(f);
    EXPECT_ONE_ERROR(fy_disk_check_dir(g_disk), FY_ERR_IO, "holds foo");
    cr_assert_not_null(strstr(fy_last_error(), "must be empty"));
    cr_assert_eq(access(path, F_OK), 0, "the entry was touched");
    snprintf(path, sizeof path, "%s/missing", g_dir);
    EXPECT_ONE_ERROR(fy_disk_check_dir(path), FY_ERR_IO, "no such directory");
    cr_assert_not_null(strstr(fy_last_error(), "--disk-dir"));
    snprintf(path, sizeof path, "%s/foo", g_disk);
    EXPECT_ONE_ERROR(fy_disk_check_dir(path), FY_ERR_IO, "not a directory");
}

/* Root is let through any permission bits, so this one runs as another user only. */
Test(disk, check_dir_refuses_a_directory_it_cannot_write) {
    if (geteuid() == 0) {
        remove_dir(); /* .fini does not run after a skip */
        cr_skip_test("running as root, which writes any directory whatever its permissions");
    }
    cr_assert_eq(chmod(g_disk, 0555), 0);
    EXPECT_ONE_ERROR(fy_disk_check_dir(g_disk), FY_ERR_IO, "not writable");
    fy_disk *d = NULL;
    EXPECT_ONE_ERROR(fy_disk_open(g_disk, 0, PIECE, 0, &d), FY_ERR_IO, "ferry-scratch");
    cr_assert_null(d);
    chmod(g_disk, 0755);
}

Test(disk, open_refuses_an_empty_file_and_a_missing_directory) {
    fy_disk *d = NULL;
    EXPECT_ONE_ERROR(fy_disk_open(g_disk, 0, 0, 0, &d), FY_ERR_INVALID, "0 bytes");
    cr_assert_null(d);
    EXPECT_ONE_ERROR(fy_disk_open(g_disk, 0, PIECE, -1, &d), FY_ERR_INVALID, "queue depth");
    char missing[256];
    snprintf(missing, sizeof missing, "%s/missing", g_dir);
    EXPECT_ONE_ERROR(fy_disk_open(missing, 0, PIECE, 0, &d), FY_ERR_IO, "/missing/ferry-scratch-");
    cr_assert_null(d);
}

/* ---- failures in a child --------------------------------------------------------------- */

/* Runs child() in a forked process: its exit status (a code child() chose), or 128 +
 * the signal that ended it. */
static int in_child(int (*child)(void)) {
    fflush(NULL);
    const pid_t pid = fork();
    cr_assert_neq(pid, -1, "fork: %s", strerror(errno));
    if (pid == 0) _exit(child());
    int ws;
    cr_assert_eq(waitpid(pid, &ws, 0), pid);
    return WIFEXITED(ws) ? WEXITSTATUS(ws) : 128 + WTERMSIG(ws);
}

/* Each check of a child: its own exit code, its message printed by the child. */
#define CHILD_CHECK(code, cond) do { \
        if (!(cond)) { fprintf(stderr, "child: %s failed (%s)\n", #cond, fy_last_error()); return (code); } \
    } while (0)

/* A full disk at open, without root: a file-size limit below the file makes
 * posix_fallocate fail (EFBIG; SIGXFSZ, which the kernel sends with it, ignored). */
static int full_disk_child(void) {
    signal(SIGXFSZ, SIG_IGN);
    const struct rlimit lim = {.rlim_cur = MiB, .rlim_max = MiB};
    CHILD_CHECK(2, setrlimit(RLIMIT_FSIZE, &lim) == 0);
    const unsigned before = fy_log_error_count();
    fy_disk *d = NULL;
    CHILD_CHECK(3, fy_disk_open(g_disk, 0, 64 * MiB, 0, &d) == FY_ERR_IO && !d);
    CHILD_CHECK(4, fy_log_error_count() - before == 1);
    CHILD_CHECK(5, strstr(fy_last_error(), "cannot preallocate 64.00 MiB"));
    CHILD_CHECK(6, strstr(fy_last_error(), "ferry-scratch-"));
    CHILD_CHECK(7, strstr(fy_last_error(), strerror(EFBIG)));
    CHILD_CHECK(8, entries(g_disk) == 0);
    return 0;
}

Test(disk, a_full_disk_fails_at_open_and_leaves_the_directory_empty) {
    cr_assert_eq(in_child(full_disk_child), 0, "see the child's line above");
    cr_assert_eq(entries(g_disk), 0);
}

/* FERRY_TEST_DISK_FAIL_AT=3: the third call (a write) fails with EIO, logged once as a
 * real error would be; the calls before and after it succeed. */
static int fail_at_child(void) {
    setenv("FERRY_TEST_DISK_FAIL_AT", "3", 1);
    fy_disk *d;
    CHILD_CHECK(2, fy_disk_open(g_disk, 0, 4 * PIECE, 0, &d) == FY_OK);
    char *b = fy_disk_buffer(2 * PIECE);
    const unsigned before = fy_log_error_count();
    CHILD_CHECK(3, fy_disk_write(d, 0, b, 2 * PIECE) == FY_OK);
    CHILD_CHECK(4, fy_disk_read(d, 0, b, PIECE) == FY_OK);
    CHILD_CHECK(5, fy_disk_write(d, 8192, b, 2 * PIECE) == FY_ERR_IO);
    CHILD_CHECK(6, fy_log_error_count() - before == 1);
    CHILD_CHECK(7, strstr(fy_last_error(), "I/O error writing 16.00 MiB at offset 8192 of "));
    CHILD_CHECK(8, strstr(fy_last_error(), "(unlinked): Input/output error"));
    CHILD_CHECK(9, fy_disk_write(d, 8192, b, 2 * PIECE) == FY_OK);
    free(b);
    fy_disk_close(d);
    return 0;
}

Test(disk, the_test_hook_fails_the_kth_call) {
    cr_assert_eq(in_child(fail_at_child), 0, "see the child's line above");
}

/* Misaligned I/O is a bug: an abort through FY_ASSERT, not a status. */
static int misaligned_child(void) {
    fy_disk *d;
    if (fy_disk_open(g_disk, 0, PIECE, 0, &d) != FY_OK) return 2;
    char *b = fy_disk_buffer(PIECE);
    (void)fy_disk_read(d, 512, b, 4096);
    return 3; /* not reached */
}

static int misaligned_len_child(void) {
    fy_disk *d;
    if (fy_disk_open(g_disk, 0, PIECE, 0, &d) != FY_OK) return 2;
    char *b = fy_disk_buffer(PIECE);
    (void)fy_disk_write(d, 0, b + 8, 4096);
    return 3;
}

Test(disk, misaligned_io_aborts) {
    cr_assert_eq(in_child(misaligned_child), 128 + SIGABRT);
    cr_assert_eq(in_child(misaligned_len_child), 128 + SIGABRT);
    cr_assert_eq(entries(g_disk), 0);
}

/* ---- direct or buffered ---------------------------------------------------------------- */

/* Whether a file in dir can be opened with O_DIRECT: told independently of disk.c. */
static bool dir_takes_direct(const char *dir) {
    char path[256];
    snprintf(path, sizeof path, "%s/probe-direct", dir);
    const int fd = open(path, O_RDWR | O_CREAT, 0600);
    cr_assert_geq(fd, 0, "%s: %s", path, strerror(errno));
    close(fd);
    const int fd2 = open(path, O_RDWR | O_DIRECT);
    if (fd2 >= 0) close(fd2);
    unlink(path);
    return fd2 >= 0;
}

/* fy_disk_direct says what the filesystem does, here and on a tmpfs (/dev/shm, where
 * there is one: no O_DIRECT on kernels before 6.6), and data round-trips either way. */
Test(disk, direct_io_where_the_filesystem_allows_it) {
    const bool want = dir_takes_direct(g_dir);
    fy_disk *d = open_disk(2 * PIECE, 0);
    cr_assert_eq(fy_disk_direct(d), want, "%s: direct %d, the filesystem says %d", g_disk,
                 fy_disk_direct(d), want);
    round_trip(d, 4096, PIECE + 4096, 3);
    fy_disk_close(d);
    char shm[64] = "/dev/shm/ferry-test-disk-XXXXXX";
    if (access("/dev/shm", W_OK) != 0 || !mkdtemp(shm)) return;
    const bool shm_want = dir_takes_direct(shm);
    fy_disk *s;
    cr_assert_eq(fy_disk_open(shm, 0, 2 * PIECE, 0, &s), FY_OK, "%s", fy_last_error());
    cr_assert_eq(fy_disk_direct(s), shm_want);
    round_trip(s, 4096, PIECE + 4096, 4);
    fy_disk_close(s);
    cr_assert_eq(entries(shm), 0);
    rmdir(shm);
}

/* ---- the bench ------------------------------------------------------------------------- */

Test(disk, bench_measures_both_directions) {
    double w = 0, r = 0;
    cr_assert_eq(fy_disk_bench(g_disk, 64 * MiB, FY_DISK_QDEPTH, &w, &r), FY_OK, "%s", fy_last_error());
    cr_assert_gt(w, 0.0);
    cr_assert_gt(r, 0.0);
    cr_log_info("64 MiB at depth %d: write %.2f GB/s, read %.2f GB/s", FY_DISK_QDEPTH, w, r);
    cr_assert_eq(entries(g_disk), 0);
    double w2 = 1, r2 = 1;
    char missing[256];
    snprintf(missing, sizeof missing, "%s/missing", g_dir);
    EXPECT_ONE_ERROR(fy_disk_bench(missing, MiB, 1, &w2, &r2), FY_ERR_IO, "missing");
    cr_assert(w2 == 0 && r2 == 0);
}

Test(disk, buffers_are_aligned_and_zeroed) {
    static const size_t sizes[] = {0, 1, 4095, 4096, 4097, 3 * MiB + 5};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        unsigned char *b = fy_disk_buffer(sizes[i]);
        cr_assert_not_null(b);
        cr_assert_eq((uintptr_t)b % FY_DISK_ALIGN, 0u);
        const size_t n = sizes[i] ? fy_disk_align_up(sizes[i]) : FY_DISK_ALIGN;
        size_t k = 0;
        while (k < n && !b[k]) k++;
        cr_assert_eq(k, n, "byte %zu of %zu is not zero", k, n);
        free(b);
    }
}
