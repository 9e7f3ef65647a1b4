/* adam_pool.c — the pinned worker pool, tile scheduling and first-touch allocation.
 *
 * Workers run one job per generation; between jobs they poll (yielding) for 200 us and
 * then sleep on a condition variable; the caller sleeps until the last worker reports.
 * A step job gives thread t the contiguous run of work units [t*U/T, (t+1)*U/T)
 * (U units, T threads); each run has an atomic cursor, so
 * a thread that is done claims units from the runs of threads on its NUMA node. Units
 * are FY_ADAM_TILE_NELEM elements, or, for ranges too small to give every thread a
 * tile, an equal share rounded up to 64 elements (so every unit but the last starts
 * 64-byte aligned when the range does).
 *
 * With check_finite, a first job scans every gradient of the call and a second one
 * updates only when none was non-finite: nothing is written otherwise. */
#include "optim_cpu/adam_pool.h"
#include "optim_cpu/adam_impl.h"
#include "engine/core/util.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#ifdef FY_HAVE_NUMA
#include <numa.h>
#endif

#define HUGE_NBYTES ((size_t)2 << 20)

typedef struct cursor {
    _Alignas(64) atomic_size_t next; /* next unit to claim in this run */
    size_t end;
} cursor;

typedef struct worker {
    struct fy_adam_pool *pool;
    pthread_t thread;
    int index, cpu, node;
} worker;

struct fy_adam_pool {
    int nthreads;
    worker *workers;   /* (nthreads) */
    cursor *cursors;   /* (nthreads), one per thread's run of units */
    pthread_mutex_t submit; /* serialises callers */
    pthread_mutex_t mu;     /* guards the sleeps on wake and done */
    pthread_cond_t wake, done;
    atomic_uint_fast64_t gen; /* bumped (release) for each job, after fn and ctx are set */
    atomic_int pending;       /* workers still running the current job */
    atomic_bool quit;
    fy_adam_pool_fn fn;
    void *ctx;
};

/* How long a worker keeps polling for the next job before it sleeps. A sleeping vCPU
 * takes tens of microseconds to wake; a scheduler that hands out tiles back to back
 * finds the workers still polling (they yield the CPU while they poll, so a thread that
 * has work, the caller included, is not held up). */
#define SPIN_NS 200000.0

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

/* The next job's generation (!= seen), or seen once quit is set. */
static uint64_t wait_job(fy_adam_pool *pool, uint64_t seen) {
    uint64_t g;
    double start = now_ns();
    while ((g = atomic_load_explicit(&pool->gen, memory_order_acquire)) == seen &&
           !atomic_load_explicit(&pool->quit, memory_order_acquire)) {
        if (now_ns() - start > SPIN_NS) {
            pthread_mutex_lock(&pool->mu);
            while ((g = atomic_load_explicit(&pool->gen, memory_order_acquire)) == seen &&
                   !atomic_load(&pool->quit))
                pthread_cond_wait(&pool->wake, &pool->mu);
            pthread_mutex_unlock(&pool->mu);
            break;
        }
        sched_yield();
    }
    return g;
}

static void *worker_main(void *arg) {
    worker *w = arg;
    fy_adam_pool *pool = w->pool;
    uint64_t seen = 0;
    for (;;) {
        uint64_t g = wait_job(pool, seen);
        if (g == seen) break; /* quit */
        seen = g;
        pool->fn(pool->ctx, w->index, pool->nthreads);
        if (atomic_fetch_sub_explicit(&pool->pending, 1, memory_order_acq_rel) == 1) {
            pthread_mutex_lock(&pool->mu);
            pthread_cond_signal(&pool->done);
            pthread_mutex_unlock(&pool->mu);
        }
    }
    return NULL;
}

void fy_adam_pool_run(fy_adam_pool *pool, fy_adam_pool_fn fn, void *ctx) {
    pthread_mutex_lock(&pool->submit);
    pool->fn = fn;
    pool->ctx = ctx;
    atomic_store_explicit(&pool->pending, pool->nthreads, memory_order_relaxed);
    pthread_mutex_lock(&pool->mu); /* a worker deciding to sleep holds mu: no lost wakeup */
    atomic_fetch_add_explicit(&pool->gen, 1, memory_order_release);
    pthread_cond_broadcast(&pool->wake);
    /* The caller sleeps rather than polls: it is not pinned and would take CPU time
     * from a worker on its core (measured: 40% slower tile-by-tile steps). */
    while (atomic_load_explicit(&pool->pending, memory_order_acquire) > 0)
        pthread_cond_wait(&pool->done, &pool->mu);
    pthread_mutex_unlock(&pool->mu);
    pthread_mutex_unlock(&pool->submit);
}

/* The CPUs the caller may run on, in increasing order; returns their count. */
static int allowed_cpus(int *cpus, int cap) {
    cpu_set_t set;
    int n = 0;
    if (sched_getaffinity(0, sizeof set, &set) != 0) return 0;
    for (int c = 0; c < CPU_SETSIZE && n < cap; c++)
        if (CPU_ISSET(c, &set)) cpus[n++] = c;
    return n;
}

static int node_of_cpu(int cpu) {
#ifdef FY_HAVE_NUMA
    if (cpu >= 0 && numa_available() >= 0) {
        int node = numa_node_of_cpu(cpu);
        return node >= 0 ? node : 0;
    }
#endif
    (void)cpu;
    return 0;
}

fy_status fy_adam_pool_new(int threads, fy_adam_pool **out) {
    int cpus[CPU_SETSIZE];
    int ncpu = allowed_cpus(cpus, CPU_SETSIZE);
    if (threads <= 0) threads = ncpu > 0 ? ncpu : 1;
    if (threads > 4096) {
        fy_log_error("adam pool: %d threads is too many", threads);
        return FY_ERR_INVALID;
    }
    fy_adam_pool *pool = calloc(1, sizeof *pool);
    if (!pool) goto nomem;
    pool->workers = calloc((size_t)threads, sizeof *pool->workers);
    pool->cursors = aligned_alloc(64, fy_round_up((size_t)threads * sizeof(cursor), 64));
    if (!pool->workers || !pool->cursors) goto nomem;
    pthread_mutex_init(&pool->submit, NULL);
    pthread_mutex_init(&pool->mu, NULL);
    pthread_cond_init(&pool->wake, NULL);
    pthread_cond_init(&pool->done, NULL);
    atomic_init(&pool->gen, 0);
    atomic_init(&pool->pending, 0);
    atomic_init(&pool->quit, false);
    bool pin_failed = false;
    for (int t = 0; t < threads; t++) {
        worker *w = &pool->workers[t];
        w->pool = pool;
        w->index = t;
        w->cpu = ncpu > 0 ? cpus[t % ncpu] : -1;
        w->node = node_of_cpu(w->cpu);
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        if (w->cpu >= 0) {
            cpu_set_t set;
            CPU_ZERO(&set);
            CPU_SET(w->cpu, &set);
            if (pthread_attr_setaffinity_np(&attr, sizeof set, &set) != 0) {
                pin_failed = true;
                w->cpu = -1;
            }
        }
        int rc = pthread_create(&w->thread, &attr, worker_main, w);
        pthread_attr_destroy(&attr);
        if (rc != 0) {
            fy_log_error("adam pool: cannot start thread %d of %d", t + 1, threads);
            pool->nthreads = t;
            fy_adam_pool_free(pool);
            return FY_ERR_NOMEM;
        }
        pool->nthreads = t + 1;
    }
    if (pin_failed) fy_log_warn("adam pool: could not pin every thread; running unpinned");
    *out = pool;
    return FY_OK;
nomem:
    if (pool) {
        free(pool->workers);
        free(pool->cursors);
        free(pool);
    }
    fy_log_error("adam pool: out of memory for %d threads", threads);
    return FY_ERR_NOMEM;
}

void fy_adam_pool_free(fy_adam_pool *pool) {
    if (!pool) return;
    pthread_mutex_lock(&pool->mu);
    atomic_store(&pool->quit, true);
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->mu);
    for (int t = 0; t < pool->nthreads; t++) pthread_join(pool->workers[t].thread, NULL);
    pthread_cond_destroy(&pool->wake);
    pthread_cond_destroy(&pool->done);
    pthread_mutex_destroy(&pool->mu);
    pthread_mutex_destroy(&pool->submit);
    free(pool->workers);
    free(pool->cursors);
    free(pool);
}

int fy_adam_pool_threads(const fy_adam_pool *pool) { return pool->nthreads; }

int fy_adam_pool_cpu(const fy_adam_pool *pool, int t) {
    FY_ASSERT(t >= 0 && t < pool->nthreads, "worker index out of range");
    return pool->workers[t].cpu;
}

/* ---- steps ---------------------------------------------------------------------- */

typedef struct step_job {
    fy_adam_pool *pool;
    const fy_adam_range *r;
    const fy_adam_consts *c;
    fy_adam_kernel_fn kernel;
    fy_adam_scan_fn scan; /* set for the scan job, NULL for the update job */
    size_t unit;          /* elements per unit of work */
    atomic_bool nonfinite;
} step_job;

static void do_unit(step_job *job, size_t u) {
    size_t lo = u * job->unit, hi = lo + job->unit < job->r->n ? lo + job->unit : job->r->n;
    if (!job->scan) {
        job->kernel(job->c, job->r, lo, hi);
    } else if (!atomic_load_explicit(&job->nonfinite, memory_order_relaxed) &&
               !job->scan(job->c->grad_scale, job->r->grad, job->r->grad_dtype, lo, hi)) {
        atomic_store(&job->nonfinite, true);
    }
}

static void drain(step_job *job, cursor *cur) {
    for (;;) {
        size_t u = atomic_fetch_add_explicit(&cur->next, 1, memory_order_relaxed);
        if (u >= cur->end) return;
        do_unit(job, u);
    }
}

static void step_worker(void *ctx, int t, int nthreads) {
    step_job *job = ctx;
    fy_adam_pool *pool = job->pool;
    drain(job, &pool->cursors[t]);
    for (int k = 1; k < nthreads; k++) {
        int v = (t + k) % nthreads;
        if (pool->workers[v].node == pool->workers[t].node) drain(job, &pool->cursors[v]);
    }
}

static void run_step_job(fy_adam_pool *pool, step_job *job) {
    int T = pool->nthreads;
    size_t units = (job->r->n + job->unit - 1) / job->unit;
    for (int t = 0; t < T; t++) {
        atomic_store_explicit(&pool->cursors[t].next, units * (size_t)t / (size_t)T,
                              memory_order_relaxed);
        pool->cursors[t].end = units * (size_t)(t + 1) / (size_t)T;
    }
    fy_adam_pool_run(pool, step_worker, job); /* the job's release publishes the cursors */
}

fy_status fy_adam_pool_step_path(fy_adam_pool *pool, fy_adam_path p, const fy_adam_hparams *hp,
                                 const fy_adam_range *r) {
    fy_adam_kernel_fn kernel;
    fy_adam_scan_fn scan;
    FY_TRY(fy_adam_path_ready(p, r, &kernel, &scan));
    if (r->n == 0) return FY_OK;
    fy_adam_consts c;
    fy_adam_consts_init(hp, r->decay, &c);
    size_t T = (size_t)pool->nthreads;
    size_t share = fy_round_up((r->n + T - 1) / T, 64);
    step_job job = {.pool = pool, .r = r, .c = &c, .kernel = kernel,
                    .unit = share < FY_ADAM_TILE_NELEM ? share : FY_ADAM_TILE_NELEM};
    atomic_init(&job.nonfinite, false);
    if (hp->check_finite) {
        job.scan = scan;
        run_step_job(pool, &job);
        if (atomic_load(&job.nonfinite)) return FY_ERR_NONFINITE;
        job.scan = NULL;
    }
    run_step_job(pool, &job);
    return FY_OK;
}

fy_status fy_adam_pool_step(fy_adam_pool *pool, const fy_adam_hparams *hp, const fy_adam_range *r) {
    return fy_adam_pool_step_path(pool, FY_ADAM_PATH_AUTO, hp, r);
}

fy_status fy_adam_pool_step_tiles(fy_adam_pool *pool, const fy_adam_hparams *hp,
                                  const fy_adam_range *r, size_t tile_lo, size_t tile_hi) {
    FY_ASSERT(tile_lo <= tile_hi && tile_hi <= fy_adam_ntiles(r->n), "tiles out of the range");
    FY_TRY(fy_adam_range_check(r));
    size_t lo = tile_lo * FY_ADAM_TILE_NELEM;
    size_t hi = tile_hi * FY_ADAM_TILE_NELEM < r->n ? tile_hi * FY_ADAM_TILE_NELEM : r->n;
    fy_adam_range sub;
    fy_adam_range_slice(r, lo, hi, &sub);
    return fy_adam_pool_step(pool, hp, &sub);
}

/* ---- memory --------------------------------------------------------------------- */

typedef struct touch_job {
    fy_adam_pool *pool;
    char *base;
    size_t len;
} touch_job;

/* Part t of [0, len): boundaries at multiples of 2 MiB (one huge page, one owner). */
static size_t part_edge(size_t len, int t, int T) {
    if (t >= T) return len;
    size_t e = (size_t)((double)len * t / T) / HUGE_NBYTES * HUGE_NBYTES;
    return e < len ? e : len;
}

static void touch_worker(void *ctx, int t, int T) {
    touch_job *job = ctx;
    size_t lo = part_edge(job->len, t, T), hi = part_edge(job->len, t + 1, T);
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    for (size_t off = lo; off < hi; off += page) ((volatile char *)job->base)[off] = 0;
}

/* Successive allocations start at different offsets ("colours") within their first
 * 2 MiB: colour k is k * (64 KiB + 64 B), k = 0..15 in turn. Arrays that an update reads
 * at the same index (w, m, v) otherwise start at the same offset modulo 2 MiB and, the
 * memory controller's channel and bank bits being low address bits, keep hitting the
 * same banks: on the reference machine the AdamW traffic pattern ran at ~50 GB/s with
 * aligned arrays and ~97 GB/s with arrays 64 KiB + 64 B apart (bench/RESULTS.md). */
#define COLOUR_NBYTES ((size_t)(64 << 10) + 64)
#define NCOLOURS 16

fy_status fy_adam_mem_alloc(fy_adam_pool *pool, size_t nbytes, void **out) {
    static atomic_uint next_colour;
    *out = NULL;
    if (nbytes == 0) return FY_OK;
    size_t colour = (atomic_fetch_add(&next_colour, 1) % NCOLOURS) * COLOUR_NBYTES;
    size_t len = fy_round_up(nbytes + colour, HUGE_NBYTES);
    /* over-map by one huge page and trim, for a 2 MiB aligned start */
    char *raw = mmap(NULL, len + HUGE_NBYTES, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) {
        fy_log_error("adam: cannot map %zu bytes for optimizer state", nbytes);
        return FY_ERR_NOMEM;
    }
    char *p = (char *)fy_round_up((uintptr_t)raw, HUGE_NBYTES);
    if (p > raw) munmap(raw, (size_t)(p - raw));
    size_t tail = (size_t)(raw + len + HUGE_NBYTES - (p + len));
    if (tail) munmap(p + len, tail);
#ifdef MADV_HUGEPAGE
    madvise(p, len, MADV_HUGEPAGE); /* a hint: without THP the pages are simply small */
#endif
    touch_job job = {pool, p, len};
    if (!pool) {
        touch_worker(&job, 0, 1);
    } else {
#ifdef FY_HAVE_NUMA
        if (numa_available() >= 0 && numa_max_node() > 0) {
            int T = pool->nthreads;
            for (int t = 0; t < T; t++) {
                size_t lo = part_edge(len, t, T), hi = part_edge(len, t + 1, T);
                if (hi > lo) numa_tonode_memory(p + lo, hi - lo, pool->workers[t].node);
            }
        }
#endif
        fy_adam_pool_run(pool, touch_worker, &job);
    }
    *out = p + colour;
    return FY_OK;
}

void fy_adam_mem_free(void *p, size_t nbytes) {
    if (!p) return;
    char *base = (char *)((uintptr_t)p & ~(uintptr_t)(HUGE_NBYTES - 1));
    munmap(base, fy_round_up(nbytes + (size_t)((char *)p - base), HUGE_NBYTES));
}
