/* step_exec.c — the executor: a trainer's windows of the step graph, run on its lanes.
 *
 * The builder (step_build.c) makes the graph from the trainer's layout; the executor
 * binds each task to its lane's stream and its runner (step_run.c), owns the window's
 * state (fy_exec: the batch source, learning rates, stats, events), and turns what ran
 * into step stats, measured costs and, after a failure, the trainer's counters.
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
 * Exactness: the arithmetic is that of the serial order, task by task, so every schedule
 * mode gives bit-identical results.
 *
 * Failure: each step is an epoch of the scheduler: a failing task cancels its step and
 * later ones, earlier steps finish; the trainer rolls its counters back to the last
 * finished step, and is broken only if the failing step had started updating. */
#include <stdlib.h>
#include <string.h>

#include "engine/core/util.h"
#include "engine/trainer_core.h"

/* ---- binding tasks to lanes ------------------------------------------------------------ */

static fy_stream *lane_stream(const fy_trainer *tr, fy_lane lane) {
    switch (lane) {
    case FY_LANE_COMPUTE: return tr->s;
    case FY_LANE_H2D: return tr->s_h2d;
    case FY_LANE_D2H: return tr->s_d2h;
    case FY_LANE_COMM: return tr->s_comm;
    default: return NULL; /* the cpu lane works on the host */
    }
}

/* Makes task t's work wait for the work of task `before`: on the device when t has a
 * stream (nothing when it is before's own stream: stream order), on the host when t is
 * host work. Host work (the cpu lane) is complete when its task ends. */
static void wait_for(const fy_trainer *tr, fy_stream *s, int before) {
    const fy_task *b = &tr->ex.sg->g.tasks[before];
    fy_stream *bs = lane_stream(tr, b->lane);
    if (!bs || bs == s) return;
    if (s) fy_stream_wait_event(s, tr->ex.ev_end[before]);
    else fy_event_sync(tr->ex.ev_end[before]);
}

void fy_exec_host_after(const fy_trainer *tr, int id) {
    const fy_task *t = &tr->ex.sg->g.tasks[id];
    fy_stream *s = lane_stream(tr, t->lane);
    for (int k = 0; k < t->npred; k++) /* its own stream's work writes no host memory */
        if (lane_stream(tr, tr->ex.sg->g.tasks[t->pred[k]].lane) != s) wait_for(tr, NULL, t->pred[k]);
}

/* Whether the test hook (trainer.h) claims task t. */
static bool injected(fy_trainer *tr, const fy_task *t, const fy_step_task *p) {
    return tr->inject.kind == t->kind && (tr->inject.block < 0 || tr->inject.block == t->block) &&
           tr->inject.micro == fy_exec_abs_micro(tr, p) && atomic_exchange(&tr->inject.armed, false);
}

/* Every task: the injected failure, waits for its inputs, the runner between its events. */
static fy_status run_task(void *ctx, const fy_task *t) {
    fy_trainer *tr = ctx;
    fy_exec *ex = &tr->ex;
    const int id = (int)(t - ex->sg->g.tasks);
    const fy_step_task *p = &ex->sg->task[id];
    fy_stream *s = lane_stream(tr, t->lane);
    if (injected(tr, t, p)) {
        fy_log_error("injected failure");
        /* its end event still marks its place in the stream: a later taker of a unit it
         * freed waits on it */
        if (s) fy_event_record(ex->ev_end[id], s);
        return tr->inject.st;
    }
    for (int k = 0; k < t->npred; k++) wait_for(tr, s, t->pred[k]);
    if (t->unit_after >= 0) wait_for(tr, s, t->unit_after);
    if (s) fy_event_record(ex->ev_start[id], s);
    else ex->host_start[id] = fy_now_ms(); /* its work starts after the waits */
    fy_status st = fy_runners[t->kind](tr, id, t, p);
    if (!s) return st;
    fy_event_record(ex->ev_end[id], s);
    if (tr->cfg.schedule == FY_SCHED_SERIAL) fy_event_sync(ex->ev_end[id]);
    ex->ahead[t->lane][ex->nahead[t->lane]++] = id;
    return st;
}

/* Before a device lane picks its next task: at most FY_RUN_AHEAD - 1 of its tasks may
 * still be queued, so the next one can still be chosen by what is ready then. */
static void lane_wait(void *ctx, fy_lane lane) {
    fy_exec *ex = &((fy_trainer *)ctx)->ex;
    int *q = ex->ahead[lane], *n = &ex->nahead[lane];
    while (*n > FY_RUN_AHEAD - 1) {
        fy_event_sync(ex->ev_end[q[0]]);
        memmove(q, q + 1, (size_t)--*n * sizeof *q);
    }
}

static void sync_all(void *ctx) {
    fy_trainer *tr = ctx;
    fy_stream_sync(tr->s);
    fy_stream_sync(tr->s_h2d);
    fy_stream_sync(tr->s_d2h);
    if (tr->s_comm) fy_stream_sync(tr->s_comm);
}

/* ---- running a graph -------------------------------------------------------------------- */

/* Events around every task of a graph of n tasks, and the host tasks' start times (grown
 * once, reused by later windows). */
static fy_status events_for(fy_trainer *tr, int n) {
    fy_exec *ex = &tr->ex;
    if (!ex->ev_anchor) FY_TRY(fy_event_new_timed(tr->dev, &ex->ev_anchor));
    if (n > ex->nhost_start) {
        double *h = realloc(ex->host_start, (size_t)n * sizeof *h);
        if (!h) return FY_ERR_NOMEM;
        ex->host_start = h;
        ex->nhost_start = n;
    }
    if (n <= ex->nev) return FY_OK;
    fy_event **s = realloc(ex->ev_start, (size_t)n * sizeof *s);
    if (!s) return FY_ERR_NOMEM;
    ex->ev_start = s;
    fy_event **e = realloc(ex->ev_end, (size_t)n * sizeof *e);
    if (!e) return FY_ERR_NOMEM;
    ex->ev_end = e;
    for (; ex->nev < n; ex->nev++) {
        fy_event *a, *b;
        FY_TRY(fy_event_new_timed(tr->dev, &a));
        fy_status st = fy_event_new_timed(tr->dev, &b);
        if (st != FY_OK) {
            fy_event_free(a);
            return st;
        }
        ex->ev_start[ex->nev] = a;
        ex->ev_end[ex->nev] = b;
    }
    return FY_OK;
}

fy_status fy_exec_init(fy_trainer *tr) {
    tr->ex.spec_wrote = calloc((size_t)fy_tr_nblocks(tr), sizeof *tr->ex.spec_wrote);
    if (!tr->ex.spec_wrote) return FY_ERR_NOMEM;
    const int rb = tr->L->rows_block;
    if (rb < 0) return FY_OK;
    const int nrows = fy_model_block(tr->model, rb)->tensors[0].alloc_rows;
    for (int r = 0; r < nrows; r++) tr->st->win.row_map[r] = -1; /* no row gathered */
    return FY_OK;
}

void fy_exec_free(fy_exec *ex) {
    for (int i = 0; i < ex->nev; i++) {
        fy_event_free(ex->ev_start[i]);
        fy_event_free(ex->ev_end[i]);
    }
    fy_event_free(ex->ev_anchor);
    free(ex->ev_start);
    free(ex->ev_end);
    free(ex->host_start);
    free(ex->spec_wrote);
    memset(ex, 0, sizeof *ex);
}

static int by_start(const void *a, const void *b) {
    const fy_trace_rec *x = a, *y = b;
    return (x->start_ms > y->start_ms) - (x->start_ms < y->start_ms);
}

/* The records of device tasks get the device's times (from their events, placed on the
 * host clock through the anchor recorded when the window began); busy times and the
 * makespan follow. */
static void device_times(fy_trainer *tr, const fy_graph *g, fy_sched_result *r, double anchor_ms) {
    /* (a failed task may have stopped before its events: it keeps the host's times; a
     * host task's starts after its waits) */
    const fy_exec *ex = &tr->ex;
    const double off = anchor_ms - r->t0_ms;
    memset(r->busy_ms, 0, sizeof r->busy_ms);
    r->makespan_ms = 0.0;
    for (int i = 0; i < r->nrecs; i++) {
        fy_trace_rec *rec = &r->recs[i];
        const fy_task *t = &g->tasks[rec->task];
        if (rec->task == r->failed_task) {
            /* keeps the host's times */
        } else if (lane_stream(tr, t->lane)) {
            rec->start_ms = off + fy_event_elapsed_ms(ex->ev_anchor, ex->ev_start[rec->task]);
            rec->end_ms = off + fy_event_elapsed_ms(ex->ev_anchor, ex->ev_end[rec->task]);
        } else {
            rec->start_ms = ex->host_start[rec->task] - r->t0_ms;
        }
        r->busy_ms[t->lane] += rec->end_ms - rec->start_ms;
        if (rec->end_ms > r->makespan_ms) r->makespan_ms = rec->end_ms;
    }
    qsort(r->recs, (size_t)r->nrecs, sizeof *r->recs, by_start);
}

fy_status fy_exec_run(fy_trainer *tr, fy_step_graph *sg, fy_sched_result *res) {
    fy_exec *ex = &tr->ex;
    fy_graph *g = &sg->g;
    fy_status st = events_for(tr, g->n);
    if (st != FY_OK) { memset(res, 0, sizeof *res); return st; }
    for (int i = 0; i < g->n; i++) {
        g->tasks[i].run = run_task;
        g->tasks[i].ctx = tr;
    }
    g->drain = sync_all;
    g->lane_wait = lane_wait;
    g->hook_ctx = tr;
    ex->sg = sg;
    memset(ex->nahead, 0, sizeof ex->nahead); /* the last window ended with everything done */
    ex->rows_fetch_last = -1;
    fy_event_record(ex->ev_anchor, tr->s);
    fy_event_sync(ex->ev_anchor);
    const double anchor_ms = fy_now_ms();
    st = fy_sched_execute(g, tr->cfg.schedule, res);
    sync_all(tr); /* the end of the window: everything queued is done */
    device_times(tr, g, res, anchor_ms);
    ex->sg = NULL;
    return st;
}

/* ---- windows ------------------------------------------------------------------------------- */

/* Step times from the records: a step ends with its last task. */
static void step_times(const fy_graph *g, const fy_sched_result *r, int nsteps, fy_step_stats *stats) {
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
        stats[s].done_ms = r->t0_ms + end[s];
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
        if (t->epoch == failed && r->recs[i].task != r->failed_task && fy_run_applies(tr, t))
            partial = true;
    }
    partial &= !tr->ex.stats[failed].skipped;
    /* gradients copied into host weights before the failure are not weights: each rank of
     * a job restores its shards, and the ranks (all stopped at the same step's norm:
     * together) gather the others' */
    for (int b = 0; b < fy_tr_nblocks(tr); b++) {
        fy_run_restore_weights(tr, b);
        if (tr->world <= 1 || !fy_layout_grad_in_weights(tr->L, b)) continue;
        if (!together || fy_run_gather_weights(tr, b) != FY_OK) tr->broken = true;
    }
    tr->steps_done = failed == 0 ? steps_before : tr->ex.adam_step[failed - 1];
    tr->micro_base += (int64_t)failed * tr->L->accum;
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

/* What a window's run leaves: measured costs, step times, and after a failure the
 * counters (the number of steps completed). */
static int window_end(fy_trainer *tr, fy_window *w, const fy_step_graph *sg, const fy_sched_result *res,
                      fy_status st, int64_t steps_before) {
    if (res->recs) {
        step_times(&sg->g, res, w->nsteps, w->stats);
        for (int i = 0; i < res->nrecs; i++) {
            const int id = res->recs[i].task;
            const fy_task *t = &sg->g.tasks[id];
            const double ms = res->recs[i].end_ms - res->recs[i].start_ms;
            fy_cost_add(&tr->costs, (fy_task_kind)t->kind, t->block, ms / fy_step_copy_scale(sg, tr->L, id));
        }
    }
    if (st == FY_OK) {
        tr->micro_base += (int64_t)w->nsteps * tr->L->accum;
        return w->nsteps;
    }
    if (res->recs && res->failed_task >= 0) {
        const int done = settle_failure(tr, &sg->g, res, steps_before, st == FY_INTERRUPTED);
        /* in a job, the other ranks may be inside the failed step's collectives: a retry
         * would meet them out of order */
        if (tr->world > 1 && st != FY_INTERRUPTED) tr->broken = true;
        return done;
    }
    /* the scheduler could not finish the graph after some tasks ran (a bug, logged): what
     * they applied is unknown */
    if (res->nrecs > 0) tr->broken = true;
    return 0;
}

/* The test hook (trainer.h: test_speculate_first): each step's norm after its
 * speculative blocks' adam_cpu tasks. */
static fy_status speculate_first(const fy_trainer *tr, fy_step_graph *sg) {
    fy_graph *g = &sg->g;
    for (int n = 0; n < g->n; n++) {
        if (g->tasks[n].kind != FY_T_NORM) continue;
        for (int i = 0; i < g->n; i++)
            if (g->tasks[i].kind == FY_T_ADAM_CPU && g->tasks[i].epoch == g->tasks[n].epoch &&
                fy_tr_blk(tr, g->tasks[i].block)->speculate)
                FY_TRY(fy_graph_dep(g, i, n));
    }
    return fy_graph_prioritize(g);
}

/* A training graph of nsteps under the trainer's layout, priced by its measured costs. */
static fy_status priced_train(fy_trainer *tr, int nsteps, bool norm_barrier, fy_step_graph *sg) {
    FY_TRY(fy_step_build_train(tr->L, nsteps, norm_barrier, sg));
    if (tr->cfg.test_speculate_first) {
        fy_status st = speculate_first(tr, sg);
        if (st != FY_OK) {
            fy_step_graph_free(sg);
            return st;
        }
    }
    fy_step_graph_price(sg, tr->L, &tr->costs);
    return FY_OK;
}

/* The targets each step of the window counts, over all its micro-batches (every rank's:
 * the step's global numbers, fy_exec_abs_micro's). */
static void count_targets(const fy_trainer *tr, const fy_window *w, int64_t *out) {
    const int64_t first = tr->micro_base / tr->L->accum;
    for (int i = 0; i < w->nsteps; i++) {
        if (!w->targets) {
            out[i] = (int64_t)tr->L->B * tr->L->T * tr->micro_total;
            continue;
        }
        out[i] = 0;
        for (int64_t j = 0; j < tr->micro_total; j++)
            out[i] += w->targets(w->batch_ctx, (first + i) * tr->micro_total + j);
    }
}

fy_status fy_trainer_run(fy_trainer *tr, fy_window *w) {
    w->completed = 0;
    if (w->nsteps <= 0) return FY_OK;
    FY_ASSERT(!tr->cfg.eval_only, "an evaluation-only trainer cannot train");
    FY_TRY(usable(tr));
    fy_step_graph sg;
    FY_TRY(priced_train(tr, w->nsteps, true, &sg));
    fy_exec *ex = &tr->ex;
    ex->adam_step = calloc((size_t)w->nsteps, sizeof *ex->adam_step);
    ex->step_targets = calloc((size_t)w->nsteps, sizeof *ex->step_targets);
    if (!ex->adam_step || !ex->step_targets) {
        free(ex->adam_step);
        free(ex->step_targets);
        ex->adam_step = ex->step_targets = NULL;
        fy_step_graph_free(&sg);
        return FY_ERR_NOMEM;
    }
    count_targets(tr, w, ex->step_targets);
    ex->lrs = w->lrs;
    ex->stats = w->stats;
    ex->next_batch = w->next_batch;
    ex->batch_ctx = w->batch_ctx;
    ex->eval = false;
    ex->normed = -1;
    ex->spec_ss = 0.0;
    memset(w->stats, 0, (size_t)w->nsteps * sizeof *w->stats);
    const int64_t steps_before = tr->steps_done;
    fy_sched_result res = {0};
    fy_status st = fy_exec_run(tr, &sg, &res);
    w->completed = window_end(tr, w, &sg, &res, st, steps_before);
    free(ex->adam_step);
    free(ex->step_targets);
    ex->adam_step = ex->step_targets = NULL;
    if (w->trace && w->graph && st == FY_OK) {
        *w->trace = res;
        *w->graph = sg.g;
        free(sg.task);
    } else {
        fy_sched_result_free(&res);
        fy_step_graph_free(&sg);
    }
    return st;
}

fy_status fy_trainer_predict(fy_trainer *tr, int nsteps, fy_sched_mode mode, bool norm_barrier,
                             fy_sched_result *out) {
    memset(out, 0, sizeof *out);
    fy_step_graph sg;
    FY_TRY(priced_train(tr, nsteps, norm_barrier, &sg));
    fy_status st = fy_sched_simulate(&sg.g, mode, out);
    fy_step_graph_free(&sg);
    return st;
}

/* Evaluation graphs hold at most this many batches (a pass over a large validation set
 * runs as several). */
#define EVAL_WINDOW 32

fy_status fy_trainer_eval_run(fy_trainer *tr, int nbatches, fy_batch_fn next_batch, void *ctx,
                              float *losses, int64_t *counts) {
    FY_TRY(usable(tr));
    int64_t *own = NULL;
    if (!counts && !(counts = own = calloc((size_t)(nbatches > 0 ? nbatches : 1), sizeof *counts))) {
        fy_log_error("out of host memory");
        return FY_ERR_NOMEM;
    }
    fy_exec *ex = &tr->ex;
    ex->next_batch = next_batch;
    ex->batch_ctx = ctx;
    ex->eval = true;
    fy_status st = FY_OK;
    for (int b0 = 0; b0 < nbatches && st == FY_OK; b0 += EVAL_WINDOW) {
        const int n = nbatches - b0 < EVAL_WINDOW ? nbatches - b0 : EVAL_WINDOW;
        ex->eval_base = b0;
        ex->eval_losses = losses + b0;
        ex->eval_counts = counts + b0;
        fy_step_graph sg;
        fy_sched_result res = {0};
        st = fy_step_build_eval(tr->L, n, &sg);
        if (st != FY_OK) break;
        st = fy_exec_run(tr, &sg, &res);
        fy_sched_result_free(&res);
        fy_step_graph_free(&sg);
    }
    ex->eval = false;
    ex->eval_losses = NULL;
    ex->eval_counts = NULL;
    free(own);
    return st;
}

typedef struct arrays { const int32_t *x, *y; size_t N; int64_t base; } arrays;

static fy_status from_arrays(void *ctx, int64_t micro, int32_t *x, int32_t *y, int32_t *docs) {
    FY_ASSERT(!docs, "a trainer whose documents come from its data runs windows");
    const arrays *a = ctx;
    size_t off = (size_t)(micro - a->base) * a->N;
    memcpy(x, a->x + off, a->N * sizeof(int32_t));
    memcpy(y, a->y + off, a->N * sizeof(int32_t));
    return FY_OK;
}

static int64_t arrays_targets(void *ctx, int64_t micro) {
    const arrays *a = ctx;
    const int32_t *y = a->y + (size_t)(micro - a->base) * a->N;
    int64_t n = 0;
    for (size_t i = 0; i < a->N; i++) n += y[i] >= 0;
    return n;
}

fy_status fy_trainer_step(fy_trainer *tr, const int32_t *x, const int32_t *y, float lr,
                          fy_step_stats *out) {
    if (tr->world > 1) { /* its arrays hold this process's micro-batches, numbered locally */
        fy_log_error("fy_trainer_step: a data-parallel trainer runs windows (fy_trainer_run)");
        return FY_ERR_UNSUPPORTED;
    }
    arrays a = {x, y, (size_t)tr->L->B * tr->L->T, tr->micro_base};
    fy_window w = {.nsteps = 1, .lrs = &lr, .next_batch = from_arrays,
                   .targets = arrays_targets, .batch_ctx = &a, .stats = out};
    fy_status st = fy_trainer_run(tr, &w);
    if (st == FY_OK && out->skipped)
        fy_log_warn("step %lld: gradient norm is %g; update skipped",
                    (long long)tr->steps_done + 1, out->grad_norm);
    return st;
}

fy_status fy_trainer_eval(fy_trainer *tr, const int32_t *x, const int32_t *y, float *loss) {
    arrays a = {x, y, (size_t)tr->L->B * tr->L->T, 0};
    return fy_trainer_eval_run(tr, 1, from_arrays, &a, loss, NULL);
}

void fy_trainer_inject_failure(fy_trainer *tr, fy_task_kind kind, int block, int64_t micro,
                               fy_status st) {
    tr->inject.kind = kind;
    tr->inject.block = block;
    tr->inject.micro = micro;
    tr->inject.st = st;
    atomic_store(&tr->inject.armed, true);
}

double fy_trainer_cost(const fy_trainer *tr, fy_task_kind kind, int block) {
    return fy_cost_mean(&tr->costs, kind, block);
}

void fy_trainer_reset_costs(fy_trainer *tr) { fy_cost_reset(&tr->costs); }
