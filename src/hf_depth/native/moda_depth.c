/* MoDA's depth part on CPU in fp32, reading each depth bank once per direction (``hf_depth.native``).
 *
 * The same function as hf_depth.models.depth_ops._MoDAFlash's depth terms (its eager form):
 *   forward   s_j = scaling q . K_j (j live),  tot = logaddexp(lse, logsumexp_j s_j),
 *             o <- o exp(lse - tot) + sum_j exp(s_j - tot) V_j,   lse <- tot
 *   backward  p_j = exp(s_j - tot),  dd_j = p_j (dO . V_j - dO . o) scaling,  dq += sum_j dd_j K_j
 *             (masked slots: p_j = dd_j = 0); p and dd are written out, [D, B, H, T], and the slot gradients
 *   slots     gK_j = sum_i sum_{heads of the kv head} dd_ij q_i,  gV_j = sum_i p_ij dO_i
 *             are summed once, over every consumer i of slot j, when the slot's first reader runs backward:
 *             the banks' gradients are written once instead of read and written by every consumer.
 *
 * Layouts (strides in elements):
 *   q, dout, dq  [B, H, T, hd], any strides (q*, d*, g*)
 *   o            [B, T, H, hd], contiguous (the joint output; forward: in/out)
 *   lse          [B, H, T], any strides (l*) (forward: the sequence lse in, the joint lse out; backward: joint)
 *   K, V         [D, B, Hkv, T, hd], strides sk, sv (the last 1): the depth banks' first D slots (slot-major:
 *                a slot's rows of one (b, kv head) contiguous, read TC at a time)
 *   p, dd        [D, B, H, T], contiguous (slot-major: a slot's weights are contiguous for its gradient)
 *   live         [D] uint8, or NULL for every slot live
 * H = Hkv rep (GQA: the rep query heads of one kv head are handled together, so a bank row is read once).
 * Work items are (b, kv head, chunk of TC tokens); a call handles items [item0, item1) (threads split the range).
 * Within an item the slots are the outer loop, SB of them at a time, so each pass streams TC contiguous rows of
 * SB slots (runs of 32 KB at TC = 128, hd = 64: long runs are what a DRAM-bound pass needs). The backward reads V
 * first (dO . V_j), then K once: per SB slots their scores, p and dd, and their dq terms while the rows are in
 * cache. No FMA contraction (-std=c99): each product and sum rounds as in the eager form; the slots' exponentials
 * are hfd_exp_shift's, eight slots at a time (within 1 ulp of expf; a masked slot's -inf gives 0).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#ifndef TC
#define TC 128
#endif
#ifndef SB
#define SB 8
#endif

/* y += sum_u w[u] x[u slot + .] over jn rows of consecutive slots, four per pass over y (hfd_axpy4: the terms in
 * order, the bits of jn hfd_axpy calls) */
static inline void axpy_slots(float *restrict y, const float *restrict w, const float *restrict x, int64_t slot,
                              int64_t jn, int64_t n) {
    int64_t u = 0;
    for (; u + 4 <= jn; u += 4)
        hfd_axpy4(y, w + u, x + u * slot, x + (u + 1) * slot, x + (u + 2) * slot, x + (u + 3) * slot, n);
    for (; u < jn; u++) hfd_axpy(y, w[u], x + u * slot, n);
}

typedef struct {
    int64_t b, hk, t0, tn;
} item_t;

static inline item_t item(int64_t it, int64_t Hkv, int64_t T) {
    const int64_t chunks = (T + TC - 1) / TC;
    item_t x = {it / (Hkv * chunks), (it / chunks) % Hkv, (it % chunks) * TC, 0};
    x.tn = T - x.t0 < TC ? T - x.t0 : TC;
    return x;
}

/* rows [rep][tn][hd] of x (strides s0..s3) for batch b, heads h0.., tokens t0.. into a contiguous buffer */
static void gather(float *restrict dst, const float *x, const int64_t *s, int64_t b, int64_t h0, int64_t rep,
                   int64_t t0, int64_t tn, int64_t hd) {
    for (int64_t r = 0; r < rep; r++)
        for (int64_t ti = 0; ti < tn; ti++) {
            const float *src = x + b * s[0] + (h0 + r) * s[1] + (t0 + ti) * s[2];
            float *d = dst + (r * TC + ti) * hd;
            if (s[3] == 1) memcpy(d, src, (size_t)hd * sizeof(float));
            else for (int64_t i = 0; i < hd; i++) d[i] = src[i * s[3]];
        }
}

/* s[r][ti][j] = scaling x_r,ti . B_j,ti for the item's rows and slots j in [ja, jb) (rows of D: x the gathered q or
 * dO; row (j, ti) of the bank at Bk + j sj + ti st); masked slots: -INFINITY */
static void slot_dots(float *restrict s, const float *xc, const float *Bk, const uint8_t *live, int64_t D, int64_t ja,
                      int64_t jb, int64_t sj, int64_t st, int64_t rep, int64_t tn, int64_t hd, float scaling) {
    for (int64_t j0 = ja; j0 < jb; j0 += SB) {
        const int64_t jn = jb - j0 < SB ? jb - j0 : SB;
        for (int64_t ti = 0; ti < tn; ti++)
            for (int64_t r = 0; r < rep; r++) {
                const float *x = xc + (r * TC + ti) * hd;
                float *sp = s + (r * TC + ti) * D + j0;
                hfd_dots(sp, x, Bk + j0 * sj + ti * st, sj, jn, hd);  /* hfd_dot's bits, four rows at a time */
                for (int64_t u = 0; u < jn; u++) sp[u] = (!live || live[j0 + u]) ? sp[u] * scaling : -INFINITY;
            }
    }
}

/* acc[r][ti] += sum_j w[r][ti][j] B_j,ti over slots [ja, jb) (w: [rep][TC][D]; masked slots carry w = 0); rows as in
 * slot_dots */
static void slot_mix(float *restrict acc, const float *w, const float *Bv, int64_t D, int64_t ja, int64_t jb,
                     int64_t sj, int64_t st, int64_t rep, int64_t tn, int64_t hd) {
    for (int64_t j0 = ja; j0 < jb; j0 += SB) {
        const int64_t jn = jb - j0 < SB ? jb - j0 : SB;
        for (int64_t ti = 0; ti < tn; ti++)
            for (int64_t r = 0; r < rep; r++)
                axpy_slots(acc + (r * TC + ti) * hd, w + (r * TC + ti) * D + j0, Bv + j0 * sj + ti * st, sj, jn, hd);
    }
}

int hfd_moda_depth_fwd(const float *q, const int64_t *sq, const float *K, const int64_t *sk, const float *V,
                       const int64_t *sv, float *o, float *lse, const int64_t *sl, const uint8_t *live, int64_t D, int64_t B, int64_t H, int64_t Hkv,
                       int64_t T, int64_t hd, float scaling, int64_t item0, int64_t item1) {
    const int64_t rep = H / Hkv, n = rep * TC;
    float *s = malloc(sizeof(float) * (size_t)(n * (D + 2 * hd) + D));
    if (!s) return 1;
    float *qc = s + n * D, *oc = qc + n * hd, *e = oc + n * hd;
    (void)B;
    for (int64_t it = item0; it < item1; it++) {
        const item_t x = item(it, Hkv, T);
        const int64_t rk = x.b * sk[1] + x.hk * sk[2] + x.t0 * sk[3], rv = x.b * sv[1] + x.hk * sv[2] + x.t0 * sv[3];
        gather(qc, q, sq, x.b, x.hk * rep, rep, x.t0, x.tn, hd);
        slot_dots(s, qc, K + rk, live, D, 0, D, sk[0], sk[3], rep, x.tn, hd, scaling);
        for (int64_t r = 0; r < rep; r++)
            for (int64_t ti = 0; ti < x.tn; ti++) {
                float *sr = s + (r * TC + ti) * D, *lp = lse + x.b * sl[0] + (x.hk * rep + r) * sl[1] + (x.t0 + ti) * sl[2];
                float mx = *lp;
                for (int64_t j = 0; j < D; j++) mx = sr[j] > mx ? sr[j] : mx;
                hfd_exp_shift(e, sr, mx, D);
                float sum = expf(*lp - mx);
                for (int64_t j = 0; j < D; j++) sum += e[j];
                const float tot = mx + logf(sum), a = expf(*lp - tot);
                hfd_exp_shift(sr, sr, tot, D);
                float *op = o + ((x.b * T + x.t0 + ti) * H + x.hk * rep + r) * hd;
                for (int64_t i = 0; i < hd; i++) op[i] *= a;
                *lp = tot;
            }
        memset(oc, 0, sizeof(float) * (size_t)(n * hd));
        slot_mix(oc, s, V + rv, D, 0, D, sv[0], sv[3], rep, x.tn, hd);
        for (int64_t r = 0; r < rep; r++)
            for (int64_t ti = 0; ti < x.tn; ti++)
                hfd_axpy(o + ((x.b * T + x.t0 + ti) * H + x.hk * rep + r) * hd, 1.0f, oc + (r * TC + ti) * hd, hd);
    }
    free(s);
    return 0;
}

int hfd_moda_depth_bwd(const float *q, const int64_t *sq, const float *dout, const int64_t *sd, float *dq,
                       const int64_t *sg, const float *K, const int64_t *sk, const float *V, const int64_t *sv,
                       const float *o, const float *lse,
                       const int64_t *sl, const uint8_t *live, float *P, float *DD, int64_t D, int64_t B, int64_t H,
                       int64_t Hkv, int64_t T, int64_t hd, float scaling, int64_t item0, int64_t item1) {
    const int64_t rep = H / Hkv, n = rep * TC;
    float *p = malloc(sizeof(float) * (size_t)(n * (2 * D + 3 * hd + 1)));
    if (!p) return 1;
    float *dd = p + n * D, *qc = dd + n * D, *dc = qc + n * hd, *gq = dc + n * hd, *rs = gq + n * hd;
    for (int64_t it = item0; it < item1; it++) {
        const item_t x = item(it, Hkv, T);
        const int64_t rk = x.b * sk[1] + x.hk * sk[2] + x.t0 * sk[3], rv = x.b * sv[1] + x.hk * sv[2] + x.t0 * sv[3];
        gather(qc, q, sq, x.b, x.hk * rep, rep, x.t0, x.tn, hd);
        gather(dc, dout, sd, x.b, x.hk * rep, rep, x.t0, x.tn, hd);
        slot_dots(dd, dc, V + rv, live, D, 0, D, sv[0], sv[3], rep, x.tn, hd, 1.0f);  /* the V pass: dO . V_j */
        for (int64_t r = 0; r < rep; r++)
            for (int64_t ti = 0; ti < x.tn; ti++)
                rs[r * TC + ti] = hfd_dot(dc + (r * TC + ti) * hd, o + ((x.b * T + x.t0 + ti) * H + x.hk * rep + r) * hd,
                                          hd);
        memset(gq, 0, sizeof(float) * (size_t)(n * hd));
        /* the K pass, SB slots at a time: scores, p and dd, then dq from the same rows while they are in cache */
        for (int64_t j0 = 0; j0 < D; j0 += SB) {
            const int64_t j1 = D - j0 < SB ? D : j0 + SB;
            slot_dots(p, qc, K + rk, live, D, j0, j1, sk[0], sk[3], rep, x.tn, hd, scaling);
            for (int64_t r = 0; r < rep; r++)
                for (int64_t ti = 0; ti < x.tn; ti++) {
                    const int64_t h = x.hk * rep + r, k = r * TC + ti;
                    const float tot = lse[x.b * sl[0] + h * sl[1] + (x.t0 + ti) * sl[2]], rsum = rs[k];
                    float *pr = p + k * D, *dr = dd + k * D;
                    const int64_t out = (x.b * H + h) * T + x.t0 + ti, plane = B * H * T;  /* P, DD: [D, B, H, T] */
                    hfd_exp_shift(pr + j0, pr + j0, tot, j1 - j0);
                    for (int64_t j = j0; j < j1; j++) {
                        const int on = !live || live[j];
                        pr[j] = on ? pr[j] : 0.0f;
                        dr[j] = on ? pr[j] * (dr[j] - rsum) * scaling : 0.0f;
                        P[j * plane + out] = pr[j];
                        DD[j * plane + out] = dr[j];
                    }
                }
            slot_mix(gq, dd, K + rk, D, j0, j1, sk[0], sk[3], rep, x.tn, hd);  /* dq */
        }
        for (int64_t r = 0; r < rep; r++)
            for (int64_t ti = 0; ti < x.tn; ti++) {
                float *dst = dq + x.b * sg[0] + (x.hk * rep + r) * sg[1] + (x.t0 + ti) * sg[2];
                const float *src = gq + (r * TC + ti) * hd;
                for (int64_t i = 0; i < hd; i++) dst[i * sg[3]] += src[i];
            }
    }
    free(p);
    return 0;
}

/* The gradients of slots [j0, j1) of one bank, summed over its n consumers i (each read D_i slots):
 *   G[j - j0] = sum_i sum_r W_i[j, b, hk rep + r, t] X_i[b, hk rep + r, t, :]      (0 where no consumer reads j)
 * with (W, X) = (dd, q) for keys and (p, dO) for values. W_i [D_i, B, H, T] contiguous; X_i [B, H, T, hd] with
 * strides xs[4 i .. 4 i + 3]; G [j1 - j0, B, Hkv, T, hd] contiguous, written once (or, with ``accumulate``, the
 * consumers' sum added to it: AttnRes' grouped bank gradients, native.SlotGrads with an accumulator). Work items are
 * (b, chunk of GT tokens), cut into tiles of tt tokens x every kv head, whose output rows fit an ACC-float accumulator
 * (256 KB, L2-resident: a tile reads each consumer's rows as one run of up to 128 tokens, 128 KB at 4 kv heads of
 * 64, where 8-token tiles resumed ~30 runs of 8 KB each; one token where a token's rows alone exceed it). Per tile and
 * slot the consumers are taken four at a time, each four read over the tile's tokens and heads in memory order (the
 * attention's q and dO are [B, T, H, hd] in memory: a token's heads are adjacent), so few streams are in flight;
 * each row's terms are still added in (head, consumer) order, four per pass over the row (hfd_axpy4), and each row
 * is stored once. */
#ifndef GT
#define GT 128
#endif
#ifndef ACC
#define ACC 65536
#endif

int hfd_moda_slot_grads(int64_t ncons, const float *const *W, const int64_t *Dn, const float *const *X,
                        const int64_t *xs, float *G, int64_t j0, int64_t j1, int64_t B, int64_t H, int64_t Hkv,
                        int64_t T, int64_t hd, int64_t accumulate, int64_t item0, int64_t item1) {
    const int64_t rep = H / Hkv, slot = B * Hkv * T * hd, nj = j1 - j0, chunks = (T + GT - 1) / GT, plane = B * H * T;
    /* tokens per tile: the tile's accumulator rows [Hkv][nj][tt][hd] stay within ACC floats (at least one token) */
    int64_t tt = ACC / (Hkv * nj * hd > 0 ? Hkv * nj * hd : 1);
    tt = tt < 1 ? 1 : tt > GT ? GT : tt;
    const int64_t arow = tt * hd, ahk = nj * arow;  /* acc strides: per slot, per kv head */
    float *acc = malloc(sizeof(float) * (size_t)(Hkv * ahk));
    /* per slot, the consumers that read it, in order (ms[j - j0] of them at cs + (j - j0) ncons), listed once */
    int64_t *ms = malloc(sizeof(int64_t) * (size_t)(nj * (ncons + 1) + 1));
    if (!acc || !ms) {
        free(acc);
        free(ms);
        return 1;
    }
    int64_t *cs = ms + nj;
    for (int64_t j = 0; j < nj; j++) {
        ms[j] = 0;
        for (int64_t c = 0; c < ncons; c++)
            if (j0 + j < Dn[c]) cs[j * ncons + ms[j]++] = c;
    }
    int unit = 1;
    for (int64_t c = 0; c < ncons; c++) unit &= xs[4 * c + 3] == 1;
    for (int64_t it = item0; it < item1; it++) {
        const int64_t b = it / chunks, c0 = (it % chunks) * GT, cn = T - c0 < GT ? T - c0 : GT;
        for (int64_t t0 = c0; t0 < c0 + cn; t0 += tt) {
            const int64_t tn = c0 + cn - t0 < tt ? c0 + cn - t0 : tt;
            memset(acc, 0, sizeof(float) * (size_t)(Hkv * ahk));
            for (int64_t r = 0; r < rep; r++)
                for (int64_t j = j0; j < j1; j++) {
                    /* each row's terms in (head of the kv head, consumer) order, four consumers per pass over the
                     * tile's rows */
                    const int64_t m = ms[j - j0], *cj = cs + (j - j0) * ncons;
                    for (int64_t k = 0; k < m; k += 4) {
                        const int64_t u = m - k < 4 ? m - k : 4;
                        for (int64_t ti = 0; ti < tn; ti++)
                            for (int64_t hk = 0; hk < Hkv; hk++) {
                                const int64_t h = hk * rep + r;
                                float *a = acc + hk * ahk + (j - j0) * arow + ti * hd, w4[4];
                                const float *x4[4];
                                for (int64_t e = 0; e < u; e++) {
                                    const int64_t c = cj[k + e], *st = xs + 4 * c;
                                    w4[e] = W[c][j * plane + (b * H + h) * T + t0 + ti];
                                    x4[e] = X[c] + b * st[0] + h * st[1] + (t0 + ti) * st[2];
                                }
                                if (!unit) {
                                    for (int64_t e = 0; e < u; e++)
                                        for (int64_t i = 0; i < hd; i++) a[i] += w4[e] * x4[e][i * xs[4 * cj[k + e] + 3]];
                                } else if (u == 4) {
                                    hfd_axpy4(a, w4, x4[0], x4[1], x4[2], x4[3], hd);
                                } else {
                                    for (int64_t e = 0; e < u; e++) hfd_axpy(a, w4[e], x4[e], hd);
                                }
                            }
                    }
                }
            for (int64_t hk = 0; hk < Hkv; hk++)
                for (int64_t j = 0; j < nj; j++)
                    for (int64_t ti = 0; ti < tn; ti++) {
                        float *g = G + j * slot + ((b * Hkv + hk) * T + t0 + ti) * hd;
                        const float *a = acc + hk * ahk + j * arow + ti * hd;
                        if (accumulate) hfd_axpy(g, 1.0f, a, hd);
                        else memcpy(g, a, sizeof(float) * (size_t)hd);
                    }
        }
    }
    free(acc);
    free(ms);
    return 0;
}

/* y = e^(x - m) over n floats by the kernels' vector exponential (hfd_exp_shift): ``native.exp_shift``, its check */
int hfd_exp_shift_rows(const float *x, float *y, float m, int64_t n) {
    hfd_exp_shift(y, x, m, n);
    return 0;
}

/* The work-item sizes, read by the Python side to count the items. */
int64_t hfd_moda_items(int64_t B, int64_t Hkv, int64_t T) { return B * Hkv * ((T + TC - 1) / TC); }
int64_t hfd_moda_grad_items(int64_t B, int64_t T) { return B * ((T + GT - 1) / GT); }

/* An FFN sublayer's depth K/V from its ``kv_proj`` output kv [B, T, 2, Hkv, hd] (strides s, the last 1; rows [k | v]):
 * K, V [B, Hkv, T, hd] contiguous, K rotated at the token's own position where rc != NULL (rc, rs: the cos and sin
 * tables [B, T, hd], strides sc, the last 1; a batch stride of 0 broadcasts), with ``rotate``'s ops and rounding:
 *   K_i = k_i c_i + (-k_{i+h}) s_i  (i < h),   k_i c_i + k_{i-h} s_i  (i >= h),   h = hd / 2
 * (rotate_half(k) = [-k2, k1]; each product and the sum rounded, no contraction). Work items are tokens. */
int hfd_moda_kv_write(const float *kv, const int64_t *s, const float *rc, const float *rs, const int64_t *sc,
                      float *K, float *V, int64_t T, int64_t Hkv, int64_t hd, int64_t item0, int64_t item1) {
    const int64_t h = hd / 2;
    for (int64_t it = item0; it < item1; it++) {
        const int64_t b = it / T, t = it % T;
        const float *c = rc ? rc + b * sc[0] + t * sc[1] : NULL, *sn = rs ? rs + b * sc[0] + t * sc[1] : NULL;
        for (int64_t hk = 0; hk < Hkv; hk++) {
            const float *k = kv + b * s[0] + t * s[1] + hk * s[3], *v = k + s[2];
            float *ko = K + ((b * Hkv + hk) * T + t) * hd, *vo = V + ((b * Hkv + hk) * T + t) * hd;
            memcpy(vo, v, sizeof(float) * (size_t)hd);
            if (!c) {
                memcpy(ko, k, sizeof(float) * (size_t)hd);
                continue;
            }
            for (int64_t i = 0; i < h; i++) {
                const float a = k[i] * c[i], r = (-k[i + h]) * sn[i];
                ko[i] = a + r;
            }
            for (int64_t i = h; i < hd; i++) {
                const float a = k[i] * c[i], r = k[i - h] * sn[i];
                ko[i] = a + r;
            }
        }
    }
    return 0;
}

/* Its backward: g [B, T, 2, Hkv, hd] contiguous from gK, gV [B, Hkv, T, hd] (strides sk, sv, the last 1; NULL: zero),
 * the gradient autograd gives ``rotate``'s ops (the product's, plus rotate_half's moved and negated part):
 *   gk_i = gK_i c_i + gK_{i+h} s_{i+h}  (i < h),   gK_i c_i + (-(gK_{i-h} s_{i-h}))  (i >= h) */
int hfd_moda_kv_grad(const float *gK, const int64_t *sk, const float *gV, const int64_t *sv, const float *rc,
                     const float *rs, const int64_t *sc, float *g, int64_t T, int64_t Hkv, int64_t hd, int64_t item0,
                     int64_t item1) {
    const int64_t h = hd / 2;
    for (int64_t it = item0; it < item1; it++) {
        const int64_t b = it / T, t = it % T;
        const float *c = rc ? rc + b * sc[0] + t * sc[1] : NULL, *sn = rs ? rs + b * sc[0] + t * sc[1] : NULL;
        for (int64_t hk = 0; hk < Hkv; hk++) {
            float *gk = g + ((b * T + t) * 2 * Hkv + hk) * hd, *gv = gk + Hkv * hd;
            if (gV) memcpy(gv, gV + b * sv[0] + hk * sv[1] + t * sv[2], sizeof(float) * (size_t)hd);
            else memset(gv, 0, sizeof(float) * (size_t)hd);
            if (!gK) {
                memset(gk, 0, sizeof(float) * (size_t)hd);
                continue;
            }
            const float *x = gK + b * sk[0] + hk * sk[1] + t * sk[2];
            if (!c) {
                memcpy(gk, x, sizeof(float) * (size_t)hd);
                continue;
            }
            for (int64_t i = 0; i < h; i++) {
                const float a = x[i] * c[i], r = x[i + h] * sn[i + h];
                gk[i] = a + r;
            }
            for (int64_t i = h; i < hd; i++) {
                const float a = x[i] * c[i], r = -(x[i - h] * sn[i - h]);
                gk[i] = a + r;
            }
        }
    }
    return 0;
}
