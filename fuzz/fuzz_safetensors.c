/* fuzz_safetensors.c — the safetensors reader: header JSON, dtypes, shapes, offsets;
 * every tensor of a file that opens is read back as fp32. */
#include <stdlib.h>

#include "engine/io/safetensors.h"
#include "fuzz/fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t n) {
    const char *path = fuzz_file(".safetensors", data, n);
    fy_st_file *f;
    if (!path || fy_st_open(path, &f) != FY_OK) return 0;
    for (int i = 0; i < fy_st_count(f); i++) {
        const fy_st_tensor *t = fy_st_at(f, i);
        size_t nelem = t->nelem;
        if (nelem > ((size_t)1 << 24)) continue; /* the reader checked nbytes against the file */
        float *buf = malloc((nelem ? nelem : 1) * sizeof *buf);
        if (buf) fy_st_read_f32(f, t, buf);
        free(buf);
    }
    fy_st_close(f);
    return 0;
}
