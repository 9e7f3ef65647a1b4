/* rope.h — rotary position embeddings: the parameters (a config's rope_theta,
 * rope_scaling and partial_rotary_factor) and each pair's frequency, shared by the kernels
 * of every backend (the function is host and device code under nvcc), so they rotate by
 * the same angles.
 *
 * Pairs follow Hugging Face's rotate_half over the first d channels of a head (d =
 * rot_dim, or all hd channels; the channels d..hd-1 pass through unchanged): channel j and
 * j + d/2 (j < d/2) form pair j, rotated by the angle t * inv_freq(j) at position t and
 * scaled by attn_factor f:
 *   x'[j]       = f (x[j] cos - x[j + d/2] sin)
 *   x'[j + d/2] = f (x[j + d/2] cos + x[j] sin)
 * inv_freq(j) = theta^(-2j/d), then scaled by the type:
 *   DEFAULT  as is;
 *   LINEAR   divided by factor (position interpolation);
 *   LLAMA3   Llama 3.1's: with wavelength w = 2 pi / inv_freq, low_w = orig / low,
 *            high_w = orig / high: w < high_w keeps it, w > low_w divides it by factor,
 *            and between them s = (orig / w - low) / (high - low) blends the two,
 *            (1 - s) inv_freq / factor + s inv_freq;
 *   LONGROPE Phi-3's: divided by the pair's own factor ext[j] (the model picks the short
 *            or the long list of its config; attn_factor is the config's scaling too).
 * Angles, their sines and their products with f are computed in double and rounded once
 * to fp32. With f != 1 the map is a rotation times f: its transpose (the backward) is f
 * times the opposite rotation, not its inverse. */
#ifndef FY_ROPE_H
#define FY_ROPE_H

#include <math.h>

#ifdef __CUDACC__
#define FY_HOST_DEVICE __host__ __device__
#else
#define FY_HOST_DEVICE
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef enum fy_rope_type {
    FY_ROPE_DEFAULT = 0, FY_ROPE_LINEAR = 1, FY_ROPE_LLAMA3 = 2, FY_ROPE_LONGROPE = 3
} fy_rope_type;

/* The most pairs a head has: FY_ATTN_MAX_HEAD (kernels.h) / 2. */
#define FY_ROPE_MAX_PAIRS 128

typedef struct fy_rope {
    fy_rope_type type;
    float theta;            /* rope_theta (10000 for Llama 2, 500000 for Llama 3) */
    float factor;           /* LINEAR, LLAMA3 */
    float low_freq_factor;  /* LLAMA3 */
    float high_freq_factor; /* LLAMA3 */
    float orig_max_pos;     /* LLAMA3: original_max_position_embeddings */
    int rot_dim;            /* channels rotated per head, even, <= hd; 0: all hd */
    float attn_factor;      /* cos and sin are multiplied by it; 0 means 1 */
    float ext[FY_ROPE_MAX_PAIRS]; /* LONGROPE: pair j's divisor of inv_freq (j < d/2) */
} fy_rope;

/* Pair j's inverse frequency in a rotation of d channels (rot_dim, or hd). */
FY_HOST_DEVICE static inline double fy_rope_inv_freq(const fy_rope *r, int j, int d) {
    const int type = r->type;
    const double theta = r->theta, factor = r->factor, low = r->low_freq_factor,
                 high = r->high_freq_factor, orig = r->orig_max_pos;
    if (type == FY_ROPE_LONGROPE) return 1.0 / ((double)r->ext[j] * pow(theta, 2.0 * j / d));
    double inv = pow(theta, -2.0 * j / d);
    if (type == FY_ROPE_LINEAR) return inv / factor;
    if (type != FY_ROPE_LLAMA3) return inv;
    const double two_pi = 6.283185307179586476925286766559;
    double w = two_pi / inv;
    if (w < orig / high) return inv;
    if (w > orig / low) return inv / factor;
    double s = (orig / w - low) / (high - low);
    return (1.0 - s) * inv / factor + s * inv;
}

#ifdef __cplusplus
}
#endif
#endif
