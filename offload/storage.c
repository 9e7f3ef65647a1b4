/* storage.c — allocating what a layout lists, and the memory model.
 *
 * walk() visits every buffer of a layout in one fixed order and hands each to take()
 * (device memory) or carve() (a host arena). A dry walk only counts: that is the memory
 * model. The real walk allocates the same list, so the model cannot drift from what is
 * allocated. */
#include "offload/storage.h"

#include <stdlib.h>
#include <string.h>

#include "engine/core/util.h"
#include "offload/disk.h"

#define HOST_ALIGN 64

static const char *cat_names[FY_CAT_COUNT] = {"parameters", "gradients", "optimizer",
                                              "activations", "staging", "workspace"};

const char *fy_mem_cat_name(fy_mem_cat c) { return c < FY_CAT_COUNT ? cat_names[c] : "?"; }

typedef struct walk {
    fy_storage *st;        /* NULL in a dry walk */
    fy_mem_model *m;
    size_t pinned_cap;     /* transfer buffers past it go to the pageable arena */
    char *cur[2];          /* real walk: the next free byte of the pageable [0] and the
                              pinned [1] arena */
    char what[80];         /* the buffer's name, for the allocation's errors */
    size_t disk_cur;       /* the scratch file's next free byte */
    void *scratch;         /* a dry walk's out parameter */
} walk;

static fy_status take(walk *w, fy_mem_cat cat, size_t nbytes, void *out) {
    w->m->device[cat] += nbytes;
    w->m->device_total += nbytes;
    if (!w->st || !nbytes) return FY_OK; /* an empty shard: NULL, as modelled */
    fy_storage *st = w->st;
    if (st->nallocs == st->capallocs) {
        int ncap = st->capallocs ? 2 * st->capallocs : 64;
        void **a = realloc(st->allocs, (size_t)ncap * sizeof *a);
        if (!a) return FY_ERR_NOMEM;
        st->allocs = a;
        st->capallocs = ncap;
    }
    void *p;
    FY_TRY(fy_dev_alloc(st->dev, FY_MEM_DEVICE, nbytes, w->what, &p));
    st->allocs[st->nallocs++] = p;
    memcpy(out, &p, sizeof p);
    return FY_OK;
}

/* Big host arrays are followed by a 4 KiB + 64 B gap: weights, moments and gradients
 * updated together then start at different offsets within 2 MiB pages, which keeps
 * them out of each other's DRAM banks (optim_cpu measured ~2x on same-offset arrays). */
#define HOST_STAGGER (4096 + HOST_ALIGN)

/* A host buffer. One the device copies to or from (xfer) goes to the pinned arena while
 * that stays within the cap, the rest to the pageable one. */
static void carve(walk *w, fy_mem_cat cat, size_t nbytes, bool xfer, void *out) {
    size_t n = fy_round_up(nbytes, HOST_ALIGN);
    if (n >= (1u << 20)) n += HOST_STAGGER;
    const bool pin = xfer && w->m->host_pinned + n <= w->pinned_cap;
    w->m->host[cat] += n;
    w->m->host_total += n;
    if (pin) w->m->host_pinned += n;
    else if (xfer) w->m->pinned_over += n;
    if (!w->st) return;
    void *p = w->cur[pin];
    w->cur[pin] += n;
    memcpy(out, &p, sizeof p);
}

/* A buffer's name for the allocation's errors, made only when a walk allocates (the
 * tuner walks layouts by the hundred thousand). */
#define NAME(...) do { if (w->st) snprintf(w->what, sizeof w->what, __VA_ARGS__); } while (0)

#define OUT(field) (w->st ? (void *)&w->st->field : (void *)&w->scratch)

static const char *ring_names[FY_RINGS] = {"layer", "large"};

/* Block b's states with buffers of their own, in state order; aliases then take their
 * owner's buffer. */
static fy_status walk_block(walk *w, const fy_layout *L, int b) {
    const char *bname = fy_model_block(L->model, b)->name;
    void **ptr = w->st ? &w->st->state[(size_t)b * FY_STATES] : NULL;
    for (int s = 0; s < FY_STATE_SAVED; s++) {
        const fy_place *p = fy_layout_state(L, b, (fy_state)s);
        if (!fy_layout_owns(L, b, (fy_state)s)) continue;
        void **out = ptr ? &ptr[s] : &w->scratch;
        if (p->tier == FY_TIER_DISK) { /* a region of the file; no pointer */
            const size_t n = fy_disk_align_up(fy_place_nbytes(p));
            if (w->st) w->st->disk_off[(size_t)b * FY_STATES + s] = w->disk_cur;
            w->disk_cur += n;
            w->m->disk[p->cat] += n;
            w->m->disk_total += n;
        } else if (p->tier == FY_TIER_DEVICE) {
            NAME("%s %s", bname, fy_state_name((fy_state)s));
            FY_TRY(take(w, p->cat, fy_place_nbytes(p), out));
        } else {
            carve(w, p->cat, fy_place_nbytes(p), p->tier == FY_TIER_PINNED, out);
        }
    }
    for (int s = 0; ptr && s < FY_STATE_SAVED; s++)
        if (fy_layout_has(L, b, (fy_state)s) && !fy_layout_owns(L, b, (fy_state)s))
            ptr[s] = ptr[fy_layout_buffer_of(L, b, (fy_state)s)];
    return FY_OK;
}

void fy_storage_swap_spare(fy_storage *st, int b) {
    const fy_layout *L = &st->layout;
    FY_ASSERT(L->blocks[b].speculate, "only a speculative block has a spare side");
    void **ptr = &st->state[(size_t)b * FY_STATES], *t;
    const fy_state pairs[3][2] = {{fy_layout_buffer_of(L, b, FY_STATE_MASTER), FY_STATE_SPARE_MASTER},
                                  {FY_STATE_M, FY_STATE_SPARE_M}, {FY_STATE_V, FY_STATE_SPARE_V}};
    for (int k = 0; k < 3; k++) {
        t = ptr[pairs[k][0]];
        ptr[pairs[k][0]] = ptr[pairs[k][1]];
        ptr[pairs[k][1]] = t;
    }
    for (int s = 0; s < FY_STATE_SAVED; s++)
        if (fy_layout_has(L, b, (fy_state)s) && !fy_layout_owns(L, b, (fy_state)s))
            ptr[s] = ptr[fy_layout_buffer_of(L, b, (fy_state)s)];
}

/* The staging rings' slots, the landing slot, a row-staged block's buffers. */
static fy_status walk_staging(walk *w, const fy_layout *L) {
    for (int r = 0; r < FY_RINGS; r++) {
        fy_ring *pr = w->st ? &w->st->param_ring[r] : NULL, *gr = w->st ? &w->st->grad_ring[r] : NULL;
        for (int i = 0; i < L->param_ring[r].n; i++) {
            NAME("parameter staging slot %d (%s ring)", i, ring_names[r]);
            FY_TRY(take(w, FY_CAT_STAGING, L->param_ring[r].nbytes, pr ? &pr->slots[i] : &w->scratch));
        }
        for (int i = 0; i < L->grad_ring[r].n; i++) {
            NAME("gradient staging slot %d (%s ring)", i, ring_names[r]);
            FY_TRY(take(w, FY_CAT_STAGING, L->grad_ring[r].nbytes, gr ? &gr->slots[i] : &w->scratch));
        }
    }
    if (L->landing_nbytes) carve(w, FY_CAT_STAGING, L->landing_nbytes, true, OUT(win.landing));
    for (int i = 0; i < L->disk_ring.n; i++) { /* direct I/O's alignment inside each */
        char *raw = NULL;
        carve(w, FY_CAT_STAGING, L->disk_ring.nbytes + FY_DISK_ALIGN, false, &raw);
        if (w->st) w->st->disk_ring.slots[i] = (void *)fy_round_up((uintptr_t)raw, FY_DISK_ALIGN);
    }
    if (L->rows_block >= 0) {
        const fy_block_spec *gb = fy_model_block(L->model, L->rows_block);
        const size_t N = (size_t)L->B * L->T;
        carve(w, FY_CAT_STAGING, L->blocks[L->rows_block].rows_nelem * L->es, true, OUT(win.rows_host));
        carve(w, FY_CAT_WORKSPACE, 2 * N * sizeof(int32_t), false, OUT(win.rows));
        carve(w, FY_CAT_WORKSPACE, (size_t)gb->tensors[0].alloc_rows * sizeof(int32_t), false,
              OUT(win.row_map));
    }
    return FY_OK;
}

/* Activations: the saved area recomputed blocks share, then each block's own. */
static fy_status walk_acts(walk *w, const fy_layout *L) {
    void *shared = NULL;
    NAME("activations shared by recomputed layers");
    if (L->shared_saved_nbytes) FY_TRY(take(w, FY_CAT_ACTS, L->shared_saved_nbytes, &shared));
    for (int b = 0; b < L->nblocks; b++) {
        const fy_block_layout *bl = &L->blocks[b];
        const char *bname = fy_model_block(L->model, b)->name;
        fy_block_acts ba = {0};
        if (bl->recompute) {
            ba.saved = shared;
        } else if (bl->saved_nbytes) {
            NAME("%s activations", bname);
            FY_TRY(take(w, FY_CAT_ACTS, bl->saved_nbytes, &ba.saved));
        }
        void *host_acts = NULL;
        if (bl->out_offloaded) {
            carve(w, FY_CAT_ACTS, bl->out_nbytes, true, &host_acts);
        } else if (bl->out_nbytes) {
            NAME("%s output", bname);
            FY_TRY(take(w, FY_CAT_ACTS, bl->out_nbytes, &ba.out));
        }
        if (w->st) {
            w->st->acts[b] = ba;
            w->st->state[(size_t)b * FY_STATES + FY_STATE_SAVED] = ba.saved;
            w->st->state[(size_t)b * FY_STATES + FY_STATE_HOST_ACTS] = host_acts;
        }
    }
    for (int i = 0; i < L->act_ring.n; i++) {
        NAME("offloaded activation slot %d", i);
        FY_TRY(take(w, FY_CAT_ACTS, L->act_ring.nbytes, w->st ? &w->st->act_ring.slots[i] : &w->scratch));
    }
    NAME("workspace");
    if (L->work_nbytes) FY_TRY(take(w, FY_CAT_WORKSPACE, L->work_nbytes, OUT(work)));
    NAME("activation gradient");
    if (L->dx_nbytes) FY_TRY(take(w, FY_CAT_WORKSPACE, L->dx_nbytes, OUT(dx)));
    return FY_OK;
}

/* The window's scratch: tokens (double-buffered, so the next micro-batch loads while
 * this one computes), losses, norms, a sharded job's chunk sums. */
static fy_status walk_scratch(walk *w, const fy_layout *L) {
    const size_t N = (size_t)L->B * L->T, tok = 2 * (size_t)L->tok_parts * N * sizeof(int32_t);
    const size_t accum = (size_t)L->accum, nb = (size_t)L->nblocks;
    NAME("tokens");
    FY_TRY(take(w, FY_CAT_WORKSPACE, tok, OUT(win.tok_dev)));
    NAME("losses");
    FY_TRY(take(w, FY_CAT_WORKSPACE, accum * sizeof(float), OUT(win.loss_dev)));
    NAME("gradient norms");
    FY_TRY(take(w, FY_CAT_WORKSPACE, nb * sizeof(double), OUT(win.sumsq_dev)));
    carve(w, FY_CAT_WORKSPACE, tok, true, OUT(win.tok_host));
    carve(w, FY_CAT_WORKSPACE, accum * sizeof(float), true, OUT(win.loss_host));
    carve(w, FY_CAT_WORKSPACE, nb * sizeof(double), true, OUT(win.sumsq_host));
    if (!fy_layout_sharded(L)) return FY_OK;
    NAME("norm chunk sums");
    FY_TRY(take(w, FY_CAT_WORKSPACE, (L->own_parts ? L->own_parts : 1) * sizeof(double), OUT(win.parts_dev)));
    carve(w, FY_CAT_WORKSPACE, L->nparts * sizeof(double), true, OUT(win.parts_host));
    return FY_OK;
}

static fy_status walk_all(walk *w, const fy_layout *L) {
    for (int b = 0; b < L->nblocks; b++) FY_TRY(walk_block(w, L, b));
    FY_TRY(walk_staging(w, L));
    FY_TRY(walk_acts(w, L));
    return walk_scratch(w, L);
}

void fy_layout_memory(const fy_layout *L, size_t pinned_cap, fy_mem_model *out) {
    memset(out, 0, sizeof *out);
    walk w = {.m = out, .pinned_cap = pinned_cap};
    fy_status s = walk_all(&w, L);
    FY_ASSERT(s == FY_OK, "a dry storage walk cannot fail");
}

void fy_storage_model_pinned(const fy_model *m, const fy_plan *plan, int T, bool training,
                             size_t pinned_cap, fy_mem_model *out) {
    fy_layout L;
    fy_status s = fy_layout_new(m, plan, T, training, 1, 0, &L);
    FY_ASSERT(s == FY_OK, "the memory model of a plan that does not fit its model");
    fy_layout_memory(&L, pinned_cap, out);
    fy_layout_free(&L);
}

void fy_storage_model_for(const fy_model *m, const fy_plan *plan, int T, bool training,
                          fy_mem_model *out) {
    fy_storage_model_pinned(m, plan, T, training, SIZE_MAX, out);
}

void fy_storage_model(const fy_model *m, const fy_plan *plan, int T, fy_mem_model *out) {
    fy_storage_model_for(m, plan, T, true, out);
}

/* The storage's own tables: the layout's copy, state pointers, ring slots, activations. */
static fy_status storage_tables(const fy_layout *L, fy_storage *st) {
    const size_t nb = (size_t)L->nblocks;
    st->layout = *L;
    st->layout.blocks = malloc(nb * sizeof *L->blocks);
    st->state = calloc(nb * FY_STATES, sizeof *st->state);
    st->acts = calloc(nb, sizeof *st->acts);
    st->disk_off = calloc(nb * FY_STATES, sizeof *st->disk_off);
    st->disk_ring = (fy_ring){.n = L->disk_ring.n, .nbytes = L->disk_ring.nbytes,
                              .slots = calloc((size_t)(L->disk_ring.n ? L->disk_ring.n : 1), sizeof(void *))};
    st->act_ring = (fy_ring){.n = L->act_ring.n, .nbytes = L->act_ring.nbytes,
                             .slots = calloc((size_t)(L->act_ring.n ? L->act_ring.n : 1), sizeof(void *))};
    if (!st->layout.blocks || !st->state || !st->acts || !st->disk_off || !st->disk_ring.slots ||
        !st->act_ring.slots)
        return FY_ERR_NOMEM;
    memcpy(st->layout.blocks, L->blocks, nb * sizeof *L->blocks);
    st->layout.cap = L->nblocks;
    for (int r = 0; r < FY_RINGS; r++) {
        const int np = L->param_ring[r].n, ng = L->grad_ring[r].n;
        st->param_ring[r] = (fy_ring){.n = np, .nbytes = L->param_ring[r].nbytes,
                                      .slots = calloc((size_t)(np ? np : 1), sizeof(void *))};
        st->grad_ring[r] = (fy_ring){.n = ng, .nbytes = L->grad_ring[r].nbytes,
                                     .slots = calloc((size_t)(ng ? ng : 1), sizeof(void *))};
        if (!st->param_ring[r].slots || !st->grad_ring[r].slots) return FY_ERR_NOMEM;
    }
    return FY_OK;
}

/* The host arenas: the pinned one (pageable, with one warning, if the system will not
 * pin it), and the pageable one. */
static fy_status new_arenas(fy_storage *st, const fy_mem_model *dry, size_t cap) {
    char a[32], b[32];
    if (dry->pinned_over)
        fy_log_warn("pinned memory is capped at %s (--pinned-mem): %s of buffers the device "
                    "copies to and from are pageable (slower copies)", fy_fmt_size(cap, a, sizeof a),
                    fy_fmt_size(dry->pinned_over, b, sizeof b));
    st->arena_nbytes[1] = dry->host_pinned;
    st->arena_nbytes[0] = dry->host_total - dry->host_pinned;
    if (st->arena_nbytes[1]) {
        fy_status s = fy_dev_alloc(st->dev, FY_MEM_PINNED, st->arena_nbytes[1], "pinned host arena",
                                   &st->arena[1]);
        st->arena_pinned = s == FY_OK;
        if (s != FY_OK) {
            fy_log_warn("cannot pin %s of host memory: using pageable memory (slower copies)",
                        fy_fmt_size(st->arena_nbytes[1], a, sizeof a));
            FY_TRY(fy_dev_alloc(st->dev, FY_MEM_HOST, st->arena_nbytes[1], "host arena", &st->arena[1]));
        }
    }
    if (st->arena_nbytes[0])
        FY_TRY(fy_dev_alloc(st->dev, FY_MEM_HOST, st->arena_nbytes[0], "host arena", &st->arena[0]));
    return FY_OK;
}

fy_status fy_storage_new(fy_dev *dev, const fy_layout *L, const char *disk_dir, fy_storage **out) {
    *out = NULL;
    fy_storage *st = calloc(1, sizeof *st);
    if (!st) return FY_ERR_NOMEM;
    st->dev = dev;
    st->model = L->model;
    fy_status s = storage_tables(L, st);
    const size_t cap = fy_dev_pinned_cap(dev);
    fy_mem_model dry;
    fy_layout_memory(L, cap, &dry);
    if (s == FY_OK) s = new_arenas(st, &dry, cap);
    walk w = {.st = st, .m = &st->mem, .pinned_cap = cap, .cur = {st->arena[0], st->arena[1]}};
    if (s == FY_OK) s = walk_all(&w, L);
    if (s == FY_OK && dry.disk_total && !disk_dir) {
        fy_log_error("the plan keeps optimizer state on disk: give --disk-dir DIR");
        s = FY_ERR_INVALID;
    }
    if (s == FY_OK && dry.disk_total) s = fy_disk_open(disk_dir, L->rank, dry.disk_total, 0, &st->disk);
    if (s == FY_OK && st->disk && !fy_disk_direct(st->disk) && L->rank <= 0)
        fy_log_warn("--disk-dir %s: its filesystem refuses direct I/O, so the disk tier's scratch "
                    "file goes through the page cache (host memory the plan does not count)", disk_dir);
    if (s != FY_OK) {
        fy_storage_free(st);
        return s;
    }
    FY_ASSERT(w.cur[0] - (char *)st->arena[0] == (ptrdiff_t)st->arena_nbytes[0] &&
              w.cur[1] - (char *)st->arena[1] == (ptrdiff_t)st->arena_nbytes[1] &&
              st->mem.device_total == dry.device_total,
              "the storage walk must be the same dry and real");
    *out = st;
    return FY_OK;
}

void fy_storage_free(fy_storage *st) {
    if (!st) return;
    for (int i = st->nallocs - 1; i >= 0; i--) fy_dev_release(st->dev, st->allocs[i]);
    if (st->dev) {
        fy_dev_release(st->dev, st->arena[0]);
        fy_dev_release(st->dev, st->arena[1]);
    }
    free(st->allocs);
    fy_disk_close(st->disk);
    free(st->disk_off);
    free(st->disk_ring.slots);
    free(st->act_ring.slots);
    for (int r = 0; r < FY_RINGS; r++) {
        free(st->param_ring[r].slots);
        free(st->grad_ring[r].slots);
    }
    free(st->state);
    free(st->acts);
    fy_layout_free(&st->layout);
    free(st);
}

void fy_mem_model_print(const fy_mem_model *m, FILE *f) {
    char a[32], b[32], d[32];
    const bool disk = m->disk_total > 0;
    fprintf(f, "memory  %-12s %12s %12s%s\n", "", "device", "host", disk ? "         disk" : "");
    for (int c = 0; c < FY_CAT_COUNT; c++) {
        fprintf(f, "        %-12s %12s %12s", cat_names[c], fy_fmt_size(m->device[c], a, sizeof a),
                fy_fmt_size(m->host[c], b, sizeof b));
        if (disk) fprintf(f, " %12s", fy_fmt_size(m->disk[c], d, sizeof d));
        fputc('\n', f);
    }
    fprintf(f, "        %-12s %12s %12s", "total", fy_fmt_size(m->device_total, a, sizeof a),
            fy_fmt_size(m->host_total, b, sizeof b));
    if (disk) fprintf(f, " %12s", fy_fmt_size(m->disk_total, d, sizeof d));
    fputc('\n', f);
}
