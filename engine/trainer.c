/* trainer.c — a trainer's life outside its windows: its layout and storage under the
 * plan (offload/layout.h, storage.h), its streams and optimizer pool, initialising,
 * loading and saving weights. Windows run in step_exec.c; weights, gradients and
 * moments are read back (a sharded job's gathered on rank 0) in trainer_state.c. Every
 * buffer comes from the layout's answer for a state: no code here knows which plan put
 * it where. */
#include "engine/trainer_core.h"

#include <math.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/dtype.h"
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

/* State s of block b (a buffer of its own) from fp32 host values of the whole block:
 * its range, in its dtype, copied to the device or written in host memory. *tmp is
 * scratch kept across calls (the caller frees it). */
static fy_status fill_state(fy_trainer *tr, int b, fy_state s, const float *host, void **tmp) {
    const fy_place *p = fy_layout_state(tr->L, b, s);
    const size_t n = p->hi - p->lo, nbytes = fy_place_nbytes(p);
    void *dst = fy_tr_ptr(tr, b, s);
    if (!nbytes) return FY_OK;
    const float *src = host + p->lo;
    if (p->tier == FY_TIER_DISK) return fy_trainer_disk_state(tr, b, s, (float *)host, true);
    if (p->dtype == FY_F32 && p->tier != FY_TIER_DEVICE) {
        memcpy(dst, src, nbytes);
        return FY_OK;
    }
    if (p->dtype != FY_F32 && p->tier != FY_TIER_DEVICE) {
        fy_f32_to_bf16_n(dst, src, n);
        return FY_OK;
    }
    if (p->dtype != FY_F32) { /* rounded on the host, then copied */
        void *t = realloc(*tmp, nbytes);
        if (!t) return FY_ERR_NOMEM;
        *tmp = t;
        fy_f32_to_bf16_n(t, src, n);
        src = t;
    }
    fy_copy_async(tr->s, dst, src, nbytes, FY_H2D);
    fy_stream_sync(tr->s); /* host and *tmp are reused for the next state */
    return FY_OK;
}

/* Block b's fp32 weights into every buffer the layout keeps of them. */
static fy_status upload_block(fy_trainer *tr, int b, const float *host, void **tmp) {
    static const fy_state weights[] = {FY_STATE_MASTER, FY_STATE_HOST_WEIGHTS, FY_STATE_WEIGHTS};
    for (size_t i = 0; i < sizeof weights / sizeof weights[0]; i++)
        if (fy_layout_owns(tr->L, b, weights[i])) FY_TRY(fill_state(tr, b, weights[i], host, tmp));
    return FY_OK;
}

/* Every block's weights, from w or (w NULL) the seed's initialisation, through one
 * block-sized host buffer. */
static fy_status fill_params(fy_trainer *tr, const fy_weights *w, uint64_t seed) {
    const unsigned errors = fy_log_error_count();
    float *host = malloc(fy_model_max_block_nelem(tr->model) * sizeof *host);
    void *tmp = NULL;
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

/* The plan (a copy of cfg->plan, or all-resident from cfg), checked against the model,
 * the job (world, rank, the step's micro-batches) and the layout under them. */
static fy_status setup(fy_trainer *tr, const fy_trainer_cfg *cfg, fy_layout *L) {
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
    tr->micro_total = cfg->micro_total > 0 ? cfg->micro_total : (int64_t)tr->world * tr->plan.grad_accum;
    tr->micro_first = cfg->micro_total > 0 ? cfg->micro_first : (int64_t)tr->rank * tr->plan.grad_accum;
    return fy_layout_new(tr->model, &tr->plan, cfg->T, !cfg->eval_only, tr->world, tr->rank, L);
}

/* The lanes' streams: compute and the two copy directions, and in a job on a device with
 * collectives the comm lane's (gradients in device memory are summed there, by NCCL;
 * host ones over MPI). */
static fy_status new_streams(fy_trainer *tr) {
    fy_dev *dev = tr->dev;
    if (tr->world > 1 && fy_dev_get_kind(dev) != FY_DEV_CPU) {
        if (!fy_dev_has_collectives(dev)) {
            fy_log_error("data parallel on the %s backend needs its collectives, which it "
                         "lacks", fy_dev_kind_name(fy_dev_get_kind(dev)));
            return FY_ERR_UNSUPPORTED;
        }
        FY_TRY(fy_comm_attach(tr->comm, dev));
        FY_TRY(fy_stream_new(dev, "comm", &tr->s_comm));
    }
    FY_TRY(fy_stream_new(dev, "compute", &tr->s));
    FY_TRY(fy_stream_new(dev, "h2d", &tr->s_h2d));
    return fy_stream_new(dev, "d2h", &tr->s_d2h);
}

/* The optimizer pool, when a block is updated on the CPU. */
static fy_status maybe_pool(fy_trainer *tr) {
    for (int b = 0; b < fy_tr_nblocks(tr) && tr->L->training; b++)
        if (fy_tr_blk(tr, b)->update == FY_UPDATE_CPU) {
            const int at = tr->cfg.adam_threads > 0 ? tr->cfg.adam_threads : fy_dev_threads(tr->dev);
            return new_pool(fy_dev_threads(tr->dev), at, &tr->pool);
        }
    return FY_OK;
}

fy_status fy_trainer_new(fy_dev *dev, const fy_trainer_cfg *cfg, fy_trainer **out) {
    *out = NULL;
    fy_trainer *tr = calloc(1, sizeof *tr);
    if (!tr) return FY_ERR_NOMEM;
    tr->dev = dev;
    fy_layout L = {0};
    fy_status st = setup(tr, cfg, &L);
    if (st == FY_OK) st = new_streams(tr);
    if (st == FY_OK) st = fy_storage_new(dev, &L, cfg->disk_dir, &tr->st);
    fy_layout_free(&L);
    if (st != FY_OK) goto fail;
    tr->L = &tr->st->layout;
    if ((st = fy_exec_init(tr)) != FY_OK ||
        (st = fy_stream_set_dtype(tr->s, fy_tr_dt(tr))) != FY_OK ||
        (tr->s_comm && (st = fy_stream_set_dtype(tr->s_comm, fy_tr_dt(tr))) != FY_OK) ||
        (st = fy_cost_table_init(&tr->costs, fy_tr_nblocks(tr))) != FY_OK ||
        (fy_layout_sharded(tr->L) && (st = fy_trainer_setup_parts(tr)) != FY_OK) ||
        (st = maybe_pool(tr)) != FY_OK ||
        (st = fill_params(tr, cfg->weights, cfg->seed)) != FY_OK)
        goto fail;
    *out = tr;
    return FY_OK;
fail:
    fy_trainer_free(tr);
    return st;
}

void fy_trainer_free(fy_trainer *tr) {
    if (!tr) return;
    if (tr->s) fy_stream_sync(tr->s);
    fy_stream_free(tr->s);
    fy_stream_free(tr->s_h2d);
    fy_stream_free(tr->s_d2h);
    fy_stream_free(tr->s_comm);
    fy_exec_free(&tr->ex);
    fy_storage_free(tr->st);
    fy_adam_pool_free(tr->pool);
    fy_cost_table_free(&tr->costs);
    free(tr->part_region);
    free(tr->part_base);
    fy_plan_free(&tr->plan);
    free(tr);
}

const fy_model *fy_trainer_model(const fy_trainer *tr) { return tr->model; }
const fy_plan *fy_trainer_plan(const fy_trainer *tr) { return &tr->plan; }
const fy_layout *fy_trainer_layout(const fy_trainer *tr) { return tr->L; }
int64_t fy_trainer_steps_done(const fy_trainer *tr) { return tr->steps_done; }
int64_t fy_trainer_micro_done(const fy_trainer *tr) { return tr->micro_base; }
const fy_storage *fy_trainer_storage(const fy_trainer *tr) { return tr->st; }

void fy_trainer_set_progress(fy_trainer *tr, int64_t steps_done, int64_t micro_done) {
    tr->steps_done = steps_done;
    tr->micro_base = micro_done;
}

fy_status fy_trainer_load(fy_trainer *tr, const fy_weights *w) {
    return fill_params(tr, w, 0);
}

static fy_status params_of(void *ctx, int b, float *host) {
    return fy_trainer_get_params(ctx, b, host);
}

fy_status fy_trainer_save(fy_trainer *tr, const char *path, const fy_save_opts *o) {
    return fy_model_save(tr->model, path, o, params_of, tr);
}
