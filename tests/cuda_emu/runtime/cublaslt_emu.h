/* cublaslt_emu.h — what the emulated cuBLASLt's two files share (C++, inside
 * libcublasLt.so.13 only): its objects, the registry that tells a live one, and the report
 * every refusal makes.
 *   cublaslt_emu.cc     handles, descriptors, layouts, preferences and their attributes;
 *                       the version and status strings;
 *   cublaslt_matmul.cc  the problem they describe, the heuristic and cublasLtMatmul.
 * The library is strict where cuBLASLt is lenient or undefined, so that a misuse fails
 * here as on a GPU or worse, never better. A refusal returns cuBLASLt's status for it
 * with one fy_emu_report line naming the call and the operand:
 * CUBLAS_STATUS_INVALID_VALUE for a malformed call, CUBLAS_STATUS_NOT_SUPPORTED for a
 * well-formed problem cuBLASLt (or this emulation) does not run,
 * CUBLAS_STATUS_NOT_INITIALIZED for a handle that is not one. */
#ifndef FY_CUBLASLT_EMU_H
#define FY_CUBLASLT_EMU_H

#include <cublasLt.h>

#include "tests/cuda_emu/runtime/emu_rt.h"

/* What the library exports: cuBLASLt's names, visible whatever the build's default. */
#define LT_API extern "C" __attribute__((visibility("default")))

/* One report line; returns s, the status the call gives. */
cublasStatus_t lt_fail(cublasStatus_t s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
const char *lt_type_name(int t);        /* "CUDA_R_32F" */
const char *lt_compute_name(int c);     /* "CUBLAS_COMPUTE_32F" */

/* ---- objects: the library's own structs behind cuBLASLt's opaque pointers ------------ */

enum lt_kind { LT_HANDLE, LT_DESC, LT_LAYOUT, LT_PREF };
extern const char *const lt_kind_name[4]; /* "matrix layout" */

/* Whether p is a live object of kind k (created, not yet destroyed). Any thread. */
bool lt_is(const void *p, lt_kind k);

/* p as a live object of kind k, or NULL after a report naming the call and argument. */
template <typename T> static inline T *lt_live(const void *p, lt_kind k, const char *who, const char *arg) {
    if (lt_is(p, k)) return (T *)p;
    fy_emu_report("%s: %s %p is not a live %s", who, arg, p, lt_kind_name[k]);
    return nullptr;
}

struct lt_desc {
    int32_t compute, scale;  /* cublasComputeType_t, cudaDataType_t of alpha and beta */
    int32_t transa, transb;  /* cublasOperation_t: CUBLAS_OP_N or CUBLAS_OP_T */
    uint32_t epilogue;       /* CUBLASLT_EPILOGUE_DEFAULT or CUBLASLT_EPILOGUE_BIAS */
    const void *bias;        /* (D's rows), device */
    int32_t bias_type;       /* cudaDataType_t; -1: D's type (cuBLASLt's default) */
};

struct lt_layout {
    uint32_t type;           /* cudaDataType_t */
    int32_t order;           /* cublasLtOrder_t */
    uint64_t rows, cols;
    int64_t ld;              /* elements */
    int32_t batch;
    int64_t stride;          /* elements between batch items */
};

enum { MAT_A, MAT_B, MAT_C, MAT_D };
extern const char *const lt_mat_name[4]; /* "A" */

struct lt_pref {
    uint64_t max_ws;         /* bytes */
    uint32_t reduction;      /* cublasLtReductionScheme_t mask */
    uint32_t align[4];       /* MIN_ALIGNMENT_{A,B,C,D}_BYTES: powers of two */
};
/* cuBLASLt's defaults: no workspace, every reduction scheme, 256-byte alignment */
extern const lt_pref lt_default_pref;

#endif
