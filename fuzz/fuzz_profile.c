/* fuzz_profile.c — machine profiles: bandwidths, memory, the CPU AdamW table, the
 * measured block costs. */
#include "fuzz/fuzz_util.h"
#include "tuner/profile.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t n) {
    const char *path = fuzz_file(".json", data, n);
    fy_profile p;
    if (path) fy_profile_load(path, &p);
    return 0;
}
