/* checkpoint.c — writing, finding, verifying and restoring checkpoints (checkpoint.h). */
#include "engine/checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <libgen.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "engine/core/crc32c.h"
#include "engine/core/util.h"
#include "engine/core/version.h"
#include "engine/io/json_file.h"

#define FORMAT_NAME "ferry-checkpoint"
#define STEP_PREFIX "step-"
#define LATEST_NAME "latest"
#define LOCK_NAME ".lock"
#define PATH_CAP 4200

/* The files of a checkpoint besides the state, in the order written. */
static const char *const data_files[] = {
    "model.safetensors", "optimizer.exp_avg.safetensors", "optimizer.exp_avg_sq.safetensors",
};
#define NDATA (int)(sizeof data_files / sizeof data_files[0])

static bool known_file(const char *name) {
    for (int i = 0; i < NDATA; i++)
        if (!strcmp(name, data_files[i])) return true;
    return false;
}

/* dir/name into buf (cap bytes); false if it does not fit. */
static bool join(char *buf, size_t cap, const char *dir, const char *name) {
    return (size_t)snprintf(buf, cap, "%s/%s", dir, name) < cap;
}

/* The size and CRC-32C of a regular file, read through a mapping. */
static fy_status file_crc(const char *path, uint64_t *nbytes, uint32_t *crc) {
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    struct stat sb;
    if (fd < 0 || fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        if (fd >= 0) close(fd);
        return FY_ERR_IO;
    }
    *nbytes = (uint64_t)sb.st_size;
    *crc = 0;
    if (sb.st_size > 0) {
        void *p = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) {
            close(fd);
            return FY_ERR_IO;
        }
        madvise(p, (size_t)sb.st_size, MADV_SEQUENTIAL);
        *crc = fy_crc32c(p, (size_t)sb.st_size, 0);
        munmap(p, (size_t)sb.st_size);
    }
    close(fd);
    return FY_OK;
}

/* ---- the state file ---------------------------------------------------------------------- */

void fy_ckpt_state_free(fy_ckpt_state *s) {
    cJSON_Delete(s->config);
    s->config = NULL;
}

/* The state's own checksum: of its compact text without the "state_crc32c" field (cJSON
 * prints a parsed number as it printed the number parsed, so a reader recomputes it). */
static bool state_crc(const cJSON *root, uint32_t *crc) {
    cJSON *copy = cJSON_Duplicate(root, true);
    if (!copy) return false;
    cJSON_DeleteItemFromObjectCaseSensitive(copy, "state_crc32c");
    char *text = cJSON_PrintUnformatted(copy);
    cJSON_Delete(copy);
    if (!text) return false;
    *crc = fy_crc32c(text, strlen(text), 0);
    free(text);
    return true;
}

/* Exactly 8 hex digits. */
static bool parse_hex8(const char *s, uint32_t *out) {
    uint32_t v = 0;
    for (int i = 0; i < 8; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
              : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) return false;
        v = v << 4 | (uint32_t)d;
    }
    if (s[8]) return false;
    *out = v;
    return true;
}

/* An integer field in [lo, hi]. */
static bool get_int(const cJSON *o, const char *key, int64_t lo, int64_t hi, int64_t *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsNumber(v) || !(v->valuedouble >= (double)lo && v->valuedouble <= (double)hi) ||
        v->valuedouble != floor(v->valuedouble))
        return false;
    *out = (int64_t)v->valuedouble;
    return true;
}

/* A loss: a number, or null for none or non-finite. */
static bool get_loss(const cJSON *o, const char *key, double *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (cJSON_IsNull(v)) {
        *out = NAN;
        return true;
    }
    if (!cJSON_IsNumber(v)) return false;
    *out = v->valuedouble;
    return true;
}

fy_status fy_ckpt_state_parse(const char *text, size_t n, fy_ckpt_state *out, char *why,
                              size_t cap) {
    memset(out, 0, sizeof *out);
    cJSON *root = cJSON_ParseWithLength(text, n);
    const char *bad = NULL;
    int64_t version = 0, x;
    const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(root, "format");
    const cJSON *ferry = cJSON_GetObjectItemCaseSensitive(root, "ferry");
    const cJSON *files = cJSON_GetObjectItemCaseSensitive(root, "files");
    const cJSON *config = cJSON_GetObjectItemCaseSensitive(root, "config");
    char dup[160], dup_why[200];
    if (!root || !cJSON_IsObject(root)) bad = "not a JSON object";
    else if (fy_json_duplicate(root, dup, sizeof dup)) {
        snprintf(dup_why, sizeof dup_why, "key \"%s\" appears twice", dup);
        bad = dup_why;
    } else if (!cJSON_IsString(fmt) || strcmp(fmt->valuestring, FORMAT_NAME))
        bad = "\"format\" is not \"" FORMAT_NAME "\"";
    else if (!get_int(root, "version", 1, 1 << 20, &version)) bad = "no valid \"version\"";
    else if (version != FY_CKPT_VERSION) bad = "a format version this ferry does not read";
    else if (!cJSON_IsString(ferry) || strlen(ferry->valuestring) >= sizeof out->ferry)
        bad = "no valid \"ferry\" version";
    else if (!get_int(root, "step", 0, (int64_t)1 << 50, &out->info.step)) bad = "no valid \"step\"";
    else if (!get_int(root, "updates", 0, out->info.step, &out->info.updates))
        bad = "no valid \"updates\" (at most \"step\")";
    else if (!get_int(root, "skipped_run", 0, out->info.step, &out->info.skipped_run))
        bad = "no valid \"skipped_run\"";
    else if (!get_loss(root, "loss", &out->info.loss) || !get_loss(root, "val_loss", &out->info.val_loss))
        bad = "no valid \"loss\" or \"val_loss\"";
    else if (!cJSON_IsObject(config)) bad = "no \"config\" object";
    else if (!cJSON_IsArray(files)) bad = "no \"files\" list";
    if (!bad) snprintf(out->ferry, sizeof out->ferry, "%s", ferry->valuestring);
    const cJSON *f, *list = bad ? NULL : files;
    cJSON_ArrayForEach(f, list) {
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(f, "name");
        const cJSON *crc = cJSON_GetObjectItemCaseSensitive(f, "crc32c");
        uint32_t c = 0;
        bool crc_ok = cJSON_IsString(crc) && parse_hex8(crc->valuestring, &c);
        if (out->nfiles == FY_CKPT_MAX_FILES) bad = "too many \"files\"";
        else if (!cJSON_IsString(name) || !known_file(name->valuestring))
            bad = "a file that is not a checkpoint's";
        else if (!get_int(f, "bytes", 0, (int64_t)1 << 52, &x)) bad = "a file without valid \"bytes\"";
        else if (!crc_ok) bad = "a file without a valid \"crc32c\" (8 hex digits)";
        if (bad) break;
        for (int i = 0; i < out->nfiles; i++)
            if (!strcmp(out->files[i].name, name->valuestring)) bad = "a file listed twice";
        if (bad) break;
        snprintf(out->files[out->nfiles].name, sizeof out->files[0].name, "%s", name->valuestring);
        out->files[out->nfiles].nbytes = (uint64_t)x;
        out->files[out->nfiles].crc = c;
        out->nfiles++;
    }
    for (int i = 0; i < NDATA && !bad; i++) {
        bool listed = false;
        for (int k = 0; k < out->nfiles; k++) listed |= !strcmp(out->files[k].name, data_files[i]);
        if (!listed) bad = "a checkpoint file missing from \"files\"";
    }
    const cJSON *own = cJSON_GetObjectItemCaseSensitive(root, "state_crc32c");
    const cJSON *metrics = cJSON_GetObjectItemCaseSensitive(root, "metrics");
    uint32_t want = 0, got = 0;
    if (!bad && (!cJSON_IsString(own) || !parse_hex8(own->valuestring, &want)))
        bad = "no valid \"state_crc32c\" (8 hex digits)";
    else if (!bad && !state_crc(root, &got)) bad = "out of host memory";
    else if (!bad && got != want) bad = "its own checksum does not match (the file was changed)";
    out->info.metrics_bytes = -1;
    if (!bad && metrics) {
        const cJSON *mp = cJSON_GetObjectItemCaseSensitive(metrics, "path");
        if (!cJSON_IsString(mp) || strlen(mp->valuestring) >= sizeof out->info.metrics ||
            !get_int(metrics, "bytes", 0, (int64_t)1 << 52, &out->info.metrics_bytes))
            bad = "a \"metrics\" object without a valid path and bytes";
        else
            snprintf(out->info.metrics, sizeof out->info.metrics, "%s", mp->valuestring);
    }
    if (!bad && !(out->config = cJSON_Duplicate(config, true))) bad = "out of host memory";
    cJSON_Delete(root);
    if (bad) {
        snprintf(why, cap, "%s", bad);
        fy_ckpt_state_free(out);
        return FY_ERR_FORMAT;
    }
    return FY_OK;
}

/* The state file of checkpoint info into dir, with the files' sizes and checksums. */
static fy_status write_state(const char *dir, const cJSON *plan_json, const fy_ckpt_info *info,
                             const cJSON *config, const uint64_t nbytes[NDATA],
                             const uint32_t crcs[NDATA]) {
    char path[PATH_CAP], stamp[32];
    time_t now = time(NULL);
    struct tm tm;
    strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%SZ", gmtime_r(&now, &tm));
    cJSON *root = cJSON_CreateObject(), *files = cJSON_CreateArray();
    cJSON *cfg = cJSON_Duplicate(config, true);
    cJSON *plan = cJSON_Duplicate(plan_json, true);
    fy_status st = root && files && cfg && plan ? FY_OK : FY_ERR_NOMEM;
    if (st == FY_OK) {
        cJSON_AddStringToObject(root, "format", FORMAT_NAME);
        cJSON_AddNumberToObject(root, "version", FY_CKPT_VERSION);
        cJSON_AddStringToObject(root, "ferry", FY_VERSION);
        cJSON_AddStringToObject(root, "written", stamp);
        cJSON_AddNumberToObject(root, "step", (double)info->step);
        cJSON_AddNumberToObject(root, "updates", (double)info->updates);
        cJSON_AddNumberToObject(root, "skipped_run", (double)info->skipped_run);
        if (isfinite(info->loss)) cJSON_AddNumberToObject(root, "loss", info->loss);
        else cJSON_AddNullToObject(root, "loss");
        if (isfinite(info->val_loss)) cJSON_AddNumberToObject(root, "val_loss", info->val_loss);
        else cJSON_AddNullToObject(root, "val_loss");
        if (info->metrics[0]) {
            cJSON *mo = cJSON_AddObjectToObject(root, "metrics");
            if (mo) cJSON_AddStringToObject(mo, "path", info->metrics);
            if (mo) cJSON_AddNumberToObject(mo, "bytes", (double)info->metrics_bytes);
        }
        cJSON_AddItemToObject(root, "config", cfg);
        cJSON_AddItemToObject(root, "plan", plan);
        cJSON_AddItemToObject(root, "files", files);
        cfg = plan = files = NULL;
    }
    cJSON *in_root = root ? cJSON_GetObjectItemCaseSensitive(root, "files") : NULL;
    for (int i = 0; i < NDATA && st == FY_OK; i++) {
        char hex[16];
        snprintf(hex, sizeof hex, "%08" PRIx32, crcs[i]);
        cJSON *f = cJSON_CreateObject();
        if (!f || !cJSON_AddStringToObject(f, "name", data_files[i]) ||
            !cJSON_AddNumberToObject(f, "bytes", (double)nbytes[i]) ||
            !cJSON_AddStringToObject(f, "crc32c", hex)) {
            cJSON_Delete(f);
            st = FY_ERR_NOMEM;
            break;
        }
        cJSON_AddItemToArray(in_root, f);
    }
    uint32_t own;
    if (st == FY_OK) {
        char hex[16];
        if (!state_crc(root, &own)) st = FY_ERR_NOMEM;
        else if (snprintf(hex, sizeof hex, "%08" PRIx32, own) < 0 ||
                 !cJSON_AddStringToObject(root, "state_crc32c", hex))
            st = FY_ERR_NOMEM;
    }
    if (st == FY_ERR_NOMEM) fy_log_error("out of host memory writing the checkpoint state");
    if (st == FY_OK) {
        if (!join(path, sizeof path, dir, FY_CKPT_STATE_NAME)) st = FY_ERR_IO;
        else st = fy_json_write(path, "checkpoint state", root);
    }
    cJSON_Delete(root);
    cJSON_Delete(cfg);
    cJSON_Delete(plan);
    cJSON_Delete(files);
    return st;
}

/* ---- the directory ------------------------------------------------------------------------ */

struct fy_ckpt_dir {
    char *path;
    int lock_fd;
    pthread_t writer;         /* a save in the background, while job is set */
    struct save_job *job;
};

const char *fy_ckpt_dir_path(const fy_ckpt_dir *d) { return d->path; }

/* Whether name is a step directory's, as ferry names them ("step-" and the step in at
 * least 8 digits, no other leading zeros): its step into *step. */
static bool step_name(const char *name, int64_t *step) {
    size_t np = strlen(STEP_PREFIX);
    if (strncmp(name, STEP_PREFIX, np) || !name[np] || strlen(name + np) > 15) return false;
    for (const char *c = name + np; *c; c++)
        if (*c < '0' || *c > '9') return false;
    int64_t s = strtoll(name + np, NULL, 10);
    char canon[32];
    snprintf(canon, sizeof canon, STEP_PREFIX "%08" PRId64, s);
    if (strcmp(canon, name)) return false;
    *step = s;
    return true;
}

/* Removes a checkpoint directory ferry wrote (its files and their temporaries, then the
 * directory if that emptied it); anything else in it stays. Links are not followed. */
static void remove_ckpt(int parent_fd, const char *name) {
    int fd = openat(parent_fd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
    if (!d) {
        if (fd >= 0) close(fd);
        return;
    }
    for (struct dirent *e; (e = readdir(d));) {
        const char *n = e->d_name, *dot = strstr(n, ".tmp.");
        char base[64];
        if (dot && (size_t)(dot - n) < sizeof base) {
            snprintf(base, sizeof base, "%.*s", (int)(dot - n), n);
            n = base;
        }
        if (known_file(n) || !strcmp(n, FY_CKPT_STATE_NAME)) unlinkat(dirfd(d), e->d_name, 0);
    }
    closedir(d);
    unlinkat(parent_fd, name, AT_REMOVEDIR);
}

/* Whether name is <base><tag><digits> with base a step directory's name (or `latest`
 * when latest_too): base into base[64]. */
static bool temp_name(const char *name, const char *tag, bool latest_too, char base[64]) {
    const char *at = strstr(name, tag);
    int64_t step;
    if (!at || (size_t)(at - name) >= 64 || !at[strlen(tag)]) return false;
    for (const char *c = at + strlen(tag); *c; c++)
        if (*c < '0' || *c > '9') return false;
    snprintf(base, 64, "%.*s", (int)(at - name), name);
    return step_name(base, &step) || (latest_too && !strcmp(base, LATEST_NAME));
}

bool fy_ckpt_dir_owns(const char *name) {
    int64_t step;
    char base[64];
    if (step_name(name, &step) || temp_name(name, ".tmp.", true, base) ||
        temp_name(name, ".old.", false, base) || !strcmp(name, LATEST_NAME) || !strcmp(name, LOCK_NAME))
        return true;
    const size_t n = strlen(FY_CKPT_METRICS_START_NAME);
    return !strncmp(name, FY_CKPT_METRICS_START_NAME, n) && (!name[n] || !strncmp(name + n, ".tmp.", 5));
}

/* What killed writers left in dir (run under the lock, so no other writer is at work):
 * step-N.tmp.PID directories and latest.tmp.PID links are removed; a step-N.old.PID
 * (a step directory moved aside to be replaced, or to be removed) goes back to step-N
 * if the replacement never arrived, else is removed. */
static void remove_stale(const char *dir) {
    DIR *d = opendir(dir);
    for (struct dirent *e; d && (e = readdir(d));) {
        const char *n = e->d_name;
        char base[64];
        struct stat sb;
        if (temp_name(n, ".tmp.", true, base)) {
            if (!strcmp(base, LATEST_NAME)) unlinkat(dirfd(d), n, 0);
            else remove_ckpt(dirfd(d), n);
        } else if (temp_name(n, ".old.", false, base)) {
            if (fstatat(dirfd(d), base, &sb, AT_SYMLINK_NOFOLLOW) != 0 && errno == ENOENT)
                renameat(dirfd(d), n, dirfd(d), base);
            else
                remove_ckpt(dirfd(d), n);
        }
    }
    if (d) closedir(d);
}

/* Removes step directory `name` of dir: moved aside first (one rename), so a kill midway
 * never leaves a half-deleted step-N that looks like a checkpoint. */
static void remove_step(int dir_fd, const char *name) {
    char aside[128];
    snprintf(aside, sizeof aside, "%s.old.%ld", name, (long)getpid());
    if (renameat(dir_fd, name, dir_fd, aside) == 0) remove_ckpt(dir_fd, aside);
}

fy_status fy_ckpt_dir_check(const char *path) {
    struct stat sb;
    const int found = stat(path, &sb), why = errno;
    if (found == 0) {
        if (!S_ISDIR(sb.st_mode)) {
            fy_log_error("--checkpoint-dir %s: exists and is not a directory", path);
            return FY_ERR_IO;
        }
        if (access(path, W_OK | X_OK) != 0) {
            fy_log_error("--checkpoint-dir %s: not writable", path);
            return FY_ERR_IO;
        }
        return FY_OK;
    }
    /* a new directory: its parent must be a writable directory */
    char *copy = strdup(path);
    if (!copy) return FY_ERR_NOMEM;
    const char *dir = dirname(copy); /* trailing slashes and the top handled */
    fy_status st = FY_OK;
    if (why != ENOENT || stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode) ||
        access(dir, W_OK | X_OK) != 0) {
        fy_log_error("--checkpoint-dir %s: cannot be created (%s is not a writable directory)",
                     path, dir);
        st = FY_ERR_IO;
    }
    free(copy);
    return st;
}

fy_status fy_ckpt_dir_open(const char *path, fy_ckpt_dir **out) {
    *out = NULL;
    struct stat sb;
    if (mkdir(path, 0755) != 0 && errno != EEXIST) {
        fy_log_error("--checkpoint-dir %s: cannot create it: %s", path, strerror(errno));
        return FY_ERR_IO;
    }
    if (stat(path, &sb) != 0 || !S_ISDIR(sb.st_mode)) {
        fy_log_error("--checkpoint-dir %s: exists and is not a directory", path);
        return FY_ERR_IO;
    }
    if (access(path, W_OK | X_OK) != 0) {
        fy_log_error("--checkpoint-dir %s: not writable", path);
        return FY_ERR_IO;
    }
    char lock[PATH_CAP];
    if (!join(lock, sizeof lock, path, LOCK_NAME)) {
        fy_log_error("--checkpoint-dir %s: too long a path", path);
        return FY_ERR_IO;
    }
    int fd = open(lock, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0) {
        fy_log_error("--checkpoint-dir %s: cannot create %s: %s", path, lock, strerror(errno));
        return FY_ERR_IO;
    }
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        fy_log_error("--checkpoint-dir %s: another ferry run is writing checkpoints there", path);
        close(fd);
        return FY_ERR_IO;
    }
    fy_ckpt_dir *d = calloc(1, sizeof *d);
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/') n--; /* "ckpt/" names ckpt/step-N, not ckpt//step-N */
    if (!d || !(d->path = strndup(path, n))) {
        free(d);
        close(fd);
        fy_log_error("out of host memory");
        return FY_ERR_NOMEM;
    }
    d->lock_fd = fd;
    remove_stale(path);
    *out = d;
    return FY_OK;
}

void fy_ckpt_dir_close(fy_ckpt_dir *d) {
    if (!d) return;
    fy_ckpt_wait(d, NULL); /* a save in flight completes (or fails, logged) first */
    close(d->lock_fd); /* releases the lock */
    free(d->path);
    free(d);
}

/* ---- writing --------------------------------------------------------------------------------- */

/* Where a save reads the state from: the trainer itself (a synchronous save), or a
 * snapshot of it (a save in the background). */
struct fy_ckpt_snapshot {
    const fy_model *m;
    float *buf;               /* per block: master, m, v (nelem floats each), block after block */
    size_t nbytes;
    size_t *off;              /* per block: its master's offset in floats */
};

typedef struct state_src {
    fy_trainer *tr;           /* or */
    const fy_ckpt_snapshot *snap;
    int which;                /* 0 masters, 1 first moment, 2 second */
} state_src;

static fy_status block_of(void *ctx, int b, float *host) {
    const state_src *s = ctx;
    if (s->snap) {
        const fy_ckpt_snapshot *sn = s->snap;
        const size_t n = fy_model_block(sn->m, b)->nelem;
        memcpy(host, sn->buf + sn->off[b] + (size_t)s->which * n, n * sizeof(float));
    } else if (s->which == 0) {
        return fy_trainer_get_params(s->tr, b, host);
    } else {
        return fy_trainer_get_moments(s->tr, b, s->which == 1 ? host : NULL, s->which == 2 ? host : NULL);
    }
    return FY_OK;
}

/* The data files into dir from src (its `which` set per file), their sizes and CRCs (taken
 * as they are written, so nothing is read back) into nbytes[] and crc[]. The three files
 * fetch their blocks into the same two block buffers, touched once: fresh pages cost about
 * as much as the disk's writes on the machines measured (bench/RESULTS.md). */
static fy_status write_files(const char *dir, const fy_model *m, state_src src,
                             uint64_t nbytes[NDATA], uint32_t crc[NDATA]) {
    char path[PATH_CAP];
    const size_t buf_nbytes = fy_model_save_buf_nelem(m) * sizeof(float);
    float *buf = mmap(NULL, buf_nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (buf == MAP_FAILED) {
        fy_log_error("out of host memory writing a checkpoint");
        return FY_ERR_NOMEM;
    }
    fy_status st = FY_OK;
    for (int i = 0; i < NDATA && st == FY_OK; i++) {
        const fy_save_opts o = {.dtype = FY_F32, .crc32c = &crc[i], .block_buf = buf};
        if (!join(path, sizeof path, dir, data_files[i])) st = FY_ERR_IO;
        src.which = i;
        if (st == FY_OK) st = fy_model_save(m, path, &o, block_of, &src);
        struct stat sb;
        if (st == FY_OK && stat(path, &sb) != 0) {
            fy_log_error("cannot stat %s: %s", path, strerror(errno));
            st = FY_ERR_IO;
        }
        if (st == FY_OK) nbytes[i] = (uint64_t)sb.st_size;
    }
    munmap(buf, buf_nbytes);
    return st;
}

/* `latest` pointing to name, replaced by a rename so it is never missing or half made. */
static fy_status set_latest(const char *dir, const char *name) {
    char tmp[PATH_CAP], link[PATH_CAP];
    if (!join(link, sizeof link, dir, LATEST_NAME) ||
        (size_t)snprintf(tmp, sizeof tmp, "%s.tmp.%ld", link, (long)getpid()) >= sizeof tmp)
        return FY_ERR_IO;
    unlink(tmp);
    if (symlink(name, tmp) != 0 || rename(tmp, link) != 0) {
        fy_log_error("cannot point %s to %s: %s", link, name, strerror(errno));
        unlink(tmp);
        return FY_ERR_IO;
    }
    return fy_fsync_dir(dir);
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Removes the step directories at or below step but the newest `keep` (names are
 * canonical, so the step rebuilds the name). Those above step are from a run abandoned
 * past the one resumed: they stay until this run replaces them. */
static void rotate(const char *dir, int64_t step, int keep) {
    DIR *d = opendir(dir);
    int64_t *steps = NULL;
    size_t n = 0, cap = 0;
    for (struct dirent *e; d && (e = readdir(d));) {
        int64_t s;
        if (!step_name(e->d_name, &s) || s > step) continue;
        if (n == cap) {
            int64_t *t = realloc(steps, (cap = cap ? cap * 2 : 16) * sizeof *t);
            if (!t) break;
            steps = t;
        }
        steps[n++] = s;
    }
    if (steps) qsort(steps, n, sizeof *steps, cmp_i64);
    for (size_t i = 0; d && n > (size_t)keep && i < n - (size_t)keep; i++) {
        char name[64];
        snprintf(name, sizeof name, STEP_PREFIX "%08" PRId64, steps[i]);
        remove_step(dirfd(d), name);
    }
    free(steps);
    if (d) closedir(d);
}

/* The whole save (see the top) from src. */
static fy_status save_body(fy_ckpt_dir *d, const fy_model *m, state_src src, const cJSON *plan_json,
                           const fy_ckpt_info *info, const cJSON *config, int keep, char **path) {
    char name[64], tmp[PATH_CAP], final[PATH_CAP], old[PATH_CAP];
    snprintf(name, sizeof name, STEP_PREFIX "%08" PRId64, info->step);
    if (!join(final, sizeof final, d->path, name) ||
        (size_t)snprintf(tmp, sizeof tmp, "%s.tmp.%ld", final, (long)getpid()) >= sizeof tmp ||
        (size_t)snprintf(old, sizeof old, "%s.old.%ld", final, (long)getpid()) >= sizeof old) {
        fy_log_error("--checkpoint-dir %s: too long a path", d->path);
        return FY_ERR_IO;
    }
    remove_ckpt(AT_FDCWD, tmp);
    if (mkdir(tmp, 0755) != 0) {
        fy_log_error("cannot create %s: %s", tmp, strerror(errno));
        return FY_ERR_IO;
    }
    uint64_t nbytes[NDATA];
    uint32_t crc[NDATA];
    fy_status st = write_files(tmp, m, src, nbytes, crc);
    static int saves; /* the test hook: see checkpoint.h */
    const char *kill_at = getenv("FERRY_TEST_KILL_IN_SAVE");
    if (kill_at && atoi(kill_at) == ++saves) raise(SIGKILL);
    if (st == FY_OK) st = write_state(tmp, plan_json, info, config, nbytes, crc);
    if (st == FY_OK) st = fy_fsync_dir(tmp);
    struct stat sb;
    if (st == FY_OK && lstat(final, &sb) == 0) {
        /* from a run abandoned past this step (or a corrupt one): swapped atomically where
         * the filesystem can (tmp then holds the old one), else moved aside first (a kill
         * between the renames leaves step-N.old.PID, which the next run moves back) */
        if (renameat2(AT_FDCWD, tmp, AT_FDCWD, final, RENAME_EXCHANGE) == 0) {
            remove_ckpt(AT_FDCWD, tmp);
        } else if (rename(final, old) != 0) {
            fy_log_error("cannot move the old %s aside: %s", final, strerror(errno));
            st = FY_ERR_IO;
        } else if (rename(tmp, final) != 0) {
            fy_log_error("cannot rename %s to %s: %s", tmp, final, strerror(errno));
            rename(old, final);
            st = FY_ERR_IO;
        } else {
            remove_ckpt(AT_FDCWD, old);
        }
    } else if (st == FY_OK && rename(tmp, final) != 0) {
        fy_log_error("cannot rename %s to %s: %s", tmp, final, strerror(errno));
        st = FY_ERR_IO;
    }
    if (st != FY_OK) {
        remove_ckpt(AT_FDCWD, tmp);
        return st;
    }
    FY_TRY(fy_fsync_dir(d->path));
    FY_TRY(set_latest(d->path, name));
    rotate(d->path, info->step, keep);
    if (path && !(*path = strdup(final))) return FY_ERR_NOMEM;
    return FY_OK;
}

fy_status fy_ckpt_save(fy_ckpt_dir *d, fy_trainer *tr, const fy_ckpt_info *info,
                       const cJSON *config, int keep, char **path) {
    FY_TRY(fy_ckpt_wait(d, NULL));
    cJSON *plan = fy_plan_json(fy_trainer_plan(tr));
    if (!plan) {
        fy_log_error("out of host memory writing a checkpoint");
        return FY_ERR_NOMEM;
    }
    state_src src = {.tr = tr};
    fy_status st = save_body(d, fy_trainer_model(tr), src, plan, info, config, keep, path);
    cJSON_Delete(plan);
    return st;
}

/* ---- saving in the background ------------------------------------------------------- */

size_t fy_ckpt_snapshot_nbytes(const fy_model *m) {
    size_t n = 0;
    for (int b = 0; b < fy_model_nblocks(m); b++) n += 3 * fy_model_block(m, b)->nelem;
    return n * sizeof(float);
}

fy_status fy_ckpt_snapshot_new(const fy_model *m, fy_ckpt_snapshot **out) {
    *out = NULL;
    fy_ckpt_snapshot *sn = calloc(1, sizeof *sn);
    if (!sn) return FY_ERR_NOMEM;
    sn->m = m;
    sn->nbytes = fy_ckpt_snapshot_nbytes(m);
    sn->off = malloc((size_t)fy_model_nblocks(m) * sizeof *sn->off);
    void *p = mmap(NULL, sn->nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (!sn->off || p == MAP_FAILED) {
        if (p != MAP_FAILED) munmap(p, sn->nbytes);
        free(sn->off);
        free(sn);
        fy_log_error("out of host memory for a checkpoint snapshot");
        return FY_ERR_NOMEM;
    }
    sn->buf = p;
    memset(sn->buf, 0, sn->nbytes); /* touched once, here, not during the first save */
    size_t o = 0;
    for (int b = 0; b < fy_model_nblocks(m); b++) {
        sn->off[b] = o;
        o += 3 * fy_model_block(m, b)->nelem;
    }
    *out = sn;
    return FY_OK;
}

void fy_ckpt_snapshot_free(fy_ckpt_snapshot *sn) {
    if (!sn) return;
    munmap(sn->buf, sn->nbytes);
    free(sn->off);
    free(sn);
}

typedef struct save_job {
    fy_ckpt_dir *d;
    const fy_ckpt_snapshot *snap;
    cJSON *plan, *config;
    fy_ckpt_info info;
    int keep;
    char *path;               /* out */
    fy_status st;             /* out */
} save_job;

static void *save_thread(void *arg) {
    save_job *j = arg;
    state_src src = {.snap = j->snap};
    j->st = save_body(j->d, j->snap->m, src, j->plan, &j->info, j->config, j->keep, &j->path);
    return NULL;
}

fy_status fy_ckpt_save_async(fy_ckpt_dir *d, fy_trainer *tr, fy_ckpt_snapshot *snap,
                             const fy_ckpt_info *info, const cJSON *config, int keep) {
    FY_TRY(fy_ckpt_wait(d, NULL));
    const fy_model *m = fy_trainer_model(tr);
    for (int b = 0; b < fy_model_nblocks(m); b++) { /* the state as of now */
        const size_t n = fy_model_block(m, b)->nelem;
        float *base = snap->buf + snap->off[b];
        FY_TRY(fy_trainer_get_params(tr, b, base));
        FY_TRY(fy_trainer_get_moments(tr, b, base + n, base + 2 * n));
    }
    save_job *j = calloc(1, sizeof *j);
    if (!j || !(j->plan = fy_plan_json(fy_trainer_plan(tr))) ||
        !(j->config = cJSON_Duplicate(config, true))) {
        if (j) cJSON_Delete(j->plan);
        free(j);
        fy_log_error("out of host memory writing a checkpoint");
        return FY_ERR_NOMEM;
    }
    *j = (save_job){.d = d, .snap = snap, .plan = j->plan, .config = j->config, .info = *info,
                    .keep = keep};
    if (pthread_create(&d->writer, NULL, save_thread, j) != 0) {
        fy_log_error("cannot start the checkpoint writer thread");
        cJSON_Delete(j->plan);
        cJSON_Delete(j->config);
        free(j);
        return FY_ERR_NOMEM;
    }
    d->job = j;
    return FY_OK;
}

fy_status fy_ckpt_wait(fy_ckpt_dir *d, char **path) {
    if (path) *path = NULL;
    if (!d->job) return FY_OK;
    pthread_join(d->writer, NULL);
    save_job *j = d->job;
    d->job = NULL;
    fy_status st = j->st;
    if (path) *path = j->path;
    else free(j->path);
    cJSON_Delete(j->plan);
    cJSON_Delete(j->config);
    free(j);
    return st;
}

bool fy_ckpt_pending(const fy_ckpt_dir *d) { return d->job != NULL; }

/* ---- finding ------------------------------------------------------------------------------------ */

/* The newest step directory of dir below `below` (malloc'd path), or NULL. */
static char *newest_below(const char *dir, int64_t below) {
    DIR *d = opendir(dir);
    int64_t best = -1;
    for (struct dirent *e; d && (e = readdir(d));) {
        int64_t s;
        if (step_name(e->d_name, &s) && s < below && s > best) best = s;
    }
    if (d) closedir(d);
    if (best < 0) return NULL;
    char path[PATH_CAP];
    if ((size_t)snprintf(path, sizeof path, "%s/" STEP_PREFIX "%08" PRId64, dir, best) >= sizeof path)
        return NULL;
    return strdup(path);
}

fy_status fy_ckpt_latest(const char *dir, char **out, bool *guessed) {
    *out = NULL;
    *guessed = false;
    char link[PATH_CAP], target[256], path[PATH_CAP];
    if (!join(link, sizeof link, dir, LATEST_NAME)) return FY_ERR_IO;
    ssize_t n = readlink(link, target, sizeof target - 1);
    struct stat sb;
    if (n < 0 && errno != ENOENT) {
        if (errno == EINVAL && lstat(link, &sb) == 0)
            fy_log_error("%s is not a symbolic link to a checkpoint", link);
        else
            fy_log_error("cannot read %s: %s", link, strerror(errno));
        return FY_ERR_FORMAT;
    }
    if (n >= 0) {
        target[n] = 0;
        int64_t step;
        if (!step_name(target, &step)) {
            fy_log_error("%s points to \"%s\", not to a step directory", link, target);
            return FY_ERR_FORMAT;
        }
        if (!join(path, sizeof path, dir, target)) return FY_ERR_IO;
        if (lstat(path, &sb) == 0) return (*out = strdup(path)) ? FY_OK : FY_ERR_NOMEM;
    }
    /* no `latest` yet, or one whose step is gone: a run killed between a checkpoint's
     * rename and the link's move (or an emptied directory); the newest step directory is
     * complete (renamed only once it was) */
    *out = newest_below(dir, INT64_MAX);
    *guessed = *out != NULL;
    return FY_OK;
}

char *fy_ckpt_before(const char *dir, int64_t step) { return newest_below(dir, step); }

/* ---- reading ------------------------------------------------------------------------------------ */

struct fy_ckpt {
    char *path;
    fy_ckpt_state state;
    fy_weights *weights;
};

const char *fy_ckpt_path(const fy_ckpt *c) { return c->path; }
const fy_ckpt_state *fy_ckpt_state_of(const fy_ckpt *c) { return &c->state; }
const fy_weights *fy_ckpt_weights(const fy_ckpt *c) { return c->weights; }

void fy_ckpt_close(fy_ckpt *c) {
    if (!c) return;
    fy_ckpt_state_free(&c->state);
    fy_weights_close(c->weights);
    free(c->path);
    free(c);
}

fy_status fy_ckpt_open(const char *path, fy_ckpt **out) {
    *out = NULL;
    struct stat sb;
    if (stat(path, &sb) != 0 || !S_ISDIR(sb.st_mode)) {
        fy_log_error("checkpoint %s: not a directory", path);
        return FY_ERR_IO;
    }
    fy_ckpt *c = calloc(1, sizeof *c);
    char file[PATH_CAP], why[128];
    char *text = NULL;
    size_t n = 0;
    fy_status st = c && (c->path = strdup(path)) ? FY_OK : FY_ERR_NOMEM;
    struct stat ssb;
    if (st == FY_OK && (!join(file, sizeof file, path, FY_CKPT_STATE_NAME) || lstat(file, &ssb) != 0)) {
        char *inner = newest_below(path, INT64_MAX), link[PATH_CAP];
        struct stat lsb;
        if (inner || (join(link, sizeof link, path, LATEST_NAME) && lstat(link, &lsb) == 0))
            fy_log_error("%s is a checkpoint directory, not a checkpoint: resume with "
                         "--checkpoint-dir %s --resume, or --resume %s/%s", path, path, path,
                         LATEST_NAME);
        else
            fy_log_error("checkpoint %s is incomplete: it has no %s", path, FY_CKPT_STATE_NAME);
        free(inner);
        st = FY_ERR_FORMAT;
    }
    if (st == FY_OK && fy_json_read_text(file, "checkpoint state", &text, &n) != FY_OK)
        st = FY_ERR_FORMAT; /* logged: unreadable, not a regular file, too large */
    if (st == FY_OK && fy_ckpt_state_parse(text, n, &c->state, why, sizeof why) != FY_OK) {
        fy_log_error("checkpoint %s: %s: %s", path, FY_CKPT_STATE_NAME, why);
        st = FY_ERR_FORMAT;
    }
    free(text);
    char *real = st == FY_OK ? realpath(path, NULL) : NULL;
    const char *base = real ? (strrchr(real, '/') ? strrchr(real, '/') + 1 : real) : NULL;
    int64_t named;
    if (base && step_name(base, &named) && named != c->state.info.step) {
        fy_log_error("checkpoint %s: its state is of step %" PRId64 ", its name of step %" PRId64,
                     path, c->state.info.step, named);
        st = FY_ERR_FORMAT;
    }
    free(real);
    for (int i = 0; st == FY_OK && i < c->state.nfiles; i++) {
        uint64_t nb;
        uint32_t crc;
        const char *name = c->state.files[i].name;
        if (!join(file, sizeof file, path, name) || file_crc(file, &nb, &crc) != FY_OK) {
            fy_log_error("checkpoint %s is incomplete: %s is missing or unreadable", path, name);
            st = FY_ERR_FORMAT;
        } else if (nb != c->state.files[i].nbytes) {
            fy_log_error("checkpoint %s is corrupt: %s has %" PRIu64 " bytes, its state says %" PRIu64,
                         path, name, nb, c->state.files[i].nbytes);
            st = FY_ERR_FORMAT;
        } else if (crc != c->state.files[i].crc) {
            fy_log_error("checkpoint %s is corrupt: %s has checksum %08" PRIx32 ", its state says "
                         "%08" PRIx32, path, name, crc, c->state.files[i].crc);
            st = FY_ERR_FORMAT;
        }
    }
    if (st == FY_OK && join(file, sizeof file, path, data_files[0]))
        st = fy_weights_open(file, &c->weights);
    if (st != FY_OK) {
        if (st == FY_ERR_NOMEM) fy_log_error("out of host memory reading checkpoint %s", path);
        fy_ckpt_close(c);
        return st;
    }
    *out = c;
    return FY_OK;
}

fy_status fy_ckpt_restore(const fy_ckpt *c, fy_trainer *tr, int grad_accum) {
    const fy_model *m = fy_trainer_model(tr);
    fy_weights *w[2] = {NULL, NULL};
    float *buf[2] = {NULL, NULL};
    char file[PATH_CAP];
    fy_status st = FY_OK;
    for (int i = 0; i < 2 && st == FY_OK; i++) {
        if (!join(file, sizeof file, c->path, data_files[1 + i])) st = FY_ERR_IO;
        if (st == FY_OK) st = fy_weights_open(file, &w[i]);
        if (st == FY_OK) st = fy_model_check_weights(m, w[i]);
        if (st == FY_OK && !(buf[i] = malloc(fy_model_max_block_nelem(m) * sizeof(float)))) {
            fy_log_error("out of host memory restoring checkpoint %s", c->path);
            st = FY_ERR_NOMEM;
        }
    }
    for (int b = 0; b < fy_model_nblocks(m) && st == FY_OK; b++) {
        st = fy_model_load_block(m, w[0], b, buf[0]);
        if (st == FY_OK) st = fy_model_load_block(m, w[1], b, buf[1]);
        if (st == FY_OK) st = fy_trainer_set_moments(tr, b, buf[0], buf[1]);
    }
    if (st == FY_OK)
        fy_trainer_set_progress(tr, c->state.info.updates, c->state.info.step * grad_accum);
    for (int i = 0; i < 2; i++) {
        fy_weights_close(w[i]);
        free(buf[i]);
    }
    return st;
}
