/* kernel_check.h — what the kernel tests share (test_device.c: GPT-2's kernels and the
 * device; test_llama.c: Llama's): a cpu device and stream per test, host and device
 * scratch, a seeded generator, and the finite-difference engine with its tolerance rule
 * (test_device.c's header explains the rule). Included once per test program, after
 * <criterion/criterion.h>. */
#ifndef FY_KERNEL_CHECK_H
#define FY_KERNEL_CHECK_H

#include <criterion/logging.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/util.h"
#include "engine/device/device.h"

#define U_F32 0x1p-24 /* unit roundoff of fp32 */

/* ---- fixtures and helpers ---------------------------------------------------------- */

static fy_dev *g_dev;
static fy_stream *g_s;
static void *g_host[512];
static int g_nhost;

static inline fy_dev *open_dev(size_t cap_nbytes, double gbps, int threads) {
    fy_dev_cfg cfg = {.kind = FY_DEV_CPU, .threads = threads, .mem_cap_nbytes = cap_nbytes,
                      .sim_pcie_gbps = gbps};
    fy_dev *d = NULL;
    cr_assert_eq(fy_dev_new(&cfg, &d), FY_OK, "fy_dev_new: %s", fy_last_error());
    return d;
}

static inline void setup_with(size_t cap_nbytes, double gbps) {
    fy_log_set_level(FY_LOG_QUIET); /* expected errors (OOM) stay out of the output */
    g_dev = open_dev(cap_nbytes, gbps, 2);
    cr_assert_eq(fy_stream_new(g_dev, "main", &g_s), FY_OK);
}
static inline void setup(void) { setup_with(0, 0.0); }

static inline void teardown(void) {
    fy_stream_free(g_s);
    fy_dev_free(g_dev);
    while (g_nhost > 0) free(g_host[--g_nhost]);
}

/* Host scratch, zeroed, freed at teardown. */
static inline void *hnew(size_t nbytes) {
    cr_assert(g_nhost < (int)(sizeof g_host / sizeof g_host[0]));
    void *p = calloc(1, nbytes ? nbytes : 1);
    cr_assert(p);
    return g_host[g_nhost++] = p;
}
static inline float *hnewf(size_t n) { return hnew(n * sizeof(float)); }

static inline void *dnew(size_t nbytes) {
    void *p = NULL;
    fy_status st = fy_dev_alloc(g_dev, FY_MEM_DEVICE, nbytes, "test buffer", &p);
    cr_assert_eq(st, FY_OK, "fy_dev_alloc: %s", fy_last_error());
    return p;
}
static inline float *dnewf(size_t n) { return dnew(n * sizeof(float)); }

static inline void put(void *d, const void *h, size_t nbytes) {
    fy_copy_async(g_s, d, h, nbytes, FY_H2D);
    fy_stream_sync(g_s);
}
static inline void get(void *h, const void *d, size_t nbytes) {
    fy_copy_async(g_s, h, d, nbytes, FY_D2H);
    fy_stream_sync(g_s);
}
static inline float *dputf(const float *h, size_t n) {
    float *d = dnewf(n);
    put(d, h, n * sizeof(float));
    return d;
}
static inline float *dgetf(const float *d, size_t n) {
    float *h = hnewf(n);
    get(h, d, n * sizeof(float));
    return h;
}

typedef struct rng { uint64_t s; } rng;
static inline uint64_t rng_u64(rng *r) { /* splitmix64 */
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static inline float rng_unif(rng *r, float lo, float hi) {
    return lo + (hi - lo) * (float)((double)(rng_u64(r) >> 11) * 0x1p-53);
}
static inline int rng_int(rng *r, int n) { return (int)(rng_u64(r) % (uint64_t)n); }
static inline float *hrand(rng *r, size_t n, float lo, float hi) {
    float *x = hnewf(n);
    for (size_t i = 0; i < n; i++) x[i] = rng_unif(r, lo, hi);
    return x;
}

/* L = sum(out * R) in double, out read back from the device into tmp. */
static inline double dot_dev(const float *out, const float *R, float *tmp, size_t n) {
    get(tmp, out, n * sizeof(float));
    double L = 0.0;
    for (size_t i = 0; i < n; i++) L += (double)tmp[i] * (double)R[i];
    return L;
}

/* ---- the finite-difference engine -------------------------------------------------- */

/* Queues a forward on g_s and returns the objective L read back in double. */
typedef double (*fd_objective)(void *ctx);

typedef struct fd_check {
    const char *name;
    float *x;         /* the input perturbed, device memory (n) */
    size_t n;
    const float *ana; /* dL/dx from the backward kernel, host (n) */
    float h;          /* step */
    size_t max_coords;/* coordinates checked: all if n is not larger, else a fixed sample */
    double tol;       /* on ||num - ana|| / ||ana|| */
} fd_check;

static inline double fd_rel_err(fd_objective f, void *ctx, const fd_check *c) {
    float *x = malloc(c->n * sizeof *x);
    size_t *idx = malloc(c->n * sizeof *idx);
    cr_assert(x && idx);
    get(x, c->x, c->n * sizeof(float));
    for (size_t i = 0; i < c->n; i++) idx[i] = i;
    size_t m = c->n;
    if (m > c->max_coords) { /* partial Fisher-Yates: a fixed sample without repeats */
        rng r = {0xfd5eed ^ c->n};
        for (size_t k = 0; k < c->max_coords; k++) {
            size_t j = k + (size_t)(rng_u64(&r) % (c->n - k));
            size_t t = idx[k]; idx[k] = idx[j]; idx[j] = t;
        }
        m = c->max_coords;
    }
    double e2 = 0.0, a2 = 0.0;
    for (size_t k = 0; k < m; k++) {
        size_t i = idx[k];
        float x0 = x[i], xp = x0 + c->h, xm = x0 - c->h;
        put(c->x + i, &xp, sizeof xp);
        double lp = f(ctx);
        put(c->x + i, &xm, sizeof xm);
        double lm = f(ctx);
        put(c->x + i, &x0, sizeof x0);
        double num = (lp - lm) / ((double)xp - (double)xm);
        e2 += (num - c->ana[i]) * (num - c->ana[i]);
        a2 += (double)c->ana[i] * c->ana[i];
    }
    free(x);
    free(idx);
    return sqrt(e2) / sqrt(a2); /* NaN or inf (a failure) if ana is all zeros */
}

static inline void expect_fd(fd_objective f, void *ctx, const fd_check *c) {
    double rel = fd_rel_err(f, ctx, c);
    cr_log_info("fd %-26s ||num-ana||/||ana|| = %.2e (tol %.0e)", c->name, rel, c->tol);
    cr_expect(rel <= c->tol,
              "%s: finite differences disagree with the backward kernel: "
              "||num - ana|| / ||ana|| = %.3g > tol %.3g", c->name, rel, c->tol);
}

/* got == base + inc up to the rounding of one fp32 addition (and of the sum, if the
 * kernel adds a differently rounded partial): 4u * (|base| + |inc|). */
static inline void expect_accumulated(const char *name, const float *got, const float *base,
                               const float *inc, size_t n) {
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < n; i++) {
        double want = (double)base[i] + inc[i];
        double tol = 4 * U_F32 * (fabs(base[i]) + fabs(inc[i]));
        if (!(fabs(got[i] - want) <= tol)) { if (!bad) first = i; bad++; }
    }
    cr_expect(bad == 0, "%s does not accumulate: %zu of %zu wrong, first [%zu] = %.9g, "
              "want %.9g + %.9g", name, bad, n, first, got[first], base[first], inc[first]);
}

static inline void expect_same_bits(const char *name, const void *a, const void *b, size_t nbytes) {
    cr_expect(memcmp(a, b, nbytes) == 0, "%s: results differ bitwise", name);
}

#endif
