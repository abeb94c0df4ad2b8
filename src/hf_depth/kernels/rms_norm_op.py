"""RMSNorm in Llama's cast order, forward and backward; K gamma-scaled outputs from one read of x (HG), an
optional fused residual add (used by ``add_rms_norm``). Math: kernels/rms_norm.md.

    h = x (+ u);  r = rsqrt(mean(h^2) + eps);  n = cast_dtype(h r);  y_k = w_k n
    dh = r (g - h r mean(g h r)) (+ dh_out),   g = sum_k w_k dy_k;   dw_k = sum_rows dy_k n
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import new, pow2, programs, register, rnd, rows, rows_per_program, store, warps


@triton.jit
def _fwd(x_ptr, u_ptr, w_ptr, y_ptr, h_ptr, rstd_ptr, M, D, eps,
         K: tl.constexpr, HAS_W: tl.constexpr, HAS_RES: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr):
    r = tl.program_id(0) * BM + tl.arange(0, BM)
    c = tl.arange(0, BD)
    mask = (r[:, None] < M) & (c[None, :] < D)
    offs = r[:, None] * D + c[None, :]
    h = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:  # h = x + u, rounded to the dtype of the sum as torch does, and returned
        h = rnd(h + tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32), h_ptr.dtype.element_ty)
        store(h_ptr + offs, h, mask)
    rstd = tl.math.rsqrt(tl.sum(h * h, axis=1) / D + eps)
    n = rnd(h * rstd[:, None], h_ptr.dtype.element_ty)  # Llama: cast to the input dtype before the weight
    for k in tl.static_range(K):
        y = n
        if HAS_W:
            y = n * tl.load(w_ptr + k * D + c, mask=c < D, other=0.0).to(tl.float32)[None, :]
        store(y_ptr + k * M * D + offs, y, mask)
    tl.store(rstd_ptr + r, rstd, mask=r < M)


@triton.jit
def _bwd(dy_ptr, dh_ptr, h_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, M, D,
         K: tl.constexpr, KP: tl.constexpr, HAS_W: tl.constexpr, HAS_RES: tl.constexpr, BM: tl.constexpr,
         BD: tl.constexpr):
    # persistent: a few programs per SM stride over the row blocks and keep their dW partial in registers
    pid = tl.program_id(0)
    c = tl.arange(0, BD)
    kk = tl.arange(0, KP)
    dw = tl.zeros([KP, BD], dtype=tl.float32)
    for blk in range(pid, tl.cdiv(M, BM), tl.num_programs(0)):
        r = blk * BM + tl.arange(0, BM)
        mask = (r[:, None] < M) & (c[None, :] < D)
        offs = r[:, None] * D + c[None, :]
        h = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + r, mask=r < M, other=0.0)
        hat = h * rstd[:, None]
        n = rnd(hat, h_ptr.dtype.element_ty)
        g = tl.zeros([BM, BD], dtype=tl.float32)
        for k in tl.static_range(K):
            dy = tl.load(dy_ptr + k * M * D + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_W:
                g += dy * tl.load(w_ptr + k * D + c, mask=c < D, other=0.0).to(tl.float32)[None, :]
                dw += tl.where(kk[:, None] == k, tl.sum(dy * n, axis=0)[None, :], 0.0)
            else:
                g += dy
        dx = rstd[:, None] * (g - hat * (tl.sum(g * hat, axis=1) / D)[:, None])
        if HAS_RES:
            dx += tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        store(dx_ptr + offs, dx, mask)
    if HAS_W:  # one [K, D] fp32 partial per program, summed by PyTorch (deterministic, no atomics)
        tl.store(dw_ptr + (pid * K + kk[:, None]) * D + c[None, :], dw, mask=(kk[:, None] < K) & (c[None, :] < D))


def _blocks(D: int) -> tuple[int, int]:
    bd = pow2(D)
    return rows_per_program(bd), bd


def _out_dtype(x: torch.Tensor, w: torch.Tensor | None) -> torch.dtype:
    return x.dtype if w is None else torch.promote_types(x.dtype, w.dtype)


def _fwd_fake(x, update, weight, k, eps):
    M, D = x.shape
    h_dtype = x.dtype if update is None else torch.promote_types(x.dtype, update.dtype)
    return (x.new_empty((k, M, D), dtype=_out_dtype(x.new_empty(0, dtype=h_dtype), weight)),
            x.new_empty((M, D) if update is not None else (0,), dtype=h_dtype), x.new_empty((M,), dtype=torch.float32))


@register("rms_norm_fwd", _fwd_fake)
def rms_norm_fwd(x: torch.Tensor, update: torch.Tensor | None, weight: torch.Tensor | None, k: int, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, update: [M, D]; weight: [k, D] or None. Returns (y [k, M, D], h = x + update [M, D] or [0], rstd [M])."""
    M, D = x.shape
    y0, h0, _ = _fwd_fake(x, update, weight, k, eps)
    y, rstd = new(y0.shape, y0.dtype, x.device), new((M,), torch.float32, x.device)
    h = new(h0.shape, h0.dtype, x.device) if update is not None else h0
    bm, bd = _blocks(D)
    _fwd[(triton.cdiv(M, bm),)](
        x, update if update is not None else x, weight if weight is not None else x, y,
        h if update is not None else x, rstd, M, D, eps,
        K=k, HAS_W=weight is not None, HAS_RES=update is not None, BM=bm, BD=bd, num_warps=warps(bm * bd))
    return y, h, rstd


def _bwd_fake(dy, dh, h, weight, rstd):
    k, M, D = dy.shape
    return h.new_empty((M, D)), h.new_empty((k, D) if weight is not None else (0,), dtype=torch.float32)


@register("rms_norm_bwd", _bwd_fake)
def rms_norm_bwd(dy: torch.Tensor, dh: torch.Tensor | None, h: torch.Tensor, weight: torch.Tensor | None,
                 rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dy: [k, M, D] grads of the outputs; dh: extra grad of h (add_rms_norm). Returns (dh_total, dw [k, D] fp32)."""
    k, M, D = dy.shape
    bm, bd = _blocks(D)
    grid = programs(h.device, triton.cdiv(M, bm))
    dx = new((M, D), h.dtype, h.device)
    part = new((grid, k, D), torch.float32, h.device) if weight is not None else h.new_empty(0, dtype=torch.float32)
    _bwd[(grid,)](dy, dh if dh is not None else dy, h, weight if weight is not None else h, rstd, dx, part, M, D,
                  K=k, KP=pow2(k), HAS_W=weight is not None, HAS_RES=dh is not None, BM=bm, BD=bd,
                  num_warps=warps(bm * bd))
    return dx, (part.sum(0) if weight is not None else part)


def stack_weights(weights, D: int, like: torch.Tensor) -> torch.Tensor | None:
    """[K, D] stack of the gammas (None -> ones), or None when no output has a weight."""
    if all(w is None for w in weights):
        return None
    ref = next(w for w in weights if w is not None)
    return torch.stack([torch.ones(D, dtype=ref.dtype, device=ref.device) if w is None else w for w in weights])


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, *weights):
        # weight: the stacked [K, D] gammas (or None); *weights are the caller's tensors, only for their grads
        shape = x.shape
        k = len(weights)
        y, _, rstd = torch.ops.hf_depth.rms_norm_fwd(rows(x), None, weight, k, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.has = [w is not None for w in weights]
        return tuple(y[i].view(shape).to(x.dtype) if weights[i] is None else y[i].view(shape) for i in range(k))

    @staticmethod
    def backward(ctx, *dys):
        x, weight, rstd = ctx.saved_tensors
        D = x.shape[-1]
        dy = torch.stack([g.reshape(-1, D) for g in dys]) if len(dys) > 1 else dys[0].reshape(1, -1, D)
        dx, dw = torch.ops.hf_depth.rms_norm_bwd(dy.contiguous(), None, rows(x), weight, rstd)
        dws = [dw[i].to(weight.dtype) if has else None for i, has in enumerate(ctx.has)]
        return (dx.view(x.shape), None, None, *dws)


def rms_norm_multi(x: torch.Tensor, weights: list[torch.Tensor | None], eps: float) -> list[torch.Tensor]:
    """[w_i * N̄(x)]: one read of x, one rsqrt, one output per gamma (None: the unweighted N̄(x))."""
    weights = list(weights)
    W = stack_weights(weights, x.shape[-1], x)
    return list(_RMSNorm.apply(x, W, eps, *weights))


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """weight * cast(x / rms(x)) in Llama's cast order (``weight=None``: no scale)."""
    W = None if weight is None else weight.unsqueeze(0)
    return _RMSNorm.apply(x, W, eps, weight)[0]
