"""Single-layer pruning curve (DepthBench Figure 8, left): loss increase when one layer's branches are removed.

    prune[s] = L(M without layer s's branches) - L(M)

"Removed" is the convention's skip (``conventions.skip_layer``: the whole block returns its input for
``depthbench``, the default; its branches output zeros for ``branch``). ``causal.causal_scores``
computes the same skipped losses as a by-product; pass its ``skip_loss`` to avoid the extra forwards.
"""

from __future__ import annotations

import torch

from . import conventions
from .common import as_batches, mean_loss, num_layers, progress


@torch.no_grad()
def pruning_curve(model, batches, base_loss: float | None = None, skip_loss=None, show_progress: bool = True,
                  convention: str = conventions.DEFAULT) -> dict:
    """Returns ``{"loss": L(M), "skip_loss": [L], "delta": [L], "relative": [L]}``."""
    conventions.check(convention)
    batches = as_batches(batches)
    if base_loss is None:
        base_loss = mean_loss(model, batches)
    if skip_loss is None:
        skip_loss = []
        for s in progress(range(num_layers(model)), desc="pruning", enabled=show_progress):
            with conventions.skip_layer(model, s, convention):
                skip_loss.append(mean_loss(model, batches))
    delta = [x - base_loss for x in skip_loss]
    return {
        "loss": base_loss,
        "skip_loss": list(skip_loss),
        "delta": delta,
        "relative": [d / base_loss for d in delta],
    }
