/* trainer.c — a trainer's life outside the step: building its storage under the plan
 * (offload/storage.c), initialising, loading and saving weights, reading parameters and
 * gradients back, and evaluation (a serial forward pass on the compute stream). The
 * training step itself is a task graph run by the scheduler (step_graph.c). */
#include "engine/trainer_impl.h"

#include <math.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/dtype.h"
#include "engine/core/reduce.h"
#include "engine/device/kernels.h"
#include "engine/model/gpt2_io.h"

/* Block b's parameters on the device: resident, or copied into a staging slot. */
static float *fetch(fy_trainer *tr, int b) {
    const fy_chunk *c = &tr->st->chunks[b];
    if (!fy_tr_streamed(tr, b)) return c->param_dev;
    FY_ASSERT(!tr->fetched[b], "block fetched twice");
    float *slot = fy_storage_param_slot(tr->st, b);
    fy_copy_async(tr->s, slot, c->param_lp, fy_tr_nbytes(tr, b), FY_H2D);
    tr->fetched[b] = slot;
    return slot;
}

/* Stream order guarantees the slot's next copy runs after this block's kernels. */
static void unfetch(fy_trainer *tr, int b) {
    if (!fy_tr_streamed(tr, b)) return;
    fy_storage_release_param(tr->st, b);
    tr->fetched[b] = NULL;
}

/* Evaluation's forward pass, serial on the compute stream. */
static void forward(fy_trainer *tr, float *loss_out) {
    const fy_gpt2_config *mc = &tr->cfg.model;
    fy_storage *st = tr->st;
    const int B = tr->plan.micro_batch, T = tr->cfg.T, L = mc->layers;
    const int32_t *x = st->tok_dev, *y = st->tok_dev + (size_t)B * T;
    fy_gpt2_embed_w ew;
    fy_gpt2_embed_view(&tr->lay.blocks[0], fy_tr_dt(tr), fetch(tr, 0), &ew);
    fy_gpt2_embed_fwd(mc, &ew, x, st->x0, B, T, tr->s);
    unfetch(tr, 0);
    for (int l = 0; l < L; l++) {
        fy_gpt2_layer_w w;
        fy_gpt2_layer_view(&tr->lay.blocks[1 + l], fy_tr_dt(tr), fetch(tr, 1 + l), &w);
        fy_gpt2_layer_fwd(mc, &w, &st->acts[l], fy_tr_layer_input(tr, l), &st->sc, B, T, tr->s);
        unfetch(tr, 1 + l);
    }
    fy_gpt2_head_w hw;
    fy_gpt2_head_view(&tr->lay.blocks[L + 1], fy_tr_dt(tr), fetch(tr, L + 1), &hw);
    fy_gpt2_embed_view(&tr->lay.blocks[0], fy_tr_dt(tr), fetch(tr, 0), &ew);
    fy_gpt2_head_fwd(mc, &hw, ew.wte, st->acts[L - 1].out, &st->head, y, loss_out, B, T, tr->s);
    unfetch(tr, L + 1);
    unfetch(tr, 0);
}

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
static fy_status upload_params(fy_trainer *tr, float *const *host) {
    uint16_t *tmp = NULL;
    for (int b = 0; b < tr->lay.nblocks; b++) {
        const fy_chunk *c = &tr->st->chunks[b];
        if (c->param_host) memcpy(c->param_host, host[b], fy_tr_master_nbytes(tr, b));
        if (c->master_dev)
            fy_copy_async(tr->s, c->master_dev, host[b], fy_tr_master_nbytes(tr, b), FY_H2D);
        if (!fy_tr_lp(tr)) {
            if (c->param_dev) fy_copy_async(tr->s, c->param_dev, host[b], fy_tr_nbytes(tr, b), FY_H2D);
            continue;
        }
        if (c->param_lp) fy_f32_to_bf16_n((uint16_t *)c->param_lp, host[b], c->nelem);
        if (!c->param_dev) continue;
        fy_stream_sync(tr->s); /* tmp is reused */
        uint16_t *t = realloc(tmp, fy_tr_nbytes(tr, b));
        if (!t) { free(tmp); return FY_ERR_NOMEM; }
        tmp = t;
        fy_f32_to_bf16_n(tmp, host[b], c->nelem);
        fy_copy_async(tr->s, c->param_dev, tmp, fy_tr_nbytes(tr, b), FY_H2D);
    }
    fy_stream_sync(tr->s);
    free(tmp);
    return FY_OK;
}

static float **host_blocks_new(const fy_gpt2_layout *lay) {
    float **h = calloc((size_t)lay->nblocks, sizeof *h);
    if (!h) return NULL;
    for (int b = 0; b < lay->nblocks; b++)
        if (!(h[b] = malloc(lay->blocks[b].nelem * sizeof(float)))) {
            for (int k = 0; k < b; k++) free(h[k]);
            free(h);
            return NULL;
        }
    return h;
}

static void host_blocks_free(const fy_gpt2_layout *lay, float **h) {
    if (!h) return;
    for (int b = 0; b < lay->nblocks; b++) free(h[b]);
    free(h);
}

fy_status fy_trainer_setup_plan(fy_trainer *tr, const fy_trainer_cfg *cfg) {
    tr->cfg = *cfg;
    tr->cfg.plan = NULL;
    FY_TRY(fy_gpt2_layout_new(&cfg->model, &tr->lay));
    if (cfg->plan && cfg->plan->layers != cfg->model.layers) {
        fy_log_error("the plan is for %d layers, the model has %d", cfg->plan->layers,
                     cfg->model.layers);
        return FY_ERR_INVALID;
    }
    FY_TRY(cfg->plan ? fy_plan_copy(cfg->plan, &tr->plan)
                     : fy_plan_new(cfg->model.layers, cfg->B,
                                   cfg->grad_accum > 0 ? cfg->grad_accum : 1, &tr->plan));
    tr->cfg.B = tr->plan.micro_batch;
    tr->cfg.grad_accum = tr->plan.grad_accum;
    return FY_OK;
}

fy_status fy_trainer_new(fy_dev *dev, const fy_trainer_cfg *cfg, fy_trainer **out) {
    *out = NULL;
    fy_trainer *tr = calloc(1, sizeof *tr);
    if (!tr) return FY_ERR_NOMEM;
    tr->dev = dev;
    float **host = NULL;
    fy_status st = fy_trainer_setup_plan(tr, cfg);
    if (st != FY_OK) goto fail;
    if ((st = fy_stream_new(dev, "compute", &tr->s)) != FY_OK ||
        (st = fy_stream_new(dev, "h2d", &tr->s_h2d)) != FY_OK ||
        (st = fy_stream_new(dev, "d2h", &tr->s_d2h)) != FY_OK)
        goto fail;
    if ((st = fy_storage_new(dev, &tr->lay, &tr->plan, cfg->T, !cfg->eval_only, &tr->st)) != FY_OK ||
        (st = fy_stream_set_dtype(tr->s, fy_tr_dt(tr))) != FY_OK)
        goto fail;
    tr->fetched = calloc((size_t)tr->lay.nblocks, sizeof *tr->fetched);
    tr->cost_ms = calloc((size_t)FY_T_COUNT * (tr->lay.nblocks + 1) * 2, sizeof *tr->cost_ms);
    if (!tr->fetched || !tr->cost_ms) { st = FY_ERR_NOMEM; goto fail; }
    for (int b = 0; b < tr->lay.nblocks && !cfg->eval_only; b++)
        if (fy_tr_cpu_optim(tr, b)) {
            int at = cfg->adam_threads > 0 ? cfg->adam_threads : fy_dev_threads(dev);
            if ((st = new_pool(fy_dev_threads(dev), at, &tr->pool)) != FY_OK) goto fail;
            break;
        }
    if (!(host = host_blocks_new(&tr->lay))) { st = FY_ERR_NOMEM; goto fail; }
    for (int b = 0; b < tr->lay.nblocks; b++)
        fy_gpt2_init_block(&cfg->model, &tr->lay.blocks[b], cfg->seed, host[b]);
    if ((st = upload_params(tr, host)) != FY_OK) goto fail;
    host_blocks_free(&tr->lay, host);
    *out = tr;
    return FY_OK;
fail:
    host_blocks_free(&tr->lay, host);
    fy_trainer_free(tr);
    return st;
}

fy_status fy_trainer_new_dry(const fy_trainer_cfg *cfg, fy_trainer **out) {
    *out = NULL;
    fy_trainer *tr = calloc(1, sizeof *tr);
    if (!tr) return FY_ERR_NOMEM;
    fy_status st = fy_trainer_setup_plan(tr, cfg);
    if (st == FY_OK) st = fy_storage_dry(&tr->lay, &tr->plan, cfg->T, true, &tr->st);
    if (st == FY_OK) {
        tr->cost_ms = calloc((size_t)FY_T_COUNT * (tr->lay.nblocks + 1) * 2, sizeof *tr->cost_ms);
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
    fy_storage_free(tr->st);
    fy_adam_pool_free(tr->pool);
    free(tr->fetched);
    free(tr->cost_ms);
    fy_plan_free(&tr->plan);
    fy_gpt2_layout_free(&tr->lay);
    free(tr);
}

const fy_gpt2_layout *fy_trainer_layout(const fy_trainer *tr) { return &tr->lay; }
int64_t fy_trainer_steps_done(const fy_trainer *tr) { return tr->steps_done; }
const fy_storage *fy_trainer_storage(const fy_trainer *tr) { return tr->st; }

fy_status fy_trainer_load(fy_trainer *tr, const fy_st_file *f) {
    float **h = host_blocks_new(&tr->lay);
    if (!h) return FY_ERR_NOMEM;
    fy_status st = fy_gpt2_load_blocks(f, &tr->lay, h);
    if (st == FY_OK) st = upload_params(tr, h);
    host_blocks_free(&tr->lay, h);
    return st;
}

fy_status fy_trainer_save(fy_trainer *tr, const char *path) {
    float **h = host_blocks_new(&tr->lay);
    if (!h) return FY_ERR_NOMEM;
    for (int b = 0; b < tr->lay.nblocks; b++) fy_trainer_get_params(tr, b, h[b]);
    fy_status st = fy_gpt2_save(path, &tr->lay, h);
    host_blocks_free(&tr->lay, h);
    return st;
}

/* Block b's buffer of the storage type (in host memory, or on the device) into fp32
 * host memory. */
static void read_widened(fy_trainer *tr, float *host, const void *src, bool src_on_host, int b) {
    const size_t n = tr->lay.blocks[b].nelem;
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

void fy_trainer_get_params(fy_trainer *tr, int b, float *host) {
    const fy_chunk *c = &tr->st->chunks[b];
    fy_stream_sync(tr->s);
    if (c->param_host) { /* the master */
        memcpy(host, c->param_host, fy_tr_master_nbytes(tr, b));
    } else if (c->master_dev) {
        fy_copy_async(tr->s, host, c->master_dev, fy_tr_master_nbytes(tr, b), FY_D2H);
        fy_stream_sync(tr->s);
    } else {
        read_widened(tr, host, c->param_dev, false, b);
    }
}

void fy_trainer_get_grads(fy_trainer *tr, int b, float *host) {
    FY_ASSERT(!tr->cfg.eval_only, "an evaluation-only trainer has no gradients");
    const fy_chunk *c = &tr->st->chunks[b];
    fy_stream_sync(tr->s);
    read_widened(tr, host, c->grad_host ? c->grad_host : c->grad_dev, c->grad_host != NULL, b);
}

/* ---- the step ---------------------------------------------------------------------- */

static void upload_tokens(fy_trainer *tr, const int32_t *x, const int32_t *y) {
    const size_t N = (size_t)tr->plan.micro_batch * tr->cfg.T;
    fy_stream_sync(tr->s); /* the staging buffer is reused: the last copy must be done */
    memcpy(tr->st->tok_host, x, N * sizeof(int32_t));
    memcpy(tr->st->tok_host + N, y, N * sizeof(int32_t));
    fy_copy_async(tr->s, tr->st->tok_dev, tr->st->tok_host, 2 * N * sizeof(int32_t), FY_H2D);
}

fy_status fy_trainer_eval(fy_trainer *tr, const int32_t *x, const int32_t *y, float *loss) {
    upload_tokens(tr, x, y);
    forward(tr, tr->st->loss_dev);
    fy_copy_async(tr->s, tr->st->loss_host, tr->st->loss_dev, sizeof(float), FY_D2H);
    fy_stream_sync(tr->s);
    *loss = tr->st->loss_host[0];
    return FY_OK;
}
