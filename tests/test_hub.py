"""Export a finished run: a complete Hub folder that loads without hf_depth, and a valid model card."""

import json

import pytest
import torch
import yaml
from helpers import run_without_hf_depth
from training_helpers import hf_depth_cache, tiny_recipe, write_corpus  # noqa: F401

from hf_depth import hub
from hf_depth.training.recipe import recipe_from_dict
from hf_depth.training.train import run


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hub")
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_DEPTH_CACHE", str(tmp_path_factory.getbasetemp() / "hf_depth_cache"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        r = recipe_from_dict(tiny_recipe(tmp, write_corpus(tmp), name="hubrun", train={"max_steps": 6}))
        assert run(r)["status"] == "finished"
    finally:
        mp.undo()
        torch.set_num_threads(threads)
    (r.resolved_run_dir / "eval_results.json").write_text(json.dumps({"sciq": {"acc": 0.25}}))
    return r.resolved_run_dir


def test_export_folder_is_complete_and_loads_in_a_fresh_process(finished_run, tmp_path):
    out = tmp_path / "export"
    assert hub.main([str(finished_run), "--out", str(out)]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "README.md",
            "loss_curve.png", "recipe.yaml", "modeling_depth.py", "configuration_depth.py"} <= names
    assert "AutoModelForCausalLM" in json.loads((out / "config.json").read_text())["auto_map"]
    code = f"""
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
m = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True).eval()
tok = AutoTokenizer.from_pretrained({str(out)!r})
ids = tok("def main():", return_tensors="pt").input_ids
out = m.generate(ids, max_new_tokens=5, do_sample=False)
assert out.shape[1] == ids.shape[1] + 5 and m.generation_config.eos_token_id == tok.eos_token_id
assert 'hf_depth' not in sys.modules and type(m).__module__.startswith('transformers_modules')
print('OK')
"""
    r = run_without_hf_depth(tmp_path, code)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


def test_model_card_is_yaml_front_matter_plus_markdown(finished_run, tmp_path):
    card = hub.write_model_card(tmp_path, finished_run, {"Depth diagnostics": "angular distance: 0.42"},
                                repo_id="me/tiny")
    text = card.read_text()
    assert text.startswith("---\n")
    _, fm, body = text.split("---\n", 2)
    meta = yaml.safe_load(fm)
    assert meta["library_name"] == "transformers" and "hf_depth_pre_ln" in meta["tags"]
    results = meta["model-index"][0]["results"]
    assert meta["model-index"][0]["name"] == "tiny"
    assert results[0]["metrics"][0]["type"] == "loss" and isinstance(results[0]["metrics"][0]["value"], float)
    assert {"type": "acc", "name": "acc", "value": 0.25} in results[1]["metrics"]
    assert "h <- h + F(N(h))" in body and "## Depth diagnostics" in body and "angular distance: 0.42" in body
    assert "$" not in body.replace("$ ", "")  # every placeholder filled
    assert body.lstrip().startswith("# tiny") and "```yaml" in body and "![loss curve](loss_curve.png)" in body


def test_model_card_carries_diagnostics_headline(finished_run, tmp_path):
    diag = finished_run / "diagnostics"
    diag.mkdir(exist_ok=True)
    report = {"loss": 3.5, "causal": {"R_causal": 0.125}, "permutation": {"R_perm": 0.25},
              "pruning": {"delta": [0.5, 0.01]}}
    (diag / "report.json").write_text(json.dumps(report))
    try:
        body = hub.write_model_card(tmp_path, finished_run).read_text()
    finally:
        (diag / "report.json").unlink()
    assert "## Depth diagnostics" in body and "| 0.1250 |" in body and "| 0.2500 |" in body and "+0.500, +0.010" in body


def test_export_refuses_a_folder_without_a_model(tmp_path, capsys):
    assert hub.main([str(tmp_path)]) == 2
    assert "no final/ model" in capsys.readouterr().err
