/* trainer.c — a trainer's life outside its windows: building its storage under the plan
 * (offload/storage.c), initialising, loading and saving weights, reading parameters and
 * gradients back. Training and evaluation run as task graphs on the scheduler
 * (step_graph.c). */
#include "engine/trainer_impl.h"

#include <math.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/dtype.h"
#include "engine/core/reduce.h"
#include "engine/device/kernels.h"

/* ---- construction ------------------------------------------------------------------ */

/* The optimizer pool pins its threads within its creator's affinity mask: when there are
 * cores enough, create it from a mask without the first compute_threads cores, so the
 * CPU optimizer and the compute lane do not share cores. */
static fy_status new_pool(int compute_threads, int adam_threads, fy_adam_pool **out) {
    cpu_set_t old, set;
    bool narrowed = false;
    if (sched_getaffinity(0, sizeof old, &old) == 0 &&
        CPU_COUNT(&old) >= compute_threads + adam_threads) {
        CPU_ZERO(&set);
        int seen = 0;
        for (int c = 0; c < CPU_SETSIZE; c++)
            if (CPU_ISSET(c, &old) && seen++ >= compute_threads) CPU_SET(c, &set);
        narrowed = sched_setaffinity(0, sizeof set, &set) == 0;
    }
    fy_status st = fy_adam_pool_new(adam_threads, out);
    if (narrowed) sched_setaffinity(0, sizeof old, &old);
    return st;
}

/* Every copy of the parameters from fp32 host blocks: masters as they are, the storage
 * type's copies rounded to it. */
/* Block b's fp32 parameters into every copy the plan keeps of them; *tmp is bf16
 * scratch kept across calls (the caller frees it). */
static fy_status upload_block(fy_trainer *tr, int b, const float *host, uint16_t **tmp) {
    const fy_chunk *c = &tr->st->chunks[b];
    const size_t shard = (c->hi - c->lo) * sizeof(float); /* masters apart: their shard */
    if (c->param_host && c->apart) memcpy(c->param_host, host + c->lo, shard);
    else if (c->param_host) memcpy(c->param_host, host, fy_tr_master_nbytes(tr, b));
    if (c->master_dev) fy_copy_async(tr->s, c->master_dev, host + c->lo, shard, FY_H2D);
    if (!fy_tr_lp(tr)) {
        if (c->param_lp && c->param_lp != c->param_host) /* an fp32 copy apart (storage.h) */
            memcpy(c->param_lp, host, fy_tr_nbytes(tr, b));
        if (c->param_dev) fy_copy_async(tr->s, c->param_dev, host, fy_tr_nbytes(tr, b), FY_H2D);
        fy_stream_sync(tr->s); /* host is reused for the next block */
        return FY_OK;
    }
    if (c->param_lp) fy_f32_to_bf16_n((uint16_t *)c->param_lp, host, c->nelem);
    fy_stream_sync(tr->s);
    if (!c->param_dev) return FY_OK;
    uint16_t *t = realloc(*tmp, fy_tr_nbytes(tr, b));
    if (!t) return FY_ERR_NOMEM;
    *tmp = t;
    fy_f32_to_bf16_n(t, host, c->nelem);
    fy_copy_async(tr->s, c->param_dev, t, fy_tr_nbytes(tr, b), FY_H2D);
    fy_stream_sync(tr->s);
    return FY_OK;
}

/* Every block's parameters, from w or (w NULL) the seed's initialisation, through one
 * block-sized host buffer. */
static fy_status fill_params(fy_trainer *tr, const fy_weights *w, uint64_t seed) {
    const unsigned errors = fy_log_error_count();
    float *host = malloc(fy_model_max_block_nelem(tr->model) * sizeof *host);
    uint16_t *tmp = NULL;
    fy_status st = host ? FY_OK : FY_ERR_NOMEM;
    if (st == FY_OK && w) st = fy_model_check_weights(tr->model, w);
    for (int b = 0; b < fy_tr_nblocks(tr) && st == FY_OK; b++) {
        if (w) st = fy_model_load_block(tr->model, w, b, host);
        else fy_model_init_block(tr->model, b, seed, host);
        if (st == FY_OK) st = upload_block(tr, b, host, &tmp);
    }
    if (st == FY_ERR_NOMEM && fy_log_error_count() == errors)
        fy_log_error("out of host memory filling the parameters");
    free(host);
    free(tmp);
    return st;
}

fy_status fy_trainer_setup_plan(fy_trainer *tr, const fy_trainer_cfg *cfg) {
    tr->cfg = *cfg;
    tr->cfg.plan = NULL;
    tr->model = cfg->model;
    FY_ASSERT(tr->model, "a trainer needs a model");
    if (cfg->plan) FY_TRY(fy_plan_check(cfg->plan, tr->model));
    FY_TRY(cfg->plan ? fy_plan_copy(cfg->plan, &tr->plan)
                     : fy_plan_new(tr->model, cfg->B, cfg->grad_accum > 0 ? cfg->grad_accum : 1,
                                   &tr->plan));
    tr->cfg.B = tr->plan.micro_batch;
    tr->cfg.grad_accum = tr->plan.grad_accum;
    tr->comm = cfg->comm;
    tr->world = cfg->comm ? fy_comm_size(cfg->comm) : 1;
    tr->rank = cfg->comm ? fy_comm_rank(cfg->comm) : 0;
    if (!cfg->comm && cfg->plan_ranks > 1) { /* planning a job's step (trainer.h) */
        if (cfg->plan_ranks > FY_MAX_SHARDS) {
            fy_log_error("a job of %d ranks: at most %d", cfg->plan_ranks, FY_MAX_SHARDS);
            return FY_ERR_INVALID;
        }
        tr->world = cfg->plan_ranks;
        tr->rank = -1; /* the plan's shard: each block's largest (plan.h) */
    }
    tr->micro_total = cfg->micro_total > 0 ? cfg->micro_total : (int64_t)tr->world * tr->plan.grad_accum;
    tr->micro_first = cfg->micro_total > 0 ? cfg->micro_first
                                           : (int64_t)(tr->rank > 0 ? tr->rank : 0) * tr->plan.grad_accum;
    if (tr->world > 1 && !cfg->eval_only) { /* ZeRO: this rank holds its shard (storage.h) */
        tr->plan.shards = tr->world;
        tr->plan.shard = tr->rank;
    }
    return FY_OK;
}

/* Where each rank's norm chunk sums go (trainer_impl.h: part_region, part_base). */
static fy_status setup_parts(fy_trainer *tr) {
    const int nb = fy_tr_nblocks(tr), W = tr->world;
    tr->part_region = calloc((size_t)W + 1, sizeof *tr->part_region);
    tr->part_base = calloc((size_t)nb, sizeof *tr->part_base);
    if (!tr->part_region || !tr->part_base) return FY_ERR_NOMEM;
    for (int r = 0; r < W; r++) {
        size_t n = 0;
        for (int b = 0; b < nb; b++) {
            if (r == tr->rank) tr->part_base[b] = n;
            n += fy_shard_nchunks(tr->st->chunks[b].nelem, W, r);
        }
        tr->part_region[r + 1] = tr->part_region[r] + n;
    }
    FY_ASSERT(tr->part_region[W] == tr->st->nparts, "every chunk sum has its place");
    return FY_OK;
}

fy_status fy_trainer_new(fy_dev *dev, const fy_trainer_cfg *cfg, fy_trainer **out) {
    *out = NULL;
    fy_trainer *tr = calloc(1, sizeof *tr);
    if (!tr) return FY_ERR_NOMEM;
    tr->dev = dev;
    fy_status st = fy_trainer_setup_plan(tr, cfg);
    if (st != FY_OK) goto fail;
    if (tr->world > 1 && fy_dev_get_kind(dev) != FY_DEV_CPU) {
        /* gradients in device memory are summed by the device's collectives (NCCL) on a
         * stream of the comm lane; host ones over MPI */
        if (!fy_dev_has_collectives(dev)) {
            fy_log_error("data parallel on the %s backend needs its collectives, which it "
                         "lacks", fy_dev_kind_name(fy_dev_get_kind(dev)));
            st = FY_ERR_UNSUPPORTED;
            goto fail;
        }
        if ((st = fy_comm_attach(cfg->comm, dev)) != FY_OK ||
            (st = fy_stream_new(dev, "comm", &tr->s_comm)) != FY_OK)
            goto fail;
    }
    if ((st = fy_stream_new(dev, "compute", &tr->s)) != FY_OK ||
        (st = fy_stream_new(dev, "h2d", &tr->s_h2d)) != FY_OK ||
        (st = fy_stream_new(dev, "d2h", &tr->s_d2h)) != FY_OK)
        goto fail;
    if ((st = fy_storage_new(dev, tr->model, &tr->plan, cfg->T, !cfg->eval_only, &tr->st)) != FY_OK ||
        (st = fy_stream_set_dtype(tr->s, fy_tr_dt(tr))) != FY_OK ||
        (tr->s_comm && (st = fy_stream_set_dtype(tr->s_comm, fy_tr_dt(tr))) != FY_OK) ||
        (st = fy_event_new_timed(dev, &tr->ev_anchor)) != FY_OK)
        goto fail;
    tr->cost_ms = calloc((size_t)FY_T_COUNT * (fy_tr_nblocks(tr) + 1) * 2, sizeof *tr->cost_ms);
    if (!tr->cost_ms) { st = FY_ERR_NOMEM; goto fail; }
    if (tr->plan.shards > 1 && (st = setup_parts(tr)) != FY_OK) goto fail;
    for (int b = 0; b < fy_tr_nblocks(tr) && !cfg->eval_only; b++)
        if (fy_tr_cpu_optim(tr, b)) {
            int at = cfg->adam_threads > 0 ? cfg->adam_threads : fy_dev_threads(dev);
            if ((st = new_pool(fy_dev_threads(dev), at, &tr->pool)) != FY_OK) goto fail;
            break;
        }
    if ((st = fill_params(tr, cfg->weights, cfg->seed)) != FY_OK) goto fail;
    *out = tr;
    return FY_OK;
fail:
    fy_trainer_free(tr);
    return st;
}

fy_status fy_trainer_new_dry(const fy_trainer_cfg *cfg, fy_trainer **out) {
    *out = NULL;
    fy_trainer *tr = calloc(1, sizeof *tr);
    if (!tr) return FY_ERR_NOMEM;
    fy_status st = fy_trainer_setup_plan(tr, cfg);
    if (st == FY_OK) st = fy_storage_dry(tr->model, &tr->plan, cfg->T, true, &tr->st);
    if (st == FY_OK) {
        tr->cost_ms = calloc((size_t)FY_T_COUNT * (fy_tr_nblocks(tr) + 1) * 2, sizeof *tr->cost_ms);
        if (!tr->cost_ms) st = FY_ERR_NOMEM;
    }
    if (st != FY_OK) {
        fy_trainer_free(tr);
        return st;
    }
    *out = tr;
    return FY_OK;
}

void fy_trainer_free(fy_trainer *tr) {
    if (!tr) return;
    if (tr->s) fy_stream_sync(tr->s);
    fy_stream_free(tr->s);
    fy_stream_free(tr->s_h2d);
    fy_stream_free(tr->s_d2h);
    fy_stream_free(tr->s_comm);
    fy_trainer_graph_free(tr);
    fy_event_free(tr->ev_anchor);
    fy_storage_free(tr->st);
    fy_adam_pool_free(tr->pool);
    free(tr->cost_ms);
    free(tr->part_region);
    free(tr->part_base);
    fy_plan_free(&tr->plan);
    free(tr);
}

const fy_model *fy_trainer_model(const fy_trainer *tr) { return tr->model; }
const fy_plan *fy_trainer_plan(const fy_trainer *tr) { return &tr->plan; }
int64_t fy_trainer_steps_done(const fy_trainer *tr) { return tr->steps_done; }
int64_t fy_trainer_micro_done(const fy_trainer *tr) { return tr->micro_base; }
const fy_storage *fy_trainer_storage(const fy_trainer *tr) { return tr->st; }

fy_status fy_trainer_load(fy_trainer *tr, const fy_weights *w) {
    return fill_params(tr, w, 0);
}

static fy_status params_of(void *ctx, int b, float *host) {
    fy_trainer_get_params(ctx, b, host);
    return FY_OK;
}

fy_status fy_trainer_save(fy_trainer *tr, const char *path, const fy_save_opts *o) {
    return fy_model_save(tr->model, path, o, params_of, tr);
}

/* Block b's buffer of the storage type (in host memory, or on the device) into fp32
 * host memory. */
static void read_widened(fy_trainer *tr, float *host, const void *src, bool src_on_host, int b) {
    const size_t n = fy_tr_block(tr, b)->nelem;
    /* bf16 lands in the back half and is widened in place: host holds n floats, the bf16
     * copy 2n bytes, and host[i] (bytes 4i..4i+3) never overtakes lo[i] (2n + 2i) */
    void *dst = fy_tr_lp(tr) ? (void *)((uint16_t *)host + n) : (void *)host;
    if (src_on_host) {
        memcpy(dst, src, fy_tr_nbytes(tr, b));
    } else {
        fy_copy_async(tr->s, dst, src, fy_tr_nbytes(tr, b), FY_D2H);
        fy_stream_sync(tr->s);
    }
    if (fy_tr_lp(tr)) fy_bf16_to_f32_n(host, dst, n);
}

/* ---- a sharded job's state, gathered on rank 0 ---------------------------------------- */

/* What rank 0 asks the serving ranks for (fy_trainer_serve): */
enum { SERVE_END = 0, SERVE_PARAMS, SERVE_M, SERVE_V };

static bool sharded(const fy_trainer *tr) { return tr->plan.shards > 1; }

/* Whether block b's fp32 master is held in shards (masters apart, storage.h); else it
 * is the whole fp32 weights, current on every rank. */
static bool master_sharded(const fy_trainer *tr, int b) {
    const fy_chunk *c = &tr->st->chunks[b];
    return sharded(tr) && c->apart &&
           (c->param_host || (!fy_tr_cpu_optim(tr, b) && !fy_tr_streamed(tr, b)));
}

/* This rank's shard of block b's `what` (fp32, hi - lo elements) in host memory: the
 * host buffer itself, or a device one's copy in *tmp. */
static const float *shard_on_host(fy_trainer *tr, int b, int what, float **tmp) {
    const fy_chunk *c = &tr->st->chunks[b];
    const float *src = what == SERVE_M ? c->m : what == SERVE_V ? c->v
                       : c->param_host ? c->param_host : c->master_dev;
    const bool on_dev = what == SERVE_PARAMS ? !c->param_host : !fy_tr_cpu_optim(tr, b);
    const size_t nbytes = (c->hi - c->lo) * sizeof(float);
    fy_stream_sync(tr->s);
    if (!on_dev || !nbytes) return src;
    float *t = realloc(*tmp, nbytes);
    FY_ASSERT(t, "out of host memory gathering a block's shards");
    *tmp = t;
    fy_copy_async(tr->s, t, src, nbytes, FY_D2H);
    fy_stream_sync(tr->s);
    return t;
}

/* Block b's `what` gathered into rank 0's whole (the others pass NULL): each rank sends
 * its shard (through *tmp when it is in device memory). */
static fy_status gather_block(fy_trainer *tr, int b, int what, float *whole, float **tmp) {
    size_t off[FY_MAX_SHARDS + 1];
    fy_tr_shards(tr, b, off);
    return fy_comm_gather(tr->comm, whole, shard_on_host(tr, b, what, tmp), off, sizeof(float));
}

/* Rank 0: block b's `what` whole into host, its shards from their owners, who serve. A
 * job whose collectives fail is ended (comm.h). */
static void gather_shards(fy_trainer *tr, int b, int what, float *host) {
    FY_ASSERT(tr->rank == 0, "rank 0 gathers a sharded job's state; the others serve it");
    int64_t req[2] = {what, b};
    float *tmp = NULL;
    fy_status st = fy_comm_bcast(tr->comm, req, sizeof req);
    if (st == FY_OK) st = gather_block(tr, b, what, host, &tmp);
    free(tmp);
    if (st != FY_OK) fy_comm_abort(tr->comm, 1);
}

fy_status fy_trainer_serve(fy_trainer *tr) {
    if (!sharded(tr) || tr->rank == 0) return FY_OK;
    float *tmp = NULL;
    fy_status st;
    for (;;) {
        int64_t req[2];
        fy_comm_patient(tr->comm, true); /* rank 0 may write for long between requests */
        st = fy_comm_bcast(tr->comm, req, sizeof req);
        fy_comm_patient(tr->comm, false);
        if (st != FY_OK) break;
        if (req[0] == SERVE_END) { /* req[1]: rank 0's save failed (it said why) */
            st = req[1] ? FY_ERR_IO : FY_OK;
            break;
        }
        const int b = (int)req[1];
        FY_ASSERT(b >= 0 && b < fy_tr_nblocks(tr) && req[0] <= SERVE_V, "a request for a block");
        if ((st = gather_block(tr, b, (int)req[0], NULL, &tmp)) != FY_OK) break;
    }
    free(tmp);
    return st;
}

fy_status fy_trainer_serve_end(fy_trainer *tr, bool failed) {
    if (!sharded(tr) || tr->rank != 0) return FY_OK;
    int64_t req[2] = {SERVE_END, failed};
    return fy_comm_bcast(tr->comm, req, sizeof req);
}

void fy_trainer_get_params(fy_trainer *tr, int b, float *host) {
    const fy_chunk *c = &tr->st->chunks[b];
    fy_stream_sync(tr->s);
    if (master_sharded(tr, b)) {
        gather_shards(tr, b, SERVE_PARAMS, host);
    } else if (c->param_host) { /* the master */
        memcpy(host, c->param_host, fy_tr_master_nbytes(tr, b));
    } else if (c->master_dev) {
        fy_copy_async(tr->s, host, c->master_dev, fy_tr_master_nbytes(tr, b), FY_D2H);
        fy_stream_sync(tr->s);
    } else {
        read_widened(tr, host, c->param_dev, false, b);
    }
}

bool fy_trainer_get_grads(fy_trainer *tr, int b, float *host) {
    FY_ASSERT(!tr->cfg.eval_only, "an evaluation-only trainer has no gradients");
    const fy_chunk *c = &tr->st->chunks[b];
    if (c->grad_in_lp) return false;
    fy_stream_sync(tr->s);
    read_widened(tr, host, c->grad_host ? c->grad_host : c->grad_dev, c->grad_host != NULL, b);
    return true;
}


/* A moment buffer (fp32, on the host with the cpu optimizer, else on the device; its
 * shard's elements) to or from host memory. */
static void copy_moment(fy_trainer *tr, int b, void *dst, const void *src, bool to_host) {
    const size_t nb = (tr->st->chunks[b].hi - tr->st->chunks[b].lo) * sizeof(float);
    if (!nb) return; /* an empty shard */
    fy_stream_sync(tr->s);
    if (fy_tr_cpu_optim(tr, b)) {
        memcpy(dst, src, nb);
    } else {
        fy_copy_async(tr->s, dst, src, nb, to_host ? FY_D2H : FY_H2D);
        fy_stream_sync(tr->s);
    }
}

void fy_trainer_get_moments(fy_trainer *tr, int b, float *m, float *v) {
    FY_ASSERT(!tr->cfg.eval_only, "an evaluation-only trainer has no moments");
    const fy_chunk *c = &tr->st->chunks[b];
    if (sharded(tr)) {
        if (m) gather_shards(tr, b, SERVE_M, m);
        if (v) gather_shards(tr, b, SERVE_V, v);
        return;
    }
    if (m) copy_moment(tr, b, m, c->m, true);
    if (v) copy_moment(tr, b, v, c->v, true);
}

/* Whole moments in: this rank keeps its shard. */
void fy_trainer_set_moments(fy_trainer *tr, int b, const float *m, const float *v) {
    FY_ASSERT(!tr->cfg.eval_only, "an evaluation-only trainer has no moments");
    const fy_chunk *c = &tr->st->chunks[b];
    copy_moment(tr, b, c->m, m + c->lo, false);
    copy_moment(tr, b, c->v, v + c->lo, false);
}

void fy_trainer_set_progress(fy_trainer *tr, int64_t steps_done, int64_t micro_done) {
    tr->steps_done = steps_done;
    tr->micro_base = micro_done;
}
