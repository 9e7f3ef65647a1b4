/* adam_impl.h — what the AdamW code paths share; included only by optim_cpu/ (and by
 * tests that reach into it). Not part of the public API.
 *
 * A kernel updates elements [lo, hi) of a range with precomputed constants and checks
 * nothing: dtypes are validated and the finite check is done by the caller (adam.c).
 * A scan returns true when every scaled gradient in [lo, hi) is finite. */
#ifndef FY_ADAM_IMPL_H
#define FY_ADAM_IMPL_H

#include <math.h>

#include "optim_cpu/adam.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef void (*fy_adam_kernel_fn)(const fy_adam_consts *c, const fy_adam_range *r,
                                  size_t lo, size_t hi);
typedef bool (*fy_adam_scan_fn)(float grad_scale, const void *grad, fy_dtype grad_dtype,
                                size_t lo, size_t hi);

void fy_adam_kernel_scalar(const fy_adam_consts *c, const fy_adam_range *r, size_t lo, size_t hi);
bool fy_adam_scan_scalar(float grad_scale, const void *grad, fy_dtype t, size_t lo, size_t hi);

/* FY_ADAM_NO_SIMD builds the portable scalar path only (what non-x86 targets get). */
#if (defined(__x86_64__) || defined(__i386__)) && !defined(FY_ADAM_NO_SIMD)
#define FY_ADAM_X86 1
void fy_adam_kernel_avx2(const fy_adam_consts *c, const fy_adam_range *r, size_t lo, size_t hi);
bool fy_adam_scan_avx2(float grad_scale, const void *grad, fy_dtype t, size_t lo, size_t hi);
void fy_adam_kernel_avx512(const fy_adam_consts *c, const fy_adam_range *r, size_t lo, size_t hi);
bool fy_adam_scan_avx512(float grad_scale, const void *grad, fy_dtype t, size_t lo, size_t hi);
/* AVX512-BF16 needs GCC >= 10 or clang >= 9. */
#if (defined(__clang__) && __clang_major__ >= 9) || (!defined(__clang__) && __GNUC__ >= 10)
#define FY_ADAM_HAVE_AVX512BF16 1
void fy_adam_kernel_avx512bf16(const fy_adam_consts *c, const fy_adam_range *r, size_t lo, size_t hi);
#endif
#endif

/* The kernel and scan of path p (AUTO resolved), or NULL kernel if unsupported. */
void fy_adam_path_impl(fy_adam_path p, fy_adam_kernel_fn *kernel, fy_adam_scan_fn *scan);
/* The kernels of path p for a step over r: FY_ERR_UNSUPPORTED (logged) if this CPU or
 * build lacks the path, FY_ERR_INVALID (logged) if r is malformed. */
fy_status fy_adam_path_ready(fy_adam_path p, const fy_adam_range *r, fy_adam_kernel_fn *kernel,
                             fy_adam_scan_fn *scan);

/* Checks dtypes and pointers; logs and returns FY_ERR_INVALID if wrong. */
fy_status fy_adam_range_check(const fy_adam_range *r);

/* One element, exactly the reference sequence (adam.h); SIMD paths use it for tails. */
static inline float fy_adam_load_grad(const void *g, fy_dtype t, size_t i) {
    switch (t) {
    case FY_BF16: return fy_bf16_to_f32(((const uint16_t *)g)[i]);
    case FY_F16: return fy_f16_to_f32(((const uint16_t *)g)[i]);
    default: return ((const float *)g)[i];
    }
}

static inline void fy_adam_store_out(void *o, fy_dtype t, size_t i, float w) {
    switch (t) {
    case FY_BF16: ((uint16_t *)o)[i] = fy_f32_to_bf16(w); break;
    case FY_F16: ((uint16_t *)o)[i] = fy_f32_to_f16(w); break;
    case FY_F32: ((float *)o)[i] = w; break;
    default: break;
    }
}

static inline void fy_adam_elem(const fy_adam_consts *c, const fy_adam_range *r, size_t i) {
    float g = fy_adam_load_grad(r->grad, r->grad_dtype, i) * c->grad_scale;
    float w = (r->src_param ? r->src_param : r->param)[i] * c->decay_mul;
    float m = fmaf(c->beta1, (r->src_m ? r->src_m : r->m)[i], c->omb1 * g);
    float v = fmaf(c->beta2, (r->src_v ? r->src_v : r->v)[i], (c->omb2 * g) * g);
    float d = fmaf(sqrtf(v), c->rsbc2, c->eps);
    w = fmaf(c->neg_step_size, m / d, w);
    r->param[i] = w;
    r->m[i] = m;
    r->v[i] = v;
    if (r->param_out) fy_adam_store_out(r->param_out, r->out_dtype, i, w);
}

#ifdef __cplusplus
}
#endif
#endif
