/* main.c — the ferry command: dispatches to train, eval, info and bench. Only this file
 * exits. */
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "engine/cli/opts.h"
#include "engine/cli/sweep_cmd.h"
#include "engine/cli/train_cmd.h"
#include "engine/cli/tune_cmd.h"
#include "engine/core/status.h"
#include "engine/core/version.h"
#include "engine/device/device.h"
#include "engine/model/model.h"

#ifdef FY_HAVE_BENCH
#include "bench/bench_adam.h"
#endif

static const char *usage_main =
    "ferry " FY_VERSION " — train transformer language models larger than the GPU\n\n"
    "usage: ferry <command> [options]\n\n"
    "commands:\n"
    "  train   train a model (default: gpt2-mini on the embedded corpus)\n"
    "  eval    mean loss of a weights file on a data file\n"
    "  probe   measure this machine into a profile for the tuner\n"
    "  tune    choose the fastest offload plan that fits the budgets\n"
    "  sweep   run a grid of offload configurations beside the tuner's predictions\n"
    "  info    build features and devices\n"
    "  bench   microbenchmarks (bench adam)\n\n"
    "`ferry <command> --help` lists a command's options.";

static void cpu_features(char *buf, size_t cap) {
    buf[0] = 0;
#if defined(__x86_64__)
    __builtin_cpu_init();
    static const struct { const char *name; int on; } f[] = {
        {"avx2", 0}, {"fma", 0}, {"avx512f", 0}, {"avx512bw", 0}, {"avx512bf16", 0}, {"f16c", 0}};
    int on[6] = {__builtin_cpu_supports("avx2"), __builtin_cpu_supports("fma"),
                 __builtin_cpu_supports("avx512f"), __builtin_cpu_supports("avx512bw"),
                 __builtin_cpu_supports("avx512bf16"), __builtin_cpu_supports("f16c")};
    for (int i = 0; i < 6; i++)
        if (on[i]) snprintf(buf + strlen(buf), cap - strlen(buf), "%s%s", buf[0] ? " " : "", f[i].name);
#else
    snprintf(buf, cap, "portable C");
#endif
}

static int cmd_info(void) {
    char feats[128];
    cpu_features(feats, sizeof feats);
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGE_SIZE);
    printf("ferry %s\n", FY_VERSION);
    if (fy_dev_kind_compiled(FY_DEV_CUDA))
        printf("build     C11, OpenMP, OpenBLAS (cpu GEMMs), cJSON; cuda backend: compiled in "
               "(CUDA %s, cuBLASLt loaded at run time)\n", fy_dev_cuda_version());
    else
        printf("build     C11, OpenMP, OpenBLAS (cpu GEMMs), cJSON; cuda backend: not compiled in\n");
    if (fy_dev_cuda_emulated())
        printf("          the cuda backend runs on an emulated GPU: the CUDA runtime, cuBLASLt "
               "and NCCL emulated on the CPU (-Dcuda=emulated, for tests)\n");
    printf("cpu       %ld cores, %.1f GiB memory, features: %s\n", ncpu,
           (double)pages * (double)psz / 1073741824.0, feats);
    fy_gpu_info gpus[8];
    char why[160];
    int ngpu = fy_dev_gpus(gpus, 8, why, sizeof why);
    printf("devices   cpu (reference backend)\n");
    for (int i = 0; i < ngpu && i < 8; i++)
        printf("          cuda:%d %s, compute capability %d.%d, %d SMs, %.1f GiB\n", i,
               gpus[i].name, gpus[i].major, gpus[i].minor, gpus[i].sm_count,
               (double)gpus[i].total_nbytes / 1073741824.0);
    if (ngpu == 0) printf("          no GPU: %s\n", why);
    printf("default   --device %s\n", ngpu > 0 && !fy_dev_cuda_emulated() ? "cuda" : "cpu");
    printf("models    families and their named configs (--model NAME; --init reads a Hugging "
           "Face directory of these model types):\n");
    fy_model_print_families(stdout);
    return 0;
}

int main(int argc, char **argv) {
    /* a closed pipe (--metrics into `head`) is a write error ferry reports, not a signal
     * that ends it without a word */
    signal(SIGPIPE, SIG_IGN);
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") ||
        !strcmp(argv[1], "help")) {
        puts(usage_main);
        return argc < 2 ? 2 : 0;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "--version")) { puts("ferry " FY_VERSION); return 0; }
    if (!strcmp(cmd, "info")) {
        if (argc > 2) {
            fy_log_error("info takes no arguments (got '%s')", argv[2]);
            return 2;
        }
        return cmd_info();
    }
    if (!strcmp(cmd, "bench")) {
#ifdef FY_HAVE_BENCH
        if (argc >= 3 && !strcmp(argv[2], "adam")) return fy_bench_adam_main(argc - 2, argv + 2);
#endif
        fy_log_error("usage: ferry bench adam [options] (see ferry bench adam --help)");
        return 2;
    }
    unsigned c = !strcmp(cmd, "train") ? FY_CMD_TRAIN : !strcmp(cmd, "eval") ? FY_CMD_EVAL
                 : !strcmp(cmd, "probe") ? FY_CMD_PROBE : !strcmp(cmd, "tune") ? FY_CMD_TUNE
                 : !strcmp(cmd, "sweep") ? FY_CMD_SWEEP : 0;
    if (!c) {
        fy_log_error("unknown command '%s' (commands: train, eval, probe, tune, sweep, info, bench)", cmd);
        return 2;
    }
    fy_opts o;
    int rc = fy_opts_parse(&o, c, argc, argv, 2);
    if (rc == 1 && c == FY_CMD_SWEEP) {
        fy_opts_help(c, "usage: ferry sweep --model M --grid SPEC [--steps N] [--simulate] "
                        "[--profile P] [--out DIR]\n\nruns (or simulates) every configuration of "
                        "the grid and compares the tuner's predictions with the measurements");
        return 0;
    }
    if (rc == 1 && (c == FY_CMD_PROBE || c == FY_CMD_TUNE)) {
        fy_opts_help(c, c == FY_CMD_PROBE
            ? "usage: ferry probe [--model M] [--batch B] [--seq T] [--disk-dir DIR] [--out "
              "FILE]\n\nmeasures transfers, CPU AdamW, the model's block costs and (with "
              "--disk-dir) the disk into a profile (JSON)"
            : "usage: ferry tune --model M [--profile FILE|NAME] [--gpu-mem SIZE] [--host-mem "
              "SIZE] [--batch B] [--seq T] [--out plan.json]\n\nsearches the offload plans that "
              "fit the budgets and writes the fastest");
        return 0;
    }
    if (rc == 1 && c == FY_CMD_TRAIN) {
        char usage[1024];
        snprintf(usage, sizeof usage, "usage: ferry train [options]\n\ntrains a model; named "
                 "models: %s", fy_model_names());
        fy_opts_help(c, usage);
        return 0;
    }
    if (rc == 1) {
        fy_opts_help(c, "usage: ferry eval --init FILE --data PATH [options]\n\nprints the mean "
                        "loss as a JSON object on the last line");
        return 0;
    }
    if (rc < 0) return 2;
    if (c == FY_CMD_PROBE) return fy_probe_main(&o);
    if (c == FY_CMD_TUNE) return fy_tune_main(&o);
    if (c == FY_CMD_SWEEP) return fy_sweep_main(&o);
    return c == FY_CMD_TRAIN ? fy_train_main(&o) : fy_eval_main(&o);
}
