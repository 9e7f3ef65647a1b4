/* bench_attn.c — bench/bench_attn: the cpu backend's tiled attention (fy_k_attention_fwd
 * and _bwd, no T x T buffer) against the attention it replaced (ferry's ff46229: a full
 * T x T score matrix per head, softmax, GEMM), in the same run.
 *
 * Both run on the cpu device's stream thread, on the same OpenMP pool and BLAS (the old
 * one through fy_stream_host_fn), on the same qkv and dout. Each repetition times each
 * kernel's forward and its forward+backward (one forward then one backward, timed
 * together); the two kernels alternate, the first of a pair swapping each repetition,
 * so a noisy neighbour hits both. Medians and ranges over the timed repetitions, and
 * the median of the per-repetition ratios old/new, are printed.
 *
 * Sanity: after the warm-up, out and dqkv of the two are compared (the largest
 * difference over the largest magnitude of the tensor must be <= 1e-5), and some output
 * rows of the new one against a float64 softmax computed here (every case, the old one
 * or not).
 *
 * The old kernel needs two (B,NH,T,T) fp32 buffers: where they do not fit in half the
 * memory available now it is skipped, with the reason printed. */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cblas.h>

#include "engine/core/status.h"
#include "engine/core/util.h"
#include "engine/device/device.h"
#include "engine/device/kernels.h"

/* ---- the pre-tiling reference, kept ONLY for comparison --------------------------------
 * ff46229's cpu attention_fwd/attention_bwd (engine/device/cpu/cpu_kernels.c), renamed:
 * causal mask only (no documents, no window), the probabilities P (B,NH,T,T) saved by the
 * forward, scratch (B,NH,T,T) for dS in the backward. Not used by ferry. */

typedef struct ref_dims { int B, T, NH, NKV, hd, G, W; float scale; } ref_dims;

static void ref_attention_fwd(float *out, float *att, const float *qkv, ref_dims d) {
    const int T = d.T, hd = d.hd, W = d.W, Cq = d.NH * hd;
    #pragma omp parallel for schedule(dynamic, 1)
    for (int bk = 0; bk < d.B * d.NKV; bk++) {
        int b = bk / d.NKV, kh = bk % d.NKV;
        const float *row0 = qkv + (size_t)b * T * W;
        const float *k = row0 + Cq + (size_t)kh * hd, *v = row0 + Cq + (size_t)d.NKV * hd + (size_t)kh * hd;
        for (int g = 0; g < d.G; g++) {
            int h = kh * d.G + g;
            const float *q = row0 + (size_t)h * hd;
            float *p = att + ((size_t)b * d.NH + h) * T * T;
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, T, hd, d.scale, q, W, k, W,
                        0.0f, p, T);
            for (int t = 0; t < T; t++) {
                float *row = p + (size_t)t * T;
                float mx = -INFINITY;
                for (int j = 0; j <= t; j++) mx = row[j] > mx ? row[j] : mx;
                float sum = 0.0f;
                for (int j = 0; j <= t; j++) { row[j] = expf(row[j] - mx); sum += row[j]; }
                float inv = 1.0f / sum;
                for (int j = 0; j <= t; j++) row[j] *= inv;
                for (int j = t + 1; j < T; j++) row[j] = 0.0f;
            }
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, hd, T, 1.0f, p, T, v, W,
                        0.0f, out + (size_t)b * T * Cq + (size_t)h * hd, Cq);
        }
    }
}

static void ref_attention_bwd(float *dqkv, float *scratch, const float *dout, const float *qkv,
                              const float *att, ref_dims d) {
    const int T = d.T, hd = d.hd, W = d.W, Cq = d.NH * hd;
    #pragma omp parallel for schedule(dynamic, 1)
    for (int bk = 0; bk < d.B * d.NKV; bk++) {
        int b = bk / d.NKV, kh = bk % d.NKV;
        const size_t r0 = (size_t)b * T * W, koff = (size_t)Cq + (size_t)kh * hd,
                     voff = (size_t)Cq + (size_t)d.NKV * hd + (size_t)kh * hd;
        const float *k = qkv + r0 + koff, *v = qkv + r0 + voff;
        float *dk = dqkv + r0 + koff, *dv = dqkv + r0 + voff;
        for (int g = 0; g < d.G; g++) {
            int h = kh * d.G + g;
            const float beta = g ? 1.0f : 0.0f;
            const float *q = qkv + r0 + (size_t)h * hd;
            float *dq = dqkv + r0 + (size_t)h * hd;
            const float *dy = dout + (size_t)b * T * Cq + (size_t)h * hd;
            const float *p = att + ((size_t)b * d.NH + h) * T * T;
            float *ds = scratch + ((size_t)b * d.NH + h) * T * T;
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, T, hd, 1.0f, dy, Cq, v, W,
                        0.0f, ds, T);
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, T, hd, T, 1.0f, p, T, dy, Cq,
                        beta, dv, W);
            for (int t = 0; t < T; t++) {
                const float *pr = p + (size_t)t * T;
                float *dr = ds + (size_t)t * T;
                float dot = 0.0f;
                for (int j = 0; j <= t; j++) dot += pr[j] * dr[j];
                for (int j = 0; j <= t; j++) dr[j] = pr[j] * (dr[j] - dot);
                for (int j = t + 1; j < T; j++) dr[j] = 0.0f;
            }
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, hd, T, d.scale, ds, T, k,
                        W, 0.0f, dq, W);
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, T, hd, T, d.scale, ds, T, q, W,
                        beta, dk, W);
        }
    }
}

/* ---- cases and flags ------------------------------------------------------------------ */

typedef struct bench_case { const char *name; int B, T, NH, NKV, hd; const char *note; } bench_case;

static const bench_case cases[] = {
    {"llama-1k", 1, 1024, 32, 8, 128, "Llama-3-like heads (32 query, 8 key/value, hd 128)"},
    {"llama-4k", 1, 4096, 32, 8, 128, "Llama-3-like heads"},
    {"llama-16k", 1, 16384, 8, 2, 128,
     "a quarter of the Llama heads (8 query, 2 key/value): 32 take ~1 min a repetition here"},
    {"gpt2-1k", 4, 1024, 12, 12, 64, "GPT-2 small's heads (12, hd 64), its 1024 positions"},
};
#define NCASES (sizeof cases / sizeof cases[0])

typedef struct bench_cfg {
    const char *only; /* comma list of case names, or NULL: all */
    int reps, warmup;
    bool no_old;
} bench_cfg;

enum { K_STR, K_INT, K_BOOL };
static const struct flag {
    const char *name, *arg, *help;
    int kind;
    size_t offset;
} flags[] = {
    {"cases", "A,B", "cases to run (llama-1k, llama-4k, llama-16k, gpt2-1k) [all]", K_STR,
     offsetof(bench_cfg, only)},
    {"reps", "R", "timed repetitions of each kernel [5]", K_INT, offsetof(bench_cfg, reps)},
    {"warmup", "W", "untimed repetitions first (the first one also checks) [1]", K_INT,
     offsetof(bench_cfg, warmup)},
    {"no-old", NULL, "time the tiled kernel alone", K_BOOL, offsetof(bench_cfg, no_old)},
};
#define NFLAGS (sizeof flags / sizeof flags[0])

/* Returns 0 to run, 1 after --help, 2 after an error line. */
static int parse_args(bench_cfg *cfg, int argc, char **argv) {
    *cfg = (bench_cfg){NULL, 5, 1, false};
    for (int i = 1; i < argc; i++) {
        const struct flag *f = NULL;
        for (size_t k = 0; k < NFLAGS; k++)
            if (!strncmp(argv[i], "--", 2) && !strcmp(argv[i] + 2, flags[k].name)) f = &flags[k];
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            printf("usage: bench_attn [options]\n\nThe cpu backend's tiled attention against the "
                   "pre-tiling T x T one, same run.\n\n");
            for (size_t k = 0; k < NFLAGS; k++)
                printf("  --%-8s %-4s %s\n", flags[k].name, flags[k].arg ? flags[k].arg : "",
                       flags[k].help);
            return 1;
        }
        if (!f) { fy_log_error("bench_attn: unknown argument '%s' (see --help)", argv[i]); return 2; }
        void *field = (char *)cfg + f->offset;
        if (f->kind == K_BOOL) { *(bool *)field = true; continue; }
        if (i + 1 >= argc) { fy_log_error("bench_attn: --%s needs a value", f->name); return 2; }
        const char *val = argv[++i];
        if (f->kind == K_STR) { *(const char **)field = val; continue; }
        int64_t x;
        if (fy_parse_i64(val, &x) != 0 || x < (f->offset == offsetof(bench_cfg, reps)) || x > 1000) {
            fy_log_error("bench_attn: --%s takes a small integer, not '%s'", f->name, val);
            return 2;
        }
        *(int *)field = (int)x;
    }
    return 0;
}

static bool case_selected(const bench_cfg *cfg, const char *name) {
    if (!cfg->only) return true;
    size_t n = strlen(name);
    for (const char *p = cfg->only; *p;) {
        const char *e = strchr(p, ',');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        if (len == n && !strncmp(p, name, n)) return true;
        p += len + (e != NULL);
    }
    return false;
}

/* ---- one case --------------------------------------------------------------------------- */

typedef struct run {
    fy_stream *s;
    int B, T, NH, NKV, hd;
    fy_attn a;
    ref_dims rd;
    float *qkv, *dout;                 /* inputs, shared */
    float *out, *lse, *delta, *dqkv;   /* the tiled kernel's */
    float *rout, *ratt, *rscr, *rdqkv; /* the reference's (NULL: skipped) */
} run;

static void ref_fwd_fn(void *arg) { run *r = arg; ref_attention_fwd(r->rout, r->ratt, r->qkv, r->rd); }
static void ref_bwd_fn(void *arg) {
    run *r = arg;
    ref_attention_bwd(r->rdqkv, r->rscr, r->dout, r->qkv, r->ratt, r->rd);
}

static double cpu_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

/* Times one forward and one backward of the old (old != 0) or new kernel: ms[0] the
 * forward, ms[1] forward + backward (wall), ms[2] the process's cpu time in both (all
 * threads: what a neighbour's load does not stretch, unlike the wall time). */
static void time_one(run *r, bool old, double ms[3]) {
    double c0 = cpu_ms(), t0 = fy_now_ms();
    if (old) fy_stream_host_fn(r->s, ref_fwd_fn, r);
    else fy_k_attention_fwd(r->out, r->lse, r->qkv, r->B, r->T, r->NH, r->NKV, r->hd, &r->a, r->s);
    fy_stream_sync(r->s);
    double t1 = fy_now_ms();
    if (old) fy_stream_host_fn(r->s, ref_bwd_fn, r);
    else fy_k_attention_bwd(r->dqkv, r->delta, r->dout, r->qkv, r->out, r->lse, r->B, r->T, r->NH,
                            r->NKV, r->hd, &r->a, r->s);
    fy_stream_sync(r->s);
    ms[0] = t1 - t0;
    ms[1] = fy_now_ms() - t0;
    ms[2] = cpu_ms() - c0;
}

/* max |a - b| / max |b| over n elements. */
static double rel_diff(const float *a, const float *b, size_t n) {
    double dmax = 0.0, bmax = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]), m = fabs((double)b[i]);
        dmax = d > dmax ? d : dmax;
        bmax = m > bmax ? m : bmax;
    }
    return bmax > 0.0 ? dmax / bmax : dmax;
}

/* The largest relative error (over the row's largest magnitude) of some output rows of
 * the tiled forward against a float64 softmax(scale q.k) v computed here. */
static double spot_check(const run *r) {
    const int T = r->T, hd = r->hd, W = (r->NH + 2 * r->NKV) * hd, Cq = r->NH * hd;
    const int ts[] = {0, 1, 63, 64, T / 3, T / 2 + 7, T - 2, T - 1};
    double worst = 0.0, *p = malloc(sizeof(double) * (size_t)T), *y = malloc(sizeof(double) * (size_t)hd);
    FY_ASSERT(p && y, "out of host memory");
    for (int b = 0; b < r->B; b++)
        for (int h = 0; h < r->NH; h += r->NH / 2 > 0 ? r->NH / 2 : 1)
            for (size_t k = 0; k < sizeof ts / sizeof ts[0]; k++) {
                const int t = ts[k], kh = h / (r->NH / r->NKV);
                const float *q = r->qkv + ((size_t)b * T + t) * W + (size_t)h * hd;
                double mx = -INFINITY, sum = 0.0, ymax = 0.0, dmax = 0.0;
                for (int j = 0; j <= t; j++) {
                    const float *kr = r->qkv + ((size_t)b * T + j) * W + Cq + (size_t)kh * hd;
                    double s = 0.0;
                    for (int c = 0; c < hd; c++) s += (double)q[c] * kr[c];
                    p[j] = s * r->a.scale;
                    mx = p[j] > mx ? p[j] : mx;
                }
                for (int c = 0; c < hd; c++) y[c] = 0.0;
                for (int j = 0; j <= t; j++) {
                    sum += p[j] = exp(p[j] - mx);
                    const float *vr = r->qkv + ((size_t)b * T + j) * W + Cq + (size_t)(r->NKV + kh) * hd;
                    for (int c = 0; c < hd; c++) y[c] += p[j] * vr[c];
                }
                const float *got = r->out + ((size_t)b * T + t) * Cq + (size_t)h * hd;
                for (int c = 0; c < hd; c++) {
                    double want = y[c] / sum, d = fabs(got[c] - want);
                    ymax = fabs(want) > ymax ? fabs(want) : ymax;
                    dmax = d > dmax ? d : dmax;
                }
                double e = ymax > 0.0 ? dmax / ymax : dmax;
                worst = e > worst ? e : worst;
            }
    free(p);
    free(y);
    return worst;
}

static size_t mem_available_nbytes(void) {
    FILE *f = fopen("/proc/meminfo", "r");
    char line[256];
    size_t kb = 0;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %zu kB", &kb) == 1) break;
    if (f) fclose(f);
    return kb * 1024;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* median, min and max of n values (sorted in place) */
static void stats(double *v, int n, double out[3]) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    out[0] = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
    out[1] = v[0];
    out[2] = v[n - 1];
}

static float *alloc_f(fy_dev *dev, size_t n, const char *what) {
    void *p = NULL;
    if (fy_dev_alloc(dev, FY_MEM_DEVICE, n * sizeof(float), what, &p) != FY_OK) return NULL;
    return p;
}

static void fill(float *x, size_t n, uint64_t seed, float lo, float hi) {
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        x[i] = lo + (hi - lo) * (float)((s >> 40) * (1.0 / 16777216.0));
    }
}

/* Runs one case; returns 0, or 1 when a check failed or memory ran out. */
static int run_case(fy_dev *dev, fy_stream *s, const bench_case *c, const bench_cfg *cfg) {
    const size_t W = (size_t)(c->NH + 2 * c->NKV) * c->hd, nqkv = (size_t)c->B * c->T * W,
                 nout = (size_t)c->B * c->T * c->NH * c->hd, nrow = (size_t)c->B * c->NH * c->T,
                 ntt = nrow * (size_t)c->T;
    run r = {.s = s, .B = c->B, .T = c->T, .NH = c->NH, .NKV = c->NKV, .hd = c->hd,
             .a = {.scale = 1.0f / sqrtf((float)c->hd)},
             .rd = {c->B, c->T, c->NH, c->NKV, c->hd, c->NH / c->NKV, (int)W, 1.0f / sqrtf((float)c->hd)}};
    int rc = 1;
    printf("\n== %s: B=%d T=%d NH=%d NKV=%d hd=%d (%s)\n", c->name, c->B, c->T, c->NH, c->NKV,
           c->hd, c->note);
    r.qkv = alloc_f(dev, nqkv, "qkv"), r.dqkv = alloc_f(dev, nqkv, "dqkv");
    r.out = alloc_f(dev, nout, "out"), r.dout = alloc_f(dev, nout, "dout");
    r.lse = alloc_f(dev, nrow, "lse"), r.delta = alloc_f(dev, nrow, "delta");
    if (!r.qkv || !r.dqkv || !r.out || !r.dout || !r.lse || !r.delta) goto done;
    fill(r.qkv, nqkv, 1, -1.5f, 1.5f);
    fill(r.dout, nout, 2, -1.0f, 1.0f);
    bool old = !cfg->no_old;
    const size_t old_nbytes = 2 * ntt * sizeof(float), avail = mem_available_nbytes();
    if (old && old_nbytes > avail / 2) {
        printf("old kernel skipped: its two (B,NH,T,T) buffers take %.1f GiB, more than half "
               "the %.1f GiB available now\n", old_nbytes / 1073741824.0, avail / 1073741824.0);
        old = false;
    } else if (old) {
        r.rout = alloc_f(dev, nout, "ref out"), r.rdqkv = alloc_f(dev, nqkv, "ref dqkv");
        r.ratt = alloc_f(dev, ntt, "ref P"), r.rscr = alloc_f(dev, ntt, "ref dS");
        if (!r.rout || !r.rdqkv || !r.ratt || !r.rscr) goto done;
    }
    const int n = cfg->reps;
    /* new fwd, new all, old fwd, old all (wall), new all, old all (cpu), ratios */
    double *v = calloc((size_t)9 * n, sizeof(double));
    FY_ASSERT(v, "out of host memory");
    double *nf = v, *na = v + n, *of = v + 2 * n, *oa = v + 3 * n, *nc = v + 4 * n, *oc = v + 5 * n;
    double *rf = v + 6 * n, *ra = v + 7 * n, *rcpu = v + 8 * n;
    for (int i = -cfg->warmup; i < n; i++) {
        double mn[3], mo[3] = {0, 0, 0};
        const bool old_first = old && (i & 1);
        if (old_first) time_one(&r, true, mo);
        time_one(&r, false, mn);
        if (old && !old_first) time_one(&r, true, mo);
        if (i == -cfg->warmup) { /* the first run: check */
            double e_spot = spot_check(&r);
            printf("check: out rows vs float64 %.2e", e_spot);
            bool ok = e_spot <= 1e-5;
            if (old) {
                double eo = rel_diff(r.out, r.rout, nout), ed = rel_diff(r.dqkv, r.rdqkv, nqkv);
                printf(", out vs old %.2e, dqkv vs old %.2e", eo, ed);
                ok = ok && eo <= 1e-5 && ed <= 1e-5;
            }
            printf(" (max |diff| / max |ref|, bound 1e-5): %s\n", ok ? "ok" : "FAILED");
            if (!ok) { free(v); goto done; }
        }
        if (i < 0) continue;
        nf[i] = mn[0], na[i] = mn[1], of[i] = mo[0], oa[i] = mo[1], nc[i] = mn[2], oc[i] = mo[2];
        rf[i] = old ? mo[0] / mn[0] : 0, ra[i] = old ? mo[1] / mn[1] : 0;
        rcpu[i] = old ? mo[2] / mn[2] : 0;
    }
    double st[3];
    printf("%-26s %10s %10s %10s\n", "ms", "median", "min", "max");
    const char *names[] = {"new fwd", "new fwd+bwd", "old fwd", "old fwd+bwd",
                           "new fwd+bwd, cpu time", "old fwd+bwd, cpu time"};
    for (int k = 0; k < 6; k++) {
        if (!old && (k == 2 || k == 3 || k == 5)) continue;
        stats(v + (size_t)k * n, n, st);
        printf("%-26s %10.1f %10.1f %10.1f\n", names[k], st[0], st[1], st[2]);
    }
    const char *rnames[] = {"ratio old/new fwd", "ratio old/new fwd+bwd", "ratio old/new cpu time"};
    for (int k = 0; old && k < 3; k++) {
        stats(v + (size_t)(6 + k) * n, n, st);
        printf("%-26s %10.2f %10.2f %10.2f\n", rnames[k], st[0], st[1], st[2]);
    }
    free(v);
    rc = 0;
done:
    if (rc) printf("case %s failed (a check, or out of memory)\n", c->name);
    float *bufs[] = {r.qkv, r.dqkv, r.out, r.dout, r.lse, r.delta, r.rout, r.rdqkv, r.ratt, r.rscr};
    for (size_t k = 0; k < sizeof bufs / sizeof bufs[0]; k++) fy_dev_release(dev, bufs[k]);
    return rc;
}

int main(int argc, char **argv) {
    bench_cfg cfg;
    int rc = parse_args(&cfg, argc, argv);
    if (rc) return rc == 1 ? 0 : 2;
    fy_dev *dev = NULL;
    fy_stream *s = NULL;
    if (fy_dev_new(&(fy_dev_cfg){.kind = FY_DEV_CPU}, &dev) != FY_OK ||
        fy_stream_new(dev, "attn", &s) != FY_OK) {
        fy_dev_free(dev);
        return 1;
    }
    printf("bench_attn: %s, %d timed repetitions after %d warm-up, kernels alternating\n",
           fy_dev_name(dev), cfg.reps, cfg.warmup);
    for (size_t k = 0; k < NCASES; k++)
        if (case_selected(&cfg, cases[k].name)) rc |= run_case(dev, s, &cases[k], &cfg);
    fy_stream_free(s);
    fy_dev_free(dev);
    return rc;
}
