/* json_file.c — whole-file JSON reading and atomic writing. */
#include "engine/io/json_file.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/core/util.h"

fy_status fy_json_read_text(const char *path, const char *what, char **text, size_t *nbytes) {
    *text = NULL;
    int fd = fy_open_read(path);
    struct stat sb;
    if (fd < 0 || fstat(fd, &sb) != 0) {
        if (fd >= 0) close(fd);
        fy_log_error("cannot open %s %s", what, path);
        return FY_ERR_IO;
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        fy_log_error("%s %s: not a regular file", what, path);
        return FY_ERR_IO;
    }
    FILE *f = fdopen(fd, "rb");
    if (!f) {
        close(fd);
        fy_log_error("cannot open %s %s", what, path);
        return FY_ERR_IO;
    }
    char *t = malloc(FY_JSON_MAX_BYTES + 1);
    size_t n = t ? fread(t, 1, FY_JSON_MAX_BYTES + 1, f) : 0;
    fclose(f);
    if (!t) return FY_ERR_NOMEM;
    if (n > FY_JSON_MAX_BYTES) {
        free(t);
        fy_log_error("%s %s: larger than %u bytes", what, path, FY_JSON_MAX_BYTES);
        return FY_ERR_FORMAT;
    }
    t[n] = 0;
    *text = t;
    *nbytes = n;
    return FY_OK;
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
