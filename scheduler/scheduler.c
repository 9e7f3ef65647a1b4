/* scheduler.c — graph building, next-use priorities, and the dispatch rules shared by the
 * executor (threads, real time) and the simulator (virtual time).
 *
 * The dispatch state (ready lists, pending counts, pool grants) is one struct driven by
 * three operations: pick(lane), start(task), finish(task). The executor calls them under
 * a mutex from its lane threads; the simulator calls them from an event loop. Same rules,
 * so on exact costs both produce the same order. */
#include "scheduler/scheduler.h"

#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/core/util.h"

static const char *lane_names[FY_LANE_COUNT] = {"compute", "h2d", "d2h", "cpu", "comm", "disk"};
const char *fy_lane_name(fy_lane l) { return l < FY_LANE_COUNT ? lane_names[l] : "?"; }

static const char *mode_names[] = {"priority", "fifo", "serial"};
const char *fy_sched_mode_name(fy_sched_mode m) { return (unsigned)m < 3 ? mode_names[m] : "?"; }
int fy_sched_mode_parse(const char *s, fy_sched_mode *out) {
    for (int i = 0; i < 3; i++)
        if (!strcmp(s, mode_names[i])) { *out = (fy_sched_mode)i; return 0; }
    return -1;
}

/* ---- graph ------------------------------------------------------------------------- */

void fy_graph_init(fy_graph *g) { memset(g, 0, sizeof *g); }

fy_task fy_task_make(fy_lane lane, int kind, int block, int iter, fy_task_fn run, void *ctx) {
    return (fy_task){.lane = lane, .kind = kind, .block = block, .iter = iter, .epoch = 0,
                     .use_pos = -1, .cost_ms = 1.0, .acquire_pool = -1,
                     .release_of = {-1, -1, -1, -1}, .unit_after = -1, .run = run, .ctx = ctx};
}

void fy_task_name(const fy_graph *g, const fy_task *t, char *buf, size_t cap) {
    snprintf(buf, cap, "%s(%d) it %d", g->kind_name ? g->kind_name(t->kind) : "task", t->block,
             t->iter);
}

void fy_graph_free(fy_graph *g) {
    for (int i = 0; i < g->n; i++) {
        free(g->tasks[i].succ);
        free(g->tasks[i].pred);
    }
    free(g->tasks);
    memset(g, 0, sizeof *g);
}

int fy_graph_add(fy_graph *g, const fy_task *t) {
    if (g->n == g->cap) {
        int ncap = g->cap ? 2 * g->cap : 256;
        fy_task *nt = realloc(g->tasks, (size_t)ncap * sizeof *nt);
        if (!nt) { fy_log_error("out of host memory for the task graph"); return -1; }
        g->tasks = nt;
        g->cap = ncap;
    }
    fy_task *d = &g->tasks[g->n];
    *d = *t;
    d->succ = d->pred = NULL;
    d->nsucc = d->capsucc = d->npred = d->cappred = 0;
    d->prio = 0;
    d->unit = d->unit_after = -1;
    return g->n++;
}

/* Appends x to the list (*list, *n, *cap). */
static fy_status push_id(int **list, int *n, int *cap, int x) {
    if (*n == *cap) {
        int ncap = *cap ? 2 * *cap : 4;
        int *nl = realloc(*list, (size_t)ncap * sizeof *nl);
        if (!nl) {
            fy_log_error("out of host memory for the task graph");
            return FY_ERR_NOMEM;
        }
        *list = nl;
        *cap = ncap;
    }
    (*list)[(*n)++] = x;
    return FY_OK;
}

fy_status fy_graph_dep(fy_graph *g, int before, int after) {
    FY_ASSERT(before >= 0 && before < g->n && after >= 0 && after < g->n && before != after,
              "bad dependency");
    fy_task *b = &g->tasks[before], *a = &g->tasks[after];
    for (int i = 0; i < b->nsucc; i++)
        if (b->succ[i] == after) return FY_OK;
    FY_TRY(push_id(&b->succ, &b->nsucc, &b->capsucc, after));
    return push_id(&a->pred, &a->npred, &a->cappred, before);
}

int fy_graph_pool(fy_graph *g, int units) {
    FY_ASSERT(g->npools < FY_SCHED_MAX_POOLS, "too many pools");
    g->pool_units[g->npools] = units;
    return g->npools++;
}

/* Kahn's order; returns NULL (logged) on a cycle. */
static int *topo_order(const fy_graph *g) {
    int *order = malloc((size_t)(g->n ? g->n : 1) * sizeof *order);
    int *pend = malloc((size_t)(g->n ? g->n : 1) * sizeof *pend);
    if (!order || !pend) { free(order); free(pend); return NULL; }
    int head = 0, tail = 0;
    for (int i = 0; i < g->n; i++) {
        pend[i] = g->tasks[i].npred;
        if (!pend[i]) order[tail++] = i;
    }
    while (head < tail) {
        const fy_task *t = &g->tasks[order[head++]];
        for (int k = 0; k < t->nsucc; k++)
            if (--pend[t->succ[k]] == 0) order[tail++] = t->succ[k];
    }
    free(pend);
    if (tail != g->n) {
        fy_log_error("task graph has a cycle (%d of %d tasks reachable)", tail, g->n);
        free(order);
        return NULL;
    }
    return order;
}

/* Priorities pack (next use, topological index) into one integer: ties in next use are
 * broken in a dependency-respecting order, which the pool grants rely on. */
fy_status fy_graph_prioritize(fy_graph *g) {
    int *order = topo_order(g);
    if (!order) return FY_ERR_INVALID;
    int64_t *use = malloc((size_t)(g->n ? g->n : 1) * sizeof *use);
    int *rank = malloc((size_t)(g->n ? g->n : 1) * sizeof *rank);
    if (!use || !rank) { free(order); free(use); free(rank); return FY_ERR_NOMEM; }
    int64_t maxpos = 0;
    for (int i = 0; i < g->n; i++) if (g->tasks[i].use_pos > maxpos) maxpos = g->tasks[i].use_pos;
    for (int k = 0; k < g->n; k++) rank[order[k]] = k;
    for (int k = g->n - 1; k >= 0; k--) {
        const fy_task *t = &g->tasks[order[k]];
        int64_t u = t->use_pos >= 0 ? t->use_pos : INT64_MAX;
        for (int s = 0; s < t->nsucc; s++)
            if (use[t->succ[s]] < u) u = use[t->succ[s]];
        /* waited on by nothing: after everything, in program order */
        if (u == INT64_MAX) u = maxpos + 1;
        use[order[k]] = u;
    }
    for (int i = 0; i < g->n; i++) g->tasks[i].prio = use[i] * ((int64_t)g->n + 1) + rank[i];
    free(order);
    free(use);
    free(rank);
    return FY_OK;
}

void fy_sched_result_free(fy_sched_result *r) {
    free(r->recs);
    r->recs = NULL;
    r->nrecs = 0;
}

/* ---- dispatch state ------------------------------------------------------------------ */

typedef struct dispatch {
    fy_graph *g;
    fy_sched_mode mode;
    int *pending;
    int64_t *ready_seq;
    int64_t seq;
    int *ready[FY_LANE_COUNT];       /* ready tasks without a pool, by lane */
    int nready[FY_LANE_COUNT];
    int *pos;                        /* per task: its index in ready[its lane] */
    bool *pool_ready;                /* per task: a pool task that is ready, not started */
    int *grants[FY_SCHED_MAX_POOLS]; /* pool tasks in priority order */
    int ngrants[FY_SCHED_MAX_POOLS], next_grant[FY_SCHED_MAX_POOLS];
    int *unit_holder[FY_SCHED_MAX_POOLS];  /* the task holding each unit, or -1 */
    int *unit_last[FY_SCHED_MAX_POOLS];    /* the task whose end last freed it, or -1 */
    int64_t *unit_freed[FY_SCHED_MAX_POOLS]; /* when (finish count) it was freed; -1 never */
    int running, done;
    bool lane_busy[FY_LANE_COUNT];
    int cancel_from;                       /* epochs from here on are cancelled */
} dispatch;

static bool cancelled(const dispatch *d, int id) { return d->g->tasks[id].epoch >= d->cancel_from; }

static int by_prio(const void *a, const void *b, void *graph) {
    const fy_graph *g = graph;
    int64_t pa = g->tasks[*(const int *)a].prio, pb = g->tasks[*(const int *)b].prio;
    return (pa > pb) - (pa < pb);
}

/* A task whose predecessors are done. A pool task waits outside the lanes' lists: only
 * its pool's next grant can start, so picking looks at one task per pool. */
static void push_ready(dispatch *d, int id) {
    fy_lane l = d->g->tasks[id].lane;
    if (d->g->tasks[id].acquire_pool >= 0) {
        d->pool_ready[id] = true;
    } else {
        d->pos[id] = d->nready[l];
        d->ready[l][d->nready[l]++] = id;
    }
    d->ready_seq[id] = d->seq; /* one number per event: tasks readied together tie */
}

static void dispatch_free(dispatch *d) {
    free(d->pending);
    free(d->ready_seq);
    free(d->pos);
    free(d->pool_ready);
    for (int l = 0; l < FY_LANE_COUNT; l++) free(d->ready[l]);
    for (int p = 0; p < FY_SCHED_MAX_POOLS; p++) {
        free(d->grants[p]);
        free(d->unit_holder[p]);
        free(d->unit_last[p]);
        free(d->unit_freed[p]);
    }
}

static fy_status dispatch_init(dispatch *d, fy_graph *g, fy_sched_mode mode) {
    memset(d, 0, sizeof *d);
    d->g = g;
    d->mode = mode;
    d->cancel_from = INT_MAX;
    size_t n = (size_t)(g->n ? g->n : 1);
    d->pending = malloc(n * sizeof *d->pending);
    d->ready_seq = malloc(n * sizeof *d->ready_seq);
    d->pos = malloc(n * sizeof *d->pos);
    d->pool_ready = calloc(n, sizeof *d->pool_ready);
    bool ok = d->pending && d->ready_seq && d->pos && d->pool_ready;
    for (int l = 0; l < FY_LANE_COUNT; l++) ok = ok && (d->ready[l] = malloc(n * sizeof(int)));
    for (int p = 0; p < g->npools && ok; p++) {
        size_t nu = (size_t)(g->pool_units[p] ? g->pool_units[p] : 1);
        ok = (d->grants[p] = malloc(n * sizeof(int))) &&
             (d->unit_holder[p] = malloc(nu * sizeof(int))) &&
             (d->unit_last[p] = malloc(nu * sizeof(int))) &&
             (d->unit_freed[p] = malloc(nu * sizeof(int64_t)));
        for (size_t u = 0; ok && u < nu; u++) {
            d->unit_holder[p][u] = d->unit_last[p][u] = -1;
            d->unit_freed[p][u] = -1;
        }
    }
    if (!ok) { dispatch_free(d); return FY_ERR_NOMEM; }
    for (int i = 0; i < g->n; i++) {
        fy_task *t = &g->tasks[i];
        FY_ASSERT(t->acquire_pool < g->npools, "task uses an unknown pool");
        if (t->acquire_pool >= 0) d->grants[t->acquire_pool][d->ngrants[t->acquire_pool]++] = i;
        t->unit = t->unit_after = -1;
        /* failures cancel later epochs: nothing may wait on a later epoch, and a unit is
         * given back within the epoch that took it */
        for (int k = 0; k < t->nsucc; k++)
            if (g->tasks[t->succ[k]].epoch < t->epoch) {
                fy_log_error("scheduler: a dependency goes from epoch %d back to epoch %d",
                             t->epoch, g->tasks[t->succ[k]].epoch);
                dispatch_free(d);
                return FY_ERR_INVALID;
            }
        for (int r = 0; r < FY_SCHED_MAX_RELEASES; r++)
            if (t->release_of[r] >= 0 && g->tasks[t->release_of[r]].epoch != t->epoch) {
                fy_log_error("scheduler: a unit is given back in another epoch than it was taken");
                dispatch_free(d);
                return FY_ERR_INVALID;
            }
    }
    for (int p = 0; p < g->npools; p++)
        qsort_r(d->grants[p], (size_t)d->ngrants[p], sizeof(int), by_prio, g);
    for (int i = 0; i < g->n; i++) {
        d->pending[i] = g->tasks[i].npred;
        if (!d->pending[i]) push_ready(d, i);
    }
    return FY_OK;
}

/* The index in pool p's grant order of the next task to be granted a unit (cancelled
 * tasks are skipped: they will never ask). */
static int next_grant(const dispatch *d, int p) {
    int k = d->next_grant[p];
    while (k < d->ngrants[p] && cancelled(d, d->grants[p][k])) k++;
    return k;
}

/* Pool p's next grant when it is ready and a unit is free (it may start now), else -1. */
static int pool_head(const dispatch *d, int p) {
    int k = next_grant(d, p);
    if (k >= d->ngrants[p]) return -1;
    int id = d->grants[p][k];
    if (!d->pool_ready[id]) return -1;
    for (int u = 0; u < d->g->pool_units[p]; u++)
        if (d->unit_holder[p][u] < 0) return id;
    return -1;
}

static bool better(const dispatch *d, int a, int b) {
    if (b < 0) return true;
    if (d->mode == FY_SCHED_FIFO)
        return d->ready_seq[a] != d->ready_seq[b] ? d->ready_seq[a] < d->ready_seq[b] : a < b;
    return d->g->tasks[a].prio < d->g->tasks[b].prio;
}

/* The best task that may start on lane l now (not cancelled; a pool task only as its
 * pool's next grant with a free unit), or -1. */
static int best_on(const dispatch *d, int l) {
    int best = -1;
    for (int i = 0; i < d->nready[l]; i++) {
        int id = d->ready[l][i];
        if (!cancelled(d, id) && better(d, id, best)) best = id;
    }
    for (int p = 0; p < d->g->npools; p++) {
        int id = pool_head(d, p);
        if (id >= 0 && (int)d->g->tasks[id].lane == l && better(d, id, best)) best = id;
    }
    return best;
}

/* The task to run next on lane, or -1. Priorities (and FIFO's order) are unique, so the
 * pick does not depend on the order of the lists. */
static int pick(const dispatch *d, fy_lane lane) {
    if (d->lane_busy[lane]) return -1;
    if (d->mode != FY_SCHED_SERIAL) return best_on(d, lane);
    if (d->running) return -1;
    int best = -1;
    for (int l = 0; l < FY_LANE_COUNT; l++) {
        int id = best_on(d, l);
        if (id >= 0 && better(d, id, best)) best = id;
    }
    return best >= 0 && d->g->tasks[best].lane == lane ? best : -1;
}

static void start(dispatch *d, fy_lane lane, int id) {
    fy_task *t = &d->g->tasks[id];
    if (t->acquire_pool < 0) {
        int i = d->pos[id], last = d->ready[lane][--d->nready[lane]];
        d->ready[lane][i] = last;
        d->pos[last] = i;
    } else {
        d->pool_ready[id] = false;
        /* the free unit freed longest ago: its last user's work is the likeliest done (a
         * unit is freed when its last user's task ends, which may be before that task's
         * queued work does) */
        int p = t->acquire_pool, best = -1;
        for (int u = 0; u < d->g->pool_units[p]; u++)
            if (d->unit_holder[p][u] < 0 && (best < 0 || d->unit_freed[p][u] < d->unit_freed[p][best]))
                best = u;
        d->unit_holder[p][best] = id;
        t->unit = best;
        t->unit_after = d->unit_last[p][best];
        d->next_grant[p] = next_grant(d, p) + 1;
    }
    d->lane_busy[lane] = true;
    d->running++;
}

static void finish(dispatch *d, int id) {
    fy_task *t = &d->g->tasks[id];
    for (int r = 0; r < FY_SCHED_MAX_RELEASES; r++) {
        if (t->release_of[r] < 0) continue;
        const fy_task *a = &d->g->tasks[t->release_of[r]];
        FY_ASSERT(a->unit >= 0 && a->acquire_pool >= 0, "release of a unit never acquired");
        d->unit_holder[a->acquire_pool][a->unit] = -1;
        d->unit_last[a->acquire_pool][a->unit] = id;
        d->unit_freed[a->acquire_pool][a->unit] = d->done;
    }
    for (int k = 0; k < t->nsucc; k++)
        if (--d->pending[t->succ[k]] == 0) push_ready(d, t->succ[k]);
    d->lane_busy[t->lane] = false;
    d->running--;
    d->done++;
}

static fy_status stuck_error(const dispatch *d) {
    fy_log_error("scheduler: no task can start (%d of %d done); a pool is too small or a "
                 "dependency is missing", d->done, d->g->n);
    return FY_ERR_INVALID;
}

/* ---- executor ---------------------------------------------------------------------- */

typedef struct exec {
    dispatch d;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    double t0;
    fy_sched_result *res;
    bool stuck;               /* no task can ever start: a bug in the graph */
    fy_status failure;        /* the failure of the earliest epoch */
    int lane_task[FY_LANE_COUNT]; /* the task each lane runs, or -1 */
    bool draining;            /* the drain hook is running */
    int drained_from;         /* cancel_from when it last ran (INT_MAX: never) */
} exec;

typedef struct lane_arg { exec *x; fy_lane lane; } lane_arg;

/* After a failure, once no task of a cancelled epoch runs: the graph's drain hook waits
 * for their queued work (outside the lock: other lanes go on), then the units they hold
 * are given back. Called and returns with the lock held. */
static void drain_cancelled(exec *x) {
    dispatch *d = &x->d;
    const int from = d->cancel_from;
    x->draining = true;
    pthread_mutex_unlock(&x->mu);
    if (d->g->drain) d->g->drain(d->g->hook_ctx);
    pthread_mutex_lock(&x->mu);
    for (int p = 0; p < d->g->npools; p++)
        for (int u = 0; u < d->g->pool_units[p]; u++) {
            int h = d->unit_holder[p][u];
            if (h >= 0 && d->g->tasks[h].epoch >= from) {
                d->unit_holder[p][u] = d->unit_last[p][u] = -1;
                d->unit_freed[p][u] = d->done;
            }
        }
    x->draining = false;
    x->drained_from = from;
    pthread_cond_broadcast(&x->cv);
}

/* Tasks of cancelled epochs running on some lane now. */
static int running_cancelled(const exec *x) {
    int n = 0;
    for (int l = 0; l < FY_LANE_COUNT; l++)
        n += x->lane_task[l] >= 0 && cancelled(&x->d, x->lane_task[l]);
    return n;
}

/* Nothing runs and nothing can start on any lane. */
static bool idle(const dispatch *d) {
    if (d->running) return false;
    for (int l = 0; l < FY_LANE_COUNT; l++)
        if (pick(d, (fy_lane)l) >= 0) return false;
    return true;
}

static fy_status run_task(exec *x, fy_task *t) {
    char name[96];
    fy_task_name(x->d.g, t, name, sizeof name);
    unsigned errors = fy_log_error_count();
    fy_log_set_context(name);
    fy_status st = t->run ? t->run(t->ctx, t) : FY_OK;
    if (st != FY_OK && st != FY_INTERRUPTED && fy_log_error_count() == errors)
        fy_log_error("%s", fy_status_str(st));
    fy_log_set_context(NULL);
    return st;
}

static void *lane_main(void *arg) {
    lane_arg *la = arg;
    exec *x = la->x;
    dispatch *d = &x->d;
    bool gated = false; /* lane_wait ran since this lane's last task */
    pthread_mutex_lock(&x->mu);
    for (;;) {
        if (!gated && d->g->lane_wait) {
            pthread_mutex_unlock(&x->mu);
            d->g->lane_wait(d->g->hook_ctx, la->lane);
            pthread_mutex_lock(&x->mu);
            gated = true;
        }
        bool failed = x->failure != FY_OK, drained = x->drained_from == d->cancel_from;
        if (failed && !drained && !x->draining && running_cancelled(x) == 0) {
            drain_cancelled(x);
            continue;
        }
        if (x->stuck || d->done == d->g->n) break;
        int id = pick(d, la->lane);
        if (id < 0) {
            if (idle(d) && (!failed || drained) && !x->draining) {
                if (!failed) x->stuck = true; /* after a failure, the end */
                pthread_cond_broadcast(&x->cv);
                break;
            }
            pthread_cond_wait(&x->cv, &x->mu);
            continue;
        }
        start(d, la->lane, id);
        fy_task *t = &d->g->tasks[id];
        int rec = x->res->nrecs++;
        x->lane_task[la->lane] = id;
        gated = false;
        /* a granted unit moves the pool's grant on: another lane's task may start now */
        if (t->acquire_pool >= 0) pthread_cond_broadcast(&x->cv);
        pthread_mutex_unlock(&x->mu);
        double t_start = fy_now_ms() - x->t0;
        fy_status st = run_task(x, t);
        double t_end = fy_now_ms() - x->t0;
        pthread_mutex_lock(&x->mu);
        x->res->recs[rec] = (fy_trace_rec){id, t_start, t_end};
        x->res->busy_ms[la->lane] += t_end - t_start;
        x->lane_task[la->lane] = -1;
        if (st != FY_OK && t->epoch < d->cancel_from) { /* the earliest failure so far */
            x->failure = st;
            x->res->failed_task = id;
            d->cancel_from = t->epoch;
        }
        finish(d, id);
        d->seq++;
        pthread_cond_broadcast(&x->cv);
    }
    pthread_mutex_unlock(&x->mu);
    return NULL;
}

fy_status fy_sched_execute(fy_graph *g, fy_sched_mode mode, fy_sched_result *out) {
    memset(out, 0, sizeof *out);
    out->failed_task = -1;
    exec x = {.res = out, .drained_from = INT_MAX};
    for (int l = 0; l < FY_LANE_COUNT; l++) x.lane_task[l] = -1; /* every lane, however many */
    FY_TRY(dispatch_init(&x.d, g, mode));
    out->recs = calloc((size_t)(g->n ? g->n : 1), sizeof *out->recs);
    if (!out->recs) { dispatch_free(&x.d); return FY_ERR_NOMEM; }
    pthread_mutex_init(&x.mu, NULL);
    pthread_cond_init(&x.cv, NULL);
    x.t0 = fy_now_ms();
    out->t0_ms = x.t0;
    pthread_t th[FY_LANE_COUNT];
    lane_arg args[FY_LANE_COUNT];
    int started = 0;
    bool no_thread = false;
    for (int l = 0; l < FY_LANE_COUNT; l++) {
        args[l] = (lane_arg){&x, (fy_lane)l};
        if (pthread_create(&th[l], NULL, lane_main, &args[l]) != 0) {
            pthread_mutex_lock(&x.mu);
            x.stuck = no_thread = true;
            pthread_cond_broadcast(&x.cv);
            pthread_mutex_unlock(&x.mu);
            break;
        }
        started++;
    }
    for (int l = 0; l < started; l++) pthread_join(th[l], NULL);
    out->makespan_ms = fy_now_ms() - x.t0;
    fy_status st = x.failure;
    if (st == FY_OK && no_thread) {
        fy_log_error("scheduler: cannot start the lane threads");
        st = FY_ERR_NOMEM;
    } else if (st == FY_OK && x.stuck) {
        st = stuck_error(&x.d);
    }
    pthread_mutex_destroy(&x.mu);
    pthread_cond_destroy(&x.cv);
    dispatch_free(&x.d);
    /* records were reserved at start: order them by start time */
    for (int i = 1; i < out->nrecs; i++) {
        fy_trace_rec r = out->recs[i];
        int j = i - 1;
        while (j >= 0 && out->recs[j].start_ms > r.start_ms) { out->recs[j + 1] = out->recs[j]; j--; }
        out->recs[j + 1] = r;
    }
    return st;
}

/* ---- simulator ----------------------------------------------------------------------- */

fy_status fy_sched_simulate(fy_graph *g, fy_sched_mode mode, fy_sched_result *out) {
    memset(out, 0, sizeof *out);
    dispatch d;
    FY_TRY(dispatch_init(&d, g, mode));
    out->recs = calloc((size_t)(g->n ? g->n : 1), sizeof *out->recs);
    if (!out->recs) { dispatch_free(&d); return FY_ERR_NOMEM; }
    int running[FY_LANE_COUNT];
    double end_at[FY_LANE_COUNT];
    for (int l = 0; l < FY_LANE_COUNT; l++) running[l] = -1;
    double now = 0.0;
    fy_status st = FY_OK;
    while (d.done < g->n) {
        /* start what can start now; a start can unblock another lane's pool grant */
        for (bool started = true; started;) {
            started = false;
            for (int l = 0; l < FY_LANE_COUNT; l++) {
                int id = pick(&d, (fy_lane)l);
                if (id < 0) continue;
                start(&d, (fy_lane)l, id);
                running[l] = id;
                end_at[l] = now + g->tasks[id].cost_ms;
                out->recs[out->nrecs++] = (fy_trace_rec){id, now, end_at[l]};
                out->busy_ms[l] += g->tasks[id].cost_ms;
                started = true;
            }
        }
        int first = -1;
        for (int l = 0; l < FY_LANE_COUNT; l++)
            if (running[l] >= 0 && (first < 0 || end_at[l] < end_at[first])) first = l;
        if (first < 0) { st = stuck_error(&d); break; }
        now = end_at[first];
        for (int l = 0; l < FY_LANE_COUNT; l++)
            if (running[l] >= 0 && end_at[l] <= now) {
                finish(&d, running[l]);
                running[l] = -1;
            }
        d.seq++;
    }
    out->makespan_ms = now;
    dispatch_free(&d);
    return st;
}

/* ---- trace ----------------------------------------------------------------------------- */

static fy_status tb_printf(fy_trace_buf *tb, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static fy_status tb_printf(fy_trace_buf *tb, const char *fmt, ...) {
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(tb->text ? tb->text + tb->len : NULL, tb->text ? tb->cap - tb->len : 0, fmt, ap);
        va_end(ap);
        if (n < 0) return FY_ERR_INVALID;
        if (tb->text && tb->len + (size_t)n < tb->cap) { tb->len += (size_t)n; return FY_OK; }
        size_t ncap = tb->cap ? 2 * tb->cap : 1 << 16;
        while (ncap < tb->len + (size_t)n + 1) ncap *= 2;
        char *t = realloc(tb->text, ncap);
        if (!t) return FY_ERR_NOMEM;
        tb->text = t;
        tb->cap = ncap;
    }
}

fy_status fy_trace_append(fy_trace_buf *tb, const fy_graph *g, const fy_sched_result *r,
                          double offset_ms, int iter_offset) {
    for (int i = 0; i < r->nrecs; i++) {
        const fy_task *t = &g->tasks[r->recs[i].task];
        const char *kind = g->kind_name ? g->kind_name(t->kind) : "task";
        double ts = (r->recs[i].start_ms + offset_ms) * 1e3, dur = (r->recs[i].end_ms - r->recs[i].start_ms) * 1e3;
        FY_TRY(tb_printf(tb, ",\n{\"name\":\"%s(%d) it %d\",\"cat\":\"%s\",\"ph\":\"X\",\"pid\":1,"
                         "\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f,\"args\":{\"block\":%d,\"iter\":%d,"
                         "\"prio\":%lld", kind, t->block, t->iter + iter_offset, kind, (int)t->lane,
                         ts, dur, t->block, t->iter + iter_offset, (long long)t->prio));
        if (t->bytes > 0) FY_TRY(tb_printf(tb, ",\"bytes\":%.0f", t->bytes));
        if (t->flops > 0) FY_TRY(tb_printf(tb, ",\"flops\":%.0f", t->flops));
        FY_TRY(tb_printf(tb, "}}"));
        tb->nevents++;
    }
    return FY_OK;
}

void fy_trace_buf_free(fy_trace_buf *tb) {
    free(tb->text);
    memset(tb, 0, sizeof *tb);
}

fy_status fy_trace_save(const fy_trace_buf *tb, const char *path, const char *label) {
    char tmp[4096];
    int fd = fy_open_tmp(path, tmp, sizeof tmp);
    FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;
    if (!f) {
        if (fd >= 0) close(fd);
        fy_log_error("cannot write trace %s", path);
        return FY_ERR_IO;
    }
    fprintf(f, "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n");
    fprintf(f, "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":1,\"args\":{\"name\":\"%s\"}}",
            label ? label : "ferry");
    for (int l = 0; l < FY_LANE_COUNT; l++)
        fprintf(f, ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":1,\"tid\":%d,"
                "\"args\":{\"name\":\"%s\"}}", l, lane_names[l]);
    if (tb->len) fwrite(tb->text, 1, tb->len, f);
    fprintf(f, "\n]}\n");
    if (fclose(f) != 0 || rename(tmp, path) != 0) {
        remove(tmp);
        fy_log_error("cannot write trace %s", path);
        return FY_ERR_IO;
    }
    return FY_OK;
}

fy_status fy_sched_write_trace(const fy_graph *g, const fy_sched_result *r, const char *path,
                               const char *label) {
    fy_trace_buf tb = {0};
    fy_status st = fy_trace_append(&tb, g, r, 0.0, 0);
    if (st == FY_OK) st = fy_trace_save(&tb, path, label);
    fy_trace_buf_free(&tb);
    return st;
}
