"""Pre-LN == transformers.LlamaForCausalLM with the same weights (logits, greedy generations, converters)."""

import pytest
import torch
from helpers import batch, tiny_model

from hf_depth.convert import llama_to_pre_ln, pre_ln_to_llama


@pytest.fixture(params=[2, 4], ids=["gqa", "mha"])
def pair(request):
    ours = tiny_model("pre_ln", num_key_value_heads=request.param)
    llama = pre_ln_to_llama(ours).eval()
    return ours, llama


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_logits_match_llama_fp32(pair, impl):
    ours, llama = pair
    ours.config._attn_implementation = llama.config._attn_implementation = impl
    x, mask = batch()
    with torch.no_grad():
        a = ours(x, attention_mask=mask).logits
        b = llama(x, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(a[valid], b[valid], rtol=1e-5, atol=1e-5)


def test_hidden_states_match_llama(pair):
    ours, llama = pair
    x, _ = batch(left_pad=(0, 0, 0))
    with torch.no_grad():
        ha = ours(x, output_hidden_states=True).hidden_states
        hb = llama(x, output_hidden_states=True).hidden_states
    assert len(ha) == len(hb) == ours.config.num_hidden_layers + 1
    for a, b in zip(ha, hb):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_greedy_generation_matches_llama(pair):
    ours, llama = pair
    x, mask = batch()
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    torch.testing.assert_close(ours.generate(x, **kw), llama.generate(x, **kw), rtol=0, atol=0)


def test_loss_and_grads_match_llama(pair):
    ours, llama = pair
    x, _ = batch(left_pad=(0, 0, 0))
    la, lb = ours(x, labels=x).loss, llama(x, labels=x).loss
    la.backward()
    lb.backward()
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-6)
    ga = dict(ours.named_parameters())
    for name, p in llama.named_parameters():
        torch.testing.assert_close(ga[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_round_trip_converters(pair):
    ours, llama = pair
    back = llama_to_pre_ln(llama).eval()
    x, mask = batch()
    with torch.no_grad():
        torch.testing.assert_close(back(x, attention_mask=mask).logits, ours(x, attention_mask=mask).logits)
    assert type(back).__name__ == "PreLNForCausalLM"


def test_converter_refuses_other_designs():
    with pytest.raises(ValueError, match="design='pre_ln'"):
        pre_ln_to_llama(tiny_model("sandwich_ln"))
