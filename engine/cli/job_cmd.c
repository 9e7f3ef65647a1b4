/* job_cmd.c — a job whose ranks differ: ferry tune's report of one, and a training job's
 * plans and shares (job_cmd.h). */
#include "engine/cli/job_cmd.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/cli/tune_cmd.h"
#include "engine/core/util.h"
#include "tuner/job.h"

/* The job's table: a row per rank, its machine, budget, plan (the tuner's counts:
 * recomputed, streamed, cpu-optimised layers), micro-batches and predictions. */
static void print_job(const fy_job_cfg *cfg, const fy_job_result *r) {
    printf("%-4s %-28s %10s %5s %6s %7s %-7s %10s %11s %11s\n", "rank", "machine", "budget", "ckpt",
           "stream", "cpu-opt", "micro", "ms/step", "device", "host");
    for (int i = 0; i < r->nranks; i++) {
        const fy_tune_result *t = &r->rank[i];
        char b[32], d[32], h[32];
        printf("%-4d %-28.28s %10s %5d %6d %7d %dx%-5d %10.1f %11s %11s\n", i,
               cfg->ranks[i].profile->name, fy_fmt_size(cfg->ranks[i].device_budget, b, sizeof b),
               t->k1, t->k2, t->k3, t->plan.micro_batch, t->plan.grad_accum, t->step_ms,
               fy_fmt_size(t->mem.device_total, d, sizeof d), fy_fmt_size(t->mem.host_total, h, sizeof h));
    }
}

/* ---- ferry tune: a job's report ------------------------------------------------------ */

bool fy_tune_is_job(const fy_opts *o) {
    return (o->profile && fy_opts_list_count(o->profile) > 1) || o->gpu_mem_list;
}

/* The job's size: the lists' length (they agree), --ranks when given (it agrees too). */
static fy_status job_size(const fy_opts *o, int *n) {
    const int np = o->profile ? fy_opts_list_count(o->profile) : 1;
    const int nm = o->gpu_mem_list ? fy_opts_list_count(o->gpu_mem_list) : 1;
    *n = np > nm ? np : nm;
    if (np > 1 && nm > 1 && np != nm) {
        fy_log_error("--profile gives %d ranks and --gpu-mem %d: one per rank each, or one for "
                     "every rank", np, nm);
        return FY_ERR_USAGE;
    }
    if (fy_opts_given(o, "ranks") && o->ranks != *n) {
        fy_log_error("--ranks %lld: --%s gives %d ranks", (long long)o->ranks,
                     np > 1 ? "profile" : "gpu-mem", *n);
        return FY_ERR_USAGE;
    }
    return FY_OK;
}

/* Rank r's profile and budget for ferry tune: its --profile entry (else this machine's
 * profile of a job of n, as one process's tune finds it), its --gpu-mem entry (else the
 * profile's device). */
static fy_status tune_rank(const fy_opts *o, const fy_model *m, int n, int r, fy_profile *p,
                           fy_job_rank *rk) {
    char item[4096];
    fy_opts ro = *o;
    ro.ranks = n;
    if (o->profile) {
        FY_TRY(fy_opts_rank_item("profile", o->profile, n, r, item, sizeof item));
        FY_TRY(fy_profile_open(item, p));
    } else { /* this machine's probe of a job of n */
        const fy_log_level lvl = fy_log_get_level();
        fy_log_set_level(FY_LOG_QUIET);
        const fy_status st = fy_tune_auto_profile(&ro, m, p);
        fy_log_set_level(lvl);
        if (st != FY_OK) {
            fy_log_error("a job's tune takes each rank's machine from --profile P0,P1,... (files "
                         "or names: %s), or one for every rank, or this machine's probe of %d "
                         "ranks (mpirun -np %d ferry probe), which is not cached", fy_profile_names(),
                         n, n);
            return FY_ERR_USAGE;
        }
    }
    if (!(p->coll_gbps > 0)) {
        fy_log_error("profile %s has no figure for the collectives between a job's ranks: probe "
                     "under the launcher (mpirun -np %d ferry probe), or use a named profile",
                     p->name, n);
        return FY_ERR_INVALID;
    }
    if (o->gpu_mem_list) {
        FY_TRY(fy_opts_rank_item("gpu-mem", o->gpu_mem_list, n, r, item, sizeof item));
        fy_parse_size(item, &ro.gpu_mem); /* the parser checked every entry */
    }
    const fy_tune_cfg tc = fy_tune_cfg_of(&ro, m, p);
    *rk = (fy_job_rank){.profile = p, .device_budget = tc.device_budget, .adam_threads = tc.adam_threads};
    return FY_OK;
}

int fy_tune_job_main(const fy_opts *o, const fy_model *m) {
    int n;
    if (job_size(o, &n) != FY_OK) return 2;
    if (o->out || o->trace) {
        fy_log_error("--%s: a job's tune prints each rank's plan and writes no file (train --plan "
                     "auto under the launcher plans the job on its machines)", o->out ? "out" : "trace");
        return 2;
    }
    fy_profile *profs = calloc((size_t)n, sizeof *profs);
    fy_job_rank *ranks = calloc((size_t)n, sizeof *ranks);
    fy_status st = profs && ranks ? FY_OK : FY_ERR_NOMEM;
    for (int r = 0; st == FY_OK && r < n; r++) st = tune_rank(o, m, n, r, &profs[r], &ranks[r]);
    fy_job_cfg cfg = {.model = m, .seq = (int)o->seq, .rank_batch = (int)o->batch, .nranks = n,
                      .ranks = ranks, .host_budget = o->host_mem,
                      .dtype = fy_opts_dtype(o, fy_opts_dev_kind(o)), .window = 20,
                      .schedule = fy_opts_schedule(o), .tie_margin = FY_TUNE_TIE_MARGIN};
    /* the pick, then the jobs it is held against */
    static const struct { bool one; fy_job_shares shares; const char *label; } jobs[] = {
        {false, FY_JOB_BALANCED, "each rank its own plan, shares balanced (the pick)"},
        {false, FY_JOB_EQUAL, "each rank its own plan, equal shares"},
        {true, FY_JOB_BALANCED, "one plan for every rank, shares balanced"},
        {true, FY_JOB_EQUAL, "one plan for every rank (the best within the least budget), equal shares"},
    };
    fy_job_result res[4] = {{0}};
    const double t0 = fy_now_ms();
    int evaluated = 0;
    for (int j = 0; st == FY_OK && j < 4; j++) {
        cfg.one_plan = jobs[j].one;
        cfg.shares = jobs[j].shares;
        st = fy_tune_job(&cfg, &res[j]);
        if (st == FY_OK) evaluated += res[j].evaluated;
    }
    if (st == FY_OK && !o->quiet) {
        printf("tune    a job of %d ranks, %lld sequences of %lld tokens a step (%lld a rank with equal "
               "shares), one micro-batch size for every rank; %d rank plans searched or predicted "
               "in %.1f s\n", n, (long long)o->batch * n, (long long)o->seq, (long long)o->batch,
               evaluated, (fy_now_ms() - t0) / 1e3);
        for (int j = 0; j < 4; j++) {
            printf("%s%s: %.1f ms/step (the slowest rank's)", j ? "\n" : "", jobs[j].label,
                   res[j].step_ms);
            if (j) printf(", %.2fx the pick's", res[j].step_ms / res[0].step_ms);
            printf("\n");
            print_job(&cfg, &res[j]);
        }
    } else if (st == FY_OK) {
        print_job(&cfg, &res[0]);
    }
    for (int j = 0; j < 4; j++) fy_job_result_free(&res[j]);
    free(profs);
    free(ranks);
    return st == FY_OK ? 0 : st == FY_ERR_USAGE ? 2 : 1;
}

/* ---- a training job ---------------------------------------------------------------- */

/* What the search takes of a rank, as every rank sends it (bytes: one binary). */
typedef struct rank_info {
    fy_profile profile;
    uint64_t device_budget;
    int32_t adam_threads;
    int32_t micro, accum, prefetch, dtype; /* its own plan's */
} rank_info;

/* A plan of m from the wire: the header and block table rank 0 sent. */
static fy_status plan_from(const fy_model *m, int micro, int accum, int prefetch, int dtype,
                           const fy_block_plan *blocks, fy_plan *out) {
    FY_TRY(fy_plan_new(m, micro, accum, out));
    out->prefetch = prefetch;
    out->dtype = (fy_dtype)dtype;
    memcpy(out->blocks, blocks, (size_t)out->nblocks * sizeof *blocks);
    return FY_OK;
}

/* Rank 0's part: the search over every rank's info (and, when the plans are given, their
 * block tables), printed; counts[r] and, searched, plans[r] for every rank. */
static fy_status search_job(const fy_opts *o, const fy_model *m, int world, const rank_info *all,
                            const fy_block_plan *tables, bool search, bool balance, int32_t *counts,
                            fy_job_result *res) {
    const int nb = fy_model_nblocks(m);
    fy_job_rank *ranks = calloc((size_t)world, sizeof *ranks);
    fy_plan *given = calloc((size_t)world, sizeof *given);
    fy_status st = ranks && given ? FY_OK : FY_ERR_NOMEM;
    for (int r = 0; st == FY_OK && r < world; r++) {
        ranks[r] = (fy_job_rank){.profile = &all[r].profile, .device_budget = all[r].device_budget,
                                 .adam_threads = all[r].adam_threads};
        if (search) continue;
        if (all[r].accum != all[0].accum) {
            fy_log_error("--batch-shares auto shares the micro-batches of equal shares: rank 0's "
                         "plan accumulates %d a step, rank %d's %d (give every rank the same "
                         "--grad-accum)", all[0].accum, r, all[r].accum);
            st = FY_ERR_USAGE;
            break;
        }
        st = plan_from(m, all[r].micro, all[r].accum, all[r].prefetch, all[r].dtype,
                       &tables[(size_t)r * nb], &given[r]);
        ranks[r].plan = &given[r];
    }
    const fy_job_cfg cfg = {.model = m, .seq = (int)o->seq, .nranks = world, .ranks = ranks,
                            .rank_batch = search ? (int)(o->batch * o->grad_accum)
                                                 : all[0].micro * all[0].accum,
                            .host_budget = o->host_mem, .dtype = fy_opts_dtype(o, fy_opts_dev_kind(o)),
                            .shares = balance ? FY_JOB_BALANCED : FY_JOB_EQUAL, .window = 20,
                            .schedule = fy_opts_schedule(o), .tie_margin = FY_TUNE_TIE_MARGIN};
    if (st == FY_OK) st = fy_tune_job(&cfg, res);
    for (int r = 0; st == FY_OK && r < world; r++) counts[r] = res->rank[r].plan.grad_accum;
    if (st == FY_OK && !o->quiet) {
        printf("job     %d ranks, each %s; micro-batches of %d x %lld; predicted %.1f ms a step "
               "(its slowest rank's)\n", world, search ? "its own plan from its own budget and machine"
               : "with its plan", res->micro, (long long)o->seq, res->step_ms);
        print_job(&cfg, res);
        if (balance) {
            printf("shares  micro-batches of %d x %lld by rank:", res->micro, (long long)o->seq);
            for (int r = 0; r < world; r++) printf(" %d", counts[r]);
            printf(" (auto: the predicted steps balanced)\n");
        }
    }
    for (int r = 0; given && r < world; r++) fy_plan_free(&given[r]);
    free(given);
    free(ranks);
    return st;
}

/* This rank's info and block table into all[rank] and tables, from its profile. */
static fy_status rank_info_of(const fy_opts *o, const fy_model *m, fy_comm *comm,
                              const double *slowdown, const fy_plan *plan, rank_info *mine,
                              fy_block_plan *table) {
    FY_TRY(fy_tune_rank_profile(o, m, comm, &mine->profile));
    if (slowdown) fy_profile_slow(&mine->profile, slowdown[fy_comm_rank(comm)]);
    const fy_tune_cfg tc = fy_tune_cfg_of(o, m, &mine->profile);
    mine->device_budget = tc.device_budget;
    mine->adam_threads = tc.adam_threads;
    mine->micro = plan->micro_batch;
    mine->accum = plan->grad_accum;
    mine->prefetch = plan->prefetch;
    mine->dtype = (int32_t)plan->dtype;
    memcpy(table, plan->blocks, (size_t)plan->nblocks * sizeof *table);
    return FY_OK;
}

fy_status fy_job_plans(const fy_opts *o, const fy_model *m, fy_comm *comm, const double *slowdown,
                       bool search, bool balance, fy_plan *plan) {
    const int world = fy_comm_size(comm), rank = fy_comm_rank(comm), nb = fy_model_nblocks(m);
    rank_info *all = calloc((size_t)world, sizeof *all);
    fy_block_plan *tables = calloc((size_t)world * nb, sizeof *tables);
    /* rank 0's answer: the micro-batch size, each rank's count, then each rank's prefetch
     * and storage type */
    const size_t nmsg = (size_t)world * 3 + 1;
    int32_t *msg = calloc(nmsg, sizeof *msg);
    fy_status st = fy_comm_agree(comm, all && tables && msg ? FY_OK : FY_ERR_NOMEM);
    if (st == FY_OK)
        st = rank_info_of(o, m, comm, slowdown, plan, &all[rank], &tables[(size_t)rank * nb]);
    if (st == FY_OK) st = fy_comm_allgather_records(comm, all, sizeof *all);
    if (st == FY_OK && !search) st = fy_comm_allgather_records(comm, tables, (size_t)nb * sizeof *tables);
    if (st == FY_OK) {
        fy_status found = FY_OK;
        if (rank == 0) {
            fy_job_result res = {0};
            found = search_job(o, m, world, all, tables, search, balance, msg + 1, &res);
            msg[0] = res.micro;
            for (int r = 0; found == FY_OK && r < world; r++) {
                msg[1 + world + 2 * r] = res.rank[r].plan.prefetch;
                msg[2 + world + 2 * r] = (int32_t)res.rank[r].plan.dtype;
                memcpy(&tables[(size_t)r * nb], res.rank[r].plan.blocks, (size_t)nb * sizeof *tables);
            }
            fy_job_result_free(&res);
        }
        fy_comm_patient(comm, rank != 0); /* the others wait for rank 0's search */
        st = fy_comm_agree(comm, found);
        fy_comm_patient(comm, false);
    }
    if (st == FY_OK) st = fy_comm_bcast(comm, msg, nmsg * sizeof *msg);
    if (st == FY_OK && search) st = fy_comm_bcast(comm, tables, (size_t)world * nb * sizeof *tables);
    if (st == FY_OK && search) {
        fy_plan_free(plan);
        st = plan_from(m, msg[0], msg[1 + rank], msg[1 + world + 2 * rank], msg[2 + world + 2 * rank],
                       &tables[(size_t)rank * nb], plan);
    } else if (st == FY_OK) {
        plan->grad_accum = msg[1 + rank];
    }
    free(all);
    free(tables);
    free(msg);
    return st;
}
