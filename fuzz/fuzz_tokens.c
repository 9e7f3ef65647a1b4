/* fuzz_tokens.c — llm.c token shards (magic, version, count, token width, truncation):
 * a shard that opens is read through. */
#include "engine/io/tokens.h"
#include "fuzz/fuzz_util.h"

static volatile uint64_t fuzz_sink; /* keeps the reads */

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t n) {
    const char *path = fuzz_file(".bin", data, n);
    fy_tokens *t;
    if (!path || fy_tokens_open(path, &t) != FY_OK) return 0;
    uint64_t sum = 0;
    for (size_t i = 0; i < fy_tokens_count(t); i++) sum += fy_tokens_at(t, i);
    fuzz_sink = sum;
    fy_tokens_free(t);
    return 0;
}
