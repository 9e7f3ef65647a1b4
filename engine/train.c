/* train.c — the training loop (data, windows of steps, logging, metrics, validation,
 * saving, the report) and evaluation over a data file. */
#include "engine/train.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <unistd.h>

#include "engine/core/util.h"
#include "engine/io/corpus.h"
#include "engine/io/tokens.h"
#include "engine/trainer.h"
#include "offload/storage.h"

#define TRAIN_WINDOW 20 /* steps per task graph: overlap within, a drain between */
#define MAX_SKIPPED_RUN 5 /* non-finite steps in a row that end a run as diverged */
#define CORPUS_TRAIN_BYTES (4u << 20)
#define CORPUS_VAL_BYTES (256u << 10)
#define CORPUS_TRAIN_SEED 1
#define CORPUS_VAL_SEED 2

double fy_lr_at(int64_t s, int64_t steps, double lr, double min_lr, int64_t warmup,
                bool cosine) {
    if (!cosine) return lr;
    if (s < warmup) return lr * (double)(s + 1) / (double)warmup;
    int64_t span = steps - warmup > 1 ? steps - warmup : 1;
    double r = (double)(s - warmup) / (double)span;
    if (r > 1.0) r = 1.0;
    return min_lr + 0.5 * (1.0 + cos(M_PI * r)) * (lr - min_lr);
}

void fy_train_print_plan(const fy_plan *plan, const fy_mem_model *mm, FILE *f) {
    char desc[512];
    fy_plan_describe(plan, desc, sizeof desc);
    fprintf(f, "plan    micro-batch %d x %d accumulated | %s\n", plan->micro_batch,
            plan->grad_accum, desc);
    fy_mem_model_print(mm, f);
}

/* A float as JSON: non-finite values have no JSON number, they are written as null. */
static const char *json_num(double x, char buf[32]) {
    if (isfinite(x)) snprintf(buf, 32, "%.9g", x);
    else snprintf(buf, 32, "null");
    return buf;
}

/* ---- data ------------------------------------------------------------------------------- */

static fy_status corpus_tokens(size_t nbytes, uint64_t seed, const char *label, fy_tokens **out) {
    uint8_t *text;
    FY_TRY(fy_corpus_generate(nbytes, seed, &text));
    fy_status st = fy_tokens_from_bytes(text, nbytes, label, out);
    free(text);
    return st;
}

/* Batch number `micro` of a loader: llm.c's sequential order, wrapping after a pass, read
 * by position so a batch can be asked for again. */
static fy_status batch_from(void *ctx, int64_t micro, int32_t *x, int32_t *y) {
    FY_TRY(fy_loader_seek_batch(ctx, micro));
    fy_loader_next(ctx, x, y);
    return FY_OK;
}

/* ---- the run ------------------------------------------------------------------------------ */

/* Everything a training run holds, freed in one place. */
typedef struct run {
    const fy_train_cfg *cfg;
    fy_tokens *train_tok, *val_tok;
    fy_loader *train, *val;
    fy_dev *dev;
    fy_trainer *tr;
    FILE *metrics;
    fy_trace_buf trace;
    fy_mem_model model;
    size_t N;                 /* tokens per step: micro-batch x T x accumulation */
    double t_start, ms_sum;
    int64_t ms_count;
    float loss, val_loss;
    int skipped_run;
    float *val_losses;
} run;

static void run_free(run *r) {
    if (r->metrics) fclose(r->metrics);
    fy_trainer_free(r->tr);
    fy_dev_free(r->dev);
    fy_loader_free(r->train);
    fy_loader_free(r->val);
    fy_tokens_free(r->train_tok);
    fy_tokens_free(r->val_tok);
    fy_trace_buf_free(&r->trace);
    free(r->val_losses);
}

/* Training and validation token ranges. */
static fy_status open_data(run *r) {
    const fy_train_cfg *c = r->cfg;
    const int B = c->plan->micro_batch, T = c->seq, V = fy_model_vocab(c->model);
    if (c->data) {
        FY_TRY(fy_tokens_open(c->data, &r->train_tok));
    } else {
        FY_TRY(corpus_tokens(CORPUS_TRAIN_BYTES, CORPUS_TRAIN_SEED, "embedded corpus",
                             &r->train_tok));
        if (!c->val_data)
            FY_TRY(corpus_tokens(CORPUS_VAL_BYTES, CORPUS_VAL_SEED, "embedded corpus (validation)",
                                 &r->val_tok));
    }
    FY_TRY(fy_tokens_check_vocab(r->train_tok, V));
    size_t n = fy_tokens_count(r->train_tok), train_end = n;
    if (c->val_data) {
        FY_TRY(fy_tokens_open(c->val_data, &r->val_tok));
    } else if (c->val_split > 0 && c->data) {
        train_end = n - (size_t)((double)n * c->val_split);
    }
    FY_TRY(fy_loader_new(r->train_tok, 0, train_end, B, T, &r->train));
    if (r->val_tok) {
        FY_TRY(fy_tokens_check_vocab(r->val_tok, V));
        FY_TRY(fy_loader_new(r->val_tok, 0, fy_tokens_count(r->val_tok), B, T, &r->val));
    } else if (train_end < n) {
        FY_TRY(fy_loader_new(r->train_tok, train_end, n, B, T, &r->val));
    }
    return FY_OK;
}

/* The mean loss of the first nbatches validation batches (at most one pass). */
static fy_status validate(run *r, int64_t nbatches, float *loss) {
    int64_t avail = (int64_t)fy_loader_batches(r->val);
    if (nbatches > avail) nbatches = avail;
    FY_TRY(fy_trainer_eval_run(r->tr, (int)nbatches, batch_from, r->val, r->val_losses));
    double sum = 0.0;
    for (int64_t i = 0; i < nbatches; i++) sum += r->val_losses[i];
    *loss = (float)(sum / (double)nbatches);
    return FY_OK;
}

static void progress(int64_t step, int64_t steps, double elapsed_ms, float loss) {
    int width = 30, done = (int)(width * step / steps);
    double eta_s = elapsed_ms / 1e3 / (double)step * (double)(steps - step);
    fprintf(stdout, "\r[%.*s%*s] %3d%% step %lld/%lld loss %.4f eta %dm%02ds ", done,
            "==============================", width - done, "", (int)(100 * step / steps),
            (long long)step, (long long)steps, loss, (int)eta_s / 60, (int)eta_s % 60);
    fflush(stdout);
}

static void print_header(const run *r) {
    const fy_train_cfg *c = r->cfg;
    char shape[256];
    fy_model_describe(c->model, shape, sizeof shape);
    printf("model   %s (%s): %.2fM parameters (%s)\n",
           c->init ? fy_weights_path(c->init) : fy_model_name(c->model), fy_model_family(c->model),
           (double)fy_model_num_params(c->model) / 1e6, shape);
    printf("device  %s\n", fy_dev_name(r->dev));
    printf("data    %s: %zu tokens; batch %d x %d", fy_tokens_label(r->train_tok),
           fy_tokens_count(r->train_tok), c->plan->micro_batch, c->seq);
    if (c->plan->grad_accum > 1) printf(" x %d accumulated", c->plan->grad_accum);
    printf("; validation: %s\n", r->val ? (r->val_tok ? fy_tokens_label(r->val_tok)
                                                      : "held-out tail") : "none");
    fflush(stdout);
}

static fy_status setup(run *r) {
    const fy_train_cfg *c = r->cfg;
    if (c->save) FY_TRY(fy_model_save_check(c->save)); /* fail now, not after the run */
    FY_TRY(open_data(r));
    if (c->metrics && !(r->metrics = fopen(c->metrics, "a"))) {
        fy_log_error("cannot open metrics file %s", c->metrics);
        return FY_ERR_IO;
    }
    if (r->val && !(r->val_losses = malloc(fy_loader_batches(r->val) * sizeof(float)))) {
        fy_log_error("out of host memory for the validation losses");
        return FY_ERR_NOMEM;
    }
    FY_TRY(fy_dev_new(&c->dev, &r->dev));
    fy_trainer_cfg tc = {.model = c->model, .T = c->seq, .plan = c->plan, .beta1 = c->beta1,
                         .beta2 = c->beta2, .eps = c->eps, .weight_decay = c->weight_decay,
                         .clip = c->clip, .seed = c->seed, .weights = c->init,
                         .schedule = c->schedule, .adam_threads = c->adam_threads};
    FY_TRY(fy_trainer_new(r->dev, &tc, &r->tr));
    fy_storage_model(c->model, c->plan, c->seq, &r->model);
    r->N = (size_t)c->plan->micro_batch * c->seq * c->plan->grad_accum;
    return FY_OK;
}

/* Step s (0-based) is done: metrics, the skip check, and the line or the progress bar. */
static fy_status log_step(run *r, int64_t s, const fy_step_stats *ss, float lr, bool validated) {
    const fy_train_cfg *c = r->cfg;
    const double ms = ss->step_ms, tok_s = (double)r->N / (ms / 1e3);
    if (s > 0) { r->ms_sum += ms; r->ms_count++; } /* the first step warms caches */
    r->loss = ss->loss;
    if (r->metrics) {
        char v[5][32];
        fprintf(r->metrics, "{\"step\":%lld,\"loss\":%s,\"lr\":%s,\"grad_norm\":%s,"
                "\"clip_coef\":%s,\"step_ms\":%.6f,\"tokens_per_s\":%.3f",
                (long long)s + 1, json_num(ss->loss, v[0]), json_num(lr, v[1]),
                json_num(ss->grad_norm, v[2]), json_num(ss->clip_coef, v[3]), ms, tok_s);
        if (ss->skipped) fprintf(r->metrics, ",\"skipped\":true");
        if (validated) fprintf(r->metrics, ",\"val_loss\":%s", json_num(r->val_loss, v[4]));
        fprintf(r->metrics, "}\n");
        if (fflush(r->metrics) != 0 || ferror(r->metrics)) { /* a full disk, a closed pipe */
            fy_log_error("cannot write metrics file %s: %s", c->metrics, strerror(errno));
            return FY_ERR_IO;
        }
    }
    if (ss->skipped) {
        fy_log_warn("step %lld: gradient norm is %g; update skipped", (long long)s + 1,
                    ss->grad_norm);
        if (++r->skipped_run >= MAX_SKIPPED_RUN) {
            fy_log_error("training diverged: %d steps in a row had non-finite gradients "
                         "(last good weights not saved; lower --lr or use --clip)",
                         MAX_SKIPPED_RUN);
            return FY_ERR_NONFINITE;
        }
    } else {
        r->skipped_run = 0;
    }
    if (c->quiet) return FY_OK;
    const int64_t log_every = c->log_every ? c->log_every : (c->steps <= 100 ? 1 : c->steps / 50);
    const bool tty = isatty(STDOUT_FILENO), last = s + 1 == c->steps;
    if ((s + 1) % log_every == 0 || last || s == 0 || validated) {
        if (tty && log_every > 1) printf("\r%*s\r", 78, "");
        printf("step %6lld/%lld | loss %.4f | norm %.4f | lr %.2e | %7.1f ms | %8.0f tok/s",
               (long long)s + 1, (long long)c->steps, ss->loss, ss->grad_norm, lr, ms, tok_s);
        if (validated) printf(" | val %.4f", r->val_loss);
        printf("\n");
    } else if (tty) {
        progress(s + 1, c->steps, fy_now_ms() - r->t_start, ss->loss);
    }
    fflush(stdout);
    return FY_OK;
}

/* Steps [s0, s0 + n) as one window; then their log lines (those that completed, if a
 * task failed), validation at the window's end when it is due. */
static fy_status run_window(run *r, int64_t s0, int n) {
    const fy_train_cfg *c = r->cfg;
    float lrs[TRAIN_WINDOW];
    fy_step_stats stats[TRAIN_WINDOW];
    const double min_lr = c->min_lr;
    for (int i = 0; i < n; i++)
        lrs[i] = (float)fy_lr_at(s0 + i, c->steps, c->lr, min_lr, c->warmup, c->cosine);
    fy_sched_result res = {0};
    fy_graph g;
    fy_window w = {.nsteps = n, .lrs = lrs, .next_batch = batch_from, .batch_ctx = r->train,
                   .stats = stats, .trace = c->trace ? &res : NULL, .graph = c->trace ? &g : NULL};
    const double t_win = fy_now_ms() - r->t_start;
    fy_status st = fy_trainer_run(r->tr, &w);
    if (st == FY_OK && c->trace) {
        st = fy_trace_append(&r->trace, &g, &res, t_win, (int)(s0 * c->plan->grad_accum));
        fy_sched_result_free(&res);
        fy_graph_free(&g);
    }
    for (int i = 0; i < w.completed; i++) { /* all of them, unless a task failed */
        const int64_t s = s0 + i;
        const bool do_val = r->val && i == n - 1 &&
                            (s + 1 == c->steps || (c->val_every && (s + 1) % c->val_every == 0));
        if (do_val) FY_TRY(validate(r, c->val_batches, &r->val_loss));
        FY_TRY(log_step(r, s, &stats[i], lrs[i], do_val));
    }
    return st;
}

/* The summary line, the weights, the trace, and the what-if of --predict. */
static fy_status report(run *r) {
    const fy_train_cfg *c = r->cfg;
    double total_s = (fy_now_ms() - r->t_start) / 1e3;
    if (c->save) FY_TRY(fy_trainer_save(r->tr, c->save, &c->save_opts));
    if (c->trace) FY_TRY(fy_trace_save(&r->trace, c->trace, "ferry train"));
    fy_dev_mem_stats ms;
    fy_dev_mem_stats_get(r->dev, &ms);
    char peak[32], pred[32];
    double mean_ms = r->ms_count ? r->ms_sum / (double)r->ms_count : 0.0;
    printf("done    %lld steps in %.1f s | %.1f ms/step | %.0f tok/s | final loss %.4f",
           (long long)c->steps, total_s, mean_ms,
           mean_ms > 0 ? (double)r->N / (mean_ms / 1e3) : 0.0, r->loss);
    if (r->val) printf(" | val loss %.4f", r->val_loss);
    printf(" | device peak %s (model %s)\n",
           fy_fmt_size(ms.peak_nbytes[FY_MEM_DEVICE], peak, sizeof peak),
           fy_fmt_size(r->model.device_total, pred, sizeof pred));
    if (c->save) printf("saved   %s\n", c->save);
    if (!c->predict) return FY_OK;
    /* what-if: the same window of steps under each schedule, on the simulator, with the
     * mean task durations this run measured */
    int n = c->steps < TRAIN_WINDOW ? (int)c->steps : TRAIN_WINDOW;
    printf("predict");
    for (int m = 0; m < 3; m++) {
        fy_sched_result pr;
        FY_TRY(fy_trainer_predict(r->tr, n, (fy_sched_mode)m, true, &pr));
        int busiest = 0;
        for (int l = 1; l < FY_LANE_COUNT; l++) if (pr.busy_ms[l] > pr.busy_ms[busiest]) busiest = l;
        printf(" | %s %.1f ms/step", fy_sched_mode_name((fy_sched_mode)m), pr.makespan_ms / n);
        if (m == 0) {
            printf(" (busiest lane %s %.1f ms/step)", fy_lane_name((fy_lane)busiest),
                   pr.busy_ms[busiest] / n);
            double with = pr.makespan_ms;
            fy_sched_result_free(&pr);
            FY_TRY(fy_trainer_predict(r->tr, n, FY_SCHED_PRIORITY, false, &pr));
            printf(" (without the clipping barrier %.1f: exact clipping costs %.1f%%)",
                   pr.makespan_ms / n, 100.0 * (with - pr.makespan_ms) / pr.makespan_ms);
        }
        fy_sched_result_free(&pr);
    }
    printf("\n");
    return FY_OK;
}

fy_status fy_train(const fy_train_cfg *cfg) {
    run r = {.cfg = cfg, .loss = NAN, .val_loss = NAN};
    fy_status st = setup(&r);
    if (st == FY_OK && !cfg->quiet) print_header(&r);
    r.t_start = fy_now_ms();
    for (int64_t s0 = 0; s0 < cfg->steps && st == FY_OK;) {
        /* a window of steps runs as one task graph; it ends at a validation point */
        int64_t n = cfg->steps - s0 < TRAIN_WINDOW ? cfg->steps - s0 : TRAIN_WINDOW;
        if (cfg->val_every && r.val) {
            int64_t to_val = cfg->val_every - s0 % cfg->val_every;
            if (to_val < n) n = to_val;
        }
        st = run_window(&r, s0, (int)n);
        s0 += n;
    }
    if (st == FY_OK) st = report(&r);
    run_free(&r);
    return st;
}

fy_status fy_eval(const fy_eval_cfg *cfg, fy_eval_result *out) {
    memset(out, 0, sizeof *out);
    fy_tokens *tok = NULL;
    fy_loader *ld = NULL;
    fy_dev *dev = NULL;
    fy_trainer *tr = NULL;
    float *losses = NULL;
    fy_plan plan = {0};
    fy_status st;
    if ((st = fy_tokens_open(cfg->data, &tok)) != FY_OK ||
        (st = fy_tokens_check_vocab(tok, fy_model_vocab(cfg->model))) != FY_OK ||
        (st = fy_loader_new(tok, 0, fy_tokens_count(tok), cfg->batch, cfg->seq, &ld)) != FY_OK)
        goto done;
    int64_t avail = (int64_t)fy_loader_batches(ld);
    int64_t nb = cfg->batches && cfg->batches < avail ? cfg->batches : avail;
    if (!(losses = malloc((size_t)nb * sizeof *losses))) {
        fy_log_error("out of host memory for %lld losses", (long long)nb);
        st = FY_ERR_NOMEM;
        goto done;
    }
    if ((st = fy_dev_new(&cfg->dev, &dev)) != FY_OK ||
        (st = fy_plan_new(cfg->model, cfg->batch, 1, &plan)) != FY_OK)
        goto done;
    plan.dtype = cfg->dtype;
    fy_trainer_cfg tc = {.model = cfg->model, .T = cfg->seq, .eval_only = true, .plan = &plan,
                         .weights = cfg->weights};
    if ((st = fy_trainer_new(dev, &tc, &tr)) != FY_OK ||
        (st = fy_trainer_eval_run(tr, (int)nb, batch_from, ld, losses)) != FY_OK)
        goto done;
    double sum = 0.0;
    for (int64_t i = 0; i < nb; i++) sum += losses[i];
    *out = (fy_eval_result){(float)(sum / (double)nb), nb, nb * cfg->batch * cfg->seq};
done:
    fy_trainer_free(tr);
    fy_plan_free(&plan);
    fy_dev_free(dev);
    fy_loader_free(ld);
    fy_tokens_free(tok);
    free(losses);
    return st;
}
