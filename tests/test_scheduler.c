/* test_scheduler.c — the generic scheduler (scheduler/scheduler.h): graphs, next-use
 * priorities, pools, the executor, the simulator and the trace writer.
 *
 * The executor is observed from inside: every task's run() increments a per-task counter,
 * takes a global sequence number when it starts and when it ends, claims the pool unit it
 * was given and frees the units its releases name. Order properties are then checked on
 * sequence numbers, which need no clock: "s starts after p ended" is start_seq[s] >
 * end_seq[p]. The simulator is checked on the records it returns (virtual time).
 *
 * Random graphs are built so that no schedule obeying the header's rules can deadlock
 * (see random_graph), so a hang is a scheduler bug; every test has a timeout. Timing
 * enters two tests only: the simulator against the executor (sleeps of 3..30 ms whose
 * event times never coincide; tolerances and retries explained there) and a pool grant
 * that must not wait for a 30 ms task to end. Speed itself is measured in bench/. */
#include <criterion/criterion.h>

#include <cjson/cJSON.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine/core/util.h"
#include "scheduler/scheduler.h"

static const fy_sched_mode all_modes[] = {FY_SCHED_PRIORITY, FY_SCHED_FIFO, FY_SCHED_SERIAL};

/* ---- helpers ------------------------------------------------------------------------ */

static uint64_t rng_next(uint64_t *s) { /* splitmix64 */
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
/* uniform in [lo, hi] */
static int rng_int(uint64_t *s, int lo, int hi) {
    return lo + (int)(rng_next(s) % (uint64_t)(hi - lo + 1));
}

static void sleep_ms(double ms) {
    struct timespec ts = {.tv_sec = (time_t)(ms / 1e3),
                          .tv_nsec = (long)((ms - 1e3 * (double)(time_t)(ms / 1e3)) * 1e6)};
    while (clock_nanosleep(CLOCK_MONOTONIC, 0, &ts, &ts) != 0) {}
}

/* What run() observes during one execution. Tasks find it through ctx, and their own id
 * from their place in the graph. */
typedef struct probe {
    const fy_graph *g;
    atomic_int seq;
    atomic_int *runs;                      /* per task: times run() was called */
    int *start_seq, *end_seq;              /* per task, written by its own run() */
    atomic_int running, max_running;       /* tasks inside run() now, and at most */
    atomic_int lane_running[FY_LANE_COUNT];
    atomic_int *holder[FY_SCHED_MAX_POOLS];/* per unit: 1 + id of the task holding it, 0 free */
    atomic_int errors;                     /* violations seen inside run() */
    char first_error[200];                 /* written by whoever counted the first */
    double spin_us;                        /* busy time in each run(), to let lanes overlap */
    bool sleep_cost;                       /* sleep cost_ms instead (timed test) */
    atomic_int flag;                       /* for tests that make a lane wait */
    bool wait_flag_task[512];              /* tasks that wait for flag (at most 2 s) */
    bool set_flag_task[512];               /* tasks that set flag */
    atomic_int flag_timeouts;
} probe;

static void probe_error(probe *p, const char *what, int id) {
    if (atomic_fetch_add(&p->errors, 1) == 0)
        snprintf(p->first_error, sizeof p->first_error, "%s (task %d)", what, id);
}

static probe *probe_new(int n) {
    probe *p = calloc(1, sizeof *p);
    p->runs = calloc((size_t)n + 1, sizeof *p->runs);
    p->start_seq = calloc((size_t)n + 1, sizeof(int));
    p->end_seq = calloc((size_t)n + 1, sizeof(int));
    for (int k = 0; k < FY_SCHED_MAX_POOLS; k++) p->holder[k] = calloc(64, sizeof(atomic_int));
    return p;
}

/* Clears what one execution recorded (the graph and the options stay). */
static void probe_reset(probe *p, const fy_graph *g) {
    p->g = g;
    atomic_store(&p->seq, 0);
    for (int i = 0; i < g->n; i++) {
        atomic_store(&p->runs[i], 0);
        p->start_seq[i] = p->end_seq[i] = -1;
    }
    atomic_store(&p->running, 0);
    atomic_store(&p->max_running, 0);
    for (int l = 0; l < FY_LANE_COUNT; l++) atomic_store(&p->lane_running[l], 0);
    for (int k = 0; k < FY_SCHED_MAX_POOLS; k++)
        for (int u = 0; u < 64; u++) atomic_store(&p->holder[k][u], 0);
    atomic_store(&p->errors, 0);
    p->first_error[0] = 0;
    atomic_store(&p->flag, 0);
    atomic_store(&p->flag_timeouts, 0);
}

static void probe_free(probe *p) {
    if (!p) return;
    free(p->runs);
    free(p->start_seq);
    free(p->end_seq);
    for (int k = 0; k < FY_SCHED_MAX_POOLS; k++) free(p->holder[k]);
    free(p);
}

static fy_status probe_run(void *ctx, const fy_task *t) {
    probe *p = ctx;
    const fy_graph *g = p->g;
    int id = (int)(t - g->tasks);
    atomic_fetch_add(&p->runs[id], 1);
    int now = atomic_fetch_add(&p->running, 1) + 1;
    int mx = atomic_load(&p->max_running);
    while (now > mx && !atomic_compare_exchange_weak(&p->max_running, &mx, now)) {}
    if (atomic_fetch_add(&p->lane_running[t->lane], 1) != 0)
        probe_error(p, "two tasks of one lane run at once", id);
    p->start_seq[id] = atomic_fetch_add(&p->seq, 1);
    if (t->acquire_pool >= 0) {
        int k = t->acquire_pool, u = t->unit;
        int free_unit = 0;
        if (u < 0 || u >= g->pool_units[k])
            probe_error(p, "acquired unit out of range", id);
        else if (!atomic_compare_exchange_strong(&p->holder[k][u], &free_unit, id + 1))
            probe_error(p, "acquired a unit another task holds", id);
    }
    if (p->sleep_cost) {
        sleep_ms(t->cost_ms);
    } else if (p->spin_us > 0) {
        double t0 = fy_now_ms();
        while ((fy_now_ms() - t0) * 1e3 < p->spin_us) {}
        sched_yield();
    }
    if (id < 512 && p->wait_flag_task[id]) {
        double t0 = fy_now_ms();
        while (!atomic_load(&p->flag)) {
            if (fy_now_ms() - t0 > 2000.0) { atomic_fetch_add(&p->flag_timeouts, 1); break; }
            sleep_ms(0.1);
        }
    }
    if (id < 512 && p->set_flag_task[id]) atomic_store(&p->flag, 1);
    for (int r = 0; r < FY_SCHED_MAX_RELEASES; r++) {
        int a = t->release_of[r];
        if (a < 0) continue;
        /* a is an ancestor: it ended before this task started, so its unit is settled */
        const fy_task *at = &g->tasks[a];
        int held = a + 1;
        if (at->unit < 0 || at->unit >= g->pool_units[at->acquire_pool] ||
            !atomic_compare_exchange_strong(&p->holder[at->acquire_pool][at->unit], &held, 0))
            probe_error(p, "released a unit its acquirer does not hold", id);
    }
    p->end_seq[id] = atomic_fetch_add(&p->seq, 1);
    atomic_fetch_sub(&p->lane_running[t->lane], 1);
    atomic_fetch_sub(&p->running, 1);
    return FY_OK;
}

static int add_task(fy_graph *g, fy_lane lane, int64_t use_pos, double cost_ms, probe *p) {
    fy_task t = fy_task_make(lane, 0, g->n, 0, probe_run, p);
    t.use_pos = use_pos;
    t.cost_ms = cost_ms;
    int id = fy_graph_add(g, &t);
    cr_assert_geq(id, 0);
    return id;
}

static void dep(fy_graph *g, int before, int after) {
    cr_assert_eq(fy_graph_dep(g, before, after), FY_OK);
}

/* releaser[x] = the task whose end frees x's unit, or -1 */
static int *releasers(const fy_graph *g) {
    size_t n = g->n > 0 ? (size_t)g->n : 1;
    int *rel = malloc(n * sizeof *rel);
    cr_assert_not_null(rel);
    for (int i = 0; i < g->n; i++) rel[i] = -1;
    for (int i = 0; i < g->n; i++)
        for (int r = 0; r < FY_SCHED_MAX_RELEASES; r++)
            if (g->tasks[i].release_of[r] >= 0) rel[g->tasks[i].release_of[r]] = i;
    return rel;
}

/* Start order of the tasks on one lane, from records (sorted by start). */
static int lane_order(const fy_graph *g, const fy_sched_result *r, fy_lane lane, int *out) {
    int k = 0;
    for (int i = 0; i < r->nrecs; i++)
        if (g->tasks[r->recs[i].task].lane == lane) out[k++] = r->recs[i].task;
    return k;
}

/* The records name every task once, in start order; returns start/end times per task. */
static void check_records(const fy_graph *g, const fy_sched_result *r, double *st, double *en,
                          const char *what) {
    cr_assert_eq(r->nrecs, g->n, "%s: %d records for %d tasks", what, r->nrecs, g->n);
    for (int i = 0; i < g->n; i++) st[i] = -1.0;
    for (int i = 0; i < r->nrecs; i++) {
        const fy_trace_rec *c = &r->recs[i];
        cr_assert(c->task >= 0 && c->task < g->n, "%s: record of task %d", what, c->task);
        cr_assert_eq(st[c->task], -1.0, "%s: task %d recorded twice", what, c->task);
        cr_assert(c->end_ms >= c->start_ms && c->start_ms >= 0.0, "%s: task %d [%g, %g]", what,
                  c->task, c->start_ms, c->end_ms);
        if (i) cr_assert_geq(c->start_ms, r->recs[i - 1].start_ms, "%s: records not in start order", what);
        cr_assert_leq(c->end_ms, r->makespan_ms + 1e-9, "%s: task %d ends after the makespan", what, c->task);
        st[c->task] = c->start_ms;
        en[c->task] = c->end_ms;
    }
}

/* Every property of one executor run: each task once, dependencies, lanes, pools, and
 * in serial mode one task at a time. */
static void check_execution(const fy_graph *g, const probe *p, const fy_sched_result *r,
                            fy_sched_mode mode, const char *what) {
    cr_assert_eq(atomic_load(&p->errors), 0, "%s: %d violations inside run(), first: %s", what,
                 atomic_load(&p->errors), p->first_error);
    for (int i = 0; i < g->n; i++)
        cr_assert_eq(atomic_load(&p->runs[i]), 1, "%s: task %d ran %d times", what, i,
                     atomic_load(&p->runs[i]));
    double *st = malloc((size_t)g->n * sizeof *st + 8), *en = malloc((size_t)g->n * sizeof *en + 8);
    check_records(g, r, st, en, what);
    for (int i = 0; i < g->n; i++)
        for (int k = 0; k < g->tasks[i].nsucc; k++) {
            int s = g->tasks[i].succ[k];
            cr_assert_gt(p->start_seq[s], p->end_seq[i], "%s: task %d started (seq %d) before "
                         "its predecessor %d ended (seq %d)", what, s, p->start_seq[s], i,
                         p->end_seq[i]);
        }
    /* a unit is held from its acquirer's start to its releaser's end */
    int *rel = releasers(g);
    for (int x = 0; x < g->n; x++) {
        const fy_task *tx = &g->tasks[x];
        if (tx->acquire_pool < 0) continue;
        int xend = rel[x] >= 0 ? p->end_seq[rel[x]] : INT32_MAX;
        for (int y = 0; y < g->n; y++) {
            const fy_task *ty = &g->tasks[y];
            if (y == x || ty->acquire_pool != tx->acquire_pool || ty->unit != tx->unit) continue;
            int yend = rel[y] >= 0 ? p->end_seq[rel[y]] : INT32_MAX;
            cr_assert(p->start_seq[y] > xend || p->start_seq[x] > yend,
                      "%s: tasks %d and %d held unit %d of pool %d at once", what, x, y, tx->unit,
                      tx->acquire_pool);
        }
    }
    if (mode == FY_SCHED_SERIAL) {
        cr_assert_eq(atomic_load(&p->max_running), 1, "%s: serial ran %d tasks at once", what,
                     atomic_load(&p->max_running));
        for (int i = 0; i < g->n; i++)
            cr_assert_eq(p->end_seq[i], p->start_seq[i] + 1, "%s: something ran during task %d",
                         what, i);
    }
    free(rel);
    free(st);
    free(en);
}

/* The same properties for a simulation, from its records (virtual time). */
static void check_simulation(const fy_graph *g, const fy_sched_result *r, fy_sched_mode mode,
                             const char *what) {
    double *st = malloc((size_t)g->n * sizeof *st + 8), *en = malloc((size_t)g->n * sizeof *en + 8);
    check_records(g, r, st, en, what);
    double busy[FY_LANE_COUNT] = {0}, last = 0.0;
    for (int i = 0; i < g->n; i++) {
        cr_assert_float_eq(en[i] - st[i], g->tasks[i].cost_ms, 1e-9, "%s: task %d lasted %g, cost %g",
                           what, i, en[i] - st[i], g->tasks[i].cost_ms);
        busy[g->tasks[i].lane] += g->tasks[i].cost_ms;
        if (en[i] > last) last = en[i];
        for (int k = 0; k < g->tasks[i].nsucc; k++) {
            int s = g->tasks[i].succ[k];
            cr_assert_geq(st[s], en[i], "%s: task %d started at %g before its predecessor %d "
                          "ended at %g", what, s, st[s], i, en[i]);
        }
    }
    cr_assert_float_eq(r->makespan_ms, last, 1e-9, "%s: makespan %g, last end %g", what,
                       r->makespan_ms, last);
    for (int l = 0; l < FY_LANE_COUNT; l++)
        cr_assert_float_eq(r->busy_ms[l], busy[l], 1e-6, "%s: lane %d busy %g, expected %g", what,
                           l, r->busy_ms[l], busy[l]);
    /* one task at a time per lane (everywhere in serial mode); records are in start order */
    for (int i = 0; i < r->nrecs; i++)
        for (int j = i + 1; j < r->nrecs; j++) {
            int a = r->recs[i].task, b = r->recs[j].task;
            if (mode != FY_SCHED_SERIAL && g->tasks[a].lane != g->tasks[b].lane) continue;
            cr_assert(st[b] >= en[a] || (en[a] == st[a] && st[b] == st[a]),
                      "%s: tasks %d and %d overlap on %s", what, a, b,
                      mode == FY_SCHED_SERIAL ? "the machine" : fy_lane_name(g->tasks[a].lane));
        }
    int *rel = releasers(g);
    for (int x = 0; x < g->n; x++) {
        const fy_task *tx = &g->tasks[x];
        if (tx->acquire_pool < 0) continue;
        cr_assert(tx->unit >= 0 && tx->unit < g->pool_units[tx->acquire_pool],
                  "%s: task %d got unit %d of a %d-unit pool", what, x, tx->unit,
                  g->pool_units[tx->acquire_pool]);
        double xend = rel[x] >= 0 ? en[rel[x]] : 1e300;
        for (int y = 0; y < g->n; y++) {
            const fy_task *ty = &g->tasks[y];
            if (y == x || ty->acquire_pool != tx->acquire_pool || ty->unit != tx->unit) continue;
            double yend = rel[y] >= 0 ? en[rel[y]] : 1e300;
            cr_assert(st[y] >= xend || st[x] >= yend, "%s: tasks %d and %d held unit %d of pool "
                      "%d at once", what, x, y, tx->unit, tx->acquire_pool);
        }
    }
    free(rel);
    free(st);
    free(en);
}

/* ---- 1. random graphs ------------------------------------------------------------------ */

enum { N_GRAPHS = 50, MAX_TASKS = 300 };

/* A random DAG of 20..300 tasks over the four lanes, edges from lower to higher ids (most
 * to one of the previous 12 tasks, so the graph is deep, some anywhere before), 1..3
 * pools (pool 0 has a single unit) and acquirer/releaser pairs.
 *
 * Pairs are chosen so that no schedule following the header's rules can deadlock: for
 * each acquirer X with releaser R, X is an ancestor of R, every ancestor of R that is not
 * X or an ancestor of X acquires nothing, and a releaser acquires nothing. Then the
 * not-yet-started task of smallest priority (priorities grow along edges) has all its
 * predecessors done; if it needs a unit it is next in its pool's grant order, and if all
 * units are held, the releaser of a holder has a ready ancestor-or-self that needs no
 * pool. So while anything is left, something can start: a hang is a scheduler bug.
 * Returns the number of acquirers. */
static int random_graph(fy_graph *g, uint64_t seed, probe *p) {
    uint64_t s = seed * 7919 + 17;
    int n = rng_int(&s, 20, MAX_TASKS);
    int words = (n + 63) / 64;
    uint64_t *anc = calloc((size_t)n * (size_t)words, sizeof *anc);
#define ANC(i, j) ((anc[(size_t)(i) * (size_t)words + (size_t)(j) / 64] >> ((j) % 64)) & 1)
    int(*preds)[4] = calloc((size_t)n, sizeof *preds);
    int *npred = calloc((size_t)n, sizeof *npred);
    int *lane = calloc((size_t)n, sizeof *lane), *role = calloc((size_t)n, sizeof *role);
    int *acq_pool = calloc((size_t)n, sizeof *acq_pool), *rel_of = calloc((size_t)n, sizeof *rel_of);
    for (int j = 0; j < n; j++) {
        lane[j] = rng_int(&s, 0, FY_LANE_COUNT - 1);
        acq_pool[j] = rel_of[j] = -1;
        int k = j ? rng_int(&s, 0, 3) : 0;
        for (int q = 0; q < k; q++) {
            int lo = rng_int(&s, 0, 9) < 7 ? (j > 12 ? j - 12 : 0) : 0;
            int pr = rng_int(&s, lo, j - 1);
            bool dup = false;
            for (int e = 0; e < npred[j]; e++) dup = dup || preds[j][e] == pr;
            if (dup) continue;
            preds[j][npred[j]++] = pr;
            for (int w = 0; w < words; w++)
                anc[(size_t)j * words + w] |= anc[(size_t)pr * words + w];
            anc[(size_t)j * words + pr / 64] |= 1ull << (pr % 64);
        }
    }
    int npools = rng_int(&s, 1, 3);
    fy_graph_pool(g, 1);
    for (int k = 1; k < npools; k++) fy_graph_pool(g, rng_int(&s, 1, 3));
    int *cand = malloc((size_t)n * sizeof *cand), nacq = 0;
    for (int x = 0; x < n; x++) {
        if (role[x] || rng_int(&s, 0, 9) < 4) continue;
        /* x must not lie among a pair's foreign ancestors */
        bool ok = true;
        for (int r = 0; r < n && ok; r++)
            if (rel_of[r] >= 0 && ANC(r, x) && x != rel_of[r] && !ANC(rel_of[r], x)) ok = false;
        if (!ok) continue;
        int nc = 0;
        for (int r = x + 1; r < n; r++) {
            if (role[r] || !ANC(r, x)) continue;
            bool clean = true;
            for (int i = 0; i < r && clean; i++)
                if (ANC(r, i) && i != x && !ANC(x, i) && role[i] == 1) clean = false;
            if (clean) cand[nc++] = r;
        }
        if (!nc) continue;
        int r = cand[rng_int(&s, 0, nc - 1)];
        role[x] = 1;
        role[r] = 2;
        acq_pool[x] = rng_int(&s, 0, npools - 1);
        rel_of[r] = x;
        nacq++;
    }
#undef ANC
    for (int j = 0; j < n; j++) {
        int id = add_task(g, (fy_lane)lane[j], lane[j] == FY_LANE_COMPUTE ? j : -1,
                          (double)rng_int(&s, 1, 5), p);
        cr_assert_eq(id, j);
        g->tasks[j].acquire_pool = acq_pool[j];
        g->tasks[j].release_of[0] = rel_of[j];
    }
    for (int j = 0; j < n; j++)
        for (int e = 0; e < npred[j]; e++) dep(g, preds[j][e], j);
    free(anc);
    free(preds);
    free(npred);
    free(lane);
    free(role);
    free(acq_pool);
    free(rel_of);
    free(cand);
    return nacq;
}

/* Each graph in each mode: every task once, dependencies, one task per lane (one per
 * machine in serial), units never shared. A deadlock shows as the timeout (generous:
 * the whole test takes about a second, several under ThreadSanitizer). */
Test(scheduler, random_graphs_under_the_executor, .timeout = 120) {
    int total_acq = 0, max_conc = 0;
    for (int gi = 0; gi < N_GRAPHS; gi++) {
        probe *p = probe_new(MAX_TASKS);
        p->spin_us = 5;
        fy_graph g;
        fy_graph_init(&g);
        total_acq += random_graph(&g, (uint64_t)gi, p);
        cr_assert_eq(fy_graph_prioritize(&g), FY_OK);
        for (size_t m = 0; m < sizeof all_modes / sizeof all_modes[0]; m++) {
            char what[96];
            snprintf(what, sizeof what, "graph %d (%d tasks), %s", gi, g.n,
                     fy_sched_mode_name(all_modes[m]));
            probe_reset(p, &g);
            fy_sched_result r;
            cr_assert_eq(fy_sched_execute(&g, all_modes[m], &r), FY_OK, "%s", what);
            check_execution(&g, p, &r, all_modes[m], what);
            if (all_modes[m] != FY_SCHED_SERIAL && atomic_load(&p->max_running) > max_conc)
                max_conc = atomic_load(&p->max_running);
            fy_sched_result_free(&r);
        }
        fy_graph_free(&g);
        probe_free(p);
    }
    /* the graphs must exercise the pools, and the lanes must really overlap somewhere */
    cr_assert_geq(total_acq, 5 * N_GRAPHS, "only %d acquirers in %d graphs", total_acq, N_GRAPHS);
    cr_assert_geq(max_conc, 2, "lanes never ran at once");
}

Test(scheduler, random_graphs_under_the_simulator, .timeout = 60) {
    for (int gi = 0; gi < N_GRAPHS; gi++) {
        probe *p = probe_new(MAX_TASKS);
        fy_graph g;
        fy_graph_init(&g);
        random_graph(&g, (uint64_t)gi, p);
        cr_assert_eq(fy_graph_prioritize(&g), FY_OK);
        for (size_t m = 0; m < sizeof all_modes / sizeof all_modes[0]; m++) {
            char what[96];
            snprintf(what, sizeof what, "simulated graph %d (%d tasks), %s", gi, g.n,
                     fy_sched_mode_name(all_modes[m]));
            probe_reset(p, &g);
            fy_sched_result r;
            cr_assert_eq(fy_sched_simulate(&g, all_modes[m], &r), FY_OK, "%s", what);
            cr_assert_eq(atomic_load(&p->seq), 0, "%s: the simulator called run()", what);
            check_simulation(&g, &r, all_modes[m], what);
            fy_sched_result_free(&r);
        }
        fy_graph_free(&g);
        probe_free(p);
    }
}

/* ---- 2. per-lane order ------------------------------------------------------------------ */

enum { NW = 8 };
/* Three orders of the NW cpu tasks W[0..NW-1] (ids ascending): readiness and next use. */
static const int ready_rank[NW] = {3, 6, 0, 5, 1, 7, 2, 4}; /* W[i] is the ready_rank[i]-th ready */
static const int use_rank[NW] = {5, 2, 7, 0, 4, 1, 6, 3};   /* W[i]'s next use is use_rank[i]-th */

/* Cpu task B runs first and holds the cpu lane until all W are ready (B waits, in the
 * executor, for D, which runs after the last W became ready; in the simulator B simply
 * lasts longer than the chain that readies them). H[k] on h2d readies the W of
 * ready_rank k; W[i] feeds compute task C[i] of use_pos 10 + use_rank[i]. B feeds C0
 * (use_pos 0) so it is both the earliest ready and the most urgent cpu task. */
static void lane_order_graph(fy_graph *g, probe *p, int *w, int *blocker) {
    int c0 = add_task(g, FY_LANE_COMPUTE, 0, 1.0, p);
    int b = add_task(g, FY_LANE_CPU, -1, 50.0, p);
    *blocker = b;
    dep(g, b, c0);
    int h[NW];
    for (int k = 0; k < NW; k++) {
        h[k] = add_task(g, FY_LANE_H2D, -1, 1.0, p);
        if (k) dep(g, h[k - 1], h[k]);
    }
    int d = add_task(g, FY_LANE_D2H, -1, 1.0, p);
    dep(g, h[NW - 1], d);
    for (int i = 0; i < NW; i++) w[i] = add_task(g, FY_LANE_CPU, -1, 2.0, p);
    for (int i = 0; i < NW; i++) {
        int c = add_task(g, FY_LANE_COMPUTE, 10 + use_rank[i], 1.0, p);
        dep(g, h[ready_rank[i]], w[i]);
        dep(g, w[i], c);
    }
    p->wait_flag_task[b] = true;
    p->set_flag_task[d] = true;
    cr_assert_eq(fy_graph_prioritize(g), FY_OK);
}

/* The W order (as indices into w[]) a lane order shows; checks B ran first. */
static void w_order(const fy_graph *g, const fy_sched_result *r, const int *w, int blocker,
                    int *out) {
    int ord[64], k = lane_order(g, r, FY_LANE_CPU, ord);
    cr_assert_eq(k, NW + 1);
    cr_assert_eq(ord[0], blocker, "the blocking cpu task did not run first");
    for (int j = 1; j <= NW; j++) out[j - 1] = ord[j] - w[0];
}

static void check_lane_order(bool simulate) {
    for (int m = 0; m < 2; m++) {
        fy_sched_mode mode = m ? FY_SCHED_FIFO : FY_SCHED_PRIORITY;
        probe *p = probe_new(64);
        fy_graph g;
        fy_graph_init(&g);
        int w[NW], blocker;
        lane_order_graph(&g, p, w, &blocker);
        probe_reset(p, &g);
        fy_sched_result r;
        cr_assert_eq((simulate ? fy_sched_simulate : fy_sched_execute)(&g, mode, &r), FY_OK);
        cr_assert_eq(atomic_load(&p->flag_timeouts), 0, "the W tasks never all became ready");
        int got[NW];
        w_order(&g, &r, w, blocker, got);
        for (int j = 0; j < NW; j++) {
            int want_rank = j, have = mode == FY_SCHED_PRIORITY ? use_rank[got[j]] : ready_rank[got[j]];
            cr_assert_eq(have, want_rank, "%s %s: cpu task %d is W[%d], whose %s rank is %d",
                         simulate ? "simulated" : "executed", fy_sched_mode_name(mode), j, got[j],
                         mode == FY_SCHED_PRIORITY ? "next-use" : "ready", have);
        }
        if (!simulate) check_execution(&g, p, &r, mode, "lane order");
        fy_sched_result_free(&r);
        fy_graph_free(&g);
        probe_free(p);
    }
}

/* Priority mode starts a lane's ready tasks in next-use order, fifo in ready order. */
Test(scheduler, lane_starts_ready_tasks_in_mode_order, .timeout = 30) { check_lane_order(false); }
Test(scheduler, simulated_lane_starts_ready_tasks_in_mode_order, .timeout = 30) {
    check_lane_order(true);
}

/* Serial mode: one task at a time over all lanes, the smallest priority first. Root R
 * readies W[i] (spread over the three non-compute lanes), each feeding C[i] of use_pos
 * 1 + use_rank[i]: the order is R, then W, C pairs by next use. */
static void check_serial_order(bool simulate) {
    probe *p = probe_new(64);
    fy_graph g;
    fy_graph_init(&g);
    int root = add_task(&g, FY_LANE_COMPUTE, 0, 1.0, p), w[NW], c[NW];
    for (int i = 0; i < NW; i++) w[i] = add_task(&g, (fy_lane)(1 + i % 3), -1, 1.0, p);
    for (int i = 0; i < NW; i++) {
        c[i] = add_task(&g, FY_LANE_COMPUTE, 1 + use_rank[i], 1.0, p);
        dep(&g, root, w[i]);
        dep(&g, w[i], c[i]);
    }
    cr_assert_eq(fy_graph_prioritize(&g), FY_OK);
    probe_reset(p, &g);
    fy_sched_result r;
    cr_assert_eq((simulate ? fy_sched_simulate : fy_sched_execute)(&g, FY_SCHED_SERIAL, &r), FY_OK);
    cr_assert_eq(r.nrecs, 1 + 2 * NW);
    cr_assert_eq(r.recs[0].task, root);
    for (int k = 0; k < NW; k++) {
        int i = 0;
        while (use_rank[i] != k) i++;
        cr_assert_eq(r.recs[1 + 2 * k].task, w[i], "serial step %d: task %d, expected W[%d] = %d",
                     1 + 2 * k, r.recs[1 + 2 * k].task, i, w[i]);
        cr_assert_eq(r.recs[2 + 2 * k].task, c[i], "serial step %d: task %d, expected C[%d] = %d",
                     2 + 2 * k, r.recs[2 + 2 * k].task, i, c[i]);
    }
    if (!simulate) check_execution(&g, p, &r, FY_SCHED_SERIAL, "serial order");
    fy_sched_result_free(&r);
    fy_graph_free(&g);
    probe_free(p);
}

Test(scheduler, serial_runs_one_task_at_a_time_by_priority, .timeout = 30) {
    check_serial_order(false);
    check_serial_order(true);
}

/* fifo: "the task that became ready first (ties: lower id)". One end readies W[0..NW-1]
 * at once (dependencies added in descending id order, next uses descending too), so fifo
 * must start them by ascending id. In the simulator, two roots on different lanes end at
 * the same virtual time, the one on the lower lane readying the higher id. */
Test(scheduler, fifo_breaks_ready_ties_by_lower_id, .timeout = 30) {
    for (int sim = 0; sim < 2; sim++) {
        probe *p = probe_new(64);
        fy_graph g;
        fy_graph_init(&g);
        int root = add_task(&g, FY_LANE_COMPUTE, 0, 1.0, p), w[NW];
        for (int i = 0; i < NW; i++) w[i] = add_task(&g, FY_LANE_CPU, -1, 1.0, p);
        for (int i = NW - 1; i >= 0; i--) {
            dep(&g, root, w[i]);
            dep(&g, w[i], add_task(&g, FY_LANE_COMPUTE, 100 - i, 1.0, p));
        }
        cr_assert_eq(fy_graph_prioritize(&g), FY_OK);
        probe_reset(p, &g);
        fy_sched_result r;
        cr_assert_eq((sim ? fy_sched_simulate : fy_sched_execute)(&g, FY_SCHED_FIFO, &r), FY_OK);
        int ord[64], k = lane_order(&g, &r, FY_LANE_CPU, ord);
        cr_assert_eq(k, NW);
        for (int i = 0; i < NW; i++)
            cr_assert_eq(ord[i], w[i], "%s fifo: cpu task %d is %d, expected %d (ids %d..%d "
                         "became ready together)", sim ? "simulated" : "executed", i, ord[i], w[i],
                         w[0], w[NW - 1]);
        fy_sched_result_free(&r);
        fy_graph_free(&g);
        probe_free(p);
    }
    /* simulator: P0 (compute) and P1 (h2d) both end at 5 ms; P0 readies Y1, P1 readies Y0 */
    fy_graph g;
    fy_graph_init(&g);
    int p0 = add_task(&g, FY_LANE_COMPUTE, 0, 5.0, NULL), p1 = add_task(&g, FY_LANE_H2D, -1, 5.0, NULL);
    int y0 = add_task(&g, FY_LANE_CPU, -1, 1.0, NULL), y1 = add_task(&g, FY_LANE_CPU, -1, 1.0, NULL);
    dep(&g, p0, y1);
    dep(&g, p1, y0);
    cr_assert_eq(fy_graph_prioritize(&g), FY_OK);
    fy_sched_result r;
    cr_assert_eq(fy_sched_simulate(&g, FY_SCHED_FIFO, &r), FY_OK);
    int ord[4];
    cr_assert_eq(lane_order(&g, &r, FY_LANE_CPU, ord), 2);
    cr_assert_eq(ord[0], y0, "simulated fifo: cpu started %d first, expected %d (both ready "
                 "at 5 ms)", ord[0], y0);
    fy_sched_result_free(&r);
    fy_graph_free(&g);
}

/* ---- 3. next-use priorities ---------------------------------------------------------------- */

/* A ruler of standalone compute tasks at use_pos 0..20 brackets each task's inherited
 * next use u: ruler[u-1] < task < ruler[u+1]; and a task precedes what it feeds. */
Test(scheduler, non_compute_task_inherits_earliest_next_use) {
    fy_graph g;
    fy_graph_init(&g);
    int ruler[21];
    for (int u = 0; u <= 20; u++) ruler[u] = add_task(&g, FY_LANE_COMPUTE, u, 1.0, NULL);
    int c3 = add_task(&g, FY_LANE_COMPUTE, 3, 1.0, NULL);
    int c5 = add_task(&g, FY_LANE_COMPUTE, 5, 1.0, NULL);
    int c9 = add_task(&g, FY_LANE_COMPUTE, 9, 1.0, NULL);
    int h = add_task(&g, FY_LANE_H2D, -1, 1.0, NULL);   /* feeds c5 and c3: next use 3 */
    int k = add_task(&g, FY_LANE_CPU, -1, 1.0, NULL);   /* feeds c9 and h: 3 */
    int m = add_task(&g, FY_LANE_D2H, -1, 1.0, NULL);   /* feeds c9 only: 9 */
    int lone = add_task(&g, FY_LANE_CPU, -1, 1.0, NULL);/* feeds nothing: after everything */
    dep(&g, h, c5);
    dep(&g, h, c3);
    dep(&g, k, c9);
    dep(&g, k, h);
    dep(&g, m, c9);
    cr_assert_eq(fy_graph_prioritize(&g), FY_OK);
    const fy_task *t = g.tasks;
#define BRACKETS(id, u)                                                                     \
    cr_assert(t[ruler[(u) - 1]].prio < t[id].prio && t[id].prio < t[ruler[(u) + 1]].prio,   \
              "task %d: prio %lld not between next use %d and %d (%lld, %lld)", id,         \
              (long long)t[id].prio, (u) - 1, (u) + 1, (long long)t[ruler[(u) - 1]].prio,   \
              (long long)t[ruler[(u) + 1]].prio)
    BRACKETS(c3, 3);
    BRACKETS(c5, 5);
    BRACKETS(c9, 9);
    BRACKETS(h, 3);
    BRACKETS(k, 3);
    BRACKETS(m, 9);
#undef BRACKETS
    cr_assert_lt(t[h].prio, t[c3].prio);
    cr_assert_lt(t[k].prio, t[h].prio);
    cr_assert_lt(t[m].prio, t[c9].prio);
    for (int i = 0; i < g.n; i++)
        if (i != lone) cr_assert_lt(t[i].prio, t[lone].prio, "task %d after the lone task", i);
    /* priorities are distinct: grants and picks never tie */
    for (int i = 0; i < g.n; i++)
        for (int j = i + 1; j < g.n; j++) cr_assert_neq(t[i].prio, t[j].prio);
    fy_graph_free(&g);
}

/* Two iterations of a B-block step: fwd(b), bwd(b) (compute, program order), then per
 * block a gradient copy (d2h), a CPU Adam step (cpu) and an update copy (h2d) that the
 * next iteration's fwd(b) waits for. Backward readies block B-1's gradient first, but
 * block 0 is needed first next: its copy and Adam step must rank first. */
enum { NB = 4 };
typedef struct step_ids { int fwd[2][NB], bwd[NB], d2h[NB], adam[NB], h2d[NB]; } step_ids;

static void step_graph(fy_graph *g, step_ids *s) {
    int64_t pos = 0;
    for (int b = 0; b < NB; b++) {
        s->fwd[0][b] = add_task(g, FY_LANE_COMPUTE, pos++, 2.0, NULL);
        if (b) dep(g, s->fwd[0][b - 1], s->fwd[0][b]);
    }
    for (int b = NB - 1; b >= 0; b--) {
        s->bwd[b] = add_task(g, FY_LANE_COMPUTE, pos++, 2.0, NULL);
        dep(g, b == NB - 1 ? s->fwd[0][b] : s->bwd[b + 1], s->bwd[b]);
        dep(g, s->fwd[0][b], s->bwd[b]);
    }
    for (int b = NB - 1; b >= 0; b--) {
        s->d2h[b] = add_task(g, FY_LANE_D2H, -1, 1.0, NULL);
        s->adam[b] = add_task(g, FY_LANE_CPU, -1, 4.0, NULL);
        s->h2d[b] = add_task(g, FY_LANE_H2D, -1, 1.0, NULL);
        dep(g, s->bwd[b], s->d2h[b]);
        dep(g, s->d2h[b], s->adam[b]);
        dep(g, s->adam[b], s->h2d[b]);
    }
    for (int b = 0; b < NB; b++) {
        s->fwd[1][b] = add_task(g, FY_LANE_COMPUTE, pos++, 2.0, NULL);
        dep(g, b ? s->fwd[1][b - 1] : s->bwd[0], s->fwd[1][b]);
        dep(g, s->h2d[b], s->fwd[1][b]);
    }
    cr_assert_eq(fy_graph_prioritize(g), FY_OK);
}

Test(scheduler, next_use_orders_optimizer_work_across_iterations) {
    fy_graph g;
    fy_graph_init(&g);
    step_ids s;
    step_graph(&g, &s);
    const fy_task *t = g.tasks;
    for (int b = 0; b < NB; b++) {
        if (b + 1 < NB) {
            cr_assert_lt(t[s.d2h[b]].prio, t[s.d2h[b + 1]].prio, "d2h(%d) after d2h(%d)", b, b + 1);
            cr_assert_lt(t[s.adam[b]].prio, t[s.adam[b + 1]].prio, "adam(%d) after adam(%d)", b, b + 1);
            cr_assert_lt(t[s.h2d[b]].prio, t[s.h2d[b + 1]].prio, "h2d(%d) after h2d(%d)", b, b + 1);
            /* adam(b+1) is needed only after the next fwd(b) */
            cr_assert_gt(t[s.adam[b + 1]].prio, t[s.fwd[1][b]].prio, "adam(%d) before fwd1(%d)",
                         b + 1, b);
        }
        cr_assert_lt(t[s.adam[b]].prio, t[s.fwd[1][b]].prio);
        cr_assert_lt(t[s.h2d[b]].prio, t[s.fwd[1][b]].prio);
        cr_assert_gt(t[s.adam[b]].prio, t[s.bwd[0]].prio, "adam(%d) before the last backward", b);
    }
    /* In the simulator the next iteration's fwd(0) overlaps this one's Adam in priority
     * mode; fifo runs Adam in gradient order (B-1 first), so fwd(0) waits for all of it. */
    fy_sched_result r;
    double st[64], en[64];
    cr_assert_eq(fy_sched_simulate(&g, FY_SCHED_PRIORITY, &r), FY_OK);
    check_records(&g, &r, st, en, "priority");
    double last_adam = 0.0;
    for (int b = 0; b < NB; b++) last_adam = en[s.adam[b]] > last_adam ? en[s.adam[b]] : last_adam;
    cr_assert_lt(st[s.fwd[1][0]], last_adam, "priority: fwd1(0) at %g, Adam done at %g",
                 st[s.fwd[1][0]], last_adam);
    fy_sched_result_free(&r);
    cr_assert_eq(fy_sched_simulate(&g, FY_SCHED_FIFO, &r), FY_OK);
    check_records(&g, &r, st, en, "fifo");
    for (int b = 0; b < NB; b++)
        cr_assert_geq(st[s.fwd[1][0]], en[s.adam[b]], "fifo: fwd1(0) at %g before adam(%d) ended",
                      st[s.fwd[1][0]], b);
    fy_sched_result_free(&r);
    fy_graph_free(&g);
}

/* A cycle is refused by prioritize, the executor and the simulator (no hang). */
Test(scheduler, cycle_is_refused, .timeout = 10) {
    fy_log_set_level(FY_LOG_QUIET);
    probe *p = probe_new(8);
    fy_graph g;
    fy_graph_init(&g);
    int root = add_task(&g, FY_LANE_COMPUTE, 0, 1.0, p);
    int a = add_task(&g, FY_LANE_H2D, -1, 1.0, p), b = add_task(&g, FY_LANE_CPU, -1, 1.0, p),
        c = add_task(&g, FY_LANE_COMPUTE, 1, 1.0, p);
    dep(&g, root, a);
    dep(&g, a, b);
    dep(&g, b, c);
    dep(&g, c, a);
    cr_assert_eq(fy_graph_prioritize(&g), FY_ERR_INVALID);
    for (size_t m = 0; m < sizeof all_modes / sizeof all_modes[0]; m++) {
        fy_sched_result r;
        probe_reset(p, &g);
        cr_assert_eq(fy_sched_execute(&g, all_modes[m], &r), FY_ERR_INVALID);
        cr_assert_eq(atomic_load(&p->runs[root]), 1, "the task outside the cycle did not run");
        cr_assert_eq(atomic_load(&p->runs[a]) + atomic_load(&p->runs[b]) + atomic_load(&p->runs[c]), 0);
        fy_sched_result_free(&r);
        cr_assert_eq(fy_sched_simulate(&g, all_modes[m], &r), FY_ERR_INVALID);
        fy_sched_result_free(&r);
    }
    fy_graph_free(&g);
    probe_free(p);
}

/* ---- 4. the simulator reproduces the executor ------------------------------------------------ */

/* 16 tasks sleeping 3..30 ms (multiples of 3), random lanes and edges. The seed is the
 * first from a fixed start whose simulated schedules (priority and fifo) have all task
 * ends at distinct times, and whose priority and fifo orders differ on some lane: then
 * every decision happens at least 3 ms away from any other event, much more than the
 * executor's drift (wake-ups and sleep overshoot, tens of microseconds per task), and
 * the comparison shows the executor follows the mode, not just the graph. */
enum { NT4 = 16 };

static void timed_graph(fy_graph *g, uint64_t seed, probe *p) {
    uint64_t s = seed;
    for (int j = 0; j < NT4; j++) {
        fy_lane lane = (fy_lane)rng_int(&s, 0, FY_LANE_COUNT - 1);
        add_task(g, lane, lane == FY_LANE_COMPUTE ? j : -1, 3.0 * rng_int(&s, 1, 10), p);
        int k = j ? rng_int(&s, 0, 2) : 0;
        for (int q = 0; q < k; q++) dep(g, rng_int(&s, 0, j - 1), j);
    }
    cr_assert_eq(fy_graph_prioritize(g), FY_OK);
}

static bool distinct_ends(const fy_sched_result *r) {
    for (int i = 0; i < r->nrecs; i++)
        for (int j = i + 1; j < r->nrecs; j++)
            if (r->recs[i].end_ms == r->recs[j].end_ms) return false;
    return true;
}

static bool same_lane_orders(const fy_graph *g, const fy_sched_result *a, const fy_sched_result *b,
                             char *why, size_t cap) {
    for (int l = 0; l < FY_LANE_COUNT; l++) {
        int oa[NT4], ob[NT4];
        int na = lane_order(g, a, (fy_lane)l, oa), nb = lane_order(g, b, (fy_lane)l, ob);
        if (na != nb) { snprintf(why, cap, "%s: %d vs %d tasks", fy_lane_name(l), na, nb); return false; }
        for (int i = 0; i < na; i++)
            if (oa[i] != ob[i]) {
                snprintf(why, cap, "%s: position %d is task %d vs %d", fy_lane_name(l), i, oa[i], ob[i]);
                return false;
            }
    }
    return true;
}

/* One run of the executor against the simulator: the same order on every lane, both
 * against the nominal costs and against a replay of the durations the run measured (which
 * takes sleep overshoot out of the comparison, leaving only the rules), and a makespan
 * and lane busy times near the simulated ones. Sleeps never end early, so the executor is
 * never faster; each task on the critical path (at most 16) adds a wake-up and a sleep
 * overshoot, about 0.1 ms each on a quiet machine, so 15% + 5 ms covers them with room.
 * On a loaded 2-core machine one sleep was seen to overrun by 5 ms, enough to reorder
 * events 3 ms apart: a disagreement is retried (MAX_TRIES runs), since noise does not
 * repeat and a difference in the rules does. Returns false with the reason in why. */
enum { MAX_TRIES = 4 };
static bool executor_matches(fy_graph *g, probe *p, fy_sched_mode mode, char *why, size_t cap) {
    fy_sched_result sim, ex, replay;
    cr_assert_eq(fy_sched_simulate(g, mode, &sim), FY_OK);
    probe_reset(p, g);
    cr_assert_eq(fy_sched_execute(g, mode, &ex), FY_OK);
    check_execution(g, p, &ex, mode, "timed graph");
    double cost[NT4];
    for (int i = 0; i < g->n; i++) cost[i] = g->tasks[i].cost_ms;
    for (int i = 0; i < ex.nrecs; i++)
        g->tasks[ex.recs[i].task].cost_ms = ex.recs[i].end_ms - ex.recs[i].start_ms;
    cr_assert_eq(fy_sched_simulate(g, mode, &replay), FY_OK);
    for (int i = 0; i < g->n; i++) g->tasks[i].cost_ms = cost[i];
    char w[128];
    bool ok = true;
    if (!same_lane_orders(g, &replay, &ex, w, sizeof w)) {
        snprintf(why, cap, "orders differ from a replay of the measured durations (%s)", w);
        ok = false;
    } else if (!same_lane_orders(g, &sim, &ex, w, sizeof w)) {
        snprintf(why, cap, "orders differ from the simulation (%s)", w);
        ok = false;
    } else if (ex.makespan_ms < sim.makespan_ms - 0.01 || ex.makespan_ms > 1.15 * sim.makespan_ms + 5.0) {
        snprintf(why, cap, "executed in %.2f ms, simulated %.2f ms", ex.makespan_ms, sim.makespan_ms);
        ok = false;
    }
    for (int l = 0; l < FY_LANE_COUNT && ok; l++)
        if (ex.busy_ms[l] < sim.busy_ms[l] - 0.01 || ex.busy_ms[l] > 1.15 * sim.busy_ms[l] + 5.0) {
            snprintf(why, cap, "lane %s busy %.2f ms, simulated %.2f ms", fy_lane_name((fy_lane)l),
                     ex.busy_ms[l], sim.busy_ms[l]);
            ok = false;
        }
    fy_sched_result_free(&sim);
    fy_sched_result_free(&ex);
    fy_sched_result_free(&replay);
    return ok;
}

Test(scheduler, simulator_reproduces_executor_on_exact_costs, .timeout = 60) {
    uint64_t seed = 1000;
    char why[128];
    for (;; seed++) {
        cr_assert_lt(seed, 100000, "no usable seed");
        fy_graph g;
        fy_graph_init(&g);
        timed_graph(&g, seed, NULL);
        fy_sched_result rp, rf;
        cr_assert_eq(fy_sched_simulate(&g, FY_SCHED_PRIORITY, &rp), FY_OK);
        cr_assert_eq(fy_sched_simulate(&g, FY_SCHED_FIFO, &rf), FY_OK);
        bool ok = distinct_ends(&rp) && distinct_ends(&rf) &&
                  !same_lane_orders(&g, &rp, &rf, why, sizeof why);
        fy_sched_result_free(&rp);
        fy_sched_result_free(&rf);
        fy_graph_free(&g);
        if (ok) break;
    }
    probe *p = probe_new(NT4);
    p->sleep_cost = true;
    fy_graph g;
    fy_graph_init(&g);
    timed_graph(&g, seed, p);
    for (size_t m = 0; m < sizeof all_modes / sizeof all_modes[0]; m++) {
        char last[256] = "";
        bool ok = false;
        for (int k = 0; k < MAX_TRIES && !ok; k++) ok = executor_matches(&g, p, all_modes[m], last, sizeof last);
        cr_assert(ok, "seed %llu, %s: %d runs of the executor disagreed with the simulator; "
                  "the last: %s", (unsigned long long)seed, fy_sched_mode_name(all_modes[m]),
                  MAX_TRIES, last);
    }
    fy_graph_free(&g);
    probe_free(p);
}

/* ---- 5. pools ------------------------------------------------------------------------------ */

/* A 1-unit pool wanted by A[0..NA-1], spread over the three non-compute lanes and made
 * ready together (in id order) by a root; A[i] is released by R[i] on the compute lane,
 * which feeds C[i] of use_pos 1 + NA - i, so next use runs against readiness. Even in
 * fifo mode the A start in priority order: the header grants units in priority order
 * whatever the mode. */
enum { NA = 6 };
Test(scheduler, pool_grants_in_priority_order_in_every_mode, .timeout = 30) {
    for (int sim = 0; sim < 2; sim++)
        for (size_t m = 0; m < sizeof all_modes / sizeof all_modes[0]; m++) {
            probe *p = probe_new(64);
            fy_graph g;
            fy_graph_init(&g);
            int pool = fy_graph_pool(&g, 1);
            int root = add_task(&g, FY_LANE_COMPUTE, 0, 1.0, p), a[NA];
            for (int i = 0; i < NA; i++) {
                a[i] = add_task(&g, (fy_lane)(1 + i % 3), -1, 2.0, p);
                g.tasks[a[i]].acquire_pool = pool;
                dep(&g, root, a[i]);
            }
            for (int i = 0; i < NA; i++) {
                int r = add_task(&g, FY_LANE_COMPUTE, -1, 1.0, p);
                g.tasks[r].release_of[0] = a[i];
                dep(&g, a[i], r);
                dep(&g, r, add_task(&g, FY_LANE_COMPUTE, 1 + NA - i, 1.0, p));
            }
            cr_assert_eq(fy_graph_prioritize(&g), FY_OK);
            probe_reset(p, &g);
            fy_sched_result r;
            cr_assert_eq((sim ? fy_sched_simulate : fy_sched_execute)(&g, all_modes[m], &r), FY_OK);
            int k = 0;
            for (int i = 0; i < r.nrecs; i++) {
                int id = r.recs[i].task;
                if (id < a[0] || id > a[NA - 1]) continue;
                cr_assert_eq(id, a[NA - 1 - k], "%s %s: acquirer %d started %d-th, expected %d",
                             sim ? "simulated" : "executed", fy_sched_mode_name(all_modes[m]), id,
                             k, a[NA - 1 - k]);
                k++;
            }
            cr_assert_eq(k, NA);
            if (sim) check_simulation(&g, &r, all_modes[m], "pool order");
            else check_execution(&g, p, &r, all_modes[m], "pool order");
            fy_sched_result_free(&r);
            fy_graph_free(&g);
            probe_free(p);
        }
}

/* One task may release several units (release_of holds up to four): X0 and X1 take both
 * units of a 2-unit pool and X2 one of a 1-unit pool; R releases all three, then Y0, Y1
 * (2-unit pool) and Y2 (1-unit pool) get units. */
Test(scheduler, one_task_releases_several_units, .timeout = 30) {
    for (int sim = 0; sim < 2; sim++) {
        probe *p = probe_new(64);
        fy_graph g;
        fy_graph_init(&g);
        int p2 = fy_graph_pool(&g, 2), p1 = fy_graph_pool(&g, 1);
        int x[3], y[3];
        for (int i = 0; i < 3; i++) {
            x[i] = add_task(&g, (fy_lane)(1 + i), -1, 1.0, p);
            g.tasks[x[i]].acquire_pool = i < 2 ? p2 : p1;
        }
        int r = add_task(&g, FY_LANE_COMPUTE, 0, 1.0, p);
        for (int i = 0; i < 3; i++) {
            g.tasks[r].release_of[i] = x[i];
            dep(&g, x[i], r);
        }
        for (int i = 0; i < 3; i++) {
            y[i] = add_task(&g, (fy_lane)(1 + i), -1, 1.0, p);
            g.tasks[y[i]].acquire_pool = i < 2 ? p2 : p1;
            dep(&g, r, y[i]);
        }
        cr_assert_eq(fy_graph_prioritize(&g), FY_OK);
        for (size_t m = 0; m < sizeof all_modes / sizeof all_modes[0]; m++) {
            probe_reset(p, &g);
            fy_sched_result res;
            cr_assert_eq((sim ? fy_sched_simulate : fy_sched_execute)(&g, all_modes[m], &res), FY_OK);
            if (sim) check_simulation(&g, &res, all_modes[m], "several releases");
            else check_execution(&g, p, &res, all_modes[m], "several releases");
            cr_assert_neq(g.tasks[x[0]].unit, g.tasks[x[1]].unit);
            cr_assert_neq(g.tasks[y[0]].unit, g.tasks[y[1]].unit);
            fy_sched_result_free(&res);
        }
        fy_graph_free(&g);
        probe_free(p);
    }
}

/* Once the better-priority task of a pool has started, the next one may start at once if
 * a unit is free. A 2-unit pool; B (compute, next use 2) is ready from the start but must
 * wait for A (h2d, next use 1), which K (compute, 5 ms) readies. When K ends, A starts
 * on h2d and B should start on compute too, not 30 ms later when A ends. The executor's
 * path is deterministic here: the compute thread ends K, finds B blocked (A not started
 * yet) and waits; the h2d thread then starts A. */
static void grant_graph(fy_graph *g, probe *p, int *a, int *b) {
    int pool = fy_graph_pool(g, 2);
    int k = add_task(g, FY_LANE_COMPUTE, 0, 5.0, p);
    *a = add_task(g, FY_LANE_H2D, -1, 30.0, p);
    *b = add_task(g, FY_LANE_COMPUTE, 2, 30.0, p);
    g->tasks[*a].acquire_pool = g->tasks[*b].acquire_pool = pool;
    int ra = add_task(g, FY_LANE_D2H, -1, 3.0, p), rb = add_task(g, FY_LANE_D2H, -1, 3.0, p);
    g->tasks[ra].release_of[0] = *a;
    g->tasks[rb].release_of[0] = *b;
    dep(g, k, *a);
    dep(g, *a, ra);
    dep(g, *b, rb);
    dep(g, ra, add_task(g, FY_LANE_COMPUTE, 1, 3.0, p));
    cr_assert_eq(fy_graph_prioritize(g), FY_OK);
    cr_assert_lt(g->tasks[*a].prio, g->tasks[*b].prio);
}

Test(scheduler, started_grant_frees_the_next_task_at_once, .timeout = 30) {
    for (int sim = 0; sim < 2; sim++)
        for (size_t m = 0; m < 2; m++) {
            probe *p = probe_new(16);
            p->sleep_cost = true;
            fy_graph g;
            fy_graph_init(&g);
            int a, b;
            grant_graph(&g, p, &a, &b);
            probe_reset(p, &g);
            fy_sched_result r;
            double st[16], en[16];
            cr_assert_eq((sim ? fy_sched_simulate : fy_sched_execute)(&g, all_modes[m], &r), FY_OK);
            if (sim) check_simulation(&g, &r, all_modes[m], "grant");
            else check_execution(&g, p, &r, all_modes[m], "grant");
            check_records(&g, &r, st, en, "grant");
            /* sim: exactly when A starts; executor: well before A's 30 ms are over */
            cr_assert(sim ? st[b] == st[a] : st[b] < st[a] + 10.0, "%s %s: B started at %.2f ms, "
                      "A at %.2f ms (A holds the other unit until %.2f ms)",
                      sim ? "simulated" : "executed", fy_sched_mode_name(all_modes[m]), st[b],
                      st[a], en[a]);
            fy_sched_result_free(&r);
            fy_graph_free(&g);
            probe_free(p);
        }
}

/* ---- 6. graphs that cannot finish ------------------------------------------------------------ */

/* A task needing a unit of an empty pool: FY_ERR_INVALID, no hang, in every mode; what
 * does not depend on it still runs. */
Test(scheduler, empty_pool_is_refused_without_hanging, .timeout = 10) {
    fy_log_set_level(FY_LOG_QUIET);
    probe *p = probe_new(8);
    fy_graph g;
    fy_graph_init(&g);
    int pool = fy_graph_pool(&g, 0);
    int root = add_task(&g, FY_LANE_COMPUTE, 0, 1.0, p), a = add_task(&g, FY_LANE_H2D, -1, 1.0, p);
    int after = add_task(&g, FY_LANE_COMPUTE, 1, 1.0, p), other = add_task(&g, FY_LANE_CPU, -1, 1.0, p);
    g.tasks[a].acquire_pool = pool;
    g.tasks[after].release_of[0] = a;
    dep(&g, root, a);
    dep(&g, a, after);
    cr_assert_eq(fy_graph_prioritize(&g), FY_OK);
    for (size_t m = 0; m < sizeof all_modes / sizeof all_modes[0]; m++) {
        fy_sched_result r;
        probe_reset(p, &g);
        cr_assert_eq(fy_sched_execute(&g, all_modes[m], &r), FY_ERR_INVALID, "%s",
                     fy_sched_mode_name(all_modes[m]));
        cr_assert_eq(atomic_load(&p->runs[root]), 1);
        cr_assert_eq(atomic_load(&p->runs[other]), 1);
        cr_assert_eq(atomic_load(&p->runs[a]) + atomic_load(&p->runs[after]), 0);
        fy_sched_result_free(&r);
        cr_assert_eq(fy_sched_simulate(&g, all_modes[m], &r), FY_ERR_INVALID, "simulated %s",
                     fy_sched_mode_name(all_modes[m]));
        fy_sched_result_free(&r);
    }
    fy_graph_free(&g);
    probe_free(p);
}

Test(scheduler, empty_graph_finishes, .timeout = 10) {
    fy_graph g;
    fy_graph_init(&g);
    cr_assert_eq(fy_graph_prioritize(&g), FY_OK);
    for (size_t m = 0; m < sizeof all_modes / sizeof all_modes[0]; m++) {
        fy_sched_result r;
        cr_assert_eq(fy_sched_execute(&g, all_modes[m], &r), FY_OK);
        cr_assert_eq(r.nrecs, 0);
        fy_sched_result_free(&r);
        cr_assert_eq(fy_sched_simulate(&g, all_modes[m], &r), FY_OK);
        cr_assert_eq(r.nrecs, 0);
        cr_assert_eq(r.makespan_ms, 0.0);
        fy_sched_result_free(&r);
    }
    fy_graph_free(&g);
}

/* ---- 7. trace ---------------------------------------------------------------------------------- */

static const char *kind_names[FY_LANE_COUNT] = {"fwd", "h2d_param", "d2h_grad", "adam_cpu", "reduce"};
static const char *kind_name(int kind) { return kind_names[kind]; } /* kinds are lanes here */

/* The file parses as JSON; it names the process (label), has one thread_name per lane
 * (tid = lane) and one complete ("X") event per record of each run appended, in order,
 * named "<kind>(<block>) it <iter + iter_offset>", on its task's lane, at its record's
 * times shifted by the run's offset (microseconds). */
typedef struct trace_run { const fy_sched_result *r; double offset_ms; int iter_offset; } trace_run;

static void check_trace(const fy_graph *g, const trace_run *runs, int nruns, const char *path,
                        const char *label) {
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "no trace at %s", path);
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = calloc((size_t)len + 1, 1);
    cr_assert_eq(fread(text, 1, (size_t)len, f), (size_t)len);
    fclose(f);
    cJSON *root = cJSON_Parse(text);
    const char *err = cJSON_GetErrorPtr();
    cr_assert_not_null(root, "trace is not JSON near: %.40s", err ? err : "?");
    cJSON *ev = cJSON_GetObjectItemCaseSensitive(root, "traceEvents");
    cr_assert(cJSON_IsArray(ev));
    int lanes_seen[FY_LANE_COUNT] = {0}, nproc = 0, run = 0, nx = 0;
    int *task_seen = calloc((size_t)g->n * (size_t)nruns, sizeof(int));
    cJSON *e;
    cJSON_ArrayForEach(e, ev) {
        const char *name = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(e, "name"));
        const char *ph = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(e, "ph"));
        cr_assert(name && ph, "event without name or ph");
        cJSON *tid = cJSON_GetObjectItemCaseSensitive(e, "tid");
        cJSON *args = cJSON_GetObjectItemCaseSensitive(e, "args");
        if (!strcmp(ph, "M") && !strcmp(name, "thread_name")) {
            cr_assert(cJSON_IsNumber(tid) && tid->valueint >= 0 && tid->valueint < FY_LANE_COUNT);
            lanes_seen[tid->valueint]++;
            const char *lname = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(args, "name"));
            cr_assert(lname && !strcmp(lname, fy_lane_name((fy_lane)tid->valueint)),
                      "row %d is named %s", tid->valueint, lname ? lname : "(none)");
        } else if (!strcmp(ph, "M") && !strcmp(name, "process_name")) {
            const char *pname = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(args, "name"));
            cr_assert(pname && !strcmp(pname, label), "process named %s", pname ? pname : "(none)");
            nproc++;
        } else if (!strcmp(ph, "X")) {
            while (run < nruns && nx == runs[run].r->nrecs) { run++; nx = 0; }
            cr_assert_lt(run, nruns, "more events than records");
            const trace_run *tr = &runs[run];
            const fy_trace_rec *rec = &tr->r->recs[nx];
            const fy_task *t = &g->tasks[rec->task];
            char want[64];
            snprintf(want, sizeof want, "%s(%d) it %d", kind_name(t->kind), t->block,
                     t->iter + tr->iter_offset);
            cr_assert_str_eq(name, want, "run %d event %d", run, nx);
            cr_assert(cJSON_IsNumber(tid) && tid->valueint == (int)t->lane, "%s on row %d", name,
                      tid ? tid->valueint : -1);
            double ts = cJSON_GetNumberValue(cJSON_GetObjectItemCaseSensitive(e, "ts"));
            double dur = cJSON_GetNumberValue(cJSON_GetObjectItemCaseSensitive(e, "dur"));
            /* written with 3 decimals: 1 ns */
            cr_assert_float_eq(ts, (rec->start_ms + tr->offset_ms) * 1e3, 2e-3, "%s: ts %g", name, ts);
            cr_assert_float_eq(dur, (rec->end_ms - rec->start_ms) * 1e3, 2e-3, "%s: dur %g", name, dur);
            task_seen[run * g->n + rec->task]++;
            nx++;
        } else {
            cr_assert_fail("unexpected event %s (%s)", name, ph);
        }
    }
    cr_assert_eq(nproc, 1);
    for (int l = 0; l < FY_LANE_COUNT; l++)
        cr_assert_eq(lanes_seen[l], 1, "lane %d has %d rows", l, lanes_seen[l]);
    cr_assert(run == nruns - 1 && nx == runs[nruns - 1].r->nrecs, "events stop in run %d at %d",
              run, nx);
    for (int k = 0; k < nruns; k++)
        for (int i = 0; i < g->n; i++) {
            int want = 0;
            for (int j = 0; j < runs[k].r->nrecs; j++) want += runs[k].r->recs[j].task == i;
            cr_assert_eq(task_seen[k * g->n + i], want, "run %d: task %d has %d events", k, i,
                         task_seen[k * g->n + i]);
        }
    free(task_seen);
    cJSON_Delete(root);
    free(text);
}

static void trace_graph(fy_graph *g, probe *p) {
    g->kind_name = kind_name;
    for (int i = 0; i < 24; i++) {
        fy_lane lane = (fy_lane)(i % FY_LANE_COUNT);
        fy_task t = fy_task_make(lane, (int)lane, i / 4, i % 3, probe_run, p);
        t.use_pos = lane == FY_LANE_COMPUTE ? i : -1;
        t.cost_ms = 1.0 + i % 5;
        cr_assert_eq(fy_graph_add(g, &t), i);
        if (i >= 4) dep(g, i - 4 + (i % 2), i);
    }
    cr_assert_eq(fy_graph_prioritize(g), FY_OK);
}

Test(scheduler, trace_is_chrome_json_with_a_row_per_lane, .timeout = 30) {
    char dir[] = "/tmp/ferry_sched_XXXXXX";
    cr_assert_not_null(mkdtemp(dir));
    char path[128], tmp[160];
    snprintf(path, sizeof path, "%s/trace.json", dir);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    fy_graph g;
    fy_graph_init(&g);
    probe *p = probe_new(64);
    trace_graph(&g, p);
    for (int sim = 0; sim < 2; sim++) {
        fy_sched_result r;
        probe_reset(p, &g);
        cr_assert_eq((sim ? fy_sched_simulate : fy_sched_execute)(&g, FY_SCHED_PRIORITY, &r), FY_OK);
        const char *label = sim ? "ferry (simulated)" : "ferry";
        cr_assert_eq(fy_sched_write_trace(&g, &r, path, label), FY_OK);
        trace_run one = {&r, 0.0, 0};
        check_trace(&g, &one, 1, path, label);
        cr_assert_neq(access(tmp, F_OK), 0, "the temporary file was left behind");
        fy_sched_result_free(&r);
    }
    remove(path);
    rmdir(dir);
    fy_graph_free(&g);
    probe_free(p);
}

/* A buffer of several runs (a measured step, then a simulated one after it, as the
 * trainer lays them side by side) is written as one file: each run shifted by its
 * offset, its iterations by its iter_offset. */
Test(scheduler, trace_buffer_appends_runs_at_offsets, .timeout = 30) {
    char dir[] = "/tmp/ferry_sched_XXXXXX";
    cr_assert_not_null(mkdtemp(dir));
    char path[128];
    snprintf(path, sizeof path, "%s/steps.json", dir);
    fy_graph g;
    fy_graph_init(&g);
    probe *p = probe_new(64);
    trace_graph(&g, p);
    fy_sched_result ex, sim;
    probe_reset(p, &g);
    cr_assert_eq(fy_sched_execute(&g, FY_SCHED_FIFO, &ex), FY_OK);
    cr_assert_eq(fy_sched_simulate(&g, FY_SCHED_PRIORITY, &sim), FY_OK);
    fy_trace_buf tb = {0};
    cr_assert_eq(fy_trace_append(&tb, &g, &ex, 0.0, 0), FY_OK);
    cr_assert_eq(fy_trace_append(&tb, &g, &sim, ex.makespan_ms + 0.25, 3), FY_OK);
    cr_assert_eq(tb.nevents, 2 * g.n);
    cr_assert_eq(fy_trace_save(&tb, path, "two runs"), FY_OK);
    trace_run runs[2] = {{&ex, 0.0, 0}, {&sim, ex.makespan_ms + 0.25, 3}};
    check_trace(&g, runs, 2, path, "two runs");
    fy_trace_buf_free(&tb);
    cr_assert_null(tb.text);
    fy_trace_buf_free(&tb); /* freeing twice is harmless */
    /* an empty buffer still gives a valid file with the lane rows */
    fy_sched_result none = {0};
    cr_assert_eq(fy_trace_save(&tb, path, "empty"), FY_OK);
    trace_run empty = {&none, 0.0, 0};
    check_trace(&g, &empty, 1, path, "empty");
    fy_sched_result_free(&ex);
    fy_sched_result_free(&sim);
    remove(path);
    rmdir(dir);
    fy_graph_free(&g);
    probe_free(p);
}

/* ---- failures, epochs, unit hand-over --------------------------------------------------- */

/* A task log for the failure tests: the order tasks ran in, which one fails, and the
 * order of the drain hook among them. */
typedef struct flog {
    const fy_graph *g;
    pthread_mutex_t mu;
    int order[256], n;
    int fail_id;           /* this task returns FY_ERR_IO (-1: none) */
    int fail2_id;          /* this one FY_ERR_FORMAT (-1: none) */
    int slow_id;           /* this task sleeps 20 ms first (-1: none) */
    int drains, drained_at;/* drain calls, and how many tasks had run at the first */
    int lane_waits[FY_LANE_COUNT];
} flog;

static fy_status flog_run(void *ctx, const fy_task *t) {
    flog *f = ctx;
    int id = (int)(t - f->g->tasks);
    if (id == f->slow_id) sleep_ms(20);
    pthread_mutex_lock(&f->mu);
    f->order[f->n++] = id;
    pthread_mutex_unlock(&f->mu);
    if (id == f->fail_id || id == f->fail2_id) {
        fy_log_error("planted failure");
        return id == f->fail_id ? FY_ERR_IO : FY_ERR_FORMAT;
    }
    return FY_OK;
}

static void flog_drain(void *ctx) {
    flog *f = ctx;
    pthread_mutex_lock(&f->mu);
    if (f->drains++ == 0) f->drained_at = f->n;
    pthread_mutex_unlock(&f->mu);
}

static void flog_lane_wait(void *ctx, fy_lane lane) {
    flog *f = ctx;
    pthread_mutex_lock(&f->mu);
    f->lane_waits[lane]++;
    pthread_mutex_unlock(&f->mu);
}

static int flog_add(fy_graph *g, flog *f, fy_lane lane, int epoch, int64_t use_pos) {
    fy_task t = fy_task_make(lane, 0, g->n, epoch, flog_run, f);
    t.epoch = epoch;
    t.use_pos = use_pos;
    int id = fy_graph_add(g, &t);
    cr_assert_geq(id, 0);
    return id;
}

static bool flog_ran(const flog *f, int id) {
    for (int i = 0; i < f->n; i++) if (f->order[i] == id) return true;
    return false;
}

static void flog_init(flog *f, fy_graph *g) {
    memset(f, 0, sizeof *f);
    pthread_mutex_init(&f->mu, NULL);
    f->g = g;
    f->fail_id = f->fail2_id = f->slow_id = -1;
    g->drain = flog_drain;
    g->hook_ctx = f;
}

/* Three epochs of a four-lane chain; a task of epoch 1 fails: epoch 0 runs to its end,
 * nothing of epochs 1 and 2 starts after the failure, the status is the task's, and the
 * executor ends (no hang) in every mode. */
Test(failure, cancels_its_epoch_and_the_later_ones, .timeout = 30) {
    for (int m = 0; m < 3; m++) {
        fy_graph g;
        fy_graph_init(&g);
        flog f;
        flog_init(&f, &g);
        int ids[3][4];
        for (int e = 0; e < 3; e++)
            for (int k = 0; k < 4; k++) {
                ids[e][k] = flog_add(&g, &f, (fy_lane)k, e, k == 0 ? e * 4 : -1);
                if (k) dep(&g, ids[e][k - 1], ids[e][k]);
                if (e) dep(&g, ids[e - 1][k], ids[e][k]);
            }
        f.fail_id = ids[1][1];
        cr_assert_eq(fy_graph_prioritize(&g), FY_OK);
        fy_sched_result r;
        cr_assert_eq(fy_sched_execute(&g, all_modes[m], &r), FY_ERR_IO);
        cr_expect_eq(r.failed_task, f.fail_id);
        for (int k = 0; k < 4; k++) cr_expect(flog_ran(&f, ids[0][k]), "epoch 0 task %d ran", k);
        cr_expect(!flog_ran(&f, ids[1][2]) && !flog_ran(&f, ids[2][1]),
                  "%s: tasks after the failure must not run", fy_sched_mode_name(all_modes[m]));
        cr_expect_eq(r.nrecs, f.n, "one record per task that ran");
        cr_expect_eq(f.drains, 1, "the drain hook runs once after a failure");
        fy_sched_result_free(&r);
        fy_graph_free(&g);
    }
}

/* Epoch 0 may run on after a later epoch fails: tasks of epoch 0 that are ready later
 * (behind a slow one) still run, and a unit held by the failed epoch is given back after
 * the drain hook, so an epoch-0 task that needs it is not starved. */
Test(failure, units_of_cancelled_epochs_come_back_after_the_drain, .timeout = 30) {
    fy_graph g;
    fy_graph_init(&g);
    flog f;
    flog_init(&f, &g);
    int pool = fy_graph_pool(&g, 1);
    /* epoch 1: A takes the unit (a better priority than X's), B fails, C would release it */
    int a = flog_add(&g, &f, FY_LANE_H2D, 1, 1);
    int b = flog_add(&g, &f, FY_LANE_COMPUTE, 1, 2);
    int c = flog_add(&g, &f, FY_LANE_COMPUTE, 1, 3);
    g.tasks[a].acquire_pool = pool;
    dep(&g, a, b);
    dep(&g, b, c);
    g.tasks[c].release_of[0] = a;
    /* epoch 0: slow S, then X needs the unit, Y releases it */
    int s0 = flog_add(&g, &f, FY_LANE_CPU, 0, 4);
    int x = flog_add(&g, &f, FY_LANE_D2H, 0, 5);
    int y = flog_add(&g, &f, FY_LANE_D2H, 0, 6);
    g.tasks[x].acquire_pool = pool;
    g.tasks[y].release_of[0] = x;
    dep(&g, s0, x);
    dep(&g, x, y);
    f.fail_id = b;
    f.slow_id = s0;
    cr_assert_eq(fy_graph_prioritize(&g), FY_OK);
    fy_sched_result r;
    cr_assert_eq(fy_sched_execute(&g, FY_SCHED_PRIORITY, &r), FY_ERR_IO);
    cr_expect(flog_ran(&f, a) && flog_ran(&f, x) && flog_ran(&f, y) && !flog_ran(&f, c));
    cr_expect_eq(f.drains, 1);
    int pos_x = -1;
    for (int i = 0; i < f.n; i++) if (f.order[i] == x) pos_x = i;
    cr_expect(pos_x >= f.drained_at, "X took the unit before the drain (at %d, drain at %d)",
              pos_x, f.drained_at);
    cr_expect_eq(g.tasks[x].unit_after, -1, "a unit given back after a drain has no last user");
    fy_sched_result_free(&r);
    fy_graph_free(&g);
}

/* A failure in an earlier epoch after a later epoch failed: the cancellation widens (the
 * earlier task's successors do not run), the earlier failure is the one returned, and
 * the executor drains again. */
Test(failure, a_later_failure_in_an_earlier_epoch_widens_the_cancellation, .timeout = 30) {
    fy_graph g;
    fy_graph_init(&g);
    flog f;
    flog_init(&f, &g);
    int x = flog_add(&g, &f, FY_LANE_H2D, 1, 0);    /* fails at once */
    int y = flog_add(&g, &f, FY_LANE_CPU, 0, 1);    /* fails 20 ms later */
    int z = flog_add(&g, &f, FY_LANE_COMPUTE, 0, 2);
    dep(&g, y, z);
    f.fail_id = x;
    f.fail2_id = y;
    f.slow_id = y;
    cr_assert_eq(fy_graph_prioritize(&g), FY_OK);
    fy_sched_result r;
    cr_assert_eq(fy_sched_execute(&g, FY_SCHED_PRIORITY, &r), FY_ERR_FORMAT);
    cr_expect_eq(r.failed_task, y, "the failure of the earliest epoch is the one returned");
    cr_expect(flog_ran(&f, x) && flog_ran(&f, y) && !flog_ran(&f, z),
              "a failed task's successors must not run");
    cr_expect_eq(f.drains, 2, "each widening drains again");
    fy_sched_result_free(&r);
    fy_graph_free(&g);
}

/* Dependencies never go back an epoch. */
Test(failure, a_dependency_into_an_earlier_epoch_is_refused, .timeout = 10) {
    fy_graph g;
    fy_graph_init(&g);
    flog f;
    flog_init(&f, &g);
    int a = flog_add(&g, &f, FY_LANE_COMPUTE, 1, 0), b = flog_add(&g, &f, FY_LANE_COMPUTE, 0, 1);
    dep(&g, a, b);
    cr_assert_eq(fy_graph_prioritize(&g), FY_OK);
    fy_sched_result r;
    cr_expect_eq(fy_sched_execute(&g, FY_SCHED_PRIORITY, &r), FY_ERR_INVALID);
    cr_expect(strstr(fy_last_error(), "epoch") != NULL, "%s", fy_last_error());
    fy_sched_result_free(&r);
    fy_graph_free(&g);
}

/* A unit's taker learns the task whose end freed it; free units go out oldest-freed
 * first; predecessors are listed; lane_wait runs before every pick of its lane. */
Test(scheduler, unit_hand_over_predecessors_and_lane_wait, .timeout = 10) {
    fy_graph g;
    fy_graph_init(&g);
    flog f;
    flog_init(&f, &g);
    g.lane_wait = flog_lane_wait;
    int pool = fy_graph_pool(&g, 2);
    /* on one lane, in order: t0 takes, t1 takes, t2 frees t1's, t3 frees t0's, t4 takes */
    int t[6];
    for (int i = 0; i < 6; i++) {
        t[i] = flog_add(&g, &f, FY_LANE_COMPUTE, 0, i);
        if (i) dep(&g, t[i - 1], t[i]);
    }
    g.tasks[t[0]].acquire_pool = g.tasks[t[1]].acquire_pool = g.tasks[t[4]].acquire_pool = pool;
    g.tasks[t[2]].release_of[0] = t[1];
    g.tasks[t[3]].release_of[0] = t[0];
    g.tasks[t[5]].release_of[0] = t[4];
    cr_assert_eq(g.tasks[t[3]].npred, 1);
    cr_assert_eq(g.tasks[t[3]].pred[0], t[2]);
    cr_assert_eq(fy_graph_prioritize(&g), FY_OK);
    fy_sched_result r;
    cr_assert_eq(fy_sched_execute(&g, FY_SCHED_PRIORITY, &r), FY_OK);
    cr_expect_eq(g.tasks[t[0]].unit_after, -1);
    cr_expect_eq(g.tasks[t[4]].unit_after, t[2], "t4 takes t1's unit, freed first (by t2)");
    cr_expect_eq(g.tasks[t[4]].unit, g.tasks[t[1]].unit);
    cr_expect_geq(f.lane_waits[FY_LANE_COMPUTE], 6, "lane_wait before each of the lane's picks");
    fy_sched_result_free(&r);
    fy_graph_free(&g);
}
