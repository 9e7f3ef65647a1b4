/* cuda_attention.cuh — the cuda backend's attention (kernels.h's fy_k_attention_fwd/bwd):
 * FlashAttention-2's algorithm, hand-written. Included once, by cuda_kernels.cu, whose
 * helpers it uses (to_f, from_f, warp_sum, FY_LAUNCH, LAUNCHED); so the emulation of the
 * kernel tests (tests/cuda_emu) compiles it with the rest.
 *
 * Which implementation, and why: a hand-written kernel on the mma.sync tensor-core
 * instruction, not cuDNN's fused attention (nor cuBLASLt GEMMs around a T x T matrix,
 * which this replaces). The mask (causal, sliding window, packed documents), the saved
 * log-sum-exp and the determinism rule (no atomics: results depend on inputs and shapes
 * only) are ferry's contract; cuDNN's backward sums dQ with atomics unless told
 * otherwise, its document masks need their own layout, and it is a large optional
 * dependency whose results could not be checked here. This kernel is the same source the
 * CPU emulation runs (fy_mma_16816_bf16 emulated from the PTX ISA's fragment layouts), so
 * every machine checks it against the cpu backend, races included.
 *
 * Tiles. A block owns R rows ("own" rows: queries in the forward and dQ kernels, keys in
 * the dK/dV kernel), 16 per warp, and walks the other side C rows at a time (C keys, or C
 * queries). Each warp computes 16 x C score blocks from shared memory with m16n8k16 products
 * (bf16 storage) or the same blocks by fp32 FMAs in the same register layout (fp32
 * storage; one code path for both: mma_ops<T> below). The tiles R, C depend on the storage
 * type and the head size hd so that the static shared memory (2 R hd + 2 C hd + 2 R C
 * elements) stays under 46 KiB: bf16 hd 16..32 64x64, hd 64 64x32, hd 128 32x32, hd 256
 * 16x16; fp32 hd 16..32 64x32, hd 64 32x32, hd 128 16x16 (fp32 hd 256 does not fit and is
 * refused). The probabilities P and score gradients dS pass from a warp's accumulators to
 * its next product's A operand through the warp's own rows of shared memory, rounded to
 * the storage type there (bf16 only as mma inputs); the row statistics (running max, sum,
 * lse, delta) stay fp32 in registers.
 *
 * Scores: q.k * scale, then with a soft cap c, c tanh(score / c) (att_scores); the backward
 * rebuilds P from the capped scores and multiplies dS by the tanh's derivative, 1 - (capped
 * score / c)^2 (att_dcap), before its products.
 *
 * Masks: query t sees key j iff lo(t) <= j <= t (kernels.h); lo is nondecreasing in t, so
 * a query tile needs the keys from lo(first query) to its last query, and a key tile the
 * queries from its first key to the last t with lo(t) <= its last key (a binary search).
 * Tiles outside those ranges are never loaded; inside, each element is masked.
 *
 * Three kernels for the backward, after delta = rowsum(dout * out): dK and dV sum over
 * query heads and query tiles, dQ over key tiles. One kernel per key tile would have to
 * add its dQ shares into rows other blocks also add into (atomics, or an order between
 * blocks); so dK/dV run one block per (key tile, key/value head), summing the G query
 * heads of the group in head order and their query tiles in order, and dQ a second pass,
 * one block per query tile, over key tiles in order, recomputing P (from lse) and dP.
 * Every output element has one writer and a fixed order of additions.
 *
 * Not done (performance): ldmatrix and cp.async loads, double buffering, P kept in
 * registers between the two products of the forward. */

/* ---- the warp's 16 x 8 x 16 product ----------------------------------------------------- */

/* Loops over fragments unrolled, so the fragments stay in registers (nvcc's pragma; the
 * host compiler of the emulation does not know it). */
#ifdef FY_CUDA_EMU
#define ATT_UNROLL
#else
#define ATT_UNROLL _Pragma("unroll")
#endif

#ifndef FY_CUDA_EMU
/* D = A B + C on the tensor cores (sm_80 and newer); the fragments as the PTX ISA lays
 * them out for mma.m16n8k16 (cuda_emu.h repeats them for its emulation). */
__device__ __forceinline__ void fy_mma_16816_bf16(float d[4], const uint32_t a[4], const uint32_t b[2],
                                                  const float c[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    __trap(); /* not built for such GPUs: meson's gpu_arch starts at 80 */
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
                   "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
#endif
}
#endif

/* Operand blocks in shared memory by strides: A (16 x 16) element (i, k) at a[i*rs + k*cs],
 * B (16 x 8) element (k, n) at b[k*ks + n*ns]. Lane l holds, of each 16 x 8 result block,
 * rows g = l/4 and g + 8, columns 2u and 2u + 1 (u = l % 4): c[0] (g, 2u), c[1] (g, 2u+1),
 * c[2] (g+8, 2u), c[3] (g+8, 2u+1), the mma's accumulator layout, for both types. */
template <typename T> struct mma_ops;

template <> struct mma_ops<bf16> {
    struct A { uint32_t r[4]; };
    struct B { uint32_t r[2]; };
    static __device__ __forceinline__ uint32_t pack(bf16 lo, bf16 hi) {
        uint16_t l, h;
        memcpy(&l, &lo, 2);
        memcpy(&h, &hi, 2);
        return (uint32_t)l | (uint32_t)h << 16;
    }
    /* a_i (i = 0..7, two to a register, low half first): row g (i = 0, 1, 4, 5) or g + 8,
     * column 2u + (i & 1), + 8 for i >= 4 */
    static __device__ __forceinline__ void load_a(A &f, const bf16 *a, int rs, int cs) {
        const int g = (threadIdx.x & 31) >> 2, u = threadIdx.x & 3;
        const bf16 *r0 = a + g * rs, *r1 = a + (g + 8) * rs;
        f.r[0] = pack(r0[2 * u * cs], r0[(2 * u + 1) * cs]);
        f.r[1] = pack(r1[2 * u * cs], r1[(2 * u + 1) * cs]);
        f.r[2] = pack(r0[(2 * u + 8) * cs], r0[(2 * u + 9) * cs]);
        f.r[3] = pack(r1[(2 * u + 8) * cs], r1[(2 * u + 9) * cs]);
    }
    /* b_i (i = 0..3): row 2u + (i & 1), + 8 for i >= 2; column g */
    static __device__ __forceinline__ void load_b(B &f, const bf16 *b, int ks, int ns) {
        const int g = (threadIdx.x & 31) >> 2, u = threadIdx.x & 3;
        const bf16 *col = b + g * ns;
        f.r[0] = pack(col[2 * u * ks], col[(2 * u + 1) * ks]);
        f.r[1] = pack(col[(2 * u + 8) * ks], col[(2 * u + 9) * ks]);
    }
    static __device__ __forceinline__ void mma(float c[4], const A &a, const B &b) {
        fy_mma_16816_bf16(c, a.r, b.r, c);
    }
};

/* fp32: the lane's two rows of A and two columns of B, 16 deep, by FMAs in k order */
template <> struct mma_ops<float> {
    struct A { float r[2][16]; };
    struct B { float r[2][16]; };
    static __device__ __forceinline__ void load_a(A &f, const float *a, int rs, int cs) {
        const int g = (threadIdx.x & 31) >> 2;
ATT_UNROLL
        for (int k = 0; k < 16; k++) {
            f.r[0][k] = a[g * rs + k * cs];
            f.r[1][k] = a[(g + 8) * rs + k * cs];
        }
    }
    static __device__ __forceinline__ void load_b(B &f, const float *b, int ks, int ns) {
        const int u = threadIdx.x & 3;
ATT_UNROLL
        for (int k = 0; k < 16; k++) {
            f.r[0][k] = b[k * ks + 2 * u * ns];
            f.r[1][k] = b[k * ks + (2 * u + 1) * ns];
        }
    }
    static __device__ __forceinline__ void mma(float c[4], const A &a, const B &b) {
ATT_UNROLL
        for (int i = 0; i < 4; i++) {
            float s = c[i];
ATT_UNROLL
            for (int k = 0; k < 16; k++) s += a.r[i >> 1][k] * b.r[i & 1][k];
            c[i] = s;
        }
    }
};

/* acc[n] (the 16 x 8 block n of 16 x 8N) += A (16 x K) B (K x 8N), K a multiple of 16. */
template <typename T, int N, int K>
__device__ __forceinline__ void warp_gemm(float (&acc)[N][4], const T *a, int a_rs, int a_cs,
                                          const T *b, int b_ks, int b_ns) {
    typedef mma_ops<T> ops;
ATT_UNROLL
    for (int k0 = 0; k0 < K; k0 += 16) {
        typename ops::A fa;
        ops::load_a(fa, a + k0 * a_cs, a_rs, a_cs);
ATT_UNROLL
        for (int n = 0; n < N; n++) {
            typename ops::B fb;
            ops::load_b(fb, b + k0 * b_ks + n * 8 * b_ns, b_ks, b_ns);
            ops::mma(acc[n], fa, fb);
        }
    }
}

/* ---- tiles -------------------------------------------------------------------------------- */

#define ATT_SMEM_MAX (46 * 1024)

/* Static shared bytes of R own rows and C streamed rows: two R x hd and two C x hd tiles,
 * two R x C blocks, three C-long row vectors. */
__host__ __device__ constexpr int att_smem(int es, int hd, int r, int c) {
    return es * (2 * r * hd + 2 * c * hd + 2 * r * c) + 12 * c;
}

/* The first (R, C) of 64x64, 64x32, 32x32, 32x16, 16x16 that fits, or (0, 0). */
template <typename T, int HD> struct att_tiles {
    static constexpr int es = (int)sizeof(T);
    static constexpr int pick = att_smem(es, HD, 64, 64) <= ATT_SMEM_MAX ? 0
                              : att_smem(es, HD, 64, 32) <= ATT_SMEM_MAX ? 1
                              : att_smem(es, HD, 32, 32) <= ATT_SMEM_MAX ? 2
                              : att_smem(es, HD, 32, 16) <= ATT_SMEM_MAX ? 3
                              : att_smem(es, HD, 16, 16) <= ATT_SMEM_MAX ? 4 : 5;
    static constexpr int R = pick <= 1 ? 64 : pick <= 3 ? 32 : pick == 4 ? 16 : 0;
    static constexpr int C = pick == 0 ? 64 : pick <= 2 ? 32 : pick <= 4 ? 16 : 0;
    static constexpr bool fits = pick < 5;
};

typedef struct att_args {
    int B, T, NH, NKV, G, W, window; /* G = NH / NKV; W = (NH + 2 NKV) hd, a packed row */
    int hd;                          /* the head size: at most the kernel's HD (a tile's row
                                        width; the columns past hd are zeros) */
    float scale, softcap;            /* softcap 0: none */
    const int32_t *docs;             /* (B,T) or NULL */
} att_args;

/* The first key query t of sequence b sees (the last is t). Nondecreasing in t. */
__device__ __forceinline__ int att_lo(const att_args &a, int b, int t) {
    int lo = a.docs ? a.docs[(size_t)b * a.T + t] : 0;
    if (a.window > 0 && t - a.window + 1 > lo) lo = t - a.window + 1;
    return lo;
}

/* dst (n, HD) = the hd columns of rows r0 .. r0+n-1 of src (row r at src + r*stride),
 * zeros past row T and past column hd (so a product over HD is the product over hd). */
template <typename T, int HD>
__device__ __forceinline__ void load_rows(T *dst, const T *src, size_t stride, int r0, int n,
                                          int T_, int hd) {
    for (int idx = threadIdx.x; idx < n * HD; idx += blockDim.x) {
        const int r = idx / HD, c = idx % HD;
        dst[idx] = r0 + r < T_ && c < hd ? src[(size_t)(r0 + r) * stride + c] : from_f<T>(0.0f);
    }
}

/* The element (i, n) of this lane's accumulators: row (0..15) and column of the 16 x 8N. */
__device__ __forceinline__ int frag_row(int i) { return ((threadIdx.x & 31) >> 2) + 8 * (i >> 1); }
__device__ __forceinline__ int frag_col(int n, int i) { return n * 8 + 2 * (threadIdx.x & 3) + (i & 1); }

/* Both rows' values of a lane reduced over the 4 lanes that share the rows (the same
 * result in each: xor partners add the same two numbers). */
__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 1));
    return fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(FULL_MASK, v, 1);
    return v + __shfl_xor_sync(FULL_MASK, v, 2);
}

/* A warp's block of products q.k becomes the scores: times scale, then capped when the
 * cap is set (a branch uniform over the grid, taken once a tile, not per element). */
template <int N>
__device__ __forceinline__ void att_scores(float (&s)[N][4], const att_args &a) {
    if (a.softcap > 0.0f) {
        for (int n = 0; n < N; n++)
            for (int i = 0; i < 4; i++) s[n][i] = a.softcap * tanhf(s[n][i] * a.scale / a.softcap);
    } else {
        for (int n = 0; n < N; n++)
            for (int i = 0; i < 4; i++) s[n][i] *= a.scale;
    }
}

/* The factor from a capped score's gradient to the raw score's: the tanh's derivative
 * 1 - (x / c)^2 at the capped score x; 1 without a cap. */
__device__ __forceinline__ float att_dcap(float x, const att_args &a) {
    if (a.softcap <= 0.0f) return 1.0f;
    const float th = x / a.softcap;
    return 1.0f - th * th;
}

/* ---- forward ------------------------------------------------------------------------------ */

/* Block (query tile x, head y, sequence z): out and lse of its R queries. */
template <typename T, int HD>
__global__ void attention_fwd_k(T *out, float *lse, const T *qkv, att_args a) {
    constexpr int R = att_tiles<T, HD>::R, C = att_tiles<T, HD>::C;
    static_assert(att_tiles<T, HD>::fits && att_smem(sizeof(T), HD, R, C) <= ATT_SMEM_MAX, "tiles");
    __shared__ T q_s[R * HD], k_s[C * HD], v_s[C * HD], p_s[R * C];
    const int w = threadIdx.x >> 5, b = blockIdx.z, h = blockIdx.y, i0 = blockIdx.x * R;
    const int kh = h / a.G, T_ = a.T, Cq = a.NH * a.hd;
    const T *seq = qkv + (size_t)b * T_ * a.W;
    load_rows<T, HD>(q_s, seq + (size_t)h * a.hd, a.W, i0, R, T_, a.hd);
    int t[2], lo[2]; /* this lane's two query rows; a row past T sees nothing */
    for (int r = 0; r < 2; r++) {
        t[r] = i0 + w * 16 + frag_row(2 * r);
        lo[r] = t[r] < T_ ? att_lo(a, b, t[r]) : t[r] + 1;
    }
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, o[HD / 8][4];
    for (int n = 0; n < HD / 8; n++)
        for (int i = 0; i < 4; i++) o[n][i] = 0.0f;
    const int last = (i0 + R < T_ ? i0 + R : T_) - 1;
    for (int j0 = att_lo(a, b, i0) / C * C; j0 <= last; j0 += C) {
        __syncthreads(); /* the previous tile's readers are done */
        load_rows<T, HD>(k_s, seq + Cq + (size_t)kh * a.hd, a.W, j0, C, T_, a.hd);
        load_rows<T, HD>(v_s, seq + Cq + (size_t)(a.NKV + kh) * a.hd, a.W, j0, C, T_, a.hd);
        __syncthreads();
        float s[C / 8][4];
        for (int n = 0; n < C / 8; n++)
            for (int i = 0; i < 4; i++) s[n][i] = 0.0f;
        warp_gemm<T, C / 8, HD>(s, q_s + w * 16 * HD, HD, 1, k_s, 1, HD);
        att_scores(s, a);
        float mx[2] = {m[0], m[1]};
        for (int n = 0; n < C / 8; n++)
            for (int i = 0; i < 4; i++) {
                const int r = i >> 1, j = j0 + frag_col(n, i);
                s[n][i] = j >= lo[r] && j <= t[r] ? s[n][i] : -INFINITY;
                mx[r] = fmaxf(mx[r], s[n][i]);
            }
        float alpha[2], sum[2] = {0.0f, 0.0f};
        for (int r = 0; r < 2; r++) {
            mx[r] = quad_max(mx[r]);
            alpha[r] = mx[r] == -INFINITY ? 1.0f : expf(m[r] - mx[r]); /* 0 on a first tile */
        }
        for (int n = 0; n < C / 8; n++)
            for (int i = 0; i < 4; i++) {
                const int r = i >> 1;
                const float p = s[n][i] == -INFINITY ? 0.0f : expf(s[n][i] - mx[r]);
                sum[r] += p;
                p_s[(w * 16 + frag_row(i)) * C + frag_col(n, i)] = from_f<T>(p);
            }
        for (int r = 0; r < 2; r++) {
            l[r] = l[r] * alpha[r] + quad_sum(sum[r]);
            m[r] = mx[r];
        }
        for (int n = 0; n < HD / 8; n++)
            for (int i = 0; i < 4; i++) o[n][i] *= alpha[i >> 1];
        __syncthreads(); /* the warp's P rows written (the loop is the block's: uniform) */
        warp_gemm<T, HD / 8, C>(o, p_s + w * 16 * C, C, 1, v_s, HD, 1);
    }
    for (int r = 0; r < 2; r++) {
        if (t[r] >= T_) continue;
        T *y = out + ((size_t)b * T_ + t[r]) * Cq + (size_t)h * a.hd;
        const float inv = 1.0f / l[r];
        for (int n = 0; n < HD / 8; n++)
            for (int i = 2 * r; i < 2 * r + 2; i++)
                if (frag_col(n, i) < a.hd) y[frag_col(n, i)] = from_f<T>(o[n][i] * inv);
        if ((threadIdx.x & 3) == 0) lse[((size_t)b * a.NH + h) * T_ + t[r]] = m[r] + logf(l[r]);
    }
}

/* ---- backward ----------------------------------------------------------------------------- */

/* delta (B,NH,T) = rowsum(dout * out) over each head's hd channels: a warp per row. */
template <typename T>
__global__ void attention_delta_k(float *delta, const T *dout, const T *out, int B, int T_, int NH,
                                  int hd) {
    const int lane = threadIdx.x & 31;
    const size_t row = (size_t)blockIdx.x * ROWS_PER_BLOCK + threadIdx.x / 32; /* (b, t, h) */
    if (row >= (size_t)B * T_ * NH) return;
    float s = 0.0f;
    for (int c = lane; c < hd; c += 32) s += to_f(dout[row * hd + c]) * to_f(out[row * hd + c]);
    s = warp_sum(s);
    const size_t bt = row / NH, h = row % NH, b = bt / T_, t = bt % T_;
    if (lane == 0) delta[(b * NH + h) * T_ + t] = s;
}

/* Block (key tile x, key/value head y, sequence z): dK and dV of its R keys, summed over the
 * group's query heads in head order and their query tiles in order. */
template <typename T, int HD>
__global__ void attention_bwd_dkv_k(T *dqkv, const T *dout, const T *qkv, const float *lse,
                                    const float *delta, att_args a) {
    constexpr int R = att_tiles<T, HD>::R, C = att_tiles<T, HD>::C;
    __shared__ T k_s[R * HD], v_s[R * HD], q_s[C * HD], do_s[C * HD], pt_s[R * C], dst_s[R * C];
    __shared__ float lse_s[C], delta_s[C];
    __shared__ int lo_s[C];
    const int w = threadIdx.x >> 5, b = blockIdx.z, kh = blockIdx.y, j0 = blockIdx.x * R;
    const int T_ = a.T, Cq = a.NH * a.hd;
    const T *seq = qkv + (size_t)b * T_ * a.W;
    load_rows<T, HD>(k_s, seq + Cq + (size_t)kh * a.hd, a.W, j0, R, T_, a.hd);
    load_rows<T, HD>(v_s, seq + Cq + (size_t)(a.NKV + kh) * a.hd, a.W, j0, R, T_, a.hd);
    /* the queries that see a key of the tile: j0 <= t < t_end, t_end the first t whose lo
     * is past the tile's last key */
    const int jlast = (j0 + R < T_ ? j0 + R : T_) - 1;
    int lo_t = j0, hi_t = T_;
    while (lo_t < hi_t) {
        const int mid = (lo_t + hi_t) / 2;
        if (att_lo(a, b, mid) <= jlast) lo_t = mid + 1;
        else hi_t = mid;
    }
    const int t_end = lo_t;
    int j[2];
    for (int r = 0; r < 2; r++) j[r] = j0 + w * 16 + frag_row(2 * r);
    float dk[HD / 8][4], dv[HD / 8][4];
    for (int n = 0; n < HD / 8; n++)
        for (int i = 0; i < 4; i++) dk[n][i] = dv[n][i] = 0.0f;
    for (int g = 0; g < a.G; g++) {
        const int h = kh * a.G + g;
        const float *lse_h = lse + ((size_t)b * a.NH + h) * T_, *delta_h = delta + ((size_t)b * a.NH + h) * T_;
        for (int i0 = j0 / C * C; i0 < t_end; i0 += C) {
            __syncthreads(); /* the previous tile's readers are done */
            load_rows<T, HD>(q_s, seq + (size_t)h * a.hd, a.W, i0, C, T_, a.hd);
            load_rows<T, HD>(do_s, dout + (size_t)b * T_ * Cq + (size_t)h * a.hd, Cq, i0, C, T_, a.hd);
            for (int c = threadIdx.x; c < C; c += blockDim.x) {
                const int t = i0 + c;
                lse_s[c] = t < T_ ? lse_h[t] : 0.0f;
                delta_s[c] = t < T_ ? delta_h[t] : 0.0f;
                lo_s[c] = t < T_ ? att_lo(a, b, t) : t + 1; /* past T: sees nothing */
            }
            __syncthreads();
            float st[C / 8][4], dpt[C / 8][4]; /* S^T and dP^T: keys by queries */
            for (int n = 0; n < C / 8; n++)
                for (int i = 0; i < 4; i++) st[n][i] = dpt[n][i] = 0.0f;
            warp_gemm<T, C / 8, HD>(st, k_s + w * 16 * HD, HD, 1, q_s, 1, HD);
            warp_gemm<T, C / 8, HD>(dpt, v_s + w * 16 * HD, HD, 1, do_s, 1, HD);
            att_scores(st, a);
            for (int n = 0; n < C / 8; n++)
                for (int i = 0; i < 4; i++) {
                    const int c = frag_col(n, i), t = i0 + c, jj = j[i >> 1];
                    const float p = jj >= lo_s[c] && jj <= t ? expf(st[n][i] - lse_s[c]) : 0.0f;
                    const int at = (w * 16 + frag_row(i)) * C + c;
                    pt_s[at] = from_f<T>(p);
                    dst_s[at] = from_f<T>(p * (dpt[n][i] - delta_s[c]) * att_dcap(st[n][i], a));
                }
            __syncthreads();
            warp_gemm<T, HD / 8, C>(dv, pt_s + w * 16 * C, C, 1, do_s, HD, 1);
            warp_gemm<T, HD / 8, C>(dk, dst_s + w * 16 * C, C, 1, q_s, HD, 1);
        }
    }
    for (int r = 0; r < 2; r++) {
        if (j[r] >= T_) continue;
        T *row = dqkv + ((size_t)b * T_ + j[r]) * a.W + Cq;
        for (int n = 0; n < HD / 8; n++)
            for (int i = 2 * r; i < 2 * r + 2; i++) {
                if (frag_col(n, i) >= a.hd) continue;
                row[(size_t)kh * a.hd + frag_col(n, i)] = from_f<T>(dk[n][i] * a.scale);
                row[(size_t)(a.NKV + kh) * a.hd + frag_col(n, i)] = from_f<T>(dv[n][i]);
            }
    }
}

/* Block (query tile x, head y, sequence z): dQ of its R queries over the key tiles in order. */
template <typename T, int HD>
__global__ void attention_bwd_dq_k(T *dqkv, const T *dout, const T *qkv, const float *lse,
                                   const float *delta, att_args a) {
    constexpr int R = att_tiles<T, HD>::R, C = att_tiles<T, HD>::C;
    __shared__ T q_s[R * HD], do_s[R * HD], k_s[C * HD], v_s[C * HD], ds_s[R * C];
    const int w = threadIdx.x >> 5, b = blockIdx.z, h = blockIdx.y, i0 = blockIdx.x * R;
    const int kh = h / a.G, T_ = a.T, Cq = a.NH * a.hd;
    const T *seq = qkv + (size_t)b * T_ * a.W;
    load_rows<T, HD>(q_s, seq + (size_t)h * a.hd, a.W, i0, R, T_, a.hd);
    load_rows<T, HD>(do_s, dout + (size_t)b * T_ * Cq + (size_t)h * a.hd, Cq, i0, R, T_, a.hd);
    int t[2], lo[2];
    float ls[2], dl[2];
    for (int r = 0; r < 2; r++) {
        t[r] = i0 + w * 16 + frag_row(2 * r);
        const bool in = t[r] < T_;
        lo[r] = in ? att_lo(a, b, t[r]) : t[r] + 1;
        ls[r] = in ? lse[((size_t)b * a.NH + h) * T_ + t[r]] : 0.0f;
        dl[r] = in ? delta[((size_t)b * a.NH + h) * T_ + t[r]] : 0.0f;
    }
    float dq[HD / 8][4];
    for (int n = 0; n < HD / 8; n++)
        for (int i = 0; i < 4; i++) dq[n][i] = 0.0f;
    const int last = (i0 + R < T_ ? i0 + R : T_) - 1;
    for (int j0 = att_lo(a, b, i0) / C * C; j0 <= last; j0 += C) {
        __syncthreads();
        load_rows<T, HD>(k_s, seq + Cq + (size_t)kh * a.hd, a.W, j0, C, T_, a.hd);
        load_rows<T, HD>(v_s, seq + Cq + (size_t)(a.NKV + kh) * a.hd, a.W, j0, C, T_, a.hd);
        __syncthreads();
        float s[C / 8][4], dp[C / 8][4];
        for (int n = 0; n < C / 8; n++)
            for (int i = 0; i < 4; i++) s[n][i] = dp[n][i] = 0.0f;
        warp_gemm<T, C / 8, HD>(s, q_s + w * 16 * HD, HD, 1, k_s, 1, HD);
        warp_gemm<T, C / 8, HD>(dp, do_s + w * 16 * HD, HD, 1, v_s, 1, HD);
        att_scores(s, a);
        for (int n = 0; n < C / 8; n++)
            for (int i = 0; i < 4; i++) {
                const int r = i >> 1, jj = j0 + frag_col(n, i);
                const float p = jj >= lo[r] && jj <= t[r] ? expf(s[n][i] - ls[r]) : 0.0f;
                ds_s[(w * 16 + frag_row(i)) * C + frag_col(n, i)] =
                    from_f<T>(p * (dp[n][i] - dl[r]) * att_dcap(s[n][i], a));
            }
        __syncthreads();
        warp_gemm<T, HD / 8, C>(dq, ds_s + w * 16 * C, C, 1, k_s, HD, 1);
    }
    for (int r = 0; r < 2; r++) {
        if (t[r] >= T_) continue;
        T *row = dqkv + ((size_t)b * T_ + t[r]) * a.W + (size_t)h * a.hd;
        for (int n = 0; n < HD / 8; n++)
            for (int i = 2 * r; i < 2 * r + 2; i++)
                if (frag_col(n, i) < a.hd) row[frag_col(n, i)] = from_f<T>(dq[n][i] * a.scale);
    }
}

/* ---- launchers ------------------------------------------------------------------------------ */

static att_args att_args_of(const fy_op *op, int docs_arg) {
    const int NH = (int)op->i[2], NKV = (int)op->i[3], hd = (int)op->i[4];
    return att_args{(int)op->i[0], (int)op->i[1], NH, NKV, NH / NKV, (NH + 2 * NKV) * hd,
                    (int)op->i[5], hd, op->f[0], op->f[1], (const int32_t *)op->p[docs_arg]};
}

template <typename T, int HD>
static void attention_fwd_hd(cudaStream_t st, const fy_op *op, const att_args &a) {
    constexpr int R = att_tiles<T, HD>::R;
    dim3 grid((unsigned)((a.T + R - 1) / R), (unsigned)a.NH, (unsigned)a.B);
    FY_LAUNCH(grid, 2 * R, 0, st, attention_fwd_k<T, HD>)((T *)op->p[0], (float *)op->p[1],
        (const T *)op->p[2], a);
    LAUNCHED("attention_fwd");
}

template <typename T, int HD>
static void attention_bwd_hd(cudaStream_t st, const fy_op *op, const att_args &a) {
    constexpr int R = att_tiles<T, HD>::R;
    T *dqkv = (T *)op->p[0];
    const float *delta = (const float *)op->p[1], *lse = (const float *)op->p[5];
    const T *dout = (const T *)op->p[2], *qkv = (const T *)op->p[3];
    dim3 kv((unsigned)((a.T + R - 1) / R), (unsigned)a.NKV, (unsigned)a.B);
    FY_LAUNCH(kv, 2 * R, 0, st, attention_bwd_dkv_k<T, HD>)(dqkv, dout, qkv, lse, delta, a);
    LAUNCHED("attention_bwd (dk, dv)");
    dim3 q((unsigned)((a.T + R - 1) / R), (unsigned)a.NH, (unsigned)a.B);
    FY_LAUNCH(q, 2 * R, 0, st, attention_bwd_dq_k<T, HD>)(dqkv, dout, qkv, lse, delta, a);
    LAUNCHED("attention_bwd (dq)");
}

/* The kernels' tile widths HD: a head of hd channels runs on the least HD >= hd whose
 * tiles fit (its columns past hd zeros), so every head size up to 256 (128 in fp32) runs;
 * the families' are 64, 80, 96, 128 and 256. */
#define ATT_HEAD_SIZES(X) X(16) X(32) X(64) X(128) X(256)

template <typename T>
static void attention(cudaStream_t st, const fy_op *op) {
    const att_args a = att_args_of(op, op->kind == FY_OP_ATTENTION_FWD ? 3 : 6);
    const int hd = a.hd;
    FY_ASSERT(a.NKV > 0 && a.NH % a.NKV == 0, "attention: NKV must divide NH");
    if (a.B == 0 || a.T == 0 || a.NH == 0) return;
    const bool fwd = op->kind == FY_OP_ATTENTION_FWD;
    if (!fwd) {
        const size_t rows = (size_t)a.B * a.T * a.NH;
        FY_LAUNCH(grid_for(rows, ROWS_PER_BLOCK), 32 * ROWS_PER_BLOCK, 0, st, attention_delta_k<T>)(
            (float *)op->p[1], (const T *)op->p[2], (const T *)op->p[4], a.B, a.T, a.NH, hd);
        LAUNCHED("attention_bwd (delta)");
    }
#define ATT_CASE(n)                                                                       \
    if constexpr (att_tiles<T, n>::fits) {                                                \
        if (hd <= n) {                                                                    \
            if (fwd) attention_fwd_hd<T, n>(st, op, a);                                   \
            else attention_bwd_hd<T, n>(st, op, a);                                       \
            return;                                                                       \
        }                                                                                 \
    }
    ATT_HEAD_SIZES(ATT_CASE)
#undef ATT_CASE
    FY_ASSERT(0, "cuda attention: heads of at most 256 channels (128 with fp32 storage)");
}
