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

/* a + b c per lane, rounded as SM_MADD: one fused multiply-add where the CPU has one */
static inline hfd_v8 sm_vmadd(hfd_v8 a, hfd_v8 b, hfd_v8 c) {
#if defined(__FMA__) && defined(__AVX__)
    return (hfd_v8)_mm256_fmadd_ps((__m256)b, (__m256)c, (__m256)a);
#else
    return a + b * c;
#endif
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
            hfd_dots(dMt + i * n, gi[i], Ht, shs, n, d);
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
                hfd_v8 o = hfd_splat(cs[0]) * hfd_load8(g[0] + k);
                for (int64_t u = 1; u < r; u++) o = sm_vmadd(o, hfd_splat(cs[u]), hfd_load8(g[u] + k));
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
        hfd_dots(dw + t * n, yt, dHt, sds, n, d);  /* dw_s = y . dH_s: the products of dH_s . y, the same bits */
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

/* SK_LANES floats as one vector: every step of the iteration is one vector op per entry (element-wise, the same
 * arithmetic and order per lane as a loop over the lanes; one AVX-512 register where the CPU has them) */
typedef float sk_v __attribute__((vector_size(SK_LANES * sizeof(float))));

typedef char sk_splat_lists_16_lanes[SK_LANES == 16 ? 1 : -1]; /* the initializer below names each lane */

static inline sk_v sk_splat(float x) {
    /* one broadcast (GCC compiled a loop over the lanes into 16 masked inserts) */
    const sk_v v = {x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
    return v;
}

static inline sk_v sk_load(const float *p) {
    sk_v v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static inline void sk_store(float *p, sk_v v) { memcpy(p, &v, sizeof(v)); }

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
            sk_v sum = sk_splat(0.0f);
            for (int64_t j = 0; j < n; j++) sum += sk_load(A + (i * si + j * sj) * SK_LANES);
            sk_store(s + i * SK_LANES, sum);
            const sk_v inv = sk_splat(1.0f) / sum;
            for (int64_t j = 0; j < n; j++) {
                const int64_t e = (i * si + j * sj) * SK_LANES;
                sk_store(B + e, sk_load(A + e) * inv);
            }
        }
    }
    return 0;
}

/* G [n n][lanes]: the gradient of the result, in place into that of P_0 (times P_0 gives the logits'), through the
 * iterates and normalizers that sk_block kept */
static void sk_backward(const float *P, const float *S, float *G, int64_t n, int64_t iters) {
    const int64_t nn = n * n;
    for (int64_t k = 2 * iters - 1; k >= 0; k--) {
        const float *Q = P + (k + 1) * nn * SK_LANES, *s = S + k * n * SK_LANES;
        const int64_t si = k % 2 == 0 ? n : 1, sj = k % 2 == 0 ? 1 : n;
        for (int64_t i = 0; i < n; i++) {
            sk_v dot = sk_splat(0.0f);
            for (int64_t j = 0; j < n; j++) {
                const int64_t e = (i * si + j * sj) * SK_LANES;
                dot += sk_load(G + e) * sk_load(Q + e);
            }
            const sk_v inv = sk_splat(1.0f) / sk_load(s + i * SK_LANES);
            for (int64_t j = 0; j < n; j++) {
                const int64_t e = (i * si + j * sj) * SK_LANES;
                sk_store(G + e, (sk_load(G + e) - dot) * inv);
            }
        }
    }
}

/* the normalizers' part [2 iters][n][lanes] of an sk_buffer, after its iterates */
static inline float *sk_norms(float *P, int64_t n, int64_t iters) {
    return P + (2 * iters + 1) * n * n * SK_LANES;
}

static float *sk_buffer(int64_t n, int64_t iters) {
    return (float *)malloc(sizeof(float) * (size_t)(((2 * iters + 1) * n * n + 2 * iters * n) * SK_LANES));
}

int hfd_sinkhorn(const float *L, int64_t slt, int64_t sli, int64_t slj, float *res, int64_t n, int64_t iters,
                 int64_t t0, int64_t t1) {
    float *P = sk_buffer(n, iters);
    if (!P) return 2;
    float *S = sk_norms(P, n, iters);
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
    float *S = sk_norms(P, n, iters);
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
        sk_backward(P, S, G, n, iters);
        for (int64_t l = 0; l < nt; l++)
            for (int64_t e = 0; e < nn; e++) dL[(t + l) * nn + e] = G[e * SK_LANES + l] * P[e * SK_LANES + l];
    }
    free(G);
    free(P);
    return status;
}

/* Dynamic HC's routing of one sublayer (design_hc.HCConnection, hc_dynamic and hc_stream_mixing), per token, all in
 * one pass over its n x d streams H (c = n + 2 projection columns, WT = [W_a | w_b]^T [c, d], built by hc_wt from
 * the parameters W_a [d, n + 1] and w_b [d]):
 *   r_s = 1 / sqrt(mean(H_s^2) + eps),  P[s, j] = r_s (H_s . WT_j),  T = tanh(P)
 *   A[s, i] = sa[s, i] + as T[s, i] (i <= n),  beta_s = sb_s + bs T[s, n + 1]
 *   x = sum_s A[s, 0] H_s,  mixed_i = sum_s A[s, i + 1] H_s     (sm_combine: mix_streams' order and rounding)
 * The backward recomputes T and A from the saved (r, P) and forms, per token, with G_0 = dx and G_{1+i} = dmixed_i:
 *   dA[s, i] = G_i . H_s,  dP[s, i] = as dA[s, i] (1 - T^2) (i <= n),  dP[s, n + 1] = bs dbeta_s (1 - T^2)
 *   dQ[s, j] = r_s dP[s, j],  k_s = (sum_j dP[s, j] P[s, j]) r_s^2 / d
 *   dH_s = sum_i A[s, i] G_i + sum_j dQ[s, j] WT_j - k_s H_s,   dWT_j += sum_s dQ[s, j] H_s
 * and the token sums of dA (d sa), dbeta (d sb), dA T (d as) and dbeta T (d bs), in double.
 * Layouts: H [tok, n, d] (sht, shs); x [tok, d], mixed [tok, n, d], A [tok, n, n + 1], beta [tok, n], r [tok, n],
 * P [tok, n, c] contiguous; G0 [tok, d] (sgt), G1 [tok, n, d] (sbt, sbr), dbeta [tok, n] and dH [tok, n, d]
 * contiguous; the sums go to dWT [blocks, c, d] (float) and red [blocks, n (n + 1) + n + 2] (double), one row per block
 * of ``blk`` tokens, added to in token order: a call covers whole blocks, so the sums never depend on the threads. */
#define HC_MAX_STREAMS 8
#define HC_MAX_COLS (HC_MAX_STREAMS + 2)

/* tanh per lane to a few ulp (Cephes tanhf): an odd polynomial below 0.625, else 1 - 2 / (e^{2|x|} + 1); +-1 from
 * 9 on, and NaN stays NaN */
static inline hfd_v8 sm_tanh(hfd_v8 x) {
    const hfd_i8 sign = (hfd_i8)x & hfd_splat_i(INT32_MIN);
    const hfd_v8 ax = (hfd_v8)((hfd_i8)x & ~hfd_splat_i(INT32_MIN));
    const hfd_v8 z = x * x;
    hfd_v8 p = hfd_splat(-5.70498872745e-3f);
    p = p * z + hfd_splat(2.06390887954e-2f);
    p = p * z + hfd_splat(-5.37397155531e-2f);
    p = p * z + hfd_splat(1.33314422036e-1f);
    p = p * z + hfd_splat(-3.33332819422e-1f);
    const hfd_v8 small = p * z * x + x;
    const hfd_v8 big = hfd_splat(1.0f) - hfd_splat(2.0f) / (hfd_exp8(hfd_select(ax < hfd_splat(9.0f), ax + ax, hfd_splat(18.0f))) + hfd_splat(1.0f));
    const hfd_v8 large = (hfd_v8)((hfd_i8)hfd_select(ax < hfd_splat(9.0f), big, hfd_splat(1.0f)) | sign);
    return hfd_select(ax < hfd_splat(0.625f), small, hfd_select(ax == ax, large, x));
}

/* T = tanh(P) over count floats */
static inline void hc_tanh(float *T, const float *P, int64_t count) {
    int64_t e = 0;
    for (; e + 8 <= count; e += 8) {
        const hfd_v8 v = sm_tanh(hfd_load8(P + e));
        memcpy(T + e, &v, sizeof(v));
    }
    if (e < count) {
        float buf[8] = {0};
        memcpy(buf, P + e, sizeof(float) * (size_t)(count - e));
        const hfd_v8 v = sm_tanh(hfd_load8(buf));
        memcpy(buf, &v, sizeof(v));
        memcpy(T + e, buf, sizeof(float) * (size_t)(count - e));
    }
}

/* T, A and beta of one token from its P */
static inline void hc_gates(const float *P, const float *sa, const float *sb, float as, float bs, int64_t n, float *T,
                            float *A, float *beta) {
    const int64_t c = n + 2;
    hc_tanh(T, P, n * c);
    for (int64_t s = 0; s < n; s++) {
        for (int64_t i = 0; i <= n; i++) A[s * (n + 1) + i] = sa[s * (n + 1) + i] + as * T[s * c + i];
        beta[s] = sb[s] + bs * T[s * c + n + 1];
    }
}

/* sum of squares of h [d] and its c dot products with the rows of WT [c, d], 8 lanes each */
static inline void hc_project(const float *restrict h, const float *restrict WT, int64_t c, int64_t d, float *ss,
                              float *dots) {
    hfd_v8 q = {0}, a[HC_MAX_COLS];
    for (int64_t j = 0; j < c; j++) a[j] = hfd_splat(0.0f);
    int64_t k = 0;
    for (; k + 8 <= d; k += 8) {
        const hfd_v8 v = hfd_load8(h + k);
        q += v * v;
        for (int64_t j = 0; j < c; j++) a[j] += v * hfd_load8(WT + j * d + k);
    }
    float s2 = HFD_SUM8(q);
    for (int64_t j = 0; j < c; j++) dots[j] = HFD_SUM8(a[j]);
    for (; k < d; k++) {
        s2 += h[k] * h[k];
        for (int64_t j = 0; j < c; j++) dots[j] += h[k] * WT[j * d + k];
    }
    *ss = s2;
}

/* the kernels' bodies, inlined with n = 4 (HC's default: every per-stream loop unrolled) and with n as given */
#define HC_INLINE static inline __attribute__((always_inline))
#define HC_DISPATCH(body, n, ...) ((n) == 4 ? body(4, __VA_ARGS__) : body((n), __VA_ARGS__))

HC_INLINE void hc_route_body(int64_t n, const float *H, int64_t sht, int64_t shs, const float *WT, const float *sa,
                             const float *sb, float as, float bs, float eps, float *x, float *mixed, float *A,
                             float *beta, float *r, float *P, int64_t d, int64_t t0, int64_t t1) {
    const int64_t c = n + 2;
    for (int64_t t = t0; t < t1; t++) {
        const float *Ht = H + t * sht;
        float *Pt = P + t * n * c, *At = A + t * n * (n + 1), T[HC_MAX_STREAMS * HC_MAX_COLS];
        for (int64_t s = 0; s < n; s++) {
            float ss, dots[HC_MAX_COLS];
            hc_project(Ht + s * shs, WT, c, d, &ss, dots);
            const float rs = 1.0f / sqrtf(ss / (float)d + eps);
            r[t * n + s] = rs;
            for (int64_t j = 0; j < c; j++) Pt[s * c + j] = dots[j] * rs;
        }
        hc_gates(Pt, sa, sb, as, bs, n, T, At, beta + t * n);
        sm_combine(x + t * d, At, n + 1, Ht, shs, n, d);
        for (int64_t i = 0; i < n; i++) sm_combine(mixed + (t * n + i) * d, At + i + 1, n + 1, Ht, shs, n, d);
    }
}

/* WT = [W_a | w_b]^T [n + 2, d] (the rows the kernels stream) from the parameters as the module holds them, W_a
 * [d, n + 1] and w_b [d] (row-major), into a fresh buffer (NULL: out of memory): a few KiB per call, against a
 * concatenation of two transposed parameters by the caller */
static float *hc_wt(const float *Wa, const float *wb, int64_t n, int64_t d) {
    const int64_t m = n + 1;
    float *WT = malloc(sizeof(float) * (size_t)((m + 1) * d));
    if (!WT) return NULL;
    for (int64_t k = 0; k < d; k++) {
        for (int64_t j = 0; j < m; j++) WT[j * d + k] = Wa[k * m + j];
        WT[m * d + k] = wb[k];
    }
    return WT;
}

int hfd_hc_route(const float *H, int64_t sht, int64_t shs, const float *Wa, const float *wb, const float *sa,
                 const float *sb, const float *asp, const float *bsp, float eps, float *x, float *mixed, float *A,
                 float *beta, float *r, float *P, int64_t n, int64_t d, int64_t t0, int64_t t1) {
    if (n > HC_MAX_STREAMS) return 2; /* the caller checks: never reached from Python */
    float *WT = hc_wt(Wa, wb, n, d);
    if (!WT) return 1;
    const float as = *asp, bs = *bsp;
    HC_DISPATCH(hc_route_body, n, H, sht, shs, WT, sa, sb, as, bs, eps, x, mixed, A, beta, r, P, d, t0, t1);
    free(WT);
    return 0;
}

/* the mixing matrices M = A^T [tok, n + 1, n] (and beta) from saved P, as hfd_hc_route formed them */
int hfd_hc_gates(const float *P, const float *sa, const float *sb, const float *asp, const float *bsp, float *M,
                 float *beta, int64_t n, int64_t t0, int64_t t1) {
    if (n > HC_MAX_STREAMS) return 2;
    const float as = *asp, bs = *bsp;
    const int64_t c = n + 2;
    for (int64_t t = t0; t < t1; t++) {
        float T[HC_MAX_STREAMS * HC_MAX_COLS], A[HC_MAX_STREAMS * (HC_MAX_STREAMS + 1)];
        hc_gates(P + t * n * c, sa, sb, as, bs, n, T, A, beta + t * n);
        for (int64_t s = 0; s < n; s++)
            for (int64_t i = 0; i <= n; i++) M[(t * (n + 1) + i) * n + s] = A[s * (n + 1) + i];
    }
    return 0;
}

/* out_i = sum_s c[i, s] H_s + w_i y (i < n): a mixing then the write, each row as the forward formed it (sm_combine,
 * then one fused multiply-add per element, as ATen's in-place addcmul); c[i, s] at c + i sci + s scs */
static inline void sm_mix_write(float *out, const float *c, int64_t sci, int64_t scs, const float *Ht, int64_t shs,
                                const float *w, int64_t sws, const float *yt, int64_t n, int64_t d) {
    for (int64_t i = 0; i < n; i++) {
        float *o = out + i * d;
        const float wi = w[i * sws];
        sm_combine(o, c + i * sci, scs, Ht, shs, n, d);
        for (int64_t k = 0; k < d; k++) o[k] = SM_MADD(o[k], wi, yt[k]);
    }
}

/* the next sublayer's streams from the saved P, as the forward formed them: mixed_i = sum_s A[s, i + 1] H_s, then
 * H'_i = mixed_i + w_i y (one fused multiply-add per element, as ATen's in-place addcmul of the write); w [tok, n]
 * (swt, sws), y [tok, d] (syt), out [tok, n, d] contiguous */
int hfd_hc_rebuild(const float *H, int64_t sht, int64_t shs, const float *P, const float *sa, const float *sb,
                   const float *asp, const float *bsp, const float *w, int64_t swt, int64_t sws, const float *y,
                   int64_t syt, float *out, int64_t n, int64_t d, int64_t t0, int64_t t1) {
    if (n > HC_MAX_STREAMS) return 2;
    const float as = *asp, bs = *bsp;
    for (int64_t t = t0; t < t1; t++) {
        float T[HC_MAX_STREAMS * HC_MAX_COLS], A[HC_MAX_STREAMS * (HC_MAX_STREAMS + 1)], beta[HC_MAX_STREAMS];
        hc_gates(P + t * n * (n + 2), sa, sb, as, bs, n, T, A, beta);
        sm_mix_write(out + t * n * d, A + 1, 1, n + 1, H + t * sht, shs, w + t * swt, sws, y + t * syt, n, d);
    }
    return 0;
}

HC_INLINE void hc_route_bwd_body(int64_t n, const float *H, int64_t sht, int64_t shs, const float *WT,
                                 const float *sa, const float *sb, float as, float bs, const float *r, const float *P,
                                 const float *G0, int64_t sgt, const float *G1, int64_t sbt, int64_t sbr,
                                 const float *dbeta, float *dH, float *dWTs, double *reds, int64_t blk, int64_t d,
                                 int64_t t0, int64_t t1) {
    const int64_t c = n + 2, m = n + 1;
    for (int64_t t = t0; t < t1; t++) {
        float *dWT = dWTs + (t / blk) * c * d; /* the sums of this token's block */
        double *dsa = reds + (t / blk) * (n * m + n + 2), *dsb = dsa + n * m, *das = dsb + n, *dbs = das + 1;
        const float *Ht = H + t * sht, *Pt = P + t * n * c, *rt = r + t * n, *dbt = dbeta + t * n;
        float *dHt = dH + t * n * d;
        float T[HC_MAX_STREAMS * HC_MAX_COLS], A[HC_MAX_STREAMS * (HC_MAX_STREAMS + 1)], beta[HC_MAX_STREAMS];
        hc_gates(Pt, sa, sb, as, bs, n, T, A, beta);
        const float *g[HC_MAX_STREAMS + 1];
        g[0] = G0 + t * sgt;
        for (int64_t i = 0; i < n; i++) g[i + 1] = G1 + t * sbt + i * sbr;
        float dA[HC_MAX_STREAMS + 1][HC_MAX_STREAMS]; /* dA[i][s] = G_i . H_s (dM) */
        for (int64_t i = 0; i < m; i++) hfd_dots(dA[i], g[i], Ht, shs, n, d);
        float dQ[HC_MAX_STREAMS * HC_MAX_COLS], ks[HC_MAX_STREAMS];
        double ta = 0.0, tb = 0.0;
        for (int64_t s = 0; s < n; s++) {
            float kp = 0.0f;
            for (int64_t j = 0; j < c; j++) {
                const float Tj = T[s * c + j], g1 = j < m ? dA[j][s] : dbt[s];
                const float dP = g1 * (j < m ? as : bs) * (1.0f - Tj * Tj);
                if (j < m) {
                    dsa[s * m + j] += g1;
                    ta += (double)g1 * Tj;
                } else {
                    dsb[s] += g1;
                    tb += (double)g1 * Tj;
                }
                dQ[s * c + j] = dP * rt[s];
                kp += dP * Pt[s * c + j];
            }
            ks[s] = -(kp * (rt[s] * rt[s] / (float)d));
        }
        *das += ta;
        *dbs += tb;
        int64_t k = 0;
        for (; k + 8 <= d; k += 8) {
            hfd_v8 h[HC_MAX_STREAMS], gv[HC_MAX_STREAMS + 1], w[HC_MAX_COLS];
            for (int64_t s = 0; s < n; s++) h[s] = hfd_load8(Ht + s * shs + k);
            for (int64_t i = 0; i < m; i++) gv[i] = hfd_load8(g[i] + k);
            for (int64_t j = 0; j < c; j++) w[j] = hfd_load8(WT + j * d + k);
            for (int64_t s = 0; s < n; s++) {
                const float *As = A + s * m, *dQs = dQ + s * c;
                hfd_v8 o = hfd_splat(As[1]) * gv[1]; /* the mixing's rows first, then the branch input's (the eager order) */
                for (int64_t i = 2; i < m; i++) o = sm_vmadd(o, hfd_splat(As[i]), gv[i]);
                o = sm_vmadd(o, hfd_splat(As[0]), gv[0]);
                for (int64_t j = 0; j < c; j++) o = sm_vmadd(o, hfd_splat(dQs[j]), w[j]);
                o = sm_vmadd(o, hfd_splat(ks[s]), h[s]);
                memcpy(dHt + s * d + k, &o, sizeof(o));
            }
            for (int64_t j = 0; j < c; j++) {
                hfd_v8 acc = hfd_load8(dWT + j * d + k);
                for (int64_t s = 0; s < n; s++) acc = sm_vmadd(acc, hfd_splat(dQ[s * c + j]), h[s]);
                memcpy(dWT + j * d + k, &acc, sizeof(acc));
            }
        }
        for (; k < d; k++)
            for (int64_t s = 0; s < n; s++) {
                const float *As = A + s * m, *dQs = dQ + s * c, hk = Ht[s * shs + k];
                float o = As[1] * g[1][k];
                for (int64_t i = 2; i < m; i++) o = SM_MADD(o, As[i], g[i][k]);
                o = SM_MADD(o, As[0], g[0][k]);
                for (int64_t j = 0; j < c; j++) {
                    o = SM_MADD(o, dQs[j], WT[j * d + k]);
                    dWT[j * d + k] = SM_MADD(dWT[j * d + k], dQs[j], hk);
                }
                dHt[s * d + k] = SM_MADD(o, ks[s], hk);
            }
    }
}

int hfd_hc_route_bwd(const float *H, int64_t sht, int64_t shs, const float *Wa, const float *wb, const float *sa,
                     const float *sb, const float *asp, const float *bsp, const float *r, const float *P,
                     const float *G0, int64_t sgt, const float *G1, int64_t sbt, int64_t sbr, const float *dbeta,
                     float *dH, float *dWT, double *red, int64_t blk, int64_t n, int64_t d, int64_t t0, int64_t t1) {
    if (n > HC_MAX_STREAMS) return 2;
    float *WT = hc_wt(Wa, wb, n, d);
    if (!WT) return 1;
    const float as = *asp, bs = *bsp;
    HC_DISPATCH(hc_route_bwd_body, n, H, sht, shs, WT, sa, sb, as, bs, r, P, G0, sgt, G1, sbt, sbr, dbeta, dH, dWT,
                red, blk, d, t0, t1);
    free(WT);
    return 0;
}

/* The parameter gradients of hfd_hc_route_bwd from its per-block sums (dWTs [blocks, n + 2, d] float, reds [blocks,
 * n (n + 1) + n + 2] double), summed over the blocks in block order (whatever the threads), into out, in the layouts of
 * the parameters: d W_a [d, n + 1], d w_b [d], d static_alpha [n, n + 1], d static_beta [n], d alpha_scale,
 * d beta_scale (the double sums rounded to float once). */
/* out[e] = the sum over the blocks, in block order, of the per-block sums reds [blocks, width] (double), rounded to
 * float once: the scalar parameter gradients of the HC and mHC backwards, whatever the threads */
int hfd_block_sums(const double *reds, int64_t blocks, int64_t width, float *out) {
    for (int64_t e = 0; e < width; e++) {
        double s = reds[e];
        for (int64_t b = 1; b < blocks; b++) s += reds[b * width + e];
        out[e] = (float)s;
    }
    return 0;
}

int hfd_hc_route_bwd_sums(const float *dWTs, const double *reds, int64_t blocks, int64_t n, int64_t d, float *out) {
    const int64_t m = n + 1, c = n + 2, nr = n * m + n + 2;
    float *dWa = out, *dwb = out + d * m, *rest = dwb + d;
    for (int64_t j = 0; j < c; j++)
        for (int64_t k = 0; k < d; k++) {
            float s = dWTs[j * d + k];
            for (int64_t b = 1; b < blocks; b++) s += dWTs[(b * c + j) * d + k];
            if (j < m) dWa[k * m + j] = s;
            else dwb[k] = s;
        }
    return hfd_block_sums(reds, blocks, nr, rest);
}

/* the streams after a sublayer from its mixing matrices M [tok, n + 1, n] (rows 1..n mix; smt, smr, smc): the
 * segment rebuild of mHC (whose forward saves M) */
int hfd_stream_mix_write(const float *M, int64_t smt, int64_t smr, int64_t smc, const float *H, int64_t sht,
                         int64_t shs, const float *w, int64_t swt, int64_t sws, const float *y, int64_t syt, float *out,
                         int64_t n, int64_t d, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++)
        sm_mix_write(out + t * n * d, M + t * smt + smr, smr, smc, H + t * sht, shs, w + t * swt, sws, y + t * syt,
                     n, d);
    return 0;
}

/* sum of the squares of one token's n streams of d (rows sx apart), 8 lanes */
static inline float hfd_sumsq(const float *x, int64_t sx, int64_t n, int64_t d) {
    hfd_v8 q = {0};
    float tail = 0.0f;
    for (int64_t s = 0; s < n; s++) {
        const float *row = x + s * sx;
        int64_t k = 0;
        for (; k + 8 <= d; k += 8) {
            const hfd_v8 v = hfd_load8(row + k);
            q += v * v;
        }
        for (; k < d; k++) tail += row[k] * row[k];
    }
    return HFD_SUM8(q) + tail;
}

/* mHC's routing of one sublayer (design_mhc.MHCConnection) after the product of its projection proj [tok, C]
 * (C = n^2 + 2n; vec(H) phi, the caller's GEMM), per token: r = 1 / rms(vec(H)) (eps), proj *= r in place, then
 *   u = tanh(proj) (``tanh``) or proj;  pre = sigmoid(a0 u[:n] + b[:n]);  post = 2 sigmoid(a1 u[n:2n] + b[n:2n])
 *   res = Sinkhorn(a2 u[2n:] + b[2n:], as [n, n] row-major; transposed in and out for ``cf``, columns first)
 *   M = [pre; res] [n + 1, n];  x = sum_s pre_s H_s,  mixed_i = sum_s res[i, s] H_s
 * SK_LANES tokens at a time (the Sinkhorn's lanes). Returns 1 (nothing usable written) when some token's logits are
 * out of the linear-domain Sinkhorn's range (the caller runs the log-domain form). Layouts: H [tok, n, d] (sht,
 * shs); proj [tok, C], r [tok], x [tok, d], mixed [tok, n, d], M [tok, n + 1, n], post [tok, n] contiguous. */
#define MHC_MAX_STREAMS 8
#define MHC_MAX_COLS (MHC_MAX_STREAMS * MHC_MAX_STREAMS + 2 * MHC_MAX_STREAMS)

/* u, pre, post and the Sinkhorn's logits (lane l of L [n n][SK_LANES], as the Sinkhorn reads them) of one token */
static inline void mhc_gates(const float *proj, const float *b, const float *a, int tanh_on, int cf, int64_t n,
                             float *u, float *pre, float *post, float *L, int64_t l) {
    const int64_t C = n * n + 2 * n;
    if (tanh_on)
        hc_tanh(u, proj, C);
    else
        memcpy(u, proj, sizeof(float) * (size_t)C);
    for (int64_t s = 0; s < n; s++) {
        pre[s] = 1.0f / (1.0f + expf(-(a[0] * u[s] + b[s])));
        post[s] = 2.0f / (1.0f + expf(-(a[1] * u[n + s] + b[n + s])));
    }
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < n; j++) {
            const float v = a[2] * u[2 * n + i * n + j] + b[2 * n + i * n + j];
            L[(cf ? j * n + i : i * n + j) * SK_LANES + l] = v;
        }
}

int hfd_mhc_route(const float *H, int64_t sht, int64_t shs, float *proj, float *r, float eps, const float *b,
                  const float *a, int64_t tanh_on, int64_t cf, int64_t iters, float *x, float *mixed, float *M,
                  float *post, int64_t n, int64_t d, int64_t t0, int64_t t1) {
    if (n > MHC_MAX_STREAMS) return 2;
    const int64_t nn = n * n, C = nn + 2 * n, m = n + 1;
    float *P = sk_buffer(n, iters);
    if (!P) return 2;
    float *S = sk_norms(P, n, iters);
    float L[MHC_MAX_STREAMS * MHC_MAX_STREAMS * SK_LANES], pre[SK_LANES][MHC_MAX_STREAMS];
    int status = 0;
    for (int64_t t = t0; t < t1 && !status; t += SK_LANES) {
        const int64_t nt = t1 - t < SK_LANES ? t1 - t : SK_LANES;
        for (int64_t l = 0; l < nt; l++) {
            float u[MHC_MAX_COLS], *pt = proj + (t + l) * C;
            const float rt = 1.0f / sqrtf(hfd_sumsq(H + (t + l) * sht, shs, n, d) / (float)(n * d) + eps);
            r[t + l] = rt;
            for (int64_t j = 0; j < C; j++) pt[j] *= rt; /* the normalized projection, in place */
            mhc_gates(pt, b, a, (int)tanh_on, (int)cf, n, u, pre[l], post + (t + l) * n, L, l);
        }
        status = sk_block(L, 1, n * SK_LANES, SK_LANES, 0, nt, n, iters, 0, P, S);
        for (int64_t l = 0; l < nt && !status; l++) {
            float *Mt = M + (t + l) * m * n;
            for (int64_t s = 0; s < n; s++) Mt[s] = pre[l][s];
            for (int64_t i = 0; i < n; i++)
                for (int64_t s = 0; s < n; s++) Mt[(1 + i) * n + s] = P[(cf ? s * n + i : i * n + s) * SK_LANES + l];
            const float *Ht = H + (t + l) * sht;
            sm_combine(x + (t + l) * d, Mt, 1, Ht, shs, n, d);
            for (int64_t i = 0; i < n; i++) sm_combine(mixed + ((t + l) * n + i) * d, Mt + (1 + i) * n, 1, Ht, shs, n, d);
        }
    }
    free(P);
    return status;
}

/* The backward of hfd_mhc_route up to the projection, per token, with G_0 = dx, G_{1+i} = dmixed_i:
 *   dM[i, s] = G_i . H_s;  du_pre = dM[0] pre (1 - pre);  du_post = dpost post (1 - post / 2)
 *   du_res = the Sinkhorn's backward of dM[1:] (iterates recomputed);  du = [du_pre, du_post, du_res]
 *   dproj = du [a0 .. | a1 .. | a2 ..] (times 1 - u^2 for ``tanh``);  dQ = dproj r;  k = (dproj . proj) r^2 / (n d)
 *   dH_s = sum_i M[i, s] G_i - k H_s   (the projection's dQ phi^T is the caller's product)
 * and, per block of ``blk`` tokens (a multiple of SK_LANES), the token sums of du (d bias) and of du u by gate
 * (d a0, d a1, d a2), in double: reds [blocks, C + 3], each row added to from zero in token order (a call covers
 * whole blocks: the sums never depend on the threads; hfd_block_sums adds the blocks). Layouts: r [tok],
 * M [tok, n + 1, n] (the forward's), G0 [tok, d] (sgt), G1 [tok, n, d] (sbt, sbr), dpost [tok, n], dH [tok, n, d]
 * and dQ [tok, C] contiguous. */
/* dH_s = sum_i M[i, s] G_i (rows 1.. first, then row 0) + k H_s for one token, 8 columns at a time */
HC_INLINE void mhc_dH(int64_t n, float *dHt, const float *Mt, const float *const *g, const float *Ht, int64_t shs,
                      float k, int64_t d) {
    const int64_t m = n + 1;
    int64_t c = 0;
    for (; c + 8 <= d; c += 8) {
        hfd_v8 gv[MHC_MAX_STREAMS + 1];
        for (int64_t i = 0; i < m; i++) gv[i] = hfd_load8(g[i] + c);
        for (int64_t s = 0; s < n; s++) {
            hfd_v8 o = hfd_splat(Mt[n + s]) * gv[1];
            for (int64_t i = 2; i < m; i++) o = sm_vmadd(o, hfd_splat(Mt[i * n + s]), gv[i]);
            o = sm_vmadd(o, hfd_splat(Mt[s]), gv[0]);
            o = sm_vmadd(o, hfd_splat(k), hfd_load8(Ht + s * shs + c));
            memcpy(dHt + s * d + c, &o, sizeof(o));
        }
    }
    for (; c < d; c++)
        for (int64_t s = 0; s < n; s++) {
            float v = Mt[n + s] * g[1][c];
            for (int64_t i = 2; i < m; i++) v = SM_MADD(v, Mt[i * n + s], g[i][c]);
            v = SM_MADD(v, Mt[s], g[0][c]);
            dHt[s * d + c] = SM_MADD(v, k, Ht[s * shs + c]);
        }
}

int hfd_mhc_route_bwd(const float *H, int64_t sht, int64_t shs, const float *proj, const float *r, const float *M,
                      const float *b, const float *a, int64_t tanh_on, int64_t cf, int64_t iters, const float *G0,
                      int64_t sgt, const float *G1, int64_t sbt, int64_t sbr, const float *dpost, float *dH,
                      float *dQ, double *reds, int64_t blk, int64_t n, int64_t d, int64_t t0, int64_t t1) {
    if (n > MHC_MAX_STREAMS) return 2;
    const int64_t nn = n * n, C = nn + 2 * n, m = n + 1;
    float *P = sk_buffer(n, iters);
    if (!P) return 2;
    float *S = sk_norms(P, n, iters);
    float L[MHC_MAX_STREAMS * MHC_MAX_STREAMS * SK_LANES], G[MHC_MAX_STREAMS * MHC_MAX_STREAMS * SK_LANES];
    float u[SK_LANES][MHC_MAX_COLS], pre[SK_LANES][MHC_MAX_STREAMS], post[SK_LANES][MHC_MAX_STREAMS];
    float dM[SK_LANES][(MHC_MAX_STREAMS + 1) * MHC_MAX_STREAMS];
    int status = 0;
    for (int64_t t = t0; t < t1 && !status; t += SK_LANES) {
        const int64_t nt = t1 - t < SK_LANES ? t1 - t : SK_LANES;
        if (t % blk == 0) memset(reds + (t / blk) * (C + 3), 0, sizeof(double) * (size_t)(C + 3)); /* a block's sums */
        for (int64_t l = 0; l < SK_LANES; l++) {
            if (l < nt) mhc_gates(proj + (t + l) * C, b, a, (int)tanh_on, (int)cf, n, u[l], pre[l], post[l], L, l);
            for (int64_t e = 0; e < nn; e++) G[e * SK_LANES + l] = 0.0f;
        }
        for (int64_t l = 0; l < nt; l++) {
            const float *Ht = H + (t + l) * sht;
            hfd_dots(dM[l], G0 + (t + l) * sgt, Ht, shs, n, d);
            for (int64_t i = 0; i < n; i++) {
                hfd_dots(dM[l] + (1 + i) * n, G1 + (t + l) * sbt + i * sbr, Ht, shs, n, d);
                for (int64_t s = 0; s < n; s++) /* the result's gradient as the Sinkhorn laid it out */
                    G[(cf ? s * n + i : i * n + s) * SK_LANES + l] = dM[l][(1 + i) * n + s];
            }
        }
        status = sk_block(L, 1, n * SK_LANES, SK_LANES, 0, nt, n, iters, 1, P, S);
        if (status) break;
        sk_backward(P, S, G, n, iters);
        for (int64_t l = 0; l < nt; l++) {
            const int64_t tt = t + l;
            double *red = reds + (tt / blk) * (C + 3);
            const float *pt = proj + tt * C, *Ht = H + tt * sht, *Mt = M + tt * m * n, rt = r[tt];
            float du[MHC_MAX_COLS], kp = 0.0f;
            for (int64_t s = 0; s < n; s++) {
                du[s] = dM[l][s] * pre[l][s] * (1.0f - pre[l][s]);
                du[n + s] = dpost[tt * n + s] * post[l][s] * (1.0f - 0.5f * post[l][s]);
            }
            for (int64_t i = 0; i < n; i++)
                for (int64_t j = 0; j < n; j++) {
                    const int64_t e = cf ? j * n + i : i * n + j;
                    du[2 * n + i * n + j] = G[e * SK_LANES + l] * P[e * SK_LANES + l];
                }
            for (int64_t j = 0; j < C; j++) {
                const int g = j < n ? 0 : (j < 2 * n ? 1 : 2);
                red[j] += du[j];
                red[C + g] += (double)du[j] * u[l][j];
                float dp = du[j] * a[g];
                if (tanh_on) dp = dp * (1.0f - u[l][j] * u[l][j]);
                dQ[tt * C + j] = dp * rt;
                kp += dp * pt[j];
            }
            const float k = -(kp * (rt * rt / (float)(n * d)));
            /* dH_s = sum_i M[i, s] G_i (the mixing's rows first, then the branch input's: the eager order) - k H_s */
            const float *g[MHC_MAX_STREAMS + 1];
            g[0] = G0 + tt * sgt;
            for (int64_t i = 0; i < n; i++) g[i + 1] = G1 + tt * sbt + i * sbr;
            HC_DISPATCH(mhc_dH, n, dH + tt * n * d, Mt, g, Ht, shs, k, d);
        }
    }
    free(P);
    return status;
}
