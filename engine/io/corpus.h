/* corpus.h — the embedded default corpus, generated (no download, no data file).
 *
 * A deterministic generator of English-like prose from a small probabilistic grammar:
 * a fixed vocabulary of a few hundred words, sentences with agreement and punctuation,
 * paragraphs and dialogue lines. It has structure at the character, word and sentence
 * level, so a byte-level model's loss falls well below the unigram entropy; the same
 * seed gives the same bytes on every machine. */
#ifndef FY_CORPUS_H
#define FY_CORPUS_H

#include <stddef.h>
#include <stdint.h>

#include "engine/core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Generates exactly nbytes bytes of text into a new malloc'd buffer (*out, caller frees). */
fy_status fy_corpus_generate(size_t nbytes, uint64_t seed, uint8_t **out);

#ifdef __cplusplus
}
#endif
#endif
