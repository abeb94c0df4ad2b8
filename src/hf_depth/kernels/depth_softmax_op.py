"""AttnRes depth aggregation as an online softmax over S sources that reads each source once, forward and
backward. Math: kernels/depth_softmax.md.

    k_s = w * cast(v_s r_s),  r_s = rsqrt(mean(v_s^2) + eps);   z_s = <q, k_s>;   p = softmax_s(z);   o = sum_s p_s v_s
Backward (D = <do, o> + sum_s p_s dp_s, the FlashAttention trick, so no second pass is needed):
    dz_s = p_s (dp_s + <do, v_s> - D)
    dv_s = p_s do + r_s (a_s - vhat_s mean(a_s vhat_s)),  a_s = dz_s q w
    dq = sum dz_s k_s,   dw = sum dz_s q cast(vhat_s)
The block variant of AttnRes is the same op with the block summaries as sources.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import new, pow2, programs, register, rnd, store, warps


@triton.jit
def _fwd(v_ptr, q_ptr, w_ptr, o_ptr, p_ptr, M, D, S, eps,
         HAS_W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.arange(0, BD)
    tm = t < M
    mask = tm[:, None] & (c[None, :] < D)
    q = tl.load(q_ptr + c, mask=c < D, other=0.0).to(tl.float32)
    if HAS_W:
        w = tl.load(w_ptr + c, mask=c < D, other=0.0).to(tl.float32)
    m = tl.full([BT], float("-inf"), dtype=tl.float32)
    den = tl.zeros([BT], dtype=tl.float32)
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    vp = v_ptr + t[:, None] * D + c[None, :]  # advanced by M * D per source: 64-bit pointer math (S M D > 2^31)
    for s in range(S):
        v = tl.load(vp, mask=mask, other=0.0).to(tl.float32)
        vp += M * D
        r = tl.math.rsqrt(tl.sum(v * v, axis=1) / D + eps)
        k = rnd(v * r[:, None], v_ptr.dtype.element_ty)
        if HAS_W:
            k = rnd(k * w[None, :], w_ptr.dtype.element_ty)  # torch: w * cast(vhat) in w's dtype
        z = tl.sum(k * q[None, :], axis=1)
        tl.store(p_ptr + t * S + s, z, mask=tm)  # raw logits; normalized below
        m_new = tl.maximum(m, z)
        scale = tl.exp(m - m_new)
        e = tl.exp(z - m_new)
        den = den * scale + e
        acc = acc * scale[:, None] + e[:, None] * v
        m = m_new
    store(o_ptr + t[:, None] * D + c[None, :], acc / den[:, None], mask)
    for s in range(S):
        z = tl.load(p_ptr + t * S + s, mask=tm, other=0.0)
        tl.store(p_ptr + t * S + s, tl.exp(z - m) / den, mask=tm)


@triton.jit
def _bwd(do_ptr, dp_ptr, v_ptr, o_ptr, p_ptr, q_ptr, w_ptr, dv_ptr, dq_ptr, dw_ptr, M, D, S, eps,
         HAS_W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    # persistent: a few programs per SM stride over the token blocks, dq / dw partials stay in registers
    pid = tl.program_id(0)
    c = tl.arange(0, BD)
    cm = c < D
    q = tl.load(q_ptr + c, mask=cm, other=0.0).to(tl.float32)
    qw = q
    if HAS_W:
        w = tl.load(w_ptr + c, mask=cm, other=0.0).to(tl.float32)
        qw = q * w
    dq = tl.zeros([BD], dtype=tl.float32)
    dw = tl.zeros([BD], dtype=tl.float32)
    for blk in range(pid, tl.cdiv(M, BT), tl.num_programs(0)):
        t = blk * BT + tl.arange(0, BT)
        tm = t < M
        mask = tm[:, None] & cm[None, :]
        do = tl.load(do_ptr + t[:, None] * D + c[None, :], mask=mask, other=0.0).to(tl.float32)
        o = tl.load(o_ptr + t[:, None] * D + c[None, :], mask=mask, other=0.0).to(tl.float32)
        delta = tl.sum(do * o, axis=1)  # = sum_s p_s <do, v_s>: no first pass over the sources
        for s in range(S):
            delta += tl.load(p_ptr + t * S + s, mask=tm, other=0.0) * tl.load(dp_ptr + t * S + s, mask=tm, other=0.0)
        vp = v_ptr + t[:, None] * D + c[None, :]  # advanced by M * D per source (64-bit pointer math)
        dvp = dv_ptr + t[:, None] * D + c[None, :]
        for s in range(S):
            v = tl.load(vp, mask=mask, other=0.0).to(tl.float32)
            p = tl.load(p_ptr + t * S + s, mask=tm, other=0.0)
            dz = p * (tl.load(dp_ptr + t * S + s, mask=tm, other=0.0) + tl.sum(do * v, axis=1) - delta)
            r = tl.math.rsqrt(tl.sum(v * v, axis=1) / D + eps)
            hat = v * r[:, None]
            n = rnd(hat, v_ptr.dtype.element_ty)
            if HAS_W:
                dq += tl.sum(dz[:, None] * rnd(n * w[None, :], w_ptr.dtype.element_ty), axis=0)
                dw += tl.sum(dz[:, None] * n, axis=0) * q
            else:
                dq += tl.sum(dz[:, None] * n, axis=0)
            a = dz[:, None] * qw[None, :]
            dv = p[:, None] * do + r[:, None] * (a - hat * (tl.sum(a * hat, axis=1) / D)[:, None])
            store(dvp, dv, mask)
            vp += M * D
            dvp += M * D
    tl.store(dq_ptr + pid * D + c, dq, mask=cm)
    if HAS_W:
        tl.store(dw_ptr + pid * D + c, dw, mask=cm)


def _blocks(D: int) -> tuple[int, int]:
    bd = pow2(D)
    return max(1, min(16, 2048 // bd)), bd


def _fwd_fake(query, key_weight, sources, eps):
    S, M, D = sources.shape
    return sources.new_empty((M, D)), sources.new_empty((M, S), dtype=torch.float32)


@register("depth_softmax_fwd", _fwd_fake)
def depth_softmax_fwd(query: torch.Tensor, key_weight: torch.Tensor | None, sources: torch.Tensor, eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """sources [S, M, D] -> (out [M, D] in sources' dtype, p [M, S] fp32)."""
    S, M, D = sources.shape
    bt, bd = _blocks(D)
    out, p = new((M, D), sources.dtype, sources.device), new((M, S), torch.float32, sources.device)
    _fwd[(triton.cdiv(M, bt),)](sources, query, key_weight if key_weight is not None else query, out, p, M, D, S, eps,
                                HAS_W=key_weight is not None, BT=bt, BD=bd, num_warps=warps(bt * bd))
    return out, p


def _bwd_fake(dout, dp, query, key_weight, sources, out, p, eps):
    return (torch.empty_like(sources), query.new_empty(query.shape, dtype=torch.float32),
            query.new_empty(query.shape if key_weight is not None else (0,), dtype=torch.float32))


@register("depth_softmax_bwd", _bwd_fake)
def depth_softmax_bwd(dout: torch.Tensor, dp: torch.Tensor, query: torch.Tensor, key_weight: torch.Tensor | None,
                      sources: torch.Tensor, out: torch.Tensor, p: torch.Tensor, eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dsources, dquery fp32, dkey_weight fp32 or [0])."""
    S, M, D = sources.shape
    bt, bd = _blocks(D)
    grid = programs(sources.device, triton.cdiv(M, bt))
    dv = new(sources.shape, sources.dtype, sources.device)
    dq = new((grid, D), torch.float32, sources.device)
    has_w = key_weight is not None
    dw = new((grid, D), torch.float32, sources.device) if has_w else dq.new_empty(0)
    _bwd[(grid,)](dout, dp, sources, out, p, query, key_weight if has_w else query, dv, dq, dw, M, D, S, eps,
                  HAS_W=has_w, BT=bt, BD=bd, num_warps=warps(bt * bd))
    return dv, dq.sum(0), (dw.sum(0) if has_w else dw)


class _DepthSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key_weight, sources, eps):
        out, p = torch.ops.hf_depth.depth_softmax_fwd(query, key_weight, sources, eps)
        ctx.save_for_backward(query, key_weight, sources, out, p)
        ctx.eps = eps
        return out, p

    @staticmethod
    def backward(ctx, dout, dp):
        query, key_weight, sources, out, p = ctx.saved_tensors
        dv, dq, dw = torch.ops.hf_depth.depth_softmax_bwd(dout.contiguous(), dp.contiguous(), query, key_weight,
                                                          sources, out, p, ctx.eps)
        return dq.to(query.dtype), (None if key_weight is None else dw.to(key_weight.dtype)), dv, None


def depth_softmax(query: torch.Tensor, key_weight: torch.Tensor | None, sources: torch.Tensor, eps: float = 1e-6
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """p_s = softmax_s(<query, key_weight * N̄(v_s)>), out = sum_s p_s v_s; sources [S, ..., d].
    Returns (out [..., d], p [..., S] fp32)."""
    S, lead, D = sources.shape[0], sources.shape[1:-1], sources.shape[-1]
    out, p = _DepthSoftmax.apply(query.contiguous(), None if key_weight is None else key_weight.contiguous(),
                                 sources.reshape(S, -1, D).contiguous(), eps)
    return out.view(*lead, D), p.view(*lead, S)
