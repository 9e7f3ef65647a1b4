/* opts_paths.c — what each command's flags name on disk: one row per path flag saying
 * what its value expands to (the files read, the file or directory written and how),
 * registered with engine/io/paths.h and checked before the command writes anything.
 *
 * Besides the flags, a command may read and rewrite this machine's cached profile (tune,
 * sweep and train --plan auto without --profile; probe without --out writes it), and tune
 * and sweep write ./plan.json and ./sweep without --out: those are registered too.
 * A flag's value expands once, here; the commands then read and write what it named. */
#include "engine/cli/opts.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "engine/checkpoint.h"
#include "engine/cli/sweep_cmd.h"
#include "engine/cli/tune_cmd.h"
#include "engine/core/util.h"
#include "engine/io/paths.h"
#include "engine/io/tokens.h"
#include "engine/io/weights.h"

#define CACHE_LABEL "the profile cache"

typedef struct expand_ctx {
    fy_paths *p;
    const fy_opts *o;
    unsigned cmd;
    const char *label; /* "--init" */
    const char *value; /* the flag's value; NULL when not given */
} expand_ctx;

typedef fy_status (*expand_fn)(const expand_ctx *x);

static fy_status read_one(void *ctx, const char *path) {
    const expand_ctx *x = ctx;
    return fy_paths_read(x->p, x->label, path);
}

/* --init: the weights' files, config and tokenizer (weights.h). */
static fy_status init_files(const expand_ctx *x) {
    return x->value ? fy_weights_files(x->value, read_one, (void *)x) : FY_OK;
}

/* --data, --val-data: a file, or a glob's matches (and what it would match). */
static fy_status data_files(const expand_ctx *x) {
    if (!x->value) return FY_OK;
    return fy_tokens_is_glob(x->value) ? fy_paths_read_glob(x->p, x->label, x->value)
                                       : fy_paths_read(x->p, x->label, x->value);
}

/* --plan FILE (not auto). */
static fy_status plan_file(const expand_ctx *x) {
    return x->value && strcmp(x->value, "auto") ? fy_paths_read(x->p, x->label, x->value) : FY_OK;
}

/* Whether the command reads (and may probe into) this machine's cached profile. */
static bool uses_cache(const fy_opts *o, unsigned cmd) {
    if (o->profile) return false;
    if (cmd == FY_CMD_TRAIN) /* a job's shares by prediction need the profile too */
        return (o->plan && !strcmp(o->plan, "auto")) || !strcmp(o->batch_shares, "auto");
    if (cmd == FY_CMD_TUNE) return !o->capacity;
    return cmd == FY_CMD_SWEEP;
}

static fy_status cache(const expand_ctx *x, bool reads) {
    char path[4096];
    FY_TRY(fy_tune_cache_path(path, sizeof path));
    return fy_paths_write(x->p, CACHE_LABEL, path, FY_PATH_FILE, "", NULL, reads);
}

/* --profile: a file (a name that is no file is a named profile), or one per rank, or
 * the cache. */
static fy_status profile_files(const expand_ctx *x) {
    if (!x->value) return uses_cache(x->o, x->cmd) ? cache(x, true) : FY_OK;
    const int n = fy_opts_list_count(x->value);
    for (int i = 0; i < n; i++) {
        char item[4096];
        struct stat sb;
        if (fy_opts_rank_item(x->label + 2, x->value, n, i, item, sizeof item) != FY_OK)
            return FY_ERR_USAGE;
        if (stat(item, &sb) == 0) FY_TRY(fy_paths_read(x->p, x->label, item));
    }
    return FY_OK;
}

/* --resume PATH: the checkpoint's files (without a PATH: the newest in --checkpoint-dir,
 * whose names that flag covers). */
static fy_status resume_files(const expand_ctx *x) {
    if (!x->value || !*x->value) return FY_OK;
    DIR *d = opendir(x->value);
    fy_status st = FY_OK;
    for (struct dirent *e; d && st == FY_OK && (e = readdir(d));) {
        char path[4096];
        struct stat sb;
        if ((size_t)snprintf(path, sizeof path, "%s/%s", x->value, e->d_name) < sizeof path &&
            stat(path, &sb) == 0 && S_ISREG(sb.st_mode))
            st = fy_paths_read(x->p, x->label, path);
    }
    if (d) closedir(d);
    return st;
}

/* --save: a .safetensors file, else a model directory replaced whole. */
static fy_status save_target(const expand_ctx *x) {
    if (!x->value) return FY_OK;
    const bool file = fy_str_ends_with(x->value, ".safetensors");
    return fy_paths_write(x->p, x->label, x->value, file ? FY_PATH_FILE : FY_PATH_DIR,
                          "a directory the save replaces whole", NULL, false);
}

/* --save-plan, --trace: files written whole. */
static fy_status out_file(const expand_ctx *x) {
    return x->value ? fy_paths_write(x->p, x->label, x->value, FY_PATH_FILE, "", NULL, false) : FY_OK;
}

/* --metrics: appended to (and cut back to a checkpoint's size on a resume). */
static fy_status metrics_stream(const expand_ctx *x) {
    return x->value ? fy_paths_write(x->p, x->label, x->value, FY_PATH_STREAM, "", NULL, false) : FY_OK;
}

static fy_status ckpt_dir(const expand_ctx *x) {
    if (!x->value) return FY_OK;
    FY_TRY(fy_paths_allow(x->p, x->label, "--resume")); /* a checkpoint of it, read first */
    return fy_paths_write(x->p, x->label, x->value, FY_PATH_DIR_NAMES,
                          "whose checkpoints (step-N directories, latest) this run writes and "
                          "removes", fy_ckpt_dir_owns, false);
}

/* --disk-dir: a directory the command creates and removes its scratch files in, which
 * must hold nothing else: anything another flag writes there is refused. */
static fy_status disk_dir(const expand_ctx *x) {
    return x->value ? fy_paths_write(x->p, x->label, x->value, FY_PATH_DIR,
                                     "the disk tier's directory, which must stay empty", NULL, false)
                    : FY_OK;
}

/* --out: probe's profile (default the cache), tune's plan (default ./plan.json), sweep's
 * directory (default ./sweep). */
static fy_status out_of_command(const expand_ctx *x) {
    switch (x->cmd) {
    case FY_CMD_PROBE:
        return x->value ? out_file(x) : cache(x, false);
    case FY_CMD_TUNE:
        if (x->o->capacity) {
            if (!x->value) return FY_OK;
            fy_log_error("--out: tune --capacity prints a table and writes no plan");
            return FY_ERR_USAGE;
        }
        return fy_paths_write(x->p, x->label, x->value ? x->value : "plan.json", FY_PATH_FILE, "",
                              NULL, false);
    case FY_CMD_SWEEP:
        return fy_paths_write(x->p, x->label, x->value ? x->value : "sweep", FY_PATH_DIR_NAMES,
                              "whose sweep.csv, summary.txt and plots the sweep writes",
                              fy_sweep_owns, false);
    default:
        return FY_OK;
    }
}

/* Every flag that names a path, in the order they are registered (inputs first, so a
 * message names an input the user gave before a derived one). */
static const struct path_flag {
    const char *name, *label;
    expand_fn expand;
} path_flags[] = {
    {"init", "--init", init_files},
    {"data", "--data", data_files},
    {"val-data", "--val-data", data_files},
    {"plan", "--plan", plan_file},
    {"profile", "--profile", profile_files},
    {"resume", "--resume", resume_files},
    {"save", "--save", save_target},
    {"save-plan", "--save-plan", out_file},
    {"trace", "--trace", out_file},
    {"metrics", "--metrics", metrics_stream},
    {"checkpoint-dir", "--checkpoint-dir", ckpt_dir},
    {"disk-dir", "--disk-dir", disk_dir},
    {"out", "--out", out_of_command},
};
#define NPATH_FLAGS (int)(sizeof path_flags / sizeof path_flags[0])

bool fy_opts_is_path(const char *name) {
    for (int i = 0; i < NPATH_FLAGS; i++)
        if (!strcmp(path_flags[i].name, name)) return true;
    return false;
}

/* --save takes --init's place (a fine-tune in place): the same file or directory; the
 * directory holding --init's index or model.safetensors; or the one model.safetensors of
 * the directory --init names. */
static bool save_replaces_init(const char *save, const char *init) {
    if (fy_paths_same(save, init)) return true;
    char buf[8192];
    struct stat sb;
    if (!fy_str_ends_with(save, ".safetensors")) {
        const char *slash = strrchr(init, '/'), *base = slash ? slash + 1 : init;
        if (strcmp(base, FY_HF_INDEX_NAME) && strcmp(base, FY_HF_SINGLE_NAME)) return false;
        const int w = snprintf(buf, sizeof buf, "%.*s", slash ? (int)(slash - init) + (slash == init) : 1,
                               slash ? init : ".");
        return w >= 0 && (size_t)w < sizeof buf && fy_paths_same(save, buf);
    }
    if (stat(init, &sb) != 0 || !S_ISDIR(sb.st_mode)) return false;
    int w = snprintf(buf, sizeof buf, "%s/%s", init, FY_HF_INDEX_NAME);
    if (w < 0 || (size_t)w >= sizeof buf || stat(buf, &sb) == 0)
        return false; /* one shard of several is not the model */
    w = snprintf(buf, sizeof buf, "%s/%s", init, FY_HF_SINGLE_NAME);
    return w >= 0 && (size_t)w < sizeof buf && fy_paths_same(save, buf);
}

fy_status fy_opts_check_paths(const fy_opts *o, unsigned cmd) {
    fy_paths *p;
    FY_TRY(fy_paths_new(&p));
    fy_status st = FY_OK;
    for (int i = 0; i < NPATH_FLAGS && st == FY_OK; i++) {
        if (!fy_opts_takes(cmd, path_flags[i].name)) continue;
        const expand_ctx x = {.p = p, .o = o, .cmd = cmd, .label = path_flags[i].label,
                              .value = fy_opts_str(o, path_flags[i].name)};
        st = path_flags[i].expand(&x);
    }
    if (st == FY_OK && o->save && o->init && fy_opts_takes(cmd, "save") &&
        save_replaces_init(o->save, o->init))
        st = fy_paths_allow(p, "--save", "--init");
    if (st == FY_OK) st = fy_paths_check(p);
    fy_paths_free(p);
    return st;
}
