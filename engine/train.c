/* train.c — the training loop (data, windows of steps, logging, metrics, validation,
 * saving, the report) and evaluation over a data file. */
#include "engine/train.h"

#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <inttypes.h>
#include <libgen.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/checkpoint.h"
#include "engine/core/crc32c.h"
#include "engine/core/util.h"
#include "engine/io/corpus.h"
#include "engine/io/json_file.h"
#include "engine/io/tokens.h"
#include "engine/trainer.h"
#include "offload/storage.h"

#define TRAIN_WINDOW 20 /* steps per task graph: overlap within, a drain between */
#define MAX_SKIPPED_RUN 5 /* non-finite steps in a row that end a run as diverged */
#define CORPUS_TRAIN_BYTES (4u << 20)
#define CORPUS_VAL_BYTES (256u << 10)
#define CORPUS_TRAIN_SEED 1
#define CORPUS_VAL_SEED 2
#define FINGERPRINT_TOKENS ((size_t)1 << 20) /* read at each end of the training data */

atomic_int fy_train_stop_signal;
_Static_assert(ATOMIC_INT_LOCK_FREE == 2, "a signal handler stores fy_train_stop_signal");

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
static fy_status batch_from(void *ctx, int64_t micro, int32_t *x, int32_t *y, int32_t *docs) {
    FY_TRY(fy_loader_seek_batch(ctx, micro));
    fy_loader_next(ctx, x, y, docs);
    return FY_OK;
}

/* Training batches by step: micro-batch j of step s reads the j-th B x T slice of the
 * s-th (wrapping) A x B x T window of the data, so the data of a step depends on the step
 * size in sequences only, not on how it is split in micro-batches, nor on where a run was
 * stopped and resumed. */
typedef struct train_batches {
    fy_loader *ld;
    int64_t accum, steps_per_pass; /* accum: micro-batches a step, over all ranks */
    bool alone;                    /* one process: a signal may stop it within a window */
} train_batches;

/* The loader's batch of training micro-batch `micro`. */
static int64_t train_batch_of(const train_batches *tb, int64_t micro) {
    const int64_t step = micro / tb->accum, j = micro % tb->accum;
    return (step % tb->steps_per_pass) * tb->accum + j;
}

static fy_status train_batch(void *ctx, int64_t micro, int32_t *x, int32_t *y, int32_t *docs) {
    const train_batches *tb = ctx;
    /* this step applies nothing; a data-parallel job's ranks decide together, in the
     * step's norm (trainer.h: stop) */
    if (tb->alone && atomic_load(&fy_train_stop_signal)) return FY_INTERRUPTED;
    FY_TRY(fy_loader_seek_batch(tb->ld, train_batch_of(tb, micro)));
    fy_loader_next(tb->ld, x, y, docs);
    return FY_OK;
}

static int64_t train_targets(void *ctx, int64_t micro) {
    const train_batches *tb = ctx;
    return fy_loader_batch_targets(tb->ld, train_batch_of(tb, micro));
}

static int world_of(const fy_train_cfg *c) { return c->comm ? fy_comm_size(c->comm) : 1; }
/* A job's rank but 0: it writes nothing, and serves its shards of the optimizer state to
 * rank 0's saves (trainer.h: fy_trainer_serve). */
static bool follower(const fy_train_cfg *c) { return c->comm && fy_comm_rank(c->comm) != 0; }

/* Rank 0's save is over (st: how it went): the serving ranks are told, and stop with it
 * if it failed. */
static fy_status end_served(fy_trainer *tr, fy_status st) {
    fy_status es = fy_trainer_serve_end(tr, st != FY_OK);
    return st != FY_OK ? st : es;
}
/* A step's micro-batches over the job (this process's alone when it is one). */
static int64_t step_micros(const fy_train_cfg *c) {
    return c->micro_total > 0 ? c->micro_total : (int64_t)c->plan->grad_accum * world_of(c);
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
    double t_start, ms_sum, first_ms; /* steps after the first; the first (warm-up) */
    int64_t ms_count;
    double last_done;         /* when the last step completed (fy_now_ms), shifted past the
                                 pauses since (validation, checkpoints): a step's time is
                                 the wall time from the previous step's completion */
    double *ms_all;           /* every step's time after the first, for the median */
    float loss, val_loss;
    int64_t skipped_run;
    float *val_losses;        /* per validation batch, twice the batches (validate) */
    int64_t *val_counts;      /* their targets counted, as many */
    double *val_sums;         /* a job's: the counts summed over the ranks */
    train_batches batches;
    size_t train_end;         /* the training range's end in train_tok */
    fy_doc_mask docs;         /* the run's documents (--doc-mask, or the data's) */
    /* checkpoints */
    fy_ckpt_dir *ckpt;
    cJSON *config;            /* what checkpoints record of the run and resuming checks */
    int64_t start;            /* the first step this process runs */
    int64_t saved;            /* the step of the newest checkpoint asked for (-1: none) */
    char *saved_path;         /* the newest complete one's */
    fy_ckpt_snapshot *snap;   /* saves in the background from it (NULL: before going on) */
    double pending_t0, pending_wait_ms;
    double verify_ms, restore_ms; /* the checkpoint resumed from: opened and verified, its
                                     moments restored */
} run;

static fy_status setup_snapshot(run *r);
static fy_status finish_pending(run *r);

static void run_free(run *r) {
    if (r->metrics) fclose(r->metrics);
    fy_ckpt_dir_close(r->ckpt); /* waits for a save in flight */
    fy_ckpt_snapshot_free(r->snap);
    cJSON_Delete(r->config);
    free(r->saved_path);
    fy_trainer_free(r->tr);
    fy_dev_free(r->dev);
    fy_loader_free(r->train);
    fy_loader_free(r->val);
    fy_tokens_free(r->train_tok);
    fy_tokens_free(r->val_tok);
    fy_trace_buf_free(&r->trace);
    free(r->ms_all);
    free(r->val_losses);
    free(r->val_counts);
    free(r->val_sums);
}

/* The documents of data t (a training or validation set): with loss masks, the data's
 * own (tokens.h), whose packed sequences must fit whole in --seq T, and --doc-mask must not
 * say another way; else what --doc-mask says. *out is updated: DATA once any set has masks. */
static fy_status data_docs(const fy_tokens *t, const fy_doc_mask *asked, int T, fy_doc_mask *out) {
    if (!t || !fy_tokens_has_masks(t)) return FY_OK;
    if (asked->kind != FY_DOCS_NONE) {
        fy_log_error("--doc-mask: %s has its documents in its loss-mask files (.mask): drop "
                     "--doc-mask", fy_tokens_label(t));
        return FY_ERR_INVALID;
    }
    const int S = fy_tokens_packed_seq(t);
    if (S > 0 && T % S != 0) {
        fy_log_error("--seq %d: %s was packed into sequences of %d tokens (tokenize.py --seq %d); "
                     "--seq must be a multiple of %d, or a sequence would cut its examples", T,
                     fy_tokens_label(t), S, S, S);
        return FY_ERR_INVALID;
    }
    *out = (fy_doc_mask){FY_DOCS_DATA, 0};
    return FY_OK;
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
    size_t n = fy_tokens_count(r->train_tok), train_end = n, val_begin = n;
    const size_t S = (size_t)fy_tokens_packed_seq(r->train_tok);
    if (c->val_data) {
        FY_TRY(fy_tokens_open(c->val_data, &r->val_tok));
    } else if (c->val_split > 0 && c->data) {
        train_end = val_begin = n - (size_t)((double)n * c->val_split);
        if (S > 0 && val_begin < n) { /* at a packed sequence's start; training reads its
                                         first token only as a target, which never counts */
            val_begin = val_begin / S * S;
            train_end = val_begin + 1;
        }
    }
    r->docs = c->docs;
    FY_TRY(data_docs(r->train_tok, &c->docs, T, &r->docs));
    FY_TRY(data_docs(r->val_tok, &c->docs, T, &r->docs));
    if (r->val_tok && c->val_data && fy_tokens_has_masks(r->val_tok) != fy_tokens_has_masks(r->train_tok))
        fy_log_warn("%s has %sloss masks and %s %s: the validation loss counts %s the training "
                    "loss does", fy_tokens_label(r->val_tok), fy_tokens_has_masks(r->val_tok) ? "" : "no ",
                    fy_tokens_label(r->train_tok), fy_tokens_has_masks(r->train_tok) ? "has" : "has none",
                    fy_tokens_has_masks(r->val_tok) ? "fewer targets than" : "every target, not only those");
    FY_TRY(fy_loader_new(r->train_tok, 0, train_end, B, T, &r->train));
    const int64_t A = step_micros(c);
    r->train_end = train_end;
    r->batches = (train_batches){r->train, A, (int64_t)fy_loader_batches(r->train) / A,
                                 world_of(c) == 1};
    if (r->batches.steps_per_pass < 1) {
        fy_log_error("%s: %zu training tokens, fewer than one step needs (%lld micro-batches of "
                     "%d x %d, and one more token)", fy_tokens_label(r->train_tok), train_end,
                     (long long)A, B, T);
        return FY_ERR_INVALID;
    }
    if (r->val_tok) {
        FY_TRY(fy_tokens_check_vocab(r->val_tok, V));
        FY_TRY(fy_loader_new(r->val_tok, 0, fy_tokens_count(r->val_tok), B, T, &r->val));
    } else if (val_begin < n) {
        FY_TRY(fy_loader_new(r->train_tok, val_begin, n, B, T, &r->val));
    }
    return FY_OK;
}

/* The mean loss of the first nbatches validation batches (at most one pass). */
/* A job's rank's share of the validation batches: its i-th is batch first + i * stride. */
typedef struct val_share { fy_loader *ld; int64_t first, stride; } val_share;

static fy_status share_batch(void *ctx, int64_t i, int32_t *x, int32_t *y, int32_t *docs) {
    const val_share *v = ctx;
    return batch_from(v->ld, v->first + i * v->stride, x, y, docs);
}

/* The mean loss over every target counted in n batches, from each batch's mean and count,
 * in batch order (NaN when none counts: no loss to report, not a perfect one). */
static float pooled_loss(const float *losses, const int64_t *counts, int64_t n) {
    double sum = 0.0;
    int64_t total = 0;
    for (int64_t i = 0; i < n; i++) {
        sum += (double)losses[i] * (double)counts[i];
        total += counts[i];
    }
    return total ? (float)(sum / (double)total) : NAN;
}

/* The validation loss over nbatches: the mean over their counted targets. A job's ranks
 * (every one holds the same weights) evaluate every N-th batch each, and the losses and
 * counts meet in their places (sums whose other terms are zeros: the same bits), so the
 * mean is one process's. */
static fy_status validate(run *r, int64_t nbatches, float *loss) {
    int64_t avail = (int64_t)fy_loader_batches(r->val);
    if (nbatches > avail) nbatches = avail;
    const int W = world_of(r->cfg);
    float *losses = r->val_losses;
    int64_t *counts = r->val_counts;
    if (W == 1) {
        FY_TRY(fy_trainer_eval_run(r->tr, (int)nbatches, batch_from, r->val, losses, counts));
    } else {
        const int rank = fy_comm_rank(r->cfg->comm);
        val_share v = {r->val, rank, W};
        const int64_t mine = nbatches > rank ? (nbatches - rank + W - 1) / W : 0;
        float *tmp = losses + nbatches; /* the buffers hold twice the batches */
        int64_t *tmpc = counts + nbatches;
        if (mine) FY_TRY(fy_trainer_eval_run(r->tr, (int)mine, share_batch, &v, tmp, tmpc));
        double *c = r->val_sums; /* the counts as doubles (exact below 2^53) */
        memset(losses, 0, (size_t)nbatches * sizeof *losses);
        memset(c, 0, (size_t)nbatches * sizeof *c);
        for (int64_t i = 0; i < mine; i++) {
            losses[rank + i * W] = tmp[i];
            c[rank + i * W] = (double)tmpc[i];
        }
        FY_TRY(fy_comm_sum(r->cfg->comm, losses, (size_t)nbatches, FY_F32));
        FY_TRY(fy_comm_sum(r->cfg->comm, c, (size_t)nbatches, FY_COMM_F64));
        for (int64_t i = 0; i < nbatches; i++) counts[i] = (int64_t)c[i];
    }
    *loss = pooled_loss(losses, counts, nbatches);
    if (isnan(*loss))
        fy_log_warn("validation: no target of its %lld batches counts in the loss (their masks): "
                    "no validation loss", (long long)nbatches);
    return FY_OK;
}

/* The progress bar after step `step` of `steps`; this process began at step `first`. */
static void progress(int64_t step, int64_t first, int64_t steps, double elapsed_ms, float loss) {
    int width = 30, done = (int)(width * step / steps);
    double eta_s = elapsed_ms / 1e3 / (double)(step - first) * (double)(steps - step);
    fprintf(stdout, "\r[%.*s%*s] %3d%% step %lld/%lld loss %.4f eta %dm%02ds ", done,
            "==============================", width - done, "", (int)(100 * step / steps),
            (long long)step, (long long)steps, loss, (int)eta_s / 60, (int)eta_s % 60);
    fflush(stdout);
}

static void print_header(const run *r) {
    const fy_train_cfg *c = r->cfg;
    char shape[FY_MODEL_SIGNATURE_MAX];
    fy_model_describe(c->model, shape, sizeof shape);
    const char *from = r->start > 0 || r->saved_path ? r->saved_path
                       : c->init ? fy_weights_path(c->init) : fy_model_name(c->model);
    printf("model   %s (%s): %.2fM parameters (%s)\n", from, fy_model_family(c->model),
           (double)fy_model_num_params(c->model) / 1e6, shape);
    printf("device  %s\n", fy_dev_name(r->dev));
    printf("data    %s: %zu tokens", fy_tokens_label(r->train_tok), fy_tokens_count(r->train_tok));
    if (fy_tokens_has_masks(r->train_tok)) {
        const int S = fy_tokens_packed_seq(r->train_tok);
        printf(" with loss masks and documents");
        if (S > 0) printf(" (packed into %d-token sequences)", S);
    }
    printf("; batch %d x %d", c->plan->micro_batch, c->seq);
    if (c->plan->grad_accum > 1) printf(" x %d accumulated", c->plan->grad_accum);
    printf("; validation: %s\n", r->val ? (r->val_tok ? fy_tokens_label(r->val_tok)
                                                      : "held-out tail") : "none");
    printf("timing  a step line's ms: the mean over its window (up to %d steps run as one task "
           "graph) of the wall time between step completions (the first step's own)\n",
           TRAIN_WINDOW);
    fflush(stdout);
}

/* ---- checkpoints ---------------------------------------------------------------------- */

/* A CRC of the training range's first and last FINGERPRINT_TOKENS tokens, and one of
 * their loss masks and document starts (where the data has them: else masks[0] = 0):
 * with the label and the count, what tells a resumed run's data from the checkpoint's. */
static fy_status data_fingerprint(const run *r, char hex[16], char masks[16]) {
    const size_t n = r->train_end, k = n < FINGERPRINT_TOKENS ? n : FINGERPRINT_TOKENS;
    int32_t *buf = malloc(k * sizeof *buf);
    if (!buf) {
        fy_log_error("out of host memory");
        return FY_ERR_NOMEM;
    }
    fy_tokens_read(r->train_tok, 0, k, buf);
    uint32_t crc = fy_crc32c(buf, k * sizeof *buf, 0);
    fy_tokens_read(r->train_tok, n - k, k, buf);
    crc = fy_crc32c(buf, k * sizeof *buf, crc);
    free(buf);
    snprintf(hex, 16, "%08x", crc);
    masks[0] = 0;
    if (fy_tokens_has_masks(r->train_tok)) {
        crc = fy_tokens_masks_crc(r->train_tok, 0, k, 0);
        snprintf(masks, 16, "%08x", fy_tokens_masks_crc(r->train_tok, n - k, k, crc));
    }
    return FY_OK;
}

/* The run's configuration as checkpoints record it. */
static fy_status build_config(run *r) {
    const fy_train_cfg *c = r->cfg;
    char sig[FY_MODEL_SIGNATURE_MAX], fp[16], mfp[16];
    FY_TRY(data_fingerprint(r, fp, mfp));
    fy_model_signature(c->model, sig, sizeof sig);
    cJSON *o = cJSON_CreateObject(), *d = o ? cJSON_AddObjectToObject(o, "data") : NULL;
    if (!d) {
        cJSON_Delete(o);
        fy_log_error("out of host memory");
        return FY_ERR_NOMEM;
    }
    cJSON_AddStringToObject(o, "model", sig);
    cJSON_AddNumberToObject(o, "seq", c->seq);
    cJSON_AddNumberToObject(o, "sequences_per_step",
                            (double)c->plan->micro_batch * (double)step_micros(c));
    cJSON_AddNumberToObject(o, "micro_batch", c->plan->micro_batch);
    cJSON_AddNumberToObject(o, "grad_accum", c->plan->grad_accum);
    cJSON_AddStringToObject(o, "summed", c->sum_groups[0] ? c->sum_groups : "in order");
    cJSON_AddStringToObject(o, "dtype", fy_dtype_name(c->plan->dtype));
    const int64_t N = (int64_t)c->plan->micro_batch * c->seq; /* a chunk past it is all of it */
    cJSON_AddNumberToObject(o, "chunk_tokens", (double)(fy_model_chunk(c->model) < N ? fy_model_chunk(c->model) : N));
    char docs[32] = "none";
    if (r->docs.kind == FY_DOCS_DATA)
        snprintf(docs, sizeof docs, "data");
    else if (r->docs.kind != FY_DOCS_NONE)
        snprintf(docs, sizeof docs, "%s=%d", r->docs.kind == FY_DOCS_EOT ? "eot" : "bos",
                 (int)r->docs.token);
    cJSON_AddStringToObject(o, "doc_mask", docs);
    cJSON_AddStringToObject(d, "source", fy_tokens_label(r->train_tok));
    cJSON_AddNumberToObject(d, "tokens", (double)r->train_end);
    cJSON_AddStringToObject(d, "fingerprint", fp);
    if (mfp[0]) cJSON_AddStringToObject(d, "masks", mfp);
    cJSON_AddNumberToObject(o, "steps", (double)c->steps);
    cJSON_AddNumberToObject(o, "lr", c->lr);
    cJSON_AddNumberToObject(o, "min_lr", c->min_lr);
    cJSON_AddStringToObject(o, "lr_schedule", c->cosine ? "cosine" : "const");
    cJSON_AddNumberToObject(o, "warmup", (double)c->warmup);
    cJSON_AddNumberToObject(o, "weight_decay", c->weight_decay);
    cJSON_AddNumberToObject(o, "beta1", c->beta1);
    cJSON_AddNumberToObject(o, "beta2", c->beta2);
    cJSON_AddNumberToObject(o, "eps", c->eps);
    cJSON_AddNumberToObject(o, "clip", c->clip);
    cJSON_AddNumberToObject(o, "seed", (double)c->seed);
    r->config = o;
    return FY_OK;
}

/* Whether field key of a and b is the same JSON value (both absent counts as the same). */
static bool same_field(const cJSON *a, const cJSON *b, const char *key) {
    return cJSON_Compare(cJSON_GetObjectItemCaseSensitive(a, key),
                         cJSON_GetObjectItemCaseSensitive(b, key), true) ||
           (!cJSON_GetObjectItemCaseSensitive(a, key) && !cJSON_GetObjectItemCaseSensitive(b, key));
}

/* A field's value for messages ("?" if absent). */
static const char *field_text(const cJSON *o, const char *key, char *buf, size_t cap) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (cJSON_IsString(v)) snprintf(buf, cap, "%s", v->valuestring);
    else if (cJSON_IsNumber(v)) snprintf(buf, cap, "%.9g", v->valuedouble);
    else snprintf(buf, cap, "?");
    return buf;
}

/* The checkpoint's configuration against this run's: what makes resuming meaningless is
 * refused, what makes it differ from the uninterrupted run is allowed with a warning. */
static fy_status check_config(const run *r, const fy_ckpt *ck) {
    const cJSON *was = fy_ckpt_state_of(ck)->config, *now = r->config;
    const char *path = fy_ckpt_path(ck);
    char a[256], b[256];
    static const struct { const char *key, *what; } hard[] = {
        {"model", "model"}, {"seq", "sequence length (--seq)"},
        {"sequences_per_step", "sequences per step (--batch x --grad-accum)"},
    };
    for (size_t i = 0; i < sizeof hard / sizeof hard[0]; i++)
        if (!same_field(was, now, hard[i].key)) {
            fy_log_error("checkpoint %s is from another configuration: its %s is %s, this run's "
                         "%s", path, hard[i].what, field_text(was, hard[i].key, a, sizeof a),
                         field_text(now, hard[i].key, b, sizeof b));
            return FY_ERR_INVALID;
        }
    const cJSON *dw = cJSON_GetObjectItemCaseSensitive(was, "data");
    const cJSON *dn = cJSON_GetObjectItemCaseSensitive(now, "data");
    if (!same_field(dw, dn, "tokens") || !same_field(dw, dn, "fingerprint")) {
        char n1[32], n2[32];
        fy_log_error("checkpoint %s was trained on other data: %s (%s tokens), this run's is %s "
                     "(%s tokens)", path, field_text(dw, "source", a, sizeof a),
                     field_text(dw, "tokens", n1, sizeof n1), field_text(dn, "source", b, sizeof b),
                     field_text(dn, "tokens", n2, sizeof n2));
        return FY_ERR_INVALID;
    }
    if (!same_field(dw, dn, "masks")) {
        const bool had = cJSON_GetObjectItemCaseSensitive(dw, "masks") != NULL;
        const bool has = cJSON_GetObjectItemCaseSensitive(dn, "masks") != NULL;
        fy_log_error("checkpoint %s was trained on the same tokens with %s: %s %s", path,
                     had && has ? "other loss masks or documents" : had ? "loss masks" : "no loss masks",
                     field_text(dn, "source", b, sizeof b),
                     had && has ? "has other .mask files (tokenized with another --loss-on or --seq?)"
                     : has ? "now has .mask files" : "has no .mask files now");
        return FY_ERR_INVALID;
    }
    static const struct { const char *key, *flag; } soft[] = {
        {"steps", "--steps"}, {"lr", "--lr"}, {"min_lr", "--min-lr"},
        {"lr_schedule", "--lr-schedule"}, {"warmup", "--warmup"},
        {"weight_decay", "--weight-decay"}, {"beta1", "--beta1"}, {"beta2", "--beta2"},
        {"eps", "--eps"}, {"clip", "--clip"}, {"dtype", "--dtype"},
        {"chunk_tokens", "--chunk-tokens"}, {"doc_mask", "--doc-mask"},
    };
    /* the differences allowed are every rank's: rank 0 says them */
    if (r->cfg->comm && fy_comm_rank(r->cfg->comm) != 0) return FY_OK;
    const cJSON *sched = cJSON_GetObjectItemCaseSensitive(now, "lr_schedule");
    const bool cosine = cJSON_IsString(sched) && !strcmp(sched->valuestring, "cosine");
    for (size_t i = 0; i < sizeof soft / sizeof soft[0]; i++)
        if (!same_field(was, now, soft[i].key) && (cosine || strcmp(soft[i].key, "steps")) &&
            cJSON_GetObjectItemCaseSensitive(was, soft[i].key)) /* older checkpoints lack some */
            fy_log_warn("resuming with %s %s where the checkpoint's run had %s: the result will "
                        "differ from a run never stopped", soft[i].flag,
                        field_text(now, soft[i].key, b, sizeof b),
                        field_text(was, soft[i].key, a, sizeof a));
    if (!same_field(was, now, "micro_batch")) {
        char a2[32], b2[32];
        fy_log_warn("resuming with micro-batches of %s x %s where the checkpoint's run had %s x %s: "
                    "each step reads the same data, but its gradient is summed in another order, "
                    "so the result differs from a run never stopped in rounding",
                    field_text(now, "micro_batch", b, sizeof b), field_text(now, "grad_accum", b2, sizeof b2),
                    field_text(was, "micro_batch", a, sizeof a), field_text(was, "grad_accum", a2, sizeof a2));
    } else if (cJSON_GetObjectItemCaseSensitive(was, "summed") && !same_field(was, now, "summed")) {
        field_text(now, "summed", b, sizeof b); /* "in order", or a job's counts by rank */
        field_text(was, "summed", a, sizeof a);
        const bool now_ranks = strcmp(b, "in order") != 0, was_ranks = strcmp(a, "in order") != 0;
        fy_log_warn("resuming with the step's gradient summed %s%s where the checkpoint's run "
                    "summed it %s%s: each step reads the same data, but its sum is in another "
                    "order, so the result differs from a run never stopped in rounding",
                    now_ranks ? "by rank: " : "", b, was_ranks ? "by rank: " : "", a);
    }
    return FY_OK;
}

/* The checkpoint to resume from (NULL: start afresh), opened and checked. When the one
 * `latest` names cannot be read, the next older one is named (never used unasked). */
static fy_status find_resume(run *r, fy_ckpt **out) {
    const fy_train_cfg *c = r->cfg;
    char *path = NULL;
    bool guessed = false;
    *out = NULL;
    if (*c->resume) {
        if (!(path = strdup(c->resume))) return FY_ERR_NOMEM;
    } else {
        FY_TRY(fy_ckpt_latest(c->ckpt_dir, &path, &guessed));
        if (!path) {
            fy_log_info("--resume: no checkpoint in %s yet: starting from the first step", c->ckpt_dir);
            return FY_OK;
        }
        if (guessed)
            fy_log_warn("%s/latest is missing (a run was stopped before it moved): resuming from "
                        "the newest checkpoint, %s", c->ckpt_dir, path);
    }
    const double t0 = fy_now_ms();
    fy_status st = fy_ckpt_open(path, out);
    r->verify_ms = fy_now_ms() - t0;
    if (st != FY_OK && !*c->resume) {
        const char *slash = strrchr(path, '/');
        int64_t s;
        char *before = slash && sscanf(slash + 1, "step-%" SCNd64, &s) == 1
                           ? fy_ckpt_before(c->ckpt_dir, s) : NULL;
        if (before)
            fy_log_info("an older checkpoint is %s: resume from it with --resume %s", before, before);
        free(before);
    }
    if (st == FY_OK) st = check_config(r, *out);
    free(path);
    if (st != FY_OK) {
        fy_ckpt_close(*out);
        *out = NULL;
    }
    return st;
}

/* The metrics file's absolute path and size now, if it is a regular file (else
 * path[0] = 0). */
static void metrics_position(const char *metrics, char path[1024], int64_t *nbytes) {
    struct stat sb;
    path[0] = 0;
    *nbytes = -1;
    if (!metrics) return;
    char *real = realpath(metrics, NULL);
    if (real && strlen(real) < 1024 && stat(real, &sb) == 0 && S_ISREG(sb.st_mode)) {
        snprintf(path, 1024, "%s", real);
        *nbytes = (int64_t)sb.st_size;
    } else if (!real && errno == ENOENT && strlen(metrics) < 1024) {
        /* not created yet: empty, where it will be */
        char d[1024], b[1024];
        snprintf(d, sizeof d, "%s", metrics);
        snprintf(b, sizeof b, "%s", metrics);
        char *rdir = realpath(dirname(d), NULL);
        if (rdir) {
            int k = snprintf(path, 1024, "%s/%s", strcmp(rdir, "/") ? rdir : "", basename(b));
            if (k < 0 || k >= 1024) path[0] = 0;
            *nbytes = 0;
        }
        free(rdir);
    }
    free(real);
}

/* A resumed run's --metrics file: what the stopped run wrote after the checkpoint (or,
 * resuming with no checkpoint yet, after the first launch began) is cut, since this run
 * writes those steps again; recorded path must be the file's, and the file no shorter. */
static fy_status trim_metrics(const char *metrics, const char *recorded, int64_t nbytes) {
    char path[1024];
    int64_t now;
    metrics_position(metrics, path, &now);
    if (!path[0] || !recorded[0] || strcmp(path, recorded) || nbytes < 0 || now <= nbytes)
        return FY_OK;
    if (truncate(path, (off_t)nbytes) != 0) {
        fy_log_error("cannot trim metrics file %s: %s", metrics, strerror(errno));
        return FY_ERR_IO;
    }
    fy_log_info("metrics %s: removed %lld bytes the stopped run wrote after its last "
                "checkpoint (this run writes those steps again)", metrics, (long long)(now - nbytes));
    return FY_OK;
}

/* Where the metrics file stood when a run began in the checkpoint directory (before any
 * checkpoint), so a relaunch before the first one can trim it: read, or written when
 * first. */
static fy_status metrics_start(run *r, bool resumed_afresh) {
    const fy_train_cfg *c = r->cfg;
    char file[4200];
    snprintf(file, sizeof file, "%s/%s", c->ckpt_dir, FY_CKPT_METRICS_START_NAME);
    cJSON *j = NULL;
    struct stat sb;
    if (resumed_afresh && c->metrics && stat(file, &sb) == 0) {
        FY_TRY(fy_json_read(file, "metrics start", &j));
        const cJSON *p = cJSON_GetObjectItemCaseSensitive(j, "path");
        const cJSON *n = cJSON_GetObjectItemCaseSensitive(j, "bytes");
        fy_status st = FY_OK;
        if (cJSON_IsString(p) && cJSON_IsNumber(n))
            st = trim_metrics(c->metrics, p->valuestring, (int64_t)n->valuedouble);
        cJSON_Delete(j);
        return st;
    }
    char path[1024];
    int64_t nbytes;
    metrics_position(c->metrics, path, &nbytes);
    if (!path[0]) {
        unlink(file);
        return FY_OK;
    }
    if (!(j = cJSON_CreateObject()) || !cJSON_AddStringToObject(j, "path", path) ||
        !cJSON_AddNumberToObject(j, "bytes", (double)nbytes)) {
        cJSON_Delete(j);
        return FY_ERR_NOMEM;
    }
    fy_status st = fy_json_write(file, "metrics start", j);
    cJSON_Delete(j);
    return st;
}

static fy_status setup_run(run *r, const fy_ckpt *ck);

static fy_status setup_checkpoints_lead(run *r, fy_ckpt **ck);

/* Checkpoints: the directory, this run's configuration and the checkpoint resumed from
 * (*ck, NULL when starting afresh), whose step's metrics lines end the metrics file.
 * In a job, rank 0 alone keeps the directory (its lock, its checkpoints, gathered from
 * every rank's shards, the metrics), finds the checkpoint to resume from and tells the
 * others, which read it (each keeping its shard) and check it against their
 * configuration. */
static fy_status setup_checkpoints(run *r, fy_ckpt **ck) {
    const fy_train_cfg *c = r->cfg;
    *ck = NULL;
    if (!c->ckpt_dir && !c->resume) return FY_OK;
    if (world_of(c) == 1) return setup_checkpoints_lead(r, ck);
    const bool lead = fy_comm_rank(c->comm) == 0;
    fy_status st = lead ? setup_checkpoints_lead(r, ck) : build_config(r);
    char path[4096] = "";
    if (lead && *ck) snprintf(path, sizeof path, "%s", fy_ckpt_path(*ck));
    FY_TRY(fy_comm_agree(c->comm, st)); /* rank 0 said why; the others stop with it */
    FY_TRY(fy_comm_bcast(c->comm, path, sizeof path));
    if (lead || !path[0]) return FY_OK;
    FY_TRY(fy_ckpt_open(path, ck));
    return check_config(r, *ck);
}

static fy_status setup_checkpoints_lead(run *r, fy_ckpt **ck) {
    const fy_train_cfg *c = r->cfg;
    *ck = NULL;
    if (c->ckpt_dir) FY_TRY(fy_ckpt_dir_open(c->ckpt_dir, &r->ckpt));
    if (c->ckpt_dir && !c->resume) { /* a new run must not mix with another's checkpoints */
        char *have = NULL;
        bool guessed;
        FY_TRY(fy_ckpt_latest(c->ckpt_dir, &have, &guessed));
        if (have) {
            fy_log_error("--checkpoint-dir %s holds checkpoints (%s): add --resume to continue "
                         "that run, or give another directory", c->ckpt_dir, have);
            free(have);
            return FY_ERR_USAGE;
        }
    }
    FY_TRY(build_config(r));
    if (c->resume) FY_TRY(find_resume(r, ck));
    if (*ck && c->metrics) {
        const fy_ckpt_info *in = &fy_ckpt_state_of(*ck)->info;
        FY_TRY(trim_metrics(c->metrics, in->metrics, in->metrics_bytes));
    }
    if (!*ck && c->ckpt_dir) FY_TRY(metrics_start(r, c->resume != NULL));
    return FY_OK;
}

/* The resumed run's state: moments, counters, where the loop goes on. */
static fy_status resume_from(run *r, const fy_ckpt *ck) {
    const fy_ckpt_info *in = &fy_ckpt_state_of(ck)->info;
    if (r->cfg->init)
        fy_log_info("--init %s: the weights come from checkpoint %s (it has the same shape)",
                    fy_weights_path(r->cfg->init), fy_ckpt_path(ck));
    const double t0 = fy_now_ms();
    FY_TRY(fy_ckpt_restore(ck, r->tr, r->cfg->plan->grad_accum));
    r->restore_ms = fy_now_ms() - t0;
    r->start = r->saved = in->step;
    r->skipped_run = in->skipped_run;
    r->loss = (float)in->loss;
    r->val_loss = (float)in->val_loss;
    if (!(r->saved_path = strdup(fy_ckpt_path(ck)))) return FY_ERR_NOMEM;
    return FY_OK;
}

static fy_status setup(run *r) {
    const fy_train_cfg *c = r->cfg;
    if (c->save && !follower(c)) FY_TRY(fy_model_save_check(c->save)); /* fail now, not after the run */
    FY_TRY(open_data(r));
    fy_ckpt *ck = NULL;
    fy_status st = setup_checkpoints(r, &ck);
    if (st == FY_OK) st = setup_run(r, ck);
    fy_ckpt_close(ck);
    return st;
}

static fy_status setup_run(run *r, const fy_ckpt *ck) {
    const fy_train_cfg *c = r->cfg;
    if (c->metrics && !(r->metrics = fopen(c->metrics, "a"))) {
        fy_log_error("cannot open metrics file %s", c->metrics);
        return FY_ERR_IO;
    }
    if (r->val) {
        const size_t nb = fy_loader_batches(r->val);
        r->val_losses = malloc(2 * nb * sizeof *r->val_losses);
        r->val_counts = malloc(2 * nb * sizeof *r->val_counts);
        r->val_sums = malloc(nb * sizeof *r->val_sums);
        if (!r->val_losses || !r->val_counts || !r->val_sums) {
            fy_log_error("out of host memory for the validation losses");
            return FY_ERR_NOMEM;
        }
    }
    FY_TRY(fy_dev_new(&c->dev, &r->dev));
    fy_trainer_cfg tc = {.model = c->model, .T = c->seq, .plan = c->plan, .disk_dir = c->disk_dir, .beta1 = c->beta1,
                         .beta2 = c->beta2, .eps = c->eps, .weight_decay = c->weight_decay,
                         .clip = c->clip, .seed = c->seed,
                         .weights = ck ? fy_ckpt_weights(ck) : c->init,
                         .schedule = c->schedule, .adam_threads = c->adam_threads,
                         .comm = c->comm, .micro_first = c->micro_first,
                         .micro_total = c->micro_total, .stop = &fy_train_stop_signal,
                         .docs = r->docs,
                         .test_nan_step = c->test_nan_step};
    FY_TRY(fy_trainer_new(r->dev, &tc, &r->tr));
    if (ck) FY_TRY(resume_from(r, ck));
    r->model = fy_trainer_storage(r->tr)->mem; /* this rank's: in a job, its shards */
    FY_TRY(setup_snapshot(r));
    r->N = (size_t)c->plan->micro_batch * c->seq * (size_t)step_micros(c);
    return FY_OK;
}

/* Step s (0-based) is done: metrics, the skip check, and the line or the progress bar;
 * wall_ms is its own time (from the previous step's completion), ss->step_ms its
 * window's mean. */
static fy_status log_step(run *r, int64_t s, const fy_step_stats *ss, double wall_ms, float lr,
                          bool validated) {
    const fy_train_cfg *c = r->cfg;
    const double ms = ss->step_ms, tok_s = (double)r->N / (ms / 1e3);
    if (s > r->start) { /* the first step warms caches */
        if (r->ms_all) r->ms_all[r->ms_count] = wall_ms;
        r->ms_sum += wall_ms;
        r->ms_count++;
    } else {
        r->first_ms = wall_ms;
    }
    r->loss = ss->loss;
    if (r->metrics) {
        char v[5][32];
        fprintf(r->metrics, "{\"step\":%lld,\"loss\":%s,\"lr\":%s,\"grad_norm\":%s,"
                "\"clip_coef\":%s,\"step_ms\":%.6f,\"step_wall_ms\":%.6f,\"tokens_per_s\":%.3f,"
                "\"loss_tokens\":%lld",
                (long long)s + 1, json_num(ss->loss, v[0]), json_num(lr, v[1]),
                json_num(ss->grad_norm, v[2]), json_num(ss->clip_coef, v[3]), ms, wall_ms, tok_s,
                (long long)ss->targets);
        if (ss->skipped) fprintf(r->metrics, ",\"skipped\":true");
        if (ss->speculated)
            fprintf(r->metrics, ",\"speculated\":%d,\"kept\":%d", ss->speculated, ss->kept);
        if (validated) fprintf(r->metrics, ",\"val_loss\":%s", json_num(r->val_loss, v[4]));
        fprintf(r->metrics, "}\n");
        if (fflush(r->metrics) != 0 || ferror(r->metrics)) { /* a full disk, a closed pipe */
            fy_log_error("cannot write metrics file %s: %s", c->metrics, strerror(errno));
            return FY_ERR_IO;
        }
    }
    if (ss->skipped && ss->targets == 0) { /* nothing to learn from: not a divergence */
        fy_log_warn("step %lld: no token of its batch counts in the loss (its masks); update "
                    "skipped", (long long)s + 1);
    } else if (ss->skipped) {
        fy_log_warn("step %lld: gradient norm is %g; update skipped", (long long)s + 1,
                    ss->grad_norm);
        if (++r->skipped_run >= MAX_SKIPPED_RUN) {
            finish_pending(r); /* the checkpoint to name is the newest complete one */
            if (r->saved_path)
                fy_log_error("training diverged: %d steps in a row had non-finite gradients; the "
                             "last checkpoint, %s (step %lld), is kept: resume from it with "
                             "--resume %s and a lower --lr", MAX_SKIPPED_RUN, r->saved_path,
                             (long long)r->saved, r->saved_path);
            else
                fy_log_error("training diverged: %d steps in a row had non-finite gradients "
                             "(last good weights not saved; lower --lr or use --clip, and "
                             "--checkpoint-dir to keep them)", MAX_SKIPPED_RUN);
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
        if (fy_tokens_has_masks(r->train_tok)) printf(" | %lld loss tokens", (long long)ss->targets);
        printf("\n");
    } else if (tty) {
        progress(s + 1, r->start, c->steps, fy_now_ms() - r->t_start, ss->loss);
    }
    fflush(stdout);
    return FY_OK;
}

/* Steps [s0, s0 + n) as one window; then their log lines (those that completed, if a
 * task failed or a signal stopped it: *done), validation at the window's end when it is
 * due. */
static fy_status run_window(run *r, int64_t s0, int n, int *done) {
    const fy_train_cfg *c = r->cfg;
    *done = 0;
    float lrs[TRAIN_WINDOW];
    fy_step_stats stats[TRAIN_WINDOW];
    const double min_lr = c->min_lr;
    for (int i = 0; i < n; i++)
        lrs[i] = (float)fy_lr_at(s0 + i, c->steps, c->lr, min_lr, c->warmup, c->cosine);
    fy_sched_result res = {0};
    fy_graph g;
    fy_window w = {.nsteps = n, .lrs = lrs, .next_batch = train_batch,
                   .targets = fy_tokens_has_masks(r->train_tok) ? train_targets : NULL,
                   .batch_ctx = &r->batches, .stats = stats, .trace = c->trace ? &res : NULL, .graph = c->trace ? &g : NULL};
    const double t_win = fy_now_ms() - r->t_start;
    fy_status st = fy_trainer_run(r->tr, &w);
    if (st == FY_OK && c->trace) {
        st = fy_trace_append(&r->trace, &g, &res, t_win, (int)(s0 * c->plan->grad_accum));
        fy_sched_result_free(&res);
        fy_graph_free(&g);
    }
    /* a step's time is the window's mean of the wall time between step completions: a
     * window's last step completes with nothing after it competing, and the next window's
     * first fills the pipeline, so single steps at the boundaries would alternate short
     * and long; the median is of the single steps */
    double wall[TRAIN_WINDOW];
    for (int i = 0; i < w.completed; i++) {
        wall[i] = stats[i].done_ms - r->last_done;
        r->last_done = stats[i].done_ms;
    }
    /* the run's first step (its warm-up) shows its own time, outside the mean */
    const int first = s0 == r->start ? 1 : 0;
    double sum = 0.0;
    for (int i = first; i < w.completed; i++) sum += wall[i];
    for (int i = 0; i < w.completed; i++)
        stats[i].step_ms = i < first ? wall[i] : sum / (w.completed - first);
    for (int i = 0; i < w.completed; i++) { /* all of them, unless a task failed */
        const int64_t s = s0 + i;
        const bool do_val = r->val && i == n - 1 &&
                            (s + 1 == c->steps || (c->val_every && (s + 1) % c->val_every == 0));
        if (do_val) {
            const double v0 = fy_now_ms();
            FY_TRY(validate(r, c->val_batches, &r->val_loss));
            r->last_done += fy_now_ms() - v0; /* a pause, not the next step's time */
        }
        FY_TRY(log_step(r, s, &stats[i], wall[i], lrs[i], do_val));
        *done = i + 1;
    }
    return st;
}

static int cmp_f64(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The summary line, the weights, the trace, and the what-if of --predict. */
static fy_status report(run *r) {
    const fy_train_cfg *c = r->cfg;
    double total_s = (fy_now_ms() - r->t_start) / 1e3;
    if (c->save && follower(c)) {
        FY_TRY(fy_trainer_serve(r->tr));
    } else if (c->save) {
        FY_TRY(end_served(r->tr, fy_trainer_save(r->tr, c->save, &c->save_opts)));
    }
    if (c->trace) FY_TRY(fy_trace_save(&r->trace, c->trace, "ferry train"));
    fy_dev_mem_stats ms;
    fy_dev_mem_stats_get(r->dev, &ms);
    char peak[32], pred[32];
    /* the mean over the steps after the first, which warms caches; a run of one step has
     * only that one, said so */
    const double mean_ms = r->ms_count ? r->ms_sum / (double)r->ms_count : r->first_ms;
    double median_ms = mean_ms;
    if (r->ms_count && r->ms_all) {
        qsort(r->ms_all, (size_t)r->ms_count, sizeof *r->ms_all, cmp_f64);
        const int64_t k = r->ms_count / 2;
        median_ms = r->ms_count % 2 ? r->ms_all[k] : 0.5 * (r->ms_all[k - 1] + r->ms_all[k]);
    }
    const int64_t ran = c->steps > r->start ? c->steps - r->start : 0;
    if (!ran)
        printf("done    nothing to train: resumed at step %lld of %lld | final loss %.4f",
               (long long)r->start, (long long)c->steps, r->loss);
    else
        printf("done    %lld step%s%s in %.1f s | %.1f ms/step%s, median %.1f | %.0f tok/s | final loss %.4f",
               (long long)ran, ran == 1 ? "" : "s", r->start ? " (resumed)" : "", total_s,
               mean_ms, r->ms_count ? " (mean after the first)" : " (the first step's, with its warm-up)",
               median_ms,
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

/* A checkpoint of the state after step `step` (steps are 1-based here: step steps done). */
/* The "ckpt" line of a checkpoint written: its size, the time training waited for it,
 * and for one written in the background the time the writing took; the speed is of the
 * state's bytes (the files' headers aside). */
static void print_ckpt(const run *r, const char *path, double wait_ms, double bg_ms) {
    if (r->cfg->quiet) return;
    if (isatty(STDOUT_FILENO)) printf("\r%*s\r", 78, "");
    char size[32];
    const size_t nbytes = fy_ckpt_snapshot_nbytes(r->cfg->model);
    fy_fmt_size(nbytes, size, sizeof size);
    const double ms = bg_ms > 0 ? bg_ms : wait_ms, gbps = ms > 0 ? nbytes / ms / 1e6 : 0;
    if (bg_ms > 0)
        printf("ckpt    %s (%s: training waited %.2f s for the snapshot; written in the "
               "background in %.2f s, %.2f GB/s)\n", path, size, wait_ms / 1e3, bg_ms / 1e3, gbps);
    else
        printf("ckpt    %s (%s in %.2f s, %.2f GB/s)\n", path, size, wait_ms / 1e3, gbps);
    fflush(stdout);
}

/* The save in the background, if one is in flight: joined, and it is the newest. */
static fy_status finish_pending(run *r) {
    if (!r->ckpt || !fy_ckpt_pending(r->ckpt)) return FY_OK;
    char *path = NULL;
    FY_TRY(fy_ckpt_wait(r->ckpt, &path));
    free(r->saved_path);
    r->saved_path = path;
    print_ckpt(r, path, r->pending_wait_ms, fy_now_ms() - r->pending_t0);
    return FY_OK;
}

static fy_status save_checkpoint_lead(run *r, int64_t step, bool now);

/* Whether this process takes part in checkpoints: rank 0 keeps the directory, a job's
 * other ranks serve it their shards. */
static bool ckpt_on(const run *r) { return r->ckpt || (r->cfg->ckpt_dir && follower(r->cfg)); }

/* A checkpoint of the state after step `step` (steps are 1-based here: step steps done):
 * written in the background from a snapshot when the run has one (`now` false), else
 * before training goes on; a job's other ranks serve their shards meanwhile. */
static fy_status save_checkpoint(run *r, int64_t step, bool now) {
    if (!r->ckpt) {
        r->saved = step;
        return fy_trainer_serve(r->tr);
    }
    return end_served(r->tr, save_checkpoint_lead(r, step, now));
}

static fy_status save_checkpoint_lead(run *r, int64_t step, bool now) {
    fy_ckpt_info info = {.step = step, .updates = fy_trainer_steps_done(r->tr),
                         .skipped_run = r->skipped_run, .loss = r->loss, .val_loss = r->val_loss};
    if (r->metrics) fflush(r->metrics);
    metrics_position(r->cfg->metrics, info.metrics, &info.metrics_bytes);
    const int keep = r->cfg->ckpt_keep > 0 ? r->cfg->ckpt_keep : 2;
    FY_TRY(finish_pending(r));
    r->saved = step;
    if (r->snap && !now) {
        r->pending_t0 = fy_now_ms();
        FY_TRY(fy_ckpt_save_async(r->ckpt, r->tr, r->snap, &info, r->config, keep));
        r->pending_wait_ms = fy_now_ms() - r->pending_t0;
        return FY_OK;
    }
    char *path = NULL;
    const double t0 = fy_now_ms();
    FY_TRY(fy_ckpt_save(r->ckpt, r->tr, &info, r->config, keep, &path));
    free(r->saved_path);
    r->saved_path = path;
    print_ckpt(r, path, fy_now_ms() - t0, 0);
    return FY_OK;
}

/* Whether checkpoints go through a snapshot, written in the background: unless
 * --checkpoint-sync, when a core is left for the writer (the cpu backend's kernels take
 * --threads of them, all by default: a writer beside them slows every step more than it
 * saves, measured in bench/RESULTS.md), and the snapshot (12 bytes a parameter) takes at
 * most half the memory available now and stays inside --host-mem beside the plan's host
 * state. */
static fy_status setup_snapshot(run *r) {
    const fy_train_cfg *c = r->cfg;
    if (!r->ckpt || c->ckpt_sync) return FY_OK;
    const long cores = sysconf(_SC_NPROCESSORS_ONLN);
    if (c->dev.kind == FY_DEV_CPU && fy_dev_threads(r->dev) >= cores) {
        fy_log_info("checkpoints are written before training goes on: the cpu backend's kernels "
                    "use all %ld cores (--threads below that leaves the writer a core)", cores);
        return FY_OK;
    }
    const size_t need = fy_ckpt_snapshot_nbytes(c->model);
    size_t avail = 0;
    FILE *f = fopen("/proc/meminfo", "r");
    char line[256];
    while (f && fgets(line, sizeof line, f)) {
        unsigned long long kb;
        if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) avail = (size_t)kb << 10;
    }
    if (f) fclose(f);
    char a[32], b[32];
    if (need > avail / 2 || (c->host_budget && r->model.host_total + need > c->host_budget)) {
        fy_log_info("checkpoints are written before training goes on: a snapshot to write them "
                    "from in the background takes %s (%s available%s)",
                    fy_fmt_size(need, a, sizeof a), fy_fmt_size(avail, b, sizeof b),
                    c->host_budget ? ", and --host-mem binds" : "");
        return FY_OK;
    }
    return fy_ckpt_snapshot_new(c->model, &r->snap);
}

fy_status fy_train(const fy_train_cfg *cfg) {
    run r = {.cfg = cfg, .loss = NAN, .val_loss = NAN, .saved = -1};
    fy_status st = setup(&r);
    if (st == FY_OK && !cfg->quiet) print_header(&r);
    if (st == FY_OK && r.start > 0 && !cfg->quiet)
        printf("resume  %s: step %lld of %lld (verified in %.2f s, moments restored in %.2f s)\n",
               r.saved_path, (long long)r.start, (long long)cfg->steps, r.verify_ms / 1e3,
               r.restore_ms / 1e3);
    r.t_start = r.last_done = fy_now_ms();
    if (cfg->steps > r.start + 1) r.ms_all = malloc((size_t)(cfg->steps - r.start) * sizeof *r.ms_all);
    int64_t s0 = r.start;
    while (s0 < cfg->steps && st == FY_OK) {
        int32_t stop = atomic_load(&fy_train_stop_signal) != 0;
        /* every rank stops, or none (a request during a window stops it at a step's norm;
         * one between windows, before the next window runs a step it would drop) */
        if (cfg->comm) st = fy_comm_max_i32(cfg->comm, &stop);
        if (st == FY_OK && stop) st = FY_INTERRUPTED;
        if (st != FY_OK) break;
        /* a window of steps runs as one task graph; it ends at a validation point and at a
         * checkpoint */
        int64_t n = cfg->steps - s0 < TRAIN_WINDOW ? cfg->steps - s0 : TRAIN_WINDOW;
        if (cfg->val_every && r.val) {
            int64_t to_val = cfg->val_every - s0 % cfg->val_every;
            if (to_val < n) n = to_val;
        }
        if (cfg->ckpt_dir && cfg->ckpt_every) { /* the same windows on every rank */
            int64_t to_ckpt = cfg->ckpt_every - s0 % cfg->ckpt_every;
            if (to_ckpt < n) n = to_ckpt;
        }
        int done = 0;
        st = run_window(&r, s0, (int)n, &done);
        s0 += done;
        if (st == FY_OK && ckpt_on(&r) && cfg->ckpt_every && s0 % cfg->ckpt_every == 0) {
            const double c0 = fy_now_ms();
            st = save_checkpoint(&r, s0, false);
            r.last_done += fy_now_ms() - c0; /* a pause, not the next step's time */
        }
    }
    if (ckpt_on(&r) && (st == FY_OK || st == FY_INTERRUPTED) && s0 > r.saved && s0 > r.start) {
        fy_status cs = save_checkpoint(&r, s0, true); /* the end, or where the signal stopped it */
        if (cs != FY_OK) st = cs;
    }
    if (r.ckpt) { /* a save still in the background completes before the run reports */
        fy_status cs = finish_pending(&r);
        if (cs != FY_OK && (st == FY_OK || st == FY_INTERRUPTED)) st = cs;
    }
    if (st == FY_INTERRUPTED) {
        const int sig = atomic_load(&fy_train_stop_signal);
        if (!cfg->quiet && isatty(STDOUT_FILENO)) printf("\n");
        fflush(stdout);
        if (r.ckpt && r.saved >= 0)
            fy_log_info("interrupted by %s after step %lld; checkpoint %s: run the same command "
                        "with --resume to continue",
                        sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : "a signal",
                        (long long)s0, r.saved_path);
        else
            fy_log_info("interrupted by %s after step %lld (no --checkpoint-dir: nothing saved)",
                        sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : "a signal",
                        (long long)s0);
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
    int64_t *counts = NULL;
    fy_plan plan = {0};
    fy_doc_mask docs = cfg->docs;
    fy_status st;
    if ((st = fy_tokens_open(cfg->data, &tok)) != FY_OK ||
        (st = fy_tokens_check_vocab(tok, fy_model_vocab(cfg->model))) != FY_OK ||
        (st = data_docs(tok, &cfg->docs, cfg->seq, &docs)) != FY_OK ||
        (st = fy_loader_new(tok, 0, fy_tokens_count(tok), cfg->batch, cfg->seq, &ld)) != FY_OK)
        goto done;
    int64_t avail = (int64_t)fy_loader_batches(ld);
    int64_t nb = cfg->batches && cfg->batches < avail ? cfg->batches : avail;
    if (!(losses = malloc((size_t)nb * sizeof *losses)) ||
        !(counts = malloc((size_t)nb * sizeof *counts))) {
        fy_log_error("out of host memory for %lld losses", (long long)nb);
        st = FY_ERR_NOMEM;
        goto done;
    }
    if ((st = fy_dev_new(&cfg->dev, &dev)) != FY_OK ||
        (st = fy_plan_new(cfg->model, cfg->batch, 1, &plan)) != FY_OK)
        goto done;
    plan.dtype = cfg->dtype;
    fy_trainer_cfg tc = {.model = cfg->model, .T = cfg->seq, .eval_only = true, .plan = &plan,
                         .weights = cfg->weights, .docs = docs};
    if ((st = fy_trainer_new(dev, &tc, &tr)) != FY_OK ||
        (st = fy_trainer_eval_run(tr, (int)nb, batch_from, ld, losses, counts)) != FY_OK)
        goto done;
    int64_t targets = 0;
    for (int64_t i = 0; i < nb; i++) targets += counts[i];
    *out = (fy_eval_result){pooled_loss(losses, counts, nb), nb, nb * cfg->batch * cfg->seq,
                            targets, fy_tokens_has_masks(tok)};
done:
    fy_trainer_free(tr);
    fy_plan_free(&plan);
    fy_dev_free(dev);
    fy_loader_free(ld);
    fy_tokens_free(tok);
    free(losses);
    free(counts);
    return st;
}
