/* status.c — status strings, the one-line logger and the abort path. */
#include "engine/core/status.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static fy_log_level g_level = FY_LOG_INFO;
static _Thread_local char t_last_error[1024];
static _Thread_local const char *t_context;
static _Thread_local unsigned t_errors;

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
    }
    return "unknown status";
}

void fy_log_set_level(fy_log_level level) { g_level = level; }
fy_log_level fy_log_get_level(void) { return g_level; }

void fy_log(fy_log_level level, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
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
    fprintf(stderr, "ferry: %s%s\n", tags[level < FY_LOG_QUIET ? level : 0], msg);
}

const char *fy_last_error(void) { return t_last_error; }
void fy_log_set_context(const char *ctx) { t_context = ctx; }
unsigned fy_log_error_count(void) { return t_errors; }

void fy_abort_at(const char *file, int line, const char *cond, const char *hint) {
    fprintf(stderr, "ferry: internal error at %s:%d: %s (%s)\n", file, line, cond,
            hint ? hint : "this is a bug; please report it");
    fflush(stderr);
    abort();
}
