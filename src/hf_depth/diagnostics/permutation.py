"""Permutation score P(l1, l2) (DepthBench Figure 6c/d).

Swap layers l1 and l2 in the convention's sense (``conventions.swap_layers``): ``depthbench`` (default)
exchanges every tensor of the two blocks, HC/mHC routing and the LNS factor included (DepthBench
``depth_probes.swap_blocks``); ``branch`` moves the *branch* weights only (``common.swap_layers``: attention,
FFN and their input norms; LNS's 1/sqrt(l), HC's routing, AttnRes queries, KEEL/DeepNorm post norms stay in
place). Then measure

    P(l1, l2) = |L(M) - L(M_swap)| / L(M)       (absolute value, as DepthBench's code)

``R_perm`` = fraction of pairs in the last 3/4 of the network (l1 >= ceil(L/4)) above 0.15.

Cost: one loss evaluation per pair over the calibration data; the swap is an in-place exchange of tensor
pointers (no copies, no deep copies of the model), the baseline loss is computed once.
"""

from __future__ import annotations

import torch

from . import conventions
from .causal import fraction_above
from .common import as_batches, mean_loss, num_layers, progress

THRESHOLD = 0.15


@torch.no_grad()
def permutation_scores(model, batches, base_loss: float | None = None, pairs=None, show_progress: bool = True,
                       convention: str = conventions.DEFAULT) -> dict:
    """Returns ``{"scores": [L, L] symmetric (NaN on the diagonal / unswappable pairs), "loss": L(M), "convention",
    and DepthBench's global aggregates (``conventions.global_permutation_scores``)}``."""
    conventions.check(convention)
    batches = as_batches(batches)
    L = num_layers(model)
    if base_loss is None:
        base_loss = mean_loss(model, batches)
    pairs = pairs if pairs is not None else [(a, b) for a in range(L) for b in range(a + 1, L)]
    scores = torch.full((L, L), float("nan"))
    for a, b in progress(pairs, desc="permutation", enabled=show_progress):
        if not conventions.swappable(model, a, b, convention):
            continue
        with conventions.swap_layers(model, a, b, convention):
            swapped = mean_loss(model, batches)
        scores[a, b] = scores[b, a] = abs(base_loss - swapped) / base_loss
    return {"scores": scores, "loss": base_loss, "convention": convention,
            **conventions.global_permutation_scores(scores)}


def r_perm(scores: torch.Tensor, threshold: float = THRESHOLD) -> float:
    return fraction_above(scores, threshold)
