/* storage.c — the chunk table, staging rings, activations and the memory model.
 *
 * layout() walks every buffer a run needs, in one fixed order, and hands each to take()
 * (device memory) or carve() (host arena). A dry walk only counts: that is the memory
 * model. The real walk allocates the same list, so the model cannot drift from what is
 * allocated. */
#include "offload/storage.h"

#include <stdlib.h>
#include <string.h>

#include "engine/core/util.h"

#define HOST_ALIGN 64

static const char *cat_names[FY_CAT_COUNT] = {"parameters", "gradients", "optimizer",
                                              "activations", "staging", "workspace"};

const char *fy_mem_cat_name(fy_mem_cat c) { return c < FY_CAT_COUNT ? cat_names[c] : "?"; }

typedef struct walk {
    fy_storage *st;        /* NULL in a dry walk */
    bool alloc;            /* allocate (else only count, and fill st's tables) */
    fy_mem_model *m;
    char *arena_cur;       /* real walk: next free byte of the arena */
} walk;

static fy_status take(walk *w, fy_mem_cat cat, size_t nbytes, const char *what, void *out) {
    w->m->device[cat] += nbytes;
    w->m->device_total += nbytes;
    if (!w->st || !w->alloc) return FY_OK;
    fy_storage *st = w->st;
    if (st->nallocs == st->capallocs) {
        int ncap = st->capallocs ? 2 * st->capallocs : 64;
        void **a = realloc(st->allocs, (size_t)ncap * sizeof *a);
        if (!a) return FY_ERR_NOMEM;
        st->allocs = a;
        st->capallocs = ncap;
    }
    void *p;
    FY_TRY(fy_dev_alloc(st->dev, FY_MEM_DEVICE, nbytes, what, &p));
    st->allocs[st->nallocs++] = p;
    memcpy(out, &p, sizeof p);
    return FY_OK;
}

/* Big host arrays are followed by a 4 KiB + 64 B gap: weights, moments and gradients
 * updated together then start at different offsets within 2 MiB pages, which keeps
 * them out of each other's DRAM banks (optim_cpu measured ~2x on same-offset arrays). */
#define HOST_STAGGER (4096 + HOST_ALIGN)

static void carve(walk *w, fy_mem_cat cat, size_t nbytes, void *out) {
    size_t n = fy_round_up(nbytes, HOST_ALIGN);
    if (n >= (1u << 20)) n += HOST_STAGGER;
    w->m->host[cat] += n;
    w->m->host_total += n;
    if (!w->st || !w->alloc) return;
    void *p = w->arena_cur;
    w->arena_cur += n;
    w->st->arena_used += n;
    memcpy(out, &p, sizeof p);
}

static size_t fsz(size_t nelem) { return nelem * sizeof(float); }

static fy_dtype plan_dtype(const fy_plan *plan) { return plan->dtype == FY_BF16 ? FY_BF16 : FY_F32; }

static fy_status layout(walk *w, const fy_gpt2_layout *lay, const fy_plan *plan, int T,
                        bool training, fy_chunk *chunks, fy_storage *st) {
    const fy_gpt2_config *mc = &lay->cfg;
    const int B = plan->micro_batch, L = mc->layers, nb = lay->nblocks;
    const size_t N = (size_t)B * T;
    const fy_dtype dt = plan_dtype(plan);
    const size_t es = fy_dtype_size(dt);
    const bool lp = dt != FY_F32; /* masters apart from the device copies */
    char what[64];
    fy_chunk scratch_chunk;
    float *base_dummy;
    size_t pslot = 0, gslot = 0;
    int nstreamed = 0, nstaged = 0;
    bool any_cpu = false, embed_staged = false;
    for (int b = 0; b < nb; b++) {
        const fy_block_plan *bp = &plan->blocks[b];
        fy_chunk *c = chunks ? &chunks[b] : &scratch_chunk;
        memset(c, 0, sizeof *c);
        c->nelem = lay->blocks[b].nelem;
        const size_t nbytes = fsz(c->nelem), lpbytes = c->nelem * es;
        bool streamed = bp->params == FY_PARAMS_STREAMED, cpu = bp->optim == FY_OPTIM_CPU;
        c->needs_grad_staging = training && (cpu || plan->grad_accum > 1);
        if (streamed) {
            /* a device update of a bf16 block needs its fp32 master and the bf16 copy out */
            size_t need = lp && training && !cpu ? nbytes + lpbytes : lpbytes;
            nstreamed++;
            if (need > pslot) pslot = need;
        }
        if (c->needs_grad_staging) {
            nstaged++;
            if (b == 0) embed_staged = true;
            if (lpbytes > gslot) gslot = lpbytes;
        }
        any_cpu |= cpu;
        if (!streamed) {
            snprintf(what, sizeof what, "block %d parameters", b);
            FY_TRY(take(w, FY_CAT_PARAMS, lpbytes, what, &c->param_dev));
            if (lp && training && !cpu) {
                snprintf(what, sizeof what, "block %d fp32 master weights", b);
                FY_TRY(take(w, FY_CAT_OPTIM, nbytes, what, &c->master_dev));
            }
        }
        if (streamed || (cpu && training)) {
            carve(w, FY_CAT_PARAMS, nbytes, &c->param_host);
            if (lp) carve(w, FY_CAT_PARAMS, lpbytes, &c->param_lp);
            else c->param_lp = c->param_host;
        }
        if (!training) continue; /* evaluation: parameters only */
        if (cpu) {
            carve(w, FY_CAT_GRADS, lpbytes, &c->grad_host);
            carve(w, FY_CAT_OPTIM, nbytes, &c->m);
            carve(w, FY_CAT_OPTIM, nbytes, &c->v);
        } else {
            snprintf(what, sizeof what, "block %d gradients", b);
            FY_TRY(take(w, FY_CAT_GRADS, lpbytes, what, &c->grad_dev));
            snprintf(what, sizeof what, "block %d Adam m", b);
            FY_TRY(take(w, FY_CAT_OPTIM, nbytes, what, &c->m));
            snprintf(what, sizeof what, "block %d Adam v", b);
            FY_TRY(take(w, FY_CAT_OPTIM, nbytes, what, &c->v));
        }
    }
    /* staging rings: the serial schedule needs one slot, plus one when the head's
     * forward and backward need the head and the tied embedding at once (parameters),
     * or when the embedding's gradient, held from the head's backward to its own, shares
     * the ring with others (gradients) */
    const fy_block_plan *pe = &plan->blocks[0], *ph = &plan->blocks[L + 1];
    int npslots = nstreamed == 0 ? 0
                  : (pe->params == FY_PARAMS_STREAMED && ph->params == FY_PARAMS_STREAMED) ? 2 : 1;
    int ngslots = nstaged == 0 ? 0 : (embed_staged && nstaged > 1) ? 2 : 1;
    /* plus the plan's prefetch depth, so transfers can run ahead of compute */
    if (npslots) npslots += plan->prefetch;
    if (ngslots) ngslots += plan->prefetch;
    if (st) {
        st->nparam_slots = npslots;
        st->ngrad_slots = ngslots;
        st->param_slot_nbytes = pslot;
        st->grad_slot_nbytes = gslot;
        st->dtype = dt;
        st->es = es;
        st->param_slots = calloc((size_t)(npslots ? npslots : 1), sizeof(fy_slot));
        st->grad_slots = calloc((size_t)(ngslots ? ngslots : 1), sizeof(fy_slot));
        if (!st->param_slots || !st->grad_slots) return FY_ERR_NOMEM;
    }
    for (int i = 0; i < npslots; i++) {
        snprintf(what, sizeof what, "parameter staging slot %d", i);
        float *p = NULL;
        FY_TRY(take(w, FY_CAT_STAGING, pslot, what, &p));
        if (st) st->param_slots[i] = (fy_slot){p, -1};
    }
    for (int i = 0; i < ngslots; i++) {
        snprintf(what, sizeof what, "gradient staging slot %d", i);
        float *p = NULL;
        FY_TRY(take(w, FY_CAT_STAGING, gslot, what, &p));
        if (st) st->grad_slots[i] = (fy_slot){p, -1};
    }
    /* host landing buffer for micro-batch gradients added into grad_host */
    if (any_cpu && plan->grad_accum > 1)
        carve(w, FY_CAT_STAGING, gslot, st ? (void *)&st->grad_host_tmp : (void *)&base_dummy);
    /* activations */
    const size_t layer_n = fy_gpt2_layer_acts_nbytes(mc, B, T, dt);
    float *shared = NULL;
    bool any_recompute = false;
    for (int l = 0; l < L; l++) any_recompute |= plan->blocks[1 + l].acts == FY_ACTS_RECOMPUTE;
    if (any_recompute)
        FY_TRY(take(w, FY_CAT_ACTS, layer_n, "activations shared by recomputed layers", &shared));
    for (int l = 0; l < L; l++) {
        fy_gpt2_layer_acts a;
        memset(&a, 0, sizeof a);
        if (plan->blocks[1 + l].acts == FY_ACTS_RECOMPUTE) {
            if (st && w->alloc) fy_gpt2_layer_acts_bind(mc, B, T, dt, shared, &a);
        } else {
            float *base = NULL;
            snprintf(what, sizeof what, "layer %d activations", l);
            FY_TRY(take(w, FY_CAT_ACTS, layer_n, what, &base));
            if (st && w->alloc) fy_gpt2_layer_acts_bind(mc, B, T, dt, base, &a);
        }
        snprintf(what, sizeof what, "layer %d output", l);
        FY_TRY(take(w, FY_CAT_ACTS, N * mc->channels * es, what, &a.out));
        if (st) st->acts[l] = a;
    }
    float *base = NULL;
    FY_TRY(take(w, FY_CAT_ACTS, fy_gpt2_head_acts_nbytes(mc, B, T, dt), "head activations", &base));
    if (st && w->alloc) fy_gpt2_head_acts_bind(mc, B, T, dt, base, &st->head);
    FY_TRY(take(w, FY_CAT_ACTS, N * mc->channels * es, "embedding output", st ? &st->x0 : &base));
    FY_TRY(take(w, FY_CAT_WORKSPACE, fy_gpt2_scratch_nbytes(mc, B, T, dt), "backward workspace",
                &base));
    if (st && w->alloc) fy_gpt2_scratch_bind(mc, B, T, dt, base, &st->sc);
    if (training && lp)
        FY_TRY(take(w, FY_CAT_WORKSPACE, (size_t)fy_gpt2_vocab_padded(mc) * mc->channels * sizeof(float),
                    "classifier's fp32 dwte sums", st ? (void *)&st->dwte32 : &base));
    const size_t accum = (size_t)plan->grad_accum;
    void *tmp;
    /* tokens are double-buffered so the next micro-batch loads while this one computes */
    FY_TRY(take(w, FY_CAT_WORKSPACE, 4 * N * sizeof(int32_t), "tokens", st ? (void *)&st->tok_dev : &tmp));
    FY_TRY(take(w, FY_CAT_WORKSPACE, accum * sizeof(float), "losses", st ? (void *)&st->loss_dev : &tmp));
    FY_TRY(take(w, FY_CAT_WORKSPACE, (size_t)nb * sizeof(double), "gradient norms",
                st ? (void *)&st->sumsq_dev : &tmp));
    carve(w, FY_CAT_WORKSPACE, 4 * N * sizeof(int32_t), st ? (void *)&st->tok_host : &tmp);
    carve(w, FY_CAT_WORKSPACE, accum * sizeof(float), st ? (void *)&st->loss_host : &tmp);
    carve(w, FY_CAT_WORKSPACE, (size_t)nb * sizeof(double), st ? (void *)&st->sumsq_host : &tmp);
    return FY_OK;
}

void fy_storage_model_for(const fy_gpt2_layout *lay, const fy_plan *plan, int T, bool training,
                          fy_mem_model *out) {
    memset(out, 0, sizeof *out);
    walk w = {.m = out};
    fy_status s = layout(&w, lay, plan, T, training, NULL, NULL);
    FY_ASSERT(s == FY_OK, "a dry storage walk cannot fail");
}

void fy_storage_model(const fy_gpt2_layout *lay, const fy_plan *plan, int T, fy_mem_model *out) {
    fy_storage_model_for(lay, plan, T, true, out);
}

fy_status fy_storage_new(fy_dev *dev, const fy_gpt2_layout *lay, const fy_plan *plan, int T,
                         bool training, fy_storage **out) {
    *out = NULL;
    fy_storage *st = calloc(1, sizeof *st);
    if (!st) return FY_ERR_NOMEM;
    st->dev = dev;
    st->lay = lay;
    st->B = plan->micro_batch;
    st->T = T;
    fy_status s = fy_plan_copy(plan, &st->plan);
    if (s != FY_OK) { free(st); return s; }
    fy_mem_model dry;
    fy_storage_model_for(lay, plan, T, training, &dry);
    st->chunks = calloc((size_t)lay->nblocks, sizeof *st->chunks);
    st->acts = calloc((size_t)lay->cfg.layers, sizeof *st->acts);
    if (!st->chunks || !st->acts) { s = FY_ERR_NOMEM; goto fail; }
    /* host arena: pinned if the device can, else pageable with one warning */
    st->arena_nbytes = dry.host_total ? dry.host_total : HOST_ALIGN;
    s = fy_dev_alloc(dev, FY_MEM_PINNED, st->arena_nbytes, "host arena", &st->arena);
    st->arena_pinned = s == FY_OK;
    if (s != FY_OK) {
        fy_log_warn("cannot pin %zu bytes of host memory: using pageable memory (slower "
                    "transfers)", st->arena_nbytes);
        s = fy_dev_alloc(dev, FY_MEM_HOST, st->arena_nbytes, "host arena", &st->arena);
        if (s != FY_OK) goto fail;
    }
    walk w = {.st = st, .alloc = true, .m = &st->model, .arena_cur = st->arena};
    if ((s = layout(&w, lay, plan, T, training, st->chunks, st)) != FY_OK) goto fail;
    FY_ASSERT(st->arena_used == dry.host_total && st->model.device_total == dry.device_total,
              "the storage walk must be the same dry and real");
    *out = st;
    return FY_OK;
fail:
    fy_storage_free(st);
    return s;
}

fy_status fy_storage_dry(const fy_gpt2_layout *lay, const fy_plan *plan, int T, bool training,
                         fy_storage **out) {
    *out = NULL;
    fy_storage *st = calloc(1, sizeof *st);
    if (!st) return FY_ERR_NOMEM;
    st->lay = lay;
    st->B = plan->micro_batch;
    st->T = T;
    fy_status s = fy_plan_copy(plan, &st->plan);
    if (s != FY_OK) { free(st); return s; }
    st->chunks = calloc((size_t)lay->nblocks, sizeof *st->chunks);
    st->acts = calloc((size_t)lay->cfg.layers, sizeof *st->acts);
    if (!st->chunks || !st->acts) { fy_storage_free(st); return FY_ERR_NOMEM; }
    walk w = {.st = st, .alloc = false, .m = &st->model};
    if ((s = layout(&w, lay, plan, T, training, st->chunks, st)) != FY_OK) {
        fy_storage_free(st);
        return s;
    }
    *out = st;
    return FY_OK;
}

void fy_storage_free(fy_storage *st) {
    if (!st) return;
    for (int i = st->nallocs - 1; i >= 0; i--) fy_dev_release(st->dev, st->allocs[i]);
    if (st->dev) fy_dev_release(st->dev, st->arena);
    free(st->allocs);
    free(st->param_slots);
    free(st->grad_slots);
    free(st->chunks);
    free(st->acts);
    fy_plan_free(&st->plan);
    free(st);
}

static float *acquire(fy_slot *slots, int n, int b, const char *kind) {
    for (int i = 0; i < n; i++)
        if (slots[i].owner < 0) { slots[i].owner = b; return slots[i].buf; }
    FY_ASSERT(0, kind);
    return NULL;
}

static void release(fy_slot *slots, int n, int b) {
    for (int i = 0; i < n; i++)
        if (slots[i].owner == b) { slots[i].owner = -1; return; }
    FY_ASSERT(0, "releasing a staging slot the block does not hold");
}

float *fy_storage_param_slot(fy_storage *st, int b) {
    return acquire(st->param_slots, st->nparam_slots, b, "no free parameter staging slot");
}
float *fy_storage_grad_slot(fy_storage *st, int b) {
    return acquire(st->grad_slots, st->ngrad_slots, b, "no free gradient staging slot");
}
void fy_storage_release_param(fy_storage *st, int b) { release(st->param_slots, st->nparam_slots, b); }
void fy_storage_release_grad(fy_storage *st, int b) { release(st->grad_slots, st->ngrad_slots, b); }

void fy_mem_model_print(const fy_mem_model *m, FILE *f) {
    char a[32], b[32];
    fprintf(f, "memory  %-12s %12s %12s\n", "", "device", "host");
    for (int c = 0; c < FY_CAT_COUNT; c++)
        fprintf(f, "        %-12s %12s %12s\n", cat_names[c], fy_fmt_size(m->device[c], a, sizeof a),
                fy_fmt_size(m->host[c], b, sizeof b));
    fprintf(f, "        %-12s %12s %12s\n", "total", fy_fmt_size(m->device_total, a, sizeof a),
            fy_fmt_size(m->host_total, b, sizeof b));
}
