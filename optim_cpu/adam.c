/* adam.c — run-time choice of the AdamW code path, argument checks, tiles.
 *
 * The path is picked from the CPU's features (__builtin_cpu_supports), never from the
 * build flags, so one binary runs on any x86-64; the SIMD files compile their functions
 * with target attributes. Off x86 only the scalar path exists.
 *
 * Whole-call contract of check_finite: the scan over every gradient of the call runs
 * before any store, so a non-finite gradient leaves all arrays untouched. */
#include "optim_cpu/adam.h"
#include "optim_cpu/adam_impl.h"

#include <string.h>

#ifdef FY_ADAM_X86
#include <cpuid.h>

/* F16C (CPUID.1:ECX bit 29); not every compiler's __builtin_cpu_supports knows it. */
static bool cpu_has_f16c(void) {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29));
}
#endif

static const char *const path_names[FY_ADAM_PATH_COUNT] = {
    "auto", "scalar", "avx2", "avx512", "avx512bf16",
};

const char *fy_adam_path_name(fy_adam_path p) {
    return (unsigned)p < FY_ADAM_PATH_COUNT ? path_names[p] : "?";
}

int fy_adam_path_parse(const char *s, fy_adam_path *out) {
    for (int p = 0; p < FY_ADAM_PATH_COUNT; p++)
        if (!strcmp(s, path_names[p])) { *out = (fy_adam_path)p; return 0; }
    return -1;
}

bool fy_adam_path_supported(fy_adam_path p) {
    switch (p) {
    case FY_ADAM_PATH_AUTO:
    case FY_ADAM_PATH_SCALAR: return true;
#ifdef FY_ADAM_X86
    case FY_ADAM_PATH_AVX2:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c();
    case FY_ADAM_PATH_AVX512:
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#ifdef FY_ADAM_HAVE_AVX512BF16
    case FY_ADAM_PATH_AVX512_BF16:
        return fy_adam_path_supported(FY_ADAM_PATH_AVX512) &&
               __builtin_cpu_supports("avx512bf16");
#endif
#endif
    default: return false;
    }
}

fy_adam_path fy_adam_path_best(void) {
    static const fy_adam_path order[] = {FY_ADAM_PATH_AVX512_BF16, FY_ADAM_PATH_AVX512,
                                         FY_ADAM_PATH_AVX2};
    for (size_t i = 0; i < sizeof order / sizeof order[0]; i++)
        if (fy_adam_path_supported(order[i])) return order[i];
    return FY_ADAM_PATH_SCALAR;
}

void fy_adam_path_impl(fy_adam_path p, fy_adam_kernel_fn *kernel, fy_adam_scan_fn *scan) {
    *kernel = NULL;
    *scan = fy_adam_scan_scalar;
    if (p == FY_ADAM_PATH_AUTO) p = fy_adam_path_best();
    if (!fy_adam_path_supported(p)) return;
    switch (p) {
#ifdef FY_ADAM_X86
    case FY_ADAM_PATH_AVX2: *kernel = fy_adam_kernel_avx2; *scan = fy_adam_scan_avx2; break;
    case FY_ADAM_PATH_AVX512: *kernel = fy_adam_kernel_avx512; *scan = fy_adam_scan_avx512; break;
#ifdef FY_ADAM_HAVE_AVX512BF16
    case FY_ADAM_PATH_AVX512_BF16:
        *kernel = fy_adam_kernel_avx512bf16;
        *scan = fy_adam_scan_avx512;
        break;
#endif
#endif
    default: *kernel = fy_adam_kernel_scalar; break;
    }
}

fy_status fy_adam_range_check(const fy_adam_range *r) {
    if (r->grad_dtype != FY_F32 && r->grad_dtype != FY_BF16 && r->grad_dtype != FY_F16) {
        fy_log_error("adam: gradient dtype %d is not fp32, bf16 or fp16", (int)r->grad_dtype);
        return FY_ERR_INVALID;
    }
    if (r->param_out && r->out_dtype != FY_F32 && r->out_dtype != FY_BF16 &&
        r->out_dtype != FY_F16) {
        fy_log_error("adam: output dtype %d is not fp32, bf16 or fp16", (int)r->out_dtype);
        return FY_ERR_INVALID;
    }
    if (!r->src_param != !r->src_m || !r->src_m != !r->src_v) {
        fy_log_error("adam: an out-of-place range names some of its sources, not all");
        return FY_ERR_INVALID;
    }
    if (r->n && (!r->param || !r->m || !r->v || !r->grad)) {
        fy_log_error("adam: a range of %zu elements has a NULL array", r->n);
        return FY_ERR_INVALID;
    }
    return FY_OK;
}

fy_status fy_adam_grads_finite(fy_adam_path p, const fy_adam_hparams *hp, const fy_adam_range *r) {
    fy_adam_kernel_fn kernel;
    fy_adam_scan_fn scan;
    fy_adam_path_impl(p, &kernel, &scan);
    return scan(hp->grad_scale, r->grad, r->grad_dtype, 0, r->n) ? FY_OK : FY_ERR_NONFINITE;
}

fy_status fy_adam_path_ready(fy_adam_path p, const fy_adam_range *r, fy_adam_kernel_fn *kernel,
                             fy_adam_scan_fn *scan) {
    fy_adam_path_impl(p, kernel, scan);
    if (!*kernel) {
        fy_log_error("adam: path %s is not supported by this CPU or build", fy_adam_path_name(p));
        return FY_ERR_UNSUPPORTED;
    }
    return fy_adam_range_check(r);
}

fy_status fy_adam_step_path(fy_adam_path p, const fy_adam_hparams *hp, const fy_adam_range *r) {
    fy_adam_kernel_fn kernel;
    fy_adam_scan_fn scan;
    FY_TRY(fy_adam_path_ready(p, r, &kernel, &scan));
    if (hp->check_finite && !scan(hp->grad_scale, r->grad, r->grad_dtype, 0, r->n))
        return FY_ERR_NONFINITE;
    fy_adam_consts c;
    fy_adam_consts_init(hp, r->decay, &c);
    kernel(&c, r, 0, r->n);
    return FY_OK;
}

fy_status fy_adam_step(const fy_adam_hparams *hp, const fy_adam_range *r) {
    return fy_adam_step_path(FY_ADAM_PATH_AUTO, hp, r);
}

void fy_adam_range_slice(const fy_adam_range *r, size_t lo, size_t hi, fy_adam_range *out) {
    FY_ASSERT(lo <= hi && hi <= r->n, "slice out of the range");
    *out = *r;
    out->param = r->param + lo;
    out->m = r->m + lo;
    out->v = r->v + lo;
    if (r->src_param) out->src_param = r->src_param + lo;
    if (r->src_m) out->src_m = r->src_m + lo;
    if (r->src_v) out->src_v = r->src_v + lo;
    out->grad = (const char *)r->grad + lo * fy_dtype_size(r->grad_dtype);
    if (r->param_out) out->param_out = (char *)r->param_out + lo * fy_dtype_size(r->out_dtype);
    out->n = hi - lo;
}

fy_status fy_adam_step_tile(const fy_adam_hparams *hp, const fy_adam_range *r, size_t tile) {
    FY_ASSERT(tile < fy_adam_ntiles(r->n), "tile index past the end of the range");
    size_t lo = tile * FY_ADAM_TILE_NELEM;
    size_t hi = lo + FY_ADAM_TILE_NELEM < r->n ? lo + FY_ADAM_TILE_NELEM : r->n;
    FY_TRY(fy_adam_range_check(r));
    fy_adam_range sub;
    fy_adam_range_slice(r, lo, hi, &sub);
    return fy_adam_step(hp, &sub);
}
