/* cuda_nccl.c — the cuda backend's collectives (device.h: fy_dev_coll_*): NCCL, loaded
 * with dlopen when a job of several processes first asks for it, so the binary needs
 * NCCL only where it runs data parallel on GPUs. One communicator per device, over the
 * job's ranks (its id made by rank 0 and sent to the others over MPI, engine/comm).
 *
 * Sharded collectives (device.h), one group of calls a shard: a reduce-scatter is an
 * ncclReduce (ncclSum) to each shard's owner, an allgather an ncclBroadcast from each
 * owner, so shards may differ in size (ncclReduceScatter's may not). NCCL adds in an
 * order of its own: two ranks give a + b, the same bits as one process accumulating;
 * more ranks agree to float rounding (unlike the cpu backend's rank-order sums).
 *
 * A build whose toolkit has no nccl.h (FY_NO_NCCL, engine/device/meson.build) has the
 * cuda backend without collectives: a job that asks for them gets one error line saying
 * so. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/device/cuda/cuda_impl.h"

#ifdef FY_NO_NCCL

static fy_status no_nccl(void) {
    fy_log_error("this build has no NCCL (its CUDA toolkit had no nccl.h): data parallel on "
                 "GPUs needs it");
    return FY_ERR_UNSUPPORTED;
}

fy_status fy_cu_nccl_id(void *id, size_t cap, size_t *len) { return no_nccl(); }
fy_status fy_cu_nccl_init(fy_cu_dev *cd, const void *id, size_t len, int rank, int size) {
    return no_nccl();
}
void fy_cu_nccl_free(fy_cu_dev *cd) {}
void fy_cu_nccl_poll(fy_cu_dev *cd) {}
void fy_cu_nccl_shards(fy_cu_dev *cd, fy_cu_stream *cs, void *buf, const size_t *off, int nranks,
                       fy_dtype dt, bool gather) {
    FY_ASSERT(0, "a device collective in a build without NCCL");
}

#else

#include <nccl.h>

#define NCCL_FUNCS(X)                                                                    \
    X(ncclGetUniqueId) X(ncclCommInitRank) X(ncclReduce) X(ncclBroadcast) X(ncclGroupStart) \
    X(ncclGroupEnd) X(ncclCommDestroy) X(ncclGetErrorString) X(ncclCommGetAsyncError)     \
    X(ncclCommAbort)

static struct {
#define NCCL_FIELD(f) __typeof__(&f) f;
    NCCL_FUNCS(NCCL_FIELD)
#undef NCCL_FIELD
} nc;

static pthread_once_t nc_once = PTHREAD_ONCE_INIT;
static fy_status nc_status = FY_ERR_UNSUPPORTED;
static char nc_error[256];

static void nc_load(void) {
    void *h = fy_cu_dlopen("libnccl.so.2", "NCCL", nc_error, sizeof nc_error);
    if (!h) return;
#define NCCL_SYM(f) FY_CU_SYM(h, nc, f, "NCCL", nc_error)
    NCCL_FUNCS(NCCL_SYM)
#undef NCCL_SYM
    /* NCCL 2.22+ connects peers at a collective's first use, taking device memory then;
     * connected at init, its buffers exist when the backend measures them (unless the
     * user chose otherwise). Set before any thread reads the environment concurrently:
     * a job attaches its communicator during setup. */
    setenv("NCCL_RUNTIME_CONNECT", "0", 0);
    nc_status = FY_OK;
}

static fy_status nc_check(ncclResult_t r, const char *what) {
    if (r == ncclSuccess) return FY_OK;
    fy_log_error("NCCL %s failed: %s", what, nc.ncclGetErrorString ? nc.ncclGetErrorString(r) : "?");
    return FY_ERR_DEVICE;
}

fy_status fy_cu_nccl_id(void *id, size_t cap, size_t *len) {
    pthread_once(&nc_once, nc_load);
    if (nc_status != FY_OK) {
        fy_log_error("%s", nc_error);
        return nc_status;
    }
    FY_ASSERT(cap >= sizeof(ncclUniqueId), "room for an NCCL id");
    ncclUniqueId u;
    FY_TRY(nc_check(nc.ncclGetUniqueId(&u), "ncclGetUniqueId"));
    memcpy(id, &u, sizeof u);
    *len = sizeof u;
    return FY_OK;
}

fy_status fy_cu_nccl_init(fy_cu_dev *cd, const void *id, size_t len, int rank, int size) {
    pthread_once(&nc_once, nc_load);
    if (nc_status != FY_OK) {
        fy_log_error("%s", nc_error);
        return nc_status;
    }
    if (len != sizeof(ncclUniqueId)) {
        fy_log_error("an NCCL id of %zu bytes (this NCCL's are %zu)", len, sizeof(ncclUniqueId));
        return FY_ERR_INVALID;
    }
    ncclUniqueId u;
    memcpy(&u, id, sizeof u);
    ncclComm_t comm;
    FY_TRY(nc_check(nc.ncclCommInitRank(&comm, size, u, rank), "ncclCommInitRank"));
    cd->nccl = comm;
    cd->rank = rank;
    return FY_OK;
}

void fy_cu_nccl_free(fy_cu_dev *cd) {
    if (cd->nccl) nc.ncclCommDestroy((ncclComm_t)cd->nccl);
    cd->nccl = NULL;
}

void fy_cu_nccl_poll(fy_cu_dev *cd) {
    const ncclComm_t comm = (ncclComm_t)cd->nccl;
    ncclResult_t err = ncclSuccess;
    const ncclResult_t r = nc.ncclCommGetAsyncError(comm, &err);
    if (r != ncclSuccess) err = r;
    if (err == ncclSuccess || err == ncclInProgress) return;
    static atomic_flag ending = ATOMIC_FLAG_INIT;
    if (atomic_flag_test_and_set(&ending)) /* another thread saw it and ends the process */
        for (;;) pause();
    if (err == ncclRemoteError)
        fy_log_error("NCCL: a peer of rank %d failed (%s): ending the job", cd->rank,
                     nc.ncclGetErrorString(err));
    else
        fy_log_error("NCCL: the collectives of rank %d failed (%s): ending the job", cd->rank,
                     nc.ncclGetErrorString(err));
    /* the abort ends this rank's NCCL kernels and proxy threads; the exit ends the job
     * (the launcher stops the other ranks), as the MPI watchdog of engine/comm does: the
     * streams cannot be waited for, so nothing can be unwound */
    nc.ncclCommAbort(comm);
    fflush(stderr);
    _exit(1);
}

void fy_cu_nccl_shards(fy_cu_dev *cd, fy_cu_stream *cs, void *buf, const size_t *off, int nranks,
                       fy_dtype dt, bool gather) {
    FY_ASSERT(cd->nccl, "a device collective before fy_dev_coll_init");
    const ncclDataType_t t = dt == FY_BF16 ? ncclBfloat16 : ncclFloat32;
    const size_t es = dt == FY_BF16 ? 2 : 4;
    const ncclComm_t comm = (ncclComm_t)cd->nccl;
    fy_status st = nc_check(nc.ncclGroupStart(), "ncclGroupStart");
    for (int q = 0; q < nranks && st == FY_OK; q++) {
        char *p = (char *)buf + off[q] * es;
        const size_t n = off[q + 1] - off[q];
        if (!n) continue;
        st = gather ? nc_check(nc.ncclBroadcast(p, p, n, t, q, comm, cs->st), "ncclBroadcast")
                    : nc_check(nc.ncclReduce(p, p, n, t, ncclSum, q, comm, cs->st), "ncclReduce");
    }
    if (st == FY_OK) st = nc_check(nc.ncclGroupEnd(), "ncclGroupEnd");
    FY_ASSERT(st == FY_OK, "an NCCL collective cannot be undone: the job's ranks disagree now");
}

#endif /* FY_NO_NCCL */
