/* cpu_backend.c — the cpu backend's memory, streams, events and copies.
 *
 * Memory: every allocation is an anonymous mapping, advised to use huge pages and
 * pre-touched (zeroed) by the kernel threads, so first use pays no page faults.
 * Device memory is host memory; the capacity cap is enforced by device.c.
 *
 * Streams: each stream is a worker thread draining a bounded ring of fy_ops in order.
 * A full ring blocks the submitter (back-pressure). The worker sets its OpenMP thread
 * count to the device's, so kernels run with a fixed thread count (determinism).
 *
 * Emulated PCIe: with sim_pcie_gbps set, each direction (H2D, D2H) is one link. A copy
 * books the link from max(now, link free) for nbytes / bandwidth and its stream sleeps
 * until the booking ends; concurrent copies in one direction thus share the bandwidth,
 * copies in opposite directions overlap (full duplex), as on a real PCIe link.
 *
 * Events: a generation counter; record bumps "recorded" at submission and sets "done"
 * (and the time) when the worker reaches it; a wait captures the recorded generation at
 * submission. */
#include <errno.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine/core/util.h"
#include "engine/device/device_impl.h"

#define RING_CAP 1024

typedef struct cpu_dev {
    int threads;
    double gbps;
    double slowdown;        /* kernels: sleep (slowdown - 1) x their time after each */
    pthread_mutex_t link_mu;
    double link_free_ms[2]; /* per direction: when the emulated link is next free */
} cpu_dev;

typedef struct cpu_stream {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv_work, cv_space, cv_done;
    fy_op ring[RING_CAP];
    size_t head, tail;       /* ring indices: ops [head, tail) are queued */
    uint64_t submitted, completed;
    bool stop;
    fy_dev *dev;
} cpu_stream;

typedef struct cpu_event {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t recorded, done;
    double done_ms;          /* fy_now_ms() when the worker reached the latest record */
} cpu_event;

/* ---- memory ---------------------------------------------------------------------- */

static fy_status cpu_alloc(fy_dev *dev, fy_mem_kind kind, size_t nbytes, void **out) {
    cpu_dev *cd = dev->ctx;
    fy_status st = fy_host_map(nbytes, cd->threads, out);
    return st == FY_OK || kind != FY_MEM_DEVICE ? st : FY_ERR_DEVICE_OOM;
}

static void cpu_release(fy_dev *dev, fy_mem_kind kind, void *ptr, size_t nbytes) {
    fy_host_unmap(ptr, nbytes);
}

/* ---- emulated link --------------------------------------------------------------- */

static void sleep_until_ms(double t_ms) {
    struct timespec ts = {(time_t)(t_ms / 1e3), (long)((t_ms - (double)(time_t)(t_ms / 1e3) * 1e3) * 1e6)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {}
}

static void do_copy(cpu_dev *cd, void *dst, const void *src, size_t nbytes, int dir) {
    if ((dir == FY_H2D || dir == FY_D2H) && cd->gbps > 0) {
        double dur_ms = (double)nbytes / (cd->gbps * 1e9) * 1e3;
        pthread_mutex_lock(&cd->link_mu);
        double now = fy_now_ms();
        double start = cd->link_free_ms[dir] > now ? cd->link_free_ms[dir] : now;
        double end = start + dur_ms;
        cd->link_free_ms[dir] = end;
        pthread_mutex_unlock(&cd->link_mu);
        memmove(dst, src, nbytes);
        sleep_until_ms(end);
        return;
    }
    memmove(dst, src, nbytes);
}

/* ---- streams --------------------------------------------------------------------- */

static void exec_op(cpu_stream *cs, const fy_op *op) {
    cpu_dev *cd = cs->dev->ctx;
    switch (op->kind) {
    case FY_OP_COPY:
        do_copy(cd, op->p[0], op->p[1], (size_t)op->i[0], (int)op->i[1]);
        break;
    case FY_OP_MEMSET:
        memset(op->p[0], (int)op->i[1], (size_t)op->i[0]);
        break;
    case FY_OP_HOST_FN: {
        void (*fn)(void *);
        memcpy(&fn, &op->p[0], sizeof fn);
        fn(op->p[1]);
        break;
    }
    case FY_OP_EVENT_RECORD: {
        cpu_event *ce = op->p[0];
        uint64_t gen = (uint64_t)op->i[0];
        pthread_mutex_lock(&ce->mu);
        if (ce->done < gen) {
            ce->done = gen;
            ce->done_ms = fy_now_ms();
        }
        pthread_cond_broadcast(&ce->cv);
        pthread_mutex_unlock(&ce->mu);
        break;
    }
    case FY_OP_EVENT_WAIT: {
        cpu_event *ce = op->p[0];
        uint64_t gen = (uint64_t)op->i[0];
        pthread_mutex_lock(&ce->mu);
        while (ce->done < gen) pthread_cond_wait(&ce->cv, &ce->mu);
        pthread_mutex_unlock(&ce->mu);
        break;
    }
    default: {
        const cpu_dev *cd = cs->dev->ctx;
        const double t0 = cd->slowdown > 1.0 ? fy_now_ms() : 0.0;
        if (op->dt == FY_BF16) fy_cpu_exec_bf16(op);
        else fy_cpu_exec(op);
        if (cd->slowdown > 1.0) {
            const double extra_ms = (fy_now_ms() - t0) * (cd->slowdown - 1.0);
            if (extra_ms > 0) usleep((useconds_t)(extra_ms * 1e3));
        }
    }
    }
}

static void *worker_main(void *arg) {
    cpu_stream *cs = arg;
    cpu_dev *cd = cs->dev->ctx;
    omp_set_num_threads(cd->threads);
    pthread_mutex_lock(&cs->mu);
    for (;;) {
        while (cs->head == cs->tail && !cs->stop) pthread_cond_wait(&cs->cv_work, &cs->mu);
        if (cs->head == cs->tail && cs->stop) break;
        fy_op op = cs->ring[cs->head % RING_CAP];
        pthread_mutex_unlock(&cs->mu);
        exec_op(cs, &op);
        pthread_mutex_lock(&cs->mu);
        cs->head++;
        cs->completed++;
        pthread_cond_signal(&cs->cv_space);
        pthread_cond_broadcast(&cs->cv_done);
    }
    pthread_mutex_unlock(&cs->mu);
    return NULL;
}

static void cpu_launch(fy_stream *s, const fy_op *op) {
    cpu_stream *cs = s->ctx;
    pthread_mutex_lock(&cs->mu);
    while (cs->tail - cs->head == RING_CAP) pthread_cond_wait(&cs->cv_space, &cs->mu);
    cs->ring[cs->tail % RING_CAP] = *op;
    cs->tail++;
    cs->submitted++;
    pthread_cond_signal(&cs->cv_work);
    pthread_mutex_unlock(&cs->mu);
}

static fy_status cpu_stream_new(fy_stream *s) {
    cpu_stream *cs = calloc(1, sizeof *cs);
    if (!cs) return FY_ERR_NOMEM;
    cs->dev = s->dev;
    pthread_mutex_init(&cs->mu, NULL);
    pthread_cond_init(&cs->cv_work, NULL);
    pthread_cond_init(&cs->cv_space, NULL);
    pthread_cond_init(&cs->cv_done, NULL);
    if (pthread_create(&cs->thread, NULL, worker_main, cs) != 0) {
        fy_log_error("cannot start the worker thread of stream %s", s->name);
        free(cs);
        return FY_ERR_NOMEM;
    }
    s->ctx = cs;
    return FY_OK;
}

static void cpu_stream_sync(fy_stream *s) {
    cpu_stream *cs = s->ctx;
    pthread_mutex_lock(&cs->mu);
    uint64_t target = cs->submitted;
    while (cs->completed < target) pthread_cond_wait(&cs->cv_done, &cs->mu);
    pthread_mutex_unlock(&cs->mu);
}

static void cpu_stream_free(fy_stream *s) {
    cpu_stream *cs = s->ctx;
    pthread_mutex_lock(&cs->mu);
    cs->stop = true;
    pthread_cond_signal(&cs->cv_work);
    pthread_mutex_unlock(&cs->mu);
    pthread_join(cs->thread, NULL);
    pthread_mutex_destroy(&cs->mu);
    pthread_cond_destroy(&cs->cv_work);
    pthread_cond_destroy(&cs->cv_space);
    pthread_cond_destroy(&cs->cv_done);
    free(cs);
}

/* ---- events ---------------------------------------------------------------------- */

static fy_status cpu_event_new(fy_event *e) {
    cpu_event *ce = calloc(1, sizeof *ce);
    if (!ce) return FY_ERR_NOMEM;
    pthread_mutex_init(&ce->mu, NULL);
    pthread_cond_init(&ce->cv, NULL);
    e->ctx = ce;
    return FY_OK;
}

static void cpu_event_free(fy_event *e) {
    cpu_event *ce = e->ctx;
    pthread_mutex_destroy(&ce->mu);
    pthread_cond_destroy(&ce->cv);
    free(ce);
}

static void cpu_event_record(fy_event *e, fy_stream *s) {
    cpu_event *ce = e->ctx;
    pthread_mutex_lock(&ce->mu);
    uint64_t gen = ++ce->recorded;
    pthread_mutex_unlock(&ce->mu);
    cpu_launch(s, &(fy_op){.kind = FY_OP_EVENT_RECORD, .p = {ce}, .i = {(int64_t)gen}});
}

static void cpu_stream_wait_event(fy_stream *s, fy_event *e) {
    cpu_event *ce = e->ctx;
    pthread_mutex_lock(&ce->mu);
    uint64_t gen = ce->recorded;
    pthread_mutex_unlock(&ce->mu);
    cpu_launch(s, &(fy_op){.kind = FY_OP_EVENT_WAIT, .p = {ce}, .i = {(int64_t)gen}});
}

static void cpu_event_sync(fy_event *e) {
    cpu_event *ce = e->ctx;
    pthread_mutex_lock(&ce->mu);
    while (ce->done < ce->recorded) pthread_cond_wait(&ce->cv, &ce->mu);
    pthread_mutex_unlock(&ce->mu);
}

static bool cpu_event_done(fy_event *e) {
    cpu_event *ce = e->ctx;
    pthread_mutex_lock(&ce->mu);
    bool done = ce->done >= ce->recorded;
    pthread_mutex_unlock(&ce->mu);
    return done;
}

static double cpu_event_elapsed_ms(fy_event *from, fy_event *to) {
    cpu_event *a = from->ctx, *b = to->ctx;
    pthread_mutex_lock(&a->mu);
    double ta = a->done_ms;
    pthread_mutex_unlock(&a->mu);
    pthread_mutex_lock(&b->mu);
    double tb = b->done_ms;
    pthread_mutex_unlock(&b->mu);
    return tb - ta;
}

static void cpu_free(fy_dev *dev) {
    cpu_dev *cd = dev->ctx;
    pthread_mutex_destroy(&cd->link_mu);
    free(cd);
}

static const fy_dev_iface cpu_iface = {
    .name = "cpu",
    .dtypes = 1u << FY_F32 | 1u << FY_BF16,
    .free = cpu_free,
    .alloc = cpu_alloc,
    .release = cpu_release,
    .stream_new = cpu_stream_new,
    .stream_free = cpu_stream_free,
    .stream_sync = cpu_stream_sync,
    .launch = cpu_launch,
    .event_new = cpu_event_new,
    .event_free = cpu_event_free,
    .event_record = cpu_event_record,
    .stream_wait_event = cpu_stream_wait_event,
    .event_sync = cpu_event_sync,
    .event_done = cpu_event_done,
    .event_elapsed_ms = cpu_event_elapsed_ms,
};

void openblas_set_num_threads(int num_threads);

fy_status fy_cpu_dev_init(fy_dev *dev) {
    cpu_dev *cd = calloc(1, sizeof *cd);
    if (!cd) return FY_ERR_NOMEM;
    const int ncpu = fy_cpus_allowed(); /* the cores this process may run on */
    cd->threads = dev->cfg.threads > 0 ? dev->cfg.threads : ncpu;
    cd->gbps = dev->cfg.sim_pcie_gbps;
    cd->slowdown = dev->cfg.sim_slowdown;
    pthread_mutex_init(&cd->link_mu, NULL);
    openblas_set_num_threads(cd->threads);
    dev->iface = &cpu_iface;
    dev->ctx = cd;
    dev->threads = cd->threads;
    char cap[32] = "no cap";
    if (dev->cfg.mem_cap_nbytes) fy_fmt_size(dev->cfg.mem_cap_nbytes, cap, sizeof cap);
    if (cd->gbps > 0)
        snprintf(dev->name, sizeof dev->name, "cpu (%d threads, %s, PCIe emulated at %.3g GB/s)",
                 cd->threads, cap, cd->gbps);
    else
        snprintf(dev->name, sizeof dev->name, "cpu (%d threads, %s)", cd->threads, cap);
    return FY_OK;
}
