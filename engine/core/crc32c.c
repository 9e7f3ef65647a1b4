/* crc32c.c — CRC-32C by table (eight tables, a word at a time) or by SSE4.2's crc32,
 * chosen at run time.
 *
 * The crc32 instruction takes 3 cycles and issues one a cycle, so one dependent chain runs
 * at a third of its speed: the hardware path runs three chains over three adjacent
 * stretches of a block and joins them. The CRC register after a stretch of n zero bytes is
 * a linear function of the register before, applied by four 256-entry tables (zeros_op:
 * what each byte of the register becomes); a block of three stretches A B C gives
 * crc(ABC) = shift(shift(crc(A)) ^ crc(B)) ^ crc(C) with crc(B) and crc(C) started from 0.
 * Long stretches (LONG bytes) serve large buffers, short ones (SHORT) what is left of them,
 * then one chain finishes. Both paths give the same value (tests compare them on random
 * data of every length and alignment). */
#include "engine/core/crc32c.h"

#include <pthread.h>
#include <stdbool.h>
#include <string.h>

#define POLY 0x82F63B78u /* Castagnoli, reflected */
#define LONG 8192        /* bytes a chain covers in a block of three: large buffers */
#define SHORT 256        /* and what is left of them */

static uint32_t tab[8][256];
static uint32_t zeros_long[4][256], zeros_short[4][256];
static bool hw; /* the CPU has SSE4.2's crc32 */

/* The register after n zero bytes, from register c (the raw register: no inversion). */
static uint32_t after_zeros(uint32_t c, size_t n) {
    while (n--) c = (c >> 8) ^ tab[0][c & 0xff];
    return c;
}

/* zeros[k][b]: the register after n zero bytes from the register (b << 8k); the register
 * after them from any c is then the XOR over c's four bytes (linearity). */
static void zeros_op(uint32_t zeros[4][256], size_t n) {
    uint32_t bit[32];
    for (int i = 0; i < 32; i++) bit[i] = after_zeros(1u << i, n);
    for (int k = 0; k < 4; k++)
        for (uint32_t b = 0; b < 256; b++) {
            uint32_t v = 0;
            for (int i = 0; i < 8; i++)
                if (b >> i & 1) v ^= bit[8 * k + i];
            zeros[k][b] = v;
        }
}

static inline uint32_t shift(uint32_t zeros[4][256], uint32_t c) {
    return zeros[0][c & 0xff] ^ zeros[1][(c >> 8) & 0xff] ^ zeros[2][(c >> 16) & 0xff] ^
           zeros[3][c >> 24];
}

static void init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
        tab[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++) tab[t][i] = (tab[t - 1][i] >> 8) ^ tab[0][tab[t - 1][i] & 0xff];
    zeros_op(zeros_long, LONG);
    zeros_op(zeros_short, SHORT);
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

static inline uint64_t load64(const unsigned char *p) {
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}

/* Blocks of three stretches of len bytes (a multiple of 8) from *p while they last,
 * three chains in flight; zeros shifts a register over len bytes. */
__attribute__((target("sse4.2"))) static uint32_t crc_hw_3way(const unsigned char **p, size_t *n,
                                                              uint32_t c, size_t len,
                                                              uint32_t zeros[4][256]) {
    const unsigned char *q = *p;
    uint64_t c0 = c;
    for (; *n >= 3 * len; q += 3 * len, *n -= 3 * len) {
        uint64_t c1 = 0, c2 = 0;
        for (size_t i = 0; i < len; i += 8) {
            c0 = _mm_crc32_u64(c0, load64(q + i));
            c1 = _mm_crc32_u64(c1, load64(q + len + i));
            c2 = _mm_crc32_u64(c2, load64(q + 2 * len + i));
        }
        c0 = shift(zeros, (uint32_t)c0) ^ (uint32_t)c1;
        c0 = shift(zeros, (uint32_t)c0) ^ (uint32_t)c2;
    }
    *p = q;
    return (uint32_t)c0;
}

__attribute__((target("sse4.2"))) static uint32_t crc_hw(const unsigned char *p, size_t n,
                                                          uint32_t c) {
    for (; n && ((uintptr_t)p & 7); n--) c = _mm_crc32_u8(c, *p++); /* aligned loads below */
    c = crc_hw_3way(&p, &n, c, LONG, zeros_long);
    c = crc_hw_3way(&p, &n, c, SHORT, zeros_short);
    uint64_t c64 = c;
    for (; n >= 8; p += 8, n -= 8) c64 = _mm_crc32_u64(c64, load64(p));
    c = (uint32_t)c64;
    while (n--) c = _mm_crc32_u8(c, *p++);
    return c;
}
#endif

static pthread_once_t once = PTHREAD_ONCE_INIT;

uint32_t fy_crc32c(const void *data, size_t n, uint32_t crc) {
    pthread_once(&once, init);
#if defined(__x86_64__)
    if (hw) return ~crc_hw(data, n, ~crc);
#endif
    return ~crc_table(data, n, ~crc);
}

uint32_t fy_crc32c_portable(const void *data, size_t n, uint32_t crc) {
    pthread_once(&once, init);
    return ~crc_table(data, n, ~crc);
}
