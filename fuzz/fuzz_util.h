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

/* The file of this process's inputs, ending in ext (".bin" makes a token file a shard). */
static const char *fuzz_path(const char *ext) {
    static char path[256];
    if (!path[0]) {
        const char *dir = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
        snprintf(path, sizeof path, "%s/ferry-fuzz-%ld%s", dir, (long)getpid(), ext);
        fy_log_set_level(FY_LOG_QUIET);
    }
    return path;
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
