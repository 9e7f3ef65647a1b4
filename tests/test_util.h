/* test_util.h — helpers several test files share (each test file is its own program, so
 * these are static; include after <criterion/criterion.h>). */
#ifndef FY_TEST_UTIL_H
#define FY_TEST_UTIL_H

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "engine/io/corpus.h"
#include "engine/io/tokens.h"

static int test_rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb; (void)flag; (void)ftw;
    return remove(p);
}
/* Removes dir and everything under it (a test's temporary directory). */
/* xorshift64: the next of a test's reproducible pseudo-random words (*state nonzero). */
static inline uint64_t test_xorshift64(uint64_t *state) {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    return *state;
}

static inline void test_remove_tree(const char *dir) {
    nftw(dir, test_rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

/* A whole file, NUL-terminated, in a malloc'd buffer (n, if not NULL, gets its size);
 * the calling test fails if it cannot be read. */
static inline char *test_read_file(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)sz + 1);
    cr_assert_not_null(b);
    cr_assert_eq(fread(b, 1, (size_t)sz, f), (size_t)sz, "cannot read %s", path);
    b[sz] = 0;
    fclose(f);
    if (n) *n = (size_t)sz;
    return b;
}

/* dir/<fmt, ...> in one of 16 rotating buffers: a path in a test's temporary directory. */
static inline const char *test_vpath(const char *dir, const char *fmt, va_list ap) {
    static char bufs[16][512];
    static int k;
    char name[256];
    vsnprintf(name, sizeof name, fmt, ap);
    char *b = bufs[k++ % 16];
    snprintf(b, sizeof bufs[0], "%s/%s", dir, name);
    return b;
}

/* $FERRY_FIXTURES/name, in one of 4 rotating buffers. */
static inline const char *test_fixture(const char *name) {
    static char bufs[4][1024];
    static int k;
    const char *d = getenv("FERRY_FIXTURES");
    cr_assert_not_null(d, "FERRY_FIXTURES must name tests/fixtures");
    char *b = bufs[k++ % 4];
    snprintf(b, sizeof bufs[0], "%s/%s", d, name);
    return b;
}

/* A copy of the file from at to (created or replaced). */
static inline void test_copy_file(const char *from, const char *to) {
    size_t n;
    char *b = test_read_file(from, &n);
    FILE *f = fopen(to, "wb");
    cr_assert_not_null(f, "cannot create %s: %s", to, strerror(errno));
    cr_assert_eq(fwrite(b, 1, n, f), n);
    cr_assert_eq(fclose(f), 0);
    free(b);
}

/* A new directory dst with a copy of every file of src but its dot files. */
static inline void test_copy_dir(const char *src, const char *dst) {
    cr_assert_eq(mkdir(dst, 0755), 0, "mkdir %s: %s", dst, strerror(errno));
    DIR *d = opendir(src);
    cr_assert_not_null(d, "%s", src);
    for (struct dirent *e; (e = readdir(d));) {
        if (e->d_name[0] == '.') continue;
        char from[1200], to[1200];
        snprintf(from, sizeof from, "%s/%s", src, e->d_name);
        snprintf(to, sizeof to, "%s/%s", dst, e->d_name);
        test_copy_file(from, to);
    }
    closedir(d);
}

/* 64 KiB of the generated corpus as byte tokens: the training data of the plan tests. */
static inline fy_tokens *test_corpus(void) {
    uint8_t *text;
    cr_assert_eq(fy_corpus_generate(64 << 10, 3, &text), FY_OK);
    fy_tokens *t;
    cr_assert_eq(fy_tokens_from_bytes(text, 64 << 10, "test corpus", &t), FY_OK);
    free(text);
    return t;
}

/* A run of the ferry binary: exit status (-1 when killed by a signal), the signal, the
 * command line (for messages) and what it wrote (NUL-terminated; leaked: the test process
 * is forked per test and exits soon). */
typedef struct test_proc {
    int code;
    int sig;
    char cmd[4096];
    char *out, *err;
} test_proc;

/* As test_run_ferry (below), and delay_ms after the start sends sig to the child (if it is
 * still running), then sig2 (0: none) sig2_after_ms later (if it is still running). With
 * `when` (and delay_ms 0), the signal goes as soon as when(ctx) is true, polled every
 * millisecond instead. */
static inline void test_run_ferry_when(test_proc *r, const char *dir, int timeout_s,
                                       const char *const *args, int delay_ms, int sig, int sig2,
                                       int sig2_after_ms, bool (*when)(void *), void *ctx);
static inline void test_run_ferry_sig(test_proc *r, const char *dir, int timeout_s,
                                      const char *const *args, int delay_ms, int sig, int sig2) {
    test_run_ferry_when(r, dir, timeout_s, args, delay_ms, sig, sig2, 0, NULL, NULL);
}

/* Runs $FERRY_BIN with args (NULL-terminated) in dir, stdin from /dev/null, stdout and
 * stderr captured through files in dir; an alarm of timeout_s seconds, which survives the
 * exec, turns a hang into SIGALRM. */
static inline void test_run_ferry(test_proc *r, const char *dir, int timeout_s,
                                  const char *const *args) {
    test_run_ferry_sig(r, dir, timeout_s, args, -1, 0, 0);
}

static inline void test_run_ferry_when(test_proc *r, const char *dir, int timeout_s,
                                       const char *const *args, int delay_ms, int sig, int sig2,
                                       int sig2_after_ms, bool (*when)(void *), void *ctx) {
    const char *bin = getenv("FERRY_BIN");
    cr_assert_not_null(bin, "FERRY_BIN must name the ferry binary");
    char outp[512], errp[512];
    snprintf(outp, sizeof outp, "%s/.stdout", dir);
    snprintf(errp, sizeof errp, "%s/.stderr", dir);
    size_t len = (size_t)snprintf(r->cmd, sizeof r->cmd, "ferry");
    int n = 0;
    for (; args[n]; n++)
        if (len < sizeof r->cmd)
            len += (size_t)snprintf(r->cmd + len, sizeof r->cmd - len, " %s", args[n]);
    const char **argv = calloc((size_t)n + 2, sizeof *argv);
    cr_assert_not_null(argv);
    argv[0] = bin;
    for (int i = 0; i < n; i++) argv[i + 1] = args[i];
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    cr_assert_neq(pid, -1, "fork: %s", strerror(errno));
    if (pid == 0) {
        int in = open("/dev/null", O_RDONLY);
        int fo = open(outp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        int fe = open(errp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (in < 0 || fo < 0 || fe < 0 || dup2(in, 0) < 0 || dup2(fo, 1) < 0 || dup2(fe, 2) < 0)
            _exit(126);
        if (chdir(dir) != 0) _exit(126);
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        signal(SIGALRM, SIG_DFL);
        alarm((unsigned)timeout_s);
        execv(bin, (char *const *)argv);
        _exit(127);
    }
    int st;
    bool reaped = false;
    for (int waited = 0; delay_ms >= 0 && sig && !reaped; waited++) {
        pid_t w = waitpid(pid, &st, WNOHANG);
        cr_assert(w >= 0 || errno == EINTR, "waitpid: %s", strerror(errno));
        reaped = w == pid;
        if (!reaped && (when ? when(ctx) : waited >= delay_ms)) {
            kill(pid, sig);
            for (int w2 = 0; sig2 && w2 < sig2_after_ms && !reaped; w2++) {
                reaped = waitpid(pid, &st, WNOHANG) == pid;
                usleep(1000);
            }
            if (sig2 && !reaped) kill(pid, sig2);
            break;
        }
        if (!reaped) usleep(1000);
    }
    while (!reaped && waitpid(pid, &st, 0) < 0) cr_assert_eq(errno, EINTR, "waitpid: %s", strerror(errno));
    free(argv);
    r->code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    r->sig = WIFSIGNALED(st) ? WTERMSIG(st) : 0;
    r->out = test_read_file(outp, NULL);
    r->err = test_read_file(errp, NULL);
    cr_assert_neq(r->code, 127, "cannot execute %s", bin);
    unlink(outp);
    unlink(errp);
}

/* ---- the contract for bad input (README, "Bad input") ---- */

/* Asserts no signal, no hang, and nothing on stderr that is not a "ferry: " line. */
static inline void test_expect_clean(const test_proc *r) {
    cr_assert_eq(r->sig, 0, "`%s` was killed by signal %d (%s)%s\nstderr:\n%s", r->cmd, r->sig,
                 strsignal(r->sig), r->sig == SIGALRM ? ": it hung" : "", r->err);
    cr_assert_null(strstr(r->err, "internal error"), "`%s`: internal error\n%s", r->cmd, r->err);
    for (const char *l = r->err; *l;) {
        const char *nl = strchr(l, '\n');
        size_t n = nl ? (size_t)(nl - l) : strlen(l);
        cr_assert(n == 0 || !strncmp(l, "ferry: ", 7),
                  "`%s`: stderr holds a line that is not ferry's: '%.*s'\nstderr:\n%s", r->cmd,
                  (int)n, l, r->err);
        l += n + (nl ? 1 : 0);
    }
}

/* The one "ferry: error:" line (asserted to be exactly one), copied into line. */
static inline void test_error_line(const test_proc *r, char *line, size_t cap) {
    int count = 0;
    line[0] = 0;
    for (const char *l = r->err; *l;) {
        const char *nl = strchr(l, '\n');
        size_t n = nl ? (size_t)(nl - l) : strlen(l);
        if (!strncmp(l, "ferry: error:", 13)) {
            if (count++ == 0) snprintf(line, cap, "%.*s", (int)n, l);
        }
        l += n + (nl ? 1 : 0);
    }
    cr_assert_eq(count, 1, "`%s`: expected exactly one 'ferry: error:' line, got %d\nstderr:\n%s",
                 r->cmd, count, r->err);
}

/* Asserts a clean failure: exit status `want` (0: 1 or 2), exactly one error line, and
 * that line holds every key word. */
static inline void test_expect_error_kw(const test_proc *r, int want, const char *const *kw) {
    test_expect_clean(r);
    cr_assert_neq(r->code, 0, "`%s` succeeded; it should fail\nstdout:\n%s", r->cmd, r->out);
    if (want) cr_assert_eq(r->code, want, "`%s`: exit status %d, expected %d\nstderr:\n%s", r->cmd,
                           r->code, want, r->err);
    else cr_assert(r->code == 1 || r->code == 2, "`%s`: exit status %d, expected 1 or 2\n%s",
                   r->cmd, r->code, r->err);
    char line[2048];
    test_error_line(r, line, sizeof line);
    cr_log_info("`%s` -> %d: %s", r->cmd, r->code, line); /* shown with --verbose */
    for (int i = 0; kw[i]; i++)
        cr_assert_not_null(strstr(line, kw[i]), "`%s`: the error does not mention '%s': %s",
                           r->cmd, kw[i], line);
}

#define EXPECT_ERROR(r, want, ...) test_expect_error_kw((r), (want), (const char *const[]){__VA_ARGS__, NULL})

static inline void test_expect_ok(const test_proc *r) {
    test_expect_clean(r);
    cr_assert_eq(r->code, 0, "`%s` failed with status %d\nstderr:\n%s", r->cmd, r->code, r->err);
    cr_assert_null(strstr(r->err, "ferry: error:"), "`%s` succeeded but logged an error:\n%s",
                   r->cmd, r->err);
}

#endif
