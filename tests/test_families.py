"""Diagnostics on every supported Hub decoder family (tiny random configs, no download), with known answers.

What must mean the same in every family: skipping a layer = its branches contribute nothing (so a layer whose
branches already output zero has causal score 0, pruning delta 0 and angular step 0, and this holds for the
last layer too, i.e. ``h_L`` is read before the final norm); the LogitLens readout of ``h_L`` is the model's own
logits (final norm, tied or untied head, Gemma's softcapping), so its KL is 0; identical layers swap to the
same function (permutation score 0).
"""

import json

import pytest
import torch
import transformers as tr
from family_helpers import FAMILIES, family_model
from torch.utils.flop_counter import FlopCounterMode

from hf_depth.diagnostics import angular, causal, cost, logit_lens, permutation
from hf_depth.diagnostics.adapters import adapter_for
from hf_depth.diagnostics.cli import main as diagnose
from hf_depth.diagnostics.common import Batch, forward_states
from hf_depth.diagnostics.report import run_diagnostics

NAMES = sorted(FAMILIES)


def data(seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(2, 97, (3, 10), generator=g)
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    x[0, :3] = 0
    return [Batch(x, mask), Batch(torch.randint(2, 97, (2, 10), generator=g), torch.ones(2, 10, dtype=torch.long))]


def zero_layer(model, i):
    """Zero every parameter of layer i's branches: their outputs are exactly zero in every family."""
    a = adapter_for(model)
    with torch.no_grad():
        for name in a.branches:
            for p in getattr(a.layers()[i], name).parameters():
                p.zero_()
    return model


@pytest.mark.parametrize("family", NAMES)
@pytest.mark.parametrize("layer", [1, 2])
def test_zeroed_layer_gives_zero_causal_pruning_and_angular(family, layer):
    model = zero_layer(family_model(family), layer)
    c = causal.causal_scores(model, data(), show_progress=False)
    later = c["scores"][layer, layer + 1:]
    assert torch.all(later.abs() < 1e-5), later  # skipping a dead layer changes no later update
    assert c["skip_loss"][layer] == pytest.approx(c["loss"], abs=1e-5)
    assert abs(c["skip_loss"][0] - c["loss"]) > 1e-4  # a live layer does matter
    D = angular.angular_distance(model, data(), show_progress=False)
    assert float(D[layer, 1]) < 1e-6
    assert float(D[0, 1]) > 1e-4


@pytest.mark.parametrize("family", NAMES)
def test_logit_lens_readout_is_the_models_own(family):
    model = family_model(family)
    b = data()[0]
    f = forward_states(model, b)
    torch.testing.assert_close(adapter_for(model).logits(f.states[-1]), f.logits, rtol=0, atol=1e-5)
    kl = logit_lens.logit_lens_kl(model, data(), show_progress=False)
    assert len(kl) == 4 and kl[-1] == pytest.approx(0.0, abs=1e-7) and kl[0] > 1e-4


def test_gemma_readout_needs_the_softcap():
    model = family_model("gemma2", final_logit_softcapping=0.5)  # a cap that bites on random logits
    a = adapter_for(model)
    f = forward_states(model, data()[0])
    raw = a.head()(a.final_norm()(f.states[-1]))
    assert (raw - f.logits).abs().max() > 1e-2  # without softcapping the lens would be wrong
    torch.testing.assert_close(a.logits(f.states[-1]), f.logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", NAMES)
def test_identical_layers_swap_to_the_same_function(family):
    model = family_model(family)
    a = adapter_for(model)
    layers = a.layers()
    with torch.no_grad():
        for layer in layers:
            for name in (*a.branches, *a.branch_norms):
                getattr(layer, name).load_state_dict(getattr(layers[0], name).state_dict())
    scores = permutation.permutation_scores(model, data(), show_progress=False)["scores"]
    off = ~torch.eye(3, dtype=torch.bool)
    assert float(scores[off].abs().max()) < 1e-6
    distinct = permutation.permutation_scores(family_model(family), data(), show_progress=False)["scores"]
    assert bool((distinct[off] > 1e-6).all())


@pytest.mark.parametrize("family", NAMES)
def test_analytic_flops_match_flop_counter(family):
    model = family_model(family)
    T, B = 16, 2
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=torch.randint(2, 97, (B, T)), use_cache=False)
    assert cost.prefill_flops(model.config, T, model)["total_matmul"] * B == pytest.approx(
        counter.get_total_flops(), rel=0.02)


@pytest.mark.parametrize("family", NAMES)
def test_every_measurement_of_the_report_runs(family):
    rep = run_diagnostics(family_model(family), data(), measure_seq_len=8, repeats=1, flops_seq_len=64,
                          show_progress=False)
    assert rep["model"]["family"] == adapter_for(family_model(family)).family
    for key in ("angular", "causal", "pruning", "permutation", "logit_lens", "cost"):
        assert key in rep, key
    assert rep["paths"] is None and rep["cost"]["measured"]["generate"]["tokens_per_s"] > 0
    json.dumps(rep, allow_nan=False, default=str)


def test_unknown_family_is_refused_with_one_line(tmp_path, capsys):
    cfg = tr.GPTJConfig(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4)
    model = tr.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match="unsupported model family 'gptj'"):
        run_diagnostics(model, data(), show_progress=False)
    model.save_pretrained(tmp_path / "gptj")
    capsys.readouterr()
    assert diagnose([str(tmp_path / "gptj"), "--data", "x.txt", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unsupported model family 'gptj'" in err[0] and "gpt_neox" in err[0]


def test_cli_diagnoses_a_gpt2_folder(tmp_path, capsys):
    family_model("gpt2").save_pretrained(tmp_path / "m")
    f = tmp_path / "ids.jsonl"
    f.write_text("\n".join(json.dumps({"input_ids": list(range(2 + k, 14 + k))}) for k in range(4)))
    rc = diagnose([str(tmp_path / "m"), "--data", str(f), "--out", str(tmp_path / "out"), "--seq-len", "12",
                   "--num-samples", "4", "--batch-size", "2", "--no-measure-cost", "--no-progress"])
    assert rc == 0
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["model"]["family"] == "gpt2" and rep["logit_lens"]["kl"][-1] == pytest.approx(0.0, abs=1e-7)
