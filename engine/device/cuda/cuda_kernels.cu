/* cuda_kernels.cu — the cuda backend's hand-written kernels: everything but the GEMMs
 * (attention, tiled on the tensor cores, is in cuda_attention.cuh, included below).
 *
 * Each kernel is written once over the storage type T (float or bf16) and computes in
 * fp32 (sums of many terms in double where the cpu reference does). Shapes use llm.c's
 * letters; rows are N = B*T positions.
 *
 * Determinism: no atomics. A reduction across rows is split into fixed row chunks whose
 * partial sums are added in chunk order, and the embedding scatter gives each
 * (token, channel) to one thread that adds positions in order; so a result depends on
 * the inputs and shapes only. Where the cpu backend's order is as simple (the embedding
 * gradients, the sum of squares, AdamW), the fp32 results are its exact bits.
 *
 * Speed: kernels over rows of a tensor run on 2D grids (columns along x, rows along y,
 * striding past 65535), so no thread divides an index; the warp-per-row kernels (the
 * norms) move a row in 16-byte pieces (load_piece, store_piece).
 *
 * Every launch is checked at once; a failure aborts naming the kernel. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "engine/core/reduce.h"
#include "engine/device/cuda/cuda_impl.h"
#include "engine/device/kernels.h"
#include "engine/device/rope.h"
#include "optim_cpu/adam.h"

typedef __nv_bfloat16 bf16;

#define FULL_MASK 0xffffffffu
#define LN_EPS 1e-5f
#define ROWS_PER_BLOCK 8      /* warp-per-row kernels: 8 warps of 32 */
#define GELU_K 0.7978845608028654f

#define LAUNCHED(name) FY_CUDA_CHECK(cudaGetLastError(), "kernel " name)

/* Every launch: FY_LAUNCH(grid, block, shared bytes, stream, kernel)(arguments). With
 * nvcc, the triple-chevron launch; under the CPU emulation of the kernel tests
 * (tests/cuda_emu, FY_CUDA_EMU), a call of its launcher, which runs every block's
 * threads as fibers. The kernel comes last: a template's arguments hold commas. */
#ifndef FY_CUDA_EMU
#define FY_LAUNCH(grid, block, shmem, stream, ...) __VA_ARGS__<<<(grid), (block), (shmem), (stream)>>>
#endif

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f<bf16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

static unsigned grid_for(size_t n, unsigned threads) {
    size_t g = (n + threads - 1) / threads;
    return (unsigned)(g < 1 ? 1 : g > 0x7fffffff ? 0x7fffffff : g);
}

/* Blocks along y for n rows: at least one, at most CUDA's 65535 (the kernels stride past
 * it). */
static unsigned grid_rows(size_t n) { return (unsigned)(n < 1 ? 1 : n > 65535 ? 65535 : n); }

/* A 2D launch over N rows of C columns: ROW_THREADS threads a block along the columns,
 * one block row per row of the tensor up to 65535 (the kernels stride past it). */
#define ROW_THREADS 256
static dim3 rows_grid(size_t N, size_t C) {
    return dim3(grid_for(C, ROW_THREADS), grid_rows(N));
}

/* ---- rows in 16-byte pieces ----------------------------------------------------------
 * A warp walks a row of C channels in pieces of V = 16 / sizeof(T) (8 bf16, 4 floats):
 * lane l takes channels [V l, V l + V), then the same 32 V further on. A piece is one
 * 16-byte load or store where the row starts 16-byte aligned (every row does when the
 * tensor is and C is a multiple of V, as the model's widths are), else V scalar ones;
 * channels past C are skipped (the scalar tail). Which channels a lane takes, and in
 * what order it adds them, depend on C alone, never on the alignment, so the bits do not
 * depend on where a buffer lives. */
struct alignas(16) bytes16 { uint32_t w[4]; };

template <typename T> struct piece { static constexpr int V = 16 / sizeof(T); };

template <typename T> __device__ __forceinline__ bool aligned16(const T *p) {
    return ((uintptr_t)p & 15u) == 0;
}

/* f = x[c, c + V) widened to fp32; 0 past C. */
template <typename T>
__device__ __forceinline__ void load_piece(float (&f)[piece<T>::V], const T *x, int c, int C, bool vec) {
    constexpr int V = piece<T>::V;
    if (vec && c + V <= C) {
        const bytes16 b = *(const bytes16 *)(x + c);
        T t[V];
        memcpy(t, &b, sizeof b);
        for (int k = 0; k < V; k++) f[k] = to_f(t[k]);
    } else {
        for (int k = 0; k < V; k++) f[k] = c + k < C ? to_f(x[c + k]) : 0.0f;
    }
}

/* o[c, min(c + V, C)) = f rounded to T. */
template <typename T>
__device__ __forceinline__ void store_piece(T *o, const float (&f)[piece<T>::V], int c, int C, bool vec) {
    constexpr int V = piece<T>::V;
    if (vec && c + V <= C) {
        T t[V];
        for (int k = 0; k < V; k++) t[k] = from_f<T>(f[k]);
        bytes16 b;
        memcpy(&b, t, sizeof b);
        *(bytes16 *)(o + c) = b;
    } else {
        for (int k = 0; k < V && c + k < C; k++) o[c + k] = from_f<T>(f[k]);
    }
}

/* ---- encoder ---------------------------------------------------------------------- */

/* A row's place in its document (kernels.h): t, or t - docs[n] with documents. */
__device__ __forceinline__ int position_of(const int32_t *docs, int n, int T_) {
    return n % T_ - (docs ? docs[n] : 0);
}

/* out = wte[tok] * scale (+ wpe[pos]): the product rounded on its own (__fmul_rn: never
 * fused with the sum), the cpu backend's arithmetic; scale 1 gives wte's values. */
template <typename T>
__global__ void encoder_fwd_k(T *out, const int32_t *tok, const T *wte, const T *wpe,
                              const int32_t *docs, int N, int T_, int C, float scale) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    for (int n = blockIdx.y; n < N; n += gridDim.y) {
        const float we = __fmul_rn(to_f(wte[(size_t)tok[n] * C + c]), scale);
        out[(size_t)n * C + c] =
            from_f<T>(wpe ? we + to_f(wpe[(size_t)position_of(docs, n, T_) * C + c]) : we);
    }
}

/* dwpe (T, C): one thread per (position p, c) adds, in row order, the rows at place p of
 * their document: row (b, p) of each sequence without documents; with them, row s + p of
 * each document starting at s that is longer than p (docs[b, s+p] == s). The next
 * document's start is the first t with docs[b,t] > s (docs is nondecreasing in t): a
 * binary search. The cpu backend's order, so fp32 gives its bits. */
template <typename T>
__global__ void encoder_bwd_wpe_k(T *dwpe, const T *dout, const int32_t *docs, int B, int T_, int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    for (int p = blockIdx.y; p < T_; p += gridDim.y) {
        const size_t idx = (size_t)p * C + c;
        float acc = to_f(dwpe[idx]);
        for (int b = 0; b < B; b++) {
            const T *d = dout + (size_t)b * T_ * C;
            if (!docs) { acc += to_f(d[idx]); continue; }
            const int32_t *doc = docs + (size_t)b * T_;
            for (int s = 0; s + p < T_;) {
                int lo = s + 1, hi = T_;
                if (doc[s + p] == s) {
                    acc += to_f(d[(size_t)(s + p) * C + c]);
                    lo = s + p + 1; /* this document runs past s + p */
                }
                while (lo < hi) {
                    const int mid = (lo + hi) / 2;
                    if (doc[mid] > s) hi = mid;
                    else lo = mid + 1;
                }
                s = lo;
            }
        }
        dwpe[idx] = from_f<T>(acc);
    }
}

/* The embedding scatter's partitions: calls f(n, t) for every position n, in order, whose
 * token t belongs to partition p (t % P == p). Called by a whole warp: the lanes load 32
 * positions at once and take the matching ones in order. */
template <typename F>
__device__ __forceinline__ void for_partition(const int32_t *tok, int N, int P, int p, F f) {
    int lane = threadIdx.x & 31;
    for (int n0 = 0; n0 < N; n0 += 32) {
        int n = n0 + lane;
        int tk = n < N ? tok[n] : -1;
        unsigned mine = __ballot_sync(FULL_MASK, tk >= 0 && tk % P == p);
        while (mine) {
            int j = __ffs(mine) - 1;
            mine &= mine - 1;
            f(n0 + j, __shfl_sync(FULL_MASK, tk, j));
        }
    }
}

/* dwte (V, C): block y owns the tokens with tok % P == y, each warp 32 channels; a warp
 * scans all positions in order and adds the rows of its tokens, so every (token,
 * channel) is summed by one thread in position order. */
template <typename T>
__global__ void encoder_bwd_wte_k(T *dwte, const T *dout, const int32_t *tok, int N, int C,
                                  int P, float scale) {
    int lane = threadIdx.x & 31;
    int c = (blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32) * 32 + lane;
    if (c - lane >= C) return; /* the whole warp leaves together */
    for_partition(tok, N, P, blockIdx.y, [&](int n, int t) {
        if (c < C) {
            size_t o = (size_t)t * C + c;
            dwte[o] = from_f<T>(to_f(dwte[o]) + __fmul_rn(to_f(dout[(size_t)n * C + c]), scale));
        }
    });
}

/* The same scatter for a bf16 dwte: each warp sums its tokens' rows in fp32 in shared
 * memory (token t of partition p at slot t / P) and adds each sum to dwte once, so a
 * token seen at many positions is rounded to bf16 once, not once per position. Only the
 * rows of tokens seen are written back (a bit per slot, the same in every lane). */
#define WTE_ACC_WARPS 4
#define WTE_ACC_SLOTS 96 /* fp32 sums per lane: 96 x 32 x 4 B = 12 KiB a warp */

__global__ void encoder_bwd_wte_acc_k(bf16 *dwte, const bf16 *dout, const int32_t *tok, int N,
                                      int C, int V, int P, float scale) {
    __shared__ float acc[WTE_ACC_WARPS][WTE_ACC_SLOTS][32];
    int lane = threadIdx.x & 31, w = threadIdx.x / 32;
    int c = (blockIdx.x * WTE_ACC_WARPS + w) * 32 + lane;
    if (c - lane >= C) return; /* the whole warp leaves together */
    int p = blockIdx.y, nslots = (V - p + P - 1) / P;
    for (int k = 0; k < nslots; k++) acc[w][k][lane] = 0.0f; /* each lane its own column */
    unsigned seen[(WTE_ACC_SLOTS + 31) / 32] = {0};
    for_partition(tok, N, P, p, [&](int n, int t) {
        if (t >= V) return; /* the data layer refuses such tokens; never write past acc */
        int k = t / P;
        seen[k / 32] |= 1u << (k % 32);
        if (c < C) acc[w][k][lane] += __fmul_rn(to_f(dout[(size_t)n * C + c]), scale);
    });
    if (c >= C) return;
    for (int k = 0; k < nslots; k++) {
        if (!(seen[k / 32] >> (k % 32) & 1u)) continue;
        size_t o = (size_t)(k * P + p) * C + c;
        dwte[o] = from_f<bf16>(to_f(dwte[o]) + acc[w][k][lane]);
    }
}

template <typename T>
static void encoder_fwd(cudaStream_t st, const fy_op *op) {
    int B = (int)op->i[0], T_ = (int)op->i[1], C = (int)op->i[2];
    FY_LAUNCH(rows_grid((size_t)B * T_, C), ROW_THREADS, 0, st, encoder_fwd_k<T>)((T *)op->p[0], (const int32_t *)op->p[1],
        (const T *)op->p[2], (const T *)op->p[3], (const int32_t *)op->p[4], B * T_, T_, C, op->f[0]);
    LAUNCHED("encoder_fwd");
}

template <typename T>
static void encoder_bwd(cudaStream_t st, const fy_op *op) {
    int B = (int)op->i[0], T_ = (int)op->i[1], C = (int)op->i[2], V = (int)op->i[3], N = B * T_;
    if (op->p[1]) { /* learned positions */
        FY_LAUNCH(rows_grid(T_, C), ROW_THREADS, 0, st, encoder_bwd_wpe_k<T>)((T *)op->p[1],
            (const T *)op->p[2], (const int32_t *)op->p[4], B, T_, C);
        LAUNCHED("encoder_bwd (wpe)");
    }
    if (sizeof(T) == 2) {
        /* partitions enough that each holds at most WTE_ACC_SLOTS tokens */
        int P = (V + WTE_ACC_SLOTS - 1) / WTE_ACC_SLOTS;
        FY_ASSERT(P >= 1 && P <= 65535, "a vocabulary the bf16 embedding scatter cannot take");
        dim3 grid((unsigned)((C + 32 * WTE_ACC_WARPS - 1) / (32 * WTE_ACC_WARPS)), (unsigned)P);
        FY_LAUNCH(grid, 32 * WTE_ACC_WARPS, 0, st, encoder_bwd_wte_acc_k)((bf16 *)op->p[0],
            (const bf16 *)op->p[2], (const int32_t *)op->p[3], N, C, V, P, op->f[0]);
        LAUNCHED("encoder_bwd (wte, bf16)");
        return;
    }
    /* fp32: added straight into dwte in position order, the cpu backend's exact bits */
    int P = N / 16 < 1 ? 1 : N / 16 > 512 ? 512 : N / 16; /* ~16 positions per warp */
    dim3 grid((unsigned)((C + 255) / 256), (unsigned)P);
    FY_LAUNCH(grid, 256, 0, st, encoder_bwd_wte_k<T>)((T *)op->p[0], (const T *)op->p[2],
        (const int32_t *)op->p[3], N, C, P, op->f[0]);
    LAUNCHED("encoder_bwd (wte)");
}

/* ---- layernorm -------------------------------------------------------------------- */

template <typename T>
__global__ void layernorm_fwd_k(T *out, float *mean, float *rstd, const T *inp, const T *w,
                                const T *b, int N, int C) {
    constexpr int V = piece<T>::V;
    int lane = threadIdx.x & 31, row = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / 32;
    if (row >= N) return;
    const T *x = inp + (size_t)row * C;
    T *o = out + (size_t)row * C;
    const bool vx = aligned16(x), vw = aligned16(w), vb = aligned16(b), vo = aligned16(o);
    float xs[V], ws[V], bs[V];
    float s = 0.0f;
    for (int c = lane * V; c < C; c += 32 * V) {
        load_piece(xs, x, c, C, vx);
        for (int k = 0; k < V; k++) s += xs[k]; /* 0 past C */
    }
    float m = warp_sum(s) / (float)C;
    float v = 0.0f;
    for (int c = lane * V; c < C; c += 32 * V) {
        load_piece(xs, x, c, C, vx);
        for (int k = 0; k < V && c + k < C; k++) { float d = xs[k] - m; v += d * d; }
    }
    v = warp_sum(v) / (float)C;
    float r = 1.0f / sqrtf(v + LN_EPS);
    for (int c = lane * V; c < C; c += 32 * V) {
        load_piece(xs, x, c, C, vx);
        load_piece(ws, w, c, C, vw);
        load_piece(bs, b, c, C, vb);
        for (int k = 0; k < V; k++) xs[k] = (xs[k] - m) * r * ws[k] + bs[k];
        store_piece(o, xs, c, C, vo);
    }
    if (lane == 0) { mean[row] = m; rstd[row] = r; }
}

/* dinp accumulates, row by row (one warp each). */
template <typename T>
__global__ void layernorm_bwd_dx_k(T *dinp, const T *dout, const T *inp, const T *w,
                                   const float *mean, const float *rstd, int N, int C) {
    constexpr int V = piece<T>::V;
    int lane = threadIdx.x & 31, row = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / 32;
    if (row >= N) return;
    const T *x = inp + (size_t)row * C, *d = dout + (size_t)row * C;
    T *di = dinp + (size_t)row * C;
    const bool vx = aligned16(x), vd = aligned16(d), vw = aligned16(w), vi = aligned16(di);
    float xs[V], ds[V], ws[V], is[V];
    float m = mean[row], r = rstd[row], dm = 0.0f, dnm = 0.0f;
    for (int c = lane * V; c < C; c += 32 * V) {
        load_piece(xs, x, c, C, vx);
        load_piece(ds, d, c, C, vd);
        load_piece(ws, w, c, C, vw);
        for (int k = 0; k < V && c + k < C; k++) {
            float norm = (xs[k] - m) * r, dnorm = ws[k] * ds[k];
            dm += dnorm;
            dnm += dnorm * norm;
        }
    }
    dm = warp_sum(dm) / (float)C;
    dnm = warp_sum(dnm) / (float)C;
    for (int c = lane * V; c < C; c += 32 * V) {
        load_piece(xs, x, c, C, vx);
        load_piece(ds, d, c, C, vd);
        load_piece(ws, w, c, C, vw);
        load_piece(is, di, c, C, vi);
        for (int k = 0; k < V; k++) {
            float norm = (xs[k] - m) * r, dnorm = ws[k] * ds[k];
            is[k] += (dnorm - dm - norm * dnm) * r;
        }
        store_piece(di, is, c, C, vi);
    }
}

/* Column partial sums over a chunk of rows: block (32, 8) covers 32 columns; block y is
 * row chunk y. MODE COLSUM: part[y * stride + c] = sum of x; LN (layernorm's gain and
 * bias): part[y * stride + c] = sum of x * norm(inp), part[y * stride + C + c] = sum of
 * x; RMS (RMSNorm's gain): part[y * stride + c] = sum of x * inp * rstd. The 8 row lanes
 * are added in lane order, so the order is fixed. */
enum { COLSUM = 0, LN = 1, RMS = 2 };
template <typename T, int MODE>
__global__ void colsum_part_k(float *part, const T *x, const T *inp, const float *mean,
                              const float *rstd, int N, int C, int rows_per, int stride) {
    __shared__ float s0[8][33], s1[8][33];
    int tx = threadIdx.x, ty = threadIdx.y, c = blockIdx.x * 32 + tx;
    int lo = blockIdx.y * rows_per, hi = lo + rows_per < N ? lo + rows_per : N;
    float a0 = 0.0f, a1 = 0.0f;
    if (c < C) {
        for (int n = lo + ty; n < hi; n += 8) {
            float d = to_f(x[(size_t)n * C + c]);
            if (MODE == LN) a0 += (to_f(inp[(size_t)n * C + c]) - mean[n]) * rstd[n] * d;
            if (MODE == RMS) a0 += to_f(inp[(size_t)n * C + c]) * rstd[n] * d;
            a1 += d;
        }
    }
    s0[ty][tx] = a0;
    s1[ty][tx] = a1;
    __syncthreads();
    if (ty == 0 && c < C) {
        float t0 = 0.0f, t1 = 0.0f;
        for (int k = 0; k < 8; k++) { t0 += s0[k][tx]; t1 += s1[k][tx]; }
        float *pr = part + (size_t)blockIdx.y * stride;
        if (MODE == LN) { pr[c] = t0; pr[C + c] = t1; }
        else pr[c] = MODE == RMS ? t0 : t1;
    }
}

/* dst (C) += the R chunk sums, in chunk order. */
template <typename T>
__global__ void colsum_finish_k(T *dst, const float *part, int R, int C, int stride) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float acc = 0.0f;
    for (int r = 0; r < R; r++) acc += part[(size_t)r * stride + c];
    dst[c] = from_f<T>(to_f(dst[c]) + acc);
}

/* Row chunks for a column reduction of N rows into `width` floats per chunk, fitting
 * the stream's partials buffer. Depends on the shape only. */
static int rows_per_chunk(int N, int width) {
    size_t max_chunks = FY_CU_PART_NBYTES / sizeof(float) / (size_t)width;
    if (max_chunks > 1024) max_chunks = 1024;
    FY_ASSERT(max_chunks >= 1, "a column reduction wider than the partials buffer");
    int rows = 64;
    while ((size_t)((N + rows - 1) / rows) > max_chunks) rows *= 2;
    return rows;
}

template <typename T>
static void layernorm_bwd(fy_cu_stream *cs, const fy_op *op) {
    cudaStream_t st = cs->st;
    T *dinp = (T *)op->p[0], *dw = (T *)op->p[1], *db = (T *)op->p[2];
    const T *dout = (const T *)op->p[3], *inp = (const T *)op->p[4], *w = (const T *)op->p[5];
    const float *mean = (const float *)op->p[6], *rstd = (const float *)op->p[7];
    int N = (int)op->i[0], C = (int)op->i[1];
    if (N <= 0 || C <= 0) return;
    FY_LAUNCH(grid_for((size_t)N, ROWS_PER_BLOCK), 32 * ROWS_PER_BLOCK, 0, st, layernorm_bwd_dx_k<T>)(
        dinp, dout, inp, w, mean, rstd, N, C);
    LAUNCHED("layernorm_bwd (dinp)");
    int rows = rows_per_chunk(N, 2 * C), R = (N + rows - 1) / rows;
    dim3 grid((unsigned)((C + 31) / 32), (unsigned)R), block(32, 8);
    FY_LAUNCH(grid, block, 0, st, colsum_part_k<T, LN>)(cs->part, dout, inp, mean, rstd, N, C, rows, 2 * C);
    LAUNCHED("layernorm_bwd (partials)");
    FY_LAUNCH(grid_for((size_t)C, 256), 256, 0, st, colsum_finish_k<T>)(dw, cs->part, R, C, 2 * C);
    FY_LAUNCH(grid_for((size_t)C, 256), 256, 0, st, colsum_finish_k<T>)(db, cs->part + C, R, C, 2 * C);
    LAUNCHED("layernorm_bwd (dw, db)");
}

/* ---- RMSNorm ------------------------------------------------------------------------ */

/* The norm's gain w + offset (kernels.h); offset 0 keeps w's value. */
__device__ __forceinline__ float gain(float w, float offset) { return offset != 0.0f ? w + offset : w; }

/* One RMSNorm row of C channels by one warp: o = x * r * (w + offset); returns r (in every
 * lane). RMSNorm's rows and the per-head norms' heads alike. */
template <typename T>
__device__ __forceinline__ float rms_row_fwd(T *o, const T *x, const T *w, int C, float eps,
                                             float offset) {
    constexpr int V = piece<T>::V;
    const int lane = threadIdx.x & 31;
    const bool vx = aligned16(x), vw = aligned16(w), vo = aligned16(o);
    float xs[V], ws[V];
    float ss = 0.0f;
    for (int c = lane * V; c < C; c += 32 * V) {
        load_piece(xs, x, c, C, vx);
        for (int k = 0; k < V; k++) ss += xs[k] * xs[k]; /* 0 past C */
    }
    float r = 1.0f / sqrtf(warp_sum(ss) / (float)C + eps);
    for (int c = lane * V; c < C; c += 32 * V) {
        load_piece(xs, x, c, C, vx);
        load_piece(ws, w, c, C, vw);
        for (int k = 0; k < V; k++) xs[k] = xs[k] * r * gain(ws[k], offset);
        store_piece(o, xs, c, C, vo);
    }
    return r;
}

/* One row's input gradient by one warp, g = w + offset: v = r (g d) - x r^3 mean(g d x);
 * di += v with acc, else di = v. di may be d: a lane reads a piece of d before it writes
 * that piece of di, and no other lane touches its channels. */
template <typename T>
__device__ __forceinline__ void rms_row_bwd(T *di, const T *d, const T *x, const T *w, float r,
                                            int C, float offset, bool acc) {
    constexpr int V = piece<T>::V;
    const int lane = threadIdx.x & 31;
    const bool vd = aligned16(d), vx = aligned16(x), vw = aligned16(w), vi = aligned16(di);
    float ds[V], xs[V], ws[V], is[V];
    float dot = 0.0f;
    for (int c = lane * V; c < C; c += 32 * V) {
        load_piece(ds, d, c, C, vd);
        load_piece(xs, x, c, C, vx);
        load_piece(ws, w, c, C, vw);
        for (int j = 0; j < V && c + j < C; j++) dot += gain(ws[j], offset) * ds[j] * xs[j];
    }
    float k = warp_sum(dot) / (float)C * r * r * r;
    for (int c = lane * V; c < C; c += 32 * V) {
        load_piece(ds, d, c, C, vd);
        load_piece(xs, x, c, C, vx);
        load_piece(ws, w, c, C, vw);
        if (acc) load_piece(is, di, c, C, vi);
        for (int j = 0; j < V; j++) {
            const float v = gain(ws[j], offset) * ds[j] * r - xs[j] * k;
            is[j] = acc ? is[j] + v : v;
        }
        store_piece(di, is, c, C, vi);
    }
}

template <typename T>
__global__ void rmsnorm_fwd_k(T *out, float *rstd, const T *inp, const T *w, int N, int C,
                              float eps, float offset) {
    int lane = threadIdx.x & 31, row = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / 32;
    if (row >= N) return;
    float r = rms_row_fwd(out + (size_t)row * C, inp + (size_t)row * C, w, C, eps, offset);
    if (lane == 0) rstd[row] = r;
}

/* dinp accumulates, row by row (one warp each). */
template <typename T>
__global__ void rmsnorm_bwd_dx_k(T *dinp, const T *dout, const T *inp, const T *w,
                                 const float *rstd, int N, int C, float offset) {
    int row = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / 32;
    if (row >= N) return;
    rms_row_bwd(dinp + (size_t)row * C, dout + (size_t)row * C, inp + (size_t)row * C, w,
                rstd[row], C, offset, true);
}

template <typename T>
static void rmsnorm_bwd(fy_cu_stream *cs, const fy_op *op) {
    cudaStream_t st = cs->st;
    T *dinp = (T *)op->p[0], *dw = (T *)op->p[1];
    const T *dout = (const T *)op->p[2], *inp = (const T *)op->p[3], *w = (const T *)op->p[4];
    const float *rstd = (const float *)op->p[5];
    int N = (int)op->i[0], C = (int)op->i[1];
    if (N <= 0 || C <= 0) return;
    FY_LAUNCH(grid_for((size_t)N, ROWS_PER_BLOCK), 32 * ROWS_PER_BLOCK, 0, st, rmsnorm_bwd_dx_k<T>)(
        dinp, dout, inp, w, rstd, N, C, op->f[0]);
    LAUNCHED("rmsnorm_bwd (dinp)");
    int rows = rows_per_chunk(N, C), R = (N + rows - 1) / rows;
    dim3 grid((unsigned)((C + 31) / 32), (unsigned)R), block(32, 8);
    FY_LAUNCH(grid, block, 0, st, colsum_part_k<T, RMS>)(cs->part, dout, inp, NULL, rstd, N, C, rows, C);
    LAUNCHED("rmsnorm_bwd (partials)");
    FY_LAUNCH(grid_for((size_t)C, 256), 256, 0, st, colsum_finish_k<T>)(dw, cs->part, R, C, C);
    LAUNCHED("rmsnorm_bwd (dw)");
}

/* ---- per-head RMSNorm of q and k ------------------------------------------------------
 * Packed rows (N, W), W = (NH + 2 NKV) hd: row n's head h at n W + h hd, the query heads
 * (gain wq), the key heads (wk), the value heads (copied). One warp per (row, head): a
 * block's warps take ROWS_PER_BLOCK heads (x) of rows along y (qk_grid). */

static dim3 qk_grid(int N, int NH, int NKV) {
    return dim3((unsigned)((NH + 2 * NKV + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK),
                grid_rows((size_t)N));
}

template <typename T>
__global__ void qk_norm_fwd_k(T *out, float *rstd, const T *inp, const T *wq, const T *wk, int N,
                              int NH, int NKV, int hd, float eps, float offset) {
    const int heads = NH + NKV, all = heads + NKV, lane = threadIdx.x & 31;
    const int h = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / 32;
    if (h >= all) return; /* whole warps */
    for (int n = blockIdx.y; n < N; n += gridDim.y) {
        const size_t off = (size_t)n * all * hd + (size_t)h * hd;
        if (h >= heads) { /* a value head */
            if (out != inp)
                for (int c = lane; c < hd; c += 32) out[off + c] = inp[off + c];
            continue;
        }
        float r = rms_row_fwd(out + off, inp + off, h < NH ? wq : wk, hd, eps, offset);
        if (lane == 0) rstd[(size_t)n * heads + h] = r;
    }
}

/* dinp overwritten; value heads copied from dout (nothing to do in place). */
template <typename T>
__global__ void qk_norm_bwd_dx_k(T *dinp, const T *dout, const T *inp, const T *wq, const T *wk,
                                 const float *rstd, int N, int NH, int NKV, int hd, float offset) {
    const int heads = NH + NKV, all = heads + NKV, lane = threadIdx.x & 31;
    const int h = blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / 32;
    if (h >= all) return; /* whole warps */
    for (int n = blockIdx.y; n < N; n += gridDim.y) {
        const size_t off = (size_t)n * all * hd + (size_t)h * hd;
        if (h >= heads) {
            if (dinp != dout)
                for (int c = lane; c < hd; c += 32) dinp[off + c] = dout[off + c];
            continue;
        }
        rms_row_bwd(dinp + off, dout + off, inp + off, h < NH ? wq : wk,
                    rstd[(size_t)n * heads + h], hd, offset, false);
    }
}

/* A gain's partial sums, colsum_part_k's layout (block (32, 8): 32 channels, block y a
 * chunk of rows_per rows; the 8 row lanes added in lane order) over the R = N nh rows
 * (n, h0 + j), n-major: part[y * hd + c] = sum of dout * inp * rstd. */
template <typename T>
__global__ void qk_norm_dw_part_k(float *part, const T *dout, const T *inp, const float *rstd,
                                  int R, int nh, int h0, int heads, int W, int hd, int rows_per) {
    __shared__ float s0[8][33];
    int tx = threadIdx.x, ty = threadIdx.y, c = blockIdx.x * 32 + tx;
    int lo = blockIdx.y * rows_per, hi = lo + rows_per < R ? lo + rows_per : R;
    float a0 = 0.0f;
    if (c < hd) {
        for (int q = lo + ty; q < hi; q += 8) {
            const int n = q / nh, h = h0 + q % nh;
            const size_t at = (size_t)n * W + (size_t)h * hd + c;
            a0 += to_f(inp[at]) * rstd[(size_t)n * heads + h] * to_f(dout[at]);
        }
    }
    s0[ty][tx] = a0;
    __syncthreads();
    if (ty == 0 && c < hd) {
        float t0 = 0.0f;
        for (int k = 0; k < 8; k++) t0 += s0[k][tx];
        part[(size_t)blockIdx.y * hd + c] = t0;
    }
}

/* dw (hd) += the sum over the rows of heads h0..h0+nh-1, in a fixed order. */
template <typename T>
static void qk_norm_dw(fy_cu_stream *cs, T *dw, const T *dout, const T *inp, const float *rstd,
                       int N, int nh, int h0, int heads, int W, int hd) {
    const int R = N * nh, rows = rows_per_chunk(R, hd), chunks = (R + rows - 1) / rows;
    dim3 grid((unsigned)((hd + 31) / 32), (unsigned)chunks), block(32, 8);
    FY_LAUNCH(grid, block, 0, cs->st, qk_norm_dw_part_k<T>)(cs->part, dout, inp, rstd, R, nh, h0,
                                                           heads, W, hd, rows);
    LAUNCHED("qk_norm_bwd (partials)");
    FY_LAUNCH(grid_for((size_t)hd, 256), 256, 0, cs->st, colsum_finish_k<T>)(dw, cs->part, chunks, hd, hd);
    LAUNCHED("qk_norm_bwd (dw)");
}

/* The gains' gradients first (they read dout), then dinp, which may be dout. */
template <typename T>
static void qk_norm_bwd(fy_cu_stream *cs, const fy_op *op) {
    T *dinp = (T *)op->p[0], *dwq = (T *)op->p[1], *dwk = (T *)op->p[2];
    const T *dout = (const T *)op->p[3], *inp = (const T *)op->p[4];
    const T *wq = (const T *)op->p[5], *wk = (const T *)op->p[6];
    const float *rstd = (const float *)op->p[7];
    const int N = (int)op->i[0], NH = (int)op->i[1], NKV = (int)op->i[2], hd = (int)op->i[3];
    const int W = (NH + 2 * NKV) * hd;
    if (N <= 0) return;
    qk_norm_dw<T>(cs, dwq, dout, inp, rstd, N, NH, 0, NH + NKV, W, hd);
    qk_norm_dw<T>(cs, dwk, dout, inp, rstd, N, NKV, NH, NH + NKV, W, hd);
    FY_LAUNCH(qk_grid(N, NH, NKV), 32 * ROWS_PER_BLOCK, 0, cs->st, qk_norm_bwd_dx_k<T>)(
        dinp, dout, inp, wq, wk, rstd, N, NH, NKV, hd, op->f[0]);
    LAUNCHED("qk_norm_bwd (dinp)");
}

template <typename T>
static void colsum_acc(fy_cu_stream *cs, void *dst, const void *x, int N, int C) {
    if (N <= 0 || C <= 0) return;
    int rows = rows_per_chunk(N, C), R = (N + rows - 1) / rows;
    dim3 grid((unsigned)((C + 31) / 32), (unsigned)R), block(32, 8);
    FY_LAUNCH(grid, block, 0, cs->st, colsum_part_k<T, COLSUM>)(cs->part, (const T *)x, NULL, NULL, NULL,
                                                        N, C, rows, C);
    LAUNCHED("bias gradient (partials)");
    FY_LAUNCH(grid_for((size_t)C, 256), 256, 0, cs->st, colsum_finish_k<T>)((T *)dst, cs->part, R, C, C);
    LAUNCHED("bias gradient (sum)");
}

extern "C" void fy_cu_colsum_acc(fy_cu_stream *cs, fy_dtype dt, void *dst, const void *x, int N, int C) {
    if (dt == FY_BF16) colsum_acc<bf16>(cs, dst, x, N, C);
    else colsum_acc<float>(cs, dst, x, N, C);
}

template <typename T>
__global__ void bias_fill_k(T *out, const T *bias, int N, int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const T b = bias[c];
    for (int n = blockIdx.y; n < N; n += gridDim.y) out[(size_t)n * C + c] = b;
}

/* (N = 0 launches an empty grid's one block: cuda_backend.c's warm-up.) */
extern "C" void fy_cu_bias_fill(fy_cu_stream *cs, fy_dtype dt, void *out, const void *bias, int N, int C) {
    const dim3 g = rows_grid(N, C);
    if (dt == FY_BF16) FY_LAUNCH(g, ROW_THREADS, 0, cs->st, bias_fill_k<bf16>)((bf16 *)out, (const bf16 *)bias, N, C);
    else FY_LAUNCH(g, ROW_THREADS, 0, cs->st, bias_fill_k<float>)((float *)out, (const float *)bias, N, C);
    LAUNCHED("matmul bias");
}

/* ---- pointwise ---------------------------------------------------------------------- */

/* GELU, tanh approximation, and its derivative: fy_k_gelu's and GeGLU's. */
__device__ __forceinline__ float gelu_tanh(float x) {
    return 0.5f * x * (1.0f + tanhf(GELU_K * (x + 0.044715f * x * x * x)));
}
__device__ __forceinline__ float gelu_tanh_grad(float x) {
    float th = tanhf(GELU_K * (x + 0.044715f * x * x * x));
    float sech2 = 1.0f - th * th;
    return 0.5f * (1.0f + th) + 0.5f * x * sech2 * GELU_K * (1.0f + 3.0f * 0.044715f * x * x);
}

template <typename T>
__global__ void gelu_fwd_k(T *out, const T *inp, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        out[i] = from_f<T>(gelu_tanh(to_f(inp[i])));
}

template <typename T>
__global__ void gelu_bwd_k(T *dinp, const T *inp, const T *dout, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dinp[i] = from_f<T>(gelu_tanh_grad(to_f(inp[i])) * to_f(dout[i]));
}

/* GLU over rows gu (N, 2F) = [gate | up]: out (N, F) = act(gate) * up, act silu or
 * gelu_tanh (fy_glu_act). 2D: channel j along x, rows along y. */
template <typename T>
__global__ void glu_fwd_k(T *out, const T *gu, int N, int F, int act) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= F) return;
    for (int n = blockIdx.y; n < N; n += gridDim.y) {
        const T *r = gu + (size_t)n * 2 * F;
        float g = to_f(r[j]), u = to_f(r[F + j]);
        out[(size_t)n * F + j] = from_f<T>(act == FY_GLU_SILU ? g / (1.0f + expf(-g)) * u : gelu_tanh(g) * u);
    }
}

/* dgate = dout up act'(g), dup = dout act(g). */
template <typename T>
__global__ void glu_bwd_k(T *dgu, const T *gu, const T *dout, int N, int F, int act) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= F) return;
    for (int n = blockIdx.y; n < N; n += gridDim.y) {
        const T *r = gu + (size_t)n * 2 * F;
        T *dr = dgu + (size_t)n * 2 * F;
        float g = to_f(r[j]), u = to_f(r[F + j]), d = to_f(dout[(size_t)n * F + j]);
        float dg, du;
        if (act == FY_GLU_SILU) {
            float sg = 1.0f / (1.0f + expf(-g));
            dg = d * u * sg * (1.0f + g * (1.0f - sg));
            du = d * g * sg;
        } else {
            dg = d * u * gelu_tanh_grad(g);
            du = d * gelu_tanh(g);
        }
        dr[j] = from_f<T>(dg);
        dr[F + j] = from_f<T>(du);
    }
}

/* Each pair's inverse frequency (rope.h), computed once per launch on the host, as the
 * cpu backend computes it; with the attention factor. By value: 1 KiB of a kernel's
 * 4 KiB of parameters. */
typedef struct rope_freqs {
    double inv[FY_ROPE_MAX_PAIRS];
    double attn_factor;
    int half;  /* pairs: rot_dim / 2 */
} rope_freqs;

/* Rotary embeddings (rope.h) on the query and key heads of packed rows, at each row's
 * place in its document. A thread per (row, pair): pairs along x, rows along y; it turns
 * its pair in every head by one angle, computed in double (its cosine and sine times the
 * attention factor rounded to fp32, as the cpu backend does) once for all the heads. */
#define ROPE_ROWS 8 /* rows a block, a warp each (the pairs along its lanes) */

template <typename T>
__global__ void rope_k(T *qkv, const int32_t *docs, int N, int T_, int heads, int W, int hd,
                       bool inverse, rope_freqs f) {
    const int half = f.half;
    for (int n = blockIdx.y * blockDim.y + threadIdx.y; n < N; n += gridDim.y * blockDim.y) {
        const double pos = (double)position_of(docs, n, T_);
        for (int j = threadIdx.x; j < half; j += blockDim.x) {
            double sd, cd;
            sincos(pos * f.inv[j], &sd, &cd);
            const float c = (float)(cd * f.attn_factor);
            const float sn = inverse ? -(float)(sd * f.attn_factor) : (float)(sd * f.attn_factor);
            T *x = qkv + (size_t)n * W + j;
            for (int h = 0; h < heads; h++, x += hd) {
                const float x1 = to_f(x[0]), x2 = to_f(x[half]);
                x[0] = from_f<T>(x1 * c - x2 * sn);
                x[half] = from_f<T>(x2 * c + x1 * sn);
            }
        }
    }
}


template <typename T>
__global__ void residual_fwd_k(T *out, const T *a, const T *b, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        out[i] = from_f<T>(to_f(a[i]) + to_f(b[i]));
}

/* dst (storage type) += src (fp32), rounded once. */
template <typename T>
__global__ void add_f32_k(T *dst, const float *src, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = from_f<T>(to_f(dst[i]) + src[i]);
}

static unsigned pointwise_grid(size_t n) {
    unsigned g = grid_for(n, 256);
    return g > 65536 ? 65536 : g;
}

/* ---- cross-entropy -------------------------------------------------------------------- */

#define CE_THREADS 512

/* Block-wide reductions in a fixed order: lanes by butterfly, warps in warp order. */
static __device__ float block_max(float v, float *sh) {
    int lane = threadIdx.x & 31, w = threadIdx.x / 32, nw = blockDim.x / 32;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    float r = sh[0];
    for (int k = 1; k < nw; k++) r = fmaxf(r, sh[k]);
    return r;
}

static __device__ double block_sum_d(double v, double *sh) {
    int lane = threadIdx.x & 31, w = threadIdx.x / 32, nw = blockDim.x / 32;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    double r = 0.0;
    for (int k = 0; k < nw; k++) r += sh[k];
    return r;
}

/* Soft-capping (kernels.h): the logit the softmax sees, z = cap tanh(l / cap) (divide,
 * tanh, multiply, each rounded: no fused product), or l with cap 0; and z's gradient g
 * turned into l's, g (1 - tanh^2(l / cap)). */
__device__ __forceinline__ float capped(float l, float cap) {
    return cap > 0.0f ? __fmul_rn(cap, tanhf(__fdiv_rn(l, cap))) : l;
}
__device__ __forceinline__ float capped_grad(float g, float l, float cap) {
    if (!(cap > 0.0f)) return g;
    const float t = tanhf(__fdiv_rn(l, cap));
    return g * (1.0f - t * t);
}

/* One block per row of Vp logits, V of them classes: losses[n] = logsumexp -
 * logit[target] over the capped logits; with dloss != 0 the row becomes (softmax -
 * onehot) * dloss (times the cap's derivative) in place, and its padding 0. Only the
 * row's own logits are touched. */
template <typename T>
__global__ void crossentropy_k(float *losses, T *logits, const int32_t *targets, int V, int Vp,
                               float dloss, float cap) {
    __shared__ float shf[CE_THREADS / 32];
    __shared__ double shd[CE_THREADS / 32];
    int n = blockIdx.x;
    T *x = logits + (size_t)n * Vp;
    const int y = targets[n];
    if (y < 0) { /* a target the loss does not count (kernels.h): no loss, no gradient */
        if (threadIdx.x == 0) losses[n] = 0.0f;
        if (dloss != 0.0f)
            for (int j = threadIdx.x; j < Vp; j += blockDim.x) x[j] = from_f<T>(0.0f);
        return;
    }
    float mx = -INFINITY;
    for (int j = threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, capped(to_f(x[j]), cap));
    mx = block_max(mx, shf);
    double s = 0.0;
    for (int j = threadIdx.x; j < V; j += blockDim.x) s += exp((double)(capped(to_f(x[j]), cap) - mx));
    s = block_sum_d(s, shd);
    if (threadIdx.x == 0) losses[n] = mx + (float)log(s) - capped(to_f(x[y]), cap);
    if (dloss == 0.0f) return;
    __syncthreads(); /* x[y] is read before any thread writes */
    float inv = (float)(1.0 / s);
    for (int j = threadIdx.x; j < Vp; j += blockDim.x) {
        const float l = j < V ? to_f(x[j]) : 0.0f;
        float g = j < V ? expf(capped(l, cap) - mx) * inv * dloss : 0.0f;
        if (j == y) g -= dloss;
        x[j] = from_f<T>(j < V ? capped_grad(g, l, cap) : 0.0f);
    }
}

/* The classifier by vocabulary chunks (kernels.h): one block per row of the chunk's nv
 * logits, lim = min(nv, V - v0) of them classes. Forward: the chunk's max, then its
 * exps' fp64 sum at the new running max; thread 0 adds the earlier chunks' sum rescaled
 * (the cpu backend adds it first: the sums may differ in the last bits) and keeps the
 * target's logit; the chunk holding class V-1 writes the loss. */
template <typename T>
__global__ void ce_chunk_fwd_k(const T *logits, const int32_t *targets, float *mx, double *sm,
                               float *tl, float *losses, int v0, int nv, int V, float cap) {
    __shared__ float shf[CE_THREADS / 32];
    __shared__ double shd[CE_THREADS / 32];
    const int n = blockIdx.x, lim = V - v0 < nv ? V - v0 : nv;
    const bool first = v0 == 0;
    if (targets[n] < 0) { /* not counted: its running values stay neutral */
        if (threadIdx.x != 0) return;
        if (first) mx[n] = 0.0f, sm[n] = 1.0, tl[n] = 0.0f;
        if (v0 + nv >= V) losses[n] = 0.0f;
        return;
    }
    const T *x = logits + (size_t)n * nv;
    float cm = -INFINITY;
    for (int j = threadIdx.x; j < lim; j += blockDim.x) cm = fmaxf(cm, capped(to_f(x[j]), cap));
    cm = block_max(cm, shf);
    const float m = first ? cm : fmaxf(cm, mx[n]); /* read by all before thread 0 writes */
    double s = 0.0;
    for (int j = threadIdx.x; j < lim; j += blockDim.x) s += exp((double)(capped(to_f(x[j]), cap) - m));
    s = block_sum_d(s, shd);
    if (threadIdx.x != 0) return;
    if (!first) s += sm[n] * exp((double)(mx[n] - m));
    const int y = targets[n] - v0;
    float t = first ? 0.0f : tl[n];
    if (y >= 0 && y < lim) t = capped(to_f(x[y]), cap);
    mx[n] = m;
    sm[n] = s;
    tl[n] = t;
    if (v0 + nv >= V) losses[n] = m + (float)log(s) - t;
}

/* Backward: the chunk's logits become (softmax - onehot) * dloss (times the cap's
 * derivative), the padding 0. */
template <typename T>
__global__ void ce_chunk_bwd_k(T *logits, const int32_t *targets, const float *mx,
                               const double *sm, int v0, int nv, int V, float dloss, float cap) {
    const int n = blockIdx.x, lim = V - v0 < nv ? V - v0 : nv, y = targets[n] - v0;
    T *x = logits + (size_t)n * nv;
    if (targets[n] < 0) { /* not counted: no gradient */
        for (int j = threadIdx.x; j < nv; j += blockDim.x) x[j] = from_f<T>(0.0f);
        return;
    }
    const float m = mx[n], inv = (float)(1.0 / sm[n]);
    for (int j = threadIdx.x; j < nv; j += blockDim.x) {
        const float l = j < lim ? to_f(x[j]) : 0.0f;
        float g = j < lim ? expf(capped(l, cap) - m) * inv * dloss : 0.0f;
        if (j == y) g -= dloss;
        x[j] = from_f<T>(j < lim ? capped_grad(g, l, cap) : 0.0f);
    }
}

/* ---- sums ------------------------------------------------------------------------------- */

/* out[0] = sum(x) / div over fp32 x (the losses), in double, one block, in a fixed order
 * (strided per thread, then a fixed tree): not the cpu's index order, so the mean may
 * differ from it in the last bits. */
__global__ void mean_k(float *out, const float *x, size_t n, int64_t div) {
    __shared__ double sh[32];
    double s = 0.0;
    for (size_t i = threadIdx.x; i < n; i += blockDim.x) s += x[i];
    s = block_sum_d(s, sh);
    if (threadIdx.x == 0) out[0] = (float)(s / (double)div);
}

/* reduce.h's order: each chunk of FY_SUMSQ_CHUNK elements summed in double in index
 * order, then the chunk sums added in chunk order (sumsq_total_k). For fp32 these are
 * fy_sumsq()'s bits, so a gradient norm does not depend on where the gradient is.
 * One warp per chunk: the lanes load 32 consecutive squares (coalesced) and every lane
 * adds them in index order (the same sum in each lane; adding the zeros past the end
 * changes nothing, the sum being non-negative). */
template <typename T>
__global__ void sumsq_chunks_k(double *part, const T *x, size_t n, size_t nchunks) {
    int lane = threadIdx.x & 31;
    size_t c = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    if (c >= nchunks) return; /* whole warps */
    size_t i0 = c * FY_SUMSQ_CHUNK, i1 = i0 + FY_SUMSQ_CHUNK < n ? i0 + FY_SUMSQ_CHUNK : n;
    double s = 0.0;
    for (size_t i = i0; i < i1; i += 32) {
        double v = i + lane < i1 ? (double)to_f(x[i + lane]) : 0.0;
        double sq = __dmul_rn(v, v);
        for (int k = 0; k < 32; k++) s = __dadd_rn(s, __shfl_sync(FULL_MASK, sq, k));
    }
    if (lane == 0) part[c] = s;
}

/* out[0] = the chunk sums added from 0.0 in chunk order: reduce.h's order, which no tree
 * keeps (a tree adds in another order, so other bits), so one thread adds; what runs in
 * parallel is the reading. The block loads SUMSQ_TILE sums at a time into shared memory,
 * all loads in flight at once, while thread 0 adds the previous tile's from shared
 * memory: the sum runs at the rate of dependent additions, not of one thread's global
 * loads one after another. */
#define SUMSQ_TILE 256
__global__ void sumsq_total_k(double *out, const double *part, size_t nchunks) {
    __shared__ double tile[2][SUMSQ_TILE];
    const size_t ntiles = (nchunks + SUMSQ_TILE - 1) / SUMSQ_TILE;
    double s = 0.0;
    for (size_t t = 0; t <= ntiles; t++) {
        const size_t c = t * SUMSQ_TILE + threadIdx.x;
        if (t < ntiles && c < nchunks) tile[t % 2][threadIdx.x] = part[c];
        if (threadIdx.x == 0 && t > 0) { /* tile t - 1, loaded before the last barrier */
            const size_t c0 = (t - 1) * SUMSQ_TILE, n = nchunks - c0 < SUMSQ_TILE ? nchunks - c0 : SUMSQ_TILE;
            for (size_t k = 0; k < n; k++) s = __dadd_rn(s, tile[(t - 1) % 2][k]);
        }
        __syncthreads(); /* tile t is loaded; tile t - 1 is added and may be overwritten */
    }
    if (threadIdx.x == 0) out[0] = s;
}

template <typename T>
static void sumsq(fy_cu_stream *cs, const fy_op *op) {
    size_t n = (size_t)op->i[0], nchunks = fy_sumsq_nchunks(n);
    FY_ASSERT(nchunks * sizeof(double) <= FY_CU_PART_NBYTES, "sumsq of more elements than the partials buffer holds");
    double *part = (double *)cs->part;
    if (nchunks)
        FY_LAUNCH(grid_for(nchunks * 32, 128), 128, 0, cs->st, sumsq_chunks_k<T>)(part, (const T *)op->p[1], n, nchunks);
    FY_LAUNCH(1, SUMSQ_TILE, 0, cs->st, sumsq_total_k)((double *)op->p[0], part, nchunks);
    LAUNCHED("sumsq");
}

template <typename T>
static void sumsq_parts(fy_cu_stream *cs, const fy_op *op) {
    size_t n = (size_t)op->i[0], nchunks = fy_sumsq_nchunks(n);
    if (nchunks)
        FY_LAUNCH(grid_for(nchunks * 32, 128), 128, 0, cs->st, sumsq_chunks_k<T>)((double *)op->p[0],
                                                                                (const T *)op->p[1], n, nchunks);
    LAUNCHED("sumsq_parts");
}

/* ---- AdamW ------------------------------------------------------------------------------- */

__device__ __forceinline__ float load_grad(const void *g, int t, size_t i) {
    if (t == FY_BF16) return __bfloat162float(((const bf16 *)g)[i]);
    if (t == FY_F16) return __half2float(((const __half *)g)[i]);
    return ((const float *)g)[i];
}

/* adam.h's sequence of IEEE operations, each written with an explicit rounding
 * intrinsic so the compiler cannot contract or reorder it: fy_adam_step's bits. */
__global__ void adamw_k(float *param, float *m, float *v, const void *grad, int gt,
                        void *out, int ot, size_t n, fy_adam_consts c) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float g = __fmul_rn(load_grad(grad, gt, i), c.grad_scale);
        float w = __fmul_rn(param[i], c.decay_mul);
        float mi = __fmaf_rn(c.beta1, m[i], __fmul_rn(c.omb1, g));
        float vi = __fmaf_rn(c.beta2, v[i], __fmul_rn(__fmul_rn(c.omb2, g), g));
        float d = __fmaf_rn(__fsqrt_rn(vi), c.rsbc2, c.eps);
        w = __fmaf_rn(c.neg_step_size, __fdiv_rn(mi, d), w);
        param[i] = w;
        m[i] = mi;
        v[i] = vi;
        if (out) {
            if (ot == FY_BF16) ((bf16 *)out)[i] = __float2bfloat16_rn(w);
            else if (ot == FY_F16) ((__half *)out)[i] = __float2half_rn(w);
            else ((float *)out)[i] = w;
        }
    }
}

static void adamw(cudaStream_t st, const fy_op *op) {
    fy_adam_hparams hp = {op->f[0], op->f[1], op->f[2], op->f[3], op->f[4], op->i[4], op->f[5], false};
    fy_adam_consts c;
    fy_adam_consts_init(&hp, op->i[3] != 0, &c);
    size_t n = (size_t)op->i[0];
    if (n == 0) return;
    FY_LAUNCH(pointwise_grid(n), 256, 0, st, adamw_k)((float *)op->p[0], (float *)op->p[1],
        (float *)op->p[2], op->p[3], (int)op->i[1], op->p[4], (int)op->i[2], n, c);
    LAUNCHED("adamw");
}

/* ---- attention ------------------------------------------------------------------------------ */

#include "engine/device/cuda/cuda_attention.cuh"

/* ---- dispatch ------------------------------------------------------------------------------ */

template <typename T>
static void exec_typed(fy_cu_stream *cs, const fy_op *op) {
    cudaStream_t st = cs->st;
    void *const *p = op->p;
    const int64_t *i = op->i;
    switch (op->kind) {
    case FY_OP_ENCODER_FWD: encoder_fwd<T>(st, op); break;
    case FY_OP_ENCODER_BWD: encoder_bwd<T>(st, op); break;
    case FY_OP_LAYERNORM_FWD: {
        int N = (int)i[0], C = (int)i[1];
        FY_LAUNCH(grid_for((size_t)N, ROWS_PER_BLOCK), 32 * ROWS_PER_BLOCK, 0, st, layernorm_fwd_k<T>)(
            (T *)p[0], (float *)p[1], (float *)p[2], (const T *)p[3], (const T *)p[4],
            (const T *)p[5], N, C);
        LAUNCHED("layernorm_fwd");
        break;
    }
    case FY_OP_LAYERNORM_BWD: layernorm_bwd<T>(cs, op); break;
    case FY_OP_RMSNORM_FWD: {
        int N = (int)i[0], C = (int)i[1];
        if (N > 0)
            FY_LAUNCH(grid_for((size_t)N, ROWS_PER_BLOCK), 32 * ROWS_PER_BLOCK, 0, st, rmsnorm_fwd_k<T>)(
                (T *)p[0], (float *)p[1], (const T *)p[2], (const T *)p[3], N, C, op->f[0], op->f[1]);
        LAUNCHED("rmsnorm_fwd");
        break;
    }
    case FY_OP_RMSNORM_BWD: rmsnorm_bwd<T>(cs, op); break;
    case FY_OP_QK_NORM_FWD: {
        const int N = (int)i[0], NH = (int)i[1], NKV = (int)i[2], hd = (int)i[3];
        if (N > 0 && NH + 2 * NKV > 0)
            FY_LAUNCH(qk_grid(N, NH, NKV), 32 * ROWS_PER_BLOCK, 0, st, qk_norm_fwd_k<T>)(
                (T *)p[0], (float *)p[1], (const T *)p[2], (const T *)p[3], (const T *)p[4], N, NH,
                NKV, hd, op->f[0], op->f[1]);
        LAUNCHED("qk_norm_fwd");
        break;
    }
    case FY_OP_QK_NORM_BWD: qk_norm_bwd<T>(cs, op); break;
    case FY_OP_ROPE: {
        int B = (int)i[0], T_ = (int)i[1], NH = (int)i[2], NKV = (int)i[3], hd = (int)i[4];
        const fy_rope r = fy_op_rope(op);
        rope_freqs f;
        memset(&f, 0, sizeof f);
        f.half = r.rot_dim / 2;
        f.attn_factor = r.attn_factor;
        FY_ASSERT(f.half <= FY_ROPE_MAX_PAIRS, "a rotation of more pairs than rope.h allows");
        for (int j = 0; j < f.half; j++) f.inv[j] = fy_rope_inv_freq(&r, j, r.rot_dim);
        const int N = B * T_;
        const unsigned rows = (unsigned)((N + ROPE_ROWS - 1) / ROPE_ROWS);
        if (N > 0 && f.half > 0 && NH + NKV > 0)
            FY_LAUNCH(dim3(1, grid_rows(rows)), dim3(32, ROPE_ROWS), 0, st, rope_k<T>)(
                (T *)p[0], (const int32_t *)p[1], N, T_, NH + NKV, (NH + 2 * NKV) * hd, hd,
                i[5] != 0, f);
        LAUNCHED("rope");
        break;
    }
    case FY_OP_ATTENTION_FWD: case FY_OP_ATTENTION_BWD: attention<T>(st, op); break;
    case FY_OP_GLU_FWD: {
        const int N = (int)i[0], F = (int)i[1];
        if (N > 0 && F > 0)
            FY_LAUNCH(rows_grid(N, F), ROW_THREADS, 0, st, glu_fwd_k<T>)((T *)p[0], (const T *)p[1], N, F,
                (int)i[2]);
        LAUNCHED("glu_fwd");
        break;
    }
    case FY_OP_GLU_BWD: {
        const int N = (int)i[0], F = (int)i[1];
        if (N > 0 && F > 0)
            FY_LAUNCH(rows_grid(N, F), ROW_THREADS, 0, st, glu_bwd_k<T>)((T *)p[0], (const T *)p[1],
                (const T *)p[2], N, F, (int)i[2]);
        LAUNCHED("glu_bwd");
        break;
    }
    case FY_OP_GELU_FWD:
        if (i[0]) FY_LAUNCH(pointwise_grid((size_t)i[0]), 256, 0, st, gelu_fwd_k<T>)((T *)p[0], (const T *)p[1], (size_t)i[0]);
        LAUNCHED("gelu_fwd");
        break;
    case FY_OP_GELU_BWD:
        if (i[0]) FY_LAUNCH(pointwise_grid((size_t)i[0]), 256, 0, st, gelu_bwd_k<T>)((T *)p[0], (const T *)p[1], (const T *)p[2], (size_t)i[0]);
        LAUNCHED("gelu_bwd");
        break;
    case FY_OP_RESIDUAL_FWD:
        if (i[0]) FY_LAUNCH(pointwise_grid((size_t)i[0]), 256, 0, st, residual_fwd_k<T>)((T *)p[0], (const T *)p[1], (const T *)p[2], (size_t)i[0]);
        LAUNCHED("residual_fwd");
        break;
    case FY_OP_ADD_F32:
        if (i[0]) FY_LAUNCH(pointwise_grid((size_t)i[0]), 256, 0, st, add_f32_k<T>)((T *)p[0], (const float *)p[1], (size_t)i[0]);
        LAUNCHED("add_f32");
        break;
    case FY_OP_CROSSENTROPY:
        if (i[0]) FY_LAUNCH((unsigned)i[0], CE_THREADS, 0, st, crossentropy_k<T>)((float *)p[0], (T *)p[1],
            (const int32_t *)p[2], (int)i[1], (int)i[2], op->f[0], op->f[1]);
        LAUNCHED("crossentropy");
        break;
    case FY_OP_CE_CHUNK_FWD:
        if (i[0]) FY_LAUNCH((unsigned)i[0], CE_THREADS, 0, st, ce_chunk_fwd_k<T>)((const T *)p[0],
            (const int32_t *)p[1], (float *)p[2], (double *)p[3], (float *)p[4], (float *)p[5],
            (int)i[1], (int)i[2], (int)i[3], op->f[0]);
        LAUNCHED("ce_chunk_fwd");
        break;
    case FY_OP_CE_CHUNK_BWD:
        if (i[0]) FY_LAUNCH((unsigned)i[0], CE_THREADS, 0, st, ce_chunk_bwd_k<T>)((T *)p[0],
            (const int32_t *)p[1], (const float *)p[2], (const double *)p[3], (int)i[1], (int)i[2],
            (int)i[3], op->f[0], op->f[1]);
        LAUNCHED("ce_chunk_bwd");
        break;
    case FY_OP_MEAN:
        FY_LAUNCH(1, 1024, 0, st, mean_k)((float *)p[0], (const float *)p[1], (size_t)i[0], i[1]);
        LAUNCHED("mean");
        break;
    case FY_OP_SUMSQ: sumsq<T>(cs, op); break;
    case FY_OP_SUMSQ_PARTS: sumsq_parts<T>(cs, op); break;
    case FY_OP_ADAMW: adamw(st, op); break;
    default: FY_ASSERT(0, "op not handled by the cuda kernels");
    }
}

extern "C" void fy_cu_exec_kernel(fy_cu_stream *cs, const fy_op *op) {
    if (op->dt == FY_BF16) exec_typed<bf16>(cs, op);
    else exec_typed<float>(cs, op);
}
