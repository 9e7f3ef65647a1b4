/* adam_avx512.c — the AdamW kernel in 16-lane AVX-512 (F, BW, VL, DQ), with bf16
 * rounding either by integer arithmetic or by AVX512-BF16's vcvtneps2bf16.
 *
 * Bit-exactness: each lane runs the reference sequence of adam.h with the same IEEE
 * operations (vmulps, vfmadd, vsqrtps, vdivps are correctly rounded, like their scalar
 * forms), so results equal fy_adam_step_ref lane by lane. The conversions are the ones
 * of engine/core/dtype.h:
 *   - bf16 by integer arithmetic: u + 0x7fff + ((u >> 16) & 1), NaN -> (u >> 16) | 0x40.
 *   - bf16 by vcvtneps2bf16: the same rounding, same NaN rule, but the instruction always
 *     treats denormal inputs as zero; a vector holding a denormal takes the integer
 *     sequence instead (detected with integer compares, which MXCSR.DAZ cannot touch).
 *   - fp16 by vcvtps2ph with an immediate round-to-nearest-even (MXCSR not consulted);
 *     it keeps fp16 subnormals, quiets NaN as fy_f32_to_f16 does, overflows to inf.
 *   - fp16 in by vcvtph2ps (exact), bf16 in by a 16-bit shift (exact).
 * Loads are unaligned; the loop first peels up to 15 elements so the fp32 param stream
 * is 64-byte aligned, and ends with a masked vector instead of a scalar tail. The copy
 * out, never read back here, is written with streaming stores when aligned. The loop is
 * bound by memory, not by the divider (about 0.35 ns per element per core from cache on
 * the reference machine, against ~0.55 at DRAM bandwidth); software prefetching was
 * measured and did not help (bench/RESULTS.md).
 *
 * All functions carry target attributes, so this file builds with baseline flags and
 * runs only where adam.c has checked the CPU. The avx512bf16 feature is in the target
 * of every function here (to let the kernels share one set of inline helpers), but only
 * the *_BF16I specialisations contain the instruction and only fy_adam_kernel_avx512bf16
 * reaches them. */
#include "optim_cpu/adam_impl.h"

#ifdef FY_ADAM_X86
#include <immintrin.h>

#ifdef FY_ADAM_HAVE_AVX512BF16
#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")))
#else
#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#endif
#define INL static inline __attribute__((always_inline)) T512

/* Output kinds; BF16I = bf16 through the AVX512-BF16 instruction. */
enum { OUT_NONE, OUT_F32, OUT_BF16, OUT_BF16I, OUT_F16 };

typedef struct vconsts {
    __m512 gs, dm, b1, omb1, b2, omb2, rsbc2, eps, nss;
} vconsts;

INL __m256i bf16_round_int(__m512 w) {
    __m512i u = _mm512_castps_si512(w);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
    __mmask16 nan = _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

#ifdef FY_ADAM_HAVE_AVX512BF16
INL __m256i bf16_round_insn(__m512 w) {
    __m512i a = _mm512_and_si512(_mm512_castps_si512(w), _mm512_set1_epi32(0x7fffffff));
    /* denormal: 0 < |u| < 0x00800000, i.e. |u| - 1 < 0x007fffff unsigned */
    __mmask16 den = _mm512_cmplt_epu32_mask(_mm512_sub_epi32(a, _mm512_set1_epi32(1)),
                                            _mm512_set1_epi32(0x007fffff));
    if (__builtin_expect(den != 0, 0)) return bf16_round_int(w);
    return (__m256i)_mm512_cvtneps_pbh(w);
}
#endif

INL __m512 load_grad(const void *g, size_t i, int G, __mmask16 k, bool masked) {
    if (G == FY_F32) {
        const float *p = (const float *)g + i;
        return masked ? _mm512_maskz_loadu_ps(k, p) : _mm512_loadu_ps(p);
    }
    const uint16_t *p = (const uint16_t *)g + i;
    __m256i h = masked ? _mm256_maskz_loadu_epi16(k, p) : _mm256_loadu_si256((const __m256i *)p);
    if (G == FY_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

INL void store_out(void *o, size_t i, __m512 w, int O, __mmask16 k, bool masked, bool nt) {
    if (O == OUT_NONE) return;
    if (O == OUT_F32) {
        float *p = (float *)o + i;
        if (masked) _mm512_mask_storeu_ps(p, k, w);
        else if (nt) _mm512_stream_ps(p, w);
        else _mm512_storeu_ps(p, w);
        return;
    }
    __m256i h;
    if (O == OUT_F16) h = _mm512_cvtps_ph(w, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#ifdef FY_ADAM_HAVE_AVX512BF16
    else if (O == OUT_BF16I) h = bf16_round_insn(w);
#endif
    else h = bf16_round_int(w);
    uint16_t *p = (uint16_t *)o + i;
    if (masked) _mm256_mask_storeu_epi16(p, k, h);
    else if (nt) _mm256_stream_si256((__m256i *)p, h);
    else _mm256_storeu_si256((__m256i *)p, h);
}

/* Lanes i..i+15 (those in k when masked). The order of operations is adam.h's. */
/* The arrays of a range, in locals: stores through them cannot alias the range struct,
 * so the pointers stay in registers. */
typedef struct arrays {
    float *param, *m, *v;
    const float *sp, *sm, *sv; /* what is read: param, m, v unless out of place */
    const void *grad;
    void *out;
} arrays;

INL void step16(const vconsts *c, const arrays *r, size_t i, int G, int O,
                __mmask16 k, bool masked, bool nt) {
    float *pp = r->param + i, *pm = r->m + i, *pv = r->v + i;
    __m512 g = load_grad(r->grad, i, G, k, masked);
    const float *sp = r->sp + i, *sm = r->sm + i, *sv = r->sv + i;
    __m512 w = masked ? _mm512_maskz_loadu_ps(k, sp) : _mm512_loadu_ps(sp);
    __m512 m = masked ? _mm512_maskz_loadu_ps(k, sm) : _mm512_loadu_ps(sm);
    __m512 v = masked ? _mm512_maskz_loadu_ps(k, sv) : _mm512_loadu_ps(sv);
    g = _mm512_mul_ps(g, c->gs);
    w = _mm512_mul_ps(w, c->dm);
    m = _mm512_fmadd_ps(c->b1, m, _mm512_mul_ps(c->omb1, g));
    v = _mm512_fmadd_ps(c->b2, v, _mm512_mul_ps(_mm512_mul_ps(c->omb2, g), g));
    __m512 d = _mm512_fmadd_ps(_mm512_sqrt_ps(v), c->rsbc2, c->eps);
    w = _mm512_fmadd_ps(c->nss, _mm512_div_ps(m, d), w);
    if (masked) {
        _mm512_mask_storeu_ps(pp, k, w);
        _mm512_mask_storeu_ps(pm, k, m);
        _mm512_mask_storeu_ps(pv, k, v);
    } else {
        _mm512_storeu_ps(pp, w);
        _mm512_storeu_ps(pm, m);
        _mm512_storeu_ps(pv, v);
    }
    store_out(r->out, i, w, O, k, masked, nt);
}

/* Whole vectors from i while 16 fit; returns where it stopped. */
INL size_t body(const vconsts *c, const arrays *r, size_t i, size_t hi, int G, int O, bool nt) {
    for (; i + 32 <= hi; i += 32) {
        step16(c, r, i, G, O, 0, false, nt);
        step16(c, r, i + 16, G, O, 0, false, nt);
    }
    for (; i + 16 <= hi; i += 16) step16(c, r, i, G, O, 0, false, nt);
    return i;
}

INL void run(const fy_adam_consts *cs, const fy_adam_range *range, size_t lo, size_t hi, int G,
             int O) {
    const arrays a = {range->param, range->m, range->v,
                      range->src_param ? range->src_param : range->param,
                      range->src_m ? range->src_m : range->m,
                      range->src_v ? range->src_v : range->v, range->grad, range->param_out};
    const arrays *r = &a;
    vconsts c = {
        _mm512_set1_ps(cs->grad_scale), _mm512_set1_ps(cs->decay_mul),
        _mm512_set1_ps(cs->beta1), _mm512_set1_ps(cs->omb1),
        _mm512_set1_ps(cs->beta2), _mm512_set1_ps(cs->omb2),
        _mm512_set1_ps(cs->rsbc2), _mm512_set1_ps(cs->eps),
        _mm512_set1_ps(cs->neg_step_size),
    };
    size_t i = lo;
    /* peel to a 64-byte aligned param pointer (params are 4-byte aligned floats) */
    size_t head = ((64 - ((uintptr_t)(r->param + i) & 63)) & 63) / 4;
    if (head > hi - i) head = hi - i;
    if (head) {
        step16(&c, r, i, G, O, (__mmask16)((1u << head) - 1), true, false);
        i += head;
    }
    /* The copy out is written and not read again here: streaming stores spare the read
     * of each line before it is written (2 of ~30 bytes of traffic per parameter with
     * bf16). They need the vector-aligned address the peel usually gives. */
    size_t osz = O == OUT_F32 ? 4 : 2;
    if (O != OUT_NONE && ((uintptr_t)r->out + i * osz) % (16 * osz) == 0) {
        i = body(&c, r, i, hi, G, O, true);
        _mm_sfence(); /* streaming stores are weakly ordered: publish them before returning */
    } else {
        i = body(&c, r, i, hi, G, O, false);
    }
    if (i < hi) step16(&c, r, i, G, O, (__mmask16)((1u << (hi - i)) - 1), true, false);
}

/* One specialised loop per (gradient dtype, output kind). */
#define FOR_OUT(G, O_BF16)                                                                \
    switch (r->param_out ? r->out_dtype : FY_DTYPE_NONE) {                                \
    case FY_F32: run(c, r, lo, hi, G, OUT_F32); break;                                    \
    case FY_BF16: run(c, r, lo, hi, G, O_BF16); break;                                    \
    case FY_F16: run(c, r, lo, hi, G, OUT_F16); break;                                    \
    default: run(c, r, lo, hi, G, OUT_NONE); break;                                       \
    }

#define DISPATCH(O_BF16)                                                                  \
    switch (r->grad_dtype) {                                                              \
    case FY_BF16: FOR_OUT(FY_BF16, O_BF16); break;                                        \
    case FY_F16: FOR_OUT(FY_F16, O_BF16); break;                                          \
    default: FOR_OUT(FY_F32, O_BF16); break;                                              \
    }

T512 void fy_adam_kernel_avx512(const fy_adam_consts *c, const fy_adam_range *r, size_t lo,
                                size_t hi) {
    DISPATCH(OUT_BF16)
}

#ifdef FY_ADAM_HAVE_AVX512BF16
T512 void fy_adam_kernel_avx512bf16(const fy_adam_consts *c, const fy_adam_range *r, size_t lo,
                                    size_t hi) {
    DISPATCH(OUT_BF16I)
}
#endif

/* Non-finite lanes have the exponent field all ones; the running unsigned max of the
 * exponent fields reaches 0x7f800000 exactly when one was met. */
INL __m512i scan_run(__m512 gs, const void *g, size_t lo, size_t hi, int G) {
    const __m512i expm = _mm512_set1_epi32(0x7f800000);
    __m512i acc = _mm512_setzero_si512();
    size_t i = lo;
    for (; i + 16 <= hi; i += 16) {
        __m512 x = _mm512_mul_ps(load_grad(g, i, G, 0, false), gs);
        acc = _mm512_max_epu32(acc, _mm512_and_si512(_mm512_castps_si512(x), expm));
    }
    if (i < hi) {
        __mmask16 k = (__mmask16)((1u << (hi - i)) - 1);
        __m512 x = _mm512_mul_ps(load_grad(g, i, G, k, true), gs);
        acc = _mm512_max_epu32(acc, _mm512_maskz_and_epi32(k, _mm512_castps_si512(x), expm));
    }
    return acc;
}

T512 bool fy_adam_scan_avx512(float grad_scale, const void *grad, fy_dtype t, size_t lo,
                              size_t hi) {
    __m512 gs = _mm512_set1_ps(grad_scale);
    __m512i acc;
    switch (t) {
    case FY_BF16: acc = scan_run(gs, grad, lo, hi, FY_BF16); break;
    case FY_F16: acc = scan_run(gs, grad, lo, hi, FY_F16); break;
    default: acc = scan_run(gs, grad, lo, hi, FY_F32); break;
    }
    return _mm512_cmpeq_epi32_mask(acc, _mm512_set1_epi32(0x7f800000)) == 0;
}

#endif /* FY_ADAM_X86 */
