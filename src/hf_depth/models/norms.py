"""Normalization layers and the RMSNorm scale-vector family.

Every norm reports its **role** for the IWD weight-decay rule of the scale-vector paper:

* ``"input"``  -- an *Input-Norm*: its output feeds a linear map (the Pre-Norm gammas). Its scale vector
  folds into that map as W diag(gamma): no expressivity, but a self-amplifying preconditioner.
* ``"output"`` -- an *Output-Norm*: its output is not followed by a linear map (QK-norm, the output norms of
  Sandwich-LN / KEEL / Post-LN, the final norm's gamma is treated as input since the LM head follows).

The scale-vector variant is chosen by ``config.scale_vector`` once, here, for every residual design.
"""

from __future__ import annotations

import torch
from torch import nn

from .dispatch import rms_norm

NORM_ROLES = ("input", "output")


class RMSNorm(nn.Module):
    """RMSNorm in Llama's cast order, with a learnable scale ``weight`` (or none, ``elementwise_affine=False``)."""

    def __init__(self, dim: int, eps: float = 1e-6, role: str = "input", elementwise_affine: bool = True):
        super().__init__()
        if role not in NORM_ROLES:
            raise ValueError(f"`role` must be one of {list(NORM_ROLES)}, got {role!r}")
        self.dim, self.eps, self.role = dim, eps, role
        self.weight = nn.Parameter(torch.ones(dim)) if elementwise_affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, role={self.role}, affine={self.weight is not None}"


class LayerNorm(nn.LayerNorm):
    """LayerNorm (with bias) carrying a role; DeepNorm uses it as in the DeepNet paper and DepthBench."""

    def __init__(self, dim: int, eps: float = 1e-6, role: str = "output", elementwise_affine: bool = True):
        super().__init__(dim, eps=eps, elementwise_affine=elementwise_affine)
        self.role = role

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # normalize in fp32 like RMSNorm
        w = None if self.weight is None else self.weight.float()
        b = None if self.bias is None else self.bias.float()
        return nn.functional.layer_norm(x.float(), self.normalized_shape, w, b, self.eps).to(x.dtype)


def make_norm(config, dim: int | None = None, role: str = "input", kind: str | None = None) -> nn.Module:
    """Build a norm of width ``dim`` (default hidden_size) for ``role`` following ``config.scale_vector``.

    ``kind`` is ``"rms"`` or ``"layer"`` (LayerNorm, DeepNorm's default); ``None`` takes ``config.norm_kind``.
    With ``scale_vector="none"`` the norm has no learnable scale at all (the ablation).
    """
    dim = config.hidden_size if dim is None else dim
    kind = kind or getattr(config, "norm_kind", "rms")
    affine = "none" not in config.scale_vector_parts
    if kind == "layer":
        return LayerNorm(dim, eps=config.rms_norm_eps, role=role, elementwise_affine=affine)
    return RMSNorm(dim, eps=config.rms_norm_eps, role=role, elementwise_affine=affine)


def norm_param_count(config, dim: int | None = None, kind: str | None = None) -> int:
    """Exact parameter count of ``make_norm(config, dim, kind=kind)``."""
    dim = config.hidden_size if dim is None else dim
    if "none" in config.scale_vector_parts:
        return 0
    return 2 * dim if (kind or getattr(config, "norm_kind", "rms")) == "layer" else dim


def projection_scales_param_count(config, projections: dict[str, tuple[int, int]]) -> int:
    """Exact parameter count of ``ProjectionScales(config, projections)``."""
    return 0


class ProjectionScales(nn.Module):
    """Scale vectors around the linear maps that read from one norm (identity for ``standard``/``none``).

    ``inputs(x)`` returns one branch input per projection name (HG: each its own gamma); ``outputs(name, y)``
    applies an output-side scale (AP/DP/DNP). For ``standard`` both are the identity and this module holds no
    parameters, so the state dict equals Llama's.
    """

    def __init__(self, config, projections: dict[str, tuple[int, int]]):
        super().__init__()
        self.names = tuple(projections)

    def inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (x,) * len(self.names)

    def outputs(self, name: str, y: torch.Tensor) -> torch.Tensor:
        return y
