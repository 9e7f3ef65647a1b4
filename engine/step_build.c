/* step_build.c — training steps and evaluation as task graphs, from a layout
 * (step_build.h). No device, no trainer: what a task does is its runner's
 * (engine/step_run.c); when it may run is decided here. */
#include "engine/step_build.h"

#include <stdlib.h>
#include <string.h>

#include "engine/core/util.h"

#define ML FY_PASS_LINKS

/* A pass gives back its own fetch, its links' fetches and its own gradient unit. */
_Static_assert(FY_MODEL_MAX_LINKS + 2 <= FY_SCHED_MAX_RELEASES,
               "the scheduler must hold every unit a pass gives back");

/* ---- the kinds' table -------------------------------------------------------------- */

#define X_NAME(id, name, lane, cost) #name,
static const char *const kind_names[FY_T_COUNT] = {FY_TASK_KINDS(X_NAME)};
#undef X_NAME
#define X_LANE(id, name, lane, cost) lane,
static const fy_lane kind_lanes[FY_T_COUNT] = {FY_TASK_KINDS(X_LANE)};
#undef X_LANE

const char *fy_task_kind_name(int kind) {
    return kind >= 0 && kind < FY_T_COUNT ? kind_names[kind] : "?";
}
fy_lane fy_task_kind_lane(fy_task_kind kind) { return kind_lanes[kind]; }

/* ---- the builder's state ------------------------------------------------------------ */

typedef struct builder {
    const fy_layout *L;
    fy_step_graph *sg;
    fy_graph *g;
    int ppool[FY_RINGS], gpool[FY_RINGS]; /* the rings' pools */
    int dpool;              /* the disk ring's pool */
    int apool;              /* the act ring's pool */
    int *out_unit;          /* per block, this micro-batch: the task whose act unit holds its
                               output (offloaded outputs), -1 */
    int *d2h_act;           /* per block: its input's last d2h_act */
    int prev_act_in;        /* the last h2d_act */
    int *disk_base;         /* per block: its first chunk's index in disk_write */
    int *disk_write;        /* per disk chunk: its last disk_write (-1 none yet) */
    int64_t pos;            /* next program position of a compute task */
    int epoch;              /* the step being built */
    bool barrier;           /* updates wait for the norm */
    fy_status st;
    int nb;
    int *ready;             /* per block: the task after which its weights are current for
                               the next use (-1 at the window's start) */
    int *last_bwd;          /* per block: the last task of the previous micro-batch that
                               reads its activations (its backward pass) */
    int *final_grad;        /* per block: the task completing its step's gradient */
    int *last_d2h;          /* per block: its last d2h_grad */
    fy_grad_at *grad;       /* per block, this micro-batch: where its gradient is written */
    bool *started;          /* per block, this micro-batch: its gradient has a writer */
    int shared_user;        /* the last task that used the recompute area */
    int prev_load, load_war[2], load_buf[2], prev_norm;
    int spec_after;         /* the previous step's norm: a speculative update assumes the
                               step count it left */
    int prev_fetch;         /* the last pass's fetch (pass_fetch) */
    int prev_comm;          /* the last reduce or allgather: they run in one order on every
                               rank */
} builder;

static const fy_block_layout *blk_of(const builder *bd, int b) { return &bd->L->blocks[b]; }
static bool streamed(const builder *bd, int b) { return blk_of(bd, b)->streamed; }
static bool staged(const builder *bd, int b) { return blk_of(bd, b)->grad_staged; }
static bool cpu_update(const builder *bd, int b) { return blk_of(bd, b)->update == FY_UPDATE_CPU; }
static bool rows(const builder *bd, int b) { return blk_of(bd, b)->staging == FY_STAGE_ROWS; }
static bool chunked(const builder *bd, int b) { return blk_of(bd, b)->staging == FY_STAGE_CHUNKS; }
static fy_ring_id ring(const builder *bd, int b) { return blk_of(bd, b)->ring; }
static bool dp(const builder *bd) { return bd->L->world > 1; }
static const fy_block_spec *spec(const builder *bd, int b) { return fy_model_block(bd->L->model, b); }
static double stage_bytes(const builder *bd, int b) {
    return (double)blk_of(bd, b)->stage_nelem * (double)bd->L->es;
}

/* The matmul FLOPs of a pass task of block b (model.h: fy_model_cost; the loss pass is
 * the head's forward and backward, about a third of it forward): a chunked head's task
 * on chunk k of K does its chunk's share, a forward (a third) and, the last in
 * training, its backward (two thirds); a chunk's backward task recomputes and
 * backpropagates its share. */
static double pass_flops(const builder *bd, fy_task_kind kind, int b, int chunk, bool train) {
    const fy_layout *L = bd->L;
    fy_cost c;
    const fy_pass pass = kind == FY_T_BWD && chunk < 0 ? FY_PASS_BWD
                       : kind == FY_T_FWD || kind == FY_T_RECOMPUTE ? FY_PASS_FWD : FY_PASS_LOSS;
    fy_model_cost(L->model, b, pass, L->B, L->T, (double)L->es, &c);
    if (pass != FY_PASS_LOSS) return c.flops;
    const double K = chunk >= 0 ? L->head_chunks.n : 1;
    if (kind == FY_T_BWD) return c.flops / K;
    const bool backward = train && (chunk < 0 || chunk == L->head_chunks.n - 1);
    return c.flops / (3.0 * K) + (backward ? 2.0 * c.flops / (3.0 * K) : 0.0);
}

/* A new task of kind on its lane; its payload zeroed but for the micro-batch. */
static int add(builder *bd, fy_task_kind kind, int block, int micro) {
    const fy_lane lane = fy_task_kind_lane(kind);
    fy_task t = fy_task_make(lane, kind, block, micro, NULL, NULL);
    t.epoch = bd->epoch;
    if (lane == FY_LANE_COMPUTE) t.use_pos = bd->pos++;
    const int id = fy_graph_add(bd->g, &t);
    if (id < 0) { bd->st = FY_ERR_NOMEM; return -1; }
    fy_step_graph *sg = bd->sg;
    if (id >= sg->cap) {
        const int ncap = sg->cap ? 2 * sg->cap : 1024;
        fy_step_task *n = realloc(sg->task, (size_t)ncap * sizeof *n);
        if (!n) { bd->st = FY_ERR_NOMEM; return -1; }
        sg->task = n;
        sg->cap = ncap;
    }
    fy_step_task *p = &sg->task[id];
    memset(p, 0, sizeof *p);
    p->micro = micro;
    p->chunk = -1;
    return id;
}

static fy_step_task *payload(builder *bd, int id) { return &bd->sg->task[id]; }

static void dep(builder *bd, int before, int after) {
    if (before < 0 || after < 0 || bd->st != FY_OK) return;
    fy_status s = fy_graph_dep(bd->g, before, after);
    if (s != FY_OK) bd->st = s;
}

/* At its end, `task` gives back the unit task `taker` acquired (no-op for -1). */
static void releases(builder *bd, int task, int taker) {
    if (task < 0 || taker < 0) return;
    int *r = bd->g->tasks[task].release_of;
    for (int i = 0; i < FY_SCHED_MAX_RELEASES; i++)
        if (r[i] < 0) { r[i] = taker; return; }
    FY_ASSERT(0, "a task releases more units than the scheduler holds");
}

/* ---- forward, head, backward -------------------------------------------------------- */

/* A fetch of streamed block b's weights after `ready` (with `rows`, of a fwd_rows block:
 * only the micro-batch's rows), or -1 if b is resident. */
static int fetch_of(builder *bd, int b, int micro, bool rows_only) {
    if (!streamed(bd, b)) return -1;
    int f = add(bd, FY_T_H2D_PARAM, b, micro);
    if (f < 0) return -1;
    const bool by_rows = rows(bd, b) || rows_only;
    bd->g->tasks[f].acquire_pool = bd->ppool[ring(bd, b)];
    bd->g->tasks[f].bytes = by_rows ? (double)blk_of(bd, b)->rows_nelem * (double)bd->L->es : stage_bytes(bd, b);
    payload(bd, f)->u.fetch.rows = by_rows;
    dep(bd, bd->ready[b], f);
    if (by_rows) dep(bd, bd->load_buf[micro % 2], f); /* its rows are known */
    return f;
}
static int fetch(builder *bd, int b, int micro) { return fetch_of(bd, b, micro, false); }

/* A pass's fetch (fetch_of), after the previous pass's: the copy lane takes them in the
 * order compute uses them, so a long copy for a later pass (a tied table for the head)
 * never starts ahead of a short one the next pass waits for that becomes ready a moment
 * later (its block's update still running): a copy, once started, cannot be overtaken. */
static int pass_fetch(builder *bd, int b, int micro, bool rows_only) {
    int f = fetch_of(bd, b, micro, rows_only);
    if (f < 0) return f;
    dep(bd, bd->prev_fetch, f);
    bd->prev_fetch = f;
    return f;
}

/* A pass of block b (fwd, recompute, head, bwd) with its weights and its links': fetched
 * for it when streamed (and given back at its end: `keep` holds its own for the next
 * pass, which names it as `fetched`), current after their last update. */
static int pass_with(builder *bd, fy_task_kind kind, int b, int micro, int fetched, bool keep) {
    const fy_block_spec *blk = spec(bd, b);
    /* an embedding's backward reads no weights (model.h) */
    int f = fetched >= 0 ? fetched : kind == FY_T_BWD && blk->kind == FY_BLOCK_EMBED ? -1
            : pass_fetch(bd, b, micro, kind == FY_T_FWD && blk_of(bd, b)->fwd_rows),
        lf[ML];
    for (int k = 0; k < blk->nlinks; k++) lf[k] = pass_fetch(bd, blk->links[k], micro, false);
    int id = add(bd, kind, b, micro);
    if (id < 0) return -1;
    if (kind != FY_T_HEAD) bd->g->tasks[id].flops = pass_flops(bd, kind, b, -1, true);
    payload(bd, id)->u.pass.fetch = f;
    payload(bd, id)->u.pass.in_unit = payload(bd, id)->u.pass.out_unit = -1;
    dep(bd, f, id);
    dep(bd, bd->ready[b], id);
    if (!keep) releases(bd, id, f);
    for (int k = 0; k < blk->nlinks; k++) {
        payload(bd, id)->u.pass.link_fetch[k] = lf[k];
        dep(bd, lf[k], id);
        dep(bd, bd->ready[blk->links[k]], id);
        releases(bd, id, lf[k]);
    }
    return id;
}

static int pass_task(builder *bd, fy_task_kind kind, int b, int micro) {
    return pass_with(bd, kind, b, micro, -1, false);
}

/* Where backward pass `id` writes block b's gradient: where an earlier task of this
 * micro-batch started it (a grad_zero's unit, or the accumulator), or started here (a
 * unit this task takes when b is staged, else the accumulator). */
static fy_grad_at grad_target(builder *bd, int b, int id) {
    if (bd->started[b]) return (fy_grad_at){bd->grad[b].unit_task, false};
    bd->started[b] = true;
    bd->grad[b] = (fy_grad_at){staged(bd, b) ? id : -1, true};
    if (staged(bd, b)) bd->g->tasks[id].acquire_pool = bd->gpool[ring(bd, b)];
    return bd->grad[b];
}

/* load(m): micro-batch m into token buffer m%2, after the previous load (batches come in
 * order) and after the last reader of that buffer. */
static int build_load(builder *bd, int m) {
    int load = add(bd, FY_T_LOAD, -1, m);
    if (load < 0) return -1;
    payload(bd, load)->u.load.reuse = bd->load_buf[m % 2];
    bd->g->tasks[load].bytes = (double)bd->L->tok_parts * bd->L->B * bd->L->T * sizeof(int32_t);
    dep(bd, bd->load_war[m % 2], load);
    dep(bd, bd->prev_load, load);
    bd->prev_load = bd->load_buf[m % 2] = load;
    return load;
}

/* An offloaded input of block b, in the act unit of task `unit`, to the host after
 * `after` (its forward read it), giving the unit back. */
static void act_out(builder *bd, int b, int m, int unit, int after) {
    int d = add(bd, FY_T_D2H_ACT, b, m);
    if (d < 0) return;
    payload(bd, d)->u.act.unit_task = unit;
    bd->g->tasks[d].bytes = (double)blk_of(bd, b - 1)->out_nbytes;
    dep(bd, after, d);
    releases(bd, d, unit);
    bd->d2h_act[b] = d;
}

/* Forward through every block before the head; returns the last task. An offloaded
 * output goes into an act unit its forward takes. */
static int build_forward(builder *bd, int m, int load) {
    int prev = load;
    for (int b = 0; b < bd->nb; b++) {
        if (spec(bd, b)->kind == FY_BLOCK_HEAD) continue;
        int x = pass_task(bd, FY_T_FWD, b, m);
        if (x < 0) return -1;
        dep(bd, prev, x); /* the first: after the load */
        dep(bd, bd->last_bwd[b], x); /* its activations are reused */
        if (blk_of(bd, b)->recompute) {
            dep(bd, bd->shared_user, x);
            bd->shared_user = x;
        }
        if (blk_of(bd, b)->out_offloaded) {
            bd->g->tasks[x].acquire_pool = bd->apool;
            payload(bd, x)->u.pass.out_unit = bd->out_unit[b] = x;
        }
        if (blk_of(bd, b)->offload_in) {
            payload(bd, x)->u.pass.in_unit = bd->out_unit[b - 1];
            act_out(bd, b, m, bd->out_unit[b - 1], x);
        }
        prev = x;
    }
    return prev;
}

/* Block b's offloaded input back into an act unit before its recompute, after it left
 * (and after the previous h2d_act: they run in the backward's order, as far ahead as
 * the ring's units allow). */
static int act_in(builder *bd, int b, int m) {
    int h = add(bd, FY_T_H2D_ACT, b, m);
    if (h < 0) return -1;
    payload(bd, h)->u.act.unit_task = h;
    bd->g->tasks[h].acquire_pool = bd->apool;
    bd->g->tasks[h].bytes = (double)blk_of(bd, b - 1)->out_nbytes;
    dep(bd, bd->d2h_act[b], h);
    dep(bd, bd->prev_act_in, h);
    bd->prev_act_in = bd->out_unit[b - 1] = h;
    return h;
}

/* Before the backward pass of block b (after `prev`): a grad_zero for every staged block
 * it adds into whose gradient has no writer yet (their units cannot be the pass's own,
 * which it may take for its own gradient). Returns the last grad_zero, or prev. */
static int zero_link_grads(builder *bd, int b, int m, int prev) {
    const fy_block_spec *blk = spec(bd, b);
    for (int k = 0; k < blk->nlinks; k++) {
        const int l = blk->links[k];
        if (!staged(bd, l) || bd->started[l]) continue;
        int z = add(bd, FY_T_GRAD_ZERO, l, m);
        if (z < 0) return prev;
        bd->g->tasks[z].acquire_pool = bd->gpool[ring(bd, l)];
        dep(bd, prev, z);
        bd->started[l] = true;
        bd->grad[l] = (fy_grad_at){z, false};
        prev = z;
    }
    return prev;
}

/* The gradients backward pass `id` of block b writes: its own and its links'. */
static void bind_pass_grads(builder *bd, int b, int id) {
    const fy_block_spec *blk = spec(bd, b);
    fy_step_task *p = payload(bd, id);
    p->u.pass.grad = grad_target(bd, b, id);
    for (int k = 0; k < blk->nlinks; k++) p->u.pass.link_grad[k] = grad_target(bd, blk->links[k], id);
}

/* A compute task of a chunked head on chunk k (kind head: forward; bwd: backward) after
 * `prev`, with its chunk's fetch; with `grad` it takes a gradient unit of its own. */
static int chunk_task(builder *bd, fy_task_kind kind, int h, int m, int k, int prev, bool grad) {
    int f = pass_fetch(bd, h, m, false), t = add(bd, kind, h, m);
    if (t < 0) return -1;
    if (f >= 0) payload(bd, f)->chunk = k;
    fy_step_task *p = payload(bd, t);
    p->chunk = k;
    p->u.pass.fetch = f;
    p->u.pass.in_unit = p->u.pass.out_unit = -1;
    dep(bd, f, t);
    dep(bd, bd->ready[h], t);
    dep(bd, prev, t);
    releases(bd, t, f);
    if (grad) {
        bd->g->tasks[t].acquire_pool = bd->gpool[ring(bd, h)];
        p->u.pass.grad = (fy_grad_at){t, true};
    }
    return t;
}

/* A chunked head's gradient of chunk k, in task gt's unit, to the host (in chunk order:
 * the host adds, and the last takes the norm). */
static void chunk_d2h(builder *bd, int h, int m, int k, int gt) {
    int d = add(bd, FY_T_D2H_GRAD, h, m);
    if (d < 0) return;
    payload(bd, d)->chunk = k;
    payload(bd, d)->u.d2h_grad.unit_task = gt;
    bd->g->tasks[d].bytes = stage_bytes(bd, h);
    releases(bd, d, gt);
    dep(bd, gt, d);
    dep(bd, bd->last_d2h[h], d);
    bd->last_d2h[h] = bd->final_grad[h] = d;
}

/* A split table's (layout.h: split_grad) first part to the host after the head wrote
 * it: the rows its own backward will not touch. */
static void split_d2h(builder *bd, int l, int m, int head) {
    const fy_block_layout *bl = blk_of(bd, l);
    int d = add(bd, FY_T_D2H_GRAD, l, m);
    if (d < 0) return;
    payload(bd, d)->u.d2h_grad.unit_task = bd->grad[l].unit_task;
    payload(bd, d)->u.d2h_grad.part = 1;
    /* its bytes depend on the tokens: at most the table less the rows that stay */
    bd->g->tasks[d].bytes = (double)(bl->nelem - (bl->rows_nelem < bl->nelem ? bl->rows_nelem : 0)) * bd->L->es;
    dep(bd, head, d);
    dep(bd, bd->last_d2h[l], d);
    dep(bd, bd->load_buf[m % 2], d); /* the rows it leaves */
    bd->last_d2h[l] = d;
}

/* The head's loss pass after `prev` (in training, with its backward). */
static int build_head(builder *bd, int m, int prev, bool train) {
    const int h = bd->nb - 1;
    FY_ASSERT(spec(bd, h)->kind == FY_BLOCK_HEAD, "the model's last block is its head");
    if (chunked(bd, h)) { /* one task per chunk; the last one starts backward */
        const int K = bd->L->head_chunks.n;
        int t = prev;
        for (int k = 0; k < K; k++) {
            t = chunk_task(bd, FY_T_HEAD, h, m, k, t, train && k == K - 1);
            if (t < 0) return -1;
            bd->g->tasks[t].flops = pass_flops(bd, FY_T_HEAD, h, k, train);
            payload(bd, t)->u.pass.train = train;
            if (k == 0) dep(bd, bd->last_bwd[h], t); /* the head's activations are reused */
        }
        return t;
    }
    if (train) prev = zero_link_grads(bd, h, m, prev);
    int hd = pass_task(bd, FY_T_HEAD, h, m);
    if (hd < 0) return -1;
    bd->g->tasks[hd].flops = pass_flops(bd, FY_T_HEAD, h, -1, train);
    payload(bd, hd)->u.pass.train = train;
    dep(bd, prev, hd);
    dep(bd, bd->last_bwd[h], hd);
    if (!train) return hd;
    bind_pass_grads(bd, h, hd);
    for (int k = 0; k < spec(bd, h)->nlinks; k++) /* a tied table's rows the head finished */
        if (blk_of(bd, spec(bd, h)->links[k])->split_grad) split_d2h(bd, spec(bd, h)->links[k], m, hd);
    return hd;
}

/* Block b's gradient of micro-batch m is complete after task gt (its own backward): a
 * block updated on the CPU sends it to the host (the unit is given back after the copy);
 * one updated on the device added it into its accumulator inside gt. */
static void grad_done(builder *bd, int b, int m, int gt) {
    bd->last_bwd[b] = gt;
    bd->final_grad[b] = gt;
    if (!staged(bd, b)) return;
    const int unit = bd->grad[b].unit_task;
    if (!cpu_update(bd, b)) {
        releases(bd, gt, unit);
        return;
    }
    int d = add(bd, FY_T_D2H_GRAD, b, m);
    if (d < 0) return;
    payload(bd, d)->u.d2h_grad.unit_task = unit;
    bd->g->tasks[d].bytes = stage_bytes(bd, b);
    if (blk_of(bd, b)->split_grad) { /* the second part: the micro-batch's rows */
        payload(bd, d)->u.d2h_grad.part = 2;
        bd->g->tasks[d].bytes = (double)blk_of(bd, b)->rows_nelem * (double)bd->L->es;
    }
    releases(bd, d, unit);
    dep(bd, gt, d);
    dep(bd, bd->last_d2h[b], d); /* the host adds in micro-batch order */
    bd->last_d2h[b] = d;
    if (bd->L->accum > 1) bd->final_grad[b] = d;
}

/* A chunked head's backward after its last chunk's task: that chunk's gradient to the
 * host, then each earlier chunk's backward (recomputing its logits) and gradient, down to
 * chunk 0, which gives d in. Returns the last task. */
static int build_head_backward(builder *bd, int m, int head) {
    const int h = bd->nb - 1, K = bd->L->head_chunks.n;
    chunk_d2h(bd, h, m, K - 1, head);
    int t = head;
    for (int k = K - 2; k >= 0 && t >= 0; k--) {
        t = chunk_task(bd, FY_T_BWD, h, m, k, t, true);
        if (t < 0) break;
        bd->g->tasks[t].flops = pass_flops(bd, FY_T_BWD, h, k, true);
        chunk_d2h(bd, h, m, k, t);
    }
    bd->last_bwd[h] = t;
    return t;
}

/* Backward from the block before the head down to the embedding. */
static void build_backward(builder *bd, int m, int head) {
    int prev = head;
    if (chunked(bd, bd->nb - 1)) prev = build_head_backward(bd, m, head);
    else grad_done(bd, bd->nb - 1, m, head);
    for (int b = bd->nb - 2; b >= 0; b--) {
        int rc = -1, kept = -1, in = -1;
        const bool off_in = blk_of(bd, b)->offload_in, off_out = blk_of(bd, b)->out_offloaded;
        if (off_in) in = act_in(bd, b, m);
        if (blk_of(bd, b)->recompute) { /* its weights stay for its backward: one fetch */
            rc = pass_with(bd, FY_T_RECOMPUTE, b, m, -1, true);
            if (rc < 0) return;
            kept = payload(bd, rc)->u.pass.fetch;
            dep(bd, prev, rc);
            dep(bd, bd->shared_user, rc);
            dep(bd, in, rc);
            payload(bd, rc)->u.pass.in_unit = in;
            if (off_out) { /* it writes its output again where the next block's input was */
                payload(bd, rc)->u.pass.out_unit = bd->out_unit[b];
                releases(bd, rc, bd->out_unit[b]);
            }
        }
        prev = zero_link_grads(bd, b, m, prev);
        int gt = pass_with(bd, FY_T_BWD, b, m, kept, false);
        if (gt < 0) return;
        payload(bd, gt)->u.pass.in_unit = in;
        dep(bd, in, gt);
        /* its input's unit: the previous block's recompute rewrites it, else it is done */
        if (off_in && !(blk_of(bd, b - 1)->recompute && spec(bd, b - 1)->kind == FY_BLOCK_LAYER))
            releases(bd, gt, in);
        bind_pass_grads(bd, b, gt);
        dep(bd, rc, gt);
        dep(bd, prev, gt);
        if (rc >= 0) bd->shared_user = gt;
        prev = gt;
        grad_done(bd, b, m, gt);
    }
}

/* ---- once a step: reduce, norm, updates, allgather ---------------------------------- */

/* A block's collective moves (N - 1)/N of it on each rank. */
static double coll_bytes(const builder *bd, int b) {
    const double N = bd->L->world;
    return (double)blk_of(bd, b)->nelem * (double)bd->L->es * (N - 1.0) / N;
}

/* Data parallel: each block's step gradient summed over the ranks, once it is complete,
 * in the order gradients complete (head, layers down, embedding). The reduces are
 * chained: every rank runs the same collectives in the same order whatever is ready
 * first. The norm and the updates then wait for them. */
static void build_reduce(builder *bd, int last) {
    for (int b = bd->nb - 1; b >= 0; b--) {
        int r = add(bd, FY_T_REDUCE, b, last);
        if (r < 0) return;
        bd->g->tasks[r].bytes = coll_bytes(bd, b);
        dep(bd, bd->final_grad[b], r);
        dep(bd, bd->last_d2h[b], r);
        dep(bd, bd->prev_comm, r);
        bd->prev_comm = bd->final_grad[b] = r;
        if (bd->last_d2h[b] >= 0) bd->last_d2h[b] = r;
    }
}

/* Step t's norm, after every gradient and loss of the step (`last`: its last micro-batch). */
static int build_norm(builder *bd, int last, const int *heads) {
    int nm = add(bd, FY_T_NORM, -1, last);
    for (int b = 0; b < bd->nb; b++) {
        dep(bd, bd->final_grad[b], nm);
        dep(bd, bd->last_d2h[b], nm);
    }
    for (int a = 0; a < bd->L->accum; a++) dep(bd, heads[a], nm);
    dep(bd, bd->prev_norm, nm);
    bd->prev_norm = nm;
    return nm;
}

/* A resident cpu-updated block's new weights back to the device, after `after`. */
static void build_h2d_update(builder *bd, int b, int last, int after) {
    int up = add(bd, FY_T_H2D_UPDATE, b, last);
    if (up < 0) return;
    bd->g->tasks[up].bytes = (double)blk_of(bd, b)->nelem * (double)bd->L->es;
    dep(bd, after, up);
    bd->ready[b] = up;
}

/* Data parallel: each block's updated shards from their owners, after its update, block 0
 * first (the next forward's order); chained like the reduces, after them. */
static void build_allgather(builder *bd, int last) {
    for (int b = 0; b < bd->nb; b++) {
        int g = add(bd, FY_T_ALLGATHER, b, last);
        if (g < 0) return;
        bd->g->tasks[g].bytes = coll_bytes(bd, b);
        dep(bd, bd->ready[b], g);
        dep(bd, bd->prev_comm, g);
        bd->prev_comm = bd->ready[b] = g;
        if (cpu_update(bd, b) && !streamed(bd, b)) build_h2d_update(bd, b, last, g);
    }
}

/* A device update of block b, with the fetch of its master and the copy back when it is
 * streamed. */
static void build_adam_gpu(builder *bd, int b, int last, int barrier) {
    const fy_block_layout *bl = blk_of(bd, b);
    const fy_place *master = fy_layout_state(bd->L, b, FY_STATE_MASTER);
    const double master_bytes = (double)(master->hi - master->lo) * sizeof(float);
    int f = fetch(bd, b, last);
    if (f >= 0) { /* the master of its shard (with fp32 storage, the whole weights) */
        payload(bd, f)->u.fetch.for_update = true;
        bd->g->tasks[f].bytes = master_bytes;
    }
    int ad = add(bd, FY_T_ADAM_GPU, b, last);
    if (ad < 0) return;
    payload(bd, ad)->u.update.fetch = f;
    bd->g->tasks[ad].use_pos = -1;
    dep(bd, f, ad);
    dep(bd, barrier, ad);
    dep(bd, bd->final_grad[b], ad);
    bd->ready[b] = ad;
    if (f < 0) return;
    int d = add(bd, FY_T_D2H_PARAM, b, last);
    if (d < 0) return;
    const bool writes_copy = fy_layout_owns(bd->L, b, FY_STATE_MASTER);
    payload(bd, d)->u.update.fetch = f;
    bd->g->tasks[d].bytes = (double)(bl->hi - bl->lo) * (sizeof(float) + (writes_copy ? bd->L->es : 0));
    releases(bd, d, f);
    dep(bd, ad, d);
    bd->ready[b] = d;
}

/* A speculative block's update (plan.h): its adam_cpu as soon as its gradient is on the
 * host (and the previous step's norm has counted the step), then its commit once this
 * step's norm is known; the block's next use waits for the commit. */
static int build_speculative(builder *bd, int b, int last, int nm) {
    int ad = add(bd, FY_T_ADAM_CPU, b, last);
    dep(bd, bd->last_d2h[b], ad);
    dep(bd, bd->ready[b], ad);
    dep(bd, bd->spec_after, ad);
    int c = add(bd, FY_T_COMMIT, b, last);
    dep(bd, ad, c);
    dep(bd, nm, c);
    return c;
}

/* A disk block's update (layout.h: FY_TIER_DISK), chunk by chunk: each chunk's master
 * and moments read into a disk slot (after the chunk's last write: the same bytes of the
 * file), updated there by adam_cpu (after the norm, as any update) and written back,
 * which gives the slot back. The chunks' updates are chained (the cpu lane runs one task
 * at a time anyway), so the last one says the block's weights are current. Returns it. */
static int build_disk_update(builder *bd, int b, int last, int barrier) {
    const fy_block_layout *bl = blk_of(bd, b);
    int prev = -1;
    for (int c = 0; c < bl->disk_chunks && bd->st == FY_OK; c++) {
        size_t lo, hi;
        fy_layout_disk_range(bd->L, b, c, &lo, &hi);
        const double bytes = FY_DISK_STATES * (double)(hi - lo) * sizeof(float);
        int *written = &bd->disk_write[bd->disk_base[b] + c];
        int r = add(bd, FY_T_DISK_READ, b, last), ad = add(bd, FY_T_ADAM_CPU, b, last),
            w = add(bd, FY_T_DISK_WRITE, b, last);
        if (r < 0 || ad < 0 || w < 0) return -1;
        bd->g->tasks[r].acquire_pool = bd->dpool;
        bd->g->tasks[r].bytes = bd->g->tasks[w].bytes = bytes;
        payload(bd, r)->chunk = payload(bd, ad)->chunk = payload(bd, w)->chunk = c;
        payload(bd, ad)->u.update.fetch = payload(bd, w)->u.update.fetch = r;
        dep(bd, *written, r);
        dep(bd, r, ad);
        dep(bd, barrier, ad);
        dep(bd, bd->last_d2h[b], ad);
        dep(bd, prev, ad);
        dep(bd, ad, w);
        releases(bd, w, r);
        *written = w;
        prev = ad;
    }
    return prev;
}

/* Every block's update after the norm (a speculative block's before it, committed
 * after), created in the order gradients complete (head, layers down, embedding): fifo
 * runs them so; priority reorders them by next use (block 0 first). They are not
 * program uses themselves: their priority is that of the next forward. */
static void build_update(builder *bd, int last, int nm) {
    const int barrier = bd->barrier ? nm : -1;
    for (int b = bd->nb - 1; b >= 0; b--) {
        if (!cpu_update(bd, b)) {
            build_adam_gpu(bd, b, last, barrier);
            continue;
        }
        int ad;
        if (blk_of(bd, b)->speculate) {
            ad = build_speculative(bd, b, last, nm);
        } else if (blk_of(bd, b)->disk_chunks) {
            ad = build_disk_update(bd, b, last, barrier);
        } else {
            ad = add(bd, FY_T_ADAM_CPU, b, last);
            dep(bd, barrier, ad);
            dep(bd, bd->last_d2h[b], ad);
        }
        bd->ready[b] = ad;
        /* a job's h2d_update follows the allgather */
        if (!streamed(bd, b) && !dp(bd)) build_h2d_update(bd, b, last, ad);
    }
}

/* ---- the graphs --------------------------------------------------------------------- */

static void builder_end(builder *bd) {
    free(bd->ready);
    free(bd->last_bwd);
    free(bd->final_grad);
    free(bd->last_d2h);
    free(bd->grad);
    free(bd->started);
    free(bd->disk_base);
    free(bd->disk_write);
    free(bd->out_unit);
    free(bd->d2h_act);
}

/* The builder's end: its status, then the priorities; the graph is freed on failure. */
static fy_status finish(builder *bd, fy_status st) {
    builder_end(bd);
    if (st == FY_OK) st = bd->st;
    if (st == FY_OK) st = fy_graph_prioritize(bd->g);
    if (st != FY_OK) fy_step_graph_free(bd->sg);
    return st;
}

/* A builder over an empty graph sg (freed, as everything else, if it fails). */
static fy_status builder_init(builder *bd, const fy_layout *L, fy_step_graph *sg, bool barrier) {
    memset(bd, 0, sizeof *bd);
    memset(sg, 0, sizeof *sg);
    bd->L = L;
    bd->sg = sg;
    bd->g = &sg->g;
    bd->barrier = barrier;
    bd->nb = L->nblocks;
    fy_graph_init(bd->g);
    bd->g->kind_name = fy_task_kind_name;
    for (int r = 0; r < FY_RINGS; r++) {
        bd->ppool[r] = fy_graph_pool(bd->g, L->param_ring[r].n);
        bd->gpool[r] = fy_graph_pool(bd->g, L->grad_ring[r].n);
    }
    bd->dpool = fy_graph_pool(bd->g, L->disk_ring.n);
    bd->apool = fy_graph_pool(bd->g, L->act_ring.n);
    const size_t n = (size_t)bd->nb;
    size_t nchunks = 0;
    bd->disk_base = malloc(n * sizeof *bd->disk_base);
    for (size_t b = 0; bd->disk_base && b < n; b++) {
        bd->disk_base[b] = (int)nchunks;
        nchunks += (size_t)L->blocks[b].disk_chunks;
    }
    bd->disk_write = malloc((nchunks ? nchunks : 1) * sizeof *bd->disk_write);
    for (size_t c = 0; bd->disk_write && c < nchunks; c++) bd->disk_write[c] = -1;
    bd->out_unit = malloc(n * sizeof *bd->out_unit);
    bd->d2h_act = malloc(n * sizeof *bd->d2h_act);
    bd->ready = malloc(n * sizeof *bd->ready);
    bd->last_bwd = malloc(n * sizeof *bd->last_bwd);
    bd->final_grad = malloc(n * sizeof *bd->final_grad);
    bd->last_d2h = malloc(n * sizeof *bd->last_d2h);
    bd->grad = malloc(n * sizeof *bd->grad);
    bd->started = malloc(n * sizeof *bd->started);
    if (!bd->ready || !bd->last_bwd || !bd->final_grad || !bd->last_d2h || !bd->grad || !bd->started ||
        !bd->disk_base || !bd->disk_write || !bd->out_unit || !bd->d2h_act)
        return finish(bd, FY_ERR_NOMEM);
    for (size_t b = 0; b < n; b++)
        bd->ready[b] = bd->last_bwd[b] = bd->last_d2h[b] = bd->out_unit[b] = bd->d2h_act[b] = -1;
    bd->shared_user = bd->prev_load = bd->prev_norm = bd->prev_comm = bd->spec_after = -1;
    bd->prev_fetch = bd->prev_act_in = -1;
    bd->load_war[0] = bd->load_war[1] = bd->load_buf[0] = bd->load_buf[1] = -1;
    return FY_OK;
}

fy_status fy_step_build_train(const fy_layout *L, int nsteps, bool norm_barrier, fy_step_graph *out) {
    builder bd;
    FY_TRY(builder_init(&bd, L, out, norm_barrier));
    const int A = L->accum;
    int heads[FY_PLAN_MAX_ACCUM];
    for (int t = 0; t < nsteps && bd.st == FY_OK; t++) {
        bd.epoch = t;
        for (int a = 0; a < A; a++) {
            const int m = t * A + a;
            memset(bd.started, 0, (size_t)bd.nb * sizeof *bd.started);
            int load = build_load(&bd, m);
            int prev = build_forward(&bd, m, load);
            heads[a] = build_head(&bd, m, prev, true);
            build_backward(&bd, m, heads[a]);
            /* the embedding's backward reads tokens last; a row-staged one's rows are
             * read by its gradient's copy */
            bd.load_war[m % 2] = rows(&bd, 0) || blk_of(&bd, 0)->split_grad ? bd.last_d2h[0] : bd.last_bwd[0];
        }
        const int last = t * A + A - 1; /* per-step tasks carry the step's last micro-batch */
        if (dp(&bd)) build_reduce(&bd, last);
        const int nm = build_norm(&bd, last, heads);
        build_update(&bd, last, nm);
        bd.spec_after = nm;
        if (dp(&bd)) build_allgather(&bd, last);
    }
    return finish(&bd, FY_OK);
}

fy_status fy_step_build_eval(const fy_layout *L, int nbatches, fy_step_graph *out) {
    builder bd;
    FY_TRY(builder_init(&bd, L, out, true));
    const int nslots = L->accum;
    int *collect = malloc((size_t)(nbatches > 0 ? nbatches : 1) * sizeof *collect);
    if (!collect) return finish(&bd, FY_ERR_NOMEM);
    for (int m = 0; m < nbatches && bd.st == FY_OK; m++) {
        bd.epoch = m;
        int load = build_load(&bd, m);
        int hd = build_head(&bd, m, build_forward(&bd, m, load), false);
        if (m >= nslots) dep(&bd, collect[m - nslots], hd); /* its loss slot is read */
        collect[m] = add(&bd, FY_T_COLLECT, -1, m);
        dep(&bd, hd, collect[m]);
        for (int b = 0; b < bd.nb; b++) bd.last_bwd[b] = hd; /* activations are reused */
        bd.load_war[m % 2] = hd;
    }
    free(collect);
    return finish(&bd, FY_OK);
}

void fy_step_graph_free(fy_step_graph *sg) {
    fy_graph_free(&sg->g);
    free(sg->task);
    sg->task = NULL;
    sg->cap = 0;
}

/* ---- costs -------------------------------------------------------------------------- */

static double *cost_slot(const fy_cost_table *c, int kind, int block) {
    const int col = block >= 0 && block < c->nblocks ? block : c->nblocks;
    return c->sum_count + 2 * ((size_t)kind * (size_t)(c->nblocks + 1) + (size_t)col);
}

fy_status fy_cost_table_init(fy_cost_table *c, int nblocks) {
    c->nblocks = nblocks;
    c->sum_count = calloc((size_t)FY_T_COUNT * (size_t)(nblocks + 1) * 2, sizeof *c->sum_count);
    return c->sum_count ? FY_OK : FY_ERR_NOMEM;
}

void fy_cost_table_free(fy_cost_table *c) {
    free(c->sum_count);
    c->sum_count = NULL;
}

void fy_cost_reset(fy_cost_table *c) {
    memset(c->sum_count, 0, (size_t)FY_T_COUNT * (size_t)(c->nblocks + 1) * 2 * sizeof *c->sum_count);
}

void fy_cost_add(fy_cost_table *c, fy_task_kind kind, int block, double ms) {
    double *s = cost_slot(c, kind, block);
    s[0] += ms;
    s[1] += 1;
}

void fy_cost_set(fy_cost_table *c, fy_task_kind kind, int block, double ms) {
    double *s = cost_slot(c, kind, block);
    s[0] = ms;
    s[1] = 1;
}

double fy_cost_mean(const fy_cost_table *c, fy_task_kind kind, int block) {
    const double *s = cost_slot(c, kind, block);
    return s[1] > 0 ? s[0] / s[1] : -1.0;
}

void fy_step_graph_price(fy_step_graph *sg, const fy_layout *L, const fy_cost_table *c) {
    for (int i = 0; i < sg->g.n; i++) {
        fy_task *t = &sg->g.tasks[i];
        const double *s = cost_slot(c, t->kind, t->block);
        if (s[1] > 0) t->cost_ms = s[0] / s[1]; /* else the scheduler's default */
        t->cost_ms *= fy_step_copy_scale(sg, L, i);
    }
}

double fy_step_copy_scale(const fy_step_graph *sg, const fy_layout *L, int i) {
    const fy_task *t = &sg->g.tasks[i];
    const fy_block_layout *bl = t->block >= 0 ? &L->blocks[t->block] : NULL;
    const int chunk = sg->task[i].chunk;
    if ((t->kind == FY_T_DISK_READ || t->kind == FY_T_DISK_WRITE || t->kind == FY_T_ADAM_CPU) &&
        bl && bl->disk_chunks && chunk >= 0) { /* a disk chunk's share of its shard */
        size_t lo, hi;
        fy_layout_disk_range(L, t->block, chunk, &lo, &hi);
        return (double)(hi - lo) / (double)(bl->hi - bl->lo);
    }
    if (t->kind != FY_T_H2D_PARAM && t->kind != FY_T_D2H_GRAD) return 1.0;
    return t->bytes / ((double)bl->stage_nelem * (double)L->es);
}

void fy_step_graph_busy(const fy_step_graph *sg, double busy_ms[FY_LANE_COUNT]) {
    for (int l = 0; l < FY_LANE_COUNT; l++) busy_ms[l] = 0.0;
    for (int i = 0; i < sg->g.n; i++) busy_ms[sg->g.tasks[i].lane] += sg->g.tasks[i].cost_ms;
}
