/* opts.c — the option table, its parser and its --help. */
#include "engine/cli/opts.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "engine/core/status.h"
#include "engine/core/util.h"
#include "offload/disk.h"

#define STR_(x) #x
#define STR(x) STR_(x) /* a macro's value as a string literal */

typedef enum { T_INT, T_FLOAT, T_STR, T_SIZE, T_BOOL, T_OPTSTR, T_SIZES } opt_type; /* T_OPTSTR:
    a string that may be left out ("" then): --resume, --resume PATH, --resume=PATH;
    T_SIZES: a size, or a job's sizes one per rank (S0,S1,...): the first into the field,
    the whole list into fy_opts.gpu_mem_list (--gpu-mem is the one such option) */
typedef enum { R_ANY, R_POS, R_NONNEG, R_UNIT, R_RATIO } opt_range; /* R_UNIT: [0, 1), R_RATIO: [0, 1] */

typedef struct opt {
    const char *name;
    opt_type type;
    size_t offset;
    unsigned cmds;
    const char *def;     /* parsed like user input; NULL = unset */
    opt_range range;
    const char *choices; /* "a|b|c" for strings limited to a set */
    const char *metavar;
    const char *help;
    int64_t max;         /* integers: largest accepted value (0 = INT32_MAX) */
} opt;

#define O(field) offsetof(fy_opts, field)
#define TR FY_CMD_TRAIN
#define EV FY_CMD_EVAL
#define PR FY_CMD_PROBE
#define TU FY_CMD_TUNE
#define SW FY_CMD_SWEEP

static const opt table[] = {
    {"device", T_STR, O(device), TR | EV | PR | TU | SW, "auto", R_ANY, "auto|cpu|cuda", "KIND",
     "backend; auto = cuda when a GPU is present, else cpu", 0},
    {"dtype", T_STR, O(dtype), TR | EV | PR | TU | SW, "auto", R_ANY, "auto|fp32|bf16", "TYPE",
     "device storage of parameters, gradients, activations (fp32 masters and moments "
     "either way); auto = bf16 on cuda, fp32 on cpu", 0},
    {"matmul", T_STR, O(matmul), TR | EV | PR, "auto", R_ANY, "auto|fp32|tf32|bf16", "MATH",
     "cuda: fp32 GEMMs on bf16 or tf32 tensor cores (fp32 accumulation) or exact fp32; "
     "auto = bf16 on cuda (the cpu backend is fp32 only)", 0},
    {"gpu-mem", T_SIZES, O(gpu_mem), TR | EV | PR | TU | SW, "0", R_NONNEG, NULL, "SIZE",
     "device memory budget, e.g. 512MiB, 16GiB (0 = all of it); a job's (train under "
     "mpirun, tune --ranks) may give one per rank: 24GiB,80GiB", 0},
    {"sim-pcie-gbps", T_FLOAT, O(sim_pcie_gbps), TR | EV | PR | TU | SW, "0", R_NONNEG, NULL, "X",
     "cpu backend: throttle host<->device copies to X GB/s (0 = off)", 0},
    {"sim-slowdown", T_STR, O(sim_slowdown), TR, NULL, R_ANY, NULL, "S0,S1,...",
     "cpu backend, a job of several processes: rank i's kernels run S_i times slower "
     "(unlike devices; its profile's compute is slowed as much for the job's search)", 0},
    {"threads", T_INT, O(threads), TR | EV | PR | TU | SW, "0", R_NONNEG, NULL, "N",
     "cpu backend: kernel threads (0 = all cores)", 1024},
    {"model", T_STR, O(model), TR | PR | TU | SW, "gpt2-mini", R_ANY, NULL, "NAME",
     "named model config (listed above); with --init the file sets the shape", 0},
    {"init", T_STR, O(init), TR | EV, NULL, R_ANY, NULL, "PATH",
     "start from these weights: a .safetensors file, a Hugging Face model directory or its "
     "model.safetensors.index.json (GPT-2, Llama, Mistral)", 0},
    {"heads", T_INT, O(heads), TR | EV | PR | TU | SW, "0", R_NONNEG, NULL, "N",
     "attention heads (free shapes; for a GPT-2 file that does not say)", 65536},
    {"kv-heads", T_INT, O(kv_heads), TR | PR | TU | SW, "0", R_NONNEG, NULL, "N",
     "Llama: key/value heads (grouped-query attention; must divide --heads)", 65536},
    {"ffn", T_INT, O(ffn), TR | PR | TU | SW, "0", R_NONNEG, NULL, "N",
     "Llama: the MLP's width (intermediate_size)", 1 << 24},
    {"layers", T_INT, O(layers), TR | PR | TU | SW, "0", R_NONNEG, NULL, "L",
     "override the named model's layer count (free shapes)", 4096},
    {"channels", T_INT, O(channels), TR | PR | TU | SW, "0", R_NONNEG, NULL, "C",
     "override the named model's channels", 65536},
    {"vocab", T_INT, O(vocab), TR | PR | TU | SW, "0", R_NONNEG, NULL, "V",
     "override the named model's vocabulary", 1 << 24},
    {"max-seq", T_INT, O(max_seq), TR | PR | TU | SW, "0", R_NONNEG, NULL, "T",
     "override the named model's positions", 1 << 20},
    {"data", T_STR, O(data), TR | EV, NULL, R_ANY, NULL, "PATH",
     "token shard(s) (llm.c .bin, glob allowed) or a text file; default: embedded corpus", 0},
    {"val-data", T_STR, O(val_data), TR, NULL, R_ANY, NULL, "PATH",
     "validation tokens (same formats as --data)", 0},
    {"val-split", T_FLOAT, O(val_split), TR, "0", R_UNIT, NULL, "F",
     "without --val-data: hold out the last fraction F of --data for validation", 0},
    {"ranks", T_INT, O(ranks), TU, "1", R_POS, NULL, "N",
     "plan each rank of a data-parallel job of N processes (ZeRO-sharded optimizer state; "
     "the collectives costed from the profile's, probed under mpirun or named); a --profile "
     "or --gpu-mem per rank plans a job of unlike ranks", 1024},
    {"batch", T_INT, O(batch), TR | EV | PR | TU | SW, "8", R_POS, NULL, "B", "micro-batch size", 65536},
    {"seq", T_INT, O(seq), TR | EV | PR | TU | SW, "128", R_POS, NULL, "T", "sequence length", 1 << 20},
    {"chunk-tokens", T_INT, O(chunk_tokens), TR | EV | PR | TU | SW, "4096", R_POS, NULL, "N",
     "a layer's norms, projections and MLP run on N of a micro-batch's positions at a time, "
     "so their workspace is bounded by N, not by the sequence", 1 << 30},
    {"doc-mask", T_STR, O(doc_mask), TR | EV, "none", R_ANY, NULL, "HOW",
     "packed documents: none; eot (a document ends at each end-of-text token: attention "
     "never crosses it and positions restart after it); bos (one starts at each "
     "beginning-of-text token); eot=ID or bos=ID name the token", 0},
    {"grad-accum", T_INT, O(grad_accum), TR, "1", R_POS, NULL, "N",
     "micro-batches per optimizer step (in a job: per rank)", 1024},
    {"batch-shares", T_STR, O(batch_shares), TR, "equal", R_ANY, NULL, "HOW",
     "a job's micro-batches by rank: equal (--grad-accum each), auto (the same total, "
     "balancing the ranks' predicted steps under their own plans and profiles), or "
     "n0,n1,... per rank", 0},
    {"steps", T_INT, O(steps), TR | SW, "300", R_POS, NULL, "N", "optimizer steps", (int64_t)1 << 40},
    {"lr", T_FLOAT, O(lr), TR, "2e-3", R_POS, NULL, "X", "peak learning rate", 0},
    {"lr-schedule", T_STR, O(lr_schedule), TR, "cosine", R_ANY, "const|cosine", "S",
     "const, or linear warmup then cosine decay to --min-lr", 0},
    {"warmup", T_INT, O(warmup), TR, "20", R_NONNEG, NULL, "N", "warmup steps (cosine)", 0},
    {"min-lr", T_FLOAT, O(min_lr), TR, NULL, R_NONNEG, NULL, "X",
     "floor of the cosine schedule (default: lr / 10)", 0},
    {"weight-decay", T_FLOAT, O(weight_decay), TR, "0.1", R_NONNEG, NULL, "X",
     "AdamW decoupled weight decay (2-D tensors only)", 0},
    {"beta1", T_FLOAT, O(beta1), TR, "0.9", R_UNIT, NULL, "X", "AdamW beta1", 0},
    {"beta2", T_FLOAT, O(beta2), TR, "0.95", R_UNIT, NULL, "X", "AdamW beta2", 0},
    {"eps", T_FLOAT, O(eps), TR, "1e-8", R_POS, NULL, "X", "AdamW epsilon", 0},
    {"clip", T_FLOAT, O(clip), TR, "1.0", R_NONNEG, NULL, "X",
     "clip the global gradient norm to X (0 = off)", 0},
    {"seed", T_INT, O(seed), TR, "1337", R_NONNEG, NULL, "N", "initialisation seed", (int64_t)1 << 62},
    {"plan", T_STR, O(plan), TR, NULL, R_ANY, NULL, "FILE",
     "placement plan (JSON, as written by --save-plan)", 0},
    {"save-plan", T_STR, O(save_plan), TR, NULL, R_ANY, NULL, "FILE",
     "write the plan in use as JSON", 0},
    {"offload-params", T_FLOAT, O(offload_params), TR, "0", R_RATIO, NULL, "R",
     "stream the parameters of the first ceil(R*L) layers from host memory (R=1: all blocks)", 0},
    {"offload-optim", T_FLOAT, O(offload_optim), TR, "0", R_RATIO, NULL, "R",
     "run the optimizer of the last ceil(R*L) layers on the CPU (R=1: all blocks)", 0},
    {"speculate", T_FLOAT, O(speculate), TR, "0", R_RATIO, NULL, "R",
     "start the CPU updates of the last ceil(R*L) layers (R=1: all blocks) as soon as their "
     "gradients reach the host, before the step's norm is known, exactly (a step that clips "
     "redoes them); 12 host bytes a parameter more", 0},
    {"ckpt-layers", T_INT, O(ckpt_layers), TR, "0", R_NONNEG, NULL, "K",
     "recompute the activations of the first K layers in backward", 0},
    {"offload-acts", T_FLOAT, O(offload_acts), TR, "0", R_RATIO, NULL, "R",
     "keep the inputs of the first ceil(R*L) layers in pinned host memory (they recompute; "
     "sent after their forward, fetched before their recompute)", 0},
    {"disk-optim", T_FLOAT, O(disk_optim), TR, "0", R_RATIO, NULL, "R",
     "keep the fp32 master and moments of the CPU-updated blocks among the last ceil(R*L) "
     "layers (R=1: all of them) in a scratch file under --disk-dir", 0},
    {"disk-mem", T_SIZE, O(disk_mem), TR | TU, "0", R_NONNEG, NULL, "SIZE",
     "disk budget of the disk tier: train, the scratch file's limit (0: --disk-dir's free "
     "space, which also binds when smaller); train --plan auto, the search's (with "
     "--disk-dir); tune, the search's (0: no disk tier)", 0},
    {"dry-run", T_BOOL, O(dry_run), TR, "0", R_ANY, NULL, NULL,
     "print the plan and its memory model, then exit", 0},
    {"schedule", T_STR, O(schedule), TR | TU | SW, "priority", R_ANY, "priority|fifo|serial", "S",
     "task order: by next use, by readiness, or one task at a time (tune, sweep: the one "
     "the simulator predicts)", 0},
    {"trace", T_STR, O(trace), TR | TU, NULL, R_ANY, NULL, "FILE",
     "write a Chrome trace (JSON) of every task, one row per lane (tune: the pick's "
     "simulated steps)", 0},
    {"adam-threads", T_INT, O(adam_threads), TR | PR | TU | SW, "0", R_NONNEG, NULL, "N",
     "threads of the CPU optimizer (0 = --threads)", 1024},
    {"predict", T_BOOL, O(predict), TR, "0", R_ANY, NULL, NULL,
     "after training, simulate every schedule with the task times measured in this run", 0},
    {"profile", T_STR, O(profile), TU | TR | SW, NULL, R_ANY, NULL, "FILE|NAME",
     "machine profile for tuning: a file from ferry probe, or a named one (a100-40gb-pcie4, "
     "a100-80gb-pcie4, rtx4090-pcie4, h100-80gb-pcie5, h200-141gb); a job's ranks may each "
     "have one: P0,P1,... (tune: a job of that many ranks); default: this machine's cached "
     "probe", 0},
    {"host-mem", T_SIZE, O(host_mem), TU | TR | SW, "0", R_NONNEG, NULL, "SIZE",
     "host memory budget: binds training and tuning (0 = no limit)", 0},
    {"pinned-mem", T_SIZE, O(pinned_mem), TR | EV, "0", R_NONNEG, NULL, "SIZE",
     "page-locked host memory for the buffers the device copies (0 = half the machine's); "
     "past it they are pageable (slower copies)", 0},
    {"disk-dir", T_STR, O(disk_dir), TR | PR, NULL, R_ANY, NULL, "DIR",
     "an existing, empty directory for the disk tier's scratch file (created and unlinked at "
     "once, so nothing is left behind); train: where the plan's state on disk lives; probe: "
     "also measure the drive there, written, synced and read back at queue depth "
     STR(FY_DISK_QDEPTH) " (without it the disk is not probed)", 0},
    {"disk-probe-size", T_SIZE, O(disk_probe_size), PR, "1GiB", R_POS, NULL, "SIZE",
     "with --disk-dir: the scratch file's size (past the drive's write cache, it measures "
     "the sustained rate)", 0},
    {"out", T_STR, O(out), PR | TU | SW, NULL, R_ANY, NULL, "FILE",
     "where to write the profile (probe; default the per-machine cache) or the plan (tune)", 0},
    {"grid", T_STR, O(grid), SW, NULL, R_ANY, NULL, "SPEC",
     "sweep axes: offload_params=0:1:0.25,offload_optim=0,1,ckpt=0,L,micro=1,2", 0},
    {"capacity", T_BOOL, O(capacity), TU, "0", R_ANY, NULL, NULL,
     "instead of one model's plan: the named models and free shapes that fit the budgets "
     "(--profile's device, --host-mem or the profile's host), each with its best plan", 0},
    {"simulate", T_BOOL, O(simulate), SW, "0", R_ANY, NULL, NULL,
     "sweep: predict only, run nothing", 0},
    {"val-every", T_INT, O(val_every), TR, "0", R_NONNEG, NULL, "N",
     "evaluate every N steps (0 = only at the end)", 0},
    {"val-batches", T_INT, O(val_batches), TR, "20", R_POS, NULL, "N",
     "batches per validation", 0},
    {"batches", T_INT, O(batches), EV, "0", R_NONNEG, NULL, "N",
     "batches to evaluate (0 = one pass over the data)", 0},
    {"log-every", T_INT, O(log_every), TR, "0", R_NONNEG, NULL, "N",
     "print a line every N steps (0 = every step up to 100 steps, else 1/50 of the run)", 0},
    {"save", T_STR, O(save), TR, NULL, R_ANY, NULL, "PATH",
     "write the trained weights at the end: PATH.safetensors is one file, any other PATH a "
     "Hugging Face model directory (config.json, shards, index)", 0},
    {"save-dtype", T_STR, O(save_dtype), TR, "fp32", R_ANY, "fp32|bf16", "TYPE",
     "the saved weights' type", 0},
    {"save-shard-size", T_SIZE, O(save_shard_size), TR, "5GB", R_POS, NULL, "SIZE",
     "a saved directory's shards at most (a larger tensor gets one of its own)", 0},
    {"metrics", T_STR, O(metrics), TR, NULL, R_ANY, NULL, "FILE",
     "append one JSON object per step (JSON Lines)", 0},
    {"checkpoint-dir", T_STR, O(ckpt_dir), TR, NULL, R_ANY, NULL, "DIR",
     "write checkpoints (fp32 master weights, Adam moments, the run's state) into DIR/step-N "
     "at the end, every --checkpoint-every steps and on SIGTERM/SIGINT; DIR/latest is the "
     "newest", 0},
    {"checkpoint-every", T_INT, O(ckpt_every), TR, "0", R_NONNEG, NULL, "N",
     "a checkpoint every N steps (0 = only at the end and when interrupted)", (int64_t)1 << 40},
    {"checkpoint-keep", T_INT, O(ckpt_keep), TR, "2", R_POS, NULL, "K",
     "checkpoints kept (the newest K; older ones are removed)", 1 << 20},
    {"checkpoint-sync", T_BOOL, O(ckpt_sync), TR, "0", R_ANY, NULL, NULL,
     "write each checkpoint before training goes on (default: from a snapshot in host "
     "memory, 12 bytes a parameter, in the background, when the memory allows)", 0},
    {"resume", T_OPTSTR, O(resume), TR, NULL, R_ANY, NULL, "[PATH]",
     "continue from the newest checkpoint in --checkpoint-dir (or from checkpoint PATH), "
     "bit-exactly under any plan (another micro-batch split rounds differently); with none "
     "yet, start from the first step", 0},
    {"quiet", T_BOOL, O(quiet), TR | EV | PR | TU | SW, "0", R_ANY, NULL, NULL, "only errors and results", 0},
};
#define NOPTS (int)(sizeof table / sizeof table[0])
_Static_assert(sizeof table / sizeof table[0] <= 128, "set_mask holds 128 options");

/* Item i of a comma-separated list into out (cut to cap - 1 bytes); its whole length. */
static size_t list_item(const char *value, int i, char *out, size_t cap) {
    const char *p = value;
    for (int k = 0; k < i && p; k++)
        if ((p = strchr(p, ','))) p++;
    if (!p) p = "";
    const char *comma = strchr(p, ',');
    const size_t len = comma ? (size_t)(comma - p) : strlen(p);
    snprintf(out, cap, "%.*s", (int)(len < cap ? len : cap - 1), p);
    return len;
}

static int set_value(fy_opts *o, const opt *op, const char *v, bool from_user) {
    char *base = (char *)o + op->offset;
    switch (op->type) {
    case T_STR:
        if (op->choices) {
            size_t n = strlen(v);
            const char *c = op->choices;
            bool ok = false;
            while (*c) {
                const char *bar = strchr(c, '|');
                size_t len = bar ? (size_t)(bar - c) : strlen(c);
                if (len == n && !strncmp(c, v, n)) ok = true;
                c += len + (bar ? 1 : 0);
            }
            if (!ok) {
                fy_log_error("--%s: '%s' is not one of %s", op->name, v, op->choices);
                return -1;
            }
        }
        if (!*v) { fy_log_error("--%s: empty value", op->name); return -1; }
        *(const char **)base = v;
        return 0;
    case T_BOOL:
        *(bool *)base = !strcmp(v, "1");
        return 0;
    case T_OPTSTR:
        *(const char **)base = v;
        return 0;
    case T_INT: {
        int64_t x;
        if (fy_parse_i64(v, &x)) {
            fy_log_error("--%s: '%s' is not an integer", op->name, v);
            return -1;
        }
        if ((op->range == R_POS && x <= 0) || (op->range == R_NONNEG && x < 0)) {
            fy_log_error("--%s: must be %s, got %s", op->name,
                         op->range == R_POS ? "positive" : "zero or positive", v);
            return -1;
        }
        int64_t max = op->max ? op->max : INT32_MAX;
        if (x > max) {
            fy_log_error("--%s: %s is too large (at most %lld)", op->name, v, (long long)max);
            return -1;
        }
        *(int64_t *)base = x;
        return 0;
    }
    case T_FLOAT: {
        double x;
        if (fy_parse_f64(v, &x)) {
            fy_log_error("--%s: '%s' is not a number", op->name, v);
            return -1;
        }
        const char *need = NULL;
        if (op->range == R_POS && !(x > 0)) need = "positive";
        if (op->range == R_NONNEG && !(x >= 0)) need = "zero or positive";
        if (op->range == R_UNIT && !(x >= 0 && x < 1)) need = "in [0, 1)";
        if (op->range == R_RATIO && !(x >= 0 && x <= 1)) need = "a ratio in [0, 1]";
        if (need) {
            fy_log_error("--%s: must be %s, got %s", op->name, need, v);
            return -1;
        }
        *(double *)base = x;
        return 0;
    }
    case T_SIZE: {
        size_t x;
        if (fy_parse_size(v, &x)) {
            fy_log_error("--%s: '%s' is not a size (examples: 512MiB, 16GiB, 1.5GB)", op->name, v);
            return -1;
        }
        if (op->range == R_POS && x == 0) {
            fy_log_error("--%s: must be positive, got %s", op->name, v);
            return -1;
        }
        *(size_t *)base = x;
        return 0;
    }
    case T_SIZES: {
        size_t first = 0;
        for (int i = 0, n = fy_opts_list_count(v); i < n; i++) {
            char item[64];
            size_t x;
            const size_t len = list_item(v, i, item, sizeof item);
            if (len == 0 || len >= sizeof item || fy_parse_size(item, &x)) {
                fy_log_error("--%s: '%s' is not a size (examples: 512MiB, 16GiB, 1.5GB; a job's, one "
                             "per rank: 8GiB,2GiB)", op->name, len ? item : v);
                return -1;
            }
            if (i == 0) first = x;
        }
        *(size_t *)base = first;
        o->gpu_mem_list = strchr(v, ',') ? v : NULL;
        return 0;
    }
    }
    (void)from_user;
    return -1;
}

int fy_opts_parse(fy_opts *o, unsigned cmd, int argc, char **argv, int first) {
    memset(o, 0, sizeof *o);
    for (int i = 0; i < NOPTS; i++)
        if (table[i].def && set_value(o, &table[i], table[i].def, false))
            FY_ASSERT(0, "bad default in the option table");
    for (int a = first; a < argc; a++) {
        const char *arg = argv[a];
        if (!strcmp(arg, "--help") || !strcmp(arg, "-h")) return 1;
        if (strncmp(arg, "--", 2) != 0) {
            fy_log_error("unexpected argument '%s' (options start with --; see --help)", arg);
            return -1;
        }
        const char *name = arg + 2, *eq = strchr(name, '=');
        size_t nlen = eq ? (size_t)(eq - name) : strlen(name);
        int k = -1;
        for (int i = 0; i < NOPTS; i++)
            if (strlen(table[i].name) == nlen && !strncmp(table[i].name, name, nlen) &&
                (table[i].cmds & cmd)) k = i;
        if (k < 0) {
            fy_log_error("unknown option '--%.*s' (see --help)", (int)nlen, name);
            return -1;
        }
        const char *val;
        if (table[k].type == T_BOOL) {
            if (eq) { fy_log_error("--%s takes no value", table[k].name); return -1; }
            val = "1";
        } else if (eq) {
            val = eq + 1;
            if (table[k].type == T_OPTSTR && !*val) {
                fy_log_error("--%s=: empty value (leave out '=' for the default)", table[k].name);
                return -1;
            }
        } else if (table[k].type == T_OPTSTR) {
            val = a + 1 < argc && strncmp(argv[a + 1], "--", 2) != 0 ? argv[++a] : "";
        } else {
            if (a + 1 >= argc) {
                fy_log_error("--%s needs a value (%s)", table[k].name, table[k].metavar);
                return -1;
            }
            val = argv[++a];
        }
        if (set_value(o, &table[k], val, true)) return -1;
        o->set_mask[k / 32] |= 1u << (k % 32);
    }
    /* a value per rank is a job's: train under a launcher, tune of several ranks */
    const char *listed = o->gpu_mem_list && !(cmd & (FY_CMD_TRAIN | FY_CMD_TUNE)) ? "gpu-mem"
                       : o->profile && strchr(o->profile, ',') && cmd == FY_CMD_SWEEP ? "profile" : NULL;
    if (listed) {
        fy_log_error("--%s: one value per rank is a job's (train under mpirun, or tune); this "
                     "command takes one", listed);
        return -1;
    }
    return 0;
}

/* The kind --device names: auto is cuda when a GPU is present and --sim-pcie-gbps (a cpu
 * backend option) is not set; why says why there is no GPU when auto looked for one. An
 * emulated GPU (-Dcuda=emulated) is for testing the cuda backend and slower than the cpu
 * backend: auto never picks it. */
static fy_dev_kind kind_of(const fy_opts *o, char *why, size_t whylen) {
    why[0] = 0;
    if (!strcmp(o->device, "cuda")) return FY_DEV_CUDA;
    if (!strcmp(o->device, "cpu") || o->sim_pcie_gbps > 0 || fy_dev_cuda_emulated()) return FY_DEV_CPU;
    fy_gpu_info gpu;
    return fy_dev_gpus(&gpu, 1, why, whylen) > 0 ? FY_DEV_CUDA : FY_DEV_CPU;
}

fy_status fy_opts_dev_cfg(const fy_opts *o, bool need_gpu, fy_dev_cfg *out) {
    memset(out, 0, sizeof *out);
    if (o->sim_pcie_gbps > 0 && o->sim_pcie_gbps < 1e-3) {
        fy_log_error("--sim-pcie-gbps: must be 0 (off) or at least 0.001, got %g", o->sim_pcie_gbps);
        return FY_ERR_INVALID;
    }
    out->mem_cap_nbytes = o->gpu_mem;
    out->pinned_cap_nbytes = o->pinned_mem;
    out->sim_pcie_gbps = o->sim_pcie_gbps;
    out->threads = (int)o->threads;
    if (fy_matmul_math_parse(o->matmul ? o->matmul : "auto", &out->matmul) != 0) {
        fy_log_error("--matmul: unknown arithmetic '%s' (auto, fp32, tf32, bf16)", o->matmul);
        return FY_ERR_INVALID;
    }
    char why[160];
    out->kind = kind_of(o, why, sizeof why);
    fy_gpu_info gpu;
    if (out->kind == FY_DEV_CUDA && !strcmp(o->device, "cuda") && need_gpu &&
        fy_dev_gpus(&gpu, 1, why, sizeof why) == 0) {
        fy_log_error("--device cuda: %s", why);
        return FY_ERR_UNSUPPORTED;
    }
    if (out->kind == FY_DEV_CPU && why[0] && !o->quiet)
        fy_log_info("%s: using the cpu backend", why);
    if (out->kind == FY_DEV_CPU && out->matmul != FY_MATMUL_AUTO && out->matmul != FY_MATMUL_FP32) {
        fy_log_error("--matmul %s: the cpu backend computes GEMMs in fp32 only", o->matmul);
        return FY_ERR_INVALID;
    }
    return FY_OK;
}

fy_dtype fy_opts_dtype(const fy_opts *o, fy_dev_kind kind) {
    const char *d = o->dtype ? o->dtype : "auto";
    if (!strcmp(d, "fp32")) return FY_F32;
    if (!strcmp(d, "bf16")) return FY_BF16;
    return kind == FY_DEV_CUDA ? FY_BF16 : FY_F32;
}

fy_sched_mode fy_opts_schedule(const fy_opts *o) {
    fy_sched_mode m = FY_SCHED_PRIORITY;
    if (o->schedule) fy_sched_mode_parse(o->schedule, &m);
    return m;
}

fy_dev_kind fy_opts_dev_kind(const fy_opts *o) {
    char why[160];
    return kind_of(o, why, sizeof why);
}

static const opt *find(const char *name) {
    for (int i = 0; i < NOPTS; i++)
        if (!strcmp(table[i].name, name)) return &table[i];
    return NULL;
}

bool fy_opts_given(const fy_opts *o, const char *name) {
    const opt *op = find(name);
    FY_ASSERT(op, "fy_opts_given: no such option");
    const int i = (int)(op - table);
    return (o->set_mask[i / 32] >> (i % 32)) & 1u;
}

const char *fy_opts_str(const fy_opts *o, const char *name) {
    const opt *op = find(name);
    FY_ASSERT(op && (op->type == T_STR || op->type == T_OPTSTR), "fy_opts_str: no such string option");
    return *(const char *const *)((const char *)o + op->offset);
}

bool fy_opts_takes(unsigned cmd, const char *name) {
    const opt *op = find(name);
    return op && (op->cmds & cmd);
}

int fy_opts_list_count(const char *value) {
    int n = 1;
    for (const char *p = value; (p = strchr(p, ',')); p++) n++;
    return n;
}

fy_status fy_opts_rank_item(const char *flag, const char *value, int world, int rank, char *out,
                            size_t cap) {
    const int n = fy_opts_list_count(value);
    if (n != 1 && n != world) {
        fy_log_error("--%s: '%s' gives %d values; give one (every rank's) or one per rank (%d)",
                     flag, value, n, world);
        return FY_ERR_USAGE;
    }
    const size_t len = list_item(value, n > 1 ? rank : 0, out, cap);
    if (len == 0 || len >= cap) {
        fy_log_error("--%s: '%s': rank %d's value is %s", flag, value, rank, len ? "too long" : "empty");
        return FY_ERR_USAGE;
    }
    return FY_OK;
}

int fy_opts_count(void) { return NOPTS; }

void fy_opts_at(int i, const char **name, const char **metavar, unsigned *cmds) {
    FY_ASSERT(i >= 0 && i < NOPTS, "fy_opts_at: no such option");
    *name = table[i].name;
    *metavar = table[i].metavar;
    *cmds = table[i].cmds;
}

void fy_opts_help(unsigned cmd, const char *usage) {
    printf("%s\n\noptions:\n", usage);
    for (int i = 0; i < NOPTS; i++) {
        const opt *op = &table[i];
        if (!(op->cmds & cmd)) continue;
        char left[48];
        snprintf(left, sizeof left, "--%s%s%s", op->name, op->metavar ? " " : "",
                 op->metavar ? op->metavar : "");
        printf("  %-24s %s", left, op->help);
        if (op->choices) printf(" [%s]", op->choices);
        if (op->def && op->type != T_BOOL) printf(" (default %s)", op->def);
        printf("\n");
    }
}
