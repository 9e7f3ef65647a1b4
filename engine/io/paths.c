/* paths.c — the inputs and outputs of a command, resolved and checked pairwise (paths.h). */
#include "engine/io/paths.h"

#include <errno.h>
#include <fnmatch.h>
#include <glob.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define CAP (2 * PATH_MAX)
#define MAX_HOPS 40 /* the kernel's limit on links followed in one lookup */

/* A path as a write to it would reach it (malloc'd strings: a glob of ten thousand shards
 * costs their lengths, not ten thousand buffers of PATH_MAX). */
typedef struct where {
    char *name;  /* absolute: its directory resolved, its last component as given */
    char *real;  /* name with the last component's links followed (dangling: their end) */
    bool exists; /* real names a file or directory: dev and ino are its */
    dev_t dev;
    ino_t ino;
} where;

typedef struct entry {
    const char *flag;
    char *given;
    where r;
    bool reads;
    fy_path_write writes;
    const char *what;
    bool (*owns)(const char *name);
    /* a glob (reads): the pattern of the names (glob_base); the directories its
     * directory part names now, resolved (glob_dirs: the one a plain path names, if it
     * exists; every directory a pattern matches); that part made absolute, as given
     * when it is a plain path (glob_at, for one that does not exist yet), else a pattern
     * lexically normalized with the working directory's glob characters escaped
     * (glob_pat, for directories that do not exist yet) */
    bool glob;
    char *glob_base, *glob_at, *glob_pat;
    char **glob_dirs;
    int nglob_dirs;
} entry;

typedef struct allowed { const char *out, *in; } allowed;

struct fy_paths {
    entry *e;
    int n, cap;
    allowed *ok;
    int nok;
};

/* ---- resolving ------------------------------------------------------------------------ */

/* s (absolute) with "." and ".." components and repeated slashes removed, lexically, into
 * out; false if it does not fit. */
static bool normalize(const char *s, char *out, size_t cap) {
    size_t n = 0;
    out[0] = 0;
    for (const char *p = s; *p;) {
        while (*p == '/') p++;
        const char *q = p;
        while (*q && *q != '/') q++;
        const size_t len = (size_t)(q - p);
        if (len == 0 || (len == 1 && p[0] == '.')) {
            /* nothing */
        } else if (len == 2 && p[0] == '.' && p[1] == '.') {
            while (n > 0 && out[n - 1] != '/') n--;
            if (n > 0) n--; /* the slash */
            out[n] = 0;
        } else {
            if (n + 1 + len + 1 > cap) return false;
            out[n++] = '/';
            memcpy(out + n, p, len);
            n += len;
            out[n] = 0;
        }
        p = q;
    }
    if (n == 0) {
        if (cap < 2) return false;
        out[0] = '/';
        out[1] = 0;
    }
    return true;
}

/* path made absolute against the working directory (not normalized: a ".." after a link
 * is the kernel's to resolve), into out. */
static bool absolute(const char *path, char *out, size_t cap) {
    int w;
    if (path[0] == '/') {
        w = snprintf(out, cap, "%s", path);
    } else {
        char cwd[PATH_MAX];
        if (!getcwd(cwd, sizeof cwd)) return false;
        w = snprintf(out, cap, "%s/%s", cwd, path);
    }
    return w >= 0 && (size_t)w < cap;
}

/* abs (absolute) resolved through realpath as far as it exists, the rest appended and
 * normalized lexically (it names nothing yet: a write there makes at most its last
 * component), into out. */
static bool resolve_prefix(const char *abs, char *out, size_t cap) {
    char buf[CAP];
    snprintf(buf, sizeof buf, "%s", abs);
    for (size_t cut = strlen(buf); cut > 0; cut--) {
        if (buf[cut] != '/' && buf[cut] != 0) continue;
        const char saved = buf[cut];
        buf[cut] = 0;
        char *real = realpath(buf, NULL);
        buf[cut] = saved;
        if (!real) continue;
        char joined[CAP];
        const int w = snprintf(joined, sizeof joined, "%s/%s", real, buf + cut);
        free(real);
        return w >= 0 && (size_t)w < sizeof joined && normalize(joined, out, cap);
    }
    return normalize(abs, out, cap);
}

/* The absolute path abs with its directory resolved through realpath and its last
 * component kept (trailing slashes dropped; a last component "." or "..": the directory
 * it names, resolved whole), into out; where the directory does not exist, resolved as
 * far as it does (resolve_prefix). */
static bool name_of(const char *abs, char *out, size_t cap) {
    char buf[CAP];
    snprintf(buf, sizeof buf, "%s", abs);
    size_t n = strlen(buf);
    while (n > 1 && buf[n - 1] == '/') buf[--n] = 0;
    char *slash = strrchr(buf, '/');
    const char *base = slash + 1;
    char *real = NULL;
    int w;
    if (!*base || !strcmp(base, ".") || !strcmp(base, "..")) {
        if ((real = realpath(buf, NULL))) w = snprintf(out, cap, "%s", real);
        else return resolve_prefix(buf, out, cap);
    } else {
        *slash = 0;
        real = realpath(slash == buf ? "/" : buf, NULL);
        if (!real) {
            *slash = '/';
            return resolve_prefix(buf, out, cap);
        }
        w = snprintf(out, cap, "%s/%s", strcmp(real, "/") ? real : "", base);
    }
    free(real);
    return w >= 0 && (size_t)w < cap;
}

static void where_free(where *w) {
    free(w->name);
    free(w->real);
    w->name = w->real = NULL;
}

/* Resolves path (paths.h) into *w: FY_ERR_USAGE if it is too long to, FY_ERR_NOMEM. */
static fy_status resolve(const char *path, where *w) {
    char abs[CAP], name[CAP], real[CAP];
    memset(w, 0, sizeof *w);
    if (!absolute(path, abs, sizeof abs) || !name_of(abs, name, sizeof name)) return FY_ERR_USAGE;
    snprintf(real, sizeof real, "%s", name);
    struct stat sb;
    for (int hop = 0; hop < MAX_HOPS && lstat(real, &sb) == 0 && S_ISLNK(sb.st_mode); hop++) {
        char target[CAP], next[CAP];
        const ssize_t k = readlink(real, target, sizeof target - 1);
        if (k < 0) break;
        target[k] = 0;
        const char *slash = strrchr(real, '/'); /* a relative target is from the link's directory */
        const int n = target[0] == '/' ? snprintf(next, sizeof next, "%s", target)
                      : snprintf(next, sizeof next, "%.*s/%s", (int)(slash - real), real, target);
        if (n < 0 || (size_t)n >= sizeof next || !name_of(next, real, sizeof real)) return FY_ERR_USAGE;
    }
    if (stat(real, &sb) == 0) {
        w->exists = true;
        w->dev = sb.st_dev;
        w->ino = sb.st_ino;
    }
    w->name = strdup(name);
    w->real = strdup(real);
    if (w->name && w->real) return FY_OK;
    where_free(w);
    return FY_ERR_NOMEM;
}

/* ---- registering ---------------------------------------------------------------------- */

fy_status fy_paths_new(fy_paths **out) {
    *out = calloc(1, sizeof **out);
    if (*out) return FY_OK;
    fy_log_error("out of host memory");
    return FY_ERR_NOMEM;
}

void fy_paths_free(fy_paths *p) {
    if (!p) return;
    for (int i = 0; i < p->n; i++) {
        where_free(&p->e[i].r);
        free(p->e[i].given);
        free(p->e[i].glob_base);
        free(p->e[i].glob_at);
        free(p->e[i].glob_pat);
        for (int k = 0; k < p->e[i].nglob_dirs; k++) free(p->e[i].glob_dirs[k]);
        free(p->e[i].glob_dirs);
    }
    free(p->e);
    free(p->ok);
    free(p);
}

static fy_status add(fy_paths *p, const char *flag, const char *path, entry **out) {
    if (p->n == p->cap) {
        const int cap = p->cap ? 2 * p->cap : 16;
        entry *e = realloc(p->e, (size_t)cap * sizeof *e);
        if (!e) {
            fy_log_error("out of host memory");
            return FY_ERR_NOMEM;
        }
        p->e = e;
        p->cap = cap;
    }
    entry *e = &p->e[p->n];
    memset(e, 0, sizeof *e);
    e->flag = flag;
    if (!(e->given = strdup(path))) {
        fy_log_error("out of host memory");
        return FY_ERR_NOMEM;
    }
    const fy_status st = resolve(path, &e->r);
    if (st != FY_OK) {
        free(e->given);
        if (st == FY_ERR_NOMEM) fy_log_error("out of host memory");
        else fy_log_error("%s %s: too long a path", flag, path);
        return st;
    }
    p->n++;
    *out = e;
    return FY_OK;
}

fy_status fy_paths_read(fy_paths *p, const char *flag, const char *path) {
    entry *e;
    FY_TRY(add(p, flag, path, &e));
    e->reads = true;
    return FY_OK;
}

/* s with the characters glob gives a meaning escaped by a backslash, into out. */
static bool escaped(const char *s, char *out, size_t cap) {
    size_t n = 0;
    for (; *s; s++) {
        if (n + 3 > cap) return false;
        if (strchr("*?[\\", *s)) out[n++] = '\\';
        out[n++] = *s;
    }
    out[n] = 0;
    return true;
}

/* Adds the resolved directory dir to glob entry e's. */
static fy_status add_glob_dir(entry *e, const char *dir) {
    char *real = realpath(dir, NULL);
    struct stat sb;
    if (!real || stat(real, &sb) != 0 || !S_ISDIR(sb.st_mode)) {
        free(real);
        return FY_OK; /* gone, or not a directory: nothing there to match */
    }
    char **d = realloc(e->glob_dirs, (size_t)(e->nglob_dirs + 1) * sizeof *d);
    if (!d) {
        free(real);
        return FY_ERR_NOMEM;
    }
    e->glob_dirs = d;
    e->glob_dirs[e->nglob_dirs++] = real;
    return FY_OK;
}

/* Glob entry e's directories and patterns (entry's comment) from the pattern as given. */
static fy_status glob_parts(entry *e, const char *pattern) {
    char dir[CAP], abs[CAP], cwd[PATH_MAX], buf[CAP];
    const char *slash = strrchr(pattern, '/');
    if (!slash) snprintf(dir, sizeof dir, ".");
    else snprintf(dir, sizeof dir, "%.*s", slash == pattern ? 1 : (int)(slash - pattern), pattern);
    if (!(e->glob_base = strdup(slash ? slash + 1 : pattern))) return FY_ERR_NOMEM;
    if (!strpbrk(dir, "*?[")) { /* a plain directory */
        if (!absolute(dir, abs, sizeof abs)) return FY_ERR_USAGE;
        if (!(e->glob_at = strdup(abs))) return FY_ERR_NOMEM;
        return add_glob_dir(e, dir);
    }
    if (dir[0] == '/') {
        snprintf(abs, sizeof abs, "%s", dir);
    } else {
        if (!getcwd(cwd, sizeof cwd) || !escaped(cwd, buf, sizeof buf)) return FY_ERR_USAGE;
        const int w = snprintf(abs, sizeof abs, "%s/%s", buf, dir);
        if (w < 0 || (size_t)w >= sizeof abs) return FY_ERR_USAGE;
    }
    if (!normalize(abs, buf, sizeof buf) || !(e->glob_pat = strdup(buf))) return FY_ERR_USAGE;
    glob_t g;
    const int rc = glob(dir, GLOB_ONLYDIR, NULL, &g);
    fy_status st = rc == GLOB_NOSPACE ? FY_ERR_NOMEM : FY_OK;
    for (size_t i = 0; rc == 0 && i < g.gl_pathc && st == FY_OK; i++) st = add_glob_dir(e, g.gl_pathv[i]);
    if (rc == 0) globfree(&g);
    return st;
}

fy_status fy_paths_read_glob(fy_paths *p, const char *flag, const char *pattern) {
    entry *e;
    FY_TRY(add(p, flag, pattern, &e));
    e->reads = true;
    e->glob = true;
    fy_status st = glob_parts(e, pattern);
    if (st == FY_ERR_USAGE) fy_log_error("%s %s: too long a path", flag, pattern);
    if (st == FY_ERR_NOMEM) fy_log_error("out of host memory expanding %s %s", flag, pattern);
    if (st != FY_OK) return st;
    /* what it matches now (without GLOB_ERR a directory it cannot read matches nothing;
     * the names an output would take are compared all the same) */
    glob_t g;
    const int rc = glob(pattern, 0, NULL, &g);
    if (rc == GLOB_NOSPACE) {
        fy_log_error("out of host memory expanding %s %s", flag, pattern);
        st = FY_ERR_NOMEM;
    }
    for (size_t i = 0; rc == 0 && i < g.gl_pathc && st == FY_OK; i++)
        st = fy_paths_read(p, flag, g.gl_pathv[i]);
    if (rc == 0) globfree(&g);
    return st;
}

fy_status fy_paths_write(fy_paths *p, const char *flag, const char *path, fy_path_write how,
                         const char *what, bool (*owns)(const char *name), bool reads) {
    FY_ASSERT(how != FY_PATH_NONE && (how == FY_PATH_DIR_NAMES) == (owns != NULL),
              "a writer says how it writes, and a directory of names which are its own");
    entry *e;
    FY_TRY(add(p, flag, path, &e));
    e->writes = how;
    e->what = what;
    e->owns = owns;
    e->reads = reads;
    return FY_OK;
}

fy_status fy_paths_allow(fy_paths *p, const char *out, const char *in) {
    allowed *ok = realloc(p->ok, (size_t)(p->nok + 1) * sizeof *ok);
    if (!ok) {
        fy_log_error("out of host memory");
        return FY_ERR_NOMEM;
    }
    p->ok = ok;
    p->ok[p->nok++] = (allowed){out, in};
    return FY_OK;
}

/* ---- comparing ------------------------------------------------------------------------ */

static bool one_file(const where *a, const where *b) {
    return (a->exists && b->exists && a->dev == b->dev && a->ino == b->ino) ||
           !strcmp(a->real, b->real) || !strcmp(a->name, b->name);
}

bool fy_paths_same(const char *a, const char *b) {
    where wa = {0}, wb = {0};
    const bool same = resolve(a, &wa) == FY_OK && resolve(b, &wb) == FY_OK && one_file(&wa, &wb);
    where_free(&wa);
    where_free(&wb);
    return same;
}

/* The rest of path below dir ("" when path is dir), or NULL if it is not below it. */
static const char *below(const char *path, const char *dir) {
    if (!strcmp(dir, "/")) return path + 1;
    const size_t n = strlen(dir);
    if (strncmp(path, dir, n)) return NULL;
    return path[n] == '/' ? path + n + 1 : path[n] ? NULL : path + n;
}

/* Whether directory writer d writes at path: below it (DIR), or below one of the names
 * it owns (DIR_NAMES); with at_too, also at d itself. */
static bool claims(const entry *d, const char *path, bool at_too) {
    if (d->writes != FY_PATH_DIR && d->writes != FY_PATH_DIR_NAMES) return false;
    const char *ds[2] = {d->r.real, d->r.name};
    for (int j = 0; j < 2; j++) {
        const char *rest = below(path, ds[j]);
        if (!rest || (!*rest && !at_too)) continue;
        if (d->writes == FY_PATH_DIR || !*rest) return true;
        char part[NAME_MAX + 1];
        const char *sl = strchr(rest, '/');
        snprintf(part, sizeof part, "%.*s", (int)(sl ? (size_t)(sl - rest) : strlen(rest)), rest);
        if (d->owns(part)) return true;
    }
    return false;
}

/* Whether x lies in what directory writer d writes (claims, by either of x's names). */
static bool inside(const entry *x, const entry *d) {
    return claims(d, x->r.name, false) || claims(d, x->r.real, false);
}

/* Whether output o would be one of the files glob g matches, or (a directory it writes)
 * would change which files those are. */
static bool matches(const entry *o, const entry *g) {
    const bool dir = o->writes == FY_PATH_DIR || o->writes == FY_PATH_DIR_NAMES;
    const char *os[2] = {o->r.name, o->r.real};
    for (int k = 0; k < g->nglob_dirs; k++) { /* the directories it reads now */
        const char *gd = g->glob_dirs[k];
        for (int i = 0; i < 2; i++) {
            const char *slash = strrchr(os[i], '/');
            const size_t dn = slash == os[i] ? 1 : (size_t)(slash - os[i]);
            if (strlen(gd) == dn && !strncmp(os[i], gd, dn) && fnmatch(g->glob_base, slash + 1, FNM_PERIOD) == 0)
                return true;
        }
        if (dir && claims(o, gd, true)) return true; /* it is written over */
    }
    char pat[CAP];
    if (g->glob_pat) { /* directories a pattern would match once made: its names, its levels */
        snprintf(pat, sizeof pat, "%s/%s", strcmp(g->glob_pat, "/") ? g->glob_pat : "", g->glob_base);
        for (int i = 0; i < 2; i++) {
            if (fnmatch(pat, os[i], FNM_PATHNAME | FNM_PERIOD) == 0) return true;
            for (char *c = pat; dir && (c = strchr(c + 1, '/'));) {
                *c = 0;
                const bool level = fnmatch(pat, os[i], FNM_PATHNAME | FNM_PERIOD) == 0;
                *c = '/';
                if (level) return true;
            }
        }
        return false;
    }
    /* a plain directory that does not exist yet: a directory output on its way makes it */
    if (!dir || g->nglob_dirs) return false;
    snprintf(pat, sizeof pat, "%s/", g->glob_at);
    for (char *c = pat; (c = strchr(c + 1, '/'));) {
        *c = 0;
        where r;
        const bool on_way = resolve(pat, &r) == FY_OK &&
                            (!strcmp(r.name, o->r.name) || !strcmp(r.real, o->r.real));
        where_free(&r);
        *c = '/';
        if (on_way) return true;
    }
    return false;
}

/* Whether x is named as one of the temporaries file writer o makes beside its path
 * (<name>.tmp.<digits>: a save removes one whose writer is gone). */
static bool temporary_of(const entry *x, const entry *o) {
    if (o->writes != FY_PATH_FILE) return false;
    const char *slash = strrchr(o->r.name, '/');
    const size_t dn = (size_t)(slash - o->r.name), bn = strlen(slash + 1);
    const char *xs[2] = {x->r.name, x->r.real};
    for (int i = 0; i < 2; i++) {
        const char *p = xs[i];
        if (strncmp(p, o->r.name, dn + 1 + bn) || strncmp(p + dn + 1 + bn, ".tmp.", 5)) continue;
        const char *d = p + dn + 1 + bn + 5;
        if (!*d) continue;
        while (*d >= '0' && *d <= '9') d++;
        if (!*d) return true;
    }
    return false;
}

/* How two paths that are one file are so, for the message. */
static const char *how_one(const entry *a, const entry *b) {
    if (strcmp(a->r.real, b->r.real)) return " (hard links)";
    if (strcmp(a->r.name, a->r.real) || strcmp(b->r.name, b->r.real))
        return " (through a symbolic link)";
    return "";
}

static bool is_allowed(const fy_paths *p, const entry *out, const entry *in) {
    for (int i = 0; i < p->nok; i++)
        if (!strcmp(p->ok[i].out, out->flag) && !strcmp(p->ok[i].in, in->flag)) return true;
    return false;
}

/* The flag a message asks to change: the writer's, unless the writer is no flag of the
 * user's (a cache) and the reader is. */
static const char *to_change(const entry *o, const entry *i) {
    return strncmp(o->flag, "--", 2) && !strncmp(i->flag, "--", 2) ? i->flag : o->flag;
}

/* Writer o against reader i: whether they collide (logged). */
static bool lands_on_input(const entry *o, const entry *i) {
    if (i->glob) {
        if (!matches(o, i)) return false;
        fy_log_error("%s %s would %s %s %s matches: ferry never writes over what it reads; give "
                     "%s another path", o->flag, o->given, o->writes == FY_PATH_DIR ||
                     o->writes == FY_PATH_DIR_NAMES ? "change the files" : "be one of the files",
                     i->flag, i->given, to_change(o, i));
        return true;
    }
    if (one_file(&o->r, &i->r)) {
        fy_log_error("%s %s and %s %s are one file%s: ferry never writes over what it reads; "
                     "give %s another path", o->flag, o->given, i->flag, i->given, how_one(o, i),
                     to_change(o, i));
        return true;
    }
    if (inside(i, o)) {
        fy_log_error("%s %s is inside %s %s, %s: ferry never writes over what it reads; give %s "
                     "another path", i->flag, i->given, o->flag, o->given, o->what, to_change(o, i));
        return true;
    }
    if (temporary_of(i, o)) {
        fy_log_error("%s %s is named as a temporary of %s %s (written beside it, then renamed; "
                     "a later save removes one whose writer is gone): ferry never writes over "
                     "what it reads; give %s another path", i->flag, i->given, o->flag, o->given,
                     to_change(o, i));
        return true;
    }
    return false;
}

/* Writers a and b: whether they collide (logged). */
static bool outputs_meet(const entry *a, const entry *b) {
    if (one_file(&a->r, &b->r)) {
        fy_log_error("%s %s and %s %s are one path%s: each output needs a path of its own",
                     a->flag, a->given, b->flag, b->given, how_one(a, b));
        return true;
    }
    if (temporary_of(a, b) || temporary_of(b, a)) {
        fy_log_error("%s %s and %s %s: one is named as the other's temporary (written beside "
                     "it, then renamed): each output needs a path of its own", a->flag, a->given,
                     b->flag, b->given);
        return true;
    }
    const entry *x = a, *d = b;
    if (!inside(x, d)) {
        x = b;
        d = a;
        if (!inside(x, d)) return false;
    }
    fy_log_error("%s %s is inside %s %s, %s: each output needs a path of its own", x->flag,
                 x->given, d->flag, d->given, d->what);
    return true;
}

fy_status fy_paths_check(const fy_paths *p) {
    for (int a = 0; a < p->n; a++) { /* writers against everything: O(writers x entries) */
        const entry *ea = &p->e[a];
        if (!ea->writes) continue;
        for (int b = 0; b < p->n; b++) {
            const entry *eb = &p->e[b];
            if (a == b || !strcmp(ea->flag, eb->flag)) continue;
            if (ea->writes && eb->reads && !is_allowed(p, ea, eb) && lands_on_input(ea, eb))
                return FY_ERR_USAGE;
            if (b > a && ea->writes && eb->writes && outputs_meet(ea, eb)) return FY_ERR_USAGE;
        }
    }
    return FY_OK;
}
