/* cudart_emu_launch.cc — kernel launches on the emulated runtime: cuda_emu.h's FY_LAUNCH
 * in the runtime's build (FY_CUDA_EMU_RT) calls fy_emu_launch with the kernel's queued
 * call (a function of the program that has the kernel, which the device processes have:
 * they are forks of it) and its arguments.
 *
 * At the launch, on the host: the configuration is checked as CUDA checks it (a bad one
 * is cudaErrorInvalidConfiguration, the calling thread's next cudaGetLastError, and
 * nothing runs), and the stream must be of the calling thread's device
 * (cudaErrorInvalidResourceHandle, reported); the device's first launch loads the kernels' module, whose memory is
 * charged (EMU_MODULE_NBYTES; cudaErrorMemoryAllocation if it does not fit, reported);
 * then the call is queued on the stream.
 *
 * A pointer argument to pageable host memory is what a GPU faults on when the kernel
 * reads it: the launch goes, and its work fails there with cudaErrorIllegalAddress (the
 * device process, a fork, could read a stale copy of memory older than itself).
 *
 * On the device, the grid runs once, or with FERRY_EMU_RACECHECK=1 three times, its
 * threads and blocks in forward, reverse and shuffled order, each from the device
 * memory as it was before the first (every live allocation of the device is compared:
 * fy_emu_check_orders) while no other work of the device runs (cudart_emu_proc.cc); a
 * difference is a race, which ends the device process (the device's sticky error is
 * then cudaErrorLaunchFailure). */
#include "tests/cuda_emu/cuda_emu.h"
#include "tests/cuda_emu/runtime/cudart_emu.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* CUDA loads a module's code lazily at its first launch (the default since CUDA 12.2,
 * CUDA_MODULE_LOADING=LAZY), taking device memory for the code, its constant banks and
 * the launch's local memory; 16 MiB stands for ferry's kernels (some 60, sm_90). */
#define EMU_MODULE_NBYTES ((size_t)16 << 20)

typedef struct kernel_args {
    cudaError_t (*run)(void *args);
    const void *pageable;              /* a pointer argument to pageable memory, or NULL */
    char name[56];
    alignas(16) char payload[FY_EMU_ARGS_MAX - 80];
} kernel_args;
#define KERNEL_HEAD offsetof(kernel_args, payload)

static void run_once(void *k) {
    kernel_args *ka = (kernel_args *)k;
    ka->run(ka->payload);
}

/* The device's half: the grid once, or the race check over the device's memory. */
static cudaError_t run_kernel(void *k) {
    kernel_args *ka = (kernel_args *)k;
    if (ka->pageable) { /* what a GPU does with it: a fault */
        char why[160];
        snprintf(why, sizeof why, "an illegal memory access by %s at %p (pageable host memory, "
                 "passed as its argument)", ka->name, ka->pageable);
        emu_fail(emu_device_index(), cudaErrorIllegalAddress, why);
        return cudaErrorIllegalAddress;
    }
    if (!g_emu.racecheck) return ka->run(ka->payload);
    emu_alloc *allocs = (emu_alloc *)malloc(EMU_MAX_ALLOCS * sizeof *allocs);
    fy_emu_buf *bufs = (fy_emu_buf *)malloc(EMU_MAX_ALLOCS * sizeof *bufs);
    char(*names)[48] = (char(*)[48])malloc(EMU_MAX_ALLOCS * 48);
    if (!allocs || !bufs || !names) abort();
    const int n = emu_dev_allocs(emu_device_index(), allocs, EMU_MAX_ALLOCS);
    for (int i = 0; i < n; i++) {
        snprintf(names[i], 48, "(the allocation at %p)", (void *)allocs[i].base);
        bufs[i] = fy_emu_buf{(void *)allocs[i].base, allocs[i].nbytes, names[i]};
    }
    fy_emu_check_orders(ka->name, run_once, ka, bufs, n);
    free(allocs);
    free(bufs);
    free(names);
    return cudaSuccess;
}

/* Loads the kernels' module on device d unless it is. */
static cudaError_t load_module(int d) {
    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    emu_gpu *g = &g_emu.gpu[d];
    if (g->module.load()) return cudaSuccess;
    pthread_mutex_lock(&mu);
    cudaError_t e = g->module.load() ? cudaSuccess : emu_charge(d, EMU_MODULE_NBYTES);
    if (e == cudaSuccess) g->module.store(1);
    pthread_mutex_unlock(&mu);
    if (e != cudaSuccess)
        fy_emu_report("GPU %d has no room for the kernels' module (%zu MiB, loaded at the first "
                      "launch): the launch fails", d, EMU_MODULE_NBYTES >> 20);
    return e;
}

extern "C" void fy_emu_launch(cudaStream_t s, dim3 grid, dim3 block, size_t shmem, const char *name,
                              cudaError_t (*run)(void *args), const void *args, size_t nbytes,
                              const void *const *ptrs, int nptrs) {
    int d;
    cudaError_t e = emu_enter(true, &d);
    if (e != cudaSuccess) {
        emu_ret(e);
        return;
    }
    if (!fy_emu::launch_config_ok(grid, block, shmem)) {
        fy_emu_report("kernel %s: grid (%u, %u, %u) of blocks (%u, %u, %u), %zu bytes of dynamic "
                      "shared memory: a configuration CUDA refuses (or not emulated)", name, grid.x,
                      grid.y, grid.z, block.x, block.y, block.z, shmem);
        emu_ret(cudaErrorInvalidConfiguration);
        return;
    }
    if (nbytes > sizeof(((kernel_args *)0)->payload)) {
        fy_emu_report("kernel %s: %zu bytes of arguments, more than the emulation carries", name, nbytes);
        emu_ret(cudaErrorInvalidValue);
        return;
    }
    emu_stream *st = emu_stream_get(s, d);
    if (!st) {
        fy_emu_report("kernel %s: stream %p is not a live stream", name, (void *)s);
        emu_ret(cudaErrorInvalidResourceHandle);
        return;
    }
    if (emu_stream_dev(st) != d) { /* CUDA launches into the current device's streams only */
        fy_emu_report("kernel %s launched on a stream of GPU %d by a thread whose device is GPU %d",
                      name, emu_stream_dev(st), d);
        e = cudaErrorInvalidResourceHandle;
    } else {
        e = load_module(d);
    }
    if (e == cudaSuccess) {
        kernel_args ka;
        ka.run = run;
        ka.pageable = NULL;
        for (int i = 0; i < nptrs && !ka.pageable; i++) {
            int pd;
            if (ptrs[i] && emu_mem_find(ptrs[i], 1, &pd) == FY_EMU_PAGEABLE) ka.pageable = ptrs[i];
        }
        snprintf(ka.name, sizeof ka.name, "%s", name);
        memcpy(ka.payload, args, nbytes);
        e = emu_stream_dev_work(st, run_kernel, &ka, KERNEL_HEAD + nbytes, name);
    }
    emu_stream_put(st);
    emu_ret(e);
}
