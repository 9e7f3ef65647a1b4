/* device_suite.h — the device interface's semantics (engine/device/device.h), one suite
 * run on every backend: test_device.c includes it for the cpu backend, test_cuda.c for the
 * cuda backend (where it skips without a GPU). Memory (zeroed, the budget), copies
 * between every kind of memory, stream order, events across streams, timed events and
 * storage types must mean the same on every backend: the layers above rely on them.
 *
 * The including file defines, before including it (after <criterion/criterion.h>):
 *   static fy_dev *suite_open(size_t cap_nbytes);
 * which opens a device of its backend with that device-memory budget (0: the backend's
 * own), or skips the calling test when the backend cannot run here. */
#ifndef FY_DEVICE_SUITE_H
#define FY_DEVICE_SUITE_H

#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/core/dtype.h"
#include "engine/core/util.h"
#include "engine/device/device.h"

static fy_dev *sd_dev;
static fy_stream *sd_s;
static void *sd_host[256];
static int sd_nhost;

static void sd_open(size_t cap_nbytes) {
    sd_dev = suite_open(cap_nbytes);
    cr_assert_eq(fy_stream_new(sd_dev, "suite", &sd_s), FY_OK);
}

static void sd_close(void) {
    if (sd_s) fy_stream_sync(sd_s);
    fy_stream_free(sd_s);
    fy_dev_free(sd_dev);
    for (int i = 0; i < sd_nhost; i++) free(sd_host[i]);
    sd_s = NULL;
    sd_dev = NULL;
    sd_nhost = 0;
}

/* Zeroed host scratch (malloc'd: pageable), freed at the end of the test. */
static void *sd_hnew(size_t n) {
    cr_assert_lt(sd_nhost, 256);
    void *p = calloc(1, n ? n : 1);
    cr_assert_not_null(p);
    return sd_host[sd_nhost++] = p;
}

static void *sd_alloc(fy_mem_kind kind, size_t n, const char *what) {
    void *p;
    cr_assert_eq(fy_dev_alloc(sd_dev, kind, n, what, &p), FY_OK, "%s", fy_last_error());
    return p;
}

/* The bytes of device (or any) memory, read on the suite's stream. */
static void sd_get(void *h, const void *d, size_t n) {
    fy_copy_async(sd_s, h, d, n, FY_D2H);
    fy_stream_sync(sd_s);
}

static size_t sd_first_not(const unsigned char *p, int byte, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (p[i] != (unsigned char)byte) return i;
    return n;
}

static void sd_sleep_ms(double ms) {
    struct timespec ts = {(time_t)(ms / 1e3), (long)((ms - 1e3 * (double)(time_t)(ms / 1e3)) * 1e6)};
    while (nanosleep(&ts, &ts) != 0) {}
}

TestSuite(device_semantics, .fini = sd_close, .timeout = 60);

/* ---- memory ---------------------------------------------------------------------------- */

Test(device_semantics, allocations_are_zeroed_even_when_memory_is_reused) {
    sd_open(0);
    static const size_t sizes[] = {1000, 3u << 20, 17u << 20}; /* small, huge-page, parallel */
    static const fy_mem_kind kinds[] = {FY_MEM_DEVICE, FY_MEM_PINNED, FY_MEM_HOST};
    static const char *const names[] = {"device", "pinned", "host"};
    unsigned char *view = sd_hnew(17u << 20);
    for (int k = 0; k < 3; k++)
        for (int i = 0; i < 3; i++)
            for (int round = 0; round < 2; round++) { /* round 1 may get round 0's dirty memory */
                void *p = sd_alloc(kinds[k], sizes[i], "zeroed?");
                cr_expect_eq((uintptr_t)p % 64, 0, "an allocation not 64-byte aligned");
                memset(view, 0xcd, sizes[i]);
                sd_get(view, p, sizes[i]);
                size_t at = sd_first_not(view, 0, sizes[i]);
                cr_expect(at == sizes[i], "%s allocation of %zu bytes (round %d): byte %zu is 0x%02x",
                          names[k], sizes[i], round, at, at < sizes[i] ? view[at] : 0);
                fy_memset_async(sd_s, p, 0xab, sizes[i]); /* dirty it before it is freed */
                fy_stream_sync(sd_s);
                fy_dev_release(sd_dev, p);
            }
}

/* 1 MiB of device memory: 640 KiB taken, 512 KiB more is refused with the numbers, what is
 * left can still be taken, and the device keeps working. */
Test(device_semantics, budget_refuses_with_oom_and_names_the_buffer_and_the_shortfall) {
    sd_open(1u << 20);
    fy_log_set_level(FY_LOG_QUIET); /* the expected error stays out of the output */
    void *a = sd_alloc(FY_MEM_DEVICE, 640u << 10, "first"), *b = (void *)1, *c;
    fy_status st = fy_dev_alloc(sd_dev, FY_MEM_DEVICE, 512u << 10, "layer 3 parameters", &b);
    cr_assert_eq(st, FY_ERR_DEVICE_OOM, "allocating past the budget gave %s", fy_status_str(st));
    cr_expect_null(b, "a failed allocation returns NULL");
    const char *msg = fy_last_error();
    cr_expect(strstr(msg, "layer 3 parameters"), "the error does not name the buffer: %s", msg);
    cr_expect(strstr(msg, "128.00 KiB"), "no shortfall (128 KiB) in: %s", msg);
    cr_expect(strstr(msg, "384.00 KiB"), "no free memory (384 KiB) in: %s", msg);
    cr_expect(strstr(msg, "1.00 MiB"), "no budget (1 MiB) in: %s", msg);
    fy_dev_mem_stats ms;
    fy_dev_mem_stats_get(sd_dev, &ms);
    cr_expect_eq(ms.used_nbytes[FY_MEM_DEVICE], 640u << 10, "the failed allocation was counted");
    cr_expect_eq(ms.cap_nbytes, 1u << 20);
    c = sd_alloc(FY_MEM_DEVICE, 384u << 10, "what is left");
    cr_expect_eq(fy_dev_alloc(sd_dev, FY_MEM_DEVICE, 1, "one more byte", &b), FY_ERR_DEVICE_OOM);
    cr_expect_eq(fy_dev_alloc(sd_dev, FY_MEM_PINNED, 4u << 20, "pinned", &b), FY_OK,
                 "host memory does not count against the device budget");
    fy_memset_async(sd_s, c, 0x5a, 384u << 10); /* the device still works */
    unsigned char *h = sd_hnew(384u << 10);
    sd_get(h, c, 384u << 10);
    cr_expect_eq(sd_first_not(h, 0x5a, 384u << 10), 384u << 10, "a memset after a refusal");
    fy_dev_release(sd_dev, a);
    fy_dev_release(sd_dev, c);
    fy_dev_release(sd_dev, b);
    cr_expect_eq(fy_dev_alloc(sd_dev, FY_MEM_DEVICE, 1u << 20, "all of it", &a), FY_OK,
                 "released memory can be allocated again");
}

/* ---- copies and memsets ------------------------------------------------------------------ */

Test(device_semantics, copies_between_every_kind_of_memory) {
    sd_open(0);
    const size_t n = 1000003; /* odd, and every copy starts at an odd offset */
    unsigned char *src = sd_hnew(n), *back = sd_hnew(n + 16);
    uint64_t z = 808;
    for (size_t i = 0; i < n; i++) { z = z * 6364136223846793005ull + 1442695040888963407ull; src[i] = (unsigned char)(z >> 56); }
    unsigned char *pinned = sd_alloc(FY_MEM_PINNED, n + 16, "pinned");
    unsigned char *host = sd_alloc(FY_MEM_HOST, n + 16, "host");
    char *d1 = sd_alloc(FY_MEM_DEVICE, n + 16, "d1"), *d2 = sd_alloc(FY_MEM_DEVICE, n + 16, "d2");
    char *d3 = sd_alloc(FY_MEM_DEVICE, n + 16, "d3");
    fy_copy_async(sd_s, d1 + 1, src, n, FY_H2D);          /* malloc'd -> device */
    fy_copy_async(sd_s, d2 + 5, d1 + 1, n, FY_D2D);       /* device -> device */
    fy_copy_async(sd_s, pinned + 3, d2 + 5, n, FY_D2H);   /* device -> pinned */
    fy_copy_async(sd_s, host + 2, pinned + 3, n, FY_H2H); /* pinned -> host (after the D2H) */
    fy_copy_async(sd_s, d3 + 9, host + 2, n, FY_H2D);     /* host -> device */
    fy_copy_async(sd_s, back + 7, d3 + 9, n, FY_D2H);     /* device -> malloc'd */
    fy_stream_sync(sd_s);
    cr_expect(memcmp(back + 7, src, n) == 0, "the chain of copies corrupted the data");
    cr_expect_eq(sd_first_not(back, 0, 7), 7, "a copy wrote before its destination");
    cr_expect(back[n + 7] == 0 && pinned[2] == 0 && pinned[n + 3] == 0 && host[1] == 0 &&
              host[n + 2] == 0, "a copy wrote outside its destination");
    unsigned char edge[2];
    sd_get(&edge[0], d2 + 4, 1);
    sd_get(&edge[1], d2 + 5 + n, 1);
    cr_expect(edge[0] == 0 && edge[1] == 0, "D2D wrote outside its destination");
}

Test(device_semantics, memset_sets_exactly_its_range) {
    sd_open(0);
    const size_t n = 4099;
    unsigned char *d = sd_alloc(FY_MEM_DEVICE, n + 64, "d"), *h = sd_hnew(n + 64);
    fy_memset_async(sd_s, d, 0x11, n + 64);
    fy_memset_async(sd_s, d + 13, 0xA5, n);
    sd_get(h, d, n + 64);
    for (size_t i = 0; i < n + 64; i++) {
        int want = i >= 13 && i < 13 + n ? 0xA5 : 0x11;
        cr_assert_eq(h[i], want, "byte %zu is 0x%02x, want 0x%02x", i, h[i], want);
    }
}

/* ---- streams and events ------------------------------------------------------------------- */

typedef struct sd_log { int n, seq[3000], byte[3000]; } sd_log;
typedef struct sd_item { sd_log *log; int seq; const unsigned char *slot; } sd_item;
static void sd_log_append(void *p) {
    sd_item *it = p;
    it->log->seq[it->log->n] = it->seq;
    it->log->byte[it->log->n] = *it->slot;
    it->log->n++;
}

/* Memsets, copies and host functions in submission order (3000: past the cpu stream's
 * ring, so across its wrap-around too). */
Test(device_semantics, work_runs_in_submission_order) {
    sd_open(0);
    enum { n = 3000 };
    sd_log *log = sd_hnew(sizeof *log);
    sd_item *items = sd_hnew(n * sizeof *items);
    unsigned char *slots = sd_alloc(FY_MEM_PINNED, n, "slots");
    unsigned char *dbyte = sd_alloc(FY_MEM_DEVICE, 64, "byte");
    for (int i = 0; i < n; i++) {
        items[i] = (sd_item){log, i, &slots[i]};
        fy_memset_async(sd_s, dbyte, i & 0xff, 1);
        fy_copy_async(sd_s, &slots[i], dbyte, 1, FY_D2H);
        fy_stream_host_fn(sd_s, sd_log_append, &items[i]);
    }
    fy_stream_sync(sd_s);
    cr_assert_eq(log->n, n, "%d host functions ran, %d queued", log->n, n);
    for (int i = 0; i < n; i++) {
        cr_assert_eq(log->seq[i], i, "host function %d ran in place %d", log->seq[i], i);
        cr_assert_eq(log->byte[i], i & 0xff, "host function %d saw byte %d: the memset and copy "
                     "queued before it had not completed", i, log->byte[i]);
    }
}

typedef struct sd_flag { double sleep_ms; atomic_int flag, seen; } sd_flag;
static void sd_set_flag_slowly(void *p) {
    sd_flag *f = p;
    sd_sleep_ms(f->sleep_ms);
    atomic_store(&f->flag, 1);
}
static void sd_read_flag(void *p) {
    sd_flag *f = p;
    atomic_store(&f->seen, atomic_load(&f->flag) + 1); /* 1: not yet set, 2: set */
}

Test(device_semantics, an_event_orders_work_across_streams) {
    sd_open(0);
    enum { n = 1 << 20 };
    fy_stream *b;
    fy_event *e;
    cr_assert_eq(fy_stream_new(sd_dev, "b", &b), FY_OK);
    cr_assert_eq(fy_event_new(sd_dev, &e), FY_OK);
    unsigned char *src = sd_alloc(FY_MEM_PINNED, n, "src"), *out = sd_alloc(FY_MEM_PINNED, n, "out");
    for (int i = 0; i < n; i++) src[i] = (unsigned char)(i * 7 + 1);
    char *buf = sd_alloc(FY_MEM_DEVICE, n, "buf"), *buf2 = sd_alloc(FY_MEM_DEVICE, n, "buf2");
    sd_flag *f = sd_hnew(sizeof *f);
    f->sleep_ms = 60;
    /* A: slow host work, then the data B needs, then the event */
    fy_stream_host_fn(sd_s, sd_set_flag_slowly, f);
    fy_copy_async(sd_s, buf, src, n, FY_H2D);
    fy_event_record(e, sd_s);
    /* B, queued while A still sleeps: wait, then read what A wrote */
    fy_stream_wait_event(b, e);
    fy_stream_host_fn(b, sd_read_flag, f);
    fy_copy_async(b, buf2, buf, n, FY_D2D);
    fy_copy_async(b, out, buf2, n, FY_D2H);
    fy_stream_sync(b);
    cr_expect_eq(atomic_load(&f->seen), 2, "stream B ran before A's host function finished");
    cr_expect(memcmp(out, src, n) == 0, "stream B's copy ran before A's");
    fy_stream_sync(sd_s);
    fy_event_free(e);
    fy_stream_free(b);
}

typedef struct sd_gate { atomic_int open, passed; } sd_gate;
static void sd_gate_wait(void *p) {
    sd_gate *g = p;
    while (!atomic_load(&g->open)) sd_sleep_ms(0.5);
    atomic_store(&g->passed, 1);
}

Test(device_semantics, event_done_and_sync) {
    sd_open(0);
    fy_event *e, *never;
    cr_assert_eq(fy_event_new(sd_dev, &e), FY_OK);
    cr_assert_eq(fy_event_new(sd_dev, &never), FY_OK);
    /* CUDA's events do so, but the emulated runtime refuses to wait on one in its strict
     * mode (a wait that orders nothing is a bug in ferry: tests/cuda_emu/runtime) */
    if (!(fy_dev_get_kind(sd_dev) == FY_DEV_CUDA && fy_dev_cuda_emulated())) {
        cr_expect(fy_event_done(never), "an event never recorded counts as complete");
        fy_event_sync(never); /* returns at once */
    }
    for (int round = 0; round < 2; round++) { /* a re-recorded event is pending again */
        sd_gate *g = sd_hnew(sizeof *g);
        fy_stream_host_fn(sd_s, sd_gate_wait, g);
        fy_event_record(e, sd_s);
        sd_sleep_ms(5);
        cr_expect(!fy_event_done(e), "round %d: done while the work before it is blocked", round);
        atomic_store(&g->open, 1);
        fy_event_sync(e);
        cr_expect(atomic_load(&g->passed), "round %d: fy_event_sync returned before the work "
                  "recorded before it", round);
        cr_expect(fy_event_done(e), "round %d: not done after fy_event_sync", round);
    }
    fy_event_free(never);
    fy_event_free(e);
}

/* B waits on the first record; a later record of the same event behind a closed gate must
 * not hold B back (CUDA's semantics: a wait refers to the latest record before it). */
Test(device_semantics, a_wait_refers_to_the_record_submitted_before_it) {
    sd_open(0);
    fy_stream *b;
    fy_event *e, *bdone;
    cr_assert_eq(fy_stream_new(sd_dev, "b", &b), FY_OK);
    cr_assert_eq(fy_event_new(sd_dev, &e), FY_OK);
    cr_assert_eq(fy_event_new(sd_dev, &bdone), FY_OK);
    fy_event_record(e, sd_s);
    fy_stream_sync(sd_s);
    fy_stream_wait_event(b, e);
    sd_gate *g = sd_hnew(sizeof *g);
    fy_stream_host_fn(sd_s, sd_gate_wait, g);
    fy_event_record(e, sd_s);
    fy_event_record(bdone, b);
    double t0 = fy_now_ms();
    while (!fy_event_done(bdone) && fy_now_ms() - t0 < 1000) sd_sleep_ms(1);
    cr_expect(fy_event_done(bdone), "stream B waited for a record submitted after its wait");
    atomic_store(&g->open, 1);
    fy_stream_sync(sd_s);
    fy_stream_sync(b);
    fy_event_free(bdone);
    fy_event_free(e);
    fy_stream_free(b);
}

/* Timed events measure what the device did between them: a 30 ms host function between
 * two records takes at least 30 ms (the bound allows 1% of clock rounding) and well under
 * a second; the other way round the time is negative. The trainer times every task so. */
Test(device_semantics, timed_events_measure_the_work_between_them) {
    sd_open(0);
    fy_event *a, *b;
    cr_assert_eq(fy_event_new_timed(sd_dev, &a), FY_OK);
    cr_assert_eq(fy_event_new_timed(sd_dev, &b), FY_OK);
    sd_flag *f = sd_hnew(sizeof *f);
    f->sleep_ms = 30;
    fy_event_record(a, sd_s);
    fy_stream_host_fn(sd_s, sd_set_flag_slowly, f);
    fy_event_record(b, sd_s);
    fy_event_sync(b);
    double ms = fy_event_elapsed_ms(a, b);
    cr_expect(ms >= 29.7 && ms < 1000, "30 ms of work measured as %.3f ms", ms);
    cr_expect_lt(fy_event_elapsed_ms(b, a), 0.0);
    fy_event_free(a);
    fy_event_free(b);
}

Test(device_semantics, streams_store_fp32_or_bf16) {
    sd_open(0);
    fy_log_set_level(FY_LOG_QUIET);
    cr_expect_eq(fy_stream_dtype(sd_s), FY_F32, "a new stream stores fp32");
    cr_expect_eq(fy_stream_set_dtype(sd_s, FY_BF16), FY_OK);
    cr_expect_eq(fy_stream_dtype(sd_s), FY_BF16);
    cr_expect_eq(fy_stream_set_dtype(sd_s, FY_F16), FY_ERR_UNSUPPORTED, "no backend has fp16 kernels");
    cr_expect_eq(fy_stream_dtype(sd_s), FY_BF16, "a refused type leaves the stream's as it was");
    cr_expect_eq(fy_stream_set_dtype(sd_s, FY_F32), FY_OK);
}

#endif
