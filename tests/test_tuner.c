/* test_tuner.c — profiles (files, named estimates), and the plan search: on synthetic
 * profiles whose optimum is known by construction it finds it, and it never returns a
 * plan over the device or host budget. A job of unlike ranks (job.h): its shares are the
 * minimax counts an enumeration finds, its step the least over every micro-batch size and
 * count vector, each rank's plan within its own budget. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/model/gpt2.h"
#include "tuner/job.h"
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
    cr_expect(q.disk_read_gbps == 0 && q.disk_write_gbps == 0 && q.disk_qdepth == 0 &&
              !q.disk_source[0], "a profile without a disk figure gains one");
    p.disk_read_gbps = 2.5;
    p.disk_write_gbps = 1.25;
    p.disk_qdepth = 4;
    snprintf(p.disk_source, sizeof p.disk_source, "ferry probe: /scratch, 1.00 GiB, direct I/O");
    cr_assert_eq(fy_profile_save(path, &p), FY_OK);
    cr_assert_eq(fy_profile_load(path, &q), FY_OK);
    cr_expect(q.disk_read_gbps == 2.5 && q.disk_write_gbps == 1.25 && q.disk_qdepth == 4 &&
              !strcmp(q.disk_source, p.disk_source), "the disk's figures do not round-trip");
    unlink(path);
}

/* A profile written before the disk tier (no "disk" object) loads with the disk unknown:
 * its figures 0. */
Test(profile, an_old_file_loads_without_a_disk) {
    static const char old[] =
        "{\"format\":\"ferry-profile\",\"version\":1,\"name\":\"measured\",\"h2d_gbps\":1,"
        "\"d2h_gbps\":1,\"duplex_h2d_gbps\":1,\"duplex_d2h_gbps\":1,\"latency_ms\":0.01,"
        "\"device_mem_gib\":1,\"host_mem_gib\":4,\"cores\":2,\"numa_nodes\":1,"
        "\"adam_gparams_by_threads\":[1,2],\"compute_tflops\":0.1,\"device_mem_gbps\":10}";
    char *path = tmp_path();
    FILE *f = fopen(path, "w");
    fputs(old, f);
    fclose(f);
    fy_profile q;
    memset(&q, 0x5a, sizeof q); /* what load leaves unset would show */
    cr_assert_eq(fy_profile_load(path, &q), FY_OK, "%s", fy_last_error());
    cr_expect(q.disk_read_gbps == 0 && q.disk_write_gbps == 0 && q.disk_qdepth == 0 &&
              !q.disk_source[0]);
    cr_expect_eq(q.h2d_gbps, 1);
    unlink(path);
}

Test(profile, named_profiles_are_estimates_with_sources) {
    const char *names[] = {"a100-40gb-pcie4", "a100-80gb-pcie4", "rtx4090-pcie4", "h100-80gb-pcie5",
                           "h200-141gb"};
    for (int i = 0; i < 5; i++) {
        fy_profile p;
        cr_assert_eq(fy_profile_named(names[i], &p), FY_OK, "%s", names[i]);
        cr_expect(p.estimate);
        cr_expect(strstr(p.source, "estimate") != NULL && strlen(p.source) > 40);
        cr_expect(p.h2d_gbps > 0 && p.compute_tflops > 0 && p.device_mem_gib > 0);
        cr_expect(p.coll_gbps > 0 && strstr(p.coll_source, "estimate") && strlen(p.coll_source) > 40,
                  "%s: the collectives between its GPUs, with a source", names[i]);
        cr_expect(p.disk_read_gbps > 0 && p.disk_write_gbps > 0 && strstr(p.disk_source, "estimate") &&
                  strstr(p.disk_source, "MB/s") && strstr(p.disk_source, "peak"),
                  "%s: the disk's figures, with a source saying they are peaks: %s", names[i],
                  p.disk_source);
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
        /* a disk with no read rate */
        "{\"format\":\"ferry-profile\",\"h2d_gbps\":1,\"d2h_gbps\":1,\"duplex_h2d_gbps\":1,"
        "\"duplex_d2h_gbps\":1,\"latency_ms\":0,\"device_mem_gib\":1,\"host_mem_gib\":1,\"cores\":1,"
        "\"adam_gparams_by_threads\":[1],\"compute_tflops\":1,\"device_mem_gbps\":1,"
        "\"disk\":{\"read_gbps\":0,\"write_gbps\":1,\"qdepth\":4}}",
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

/* ---- a job of unlike ranks (job.h) ---------------------------------------------------- */

/* xorshift64: the random cases are the same on every libc */
static double unit_rand(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return (double)(*s >> 11) * 0x1.0p-53;
}

/* The least max_r (a[r] + b[r] n[r]) over every count vector of ranks r.. (each at least
 * 1, summing to left), the ranks before r at `worst`: an enumeration. */
static double balance_brute(const double *a, const double *b, int r, int nranks, int left, double worst) {
    if (r == nranks - 1) return left >= 1 ? fmax(worst, a[r] + b[r] * left) : INFINITY;
    double best = INFINITY;
    for (int n = 1; n <= left - (nranks - 1 - r); n++)
        best = fmin(best, balance_brute(a, b, r + 1, nranks, left - n, fmax(worst, a[r] + b[r] * n)));
    return best;
}

/* On random affine steps (some ranks with no cost per micro-batch), the counts are whole
 * shares of the total and their job is the enumeration's least; ties go to the lower rank. */
Test(job, balance_is_the_minimax_of_every_count_vector) {
    uint64_t seed = 0x9e3779b97f4a7c15u;
    int cases = 0;
    for (int nranks = 1; nranks <= 4; nranks++)
        for (int trial = 0; trial < 25; trial++) {
            double a[4], b[4];
            for (int r = 0; r < nranks; r++) {
                a[r] = 10.0 * unit_rand(&seed);
                b[r] = unit_rand(&seed) < 0.15 ? 0.0 : 3.0 * unit_rand(&seed);
            }
            for (int total = nranks; total <= nranks + 8; total++) {
                int n[4] = {0}, sum = 0;
                cr_assert_eq(fy_job_balance(a, b, nranks, total, n), FY_OK);
                double job = -INFINITY;
                for (int r = 0; r < nranks; r++) {
                    cr_expect(n[r] >= 1, "%d ranks, total %d: rank %d has %d", nranks, total, r, n[r]);
                    sum += n[r];
                    job = fmax(job, a[r] + b[r] * n[r]);
                }
                cr_expect_eq(sum, total, "%d ranks: counts sum to %d of %d", nranks, sum, total);
                const double least = balance_brute(a, b, 0, nranks, total, -INFINITY);
                cr_expect(fabs(job - least) <= 1e-12 * fmax(1.0, least),
                          "%d ranks, trial %d, total %d: job %.17g, the least %.17g", nranks, trial,
                          total, job, least);
                cases++;
            }
        }
    cr_expect_eq(cases, 4 * 25 * 9);
    const double a[2] = {1, 1}, b[2] = {2, 2};
    int n[2];
    cr_assert_eq(fy_job_balance(a, b, 2, 3, n), FY_OK);
    cr_expect(n[0] == 2 && n[1] == 1, "alike ranks, 3 micro-batches: %d %d", n[0], n[1]);
}

/* A rank's count is capped at FY_PLAN_MAX_ACCUM (a rank whose micro-batches cost nothing
 * takes no more), and a total no counts of 1 to FY_PLAN_MAX_ACCUM make is refused. */
Test(job, balance_keeps_counts_in_range) {
    const double a[3] = {0, 0, 0}, b[3] = {0, 1, 1};
    int n[3];
    cr_assert_eq(fy_job_balance(a, b, 2, FY_PLAN_MAX_ACCUM + 6, n), FY_OK);
    cr_expect(n[0] == FY_PLAN_MAX_ACCUM && n[1] == 6, "%d %d", n[0], n[1]);
    cr_assert_eq(fy_job_balance(a, b, 3, 3 * FY_PLAN_MAX_ACCUM, n), FY_OK);
    for (int r = 0; r < 3; r++) cr_expect_eq(n[r], FY_PLAN_MAX_ACCUM);
    cr_assert_eq(fy_job_balance(a, b, 3, 3, n), FY_OK);
    for (int r = 0; r < 3; r++) cr_expect_eq(n[r], 1);
    cr_expect_eq(fy_job_balance(a, b, 3, 2, n), FY_ERR_INVALID);
    cr_expect(strstr(fy_last_error(), "cannot be shared by 3 ranks") != NULL, "%s", fy_last_error());
    cr_expect_eq(fy_job_balance(a, b, 3, 3 * FY_PLAN_MAX_ACCUM + 1, n), FY_ERR_INVALID);
    cr_expect_eq(fy_job_balance(a, b, 0, 1, n), FY_ERR_INVALID);
}

/* The collectives run at the slowest link: the least bandwidths, the largest latencies. */
Test(job, share_links_takes_the_slowest_link) {
    fy_profile x = base_profile(), y = base_profile();
    x.coll_gbps = 100; x.coll_latency_ms = 0.01; x.coll_host_gbps = 5; x.coll_host_latency_ms = 0.3;
    y.coll_gbps = 20;  y.coll_latency_ms = 0.05; y.coll_host_gbps = 9; y.coll_host_latency_ms = 0.1;
    fy_profile *both[2] = {&x, &y};
    fy_job_share_links(both, 2);
    for (int r = 0; r < 2; r++) {
        cr_expect(both[r]->coll_gbps == 20 && both[r]->coll_latency_ms == 0.05, "rank %d", r);
        cr_expect(both[r]->coll_host_gbps == 5 && both[r]->coll_host_latency_ms == 0.3, "rank %d", r);
    }
    cr_expect(x.h2d_gbps == 10 && x.compute_tflops == 0.05, "the rest as it was");
}

enum { JOB_SEQ = 64, JOB_MAX_RANKS = 3, JOB_MAX_COUNT = 3 * 8 };
static fy_model *job_model; /* gpt2-mini: 4 layers of 128 channels */

static void open_job_model(void) { cr_assert_eq(fy_model_named("gpt2-mini", NULL, &job_model), FY_OK); }
static void close_job_model(void) { fy_model_free(job_model); job_model = NULL; }
TestSuite(job, .init = open_job_model, .fini = close_job_model);

static fy_profile named_profile(const char *name) {
    fy_profile p;
    cr_assert_eq(fy_profile_named(name, &p), FY_OK, "%s", name);
    return p;
}

static fy_job_rank job_rank(const fy_profile *p, size_t budget) {
    return (fy_job_rank){.profile = p, .device_budget = budget, .adam_threads = p->adam_threads_max};
}

/* tie_margin 0: each rank's plan is its fastest, so the enumerations below ask fy_tune for
 * the same thing the job does */
static fy_job_cfg job_cfg(const fy_job_rank *ranks, int nranks, int rank_batch, fy_job_shares shares) {
    return (fy_job_cfg){.model = job_model, .seq = JOB_SEQ, .rank_batch = rank_batch, .nranks = nranks,
                        .ranks = ranks, .shares = shares, .window = 4};
}

/* Rank r's step with `count` micro-batches of `micro`, as the job's rank (its profile,
 * budget, the job's size): under its given plan (INFINITY for another micro-batch size),
 * else under its best plan (INFINITY when none fits). */
static double rank_step(const fy_job_cfg *c, int r, int micro, int count) {
    const fy_job_rank *rk = &c->ranks[r];
    const fy_tune_cfg tc = {.model = c->model, .batch = micro * count, .micro = micro, .seq = c->seq,
                            .device_budget = rk->device_budget, .host_budget = c->host_budget,
                            .adam_threads = rk->adam_threads, .window = c->window, .dtype = c->dtype,
                            .ranks = c->nranks, .tie_margin = c->tie_margin};
    fy_tune_result top;
    if (rk->plan) {
        if (rk->plan->micro_batch != micro) return INFINITY;
        fy_plan q;
        cr_assert_eq(fy_plan_copy(rk->plan, &q), FY_OK);
        q.grad_accum = count;
        cr_assert_eq(fy_tune_predict(rk->profile, &tc, &q, &top), FY_OK);
        fy_plan_free(&q);
        fy_plan_free(&top.plan);
        return top.step_ms;
    }
    int n = 0, ne = 0;
    const fy_log_level lvl = fy_log_get_level();
    fy_log_set_level(FY_LOG_QUIET);
    const fy_status st = fy_tune(rk->profile, &tc, &top, 1, &n, &ne);
    fy_log_set_level(lvl);
    if (st != FY_OK || n < 1) return INFINITY;
    fy_plan_free(&top.plan);
    return top.step_ms;
}

/* The least job step over every count vector of ranks r.. summing to left (t[r][n]: rank
 * r's step with n micro-batches). */
static double job_brute(double t[][JOB_MAX_COUNT + 1], int r, int nranks, int left, double worst) {
    if (r >= JOB_MAX_RANKS || left > JOB_MAX_COUNT) return INFINITY; /* never: bounds for the compiler */
    if (r == nranks - 1) return left >= 1 ? fmax(worst, t[r][left]) : INFINITY;
    double best = INFINITY;
    for (int n = 1; n <= left - (nranks - 1 - r); n++)
        best = fmin(best, job_brute(t, r + 1, nranks, left - n, fmax(worst, t[r][n])));
    return best;
}

/* The least step of job c over every micro-batch size, and with balanced shares every count
 * vector (equal shares: rank_batch / micro each), each rank under its given or best plan. */
static double job_enumerated(const fy_job_cfg *c) {
    const int N = c->nranks;
    cr_assert(N <= JOB_MAX_RANKS && N * c->rank_batch <= JOB_MAX_COUNT);
    double best = INFINITY;
    for (int m = 1; m <= N * c->rank_batch; m++) { /* sizes the ranks can share (job.h) */
        const int total = N * c->rank_batch / m;
        if ((N * c->rank_batch) % m || total < N || (c->shares == FY_JOB_EQUAL && c->rank_batch % m))
            continue;
        static double t[JOB_MAX_RANKS][JOB_MAX_COUNT + 1];
        double equal = 0.0;
        for (int r = 0; r < N; r++) {
            for (int n = 1; n <= total - (N - 1); n++)
                t[r][n] = c->shares == FY_JOB_BALANCED || n == total / N ? rank_step(c, r, m, n) : NAN;
            equal = fmax(equal, t[r][total / N]);
        }
        best = fmin(best, c->shares == FY_JOB_BALANCED ? job_brute(t, 0, N, total, -INFINITY) : equal);
    }
    return best;
}

/* What every job returns: one micro-batch size, every rank's count its plan's grad_accum
 * summing to the step's micro-batches, the step the slowest rank's. */
static void expect_whole_job(const fy_job_cfg *c, const fy_job_result *res) {
    cr_assert_eq(res->nranks, c->nranks);
    cr_assert(res->micro >= 1 && (c->nranks * c->rank_batch) % res->micro == 0, "micro %d", res->micro);
    int sum = 0;
    double slowest = 0.0;
    for (int r = 0; r < c->nranks; r++) {
        const fy_plan *p = &res->rank[r].plan;
        cr_expect_eq(p->micro_batch, res->micro, "rank %d: micro-batch %d of the job's %d", r,
                     p->micro_batch, res->micro);
        cr_expect(p->grad_accum >= 1, "rank %d: %d micro-batches", r, p->grad_accum);
        cr_expect_eq(fy_plan_check(p, c->model), FY_OK, "rank %d", r);
        sum += p->grad_accum;
        slowest = fmax(slowest, res->rank[r].step_ms);
    }
    cr_expect_eq(sum, c->nranks * c->rank_batch / res->micro, "the counts sum to %d", sum);
    cr_expect_eq(res->step_ms, slowest);
    cr_expect(res->evaluated >= 1);
}

/* Two ranks alike (one named profile, one budget): equal shares of one plan, whichever the
 * shares asked for, and the job's step each rank's, which is the rank's own search's. */
Test(job, alike_ranks_get_equal_shares_of_one_plan) {
    const fy_profile p = named_profile("a100-40gb-pcie4");
    const fy_job_rank ranks[2] = {job_rank(&p, (size_t)32 << 20), job_rank(&p, (size_t)32 << 20)};
    for (int s = 0; s < 2; s++) {
        const fy_job_cfg c = job_cfg(ranks, 2, 4, s ? FY_JOB_BALANCED : FY_JOB_EQUAL);
        fy_job_result res;
        cr_assert_eq(fy_tune_job(&c, &res), FY_OK);
        expect_whole_job(&c, &res);
        const int each = c.rank_batch / res.micro;
        for (int r = 0; r < 2; r++) {
            cr_expect_eq(res.rank[r].plan.grad_accum, each, "shares %d rank %d: %d of %d", s, r,
                         res.rank[r].plan.grad_accum, each);
            cr_expect_eq(res.rank[r].step_ms, res.step_ms);
        }
        cr_expect(fy_plan_equal(&res.rank[0].plan, &res.rank[1].plan), "shares %d", s);
        cr_expect_eq(res.step_ms, rank_step(&c, 0, res.micro, each));
        cr_expect(res.step_ms <= job_enumerated(&c) * (1 + 1e-9), "shares %d: %.6f ms, the "
                  "enumeration's %.6f", s, res.step_ms, job_enumerated(&c));
        fy_job_result_free(&res);
    }
}

/* Ranks of unlike speeds (an A100, its twin twice as slow, an RTX 4090, their collectives at
 * the slowest link): the slow rank takes fewer micro-batches than its fast twin, the
 * balanced job is the least over every micro-batch size and count vector, and faster than
 * equal shares, which are in turn the least over the micro-batch sizes. */
Test(job, slow_ranks_take_fewer_micro_batches) {
    fy_profile ps[3] = {named_profile("a100-40gb-pcie4"), named_profile("a100-40gb-pcie4"),
                        named_profile("rtx4090-pcie4")};
    /* devices 50x slower than their datasheets (the twin 100x): the micro-batches' compute,
     * not the collectives' latencies, is the step of so small a model */
    for (int r = 0; r < 3; r++) fy_profile_slow(&ps[r], r == 1 ? 100 : 50);
    fy_profile *links[3] = {&ps[0], &ps[1], &ps[2]};
    fy_job_share_links(links, 3);
    const fy_job_rank ranks[3] = {job_rank(&ps[0], (size_t)64 << 20), job_rank(&ps[1], (size_t)64 << 20),
                                  job_rank(&ps[2], (size_t)64 << 20)};
    for (int nranks = 2; nranks <= 3; nranks++) {
        fy_job_cfg c = job_cfg(ranks, nranks, 8, FY_JOB_BALANCED);
        c.seq = 256;
        fy_job_result bal, eq;
        cr_assert_eq(fy_tune_job(&c, &bal), FY_OK);
        expect_whole_job(&c, &bal);
        cr_expect(bal.rank[1].plan.grad_accum < bal.rank[0].plan.grad_accum, "%d ranks: the slow rank "
                  "%d micro-batches, the fast %d", nranks, bal.rank[1].plan.grad_accum,
                  bal.rank[0].plan.grad_accum);
        const double least = job_enumerated(&c);
        cr_expect(bal.step_ms <= least * (1 + 1e-9), "%d ranks: balanced %.6f ms, the enumeration's "
                  "least %.6f", nranks, bal.step_ms, least);
        c.shares = FY_JOB_EQUAL;
        cr_assert_eq(fy_tune_job(&c, &eq), FY_OK);
        expect_whole_job(&c, &eq);
        for (int r = 0; r < nranks; r++) cr_expect_eq(eq.rank[r].plan.grad_accum, c.rank_batch / eq.micro);
        cr_expect(bal.step_ms <= eq.step_ms, "%d ranks: balanced %.6f ms, equal %.6f", nranks,
                  bal.step_ms, eq.step_ms);
        cr_expect(bal.step_ms < 0.9 * eq.step_ms, "%d ranks: balancing a rank twice as slow gains "
                  "(%.6f ms, equal %.6f)", nranks, bal.step_ms, eq.step_ms);
        const double least_eq = job_enumerated(&c);
        cr_expect(eq.step_ms <= least_eq * (1 + 1e-9), "%d ranks: equal %.6f ms, the enumeration's "
                  "%.6f", nranks, eq.step_ms, least_eq);
        fy_job_result_free(&bal);
        fy_job_result_free(&eq);
    }
}

/* A rank ten times slower than the other, both given plans of micro-batches of 1: its
 * best share (2 of 24) lies further from equal shares (12 each) than the single moves that
 * end the search reach (4 a rank, 8 in all), so the rounds' balance of the ranks' fitted
 * lines must find it. */
Test(job, a_much_slower_rank_is_balanced_far_from_equal_shares) {
    fy_profile ps[2] = {named_profile("a100-40gb-pcie4"), named_profile("a100-40gb-pcie4")};
    fy_profile_slow(&ps[0], 50);
    fy_profile_slow(&ps[1], 500);
    fy_plan resident;
    cr_assert_eq(fy_plan_new(job_model, 1, 12, &resident), FY_OK);
    fy_job_rank ranks[2] = {job_rank(&ps[0], (size_t)64 << 20), job_rank(&ps[1], (size_t)64 << 20)};
    ranks[0].plan = ranks[1].plan = &resident;
    fy_job_cfg c = job_cfg(ranks, 2, 12, FY_JOB_BALANCED);
    c.seq = 256;
    fy_job_result res;
    cr_assert_eq(fy_tune_job(&c, &res), FY_OK);
    expect_whole_job(&c, &res);
    const double least = job_enumerated(&c);
    cr_expect(res.step_ms <= least * (1 + 1e-9), "%.6f ms (counts %d %d), the enumeration's %.6f",
              res.step_ms, res.rank[0].plan.grad_accum, res.rank[1].plan.grad_accum, least);
    cr_expect(res.rank[1].plan.grad_accum < 12 - 8, "the slow rank's share %d: over 8 moves from 12",
              res.rank[1].plan.grad_accum);
    fy_job_result_free(&res);
    fy_plan_free(&resident);
}

/* Offloaded layers of a plan: recomputed, streamed, cpu-optimised. */
static int moved_layers(const fy_plan *p) {
    int k = 0;
    for (int b = 0; b < p->nblocks; b++)
        k += (p->blocks[b].acts == FY_ACTS_RECOMPUTE) + (p->blocks[b].weights == FY_ON_HOST) +
             (p->blocks[b].update == FY_UPDATE_CPU);
    return k;
}

/* Device budgets 4x apart on one machine, the small one below the large rank's plan: each
 * rank's plan fits its own budget, the small rank's moving more off the device. The one
 * plan baseline runs one plan on every rank, within the least budget, never faster than
 * each rank its own (1%: the pruned search's misses, test tune above). */
Test(job, each_rank_plans_within_its_own_budget) {
    const fy_profile p = named_profile("a100-40gb-pcie4");
    const size_t big = (size_t)32 << 20, small_budget = (size_t)8 << 20;
    const fy_job_rank ranks[2] = {job_rank(&p, big), job_rank(&p, small_budget)};
    for (int s = 0; s < 2; s++) {
        fy_job_cfg c = job_cfg(ranks, 2, 4, s ? FY_JOB_BALANCED : FY_JOB_EQUAL);
        fy_job_result own, one;
        cr_assert_eq(fy_tune_job(&c, &own), FY_OK);
        expect_whole_job(&c, &own);
        for (int r = 0; r < 2; r++)
            cr_expect(own.rank[r].mem.device_total <= ranks[r].device_budget, "shares %d rank %d: %zu "
                      "bytes of %zu", s, r, own.rank[r].mem.device_total, ranks[r].device_budget);
        cr_expect(own.rank[0].mem.device_total > small_budget, "shares %d: the large rank's plan (%zu "
                  "bytes) would not fit the small budget", s, own.rank[0].mem.device_total);
        cr_expect(own.rank[1].k2 + own.rank[1].k3 > own.rank[0].k2 + own.rank[0].k3,
                  "shares %d: small rank streams %d, cpu-optimises %d; large %d, %d", s, own.rank[1].k2,
                  own.rank[1].k3, own.rank[0].k2, own.rank[0].k3);
        cr_expect(moved_layers(&own.rank[1].plan) > moved_layers(&own.rank[0].plan), "shares %d", s);
        cr_expect(own.rank[1].mem.host_total > own.rank[0].mem.host_total, "shares %d", s);
        cr_expect(own.step_ms <= job_enumerated(&c) * (1 + 1e-9), "shares %d", s);

        c.one_plan = true;
        cr_assert_eq(fy_tune_job(&c, &one), FY_OK);
        expect_whole_job(&c, &one);
        for (int r = 0; r < 2; r++) {
            fy_plan q;
            cr_assert_eq(fy_plan_copy(&one.rank[r].plan, &q), FY_OK);
            q.grad_accum = one.rank[0].plan.grad_accum; /* balanced shares may differ */
            cr_expect(fy_plan_equal(&q, &one.rank[0].plan), "shares %d: rank %d's plan is rank 0's", s, r);
            fy_plan_free(&q);
            cr_expect(one.rank[r].mem.device_total <= small_budget, "shares %d rank %d: %zu bytes", s, r,
                      one.rank[r].mem.device_total);
        }
        if (!s)
            cr_expect(fy_plan_equal(&one.rank[0].plan, &one.rank[1].plan), "equal shares: one plan");
        cr_expect(own.step_ms <= one.step_ms * 1.01, "shares %d: own plans %.6f ms, one plan %.6f "
                  "(1%%: the pruned search's ties)", s, own.step_ms, one.step_ms);
        fy_job_result_free(&own);
        fy_job_result_free(&one);
    }
}

/* Plans given to the ranks: they must agree on the micro-batch size (and it must divide a
 * rank's batch); the job keeps every block as given and only shares the micro-batches,
 * balanced to the least step over every count vector. */
Test(job, given_plans_are_kept_and_shared) {
    fy_profile ps[2] = {named_profile("h100-80gb-pcie5"), named_profile("h100-80gb-pcie5")};
    fy_profile_slow(&ps[0], 50); /* compute-bound, as above */
    fy_profile_slow(&ps[1], 100);
    fy_plan streamed, cpu_opt, other_micro;
    cr_assert_eq(fy_plan_new(job_model, 2, 2, &streamed), FY_OK);
    cr_assert_eq(fy_plan_shorthands(&streamed, 0.5, 0, 1), FY_OK);
    cr_assert_eq(fy_plan_new(job_model, 2, 2, &cpu_opt), FY_OK);
    cr_assert_eq(fy_plan_shorthands(&cpu_opt, 0, 0.5, 0), FY_OK);
    cr_assert_eq(fy_plan_new(job_model, 1, 4, &other_micro), FY_OK);
    fy_job_rank ranks[2] = {job_rank(&ps[0], (size_t)64 << 20), job_rank(&ps[1], (size_t)64 << 20)};
    ranks[0].plan = &streamed;
    ranks[1].plan = &other_micro;
    fy_job_cfg c = job_cfg(ranks, 2, 4, FY_JOB_BALANCED);
    c.seq = 256;
    fy_job_result res;
    cr_expect_eq(fy_tune_job(&c, &res), FY_ERR_INVALID, "micro-batches of 2 and 1");
    cr_expect(strstr(fy_last_error(), "micro-batches of 2 and 1") != NULL, "%s", fy_last_error());
    ranks[1].plan = &cpu_opt;
    c.rank_batch = 3; /* 6 sequences: 3 micro-batches of 2, shared unequally but not equally */
    c.shares = FY_JOB_EQUAL;
    cr_expect_eq(fy_tune_job(&c, &res), FY_ERR_INVALID, "equal shares of a batch of 3 in micro-batches of 2");
    c.shares = FY_JOB_BALANCED;
    cr_assert_eq(fy_tune_job(&c, &res), FY_OK, "3 micro-batches of 2 over 2 ranks");
    expect_whole_job(&c, &res);
    fy_job_result_free(&res);
    c.rank_batch = 8;
    for (int s = 0; s < 2; s++) {
        c.shares = s ? FY_JOB_BALANCED : FY_JOB_EQUAL;
        cr_assert_eq(fy_tune_job(&c, &res), FY_OK);
        expect_whole_job(&c, &res);
        cr_expect_eq(res.micro, 2);
        const double least = job_enumerated(&c);
        cr_expect(res.step_ms <= least * (1 + 1e-9), "shares %d: %.6f ms, the enumeration's %.6f", s,
                  res.step_ms, least);
        for (int r = 0; r < 2; r++) {
            fy_plan q;
            cr_assert_eq(fy_plan_copy(ranks[r].plan, &q), FY_OK);
            q.grad_accum = res.rank[r].plan.grad_accum;
            cr_expect(fy_plan_equal(&q, &res.rank[r].plan), "shares %d rank %d: the given plan", s, r);
            fy_plan_free(&q);
        }
        if (s)
            cr_expect(res.rank[1].plan.grad_accum < res.rank[0].plan.grad_accum, "slow rank %d, fast %d",
                      res.rank[1].plan.grad_accum, res.rank[0].plan.grad_accum);
        else
            cr_expect(res.rank[0].plan.grad_accum == 4 && res.rank[1].plan.grad_accum == 4);
        fy_job_result_free(&res);
    }
    fy_plan_free(&streamed);
    fy_plan_free(&cpu_opt);
    fy_plan_free(&other_micro);
}

/* A rank whose budget fits no plan fails the job, the error naming that rank; so does a
 * least budget no one plan fits. */
/* At the accumulation limit: ranks whose given plans accumulate FY_PLAN_MAX_ACCUM each,
 * the slower with the fewer, and no prediction of a count past the limit (the balance's
 * lines were once fitted at count + 1, past the step graph's arrays). */
Test(job, counts_at_the_accumulation_limit) {
    fy_profile ps[2] = {named_profile("h100-80gb-pcie5"), named_profile("h100-80gb-pcie5")};
    fy_profile_slow(&ps[0], 1000); /* compute-bound at this size, the second rank 3x slower */
    fy_profile_slow(&ps[1], 3000);
    fy_model *m;
    cr_assert_eq(fy_model_named("gpt2-tiny", NULL, &m), FY_OK);
    fy_plan p;
    cr_assert_eq(fy_plan_new(m, 1, FY_PLAN_MAX_ACCUM, &p), FY_OK);
    fy_job_rank ranks[2] = {job_rank(&ps[0], (size_t)1 << 30), job_rank(&ps[1], (size_t)1 << 30)};
    ranks[0].plan = ranks[1].plan = &p;
    fy_job_cfg c = job_cfg(ranks, 2, FY_PLAN_MAX_ACCUM, FY_JOB_BALANCED);
    c.model = m;
    c.seq = 16;
    c.window = 1;
    fy_job_result res;
    cr_assert_eq(fy_tune_job(&c, &res), FY_OK, "%s", fy_last_error());
    cr_expect_eq(res.rank[0].plan.grad_accum, FY_PLAN_MAX_ACCUM, "the full rank at the limit");
    cr_expect_eq(res.rank[1].plan.grad_accum, FY_PLAN_MAX_ACCUM);
    fy_job_result_free(&res);
    c.rank_batch = FY_PLAN_MAX_ACCUM / 2; /* room to move: the slower rank takes fewer */
    cr_assert_eq(fy_tune_job(&c, &res), FY_OK, "%s", fy_last_error());
    expect_whole_job(&c, &res);
    cr_expect_lt(res.rank[1].plan.grad_accum, res.rank[0].plan.grad_accum);
    fy_job_result_free(&res);
    fy_plan_free(&p);
    fy_model_free(m);
}

Test(job, a_rank_no_plan_fits_is_named) {
    const fy_profile p = named_profile("a100-40gb-pcie4");
    const size_t mib = (size_t)1 << 20;
    for (int bad = 0; bad < 2; bad++)
        for (int one = 0; one < 2; one++) {
            fy_job_rank ranks[2] = {job_rank(&p, 64 * mib), job_rank(&p, 64 * mib)};
            ranks[bad].device_budget = mib;
            fy_job_cfg c = job_cfg(ranks, 2, 4, FY_JOB_BALANCED);
            c.one_plan = one;
            fy_job_result res;
            cr_expect_eq(fy_tune_job(&c, &res), FY_ERR_INVALID, "rank %d, one plan %d", bad, one);
            char want[32];
            snprintf(want, sizeof want, one ? "one plan for every rank" : "rank %d", bad);
            cr_expect(strstr(fy_last_error(), want) != NULL, "rank %d, one plan %d: %s", bad, one,
                      fy_last_error());
            if (!one) {
                snprintf(want, sizeof want, "rank %d", !bad);
                cr_expect(strstr(fy_last_error(), want) == NULL, "names rank %d: %s", !bad, fy_last_error());
            }
            cr_expect(res.rank == NULL, "nothing left to free");
        }
}

/* Random jobs (2 or 3 ranks of the named profiles, each slowed 1x to 150x, budgets from
 * tight to ample, fp32 or bf16, the tie margin or none, own plans or one plan): every rank
 * within its budget (one plan: the least), balanced shares never slower than equal ones,
 * and with each rank its own plan both the least the enumeration finds. */
Test(job, random_jobs_are_the_least_the_enumeration_finds, .timeout = 120) {
    static const char *const names[] = {"a100-40gb-pcie4", "a100-80gb-pcie4", "rtx4090-pcie4",
                                        "h100-80gb-pcie5", "h200-141gb"};
    static const double slows[] = {1, 30, 50, 75, 100, 150};
    static const size_t budget_mib[2][4] = {{6, 8, 12, 32}, {8, 12, 20, 64}}; /* seq 64, 256 */
    static const int rank_batches[] = {4, 6, 8};
    uint64_t seed = 12345;
    int enumerated = 0, one_plans = 0, refused = 0;
    for (int trial = 0; trial < 48; trial++) {
        const int N = 2 + (unit_rand(&seed) < 0.5), big = unit_rand(&seed) < 0.5;
        fy_profile ps[3];
        fy_profile *links[3];
        fy_job_rank ranks[3];
        size_t least = SIZE_MAX;
        for (int r = 0; r < N; r++) {
            ps[r] = named_profile(names[(int)(unit_rand(&seed) * 5)]);
            fy_profile_slow(&ps[r], slows[(int)(unit_rand(&seed) * 6)]);
            links[r] = &ps[r];
        }
        fy_job_share_links(links, N);
        for (int r = 0; r < N; r++) {
            ranks[r] = job_rank(&ps[r], budget_mib[big][(int)(unit_rand(&seed) * 4)] << 20);
            least = ranks[r].device_budget < least ? ranks[r].device_budget : least;
        }
        fy_job_cfg c = job_cfg(ranks, N, rank_batches[(int)(unit_rand(&seed) * 3)], FY_JOB_BALANCED);
        c.seq = big ? 256 : 64;
        c.tie_margin = unit_rand(&seed) < 0.5 ? 0 : FY_TUNE_TIE_MARGIN;
        c.one_plan = unit_rand(&seed) < 0.3;
        c.dtype = unit_rand(&seed) < 0.5 ? FY_BF16 : FY_F32;
        fy_job_result bal, eq;
        const fy_log_level lvl = fy_log_get_level();
        fy_log_set_level(FY_LOG_QUIET); /* 8 MiB fits no plan at seq 256 */
        const fy_status st = fy_tune_job(&c, &bal);
        fy_log_set_level(lvl);
        if (st != FY_OK) {
            cr_expect_eq(st, FY_ERR_INVALID);
            cr_expect(strstr(fy_last_error(), "no plan of the job fits") != NULL, "trial %d: %s", trial,
                      fy_last_error());
            fy_job_rank at_least[3];
            for (int r = 0; r < N; r++) {
                at_least[r] = ranks[r];
                if (c.one_plan) at_least[r].device_budget = least;
            }
            fy_job_cfg e = c;
            e.ranks = at_least;
            e.shares = FY_JOB_EQUAL;
            cr_expect(isinf(job_enumerated(&e)), "trial %d: refused, yet each rank has a plan", trial);
            refused++;
            continue;
        }
        expect_whole_job(&c, &bal);
        for (int r = 0; r < N; r++)
            cr_expect(bal.rank[r].mem.device_total <= (c.one_plan ? least : ranks[r].device_budget),
                      "trial %d rank %d: %zu bytes", trial, r, bal.rank[r].mem.device_total);
        c.shares = FY_JOB_EQUAL;
        cr_assert_eq(fy_tune_job(&c, &eq), FY_OK, "trial %d: balanced shares fit, equal do not", trial);
        expect_whole_job(&c, &eq);
        cr_expect(bal.step_ms <= eq.step_ms, "trial %d: balanced %.6f ms, equal %.6f", trial, bal.step_ms,
                  eq.step_ms);
        if (c.one_plan) {
            one_plans++;
        } else {
            const double least_eq = job_enumerated(&c);
            c.shares = FY_JOB_BALANCED;
            const double least_bal = job_enumerated(&c);
            cr_expect(bal.step_ms <= least_bal * (1 + 1e-9), "trial %d: balanced %.6f ms, the "
                      "enumeration's %.6f", trial, bal.step_ms, least_bal);
            cr_expect(eq.step_ms <= least_eq * (1 + 1e-9), "trial %d: equal %.6f ms, the enumeration's "
                      "%.6f", trial, eq.step_ms, least_eq);
            enumerated++;
        }
        fy_job_result_free(&bal);
        fy_job_result_free(&eq);
    }
    cr_expect(enumerated >= 20 && one_plans >= 8 && refused >= 2, "%d jobs enumerated, %d of one plan, %d "
              "refused", enumerated, one_plans, refused);
}

/* The tiers past host memory enter the search only where memory runs out: a host budget
 * below the fully offloaded plan's is met by keeping the fewest layers' state on disk
 * (within the disk budget, costed at the profile's disk rates: the disk lane is busy),
 * and nothing fits without a disk budget; a device budget below the all-streamed,
 * all-recomputed plan's is met by offloading the fewest layers' inputs. */
Test(tune, the_tiers_take_over_where_memory_runs_out, .timeout = 120) {
    /* many layers and a small vocabulary: state on disk saves more host memory than the
     * disk slots (three times a layer's master and moments) take */
    const fy_gpt2_config deep_cfg = {.vocab = 64, .max_seq = 32, .channels = 32, .layers = 12, .heads = 4};
    fy_model *deep;
    cr_assert_eq(fy_gpt2_new(&deep_cfg, NULL, &deep), FY_OK);
    fy_profile p = base_profile();
    p.disk_read_gbps = p.disk_write_gbps = 1;
    const int L = deep_cfg.layers;
    fy_mem_model full, ondisk, acts;
    fy_plan q = point(deep, 4, 4, L, L, L, FY_BF16, &full);
    cr_assert_eq(fy_plan_disk(&q, 1.0), FY_OK);
    fy_storage_model(deep, &q, 16, &ondisk);
    fy_plan_free(&q);
    cr_assert_lt(ondisk.host_total, full.host_total);
    fy_tune_cfg c = base_cfg(full.device_total);
    c.model = deep;
    c.dtype = FY_BF16;
    c.micro = 4;
    c.host_budget = (ondisk.host_total + full.host_total) / 2;
    fy_tune_result top[3];
    int n, ne;
    cr_expect_eq(fy_tune(&p, &c, top, 3, &n, &ne), FY_ERR_INVALID, "no disk: nothing fits");
    c.disk_budget = (size_t)1 << 30;
    cr_assert_eq(fy_tune(&p, &c, top, 3, &n, &ne), FY_OK);
    for (int i = 0; i < n; i++) {
        cr_expect_gt(top[i].k5, 0, "plan %d keeps state on disk", i);
        cr_expect(top[i].mem.host_total <= c.host_budget && top[i].mem.disk_total > 0 &&
                  top[i].mem.disk_total <= c.disk_budget, "plan %d within the budgets", i);
        cr_expect_gt(top[i].busy_ms[FY_LANE_DISK], 0.0, "the disk lane is costed");
        cr_expect(fy_plan_uses_disk(&top[i].plan));
    }
    free_top(top, n);
    /* the device: below the all-streamed, all-recomputed floor, inputs go to the host */
    q = point(deep, 4, 1, L, L, L, FY_F32, &full);
    cr_assert_eq(fy_plan_offload_acts(&q, 1.0), FY_OK);
    fy_storage_model(deep, &q, 16, &acts);
    fy_plan_free(&q);
    cr_assert_lt(acts.device_total, full.device_total, "offloading every input saves device memory");
    c = base_cfg(full.device_total - 1);
    c.model = deep;
    c.micro = 1;
    cr_assert_eq(fy_tune(&p, &c, top, 3, &n, &ne), FY_OK);
    for (int i = 0; i < n; i++) {
        cr_expect_gt(top[i].k6, 0, "plan %d offloads inputs", i);
        cr_expect_leq(top[i].mem.device_total, c.device_budget);
    }
    free_top(top, n);
    fy_model_free(deep);
}
