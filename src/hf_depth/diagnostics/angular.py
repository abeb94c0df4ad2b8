"""Angular distance between residual states (DepthBench Figure 5).

    d(h_l, h_{l+n}) = arccos( <h_l, h_{l+n}> / (|h_l| |h_{l+n}|) ) / pi        in [0, 1]

averaged over real (non-padding) tokens of the calibration data. ``h_0`` is the embedding and ``h_L`` the last
layer's output before the final norm; which state is measured is the convention's (``conventions``: DepthBench's
concatenated HC/mHC streams and AttnRes depth mixes by default, the collapsed stream for ``branch``). Result: ``D[l, n]`` for start layer ``l`` in 0..L and
offset ``n`` in 0..L - l (NaN elsewhere); ``D[l, 1]`` is how much layer ``l`` turns the representation.
"""

from __future__ import annotations

import torch

from . import conventions
from .common import as_batches, progress


def angular_sums(states: list[torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """Summed angular distance over the selected tokens for every (l, n): ``[L+1, L+1]`` (zeros where undefined)."""
    u = torch.stack([h[tokens].double() for h in states])  # [L+1, N, d]; fp64: arccos is steep near cos = 1
    u = u / u.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    k = len(states)
    out = torch.zeros(k, k, dtype=torch.float64)
    for n in range(1, k):
        cos = (u[: k - n] * u[n:]).sum(-1).clamp(-1.0, 1.0)  # [L+1-n, N]
        out[: k - n, n] = (torch.arccos(cos) / torch.pi).sum(-1)
    return out


@torch.no_grad()
def angular_distance(model, batches, show_progress: bool = True,
                     convention: str = conventions.DEFAULT) -> torch.Tensor:
    """Token-mean angular distance ``D[l, n]`` (``[L+1, L+1]``, NaN where ``l + n > L``)."""
    conventions.check(convention)
    batches = as_batches(batches)
    total, count = None, 0
    for b in progress(batches, desc="angular", enabled=show_progress):
        f = conventions.forward_states(model, b, convention)
        s = angular_sums(f.states, b.tokens)
        total = s if total is None else total + s
        count += int(b.tokens.sum())
    return finalize(total, count)


def finalize(total: torch.Tensor, count: int) -> torch.Tensor:
    k = total.shape[0]
    d = total / max(count, 1)
    l_idx, n_idx = torch.meshgrid(torch.arange(k), torch.arange(k), indexing="ij")
    return d.masked_fill(l_idx + n_idx > k - 1, float("nan")).float()


def summary(D: torch.Tensor) -> dict:
    """Per-layer step distance d(h_l, h_{l+1}) and its mean over the last 3/4 of the layers."""
    from .common import late_start

    steps = D[:-1, 1]
    L = steps.numel()
    return {"step": steps.tolist(), "late_mean_step": float(steps[late_start(L):].mean()) if L else float("nan")}
