/* step_run.c — what each task of the step graph does: its runner queues its block's work
 * on its lane's stream (device lanes) or does it (the cpu and, over MPI, comm lanes).
 *
 * Every buffer a runner touches comes from the layout's answer for a state
 * (fy_tr_ptr, fy_tr_at: the weights, the master, the host weights, the gradient, the
 * moments) or from the staging unit a task took (the scheduler's pools). Which task
 * runs when, and after what, is the builder's (step_build.c); the waits on the device
 * and the events are the executor's (step_exec.c).
 *
 * Gradients: a backward pass writes a block's gradient where the builder said
 * (fy_grad_at): a staging unit, or the device accumulator (GRAD on the device). When a
 * micro-batch's gradient of a block is complete (its own backward ran), a staged block
 * updated on the device adds it into its accumulator, and on the step's last micro-batch
 * the sum of squares is taken where the final gradient is (on the host, by d2h_grad,
 * when a block updated on the CPU accumulates there or is row-staged or chunked; after
 * the sum over ranks in a job). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/dtype.h"
#include "engine/core/reduce.h"
#include "engine/core/util.h"
#include "engine/device/kernels.h"
#include "engine/trainer_core.h"
#include "offload/disk.h"

/* ---- helpers -------------------------------------------------------------------------- */

/* The window's working buffers (storage.h: fy_window_bufs). */
static fy_window_bufs *bufs(const fy_trainer *tr) { return &tr->st->win; }

static int accum(const fy_trainer *tr) { return tr->L->accum; }
static size_t tokens_n(const fy_trainer *tr) { return (size_t)tr->L->B * tr->L->T; }
static int step_of(const fy_trainer *tr, const fy_step_task *p) { return p->micro / accum(tr); }
static bool dp(const fy_trainer *tr) { return tr->world > 1; }
static bool staged(const fy_trainer *tr, int b) { return fy_tr_blk(tr, b)->grad_staged; }
static bool cpu_update(const fy_trainer *tr, int b) { return fy_tr_blk(tr, b)->update == FY_UPDATE_CPU; }
static bool rows_staged(const fy_trainer *tr, int b) { return fy_tr_blk(tr, b)->staging == FY_STAGE_ROWS; }
static bool chunked(const fy_trainer *tr, int b) { return fy_tr_blk(tr, b)->staging == FY_STAGE_CHUNKS; }
static bool lp(const fy_trainer *tr) { return tr->L->dtype != FY_F32; }

int64_t fy_exec_abs_micro(const fy_trainer *tr, const fy_step_task *p) {
    if (tr->ex.eval) return tr->ex.eval_base + p->micro;
    const int64_t m = tr->micro_base + p->micro, A = accum(tr);
    return (m / A) * tr->micro_total + tr->micro_first + m % A;
}

/* The buffer of the unit task `id` took from a parameter or a gradient pool: its block's
 * ring (a fetch's block, a grad_zero's, or a backward pass's own). */
static void *param_unit(const fy_trainer *tr, int id) {
    const fy_task *t = &tr->ex.sg->g.tasks[id];
    return tr->st->param_ring[fy_tr_blk(tr, t->block)->ring].slots[t->unit];
}
static void *grad_unit(const fy_trainer *tr, int id) {
    const fy_task *t = &tr->ex.sg->g.tasks[id];
    return tr->st->grad_ring[fy_tr_blk(tr, t->block)->ring].slots[t->unit];
}
/* The act-ring slot task `id` took (an offloaded output's forward, an h2d_act). */
static void *act_unit(const fy_trainer *tr, int id) {
    return tr->st->act_ring.slots[tr->ex.sg->g.tasks[id].unit];
}

/* Block b's weights for a pass: the slot of fetch task `fetch`, or the device copy. */
static const void *weights_for(const fy_trainer *tr, int b, int fetch) {
    return fetch >= 0 ? param_unit(tr, fetch) : fy_tr_ptr(tr, b, FY_STATE_WEIGHTS);
}

/* Micro-batch m's token buffer: inputs, targets, and with a row-staged block the inputs
 * renumbered into its rows. */
static int32_t *tokens_dev(const fy_trainer *tr, int m) {
    return bufs(tr)->tok_dev + (size_t)(m % 2) * tr->L->tok_parts * tokens_n(tr);
}
/* A block's staged copy (a slot's weights or gradient) in bytes. */
static size_t stage_nbytes(const fy_trainer *tr, int b) {
    return fy_tr_blk(tr, b)->stage_nelem * fy_tr_es(tr);
}

/* Block b's gradient for a task writing it in micro-batch a (g says where), zeroed here
 * when the task writes it first. */
static void *grad_for_write(fy_trainer *tr, int b, int a, fy_grad_at g, int self) {
    void *buf = g.unit_task >= 0 ? grad_unit(tr, g.unit_task) : fy_tr_ptr(tr, b, FY_STATE_GRAD);
    if (g.writes_first && (g.unit_task == self || (g.unit_task < 0 && a == 0)))
        fy_memset_async(tr->s, buf, 0, g.unit_task >= 0 ? stage_nbytes(tr, b) : fy_tr_nbytes(tr, b));
    return buf;
}

/* Micro-batch a's gradient of block b is complete in g (see the top). */
static void grad_complete(fy_trainer *tr, int b, int a, const void *g) {
    void *acc = fy_tr_ptr(tr, b, FY_STATE_GRAD);
    const size_t n = fy_tr_blk(tr, b)->nelem;
    if (!cpu_update(tr, b) && staged(tr, b)) {
        if (a == 0) fy_copy_async(tr->s, acc, g, fy_tr_nbytes(tr, b), FY_D2D);
        else fy_k_residual_fwd(acc, acc, g, n, tr->s);
    }
    if (a != accum(tr) - 1 || rows_staged(tr, b) || chunked(tr, b) || dp(tr)) return;
    const void *final = !cpu_update(tr, b) ? acc : accum(tr) == 1 ? g : NULL;
    if (!final) return;
    fy_k_sumsq(bufs(tr)->sumsq_dev + b, final, n, tr->s);
    fy_copy_async(tr->s, bufs(tr)->sumsq_host + b, bufs(tr)->sumsq_dev + b, sizeof(double), FY_D2H);
}

/* A pass's device views: activations and tokens of micro-batch m, weights of the block
 * and its links; a pass given the micro-batch's rows (a row-staged block's, a fwd_rows
 * block's forward: its fetch says) sees them and the tokens renumbered into them. */
static fy_block_io pass_io(const fy_trainer *tr, int b, const fy_step_task *p) {
    const fy_storage *st = tr->st;
    const fy_block_spec *blk = fy_model_block(tr->model, b);
    const int f = p->u.pass.fetch;
    const bool by_rows = rows_staged(tr, b) || (f >= 0 && tr->ex.sg->task[f].u.fetch.rows);
    fy_block_io io = {.B = tr->L->B, .T = tr->L->T,
                      .params = weights_for(tr, b, p->u.pass.fetch),
                      .in = p->u.pass.in_unit >= 0 ? act_unit(tr, p->u.pass.in_unit)
                            : b > 0 ? st->acts[b - 1].out : NULL,
                      .out = p->u.pass.out_unit >= 0 ? act_unit(tr, p->u.pass.out_unit) : st->acts[b].out,
                      .saved = st->acts[b].saved, .work = st->work, .dx = st->dx,
                      .tokens = tokens_dev(tr, p->micro) + (by_rows ? 2 * tokens_n(tr) : 0),
                      .docs = tr->cfg.docs.kind == FY_DOCS_NONE ? NULL
                              : tokens_dev(tr, p->micro) + (size_t)tr->L->docs_part * tokens_n(tr),
                      .targets = tokens_dev(tr, p->micro) + tokens_n(tr)};
    for (int k = 0; k < blk->nlinks; k++)
        io.link_params[k] = weights_for(tr, blk->links[k], p->u.pass.link_fetch[k]);
    if (by_rows) io.table_rows = tr->ex.nrows[p->micro % 2];
    return io;
}

/* The gradients a backward pass writes: the block's and its links'. */
static void bind_grads(fy_trainer *tr, int b, const fy_step_task *p, int self, fy_block_io *io) {
    const fy_block_spec *blk = fy_model_block(tr->model, b);
    const int a = p->micro % accum(tr);
    io->grads = grad_for_write(tr, b, a, p->u.pass.grad, self);
    for (int k = 0; k < blk->nlinks; k++)
        io->link_grads[k] = grad_for_write(tr, blk->links[k], a, p->u.pass.link_grad[k], self);
}

/* The divisor of a pass's losses (model.h: loss_div): training, the targets its step
 * counts over every micro-batch and rank (1 when it counts none: the losses are all 0 and
 * the step is skipped), so the micro-batches' shares add up to the step's mean loss;
 * evaluation, its own batch's. And a training step's loss scale, 1 / that. */
static int64_t loss_div(const fy_trainer *tr, const fy_step_task *p) {
    const int64_t n = tr->ex.eval ? tr->ex.eval_counts[p->micro] : tr->ex.step_targets[step_of(tr, p)];
    return n > 0 ? n : 1;
}
static float loss_scale(const fy_trainer *tr, const fy_step_task *p) {
    return (float)(1.0 / (double)loss_div(tr, p));
}

/* ---- forward and backward ------------------------------------------------------------- */

void fy_doc_starts(const fy_doc_mask *m, const int32_t *tok, int n, int T, int32_t *docs) {
    for (int b = 0; b < n; b++) {
        const int32_t *x = tok + (size_t)b * T;
        int32_t *d = docs + (size_t)b * T, start = 0;
        for (int t = 0; t < T; t++) {
            if (t > 0 && ((m->kind == FY_DOCS_EOT && x[t - 1] == m->token) ||
                          (m->kind == FY_DOCS_BOS && x[t] == m->token)))
                start = t;
            d[t] = start;
        }
    }
}

static int cmp_i32(const void *a, const void *b) {
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* The row-staged block's rows for token buffer `buf` (the distinct inputs, in increasing
 * order), and the inputs renumbered into them (out). */
static fy_status gather_rows(fy_trainer *tr, int buf, const int32_t *tok, int32_t *out, size_t N) {
    const fy_block_spec *blk = fy_model_block(tr->model, tr->L->rows_block);
    const uint32_t nrows = (uint32_t)blk->tensors[0].alloc_rows;
    int32_t *rows = bufs(tr)->rows + (size_t)buf * N, *map = bufs(tr)->row_map;
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
    tr->ex.nrows[buf] = (int)n;
    return FY_OK;
}

static fy_status run_load(fy_trainer *tr, int id, const fy_task *t, const fy_step_task *p) {
    const size_t N = tokens_n(tr), parts = (size_t)tr->L->tok_parts;
    int32_t *h = bufs(tr)->tok_host + (size_t)(p->micro % 2) * parts * N;
    if (p->u.load.reuse >= 0) fy_event_sync(tr->ex.ev_end[p->u.load.reuse]); /* its copy is done */
    const bool docs = tr->cfg.docs.kind != FY_DOCS_NONE; /* the last part, else unused */
    int32_t *dh = h + (size_t)tr->L->docs_part * N;
    FY_TRY(tr->ex.next_batch(tr->ex.batch_ctx, fy_exec_abs_micro(tr, p), h, h + N,
                             tr->cfg.docs.kind == FY_DOCS_DATA ? dh : NULL));
    if (tr->ex.eval) { /* its loss's divisor (the head follows the load) */
        int64_t n = 0;
        for (size_t i = 0; i < N; i++) n += h[N + i] >= 0;
        tr->ex.eval_counts[p->micro] = n;
    }
    if (tr->L->rows_block >= 0) FY_TRY(gather_rows(tr, p->micro % 2, h, h + 2 * N, N));
    if (docs && tr->cfg.docs.kind != FY_DOCS_DATA) fy_doc_starts(&tr->cfg.docs, h, tr->L->B, tr->L->T, dh);
    fy_copy_async(tr->s_h2d, tokens_dev(tr, p->micro), h, (docs ? parts : parts - 1) * N * sizeof(int32_t),
                  FY_H2D);
    return FY_OK;
}

/* A chunked head's fetch of chunk k: the chunk view (model.h), its classifier rows then
 * the head's other tensors. */
static void fetch_chunk(fy_trainer *tr, int b, int k, void *slot) {
    const size_t es = fy_tr_es(tr);
    size_t ro, rn, to, tn;
    fy_model_chunk_ranges(tr->model, b, tr->L->head_chunks, k, &ro, &rn, &to, &tn);
    const char *src = fy_tr_ptr(tr, b, FY_STATE_HOST_WEIGHTS);
    fy_copy_async(tr->s_h2d, slot, src + ro * es, rn * es, FY_H2D);
    fy_copy_async(tr->s_h2d, (char *)slot + (fy_tr_blk(tr, b)->stage_nelem - tn) * es,
                  src + to * es, tn * es, FY_H2D);
}

/* A fetch of rows: the micro-batch's rows of the block's host weights, gathered on the
 * host into the pinned buffer once the previous such fetch's copy out of it is done and
 * the weights' last writer on another device lane (a device update's d2h_param) has
 * landed them. */
static void fetch_rows(fy_trainer *tr, int id, int b, int micro, void *slot) {
    const size_t row = (size_t)fy_model_block(tr->model, b)->tensors[0].cols * fy_tr_es(tr);
    const int buf = micro % 2, n = tr->ex.nrows[buf];
    const int32_t *rows = bufs(tr)->rows + (size_t)buf * tokens_n(tr);
    if (tr->ex.rows_fetch_last >= 0) fy_event_sync(tr->ex.ev_end[tr->ex.rows_fetch_last]);
    fy_exec_host_after(tr, id);
    char *dst = bufs(tr)->rows_host;
    const char *src = fy_tr_ptr(tr, b, FY_STATE_HOST_WEIGHTS);
    for (int k = 0; k < n; k++) memcpy(dst + (size_t)k * row, src + (size_t)rows[k] * row, row);
    fy_copy_async(tr->s_h2d, slot, dst, (size_t)n * row, FY_H2D);
    tr->ex.rows_fetch_last = id;
}

/* h2d_param: the host weights for compute; for a device update, the master's range (with
 * bf16 storage its shard, and the bf16 copy the update writes follows it in the slot). */
static fy_status run_h2d_param(fy_trainer *tr, int id, const fy_task *t, const fy_step_task *p) {
    const int b = t->block;
    void *slot = param_unit(tr, id);
    if (p->u.fetch.rows) {
        fetch_rows(tr, id, b, p->micro, slot);
    } else if (p->chunk >= 0) {
        fetch_chunk(tr, b, p->chunk, slot);
    } else if (p->u.fetch.for_update) {
        const fy_place *m = fy_layout_state(tr->L, b, FY_STATE_MASTER);
        fy_copy_async(tr->s_h2d, slot, fy_tr_ptr(tr, b, FY_STATE_MASTER), (m->hi - m->lo) * sizeof(float), FY_H2D);
    } else {
        fy_copy_async(tr->s_h2d, slot, fy_tr_ptr(tr, b, FY_STATE_HOST_WEIGHTS), fy_tr_nbytes(tr, b), FY_H2D);
    }
    return FY_OK;
}

/* fwd and recompute: the same pass, so a recomputed block rebuilds the same bits. */
static fy_status run_fwd(fy_trainer *tr, int id, const fy_task *t, const fy_step_task *p) {
    fy_block_io io = pass_io(tr, t->block, p);
    fy_model_forward(tr->model, t->block, &io, tr->s);
    return FY_OK;
}
#define run_recompute run_fwd

static fy_status run_grad_zero(fy_trainer *tr, int id, const fy_task *t, const fy_step_task *p) {
    fy_memset_async(tr->s, grad_unit(tr, id), 0, fy_tr_nbytes(tr, t->block));
    return FY_OK;
}

/* head: the loss pass; in training also its backward, and the loss goes to the host. */
static fy_status run_head(fy_trainer *tr, int id, const fy_task *t, const fy_step_task *p) {
    const int b = t->block;
    fy_block_io io = pass_io(tr, b, p);
    /* a chunked head: chunk k's forward; the last writes the loss, and in training also
     * runs its backward into the gradient unit it took */
    const bool last = p->chunk < 0 || p->chunk == tr->L->head_chunks.n - 1;
    io.chunked = p->chunk >= 0;
    io.chunk = p->chunk;
    const int slot = p->micro % accum(tr); /* training: its micro-batch; evaluation: one
                                              loss slot per batch in flight */
    io.loss = bufs(tr)->loss_dev + slot;
    io.loss_div = loss_div(tr, p);
    if (!p->u.pass.train) {
        fy_model_loss(tr->model, b, &io, tr->s);
        if (last) fy_copy_async(tr->s, bufs(tr)->loss_host + slot, bufs(tr)->loss_dev + slot, sizeof(float), FY_D2H);
        return FY_OK;
    }
    io.dloss = loss_scale(tr, p);
    if (last) bind_grads(tr, b, p, id, &io);
    fy_model_loss(tr->model, b, &io, tr->s);
    if (!last) return FY_OK;
    fy_copy_async(tr->s, bufs(tr)->loss_host + slot, bufs(tr)->loss_dev + slot, sizeof(float), FY_D2H);
    grad_complete(tr, b, slot, io.grads);
    return FY_OK;
}

static fy_status run_bwd(fy_trainer *tr, int id, const fy_task *t, const fy_step_task *p) {
    const int b = t->block;
    fy_block_io io = pass_io(tr, b, p);
    if (p->chunk >= 0) { /* a chunked head's backward of chunk k (its forward ran) */
        io.chunked = io.chunk_bwd = true;
        io.chunk = p->chunk;
        io.dloss = loss_scale(tr, p);
        io.loss_div = loss_div(tr, p);
        bind_grads(tr, b, p, id, &io);
        fy_model_loss(tr->model, b, &io, tr->s);
        return FY_OK;
    }
    bind_grads(tr, b, p, id, &io);
    fy_model_backward(tr->model, b, &io, tr->s);
    grad_complete(tr, b, p->micro % accum(tr), io.grads);
    return FY_OK;
}

/* ---- gradients to the host ------------------------------------------------------------ */

/* The sum of squares of n elements of the storage type in host memory (fy_k_sumsq's
 * bits on the cpu backend). */
static double host_sumsq(const fy_trainer *tr, const void *g, size_t n) {
    return lp(tr) ? fy_sumsq_bf16((const uint16_t *)g, n) : fy_sumsq((const float *)g, n);
}

/* The host's sum of micro-batch gradients: acc[i] += add[i] for n elements of the
 * storage type (the device's accumulation). */
static void host_add(const fy_trainer *tr, void *acc, const void *add, size_t n) {
    fy_add_n(fy_tr_dt(tr), acc, add, n);
}

/* A row-staged block's d2h_grad: its rows' gradient lands in the landing slot and is
 * scattered into GRAD, which the first micro-batch zeroes; the rows no token chose get
 * nothing, as their gradient in the whole table is zero. The norm is taken over the
 * whole table, as an accumulated block's. */
static void scatter_rows(fy_trainer *tr, int b, int micro, const void *g) {
    const size_t es = fy_tr_es(tr), row = (size_t)fy_model_block(tr->model, b)->tensors[0].cols * es;
    const int buf = micro % 2, n = tr->ex.nrows[buf], a = micro % accum(tr);
    const int32_t *rows = bufs(tr)->rows + (size_t)buf * tokens_n(tr);
    char *tmp = bufs(tr)->landing, *acc = fy_tr_ptr(tr, b, FY_STATE_GRAD);
    fy_copy_async(tr->s_d2h, tmp, g, (size_t)n * row, FY_D2H);
    fy_stream_sync(tr->s_d2h);
    if (a == 0) memset(acc, 0, fy_tr_nbytes(tr, b));
    for (int k = 0; k < n; k++) {
        if (a == 0) memcpy(acc + (size_t)rows[k] * row, tmp + (size_t)k * row, row);
        else host_add(tr, acc + (size_t)rows[k] * row, tmp + (size_t)k * row, row / es);
    }
    if (a == accum(tr) - 1 && !dp(tr)) bufs(tr)->sumsq_host[b] = host_sumsq(tr, acc, fy_tr_blk(tr, b)->nelem);
}

/* A chunked head's d2h_grad of chunk k: its rows' gradient (and with k = 0, the last,
 * the other tensors') into GRAD's, directly for the first micro-batch, else through the
 * landing slot and added; the last chunk of the step's last micro-batch takes the norm
 * over the whole gradient (the earlier chunks' copies are before it on the stream). */
static void land_chunk(fy_trainer *tr, int b, int micro, int k, const void *g) {
    const int a = micro % accum(tr);
    const size_t es = fy_tr_es(tr);
    size_t ro, rn, to, tn;
    fy_model_chunk_ranges(tr->model, b, tr->L->head_chunks, k, &ro, &rn, &to, &tn);
    const char *gt = (const char *)g + (fy_tr_blk(tr, b)->stage_nelem - tn) * es;
    char *acc = fy_tr_ptr(tr, b, FY_STATE_GRAD), *tmp = bufs(tr)->landing;
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
    bufs(tr)->sumsq_host[b] = host_sumsq(tr, acc, fy_tr_blk(tr, b)->nelem);
}

/* A split table's part (layout.h: split_grad; 1: the rows the micro-batch's tokens do
 * not choose, 2: those they do) from unit g: into GRAD at their places (the first
 * micro-batch), else into the landing slot at the same places and added. One copy per
 * run of consecutive rows (the tokens' rows are in increasing order). */
static void land_part(fy_trainer *tr, int b, int micro, int part, const char *g) {
    const size_t es = fy_tr_es(tr), row = (size_t)fy_model_block(tr->model, b)->tensors[0].cols * es;
    const size_t nrows = fy_tr_nbytes(tr, b) / row;
    const int buf = micro % 2, n = tr->ex.nrows[buf], a = micro % accum(tr);
    const int32_t *rows = bufs(tr)->rows + (size_t)buf * tokens_n(tr);
    char *acc = fy_tr_ptr(tr, b, FY_STATE_GRAD), *dst = a == 0 ? acc : bufs(tr)->landing;
    for (int pass = 0; pass < (a == 0 ? 1 : 2); pass++) { /* copy; then add what landed */
        if (pass == 1) fy_stream_sync(tr->s_d2h);
        size_t next = 0; /* part 1: the first row after the last token row seen */
        for (int k = 0; k <= n;) {
            size_t r0, r1;
            if (part == 1) {
                r0 = next;
                r1 = k < n ? (size_t)rows[k] : nrows;
                next = r1 + 1;
                k++;
            } else {
                if (k == n) break;
                r0 = (size_t)rows[k];
                while (k + 1 < n && (size_t)rows[k + 1] == (size_t)rows[k] + 1) k++;
                r1 = (size_t)rows[k++] + 1;
            }
            if (r1 <= r0) continue;
            if (pass == 0) fy_copy_async(tr->s_d2h, dst + r0 * row, g + r0 * row, (r1 - r0) * row, FY_D2H);
            else host_add(tr, acc + r0 * row, dst + r0 * row, (r1 - r0) * row / es);
        }
    }
}

/* d2h_grad: the first micro-batch lands in GRAD, later ones in the landing slot and are
 * added there (host_add), which reads the copy: the host waits for it. */
static fy_status run_d2h_grad(fy_trainer *tr, int id, const fy_task *t, const fy_step_task *p) {
    const int b = t->block, a = p->micro % accum(tr);
    const void *g = grad_unit(tr, p->u.d2h_grad.unit_task);
    if (p->u.d2h_grad.part) {
        land_part(tr, b, p->micro, p->u.d2h_grad.part, g);
        if (p->u.d2h_grad.part == 1 || accum(tr) == 1 || a != accum(tr) - 1 || dp(tr)) return FY_OK;
        bufs(tr)->sumsq_host[b] = host_sumsq(tr, fy_tr_ptr(tr, b, FY_STATE_GRAD), fy_tr_blk(tr, b)->nelem);
        return FY_OK;
    }
    if (rows_staged(tr, b)) {
        scatter_rows(tr, b, p->micro, g);
        return FY_OK;
    }
    if (p->chunk >= 0) {
        land_chunk(tr, b, p->micro, p->chunk, g);
        return FY_OK;
    }
    void *acc = fy_tr_ptr(tr, b, FY_STATE_GRAD), *dst = a == 0 ? acc : bufs(tr)->landing;
    fy_copy_async(tr->s_d2h, dst, g, fy_tr_nbytes(tr, b), FY_D2H);
    if (accum(tr) == 1) return FY_OK;
    fy_stream_sync(tr->s_d2h);
    const size_t n = fy_tr_blk(tr, b)->nelem;
    if (a > 0) host_add(tr, acc, dst, n);
    if (a == accum(tr) - 1 && !dp(tr)) bufs(tr)->sumsq_host[b] = host_sumsq(tr, acc, n);
    return FY_OK;
}

/* ---- collectives ------------------------------------------------------------------------ */

/* The job's collectives for a state's buffer (comm.h: the backend by its memory kind). */
static fy_coll coll_for(const fy_trainer *tr, int b, fy_state s) {
    return fy_comm_coll(tr->comm, tr->dev, fy_tr_on_device(tr, b, s) ? FY_MEM_DEVICE : FY_MEM_HOST);
}

/* reduce (data parallel): block b's step gradient summed over the ranks into this rank's
 * shard, and the chunk sums of the shard's squares into this rank's part of parts_host
 * (the norm adds every rank's in chunk order: the one-process norm's bits), on the
 * stream after a queued collective, else on the host. */
static fy_status run_reduce(fy_trainer *tr, int id, const fy_task *t, const fy_step_task *p) {
    const int b = t->block;
    const fy_block_layout *bl = fy_tr_blk(tr, b);
    size_t off[FY_MAX_SHARDS + 1];
    fy_tr_shards(tr, b, off);
    double *parts = bufs(tr)->parts_host + tr->part_region[tr->rank] + tr->part_base[b];
    const fy_coll co = coll_for(tr, b, FY_STATE_GRAD);
    FY_TRY(fy_coll_reduce_scatter(co, tr->s_comm, fy_tr_ptr(tr, b, FY_STATE_GRAD), off, fy_tr_dt(tr)));
    const void *shard = fy_tr_at(tr, b, FY_STATE_GRAD, bl->lo);
    if (!co.iface->queued) {
        fy_sumsq_parts(shard, lp(tr), bl->hi - bl->lo, parts);
        return FY_OK;
    }
    double *pd = bufs(tr)->parts_dev + tr->part_base[b];
    fy_k_sumsq_parts(pd, shard, bl->hi - bl->lo, tr->s_comm);
    fy_copy_async(tr->s_comm, parts, pd, fy_sumsq_nchunks(bl->hi - bl->lo) * sizeof(double), FY_D2H);
    return FY_OK;
}

/* Every shard of block b's weights from its owner, where the update wrote them (layout.h:
 * fy_layout_updated_weights). */
fy_status fy_run_gather_weights(fy_trainer *tr, int b) {
    const fy_state s = fy_layout_updated_weights(tr->L, b);
    size_t off[FY_MAX_SHARDS + 1];
    fy_tr_shards(tr, b, off);
    return fy_coll_allgather(coll_for(tr, b, s), tr->s_comm, fy_tr_ptr(tr, b, s), off, fy_tr_dt(tr));
}

static fy_status run_allgather(fy_trainer *tr, int id, const fy_task *t, const fy_step_task *p) {
    return fy_run_gather_weights(tr, t->block);
}

/* ---- the norm and the updates ----------------------------------------------------------- */

/* The sharded norm's sums of squares per block (sumsq_host): every rank's chunk sums
 * (parts_host, rank after rank, each rank's block after block) added per block in chunk
 * order, from rank 0's first chunk on. */
static fy_status shard_sumsq(fy_trainer *tr) {
    const int nb = fy_tr_nblocks(tr);
    FY_TRY(fy_comm_allgather(tr->comm, bufs(tr)->parts_host, tr->part_region, sizeof(double)));
    for (int b = 0; b < nb; b++) bufs(tr)->sumsq_host[b] = 0.0;
    for (int r = 0; r < tr->world; r++) {
        const double *x = bufs(tr)->parts_host + tr->part_region[r];
        for (int b = 0; b < nb; b++) {
            const size_t n = fy_shard_nchunks(fy_tr_blk(tr, b)->nelem, tr->world, r);
            for (size_t k = 0; k < n; k++) bufs(tr)->sumsq_host[b] += *x++;
        }
    }
    return FY_OK;
}

static fy_status run_norm(fy_trainer *tr, int id, const fy_task *t, const fy_step_task *p) {
    const int step = step_of(tr, p);
    fy_step_stats *out = &tr->ex.stats[step];
    double ss = 0.0, loss = 0.0;
    if (dp(tr)) FY_TRY(shard_sumsq(tr));
    for (int b = 0; b < fy_tr_nblocks(tr); b++) ss += bufs(tr)->sumsq_host[b];
    for (int a = 0; a < accum(tr); a++) loss += bufs(tr)->loss_host[a];
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
    out->loss = (float)loss; /* each micro-batch's loss was its share of the step's mean */
    out->targets = tr->ex.step_targets[step];
    out->grad_norm = norm;
    out->clip_coef = 1.0f;
    out->skipped = !isfinite(norm) || out->targets == 0;
    if (!out->skipped && tr->cfg.clip > 0.0f) {
        float coef = tr->cfg.clip / (norm + 1e-6f);
        if (coef < 1.0f) out->clip_coef = coef;
    }
    if (!out->skipped) tr->steps_done++;
    tr->ex.adam_step[step] = tr->steps_done;
    tr->ex.normed = step;
    tr->ex.spec_ss = 0.0;
    tr->ex.prev_clipped = out->skipped || out->clip_coef < 1.0f;
    return FY_OK;
}

static fy_adam_hparams hparams(const fy_trainer *tr, int step) {
    return (fy_adam_hparams){.lr = tr->ex.lrs[step], .beta1 = tr->cfg.beta1,
                             .beta2 = tr->cfg.beta2, .eps = tr->cfg.eps,
                             .weight_decay = tr->cfg.weight_decay,
                             .step = tr->ex.adam_step[step],
                             .grad_scale = tr->ex.stats[step].clip_coef};
}

/* The two AdamW ranges of block b's shard: tensors with weight decay first, then the
 * others (each may be empty). */
static void adam_ranges(const fy_trainer *tr, int b, size_t off[2], size_t len[2]) {
    const fy_block_layout *bl = fy_tr_blk(tr, b);
    const size_t cut[3] = {0, fy_model_block(tr->model, b)->decay_nelem, bl->nelem};
    for (int k = 0; k < 2; k++) {
        const size_t a = cut[k] > bl->lo ? cut[k] : bl->lo, e = cut[k + 1] < bl->hi ? cut[k + 1] : bl->hi;
        off[k] = a;
        len[k] = e > a ? e - a : 0;
    }
}

/* adam_gpu: the master of the block's shard is updated; with bf16 storage the update
 * also writes the shard's bf16 copy (into the device weights, or the slot's second part).
 * A streamed block's slot holds the master's range (layout.h: MASTER), then the copy. */
static fy_status run_adam_gpu(fy_trainer *tr, int id, const fy_task *t, const fy_step_task *p) {
    if (tr->ex.stats[step_of(tr, p)].skipped) return FY_OK;
    const int b = t->block, fetch = p->u.update.fetch;
    const fy_place *mp = fy_layout_state(tr->L, b, FY_STATE_MASTER);
    const bool writes_copy = fy_layout_owns(tr->L, b, FY_STATE_MASTER);
    fy_adam_hparams hp = hparams(tr, step_of(tr, p));
    float *slot = fetch >= 0 ? param_unit(tr, fetch) : NULL;
    size_t off[2], len[2];
    adam_ranges(tr, b, off, len);
    for (int k = 0; k < 2; k++) {
        if (!len[k]) continue;
        const size_t o = off[k];
        void *out = !writes_copy ? NULL : slot ? (char *)(slot + (mp->hi - mp->lo)) + (o - mp->lo) * fy_tr_es(tr)
                                             : fy_tr_at(tr, b, FY_STATE_WEIGHTS, o);
        fy_adam_range r = {.param = slot ? slot + (o - mp->lo) : fy_tr_at(tr, b, FY_STATE_MASTER, o),
                           .m = fy_tr_at(tr, b, FY_STATE_M, o), .v = fy_tr_at(tr, b, FY_STATE_V, o),
                           .grad = fy_tr_at(tr, b, FY_STATE_GRAD, o), .grad_dtype = fy_tr_dt(tr),
                           .param_out = out, .out_dtype = fy_tr_dt(tr), .n = len[k], .decay = k == 0};
        fy_k_adamw(&hp, &r, tr->s);
    }
    return FY_OK;
}

/* d2h_param: the shard's updated master in the update fetch's slot (and, when the master
 * is apart, the copy after it) back to the host. */
static fy_status run_d2h_param(fy_trainer *tr, int id, const fy_task *t, const fy_step_task *p) {
    /* a skipped update wrote nothing: the host copies are current (with bf16 storage the
     * slot's second part holds stale bytes) */
    if (tr->ex.stats[step_of(tr, p)].skipped) return FY_OK;
    const int b = t->block;
    const fy_block_layout *bl = fy_tr_blk(tr, b);
    const fy_place *mp = fy_layout_state(tr->L, b, FY_STATE_MASTER);
    const size_t n = bl->hi - bl->lo, es = fy_tr_es(tr);
    const char *slot = param_unit(tr, p->u.update.fetch);
    fy_copy_async(tr->s_d2h, fy_tr_at(tr, b, FY_STATE_MASTER, bl->lo), slot + (bl->lo - mp->lo) * sizeof(float),
                  n * sizeof(float), FY_D2H);
    if (fy_layout_owns(tr->L, b, FY_STATE_MASTER))
        fy_copy_async(tr->s_d2h, fy_tr_at(tr, b, FY_STATE_HOST_WEIGHTS, bl->lo),
                      slot + (mp->hi - mp->lo) * sizeof(float), n * es, FY_D2H);
    return FY_OK;
}

/* Host weights w (n elements, the storage type) made from fp32 master values: a
 * skipped or failed step's gradient in them replaced. */
static void weights_from_master(const fy_trainer *tr, void *w, const float *master, size_t n) {
    if (lp(tr)) fy_f32_to_bf16_n(w, master, n);
    else memcpy(w, master, n * sizeof(float));
}

/* ---- the disk tier ------------------------------------------------------------------ */

/* A disk slot holds a chunk's master, m and v (fy_disk_states), each in a part of
 * fy_tr_disk_piece elements (storage.h). */
static char *disk_slot(const fy_trainer *tr, int read_task) {
    return tr->st->disk_ring.slots[tr->ex.sg->g.tasks[read_task].unit];
}

/* Chunk p->chunk of disk block t->block: its master and moments between the file and the
 * slot disk_read task `read` took (whole 4 KiB pieces: the regions are padded). */
static fy_status disk_chunk_io(fy_trainer *tr, const fy_task *t, const fy_step_task *p, int read, bool write) {
    size_t lo, hi;
    fy_layout_disk_range(tr->L, t->block, p->chunk, &lo, &hi);
    char *slot = disk_slot(tr, read);
    const size_t nbytes = fy_disk_align_up((hi - lo) * sizeof(float));
    for (int k = 0; k < FY_DISK_STATES; k++) {
        const size_t off = fy_storage_disk_off(tr->st, t->block, fy_disk_states[k], lo);
        char *part = slot + (size_t)k * fy_tr_disk_piece(tr) * sizeof(float);
        FY_TRY(write ? fy_disk_write(tr->st->disk, off, part, nbytes) : fy_disk_read(tr->st->disk, off, part, nbytes));
    }
    return FY_OK;
}

static fy_status run_disk_read(fy_trainer *tr, int id, const fy_task *t, const fy_step_task *p) {
    return disk_chunk_io(tr, t, p, id, false);
}

/* A skipped step changed nothing: the file holds the chunk already. */
static fy_status run_disk_write(fy_trainer *tr, int id, const fy_task *t, const fy_step_task *p) {
    if (tr->ex.stats[step_of(tr, p)].skipped) return FY_OK;
    return disk_chunk_io(tr, t, p, p->u.update.fetch, true);
}

/* A disk block's update of chunk p->chunk (elements lo..hi of its shard) in the slot its
 * read took: AdamW on the master and moments there, writing the host weights (over the
 * gradient when they share a buffer, as host_adam); a skipped step's host weights made
 * weights again from the slot's master. */
static void disk_adam(fy_trainer *tr, int b, const fy_step_task *p) {
    size_t lo, hi;
    fy_layout_disk_range(tr->L, b, p->chunk, &lo, &hi);
    float *master = (float *)disk_slot(tr, p->u.update.fetch);
    const size_t part = fy_tr_disk_piece(tr);
    const int step = step_of(tr, p);
    if (tr->ex.stats[step].skipped) {
        if (fy_layout_grad_in_weights(tr->L, b))
            weights_from_master(tr, fy_tr_at(tr, b, FY_STATE_HOST_WEIGHTS, lo), master, hi - lo);
        return;
    }
    const fy_adam_hparams hp = hparams(tr, step);
    size_t off[2], len[2];
    adam_ranges(tr, b, off, len);
    for (int k = 0; k < 2; k++) {
        const size_t a = off[k] > lo ? off[k] : lo, e = off[k] + len[k] < hi ? off[k] + len[k] : hi;
        if (e <= a) continue;
        fy_adam_range r = {.param = master + (a - lo), .m = master + part + (a - lo),
                           .v = master + 2 * part + (a - lo),
                           .grad = fy_tr_at(tr, b, FY_STATE_GRAD, a), .grad_dtype = fy_tr_dt(tr),
                           .param_out = fy_tr_at(tr, b, FY_STATE_HOST_WEIGHTS, a),
                           .out_dtype = fy_tr_dt(tr), .n = e - a, .decay = k == 0};
        fy_status s = fy_adam_pool_step(tr->pool, &hp, &r);
        FY_ASSERT(s == FY_OK, "a cpu AdamW step without check_finite cannot fail");
    }
}

/* Between windows (a failed one's end): block b's host weights from its master on disk,
 * a slot's part at a time through the first disk slot. */
static fy_status restore_from_disk(fy_trainer *tr, int b) {
    const fy_block_layout *bl = fy_tr_blk(tr, b);
    const size_t part = fy_tr_disk_piece(tr);
    for (size_t lo = bl->lo; lo < bl->hi; lo += part) {
        const size_t n = bl->hi - lo < part ? bl->hi - lo : part;
        FY_TRY(fy_trainer_disk_piece(tr, b, FY_STATE_MASTER, lo, n, false));
        weights_from_master(tr, fy_tr_at(tr, b, FY_STATE_HOST_WEIGHTS, lo), tr->st->disk_ring.slots[0], n);
    }
    return FY_OK;
}

/* A block whose gradient landed in its host weights (layout.h: GRAD same as
 * HOST_WEIGHTS) and was not updated over it (a skipped step, a failed one) gets its
 * shard of them back from its master (a job's allgather brings the others'). */
void fy_run_restore_weights(fy_trainer *tr, int b) {
    const bool spec = tr->ex.spec_wrote[b];
    tr->ex.spec_wrote[b] = false; /* its spare side is not the update */
    if (!fy_layout_grad_in_weights(tr->L, b) && !(spec && fy_layout_owns(tr->L, b, FY_STATE_MASTER)))
        return;
    const fy_block_layout *bl = fy_tr_blk(tr, b);
    if (bl->disk_chunks) {
        if (restore_from_disk(tr, b) != FY_OK) tr->broken = true;
        return;
    }
    weights_from_master(tr, fy_tr_at(tr, b, FY_STATE_HOST_WEIGHTS, bl->lo),
                        fy_tr_at(tr, b, FY_STATE_MASTER, bl->lo), bl->hi - bl->lo);
}

/* Block b's AdamW on the host under hp: the fp32 master, m and v, in place, or (spare)
 * read from them and written into the spare side; with the master apart the update
 * writes the host weights too (over the gradient when they share a buffer: AdamW reads
 * each gradient element before it writes that element's weight). */
static void host_adam(fy_trainer *tr, int b, const fy_adam_hparams *hp, bool spare) {
    const bool writes_copy = fy_layout_owns(tr->L, b, FY_STATE_MASTER);
    const fy_state ws[3] = {spare ? FY_STATE_SPARE_MASTER : FY_STATE_MASTER,
                            spare ? FY_STATE_SPARE_M : FY_STATE_M, spare ? FY_STATE_SPARE_V : FY_STATE_V};
    size_t off[2], len[2];
    adam_ranges(tr, b, off, len);
    for (int k = 0; k < 2; k++) {
        if (!len[k]) continue;
        const size_t o = off[k];
        fy_adam_range r = {.param = fy_tr_at(tr, b, ws[0], o), .m = fy_tr_at(tr, b, ws[1], o),
                           .v = fy_tr_at(tr, b, ws[2], o),
                           .grad = fy_tr_at(tr, b, FY_STATE_GRAD, o), .grad_dtype = fy_tr_dt(tr),
                           .param_out = writes_copy ? fy_tr_at(tr, b, FY_STATE_HOST_WEIGHTS, o) : NULL,
                           .out_dtype = fy_tr_dt(tr), .n = len[k], .decay = k == 0};
        if (spare) {
            r.src_param = fy_tr_at(tr, b, FY_STATE_MASTER, o);
            r.src_m = fy_tr_at(tr, b, FY_STATE_M, o);
            r.src_v = fy_tr_at(tr, b, FY_STATE_V, o);
        }
        fy_status s = fy_adam_pool_step(tr->pool, hp, &r);
        FY_ASSERT(s == FY_OK, "a cpu AdamW step without check_finite cannot fail");
    }
}

/* The update of a step whose norm is known: AdamW with its clip coefficient, or, skipped,
 * the host weights made weights again. */
static void known_update(fy_trainer *tr, int b, int step) {
    if (tr->ex.stats[step].skipped) {
        fy_run_restore_weights(tr, b);
        return;
    }
    const fy_adam_hparams hp = hparams(tr, step);
    host_adam(tr, b, &hp, false);
}

/* Speculation (plan.h; step_build.h): before the norm, a block's update assumes it is
 * the unclipped, counted one, unless what is known already says otherwise: its own
 * gradient is not finite, or with this step's blocks updated so far it reaches the clip
 * threshold (their sums of squares only grow; that much clips, up to rounding, which the
 * commit settles exactly); and not after a step that clipped or was skipped (the next one
 * likely does too, and each speculation it redoes costs the CPU a second AdamW). It
 * reads the block's state and writes the spare side; the commit swaps them when the norm
 * agrees. */
static bool speculate(fy_trainer *tr, int b, int step) {
    fy_exec *ex = &tr->ex;
    const double ss = bufs(tr)->sumsq_host[b], clip = tr->cfg.clip;
    if (ex->normed >= step || !isfinite(ss) || ex->prev_clipped) return false;
    ex->spec_ss += ss;
    if (clip > 0.0 && ex->spec_ss >= clip * clip) return false;
    fy_adam_hparams hp = hparams(tr, step);
    hp.grad_scale = 1.0f;
    hp.step = tr->steps_done + 1; /* the previous step's norm counted the steps so far */
    host_adam(tr, b, &hp, true);
    ex->spec_wrote[b] = true;
    ex->stats[step].speculated++;
    return true;
}

static fy_status run_adam_cpu(fy_trainer *tr, int id, const fy_task *t, const fy_step_task *p) {
    const int b = t->block;
    if (fy_tr_blk(tr, b)->disk_chunks) {
        disk_adam(tr, b, p);
        return FY_OK;
    }
    if (fy_tr_blk(tr, b)->speculate) {
        speculate(tr, b, step_of(tr, p)); /* else its commit updates it */
        return FY_OK;
    }
    known_update(tr, b, step_of(tr, p));
    return FY_OK;
}

/* commit: a speculative update that was the update (unclipped, counted) takes its spare
 * side; otherwise the block is updated now, as without speculation: in place with the
 * clip coefficient (the kept side is the state before the step), or skipped (the host
 * weights the speculation wrote made weights again). */
static fy_status run_commit(fy_trainer *tr, int id, const fy_task *t, const fy_step_task *p) {
    const int b = t->block, step = step_of(tr, p);
    const fy_step_stats *s = &tr->ex.stats[step];
    if (tr->ex.spec_wrote[b] && !s->skipped && s->clip_coef == 1.0f) {
        tr->ex.spec_wrote[b] = false;
        fy_storage_swap_spare(tr->st, b);
        tr->ex.stats[step].kept++;
        return FY_OK;
    }
    known_update(tr, b, step); /* a skipped one reads spec_wrote[b] (and clears it) */
    tr->ex.spec_wrote[b] = false;
    return FY_OK;
}

bool fy_run_applies(const fy_trainer *tr, const fy_task *t) {
    return t->kind == FY_T_ADAM_GPU || t->kind == FY_T_COMMIT ||
           (t->kind == FY_T_ADAM_CPU && !fy_tr_blk(tr, t->block)->speculate);
}

static fy_status run_h2d_update(fy_trainer *tr, int id, const fy_task *t, const fy_step_task *p) {
    const int b = t->block;
    fy_copy_async(tr->s_h2d, fy_tr_ptr(tr, b, FY_STATE_WEIGHTS), fy_tr_ptr(tr, b, FY_STATE_HOST_WEIGHTS),
                  fy_tr_nbytes(tr, b), FY_H2D);
    return FY_OK;
}

/* collect: an evaluated batch's loss, from the host copy its head made. */
static fy_status run_collect(fy_trainer *tr, int id, const fy_task *t, const fy_step_task *p) {
    const int64_t n = tr->ex.eval_counts[p->micro];
    tr->ex.eval_losses[p->micro] = n > 0 ? bufs(tr)->loss_host[p->micro % accum(tr)] : 0.0f;
    return FY_OK;
}

/* d2h_act, h2d_act: an offloaded input (the previous block's output) between its act
 * unit and its host copy (layout.h: HOST_ACTS). */
static fy_status run_d2h_act(fy_trainer *tr, int id, const fy_task *t, const fy_step_task *p) {
    const int b = t->block;
    fy_copy_async(tr->s_d2h, fy_tr_ptr(tr, b - 1, FY_STATE_HOST_ACTS), act_unit(tr, p->u.act.unit_task),
                  fy_tr_blk(tr, b - 1)->out_nbytes, FY_D2H);
    return FY_OK;
}
static fy_status run_h2d_act(fy_trainer *tr, int id, const fy_task *t, const fy_step_task *p) {
    const int b = t->block;
    fy_copy_async(tr->s_h2d, act_unit(tr, id), fy_tr_ptr(tr, b - 1, FY_STATE_HOST_ACTS),
                  fy_tr_blk(tr, b - 1)->out_nbytes, FY_H2D);
    return FY_OK;
}

#define X_RUNNER(id, name, lane, cost) [FY_T_##id] = run_##name,
const fy_runner fy_runners[FY_T_COUNT] = {FY_TASK_KINDS(X_RUNNER)};
#undef X_RUNNER
