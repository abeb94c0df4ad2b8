"""mHC (manifold-constrained Hyper-Connections): coefficients, log-domain Sinkhorn, and pre/post mixing.
Math: kernels/mhc.md.

* ``mhc_width`` / ``mhc_depth`` are the HC width/depth kernels of ``hc.py`` with C = [pre | res^T]
  (x = sum_s pre_s H_s, mixed_t = sum_s res[t, s] H_s) and beta = post: one pass over the streams each.
* ``mhc_coefficients``: the projection (RMS of the flattened streams, [n d] x [n^2 + 2n] GEMM, 1/r applied after
  the matmul as in the paper) and the sigmoids stay in PyTorch (a skinny GEMM plus 2n + n^2 numbers per token);
  the 20-iteration Sinkhorn, the part eager PyTorch runs as ~80 tiny launches, is the Triton kernel of
  ``sinkhorn.py``.
"""

from __future__ import annotations

import torch

from .hc_op import mix_depth, mix_width
from .sinkhorn_op import sinkhorn


def mhc_coefficients(
    H: torch.Tensor, phi: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor, iters: int = 20, eps: float = 1e-6,
    tanh: bool = False, columns_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(H_pre = sigmoid [..., n], H_post = 2 sigmoid [..., n], H_res = Sinkhorn [..., n, n]), fp32."""
    n = H.shape[-2]
    x = H.flatten(-2).float()
    inv_r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    proj = (x @ phi.float()) * inv_r
    if tanh:  # DepthBench's torch backend: gate * tanh(projection) + bias
        proj = torch.tanh(proj)
    a, b = alpha.float(), bias.float()
    pre = torch.sigmoid(a[0] * proj[..., :n] + b[:n])
    post = 2.0 * torch.sigmoid(a[1] * proj[..., n : 2 * n] + b[n : 2 * n])
    res_logits = (a[2] * proj[..., 2 * n :] + b[2 * n :]).unflatten(-1, (n, n))
    if columns_first:  # Sinkhorn starting with the column step: the row-first one of the transpose, transposed
        return pre, post, sinkhorn(res_logits.transpose(-1, -2), iters).transpose(-1, -2)
    return pre, post, sinkhorn(res_logits, iters)


def mhc_width(H: torch.Tensor, pre: torch.Tensor, res: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x = sum_s pre_s H_s and mixed_t = sum_s res[t, s] H_s, one pass over H."""
    C = torch.cat([pre.to(H.dtype).unsqueeze(-1), res.to(H.dtype).transpose(-1, -2)], dim=-1)
    return mix_width(H, C)


def mhc_depth(mixed: torch.Tensor, post: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """H'_t = mixed_t + post_t * y in one pass."""
    return mix_depth(mixed, post, y)
