/* cuda_emu.h — CUDA C on the CPU, for ferry's own kernels: what
 * engine/device/cuda/cuda_kernels.cu uses, compiled by the host C++ compiler with
 * -DFY_CUDA_EMU and tests/cuda_emu/include first on the include path (its cuda_*.h
 * include this file), so the kernels are the same source nvcc builds.
 *
 * What it supports, and how:
 *   launches      FY_LAUNCH(grid, block, shared, stream, kernel)(args): runs the grid
 *                 there and then (the stream is ignored), one block at a time, every
 *                 thread of a block a fiber with its own stack (a register switch on
 *                 x86-64, ucontext elsewhere);
 *   indices       threadIdx, blockIdx, blockDim, gridDim (dim3, uint3);
 *   __syncthreads a barrier over the block's threads that have not returned; a thread
 *                 that waits while another waits at a warp operation is a deadlock
 *                 (divergent barrier), reported with the kernel's name;
 *   __shared__    static variables in one linker section, every byte set to 0xff
 *                 before each block (NaN, -1), so a kernel that reads shared memory before
 *                 its block writes it gets poison, not the previous block's values (blocks
 *                 run one at a time; launches from several OS threads take turns).
 *                 Dynamic shared memory (extern __shared__) does not compile;
 *   warps         __shfl_sync, __shfl_xor_sync, __ballot_sync: a barrier over the warp's
 *                 32 lanes, which all must be there at the same operation (the same
 *                 kind, each lane's n-th warp operation); full masks only: a lane that
 *                 returned, a partial mask or a partial warp is an error; __ffs;
 *   tensor cores  fy_mma_16816_bf16, the kernels' wrapper of mma.sync.aligned.m16n8k16
 *                 .row.col.f32.bf16.bf16.f32 (inline PTX under nvcc): the lanes exchange
 *                 their A and B fragments (three warp operations) and each computes its
 *                 four outputs by the PTX ISA's fragment layouts (section "Matrix Fragments
 *                 for mma.m16n8k16 with floating point type"), summing the 16 exact bf16
 *                 products onto c in k order in fp32 (the GPU's internal order and
 *                 intermediate precision are not documented: results agree to fp32
 *                 rounding, not bitwise);
 *   arithmetic    __fmul_rn, __fmaf_rn, __fdiv_rn, __fsqrt_rn, __dadd_rn, __dmul_rn as
 *                 IEEE operations (this file's users compile with -ffp-contract=off, so
 *                 nothing is fused unasked); expf, tanhf, sqrtf, fmaxf... are the C
 *                 library's, which differ from CUDA's in the last ulps (the tests'
 *                 tolerances cover it); bf16 and fp16 conversions round to nearest even
 *                 (NaN stays NaN), as the GPU's __float2bfloat16_rn and __float2half_rn;
 *   errors        cudaGetLastError reports a launch CUDA refuses (more than 1024
 *                 threads a block, block.z over 64, grid.y or grid.z over 65535, an empty
 *                 grid or block; dynamic shared memory);
 *   orders        the blocks of a grid, and between barriers the runnable threads of a
 *                 block, run in the order the caller sets (fy_emu_set_order: forward,
 *                 reverse, shuffled): a kernel whose results depend on it has a race
 *                 (tests/cuda_emu/emu_dev.cc runs every kernel in all three, compares,
 *                 and aborts naming the kernel).
 * Anything else a kernel could use (atomics, other intrinsics, textures, cooperative
 * groups) is not declared here, so it fails to compile rather than run wrongly.
 *
 * Two builds use it. The kernel tests' (FY_CUDA_EMU alone): the types above are this
 * file's, a launch runs the grid there and then on the calling thread, and the cuda
 * backend's entry points are renamed (below). The emulated CUDA runtime's (also
 * FY_CUDA_EMU_RT, -Dcuda=emulated; tests/cuda_emu/runtime): the types are the toolkit's
 * (include/cuda_runtime_api.h passes the real header through), cudaGetLastError is the
 * runtime's, and a launch checks its configuration, copies its arguments (trivially
 * copyable) and queues the grid on the stream (fy_emu_launch), which the emulated
 * device's process runs in stream order.
 *
 * What it cannot see: a thread runs from one barrier or warp operation to the next
 * without interruption, so a read-modify-write race whose result is the same in every
 * order (every thread adding 1 to one shared counter) passes, where a GPU loses updates;
 * ferry's kernels have no such updates (each element has one writer between barriers).
 * Math functions (expf, tanhf, sincos) are glibc's, within the tests' tolerances of
 * CUDA's; products and sums are never fused (-ffp-contract=off), where nvcc fuses
 * a*b+c by default, so a bit-exact check passing here proves GPU bits only for code
 * without such expressions or with _rn intrinsics (ferry's bit-exact kernels). */
#ifndef FY_CUDA_EMU_H
#define FY_CUDA_EMU_H

#ifndef __cplusplus
#error "cuda_emu.h is for the C++ compilation of CUDA sources"
#endif

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <tuple>
#include <type_traits>
#include <utility>

#ifdef FY_CUDA_EMU_RT
#include <cuda_runtime_api.h>
#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __shared__
#endif

/* Kernels get internal linkage. In the kernel tests' build the backend's entry points get
 * other names too: a build with the real cuda backend links both objects into the
 * emulation's tests, and neither may stand in for the other. */
#define __global__ static
#define __device__
#define __host__
#define __forceinline__ inline
#ifndef FY_CUDA_EMU_RT
#define fy_cu_exec_kernel fy_emu_cu_exec_kernel
#define fy_cu_colsum_acc fy_emu_cu_colsum_acc
#define fy_cu_bias_fill fy_emu_cu_bias_fill
#endif
/* Shared memory: one section of static variables, poisoned (every byte 0xff: NaN, -1)
 * before each block, so a read before the block's own write shows; emulated launches are
 * serialised across OS threads (the section is the process's). */
#define __shared__ __attribute__((section("fy_emu_shared"))) static

/* The shared-memory section's bounds (the linker's), taken where the kernels are; weak:
 * a program with no __shared__ variable has no section. */
extern "C" char __start_fy_emu_shared __attribute__((weak));
extern "C" char __stop_fy_emu_shared __attribute__((weak));

/* ---- the runtime's types ---------------------------------------------------------- */

#ifndef FY_CUDA_EMU_RT
typedef struct CUstream_st *cudaStream_t;
typedef enum cudaError { cudaSuccess = 0, cudaErrorInvalidConfiguration = 9,
                         cudaErrorLaunchFailure = 4 } cudaError_t;
cudaError_t cudaGetLastError(void);
const char *cudaGetErrorString(cudaError_t e);

struct uint3 { unsigned x, y, z; };
struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
#else
/* The runtime's launch (tests/cuda_emu/runtime/cudart_emu_launch.cc): checks the
 * configuration (a bad one is the calling thread's next cudaGetLastError, as CUDA's),
 * charges the kernels' module at a device's first launch, and queues run on the stream
 * with a copy of args[0, nbytes). ptrs[0, nptrs) are the kernel's pointer arguments (NULL
 * for the others), checked for pageable host memory, which the device cannot read. */
extern "C" void fy_emu_launch(cudaStream_t s, dim3 grid, dim3 block, size_t shmem, const char *name,
                              cudaError_t (*run)(void *args), const void *args, size_t nbytes,
                              const void *const *ptrs, int nptrs);
#endif

/* ---- bf16 and fp16 ------------------------------------------------------------------ */

struct __nv_bfloat16 { uint16_t bits; };
struct __half { uint16_t bits; };

static inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    __nv_bfloat16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) r.bits = 0x7fff; /* CUDA's canonical NaN */
    else r.bits = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return r;
}
static inline float __bfloat162float(__nv_bfloat16 b) {
    uint32_t u = (uint32_t)b.bits << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline __half __float2half_rn(float f) {
    _Float16 h = (_Float16)f; /* IEEE conversion, round to nearest even */
    __half r;
    memcpy(&r.bits, &h, 2);
    if (f != f) r.bits = 0x7fff; /* CUDA's canonical NaN */
    return r;
}
static inline float __half2float(__half h) {
    _Float16 x;
    memcpy(&x, &h.bits, 2);
    return (float)x;
}

/* ---- round-to-nearest arithmetic ---------------------------------------------------- */

static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fsqrt_rn(float a) { return sqrtf(a); }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dmul_rn(double a, double b) { return a * b; }

/* ---- threads, barriers, warps ---------------------------------------------------------- */

namespace fy_emu {

struct thread_state; /* cuda_emu.cc */

/* The fiber running now, the block and the launch: per OS thread. */
extern thread_local uint3 cur_thread_idx, cur_block_idx;
extern thread_local dim3 cur_block_dim, cur_grid_dim;

void syncthreads();
/* The warp exchange: every lane of the calling lane's warp deposits `value` (8 bytes)
 * and waits; then each gets back the 32 deposits. Lanes at different operations (`kind`,
 * or each lane's count of them) are an error. */
void warp_exchange(uint64_t value, uint64_t out[32], int kind);
int lane_of_caller();

/* Whether CUDA launches a grid of this shape: at most 1024 threads a block, block.z at
 * most 64, grid.x at most 2^31 - 1, grid.y and grid.z at most 65535, nothing empty, no
 * dynamic shared memory (not emulated). */
bool launch_config_ok(dim3 grid, dim3 block, size_t shmem);
/* Runs fn(ctx) as every thread of every block of the grid (see the top); [shared_lo,
 * shared_hi) is the __shared__ section of the program the kernel is in. A configuration
 * launch_config_ok refuses is the launch's error (kernel tests) or a bug (the runtime
 * checked it before queueing). */
void run_grid(dim3 grid, dim3 block, size_t shmem, const char *name, void (*fn)(void *), void *ctx,
              char *shared_lo, char *shared_hi);

template <typename T> static inline uint64_t to_bits(T v) {
    static_assert(sizeof(T) <= 8, "warp values of at most 8 bytes");
    uint64_t u = 0;
    memcpy(&u, &v, sizeof v);
    return u;
}
template <typename T> static inline T from_bits(uint64_t u) {
    T v;
    memcpy(&v, &u, sizeof v);
    return v;
}
void check_full_mask(unsigned mask);

#ifndef FY_CUDA_EMU_RT
/* FY_LAUNCH's object: launch(...)(args) runs kernel(args) on the grid. */
template <typename... P> struct launcher {
    dim3 grid, block;
    size_t shmem;
    const char *name;
    void (*kernel)(P...);
    void operator()(P... a) const { /* converted at the call, as a kernel's arguments are */
        std::tuple<P...> args(a...);
        struct call {
            void (*k)(P...);
            std::tuple<P...> *args;
            static void run(void *c) {
                call *self = static_cast<call *>(c);
                std::apply(self->k, *self->args);
            }
        } c{kernel, &args};
        run_grid(grid, block, shmem, name, &call::run, &c, &__start_fy_emu_shared,
                 &__stop_fy_emu_shared);
    }
};
template <typename... P>
launcher<P...> launch(dim3 grid, dim3 block, size_t shmem, const char *name, void (*k)(P...)) {
    return launcher<P...>{grid, block, shmem, name, k};
}
#else
/* A kernel's arguments as one trivially copyable aggregate, copied to the device as
 * bytes: head, then the rest. */
template <typename... P> struct arg_pack {};
template <typename H, typename... R> struct arg_pack<H, R...> {
    H head;
    arg_pack<R...> rest;
};
static inline arg_pack<> pack_args() { return arg_pack<>{}; }
template <typename H, typename... R> static inline arg_pack<H, R...> pack_args(H h, R... r) {
    return arg_pack<H, R...>{h, pack_args(r...)};
}
/* k(the pack's values in order) */
template <typename K, typename... Done> static inline void apply_args(K k, const arg_pack<> &, Done... d) {
    k(d...);
}
template <typename K, typename H, typename... R, typename... Done>
static inline void apply_args(K k, const arg_pack<H, R...> &p, Done... d) {
    apply_args(k, p.rest, d..., p.head);
}

/* An argument if it is a pointer, else NULL. */
template <typename T> static inline const void *pointer_arg(T v) {
    if constexpr (std::is_pointer<T>::value) return (const void *)v;
    else return nullptr;
}

/* FY_LAUNCH's object: launch(...)(args) queues kernel(args) on the stream. The queued
 * call lives in the program that has the kernel (this template is instantiated there),
 * which the device's process, a fork of it, has too. (Not named launcher: a test program
 * may hold both builds' templates.) */
template <typename... P> struct queued_launcher {
    dim3 grid, block;
    size_t shmem;
    cudaStream_t stream;
    const char *name;
    void (*kernel)(P...);
    struct call {
        void (*k)(P...);
        dim3 grid, block;
        const char *name;
        char *shared_lo, *shared_hi;
        arg_pack<P...> args;
        static void body(void *c) {
            const call *self = static_cast<const call *>(c);
            apply_args(self->k, self->args);
        }
        static cudaError_t run(void *c) {
            call *self = static_cast<call *>(c);
            run_grid(self->grid, self->block, 0, self->name, &body, c, self->shared_lo, self->shared_hi);
            return cudaSuccess;
        }
    };
    void operator()(P... a) const { /* converted at the call, as a kernel's arguments are */
        static_assert((std::is_trivially_copyable<P>::value && ...),
                      "a kernel's arguments are copied to the device: trivially copyable");
        call c{kernel, grid, block, name, &__start_fy_emu_shared, &__stop_fy_emu_shared, pack_args(a...)};
        const void *ptrs[sizeof...(P) + 1] = {pointer_arg(a)..., nullptr};
        fy_emu_launch(stream, grid, block, shmem, name, &call::run, &c, sizeof c, ptrs, (int)sizeof...(P));
    }
};
template <typename... P>
queued_launcher<P...> launch(dim3 grid, dim3 block, size_t shmem, cudaStream_t stream, const char *name,
                             void (*k)(P...)) {
    return queued_launcher<P...>{grid, block, shmem, stream, name, k};
}
#endif

} /* namespace fy_emu */

#define threadIdx (fy_emu::cur_thread_idx)
#define blockIdx (fy_emu::cur_block_idx)
#define blockDim (fy_emu::cur_block_dim)
#define gridDim (fy_emu::cur_grid_dim)

static inline void __syncthreads(void) { fy_emu::syncthreads(); }

template <typename T> static inline T __shfl_sync(unsigned mask, T v, int src) {
    fy_emu::check_full_mask(mask);
    uint64_t all[32];
    fy_emu::warp_exchange(fy_emu::to_bits(v), all, 1);
    return fy_emu::from_bits<T>(all[src & 31]);
}
template <typename T> static inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
    fy_emu::check_full_mask(mask);
    uint64_t all[32];
    fy_emu::warp_exchange(fy_emu::to_bits(v), all, 2);
    const int src = fy_emu::lane_of_caller() ^ lane_mask; /* outside the warp: its own */
    return src < 32 ? fy_emu::from_bits<T>(all[src]) : v;
}
static inline unsigned __ballot_sync(unsigned mask, int pred) {
    fy_emu::check_full_mask(mask);
    uint64_t all[32];
    fy_emu::warp_exchange(pred ? 1u : 0u, all, 3);
    unsigned r = 0;
    for (int l = 0; l < 32; l++) r |= (all[l] ? 1u : 0u) << l;
    return r;
}
static inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }

/* D (16x8) = A (16x16) B (16x8) + C in fp32, a warp's collective operation: each lane
 * passes its fragments (a: four registers of two bf16, the lower index in the low half;
 * b: two; c and d: four floats) laid out as the PTX ISA documents for m16n8k16 (see the
 * top); d may be c. */
void fy_mma_16816_bf16(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4]);

#ifndef FY_CUDA_EMU_RT
#define FY_LAUNCH(grid, block, shmem, stream, ...) \
    (void)(stream), fy_emu::launch(dim3(grid), dim3(block), (shmem), #__VA_ARGS__, __VA_ARGS__)
#else
#define FY_LAUNCH(grid, block, shmem, stream, ...) \
    fy_emu::launch(dim3(grid), dim3(block), (shmem), (stream), #__VA_ARGS__, __VA_ARGS__)
#endif

/* The order runnable threads take between barriers: 0 forward, 1 reverse, 2 shuffled
 * (seeded per launch). Per OS thread. */
extern "C" void fy_emu_set_order(int order);

/* The race check: run(ctx) three times, the threads in forward, reverse and shuffled
 * order, each from the contents bufs had before the first; outputs that differ abort
 * with one line naming `what`, the buffer and the order. */
extern "C" {
typedef struct fy_emu_buf { void *p; size_t nbytes; const char *name; } fy_emu_buf;
void fy_emu_check_orders(const char *what, void (*run)(void *ctx), void *ctx,
                         const fy_emu_buf *bufs, int nbufs);
}

#endif
