/* AttnRes' depth softmax on CPU in fp32, one pass per token over its sources (``hf_depth.native``).
 *
 * The same function as hf_depth.models.depth_ops._TwoPhaseAggregate / _DepthAggregate (their eager forms), per
 * token n, given the K stable sources' logits z_k (computed by the caller: the two-phase logits or r_k qg . v_k):
 *   forward   [rp = 1 / rms(P),  zp = rp qg . P]     (P: the running partial sum, when there is one)
 *             p = softmax([z_0 .. z_{K-1} | zp]),   out = sum_k p_k V_k + p_K P
 *   backward  dp_k = do . V_k,  dp_K = do . P,   dz = p (dp - sum_j p_j dp_j)
 *             dV_k += p_k do  (the bank's gradient accumulator, in place),  DZ_k = dz_k (k < K)
 *             or, with dV NULL, PW_k = p_k [K, N]: the weights, for the caller's deferred sum of every consumer's
 *             p_k do (hfd_moda_slot_grads: each slot's accumulator row read and written once per group of consumers)
 *             a = dz_K rp,   dP = p_K do + a qg - (a zp rp / d) P
 * The slots' logit gradients DZ go on to the caller's products (the two-phase form's d z / d v and d z / d qg), and
 * a [N] to the partial's part of the query gradient (a sum over tokens: the caller's, so threads change no bit).
 * Eager PyTorch runs each of these as a pass over [K, N] or [N, d] tensors (one per slot for the weighted sum);
 * here a token's K rows are read once per direction and its d-wide sums stay in L1.
 *
 * Layouts (strides in elements): z [K, N] (slot stride szk, tokens contiguous); V [K, N, d] (slot stride svk,
 * token rows contiguous); P, out, do, dP [N, d] contiguous; p [N, K + 1] contiguous (K without P: the row of
 * weights the caller returns, token-major); rp, zp, a [N]; DZ [K, N] (slot stride sdk); dV [K, N, d] (slot stride
 * sgk) or NULL; PW [K, N] (slot stride spk) or NULL. A call handles tokens [n0, n1) (threads split the range).
 * No FMA contraction (-std=c99).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

/* p[0..S) = softmax of the token's logits z_k (k < K, slot stride szk) and, with a partial, zp as the last one */
static void agg_softmax(float *restrict p, const float *z, int64_t szk, int64_t K, int has_p, float zp) {
    const int64_t S = K + has_p;
    for (int64_t k = 0; k < K; k++) p[k] = z[k * szk];
    if (has_p) p[K] = zp;
    float mx = p[0];
    for (int64_t k = 1; k < S; k++) mx = p[k] > mx ? p[k] : mx;
    float sum = 0.0f;
    for (int64_t k = 0; k < S; k++) {
        p[k] = expf(p[k] - mx);
        sum += p[k];
    }
    const float inv = 1.0f / sum;
    for (int64_t k = 0; k < S; k++) p[k] *= inv;
}

/* 1 / rms of a row (functional.inv_rms: 1 / sqrt(mean(x^2) + eps)) */
static inline float agg_rinv(const float *x, int64_t d, float eps) {
    return 1.0f / sqrtf(hfd_dot(x, x, d) / (float)d + eps);
}

/* tokens per chunk: a chunk's rows of one slot are contiguous (streamed), its d-wide sums stay in L1 */
#ifndef AGG_TC
#define AGG_TC 16
#endif

/* A bank slot's write (depth_ops.SourceBank): rows [n0, n1) of x (row stride sx, d contiguous) copied into dst
 * [N, d] (contiguous), with their 1 / rms (agg_rinv, ``eps``) into r [N]: one pass instead of a copy and five ops */
int hfd_slot_write(const float *x, int64_t sx, float *dst, float *r, float eps, int64_t d, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
        const float *xn = x + n * sx;
        memcpy(dst + n * d, xn, sizeof(float) * (size_t)d);
        r[n] = agg_rinv(xn, d, eps);
    }
    return 0;
}

int hfd_agg_fwd(const float *z, int64_t szk, const float *V, int64_t svk, int64_t K, const float *P,
                const float *qg, float eps, float *out, float *p, float *rp, float *zp, int64_t d, int64_t n0,
                int64_t n1) {
    const int has_p = P != NULL;
    const int64_t S = K + has_p;
    for (int64_t c = n0; c < n1; c += AGG_TC) {
        const int64_t tn = n1 - c < AGG_TC ? n1 - c : AGG_TC;
        for (int64_t n = c; n < c + tn; n++) {
            float zn = 0.0f;
            if (has_p) {
                rp[n] = agg_rinv(P + n * d, d, eps);
                zn = zp[n] = rp[n] * hfd_dot(P + n * d, qg, d);
            }
            agg_softmax(p + n * S, z + n, szk, K, has_p, zn);
            const float w = p[n * S], *v = V + n * d;
            float *o = out + n * d;
            for (int64_t i = 0; i < d; i++) o[i] = w * v[i];
        }
        int64_t k = 1;
        for (; k + 4 <= S; k += 4)  /* four slots' rows of the chunk streamed at a time, a row's terms in slot order */
            for (int64_t n = c; n < c + tn; n++) {
                const float *v[4];
                for (int u = 0; u < 4; u++) v[u] = k + u < K ? V + (k + u) * svk + n * d : P + n * d;
                hfd_axpy4(out + n * d, p + n * S + k, v[0], v[1], v[2], v[3], d);
            }
        for (; k < S; k++)
            for (int64_t n = c; n < c + tn; n++)
                hfd_axpy(out + n * d, p[n * S + k], k < K ? V + k * svk + n * d : P + n * d, d);
    }
    return 0;
}

int hfd_agg_bwd(const float *z, int64_t szk, const float *V, int64_t svk, int64_t K, const float *P,
                const float *qg, const float *rp, const float *zp, const float *dout, float *DZ, int64_t sdk,
                float *dV, int64_t sgk, float *PW, int64_t spk, float *dP, float *a, int64_t d, int64_t n0,
                int64_t n1) {
    const int has_p = P != NULL;
    const int64_t S = K + has_p;
    float *p = malloc(sizeof(float) * (size_t)(2 * AGG_TC * S));
    if (!p) return 2;
    float *dp = p + AGG_TC * S;
    for (int64_t c = n0; c < n1; c += AGG_TC) {
        const int64_t tn = n1 - c < AGG_TC ? n1 - c : AGG_TC;
        for (int64_t t = 0; t < tn; t++) agg_softmax(p + t * S, z + c + t, szk, K, has_p, has_p ? zp[c + t] : 0.0f);
        for (int64_t k = 0; k < K; k += 4) {  /* dp_k = do . V_k, four slots' rows of the chunk streamed at a time */
            const int64_t kn = K - k < 4 ? K - k : 4;
            for (int64_t t = 0; t < tn; t++)
                hfd_dots(dp + t * S + k, dout + (c + t) * d, V + k * svk + (c + t) * d, svk, kn, d);
        }
        for (int64_t t = 0; has_p && t < tn; t++) dp[t * S + K] = hfd_dot(dout + (c + t) * d, P + (c + t) * d, d);
        for (int64_t t = 0; t < tn; t++) {  /* dz = p (dp - sum p dp), in place of dp */
            float *pt = p + t * S, *gt = dp + t * S, s = 0.0f;
            for (int64_t k = 0; k < S; k++) s += pt[k] * gt[k];
            for (int64_t k = 0; k < S; k++) gt[k] = pt[k] * (gt[k] - s);
            for (int64_t k = 0; k < K; k++) DZ[k * sdk + c + t] = gt[k];
            if (PW)
                for (int64_t k = 0; k < K; k++) PW[k * spk + c + t] = pt[k];
        }
        for (int64_t k = 0; dV && k < K; k++)  /* dV_k += p_k do, slot-major */
            for (int64_t t = 0; t < tn; t++) hfd_axpy(dV + k * sgk + (c + t) * d, p[t * S + k], dout + (c + t) * d, d);
        if (has_p)
            for (int64_t t = 0; t < tn; t++) {
                const int64_t n = c + t;
                const float an = dp[t * S + K] * rp[n], cn = an * zp[n] * rp[n] * (-1.0f / (float)d), w = p[t * S + K];
                const float *g = dout + n * d, *Pn = P + n * d;
                float *o = dP + n * d;
                for (int64_t i = 0; i < d; i++) o[i] = g[i] * w + an * qg[i] + cn * Pn[i];
                a[n] = an;
            }
    }
    free(p);
    return 0;
}
