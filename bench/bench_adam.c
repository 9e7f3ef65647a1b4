/* bench_adam.c — `ferry bench adam`: how close the host AdamW step comes to the memory
 * bandwidth of this machine.
 *
 * In one run, on the same pinned pool threads and on memory placed and pre-touched the
 * same way (fy_adam_mem_alloc), it times:
 *   - the AdamW step over N parameters (fp32 master, m, v; gradients in; optional copy out),
 *   - a read-modify-write stream b[i] += s*c[i] over two fp32 arrays whose total size is
 *     that of the Adam arrays (the reference: the bandwidth a loop that reads two streams
 *     and writes one back gets here; widest SIMD the CPU has),
 *   - the scalar reference path on the same pool.
 * Adam and the stream alternate run by run, so noise from other tenants hits both; the
 * median of the timed runs after warm-up is reported.
 *
 * Bytes are counted as the loop asks for them: per parameter 12 read + 12 written (w, m,
 * v) plus the gradient read plus the copy written; per stream element 8 read + 4 written.
 * ratio_to_rmw is Adam's effective GB/s over the stream's, the median over the runs of
 * that ratio for each back-to-back pair (the bandwidth a shared machine gives varies by
 * up to 2x from second to second; both halves of a pair see the same).
 *
 * Every array comes from fy_adam_mem_alloc (pinned-thread first touch, huge pages,
 * staggered colours) and holds distinct values in every page (a hypervisor merging
 * identical pages would serve a constant array from one cached page). */
#include "bench/bench_adam.h"

#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/status.h"
#include "engine/core/util.h"
#include "optim_cpu/adam.h"
#include "optim_cpu/adam_pool.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define BENCH_X86 1
#endif

typedef struct bench_cfg {
    int64_t params, threads, repeats, warmup, scalar_repeats, tile;
    fy_dtype grad_dtype, out_dtype;
    fy_adam_path path;
    bool check_finite;
} bench_cfg;

/* ---- flags: one table parses, checks and prints --help ------------------------------ */

enum { K_COUNT, K_INT, K_GRAD, K_OUT, K_PATH, K_BOOL };

static const struct flag {
    const char *name, *arg, *def, *help;
    int kind;
    size_t offset;
    int64_t min, max;
} flags[] = {
    {"params", "N", "100M", "parameters per step (suffix k, M, G: 1e3, 1e6, 1e9)", K_COUNT,
     offsetof(bench_cfg, params), 1, 4000000000},
    {"threads", "T", "0", "pool threads (0: one per CPU this process may run on)", K_INT,
     offsetof(bench_cfg, threads), 0, 4096},
    {"grad-dtype", "fp32|bf16|fp16", "bf16", "gradient dtype", K_GRAD,
     offsetof(bench_cfg, grad_dtype), 0, 0},
    {"out-dtype", "none|bf16|fp16|fp32", "bf16", "dtype of the copy of the updated weights",
     K_OUT, offsetof(bench_cfg, out_dtype), 0, 0},
    {"repeats", "R", "11", "timed runs; the median is reported", K_INT,
     offsetof(bench_cfg, repeats), 1, 1000},
    {"warmup", "W", "2", "untimed runs first", K_INT, offsetof(bench_cfg, warmup), 0, 100},
    {"scalar-repeats", "R", "3", "timed runs of the scalar reference (0: skip it)", K_INT,
     offsetof(bench_cfg, scalar_repeats), 0, 1000},
    {"path", "auto|scalar|avx2|avx512|avx512bf16", "auto", "AdamW code path", K_PATH,
     offsetof(bench_cfg, path), 0, 0},
    {"tile", "N", "0",
     "issue the step as one pool call per N parameters, as a scheduler would (0: one call)",
     K_COUNT, offsetof(bench_cfg, tile), 0, 4000000000},
    {"check-finite", NULL, NULL, "scan all gradients for NaN/Inf before updating", K_BOOL,
     offsetof(bench_cfg, check_finite), 0, 0},
};
#define NFLAGS (sizeof flags / sizeof flags[0])

static void print_help(void) {
    printf("usage: ferry bench adam [options]\n\n"
           "Times the AdamW step on the host against a read-modify-write stream of the same\n"
           "total size and the scalar reference, in the same run. Prints a table and, last,\n"
           "one JSON line.\n\n");
    for (size_t k = 0; k < NFLAGS; k++) {
        char left[64];
        snprintf(left, sizeof left, "--%s%s%s", flags[k].name, flags[k].arg ? " " : "",
                 flags[k].arg ? flags[k].arg : "");
        printf("  %-40s %s", left, flags[k].help);
        if (flags[k].def) printf(" [%s]", flags[k].def);
        printf("\n");
    }
}

/* "100M", "2.5e6", "4096": a positive count with an optional decimal suffix. */
static int parse_count(const char *s, int64_t *out) {
    char *end;
    double v = strtod(s, &end);
    if (end == s) return -1;
    double mul = 1.0;
    if (*end == 'k' || *end == 'K') mul = 1e3, end++;
    else if (*end == 'M') mul = 1e6, end++;
    else if (*end == 'G') mul = 1e9, end++;
    if (*end || !(v >= 0) || v * mul > 9e18 || v * mul != floor(v * mul)) return -1;
    *out = (int64_t)(v * mul);
    return 0;
}

static int set_flag(bench_cfg *cfg, const struct flag *f, const char *val) {
    void *field = (char *)cfg + f->offset;
    int64_t x;
    fy_dtype t;
    fy_adam_path p;
    switch (f->kind) {
    case K_COUNT:
    case K_INT:
        if ((f->kind == K_COUNT ? parse_count(val, &x) : fy_parse_i64(val, &x)) != 0 ||
            x < f->min || x > f->max) {
            fy_log_error("bench adam: --%s takes %s in [%lld, %lld], not '%s'", f->name,
                         f->kind == K_COUNT ? "a count" : "an integer", (long long)f->min,
                         (long long)f->max, val);
            return -1;
        }
        *(int64_t *)field = x;
        return 0;
    case K_GRAD:
    case K_OUT:
        if (fy_dtype_parse(val, &t) != 0 || (f->kind == K_GRAD && t == FY_DTYPE_NONE)) {
            fy_log_error("bench adam: --%s takes %s, not '%s'", f->name, f->arg, val);
            return -1;
        }
        *(fy_dtype *)field = t;
        return 0;
    case K_PATH:
        if (fy_adam_path_parse(val, &p) != 0) {
            fy_log_error("bench adam: --%s takes %s, not '%s'", f->name, f->arg, val);
            return -1;
        }
        *(fy_adam_path *)field = p;
        return 0;
    default:
        *(bool *)field = true;
        return 0;
    }
}

/* Returns 0 to run, 1 after --help, 2 after an error line. */
static int parse_args(bench_cfg *cfg, int argc, char **argv) {
    memset(cfg, 0, sizeof *cfg);
    for (size_t k = 0; k < NFLAGS; k++)
        if (flags[k].def) FY_ASSERT(set_flag(cfg, &flags[k], flags[k].def) == 0, "bad default");
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { print_help(); return 1; }
        if (strncmp(a, "--", 2) != 0) {
            fy_log_error("bench adam: unexpected argument '%s' (see --help)", a);
            return 2;
        }
        const char *name = a + 2, *eq = strchr(name, '=');
        size_t len = eq ? (size_t)(eq - name) : strlen(name);
        const struct flag *f = NULL;
        for (size_t k = 0; k < NFLAGS; k++)
            if (strlen(flags[k].name) == len && !strncmp(flags[k].name, name, len)) f = &flags[k];
        if (!f) {
            fy_log_error("bench adam: unknown flag '%s' (see --help)", a);
            return 2;
        }
        const char *val = eq ? eq + 1 : NULL;
        if (f->kind == K_BOOL) {
            if (val) {
                fy_log_error("bench adam: --%s takes no value", f->name);
                return 2;
            }
        } else if (!val) {
            if (i + 1 >= argc) {
                fy_log_error("bench adam: --%s needs a value (%s)", f->name, f->arg);
                return 2;
            }
            val = argv[++i];
        }
        if (set_flag(cfg, f, val) != 0) return 2;
    }
    if (!fy_adam_path_supported(cfg->path)) {
        fy_log_error("bench adam: this CPU has no %s path (best: %s)",
                     fy_adam_path_name(cfg->path), fy_adam_path_name(fy_adam_path_best()));
        return 2;
    }
    return 0;
}

/* ---- the read-modify-write stream ------------------------------------------------- */

typedef void (*rmw_fn)(float *b, const float *c, float s, size_t lo, size_t hi);

static void rmw_scalar(float *b, const float *c, float s, size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; i++) b[i] += s * c[i];
}

#ifdef BENCH_X86
__attribute__((target("avx512f"))) static void rmw_avx512(float *b, const float *c, float s,
                                                          size_t lo, size_t hi) {
    __m512 sv = _mm512_set1_ps(s);
    size_t i = lo;
    for (; i + 32 <= hi; i += 32) {
        __m512 x = _mm512_fmadd_ps(sv, _mm512_loadu_ps(c + i), _mm512_loadu_ps(b + i));
        __m512 y = _mm512_fmadd_ps(sv, _mm512_loadu_ps(c + i + 16), _mm512_loadu_ps(b + i + 16));
        _mm512_storeu_ps(b + i, x);
        _mm512_storeu_ps(b + i + 16, y);
    }
    rmw_scalar(b, c, s, i, hi);
}

__attribute__((target("avx2,fma"))) static void rmw_avx2(float *b, const float *c, float s,
                                                         size_t lo, size_t hi) {
    __m256 sv = _mm256_set1_ps(s);
    size_t i = lo;
    for (; i + 16 <= hi; i += 16) {
        __m256 x = _mm256_fmadd_ps(sv, _mm256_loadu_ps(c + i), _mm256_loadu_ps(b + i));
        __m256 y = _mm256_fmadd_ps(sv, _mm256_loadu_ps(c + i + 8), _mm256_loadu_ps(b + i + 8));
        _mm256_storeu_ps(b + i, x);
        _mm256_storeu_ps(b + i + 8, y);
    }
    rmw_scalar(b, c, s, i, hi);
}
#endif

static rmw_fn pick_rmw(const char **name) {
#ifdef BENCH_X86
    if (__builtin_cpu_supports("avx512f")) { *name = "avx512"; return rmw_avx512; }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        *name = "avx2";
        return rmw_avx2;
    }
#endif
    *name = "scalar";
    return rmw_scalar;
}

/* ---- jobs on the pool ------------------------------------------------------------ */

typedef struct bench_ctx {
    size_t n, n_rmw;
    float *param, *m, *v, *b, *c;
    void *grad, *out;
    fy_dtype grad_dtype;
    rmw_fn rmw;
} bench_ctx;

/* thread t's share of [0, n), in multiples of 64 elements */
static void share(size_t n, int t, int T, size_t *lo, size_t *hi) {
    *lo = t == 0 ? 0 : fy_round_up(n * (size_t)t / (size_t)T, 64);
    *hi = t == T - 1 ? n : fy_round_up(n * (size_t)(t + 1) / (size_t)T, 64);
    if (*lo > n) *lo = n;
    if (*hi > n) *hi = n;
}

static uint32_t hash32(uint64_t x) {
    x = (x ^ (x >> 33)) * 0xff51afd7ed558ccdull;
    x = (x ^ (x >> 33)) * 0xc4ceb9fe1a85ec53ull;
    return (uint32_t)(x >> 32);
}

/* weights in (-1, 1), gradients in (-1e-2, 1e-2); moments start at zero (mmap) */
static void init_job(void *arg, int t, int T) {
    bench_ctx *x = arg;
    size_t lo, hi;
    share(x->n, t, T, &lo, &hi);
    for (size_t i = lo; i < hi; i++) {
        uint32_t h = hash32(i);
        x->param[i] = ((float)(h & 0xffff) - 32767.5f) * (1.0f / 32768.0f);
        float g = ((float)(h >> 16) - 32767.5f) * (1e-2f / 32768.0f);
        switch (x->grad_dtype) {
        case FY_BF16: ((uint16_t *)x->grad)[i] = fy_f32_to_bf16(g); break;
        case FY_F16: ((uint16_t *)x->grad)[i] = fy_f32_to_f16(g); break;
        default: ((float *)x->grad)[i] = g; break;
        }
    }
    /* distinct values in every page: a hypervisor that merges identical pages (KSM)
     * would otherwise serve a constant array from one cached page */
    share(x->n_rmw, t, T, &lo, &hi);
    for (size_t i = lo; i < hi; i++) {
        uint32_t h = hash32(i + 0x9e3779b97f4a7c15ull);
        x->b[i] = (float)(h & 0xffff) * (1.0f / 65536.0f);
        x->c[i] = (float)(h >> 16) * (1.0f / 65536.0f);
    }
}

static void rmw_job(void *arg, int t, int T) {
    bench_ctx *x = arg;
    size_t lo, hi;
    share(x->n_rmw, t, T, &lo, &hi);
    x->rmw(x->b, x->c, 1e-3f, lo, hi);
}

/* ---- timing ---------------------------------------------------------------------- */

typedef struct stats { double median, min, max; } stats;

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static stats summarize(double *ms, int n) {
    qsort(ms, (size_t)n, sizeof *ms, cmp_double);
    stats s = {n % 2 ? ms[n / 2] : 0.5 * (ms[n / 2 - 1] + ms[n / 2]), ms[0], ms[n - 1]};
    return s;
}

static fy_status adam_once(fy_adam_pool *pool, fy_adam_path path, const bench_cfg *cfg,
                           const fy_adam_range *r, int64_t step, double *ms) {
    fy_adam_hparams hp = {.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f,
                          .weight_decay = 0.01f, .step = step, .grad_scale = 1.0f,
                          .check_finite = cfg->check_finite};
    double t0 = fy_now_ms();
    if (cfg->tile > 0) {
        for (size_t lo = 0; lo < r->n; lo += (size_t)cfg->tile) {
            size_t hi = r->n - lo > (size_t)cfg->tile ? lo + (size_t)cfg->tile : r->n;
            fy_adam_range sub;
            fy_adam_range_slice(r, lo, hi, &sub);
            FY_TRY(fy_adam_pool_step_path(pool, path, &hp, &sub));
        }
    } else {
        FY_TRY(fy_adam_pool_step_path(pool, path, &hp, r));
    }
    *ms = fy_now_ms() - t0;
    return FY_OK;
}

static int run(const bench_cfg *cfg) {
    int rc = 1;
    fy_adam_pool *pool = NULL;
    bench_ctx x = {.n = (size_t)cfg->params, .grad_dtype = cfg->grad_dtype};
    size_t gsz = fy_dtype_size(cfg->grad_dtype), osz = fy_dtype_size(cfg->out_dtype);
    size_t bytes_per_param = 24 + gsz + osz;
    size_t state_nbytes = x.n * (12 + gsz + osz);
    x.n_rmw = state_nbytes / 8;
    double *adam_ms = calloc((size_t)cfg->repeats, sizeof(double));
    double *rmw_ms = calloc((size_t)cfg->repeats, sizeof(double));
    double *ratios = calloc((size_t)cfg->repeats, sizeof(double));
    double *scalar_ms = calloc((size_t)cfg->scalar_repeats + 1, sizeof(double));
    if (!adam_ms || !rmw_ms || !ratios || !scalar_ms) goto done;
    if (fy_adam_pool_new((int)cfg->threads, &pool) != FY_OK) goto done;
    int T = fy_adam_pool_threads(pool);
    const char *rmw_name;
    x.rmw = pick_rmw(&rmw_name);
    if (fy_adam_mem_alloc(pool, x.n * 4, (void **)&x.param) != FY_OK ||
        fy_adam_mem_alloc(pool, x.n * 4, (void **)&x.m) != FY_OK ||
        fy_adam_mem_alloc(pool, x.n * 4, (void **)&x.v) != FY_OK ||
        fy_adam_mem_alloc(pool, x.n * gsz, &x.grad) != FY_OK ||
        fy_adam_mem_alloc(pool, x.n * osz, &x.out) != FY_OK ||
        fy_adam_mem_alloc(pool, x.n_rmw * 4, (void **)&x.b) != FY_OK ||
        fy_adam_mem_alloc(pool, x.n_rmw * 4, (void **)&x.c) != FY_OK)
        goto done;
    fy_adam_pool_run(pool, init_job, &x);

    fy_adam_path path = cfg->path == FY_ADAM_PATH_AUTO ? fy_adam_path_best() : cfg->path;
    fy_adam_range r = {.param = x.param, .m = x.m, .v = x.v, .grad = x.grad,
                       .grad_dtype = cfg->grad_dtype, .param_out = osz ? x.out : NULL,
                       .out_dtype = cfg->out_dtype, .n = x.n, .decay = true};
    char sz[32], sz2[32], cpus[128] = "";
    for (int t = 0, len = 0; t < T && len < (int)sizeof cpus - 8; t++)
        len += snprintf(cpus + len, sizeof cpus - (size_t)len, "%s%d", t ? "," : "",
                        fy_adam_pool_cpu(pool, t));
    printf("ferry bench adam: %lld params, %d threads (cpus %s), grad %s, out %s, path %s%s\n",
           (long long)cfg->params, T, cpus, fy_dtype_name(cfg->grad_dtype),
           fy_dtype_name(cfg->out_dtype), fy_adam_path_name(path),
           cfg->check_finite ? ", finite check" : "");
    printf("arrays: adam %s, rmw stream 2 x %s (%s); %lld timed runs after %lld warm-up, "
           "%s per step\n",
           fy_fmt_size(state_nbytes, sz, sizeof sz), fy_fmt_size(x.n_rmw * 4, sz2, sizeof sz2),
           rmw_name, (long long)cfg->repeats, (long long)cfg->warmup,
           cfg->tile > 0 ? "one pool call per tile" : "one pool call");
    fflush(stdout);

    int64_t step = 1;
    for (int64_t k = 0; k < cfg->warmup + cfg->repeats; k++) {
        double ms;
        if (adam_once(pool, path, cfg, &r, step++, &ms) != FY_OK) goto done;
        if (k >= cfg->warmup) adam_ms[k - cfg->warmup] = ms;
        double t0 = fy_now_ms();
        fy_adam_pool_run(pool, rmw_job, &x);
        if (k >= cfg->warmup) rmw_ms[k - cfg->warmup] = fy_now_ms() - t0;
    }
    for (int64_t k = 0; k < (cfg->scalar_repeats ? cfg->scalar_repeats + 1 : 0); k++) {
        double ms;
        if (adam_once(pool, FY_ADAM_PATH_SCALAR, cfg, &r, step++, &ms) != FY_OK) goto done;
        if (k > 0) scalar_ms[k - 1] = ms; /* the first is a warm-up */
    }

    /* the ratio of each back-to-back pair, so a change of the machine's bandwidth between
     * runs (other tenants) moves both sides of a ratio alike */
    for (int64_t k = 0; k < cfg->repeats; k++)
        ratios[k] = ((double)bytes_per_param * (double)x.n / adam_ms[k]) /
                    (12.0 * (double)x.n_rmw / rmw_ms[k]);
    stats sa = summarize(adam_ms, (int)cfg->repeats), sr = summarize(rmw_ms, (int)cfg->repeats);
    double params_per_s = (double)x.n / (sa.median * 1e-3);
    double effective_gbps = params_per_s * (double)bytes_per_param * 1e-9;
    double rmw_gbps = (double)x.n_rmw * 12.0 / (sr.median * 1e-3) * 1e-9;
    stats sq = summarize(ratios, (int)cfg->repeats);
    double ratio = sq.median;
    stats ss = {0, 0, 0};
    double scalar_pps = 0, speedup = 0;
    if (cfg->scalar_repeats) {
        ss = summarize(scalar_ms, (int)cfg->scalar_repeats);
        scalar_pps = (double)x.n / (ss.median * 1e-3);
        speedup = params_per_s / scalar_pps;
    }
    printf("\n%-34s %10s %10s %10s %12s %9s\n", "", "median ms", "min ms", "max ms",
           "G elem/s", "GB/s");
    char label[64];
    snprintf(label, sizeof label, "adam %s (%zu B/param)", fy_adam_path_name(path), bytes_per_param);
    printf("%-34s %10.2f %10.2f %10.2f %12.3f %9.1f\n", label, sa.median, sa.min, sa.max,
           params_per_s * 1e-9, effective_gbps);
    printf("%-34s %10.2f %10.2f %10.2f %12.3f %9.1f\n", "rmw b[i] += s*c[i] (12 B/elem)",
           sr.median, sr.min, sr.max, (double)x.n_rmw / (sr.median * 1e-3) * 1e-9, rmw_gbps);
    if (cfg->scalar_repeats)
        printf("%-34s %10.2f %10.2f %10.2f %12.3f %9.1f\n", "adam scalar (reference)", ss.median,
               ss.min, ss.max, scalar_pps * 1e-9, scalar_pps * (double)bytes_per_param * 1e-9);
    printf("\nratio_to_rmw %.3f (median of back-to-back pairs; range %.3f..%.3f)", ratio, sq.min,
           sq.max);
    if (cfg->scalar_repeats) printf(", speedup_vs_scalar %.2f", speedup);
    printf("\n");
    printf("{\"bench\":\"adam\",\"params\":%lld,\"threads\":%d,\"grad_dtype\":\"%s\","
           "\"out_dtype\":\"%s\",\"path\":\"%s\",\"tile\":%lld,\"check_finite\":%s,"
           "\"repeats\":%lld,\"step_ms\":%.3f,\"params_per_s\":%.6g,\"bytes_per_param\":%zu,"
           "\"effective_gbps\":%.2f,\"rmw_ms\":%.3f,\"rmw_gbps\":%.2f,\"ratio_to_rmw\":%.3f,",
           (long long)cfg->params, T, fy_dtype_name(cfg->grad_dtype),
           fy_dtype_name(cfg->out_dtype), fy_adam_path_name(path), (long long)cfg->tile,
           cfg->check_finite ? "true" : "false", (long long)cfg->repeats, sa.median,
           params_per_s, bytes_per_param, effective_gbps, sr.median, rmw_gbps, ratio);
    if (cfg->scalar_repeats)
        printf("\"scalar_params_per_s\":%.6g,\"speedup_vs_scalar\":%.2f}\n", scalar_pps, speedup);
    else
        printf("\"scalar_params_per_s\":null,\"speedup_vs_scalar\":null}\n");
    rc = 0;
done:
    if (rc) fy_log_error("bench adam: could not run (%s)", fy_last_error());
    fy_adam_mem_free(x.param, x.n * 4);
    fy_adam_mem_free(x.m, x.n * 4);
    fy_adam_mem_free(x.v, x.n * 4);
    fy_adam_mem_free(x.grad, x.n * gsz);
    fy_adam_mem_free(x.out, x.n * osz);
    fy_adam_mem_free(x.b, x.n_rmw * 4);
    fy_adam_mem_free(x.c, x.n_rmw * 4);
    fy_adam_pool_free(pool);
    free(adam_ms);
    free(rmw_ms);
    free(ratios);
    free(scalar_ms);
    return rc;
}

int fy_bench_adam_main(int argc, char **argv) {
    bench_cfg cfg;
    int rc = parse_args(&cfg, argc, argv);
    if (rc == 1) return 0;
    if (rc) return 2;
    return run(&cfg);
}
