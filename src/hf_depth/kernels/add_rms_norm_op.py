"""Fused residual add + RMSNorm: (h, rms_norm(h)) with h = residual + update, one read of each input and one
write of each output (the RMSNorm kernels of ``rms_norm.py`` with ``HAS_RES``). Math: kernels/add_rms_norm.md."""

from __future__ import annotations

import torch

from ._common import rows
from .rms_norm_op import rms_norm_bwd, rms_norm_fwd  # noqa: F401  (registers the custom ops)


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, residual, update, weight, eps):
        shape = residual.shape
        W = None if weight is None else weight.unsqueeze(0)
        y, h, rstd = torch.ops.hf_depth.rms_norm_fwd(rows(residual), rows(update), W, 1, eps)
        ctx.save_for_backward(h, W, rstd)
        ctx.dtypes = residual.dtype, update.dtype
        return h.view(shape), y[0].view(shape)

    @staticmethod
    def backward(ctx, dh, dy):
        h, W, rstd = ctx.saved_tensors
        D = h.shape[-1]
        dx, dw = torch.ops.hf_depth.rms_norm_bwd(dy.reshape(1, -1, D).contiguous(), rows(dh), h, W, rstd)
        dx = dx.view(dh.shape)
        return dx.to(ctx.dtypes[0]), dx.to(ctx.dtypes[1]), (None if W is None else dw[0].to(W.dtype)), None


def add_rms_norm(residual: torch.Tensor, update: torch.Tensor, weight: torch.Tensor | None, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + update, rms_norm(residual + update, weight, eps)) in one pass."""
    return _AddRMSNorm.apply(residual, update, weight, eps)
