/* test_paths.c — no output lands on an input or on another output (engine/io/paths.h and
 * the commands' flags, engine/cli/opts_paths.c).
 *
 * Three layers: the module on hand-made trees (links, "..", hard links, owned names,
 * globs); the property on random trees (tests/paths_world.h: when the check passes,
 * writing the outputs as ferry does leaves every input, glob and other output as it was;
 * fuzz/fuzz_paths.c runs the same with libFuzzer's bytes); and the ferry binary, where
 * each refused command must exit 2 with one "ferry: error:" line naming both flags and
 * leave every input byte for byte as it was (checked by checksum), given directly,
 * through a symbolic link and through a hard link. */
#include <criterion/criterion.h>

#include <stdarg.h>
#include <sys/stat.h>

#include "engine/cli/opts.h"
#include "tests/paths_world.h"
#include "tests/test_util.h"
#include "tuner/profile.h"

static char g_dir[64];

static void make_dir(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/ferry-test-paths-XXXXXX");
    cr_assert_not_null(mkdtemp(g_dir), "mkdtemp: %s", strerror(errno));
}

static void remove_dir(void) { test_remove_tree(g_dir); }

TestSuite(paths, .init = make_dir, .fini = remove_dir);

/* A path inside the test directory. */
static const char *P(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    const char *p = test_vpath(g_dir, fmt, ap);
    va_end(ap);
    return p;
}

static void put(const char *path, const char *text) {
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "cannot create %s: %s", path, strerror(errno));
    cr_assert_eq(fputs(text, f) >= 0 && fclose(f) == 0, true);
}

/* ---- the module ------------------------------------------------------------------------ */

/* fy_paths_check of one reader and one writer (or two writers: in == NULL, out2 given). */
static fy_status check2(const char *in, const char *out, fy_path_write how, const char *out2) {
    fy_paths *p;
    cr_assert_eq(fy_paths_new(&p), FY_OK);
    if (in) cr_assert_eq(fy_paths_read(p, "--in", in), FY_OK);
    cr_assert_eq(fy_paths_write(p, "--out", out, how, "written whole", NULL, false), FY_OK);
    if (out2) cr_assert_eq(fy_paths_write(p, "--out2", out2, FY_PATH_FILE, "", NULL, false), FY_OK);
    fy_log_level lvl = fy_log_get_level();
    fy_log_set_level(FY_LOG_QUIET);
    const fy_status st = fy_paths_check(p);
    fy_log_set_level(lvl);
    fy_paths_free(p);
    return st;
}

Test(paths, one_file_by_name_link_dots_and_inode) {
    cr_assert_eq(mkdir(P("d"), 0755), 0);
    put(P("d/data.bin"), "tokens");
    cr_assert_eq(symlink("d/data.bin", P("link")), 0);
    cr_assert_eq(symlink("data.bin", P("d/rel")), 0);
    cr_assert_eq(symlink(P("d"), P("dirlink")), 0);
    cr_assert_eq(link(P("d/data.bin"), P("hard")), 0);
    cr_assert_eq(symlink("link", P("chain")), 0); /* a link to a link */
    const char *same[] = {"d/data.bin", "link", "d/rel", "dirlink/data.bin", "hard", "chain",
                          "d/../d/./data.bin", "dirlink/../d/data.bin", NULL};
    for (int i = 0; same[i]; i++) {
        cr_expect_eq(check2(P("d/data.bin"), P("%s", same[i]), FY_PATH_FILE, NULL), FY_ERR_USAGE,
                     "%s is the input", same[i]);
        cr_expect_eq(check2(P("%s", same[i]), P("d/data.bin"), FY_PATH_STREAM, NULL), FY_ERR_USAGE,
                     "the output is %s", same[i]);
        cr_expect(fy_paths_same(P("%s", same[i]), P("d/data.bin")), "%s", same[i]);
    }
    /* not one file: a copy, a name beside it, the directory */
    put(P("d/copy.bin"), "tokens");
    cr_expect_eq(check2(P("d/data.bin"), P("d/copy.bin"), FY_PATH_FILE, NULL), FY_OK);
    cr_expect_eq(check2(P("d/data.bin"), P("d/new.bin"), FY_PATH_FILE, NULL), FY_OK);
    cr_expect_eq(check2(P("d/data.bin"), P("data.bin"), FY_PATH_FILE, NULL), FY_OK);
}

/* ".." after a link is the link's target's parent, as the kernel resolves it, not the
 * link's own directory. */
Test(paths, dots_after_a_link_go_up_from_its_target) {
    cr_assert_eq(mkdir(P("a"), 0755), 0);
    cr_assert_eq(mkdir(P("a/b"), 0755), 0);
    cr_assert_eq(mkdir(P("c"), 0755), 0);
    put(P("a/in.txt"), "x");
    cr_assert_eq(symlink(P("a/b"), P("c/lb")), 0);
    /* c/lb/.. is a, so c/lb/../in.txt is a/in.txt (lexically it would be c/in.txt) */
    cr_expect_eq(check2(P("a/in.txt"), P("c/lb/../in.txt"), FY_PATH_FILE, NULL), FY_ERR_USAGE);
    cr_expect_eq(check2(P("c/in.txt"), P("c/lb/../in.txt"), FY_PATH_FILE, NULL), FY_OK);
}

Test(paths, dangling_links_resolve_to_where_they_point) {
    cr_assert_eq(symlink("later.json", P("dangling")), 0);
    /* two outputs, one through a link to a file neither has made yet */
    cr_expect_eq(check2(NULL, P("dangling"), FY_PATH_STREAM, P("later.json")), FY_ERR_USAGE);
    cr_assert_eq(symlink("loop2", P("loop1")), 0);
    cr_assert_eq(symlink("loop1", P("loop2")), 0);
    cr_expect_eq(check2(NULL, P("loop1"), FY_PATH_FILE, P("other")), FY_OK); /* no hang */
}

Test(paths, inside_a_directory_written_whole) {
    cr_assert_eq(mkdir(P("out"), 0755), 0);
    cr_assert_eq(mkdir(P("out/sub"), 0755), 0);
    put(P("out/sub/in.bin"), "x");
    cr_assert_eq(symlink("out", P("outlink")), 0);
    cr_expect_eq(check2(P("out/sub/in.bin"), P("out"), FY_PATH_DIR, NULL), FY_ERR_USAGE);
    cr_expect_eq(check2(P("outlink/sub/in.bin"), P("out/"), FY_PATH_DIR, NULL), FY_ERR_USAGE);
    cr_expect_eq(check2(NULL, P("out"), FY_PATH_DIR, P("out/new.json")), FY_ERR_USAGE);
    cr_expect_eq(check2(P("out/sub/in.bin"), P("outer"), FY_PATH_DIR, NULL), FY_OK); /* a prefix, not a parent */
    cr_expect_eq(check2(P("out/sub/in.bin"), P("out/sub/in.bin.d"), FY_PATH_DIR, NULL), FY_OK);
}

static bool owns_step(const char *name) { return !strncmp(name, "step-", 5) || !strcmp(name, "latest"); }

Test(paths, a_directory_of_owned_names_leaves_the_others) {
    cr_assert_eq(mkdir(P("ck"), 0755), 0);
    cr_assert_eq(mkdir(P("ck/step-1"), 0755), 0);
    put(P("ck/step-1/state.json"), "{}");
    put(P("ck/notes.txt"), "mine");
    fy_paths *p;
    fy_log_set_level(FY_LOG_QUIET);
    const struct { const char *in, *out; fy_status want; } cases[] = {
        {"ck/step-1/state.json", NULL, FY_ERR_USAGE}, /* inside a name it replaces */
        {"ck/notes.txt", NULL, FY_OK},                /* a name it leaves alone */
        {NULL, "ck/latest", FY_ERR_USAGE},
        {NULL, "ck/metrics.jsonl", FY_OK},
        {NULL, "ck", FY_ERR_USAGE},                   /* the directory itself */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        cr_assert_eq(fy_paths_new(&p), FY_OK);
        if (cases[i].in) cr_assert_eq(fy_paths_read(p, "--in", P("%s", cases[i].in)), FY_OK);
        if (cases[i].out)
            cr_assert_eq(fy_paths_write(p, "--out", P("%s", cases[i].out), FY_PATH_FILE, "", NULL, false), FY_OK);
        cr_assert_eq(fy_paths_write(p, "--dir", P("ck"), FY_PATH_DIR_NAMES, "its steps", owns_step, false), FY_OK);
        cr_expect_eq(fy_paths_check(p), cases[i].want, "case %zu (%s %s)", i,
                     cases[i].in ? cases[i].in : "", cases[i].out ? cases[i].out : "");
        fy_paths_free(p);
    }
    /* an allowed pair is not compared: --resume's checkpoint inside --checkpoint-dir */
    cr_assert_eq(fy_paths_new(&p), FY_OK);
    cr_assert_eq(fy_paths_read(p, "--in", P("ck/step-1/state.json")), FY_OK);
    cr_assert_eq(fy_paths_write(p, "--dir", P("ck"), FY_PATH_DIR_NAMES, "its steps", owns_step, false), FY_OK);
    cr_assert_eq(fy_paths_allow(p, "--dir", "--in"), FY_OK);
    cr_expect_eq(fy_paths_check(p), FY_OK);
    fy_paths_free(p);
}

Test(paths, an_output_a_glob_would_read) {
    cr_assert_eq(mkdir(P("data"), 0755), 0);
    put(P("data/a_000.bin"), "x");
    fy_log_set_level(FY_LOG_QUIET);
    const fy_path_write F = FY_PATH_FILE, D = FY_PATH_DIR;
    const struct { const char *glob, *out; fy_path_write how; fy_status want; } cases[] = {
        {"data/a_*.bin", "data/a_000.bin", F, FY_ERR_USAGE}, /* a match now */
        {"data/a_*.bin", "data/a_001.bin", F, FY_ERR_USAGE}, /* a match once written */
        {"data/a_*.bin", "data/b_001.bin", F, FY_OK},
        {"data/a_*.bin", "data/.a_x.bin", F, FY_OK},         /* a leading dot is not matched */
        {"d*/a_*.bin", "data/a_002.bin", F, FY_ERR_USAGE},   /* the directory a pattern too */
        {"data/../data/a_?.bin", "data/a_9.bin", F, FY_ERR_USAGE},
        /* a directory output that would change what the glob matches */
        {"data/*.bin", "data", D, FY_ERR_USAGE},             /* its directory, replaced */
        {"data/x/*.bin", "data", D, FY_ERR_USAGE},           /* one that holds it */
        {"new/*.bin", "new", D, FY_ERR_USAGE},               /* one that would make it */
        {"new/../data/*.bin", "new", D, FY_ERR_USAGE},       /* ".." after it, once it exists */
        {"o*/*.bin", "out", D, FY_ERR_USAGE},                /* a level of a pattern */
        {"data/*.bin", "data2", D, FY_OK},
        {"*.bin", "model", D, FY_OK},                        /* a glob does not descend */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        fy_paths *p;
        cr_assert_eq(fy_paths_new(&p), FY_OK);
        cr_assert_eq(fy_paths_read_glob(p, "--data", P("%s", cases[i].glob)), FY_OK);
        cr_assert_eq(fy_paths_write(p, "--trace", P("%s", cases[i].out), cases[i].how, "", NULL, false), FY_OK);
        cr_expect_eq(fy_paths_check(p), cases[i].want, "%s against %s", cases[i].out, cases[i].glob);
        fy_paths_free(p);
    }
}

/* Random trees and paths (paths_world.h): 2500 of them from fixed seeds. */
Test(paths, random_trees_never_lose_an_input_or_an_output, .timeout = 300) {
    fy_log_set_level(FY_LOG_QUIET);
    char root[600];
    snprintf(root, sizeof root, "%s/world", g_dir);
    uint64_t s = 0x9e3779b97f4a7c15ull;
    int refused = 0, passed = 0;
    for (int seed = 0; seed < 2500; seed++) {
        uint8_t bytes[96];
        for (size_t i = 0; i < sizeof bytes; i++) {
            s ^= s << 13; s ^= s >> 7; s ^= s << 17;
            bytes[i] = (uint8_t)(s >> 24);
        }
        const unsigned before = fy_log_error_count();
        char *bad = world_run(root, bytes, sizeof bytes);
        cr_assert_null(bad, "seed %d: %s", seed, bad);
        if (fy_log_error_count() > before) refused++;
        else passed++;
    }
    /* both outcomes are exercised, so neither side of the property is vacuous */
    cr_expect_gt(refused, 250, "only %d of 2500 worlds refused", refused);
    cr_expect_gt(passed, 250, "only %d of 2500 worlds passed", passed);
}

/* Every option that names a file or directory is one the checks know. */
Test(paths, every_path_option_is_checked) {
    for (int i = 0; i < fy_opts_count(); i++) {
        const char *name, *metavar;
        unsigned cmds;
        fy_opts_at(i, &name, &metavar, &cmds);
        const bool names_path = metavar && (strstr(metavar, "FILE") || strstr(metavar, "PATH") ||
                                            strstr(metavar, "DIR"));
        cr_expect(!names_path || fy_opts_is_path(name), "--%s %s is not registered with the path checks",
                  name, metavar);
    }
}

/* ---- the binary -------------------------------------------------------------------------- */

#define SMALL "--batch", "2", "--seq", "16", "--steps", "1", "--threads", "1", "--device", "cpu"

static void run(test_proc *r, const char *const *args) { test_run_ferry(r, g_dir, 120, args); }
#define FERRY(r, ...) run((r), (const char *const[]){__VA_ARGS__, NULL})

/* FNV-1a of a whole file. */
static uint64_t sum_of(const char *path) {
    bool ok;
    const uint64_t h = w_sum(path, &ok);
    cr_assert(ok, "cannot read %s", path);
    return h;
}

/* The same run with `out` given directly, through a symbolic link and through a hard link
 * to `in`: each exits 2 with one error line naming both flags, `in` unchanged. */
typedef void (*runner)(test_proc *r, const char *out);

static void refused_three_ways(const char *in, const char *in_flag, const char *out_flag, runner go) {
    const uint64_t before = sum_of(in);
    static int k;
    char sym[512], hard[512];
    snprintf(sym, sizeof sym, "%s/sym-%d", g_dir, k);
    snprintf(hard, sizeof hard, "%s/hard-%d", g_dir, k++);
    cr_assert_eq(symlink(in, sym), 0);
    cr_assert_eq(link(in, hard), 0);
    const char *outs[] = {in, sym, hard};
    for (int i = 0; i < 3; i++) {
        test_proc r;
        go(&r, outs[i]);
        EXPECT_ERROR(&r, 2, out_flag, in_flag);
        cr_expect_eq(sum_of(in), before, "%s: %s changed", r.cmd, in);
        struct stat sb;
        cr_expect_eq(lstat(sym, &sb) == 0 && S_ISLNK(sb.st_mode), true, "%s: the link is gone", r.cmd);
    }
}

static const char *g_in; /* the input of the runners below */

static void save_plan_on_data(test_proc *r, const char *out) {
    FERRY(r, "train", "--model", "gpt2-tiny", SMALL, "--data", g_in, "--save-plan", out);
}
static void trace_on_data(test_proc *r, const char *out) {
    FERRY(r, "train", "--model", "gpt2-tiny", SMALL, "--data", g_in, "--trace", out);
}
static void metrics_on_data(test_proc *r, const char *out) {
    FERRY(r, "train", "--model", "gpt2-tiny", SMALL, "--data", g_in, "--metrics", out);
}
static void trace_on_init(test_proc *r, const char *out) {
    FERRY(r, "train", SMALL, "--heads", "4", "--init", g_in, "--trace", out);
}
static void metrics_on_init(test_proc *r, const char *out) {
    FERRY(r, "train", SMALL, "--heads", "4", "--init", g_in, "--metrics", out);
}

/* The five commands of the audit (issue #26), each three ways. */
Test(paths, outputs_never_land_on_the_data_or_the_weights) {
    const char *shard = P("train.bin"), *weights = P("init.safetensors");
    test_copy_file(test_fixture("gpt2_tiny_tokens.bin"), shard);
    test_copy_file(test_fixture("gpt2_tiny_init.safetensors"), weights);
    g_in = shard;
    refused_three_ways(shard, "--data", "--save-plan", save_plan_on_data);
    refused_three_ways(shard, "--data", "--trace", trace_on_data);
    refused_three_ways(shard, "--data", "--metrics", metrics_on_data);
    g_in = weights;
    refused_three_ways(weights, "--init", "--trace", trace_on_init);
    refused_three_ways(weights, "--init", "--metrics", metrics_on_init);
    /* and the data still trains, the weights still load */
    test_proc r;
    FERRY(&r, "train", SMALL, "--heads", "4", "--init", weights, "--data", shard);
    test_expect_ok(&r);
}

/* --init as a Hugging Face directory: every file of it is an input (index, shards,
 * config, tokenizer and generation files); --save may replace it whole, not one shard. */
Test(paths, a_model_directory_is_all_inputs) {
    const char *d = P("model");
    test_copy_dir(test_fixture("llama_hf_tiny"), d);
    const char *shard = P("model/model-00007-of-00012.safetensors");
    const uint64_t before = sum_of(shard), cfg = sum_of(P("model/config.json"));
    test_proc r;
    FERRY(&r, "train", SMALL, "--init", d, "--metrics", shard);
    EXPECT_ERROR(&r, 2, "--metrics", "--init", "model-00007-of-00012");
    FERRY(&r, "train", SMALL, "--init", d, "--trace", P("model/config.json"));
    EXPECT_ERROR(&r, 2, "--trace", "--init", "config.json");
    FERRY(&r, "train", SMALL, "--init", P("model/model.safetensors.index.json"), "--save-plan",
          P("model/generation_config.json"));
    EXPECT_ERROR(&r, 2, "--save-plan", "--init", "generation_config.json");
    FERRY(&r, "train", SMALL, "--init", d, "--save", shard); /* one shard of twelve */
    EXPECT_ERROR(&r, 2, "--save", "--init");
    cr_expect_eq(sum_of(shard), before);
    cr_expect_eq(sum_of(P("model/config.json")), cfg);
}

/* A fine-tune in place: --save onto --init's directory replaces it after training; data
 * inside that directory is refused before anything runs. */
Test(paths, save_replaces_init_but_not_the_data) {
    const char *d = P("model");
    test_copy_dir(test_fixture("llama_hf_tiny_bf16"), d);
    const char *tokens = test_fixture("gpt2_tiny_tokens.bin");
    const uint64_t w0 = sum_of(P("model/model.safetensors"));
    test_proc r;
    FERRY(&r, "train", SMALL, "--init", d, "--save", d, "--data", tokens);
    test_expect_ok(&r);
    cr_expect_neq(sum_of(P("model/model.safetensors")), w0, "the trained weights were not saved");
    FERRY(&r, "train", SMALL, "--init", P("model/model.safetensors"), "--save", P("model/"), "--data", tokens);
    test_expect_ok(&r);
    test_copy_file(tokens, P("model/t.bin"));
    const uint64_t t0 = sum_of(P("model/t.bin")), w1 = sum_of(P("model/model.safetensors"));
    FERRY(&r, "train", SMALL, "--init", d, "--save", d, "--data", P("model/t.bin"));
    EXPECT_ERROR(&r, 2, "--data", "--save", "replaces whole");
    cr_expect_eq(sum_of(P("model/t.bin")), t0);
    cr_expect_eq(sum_of(P("model/model.safetensors")), w1);
}

Test(paths, outputs_never_meet) {
    const char *tokens = test_fixture("gpt2_tiny_tokens.bin");
    cr_assert_eq(mkdir(P("sub"), 0755), 0);
    test_proc r;
    FERRY(&r, "train", "--model", "gpt2-tiny", SMALL, "--trace", "t.json", "--save-plan", "sub/../t.json");
    EXPECT_ERROR(&r, 2, "--trace", "--save-plan", "one path");
    FERRY(&r, "train", "--model", "gpt2-tiny", SMALL, "--save", "sv", "--metrics", "sv/m.jsonl");
    EXPECT_ERROR(&r, 2, "--save", "--metrics");
    cr_assert_eq(mkdir(P("d"), 0755), 0);
    test_copy_file(tokens, P("d/a.bin"));
    FERRY(&r, "train", "--model", "gpt2-tiny", SMALL, "--data", "d/*.bin", "--save-plan", "d/plan.bin");
    EXPECT_ERROR(&r, 2, "--data", "--save-plan", "matches");
    struct stat sb;
    cr_expect_neq(stat(P("d/plan.bin"), &sb), 0, "the plan was written");
    cr_expect_neq(stat(P("t.json"), &sb), 0, "the trace was written");
}

/* The checkpoint directory's own names (step-N, latest) are outputs; --resume reads one. */
Test(paths, checkpoints_are_outputs_and_resume_an_input) {
    const char *tokens = test_fixture("gpt2_tiny_tokens.bin");
    test_proc r;
    FERRY(&r, "train", "--model", "gpt2-tiny", SMALL, "--checkpoint-dir", "ck", "--metrics", "ck/latest");
    EXPECT_ERROR(&r, 2, "--checkpoint-dir", "--metrics");
    FERRY(&r, "train", "--model", "gpt2-tiny", SMALL, "--data", tokens, "--steps", "2",
          "--checkpoint-dir", "ck", "--checkpoint-sync");
    test_expect_ok(&r);
    const char *state = P("ck/step-00000002/ferry_state.json");
    const uint64_t s0 = sum_of(state), m0 = sum_of(P("ck/step-00000002/model.safetensors"));
    /* a checkpoint's weights as --init where this run's checkpoints rotate */
    FERRY(&r, "train", SMALL, "--heads", "4", "--init", "ck/step-00000002/model.safetensors",
          "--data", tokens, "--checkpoint-dir", "ck");
    EXPECT_ERROR(&r, 2, "--init", "--checkpoint-dir");
    /* resuming into another directory: the checkpoint's files are inputs */
    FERRY(&r, "train", "--model", "gpt2-tiny", SMALL, "--data", tokens, "--steps", "3",
          "--resume", "ck/step-00000002", "--checkpoint-dir", "ck2", "--trace", state);
    EXPECT_ERROR(&r, 2, "--trace", "--resume");
    FERRY(&r, "train", "--model", "gpt2-tiny", SMALL, "--data", tokens, "--steps", "3",
          "--checkpoint-dir", "ck", "--save", "ck/step-00000002");
    EXPECT_ERROR(&r, 2, "--save", "--checkpoint-dir");
    cr_expect_eq(sum_of(state), s0);
    cr_expect_eq(sum_of(P("ck/step-00000002/model.safetensors")), m0);
    /* and resuming in place is what the directory is for */
    FERRY(&r, "train", "--model", "gpt2-tiny", SMALL, "--data", tokens, "--steps", "3",
          "--checkpoint-dir", "ck", "--resume", "--checkpoint-sync");
    test_expect_ok(&r);
}

static void tune_onto_profile(test_proc *r, const char *out) {
    FERRY(r, "tune", "--model", "gpt2-mini", "--profile", g_in, "--out", out, "--quiet");
}

Test(paths, tune_and_sweep_never_write_over_the_profile) {
    fy_profile prof;
    cr_assert_eq(fy_profile_named("h200-141gb", &prof), FY_OK);
    const char *pf = P("h200.json");
    cr_assert_eq(fy_profile_save(pf, &prof), FY_OK);
    g_in = pf;
    refused_three_ways(pf, "--profile", "--out", tune_onto_profile);
    test_proc r;
    test_copy_file(pf, P("plan.json")); /* tune's default output, given as the profile */
    FERRY(&r, "tune", "--model", "gpt2-mini", "--profile", "plan.json");
    EXPECT_ERROR(&r, 2, "--out", "--profile", "plan.json");
    FERRY(&r, "tune", "--capacity", "--profile", "h200-141gb", "--out", "x.json");
    EXPECT_ERROR(&r, 2, "--out", "capacity");
    cr_assert_eq(mkdir(P("sw"), 0755), 0);
    test_copy_file(pf, P("sw/sweep.csv"));
    const uint64_t s0 = sum_of(P("sw/sweep.csv"));
    FERRY(&r, "sweep", "--model", "gpt2-tiny", "--grid", "offload_params=0", "--simulate",
          "--profile", "sw/sweep.csv", "--out", "sw");
    EXPECT_ERROR(&r, 2, "--profile", "--out", "sweep.csv");
    cr_expect_eq(sum_of(P("sw/sweep.csv")), s0);
    test_copy_file(pf, P("sw/mine.json")); /* a file the sweep does not write is the user's to keep there */
    FERRY(&r, "sweep", "--model", "gpt2-tiny", "--grid", "offload_params=0", "--simulate",
          "--profile", "sw/mine.json", "--out", "sw", "--quiet");
    test_expect_ok(&r);
    /* links planted at the sweep's own names are replaced, never written through */
    cr_assert_eq(mkdir(P("sw2"), 0755), 0);
    cr_assert_eq(symlink(pf, P("sw2/sweep.csv")), 0);
    cr_assert_eq(link(pf, P("sw2/summary.txt")), 0);
    const uint64_t p0 = sum_of(pf);
    FERRY(&r, "sweep", "--model", "gpt2-tiny", "--grid", "offload_params=0", "--simulate",
          "--profile", pf, "--out", "sw2", "--quiet");
    test_expect_ok(&r);
    cr_expect_eq(sum_of(pf), p0, "the sweep wrote through a link at one of its own names");
    struct stat sb;
    cr_expect(lstat(P("sw2/sweep.csv"), &sb) == 0 && S_ISREG(sb.st_mode) && sb.st_nlink == 1);
    cr_expect(lstat(P("sw2/summary.txt"), &sb) == 0 && S_ISREG(sb.st_mode) && sb.st_nlink == 1);
    FERRY(&r, "train", "--model", "gpt2-tiny", SMALL, "--profile", "h200-141gb");
    EXPECT_ERROR(&r, 2, "--profile", "--plan auto");
}

/* A save writes beside its path (<name>.tmp.<pid>) and removes what a dead writer left
 * there: an input so named is refused; a directory only named like a save's leftover (a
 * backup model.old.20231231) is an input like any other, and is kept. */
Test(paths, temporaries_beside_a_save) {
    const char *tokens = test_fixture("gpt2_tiny_tokens.bin");
    test_copy_file(test_fixture("gpt2_tiny_init.safetensors"), P("w.safetensors.tmp.123"));
    test_proc r;
    FERRY(&r, "train", SMALL, "--heads", "4", "--init", "w.safetensors.tmp.123", "--data", tokens,
          "--save", "w.safetensors");
    EXPECT_ERROR(&r, 2, "--init", "--save", "temporary");
    const char *d = P("mymodel.old.20231231");
    test_copy_dir(test_fixture("llama_hf_tiny_bf16"), d);
    const uint64_t w0 = sum_of(P("mymodel.old.20231231/model.safetensors"));
    FERRY(&r, "train", SMALL, "--init", d, "--data", tokens, "--save", "mymodel");
    test_expect_ok(&r);
    cr_expect_eq(sum_of(P("mymodel.old.20231231/model.safetensors")), w0, "the backup was changed");
    struct stat sb;
    cr_expect_eq(stat(P("mymodel.old.20231231/config.json"), &sb), 0, "the backup's config is gone");
    cr_expect_eq(stat(P("mymodel/model.safetensors"), &sb), 0, "the save is missing");
}

/* A glob whose directory part is a pattern reaches directories through links; a working
 * directory whose name holds glob characters is a name, not a pattern. */
Test(paths, globs_through_links_and_odd_directories) {
    const char *tokens = test_fixture("gpt2_tiny_tokens.bin");
    cr_assert_eq(mkdir(P("g"), 0755), 0);
    cr_assert_eq(mkdir(P("g/a"), 0755), 0);
    cr_assert_eq(mkdir(P("else"), 0755), 0);
    test_copy_file(tokens, P("g/a/s1.bin"));
    cr_assert_eq(symlink("../else", P("g/c")), 0);
    test_proc r;
    FERRY(&r, "train", "--model", "gpt2-tiny", SMALL, "--data", "g/*/*.bin", "--save-plan", "else/p.bin");
    EXPECT_ERROR(&r, 2, "--save-plan", "--data");
    cr_assert_eq(symlink("g", P("lg")), 0);
    FERRY(&r, "train", "--model", "gpt2-tiny", SMALL, "--data", "lg/*/*.bin", "--metrics", "g/a/x.bin");
    EXPECT_ERROR(&r, 2, "--metrics", "--data");
    /* the same from a working directory named x[1] */
    cr_assert_eq(mkdir(P("x[1]"), 0755), 0);
    cr_assert_eq(mkdir(P("x[1]/g"), 0755), 0);
    test_copy_file(tokens, P("x[1]/g/s.bin"));
    char cwd[600];
    snprintf(cwd, sizeof cwd, "%s/x[1]", g_dir);
    test_run_ferry(&r, cwd, 120, (const char *const[]){"train", "--model", "gpt2-tiny", SMALL,
                   "--data", "g/*.bin", "--save-plan", "g/p.bin", NULL});
    EXPECT_ERROR(&r, 2, "--save-plan", "--data");
    struct stat sb;
    cr_expect_neq(stat(P("else/p.bin"), &sb), 0);
    cr_expect_neq(stat(P("x[1]/g/p.bin"), &sb), 0);
}
