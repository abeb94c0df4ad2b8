"""Hyper-Connections: the width connection (branch input + stream mixing) and the depth connection (write the
branch output into every stream), one pass over the streams each, forward and backward. Math: kernels/hc.md.

    width:  out_o = sum_s C[s, o] H_s  for o = 0..n  (o = 0: branch input x, o >= 1: mixed streams)
            dH_s = sum_o C[s, o] dout_o;   dC[s, o] = <H_s, dout_o>
    depth:  H'_t = mixed_t + beta_t y;  dmixed = dH';  dbeta_t = <dH'_t, y>;  dy = sum_t beta_t dH'_t

The same two kernels serve mHC (``mhc.py``: C = [pre | res^T], beta = post). The dynamic coefficients
(``hc_coefficients``: RMSNorm + a [d, n+1] projection + tanh) stay in PyTorch: they are a skinny GEMM that
cuBLAS / torch.compile already run at bandwidth, and their output is n(n+1) numbers per token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_depth.models.functional import hc_coefficients  # noqa: F401  (torch on purpose, see the docstring)

from ._common import new, pow2, register, store, warps


def _blocks(D: int, n: int) -> tuple[int, int]:
    bd = min(pow2(D), 256)
    return max(1, min(16, 2048 // (bd * pow2(n)))), bd


@triton.jit
def _width_fwd(h_ptr, c_ptr, x_ptr, mix_ptr, M, D, NI, NO,
               BT: tl.constexpr, NIP: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    s = tl.arange(0, NIP)
    tm, sm, dm = t < M, s < NI, d < D
    tile = tl.load(h_ptr + (t[:, None, None] * NI + s[None, :, None]) * D + d[None, None, :],
                   mask=tm[:, None, None] & sm[None, :, None] & dm[None, None, :], other=0.0).to(tl.float32)
    cm = tm[:, None] & sm[None, :]
    om = tm[:, None] & dm[None, :]
    x = tl.sum(tl.load(c_ptr + (t[:, None] * NI + s[None, :]) * NO, mask=cm, other=0.0).to(tl.float32)[:, :, None]
               * tile, axis=1)
    store(x_ptr + t[:, None] * D + d[None, :], x, om)
    for o in range(1, NO):
        coef = tl.load(c_ptr + (t[:, None] * NI + s[None, :]) * NO + o, mask=cm, other=0.0).to(tl.float32)
        out = tl.sum(coef[:, :, None] * tile, axis=1)
        store(mix_ptr + (t[:, None] * (NO - 1) + o - 1) * D + d[None, :], out, om)


@triton.jit
def _width_bwd(dx_ptr, dmix_ptr, h_ptr, c_ptr, dh_ptr, dc_ptr, M, D, NI, NO,
               BT: tl.constexpr, NIP: tl.constexpr, NOP: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    s = tl.arange(0, NIP)
    oc = tl.arange(0, NOP)
    tm, sm = t < M, s < NI
    cm = tm[:, None] & sm[None, :]
    dc = tl.zeros([BT, NIP, NOP], dtype=tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        dm = d < D
        m3 = tm[:, None, None] & sm[None, :, None] & dm[None, None, :]
        hoff = (t[:, None, None] * NI + s[None, :, None]) * D + d[None, None, :]
        tile = tl.load(h_ptr + hoff, mask=m3, other=0.0).to(tl.float32)
        dh = tl.zeros([BT, NIP, BD], dtype=tl.float32)
        for o in range(0, NO):
            if o == 0:
                g = tl.load(dx_ptr + t[:, None] * D + d[None, :], mask=tm[:, None] & dm[None, :], other=0.0)
            else:
                g = tl.load(dmix_ptr + (t[:, None] * (NO - 1) + o - 1) * D + d[None, :],
                            mask=tm[:, None] & dm[None, :], other=0.0)
            g = g.to(tl.float32)
            coef = tl.load(c_ptr + (t[:, None] * NI + s[None, :]) * NO + o, mask=cm, other=0.0).to(tl.float32)
            dh += coef[:, :, None] * g[:, None, :]
            part = tl.sum(tile * g[:, None, :], axis=2)
            dc += tl.where(oc[None, None, :] == o, part[:, :, None], 0.0)
        store(dh_ptr + hoff, dh, m3)
    store(dc_ptr + (t[:, None, None] * NI + s[None, :, None]) * NO + oc[None, None, :], dc,
          cm[:, :, None] & (oc[None, None, :] < NO))


def _width_fake(H, C):
    M, n, D = H.shape
    return H.new_empty((M, D)), H.new_empty((M, C.shape[-1] - 1, D))


@register("mix_width_fwd", _width_fake)
def mix_width_fwd(H: torch.Tensor, C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """H [M, n, D], C [M, n, n+1] -> (x [M, D], mixed [M, n, D]) with out_o = sum_s C[s, o] H_s."""
    M, n, D = H.shape
    no = C.shape[-1]
    bt, bd = _blocks(D, n)
    x, mixed = new((M, D), H.dtype, H.device), new((M, no - 1, D), H.dtype, H.device)
    _width_fwd[(triton.cdiv(M, bt), triton.cdiv(D, bd))](H, C, x, mixed, M, D, n, no, BT=bt, NIP=pow2(n), BD=bd,
                                                          num_warps=warps(bt * pow2(n) * bd))
    return x, mixed


@register("mix_width_bwd", lambda dx, dmixed, H, C: (torch.empty_like(H), torch.empty_like(C)))
def mix_width_bwd(dx: torch.Tensor, dmixed: torch.Tensor, H: torch.Tensor, C: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    M, n, D = H.shape
    no = C.shape[-1]
    bt, bd = _blocks(D, max(n, no))
    dH, dC = new(H.shape, H.dtype, H.device), new(C.shape, C.dtype, C.device)
    _width_bwd[(triton.cdiv(M, bt),)](dx, dmixed, H, C, dH, dC, M, D, n, no, BT=bt, NIP=pow2(n), NOP=pow2(no),
                                      BD=bd, num_warps=warps(bt * pow2(max(n, no)) * bd))
    return dH, dC


class _Width(torch.autograd.Function):
    @staticmethod
    def forward(ctx, H, C):
        ctx.save_for_backward(H, C)
        return torch.ops.hf_depth.mix_width_fwd(H, C)

    @staticmethod
    def backward(ctx, dx, dmixed):
        return torch.ops.hf_depth.mix_width_bwd(dx.contiguous(), dmixed.contiguous(), *ctx.saved_tensors)


def mix_width(H: torch.Tensor, C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum_s C[..., s, 0] H_s, [sum_s C[..., s, o] H_s]_{o>=1}) for H [..., n, d], C [..., n, n+1]."""
    lead, (n, D) = H.shape[:-2], H.shape[-2:]
    C = C.to(H.dtype).expand(*lead, n, C.shape[-1])
    x, mixed = _Width.apply(H.reshape(-1, n, D).contiguous(), C.reshape(-1, n, C.shape[-1]).contiguous())
    return x.view(*lead, D), mixed.view(*lead, C.shape[-1] - 1, D)


def hc_width(H: torch.Tensor, A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Branch input x = sum_s A[s, 0] H_s and mixed streams H'_t = sum_s A[s, t+1] H_s, one pass over H."""
    return mix_width(H, A)


@triton.jit
def _depth_fwd(m_ptr, b_ptr, y_ptr, o_ptr, M, D, N, BT: tl.constexpr, NP: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    s = tl.arange(0, NP)
    tm, sm, dm = t < M, s < N, d < D
    m3 = tm[:, None, None] & sm[None, :, None] & dm[None, None, :]
    off = (t[:, None, None] * N + s[None, :, None]) * D + d[None, None, :]
    mixed = tl.load(m_ptr + off, mask=m3, other=0.0).to(tl.float32)
    beta = tl.load(b_ptr + t[:, None] * N + s[None, :], mask=tm[:, None] & sm[None, :], other=0.0).to(tl.float32)
    y = tl.load(y_ptr + t[:, None] * D + d[None, :], mask=tm[:, None] & dm[None, :], other=0.0).to(tl.float32)
    store(o_ptr + off, mixed + beta[:, :, None] * y[:, None, :], m3)


@triton.jit
def _depth_bwd(g_ptr, b_ptr, y_ptr, db_ptr, dy_ptr, M, D, N, BT: tl.constexpr, NP: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    s = tl.arange(0, NP)
    tm, sm = t < M, s < N
    bm = tm[:, None] & sm[None, :]
    beta = tl.load(b_ptr + t[:, None] * N + s[None, :], mask=bm, other=0.0).to(tl.float32)
    db = tl.zeros([BT, NP], dtype=tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        dm = d < D
        g = tl.load(g_ptr + (t[:, None, None] * N + s[None, :, None]) * D + d[None, None, :],
                    mask=bm[:, :, None] & dm[None, None, :], other=0.0).to(tl.float32)
        y = tl.load(y_ptr + t[:, None] * D + d[None, :], mask=tm[:, None] & dm[None, :], other=0.0).to(tl.float32)
        db += tl.sum(g * y[:, None, :], axis=2)
        store(dy_ptr + t[:, None] * D + d[None, :], tl.sum(beta[:, :, None] * g, axis=1), tm[:, None] & dm[None, :])
    store(db_ptr + t[:, None] * N + s[None, :], db, bm)


@register("mix_depth_fwd", lambda mixed, beta, y: torch.empty_like(mixed))
def mix_depth_fwd(mixed: torch.Tensor, beta: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    M, n, D = mixed.shape
    bt, bd = _blocks(D, n)
    out = new(mixed.shape, mixed.dtype, mixed.device)
    _depth_fwd[(triton.cdiv(M, bt), triton.cdiv(D, bd))](mixed, beta, y, out, M, D, n, BT=bt, NP=pow2(n), BD=bd,
                                                          num_warps=warps(bt * pow2(n) * bd))
    return out


@register("mix_depth_bwd", lambda g, beta, y: (torch.empty_like(beta), torch.empty_like(y)))
def mix_depth_bwd(g: torch.Tensor, beta: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    M, n, D = g.shape
    bt, bd = _blocks(D, n)
    dbeta, dy = new(beta.shape, beta.dtype, g.device), new(y.shape, y.dtype, g.device)
    _depth_bwd[(triton.cdiv(M, bt),)](g, beta, y, dbeta, dy, M, D, n, BT=bt, NP=pow2(n), BD=bd,
                                      num_warps=warps(bt * pow2(n) * bd))
    return dbeta, dy


class _Depth(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mixed, beta, y):
        ctx.save_for_backward(beta, y)
        return torch.ops.hf_depth.mix_depth_fwd(mixed, beta, y)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        return (g, *torch.ops.hf_depth.mix_depth_bwd(g, *ctx.saved_tensors))


def mix_depth(mixed: torch.Tensor, beta: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """mixed_t + beta_t y for mixed [..., n, d], beta [..., n], y [..., d] (one read of each, one write)."""
    lead, (n, D) = mixed.shape[:-2], mixed.shape[-2:]
    beta = beta.to(mixed.dtype).expand(*lead, n).reshape(-1, n).contiguous()
    out = _Depth.apply(mixed.reshape(-1, n, D).contiguous(), beta, y.expand(*lead, D).reshape(-1, D).contiguous())
    return out.view(mixed.shape)


def hc_depth(mixed: torch.Tensor, beta: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """H'_t = mixed_t + beta_t * y in one pass."""
    return mix_depth(mixed, beta, y)
