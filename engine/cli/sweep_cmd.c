/* sweep_cmd.c — `ferry sweep`: run (or simulate) a grid of offload configurations and
 * lay the tuner's prediction beside the measurement.
 *
 * --grid 'offload_params=0:1:0.25,offload_optim=0,0.5,1,ckpt=0,L,micro=1,2' : axes are
 * offload_params, offload_optim (ratios), ckpt (layers; L = all) and micro (micro-batch;
 * the batch is --batch, accumulation fills it). A value is a number, a range a:b:step, or
 * L; a bare value after an axis adds to it. Every combination runs --steps steps on the
 * cpu backend (median step time over steps 2..N, device peak) unless --simulate, and is
 * predicted from the profile. Writes DIR/sweep.csv, DIR/summary.txt, and, when gnuplot
 * is installed, DIR/measured_vs_predicted.png and DIR/throughput.png. */
#include "engine/cli/sweep_cmd.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/cli/tune_cmd.h"
#include "engine/trainer.h"
#include "engine/core/util.h"
#include "engine/io/corpus.h"
#include "engine/io/tokens.h"
#include "tuner/tune.h"

#define MAX_VALUES 64

typedef struct axis { double v[MAX_VALUES]; int n; } axis;
enum { AX_PARAMS = 0, AX_OPTIM, AX_CKPT, AX_MICRO, AX_COUNT };
static const char *axis_names[AX_COUNT] = {"offload_params", "offload_optim", "ckpt", "micro"};

static int add_values(axis *a, const char *tok, int L) {
    double lo, hi, step;
    if (!strcmp(tok, "L")) { if (a->n < MAX_VALUES) a->v[a->n++] = L; return 0; }
    char range[64], *c1, *c2;
    snprintf(range, sizeof range, "%s", tok);
    if ((c1 = strchr(range, ':')) && (c2 = strchr(c1 + 1, ':'))) { /* lo:hi:step */
        *c1 = *c2 = 0;
        if (fy_parse_f64(range, &lo) || fy_parse_f64(c1 + 1, &hi) || fy_parse_f64(c2 + 1, &step))
            return -1;
        if (!(step > 0) || hi < lo) return -1;
        for (double x = lo; x <= hi + 1e-9 && a->n < MAX_VALUES; x += step) a->v[a->n++] = x;
        return 0;
    }
    double x;
    if (fy_parse_f64(tok, &x) != 0) return -1;
    if (a->n < MAX_VALUES) a->v[a->n++] = x;
    return 0;
}

static fy_status parse_grid(const char *grid, int L, axis ax[AX_COUNT]) {
    memset(ax, 0, AX_COUNT * sizeof *ax);
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", grid);
    int cur = -1;
    for (char *save, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(tok, '=');
        if (eq) {
            *eq = 0;
            cur = -1;
            for (int i = 0; i < AX_COUNT; i++) if (!strcmp(tok, axis_names[i])) cur = i;
            if (cur < 0) {
                fy_log_error("--grid: unknown axis '%s' (offload_params, offload_optim, ckpt, micro)", tok);
                return FY_ERR_INVALID;
            }
            tok = eq + 1;
        }
        if (cur < 0 || add_values(&ax[cur], tok, L)) {
            fy_log_error("--grid: cannot read '%s' (axis=value, axis=a:b:step, or L)", tok);
            return FY_ERR_INVALID;
        }
    }
    for (int i = 0; i < AX_COUNT; i++)
        for (int k = 0; k < ax[i].n; k++) {
            double x = ax[i].v[k];
            bool ok = i < AX_CKPT ? x >= 0 && x <= 1 : i == AX_CKPT ? x >= 0 && x <= L && x == floor(x)
                                                                      : x >= 1 && x <= 65536 && x == floor(x);
            if (!ok) {
                fy_log_error("--grid: %s value %g is out of range", axis_names[i], x);
                return FY_ERR_INVALID;
            }
        }
    return FY_OK;
}

static fy_status next_batch(void *ctx, int64_t micro, int32_t *x, int32_t *y, int32_t *docs) {
    FY_TRY(fy_loader_seek_batch(ctx, micro));
    fy_loader_next(ctx, x, y, docs);
    return FY_OK;
}

typedef struct measured { double step_ms, busy[FY_LANE_COUNT]; size_t peak; } measured;

static fy_status measure(const fy_opts *o, const fy_model *model, const fy_plan *plan,
                         const fy_tokens *tok, int steps, measured *out) {
    fy_dev_cfg dc;
    FY_TRY(fy_opts_dev_cfg(o, true, &dc));
    fy_dev *dev;
    FY_TRY(fy_dev_new(&dc, &dev));
    fy_trainer_cfg tc = {.model = model, .T = (int)o->seq, .beta1 = 0.9f, .beta2 = 0.95f,
                         .eps = 1e-8f, .weight_decay = 0.1f, .clip = 1.0f, .seed = 1,
                         .plan = plan, .adam_threads = (int)o->adam_threads,
                         .schedule = fy_opts_schedule(o)};
    fy_trainer *tr = NULL;
    fy_loader *ld = NULL;
    float *lrs = calloc((size_t)steps, sizeof *lrs);
    fy_step_stats *st = calloc((size_t)steps, sizeof *st);
    fy_status s = lrs && st ? FY_OK : FY_ERR_NOMEM;
    if (s == FY_OK) s = fy_trainer_new(dev, &tc, &tr);
    if (s == FY_OK) s = fy_loader_new(tok, 0, fy_tokens_count(tok), plan->micro_batch, (int)o->seq, &ld);
    fy_sched_result res = {0};
    fy_graph g;
    if (s == FY_OK) {
        for (int i = 0; i < steps; i++) lrs[i] = 1e-3f;
        fy_window w = {.nsteps = steps, .lrs = lrs, .next_batch = next_batch, .batch_ctx = ld,
                       .stats = st, .trace = &res, .graph = &g};
        s = fy_trainer_run(tr, &w);
    }
    if (s == FY_OK) {
        double *ms = malloc((size_t)steps * sizeof *ms);
        int n = 0;
        for (int i = 1; i < steps; i++) ms[n++] = st[i].step_ms;
        for (int i = 1; i < n; i++) /* insertion sort: n is small */
            for (int j = i; j > 0 && ms[j] < ms[j - 1]; j--) { double t = ms[j]; ms[j] = ms[j - 1]; ms[j - 1] = t; }
        out->step_ms = n ? (n % 2 ? ms[n / 2] : 0.5 * (ms[n / 2 - 1] + ms[n / 2])) : st[0].step_ms;
        free(ms);
        for (int l = 0; l < FY_LANE_COUNT; l++) out->busy[l] = res.busy_ms[l] / steps;
        fy_dev_mem_stats m;
        fy_dev_mem_stats_get(dev, &m);
        out->peak = m.peak_nbytes[FY_MEM_DEVICE];
        fy_sched_result_free(&res);
        fy_graph_free(&g);
    }
    fy_loader_free(ld);
    fy_trainer_free(tr);
    fy_dev_free(dev);
    free(lrs);
    free(st);
    return s;
}

static const char *const plot_files[] = {"measured_vs_predicted.png", "throughput.png", NULL};

bool fy_sweep_owns(const char *name) {
    if (!strcmp(name, "sweep.csv") || !strcmp(name, "summary.txt")) return true;
    for (int i = 0; plot_files[i]; i++)
        if (!strcmp(name, plot_files[i])) return true;
    return false;
}

/* A new file at dir/name for writing: what was there is unlinked first (a file of an
 * earlier sweep, or a link planted there: never followed, never truncated through a hard
 * link), then the name is created afresh. NULL (errno set) if it cannot be. */
static FILE *fresh(const char *dir, const char *name, char *path, size_t cap) {
    snprintf(path, cap, "%s/%s", dir, name);
    if (unlink(path) != 0 && errno != ENOENT) return NULL;
    const int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;
    if (fd >= 0 && !f) close(fd);
    return f;
}

static void plots(const char *dir) {
    if (system("command -v gnuplot >/dev/null 2>&1") != 0) {
        fy_log_info("gnuplot is not installed: no plots (sweep.csv has every number)");
        return;
    }
    char path[4200];
    for (int i = 0; plot_files[i]; i++) { /* gnuplot opens them as they are: make them afresh */
        FILE *f = fresh(dir, plot_files[i], path, sizeof path);
        if (!f) {
            fy_log_warn("cannot write %s: %s; no plots", path, strerror(errno));
            return;
        }
        fclose(f);
    }
    char cmd[8192];
    snprintf(cmd, sizeof cmd,
             "cd '%s' && gnuplot -e \"set datafile separator ','; set terminal pngcairo size 800,600;"
             " set output 'measured_vs_predicted.png'; set xlabel 'predicted ms/step';"
             " set ylabel 'measured ms/step'; set key off; f(x)=x;"
             " plot 'sweep.csv' using 7:8 skip 1 with points pt 7, f(x) with lines;"
             " set output 'throughput.png'; set xlabel 'offload ratio'; set ylabel 'tokens/s'; set key on;"
             " plot 'sweep.csv' using 1:9 skip 1 with points pt 7 title 'vs offload_params',"
             " 'sweep.csv' using 2:9 skip 1 with points pt 6 title 'vs offload_optim'\" 2>/dev/null",
             dir);
    if (system(cmd) != 0) fy_log_warn("gnuplot failed; no plots");
}

static int sweep(const fy_opts *o, const fy_model *m);

int fy_sweep_main(const fy_opts *o) {
    if (o->quiet) fy_log_set_level(FY_LOG_WARN);
    if (!o->grid) {
        fy_log_error("sweep needs --grid (e.g. 'offload_params=0:1:0.5,offload_optim=0,1,ckpt=0,L')");
        return 2;
    }
    if (o->steps > 100000) { /* a sweep measures; it does not train */
        fy_log_error("--steps %lld: a sweep runs at most 100000 steps a configuration",
                     (long long)o->steps);
        return 2;
    }
    fy_status st = fy_opts_check_paths(o, FY_CMD_SWEEP);
    if (st != FY_OK) return st == FY_ERR_USAGE ? 2 : 1;
    fy_model *model;
    if (fy_opts_model(o, &model) != FY_OK) return 1;
    int rc = sweep(o, model);
    fy_model_free(model);
    return rc;
}

/* The sweep of model m over the grid. */
static int sweep(const fy_opts *o, const fy_model *m) {
    axis ax[AX_COUNT];
    if (parse_grid(o->grid, fy_model_layers(m), ax) != FY_OK) return 2;
    if (!ax[AX_PARAMS].n) ax[AX_PARAMS].v[ax[AX_PARAMS].n++] = 0;
    if (!ax[AX_OPTIM].n) ax[AX_OPTIM].v[ax[AX_OPTIM].n++] = 0;
    if (!ax[AX_CKPT].n) ax[AX_CKPT].v[ax[AX_CKPT].n++] = 0;
    if (!ax[AX_MICRO].n) ax[AX_MICRO].v[ax[AX_MICRO].n++] = (double)o->batch;
    const char *dir = o->out ? o->out : "sweep";
    if (!o->out && access(dir, F_OK) == 0) {
        fy_log_error("./sweep exists and sweep does not replace what it was not given: name the "
                     "output directory with --out (sweep itself to write into it)");
        return 2;
    }
    if (mkdir(dir, 0755) != 0 && access(dir, W_OK) != 0) {
        fy_log_error("cannot create the output directory %s", dir);
        return 1;
    }
    fy_profile prof;
    fy_status st = o->profile ? fy_profile_open(o->profile, &prof) : FY_ERR_INVALID;
    if (!o->profile) {
        fy_opts po = *o;
        st = fy_tune_auto_profile(&po, m, &prof);
    }
    if (st != FY_OK) return 1;
    fy_tokens *tok = NULL;
    uint8_t *text = NULL;
    if (!o->simulate) {
        if (fy_corpus_generate(1u << 20, 1, &text) != FY_OK ||
            fy_tokens_from_bytes(text, 1u << 20, "embedded corpus", &tok) != FY_OK) {
            free(text);
            return 1;
        }
        free(text);
    }
    char path[4096];
    FILE *csv = fresh(dir, "sweep.csv", path, sizeof path);
    if (!csv) { fy_log_error("cannot write %s: %s", path, strerror(errno)); fy_tokens_free(tok); return 1; }
    fprintf(csv, "offload_params,offload_optim,ckpt,micro,accum,fits,predicted_ms,measured_ms,"
                 "tokens_per_s,predicted_device_bytes,measured_device_peak,host_bytes,"
                 "pred_compute_ms,pred_h2d_ms,pred_d2h_ms,pred_cpu_ms,"
                 "meas_compute_ms,meas_h2d_ms,meas_d2h_ms,meas_cpu_ms\n");
    fy_tune_cfg tc = {.model = m, .batch = (int)o->batch, .seq = (int)o->seq,
                      .dtype = fy_opts_dtype(o, fy_opts_dev_kind(o)),
                      .device_budget = o->gpu_mem ? o->gpu_mem : SIZE_MAX, .host_budget = o->host_mem,
                      .adam_threads = o->adam_threads > 0 ? (int)o->adam_threads : (o->threads > 0 ? (int)o->threads : prof.cores),
                      .window = o->steps < 20 ? (int)o->steps : 20, .schedule = fy_opts_schedule(o)};
    double errs[4096];
    int nerr = 0, nconf = 0, best = -1;
    double best_ms = 1e30;
    char best_desc[128] = "";
    /* every fitting configuration, for the tuner's pick (same rule as ferry tune) */
    enum { MAXC = 4096 };
    fy_tune_result *preds = calloc(MAXC, sizeof *preds);
    double *meas = calloc(MAXC, sizeof *meas);
    char (*descs)[128] = calloc(MAXC, sizeof *descs);
    if (!preds || !meas || !descs) { free(preds); free(meas); free(descs); fclose(csv); fy_tokens_free(tok); return 1; }
    for (int i = 0; i < ax[AX_PARAMS].n; i++)
        for (int j = 0; j < ax[AX_OPTIM].n; j++)
            for (int k = 0; k < ax[AX_CKPT].n; k++)
                for (int u = 0; u < ax[AX_MICRO].n; u++) {
                    int micro = (int)ax[AX_MICRO].v[u];
                    if (micro > o->batch || o->batch % micro) continue;
                    fy_plan plan;
                    if (fy_plan_new(m, micro, (int)o->batch / micro, &plan) != FY_OK ||
                        fy_plan_shorthands(&plan, ax[AX_PARAMS].v[i], ax[AX_OPTIM].v[j],
                                           (int)ax[AX_CKPT].v[k]) != FY_OK) {
                        fy_plan_free(&plan);
                        continue;
                    }
                    plan.dtype = tc.dtype;
                    fy_tune_result pr;
                    st = fy_tune_predict(&prof, &tc, &plan, &pr);
                    bool fits = st == FY_OK && pr.mem.device_total <= tc.device_budget &&
                                (!tc.host_budget || pr.mem.host_total <= tc.host_budget);
                    measured meas_one = {0};
                    if (fits && !o->simulate && measure(o, m, &plan, tok, (int)o->steps, &meas_one) != FY_OK)
                        fits = false;
                    double ms = o->simulate ? pr.step_ms : meas_one.step_ms;
                    fprintf(csv, "%g,%g,%d,%d,%d,%d,%.3f,%.3f,%.1f,%zu,%zu,%zu,%.3f,%.3f,%.3f,%.3f,"
                                 "%.3f,%.3f,%.3f,%.3f\n", ax[AX_PARAMS].v[i], ax[AX_OPTIM].v[j],
                            (int)ax[AX_CKPT].v[k], micro, (int)o->batch / micro, fits, pr.step_ms,
                            fits ? ms : NAN, fits ? o->batch * o->seq / (ms / 1e3) : NAN,
                            pr.mem.device_total, meas_one.peak, pr.mem.host_total, pr.busy_ms[0],
                            pr.busy_ms[1], pr.busy_ms[2], pr.busy_ms[3], meas_one.busy[0],
                            meas_one.busy[1], meas_one.busy[2], meas_one.busy[3]);
                    fflush(csv);
                    char desc[128];
                    snprintf(desc, sizeof desc, "offload_params=%g offload_optim=%g ckpt=%d micro=%d",
                             ax[AX_PARAMS].v[i], ax[AX_OPTIM].v[j], (int)ax[AX_CKPT].v[k], micro);
                    if (!o->quiet)
                        printf("%-60s predicted %8.1f ms  measured %8.1f ms  device %zu / %zu\n", desc,
                               pr.step_ms, fits ? ms : NAN, pr.mem.device_total, meas_one.peak);
                    if (fits) {
                        nconf++;
                        if (!o->simulate && nerr < 4096) errs[nerr++] = fabs(pr.step_ms - ms) / ms;
                        if (ms < best_ms) { best_ms = ms; best = nconf; snprintf(best_desc, sizeof best_desc, "%s", desc); }
                        if (nconf <= MAXC) {
                            preds[nconf - 1] = pr;
                            preds[nconf - 1].plan.blocks = NULL; /* freed below; not needed */
                            meas[nconf - 1] = ms;
                            snprintf(descs[nconf - 1], sizeof descs[0], "%s", desc);
                        }
                    }
                    if (st == FY_OK) fy_plan_free(&pr.plan);
                    fy_plan_free(&plan);
                }
    fclose(csv);
    fy_tokens_free(tok);
    int npred = nconf < MAXC ? nconf : MAXC;
    int pk = npred ? fy_tune_pick(preds, npred, FY_TUNE_TIE_MARGIN) : 0;
    double best_pred = npred ? preds[pk].step_ms : NAN, pbest_meas = npred ? meas[pk] : NAN;
    char pbest_desc[128] = "";
    if (npred) snprintf(pbest_desc, sizeof pbest_desc, "%s", descs[pk]);
    free(preds);
    free(meas);
    free(descs);
    for (int i = 1; i < nerr; i++)
        for (int j = i; j > 0 && errs[j] < errs[j - 1]; j--) { double t = errs[j]; errs[j] = errs[j - 1]; errs[j - 1] = t; }
    double med = nerr ? (nerr % 2 ? errs[nerr / 2] : 0.5 * (errs[nerr / 2 - 1] + errs[nerr / 2])) : NAN;
    if (nconf == 0) { /* sweep.csv says, per configuration, what did not fit or failed */
        fy_log_error("no configuration of the grid %s (sweep.csv in %s lists those tried; a "
                     "micro value must divide --batch %lld)", o->simulate ? "fits the budgets"
                     : "fits the budgets and ran", dir, (long long)o->batch);
        return 1;
    }
    FILE *sum = fresh(dir, "summary.txt", path, sizeof path);
    if (sum && o->simulate) {
        fprintf(sum, "configurations simulated: %d\nfastest predicted: %s (%.1f ms/step)\n", nconf,
                pbest_desc, best_pred);
        fclose(sum);
    } else if (sum) {
        fprintf(sum, "configurations run: %d\nbest measured: %s (%.1f ms/step)\n"
                     "best predicted: %s (predicted %.1f, measured %.1f ms/step, %.1f%% from the best)\n"
                     "median |predicted - measured| / measured: %.1f%%\n", nconf, best_desc, best_ms,
                pbest_desc, best_pred, pbest_meas, 100.0 * (pbest_meas - best_ms) / best_ms, 100.0 * med);
        fclose(sum);
    }
    (void)best;
    if (o->simulate)
        printf("sweep   %d configurations simulated; fastest predicted %s (%.1f ms/step)\n", nconf,
               pbest_desc, best_pred);
    else
        printf("sweep   %d configurations; best measured %s (%.1f ms/step); the tuner's pick %s "
               "measured %.1f ms/step (%.1f%% from the best); median prediction error %.1f%%\n",
               nconf, best_desc, best_ms, pbest_desc, pbest_meas,
               100.0 * (pbest_meas - best_ms) / best_ms, 100.0 * med);
    printf("saved   %s/sweep.csv, %s/summary.txt\n", dir, dir);
    plots(dir);
    return 0;
}
