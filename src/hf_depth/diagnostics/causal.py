"""Skip-layer causal score C(s, l) (DepthBench Figure 6a/b) and, from the same forwards, single-layer pruning.

Skip layer ``s`` and compare every later layer's update ``Delta_l = z_{l+1} - z_l`` with the intact model's.
What "skip" and the state ``z`` mean is the convention's (``conventions``):

* ``depthbench`` (default; DepthBench ``analysis/compute_causal_score.py`` at
  keyu-wang-2002/DepthBench@f807aa279d04ffd6d08bc3d9f2c3a97985a1e980): the block returns its input, and

      C(s, l) = mean_tokens( |Delta'_l - Delta_l|_2 / max(|Delta_l|_2, 1e-8) )      (s < L - 1, s < l < L)

* ``branch``: the branches output zeros (``common.skip_layer``), and a ratio of means (NaN where 0 / 0):

      C(s, l) = mean_tokens |Delta'_l - Delta_l|_2  /  mean_tokens |Delta_l|_2

``R_causal`` = fraction of pairs (s, l > s) with s >= ceil(L/4) whose score exceeds 0.45.
"""

from __future__ import annotations

import torch

from . import conventions
from .common import as_batches, late_start, num_layers, progress

THRESHOLD = 0.45
EPS = 1e-8  # DepthBench's clamp of |Delta_l| (``--eps``)


@torch.no_grad()
def causal_scores(model, batches, show_progress: bool = True, convention: str = conventions.DEFAULT) -> dict:
    """Returns ``{"scores": [L, L] (NaN where l <= s, and for ``branch`` where Delta_l is 0), "skip_loss": [L],
    "loss": float, "convention": str}`` and for ``depthbench`` DepthBench's global causal score.

    ``skip_loss[s]`` is the mean next-token loss with layer ``s`` skipped (the pruning curve).
    """
    batches = as_batches(batches)
    if conventions.check(convention) == "depthbench":
        return _depthbench_scores(model, batches, show_progress)
    return _branch_scores(model, batches, show_progress)


def _updates(states, tok):
    return torch.stack([(states[i + 1] - states[i])[tok].float() for i in range(len(states) - 1)])  # [L, N, w]


def _depthbench_scores(model, batches, show_progress):
    L = num_layers(model)
    ratio = torch.zeros(L, L, dtype=torch.float64)
    skip_loss = torch.zeros(L, dtype=torch.float64)
    base_loss, count, ntok = 0.0, 0, 0
    it = iter(progress(range(len(batches) * L), desc="causal/pruning", enabled=show_progress))
    for b in batches:
        tok = b.tokens
        ref = conventions.forward_states(model, b, "depthbench")
        base_loss, count = base_loss + ref.loss_sum, count + ref.loss_count
        delta = _updates(ref.states, tok)
        norm = delta.norm(dim=-1).clamp_min(EPS)
        for s in range(L):
            with conventions.skip_layer(model, s, "depthbench"):
                f = conventions.forward_states(model, b, "depthbench", states=s < L - 1)
            skip_loss[s] += f.loss_sum
            if s < L - 1:
                d2 = _updates(f.states, tok)[s + 1:]
                ratio[s, s + 1:] += ((d2 - delta[s + 1:]).norm(dim=-1) / norm[s + 1:]).sum(-1).double()
            next(it, None)
        ntok += int(tok.sum())
    scores = (ratio / max(ntok, 1)).float()
    s_idx, l_idx = torch.meshgrid(torch.arange(L), torch.arange(L), indexing="ij")
    scores = scores.masked_fill(l_idx <= s_idx, float("nan"))
    c = max(count, 1)
    return {"scores": scores, "skip_loss": (skip_loss / c).tolist(), "loss": base_loss / c,
            "convention": "depthbench", **conventions.global_causal_score(scores)}


def _branch_scores(model, batches, show_progress):
    L = num_layers(model)
    num = torch.zeros(L, L, dtype=torch.float64)
    den = torch.zeros(L, dtype=torch.float64)
    skip_loss = torch.zeros(L, dtype=torch.float64)
    base_loss, count = 0.0, 0
    bar = progress(range(len(batches) * L), desc="causal/pruning", enabled=show_progress)
    it = iter(bar)
    for b in batches:
        tok = b.tokens
        ref = conventions.forward_states(model, b, "branch")
        base_loss, count = base_loss + ref.loss_sum, count + ref.loss_count
        delta = torch.stack([(ref.states[i + 1] - ref.states[i])[tok].float() for i in range(L)])  # [L, N, d]
        den += delta.norm(dim=-1).sum(-1).double()
        for s in range(L):
            with conventions.skip_layer(model, s, "branch"):
                f = conventions.forward_states(model, b, "branch")
            skip_loss[s] += f.loss_sum
            for i in range(s + 1, L):
                d2 = (f.states[i + 1] - f.states[i])[tok].float()
                num[s, i] += (d2 - delta[i]).norm(dim=-1).sum().double()
            next(it, None)
    scores = num / den.clamp_min(1e-30)[None, :]
    s_idx, l_idx = torch.meshgrid(torch.arange(L), torch.arange(L), indexing="ij")
    undefined = (l_idx <= s_idx) | (den == 0)[None, :]  # l <= s, or layer l never updates (0 / 0)
    scores = scores.masked_fill(undefined, float("nan")).float()
    c = max(count, 1)
    return {"scores": scores, "skip_loss": (skip_loss / c).tolist(), "loss": base_loss / c, "convention": "branch"}


def late_pairs(L: int) -> list[tuple[int, int]]:
    """Pairs (a, b), a < b, inside the last 3/4 of the network (a >= ceil(L/4))."""
    s0 = late_start(L)
    return [(a, b) for a in range(s0, L) for b in range(a + 1, L)]


def fraction_above(scores: torch.Tensor, threshold: float) -> float:
    """Fraction of late pairs (upper triangle, a >= ceil(L/4)) whose score exceeds ``threshold``."""
    pairs = late_pairs(scores.shape[0])
    if not pairs:
        return float("nan")
    vals = torch.tensor([float(scores[a, b]) for a, b in pairs])
    vals = vals[~torch.isnan(vals)]  # undefined pairs (unswappable, or a layer that never updates) do not count
    return float((vals > threshold).float().mean()) if vals.numel() else float("nan")


def r_causal(scores: torch.Tensor, threshold: float = THRESHOLD) -> float:
    return fraction_above(scores, threshold)
