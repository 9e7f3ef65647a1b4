/* comm.c — the job's processes and the ordered collectives over MPI (comm.h). */
#include "engine/comm/comm.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/core/util.h"

#ifdef FY_HAVE_MPI
#include <mpi.h>
#endif
#ifdef FY_HAVE_NUMA
#include <numa.h>
#endif

/* Collectives move at most this many bytes a message (MPI counts are int). */
#define PIECE_NBYTES ((size_t)16 << 20)

struct fy_comm {
    int rank, size, local_rank, local_size;
    bool mpi;                /* this process started MPI */
    bool multiple;           /* MPI_THREAD_MULTIPLE: the watchdog may call MPI_Abort while
                                a lane waits inside MPI */
    void *tmp;               /* a receive buffer, PIECE_NBYTES */
    void *acc;               /* reduce_scatter's running sum, PIECE_NBYTES */
    /* the watchdog: the start of the collective in progress (0: none) */
    _Atomic double busy_since_ms;
    double timeout_ms;
    pthread_t watchdog;
    bool watching;
    atomic_bool stop;
    atomic_bool patient;     /* fy_comm_patient: waits are not timed */
#ifdef FY_HAVE_MPI
    MPI_Comm node;           /* the ranks of this node */
    bool has_node;
#endif
};

void fy_comm_patient(fy_comm *c, bool on) { atomic_store(&c->patient, on); }

#ifdef FY_HAVE_MPI
/* A collective starts or progresses: the watchdog's clock (re)starts, unless patient. */
static void arm(fy_comm *c) {
    atomic_store(&c->busy_since_ms, atomic_load(&c->patient) ? 0.0 : fy_now_ms());
}

/* The collective is over: nothing to time. */
static void disarm(fy_comm *c) { atomic_store(&c->busy_since_ms, 0.0); }

/* The length of the piece at i0 of a range ending at end, pieces of at most per. */
static size_t piece(size_t i0, size_t end, size_t per) { return end - i0 < per ? end - i0 : per; }
#endif

/* The launcher's world size and rank from its environment (-1: no launcher). */
static int env_int(const char *const *names) {
    for (int i = 0; names[i]; i++) {
        const char *v = getenv(names[i]);
        if (v && *v) {
            char *end;
            long x = strtol(v, &end, 10);
            if (*end == '\0' && x >= 0 && x < (1 << 24)) return (int)x;
        }
    }
    return -1;
}

static const char *const size_vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE",
                                        "SLURM_NTASKS", NULL};
#ifdef FY_HAVE_MPI
static const char *const local_vars[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                                         "SLURM_LOCALID", NULL};
static const char *const local_size_vars[] = {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                                              "SLURM_NTASKS_PER_NODE", NULL};
#endif

/* A world of this process alone, without MPI. */
static fy_status single(fy_comm **out) {
    fy_comm *c = calloc(1, sizeof *c);
    if (!c) return FY_ERR_NOMEM;
    c->size = c->local_size = 1;
    *out = c;
    return FY_OK;
}

#ifdef FY_HAVE_MPI
static void *watch(void *arg) {
    fy_comm *c = arg;
    while (!atomic_load(&c->stop)) {
        usleep(200 * 1000);
        const double t0 = atomic_load(&c->busy_since_ms);
        if (t0 > 0 && fy_now_ms() - t0 > c->timeout_ms) {
            fy_log_error("a collective has waited %.0f s for the other ranks (one failed or "
                         "stalled; FERRY_COMM_TIMEOUT): ending the job", c->timeout_ms / 1e3);
            fflush(stderr);
            /* a second thread in MPI only where the library allows it; else the exit of
             * this rank ends the job (the launcher stops the others) */
            if (c->multiple) MPI_Abort(MPI_COMM_WORLD, 1);
            _exit(1);
        }
    }
    return NULL;
}

static fy_status mpi_check(int rc, const char *what) {
    if (rc == MPI_SUCCESS) return FY_OK;
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    fy_log_error("MPI %s failed: %.*s", what, len, msg);
    return FY_ERR_IO;
}
#endif

fy_status fy_comm_init(fy_comm **out) {
    *out = NULL;
    const int size = env_int(size_vars);
    if (size <= 1) return single(out);
#ifndef FY_HAVE_MPI
    fy_log_error("started as one of %d processes, but this build has no MPI (install "
                 "libopenmpi-dev and rebuild)", size);
    return FY_ERR_UNSUPPORTED;
#else
    fy_comm *c = calloc(1, sizeof *c);
    if (!c) return FY_ERR_NOMEM;
    int provided = 0;
    /* the trainer's lanes call MPI from one thread at a time; MULTIPLE, where the library
     * has it, lets the watchdog abort while a lane waits */
    if (MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS) {
        fy_log_error("MPI failed to start (launched as one of %d processes)", size);
        free(c);
        return FY_ERR_IO;
    }
    c->mpi = true;
    c->multiple = provided >= MPI_THREAD_MULTIPLE;
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    MPI_Comm_rank(MPI_COMM_WORLD, &c->rank);
    MPI_Comm_size(MPI_COMM_WORLD, &c->size);
    /* this node's ranks: the processes that share memory with this one (the launcher's
     * variables as a fallback) */
    fy_status st = FY_OK;
    if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, c->rank, MPI_INFO_NULL,
                            &c->node) == MPI_SUCCESS) {
        c->has_node = true;
        MPI_Comm_rank(c->node, &c->local_rank);
        MPI_Comm_size(c->node, &c->local_size);
    } else {
        c->local_rank = env_int(local_vars);
        if (c->local_rank < 0) c->local_rank = c->rank;
        c->local_size = env_int(local_size_vars);
        if (c->local_size <= c->local_rank) c->local_size = c->size;
    }
    if (provided < MPI_THREAD_SERIALIZED) {
        fy_log_error("MPI gives thread level %d; ferry needs MPI_THREAD_SERIALIZED", provided);
        st = FY_ERR_UNSUPPORTED;
    }
    if (st == FY_OK && (!(c->tmp = malloc(PIECE_NBYTES)) || !(c->acc = malloc(PIECE_NBYTES))))
        st = FY_ERR_NOMEM;
    const char *to = getenv("FERRY_COMM_TIMEOUT");
    c->timeout_ms = (to && atof(to) > 0 ? atof(to) : 600.0) * 1e3;
    if (st == FY_OK && pthread_create(&c->watchdog, NULL, watch, c) == 0) c->watching = true;
    if (st != FY_OK) {
        fy_comm_free(c);
        return st;
    }
    *out = c;
    return FY_OK;
#endif
}

void fy_comm_free(fy_comm *c) {
    if (!c) return;
#ifdef FY_HAVE_MPI
    if (c->watching) {
        atomic_store(&c->stop, true);
        pthread_join(c->watchdog, NULL);
    }
    if (c->has_node) MPI_Comm_free(&c->node);
    if (c->mpi) MPI_Finalize();
#endif
    free(c->tmp);
    free(c->acc);
    free(c);
}

int fy_comm_rank(const fy_comm *c) { return c->rank; }
int fy_comm_size(const fy_comm *c) { return c->size; }
int fy_comm_local_rank(const fy_comm *c) { return c->local_rank; }
int fy_comm_local_size(const fy_comm *c) { return c->local_size; }

/* "a-b" runs of a CPU list into buf. */
static void cpu_list(const int *cpus, int n, char *buf, size_t cap) {
    size_t len = 0;
    buf[0] = 0;
    for (int i = 0; i < n && len < cap; i++) {
        int j = i;
        while (j + 1 < n && cpus[j + 1] == cpus[j] + 1) j++;
        len += (size_t)snprintf(buf + len, cap - len, "%s%d", i ? "," : "", cpus[i]);
        if (j > i && len < cap) len += (size_t)snprintf(buf + len, cap - len, "-%d", cpus[j]);
        i = j;
    }
}

static int node_of(int cpu) {
#ifdef FY_HAVE_NUMA
    if (numa_available() >= 0) {
        const int n = numa_node_of_cpu(cpu);
        return n >= 0 ? n : 0;
    }
#endif
    (void)cpu;
    return 0;
}

void fy_comm_place(const fy_comm *c, char *desc, size_t cap) {
    snprintf(desc, cap, "not placed (one process)");
    if (c->size <= 1) return;
    const char *env = getenv("FERRY_PLACE");
    if (env && !strcmp(env, "0")) {
        snprintf(desc, cap, "not placed (FERRY_PLACE=0)");
        return;
    }
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) != 0) {
        snprintf(desc, cap, "not placed (its CPUs unknown)");
        return;
    }
    int mine[CPU_SETSIZE], all[CPU_SETSIZE];
    int nall = 0, n = 0;
    for (int i = 0; i < CPU_SETSIZE; i++) if (CPU_ISSET(i, &set)) all[nall++] = i;
    const long online = sysconf(_SC_NPROCESSORS_ONLN);
    int nodes = 1;
#ifdef FY_HAVE_NUMA
    if (numa_available() >= 0) nodes = numa_max_node() + 1;
#endif
    /* bound by the launcher: the node's ranks were given different CPUs (kept as they
     * are); the same set (a container's, the machine's) is theirs to share out */
    bool bound = nall < online;
#ifdef FY_HAVE_MPI
    if (c->has_node) {
        uint64_t h = 1469598103934665603ull; /* FNV-1a of the CPU set */
        for (int i = 0; i < nall; i++) h = (h ^ (uint64_t)all[i]) * 1099511628211ull;
        uint64_t lo = h, hi = h;
        if (MPI_Allreduce(MPI_IN_PLACE, &lo, 1, MPI_UINT64_T, MPI_MIN, c->node) == MPI_SUCCESS &&
            MPI_Allreduce(MPI_IN_PLACE, &hi, 1, MPI_UINT64_T, MPI_MAX, c->node) == MPI_SUCCESS)
            bound = lo != hi;
    }
#endif
    int node = nall ? node_of(all[0]) : 0;
    if (!bound) {
        const int L = c->local_size, i = c->local_rank;
        node = (int)((long)i * nodes / L);
        int idx = 0, m = 0; /* this rank among the local ranks on its node */
        for (int r = 0; r < L; r++)
            if ((long)r * nodes / L == node) { idx += r < i; m++; }
        int ncpu = 0;
        for (int k = 0; k < nall; k++) if (node_of(all[k]) == node) all[ncpu++] = all[k];
        if (ncpu == 0) { /* no CPU of ours on that node: share them all */
            for (int k = 0; k < CPU_SETSIZE; k++) if (CPU_ISSET(k, &set)) all[ncpu++] = k;
        }
        const int lo = (int)((long)idx * ncpu / m), hi = (int)((long)(idx + 1) * ncpu / m);
        CPU_ZERO(&set);
        if (hi > lo) for (int k = lo; k < hi; k++) CPU_SET(all[k], &set);
        else CPU_SET(all[lo < ncpu ? lo : ncpu - 1], &set); /* more ranks than CPUs: shared */
        if (sched_setaffinity(0, sizeof set, &set) != 0) {
            snprintf(desc, cap, "not placed (the system refused its CPUs)");
            return;
        }
    }
    for (int i = 0; i < CPU_SETSIZE; i++) if (CPU_ISSET(i, &set)) mine[n++] = i;
#ifdef FY_HAVE_NUMA
    if (nodes > 1) numa_set_preferred(node);
#endif
    char list[256];
    cpu_list(mine, n, list, sizeof list);
    snprintf(desc, cap, "cpus %s, NUMA node %d of %d%s", list, node, nodes,
             bound ? " (bound by the launcher)" : "");
}

_Noreturn void fy_comm_abort(fy_comm *c, int code) {
    fflush(stdout);
    fflush(stderr);
#ifdef FY_HAVE_MPI
    if (c && c->mpi) MPI_Abort(MPI_COMM_WORLD, code);
#endif
    _exit(code);
}

#ifdef FY_HAVE_MPI
static size_t elem_size(fy_dtype dt) { return dt == FY_BF16 ? 2 : dt == FY_F32 ? 4 : 8; }

/* acc[i] += add[i], in the type's arithmetic (comm.h). */
static void add_into(void *acc, const void *add, size_t n, fy_dtype dt) {
    if (dt != FY_COMM_F64) {
        fy_add_n(dt, acc, add, n);
        return;
    }
    double *x = acc;
    const double *y = add;
    for (size_t i = 0; i < n; i++) x[i] = x[i] + y[i];
}
#endif

fy_status fy_comm_sum(fy_comm *c, void *buf, size_t n, fy_dtype dt) {
    if (c->size == 1 || n == 0) return FY_OK;
#ifndef FY_HAVE_MPI
    (void)buf;
    (void)dt;
    return FY_ERR_UNSUPPORTED;
#else
    FY_ASSERT(dt == FY_F32 || dt == FY_BF16 || dt == FY_COMM_F64, "fy_comm_sum: a type it sums");
    const size_t es = elem_size(dt), per = PIECE_NBYTES / es;
    arm(c);
    fy_status st = FY_OK;
    for (size_t i0 = 0; i0 < n && st == FY_OK; i0 += per) {
        const size_t k = piece(i0, n, per);
        char *p = (char *)buf + i0 * es;
        if (c->rank == 0) {
            for (int r = 1; r < c->size && st == FY_OK; r++) {
                st = mpi_check(MPI_Recv(c->tmp, (int)(k * es), MPI_BYTE, r, 0, MPI_COMM_WORLD,
                                        MPI_STATUS_IGNORE), "receive");
                if (st == FY_OK) add_into(p, c->tmp, k, dt);
                arm(c); /* it moves: no stall */
            }
        } else {
            st = mpi_check(MPI_Send(p, (int)(k * es), MPI_BYTE, 0, 0, MPI_COMM_WORLD), "send");
        }
        if (st == FY_OK) st = mpi_check(MPI_Bcast(p, (int)(k * es), MPI_BYTE, 0, MPI_COMM_WORLD), "broadcast");
        arm(c);
    }
    disarm(c);
    return st;
#endif
}

fy_status fy_comm_bcast(fy_comm *c, void *buf, size_t nbytes) {
    if (c->size == 1 || nbytes == 0) return FY_OK;
#ifndef FY_HAVE_MPI
    (void)buf;
    return FY_ERR_UNSUPPORTED;
#else
    arm(c);
    fy_status st = FY_OK;
    for (size_t o = 0; o < nbytes && st == FY_OK; o += PIECE_NBYTES) {
        const size_t k = piece(o, nbytes, PIECE_NBYTES);
        st = mpi_check(MPI_Bcast((char *)buf + o, (int)k, MPI_BYTE, 0, MPI_COMM_WORLD), "broadcast");
    }
    disarm(c);
    return st;
#endif
}

fy_status fy_comm_attach(fy_comm *c, fy_dev *dev) {
    if (c->size == 1 || !fy_dev_has_collectives(dev)) return FY_OK;
    unsigned char id[FY_COLL_ID_BYTES] = {0};
    size_t len = 0;
    int32_t failed = c->rank == 0 && fy_dev_coll_id(dev, id, sizeof id, &len) != FY_OK;
    FY_TRY(fy_comm_max_i32(c, &failed));
    if (failed) return FY_ERR_UNSUPPORTED; /* rank 0 said why */
    uint64_t n = len;
    FY_TRY(fy_comm_bcast(c, &n, sizeof n));
    FY_TRY(fy_comm_bcast(c, id, sizeof id));
    return fy_dev_coll_init(dev, id, (size_t)n, c->rank, c->size);
}

fy_status fy_comm_max_i32(fy_comm *c, int32_t *x) {
    if (c->size == 1) return FY_OK;
#ifndef FY_HAVE_MPI
    return FY_ERR_UNSUPPORTED;
#else
    arm(c);
    fy_status st = mpi_check(MPI_Allreduce(MPI_IN_PLACE, x, 1, MPI_INT32_T, MPI_MAX, MPI_COMM_WORLD),
                             "allreduce");
    disarm(c);
    return st;
#endif
}

fy_status fy_comm_agree(fy_comm *c, fy_status st) {
    if (!c || c->size == 1) return st;
    int32_t failed = st != FY_OK;
    FY_TRY(fy_comm_max_i32(c, &failed));
    return !failed ? FY_OK : st != FY_OK ? st : FY_ERR_INVALID;
}

#ifdef FY_HAVE_MPI
/* Sends this rank's copy of every other rank's shard to its owner, PIECE_NBYTES a
 * message; *reqs (free it) holds the sends to wait for. */
static fy_status post_shards(fy_comm *c, const char *buf, const size_t *off, size_t es,
                             MPI_Request **reqs, int *nreqs) {
    const size_t per = PIECE_NBYTES / es;
    size_t n = 0;
    for (int q = 0; q < c->size; q++)
        if (q != c->rank) n += (off[q + 1] - off[q] + per - 1) / per;
    *nreqs = 0;
    *reqs = malloc((n ? n : 1) * sizeof **reqs);
    if (!*reqs) return FY_ERR_NOMEM;
    for (int q = 0; q < c->size; q++) {
        if (q == c->rank) continue;
        for (size_t i0 = off[q]; i0 < off[q + 1]; i0 += per) {
            const size_t k = piece(i0, off[q + 1], per);
            FY_TRY(mpi_check(MPI_Isend(buf + i0 * es, (int)(k * es), MPI_BYTE, q, 1, MPI_COMM_WORLD,
                                       &(*reqs)[(*nreqs)++]), "send"));
        }
    }
    return FY_OK;
}
#endif

fy_status fy_comm_reduce_scatter(fy_comm *c, void *buf, const size_t *off, fy_dtype dt) {
    if (c->size == 1) return FY_OK;
#ifndef FY_HAVE_MPI
    (void)buf;
    (void)off;
    (void)dt;
    return FY_ERR_UNSUPPORTED;
#else
    FY_ASSERT(dt == FY_F32 || dt == FY_BF16 || dt == FY_COMM_F64, "reduce_scatter: a type it sums");
    const size_t es = elem_size(dt), per = PIECE_NBYTES / es;
    arm(c);
    MPI_Request *reqs = NULL;
    int nreqs = 0;
    fy_status st = post_shards(c, buf, off, es, &reqs, &nreqs);
    /* this rank's shard, a piece at a time: (((x0 + x1) + x2) + ...), its own value added
     * in its turn (an addition is commutative, so acc + own is own + acc's bits) */
    for (size_t i0 = off[c->rank]; i0 < off[c->rank + 1] && st == FY_OK; i0 += per) {
        const size_t k = piece(i0, off[c->rank + 1], per);
        char *own = (char *)buf + i0 * es;
        void *acc = c->rank == 0 ? own : c->acc;
        for (int q = 0; q < c->size && st == FY_OK; q++) {
            if (q == c->rank) {
                if (q) add_into(acc, own, k, dt);
                continue;
            }
            void *into = q == 0 ? acc : c->tmp;
            st = mpi_check(MPI_Recv(into, (int)(k * es), MPI_BYTE, q, 1, MPI_COMM_WORLD,
                                    MPI_STATUS_IGNORE), "receive");
            if (st == FY_OK && q) add_into(acc, c->tmp, k, dt);
            arm(c); /* it moves: no stall */
        }
        if (st == FY_OK && acc != own) memcpy(own, acc, k * es);
    }
    if (nreqs && st == FY_OK)
        st = mpi_check(MPI_Waitall(nreqs, reqs, MPI_STATUSES_IGNORE), "send");
    free(reqs);
    disarm(c);
    return st;
#endif
}

fy_status fy_comm_allgather(fy_comm *c, void *buf, const size_t *off, size_t es) {
    if (c->size == 1) return FY_OK;
#ifndef FY_HAVE_MPI
    (void)buf;
    (void)off;
    (void)es;
    return FY_ERR_UNSUPPORTED;
#else
    const size_t per = PIECE_NBYTES / es;
    arm(c);
    fy_status st = FY_OK;
    for (int q = 0; q < c->size && st == FY_OK; q++)
        for (size_t i0 = off[q]; i0 < off[q + 1] && st == FY_OK; i0 += per) {
            const size_t k = piece(i0, off[q + 1], per);
            st = mpi_check(MPI_Bcast((char *)buf + i0 * es, (int)(k * es), MPI_BYTE, q, MPI_COMM_WORLD),
                           "broadcast");
            arm(c);
        }
    disarm(c);
    return st;
#endif
}

fy_status fy_comm_allgather_records(fy_comm *c, void *buf, size_t each) {
    if (c->size == 1) return FY_OK;
    size_t *off = malloc(((size_t)c->size + 1) * sizeof *off);
    if (!off) return FY_ERR_NOMEM;
    for (int r = 0; r <= c->size; r++) off[r] = (size_t)r * each;
    const fy_status st = fy_comm_allgather(c, buf, off, 1);
    free(off);
    return st;
}

fy_status fy_comm_gather(fy_comm *c, void *whole, const void *mine, const size_t *off, size_t es) {
    const size_t own = (off[c->rank + 1] - off[c->rank]) * es;
    if (c->rank == 0 && own && (char *)whole + off[0] * es != (const char *)mine)
        memcpy((char *)whole + off[0] * es, mine, own);
    if (c->size == 1) return FY_OK;
#ifndef FY_HAVE_MPI
    return FY_ERR_UNSUPPORTED;
#else
    const size_t per = PIECE_NBYTES / es;
    arm(c);
    fy_status st = FY_OK;
    if (c->rank == 0) {
        for (int q = 1; q < c->size && st == FY_OK; q++)
            for (size_t i0 = off[q]; i0 < off[q + 1] && st == FY_OK; i0 += per) {
                const size_t k = piece(i0, off[q + 1], per);
                st = mpi_check(MPI_Recv((char *)whole + i0 * es, (int)(k * es), MPI_BYTE, q, 2,
                                        MPI_COMM_WORLD, MPI_STATUS_IGNORE), "receive");
                arm(c);
            }
    } else {
        for (size_t i0 = 0; i0 < own && st == FY_OK; i0 += per * es) {
            const size_t k = piece(i0, own, per * es);
            st = mpi_check(MPI_Send((const char *)mine + i0, (int)k, MPI_BYTE, 0, 2, MPI_COMM_WORLD),
                           "send");
            arm(c);
        }
    }
    disarm(c);
    return st;
#endif
}

/* ---- the sharded collectives' backends (comm.h: fy_coll) ------------------------------- */

static fy_status mpi_reduce_scatter(void *ctx, fy_stream *s, void *buf, const size_t *off, fy_dtype dt) {
    if (s) fy_stream_sync(s); /* the buffer's writers' work, waited for on the stream */
    return fy_comm_reduce_scatter(ctx, buf, off, dt);
}

static fy_status mpi_allgather(void *ctx, fy_stream *s, void *buf, const size_t *off, fy_dtype dt) {
    if (s) fy_stream_sync(s);
    return fy_comm_allgather(ctx, buf, off, fy_dtype_size(dt));
}

static fy_status dev_reduce_scatter(void *ctx, fy_stream *s, void *buf, const size_t *off, fy_dtype dt) {
    fy_coll_reduce_scatter_async(s, buf, off, fy_comm_size(ctx), dt);
    return FY_OK;
}

static fy_status dev_allgather(void *ctx, fy_stream *s, void *buf, const size_t *off, fy_dtype dt) {
    fy_coll_allgather_async(s, buf, off, fy_comm_size(ctx), dt);
    return FY_OK;
}

static const fy_coll_iface mpi_coll = {"mpi", false, mpi_reduce_scatter, mpi_allgather};
static const fy_coll_iface dev_coll = {"device", true, dev_reduce_scatter, dev_allgather};

fy_coll fy_comm_coll(fy_comm *c, const fy_dev *dev, fy_mem_kind kind) {
    /* the cpu backend has no collectives of its own: its device memory goes over MPI */
    const bool device = kind == FY_MEM_DEVICE && fy_dev_has_collectives(dev);
    return (fy_coll){device ? &dev_coll : &mpi_coll, c};
}
