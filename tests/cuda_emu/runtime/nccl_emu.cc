/* nccl_emu.cc — PLACEHOLDER for the emulated NCCL (libnccl.so.2), so the -Dcuda=emulated
 * build links; the NCCL emulation replaces this file wholesale. Every call is
 * ncclInvalidUsage. */
#include <nccl.h>

extern "C" {

ncclResult_t ncclGetUniqueId(ncclUniqueId *) { return ncclInvalidUsage; }
ncclResult_t ncclCommInitRank(ncclComm_t *, int, ncclUniqueId, int) { return ncclInvalidUsage; }
ncclResult_t ncclCommDestroy(ncclComm_t) { return ncclInvalidUsage; }
ncclResult_t ncclReduce(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, int, ncclComm_t, cudaStream_t) {
    return ncclInvalidUsage;
}
ncclResult_t ncclBroadcast(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) {
    return ncclInvalidUsage;
}
ncclResult_t ncclGroupStart() { return ncclInvalidUsage; }
ncclResult_t ncclGroupEnd() { return ncclInvalidUsage; }
const char *ncclGetErrorString(ncclResult_t r) { return r == ncclSuccess ? "no error" : "invalid usage (NCCL is not emulated yet)"; }

} /* extern "C" */
