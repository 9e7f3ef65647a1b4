/* cudart_emu_copy.cc — cudaMemcpyAsync and cudaMemsetAsync of the emulated runtime
 * (cudart_emu.h).
 *
 * Each operand is classified (cudart_emu_mem.cc): device memory, pinned memory, pageable
 * host memory, or invalid (in the device's or the pinned arena's range but not inside
 * one live allocation: cudaErrorInvalidValue). An explicit direction must match the
 * operands (cudaMemcpyHostToDevice: host to device memory, ...), else
 * cudaErrorInvalidValue; cudaMemcpyDefault takes them as they are.
 *
 * Between device and pinned memory a copy is the device's work, in stream order and
 * asynchronous to the host. With a pageable operand it is synchronous, as CUDA's are:
 * the stream's worker runs it after the stream's earlier work, staging through the
 * stream's pinned buffer when the other side is device memory, and the call returns once
 * it is done. A device operand of another device than the stream's is not emulated
 * (CUDA would copy between peers): cudaErrorInvalidValue, reported.
 *
 * cudaMemsetAsync sets device or pinned memory in stream order; pageable memory is
 * cudaErrorInvalidValue, as CUDA's. */
#include "tests/cuda_emu/runtime/cudart_emu.h"

#include <string.h>

/* ---- the device's half ----------------------------------------------------------------- */

typedef struct copy_args {
    void *dst;
    const void *src;
    size_t nbytes;
} copy_args;

static cudaError_t dev_copy(void *a) {
    const copy_args *c = (const copy_args *)a;
    memcpy(c->dst, c->src, c->nbytes);
    return cudaSuccess;
}

typedef struct set_args {
    void *dst;
    int value;
    size_t nbytes;
} set_args;

static cudaError_t dev_set(void *a) {
    const set_args *c = (const set_args *)a;
    memset(c->dst, c->value, c->nbytes);
    return cudaSuccess;
}

/* ---- copies with a pageable side (on the stream's worker) -------------------------------------- */

typedef struct pageable_copy {
    char *dst;
    const char *src;
    size_t nbytes;
    fy_emu_mem kd, ks;
} pageable_copy;

static cudaError_t run_pageable(emu_stream *st, void *arg) {
    const pageable_copy *p = (const pageable_copy *)arg;
    if (p->kd != FY_EMU_DEVICE && p->ks != FY_EMU_DEVICE) {
        memcpy(p->dst, p->src, p->nbytes); /* both sides are host memory */
        return cudaSuccess;
    }
    char *stage = emu_stream_stage(st);
    if (!stage) return cudaErrorMemoryAllocation;
    for (size_t off = 0; off < p->nbytes; off += EMU_STAGE_NBYTES) {
        const size_t n = p->nbytes - off < EMU_STAGE_NBYTES ? p->nbytes - off : EMU_STAGE_NBYTES;
        copy_args c = {p->kd == FY_EMU_DEVICE ? p->dst + off : stage,
                       p->ks == FY_EMU_DEVICE ? p->src + off : stage, n};
        if (p->ks != FY_EMU_DEVICE) memcpy(stage, p->src + off, n);
        cudaError_t e = emu_worker_dev_work(st, dev_copy, &c, sizeof c, "cudaMemcpyAsync");
        if (e != cudaSuccess) return e;
        if (p->kd != FY_EMU_DEVICE) memcpy(p->dst + off, stage, n);
    }
    return cudaSuccess;
}

/* ---- the calls ------------------------------------------------------------------------------- */

static const char *kind_name(fy_emu_mem k) {
    switch (k) {
    case FY_EMU_PAGEABLE: return "pageable host memory";
    case FY_EMU_PINNED: return "pinned host memory";
    case FY_EMU_DEVICE: return "device memory";
    default: return "not one live allocation";
    }
}

static bool is_host(fy_emu_mem k) { return k == FY_EMU_PAGEABLE || k == FY_EMU_PINNED; }

/* Whether an explicit direction matches the operands. */
static bool direction_ok(cudaMemcpyKind kind, fy_emu_mem kd, fy_emu_mem ks) {
    switch (kind) {
    case cudaMemcpyHostToHost: return is_host(ks) && is_host(kd);
    case cudaMemcpyHostToDevice: return is_host(ks) && kd == FY_EMU_DEVICE;
    case cudaMemcpyDeviceToHost: return ks == FY_EMU_DEVICE && is_host(kd);
    case cudaMemcpyDeviceToDevice: return ks == FY_EMU_DEVICE && kd == FY_EMU_DEVICE;
    default: return true;
    }
}

static cudaError_t memcpy_async(void *dst, const void *src, size_t count, cudaMemcpyKind kind,
                                emu_stream *st) {
    if (kind < cudaMemcpyHostToHost || kind > cudaMemcpyDefault) return cudaErrorInvalidMemcpyDirection;
    if (count == 0) return cudaSuccess;
    int dd, sd;
    const fy_emu_mem kd = emu_mem_find(dst, count, &dd), ks = emu_mem_find(src, count, &sd);
    if (kd == FY_EMU_INVALID || ks == FY_EMU_INVALID || !direction_ok(kind, kd, ks)) {
        fy_emu_report("cudaMemcpyAsync(%p, %p, %zu bytes, kind %d): from %s to %s", dst, src, count,
                      (int)kind, kind_name(ks), kind_name(kd));
        return cudaErrorInvalidValue;
    }
    const int d = emu_stream_dev(st);
    if ((kd == FY_EMU_DEVICE && dd != d) || (ks == FY_EMU_DEVICE && sd != d)) {
        fy_emu_report("cudaMemcpyAsync(%p, %p): device memory of another GPU than the stream's "
                      "(peer copies are not emulated)", dst, src);
        return cudaErrorInvalidValue;
    }
    if (kd != FY_EMU_PAGEABLE && ks != FY_EMU_PAGEABLE) {
        copy_args c = {dst, src, count};
        return emu_stream_dev_work(st, dev_copy, &c, sizeof c, "cudaMemcpyAsync");
    }
    pageable_copy p = {(char *)dst, (const char *)src, count, kd, ks};
    return emu_stream_run_sync(st, run_pageable, &p);
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind,
                            cudaStream_t stream) {
    EMU_ENTER(true, d);
    emu_stream *st = emu_stream_get(stream, d);
    if (!st) {
        fy_emu_report("cudaMemcpyAsync: stream %p is not a live stream", (void *)stream);
        return emu_ret(cudaErrorInvalidResourceHandle);
    }
    cudaError_t e = memcpy_async(dst, src, count, kind, st);
    emu_stream_put(st);
    return emu_ret(e);
}

cudaError_t cudaMemsetAsync(void *devPtr, int value, size_t count, cudaStream_t stream) {
    EMU_ENTER(true, d);
    emu_stream *st = emu_stream_get(stream, d);
    if (!st) {
        fy_emu_report("cudaMemsetAsync: stream %p is not a live stream", (void *)stream);
        return emu_ret(cudaErrorInvalidResourceHandle);
    }
    cudaError_t e = cudaSuccess;
    int pd;
    const fy_emu_mem k = count ? emu_mem_find(devPtr, count, &pd) : FY_EMU_DEVICE;
    if (k != FY_EMU_DEVICE && k != FY_EMU_PINNED) {
        fy_emu_report("cudaMemsetAsync(%p, %zu bytes): %s (CUDA sets device or pinned memory only)",
                      devPtr, count, kind_name(k));
        e = cudaErrorInvalidValue;
    } else if (k == FY_EMU_DEVICE && pd != emu_stream_dev(st)) {
        fy_emu_report("cudaMemsetAsync(%p): device memory of another GPU than the stream's", devPtr);
        e = cudaErrorInvalidValue;
    } else if (count) {
        set_args a = {devPtr, value, count};
        e = emu_stream_dev_work(st, dev_set, &a, sizeof a, "cudaMemsetAsync");
    }
    emu_stream_put(st);
    return emu_ret(e);
}
