/* test_cuda_job.c — the cuda backend through the ferry binary, against the cpu backend:
 * whole training runs (GPT-2 and Llama, fp32 and bf16, fully offloaded with every layer
 * recomputed), checkpoints carried from one backend to the other, and a 2-rank job whose
 * collectives are NCCL's. Where there is no GPU these run on the emulated runtime
 * (a -Dcuda=emulated build: tests/cuda_emu/runtime); elsewhere on a GPU; without either
 * they skip.
 *
 * Tolerances, on every step's loss, relative to the cpu backend's:
 *   fp32 (exact fp32 GEMMs, --matmul fp32): the backends differ in summation orders and
 *     in expf/tanhf's last ulps, ~1e-7 a kernel; ten steps of AdamW at lr 2e-3 carry the
 *     difference into the weights, measured at most ~1e-6 on these models: 1e-4.
 *   bf16 storage: both round every stored tensor to bf16 (2^-9 relative), but at different
 *     points (the cuda kernels round intermediates the cpu keeps in fp32, and the tensor
 *     cores' products); a step's loss moves by ~1e-3 relative: 2e-2. */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "engine/core/util.h"
#include "engine/device/device.h"
#include "tests/test_util.h"

static char g_dir[64];

static void make_dir(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/ferry-test-cudajob-XXXXXX");
    cr_assert_not_null(mkdtemp(g_dir), "mkdtemp: %s", strerror(errno));
}
static void remove_dir(void) { test_remove_tree(g_dir); }
TestSuite(cuda_job, .init = make_dir, .fini = remove_dir, .timeout = 600);

static const char *path_in(const char *name) {
    static char b[8][512];
    static int k;
    char *p = b[k++ % 8];
    snprintf(p, 512, "%s/%s", g_dir, name);
    return p;
}

/* Skips the test unless the cuda backend finds a GPU, real or emulated (asked in this
 * test's own process: Criterion forks one per test). */
static void need_cuda(void) {
    fy_gpu_info gpu;
    char why[160] = "";
    if (fy_dev_gpus(&gpu, 1, why, sizeof why) == 0) cr_skip_test("no GPU: %s", why);
}

enum { MAX_STEPS = 16 };

/* Every step's loss in a metrics file (JSON Lines); the count. */
static int losses_of(const char *path, double *loss) {
    char *m = test_read_file(path, NULL), *save = NULL;
    int n = 0;
    for (char *line = strtok_r(m, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        cJSON *j = cJSON_Parse(line);
        cr_assert_not_null(j, "metrics line: %s", line);
        const cJSON *l = cJSON_GetObjectItemCaseSensitive(j, "loss");
        if (cJSON_IsNumber(l)) {
            cr_assert_lt(n, MAX_STEPS);
            loss[n++] = l->valuedouble;
        }
        cJSON_Delete(j);
    }
    free(m);
    return n;
}

/* `launcher` (mpirun's arguments up to the ferry binary; NULL for none), then ferry train
 * with the common flags and `extra`; exits 0 or fails the test. */
static void train_by(const char *what, const char *metrics, const char *const *launcher,
                     const char *const *extra) {
    static const char *const common[] = {"train", "--threads", "2", "--batch", "2", "--seq", "32",
                                         "--lr", "2e-3", "--log-every", "1", "--metrics", NULL};
    const char *a[64];
    int n = 0;
    for (int i = 0; launcher && launcher[i]; i++) a[n++] = launcher[i];
    for (int i = 0; common[i]; i++) a[n++] = common[i];
    a[n++] = metrics;
    for (int i = 0; extra[i]; i++) {
        cr_assert_lt(n, 62);
        a[n++] = extra[i];
    }
    a[n] = NULL;
    unlink(metrics);
    test_proc r;
    test_run_ferry(&r, g_dir, 540, a);
    cr_assert_eq(r.code, 0, "%s: %s exited %d (signal %d):\n%s", what, r.cmd, r.code, r.sig, r.err);
}
static void train(const char *what, const char *metrics, const char *const *extra) {
    train_by(what, metrics, NULL, extra);
}

/* The losses of steps [from, to) of two runs agree within tol, relative; none is NaN. */
static void expect_close(const char *what, const double *a, const double *b, int from, int to,
                         double tol) {
    for (int s = from; s < to; s++) {
        double rel = fabs(a[s] - b[s]) / fabs(b[s]);
        cr_expect(isfinite(a[s]) && rel <= tol, "%s: step %d: cuda %.9g, cpu %.9g (relative %.2e, "
                  "tolerance %.0e)", what, s + 1, a[s], b[s], rel, tol);
    }
}

#define ARGS(...) (const char *const[]){__VA_ARGS__, NULL}

/* 10 steps of `model` fully offloaded (parameters streamed, the optimizer on the CPU) with
 * every layer recomputed, on cuda and on cpu. */
static void expect_offloaded_run_matches_cpu(const char *model, const char *layers, bool bf16) {
    need_cuda();
    const char *dtype = bf16 ? "bf16" : "fp32";
    /* fp32: exact fp32 GEMMs on cuda (its default is bf16 tensor cores) */
    const char *math = bf16 ? "auto" : "fp32";
    const char *mc = path_in("cuda.jsonl"), *mp = path_in("cpu.jsonl");
    char what[128];
    snprintf(what, sizeof what, "%s %s offloaded, recomputed", model, dtype);
    train(what, mc, ARGS("--device", "cuda", "--matmul", math, "--model", model, "--dtype", dtype,
                         "--steps", "10", "--offload-params", "1", "--offload-optim", "1",
                         "--ckpt-layers", layers));
    train(what, mp, ARGS("--device", "cpu", "--model", model, "--dtype", dtype, "--steps", "10",
                         "--offload-params", "1", "--offload-optim", "1", "--ckpt-layers", layers));
    double lc[MAX_STEPS], lp[MAX_STEPS];
    cr_assert_eq(losses_of(mc, lc), 10, "%s: steps on cuda", what);
    cr_assert_eq(losses_of(mp, lp), 10, "%s: steps on cpu", what);
    expect_close(what, lc, lp, 0, 10, bf16 ? 2e-2 : 1e-4);
    cr_expect_lt(lc[9], lc[0], "%s: the loss falls (%g to %g)", what, lc[0], lc[9]);
}

Test(cuda_job, gpt2_fp32_offloaded_and_recomputed_matches_cpu) {
    expect_offloaded_run_matches_cpu("gpt2-tiny", "2", false);
}
Test(cuda_job, gpt2_bf16_offloaded_and_recomputed_tracks_cpu) {
    expect_offloaded_run_matches_cpu("gpt2-tiny", "2", true);
}
Test(cuda_job, llama_fp32_offloaded_and_recomputed_matches_cpu) {
    expect_offloaded_run_matches_cpu("llama-tiny", "4", false);
}
Test(cuda_job, llama_bf16_offloaded_and_recomputed_tracks_cpu) {
    expect_offloaded_run_matches_cpu("llama-tiny", "4", true);
}

/* Three steps on `first` writing a checkpoint, three more resumed from it on `second`,
 * against six uninterrupted steps on `second` (fp32, exact GEMMs): the resumed steps
 * within the backends' tolerance of the uninterrupted ones, step numbers going on. */
static void expect_checkpoint_moves(const char *first, const char *second) {
    need_cuda();
    char what[96];
    snprintf(what, sizeof what, "a checkpoint from %s resumed on %s", first, second);
    const char *ck = path_in("ckpt"), *m1 = path_in("first.jsonl"), *m2 = path_in("second.jsonl"),
               *mu = path_in("whole.jsonl");
    test_remove_tree(ck);
    /* a constant rate, so three steps and then three more are six steps' schedule */
#define COMMON "--model", "llama-tiny", "--dtype", "fp32", "--lr-schedule", "const", "--warmup", \
        "0", "--offload-optim", "1", "--offload-params", "0.5"
    const char *mf = strcmp(first, "cuda") ? "auto" : "fp32",
               *ms = strcmp(second, "cuda") ? "auto" : "fp32";
    train(what, m1, ARGS("--device", first, "--matmul", mf, COMMON, "--steps", "3",
                         "--checkpoint-dir", ck));
    train(what, m2, ARGS("--device", second, "--matmul", ms, COMMON, "--steps", "6",
                         "--checkpoint-dir", ck, "--resume"));
    train(what, mu, ARGS("--device", second, "--matmul", ms, COMMON, "--steps", "6"));
#undef COMMON
    double l1[MAX_STEPS], l2[MAX_STEPS], lu[MAX_STEPS];
    cr_assert_eq(losses_of(m1, l1), 3, "%s: steps before the checkpoint", what);
    cr_assert_eq(losses_of(m2, l2), 3, "%s: steps after it", what);
    cr_assert_eq(losses_of(mu, lu), 6, "%s: uninterrupted steps", what);
    expect_close(what, l1, lu, 0, 3, 1e-4);
    expect_close(what, l2, lu + 3, 0, 3, 1e-4);
}

Test(cuda_job, checkpoint_written_on_cuda_resumes_on_cpu) { expect_checkpoint_moves("cuda", "cpu"); }
Test(cuda_job, checkpoint_written_on_cpu_resumes_on_cuda) { expect_checkpoint_moves("cpu", "cuda"); }

/* ---- a job of two ranks: the device collectives are NCCL's ---- */

/* Two processes under mpirun, a micro-batch each, against one process accumulating two
 * (both on cuda, fp32 with exact GEMMs), the optimizer on the device, so the gradients
 * are reduced and the updated weights gathered by NCCL: every step's loss within 1e-5
 * relative. Two ranks' sum is a + b in any order, but one process adds its second
 * micro-batch's gradients inside the GEMM (beta 1), where the job adds two rounded
 * products: a few ulps a step. Each rank takes the GPU of its local rank: the emulation is
 * asked for two (FERRY_EMU_GPUS, passed to the ranks by mpirun's -x; a GPU machine
 * ignores it). */
Test(cuda_job, two_ranks_over_nccl_match_one_process_accumulating_two) {
    need_cuda();
    const char *mpirun = getenv("MPIRUN"), *bin = getenv("FERRY_BIN");
    if (!mpirun) cr_skip_test("no mpirun in this build");
    setenv("FERRY_EMU_GPUS", "2", 1);
    const char *m1 = path_in("one.jsonl"), *m2 = path_in("two.jsonl");
    train("one process accumulating two", m1,
          ARGS("--device", "cuda", "--matmul", "fp32", "--model", "gpt2-tiny", "--steps", "5",
               "--grad-accum", "2"));
    /* test_run_ferry runs $FERRY_BIN: mpirun, here, which starts two ferry processes */
    char *saved = strdup(bin);
    setenv("FERRY_BIN", mpirun, 1);
    train_by("two ranks", m2, ARGS("-np", "2", "--oversubscribe", "-x", "FERRY_EMU_GPUS", saved),
             ARGS("--device", "cuda", "--matmul", "fp32", "--model", "gpt2-tiny", "--steps", "5"));
    setenv("FERRY_BIN", saved, 1);
    free(saved);
    double l1[MAX_STEPS], l2[MAX_STEPS];
    cr_assert_eq(losses_of(m1, l1), 5);
    cr_assert_eq(losses_of(m2, l2), 5);
    expect_close("two ranks against one accumulating two", l2, l1, 0, 5, 1e-5);
}
