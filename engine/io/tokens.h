/* tokens.h — token data: llm.c shards, plain text files, their loss masks and documents,
 * and the batch loader.
 *
 * Files:
 *  - llm.c shards: int32 header[256] with header[0] = magic, header[1] = version,
 *    header[2] = token count; magic 20240520 version 1 stores uint16 tokens, magic
 *    20240801 version 7 stores uint32 tokens. The file size must equal
 *    1024 + count * token size exactly.
 *  - plain text: every byte is a token (0..255).
 * A file whose first int32 is one of the magics is a shard (and must be a valid one);
 * a file named *.bin that is not a valid shard is an error ("bad magic"); anything else
 * is text. Empty files are errors. A path containing glob characters (*?[) names the
 * shards matching it, sorted, read as one stream in order.
 *
 * Memory: files are memory-mapped read-only and read in place, as they store their
 * tokens (1, 2 or 4 bytes each), so a dataset larger than RAM can be trained on; only
 * fy_tokens_from_bytes holds a copy (one byte a token). A file must not be truncated
 * or rewritten in place while it is open: its size is checked before it is mapped, but
 * a later truncation would fault (SIGBUS) on the next read past the new end.
 *
 * Threads: a fy_tokens is read-only once made; any thread may read it (count, at, read,
 * check_vocab) concurrently. A loader is a cursor for one thread at a time.
 *
 * Loader (llm.c's sequential order): a step reads B*T+1 tokens at the current position;
 * x is the first B*T, y the same shifted by one; the position advances by B*T and wraps
 * to the start of the range when fewer than B*T+1 tokens remain. */
#ifndef FY_TOKENS_H
#define FY_TOKENS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "engine/core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FY_SHARD_MAGIC_V1 20240520
#define FY_SHARD_MAGIC_V7 20240801

typedef struct fy_tokens fy_tokens; /* all tokens of a file (or glob), mapped in place */

/* Loss masks and documents (scripts/tokenize.py --chat writes them): a shard X.bin may have
 * a companion X.mask beside it:
 *   int32 header[256]: header[0] = FY_MASK_MAGIC, header[1] = version 1, header[2] = the
 *   shard's token count, header[3] = the packing length S (the sequences the examples
 *   were packed into; 0: not packed), header[4] = the CRC-32 (zlib's) of the shard's
 *   token bytes as stored (what ties the mask to its shard: fy_tokens_check_vocab checks
 *   it, in its pass over every token), the rest 0;
 *   then the loss bits, ceil(count/8) bytes (bit i is byte i/8's bit i%8, the least
 *   significant first): 1 where token i is a target the loss counts;
 *   then the start bits, as many bytes: 1 where a document starts at token i.
 * The size must be exactly 1024 + 2 * ceil(count/8). Either every shard of the data has
 * one or none does (else an error names a shard without); every companion's S is the
 * same. A companion is read in place through its mapping, like the tokens.
 * With masks, a target counts when its token's loss bit is set and its start bit is not
 * (a document's first token has nothing before it in its document). */
#define FY_MASK_MAGIC 20261203
#define FY_MASK_VERSION 1

/* Opens and maps a file or a glob of them (see above), with their companions. Every malformed file fails with
 * one logged error naming it: FY_ERR_IO (missing, unreadable, not mappable, no glob
 * match), FY_ERR_FORMAT (empty, bad magic, bad version, bad count, wrong size) or
 * FY_ERR_NOMEM. On failure *out is NULL. */
fy_status fy_tokens_open(const char *path, fy_tokens **out);
/* Whether fy_tokens_open reads path as a glob (it holds one of *?[). */
static inline bool fy_tokens_is_glob(const char *path) { return strpbrk(path, "*?[") != NULL; }
/* Takes a copy of a byte buffer as text tokens (n bytes, one a token). */
fy_status fy_tokens_from_bytes(const uint8_t *bytes, size_t n, const char *label,
                               fy_tokens **out);
void fy_tokens_free(fy_tokens *t); /* NULL is a no-op */

size_t fy_tokens_count(const fy_tokens *t);
/* Token i (i < count) of the whole stream; a lookup of the file holding it, then one
 * read: for spot checks, not for bulk reads (use fy_tokens_read). */
uint32_t fy_tokens_at(const fy_tokens *t, size_t i);
/* Copies tokens [begin, begin + n) of the stream, across files, into dst (n int32;
 * an id >= 2^31 wraps as a cast does). The range must lie inside the count (aborts
 * otherwise: a bug). */
void fy_tokens_read(const fy_tokens *t, size_t begin, size_t n, int32_t *dst);
const char *fy_tokens_label(const fy_tokens *t); /* path or label, for messages */
bool fy_tokens_has_masks(const fy_tokens *t);
int fy_tokens_packed_seq(const fy_tokens *t);     /* the masks' S (0: none, or not packed) */
/* Whether target position i (the token predicted at i - 1) counts: every one without
 * masks; else its loss bit set and its start bit not (above). i < count. */
bool fy_tokens_target_counts(const fy_tokens *t, size_t i);
/* Whether a document starts at token i (false without masks). */
bool fy_tokens_doc_starts(const fy_tokens *t, size_t i);
/* A CRC-32C of the loss and start bits of tokens [begin, begin + n) (0 without masks),
 * continuing crc: what tells two runs' masks apart. */
uint32_t fy_tokens_masks_crc(const fy_tokens *t, size_t begin, size_t n, uint32_t crc);
/* FY_ERR_INVALID (logged: first offending token id, its position, the file) if any
 * token is >= vocab; FY_ERR_FORMAT (logged, naming both) if a shard's tokens do not have
 * the CRC its loss mask records. Scans the mappings in chunks and drops each chunk's pages from
 * the process once scanned (they stay in the page cache), so a scan of a large dataset
 * leaves the resident set as it found it. */
fy_status fy_tokens_check_vocab(const fy_tokens *t, int vocab);

typedef struct fy_loader fy_loader; /* a view: does not own the tokens */

/* Batches of B x T from tokens [begin, end) of t. FY_ERR_INVALID (logged) if the range
 * holds fewer than B*T+1 tokens. */
fy_status fy_loader_new(const fy_tokens *t, size_t begin, size_t end, int B, int T,
                        fy_loader **out);
void fy_loader_free(fy_loader *l);
/* Fills x and y (B*T int32 each) and advances. With masks, a target that does not count
 * is -1 in y, and docs (B*T, may be NULL) gets each position's document start in its
 * row (kernels.h: a row starts a document, and so does every token with its start bit);
 * without masks docs gets 0s (one document a row). Pages it reads stay mapped: they are
 * clean file pages, which the kernel reclaims first (the mapping is MADV_SEQUENTIAL). */
void fy_loader_next(fy_loader *l, int32_t *x, int32_t *y, int32_t *docs);
/* The targets batch k (fy_loader_seek_batch's numbering) counts: B*T without masks. Reads
 * the masks only; does not move the cursor (any thread may ask while another reads). */
int64_t fy_loader_batch_targets(const fy_loader *l, int64_t k);
void fy_loader_reset(fy_loader *l);
size_t fy_loader_pos(const fy_loader *l);        /* offset from begin, for checkpoints */
/* Moves to pos (an offset from begin, as fy_loader_pos gives). FY_ERR_INVALID (logged)
 * if fewer than B*T+1 tokens of the range remain there. */
fy_status fy_loader_set_pos(fy_loader *l, size_t pos);
/* Number of distinct batches in one pass over the range: (end-begin-1) / (B*T). */
size_t fy_loader_batches(const fy_loader *l);
size_t fy_loader_batch_tokens(const fy_loader *l); /* B*T */
/* Moves to batch k (k >= 0) of the sequential order, which wraps after each pass of
 * fy_loader_batches batches: the next fy_loader_next reads what the (k+1)-th would. */
fy_status fy_loader_seek_batch(fy_loader *l, int64_t k);

#ifdef __cplusplus
}
#endif
#endif
