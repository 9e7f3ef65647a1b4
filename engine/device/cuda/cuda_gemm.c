/* cuda_gemm.c — the GEMM ops of the cuda backend (matmul forward/backward) through
 * cuBLASLt. (Attention is a hand-written tensor-core kernel: cuda_attention.cuh.)
 *
 * cuBLASLt is loaded with dlopen when the first cuda device opens, so the ferry binary
 * starts as fast as before and runs on machines without it (the cpu backend needs
 * nothing of CUDA). Each stream has its own handle, workspace and descriptor cache: a
 * stream is fed by one thread at a time, so none of them needs a lock.
 *
 * Determinism: a GEMM's algorithm is chosen by cuBLASLt's heuristic from the shape, the
 * types and each matrix's alignment class (address, leading dimension and batch stride,
 * capped at 16 bytes: every block and activation buffer starts 64-byte aligned, so the
 * class depends on the shape alone); so the same product computes the same bits
 * wherever its buffers live. One handle and workspace per stream keeps cuBLASLt's
 * results reproducible.
 *
 * Row-major tensors are column-major transposes: each op below writes the row-major
 * product it means and its column-major form. */
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cublasLt.h>

#include "engine/device/cuda/cuda_impl.h"

#define LT_FUNCS(X)                                                                      \
    X(cublasLtCreate) X(cublasLtDestroy) X(cublasLtGetStatusString)                       \
    X(cublasLtMatmulDescCreate) X(cublasLtMatmulDescDestroy)                              \
    X(cublasLtMatmulDescSetAttribute) X(cublasLtMatrixLayoutCreate)                       \
    X(cublasLtMatrixLayoutDestroy) X(cublasLtMatrixLayoutSetAttribute)                    \
    X(cublasLtMatmulPreferenceCreate) X(cublasLtMatmulPreferenceDestroy)                  \
    X(cublasLtMatmulPreferenceSetAttribute) X(cublasLtMatmulAlgoGetHeuristic)             \
    X(cublasLtMatmul)

static struct {
#define LT_FIELD(f) __typeof__(&f) f;
    LT_FUNCS(LT_FIELD)
#undef LT_FIELD
} lt;

static pthread_once_t lt_once = PTHREAD_ONCE_INIT;
static fy_status lt_status = FY_ERR_UNSUPPORTED;
static char lt_error[256];

#define LT_STR(x) #x
#define LT_SONAME(major) "libcublasLt.so." LT_STR(major)

static void lt_load(void) {
    /* the major version this file was compiled against, and no other */
    void *h = fy_cu_dlopen(LT_SONAME(CUBLAS_VER_MAJOR), "cuBLASLt", lt_error, sizeof lt_error);
    if (!h) return;
#define LT_SYM(f) FY_CU_SYM(h, lt, f, "cuBLASLt", lt_error)
    LT_FUNCS(LT_SYM)
#undef LT_SYM
    size_t (*version)(void) = (size_t (*)(void))dlsym(h, "cublasLtGetVersion");
    if (version && version() / 10000 != CUBLAS_VER_MAJOR) {
        snprintf(lt_error, sizeof lt_error, "cuBLASLt %zu is not the major version %d this build needs",
                 version(), CUBLAS_VER_MAJOR);
        return;
    }
    lt_status = FY_OK;
}

fy_status fy_cu_blas_load(void) {
    pthread_once(&lt_once, lt_load);
    if (lt_status != FY_OK) fy_log_error("cuda: %s", lt_error);
    return lt_status;
}

#define lt_check(call, what) lt_check_at((call), (what), __FILE__, __LINE__)
static void lt_check_at(cublasStatus_t s, const char *what, const char *file, int line) {
    if (s == CUBLAS_STATUS_SUCCESS) return;
    char hint[160];
    snprintf(hint, sizeof hint, "cuBLASLt: %s: %s", what, lt.cublasLtGetStatusString(s));
    fy_abort_at(file, line, "cublasStatus == CUBLAS_STATUS_SUCCESS", hint);
}

/* ---- one GEMM, column-major: D = alpha op(A) op(B) + beta D (+ bias per row of D) ---- */

typedef struct gemm {
    bool ta, tb;
    int m, n, k;
    const void *A; int lda; int64_t sA;
    const void *B; int ldb; int64_t sB;
    void *D; int ldd; int64_t sD;
    int batch;           /* strided batch count (1 = plain) */
    float alpha, beta;
    const void *bias;    /* (m), added to every column of D; NULL for none */
    bool d_f32;          /* C and D are fp32 whatever A's and B's type */
} gemm;

typedef struct gemm_key {
    int dt, ta, tb, m, n, k, lda, ldb, ldd, batch, has_bias;
    int alA, alB, alD, alBias; /* alignment classes of A, B, D and the bias (the heuristic
                                  reads the bias pointer's alignment) */
    int d_f32;                 /* C and D fp32 */
    int64_t sA, sB, sD;
} gemm_key;
/* compared with memcmp: 16 ints and 3 int64s, no padding; keys are memset anyway */
_Static_assert(sizeof(gemm_key) == 16 * sizeof(int) + 3 * sizeof(int64_t), "gemm_key layout");

typedef struct gemm_plan {
    gemm_key key;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, ld;
    cublasLtMatmulAlgo_t algo;
    bool bias_epilogue;  /* false: the bias is written first and the product added */
    uint64_t last_use;
} gemm_plan;

#define CACHE_CAP 64

struct fy_cu_gemm_cache {
    gemm_plan plans[CACHE_CAP];
    int n;
    uint64_t clock;
};

/* The largest power of two up to 16 dividing a matrix's address, its leading dimension
 * and batch stride in bytes. */
static int align_class(const void *p, int ld, int64_t stride, int batch, size_t es) {
    uintptr_t bits = (uintptr_t)p | (uintptr_t)ld * es | 16u;
    if (batch > 1) bits |= (uintptr_t)(stride * (int64_t)es);
    return (int)(bits & (~bits + 1));
}

static cublasLtMatrixLayout_t layout(cudaDataType_t t, int rows, int cols, int ld, int batch,
                                     int64_t stride) {
    cublasLtMatrixLayout_t l;
    lt_check(lt.cublasLtMatrixLayoutCreate(&l, t, (uint64_t)rows, (uint64_t)cols, ld), "layout");
    if (batch > 1) {
        int32_t b = batch;
        lt_check(lt.cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &b, sizeof b), "batch count");
        lt_check(lt.cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride), "batch stride");
    }
    return l;
}

static void plan_free(gemm_plan *p) {
    lt.cublasLtMatrixLayoutDestroy(p->la);
    lt.cublasLtMatrixLayoutDestroy(p->lb);
    lt.cublasLtMatrixLayoutDestroy(p->ld);
    lt.cublasLtMatmulDescDestroy(p->desc);
}

/* Builds descriptors and asks the heuristic; false if no algorithm fits. */
static bool plan_build(fy_cu_stream *cs, const gemm_key *key, const void *bias, gemm_plan *p) {
    const bool with_bias = bias != NULL;
    fy_cu_dev *cd = cs->dev->ctx;
    cudaDataType_t t = key->dt == FY_BF16 ? CUDA_R_16BF : CUDA_R_32F;
    cudaDataType_t td = key->d_f32 ? CUDA_R_32F : t;
    cublasComputeType_t ct = CUBLAS_COMPUTE_32F;
    if (key->dt != FY_BF16 && cd->math == FY_MATMUL_TF32) ct = CUBLAS_COMPUTE_32F_FAST_TF32;
    if (key->dt != FY_BF16 && cd->math == FY_MATMUL_BF16) ct = CUBLAS_COMPUTE_32F_FAST_16BF;
    memset(p, 0, sizeof *p);
    p->key = *key;
    lt_check(lt.cublasLtMatmulDescCreate(&p->desc, ct, CUDA_R_32F), "matmul descriptor");
    cublasOperation_t oa = key->ta ? CUBLAS_OP_T : CUBLAS_OP_N, ob = key->tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    lt_check(lt.cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &oa, sizeof oa), "transa");
    lt_check(lt.cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &ob, sizeof ob), "transb");
    if (with_bias) {
        cublasLtEpilogue_t ep = CUBLASLT_EPILOGUE_BIAS;
        lt_check(lt.cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof ep), "epilogue");
        /* the heuristic reads the bias's alignment from its pointer */
        lt_check(lt.cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias), "bias");
    }
    p->la = layout(t, key->ta ? key->k : key->m, key->ta ? key->m : key->k, key->lda, key->batch, key->sA);
    p->lb = layout(t, key->tb ? key->n : key->k, key->tb ? key->k : key->n, key->ldb, key->batch, key->sB);
    p->ld = layout(td, key->m, key->n, key->ldd, key->batch, key->sD);

    cublasLtMatmulPreference_t pref;
    lt_check(lt.cublasLtMatmulPreferenceCreate(&pref), "preference");
    uint64_t ws = FY_CU_BLAS_WS_NBYTES;
    lt_check(lt.cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws), "workspace");
    const struct { cublasLtMatmulPreferenceAttributes_t attr; uint32_t bytes; } als[] = {
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, (uint32_t)key->alA},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, (uint32_t)key->alB},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, (uint32_t)key->alD},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, (uint32_t)key->alD}};
    for (int i = 0; i < 4; i++)
        lt_check(lt.cublasLtMatmulPreferenceSetAttribute(pref, als[i].attr, &als[i].bytes, sizeof als[i].bytes), "alignment");
    /* split-K partial sums are reduced in the compute type (fp32) and rounded to the
     * output once, never in the output buffer (a bf16 gradient written with beta 1, like
     * the classifier's in one chunk, would be rounded once a split) */
    const uint32_t reduction = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    lt_check(lt.cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reduction, sizeof reduction), "reduction scheme");
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    cublasStatus_t s = lt.cublasLtMatmulAlgoGetHeuristic(cs->lt, p->desc, p->la, p->lb, p->ld,
                                                          p->ld, pref, 1, &res, &found);
    lt.cublasLtMatmulPreferenceDestroy(pref);
    if (s != CUBLAS_STATUS_SUCCESS || found == 0) {
        plan_free(p);
        return false;
    }
    p->algo = res.algo;
    p->bias_epilogue = with_bias;
    return true;
}

static gemm_plan *plan_get(fy_cu_stream *cs, const gemm *g, fy_dtype dt) {
    fy_cu_gemm_cache *c = cs->cache;
    size_t es = dt == FY_BF16 ? 2 : 4;
    gemm_key key;
    memset(&key, 0, sizeof key); /* the padding too: keys are compared with memcmp */
    key.dt = dt;
    key.ta = g->ta;
    key.tb = g->tb;
    key.m = g->m;
    key.n = g->n;
    key.k = g->k;
    key.lda = g->lda;
    key.ldb = g->ldb;
    key.ldd = g->ldd;
    key.batch = g->batch;
    key.has_bias = g->bias != NULL;
    key.alA = align_class(g->A, g->lda, g->sA, g->batch, es);
    key.alB = align_class(g->B, g->ldb, g->sB, g->batch, es);
    key.alD = align_class(g->D, g->ldd, g->sD, g->batch, g->d_f32 ? sizeof(float) : es);
    key.d_f32 = g->d_f32;
    key.alBias = g->bias ? align_class(g->bias, 0, 0, 1, es) : 0;
    key.sA = g->batch > 1 ? g->sA : 0;
    key.sB = g->batch > 1 ? g->sB : 0;
    key.sD = g->batch > 1 ? g->sD : 0;
    c->clock++;
    for (int i = 0; i < c->n; i++)
        if (!memcmp(&c->plans[i].key, &key, sizeof key)) {
            c->plans[i].last_use = c->clock;
            return &c->plans[i];
        }
    int slot = c->n;
    if (c->n == CACHE_CAP) { /* evict the least recently used */
        slot = 0;
        for (int i = 1; i < c->n; i++)
            if (c->plans[i].last_use < c->plans[slot].last_use) slot = i;
        plan_free(&c->plans[slot]);
    } else {
        c->n++;
    }
    gemm_plan *p = &c->plans[slot];
    /* most capable first: the bias in the epilogue, then written before the product; then
     * both again claiming only element alignment (always true; fewer, slower algorithms).
     * The choice depends on the key alone, so it is the same for every call. */
    gemm_key weak = key;
    weak.alA = weak.alB = (int)es;
    weak.alD = g->d_f32 ? (int)sizeof(float) : (int)es;
    /* (the bias's alignment is read from its pointer: nothing to weaken) */
    bool ok = plan_build(cs, &key, g->bias, p) || (g->bias && plan_build(cs, &key, NULL, p)) ||
              plan_build(cs, &weak, g->bias, p) || (g->bias && plan_build(cs, &weak, NULL, p));
    p->key = key;
    if (!ok) {
        char hint[200];
        snprintf(hint, sizeof hint, "cuBLASLt has no algorithm for a %s GEMM m=%d n=%d k=%d "
                 "batch=%d (alignment A %d, B %d, D %d bytes)", fy_dtype_name(dt), g->m, g->n,
                 g->k, g->batch, key.alA, key.alB, key.alD);
        fy_abort_at(__FILE__, __LINE__, "an algorithm was found", hint);
    }
    p->last_use = c->clock;
    return p;
}

static void gemm_run(fy_cu_stream *cs, fy_dtype dt, const gemm *g, const char *what) {
    gemm_plan *p = plan_get(cs, g, dt);
    float beta = g->beta;
    if (g->bias && p->bias_epilogue) {
        lt_check(lt.cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                   &g->bias, sizeof g->bias), what);
    } else if (g->bias) {
        FY_ASSERT(g->beta == 0.0f, "a GEMM with a bias overwrites its output");
        fy_cu_bias_fill(cs, dt, g->D, g->bias, g->n, g->m); /* D is (n rows of m) row-major */
        beta = 1.0f;
    }
    lt_check(lt.cublasLtMatmul(cs->lt, p->desc, &g->alpha, g->A, p->la, g->B, p->lb, &beta,
                               g->D, p->ld, g->D, p->ld, &p->algo, cs->blas_ws,
                               FY_CU_BLAS_WS_NBYTES, cs->st), what);
}

/* ---- the ops ------------------------------------------------------------------------ */

static void *at(const void *base, int64_t nelem, fy_dtype dt) {
    return (char *)base + nelem * (dt == FY_BF16 ? 2 : 4);
}

/* out (N,OC) = inp (N,C) @ w^T + bias; column-major: out^T = w^T' inp^T with A = w. */
static void matmul_fwd(fy_cu_stream *cs, const fy_op *op, fy_dtype dt) {
    int N = (int)op->i[0], C = (int)op->i[1], OC = (int)op->i[2];
    gemm g = {.ta = true, .tb = false, .m = OC, .n = N, .k = C, .A = op->p[2], .lda = C,
              .B = op->p[1], .ldb = C, .D = op->p[0], .ldd = OC, .batch = 1, .alpha = 1.0f,
              .beta = 0.0f, .bias = op->p[3]};
    gemm_run(cs, dt, &g, "matmul_fwd");
}

/* MATMUL_BWD (dinp, dw, dbias, dout, inp, w) and MATMUL_BWD_DX32 (dinp32, dw, dout, inp,
 * w: no bias, dinp fp32 whatever the storage type and accumulated), as the op table lists
 * them. */
static void matmul_bwd(fy_cu_stream *cs, const fy_op *op, fy_dtype dt) {
    const bool dx32 = op->kind == FY_OP_MATMUL_BWD_DX32;
    const int o = dx32 ? -1 : 0; /* DX32 has no dbias: its later arguments sit one lower */
    void *dinp = op->p[0], *dw = op->p[1], *dbias = dx32 ? NULL : op->p[2];
    const void *dout = op->p[3 + o], *inp = op->p[4 + o], *w = op->p[5 + o];
    int N = (int)op->i[0], C = (int)op->i[1], OC = (int)op->i[2];
    if (dinp) { /* dinp (N,C) = (or +=) dout @ w; column-major dinp^T = w^T dout^T */
        gemm g = {.ta = false, .tb = false, .m = C, .n = N, .k = OC, .A = w, .lda = C,
                  .B = dout, .ldb = OC, .D = dinp, .ldd = C, .batch = 1, .alpha = 1.0f,
                  .beta = dx32 ? 1.0f : 0.0f, .d_f32 = dx32};
        gemm_run(cs, dt, &g, "matmul_bwd (dinp)");
    }
    /* dw (OC,C) += dout^T @ inp; column-major dw^T += inp^T dout */
    gemm g = {.ta = false, .tb = true, .m = C, .n = OC, .k = N, .A = inp, .lda = C,
              .B = dout, .ldb = OC, .D = dw, .ldd = C, .batch = 1, .alpha = 1.0f, .beta = 1.0f};
    gemm_run(cs, dt, &g, "matmul_bwd (dw)");
    if (dbias) fy_cu_colsum_acc(cs, dt, dbias, dout, N, OC);
}

void fy_cu_exec_gemm_op(fy_cu_stream *cs, const fy_op *op) {
    fy_dtype dt = op->dt == FY_BF16 ? FY_BF16 : FY_F32;
    switch (op->kind) {
    case FY_OP_MATMUL_FWD: matmul_fwd(cs, op, dt); break;
    case FY_OP_MATMUL_BWD: case FY_OP_MATMUL_BWD_DX32: matmul_bwd(cs, op, dt); break;
    default: FY_ASSERT(0, "not a GEMM op");
    }
}

fy_status fy_cu_gemm_stream_init(fy_cu_stream *cs) {
    FY_TRY(fy_cu_blas_load());
    cs->cache = calloc(1, sizeof *cs->cache);
    if (!cs->cache) return FY_ERR_NOMEM;
    cublasLtHandle_t h;
    cublasStatus_t s = lt.cublasLtCreate(&h);
    if (s != CUBLAS_STATUS_SUCCESS) {
        fy_log_error("cuda: cannot create a cuBLASLt handle: %s", lt.cublasLtGetStatusString(s));
        free(cs->cache);
        cs->cache = NULL;
        return FY_ERR_DEVICE;
    }
    cs->lt = h;
    return FY_OK;
}

void fy_cu_gemm_stream_free(fy_cu_stream *cs) {
    if (cs->cache) {
        for (int i = 0; i < cs->cache->n; i++) plan_free(&cs->cache->plans[i]);
        free(cs->cache);
        cs->cache = NULL;
    }
    if (cs->lt) lt.cublasLtDestroy((cublasLtHandle_t)cs->lt);
    cs->lt = NULL;
}
