/* test_core.c — engine/core: CRC-32C's paths (the hardware one, three chains joined,
 * against the tables, which are the reference) on known values and random data. */
#include <criterion/criterion.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/crc32c.h"
#include "tests/test_util.h"

/* The check value of the CRC-32C catalogue entry and the iSCSI test vectors of RFC 3720
 * (B.4), on both paths. */
Test(crc32c, known_values_on_both_paths) {
    uint32_t (*const fn[2])(const void *, size_t, uint32_t) = {fy_crc32c, fy_crc32c_portable};
    for (int k = 0; k < 2; k++) {
        uint8_t b[32];
        cr_expect_eq(fn[k]("123456789", 9, 0), 0xE3069283u, "path %d", k);
        memset(b, 0, 32);
        cr_expect_eq(fn[k](b, 32, 0), 0x8A9136AAu, "path %d", k);
        memset(b, 0xff, 32);
        cr_expect_eq(fn[k](b, 32, 0), 0x62A8AB43u, "path %d", k);
        for (int i = 0; i < 32; i++) b[i] = (uint8_t)i;
        cr_expect_eq(fn[k](b, 32, 0), 0x46DD794Eu, "path %d", k);
        for (int i = 0; i < 32; i++) b[i] = (uint8_t)(31 - i);
        cr_expect_eq(fn[k](b, 32, 0), 0x113FDB5Cu, "path %d", k);
        cr_expect_eq(fn[k](b, 0, 0), 0u, "path %d", k);
        cr_expect_eq(fn[k](b, 0, 0x12345678u), 0x12345678u, "path %d: nothing to add", k);
    }
}

static uint64_t g_rng = 0x9E3779B97F4A7C15u;
static uint64_t next(void) { return test_xorshift64(&g_rng); }

/* Random data at every alignment and at lengths around the paths' seams (the blocks of
 * three 8192- and 256-byte stretches, the 8-byte words, the byte tail), continued from
 * random CRCs: the hardware path gives the table's value every time. */
Test(crc32c, hardware_path_equals_the_tables) {
    const size_t cap = 3 * 8192 * 3 + 64;
    uint8_t *buf = malloc(cap);
    cr_assert_not_null(buf);
    for (size_t i = 0; i < cap; i++) buf[i] = (uint8_t)next();
    const size_t seams[] = {0, 1, 7, 8, 9, 255, 256, 257, 767, 768, 769, 775, 1000, 8191,
                            8192, 24575, 24576, 24577, 24576 + 768 + 13, 2 * 24576 + 5,
                            3 * 24576 + 7};
    for (size_t s = 0; s < sizeof seams / sizeof seams[0]; s++)
        for (size_t off = 0; off < 16; off++) {
            const size_t n = seams[s];
            cr_assert_leq(off + n, cap);
            const uint32_t from = off & 1 ? (uint32_t)next() : 0;
            const uint32_t a = fy_crc32c(buf + off, n, from), b = fy_crc32c_portable(buf + off, n, from);
            cr_assert_eq(a, b, "length %zu at offset %zu from %08x: %08x, tables %08x", n, off,
                         from, a, b);
        }
    for (int r = 0; r < 2000; r++) { /* odd lengths and alignments at random */
        const size_t off = next() % 64, n = next() % (cap - 64);
        cr_assert_eq(fy_crc32c(buf + off, n, 0), fy_crc32c_portable(buf + off, n, 0),
                     "length %zu at offset %zu", n, off);
    }
    free(buf);
}

/* A CRC taken in pieces (each continued from the last) is the CRC of the whole, at every
 * split of a buffer long enough for the three-chain blocks. */
Test(crc32c, pieces_continue_to_the_whole) {
    const size_t n = 3 * 8192 + 3 * 256 + 21;
    uint8_t *b = malloc(n);
    cr_assert_not_null(b);
    for (size_t i = 0; i < n; i++) b[i] = (uint8_t)(i * 37 + 11);
    const uint32_t whole = fy_crc32c_portable(b, n, 0);
    for (size_t cut = 0; cut <= n; cut += cut < 300 ? 1 : 97)
        cr_assert_eq(fy_crc32c(b + cut, n - cut, fy_crc32c(b, cut, 0)), whole, "split at %zu", cut);
    free(b);
}
