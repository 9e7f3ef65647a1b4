/* nccl_dev.h — the emulated NCCL's two halves (emu_rt.h): the host half, libnccl.so.2
 * (nccl_emu.cc), and the device half, nccl_dev.cc in libfy_cudart_emu.so, which runs in
 * each rank's emulated-device process as the work fy_emu_enqueue queued.
 *
 * The ranks of a communicator meet in one POSIX shared-memory segment, named in the
 * ncclUniqueId: a header, one slot per rank, then one staging buffer per rank. Each
 * rank's host process and device process map it; it is unlinked once every rank's two
 * processes have, so a killed job leaves nothing in /dev/shm.
 *
 * Invariants of the segment:
 *   - a slot is written by its own rank's processes only; every other rank reads it;
 *   - its counters (host_in, dev_in, step, done) only grow, so a condition on them that
 *     held once holds until the communicator ends;
 *   - whoever changes anything rings the bell (fy_nccl_ring), on which every waiter of
 *     every process sleeps (a futex on shared memory);
 *   - a rank's device runs its collectives one at a time, in the order the host issued
 *     them (call.seq 1, 2, ...), each rank's n-th against every other rank's n-th. */
#ifndef FY_NCCL_DEV_H
#define FY_NCCL_DEV_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FY_NCCL_ID_MAGIC 0x64692d6c6363636eull  /* the first 8 bytes of our ncclUniqueId */
#define FY_NCCL_SEG_MAGIC 0x6765732d6c63636eull /* a segment whose header is written */
#define FY_NCCL_NAME_MAX 64                     /* a segment's name, with its NUL */
/* One rank's staging buffer: NCCL_BUFFSIZE's default, the buffer a rank of a real NCCL
 * ring exchanges a collective through, a chunk at a time. */
#define FY_NCCL_STAGE_NBYTES ((size_t)4 << 20)

typedef enum fy_nccl_kind {
    FY_NCCL_JOIN = 1,  /* map the segment in the device's process (ncclCommInitRank) */
    FY_NCCL_LEAVE,     /* unmap it there (ncclCommDestroy, ncclCommAbort) */
    FY_NCCL_REDUCE,    /* ncclReduce */
    FY_NCCL_BROADCAST, /* ncclBroadcast */
    FY_NCCL_PROBE,     /* nothing: its fy_emu_enqueue says whether the device still works */
} fy_nccl_kind;

/* A slot's state. */
typedef enum fy_nccl_state {
    FY_NCCL_OUT = 0, /* not joined yet */
    FY_NCCL_IN,      /* joined */
    FY_NCCL_LEFT,    /* destroyed its communicator (ncclCommDestroy) */
    FY_NCCL_ABORTED, /* aborted it (ncclCommAbort) */
    FY_NCCL_FAILED,  /* its device met an error in a collective and left it */
} fy_nccl_state;

/* One collective as its rank issued it: what every rank's n-th must agree on. */
typedef struct fy_nccl_call {
    uint64_t seq;   /* 1, 2, ... on each rank; 0: none yet */
    int32_t kind;   /* FY_NCCL_REDUCE or FY_NCCL_BROADCAST */
    int32_t dtype;  /* ncclDataType_t */
    int32_t op;     /* ncclRedOp_t (ncclSum for a broadcast, which has none) */
    int32_t root;
    uint64_t count; /* elements */
} fy_nccl_call;

/* One rank's part of the segment. The host process writes host_pid, host_in and state
 * (join, destroy, abort); the device process the rest, and state FY_NCCL_FAILED. */
typedef struct fy_nccl_slot {
    int32_t host_pid, dev_pid;
    uint32_t host_in, dev_in; /* 1 once that process mapped the segment */
    int32_t state;            /* fy_nccl_state */
    int32_t err;              /* ncclResult_t: the asynchronous error its device met */
    fy_nccl_call call;        /* the collective its device is in (or was in last) */
    uint32_t step;            /* barriers its device passed */
    uint32_t pad;             /* done's alignment, written by nobody */
    uint64_t done;            /* seq of the last collective its device completed */
} fy_nccl_slot;

/* The segment's header; nranks slots follow it, then the staging buffers. */
typedef struct fy_nccl_seg {
    uint64_t magic;  /* FY_NCCL_SEG_MAGIC, written last by the rank that created it */
    int32_t nranks;
    uint32_t bell;   /* the futex every waiter sleeps on */
} fy_nccl_seg;

/* Rank r's slot; the bytes of a segment of nranks; rank r's staging buffer (page-aligned). */
static inline fy_nccl_slot *fy_nccl_slot_of(fy_nccl_seg *s, int r) {
    return (fy_nccl_slot *)(s + 1) + r;
}
static inline size_t fy_nccl_stage_off(int nranks) {
    size_t head = sizeof(fy_nccl_seg) + (size_t)nranks * sizeof(fy_nccl_slot);
    return (head + 4095) & ~(size_t)4095;
}
static inline size_t fy_nccl_seg_nbytes(int nranks) {
    return fy_nccl_stage_off(nranks) + (size_t)nranks * FY_NCCL_STAGE_NBYTES;
}
static inline char *fy_nccl_stage(fy_nccl_seg *s, int r) {
    return (char *)s + fy_nccl_stage_off(s->nranks) + (size_t)r * FY_NCCL_STAGE_NBYTES;
}

/* The arguments of fy_emu_nccl_dev (copied by fy_emu_enqueue). */
typedef struct fy_nccl_args {
    char name[FY_NCCL_NAME_MAX]; /* the communicator's segment */
    int32_t kind;                /* fy_nccl_kind */
    int32_t rank;
    fy_nccl_call call;           /* REDUCE, BROADCAST: the collective */
    const void *sendbuff;
    void *recvbuff;
} fy_nccl_args;

/* The device half: runs args (fy_nccl_args) in the device's process. A collective
 * returns cudaSuccess when it completed or its communicator was aborted; one that does
 * not match the other ranks', or whose peer is gone, sets the rank's asynchronous error
 * and waits for ncclCommAbort, as a hung NCCL kernel does; a buffer that is no longer
 * device memory gives cudaErrorIllegalAddress. */
cudaError_t fy_emu_nccl_dev(void *args);

/* ---- shared by the two halves --------------------------------------------------- */

/* What fy_nccl_wait found. */
typedef enum fy_nccl_met {
    FY_NCCL_MET,     /* every rank got there */
    FY_NCCL_STOPPED, /* this rank's communicator was aborted or destroyed meanwhile */
    FY_NCCL_GONE,    /* rank *who is gone: its process ended, it aborted, or it failed */
    FY_NCCL_QUIT,    /* rank *who destroyed its communicator instead of getting there */
    FY_NCCL_LATE,    /* the deadline passed before rank *who got there */
} fy_nccl_met;

/* Waits until every rank's 32-bit counter at byte offset `field` of its slot (host_in,
 * dev_in, step) reached target, watching meanwhile this rank's state and every late
 * rank's processes (every 100 ms). deadline_s: CLOCK_MONOTONIC seconds, 0 for none.
 * Callable from both processes, any thread. */
fy_nccl_met fy_nccl_wait(fy_nccl_seg *s, int self, size_t field, uint32_t target,
                         double deadline_s, int *who);

/* Wakes every waiter after a change to the segment. */
void fy_nccl_ring(fy_nccl_seg *s);

/* Sleeps until the bell rings past `seen` (read before the condition slept on was found
 * false), at most sec seconds. */
void fy_nccl_sleep(fy_nccl_seg *s, uint32_t seen, double sec);

/* CLOCK_MONOTONIC in seconds. */
double fy_nccl_now(void);

/* NCCL's names of a data type and a reduction ("ncclFloat32", "ncclSum"), "?" if none;
 * a data type's bytes, 0 if none. */
const char *fy_nccl_dtype_name(int dtype);
const char *fy_nccl_op_name(int op);
size_t fy_nccl_dtype_size(int dtype);

#ifdef __cplusplus
}
#endif
#endif
