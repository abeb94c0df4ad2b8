"""SwiGLU: y = silu(g) * u, forward and backward in one elementwise pass each. Math: kernels/swiglu.md.

    s = sigmoid(g);  y = g s u;  dg = dy u s (1 + g (1 - s));  du = dy g s
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import new, register, store

BLOCK = 4096


@triton.jit
def _fwd(g_ptr, u_ptr, y_ptr, N, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    g = tl.load(g_ptr + i, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + i, mask=m, other=0.0).to(tl.float32)
    store(y_ptr + i, g * tl.sigmoid(g) * u, m)


@triton.jit
def _bwd(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, N, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    dy = tl.load(dy_ptr + i, mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + i, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + i, mask=m, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    store(dg_ptr + i, dy * u * s * (1.0 + g * (1.0 - s)), m)
    store(du_ptr + i, dy * g * s, m)


@register("swiglu_fwd", lambda g, u: g.new_empty(g.shape, dtype=torch.promote_types(g.dtype, u.dtype)))
def swiglu_fwd(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    y = new(g.shape, torch.promote_types(g.dtype, u.dtype), g.device)
    _fwd[(triton.cdiv(g.numel(), BLOCK),)](g, u, y, g.numel(), BLOCK=BLOCK, num_warps=8)
    return y


@register("swiglu_bwd", lambda dy, g, u: (torch.empty_like(g), torch.empty_like(u)))
def swiglu_bwd(dy: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dg, du = new(g.shape, g.dtype, g.device), new(u.shape, u.dtype, u.device)
    _bwd[(triton.cdiv(g.numel(), BLOCK),)](dy, g, u, dg, du, g.numel(), BLOCK=BLOCK, num_warps=8)
    return dg, du


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        return torch.ops.hf_depth.swiglu_fwd(gate, up)

    @staticmethod
    def backward(ctx, dy):
        return torch.ops.hf_depth.swiglu_bwd(dy.contiguous(), *ctx.saved_tensors)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up (same shapes)."""
    if gate.shape != up.shape:
        gate, up = torch.broadcast_tensors(gate, up)
    return _SwiGLU.apply(gate, up)
