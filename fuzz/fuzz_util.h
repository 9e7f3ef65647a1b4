/* fuzz_util.h — what the fuzz targets share: each input becomes a file (the parsers read
 * paths, as ferry does), on tmpfs when there is one, rewritten in place for every input;
 * ferry's error lines are silenced (a bad input is the common case). */
#ifndef FY_FUZZ_UTIL_H
#define FY_FUZZ_UTIL_H

#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "engine/core/status.h"

static char fuzz_path_buf[256];

static void fuzz_remove_file(void) { unlink(fuzz_path_buf); }

/* The file of this process's inputs, ending in ext (".bin" makes a token file a shard);
 * removed when the process exits. */
static const char *fuzz_path(const char *ext) {
    if (!fuzz_path_buf[0]) {
        const char *dir = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
        snprintf(fuzz_path_buf, sizeof fuzz_path_buf, "%s/ferry-fuzz-%ld%s", dir, (long)getpid(), ext);
        fy_log_set_level(FY_LOG_QUIET);
        atexit(fuzz_remove_file);
    }
    return fuzz_path_buf;
}

/* Writes the input to the file; the path, or NULL if it cannot be written. */
static const char *fuzz_file(const char *ext, const uint8_t *data, size_t n) {
    const char *path = fuzz_path(ext);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return NULL;
    size_t done = 0;
    while (done < n) {
        ssize_t w = write(fd, data + done, n - done);
        if (w <= 0) { close(fd); return NULL; }
        done += (size_t)w;
    }
    close(fd);
    return path;
}

#endif
