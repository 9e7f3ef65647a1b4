/* cublaslt_matmul.cc — the emulated cuBLASLt's products (cublaslt_emu.h): the problem a
 * matmul descriptor and four layouts describe, the heuristic, and cublasLtMatmul.
 *
 * The heuristic validates the whole problem (problem_check: the documentation's table of
 * types, the shapes, leading dimensions and batches, the epilogue) and returns one
 * algorithm that records what it was found for (algo_rec). cublasLtMatmul validates the
 * problem again, holds it to the record, checks every pointer (inside one live device
 * allocation over the whole extent its layout implies, aligned as promised, the output
 * overlapping no input), reads alpha and beta on the host (CUBLASLT_POINTER_MODE_HOST,
 * the only mode emulated), and queues the reference GEMM (gemm_ref.h) on the stream,
 * which runs it in the emulated device's process. */
#include "tests/cuda_emu/runtime/cublaslt_emu.h"

#include <stdio.h>
#include <string.h>

#include "tests/cuda_emu/runtime/gemm_ref.h"

/* ---- the problem --------------------------------------------------------------------- */

/* cublasLtMatmul's supported types for regular (not FP8) column- or row-major matrices:
 * the cuBLAS Library User Guide (cuBLAS 12 and 13), section "cublasLtMatmul()", its table
 * of computeType, scaleType, Atype/Btype and Ctype, where Dtype is Ctype, and its Bias
 * Type column: `epilogue` false where it says "Non-default epilogue not supported"; the
 * bias is of D's type in every row kept here (cublasLt.h, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE).
 * The _PEDANTIC compute types share the rows of their plain ones. Complex rows are left
 * out, so refused. `emulated`: the rows gemm_ref.cc computes; the others are refused as
 * not emulated. */
static const struct type_row {
    cublasComputeType_t compute;
    cudaDataType_t scale, ab, c;
    bool epilogue, emulated;
} k_types[] = {
    {CUBLAS_COMPUTE_16F, CUDA_R_16F, CUDA_R_16F, CUDA_R_16F, true, false},
    {CUBLAS_COMPUTE_32I, CUDA_R_32I, CUDA_R_8I, CUDA_R_32I, false, false},
    {CUBLAS_COMPUTE_32I, CUDA_R_32F, CUDA_R_8I, CUDA_R_8I, false, false},
    {CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF, true, true},
    {CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16F, CUDA_R_16F, true, false},
    {CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_8I, CUDA_R_32F, false, false},
    {CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_32F, true, true},
    {CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16F, CUDA_R_32F, true, false},
    {CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_32F, CUDA_R_32F, true, true},
    {CUBLAS_COMPUTE_32F_FAST_16F, CUDA_R_32F, CUDA_R_32F, CUDA_R_32F, true, false},
    {CUBLAS_COMPUTE_32F_FAST_16BF, CUDA_R_32F, CUDA_R_32F, CUDA_R_32F, true, true},
    {CUBLAS_COMPUTE_32F_FAST_TF32, CUDA_R_32F, CUDA_R_32F, CUDA_R_32F, true, true},
    {CUBLAS_COMPUTE_64F, CUDA_R_64F, CUDA_R_64F, CUDA_R_64F, true, false},
};

static int plain_compute(int c) {
    switch (c) {
    case CUBLAS_COMPUTE_16F_PEDANTIC: return CUBLAS_COMPUTE_16F;
    case CUBLAS_COMPUTE_32F_PEDANTIC: return CUBLAS_COMPUTE_32F;
    case CUBLAS_COMPUTE_64F_PEDANTIC: return CUBLAS_COMPUTE_64F;
    case CUBLAS_COMPUTE_32I_PEDANTIC: return CUBLAS_COMPUTE_32I;
    default: return c;
    }
}

/* How a compute type takes its inputs: FAST_TF32 and FAST_16BF round fp32 to tf32 or
 * bf16 (the rows above give them fp32 inputs only); the others take them as they are. */
static fy_emu_gemm_round input_rounding(int compute) {
    switch (compute) {
    case CUBLAS_COMPUTE_32F_FAST_TF32: return FY_EMU_GEMM_TF32;
    case CUBLAS_COMPUTE_32F_FAST_16BF: return FY_EMU_GEMM_BF16;
    default: return FY_EMU_GEMM_EXACT;
    }
}

static size_t elem_nbytes(uint32_t t) { return t == CUDA_R_16BF ? 2 : 4; } /* the emulated types */

/* A validated problem: the four matrices' layouts and what follows from them. */
struct problem {
    const lt_desc *d;
    const lt_layout *l[4]; /* A, B, C, D */
    size_t es[4];          /* element bytes */
    size_t extent[4];      /* bytes from a matrix's address to its last element's end */
    int64_t m, n, k;
    bool bias; /* the BIAS epilogue */
    fy_emu_gemm_round round;
};

static size_t extent_of(const lt_layout *l, size_t es) {
    return (size_t)(((int64_t)l->batch - 1) * l->stride + ((int64_t)l->cols - 1) * l->ld + (int64_t)l->rows) * es;
}

/* One matrix's layout alone; the shapes are checked together in problem_check. */
static cublasStatus_t layout_check(const char *who, int x, const lt_layout *l) {
    const char *n = lt_mat_name[x];
    if (l->order != CUBLASLT_ORDER_COL)
        return lt_fail(CUBLAS_STATUS_NOT_SUPPORTED, "%s: %s's order %d: only CUBLASLT_ORDER_COL is emulated", who, n,
                       l->order);
    if (l->rows == 0 || l->cols == 0)
        return lt_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: %s is empty (%llu x %llu)", who, n,
                       (unsigned long long)l->rows, (unsigned long long)l->cols);
    /* "Usually only values that can be expressed as int32_t are supported" */
    if (l->rows > INT32_MAX || l->cols > INT32_MAX || l->ld > INT32_MAX)
        return lt_fail(CUBLAS_STATUS_NOT_SUPPORTED, "%s: %s's rows, columns or ld over INT32_MAX", who, n);
    if (l->ld < (int64_t)l->rows)
        return lt_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: %s's ld %lld is less than its %llu rows (column order)", who,
                       n, (long long)l->ld, (unsigned long long)l->rows);
    if (l->batch > 1 && l->stride < 0)
        return lt_fail(CUBLAS_STATUS_NOT_SUPPORTED, "%s: %s's batch stride %lld: negative strides are not emulated",
                       who, n, (long long)l->stride);
    return CUBLAS_STATUS_SUCCESS;
}

/* The types against the documentation's table and the epilogue's needs. */
static cublasStatus_t types_check(const char *who, const lt_desc *d, const lt_layout *const l[4], problem *pr) {
    const uint32_t ab = l[MAT_A]->type, c = l[MAT_C]->type;
    if (l[MAT_B]->type != ab || l[MAT_D]->type != c)
        return lt_fail(CUBLAS_STATUS_NOT_SUPPORTED,
                       "%s: A %s and B %s, C %s and D %s: the table wants A's type for B "
                       "and C's for D",
                       who, lt_type_name(ab), lt_type_name(l[MAT_B]->type), lt_type_name(c),
                       lt_type_name(l[MAT_D]->type));
    const type_row *row = nullptr;
    for (const type_row &r : k_types)
        if ((int)r.compute == plain_compute(d->compute) && (int)r.scale == d->scale && r.ab == (int)ab && r.c == (int)c)
            row = &r;
    if (!row)
        return lt_fail(CUBLAS_STATUS_NOT_SUPPORTED,
                       "%s: %s, scale %s, A/B %s, C/D %s is not in cublasLtMatmul's table of "
                       "supported types",
                       who, lt_compute_name(d->compute), lt_type_name(d->scale), lt_type_name(ab), lt_type_name(c));
    if (!row->emulated)
        return lt_fail(CUBLAS_STATUS_NOT_SUPPORTED, "%s: %s, A/B %s, C/D %s is supported by cuBLASLt but not emulated",
                       who, lt_compute_name(d->compute), lt_type_name(ab), lt_type_name(c));
    pr->bias = d->epilogue == CUBLASLT_EPILOGUE_BIAS;
    if (pr->bias && !row->epilogue)
        return lt_fail(CUBLAS_STATUS_NOT_SUPPORTED, "%s: no epilogue but the default with these types", who);
    if (pr->bias && d->bias_type != -1 && d->bias_type != (int)c)
        return lt_fail(CUBLAS_STATUS_NOT_SUPPORTED, "%s: a %s bias with a %s D is not emulated (the bias is D's type)",
                       who, lt_type_name(d->bias_type), lt_type_name(c));
    pr->round = input_rounding(d->compute);
    return CUBLAS_STATUS_SUCCESS;
}

/* The whole problem, as the heuristic and cublasLtMatmul both see it (no pointers but the
 * bias's, which is the caller's to check). */
static cublasStatus_t problem_check(const char *who, const lt_desc *d, const lt_layout *const l[4], problem *pr) {
    memset(pr, 0, sizeof *pr);
    pr->d = d;
    for (int x = 0; x < 4; x++) {
        cublasStatus_t s = layout_check(who, x, l[x]);
        if (s != CUBLAS_STATUS_SUCCESS) return s;
        pr->l[x] = l[x];
    }
    cublasStatus_t s = types_check(who, d, l, pr);
    if (s != CUBLAS_STATUS_SUCCESS) return s;
    const lt_layout *A = l[MAT_A], *B = l[MAT_B], *C = l[MAT_C], *D = l[MAT_D];
    pr->m = (int64_t)D->rows;
    pr->n = (int64_t)D->cols;
    pr->k = (int64_t)(d->transa == CUBLAS_OP_T ? A->rows : A->cols);
    const int64_t am = (int64_t)(d->transa == CUBLAS_OP_T ? A->cols : A->rows);
    const int64_t bk = (int64_t)(d->transb == CUBLAS_OP_T ? B->cols : B->rows);
    const int64_t bn = (int64_t)(d->transb == CUBLAS_OP_T ? B->rows : B->cols);
    if (am != pr->m || bk != pr->k || bn != pr->n || (int64_t)C->rows != pr->m || (int64_t)C->cols != pr->n)
        return lt_fail(CUBLAS_STATUS_INVALID_VALUE,
                       "%s: op(A) %lld x %lld, op(B) %lld x %lld, C %llu x %llu and D %lld x "
                       "%lld do not make one product",
                       who, (long long)am, (long long)pr->k, (long long)bk, (long long)bn, (unsigned long long)C->rows,
                       (unsigned long long)C->cols, (long long)pr->m, (long long)pr->n);
    for (int x = 0; x < 3; x++)
        if (l[x]->batch != D->batch)
            return lt_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: %s's batch count %d is not D's %d", who, lt_mat_name[x],
                           l[x]->batch, D->batch);
    for (int x = 0; x < 4; x++) {
        pr->es[x] = elem_nbytes(l[x]->type);
        pr->extent[x] = extent_of(l[x], pr->es[x]);
    }
    const int64_t d_item = ((int64_t)D->cols - 1) * D->ld + (int64_t)D->rows;
    if (D->batch > 1 && D->stride < d_item)
        return lt_fail(CUBLAS_STATUS_INVALID_VALUE,
                       "%s: D's batch items overlap (stride %lld, an item spans %lld elements)", who,
                       (long long)D->stride, (long long)d_item);
    return CUBLAS_STATUS_SUCCESS;
}

/* ---- the algorithm -------------------------------------------------------------------- */

/* What an algorithm was found for, in cublasLtMatmulAlgo_t's bytes. Alignments as log2 of
 * bytes. `claim`: the preference's MIN_ALIGNMENT_x_BYTES, which the pointers must honour;
 * `need`: the claim lowered to what the leading dimension and batch stride allowed when
 * the heuristic ran (it sees them), which they must still allow; `bias`: the bias
 * pointer's alignment when the heuristic ran (cublasLt.h: the heuristic reads it), at
 * most 16 bytes (a vector load), 16 for none. The reference never splits k (reduction
 * scheme NONE), which every REDUCTION_SCHEME_MASK allows, so the mask is not recorded. */
struct algo_rec {
    uint64_t magic;
    int32_t compute, scale;
    uint32_t ab_type, cd_type;
    uint8_t ta, tb;
    uint16_t epilogue;
    uint8_t claim[4], need[4];
    uint8_t bias;
    uint64_t ws_nbytes; /* the workspace it takes: all the preference allowed */
};
static_assert(sizeof(algo_rec) <= sizeof(cublasLtMatmulAlgo_t), "algo_rec fits an algo");
#define ALGO_MAGIC 0x666572727931746cull

static int align_log2(uint64_t v) { return v ? __builtin_ctzll(v) : 63; }
static int min3(int a, int b, int c) { return a < b ? (a < c ? a : c) : (b < c ? b : c); }

static algo_rec algo_record(const problem *pr, const lt_pref *p) {
    algo_rec r;
    memset(&r, 0, sizeof r);
    r.magic = ALGO_MAGIC;
    r.compute = pr->d->compute;
    r.scale = pr->d->scale;
    r.ab_type = pr->l[MAT_A]->type;
    r.cd_type = pr->l[MAT_D]->type;
    r.ta = pr->d->transa == CUBLAS_OP_T;
    r.tb = pr->d->transb == CUBLAS_OP_T;
    r.epilogue = (uint16_t)pr->d->epilogue;
    for (int x = 0; x < 4; x++) {
        const lt_layout *l = pr->l[x];
        r.claim[x] = (uint8_t)align_log2(p->align[x]);
        r.need[x] = (uint8_t)min3(r.claim[x], align_log2((uint64_t)l->ld * pr->es[x]),
                                  l->batch > 1 ? align_log2((uint64_t)l->stride * pr->es[x]) : 63);
    }
    r.bias = (uint8_t)(align_log2((uintptr_t)pr->d->bias) < 4 ? align_log2((uintptr_t)pr->d->bias) : 4);
    r.ws_nbytes = p->max_ws;
    return r;
}

LT_API cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t lightHandle, cublasLtMatmulDesc_t operationDesc,
                                                     cublasLtMatrixLayout_t Adesc, cublasLtMatrixLayout_t Bdesc,
                                                     cublasLtMatrixLayout_t Cdesc, cublasLtMatrixLayout_t Ddesc,
                                                     cublasLtMatmulPreference_t preference, int requestedAlgoCount,
                                                     cublasLtMatmulHeuristicResult_t heuristicResultsArray[],
                                                     int *returnAlgoCount) {
    static const char who[] = "cublasLtMatmulAlgoGetHeuristic";
    if (returnAlgoCount) *returnAlgoCount = 0;
    if (!lt_is(lightHandle, LT_HANDLE))
        return lt_fail(CUBLAS_STATUS_NOT_INITIALIZED, "%s: %p is not a live cuBLASLt handle", who, (void *)lightHandle);
    if (requestedAlgoCount <= 0 || !heuristicResultsArray || !returnAlgoCount)
        return lt_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: %d algorithms asked into %p, their count into %p", who,
                       requestedAlgoCount, (void *)heuristicResultsArray, (void *)returnAlgoCount);
    const lt_desc *d = lt_live<lt_desc>(operationDesc, LT_DESC, who, "operationDesc");
    const lt_layout *l[4] = {
        lt_live<lt_layout>(Adesc, LT_LAYOUT, who, "Adesc"), lt_live<lt_layout>(Bdesc, LT_LAYOUT, who, "Bdesc"),
        lt_live<lt_layout>(Cdesc, LT_LAYOUT, who, "Cdesc"), lt_live<lt_layout>(Ddesc, LT_LAYOUT, who, "Ddesc")};
    const lt_pref *p = lt_live<lt_pref>(preference, LT_PREF, who, "preference");
    if (!d || !l[0] || !l[1] || !l[2] || !l[3] || !p) return CUBLAS_STATUS_INVALID_VALUE;
    problem pr;
    cublasStatus_t s = problem_check(who, d, l, &pr);
    if (s != CUBLAS_STATUS_SUCCESS) return s;
    algo_rec r = algo_record(&pr, p);
    cublasLtMatmulHeuristicResult_t *res = &heuristicResultsArray[0];
    memset(res, 0, sizeof *res);
    memcpy(&res->algo, &r, sizeof r);
    res->workspaceSize = r.ws_nbytes;
    res->state = CUBLAS_STATUS_SUCCESS;
    res->wavesCount = 1.0f;
    *returnAlgoCount = 1;
    return CUBLAS_STATUS_SUCCESS;
}

/* ---- the product ---------------------------------------------------------------------- */

static const char *mem_name(fy_emu_mem k) {
    switch (k) {
    case FY_EMU_PAGEABLE: return "pageable host memory";
    case FY_EMU_PINNED: return "pinned host memory";
    case FY_EMU_DEVICE: return "device memory";
    default: return "not wholly inside one live device allocation (freed, out of bounds or straddling two)";
    }
}

/* A matrix's bytes, for overlap tests: batch items of columns. */
struct span {
    uintptr_t base;
    uint64_t rows, cols, ld, batch, stride; /* bytes for rows, ld and stride */
};

static span span_of(const void *p, const lt_layout *l, size_t es) {
    return {(uintptr_t)p, l->rows * es, l->cols, (uint64_t)l->ld * es, (uint64_t)l->batch, (uint64_t)l->stride * es};
}

static uintptr_t item_end(const span &s, uintptr_t item) { return item + (s.cols - 1) * s.ld + s.rows; }

/* Whether one item of x (at x0) and one of y (at y0) share a byte: column by column of
 * x, against the first column of y that ends after its start. */
static bool items_meet(const span &x, uintptr_t x0, const span &y, uintptr_t y0) {
    for (uint64_t c = 0; c < x.cols; c++) {
        const uintptr_t a = x0 + c * x.ld, b = a + x.rows;
        if (b <= y0) continue;
        const uint64_t j = a < y0 + y.rows ? 0 : (a - y0 - y.rows) / y.ld + 1;
        if (j < y.cols && y0 + j * y.ld < b) return true;
    }
    return false;
}

static bool spans_meet(const span &x, const span &y) {
    for (uint64_t i = 0; i < x.batch; i++) {
        const uintptr_t x0 = x.base + i * x.stride;
        for (uint64_t j = 0; j < y.batch; j++) {
            const uintptr_t y0 = y.base + j * y.stride;
            if (item_end(x, x0) <= y0 || item_end(y, y0) <= x0) continue;
            if (items_meet(x, x0, y, y0)) return true;
        }
    }
    return false;
}

/* A pointer the device reads or writes: [p, p + nbytes) inside one live device
 * allocation, p aligned to `align` bytes. */
static cublasStatus_t operand_check(const char *name, const void *p, size_t nbytes, size_t align, const char *why) {
    if (!p) return lt_fail(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatmul: %s is NULL", name);
    if ((uintptr_t)p % align)
        return lt_fail(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatmul: %s at %p is not %zu-byte aligned (%s)", name, p,
                       align, why);
    fy_emu_mem k = fy_emu_mem_of(p, nbytes);
    if (k != FY_EMU_DEVICE)
        return lt_fail(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatmul: %s [%p, +%zu bytes) is %s", name, p, nbytes,
                       mem_name(k));
    return CUBLAS_STATUS_SUCCESS;
}

/* The call against the algorithm's record: the same kind of problem, and pointers,
 * leading dimensions and batch strides as aligned as it was promised. */
static cublasStatus_t algo_check(const problem *pr, const algo_rec &r, const void *const ptr[4]) {
    const lt_desc *d = pr->d;
    if (r.compute != d->compute || r.scale != d->scale || r.ab_type != pr->l[MAT_A]->type ||
        r.cd_type != pr->l[MAT_D]->type || r.ta != (d->transa == CUBLAS_OP_T) || r.tb != (d->transb == CUBLAS_OP_T) ||
        r.epilogue != d->epilogue)
        return lt_fail(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatmul: the algo was found for other types, transposes "
                                                    "or epilogue than this call's");
    for (int x = 0; x < 4; x++) {
        const lt_layout *l = pr->l[x];
        size_t claim = (size_t)1 << r.claim[x], need = (size_t)1 << r.need[x];
        char why[96];
        snprintf(why, sizeof why, "the algo was found for MIN_ALIGNMENT_%s_BYTES %zu", lt_mat_name[x], claim);
        cublasStatus_t s =
            operand_check(lt_mat_name[x], ptr[x], pr->extent[x], claim > pr->es[x] ? claim : pr->es[x], why);
        if (s != CUBLAS_STATUS_SUCCESS) return s;
        if (((uint64_t)l->ld * pr->es[x]) % need || (l->batch > 1 && ((uint64_t)l->stride * pr->es[x]) % need))
            return lt_fail(CUBLAS_STATUS_INVALID_VALUE,
                           "cublasLtMatmul: %s's ld %lld or batch stride %lld is not a multiple "
                           "of the %zu bytes the algo was found for",
                           lt_mat_name[x], (long long)l->ld, (long long)l->stride, need);
    }
    if (pr->bias) {
        if (!d->bias)
            return lt_fail(CUBLAS_STATUS_INVALID_VALUE,
                           "cublasLtMatmul: CUBLASLT_EPILOGUE_BIAS without a bias pointer");
        cublasStatus_t s = operand_check("the bias", d->bias, (size_t)pr->m * pr->es[MAT_D], (size_t)1 << r.bias,
                                         "the algo was found for a bias pointer that was");
        if (s != CUBLAS_STATUS_SUCCESS) return s;
    }
    return CUBLAS_STATUS_SUCCESS;
}

/* D overlapping an input is a race on a GPU; C == D (in place) needs C's layout to be D's. */
static cublasStatus_t overlap_check(const problem *pr, const void *const ptr[4]) {
    const lt_layout *lc = pr->l[MAT_C], *ld = pr->l[MAT_D];
    const span d = span_of(ptr[MAT_D], ld, pr->es[MAT_D]);
    if (ptr[MAT_C] == ptr[MAT_D]) {
        if (lc->rows != ld->rows || lc->cols != ld->cols || lc->ld != ld->ld || lc->batch != ld->batch ||
            (ld->batch > 1 && lc->stride != ld->stride))
            return lt_fail(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatmul: C == D (in place) with C's layout not D's");
    } else if (spans_meet(span_of(ptr[MAT_C], lc, pr->es[MAT_C]), d)) {
        return lt_fail(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatmul: D overlaps C without being it");
    }
    for (int x = MAT_A; x <= MAT_B; x++)
        if (spans_meet(span_of(ptr[x], pr->l[x], pr->es[x]), d))
            return lt_fail(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatmul: D overlaps %s", lt_mat_name[x]);
    if (pr->bias &&
        spans_meet({(uintptr_t)pr->d->bias, (uint64_t)pr->m * pr->es[MAT_D], 1, (uint64_t)pr->m * pr->es[MAT_D], 1, 0},
                   d))
        return lt_fail(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatmul: D overlaps the bias");
    return CUBLAS_STATUS_SUCCESS;
}

/* alpha or beta: a float on the host (CUBLASLT_POINTER_MODE_HOST, scale type 32F). */
static cublasStatus_t scalar_read(const char *name, const void *p, float *out) {
    if (!p) return lt_fail(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatmul: %s is NULL", name);
    fy_emu_mem k = fy_emu_mem_of(p, sizeof(float));
    if (k != FY_EMU_PAGEABLE && k != FY_EMU_PINNED)
        return lt_fail(CUBLAS_STATUS_INVALID_VALUE,
                       "cublasLtMatmul: %s at %p is %s, not host memory "
                       "(CUBLASLT_POINTER_MODE_HOST)",
                       name, p, mem_name(k));
    memcpy(out, p, sizeof *out);
    return CUBLAS_STATUS_SUCCESS;
}

LT_API cublasStatus_t cublasLtMatmul(cublasLtHandle_t lightHandle, cublasLtMatmulDesc_t computeDesc, const void *alpha,
                                     const void *A, cublasLtMatrixLayout_t Adesc, const void *B,
                                     cublasLtMatrixLayout_t Bdesc, const void *beta, const void *C,
                                     cublasLtMatrixLayout_t Cdesc, void *D, cublasLtMatrixLayout_t Ddesc,
                                     const cublasLtMatmulAlgo_t *algo, void *workspace, size_t workspaceSizeInBytes,
                                     cudaStream_t stream) {
    static const char who[] = "cublasLtMatmul";
    if (!lt_is(lightHandle, LT_HANDLE))
        return lt_fail(CUBLAS_STATUS_NOT_INITIALIZED, "%s: %p is not a live cuBLASLt handle", who, (void *)lightHandle);
    const lt_desc *d = lt_live<lt_desc>(computeDesc, LT_DESC, who, "computeDesc");
    const lt_layout *l[4] = {
        lt_live<lt_layout>(Adesc, LT_LAYOUT, who, "Adesc"), lt_live<lt_layout>(Bdesc, LT_LAYOUT, who, "Bdesc"),
        lt_live<lt_layout>(Cdesc, LT_LAYOUT, who, "Cdesc"), lt_live<lt_layout>(Ddesc, LT_LAYOUT, who, "Ddesc")};
    if (!d || !l[0] || !l[1] || !l[2] || !l[3]) return CUBLAS_STATUS_INVALID_VALUE;
    problem pr;
    cublasStatus_t s = problem_check(who, d, l, &pr);
    if (s != CUBLAS_STATUS_SUCCESS) return s;
    /* no algo: cuBLASLt asks its heuristic with the default preferences */
    algo_rec r = algo_record(&pr, &lt_default_pref);
    if (algo) {
        memcpy(&r, algo, sizeof r);
        if (r.magic != ALGO_MAGIC)
            return lt_fail(CUBLAS_STATUS_INVALID_VALUE,
                           "%s: the algo is not one cublasLtMatmulAlgoGetHeuristic returned", who);
    }
    const void *const ptr[4] = {A, B, C, D};
    if ((s = algo_check(&pr, r, ptr)) != CUBLAS_STATUS_SUCCESS) return s;
    if ((s = overlap_check(&pr, ptr)) != CUBLAS_STATUS_SUCCESS) return s;
    if (workspaceSizeInBytes < r.ws_nbytes)
        return lt_fail(CUBLAS_STATUS_INVALID_VALUE, "%s: a workspace of %zu bytes for an algo that takes %llu", who,
                       workspaceSizeInBytes, (unsigned long long)r.ws_nbytes);
    if (workspaceSizeInBytes &&
        (s = operand_check("the workspace", workspace, workspaceSizeInBytes, 1, "")) != CUBLAS_STATUS_SUCCESS)
        return s;
    fy_emu_gemm g;
    memset(&g, 0, sizeof g);
    if ((s = scalar_read("alpha", alpha, &g.alpha)) != CUBLAS_STATUS_SUCCESS) return s;
    if ((s = scalar_read("beta", beta, &g.beta)) != CUBLAS_STATUS_SUCCESS) return s;
    g.A = A;
    g.B = B;
    g.C = C;
    g.D = D;
    g.bias = pr.bias ? d->bias : nullptr;
    g.ab_type = (cudaDataType_t)l[MAT_A]->type;
    g.cd_type = (cudaDataType_t)l[MAT_D]->type;
    g.round = pr.round;
    g.ta = d->transa == CUBLAS_OP_T;
    g.tb = d->transb == CUBLAS_OP_T;
    g.m = pr.m;
    g.n = pr.n;
    g.k = pr.k;
    g.lda = l[MAT_A]->ld;
    g.ldb = l[MAT_B]->ld;
    g.ldc = l[MAT_C]->ld;
    g.ldd = l[MAT_D]->ld;
    g.sA = l[MAT_A]->stride;
    g.sB = l[MAT_B]->stride;
    g.sC = l[MAT_C]->stride;
    g.sD = l[MAT_D]->stride;
    g.batch = l[MAT_D]->batch;
    cudaError_t e = fy_emu_enqueue(stream, fy_emu_gemm_dev, &g, sizeof g, who);
    if (e != cudaSuccess)
        return lt_fail(e == cudaErrorInvalidResourceHandle ? CUBLAS_STATUS_INVALID_VALUE
                                                           : CUBLAS_STATUS_EXECUTION_FAILED,
                       "%s: the stream refused the product (cudaError %d)", who, (int)e);
    return CUBLAS_STATUS_SUCCESS;
}
