/* cudart_emu_proc.cc — the emulated devices' processes (cudart_emu.h).
 *
 * The first runtime call of a process (emu_init, once) reads the emulation's settings,
 * reserves each device's address range (PROT_NONE, never mapped in the host: host code
 * that touches device memory faults), maps the pinned arena (a sparse memfd, shared, at
 * one address in every process) and the control memory (the allocation tables, the
 * accounting and the sticky errors), and forks one process per device. A device process
 * maps its device's allocations as the host makes them (control requests) and runs the
 * work of each stream on a thread of its own, one item at a time, answering each with
 * its cudaError_t.
 *
 * The fork happens on a keeper thread that lives as long as the host process and waits
 * for its device process: the device process asks for SIGKILL when that thread ends
 * (PR_SET_PDEATHSIG is per thread, and the first CUDA call may come from a thread that
 * ends early) and also ends when its channels close. The device process never returns
 * into the host's code: it calls no MPI, runs no atexit handler (_exit) and reports
 * through write(2) (another host thread may have held stdio's lock at the fork).
 *
 * Faults: a device process catches SIGSEGV and SIGBUS (on an alternate stack: a fiber's
 * stack overflow faults too). Inside device work, that is an illegal memory access by
 * the work named in its message: the device's sticky error becomes
 * cudaErrorIllegalAddress and the process ends; any other end of the process (an abort
 * of the kernel emulation, a crash) is cudaErrorLaunchFailure, reported once. The host
 * sees it at its next call (the control memory) or as the end of a channel. */
#include "tests/cuda_emu/runtime/cudart_emu.h"

#include <errno.h>
#include <fcntl.h>
#include <link.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

emu_state g_emu;

#define EMU_DEFAULT_GPU_MEM ((size_t)8 << 30)
#define EMU_PINNED_NBYTES ((size_t)64 << 30) /* the pinned arena's address range (sparse) */
#define EMU_ALTSTACK_NBYTES ((size_t)64 << 10)

static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static cudaError_t init_error = cudaErrorInitializationError;
static bool on_device;         /* this process is a device process */
static int device_index = -1;  /* which */
static thread_local const char *tl_work; /* the device work running on this thread */

/* ---- reports ---------------------------------------------------------------------------- */

void fy_emu_report(const char *fmt, ...) {
    char line[512];
    int n = snprintf(line, sizeof line, "cuda emulation: ");
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    va_end(ap);
    n += m < 0 ? 0 : m > (int)(sizeof line) - n - 2 ? (int)(sizeof line) - n - 2 : m;
    line[n++] = '\n';
    for (int off = 0; off < n;) { /* one write: lines of several processes do not mix */
        ssize_t w = write(2, line + off, (size_t)(n - off));
        if (w <= 0 && errno != EINTR) break;
        if (w > 0) off += (int)w;
    }
}

bool fy_emu_on_device(void) { return on_device; }

int emu_device_index(void) { return device_index; }

cudaError_t emu_sticky(int d) { return (cudaError_t)g_emu.sh->gpu[d].sticky.load(); }

void emu_fail(int d, cudaError_t e, const char *why) {
    int none = cudaSuccess;
    if (g_emu.sh->gpu[d].sticky.compare_exchange_strong(none, (int)e)) fy_emu_report("%s", why);
}

/* ---- the shared lock -------------------------------------------------------------------- */

void emu_lock(void) {
    int r = pthread_mutex_lock(&g_emu.sh->mu);
    if (r == EOWNERDEAD) pthread_mutex_consistent(&g_emu.sh->mu);
    else if (r != 0) abort();
}

void emu_unlock(void) { pthread_mutex_unlock(&g_emu.sh->mu); }

/* ---- code the device processes have ------------------------------------------------------ */

#define MAX_CODE_RANGES 512
static struct { uintptr_t lo, hi; } code_ranges[MAX_CODE_RANGES];
static int ncode_ranges;

static int note_code(struct dl_phdr_info *info, size_t size, void *arg) {
    for (int i = 0; i < info->dlpi_phnum && ncode_ranges < MAX_CODE_RANGES; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        if (ph->p_type != PT_LOAD || !(ph->p_flags & PF_X)) continue;
        uintptr_t lo = info->dlpi_addr + ph->p_vaddr;
        code_ranges[ncode_ranges].lo = lo;
        code_ranges[ncode_ranges++].hi = lo + ph->p_memsz;
    }
    return 0;
}

bool emu_code_on_device(const void *fn) {
    for (int i = 0; i < ncode_ranges; i++)
        if ((uintptr_t)fn >= code_ranges[i].lo && (uintptr_t)fn < code_ranges[i].hi) return true;
    return false;
}

/* ---- the device process ------------------------------------------------------------------- */

enum { CTL_MAP, CTL_UNMAP, CTL_STREAM };
typedef struct ctl_req {
    int op;
    uintptr_t lo;
    size_t nbytes;
} ctl_req;

static bool is_sticky(cudaError_t e) {
    return e == cudaErrorIllegalAddress || e == cudaErrorLaunchFailure ||
           e == cudaErrorIllegalInstruction || e == cudaErrorMisalignedAddress ||
           e == cudaErrorHardwareStackError || e == cudaErrorAssert;
}

static void on_fault(int sig, siginfo_t *si, void *uc) {
    char why[256];
    const char *w = tl_work;
    if (w && (sig == SIGSEGV || sig == SIGBUS)) {
        snprintf(why, sizeof why, "an illegal memory access by %s at %p", w, si->si_addr);
        emu_fail(device_index, cudaErrorIllegalAddress, why);
    } else {
        snprintf(why, sizeof why, "the process of GPU %d stopped (signal %d%s%s): a launch failure",
                 device_index, sig, w ? ", running " : "", w ? w : "");
        emu_fail(device_index, cudaErrorLaunchFailure, why);
    }
    _exit(3);
}

/* The calling thread's signal stack (a fault's handler runs on it); returns it, for
 * alt_stack_free when the thread ends. */
static void *alt_stack(void) {
    stack_t ss;
    ss.ss_sp = mmap(NULL, EMU_ALTSTACK_NBYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (ss.ss_sp == MAP_FAILED) _exit(4);
    ss.ss_size = EMU_ALTSTACK_NBYTES;
    ss.ss_flags = 0;
    sigaltstack(&ss, NULL);
    return ss.ss_sp;
}

static void alt_stack_free(void *sp) {
    stack_t off;
    memset(&off, 0, sizeof off);
    off.ss_flags = SS_DISABLE;
    sigaltstack(&off, NULL);
    munmap(sp, EMU_ALTSTACK_NBYTES);
}

/* With the race check (FERRY_EMU_RACECHECK), device work runs one item at a time: a
 * kernel runs three times from the device memory as it was before, which work of other
 * streams running meanwhile would change (and be undone by). */
static pthread_mutex_t racecheck_mu = PTHREAD_MUTEX_INITIALIZER;

static void *serve_stream(void *arg) {
    const int fd = (int)(intptr_t)arg;
    void *sp = alt_stack();
    alignas(16) static thread_local char buf[sizeof(emu_msg) + FY_EMU_ARGS_MAX];
    for (;;) {
        ssize_t n = recv(fd, buf, sizeof buf, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n < (ssize_t)sizeof(emu_msg)) break; /* the stream is gone (or the host) */
        const emu_msg *m = (const emu_msg *)buf;
        cudaError_t r = emu_sticky(device_index);
        if (r == cudaSuccess) {
            if (g_emu.racecheck) pthread_mutex_lock(&racecheck_mu);
            tl_work = m->what;
            r = m->fn(buf + sizeof(emu_msg));
            tl_work = NULL;
            if (g_emu.racecheck) pthread_mutex_unlock(&racecheck_mu);
            if (is_sticky(r)) {
                char why[sizeof m->what + 64];
                snprintf(why, sizeof why, "%.63s failed on the device: error %d", m->what, (int)r);
                emu_fail(device_index, r, why);
            }
        }
        int32_t reply = (int32_t)r;
        if (send(fd, &reply, sizeof reply, MSG_NOSIGNAL) != sizeof reply) break;
    }
    close(fd);
    alt_stack_free(sp);
    return NULL;
}

static int32_t serve_ctl(int ctl, const ctl_req *q, int fd) {
    switch (q->op) {
    case CTL_MAP:
        if (mprotect((void *)q->lo, q->nbytes, PROT_READ | PROT_WRITE)) return cudaErrorMemoryAllocation;
        /* a GPU's new allocation holds whatever was there before (fresh pages here would
         * be zeros, and hide a missing memset): every byte 0xff, NaN in fp32 and bf16 */
        memset((void *)q->lo, 0xff, q->nbytes);
        return cudaSuccess;
    case CTL_UNMAP:
        madvise((void *)q->lo, q->nbytes, MADV_DONTNEED);
        return mprotect((void *)q->lo, q->nbytes, PROT_NONE) ? cudaErrorInvalidValue : cudaSuccess;
    case CTL_STREAM: {
        pthread_t t;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        int r = fd >= 0 ? pthread_create(&t, &at, serve_stream, (void *)(intptr_t)fd) : EINVAL;
        pthread_attr_destroy(&at);
        return r ? cudaErrorMemoryAllocation : cudaSuccess;
    }
    }
    return cudaErrorInvalidValue;
}

[[noreturn]] static void device_main(int d, int ctl) {
    on_device = true;
    device_index = d;
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != g_emu.pid) _exit(0); /* the host ended before the line above */
    for (int k = 0; k <= d; k++) close(g_emu.gpu[k].ctl); /* the host's ends */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    const int sigs[] = {SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL};
    for (int s : sigs) sigaction(s, &sa, NULL);
    (void)alt_stack(); /* the serving thread's, for the process's life */
    for (;;) {
        ctl_req q;
        char cbuf[CMSG_SPACE(sizeof(int))];
        struct iovec iov = {&q, sizeof q};
        struct msghdr mh;
        memset(&mh, 0, sizeof mh);
        mh.msg_iov = &iov;
        mh.msg_iovlen = 1;
        mh.msg_control = cbuf;
        mh.msg_controllen = sizeof cbuf;
        ssize_t n = recvmsg(ctl, &mh, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n != (ssize_t)sizeof q) _exit(0); /* the host is gone */
        int fd = -1;
        struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
        if (c && c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) memcpy(&fd, CMSG_DATA(c), sizeof fd);
        int32_t reply = serve_ctl(ctl, &q, fd);
        if (send(ctl, &reply, sizeof reply, MSG_NOSIGNAL) != sizeof reply) _exit(0);
    }
}

/* ---- control requests --------------------------------------------------------------------- */

static cudaError_t ctl_request(int d, const ctl_req *q, int fd) {
    emu_gpu *g = &g_emu.gpu[d];
    char cbuf[CMSG_SPACE(sizeof(int))];
    struct iovec iov = {(void *)q, sizeof *q};
    struct msghdr mh;
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    if (fd >= 0) {
        memset(cbuf, 0, sizeof cbuf);
        mh.msg_control = cbuf;
        mh.msg_controllen = sizeof cbuf;
        struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &fd, sizeof fd);
    }
    int32_t reply = cudaErrorLaunchFailure;
    pthread_mutex_lock(&g->ctl_mu);
    bool ok = sendmsg(g->ctl, &mh, MSG_NOSIGNAL) == (ssize_t)sizeof *q;
    while (ok) {
        ssize_t n = recv(g->ctl, &reply, sizeof reply, 0);
        if (n < 0 && errno == EINTR) continue;
        ok = n == (ssize_t)sizeof reply;
        break;
    }
    pthread_mutex_unlock(&g->ctl_mu);
    if (!ok) {
        char why[96];
        snprintf(why, sizeof why, "the process of GPU %d is gone", d);
        emu_fail(d, cudaErrorLaunchFailure, why);
        return emu_sticky(d);
    }
    return (cudaError_t)reply;
}

cudaError_t emu_ctl_map(int d, uintptr_t lo, size_t nbytes) {
    ctl_req q = {CTL_MAP, lo, nbytes};
    return ctl_request(d, &q, -1);
}

cudaError_t emu_ctl_unmap(int d, uintptr_t lo, size_t nbytes) {
    ctl_req q = {CTL_UNMAP, lo, nbytes};
    return ctl_request(d, &q, -1);
}

cudaError_t emu_ctl_stream(int d, int fd) {
    ctl_req q = {CTL_STREAM, 0, 0};
    return ctl_request(d, &q, fd);
}

/* ---- starting ------------------------------------------------------------------------------ */

/* The keeper of device d: forks its process, then waits for it; an end while the host
 * runs is a crash, the device's sticky error. */
typedef struct keeper_arg {
    int d, child_fd;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int forked;                /* 1 forked, -1 failed */
} keeper_arg;

static void *keeper(void *p) {
    keeper_arg *k = (keeper_arg *)p;
    const int d = k->d;
    pid_t pid = fork();
    if (pid == 0) device_main(d, k->child_fd);
    pthread_mutex_lock(&k->mu);
    g_emu.gpu[d].pid = pid;
    k->forked = pid > 0 ? 1 : -1;
    pthread_cond_signal(&k->cv);
    pthread_mutex_unlock(&k->mu); /* k is the starter's: not touched past here */
    if (pid < 0) return NULL;
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
    char why[128];
    if (WIFSIGNALED(status))
        snprintf(why, sizeof why, "the process of GPU %d was killed by signal %d", d, WTERMSIG(status));
    else
        snprintf(why, sizeof why, "the process of GPU %d ended (status %d)", d, WEXITSTATUS(status));
    emu_fail(d, cudaErrorLaunchFailure, why);
    return NULL;
}

static bool start_device(int d) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv)) return false;
    g_emu.gpu[d].ctl = sv[0];
    pthread_mutex_init(&g_emu.gpu[d].ctl_mu, NULL);
    pthread_mutex_init(&g_emu.gpu[d].mu, NULL);
    keeper_arg k;
    k.d = d;
    k.child_fd = sv[1];
    k.forked = 0;
    pthread_mutex_init(&k.mu, NULL);
    pthread_cond_init(&k.cv, NULL);
    pthread_t t;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    bool ok = pthread_create(&t, &at, keeper, &k) == 0;
    pthread_attr_destroy(&at);
    pthread_mutex_lock(&k.mu);
    while (ok && k.forked == 0) pthread_cond_wait(&k.cv, &k.mu);
    pthread_mutex_unlock(&k.mu);
    close(sv[1]);
    return ok && k.forked == 1;
}

/* "8G", "512M", "4096K", "1T" or bytes. */
static bool parse_size(const char *s, size_t *out) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || v == 0) return false;
    int shift = 0;
    switch (*end) {
    case 'K': case 'k': shift = 10; end++; break;
    case 'M': case 'm': shift = 20; end++; break;
    case 'G': case 'g': shift = 30; end++; break;
    case 'T': case 't': shift = 40; end++; break;
    }
    if (*end || v > (~0ull >> shift)) return false;
    *out = (size_t)(v << shift);
    return true;
}

static bool parse_int(const char *s, long lo, long hi, long *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return false;
    *out = v;
    return true;
}

static cudaError_t read_settings(void) {
    const char *s;
    long v;
    g_emu.ngpus = 1;
    if ((s = getenv("FERRY_EMU_GPUS"))) {
        if (!parse_int(s, 1, EMU_MAX_GPUS, &v)) {
            fy_emu_report("FERRY_EMU_GPUS=%s: not a number of GPUs from 1 to %d", s, EMU_MAX_GPUS);
            return cudaErrorInitializationError;
        }
        g_emu.ngpus = (int)v;
    }
    g_emu.capacity = EMU_DEFAULT_GPU_MEM;
    if ((s = getenv("FERRY_EMU_GPU_MEM")) && (!parse_size(s, &g_emu.capacity) || g_emu.capacity < EMU_GRANULE)) {
        fy_emu_report("FERRY_EMU_GPU_MEM=%s: not a size of 2M or more (like 4G)", s);
        return cudaErrorInitializationError;
    }
    g_emu.capacity = (g_emu.capacity + EMU_GRANULE - 1) / EMU_GRANULE * EMU_GRANULE;
    g_emu.strict = !((s = getenv("FERRY_EMU_STRICT")) && !strcmp(s, "0"));
    g_emu.racecheck = (s = getenv("FERRY_EMU_RACECHECK")) && !strcmp(s, "1");
    g_emu.driver_version = CUDART_VERSION;
    if ((s = getenv("FERRY_EMU_DRIVER_VERSION"))) {
        if (!parse_int(s, 1000, 99990, &v)) {
            fy_emu_report("FERRY_EMU_DRIVER_VERSION=%s: not a CUDA version like 12080", s);
            return cudaErrorInitializationError;
        }
        g_emu.driver_version = (int)v;
    }
    return cudaSuccess;
}

/* The address range of device d: four times its capacity (every allocation is followed
 * by a guard of at least one granule, and free ranges fragment), granule-aligned. */
static bool reserve_device(int d) {
    const size_t span = 4 * g_emu.capacity;
    void *p = mmap(NULL, span + EMU_GRANULE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return false;
    uintptr_t lo = ((uintptr_t)p + EMU_GRANULE - 1) & ~(uintptr_t)(EMU_GRANULE - 1);
    g_emu.gpu[d].lo = lo;
    g_emu.gpu[d].hi = lo + span;
    return true;
}

static bool map_shared(void) {
    void *p = mmap(NULL, sizeof(emu_shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return false;
    g_emu.sh = (emu_shared *)p;
    pthread_mutexattr_t ma;
    pthread_mutexattr_init(&ma);
    pthread_mutexattr_setpshared(&ma, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&ma, PTHREAD_MUTEX_ROBUST);
    pthread_mutex_init(&g_emu.sh->mu, &ma);
    pthread_mutexattr_destroy(&ma);
    int fd = memfd_create("ferry-emu-pinned", MFD_CLOEXEC);
    if (fd < 0) return false;
    bool ok = ftruncate(fd, (off_t)EMU_PINNED_NBYTES) == 0;
    p = ok ? mmap(NULL, EMU_PINNED_NBYTES, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0) : MAP_FAILED;
    close(fd); /* the mapping keeps the memory */
    if (p == MAP_FAILED) return false;
    g_emu.pinned = (char *)p;
    g_emu.pinned_nbytes = EMU_PINNED_NBYTES;
    return true;
}

static void init(void) {
    g_emu.pid = getpid();
    if ((init_error = read_settings()) != cudaSuccess) return;
    if (g_emu.driver_version / 1000 < CUDART_VERSION / 1000) {
        init_error = cudaErrorInsufficientDriver; /* minor versions are compatible */
        return;
    }
    init_error = cudaErrorInitializationError;
    if (!map_shared()) {
        fy_emu_report("cannot map the control memory or the pinned arena: %s", strerror(errno));
        return;
    }
    for (int d = 0; d < g_emu.ngpus; d++)
        if (!reserve_device(d)) {
            fy_emu_report("cannot reserve %zu GiB of addresses for GPU %d", 4 * g_emu.capacity >> 30, d);
            return;
        }
    dl_iterate_phdr(note_code, NULL);
    for (int d = 0; d < g_emu.ngpus; d++)
        if (!start_device(d)) {
            fy_emu_report("cannot start the process of GPU %d: %s", d, strerror(errno));
            return;
        }
    init_error = cudaSuccess;
}

cudaError_t emu_init(void) {
    if (on_device) return cudaSuccess; /* started: the host did it before the fork */
    pthread_once(&init_once, init);
    if (init_error == cudaSuccess && getpid() != g_emu.pid) {
        fy_emu_report("a CUDA call in a child of the process that started CUDA (fork): not supported");
        return cudaErrorInitializationError;
    }
    return init_error;
}
