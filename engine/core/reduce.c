/* reduce.c — chunked sum of squares (see reduce.h for the order contract). */
#include "engine/core/reduce.h"

#include "engine/core/dtype.h"

double fy_sumsq_chunk(const float *x, size_t n) {
    double s = 0.0;
    for (size_t i = 0; i < n; i++) s += (double)x[i] * (double)x[i];
    return s;
}

double fy_sumsq(const float *x, size_t n) {
    double s = 0.0;
    for (size_t i0 = 0; i0 < n; i0 += FY_SUMSQ_CHUNK)
        s += fy_sumsq_chunk(x + i0, n - i0 < FY_SUMSQ_CHUNK ? n - i0 : FY_SUMSQ_CHUNK);
    return s;
}

double fy_sumsq_bf16(const uint16_t *x, size_t n) {
    double s = 0.0;
    for (size_t i0 = 0; i0 < n; i0 += FY_SUMSQ_CHUNK) {
        size_t len = n - i0 < FY_SUMSQ_CHUNK ? n - i0 : FY_SUMSQ_CHUNK;
        double c = 0.0;
        for (size_t i = 0; i < len; i++) {
            double v = (double)fy_bf16_to_f32(x[i0 + i]);
            c += v * v;
        }
        s += c;
    }
    return s;
}

void fy_sumsq_parts(const void *x, bool bf16, size_t n, double *part) {
    for (size_t c = 0, i0 = 0; i0 < n; c++, i0 += FY_SUMSQ_CHUNK) {
        const size_t len = n - i0 < FY_SUMSQ_CHUNK ? n - i0 : FY_SUMSQ_CHUNK;
        part[c] = bf16 ? fy_sumsq_bf16((const uint16_t *)x + i0, len)
                       : fy_sumsq_chunk((const float *)x + i0, len);
    }
}
