/* dtype.h — element types and the scalar conversions between them.
 *
 * fp32 -> bf16 and fp32 -> fp16 round to nearest, ties to even; NaN stays NaN (quiet),
 * infinities stay infinite, fp16 overflow goes to infinity and fp16 keeps subnormals.
 * These scalar versions are the reference every SIMD conversion is tested against. */
#ifndef FY_DTYPE_H
#define FY_DTYPE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum fy_dtype {
    FY_DTYPE_NONE = 0,
    FY_F32,
    FY_BF16,
    FY_F16,
} fy_dtype;

size_t fy_dtype_size(fy_dtype t);
const char *fy_dtype_name(fy_dtype t);
/* Parses "fp32"/"f32", "bf16", "fp16"/"f16", "none"; returns -1 if unknown. */
int fy_dtype_parse(const char *s, fy_dtype *out);

static inline uint32_t fy_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float fy_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline uint16_t fy_f32_to_bf16(float f) {
    uint32_t u = fy_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline float fy_bf16_to_f32(uint16_t h) { return fy_bits_f32((uint32_t)h << 16); }

/* The same over arrays of n elements. */
static inline void fy_f32_to_bf16_n(uint16_t *dst, const float *src, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = fy_f32_to_bf16(src[i]);
}
static inline void fy_bf16_to_f32_n(float *dst, const uint16_t *src, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = fy_bf16_to_f32(src[i]);
}

uint16_t fy_f32_to_f16(float f);
float fy_f16_to_f32(uint16_t h);

/* acc[i] += add[i] for n elements of type t (F32, or BF16 bits: the fp32 sum rounded, a
 * device's accumulation of a bf16 gradient). */
void fy_add_n(fy_dtype t, void *acc, const void *add, size_t n);

#ifdef __cplusplus
}
#endif
#endif
