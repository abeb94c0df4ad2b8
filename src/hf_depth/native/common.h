/* Helpers shared by the native kernels (``hf_depth.native``; included by each source). */
#ifndef HF_DEPTH_NATIVE_COMMON_H
#define HF_DEPTH_NATIVE_COMMON_H

#include <stdint.h>

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

#endif
