/* test_tuner.c — profiles (files, named estimates), and the plan search: on synthetic
 * profiles whose optimum is known by construction it finds it, and it never returns a
 * plan over the device or host budget. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/model/gpt2.h"
#include "tuner/profile.h"
#include "tuner/tune.h"

static const fy_gpt2_config small_cfg = {.vocab = 256, .max_seq = 32, .channels = 32, .layers = 2,
                                         .heads = 4};
static fy_model *small; /* the model of small_cfg, for each test */

static void open_small(void) { cr_assert_eq(fy_gpt2_new(&small_cfg, NULL, &small), FY_OK); }
static void close_small(void) { fy_model_free(small); small = NULL; }
TestSuite(tune, .init = open_small, .fini = close_small);

/* A profile in which every resource is fast and balanced. */
static fy_profile base_profile(void) {
    fy_profile p;
    memset(&p, 0, sizeof p);
    snprintf(p.name, sizeof p.name, "synthetic");
    p.h2d_gbps = p.d2h_gbps = p.duplex_h2d_gbps = p.duplex_d2h_gbps = 10;
    p.latency_ms = 0.01;
    p.device_mem_gib = 1;
    p.host_mem_gib = 4;
    p.cores = 2;
    p.numa_nodes = 1;
    p.adam_threads_max = 2;
    p.adam_gparams[1] = 1;
    p.adam_gparams[2] = 2;
    p.compute_tflops = 0.05;
    p.device_mem_gbps = 20;
    return p;
}

static fy_tune_cfg base_cfg(size_t budget) {
    return (fy_tune_cfg){.model = small, .batch = 4, .seq = 16, .device_budget = budget,
                         .adam_threads = 2, .window = 6};
}

static char *tmp_path(void) {
    static char path[64];
    snprintf(path, sizeof path, "/tmp/ferry_tuner_XXXXXX");
    int fd = mkstemp(path);
    cr_assert(fd >= 0);
    close(fd);
    return path;
}

Test(profile, json_round_trip) {
    fy_profile p = base_profile(), q;
    p.has_blocks = true;
    snprintf(p.block_model, sizeof p.block_model, "gpt2: vocab 256, positions 32, channels 32, "
             "layers 2, heads 4");
    p.block_seq = 16;
    p.block_a[FY_T_FWD][FY_BLOCK_LAYER] = 1.5;
    p.block_b[FY_T_FWD][FY_BLOCK_LAYER] = 0.25;
    p.block_a[FY_T_HEAD][FY_BLOCK_HEAD] = 0.75;
    p.coll_ranks = 4;
    p.coll_gbps = 120;
    p.coll_latency_ms = 0.03;
    p.coll_host_gbps = 9;
    p.coll_host_latency_ms = 0.01;
    snprintf(p.coll_source, sizeof p.coll_source, "ferry probe: 4 ranks");
    char *path = tmp_path();
    cr_assert_eq(fy_profile_save(path, &p), FY_OK);
    cr_assert_eq(fy_profile_load(path, &q), FY_OK);
    cr_expect_eq(q.h2d_gbps, p.h2d_gbps);
    cr_expect_eq(q.adam_threads_max, 2);
    cr_expect_eq(q.adam_gparams[2], 2);
    cr_expect(q.has_blocks && !strcmp(q.block_model, p.block_model));
    cr_expect_eq(q.block_a[FY_T_FWD][FY_BLOCK_LAYER], 1.5);
    cr_expect_eq(q.block_b[FY_T_FWD][FY_BLOCK_LAYER], 0.25);
    cr_expect_eq(q.block_a[FY_T_HEAD][FY_BLOCK_HEAD], 0.75);
    cr_expect(q.coll_ranks == 4 && q.coll_gbps == 120 && q.coll_latency_ms == 0.03 &&
              q.coll_host_gbps == 9 && q.coll_host_latency_ms == 0.01 &&
              !strcmp(q.coll_source, p.coll_source));
    unlink(path);
}

Test(profile, named_profiles_are_estimates_with_sources) {
    const char *names[] = {"a100-40gb-pcie4", "rtx4090-pcie4", "h100-80gb-pcie5", "h200-141gb"};
    for (int i = 0; i < 4; i++) {
        fy_profile p;
        cr_assert_eq(fy_profile_named(names[i], &p), FY_OK, "%s", names[i]);
        cr_expect(p.estimate);
        cr_expect(strstr(p.source, "estimate") != NULL && strlen(p.source) > 40);
        cr_expect(p.h2d_gbps > 0 && p.compute_tflops > 0 && p.device_mem_gib > 0);
        cr_expect(p.coll_gbps > 0 && strstr(p.coll_source, "estimate") && strlen(p.coll_source) > 40,
                  "%s: the collectives between its GPUs, with a source", names[i]);
    }
    fy_profile p;
    cr_expect_eq(fy_profile_named("tpu-v9", &p), FY_ERR_INVALID);
    cr_expect(strstr(fy_last_error(), "h200-141gb") != NULL, "error lists the names");
}

Test(profile, bad_files_are_refused) {
    const char *bad[] = {
        "not json",
        "{\"format\":\"ferry-plan\"}",
        "{\"format\":\"ferry-profile\",\"h2d_gbps\":-1,\"d2h_gbps\":1,\"duplex_h2d_gbps\":1,"
        "\"duplex_d2h_gbps\":1,\"latency_ms\":0,\"device_mem_gib\":1,\"host_mem_gib\":1,\"cores\":1,"
        "\"adam_gparams_by_threads\":[1],\"compute_tflops\":1,\"device_mem_gbps\":1}",
        "{\"format\":\"ferry-profile\",\"h2d_gbps\":1,\"d2h_gbps\":1,\"duplex_h2d_gbps\":1,"
        "\"duplex_d2h_gbps\":1,\"latency_ms\":0,\"device_mem_gib\":1,\"host_mem_gib\":1,\"cores\":1,"
        "\"adam_gparams_by_threads\":[],\"compute_tflops\":1,\"device_mem_gbps\":1}",
        "{\"format\":\"ferry-profile\",\"h2d_gbps\":1,\"d2h_gbps\":1,\"duplex_h2d_gbps\":1,"
        "\"duplex_d2h_gbps\":1,\"latency_ms\":0,\"device_mem_gib\":1,\"host_mem_gib\":1,\"cores\":1,"
        "\"adam_gparams_by_threads\":[1],\"compute_tflops\":1,\"device_mem_gbps\":1,"
        "\"blocks\":{\"model\":\"gpt2: vocab 1\","
        "\"seq\":1,\"ms_a_plus_b_times_batch\":{\"fwd\":{\"layer\":[1]}}}}",
        "{\"format\":\"ferry-profile\",\"h2d_gbps\":1,\"d2h_gbps\":1,\"duplex_h2d_gbps\":1,"
        "\"duplex_d2h_gbps\":1,\"latency_ms\":0,\"device_mem_gib\":1,\"host_mem_gib\":1,\"cores\":1,"
        "\"adam_gparams_by_threads\":[1],\"compute_tflops\":1,\"device_mem_gbps\":1,"
        "\"blocks\":{\"model\":\"\",\"seq\":1,\"ms_a_plus_b_times_batch\":{}}}",
        /* collectives with no bandwidth */
        "{\"format\":\"ferry-profile\",\"h2d_gbps\":1,\"d2h_gbps\":1,\"duplex_h2d_gbps\":1,"
        "\"duplex_d2h_gbps\":1,\"latency_ms\":0,\"device_mem_gib\":1,\"host_mem_gib\":1,\"cores\":1,"
        "\"adam_gparams_by_threads\":[1],\"compute_tflops\":1,\"device_mem_gbps\":1,"
        "\"collectives\":{\"ranks\":2,\"gbps\":0,\"latency_ms\":0}}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char *path = tmp_path();
        FILE *f = fopen(path, "w");
        fputs(bad[i], f);
        fclose(f);
        fy_profile p;
        cr_expect_eq(fy_profile_load(path, &p), FY_ERR_FORMAT, "case %zu accepted", i);
        cr_expect(strstr(fy_last_error(), path) != NULL, "case %zu: no file named: %s", i,
                  fy_last_error());
        unlink(path);
    }
}

enum { TUNE_TOP = 5 };

/* The plan of a point of the search space (micro-batch of a batch of `batch`; recomputed,
 * streamed and cpu-optimised layers k1, k2, k3; storage type dt) and its memory model. */
static fy_plan point(const fy_model *m, int batch, int micro, int k1, int k2, int k3, fy_dtype dt,
                     fy_mem_model *mm) {
    const int L = fy_model_layers(m);
    fy_plan q;
    cr_assert_eq(fy_plan_new(m, micro, batch / micro, &q), FY_OK);
    cr_assert_eq(fy_plan_shorthands(&q, (double)k2 / L, (double)k3 / L, k1), FY_OK);
    q.dtype = dt == FY_BF16 ? FY_BF16 : FY_F32;
    fy_storage_model(m, &q, 16, mm);
    return q;
}

static void free_top(fy_tune_result *top, int n) {
    for (int i = 0; i < n; i++) fy_plan_free(&top[i].plan);
}

/* Transfers and the CPU optimizer are very slow, memory is plentiful: keeping everything
 * on the device without recomputation is the optimum by construction. */
Test(tune, finds_all_resident_when_offload_only_costs) {
    fy_profile p = base_profile();
    p.h2d_gbps = p.d2h_gbps = p.duplex_h2d_gbps = p.duplex_d2h_gbps = 1e-3;
    p.adam_gparams[1] = p.adam_gparams[2] = 1e-4;
    fy_tune_cfg c = base_cfg((size_t)1 << 30);
    fy_tune_result top[3];
    int n, ne;
    cr_assert_eq(fy_tune(&p, &c, top, 3, &n, &ne), FY_OK);
    cr_assert(n >= 1 && ne >= 1);
    cr_expect(top[0].k1 == 0 && top[0].k2 == 0 && top[0].k3 == 0, "picked k1=%d k2=%d k3=%d",
              top[0].k1, top[0].k2, top[0].k3);
    for (int i = 1; i < n; i++) cr_expect(top[i].step_ms >= top[i - 1].step_ms, "sorted");
    free_top(top, n);
}

/* The device's own AdamW is very slow (memory bandwidth tiny) and the CPU's fast, with
 * fast transfers: every optimizer step on the CPU is the optimum. */
Test(tune, finds_cpu_optimizer_when_device_adam_is_slow) {
    fy_profile p = base_profile();
    p.device_mem_gbps = 1e-3;
    p.adam_gparams[1] = p.adam_gparams[2] = 100;
    p.h2d_gbps = p.d2h_gbps = p.duplex_h2d_gbps = p.duplex_d2h_gbps = 100;
    fy_tune_cfg c = base_cfg((size_t)1 << 30);
    fy_tune_result top[1];
    int n, ne;
    cr_assert_eq(fy_tune(&p, &c, top, 1, &n, &ne), FY_OK);
    cr_expect_eq(top[0].k3, small_cfg.layers, "picked k3=%d", top[0].k3);
    cr_expect(top[0].plan.blocks[0].update == FY_UPDATE_CPU, "the embedding's optimizer too");
    free_top(top, n);
}

/* Whatever the budget, every returned plan fits it (device and host), and a budget below
 * the smallest plan is a clear error. */
Test(tune, never_returns_a_plan_over_budget) {
    fy_profile p = base_profile();
    /* the smallest and largest device need over the search space */
    fy_mem_model lo = {.device_total = SIZE_MAX}, hi = {0};
    const int L = small_cfg.layers;
    for (int micro = 1; micro <= 4; micro *= 2)
        for (int k1 = 0; k1 <= L; k1++)
            for (int k2 = 0; k2 <= L; k2++)
                for (int k3 = 0; k3 <= L; k3++) {
                    fy_mem_model m;
                    fy_plan q = point(small, 4, micro, k1, k2, k3, FY_F32, &m);
                    if (m.device_total < lo.device_total) lo = m;
                    if (m.device_total > hi.device_total) hi = m;
                    fy_plan_free(&q);
                }
    cr_assert(lo.device_total < hi.device_total);
    for (int k = 0; k <= 8; k++) {
        size_t budget = lo.device_total + (hi.device_total - lo.device_total) * (size_t)k / 8;
        fy_tune_cfg c = base_cfg(budget);
        c.host_budget = k % 2 ? (size_t)64 << 20 : 0;
        fy_tune_result top[5];
        int n, ne;
        cr_assert_eq(fy_tune(&p, &c, top, 5, &n, &ne), FY_OK, "budget %zu", budget);
        for (int i = 0; i < n; i++) {
            cr_expect(top[i].mem.device_total <= budget, "plan over the device budget");
            cr_expect(!c.host_budget || top[i].mem.host_total <= c.host_budget);
        }
        free_top(top, n);
    }
    fy_tune_cfg c = base_cfg(lo.device_total - 1);
    fy_tune_result top[1];
    int n, ne;
    cr_expect_eq(fy_tune(&p, &c, top, 1, &n, &ne), FY_ERR_INVALID);
    cr_expect(strstr(fy_last_error(), "no plan fits") != NULL);
}

/* The exhaustive search over every point that fits (each predicted on the simulator):
 * its fastest prediction and its pick (fy_tune_pick), in *fastest and *pick (ms/step);
 * returns how many fit. */
static int exhaustive(const fy_profile *p, const fy_tune_cfg *c, double *fastest, double *pick) {
    const int L = fy_model_layers(c->model);
    fy_tune_result *all = NULL;
    int n = 0;
    for (int micro = 1; micro <= c->batch; micro++) {
        if (c->batch % micro) continue;
        for (int k1 = 0; k1 <= L; k1++)
            for (int k2 = 0; k2 <= L; k2++)
                for (int k3 = 0; k3 <= L; k3++)
                    for (int k4 = 0; k4 <= (k3 < L ? k3 : L); k4++) { /* speculative layers */
                        fy_mem_model m;
                        fy_plan q = point(c->model, c->batch, micro, k1, k2, k3, c->dtype, &m);
                        cr_assert_eq(fy_plan_speculate(&q, (double)k4 / L), FY_OK);
                        fy_storage_model(c->model, &q, c->seq, &m);
                        if (m.device_total <= c->device_budget &&
                            (!c->host_budget || m.host_total <= c->host_budget)) {
                            all = realloc(all, (size_t)(n + 1) * sizeof *all);
                            cr_assert_eq(fy_tune_predict(p, c, &q, &all[n]), FY_OK);
                            n++;
                        }
                        fy_plan_free(&q);
                    }
    }
    if (!n) return 0;
    int f = 0;
    for (int i = 1; i < n; i++) if (all[i].step_ms < all[f].step_ms) f = i;
    *fastest = all[f].step_ms;
    *pick = all[fy_tune_pick(all, n, c->tie_margin)].step_ms;
    for (int i = 0; i < n; i++) fy_plan_free(&all[i].plan);
    free(all);
    return n;
}

/* The pruned search (the memory frontier, points in the order of their lower bounds)
 * finds what the exhaustive one finds, on four machines (balanced, slow transfers, slow
 * CPU, fast CPU and slow device) and three device budgets each, with and without a host
 * budget (half the host memory of offloading everything), in fp32 and bf16 storage (whose
 * host memory depends on the micro-batch: without accumulation gradients share the bf16
 * weights' buffers): its fastest prediction is the exhaustive fastest (1% for the
 * simulator's ties) and its pick is within the tie margin of it. */
static void pruned_matches_exhaustive(fy_dtype dt) {
    fy_profile ps[4] = {base_profile(), base_profile(), base_profile(), base_profile()};
    ps[1].h2d_gbps = ps[1].d2h_gbps = ps[1].duplex_h2d_gbps = ps[1].duplex_d2h_gbps = 0.05;
    ps[2].adam_gparams[1] = ps[2].adam_gparams[2] = 0.001;
    ps[3].adam_gparams[1] = ps[3].adam_gparams[2] = 50;
    ps[3].device_mem_gbps = 0.2;
    fy_gpt2_config cfg = small_cfg;
    cfg.layers = 4;
    fy_model *m;
    cr_assert_eq(fy_gpt2_new(&cfg, NULL, &m), FY_OK);
    int fit = 0, nothing = 0;
    fy_plan all_resident;
    cr_assert_eq(fy_plan_new(m, 4, 1, &all_resident), FY_OK);
    all_resident.dtype = dt == FY_BF16 ? FY_BF16 : FY_F32;
    fy_mem_model hi, off;
    fy_storage_model(m, &all_resident, 16, &hi);
    cr_assert_eq(fy_plan_shorthands(&all_resident, 1, 1, 4), FY_OK);
    fy_storage_model(m, &all_resident, 16, &off); /* everything offloaded: the most host */
    fy_plan_free(&all_resident);
    for (int i = 0; i < 4; i++)
        for (int b = 0; b < 6; b++) {
            fy_tune_cfg c = {.model = m, .batch = 4, .seq = 16, .adam_threads = 2, .window = 6,
                             .tie_margin = FY_TUNE_TIE_MARGIN, .dtype = dt,
                             .device_budget = hi.device_total * (size_t)(2 + b / 2) / 4,
                             .host_budget = b % 2 ? off.host_total / 2 : 0};
            double fastest, pick;
            fy_tune_result top[TUNE_TOP];
            int n, ne;
            if (!exhaustive(&ps[i], &c, &fastest, &pick)) {
                cr_expect_eq(fy_tune(&ps[i], &c, top, TUNE_TOP, &n, &ne), FY_ERR_INVALID);
                nothing++;
                continue;
            }
            cr_assert_eq(fy_tune(&ps[i], &c, top, TUNE_TOP, &n, &ne), FY_OK);
            fit++;
            double pruned_fastest = top[0].step_ms;
            for (int k = 1; k < n; k++) if (top[k].step_ms < pruned_fastest) pruned_fastest = top[k].step_ms;
            cr_expect(pruned_fastest <= fastest * 1.01, "profile %d budget %d: pruned fastest %.4f, "
                      "exhaustive %.4f", i, b, pruned_fastest, fastest);
            cr_expect(top[0].step_ms <= fastest * (1 + FY_TUNE_TIE_MARGIN) + 1e-9,
                      "profile %d budget %d: pick %.4f (exhaustive pick %.4f, fastest %.4f)", i, b,
                      top[0].step_ms, pick, fastest);
            free_top(top, n);
        }
    cr_expect(fit >= 16 && nothing >= 1, "%d cases fit, %d did not", fit, nothing);
    fy_model_free(m);
}

Test(tune, pruned_search_finds_what_exhaustive_search_finds, .timeout = 120) {
    pruned_matches_exhaustive(FY_F32);
    pruned_matches_exhaustive(FY_BF16);
}

/* fy_tune_fits says a plan fits exactly when one does, for budgets at each point's own
 * device and host need (the tightest budgets under which that point fits), in bf16 with a
 * batch of 4, where the least host memory is at micro-batch 4 and the least device memory
 * at micro-batch 1. */
Test(tune, fits_exactly_when_a_plan_fits, .timeout = 120) {
    fy_gpt2_config cfg = small_cfg;
    cfg.layers = 3;
    fy_model *m;
    cr_assert_eq(fy_gpt2_new(&cfg, NULL, &m), FY_OK);
    const int L = cfg.layers;
    fy_mem_model pts[4 * 4 * 4 * 3];
    int np = 0;
    for (int micro = 1; micro <= 4; micro *= 2)
        for (int k1 = 0; k1 <= L; k1++)
            for (int k2 = 0; k2 <= L; k2++)
                for (int k3 = 0; k3 <= L; k3++) {
                    fy_plan q = point(m, 4, micro, k1, k2, k3, FY_BF16, &pts[np++]);
                    fy_plan_free(&q);
                }
    int checked = 0;
    for (int i = 0; i < np; i++)
        for (int shrink = 0; shrink < 2; shrink++) {
            /* the point's own needs (it fits), or one byte less host (it may not) */
            fy_tune_cfg c = {.model = m, .batch = 4, .seq = 16, .dtype = FY_BF16,
                             .device_budget = pts[i].device_total,
                             .host_budget = pts[i].host_total - (size_t)shrink};
            bool any = false;
            for (int j = 0; j < np && !any; j++)
                any = pts[j].device_total <= c.device_budget && pts[j].host_total <= c.host_budget;
            cr_expect_eq(fy_tune_fits(&c), any, "point %d, host budget less %d: fits says %d", i,
                         shrink, !any);
            checked++;
        }
    cr_expect_eq(checked, 2 * np);
    fy_model_free(m);
}

/* The prediction comes from the simulator: slower transfers never make a streamed plan
 * faster, and a plan's predicted memory is its storage walk's. */
Test(tune, predictions_follow_the_profile) {
    fy_profile fast = base_profile(), slow = base_profile();
    slow.h2d_gbps = slow.d2h_gbps = slow.duplex_h2d_gbps = slow.duplex_d2h_gbps = 0.1;
    fy_plan plan;
    cr_assert_eq(fy_plan_new(small, 4, 1, &plan), FY_OK);
    cr_assert_eq(fy_plan_shorthands(&plan, 1, 1, 0), FY_OK);
    fy_tune_cfg c = base_cfg((size_t)1 << 30);
    fy_tune_result a, b;
    cr_assert_eq(fy_tune_predict(&fast, &c, &plan, &a), FY_OK);
    cr_assert_eq(fy_tune_predict(&slow, &c, &plan, &b), FY_OK);
    cr_expect(b.step_ms > a.step_ms, "slow %.3f fast %.3f", b.step_ms, a.step_ms);
    cr_expect(b.busy_ms[FY_LANE_H2D] > a.busy_ms[FY_LANE_H2D]);
    fy_mem_model m;
    fy_storage_model(small, &plan, 16, &m);
    cr_expect_eq(a.mem.device_total, m.device_total);
    fy_plan_free(&a.plan);
    fy_plan_free(&b.plan);
    fy_plan_free(&plan);
}

/* Ties within the margin go to the plan that moves the least work off the compute lane;
 * a faster plan beyond the margin still wins. */
Test(tune, ties_go_to_the_least_offload) {
    fy_tune_result r[3];
    memset(r, 0, sizeof r);
    r[0].step_ms = 100; r[0].busy_ms[FY_LANE_H2D] = 50;  /* fastest, moves a lot */
    r[1].step_ms = 104; r[1].busy_ms[FY_LANE_CPU] = 10;  /* 4% slower, moves little */
    r[2].step_ms = 120;                                  /* moves nothing, 20% slower */
    cr_expect_eq(fy_tune_pick(r, 3, 0.0), 0);
    cr_expect_eq(fy_tune_pick(r, 3, 0.06), 1);
    cr_expect_eq(fy_tune_pick(r, 3, 0.25), 2);
}

/* A data-parallel job's rank (cfg.ranks): its optimizer state is sharded, so a fully
 * offloaded plan's host memory is below one process's (each block's largest shard
 * budgeted), and every block's reduce-scatter and all-gather cost what the profile's
 * collectives say: (N - 1) / N of its bytes over their bandwidth, plus their latency, on
 * the comm lane; over the device's collectives for a resident gpu-optimised block, over
 * MPI in host memory for the blocks the CPU keeps. Without a figure for them the search
 * refuses, naming the fix. */
Test(tune, a_job_shards_the_state_and_pays_for_its_collectives) {
    static const fy_gpt2_config cfg = {.vocab = 256, .max_seq = 32, .channels = 64, .layers = 2,
                                       .heads = 4}; /* layers of 4 norm chunks */
    fy_model *m;
    cr_assert_eq(fy_gpt2_new(&cfg, NULL, &m), FY_OK);
    fy_profile p = base_profile();
    p.coll_gbps = 2;
    p.coll_latency_ms = 0.05;
    p.coll_host_gbps = 1;
    p.coll_host_latency_ms = 0.02;
    fy_plan plan;
    cr_assert_eq(fy_plan_new(m, 4, 1, &plan), FY_OK);
    cr_assert_eq(fy_plan_shorthands(&plan, 1, 1, 0), FY_OK);
    fy_tune_cfg one = base_cfg((size_t)1 << 30), job = one;
    one.model = job.model = m;
    job.ranks = 2;
    fy_tune_result a, b;
    cr_assert_eq(fy_tune_predict(&p, &one, &plan, &a), FY_OK);
    cr_assert_eq(fy_tune_predict(&p, &job, &plan, &b), FY_OK);
    cr_expect(b.mem.host[FY_CAT_OPTIM] < a.mem.host[FY_CAT_OPTIM], "optimizer state %zu of %zu",
              b.mem.host[FY_CAT_OPTIM], a.mem.host[FY_CAT_OPTIM]);
    cr_expect_eq(a.busy_ms[FY_LANE_COMM], 0.0);
    /* the resident plan: the device's collectives alone, exactly */
    fy_plan res;
    cr_assert_eq(fy_plan_new(m, 4, 1, &res), FY_OK);
    fy_tune_result d;
    cr_assert_eq(fy_tune_predict(&p, &job, &res, &d), FY_OK);
    double want = 0.0; /* fp32 storage: 4 bytes an element, half of it moved by each rank */
    for (int k = 0; k < fy_model_nblocks(m); k++)
        want += 2.0 * (fy_model_block(m, k)->nelem * 4.0 / 2.0 / 2e9 * 1e3 + 0.05);
    cr_expect(fabs(d.busy_ms[FY_LANE_COMM] - want) < 1e-9 * want, "comm lane %.6f ms, want %.6f",
              d.busy_ms[FY_LANE_COMM], want);
    /* the offloaded plan's collectives are MPI's over host memory: slower there, slower
     * step; the device's figure does not change it */
    fy_profile slow = p, fast_dev = p;
    slow.coll_host_gbps = 0.01;
    fast_dev.coll_gbps = 1000;
    fy_tune_result c, e;
    cr_assert_eq(fy_tune_predict(&slow, &job, &plan, &c), FY_OK);
    cr_assert_eq(fy_tune_predict(&fast_dev, &job, &plan, &e), FY_OK);
    cr_expect(c.step_ms > b.step_ms, "slow collectives %.3f ms, fast %.3f ms", c.step_ms, b.step_ms);
    cr_expect_eq(e.busy_ms[FY_LANE_COMM], b.busy_ms[FY_LANE_COMM]);
    fy_plan_free(&d.plan);
    fy_plan_free(&e.plan);
    fy_plan_free(&res);
    /* the search: a rank's plan, refused without collectives */
    fy_tune_result top[2];
    int n = 0, ne = 0;
    cr_expect_eq(fy_tune(&p, &job, top, 2, &n, &ne), FY_OK);
    for (int i = 0; i < n; i++) fy_plan_free(&top[i].plan);
    fy_profile none = base_profile();
    cr_expect_eq(fy_tune(&none, &job, top, 2, &n, &ne), FY_ERR_INVALID);
    cr_expect(strstr(fy_last_error(), "mpirun -np 2 ferry probe") != NULL, "%s", fy_last_error());
    fy_plan_free(&a.plan);
    fy_plan_free(&b.plan);
    fy_plan_free(&c.plan);
    fy_plan_free(&plan);
    fy_model_free(m);
}
