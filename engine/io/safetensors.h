/* safetensors.h — read and write the safetensors format.
 *
 * Format: u64 little-endian header length N, N bytes of JSON
 * {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
 *  "__metadata__": {"key": "string", ...}}, then the data bytes; offsets are relative to
 * the end of the header. The reader maps the file and checks everything before handing
 * out a tensor: header length against the file size, JSON well-formed, known dtype,
 * shape product * element size == end - begin, offsets inside the data, no overlaps, no
 * duplicate names, and the tensors cover the data region exactly (no holes, no trailing
 * bytes).
 * Any violation is FY_ERR_FORMAT with one logged line naming the file and the problem.
 *
 * The writer writes to "<path>.tmp.<pid>" (through outfile.h: aligned buffers, O_DIRECT
 * where the filesystem allows, the CRC taken on the way), fsyncs, and renames over
 * <path>, so an existing file is never left half-written. */
#ifndef FY_SAFETENSORS_H
#define FY_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "engine/core/dtype.h"
#include "engine/core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FY_ST_MAX_DIMS 8

typedef struct fy_st_tensor {
    const char *name;
    const char *dtype_str;   /* as in the file: "F32", "BF16", "F16", "F64", "I64", "U8", ... */
    fy_dtype dtype;          /* FY_F32/FY_BF16/FY_F16, or FY_DTYPE_NONE for other dtypes */
    int ndim;
    int64_t shape[FY_ST_MAX_DIMS];
    size_t nelem;
    size_t nbytes;
    const void *data;        /* view into the mapped file; valid until fy_st_close; may be
                                unaligned (offsets are in bytes): use memcpy */
} fy_st_tensor;

typedef struct fy_st_file fy_st_file;

fy_status fy_st_open(const char *path, fy_st_file **out);
void fy_st_close(fy_st_file *f); /* NULL is a no-op */

int fy_st_count(const fy_st_file *f);
const fy_st_tensor *fy_st_at(const fy_st_file *f, int i); /* in the header's order */
const fy_st_tensor *fy_st_find(const fy_st_file *f, const char *name); /* NULL if absent */
/* A string from "__metadata__", or NULL. */
const char *fy_st_meta(const fy_st_file *f, const char *key);
const char *fy_st_path(const fy_st_file *f);

/* Converts a F32/BF16/F16 tensor to fp32 into dst (nelem floats). FY_ERR_FORMAT (logged,
 * naming the tensor) for other dtypes. */
fy_status fy_st_read_f32(const fy_st_file *f, const fy_st_tensor *t, float *dst);
/* Drops the mapped pages wholly inside tensor t from this process (they stay in the page
 * cache; a later read maps them again): a model read tensor by tensor then holds at most
 * one tensor of the file in its resident memory. */
void fy_st_release(const fy_st_file *f, const fy_st_tensor *t);

typedef struct fy_st_entry {
    const char *name;
    fy_dtype dtype;          /* FY_F32, FY_BF16 or FY_F16: the data's type, written as is */
    int ndim;
    int64_t shape[FY_ST_MAX_DIMS];
    const void *data;
} fy_st_entry;

/* Writes n tensors in the given order, and __metadata__ from meta, a NULL-terminated
 * list of key, value, key, value, ... strings (NULL or empty: no __metadata__).
 * FY_ERR_INVALID (logged, nothing written) for a duplicate or missing name, another
 * dtype, a negative dimension or a key without a value; FY_ERR_IO (logged) when the file
 * cannot be written, with <path> left as it was. */
fy_status fy_st_write(const char *path, const fy_st_entry *entries, int n,
                      const char *const *meta);

/* As fy_st_write, but an entry whose data is NULL is produced when its turn comes: fill
 * writes elements [first, first + nelem) of tensor i (row-major, in its dtype) into dst,
 * the writer's own buffer (no alignment beyond the dtype's size promised), called for
 * each such tensor over consecutive ranges from its first element to its last, tensor
 * after tensor; a file of many large tensors is so written without holding one whole.
 * A status other than FY_OK from fill (which logs its own error) abandons the file,
 * <path> left as it was, and is returned. */
typedef fy_status (*fy_st_fill_fn)(void *ctx, int i, size_t first, size_t nelem, void *dst);
fy_status fy_st_write_fill(const char *path, const fy_st_entry *entries, int n,
                           const char *const *meta, fy_st_fill_fn fill, void *ctx);
/* The same, and the CRC-32C of every byte written into *crc (checkpoints record it, so
 * the file need not be read back). */
fy_status fy_st_write_fill_crc(const char *path, const fy_st_entry *entries, int n,
                               const char *const *meta, fy_st_fill_fn fill, void *ctx,
                               uint32_t *crc);

#ifdef __cplusplus
}
#endif
#endif
