/* emu_dev.cc — the emulated cuda device of the kernel tests (emu_dev.h). */
extern "C" {
#include "engine/core/dtype.h"
#include "engine/device/device_impl.h"
}
#include "engine/device/cuda/cuda_impl.h"
#include "tests/cuda_emu/emu_dev.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const fy_dev_iface *cpu_iface;
static fy_dev_iface emu_iface;

extern "C" bool fy_emu_dev_emulates(int kind) {
    switch (kind) {
    case FY_OP_MATMUL_FWD: case FY_OP_MATMUL_BWD: case FY_OP_MATMUL_BWD_DX32:
        return false; /* cuda_gemm.c: cuBLASLt */
    default:
        return kind < FY_OP_KERNELS;
    }
}

/* The cuda backend's abort on a failed launch: cuda_backend.c's where the build has the
 * cuda backend, else this one (weak). */
extern "C" __attribute__((weak)) void fy_cuda_fail(cudaError_t err, const char *what, const char *file, int line) {
    fprintf(stderr, "cuda emulation: %s failed at %s:%d: %s\n", what, file, line,
            cudaGetErrorString(err));
    abort();
}

/* A stream's reduction partials, per OS thread (each cpu stream has its worker), freed
 * with the thread. */
struct emu_stream {
    fy_cu_stream cs;
    emu_stream() { memset(&cs, 0, sizeof cs); }
    ~emu_stream() { free(cs.part); }
};
static thread_local emu_stream tl_cs;

static void exec_once(const fy_op *op) {
    if (!tl_cs.cs.part) {
        tl_cs.cs.part = (float *)malloc(FY_CU_PART_NBYTES);
        if (!tl_cs.cs.part) abort();
    }
    fy_cu_exec_kernel(&tl_cs.cs, op);
}

/* Bytes of tensor argument k. */
static size_t arg_nbytes(const fy_op *op, int k) {
    const fy_op_arg *a = &fy_op_desc_of(op->kind)->args[k];
    size_t es = a->type == FY_ARG_I32 ? 4 : a->type == FY_ARG_F64 ? 8
                                          : fy_dtype_size(fy_op_arg_dtype(op, k));
    return fy_op_arg_nelem(op, k) * es;
}

static void run_op(void *op) { exec_once((const fy_op *)op); }

/* The op three times from the same inputs (see emu_dev.h). */
static void exec_checked(const fy_op *op) {
    const fy_op_desc *d = fy_op_desc_of(op->kind);
    fy_emu_buf bufs[FY_OP_MAX_ARGS];
    int n = 0;
    char what[64];
    for (int k = 0; k < fy_op_nargs(op->kind); k++)
        if (op->p[k] && (d->args[k].role & FY_ARG_OUT))
            bufs[n++] = fy_emu_buf{op->p[k], arg_nbytes(op, k), d->args[k].name};
    snprintf(what, sizeof what, "kernel op %s", fy_op_name(op->kind));
    fy_emu_check_orders(what, run_op, (void *)op, bufs, n);
}

struct job { fy_op op; };

static void run_job(void *arg) {
    job *j = (job *)arg;
    exec_checked(&j->op);
    delete j;
}

static void emu_launch(fy_stream *s, const fy_op *op) {
    if (!fy_emu_dev_emulates(op->kind)) {
        cpu_iface->launch(s, op);
        return;
    }
    job *j = new job{*op};
    fy_op h;
    memset(&h, 0, sizeof h);
    h.kind = FY_OP_HOST_FN;
    void (*fn)(void *) = run_job;
    memcpy(&h.p[0], &fn, sizeof fn);
    h.p[1] = j;
    cpu_iface->launch(s, &h);
}

static fy_status emu_init(fy_dev *dev) {
    fy_status st = fy_cpu_dev_init(dev);
    if (st != FY_OK) return st;
    cpu_iface = dev->iface;
    emu_iface = *cpu_iface;
    emu_iface.name = "cuda-emu";
    emu_iface.launch = emu_launch;
    dev->iface = &emu_iface;
    snprintf(dev->name, sizeof dev->name, "cuda kernels emulated on the cpu");
    return FY_OK;
}

extern "C" fy_status fy_emu_dev_new(const fy_dev_cfg *cfg, fy_dev **out) {
    fy_dev_cfg c = *cfg;
    c.kind = FY_DEV_CPU;
    c.matmul = FY_MATMUL_AUTO;
    return fy_dev_new_with(&c, emu_init, out);
}
