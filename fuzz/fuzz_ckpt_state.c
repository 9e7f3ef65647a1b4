/* fuzz_ckpt_state.c — checkpoint state files (ferry_state.json): the parser that decides
 * whether a checkpoint is resumed. A state that parses must name every data file once,
 * only known names (never a path: "../x" must not get through), and consistent
 * counters. */
#include <string.h>

#include "engine/checkpoint.h"
#include "fuzz/fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t n) {
    fuzz_path(".json"); /* silences the log, as every target */
    fy_ckpt_state s;
    char why[128];
    if (fy_ckpt_state_parse((const char *)data, n, &s, why, sizeof why) != FY_OK) {
        if (!why[0]) abort(); /* a refusal says why */
        return 0;
    }
    if (s.nfiles < 3 || s.nfiles > FY_CKPT_MAX_FILES || !cJSON_IsObject(s.config)) abort();
    if (s.info.updates > s.info.step || s.info.skipped_run > s.info.step || s.info.step < 0) abort();
    for (int i = 0; i < s.nfiles; i++) {
        if (strchr(s.files[i].name, '/') || !strstr(s.files[i].name, ".safetensors")) abort();
        for (int k = 0; k < i; k++)
            if (!strcmp(s.files[i].name, s.files[k].name)) abort();
    }
    fy_ckpt_state_free(&s);
    return 0;
}
