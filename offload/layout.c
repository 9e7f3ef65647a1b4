/* layout.c — the placement of every state of a run (layout.h), decided in one place.
 *
 * place_block() is the policy: from a block's plan (resident or streamed weights, update
 * on the device or the CPU, kept or recomputed activations), the storage type and the
 * job's shards, the place of each of its states. The rest sizes what the blocks share:
 * the staging rings (the serial order's least slots, plus the plan's prefetch depth in
 * the layer ring), the landing slot, the activations' shared areas, the norm's chunk
 * sums. Nothing here allocates state; storage.c walks the result. */
#include "offload/layout.h"

#include <stdlib.h>
#include <string.h>

#include "engine/core/reduce.h"
#include "engine/core/util.h"
#include "offload/disk.h"

static const char *state_names[FY_STATES] = {"weights", "master", "host weights", "gradient",
                                             "adam m", "adam v", "spare master", "spare adam m",
                                             "spare adam v", "saved activations",
                                             "activations on the host"};
static const char *tier_names[] = {"none", "device", "pinned host", "host", "disk"};
const fy_state fy_disk_states[FY_DISK_STATES] = {FY_STATE_MASTER, FY_STATE_M, FY_STATE_V};

const char *fy_state_name(fy_state s) { return s < FY_STATES ? state_names[s] : "?"; }
const char *fy_tier_name(fy_tier t) { return t <= FY_TIER_DISK ? tier_names[t] : "?"; }

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

/* The shard of a block this rank updates: whole alone (or in evaluation); planning
 * (rank -1), the size of its largest shard. */
static void shard_of(fy_block_layout *bl, const fy_layout *L) {
    bl->lo = 0;
    bl->hi = bl->nelem;
    if (!fy_layout_sharded(L)) return;
    size_t off[FY_MAX_SHARDS + 1];
    fy_shard_bounds(bl->nelem, L->world, off);
    if (L->rank < 0) {
        bl->hi = 0;
        for (int r = 0; r < L->world; r++)
            if (off[r + 1] - off[r] > bl->hi) bl->hi = off[r + 1] - off[r];
        return;
    }
    bl->lo = off[L->rank];
    bl->hi = off[L->rank + 1];
}

/* A place of the whole block, of this rank's shard, or another state's buffer (written in
 * place: the tuner makes layouts by the hundred thousand). */
static void whole(fy_place *p, fy_tier tier, fy_dtype dt, size_t nelem, fy_mem_cat cat) {
    p->tier = tier;
    p->dtype = dt;
    p->lo = 0;
    p->hi = nelem;
    p->cat = cat;
    p->sharded = false;
    p->same_as = -1;
}
static void shard(fy_place *p, fy_tier tier, const fy_block_layout *bl, const fy_layout *L, fy_mem_cat cat) {
    p->tier = tier;
    p->dtype = FY_F32;
    p->lo = bl->lo;
    p->hi = bl->hi;
    p->cat = cat;
    p->sharded = fy_layout_sharded(L);
    p->same_as = -1;
}
static void alias(fy_place *p, fy_state of, const fy_place *owner) {
    /* field by field: the owner was just written the same way (a whole-struct copy would
     * read it back wider than it was stored) */
    p->tier = owner->tier;
    p->dtype = owner->dtype;
    p->lo = owner->lo;
    p->hi = owner->hi;
    p->cat = owner->cat;
    p->sharded = owner->sharded;
    p->same_as = (int8_t)of;
}

/* How block b's staged copies cut it (layout.h: fy_staging): rows for a streamed row
 * table updated on the CPU (a device update needs the whole table there), chunks for a
 * streamed vocab_chunks head so updated (or evaluated) whose classifier takes more than
 * one chunk. */
static fy_staging staging_of(const fy_block_spec *blk, const fy_block_plan *bp, const fy_layout *L) {
    const bool cpu_or_eval = !L->training || bp->update == FY_UPDATE_CPU;
    if (bp->weights != FY_ON_HOST || !cpu_or_eval) return FY_STAGE_WHOLE;
    if (blk->gather) return FY_STAGE_ROWS;
    if (blk->vocab_chunks && L->head_chunks.n > 1) return FY_STAGE_CHUNKS;
    return FY_STAGE_WHOLE;
}

/* How block b is staged: its staged copies' size, its ring, its gradient's staging and
 * the size of a fetch's slot. */
static void place_staging(fy_layout *L, int b, const fy_block_plan *bp, size_t layer_max) {
    const fy_block_spec *blk = fy_model_block(L->model, b);
    fy_block_layout *bl = &L->blocks[b];
    const size_t N = (size_t)L->B * L->T;
    bl->staging = staging_of(blk, bp, L);
    bl->stage_nelem = bl->nelem;
    const size_t rows = blk->ntensors ? (size_t)blk->tensors[0].alloc_rows : 0;
    bl->fwd_rows = bl->streamed && (blk->gather || blk->rows_fwd) && bl->staging != FY_STAGE_ROWS;
    bl->split_grad = false;
    for (int l = b + 1; l < L->nblocks && bl->fwd_rows && L->training && bl->update == FY_UPDATE_CPU; l++)
        for (int k = 0; k < fy_model_block(L->model, l)->nlinks; k++)
            bl->split_grad |= fy_model_block(L->model, l)->links[k] == b;
    if (bl->staging == FY_STAGE_ROWS || bl->fwd_rows) {
        bl->rows_nelem = (N < rows ? N : rows) * (size_t)blk->tensors[0].cols;
        L->rows_block = b;
    }
    if (bl->staging == FY_STAGE_ROWS) {
        bl->stage_nelem = bl->rows_nelem;
    } else if (bl->staging == FY_STAGE_CHUNKS) {
        bl->stage_nelem = fy_model_chunk_view_nelem(L->model, b, L->head_chunks);
    }
    bl->ring = blk->kind != FY_BLOCK_LAYER && bl->stage_nelem > layer_max ? FY_RING_LARGE : FY_RING_LAYER;
    const bool cpu = bl->update == FY_UPDATE_CPU;
    bl->grad_staged = L->training && (cpu || L->accum > 1);
    const size_t own = bl->hi - bl->lo, stbytes = bl->stage_nelem * L->es;
    if (bl->streamed) { /* a device update of a bf16 block fetches its shard's master and
                           room for the bf16 copy it writes */
        const size_t upd = L->dtype != FY_F32 && L->training && !cpu ? own * sizeof(float) + own * L->es : 0;
        bl->fetch_nbytes = upd > stbytes ? upd : stbytes;
    }
}

/* The policy: each state's place, from where the plan keeps it (plan.h: fy_plan_where;
 * in evaluation the master is wherever the weights are). */
static void place_states(fy_layout *L, fy_block_layout *bl, const fy_block_plan *bp) {
    fy_place *pl = bl->place;
    const bool lp = L->dtype != FY_F32, training = L->training, cpu = bl->update == FY_UPDATE_CPU;
    for (int s = 0; s < FY_STATES; s++) pl[s].same_as = -1; /* the rest is zero: none */
    if (!bl->streamed) whole(&pl[FY_STATE_WEIGHTS], FY_TIER_DEVICE, L->dtype, bl->nelem, FY_CAT_PARAMS);
    if (bl->streamed || (cpu && training))
        whole(&pl[FY_STATE_HOST_WEIGHTS], FY_TIER_PINNED, L->dtype, bl->nelem, FY_CAT_PARAMS);
    /* the master on the host in a buffer of its own, not the host weights': with bf16
     * storage, and in a sharded fp32 run for a block updated on the CPU whose gradient
     * lands in its host weights (its shard's master then has its own: 4 + 12/N host bytes
     * a parameter, not 4 + 4 + 8/N); pinned only when a device update of a streamed block
     * fetches it */
    const bool own_master = lp || (training && cpu && L->world > 1 && L->accum == 1) || bl->disk;
    const fy_where master = training ? fy_plan_where(bp, FY_PLAN_MASTER) : bp->weights;
    fy_place *mp = &pl[FY_STATE_MASTER];
    if (master == FY_ON_DISK)
        shard(mp, FY_TIER_DISK, bl, L, FY_CAT_PARAMS);
    else if (master == FY_ON_DEVICE && lp && training)
        shard(mp, FY_TIER_DEVICE, bl, L, FY_CAT_OPTIM);
    else if (master == FY_ON_DEVICE)
        alias(mp, FY_STATE_WEIGHTS, &pl[FY_STATE_WEIGHTS]);
    else if (own_master)
        shard(mp, bl->streamed && training && !cpu ? FY_TIER_PINNED : FY_TIER_HOST, bl, L, FY_CAT_PARAMS);
    else
        alias(mp, FY_STATE_HOST_WEIGHTS, &pl[FY_STATE_HOST_WEIGHTS]);
    if (!training) return;
    fy_place *gp = &pl[FY_STATE_GRAD];
    if (fy_plan_where(bp, FY_PLAN_GRAD) == FY_ON_DEVICE)
        whole(gp, FY_TIER_DEVICE, L->dtype, bl->nelem, FY_CAT_GRADS);
    else if (own_master && L->accum == 1 && !bl->speculate)
        alias(gp, FY_STATE_HOST_WEIGHTS, &pl[FY_STATE_HOST_WEIGHTS]);
    else
        whole(gp, FY_TIER_PINNED, L->dtype, bl->nelem, FY_CAT_GRADS);
    static const fy_tier moments_tier[FY_WHERES] = {FY_TIER_DEVICE, FY_TIER_HOST, FY_TIER_DISK};
    const fy_tier mt = moments_tier[fy_plan_where(bp, FY_PLAN_MOMENTS)];
    shard(&pl[FY_STATE_M], mt, bl, L, FY_CAT_OPTIM);
    shard(&pl[FY_STATE_V], mt, bl, L, FY_CAT_OPTIM);
    if (!bl->speculate) return;
    const fy_place *owner = &pl[fy_layout_buffer_of(L, (int)(bl - L->blocks), FY_STATE_MASTER)];
    fy_place *sp = &pl[FY_STATE_SPARE_MASTER];
    whole(sp, owner->tier, FY_F32, 0, FY_CAT_PARAMS);
    sp->lo = mp->lo;
    sp->hi = mp->hi;
    shard(&pl[FY_STATE_SPARE_M], FY_TIER_HOST, bl, L, FY_CAT_OPTIM);
    shard(&pl[FY_STATE_SPARE_V], FY_TIER_HOST, bl, L, FY_CAT_OPTIM);
}

static void place_block(fy_layout *L, int b, const fy_block_plan *bp, size_t layer_max) {
    fy_block_layout *bl = &L->blocks[b];
    bl->nelem = fy_model_block(L->model, b)->nelem;
    bl->streamed = bp->weights == FY_ON_HOST;
    bl->recompute = bp->acts != FY_ACTS_KEEP;
    bl->offload_in = L->training && bp->acts == FY_ACTS_OFFLOAD && b > 0;
    if (bl->offload_in) L->blocks[b - 1].out_offloaded = true;
    bl->update = bp->update;
    bl->speculate = bp->speculate && L->training;
    shard_of(bl, L);
    bl->disk = bp->disk && L->training;
    if (bl->disk) bl->disk_chunks = (int)((bl->hi - bl->lo + L->disk_chunk - 1) / L->disk_chunk);
    place_staging(L, b, bp, layer_max);
    place_states(L, bl, bp);
}

/* The least slots each ring needs for the serial order to run. Parameters: the most
 * streamed blocks of the ring one task uses at once (a block and the blocks it links to).
 * Gradients: walking backward from the head, the most staged gradients of the ring open
 * at once: a block's own during its backward, and a linked block's from the backward of
 * the block linking to it until its own (it is opened by the first writer). */
static fy_status min_slots(const fy_layout *L, int np[FY_RINGS], int ng[FY_RINGS]) {
    const int nb = L->nblocks;
    bool *held = calloc((size_t)nb, sizeof *held);
    if (!held) return FY_ERR_NOMEM;
    int nheld[FY_RINGS] = {0};
    for (int r = 0; r < FY_RINGS; r++) np[r] = ng[r] = 0;
    for (int b = nb - 1; b >= 0; b--) {
        const fy_block_spec *blk = fy_model_block(L->model, b);
        const fy_block_layout *c = L->blocks;
        int p[FY_RINGS] = {0}, open[FY_RINGS] = {0};
        p[c[b].ring] += c[b].streamed;
        open[c[b].ring] += c[b].grad_staged && !held[b];
        for (int k = 0; k < blk->nlinks; k++) {
            const int l = blk->links[k];
            p[c[l].ring] += c[l].streamed;
            open[c[l].ring] += c[l].grad_staged && !held[l];
        }
        for (int r = 0; r < FY_RINGS; r++) {
            if (p[r] > np[r]) np[r] = p[r];
            if (nheld[r] + open[r] > ng[r]) ng[r] = nheld[r] + open[r];
        }
        for (int k = 0; k < blk->nlinks; k++) {
            const int l = blk->links[k];
            if (c[l].grad_staged && !held[l]) { held[l] = true; nheld[c[l].ring]++; }
        }
        if (held[b]) { held[b] = false; nheld[c[b].ring]--; }
    }
    free(held);
    return FY_OK;
}

/* The rings' slot counts and sizes, and the landing slot. */
static fy_status size_rings(fy_layout *L, int prefetch) {
    int np[FY_RINGS], ng[FY_RINGS];
    FY_TRY(min_slots(L, np, ng));
    if (np[FY_RING_LAYER]) np[FY_RING_LAYER] += prefetch;
    if (ng[FY_RING_LAYER]) ng[FY_RING_LAYER] += prefetch;
    for (int r = 0; r < FY_RINGS; r++) {
        L->param_ring[r].n = np[r];
        L->grad_ring[r].n = ng[r];
    }
    /* disk: a chunk read ahead, one updated, one written back (with prefetch 1) */
    for (int b = 0; b < L->nblocks; b++) {
        const fy_block_layout *bl = &L->blocks[b];
        if (!bl->disk_chunks) continue;
        const size_t k = bl->hi - bl->lo < L->disk_chunk ? bl->hi - bl->lo : L->disk_chunk;
        const size_t nbytes = FY_DISK_STATES * fy_disk_align_up(k * sizeof(float));
        L->disk_ring.n = 2 + prefetch;
        if (nbytes > L->disk_ring.nbytes) L->disk_ring.nbytes = nbytes;
    }
    for (int b = 0; b < L->nblocks; b++) {
        const fy_block_layout *bl = &L->blocks[b];
        const size_t st = bl->stage_nelem * L->es;
        size_t *ps = &L->param_ring[bl->ring].nbytes, *gs = &L->grad_ring[bl->ring].nbytes;
        if (bl->streamed && bl->fetch_nbytes > *ps) *ps = bl->fetch_nbytes;
        if (!bl->grad_staged) continue;
        if (st > *gs) *gs = st;
        if (bl->update == FY_UPDATE_CPU && (L->accum > 1 || bl->staging == FY_STAGE_ROWS) &&
            st > L->landing_nbytes)
            L->landing_nbytes = st;
    }
    return FY_OK;
}

/* Activations: each block's, the area recomputed blocks share, the workspace and the
 * activation gradient (the largest of each). */
static void size_acts(fy_layout *L) {
    for (int b = 0; b < L->nblocks; b++) {
        fy_block_layout *bl = &L->blocks[b];
        fy_act_sizes a;
        fy_model_acts(L->model, b, L->B, L->T, L->dtype, L->training, &a);
        bl->saved_nbytes = a.saved;
        bl->out_nbytes = a.out;
        if (bl->recompute && a.saved > L->shared_saved_nbytes) L->shared_saved_nbytes = a.saved;
        if (a.work > L->work_nbytes) L->work_nbytes = a.work;
        if (a.out > L->dx_nbytes) L->dx_nbytes = a.out;
        whole(&bl->place[FY_STATE_SAVED], a.saved ? FY_TIER_DEVICE : FY_TIER_NONE, FY_DTYPE_NONE,
              a.saved, FY_CAT_ACTS);
        if (bl->out_offloaded) { /* the host copy; on the device a slot of the ring */
            whole(&bl->place[FY_STATE_HOST_ACTS], FY_TIER_PINNED, FY_DTYPE_NONE, a.out, FY_CAT_ACTS);
            if (a.out > L->act_ring.nbytes) L->act_ring.nbytes = a.out;
        }
    }
    if (!L->training) L->dx_nbytes = 0;
}

fy_status fy_layout_new(const fy_model *m, const fy_plan *plan, int T, bool training, int world,
                        int rank, fy_layout *out) {
    memset(out, 0, sizeof *out);
    return fy_layout_renew(m, plan, T, training, world, rank, out);
}

fy_status fy_layout_renew(const fy_model *m, const fy_plan *plan, int T, bool training, int world,
                          int rank, fy_layout *out) {
    FY_TRY(fy_plan_check(plan, m));
    if (world > FY_MAX_SHARDS || rank >= world || rank < -1) {
        fy_log_error("rank %d of a job of %d: at most %d ranks", rank, world, FY_MAX_SHARDS);
        return FY_ERR_INVALID;
    }
    for (int b = 0; b < plan->nblocks && world > 1 && training; b++)
        if (plan->blocks[b].speculate) {
            fy_log_error("plan block %s: a speculative update runs in one process (a job's "
                         "norm is known only after its reduces)", fy_model_block(m, b)->name);
            return FY_ERR_INVALID;
        }
    fy_layout *L = out;
    fy_block_layout *table = L->blocks;
    const int cap = L->cap;
    memset(L, 0, sizeof *L);
    L->blocks = table;
    L->cap = cap;
    L->model = m;
    L->nblocks = plan->nblocks;
    L->B = plan->micro_batch;
    L->T = T;
    L->accum = plan->grad_accum;
    L->world = world > 1 ? world : 1;
    L->rank = world > 1 ? rank : 0;
    L->training = training;
    L->dtype = plan->dtype == FY_BF16 ? FY_BF16 : FY_F32;
    L->es = fy_dtype_size(L->dtype);
    L->rows_block = -1;
    L->disk_chunk = plan->disk_chunk ? plan->disk_chunk : FY_DISK_CHUNK;
    if (L->cap < L->nblocks) {
        free(L->blocks);
        L->cap = 0;
        if (!(L->blocks = malloc((size_t)L->nblocks * sizeof *L->blocks))) return FY_ERR_NOMEM;
        L->cap = L->nblocks;
    }
    memset(L->blocks, 0, (size_t)L->nblocks * sizeof *L->blocks);
    if (fy_model_block(m, L->nblocks - 1)->vocab_chunks)
        L->head_chunks = fy_model_head_chunks(m, L->B, T, L->dtype);
    size_t layer_max = 0;
    for (int b = 0; b < L->nblocks; b++)
        if (fy_model_block(m, b)->kind == FY_BLOCK_LAYER && fy_model_block(m, b)->nelem > layer_max)
            layer_max = fy_model_block(m, b)->nelem;
    for (int b = 0; b < L->nblocks; b++) place_block(L, b, &plan->blocks[b], layer_max);
    fy_status st = size_rings(L, plan->prefetch);
    if (st != FY_OK) { fy_layout_free(L); return st; }
    size_acts(L);
    /* offloaded inputs: the forward holds two (a layer's input until its copy leaves, and
     * its output), the backward two (a layer's input, and its output until its recompute
     * rewrites it), and the plan's prefetch depth more; never more than there are inputs
     * offloaded (so offloading one layer's saves its buffer, not adds two) */
    int offloaded = 0; /* at most one unit each is ever held */
    for (int b = 0; b < L->nblocks; b++) offloaded += L->blocks[b].out_offloaded;
    if (L->act_ring.nbytes) L->act_ring.n = 2 + plan->prefetch < offloaded ? 2 + plan->prefetch : offloaded;
    L->tok_parts = L->rows_block >= 0 ? 4 : 3;
    L->docs_part = L->tok_parts - 1;
    if (fy_layout_sharded(L))
        for (int b = 0; b < L->nblocks; b++) {
            L->own_parts += fy_sumsq_nchunks(L->blocks[b].hi - L->blocks[b].lo);
            L->nparts += fy_sumsq_nchunks(L->blocks[b].nelem);
        }
    return FY_OK;
}

void fy_layout_free(fy_layout *L) {
    free(L->blocks);
    L->blocks = NULL;
    L->cap = 0;
}
