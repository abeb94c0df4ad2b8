"""Pure-PyTorch references of the hot, memory-bound operations.

These are the CPU path of every model and the ground truth that each Triton kernel in
``hf_depth.kernels`` is tested against. They follow Llama's cast order: normalize in fp32, cast back to
the input dtype, then multiply by the weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """y = weight * (x / rms(x)), normalized in fp32 and cast back before the weight (Llama order)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = h.to(dtype)
    return h if weight is None else weight * h


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up."""
    return F.silu(gate) * up


def add_rms_norm(
    residual: torch.Tensor, update: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + update, rms_norm(residual + update)): the fused Pre-LN step between two sublayers."""
    h = residual + update
    return h, rms_norm(h, weight, eps)
