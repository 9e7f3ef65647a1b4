/* test_rt.cc — the emulated CUDA runtime itself (tests/cuda_emu/runtime, -Dcuda=emulated):
 * that it behaves as NVIDIA documents CUDA's, and that each planted misuse is caught.
 *
 * Memory: host code that reads device memory dies of SIGSEGV; a kernel that writes past
 * its allocation makes the device's error cudaErrorIllegalAddress, seen at the next
 * synchronising call (not at the launch) and by every call after it; cudaMalloc counts
 * whole 2 MiB granules in cudaMemGetInfo; the context and the kernels' module (at the
 * first launch) take memory, and a launch whose module does not fit fails with
 * cudaErrorMemoryAllocation; cudaMemsetAsync on pageable memory and cudaFree of a
 * pointer it did not give are cudaErrorInvalidValue.
 * Order: a slow op on stream A, an event, a wait on stream B: B's copy sees A's result;
 * host functions run in stream order and may not call CUDA; copies with a pageable side
 * are done when the call returns; the legacy stream orders blocking streams, not the
 * others. Events: a wait on an event never recorded is caught
 * (cudaErrorIllegalState; a warning with FERRY_EMU_STRICT=0); elapsed times need timing
 * and completion; an event synchronised without cudaEventBlockingSync spins (CPU time
 * about its wall time), with it sleeps. Launches: a bad configuration is the launch's
 * cudaGetLastError; FERRY_EMU_RACECHECK=1 passes a kernel without races and stops the
 * device on one with. A crash of the device's process is an error, not a hang. Pointer
 * kinds are the same seen from both processes; device work may not call the runtime; a
 * thread that never set a device opens GPU 0, reported when the process works on another;
 * kernels and event records go to streams of their own device only.
 *
 * Every test initialises CUDA in its own process (Criterion forks one per test): the
 * settings (FERRY_EMU_*) are set before the first call. */
#include <criterion/criterion.h>

#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "tests/cuda_emu/cuda_emu.h"
#include "tests/cuda_emu/runtime/emu_rt.h"

#if defined(__SANITIZE_ADDRESS__)
/* host_reads_of_device_memory_fault expects the plain SIGSEGV, not AddressSanitizer's
 * report of it */
extern "C" const char *__asan_default_options(void) { return "handle_segv=0"; }
#endif

#define OK(call)                                                                   \
    do {                                                                           \
        cudaError_t e_ = (call);                                                   \
        cr_assert_eq(e_, cudaSuccess, "%s: %s", #call, cudaGetErrorName(e_));      \
    } while (0)

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double thread_cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- device work of the tests (in this program: the device processes have it) ---------- */

typedef struct slow_fill {
    int *p;
    int value, n, ms;
} slow_fill;

/* Sleeps ms, then sets n ints at p to value. */
static cudaError_t slow_fill_fn(void *a) {
    const slow_fill *f = (const slow_fill *)a;
    usleep((useconds_t)f->ms * 1000);
    for (int i = 0; i < f->n; i++) f->p[i] = f->value;
    return cudaSuccess;
}

static cudaError_t abort_fn(void *a) { abort(); }

static void enqueue_slow_fill(cudaStream_t s, int *p, int value, int n, int ms) {
    slow_fill f = {p, value, n, ms};
    OK(fy_emu_enqueue(s, slow_fill_fn, &f, sizeof f, "slow_fill"));
}

__global__ void fill_k(float *out, float v, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = v;
}

/* Every thread writes the shared value, one reads it: the result is whichever ran last. */
__global__ void racy_k(int *out) {
    __shared__ int last;
    last = (int)threadIdx.x;
    __syncthreads();
    if (threadIdx.x == 0) out[0] = last;
}

static cudaStream_t new_stream(void) {
    cudaStream_t s;
    OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    return s;
}

/* ---- memory ------------------------------------------------------------------------------- */

Test(memory, host_reads_of_device_memory_fault, .signal = SIGSEGV) {
    void *p;
    OK(cudaMalloc(&p, 4096));
    volatile char c = *(volatile char *)p;
    (void)c;
}

Test(memory, a_kernel_past_its_allocation_is_a_sticky_illegal_address) {
    cudaStream_t s = new_stream();
    float *p;
    OK(cudaMalloc((void **)&p, 256));
    FY_LAUNCH(1, 65, 0, s, fill_k)(p, 1.0f, 65); /* 65 floats: 4 bytes past the 256 */
    cr_expect_eq(cudaGetLastError(), cudaSuccess, "the launch itself succeeds, as on a GPU");
    cr_expect_eq(cudaStreamSynchronize(s), cudaErrorIllegalAddress);
    void *q;
    cr_expect_eq(cudaMalloc(&q, 16), cudaErrorIllegalAddress, "every later call fails");
    cr_expect_eq(cudaGetLastError(), cudaErrorIllegalAddress);
    cr_expect_eq(cudaGetLastError(), cudaErrorIllegalAddress, "and it is never cleared");
}

Test(memory, a_kernel_given_pageable_memory_is_an_illegal_address) {
    float *h = (float *)calloc(64, sizeof(float)); /* older than the device process */
    cudaStream_t s = new_stream();
    FY_LAUNCH(1, 32, 0, s, fill_k)(h, 1.0f, 16);
    cr_expect_eq(cudaGetLastError(), cudaSuccess, "the launch itself succeeds");
    cr_expect_eq(cudaStreamSynchronize(s), cudaErrorIllegalAddress);
    cr_expect_eq(h[0], 0.0f);
    free(h);
}

Test(memory, a_kernel_inside_its_allocation_runs) {
    cudaStream_t s = new_stream();
    float *p, *h;
    OK(cudaMalloc((void **)&p, 1000 * sizeof(float)));
    OK(cudaMallocHost((void **)&h, 1000 * sizeof(float)));
    FY_LAUNCH(4, 256, 0, s, fill_k)(p, 2.5f, 1000);
    OK(cudaGetLastError());
    OK(cudaMemcpyAsync(h, p, 1000 * sizeof(float), cudaMemcpyDefault, s));
    OK(cudaStreamSynchronize(s));
    for (int i = 0; i < 1000; i++) cr_assert_eq(h[i], 2.5f, "element %d", i);
}

Test(memory, malloc_counts_whole_granules) {
    size_t free0, total, free1;
    OK(cudaMemGetInfo(&free0, &total));
    void *a, *b;
    OK(cudaMalloc(&a, 1));
    OK(cudaMemGetInfo(&free1, &total));
    cr_expect_eq(free0 - free1, (size_t)2 << 20, "1 byte takes a 2 MiB granule");
    OK(cudaMalloc(&b, ((size_t)2 << 20) + 1));
    OK(cudaMemGetInfo(&free1, &total));
    cr_expect_eq(free0 - free1, (size_t)6 << 20, "2 MiB and a byte take two more");
    OK(cudaFree(a));
    OK(cudaFree(b));
    OK(cudaMemGetInfo(&free1, &total));
    cr_expect_eq(free1, free0);
    cr_expect_eq(total, (size_t)8 << 30, "the default capacity");
}

Test(memory, the_context_and_the_module_take_memory) {
    setenv("FERRY_EMU_GPU_MEM", "1G", 1);
    size_t free0, free1, total;
    OK(cudaMemGetInfo(&free0, &total));
    cr_expect_eq(total - free0, (size_t)300 << 20, "the context");
    cudaStream_t s = new_stream();
    float *p;
    OK(cudaMalloc((void **)&p, 64));
    OK(cudaMemGetInfo(&free0, &total));
    FY_LAUNCH(1, 32, 0, s, fill_k)(p, 1.0f, 16);
    OK(cudaGetLastError());
    OK(cudaMemGetInfo(&free1, &total));
    cr_expect_eq(free0 - free1, (size_t)16 << 20, "the module, at the first launch");
    FY_LAUNCH(1, 32, 0, s, fill_k)(p, 1.0f, 16);
    OK(cudaMemGetInfo(&free0, &total));
    cr_expect_eq(free0, free1, "once");
    OK(cudaStreamSynchronize(s));
}

Test(memory, a_launch_whose_module_does_not_fit_fails) {
    setenv("FERRY_EMU_GPU_MEM", "320M", 1); /* 20 MiB past the context */
    cudaStream_t s = new_stream();
    float *p;
    OK(cudaMalloc((void **)&p, (size_t)6 << 20)); /* 14 MiB left, the module is 16 */
    FY_LAUNCH(1, 32, 0, s, fill_k)(p, 1.0f, 16);
    cr_expect_eq(cudaGetLastError(), cudaErrorMemoryAllocation);
    OK(cudaFree(p));
    float *q;
    OK(cudaMalloc((void **)&q, 64)); /* 18 MiB left */
    FY_LAUNCH(1, 32, 0, s, fill_k)(q, 1.0f, 16);
    cr_expect_eq(cudaGetLastError(), cudaSuccess, "with room for the module, the launch goes");
    OK(cudaStreamSynchronize(s));
}

Test(memory, memset_of_pageable_memory_is_invalid) {
    cudaStream_t s = new_stream();
    char *h = (char *)malloc(4096);
    cr_expect_eq(cudaMemsetAsync(h, 0, 4096, s), cudaErrorInvalidValue);
    cr_expect_eq(cudaGetLastError(), cudaErrorInvalidValue);
    cr_expect_eq(cudaGetLastError(), cudaSuccess, "not sticky");
    void *d, *pin;
    OK(cudaMalloc(&d, 4096));
    OK(cudaMallocHost(&pin, 4096));
    OK(cudaMemsetAsync(d, 0, 4096, s));
    OK(cudaMemsetAsync(pin, 7, 4096, s));
    OK(cudaStreamSynchronize(s));
    cr_expect_eq(((char *)pin)[4095], 7);
    free(h);
}

Test(memory, frees_and_copies_of_what_is_no_allocation_are_invalid) {
    cudaStream_t s = new_stream();
    char *d;
    OK(cudaMalloc((void **)&d, 4096));
    cr_expect_eq(cudaFree(d + 256), cudaErrorInvalidValue, "not the allocation's start");
    int x;
    cr_expect_eq(cudaFree(&x), cudaErrorInvalidValue, "not device memory");
    char h[64];
    cr_expect_eq(cudaMemcpyAsync(h, d + 4090, 64, cudaMemcpyDefault, s), cudaErrorInvalidValue,
                 "past the allocation's end");
    cr_expect_eq(cudaMemcpyAsync(d, h, 64, cudaMemcpyDeviceToHost, s), cudaErrorInvalidValue,
                 "the wrong direction");
    OK(cudaFree(d));
    cr_expect_eq(cudaFree(d), cudaErrorInvalidValue, "freed twice");
    cr_expect_eq(cudaMemcpyAsync(h, d, 64, cudaMemcpyDefault, s), cudaErrorInvalidValue, "freed");
}

/* ---- order ----------------------------------------------------------------------------------- */

Test(order, an_event_orders_two_streams) {
    cudaStream_t a = new_stream(), b = new_stream();
    int *d, *h;
    OK(cudaMalloc((void **)&d, 1024 * sizeof(int)));
    OK(cudaMallocHost((void **)&h, 1024 * sizeof(int)));
    cudaEvent_t e;
    OK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    enqueue_slow_fill(a, d, 42, 1024, 200);
    OK(cudaEventRecord(e, a));
    OK(cudaStreamWaitEvent(b, e, 0));
    OK(cudaMemcpyAsync(h, d, 1024 * sizeof(int), cudaMemcpyDefault, b));
    OK(cudaStreamSynchronize(b));
    for (int i = 0; i < 1024; i++) cr_assert_eq(h[i], 42, "element %d: B ran before A's op", i);
}

Test(order, a_wait_sees_the_record_as_of_the_call) {
    cudaStream_t a = new_stream(), b = new_stream();
    int *d, *h;
    OK(cudaMalloc((void **)&d, sizeof(int)));
    OK(cudaMallocHost((void **)&h, sizeof(int)));
    cudaEvent_t e;
    OK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    enqueue_slow_fill(a, d, 1, 1, 0);
    OK(cudaEventRecord(e, a));
    OK(cudaStreamWaitEvent(b, e, 0));
    enqueue_slow_fill(a, d, 2, 1, 300); /* after the wait was queued: B does not wait for it */
    OK(cudaEventRecord(e, a));
    OK(cudaMemcpyAsync(h, d, sizeof(int), cudaMemcpyDefault, b));
    OK(cudaStreamSynchronize(b));
    cr_expect_eq(*h, 1);
    OK(cudaStreamSynchronize(a));
}

static int order_log[64], order_n;
static void log_fn(void *arg) { order_log[order_n++] = (int)(intptr_t)arg; }
static cudaError_t called_from_host_fn;
static void calls_cuda_fn(void *arg) {
    void *p;
    called_from_host_fn = cudaMalloc(&p, 16);
}

Test(order, host_functions_run_in_stream_order) {
    cudaStream_t s = new_stream();
    int *d;
    OK(cudaMalloc((void **)&d, sizeof(int)));
    for (int i = 0; i < 32; i++) {
        if (i % 4 == 0) enqueue_slow_fill(s, d, i, 1, 5);
        OK(cudaLaunchHostFunc(s, log_fn, (void *)(intptr_t)i));
    }
    OK(cudaStreamSynchronize(s));
    cr_assert_eq(order_n, 32);
    for (int i = 0; i < 32; i++) cr_expect_eq(order_log[i], i);
    OK(cudaLaunchHostFunc(s, calls_cuda_fn, NULL));
    OK(cudaStreamSynchronize(s));
    cr_expect_eq(called_from_host_fn, cudaErrorNotPermitted);
}

Test(order, pageable_copies_are_done_when_they_return) {
    cudaStream_t s = new_stream();
    const int n = 3 << 20; /* 12 MiB: more than one staging buffer */
    int *d, *h = (int *)malloc((size_t)n * sizeof(int));
    OK(cudaMalloc((void **)&d, (size_t)n * sizeof(int)));
    enqueue_slow_fill(s, d, 5, n, 200);
    double t0 = now_s();
    OK(cudaMemcpyAsync(h, d, (size_t)n * sizeof(int), cudaMemcpyDefault, s));
    cr_expect_geq(now_s() - t0, 0.19, "the copy waited for the stream's earlier work");
    for (int i = 0; i < n; i += 4099) cr_assert_eq(h[i], 5, "element %d", i);
    cr_expect_eq(h[n - 1], 5);
    for (int i = 0; i < n; i++) h[i] = i;
    OK(cudaMemcpyAsync(d, h, (size_t)n * sizeof(int), cudaMemcpyHostToDevice, s));
    memset(h, 0, (size_t)n * sizeof(int)); /* the copy is done: this changes nothing there */
    OK(cudaMemcpyAsync(h, d, (size_t)n * sizeof(int), cudaMemcpyDeviceToHost, s));
    for (int i = 0; i < n; i += 4099) cr_assert_eq(h[i], i, "element %d", i);
    cr_expect_eq(h[n - 1], n - 1);
    free(h);
}

Test(order, a_destroyed_stream_finishes_its_work_and_is_gone) {
    cudaStream_t s = new_stream();
    int *d, *h;
    OK(cudaMalloc((void **)&d, sizeof(int)));
    OK(cudaMallocHost((void **)&h, sizeof(int)));
    enqueue_slow_fill(s, d, 9, 1, 100);
    OK(cudaMemcpyAsync(h, d, sizeof(int), cudaMemcpyDefault, s));
    OK(cudaStreamDestroy(s));
    cr_expect_eq(cudaStreamSynchronize(s), cudaErrorInvalidResourceHandle);
    cr_expect_eq(cudaStreamDestroy(s), cudaErrorInvalidResourceHandle);
    OK(cudaDeviceSynchronize());
    cr_expect_eq(*h, 9, "its queued work ran");
}

Test(order, the_legacy_stream_orders_blocking_streams_only) {
    cudaStream_t b, nb = new_stream();
    OK(cudaStreamCreate(&b)); /* blocking */
    int *d, *h;
    OK(cudaMalloc((void **)&d, sizeof(int)));
    OK(cudaMallocHost((void **)&h, 3 * sizeof(int)));
    enqueue_slow_fill(b, d, 3, 1, 200);
    OK(cudaMemcpyAsync(h, d, sizeof(int), cudaMemcpyDefault, 0));
    OK(cudaStreamSynchronize(0));
    cr_expect_eq(h[0], 3, "the legacy stream waited for the blocking stream's work");
    enqueue_slow_fill(0, d, 4, 1, 400);
    OK(cudaMemcpyAsync(h + 1, d, sizeof(int), cudaMemcpyDefault, nb));
    OK(cudaMemcpyAsync(h + 2, d, sizeof(int), cudaMemcpyDefault, b));
    OK(cudaStreamSynchronize(nb));
    cr_expect_eq(h[1], 3, "a non-blocking stream does not wait for the legacy stream");
    OK(cudaStreamSynchronize(b));
    cr_expect_eq(h[2], 4, "a blocking stream does");
}

/* ---- events ------------------------------------------------------------------------------------ */

Test(events, a_wait_on_an_event_never_recorded_is_caught) {
    cudaStream_t s = new_stream();
    cudaEvent_t e;
    OK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    cr_expect_eq(cudaStreamWaitEvent(s, e, 0), cudaErrorIllegalState);
    cr_expect_eq(cudaEventSynchronize(e), cudaErrorIllegalState);
    cr_expect_eq(cudaEventQuery(e), cudaSuccess, "a query is no wait: done, as CUDA says");
}

Test(events, never_recorded_is_a_warning_when_not_strict) {
    setenv("FERRY_EMU_STRICT", "0", 1);
    cudaStream_t s = new_stream();
    cudaEvent_t e;
    OK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    OK(cudaStreamWaitEvent(s, e, 0));
    OK(cudaEventSynchronize(e));
}

Test(events, elapsed_time_needs_timing_and_completion) {
    cudaStream_t s = new_stream();
    int *d;
    OK(cudaMalloc((void **)&d, sizeof(int)));
    cudaEvent_t t0, t1, nt;
    OK(cudaEventCreate(&t0));
    OK(cudaEventCreate(&t1));
    OK(cudaEventCreateWithFlags(&nt, cudaEventDisableTiming));
    float ms;
    cr_expect_eq(cudaEventElapsedTime(&ms, t0, t1), cudaErrorInvalidResourceHandle, "never recorded");
    OK(cudaEventRecord(t0, s));
    enqueue_slow_fill(s, d, 1, 1, 150);
    OK(cudaEventRecord(t1, s));
    OK(cudaEventRecord(nt, s));
    cr_expect_eq(cudaEventElapsedTime(&ms, t0, t1), cudaErrorNotReady);
    cr_expect_eq(cudaEventQuery(t1), cudaErrorNotReady);
    OK(cudaEventSynchronize(t1));
    OK(cudaEventElapsedTime(&ms, t0, t1));
    cr_expect(ms >= 140.0f && ms < 5000.0f, "%.1f ms around a 150 ms op", (double)ms);
    cr_expect_eq(cudaEventElapsedTime(&ms, t0, nt), cudaErrorInvalidResourceHandle, "no timing");
    OK(cudaEventDestroy(nt));
    cr_expect_eq(cudaEventQuery(nt), cudaErrorInvalidResourceHandle, "destroyed");
}

/* The calling thread's CPU seconds over a synchronisation of a 300 ms op. */
static double cpu_of_event_sync(unsigned flags) {
    cudaStream_t s = new_stream();
    int *d;
    OK(cudaMalloc((void **)&d, sizeof(int)));
    cudaEvent_t e;
    OK(cudaEventCreateWithFlags(&e, flags | cudaEventDisableTiming));
    enqueue_slow_fill(s, d, 1, 1, 300);
    OK(cudaEventRecord(e, s));
    double c0 = thread_cpu_s();
    OK(cudaEventSynchronize(e));
    return thread_cpu_s() - c0;
}

/* The bounds leave room for a loaded machine (meson runs suites side by side on two
 * cores): a spinning thread then gets a share of a core, still 30 ms or more in 300 ms,
 * where a sleeping one takes a few hundred microseconds. */
Test(events, a_sync_without_blocking_sync_spins) {
    double cpu = cpu_of_event_sync(cudaEventDefault);
    cr_expect_gt(cpu, 0.03, "%.3f s of CPU in a 300 ms wait: a busy wait burns CPU", cpu);
}

Test(events, a_sync_with_blocking_sync_sleeps) {
    double cpu = cpu_of_event_sync(cudaEventBlockingSync);
    cr_expect_lt(cpu, 0.02, "%.3f s of CPU in a 300 ms wait: a blocking wait sleeps", cpu);
}

/* ---- launches and the device process ----------------------------------------------------------- */

Test(launch, a_bad_configuration_is_the_launch_error) {
    cudaStream_t s = new_stream();
    float *p;
    OK(cudaMalloc((void **)&p, 4096));
    FY_LAUNCH(1, 2048, 0, s, fill_k)(p, 1.0f, 16);
    cr_expect_eq(cudaPeekAtLastError(), cudaErrorInvalidConfiguration);
    cr_expect_eq(cudaGetLastError(), cudaErrorInvalidConfiguration);
    cr_expect_eq(cudaGetLastError(), cudaSuccess, "not sticky");
    OK(cudaStreamSynchronize(s));
}

Test(launch, the_race_check_passes_a_kernel_without_races) {
    setenv("FERRY_EMU_RACECHECK", "1", 1);
    cudaStream_t s = new_stream();
    float *p;
    OK(cudaMalloc((void **)&p, 1000 * sizeof(float)));
    FY_LAUNCH(4, 256, 0, s, fill_k)(p, 1.0f, 1000);
    OK(cudaStreamSynchronize(s));
}

Test(launch, the_race_check_stops_a_race) {
    setenv("FERRY_EMU_RACECHECK", "1", 1);
    cudaStream_t s = new_stream();
    int *p;
    OK(cudaMalloc((void **)&p, sizeof(int)));
    FY_LAUNCH(1, 64, 0, s, racy_k)(p);
    cr_expect_eq(cudaStreamSynchronize(s), cudaErrorLaunchFailure);
}

Test(launch, a_crash_of_the_device_process_is_an_error) {
    cudaStream_t s = new_stream();
    OK(fy_emu_enqueue(s, abort_fn, NULL, 0, "abort"));
    cr_expect_eq(cudaStreamSynchronize(s), cudaErrorLaunchFailure);
    void *p;
    cr_expect_eq(cudaMalloc(&p, 16), cudaErrorLaunchFailure);
}

typedef struct probe {
    void *dev, *pinned, *pageable;
    int *out; /* pinned: what the device process saw */
} probe;

static cudaError_t probe_fn(void *a) {
    const probe *p = (const probe *)a;
    void *q;
    p->out[0] = fy_emu_mem_of(p->dev, 16);
    p->out[1] = fy_emu_mem_of(p->pinned, 16);
    p->out[2] = fy_emu_mem_of(p->pageable, 16);
    p->out[3] = fy_emu_on_device();
    p->out[4] = cudaMalloc(&q, 16);
    return cudaSuccess;
}

Test(launch, pointers_are_classified_in_both_processes) {
    cudaStream_t s = new_stream();
    char *d, *pin, page[64];
    int *out;
    OK(cudaMalloc((void **)&d, 4096));
    OK(cudaHostAlloc((void **)&pin, 4096, cudaHostAllocPortable));
    OK(cudaMallocHost((void **)&out, 8 * sizeof(int)));
    cr_expect_eq(fy_emu_mem_of(d, 4096), FY_EMU_DEVICE);
    cr_expect_eq(fy_emu_mem_of(d + 4000, 97), FY_EMU_INVALID, "past the end");
    cr_expect_eq(fy_emu_mem_of(pin + 10, 100), FY_EMU_PINNED);
    cr_expect_eq(fy_emu_mem_of(page, sizeof page), FY_EMU_PAGEABLE);
    cr_expect_not(fy_emu_on_device());
    probe p = {d, pin, page, out};
    OK(fy_emu_enqueue(s, probe_fn, &p, sizeof p, "probe"));
    OK(cudaStreamSynchronize(s));
    cr_expect_eq(out[0], FY_EMU_DEVICE);
    cr_expect_eq(out[1], FY_EMU_PINNED);
    cr_expect_eq(out[2], FY_EMU_PAGEABLE);
    cr_expect_eq(out[3], 1, "the work ran in the device process");
    cr_expect_eq(out[4], cudaErrorNotPermitted, "no runtime calls inside device work");
    struct cudaPointerAttributes at;
    OK(cudaPointerGetAttributes(&at, d + 8));
    cr_expect(at.type == cudaMemoryTypeDevice && at.device == 0 && at.devicePointer == d + 8);
    OK(cudaPointerGetAttributes(&at, pin));
    cr_expect(at.type == cudaMemoryTypeHost && at.hostPointer == pin);
    OK(cudaPointerGetAttributes(&at, page));
    cr_expect_eq(at.type, cudaMemoryTypeUnregistered);
    OK(cudaFreeHost(pin));
    cr_expect_eq(cudaPointerGetAttributes(&at, pin), cudaErrorInvalidValue, "freed");
}

Test(launch, the_device_looks_like_one) {
    setenv("FERRY_EMU_GPUS", "2", 1);
    setenv("FERRY_EMU_GPU_MEM", "4G", 1);
    int n, v;
    OK(cudaGetDeviceCount(&n));
    cr_expect_eq(n, 2);
    struct cudaDeviceProp p;
    OK(cudaGetDeviceProperties(&p, 1));
    cr_expect_str_eq(p.name, "Emulated GPU (ferry, 4096 MiB)");
    cr_expect_eq(p.totalGlobalMem, (size_t)4 << 30);
    cr_expect(p.major == 9 && p.minor == 0 && p.multiProcessorCount == 132);
    cr_expect_eq(cudaGetDeviceProperties(&p, 2), cudaErrorInvalidDevice);
    OK(cudaDriverGetVersion(&v));
    cr_expect_eq(v, CUDART_VERSION);
    size_t f0, f1, t;
    OK(cudaSetDevice(1));
    OK(cudaMemGetInfo(&f1, &t));
    OK(cudaSetDevice(0));
    OK(cudaMemGetInfo(&f0, &t));
    cr_expect_eq(f0, f1, "each device has its context");
    cr_expect_str_eq(cudaGetErrorName(cudaErrorIllegalAddress), "cudaErrorIllegalAddress");
    cr_expect_str_eq(cudaGetErrorString(cudaErrorIllegalAddress), "an illegal memory access was encountered");
}

static cudaStream_t lane_stream;
static cudaError_t lane_result;
static void *lane(void *arg) {
    lane_result = cudaStreamQuery(lane_stream); /* never called cudaSetDevice */
    return NULL;
}

Test(launch, devices_are_per_thread_and_their_handles_theirs) {
    setenv("FERRY_EMU_GPUS", "2", 1);
    char path[] = "/tmp/fy_test_rt_XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    unlink(path);
    dup2(fd, 2); /* the emulation's reports */
    OK(cudaSetDevice(1));
    lane_stream = new_stream();
    pthread_t t;
    cr_assert_eq(pthread_create(&t, NULL, lane, NULL), 0);
    pthread_join(t, NULL);
    OK(lane_result);
    size_t f0, f1, total;
    OK(cudaMemGetInfo(&f1, &total));
    OK(cudaSetDevice(0));
    OK(cudaMemGetInfo(&f0, &total));
    cr_expect_eq(f0, f1, "GPU 0 has a context too, and its memory is taken");
    float *p;
    OK(cudaMalloc((void **)&p, 64));
    FY_LAUNCH(1, 32, 0, lane_stream, fill_k)(p, 1.0f, 16);
    cr_expect_eq(cudaGetLastError(), cudaErrorInvalidResourceHandle, "a launch on GPU 1's stream from GPU 0");
    cudaEvent_t e;
    OK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    cr_expect_eq(cudaEventRecord(e, lane_stream), cudaErrorInvalidResourceHandle, "GPU 0's event, GPU 1's stream");
    char buf[1024] = "";
    ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
    buf[n > 0 ? n : 0] = 0;
    cr_expect(strstr(buf, "never called cudaSetDevice uses GPU 0") != NULL, "reported:\n%s", buf);
}

Test(launch, an_old_driver_is_insufficient) {
    setenv("FERRY_EMU_DRIVER_VERSION", "12080", 1);
    int n = 1, v;
    cr_expect_eq(cudaGetDeviceCount(&n), cudaErrorInsufficientDriver);
    cr_expect_eq(n, 0);
    OK(cudaDriverGetVersion(&v));
    cr_expect_eq(v, 12080);
}
