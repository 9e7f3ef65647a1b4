/* cuda_nccl.c — the cuda backend's collectives (device.h: fy_dev_coll_*): NCCL, loaded
 * with dlopen when a job of several processes first asks for it, so the binary needs
 * NCCL only where it runs data parallel on GPUs. One communicator per device, over the
 * job's ranks (its id made by rank 0 and sent to the others over MPI, engine/comm).
 *
 * Sums: ncclAllReduce with ncclSum on the stream given. NCCL's ring adds in an order of
 * its own: two ranks give a + b, the same bits as one process accumulating, more ranks
 * agree to float rounding (unlike the cpu backend's rank-order sums). */
#include <dlfcn.h>
#include <nccl.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "engine/device/cuda/cuda_impl.h"

#define NCCL_FUNCS(X)                                                                           \
    X(ncclResult_t, ncclGetUniqueId, (ncclUniqueId *))                                          \
    X(ncclResult_t, ncclCommInitRank, (ncclComm_t *, int, ncclUniqueId, int))                   \
    X(ncclResult_t, ncclAllReduce, (const void *, void *, size_t, ncclDataType_t, ncclRedOp_t,  \
                                    ncclComm_t, cudaStream_t))                                  \
    X(ncclResult_t, ncclCommDestroy, (ncclComm_t))                                              \
    X(const char *, ncclGetErrorString, (ncclResult_t))

static struct {
#define NCCL_FIELD(ret, name, args) ret(*name) args;
    NCCL_FUNCS(NCCL_FIELD)
#undef NCCL_FIELD
} nc;

static pthread_once_t nc_once = PTHREAD_ONCE_INIT;
static fy_status nc_status = FY_ERR_UNSUPPORTED;
static char nc_error[256];

static void nc_load(void) {
    static const char *names[] = {"libnccl.so.2", FY_CUDA_LIBDIR "/libnccl.so.2"};
    void *h = NULL;
    for (size_t i = 0; i < sizeof names / sizeof *names && !h; i++)
        h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(nc_error, sizeof nc_error, "cannot load NCCL (libnccl.so.2): %s", dlerror());
        return;
    }
#define NCCL_SYM(ret, name, args)                                                          \
    if (!(*(void **)&nc.name = dlsym(h, #name))) {                                         \
        snprintf(nc_error, sizeof nc_error, "NCCL lacks %s", #name);                       \
        return;                                                                            \
    }
    NCCL_FUNCS(NCCL_SYM)
#undef NCCL_SYM
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
    return FY_OK;
}

void fy_cu_nccl_free(fy_cu_dev *cd) {
    if (cd->nccl) nc.ncclCommDestroy((ncclComm_t)cd->nccl);
    cd->nccl = NULL;
}

void fy_cu_nccl_sum(fy_cu_dev *cd, fy_cu_stream *cs, void *buf, size_t n, fy_dtype dt) {
    FY_ASSERT(cd->nccl, "a device collective before fy_dev_coll_init");
    const ncclDataType_t t = dt == FY_BF16 ? ncclBfloat16 : dt == FY_F32 ? ncclFloat32 : ncclFloat64;
    fy_status st = nc_check(nc.ncclAllReduce(buf, buf, n, t, ncclSum, (ncclComm_t)cd->nccl, cs->st),
                            "ncclAllReduce");
    FY_ASSERT(st == FY_OK, "an NCCL sum cannot be undone: the job's ranks disagree now");
}
