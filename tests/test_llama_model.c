/* test_llama_model.c — the Llama family end to end on the cpu backend:
 *   - against the float64 PyTorch Llama written for this project (tests/ref/
 *     gen_llama_ref.py; fixtures committed): first-step gradients of every tensor and 10
 *     AdamW steps with clipping off and on, untied with grouped-query attention and
 *     llama3 rope scaling, and tied;
 *   - against transformers: a random model saved by transformers 4.44.2 as a 12-shard
 *     directory (and as bf16) evaluates to its loss and takes the same AdamW step;
 *   - the offload invariance: every plan bit-identical to all-resident, fp32 and bf16,
 *     the memory model equal to the measured peak;
 *   - Hugging Face directories and files written and read back: the same bits, shards
 *     within their size and consistent with the index, the config rebuilding the model,
 *     GPT-2's too; a directory holding other files is never replaced.
 *
 * Tolerances. Against float64 PyTorch, ferry computes in fp32: a loss carries ~1e-7
 * relative rounding and a gradient ~1e-6 (sums over 128 positions and 64..96 channels);
 * Adam divides by sqrt(v), so a weight's update can carry a few 1e-5 of relative error
 * where a gradient is near zero. 1e-4 relative per tensor, per step, holds every one of
 * them with margin (as for GPT-2, tests/test_model.c). Against transformers' float32
 * run, both sides are fp32: the same 1e-4 bound, met at ~1e-8. */
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "engine/io/tokens.h"
#include "engine/model/gpt2.h"
#include "engine/model/llama.h"
#include "engine/train.h"
#include "tests/plan_runs.h"

static const char *fixture(const char *name) {
    static char path[4096];
    const char *dir = getenv("FERRY_FIXTURES");
    snprintf(path, sizeof path, "%s/%s", dir ? dir : "tests/fixtures", name);
    return path;
}

static double jnum(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    cr_assert(cJSON_IsNumber(v), "fixture field %s", key);
    return v->valuedouble;
}

/* ---- the reference runs ------------------------------------------------------------------ */

typedef struct ref {
    cJSON *json;
    fy_weights *init;
    fy_model *model;
    fy_tokens *tok;
    fy_dev *dev;
    int B, T;
    char name[32];
} ref;

/* The fixture's config as a Llama model (its JSON's config: the llama_* fixtures are bare
 * safetensors files). */
static void ref_model_of_json(ref *r) {
    const cJSON *c = cJSON_GetObjectItem(r->json, "config");
    fy_llama_config lc = {.vocab = (int)jnum(c, "vocab"), .max_seq = (int)jnum(c, "max_seq"),
                          .channels = (int)jnum(c, "channels"), .layers = (int)jnum(c, "layers"),
                          .heads = (int)jnum(c, "heads"), .kv_heads = (int)jnum(c, "kv_heads"),
                          .head_dim = (int)jnum(c, "head_dim"), .ffn = (int)jnum(c, "ffn"),
                          .norm_eps = (float)jnum(c, "rms_eps"),
                          .tied = cJSON_IsTrue(cJSON_GetObjectItem(c, "tied"))};
    lc.rope.theta = (float)jnum(c, "rope_theta");
    const cJSON *sc = cJSON_GetObjectItem(c, "rope_scaling");
    if (cJSON_IsObject(sc)) {
        cr_assert_str_eq(cJSON_GetObjectItem(sc, "rope_type")->valuestring, "llama3");
        lc.rope.type = FY_ROPE_LLAMA3;
        lc.rope.factor = (float)jnum(sc, "factor");
        lc.rope.low_freq_factor = (float)jnum(sc, "low_freq_factor");
        lc.rope.high_freq_factor = (float)jnum(sc, "high_freq_factor");
        lc.rope.orig_max_pos = (float)jnum(sc, "original_max_position_embeddings");
    }
    cr_assert_eq(fy_llama_new(&lc, NULL, &r->model), FY_OK);
}

/* A fixture set: the fam_* ones are Hugging Face directories, the others bare files. */
static void ref_open(ref *r, const char *name) {
    char file[64];
    snprintf(r->name, sizeof r->name, "%s", name);
    snprintf(file, sizeof file, "%s_ref.json", name);
    char *text = test_read_file(fixture(file), NULL);
    r->json = cJSON_Parse(text);
    free(text);
    cr_assert(r->json);
    if (!strncmp(name, "fam_", 4)) { /* a Hugging Face directory, read as a user's is */
        cr_assert_eq(fy_weights_open(fixture(name), &r->init), FY_OK, "%s", fy_last_error());
        cr_assert_eq(fy_model_from_weights(r->init, NULL, &r->model), FY_OK, "%s", fy_last_error());
    } else {
        ref_model_of_json(r);
        snprintf(file, sizeof file, "%s_init.safetensors", name);
        cr_assert_eq(fy_weights_open(fixture(file), &r->init), FY_OK);
    }
    cr_assert_eq(fy_model_check_weights(r->model, r->init), FY_OK, "%s", fy_last_error());
    r->B = (int)jnum(r->json, "batch");
    r->T = (int)jnum(r->json, "seq");
    cr_assert_eq(fy_tokens_open(fixture("gpt2_tiny_tokens.bin"), &r->tok), FY_OK);
    fy_dev_cfg dc = {.kind = FY_DEV_CPU, .threads = 2};
    cr_assert_eq(fy_dev_new(&dc, &r->dev), FY_OK);
}

static void ref_close(ref *r) {
    fy_dev_free(r->dev);
    fy_tokens_free(r->tok);
    fy_model_free(r->model);
    fy_weights_close(r->init);
    cJSON_Delete(r->json);
}

static fy_trainer *ref_trainer(ref *r, const fy_weights *w, float clip) {
    const cJSON *a = cJSON_GetObjectItem(r->json, "adamw");
    fy_trainer_cfg tc = {.model = r->model, .B = r->B, .T = r->T, .beta1 = (float)jnum(a, "beta1"),
                         .beta2 = (float)jnum(a, "beta2"), .eps = (float)jnum(a, "eps"),
                         .weight_decay = (float)jnum(a, "weight_decay"), .clip = clip,
                         .weights = w};
    fy_trainer *tr;
    cr_assert_eq(fy_trainer_new(r->dev, &tc, &tr), FY_OK, "%s", fy_last_error());
    return tr;
}

static float **blocks_new(const fy_model *m) {
    float **h = calloc((size_t)fy_model_nblocks(m), sizeof *h);
    for (int b = 0; b < fy_model_nblocks(m); b++) h[b] = calloc(fy_model_block(m, b)->nelem, sizeof(float));
    return h;
}

static void blocks_free(const fy_model *m, float **h) {
    for (int b = 0; b < fy_model_nblocks(m); b++) free(h[b]);
    free(h);
}

/* Per tensor: ||got - want|| <= tol ||want||. */
static void expect_tensors_close(const fy_model *m, float **got, float **want, double tol,
                                 const char *what) {
    for (int b = 0; b < fy_model_nblocks(m); b++) {
        const fy_block_spec *blk = fy_model_block(m, b);
        for (int i = 0; i < blk->ntensors; i++) {
            const fy_tensor_spec *t = &blk->tensors[i];
            double dd = 0, ww = 0;
            for (size_t j = 0; j < (size_t)t->rows * t->cols; j++) {
                double g = got[b][t->offset + j], w = want[b][t->offset + j];
                dd += (g - w) * (g - w);
                ww += w * w;
            }
            double rel = sqrt(dd) / (sqrt(ww) + 1e-30);
            cr_log_info("%s %s: %.2e", what, t->name, rel);
            cr_expect(sqrt(dd) <= tol * sqrt(ww) + 1e-12, "%s %s: relative error %.3g > %.1g",
                      what, t->name, rel, tol);
        }
    }
}

/* The trainer's parameters (grads false) or gradients (true) against a fixture file of
 * the reference's, per tensor within 1e-4 relative. */
static void expect_fixture(ref *r, fy_trainer *tr, bool grads, const char *suffix, const char *what) {
    float **got = blocks_new(r->model), **want = blocks_new(r->model);
    for (int b = 0; b < fy_model_nblocks(r->model); b++) {
        if (grads) cr_assert(fy_trainer_get_grads(tr, b, got[b]));
        else fy_trainer_get_params(tr, b, got[b]);
    }
    char file[64];
    snprintf(file, sizeof file, "%s_%s.safetensors", r->name, suffix);
    fy_weights *w;
    cr_assert_eq(fy_weights_open(fixture(file), &w), FY_OK);
    cr_assert_eq(fy_model_load(r->model, w, want), FY_OK);
    expect_tensors_close(r->model, got, want, 1e-4, what);
    fy_weights_close(w);
    blocks_free(r->model, got);
    blocks_free(r->model, want);
}

/* chunk > 0: the layers' position-wise work in sequence chunks of that many positions. */
static void check_first_step(const char *name, int chunk) {
    ref r;
    ref_open(&r, name);
    if (chunk > 0) fy_model_set_chunk(r.model, chunk);
    fy_trainer *tr = ref_trainer(&r, r.init, 0.0f);
    const size_t N = (size_t)r.B * r.T;
    int32_t *x = malloc(N * 4), *y = malloc(N * 4);
    fy_loader *ld;
    cr_assert_eq(fy_loader_new(r.tok, 0, fy_tokens_count(r.tok), r.B, r.T, &ld), FY_OK);
    fy_loader_next(ld, x, y, NULL);
    fy_step_stats ss;
    cr_assert_eq(fy_trainer_step(tr, x, y, 0.0f, &ss), FY_OK); /* lr 0: the weights stay */
    const cJSON *run = cJSON_GetObjectItem(cJSON_GetObjectItem(r.json, "runs"), "noclip");
    double wl = cJSON_GetArrayItem(cJSON_GetObjectItem(run, "losses"), 0)->valuedouble;
    double wn = cJSON_GetArrayItem(cJSON_GetObjectItem(run, "grad_norms"), 0)->valuedouble;
    cr_expect(fabs(ss.loss - wl) <= 1e-5 * wl, "%s: loss %.9g vs %.9g", name, ss.loss, wl);
    cr_expect(fabs(ss.grad_norm - wn) <= 1e-4 * wn, "%s: norm %.9g vs %.9g", name, ss.grad_norm, wn);
    expect_fixture(&r, tr, true, "grads", "gradient");
    fy_loader_free(ld);
    free(x);
    free(y);
    fy_trainer_free(tr);
    ref_close(&r);
}

static void check_ten_steps(const char *name, const char *run_name) {
    ref r;
    ref_open(&r, name);
    const cJSON *run = cJSON_GetObjectItem(cJSON_GetObjectItem(r.json, "runs"), run_name);
    const float clip = (float)jnum(run, "clip");
    const double lr = jnum(cJSON_GetObjectItem(r.json, "adamw"), "lr");
    const int steps = (int)jnum(r.json, "steps");
    cr_assert_str_eq(cJSON_GetObjectItem(run, "schedule")->valuestring, "const");
    fy_trainer *tr = ref_trainer(&r, r.init, clip);
    const size_t N = (size_t)r.B * r.T;
    int32_t *x = malloc(N * 4), *y = malloc(N * 4);
    fy_loader *ld;
    cr_assert_eq(fy_loader_new(r.tok, 0, fy_tokens_count(r.tok), r.B, r.T, &ld), FY_OK);
    for (int s = 0; s < steps; s++) {
        fy_loader_next(ld, x, y, NULL);
        fy_step_stats ss;
        cr_assert_eq(fy_trainer_step(tr, x, y, (float)lr, &ss), FY_OK);
        double wl = cJSON_GetArrayItem(cJSON_GetObjectItem(run, "losses"), s)->valuedouble;
        double wn = cJSON_GetArrayItem(cJSON_GetObjectItem(run, "grad_norms"), s)->valuedouble;
        cr_expect(fabs(ss.loss - wl) <= 1e-4 * wl, "%s %s step %d: loss %.9g vs %.9g", name,
                  run_name, s, ss.loss, wl);
        cr_expect(fabs(ss.grad_norm - wn) <= 1e-4 * wn, "%s %s step %d: norm %.9g vs %.9g", name,
                  run_name, s, ss.grad_norm, wn);
        if (clip > 0) cr_expect(ss.clip_coef < 1.0f, "%s step %d: clipping was not active", name, s);
    }
    /* the final weights of the run without clipping are in the fixtures */
    if (clip == 0) expect_fixture(&r, tr, false, "final_noclip", "final weight");
    fy_loader_free(ld);
    free(x);
    free(y);
    fy_trainer_free(tr);
    ref_close(&r);
}

TestSuite(llama_model, .timeout = 300);

Test(llama_model, first_step_gradients_match_pytorch_untied_gqa_llama3_rope) {
    check_first_step("llama_tiny", 0);
}
/* The same step with the layers' norms, projections and MLP in chunks of 7 positions (not
 * dividing B*T, so a short last chunk): the same gradients, within the same bounds. */
Test(llama_model, first_step_gradients_match_pytorch_in_sequence_chunks) {
    check_first_step("llama_tiny", 7);
}
Test(llama_model, first_step_gradients_match_pytorch_tied) { check_first_step("llama_tied", 0); }
Test(llama_model, ten_steps_match_pytorch_untied_noclip) { check_ten_steps("llama_tiny", "noclip"); }
Test(llama_model, ten_steps_match_pytorch_untied_clip) { check_ten_steps("llama_tiny", "clip"); }
Test(llama_model, ten_steps_match_pytorch_tied_noclip) { check_ten_steps("llama_tied", "noclip"); }
Test(llama_model, ten_steps_match_pytorch_tied_clip) { check_ten_steps("llama_tied", "clip"); }

/* ---- a directory transformers wrote ------------------------------------------------------- */

static cJSON *hf_expected(void) {
    char *text = test_read_file(fixture("llama_hf_tiny_expected.json"), NULL);
    cJSON *j = cJSON_Parse(text);
    free(text);
    cr_assert(j);
    return j;
}

/* The mean loss of the first `batches` batches of B x T under the weights at path. */
static float eval_path(const char *path, int batches, fy_dtype dt) {
    fy_weights *w;
    fy_model *m;
    cr_assert_eq(fy_weights_open(path, &w), FY_OK, "%s", fy_last_error());
    cr_assert_eq(fy_model_from_weights(w, NULL, &m), FY_OK, "%s", fy_last_error());
    fy_eval_cfg ec = {.model = m, .weights = w, .data = fixture("gpt2_tiny_tokens.bin"),
                      .batch = 4, .seq = 32, .batches = batches, .dtype = dt,
                      .dev = {.kind = FY_DEV_CPU, .threads = 2}};
    fy_eval_result res;
    cr_assert_eq(fy_eval(&ec, &res), FY_OK, "%s", fy_last_error());
    fy_model_free(m);
    fy_weights_close(w);
    return res.loss;
}

Test(llama_model, a_sharded_transformers_directory_evaluates_to_its_loss) {
    cJSON *e = hf_expected();
    /* the directory, its index and a shard-free bf16 directory */
    float l_dir = eval_path(fixture("llama_hf_tiny"), 1, FY_F32);
    float l_idx = eval_path(fixture("llama_hf_tiny/model.safetensors.index.json"), 1, FY_F32);
    float l_bf16 = eval_path(fixture("llama_hf_tiny_bf16"), 1, FY_F32);
    const double want = jnum(e, "loss_f64"), want_bf16 = jnum(cJSON_GetObjectItem(e, "bf16"), "loss_f64");
    cr_log_info("transformers directory: ferry %.9g, float64 %.9g", l_dir, want);
    cr_expect(fabs(l_dir - want) <= 1e-4 * want, "directory: %.9g vs %.9g", l_dir, want);
    cr_expect(l_idx == l_dir, "the index and its directory are the same weights");
    cr_expect(fabs(l_bf16 - want_bf16) <= 1e-4 * want_bf16, "bf16: %.9g vs %.9g", l_bf16, want_bf16);
    cJSON_Delete(e);
}

/* One AdamW step from the directory as transformers' AdamW took it: the gradient norm
 * and the next batch's loss before and after. */
Test(llama_model, a_transformers_directory_trains_to_the_same_step) {
    cJSON *e = hf_expected();
    const cJSON *a = cJSON_GetObjectItem(e, "adamw"), *s1 = cJSON_GetObjectItem(e, "step1");
    fy_weights *w;
    fy_model *m;
    cr_assert_eq(fy_weights_open(fixture("llama_hf_tiny"), &w), FY_OK);
    cr_assert_eq(fy_model_from_weights(w, NULL, &m), FY_OK);
    fy_dev_cfg dc = {.kind = FY_DEV_CPU, .threads = 2};
    fy_dev *dev;
    cr_assert_eq(fy_dev_new(&dc, &dev), FY_OK);
    fy_trainer_cfg tc = {.model = m, .B = 4, .T = 32, .beta1 = (float)jnum(a, "beta1"),
                         .beta2 = (float)jnum(a, "beta2"), .eps = (float)jnum(a, "eps"),
                         .weight_decay = (float)jnum(a, "weight_decay"), .weights = w};
    fy_trainer *tr;
    cr_assert_eq(fy_trainer_new(dev, &tc, &tr), FY_OK);
    fy_tokens *tok;
    cr_assert_eq(fy_tokens_open(fixture("gpt2_tiny_tokens.bin"), &tok), FY_OK);
    fy_loader *ld;
    cr_assert_eq(fy_loader_new(tok, 0, fy_tokens_count(tok), 4, 32, &ld), FY_OK);
    int32_t x[2][128], y[2][128];
    fy_loader_next(ld, x[0], y[0], NULL);
    fy_loader_next(ld, x[1], y[1], NULL);
    float before, after;
    cr_assert_eq(fy_trainer_eval(tr, x[1], y[1], &before), FY_OK);
    fy_step_stats ss;
    cr_assert_eq(fy_trainer_step(tr, x[0], y[0], (float)jnum(a, "lr"), &ss), FY_OK);
    cr_assert_eq(fy_trainer_eval(tr, x[1], y[1], &after), FY_OK);
    const double wn = jnum(s1, "grad_norm"), wb = jnum(s1, "loss_batch2_before"),
                 wa = jnum(s1, "loss_batch2");
    cr_log_info("step: norm %.9g (%.9g), batch 2 %.9g -> %.9g (%.9g -> %.9g)", ss.grad_norm, wn,
                before, after, wb, wa);
    cr_expect(fabs(ss.grad_norm - wn) <= 1e-4 * wn, "norm %.9g vs %.9g", ss.grad_norm, wn);
    cr_expect(fabs(before - wb) <= 1e-4 * wb, "batch 2 before: %.9g vs %.9g", before, wb);
    cr_expect(fabs(after - wa) <= 1e-4 * wa, "batch 2 after: %.9g vs %.9g", after, wa);
    fy_loader_free(ld);
    fy_tokens_free(tok);
    fy_trainer_free(tr);
    fy_dev_free(dev);
    fy_model_free(m);
    fy_weights_close(w);
    cJSON_Delete(e);
}

/* ---- every plan, bit for bit ---------------------------------------------------------------- */

static fy_model *plan_llama(bool tied);

/* A tied table streamed crosses to the device once a step, whole, for the head (its
 * classifier); the embedding's forward fetches only the micro-batch's rows and its
 * backward nothing; each streamed layer crosses twice (its forward; its recompute and
 * backward together). Its gradient comes back in two parts (layout.h: split_grad). The
 * bytes are the tasks' (step_build.c), and the run is every plan's bits (fp32 and bf16,
 * with and without accumulation). */
Test(llama_model, a_tied_table_crosses_once_a_step) {
    fy_model *m = plan_llama(true);
    const int L = fy_model_layers(m), nb = fy_model_nblocks(m);
    for (int v = 0; v < 4; v++) {
        const fy_dtype dt = v & 1 ? FY_BF16 : FY_F32;
        const int accum = v & 2 ? 2 : 1;
        fy_plan p = plan_of(m, 2, accum, 1, 1, v < 2 ? L : 0, dt);
        fy_layout lay;
        cr_assert_eq(fy_layout_new(m, &p, T_SEQ, true, 1, 0, &lay), FY_OK);
        cr_expect(lay.blocks[0].fwd_rows && lay.rows_block == 0 && lay.blocks[0].split_grad);
        fy_step_graph sg;
        cr_assert_eq(fy_step_build_train(&lay, 1, true, &sg), FY_OK);
        double table = 0, rows = 0, layers = 0, want_layers = 0;
        int parts[3] = {0};
        for (int i = 0; i < sg.g.n; i++) {
            const fy_task *t = &sg.g.tasks[i];
            if (t->kind == FY_T_D2H_GRAD && t->block == 0) parts[sg.task[i].u.d2h_grad.part]++;
            if (t->kind != FY_T_H2D_PARAM) continue;
            if (t->block == 0 && sg.task[i].u.fetch.rows) rows += t->bytes;
            else if (t->block == 0) table += t->bytes;
            else if (t->block < nb - 1) layers += t->bytes;
        }
        for (int b = 1; b < nb - 1; b++) want_layers += 2.0 * accum * (double)lay.blocks[b].nelem * lay.es;
        const double tbl = (double)lay.blocks[0].nelem * lay.es;
        cr_expect_eq(table, accum * tbl, "v %d: the table crossed %g times", v, table / tbl);
        cr_expect(rows > 0 && rows <= accum * (double)lay.blocks[0].rows_nelem * lay.es);
        cr_expect_eq(layers, want_layers, "v %d: layers %g bytes, want %g", v, layers, want_layers);
        /* its gradient leaves in two parts a micro-batch: the head's rows early, the
         * tokens' after the embedding's backward */
        cr_expect(parts[0] == 0 && parts[1] == accum && parts[2] == accum);
        fy_step_graph_free(&sg);
        fy_layout_free(&lay);
        fy_plan base = plan_of(m, 2, accum, 0, 0, 0, dt);
        result r0, r1;
        cr_assert_eq(plan_train(m, &base, 0, FY_SCHED_PRIORITY, -1, &r0), FY_OK);
        cr_assert_eq(plan_train(m, &p, 0, FY_SCHED_PRIORITY, -1, &r1), FY_OK);
        cr_expect_eq(r1.gathered, 0);
        expect_identical(&r0, &r1, "tied, streamed");
        result_free(&r0);
        result_free(&r1);
        fy_plan_free(&base);
        fy_plan_free(&p);
    }
    fy_model_free(m);
}

static fy_model *plan_llama(bool tied) {
    fy_llama_config c = {.vocab = 256, .max_seq = 32, .channels = 32, .layers = 4, .heads = 4,
                         .kv_heads = 2, .head_dim = 8, .ffn = 48, .norm_eps = 1e-5f,
                         .rope = {.type = FY_ROPE_LLAMA3, .theta = 500000.0f, .factor = 8.0f,
                                  .low_freq_factor = 1.0f, .high_freq_factor = 4.0f,
                                  .orig_max_pos = 8.0f}, .tied = tied};
    fy_model *m;
    cr_assert_eq(fy_llama_new(&c, NULL, &m), FY_OK);
    return m;
}

Test(llama_model, disk_and_offloaded_activations_are_bit_identical, .timeout = 300) {
    fy_model *m = plan_llama(false);
    tiered_plans_are_bit_identical(m, FY_F32);
    tiered_plans_are_bit_identical(m, FY_BF16);
    fy_model_free(m);
}

Test(llama_model, every_plan_is_bit_identical_fp32) {
    fy_model *m = plan_llama(false);
    every_plan_is_bit_identical(m, FY_F32);
    irregular_plan_is_bit_identical(m, FY_F32);
    fy_model_free(m);
}

/* Each family against its float64 PyTorch reference (tests/ref/gen_family_ref.py, written
 * from the published modeling code; fixtures tests/fixtures/fam_*): the directory read as a
 * user's download is, first-step gradients of every tensor within 1e-4 relative (fp32
 * arithmetic against float64: summation order over B*T = 128 rows and 64 channels gives
 * 1e-6 typically; the soft-caps' tanh and the longrope's scaled angles stay within it), and
 * 10 AdamW steps, with and without clipping, losses and norms within 1e-4. */
#define FAMILY_TESTS(fam)                                                                     \
    Test(llama_model, fam##_first_step_gradients_match_pytorch) { check_first_step("fam_" #fam, 0); } \
    Test(llama_model, fam##_ten_steps_match_pytorch) {                                       \
        check_ten_steps("fam_" #fam, "noclip");                                               \
        check_ten_steps("fam_" #fam, "clip");                                                 \
    }
FAMILY_TESTS(qwen2)
FAMILY_TESTS(qwen3)
FAMILY_TESTS(mistral)
FAMILY_TESTS(gemma2)
FAMILY_TESTS(gemma3_text)
FAMILY_TESTS(phi3)

/* plan_llama's shape as each family: every switch of fy_llama_config on in one of them
 * (biases, q/k norms, head_dim apart from the width, windows on all or some layers, sandwich
 * norms with (1 + w) gains, GeGLU, a scaled embedding, soft-caps, two ropes, a partial
 * longrope over a sequence past its original length). */
static fy_model *plan_family_seq(fy_llama_arch arch, int max_seq) {
    fy_llama_config c = {.vocab = 256, .max_seq = max_seq, .channels = 32, .layers = 4, .heads = 4,
                         .kv_heads = 2, .head_dim = 8, .ffn = 48, .norm_eps = 1e-5f,
                         .rope = {.type = FY_ROPE_DEFAULT, .theta = 10000.0f}, .arch = arch};
    switch (arch) {
    case FY_ARCH_QWEN2: c.qkv_bias = true; c.tied = true; break;
    case FY_ARCH_QWEN3: c.qk_norm = true; c.head_dim = 12; break;
    case FY_ARCH_MISTRAL: c.sliding_window = 5; break;
    case FY_ARCH_GEMMA2:
    case FY_ARCH_GEMMA3:
        c.sandwich = true; c.norm_offset = 1.0f; c.act = FY_GLU_GELU_TANH; c.embed_scale = true;
        c.tied = true; c.sliding_window = 5; c.query_scalar = 6.0f;
        c.local_pattern = arch == FY_ARCH_GEMMA2 ? 2 : 3;
        if (arch == FY_ARCH_GEMMA2) { c.attn_softcap = 5.0f; c.final_softcap = 3.0f; }
        else {
            c.qk_norm = true;
            c.rope = (fy_rope){.type = FY_ROPE_LINEAR, .theta = 1000000.0f, .factor = 8.0f};
            c.rope_local = (fy_rope){.type = FY_ROPE_DEFAULT, .theta = 10000.0f};
        }
        break;
    case FY_ARCH_PHI3:
        c.sliding_window = 7;
        c.rope = (fy_rope){.type = FY_ROPE_LONGROPE, .theta = 10000.0f, .orig_max_pos = 8.0f,
                           .rot_dim = 6, .attn_factor = 1.2f, .ext = {1.0f, 1.5f, 2.0f}};
        for (int j = 0; j < 3; j++) c.rope_long[j] = 3.0f + (float)j;
        break;
    default: break;
    }
    fy_model *m;
    cr_assert_eq(fy_llama_new(&c, NULL, &m), FY_OK, "%s", fy_last_error());
    return m;
}

static fy_model *plan_family(fy_llama_arch arch) { return plan_family_seq(arch, 32); }

static void family_plans(fy_llama_arch arch, bool bf16) {
    fy_model *m = plan_family(arch);
    every_plan_is_bit_identical(m, FY_F32);
    if (bf16) every_plan_is_bit_identical(m, FY_BF16);
    fy_model_free(m);
}

Test(llama_model, every_plan_is_bit_identical_qwen2) { family_plans(FY_ARCH_QWEN2, false); }
Test(llama_model, every_plan_is_bit_identical_qwen3) { family_plans(FY_ARCH_QWEN3, false); }
Test(llama_model, every_plan_is_bit_identical_mistral) { family_plans(FY_ARCH_MISTRAL, false); }
Test(llama_model, every_plan_is_bit_identical_gemma2) { family_plans(FY_ARCH_GEMMA2, true); }
Test(llama_model, every_plan_is_bit_identical_gemma3) { family_plans(FY_ARCH_GEMMA3, true); }
Test(llama_model, every_plan_is_bit_identical_phi3) { family_plans(FY_ARCH_PHI3, false); }

Test(llama_model, every_plan_is_bit_identical_bf16) {
    fy_model *m = plan_llama(false);
    every_plan_is_bit_identical(m, FY_BF16);
    fy_model_free(m);
}

/* Long-context features move no data differently, so they keep the invariance: a sliding
 * window of 6 positions, documents ending at each newline of the corpus (byte 10: a few a
 * sequence of 16), and sequence chunks of 5 positions (a micro-batch's 32 positions in 7
 * chunks, the last short): every plan gives the all-resident plan's bits. */
Test(llama_model, every_plan_is_bit_identical_with_windows_documents_and_chunks) {
    fy_llama_config c = {.vocab = 256, .max_seq = 32, .channels = 32, .layers = 4, .heads = 4,
                         .kv_heads = 2, .head_dim = 8, .ffn = 48, .norm_eps = 1e-5f,
                         .rope = {.type = FY_ROPE_LLAMA3, .theta = 500000.0f, .factor = 8.0f,
                                  .low_freq_factor = 1.0f, .high_freq_factor = 4.0f,
                                  .orig_max_pos = 8.0f},
                         .sliding_window = 6};
    fy_model *m;
    cr_assert_eq(fy_llama_new(&c, NULL, &m), FY_OK);
    fy_model_set_chunk(m, 5);
    g_docs = (fy_doc_mask){FY_DOCS_EOT, '\n'};
    every_plan_is_bit_identical(m, FY_F32);
    g_docs = (fy_doc_mask){FY_DOCS_NONE, 0};
    fy_model_free(m);
}

/* Every family's switches with documents and sequence chunks (5 positions: chunks that
 * split the windows, the documents and the sandwich norms' rows): every plan gives the
 * all-resident plan's bits and the memory model its measured peak (bf16 where the family
 * has one of the two storage types' own roundings: Gemma's scaled embedding and gains). */
static void family_plans_docs_chunks(fy_llama_arch arch, bool bf16) {
    fy_model *m = plan_family(arch);
    fy_model_set_chunk(m, 5);
    g_docs = (fy_doc_mask){FY_DOCS_EOT, '\n'};
    every_plan_is_bit_identical(m, bf16 ? FY_BF16 : FY_F32);
    g_docs = (fy_doc_mask){FY_DOCS_NONE, 0};
    fy_model_free(m);
}

#define FAMILY_PLANS_DOCS_CHUNKS(fam, arch, bf16)                                              \
    Test(llama_model, every_plan_is_bit_identical_##fam##_documents_and_chunks) {            \
        family_plans_docs_chunks(arch, bf16);                                                 \
    }
FAMILY_PLANS_DOCS_CHUNKS(qwen2, FY_ARCH_QWEN2, false)
FAMILY_PLANS_DOCS_CHUNKS(qwen3, FY_ARCH_QWEN3, false)
FAMILY_PLANS_DOCS_CHUNKS(mistral, FY_ARCH_MISTRAL, false)
FAMILY_PLANS_DOCS_CHUNKS(gemma2, FY_ARCH_GEMMA2, true)
FAMILY_PLANS_DOCS_CHUNKS(gemma3, FY_ARCH_GEMMA3, true)
FAMILY_PLANS_DOCS_CHUNKS(phi3, FY_ARCH_PHI3, false)

/* Sum of the per-position losses of x (n positions, targets y) as one sequence of n. */
static double seq_loss_sum(const fy_model *m, const fy_weights *w, const int32_t *x,
                           const int32_t *y, int n, const fy_doc_mask *docs) {
    fy_dev_cfg dc = {.kind = FY_DEV_CPU, .threads = 2};
    fy_dev *dev;
    cr_assert_eq(fy_dev_new(&dc, &dev), FY_OK);
    fy_plan plan;
    cr_assert_eq(fy_plan_new(m, 1, 1, &plan), FY_OK);
    fy_trainer_cfg tc = {.model = m, .T = n, .plan = &plan, .eval_only = true, .weights = w,
                         .seed = 5};
    if (docs) tc.docs = *docs;
    fy_trainer *tr;
    cr_assert_eq(fy_trainer_new(dev, &tc, &tr), FY_OK, "%s", fy_last_error());
    float loss;
    cr_assert_eq(fy_trainer_eval(tr, x, y, &loss), FY_OK);
    fy_trainer_free(tr);
    fy_plan_free(&plan);
    fy_dev_free(dev);
    return (double)loss * n;
}

/* A packed sequence's loss is the sum of its documents' losses evaluated one by one
 * (attention stops at each document's start, positions restart there), for learned
 * positions (GPT-2) and rotary ones (Llama, with a window longer than some documents and
 * shorter than others). Documents end at token 7 (eot); lengths 9, 23, 1, 31 = 64. The
 * sums differ only in rounding: the tiles of the packed sequence split each document's
 * keys differently, and the mean is over other rows; 2e-6 relative bounds fp32's on
 * sums of ~64 terms. */
static void packed_equals_one_by_one(const fy_model *m) {
    enum { T = 64 };
    const int lens[] = {9, 23, 1, 31};
    int32_t x[T], y[T];
    uint64_t st = 77;
    for (int t = 0; t < T; t++) {
        st = st * 6364136223846793005ull + 1442695040888963407ull;
        x[t] = 8 + (int32_t)((st >> 33) % 200);
        y[t] = 8 + (int32_t)((st >> 13) % 200);
    }
    int off = 0;
    for (int d = 0; d < 4; d++) {
        off += lens[d];
        x[off - 1] = 7; /* each document ends with the end-of-text token */
    }
    const fy_doc_mask docs = {FY_DOCS_EOT, 7};
    const double packed = seq_loss_sum(m, NULL, x, y, T, &docs);
    double alone = 0;
    off = 0;
    for (int d = 0; d < 4; d++) {
        alone += seq_loss_sum(m, NULL, x + off, y + off, lens[d], NULL);
        off += lens[d];
    }
    cr_expect(fabs(packed - alone) <= 2e-6 * fabs(alone), "%s: packed %.9g, one by one %.9g",
              fy_model_name(m), packed, alone);
    /* and without the mask, the documents see each other: a different loss */
    const double crossing = seq_loss_sum(m, NULL, x, y, T, NULL);
    cr_expect(fabs(crossing - alone) > 1e-4 * fabs(alone), "%s: the mask changed nothing",
              fy_model_name(m));
}

Test(llama_model, a_packed_sequence_evaluates_to_its_documents_one_by_one) {
    fy_llama_config c = {.vocab = 256, .max_seq = 64, .channels = 32, .layers = 2, .heads = 4,
                         .kv_heads = 2, .head_dim = 8, .ffn = 48, .norm_eps = 1e-5f,
                         .rope = {.type = FY_ROPE_DEFAULT, .theta = 10000.0f},
                         .sliding_window = 12};
    fy_model *m;
    cr_assert_eq(fy_llama_new(&c, NULL, &m), FY_OK);
    packed_equals_one_by_one(m);
    fy_model_free(m);
    fy_model_shape over = {.vocab = 256, .max_seq = 64};
    cr_assert_eq(fy_model_named("gpt2-tiny", &over, &m), FY_OK, "%s", fy_last_error());
    packed_equals_one_by_one(m);
    fy_model_free(m);
}

/* The same for every family's switches (plan_family's shapes over 64 positions): biases,
 * q/k norms, sandwich norms, soft-caps, per-layer windows and ropes, partial longrope (its
 * documents of 9, 23 and 31 positions are all past its original 8, so each alone takes
 * the long factors as the packed sequence does). */
Test(llama_model, a_packed_sequence_evaluates_to_its_documents_one_by_one_families) {
    for (int a = FY_ARCH_QWEN2; a <= FY_ARCH_PHI3; a++) {
        fy_model *m = plan_family_seq((fy_llama_arch)a, 64);
        packed_equals_one_by_one(m);
        fy_model_free(m);
    }
}

/* An untied embedding streamed and optimised on the CPU gets only its micro-batch's rows
 * (32 positions of a 256-row table: at most 32 rows staged): still every plan bit for
 * bit, with accumulation (rows scattered into a gradient that holds the first
 * micro-batch's) and without, fp32 and bf16. Updated on the device, its gradient and
 * update take the whole table, but its forward still fetches rows. */
Test(llama_model, a_gathered_embedding_is_bit_identical_and_smaller) {
    fy_model *m = plan_llama(false);
    const int L = fy_model_layers(m);
    for (int d = 0; d < 2; d++) {
        const fy_dtype dt = d ? FY_BF16 : FY_F32;
        result r1, r2;
        accumulated_plans_are_bit_identical(m, dt, &r2);
        fy_plan full = plan_of(m, 2, 2, 1, 1, L, dt), whole = plan_of(m, 2, 2, 1, 1, L, dt);
        whole.blocks[0].update = FY_UPDATE_DEVICE; /* updated on the device: the whole table */
        /* the head (as large as the table) resident, so that the table alone sizes the
         * large ring */
        full.blocks[L + 1].weights = whole.blocks[L + 1].weights = FY_ON_DEVICE;
        cr_assert_eq(plan_train(m, &full, 0, FY_SCHED_PRIORITY, -1, &r1), FY_OK);
        cr_expect_eq(r1.gathered, 0, "%s: the embedding is gathered", fy_dtype_name(dt));
        expect_identical(&r2, &r1, "gathered, accumulated");
        result rw;
        cr_assert_eq(plan_train(m, &whole, 0, FY_SCHED_PRIORITY, -1, &rw), FY_OK);
        cr_expect_eq(rw.gathered, 0, "its forward still gets rows (model.h: rows_fwd)");
        expect_identical(&r2, &rw, "streamed whole, accumulated");
        /* the table's slots (256 x 32) were the large ring's; 32 rows fit the layers' */
        cr_expect(r1.staging < rw.staging, "%s: staging %zu gathered, %zu whole",
                  fy_dtype_name(dt), r1.staging, rw.staging);
        result_free(&r1);
        result_free(&rw);
        result_free(&r2);
        fy_plan_free(&full);
        fy_plan_free(&whole);
        /* one micro-batch a step: the bf16 gradient lands in the table's bf16 copy */
        fy_plan one = plan_of(m, 2, 1, 1, 1, 0, dt), base = plan_of(m, 2, 1, 0, 0, 0, dt);
        result ro, rb;
        cr_assert_eq(plan_train(m, &base, 0, FY_SCHED_PRIORITY, -1, &rb), FY_OK);
        cr_assert_eq(plan_train(m, &one, 0, FY_SCHED_SERIAL, -1, &ro), FY_OK);
        cr_expect_eq(ro.gathered, 0);
        expect_identical(&rb, &ro, "gathered, one micro-batch");
        result_free(&ro);
        fy_plan_free(&one);
        /* a skipped step (a NaN in the head) restores the table's bf16 copy */
        fy_plan nanp = plan_of(m, 2, 1, 1, 1, 0, dt);
        result rn, rbn;
        cr_assert_eq(plan_train(m, &base, 0, FY_SCHED_PRIORITY, 2, &rbn), FY_OK);
        cr_assert_eq(plan_train(m, &nanp, 0, FY_SCHED_PRIORITY, 2, &rn), FY_OK);
        cr_expect(rn.skipped[2] && rbn.skipped[2]);
        for (int st = 0; st < STEPS; st++)
            cr_expect(st == 2 || (rn.loss[st] == rbn.loss[st] && rn.norm[st] == rbn.norm[st]),
                      "gathered, a skipped step: step %d", st);
        for (int bl = 0; bl < rn.nblocks; bl++)
            cr_expect(!memcmp(rn.w[bl], rbn.w[bl], rn.nelem[bl] * sizeof(float)),
                      "gathered, a skipped step: block %d", bl);
        result_free(&rn);
        result_free(&rbn);
        result_free(&rb);
        fy_plan_free(&nanp);
        fy_plan_free(&base);
    }
    fy_model_free(m);
}

/* An untied lm_head streamed and optimised on the CPU runs by vocabulary chunks (2 here:
 * a chunk within a layer, 224 rows, of 256), a task and a fetch each, its gradient to
 * the host chunk by chunk: bit for bit the all-resident run, fp32 and bf16, with and
 * without accumulation, in every schedule; and its slots are a layer's, not the head's. */
Test(llama_model, a_chunked_head_is_bit_identical_and_smaller) {
    fy_model *m = plan_llama(false);
    const int L = fy_model_layers(m);
    for (int d = 0; d < 2; d++) {
        const fy_dtype dt = d ? FY_BF16 : FY_F32;
        for (int A = 1; A <= 2; A++) {
            fy_plan base = plan_of(m, 2, A, 0, 0, 0, dt), full = plan_of(m, 2, A, 1, 1, L / 2, dt);
            fy_plan whole = plan_of(m, 2, A, 1, 1, L / 2, dt);
            whole.blocks[L + 1].update = FY_UPDATE_DEVICE; /* updated on the device: whole */
            result rb, rf, rw, rs;
            cr_assert_eq(plan_train(m, &base, 0, FY_SCHED_PRIORITY, -1, &rb), FY_OK);
            cr_assert_eq(plan_train(m, &full, 0, FY_SCHED_PRIORITY, -1, &rf), FY_OK);
            cr_assert_eq(plan_train(m, &full, 0, FY_SCHED_SERIAL, -1, &rs), FY_OK);
            cr_assert_eq(plan_train(m, &whole, 0, FY_SCHED_PRIORITY, -1, &rw), FY_OK);
            char what[64];
            snprintf(what, sizeof what, "chunked head, %s, %d micro-batches", fy_dtype_name(dt), A);
            cr_expect_eq(rf.head_chunks, 2, "%s", what);
            cr_expect_eq(rw.head_chunks, 0, "%s", what);
            expect_identical(&rb, &rf, what);
            expect_identical(&rb, &rs, what);
            expect_identical(&rb, &rw, what);
            cr_expect(rf.peak == rf.model, "%s: peak %zu, model %zu", what, rf.peak, rf.model);
            cr_expect(rf.staging < rw.staging, "%s: staging %zu chunked, %zu whole", what,
                      rf.staging, rw.staging);
            result_free(&rb);
            result_free(&rf);
            result_free(&rs);
            result_free(&rw);
            fy_plan_free(&base);
            fy_plan_free(&full);
            fy_plan_free(&whole);
        }
    }
    fy_model_free(m);
}

/* Evaluation through a chunked head (and a gathered embedding), by a training trainer
 * and by an evaluation-only one (whose head is chunked whatever its optimizer): the
 * all-resident plan's loss, bit for bit. */
Test(llama_model, a_chunked_head_evaluates_the_same_bits) {
    fy_model *m = plan_llama(false);
    fy_tokens *tok = test_corpus();
    fy_loader *ld;
    cr_assert_eq(fy_loader_new(tok, 0, fy_tokens_count(tok), 2, T_SEQ, &ld), FY_OK);
    int32_t x[2 * T_SEQ], y[2 * T_SEQ];
    fy_loader_next(ld, x, y, NULL);
    for (int d = 0; d < 2; d++) {
        const fy_dtype dt = d ? FY_BF16 : FY_F32;
        float loss[3];
        for (int run = 0; run < 3; run++) {
            fy_plan p = plan_of(m, 2, 1, run ? 1 : 0, run == 1 ? 1 : 0, 0, dt);
            fy_dev_cfg dc = {.kind = FY_DEV_CPU, .threads = 2};
            fy_dev *dev;
            cr_assert_eq(fy_dev_new(&dc, &dev), FY_OK);
            fy_trainer_cfg tc = {.model = m, .T = T_SEQ, .seed = 5, .plan = &p, .eval_only = run == 2};
            fy_trainer *tr;
            cr_assert_eq(fy_trainer_new(dev, &tc, &tr), FY_OK);
            if (run) cr_expect(fy_trainer_layout(tr)->blocks[fy_model_nblocks(m) - 1].staging == FY_STAGE_CHUNKS,
                               "run %d: chunked", run);
            cr_assert_eq(fy_trainer_eval(tr, x, y, &loss[run]), FY_OK);
            fy_trainer_free(tr);
            fy_dev_free(dev);
            fy_plan_free(&p);
        }
        cr_expect(loss[1] == loss[0] && loss[2] == loss[0], "%s: %.9g, %.9g, %.9g",
                  fy_dtype_name(dt), loss[0], loss[1], loss[2]);
    }
    fy_loader_free(ld);
    fy_tokens_free(tok);
    fy_model_free(m);
}

/* A vocabulary much larger than a micro-batch (2048 rows, 32 positions: the gathered
 * embedding takes at most 32 rows, the head 11 chunks of 192), three micro-batches a
 * step, fp32 and bf16: training, evaluation after it, and a step that fails mid-way
 * (a chunk's gradient copy, after a chunk landed in the bf16 copy) and is run again,
 * all give the all-resident run's bits. */
Test(llama_model, a_large_vocabulary_gathered_and_chunked) {
    fy_llama_config c = {.vocab = 2048, .max_seq = 32, .channels = 32, .layers = 2, .heads = 4,
                         .kv_heads = 2, .head_dim = 8, .ffn = 48, .norm_eps = 1e-5f,
                         .rope = {.type = FY_ROPE_DEFAULT, .theta = 10000.0f, .factor = 1.0f,
                                  .low_freq_factor = 1.0f, .high_freq_factor = 1.0f,
                                  .orig_max_pos = 1.0f}};
    fy_model *m;
    cr_assert_eq(fy_llama_new(&c, NULL, &m), FY_OK);
    fy_tokens *tok = test_corpus();
    enum { A = 3, NST = 4 };
    const size_t N = 2 * T_SEQ;
    int32_t *x = malloc(NST * A * N * 4), *y = malloc(NST * A * N * 4);
    fy_loader *ld;
    cr_assert_eq(fy_loader_new(tok, 0, fy_tokens_count(tok), 2, T_SEQ, &ld), FY_OK);
    for (int i = 0; i < NST * A; i++) fy_loader_next(ld, x + i * N, y + i * N, NULL);
    for (int d = 0; d < 2; d++) {
        const fy_dtype dt = d ? FY_BF16 : FY_F32;
        for (int acc = 1; acc <= A; acc += A - 1) { /* one micro-batch a step, and three */
            float loss[3][NST], eval[3];
            float *w[3][4];
            for (int run = 0; run < 3; run++) { /* all-resident, offloaded, offloaded failing */
                fy_plan p = plan_of(m, 2, acc, run ? 1 : 0, run ? 1 : 0, 0, dt);
                fy_dev_cfg dc = {.kind = FY_DEV_CPU, .threads = 2};
                fy_dev *dev;
                cr_assert_eq(fy_dev_new(&dc, &dev), FY_OK);
                fy_trainer_cfg tc = {.model = m, .T = T_SEQ, .beta1 = 0.9f, .beta2 = 0.95f,
                                     .eps = 1e-8f, .weight_decay = 0.1f, .clip = 1.0f, .seed = 9,
                                     .plan = &p};
                fy_trainer *tr;
                cr_assert_eq(fy_trainer_new(dev, &tc, &tr), FY_OK);
                if (run) {
                    const fy_layout *L = fy_trainer_layout(tr);
                    cr_expect_eq(L->rows_block, 0);
                    cr_expect(L->blocks[3].staging == FY_STAGE_CHUNKS && L->head_chunks.n == 11,
                              "%d chunks", L->head_chunks.n);
                }
                for (int s = 0; s < NST; s++) {
                    const size_t at = (size_t)s * acc * N;
                    fy_step_stats ss;
                    if (run == 2 && s == 2) { /* chunk 5's gradient copy of the step's last micro */
                        fy_trainer_inject_failure(tr, FY_T_D2H_GRAD, 3, (int64_t)s * acc + acc - 1,
                                                  FY_ERR_IO);
                        cr_assert_eq(fy_trainer_step(tr, x + at, y + at, 1e-2f, &ss), FY_ERR_IO);
                    }
                    cr_assert_eq(fy_trainer_step(tr, x + at, y + at, 1e-2f, &ss), FY_OK);
                    loss[run][s] = ss.loss;
                }
                cr_assert_eq(fy_trainer_eval(tr, x, y, &eval[run]), FY_OK);
                for (int b = 0; b < 4; b++) {
                    w[run][b] = malloc(fy_model_block(m, b)->nelem * 4);
                    fy_trainer_get_params(tr, b, w[run][b]);
                }
                fy_trainer_free(tr);
                fy_dev_free(dev);
                fy_plan_free(&p);
            }
            for (int run = 1; run < 3; run++) {
                for (int s = 0; s < NST; s++)
                    cr_expect(loss[run][s] == loss[0][s], "%s, %d micro-batches, run %d: step %d "
                              "loss %.9g vs %.9g", fy_dtype_name(dt), acc, run, s, loss[run][s], loss[0][s]);
                cr_expect(eval[run] == eval[0], "%s, %d micro-batches, run %d: evaluation",
                          fy_dtype_name(dt), acc, run);
                for (int b = 0; b < 4; b++)
                    cr_expect(!memcmp(w[run][b], w[0][b], fy_model_block(m, b)->nelem * 4),
                              "%s, %d micro-batches, run %d: block %d", fy_dtype_name(dt), acc, run, b);
            }
            for (int run = 0; run < 3; run++)
                for (int b = 0; b < 4; b++) free(w[run][b]);
        }
    }
    free(x);
    free(y);
    fy_loader_free(ld);
    fy_tokens_free(tok);
    fy_model_free(m);
}

Test(llama_model, tied_and_accumulated_plans_are_bit_identical) {
    fy_model *m = plan_llama(true);
    result r32, r16;
    accumulated_plans_are_bit_identical(m, FY_F32, &r32);
    accumulated_plans_are_bit_identical(m, FY_BF16, &r16);
    cr_expect(r32.loss[STEPS - 1] < r32.loss[0], "the tied model learns: %.4f -> %.4f", r32.loss[0],
              r32.loss[STEPS - 1]);
    result_free(&r32);
    result_free(&r16);
    fy_model_free(m);
}

/* ---- directories and files written and read back ------------------------------------------- */

static char *temp_dir(void) {
    char *d = strdup("/tmp/ferry-test-hf-XXXXXX");
    cr_assert(mkdtemp(d));
    return d;
}

static void rm_rf(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    for (struct dirent *e; (e = readdir(d));) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char p[4096];
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        struct stat sb;
        if (stat(p, &sb) == 0 && S_ISDIR(sb.st_mode)) rm_rf(p);
        else unlink(p);
    }
    closedir(d);
    rmdir(dir);
}

static int count_files(const char *dir, const char *suffix) {
    DIR *d = opendir(dir);
    cr_assert(d, "%s", dir);
    int n = 0;
    for (struct dirent *e; (e = readdir(d));) {
        size_t a = strlen(e->d_name), b = strlen(suffix);
        n += a >= b && !strcmp(e->d_name + a - b, suffix);
    }
    closedir(d);
    return n;
}

/* Random weights of m (nonzero everywhere, norms away from 1). */
static float **random_blocks(const fy_model *m, uint64_t seed) {
    float **h = blocks_new(m);
    for (int b = 0; b < fy_model_nblocks(m); b++) {
        fy_model_init_block(m, b, seed, h[b]);
        const fy_block_spec *blk = fy_model_block(m, b);
        for (int i = 0; i < blk->ntensors; i++)
            if (blk->tensors[i].cols == 1)
                for (int r = 0; r < blk->tensors[i].rows; r++)
                    h[b][blk->tensors[i].offset + r] += 0.01f * (float)((r * 7 + b) % 13);
    }
    return h;
}

/* Saves m's host weights to path and reads them back through fy_model_from_weights:
 * the same model, the same bits (bf16: the values rounded). */
static void round_trip(const fy_model *m, float **h, const char *path, const fy_save_opts *o) {
    cr_assert_eq(fy_model_save_host(m, path, o, h), FY_OK, "%s", fy_last_error());
    fy_weights *w;
    fy_model *back;
    cr_assert_eq(fy_weights_open(path, &w), FY_OK, "%s", fy_last_error());
    cr_assert_eq(fy_model_from_weights(w, NULL, &back), FY_OK, "%s", fy_last_error());
    char a[FY_MODEL_SIGNATURE_MAX], b[FY_MODEL_SIGNATURE_MAX];
    fy_model_signature(m, a, sizeof a);
    fy_model_signature(back, b, sizeof b);
    cr_expect_str_eq(a, b, "the config written rebuilds the model");
    float **got = blocks_new(m);
    cr_assert_eq(fy_model_load(back, w, got), FY_OK);
    for (int bl = 0; bl < fy_model_nblocks(m); bl++) {
        size_t n = fy_model_block(m, bl)->nelem;
        if (o && o->dtype == FY_BF16) {
            size_t bad = 0;
            for (size_t i = 0; i < n; i++)
                bad += fy_f32_to_bf16(h[bl][i]) != fy_f32_to_bf16(got[bl][i]) ||
                       got[bl][i] != fy_bf16_to_f32(fy_f32_to_bf16(got[bl][i]));
            cr_expect_eq(bad, 0, "%s block %d: %zu values are not the bf16 rounding", path, bl, bad);
        } else {
            cr_expect(!memcmp(got[bl], h[bl], n * sizeof(float)), "%s block %d differs", path, bl);
        }
    }
    blocks_free(m, got);
    fy_model_free(back);
    fy_weights_close(w);
}

/* The index against the shards: every tensor once, in the shard it names, total_size
 * the sum of the tensors' bytes, each shard within the cap unless it holds one tensor. */
static void expect_index_consistent(const char *dir, size_t cap) {
    char p[4096];
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    char *text = test_read_file(p, NULL);
    cJSON *idx = cJSON_Parse(text);
    free(text);
    cr_assert(idx);
    const cJSON *map = cJSON_GetObjectItem(idx, "weight_map");
    double total = jnum(cJSON_GetObjectItem(idx, "metadata"), "total_size"), sum = 0;
    int nmap = cJSON_GetArraySize(map), nfound = 0;
    DIR *d = opendir(dir);
    for (struct dirent *e; (e = readdir(d));) {
        if (!strstr(e->d_name, "-of-")) continue;
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        fy_st_file *f;
        cr_assert_eq(fy_st_open(p, &f), FY_OK);
        size_t bytes = 0;
        for (int i = 0; i < fy_st_count(f); i++) {
            const fy_st_tensor *t = fy_st_at(f, i);
            const cJSON *v = cJSON_GetObjectItem(map, t->name);
            cr_expect(cJSON_IsString(v) && !strcmp(v->valuestring, e->d_name),
                      "%s of %s is not mapped to it", t->name, e->d_name);
            bytes += t->nbytes;
            nfound++;
        }
        cr_expect(bytes <= cap || fy_st_count(f) == 1, "%s holds %zu bytes, over %zu", e->d_name,
                  bytes, cap);
        sum += (double)bytes;
        fy_st_close(f);
    }
    closedir(d);
    cr_expect_eq(nfound, nmap, "the shards hold %d tensors, the index maps %d", nfound, nmap);
    cr_expect(sum == total, "total_size %.0f, the tensors %.0f bytes", total, sum);
    cJSON_Delete(idx);
}

Test(llama_model, directories_and_files_round_trip_bit_exactly) {
    char *dir = temp_dir();
    char path[4096];
    fy_model *m = plan_llama(false), *t = plan_llama(true);
    float **h = random_blocks(m, 3), **ht = random_blocks(t, 4);
    const size_t cap = 40000; /* several shards; the embedding (256 x 32 fp32) alone */
    snprintf(path, sizeof path, "%s/untied", dir);
    round_trip(m, h, path, &(fy_save_opts){.shard_nbytes = cap});
    cr_expect_gt(count_files(path, ".safetensors"), 3);
    expect_index_consistent(path, cap);
    snprintf(path, sizeof path, "%s/one-shard", dir); /* the default cap: model.safetensors */
    round_trip(m, h, path, NULL);
    cr_expect_eq(count_files(path, ".safetensors"), 1);
    snprintf(path, sizeof path, "%s/one-shard/model.safetensors", dir);
    cr_expect_eq(access(path, F_OK), 0);
    snprintf(path, sizeof path, "%s/tied-bf16", dir);
    round_trip(t, ht, path, &(fy_save_opts){.dtype = FY_BF16, .shard_nbytes = cap});
    snprintf(path, sizeof path, "%s/untied.safetensors", dir); /* one file, config inside */
    round_trip(m, h, path, NULL);
    /* GPT-2: a directory (names under transformer.) and a file */
    fy_gpt2_config gc = {.vocab = 96, .max_seq = 16, .channels = 32, .layers = 2, .heads = 4};
    fy_model *g;
    cr_assert_eq(fy_gpt2_new(&gc, NULL, &g), FY_OK);
    float **hg = random_blocks(g, 5);
    snprintf(path, sizeof path, "%s/gpt2", dir);
    round_trip(g, hg, path, &(fy_save_opts){.shard_nbytes = cap});
    expect_index_consistent(path, cap);
    snprintf(path, sizeof path, "%s/gpt2.safetensors", dir);
    round_trip(g, hg, path, NULL);
    blocks_free(g, hg);
    fy_model_free(g);
    blocks_free(m, h);
    blocks_free(t, ht);
    fy_model_free(m);
    fy_model_free(t);
    rm_rf(dir);
    free(dir);
}

/* A directory is replaced whole (the old shards gone) when it holds only what ferry
 * writes; one holding anything else is left as it was, with an error naming the file. */
Test(llama_model, saving_replaces_only_a_model_directory) {
    char *dir = temp_dir();
    char path[4096], extra[4200];
    fy_model *m = plan_llama(false);
    float **h = random_blocks(m, 6), **h2 = random_blocks(m, 7);
    snprintf(path, sizeof path, "%s/model", dir);
    cr_assert_eq(fy_model_save_host(m, path, &(fy_save_opts){.shard_nbytes = 40000}, h), FY_OK);
    int before = count_files(path, ".safetensors");
    cr_assert_eq(fy_model_save_host(m, path, NULL, h2), FY_OK); /* now one shard */
    cr_expect_eq(count_files(path, ".safetensors"), 1, "the old %d shards were left behind", before);
    /* what an interrupted save left (a process that is gone, its directory still marked
     * partial): removed by the next one; directories only named like it (a user's backup
     * model.old.20231231, an unmarked model.tmp.N) are left as they are */
    char stale[4200], stale_file[4300], backup[4200], unmarked[4200];
    snprintf(stale, sizeof stale, "%s.tmp.4194303", path);
    snprintf(backup, sizeof backup, "%s.old.20231231", path);
    snprintf(unmarked, sizeof unmarked, "%s.tmp.4194302", path);
    const char *dirs[] = {stale, backup, unmarked};
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(mkdir(dirs[i], 0755), 0);
        snprintf(stale_file, sizeof stale_file, "%s/model.safetensors", dirs[i]);
        fclose(fopen(stale_file, "w"));
    }
    snprintf(stale_file, sizeof stale_file, "%s/.ferry-partial", stale);
    fclose(fopen(stale_file, "w"));
    cr_assert_eq(fy_model_save_host(m, path, NULL, h2), FY_OK);
    cr_expect_neq(access(stale, F_OK), 0, "the stale directory %s is still there", stale);
    snprintf(stale_file, sizeof stale_file, "%s/model.safetensors", backup);
    cr_expect_eq(access(stale_file, F_OK), 0, "the user's %s was removed", backup);
    snprintf(stale_file, sizeof stale_file, "%s/model.safetensors", unmarked);
    cr_expect_eq(access(stale_file, F_OK), 0, "the unmarked %s was removed", unmarked);
    snprintf(stale_file, sizeof stale_file, "%s/.ferry-partial", path);
    cr_expect_neq(access(stale_file, F_OK), 0, "the saved directory is still marked partial");
    snprintf(extra, sizeof extra, "%s/notes.txt", path);
    FILE *fp = fopen(extra, "w");
    fputs("mine\n", fp);
    fclose(fp);
    fy_log_set_level(FY_LOG_QUIET);
    cr_expect_eq(fy_model_save_host(m, path, NULL, h), FY_ERR_INVALID);
    cr_expect(strstr(fy_last_error(), "notes.txt"), "%s", fy_last_error());
    cr_expect_eq(access(extra, F_OK), 0, "the user's file is gone");
    fy_weights *w;
    cr_assert_eq(fy_weights_open(path, &w), FY_OK);
    float **got = blocks_new(m);
    cr_assert_eq(fy_model_load(m, w, got), FY_OK);
    for (int b = 0; b < fy_model_nblocks(m); b++)
        cr_expect(!memcmp(got[b], h2[b], fy_model_block(m, b)->nelem * 4), "block %d changed", b);
    fy_weights_close(w);
    blocks_free(m, got);
    blocks_free(m, h);
    blocks_free(m, h2);
    fy_model_free(m);
    rm_rf(dir);
    free(dir);
}

/* A chunked sequence's MLP recomputes its gate and up projections (gu, N x 2F) in the
 * backward instead of keeping them (llama.c: gu_recomputed): a layer's saved area is
 * smaller by gu, its workspace holds a chunk's gu instead (eval's too: the forward computes
 * it there), and its backward costs that GEMM's 2 N C 2F FLOPs more; one chunk keeps gu.
 * (That the recomputation gives the forward's bits: the plan and fixture tests in chunks.) */
Test(llama_model, a_chunked_sequence_recomputes_the_mlp_projections) {
    fy_model *m;
    cr_assert_eq(fy_model_named("llama-tiny", NULL, &m), FY_OK);
    const fy_llama_config *c = fy_llama_config_of(m);
    const int B = 2, T = 64, N = B * T, Nc = 32, lay = 1;
    const size_t gu = (size_t)N * 2 * c->ffn * 4, gu_chunk = (size_t)Nc * 2 * c->ffn * 4;
    fy_act_sizes kept, rec, kept_eval, rec_eval;
    fy_cost kept_bwd, rec_bwd, kept_fwd, rec_fwd;
    fy_model_set_chunk(m, N); /* one chunk */
    fy_model_acts(m, lay, B, T, FY_F32, true, &kept);
    fy_model_acts(m, lay, 1, Nc, FY_F32, false, &kept_eval); /* Nc positions, one chunk */
    fy_model_cost(m, lay, FY_PASS_FWD, B, T, 4, &kept_fwd);
    fy_model_cost(m, lay, FY_PASS_BWD, B, T, 4, &kept_bwd);
    fy_model_set_chunk(m, Nc);
    fy_model_acts(m, lay, B, T, FY_F32, true, &rec);
    fy_model_acts(m, lay, B, T, FY_F32, false, &rec_eval);
    fy_model_cost(m, lay, FY_PASS_FWD, B, T, 4, &rec_fwd);
    fy_model_cost(m, lay, FY_PASS_BWD, B, T, 4, &rec_bwd);
    cr_expect_eq(kept.saved - rec.saved, gu, "saved %zu, kept %zu", rec.saved, kept.saved);
    cr_expect_eq(rec_eval.work - kept_eval.work, gu_chunk, "eval work %zu, %zu without gu",
                 rec_eval.work, kept_eval.work);
    cr_expect_eq(rec_fwd.flops, kept_fwd.flops);
    cr_expect_eq(rec_bwd.flops - kept_bwd.flops, 4.0 * N * c->channels * c->ffn);
    fy_model_free(m);
}

/* Every named config builds and fits the interface; the published sizes. */
Test(llama_model, named_configs_have_the_published_sizes) {
    static const struct { const char *name; double params_b; } want[] = {
        {"llama3.2-1b", 1.236}, {"llama3.2-3b", 3.213}, {"llama3-8b", 8.030},
        {"llama2-7b", 6.738}, {"llama2-13b", 13.016}, {"llama3-70b", 70.554}};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        fy_model *m;
        cr_assert_eq(fy_model_named(want[i].name, NULL, &m), FY_OK);
        double p = (double)fy_model_num_params(m) / 1e9;
        cr_expect(fabs(p - want[i].params_b) < 0.001, "%s: %.4fB parameters, published %.3fB",
                  want[i].name, p, want[i].params_b);
        cr_expect_str_eq(fy_model_family(m), "llama");
        fy_model_free(m);
    }
}

/* The other families' named configs: their exact parameter counts, as the model cards and
 * the safetensors indexes of the published checkpoints give them (Qwen2.5 0.5B 494,032,768,
 * 7B 7,615,616,512, 14B 14,770,033,664, 32B 32,763,876,352; Qwen3 0.6B 596,049,920 (its
 * tied head counted once), 8B 8,190,735,360, 14B 14,768,307,200, 32B 32,762,123,264;
 * Mistral 7B v0.1 7,241,732,096, Nemo 12,247,782,400; Gemma 2 2B 2,614,341,888, 9B
 * 9,241,705,984, 27B 27,227,128,320; Gemma 3 1B 999,885,952; Phi-3 mini 3,821,079,552,
 * Phi-4 mini 3,836,021,760). Gemma 3 4B, 12B and 27B are published with a vision tower; the
 * counts here are of their text models, as transformers' Gemma3ForCausalLM builds them from
 * the published text_config (3,880,263,168, 11,766,034,176, 27,009,346,304). Each also
 * counted by transformers 4.57 from the same config on the meta device: equal. */
Test(llama_model, family_configs_have_the_published_parameter_counts) {
    static const struct { const char *name, *type; size_t params; } want[] = {
        {"qwen2.5-0.5b", "qwen2", 494032768}, {"qwen2.5-7b", "qwen2", 7615616512},
        {"qwen2.5-14b", "qwen2", 14770033664}, {"qwen2.5-32b", "qwen2", 32763876352},
        {"qwen3-0.6b", "qwen3", 596049920}, {"qwen3-8b", "qwen3", 8190735360},
        {"qwen3-14b", "qwen3", 14768307200}, {"qwen3-32b", "qwen3", 32762123264},
        {"mistral-7b", "mistral", 7241732096}, {"mistral-nemo-12b", "mistral", 12247782400},
        {"gemma2-2b", "gemma2", 2614341888}, {"gemma2-9b", "gemma2", 9241705984},
        {"gemma2-27b", "gemma2", 27227128320}, {"gemma3-1b", "gemma3_text", 999885952},
        {"gemma3-4b", "gemma3_text", 3880263168}, {"gemma3-12b", "gemma3_text", 11766034176},
        {"gemma3-27b", "gemma3_text", 27009346304}, {"phi3-mini", "phi3", 3821079552},
        {"phi4-mini", "phi3", 3836021760}};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        fy_model *m;
        cr_assert_eq(fy_model_named(want[i].name, NULL, &m), FY_OK, "%s", want[i].name);
        cr_expect_eq(fy_model_num_params(m), want[i].params, "%s: %zu parameters, published %zu",
                     want[i].name, fy_model_num_params(m), want[i].params);
        cr_expect_str_eq(fy_llama_arch_type(fy_llama_config_of(m)->arch), want[i].type);
        fy_model_free(m);
    }
    /* the tiny shape of each builds */
    const char *tiny[] = {"qwen2.5-tiny", "qwen3-tiny", "mistral-tiny", "gemma2-tiny",
                          "gemma3-tiny", "phi3-tiny"};
    for (size_t i = 0; i < sizeof tiny / sizeof tiny[0]; i++) {
        fy_model *m;
        cr_assert_eq(fy_model_named(tiny[i], NULL, &m), FY_OK, "%s", tiny[i]);
        fy_model_free(m);
    }
}
