/* test_dp.c — data parallel over MPI on the cpu backend: ferry under `mpirun -np N`
 * against one process accumulating N micro-batches (the same micro-batches, in the same
 * order: comm.h's rank-order sums make them the same bits), and a job's failures.
 * Built where meson finds MPI and mpirun ($MPIRUN); as root it needs Open MPI's
 * OMPI_ALLOW_RUN_AS_ROOT variables (the test environment sets them). */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <ftw.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "tests/test_util.h"

static char g_dir[64];

static void make_dir(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/ferry-test-dp-XXXXXX");
    cr_assert_not_null(mkdtemp(g_dir), "mkdtemp: %s", strerror(errno));
}
static void remove_dir(void) { test_remove_tree(g_dir); }
TestSuite(dp, .init = make_dir, .fini = remove_dir, .timeout = 300);

static const char *path_in(const char *name) {
    static char b[4][512];
    static int k;
    char *p = b[k++ % 4];
    snprintf(p, 512, "%s/%s", g_dir, name);
    return p;
}

/* mpirun with args (its own, then ferry's). */
static void run_mpirun(test_proc *r, const char *const *args) {
    const char *bin = getenv("FERRY_BIN"), *mpirun = getenv("MPIRUN");
    cr_assert(bin && mpirun, "FERRY_BIN and MPIRUN");
    char *saved = strdup(bin);
    setenv("FERRY_BIN", mpirun, 1);
    test_run_ferry(r, g_dir, 240, args);
    setenv("FERRY_BIN", saved, 1);
    free(saved);
}

/* ferry with args, alone (np 0) or as np processes under mpirun. */
static void run(test_proc *r, int np, const char *const *args) {
    if (np == 0) {
        test_run_ferry(r, g_dir, 240, args);
        return;
    }
    const char *a[64];
    char nps[16];
    snprintf(nps, sizeof nps, "%d", np);
    int n = 0;
    a[n++] = "-np";
    a[n++] = nps;
    a[n++] = "--oversubscribe"; /* more ranks than this machine's cores */
    a[n++] = getenv("FERRY_BIN");
    for (int i = 0; args[i]; i++) {
        cr_assert_lt(n, 62);
        a[n++] = args[i];
    }
    a[n] = NULL;
    run_mpirun(r, a);
}
#define FERRY(r, np, ...) run((r), (np), (const char *const[]){__VA_ARGS__, NULL})

static int count_stops(const char *err) {
    int n = 0;
    for (const char *p = err; (p = strstr(p, "stopping after this step")); p++) n++;
    return n;
}

static char *slurp(const char *path) { return test_read_file(path, NULL); }

/* The loss and grad_norm (and val_loss, where there is one) fields of every metrics
 * line, in order. */
static void losses_of(const char *path, char *out, size_t cap) {
    char *m = slurp(path), *save = NULL;
    size_t len = 0;
    out[0] = 0;
    for (char *line = strtok_r(m, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        const char *l = strstr(line, "\"loss\":"), *g = strstr(line, "\"grad_norm\":");
        cr_assert(l && g, "metrics line: %s", line);
        const char *v = strstr(line, "\"val_loss\":");
        len += (size_t)snprintf(out + len, cap - len, "%.24s|%.24s|%.24s\n", l, g, v ? v : "");
    }
    free(m);
}

/* One process accumulating `np` micro-batches against np processes of one each, under
 * the extra flags: the saved weights byte for byte, every step's loss and gradient norm,
 * and the validation loss (5 batches, split over the ranks). */
static void expect_same_runs(int np, const char *const *extra, const char *const *one_extra,
                             const char *const *many_extra, const char *what);

static void expect_same_run(int np, const char *const *extra, const char *what) {
    char acc[8];
    snprintf(acc, sizeof acc, "%d", np);
    expect_same_runs(np, extra, (const char *const[]){"--grad-accum", acc, NULL},
                     (const char *const[]){NULL}, what);
}

/* The same with flags for the one process and for the np processes (a plan file each:
 * its accumulation is the plan's). */
static void expect_same_runs(int np, const char *const *extra, const char *const *one_extra,
                             const char *const *many_extra, const char *what) {
    const char *base[] = {"train", "--device", "cpu", "--threads", "1", "--seq", "32",
                          "--batch", "2", "--steps", "5", "--val-batches", "5"};
    const size_t nb = sizeof base / sizeof base[0];
    const char *a1[48], *a2[48];
    size_t n1 = 0, n2 = 0;
    for (size_t i = 0; i < nb; i++) a1[n1++] = a2[n2++] = base[i];
    for (int i = 0; extra[i]; i++) a1[n1++] = a2[n2++] = extra[i];
    const char *w1 = path_in("one.safetensors"), *w2 = path_in("many.safetensors");
    const char *m1 = path_in("one.jsonl"), *m2 = path_in("many.jsonl");
    unlink(w1); unlink(w2); unlink(m1); unlink(m2);
    for (int i = 0; one_extra[i]; i++) a1[n1++] = one_extra[i];
    for (int i = 0; many_extra[i]; i++) a2[n2++] = many_extra[i];
    a1[n1++] = "--save"; a1[n1++] = w1;
    a1[n1++] = "--metrics"; a1[n1++] = m1;
    a1[n1] = NULL;
    a2[n2++] = "--save"; a2[n2++] = w2;
    a2[n2++] = "--metrics"; a2[n2++] = m2;
    a2[n2] = NULL;
    test_proc r1, r2;
    run(&r1, 0, a1);
    cr_assert_eq(r1.code, 0, "%s: one process: %s", what, r1.err);
    run(&r2, np, a2);
    cr_assert_eq(r2.code, 0, "%s: %d processes: %s", what, np, r2.err);
    size_t s1, s2;
    char *b1 = test_read_file(w1, &s1), *b2 = test_read_file(w2, &s2);
    cr_expect(s1 == s2 && !memcmp(b1, b2, s1), "%s: the weights of %d processes differ from "
              "one process accumulating %d", what, np, np);
    char l1[4096], l2[4096];
    losses_of(m1, l1, sizeof l1);
    losses_of(m2, l2, sizeof l2);
    cr_expect_str_eq(l2, l1, "%s: losses and norms", what);
    /* rank 0 alone reports: one summary line, whose memory model is its rank's (its
     * shards of the optimizer state) and equals its measured device peak */
    const char *done = strstr(r2.out, "done ");
    cr_expect(done && !strstr(done + 1, "done "), "%s: one report, from rank 0:\n%s", what, r2.out);
    char peak[32] = "", model[32] = "";
    const char *pk = done ? strstr(done, "device peak ") : NULL;
    cr_assert(pk && sscanf(pk, "device peak %31[^(](model %31[^)])", peak, model) == 2, "%s: %s", what, done);
    peak[strlen(peak) - 1] = 0; /* the space before "(model" */
    cr_expect_str_eq(model, peak, "%s: rank 0's memory model against its peak", what);
    free(b1);
    free(b2);
}

#define EXTRA(...) (const char *const[]){__VA_ARGS__, NULL}

Test(dp, two_ranks_match_one_rank_accumulating_two_all_resident) {
    expect_same_run(2, EXTRA("--model", "gpt2-tiny"), "gpt2-tiny fp32");
    expect_same_run(2, EXTRA("--model", "gpt2-tiny", "--dtype", "bf16"), "gpt2-tiny bf16");
}

Test(dp, two_ranks_match_one_rank_accumulating_two_with_offload) {
    expect_same_run(2, EXTRA("--model", "gpt2-tiny", "--offload-params", "0.5", "--offload-optim",
                             "0.5", "--ckpt-layers", "1"), "gpt2-tiny, mixed plan");
    /* llama: the gathered embedding and the head by vocabulary chunks, summed on the host */
    expect_same_run(2, EXTRA("--model", "llama-tiny", "--vocab", "4096", "--offload-params", "1",
                             "--offload-optim", "1", "--dtype", "bf16"), "llama-tiny offloaded, bf16");
    /* streamed and updated on the device: the update's slot holds the shard's fp32 master
     * and its bf16 copy (bf16), or the whole fp32 weights (fp32) */
    expect_same_run(2, EXTRA("--model", "gpt2-tiny", "--offload-params", "1", "--dtype", "bf16"),
                    "gpt2-tiny streamed, device updates, bf16");
    expect_same_run(2, EXTRA("--model", "gpt2-tiny", "--offload-params", "1"),
                    "gpt2-tiny streamed, device updates, fp32");
    /* a step whose norm is not finite (the test hook makes step 3's NaN) is skipped by
     * every rank together, each restoring its shard of the weights its gradient had
     * landed in (bf16, and fp32's copy apart from the masters) and gathering the others' */
    setenv("FERRY_TEST_NAN_STEP", "3", 1);
    expect_same_run(2, EXTRA("--model", "gpt2-tiny", "--offload-optim", "1", "--dtype", "bf16"),
                    "gpt2-tiny, a skipped step, bf16");
    expect_same_run(2, EXTRA("--model", "gpt2-tiny", "--offload-optim", "1"),
                    "gpt2-tiny, a skipped step, fp32");
    unsetenv("FERRY_TEST_NAN_STEP");
}

/* A plan file for gpt2-tiny (2 layers) with accumulation `accum`: each block's weights
 * (device|host) and update (gpu|cpu) from the strings, in block order. */
static const char *tiny_plan(const char *name, int accum, const char *dtype, const char *const w[4],
                             const char *const u[4]) {
    static const char *const blocks[4] = {"embed", "layer.0", "layer.1", "head"};
    const char *path = path_in(name);
    FILE *f = fopen(path, "w");
    cr_assert(f, "%s", path);
    fprintf(f, "{\"format\": \"ferry-plan\", \"version\": 2, \"layers\": 2, \"micro_batch\": 2, "
               "\"grad_accum\": %d, \"dtype\": \"%s\", \"blocks\": [", accum, dtype);
    for (int b = 0; b < 4; b++)
        fprintf(f, "%s{\"block\": \"%s\", \"weights\": \"%s\", \"update\": \"%s\", \"acts\": \"keep\"}",
                b ? ", " : "", blocks[b], w[b], u[b]);
    fprintf(f, "]}\n");
    fclose(f);
    return path;
}

/* Irregular plans in a job of np ranks against one process accumulating np (plans that
 * crashed or saved the wrong master before the layout, issue 27: a streamed head updated on
 * the CPU beside streamed blocks updated on the device, fp32 and bf16; a resident embedding
 * updated on the CPU, whose shard on rank 0 is empty, beside device-updated blocks, bf16). */
Test(dp, irregular_plans_match_one_process, .timeout = 300) {
    struct { int np; const char *dtype; const char *w[4], *u[4]; } cases[] = {
        {2, "fp32", {"host", "device", "host", "host"}, {"gpu", "gpu", "gpu", "cpu"}},
        {3, "bf16", {"device", "host", "host", "host"}, {"gpu", "gpu", "gpu", "cpu"}},
        {3, "bf16", {"device", "device", "device", "host"}, {"cpu", "gpu", "gpu", "gpu"}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char what[64], one[32], many[32];
        snprintf(what, sizeof what, "irregular plan %zu, %d ranks, %s", i, cases[i].np, cases[i].dtype);
        snprintf(one, sizeof one, "one_%zu.json", i);
        snprintf(many, sizeof many, "many_%zu.json", i);
        const char *p1 = tiny_plan(one, cases[i].np, cases[i].dtype, cases[i].w, cases[i].u);
        char *p1c = strdup(p1);
        const char *pn = tiny_plan(many, 1, cases[i].dtype, cases[i].w, cases[i].u);
        char *pnc = strdup(pn);
        expect_same_runs(cases[i].np, EXTRA("--model", "gpt2-tiny"), EXTRA("--plan", p1c),
                         EXTRA("--plan", pnc), what);
        free(p1c);
        free(pnc);
    }
}

/* Three ranks: shards of unequal size, empty ones (a block of one norm chunk is wholly
 * the last rank's), the weight-decay cut inside a shard. */
Test(dp, three_ranks_match_one_rank_accumulating_three) {
    expect_same_run(3, EXTRA("--model", "gpt2-tiny", "--offload-params", "0.5", "--offload-optim",
                             "0.5", "--dtype", "bf16"), "gpt2-tiny, 3 ranks, mixed plan, bf16");
}

/* Sums in rank order: four ranks give one process's four accumulated micro-batches
 * exactly, not within a bound. */
Test(dp, four_ranks_match_one_rank_accumulating_four) {
    expect_same_run(4, EXTRA("--model", "gpt2-tiny", "--offload-optim", "1"), "gpt2-tiny, 4 ranks");
}

Test(dp, every_rank_prints_its_memory_model) {
    test_proc r;
    FERRY(&r, 2, "train", "--model", "gpt2-tiny", "--device", "cpu", "--dry-run");
    cr_assert_eq(r.code, 0, "%s", r.err);
    cr_expect(strstr(r.out, "{\"rank\":0,\"ranks\":2,") && strstr(r.out, "{\"rank\":1,\"ranks\":2,"),
              "a JSON line from each rank:\n%s", r.out);
}

/* Ranks the launcher did not bind take their share of their node's CPUs (comm.h:
 * fy_comm_place), so their kernels and CPU AdamW pools do not share cores: two ranks on
 * a machine of two or more cores run on different ones. Ranks the launcher bound (Open
 * MPI's binding policy "core") keep its binding. */
Test(dp, unbound_ranks_take_their_share_of_the_cpus) {
    if (sysconf(_SC_NPROCESSORS_ONLN) < 2) cr_skip_test("one core");
    for (int bind = 0; bind < 2; bind++) {
        setenv("OMPI_MCA_hwloc_base_binding_policy", bind ? "core" : "none", 1);
        test_proc r;
        FERRY(&r, 2, "train", "--model", "gpt2-tiny", "--device", "cpu", "--dry-run");
        unsetenv("OMPI_MCA_hwloc_base_binding_policy");
        cr_assert_eq(r.code, 0, "%s", r.err);
        char cpus[2][64] = {"", ""};
        for (int k = 0; k < 2; k++) {
            char key[32];
            snprintf(key, sizeof key, "{\"rank\":%d,", k);
            const char *line = strstr(r.out, key), *p = line ? strstr(line, "\"placed\":\"cpus ") : NULL;
            cr_assert(p, "rank %d's placement:\n%s", k, r.out);
            sscanf(p + strlen("\"placed\":\"cpus "), "%63[^,]", cpus[k]);
            const char *end = strchr(p + 10, '"');
            const bool said = strstr(p, "bound by the launcher") && strstr(p, "bound by the launcher") < end;
            cr_expect(said == (bind == 1), "binding %d: %.80s", bind, p);
        }
        cr_expect(strcmp(cpus[0], cpus[1]) != 0, "binding %d: both ranks on cpus %s", bind, cpus[0]);
    }
}

/* The host bytes of a job's ranks (--dry-run's memory model, which equals what they
 * allocate): each holds its shard of the masters and moments (ZeRO), so two ranks of a
 * fully offloaded bf16 run hold at most 1.25x one process's (2 + 12/2 bytes a parameter
 * each against 14), and an fp32 run's 1.25x and its few constant buffers (4 +
 * 12/2 against 16: the fp32 weights compute reads stay whole on every rank, the
 * gradient landing in them). */
static size_t json_size(const char *line, const char *key) {
    const char *p = strstr(line, key);
    cr_assert(p, "%s in %s", key, line);
    return (size_t)strtoull(p + strlen(key), NULL, 10);
}

Test(dp, ranks_hold_their_shards_of_the_optimizer_state) {
    for (int fp32 = 0; fp32 < 2; fp32++) {
        test_proc r1, r2;
#define ARGS "train", "--model", "gpt2-mini", "--device", "cpu", "--dry-run", "--offload-params", \
        "1", "--offload-optim", "1", "--dtype", fp32 ? "fp32" : "bf16"
        FERRY(&r1, 0, ARGS);
        FERRY(&r2, 2, ARGS);
#undef ARGS
        cr_assert_eq(r1.code, 0, "%s", r1.err);
        cr_assert_eq(r2.code, 0, "%s", r2.err);
        const char *one = strstr(r1.out, "{\"params\""), *a = strstr(r2.out, "{\"rank\":0,"),
                   *b = strstr(r2.out, "{\"rank\":1,");
        cr_assert(one && a && b, "%s\n%s", r1.out, r2.out);
        const size_t h1 = json_size(one, "\"host_bytes\":"),
                     h2 = json_size(a, "\"host_bytes\":") + json_size(b, "\"host_bytes\":");
        const size_t o1 = json_size(one, "\"optimizer\":"),
                     o2 = json_size(a, "\"optimizer\":") + json_size(b, "\"optimizer\":");
        cr_expect((double)o2 <= 1.01 * (double)o1, "%s: optimizer state %zu on two ranks, %zu on one",
                  fp32 ? "fp32" : "bf16", o2, o1);
        /* fp32's floor is 1.25x plus the per-rank constants and the partial last chunks
         * (1.2501x for gpt2-124m, 1.251x for this gpt2-mini) */
        cr_expect((double)h2 <= (fp32 ? 1.26 : 1.25) * (double)h1,
                  "%s: host bytes %zu on two ranks, %zu on one", fp32 ? "fp32" : "bf16", h2, h1);
    }
}

/* Checkpoints of a job are rank 0's, its shards of the optimizer state gathered from
 * the other ranks, and resume on another world size with the same sequences per step
 * (each rank keeping its shard): 2 processes for 4 steps then one accumulating 2 for 4
 * more, and the other way round, give the weights of one process never stopped, byte for
 * byte; all-resident in fp32 (the moments on the device gathered) and in bf16 (the
 * device's fp32 masters too), and with the optimizer on the CPU in bf16 (the host's). */
static void expect_resume_across_world_sizes(const char *dtype, const char *optim) {
#define RUN_ARGS "train", "--model", "gpt2-tiny", "--device", "cpu", "--threads", "1", "--seq", \
        "32", "--batch", "2", "--val-batches", "1", "--lr-schedule", "const", "--dtype", dtype, \
        "--offload-optim", optim
    test_proc r;
    const char *whole = path_in("whole.safetensors");
    FERRY(&r, 0, RUN_ARGS, "--grad-accum", "2", "--steps", "8", "--save", whole);
    cr_assert_eq(r.code, 0, "%s", r.err);
    size_t n0;
    char *w0 = test_read_file(whole, &n0);
    for (int order = 0; order < 2; order++) {
        char ck[32], wname[32];
        snprintf(ck, sizeof ck, "ck%d", order);
        snprintf(wname, sizeof wname, "resumed%d.safetensors", order);
        const char *dir = path_in(ck), *w = path_in(wname);
        const int first = order ? 0 : 2, second = order ? 2 : 0; /* processes (0: alone) */
        if (first) FERRY(&r, first, RUN_ARGS, "--steps", "4", "--checkpoint-dir", dir, "--checkpoint-every", "2");
        else FERRY(&r, 0, RUN_ARGS, "--grad-accum", "2", "--steps", "4", "--checkpoint-dir", dir);
        cr_assert_eq(r.code, 0, "order %d, first part: %s", order, r.err);
        if (second) FERRY(&r, second, RUN_ARGS, "--steps", "8", "--checkpoint-dir", dir, "--resume", "--save", w);
        else FERRY(&r, 0, RUN_ARGS, "--grad-accum", "2", "--steps", "8", "--checkpoint-dir", dir, "--resume",
                   "--save", w);
        cr_assert_eq(r.code, 0, "order %d, resumed: %s", order, r.err);
        size_t n;
        char *b = test_read_file(w, &n);
        cr_expect(n == n0 && !memcmp(b, w0, n), "%s: order %d: the resumed run's weights differ",
                  dtype, order);
        free(b);
        test_remove_tree(dir);
    }
    free(w0);
#undef RUN_ARGS
}

Test(dp, checkpoints_resume_on_another_world_size) {
    expect_resume_across_world_sizes("fp32", "0");
    expect_resume_across_world_sizes("bf16", "0"); /* the masters on the device gathered */
    expect_resume_across_world_sizes("bf16", "1");
    expect_resume_across_world_sizes("fp32", "1"); /* fp32 masters apart from the weights */
#define RUN_ARGS "train", "--model", "gpt2-tiny", "--device", "cpu", "--threads", "1", "--seq", \
        "32", "--batch", "2", "--val-batches", "1", "--lr-schedule", "const"
    test_proc r;
    FERRY(&r, 0, RUN_ARGS, "--steps", "2", "--checkpoint-dir", path_in("ck0"));
    cr_assert_eq(r.code, 0, "%s", r.err);
    /* a new run refuses a directory that holds checkpoints: one error, from rank 0 */
    FERRY(&r, 2, RUN_ARGS, "--steps", "2", "--checkpoint-dir", path_in("ck0"));
    cr_expect_neq(r.code, 0);
    cr_expect(strstr(r.err, "ferry: error: rank 0: --checkpoint-dir") && strstr(r.err, "holds checkpoints"),
              "%s", r.err);
#undef RUN_ARGS
}

static bool has_latest(void *dir) {
    char p[600];
    snprintf(p, sizeof p, "%s/latest", (const char *)dir);
    return access(p, F_OK) == 0;
}

/* SIGTERM to mpirun (which passes it to every rank) once a checkpoint exists: every rank
 * stops at the same step (decided together at the step's norm), rank 0 writes its
 * checkpoint, and one process resuming from it ends with the weights of one process
 * never stopped. In bf16 with the optimizer on the CPU, where the stopped step's gradient
 * had landed in the bf16 weights: each rank restores its shard and gathers the others'. */
Test(dp, a_signalled_job_stops_together_and_resumes_exactly) {
#define RUN_ARGS "train", "--model", "gpt2-tiny", "--device", "cpu", "--threads", "1", "--seq", \
        "32", "--batch", "2", "--val-batches", "1", "--steps", "400", "--lr-schedule", "const", \
        "--dtype", "bf16", "--offload-optim", "1"
    test_proc r;
    const char *whole = path_in("whole400.safetensors"), *res = path_in("res400.safetensors");
    const char *dir = path_in("sigck");
    FERRY(&r, 0, RUN_ARGS, "--grad-accum", "2", "--save", whole);
    cr_assert_eq(r.code, 0, "%s", r.err);
    const char *bin = getenv("FERRY_BIN"), *mpirun = getenv("MPIRUN");
    char *saved = strdup(bin);
    const char *a[] = {"-np", "2", "--oversubscribe", saved, RUN_ARGS, "--checkpoint-dir", dir,
                       "--checkpoint-every", "5", NULL};
    setenv("FERRY_BIN", mpirun, 1);
    test_run_ferry_when(&r, g_dir, 240, a, 0, SIGTERM, 0, 0, has_latest, (void *)dir);
    setenv("FERRY_BIN", saved, 1);
    free(saved);
    cr_expect_eq(count_stops(r.err), 2, "both ranks stop after their step:\n%s", r.err);
    cr_expect(strstr(r.err, "ferry: rank 0: stopping") && strstr(r.err, "ferry: rank 1: stopping"),
              "each stop line names its rank:\n%s", r.err);
    FERRY(&r, 0, RUN_ARGS, "--grad-accum", "2", "--checkpoint-dir", dir, "--resume", "--save", res);
    cr_assert_eq(r.code, 0, "%s", r.err);
    cr_expect(strstr(r.out, "resume "), "%s", r.out);
    size_t n0, n1;
    char *w0 = test_read_file(whole, &n0), *w1 = test_read_file(res, &n1);
    cr_expect(n0 == n1 && !memcmp(w0, w1, n0), "the resumed weights differ from a run never stopped");
    free(w0);
    free(w1);
#undef RUN_ARGS
}

/* A cpu profile of 2 ranks probed once (tests/fixtures/dp/profile-cpu-2ranks.json:
 * gpt2-mini's blocks at 64 tokens, analytic for other shapes), so that the shares and
 * plans the job's search predicts do not depend on this machine's load or a sanitizer. */
static const char *job_profile(void) {
    static char path[1024];
    const char *fx = getenv("FERRY_FIXTURES");
    cr_assert(fx, "FERRY_FIXTURES");
    snprintf(path, sizeof path, "%s/dp/profile-cpu-2ranks.json", fx);
    return path;
}

/* Unlike ranks: a step of 4 micro-batches split by speed (--sim-slowdown 1,2 makes rank
 * 1's kernels twice as slow; auto, on the predictions of the fixture's profile slowed so,
 * gives it 1 of 4) or by explicit counts reads the same
 * micro-batches as one process accumulating 4: auto's split (3, 1) sums them in one
 * process's order, bit for bit; 1,3 in another, within 1e-5 relative. (The step time
 * of auto against equal shares is a benchmark: bench/RESULTS.md.) */
Test(dp, unequal_shares_read_the_same_micro_batches) {
#define RUN_ARGS "train", "--model", "gpt2-tiny", "--device", "cpu", "--threads", "1", "--seq", \
        "32", "--batch", "2", "--val-batches", "1", "--steps", "4"
    test_proc r;
    const char *m1 = path_in("one4.jsonl"), *ma = path_in("auto.jsonl"), *me = path_in("explicit.jsonl");
    FERRY(&r, 0, RUN_ARGS, "--grad-accum", "4", "--metrics", m1);
    cr_assert_eq(r.code, 0, "%s", r.err);
    FERRY(&r, 2, RUN_ARGS, "--grad-accum", "2", "--sim-slowdown", "1,2", "--batch-shares", "auto",
          "--profile", job_profile(), "--metrics", ma);
    cr_assert_eq(r.code, 0, "%s", r.err);
    cr_expect(strstr(r.out, "by rank: 3 1 (auto"), "the shares line:\n%s", r.out);
    FERRY(&r, 2, RUN_ARGS, "--batch-shares", "1,3", "--metrics", me);
    cr_assert_eq(r.code, 0, "%s", r.err);
    char l1[2048], la[2048], le[2048];
    losses_of(m1, l1, sizeof l1);
    losses_of(ma, la, sizeof la);
    cr_expect_str_eq(la, l1, "auto (3, 1): one process's losses and norms");
    losses_of(me, le, sizeof le);
    const char *p1 = l1, *pe = le;
    for (int s = 0; s < 4; s++) { /* "loss":X ... per line */
        const char *a = strstr(p1, "\"loss\":"), *b = strstr(pe, "\"loss\":");
        cr_assert(a && b);
        const double x = atof(a + 7), y = atof(b + 7);
        cr_expect(fabs(x - y) <= 1e-5 * fabs(x), "1,3: step %d loss %.9g vs %.9g", s, y, x);
        p1 = a + 7;
        pe = b + 7;
    }
    /* bad shares and slowdowns: one error line each */
    const char *bad[][2] = {{"--batch-shares", "2"}, {"--batch-shares", "0,2"}, {"--batch-shares", "1.5,2"},
                            {"--sim-slowdown", "0.5,1"}, {"--sim-slowdown", "1,2,3"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        FERRY(&r, 2, RUN_ARGS, bad[i][0], bad[i][1]);
        cr_expect_neq(r.code, 0, "%s %s", bad[i][0], bad[i][1]);
        cr_expect(strstr(r.err, "ferry: error: rank ") && strstr(r.err, bad[i][0] + 2),
                  "%s %s:\n%s", bad[i][0], bad[i][1], r.err);
    }
#undef RUN_ARGS
}

/* --plan auto in a job: `ferry probe` under the launcher measures the collectives between
 * the ranks (every rank probing, rank 0 writing); each rank's plan is searched for its own
 * budget and shard (here alike: each offloads, under a budget the all-resident plan
 * exceeds). A profile without collectives is refused with one error, from one rank. */
Test(dp, auto_plans_in_a_job) {
#define ARGS "--model", "gpt2-tiny", "--device", "cpu", "--threads", "1", "--seq", "64"
    test_proc r;
    const char *job = path_in("job-profile.json"), *alone = path_in("alone-profile.json");
    FERRY(&r, 2, "probe", ARGS, "--batch", "2", "--out", job);
    cr_assert_eq(r.code, 0, "%s", r.err);
    char *text = slurp(job);
    cr_expect(text && strstr(text, "\"collectives\"") && strstr(text, "MPI over host memory"), "%s", text);
    free(text);
    FERRY(&r, 2, "train", ARGS, "--batch", "4", "--steps", "2", "--plan", "auto", "--profile", job,
          "--gpu-mem", "2800KiB");
    cr_assert_eq(r.code, 0, "%s", r.err);
    cr_expect(strstr(r.out, "plan    micro-batch") && !strstr(r.out, "optim on cpu: none"),
              "rank 0's plan offloads:\n%s", r.out);
    FERRY(&r, 0, "probe", ARGS, "--batch", "2", "--out", alone);
    cr_assert_eq(r.code, 0, "%s", r.err);
    FERRY(&r, 2, "train", ARGS, "--batch", "4", "--steps", "2", "--plan", "auto", "--profile", alone);
    cr_expect_neq(r.code, 0);
    cr_expect(strstr(r.err, "ferry: error: rank 0: profile") && strstr(r.err, "mpirun -np 2 ferry probe") &&
              !strstr(r.err, "rank 1: profile"), "%s", r.err);
#undef ARGS
}

/* A checkpoint records how its step's gradient was summed: in micro-batch order (one
 * process; a job whose later ranks take one micro-batch each) or by rank. Resuming in
 * another order is allowed with one warning; in the same order, none. */
Test(dp, resuming_in_another_summing_order_says_so) {
#define RUN_ARGS "train", "--model", "gpt2-tiny", "--device", "cpu", "--threads", "1", "--seq", \
        "32", "--batch", "2", "--val-batches", "1", "--lr-schedule", "const"
    test_proc r;
    const char *by_rank = path_in("by-rank"), *in_order = path_in("in-order");
    FERRY(&r, 2, RUN_ARGS, "--batch-shares", "2,2", "--steps", "2", "--checkpoint-dir", by_rank);
    cr_assert_eq(r.code, 0, "%s", r.err);
    FERRY(&r, 2, RUN_ARGS, "--batch-shares", "3,1", "--steps", "3", "--checkpoint-dir", by_rank, "--resume");
    cr_assert_eq(r.code, 0, "%s", r.err);
    cr_expect(strstr(r.err, "ferry: warning: rank 0: resuming with the step's gradient summed in order "
                            "where the checkpoint's run summed it by rank: 2,2") &&
              !strstr(r.err, "rank 1: resuming"), "%s", r.err);
    FERRY(&r, 2, RUN_ARGS, "--batch-shares", "3,1", "--steps", "2", "--checkpoint-dir", in_order);
    cr_assert_eq(r.code, 0, "%s", r.err);
    FERRY(&r, 0, RUN_ARGS, "--grad-accum", "4", "--steps", "3", "--checkpoint-dir", in_order, "--resume");
    cr_assert_eq(r.code, 0, "%s", r.err);
    cr_expect(!strstr(r.err, "summed"), "(3, 1) is one process's order:\n%s", r.err);
#undef RUN_ARGS
}

/* ---- unlike ranks: a plan and a share each ---- */

/* Each rank's `--dry-run` memory line (JSON): its rank, budget and device bytes. */
typedef struct rank_mem { int rank; double budget, device, micro_batches; } rank_mem;
static int rank_mems(const char *out, rank_mem *v, int cap) {
    int n = 0;
    for (const char *p = out; n < cap && (p = strstr(p, "{\"rank\":")); p++) {
        const char *e = strchr(p, '\n');
        char line[4096];
        snprintf(line, sizeof line, "%.*s", e ? (int)(e - p) : (int)strlen(p), p);
        cJSON *j = cJSON_Parse(line);
        cr_assert_not_null(j, "%s", line);
        v[n++] = (rank_mem){(int)cJSON_GetObjectItem(j, "rank")->valuedouble,
                            cJSON_GetObjectItem(j, "device_budget")->valuedouble,
                            cJSON_GetObjectItem(j, "device_bytes")->valuedouble,
                            cJSON_GetObjectItem(j, "micro_batches")->valuedouble};
        cJSON_Delete(j);
    }
    return n;
}

/* The saved weights of two runs, byte for byte, and their losses and norms. */
static void expect_same_training(const char *m1, const char *w1, const char *m2, const char *w2,
                                 const char *what) {
    char l1[4096], l2[4096];
    losses_of(m1, l1, sizeof l1);
    losses_of(m2, l2, sizeof l2);
    cr_expect_str_eq(l2, l1, "%s: the losses and norms", what);
    size_t s1, s2;
    char *b1 = test_read_file(w1, &s1), *b2 = test_read_file(w2, &s2);
    cr_expect(b1 && b2 && s1 == s2 && !memcmp(b1, b2, s1), "%s: the saved weights differ", what);
    free(b1);
    free(b2);
}

/* The bar: budgets 4x apart (24 MiB and 6 MiB, where gpt2-mini's all-resident plan
 * needs more than 6): each rank's dry run shows its own plan within its own budget, and 5
 * steps with one micro-batch a rank are bit-identical to one process accumulating the
 * job's 2. Then unlike speeds too (--sim-slowdown 1,2), shares by the predictions: the
 * fast, large rank takes 3 of 4 micro-batches (so the job's rank-order sum is one
 * process's accumulation, bit for bit). */
Test(dp, per_rank_budgets_give_each_rank_its_own_plan) {
#define ARGS "train", "--model", "gpt2-mini", "--device", "cpu", "--threads", "1", "--seq", "64", \
        "--batch", "1", "--val-batches", "2"
    test_proc r;
    FERRY(&r, 0, ARGS, "--gpu-mem", "6MiB", "--dry-run");
    cr_assert(strstr(r.out, "\"device_bytes\":"), "%s", r.err);
    const double all_resident = atof(strstr(r.out, "\"device_bytes\":") + 15);
    cr_assert_gt(all_resident, 6 << 20, "gpt2-mini all-resident: %.0f bytes", all_resident);
    FERRY(&r, 2, ARGS, "--plan", "auto", "--profile", job_profile(), "--gpu-mem", "24MiB,6MiB",
          "--dry-run");
    cr_assert_eq(r.code, 0, "%s", r.err);
    rank_mem v[2];
    cr_assert_eq(rank_mems(r.out, v, 2), 2, "%s", r.out);
    for (int i = 0; i < 2; i++) {
        const double want = v[i].rank == 0 ? 24 << 20 : 6 << 20;
        cr_expect_eq(v[i].budget, want, "rank %d's budget", v[i].rank);
        cr_expect(v[i].device <= v[i].budget, "rank %d: %.0f device bytes over %.0f", v[i].rank,
                  v[i].device, v[i].budget);
        cr_expect_eq(v[i].micro_batches, 1, "rank %d", v[i].rank);
        if (v[i].rank == 0)
            cr_expect_gt(v[i].device, 6 << 20, "rank 0 plans for its own budget, not rank 1's");
    }
    /* every rank prints its plan line, in whichever order the ranks' output lands */
    const char *plans[2] = {NULL, NULL};
    int np = 0;
    for (const char *l = r.out; l && *l && np < 2; l = strchr(l, '\n'), l = l ? l + 1 : NULL)
        if (!strncmp(l, "plan    ", 8)) plans[np++] = l;
    cr_assert_eq(np, 2, "two plans:\n%s", r.out);
    cr_expect(strncmp(plans[0], plans[1], strcspn(plans[0], "\n") + 1), "the ranks' plans are one:\n%s",
              r.out);
    const char *m1 = path_in("one.jsonl"), *w1 = path_in("one.safetensors");
    const char *m2 = path_in("job.jsonl"), *w2 = path_in("job.safetensors");
    FERRY(&r, 2, ARGS, "--plan", "auto", "--profile", job_profile(), "--gpu-mem", "24MiB,6MiB",
          "--steps", "5", "--metrics", m2, "--save", w2);
    cr_assert_eq(r.code, 0, "%s", r.err);
    FERRY(&r, 0, ARGS, "--grad-accum", "2", "--steps", "5", "--metrics", m1, "--save", w1);
    cr_assert_eq(r.code, 0, "%s", r.err);
    expect_same_training(m1, w1, m2, w2, "own plans, a micro-batch each");
    unlink(m1); unlink(w1); unlink(m2); unlink(w2);
    FERRY(&r, 2, ARGS, "--plan", "auto", "--profile", job_profile(), "--gpu-mem", "24MiB,6MiB",
          "--sim-slowdown", "1,2", "--grad-accum", "2", "--batch-shares", "auto", "--steps", "5",
          "--metrics", m2, "--save", w2);
    cr_assert_eq(r.code, 0, "%s", r.err);
    cr_expect(strstr(r.out, "by rank: 3 1 (auto") && strstr(r.out, "\n1    measured, 2x slower"),
              "the job:\n%s", r.out);
    FERRY(&r, 0, ARGS, "--grad-accum", "4", "--steps", "5", "--metrics", m1, "--save", w1);
    cr_assert_eq(r.code, 0, "%s", r.err);
    expect_same_training(m1, w1, m2, w2, "own plans and shares (3, 1)");
#undef ARGS
}

/* Ranks started with plans of their own (Open MPI's `A : B`): rank 0 all-resident, rank 1
 * fully offloaded and recomputing, under budgets of their own: bit-identical to one
 * process. Micro-batches of another size on one rank are refused, as are --batch-shares
 * auto over plans accumulating unlike counts; budgets and profiles per rank are checked
 * with one error line, from rank 0. */
static void run_mpmd(test_proc *r, const char *const *a0, const char *const *a1) {
    const char *a[96];
    int n = 0;
    a[n++] = "--oversubscribe";
    for (int side = 0; side < 2; side++) {
        if (side) a[n++] = ":";
        a[n++] = "-np";
        a[n++] = "1";
        a[n++] = getenv("FERRY_BIN");
        for (const char *const *p = side ? a1 : a0; *p; p++) {
            cr_assert_lt(n, 94);
            a[n++] = *p;
        }
    }
    a[n] = NULL;
    run_mpirun(r, a);
}

#define LIST(...) (const char *const[]){__VA_ARGS__, NULL}

Test(dp, ranks_with_plans_of_their_own) {
#define ARGS "train", "--model", "gpt2-mini", "--device", "cpu", "--threads", "1", "--seq", "64", \
        "--val-batches", "2", "--steps", "5", "--batch", "2"
    test_proc r;
    const char *m1 = path_in("one.jsonl"), *w1 = path_in("one.safetensors");
    const char *m2 = path_in("job.jsonl"), *w2 = path_in("job.safetensors");
    run_mpmd(&r, LIST(ARGS, "--gpu-mem", "24MiB", "--metrics", m2, "--save", w2),
             LIST(ARGS, "--gpu-mem", "8MiB", "--offload-params", "1", "--offload-optim", "1",
                  "--ckpt-layers", "4"));
    cr_assert_eq(r.code, 0, "%s", r.err);
    FERRY(&r, 0, ARGS, "--grad-accum", "2", "--metrics", m1, "--save", w1);
    cr_assert_eq(r.code, 0, "%s", r.err);
    expect_same_training(m1, w1, m2, w2, "rank 0 all-resident, rank 1 offloaded");
    run_mpmd(&r, LIST(ARGS), LIST(ARGS, "--batch", "1"));
    cr_expect_neq(r.code, 0);
    cr_expect(strstr(r.err, "ferry: error: rank 0: the ranks' micro-batches differ") &&
              !strstr(r.err, "rank 1: the ranks'"), "%s", r.err);
    run_mpmd(&r, LIST(ARGS, "--batch-shares", "auto"),
             LIST(ARGS, "--batch-shares", "auto", "--grad-accum", "2"));
    cr_expect_neq(r.code, 0);
    cr_expect(strstr(r.err, "ferry: error: rank 0: --batch-shares auto") && strstr(r.err, "--grad-accum"),
              "%s", r.err);
    /* ranks that must agree and do not: one error, from rank 0, naming the rank and flag,
     * before any collective of planning (each of these once stalled the job or ended it
     * mid-run) */
    static const char *const differ[][3] = {
        {"--plan auto", "--plan", "auto"},
        {"--batch-shares", "--batch-shares", "auto"},
        {"--dtype", "--dtype", "bf16"},
        {"--steps", "--steps", "6"},
    };
    for (size_t i = 0; i < sizeof differ / sizeof differ[0]; i++) {
        run_mpmd(&r, LIST(ARGS), LIST(ARGS, differ[i][1], differ[i][2]));
        cr_expect_neq(r.code, 0, "%s", differ[i][0]);
        char want[128];
        snprintf(want, sizeof want, "ferry: error: rank 0: rank 1's %s differs", differ[i][0]);
        cr_expect(strstr(r.err, want) && !strstr(r.err, "rank 1: rank"), "%s:\n%s", want, r.err);
    }
    run_mpmd(&r, LIST(ARGS), LIST(ARGS, "--offload-optim", "1", "--speculate", "1"));
    cr_expect_neq(r.code, 0);
    cr_expect(strstr(r.err, "ferry: error: rank 1: --speculate: a speculative update runs in one process") &&
              !strstr(r.err, "rank 0: --speculate"), "%s", r.err);
#undef ARGS
#define ARGS "train", "--model", "gpt2-mini", "--device", "cpu", "--threads", "1", "--seq", "64", \
        "--steps", "2"
    FERRY(&r, 2, ARGS, "--plan", "auto", "--profile", "nope");
    cr_expect_neq(r.code, 0);
    cr_expect(strstr(r.err, "ferry: error: rank 0: unknown profile 'nope'") &&
              !strstr(r.err, "rank 1: unknown profile"), "%s", r.err);
    FERRY(&r, 2, ARGS, "--plan", "auto", "--profile", job_profile(), "--batch-shares", "3,1");
    cr_expect_neq(r.code, 0);
    cr_expect(strstr(r.err, "ferry: error: rank 0: --batch-shares 3,1 counts micro-batches of --batch") &&
              !strstr(r.err, "rank 1: --batch-shares"), "%s", r.err);
    FERRY(&r, 2, ARGS, "--gpu-mem", "24MiB,6MiB,1MiB");
    cr_expect_neq(r.code, 0);
    cr_expect(strstr(r.err, "ferry: error: rank 0: --gpu-mem") && strstr(r.err, "3 values for 2 ranks") &&
              !strstr(r.err, "rank 1: --gpu-mem"), "%s", r.err);
    FERRY(&r, 2, ARGS, "--plan", "auto", "--profile", "h200-141gb,rtx4090-pcie4,h200-141gb");
    cr_expect_neq(r.code, 0);
    cr_expect(strstr(r.err, "ferry: error: rank 0: --profile") && !strstr(r.err, "rank 1: --profile"),
              "%s", r.err);
    FERRY(&r, 2, ARGS, "--plan", "auto", "--profile", "h200-141gb,rtx4090-pcie4", "--gpu-mem", "24MiB,4KiB");
    cr_expect_neq(r.code, 0);
    cr_expect(strstr(r.err, "ferry: error: rank 0: no plan of the job fits: rank 1 (device budget 4.00 KiB"),
              "%s", r.err);
#undef ARGS
}

/* A rank that fails ends the job (its error line names it), and a rank that stalls is
 * found by the others' collective timeout: never a hang. */
Test(dp, a_failed_or_stalled_rank_ends_the_job) {
    test_proc r;
    setenv("FERRY_TEST_FAIL_RANK", "1", 1);
    FERRY(&r, 2, "train", "--model", "gpt2-tiny", "--device", "cpu", "--threads", "1", "--steps", "50");
    unsetenv("FERRY_TEST_FAIL_RANK");
    cr_expect_neq(r.code, 0);
    cr_expect(strstr(r.err, "ferry: error: rank 1: injected failure"), "%s", r.err);
    setenv("FERRY_TEST_STALL_RANK", "1", 1);
    setenv("FERRY_COMM_TIMEOUT", "2", 1);
    FERRY(&r, 2, "train", "--model", "gpt2-tiny", "--device", "cpu", "--threads", "1", "--steps", "50");
    unsetenv("FERRY_TEST_STALL_RANK");
    unsetenv("FERRY_COMM_TIMEOUT");
    cr_expect_neq(r.code, 0);
    cr_expect(strstr(r.err, "ferry: error: rank 0: a collective has waited 2 s"), "%s", r.err);
}

/* ---- loss masks ---- */

/* The generator's count of each 64-token batch's targets (tests/fixtures/masked/
 * expected.json: tests/ref/gen_masked_data.py), the first n. */
static void masked_batch_targets(long *out, int n) {
    const char *fx = getenv("FERRY_FIXTURES");
    cr_assert(fx, "FERRY_FIXTURES");
    char path[1024];
    snprintf(path, sizeof path, "%s/masked/expected.json", fx);
    char *text = slurp(path);
    const char *p = strstr(text, "\"batch_targets\"");
    cr_assert(p && (p = strchr(p, '[')), "%s: no batch_targets", path);
    for (int i = 0; i < n; i++) {
        char *end;
        out[i] = strtol(p + 1, &end, 10);
        cr_assert(end != p + 1, "%s: fewer than %d batch_targets", path, n);
        p = end;
    }
    free(text);
}

/* The loss_tokens of every metrics line, in order. */
static void loss_tokens_of(const char *path, long *out, int n) {
    char *m = slurp(path);
    const char *p = m;
    for (int i = 0; i < n; i++) {
        p = strstr(p, "\"loss_tokens\":");
        cr_assert(p, "%s: fewer than %d lines with loss_tokens", path, n);
        p += strlen("\"loss_tokens\":");
        out[i] = strtol(p, NULL, 10);
    }
    free(m);
}

/* Packed, loss-masked data (tests/fixtures/masked): a step's loss divides by the targets its
 * micro-batches count on every rank, so 2 ranks give one process accumulating 2, bit for
 * bit, with the validation (5 batches split over the ranks, on the held-out quarter cut at a
 * packed sequence) pooled over the counted targets; all resident and a mixed plan. Each
 * step's loss_tokens is the masks' count over its 4 sequences. */
Test(dp, masked_data_two_ranks_match_one_rank_accumulating_two) {
    char data[1024];
    snprintf(data, sizeof data, "%s/masked/chat_train_*.bin", getenv("FERRY_FIXTURES"));
#define MASKED "--model", "llama-tiny", "--vocab", "256", "--data", data, "--val-split", "0.25", \
        "--val-every", "2"
    long bt[10];
    masked_batch_targets(bt, 10);
    for (int plan = 0; plan < 2; plan++) {
        if (plan) expect_same_run(2, EXTRA(MASKED, "--offload-params", "0.5", "--offload-optim", "0.5",
                                           "--ckpt-layers", "1"), "masked data, mixed plan");
        else expect_same_run(2, EXTRA(MASKED), "masked data, all resident");
        char *m = slurp(path_in("many.jsonl"));
        cr_expect(strstr(m, "\"val_loss\":"), "no validation in the metrics:\n%s", m);
        free(m);
        long one[5], many[5];
        loss_tokens_of(path_in("one.jsonl"), one, 5);
        loss_tokens_of(path_in("many.jsonl"), many, 5);
        for (int s = 0; s < 5; s++) {
            cr_expect_eq(one[s], bt[2 * s] + bt[2 * s + 1], "plan %d step %d: one process's loss_tokens",
                         plan, s + 1);
            cr_expect_eq(many[s], bt[2 * s] + bt[2 * s + 1], "plan %d step %d: the job's loss_tokens",
                         plan, s + 1);
        }
    }
#undef MASKED
}
