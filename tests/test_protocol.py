"""The papers' protocol: FLOP-based compute efficiency, DepthBench's suites as recipes, the scale-vector arms."""

import pytest
import torch
from helpers import tiny_model
from torch.utils.flop_counter import FlopCounterMode

from hf_depth.training import results


@pytest.mark.parametrize("design", ["pre_ln", "attnres"])
def test_training_flops_match_counted_forward_backward(design):
    """3 x forward: FlopCounterMode over a real forward + backward agrees with the analytic count."""
    model = tiny_model(design, num_hidden_layers=3, attn_implementation="eager").train()
    B, T = 2, 16
    x = torch.randint(2, 97, (B, T))
    with FlopCounterMode(display=False) as counter:
        model(x, labels=x, use_cache=False).loss.backward()
    analytic = results.training_flops(model.config, B * T, T)
    assert analytic == pytest.approx(counter.get_total_flops(), rel=0.05)


def test_training_flops_grow_with_depth_at_equal_params():
    """Not 6 N D: beyond 6 N D the attention term grows with L d, and a design's routing adds its own FLOPs."""
    def excess(design, L, d, T=512, D=10**6):
        m = tiny_model(design, num_hidden_layers=L, hidden_size=d)
        n = sum(p.numel() for n_, p in m.named_parameters() if "embed_tokens" not in n_)
        return results.training_flops(m.config, D, T) / (6 * n * D)

    assert excess("pre_ln", 8, 32) > excess("pre_ln", 2, 64) > 1.0
    assert excess("hc", 2, 64) > excess("pre_ln", 2, 64)
