/* device.c — the backend-independent half of the device interface: backend selection,
 * the device-memory capacity check, the allocation registry and usage/peak counters,
 * and the thin wrappers that forward streams, events and copies to the backend. */
#include "engine/device/device_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "engine/core/util.h"


bool fy_dev_kind_compiled(fy_dev_kind kind) {
#ifdef FY_HAVE_CUDA
    if (kind == FY_DEV_CUDA) return true;
#endif
    return kind == FY_DEV_CPU;
}

int fy_dev_gpus(fy_gpu_info *out, int max, char *why, size_t whylen) {
#ifdef FY_HAVE_CUDA
    return fy_cuda_gpus(out, max, why, whylen);
#else
    (void)out; (void)max;
    snprintf(why, whylen, "this build has no CUDA backend");
    return 0;
#endif
}

bool fy_dev_cuda_emulated(void) {
#ifdef FY_CUDA_EMULATED
    return true;
#else
    return false;
#endif
}

const char *fy_dev_cuda_version(void) {
#ifdef FY_CUDA_VERSION
    return FY_CUDA_VERSION;
#else
    return "";
#endif
}

static const char *math_names[] = {"auto", "fp32", "tf32", "bf16"};

const char *fy_matmul_math_name(fy_matmul_math m) {
    return (unsigned)m < 4 ? math_names[m] : "?";
}

int fy_matmul_math_parse(const char *s, fy_matmul_math *out) {
    for (int i = 0; i < 4; i++)
        if (!strcmp(s, math_names[i])) { *out = (fy_matmul_math)i; return 0; }
    return -1;
}

fy_status fy_host_map(size_t nbytes, int threads, void **out) {
    size_t len = fy_round_up(nbytes, 4096);
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return FY_ERR_NOMEM;
    if (len >= (2u << 20)) madvise(p, len, MADV_HUGEPAGE);
    /* pre-touch: write every page now, in parallel for big buffers */
    size_t npages = len / 4096;
    #pragma omp parallel for schedule(static) num_threads(threads) if (npages > 4096)
    for (size_t i = 0; i < npages; i++) ((volatile char *)p)[i * 4096] = 0;
    *out = p;
    return FY_OK;
}

void fy_host_unmap(void *p, size_t nbytes) { munmap(p, fy_round_up(nbytes, 4096)); }

size_t fy_dev_cfg_pinned_cap(const fy_dev_cfg *cfg) {
    if (cfg->pinned_cap_nbytes) return cfg->pinned_cap_nbytes;
    return (size_t)sysconf(_SC_PHYS_PAGES) * (size_t)sysconf(_SC_PAGE_SIZE) / 2;
}

size_t fy_dev_pinned_cap(const fy_dev *dev) { return fy_dev_cfg_pinned_cap(&dev->cfg); }

const char *fy_dev_kind_name(fy_dev_kind kind) { return kind == FY_DEV_CUDA ? "cuda" : "cpu"; }

int fy_dev_parse_kind(const char *s, fy_dev_kind *out) {
    if (!strcmp(s, "cpu")) *out = FY_DEV_CPU;
    else if (!strcmp(s, "cuda")) *out = FY_DEV_CUDA;
    else return -1;
    return 0;
}

fy_status fy_dev_new_with(const fy_dev_cfg *cfg, fy_status (*init)(fy_dev *dev), fy_dev **out) {
    *out = NULL;
    fy_dev *dev = calloc(1, sizeof *dev);
    if (!dev) return FY_ERR_NOMEM;
    dev->cfg = *cfg;
    dev->mem.cap_nbytes = cfg->mem_cap_nbytes;
    pthread_mutex_init(&dev->mu, NULL);
    fy_status st = init(dev);
    if (st != FY_OK) {
        pthread_mutex_destroy(&dev->mu);
        free(dev);
        return st;
    }
    *out = dev;
    return FY_OK;
}

fy_status fy_dev_new(const fy_dev_cfg *cfg, fy_dev **out) {
    *out = NULL;
    if (!fy_dev_kind_compiled(cfg->kind)) {
        fy_log_error("--device %s: this build of ferry has no %s backend",
                     fy_dev_kind_name(cfg->kind), fy_dev_kind_name(cfg->kind));
        return FY_ERR_UNSUPPORTED;
    }
    fy_dev *dev = calloc(1, sizeof *dev);
    if (!dev) return FY_ERR_NOMEM;
    dev->cfg = *cfg;
    dev->mem.cap_nbytes = cfg->mem_cap_nbytes;
    pthread_mutex_init(&dev->mu, NULL);
    fy_status st;
    if (cfg->kind == FY_DEV_CUDA) {
#ifdef FY_HAVE_CUDA
        st = fy_cuda_dev_init(dev);
#else
        st = FY_ERR_UNSUPPORTED;
#endif
    } else {
        if (cfg->matmul != FY_MATMUL_AUTO && cfg->matmul != FY_MATMUL_FP32) {
            fy_log_error("--matmul %s: the cpu backend computes GEMMs in fp32 only",
                         fy_matmul_math_name(cfg->matmul));
            st = FY_ERR_INVALID;
        } else {
            st = fy_cpu_dev_init(dev);
        }
    }
    if (st != FY_OK) {
        pthread_mutex_destroy(&dev->mu);
        free(dev);
        return st;
    }
    *out = dev;
    return FY_OK;
}

void fy_dev_free(fy_dev *dev) {
    if (!dev) return;
    while (dev->nrecs > 0) fy_dev_release(dev, dev->recs[dev->nrecs - 1].ptr);
    free(dev->recs);
    dev->iface->free(dev);
    pthread_mutex_destroy(&dev->mu);
    free(dev);
}

fy_dev_kind fy_dev_get_kind(const fy_dev *dev) { return dev->cfg.kind; }
const char *fy_dev_name(const fy_dev *dev) { return dev->name; }
int fy_dev_threads(const fy_dev *dev) { return dev->threads; }

fy_status fy_dev_alloc(fy_dev *dev, fy_mem_kind kind, size_t nbytes, const char *what,
                       void **out) {
    *out = NULL;
    if (nbytes == 0) nbytes = 64;
    char a[32], b[32], c[32], d[32];
    pthread_mutex_lock(&dev->mu);
    size_t used = dev->mem.used_nbytes[kind];
    if (kind == FY_MEM_DEVICE && dev->mem.cap_nbytes && used + nbytes > dev->mem.cap_nbytes) {
        pthread_mutex_unlock(&dev->mu);
        fy_log_error("device memory: %s needs %s but only %s of the %s budget is free "
                     "(short by %s)", what, fy_fmt_size(nbytes, a, sizeof a),
                     fy_fmt_size(dev->mem.cap_nbytes - used, b, sizeof b),
                     fy_fmt_size(dev->mem.cap_nbytes, c, sizeof c),
                     fy_fmt_size(used + nbytes - dev->mem.cap_nbytes, d, sizeof d));
        return FY_ERR_DEVICE_OOM;
    }
    if (dev->nrecs == dev->caprecs) {
        size_t ncap = dev->caprecs ? dev->caprecs * 2 : 64;
        fy_alloc_rec *r = realloc(dev->recs, ncap * sizeof *r);
        if (!r) { pthread_mutex_unlock(&dev->mu); return FY_ERR_NOMEM; }
        dev->recs = r;
        dev->caprecs = ncap;
    }
    /* reserve before allocating so concurrent allocations respect the cap */
    dev->mem.used_nbytes[kind] += nbytes;
    pthread_mutex_unlock(&dev->mu);

    void *p = NULL;
    fy_status st = dev->iface->alloc(dev, kind, nbytes, &p);

    pthread_mutex_lock(&dev->mu);
    if (st != FY_OK) {
        dev->mem.used_nbytes[kind] -= nbytes;
        pthread_mutex_unlock(&dev->mu);
        fy_log_error("%s memory: cannot allocate %s for %s",
                     kind == FY_MEM_DEVICE ? "device" : "host",
                     fy_fmt_size(nbytes, a, sizeof a), what);
        return st;
    }
    dev->recs[dev->nrecs++] = (fy_alloc_rec){p, nbytes, kind};
    if (dev->mem.used_nbytes[kind] > dev->mem.peak_nbytes[kind])
        dev->mem.peak_nbytes[kind] = dev->mem.used_nbytes[kind];
    pthread_mutex_unlock(&dev->mu);
    *out = p;
    return FY_OK;
}

void fy_dev_release(fy_dev *dev, void *ptr) {
    if (!ptr) return;
    pthread_mutex_lock(&dev->mu);
    size_t i = dev->nrecs;
    while (i > 0 && dev->recs[i - 1].ptr != ptr) i--;
    FY_ASSERT(i > 0, "fy_dev_release of a pointer fy_dev_alloc did not return");
    fy_alloc_rec r = dev->recs[i - 1];
    dev->recs[i - 1] = dev->recs[--dev->nrecs];
    dev->mem.used_nbytes[r.kind] -= r.nbytes;
    pthread_mutex_unlock(&dev->mu);
    dev->iface->release(dev, r.kind, r.ptr, r.nbytes);
}

void fy_dev_mem_stats_get(const fy_dev *dev, fy_dev_mem_stats *out) {
    pthread_mutex_lock((pthread_mutex_t *)&dev->mu);
    *out = dev->mem;
    pthread_mutex_unlock((pthread_mutex_t *)&dev->mu);
}

void fy_dev_mem_reset_peak(fy_dev *dev) {
    pthread_mutex_lock(&dev->mu);
    for (int k = 0; k < 3; k++) dev->mem.peak_nbytes[k] = dev->mem.used_nbytes[k];
    pthread_mutex_unlock(&dev->mu);
}

fy_status fy_stream_new(fy_dev *dev, const char *name, fy_stream **out) {
    *out = NULL;
    fy_stream *s = calloc(1, sizeof *s);
    if (!s) return FY_ERR_NOMEM;
    s->dev = dev;
    s->dtype = FY_F32;
    snprintf(s->name, sizeof s->name, "%s", name ? name : "stream");
    fy_status st = dev->iface->stream_new(s);
    if (st != FY_OK) { free(s); return st; }
    *out = s;
    return FY_OK;
}

void fy_stream_free(fy_stream *s) {
    if (!s) return;
    s->dev->iface->stream_free(s);
    free(s);
}

fy_dev *fy_stream_dev(const fy_stream *s) { return s->dev; }

bool fy_dev_has_collectives(const fy_dev *dev) { return dev->iface->coll_init != NULL; }

fy_status fy_dev_coll_id(fy_dev *dev, void *id, size_t cap, size_t *len) {
    FY_ASSERT(dev->iface->coll_id, "a backend without collectives");
    return dev->iface->coll_id(dev, id, cap, len);
}

fy_status fy_dev_coll_init(fy_dev *dev, const void *id, size_t len, int rank, int size) {
    FY_ASSERT(dev->iface->coll_init, "a backend without collectives");
    return dev->iface->coll_init(dev, id, len, rank, size);
}

void fy_coll_reduce_scatter_async(fy_stream *s, void *buf, const size_t *off, int nranks, fy_dtype dt) {
    FY_ASSERT(s->dev->iface->coll_shards, "a backend without collectives");
    s->dev->iface->coll_shards(s, buf, off, nranks, dt, false);
}

void fy_coll_allgather_async(fy_stream *s, void *buf, const size_t *off, int nranks, fy_dtype dt) {
    FY_ASSERT(s->dev->iface->coll_shards, "a backend without collectives");
    s->dev->iface->coll_shards(s, buf, off, nranks, dt, true);
}

fy_status fy_stream_set_dtype(fy_stream *s, fy_dtype t) {
    if (t == FY_DTYPE_NONE) t = FY_F32;
    if (!(s->dev->iface->dtypes & (1u << t))) {
        fy_log_error("the %s backend has no %s kernels", s->dev->iface->name, fy_dtype_name(t));
        return FY_ERR_UNSUPPORTED;
    }
    s->dtype = t;
    return FY_OK;
}

fy_dtype fy_stream_dtype(const fy_stream *s) { return s->dtype; }
void fy_stream_sync(fy_stream *s) { s->dev->iface->stream_sync(s); }

static fy_status event_new(fy_dev *dev, bool timed, fy_event **out) {
    *out = NULL;
    fy_event *e = calloc(1, sizeof *e);
    if (!e) return FY_ERR_NOMEM;
    e->dev = dev;
    e->timed = timed;
    fy_status st = dev->iface->event_new(e);
    if (st != FY_OK) { free(e); return st; }
    *out = e;
    return FY_OK;
}

fy_status fy_event_new(fy_dev *dev, fy_event **out) { return event_new(dev, false, out); }
fy_status fy_event_new_timed(fy_dev *dev, fy_event **out) { return event_new(dev, true, out); }

double fy_event_elapsed_ms(fy_event *from, fy_event *to) {
    FY_ASSERT(from->timed && to->timed, "fy_event_elapsed_ms needs timed events");
    return from->dev->iface->event_elapsed_ms(from, to);
}

void fy_event_free(fy_event *e) {
    if (!e) return;
    e->dev->iface->event_free(e);
    free(e);
}

void fy_event_record(fy_event *e, fy_stream *s) { s->dev->iface->event_record(e, s); }
void fy_stream_wait_event(fy_stream *s, fy_event *e) { s->dev->iface->stream_wait_event(s, e); }
void fy_event_sync(fy_event *e) { e->dev->iface->event_sync(e); }
bool fy_event_done(fy_event *e) { return e->dev->iface->event_done(e); }

void fy_copy_async(fy_stream *s, void *dst, const void *src, size_t nbytes, fy_copy_dir dir) {
    if (nbytes == 0) return;
    fy_op op = {.kind = FY_OP_COPY, .p = {dst, (void *)src}, .i = {(int64_t)nbytes, dir}};
    s->dev->iface->launch(s, &op);
}

void fy_memset_async(fy_stream *s, void *dst, int byte, size_t nbytes) {
    if (nbytes == 0) return;
    fy_op op = {.kind = FY_OP_MEMSET, .p = {dst}, .i = {(int64_t)nbytes, byte}};
    s->dev->iface->launch(s, &op);
}

void fy_stream_host_fn(fy_stream *s, void (*fn)(void *arg), void *arg) {
    fy_op op = {.kind = FY_OP_HOST_FN, .p = {NULL, arg}};
    memcpy(&op.p[0], &fn, sizeof fn);
    s->dev->iface->launch(s, &op);
}
