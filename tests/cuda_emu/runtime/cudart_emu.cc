/* cudart_emu.cc — the emulated runtime's devices, versions and errors (cudart_emu.h).
 *
 * Devices: FERRY_EMU_GPUS of them (default 1), "Emulated GPU (ferry, N MiB)", compute
 * capability 9.0 with 132 SMs (an H100 SXM's), FERRY_EMU_GPU_MEM each. The current device
 * is per thread; a thread that never set one uses device 0, and the first call that needs
 * a context on a device creates it, as CUDA's runtime does (cudaSetDevice creates it
 * since CUDA 12; its memory is charged: cudart_emu_mem.cc). A thread that never set a
 * device creating GPU 0's context while another GPU has one is reported.
 *
 * Versions: cudaRuntimeGetVersion is the toolkit's CUDART_VERSION; cudaDriverGetVersion
 * is FERRY_EMU_DRIVER_VERSION if set, else the same. A driver of an older major version
 * than the runtime makes every call that needs the device cudaErrorInsufficientDriver
 * (minor versions are compatible, as CUDA's).
 *
 * Errors: the calling thread's last error is the latest failure of a call on it, which
 * cudaGetLastError returns and clears and cudaPeekAtLastError returns; a device's sticky
 * error is returned by every later call that touches the device and is never cleared.
 * A host function (cudaLaunchHostFunc) that calls the runtime gets
 * cudaErrorNotPermitted. */
#include "tests/cuda_emu/runtime/cudart_emu.h"

#include <stdio.h>
#include <string.h>

thread_local bool emu_in_host_fn;
static thread_local int tl_dev = -1;      /* -1: never set, device 0 */
static thread_local cudaError_t tl_last = cudaSuccess;

#define EMU_SM_COUNT 132

cudaError_t emu_ret(cudaError_t e) {
    if (e != cudaSuccess) tl_last = e;
    return e;
}

static int current(void) { return tl_dev < 0 ? 0 : tl_dev; }

/* A thread that never set a device is about to create GPU 0's context: reported when the
 * process works on another GPU (a context there it never meant to have, and its memory:
 * on a machine whose GPU 0 is another process's, that one's memory). */
static void stray_context(void) {
    for (int d = 1; d < g_emu.ngpus; d++)
        if (g_emu.gpu[d].ctx.load()) {
            fy_emu_report("a thread that never called cudaSetDevice uses GPU 0 (CUDA's default) and "
                          "creates its context, while the process works on GPU %d", d);
            return;
        }
}

cudaError_t emu_enter(bool ctx, int *dev) {
    *dev = 0;
    cudaError_t e = emu_init();
    if (e != cudaSuccess) return e;
    if (fy_emu_on_device()) {
        fy_emu_report("a CUDA runtime call inside device work: not permitted");
        return cudaErrorNotPermitted;
    }
    if (emu_in_host_fn) {
        fy_emu_report("a CUDA call from a host function (cudaLaunchHostFunc): not permitted");
        return cudaErrorNotPermitted;
    }
    *dev = current();
    if (!ctx) return cudaSuccess;
    if ((e = emu_sticky(*dev)) != cudaSuccess) return e;
    if (tl_dev < 0 && !g_emu.gpu[0].ctx.load()) stray_context();
    return emu_ctx(*dev);
}

/* ---- devices ----------------------------------------------------------------------------- */

cudaError_t cudaGetDeviceCount(int *count) {
    if (!count) return emu_ret(cudaErrorInvalidValue);
    *count = 0;
    EMU_ENTER(false, d);
    (void)d;
    *count = g_emu.ngpus;
    return cudaSuccess;
}

cudaError_t cudaGetDevice(int *device) {
    EMU_ENTER(false, d);
    if (!device) return emu_ret(cudaErrorInvalidValue);
    *device = d;
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
    EMU_ENTER(false, d);
    (void)d;
    if (device < 0 || device >= g_emu.ngpus) return emu_ret(cudaErrorInvalidDevice);
    tl_dev = device;
    cudaError_t e = emu_sticky(device);
    return emu_ret(e != cudaSuccess ? e : emu_ctx(device));
}

cudaError_t cudaSetDeviceFlags(unsigned int flags) {
    EMU_ENTER(true, d);
    if ((flags & ~(unsigned)cudaDeviceMask) || (flags & cudaDeviceScheduleMask) > cudaDeviceScheduleBlockingSync ||
        (flags & cudaDeviceScheduleMask) == 3)
        return emu_ret(cudaErrorInvalidValue);
    g_emu.gpu[d].flags.store(flags);
    return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device) {
    EMU_ENTER(false, d);
    (void)d;
    if (!prop) return emu_ret(cudaErrorInvalidValue);
    if (device < 0 || device >= g_emu.ngpus) return emu_ret(cudaErrorInvalidDevice);
    memset(prop, 0, sizeof *prop);
    snprintf(prop->name, sizeof prop->name, "Emulated GPU (ferry, %zu MiB)", g_emu.capacity >> 20);
    prop->totalGlobalMem = g_emu.capacity;
    prop->sharedMemPerBlock = 48 << 10;
    prop->regsPerBlock = 65536;
    prop->warpSize = 32;
    prop->memPitch = (size_t)1 << 31;
    prop->maxThreadsPerBlock = 1024;
    prop->maxThreadsDim[0] = 1024;
    prop->maxThreadsDim[1] = 1024;
    prop->maxThreadsDim[2] = 64;
    prop->maxGridSize[0] = 0x7fffffff;
    prop->maxGridSize[1] = 65535;
    prop->maxGridSize[2] = 65535;
    prop->totalConstMem = 64 << 10;
    prop->major = 9;
    prop->minor = 0;
    prop->multiProcessorCount = EMU_SM_COUNT;
    prop->canMapHostMemory = 1;
    prop->concurrentKernels = 1;
    prop->pciBusID = device + 1;
    prop->asyncEngineCount = 2;
    prop->unifiedAddressing = 1;
    prop->maxThreadsPerMultiProcessor = 2048;
    prop->sharedMemPerMultiprocessor = 228 << 10;
    prop->regsPerMultiprocessor = 65536;
    prop->maxBlocksPerMultiProcessor = 32;
    return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int *driverVersion) {
    if (!driverVersion) return emu_ret(cudaErrorInvalidValue);
    emu_init(); /* reads FERRY_EMU_DRIVER_VERSION; its failures are other calls' */
    *driverVersion = g_emu.driver_version;
    return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int *runtimeVersion) {
    if (!runtimeVersion) return emu_ret(cudaErrorInvalidValue);
    *runtimeVersion = CUDART_VERSION;
    return cudaSuccess;
}

/* ---- errors -------------------------------------------------------------------------------- */

/* Every code the emulation returns (and the usual others), with CUDA's name and message. */
#define EMU_ERRORS(X)                                                                               \
    X(cudaSuccess, "no error")                                                                     \
    X(cudaErrorInvalidValue, "invalid argument")                                                   \
    X(cudaErrorMemoryAllocation, "out of memory")                                                  \
    X(cudaErrorInitializationError, "initialization error")                                        \
    X(cudaErrorLaunchTimeout, "the launch timed out and was terminated")                           \
    X(cudaErrorLaunchOutOfResources, "too many resources requested for launch")                    \
    X(cudaErrorInvalidConfiguration, "invalid configuration argument")                             \
    X(cudaErrorInvalidDevicePointer, "invalid device pointer")                                      \
    X(cudaErrorInvalidMemcpyDirection, "invalid copy direction for memcpy")                        \
    X(cudaErrorInsufficientDriver, "CUDA driver version is insufficient for CUDA runtime version") \
    X(cudaErrorSetOnActiveProcess, "cannot set while device is active in this process")            \
    X(cudaErrorInvalidDeviceFunction, "invalid device function")                                   \
    X(cudaErrorNoDevice, "no CUDA-capable device is detected")                                     \
    X(cudaErrorInvalidDevice, "invalid device ordinal")                                            \
    X(cudaErrorInvalidResourceHandle, "invalid resource handle")                                   \
    X(cudaErrorIllegalState, "the operation cannot be performed in the present state")            \
    X(cudaErrorNotReady, "device not ready")                                                       \
    X(cudaErrorIllegalAddress, "an illegal memory access was encountered")                         \
    X(cudaErrorHardwareStackError, "hardware stack error")                                         \
    X(cudaErrorIllegalInstruction, "an illegal instruction was encountered")                      \
    X(cudaErrorMisalignedAddress, "misaligned address")                                            \
    X(cudaErrorAssert, "device-side assert triggered")                                             \
    X(cudaErrorLaunchFailure, "unspecified launch failure")                                        \
    X(cudaErrorNotPermitted, "operation not permitted")                                            \
    X(cudaErrorNotSupported, "operation not supported")                                            \
    X(cudaErrorUnknown, "unknown error")

const char *cudaGetErrorName(cudaError_t error) {
    switch (error) {
#define EMU_NAME(code, msg) case code: return #code;
        EMU_ERRORS(EMU_NAME)
#undef EMU_NAME
    default: return "unrecognized error code";
    }
}

const char *cudaGetErrorString(cudaError_t error) {
    switch (error) {
#define EMU_STRING(code, msg) case code: return msg;
        EMU_ERRORS(EMU_STRING)
#undef EMU_STRING
    default: return "unrecognized error code";
    }
}

/* The current device's sticky error, else the thread's last error. */
static cudaError_t last_error(void) {
    if (emu_init() == cudaSuccess) {
        cudaError_t e = emu_sticky(current());
        if (e != cudaSuccess) return e;
    }
    return tl_last;
}

cudaError_t cudaGetLastError(void) {
    cudaError_t e = last_error();
    tl_last = cudaSuccess;
    return e;
}

cudaError_t cudaPeekAtLastError(void) { return last_error(); }
