/* HC and mHC's stream mixing on CPU in fp32, one pass per token over its n x d streams (``hf_depth.native``).
 *
 * The same arithmetic as hf_depth.models.functional.mix_streams / write_streams and the by-hand backward of
 * depth_ops._Route / _Write (their eager forms), per token t:
 *   mix        out_i = sum_s M[i, s] H_s                  (i < r rows; rows [0, r0) to out0, [r0, r) to out1)
 *   mix_bwd    dM[i, s] = G_i . H_s,  dH_s = sum_i M[i, s] G_i      (G rows [0, r0) from G0, [r0, r) from G1)
 *   write_bwd  dy = sum_s w_s dH_s,  dw_s = dH_s . y
 * Eager PyTorch runs each sum as one broadcast pass per term over stream-sized tensors (a fresh output, then
 * multiply-adds in place) and the per-token [r, n] x [n, d] products as batched products far below bandwidth; here
 * a token's n x d block (a few KiB) is read once and stays in L1 while every row is formed.
 *
 * Rounding: the mix forms each row as the eager form does (M[i, 0] H_0, then + M[i, s] H_s in s order, each a
 * fused multiply-add where the CPU has one, as ATen's addcmul; no other contraction under -std=c99), so its rows
 * equal mix_streams' bit for bit; the dot products sum in 8 lanes (their rounding differs from the eager batched
 * products' at ~1e-7 relative).
 *
 * Layouts (strides in elements, the last dim contiguous): M [tok, r, n] (smt, smr, smc; smt = 0 for one M for every
 * token); H [tok, n, d] (sht, shs; shs = 0 for a broadcast stream); out0 [tok, r0, d] and out1 [tok, r - r0, d]
 * contiguous; G0 [tok, r0, d] (sat, sar), G1 [tok, r - r0, d] (sbt, sbr); dM [tok, r, n] and dH [tok, n, d]
 * contiguous; the write's w [tok, n] (swt, sws), dH [tok, n, d] (sdt, sds), y [tok, d] (syt); dy [tok, d] and
 * dw [tok, n] contiguous.
 * A call handles tokens [t0, t1) (threads split the range).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#if defined(__FMA__) && defined(__AVX__)
#include <immintrin.h>
#endif

/* the most rows (r) and streams (n) the mixing backward takes (the caller checks: native.MAX_STREAM_ROWS) */
#define SM_MAX_ROWS 16

/* a + b c as ATen's CPU addcmul forms it: one fused multiply-add where the CPU has one (its vectorized kernels) */
#ifdef __FMA__
#define SM_MADD(a, b, c) fmaf((b), (c), (a))
#else
#define SM_MADD(a, b, c) ((a) + (b) * (c))
#endif

/* 8 floats as one vector (GCC / clang vector extension): the dot products' lanes, in registers */
typedef float sm_v8 __attribute__((vector_size(32)));

static inline sm_v8 sm_splat(float x) {
    const sm_v8 v = {x, x, x, x, x, x, x, x};
    return v;
}

/* a + b c per lane, rounded as SM_MADD: one fused multiply-add where the CPU has one */
static inline sm_v8 sm_vmadd(sm_v8 a, sm_v8 b, sm_v8 c) {
#if defined(__FMA__) && defined(__AVX__)
    return (sm_v8)_mm256_fmadd_ps((__m256)b, (__m256)c, (__m256)a);
#else
    return a + b * c;
#endif
}

static inline sm_v8 sm_load(const float *p) {
    sm_v8 v;
    memcpy(&v, p, sizeof(v));
    return v;
}

/* out[s] = a . b_s for the n rows b_s = b + s sb, each summed as ``hfd_dot`` does (the same bits), a read once */
static inline void sm_dots(float *out, const float *restrict a, const float *restrict b, int64_t sb, int64_t n,
                           int64_t d) {
    int64_t s = 0;
    for (; s + 4 <= n; s += 4) {
        const float *b0 = b + s * sb, *b1 = b0 + sb, *b2 = b1 + sb, *b3 = b2 + sb;
        sm_v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        int64_t i = 0;
        for (; i + 8 <= d; i += 8) {
            const sm_v8 v = sm_load(a + i);
            a0 += v * sm_load(b0 + i);
            a1 += v * sm_load(b1 + i);
            a2 += v * sm_load(b2 + i);
            a3 += v * sm_load(b3 + i);
        }
#define SM_SUM(x) (((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])))
        float s0 = SM_SUM(a0), s1 = SM_SUM(a1), s2 = SM_SUM(a2), s3 = SM_SUM(a3);
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

/* o = sum_s c[s * sc] x[s * sx + .] over n terms, as the eager form: the first product, then multiply-adds */
static inline void sm_combine(float *restrict o, const float *c, int64_t sc, const float *x, int64_t sx, int64_t n,
                              int64_t d) {
    const float c0 = c[0];
    const float *restrict x0 = x;
    for (int64_t k = 0; k < d; k++) o[k] = c0 * x0[k];
    for (int64_t s = 1; s < n; s++) {
        const float cs = c[s * sc];
        const float *restrict xs = x + s * sx;
        for (int64_t k = 0; k < d; k++) o[k] = SM_MADD(o[k], cs, xs[k]);
    }
}

int hfd_stream_mix(const float *M, int64_t smt, int64_t smr, int64_t smc, const float *H, int64_t sht, int64_t shs,
                   float *out0, float *out1, int64_t r0, int64_t r, int64_t n, int64_t d, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
        const float *Mt = M + t * smt, *Ht = H + t * sht;
        for (int64_t i = 0; i < r; i++) {
            float *o = i < r0 ? out0 + (t * r0 + i) * d : out1 + (t * (r - r0) + i - r0) * d;
            sm_combine(o, Mt + i * smr, smc, Ht, shs, n, d);
        }
    }
    return 0;
}

int hfd_stream_mix_bwd(const float *M, int64_t smt, int64_t smr, int64_t smc, const float *H, int64_t sht,
                       int64_t shs, const float *G0, int64_t sat, int64_t sar, const float *G1, int64_t sbt,
                       int64_t sbr, float *dM, float *dH, int64_t r0, int64_t r, int64_t n, int64_t d, int64_t t0,
                       int64_t t1) {
    if (r > SM_MAX_ROWS || n > SM_MAX_ROWS) return 2; /* the caller checks: never reached from Python */
    for (int64_t t = t0; t < t1; t++) {
        const float *Mt = M + t * smt, *Ht = H + t * sht;
        float *dMt = dM + t * r * n, *dHt = dH + t * n * d;
        const float *gi[SM_MAX_ROWS]; /* row i of [G0; G1] */
        for (int64_t i = 0; i < r; i++) {
            gi[i] = i < r0 ? G0 + t * sat + i * sar : G1 + t * sbt + (i - r0) * sbr;
            sm_dots(dMt + i * n, gi[i], Ht, shs, n, d);
        }
        /* dH_s = sum_i M[i, s] G_i: rows of G1 first, then G0's (the eager order), 8 columns at a time for every s
         * (each G row read once per chunk; the sums in registers) */
        const float *g[SM_MAX_ROWS];
        float c[SM_MAX_ROWS * SM_MAX_ROWS];
        for (int64_t u = 0; u < r; u++) {
            const int64_t row = (u + r0) % r;
            g[u] = gi[row];
            for (int64_t s = 0; s < n; s++) c[s * r + u] = Mt[row * smr + s * smc];
        }
        int64_t k = 0;
        for (; k + 8 <= d; k += 8)
            for (int64_t s = 0; s < n; s++) {
                const float *cs = c + s * r;
                sm_v8 o = sm_splat(cs[0]) * sm_load(g[0] + k);
                for (int64_t u = 1; u < r; u++) o = sm_vmadd(o, sm_splat(cs[u]), sm_load(g[u] + k));
                memcpy(dHt + s * d + k, &o, sizeof(o));
            }
        for (; k < d; k++)
            for (int64_t s = 0; s < n; s++) {
                const float *cs = c + s * r;
                float o = cs[0] * g[0][k];
                for (int64_t u = 1; u < r; u++) o = SM_MADD(o, cs[u], g[u][k]);
                dHt[s * d + k] = o;
            }
    }
    return 0;
}

int hfd_stream_write_bwd(const float *w, int64_t swt, int64_t sws, const float *dH, int64_t sdt, int64_t sds,
                         const float *y, int64_t syt, float *dy, float *dw, int64_t n, int64_t d, int64_t t0,
                         int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
        const float *dHt = dH + t * sdt, *yt = y + t * syt;
        sm_combine(dy + t * d, w + t * swt, sws, dHt, sds, n, d);
        for (int64_t s = 0; s < n; s++) dw[t * n + s] = hfd_dot(dHt + s * sds, yt, d);
    }
    return 0;
}

/* mHC's Sinkhorn-Knopp per token on an n x n matrix of logits L (rows normalized first, ``iters`` times rows then
 * columns), in the linear domain: P_0 = exp(L - rowmax), then each half-step P_k = P_{k-1} / (its row or column
 * sums). The same iterates as the log-domain form (z <- log_softmax(z), P = exp(z)) to fp32 rounding: every entry
 * stays positive, so no cancellation. Its range is bounded: a token whose logits span more than SK_RANGE (entries
 * e^-SK_RANGE apart, where fp32 would underflow) makes the call return 1 and the caller runs the log-domain form.
 * Backward (recomputing the iterates): for Q = P / s along the normalized dim, dP = (dQ - sum(dQ Q)) / s; then
 * dL = dP_0 P_0 (the row shift leaves the result unchanged).
 * Tokens run SK_LANES at a time, each entry a vector over them ([entry][lane]: every step is a vector op).
 * Layouts: L [tok, n, n] with strides (slt, sli, slj); res, dres, dL [tok, n, n] contiguous. */
#define SK_RANGE 60.0f
#define SK_LANES 16

/* tokens [t, t + nt) of L as lanes: P_0 into P, then the iterates (all of them into P when ``keep``, else two
 * alternating slots) and the normalizers into S [2 iters][n][lanes]; 1 if a token is out of range */
static int sk_block(const float *L, int64_t slt, int64_t sli, int64_t slj, int64_t t, int64_t nt, int64_t n,
                    int64_t iters, int keep, float *P, float *S) {
    const int64_t nn = n * n;
    for (int64_t l = 0; l < SK_LANES; l++) {
        if (l >= nt) { /* padding lanes: zero logits (a valid matrix), results unused */
            for (int64_t e = 0; e < nn; e++) P[e * SK_LANES + l] = 1.0f;
            continue;
        }
        const float *Lt = L + (t + l) * slt;
        float lo = Lt[0], hi = Lt[0];
        for (int64_t i = 0; i < n; i++)
            for (int64_t j = 0; j < n; j++) {
                const float v = Lt[i * sli + j * slj];
                if (!(v - v == 0.0f)) return 1; /* NaN or inf: the log-domain form propagates it */
                lo = v < lo ? v : lo;
                hi = v > hi ? v : hi;
            }
        if (!(hi - lo <= SK_RANGE)) return 1;
        for (int64_t i = 0; i < n; i++) {
            float m = Lt[i * sli];
            for (int64_t j = 1; j < n; j++) m = Lt[i * sli + j * slj] > m ? Lt[i * sli + j * slj] : m;
            for (int64_t j = 0; j < n; j++) P[(i * n + j) * SK_LANES + l] = expf(Lt[i * sli + j * slj] - m);
        }
    }
    for (int64_t k = 0; k < 2 * iters; k++) {
        const float *A = P + (keep ? k : k % 2) * nn * SK_LANES;
        float *B = P + (keep ? k + 1 : (k + 1) % 2) * nn * SK_LANES, *s = S + k * n * SK_LANES;
        const int64_t si = k % 2 == 0 ? n : 1, sj = k % 2 == 0 ? 1 : n; /* rows, then columns */
        for (int64_t i = 0; i < n; i++) {
            float sum[SK_LANES], inv[SK_LANES];
            for (int l = 0; l < SK_LANES; l++) sum[l] = 0.0f;
            for (int64_t j = 0; j < n; j++) {
                const float *a = A + (i * si + j * sj) * SK_LANES;
                for (int l = 0; l < SK_LANES; l++) sum[l] += a[l];
            }
            for (int l = 0; l < SK_LANES; l++) {
                s[i * SK_LANES + l] = sum[l];
                inv[l] = 1.0f / sum[l];
            }
            for (int64_t j = 0; j < n; j++) {
                const float *a = A + (i * si + j * sj) * SK_LANES;
                float *b = B + (i * si + j * sj) * SK_LANES;
                for (int l = 0; l < SK_LANES; l++) b[l] = a[l] * inv[l];
            }
        }
    }
    return 0;
}

static float *sk_buffer(int64_t n, int64_t iters) {
    return (float *)malloc(sizeof(float) * (size_t)(((2 * iters + 1) * n * n + 2 * iters * n) * SK_LANES));
}

int hfd_sinkhorn(const float *L, int64_t slt, int64_t sli, int64_t slj, float *res, int64_t n, int64_t iters,
                 int64_t t0, int64_t t1) {
    float *P = sk_buffer(n, iters);
    if (!P) return 2;
    float *S = P + (2 * iters + 1) * n * n * SK_LANES;
    const int64_t nn = n * n;
    int status = 0;
    for (int64_t t = t0; t < t1 && !status; t += SK_LANES) {
        const int64_t nt = t1 - t < SK_LANES ? t1 - t : SK_LANES;
        status = sk_block(L, slt, sli, slj, t, nt, n, iters, 0, P, S);
        const float *R = P + (2 * iters % 2) * nn * SK_LANES;
        for (int64_t l = 0; l < nt && !status; l++)
            for (int64_t e = 0; e < nn; e++) res[(t + l) * nn + e] = R[e * SK_LANES + l];
    }
    free(P);
    return status;
}

int hfd_sinkhorn_bwd(const float *L, int64_t slt, int64_t sli, int64_t slj, const float *dres, float *dL, int64_t n,
                     int64_t iters, int64_t t0, int64_t t1) {
    float *P = sk_buffer(n, iters);
    if (!P) return 2;
    float *S = P + (2 * iters + 1) * n * n * SK_LANES;
    const int64_t nn = n * n;
    float *G = (float *)malloc(sizeof(float) * (size_t)(nn * SK_LANES));
    if (!G) {
        free(P);
        return 2;
    }
    int status = 0;
    for (int64_t t = t0; t < t1 && !status; t += SK_LANES) {
        const int64_t nt = t1 - t < SK_LANES ? t1 - t : SK_LANES;
        status = sk_block(L, slt, sli, slj, t, nt, n, iters, 1, P, S);
        if (status) break;
        for (int64_t e = 0; e < nn; e++)
            for (int64_t l = 0; l < SK_LANES; l++) G[e * SK_LANES + l] = l < nt ? dres[(t + l) * nn + e] : 0.0f;
        for (int64_t k = 2 * iters - 1; k >= 0; k--) {
            const float *Q = P + (k + 1) * nn * SK_LANES, *s = S + k * n * SK_LANES;
            const int64_t si = k % 2 == 0 ? n : 1, sj = k % 2 == 0 ? 1 : n;
            for (int64_t i = 0; i < n; i++) {
                float dot[SK_LANES], inv[SK_LANES];
                for (int l = 0; l < SK_LANES; l++) dot[l] = 0.0f;
                for (int64_t j = 0; j < n; j++) {
                    const float *g = G + (i * si + j * sj) * SK_LANES, *q = Q + (i * si + j * sj) * SK_LANES;
                    for (int l = 0; l < SK_LANES; l++) dot[l] += g[l] * q[l];
                }
                for (int l = 0; l < SK_LANES; l++) inv[l] = 1.0f / s[i * SK_LANES + l];
                for (int64_t j = 0; j < n; j++) {
                    float *g = G + (i * si + j * sj) * SK_LANES;
                    for (int l = 0; l < SK_LANES; l++) g[l] = (g[l] - dot[l]) * inv[l];
                }
            }
        }
        for (int64_t l = 0; l < nt; l++)
            for (int64_t e = 0; e < nn; e++) dL[(t + l) * nn + e] = G[e * SK_LANES + l] * P[e * SK_LANES + l];
    }
    free(G);
    free(P);
    return status;
}
