/* fuzz_paths.c — the output checks of engine/io/paths.h: each input builds a tree of files,
 * directories, symbolic and hard links on tmpfs and a command's inputs and outputs in it
 * (tests/paths_world.h); when the check passes, writing the outputs as ferry does must
 * leave every input's bytes, every glob's matches and every other output as they were,
 * and a refusal must be one error line naming both flags. */
#include <stdio.h>

#include "fuzz/fuzz_util.h"
#include "tests/paths_world.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t n) {
    static char root[128];
    if (!root[0]) {
        const char *dir = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
        snprintf(root, sizeof root, "%s/ferry-fuzz-paths-%ld", dir, (long)getpid());
        fy_log_set_level(FY_LOG_QUIET);
    }
    char *bad = world_run(root, data, n);
    if (bad) {
        fprintf(stderr, "fuzz_paths: %s\n", bad);
        abort();
    }
    return 0;
}
