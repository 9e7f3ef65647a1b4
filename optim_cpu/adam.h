/* adam.h — AdamW on host memory (pure host code; depends on engine/core only).
 *
 * One call updates one contiguous range of a block: fp32 master weights, first and
 * second moments, gradients in fp32/bf16/fp16, and optionally writes the updated
 * weights out again in bf16/fp16/fp32 in the same pass.
 *
 * Semantics are PyTorch's torch.optim.AdamW: bias-corrected moments, eps added after the
 * square root of the corrected second moment, decoupled weight decay applied to the
 * weight before the Adam update (w *= 1 - lr*wd), only on ranges with decay set.
 *
 * Arithmetic contract (the invariance depends on it): every code path computes each
 * element with the same sequence of IEEE operations as fy_adam_step_ref(), so results are
 * bit-identical whatever the path, the split into ranges, tiles or threads:
 *     g  = grad * grad_scale
 *     w  = decay ? w * decay_mul : w            decay_mul = 1 - lr*wd   (fp32)
 *     m  = fmaf(beta1, m, omb1 * g)             omb1 = 1 - beta1
 *     v  = fmaf(beta2, v, (omb2 * g) * g)       omb2 = 1 - beta2
 *     d  = fmaf(sqrtf(v), rsbc2, eps)           rsbc2 = 1 / sqrt(1 - beta2^step)
 *     w  = fmaf(-step_size, m / d, w)           step_size = lr / (1 - beta1^step)
 * The per-step scalars are computed once in double by fy_adam_consts() and rounded
 * to fp32. */
#ifndef FY_ADAM_H
#define FY_ADAM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/core/dtype.h"
#include "engine/core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fy_adam_hparams {
    float lr, beta1, beta2, eps, weight_decay;
    int64_t step;      /* 1-based count of updates including this one (bias correction) */
    float grad_scale;  /* gradients are multiplied by this first (clip coef, 1/loss scale) */
    bool check_finite; /* if set, a non-finite scaled gradient skips the whole range */
} fy_adam_hparams;

/* The fp32 scalars every path uses; derived from fy_adam_hparams. */
typedef struct fy_adam_consts {
    float grad_scale, decay_mul, beta1, omb1, beta2, omb2, rsbc2, eps, neg_step_size;
} fy_adam_consts;

typedef struct fy_adam_range {
    float *param;            /* (n) fp32 master weights, updated (written) */
    float *m, *v;            /* (n) moments, updated (written) */
    const float *src_param;  /* (n) the state read, when it is elsewhere (an out-of-place */
    const float *src_m;      /* update: the speculative step writes beside the state it */
    const float *src_v;      /* keeps, engine/step_run.c); NULL: param, m, v (in place).
                                Each or none; the arithmetic is the in-place update's */
    const void *grad;        /* (n) gradients of type grad_dtype (F32, BF16 or F16) */
    fy_dtype grad_dtype;
    void *param_out;         /* (n) optional copy of the updated weights, or NULL; may be
                                grad itself when the types match (every implementation
                                reads an element's gradient before it writes its weight) */
    fy_dtype out_dtype;      /* F32, BF16 or F16 when param_out is set */
    size_t n;
    bool decay;              /* apply weight decay to this range */
} fy_adam_range;

void fy_adam_consts_init(const fy_adam_hparams *hp, bool decay, fy_adam_consts *out);

/* The scalar reference path. Returns FY_ERR_NONFINITE (writing nothing) when
 * hp->check_finite is set and a scaled gradient is NaN or Inf; FY_OK otherwise. */
fy_status fy_adam_step_ref(const fy_adam_hparams *hp, const fy_adam_range *r);

/* The fastest path this CPU supports (chosen at run time), single-threaded,
 * same contract and bit-identical results as fy_adam_step_ref. Returns FY_ERR_INVALID
 * (logged) for an unknown grad_dtype/out_dtype or NULL arrays with n > 0. */
fy_status fy_adam_step(const fy_adam_hparams *hp, const fy_adam_range *r);

/* ---- code paths ------------------------------------------------------------------
 * Every path gives the bits of fy_adam_step_ref (NaN payloads aside: where two
 * different NaNs meet in one operation the payload kept may differ; a NaN stays NaN).
 *   SCALAR      the reference, portable C
 *   AVX2        AVX2 + FMA + F16C, 8 lanes
 *   AVX512      AVX-512 F/BW/VL/DQ, 16 lanes, bf16 rounding by integer arithmetic
 *   AVX512_BF16 as AVX512, bf16 rounding by vcvtneps2bf16 (AVX512-BF16), with the
 *               integer sequence for vectors holding denormals (the instruction
 *               flushes them; fy_f32_to_bf16 rounds them) */
typedef enum fy_adam_path {
    FY_ADAM_PATH_AUTO = 0, /* the best supported path */
    FY_ADAM_PATH_SCALAR,
    FY_ADAM_PATH_AVX2,
    FY_ADAM_PATH_AVX512,
    FY_ADAM_PATH_AVX512_BF16,
    FY_ADAM_PATH_COUNT
} fy_adam_path;

/* Whether this build and this CPU can run path p (AUTO and SCALAR always can). */
bool fy_adam_path_supported(fy_adam_path p);
/* The path AUTO resolves to: the widest supported one. */
fy_adam_path fy_adam_path_best(void);
/* "auto", "scalar", "avx2", "avx512", "avx512bf16". */
const char *fy_adam_path_name(fy_adam_path p);
/* Parses the names above; returns -1 if unknown. */
int fy_adam_path_parse(const char *s, fy_adam_path *out);

/* fy_adam_step on an explicit path. FY_ERR_UNSUPPORTED (logged) if this CPU or build
 * lacks it; otherwise as fy_adam_step. */
fy_status fy_adam_step_path(fy_adam_path p, const fy_adam_hparams *hp, const fy_adam_range *r);

/* FY_OK if every scaled gradient grad[i] * hp->grad_scale of r is finite, else
 * FY_ERR_NONFINITE (not logged: the caller decides whether a skipped step is news).
 * Ignores hp->check_finite. Reads only r->grad. */
fy_status fy_adam_grads_finite(fy_adam_path p, const fy_adam_hparams *hp, const fy_adam_range *r);

/* ---- tiles: bounded units of work for a scheduler ---------------------------------
 * A range is cut into tiles of FY_ADAM_TILE_NELEM elements (the last one shorter).
 * 256 Ki elements: 1 MiB per fp32 array, about 7 MiB of memory traffic per tile with
 * bf16 gradients in and a bf16 copy out, 0.1-0.2 ms for one thread at memory bandwidth:
 * small enough that a scheduler can update tile k while the gradients of tile k+1
 * (512 KiB in bf16, ~20 us of PCIe 4) are in flight and no lane waits long behind one,
 * large enough that a call costs nothing measurable (a kernel call is ~100 ns; the
 * streams stay long for the prefetchers). A multiple of 64 elements, so tiles of a
 * 64-byte aligned range start 64-byte aligned for every element type.
 * fy_adam_step_tile() runs a tile on the calling thread (a scheduler's own CPU workers);
 * the pool splits each call across its threads and pays a wake-up and a join per call
 * (10-40 us on the reference VM), so hand the pool several tiles at once
 * (bench/RESULTS.md has the numbers). */
#define FY_ADAM_TILE_NELEM ((size_t)1 << 18)

static inline size_t fy_adam_ntiles(size_t n) {
    return (n + FY_ADAM_TILE_NELEM - 1) / FY_ADAM_TILE_NELEM;
}

/* *out = the view of elements [lo, hi) of r (pointers offset; nothing copied).
 * Requires lo <= hi <= r->n. */
void fy_adam_range_slice(const fy_adam_range *r, size_t lo, size_t hi, fy_adam_range *out);

/* fy_adam_step on tile `tile` of r (elements [tile*FY_ADAM_TILE_NELEM, ...)), on the
 * calling thread. check_finite covers that tile only: a caller that wants a whole-range
 * skip checks fy_adam_grads_finite() first. Requires tile < fy_adam_ntiles(r->n). */
fy_status fy_adam_step_tile(const fy_adam_hparams *hp, const fy_adam_range *r, size_t tile);

#ifdef __cplusplus
}
#endif
#endif
