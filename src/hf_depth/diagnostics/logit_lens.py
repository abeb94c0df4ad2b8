"""LogitLens (DepthBench Figure 8, right): KL between each layer's prediction and the final prediction.

    p_l = softmax(readout(h_l)),     KL_l = KL(p_L || p_l) = sum_v p_L (log p_L - log p_l)

token-mean over real tokens, for l = 0..L (``h_0`` is the embedding, ``h_L`` the last layer's output before the
final norm). ``readout`` is the family's own (``adapters.Adapter.logits``: final norm, LM head, and Gemma's
logit softcapping, exactly as the model's forward), applied to the collapsed state; ``p_L`` is the model's own
output distribution. ``KL_L`` is computed, not set: it is 0 whenever the readout is the model's (every supported
family, every single-state hf_depth design); for HC with DepthBench's sum-of-normed-streams reduce it is the
gap between the model's output and ``norm(collapse(state))``, the best single-stream reading of a layer.
"""

from __future__ import annotations

import torch

from .adapters import adapter_for
from .common import as_batches, forward_states, progress


@torch.no_grad()
def logit_lens_kl(model, batches, show_progress: bool = True) -> list[float]:
    """Token-mean KL(p_final || p_l) for every layer boundary l = 0..L."""
    batches = as_batches(batches)
    readout = adapter_for(model).logits
    sums, count = None, 0
    for b in progress(batches, desc="logit lens", enabled=show_progress):
        f = forward_states(model, b)
        tok = b.tokens
        logp_final = torch.log_softmax(f.logits[tok].float(), -1)
        p_final = logp_final.exp()
        row = []
        for h in f.states:  # the full [B, T, d] state, as the model's own head sees it (same kernels, same bits)
            logp = torch.log_softmax(readout(h)[tok].float(), -1)
            row.append(float((p_final * (logp_final - logp)).sum(-1).sum()))
        t = torch.tensor(row, dtype=torch.float64)
        sums = t if sums is None else sums + t
        count += int(tok.sum())
    return (sums / max(count, 1)).tolist()
