"""One registry-parametrized suite: every design passes it (a new design gets it for free)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import TINY, batch, tiny_model, train_steps
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

import hf_depth

DESIGNS = sorted(hf_depth.DESIGNS)


@pytest.mark.parametrize("design", DESIGNS)
def test_auto_classes(design):
    cfg = hf_depth.config_for(design, **TINY)
    assert type(AutoConfig.for_model(cfg.model_type, **TINY)) is type(cfg)
    lm = AutoModelForCausalLM.from_config(cfg)
    base = AutoModel.from_config(cfg)
    assert type(lm) is hf_depth.MODEL_CLASSES[design][1] and type(base) is hf_depth.MODEL_CLASSES[design][0]


@pytest.mark.parametrize("design", DESIGNS)
def test_save_reload_identical(design, tmp_path):
    model = tiny_model(design)
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert set(cfg["auto_map"]) == {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    x, mask = batch()
    with torch.no_grad():
        torch.testing.assert_close(again(x, attention_mask=mask).logits, model(x, attention_mask=mask).logits,
                                   rtol=0, atol=0)
    base = AutoModel.from_pretrained(tmp_path)
    assert type(base).__name__.endswith("Model")


@pytest.mark.parametrize("design", DESIGNS)
def test_generate_cache_equals_no_cache_with_left_padding(design):
    model = tiny_model(design)
    x, mask = batch()
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with_cache = model.generate(x, **kw)
    without = model.generate(x, use_cache=False, **kw)
    torch.testing.assert_close(with_cache, without, rtol=0, atol=0)
    # a left-padded row generates what the same prompt alone does
    alone = model.generate(x[:1, 3:], attention_mask=mask[:1, 3:], max_new_tokens=8, do_sample=False, pad_token_id=0)
    torch.testing.assert_close(with_cache[:1, 3:], alone, rtol=0, atol=0)


@pytest.mark.parametrize("design", DESIGNS)
def test_padded_logits_equal_unpadded(design):
    model = tiny_model(design)
    x, mask = batch()
    with torch.no_grad():
        padded = model(x, attention_mask=mask).logits[0, 3:]
        alone = model(x[:1, 3:]).logits[0]
    torch.testing.assert_close(padded, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("design", DESIGNS)
def test_hidden_states_one_per_boundary(design):
    model = tiny_model(design)
    x, _ = batch()
    out = model(x, output_hidden_states=True)
    hs = out.hidden_states
    assert len(hs) == model.config.num_hidden_layers + 1
    assert all(h.shape == (*x.shape, model.config.hidden_size) for h in hs)
    assert isinstance(model.model.residual_path_weights(), dict)


@pytest.mark.parametrize("design", DESIGNS)
def test_gradient_checkpointing_same_grads(design):
    x, _ = batch(left_pad=(0, 0, 0))
    grads = []
    for ckpt in (False, True):
        model = tiny_model(design).train()
        if ckpt:
            model.activation_checkpointing_enable()
            assert all(layer.gradient_checkpointing for layer in model.model.layers)
        model(x, labels=x).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-5, atol=1e-7, msg=n)


@pytest.mark.parametrize("design", DESIGNS)
def test_bf16_close_to_fp32(design):
    model = tiny_model(design)
    x, mask = batch()
    with torch.no_grad():
        ref = model(x, attention_mask=mask).logits
        low = model.to(torch.bfloat16)(x, attention_mask=mask).logits.float()
    assert torch.isfinite(low).all()
    rel = (low - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()
    assert rel < 0.05, rel


@pytest.mark.parametrize("design", DESIGNS)
def test_thirty_steps_reduce_loss(design):
    torch.manual_seed(0)
    model = tiny_model(design).train()
    x = torch.randint(2, 97, (4, 16), generator=torch.Generator().manual_seed(3))
    losses = train_steps(model, x, torch.optim.AdamW(model.parameters(), lr=3e-3), 30)
    assert losses[-1] < 0.7 * losses[0], losses
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad), "a parameter got no gradient"


@pytest.mark.parametrize("design", DESIGNS)
def test_olmo_core_names_round_trip_or_one_line_refusal(design):
    """A design that declares OLMo-core name rules (``Design.olmo``) maps every parameter to DepthBench names and
    back unchanged; one that declares none is refused in one line naming it and the convertible designs."""
    from hf_depth.olmo_core import convertible, hf_depth_to_olmo_core, olmo_core_to_hf_state_dict

    model = tiny_model(design).eval()
    if design not in convertible():
        with pytest.raises(ValueError) as e:
            hf_depth_to_olmo_core(model)
        msg = str(e.value)
        assert "\n" not in msg and repr(design) in msg and all(repr(n) in msg for n in convertible()), msg
        return
    back = olmo_core_to_hf_state_dict(hf_depth_to_olmo_core(model), model.config)
    sd = model.state_dict()
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)


def test_trust_remote_code_without_package(tmp_path):
    """Every design's saved folder loads in a process that never imports hf_depth."""
    expected = {}
    x = torch.arange(2, 9)[None]
    for design in DESIGNS:
        model = tiny_model(design)
        model.save_pretrained(tmp_path / design)
        with torch.no_grad():
            expected[design] = model(x).logits[0, -1].tolist()
    (tmp_path / "expected.json").write_text(json.dumps(expected))
    code = f"""
import json, sys, torch
from transformers import AutoModelForCausalLM
exp = json.load(open({str(tmp_path / 'expected.json')!r}))
for design, logits in exp.items():
    m = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r} + '/' + design, trust_remote_code=True).eval()
    with torch.no_grad():
        got = m(torch.arange(2, 9)[None]).logits[0, -1]
    torch.testing.assert_close(got, torch.tensor(logits), rtol=1e-6, atol=1e-6)
    assert type(m).__module__.startswith('transformers_modules'), type(m).__module__
assert 'hf_depth' not in sys.modules
print('OK', len(exp))
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_HUB_OFFLINE"] = "1"
    # run from a folder where `hf_depth` cannot be imported from the source tree, with the package hidden
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "hf_depth.py").write_text("raise ImportError('hf_depth must not be imported')\n")
    env["PYTHONPATH"] = str(hide)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"OK {len(DESIGNS)}" in r.stdout
