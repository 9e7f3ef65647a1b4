/* cudart_emu_stream.cc — streams and host functions of the emulated runtime
 * (cudart_emu.h); events are cudart_emu_event.cc's, on the markers this file queues.
 *
 * A stream is an in-order queue with a worker thread in the host process: the worker
 * sends each device work item to its device's process over the stream's own channel (a
 * socket whose other end a thread of the device process serves) and waits for its
 * answer, runs host functions itself, and waits for other streams where an event wait
 * says so. Items are numbered as queued (submitted); `completed` is the number of the
 * last one done. So everything is a pair (stream, number): an event's record is the
 * number of its marker on the stream it was recorded on, a wait waits for that number,
 * a synchronisation for the stream's submitted count at the call.
 *
 * The legacy default stream (NULL) is made at a device's first use of it and follows
 * CUDA's rules: its work waits for the work queued before on the device's blocking
 * streams, and their work waits for its. Non-blocking streams (what ferry makes) are
 * independent of it.
 *
 * Stream and device synchronisation spin unless the device's flags say
 * cudaDeviceScheduleBlockingSync (the CPU time CUDA's waits cost). Host functions do not
 * run after a device error (cudaLaunchHostFunc's, unlike callbacks), and may not call
 * the runtime (cudaErrorNotPermitted).
 *
 * Handles are checked against the live ones: a destroyed stream is
 * cudaErrorInvalidResourceHandle. A destroyed stream's queued work still runs (and
 * cudaDeviceSynchronize waits for it); the structure lives while anything (a queued
 * wait, an event's record) refers to it. */
#include "tests/cuda_emu/runtime/cudart_emu.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>


enum { ITEM_DEV, ITEM_HOST_FN, ITEM_MARK, ITEM_WAIT, ITEM_SYNC_FN };

typedef struct emu_item {
    struct emu_item *next;
    int kind;
    uint64_t seq;
    emu_msg msg;                       /* ITEM_DEV: the header; its arguments follow the item */
    cudaHostFn_t host_fn;              /* ITEM_HOST_FN, ITEM_MARK (the marker's), ITEM_SYNC_FN */
    void *arg;
    void (*release)(void *arg);        /* ITEM_MARK: when the item is freed */
    emu_stream *on;                    /* ITEM_WAIT: (a reference) until on's number on_seq */
    uint64_t on_seq;
    cudaError_t (*sync_fn)(emu_stream *, void *); /* ITEM_SYNC_FN, its result */
    cudaError_t *result;
} emu_item;

struct emu_stream {
    int dev;
    unsigned flags;                    /* cudaStreamDefault or cudaStreamNonBlocking */
    bool legacy;
    int fd;                            /* the channel to the device process */
    pthread_mutex_t mu;                /* the queue, submitted, error, destroyed */
    pthread_cond_t cv;                 /* work queued, or completed moved on */
    emu_item *head, *tail;
    uint64_t submitted;
    std::atomic<uint64_t> completed;
    cudaError_t error;                 /* the first error of its work since the last wait */
    bool destroyed;
    std::atomic<int> refs;
    char *stage;                       /* pinned staging (worker only) */
    emu_stream *next;                  /* the device's list */
};

static emu_handles<emu_stream> live_streams;

static void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* ---- references -------------------------------------------------------------------------- */

void emu_stream_put(emu_stream *st) {
    if (!st || st->refs.fetch_sub(1) != 1) return;
    pthread_mutex_destroy(&st->mu);
    pthread_cond_destroy(&st->cv);
    delete st;
}

void emu_stream_ref(emu_stream *st) { st->refs++; }

static void item_free(emu_item *it) {
    if (it->kind == ITEM_MARK && it->release) it->release(it->arg);
    if (it->kind == ITEM_WAIT) emu_stream_put(it->on);
    free(it);
}

int emu_stream_dev(const emu_stream *st) { return st->dev; }

bool emu_dev_spins(int d) {
    return (g_emu.gpu[d].flags.load() & cudaDeviceScheduleMask) != cudaDeviceScheduleBlockingSync;
}

/* ---- the worker ---------------------------------------------------------------------------- */

cudaError_t emu_worker_dev_work(emu_stream *st, fy_emu_dev_fn fn, const void *args, size_t nbytes,
                                const char *what) {
    emu_msg m;
    memset(&m, 0, sizeof m);
    m.fn = fn;
    m.nbytes = (uint32_t)nbytes;
    snprintf(m.what, sizeof m.what, "%s", what);
    cudaError_t e = emu_sticky(st->dev);
    if (e != cudaSuccess) return e;
    struct iovec iov[2] = {{&m, sizeof m}, {(void *)args, nbytes}};
    struct msghdr mh;
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = iov;
    mh.msg_iovlen = 2;
    int32_t reply;
    ssize_t n;
    if (sendmsg(st->fd, &mh, MSG_NOSIGNAL) == (ssize_t)(sizeof m + nbytes)) {
        while ((n = recv(st->fd, &reply, sizeof reply, 0)) < 0 && errno == EINTR) {}
        if (n == (ssize_t)sizeof reply) return (cudaError_t)reply;
    }
    char why[96];
    snprintf(why, sizeof why, "the process of GPU %d is gone", st->dev);
    emu_fail(st->dev, cudaErrorLaunchFailure, why);
    return emu_sticky(st->dev);
}

bool emu_stream_done(emu_stream *st, uint64_t seq) {
    return st->completed.load(std::memory_order_acquire) >= seq;
}

void emu_stream_wait_done(emu_stream *st, uint64_t seq, bool spin) {
    if (spin) {
        while (st->completed.load(std::memory_order_acquire) < seq) cpu_relax();
        return;
    }
    pthread_mutex_lock(&st->mu);
    while (st->completed.load() < seq) pthread_cond_wait(&st->cv, &st->mu);
    pthread_mutex_unlock(&st->mu);
}

static cudaError_t run_item(emu_stream *st, emu_item *it) {
    switch (it->kind) {
    case ITEM_DEV:
        return emu_worker_dev_work(st, it->msg.fn, it + 1, it->msg.nbytes, it->msg.what);
    case ITEM_HOST_FN:
        /* not after a device error, as CUDA's (cudaLaunchHostFunc, unlike callbacks) */
        if (emu_sticky(st->dev) != cudaSuccess) return emu_sticky(st->dev);
        emu_in_host_fn = true;
        it->host_fn(it->arg);
        emu_in_host_fn = false;
        return cudaSuccess;
    case ITEM_MARK:
        it->host_fn(it->arg);
        return cudaSuccess;
    case ITEM_WAIT:
        emu_stream_wait_done(it->on, it->on_seq, false);
        return cudaSuccess;
    case ITEM_SYNC_FN:
        *it->result = it->sync_fn(st, it->arg);
        return *it->result;
    }
    return cudaErrorInvalidValue;
}

static void *worker(void *p) {
    emu_stream *st = (emu_stream *)p;
    for (;;) {
        pthread_mutex_lock(&st->mu);
        while (!st->head && !st->destroyed) pthread_cond_wait(&st->cv, &st->mu);
        emu_item *it = st->head;
        if (it) {
            st->head = it->next;
            if (!st->head) st->tail = NULL;
        }
        pthread_mutex_unlock(&st->mu);
        if (!it) break; /* destroyed, and its work done: off the device's list */
        cudaError_t e = run_item(st, it);
        pthread_mutex_lock(&st->mu);
        if (e != cudaSuccess && st->error == cudaSuccess) st->error = e;
        st->completed.store(it->seq, std::memory_order_release);
        pthread_cond_broadcast(&st->cv);
        pthread_mutex_unlock(&st->mu);
        item_free(it);
    }
    emu_gpu *g = &g_emu.gpu[st->dev];
    pthread_mutex_lock(&g->mu);
    for (emu_stream **pp = &g->streams; *pp; pp = &(*pp)->next)
        if (*pp == st) {
            *pp = st->next;
            break;
        }
    pthread_mutex_unlock(&g->mu);
    close(st->fd);
    if (st->stage) emu_pinned_internal_free(st->stage);
    emu_stream_put(st);
    return NULL;
}

char *emu_stream_stage(emu_stream *st) {
    if (!st->stage) st->stage = (char *)emu_pinned_internal(EMU_STAGE_NBYTES);
    return st->stage;
}

/* ---- queueing ------------------------------------------------------------------------------- */

static emu_item *item_new(int kind, size_t extra) {
    emu_item *it = (emu_item *)calloc(1, sizeof *it + extra);
    if (it) it->kind = kind;
    return it;
}

/* The waits CUDA's legacy stream adds before work on st: (streams, numbers) in w, at most
 * cap, each with a reference. */
static int legacy_waits(emu_stream *st, emu_stream **w, uint64_t *seq, int cap) {
    if (!st->legacy && (st->flags & cudaStreamNonBlocking)) return 0;
    emu_gpu *g = &g_emu.gpu[st->dev];
    int n = 0;
    emu_stream *o;
    pthread_mutex_lock(&g->mu);
    for (o = g->streams; o && n < cap; o = o->next) {
        if (o == st || (!o->legacy && (o->flags & cudaStreamNonBlocking))) continue;
        if (!st->legacy && !o->legacy) continue; /* blocking streams wait for the legacy one only */
        pthread_mutex_lock(&o->mu);
        if (o->completed.load() < o->submitted) {
            o->refs++;
            w[n] = o;
            seq[n++] = o->submitted;
        }
        pthread_mutex_unlock(&o->mu);
    }
    const bool more = n == cap && o;
    pthread_mutex_unlock(&g->mu);
    if (more) { /* never a weaker order than CUDA's: stop */
        fy_emu_report("more than %d streams for the legacy default stream to wait for", cap);
        abort();
    }
    return n;
}

/* Queues it on st (taking it); its number in *seq if asked. */
static cudaError_t push(emu_stream *st, emu_item *it, uint64_t *seq) {
    if (!it) return cudaErrorMemoryAllocation;
    cudaError_t e = emu_sticky(st->dev);
    if (e != cudaSuccess) {
        item_free(it);
        return e;
    }
    emu_stream *w[64];
    uint64_t wseq[64];
    const int nw = legacy_waits(st, w, wseq, 64);
    emu_item *waits = NULL;
    for (int i = nw - 1; i >= 0; i--) {
        emu_item *wi = item_new(ITEM_WAIT, 0);
        if (!wi) abort();
        wi->on = w[i];
        wi->on_seq = wseq[i];
        wi->next = waits;
        waits = wi;
    }
    pthread_mutex_lock(&st->mu);
    if (st->destroyed) {
        pthread_mutex_unlock(&st->mu);
        for (emu_item *wi = waits, *nx; wi; wi = nx) { nx = wi->next; item_free(wi); }
        item_free(it);
        return cudaErrorInvalidResourceHandle;
    }
    for (emu_item *wi = waits, *nx; wi; wi = nx) {
        nx = wi->next;
        wi->next = NULL;
        wi->seq = ++st->submitted;
        if (st->tail) st->tail->next = wi;
        else st->head = wi;
        st->tail = wi;
    }
    it->next = NULL;
    it->seq = ++st->submitted;
    if (seq) *seq = it->seq;
    if (st->tail) st->tail->next = it;
    else st->head = it;
    st->tail = it;
    pthread_cond_broadcast(&st->cv);
    pthread_mutex_unlock(&st->mu);
    return cudaSuccess;
}

cudaError_t emu_stream_dev_work(emu_stream *st, fy_emu_dev_fn fn, const void *args, size_t nbytes,
                                const char *what) {
    emu_item *it = item_new(ITEM_DEV, nbytes);
    if (it) {
        it->msg.fn = fn;
        it->msg.nbytes = (uint32_t)nbytes;
        snprintf(it->msg.what, sizeof it->msg.what, "%s", what);
        if (nbytes) memcpy(it + 1, args, nbytes);
    }
    return push(st, it, NULL);
}

cudaError_t emu_stream_mark(emu_stream *st, void (*mark)(void *arg), void (*release)(void *arg), void *arg,
                            uint64_t *seq) {
    emu_item *it = item_new(ITEM_MARK, 0);
    if (it) {
        it->host_fn = mark;
        it->release = release;
        it->arg = arg;
    } else if (release) {
        release(arg);
    }
    return push(st, it, seq);
}

cudaError_t emu_stream_wait_for(emu_stream *st, emu_stream *on, uint64_t seq) {
    emu_item *it = item_new(ITEM_WAIT, 0);
    if (it) {
        it->on = on;
        it->on_seq = seq;
    } else {
        emu_stream_put(on);
    }
    return push(st, it, NULL);
}

cudaError_t emu_stream_run_sync(emu_stream *st, cudaError_t (*fn)(emu_stream *st, void *arg), void *arg) {
    cudaError_t result = cudaSuccess;
    emu_item *it = item_new(ITEM_SYNC_FN, 0);
    if (it) {
        it->sync_fn = fn;
        it->arg = arg;
        it->result = &result;
    }
    uint64_t seq;
    cudaError_t e = push(st, it, &seq);
    if (e != cudaSuccess) return e;
    emu_stream_wait_done(st, seq, false);
    return result;
}

/* ---- streams --------------------------------------------------------------------------------- */

static emu_stream *stream_new(int d, unsigned flags, bool legacy, cudaError_t *err) {
    int sv[2];
    *err = cudaErrorMemoryAllocation;
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv)) return NULL;
    *err = emu_ctl_stream(d, sv[1]);
    close(sv[1]);
    if (*err != cudaSuccess) {
        close(sv[0]);
        return NULL;
    }
    emu_stream *st = new emu_stream();
    st->dev = d;
    st->flags = flags;
    st->legacy = legacy;
    st->fd = sv[0];
    pthread_mutex_init(&st->mu, NULL);
    pthread_cond_init(&st->cv, NULL);
    st->completed.store(0);
    st->refs.store(2); /* the handle's and the worker's */
    pthread_t t;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &at, worker, st)) {
        pthread_attr_destroy(&at);
        close(st->fd);
        delete st;
        *err = cudaErrorMemoryAllocation;
        return NULL;
    }
    pthread_attr_destroy(&at);
    emu_gpu *g = &g_emu.gpu[d];
    pthread_mutex_lock(&g->mu);
    st->next = g->streams;
    g->streams = st;
    pthread_mutex_unlock(&g->mu);
    *err = cudaSuccess;
    return st;
}

emu_stream *emu_stream_get(cudaStream_t s, int dev) {
    if (!s || s == cudaStreamLegacy) {
        static pthread_mutex_t legacy_mu = PTHREAD_MUTEX_INITIALIZER; /* makes them one at a time */
        emu_gpu *g = &g_emu.gpu[dev];
        pthread_mutex_lock(&legacy_mu);
        if (!g->legacy) {
            cudaError_t e;
            emu_stream *st = stream_new(dev, cudaStreamDefault, true, &e);
            pthread_mutex_lock(&g->mu);
            g->legacy = st;
            pthread_mutex_unlock(&g->mu);
        }
        emu_stream *st = g->legacy;
        if (st) st->refs++;
        pthread_mutex_unlock(&legacy_mu);
        return st;
    }
    if (s == cudaStreamPerThread) {
        fy_emu_report("cudaStreamPerThread is not emulated");
        return NULL;
    }
    return live_streams.get(s);
}

cudaError_t emu_stream_lookup(cudaStream_t s, int dev, const char *call, emu_stream **out) {
    *out = emu_stream_get(s, dev);
    if (*out) return cudaSuccess;
    if (s && s != cudaStreamLegacy)
        fy_emu_report("%s: stream %p is not a live stream (destroyed, or never made)", call, (void *)s);
    return cudaErrorInvalidResourceHandle;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *pStream, unsigned int flags) {
    EMU_ENTER(true, d);
    if (!pStream || (flags != cudaStreamDefault && flags != cudaStreamNonBlocking))
        return emu_ret(cudaErrorInvalidValue);
    cudaError_t e;
    emu_stream *st = stream_new(d, flags, false, &e);
    if (!st) return emu_ret(e);
    live_streams.add(st);
    *pStream = (cudaStream_t)st;
    return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t *pStream) {
    return cudaStreamCreateWithFlags(pStream, cudaStreamDefault);
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
    EMU_ENTER(false, d);
    (void)d;
    emu_stream *st = live_streams.remove(stream);
    if (!st) {
        fy_emu_report("cudaStreamDestroy: stream %p is not a live stream (destroyed, or never made)",
                      (void *)stream);
        return emu_ret(cudaErrorInvalidResourceHandle);
    }
    pthread_mutex_lock(&st->mu);
    st->destroyed = true; /* its worker ends once the queued work is done */
    pthread_cond_broadcast(&st->cv);
    pthread_mutex_unlock(&st->mu);
    emu_stream_put(st);
    return cudaSuccess;
}

/* Waits for st's work queued so far; the device's sticky error or the stream's first
 * error since the last wait (cleared). */
static cudaError_t stream_wait(emu_stream *st, bool spin) {
    pthread_mutex_lock(&st->mu);
    const uint64_t target = st->submitted;
    pthread_mutex_unlock(&st->mu);
    emu_stream_wait_done(st, target, spin);
    cudaError_t e = emu_sticky(st->dev);
    pthread_mutex_lock(&st->mu);
    if (e == cudaSuccess) e = st->error;
    st->error = cudaSuccess;
    pthread_mutex_unlock(&st->mu);
    return e;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
    EMU_ENTER(true, d);
    emu_stream *st;
    cudaError_t e = emu_stream_lookup(stream, d, "cudaStreamSynchronize", &st);
    if (e != cudaSuccess) return emu_ret(e);
    e = stream_wait(st, emu_dev_spins(st->dev));
    emu_stream_put(st);
    return emu_ret(e);
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
    EMU_ENTER(true, d);
    emu_stream *st;
    cudaError_t e = emu_stream_lookup(stream, d, "cudaStreamQuery", &st);
    if (e != cudaSuccess) return emu_ret(e);
    pthread_mutex_lock(&st->mu);
    /* done: the error its work met, as a synchronize reports it (and clears it) */
    e = st->completed.load() < st->submitted ? cudaErrorNotReady : st->error;
    if (e != cudaErrorNotReady) st->error = cudaSuccess;
    pthread_mutex_unlock(&st->mu);
    if (emu_sticky(st->dev) != cudaSuccess) e = emu_sticky(st->dev);
    emu_stream_put(st);
    return e == cudaErrorNotReady ? e : emu_ret(e);
}

cudaError_t emu_device_sync(int d, bool spin) {
    emu_gpu *g = &g_emu.gpu[d];
    emu_stream *all[256];
    int n = 0;
    pthread_mutex_lock(&g->mu);
    emu_stream *o;
    for (o = g->streams; o && n < 256; o = o->next) {
        o->refs++;
        all[n++] = o;
    }
    pthread_mutex_unlock(&g->mu);
    if (o) { /* never a weaker synchronisation than CUDA's: stop */
        fy_emu_report("cudaDeviceSynchronize: more than 256 streams on GPU %d", d);
        abort();
    }
    cudaError_t first = cudaSuccess;
    for (int i = 0; i < n; i++) {
        cudaError_t e = stream_wait(all[i], spin);
        if (first == cudaSuccess) first = e;
        emu_stream_put(all[i]);
    }
    cudaError_t e = emu_sticky(d);
    return e != cudaSuccess ? e : first;
}

cudaError_t cudaDeviceSynchronize(void) {
    EMU_ENTER(true, d);
    return emu_ret(emu_device_sync(d, emu_dev_spins(d)));
}

cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void *userData) {
    EMU_ENTER(true, d);
    if (!fn) return emu_ret(cudaErrorInvalidValue);
    emu_stream *st;
    cudaError_t e = emu_stream_lookup(stream, d, "cudaLaunchHostFunc", &st);
    if (e != cudaSuccess) return emu_ret(e);
    emu_item *it = item_new(ITEM_HOST_FN, 0);
    if (it) {
        it->host_fn = fn;
        it->arg = userData;
    }
    e = push(st, it, NULL);
    emu_stream_put(st);
    return emu_ret(e);
}

cudaError_t fy_emu_enqueue(cudaStream_t s, fy_emu_dev_fn fn, const void *args, size_t nbytes,
                           const char *what) {
    EMU_ENTER(true, d);
    if (!fn || nbytes > FY_EMU_ARGS_MAX || (nbytes && !args)) {
        fy_emu_report("fy_emu_enqueue(%s): no function, or arguments of %zu bytes (at most %d)",
                      what, nbytes, FY_EMU_ARGS_MAX);
        return emu_ret(cudaErrorInvalidValue);
    }
    if (!emu_code_on_device((const void *)fn)) {
        fy_emu_report("fy_emu_enqueue(%s): its function is in code loaded after the device "
                      "processes started, which they do not have", what);
        return emu_ret(cudaErrorInvalidDeviceFunction);
    }
    emu_stream *st;
    cudaError_t e = emu_stream_lookup(s, d, what, &st);
    if (e != cudaSuccess) return emu_ret(e);
    e = emu_stream_dev_work(st, fn, args, nbytes, what);
    emu_stream_put(st);
    return emu_ret(e);
}
