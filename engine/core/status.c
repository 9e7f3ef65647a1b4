/* status.c — status strings, the one-line logger and the abort path. */
#include "engine/core/status.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static fy_log_level g_level = FY_LOG_INFO;
static _Thread_local char t_last_error[1024];
static _Thread_local const char *t_context;
static _Thread_local unsigned t_errors;
static char g_rank[24]; /* "rank 3: " in a job of several processes, else empty */

const char *fy_status_str(fy_status s) {
    switch (s) {
    case FY_OK: return "ok";
    case FY_ERR_NOMEM: return "out of host memory";
    case FY_ERR_DEVICE_OOM: return "out of device memory";
    case FY_ERR_IO: return "i/o error";
    case FY_ERR_FORMAT: return "bad file format";
    case FY_ERR_INVALID: return "invalid argument";
    case FY_ERR_UNSUPPORTED: return "unsupported";
    case FY_ERR_NONFINITE: return "non-finite value";
    case FY_ERR_DEVICE: return "device error";
    case FY_ERR_USAGE: return "command-line error";
    case FY_INTERRUPTED: return "interrupted";
    }
    return "unknown status";
}

void fy_log_set_level(fy_log_level level) { g_level = level; }
fy_log_level fy_log_get_level(void) { return g_level; }

/* Control characters in s (a newline or a terminal escape from a file's tensor name, a
 * dtype string, a path) written as \n, \t, \xNN or, for UTF-8's C1 controls, \u00NN, in
 * place (truncated to cap): a message stays one line and cannot drive the terminal. */
static void escape_controls(char *s, size_t cap) {
    char out[1024];
    size_t o = 0;
    for (const unsigned char *p = (const unsigned char *)s; *p && o + 7 < sizeof out; p++) {
        if (p[0] == 0xc2 && p[1] >= 0x80 && p[1] <= 0x9f) { /* a C1 control in UTF-8 */
            o += (size_t)snprintf(out + o, sizeof out - o, "\\u%04x", p[1]);
            p++;
            continue;
        }
        if (*p >= 0x20 && *p != 0x7f) { out[o++] = (char)*p; continue; }
        o += (size_t)snprintf(out + o, sizeof out - o, *p == '\n' ? "\\n" : *p == '\t' ? "\\t" : "\\x%02x", *p);
    }
    out[o] = 0;
    snprintf(s, cap, "%s", out);
}

void fy_log(fy_log_level level, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    escape_controls(msg, sizeof msg);
    if (level == FY_LOG_ERROR && t_context) {
        char tmp[sizeof msg];
        snprintf(tmp, sizeof tmp, "%.200s: %.800s", t_context, msg);
        memcpy(msg, tmp, sizeof msg);
    }
    if (level == FY_LOG_ERROR) {
        snprintf(t_last_error, sizeof t_last_error, "%s", msg);
        t_errors++;
    }
    if (level < g_level) return;
    static const char *tags[] = {"debug: ", "", "warning: ", "error: "};
    /* one fprintf per line so concurrent threads do not interleave within a line */
    fprintf(stderr, "ferry: %s%s%s\n", tags[level < FY_LOG_QUIET ? level : 0], g_rank, msg);
}

const char *fy_last_error(void) { return t_last_error; }
void fy_log_set_context(const char *ctx) { t_context = ctx; }

void fy_log_set_rank(int rank) {
    if (rank < 0) g_rank[0] = '\0';
    else snprintf(g_rank, sizeof g_rank, "rank %d: ", rank);
}
unsigned fy_log_error_count(void) { return t_errors; }

void fy_abort_at(const char *file, int line, const char *cond, const char *hint) {
    fprintf(stderr, "ferry: internal error at %s:%d: %s (%s)\n", file, line, cond,
            hint ? hint : "this is a bug; please report it");
    fflush(stderr);
    abort();
}
