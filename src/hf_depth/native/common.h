/* Helpers shared by the native kernels (``hf_depth.native``; included by each source). */
#ifndef HF_DEPTH_NATIVE_COMMON_H
#define HF_DEPTH_NATIVE_COMMON_H

#include <stdint.h>
#include <string.h>

/* a . b over n floats, summed in 8 lanes, then ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)), then the tail:
 * one fixed order, so every kernel's dot products round alike */
static inline float hfd_dot(const float *restrict a, const float *restrict b, int64_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) acc[k] += a[i + k] * b[i + k];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* y += a x over n floats (a product, then an add: no contraction under -std=c99) */
static inline void hfd_axpy(float *restrict y, float a, const float *restrict x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

/* y += w[0] x0 + w[1] x1 + w[2] x2 + w[3] x3, each term added in turn: the bits of four hfd_axpy calls in one pass
 * over y */
static inline void hfd_axpy4(float *restrict y, const float *w, const float *restrict x0, const float *restrict x1,
                             const float *restrict x2, const float *restrict x3, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = (((y[i] + w[0] * x0[i]) + w[1] * x1[i]) + w[2] * x2[i]) + w[3] * x3[i];
}

/* 8 floats as one vector (GCC / clang vector extension): the dot products' lanes, in registers */
typedef float hfd_v8 __attribute__((vector_size(32)));

static inline hfd_v8 hfd_load8(const float *p) {
    hfd_v8 v;
    memcpy(&v, p, sizeof(v));
    return v;
}

/* the scalar in every lane */
static inline hfd_v8 hfd_splat(float x) {
    const hfd_v8 v = {x, x, x, x, x, x, x, x};
    return v;
}

/* 8 int32 lanes: comparison masks and the bits of hfd_v8 lanes */
typedef int32_t hfd_i8 __attribute__((vector_size(32)));

static inline hfd_i8 hfd_splat_i(int32_t x) {
    return (hfd_i8){0} + x; /* the scalar broadcast to every lane */
}

/* lanes of a where the mask is set, else of b */
static inline hfd_v8 hfd_select(hfd_i8 mask, hfd_v8 a, hfd_v8 b) {
    return (hfd_v8)((mask & (hfd_i8)a) | (~mask & (hfd_i8)b));
}

/* e^x per lane for x in [-88, 88.37] (Cephes expf: x = k ln 2 + f, |f| <= ln 2 / 2, a degree-6 polynomial, times 2^k):
 * within 1 ulp of expf from -87 on, 0 below -87.68 (where e^x is subnormal); outside the range 2^k leaves the
 * exponent's bits (callers clamp: hfd_exp_shift) */
static inline hfd_v8 hfd_exp8(hfd_v8 x) {
    const hfd_v8 magic = hfd_splat(12582912.0f); /* 1.5 2^23: adding it rounds to an integer */
    const hfd_v8 k = (x * hfd_splat(1.44269504088896341f) + magic) - magic;
    const hfd_v8 f = (x - k * hfd_splat(0.693359375f)) - k * hfd_splat(-2.12194440e-4f);
    hfd_v8 p = hfd_splat(1.9875691500e-4f);
    p = p * f + hfd_splat(1.3981999507e-3f);
    p = p * f + hfd_splat(8.3334519073e-3f);
    p = p * f + hfd_splat(4.1665795894e-2f);
    p = p * f + hfd_splat(1.6666665459e-1f);
    p = p * f + hfd_splat(5.0000001201e-1f);
    p = p * (f * f) + f + hfd_splat(1.0f);
    const hfd_i8 e = (__builtin_convertvector(k, hfd_i8) + 127) << 23;
    return p * (hfd_v8)e;
}

/* e^(x - m) per lane for any x - m: clamped to [-88, 89] first, so -inf (a masked slot) and anything below -87.68
 * give 0, anything above 88.37 +inf, and NaN stays NaN */
static inline hfd_v8 hfd_exp8_any(hfd_v8 x, float m) {
    const hfd_v8 z = x - hfd_splat(m);
    return hfd_exp8(hfd_select(z > hfd_splat(89.0f), hfd_splat(89.0f),
                               hfd_select(z < hfd_splat(-88.0f), hfd_splat(-88.0f), z)));
}

/* y[j] = e^(x[j] - m) over n floats (hfd_exp8_any, eight at a time; y may be x) */
static inline void hfd_exp_shift(float *y, const float *x, float m, int64_t n) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const hfd_v8 v = hfd_exp8_any(hfd_load8(x + j), m);
        memcpy(y + j, &v, sizeof(v));
    }
    if (j < n) {
        float buf[8] = {0};
        memcpy(buf, x + j, sizeof(float) * (size_t)(n - j));
        const hfd_v8 v = hfd_exp8_any(hfd_load8(buf), m);
        memcpy(buf, &v, sizeof(v));
        memcpy(y + j, buf, sizeof(float) * (size_t)(n - j));
    }
}

/* the 8 lanes' sum in hfd_dot's order */
#define HFD_SUM8(x) (((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])))

/* out[s] = a . b_s for the n rows b_s = b + s sb, each summed as ``hfd_dot`` does (the same bits), four rows at a time:
 * a read once per four, and four independent sums in flight (one dot's chain of adds is latency-bound) */
static inline void hfd_dots(float *out, const float *restrict a, const float *restrict b, int64_t sb, int64_t n,
                            int64_t d) {
    int64_t s = 0;
    for (; s + 4 <= n; s += 4) {
        const float *b0 = b + s * sb, *b1 = b0 + sb, *b2 = b1 + sb, *b3 = b2 + sb;
        hfd_v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        int64_t i = 0;
        for (; i + 8 <= d; i += 8) {
            const hfd_v8 v = hfd_load8(a + i);
            a0 += v * hfd_load8(b0 + i);
            a1 += v * hfd_load8(b1 + i);
            a2 += v * hfd_load8(b2 + i);
            a3 += v * hfd_load8(b3 + i);
        }
        float s0 = HFD_SUM8(a0), s1 = HFD_SUM8(a1), s2 = HFD_SUM8(a2), s3 = HFD_SUM8(a3);
        for (; i < d; i++) {
            s0 += a[i] * b0[i];
            s1 += a[i] * b1[i];
            s2 += a[i] * b2[i];
            s3 += a[i] * b3[i];
        }
        out[s] = s0, out[s + 1] = s1, out[s + 2] = s2, out[s + 3] = s3;
    }
    for (; s < n; s++) out[s] = hfd_dot(a, b + s * sb, d);
}

#endif
