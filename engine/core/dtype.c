/* dtype.c — fp16 conversions (bf16 ones are inline in the header). */
#include "engine/core/dtype.h"

size_t fy_dtype_size(fy_dtype t) {
    switch (t) {
    case FY_F32: return 4;
    case FY_BF16: case FY_F16: return 2;
    default: return 0;
    }
}

const char *fy_dtype_name(fy_dtype t) {
    switch (t) {
    case FY_F32: return "fp32";
    case FY_BF16: return "bf16";
    case FY_F16: return "fp16";
    default: return "none";
    }
}

int fy_dtype_parse(const char *s, fy_dtype *out) {
    if (!strcmp(s, "fp32") || !strcmp(s, "f32")) *out = FY_F32;
    else if (!strcmp(s, "bf16")) *out = FY_BF16;
    else if (!strcmp(s, "fp16") || !strcmp(s, "f16")) *out = FY_F16;
    else if (!strcmp(s, "none")) *out = FY_DTYPE_NONE;
    else return -1;
    return 0;
}

void fy_add_n(fy_dtype t, void *acc, const void *add, size_t n) {
    if (t == FY_BF16) {
        uint16_t *x = acc;
        const uint16_t *y = add;
        for (size_t i = 0; i < n; i++) x[i] = fy_f32_to_bf16(fy_bf16_to_f32(x[i]) + fy_bf16_to_f32(y[i]));
    } else {
        float *x = acc;
        const float *y = add;
        for (size_t i = 0; i < n; i++) x[i] = x[i] + y[i];
    }
}

uint16_t fy_f32_to_f16(float f) {
    uint32_t u = fy_f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00u | (uint16_t)((a >> 13) & 0x3ffu); /* NaN */
    if (a >= 0x477ff000u) return sign | 0x7c00u; /* rounds to >= 65520: infinity */
    if (a < 0x38800000u) {                       /* below 2^-14: fp16 subnormal or zero */
        if (a < 0x33000000u) return sign;        /* below half the smallest subnormal */
        uint32_t mant = (a & 0x7fffffu) | 0x800000u;
        int shift = 126 - (int)(a >> 23); /* 14..24: aligns to units of 2^-24 */
        uint32_t q = mant >> shift;
        uint32_t rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1u))) q++;
        return sign | (uint16_t)q;
    }
    /* normal: rebias exponent 127 -> 15 and round 23 -> 10 mantissa bits */
    uint32_t r = a - 0x38000000u;
    r += 0xfffu + ((r >> 13) & 1u);
    return sign | (uint16_t)(r >> 13);
}

float fy_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1f) return fy_bits_f32(sign | 0x7f800000u | (m << 13));
    if (e == 0) {
        if (m == 0) return fy_bits_f32(sign);
        float f = (float)m * 5.9604644775390625e-8f; /* m * 2^-24, exact */
        return sign ? -f : f;
    }
    return fy_bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}
