/* paths_world.h — random trees of files, directories, symbolic and hard links, a command's
 * inputs and outputs drawn into them, and the check of engine/io/paths.h against what
 * writing those outputs really does. Shared by the property test (tests/test_paths.c,
 * a fixed series of seeds) and the fuzz target (fuzz/fuzz_paths.c, libFuzzer's bytes).
 *
 * The oracle is the file system itself, not a second copy of the rules: when fy_paths_check
 * passes, every output is written as ferry writes it (a file beside its path then renamed
 * over it; a stream appended to through its links; a directory replaced whole; a
 * directory's own names, those starting "own", replaced), and afterwards every input must
 * read the bytes it read before, every glob (a pattern in its last component, sometimes
 * in the directory before it too) must match what it matched before, and every output
 * must still hold what it wrote. A check that refuses is not judged (it may be
 * stricter than needed), only that it names both sides in one error line.
 *
 * world_run(root, bytes, n) builds under root (which it empties first) and returns NULL,
 * or a malloc'd description of the violation. */
#ifndef FY_PATHS_WORLD_H
#define FY_PATHS_WORLD_H

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <glob.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/core/status.h"
#include "engine/io/paths.h"

#define W_MAX_ENTRIES 6
#define W_PATH 1024

/* The bytes, read one at a time (zeros past the end). */
typedef struct w_bytes { const uint8_t *p; size_t n, at; } w_bytes;

static unsigned w_next(w_bytes *b) { return b->at < b->n ? b->p[b->at++] : 0; }
static unsigned w_pick(w_bytes *b, unsigned n) { return w_next(b) % n; }

static int w_rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb; (void)flag; (void)ftw;
    return remove(p);
}

static void w_rm_tree(const char *path) {
    struct stat sb;
    if (lstat(path, &sb) != 0) return;
    if (S_ISDIR(sb.st_mode)) nftw(path, w_rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    else unlink(path);
}

static bool w_write_file(const char *path, const char *text, int flags) {
    int fd = open(path, O_WRONLY | O_CLOEXEC | flags, 0644);
    if (fd < 0) return false;
    const size_t n = strlen(text);
    const bool ok = write(fd, text, n) == (ssize_t)n;
    return close(fd) == 0 && ok;
}

/* FNV-1a of the file path reads (following links); 0 and *ok false if it cannot be read. */
static uint64_t w_sum(const char *path, bool *ok) {
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    struct stat sb;
    *ok = false;
    if (fd < 0) return 0;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return 0;
    }
    uint64_t h = 1469598103934665603ull;
    char buf[256];
    for (ssize_t k; (k = read(fd, buf, sizeof buf)) > 0;)
        for (ssize_t i = 0; i < k; i++) h = (h ^ (uint8_t)buf[i]) * 1099511628211ull;
    close(fd);
    *ok = true;
    return h;
}

static const char *const w_names[] = {"d0", "d1", "own0", "f0", "f1", "f2", "own1", "l0", "l1",
                                      "l2", "h0", "new", "x.bin", "y.bin"};
#define W_NNAMES (int)(sizeof w_names / sizeof w_names[0])

/* The tree: d0, d1 and own0 directories (d1 inside d0 sometimes), files with distinct
 * contents, symbolic links (relative or absolute; to files, directories, nothing, or each
 * other) and hard links, each placed in the root or one of the directories. */
static void w_build(const char *root, w_bytes *b) {
    char p[W_PATH], q[W_PATH];
    static const char *const dirs[] = {"d0", "d0/d1", "own0"};
    for (int i = 0; i < 3; i++) {
        snprintf(p, sizeof p, "%s/%s", root, dirs[i]);
        mkdir(p, 0755);
    }
    static const char *const where[] = {"", "d0/", "d0/d1/", "own0/"};
    const int nfiles = 2 + (int)w_pick(b, 5);
    for (int i = 0; i < nfiles; i++) {
        static const char *const fn[] = {"f0", "f1", "f2", "x.bin", "y.bin", "own1"};
        snprintf(p, sizeof p, "%s/%s%s", root, where[w_pick(b, 4)], fn[w_pick(b, 6)]);
        char text[64];
        snprintf(text, sizeof text, "file %d of the world\n", i);
        w_write_file(p, text, O_CREAT | O_TRUNC);
    }
    const int nlinks = (int)w_pick(b, 5);
    for (int i = 0; i < nlinks; i++) {
        static const char *const ln[] = {"l0", "l1", "l2", "own1"};
        snprintf(p, sizeof p, "%s/%s%s", root, where[w_pick(b, 4)], ln[w_pick(b, 4)]);
        const char *to = w_names[w_pick(b, W_NNAMES)];
        const unsigned how = w_pick(b, 4);
        if (how == 0) snprintf(q, sizeof q, "%s", to);                      /* beside it */
        else if (how == 1) snprintf(q, sizeof q, "../%s", to);              /* one up */
        else if (how == 2) snprintf(q, sizeof q, "%s/%s%s", root, where[w_pick(b, 4)], to);
        else snprintf(q, sizeof q, "d0/%s", to);
        symlink(q, p);
    }
    const int nhard = (int)w_pick(b, 3);
    for (int i = 0; i < nhard; i++) {
        snprintf(p, sizeof p, "%s/%s%s", root, where[w_pick(b, 4)], w_names[3 + w_pick(b, 3)]);
        snprintf(q, sizeof q, "%s/%s%s", root, where[w_pick(b, 4)], i ? "h0" : "y.bin");
        link(p, q);
    }
}

/* A path into the tree: one to three components, some "." or "..", relative to the root
 * (the working directory) or absolute, sometimes with a trailing slash. */
static void w_path(const char *root, w_bytes *b, char *out, size_t cap) {
    const int n = 1 + (int)w_pick(b, 3);
    size_t len = 0;
    out[0] = 0;
    if (w_pick(b, 4) == 0) len = (size_t)snprintf(out, cap, "%s/", root);
    for (int i = 0; i < n && len < cap; i++) {
        const unsigned k = w_pick(b, W_NNAMES + 3);
        const char *c = k < (unsigned)W_NNAMES ? w_names[k] : k == (unsigned)W_NNAMES ? "." : k == (unsigned)W_NNAMES + 1 ? ".." : "d0";
        len += (size_t)snprintf(out + len, cap - len, "%s%s", i ? "/" : "", c);
    }
    if (w_pick(b, 8) == 0 && len + 1 < cap) strcat(out, "/");
}

typedef struct w_entry {
    char path[W_PATH];
    int role; /* 0 read, 1 glob, 2 file, 3 stream, 4 dir, 5 dir of own names */
    const char *flag;
    bool had; uint64_t sum; /* read: its bytes before */
    char globbed[4096];     /* glob: its matches before, joined */
    char text[64];          /* outputs: what it wrote */
    bool wrote;
} w_entry;

static bool w_owns(const char *name) { return !strncmp(name, "own", 3); }

/* The matches of pattern, joined by newlines, into out. */
static void w_glob(const char *pattern, char *out, size_t cap) {
    glob_t g;
    out[0] = 0;
    if (glob(pattern, 0, NULL, &g) != 0) return;
    for (size_t i = 0; i < g.gl_pathc; i++) {
        const size_t len = strlen(out);
        snprintf(out + len, cap - len, "%s\n", g.gl_pathv[i]);
    }
    globfree(&g);
}

/* Whether what a write to path touches lies inside root (or is root itself, with
 * root_too): the name with its directory resolved; for a stream (follow) or a directory,
 * the whole path resolved, and nothing a dangling link points to. Paths climb out of the
 * root through "..": the oracle never writes there. */
static bool w_confined(const char *root, const char *path, bool follow, bool root_too) {
    char buf[W_PATH], *real = NULL;
    snprintf(buf, sizeof buf, "%s", path);
    struct stat sb;
    bool ok = false;
    if (follow && lstat(buf, &sb) == 0) {
        real = realpath(buf, NULL); /* NULL: a dangling link, whose end is unknown here */
    } else {
        char *slash = strrchr(buf, '/');
        const char *base = slash ? slash + 1 : buf;
        if (!*base || !strcmp(base, ".") || !strcmp(base, "..")) return false;
        if (slash) *slash = 0;
        char *dir = realpath(slash ? (*buf ? buf : "/") : ".", NULL);
        const size_t len = dir ? strlen(dir) + strlen(base) + 2 : 0;
        if (dir && (real = malloc(len))) snprintf(real, len, "%s/%s", dir, base);
        free(dir);
    }
    if (real) {
        const size_t n = strlen(root);
        ok = !strncmp(real, root, n) && (real[n] == '/' || (root_too && !real[n]));
    }
    free(real);
    return ok;
}

/* Writes output e as ferry would; whether it did (a write ferry's other checks refuse,
 * such as a file over a directory, does nothing). */
static bool w_write(const char *root, w_entry *e) {
    char tmp[W_PATH + 16], p[W_PATH + 300];
    struct stat sb;
    size_t n = strlen(e->path);
    char path[W_PATH];
    snprintf(path, sizeof path, "%s", e->path);
    while (n > 1 && path[n - 1] == '/') path[--n] = 0;
    if (!w_confined(root, path, e->role != 2, e->role == 5)) return false;
    switch (e->role) {
    case 2: /* a file: beside, then renamed over (a link at path is replaced, not followed) */
        if (e->path[strlen(e->path) - 1] == '/' || (stat(path, &sb) == 0 && !S_ISREG(sb.st_mode)))
            return false;
        snprintf(tmp, sizeof tmp, "%s.tmp.w", path);
        return w_write_file(tmp, e->text, O_CREAT | O_EXCL) && rename(tmp, path) == 0;
    case 3: /* a stream: appended through its links */
        if (e->path[strlen(e->path) - 1] == '/' || (stat(path, &sb) == 0 && !S_ISREG(sb.st_mode)))
            return false;
        return w_write_file(path, e->text, O_CREAT | O_APPEND);
    case 4: /* a directory replaced whole (never through a link: ferry refuses one) */
        if (lstat(path, &sb) == 0 && !S_ISDIR(sb.st_mode)) return false;
        w_rm_tree(path);
        if (mkdir(path, 0755) != 0) return false;
        snprintf(p, sizeof p, "%s/written", path);
        return w_write_file(p, e->text, O_CREAT | O_EXCL);
    case 5: { /* a directory whose "own" names are replaced */
        if (stat(path, &sb) != 0 && mkdir(path, 0755) != 0) return false;
        if (stat(path, &sb) != 0 || !S_ISDIR(sb.st_mode)) return false;
        DIR *d = opendir(path);
        for (struct dirent *de; d && (de = readdir(d));) {
            if (!w_owns(de->d_name)) continue;
            snprintf(p, sizeof p, "%s/%s", path, de->d_name);
            w_rm_tree(p);
        }
        if (d) closedir(d);
        snprintf(p, sizeof p, "%s/own-new", path);
        return w_write_file(p, e->text, O_CREAT | O_TRUNC);
    }
    default:
        return false;
    }
}

/* A description of what went wrong (malloc'd), for the caller. */
static char *w_fail(const w_entry *es, int n, bool passed, const char *fmt, const char *what) {
    char *s = malloc(8192);
    if (!s) return NULL;
    int len = snprintf(s, 8192, fmt, what);
    len += snprintf(s + len, 8192 - (size_t)len, " (check %s) in:", passed ? "passed" : "refused");
    static const char *const roles[] = {"read", "glob", "file", "stream", "dir", "dir-names"};
    for (int i = 0; i < n && len < 8000; i++)
        len += snprintf(s + len, 8192 - (size_t)len, " [%s %s %s]", es[i].flag, roles[es[i].role], es[i].path);
    return s;
}

static char *world_run(const char *root, const uint8_t *bytes, size_t nbytes) {
    w_bytes b = {bytes, nbytes, 0};
    w_rm_tree(root);
    if (mkdir(root, 0755) != 0) return strdup("cannot make the world's root");
    char cwd[W_PATH], real_root[W_PATH];
    if (!getcwd(cwd, sizeof cwd) || chdir(root) != 0 || !getcwd(real_root, sizeof real_root))
        return strdup("cannot enter the root");
    w_build(root, &b);
    static const char *const flags[W_MAX_ENTRIES] = {"--a", "--b", "--c", "--d", "--e", "--f"};
    w_entry es[W_MAX_ENTRIES];
    const int n = 2 + (int)w_pick(&b, W_MAX_ENTRIES - 1);
    fy_paths *p = NULL;
    char *bad = NULL;
    if (fy_paths_new(&p) != FY_OK) { bad = strdup("fy_paths_new"); goto done; }
    for (int i = 0; i < n; i++) {
        w_entry *e = &es[i];
        memset(e, 0, sizeof *e);
        e->role = (int)w_pick(&b, 6);
        e->flag = flags[i];
        w_path(root, &b, e->path, sizeof e->path);
        if (e->role == 1) { /* a glob in one directory */
            char pat[W_PATH];
            snprintf(pat, sizeof pat, "%s", e->path);
            char *slash = strrchr(pat, '/');
            snprintf(slash ? slash + 1 : pat, sizeof pat - (size_t)(slash ? slash + 1 - pat : 0), "%s",
                     w_pick(&b, 2) ? "*.bin" : "f?");
            if (slash && w_pick(&b, 3) == 0) { /* the directory before it a pattern too */
                char rest[W_PATH];
                snprintf(rest, sizeof rest, "%s", slash);
                *slash = 0;
                char *up = strrchr(pat, '/');
                snprintf(up ? up + 1 : pat, sizeof pat - (size_t)(up ? up + 1 - pat : 0), "%s%s",
                         w_pick(&b, 2) ? "*" : "d?", rest);
            }
            snprintf(e->path, sizeof e->path, "%s", pat);
        }
        snprintf(e->text, sizeof e->text, "output %d\n", i);
        fy_status st = e->role == 0 ? fy_paths_read(p, e->flag, e->path)
                       : e->role == 1 ? fy_paths_read_glob(p, e->flag, e->path)
                       : fy_paths_write(p, e->flag, e->path,
                                        e->role == 2 ? FY_PATH_FILE : e->role == 3 ? FY_PATH_STREAM
                                        : e->role == 4 ? FY_PATH_DIR : FY_PATH_DIR_NAMES,
                                        "written", e->role == 5 ? w_owns : NULL, false);
        if (st != FY_OK) { bad = strdup("registering failed"); goto done; }
        if (e->role == 0) e->sum = w_sum(e->path, &e->had);
        if (e->role == 1) w_glob(e->path, e->globbed, sizeof e->globbed);
    }
    const unsigned before = fy_log_error_count();
    const fy_status st = fy_paths_check(p);
    if (st != FY_OK) {
        if (st != FY_ERR_USAGE || fy_log_error_count() != before + 1) {
            bad = w_fail(es, n, false, "%s", "a refusal that is not one usage error");
            goto done;
        }
        const char *line = fy_last_error();
        int named = 0;
        for (int i = 0; i < n; i++) named += strstr(line, es[i].flag) != NULL;
        if (named != 2) bad = w_fail(es, n, false, "the error names %s flags, not two", named < 2 ? "fewer" : "more");
        goto done;
    }
    for (int i = 0; i < n; i++)
        if (es[i].role >= 2) es[i].wrote = w_write(real_root, &es[i]);
    for (int i = 0; i < n && !bad; i++) {
        const w_entry *e = &es[i];
        bool ok;
        if (e->role == 0 && e->had && (w_sum(e->path, &ok) != e->sum || !ok))
            bad = w_fail(es, n, true, "input %s changed", e->flag);
        if (e->role == 1) {
            char now[4096];
            w_glob(e->path, now, sizeof now);
            if (strcmp(now, e->globbed)) bad = w_fail(es, n, true, "glob %s matches other files", e->flag);
        }
        if ((e->role == 2 || e->role == 3) && e->wrote) {
            char text[128] = "";
            int fd = open(e->path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
            ssize_t k = fd >= 0 ? read(fd, text, sizeof text - 1) : -1;
            if (fd >= 0) close(fd);
            text[k > 0 ? k : 0] = 0;
            /* a stream appends to what was there: its own line must end the file */
            const size_t tl = strlen(text), el = strlen(e->text);
            const bool mine = e->role == 2 ? !strcmp(text, e->text)
                                           : tl >= el && !strcmp(text + tl - el, e->text);
            if (!mine) bad = w_fail(es, n, true, "output %s was overwritten", e->flag);
        }
    }
done:
    fy_paths_free(p);
    if (chdir(cwd) != 0 && !bad) bad = strdup("cannot leave the root");
    w_rm_tree(root);
    return bad;
}

#endif
