"""Recipes, data streams and the training loop (CPU, tiny shapes)."""

import json
import random

import numpy as np
import pytest
import torch
from training_helpers import hf_depth_cache, tiny_recipe, write_corpus  # noqa: F401

from hf_depth.training import train as train_mod
from hf_depth.training.data import Documents, TokenStream, embedded_documents, load_tokenizer, pack
from hf_depth.training.recipe import DataRecipe, load_recipe, recipe_from_dict
from hf_depth.training.train import lr_at, run


@pytest.fixture
def corpus(tmp_path):
    return write_corpus(tmp_path)


# ---------------------------------------------------------------------------------------------- recipes
def test_shipped_tiny_recipe_loads_and_overrides_apply():
    r = load_recipe("recipes/train/tiny_cpu.yaml", ["model.hidden_size=64", "optim.lr=1e-3", "train.trackers=[]"])
    assert r.model.hidden_size == 64 and r.optim.lr == 1e-3 and isinstance(r.optim.lr, float)
    assert r.data.source == "embedded" and r.name == "tiny_cpu"


@pytest.mark.parametrize(
    "override, needles",
    [
        ("model.hiden_size=64", ["`model.hiden_size`", "hidden_size"]),
        ("optimizer.lr=1e-3", ["`optimizer`", "optim"]),
        ("optim.lr=fast", ["`optim.lr`", "number"]),
        ("data.source=s3", ["`data.source`", "'embedded'", "'hf'", "'memmap'"]),
        ("train.micro_batch_size=0", ["`train.micro_batch_size`", "positive"]),
        ("train.compile=maybe", ["`train.compile`", "true or false"]),
        ("optim.policy=lamb", ["`optim.policy`", "'depthbench'"]),
        ("model.design=resnet", ["`model.design`", "pre_ln"]),
        ("model.num_attention_heads=3", ["num_attention_heads"]),
        ("train.trackers=[mlflow]", ["`train.trackers`", "tensorboard"]),
        ("optim.warmup_frac=1.5", ["`optim.warmup_frac`", "[0, 1)"]),
        ("lr", ["section.key=value"]),
    ],
)
def test_bad_overrides_are_rejected_with_the_key_and_allowed_values(override, needles):
    with pytest.raises(ValueError) as e:
        load_recipe("recipes/train/tiny_cpu.yaml", [override])
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


def test_bad_recipe_file_and_cli_exit_code(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  design: pre_ln\n  depth: 12\n")
    with pytest.raises(ValueError, match=r"`model.depth`.*allowed keys"):
        load_recipe(bad)
    with pytest.raises(ValueError, match="does not exist"):
        load_recipe(tmp_path / "missing.yaml")
    assert train_mod.main([str(bad)]) == 2
    assert "`model.depth`" in capsys.readouterr().err
    with pytest.raises(ValueError, match="`data.path` is required"):
        recipe_from_dict({"data": {"source": "hf"}})


def test_schedule_warmup_cosine_floor():
    total, peak = 100, 1.0
    lrs = [lr_at(s, total, peak) for s in range(total)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)  # 10 warmup steps
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[-1] == pytest.approx(0.1, abs=2e-3) and min(lrs[10:]) >= 0.1 - 1e-12


# ---------------------------------------------------------------------------------------------- data
def test_pack_loses_and_duplicates_no_token():
    rng = random.Random(0)
    docs = [[rng.randrange(2, 50) for _ in range(rng.randrange(1, 40))] + [1] for _ in range(50)]
    stream = [t for d in docs for t in d]
    seqs, carry = [], []
    for seq, _, rest in pack(iter(docs), 16):
        assert len(seq) == 16
        seqs.append(seq)
        carry = rest
    assert [t for s in seqs for t in s] + carry == stream
    # resuming mid-stream from (documents consumed, carry) continues exactly
    out = list(pack(iter(docs), 16))
    k = 7
    _, consumed, carry_k = out[k]
    rest = [s for s, _, _ in pack(iter(docs[consumed:]), 16, carry_k)]
    assert rest == [s for s, _, _ in out[k + 1 :]]


def test_hf_shards_disjoint_and_validation_held_out(corpus):
    data = DataRecipe(source="hf", path="json", data_files=corpus, val_docs=30)
    shards = [list(Documents(data, "train", r, 2).iterate()) for r in range(2)]
    val = list(Documents(data, "val").iterate())
    whole = list(Documents(data, "train").iterate())
    assert len(val) == 30 and len(whole) == 240 - 30
    assert not set(shards[0]) & set(shards[1])
    assert sorted(shards[0] + shards[1]) == sorted(whole)
    assert not set(val) & set(whole)


def test_embedded_shards_disjoint():
    data = DataRecipe(source="embedded", val_docs=5)
    a = list(Documents(data, "train", 0, 2).iterate())[:20]
    b = list(Documents(data, "train", 1, 2).iterate())[:20]
    assert a and b and not set(a) & set(b)
    assert len(embedded_documents(0)) > 100


def test_stream_position_resumes_exactly(tmp_path):
    small = write_corpus(tmp_path, n_docs=40)
    data = DataRecipe(source="hf", path="json", data_files=small, tokenizer="embedded", tokenizer_vocab_size=300,
                      seq_len=32, val_docs=10)
    tok = load_tokenizer(data)
    s = TokenStream(data, tok, "train")
    for _ in range(5):
        s.next_batch(4)
    state = s.state_dict()
    expected = [s.next_batch(4) for _ in range(40)]  # 160 sequences: the stream wraps into a second epoch
    assert s.state["epoch"] >= 1
    r = TokenStream(data, tok, "train")
    r.load_state_dict(state)
    for want in expected:
        torch.testing.assert_close(r.next_batch(4), want, rtol=0, atol=0)
    # the EOS separates documents inside the packed sequences
    assert (torch.cat(expected) == tok.eos_token_id).any()


def test_memmap_stream(tmp_path):
    tokens = np.arange(10 * 16, dtype=np.uint16)
    np.save(tmp_path / "a.npy", tokens[:80])
    (tmp_path / "b.bin").write_bytes(tokens[80:].tobytes())
    data = DataRecipe(source="memmap", data_files=[str(tmp_path / "a.npy"), str(tmp_path / "b.bin")], seq_len=16,
                      val_sequences=2)
    val = TokenStream(data, None, "val").take(10)
    assert [v[0] for v in val] == [128, 144]
    shards = [TokenStream(data, None, "train", r, 2).next_batch(4) for r in range(2)]
    starts = sorted(int(x) for s in shards for x in s[:, 0])
    assert starts == list(range(0, 128, 16))  # 8 training sequences, each seen once across the two ranks
    for s in shards:
        assert (s[:, 1:] - s[:, :-1] == 1).all()


# ---------------------------------------------------------------------------------------------- the loop
def _metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_equals_uninterrupted_run_and_loss_goes_down(tmp_path, corpus):
    full = recipe_from_dict(tiny_recipe(tmp_path, corpus, name="full", train={"max_steps": 24}))
    summary = run(full)
    rows = _metrics(full.resolved_run_dir)
    losses = [r["loss"] for r in rows]
    assert summary["status"] == "finished" and len(losses) == 24
    assert np.mean(losses[-4:]) < np.mean(losses[:4]) - 0.5, losses
    assert summary["best_val_loss"] is not None and summary["best_val_loss"] < rows[5]["val_loss"] + 1e-9
    run_dir = full.resolved_run_dir
    assert (run_dir / "final" / "model.safetensors").exists() and (run_dir / "final" / "tokenizer.json").exists()
    meta = json.loads((run_dir / "run.json").read_text())
    assert {"version", "git_sha", "environment", "plan"} <= set(meta) and (run_dir / "recipe.yaml").exists()
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["step_00000020", "step_00000024"]  # keep_last=2, no temporary folder left

    part = recipe_from_dict(tiny_recipe(tmp_path, corpus, name="part", train={"max_steps": 24}))
    assert run(part, stop_after=10)["status"] == "interrupted"  # checkpoint at step 8, steps 9-10 are lost
    with pytest.raises(ValueError, match="--resume"):
        run(part)
    assert run(part, resume=True)["status"] == "finished"
    resumed = [r["loss"] for r in _metrics(part.resolved_run_dir)]
    assert resumed == losses  # step for step, bit for bit


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path, corpus, monkeypatch):
    calls = {"n": 0}
    real = train_mod.lm_loss

    def poisoned(model, x):
        calls["n"] += 1
        loss = real(model, x)
        return loss * float("nan") if calls["n"] == 7 else loss

    monkeypatch.setattr(train_mod, "lm_loss", poisoned)
    r = recipe_from_dict(tiny_recipe(tmp_path, corpus, name="nan", train={"eval_every": 100}))
    summary = run(r)
    assert summary["status"] == "diverged" and "non-finite loss" in summary["message"]
    assert "step_00000004" in summary["message"] and summary["steps"] == 6
    assert [p.name for p in (r.resolved_run_dir / "checkpoints").iterdir()] == ["step_00000004"]
    assert not (r.resolved_run_dir / "final").exists()


def test_generated_recipes_load_or_name_the_missing_design():
    import pathlib

    from hf_depth.models.registry import DESIGNS

    files = sorted(pathlib.Path("recipes/train").rglob("*.yaml"))
    assert len(files) > 150
    for f in files[::7]:  # a sample across every folder (each load builds the design's config)
        design = (yaml_load(f) or {}).get("model", {}).get("design", "pre_ln")
        if design in DESIGNS:
            r = load_recipe(f)
            assert r.model.design == design
        else:  # recipes are data: a design merged later is checked when the recipe is loaded
            with pytest.raises(ValueError, match=f"`model.design` must be one of .*got '{design}'"):
                load_recipe(f)


def yaml_load(path):
    import yaml

    return yaml.safe_load(path.read_text())
