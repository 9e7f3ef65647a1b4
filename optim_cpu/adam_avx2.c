/* adam_avx2.c — the AdamW kernel in 8-lane AVX2 with FMA and F16C.
 *
 * Bit-exactness as in adam_avx512.c: the reference sequence of adam.h lane by lane with
 * correctly rounded vmulps/vfmadd/vsqrtps/vdivps; bf16 rounding by integer arithmetic
 * (fy_f32_to_bf16's); fp16 by vcvtps2ph with an immediate round-to-nearest-even (keeps
 * subnormals, quiets NaN like fy_f32_to_f16); fp16 in by vcvtph2ps, bf16 in by a shift.
 * AVX2 has no 16-bit masked loads, so the head (peeled to a 32-byte aligned param
 * pointer) and the tail run fy_adam_elem, the scalar path's element function.
 *
 * Functions carry target attributes; adam.c calls them only where the CPU has AVX2, FMA
 * and F16C. */
#include "optim_cpu/adam_impl.h"

#ifdef FY_ADAM_X86
#include <immintrin.h>

#define T256 __attribute__((target("avx2,fma,f16c")))
#define INL static inline __attribute__((always_inline)) T256

enum { OUT_NONE, OUT_F32, OUT_BF16, OUT_F16 };

typedef struct vconsts {
    __m256 gs, dm, b1, omb1, b2, omb2, rsbc2, eps, nss;
} vconsts;

INL __m128i bf16_round_int(__m256 w) {
    __m256i u = _mm256_castps_si256(w);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    /* NaN: |u| > 0x7f800000 as signed ints (|u| < 2^31) */
    __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000));
    __m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, q, nan);
    /* every lane is in [0, 0xffff], so the signed-to-unsigned saturating pack is exact */
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

INL __m256 load_grad(const void *g, size_t i, int G) {
    if (G == FY_F32) return _mm256_loadu_ps((const float *)g + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)g + i));
    if (G == FY_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

INL void store_out(void *o, size_t i, __m256 w, int O, bool nt) {
    if (O == OUT_NONE) return;
    if (O == OUT_F32) {
        if (nt) _mm256_stream_ps((float *)o + i, w);
        else _mm256_storeu_ps((float *)o + i, w);
        return;
    }
    __m128i h = O == OUT_F16 ? _mm256_cvtps_ph(w, _MM_FROUND_TO_NEAREST_INT) : bf16_round_int(w);
    if (nt) _mm_stream_si128((__m128i *)((uint16_t *)o + i), h);
    else _mm_storeu_si128((__m128i *)((uint16_t *)o + i), h);
}

/* The arrays of a range, in locals: stores through them cannot alias the range struct,
 * so the pointers stay in registers. */
typedef struct arrays {
    float *param, *m, *v;
    const float *sp, *sm, *sv; /* what is read: param, m, v unless out of place */
    const void *grad;
    void *out;
} arrays;

/* Lanes i..i+7, in adam.h's order of operations. */
INL void step8(const vconsts *c, const arrays *r, size_t i, int G, int O, bool nt) {
    float *pp = r->param + i, *pm = r->m + i, *pv = r->v + i;
    __m256 g = _mm256_mul_ps(load_grad(r->grad, i, G), c->gs);
    __m256 w = _mm256_mul_ps(_mm256_loadu_ps(r->sp + i), c->dm);
    __m256 m = _mm256_fmadd_ps(c->b1, _mm256_loadu_ps(r->sm + i), _mm256_mul_ps(c->omb1, g));
    __m256 v = _mm256_fmadd_ps(c->b2, _mm256_loadu_ps(r->sv + i),
                               _mm256_mul_ps(_mm256_mul_ps(c->omb2, g), g));
    __m256 d = _mm256_fmadd_ps(_mm256_sqrt_ps(v), c->rsbc2, c->eps);
    w = _mm256_fmadd_ps(c->nss, _mm256_div_ps(m, d), w);
    _mm256_storeu_ps(pp, w);
    _mm256_storeu_ps(pm, m);
    _mm256_storeu_ps(pv, v);
    store_out(r->out, i, w, O, nt);
}

INL size_t body(const vconsts *c, const arrays *r, size_t i, size_t hi, int G, int O, bool nt) {
    for (; i + 16 <= hi; i += 16) {
        step8(c, r, i, G, O, nt);
        step8(c, r, i + 8, G, O, nt);
    }
    for (; i + 8 <= hi; i += 8) step8(c, r, i, G, O, nt);
    return i;
}

INL void run(const fy_adam_consts *cs, const fy_adam_range *range, size_t lo, size_t hi, int G,
             int O) {
    const arrays a = {range->param, range->m, range->v,
                      range->src_param ? range->src_param : range->param,
                      range->src_m ? range->src_m : range->m,
                      range->src_v ? range->src_v : range->v, range->grad, range->param_out};
    vconsts c = {
        _mm256_set1_ps(cs->grad_scale), _mm256_set1_ps(cs->decay_mul),
        _mm256_set1_ps(cs->beta1), _mm256_set1_ps(cs->omb1),
        _mm256_set1_ps(cs->beta2), _mm256_set1_ps(cs->omb2),
        _mm256_set1_ps(cs->rsbc2), _mm256_set1_ps(cs->eps),
        _mm256_set1_ps(cs->neg_step_size),
    };
    size_t i = lo;
    size_t head = ((32 - ((uintptr_t)(a.param + i) & 31)) & 31) / 4;
    if (head > hi - i) head = hi - i;
    for (size_t e = i + head; i < e; i++) fy_adam_elem(cs, range, i);
    /* streaming stores for the copy out when aligned, as in adam_avx512.c */
    size_t osz = O == OUT_F32 ? 4 : 2;
    if (O != OUT_NONE && ((uintptr_t)a.out + i * osz) % (8 * osz) == 0) {
        i = body(&c, &a, i, hi, G, O, true);
        _mm_sfence();
    } else {
        i = body(&c, &a, i, hi, G, O, false);
    }
    for (; i < hi; i++) fy_adam_elem(cs, range, i);
}

#define FOR_OUT(G)                                                                        \
    switch (r->param_out ? r->out_dtype : FY_DTYPE_NONE) {                                \
    case FY_F32: run(c, r, lo, hi, G, OUT_F32); break;                                    \
    case FY_BF16: run(c, r, lo, hi, G, OUT_BF16); break;                                  \
    case FY_F16: run(c, r, lo, hi, G, OUT_F16); break;                                    \
    default: run(c, r, lo, hi, G, OUT_NONE); break;                                       \
    }

T256 void fy_adam_kernel_avx2(const fy_adam_consts *c, const fy_adam_range *r, size_t lo,
                              size_t hi) {
    switch (r->grad_dtype) {
    case FY_BF16: FOR_OUT(FY_BF16); break;
    case FY_F16: FOR_OUT(FY_F16); break;
    default: FOR_OUT(FY_F32); break;
    }
}

INL bool scan_run(float grad_scale, const void *g, size_t lo, size_t hi, int G) {
    const __m256 gs = _mm256_set1_ps(grad_scale);
    const __m256i expm = _mm256_set1_epi32(0x7f800000);
    __m256i acc = _mm256_setzero_si256();
    size_t i = lo;
    for (; i + 8 <= hi; i += 8) {
        __m256 x = _mm256_mul_ps(load_grad(g, i, G), gs);
        acc = _mm256_max_epu32(acc, _mm256_and_si256(_mm256_castps_si256(x), expm));
    }
    if (!_mm256_testz_si256(_mm256_cmpeq_epi32(acc, expm), _mm256_set1_epi32(-1))) return false;
    return fy_adam_scan_scalar(grad_scale, g, (fy_dtype)G, i, hi);
}

T256 bool fy_adam_scan_avx2(float grad_scale, const void *grad, fy_dtype t, size_t lo,
                            size_t hi) {
    switch (t) {
    case FY_BF16: return scan_run(grad_scale, grad, lo, hi, FY_BF16);
    case FY_F16: return scan_run(grad_scale, grad, lo, hi, FY_F16);
    default: return scan_run(grad_scale, grad, lo, hi, FY_F32);
    }
}

#endif /* FY_ADAM_X86 */
