/* cublaslt_emu.cc — the emulated cuBLASLt's objects (cublaslt_emu.h): handles, matmul
 * descriptors, matrix layouts and matmul preferences, their attributes, and the version
 * and status strings. The library is libcublasLt.so.13 of a -Dcuda=emulated build:
 * exactly the functions engine/device/cuda/cuda_gemm.c calls, with cuBLASLt 13's types
 * and values (the toolkit's cublasLt.h).
 *
 * Every object is registered while alive, so a call with a destroyed or foreign one is
 * refused and reported (cuBLASLt's behaviour is undefined there). Descriptors hold every
 * attribute ferry sets, checked for size and range as they are set; an attribute
 * cuBLASLt has and this library does not emulate is refused when set, never ignored.
 *
 * Threads: any; the registry has its lock, and one object is used by one thread at a time
 * (cuBLASLt's rule for descriptors). */
#include "tests/cuda_emu/runtime/cublaslt_emu.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <mutex>
#include <unordered_map>

/* Device memory a handle takes (fy_emu_take). cuBLASLt allocates a handle's device state
 * itself and NVIDIA does not size it; 1 MiB is a nominal figure, there so that a handle
 * shows in cudaMemGetInfo and a leaked one is seen, not a measured one. */
#define HANDLE_NBYTES ((size_t)1 << 20)

/* ---- reports ------------------------------------------------------------------------ */

cublasStatus_t lt_fail(cublasStatus_t s, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fy_emu_report("%s", msg);
    return s;
}

const char *lt_type_name(int t) {
    switch (t) {
    case CUDA_R_32F: return "CUDA_R_32F";
    case CUDA_R_16BF: return "CUDA_R_16BF";
    case CUDA_R_16F: return "CUDA_R_16F";
    case CUDA_R_64F: return "CUDA_R_64F";
    case CUDA_R_8I: return "CUDA_R_8I";
    case CUDA_R_32I: return "CUDA_R_32I";
    default: return "another cudaDataType";
    }
}

const char *lt_compute_name(int c) {
    switch (c) {
    case CUBLAS_COMPUTE_32F: return "CUBLAS_COMPUTE_32F";
    case CUBLAS_COMPUTE_32F_PEDANTIC: return "CUBLAS_COMPUTE_32F_PEDANTIC";
    case CUBLAS_COMPUTE_32F_FAST_TF32: return "CUBLAS_COMPUTE_32F_FAST_TF32";
    case CUBLAS_COMPUTE_32F_FAST_16BF: return "CUBLAS_COMPUTE_32F_FAST_16BF";
    case CUBLAS_COMPUTE_32F_FAST_16F: return "CUBLAS_COMPUTE_32F_FAST_16F";
    default: return "another cublasComputeType";
    }
}

/* ---- live objects ------------------------------------------------------------------- */

const char *const lt_kind_name[4] = {"cuBLASLt handle", "matmul descriptor", "matrix layout", "matmul preference"};
const char *const lt_mat_name[4] = {"A", "B", "C", "D"};
const lt_pref lt_default_pref = {0, CUBLASLT_REDUCTION_SCHEME_MASK, {256, 256, 256, 256}};

static std::mutex g_mu;
static std::unordered_map<const void *, lt_kind> g_live;

static bool obj_add(const void *p, lt_kind k) {
    std::lock_guard<std::mutex> lock(g_mu);
    try {
        g_live[p] = k;
    } catch (...) {
        return false;
    }
    return true;
}

bool lt_is(const void *p, lt_kind k) {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_live.find(p);
    return it != g_live.end() && it->second == k;
}

static bool obj_remove(const void *p, lt_kind k) {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_live.find(p);
    if (it == g_live.end() || it->second != k) return false;
    g_live.erase(it);
    return true;
}

template <typename T> static cublasStatus_t create(T **out, const T &init, lt_kind k) {
    if (!out) return lt_fail(CUBLAS_STATUS_INVALID_VALUE, "cuBLASLt: a %s created into NULL", lt_kind_name[k]);
    T *o = (T *)malloc(sizeof *o);
    if (!o) return CUBLAS_STATUS_ALLOC_FAILED;
    *o = init;
    if (!obj_add(o, k)) {
        free(o);
        return CUBLAS_STATUS_ALLOC_FAILED;
    }
    *out = o;
    return CUBLAS_STATUS_SUCCESS;
}

/* Destroying NULL does nothing; destroying what is not a live object is refused. */
static cublasStatus_t destroy(void *o, lt_kind k, const char *who) {
    if (!o) return CUBLAS_STATUS_SUCCESS;
    if (!obj_remove(o, k))
        return lt_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: %p is not a live %s (destroyed twice?)", who, o,
                       lt_kind_name[k]);
    free(o);
    return CUBLAS_STATUS_SUCCESS;
}

/* Copies an attribute's value of exactly `want` bytes from buf; false after a report. */
static bool attr_value(const char *who, const char *name, const void *buf, size_t nbytes, void *dst, size_t want) {
    if (!buf) {
        fy_emu_report("%s: %s from a NULL buffer", who, name);
        return false;
    }
    if (nbytes != want) {
        fy_emu_report("%s: %s takes %zu bytes, given %zu", who, name, want, nbytes);
        return false;
    }
    memcpy(dst, buf, want);
    return true;
}

#define ATTR(name, var) \
    if (!attr_value(who, name, buf, nbytes, &(var), sizeof(var))) return CUBLAS_STATUS_INVALID_VALUE

static bool known_type(int64_t t) { return t >= 0 && t <= CUDA_R_4F_E2M1; } /* library_types.h's */

static bool known_compute(int64_t c) {
    switch (c) {
    case CUBLAS_COMPUTE_16F:
    case CUBLAS_COMPUTE_16F_PEDANTIC:
    case CUBLAS_COMPUTE_32F:
    case CUBLAS_COMPUTE_32F_PEDANTIC:
    case CUBLAS_COMPUTE_32F_FAST_16F:
    case CUBLAS_COMPUTE_32F_FAST_16BF:
    case CUBLAS_COMPUTE_32F_FAST_TF32:
    case CUBLAS_COMPUTE_32F_EMULATED_16BFX9:
    case CUBLAS_COMPUTE_64F:
    case CUBLAS_COMPUTE_64F_PEDANTIC:
    case CUBLAS_COMPUTE_64F_EMULATED_FIXEDPOINT:
    case CUBLAS_COMPUTE_32I:
    case CUBLAS_COMPUTE_32I_PEDANTIC: return true;
    default: return false;
    }
}

/* ---- handles, descriptors, layouts, preferences ------------------------------------ */

LT_API cublasStatus_t cublasLtCreate(cublasLtHandle_t *lightHandle) {
    if (!lightHandle) return lt_fail(CUBLAS_STATUS_INVALID_VALUE, "cublasLtCreate: into NULL");
    cudaError_t e = fy_emu_take(HANDLE_NBYTES);
    if (e != cudaSuccess)
        return e == cudaErrorMemoryAllocation ? CUBLAS_STATUS_ALLOC_FAILED : CUBLAS_STATUS_NOT_INITIALIZED;
    char *h = (char *)malloc(1);
    if (!h || !obj_add(h, LT_HANDLE)) {
        free(h);
        fy_emu_give(HANDLE_NBYTES);
        return CUBLAS_STATUS_ALLOC_FAILED;
    }
    *lightHandle = (cublasLtHandle_t)h;
    return CUBLAS_STATUS_SUCCESS;
}

LT_API cublasStatus_t cublasLtDestroy(cublasLtHandle_t lightHandle) {
    if (!obj_remove(lightHandle, LT_HANDLE))
        return lt_fail(CUBLAS_STATUS_NOT_INITIALIZED, "cublasLtDestroy: %p is not a live cuBLASLt handle",
                       (void *)lightHandle);
    free(lightHandle);
    fy_emu_give(HANDLE_NBYTES);
    return CUBLAS_STATUS_SUCCESS;
}

LT_API cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *matmulDesc, cublasComputeType_t computeType,
                                               cudaDataType_t scaleType) {
    if (!known_compute(computeType) || !known_type(scaleType))
        return lt_fail(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatmulDescCreate: compute type %d, scale type %d",
                       (int)computeType, (int)scaleType);
    lt_desc init = {
        (int32_t)computeType, (int32_t)scaleType, CUBLAS_OP_N, CUBLAS_OP_N, CUBLASLT_EPILOGUE_DEFAULT, nullptr, -1};
    return create((lt_desc **)matmulDesc, init, LT_DESC);
}

LT_API cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t matmulDesc) {
    return destroy(matmulDesc, LT_DESC, "cublasLtMatmulDescDestroy");
}

LT_API cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t matmulDesc,
                                                     cublasLtMatmulDescAttributes_t attr, const void *buf,
                                                     size_t nbytes) {
    static const char who[] = "cublasLtMatmulDescSetAttribute";
    lt_desc *d = lt_live<lt_desc>(matmulDesc, LT_DESC, who, "matmulDesc");
    if (!d) return CUBLAS_STATUS_INVALID_VALUE;
    int32_t i32;
    uint32_t u32;
    switch (attr) {
    case CUBLASLT_MATMUL_DESC_COMPUTE_TYPE:
        ATTR("CUBLASLT_MATMUL_DESC_COMPUTE_TYPE", i32);
        if (!known_compute(i32)) return lt_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: compute type %d", who, i32);
        d->compute = i32;
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_SCALE_TYPE:
        ATTR("CUBLASLT_MATMUL_DESC_SCALE_TYPE", i32);
        if (!known_type(i32)) return lt_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: scale type %d", who, i32);
        d->scale = i32;
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_POINTER_MODE:
        ATTR("CUBLASLT_MATMUL_DESC_POINTER_MODE", i32);
        if (i32 != CUBLASLT_POINTER_MODE_HOST)
            return lt_fail(CUBLAS_STATUS_INVALID_VALUE,
                           "%s: pointer mode %d: only CUBLASLT_POINTER_MODE_HOST is emulated", who, i32);
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_TRANSA:
    case CUBLASLT_MATMUL_DESC_TRANSB:
        ATTR(attr == CUBLASLT_MATMUL_DESC_TRANSA ? "CUBLASLT_MATMUL_DESC_TRANSA" : "CUBLASLT_MATMUL_DESC_TRANSB", i32);
        if (i32 != CUBLAS_OP_N && i32 != CUBLAS_OP_T)
            return lt_fail(CUBLAS_STATUS_INVALID_VALUE,
                           "%s: operation %d: only CUBLAS_OP_N and CUBLAS_OP_T are emulated", who, i32);
        (attr == CUBLASLT_MATMUL_DESC_TRANSA ? d->transa : d->transb) = i32;
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_TRANSC: /* "Currently only CUBLAS_OP_N is supported" */
        ATTR("CUBLASLT_MATMUL_DESC_TRANSC", i32);
        if (i32 != CUBLAS_OP_N)
            return lt_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: TRANSC %d: only CUBLAS_OP_N", who, i32);
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_EPILOGUE:
        ATTR("CUBLASLT_MATMUL_DESC_EPILOGUE", u32);
        if (u32 != CUBLASLT_EPILOGUE_DEFAULT && u32 != CUBLASLT_EPILOGUE_BIAS)
            return lt_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: epilogue %u: only DEFAULT and BIAS are emulated", who,
                           u32);
        d->epilogue = u32;
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER:
        ATTR("CUBLASLT_MATMUL_DESC_BIAS_POINTER", d->bias);
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE:
        ATTR("CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE", i32);
        if (i32 != -1 && !known_type(i32)) return lt_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: bias type %d", who, i32);
        d->bias_type = i32;
        return CUBLAS_STATUS_SUCCESS;
    default: return lt_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: attribute %d is unknown or not emulated", who, (int)attr);
    }
}

LT_API cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *matLayout, cudaDataType type, uint64_t rows,
                                                 uint64_t cols, int64_t ld) {
    if (!known_type(type) || ld < 0)
        return lt_fail(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatrixLayoutCreate: type %d, ld %lld", (int)type,
                       (long long)ld);
    lt_layout init = {(uint32_t)type, CUBLASLT_ORDER_COL, rows, cols, ld, 1, 0};
    return create((lt_layout **)matLayout, init, LT_LAYOUT);
}

LT_API cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t matLayout) {
    return destroy(matLayout, LT_LAYOUT, "cublasLtMatrixLayoutDestroy");
}

LT_API cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t matLayout,
                                                       cublasLtMatrixLayoutAttribute_t attr, const void *buf,
                                                       size_t nbytes) {
    static const char who[] = "cublasLtMatrixLayoutSetAttribute";
    lt_layout *l = lt_live<lt_layout>(matLayout, LT_LAYOUT, who, "matLayout");
    if (!l) return CUBLAS_STATUS_INVALID_VALUE;
    uint32_t u32;
    int32_t i32;
    int64_t i64;
    switch (attr) {
    case CUBLASLT_MATRIX_LAYOUT_TYPE:
        ATTR("CUBLASLT_MATRIX_LAYOUT_TYPE", u32);
        if (!known_type(u32)) return lt_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: type %u", who, u32);
        l->type = u32;
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATRIX_LAYOUT_ORDER:
        ATTR("CUBLASLT_MATRIX_LAYOUT_ORDER", i32);
        if (i32 < CUBLASLT_ORDER_COL || i32 > CUBLASLT_ORDER_COL32_2R_4R4)
            return lt_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: order %d", who, i32);
        l->order = i32;
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATRIX_LAYOUT_ROWS: ATTR("CUBLASLT_MATRIX_LAYOUT_ROWS", l->rows); return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATRIX_LAYOUT_COLS: ATTR("CUBLASLT_MATRIX_LAYOUT_COLS", l->cols); return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATRIX_LAYOUT_LD: /* "Currently only non-negative values are supported" */
        ATTR("CUBLASLT_MATRIX_LAYOUT_LD", i64);
        if (i64 < 0) return lt_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: ld %lld", who, (long long)i64);
        l->ld = i64;
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT:
        ATTR("CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT", i32);
        if (i32 < 1) return lt_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: batch count %d", who, i32);
        l->batch = i32;
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET:
        ATTR("CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET", l->stride);
        return CUBLAS_STATUS_SUCCESS;
    default: return lt_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: attribute %d is unknown or not emulated", who, (int)attr);
    }
}

LT_API cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *pref) {
    return create((lt_pref **)pref, lt_default_pref, LT_PREF);
}

LT_API cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
    return destroy(pref, LT_PREF, "cublasLtMatmulPreferenceDestroy");
}

LT_API cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                           cublasLtMatmulPreferenceAttributes_t attr, const void *buf,
                                                           size_t nbytes) {
    static const char who[] = "cublasLtMatmulPreferenceSetAttribute";
    lt_pref *p = lt_live<lt_pref>(pref, LT_PREF, who, "pref");
    if (!p) return CUBLAS_STATUS_INVALID_VALUE;
    uint32_t u32;
    switch (attr) {
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES:
        ATTR("CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES", p->max_ws);
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK:
        ATTR("CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK", u32);
        if (u32 & ~(uint32_t)CUBLASLT_REDUCTION_SCHEME_MASK)
            return lt_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: reduction scheme mask 0x%x", who, u32);
        p->reduction = u32;
        return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES: {
        const int x = attr - CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES;
        ATTR("CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_x_BYTES", u32);
        /* an alignment that is not a power of two promises nothing an address can honour */
        if (u32 == 0 || (u32 & (u32 - 1)))
            return lt_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: MIN_ALIGNMENT_%s_BYTES %u is not a power of two", who,
                           lt_mat_name[x], u32);
        p->align[x] = u32;
        return CUBLAS_STATUS_SUCCESS;
    }
    default: return lt_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: attribute %d is unknown or not emulated", who, (int)attr);
    }
}

#undef ATTR
/* ---- version and messages ------------------------------------------------------------ */

/* CUBLAS_VERSION of the headers this was built with, or FERRY_EMU_CUBLAS_VERSION (a test
 * emulating another library). */
LT_API size_t cublasLtGetVersion(void) {
    const char *s = getenv("FERRY_EMU_CUBLAS_VERSION");
    if (!s || !*s) return CUBLAS_VERSION;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (*end || errno || *s == '-') {
        fy_emu_report("FERRY_EMU_CUBLAS_VERSION=%s is not a version (major * 10000 + minor * 100 + patch); "
                      "cuBLASLt %d",
                      s, CUBLAS_VERSION);
        return CUBLAS_VERSION;
    }
    return (size_t)v;
}

LT_API const char *cublasLtGetStatusString(cublasStatus_t status) {
    switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "the operation completed successfully";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "the library was not initialized";
    case CUBLAS_STATUS_ALLOC_FAILED: return "resource allocation failed";
    case CUBLAS_STATUS_INVALID_VALUE: return "an invalid value was passed";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "the device lacks a feature the operation needs";
    case CUBLAS_STATUS_MAPPING_ERROR: return "an access to GPU memory failed";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "the GPU program failed to execute";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "an internal operation failed";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "the requested functionality is not supported";
    case CUBLAS_STATUS_LICENSE_ERROR: return "the license check failed";
    default: return "unknown cuBLAS status";
    }
}
