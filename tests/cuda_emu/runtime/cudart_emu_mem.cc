/* cudart_emu_mem.cc — memory of the emulated devices and pinned memory (cudart_emu.h).
 *
 * Device memory: cudaMalloc takes a slot of device d's address range, its size rounded
 * up to the driver's 2 MiB granule and followed by a guard granule that is never mapped;
 * the caller's range ends at the end of the rounded size, 256-byte aligned (CUDA's
 * promise), and only its pages are mapped in the device process, so an overrun past the
 * allocation's 256-byte rounding or an underrun past its first page faults there. The
 * host maps none of it: host code that reads device memory faults.
 *
 * Accounting, as cudaMemGetInfo counts it, per device: every allocation's rounded size,
 * the context (EMU_CTX_NBYTES, at the first call that needs one on the device), the
 * kernels' module (EMU_MODULE_NBYTES, at the first kernel launch: cudart_emu_launch.cc),
 * and what cuBLASLt and NCCL take for themselves (fy_emu_take). Anything that does not
 * fit is cudaErrorMemoryAllocation.
 *
 * Pinned memory comes from the pinned arena, which every process maps shared at the
 * same address: page-rounded, a page apart (a range across two allocations is not one
 * allocation's), zero-filled (fresh or punched pages of the memfd).
 *
 * cudaFree and cudaFreeHost wait for the devices' queued work first, as CUDA's do. */
#include "tests/cuda_emu/runtime/cudart_emu.h"

#include <string.h>
#include <sys/mman.h>

/* A primary context of CUDA 12-13 on a Hopper GPU takes about 300-500 MiB of device
 * memory (cudaMemGetInfo before and after the first call that creates it); the lower
 * figure, so a budget that fits the emulation may still not fit a GPU. */
#define EMU_CTX_NBYTES ((size_t)300 << 20)

static size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

/* ---- the tables ------------------------------------------------------------------------- */

/* The last entry with base <= p, or -1. */
static int find_le(const emu_table *t, uintptr_t p) {
    int lo = 0, hi = t->n - 1, r = -1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        if (t->a[mid].base <= p) { r = mid; lo = mid + 1; }
        else hi = mid - 1;
    }
    return r;
}

/* The first free slot of slot_nbytes in [lo, hi), aligned to `align`: 0 if none. */
static uintptr_t first_fit(const emu_table *t, uintptr_t lo, uintptr_t hi, size_t slot_nbytes,
                           size_t align) {
    uintptr_t cur = lo;
    for (int i = 0; i <= t->n; i++) {
        const uintptr_t end = i < t->n ? t->a[i].slot : hi;
        if (end >= cur && end - cur >= slot_nbytes) return cur;
        if (i < t->n) cur = round_up(t->a[i].slot + t->a[i].slot_nbytes, align);
    }
    return 0;
}

static bool table_insert(emu_table *t, const emu_alloc *a) {
    if (t->n == EMU_MAX_ALLOCS) return false;
    int i = find_le(t, a->base) + 1;
    memmove(&t->a[i + 1], &t->a[i], (size_t)(t->n - i) * sizeof t->a[0]);
    t->a[i] = *a;
    t->n++;
    return true;
}

/* Removes the entry whose base is p (internal or not, as asked) into *out: false if none. */
static bool table_remove(emu_table *t, uintptr_t p, int internal, emu_alloc *out) {
    int i = find_le(t, p);
    if (i < 0 || t->a[i].base != p || t->a[i].internal != internal) return false;
    *out = t->a[i];
    memmove(&t->a[i], &t->a[i + 1], (size_t)(t->n - i - 1) * sizeof t->a[0]);
    t->n--;
    return true;
}

/* Where [p, p + nbytes) lies in one table's range [lo, hi): 0 outside, 1 inside one
 * live non-internal allocation (its device in *dev), -1 otherwise. */
static int classify(const emu_table *t, uintptr_t lo, uintptr_t hi, uintptr_t p, uintptr_t end, int *dev) {
    if (end <= lo || p >= hi) return 0;
    int i = find_le(t, p);
    if (i < 0 || t->a[i].internal || end > t->a[i].base + t->a[i].nbytes) return -1;
    *dev = t->a[i].dev;
    return 1;
}

fy_emu_mem emu_mem_find(const void *ptr, size_t nbytes, int *dev) {
    const uintptr_t p = (uintptr_t)ptr, end = p + (nbytes ? nbytes : 1);
    *dev = -1;
    if (end < p) return FY_EMU_INVALID;
    fy_emu_mem kind = FY_EMU_PAGEABLE;
    emu_lock();
    for (int d = 0; d < g_emu.ngpus && kind == FY_EMU_PAGEABLE; d++) {
        int c = classify(&g_emu.sh->gpu[d].allocs, g_emu.gpu[d].lo, g_emu.gpu[d].hi, p, end, dev);
        if (c) kind = c > 0 ? FY_EMU_DEVICE : FY_EMU_INVALID;
    }
    if (kind == FY_EMU_PAGEABLE) {
        const uintptr_t lo = (uintptr_t)g_emu.pinned;
        int c = classify(&g_emu.sh->pinned, lo, lo + g_emu.pinned_nbytes, p, end, dev);
        if (c) kind = c > 0 ? FY_EMU_PINNED : FY_EMU_INVALID;
    }
    emu_unlock();
    return kind;
}

fy_emu_mem fy_emu_mem_of(const void *p, size_t nbytes) {
    if (emu_init() != cudaSuccess) return FY_EMU_PAGEABLE;
    int dev;
    return emu_mem_find(p, nbytes, &dev);
}

int emu_dev_allocs(int d, emu_alloc *out, int cap) {
    int n = 0;
    emu_lock();
    const emu_table *t = &g_emu.sh->gpu[d].allocs;
    for (int i = 0; i < t->n && n < cap; i++)
        if (!t->a[i].internal) out[n++] = t->a[i];
    emu_unlock();
    return n;
}

/* ---- accounting --------------------------------------------------------------------------- */

static cudaError_t charge_locked(int d, size_t nbytes) {
    emu_gpu_shared *g = &g_emu.sh->gpu[d];
    if (nbytes > g_emu.capacity || g->charged > g_emu.capacity - nbytes) return cudaErrorMemoryAllocation;
    g->charged += nbytes;
    return cudaSuccess;
}

cudaError_t emu_charge(int d, size_t nbytes) {
    emu_lock();
    cudaError_t e = charge_locked(d, nbytes);
    emu_unlock();
    return e;
}

void emu_uncharge(int d, size_t nbytes) {
    emu_lock();
    emu_gpu_shared *g = &g_emu.sh->gpu[d];
    g->charged -= nbytes < g->charged ? nbytes : g->charged;
    emu_unlock();
}

cudaError_t emu_ctx(int d) {
    emu_gpu *g = &g_emu.gpu[d];
    if (g->ctx.load()) return cudaSuccess;
    cudaError_t e = cudaSuccess;
    emu_lock();
    if (!g->ctx.load()) {
        e = charge_locked(d, EMU_CTX_NBYTES);
        if (e == cudaSuccess) g->ctx.store(1);
        else fy_emu_report("no room on GPU %d for a context (%zu MiB)", d, EMU_CTX_NBYTES >> 20);
    }
    emu_unlock();
    return e;
}

cudaError_t fy_emu_take(size_t nbytes) {
    EMU_ENTER(true, d);
    return emu_ret(emu_charge(d, nbytes));
}

void fy_emu_give(size_t nbytes) {
    int d;
    if (emu_enter(false, &d) == cudaSuccess) emu_uncharge(d, nbytes);
}

/* ---- device memory -------------------------------------------------------------------------- */

cudaError_t cudaMalloc(void **devPtr, size_t size) {
    EMU_ENTER(true, d);
    if (!devPtr) return emu_ret(cudaErrorInvalidValue);
    *devPtr = NULL;
    if (size == 0) return cudaSuccess;
    if (size > g_emu.capacity) return emu_ret(cudaErrorMemoryAllocation);
    const size_t rounded = round_up(size, EMU_GRANULE);
    emu_lock();
    emu_gpu_shared *g = &g_emu.sh->gpu[d];
    cudaError_t e = charge_locked(d, rounded);
    emu_alloc a;
    memset(&a, 0, sizeof a);
    if (e == cudaSuccess) {
        a.slot = first_fit(&g->allocs, g_emu.gpu[d].lo, g_emu.gpu[d].hi, rounded + EMU_GRANULE, EMU_GRANULE);
        a.slot_nbytes = rounded + EMU_GRANULE;
        a.base = a.slot + rounded - round_up(size, 256);
        a.nbytes = size;
        a.dev = d;
        if (!a.slot || !table_insert(&g->allocs, &a)) {
            fy_emu_report("GPU %d: %s", d, a.slot ? "more live allocations than the emulation keeps"
                                                  : "its address range is too fragmented");
            g->charged -= rounded;
            e = cudaErrorMemoryAllocation;
        }
    }
    emu_unlock();
    if (e != cudaSuccess) return emu_ret(e);
    const uintptr_t first_page = a.base & ~(uintptr_t)(EMU_PAGE - 1);
    e = emu_ctl_map(d, first_page, a.slot + rounded - first_page);
    if (e != cudaSuccess) {
        emu_lock();
        table_remove(&g->allocs, a.base, 0, &a);
        g->charged -= rounded;
        emu_unlock();
        return emu_ret(e);
    }
    *devPtr = (void *)a.base;
    return cudaSuccess;
}

cudaError_t cudaFree(void *devPtr) {
    EMU_ENTER(true, cur);
    (void)cur;
    if (!devPtr) return cudaSuccess;
    int d;
    if (emu_mem_find(devPtr, 1, &d) != FY_EMU_DEVICE) {
        fy_emu_report("cudaFree(%p): not the start of a live cudaMalloc allocation", devPtr);
        return emu_ret(cudaErrorInvalidValue);
    }
    cudaError_t e = emu_device_sync(d, false);
    if (e != cudaSuccess) return emu_ret(e);
    emu_alloc a;
    emu_lock();
    bool found = table_remove(&g_emu.sh->gpu[d].allocs, (uintptr_t)devPtr, 0, &a);
    if (found) g_emu.sh->gpu[d].charged -= a.slot_nbytes - EMU_GRANULE;
    emu_unlock();
    if (!found) {
        fy_emu_report("cudaFree(%p): not the start of a live cudaMalloc allocation", devPtr);
        return emu_ret(cudaErrorInvalidValue);
    }
    const uintptr_t first_page = a.base & ~(uintptr_t)(EMU_PAGE - 1);
    return emu_ret(emu_ctl_unmap(d, first_page, a.slot + a.slot_nbytes - EMU_GRANULE - first_page));
}

cudaError_t cudaMemGetInfo(size_t *free, size_t *total) {
    EMU_ENTER(true, d);
    if (!free || !total) return emu_ret(cudaErrorInvalidValue);
    emu_lock();
    *free = g_emu.capacity - g_emu.sh->gpu[d].charged;
    *total = g_emu.capacity;
    emu_unlock();
    return cudaSuccess;
}

/* ---- pinned memory ---------------------------------------------------------------------------- */

static void *pinned_alloc(size_t nbytes, int internal, int dev) {
    const size_t span = round_up(nbytes, EMU_PAGE);
    emu_alloc a;
    memset(&a, 0, sizeof a);
    emu_lock();
    emu_table *t = &g_emu.sh->pinned;
    const uintptr_t lo = (uintptr_t)g_emu.pinned;
    a.slot = first_fit(t, lo, lo + g_emu.pinned_nbytes, span + EMU_PAGE, EMU_PAGE);
    a.slot_nbytes = span + EMU_PAGE;
    a.base = a.slot;
    a.nbytes = nbytes;
    a.internal = internal;
    a.dev = dev;
    bool ok = a.slot && table_insert(t, &a);
    emu_unlock();
    return ok ? (void *)a.base : NULL;
}

/* Frees a pinned allocation (internal or not): false if p starts none. */
static bool pinned_free(void *p, int internal) {
    emu_alloc a;
    emu_lock();
    bool found = table_remove(&g_emu.sh->pinned, (uintptr_t)p, internal, &a);
    emu_unlock();
    if (found) madvise(p, a.slot_nbytes - EMU_PAGE, MADV_REMOVE); /* zero pages, memory back */
    return found;
}

void *emu_pinned_internal(size_t nbytes) { return pinned_alloc(nbytes, 1, -1); }
void emu_pinned_internal_free(void *p) { pinned_free(p, 1); }

cudaError_t cudaHostAlloc(void **pHost, size_t size, unsigned int flags) {
    EMU_ENTER(true, d);
    if (!pHost || (flags & ~(unsigned)(cudaHostAllocPortable | cudaHostAllocMapped | cudaHostAllocWriteCombined)))
        return emu_ret(cudaErrorInvalidValue);
    *pHost = NULL;
    if (size == 0) return cudaSuccess;
    *pHost = pinned_alloc(size, 0, d);
    return *pHost ? cudaSuccess : emu_ret(cudaErrorMemoryAllocation);
}

cudaError_t cudaMallocHost(void **ptr, size_t size) { return cudaHostAlloc(ptr, size, cudaHostAllocDefault); }

cudaError_t cudaFreeHost(void *ptr) {
    EMU_ENTER(true, d);
    (void)d;
    if (!ptr) return cudaSuccess;
    if (emu_mem_find(ptr, 1, &d) != FY_EMU_PINNED) {
        fy_emu_report("cudaFreeHost(%p): not the start of a live cudaHostAlloc allocation", ptr);
        return emu_ret(cudaErrorInvalidValue);
    }
    for (int k = 0; k < g_emu.ngpus; k++) {
        cudaError_t e = emu_device_sync(k, false);
        if (e != cudaSuccess) return emu_ret(e);
    }
    if (!pinned_free(ptr, 0)) {
        fy_emu_report("cudaFreeHost(%p): not the start of a live cudaHostAlloc allocation", ptr);
        return emu_ret(cudaErrorInvalidValue);
    }
    return cudaSuccess;
}

/* ---- pointer attributes ------------------------------------------------------------------------ */

cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *attributes, const void *ptr) {
    EMU_ENTER(true, cur);
    (void)cur;
    if (!attributes) return emu_ret(cudaErrorInvalidValue);
    memset(attributes, 0, sizeof *attributes);
    int d;
    switch (emu_mem_find(ptr, 1, &d)) {
    case FY_EMU_DEVICE:
        attributes->type = cudaMemoryTypeDevice;
        attributes->device = d;
        attributes->devicePointer = (void *)ptr;
        return cudaSuccess;
    case FY_EMU_PINNED: /* mapped: the same address on the device (unified addressing) */
        attributes->type = cudaMemoryTypeHost;
        attributes->device = d;
        attributes->devicePointer = attributes->hostPointer = (void *)ptr;
        return cudaSuccess;
    case FY_EMU_PAGEABLE: /* CUDA 11 and later: success, unregistered */
        attributes->type = cudaMemoryTypeUnregistered;
        attributes->device = -2;
        attributes->hostPointer = (void *)ptr;
        return cudaSuccess;
    default:
        fy_emu_report("cudaPointerGetAttributes(%p): in device or pinned memory, but no live "
                      "allocation's", ptr);
        return emu_ret(cudaErrorInvalidValue);
    }
}
