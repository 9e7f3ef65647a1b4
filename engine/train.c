/* train.c — `ferry train` and `ferry eval`: everything between the options and the
 * trainer (model resolution, data, device, schedule, logging, metrics, saving). */
#include "engine/train.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/core/util.h"
#include "engine/io/corpus.h"
#include "engine/io/tokens.h"
#include "engine/model/gpt2_io.h"
#include "engine/trainer.h"
#include "engine/cli/tune_cmd.h"
#include "offload/plan.h"
#include "offload/storage.h"

#define TRAIN_WINDOW 20 /* steps per task graph: overlap within, a drain between */
#define MAX_SKIPPED_RUN 5 /* non-finite steps in a row that end a run as diverged */

/* A float as JSON: non-finite values have no JSON number, they are written as null. */
static const char *json_num(double x, char buf[32]) {
    if (isfinite(x)) snprintf(buf, 32, "%.9g", x);
    else snprintf(buf, 32, "null");
    return buf;
}
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

/* Checks that need several options at once, before anything is allocated. */
static fy_status check_run_opts(const fy_opts *o) {
    if (o->batch * o->seq > ((int64_t)1 << 26)) {
        fy_log_error("--batch %lld x --seq %lld = %lld tokens per micro-batch is too many "
                     "(at most %d)", (long long)o->batch, (long long)o->seq,
                     (long long)(o->batch * o->seq), 1 << 26);
        return FY_ERR_INVALID;
    }
    if (o->save) { /* fail now, not after the whole run */
        char dir[4096];
        snprintf(dir, sizeof dir, "%s", o->save);
        char *slash = strrchr(dir, '/');
        if (slash) *slash = 0;
        else snprintf(dir, sizeof dir, ".");
        if (access(*dir ? dir : "/", W_OK) != 0) {
            fy_log_error("--save %s: directory %s does not exist or is not writable", o->save,
                         *dir ? dir : "/");
            return FY_ERR_IO;
        }
    }
    return FY_OK;
}

/* Everything a run holds, freed in one place. */
typedef struct run {
    fy_st_file *init;
    fy_tokens *train_tok, *val_tok;
    fy_loader *train, *val;
    fy_dev *dev;
    fy_trainer *tr;
    int32_t *x, *y;
    FILE *metrics;
    fy_plan plan;
    fy_trace_buf trace;
} run;

static void run_free(run *r) {
    if (r->metrics) fclose(r->metrics);
    free(r->x);
    free(r->y);
    fy_trainer_free(r->tr);
    fy_dev_free(r->dev);
    fy_loader_free(r->train);
    fy_loader_free(r->val);
    fy_tokens_free(r->train_tok);
    fy_tokens_free(r->val_tok);
    fy_st_close(r->init);
    fy_plan_free(&r->plan);
    fy_trace_buf_free(&r->trace);
}

/* The trainer's batch source: the training loader, in order (called from one lane). */
static void next_train_batch(void *ctx, int64_t micro, int32_t *x, int32_t *y) {
    run *r = ctx;
    (void)micro;
    fy_loader_next(r->train, x, y);
}


/* The model: from the weights file when --init is given (a --model given too must
 * agree with it), else the named config. */
static fy_status resolve_model(const fy_opts *o, bool model_given, run *r, fy_gpt2_config *cfg) {
    if (o->init) {
        FY_TRY(fy_st_open(o->init, &r->init));
        FY_TRY(fy_gpt2_file_config(r->init, (int)o->heads, cfg));
        if (model_given) {
            fy_gpt2_config named;
            FY_TRY(fy_gpt2_config_named(o->model, &named));
            if (memcmp(&named, cfg, sizeof named) != 0) {
                fy_log_error("--model %s does not match the weights in %s (file: vocab %d, "
                             "positions %d, channels %d, layers %d, heads %d)", o->model,
                             o->init, cfg->vocab, cfg->max_seq, cfg->channels, cfg->layers,
                             cfg->heads);
                return FY_ERR_INVALID;
            }
        }
    } else {
        FY_TRY(fy_opts_model(o, cfg));
    }
    if (o->init && (o->layers || o->channels || o->vocab || o->max_seq)) {
        fy_log_error("--layers/--channels/--vocab/--max-seq shape a new model; the weights in "
                     "%s have their own shape", o->init);
        return FY_ERR_INVALID;
    }
    FY_TRY(fy_gpt2_config_check(cfg));
    return fy_gpt2_check_seq(cfg, o->seq);
}

/* The placement plan: a file, or the shorthands over the all-resident plan. */
static fy_status resolve_plan(const fy_opts *o, const fy_gpt2_config *cfg, fy_dev_kind kind,
                              fy_plan *plan) {
    bool shorthands = fy_opts_given(o, "offload-params") || fy_opts_given(o, "offload-optim") ||
                      fy_opts_given(o, "ckpt-layers");
    if (o->plan && !strcmp(o->plan, "auto")) {
        if (shorthands) {
            fy_log_error("--plan auto cannot be combined with --offload-params, --offload-optim "
                         "or --ckpt-layers");
            return FY_ERR_INVALID;
        }
        if (o->init) {
            fy_log_error("--plan auto tunes a named model; give a plan file with --init");
            return FY_ERR_INVALID;
        }
        FY_TRY(fy_tune_auto_plan(o, cfg, plan));
    } else if (o->plan) {
        if (shorthands) {
            fy_log_error("--plan cannot be combined with --offload-params, --offload-optim "
                         "or --ckpt-layers");
            return FY_ERR_INVALID;
        }
        FY_TRY(fy_plan_load(o->plan, cfg->layers, plan));
        if ((fy_opts_given(o, "batch") && o->batch != plan->micro_batch) ||
            (fy_opts_given(o, "grad-accum") && o->grad_accum != plan->grad_accum)) {
            fy_log_error("--batch/--grad-accum disagree with plan %s (micro_batch %d, "
                         "grad_accum %d)", o->plan, plan->micro_batch, plan->grad_accum);
            return FY_ERR_INVALID;
        }
    } else {
        FY_TRY(fy_plan_new(cfg->layers, (int)o->batch, (int)o->grad_accum, plan));
        if (o->ckpt_layers > cfg->layers) {
            fy_log_error("--ckpt-layers %lld: the model has %d layers", (long long)o->ckpt_layers,
                         cfg->layers);
            return FY_ERR_INVALID;
        }
        FY_TRY(fy_plan_shorthands(plan, o->offload_params, o->offload_optim, (int)o->ckpt_layers));
    }
    if ((int64_t)plan->micro_batch * o->seq > ((int64_t)1 << 26)) {
        fy_log_error("micro-batch %d x --seq %lld = %lld tokens per micro-batch is too many "
                     "(at most %d)", plan->micro_batch, (long long)o->seq,
                     (long long)plan->micro_batch * o->seq, 1 << 26);
        return FY_ERR_INVALID;
    }
    /* a plan file keeps the storage type it names unless --dtype says otherwise */
    if (!o->plan || !strcmp(o->plan, "auto") || fy_opts_given(o, "dtype") ||
        plan->dtype == FY_DTYPE_NONE)
        plan->dtype = fy_opts_dtype(o, kind);
    if (o->save_plan) FY_TRY(fy_plan_save(o->save_plan, plan));
    return FY_OK;
}

static fy_status corpus_tokens(size_t nbytes, uint64_t seed, const char *label, fy_tokens **out) {
    uint8_t *text;
    FY_TRY(fy_corpus_generate(nbytes, seed, &text));
    fy_status st = fy_tokens_from_bytes(text, nbytes, label, out);
    free(text);
    return st;
}

/* Training and validation token ranges. */
static fy_status open_data(const fy_opts *o, const fy_gpt2_config *cfg, int B, run *r) {
    int T = (int)o->seq;
    if (o->data) {
        FY_TRY(fy_tokens_open(o->data, &r->train_tok));
    } else {
        FY_TRY(corpus_tokens(CORPUS_TRAIN_BYTES, CORPUS_TRAIN_SEED, "embedded corpus",
                             &r->train_tok));
        if (!o->val_data)
            FY_TRY(corpus_tokens(CORPUS_VAL_BYTES, CORPUS_VAL_SEED, "embedded corpus (validation)",
                                 &r->val_tok));
    }
    FY_TRY(fy_tokens_check_vocab(r->train_tok, cfg->vocab));
    size_t n = fy_tokens_count(r->train_tok), train_end = n;
    if (o->val_data) {
        FY_TRY(fy_tokens_open(o->val_data, &r->val_tok));
    } else if (o->val_split > 0 && o->data) {
        train_end = n - (size_t)((double)n * o->val_split);
    }
    FY_TRY(fy_loader_new(r->train_tok, 0, train_end, B, T, &r->train));
    if (r->val_tok) {
        FY_TRY(fy_tokens_check_vocab(r->val_tok, cfg->vocab));
        FY_TRY(fy_loader_new(r->val_tok, 0, fy_tokens_count(r->val_tok), B, T, &r->val));
    } else if (train_end < n) {
        FY_TRY(fy_loader_new(r->train_tok, train_end, n, B, T, &r->val));
    }
    return FY_OK;
}

static fy_status validate(run *r, int64_t nbatches, float *loss) {
    fy_loader_reset(r->val);
    int64_t avail = (int64_t)fy_loader_batches(r->val);
    if (nbatches > avail) nbatches = avail;
    double sum = 0.0;
    for (int64_t i = 0; i < nbatches; i++) {
        fy_loader_next(r->val, r->x, r->y);
        float l;
        FY_TRY(fy_trainer_eval(r->tr, r->x, r->y, &l));
        sum += l;
    }
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

static void print_header(const fy_opts *o, const fy_gpt2_config *c, const run *r) {
    size_t np = fy_gpt2_num_params(c);
    printf("model   %s: %.2fM parameters (vocab %d, positions %d, channels %d, layers %d, "
           "heads %d)\n", o->init ? o->init : o->model, (double)np / 1e6, c->vocab,
           c->max_seq, c->channels, c->layers, c->heads);
    printf("device  %s\n", fy_dev_name(r->dev));
    printf("data    %s: %zu tokens; batch %d x %lld", fy_tokens_label(r->train_tok),
           fy_tokens_count(r->train_tok), r->plan.micro_batch, (long long)o->seq);
    if (r->plan.grad_accum > 1) printf(" x %d accumulated", r->plan.grad_accum);
    printf("; validation: %s\n", r->val ? (r->val_tok ? fy_tokens_label(r->val_tok)
                                                      : "held-out tail") : "none");
    fflush(stdout);
}

int fy_train_main(const fy_opts *o) {
    run r = {0};
    fy_status st;
    fy_gpt2_config cfg;
    fy_dev_cfg dc;
    if (o->quiet) fy_log_set_level(FY_LOG_WARN);
    if ((st = check_run_opts(o)) != FY_OK) goto fail;
    if ((st = fy_opts_dev_cfg(o, !o->dry_run, &dc)) != FY_OK) goto fail;
    if ((st = resolve_model(o, fy_opts_given(o, "model"), &r, &cfg)) != FY_OK) goto fail;
    if ((st = resolve_plan(o, &cfg, dc.kind, &r.plan)) != FY_OK) goto fail;
    const int B = r.plan.micro_batch, T = (int)o->seq, accum = r.plan.grad_accum;
    const size_t N = (size_t)B * T;
    fy_gpt2_layout lay;
    if ((st = fy_gpt2_layout_new(&cfg, &lay)) != FY_OK) goto fail;
    fy_mem_model model;
    fy_storage_model(&lay, &r.plan, T, &model);
    fy_gpt2_layout_free(&lay);
    if (!o->quiet || o->dry_run) {
        char desc[512];
        fy_plan_describe(&r.plan, desc, sizeof desc);
        printf("plan    micro-batch %d x %d accumulated | %s\n", B, accum, desc);
        fy_mem_model_print(&model, stdout);
    }
    if (o->dry_run) {
        run_free(&r);
        return 0;
    }
    if ((st = open_data(o, &cfg, B, &r)) != FY_OK) goto fail;
    if (o->metrics && !(r.metrics = fopen(o->metrics, "a"))) {
        fy_log_error("cannot open metrics file %s", o->metrics);
        st = FY_ERR_IO;
        goto fail;
    }
    r.x = malloc(N * accum * sizeof(int32_t));
    r.y = malloc(N * accum * sizeof(int32_t));
    if (!r.x || !r.y) {
        fy_log_error("out of host memory for %zu tokens of batch staging", 2 * N * accum);
        st = FY_ERR_NOMEM;
        goto fail;
    }
    if ((st = fy_dev_new(&dc, &r.dev)) != FY_OK) goto fail;
    fy_trainer_cfg tc = {.model = cfg, .B = B, .T = T, .beta1 = (float)o->beta1,
                         .beta2 = (float)o->beta2, .eps = (float)o->eps,
                         .weight_decay = (float)o->weight_decay, .clip = (float)o->clip,
                         .seed = (uint64_t)o->seed, .grad_accum = accum, .plan = &r.plan,
                         .adam_threads = (int)o->adam_threads};
    fy_sched_mode_parse(o->schedule, &tc.schedule); /* the option table checked the name */
    if ((st = fy_trainer_new(r.dev, &tc, &r.tr)) != FY_OK) goto fail;
    if (r.init && (st = fy_trainer_load(r.tr, r.init)) != FY_OK) goto fail;
    if (!o->quiet) print_header(o, &cfg, &r);

    const bool cosine = !strcmp(o->lr_schedule, "cosine");
    const double min_lr = fy_opts_given(o, "min-lr") ? o->min_lr : o->lr / 10.0;
    int64_t log_every = o->log_every ? o->log_every : (o->steps <= 100 ? 1 : o->steps / 50);
    const bool tty = isatty(STDOUT_FILENO) && !o->quiet;
    double t_start = fy_now_ms(), ms_sum = 0.0;
    int64_t ms_count = 0;
    float loss = NAN, val_loss = NAN;
    int skipped_run = 0;
    float lrs[TRAIN_WINDOW];
    fy_step_stats stats[TRAIN_WINDOW];
    for (int64_t s0 = 0; s0 < o->steps;) {
        /* a window of steps runs as one task graph; it ends at a validation point */
        int64_t n = o->steps - s0 < TRAIN_WINDOW ? o->steps - s0 : TRAIN_WINDOW;
        if (o->val_every && r.val) {
            int64_t to_val = o->val_every - s0 % o->val_every;
            if (to_val < n) n = to_val;
        }
        for (int64_t i = 0; i < n; i++)
            lrs[i] = (float)fy_lr_at(s0 + i, o->steps, o->lr, min_lr, o->warmup, cosine);
        fy_sched_result res = {0};
        fy_graph g;
        double t_win = fy_now_ms() - t_start;
        if ((st = fy_trainer_run(r.tr, (int)n, lrs, next_train_batch, &r, stats,
                                 o->trace ? &res : NULL, o->trace ? &g : NULL)) != FY_OK)
            goto fail;
        if (o->trace) {
            st = fy_trace_append(&r.trace, &g, &res, t_win, (int)(s0 * accum));
            fy_sched_result_free(&res);
            fy_graph_free(&g);
            if (st != FY_OK) goto fail;
        }
        for (int64_t i = 0; i < n; i++) {
            const int64_t s = s0 + i;
            const fy_step_stats *ss = &stats[i];
            double ms = ss->step_ms, tok_s = (double)N * accum / (ms / 1e3);
            if (s > 0) { ms_sum += ms; ms_count++; } /* the first step warms caches */
            loss = ss->loss;
            bool last = s + 1 == o->steps;
            bool do_val = r.val && i == n - 1 &&
                          (last || (o->val_every && (s + 1) % o->val_every == 0));
            if (do_val && (st = validate(&r, o->val_batches, &val_loss)) != FY_OK) goto fail;
            if (r.metrics) {
                char v[6][32];
                fprintf(r.metrics, "{\"step\":%lld,\"loss\":%s,\"lr\":%s,\"grad_norm\":%s,"
                        "\"clip_coef\":%s,\"step_ms\":%.6f,\"tokens_per_s\":%.3f",
                        (long long)s + 1, json_num(ss->loss, v[0]), json_num(lrs[i], v[1]),
                        json_num(ss->grad_norm, v[2]), json_num(ss->clip_coef, v[3]), ms, tok_s);
                if (ss->skipped) fprintf(r.metrics, ",\"skipped\":true");
                if (do_val) fprintf(r.metrics, ",\"val_loss\":%s", json_num(val_loss, v[4]));
                fprintf(r.metrics, "}\n");
                fflush(r.metrics);
            }
            if (ss->skipped) {
                fy_log_warn("step %lld: gradient norm is %g; update skipped", (long long)s + 1,
                            ss->grad_norm);
                if (++skipped_run >= MAX_SKIPPED_RUN) {
                    fy_log_error("training diverged: %d steps in a row had non-finite gradients "
                                 "(last good weights not saved; lower --lr or use --clip)",
                                 MAX_SKIPPED_RUN);
                    st = FY_ERR_NONFINITE;
                    goto fail;
                }
            } else {
                skipped_run = 0;
            }
            if (o->quiet) continue;
            if ((s + 1) % log_every == 0 || last || s == 0 || do_val) {
                if (tty && log_every > 1) printf("\r%*s\r", 78, "");
                printf("step %6lld/%lld | loss %.4f | norm %.4f | lr %.2e | %7.1f ms | %8.0f tok/s",
                       (long long)s + 1, (long long)o->steps, ss->loss, ss->grad_norm, lrs[i], ms,
                       tok_s);
                if (do_val) printf(" | val %.4f", val_loss);
                printf("\n");
            } else if (tty) {
                progress(s + 1, o->steps, fy_now_ms() - t_start, ss->loss);
            }
            fflush(stdout);
        }
        s0 += n;
    }
    double total_s = (fy_now_ms() - t_start) / 1e3;
    if (o->save && (st = fy_trainer_save(r.tr, o->save)) != FY_OK) goto fail;
    if (o->trace && (st = fy_trace_save(&r.trace, o->trace, "ferry train")) != FY_OK) goto fail;
    fy_dev_mem_stats ms;
    fy_dev_mem_stats_get(r.dev, &ms);
    char peak[32];
    double mean_ms = ms_count ? ms_sum / (double)ms_count : 0.0;
    printf("done    %lld steps in %.1f s | %.1f ms/step | %.0f tok/s | final loss %.4f",
           (long long)o->steps, total_s, mean_ms,
           mean_ms > 0 ? (double)N * accum / (mean_ms / 1e3) : 0.0, loss);
    if (r.val) printf(" | val loss %.4f", val_loss);
    char pred[32];
    printf(" | device peak %s (model %s)\n",
           fy_fmt_size(ms.peak_nbytes[FY_MEM_DEVICE], peak, sizeof peak),
           fy_fmt_size(model.device_total, pred, sizeof pred));
    if (o->save) printf("saved   %s\n", o->save);
    if (o->predict) {
        /* what-if: the same window of steps under each schedule, on the simulator, with
         * the mean task durations this run measured */
        int n = o->steps < TRAIN_WINDOW ? (int)o->steps : TRAIN_WINDOW;
        printf("predict");
        for (int m = 0; m < 3; m++) {
            fy_sched_result pr;
            if ((st = fy_trainer_predict(r.tr, n, (fy_sched_mode)m, true, &pr)) != FY_OK) goto fail;
            int busiest = 0;
            for (int l = 1; l < FY_LANE_COUNT; l++) if (pr.busy_ms[l] > pr.busy_ms[busiest]) busiest = l;
            printf(" | %s %.1f ms/step", fy_sched_mode_name((fy_sched_mode)m), pr.makespan_ms / n);
            if (m == 0) printf(" (busiest lane %s %.1f ms/step)", fy_lane_name((fy_lane)busiest),
                               pr.busy_ms[busiest] / n);
            if (m == 0) {
                double with = pr.makespan_ms;
                fy_sched_result_free(&pr);
                if ((st = fy_trainer_predict(r.tr, n, FY_SCHED_PRIORITY, false, &pr)) != FY_OK)
                    goto fail;
                printf(" (without the clipping barrier %.1f: exact clipping costs %.1f%%)",
                       pr.makespan_ms / n, 100.0 * (with - pr.makespan_ms) / pr.makespan_ms);
            }
            fy_sched_result_free(&pr);
        }
        printf("\n");
    }
    run_free(&r);
    return 0;
fail:
    run_free(&r);
    return 1;
}

int fy_eval_main(const fy_opts *o) {
    run r = {0};
    fy_status st;
    fy_gpt2_config cfg;
    const int B = (int)o->batch, T = (int)o->seq;
    if (o->quiet) fy_log_set_level(FY_LOG_WARN);
    if (!o->init || !o->data) {
        fy_log_error("eval needs --init FILE and --data PATH");
        return 1;
    }
    if ((st = check_run_opts(o)) != FY_OK) return 1;
    fy_dev_cfg dc;
    if ((st = fy_opts_dev_cfg(o, true, &dc)) != FY_OK) goto fail;
    if ((st = resolve_model(o, false, &r, &cfg)) != FY_OK) goto fail;
    if ((st = fy_tokens_open(o->data, &r.val_tok)) != FY_OK) goto fail;
    if ((st = fy_tokens_check_vocab(r.val_tok, cfg.vocab)) != FY_OK) goto fail;
    if ((st = fy_loader_new(r.val_tok, 0, fy_tokens_count(r.val_tok), B, T, &r.val)) != FY_OK)
        goto fail;
    r.x = malloc((size_t)B * T * sizeof(int32_t));
    r.y = malloc((size_t)B * T * sizeof(int32_t));
    if (!r.x || !r.y) {
        fy_log_error("out of host memory for %d tokens of batch staging", 2 * B * T);
        st = FY_ERR_NOMEM;
        goto fail;
    }
    if ((st = fy_dev_new(&dc, &r.dev)) != FY_OK) goto fail;
    if ((st = fy_plan_new(cfg.layers, B, 1, &r.plan)) != FY_OK) goto fail;
    r.plan.dtype = fy_opts_dtype(o, dc.kind);
    fy_trainer_cfg tc = {.model = cfg, .B = B, .T = T, .eval_only = true, .plan = &r.plan};
    if ((st = fy_trainer_new(r.dev, &tc, &r.tr)) != FY_OK) goto fail;
    if ((st = fy_trainer_load(r.tr, r.init)) != FY_OK) goto fail;
    int64_t avail = (int64_t)fy_loader_batches(r.val);
    int64_t nb = o->batches && o->batches < avail ? o->batches : avail;
    float loss;
    if ((st = validate(&r, nb, &loss)) != FY_OK) goto fail;
    printf("{\"loss\":%.9g,\"batches\":%lld,\"tokens\":%lld}\n", loss, (long long)nb,
           (long long)nb * B * T);
    run_free(&r);
    return 0;
fail:
    run_free(&r);
    return 1;
}
