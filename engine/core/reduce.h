/* reduce.h — the sum of squares used for gradient norms, in one fixed order.
 *
 * x is cut into chunks of FY_SUMSQ_CHUNK elements; each chunk is summed in double in
 * index order, and the chunk sums are added in chunk order. The device kernel
 * parallelises over chunks and the host path runs them serially: both give the same
 * bits, so a gradient norm does not depend on where the gradient lives. */
#ifndef FY_REDUCE_H
#define FY_REDUCE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FY_SUMSQ_CHUNK 16384

/* The chunks of n elements. */
static inline size_t fy_sumsq_nchunks(size_t n) { return (n + FY_SUMSQ_CHUNK - 1) / FY_SUMSQ_CHUNK; }

/* Sum of x[i]^2 over one chunk (n <= FY_SUMSQ_CHUNK), in double, in index order. */
double fy_sumsq_chunk(const float *x, size_t n);
/* All chunks, serially. */
double fy_sumsq(const float *x, size_t n);
/* The same over bf16 values (uint16_t bit patterns), each widened to fp32 exactly: the
 * device kernel on a bf16 stream gives the same bits. */
double fy_sumsq_bf16(const uint16_t *x, size_t n);
/* The chunk sums alone: part[c] for each of the ceil(n / FY_SUMSQ_CHUNK) chunks of x,
 * fp32 (bf16 false) or bf16 bit patterns. Adding them in chunk order, from 0.0, gives
 * fy_sumsq's (fy_sumsq_bf16's) bits: a data-parallel job sums the chunks of a gradient
 * each rank holds a part of so. */
void fy_sumsq_parts(const void *x, bool bf16, size_t n, double *part);

#ifdef __cplusplus
}
#endif
#endif
