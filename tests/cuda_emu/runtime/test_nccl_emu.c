/* test_nccl_emu.c — the emulated NCCL (nccl_emu.cc, nccl_dev.cc) against the runtime's
 * stand-in (nccl_standin.c): ranks are processes forked by the test, the id passed to
 * them through a pipe, each rank's verdict sent back through another.
 *
 * What ferry relies on (cuda_nccl.c): grouped ncclReduce to each shard's owner and
 * ncclBroadcast from it, shards of unequal sizes and longer than a staging buffer, fp32 and
 * bf16, in place: two ranks give the rank-order sum a + b bit for bit; three ranks NCCL's
 * ring order (from the rank after the root around to it, bf16 rounded at each addition).
 * The misuses caught: collectives issued in a different order on two ranks (ncclInvalidUsage
 * as both ranks' asynchronous error, one line naming both calls), a peer killed
 * (ncclRemoteError within seconds), ranks disagreeing on their number, a lone rank
 * (ncclCommInitRank fails after its timeout), bad arguments, a buffer freed before its
 * collective ran, calls on a destroyed communicator, ncclCommDestroy on a failed device
 * (an error, not a wait for ever). Nothing stays in /dev/shm. */
#include <criterion/criterion.h>

#include <dirent.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <nccl.h>

#include "engine/core/dtype.h"
#include "tests/cuda_emu/runtime/nccl_standin.h"

#define NRANKS_MAX 4

TestSuite(nccl_emu, .timeout = 120);

typedef struct verdict {
    int said; /* 1 once the rank wrote it */
    int ok;
    int code; /* what a rank's part returns to the test, if anything */
    char detail[500];
} verdict;

/* A rank's part of a test: given the id rank 0 made, it fails *v with why. */
typedef void (*rank_fn)(const ncclUniqueId *id, int rank, int nranks, verdict *v);

static void failf(verdict *v, const char *fmt, ...) {
    if (!v->ok) return;
    v->ok = 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(v->detail, sizeof v->detail, fmt, ap);
    va_end(ap);
}
#define CHECK(v, cond, ...)                                                                      \
    do {                                                                                         \
        if (!(cond)) {                                                                           \
            failf(v, __VA_ARGS__);                                                               \
            return;                                                                              \
        }                                                                                        \
    } while (0)

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static bool io_full(int fd, void *p, size_t n, bool wr) {
    for (size_t o = 0; o < n;) {
        ssize_t k = wr ? write(fd, (char *)p + o, n - o) : read(fd, (char *)p + o, n - o);
        if (k <= 0) return false;
        o += (size_t)k;
    }
    return true;
}

/* Runs fn on nranks processes; out[r]: rank r's verdict (said 0 if it ended without one).
 * Returns rank 0's pid, in whose name the communicator's segment is. */
static pid_t run_ranks(int nranks, rank_fn fn, verdict *out) {
    int idp[2], res[NRANKS_MAX][2];
    pid_t pid[NRANKS_MAX];
    cr_assert_eq(pipe(idp), 0);
    for (int r = 0; r < nranks; r++) cr_assert_eq(pipe(res[r]), 0);
    for (int r = 0; r < nranks; r++) {
        pid[r] = fork();
        cr_assert_geq(pid[r], 0);
        if (pid[r]) continue;
        /* a rank left waiting for a failed one ends with the test */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() == 1) _exit(1);
        for (int q = 0; q < nranks; q++) {
            close(res[q][0]);
            if (q != r) close(res[q][1]);
        }
        ncclUniqueId id;
        verdict v = {1, 1, 0, ""};
        if (r == 0) {
            if (ncclGetUniqueId(&id) != ncclSuccess) failf(&v, "ncclGetUniqueId failed");
            for (int q = 1; q < nranks; q++) io_full(idp[1], &id, sizeof id, true);
        } else if (!io_full(idp[0], &id, sizeof id, false)) {
            failf(&v, "rank %d got no id", r);
        }
        if (v.ok) fn(&id, r, nranks, &v);
        io_full(res[r][1], &v, sizeof v, true);
        _exit(0);
    }
    close(idp[0]);
    close(idp[1]);
    bool failed = false;
    for (int r = 0; r < nranks; r++) {
        close(res[r][1]);
        memset(&out[r], 0, sizeof out[r]);
        if (failed) snprintf(out[r].detail, sizeof out[r].detail, "killed: an earlier rank failed");
        else if (!io_full(res[r][0], &out[r], sizeof out[r], false)) out[r].said = 0;
        close(res[r][0]);
        /* the others may be waiting for it for ever */
        if (out[r].said && !out[r].ok && !failed) {
            failed = true;
            for (int q = r + 1; q < nranks; q++) kill(pid[q], SIGKILL);
        }
    }
    for (int r = 0; r < nranks; r++) waitpid(pid[r], NULL, 0);
    return pid[0];
}

/* Segments in /dev/shm of communicators whose id process pid made. */
static int shm_left(pid_t pid) {
    char prefix[64];
    snprintf(prefix, sizeof prefix, "fy-nccl-%d-", (int)pid);
    DIR *d = opendir("/dev/shm");
    int n = 0;
    for (struct dirent *e; d && (e = readdir(d));) n += !strncmp(e->d_name, prefix, strlen(prefix));
    if (d) closedir(d);
    return n;
}

static void expect_ok(const verdict *v, int nranks) {
    for (int r = 0; r < nranks; r++) {
        cr_expect(v[r].said, "rank %d ended without a verdict", r);
        cr_expect(v[r].ok, "rank %d: %s", r, v[r].detail);
    }
}

/* ---- reduce and broadcast by shard, as fy_cu_nccl_shards ------------------------------ */

#define SHARD_N ((size_t)2600000) /* elements: the first shard spans 2 staging buffers */

/* Rank r's element i: signs and exponents vary, so sums round. */
static float input(int rank, size_t i) {
    uint64_t s = 0x9e3779b97f4a7c15ull * (uint64_t)(rank + 1) ^ (0xbf58476d1ce4e5b9ull * (i + 1));
    s ^= s >> 31;
    s *= 0x94d049bb133111ebull;
    s ^= s >> 29;
    return (s & 1 ? -1.0f : 1.0f) * ldexpf(1.0f + (float)(s >> 40) / 16777216.0f, (int)((s >> 8) % 16) - 8);
}

static float elem(ncclDataType_t t, const void *p, size_t i) {
    return t == ncclFloat32 ? ((const float *)p)[i] : fy_bf16_to_f32(((const uint16_t *)p)[i]);
}

/* The sum NCCL's reduce to root gives: two ranks, rank order (a + b); more, the ring from
 * the rank after the root around to it, each addition rounded to t. */
static float expected_sum(ncclDataType_t t, int nranks, int root, size_t i) {
    float x[NRANKS_MAX] = {0};
    for (int q = 0; q < nranks; q++) {
        x[q] = input(q, i);
        if (t == ncclBfloat16) x[q] = fy_bf16_to_f32(fy_f32_to_bf16(x[q]));
    }
    if (nranks == 2) {
        float sum = x[0] + x[1];
        return t == ncclBfloat16 ? fy_bf16_to_f32(fy_f32_to_bf16(sum)) : sum;
    }
    float acc = x[(root + 1) % nranks];
    for (int j = 2; j <= nranks; j++) {
        acc += x[(root + j) % nranks];
        if (t == ncclBfloat16) acc = fy_bf16_to_f32(fy_f32_to_bf16(acc));
    }
    return acc;
}

/* Shard q's first element: unequal sizes. */
static size_t shard_off(int q, int nranks) {
    return q == 0 ? 0 : q == nranks ? SHARD_N : SHARD_N * (size_t)(2 * q + 1) / (size_t)(2 * nranks + 1);
}

static void shards(const ncclUniqueId *id, int rank, int nranks, ncclDataType_t t, verdict *v) {
    ncclComm_t comm;
    ncclResult_t r = ncclCommInitRank(&comm, nranks, *id, rank);
    CHECK(v, r == ncclSuccess, "rank %d: ncclCommInitRank: %s", rank, ncclGetErrorString(r));
    CHECK(v, standin_taken() == (size_t)(nranks == 2 ? 544 : 688) << 20, "rank %d charged %zu bytes",
          rank, standin_taken());
    if (rank == 0) CHECK(v, shm_left(getpid()) == 0, "the segment is still linked after init");
    const size_t es = t == ncclFloat32 ? 4 : 2;
    char *buf = standin_dev_alloc(SHARD_N * es);
    for (size_t i = 0; i < SHARD_N; i++) {
        if (t == ncclFloat32) ((float *)buf)[i] = input(rank, i);
        else ((uint16_t *)buf)[i] = fy_f32_to_bf16(input(rank, i));
    }
    for (int pass = 0; pass < 2; pass++) { /* reduce-scatter, then all-gather */
        CHECK(v, ncclGroupStart() == ncclSuccess, "ncclGroupStart");
        for (int q = 0; q < nranks; q++) {
            char *p = buf + shard_off(q, nranks) * es;
            size_t n = shard_off(q + 1, nranks) - shard_off(q, nranks);
            r = pass ? ncclBroadcast(p, p, n, t, q, comm, NULL) : ncclReduce(p, p, n, t, ncclSum, q, comm, NULL);
            CHECK(v, r == ncclSuccess, "rank %d, shard %d: %s", rank, q, ncclGetErrorString(r));
        }
        CHECK(v, ncclGroupEnd() == ncclSuccess, "ncclGroupEnd");
        /* the broadcasts are still queued: ncclCommDestroy completes them first */
        if (pass) CHECK(v, ncclCommDestroy(comm) == ncclSuccess, "ncclCommDestroy");
        CHECK(v, standin_sync() == cudaSuccess, "a collective failed");
        for (int q = pass ? 0 : rank; q < (pass ? nranks : rank + 1); q++) {
            for (size_t i = shard_off(q, nranks); i < shard_off(q + 1, nranks); i++) {
                float got = elem(t, buf, i), want = expected_sum(t, nranks, q, i);
                CHECK(v, !memcmp(&got, &want, 4), "rank %d after the %s: element %zu (shard %d) is "
                      "%a, not %a", rank, pass ? "broadcasts" : "reduces", i, q, got, want);
            }
        }
    }
    CHECK(v, standin_taken() == 0, "rank %d still holds %zu device bytes", rank, standin_taken());
}

static void shards_f32(const ncclUniqueId *id, int rank, int n, verdict *v) { shards(id, rank, n, ncclFloat32, v); }
static void shards_bf16(const ncclUniqueId *id, int rank, int n, verdict *v) { shards(id, rank, n, ncclBfloat16, v); }

Test(nccl_emu, two_ranks_reduce_and_broadcast_fp32_shards, .timeout = 120) {
    verdict v[2];
    pid_t p0 = run_ranks(2, shards_f32, v);
    expect_ok(v, 2);
    cr_expect_eq(shm_left(p0), 0, "a segment left in /dev/shm");
}

Test(nccl_emu, two_ranks_reduce_and_broadcast_bf16_shards, .timeout = 120) {
    verdict v[2];
    pid_t p0 = run_ranks(2, shards_bf16, v);
    expect_ok(v, 2);
    cr_expect_eq(shm_left(p0), 0, "a segment left in /dev/shm");
}

Test(nccl_emu, three_ranks_sum_in_nccl_ring_order, .timeout = 120) {
    verdict v[3];
    pid_t p0 = run_ranks(3, shards_bf16, v);
    expect_ok(v, 3);
    p0 = run_ranks(3, shards_f32, v);
    expect_ok(v, 3);
    cr_expect_eq(shm_left(p0), 0, "a segment left in /dev/shm");
}

/* ---- misuses between ranks -------------------------------------------------------------- */

/* Polls comm's asynchronous error for up to 10 s; returns it. */
static ncclResult_t poll_async(ncclComm_t comm, double *waited) {
    const double t0 = now_s();
    ncclResult_t e = ncclSuccess;
    while (e == ncclSuccess && now_s() - t0 < 10) {
        if (ncclCommGetAsyncError(comm, &e) != ncclSuccess) return ncclInternalError;
        if (e == ncclSuccess) usleep(10000);
    }
    *waited = now_s() - t0;
    return e;
}

/* Two reduces in one group, issued in one order on rank 0 and the other on rank 1. */
static void swapped_order(const ncclUniqueId *id, int rank, int nranks, verdict *v) {
    ncclComm_t comm;
    CHECK(v, ncclCommInitRank(&comm, nranks, *id, rank) == ncclSuccess, "ncclCommInitRank");
    float *buf = standin_dev_alloc(2000 * sizeof(float));
    ncclGroupStart();
    for (int k = 0; k < 2; k++) {
        int q = k ^ rank; /* rank 0: shard 0 then 1; rank 1: shard 1 then 0 */
        CHECK(v, ncclReduce(buf + 1000 * q, buf + 1000 * q, 1000 - 300 * (size_t)q, ncclFloat32,
                            ncclSum, q, comm, NULL) == ncclSuccess, "ncclReduce");
    }
    CHECK(v, ncclGroupEnd() == ncclSuccess, "ncclGroupEnd");
    double waited;
    ncclResult_t e = poll_async(comm, &waited);
    CHECK(v, e == ncclInvalidUsage, "rank %d's asynchronous error after %.1f s: %s", rank, waited,
          ncclGetErrorString(e));
    char theirs[64];
    snprintf(theirs, sizeof theirs, "rank %d's ncclReduce #1 (count %d", 1 - rank, rank ? 1000 : 700);
    const char *rep = standin_reports();
    CHECK(v, strstr(rep, "does not match") && strstr(rep, theirs), "rank %d reported: %s", rank, rep);
    CHECK(v, ncclCommAbort(comm) == ncclSuccess, "ncclCommAbort");
    CHECK(v, standin_sync() == cudaSuccess, "the aborted collective failed its stream");
    CHECK(v, ncclReduce(buf, buf, 10, ncclFloat32, ncclSum, 0, comm, NULL) == ncclInvalidUsage,
          "a reduce on an aborted communicator");
}

Test(nccl_emu, collectives_in_different_orders_are_caught_on_both_ranks, .timeout = 60) {
    verdict v[2];
    pid_t p0 = run_ranks(2, swapped_order, v);
    expect_ok(v, 2);
    cr_expect_eq(shm_left(p0), 0, "a segment left in /dev/shm");
}

/* Rank 1 is killed once the communicator is made; rank 0's reduce waits for it. */
static void peer_killed(const ncclUniqueId *id, int rank, int nranks, verdict *v) {
    ncclComm_t comm;
    CHECK(v, ncclCommInitRank(&comm, nranks, *id, rank) == ncclSuccess, "ncclCommInitRank");
    if (rank == 1) raise(SIGKILL);
    float *buf = standin_dev_alloc(100 * sizeof(float));
    CHECK(v, ncclReduce(buf, buf, 100, ncclFloat32, ncclSum, 0, comm, NULL) == ncclSuccess, "ncclReduce");
    double waited;
    ncclResult_t e = poll_async(comm, &waited);
    CHECK(v, e == ncclRemoteError, "the asynchronous error after %.1f s: %s", waited, ncclGetErrorString(e));
    CHECK(v, waited < 5, "the dead peer was seen after %.1f s", waited);
    CHECK(v, strstr(standin_reports(), "rank 1 is gone"), "reported: %s", standin_reports());
    CHECK(v, ncclCommAbort(comm) == ncclSuccess, "ncclCommAbort");
    CHECK(v, standin_sync() == cudaSuccess, "the aborted collective failed its stream");
}

Test(nccl_emu, a_killed_peer_gives_a_remote_error, .timeout = 60) {
    verdict v[2];
    pid_t p0 = run_ranks(2, peer_killed, v);
    cr_expect(v[0].said && v[0].ok, "rank 0: %s", v[0].detail);
    cr_expect(!v[1].said, "rank 1 was not killed");
    cr_expect_eq(shm_left(p0), 0, "a segment left in /dev/shm");
}

/* Rank 1 says the communicator has 3 ranks; rank 0, 2. Whichever comes second is refused
 * at once; the first waits for the others until its timeout. */
static void nranks_differ(const ncclUniqueId *id, int rank, int nranks, verdict *v) {
    ncclComm_t comm;
    const double t0 = now_s();
    ncclResult_t r = ncclCommInitRank(&comm, rank ? 3 : 2, *id, rank);
    v->code = r;
    if (r == ncclInvalidArgument)
        CHECK(v, strstr(standin_reports(), "the rank that created it said"), "%s", standin_reports());
    else
        CHECK(v, r == ncclSystemError && now_s() - t0 < 5, "rank %d: %s after %.1f s", rank,
              ncclGetErrorString(r), now_s() - t0);
    CHECK(v, standin_taken() == 0, "rank %d still holds %zu device bytes", rank, standin_taken());
}

Test(nccl_emu, ranks_that_disagree_on_their_number_fail_init, .timeout = 60) {
    setenv("FY_NCCL_EMU_INIT_S", "1", 1);
    verdict v[2];
    pid_t p0 = run_ranks(2, nranks_differ, v);
    expect_ok(v, 2);
    cr_expect_eq(v[0].code + v[1].code, ncclInvalidArgument + ncclSystemError, "ranks returned %d and %d",
                 v[0].code, v[1].code);
    cr_expect_eq(shm_left(p0), 0, "a segment left in /dev/shm");
}

/* One process of a 2-rank communicator: init fails after FY_NCCL_EMU_INIT_S. */
static void alone(const ncclUniqueId *id, int rank, int nranks, verdict *v) {
    ncclComm_t comm;
    const double t0 = now_s();
    ncclResult_t r = ncclCommInitRank(&comm, 2, *id, 0);
    CHECK(v, r == ncclSystemError, "%s", ncclGetErrorString(r));
    CHECK(v, now_s() - t0 >= 1 && now_s() - t0 < 5, "gave up after %.1f s", now_s() - t0);
    CHECK(v, comm == NULL, "a communicator from a failed init");
}

Test(nccl_emu, a_lone_rank_times_out, .timeout = 60) {
    setenv("FY_NCCL_EMU_INIT_S", "1", 1);
    verdict v[1];
    pid_t p0 = run_ranks(1, alone, v);
    expect_ok(v, 1);
    cr_expect_eq(shm_left(p0), 0, "a segment left in /dev/shm");
}

/* ---- one rank: arguments and the communicator's life ------------------------------------ */

static ncclComm_t one_rank(void) {
    ncclUniqueId id;
    ncclComm_t comm = NULL;
    cr_assert_eq(ncclGetUniqueId(&id), ncclSuccess);
    cr_assert_eq(ncclCommInitRank(&comm, 1, id, 0), ncclSuccess);
    return comm;
}

Test(nccl_emu, bad_arguments_are_refused) {
    ncclComm_t comm = one_rank(), none = NULL;
    float *d = standin_dev_alloc(1024 * sizeof(float)), host[16];
    ncclUniqueId id, zero;
    memset(&zero, 0, sizeof zero);
    cr_assert_eq(ncclGetUniqueId(&id), ncclSuccess);
    cr_expect_eq(ncclCommInitRank(&none, 2, id, 2), ncclInvalidArgument, "rank 2 of 2");
    cr_expect_eq(ncclCommInitRank(&none, 0, id, 0), ncclInvalidArgument, "0 ranks");
    cr_expect_eq(ncclCommInitRank(NULL, 1, id, 0), ncclInvalidArgument, "no comm");
    cr_expect_eq(ncclCommInitRank(&none, 1, zero, 0), ncclInvalidArgument, "a foreign id");
    cr_expect_eq(ncclReduce(d, d, 16, ncclFloat32, ncclSum, 1, comm, NULL), ncclInvalidArgument, "root 1 of 1");
    cr_expect_eq(ncclReduce(d, d, 16, (ncclDataType_t)ncclNumTypes, ncclSum, 0, comm, NULL), ncclInvalidArgument);
    cr_expect_eq(ncclReduce(d, d, 16, ncclFloat32, (ncclRedOp_t)ncclNumOps, 0, comm, NULL), ncclInvalidArgument);
    cr_expect_eq(ncclReduce(d, d, 16, ncclInt32, ncclSum, 0, comm, NULL), ncclInvalidArgument, "not emulated");
    cr_expect_eq(ncclReduce(d, d, 16, ncclFloat32, ncclSum, 0, NULL, NULL), ncclInvalidArgument, "no comm");
    cr_expect_eq(ncclReduce(host, host, 16, ncclFloat32, ncclSum, 0, comm, NULL), ncclInvalidArgument, "host memory");
    cr_expect_eq(ncclBroadcast(d, d, 1025, ncclFloat32, 0, comm, NULL), ncclInvalidArgument, "past the end");
    cr_expect_eq(ncclBroadcast(d, d + 8, 16, ncclFloat32, 0, comm, NULL), ncclInvalidArgument, "overlapping");
    cr_expect_eq(ncclBroadcast(NULL, NULL, 0, ncclFloat32, 0, comm, NULL), ncclSuccess, "an empty broadcast");
    cr_expect_eq(ncclGroupEnd(), ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
    /* an error inside a group fails its end, and none of its calls runs */
    cr_expect_eq(ncclGroupStart(), ncclSuccess);
    cr_expect_eq(ncclReduce(d, d, 16, ncclFloat32, ncclSum, 0, comm, NULL), ncclSuccess);
    cr_expect_eq(ncclReduce(d, d, 16, ncclFloat32, ncclSum, 3, comm, NULL), ncclInvalidArgument);
    cr_expect_eq(ncclGroupEnd(), ncclInvalidArgument);
    /* NCCL's 2048 calls a group; one group on two streams (not emulated); init in a group */
    cr_expect_eq(ncclGroupStart(), ncclSuccess);
    for (int k = 0; k < 2048; k++) cr_assert_eq(ncclReduce(d, d, 1, ncclFloat32, ncclSum, 0, comm, NULL), ncclSuccess);
    cr_expect_eq(ncclReduce(d, d, 1, ncclFloat32, ncclSum, 0, comm, NULL), ncclInvalidUsage, "call 2049");
    cr_expect_eq(ncclGroupEnd(), ncclInvalidUsage);
    cr_expect_eq(ncclGroupStart(), ncclSuccess);
    cr_expect_eq(ncclReduce(d, d, 16, ncclFloat32, ncclSum, 0, comm, (cudaStream_t)0x10), ncclSuccess);
    cr_expect_eq(ncclReduce(d, d, 16, ncclFloat32, ncclSum, 0, comm, (cudaStream_t)0x20), ncclSuccess);
    cr_expect_eq(ncclGroupEnd(), ncclInvalidUsage, "a group on two streams");
    cr_expect_eq(ncclGroupStart(), ncclSuccess);
    cr_expect_eq(ncclCommInitRank(&none, 1, id, 0), ncclInvalidUsage, "init inside a group");
    cr_expect_eq(ncclGroupEnd(), ncclSuccess);
    ncclResult_t e;
    cr_expect_eq(ncclCommGetAsyncError(comm, NULL), ncclInvalidArgument);
    cr_expect_eq(ncclCommGetAsyncError(comm, &e), ncclSuccess);
    cr_expect_eq(e, ncclSuccess);
    cr_expect_eq(ncclCommDestroy(comm), ncclSuccess);
    cr_expect_eq(standin_sync(), cudaSuccess);
    cr_expect_eq(ncclReduce(d, d, 16, ncclFloat32, ncclSum, 0, comm, NULL), ncclInvalidUsage, "after destroy");
    cr_expect_eq(ncclCommGetAsyncError(comm, &e), ncclInvalidUsage, "after destroy");
    cr_expect_eq(ncclCommDestroy(comm), ncclInvalidUsage, "destroyed twice");
    cr_expect_eq(ncclCommAbort(comm), ncclInvalidUsage, "aborted after destroy");
    cr_expect_eq(ncclCommDestroy(NULL), ncclSuccess);
    cr_expect_eq(standin_taken(), 0);
}

/* A device function that holds the stand-in's device until *arg's flag is set. */
static volatile int released;
static cudaError_t hold(void *args) {
    (void)args;
    while (!released) usleep(1000);
    return cudaSuccess;
}

Test(nccl_emu, a_buffer_freed_before_its_collective_runs_faults) {
    ncclComm_t comm = one_rank();
    float *d = standin_dev_alloc(64 * sizeof(float));
    char unused = 0;
    cr_assert_eq(fy_emu_enqueue(NULL, hold, &unused, 1, "hold"), cudaSuccess);
    cr_assert_eq(ncclBroadcast(d, d, 64, ncclFloat32, 0, comm, NULL), ncclSuccess);
    standin_dev_free(d);
    released = 1;
    cr_expect_eq(standin_sync(), cudaErrorIllegalAddress);
    ncclResult_t e;
    cr_assert_eq(ncclCommGetAsyncError(comm, &e), ncclSuccess);
    cr_expect_eq(e, ncclUnhandledCudaError);
    cr_expect(strstr(standin_reports(), "not device memory when the collective runs"), "%s", standin_reports());
    cr_expect_eq(ncclCommAbort(comm), ncclSuccess);
}

static cudaError_t fault(void *args) {
    (void)args;
    return cudaErrorIllegalAddress;
}

Test(nccl_emu, destroy_after_the_device_failed_returns) {
    ncclComm_t comm = one_rank();
    float *d = standin_dev_alloc(64 * sizeof(float));
    char unused = 0;
    cr_assert_eq(fy_emu_enqueue(NULL, hold, &unused, 1, "hold"), cudaSuccess);
    cr_assert_eq(fy_emu_enqueue(NULL, fault, &unused, 1, "fault"), cudaSuccess);
    cr_assert_eq(ncclReduce(d, d, 64, ncclFloat32, ncclSum, 0, comm, NULL), ncclSuccess);
    released = 1;
    cr_expect_eq(standin_sync(), cudaErrorIllegalAddress);
    cr_expect_eq(ncclCommDestroy(comm), ncclUnhandledCudaError, "the reduce never ran");
    cr_expect_eq(standin_taken(), 0);
}

Test(nccl_emu, error_strings_and_version_are_nccls) {
    static const char *const want[ncclNumResults] = {
        "no error",
        "unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
        "unhandled system error (run with NCCL_DEBUG=INFO for details)",
        "internal error - please report this issue to the NCCL developers",
        "invalid argument (run with NCCL_DEBUG=WARN for details)",
        "invalid usage (run with NCCL_DEBUG=WARN for details)",
        "remote process exited or there was a network error",
        "NCCL operation in progress"};
    for (int r = 0; r < ncclNumResults; r++) cr_expect_str_eq(ncclGetErrorString((ncclResult_t)r), want[r]);
    cr_expect_str_eq(ncclGetErrorString(ncclNumResults), "unknown result code");
    int version = 0;
    cr_expect_eq(ncclGetVersion(&version), ncclSuccess);
    cr_expect_eq(version, NCCL_VERSION_CODE);
    cr_expect_eq(ncclGetVersion(NULL), ncclInvalidArgument);
}
