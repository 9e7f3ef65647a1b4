/* step_graph.c — training steps (and evaluation) as task graphs for the scheduler.
 *
 * For each step of a window and each micro-batch m of it (the builders below):
 *   forward   load(m)          h2d      micro-batch m into the token buffer m%2 (and a
 *                                       gathered block's rows: its distinct tokens)
 *             h2d_param(b)     h2d      a streamed block's parameters into a staging slot
 *                                       (a gathered block's rows, a chunked head's chunk)
 *             fwd(b)           compute  the embedding, then each layer
 *   head      gopen(l)         compute  a zeroed gradient slot for a staged block l the
 *                                       head adds into before l's own backward (links)
 *             head(m)          compute  the head's loss pass: forward, loss and backward;
 *                                       a chunked head's, one task per vocabulary chunk
 *                                       forward, the last with its chunk's backward
 *   backward  bwd(head, k)     compute  a chunked head: each earlier chunk's backward
 *             recompute(b)     compute  a checkpointed layer's forward again
 *             bwd(b)           compute  layers, then the embedding
 *             d2h_grad(b)      d2h      a cpu-optimised block's gradient to the host (a
 *                                       chunked head's chunk by chunk; a gathered block's
 *                                       rows, scattered on the host)
 * and once per step:
 *   reduce    reduce(b)        comm     data parallel: each block's gradient summed over
 *                                       the ranks into each shard's owner (reduce-scatter,
 *                                       offload/storage.h), in one order on every rank,
 *                                       and the chunk sums of its shard's norm
 *   update    norm(t)          cpu      global gradient norm, clip coefficient, mean loss
 *             adam_gpu(b)      compute  (with h2d_param and d2h_param around it when streamed)
 *             adam_cpu(b)      cpu      optim_cpu on the host master
 *             allgather(b)     comm     data parallel: each shard's updated weights from
 *                                       its owner, block 0 first
 *             h2d_update(b)    h2d      updated weights back to a resident block
 * Evaluation is forward and head (without backward) per batch, and collect(m) (cpu),
 * which reads the batch's loss.
 *
 * Every task carries a typed payload (sg_task: the union member of its kind). Blocks
 * are known through the model interface: their kinds, their links (the blocks whose
 * parameters a block reads and whose gradients it adds into), their passes.
 *
 * Dependencies are the data flow (each read after its write) plus the reuse of buffers
 * (a write after the previous reads: activations, the recompute buffer, token buffers,
 * the host landing slot). The compute tasks' program positions give the next-use
 * priorities, across the steps of the window: after backward, block 0's gradient copy
 * and update come first because the next forward needs block 0 first. Staging slots are
 * the scheduler's pools: a task that takes a slot learns which task freed it last.
 *
 * Event chaining: a task queues its work on its lane's stream and records an event at
 * its end (and one at its start, for timing); a task waits for its predecessors' (and its
 * slot's previous user's) events on the device, so lanes run ahead without host round
 * trips. The host blocks only where it reads what the device wrote: the cpu lane's tasks
 * (the norm reads losses and norms, CPU Adam reads gradients, collect reads losses), the
 * host buffers a load or a gradient accumulation reuses, and the end of the window. A
 * device lane keeps at most FY_RUN_AHEAD tasks queued and waits before it picks the next
 * (lane_wait), so its picks are made by what is ready then, not committed far ahead. The
 * serial schedule also waits for each task's work, so it measures tasks one at a time.
 * Task durations are the device's, from the events.
 *
 * Exactness: clipping needs the global norm before any update, so every update of step
 * t waits for norm(t) (the "norm barrier"; fy_trainer_predict can simulate the graph
 * without it to measure what exact clipping costs in overlap); the arithmetic is that
 * of the serial order, task by task, so every schedule mode gives bit-identical results.
 *
 * Failure: each step is an epoch of the scheduler: a failing task cancels its step and
 * later ones, earlier steps finish; the trainer rolls its counters back to the last
 * finished step, and is broken only if the failing step had started updating. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/dtype.h"
#include "engine/core/reduce.h"
#include "engine/core/util.h"
#include "engine/device/kernels.h"
#include "engine/trainer_impl.h"

static const char *kind_names[FY_T_COUNT] = {
    "load", "h2d_param", "fwd", "gopen", "head", "recompute", "bwd", "d2h_grad", "norm",
    "adam_gpu", "d2h_param", "adam_cpu", "h2d_update", "collect", "reduce", "allgather"};

const char *fy_task_kind_name(int kind) {
    return kind >= 0 && kind < FY_T_COUNT ? kind_names[kind] : "?";
}

#define ML FY_MODEL_MAX_LINKS

/* A pass gives back its own fetch, its links' fetches and its own gradient unit. */
_Static_assert(FY_MODEL_MAX_LINKS + 2 <= FY_SCHED_MAX_RELEASES,
               "the scheduler must hold every unit a pass gives back");

/* Where a gradient a task writes lives: the unit of task `holder` (a gopen, or the task
 * itself), or, with holder -1, the block's device accumulator; `first`: the task writes
 * it first in its micro-batch (opens it: zeroes the accumulator on the first
 * micro-batch; a unit it took itself is zeroed always). */
typedef struct sg_grad { int holder; bool first; } sg_grad;

/* The payloads. */
struct sg_task {
    int micro;                 /* micro-batch in the window; per-step tasks: the step's last */
    int chunk;                 /* a chunked head's tasks (fetch, head, bwd, d2h_grad): the
                                  vocabulary chunk they work on; else -1 */
    union {
        struct { int reuse; } load;               /* the load that last used its host buffer */
        struct { bool for_update; } fetch;        /* h2d_param: for a device update (fp32
                                                     master), else for compute */
        struct {                                  /* fwd, recompute, head, bwd */
            int fetch;                            /* the block's fetch task, -1 resident */
            int link_fetch[ML];                   /* the linked blocks' fetches */
            sg_grad grad;                         /* head, bwd: the block's gradient */
            sg_grad link_grad[ML];                /* head, bwd: the linked blocks' */
            bool train;                           /* head: training (else evaluation) */
        } pass;
        struct { int holder; } d2h_grad;          /* the task whose unit holds it */
        struct { int fetch; } update;             /* adam_gpu, d2h_param: the update's
                                                     fetch, -1 resident */
    } u;
};

/* ---- helpers shared by the runners --------------------------------------------------- */

static int accum(const fy_trainer *tr) { return tr->plan.grad_accum; }
static bool staged(const fy_trainer *tr, int b) { return tr->st->chunks[b].needs_grad_staging; }
static fy_ring_id ring(const fy_trainer *tr, int b) { return tr->st->chunks[b].ring; }
static size_t tokens_n(const fy_trainer *tr) { return (size_t)tr->plan.micro_batch * tr->st->T; }
static int step_of(const fy_trainer *tr, const sg_task *p) { return p->micro / accum(tr); }
/* The batch number next_batch is asked for: evaluation's, or training's counted from the
 * trainer's first step; in a data-parallel job the step's global numbers, this rank
 * taking its A from micro_first on of each step's micro_total (trainer.h). */
static int64_t abs_micro(const fy_trainer *tr, const sg_task *p) {
    if (tr->eval) return tr->eval_base + p->micro;
    const int64_t m = tr->micro_base + p->micro, A = accum(tr);
    return (m / A) * tr->micro_total + tr->micro_first + m % A;
}
/* Whether gradients are summed over the ranks (their norm is then taken after), each
 * rank holding and updating its shard of the optimizer state (storage.h). */
static bool dp(const fy_trainer *tr) { return tr->world > 1; }
/* Block b's fp32 master from element i of its shard on: the shard's own buffer (indexed
 * from lo; storage.h: apart) or the whole fp32 weights that are also the master. */
static float *master_at(const fy_trainer *tr, float *whole_or_shard, int b, size_t i) {
    const fy_chunk *c = &tr->st->chunks[b];
    return c->apart ? whole_or_shard + (i - c->lo) : whole_or_shard + i;
}

/* The buffer of the unit task `id` took from a parameter or a gradient pool: its block's
 * ring (a fetch's block, a gopen's, or a backward pass's own). */
static void *param_unit(const fy_trainer *tr, int id) {
    const fy_task *t = &tr->graph->tasks[id];
    return tr->st->param_ring[tr->st->chunks[t->block].ring].slots[t->unit];
}
static void *grad_unit(const fy_trainer *tr, int id) {
    const fy_task *t = &tr->graph->tasks[id];
    return tr->st->grad_ring[tr->st->chunks[t->block].ring].slots[t->unit];
}

/* Block b's parameters: the slot of fetch task `fetch`, or the resident copy. */
static const void *params_for(const fy_trainer *tr, int b, int fetch) {
    return fetch >= 0 ? param_unit(tr, fetch) : tr->st->chunks[b].param_dev;
}

/* Micro-batch m's token buffer: inputs, targets, and with a gathered block the inputs
 * renumbered into its rows. */
static int32_t *tokens_dev(const fy_trainer *tr, int m) {
    return tr->st->tok_dev + (size_t)(m % 2) * tr->st->tok_parts * tokens_n(tr);
}
static bool gathered(const fy_trainer *tr, int b) { return tr->st->chunks[b].gathered; }
/* A block's staged copy (a slot's parameters or gradient) in bytes: the whole block, or
 * a gathered block's rows. */
static size_t stage_nbytes(const fy_trainer *tr, int b) {
    return tr->st->chunks[b].stage_nelem * tr->st->es;
}

static fy_stream *lane_stream(const fy_trainer *tr, fy_lane lane) {
    switch (lane) {
    case FY_LANE_COMPUTE: return tr->s;
    case FY_LANE_H2D: return tr->s_h2d;
    case FY_LANE_D2H: return tr->s_d2h;
    case FY_LANE_COMM: return tr->s_comm;
    default: return NULL; /* the cpu lane works on the host */
    }
}

/* Block b's gradient for a task writing it in micro-batch a (g says where; see sg_grad),
 * opened (zeroed) here when the task writes it first. */
static void *grad_open(fy_trainer *tr, int b, int a, sg_grad g, int self) {
    void *buf = g.holder >= 0 ? grad_unit(tr, g.holder) : tr->st->chunks[b].grad_dev;
    if (g.first && (g.holder == self || (g.holder < 0 && a == 0)))
        fy_memset_async(tr->s, buf, 0, g.holder >= 0 ? stage_nbytes(tr, b) : fy_tr_nbytes(tr, b));
    return buf;
}

/* Micro-batch a's gradient of block b is complete in g (its last writer ran): a staged
 * gpu-optimised block adds it into its device accumulator (the first micro-batch copies),
 * and on the last micro-batch the sum of squares is taken where the final gradient is
 * (on the host, by d2h_grad, when a cpu-optimised block accumulates there). */
static void grad_close(fy_trainer *tr, int b, int a, const void *g) {
    const fy_chunk *c = &tr->st->chunks[b];
    fy_storage *st = tr->st;
    if (!fy_tr_cpu_optim(tr, b) && staged(tr, b)) {
        if (a == 0) fy_copy_async(tr->s, c->grad_dev, g, fy_tr_nbytes(tr, b), FY_D2D);
        else fy_k_residual_fwd(c->grad_dev, c->grad_dev, g, c->nelem, tr->s);
    }
    /* a gathered or chunked block's norm is taken on the host, a data-parallel job's
     * after the sum over ranks */
    if (a != accum(tr) - 1 || c->gathered || c->chunked || dp(tr)) return;
    const void *final = !fy_tr_cpu_optim(tr, b) ? c->grad_dev : accum(tr) == 1 ? g : NULL;
    if (!final) return;
    fy_k_sumsq(st->sumsq_dev + b, final, c->nelem, tr->s);
    fy_copy_async(tr->s, st->sumsq_host + b, st->sumsq_dev + b, sizeof(double), FY_D2H);
}

/* A pass's device views: activations and tokens of micro-batch m, parameters of the
 * block and its links. */
static fy_block_io pass_io(const fy_trainer *tr, int b, const sg_task *p) {
    const fy_storage *st = tr->st;
    const fy_block_spec *blk = fy_tr_block(tr, b);
    fy_block_io io = {.B = tr->plan.micro_batch, .T = st->T,
                      .params = params_for(tr, b, p->u.pass.fetch),
                      .in = b > 0 ? st->acts[b - 1].out : NULL, .out = st->acts[b].out,
                      .saved = st->acts[b].saved, .work = st->work, .dx = st->dx,
                      .tokens = tokens_dev(tr, p->micro) + (gathered(tr, b) ? 2 * tokens_n(tr) : 0),
                      .targets = tokens_dev(tr, p->micro) + tokens_n(tr)};
    for (int k = 0; k < blk->nlinks; k++)
        io.link_params[k] = params_for(tr, blk->links[k], p->u.pass.link_fetch[k]);
    if (gathered(tr, b)) io.table_rows = st->gather.nrows[p->micro % 2];
    return io;
}

/* The gradients a backward pass writes: the block's and its links'. */
static void bind_grads(fy_trainer *tr, int b, const sg_task *p, int self, fy_block_io *io) {
    const fy_block_spec *blk = fy_tr_block(tr, b);
    const int a = p->micro % accum(tr);
    io->grads = grad_open(tr, b, a, p->u.pass.grad, self);
    for (int k = 0; k < blk->nlinks; k++)
        io->link_grads[k] = grad_open(tr, blk->links[k], a, p->u.pass.link_grad[k], self);
}

/* The scale of a training step's mean loss: 1/(B*T x the step's micro-batches, over all
 * ranks). */
static float loss_scale(const fy_trainer *tr) {
    return (float)(1.0 / ((double)tokens_n(tr) * (double)tr->micro_total));
}

/* ---- runners: each queues its block's work on its lane ---------------------------------- */

typedef fy_status (*runner)(fy_trainer *tr, int id, const fy_task *t, const sg_task *p);

static int cmp_i32(const void *a, const void *b) {
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* The gathered block's rows for token buffer `buf` (the distinct inputs, in increasing
 * order), and the inputs renumbered into them (out). */
static fy_status gather_rows(fy_storage *st, int buf, const int32_t *tok, int32_t *out, size_t N) {
    const fy_block_spec *blk = fy_model_block(st->model, st->gather.block);
    const uint32_t nrows = (uint32_t)blk->tensors[0].alloc_rows;
    int32_t *rows = st->gather.rows + (size_t)buf * N, *map = st->gather.map;
    size_t n = 0;
    for (size_t i = 0; i < N; i++) {
        if ((uint32_t)tok[i] >= nrows) { /* the data layer keeps tokens in the vocabulary */
            for (size_t k = 0; k < n; k++) map[rows[k]] = -1;
            fy_log_error("token %d outside the vocabulary (%u)", (int)tok[i], nrows);
            return FY_ERR_INVALID;
        }
        if (map[tok[i]] < 0) { map[tok[i]] = 0; rows[n++] = tok[i]; }
    }
    qsort(rows, n, sizeof *rows, cmp_i32);
    for (size_t k = 0; k < n; k++) map[rows[k]] = (int32_t)k;
    for (size_t i = 0; i < N; i++) out[i] = map[tok[i]];
    for (size_t k = 0; k < n; k++) map[rows[k]] = -1;
    st->gather.nrows[buf] = (int)n;
    return FY_OK;
}

static fy_status run_load(fy_trainer *tr, int id, const fy_task *t, const sg_task *p) {
    fy_storage *st = tr->st;
    const size_t N = tokens_n(tr), parts = (size_t)st->tok_parts;
    int32_t *h = st->tok_host + (size_t)(p->micro % 2) * parts * N;
    if (p->u.load.reuse >= 0) fy_event_sync(tr->ev_end[p->u.load.reuse]); /* its copy is done */
    FY_TRY(tr->next_batch(tr->batch_ctx, abs_micro(tr, p), h, h + N));
    if (st->gather.block >= 0) FY_TRY(gather_rows(st, p->micro % 2, h, h + 2 * N, N));
    fy_copy_async(tr->s_h2d, tokens_dev(tr, p->micro), h, parts * N * sizeof(int32_t), FY_H2D);
    return FY_OK;
}

/* A chunked head's fetch of chunk k: the chunk view (model.h), its classifier rows then
 * the head's other tensors. */
static void fetch_chunk(fy_trainer *tr, int b, int k, void *slot) {
    const fy_storage *st = tr->st;
    size_t ro, rn, to, tn;
    fy_model_chunk_ranges(tr->model, b, st->head_chunks, k, &ro, &rn, &to, &tn);
    const char *src = (const char *)st->chunks[b].param_lp;
    fy_copy_async(tr->s_h2d, slot, src + ro * st->es, rn * st->es, FY_H2D);
    fy_copy_async(tr->s_h2d, (char *)slot + (st->chunks[b].stage_nelem - tn) * st->es,
                  src + to * st->es, tn * st->es, FY_H2D);
}

/* A gathered block's fetch: the micro-batch's rows of its storage-type copy, gathered
 * into the pinned buffer (once the previous gathered fetch's copy out of it is done). */
static void fetch_rows(fy_trainer *tr, int id, int b, int micro, void *slot) {
    fy_storage *st = tr->st;
    const size_t row = (size_t)fy_tr_block(tr, b)->tensors[0].cols * st->es;
    const int buf = micro % 2, n = st->gather.nrows[buf];
    const int32_t *rows = st->gather.rows + (size_t)buf * tokens_n(tr);
    if (tr->gather_last >= 0) fy_event_sync(tr->ev_end[tr->gather_last]);
    char *dst = st->gather.host;
    const char *src = (const char *)st->chunks[b].param_lp;
    for (int k = 0; k < n; k++) memcpy(dst + (size_t)k * row, src + (size_t)rows[k] * row, row);
    fy_copy_async(tr->s_h2d, slot, dst, (size_t)n * row, FY_H2D);
    tr->gather_last = id;
}

/* h2d_param: the storage type's copy for compute; for a device update with bf16 storage,
 * the fp32 master of its shard (the bf16 copy the update writes follows it in the slot). */
static fy_status run_h2d_param(fy_trainer *tr, int id, const fy_task *t, const sg_task *p) {
    const fy_chunk *c = &tr->st->chunks[t->block];
    void *slot = param_unit(tr, id);
    if (c->gathered) fetch_rows(tr, id, t->block, p->micro, slot);
    else if (p->chunk >= 0) fetch_chunk(tr, t->block, p->chunk, slot);
    else if (p->u.fetch.for_update && fy_tr_lp(tr)) /* its shard's */
        fy_copy_async(tr->s_h2d, slot, c->param_host, (c->hi - c->lo) * sizeof(float), FY_H2D);
    else
        fy_copy_async(tr->s_h2d, slot, c->param_lp, fy_tr_nbytes(tr, t->block), FY_H2D);
    return FY_OK;
}

/* fwd and recompute: the same pass, so a recomputed block rebuilds the same bits. */
static fy_status run_fwd(fy_trainer *tr, int id, const fy_task *t, const sg_task *p) {
    fy_block_io io = pass_io(tr, t->block, p);
    fy_model_forward(tr->model, t->block, &io, tr->s);
    return FY_OK;
}

static fy_status run_gopen(fy_trainer *tr, int id, const fy_task *t, const sg_task *p) {
    fy_memset_async(tr->s, grad_unit(tr, id), 0, fy_tr_nbytes(tr, t->block));
    return FY_OK;
}

/* head: the loss pass; in training also its backward, and the loss goes to the host. */
static fy_status run_head(fy_trainer *tr, int id, const fy_task *t, const sg_task *p) {
    fy_storage *st = tr->st;
    const int b = t->block;
    fy_block_io io = pass_io(tr, b, p);
    /* a chunked head: chunk k's forward; the last writes the loss, and in training also
     * runs its backward into the gradient unit it took */
    const bool last = p->chunk < 0 || p->chunk == st->head_chunks.n - 1;
    io.chunked = p->chunk >= 0;
    io.chunk = p->chunk;
    if (!p->u.pass.train) { /* evaluation: one loss slot per batch in flight */
        const int slot = p->micro % accum(tr);
        io.loss = st->loss_dev + slot;
        fy_model_loss(tr->model, b, &io, tr->s);
        if (last) fy_copy_async(tr->s, st->loss_host + slot, st->loss_dev + slot, sizeof(float), FY_D2H);
        return FY_OK;
    }
    const int a = p->micro % accum(tr);
    io.dloss = loss_scale(tr);
    io.loss = st->loss_dev + a;
    if (last) bind_grads(tr, b, p, id, &io);
    fy_model_loss(tr->model, b, &io, tr->s);
    if (!last) return FY_OK;
    fy_copy_async(tr->s, st->loss_host + a, st->loss_dev + a, sizeof(float), FY_D2H);
    grad_close(tr, b, a, io.grads);
    return FY_OK;
}

static fy_status run_bwd(fy_trainer *tr, int id, const fy_task *t, const sg_task *p) {
    const int b = t->block;
    fy_block_io io = pass_io(tr, b, p);
    if (p->chunk >= 0) { /* a chunked head's backward of chunk k (its forward ran) */
        io.chunked = io.chunk_bwd = true;
        io.chunk = p->chunk;
        io.dloss = loss_scale(tr);
        bind_grads(tr, b, p, id, &io);
        fy_model_loss(tr->model, b, &io, tr->s);
        return FY_OK;
    }
    bind_grads(tr, b, p, id, &io);
    fy_model_backward(tr->model, b, &io, tr->s);
    grad_close(tr, b, p->micro % accum(tr), io.grads);
    return FY_OK;
}

/* The sum of squares of n elements of the storage type in host memory (fy_k_sumsq's
 * bits on the cpu backend). */
static double host_sumsq(const fy_trainer *tr, const void *g, size_t n) {
    return fy_tr_lp(tr) ? fy_sumsq_bf16((const uint16_t *)g, n) : fy_sumsq((const float *)g, n);
}

/* The host's sum of micro-batch gradients: acc[i] += add[i] for n elements of the
 * storage type (the device's accumulation). */
static void host_add(const fy_trainer *tr, void *acc, const void *add, size_t n) {
    fy_add_n(fy_tr_dt(tr), acc, add, n);
}

/* A gathered block's d2h_grad: its rows' gradient lands in the landing slot and is
 * scattered into grad_host, which the first micro-batch zeroes; the rows no token chose
 * get nothing, as their gradient in the whole table is zero. The norm is taken over the
 * whole table, as an accumulated block's. */
static void scatter_rows(fy_trainer *tr, int b, int micro, const void *g) {
    fy_storage *st = tr->st;
    const fy_chunk *c = &st->chunks[b];
    const size_t row = (size_t)fy_tr_block(tr, b)->tensors[0].cols * st->es;
    const int buf = micro % 2, n = st->gather.nrows[buf], a = micro % accum(tr);
    const int32_t *rows = st->gather.rows + (size_t)buf * tokens_n(tr);
    char *tmp = (char *)st->grad_host_tmp, *acc = (char *)c->grad_host;
    fy_copy_async(tr->s_d2h, tmp, g, (size_t)n * row, FY_D2H);
    fy_stream_sync(tr->s_d2h);
    if (a == 0) memset(acc, 0, fy_tr_nbytes(tr, b));
    for (int k = 0; k < n; k++) {
        if (a == 0) memcpy(acc + (size_t)rows[k] * row, tmp + (size_t)k * row, row);
        else host_add(tr, acc + (size_t)rows[k] * row, tmp + (size_t)k * row, row / st->es);
    }
    if (a == accum(tr) - 1 && !dp(tr)) st->sumsq_host[b] = host_sumsq(tr, acc, c->nelem);
}

/* A chunked head's d2h_grad of chunk k: its rows' gradient (and with k = 0, the last,
 * the other tensors') into grad_host's, directly for the first micro-batch, else through
 * the landing slot and added; the last chunk of the step's last micro-batch takes the
 * norm over the whole gradient (the earlier chunks' copies are before it on the stream). */
static void land_chunk(fy_trainer *tr, int b, int micro, int k, const void *g) {
    fy_storage *st = tr->st;
    const fy_chunk *c = &st->chunks[b];
    const int a = micro % accum(tr);
    const size_t es = st->es;
    size_t ro, rn, to, tn;
    fy_model_chunk_ranges(tr->model, b, st->head_chunks, k, &ro, &rn, &to, &tn);
    const char *gt = (const char *)g + (c->stage_nelem - tn) * es;
    char *acc = (char *)c->grad_host, *tmp = (char *)st->grad_host_tmp;
    if (a == 0) {
        fy_copy_async(tr->s_d2h, acc + ro * es, g, rn * es, FY_D2H);
        if (k == 0) fy_copy_async(tr->s_d2h, acc + to * es, gt, tn * es, FY_D2H);
    } else {
        fy_copy_async(tr->s_d2h, tmp, g, rn * es, FY_D2H);
        if (k == 0) fy_copy_async(tr->s_d2h, tmp + rn * es, gt, tn * es, FY_D2H);
        fy_stream_sync(tr->s_d2h);
        host_add(tr, acc + ro * es, tmp, rn);
        if (k == 0) host_add(tr, acc + to * es, tmp + rn * es, tn);
    }
    if (k != 0 || a != accum(tr) - 1 || dp(tr)) return;
    fy_stream_sync(tr->s_d2h);
    st->sumsq_host[b] = host_sumsq(tr, acc, c->nelem);
}

/* d2h_grad: the first micro-batch lands in grad_host, later ones in the landing slot and
 * are added there (host_add), which reads the copy: the host waits for it. */
static fy_status run_d2h_grad(fy_trainer *tr, int id, const fy_task *t, const sg_task *p) {
    const int b = t->block, a = p->micro % accum(tr);
    const fy_chunk *c = &tr->st->chunks[b];
    const void *g = grad_unit(tr, p->u.d2h_grad.holder);
    if (c->gathered) {
        scatter_rows(tr, b, p->micro, g);
        return FY_OK;
    }
    if (p->chunk >= 0) {
        land_chunk(tr, b, p->micro, p->chunk, g);
        return FY_OK;
    }
    float *dst = a == 0 ? c->grad_host : tr->st->grad_host_tmp;
    fy_copy_async(tr->s_d2h, dst, g, fy_tr_nbytes(tr, b), FY_D2H);
    if (accum(tr) == 1) return FY_OK;
    fy_stream_sync(tr->s_d2h);
    if (a > 0) host_add(tr, c->grad_host, dst, c->nelem);
    if (a == accum(tr) - 1 && !dp(tr)) tr->st->sumsq_host[b] = host_sumsq(tr, c->grad_host, c->nelem);
    return FY_OK;
}

/* reduce (data parallel): block b's step gradient summed over the ranks into this rank's
 * shard (rank order; the cpu backend's device memory is host memory), and the chunk sums
 * of the shard's squares into this rank's part of parts_host (the norm adds every rank's
 * in chunk order: the one-process norm's bits). */
static fy_status run_reduce(fy_trainer *tr, int id, const fy_task *t, const sg_task *p) {
    const int b = t->block;
    fy_storage *st = tr->st;
    const fy_chunk *c = &st->chunks[b];
    size_t off[FY_MAX_SHARDS + 1];
    fy_tr_shards(tr, b, off);
    double *parts = st->parts_host + tr->part_region[tr->rank] + tr->part_base[b];
    if (tr->s_comm && !fy_tr_cpu_optim(tr, b)) { /* device memory: the device's collectives */
        double *pd = st->parts_dev + tr->part_base[b];
        const size_t nparts = fy_sumsq_nchunks(c->hi - c->lo);
        fy_coll_reduce_scatter_async(tr->s_comm, c->grad_dev, off, tr->world, fy_tr_dt(tr));
        fy_k_sumsq_parts(pd, fy_tr_at(tr, c->grad_dev, c->lo), c->hi - c->lo, tr->s_comm);
        fy_copy_async(tr->s_comm, parts, pd, nparts * sizeof(double), FY_D2H);
        return FY_OK;
    }
    /* host memory over MPI: with a comm stream the waits were on the device, so the host
     * waits for them here */
    if (tr->s_comm) fy_stream_sync(tr->s_comm);
    void *g = fy_tr_cpu_optim(tr, b) ? (void *)c->grad_host : (void *)c->grad_dev;
    FY_TRY(fy_comm_reduce_scatter(tr->comm, g, off, fy_tr_dt(tr)));
    fy_sumsq_parts(fy_tr_at(tr, g, c->lo), fy_tr_lp(tr), c->hi - c->lo, parts);
    return FY_OK;
}

/* The sharded norm's sums of squares per block (sumsq_host): every rank's chunk sums
 * (parts_host, rank after rank, each rank's block after block) added per block in chunk
 * order, from rank 0's first chunk on. */
static fy_status shard_sumsq(fy_trainer *tr) {
    fy_storage *st = tr->st;
    const int nb = fy_tr_nblocks(tr);
    FY_TRY(fy_comm_allgather(tr->comm, st->parts_host, tr->part_region, sizeof(double)));
    for (int b = 0; b < nb; b++) st->sumsq_host[b] = 0.0;
    for (int r = 0; r < tr->world; r++) {
        const double *x = st->parts_host + tr->part_region[r];
        for (int b = 0; b < nb; b++) {
            const size_t n = fy_shard_nchunks(st->chunks[b].nelem, tr->world, r);
            for (size_t k = 0; k < n; k++) st->sumsq_host[b] += *x++;
        }
    }
    return FY_OK;
}

static fy_status run_norm(fy_trainer *tr, int id, const fy_task *t, const sg_task *p) {
    fy_storage *st = tr->st;
    const int step = step_of(tr, p);
    fy_step_stats *out = &tr->stats[step];
    double ss = 0.0, loss = 0.0;
    if (dp(tr)) FY_TRY(shard_sumsq(tr));
    for (int b = 0; b < fy_tr_nblocks(tr); b++) ss += st->sumsq_host[b];
    for (int a = 0; a < accum(tr); a++) loss += st->loss_host[a];
    if (dp(tr)) { /* the loss in rank order, and a stop any rank was asked for: then the
                   * step applies nothing on every rank, as one process's stopped step */
        double v[2] = {loss, tr->cfg.stop && atomic_load(tr->cfg.stop) ? 1.0 : 0.0};
        FY_TRY(fy_comm_sum(tr->comm, v, 2, FY_COMM_F64));
        if (v[1] > 0) return FY_INTERRUPTED;
        loss = v[0];
    }
    float norm = (float)sqrt(ss);
    if (tr->cfg.test_nan_step > 0 && tr->micro_base / accum(tr) + step + 1 == tr->cfg.test_nan_step)
        norm = NAN; /* the test hook (trainer.h) */
    out->loss = (float)(loss / (double)tr->micro_total);
    out->grad_norm = norm;
    out->clip_coef = 1.0f;
    out->skipped = !isfinite(norm);
    if (!out->skipped && tr->cfg.clip > 0.0f) {
        float coef = tr->cfg.clip / (norm + 1e-6f);
        if (coef < 1.0f) out->clip_coef = coef;
    }
    if (!out->skipped) tr->steps_done++;
    tr->adam_step[step] = tr->steps_done;
    return FY_OK;
}

static fy_adam_hparams hparams(const fy_trainer *tr, int step) {
    return (fy_adam_hparams){.lr = tr->lrs[step], .beta1 = tr->cfg.beta1,
                             .beta2 = tr->cfg.beta2, .eps = tr->cfg.eps,
                             .weight_decay = tr->cfg.weight_decay,
                             .step = tr->adam_step[step],
                             .grad_scale = tr->stats[step].clip_coef};
}

/* The two AdamW ranges of block b's shard: tensors with weight decay first, then the
 * others (each may be empty). */
static void adam_ranges(const fy_trainer *tr, int b, size_t off[2], size_t len[2]) {
    const fy_block_spec *blk = fy_tr_block(tr, b);
    const size_t lo = tr->st->chunks[b].lo, hi = tr->st->chunks[b].hi;
    const size_t cut[3] = {0, blk->decay_nelem, blk->nelem};
    for (int k = 0; k < 2; k++) {
        const size_t a = cut[k] > lo ? cut[k] : lo, e = cut[k + 1] < hi ? cut[k + 1] : hi;
        off[k] = a;
        len[k] = e > a ? e - a : 0;
    }
}

/* adam_gpu: the fp32 master of the block's shard is updated; with bf16 storage the
 * update also writes the shard's bf16 copy (into the resident one, or the slot's second
 * part). Masters, m and v of a shard are indexed from its lo (storage.h); the slot holds
 * the shard's master (bf16 storage) or the whole fp32 weights. */
static fy_status run_adam_gpu(fy_trainer *tr, int id, const fy_task *t, const sg_task *p) {
    if (tr->stats[step_of(tr, p)].skipped) return FY_OK;
    const int b = t->block, fetch = p->u.update.fetch;
    const fy_chunk *c = &tr->st->chunks[b];
    const size_t lo = c->lo;
    fy_adam_hparams hp = hparams(tr, step_of(tr, p));
    float *w = fetch >= 0 ? param_unit(tr, fetch) : fy_tr_lp(tr) ? c->master_dev : c->param_dev;
    void *out = NULL;               /* the bf16 copy, element i at out + (i - out_lo) */
    size_t out_lo = 0;
    if (fy_tr_lp(tr) && fetch >= 0) { out = w + (c->hi - lo); out_lo = lo; }
    else if (fy_tr_lp(tr)) out = c->param_dev;
    size_t off[2], len[2];
    adam_ranges(tr, b, off, len);
    for (int k = 0; k < 2; k++) {
        if (!len[k]) continue;
        size_t o = off[k];
        fy_adam_range r = {.param = master_at(tr, w, b, o), .m = c->m + (o - lo), .v = c->v + (o - lo),
                           .grad = fy_tr_at(tr, c->grad_dev, o), .grad_dtype = fy_tr_dt(tr),
                           .param_out = out ? fy_tr_at(tr, out, o - out_lo) : NULL,
                           .out_dtype = fy_tr_dt(tr), .n = len[k], .decay = k == 0};
        fy_k_adamw(&hp, &r, tr->s);
    }
    return FY_OK;
}

/* d2h_param: the shard's updated weights in the update fetch's slot (and, with bf16
 * storage, their bf16 copy after them) back to the host. */
static fy_status run_d2h_param(fy_trainer *tr, int id, const fy_task *t, const sg_task *p) {
    /* a skipped update wrote nothing: the host copies are current (with bf16 storage the
     * slot's second part holds stale bytes) */
    if (tr->stats[step_of(tr, p)].skipped) return FY_OK;
    const fy_chunk *c = &tr->st->chunks[t->block];
    const size_t lo = c->lo, n = c->hi - c->lo, es = tr->st->es;
    char *slot = param_unit(tr, p->u.update.fetch);
    if (fy_tr_lp(tr)) {
        fy_copy_async(tr->s_d2h, c->param_host, slot, n * sizeof(float), FY_D2H);
        fy_copy_async(tr->s_d2h, (char *)c->param_lp + lo * es, slot + n * sizeof(float), n * es, FY_D2H);
    } else {
        fy_copy_async(tr->s_d2h, c->param_host + lo, slot + lo * sizeof(float), n * sizeof(float), FY_D2H);
    }
    return FY_OK;
}

/* A block whose gradient landed in its bf16 parameter copy (grad_in_lp) and was not
 * updated over it (a skipped step, a failed one) gets the copy back from its master. */
static void restore_lp(fy_trainer *tr, int b) {
    const fy_chunk *c = &tr->st->chunks[b];
    if (!c->grad_in_lp) return;
    /* its shard's: a job's allgather brings the others' */
    if (fy_tr_lp(tr)) fy_f32_to_bf16_n((uint16_t *)c->param_lp + c->lo, c->param_host, c->hi - c->lo);
    else memcpy(c->param_lp + c->lo, c->param_host, (c->hi - c->lo) * sizeof(float));
}

/* adam_cpu: the fp32 master, m and v on the host; with bf16 storage the update writes the
 * bf16 copy too (over the gradient when they share a buffer: AdamW reads each gradient
 * element before it writes that element's weight). */
static fy_status run_adam_cpu(fy_trainer *tr, int id, const fy_task *t, const sg_task *p) {
    const int b = t->block;
    if (tr->stats[step_of(tr, p)].skipped) {
        restore_lp(tr, b);
        return FY_OK;
    }
    const fy_chunk *c = &tr->st->chunks[b];
    fy_adam_hparams hp = hparams(tr, step_of(tr, p));
    size_t off[2], len[2];
    adam_ranges(tr, b, off, len);
    for (int k = 0; k < 2; k++) {
        if (!len[k]) continue;
        size_t o = off[k];
        fy_adam_range r = {.param = master_at(tr, c->param_host, b, o), .m = c->m + (o - c->lo),
                           .v = c->v + (o - c->lo),
                           .grad = fy_tr_at(tr, c->grad_host, o), .grad_dtype = fy_tr_dt(tr),
                           .param_out = c->apart ? fy_tr_at(tr, c->param_lp, o) : NULL,
                           .out_dtype = fy_tr_dt(tr), .n = len[k], .decay = k == 0};
        fy_status s = fy_adam_pool_step(tr->pool, &hp, &r);
        FY_ASSERT(s == FY_OK, "a cpu AdamW step without check_finite cannot fail");
    }
    return FY_OK;
}

/* Every shard of block b's weights from its owner, where compute reads them: a resident
 * gpu-optimised block's device copy (the device's collectives, or the cpu backend's host
 * memory), else the host copy the fetches and h2d_update read. */
static fy_status gather_weights(fy_trainer *tr, int b) {
    const fy_chunk *c = &tr->st->chunks[b];
    size_t off[FY_MAX_SHARDS + 1];
    fy_tr_shards(tr, b, off);
    const bool on_dev = !fy_tr_cpu_optim(tr, b) && !fy_tr_streamed(tr, b);
    if (tr->s_comm && on_dev) {
        fy_coll_allgather_async(tr->s_comm, c->param_dev, off, tr->world, fy_tr_dt(tr));
        return FY_OK;
    }
    if (tr->s_comm) fy_stream_sync(tr->s_comm);
    return fy_comm_allgather(tr->comm, on_dev ? c->param_dev : c->param_lp, off, tr->st->es);
}

/* allgather (data parallel): block b's updated weights, from every shard's owner. */
static fy_status run_allgather(fy_trainer *tr, int id, const fy_task *t, const sg_task *p) {
    return gather_weights(tr, t->block);
}

static fy_status run_h2d_update(fy_trainer *tr, int id, const fy_task *t, const sg_task *p) {
    const fy_chunk *c = &tr->st->chunks[t->block];
    fy_copy_async(tr->s_h2d, c->param_dev, c->param_lp, fy_tr_nbytes(tr, t->block), FY_H2D);
    return FY_OK;
}

/* collect: an evaluated batch's loss, from the host copy its head made. */
static fy_status run_collect(fy_trainer *tr, int id, const fy_task *t, const sg_task *p) {
    tr->eval_losses[p->micro] = tr->st->loss_host[p->micro % accum(tr)];
    return FY_OK;
}

static const runner runners[FY_T_COUNT] = {
    [FY_T_LOAD] = run_load, [FY_T_H2D_PARAM] = run_h2d_param, [FY_T_FWD] = run_fwd,
    [FY_T_GOPEN] = run_gopen, [FY_T_HEAD] = run_head, [FY_T_RECOMPUTE] = run_fwd,
    [FY_T_BWD] = run_bwd, [FY_T_D2H_GRAD] = run_d2h_grad, [FY_T_NORM] = run_norm,
    [FY_T_ADAM_GPU] = run_adam_gpu, [FY_T_D2H_PARAM] = run_d2h_param,
    [FY_T_ADAM_CPU] = run_adam_cpu, [FY_T_H2D_UPDATE] = run_h2d_update,
    [FY_T_COLLECT] = run_collect, [FY_T_REDUCE] = run_reduce, [FY_T_ALLGATHER] = run_allgather,
};

/* Makes task t's work wait for the work of task `before`: on the device when t has a
 * stream (nothing when it is before's own stream: stream order), on the host when t is
 * host work. Host work (the cpu lane) is complete when its task ends. */
static void wait_for(const fy_trainer *tr, fy_stream *s, int before) {
    const fy_task *b = &tr->graph->tasks[before];
    fy_stream *bs = lane_stream(tr, b->lane);
    if (!bs || bs == s) return;
    if (s) fy_stream_wait_event(s, tr->ev_end[before]);
    else fy_event_sync(tr->ev_end[before]);
}

/* Every task: the injected failure, waits for its inputs, the runner between its events. */
static fy_status run_task(void *ctx, const fy_task *t) {
    fy_trainer *tr = ctx;
    const int id = (int)(t - tr->graph->tasks);
    const sg_task *p = &tr->sgt[id];
    fy_stream *s = lane_stream(tr, t->lane);
    if (tr->inject.kind == t->kind && (tr->inject.block < 0 || tr->inject.block == t->block) &&
        tr->inject.micro == abs_micro(tr, p) && atomic_exchange(&tr->inject.armed, false)) {
        fy_log_error("injected failure");
        /* its end event still marks its place in the stream: a later taker of a unit it
         * freed waits on it */
        if (s) fy_event_record(tr->ev_end[id], s);
        return tr->inject.st;
    }
    for (int k = 0; k < t->npred; k++) wait_for(tr, s, t->pred[k]);
    if (t->unit_after >= 0) wait_for(tr, s, t->unit_after);
    if (s) fy_event_record(tr->ev_start[id], s);
    else tr->host_start[id] = fy_now_ms(); /* its work starts after the waits */
    fy_status st = runners[t->kind](tr, id, t, p);
    if (!s) return st;
    fy_event_record(tr->ev_end[id], s);
    if (tr->cfg.schedule == FY_SCHED_SERIAL) fy_event_sync(tr->ev_end[id]);
    tr->ahead[t->lane][tr->nahead[t->lane]++] = id;
    return st;
}

/* Before a device lane picks its next task: at most FY_RUN_AHEAD - 1 of its tasks may
 * still be queued, so the next one can still be chosen by what is ready then. */
static void lane_wait(void *ctx, fy_lane lane) {
    fy_trainer *tr = ctx;
    int *q = tr->ahead[lane], *n = &tr->nahead[lane];
    while (*n > FY_RUN_AHEAD - 1) {
        fy_event_sync(tr->ev_end[q[0]]);
        memmove(q, q + 1, (size_t)--*n * sizeof *q);
    }
}

/* ---- costs --------------------------------------------------------------------------- */

/* The (sum, count) of measured durations of tasks of this kind and block. */
static double *cost_slot(fy_trainer *tr, int kind, int block) {
    int nb = fy_tr_nblocks(tr);
    int col = block >= 0 && block < nb ? block : nb;
    return tr->cost_ms + 2 * ((size_t)kind * (nb + 1) + col);
}

double fy_trainer_cost(const fy_trainer *tr, fy_task_kind kind, int block) {
    const double *c = cost_slot((fy_trainer *)tr, kind, block);
    return c[1] > 0 ? c[0] / c[1] : -1.0;
}

void fy_trainer_reset_costs(fy_trainer *tr) {
    memset(tr->cost_ms, 0, (size_t)FY_T_COUNT * (fy_tr_nblocks(tr) + 1) * 2 * sizeof *tr->cost_ms);
}

void fy_trainer_set_cost(fy_trainer *tr, fy_task_kind kind, int block, double ms) {
    double *c = cost_slot(tr, kind, block);
    c[0] = ms;
    c[1] = 1;
}

/* ---- the builders ---------------------------------------------------------------------- */

typedef struct builder {
    fy_trainer *tr;
    fy_graph *g;
    int ppool[FY_RINGS], gpool[FY_RINGS]; /* the rings' pools */
    int64_t pos;            /* next program position of a compute task */
    int epoch;              /* the step being built */
    bool barrier;           /* updates wait for the norm */
    fy_status st;
    int nb;
    int *ready;             /* per block: the task after which its parameters are current
                               for the next use (-1 at the window's start) */
    int *last_bwd;          /* per block: the last task of the previous micro-batch that
                               reads its activations (its backward pass) */
    int *final_grad;        /* per block: the task completing its step's gradient */
    int *last_d2h;          /* per block: its last d2h_grad */
    sg_grad *grad;          /* per block, this micro-batch: where its gradient is (open) */
    bool *opened;           /* per block, this micro-batch: its gradient is open */
    int shared_user;        /* the last task that used the recompute buffer */
    int prev_load, load_war[2], load_buf[2], prev_norm;
    int prev_comm;          /* the last reduce or allgather: they run in one order on every
                               rank */
} builder;

/* A new task; its payload zeroed but for the micro-batch (the builders fill the member of
 * its kind). */
static int add(builder *bd, fy_lane lane, fy_task_kind kind, int block, int micro) {
    fy_trainer *tr = bd->tr;
    fy_task t = fy_task_make(lane, kind, block, micro, run_task, tr);
    t.epoch = bd->epoch;
    if (lane == FY_LANE_COMPUTE) t.use_pos = bd->pos++;
    double *c = cost_slot(tr, kind, block);
    if (c[1] > 0) t.cost_ms = c[0] / c[1];
    int id = fy_graph_add(bd->g, &t);
    if (id < 0) { bd->st = FY_ERR_NOMEM; return -1; }
    if (id >= tr->sgt_cap) {
        int ncap = tr->sgt_cap ? 2 * tr->sgt_cap : 1024;
        sg_task *n = realloc(tr->sgt, (size_t)ncap * sizeof *n);
        if (!n) { bd->st = FY_ERR_NOMEM; return -1; }
        tr->sgt = n;
        tr->sgt_cap = ncap;
    }
    sg_task *p = &tr->sgt[id];
    memset(p, 0, sizeof *p);
    p->micro = micro;
    p->chunk = -1;
    return id;
}

static sg_task *payload(builder *bd, int id) { return &bd->tr->sgt[id]; }

static void dep(builder *bd, int before, int after) {
    if (before < 0 || after < 0 || bd->st != FY_OK) return;
    fy_status s = fy_graph_dep(bd->g, before, after);
    if (s != FY_OK) bd->st = s;
}

/* At its end, `task` gives back the unit `holder` acquired (no-op for -1). */
static void releases(builder *bd, int task, int holder) {
    if (task < 0 || holder < 0) return;
    int *r = bd->g->tasks[task].release_of;
    for (int i = 0; i < FY_SCHED_MAX_RELEASES; i++)
        if (r[i] < 0) { r[i] = holder; return; }
    FY_ASSERT(0, "a task releases more units than the scheduler holds");
}

/* A fetch of streamed block b's parameters after `ready`, or -1 if b is resident. */
static int fetch(builder *bd, int b, int micro) {
    if (!fy_tr_streamed(bd->tr, b)) return -1;
    int f = add(bd, FY_LANE_H2D, FY_T_H2D_PARAM, b, micro);
    if (f < 0) return -1;
    bd->g->tasks[f].acquire_pool = bd->ppool[ring(bd->tr, b)];
    dep(bd, bd->ready[b], f);
    if (gathered(bd->tr, b)) dep(bd, bd->load_buf[micro % 2], f); /* its rows are known */
    return f;
}

/* A pass of block b (fwd, recompute, head, bwd) with its parameters and its links':
 * fetched for it when streamed (and given back at its end), current after their last
 * update. */
static int pass_task(builder *bd, fy_task_kind kind, int b, int micro) {
    const fy_block_spec *blk = fy_tr_block(bd->tr, b);
    /* a row table's backward reads no parameters (model.h: gather) */
    int f = kind == FY_T_BWD && gathered(bd->tr, b) ? -1 : fetch(bd, b, micro), lf[ML];
    for (int k = 0; k < blk->nlinks; k++) lf[k] = fetch(bd, blk->links[k], micro);
    int id = add(bd, FY_LANE_COMPUTE, kind, b, micro);
    if (id < 0) return -1;
    payload(bd, id)->u.pass.fetch = f;
    dep(bd, f, id);
    dep(bd, bd->ready[b], id);
    releases(bd, id, f);
    for (int k = 0; k < blk->nlinks; k++) {
        payload(bd, id)->u.pass.link_fetch[k] = lf[k];
        dep(bd, lf[k], id);
        dep(bd, bd->ready[blk->links[k]], id);
        releases(bd, id, lf[k]);
    }
    return id;
}

/* Where task `id`, a backward pass, writes block b's gradient: opened by an earlier task
 * of this micro-batch (a gopen's unit or the accumulator), or opened here (a unit this
 * task takes when b is staged, else the accumulator). */
static sg_grad grad_of(builder *bd, int b, int id) {
    if (bd->opened[b]) return (sg_grad){bd->grad[b].holder, false};
    bd->opened[b] = true;
    bd->grad[b] = (sg_grad){staged(bd->tr, b) ? id : -1, true};
    if (staged(bd->tr, b)) bd->g->tasks[id].acquire_pool = bd->gpool[ring(bd->tr, b)];
    return bd->grad[b];
}

/* load(m): micro-batch m into token buffer m%2, after the previous load (batches come in
 * order) and after the last reader of that buffer. */
static int build_load(builder *bd, int m) {
    int load = add(bd, FY_LANE_H2D, FY_T_LOAD, -1, m);
    if (load < 0) return -1;
    payload(bd, load)->u.load.reuse = bd->load_buf[m % 2];
    dep(bd, bd->load_war[m % 2], load);
    dep(bd, bd->prev_load, load);
    bd->prev_load = bd->load_buf[m % 2] = load;
    return load;
}

/* Forward through every block before the head; returns the last task. */
static int build_forward(builder *bd, int m, int load) {
    fy_trainer *tr = bd->tr;
    int prev = load;
    for (int b = 0; b < bd->nb; b++) {
        if (fy_tr_block(tr, b)->kind == FY_BLOCK_HEAD) continue;
        int x = pass_task(bd, FY_T_FWD, b, m);
        dep(bd, prev, x); /* the first: after the load */
        dep(bd, bd->last_bwd[b], x); /* its activations are reused */
        if (tr->plan.blocks[b].acts == FY_ACTS_RECOMPUTE) {
            dep(bd, bd->shared_user, x);
            bd->shared_user = x;
        }
        prev = x;
    }
    return prev;
}

/* Before the backward pass of block b (after `prev`): a gopen for every staged block it
 * adds into whose gradient is not open yet (their units cannot be the pass's own, which
 * it may take for its own gradient). Returns the last gopen, or prev. */
static int open_links(builder *bd, int b, int m, int prev) {
    fy_trainer *tr = bd->tr;
    const fy_block_spec *blk = fy_tr_block(tr, b);
    for (int k = 0; k < blk->nlinks; k++) {
        const int l = blk->links[k];
        if (!staged(tr, l) || bd->opened[l]) continue;
        int go = add(bd, FY_LANE_COMPUTE, FY_T_GOPEN, l, m);
        if (go < 0) return prev;
        bd->g->tasks[go].acquire_pool = bd->gpool[ring(bd->tr, l)];
        dep(bd, prev, go);
        bd->opened[l] = true;
        bd->grad[l] = (sg_grad){go, false};
        prev = go;
    }
    return prev;
}

/* The gradients backward pass `id` of block b writes: its own and its links'. */
static void bind_pass_grads(builder *bd, int b, int id) {
    const fy_block_spec *blk = fy_tr_block(bd->tr, b);
    sg_task *p = payload(bd, id);
    p->u.pass.grad = grad_of(bd, b, id);
    for (int k = 0; k < blk->nlinks; k++) p->u.pass.link_grad[k] = grad_of(bd, blk->links[k], id);
}

/* A compute task of a chunked head on chunk k (kind head: forward; bwd: backward) after
 * `prev`, with its chunk's fetch; with `grad` it takes a gradient unit of its own. */
static int chunk_task(builder *bd, fy_task_kind kind, int h, int m, int k, int prev, bool grad) {
    int f = fetch(bd, h, m), t = add(bd, FY_LANE_COMPUTE, kind, h, m);
    if (t < 0) return -1;
    if (f >= 0) payload(bd, f)->chunk = k;
    sg_task *p = payload(bd, t);
    p->chunk = k;
    p->u.pass.fetch = f;
    dep(bd, f, t);
    dep(bd, bd->ready[h], t);
    dep(bd, prev, t);
    releases(bd, t, f);
    if (grad) {
        bd->g->tasks[t].acquire_pool = bd->gpool[ring(bd->tr, h)];
        p->u.pass.grad = (sg_grad){t, true};
    }
    return t;
}

/* A chunked head's gradient of chunk k, in task gt's unit, to the host (in chunk order:
 * the host adds, and the last takes the norm). */
static void chunk_d2h(builder *bd, int h, int m, int k, int gt) {
    int d = add(bd, FY_LANE_D2H, FY_T_D2H_GRAD, h, m);
    if (d < 0) return;
    payload(bd, d)->chunk = k;
    payload(bd, d)->u.d2h_grad.holder = gt;
    releases(bd, d, gt);
    dep(bd, gt, d);
    dep(bd, bd->last_d2h[h], d);
    bd->last_d2h[h] = bd->final_grad[h] = d;
}

/* The head's loss pass after `prev` (in training, with its backward). */
static int build_head(builder *bd, int m, int prev, bool train) {
    fy_trainer *tr = bd->tr;
    const int h = bd->nb - 1;
    FY_ASSERT(fy_tr_block(tr, h)->kind == FY_BLOCK_HEAD, "the model's last block is its head");
    if (tr->st->chunks[h].chunked) { /* one task per chunk; the last one starts backward */
        const int K = tr->st->head_chunks.n;
        int t = prev;
        for (int k = 0; k < K; k++) {
            t = chunk_task(bd, FY_T_HEAD, h, m, k, t, train && k == K - 1);
            if (t < 0) return -1;
            payload(bd, t)->u.pass.train = train;
            if (k == 0) dep(bd, bd->last_bwd[h], t); /* the head's activations are reused */
        }
        return t;
    }
    if (train) prev = open_links(bd, h, m, prev);
    int hd = pass_task(bd, FY_T_HEAD, h, m);
    if (hd < 0) return -1;
    payload(bd, hd)->u.pass.train = train;
    dep(bd, prev, hd);
    dep(bd, bd->last_bwd[h], hd);
    if (train) bind_pass_grads(bd, h, hd);
    return hd;
}

/* Block b's gradient of micro-batch m is complete after task gt (its own backward): a
 * cpu-optimised block sends it to the host (the unit is given back after the copy);
 * a gpu-optimised one closed it into its accumulator inside gt. */
static void after_grad(builder *bd, int b, int m, int gt) {
    fy_trainer *tr = bd->tr;
    bd->last_bwd[b] = gt;
    bd->final_grad[b] = gt;
    if (!staged(tr, b)) return;
    const int holder = bd->grad[b].holder;
    if (!fy_tr_cpu_optim(tr, b)) {
        releases(bd, gt, holder);
        return;
    }
    int d = add(bd, FY_LANE_D2H, FY_T_D2H_GRAD, b, m);
    if (d < 0) return;
    payload(bd, d)->u.d2h_grad.holder = holder;
    releases(bd, d, holder);
    dep(bd, gt, d);
    dep(bd, bd->last_d2h[b], d); /* the host adds in micro-batch order */
    bd->last_d2h[b] = d;
    if (accum(tr) > 1) bd->final_grad[b] = d;
}

/* A chunked head's backward after its last chunk's task: that chunk's gradient to the
 * host, then each earlier chunk's backward (recomputing its logits) and gradient, down to
 * chunk 0, which gives d in. Returns the last task. */
static int build_head_backward(builder *bd, int m, int head) {
    const int h = bd->nb - 1, K = bd->tr->st->head_chunks.n;
    chunk_d2h(bd, h, m, K - 1, head);
    int t = head;
    for (int k = K - 2; k >= 0 && t >= 0; k--) {
        t = chunk_task(bd, FY_T_BWD, h, m, k, t, true);
        if (t >= 0) chunk_d2h(bd, h, m, k, t);
    }
    bd->last_bwd[h] = t;
    return t;
}

/* Backward from the block before the head down to the embedding. */
static void build_backward(builder *bd, int m, int head) {
    fy_trainer *tr = bd->tr;
    int prev = head;
    if (tr->st->chunks[bd->nb - 1].chunked) prev = build_head_backward(bd, m, head);
    else after_grad(bd, bd->nb - 1, m, head);
    for (int b = bd->nb - 2; b >= 0; b--) {
        int rc = -1;
        if (tr->plan.blocks[b].acts == FY_ACTS_RECOMPUTE) {
            rc = pass_task(bd, FY_T_RECOMPUTE, b, m);
            dep(bd, prev, rc);
            dep(bd, bd->shared_user, rc);
        }
        prev = open_links(bd, b, m, prev);
        int gt = pass_task(bd, FY_T_BWD, b, m);
        if (gt < 0) return;
        bind_pass_grads(bd, b, gt);
        dep(bd, rc, gt);
        dep(bd, prev, gt);
        if (rc >= 0) bd->shared_user = gt;
        prev = gt;
        after_grad(bd, b, m, gt);
    }
}

/* Data parallel: each block's step gradient summed over the ranks, once it is complete,
 * in the order gradients complete (head, layers down, embedding). The reduces are
 * chained: every rank runs the same collectives in the same order whatever is ready
 * first. The norm and the updates then wait for them. */
static void build_reduce(builder *bd, int tm) {
    for (int b = bd->nb - 1; b >= 0; b--) {
        int r = add(bd, FY_LANE_COMM, FY_T_REDUCE, b, tm);
        if (r < 0) return;
        dep(bd, bd->final_grad[b], r);
        dep(bd, bd->last_d2h[b], r);
        dep(bd, bd->prev_comm, r);
        bd->prev_comm = bd->final_grad[b] = r;
        if (bd->last_d2h[b] >= 0) bd->last_d2h[b] = r;
    }
}

/* Step t's norm, after every gradient and loss of the step (tm: its last micro-batch). */
static int build_norm(builder *bd, int tm, const int *heads) {
    int nm = add(bd, FY_LANE_CPU, FY_T_NORM, -1, tm);
    for (int b = 0; b < bd->nb; b++) {
        dep(bd, bd->final_grad[b], nm);
        dep(bd, bd->last_d2h[b], nm);
    }
    for (int a = 0; a < accum(bd->tr); a++) dep(bd, heads[a], nm);
    dep(bd, bd->prev_norm, nm);
    bd->prev_norm = nm;
    return nm;
}

/* A resident cpu-optimised block's updated weights back to the device, after `after`. */
static void build_h2d_update(builder *bd, int b, int tm, int after) {
    int up = add(bd, FY_LANE_H2D, FY_T_H2D_UPDATE, b, tm);
    dep(bd, after, up);
    bd->ready[b] = up;
}

/* Data parallel: each block's updated shards from their owners, after its update, block 0
 * first (the next forward's order); chained like the reduces, after them. */
static void build_allgather(builder *bd, int tm) {
    fy_trainer *tr = bd->tr;
    for (int b = 0; b < bd->nb; b++) {
        int g = add(bd, FY_LANE_COMM, FY_T_ALLGATHER, b, tm);
        dep(bd, bd->ready[b], g);
        dep(bd, bd->prev_comm, g);
        bd->prev_comm = bd->ready[b] = g;
        if (fy_tr_cpu_optim(tr, b) && !fy_tr_streamed(tr, b)) build_h2d_update(bd, b, tm, g);
    }
}

/* Every block's update after the norm, created in the order gradients complete (head,
 * layers down, embedding): fifo runs them so; priority reorders them by next use (block
 * 0 first). They are not program uses themselves: their priority is that of the next
 * forward. */
static void build_update(builder *bd, int tm, int nm) {
    fy_trainer *tr = bd->tr;
    const int barrier = bd->barrier ? nm : -1;
    for (int b = bd->nb - 1; b >= 0; b--) {
        if (fy_tr_cpu_optim(tr, b)) {
            int ad = add(bd, FY_LANE_CPU, FY_T_ADAM_CPU, b, tm);
            dep(bd, barrier, ad);
            dep(bd, bd->last_d2h[b], ad);
            bd->ready[b] = ad;
            /* a job's h2d_update follows the allgather */
            if (!fy_tr_streamed(tr, b) && !dp(tr)) build_h2d_update(bd, b, tm, ad);
            continue;
        }
        int f = fetch(bd, b, tm);
        if (f >= 0) { /* a fetch for the update: the master of its shard (4 bytes an
                       * element; with fp32 storage the whole weights) */
            const fy_chunk *c = &tr->st->chunks[b];
            payload(bd, f)->u.fetch.for_update = true;
            if (fy_tr_lp(tr))
                bd->g->tasks[f].cost_ms *= 4.0 / (double)tr->st->es * (double)(c->hi - c->lo) / (double)c->nelem;
        }
        int ad = add(bd, FY_LANE_COMPUTE, FY_T_ADAM_GPU, b, tm);
        if (ad < 0) return;
        payload(bd, ad)->u.update.fetch = f;
        bd->g->tasks[ad].use_pos = -1;
        dep(bd, f, ad);
        dep(bd, barrier, ad);
        dep(bd, bd->final_grad[b], ad);
        bd->ready[b] = ad;
        if (f >= 0) {
            int d = add(bd, FY_LANE_D2H, FY_T_D2H_PARAM, b, tm);
            if (d < 0) return;
            payload(bd, d)->u.update.fetch = f;
            releases(bd, d, f);
            dep(bd, ad, d);
            bd->ready[b] = d;
        }
    }
}

static fy_status builder_init(builder *bd, fy_trainer *tr, fy_graph *g, bool barrier) {
    memset(bd, 0, sizeof *bd);
    bd->tr = tr;
    bd->g = g;
    bd->barrier = barrier;
    bd->nb = fy_tr_nblocks(tr);
    fy_graph_init(g);
    g->kind_name = fy_task_kind_name;
    for (int r = 0; r < FY_RINGS; r++) {
        bd->ppool[r] = fy_graph_pool(g, tr->st->param_ring[r].n);
        bd->gpool[r] = fy_graph_pool(g, tr->st->grad_ring[r].n);
    }
    const size_t n = (size_t)bd->nb;
    bd->ready = malloc(n * sizeof *bd->ready);
    bd->last_bwd = malloc(n * sizeof *bd->last_bwd);
    bd->final_grad = malloc(n * sizeof *bd->final_grad);
    bd->last_d2h = malloc(n * sizeof *bd->last_d2h);
    bd->grad = malloc(n * sizeof *bd->grad);
    bd->opened = malloc(n * sizeof *bd->opened);
    if (!bd->ready || !bd->last_bwd || !bd->final_grad || !bd->last_d2h || !bd->grad || !bd->opened)
        return FY_ERR_NOMEM;
    for (size_t b = 0; b < n; b++) bd->ready[b] = bd->last_bwd[b] = bd->last_d2h[b] = -1;
    bd->shared_user = bd->prev_load = bd->prev_norm = bd->prev_comm = -1;
    bd->load_war[0] = bd->load_war[1] = bd->load_buf[0] = bd->load_buf[1] = -1;
    return FY_OK;
}

static fy_status builder_end(builder *bd) {
    free(bd->ready);
    free(bd->last_bwd);
    free(bd->final_grad);
    free(bd->last_d2h);
    free(bd->grad);
    free(bd->opened);
    if (bd->st != FY_OK) return bd->st;
    return fy_graph_prioritize(bd->g);
}

/* nsteps training steps, each an epoch. */
static fy_status build_train(fy_trainer *tr, fy_graph *g, int nsteps, bool barrier) {
    builder bd;
    fy_status st = builder_init(&bd, tr, g, barrier);
    const int A = accum(tr);
    int heads[FY_PLAN_MAX_ACCUM];
    for (int t = 0; t < nsteps && st == FY_OK && bd.st == FY_OK; t++) {
        bd.epoch = t;
        for (int a = 0; a < A; a++) {
            const int m = t * A + a;
            memset(bd.opened, 0, (size_t)bd.nb * sizeof *bd.opened);
            int load = build_load(&bd, m);
            int prev = build_forward(&bd, m, load);
            heads[a] = build_head(&bd, m, prev, true);
            build_backward(&bd, m, heads[a]);
            /* the embedding's backward reads tokens last; a gathered one's rows are read
             * by its gradient's copy */
            bd.load_war[m % 2] = gathered(tr, 0) ? bd.last_d2h[0] : bd.last_bwd[0];
        }
        const int tm = t * A + A - 1; /* per-step tasks carry the step's last micro-batch */
        if (dp(tr)) build_reduce(&bd, tm);
        build_update(&bd, tm, build_norm(&bd, tm, heads));
        if (dp(tr)) build_allgather(&bd, tm);
    }
    if (st != FY_OK) { builder_end(&bd); return st; }
    return builder_end(&bd);
}

/* nbatches evaluation batches, each an epoch: forward, the head's loss, collect. */
static fy_status build_eval(fy_trainer *tr, fy_graph *g, int nbatches) {
    builder bd;
    fy_status st = builder_init(&bd, tr, g, true);
    const int nslots = accum(tr);
    int *collect = st == FY_OK ? malloc((size_t)nbatches * sizeof *collect) : NULL;
    if (st == FY_OK && !collect) st = FY_ERR_NOMEM;
    for (int m = 0; m < nbatches && st == FY_OK && bd.st == FY_OK; m++) {
        bd.epoch = m;
        int load = build_load(&bd, m);
        int hd = build_head(&bd, m, build_forward(&bd, m, load), false);
        if (m >= nslots) dep(&bd, collect[m - nslots], hd); /* its loss slot is read */
        collect[m] = add(&bd, FY_LANE_CPU, FY_T_COLLECT, -1, m);
        dep(&bd, hd, collect[m]);
        for (int b = 0; b < bd.nb; b++) bd.last_bwd[b] = hd; /* activations are reused */
        bd.load_war[m % 2] = hd;
    }
    free(collect);
    if (st != FY_OK) { builder_end(&bd); return st; }
    return builder_end(&bd);
}

/* ---- running a graph -------------------------------------------------------------------- */

/* Events around every task of a graph of n tasks, and the host tasks' start times (grown
 * once, reused by later windows). */
static fy_status events_for(fy_trainer *tr, int n) {
    if (n > tr->nhost_start) {
        double *h = realloc(tr->host_start, (size_t)n * sizeof *h);
        if (!h) return FY_ERR_NOMEM;
        tr->host_start = h;
        tr->nhost_start = n;
    }
    if (n <= tr->nev) return FY_OK;
    fy_event **s = realloc(tr->ev_start, (size_t)n * sizeof *s);
    if (!s) return FY_ERR_NOMEM;
    tr->ev_start = s;
    fy_event **e = realloc(tr->ev_end, (size_t)n * sizeof *e);
    if (!e) return FY_ERR_NOMEM;
    tr->ev_end = e;
    for (; tr->nev < n; tr->nev++) {
        fy_event *a, *b;
        FY_TRY(fy_event_new_timed(tr->dev, &a));
        fy_status st = fy_event_new_timed(tr->dev, &b);
        if (st != FY_OK) {
            fy_event_free(a);
            return st;
        }
        tr->ev_start[tr->nev] = a;
        tr->ev_end[tr->nev] = b;
    }
    return FY_OK;
}

void fy_trainer_graph_free(fy_trainer *tr) {
    for (int i = 0; i < tr->nev; i++) {
        fy_event_free(tr->ev_start[i]);
        fy_event_free(tr->ev_end[i]);
    }
    free(tr->ev_start);
    free(tr->ev_end);
    free(tr->sgt);
    free(tr->host_start);
    tr->ev_start = tr->ev_end = NULL;
    tr->sgt = NULL;
    tr->host_start = NULL;
    tr->nev = tr->sgt_cap = tr->nhost_start = 0;
}

static void sync_all(void *ctx) {
    fy_trainer *tr = ctx;
    fy_stream_sync(tr->s);
    fy_stream_sync(tr->s_h2d);
    fy_stream_sync(tr->s_d2h);
    if (tr->s_comm) fy_stream_sync(tr->s_comm);
}

static int by_start(const void *a, const void *b) {
    const fy_trace_rec *x = a, *y = b;
    return (x->start_ms > y->start_ms) - (x->start_ms < y->start_ms);
}

/* The records of device tasks get the device's times (from their events, placed on the
 * host clock through the anchor recorded when the window began); busy times and the
 * makespan follow. */
static void device_times(fy_trainer *tr, const fy_graph *g, fy_sched_result *r,
                         double anchor_ms) {
    /* (a failed task may have stopped before its events: it keeps the host's times; a
     * host task's starts after its waits) */
    const double off = anchor_ms - r->t0_ms;
    memset(r->busy_ms, 0, sizeof r->busy_ms);
    r->makespan_ms = 0.0;
    for (int i = 0; i < r->nrecs; i++) {
        fy_trace_rec *rec = &r->recs[i];
        const fy_task *t = &g->tasks[rec->task];
        if (rec->task == r->failed_task) {
            /* keeps the host's times */
        } else if (lane_stream(tr, t->lane)) {
            rec->start_ms = off + fy_event_elapsed_ms(tr->ev_anchor, tr->ev_start[rec->task]);
            rec->end_ms = off + fy_event_elapsed_ms(tr->ev_anchor, tr->ev_end[rec->task]);
        } else {
            rec->start_ms = tr->host_start[rec->task] - r->t0_ms;
        }
        r->busy_ms[t->lane] += rec->end_ms - rec->start_ms;
        if (rec->end_ms > r->makespan_ms) r->makespan_ms = rec->end_ms;
    }
    qsort(r->recs, (size_t)r->nrecs, sizeof *r->recs, by_start);
}

/* Builds nothing: runs graph g (built for this trainer) with events, waits for the
 * device, and gives the records the device's times. */
static fy_status execute(fy_trainer *tr, fy_graph *g, fy_sched_result *res) {
    fy_status st = events_for(tr, g->n);
    if (st != FY_OK) { memset(res, 0, sizeof *res); return st; }
    g->drain = sync_all;
    g->lane_wait = lane_wait;
    g->hook_ctx = tr;
    tr->graph = g;
    memset(tr->nahead, 0, sizeof tr->nahead); /* the last window ended with everything done */
    tr->gather_last = -1;
    fy_event_record(tr->ev_anchor, tr->s);
    fy_event_sync(tr->ev_anchor);
    const double anchor_ms = fy_now_ms();
    st = fy_sched_execute(g, tr->cfg.schedule, res);
    sync_all(tr); /* the end of the window: everything queued is done */
    device_times(tr, g, res, anchor_ms);
    return st;
}

/* Step times from the records: a step ends with its last task. */
static void step_times(const fy_trainer *tr, const fy_graph *g, const fy_sched_result *r,
                       int nsteps, fy_step_stats *stats) {
    double *end = calloc((size_t)nsteps, sizeof *end);
    if (!end) return;
    for (int i = 0; i < r->nrecs; i++) {
        int s = g->tasks[r->recs[i].task].epoch;
        if (s >= 0 && s < nsteps && r->recs[i].end_ms > end[s]) end[s] = r->recs[i].end_ms;
    }
    double prev = 0.0;
    for (int s = 0; s < nsteps; s++) {
        if (end[s] < prev) end[s] = prev;
        stats[s].step_ms = end[s] - prev;
        prev = end[s];
    }
    free(end);
}

/* After a failed window: steps before the failing one are complete (the scheduler ran
 * their epochs to the end); the counters go back to the end of the last of them. The
 * failing step is partly applied if any of its AdamW tasks ran (and it was not skipped):
 * some blocks then have its update and others, or their device copies, not. */
static int settle_failure(fy_trainer *tr, const fy_graph *g, const fy_sched_result *r,
                          int64_t steps_before, bool together) {
    const int failed = g->tasks[r->failed_task].epoch;
    bool partial = false;
    for (int i = 0; i < r->nrecs; i++) {
        const fy_task *t = &g->tasks[r->recs[i].task];
        if (t->epoch == failed && r->recs[i].task != r->failed_task &&
            (t->kind == FY_T_ADAM_GPU || t->kind == FY_T_ADAM_CPU))
            partial = true;
    }
    partial &= !tr->stats[failed].skipped;
    /* gradients copied into bf16 parameter buffers before the failure are not weights: each
     * rank of a job restores its shards, and the ranks (all stopped at the same step's
     * norm: together) gather the others' */
    for (int b = 0; b < fy_tr_nblocks(tr); b++) {
        restore_lp(tr, b);
        if (!dp(tr) || !tr->st->chunks[b].grad_in_lp) continue;
        if (!together || gather_weights(tr, b) != FY_OK) tr->broken = true;
    }
    tr->steps_done = failed == 0 ? steps_before : tr->adam_step[failed - 1];
    tr->micro_base += (int64_t)failed * accum(tr);
    if (partial) {
        tr->broken = true;
        fy_log_warn("the failure came while step %lld was being applied: some blocks have its "
                    "update and others not, so this trainer cannot go on",
                    (long long)tr->steps_done + 1);
    }
    return failed;
}

static fy_status usable(const fy_trainer *tr) {
    if (!tr->broken) return FY_OK;
    fy_log_error("this trainer's weights are inconsistent after a failed update; start again "
                 "from saved weights");
    return FY_ERR_INVALID;
}

fy_status fy_trainer_run(fy_trainer *tr, fy_window *w) {
    w->completed = 0;
    if (w->nsteps <= 0) return FY_OK;
    FY_ASSERT(!tr->cfg.eval_only, "an evaluation-only trainer cannot train");
    FY_TRY(usable(tr));
    tr->adam_step = calloc((size_t)w->nsteps, sizeof *tr->adam_step);
    if (!tr->adam_step) return FY_ERR_NOMEM;
    tr->lrs = w->lrs;
    tr->stats = w->stats;
    tr->next_batch = w->next_batch;
    tr->batch_ctx = w->batch_ctx;
    tr->eval = false;
    memset(w->stats, 0, (size_t)w->nsteps * sizeof *w->stats);
    const int64_t steps_before = tr->steps_done;
    fy_graph g;
    fy_sched_result res = {0};
    fy_status st = build_train(tr, &g, w->nsteps, true);
    if (st == FY_OK) st = execute(tr, &g, &res);
    if (res.recs) {
        step_times(tr, &g, &res, w->nsteps, w->stats);
        for (int i = 0; i < res.nrecs; i++) {
            const fy_task *t = &g.tasks[res.recs[i].task];
            double *c = cost_slot(tr, t->kind, t->block);
            c[0] += res.recs[i].end_ms - res.recs[i].start_ms;
            c[1] += 1;
        }
    }
    if (st == FY_OK) {
        w->completed = w->nsteps;
        tr->micro_base += (int64_t)w->nsteps * accum(tr);
    } else if (res.recs && res.failed_task >= 0) {
        w->completed = settle_failure(tr, &g, &res, steps_before, st == FY_INTERRUPTED);
        /* in a job, the other ranks may be inside the failed step's collectives: a retry
         * would meet them out of order */
        if (dp(tr) && st != FY_INTERRUPTED) tr->broken = true;
    } else if (res.nrecs > 0) {
        /* the scheduler could not finish the graph after some tasks ran (a bug, logged):
         * what they applied is unknown */
        tr->broken = true;
    }
    free(tr->adam_step);
    tr->adam_step = NULL;
    tr->graph = NULL;
    if (w->trace && w->graph && st == FY_OK) {
        *w->trace = res;
        *w->graph = g;
    } else {
        fy_sched_result_free(&res);
        fy_graph_free(&g);
    }
    return st;
}

fy_status fy_trainer_predict(fy_trainer *tr, int nsteps, fy_sched_mode mode, bool norm_barrier,
                             fy_sched_result *out) {
    memset(out, 0, sizeof *out);
    fy_graph g;
    fy_status st = build_train(tr, &g, nsteps, norm_barrier);
    if (st == FY_OK) st = fy_sched_simulate(&g, mode, out);
    fy_graph_free(&g);
    return st;
}

fy_status fy_trainer_step_work(fy_trainer *tr, double busy_ms[FY_LANE_COUNT], int *ntasks) {
    for (int l = 0; l < FY_LANE_COUNT; l++) busy_ms[l] = 0.0;
    fy_graph g;
    fy_status st = build_train(tr, &g, 1, true);
    *ntasks = st == FY_OK ? g.n : 0;
    for (int i = 0; st == FY_OK && i < g.n; i++) busy_ms[g.tasks[i].lane] += g.tasks[i].cost_ms;
    fy_graph_free(&g);
    return st;
}

/* Evaluation graphs hold at most this many batches (a pass over a large validation set
 * runs as several). */
#define EVAL_WINDOW 32

fy_status fy_trainer_eval_run(fy_trainer *tr, int nbatches, fy_batch_fn next_batch, void *ctx,
                              float *losses) {
    FY_TRY(usable(tr));
    tr->next_batch = next_batch;
    tr->batch_ctx = ctx;
    tr->eval = true;
    fy_status st = FY_OK;
    for (int b0 = 0; b0 < nbatches && st == FY_OK; b0 += EVAL_WINDOW) {
        const int n = nbatches - b0 < EVAL_WINDOW ? nbatches - b0 : EVAL_WINDOW;
        tr->eval_base = b0;
        tr->eval_losses = losses + b0;
        fy_graph g;
        fy_sched_result res = {0};
        st = build_eval(tr, &g, n);
        if (st == FY_OK) st = execute(tr, &g, &res);
        fy_sched_result_free(&res);
        fy_graph_free(&g);
    }
    tr->eval = false;
    tr->eval_losses = NULL;
    tr->graph = NULL;
    return st;
}

typedef struct arrays { const int32_t *x, *y; size_t N; int64_t base; } arrays;

static fy_status from_arrays(void *ctx, int64_t micro, int32_t *x, int32_t *y) {
    const arrays *a = ctx;
    size_t off = (size_t)(micro - a->base) * a->N;
    memcpy(x, a->x + off, a->N * sizeof(int32_t));
    memcpy(y, a->y + off, a->N * sizeof(int32_t));
    return FY_OK;
}

fy_status fy_trainer_step(fy_trainer *tr, const int32_t *x, const int32_t *y, float lr,
                          fy_step_stats *out) {
    if (dp(tr)) { /* its arrays hold this process's micro-batches, numbered locally */
        fy_log_error("fy_trainer_step: a data-parallel trainer runs windows (fy_trainer_run)");
        return FY_ERR_UNSUPPORTED;
    }
    arrays a = {x, y, tokens_n(tr), tr->micro_base};
    fy_window w = {.nsteps = 1, .lrs = &lr, .next_batch = from_arrays, .batch_ctx = &a,
                   .stats = out};
    fy_status st = fy_trainer_run(tr, &w);
    if (st == FY_OK && out->skipped)
        fy_log_warn("step %lld: gradient norm is %g; update skipped",
                    (long long)tr->steps_done + 1, out->grad_norm);
    return st;
}

fy_status fy_trainer_eval(fy_trainer *tr, const int32_t *x, const int32_t *y, float *loss) {
    arrays a = {x, y, tokens_n(tr), 0};
    return fy_trainer_eval_run(tr, 1, from_arrays, &a, loss);
}

void fy_trainer_inject_failure(fy_trainer *tr, fy_task_kind kind, int block, int64_t micro,
                               fy_status st) {
    tr->inject.kind = kind;
    tr->inject.block = block;
    tr->inject.micro = micro;
    tr->inject.st = st;
    atomic_store(&tr->inject.armed, true);
}
