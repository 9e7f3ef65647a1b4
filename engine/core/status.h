/* status.h — status codes, logging and the abort path shared by every module.
 *
 * Functions that can fail because of the world (memory, device OOM, I/O, bad input)
 * return fy_status and log the detail once, where it is known, through fy_log_error().
 * Bugs and broken invariants abort through FY_ASSERT, which prints file, line and a hint.
 * Only main() exits.
 *
 * Logging is thread-safe (one line is written with one call). */
#ifndef FY_STATUS_H
#define FY_STATUS_H

#include <stdarg.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum fy_status {
    FY_OK = 0,
    FY_ERR_NOMEM,      /* host allocation failed */
    FY_ERR_DEVICE_OOM, /* device memory budget or physical memory exhausted */
    FY_ERR_IO,         /* open/read/write/fsync failed */
    FY_ERR_FORMAT,     /* a file is malformed, truncated or of the wrong kind */
    FY_ERR_INVALID,    /* a flag, a shape or an argument is out of range */
    FY_ERR_UNSUPPORTED,/* asked for something this build or device cannot do */
    FY_ERR_NONFINITE,  /* NaN or Inf met where a finite value is needed */
    FY_ERR_DEVICE,     /* a device call failed */
    FY_ERR_USAGE,      /* the command line is wrong in a way found after parsing it (the
                          CLI exits 2, as for a parse error) */
    FY_INTERRUPTED,    /* stopped on request (a signal) at a clean point: not an error,
                          nothing is logged for it */
} fy_status;

const char *fy_status_str(fy_status s);

typedef enum fy_log_level {
    FY_LOG_DEBUG = 0,
    FY_LOG_INFO,
    FY_LOG_WARN,
    FY_LOG_ERROR,
    FY_LOG_QUIET, /* nothing is printed */
} fy_log_level;

/* Messages below `level` are dropped. Default FY_LOG_INFO. */
void fy_log_set_level(fy_log_level level);
fy_log_level fy_log_get_level(void);

/* Writes "ferry: <level>: <message>\n" to stderr (info has no level tag). */
void fy_log(fy_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#define fy_log_error(...) fy_log(FY_LOG_ERROR, __VA_ARGS__)
#define fy_log_warn(...) fy_log(FY_LOG_WARN, __VA_ARGS__)
#define fy_log_info(...) fy_log(FY_LOG_INFO, __VA_ARGS__)
#define fy_log_debug(...) fy_log(FY_LOG_DEBUG, __VA_ARGS__)

/* The last error message logged by this thread (empty if none); for tests and for
 * callers that want to repeat it in a summary. */
const char *fy_last_error(void);
/* While set (non-NULL), error lines logged by this thread read "<ctx>: <message>": the
 * scheduler names the task whose work failed. ctx must outlive the setting. */
void fy_log_set_context(const char *ctx);
/* In a job of several processes: every line names this process's rank ("ferry: error:
 * rank 1: ..."); -1: none (the default). Set once, before other threads log. */
void fy_log_set_rank(int rank);
/* Error lines logged by this thread so far. */
unsigned fy_log_error_count(void);

#ifdef __cplusplus
[[noreturn]] void fy_abort_at(const char *file, int line, const char *cond, const char *hint);
#else
_Noreturn void fy_abort_at(const char *file, int line, const char *cond, const char *hint);
#endif

/* A broken invariant: a bug, never bad input. */
#define FY_ASSERT(cond, hint) \
    do { if (!(cond)) fy_abort_at(__FILE__, __LINE__, #cond, (hint)); } while (0)

/* Propagate a failing status. */
#define FY_TRY(expr) \
    do { fy_status fy_try_s_ = (expr); if (fy_try_s_ != FY_OK) return fy_try_s_; } while (0)

#ifdef __cplusplus
}
#endif
#endif
