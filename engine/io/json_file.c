/* json_file.c — whole-file JSON reading and atomic writing. */
#include "engine/io/json_file.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/core/util.h"

/* path's text (malloc'd, NUL-terminated, n bytes); on failure the reason in *why (a
 * string with the status) and nothing logged. */
static fy_status read_text(const char *path, char **text, size_t *nbytes, const char **why) {
    *text = NULL;
    int fd = fy_open_read(path);
    struct stat sb;
    if (fd < 0 || fstat(fd, &sb) != 0) {
        if (fd >= 0) close(fd);
        *why = "cannot open";
        return FY_ERR_IO;
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        *why = "not a regular file";
        return FY_ERR_IO;
    }
    FILE *f = fdopen(fd, "rb");
    if (!f) {
        close(fd);
        *why = "cannot open";
        return FY_ERR_IO;
    }
    char *t = malloc(FY_JSON_MAX_BYTES + 1);
    size_t n = t ? fread(t, 1, FY_JSON_MAX_BYTES + 1, f) : 0;
    fclose(f);
    if (!t) {
        *why = "out of memory";
        return FY_ERR_NOMEM;
    }
    if (n > FY_JSON_MAX_BYTES) {
        free(t);
        *why = "too large";
        return FY_ERR_FORMAT;
    }
    t[n] = 0;
    *text = t;
    *nbytes = n;
    return FY_OK;
}

fy_status fy_json_read_text(const char *path, const char *what, char **text, size_t *nbytes) {
    const char *why = "";
    const fy_status st = read_text(path, text, nbytes, &why);
    if (st == FY_ERR_IO && !strcmp(why, "cannot open")) fy_log_error("cannot open %s %s", what, path);
    else if (st == FY_ERR_FORMAT) fy_log_error("%s %s: larger than %u bytes", what, path, FY_JSON_MAX_BYTES);
    else if (st == FY_ERR_IO) fy_log_error("%s %s: %s", what, path, why);
    return st;
}

cJSON *fy_json_try_read(const char *path) {
    char *text;
    size_t n;
    const char *why;
    if (read_text(path, &text, &n, &why) != FY_OK) return NULL;
    cJSON *root = cJSON_ParseWithLength(text, n);
    free(text);
    return root;
}

typedef struct keyed { const char *key; int at; } keyed;

static int cmp_keyed(const void *a, const void *b) {
    const keyed *x = a, *y = b;
    const int c = strcmp(x->key, y->key);
    return c ? c : (x->at > y->at) - (x->at < y->at);
}

/* Appends ".key" (or "key" at the top) or "[i]" to where[0..len) as far as it fits. */
static size_t extend(char *where, size_t cap, size_t len, const cJSON *parent, const cJSON *item,
                     int i) {
    if (len >= cap) return len;
    const int w = cJSON_IsObject(parent) ? snprintf(where + len, cap - len, "%s%s", len ? "." : "", item->string)
                                         : snprintf(where + len, cap - len, "[%d]", i);
    return w < 0 ? len : len + (size_t)w < cap ? len + (size_t)w : cap - 1;
}

/* The index among node's children of the first key, in document order, that repeats an
 * earlier key of node; -1 if none (or not an object). Sorting: O(n log n) for n keys
 * (O(n^2) without the memory to sort). */
static int repeated(const cJSON *node) {
    int n = 0;
    for (const cJSON *c = node->child; c; c = c->next) n++;
    if (!cJSON_IsObject(node) || n < 2) return -1;
    keyed *k = malloc((size_t)n * sizeof *k);
    int i = 0, at = -1;
    if (!k) { /* no memory to sort: pair by pair, with none to spare */
        for (const cJSON *c = node->child; c && at < 0; c = c->next, i++)
            for (const cJSON *b = node->child; b != c; b = b->next)
                if (!strcmp(b->string ? b->string : "", c->string ? c->string : "")) { at = i; break; }
        return at;
    }
    for (const cJSON *c = node->child; c; c = c->next, i++) k[i] = (keyed){c->string ? c->string : "", i};
    qsort(k, (size_t)n, sizeof *k, cmp_keyed);
    for (i = 1; i < n; i++)
        if (!strcmp(k[i].key, k[i - 1].key) && (at < 0 || k[i].at < at)) at = k[i].at;
    free(k);
    return at;
}

/* The first repeated key under node in document order (where[0..len) names node): its
 * path into where; false if none. */
static bool first_dup(const cJSON *node, char *where, size_t cap, size_t len) {
    const int at = repeated(node);
    int i = 0;
    for (const cJSON *c = node->child; c; c = c->next, i++) {
        const size_t l = extend(where, cap, len, node, c, i);
        if (i == at) return true;
        if ((cJSON_IsObject(c) || cJSON_IsArray(c)) && first_dup(c, where, cap, l)) return true;
        where[len] = 0;
    }
    return false;
}

bool fy_json_duplicate(const cJSON *root, char *where, size_t cap) {
    if (!root || cap == 0) return false;
    where[0] = 0;
    return first_dup(root, where, cap, 0);
}

fy_status fy_json_read(const char *path, const char *what, cJSON **out) {
    *out = NULL;
    char *text;
    size_t n;
    FY_TRY(fy_json_read_text(path, what, &text, &n));
    (void)n;
    *out = cJSON_Parse(text);
    free(text);
    if (!*out) {
        fy_log_error("%s %s: not JSON", what, path);
        return FY_ERR_FORMAT;
    }
    char where[256];
    if (fy_json_duplicate(*out, where, sizeof where)) {
        fy_log_error("%s %s: key \"%s\" appears twice; JSON readers disagree on which one counts "
                     "(Python's json, and so transformers, takes the last): keep one", what, path, where);
        cJSON_Delete(*out);
        *out = NULL;
        return FY_ERR_FORMAT;
    }
    return FY_OK;
}

fy_status fy_json_write(const char *path, const char *what, const cJSON *root) {
    char *text = cJSON_Print(root);
    if (!text) return FY_ERR_NOMEM;
    char tmp[4096];
    int fd = fy_open_tmp(path, tmp, sizeof tmp);
    FILE *f = fd >= 0 ? fdopen(fd, "wb") : NULL;
    if (fd >= 0 && !f) close(fd);
    fy_status st = FY_OK;
    if (!f || fputs(text, f) < 0 || fputc('\n', f) < 0 || fflush(f) != 0 || fsync(fileno(f)) != 0)
        st = FY_ERR_IO;
    if (f && fclose(f) != 0) st = FY_ERR_IO;
    if (st == FY_OK && rename(tmp, path) != 0) st = FY_ERR_IO;
    if (st != FY_OK) {
        remove(tmp);
        fy_log_error("cannot write %s %s", what, path);
    }
    free(text);
    return st;
}
