/* test_cublaslt_rt.c — a stand-in for libfy_cudart_emu.so under test_cublaslt.c: the
 * emu_rt.h functions the emulated cuBLASLt calls and the few CUDA runtime calls the test
 * makes, in one process, so the library can be tested without the emulated device.
 *
 * Device memory is an arena of its own mapping: allocations are bumped 256-byte aligned
 * with a 4 KiB gap after each and never reused, so fy_emu_mem_of tells a pointer inside
 * one live allocation (FY_EMU_DEVICE) from one in the arena but not wholly inside one
 * (FY_EMU_INVALID: freed, past an end, in a gap) and from host memory (FY_EMU_PAGEABLE).
 * Queued work runs at once (fy_emu_enqueue), on its own copy of the arguments; its error
 * is the stream's, returned by cudaDeviceSynchronize. Not the real runtime: the device
 * memory is host memory here, and there is no second process.
 *
 * Single-threaded, as the test is. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

#include "tests/cuda_emu/runtime/emu_rt.h"

#define ARENA_NBYTES ((size_t)1 << 30)
#define ALLOC_MAX 256
#define GAP_NBYTES 4096

static char *g_arena;
static size_t g_used;          /* bytes bumped, gaps included */
static size_t g_taken;         /* fy_emu_take's */
static struct { char *p; size_t nbytes; int live; } g_allocs[ALLOC_MAX];
static int g_nallocs;
static cudaError_t g_stream_err = cudaSuccess;

static int arena_init(void) {
    if (g_arena) return 1;
    void *p = mmap(NULL, ARENA_NBYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return 0;
    g_arena = p;
    return 1;
}

cudaError_t cudaMalloc(void **devPtr, size_t size) {
    if (!devPtr) return cudaErrorInvalidValue;
    size_t at = (g_used + 255) & ~(size_t)255;
    if (!arena_init() || g_nallocs == ALLOC_MAX || at + size + GAP_NBYTES + g_taken > ARENA_NBYTES)
        return cudaErrorMemoryAllocation;
    g_allocs[g_nallocs].p = g_arena + at;
    g_allocs[g_nallocs].nbytes = size;
    g_allocs[g_nallocs].live = 1;
    g_nallocs++;
    g_used = at + size + GAP_NBYTES;
    *devPtr = g_arena + at;
    return cudaSuccess;
}

cudaError_t cudaFree(void *devPtr) {
    if (!devPtr) return cudaSuccess;
    for (int i = 0; i < g_nallocs; i++)
        if (g_allocs[i].p == devPtr && g_allocs[i].live) {
            g_allocs[i].live = 0;
            return cudaSuccess;
        }
    return cudaErrorInvalidValue;
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind) {
    memcpy(dst, src, count);
    return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) { return g_stream_err; }

cudaError_t cudaMemGetInfo(size_t *free, size_t *total) {
    size_t live = g_taken;
    for (int i = 0; i < g_nallocs; i++)
        if (g_allocs[i].live) live += g_allocs[i].nbytes;
    *free = ARENA_NBYTES - live;
    *total = ARENA_NBYTES;
    return cudaSuccess;
}

cudaError_t fy_emu_enqueue(cudaStream_t s, fy_emu_dev_fn fn, const void *args, size_t nbytes, const char *what) {
    _Alignas(16) char copy[FY_EMU_ARGS_MAX];
    if (g_stream_err != cudaSuccess) return g_stream_err;
    if (nbytes > sizeof copy) return cudaErrorInvalidValue;
    memcpy(copy, args, nbytes);
    g_stream_err = fn(copy);
    return cudaSuccess;
}

fy_emu_mem fy_emu_mem_of(const void *p, size_t nbytes) {
    const char *c = p;
    if (!g_arena || c < g_arena || c >= g_arena + ARENA_NBYTES) return FY_EMU_PAGEABLE;
    for (int i = 0; i < g_nallocs; i++)
        if (g_allocs[i].live && c >= g_allocs[i].p && nbytes <= g_allocs[i].nbytes &&
            (size_t)(c - g_allocs[i].p) <= g_allocs[i].nbytes - nbytes)
            return FY_EMU_DEVICE;
    return FY_EMU_INVALID;
}

cudaError_t fy_emu_take(size_t nbytes) {
    size_t free, total;
    cudaMemGetInfo(&free, &total);
    if (nbytes > free) return cudaErrorMemoryAllocation;
    g_taken += nbytes;
    return cudaSuccess;
}

void fy_emu_give(size_t nbytes) { g_taken -= nbytes; }

void fy_emu_report(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("cuda emulation: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

bool fy_emu_on_device(void) { return true; }
