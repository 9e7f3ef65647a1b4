/* checkpoint.h — a training run's checkpoints: one directory per step under a checkpoint
 * directory, written so that a kill at any moment leaves every complete checkpoint intact.
 *
 *   DIR/step-00000040/model.safetensors              fp32 master weights, the family's
 *                                                    tensor names and file layout
 *                     optimizer.exp_avg.safetensors    AdamW's first moment, per tensor,
 *                     optimizer.exp_avg_sq.safetensors and the second, the same names
 *                     ferry_state.json                 step, counters, the run's
 *                                                    configuration, the plan, ferry's
 *                                                    version, the metrics file's size,
 *                                                    each file's size and CRC-32C (taken
 *                                                    while writing) and its own; last
 *   DIR/latest -> step-00000040                      the newest complete checkpoint
 *   DIR/.lock                                        held (flock) by the run writing DIR
 *
 * Everything is stored per tensor, never per placement: a checkpoint written under one
 * plan (or micro-batch split) is read under any other. With bf16 storage the device's
 * bf16 weights are the masters rounded, so they are not stored again. A checkpoint is
 * written into DIR/step-N.tmp.<pid>, each file fsynced, the directory fsynced and renamed
 * to step-N, DIR fsynced; only then does `latest` (a symbolic link, replaced by rename)
 * move to it, and older checkpoints beyond the number kept are removed. A killed writer's
 * temporaries are removed by the next run that opens DIR.
 *
 * Test hook: with FERRY_TEST_KILL_IN_SAVE=K in the environment, the process kills itself
 * (SIGKILL) in its K-th save, after the data files and before the state and the rename:
 * the moment a kill leaves the most behind.
 *
 * Reading verifies before anything is restored: the state's format and version, that
 * every file it lists is there with its size and checksum. Errors are one line naming
 * the checkpoint and what is wrong.
 *
 * Threads: used from the thread driving the trainer. */
#ifndef FY_CHECKPOINT_H
#define FY_CHECKPOINT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "engine/io/weights.h"
#include "engine/trainer.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FY_CKPT_VERSION 1
#define FY_CKPT_STATE_NAME "ferry_state.json"
#define FY_CKPT_MAX_FILES 8

/* The training loop's state at a step boundary. */
typedef struct fy_ckpt_info {
    int64_t step;          /* steps run: the next step's 0-based number */
    int64_t updates;       /* AdamW updates applied (skipped steps do not count) */
    int64_t skipped_run;   /* non-finite steps in a row just before it */
    double loss, val_loss; /* the last step's and validation's (NaN: none yet) */
    char metrics[1024];    /* the run's metrics file (absolute; "" none) and its size when */
    int64_t metrics_bytes; /* the checkpoint was written (-1: none), so a resumed run cuts
                              what the stopped one wrote after it */
} fy_ckpt_info;

/* A checkpoint's state file, parsed (fy_ckpt_state_parse). */
typedef struct fy_ckpt_state {
    fy_ckpt_info info;
    char ferry[64];        /* the version that wrote it */
    cJSON *config;         /* the run's configuration, as the writer gave it (owned) */
    int nfiles;
    struct { char name[64]; uint64_t nbytes; uint32_t crc; } files[FY_CKPT_MAX_FILES];
} fy_ckpt_state;

/* Parses a state file's text (n bytes). FY_ERR_FORMAT with why (cap bytes) set; no
 * logging (the caller names the file). On success free with fy_ckpt_state_free. */
fy_status fy_ckpt_state_parse(const char *text, size_t n, fy_ckpt_state *out, char *why,
                              size_t cap);
void fy_ckpt_state_free(fy_ckpt_state *s);

/* ---- writing ------------------------------------------------------------------------ */

typedef struct fy_ckpt_dir fy_ckpt_dir;

/* Where a run that starts in a checkpoint directory records the metrics file's size then
 * (engine/train.c), so that a resume from no checkpoint cuts back to it. */
#define FY_CKPT_METRICS_START_NAME ".metrics-start.json"

/* Whether name, directly under a checkpoint directory, is one ferry writes, replaces or
 * removes there: a step directory, `latest`, the lock, the metrics start, and their
 * temporaries. The directory's other names are left alone. */
bool fy_ckpt_dir_owns(const char *name);

/* Whether path can be a checkpoint directory (an existing writable directory, or a new
 * name in one), checked before any work. FY_ERR_IO (logged) otherwise. */
fy_status fy_ckpt_dir_check(const char *path);
/* Opens (creating it if new; its parent must exist) the checkpoint directory: takes its
 * lock, so two runs never write one directory, and removes what killed writers left.
 * FY_ERR_IO (logged) if it cannot be created or written, or another run holds it. */
fy_status fy_ckpt_dir_open(const char *path, fy_ckpt_dir **out);
void fy_ckpt_dir_close(fy_ckpt_dir *d); /* NULL is a no-op */
const char *fy_ckpt_dir_path(const fy_ckpt_dir *d);

/* Writes the trainer's state as checkpoint info->step, with config (the caller's JSON
 * object, stored as given), moves `latest` to it and keeps the newest `keep` below and
 * at it. A step directory already there (from a run abandoned past this step) is
 * replaced. The path written goes to *path (malloc'd) when path is not NULL. */
fy_status fy_ckpt_save(fy_ckpt_dir *d, fy_trainer *tr, const fy_ckpt_info *info,
                       const cJSON *config, int keep, char **path);

/* Saving in the background: the state is copied into a snapshot (host memory the size of
 * the fp32 masters and both moments, 12 bytes a parameter, allocated and touched once)
 * while the trainer is idle, then a thread writes the checkpoint from it, exactly as
 * fy_ckpt_save would, while training goes on. One save at a time per directory:
 * fy_ckpt_save and fy_ckpt_save_async first wait for the one in flight. fy_ckpt_wait
 * joins it: its status and (malloc'd, when path is not NULL) the path written. */
typedef struct fy_ckpt_snapshot fy_ckpt_snapshot;
size_t fy_ckpt_snapshot_nbytes(const fy_model *m);
fy_status fy_ckpt_snapshot_new(const fy_model *m, fy_ckpt_snapshot **out);
void fy_ckpt_snapshot_free(fy_ckpt_snapshot *sn); /* NULL is a no-op; not while in use */
fy_status fy_ckpt_save_async(fy_ckpt_dir *d, fy_trainer *tr, fy_ckpt_snapshot *snap,
                             const fy_ckpt_info *info, const cJSON *config, int keep);
fy_status fy_ckpt_wait(fy_ckpt_dir *d, char **path);
bool fy_ckpt_pending(const fy_ckpt_dir *d);

/* The checkpoint `latest` names (malloc'd path) or NULL if the directory has none yet.
 * Without a `latest` (or with one whose step directory is gone: a run killed between a
 * checkpoint's rename and the link's move), the newest step directory, with *guessed
 * set. FY_ERR_FORMAT (logged) if `latest` is not a link to a step directory. */
fy_status fy_ckpt_latest(const char *dir, char **out, bool *guessed);
/* The newest step directory of dir older than step (malloc'd), or NULL: what to suggest
 * when the latest one cannot be read. */
char *fy_ckpt_before(const char *dir, int64_t step);

/* ---- reading ------------------------------------------------------------------------ */

typedef struct fy_ckpt fy_ckpt;

/* Opens a checkpoint directory and verifies it (see the top). FY_ERR_FORMAT/FY_ERR_IO
 * (one logged line: incomplete, corrupt, or not a checkpoint, and which file). */
fy_status fy_ckpt_open(const char *path, fy_ckpt **out);
void fy_ckpt_close(fy_ckpt *c); /* NULL is a no-op */
const char *fy_ckpt_path(const fy_ckpt *c);
const fy_ckpt_state *fy_ckpt_state_of(const fy_ckpt *c);
/* The master weights: give them to the trainer as its starting weights. */
const fy_weights *fy_ckpt_weights(const fy_ckpt *c);
/* Restores the moments and the counters into a trainer built on the checkpoint's
 * weights (any plan), for micro-batches of grad_accum a step. */
fy_status fy_ckpt_restore(const fy_ckpt *c, fy_trainer *tr, int grad_accum);

#ifdef __cplusplus
}
#endif
#endif
