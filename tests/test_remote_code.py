"""Remote code is opt-in (issue 13, item 3): `hf-depth eval`, `val-loss` and `diagnose` (and `--model hfd` for
lm-eval) load hf_depth folders with the installed package's classes and standard transformers folders with
transformers', and refuse -- one line, exit 2, nothing of the folder's code run -- a folder whose config asks to
run its own code unless `--trust-remote-code` is given. Also: `hf-depth eval` records the sandbox's
containment (`sandbox.describe()`) in results.json."""

import json
import shutil
import sys

import pytest
import torch
from eval_helpers import FIXTURES, gpt2_tokenizer, tiny_hf_depth, tiny_llama

from hf_depth import cli
from hf_depth.loading import RemoteCodeRefused, check_remote_code, foreign_code, load_model, load_tokenizer

EVIL_MODULE = '''import pathlib
pathlib.Path({marker!r}).write_text("the folder's own code ran")
from transformers import LlamaConfig, LlamaForCausalLM


class EvilConfig(LlamaConfig):
    model_type = "hfd_test_evil"


class EvilForCausalLM(LlamaForCausalLM):
    config_class = EvilConfig
'''


def _edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote_code")
    tok = gpt2_tokenizer()
    out = {"root": root, "marker": root / "MARKER"}
    for name, model in (("ours", tiny_hf_depth()), ("llama", tiny_llama())):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        out[name] = str(root / name)
    # a folder whose auto_map points at a module that writes a marker when imported
    evil = root / "evil"
    tiny_llama().save_pretrained(evil)
    tok.save_pretrained(evil)
    (evil / "evil_modeling.py").write_text(EVIL_MODULE.format(marker=str(out["marker"])))
    _edit_json(evil / "config.json", model_type="hfd_test_evil", architectures=["EvilForCausalLM"],
               auto_map={"AutoConfig": "evil_modeling.EvilConfig",
                         "AutoModelForCausalLM": "evil_modeling.EvilForCausalLM"})
    out["evil"] = str(evil)
    # an hf_depth model whose tokenizer asks for its own code
    evil_tok = root / "evil_tok"
    tiny_hf_depth().save_pretrained(evil_tok)
    tok.save_pretrained(evil_tok)
    (evil_tok / "evil_modeling.py").write_text(EVIL_MODULE.format(marker=str(out["marker"])))
    _edit_json(evil_tok / "tokenizer_config.json", auto_map={"AutoTokenizer": [None, "evil_modeling.EvilTok"]})
    out["evil_tok"] = str(evil_tok)
    text = root / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog.\n\nA second paragraph of held-out text here.\n")
    out["text"] = str(text)
    return out


def _no_marker(folders):
    assert not folders["marker"].exists(), "the folder's own code ran"


def test_an_hf_depth_folder_has_an_auto_map_that_is_not_foreign(folders):
    cfg = json.loads((folders["root"] / "ours" / "config.json").read_text())
    assert "AutoModelForCausalLM" in cfg["auto_map"]          # save_pretrained wrote it (loads without hf_depth)
    assert foreign_code(folders["ours"]) is None and foreign_code(folders["llama"]) is None
    assert "evil_modeling.EvilConfig" in foreign_code(folders["evil"])


@pytest.mark.parametrize("name", ["ours", "llama"])
def test_ours_and_standard_folders_load_without_the_flag(folders, name):
    model = load_model(folders[name])
    want = "hf_depth." if name == "ours" else "transformers.models.llama"
    assert type(model).__module__.startswith(want), type(model).__module__
    assert not any("transformers_modules" in m and name in m for m in sys.modules)   # the copied code is unused
    assert load_tokenizer(folders[name]) is not None
    _no_marker(folders)


@pytest.mark.parametrize("command", ["eval", "val-loss", "diagnose"])
def test_every_command_refuses_foreign_code_without_the_flag(folders, command, capsys):
    tail = {"eval": ["--tasks", "hfd_sciq_mc", "--data-dir", str(FIXTURES), "--device", "cpu",
                     "--output", str(folders["root"] / "out_refused")],
            "val-loss": ["--data", folders["text"]],
            "diagnose": ["--data", folders["text"], "--out", str(folders["root"] / "diag_refused")]}[command]
    for folder in ("evil", "evil_tok"):
        capsys.readouterr()
        assert cli.main([command, folders[folder], *tail]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1] == (f"hf-depth {command}: {folders[folder]} asks to run its own code (auto_map: "
                           + ("AutoConfig -> evil_modeling.EvilConfig; AutoModelForCausalLM -> "
                              "evil_modeling.EvilForCausalLM" if folder == "evil" else
                              "AutoTokenizer -> evil_modeling.EvilTok")
                           + "); pass --trust-remote-code if you trust it"), err
        _no_marker(folders)
    assert not (folders["root"] / "out_refused").exists() and not (folders["root"] / "diag_refused").exists()


def test_lm_eval_model_class_follows_trust_remote_code(folders):
    from hf_depth.evaluation.lm import ContextFitHFLM

    with pytest.raises(RemoteCodeRefused, match="trust_remote_code=True in --model_args"):
        ContextFitHFLM(pretrained=folders["evil"], device="cpu", batch_size=1)
    _no_marker(folders)
    lm = ContextFitHFLM(pretrained=folders["ours"], device="cpu", batch_size=1)
    assert type(lm.model).__module__.startswith("hf_depth.")


def test_the_flag_lets_the_folders_code_run(folders, tmp_path, monkeypatch):
    import transformers.dynamic_module_utils as dmu

    monkeypatch.setattr(dmu, "HF_MODULES_CACHE", str(tmp_path / "modules"))   # keep the user's cache clean
    with pytest.raises(RemoteCodeRefused):
        check_remote_code(folders["evil"], False)
    _no_marker(folders)
    model = load_model(folders["evil"], trust_remote_code=True)
    assert folders["marker"].read_text() == "the folder's own code ran"
    assert type(model).__name__ == "EvilForCausalLM"
    with torch.no_grad():
        assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 50257)
    folders["marker"].unlink()
    # the command-line flag reaches the loader (a copy: the module of the first load is imported already)
    again = shutil.copytree(folders["evil"], tmp_path / "evil_again")
    assert cli.main(["val-loss", str(again), "--data", folders["text"], "--seq-len", "8", "--trust-remote-code"]) == 0
    assert folders["marker"].exists()
    folders["marker"].unlink()


def test_eval_records_the_sandbox_containment(folders, tmp_path, capsys):
    from hf_depth.evaluation import sandbox

    out = tmp_path / "out"
    assert cli.main(["eval", folders["llama"], "--tasks", "hfd_sciq_mc", "--limit", "2", "--data-dir", str(FIXTURES),
                     "--device", "cpu", "--max-length", "256", "--output", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert "hfd_sciq_mc" in results["results"]
    recorded = results["hfd_sandbox"]
    assert recorded == json.loads(json.dumps(sandbox.describe()))
    assert set(recorded) == {"isolation", "contained", "not_contained"}
    assert recorded["contained"][0].startswith("success only through the harness's per-run token")
    iso = recorded["isolation"]
    # each namespace the run had is said as contained, each it lacked as not contained (the documented fallback)
    said = " | ".join(recorded["contained"] if iso["netns"] else recorded["not_contained"])
    assert ("own network namespace" if iso["netns"] else "audit hook refusing socket creation") in said
    _no_marker(folders)
