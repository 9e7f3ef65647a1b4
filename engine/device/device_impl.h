/* device_impl.h — what a backend implements; included by backends and device.c only.
 *
 * A device is {iface, ctx}. The wrapper (device.c) owns what every backend shares:
 * the capacity check, the allocation registry and the usage/peak counters. Kernels are
 * described by a fy_op (kind plus pointer, integer and float arguments in launcher order,
 * as the op table in ops.h lists them) and handed to iface->launch; the cpu backend
 * queues the op on the stream's worker, the cuda backend launches it at once. */
#ifndef FY_DEVICE_IMPL_H
#define FY_DEVICE_IMPL_H

#include <pthread.h>
#include <string.h>

#include "engine/device/device.h"

#include "engine/device/ops.h"

typedef struct fy_op {
    fy_op_kind kind;
    void *p[8];    /* pointers, outputs first, in launcher order (ops.h) */
    int64_t i[FY_OP_MAX_INT]; /* sizes and flags, in launcher order */
    float f[FY_OP_MAX_FLT];   /* scalars */
    fy_dtype dt;   /* kernels: the storage type of their tensors (NONE means F32) */
} fy_op;

/* A kernel op from its arguments, checked against the op table (counts; required tensors
 * not NULL): FY_ASSERT on a mismatch, which is a bug in a launcher. */
void fy_op_pack(fy_op *op, fy_op_kind kind, void *const *p, int np, const int64_t *i, int ni,
                const float *f, int nf);
/* Argument k of a kernel op: its size in elements, and its element type (FY_DTYPE_NONE
 * for int32 and double arguments). */
size_t fy_op_arg_nelem(const fy_op *op, int k);
fy_dtype fy_op_arg_dtype(const fy_op *op, int k);

/* The ROPE op's parameters (ops.h's row) as a fy_rope: rot_dim is the rotated channels d
 * and attn_factor the factor itself, as the launcher resolves them (never 0). */
static inline fy_rope fy_op_rope(const fy_op *op) {
    fy_rope r;
    memset(&r, 0, sizeof r);
    r.type = (fy_rope_type)op->i[6];
    r.theta = op->f[0];
    r.factor = op->f[1];
    r.low_freq_factor = op->f[2];
    r.high_freq_factor = op->f[3];
    r.orig_max_pos = op->f[4];
    r.rot_dim = (int)op->i[7];
    r.attn_factor = op->f[5];
    memcpy(r.ext, op->f + 6, sizeof r.ext);
    return r;
}

typedef struct fy_dev_iface {
    const char *name;
    unsigned dtypes;  /* bit 1u << t for each storage type t the kernels take */
    void (*free)(fy_dev *dev);
    fy_status (*alloc)(fy_dev *dev, fy_mem_kind kind, size_t nbytes, void **out);
    void (*release)(fy_dev *dev, fy_mem_kind kind, void *ptr, size_t nbytes);
    fy_status (*stream_new)(fy_stream *s);  /* fills s->ctx */
    void (*stream_free)(fy_stream *s);
    void (*stream_sync)(fy_stream *s);
    void (*launch)(fy_stream *s, const fy_op *op);  /* kernels, copies, memsets, host fns */
    fy_status (*event_new)(fy_event *e);    /* fills e->ctx */
    void (*event_free)(fy_event *e);
    void (*event_record)(fy_event *e, fy_stream *s);
    void (*stream_wait_event)(fy_stream *s, fy_event *e);
    void (*event_sync)(fy_event *e);
    bool (*event_done)(fy_event *e);
    double (*event_elapsed_ms)(fy_event *from, fy_event *to); /* both timed, complete */
    /* collectives between the devices of a job (NULL: none; device.h fy_dev_coll_*) */
    fy_status (*coll_id)(fy_dev *dev, void *id, size_t cap, size_t *len);
    fy_status (*coll_init)(fy_dev *dev, const void *id, size_t len, int rank, int size);
    void (*coll_shards)(fy_stream *s, void *buf, const size_t *off, int nranks, fy_dtype dt,
                        bool gather); /* reduce_scatter, or (gather) allgather */
} fy_dev_iface;

typedef struct fy_alloc_rec {
    void *ptr;
    size_t nbytes;
    fy_mem_kind kind;
} fy_alloc_rec;

struct fy_dev {
    const fy_dev_iface *iface;
    void *ctx;
    fy_dev_cfg cfg;
    char name[96];
    int threads;
    pthread_mutex_t mu;          /* guards the registry and counters */
    fy_alloc_rec *recs;
    size_t nrecs, caprecs;
    fy_dev_mem_stats mem;
};

struct fy_stream {
    fy_dev *dev;
    void *ctx;
    char name[32];
    fy_dtype dtype;  /* kernels' storage type */
};

struct fy_event {
    fy_dev *dev;
    void *ctx;
    bool timed;      /* created by fy_event_new_timed */
};

/* A device built by init (a backend constructor, below, or a test's: the CPU emulation
 * of the cuda kernels wraps the cpu backend's), with cfg's budget; no kind checks. */
fy_status fy_dev_new_with(const fy_dev_cfg *cfg, fy_status (*init)(fy_dev *dev), fy_dev **out);

/* Backend constructors: fill dev->iface, dev->ctx, dev->name, dev->threads. */
fy_status fy_cpu_dev_init(fy_dev *dev);
fy_status fy_cuda_dev_init(fy_dev *dev);     /* cuda/cuda_backend.c, if compiled */
int fy_cuda_gpus(fy_gpu_info *out, int max, char *why, size_t whylen);

/* Host memory for the backends: an anonymous mapping, huge-page advised, every page
 * touched by `threads` threads (zeroed); FY_ERR_NOMEM if the mapping fails. */
fy_status fy_host_map(size_t nbytes, int threads, void **out);
void fy_host_unmap(void *p, size_t nbytes);

/* The cpu backend's kernel bodies, also used by tests as the oracle (fp32), and the
 * same on bf16 tensors: widened to fp32, computed, rounded back (cpu/cpu_bf16.c). */
void fy_cpu_exec(const fy_op *op);
void fy_cpu_exec_bf16(const fy_op *op);
bool fy_cpu_has_kernel(fy_op_kind kind); /* the cpu backend implements this op */

#endif
