/* storage.h — the memory of a training run: what a layout (layout.h) lists, allocated,
 * and the memory model that predicts it.
 *
 * Design. The layout decides where each state lives; storage only allocates: every
 * buffer in one fixed walk of the layout, which a dry walk repeats to count, so the
 * memory model is the allocation list itself (fy_layout_memory equals the device's and
 * the host's measured peaks). Nothing is allocated during training steps. Asked for a
 * state, storage answers with its buffer (fy_storage_ptr) or element i of the block in
 * it (fy_storage_at, which knows a shard's buffer is indexed from its lo).
 *
 * Besides the blocks' states, a run holds what the step graph works in:
 *  - staging slots in two rings, each for parameters and gradients (layout.h), buffers
 *    only: the scheduler's pools grant them to tasks (engine/step_build.c);
 *  - activations: every block's output, a kept block's saved area, the one area the
 *    recomputed blocks share, one workspace and one activation gradient;
 *  - the step graph's working buffers (fy_window_bufs, the executor's: storage only
 *    allocates them): double-buffered tokens, a loss slot per micro-batch, a norm slot
 *    per block (and a sharded job's chunk sums), the host landing slot, a row-staged
 *    block's rows.
 * State on disk (layout.h: FY_TIER_DISK) is a region of one scratch file per process,
 * each rounded to 4 KiB so direct I/O of any chunk is aligned; its pointer is NULL and
 * fy_storage_disk_off says where it is. Its chunks pass through the disk ring's host
 * slots (the step graph's disk tasks) and, between windows, the first slot serves as the
 * bounce buffer of whole-state reads and writes (engine/trainer_state.c).
 * Host state comes from two arenas: what the device copies to or from (pinned tier:
 * weights and gradients of the storage type, a streamed device-updated block's master,
 * tokens) from a pinned one up to the device's pinned cap (--pinned-mem; the buffers past
 * it go pageable, with one warning), and what only the CPU touches (AdamW moments, a
 * cpu-updated block's fp32 master) from a pageable one. The pinned arena is pageable,
 * with one warning, if the system refuses to pin it. Big host arrays are staggered so
 * arrays updated together do not share DRAM banks.
 *
 * Threads: used from the thread driving the trainer. */
#ifndef FY_STORAGE_H
#define FY_STORAGE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "engine/device/device.h"
#include "engine/model/model.h"
#include "offload/layout.h"
#include "offload/plan.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fy_mem_model {
    size_t device[FY_CAT_COUNT];
    size_t host[FY_CAT_COUNT];
    size_t device_total, host_total;
    size_t host_pinned;       /* of host_total, in the pinned arena */
    size_t pinned_over;       /* buffers the device copies that the pinned cap left pageable */
    size_t disk[FY_CAT_COUNT]; /* the scratch file's regions (each rounded to 4 KiB) */
    size_t disk_total;        /* the scratch file's size */
} fy_mem_model;

typedef struct fy_ring {
    void **slots;
    int n;
    size_t nbytes;            /* each slot's */
} fy_ring;

/* A block's activations on the device (model.h: out and saved). */
typedef struct fy_block_acts {
    void *out;                /* NULL when it is offloaded: a slot of the act ring */
    void *saved;              /* own, or the area recomputed blocks share */
} fy_block_acts;

/* The step graph's working buffers (engine/step_exec.c and step_run.c use them; storage
 * only allocates them, with everything else, so the memory model stays one list). */
typedef struct fy_window_bufs {
    int32_t *tok_dev;         /* 2 x (tok_parts,B,T): double-buffered */
    int32_t *tok_host;        /* pinned staging, same shape */
    float *loss_dev, *loss_host;      /* one per micro-batch */
    double *sumsq_dev, *sumsq_host;   /* one per block */
    double *parts_dev;        /* sharded: this rank's chunk sums of its shards, block by block */
    double *parts_host;       /* sharded: every rank's, rank by rank (each as parts_dev) */
    void *landing;            /* host landing slot (layout.h: landing_nbytes) */
    int32_t *rows;            /* the row-staged block's (layout.h: rows_block), host, 2 x
                                 (B*T): per token buffer, the distinct tokens of its inputs
                                 in increasing order, the rows its passes get */
    int32_t *row_map;         /* host scratch, a row table's rows: -1, or its gathered row */
    void *rows_host;          /* pinned: the rows gathered for a fetch (stage_nelem) */
} fy_window_bufs;

typedef struct fy_storage {
    fy_dev *dev;
    const fy_model *model;
    fy_layout layout;         /* own copy */
    void **state;             /* nblocks x FY_STATES: each state's buffer (an alias's is
                                 its owner's); NULL where the block has none */
    fy_ring param_ring[FY_RINGS], grad_ring[FY_RINGS];
    fy_ring disk_ring;        /* host slots of disk chunks (4 KiB aligned) */
    fy_ring act_ring;         /* device slots of offloaded inputs (layout.h) */
    struct fy_disk *disk;     /* the scratch file (NULL: nothing on disk) */
    size_t *disk_off;         /* nblocks x FY_STATES: a disk state's region in the file */
    fy_block_acts *acts;      /* nblocks */
    void *work;               /* the blocks' shared workspace */
    void *dx;                 /* the activation gradient between blocks */
    fy_window_bufs win;       /* the executor's */
    void *arena[2];           /* host state: the pageable [0] and the pinned [1] arena */
    size_t arena_nbytes[2];
    bool arena_pinned;        /* the pinned arena is pinned (the system may refuse) */
    void **allocs;            /* device-interface allocations, for freeing */
    int nallocs, capallocs;
    fy_mem_model mem;         /* the memory model: what this storage allocated */
} fy_storage;

/* Allocates everything layout L lists on dev (L is copied), and the scratch file under
 * disk_dir (offload/disk.h) when it keeps state on disk: FY_ERR_INVALID (logged) if it
 * does and disk_dir is NULL; the file's errors as fy_disk_open's. */
fy_status fy_storage_new(fy_dev *dev, const fy_layout *L, const char *disk_dir, fy_storage **out);
void fy_storage_free(fy_storage *st);

/* Block b's state s: its buffer (NULL: none), or element i of the block in it (i within
 * the place's range). */
static inline void *fy_storage_ptr(const fy_storage *st, int b, fy_state s) {
    return st->state[(size_t)b * FY_STATES + s];
}
static inline void *fy_storage_at(const fy_storage *st, int b, fy_state s, size_t i) {
    const fy_place *p = fy_layout_state(&st->layout, b, s);
    return (char *)fy_storage_ptr(st, b, s) + (i - p->lo) * fy_dtype_size(p->dtype);
}

/* The byte offset in the scratch file of element i of block b's disk state s. */
static inline size_t fy_storage_disk_off(const fy_storage *st, int b, fy_state s, size_t i) {
    const fy_place *p = fy_layout_state(&st->layout, b, s);
    return st->disk_off[(size_t)b * FY_STATES + s] + (i - p->lo) * sizeof(float);
}

/* A speculative block's two sides swap (layout.h: SPARE_*): the master's buffer (and the
 * states that are it) with SPARE_MASTER, M with SPARE_M, V with SPARE_V. */
void fy_storage_swap_spare(fy_storage *st, int b);

/* The memory model of layout L under a pinned-memory cap (SIZE_MAX: none). */
void fy_layout_memory(const fy_layout *L, size_t pinned_cap, fy_mem_model *out);
/* The same for one process's training run of plan (evaluation: training false), under a
 * pinned cap, or none. */
void fy_storage_model_pinned(const fy_model *m, const fy_plan *plan, int T, bool training,
                             size_t pinned_cap, fy_mem_model *out);
void fy_storage_model_for(const fy_model *m, const fy_plan *plan, int T, bool training,
                          fy_mem_model *out);
void fy_storage_model(const fy_model *m, const fy_plan *plan, int T, fy_mem_model *out);
void fy_mem_model_print(const fy_mem_model *m, FILE *f);
const char *fy_mem_cat_name(fy_mem_cat c);

#ifdef __cplusplus
}
#endif
#endif
