/* cpu_bf16.c — bf16 storage on the cpu backend, so the data path the GPU runs in bf16
 * can be exercised (and its tests run) on a machine without one.
 *
 * A kernel on a bf16 stream reads and writes bf16 tensors and computes in fp32: each
 * tensor argument is widened into an fp32 temporary, the fp32 kernel runs on the
 * temporaries, and the outputs are rounded back to bf16 (round to nearest even). This is
 * the storage type's meaning, "fp32 arithmetic, bf16 at rest": results may differ in the
 * last bf16 bit from the cuda kernels, which also keep some intermediates (attention's
 * scores) in bf16. The arguments kernels.h keeps in fp32 (norm statistics, losses, the
 * mean, AdamW's state) pass through untouched.
 *
 * The temporaries are allocated per op: this path is for tests and planning, not speed. */
#include <stdlib.h>
#include <string.h>

#include "engine/core/dtype.h"
#include "engine/device/device_impl.h"

enum { IN = 1, OUT = 2, INOUT = IN | OUT };

/* Element counts, from the op's sizes (launcher order, see kernels.c). */
typedef enum { Z_NONE = 0, Z_NC, Z_C, Z_NOC, Z_OCC, Z_OC, Z_BTC, Z_BT3C, Z_BNHTT, Z_N0, Z_NV,
               Z_TC, Z_VC } size_code;

typedef struct targ { int p; int role; size_code size; } targ;

#define MAX_TARGS 6

static const targ *tensor_args(fy_op_kind k) {
    static const targ enc_f[] = {{0, OUT, Z_BTC}, {2, IN, Z_VC}, {3, IN, Z_TC}, {-1, 0, 0}};
    static const targ enc_b[] = {{0, INOUT, Z_VC}, {1, INOUT, Z_TC}, {2, IN, Z_BTC}, {-1, 0, 0}};
    static const targ ln_f[] = {{0, OUT, Z_NC}, {3, IN, Z_NC}, {4, IN, Z_C}, {5, IN, Z_C}, {-1, 0, 0}};
    static const targ ln_b[] = {{0, INOUT, Z_NC}, {1, INOUT, Z_C}, {2, INOUT, Z_C},
                                {3, IN, Z_NC}, {4, IN, Z_NC}, {5, IN, Z_C}, {-1, 0, 0}};
    static const targ mm_f[] = {{0, OUT, Z_NOC}, {1, IN, Z_NC}, {2, IN, Z_OCC}, {3, IN, Z_OC}, {-1, 0, 0}};
    static const targ mm_b[] = {{0, OUT, Z_NC}, {1, INOUT, Z_OCC}, {2, INOUT, Z_OC},
                                {3, IN, Z_NOC}, {4, IN, Z_NC}, {5, IN, Z_OCC}, {-1, 0, 0}};
    static const targ at_f[] = {{0, OUT, Z_BTC}, {1, OUT, Z_BNHTT}, {2, IN, Z_BT3C}, {-1, 0, 0}};
    static const targ at_b[] = {{0, OUT, Z_BT3C}, {1, OUT, Z_BNHTT}, {2, IN, Z_BTC},
                                {3, IN, Z_BT3C}, {4, IN, Z_BNHTT}, {-1, 0, 0}};
    static const targ ge_f[] = {{0, OUT, Z_N0}, {1, IN, Z_N0}, {-1, 0, 0}};
    static const targ two_in[] = {{0, OUT, Z_N0}, {1, IN, Z_N0}, {2, IN, Z_N0}, {-1, 0, 0}};
    static const targ ce[] = {{1, INOUT, Z_NV}, {-1, 0, 0}};
    static const targ ss[] = {{1, IN, Z_N0}, {-1, 0, 0}};
    static const targ add[] = {{0, INOUT, Z_N0}, {-1, 0, 0}}; /* the source is fp32 */
    static const targ none[] = {{-1, 0, 0}};
    switch (k) {
    case FY_OP_ENCODER_FWD: return enc_f;
    case FY_OP_ENCODER_BWD: return enc_b;
    case FY_OP_LAYERNORM_FWD: return ln_f;
    case FY_OP_LAYERNORM_BWD: return ln_b;
    case FY_OP_MATMUL_FWD: return mm_f;
    case FY_OP_MATMUL_BWD: return mm_b;
    case FY_OP_ATTENTION_FWD: return at_f;
    case FY_OP_ATTENTION_BWD: return at_b;
    case FY_OP_GELU_FWD: return ge_f;
    case FY_OP_GELU_BWD: case FY_OP_RESIDUAL_FWD: return two_in;
    case FY_OP_ADD_F32: return add;
    case FY_OP_CROSSENTROPY: return ce;
    case FY_OP_SUMSQ: return ss;
    default: return none; /* mean and AdamW: their tensors have fixed types */
    }
}

static size_t nelem_of(size_code z, const fy_op *op) {
    const int64_t *i = op->i;
    switch (z) {
    case Z_NC: return (size_t)i[0] * (size_t)i[1];
    case Z_C: return (size_t)i[1];
    case Z_NOC: return (size_t)i[0] * (size_t)i[2];
    case Z_OCC: return (size_t)i[2] * (size_t)i[1];
    case Z_OC: return (size_t)i[2];
    case Z_BTC: return (size_t)i[0] * (size_t)i[1] * (size_t)i[2];
    case Z_BT3C: return (size_t)i[0] * (size_t)i[1] * 3 * (size_t)i[2];
    case Z_BNHTT: return (size_t)i[0] * (size_t)i[3] * (size_t)i[1] * (size_t)i[1];
    case Z_N0: return (size_t)i[0];
    case Z_NV: return (size_t)i[0] * (size_t)i[2]; /* N rows of Vp */
    case Z_TC: return (size_t)i[1] * (size_t)i[2];
    case Z_VC: return (size_t)i[3] * (size_t)i[2]; /* the embedding's V rows */
    default: return 0;
    }
}

void fy_cpu_exec_bf16(const fy_op *op) {
    const targ *args = tensor_args(op->kind);
    fy_op wide = *op;
    wide.dt = FY_F32;
    float *tmp[MAX_TARGS] = {0};
    size_t n[MAX_TARGS] = {0};
    /* a matmul backward with an fp32 dw (i[3] set) leaves that argument as it is */
    const int fp32_arg = op->kind == FY_OP_MATMUL_BWD && op->i[3] ? 1 : -1;
    for (int k = 0; args[k].p >= 0; k++) {
        const uint16_t *src = op->p[args[k].p];
        if (!src || args[k].p == fp32_arg) continue; /* optional arguments (bias, dinp, dbias) */
        n[k] = nelem_of(args[k].size, op);
        tmp[k] = malloc((n[k] ? n[k] : 1) * sizeof(float));
        FY_ASSERT(tmp[k], "out of host memory widening a bf16 tensor");
        if (args[k].role & IN)
            fy_bf16_to_f32_n(tmp[k], src, n[k]);
        wide.p[args[k].p] = tmp[k];
    }
    fy_cpu_exec(&wide);
    for (int k = 0; args[k].p >= 0; k++) {
        if (!tmp[k]) continue;
        if (args[k].role & OUT) {
            uint16_t *dst = op->p[args[k].p];
            fy_f32_to_bf16_n(dst, tmp[k], n[k]);
        }
        free(tmp[k]);
    }
}
