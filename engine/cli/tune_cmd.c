/* tune_cmd.c — the commands around the tuner: probe a machine into a profile (cached per
 * machine), search the plan space under budgets, and pick a plan for `train --plan auto`. */
#include "engine/cli/tune_cmd.h"

#include "engine/io/json_file.h"
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/statvfs.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/cli/job_cmd.h"
#include "engine/core/util.h"
#include "offload/disk.h"
#include "tuner/probe.h"
#include "tuner/tune.h"

fy_status fy_opts_model(const fy_opts *o, fy_model **out) {
    fy_model_shape over = {.vocab = (int)o->vocab, .max_seq = (int)o->max_seq,
                           .channels = (int)o->channels, .layers = (int)o->layers,
                           .heads = (int)o->heads, .kv_heads = (int)o->kv_heads,
                           .ffn = (int)o->ffn};
    FY_TRY(fy_model_named(o->model, &over, out));
    fy_model_set_chunk(*out, (int)o->chunk_tokens);
    fy_status st = fy_model_check_seq(*out, o->seq);
    if (st != FY_OK) {
        fy_model_free(*out);
        *out = NULL;
    }
    return st;
}

/* The cache of the machine's device `slot`: 0 (the cpu backend, or GPU 0) is
 * profile-<host>.json, GPU k profile-<host>-gpu<k>.json (unlike GPUs of one node each
 * keep their own). */
static fy_status slot_cache_path(int slot, char *buf, size_t cap) {
    const char *base = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    char dir[3072];
    if (base && *base) snprintf(dir, sizeof dir, "%s/ferry", base);
    else if (home && *home) snprintf(dir, sizeof dir, "%s/.cache/ferry", home);
    else snprintf(dir, sizeof dir, "/tmp/ferry-cache");
    char host[256] = "host";
    gethostname(host, sizeof host - 1);
    char gpu[32] = "";
    if (slot > 0) snprintf(gpu, sizeof gpu, "-gpu%d", slot);
    if ((size_t)snprintf(buf, cap, "%s/profile-%s%s.json", dir, host, gpu) < cap) return FY_OK;
    fy_log_error("the profile cache's path is too long (XDG_CACHE_HOME or HOME)");
    return FY_ERR_INVALID;
}

fy_status fy_tune_cache_path(char *buf, size_t cap) { return slot_cache_path(0, buf, cap); }

/* The cache's path for device `slot`, its directories created. */
static fy_status cache_path(int slot, char *buf, size_t cap) {
    FY_TRY(slot_cache_path(slot, buf, cap));
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", buf);
    *strrchr(dir, '/') = 0;
    char parent[4096];
    snprintf(parent, sizeof parent, "%s", dir);
    char *slash = strrchr(parent, '/');
    if (slash && slash != parent) { *slash = 0; mkdir(parent, 0755); }
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
        fy_log_error("cannot create the profile cache %s", dir);
        return FY_ERR_IO;
    }
    return FY_OK;
}

/* A probe of this machine; in a job (comm of several processes) every rank probes at
 * once, and the collectives between them are measured too. The disk (--disk-dir, checked
 * by the caller) is rank 0's alone: its profile is the one written. */
static fy_status probe(const fy_opts *o, const fy_model *m, fy_comm *comm, fy_profile *p) {
    const bool lead = !comm || fy_comm_rank(comm) == 0;
    fy_probe_cfg pc = {.model = m, .batch = (int)o->batch, .seq = (int)o->seq,
                       .adam_threads_max = (int)o->adam_threads, .quiet = o->quiet || !lead,
                       .comm = comm, .disk_dir = lead ? o->disk_dir : NULL,
                       .disk_nbytes = o->disk_probe_size};
    FY_TRY(fy_opts_dev_cfg(o, true, &pc.dev));
    /* one GPU per process, as training takes them: the local rank's */
    if (comm && fy_comm_size(comm) > 1 && pc.dev.kind == FY_DEV_CUDA)
        pc.dev.ordinal = fy_comm_local_rank(comm);
    pc.dtype = fy_opts_dtype(o, pc.dev.kind);
    if (!pc.quiet)
        fy_log_info("probing this machine (transfers, %sCPU AdamW, the model's blocks%s%s)...",
                    comm && fy_comm_size(comm) > 1 ? "the collectives between the ranks, " : "",
                    pc.disk_dir ? ", the disk under " : "", pc.disk_dir ? pc.disk_dir : "");
    return fy_probe(&pc, p);
}

static void print_profile(const fy_profile *p) {
    printf("profile %s%s: %s\n", p->name, p->estimate ? " (estimate)" : "", p->device);
    printf("        h2d %.2f GB/s, d2h %.2f GB/s, both at once %.2f GB/s each, latency %.3f ms\n",
           p->h2d_gbps, p->d2h_gbps, p->duplex_h2d_gbps, p->latency_ms);
    for (int i = 0; i < p->nsizes; i++)
        printf("        %7.2f MiB: h2d %.2f GB/s, d2h %.2f GB/s\n", p->size_mib[i], p->h2d_by_size[i],
               p->d2h_by_size[i]);
    printf("        device %.1f GiB, host %.1f GiB, %d cores, %d NUMA node(s)\n", p->device_mem_gib,
           p->host_mem_gib, p->cores, p->numa_nodes);
    printf("        CPU AdamW");
    for (int t = 1; t <= p->adam_threads_max; t++) printf(" %d:%.2f", t, p->adam_gparams[t]);
    printf(" G params/s by threads\n");
    if (p->coll_gbps > 0)
        printf("        collectives: device memory %.2f GB/s bus bandwidth, latency %.3f ms; host "
               "memory over MPI %.2f GB/s, %.3f ms (%s)\n", p->coll_gbps, p->coll_latency_ms,
               p->coll_host_gbps, p->coll_host_latency_ms, p->coll_source);
    if (p->disk_read_gbps > 0) {
        char qd[32] = "queue depth not stated";
        if (p->disk_qdepth > 0) snprintf(qd, sizeof qd, "queue depth %d", p->disk_qdepth);
        printf("        disk: read %.2f GB/s, write %.2f GB/s, sequential at %s (%s)\n",
               p->disk_read_gbps, p->disk_write_gbps, qd, p->disk_source);
    } else {
        printf("        disk: not probed (--disk-dir DIR measures the disk tier's drive)\n");
    }
    if (p->has_blocks) {
        int L = FY_BLOCK_LAYER;
        printf("        layer fwd %.2f + %.2f*B ms, bwd %.2f + %.2f*B ms, head %.2f + %.2f*B ms "
               "(T=%d; %s)\n", p->block_a[FY_T_FWD][L], p->block_b[FY_T_FWD][L],
               p->block_a[FY_T_BWD][L], p->block_b[FY_T_BWD][L],
               p->block_a[FY_T_HEAD][FY_BLOCK_HEAD], p->block_b[FY_T_HEAD][FY_BLOCK_HEAD],
               p->block_seq, p->block_model);
    }
}

/* Under a launcher every rank probes (the collectives need them all) and rank 0 writes. */
int fy_probe_main(const fy_opts *o) {
    if (o->quiet) fy_log_set_level(FY_LOG_WARN);
    fy_comm *comm = NULL;
    if (fy_comm_init(&comm) != FY_OK) return 1;
    const bool lead = fy_comm_rank(comm) == 0;
    if (fy_comm_size(comm) > 1) fy_log_set_rank(fy_comm_rank(comm));
    char placed[320]; /* on the CPUs and memory a training rank would have */
    fy_comm_place(comm, placed, sizeof placed);
    fy_model *m = NULL;
    char path[4096];
    fy_profile p;
    int rc = 1;
    fy_status st = lead ? fy_opts_check_paths(o, FY_CMD_PROBE) : FY_OK;
    if (st == FY_OK && lead && o->disk_dir) st = fy_disk_check_dir(o->disk_dir);
    if (st == FY_OK) st = fy_opts_model(o, &m);
    if (st == FY_OK && o->out) snprintf(path, sizeof path, "%s", o->out);
    else if (st == FY_OK && lead) st = cache_path(0, path, sizeof path);
    if (st == FY_OK && lead) st = fy_check_output(path, "--out", false);
    if (st == FY_ERR_USAGE) rc = 2;
    if (fy_comm_agree(comm, st) != FY_OK) goto done; /* the failing rank said why */
    if (probe(o, m, comm, &p) != FY_OK) goto done;
    if (lead && fy_profile_save(path, &p) != FY_OK) goto done;
    if (lead) {
        print_profile(&p);
        printf("saved   %s\n", path);
    }
    rc = 0;
done:
    fy_model_free(m);
    if (rc) fy_comm_abort(comm, rc); /* the other ranks may wait in a collective */
    fy_comm_free(comm);
    return rc;
}

/* The profile without probing: --profile (file or name), else device slot's cache if it
 * measured this model and sequence length (and, for a job of `ranks`, the collectives of
 * that many); *found false: none. */
static fy_status known_profile(const fy_opts *o, const fy_model *m, int ranks, int slot,
                               fy_profile *p, bool *found) {
    *found = true;
    if (o->profile) return fy_profile_open(o->profile, p);
    char path[4096], sig[FY_MODEL_SIGNATURE_MAX];
    FY_TRY(cache_path(slot, path, sizeof path));
    fy_model_signature(m, sig, sizeof sig);
    /* a cache that does not load is probed again, with a note, not an error */
    bool loaded = false;
    if (access(path, R_OK) == 0) {
        const fy_log_level lvl = fy_log_get_level();
        fy_log_set_level(FY_LOG_QUIET);
        loaded = fy_profile_load(path, p) == FY_OK;
        fy_log_set_level(lvl);
        if (!loaded && !o->quiet) fy_log_info("the cached profile is not used: %s", fy_last_error());
    }
    *found = loaded && p->has_blocks &&
             !strcmp(p->block_model, sig) && p->block_seq == o->seq &&
             p->block_dtype == fy_opts_dtype(o, fy_opts_dev_kind(o)) &&
             (ranks <= 1 || (p->coll_gbps > 0 && p->coll_ranks == ranks));
    if (*found && !o->quiet) fy_log_info("using the cached profile %s", path);
    return FY_OK;
}

/* This process's device slot of the machine's cache: its GPU (the local rank's in a
 * job), 0 on the cpu backend. */
static int device_slot(const fy_opts *o, fy_comm *comm) {
    const bool gpus = comm && fy_comm_size(comm) > 1 && fy_opts_dev_kind(o) == FY_DEV_CUDA;
    return gpus ? fy_comm_local_rank(comm) : 0;
}

/* A probe now (every rank of a job), cached: each GPU's by its rank, the cpu backend's
 * (every rank of a node alike) by the node's first. */
static fy_status probe_and_cache(const fy_opts *o, const fy_model *m, fy_comm *comm, fy_profile *p) {
    fy_opts whole = *o; /* the device's memory, not this run's budget of it */
    whole.gpu_mem = 0;
    FY_TRY(probe(&whole, m, comm, p));
    const int slot = device_slot(o, comm);
    if (comm && slot == 0 && fy_comm_local_rank(comm) != 0) return FY_OK;
    char path[4096];
    FY_TRY(cache_path(slot, path, sizeof path));
    fy_status st = fy_profile_save(path, p);
    if (st == FY_OK && !o->quiet) fy_log_info("profile cached in %s", path);
    return st;
}

fy_status fy_tune_auto_profile(const fy_opts *o, const fy_model *m, fy_profile *p) {
    bool found;
    FY_TRY(known_profile(o, m, (int)o->ranks, 0, p, &found));
    if (!found && o->ranks > 1) { /* a probe of this process alone measures no collectives */
        fy_log_error("--ranks %lld needs a profile with the collectives of %lld ranks: probe under "
                     "the launcher (mpirun -np %lld ferry probe ...) or give --profile (a file or "
                     "a name: %s)", (long long)o->ranks, (long long)o->ranks, (long long)o->ranks,
                     fy_profile_names());
        return FY_ERR_USAGE;
    }
    return found ? FY_OK : probe_and_cache(o, m, NULL, p);
}

/* The disk tier's budget for a search: tune's --disk-mem (0: no disk tier); a run's
 * (train --plan auto) the free space under --disk-dir, or --disk-mem if less (no
 * --disk-dir: none). */
static size_t disk_budget(const fy_opts *o) {
    if (!o->disk_dir) return o->disk_mem;
    struct statvfs fs;
    const size_t avail = statvfs(o->disk_dir, &fs) == 0 ? (size_t)fs.f_bavail * (size_t)fs.f_frsize : 0;
    return o->disk_mem && o->disk_mem < avail ? o->disk_mem : avail;
}

fy_tune_cfg fy_tune_cfg_of(const fy_opts *o, const fy_model *m, const fy_profile *p) {
    size_t budget = o->gpu_mem ? o->gpu_mem : (size_t)(p->device_mem_gib * 1073741824.0);
    return (fy_tune_cfg){.model = m, .batch = (int)(o->batch * o->grad_accum), .seq = (int)o->seq,
                         .device_budget = budget, .host_budget = o->host_mem, .disk_budget = disk_budget(o),
                         .dtype = fy_opts_dtype(o, fy_opts_dev_kind(o)),
                         .adam_threads = o->adam_threads > 0 ? (int)o->adam_threads
                                                             : (o->threads > 0 ? (int)o->threads : p->cores),
                         .window = 20, .schedule = fy_opts_schedule(o), .tie_margin = FY_TUNE_TIE_MARGIN};
}

static void print_top(const fy_tune_cfg *tc, const fy_tune_result *top, int n) {
    printf("%-4s %-6s %-7s %-7s %-5s %-8s %-3s %11s %10s %11s %11s %s\n", "rank", "ckpt", "stream",
           "cpu-opt", "spec", "micro", "pf", "ms/step", "tok/s", "device", "host", "busiest lane");
    for (int i = 0; i < n; i++) {
        const fy_tune_result *r = &top[i];
        char d[32], h[32];
        int bl = 0;
        for (int l = 1; l < FY_LANE_COUNT; l++) if (r->busy_ms[l] > r->busy_ms[bl]) bl = l;
        printf("%-4d %-6d %-7d %-7d %-5d %dx%-6d %-3d %11.1f %10.0f %11s %11s %s %.1f ms", i + 1,
               r->k1, r->k2, r->k3, r->k4, r->plan.micro_batch, r->plan.grad_accum, r->plan.prefetch,
               r->step_ms,
               (double)tc->batch * tc->seq / (r->step_ms / 1e3),
               fy_fmt_size(r->mem.device_total, d, sizeof d), fy_fmt_size(r->mem.host_total, h, sizeof h),
               fy_lane_name((fy_lane)bl), r->busy_ms[bl]);
        if (r->k5 || r->k6) /* the tiers past host memory, said where a plan uses them */
            printf(" | state on disk: last %d layers (%s) | inputs on host: first %d layers", r->k5,
                   fy_fmt_size(r->mem.disk_total, h, sizeof h), r->k6);
        putchar('\n');
    }
}

/* The plan file with the prediction alongside (the plan loader ignores extra keys). */
static fy_status save_tuned(const char *path, const fy_tune_result *r) {
    FY_TRY(fy_plan_save(path, &r->plan));
    cJSON *root;
    FY_TRY(fy_json_read(path, "plan", &root));
    cJSON *pr = cJSON_AddObjectToObject(root, "predicted");
    cJSON_AddNumberToObject(pr, "step_ms", r->step_ms);
    cJSON_AddNumberToObject(pr, "device_bytes", (double)r->mem.device_total);
    cJSON_AddNumberToObject(pr, "host_bytes", (double)r->mem.host_total);
    cJSON *busy = cJSON_AddObjectToObject(pr, "lane_busy_ms");
    for (int l = 0; l < FY_LANE_COUNT; l++) cJSON_AddNumberToObject(busy, fy_lane_name((fy_lane)l), r->busy_ms[l]);
    fy_status st = fy_json_write(path, "plan", root);
    cJSON_Delete(root);
    return st;
}

/* The search's progress: on a terminal, one line rewritten in place; the candidate count
 * for the summary. */
typedef struct progress {
    bool tty, shown;
    int total;
} progress;

static void on_progress(void *ctx, int done, int total, double best_ms) {
    progress *pg = ctx;
    pg->total = total;
    if (!pg->tty) return;
    if (done < 0) {
        if (pg->shown) fputs("\r\033[K", stderr);
        return;
    }
    fprintf(stderr, "\rferry: tune: %d of %d candidate plans simulated, fastest %.1f ms/step", done,
            total, best_ms);
    pg->shown = true;
}

/* The search; for a run on this machine (train --plan auto: `here`), speculation takes no
 * more host memory than the profile says the machine has (--host-mem, when given, binds
 * everything). */
static fy_status search(const fy_opts *o, const fy_model *m, const fy_profile *p, int ranks,
                        bool here, fy_tune_result *top, int ntop, int *nfound) {
    fy_tune_cfg tc = fy_tune_cfg_of(o, m, p);
    tc.ranks = ranks;
    if (here) tc.spec_host_cap = (size_t)(p->host_mem_gib * 1073741824.0);
    FY_TRY(fy_tune_check_disk(&tc, p));
    progress pg = {.tty = !o->quiet && isatty(STDERR_FILENO)};
    tc.progress = on_progress;
    tc.progress_ctx = &pg;
    int nevaluated;
    const double t0 = fy_now_ms();
    FY_TRY(fy_tune(p, &tc, top, ntop, nfound, &nevaluated));
    if (!o->quiet) {
        printf("tune    %d plans on the memory frontier fit the budgets (batch %lld x seq %lld), %d "
               "simulated, the rest bounded out, in %.1f s; rank 1 is the pick: the least offload "
               "within %.0f%% of the fastest prediction\n", pg.total, (long long)tc.batch,
               (long long)o->seq, nevaluated, (fy_now_ms() - t0) / 1e3, 100.0 * tc.tie_margin);
        print_top(&tc, top, *nfound);
    }
    return FY_OK;
}

/* ---- capacity: what fits a machine ------------------------------------------------- */

static void capacity_head(void) {
    printf("%-26s %8s %4s %5s %6s %7s %-7s %9s %8s %11s %11s %5s %5s %11s\n", "model", "params", "fits",
           "ckpt", "stream", "cpu-opt", "micro", "ms/step", "tok/s", "device", "host", "disk", "acts",
           "on disk");
}

/* One row: the model's best plan under the budgets (r), or none. */
static void capacity_row(const char *label, const fy_model *m, const fy_tune_cfg *tc,
                         const fy_tune_result *r) {
    char d[32], h[32], params[32];
    snprintf(params, sizeof params, "%.2fB", (double)fy_model_num_params(m) / 1e9);
    if (!r) {
        printf("%-26s %8s %4s\n", label, params, "no");
        return;
    }
    char k[32];
    printf("%-26s %8s %4s %5d %6d %7d %3dx%-3d %9.1f %8.0f %11s %11s %5d %5d %11s\n", label, params, "yes",
           r->k1, r->k2, r->k3, r->plan.micro_batch, r->plan.grad_accum, r->step_ms,
           (double)tc->batch * tc->seq / (r->step_ms / 1e3),
           fy_fmt_size(r->mem.device_total, d, sizeof d), fy_fmt_size(r->mem.host_total, h, sizeof h),
           r->k5, r->k6, fy_fmt_size(r->mem.disk_total, k, sizeof k));
}

/* Tunes m under tc when a plan fits (r filled; the caller frees r->plan); false if none
 * does or the search failed. */
static bool capacity_tune(const fy_profile *p, fy_tune_cfg tc, const fy_model *m,
                          fy_tune_result *r) {
    tc.model = m;
    if (!fy_tune_fits(&tc)) return false;
    int n = 0, ne;
    return fy_tune(p, &tc, r, 1, &n, &ne) == FY_OK && n == 1;
}

/* Whether named model `name` with L layers (positions and chunks as o says) has a plan
 * that fits tc's budgets. */
static bool layers_fit(const fy_tune_cfg *tc, const fy_opts *o, const char *name, int L) {
    fy_model_shape over = {.layers = L, .max_seq = (int)o->max_seq};
    fy_model *m;
    if (fy_model_named(name, &over, &m) != FY_OK) return false;
    fy_model_set_chunk(m, (int)o->chunk_tokens);
    fy_tune_cfg c = *tc;
    c.model = m;
    const bool fits = fy_tune_fits(&c);
    fy_model_free(m);
    return fits;
}

/* The largest layer count of named model `name`'s shape that fits (0: not even one; at
 * most 4096), by doubling and bisection: every plan's memory grows with the layers. */
static int max_layers(const fy_tune_cfg *tc, const fy_opts *o, const char *name) {
    int lo = 0, hi = 1;
    while (layers_fit(tc, o, name, hi)) {
        lo = hi;
        if (hi == 4096) return hi;
        hi *= 2;
    }
    while (hi - lo > 1) {
        const int mid = lo + (hi - lo) / 2;
        if (layers_fit(tc, o, name, mid)) lo = mid;
        else hi = mid;
    }
    return lo;
}

/* The best so far of a table: a label, its parameters and predicted step time. */
typedef struct best { char label[96]; size_t params; double ms; } best;

/* One table: every named model (pass 0), or every width of a real size with as many
 * layers as fit (pass 1: fy_model_width_names); rows printed, the largest that fits in *b. */
static void capacity_table(const fy_profile *p, const fy_tune_cfg *tc, const fy_opts *o, int pass,
                           best *b) {
    char buf[1024], *save = NULL;
    snprintf(buf, sizeof buf, "%s", pass == 0 ? fy_model_names() : fy_model_width_names());
    const fy_log_level lvl = fy_log_get_level();
    capacity_head();
    for (char *name = strtok_r(buf, ", ", &save); name; name = strtok_r(NULL, ", ", &save)) {
        fy_model *m;
        fy_log_set_level(FY_LOG_QUIET); /* a shape that cannot run is a row, not an error */
        const fy_model_shape pos = {.max_seq = (int)o->max_seq};
        fy_status st = fy_model_named(name, &pos, &m);
        if (st == FY_OK && (st = fy_model_check_seq(m, tc->seq)) != FY_OK) fy_model_free(m);
        fy_log_set_level(lvl);
        if (st != FY_OK) {
            if (pass == 0) printf("%-26s (its positions are fewer than --seq %d)\n", name, tc->seq);
            continue;
        }
        char label[96];
        snprintf(label, sizeof label, "%s", name);
        if (pass == 1) {
            fy_model_free(m);
            const int L = max_layers(tc, o, name);
            fy_model_shape over = {.layers = L ? L : 1, .max_seq = (int)o->max_seq};
            if (fy_model_named(name, &over, &m) != FY_OK) continue;
            snprintf(label, sizeof label, L ? "%s, %d layers" : "%s width", name, L);
        }
        fy_model_set_chunk(m, (int)o->chunk_tokens);
        fy_tune_result r;
        const bool fits = capacity_tune(p, *tc, m, &r);
        capacity_row(label, m, tc, fits ? &r : NULL);
        if (fits && fy_model_num_params(m) > b->params) {
            snprintf(b->label, sizeof b->label, "%s", label);
            b->params = fy_model_num_params(m);
            b->ms = r.step_ms;
        }
        if (fits) fy_plan_free(&r.plan);
        fy_model_free(m);
    }
}

/* Whether m trains sequences of T tokens (its positions allow them and a plan fits). */
static bool seq_fits(const fy_tune_cfg *tc, fy_model *m, int T) {
    const fy_log_level lvl = fy_log_get_level();
    fy_log_set_level(FY_LOG_QUIET);
    const bool ok = fy_model_check_seq(m, T) == FY_OK;
    fy_log_set_level(lvl);
    fy_tune_cfg c = *tc;
    c.model = m;
    c.seq = T;
    return ok && fy_tune_fits(&c);
}

/* The longest sequence named model m trains at under tc's budgets and batch, to
 * SEQ_STEP tokens (1 below it), by doubling and bisection (memory grows with T); 0: none. */
#define SEQ_STEP 1024
static int longest_seq(const fy_tune_cfg *tc, fy_model *m) {
    int lo = 0, hi = 1;
    while (hi <= (1 << 20) && seq_fits(tc, m, hi)) {
        lo = hi;
        hi *= 2;
    }
    while (hi - lo > (lo >= SEQ_STEP ? SEQ_STEP : 1)) {
        const int mid = lo + (hi - lo) / 2;
        if (seq_fits(tc, m, mid)) lo = mid;
        else hi = mid;
    }
    return lo >= SEQ_STEP ? lo / SEQ_STEP * SEQ_STEP : lo;
}

/* The longest sequence each named model trains at, with its best plan there (--max-seq
 * sets the models' positions, --chunk-tokens their chunks). */
static void capacity_seq(const fy_opts *o, const fy_profile *p, const fy_tune_cfg *tc) {
    char buf[1024], *save = NULL;
    snprintf(buf, sizeof buf, "%s", fy_model_names());
    printf("longest sequence: each named model at batch %d, to %d tokens (its positions bound "
           "it too)\n", tc->batch, SEQ_STEP);
    printf("%-26s %8s %9s %5s %6s %7s %9s %8s %11s %11s\n", "model", "params", "max seq", "ckpt",
           "stream", "cpu-opt", "ms/step", "tok/s", "device", "host");
    const fy_model_shape over = {.max_seq = (int)o->max_seq};
    for (char *name = strtok_r(buf, ", ", &save); name; name = strtok_r(NULL, ", ", &save)) {
        fy_model *m;
        if (fy_model_named(name, &over, &m) != FY_OK) continue;
        fy_model_set_chunk(m, (int)o->chunk_tokens);
        char params[32];
        snprintf(params, sizeof params, "%.2fB", (double)fy_model_num_params(m) / 1e9);
        const int T = longest_seq(tc, m);
        fy_tune_cfg c = *tc;
        c.seq = T;
        fy_tune_result r;
        if (T == 0 || !capacity_tune(p, c, m, &r)) {
            printf("%-26s %8s %9s\n", name, params, T ? "?" : "none");
            fy_model_free(m);
            continue;
        }
        char d[32], h[32];
        printf("%-26s %8s %9d %5d %6d %7d %9.1f %8.0f %11s %11s\n", name, params, T, r.k1, r.k2,
               r.k3, r.step_ms, (double)tc->batch * T / (r.step_ms / 1e3),
               fy_fmt_size(r.mem.device_total, d, sizeof d), fy_fmt_size(r.mem.host_total, h, sizeof h));
        fy_plan_free(&r.plan);
        fy_model_free(m);
    }
}

/* ferry tune --capacity: what fits the profile's device and --host-mem (or the profile's
 * host memory) at --batch x --seq: every named model with its best plan, then each Llama
 * width with as many layers as fit; the largest of each; then the longest sequence each
 * named model trains at, at --batch. */
static int capacity(const fy_opts *o) {
    if (!o->profile) {
        fy_log_error("tune --capacity needs --profile FILE|NAME (the machine to fill)");
        return 2;
    }
    fy_profile p;
    if (fy_profile_open(o->profile, &p) != FY_OK) return 1;
    fy_tune_cfg tc = fy_tune_cfg_of(o, NULL, &p);
    if (!tc.host_budget) tc.host_budget = (size_t)(p.host_mem_gib * 1073741824.0);
    if (fy_tune_check_disk(&tc, &p) != FY_OK) return 2;
    char d[32], h[32], k[32];
    printf("capacity %s: device %s, host %s, disk %s, batch %d x seq %d, %s storage\n", p.name,
           fy_fmt_size(tc.device_budget, d, sizeof d), fy_fmt_size(tc.host_budget, h, sizeof h),
           tc.disk_budget ? fy_fmt_size(tc.disk_budget, k, sizeof k) : "none (--disk-mem)",
           tc.batch, tc.seq, fy_dtype_name(tc.dtype == FY_BF16 ? FY_BF16 : FY_F32));
    best named = {0}, shape = {0};
    capacity_table(&p, &tc, o, 0, &named);
    printf("free shapes: a named model's width (each Llama-like family's) with as many layers as fit\n");
    capacity_table(&p, &tc, o, 1, &shape);
    if (named.params)
        printf("largest named model: %s (%.2fB parameters, %.1f ms/step)\n", named.label,
               (double)named.params / 1e9, named.ms);
    else
        printf("largest named model: none fits\n");
    if (shape.params)
        printf("largest free shape: %s (%.2fB parameters, %.1f ms/step)\n", shape.label,
               (double)shape.params / 1e9, shape.ms);
    capacity_seq(o, &p, &tc);
    return 0;
}

int fy_tune_main(const fy_opts *o) {
    if (o->quiet) fy_log_set_level(FY_LOG_WARN);
    fy_status st = fy_opts_check_paths(o, FY_CMD_TUNE);
    if (st != FY_OK) return st == FY_ERR_USAGE ? 2 : 1;
    if (o->capacity && fy_tune_is_job(o)) {
        fy_log_error("tune --capacity fills one machine: give one --profile and one --gpu-mem");
        return 2;
    }
    if (o->capacity) return capacity(o);
    if (fy_tune_is_job(o)) {
        fy_model *jm;
        if (fy_opts_model(o, &jm) != FY_OK) return 1;
        const int rc = fy_tune_job_main(o, jm);
        fy_model_free(jm);
        return rc;
    }
    /* the default output is never replaced unasked: --out may name any file, this one too */
    if (!o->out && access("plan.json", F_OK) == 0) {
        fy_log_error("./plan.json exists and tune does not replace a file it was not given: name "
                     "the plan's file with --out (plan.json itself to replace it)");
        return 2;
    }
    if (o->out && fy_check_output(o->out, "--out", false) != FY_OK) return 1;
    fy_model *m;
    if (fy_opts_model(o, &m) != FY_OK) return 1;
    fy_profile p;
    fy_tune_result top[5];
    int n = 0, rc = 1;
    if (fy_tune_auto_profile(o, m, &p) == FY_OK && search(o, m, &p, (int)o->ranks, false, top, 5, &n) == FY_OK) {
        const char *out = o->out ? o->out : "plan.json";
        rc = save_tuned(out, &top[0]) == FY_OK ? 0 : 1;
        if (!rc) printf("saved   %s (predicted %.1f ms/step)\n", out, top[0].step_ms);
        if (!rc && o->trace) {
            fy_tune_cfg tc = fy_tune_cfg_of(o, m, &p);
            tc.ranks = (int)o->ranks;
            rc = fy_tune_trace(&p, &tc, &top[0].plan, o->trace) == FY_OK ? 0 : 1;
            if (!rc) printf("trace   %s (the pick's simulated steps)\n", o->trace);
        }
    }
    for (int i = 0; i < n; i++) fy_plan_free(&top[i].plan);
    fy_model_free(m);
    return rc;
}

fy_status fy_tune_check_disk(const fy_tune_cfg *tc, const fy_profile *p) {
    if (!tc->disk_budget || (p->disk_read_gbps > 0 && p->disk_write_gbps > 0)) return FY_OK;
    fy_log_error("a disk budget needs the disk's rates, and profile %s has none: probe with "
                 "ferry probe --disk-dir DIR, or plan for a named profile (%s)", p->name,
                 fy_profile_names());
    return FY_ERR_USAGE;
}

fy_status fy_tune_auto_plan(const fy_opts *o, const fy_model *m, fy_plan *out) {
    fy_profile p;
    bool found = false;
    FY_TRY(known_profile(o, m, 1, 0, &p, &found));
    if (!found) FY_TRY(probe_and_cache(o, m, NULL, &p));
    if (o->disk_dir && !(p.disk_read_gbps > 0 && p.disk_write_gbps > 0)) {
        /* the run's own disk, measured where its scratch file will be */
        FY_TRY(fy_disk_bench(o->disk_dir, (size_t)256 << 20, FY_DISK_QDEPTH, &p.disk_write_gbps,
                             &p.disk_read_gbps));
        p.disk_qdepth = FY_DISK_QDEPTH;
        fy_log_info("disk    %s: read %.2f GB/s, write %.2f GB/s (256 MiB, for --plan auto)",
                    o->disk_dir, p.disk_read_gbps, p.disk_write_gbps);
    }
    fy_tune_result top[5];
    int n = 0;
    fy_status st = search(o, m, &p, 1, true, top, 5, &n);
    if (st == FY_OK) st = fy_plan_copy(&top[0].plan, out);
    for (int i = 0; i < n; i++) fy_plan_free(&top[i].plan);
    return st;
}

fy_status fy_tune_rank_profile(const fy_opts *o, const fy_model *m, fy_comm *comm, fy_profile *p) {
    const int world = fy_comm_size(comm), rank = fy_comm_rank(comm);
    bool found = true;
    fy_status st = FY_OK;
    if (o->profile) { /* its count is checked (train_cmd.c) */
        char item[4096];
        /* one profile for every rank: rank 0 says what is wrong with it */
        const bool shared = fy_opts_list_count(o->profile) == 1, quiet = shared && rank != 0;
        const fy_log_level lvl = fy_log_get_level();
        if (quiet) fy_log_set_level(FY_LOG_QUIET);
        st = fy_opts_rank_item("profile", o->profile, world, rank, item, sizeof item);
        if (st == FY_OK) st = fy_profile_open(item, p);
        fy_log_set_level(lvl);
    } else {
        st = known_profile(o, m, world, device_slot(o, comm), p, &found);
    }
    FY_TRY(fy_comm_agree(comm, st));
    int32_t need = !found; /* any rank's: the probe measures the collectives of them all */
    FY_TRY(fy_comm_max_i32(comm, &need));
    if (need) FY_TRY(fy_comm_agree(comm, probe_and_cache(o, m, comm, p)));
    /* a profile probed alone knows no collectives: the first rank with one says so */
    int32_t lacking = p->coll_gbps > 0 ? 0 : world - rank;
    FY_TRY(fy_comm_max_i32(comm, &lacking));
    if (!lacking) return FY_OK;
    if (world - rank == lacking)
        fy_log_error("profile %s has no figure for the collectives between a job's ranks: probe "
                     "under the launcher (mpirun -np %d ferry probe), or use a named profile",
                     p->name, world);
    return FY_ERR_INVALID;
}
