/* nccl_standin.c — the test-only stand-in of emu_rt.h (nccl_standin.h). */
#include "tests/cuda_emu/runtime/nccl_standin.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define DEV_CAPACITY ((size_t)80 << 30)
#define ALLOCS_MAX 64

static struct {
    char *p;
    size_t nbytes;
    bool live;
} allocs[ALLOCS_MAX];
static int nallocs;

/* The queue: a singly linked list the worker pops in order. */
typedef struct work {
    struct work *next;
    fy_emu_dev_fn fn;
    unsigned char args[FY_EMU_ARGS_MAX];
} work;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static work *head, *tail;
static bool busy, started;
static cudaError_t first_error = cudaSuccess;
static size_t taken;
static char reports[16384];
static __thread bool on_worker;

void *standin_dev_alloc(size_t nbytes) {
    void *p = mmap(NULL, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED || nallocs == ALLOCS_MAX) abort();
    allocs[nallocs].p = p;
    allocs[nallocs].nbytes = nbytes;
    allocs[nallocs++].live = true;
    return p;
}

void standin_dev_free(void *p) {
    for (int i = 0; i < nallocs; i++)
        if (allocs[i].p == p) allocs[i].live = false;
}

fy_emu_mem fy_emu_mem_of(const void *p, size_t nbytes) {
    const char *c = (const char *)p;
    for (int i = 0; i < nallocs; i++) {
        const char *a = allocs[i].p, *e = a + allocs[i].nbytes;
        if (c >= a && c < e)
            return allocs[i].live && nbytes <= (size_t)(e - c) ? FY_EMU_DEVICE : FY_EMU_INVALID;
    }
    return FY_EMU_PAGEABLE;
}

static void *worker(void *unused) {
    (void)unused;
    on_worker = true;
    pthread_mutex_lock(&mu);
    for (;;) {
        while (!head) pthread_cond_wait(&cv, &mu);
        work *w = head;
        busy = true;
        bool dead = first_error != cudaSuccess; /* a failed device runs nothing more */
        pthread_mutex_unlock(&mu);
        cudaError_t e = dead ? cudaSuccess : w->fn(w->args);
        pthread_mutex_lock(&mu);
        if (e != cudaSuccess && first_error == cudaSuccess) first_error = e;
        head = w->next;
        if (!head) tail = NULL;
        busy = false;
        free(w);
        pthread_cond_broadcast(&cv);
    }
    return NULL;
}

cudaError_t fy_emu_enqueue(cudaStream_t s, fy_emu_dev_fn fn, const void *args, size_t nbytes,
                           const char *what) {
    (void)s;
    (void)what;
    if (nbytes > FY_EMU_ARGS_MAX) abort();
    work *w = calloc(1, sizeof *w);
    if (!w) abort();
    w->fn = fn;
    memcpy(w->args, args, nbytes);
    pthread_mutex_lock(&mu);
    cudaError_t e = first_error;
    if (e == cudaSuccess) {
        if (!started) {
            pthread_t t;
            if (pthread_create(&t, NULL, worker, NULL)) abort();
            pthread_detach(t);
            started = true;
        }
        if (tail) tail->next = w;
        else head = w;
        tail = w;
        pthread_cond_broadcast(&cv);
    } else {
        free(w);
    }
    pthread_mutex_unlock(&mu);
    return e;
}

cudaError_t standin_sync(void) {
    pthread_mutex_lock(&mu);
    while (head || busy) pthread_cond_wait(&cv, &mu);
    cudaError_t e = first_error;
    pthread_mutex_unlock(&mu);
    return e;
}

cudaError_t fy_emu_take(size_t nbytes) {
    pthread_mutex_lock(&mu);
    bool fits = nbytes <= DEV_CAPACITY - taken;
    if (fits) taken += nbytes;
    pthread_mutex_unlock(&mu);
    return fits ? cudaSuccess : cudaErrorMemoryAllocation;
}

void fy_emu_give(size_t nbytes) {
    pthread_mutex_lock(&mu);
    taken -= nbytes;
    pthread_mutex_unlock(&mu);
}

size_t standin_taken(void) { return taken; }

void fy_emu_report(const char *fmt, ...) {
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    fprintf(stderr, "cuda emulation: %s\n", line);
    pthread_mutex_lock(&mu);
    size_t n = strlen(reports);
    snprintf(reports + n, sizeof reports - n, "%s\n", line);
    pthread_mutex_unlock(&mu);
}

const char *standin_reports(void) { return reports; }

bool fy_emu_on_device(void) { return on_worker; }
