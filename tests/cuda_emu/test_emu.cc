/* test_emu.cc — the CPU emulation of CUDA itself (cuda_emu.h), and the kernels of
 * cuda_kernels.cu that the GEMM ops call (column sums, bias), which test_cuda.c reaches
 * only through cuBLASLt's ops.
 *
 * The emulation: warp shuffles and ballots give what CUDA defines; __syncthreads orders
 * shared memory in every thread order; a planted race (a shared variable every thread
 * writes, read after the barrier) gives different results in forward and reverse order,
 * which is how emu_dev.cc catches races; a planted out-of-bounds write (a buffer that
 * ends at a guard page; AddressSanitizer's own report in the sanitized build) and a
 * divergent barrier end the test process; bf16 and fp16 conversions round to nearest
 * even exactly as ferry's host conversion (and IEEE) does; the emulated tensor-core
 * product (fy_mma_16816_bf16) is the matrix product when the fragments are loaded by the
 * PTX ISA's layouts, written out again here from the ISA's formulas (integer-valued
 * inputs: exact; random bf16: fp32 rounding), and a load that swaps two registers (rows
 * g + 8 and columns + 8 of A, the easy mistake) is caught.
 * The helper kernels: against plain C references in fp32 (sums in another order: 1e-6). */
#include <criterion/criterion.h>

#include <math.h>

#include <initializer_list>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "tests/cuda_emu/cuda_emu.h"

extern "C" {
#include "engine/core/dtype.h"
#include "engine/device/device_impl.h"
#include "engine/device/kernels.h"
}
#include "engine/device/cuda/cuda_impl.h"
#include "tests/cuda_emu/emu_dev.h"

static float frand(unsigned *s) {
    *s = *s * 1103515245u + 12345u;
    return (float)((*s >> 8) & 0xffff) / 32768.0f - 1.0f;
}
static void to_bf16(uint16_t *dst, const float *src, size_t n) { fy_f32_to_bf16_n(dst, src, n); }
static void from_bf16(float *dst, const uint16_t *src, size_t n) { fy_bf16_to_f32_n(dst, src, n); }

/* ---- kernels of the tests ---------------------------------------------------------- */

__global__ void warp_ops_k(float *sum, int *from5, unsigned *ballot, int *first) {
    int t = threadIdx.x, lane = t & 31;
    float v = (float)t;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    sum[t] = v;
    from5[t] = __shfl_sync(0xffffffffu, t * 10, 5);
    unsigned b = __ballot_sync(0xffffffffu, lane % 3 == 0);
    ballot[t] = b;
    first[t] = __ffs(b & ~1u);
}

__global__ void reverse_k(int *out) {
    __shared__ int s[256];
    int t = threadIdx.x;
    s[t] = t * 7 + (int)blockIdx.x;
    __syncthreads();
    out[blockIdx.x * blockDim.x + t] = s[blockDim.x - 1 - t];
}

__global__ void racy_k(int *out) {
    __shared__ int last;
    last = (int)threadIdx.x; /* every thread writes it: whoever runs last wins */
    __syncthreads();
    out[threadIdx.x] = last;
}

__global__ void last_block_wins_k(int *out) {
    if (threadIdx.x == 0) out[0] = (int)blockIdx.x; /* every block writes one element */
}

__global__ void past_the_end_k(float *out) { out[threadIdx.x] = 1.0f; }

/* reads its shared counter before any thread of the block wrote it */
__global__ void stale_k(int *out) {
    __shared__ int count;
    __syncthreads();
    out[blockIdx.x * blockDim.x + threadIdx.x] = count;
    __syncthreads();
    if (threadIdx.x == 0) count = 0; /* "for the next block": wrong on a GPU */
}

/* lanes of one warp at different warp operations */
__global__ void mixed_warp_ops_k(unsigned *out) {
    if (threadIdx.x & 1) out[threadIdx.x] = __ballot_sync(0xffffffffu, 1);
    else out[threadIdx.x] = (unsigned)__shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
}

/* a lane mask past the warp: CUDA gives each lane its own value */
__global__ void xor_past_the_warp_k(int *out) {
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x * 3, 33);
}

/* half of each warp waits at the block's barrier, the other half at a shuffle that needs
 * the first half: neither can go on */
__global__ void divergent_k(float *out) {
    if ((threadIdx.x & 31) < 16) {
        __syncthreads();
    } else {
        out[threadIdx.x] = __shfl_sync(0xffffffffu, 1.0f, 0);
    }
}

/* One warp: D (16x8, row-major) = A (16x16, row-major) B (16x8, column-major: B[n*16 + k])
 * + C (16x8, row-major) through fy_mma_16816_bf16, the fragments placed by the PTX ISA's
 * formulas (groupID g = lane >> 2, threadID_in_group u = lane % 4): A's a_i at row g for
 * i in {0,1,4,5} else g + 8, column 2u + (i & 1) (+ 8 for i >= 4); B's b_i at row (k)
 * 2u + (i & 1) (+ 8 for i >= 2), column g; C's c_i at row g for i < 2 else g + 8, column
 * 2u + (i & 1). swap: registers a1 and a2 exchanged (a wrong layout). */
template <bool swap>
__global__ void mma_k(float *D, const uint16_t *A, const uint16_t *B, const float *C) {
    const int lane = threadIdx.x & 31, g = lane >> 2, u = lane & 3;
    uint32_t a[4], b[2];
    float c[4], d[4];
    for (int r = 0; r < 4; r++) {
        const int row = g + 8 * (r & 1), col = 2 * u + 8 * (r >> 1);
        a[r] = (uint32_t)A[row * 16 + col] | (uint32_t)A[row * 16 + col + 1] << 16;
    }
    if (swap) { uint32_t x = a[1]; a[1] = a[2]; a[2] = x; }
    for (int r = 0; r < 2; r++) {
        const int k = 2 * u + 8 * r;
        b[r] = (uint32_t)B[g * 16 + k] | (uint32_t)B[g * 16 + k + 1] << 16;
    }
    for (int i = 0; i < 4; i++) c[i] = C[(g + 8 * (i >> 1)) * 8 + 2 * u + (i & 1)];
    fy_mma_16816_bf16(d, a, b, c);
    for (int i = 0; i < 4; i++) D[(g + 8 * (i >> 1)) * 8 + 2 * u + (i & 1)] = d[i];
}

/* The emulated product against a plain one (in double) from A, B (bf16 bits) and C:
 * the largest difference relative to the largest |result|. */
static double mma_err(bool swap, const uint16_t *A, const uint16_t *B, const float *C) {
    float D[128], a[256], b[128];
    from_bf16(a, A, 256);
    from_bf16(b, B, 128);
    if (swap) FY_LAUNCH(1, 32, 0, (cudaStream_t)0, mma_k<true>)(D, A, B, C);
    else FY_LAUNCH(1, 32, 0, (cudaStream_t)0, mma_k<false>)(D, A, B, C);
    cr_assert_eq(cudaGetLastError(), cudaSuccess);
    double worst = 0, big = 0;
    for (int i = 0; i < 16; i++)
        for (int n = 0; n < 8; n++) {
            double want = C[i * 8 + n];
            for (int k = 0; k < 16; k++) want += (double)a[i * 16 + k] * b[n * 16 + k];
            worst = fmax(worst, fabs(D[i * 8 + n] - want));
            big = fmax(big, fabs(want));
        }
    return worst / big;
}

/* ---- the emulation ---------------------------------------------------------------------- */

TestSuite(emulation, .timeout = 60);

Test(emulation, warp_operations_are_cudas) {
    float sum[64];
    int from5[64], first[64];
    unsigned ballot[64];
    for (int order = 0; order < 3; order++) {
        fy_emu_set_order(order);
        FY_LAUNCH(1, 64, 0, (cudaStream_t)0, warp_ops_k)(sum, from5, ballot, first);
        cr_assert_eq(cudaGetLastError(), cudaSuccess);
        unsigned want_ballot = 0;
        for (int l = 0; l < 32; l++) want_ballot |= (l % 3 == 0 ? 1u : 0u) << l;
        for (int t = 0; t < 64; t++) {
            int w = t / 32;
            float want = 0;
            for (int l = 0; l < 32; l++) want += (float)(w * 32 + l);
            cr_expect_eq(sum[t], want, "order %d thread %d: warp sum %g, want %g", order, t, sum[t], want);
            cr_expect_eq(from5[t], (w * 32 + 5) * 10, "order %d thread %d", order, t);
            cr_expect_eq(ballot[t], want_ballot, "order %d thread %d", order, t);
            cr_expect_eq(first[t], 4, "order %d thread %d: __ffs", order, t); /* lane 3 */
        }
    }
}

Test(emulation, syncthreads_orders_shared_memory_in_every_order) {
    int out[3 * 256];
    for (int order = 0; order < 3; order++) {
        fy_emu_set_order(order);
        memset(out, 0xff, sizeof out);
        FY_LAUNCH(3, 256, 0, (cudaStream_t)0, reverse_k)(out);
        for (int b = 0; b < 3; b++)
            for (int t = 0; t < 256; t++)
                cr_assert_eq(out[b * 256 + t], (255 - t) * 7 + b, "order %d block %d thread %d", order, b, t);
    }
}

Test(emulation, a_planted_race_shows_as_orders_that_disagree) {
    int fwd[64], rev[64], shuf[64];
    fy_emu_set_order(0);
    FY_LAUNCH(1, 64, 0, (cudaStream_t)0, racy_k)(fwd);
    fy_emu_set_order(1);
    FY_LAUNCH(1, 64, 0, (cudaStream_t)0, racy_k)(rev);
    fy_emu_set_order(2);
    FY_LAUNCH(1, 64, 0, (cudaStream_t)0, racy_k)(shuf);
    cr_expect_eq(fwd[0], 63, "forward: the last thread writes last");
    cr_expect_eq(rev[0], 0, "reverse: thread 0 writes last");
    cr_expect(memcmp(fwd, rev, sizeof fwd) != 0, "the race went unseen");
}

static void run_racy(void *out) { FY_LAUNCH(1, 64, 0, (cudaStream_t)0, racy_k)((int *)out); }

/* the check every kernel op of the emulated device goes through */
Test(emulation, a_planted_race_is_caught_by_the_order_check, .signal = SIGABRT) {
    int out[64];
    fy_emu_buf b = {out, sizeof out, "out"};
    fy_emu_check_orders("racy_k", run_racy, out, &b, 1);
}

static void run_blocks(void *out) { FY_LAUNCH(5, 32, 0, (cudaStream_t)0, last_block_wins_k)((int *)out); }

/* blocks run in the three orders too: a race between blocks is caught as well */
Test(emulation, a_planted_race_between_blocks_is_caught, .signal = SIGABRT) {
    int out[1];
    fy_emu_buf b = {out, sizeof out, "out"};
    fy_emu_check_orders("last_block_wins_k", run_blocks, out, &b, 1);
}

static void run_reverse(void *out) { FY_LAUNCH(3, 256, 0, (cudaStream_t)0, reverse_k)((int *)out); }

Test(emulation, a_kernel_without_a_race_passes_the_order_check) {
    int out[3 * 256];
    fy_emu_buf b = {out, sizeof out, "out"};
    fy_emu_check_orders("reverse_k", run_reverse, out, &b, 1);
}

Test(emulation, a_bad_launch_is_an_error_not_a_run) {
    float x[1];
    FY_LAUNCH(1, 2048, 0, (cudaStream_t)0, past_the_end_k)(x);
    cr_expect_eq(cudaGetLastError(), cudaErrorInvalidConfiguration);
    cr_expect_eq(cudaGetLastError(), cudaSuccess, "the error is cleared once read");
    FY_LAUNCH(dim3(1, 70000), 32, 0, (cudaStream_t)0, past_the_end_k)(x);
    cr_expect_eq(cudaGetLastError(), cudaErrorInvalidConfiguration, "grid.y over 65535");
    FY_LAUNCH(1, dim3(1, 1, 65), 0, (cudaStream_t)0, past_the_end_k)(x);
    cr_expect_eq(cudaGetLastError(), cudaErrorInvalidConfiguration, "block.z over 64");
}

Test(emulation, shared_memory_is_poison_until_the_block_writes_it) {
    int out[2 * 32];
    FY_LAUNCH(2, 32, 0, (cudaStream_t)0, stale_k)(out);
    for (int i = 0; i < 64; i++)
        cr_expect_eq(out[i], -1, "thread %d read %d, not the poison (0xffffffff)", i, out[i]);
}

Test(emulation, lanes_at_different_warp_operations_are_reported, .signal = SIGABRT) {
    unsigned out[32];
    FY_LAUNCH(1, 32, 0, (cudaStream_t)0, mixed_warp_ops_k)(out);
}

Test(emulation, a_lane_mask_past_the_warp_gives_the_lane_its_own_value) {
    int out[32];
    FY_LAUNCH(1, 32, 0, (cudaStream_t)0, xor_past_the_warp_k)(out);
    for (int l = 0; l < 32; l++) cr_expect_eq(out[l], l * 3, "lane %d", l);
}

#if defined(__SANITIZE_ADDRESS__)
/* AddressSanitizer reports the heap overflow and exits 1 */
Test(emulation, a_planted_out_of_bounds_write_is_caught, .exit_code = 1) {
    float *out = (float *)malloc(48 * sizeof(float));
    FY_LAUNCH(1, 64, 0, (cudaStream_t)0, past_the_end_k)(out);
    free(out);
}
#else
/* the buffer ends where an inaccessible page begins: the 49th float faults */
Test(emulation, a_planted_out_of_bounds_write_is_caught, .signal = SIGSEGV) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    char *p = (char *)mmap(NULL, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    cr_assert_neq(p, MAP_FAILED);
    cr_assert_eq(mprotect(p + page, page, PROT_NONE), 0);
    float *out = (float *)(p + page) - 48;
    FY_LAUNCH(1, 64, 0, (cudaStream_t)0, past_the_end_k)(out);
}
#endif

Test(emulation, a_divergent_barrier_is_reported, .signal = SIGABRT) {
    float out[64];
    FY_LAUNCH(1, 64, 0, (cudaStream_t)0, divergent_k)(out);
}

Test(emulation, mma_is_the_matrix_product_by_the_ptx_layouts) {
    uint16_t A[256], B[128];
    float C[128], f[256];
    /* integers: every element of A says where it is (16 i + k - 128, exact in bf16), B and C
     * small integers; products and sums are exact in fp32, so any misplaced element shows */
    for (int i = 0; i < 256; i++) f[i] = (float)(i - 128);
    to_bf16(A, f, 256);
    for (int i = 0; i < 128; i++) f[i] = (float)((i * 37) % 19 - 9);
    to_bf16(B, f, 128);
    for (int i = 0; i < 128; i++) C[i] = (float)(i % 7 - 3);
    for (int order = 0; order < 3; order++) {
        fy_emu_set_order(order);
        cr_expect_eq(mma_err(false, A, B, C), 0.0, "order %d: the integer product is not exact", order);
    }
    fy_emu_set_order(0);
    cr_expect_gt(mma_err(true, A, B, C), 1e-2, "a wrong A layout goes unnoticed");
    /* random bf16 values: fp32 sums of 16 exact products, within a few fp32 ulps */
    unsigned s = 99;
    for (int trial = 0; trial < 4; trial++) {
        for (int i = 0; i < 256; i++) f[i] = 4 * frand(&s);
        to_bf16(A, f, 256);
        for (int i = 0; i < 128; i++) f[i] = 4 * frand(&s);
        to_bf16(B, f, 128);
        for (int i = 0; i < 128; i++) C[i] = frand(&s);
        double e = mma_err(false, A, B, C);
        cr_expect_lt(e, 1e-6, "trial %d: %g from the product", trial, e);
        cr_expect_gt(mma_err(true, A, B, C), 1e-2, "trial %d: a wrong A layout goes unnoticed", trial);
    }
}

Test(emulation, bf16_and_fp16_round_to_nearest_even) {
    /* every float with these 16-bit tops and a spread of low halves (ties included),
     * and the specials */
    uint32_t n = 0;
    for (uint32_t hi = 0; hi < 0x10000u; hi += 7)
        for (uint32_t lo : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) {
            uint32_t u = hi << 16 | lo;
            float f;
            memcpy(&f, &u, 4);
            uint16_t want;
            fy_f32_to_bf16_n(&want, &f, 1);
            __nv_bfloat16 got = __float2bfloat16_rn(f);
            if (isnan(f)) cr_expect(isnan(__bfloat162float(got)), "NaN %08x", u);
            else cr_expect_eq(got.bits, want, "%08x: bf16 %04x, ferry's %04x", u, got.bits, want);
            n++;
        }
    cr_expect_gt(n, 50000u);
    /* fp16: 1 + 2^-11 is a tie (rounds to 1), 1 + 3 * 2^-11 rounds up to 1 + 2^-9 */
    cr_expect_eq(__half2float(__float2half_rn(1.0f + 0x1p-11f)), 1.0f);
    cr_expect_eq(__half2float(__float2half_rn(1.0f + 3 * 0x1p-11f)), 1.0f + 0x1p-9f);
    cr_expect_eq(__half2float(__float2half_rn(70000.0f)), INFINITY);
}

/* ---- the kernels the GEMM ops call ------------------------------------------------------- */

static fy_cu_stream *stream(void) {
    static fy_cu_stream cs;
    if (!cs.part) cs.part = (float *)malloc(FY_CU_PART_NBYTES);
    return &cs;
}


static double rel_err(const float *a, const double *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - b[i];
        num += d * d;
        den += b[i] * b[i];
    }
    return isfinite(num) ? sqrt(num / (den > 0 ? den : 1)) : INFINITY;
}

TestSuite(gemm_helpers, .timeout = 60);

/* ADD_F32 (dst += an fp32 source; the fp32 accumulator of the bf16 GEMM gradients), whose
 * only other caller is a GEMM test: fp32 exact, bf16 one rounding of the fp32 sum */
Test(gemm_helpers, add_f32_is_one_rounded_addition) {
    const int64_t n = 1000;
    float d[1000], src[1000], want[1000];
    uint16_t hb[1000], wb[1000];
    unsigned s = 3;
    for (int i = 0; i < n; i++) { d[i] = frand(&s); src[i] = frand(&s); }
    for (int dt = 0; dt < 2; dt++) {
        fy_op op;
        memset(&op, 0, sizeof op);
        op.kind = FY_OP_ADD_F32;
        op.i[0] = n;
        op.p[1] = src;
        if (dt == 0) {
            for (int i = 0; i < n; i++) want[i] = d[i] + src[i];
            op.dt = FY_F32;
            op.p[0] = d;
            fy_cu_exec_kernel(stream(), &op);
            cr_expect(!memcmp(d, want, sizeof d), "fp32 add_f32 is not exact");
        } else {
            to_bf16(hb, src, (size_t)n); /* any bf16 values */
            for (int i = 0; i < n; i++) {
                float a;
                from_bf16(&a, &hb[i], 1);
                want[i] = a + src[i];
            }
            to_bf16(wb, want, (size_t)n);
            op.dt = FY_BF16;
            op.p[0] = hb;
            fy_cu_exec_kernel(stream(), &op);
            cr_expect(!memcmp(hb, wb, sizeof hb), "bf16 add_f32 is not the rounded fp32 sum");
        }
    }
}

Test(gemm_helpers, column_sums_accumulate_and_bias_fills) {
    const int N = 301, C = 70;
    float *x = (float *)malloc((size_t)N * C * 4), dst[70], out[5 * 70];
    double want[70], wout[5 * 70];
    unsigned s = 11;
    for (int i = 0; i < N * C; i++) x[i] = frand(&s);
    for (int c = 0; c < C; c++) {
        dst[c] = frand(&s);
        want[c] = dst[c];
        for (int r = 0; r < N; r++) want[c] += x[(size_t)r * C + c];
    }
    fy_cu_colsum_acc(stream(), FY_F32, dst, x, N, C);
    cr_expect_lt(rel_err(dst, want, C), 1e-6, "column sums: %g", rel_err(dst, want, C));
    for (int r = 0; r < 5; r++)
        for (int c = 0; c < C; c++) wout[r * C + c] = dst[c];
    memset(out, 0xff, sizeof out);
    fy_cu_bias_fill(stream(), FY_F32, out, dst, 5, C);
    cr_expect_eq(rel_err(out, wout, 5 * C), 0.0, "bias fill");
    free(x);
}

/* ---- odd shapes, each kernel op against the cpu backend ---------------------------------- */

/* Op `kind` with integer arguments i (and floats f) on random fp32 inputs, run by the cpu
 * backend (fy_cpu_exec) and by the emulated cuda kernel from the same buffers; outputs
 * start as NaN (an element left unwritten shows), accumulators random; every output
 * within tol (relative norm; 0: the same bits). Token and target arguments hold ids
 * below `ids`; optional int32 arguments (documents) are absent. Shapes the kernel tests of test_cuda.c do not take: one row, rows and
 * channels that are not multiples of 32, vocabularies of one or many partitions. */
static bool g_ignored; /* against_cpu: every third id is -1 (a target the loss does not count) */

static void against_cpu(fy_op_kind kind, std::initializer_list<int64_t> ints,
                        std::initializer_list<float> flts, int64_t ids, double tol) {
    fy_op a, b;
    memset(&a, 0, sizeof a);
    a.kind = kind;
    a.dt = FY_F32;
    int k = 0;
    for (int64_t v : ints) a.i[k++] = v;
    k = 0;
    for (float v : flts) a.f[k++] = v;
    b = a;
    const fy_op_desc *d = fy_op_desc_of(kind);
    const int n = fy_op_nargs(kind);
    unsigned s = 17u + (unsigned)kind;
    size_t nb[FY_OP_MAX_ARGS];
    for (int j = 0; j < n; j++) {
        if (d->args[j].optional && d->args[j].type == FY_ARG_I32) { /* documents: none */
            nb[j] = 0;
            a.p[j] = b.p[j] = NULL;
            continue;
        }
        a.p[j] = (void *)1; /* sizes first: they depend on the integers only */
        size_t ne = fy_op_arg_nelem(&a, j);
        size_t es = d->args[j].type == FY_ARG_F64 ? 8 : 4;
        nb[j] = ne * es;
        a.p[j] = malloc(nb[j] ? nb[j] : 1);
        b.p[j] = malloc(nb[j] ? nb[j] : 1);
        for (size_t e = 0; e < ne; e++) {
            if (d->args[j].type == FY_ARG_I32) ((int32_t *)a.p[j])[e] = g_ignored && e % 3 == 1 ? -1
                                                  : (int32_t)((s = s * 1103515245u + 12345u) >> 8) % (int32_t)ids;
            else if (d->args[j].type == FY_ARG_F64) /* inputs: positive sums */
                ((double *)a.p[j])[e] = d->args[j].role == FY_ARG_OUT ? NAN : 1.5 + frand(&s);
            else ((float *)a.p[j])[e] = d->args[j].role == FY_ARG_OUT ? NAN : frand(&s);
        }
        memcpy(b.p[j], a.p[j], nb[j]);
    }
    fy_cpu_exec(&a);
    fy_cu_exec_kernel(stream(), &b);
    for (int j = 0; j < n; j++) {
        if (d->args[j].role & FY_ARG_OUT) {
            double num = 0, den = 0;
            const size_t ne = fy_op_arg_nelem(&a, j);
            for (size_t e = 0; e < ne; e++) {
                double x = d->args[j].type == FY_ARG_F64 ? ((double *)a.p[j])[e] : ((float *)a.p[j])[e];
                double y = d->args[j].type == FY_ARG_F64 ? ((double *)b.p[j])[e] : ((float *)b.p[j])[e];
                num += (x - y) * (x - y);
                den += x * x;
            }
            double err = sqrt(num / (den > 0 ? den : 1));
            if (tol == 0) cr_expect(!memcmp(a.p[j], b.p[j], nb[j]), "%s %s: not the cpu's bits",
                                    fy_op_name(kind), d->args[j].name);
            else cr_expect(err <= tol, "%s %s: %g > %g", fy_op_name(kind), d->args[j].name, err, tol);
        }
        free(a.p[j]);
        free(b.p[j]);
    }
}

Test(odd_shapes, every_kernel_against_the_cpu_backend) {
    /* encoder: B, T, C, V (C not a multiple of 32; one partition, and many) */
    against_cpu(FY_OP_ENCODER_FWD, {3, 5, 37, 300}, {1.0f}, 300, 0);
    against_cpu(FY_OP_ENCODER_BWD, {3, 5, 37, 300}, {1.0f}, 300, 0);
    against_cpu(FY_OP_ENCODER_BWD, {1, 1, 5, 7}, {1.0f}, 7, 0);
    against_cpu(FY_OP_ENCODER_BWD, {4, 40, 33, 5000}, {1.0f}, 5000, 0);
    /* a scaled embedding (Gemma's): products rounded on their own on both, the same bits */
    against_cpu(FY_OP_ENCODER_FWD, {3, 5, 37, 300}, {6.92820323f}, 300, 0);
    against_cpu(FY_OP_ENCODER_BWD, {4, 40, 33, 5000}, {6.92820323f}, 5000, 0);
    for (int64_t rows : {1, 3, 70}) { /* N, C: one row, a few, more than a block's */
        for (int64_t C : {3, 31, 65}) {
            against_cpu(FY_OP_LAYERNORM_FWD, {rows, C}, {}, 1, 1e-5);
            against_cpu(FY_OP_LAYERNORM_BWD, {rows, C}, {}, 1, 2e-5);
            against_cpu(FY_OP_RMSNORM_FWD, {rows, C}, {1e-5f}, 1, 1e-5);
            against_cpu(FY_OP_RMSNORM_BWD, {rows, C}, {}, 1, 2e-5);
            against_cpu(FY_OP_RMSNORM_FWD, {rows, C}, {1e-5f, 1.0f}, 1, 1e-5); /* (1 + w) */
            against_cpu(FY_OP_RMSNORM_BWD, {rows, C}, {1.0f}, 1, 2e-5);
        }
    }
    /* per-head norms: N, NH, NKV, hd (heads narrower and wider than a warp, partial ones) */
    for (int64_t rows : {1, 3, 70})
        for (int64_t hd : {3, 31, 65}) {
            against_cpu(FY_OP_QK_NORM_FWD, {rows, 3, 1, hd}, {1e-6f, 1.0f}, 1, 1e-5);
            against_cpu(FY_OP_QK_NORM_BWD, {rows, 3, 1, hd}, {1.0f}, 1, 2e-5);
        }
    for (int64_t n : {1, 33, 1000}) {
        against_cpu(FY_OP_GELU_FWD, {n}, {}, 1, 1e-5);
        against_cpu(FY_OP_GELU_BWD, {n}, {}, 1, 1e-5);
        against_cpu(FY_OP_RESIDUAL_FWD, {n}, {}, 1, 0);
        for (int64_t act : {(int64_t)FY_GLU_SILU, (int64_t)FY_GLU_GELU_TANH}) {
            against_cpu(FY_OP_GLU_FWD, {n, 3, act}, {}, 1, 1e-5);
            against_cpu(FY_OP_GLU_BWD, {n, 3, act}, {}, 1, 1e-5);
        }
        against_cpu(FY_OP_MEAN, {n, n}, {}, 1, 1e-6);
        against_cpu(FY_OP_MEAN, {n, 7}, {}, 1, 1e-6); /* a masked loss's divisor */
        against_cpu(FY_OP_SUMSQ, {n}, {}, 1, 0); /* the cpu's bits (the backend's claim) */
    }
    for (int64_t n : {1, 16384, 40000}) /* one chunk, a whole one, a partial third */
        against_cpu(FY_OP_SUMSQ_PARTS, {n}, {}, 1, 0);
    /* cross-entropy: N, V, Vp (a padded vocabulary), forward and fused backward */
    against_cpu(FY_OP_CROSSENTROPY, {7, 5, 8}, {0.0f}, 5, 1e-5);
    against_cpu(FY_OP_CROSSENTROPY, {3, 1500, 1536}, {1.0f / 3}, 1500, 1e-5);
    /* the classifier by vocabulary chunks: N, v0, nv, V; a first chunk with padding past
     * class 49, and a later chunk of a 3000-class vocabulary (some targets in it) */
    against_cpu(FY_OP_CE_CHUNK_FWD, {7, 0, 64, 50}, {}, 50, 1e-5);
    against_cpu(FY_OP_CE_CHUNK_BWD, {7, 0, 64, 50}, {1.0f / 7}, 50, 1e-5);
    against_cpu(FY_OP_CE_CHUNK_FWD, {40, 1536, 1536, 3000}, {}, 3000, 1e-5);
    against_cpu(FY_OP_CE_CHUNK_BWD, {40, 1536, 1536, 3000}, {1.0f / 40}, 3000, 1e-5);
    /* soft-capped (a cap of 0.5 on logits in [-1, 1]: tanh's curved part) */
    against_cpu(FY_OP_CROSSENTROPY, {3, 1500, 1536}, {1.0f / 3, 0.5f}, 1500, 1e-5);
    against_cpu(FY_OP_CE_CHUNK_FWD, {40, 1536, 1536, 3000}, {0.5f}, 3000, 1e-5);
    against_cpu(FY_OP_CE_CHUNK_BWD, {40, 1536, 1536, 3000}, {1.0f / 40, 0.5f}, 3000, 1e-5);
    /* targets the loss does not count (-1): losses and gradient rows 0 */
    g_ignored = true;
    against_cpu(FY_OP_CROSSENTROPY, {7, 5, 8}, {1.0f / 7, 0.0f}, 5, 1e-5);
    against_cpu(FY_OP_CE_CHUNK_FWD, {40, 0, 1536, 3000}, {}, 3000, 1e-5);
    against_cpu(FY_OP_CE_CHUNK_BWD, {40, 0, 1536, 3000}, {1.0f / 40}, 3000, 1e-5);
    against_cpu(FY_OP_CE_CHUNK_FWD, {40, 1536, 1536, 3000}, {0.5f}, 3000, 1e-5);
    g_ignored = false;
}
