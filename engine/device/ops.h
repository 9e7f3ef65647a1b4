/* ops.h — the op table: every kernel's arguments, in launcher order, with their roles,
 * types and sizes. One source for the launchers' packing (kernels.c checks each launch
 * against it), for every backend's unpacking (the cpu backend's dispatch table, the cuda
 * backend's switches) and for the bf16 widening (cpu/cpu_bf16.c widens and narrows
 * exactly the storage-typed tensors the table lists, by the sizes it gives). Adding an op
 * touches this table, the kernel (launcher and backends) and its test. Included by
 * device_impl.h only.
 *
 * FY_KERNEL_OPS(X): X(NAME, nint, nflt, args), args a list of
 *   A(name, role, type, size)   a tensor argument
 *   AO(name, role, type, size)  one that may be NULL (then skipped)
 * role IN, OUT (overwritten) or INOUT (read and updated: accumulators);
 * type S (the stream's storage type), F32, F64, I32, or D1 / D2 (the fy_dtype given by
 * integer argument 1 / 2: AdamW's gradient and copy out);
 * size a code of fy_op_size (ops.c computes it from the integer arguments). */
#ifndef FY_OPS_H
#define FY_OPS_H

#include <stddef.h>
#include <stdint.h>

#include "engine/core/dtype.h"
#include "engine/device/rope.h"

/* Sizes in elements, from the integer arguments i[]:
 *   N0 = i0, NC = i0*i1, C = i1, NOC = i0*i2, OCC = i2*i1, OC = i2, N2C = 2*i0*i1,
 *   BT = i0*i1, BTC = i0*i1*i2, TC = i1*i2, VC = i3*i2 (the embedding's V rows),
 *   NVP = i0*i2 (N rows of Vp), ONE = 1, NCH = the norm chunks of i0 elements
 *   (core/reduce.h: ceil(i0 / FY_SUMSQ_CHUNK));
 *   attention's, with i = (B, T, NH, NKV, hd): QKV = B*T*(NH+2*NKV)*hd (the packed q, k
 *   and v rows), BTQ = B*T*NH*hd, BHT = B*NH*T (a value per query row);
 *   the per-head norms', with i = (N, NH, NKV, hd): NW = N*(NH+2*NKV)*hd (packed rows),
 *   NQK = N*(NH+NKV) (a value per query and key head), HD = hd */
#define FY_OP_SIZES(X) X(N0) X(NC) X(C) X(NOC) X(OCC) X(OC) X(N2C) X(BT) X(BTC) X(TC) X(VC) \
                       X(NVP) X(ONE) X(NCH) X(QKV) X(BTQ) X(BHT) \
                       X(NW) X(NQK) X(HD)

#define FY_KERNEL_OPS(X)                                                                       \
    X(ENCODER_FWD, 4, 1, /* i: B, T, C, V; f: the embedding's scale */                          \
      A(out, OUT, S, BTC) A(tokens, IN, I32, BT) A(wte, IN, S, VC) AO(wpe, IN, S, TC)            \
      AO(docs, IN, I32, BT))                                                                   \
    X(ENCODER_BWD, 4, 1,                                                                       \
      A(dwte, INOUT, S, VC) AO(dwpe, INOUT, S, TC) A(dout, IN, S, BTC) A(tokens, IN, I32, BT)    \
      AO(docs, IN, I32, BT))                                                                   \
    X(LAYERNORM_FWD, 2, 0, /* i: N, C */                                                       \
      A(out, OUT, S, NC) A(mean, OUT, F32, N0) A(rstd, OUT, F32, N0) A(inp, IN, S, NC)           \
      A(w, IN, S, C) A(b, IN, S, C))                                                           \
    X(LAYERNORM_BWD, 2, 0,                                                                     \
      A(dinp, INOUT, S, NC) A(dw, INOUT, S, C) A(db, INOUT, S, C) A(dout, IN, S, NC)             \
      A(inp, IN, S, NC) A(w, IN, S, C) A(mean, IN, F32, N0) A(rstd, IN, F32, N0))                \
    X(RMSNORM_FWD, 2, 2, /* i: N, C; f: eps, the gain's offset */                              \
      A(out, OUT, S, NC) A(rstd, OUT, F32, N0) A(inp, IN, S, NC) A(w, IN, S, C))                 \
    X(RMSNORM_BWD, 2, 1, /* f: the gain's offset */                                            \
      A(dinp, INOUT, S, NC) A(dw, INOUT, S, C) A(dout, IN, S, NC) A(inp, IN, S, NC)              \
      A(w, IN, S, C) A(rstd, IN, F32, N0))                                                     \
    X(QK_NORM_FWD, 4, 2, /* i: N, NH, NKV, hd; f: eps, the gains' offset */                    \
      A(out, OUT, S, NW) A(rstd, OUT, F32, NQK) A(inp, IN, S, NW) A(wq, IN, S, HD)               \
      A(wk, IN, S, HD))                                                                        \
    X(QK_NORM_BWD, 4, 1, /* f: the gains' offset; dinp may be dout */                          \
      A(dinp, OUT, S, NW) A(dwq, INOUT, S, HD) A(dwk, INOUT, S, HD) A(dout, IN, S, NW)           \
      A(inp, IN, S, NW) A(wq, IN, S, HD) A(wk, IN, S, HD) A(rstd, IN, F32, NQK))                 \
    X(MATMUL_FWD, 3, 0, /* i: N, C, OC */                                                      \
      A(out, OUT, S, NOC) A(inp, IN, S, NC) A(w, IN, S, OCC) AO(bias, IN, S, OC))                \
    X(MATMUL_BWD, 3, 0,                                                                        \
      AO(dinp, OUT, S, NC) A(dw, INOUT, S, OCC) AO(dbias, INOUT, S, OC) A(dout, IN, S, NOC)      \
      A(inp, IN, S, NC) A(w, IN, S, OCC))                                                      \
    X(MATMUL_BWD_DX32, 3, 0, /* dinp fp32 and accumulated whatever the storage type */        \
      A(dinp, INOUT, F32, NC) A(dw, INOUT, S, OCC) A(dout, IN, S, NOC) A(inp, IN, S, NC)         \
      A(w, IN, S, OCC))                                                                        \
    X(ADD_F32, 1, 0, A(dst, INOUT, S, N0) A(src, IN, F32, N0))                                 \
    X(ATTENTION_FWD, 6, 2, /* i: B, T, NH, NKV, hd, window; f: scale, softcap */               \
      A(out, OUT, S, BTQ) A(lse, OUT, F32, BHT) A(qkv, IN, S, QKV) AO(docs, IN, I32, BT))        \
    X(ATTENTION_BWD, 6, 2,                                                                     \
      A(dqkv, OUT, S, QKV) A(delta, OUT, F32, BHT) A(dout, IN, S, BTQ) A(qkv, IN, S, QKV)        \
      A(out, IN, S, BTQ) A(lse, IN, F32, BHT) AO(docs, IN, I32, BT))                             \
    X(ROPE, 8, 6 + FY_ROPE_MAX_PAIRS, /* i: B, T, NH, NKV, hd, inverse, type, d (rotated      \
      channels); f: theta, factor, low, high, orig, attn_factor, ext[FY_ROPE_MAX_PAIRS]    \
      (fy_op_rope) */                                                                      \
      A(qkv, INOUT, S, QKV) AO(docs, IN, I32, BT))                                             \
    X(GELU_FWD, 1, 0, A(out, OUT, S, N0) A(inp, IN, S, N0))                                    \
    X(GELU_BWD, 1, 0, A(dinp, OUT, S, N0) A(inp, IN, S, N0) A(dout, IN, S, N0))                \
    X(GLU_FWD, 3, 0, /* i: N, F, activation (fy_glu_act) */                                    \
      A(out, OUT, S, NC) A(gu, IN, S, N2C))                                                    \
    X(GLU_BWD, 3, 0, A(dgu, OUT, S, N2C) A(gu, IN, S, N2C) A(dout, IN, S, NC))                 \
    X(RESIDUAL_FWD, 1, 0, A(out, OUT, S, N0) A(a, IN, S, N0) A(b, IN, S, N0))                  \
    X(CROSSENTROPY, 3, 2, /* i: N, V, Vp; f: dloss, softcap */                                 \
      A(losses, OUT, F32, N0) A(logits, INOUT, S, NVP) A(targets, IN, I32, N0))                  \
    X(CE_CHUNK_FWD, 4, 1, /* i: N, v0, nv, V; f: softcap */                                    \
      A(logits, IN, S, NOC) A(targets, IN, I32, N0) A(max, INOUT, F32, N0)                       \
      A(sum, INOUT, F64, N0) A(tlogit, INOUT, F32, N0) A(losses, INOUT, F32, N0))                \
    X(CE_CHUNK_BWD, 4, 2, /* i: N, v0, nv, V; f: dloss, softcap */                             \
      A(logits, INOUT, S, NOC) A(targets, IN, I32, N0) A(max, IN, F32, N0) A(sum, IN, F64, N0))  \
    X(MEAN, 2, 0, /* i: n, the divisor */                                                      \
      A(out, OUT, F32, ONE) A(x, IN, F32, N0))                                     \
    X(SUMSQ, 1, 0, A(out, OUT, F64, ONE) A(x, IN, S, N0))                                      \
    X(SUMSQ_PARTS, 1, 0, A(out, OUT, F64, NCH) A(x, IN, S, N0))                                \
    X(ADAMW, 5, 6, /* i: n, grad type, out type, decay, step; f: lr, b1, b2, eps, wd, scale */ \
      A(param, INOUT, F32, N0) A(m, INOUT, F32, N0) A(v, INOUT, F32, N0) A(grad, IN, D1, N0)     \
      AO(param_out, OUT, D2, N0))

/* Stream operations: not kernels, no table entry (device.c and the backends). */
#define FY_STREAM_OPS(X) X(COPY) X(MEMSET) X(HOST_FN) X(EVENT_RECORD) X(EVENT_WAIT)

typedef enum fy_op_kind {
#define FY_OP_ENUM_K(name, ...) FY_OP_##name,
#define FY_OP_ENUM_S(name) FY_OP_##name,
    FY_KERNEL_OPS(FY_OP_ENUM_K)
    FY_STREAM_OPS(FY_OP_ENUM_S)
#undef FY_OP_ENUM_K
#undef FY_OP_ENUM_S
    FY_OP_COUNT
} fy_op_kind;

#define FY_OP_KERNELS FY_OP_COPY /* kinds below it are kernels */

typedef enum fy_op_size {
#define FY_OP_SIZE_ENUM(name) FY_SZ_##name,
    FY_OP_SIZES(FY_OP_SIZE_ENUM)
#undef FY_OP_SIZE_ENUM
} fy_op_size;

typedef enum fy_arg_role { FY_ARG_IN = 1, FY_ARG_OUT = 2, FY_ARG_INOUT = 3 } fy_arg_role;
typedef enum fy_arg_type {
    FY_ARG_S = 0, FY_ARG_F32, FY_ARG_F64, FY_ARG_I32, FY_ARG_D1, FY_ARG_D2
} fy_arg_type;

#define FY_OP_MAX_ARGS 8
#define FY_OP_MAX_INT 8
#define FY_OP_MAX_FLT (8 + FY_ROPE_MAX_PAIRS) /* the rope's per-pair factors */

typedef struct fy_op_arg {
    const char *name;
    fy_arg_role role;
    fy_arg_type type;
    fy_op_size size;
    int optional;
} fy_op_arg;

typedef struct fy_op_desc {
    const char *name;
    int nint, nflt;                 /* integer and float arguments */
    fy_op_arg args[FY_OP_MAX_ARGS]; /* the tensor arguments: fy_op_nargs of them */
} fy_op_desc;

/* The descriptor of a kernel op (kind < FY_OP_KERNELS) and its tensor arguments' count. */
const fy_op_desc *fy_op_desc_of(fy_op_kind kind);
int fy_op_nargs(fy_op_kind kind);
const char *fy_op_name(fy_op_kind k);

#endif
