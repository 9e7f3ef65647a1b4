/* probe.c — measuring bandwidths, AdamW throughput and block costs (see probe.h). */
#include "tuner/probe.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/core/util.h"
#include "engine/device/kernels.h"
#include "engine/trainer.h"
#include "offload/disk.h"
#include "optim_cpu/adam_pool.h"

#define XFER_BYTES ((size_t)64 << 20)
#define XFER_REPS 3

/* Best-of-reps GB/s of copies of nbytes in dir on s (and, if s2, dir2 on s2 at once). */
static void time_copies(fy_stream *s, void *dst, const void *src, fy_copy_dir dir, fy_stream *s2,
                        void *dst2, const void *src2, fy_copy_dir dir2, size_t nbytes, double *gbps,
                        double *gbps2) {
    double best = 1e30;
    for (int r = 0; r < XFER_REPS; r++) {
        double t0 = fy_now_ms();
        fy_copy_async(s, dst, src, nbytes, dir);
        if (s2) fy_copy_async(s2, dst2, src2, nbytes, dir2);
        fy_stream_sync(s);
        if (s2) fy_stream_sync(s2);
        double ms = fy_now_ms() - t0;
        if (ms < best) best = ms;
    }
    *gbps = (double)nbytes / (best * 1e-3) / 1e9;
    if (gbps2) *gbps2 = *gbps;
}

static fy_status probe_transfers(fy_dev *dev, fy_profile *p) {
    void *d1 = NULL, *d2 = NULL, *h1 = NULL, *h2 = NULL;
    fy_stream *s1 = NULL, *s2 = NULL;
    fy_status st;
    if ((st = fy_dev_alloc(dev, FY_MEM_DEVICE, XFER_BYTES, "probe buffer", &d1)) != FY_OK ||
        (st = fy_dev_alloc(dev, FY_MEM_DEVICE, XFER_BYTES, "probe buffer", &d2)) != FY_OK ||
        (st = fy_dev_alloc(dev, FY_MEM_PINNED, XFER_BYTES, "probe buffer", &h1)) != FY_OK ||
        (st = fy_dev_alloc(dev, FY_MEM_PINNED, XFER_BYTES, "probe buffer", &h2)) != FY_OK ||
        (st = fy_stream_new(dev, "probe1", &s1)) != FY_OK ||
        (st = fy_stream_new(dev, "probe2", &s2)) != FY_OK)
        goto done;
    time_copies(s1, d1, h1, FY_H2D, NULL, NULL, NULL, FY_H2D, XFER_BYTES, &p->h2d_gbps, NULL);
    time_copies(s1, h1, d1, FY_D2H, NULL, NULL, NULL, FY_D2H, XFER_BYTES, &p->d2h_gbps, NULL);
    double both;
    time_copies(s1, d1, h1, FY_H2D, s2, h2, d2, FY_D2H, XFER_BYTES, &both, NULL);
    p->duplex_h2d_gbps = p->duplex_d2h_gbps = both;
    /* latency: the best time of a small copy */
    double best = 1e30;
    for (int r = 0; r < 20; r++) {
        double t0 = fy_now_ms();
        fy_copy_async(s1, d1, h1, 4096, FY_H2D);
        fy_stream_sync(s1);
        double ms = fy_now_ms() - t0;
        if (ms < best) best = ms;
    }
    p->latency_ms = best;
    /* bandwidth over transfer sizes, for the record (the cost model uses latency plus the
     * large-transfer rate) */
    static const double sizes_mib[] = {0.25, 1, 4, 16, 64};
    p->nsizes = 0;
    for (size_t i = 0; i < sizeof sizes_mib / sizeof sizes_mib[0]; i++) {
        size_t nb = (size_t)(sizes_mib[i] * 1048576.0);
        p->size_mib[p->nsizes] = sizes_mib[i];
        time_copies(s1, d1, h1, FY_H2D, NULL, NULL, NULL, FY_H2D, nb, &p->h2d_by_size[p->nsizes], NULL);
        time_copies(s1, h1, d1, FY_D2H, NULL, NULL, NULL, FY_D2H, nb, &p->d2h_by_size[p->nsizes], NULL);
        p->nsizes++;
    }
done:
    fy_stream_free(s1);
    fy_stream_free(s2);
    fy_dev_release(dev, d1);
    fy_dev_release(dev, d2);
    fy_dev_release(dev, h1);
    fy_dev_release(dev, h2);
    return st;
}

static fy_status probe_adam(int max_threads, fy_profile *p) {
    const size_t n = (size_t)8 << 20;
    p->adam_threads_max = max_threads;
    for (int t = 1; t <= max_threads; t++) {
        fy_adam_pool *pool;
        FY_TRY(fy_adam_pool_new(t, &pool));
        float *w = NULL, *m = NULL, *v = NULL, *g = NULL;
        fy_status st = FY_OK;
        if ((st = fy_adam_mem_alloc(pool, n * 4, (void **)&w)) != FY_OK ||
            (st = fy_adam_mem_alloc(pool, n * 4, (void **)&m)) != FY_OK ||
            (st = fy_adam_mem_alloc(pool, n * 4, (void **)&v)) != FY_OK ||
            (st = fy_adam_mem_alloc(pool, n * 4, (void **)&g)) != FY_OK) {
            fy_adam_mem_free(w, n * 4);
            fy_adam_mem_free(m, n * 4);
            fy_adam_mem_free(v, n * 4);
            fy_adam_pool_free(pool);
            return st;
        }
        fy_adam_hparams hp = {.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
                              .weight_decay = 0.1f, .step = 1, .grad_scale = 1.0f};
        fy_adam_range r = {.param = w, .m = m, .v = v, .grad = g, .grad_dtype = FY_F32, .n = n,
                           .decay = true};
        double best = 1e30;
        for (int rep = 0; rep < 4; rep++) {
            double t0 = fy_now_ms();
            fy_adam_pool_step(pool, &hp, &r);
            double ms = fy_now_ms() - t0;
            if (rep && ms < best) best = ms; /* the first run warms */
        }
        p->adam_gparams[t] = (double)n / (best * 1e-3) / 1e9;
        fy_adam_mem_free(w, n * 4);
        fy_adam_mem_free(m, n * 4);
        fy_adam_mem_free(v, n * 4);
        fy_adam_mem_free(g, n * 4);
        fy_adam_pool_free(pool);
    }
    return FY_OK;
}

/* A fixed batch of valid token ids. */
static fy_status zero_batch(void *ctx, int64_t micro, int32_t *x, int32_t *y, int32_t *docs) {
    const size_t *n = ctx; /* [0] tokens, [1] vocabulary */
    (void)micro, (void)docs;
    for (size_t i = 0; i < n[0]; i++) x[i] = y[i] = (int32_t)(i % 200 % n[1]);
    return FY_OK;
}

/* Per task kind and block kind, the mean measured cost of a few serial steps at
 * micro-batch B. */
static fy_status block_costs(fy_dev *dev, const fy_probe_cfg *cfg, int B,
                             double cost[FY_T_COUNT][FY_BLOCK_KINDS]) {
    const fy_model *m = cfg->model;
    fy_plan plan;
    FY_TRY(fy_plan_new(m, B, 1, &plan));
    fy_status st = fy_plan_shorthands(&plan, 0, 0, fy_model_layers(m)); /* every layer recomputed */
    plan.dtype = cfg->dtype == FY_BF16 ? FY_BF16 : FY_F32; /* blocks cost what training runs */
    fy_trainer_cfg tc = {.model = m, .T = cfg->seq, .beta1 = 0.9f, .beta2 = 0.95f,
                         .eps = 1e-8f, .weight_decay = 0.1f, .clip = 1.0f, .seed = 1,
                         .plan = &plan, .schedule = FY_SCHED_SERIAL};
    fy_trainer *tr = NULL;
    if (st == FY_OK) st = fy_trainer_new(dev, &tc, &tr);
    enum { STEPS = 3 };
    float lrs[STEPS] = {1e-4f, 1e-4f, 1e-4f};
    fy_step_stats stats[STEPS];
    size_t n[2] = {(size_t)B * cfg->seq, (size_t)fy_model_vocab(m)};
    fy_window warm = {.nsteps = 1, .lrs = lrs, .next_batch = zero_batch, .batch_ctx = n,
                      .stats = stats};
    fy_window timed = warm;
    timed.nsteps = STEPS;
    /* one step to warm up (first touches, BLAS set-up), then the measured ones */
    if (st == FY_OK) st = fy_trainer_run(tr, &warm);
    if (st == FY_OK) fy_trainer_reset_costs(tr);
    if (st == FY_OK) st = fy_trainer_run(tr, &timed);
    if (st == FY_OK) {
        static const int kinds[] = {FY_T_FWD, FY_T_RECOMPUTE, FY_T_BWD, FY_T_HEAD, FY_T_ADAM_GPU};
        for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
            int k = kinds[i];
            double sum[FY_BLOCK_KINDS] = {0};
            int cnt[FY_BLOCK_KINDS] = {0};
            for (int b = 0; b < fy_model_nblocks(m); b++) {
                double ms = fy_trainer_cost(tr, (fy_task_kind)k, b);
                if (ms < 0) continue;
                int c = fy_model_block(m, b)->kind;
                sum[c] += ms;
                cnt[c]++;
            }
            for (int c = 0; c < FY_BLOCK_KINDS; c++) cost[k][c] = cnt[c] ? sum[c] / cnt[c] : 0.0;
        }
    }
    fy_trainer_free(tr);
    fy_plan_free(&plan);
    return st;
}

static int count_numa_nodes(void) {
    DIR *d = opendir("/sys/devices/system/node");
    if (!d) return 1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (!strncmp(e->d_name, "node", 4) && e->d_name[4] >= '0' && e->d_name[4] <= '9') n++;
    closedir(d);
    return n ? n : 1;
}

/* The collectives between a job's ranks (probe.h): the best of COLL_REPS of a
 * reduce-scatter and an all-gather at two sizes, every rank together, fitted as
 * latency + moved bytes / bandwidth; through the backend comm gives buffers of buf's
 * memory (co: the device's collectives on device memory, queued on s; else MPI). */
#define COLL_REPS 5
static fy_status time_collectives(fy_comm *comm, fy_coll co, fy_stream *s, void *buf, double *gbps,
                                  double *latency_ms) {
    const int N = fy_comm_size(comm);
    const size_t sizes[2] = {(size_t)64 << 10, (size_t)32 << 20}; /* bytes, fp32 */
    double t[2] = {1e30, 1e30};
    fy_status st = FY_OK;
    for (int k = 0; k < 2 && st == FY_OK; k++) {
        size_t off[FY_MAX_SHARDS + 1];
        fy_shard_bounds(sizes[k] / sizeof(float), N, off);
        if (s) {
            fy_memset_async(s, buf, 0, sizes[k]);
            fy_stream_sync(s);
        } else {
            memset(buf, 0, sizes[k]);
        }
        for (int r = 0; r < COLL_REPS && st == FY_OK; r++) {
            int32_t sync = 0;
            if ((st = fy_comm_max_i32(comm, &sync)) != FY_OK) break; /* start together */
            const double t0 = fy_now_ms();
            if ((st = fy_coll_reduce_scatter(co, s, buf, off, FY_F32)) != FY_OK ||
                (st = fy_coll_allgather(co, s, buf, off, FY_F32)) != FY_OK)
                break;
            if (co.iface->queued) fy_stream_sync(s);
            const double ms = (fy_now_ms() - t0) / 2.0; /* one collective */
            if (ms < t[k]) t[k] = ms;
        }
    }
    if (st != FY_OK) return st;
    const double moved[2] = {(double)sizes[0] * (N - 1) / N, (double)sizes[1] * (N - 1) / N};
    const double dt = t[1] - t[0] > 1e-6 ? t[1] - t[0] : 1e-6;
    *gbps = (moved[1] - moved[0]) / (dt * 1e-3) / 1e9;
    *latency_ms = t[0] - moved[0] / (*gbps * 1e9) * 1e3;
    if (*latency_ms < 0) *latency_ms = 0;
    return FY_OK;
}

static fy_status probe_collectives(fy_dev *dev, fy_comm *comm, fy_profile *p) {
    const size_t nbytes = (size_t)32 << 20;
    void *dbuf = NULL, *hbuf = NULL;
    fy_stream *s = NULL;
    /* host memory's path, then device memory's where comm gives it another backend */
    const fy_coll host = fy_comm_coll(comm, dev, FY_MEM_HOST), devc = fy_comm_coll(comm, dev, FY_MEM_DEVICE);
    const bool on_dev = devc.iface != host.iface;
    fy_status st = fy_dev_alloc(dev, FY_MEM_PINNED, nbytes, "probe collectives", &hbuf);
    if (st == FY_OK) st = time_collectives(comm, host, NULL, hbuf, &p->coll_host_gbps, &p->coll_host_latency_ms);
    if (st == FY_OK && on_dev) {
        if ((st = fy_dev_alloc(dev, FY_MEM_DEVICE, nbytes, "probe collectives", &dbuf)) == FY_OK &&
            (st = fy_comm_attach(comm, dev)) == FY_OK && (st = fy_stream_new(dev, "probe comm", &s)) == FY_OK)
            st = time_collectives(comm, devc, s, dbuf, &p->coll_gbps, &p->coll_latency_ms);
    } else if (st == FY_OK) { /* the cpu backend: device memory is host memory, one path */
        p->coll_gbps = p->coll_host_gbps;
        p->coll_latency_ms = p->coll_host_latency_ms;
    }
    if (st == FY_OK) {
        p->coll_ranks = fy_comm_size(comm);
        snprintf(p->coll_source, sizeof p->coll_source, "ferry probe: %d ranks, %s", p->coll_ranks,
                 on_dev ? "the device's collectives and MPI over host memory" : "MPI over host memory");
    }
    fy_stream_free(s);
    if (dbuf) fy_dev_release(dev, dbuf);
    if (hbuf) fy_dev_release(dev, hbuf);
    return st;
}

/* The disk tier's drive: fy_disk_bench in cfg->disk_dir at the queue depth runs use. */
static fy_status probe_disk(const fy_probe_cfg *cfg, fy_profile *p) {
    const size_t nbytes = cfg->disk_nbytes ? cfg->disk_nbytes : (size_t)1 << 30;
    FY_TRY(fy_disk_bench(cfg->disk_dir, nbytes, FY_DISK_QDEPTH, &p->disk_write_gbps,
                         &p->disk_read_gbps));
    p->disk_qdepth = FY_DISK_QDEPTH;
    char sz[32];
    snprintf(p->disk_source, sizeof p->disk_source, "ferry probe: a %s scratch file in %.160s",
             fy_fmt_size(fy_disk_align_up(nbytes), sz, sizeof sz), cfg->disk_dir);
    return FY_OK;
}

fy_status fy_probe(const fy_probe_cfg *cfg, fy_profile *out) {
    memset(out, 0, sizeof *out);
    /* the device without a cap: the probe measures, the budget is the tuner's business */
    fy_dev_cfg dc = cfg->dev;
    dc.mem_cap_nbytes = 0;
    fy_dev *dev;
    FY_TRY(fy_dev_new(&dc, &dev));
    snprintf(out->name, sizeof out->name, "measured");
    snprintf(out->device, sizeof out->device, "%s", fy_dev_name(dev));
    snprintf(out->source, sizeof out->source, "ferry probe on this machine");
    out->cores = fy_cpus_allowed(); /* a job's rank: its share (comm.h: fy_comm_place) */
    out->numa_nodes = count_numa_nodes();
    out->host_mem_gib = (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGE_SIZE) / 1073741824.0;
    fy_status st = probe_transfers(dev, out);
    if (st == FY_OK && cfg->comm && fy_comm_size(cfg->comm) > 1)
        st = probe_collectives(dev, cfg->comm, out);
    /* the budget asked for; else what the backend can give (a GPU's free memory less its
     * workspace reserve and, in a job, NCCL's buffers, which the collectives' probe has
     * just attached: read after it); the cpu backend has no cap: the host's memory */
    fy_dev_mem_stats ms;
    fy_dev_mem_stats_get(dev, &ms);
    size_t cap = cfg->dev.mem_cap_nbytes ? cfg->dev.mem_cap_nbytes : ms.cap_nbytes;
    if (ms.cap_nbytes && ms.cap_nbytes < cap) cap = ms.cap_nbytes;
    out->device_mem_gib = cap ? (double)cap / 1073741824.0 : out->host_mem_gib;
    int tmax = cfg->adam_threads_max > 0 ? cfg->adam_threads_max : out->cores;
    if (tmax > FY_PROFILE_MAX_THREADS) tmax = FY_PROFILE_MAX_THREADS;
    if (st == FY_OK) st = probe_adam(tmax, out);
    double c1[FY_T_COUNT][FY_BLOCK_KINDS] = {{0}}, c2[FY_T_COUNT][FY_BLOCK_KINDS] = {{0}};
    /* the ends of the search's micro-batches, 1 and --batch (the tuner's are its
     * divisors): the fit interpolates where plans are chosen (1 and 2 for a batch of 1) */
    const int B1 = 1, B2 = cfg->batch > 1 ? cfg->batch : 2;
    bool two = true;
    if (st == FY_OK) st = block_costs(dev, cfg, B1, c1);
    if (st == FY_OK && block_costs(dev, cfg, B2, c2) != FY_OK) {
        /* a second size that does not fit: costs taken as independent of the batch */
        memcpy(c2, c1, sizeof c2);
        two = false;
        fy_log_warn("probe: micro-batch %d does not fit; block costs measured at %d only", B2, B1);
    }
    if (st == FY_OK) {
        out->has_blocks = true;
        fy_model_signature(cfg->model, out->block_model, sizeof out->block_model);
        out->block_seq = cfg->seq;
        out->block_dtype = cfg->dtype == FY_BF16 ? FY_BF16 : FY_F32;
        for (int k = 0; k < FY_T_COUNT; k++)
            for (int c = 0; c < FY_BLOCK_KINDS; c++) {
                double b = (c2[k][c] - c1[k][c]) / (B2 - B1);
                if (b < 0) b = 0; /* noise: never predict less work for more tokens */
                out->block_b[k][c] = b;
                out->block_a[k][c] = c1[k][c] - b * B1;
            }
        /* analytic fallbacks from the same measurements: the effective matmul rate of a
         * layer's forward (its FLOPs from the model) and the memory rate of the device
         * AdamW (28 bytes an element) */
        int layer = -1;
        for (int b = 0; b < fy_model_nblocks(cfg->model) && layer < 0; b++)
            if (fy_model_block(cfg->model, b)->kind == FY_BLOCK_LAYER) layer = b;
        fy_cost fc = {0};
        double P = 0.0;
        const int Bf = two ? B2 : B1; /* the larger size measured: nearer the throughput */
        if (layer >= 0) {
            fy_model_cost(cfg->model, layer, FY_PASS_FWD, Bf, cfg->seq,
                          (double)fy_dtype_size(out->block_dtype), &fc);
            P = (double)fy_model_block(cfg->model, layer)->nelem;
        }
        const double(*cf)[FY_BLOCK_KINDS] = two ? c2 : c1;
        double fwd = cf[FY_T_FWD][FY_BLOCK_LAYER], adam = cf[FY_T_ADAM_GPU][FY_BLOCK_LAYER];
        out->compute_tflops = fwd > 0 && fc.flops > 0 ? fc.flops / (fwd * 1e-3) / 1e12 : 0.1;
        out->device_mem_gbps = adam > 0 && P > 0 ? 28.0 * P / (adam * 1e-3) / 1e9 : 10.0;
    }
    if (st == FY_OK && cfg->disk_dir) st = probe_disk(cfg, out);
    fy_dev_free(dev);
    return st;
}
