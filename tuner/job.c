/* job.c — a job of unlike ranks: each rank's plan and share of the step (job.h). */
#include "tuner/job.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/util.h"

#define JOB_ROUNDS 8

/* A rank's prediction for a micro-batch size and count, under its own searched plan
 * (cand -1) or under candidate plan `cand` of one_plan's; ranks of one class (the same
 * profile and budget) share them. */
typedef struct entry {
    int cls, cand, micro, count;
    bool ok;
    fy_tune_result r;
} entry;

typedef struct search {
    const fy_job_cfg *cfg;
    int *cls;                /* rank r's class: the first rank alike */
    const fy_plan *fixed;    /* one_plan's candidate in evaluation, or NULL */
    int cand;
    entry *memo;
    int nmemo, cap;
    int evaluated;
    char why[768];           /* the first rank found with no plan, and why */
} search;

fy_status fy_job_balance(const double *a, const double *b, int nranks, int total, int *n) {
    if (nranks < 1 || total < nranks || total > (int64_t)nranks * FY_PLAN_MAX_ACCUM) {
        fy_log_error("%d micro-batches a step cannot be shared by %d ranks (each takes 1 to %d)",
                     total, nranks, FY_PLAN_MAX_ACCUM);
        return FY_ERR_INVALID;
    }
    for (int r = 0; r < nranks; r++) n[r] = 1;
    for (int k = nranks; k < total; k++) {
        int best = -1;
        double bestv = INFINITY;
        for (int r = 0; r < nranks; r++) {
            const double v = a[r] + b[r] * (n[r] + 1);
            if (n[r] < FY_PLAN_MAX_ACCUM && (best < 0 || v < bestv)) {
                best = r;
                bestv = v;
            }
        }
        n[best]++;
    }
    return FY_OK;
}

void fy_job_share_links(fy_profile *const *profiles, int n) {
    fy_profile least = *profiles[0];
    for (int r = 1; r < n; r++) {
        const fy_profile *p = profiles[r];
        if (p->coll_gbps < least.coll_gbps) least.coll_gbps = p->coll_gbps;
        if (p->coll_host_gbps < least.coll_host_gbps) least.coll_host_gbps = p->coll_host_gbps;
        if (p->coll_latency_ms > least.coll_latency_ms) least.coll_latency_ms = p->coll_latency_ms;
        if (p->coll_host_latency_ms > least.coll_host_latency_ms)
            least.coll_host_latency_ms = p->coll_host_latency_ms;
    }
    for (int r = 0; r < n; r++) {
        profiles[r]->coll_gbps = least.coll_gbps;
        profiles[r]->coll_host_gbps = least.coll_host_gbps;
        profiles[r]->coll_latency_ms = least.coll_latency_ms;
        profiles[r]->coll_host_latency_ms = least.coll_host_latency_ms;
    }
}

/* Whether ranks x and y plan alike: the same profile (bytes: both come whole from a file,
 * a name or a broadcast), budget and threads, and neither has a plan of its own. */
static bool alike(const fy_job_rank *x, const fy_job_rank *y) {
    return !x->plan && !y->plan && x->device_budget == y->device_budget &&
           x->adam_threads == y->adam_threads && !memcmp(x->profile, y->profile, sizeof *x->profile);
}

static fy_tune_cfg rank_cfg(const fy_job_cfg *cfg, int r, int micro, int count) {
    const fy_job_rank *rk = &cfg->ranks[r];
    return (fy_tune_cfg){.model = cfg->model, .batch = micro * count, .micro = micro, .seq = cfg->seq,
                         .device_budget = rk->device_budget, .host_budget = cfg->host_budget,
                         .adam_threads = rk->adam_threads, .window = cfg->window, .dtype = cfg->dtype,
                         .ranks = cfg->nranks, .schedule = cfg->schedule, .tie_margin = cfg->tie_margin};
}

/* Rank r's plan predicted at its count, with the search's counts of the plan's layers
 * (recomputed, streamed, cpu-updated, speculative), as the tuner reports a point. */
static fy_status predict_plan(search *s, int r, const fy_plan *plan, int micro, int count,
                              fy_tune_result *out) {
    fy_plan p;
    FY_TRY(fy_plan_copy(plan, &p));
    p.grad_accum = count;
    const fy_tune_cfg tc = rank_cfg(s->cfg, r, micro, count);
    fy_status st = fy_tune_predict(s->cfg->ranks[r].profile, &tc, &p, out);
    fy_plan_free(&p);
    s->evaluated++;
    for (int b = 0; st == FY_OK && b < plan->nblocks; b++) {
        const fy_block_plan *bp = &plan->blocks[b];
        if (bp->layer < 0) continue;
        out->k1 += bp->acts == FY_ACTS_RECOMPUTE;
        out->k2 += bp->weights == FY_ON_HOST;
        out->k3 += bp->update == FY_UPDATE_CPU;
        out->k4 += bp->speculate;
    }
    return st;
}

/* Rank r at a micro-batch size and count: *out the memo's entry (ok false: no plan fits,
 * s->why says why for the first such rank). */
static fy_status rank_at(search *s, int r, int micro, int count, const entry **out) {
    const fy_job_cfg *cfg = s->cfg;
    const fy_plan *given = s->fixed ? s->fixed : cfg->ranks[r].plan;
    const int cls = given && !s->fixed ? r : s->cls[r];
    for (int i = 0; i < s->nmemo; i++) {
        const entry *e = &s->memo[i];
        if (e->cls == cls && e->cand == s->cand && e->micro == micro && e->count == count) {
            *out = e;
            return FY_OK;
        }
    }
    if (s->nmemo == s->cap) {
        const int ncap = s->cap ? 2 * s->cap : 32;
        entry *m = realloc(s->memo, (size_t)ncap * sizeof *m);
        if (!m) return FY_ERR_NOMEM;
        s->memo = m;
        s->cap = ncap;
    }
    entry *e = &s->memo[s->nmemo];
    *e = (entry){.cls = cls, .cand = s->cand, .micro = micro, .count = count};
    if (given) {
        FY_TRY(predict_plan(s, r, given, micro, count, &e->r));
        e->ok = true;
    } else {
        const fy_tune_cfg tc = rank_cfg(cfg, r, micro, count);
        int n = 0, ne = 0;
        const fy_log_level lvl = fy_log_get_level();
        fy_log_set_level(FY_LOG_QUIET); /* a size that fits no plan is a result, not an error */
        const fy_status st = fy_tune(cfg->ranks[r].profile, &tc, &e->r, 1, &n, &ne);
        fy_log_set_level(lvl);
        s->evaluated += ne;
        if (st == FY_ERR_NOMEM) return st;
        e->ok = st == FY_OK && n == 1;
        if (!e->ok && !s->why[0]) {
            char b[32];
            snprintf(s->why, sizeof s->why, "rank %d (device budget %s, %s): %s", r,
                     fy_fmt_size(cfg->ranks[r].device_budget, b, sizeof b),
                     cfg->ranks[r].profile->name, fy_last_error());
        }
    }
    s->nmemo++;
    *out = e;
    return FY_OK;
}

/* Whether the job's step (nranks x rank_batch sequences) is whole micro-batches of m
 * that the ranks can share: each at least one and at most FY_PLAN_MAX_ACCUM, and with
 * equal shares the same count each. */
static bool size_fits(const fy_job_cfg *cfg, int m) {
    const int64_t seqs = (int64_t)cfg->nranks * cfg->rank_batch, total = seqs / m;
    if (seqs % m || total < cfg->nranks || total > (int64_t)cfg->nranks * FY_PLAN_MAX_ACCUM) return false;
    return cfg->shares != FY_JOB_EQUAL || cfg->rank_batch % m == 0;
}

/* The first counts at micro-batch size m: as equal as whole micro-batches allow, the
 * remainder one each to the first ranks. */
static void first_counts(const fy_job_cfg *cfg, int m, int *n) {
    const int total = cfg->nranks * cfg->rank_batch / m;
    for (int r = 0; r < cfg->nranks; r++) n[r] = total / cfg->nranks + (r < total % cfg->nranks);
}

/* The job at one micro-batch size: the counts n (and *ms, the slowest rank's step) of
 * the best job the rounds found; *ms INFINITY when a rank has no plan at this size. */
static fy_status job_at(search *s, int micro, int *best_n, double *ms) {
    const fy_job_cfg *cfg = s->cfg;
    const int N = cfg->nranks, total = N * cfg->rank_batch / micro;
    *ms = INFINITY;
    int *n = calloc((size_t)N, sizeof *n), *seen = calloc((size_t)JOB_ROUNDS * N, sizeof *seen);
    double *a = calloc((size_t)N, sizeof *a), *b = calloc((size_t)N, sizeof *b);
    fy_status st = n && seen && a && b ? FY_OK : FY_ERR_NOMEM;
    if (st == FY_OK) first_counts(cfg, micro, n);
    for (int round = 0; st == FY_OK && round < JOB_ROUNDS; round++) {
        memcpy(&seen[round * N], n, (size_t)N * sizeof *n);
        double job = 0.0;
        bool fits = true;
        for (int r = 0; st == FY_OK && r < N && fits; r++) {
            const entry *e;
            st = rank_at(s, r, micro, n[r], &e);
            if (st == FY_OK && !e->ok) fits = false;
            if (st == FY_OK && e->ok && e->r.step_ms > job) job = e->r.step_ms;
        }
        if (st != FY_OK || !fits) break;
        if (job < *ms) {
            *ms = job;
            memcpy(best_n, n, (size_t)N * sizeof *n);
        }
        if (cfg->shares == FY_JOB_EQUAL) break;
        /* each rank's step as a + b n under the plan it has now, from one more
         * micro-batch (one fewer at the accumulation limit) */
        for (int r = 0; st == FY_OK && r < N; r++) {
            const entry *e;
            fy_tune_result near;
            const int other = n[r] < FY_PLAN_MAX_ACCUM ? n[r] + 1 : n[r] - 1;
            st = rank_at(s, r, micro, n[r], &e);
            if (st == FY_OK) st = predict_plan(s, r, &e->r.plan, micro, other, &near);
            if (st != FY_OK) break;
            fy_plan_free(&near.plan);
            const double slope = (near.step_ms - e->r.step_ms) / (other - n[r]);
            b[r] = slope > 1e-9 ? slope : 1e-9;
            a[r] = e->r.step_ms - b[r] * n[r];
        }
        if (st == FY_OK) st = fy_job_balance(a, b, N, total, n);
        bool again = true; /* counts seen before: the rounds have settled or cycle */
        for (int k = 0; st == FY_OK && k <= round && again; k++)
            if (!memcmp(&seen[k * N], n, (size_t)N * sizeof *n)) again = false;
        if (!again) break;
    }
    /* then a micro-batch at a time from the slowest rank to another, while the job gains
     * (the rounds' lines are local: a plan's step is not quite linear in its count) */
    for (int move = 0; st == FY_OK && isfinite(*ms) && cfg->shares == FY_JOB_BALANCED && move < 4 * N;
         move++) {
        memcpy(n, best_n, (size_t)N * sizeof *n);
        /* the job's step, then the sum of the ranks' (ties of the slowest step: fewer
         * ranks at it is progress) */
        double t_max = -1.0, best_max, best_sum = 0.0;
        int slow = 0, to = -1;
        for (int r = 0; st == FY_OK && r < N; r++) {
            const entry *e;
            st = rank_at(s, r, micro, n[r], &e);
            if (st == FY_OK && e->r.step_ms > t_max) { t_max = e->r.step_ms; slow = r; }
            if (st == FY_OK) best_sum += e->r.step_ms;
        }
        best_max = t_max;
        for (int q = 0; st == FY_OK && q < N && n[slow] > 1; q++) {
            if (q == slow || n[q] >= FY_PLAN_MAX_ACCUM) continue;
            n[slow]--;
            n[q]++;
            double job = 0.0, sum = 0.0;
            for (int r = 0; st == FY_OK && r < N && isfinite(job); r++) {
                const entry *e;
                st = rank_at(s, r, micro, n[r], &e);
                job = st == FY_OK && e->ok ? fmax(job, e->r.step_ms) : INFINITY;
                if (isfinite(job)) sum += e->r.step_ms;
            }
            if (job < best_max * (1.0 - 1e-9) || (job <= best_max * (1.0 + 1e-9) && sum < best_sum)) {
                best_max = job;
                best_sum = sum;
                to = q;
            }
            n[slow]++;
            n[q]--;
        }
        if (to < 0) break;
        best_n[slow]--;
        best_n[to]++;
        if (best_max < *ms) *ms = best_max;
    }
    free(n);
    free(seen);
    free(a);
    free(b);
    return st;
}

/* Over the micro-batch sizes (every size the ranks can share, or the given plans' one),
 * the best job: its size and counts into *micro and n, *ms INFINITY when none fits. */
static fy_status best_job(search *s, int fixed_micro, int *micro, int *n, double *ms) {
    const fy_job_cfg *cfg = s->cfg;
    int *cand_n = calloc((size_t)cfg->nranks, sizeof *cand_n);
    if (!cand_n) return FY_ERR_NOMEM;
    fy_status st = FY_OK;
    *ms = INFINITY;
    for (int m = 1; st == FY_OK && m <= cfg->rank_batch * cfg->nranks; m++) {
        if (!size_fits(cfg, m) || (fixed_micro && m != fixed_micro)) continue;
        double t;
        st = job_at(s, m, cand_n, &t);
        if (st == FY_OK && t < *ms) {
            *ms = t;
            *micro = m;
            memcpy(n, cand_n, (size_t)cfg->nranks * sizeof *n);
        }
    }
    free(cand_n);
    return st;
}

/* one_plan: the candidates are the best plan at the smallest budget under each class's
 * profile, at each micro-batch size; the job runs the one whose job is fastest. */
static fy_status one_plan_job(search *s, int *micro, int *n, double *ms, fy_tune_result *chosen) {
    const fy_job_cfg *cfg = s->cfg;
    const int N = cfg->nranks;
    size_t least = SIZE_MAX;
    for (int r = 0; r < N; r++)
        if (cfg->ranks[r].device_budget < least) least = cfg->ranks[r].device_budget;
    int *cn = calloc((size_t)N, sizeof *cn), *first = calloc((size_t)N, sizeof *first);
    fy_status st = cn && first ? FY_OK : FY_ERR_NOMEM;
    *ms = INFINITY;
    int ncand = 0;
    for (int m = 1; st == FY_OK && m <= cfg->rank_batch * N; m++) {
        if (!size_fits(cfg, m)) continue;
        first_counts(cfg, m, first);
        for (int r = 0; st == FY_OK && r < N; r++) {
            if (s->cls[r] != r) continue;
            fy_tune_cfg tc = rank_cfg(cfg, r, m, first[r]);
            tc.device_budget = least;
            fy_tune_result top;
            int nf = 0, ne = 0;
            const fy_log_level lvl = fy_log_get_level();
            fy_log_set_level(FY_LOG_QUIET);
            st = fy_tune(cfg->ranks[r].profile, &tc, &top, 1, &nf, &ne);
            fy_log_set_level(lvl);
            s->evaluated += ne;
            if (st == FY_ERR_INVALID || nf == 0) {
                if (!s->why[0])
                    snprintf(s->why, sizeof s->why, "one plan for every rank: %s", fy_last_error());
                st = FY_OK;
                continue;
            }
            if (st != FY_OK) break;
            s->fixed = &top.plan;
            s->cand = ++ncand;
            double t;
            st = job_at(s, m, cn, &t);
            s->fixed = NULL;
            s->cand = -1;
            if (st == FY_OK && t < *ms) {
                *ms = t;
                *micro = m;
                memcpy(n, cn, (size_t)N * sizeof *n);
                fy_plan_free(&chosen->plan);
                *chosen = top;
                st = fy_plan_copy(&top.plan, &chosen->plan);
            }
            fy_plan_free(&top.plan);
        }
    }
    free(cn);
    free(first);
    return st;
}

fy_status fy_tune_job(const fy_job_cfg *cfg, fy_job_result *out) {
    memset(out, 0, sizeof *out);
    const int N = cfg->nranks;
    FY_ASSERT(N >= 1 && cfg->rank_batch >= 1, "fy_tune_job: a job of ranks and sequences");
    int fixed_micro = 0;
    for (int r = 0; r < N; r++) {
        const fy_plan *p = cfg->ranks[r].plan;
        if (!p) continue;
        if (fixed_micro && p->micro_batch != fixed_micro) {
            fy_log_error("the ranks' plans have micro-batches of %d and %d sequences: a job's "
                         "micro-batches are one size (one process accumulating them is then "
                         "the same computation)", fixed_micro, p->micro_batch);
            return FY_ERR_INVALID;
        }
        fixed_micro = p->micro_batch;
    }
    if (fixed_micro && !size_fits(cfg, fixed_micro)) {
        fy_log_error("a job of %d ranks of %d sequences is not a whole number of the plans' "
                     "micro-batches of %d, at least one a rank", N, cfg->rank_batch, fixed_micro);
        return FY_ERR_INVALID;
    }
    /* the ranks' profiles with the job's collectives: its slowest link's */
    fy_profile *profs = calloc((size_t)N, sizeof *profs), **links = calloc((size_t)N, sizeof *links);
    fy_job_rank *ranks = calloc((size_t)N, sizeof *ranks);
    fy_job_cfg job = *cfg;
    job.ranks = ranks;
    search s = {.cfg = &job, .cand = -1};
    int *n = calloc((size_t)N, sizeof *n);
    s.cls = calloc((size_t)N, sizeof *s.cls);
    out->rank = calloc((size_t)N, sizeof *out->rank);
    fy_status st = profs && links && ranks && n && s.cls && out->rank ? FY_OK : FY_ERR_NOMEM;
    for (int r = 0; st == FY_OK && r < N; r++) {
        profs[r] = *cfg->ranks[r].profile;
        links[r] = &profs[r];
        ranks[r] = cfg->ranks[r];
        ranks[r].profile = &profs[r];
    }
    if (st == FY_OK) fy_job_share_links(links, N);
    for (int r = 0; st == FY_OK && r < N; r++) {
        s.cls[r] = r;
        for (int q = 0; q < r; q++)
            if (alike(&ranks[q], &ranks[r])) { s.cls[r] = q; break; }
    }
    out->nranks = N;
    double ms = INFINITY;
    int micro = 0;
    fy_tune_result one = {0};
    if (st == FY_OK && job.one_plan) st = one_plan_job(&s, &micro, n, &ms, &one);
    else if (st == FY_OK) st = best_job(&s, fixed_micro, &micro, n, &ms);
    if (st == FY_OK && isinf(ms)) {
        fy_log_error("no plan of the job fits: %s", s.why[0] ? s.why : "no micro-batch size cuts "
                     "its step into whole micro-batches, at least one a rank");
        st = FY_ERR_INVALID;
    }
    for (int r = 0; st == FY_OK && r < N; r++) {
        const entry *e;
        if (job.one_plan) {
            st = predict_plan(&s, r, &one.plan, micro, n[r], &out->rank[r]);
            continue;
        }
        st = rank_at(&s, r, micro, n[r], &e);
        if (st == FY_OK) {
            out->rank[r] = e->r;
            st = fy_plan_copy(&e->r.plan, &out->rank[r].plan);
        }
    }
    if (st == FY_OK) {
        out->micro = micro;
        out->step_ms = 0.0;
        for (int r = 0; r < N; r++)
            if (out->rank[r].step_ms > out->step_ms) out->step_ms = out->rank[r].step_ms;
        out->evaluated = s.evaluated;
    }
    for (int i = 0; i < s.nmemo; i++) fy_plan_free(&s.memo[i].r.plan);
    free(s.memo);
    free(s.cls);
    free(n);
    free(profs);
    free(links);
    free(ranks);
    fy_plan_free(&one.plan);
    if (st != FY_OK) fy_job_result_free(out);
    return st;
}

void fy_job_result_free(fy_job_result *r) {
    if (!r->rank) return;
    for (int i = 0; i < r->nranks; i++) fy_plan_free(&r->rank[i].plan);
    free(r->rank);
    r->rank = NULL;
}
