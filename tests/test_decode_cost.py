"""Issue 12 item 5: a KV-cached decoding step does no per-token work beyond the design's equations.

Each design's equations mix within a token (AttnRes' depth softmax over the current token's sources, HC's
streams, MoDA's same-token depth K/V), so the only work of a decoding step that grows with the prompt is the
sequence attention over the KV cache -- exactly Pre-LN's. Measured as the elements every aten op of one decoding
step writes (a ``TorchDispatchMode``), for two prompt lengths: the growth per prompt token must equal Pre-LN's
(MoDA, whose one softmax runs its own fp32 eager attention, against Pre-LN with eager attention: within 5%; its
growth per layer must not depend on depth, i.e. no earlier token's depth K/V is read). Also: the per-step
overheads removed for issue 12 stay removed (RoPE without a matmul, no ``promote_types`` per norm, a cached
forward signature for ``generate``)."""

import inspect

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hf_depth


class _Written(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.elements, self.ops = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append(str(func))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                self.elements += o.numel()
        return out


def _step(model, prompt_len: int) -> _Written:
    ids = torch.randint(2, model.config.vocab_size, (1, prompt_len))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache = getattr(out, "cache", None) or out.past_key_values
        with _Written() as w:
            model(ids[:, -1:], cache=cache, use_cache=True, logits_to_keep=1)
    return w


def _growth(design: str, layers: int, attn: str) -> float:
    """Elements written by one decoding step, per extra prompt token."""
    torch.manual_seed(0)
    model = hf_depth.model_for(design, vocab_size=256, hidden_size=32, num_hidden_layers=layers,
                               num_attention_heads=2, attn_implementation=attn).eval()
    return (_step(model, 72).elements - _step(model, 8).elements) / 64


@pytest.mark.parametrize("design", sorted(hf_depth.DESIGNS))
def test_decoding_step_grows_with_the_prompt_like_pre_ln(design):
    if design == "moda":
        for layers in (2, 4):
            assert _growth("moda", layers, "sdpa") <= 1.05 * _growth("pre_ln", layers, "eager")
        assert _growth("moda", 4, "sdpa") / 4 == pytest.approx(_growth("moda", 2, "sdpa") / 2, rel=0.02)
        return
    assert _growth(design, 4, "sdpa") == _growth("pre_ln", 4, "sdpa")


def test_per_step_overheads_stay_removed():
    torch.manual_seed(0)
    model = hf_depth.model_for("pre_ln", vocab_size=256, hidden_size=32, num_hidden_layers=2,
                               num_attention_heads=2).eval()
    ops = _step(model, 8).ops
    assert not [o for o in ops if "promote_types" in o or o.startswith("aten.bmm")], ops
    assert "__signature__" in vars(type(model).forward)
    assert inspect.signature(model.forward).parameters.keys() >= {"input_ids", "cache", "past_key_values"}


def _ops(design: str, layers: int, **kw) -> list[str]:
    torch.manual_seed(0)
    model = hf_depth.model_for(design, vocab_size=256, hidden_size=32, num_hidden_layers=layers,
                               num_attention_heads=2, **kw).eval()
    return _step(model, 8).ops


@pytest.mark.parametrize("design", sorted(hf_depth.DESIGNS))
def test_decoding_step_ops_are_linear_in_depth(design):
    """A decoding step is dispatch-bound, so its cost is its op count: every block adds the same number of ops,
    however deep it sits (AttnRes' weighted sum over its growing list of sources is one batched product, not one
    op per source)."""
    counts = [len(_ops(design, layers)) for layers in (3, 6, 9)]
    assert counts[2] - counts[1] == counts[1] - counts[0], counts


def test_mhc_decoding_sinkhorn_is_one_op_per_half_step(monkeypatch):
    """mHC's Sinkhorn in a decoding step: with the native kernels, inside the one fused routing call per sublayer
    (no Sinkhorn op at all); without them (the reference, ``functional.sinkhorn``), one ``log_softmax`` per
    half-step, 2 x iters per sublayer, no ``logsumexp`` (several ops) plus a subtraction."""
    from hf_depth import native
    from hf_depth.models import depth_ops

    if native.library() is None:
        pytest.skip("native kernels unavailable (no C compiler)")
    calls = []
    real = native.mhc_route
    monkeypatch.setattr(native, "mhc_route", lambda H, *a: calls.append(H.shape[:-2].numel()) or real(H, *a))
    ops = _ops("mhc", 2, mhc_sinkhorn_iters=7)
    assert not [o for o in ops if "softmax" in o or "logsumexp" in o]
    assert calls[-4:] == [1] * 4  # the decoding step: one token, one fused call per sublayer
    monkeypatch.setattr(depth_ops, "_native_ok", lambda: False)
    ops = _ops("mhc", 2, mhc_sinkhorn_iters=7)
    assert not [o for o in ops if "logsumexp" in o]
    assert sum("_log_softmax" in o for o in ops) == 2 * 7 * 4
