"""LogitLens (DepthBench Figure 8, right): KL between each layer's prediction and the final prediction.

    p_l = softmax(lm_head(norm(h_l))),     KL_l = KL(p_L || p_l) = sum_v p_L (log p_L - log p_l)

token-mean over real tokens, for l = 0..L-1 (``h_0`` is the embedding). ``norm`` is the model's final norm
(``model.model.norm``), applied to the collapsed state; ``p_L`` is the model's own output distribution (for HC
with DepthBench's sum-of-normed-streams reduce that differs from ``norm(collapse(state))``, which is the best
single-stream reading of an intermediate layer).
"""

from __future__ import annotations

import torch

from .common import as_batches, base_model, forward_states, progress


def _lens(model):
    norm = getattr(base_model(model), "norm", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else model.lm_head
    if norm is None or head is None:
        raise ValueError(f"LogitLens needs `model.model.norm` and an LM head; {type(model).__name__} lacks one")
    return norm, head


@torch.no_grad()
def logit_lens_kl(model, batches, show_progress: bool = True) -> list[float]:
    """Token-mean KL(p_final || p_l) for every layer boundary l = 0..L (the last entry is 0)."""
    batches = as_batches(batches)
    norm, head = _lens(model)
    sums, count = None, 0
    for b in progress(batches, desc="logit lens", enabled=show_progress):
        f = forward_states(model, b)
        tok = b.tokens
        logp_final = torch.log_softmax(f.logits[tok].float(), -1)
        p_final = logp_final.exp()
        row = []
        for h in f.states[:-1]:
            logp = torch.log_softmax(head(norm(h[tok])).float(), -1)
            row.append(float((p_final * (logp_final - logp)).sum(-1).sum()))
        row.append(0.0)
        t = torch.tensor(row, dtype=torch.float64)
        sums = t if sums is None else sums + t
        count += int(tok.sum())
    return (sums / max(count, 1)).tolist()
