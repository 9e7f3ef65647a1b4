/* test_child.h — a test's body in a forked child process, its stderr captured, ended at a
 * deadline: for what the test's own process must not do or cannot observe (abort on a
 * device fault, _exit from NCCL's watchdog, hang, print a report on stderr). Include after
 * <criterion/criterion.h>.
 *
 * The child runs body(arg) and _exits with its result. No Criterion call belongs in a body
 * (its asserts talk to the runner, which does not know the child): a body reports a failure
 * with a line on stderr and a non-zero result, and returns TEST_CHILD_SKIP, its reason on
 * stderr, when the machine cannot run it. Fork the children before the test's process
 * touches CUDA (a context does not survive a fork; the emulated runtime's device processes
 * belong to the process that started them). */
#ifndef FY_TEST_CHILD_H
#define FY_TEST_CHILD_H

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define TEST_CHILD_SKIP 77

typedef struct test_child {
    pid_t pid;
    int fd;            /* the read end of its stderr; -1 at its end of file */
    bool ended;
    int code;          /* its exit status, or -1 if a signal ended it */
    int sig;           /* the signal that ended it, or 0 */
    bool hung;         /* still running at the deadline, so killed (SIGKILL) */
    double wall_s;     /* from its start to its end */
    double t0;
    char err[16384];   /* its stderr, NUL-terminated (the first 16 KiB) */
    size_t nerr;
} test_child;

static inline double test_child_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Forks a child running body(arg) with its stderr into a pipe. */
static inline void test_child_start(test_child *c, int (*body)(void *), void *arg) {
    memset(c, 0, sizeof *c);
    int p[2];
    cr_assert_eq(pipe(p), 0, "pipe: %s", strerror(errno));
    fflush(NULL);
    c->t0 = test_child_now();
    c->pid = fork();
    cr_assert_neq(c->pid, -1, "fork: %s", strerror(errno));
    if (c->pid == 0) {
        signal(SIGABRT, SIG_DFL);
        signal(SIGSEGV, SIG_DFL);
        close(p[0]);
        dup2(p[1], 2);
        close(p[1]);
        const int r = body(arg);
        fflush(NULL);
        _exit(r);
    }
    close(p[1]);
    c->fd = p[0];
    fcntl(c->fd, F_SETFL, O_NONBLOCK);
}

/* Reads what c's stderr has now; closes it at its end of file. */
static inline void test_child_read(test_child *c) {
    while (c->fd >= 0) {
        char buf[4096];
        const ssize_t n = read(c->fd, buf, sizeof buf);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return; /* nothing more for now */
        if (n == 0) {
            close(c->fd);
            c->fd = -1;
            return;
        }
        const size_t room = sizeof c->err - 1 - c->nerr, k = (size_t)n < room ? (size_t)n : room;
        memcpy(c->err + c->nerr, buf, k);
        c->nerr += k;
        c->err[c->nerr] = 0;
    }
}

/* Waits for the n children to end, killing those still running timeout_s after the call
 * (hung), and reads their stderr: to its end, or for at most 2 s after a child ended (a
 * process it started may still hold the pipe). */
static inline void test_child_wait(test_child *c, int n, double timeout_s) {
    const double deadline = test_child_now() + timeout_s;
    double all_ended_at = 0;
    for (;;) {
        struct pollfd pf[8];
        int np = 0;
        bool open = false, running = false;
        for (int i = 0; i < n; i++) {
            test_child_read(&c[i]);
            if (c[i].fd >= 0 && np < 8) {
                pf[np++] = (struct pollfd){.fd = c[i].fd, .events = POLLIN};
                open = true;
            }
            int st;
            if (!c[i].ended && waitpid(c[i].pid, &st, WNOHANG) == c[i].pid) {
                c[i].ended = true;
                c[i].wall_s = test_child_now() - c[i].t0;
                c[i].code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
                c[i].sig = WIFSIGNALED(st) ? WTERMSIG(st) : 0;
            }
            running |= !c[i].ended;
        }
        const double now = test_child_now();
        if (!running && !all_ended_at) all_ended_at = now;
        if (!running && (!open || now - all_ended_at > 2.0)) break;
        if (running && now > deadline)
            for (int i = 0; i < n; i++)
                if (!c[i].ended && !c[i].hung) {
                    c[i].hung = true;
                    kill(c[i].pid, SIGKILL);
                }
        poll(pf, (nfds_t)np, 10);
    }
    for (int i = 0; i < n; i++)
        if (c[i].fd >= 0) {
            close(c[i].fd);
            c[i].fd = -1;
        }
}

/* Skips the calling test if a child asked to (its stderr says why). */
static inline void test_child_skip_if_asked(const test_child *c) {
    if (!c->hung && c->code == TEST_CHILD_SKIP) cr_skip_test("%s", c->err);
}

/* The first line of c's stderr that starts with prefix (without its newline, in a static
 * buffer), or NULL. */
static inline const char *test_child_line(const test_child *c, const char *prefix) {
    static char line[2048];
    for (const char *l = c->err; *l;) {
        const char *nl = strchr(l, '\n');
        const size_t len = nl ? (size_t)(nl - l) : strlen(l);
        if (!strncmp(l, prefix, strlen(prefix))) {
            snprintf(line, sizeof line, "%.*s", (int)len, l);
            return line;
        }
        l += len + (nl ? 1 : 0);
    }
    return NULL;
}

#endif
