/* cpu_bf16.c — bf16 storage on the cpu backend, so the data path the GPU runs in bf16
 * can be exercised (and its tests run) on a machine without one.
 *
 * A kernel on a bf16 stream reads and writes bf16 tensors and computes in fp32: each
 * tensor argument is widened into an fp32 temporary, the fp32 kernel runs on the
 * temporaries, and the outputs are rounded back to bf16 (round to nearest even). This is
 * the storage type's meaning, "fp32 arithmetic, bf16 at rest": results may differ in the
 * last bf16 bit from the cuda kernels, which also round some intermediates to bf16
 * (attention's probabilities and score gradients, where they enter the tensor cores). The arguments kernels.h keeps in fp32 (norm statistics, losses, the
 * mean, AdamW's state) pass through untouched. Which arguments are tensors of the storage
 * type, whether they are read or written, and how many elements they hold: the op table
 * (ops.h).
 *
 * The temporaries are allocated per op: this path is for tests and planning, not speed. */
#include <stdlib.h>
#include <string.h>

#include "engine/core/dtype.h"
#include "engine/device/device_impl.h"

void fy_cpu_exec_bf16(const fy_op *op) {
    const int n = fy_op_nargs(op->kind);
    const fy_op_desc *d = fy_op_desc_of(op->kind);
    fy_op wide = *op;
    wide.dt = FY_F32;
    float *tmp[FY_OP_MAX_ARGS] = {0};
    size_t len[FY_OP_MAX_ARGS] = {0};
    for (int k = 0; k < n; k++) {
        const uint16_t *src = op->p[k];
        /* only the storage-typed tensors: the others have their own fixed types */
        if (!src || d->args[k].type != FY_ARG_S) continue;
        len[k] = fy_op_arg_nelem(op, k);
        tmp[k] = malloc((len[k] ? len[k] : 1) * sizeof(float));
        FY_ASSERT(tmp[k], "out of host memory widening a bf16 tensor");
        if (d->args[k].role & FY_ARG_IN) fy_bf16_to_f32_n(tmp[k], src, len[k]);
        wide.p[k] = tmp[k];
    }
    fy_cpu_exec(&wide);
    for (int k = 0; k < n; k++) {
        if (!tmp[k]) continue;
        if (d->args[k].role & FY_ARG_OUT) fy_f32_to_bf16_n(op->p[k], tmp[k], len[k]);
        free(tmp[k]);
    }
}
