/* cudart_emu_event.cc — events of the emulated runtime (cudart_emu.h).
 *
 * A record queues a marker on the stream (cudart_emu_stream.cc) and makes the event
 * refer to it: (the stream, the marker's number), and which record it is (gen). The
 * marker notes the time it ran when it is still the event's latest record. So a wait
 * (cudaStreamWaitEvent) waits for the latest record as of the call, a synchronisation
 * or query looks at the latest record, and a re-record is pending again.
 *
 * cudaEventSynchronize spins (a busy loop, as CUDA documents) unless the event was made
 * with cudaEventBlockingSync. A wait for an event never recorded orders nothing (CUDA
 * returns at once): reported, and in strict mode (FERRY_EMU_STRICT, the default)
 * cudaErrorIllegalState, because in ferry it means a dependency that orders nothing.
 * Elapsed times need timing on both events (else cudaErrorInvalidResourceHandle) and
 * both records done (else cudaErrorNotReady). An event is recorded on streams of the
 * device current at its creation only (one context, as CUDA's). A destroyed event is
 * cudaErrorInvalidResourceHandle; a record still queued keeps its structure alive. */
#include "tests/cuda_emu/runtime/cudart_emu.h"

#include <stdlib.h>
#include <time.h>


typedef struct emu_event {
    unsigned flags;
    int dev;                           /* the device current at its creation */
    pthread_mutex_t mu;
    emu_stream *st;                    /* the latest record's stream (a reference); NULL: never */
    uint64_t seq;                      /* its marker's number there */
    uint64_t gen;                      /* records so far */
    double t_ms;                       /* when the marker of record t_gen ran */
    uint64_t t_gen;
    std::atomic<int> refs;
} emu_event;

static emu_handles<emu_event> live_events;

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static void event_put(emu_event *ev) {
    if (!ev || ev->refs.fetch_sub(1) != 1) return;
    emu_stream_put(ev->st);
    pthread_mutex_destroy(&ev->mu);
    delete ev;
}

static cudaError_t get_event(cudaEvent_t e, const char *call, emu_event **out) {
    *out = live_events.get(e);
    if (*out) return cudaSuccess;
    fy_emu_report("%s: event %p is not a live event (destroyed, or never made)", call, (void *)e);
    return cudaErrorInvalidResourceHandle;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags) {
    EMU_ENTER(true, d);
    if (!event || (flags & ~(unsigned)(cudaEventBlockingSync | cudaEventDisableTiming)))
        return emu_ret(cudaErrorInvalidValue);
    emu_event *ev = new emu_event();
    ev->flags = flags;
    ev->dev = d;
    pthread_mutex_init(&ev->mu, NULL);
    ev->refs.store(1);
    live_events.add(ev);
    *event = (cudaEvent_t)ev;
    return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t *event) { return cudaEventCreateWithFlags(event, cudaEventDefault); }

cudaError_t cudaEventDestroy(cudaEvent_t event) {
    EMU_ENTER(false, d);
    (void)d;
    emu_event *ev = live_events.remove(event);
    if (!ev) {
        fy_emu_report("cudaEventDestroy: event %p is not a live event (destroyed, or never made)",
                      (void *)event);
        return emu_ret(cudaErrorInvalidResourceHandle);
    }
    event_put(ev); /* a record still queued keeps it */
    return cudaSuccess;
}

/* A record's marker: its event (a reference) and which record it is. */
typedef struct record_mark {
    emu_event *ev;
    uint64_t gen;
} record_mark;

static void record_ran(void *arg) {
    record_mark *m = (record_mark *)arg;
    pthread_mutex_lock(&m->ev->mu);
    if (m->ev->gen == m->gen) { /* still the latest record */
        m->ev->t_ms = now_ms();
        m->ev->t_gen = m->gen;
    }
    pthread_mutex_unlock(&m->ev->mu);
}

static void record_release(void *arg) {
    record_mark *m = (record_mark *)arg;
    event_put(m->ev);
    free(m);
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
    EMU_ENTER(true, d);
    emu_event *ev;
    cudaError_t e = get_event(event, "cudaEventRecord", &ev);
    if (e != cudaSuccess) return emu_ret(e);
    emu_stream *st;
    e = emu_stream_lookup(stream, d, "cudaEventRecord", &st);
    if (e == cudaSuccess && emu_stream_dev(st) != ev->dev) { /* one context, as CUDA's */
        fy_emu_report("cudaEventRecord: an event of GPU %d on a stream of GPU %d", ev->dev,
                      emu_stream_dev(st));
        emu_stream_put(st);
        e = cudaErrorInvalidResourceHandle;
    }
    if (e != cudaSuccess) {
        event_put(ev);
        return emu_ret(e);
    }
    record_mark *m = (record_mark *)malloc(sizeof *m);
    uint64_t seq;
    pthread_mutex_lock(&ev->mu);
    if (m) {
        ev->refs++;
        m->ev = ev;
        m->gen = ev->gen + 1;
    }
    e = m ? emu_stream_mark(st, record_ran, record_release, m, &seq) : cudaErrorMemoryAllocation;
    if (e == cudaSuccess) {
        ev->gen++;
        emu_stream *old = ev->st;
        emu_stream_ref(st);
        ev->st = st;
        ev->seq = seq;
        pthread_mutex_unlock(&ev->mu);
        emu_stream_put(old);
    } else {
        pthread_mutex_unlock(&ev->mu);
    }
    emu_stream_put(st);
    event_put(ev);
    return emu_ret(e);
}

/* The latest record of ev: its stream (a reference; NULL if never recorded) and number. */
static emu_stream *event_target(emu_event *ev, uint64_t *seq) {
    pthread_mutex_lock(&ev->mu);
    emu_stream *st = ev->st;
    *seq = ev->seq;
    if (st) emu_stream_ref(st);
    pthread_mutex_unlock(&ev->mu);
    return st;
}

/* A wait for an event never recorded: reported; cudaErrorIllegalState in strict mode. */
static cudaError_t never_recorded(const char *call, const void *event) {
    fy_emu_report("%s on event %p, which was never recorded: a wait that orders nothing%s", call,
                  event, g_emu.strict ? "" : " (a warning: FERRY_EMU_STRICT=0)");
    return g_emu.strict ? cudaErrorIllegalState : cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
    EMU_ENTER(true, d);
    if (flags != cudaEventWaitDefault) return emu_ret(cudaErrorInvalidValue);
    emu_event *ev;
    cudaError_t e = get_event(event, "cudaStreamWaitEvent", &ev);
    if (e != cudaSuccess) return emu_ret(e);
    emu_stream *st;
    e = emu_stream_lookup(stream, d, "cudaStreamWaitEvent", &st);
    if (e == cudaSuccess) {
        uint64_t seq;
        emu_stream *on = event_target(ev, &seq);
        if (!on) {
            e = never_recorded("cudaStreamWaitEvent", event);
        } else {
            e = emu_stream_wait_for(st, on, seq);
        }
        emu_stream_put(st);
    }
    event_put(ev);
    return emu_ret(e);
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
    EMU_ENTER(true, d);
    (void)d;
    emu_event *ev;
    cudaError_t e = get_event(event, "cudaEventSynchronize", &ev);
    if (e != cudaSuccess) return emu_ret(e);
    uint64_t seq;
    emu_stream *on = event_target(ev, &seq);
    if (!on) {
        e = never_recorded("cudaEventSynchronize", event);
    } else {
        emu_stream_wait_done(on, seq, !(ev->flags & cudaEventBlockingSync));
        e = emu_sticky(emu_stream_dev(on));
        emu_stream_put(on);
    }
    event_put(ev);
    return emu_ret(e);
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
    EMU_ENTER(true, d);
    (void)d;
    emu_event *ev;
    cudaError_t e = get_event(event, "cudaEventQuery", &ev);
    if (e != cudaSuccess) return emu_ret(e);
    uint64_t seq;
    emu_stream *on = event_target(ev, &seq);
    if (on) {
        e = emu_stream_done(on, seq) ? cudaSuccess : cudaErrorNotReady;
        if (emu_sticky(emu_stream_dev(on)) != cudaSuccess) e = emu_sticky(emu_stream_dev(on));
        emu_stream_put(on);
    }
    event_put(ev);
    return e == cudaErrorNotReady ? e : emu_ret(e);
}

cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end) {
    EMU_ENTER(true, d);
    (void)d;
    if (!ms) return emu_ret(cudaErrorInvalidValue);
    emu_event *ev[2];
    cudaError_t e = get_event(start, "cudaEventElapsedTime", &ev[0]);
    if (e != cudaSuccess) return emu_ret(e);
    e = get_event(end, "cudaEventElapsedTime", &ev[1]);
    if (e != cudaSuccess) {
        event_put(ev[0]);
        return emu_ret(e);
    }
    double t[2];
    for (int i = 0; i < 2 && e == cudaSuccess; i++) {
        uint64_t seq;
        emu_stream *on = event_target(ev[i], &seq);
        if ((ev[i]->flags & cudaEventDisableTiming) || !on) e = cudaErrorInvalidResourceHandle;
        else if (!emu_stream_done(on, seq)) e = cudaErrorNotReady;
        emu_stream_put(on);
        pthread_mutex_lock(&ev[i]->mu);
        t[i] = ev[i]->t_ms;
        pthread_mutex_unlock(&ev[i]->mu);
    }
    if (e == cudaSuccess) *ms = (float)(t[1] - t[0]);
    event_put(ev[0]);
    event_put(ev[1]);
    return e == cudaErrorNotReady ? e : emu_ret(e); /* not ready is no error */
}
