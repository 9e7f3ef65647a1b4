/* fuzz_plan.c — plan files against a 4-layer GPT-2 (the blocks, kinds, placements, the
 * micro-batch and accumulation, the storage type); a plan that loads must pass
 * fy_plan_check. */
#include "engine/model/gpt2.h"
#include "fuzz/fuzz_util.h"
#include "offload/plan.h"

static fy_model *model;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t n) {
    if (!model) {
        fy_gpt2_config cfg = {.vocab = 256, .max_seq = 32, .channels = 32, .layers = 4, .heads = 4};
        if (fy_gpt2_new(&cfg, NULL, &model) != FY_OK) abort();
    }
    const char *path = fuzz_file(".json", data, n);
    fy_plan plan;
    if (!path || fy_plan_load(path, model, &plan) != FY_OK) return 0;
    if (fy_plan_check(&plan, model) != FY_OK) abort(); /* a loaded plan is a valid one */
    fy_plan_free(&plan);
    return 0;
}
