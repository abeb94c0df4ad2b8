"""Bad inputs, table-driven: every one gets one clear line naming the field or file, the right exit status, and
leaves nothing that looks like a valid result (issue 14).

Config cases call ``config_for`` / ``from_pretrained`` and expect a ``ValueError`` naming the field. CLI cases call
``hf_depth.cli.main`` in-process (a few run ``hf-depth`` as a subprocess to prove the real exit status) and check:
the exit status, exactly one ``hf-depth COMMAND:`` line on stderr holding the needle, no traceback, and that none
of the case's result files exists afterwards. Divergence, resume and run-folder locking cases follow the tables.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from training_helpers import hf_depth_cache, tiny_recipe, write_corpus  # noqa: F401

import hf_depth
from hf_depth import cli
from hf_depth.training import train as train_mod

TINY = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
            pad_token_id=0, eos_token_id=1)
NAN, INF = float("nan"), float("inf")

# ---------------------------------------------------------------------------------------------- configs
CONFIG_CASES = [
    ("pre_ln", dict(rope_theta=NAN), "rope_theta"),
    ("pre_ln", dict(rope_theta=INF), "rope_theta"),
    ("pre_ln", dict(rope_theta=True), "rope_theta"),
    ("pre_ln", dict(initializer_range=NAN), "initializer_range"),
    ("pre_ln", dict(init_cutoff_factor=NAN), "init_cutoff_factor"),
    ("pre_ln", dict(rms_norm_eps=NAN), "rms_norm_eps"),
    ("pre_ln", dict(attention_dropout=NAN), "attention_dropout"),
    ("pre_ln", dict(hidden_size=True), "hidden_size"),
    ("pre_ln", dict(num_hidden_layers=2.0), "num_hidden_layers"),
    ("pre_ln", dict(attention_bias="no"), "attention_bias"),
    ("pre_ln", dict(scale_vector=3), "scale_vector"),
    ("pre_ln", dict(eos_token_id=97), "eos_token_id"),
    ("pre_ln", dict(eos_token_id=[1, 500]), "eos_token_id"),
    ("pre_ln", dict(pad_token_id=-1), "pad_token_id"),
    ("pre_ln", dict(bos_token_id=97), "bos_token_id"),
    ("pre_ln", dict(pad_token_id=True), "pad_token_id"),
    ("hc", dict(hc_alpha_scale_init=NAN), "hc_alpha_scale_init"),
    ("hc", dict(hc_beta_scale_init=INF), "hc_beta_scale_init"),
    ("hc", dict(hc_norm_eps=NAN), "hc_norm_eps"),
    ("hc", dict(hc_streams=True), "hc_streams"),
    ("mhc", dict(mhc_phi_init_std=NAN), "mhc_phi_init_std"),
    ("mhc", dict(mhc_gate_init=INF), "mhc_gate_init"),
    ("mhc", dict(mhc_identity_logit=INF), "mhc_identity_logit"),
    ("deepnorm", dict(deepnorm_alpha=NAN), "deepnorm_alpha"),
    ("deepnorm", dict(deepnorm_beta=INF), "deepnorm_beta"),
    ("deepnorm", dict(deepnorm_alpha=True), "deepnorm_alpha"),
    ("keel", dict(keel_alpha=INF), "keel_alpha"),
    ("keel", dict(keel_alpha=NAN), "keel_alpha"),
    ("block_attnres", dict(attnres_block_size=5), "attnres_block_size"),  # > 2L = 4
    ("block_attnres", dict(attnres_block_size=2.0), "attnres_block_size"),
    ("hires", dict(hires_outer_size=64.0), "hires_outer_size"),
    ("moda", dict(attn_implementation="flash_attention_2"), "attn_implementation"),
    ("moda", dict(attn_implementation="flex_attention"), "attn_implementation"),
]


@pytest.mark.parametrize("design, kwargs, needle", CONFIG_CASES, ids=lambda v: str(v) if isinstance(v, str) else None)
def test_bad_config_value_names_the_field(design, kwargs, needle):
    with pytest.raises(ValueError, match=f"`{needle}`"):
        hf_depth.config_for(design, **{**TINY, **kwargs})


def _saved(tmp_path, design="pre_ln", **kw):
    model = hf_depth.model_for(design, **{**TINY, **kw})
    model.save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("edit, needle", [
    ({"hidden_size": 30}, "hidden_size"),            # head_dim is recomputed, not trusted from disk
    ({"rope_theta": NAN}, "rope_theta"),
    ({"eos_token_id": 500}, "eos_token_id"),
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
])
def test_edited_config_json_is_refused_on_load(tmp_path, edit, needle):
    folder = _saved(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **edit}))
    from transformers import AutoConfig

    with pytest.raises(ValueError, match=f"`{needle}`"):
        AutoConfig.from_pretrained(folder)


def test_moda_backend_refused_at_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    folder = _saved(tmp_path, "moda")
    with pytest.raises(ValueError, match="`attn_implementation` 'flash_attention_2' is not supported by design 'moda'"):
        AutoModelForCausalLM.from_pretrained(folder, attn_implementation="flash_attention_2")
    assert AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").config._attn_implementation == "eager"


def test_head_dim_derived_is_recomputed_explicit_survives(tmp_path):
    from transformers import AutoConfig

    assert json.loads((_saved(tmp_path / "a") / "config.json").read_text())["head_dim"] is None  # derived
    assert AutoConfig.from_pretrained(tmp_path / "a").head_dim == 8
    hf_depth.model_for("pre_ln", **{**TINY, "head_dim": 16}).save_pretrained(tmp_path / "b")
    assert AutoConfig.from_pretrained(tmp_path / "b").head_dim == 16


@pytest.mark.parametrize("design, key, suggestion", [
    ("pre_ln", "hiden_size", "hidden_size"),
    ("pre_ln", "num_hiden_layers", "num_hidden_layers"),
    ("hc", "hc_stream", "hc_streams"),
    ("mhc", "mhc_sinkhorn_iter", "mhc_sinkhorn_iters"),
])
def test_misspelled_field_warns_with_the_closest_name(design, key, suggestion):
    with pytest.warns(UserWarning, match=f"`{key}`.*did you mean `{suggestion}`"):
        hf_depth.config_for(design, **TINY, **{key: 4})


def test_transformers_kwargs_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = hf_depth.config_for("pre_ln", **TINY, output_attentions=False, attn_implementation="eager",
                                torch_dtype="float32", use_cache=False, num_labels=2, return_dict=True)
    assert c._attn_implementation == "eager"


def test_eos_inside_the_vocabulary_except_the_depthbench_default():
    assert hf_depth.config_for("pre_ln", vocab_size=97).eos_token_id == 50279  # the documented exemption
    with pytest.raises(ValueError, match="`eos_token_id`"):
        hf_depth.config_for("pre_ln", vocab_size=97, eos_token_id=50278)


# ---------------------------------------------------------------------------------------------- CLI table
@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Files for every CLI case: a tiny saved model with a tokenizer, broken copies, bad data and recipes."""
    root = tmp_path_factory.mktemp("bad_inputs")
    os.environ.setdefault("HF_DEPTH_CACHE", str(tmp_path_factory.getbasetemp() / "hf_depth_cache"))
    from hf_depth.training.data import load_tokenizer
    from hf_depth.training.recipe import DataRecipe

    tok = load_tokenizer(DataRecipe(tokenizer="embedded", tokenizer_vocab_size=300))
    model_dir = root / "model"
    torch.manual_seed(0)
    hf_depth.model_for("pre_ln", **{**TINY, "vocab_size": len(tok), "eos_token_id": tok.eos_token_id,
                                    "pad_token_id": tok.pad_token_id}).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    truncated = root / "truncated"
    shutil.copytree(model_dir, truncated)
    st = truncated / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    (root / "no_config").mkdir()
    (root / "no_config" / "model.safetensors").write_bytes(b"\0" * 16)
    rng = np.random.default_rng(0)
    (root / "random.pt").write_bytes(rng.bytes(4096))
    (root / "empty.pt").write_bytes(b"")
    (root / "empty.jsonl").write_text("")
    (root / "blank.jsonl").write_text("\n\n")
    (root / "broken.jsonl").write_text('{"text": "fine"}\n{"text": "torn\n')
    (root / "notext.jsonl").write_text('{"body": "no text field"}\n')
    (root / "data.csv").write_text("a,b\n1,2\n")
    (root / "good.txt").write_text("the model reads the stream. " * 40)
    (root / "empty.bin").write_bytes(b"")
    (root / "odd.bin").write_bytes(b"\1\2\3")
    (root / "short.bin").write_bytes(np.arange(5, dtype=np.uint16).tobytes())
    (root / "random.npy").write_bytes(rng.bytes(512))
    np.save(root / "floats.npy", np.linspace(0, 1, 4096))
    np.save(root / "matrix.npy", np.zeros((64, 64), dtype=np.int64))
    (root / "pickled.pt").write_bytes(pickle.dumps(_Payload(str(root / "PWNED"))))
    corpus = write_corpus(root, n_docs=120)
    recipes = root / "recipes"
    recipes.mkdir()

    def recipe(name, **sections):
        d = tiny_recipe(root, corpus, name=name, **sections)
        path = recipes / f"{name}.yaml"
        path.write_text(yaml.safe_dump(d))
        return str(path)

    (recipes / "malformed.yaml").write_text("model:\n  design: pre_ln\n hidden_size: [32\n")
    (recipes / "list.yaml").write_text("- model\n- data\n")
    (recipes / "scalar.yaml").write_text("just a string\n")
    (recipes / "binary.yaml").write_bytes(rng.bytes(256))
    paths = {
        "root": root, "model": str(model_dir), "truncated": str(truncated), "no_config": str(root / "no_config"),
        "good": recipe("good"),
        "fields_typo": recipe("fields_typo", model={"design": "hc", "fields": {"hc_stream": 2}}),
        "fields_shape": recipe("fields_shape", model={"fields": {"hidden_size": 64}}),
        "block_too_big": recipe("block_too_big", model={"design": "block_attnres", "fields": {"attnres_block_size": 99}}),
        "moda_flash": recipe("moda_flash", model={"design": "moda", "fields": {"attn_implementation": "flash_attention_2"}}),
        "empty_json": recipe("empty_json", data={"data_files": [str(root / "empty.jsonl")]}),
        "notext_json": recipe("notext_json", data={"data_files": [str(root / "notext.jsonl")]}),
        "missing_json": recipe("missing_json", data={"data_files": [str(root / "nope.jsonl")]}),
    }
    for name in ("empty.bin", "odd.bin", "short.bin", "random.npy", "floats.npy", "matrix.npy", "missing.bin"):
        paths[f"memmap:{name}"] = recipe(f"mm_{name.replace('.', '_')}", data={
            "source": "memmap", "path": None, "data_files": [str(root / name)]})
    return paths


class _Payload:
    """A pickle that would create a file when loaded without ``weights_only``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


@dataclass
class CliCase:
    id: str
    argv: list  # "{name}" entries are replaced by env paths, "@x" by root / x
    needle: str
    code: int = 2
    forbidden: list = field(default_factory=list)  # paths (same substitution) that must not exist afterwards


def R(name):  # a run folder of the env's recipes (tiny_recipe: ROOT/runs/NAME)
    return f"@runs/{name}/"


def _nothing_trained(name):
    return [R(name) + "checkpoints", R(name) + "final", R(name) + "summary.json"]


CLI_CASES = [
    # recipes and overrides: refused before a run folder exists
    CliCase("yaml-malformed", ["train", "@recipes/malformed.yaml"], "malformed.yaml", forbidden=[R("malformed")]),
    CliCase("yaml-top-level-list", ["train", "@recipes/list.yaml"], "mapping", forbidden=[R("list")]),
    CliCase("yaml-scalar", ["train", "@recipes/scalar.yaml"], "mapping", forbidden=[R("scalar")]),
    CliCase("yaml-binary", ["train", "@recipes/binary.yaml"], "binary.yaml", forbidden=[R("binary")]),
    CliCase("recipe-missing", ["train", "@recipes/nope.yaml"], "nope.yaml"),
    CliCase("recipe-is-folder", ["train", "@recipes"], "recipes"),
    CliCase("lr-nan", ["train", "{good}", "optim.lr=.nan"], "optim.lr", forbidden=[R("good")]),
    CliCase("lr-inf", ["train", "{good}", "optim.lr=.inf"], "optim.lr", forbidden=[R("good")]),
    CliCase("lr-neg-inf", ["train", "{good}", "optim.lr=-.inf"], "optim.lr", forbidden=[R("good")]),
    CliCase("lr-zero", ["train", "{good}", "optim.lr=0"], "optim.lr", forbidden=[R("good")]),
    CliCase("lr-negative", ["train", "{good}", "optim.lr=-1e-3"], "optim.lr", forbidden=[R("good")]),
    CliCase("lr-string", ["train", "{good}", "optim.lr=fast"], "optim.lr", forbidden=[R("good")]),
    CliCase("wd-nan", ["train", "{good}", "optim.weight_decay=.nan"], "optim.weight_decay", forbidden=[R("good")]),
    CliCase("beta-nan", ["train", "{good}", "optim.beta2=.nan"], "optim.beta2", forbidden=[R("good")]),
    CliCase("clip-inf", ["train", "{good}", "optim.grad_clip=.inf"], "optim.grad_clip", forbidden=[R("good")]),
    CliCase("tpp-inf", ["train", "{good}", "train.tokens_per_param=.inf"], "train.tokens_per_param"),
    CliCase("override-bad-yaml", ["train", "{good}", "optim.lr=[1e-3"], "optim.lr=[1e-3"),
    CliCase("override-empty-key", ["train", "{good}", "=3"], "section.key=value"),
    CliCase("override-typo", ["train", "{good}", "model.hiden_size=64"], "hidden_size"),
    CliCase("seed-negative", ["train", "{good}", "data.shuffle_seed=-1"], "data.shuffle_seed", forbidden=[R("good")]),
    CliCase("val-sequences-zero", ["train", "{good}", "data.val_sequences=0"], "data.val_sequences"),
    CliCase("override-bool-int", ["train", "{good}", "train.max_steps=true"], "train.max_steps"),
    CliCase("fields-typo", ["train", "{fields_typo}"], "did you mean `hc_streams`", forbidden=[R("fields_typo")]),
    CliCase("fields-shape", ["train", "{fields_shape}"], "model.fields.hidden_size"),
    CliCase("fields-block-size", ["train", "{block_too_big}"], "attnres_block_size"),
    CliCase("fields-moda-flash", ["train", "{moda_flash}"], "not supported by design 'moda'"),
    # training data: refused before any step, nothing trained
    CliCase("json-empty", ["train", "{empty_json}"], "empty.jsonl", forbidden=_nothing_trained("empty_json")),
    CliCase("json-no-text", ["train", "{notext_json}"], "data.text_field", forbidden=_nothing_trained("notext_json")),
    CliCase("json-missing", ["train", "{missing_json}"], "nope.jsonl", forbidden=_nothing_trained("missing_json")),
    CliCase("memmap-empty", ["train", "{memmap:empty.bin}"], "empty.bin", forbidden=_nothing_trained("mm_empty_bin")),
    CliCase("memmap-odd-size", ["train", "{memmap:odd.bin}"], "odd.bin", forbidden=_nothing_trained("mm_odd_bin")),
    CliCase("memmap-too-short", ["train", "{memmap:short.bin}"], "seq_len", forbidden=_nothing_trained("mm_short_bin")),
    CliCase("memmap-random-npy", ["train", "{memmap:random.npy}"], "random.npy",
            forbidden=_nothing_trained("mm_random_npy")),
    CliCase("memmap-float-npy", ["train", "{memmap:floats.npy}"], "floats.npy",
            forbidden=_nothing_trained("mm_floats_npy")),
    CliCase("memmap-2d-npy", ["train", "{memmap:matrix.npy}"], "matrix.npy", forbidden=_nothing_trained("mm_matrix_npy")),
    CliCase("memmap-missing", ["train", "{memmap:missing.bin}"], "missing.bin",
            forbidden=_nothing_trained("mm_missing_bin")),
    # val-loss
    CliCase("val-loss-empty-data", ["val-loss", "{model}", "--data", "@empty.jsonl", "--output", "@vl1.json"],
            "empty.jsonl", forbidden=["@vl1.json"]),
    CliCase("val-loss-blank-data", ["val-loss", "{model}", "--data", "@blank.jsonl", "--output", "@vl2.json"],
            "blank.jsonl", forbidden=["@vl2.json"]),
    CliCase("val-loss-torn-jsonl", ["val-loss", "{model}", "--data", "@broken.jsonl", "--output", "@vl3.json"],
            "broken.jsonl", forbidden=["@vl3.json"]),
    CliCase("val-loss-no-text-field", ["val-loss", "{model}", "--data", "@notext.jsonl", "--output", "@vl4.json"],
            "--text-field", forbidden=["@vl4.json"]),
    CliCase("val-loss-csv", ["val-loss", "{model}", "--data", "@data.csv", "--output", "@vl5.json"], "data.csv",
            forbidden=["@vl5.json"]),
    CliCase("val-loss-missing-data", ["val-loss", "{model}", "--data", "@nope.txt", "--output", "@vl6.json"],
            "nope.txt", forbidden=["@vl6.json"]),
    CliCase("val-loss-no-config", ["val-loss", "{no_config}", "--data", "@good.txt", "--output", "@vl7.json"],
            "no_config", forbidden=["@vl7.json"]),
    CliCase("val-loss-truncated", ["val-loss", "{truncated}", "--data", "@good.txt", "--output", "@vl8.json"],
            "truncated", forbidden=["@vl8.json"]),
    CliCase("val-loss-missing-model", ["val-loss", "@nope_model/", "--data", "@good.txt", "--output", "@vl9.json"],
            "nope_model", forbidden=["@vl9.json"]),
    # diagnose
    CliCase("diagnose-no-config", ["diagnose", "{no_config}", "--data", "@good.txt", "--out", "@d1"], "no_config",
            forbidden=["@d1/report.json"]),
    CliCase("diagnose-truncated", ["diagnose", "{truncated}", "--data", "@good.txt", "--out", "@d2"], "truncated",
            forbidden=["@d2/report.json"]),
    CliCase("diagnose-missing-data", ["diagnose", "{model}", "--data", "@nope.jsonl", "--out", "@d3"], "nope.jsonl",
            forbidden=["@d3/report.json"]),
    CliCase("diagnose-random-pt", ["diagnose", "{model}", "--data", "@random.pt", "--out", "@d4"], "random.pt",
            forbidden=["@d4/report.json"]),
    CliCase("diagnose-pickle-pt", ["diagnose", "{model}", "--data", "@pickled.pt", "--out", "@d5"], "pickled.pt",
            forbidden=["@d5/report.json", "@PWNED"]),
    CliCase("diagnose-empty-jsonl", ["diagnose", "{model}", "--data", "@empty.jsonl", "--out", "@d6"], "empty.jsonl",
            forbidden=["@d6/report.json"]),
    CliCase("diagnose-torn-jsonl", ["diagnose", "{model}", "--data", "@broken.jsonl", "--out", "@d7"], "broken.jsonl",
            forbidden=["@d7/report.json"]),
    CliCase("diagnose-csv", ["diagnose", "{model}", "--data", "@data.csv", "--out", "@d8"], "data.csv",
            forbidden=["@d8/report.json"]),
    CliCase("diagnose-num-samples-0", ["diagnose", "{model}", "--data", "@good.txt", "--out", "@d9", "--num-samples",
                                       "0"], "num_samples", forbidden=["@d9/report.json"]),
    CliCase("diagnose-no-text-field", ["diagnose", "{model}", "--data", "@notext.jsonl", "--out", "@d10"], "notext",
            forbidden=["@d10/report.json"]),
    # convert-olmo-core
    CliCase("convert-random-pt", ["convert-olmo-core", "@random.pt", "@c1", "--design", "pre_ln"], "random.pt",
            forbidden=["@c1/config.json"]),
    CliCase("convert-empty-pt", ["convert-olmo-core", "@empty.pt", "@c2", "--design", "pre_ln"], "empty.pt",
            forbidden=["@c2/config.json"]),
    CliCase("convert-pickle-pt", ["convert-olmo-core", "@pickled.pt", "@c3", "--design", "pre_ln"], "pickled.pt",
            forbidden=["@c3/config.json", "@PWNED"]),
    CliCase("convert-missing", ["convert-olmo-core", "@nope.pt", "@c4", "--design", "pre_ln"], "nope.pt",
            forbidden=["@c4/config.json"]),
    CliCase("convert-truncated-st", ["convert-olmo-core", "{truncated}", "@c5", "--design", "pre_ln"], "truncated",
            forbidden=["@c5/config.json"]),
    # export / results
    CliCase("export-not-a-run", ["export", "{no_config}"], "no_config"),
    CliCase("results-empty", ["results", "@recipes"], "summary.json"),
]


def _sub(env, text: str) -> str:
    if text.startswith("@"):
        return str(env["root"] / text[1:])
    return env[text[1:-1]] if text.startswith("{") and text.endswith("}") else text


def check_cli(env, case: CliCase, capsys, monkeypatch):
    monkeypatch.delenv("HF_DEPTH_DEBUG", raising=False)
    argv = [_sub(env, a) for a in case.argv]
    capsys.readouterr()
    code = cli.main(argv)
    out, err = capsys.readouterr()
    ours = [line for line in err.splitlines() if line.startswith(f"hf-depth {case.argv[0]}:")]
    assert code == case.code, (code, err[-2000:])
    assert len(ours) == 1, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert _sub(env, case.needle) in ours[0] or case.needle in ours[0], ours[0]
    assert "internal error" not in ours[0], ours[0]
    for f in case.forbidden:
        assert not Path(_sub(env, f)).exists(), f"{f} was written after a failure"
    assert "val loss" not in out and '"headline"' not in out and "exported" not in out


@pytest.mark.parametrize("case", CLI_CASES, ids=lambda c: c.id)
def test_bad_cli_input_gives_one_line_and_exit_2(env, case, capsys, monkeypatch):
    check_cli(env, case, capsys, monkeypatch)


def test_table_is_large_enough():
    assert len(CONFIG_CASES) + len(CLI_CASES) >= 60


# ---------------------------------------------------------------------------------------------- real processes
def _hf_depth(*args, env_extra=None, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(Path(hf_depth.__file__).parents[1]), "OMP_NUM_THREADS": "1",
           **(env_extra or {})}
    env.pop("HF_DEPTH_DEBUG", None) if not env_extra or "HF_DEPTH_DEBUG" not in env_extra else None
    return subprocess.run([sys.executable, "-m", "hf_depth.cli", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def test_real_exit_status_and_debug_traceback(env, capsys, monkeypatch):
    bad = str(env["root"] / "recipes" / "malformed.yaml")
    p = _hf_depth("train", bad)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("hf-depth train: bad recipe: recipe file")
    # HF_DEPTH_DEBUG shows the traceback; a pickle payload never runs, even with torch's weights_only switched off
    p = _hf_depth("diagnose", env["model"], "--data", str(env["root"] / "pickled.pt"), "--out",
                  str(env["root"] / "d_sub"), env_extra={"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1", "HF_DEPTH_DEBUG": "1"})
    assert p.returncode == 2 and "Traceback" in p.stderr and "pickled.pt" in p.stderr
    assert not (env["root"] / "PWNED").exists() and not (env["root"] / "d_sub" / "report.json").exists()
    # --debug anywhere on the command line, in-process
    monkeypatch.delenv("HF_DEPTH_DEBUG", raising=False)
    capsys.readouterr()
    assert cli.main(["train", bad, "--debug"]) == 2
    assert "Traceback" in capsys.readouterr().err
    assert cli.main(["--debug", "val-loss", env["no_config"], "--data", str(env["root"] / "good.txt")]) == 2
    assert "Traceback" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- runs
@pytest.fixture
def corpus(tmp_path):
    return write_corpus(tmp_path)


def _recipe_file(tmp_path, corpus, name="r", **sections):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe(tmp_path, corpus, name=name, **sections)))
    return str(path)


def _weights_finite(ckpt: Path) -> bool:
    from safetensors.torch import load_file

    return all(torch.isfinite(t).all() for t in load_file(ckpt / "model.safetensors").values())


def test_divergence_never_saves_non_finite_weights_and_resume_with_lower_lr_works(tmp_path, corpus, capsys):
    recipe = _recipe_file(tmp_path, corpus, train={"max_steps": 12, "save_every": 4, "eval_every": 100})
    run_dir = tmp_path / "runs" / "r"
    # 4 good steps, then the learning rate explodes: every later checkpoint would hold garbage
    from hf_depth.training.recipe import load_recipe

    assert train_mod.run(load_recipe(recipe), stop_after=4)["status"] == "interrupted"
    capsys.readouterr()
    code = train_mod.main([recipe, "--resume", "optim.lr=1e30", "train.save_every=1"])
    err = capsys.readouterr().err
    assert code == 1, err
    line = [x for x in err.splitlines() if x.startswith("hf-depth train:")][-1]
    assert "step_00000004" in line, line
    ckpts = train_mod.checkpoints(run_dir)
    assert [c.name for c in ckpts] == ["step_00000004"] and _weights_finite(ckpts[-1])
    assert not (run_dir / "final").exists()
    # the named checkpoint resumes and finishes with a sane learning rate
    assert train_mod.main([recipe, "--resume", "optim.lr=1e-3"]) == 0
    rows = train_mod.read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 13)) and all(math.isfinite(r["loss"]) for r in rows)
    assert _weights_finite(train_mod.checkpoints(run_dir)[-1])


def test_resume_drops_a_torn_metrics_line_and_rng_errors_are_refused(tmp_path, corpus, capsys):
    from hf_depth.training.recipe import load_recipe

    recipe = _recipe_file(tmp_path, corpus, train={"max_steps": 8, "save_every": 4, "eval_every": 100})
    run_dir = tmp_path / "runs" / "r"
    assert train_mod.run(load_recipe(recipe), stop_after=6)["status"] == "interrupted"
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "tokens": 8')  # killed mid-write
    rng = run_dir / "checkpoints" / "step_00000004" / "random_states_0.pkl"
    good_rng = rng.read_bytes()
    rng.write_bytes(b"not a pickle")
    capsys.readouterr()
    assert train_mod.main([recipe, "--resume"]) == 2
    line = [x for x in capsys.readouterr().err.splitlines() if x.startswith("hf-depth train:")]
    assert len(line) == 1 and "random_states_0.pkl" in line[0] and "--resume-ignore-rng" in line[0]
    assert not (run_dir / "final").exists()
    rng.write_bytes(good_rng)
    with pytest.warns(UserWarning, match="torn"):
        assert train_mod.main([recipe, "--resume"]) == 0
    rows = train_mod.read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 9))


def test_resume_ignore_rng_continues(tmp_path, corpus):
    from hf_depth.training.recipe import load_recipe

    recipe = _recipe_file(tmp_path, corpus, train={"max_steps": 8, "save_every": 4, "eval_every": 100})
    run_dir = tmp_path / "runs" / "r"
    assert train_mod.run(load_recipe(recipe), stop_after=4)["status"] == "interrupted"
    (run_dir / "checkpoints" / "step_00000004" / "random_states_0.pkl").write_bytes(pickle.dumps(_Payload(
        str(tmp_path / "PWNED"))))
    with pytest.warns(UserWarning, match="RNG state not restored"):
        assert train_mod.main([recipe, "--resume", "--resume-ignore-rng"]) == 0
    assert not (tmp_path / "PWNED").exists()  # weights_only: the payload never ran


def test_run_folder_is_owned_by_one_process(tmp_path, corpus, capsys):
    recipe = _recipe_file(tmp_path, corpus)
    run_dir = tmp_path / "runs" / "r"
    with train_mod.run_folder_lock(run_dir):  # another run holds the folder
        for extra in ([], ["--resume"]):
            capsys.readouterr()
            assert train_mod.main([recipe, *extra]) == 2
            line = [x for x in capsys.readouterr().err.splitlines() if x.startswith("hf-depth train:")]
            assert len(line) == 1 and f"in use by process {os.getpid()}" in line[0]
        assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists()
    # a live holder in another process
    holder = subprocess.Popen([sys.executable, "-c", (  # the same OS lock, taken by a plain process
        "import fcntl, os, sys, time\nfd = os.open(sys.argv[1], os.O_RDWR)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
        "os.pwrite(fd, str(os.getpid()).encode(), 0)\nprint('held', flush=True)\ntime.sleep(60)"),
        str(run_dir / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        capsys.readouterr()
        assert train_mod.main([recipe]) == 2
        assert f"in use by process {holder.pid}" in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()
    assert train_mod.main([recipe, "train.max_steps=2", "train.save_every=2"]) == 0  # the lock died with it


def test_non_finite_gradient_stops_before_the_update(tmp_path, corpus, monkeypatch):
    from hf_depth.training.recipe import recipe_from_dict

    calls = {"n": 0}
    real = train_mod.lm_loss

    def nan_grad(model, x):  # a finite loss whose gradient is NaN: 0 * d sqrt(z)/dz at z = 0
        calls["n"] += 1
        loss = real(model, x)
        return loss + 0.0 * torch.sqrt(loss - loss.detach()) if calls["n"] == 3 else loss

    monkeypatch.setattr(train_mod, "lm_loss", nan_grad)
    r = recipe_from_dict(tiny_recipe(tmp_path, corpus, name="g", train={"save_every": 1, "eval_every": 100}))
    summary = train_mod.run(r)
    assert summary["status"] == "diverged" and "non-finite gradient norm" in summary["message"], summary["message"]
    assert summary["steps"] == 2 and "step_00000002" in summary["message"]
    assert _weights_finite(train_mod.checkpoints(r.resolved_run_dir)[-1])


def _truncate(path: Path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


CHECKPOINT_CASES = [  # (id, corruption of checkpoints/step_00000004, needle of the one line)
    ("trainer-state-garbage", lambda c: (c / "trainer_state.json").write_text("{not json"), "step_00000004"),
    ("trainer-state-no-step", lambda c: (c / "trainer_state.json").write_text("{}"), "step_00000004"),
    ("data-state-missing", lambda c: (c / "data_state_0.json").unlink(), "step_00000004"),
    ("model-truncated", lambda c: _truncate(c / "model.safetensors"), "step_00000004"),
    ("optimizer-random", lambda c: (c / "optimizer.bin").write_bytes(os.urandom(256)), "step_00000004"),
    ("rng-garbage", lambda c: (c / "random_states_0.pkl").write_bytes(b"\x80\x04garbage"), "random_states_0.pkl"),
    ("rng-missing", lambda c: (c / "random_states_0.pkl").unlink(), "random_states_0.pkl"),
]


@pytest.mark.parametrize("corrupt, needle", [c[1:] for c in CHECKPOINT_CASES], ids=[c[0] for c in CHECKPOINT_CASES])
def test_bad_checkpoint_on_resume_gives_one_line_and_exit_2(tmp_path, corpus, capsys, corrupt, needle):
    from hf_depth.training.recipe import load_recipe

    recipe = _recipe_file(tmp_path, corpus, train={"max_steps": 8, "save_every": 4, "eval_every": 100})
    run_dir = tmp_path / "runs" / "r"
    assert train_mod.run(load_recipe(recipe), stop_after=4)["status"] == "interrupted"
    corrupt(run_dir / "checkpoints" / "step_00000004")
    capsys.readouterr()
    assert train_mod.main([recipe, "--resume"]) == 2
    err = capsys.readouterr().err
    ours = [x for x in err.splitlines() if x.startswith("hf-depth train:")]
    assert len(ours) == 1 and needle in ours[0] and "Traceback" not in err and "internal error" not in ours[0], err
    assert not (run_dir / "final").exists() and not (run_dir / "summary.json").exists()
    assert [c.name for c in train_mod.checkpoints(run_dir)] == ["step_00000004"]
