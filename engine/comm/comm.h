/* comm.h — the processes of a data-parallel job and the collectives between them.
 *
 * One process per device, started by a launcher (mpirun, Slurm's srun). fy_comm_init
 * reads the launcher's environment (Open MPI's OMPI_COMM_WORLD_SIZE, PMI's PMI_SIZE,
 * Slurm's SLURM_NTASKS); without one the world is this process alone and no MPI call is
 * made, so a single process needs the MPI library only to load. Ranks talk over MPI
 * (host buffers; the cpu backend's device memory is host memory).
 *
 * Exactness: a sum over ranks is formed in rank order, (((x0 + x1) + x2) + ...), each
 * addition in the buffer's type (bf16: an fp32 sum rounded to bf16, the device's
 * accumulation): by rank 0 and broadcast (fy_comm_sum: every rank gets the same bits),
 * or by each shard's owner (fy_comm_reduce_scatter). Either way they are the bits one
 * process gets adding the ranks' values in that order (so W ranks of one micro-batch
 * each train exactly as one process accumulating W micro-batches).
 *
 * Failure: a collective that waits longer than the timeout (FERRY_COMM_TIMEOUT seconds,
 * default 600: a rank died or stalled) ends the job with one error line naming the rank
 * that waited; fy_comm_abort ends it from a rank that failed (the launcher then stops
 * the others). Never a hang.
 *
 * Threads: collectives are called from one thread at a time (the trainer's comm and cpu
 * lanes are ordered by the graph). */
#ifndef FY_COMM_H
#define FY_COMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/core/dtype.h"
#include "engine/core/status.h"
#include "engine/device/device.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fy_comm fy_comm;

/* The world this process belongs to. FY_ERR_UNSUPPORTED (logged) when a launcher started
 * several processes and this build has no MPI; FY_ERR_IO (logged) when MPI fails to
 * start. */
fy_status fy_comm_init(fy_comm **out);
void fy_comm_free(fy_comm *c); /* NULL is a no-op; ends MPI when it started it */

int fy_comm_rank(const fy_comm *c);
int fy_comm_size(const fy_comm *c);
int fy_comm_local_rank(const fy_comm *c); /* among the ranks of this node: picks the GPU */
int fy_comm_local_size(const fy_comm *c); /* the ranks of this node */

/* Places this rank on its node: unless the launcher bound it already (the node's ranks
 * were given different CPU sets), the local ranks (those sharing this node's memory)
 * share out the set they were given: they are spread evenly over the NUMA nodes (local rank
 * i of L on node i*K/L of K) and each takes its share of its node's CPUs (threads made
 * later inherit them: the cpu backend's kernels, the CPU AdamW pool, which pins its
 * workers inside them; threads MPI or the comm watchdog started before keep the whole
 * set), and its memory is preferred on that node, so the host buffers it first-touches
 * (the arenas, the moments) are local. Call before any of them exist; every rank of the
 * job together (it compares the node's CPU sets). FERRY_PLACE=0 in the environment
 * leaves the rank where it is.
 * A no-op for a process alone. Describes the placement in desc ("cpus 0-3, NUMA node
 * 0"). */
void fy_comm_place(const fy_comm *c, char *desc, size_t cap);

/* buf[0..n) = the sum over ranks in rank order (above); dt F32, BF16 (host bf16 bits) or
 * F64 (FY_DTYPE_NONE stands for fp64 here: dtype.h has no fp64). */
#define FY_COMM_F64 FY_DTYPE_NONE
fy_status fy_comm_sum(fy_comm *c, void *buf, size_t n, fy_dtype dt);
/* Sharded collectives (data parallel's ZeRO, offload/layout.h): a buffer of elements of
 * es bytes (dt's) is cut at off[0..size], rank r's shard being [off[r], off[r+1]).
 * reduce_scatter: this rank's shard of buf becomes the sum over ranks of their shards,
 * in rank order with fy_comm_sum's arithmetic and bits; the rest of buf is left as it
 * was. allgather: every shard of buf from its owner. gather: rank 0's `whole` receives
 * every rank's shard, each sent from `mine` (its shard's elements; rank 0's too). */
fy_status fy_comm_reduce_scatter(fy_comm *c, void *buf, const size_t *off, fy_dtype dt);
fy_status fy_comm_allgather(fy_comm *c, void *buf, const size_t *off, size_t es);
/* allgather of one record of `each` bytes a rank: rank r's at buf + r * each. */
fy_status fy_comm_allgather_records(fy_comm *c, void *buf, size_t each);
fy_status fy_comm_gather(fy_comm *c, void *whole, const void *mine, const size_t *off, size_t es);

/* A job's sharded collectives on a buffer, as {iface, ctx}: two backends, MPI over host
 * memory (done when the call returns, after the host waits for the work queued on s,
 * which the buffer's writers may still have pending), and the device's own (NCCL on the
 * cuda backend) over device memory, queued on s. fy_comm_coll picks the backend by the
 * memory kind of the buffer (the cpu backend's device memory is host memory, over MPI);
 * nothing else chooses between them. */
typedef struct fy_coll_iface {
    const char *name;         /* "mpi", "device" */
    bool queued;              /* the work is queued on the stream, not done on return */
    fy_status (*reduce_scatter)(void *ctx, fy_stream *s, void *buf, const size_t *off, fy_dtype dt);
    fy_status (*allgather)(void *ctx, fy_stream *s, void *buf, const size_t *off, fy_dtype dt);
} fy_coll_iface;
typedef struct fy_coll { const fy_coll_iface *iface; void *ctx; } fy_coll;
fy_coll fy_comm_coll(fy_comm *c, const fy_dev *dev, fy_mem_kind kind);
static inline fy_status fy_coll_reduce_scatter(fy_coll co, fy_stream *s, void *buf, const size_t *off,
                                               fy_dtype dt) {
    return co.iface->reduce_scatter(co.ctx, s, buf, off, dt);
}
static inline fy_status fy_coll_allgather(fy_coll co, fy_stream *s, void *buf, const size_t *off,
                                          fy_dtype dt) {
    return co.iface->allgather(co.ctx, s, buf, off, dt);
}

/* The job's devices join in their backend's collectives (fy_dev_coll_*: NCCL on the
 * cuda backend): rank 0 makes the id and sends it over MPI. A no-op alone or on a backend
 * without them (the cpu backend sums host memory, fy_comm_sum). */
fy_status fy_comm_attach(fy_comm *c, fy_dev *dev);

/* While on, this rank's collectives wait without the timeout: for a wait on rank 0's own
 * long work (a save's writing, the tuner's search), which is no stall. */
void fy_comm_patient(fy_comm *c, bool on);

/* buf[0..nbytes) of rank 0 on every rank. */
fy_status fy_comm_bcast(fy_comm *c, void *buf, size_t nbytes);
/* x = the largest over ranks (a collective decision: stop, skip). */
fy_status fy_comm_max_i32(fy_comm *c, int32_t *x);
/* Whether every rank's st is FY_OK, decided together: FY_OK, or where any failed (it
 * logged why) this rank's own failure, else FY_ERR_INVALID. Alone (c NULL or one
 * process): st. */
fy_status fy_comm_agree(fy_comm *c, fy_status st);
/* Ends every process of the job (this one with `code`). */
_Noreturn void fy_comm_abort(fy_comm *c, int code);

#ifdef __cplusplus
}
#endif
#endif
