/* ops.c — the op table's descriptors (from FY_KERNEL_OPS) and what they compute: an
 * argument's size in elements and its element type for a given op. */
#include "engine/device/device_impl.h"

#include <string.h>

#include "engine/core/reduce.h"

/* The tensor arguments of each op, counted... */
#define A(...) + 1
#define AO(...) + 1
#define NPTR(kind, ni, nf, args) [FY_OP_##kind] = 0 args,
static const int nptrs[FY_OP_KERNELS] = {FY_KERNEL_OPS(NPTR)};
#undef A
#undef AO
#undef NPTR

/* Every op's scalars fit a fy_op. */
#define FITS(kind, ni, nf, args) \
    _Static_assert((ni) <= FY_OP_MAX_INT && (nf) <= FY_OP_MAX_FLT, #kind "'s scalars fit a fy_op");
FY_KERNEL_OPS(FITS)
#undef FITS

/* ... and described. */
#define A(nm, role, type, size) {#nm, FY_ARG_##role, FY_ARG_##type, FY_SZ_##size, 0},
#define AO(nm, role, type, size) {#nm, FY_ARG_##role, FY_ARG_##type, FY_SZ_##size, 1},
#define DESC(kind, ni, nf, args) [FY_OP_##kind] = {#kind, ni, nf, {args}},
static const fy_op_desc descs[FY_OP_KERNELS] = {FY_KERNEL_OPS(DESC)};
#undef A
#undef AO
#undef DESC

static const char *stream_names[] = {
#define FY_OP_NAME_S(name) #name,
    FY_STREAM_OPS(FY_OP_NAME_S)
#undef FY_OP_NAME_S
};

const fy_op_desc *fy_op_desc_of(fy_op_kind kind) {
    FY_ASSERT(kind < FY_OP_KERNELS, "only kernels have descriptors");
    return &descs[kind];
}

int fy_op_nargs(fy_op_kind kind) {
    FY_ASSERT(kind < FY_OP_KERNELS, "only kernels have descriptors");
    return nptrs[kind];
}

const char *fy_op_name(fy_op_kind k) {
    if (k < FY_OP_KERNELS) return descs[k].name;
    return k < FY_OP_COUNT ? stream_names[k - FY_OP_KERNELS] : "?";
}

size_t fy_op_arg_nelem(const fy_op *op, int k) {
    const int64_t *i = op->i;
    const size_t i0 = (size_t)i[0], i1 = (size_t)i[1], i2 = (size_t)i[2], i3 = (size_t)i[3],
                 i4 = (size_t)i[4];
    switch (fy_op_desc_of(op->kind)->args[k].size) {
    case FY_SZ_N0: return i0;
    case FY_SZ_NC: case FY_SZ_BT: return i0 * i1;
    case FY_SZ_C: return i1;
    case FY_SZ_NOC: case FY_SZ_NVP: return i0 * i2;
    case FY_SZ_OCC: case FY_SZ_TC: return i2 * i1;
    case FY_SZ_OC: return i2;
    case FY_SZ_N2C: return 2 * i0 * i1;
    case FY_SZ_BTC: return i0 * i1 * i2;
    case FY_SZ_VC: return i3 * i2;
    case FY_SZ_ONE: return 1;
    case FY_SZ_NCH: return fy_sumsq_nchunks(i0);
    case FY_SZ_QKV: return i0 * i1 * (i2 + 2 * i3) * i4;
    case FY_SZ_BTQ: return i0 * i1 * i2 * i4;
    case FY_SZ_BHT: return i0 * i2 * i1;
    case FY_SZ_NW: return i0 * (i1 + 2 * i2) * i3;
    case FY_SZ_NQK: return i0 * (i1 + i2);
    case FY_SZ_HD: return i3;
    }
    FY_ASSERT(0, "unknown size rule");
    return 0;
}

fy_dtype fy_op_arg_dtype(const fy_op *op, int k) {
    switch (fy_op_desc_of(op->kind)->args[k].type) {
    case FY_ARG_S: return op->dt == FY_DTYPE_NONE ? FY_F32 : op->dt;
    case FY_ARG_F32: return FY_F32;
    case FY_ARG_D1: return (fy_dtype)op->i[1];
    case FY_ARG_D2: return (fy_dtype)op->i[2];
    default: return FY_DTYPE_NONE; /* F64, I32: not storage types */
    }
}

void fy_op_pack(fy_op *op, fy_op_kind kind, void *const *p, int np, const int64_t *i, int ni,
                const float *f, int nf) {
    const fy_op_desc *d = fy_op_desc_of(kind);
    FY_ASSERT(np == nptrs[kind] && ni == d->nint && nf == d->nflt,
              "a launcher packs the arguments the op table lists");
    memset(op, 0, sizeof *op);
    op->kind = kind;
    for (int k = 0; k < np; k++) {
        FY_ASSERT(p[k] || d->args[k].optional, "a tensor argument the op table requires is NULL");
        op->p[k] = p[k];
    }
    for (int k = 0; k < ni; k++) op->i[k] = i[k];
    for (int k = 0; k < nf; k++) op->f[k] = f[k];
}
