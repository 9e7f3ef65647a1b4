/* crc32c.c — CRC-32C by table (eight tables, a word at a time) or by SSE4.2's crc32. */
#include "engine/core/crc32c.h"

#include <pthread.h>
#include <stdbool.h>
#include <string.h>

#define POLY 0x82F63B78u /* Castagnoli, reflected */

static uint32_t tab[8][256];
static bool hw; /* the CPU has SSE4.2's crc32 */

static void init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
        tab[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++) tab[t][i] = (tab[t - 1][i] >> 8) ^ tab[0][tab[t - 1][i] & 0xff];
#if defined(__x86_64__)
    __builtin_cpu_init();
    hw = __builtin_cpu_supports("sse4.2");
#endif
}

static uint32_t crc_table(const unsigned char *p, size_t n, uint32_t c) {
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= c;
        c = tab[7][w & 0xff] ^ tab[6][(w >> 8) & 0xff] ^ tab[5][(w >> 16) & 0xff] ^
            tab[4][(w >> 24) & 0xff] ^ tab[3][(w >> 32) & 0xff] ^ tab[2][(w >> 40) & 0xff] ^
            tab[1][(w >> 48) & 0xff] ^ tab[0][w >> 56];
    }
    while (n--) c = (c >> 8) ^ tab[0][(c ^ *p++) & 0xff];
    return c;
}

#if defined(__x86_64__)
#include <nmmintrin.h>
__attribute__((target("sse4.2"))) static uint32_t crc_hw(const unsigned char *p, size_t n,
                                                          uint32_t c) {
    uint64_t c64 = c;
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c64 = _mm_crc32_u64(c64, w);
    }
    c = (uint32_t)c64;
    while (n--) c = _mm_crc32_u8(c, *p++);
    return c;
}
#endif

uint32_t fy_crc32c(const void *data, size_t n, uint32_t crc) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, init);
#if defined(__x86_64__)
    if (hw) return ~crc_hw(data, n, ~crc);
#endif
    return ~crc_table(data, n, ~crc);
}
