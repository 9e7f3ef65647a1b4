/* trainer_state.c — a trainer's state read and written block by block, wherever the
 * layout keeps it: the weights, gradients and moments a save or a checkpoint reads and
 * a resume writes; in a sharded job, gathered on rank 0 from the ranks that serve them,
 * and where each rank's norm chunk sums go.
 *
 * In a data-parallel job each rank holds its shard of the fp32 masters (where they are
 * apart from the weights) and of the moments (layout.h). Rank 0's getters gather a
 * block's state from every rank: rank 0 broadcasts a request (the state and block), and
 * every other rank, inside fy_trainer_serve, sends its shard, until rank 0's
 * fy_trainer_serve_end. A state that is not sharded is read where it is. */
#include <stdlib.h>
#include <string.h>

#include "engine/trainer_core.h"
#include "offload/disk.h"

fy_status fy_trainer_disk_piece(fy_trainer *tr, int b, fy_state s, size_t lo, size_t n, bool write) {
    char *bounce = tr->st->disk_ring.slots[0];
    const size_t nbytes = fy_disk_align_up(n * sizeof(float)), off = fy_storage_disk_off(tr->st, b, s, lo);
    FY_ASSERT(n <= fy_tr_disk_piece(tr), "a piece fits the first disk slot's part");
    if (!write) return fy_disk_read(tr->st->disk, off, bounce, nbytes);
    memset(bounce + n * sizeof(float), 0, nbytes - n * sizeof(float));
    return fy_disk_write(tr->st->disk, off, bounce, nbytes);
}

fy_status fy_trainer_disk_state(fy_trainer *tr, int b, fy_state s, float *host, bool write) {
    const fy_place *p = fy_layout_state(tr->L, b, s);
    const size_t part = fy_tr_disk_piece(tr);
    float *bounce = tr->st->disk_ring.slots[0];
    for (size_t lo = p->lo; lo < p->hi; lo += part) {
        const size_t n = p->hi - lo < part ? p->hi - lo : part;
        if (write) memcpy(bounce, host + lo, n * sizeof(float));
        FY_TRY(fy_trainer_disk_piece(tr, b, s, lo, n, write));
        if (!write) memcpy(host + lo, bounce, n * sizeof(float));
    }
    return FY_OK;
}

/* State s of block b (its range, in its dtype, on the device or the host) into fp32 host
 * memory at host + lo. bf16 lands in the back half and is widened in place: host holds
 * the floats, the bf16 copy half their bytes, and host[i] (bytes 4i..4i+3) never
 * overtakes the copy's element i (2n + 2i). */
fy_status fy_trainer_read_state(fy_trainer *tr, int b, fy_state s, float *host) {
    const fy_place *p = fy_layout_state(tr->L, b, s);
    const size_t n = p->hi - p->lo, nbytes = n * fy_dtype_size(p->dtype);
    float *out = host + p->lo;
    void *dst = p->dtype != FY_F32 ? (void *)((uint16_t *)out + n) : (void *)out;
    fy_stream_sync(tr->s);
    if (!nbytes) return FY_OK;
    if (p->tier == FY_TIER_DISK) return fy_trainer_disk_state(tr, b, s, host, false);
    if (p->tier == FY_TIER_DEVICE) {
        fy_copy_async(tr->s, dst, fy_tr_ptr(tr, b, s), nbytes, FY_D2H);
        fy_stream_sync(tr->s);
    } else {
        memcpy(dst, fy_tr_ptr(tr, b, s), nbytes);
    }
    if (p->dtype != FY_F32) fy_bf16_to_f32_n(out, dst, n);
    return FY_OK;
}

/* State s of block b (fp32, its range) from host + lo. */
fy_status fy_trainer_write_state(fy_trainer *tr, int b, fy_state s, const float *host) {
    const fy_place *p = fy_layout_state(tr->L, b, s);
    const size_t nbytes = fy_place_nbytes(p);
    FY_ASSERT(p->dtype == FY_F32 && p->same_as < 0, "fp32 state of its own is written back");
    if (!nbytes) return FY_OK; /* an empty shard */
    fy_stream_sync(tr->s);
    if (p->tier == FY_TIER_DISK) return fy_trainer_disk_state(tr, b, s, (float *)host, true);
    if (p->tier == FY_TIER_DEVICE) {
        fy_copy_async(tr->s, fy_tr_ptr(tr, b, s), host + p->lo, nbytes, FY_H2D);
        fy_stream_sync(tr->s);
    } else {
        memcpy(fy_tr_ptr(tr, b, s), host + p->lo, nbytes);
    }
    return FY_OK;
}

bool fy_trainer_get_grads(fy_trainer *tr, int b, float *host) {
    FY_ASSERT(!tr->cfg.eval_only, "an evaluation-only trainer has no gradients");
    if (fy_layout_grad_in_weights(tr->L, b)) return false;
    return fy_trainer_read_state(tr, b, FY_STATE_GRAD, host) == FY_OK;
}

/* Where each rank's norm chunk sums go (trainer_core.h: part_region, part_base). */
fy_status fy_trainer_setup_parts(fy_trainer *tr) {
    const int nb = fy_tr_nblocks(tr), W = tr->world;
    tr->part_region = calloc((size_t)W + 1, sizeof *tr->part_region);
    tr->part_base = calloc((size_t)nb, sizeof *tr->part_base);
    if (!tr->part_region || !tr->part_base) return FY_ERR_NOMEM;
    for (int r = 0; r < W; r++) {
        size_t n = 0;
        for (int b = 0; b < nb; b++) {
            if (r == tr->rank) tr->part_base[b] = n;
            n += fy_shard_nchunks(fy_tr_blk(tr, b)->nelem, W, r);
        }
        tr->part_region[r + 1] = tr->part_region[r] + n;
    }
    FY_ASSERT(tr->part_region[W] == tr->L->nparts, "every chunk sum has its place");
    return FY_OK;
}

/* A request's first word: a state (fy_state), or the end. */
enum { SERVE_END = -1 };

/* This rank's shard of block b's state s (fp32, its range) in host memory: the host
 * buffer itself, or a device or disk one's copy in *tmp. The scratch file failing here
 * (logged by it) ends the job: the other ranks wait in the gather, and the checkpoint
 * being written is never published. */
static const float *shard_on_host(fy_trainer *tr, int b, fy_state s, float **tmp) {
    const fy_place *p = fy_layout_state(tr->L, b, s);
    const float *src = fy_tr_ptr(tr, b, s);
    const size_t nbytes = (p->hi - p->lo) * sizeof(float);
    fy_stream_sync(tr->s);
    if (p->tier == FY_TIER_DISK && nbytes) { /* read into *tmp, indexed from the shard's lo */
        float *t = realloc(*tmp, nbytes);
        FY_ASSERT(t, "out of host memory gathering a block's shards");
        *tmp = t;
        if (fy_trainer_disk_state(tr, b, s, t - p->lo, false) != FY_OK) fy_comm_abort(tr->comm, 1);
        return t;
    }
    if (p->tier != FY_TIER_DEVICE || !nbytes) return src;
    float *t = realloc(*tmp, nbytes);
    FY_ASSERT(t, "out of host memory gathering a block's shards");
    *tmp = t;
    fy_copy_async(tr->s, t, src, nbytes, FY_D2H);
    fy_stream_sync(tr->s);
    return t;
}

/* Block b's state s gathered into rank 0's whole (the others pass NULL): each rank sends
 * its shard (through *tmp when it is in device memory). */
static fy_status gather_block(fy_trainer *tr, int b, fy_state s, float *whole, float **tmp) {
    size_t off[FY_MAX_SHARDS + 1];
    fy_tr_shards(tr, b, off);
    return fy_comm_gather(tr->comm, whole, shard_on_host(tr, b, s, tmp), off, sizeof(float));
}

/* Rank 0: block b's state s whole into host, its shards from their owners, who serve. A
 * job whose collectives fail is ended (comm.h). */
static void gather_shards(fy_trainer *tr, int b, fy_state s, float *host) {
    FY_ASSERT(tr->rank == 0, "rank 0 gathers a sharded job's state; the others serve it");
    int64_t req[2] = {s, b};
    float *tmp = NULL;
    fy_status st = fy_comm_bcast(tr->comm, req, sizeof req);
    if (st == FY_OK) st = gather_block(tr, b, s, host, &tmp);
    free(tmp);
    if (st != FY_OK) fy_comm_abort(tr->comm, 1);
}

fy_status fy_trainer_serve(fy_trainer *tr) {
    if (!fy_layout_sharded(tr->L) || tr->rank == 0) return FY_OK;
    float *tmp = NULL;
    fy_status st;
    for (;;) {
        int64_t req[2];
        fy_comm_patient(tr->comm, true); /* rank 0 may write for long between requests */
        st = fy_comm_bcast(tr->comm, req, sizeof req);
        fy_comm_patient(tr->comm, false);
        if (st != FY_OK) break;
        if (req[0] == SERVE_END) { /* req[1]: rank 0's save failed (it said why) */
            st = req[1] ? FY_ERR_IO : FY_OK;
            break;
        }
        const int b = (int)req[1];
        FY_ASSERT(b >= 0 && b < fy_tr_nblocks(tr) && req[0] >= 0 && req[0] < FY_STATES,
                  "a request for a block's state");
        if ((st = gather_block(tr, b, (fy_state)req[0], NULL, &tmp)) != FY_OK) break;
    }
    free(tmp);
    return st;
}

fy_status fy_trainer_serve_end(fy_trainer *tr, bool failed) {
    if (!fy_layout_sharded(tr->L) || tr->rank != 0) return FY_OK;
    int64_t req[2] = {SERVE_END, failed};
    return fy_comm_bcast(tr->comm, req, sizeof req);
}

fy_status fy_trainer_get_params(fy_trainer *tr, int b, float *host) {
    if (fy_layout_master_sharded(tr->L, b)) {
        gather_shards(tr, b, FY_STATE_MASTER, host);
        return FY_OK;
    }
    return fy_trainer_read_state(tr, b, FY_STATE_MASTER, host);
}

fy_status fy_trainer_get_moments(fy_trainer *tr, int b, float *m, float *v) {
    FY_ASSERT(!tr->cfg.eval_only, "an evaluation-only trainer has no moments");
    const fy_state s[2] = {FY_STATE_M, FY_STATE_V};
    float *out[2] = {m, v};
    for (int k = 0; k < 2; k++) {
        if (!out[k]) continue;
        if (fy_layout_sharded(tr->L)) gather_shards(tr, b, s[k], out[k]);
        else FY_TRY(fy_trainer_read_state(tr, b, s[k], out[k]));
    }
    return FY_OK;
}

/* Whole moments in: this rank keeps its shard. */
fy_status fy_trainer_set_moments(fy_trainer *tr, int b, const float *m, const float *v) {
    FY_ASSERT(!tr->cfg.eval_only, "an evaluation-only trainer has no moments");
    FY_TRY(fy_trainer_write_state(tr, b, FY_STATE_M, m));
    return fy_trainer_write_state(tr, b, FY_STATE_V, v);
}
