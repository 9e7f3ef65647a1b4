/* storage.c — the chunk table, staging rings, activations and the memory model.
 *
 * layout() walks every buffer a run needs, in one fixed order, and hands each to take()
 * (device memory) or carve() (host arena). A dry walk only counts: that is the memory
 * model. The real walk allocates the same list, so the model cannot drift from what is
 * allocated. */
#include "offload/storage.h"

#include <stdlib.h>
#include <string.h>

#include "engine/core/reduce.h"
#include "engine/core/util.h"
#include "offload/plan.h"

#define HOST_ALIGN 64

static const char *cat_names[FY_CAT_COUNT] = {"parameters", "gradients", "optimizer",
                                              "activations", "staging", "workspace"};

const char *fy_mem_cat_name(fy_mem_cat c) { return c < FY_CAT_COUNT ? cat_names[c] : "?"; }

typedef struct walk {
    fy_storage *st;        /* NULL in a dry walk */
    bool alloc;            /* allocate (else only count, and fill st's tables) */
    fy_mem_model *m;
    size_t pinned_cap;     /* transfer buffers past it go to the pageable arena */
    char *cur[2];          /* real walk: the next free byte of the pageable [0] and the
                              pinned [1] arena */
} walk;

static fy_status take(walk *w, fy_mem_cat cat, size_t nbytes, const char *what, void *out) {
    w->m->device[cat] += nbytes;
    w->m->device_total += nbytes;
    if (!w->st || !w->alloc || !nbytes) return FY_OK; /* an empty shard: NULL, as modelled */
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

/* A host buffer. One the device copies to or from (xfer) goes to the pinned arena while
 * that stays within the cap, the rest (the moments, a cpu-optimised block's fp32 master:
 * only the CPU touches them) to the pageable one. */
static void carve(walk *w, fy_mem_cat cat, size_t nbytes, bool xfer, void *out) {
    size_t n = fy_round_up(nbytes, HOST_ALIGN);
    if (n >= (1u << 20)) n += HOST_STAGGER;
    const bool pin = xfer && w->m->host_pinned + n <= w->pinned_cap;
    w->m->host[cat] += n;
    w->m->host_total += n;
    if (pin) w->m->host_pinned += n;
    else if (xfer) w->m->pinned_over += n;
    if (!w->st || !w->alloc) return;
    void *p = w->cur[pin];
    w->cur[pin] += n;
    memcpy(out, &p, sizeof p);
}

static size_t fsz(size_t nelem) { return nelem * sizeof(float); }

/* A buffer's name for the allocation's errors, made only when a walk allocates (the
 * tuner walks plans by the hundred thousand). */
#define NAME(...) do { if (w->alloc) snprintf(what, sizeof what, __VA_ARGS__); } while (0)

static fy_dtype plan_dtype(const fy_plan *plan) { return plan->dtype == FY_BF16 ? FY_BF16 : FY_F32; }

/* The least slots each ring needs for the serial order to run. Parameters: the most
 * streamed blocks of the ring one task uses at once (a block and the blocks it links to).
 * Gradients: walking backward from the head, the most staged gradients of the ring open
 * at once: a block's own during its backward, and a linked block's from the backward of
 * the block linking to it until its own (it is opened by the first writer). */
static void min_slots(const fy_model *m, const fy_plan *plan, const fy_chunk *c,
                      int np[FY_RINGS], int ng[FY_RINGS]) {
    const int nb = plan->nblocks;
    bool *held = calloc((size_t)nb, sizeof *held);
    FY_ASSERT(held, "out of host memory sizing the staging rings");
    int nheld[FY_RINGS] = {0};
    for (int r = 0; r < FY_RINGS; r++) np[r] = ng[r] = 0;
    for (int b = nb - 1; b >= 0; b--) {
        const fy_block_spec *blk = fy_model_block(m, b);
        int p[FY_RINGS] = {0}, open[FY_RINGS] = {0};
        p[c[b].ring] += plan->blocks[b].params == FY_PARAMS_STREAMED;
        open[c[b].ring] += c[b].needs_grad_staging && !held[b];
        for (int k = 0; k < blk->nlinks; k++) {
            const int l = blk->links[k];
            p[c[l].ring] += plan->blocks[l].params == FY_PARAMS_STREAMED;
            open[c[l].ring] += c[l].needs_grad_staging && !held[l];
        }
        for (int r = 0; r < FY_RINGS; r++) {
            if (p[r] > np[r]) np[r] = p[r];
            if (nheld[r] + open[r] > ng[r]) ng[r] = nheld[r] + open[r];
        }
        for (int k = 0; k < blk->nlinks; k++) {
            const int l = blk->links[k];
            if (c[l].needs_grad_staging && !held[l]) { held[l] = true; nheld[c[l].ring]++; }
        }
        if (held[b]) { held[b] = false; nheld[c[b].ring]--; }
    }
    free(held);
}

/* The ring of a block whose staged copies take stage_nelem elements: the large one for
 * a block that is not a layer and is larger than the largest layer (layer_max). */
static fy_ring_id ring_of(const fy_block_spec *blk, size_t stage_nelem, size_t layer_max) {
    return blk->kind != FY_BLOCK_LAYER && stage_nelem > layer_max ? FY_RING_LARGE : FY_RING_LAYER;
}

/* Whether a head is chunked under the plan (storage.h): a vocab_chunks head streamed and,
 * in training, optimised on the CPU, whose classifier takes more than one chunk. */
static bool chunked(const fy_block_spec *blk, const fy_block_plan *bp, bool training,
                    fy_lm_chunks ch) {
    return blk->vocab_chunks && bp->params == FY_PARAMS_STREAMED &&
           (!training || bp->optim == FY_OPTIM_CPU) && ch.n > 1;
}

/* Whether block b is gathered under the plan (storage.h): a row table whose parameters
 * are streamed and, in training, whose optimizer runs on the CPU (an update on the
 * device needs the whole table there). */
static bool gathered(const fy_block_spec *blk, const fy_block_plan *bp, bool training) {
    return blk->gather && bp->params == FY_PARAMS_STREAMED && (!training || bp->optim == FY_OPTIM_CPU);
}

static const char *ring_names[FY_RINGS] = {"layer", "large"};

/* Shard r of `shards` takes chunks [nch r / shards, nch (r + 1) / shards). */
static size_t first_chunk(size_t nch, int shards, int r) { return nch * (size_t)r / (size_t)shards; }

void fy_shard_bounds(size_t nelem, int shards, size_t *off) {
    const size_t nch = fy_sumsq_nchunks(nelem);
    for (int r = 0; r <= shards; r++) {
        const size_t e = first_chunk(nch, shards, r) * FY_SUMSQ_CHUNK;
        off[r] = e < nelem ? e : nelem;
    }
}

size_t fy_shard_nchunks(size_t nelem, int shards, int r) {
    const size_t nch = fy_sumsq_nchunks(nelem);
    return first_chunk(nch, shards, r + 1) - first_chunk(nch, shards, r);
}

/* Block chunk c's shard under the plan: [lo, hi) of its elements (all of them unless a
 * data-parallel run trains); for planning (shard -1) the size of its largest shard. */
static void shard_of(fy_chunk *c, const fy_plan *plan, bool training) {
    c->lo = 0;
    c->hi = c->nelem;
    if (!training || plan->shards <= 1) return;
    size_t off[FY_MAX_SHARDS + 1];
    fy_shard_bounds(c->nelem, plan->shards, off);
    if (plan->shard < 0) {
        c->hi = 0;
        for (int r = 0; r < plan->shards; r++)
            if (off[r + 1] - off[r] > c->hi) c->hi = off[r + 1] - off[r];
        return;
    }
    c->lo = off[plan->shard];
    c->hi = off[plan->shard + 1];
}


static fy_status layout(walk *w, const fy_model *m, const fy_plan *plan, int T, bool training,
                        fy_chunk *chunks, fy_storage *st) {
    const int B = plan->micro_batch, nb = plan->nblocks;
    const size_t N = (size_t)B * T;
    const fy_dtype dt = plan_dtype(plan);
    const size_t es = fy_dtype_size(dt);
    const bool lp = dt != FY_F32; /* masters apart from the device copies */
    char what[64] = "";
    fy_chunk *c_all = chunks ? chunks : calloc((size_t)nb, sizeof *c_all);
    if (!c_all) return FY_ERR_NOMEM;
    size_t pslot[FY_RINGS] = {0}, gslot[FY_RINGS] = {0}, layer_max = 0;
    for (int b = 0; b < nb; b++)
        if (fy_model_block(m, b)->kind == FY_BLOCK_LAYER && fy_model_block(m, b)->nelem > layer_max)
            layer_max = fy_model_block(m, b)->nelem;
    int gather_block = -1;
    size_t land = 0; /* the host landing slot: the largest gradient added on the host */
    fy_status s = FY_OK;
    const fy_lm_chunks hch = fy_model_block(m, nb - 1)->vocab_chunks
                                 ? fy_model_head_chunks(m, B, T, dt) : (fy_lm_chunks){0};
    if (st) st->head_chunks = hch;
    for (int b = 0; b < nb; b++) {
        const fy_block_plan *bp = &plan->blocks[b];
        const fy_block_spec *blk = fy_model_block(m, b);
        const char *bname = blk->name;
        fy_chunk *c = &c_all[b];
        memset(c, 0, sizeof *c);
        c->nelem = blk->nelem;
        c->stage_nelem = c->nelem;
        if ((c->gathered = gathered(blk, bp, training))) {
            const size_t rows = (size_t)blk->tensors[0].alloc_rows;
            c->stage_nelem = (N < rows ? N : rows) * (size_t)blk->tensors[0].cols;
            gather_block = b;
        }
        if ((c->chunked = chunked(blk, bp, training, hch)))
            c->stage_nelem = fy_model_chunk_view_nelem(m, b, hch);
        c->ring = ring_of(blk, c->stage_nelem, layer_max);
        shard_of(c, plan, training);
        const size_t nbytes = fsz(c->nelem), lpbytes = c->nelem * es, stbytes = c->stage_nelem * es;
        const size_t own = c->hi - c->lo, ownbytes = fsz(own); /* its shard's fp32 state */
        bool streamed = bp->params == FY_PARAMS_STREAMED, cpu = bp->optim == FY_OPTIM_CPU;
        c->needs_grad_staging = training && (cpu || plan->grad_accum > 1);
        if (streamed) {
            /* a device update of a bf16 block needs its (shard's) fp32 master and the bf16
             * copy out */
            size_t need = lp && training && !cpu ? ownbytes + own * es : stbytes;
            if (need < stbytes) need = stbytes;
            if (need > pslot[c->ring]) pslot[c->ring] = need;
        }
        if (c->needs_grad_staging) {
            if (stbytes > gslot[c->ring]) gslot[c->ring] = stbytes;
            if (cpu && (plan->grad_accum > 1 || c->gathered) && stbytes > land) land = stbytes;
        }
        if (!streamed) {
            NAME( "%s parameters", bname);
            if ((s = take(w, FY_CAT_PARAMS, lpbytes, what, &c->param_dev)) != FY_OK) goto done;
            if (lp && training && !cpu) {
                NAME( "%s fp32 master weights", bname);
                if ((s = take(w, FY_CAT_OPTIM, ownbytes, what, &c->master_dev)) != FY_OK) goto done;
            }
        }
        /* the master apart from the copy compute reads: with bf16 storage, and in a
         * sharded fp32 run for a cpu-optimised block whose gradient lands in that copy
         * (its shard's master then stays apart; storage.h) */
        c->apart = lp || (training && cpu && plan->shards > 1 && plan->grad_accum == 1);
        if (streamed || (cpu && training)) {
            /* the master is copied when it is what compute reads (fp32) or when a
             * device update of a streamed block fetches it and sends it back */
            carve(w, FY_CAT_PARAMS, c->apart ? ownbytes : nbytes,
                  !c->apart || (streamed && training && !cpu), &c->param_host);
            if (c->apart) carve(w, FY_CAT_PARAMS, lpbytes, true, &c->param_lp);
            else c->param_lp = c->param_host;
        }
        if (!training) continue; /* evaluation: parameters only */
        if (cpu && c->apart && plan->grad_accum == 1) {
            c->grad_host = c->param_lp;
            c->grad_in_lp = true;
            carve(w, FY_CAT_OPTIM, ownbytes, false, &c->m);
            carve(w, FY_CAT_OPTIM, ownbytes, false, &c->v);
        } else if (cpu) {
            carve(w, FY_CAT_GRADS, lpbytes, true, &c->grad_host);
            carve(w, FY_CAT_OPTIM, ownbytes, false, &c->m);
            carve(w, FY_CAT_OPTIM, ownbytes, false, &c->v);
        } else {
            NAME( "%s gradients", bname);
            if ((s = take(w, FY_CAT_GRADS, lpbytes, what, &c->grad_dev)) != FY_OK) goto done;
            NAME( "%s Adam m", bname);
            if ((s = take(w, FY_CAT_OPTIM, ownbytes, what, &c->m)) != FY_OK) goto done;
            NAME( "%s Adam v", bname);
            if ((s = take(w, FY_CAT_OPTIM, ownbytes, what, &c->v)) != FY_OK) goto done;
        }
    }
    /* staging rings: the serial minimum, plus the plan's prefetch depth in the layer
     * ring so transfers can run ahead of compute */
    int np[FY_RINGS], ng[FY_RINGS];
    min_slots(m, plan, c_all, np, ng);
    if (np[FY_RING_LAYER]) np[FY_RING_LAYER] += plan->prefetch;
    if (ng[FY_RING_LAYER]) ng[FY_RING_LAYER] += plan->prefetch;
    if (st) {
        st->dtype = dt;
        st->es = es;
    }
    void *tmp;
    for (int r = 0; r < FY_RINGS; r++) {
        fy_ring *pr = st ? &st->param_ring[r] : NULL, *gr = st ? &st->grad_ring[r] : NULL;
        if (st) {
            *pr = (fy_ring){.n = np[r], .nbytes = pslot[r],
                            .slots = calloc((size_t)(np[r] ? np[r] : 1), sizeof(void *))};
            *gr = (fy_ring){.n = ng[r], .nbytes = gslot[r],
                            .slots = calloc((size_t)(ng[r] ? ng[r] : 1), sizeof(void *))};
            if (!pr->slots || !gr->slots) { s = FY_ERR_NOMEM; goto done; }
        }
        for (int i = 0; i < np[r]; i++) {
            NAME( "parameter staging slot %d (%s ring)", i, ring_names[r]);
            if ((s = take(w, FY_CAT_STAGING, pslot[r], what, pr ? &pr->slots[i] : &tmp)) != FY_OK) goto done;
        }
        for (int i = 0; i < ng[r]; i++) {
            NAME( "gradient staging slot %d (%s ring)", i, ring_names[r]);
            if ((s = take(w, FY_CAT_STAGING, gslot[r], what, gr ? &gr->slots[i] : &tmp)) != FY_OK) goto done;
        }
    }
    /* host landing buffer for micro-batch gradients added (or scattered) into grad_host */
    if (land) carve(w, FY_CAT_STAGING, land, true, st ? (void *)&st->grad_host_tmp : &tmp);
    /* a gathered block's rows: the fetch's pinned buffer, the distinct tokens of each
     * token buffer, and the table's row map */
    if (st) st->gather.block = gather_block;
    if (gather_block >= 0) {
        const fy_block_spec *gb = fy_model_block(m, gather_block);
        carve(w, FY_CAT_STAGING, c_all[gather_block].stage_nelem * es, true,
              st ? &st->gather.host : &tmp);
        carve(w, FY_CAT_WORKSPACE, 2 * N * sizeof(int32_t), false, st ? (void *)&st->gather.rows : &tmp);
        carve(w, FY_CAT_WORKSPACE, (size_t)gb->tensors[0].alloc_rows * sizeof(int32_t), false,
              st ? (void *)&st->gather.map : &tmp);
    }
    /* activations: the saved area recomputed blocks share, then each block's own */
    size_t shared_n = 0, work_n = 0, out_max = 0;
    for (int b = 0; b < nb; b++) {
        fy_act_sizes a;
        fy_model_acts(m, b, B, T, dt, training, &a);
        if (plan->blocks[b].acts == FY_ACTS_RECOMPUTE && a.saved > shared_n) shared_n = a.saved;
        if (a.work > work_n) work_n = a.work;
        if (a.out > out_max) out_max = a.out;
    }
    void *shared = NULL;
    if (shared_n &&
        (s = take(w, FY_CAT_ACTS, shared_n, "activations shared by recomputed layers", &shared)) != FY_OK)
        goto done;
    for (int b = 0; b < nb; b++) {
        fy_act_sizes a;
        fy_model_acts(m, b, B, T, dt, training, &a);
        const char *bname = fy_model_block(m, b)->name;
        fy_block_acts ba = {0};
        if (plan->blocks[b].acts == FY_ACTS_RECOMPUTE) {
            ba.saved = shared;
        } else if (a.saved) {
            NAME( "%s activations", bname);
            if ((s = take(w, FY_CAT_ACTS, a.saved, what, &ba.saved)) != FY_OK) goto done;
        }
        if (a.out) {
            NAME( "%s output", bname);
            if ((s = take(w, FY_CAT_ACTS, a.out, what, &ba.out)) != FY_OK) goto done;
        }
        if (st) st->acts[b] = ba;
    }
    if (work_n && (s = take(w, FY_CAT_WORKSPACE, work_n, "workspace", st ? &st->work : &tmp)) != FY_OK)
        goto done;
    if (training && out_max &&
        (s = take(w, FY_CAT_WORKSPACE, out_max, "activation gradient", st ? &st->dx : &tmp)) != FY_OK)
        goto done;
    const size_t accum = (size_t)plan->grad_accum;
    /* tokens are double-buffered so the next micro-batch loads while this one computes */
    const size_t parts = gather_block >= 0 ? 3 : 2;
    if (st) st->tok_parts = (int)parts;
    if ((s = take(w, FY_CAT_WORKSPACE, 2 * parts * N * sizeof(int32_t), "tokens", st ? (void *)&st->tok_dev : &tmp)) != FY_OK ||
        (s = take(w, FY_CAT_WORKSPACE, accum * sizeof(float), "losses", st ? (void *)&st->loss_dev : &tmp)) != FY_OK ||
        (s = take(w, FY_CAT_WORKSPACE, (size_t)nb * sizeof(double), "gradient norms",
                  st ? (void *)&st->sumsq_dev : &tmp)) != FY_OK)
        goto done;
    carve(w, FY_CAT_WORKSPACE, 2 * parts * N * sizeof(int32_t), true, st ? (void *)&st->tok_host : &tmp);
    carve(w, FY_CAT_WORKSPACE, accum * sizeof(float), true, st ? (void *)&st->loss_host : &tmp);
    carve(w, FY_CAT_WORKSPACE, (size_t)nb * sizeof(double), true, st ? (void *)&st->sumsq_host : &tmp);
    /* a sharded run's norm: each block's chunk sums, this rank's on the device, every
     * rank's on the host */
    if (training && plan->shards > 1) {
        size_t own = 0, all = 0;
        for (int b = 0; b < nb; b++) {
            own += fy_sumsq_nchunks(c_all[b].hi - c_all[b].lo);
            all += fy_sumsq_nchunks(c_all[b].nelem);
        }
        if (st) st->nparts = all;
        if ((s = take(w, FY_CAT_WORKSPACE, (own ? own : 1) * sizeof(double), "norm chunk sums",
                      st ? (void *)&st->parts_dev : &tmp)) != FY_OK)
            goto done;
        carve(w, FY_CAT_WORKSPACE, all * sizeof(double), true, st ? (void *)&st->parts_host : &tmp);
    }
done:
    if (!chunks) free(c_all);
    return s;
}

void fy_storage_model_pinned(const fy_model *m, const fy_plan *plan, int T, bool training,
                             size_t pinned_cap, fy_mem_model *out) {
    memset(out, 0, sizeof *out);
    walk w = {.m = out, .pinned_cap = pinned_cap};
    fy_status s = layout(&w, m, plan, T, training, NULL, NULL);
    FY_ASSERT(s == FY_OK, "a dry storage walk cannot fail");
}

void fy_storage_model_for(const fy_model *m, const fy_plan *plan, int T, bool training,
                          fy_mem_model *out) {
    fy_storage_model_pinned(m, plan, T, training, SIZE_MAX, out);
}

void fy_storage_model(const fy_model *m, const fy_plan *plan, int T, fy_mem_model *out) {
    fy_storage_model_for(m, plan, T, true, out);
}

/* The storage's own tables, before a walk fills them. */
static fy_status storage_alloc(const fy_model *m, const fy_plan *plan, int T, bool training,
                               fy_storage **out) {
    *out = NULL;
    FY_TRY(fy_plan_check(plan, m));
    fy_storage *st = calloc(1, sizeof *st);
    if (!st) return FY_ERR_NOMEM;
    st->model = m;
    st->B = plan->micro_batch;
    st->T = T;
    st->training = training;
    fy_status s = fy_plan_copy(plan, &st->plan);
    if (s != FY_OK) { free(st); return s; }
    st->chunks = calloc((size_t)plan->nblocks, sizeof *st->chunks);
    st->acts = calloc((size_t)plan->nblocks, sizeof *st->acts);
    if (!st->chunks || !st->acts) { fy_storage_free(st); return FY_ERR_NOMEM; }
    *out = st;
    return FY_OK;
}

fy_status fy_storage_new(fy_dev *dev, const fy_model *m, const fy_plan *plan, int T,
                         bool training, fy_storage **out) {
    fy_storage *st;
    FY_TRY(storage_alloc(m, plan, T, training, &st));
    st->dev = dev;
    fy_mem_model dry;
    const size_t cap = fy_dev_pinned_cap(dev);
    fy_storage_model_pinned(m, plan, T, training, cap, &dry);
    char a[32], b[32];
    if (dry.pinned_over)
        fy_log_warn("pinned memory is capped at %s (--pinned-mem): %s of buffers the device "
                    "copies to and from are pageable (slower copies)", fy_fmt_size(cap, a, sizeof a),
                    fy_fmt_size(dry.pinned_over, b, sizeof b));
    /* the host arenas: the pinned one (pageable, with one warning, if the system will not
     * pin it), and the pageable one */
    st->arena_nbytes[1] = dry.host_pinned;
    st->arena_nbytes[0] = dry.host_total - dry.host_pinned;
    fy_status s = FY_OK;
    if (st->arena_nbytes[1]) {
        s = fy_dev_alloc(dev, FY_MEM_PINNED, st->arena_nbytes[1], "pinned host arena", &st->arena[1]);
        st->arena_pinned = s == FY_OK;
        if (s != FY_OK) {
            fy_log_warn("cannot pin %s of host memory: using pageable memory (slower copies)",
                        fy_fmt_size(st->arena_nbytes[1], a, sizeof a));
            s = fy_dev_alloc(dev, FY_MEM_HOST, st->arena_nbytes[1], "host arena", &st->arena[1]);
        }
    }
    if (s == FY_OK && st->arena_nbytes[0])
        s = fy_dev_alloc(dev, FY_MEM_HOST, st->arena_nbytes[0], "host arena", &st->arena[0]);
    if (s != FY_OK) goto fail;
    walk w = {.st = st, .alloc = true, .m = &st->mem, .pinned_cap = cap,
              .cur = {st->arena[0], st->arena[1]}};
    if ((s = layout(&w, m, plan, T, training, st->chunks, st)) != FY_OK) goto fail;
    FY_ASSERT(w.cur[0] - (char *)st->arena[0] == (ptrdiff_t)st->arena_nbytes[0] &&
              w.cur[1] - (char *)st->arena[1] == (ptrdiff_t)st->arena_nbytes[1] &&
              st->mem.device_total == dry.device_total,
              "the storage walk must be the same dry and real");
    if (st->gather.block >= 0) {
        const fy_block_spec *gb = fy_model_block(m, st->gather.block);
        for (int r = 0; r < gb->tensors[0].alloc_rows; r++) st->gather.map[r] = -1;
    }
    *out = st;
    return FY_OK;
fail:
    fy_storage_free(st);
    return s;
}

fy_status fy_storage_dry(const fy_model *m, const fy_plan *plan, int T, bool training,
                         fy_storage **out) {
    fy_storage *st;
    FY_TRY(storage_alloc(m, plan, T, training, &st));
    walk w = {.st = st, .alloc = false, .m = &st->mem, .pinned_cap = SIZE_MAX};
    fy_status s = layout(&w, m, plan, T, training, st->chunks, st);
    if (s != FY_OK) {
        fy_storage_free(st);
        return s;
    }
    *out = st;
    return FY_OK;
}

void fy_storage_free(fy_storage *st) {
    if (!st) return;
    for (int i = st->nallocs - 1; i >= 0; i--) fy_dev_release(st->dev, st->allocs[i]);
    if (st->dev) {
        fy_dev_release(st->dev, st->arena[0]);
        fy_dev_release(st->dev, st->arena[1]);
    }
    free(st->allocs);
    for (int r = 0; r < FY_RINGS; r++) {
        free(st->param_ring[r].slots);
        free(st->grad_ring[r].slots);
    }
    free(st->chunks);
    free(st->acts);
    fy_plan_free(&st->plan);
    free(st);
}

void fy_mem_model_print(const fy_mem_model *m, FILE *f) {
    char a[32], b[32];
    fprintf(f, "memory  %-12s %12s %12s\n", "", "device", "host");
    for (int c = 0; c < FY_CAT_COUNT; c++)
        fprintf(f, "        %-12s %12s %12s\n", cat_names[c], fy_fmt_size(m->device[c], a, sizeof a),
                fy_fmt_size(m->host[c], b, sizeof b));
    fprintf(f, "        %-12s %12s %12s\n", "total", fy_fmt_size(m->device_total, a, sizeof a),
            fy_fmt_size(m->host_total, b, sizeof b));
}
