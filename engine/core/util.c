/* util.c — strict number and size parsing, clocks. */
#include "engine/core/util.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <sched.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

/* Decimal only: strtod also reads hexadecimal ("0x10", "0x1p4"), which no flag means. */
static bool decimal(const char *s) { return !strpbrk(s, "xX"); }

int fy_parse_i64(const char *s, int64_t *out) {
    if (!s || !*s || isspace((unsigned char)*s)) return -1;
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || *end) return -1;
    *out = v;
    return 0;
}

int fy_parse_f64(const char *s, double *out) {
    if (!s || !*s || isspace((unsigned char)*s) || !decimal(s)) return -1;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || *end || !isfinite(v)) return -1;
    *out = v;
    return 0;
}

int fy_parse_size(const char *s, size_t *out) {
    if (!s || !*s || isspace((unsigned char)*s) || *s == '-' || !decimal(s)) return -1;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || !isfinite(v) || v < 0) return -1;
    static const struct { const char *unit; double mul; } units[] = {
        {"", 1}, {"B", 1},
        {"K", 1024.0}, {"KiB", 1024.0}, {"KB", 1e3},
        {"M", 1048576.0}, {"MiB", 1048576.0}, {"MB", 1e6},
        {"G", 1073741824.0}, {"GiB", 1073741824.0}, {"GB", 1e9},
        {"T", 1099511627776.0}, {"TiB", 1099511627776.0}, {"TB", 1e12},
    };
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
        if (strcasecmp(end, units[i].unit) == 0) {
            double b = v * units[i].mul;
            if (b > 9.0e18) return -1;
            *out = (size_t)llround(b);
            return 0;
        }
    }
    return -1;
}

const char *fy_fmt_size(size_t n, char *buf, size_t cap) {
    static const char *u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)n;
    int i = 0;
    while (v >= 1024.0 && i < 4) { v /= 1024.0; i++; }
    if (i == 0) snprintf(buf, cap, "%zu B", n);
    else snprintf(buf, cap, "%.2f %s", v, u[i]);
    return buf;
}

int fy_cpus_allowed(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
    const long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

double fy_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

int fy_open_read(const char *path) {
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return -1;
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0) fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    return fd;
}

bool fy_left_by_dead_writer(const char *name, const char *base, const char *tag) {
    const size_t nb = strlen(base), nt = strlen(tag);
    if (strncmp(name, base, nb) || strncmp(name + nb, tag, nt)) return false;
    const char *digits = name + nb + nt;
    char *end;
    const long pid = strtol(digits, &end, 10);
    if (end == digits || *end || pid <= 0) return false;
    return pid == (long)getpid() || (kill((pid_t)pid, 0) != 0 && errno == ESRCH);
}

int fy_open_tmp(const char *path, char *tmp, size_t cap) {
    if ((size_t)snprintf(tmp, cap, "%s.tmp.%ld", path, (long)getpid()) >= cap) {
        errno = ENAMETOOLONG;
        return -1;
    }
    unlink(tmp);
    return open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
}

fy_status fy_check_output(const char *path, const char *what, bool stream) {
    struct stat sb;
    const size_t n = strlen(path);
    if (!n || path[n - 1] == '/') {
        fy_log_error("%s %s: names a directory, not a file", what, path);
        return FY_ERR_IO;
    }
    const bool exists = stat(path, &sb) == 0;
    if (exists) {
        const bool ok_kind = S_ISREG(sb.st_mode) || (stream && (S_ISCHR(sb.st_mode) || S_ISFIFO(sb.st_mode)));
        if (!ok_kind) {
            fy_log_error("%s %s: exists and is not a regular file", what, path);
            return FY_ERR_IO;
        }
        /* a stream is appended to in place; a file is written beside it and renamed over
         * it, which needs its directory */
        if (stream) {
            if (access(path, W_OK) == 0) return FY_OK;
            fy_log_error("%s %s: cannot be written: %s", what, path, strerror(errno));
            return FY_ERR_IO;
        }
    }
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", path);
    const char *d = dirname(dir);
    if (stat(d, &sb) != 0 || !S_ISDIR(sb.st_mode)) {
        fy_log_error("%s %s: the directory %s does not exist", what, path, d);
        return FY_ERR_IO;
    }
    if (access(d, W_OK | X_OK) != 0) {
        fy_log_error("%s %s: the directory %s cannot be written: %s", what, path, d, strerror(errno));
        return FY_ERR_IO;
    }
    return FY_OK;
}

fy_status fy_fsync_dir(const char *path) {
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0 || fsync(fd) != 0) {
        fy_log_error("cannot fsync directory %s: %s", path, strerror(errno));
        if (fd >= 0) close(fd);
        return FY_ERR_IO;
    }
    close(fd);
    return FY_OK;
}
