/* test_util.h — helpers several test files share (each test file is its own program, so
 * these are static; include after <criterion/criterion.h>). */
#ifndef FY_TEST_UTIL_H
#define FY_TEST_UTIL_H

#include <stdio.h>
#include <stdlib.h>

#include "engine/io/corpus.h"
#include "engine/io/tokens.h"

/* A whole file, NUL-terminated, in a malloc'd buffer (n, if not NULL, gets its size);
 * the calling test fails if it cannot be read. */
static inline char *test_read_file(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)sz + 1);
    cr_assert_not_null(b);
    cr_assert_eq(fread(b, 1, (size_t)sz, f), (size_t)sz, "cannot read %s", path);
    b[sz] = 0;
    fclose(f);
    if (n) *n = (size_t)sz;
    return b;
}

/* 64 KiB of the generated corpus as byte tokens: the training data of the plan tests. */
static inline fy_tokens *test_corpus(void) {
    uint8_t *text;
    cr_assert_eq(fy_corpus_generate(64 << 10, 3, &text), FY_OK);
    fy_tokens *t;
    cr_assert_eq(fy_tokens_from_bytes(text, 64 << 10, "test corpus", &t), FY_OK);
    free(text);
    return t;
}

#endif
