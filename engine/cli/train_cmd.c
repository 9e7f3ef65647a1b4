/* train_cmd.c — `ferry train` and `ferry eval`: the model (a named config with the shape
 * flags, or a weights file; --model and --init must then agree), the plan (a file, the
 * shorthands, or --plan auto through the tuner), the device and the storage type, checked
 * before any work; a dry run prints the plan and its memory model. The rest is the
 * training loop's (engine/train.c). */
#include "engine/cli/train_cmd.h"

#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include "engine/checkpoint.h"
#include "engine/device/kernels.h"
#include "engine/cli/job_cmd.h"
#include "engine/cli/tune_cmd.h"
#include "engine/core/util.h"
#include "engine/train.h"
#include "offload/disk.h"

/* This process's rank in a data-parallel job (0 alone): only rank 0 writes outputs. */
static int g_rank;

/* The exit status of a command's result: 2 for a command-line error, as the parser's;
 * 128 + the signal's number for a run a signal stopped, as a shell reports it. */
static int exit_status(fy_status st) {
    if (st == FY_INTERRUPTED) return 128 + atomic_load(&fy_train_stop_signal);
    return st == FY_OK ? 0 : st == FY_ERR_USAGE ? 2 : 1;
}

/* SIGTERM and SIGINT: the first stops the run after the step in progress (with a
 * checkpoint, when there is a checkpoint directory); a second exits at once, leaving the
 * checkpoints complete before it as they are. One request often arrives twice within
 * microseconds (a wrapper such as timeout(1) or a launcher signals the process and its
 * process group): a signal less than DUPLICATE_MS after the first is the same request. */
#define DUPLICATE_MS 250
static atomic_llong first_signal_ms;
/* The handler's line, made before the handler is installed (a job's names the rank). */
static char stop_msg[96];
static size_t stop_msg_len;

static void on_stop_signal(int sig) {
    const int saved = errno;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* async-signal-safe */
    const long long now = (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
    if (atomic_load(&fy_train_stop_signal)) {
        if (now - atomic_load(&first_signal_ms) >= DUPLICATE_MS) _exit(128 + sig);
        errno = saved;
        return;
    }
    atomic_store(&first_signal_ms, now);
    atomic_store(&fy_train_stop_signal, sig);
    ssize_t w = write(STDERR_FILENO, stop_msg, stop_msg_len);
    (void)w;
    errno = saved;
}

static void catch_stop_signals(int world) {
    char who[32] = "";
    if (world > 1) snprintf(who, sizeof who, "rank %d: ", g_rank);
    int n = snprintf(stop_msg, sizeof stop_msg, "\nferry: %sstopping after this step (again to exit "
                     "at once)\n", who);
    stop_msg_len = n > 0 && (size_t)n < sizeof stop_msg ? (size_t)n : 0;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop_signal;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask); /* one handler at a time: the second signal sees the first */
    sigaddset(&sa.sa_mask, SIGTERM);
    sigaddset(&sa.sa_mask, SIGINT);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
}

/* The checkpoint flags together, before any work. */
static fy_status check_ckpt_flags(const fy_opts *o) {
    if (!o->ckpt_dir && (fy_opts_given(o, "checkpoint-every") || fy_opts_given(o, "checkpoint-keep") ||
                         o->ckpt_sync)) {
        fy_log_error("--checkpoint-every, --checkpoint-keep and --checkpoint-sync need --checkpoint-dir");
        return FY_ERR_USAGE;
    }
    if (o->resume && !*o->resume && !o->ckpt_dir) {
        fy_log_error("--resume without a PATH resumes from --checkpoint-dir's newest checkpoint: "
                     "give --checkpoint-dir DIR or --resume PATH");
        return FY_ERR_USAGE;
    }
    if (o->ckpt_dir && o->dry_run) return FY_OK;
    return o->ckpt_dir ? fy_ckpt_dir_check(o->ckpt_dir) : FY_OK;
}

#define MAX_TOKENS ((int64_t)1 << 26) /* per micro-batch */

static fy_status check_tokens(int64_t B, int64_t T, const char *what) {
    if (B * T <= MAX_TOKENS) return FY_OK;
    fy_log_error("%s %lld x --seq %lld = %lld tokens per micro-batch is too many (at most %lld)",
                 what, (long long)B, (long long)T, (long long)(B * T), (long long)MAX_TOKENS);
    return FY_ERR_USAGE;
}

/* The model: from the weights when --init is given (a --model given too must agree with
 * them), else the named config with the shape flags. */
static fy_status resolve_model(const fy_opts *o, bool model_given, fy_weights **init,
                               fy_model **out) {
    *out = NULL;
    if (!o->init) return fy_opts_model(o, out);
    if (o->layers || o->channels || o->vocab || o->max_seq) {
        fy_log_error("--layers/--channels/--vocab/--max-seq shape a new model; the weights in "
                     "%s have their own shape", o->init);
        return FY_ERR_USAGE;
    }
    FY_TRY(fy_weights_open(o->init, init));
    fy_model_shape hint = {.heads = (int)o->heads, .kv_heads = (int)o->kv_heads, .ffn = (int)o->ffn};
    FY_TRY(fy_model_from_weights(*init, &hint, out));
    fy_model_set_chunk(*out, (int)o->chunk_tokens);
    if (model_given) {
        fy_model *named;
        fy_model_shape over = {.heads = (int)o->heads};
        FY_TRY(fy_model_named(o->model, &over, &named));
        bool same = fy_model_same(named, *out);
        fy_model_free(named);
        if (!same) {
            char shape[FY_MODEL_SIGNATURE_MAX];
            fy_model_describe(*out, shape, sizeof shape);
            fy_log_error("--model %s does not match the weights in %s (%s: %s)", o->model,
                         o->init, fy_model_family(*out), shape);
            return FY_ERR_INVALID;
        }
    }
    return fy_model_check_seq(*out, o->seq);
}

/* The placement plan: a file, the tuner's (--plan auto), or the shorthands over the
 * all-resident plan. */
static fy_status resolve_plan(const fy_opts *o, const fy_model *m, fy_dev_kind kind,
                              fy_comm *comm, const double *slowdown, fy_plan *plan) {
    bool shorthands = fy_opts_given(o, "offload-params") || fy_opts_given(o, "offload-optim") ||
                      fy_opts_given(o, "ckpt-layers") || fy_opts_given(o, "speculate") ||
                      fy_opts_given(o, "disk-optim") || fy_opts_given(o, "offload-acts");
    if (o->profile && !(o->plan && !strcmp(o->plan, "auto")) &&
        (strcmp(o->batch_shares, "auto") || fy_comm_size(comm) == 1)) {
        fy_log_error("--profile is the machine --plan auto (or a job's --batch-shares auto) plans "
                     "for; without either it would be ignored");
        return FY_ERR_USAGE;
    }
    if (o->plan && !strcmp(o->plan, "auto")) {
        if (o->disk_mem && !o->disk_dir) {
            fy_log_error("--disk-mem with --plan auto: give --disk-dir DIR too, where the plan "
                         "may keep optimizer state (its free space, or --disk-mem if less, is "
                         "the disk budget)");
            return FY_ERR_USAGE;
        }
        if (shorthands) {
            fy_log_error("--plan auto cannot be combined with --offload-params, --offload-optim, "
                         "--speculate, --ckpt-layers, --offload-acts or --disk-optim");
            return FY_ERR_USAGE;
        }
        if (fy_comm_size(comm) > 1) { /* each rank its own, and with auto its share */
            if (strcmp(o->batch_shares, "equal") && strcmp(o->batch_shares, "auto")) {
                if (fy_comm_rank(comm) == 0) /* every rank's mistake (the ranks agree on it) */
                    fy_log_error("--batch-shares %s counts micro-batches of --batch, and --plan "
                                 "auto chooses the micro-batch size: give auto or equal",
                                 o->batch_shares);
                return FY_ERR_USAGE;
            }
            FY_TRY(fy_plan_new(m, (int)o->batch, (int)o->grad_accum, plan));
            FY_TRY(fy_job_plans(o, m, comm, slowdown, true, !strcmp(o->batch_shares, "auto"), plan));
        } else {
            FY_TRY(fy_tune_auto_plan(o, m, plan));
        }
    } else if (o->plan) {
        if (shorthands) {
            fy_log_error("--plan cannot be combined with --offload-params, --offload-optim, "
                         "--speculate, --ckpt-layers, --offload-acts or --disk-optim");
            return FY_ERR_USAGE;
        }
        FY_TRY(fy_plan_load(o->plan, m, plan));
        if ((fy_opts_given(o, "batch") && o->batch != plan->micro_batch) ||
            (fy_opts_given(o, "grad-accum") && o->grad_accum != plan->grad_accum)) {
            fy_log_error("--batch/--grad-accum disagree with plan %s (micro_batch %d, "
                         "grad_accum %d)", o->plan, plan->micro_batch, plan->grad_accum);
            return FY_ERR_USAGE;
        }
    } else {
        FY_TRY(fy_plan_new(m, (int)o->batch, (int)o->grad_accum, plan));
        if (o->ckpt_layers > fy_model_layers(m)) {
            fy_log_error("--ckpt-layers %lld: the model has %d layers", (long long)o->ckpt_layers,
                         fy_model_layers(m));
            return FY_ERR_USAGE;
        }
        FY_TRY(fy_plan_shorthands(plan, o->offload_params, o->offload_optim, (int)o->ckpt_layers));
        FY_TRY(fy_plan_speculate(plan, o->speculate));
        bool any = false;
        for (int b = 0; b < plan->nblocks; b++) any |= plan->blocks[b].speculate;
        if (o->speculate > 0 && !any) {
            fy_log_error("--speculate %g: none of those layers is updated on the CPU "
                         "(--offload-optim chooses which are)", o->speculate);
            return FY_ERR_USAGE;
        }
        FY_TRY(fy_plan_offload_acts(plan, o->offload_acts));
        FY_TRY(fy_plan_disk(plan, o->disk_optim));
        if (o->disk_optim > 0 && !fy_plan_uses_disk(plan)) {
            fy_log_error("--disk-optim %g: none of those layers is updated on the CPU "
                         "(--offload-optim chooses which are)", o->disk_optim);
            return FY_ERR_USAGE;
        }
    }
    const bool autoplan = o->plan && !strcmp(o->plan, "auto");
    if (fy_plan_uses_disk(plan) && !o->disk_dir && !o->dry_run) {
        fy_log_error("the plan keeps optimizer state on disk: give --disk-dir DIR (an empty "
                     "directory on a fast disk)");
        return FY_ERR_USAGE;
    }
    if (o->disk_dir && !fy_plan_uses_disk(plan) && !autoplan) { /* auto: if needed */
        fy_log_error("--disk-dir %s: the plan keeps nothing on disk (--disk-optim, or a plan "
                     "file with master and moments on disk)", o->disk_dir);
        return FY_ERR_USAGE;
    }
    if (comm && fy_comm_size(comm) > 1) { /* every rank stops; the first that speculates says why */
        int32_t first = 0;
        for (int b = 0; b < plan->nblocks; b++)
            if (plan->blocks[b].speculate) first = fy_comm_size(comm) - fy_comm_rank(comm);
        FY_TRY(fy_comm_max_i32(comm, &first));
        if (first && fy_comm_size(comm) - fy_comm_rank(comm) == first)
            fy_log_error("%s: a speculative update runs in one process (a job's norm is known "
                         "only after its reduces)", o->plan ? o->plan : "--speculate");
        if (first) return FY_ERR_USAGE;
    }
    FY_TRY(check_tokens(plan->micro_batch, o->seq, "micro-batch"));
    /* a plan file keeps the storage type it names unless --dtype says otherwise */
    if (!o->plan || !strcmp(o->plan, "auto") || fy_opts_given(o, "dtype") ||
        plan->dtype == FY_DTYPE_NONE)
        plan->dtype = fy_opts_dtype(o, kind);
    return FY_OK;
}

/* The plan's memory against the budgets, before anything is allocated: --host-mem, and
 * the device's: --gpu-mem, or on the cpu backend (whose device memory is this machine's
 * RAM) 7/8 of the physical memory less the host state, which also becomes the device's
 * budget, so an oversized run ends with one error instead of the OOM killer. */
static fy_status check_budgets(const fy_opts *o, const fy_mem_model *plan_mm, fy_dev_cfg *dev) {
    const fy_mem_model mm = *plan_mm;
    char need[32], have[32], short_by[32];
    if (o->host_mem && mm.host_total > o->host_mem) {
        fy_log_error("host memory: the plan needs %s; the budget (--host-mem) is %s, short by %s "
                     "(offload less, or --plan auto)", fy_fmt_size(mm.host_total, need, sizeof need),
                     fy_fmt_size(o->host_mem, have, sizeof have),
                     fy_fmt_size(mm.host_total - o->host_mem, short_by, sizeof short_by));
        return FY_ERR_INVALID;
    }
    if (mm.disk_total) { /* the scratch file is preallocated whole: it must fit */
        struct statvfs fs;
        const size_t avail = o->disk_dir && statvfs(o->disk_dir, &fs) == 0
                                 ? (size_t)fs.f_bavail * (size_t)fs.f_frsize : SIZE_MAX;
        const bool by_flag = o->disk_mem && o->disk_mem < avail;
        const size_t budget = by_flag ? o->disk_mem : avail;
        if (mm.disk_total > budget) {
            fy_log_error("disk: the plan needs %s on disk; %s %s, short by %s",
                         fy_fmt_size(mm.disk_total, need, sizeof need),
                         by_flag ? "the budget (--disk-mem) is" : "--disk-dir's filesystem has free",
                         fy_fmt_size(budget, have, sizeof have),
                         fy_fmt_size(mm.disk_total - budget, short_by, sizeof short_by));
            return FY_ERR_INVALID;
        }
    }
    size_t cap = o->gpu_mem;
    const bool derived = !cap && dev->kind == FY_DEV_CPU;
    if (derived) {
        const size_t phys = (size_t)sysconf(_SC_PHYS_PAGES) * (size_t)sysconf(_SC_PAGE_SIZE);
        cap = phys / 8 * 7 > mm.host_total ? phys / 8 * 7 - mm.host_total : 1;
        dev->mem_cap_nbytes = cap;
    }
    if (cap && mm.device_total > cap) {
        fy_fmt_size(mm.device_total, need, sizeof need);
        fy_fmt_size(cap, have, sizeof have);
        fy_fmt_size(mm.device_total - cap, short_by, sizeof short_by);
        if (derived)
            fy_log_error("device memory: the plan needs %s; the cpu backend's budget is this "
                         "machine's memory, %s (7/8 of it less the host state), short by %s (lower "
                         "--batch or --seq, offload with --plan auto, or set --gpu-mem)", need,
                         have, short_by);
        else
            fy_log_error("device memory: the plan needs %s; the budget (--gpu-mem) is %s, short "
                         "by %s (offload more, or --plan auto)", need, have, short_by);
        return FY_ERR_INVALID;
    }
    return FY_OK;
}

/* A comma-separated list of exactly n numbers (each through parse), for a per-rank flag. */
static fy_status per_rank_list(const char *flag, const char *s, int n, double lo, double hi,
                               double *out) {
    int k = 0;
    const char *p = s;
    while (*p && k <= n) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        char item[64];
        double v;
        if (len == 0 || len >= sizeof item) break;
        memcpy(item, p, len);
        item[len] = '\0';
        if (fy_parse_f64(item, &v) || !(v >= lo && v <= hi)) {
            fy_log_error("--%s: '%s' is not a number in [%g, %g]", flag, item, lo, hi);
            return FY_ERR_USAGE;
        }
        if (k < n) out[k] = v;
        k++;
        if (!comma) { p += len; break; }
        p = comma + 1;
    }
    if (k != n || *p) {
        fy_log_error("--%s: '%s' must give exactly %d comma-separated values, one per rank", flag, s, n);
        return FY_ERR_USAGE;
    }
    return FY_OK;
}

/* --batch-shares n0,n1,...: this rank's micro-batches a step (the plan's grad_accum
 * becomes its count). equal: --grad-accum each; auto: by the job's predictions
 * (fy_job_plans), with --plan auto the search's. */
static fy_status batch_shares(const fy_opts *o, const fy_model *m, fy_comm *comm,
                              const double *slowdown, fy_plan *plan) {
    const int world = fy_comm_size(comm), rank = fy_comm_rank(comm);
    if (!strcmp(o->batch_shares, "equal") || world == 1) return FY_OK;
    if (!strcmp(o->batch_shares, "auto"))
        return o->plan && !strcmp(o->plan, "auto") ? FY_OK /* the search shared them */
                                                   : fy_job_plans(o, m, comm, slowdown, false, true, plan);
    double *w = calloc((size_t)world, sizeof *w);
    if (!w) return FY_ERR_NOMEM;
    fy_status st = per_rank_list("batch-shares", o->batch_shares, world, 1, FY_PLAN_MAX_ACCUM, w);
    for (int r = 0; r < world && st == FY_OK; r++)
        if (w[r] != (double)(int64_t)w[r]) {
            fy_log_error("--batch-shares: %g is not a whole number of micro-batches", w[r]);
            st = FY_ERR_USAGE;
        }
    if (st == FY_OK && rank == 0 && !o->quiet) {
        printf("shares  micro-batches of %d x %lld by rank:", plan->micro_batch, (long long)o->seq);
        for (int r = 0; r < world; r++) printf(" %lld", (long long)w[r]);
        printf("\n");
    }
    if (st == FY_OK) plan->grad_accum = (int)w[rank];
    free(w);
    return st;
}

/* Where this rank's micro-batches sit among the job's each step (tc->micro_first,
 * micro_total), from every rank's count; refused, with one error line from rank 0, when
 * the ranks' micro-batches are not one size (then no one process accumulating them is
 * the same computation; their --seq the ranks agreed on before). */
static fy_status place_micro_batches(fy_comm *comm, const fy_plan *plan, fy_train_cfg *tc) {
    const int world = fy_comm_size(comm), rank = fy_comm_rank(comm);
    if (world == 1) return FY_OK;
    int32_t *v = calloc((size_t)world * 2, sizeof *v);
    fy_status st = fy_comm_agree(comm, v ? FY_OK : FY_ERR_NOMEM);
    if (st == FY_OK) {
        v[2 * rank] = plan->micro_batch;
        v[2 * rank + 1] = plan->grad_accum;
        st = fy_comm_allgather_records(comm, v, 2 * sizeof *v);
    }
    int64_t first = 0, total = 0;
    for (int r = 0; st == FY_OK && r < world; r++) {
        if (v[2 * r] != v[0]) {
            if (rank == 0)
                fy_log_error("the ranks' micro-batches differ: rank 0's are %d sequences, rank %d's "
                             "%d (a job's micro-batches are one size: give every rank the same "
                             "--batch)", v[0], r, v[2 * r]);
            st = FY_ERR_USAGE;
        }
        if (r < rank) first += v[2 * r + 1];
        total += v[2 * r + 1];
    }
    if (st == FY_OK) {
        tc->micro_first = (int)first;
        tc->micro_total = (int)total;
        /* in micro-batch order unless a rank after the first sums several itself */
        bool grouped = false;
        for (int r = 1; r < world; r++) grouped |= v[2 * r + 1] > 1;
        size_t len = 0;
        for (int r = 0; grouped && r < world && len < sizeof tc->sum_groups; r++)
            len += (size_t)snprintf(tc->sum_groups + len, sizeof tc->sum_groups - len, "%s%d",
                                    r ? "," : "", v[2 * r + 1]);
    }
    free(v);
    return st;
}

/* The dry run's last line, for scripts: the model's parameters and the plan's bytes, in
 * total and by category, and the pinned part of the host's under the pinned cap; the
 * device budget (--gpu-mem, this rank's; 0: none given); in a job, this rank's
 * micro-batches a step. */
static void print_memory_json(const fy_model *m, const fy_mem_model *mm, const fy_comm *comm,
                              const char *placed, size_t budget, const fy_plan *plan) {
    static const char *const cats[FY_CAT_COUNT] = {"parameters", "gradients", "optimizer",
                                                   "activations", "staging", "workspace"};
    printf("{");
    if (fy_comm_size(comm) > 1) /* every rank prints its own, and where it runs */
        printf("\"rank\":%d,\"ranks\":%d,\"placed\":\"%s\",\"micro_batches\":%d,",
               fy_comm_rank(comm), fy_comm_size(comm), placed, plan->grad_accum);
    printf("\"params\":%zu,\"device_budget\":%zu,\"device_bytes\":%zu,\"host_bytes\":%zu,"
           "\"pinned_bytes\":%zu,\"disk_bytes\":%zu", fy_model_num_params(m), budget, mm->device_total,
           mm->host_total, mm->host_pinned, mm->disk_total);
    static const char *const sides[3] = {"device", "host", "disk"};
    const size_t *by_side[3] = {mm->device, mm->host, mm->disk};
    for (int side = 0; side < 3; side++) {
        printf(",\"%s\":{", sides[side]);
        for (int c = 0; c < FY_CAT_COUNT; c++) printf("%s\"%s\":%zu", c ? "," : "", cats[c], by_side[side][c]);
        printf("}");
    }
    printf("}\n");
}

/* --doc-mask: none, eot or bos, with the token named (=ID) or the vocabulary's own: GPT-2's
 * <|endoftext|> (50256, both), Llama 3's <|begin_of_text|> / <|end_of_text|> (128000,
 * 128001: instruction data that ends turns with <|eot_id|> names 128009), Llama 2's and
 * Mistral's <s> / </s> (1, 2). */
static fy_status parse_doc_mask(const fy_opts *o, const fy_model *m, fy_doc_mask *out) {
    *out = (fy_doc_mask){FY_DOCS_NONE, 0};
    const char *v = o->doc_mask;
    if (!strcmp(v, "none")) return FY_OK;
    const bool eot = !strncmp(v, "eot", 3), bos = !strncmp(v, "bos", 3);
    const char *id = v + 3;
    if ((!eot && !bos) || (*id && *id != '=')) {
        fy_log_error("--doc-mask %s: expected none, eot, bos, eot=ID or bos=ID", v);
        return FY_ERR_USAGE;
    }
    out->kind = eot ? FY_DOCS_EOT : FY_DOCS_BOS;
    const int V = fy_model_vocab(m);
    int64_t t = -1;
    if (*id) {
        if (fy_parse_i64(id + 1, &t) != FY_OK || t < 0 || t >= V) {
            fy_log_error("--doc-mask %s: the token must be an id below the vocabulary (%d)", v, V);
            return FY_ERR_USAGE;
        }
    } else if (V == 50257 || V == 50304) {
        t = 50256;
    } else if (V == 128256) {
        t = eot ? 128001 : 128000;
    } else if (V == 32000 || V == 32768) {
        t = eot ? 2 : 1;
    } else {
        fy_log_error("--doc-mask %s: ferry does not know this vocabulary's (%d) %s token: name "
                     "it, %s=ID", v, V, eot ? "end-of-text" : "beginning-of-text", eot ? "eot" : "bos");
        return FY_ERR_USAGE;
    }
    out->token = (int32_t)t;
    return FY_OK;
}

/* The training run's configuration from the options (tc->dev is set already). */
/* Whether the model's heads run on the device with storage type dt (one error line). */
static fy_status check_heads(const fy_model *m, fy_dev_kind kind, fy_dtype dt) {
    const int hd = fy_model_head_dim(m), most = fy_attn_max_head(kind, dt);
    if (hd <= most) return FY_OK;
    fy_log_error("heads of %d channels: the %s backend's attention takes at most %d with %s "
                 "storage%s", hd, fy_dev_kind_name(kind), most, fy_dtype_name(dt),
                 kind == FY_DEV_CUDA ? " (bf16 storage takes 256: --dtype bf16)" : "");
    return FY_ERR_USAGE;
}

static void fill_train_cfg(const fy_opts *o, fy_model *m, fy_plan *plan, fy_weights *init,
                           fy_comm *comm, bool lead, bool quiet, fy_train_cfg *tc) {
    tc->model = m;
    tc->plan = plan;
    tc->seq = (int)o->seq;
    tc->init = init;
    tc->data = o->data;
    tc->val_data = o->val_data;
    tc->val_split = o->val_split;
    tc->steps = o->steps;
    tc->lr = o->lr;
    tc->min_lr = fy_opts_given(o, "min-lr") ? o->min_lr : o->lr / 10.0;
    tc->cosine = !strcmp(o->lr_schedule, "cosine");
    tc->warmup = o->warmup;
    tc->weight_decay = (float)o->weight_decay;
    tc->beta1 = (float)o->beta1;
    tc->beta2 = (float)o->beta2;
    tc->eps = (float)o->eps;
    tc->clip = (float)o->clip;
    tc->seed = (uint64_t)o->seed;
    tc->schedule = fy_opts_schedule(o);
    tc->adam_threads = (int)o->adam_threads;
    tc->val_every = o->val_every;
    tc->val_batches = o->val_batches;
    tc->log_every = o->log_every;
    tc->comm = comm;
    tc->disk_dir = o->disk_dir;
    /* test hook (tests/test_dp.c): a step whose norm is not finite */
    int64_t nan_step = 0;
    if (getenv("FERRY_TEST_NAN_STEP") && fy_parse_i64(getenv("FERRY_TEST_NAN_STEP"), &nan_step)) nan_step = 0;
    tc->test_nan_step = nan_step;
    tc->save = o->save; /* rank 0 writes it, the others serve their shards */
    tc->save_opts = (fy_save_opts){.dtype = !strcmp(o->save_dtype, "bf16") ? FY_BF16 : FY_F32,
                                   .shard_nbytes = o->save_shard_size, .from = init};
    tc->metrics = lead ? o->metrics : NULL;
    tc->trace = lead ? o->trace : NULL;
    tc->predict = o->predict;
    tc->quiet = quiet;
    tc->ckpt_dir = o->ckpt_dir;
    tc->ckpt_every = o->ckpt_every;
    tc->ckpt_keep = (int)o->ckpt_keep;
    tc->resume = o->resume;
    tc->ckpt_sync = o->ckpt_sync;
    tc->host_budget = o->host_mem;
}

/* This rank's memory model: in a job it holds its shard of the optimizer state (ZeRO). */
static fy_status rank_memory(const fy_model *m, const fy_plan *plan, int seq, int world,
                             const fy_dev_cfg *dev, fy_mem_model *mm) {
    fy_layout L;
    FY_TRY(fy_layout_new(m, plan, seq, true, world, g_rank, &L));
    fy_layout_memory(&L, fy_dev_cfg_pinned_cap(dev), mm);
    fy_layout_free(&L);
    return FY_OK;
}

/* A job's ranks run one training: what must be the same on every rank (--plan auto and
 * --batch-shares decide the collectives of planning; the rest the step's data and math)
 * is compared, and rank 0 names the first flag that differs. Budgets, profiles, plans
 * and --sim-slowdown may differ, and with them a job started as `A : B`. */
static fy_status agree_on_run(fy_comm *comm, const fy_opts *o) {
    const int world = fy_comm_size(comm), rank = fy_comm_rank(comm);
    if (world == 1) return FY_OK;
    const bool autoplan = o->plan && !strcmp(o->plan, "auto");
    const struct { const char *flag; int64_t v; bool number; } mine[] = {
        {"--plan auto", autoplan, false},
        {"--batch-shares", !strcmp(o->batch_shares, "equal") ? 0 : !strcmp(o->batch_shares, "auto") ? 1 : 2,
         false},
        {"--dtype", fy_opts_dtype(o, fy_opts_dev_kind(o)), false},
        {"--seq", o->seq, true},
        {"--batch (with --plan auto)", autoplan ? o->batch : 0, true},
        {"--grad-accum (with --plan auto)", autoplan ? o->grad_accum : 0, true},
        {"--steps", o->steps, true},
        {"--seed", o->seed, true},
        {"--val-every", o->val_every, true},
        {"--val-batches", o->val_batches, true},
        {"--checkpoint-every", o->ckpt_every, true},
        {"--checkpoint-dir", o->ckpt_dir != NULL, false},
    };
    enum { K = sizeof mine / sizeof mine[0] };
    int64_t *v = calloc((size_t)world * K, sizeof *v);
    fy_status st = fy_comm_agree(comm, v ? FY_OK : FY_ERR_NOMEM);
    for (int k = 0; st == FY_OK && k < K; k++) v[(size_t)rank * K + k] = mine[k].v;
    if (st == FY_OK) st = fy_comm_allgather_records(comm, v, K * sizeof *v);
    for (int r = 1; st == FY_OK && r < world; r++)
        for (int k = 0; k < K; k++) {
            if (v[(size_t)r * K + k] == v[k]) continue;
            char vals[64] = "";
            if (mine[k].number)
                snprintf(vals, sizeof vals, " (%lld against %lld)", (long long)v[(size_t)r * K + k],
                         (long long)v[k]);
            if (rank == 0)
                fy_log_error("rank %d's %s differs from rank 0's%s: a job's ranks run one "
                             "training (budgets, profiles, plans and --sim-slowdown may differ)",
                             r, mine[k].flag, vals);
            st = FY_ERR_USAGE;
            break;
        }
    free(v);
    return st;
}

/* The per-rank flags: this rank's --gpu-mem from a list of one per rank, and --profile's
 * count checked (each rank opens its own when it plans); rank 0 says what is wrong. */
static fy_status rank_values(fy_comm *comm, fy_opts *o) {
    const int world = fy_comm_size(comm), rank = fy_comm_rank(comm);
    const char *flag = NULL, *list = NULL;
    if (o->gpu_mem_list && fy_opts_list_count(o->gpu_mem_list) != world) {
        flag = "gpu-mem";
        list = o->gpu_mem_list;
    } else if (o->profile && fy_opts_list_count(o->profile) != 1 && fy_opts_list_count(o->profile) != world) {
        flag = "profile";
        list = o->profile;
    }
    if (flag && rank == 0)
        fy_log_error("--%s: '%s' gives %d values for %d rank%s (one per rank, or one for every "
                     "rank)", flag, list, fy_opts_list_count(list), world,
                     world == 1 ? " (a process alone)" : "s");
    if (flag) return FY_ERR_USAGE;
    if (!o->gpu_mem_list) return FY_OK;
    char item[64];
    FY_TRY(fy_opts_rank_item("gpu-mem", o->gpu_mem_list, world, rank, item, sizeof item));
    return fy_parse_size(item, &o->gpu_mem) ? FY_ERR_USAGE : FY_OK; /* the parser checked it */
}

int fy_train_main(const fy_opts *given) {
    fy_opts own = *given; /* with this rank's entries of the per-rank flags */
    const fy_opts *o = &own;
    if (o->quiet) fy_log_set_level(FY_LOG_WARN);
    /* a launcher's job (mpirun, srun): every line names the rank; rank 0 alone prints the
     * run and writes outputs; a rank that fails ends the job */
    fy_comm *comm = NULL;
    fy_status st = fy_comm_init(&comm);
    if (st != FY_OK) return exit_status(st);
    const int world = fy_comm_size(comm);
    g_rank = fy_comm_rank(comm);
    if (world > 1) fy_log_set_rank(g_rank);
    const bool lead = g_rank == 0, quiet = o->quiet || !lead;
    if (quiet) fy_log_set_level(FY_LOG_WARN);
    if (!lead && !o->dry_run && !freopen("/dev/null", "w", stdout)) { /* rank 0 reports */
        fy_log_error("cannot quiet this rank's output: %s", strerror(errno));
        fy_comm_abort(comm, 1);
    }
    if (!o->dry_run) catch_stop_signals(world);
    char placed[320]; /* a job's rank on its node's CPUs and memory, before any threads */
    fy_comm_place(comm, placed, sizeof placed);
    if (world > 1) fy_log_debug("placed on %s", placed);
    fy_weights *init = NULL;
    fy_model *m = NULL;
    fy_plan plan = {0};
    fy_train_cfg tc = {0};
    st = rank_values(comm, &own);
    if (st == FY_OK) st = agree_on_run(comm, o);
    if (st == FY_OK) st = check_tokens(o->batch, o->seq, "--batch");
    /* test hooks (tests/test_dp.c): a rank that fails at once, or stalls */
    int64_t fail = -1, stall = -1;
    if (getenv("FERRY_TEST_FAIL_RANK") && fy_parse_i64(getenv("FERRY_TEST_FAIL_RANK"), &fail)) fail = -1;
    if (getenv("FERRY_TEST_STALL_RANK") && fy_parse_i64(getenv("FERRY_TEST_STALL_RANK"), &stall)) stall = -1;
    if (world > 1 && fail == g_rank) {
        fy_log_error("injected failure");
        st = FY_ERR_IO;
    }
    if (world > 1 && stall == g_rank) sleep(120);
    /* no output lands on an input or on another output, and every output can be
     * written, before any work */
    if (st == FY_OK && lead) st = fy_opts_check_paths(o, FY_CMD_TRAIN);
    if (st == FY_OK && lead && o->metrics) st = fy_check_output(o->metrics, "--metrics", true);
    if (st == FY_OK && lead && o->trace) st = fy_check_output(o->trace, "--trace", false);
    if (st == FY_OK && lead && o->save_plan) st = fy_check_output(o->save_plan, "--save-plan", false);
    if (st == FY_OK) st = check_ckpt_flags(o);
    if (st == FY_OK && o->disk_dir && !o->dry_run) st = fy_disk_check_dir(o->disk_dir);
    if (st == FY_OK) st = fy_opts_dev_cfg(o, !o->dry_run, &tc.dev);
    if (st == FY_OK) st = resolve_model(o, fy_opts_given(o, "model"), &init, &m);
    fy_doc_mask docs = {FY_DOCS_NONE, 0};
    if (st == FY_OK) st = parse_doc_mask(o, m, &docs);
    /* one GPU per process: the local rank picks it */
    if (st == FY_OK && world > 1 && tc.dev.kind == FY_DEV_CUDA) tc.dev.ordinal = fy_comm_local_rank(comm);
    double *slowdown = NULL; /* --sim-slowdown, per rank */
    if (st == FY_OK && o->sim_slowdown) {
        if (tc.dev.kind != FY_DEV_CPU) {
            fy_log_error("--sim-slowdown: the cpu backend's (--device cpu)");
            st = FY_ERR_USAGE;
        } else if (!(slowdown = calloc((size_t)world, sizeof *slowdown))) {
            st = FY_ERR_NOMEM;
        } else if ((st = per_rank_list("sim-slowdown", o->sim_slowdown, world, 1, 1000, slowdown)) == FY_OK) {
            tc.dev.sim_slowdown = slowdown[g_rank];
        }
    }
    if (st == FY_OK) st = resolve_plan(o, m, tc.dev.kind, comm, slowdown, &plan);
    if (st == FY_OK && world == 1 && strcmp(o->batch_shares, "equal"))
        fy_log_warn("--batch-shares: one process takes every micro-batch (--grad-accum)");
    if (st == FY_OK) st = batch_shares(o, m, comm, slowdown, &plan);
    if (st == FY_OK) st = place_micro_batches(comm, &plan, &tc);
    if (st == FY_OK && o->save_plan && lead) { /* with its count of micro-batches */
        st = fy_plan_save(o->save_plan, &plan);
        if (st == FY_OK && world > 1 && ((o->plan && !strcmp(o->plan, "auto")) ||
                                         strcmp(o->batch_shares, "equal")))
            fy_log_warn("--save-plan: %s is rank 0's plan and share (%d micro-batches a step); "
                        "this job's ranks each have their own", o->save_plan, plan.grad_accum);
    }
    free(slowdown);
    fy_mem_model mm = {0};
    if (st == FY_OK) st = check_heads(m, tc.dev.kind, plan.dtype == FY_BF16 ? FY_BF16 : FY_F32);
    if (st == FY_OK) st = rank_memory(m, &plan, (int)o->seq, world, &tc.dev, &mm);
    if (st == FY_OK && ((lead && !o->quiet) || o->dry_run)) fy_train_print_plan(&plan, &mm, stdout);
    if (st == FY_OK && o->dry_run) print_memory_json(m, &mm, comm, placed, o->gpu_mem, &plan);
    if (st == FY_OK && !o->dry_run) st = check_budgets(o, &mm, &tc.dev);
    if (st == FY_OK && !o->dry_run) {
        fill_train_cfg(o, m, &plan, init, comm, lead, quiet, &tc);
        tc.docs = docs;
        st = fy_train(&tc);
    }
    fy_plan_free(&plan);
    fy_model_free(m);
    fy_weights_close(init);
    const int code = exit_status(st);
    if (world > 1 && code != 0 && st != FY_INTERRUPTED) fy_comm_abort(comm, code);
    fflush(stdout);
    fy_comm_free(comm);
    return code;
}

int fy_eval_main(const fy_opts *o) {
    if (o->quiet) fy_log_set_level(FY_LOG_WARN);
    if (!o->init || !o->data) {
        fy_log_error("eval needs --init PATH and --data PATH");
        return 2;
    }
    fy_weights *init = NULL;
    fy_model *m = NULL;
    fy_eval_cfg ec = {.data = o->data, .batch = (int)o->batch, .seq = (int)o->seq,
                      .batches = o->batches};
    fy_eval_result r;
    fy_status st = check_tokens(o->batch, o->seq, "--batch");
    if (st == FY_OK) st = fy_opts_dev_cfg(o, true, &ec.dev);
    if (st == FY_OK) st = resolve_model(o, false, &init, &m);
    if (st == FY_OK) st = parse_doc_mask(o, m, &ec.docs);
    if (st == FY_OK) {
        ec.model = m;
        ec.weights = init;
        ec.dtype = fy_opts_dtype(o, ec.dev.kind);
        st = check_heads(m, ec.dev.kind, ec.dtype == FY_BF16 ? FY_BF16 : FY_F32);
        if (st == FY_OK) st = fy_eval(&ec, &r);
    }
    if (st == FY_OK && r.targets == 0)
        fy_log_warn("no target of the %lld batches evaluated counts in the loss (the data's masks): "
                    "no loss to report", (long long)r.batches);
    else if (st == FY_OK && !isfinite(r.loss))
        fy_log_warn("the loss is not finite: these weights give NaN or infinite logits");
    if (st == FY_OK) {
        char loss[32] = "null"; /* JSON has no NaN or Infinity */
        if (isfinite(r.loss)) snprintf(loss, sizeof loss, "%.9g", r.loss);
        printf("{\"loss\":%s,\"batches\":%lld,\"tokens\":%lld,\"loss_tokens\":%lld}\n", loss,
               (long long)r.batches, (long long)r.tokens, (long long)r.targets);
    }
    fy_model_free(m);
    fy_weights_close(init);
    return exit_status(st);
}
