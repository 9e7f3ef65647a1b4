/* rope.h — rotary position embeddings: the parameters (a config's rope_theta and
 * rope_scaling) and each pair's frequency, shared by the kernels of every backend (the
 * function is host and device code under nvcc), so they rotate by the same angles.
 *
 * Pairs follow Hugging Face's rotate_half: in a head of hd channels, channel j and
 * j + hd/2 (j < hd/2) form pair j, rotated by the angle t * inv_freq(j) at position t:
 *   x'[j]        = x[j] cos - x[j + hd/2] sin
 *   x'[j + hd/2] = x[j + hd/2] cos + x[j] sin
 * inv_freq(j) = theta^(-2j/hd), then scaled by the type:
 *   DEFAULT  as is;
 *   LINEAR   divided by factor (position interpolation);
 *   LLAMA3   Llama 3.1's: with wavelength w = 2 pi / inv_freq, low_w = orig / low,
 *            high_w = orig / high: w < high_w keeps it, w > low_w divides it by factor,
 *            and between them s = (orig / w - low) / (high - low) blends the two,
 *            (1 - s) inv_freq / factor + s inv_freq.
 * Angles and their sines are computed in double and rounded once to fp32. */
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

typedef enum fy_rope_type { FY_ROPE_DEFAULT = 0, FY_ROPE_LINEAR = 1, FY_ROPE_LLAMA3 = 2 } fy_rope_type;

typedef struct fy_rope {
    fy_rope_type type;
    float theta;            /* rope_theta (10000 for Llama 2, 500000 for Llama 3) */
    float factor;           /* LINEAR, LLAMA3 */
    float low_freq_factor;  /* LLAMA3 */
    float high_freq_factor; /* LLAMA3 */
    float orig_max_pos;     /* LLAMA3: original_max_position_embeddings */
} fy_rope;

FY_HOST_DEVICE static inline double fy_rope_inv_freq(int j, int hd, int type, double theta,
                                                    double factor, double low, double high,
                                                    double orig) {
    double inv = pow(theta, -2.0 * j / hd);
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
