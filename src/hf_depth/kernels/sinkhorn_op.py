"""Log-domain Sinkhorn-Knopp on many tiny n x n matrices, fp32, forward and backward. Math: kernels/sinkhorn.md.

Forward: z <- z - lse_row(z); z <- z - lse_col(z), ``iters`` times; P = exp(z). Nothing but P is saved.
Backward: the forward is recomputed inside the kernel, each step's output z_k kept in an fp32 scratch that only
that program touches (L2-resident), then the steps are undone in reverse with
    z' = z - lse(z)  =>  dz = dz' - exp(z') * sum(dz')      (sum over the same row / column),
starting from dz = dP * P. This is exactly the gradient of the unrolled reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import new, pow2, register


@triton.jit
def _lse_step(z, valid, AXIS: tl.constexpr):
    mx = tl.max(z, axis=AXIS)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    tot = tl.sum(tl.exp(z - tl.expand_dims(mx, AXIS)), axis=AXIS)
    lse = mx + tl.log(tl.where(tot == 0.0, 1.0, tot))  # fully padded lines: keep them finite (masked anyway)
    return tl.where(valid, z - tl.expand_dims(lse, AXIS), float("-inf"))


@triton.jit
def _load(x_ptr, M, N, BT: tl.constexpr, NP: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    i = tl.arange(0, NP)
    off = (t[:, None, None] * N + i[None, :, None]) * N + i[None, None, :]
    valid = (t[:, None, None] < M) & (i[None, :, None] < N) & (i[None, None, :] < N)
    return off, valid


@triton.jit
def _fwd(l_ptr, p_ptr, M, N, ITERS, BT: tl.constexpr, NP: tl.constexpr):
    off, valid = _load(l_ptr, M, N, BT, NP)
    z = tl.where(valid, tl.load(l_ptr + off, mask=valid, other=0.0).to(tl.float32), float("-inf"))
    for _ in range(ITERS):
        z = _lse_step(z, valid, 2)
        z = _lse_step(z, valid, 1)
    tl.store(p_ptr + off, tl.exp(z), mask=valid)


@triton.jit
def _bwd(dp_ptr, l_ptr, p_ptr, dl_ptr, scr_ptr, M, N, ITERS, BT: tl.constexpr, NP: tl.constexpr):
    off, valid = _load(l_ptr, M, N, BT, NP)
    step = M * N * N  # scratch layout [2 * ITERS, M, N, N]
    z = tl.where(valid, tl.load(l_ptr + off, mask=valid, other=0.0).to(tl.float32), float("-inf"))
    for k in range(ITERS):
        z = _lse_step(z, valid, 2)
        tl.store(scr_ptr + (2 * k) * step + off, z, mask=valid)
        z = _lse_step(z, valid, 1)
        tl.store(scr_ptr + (2 * k + 1) * step + off, z, mask=valid)
    p = tl.load(p_ptr + off, mask=valid, other=0.0)
    dz = tl.load(dp_ptr + off, mask=valid, other=0.0).to(tl.float32) * p
    for j in range(ITERS):
        k = ITERS - 1 - j
        zc = tl.load(scr_ptr + (2 * k + 1) * step + off, mask=valid, other=float("-inf"))
        dz = dz - tl.exp(zc) * tl.expand_dims(tl.sum(dz, axis=1), 1)
        zr = tl.load(scr_ptr + (2 * k) * step + off, mask=valid, other=float("-inf"))
        dz = dz - tl.exp(zr) * tl.expand_dims(tl.sum(dz, axis=2), 2)
        dz = tl.where(valid, dz, 0.0)
    tl.store(dl_ptr + off, dz, mask=valid)


def _bt(n: int) -> int:
    return max(1, 256 // (pow2(n) ** 2))


@register("sinkhorn_fwd", lambda logits, iters: torch.empty_like(logits, dtype=torch.float32))
def sinkhorn_fwd(logits: torch.Tensor, iters: int) -> torch.Tensor:
    M, n, _ = logits.shape
    P = new(logits.shape, torch.float32, logits.device)
    _fwd[(triton.cdiv(M, _bt(n)),)](logits, P, M, n, iters, BT=_bt(n), NP=pow2(n))
    return P


@register("sinkhorn_bwd", lambda dP, logits, P, iters: torch.empty_like(logits, dtype=torch.float32))
def sinkhorn_bwd(dP: torch.Tensor, logits: torch.Tensor, P: torch.Tensor, iters: int) -> torch.Tensor:
    M, n, _ = logits.shape
    dl = new(logits.shape, torch.float32, logits.device)
    scratch = torch.empty((max(1, 2 * iters), M, n, n), dtype=torch.float32, device=logits.device)
    _bwd[(triton.cdiv(M, _bt(n)),)](dP, logits, P, dl, scratch, M, n, iters, BT=_bt(n), NP=pow2(n))
    return dl


class _Sinkhorn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, iters):
        P = torch.ops.hf_depth.sinkhorn_fwd(logits, iters)
        ctx.save_for_backward(logits, P)
        ctx.iters, ctx.dtype = iters, logits.dtype
        return P

    @staticmethod
    def backward(ctx, dP):
        logits, P = ctx.saved_tensors
        return torch.ops.hf_depth.sinkhorn_bwd(dP.contiguous(), logits, P, ctx.iters).to(ctx.dtype), None


def sinkhorn(logits: torch.Tensor, iters: int = 20) -> torch.Tensor:
    """exp(logits) alternately row- then column-normalized ``iters`` times in the log domain (fp32 out)."""
    n = logits.shape[-1]
    P = _Sinkhorn.apply(logits.reshape(-1, n, n).contiguous(), int(iters))
    return P.view(logits.shape)
