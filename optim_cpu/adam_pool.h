/* adam_pool.h — a persistent, pinned thread pool for AdamW steps, and NUMA-placed,
 * pre-touched memory for the states it updates.
 *
 * Threads are created once, each pinned to one CPU of the creating thread's affinity
 * mask (thread t to the t-th allowed CPU, wrapping around when there are more threads
 * than CPUs), and sleep between calls. A step cuts its range into tiles and gives each
 * thread a contiguous run of them; a thread that finishes early takes tiles from the
 * runs of threads on its own NUMA node. fy_adam_mem_alloc() first-touches memory with
 * the same proportional split, so the pages a thread updates live on its node.
 *
 * Results are bit-identical to the single-threaded fy_adam_step(): every element is
 * computed by the same sequence whichever thread and tile it falls in.
 *
 * Threads: any thread may call; calls on one pool are serialised (one runs at a time).
 * Never call into a pool from one of its own workers (it would wait for itself). */
#ifndef FY_ADAM_POOL_H
#define FY_ADAM_POOL_H

#include "optim_cpu/adam.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fy_adam_pool fy_adam_pool;

/* Starts `threads` workers (threads <= 0: one per CPU the caller may run on).
 * FY_ERR_NOMEM or FY_ERR_INVALID (logged) on failure, *out untouched. */
fy_status fy_adam_pool_new(int threads, fy_adam_pool **out);
/* Stops and joins the workers. NULL is a no-op. */
void fy_adam_pool_free(fy_adam_pool *pool);

int fy_adam_pool_threads(const fy_adam_pool *pool);
/* The CPU worker t is pinned to, or -1 if pinning failed (logged once at creation). */
int fy_adam_pool_cpu(const fy_adam_pool *pool, int t);

/* fy_adam_step over r, split across the pool. check_finite covers the whole range: all
 * gradients are scanned (in parallel) before anything is written. */
fy_status fy_adam_pool_step(fy_adam_pool *pool, const fy_adam_hparams *hp, const fy_adam_range *r);
/* The same on an explicit path (tests, benchmarks); FY_ERR_UNSUPPORTED as fy_adam_step_path. */
fy_status fy_adam_pool_step_path(fy_adam_pool *pool, fy_adam_path p, const fy_adam_hparams *hp,
                                 const fy_adam_range *r);
/* Tiles [tile_lo, tile_hi) of r (see FY_ADAM_TILE_NELEM), split across the pool;
 * check_finite covers exactly these tiles. Requires tile_lo <= tile_hi <= ntiles. */
fy_status fy_adam_pool_step_tiles(fy_adam_pool *pool, const fy_adam_hparams *hp,
                                  const fy_adam_range *r, size_t tile_lo, size_t tile_hi);

/* Runs fn(ctx, t, nthreads) once on every worker t and returns when all are done.
 * For work that must land on the pool's threads (first touch, benchmarks). */
typedef void (*fy_adam_pool_fn)(void *ctx, int t, int nthreads);
void fy_adam_pool_run(fy_adam_pool *pool, fy_adam_pool_fn fn, void *ctx);

/* Allocates nbytes of zeroed memory for a state array (w, m, v, gradients, copies):
 * 64-byte aligned, in a 2 MiB aligned mapping with transparent huge pages asked for
 * (MADV_HUGEPAGE); part t of it on the NUMA node of worker t, every page touched from
 * that worker, so no page fault is left for the first step. Successive calls start at
 * different offsets modulo 2 MiB (16 "colours" 64 KiB + 64 B apart), so that w[i], m[i]
 * and v[i] of arrays allocated one after the other do not fall in the same DRAM banks
 * (which halves the bandwidth of the update; see bench/RESULTS.md). Allocate the w, m
 * and v arrays (or arenas) of a range with consecutive calls.
 * pool may be NULL (the caller touches everything). nbytes == 0 gives *out = NULL.
 * FY_ERR_NOMEM (logged) on failure. Free with fy_adam_mem_free(p, nbytes). */
fy_status fy_adam_mem_alloc(fy_adam_pool *pool, size_t nbytes, void **out);
void fy_adam_mem_free(void *p, size_t nbytes);

#ifdef __cplusplus
}
#endif
#endif
