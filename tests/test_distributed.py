"""Real multi-process training on CPU (gloo): DDP and FSDP2 train the same model as one process, the data shards are
disjoint, sharded checkpoints resume bit-exactly and across world sizes, a NaN on one rank stops all of them.

Two launches of tests/dist_driver.py with ``accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml``
(the recipe the README shows) run every world-size-2 job; the world-size-1 references run in this process.
Data: a ``memmap`` token file, whose global order of sequences does not depend on the world size, so world size 2
with micro-batch b sees, at every step, exactly the sequences that world size 1 sees with micro-batch 2b.
"""

import copy
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from training_helpers import hf_depth_cache, write_corpus  # noqa: F401

from hf_depth.training.data import Documents, _digest
from hf_depth.training.launch import plan_launch
from hf_depth.training.recipe import recipe_from_dict
from hf_depth.training.train import run

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_recipe(root: Path, tokens: Path, name: str, **train) -> dict:
    return {
        "name": name, "run_dir": str(root / "runs" / "{name}"),
        "model": {"design": "pre_ln", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "max_position_embeddings": 32},
        "data": {"source": "memmap", "data_files": [str(tokens)], "tokenizer": "embedded",
                 "tokenizer_vocab_size": 300, "seq_len": 32, "val_sequences": 8},
        "optim": {"lr": 5e-3},
        "train": {"max_steps": STEPS, "micro_batch_size": 4, "eval_every": 3, "save_every": 3, "log_every": 1,
                  "progress": False, **train},
    }


def with_(recipe: dict, name: str, model: dict | None = None, **train) -> dict:
    r = copy.deepcopy(recipe)
    r["name"] = name
    r["train"].update(train)
    r["model"].update(model or {})
    return r


def launch(spec: list[dict], folder: Path, name: str) -> None:
    path = folder / f"{name}.json"
    path.write_text(json.dumps(spec))
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "recipes/accelerate/cpu_2proc.yaml"), "--main_process_port", str(free_port()),
           str(ROOT / "tests/dist_driver.py"), str(path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1500, cwd=folder)
    assert proc.returncode == 0, f"launch {name} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)), f"{run_dir}: duplicated metric rows {steps} (more than one writer?)"
    return {r["step"]: r["loss"] for r in rows}


def summaries(out: Path) -> list[dict]:
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in (0, 1)]


def dcp_weights(step_dir: Path, tmp: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{step_dir.parent.parent.name}_{step_dir.name}.pt"
    dcp_to_torch_save(step_dir / "model_and_optim", out)
    return torch.load(out, weights_only=True)["model"]


def assert_same(a: dict, b: dict, atol: float = 0.0):
    assert a.keys() == b.keys()
    for k in a:
        if atol == 0.0:
            assert torch.equal(a[k], b[k]), k
        else:
            torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=k)


def copy_run_at(src: Path, dst: Path, step: int) -> Path:
    """A run folder holding only ``src``'s checkpoint at ``step`` (a run that stopped there)."""
    shutil.copytree(src, dst)
    for p in (dst / "checkpoints").iterdir():
        if p.name != f"step_{step:08d}":
            shutil.rmtree(p)
    shutil.rmtree(dst / "final", ignore_errors=True)
    (dst / "summary.json").unlink(missing_ok=True)
    return dst


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of this module: world size 2 (two launches) and world size 1 (in process)."""
    root = tmp_path_factory.mktemp("dist")
    os.environ["HF_DEPTH_CACHE"] = str(tmp_path_factory.getbasetemp() / "hf_depth_cache")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tokens = root / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 300, size=32 * 200, dtype=np.uint16))
    base = base_recipe(root, tokens, "ref")
    docs_recipe = copy.deepcopy(base)
    docs_recipe["data"] = {"source": "hf", "path": "json", "data_files": write_corpus(root, n_docs=120),
                           "tokenizer": "embedded", "tokenizer_vocab_size": 300, "seq_len": 32, "val_docs": 10}
    R = {"root": root, "base": base, "docs_recipe": docs_recipe}
    runs_dir = root / "runs"

    # world size 1 references (micro-batch 4 = 2 x 2), in this process
    run(recipe_from_dict(base))
    run(recipe_from_dict(with_(base, "ref_ga2", micro_batch_size=2, grad_accum=2)))
    run(recipe_from_dict(with_(base, "ref_attnres", model={"design": "attnres"})))
    run(recipe_from_dict(with_(base, "w1_fsdp", parallel="fsdp2")), stop_after=3)  # for world 1 -> 2

    # world size 2, launch A
    half = {"micro_batch_size": 2}
    spec = [
        {"kind": "train", "recipe": with_(base, "ddp", **half), "out": str(root / "ddp")},
        {"kind": "fsdp_parity", "out": str(root / "fsdp_parity")},
        {"kind": "docs", "recipe": docs_recipe, "out": str(root / "docs")},
        {"kind": "train", "recipe": with_(base, "fsdp", parallel="fsdp2", **half), "out": str(root / "fsdp")},
        {"kind": "train", "recipe": with_(base, "fsdp_cut", parallel="fsdp2", **half), "stop_after": 3,
         "out": str(root / "fsdp_cut_a")},
        {"kind": "train", "recipe": with_(base, "fsdp_cut", parallel="fsdp2", **half), "resume": True,
         "out": str(root / "fsdp_cut_b")},
        {"kind": "train", "recipe": with_(base, "nan", save_every=1, **half), "nan_rank": 1, "nan_step": 3,
         "out": str(root / "nan")},
        {"kind": "train", "recipe": with_(base, "compile", compile=True, **half), "out": str(root / "compile")},
        {"kind": "train", "recipe": with_(base, "compile_attnres", model={"design": "attnres"}, compile=True, **half),
         "out": str(root / "compile_attnres")},
    ]
    launch(spec, root, "launch_a")

    # world size 2 -> 1: the sharded step-3 checkpoint of launch A, loaded (max_steps 3: load, export) and continued
    w1_load = copy_run_at(runs_dir / "fsdp", runs_dir / "w2_to_w1_load", 3)
    run(recipe_from_dict(with_(base, "w2_to_w1_load", parallel="fsdp2", max_steps=3)), resume=True)
    copy_run_at(runs_dir / "fsdp", runs_dir / "w2_to_w1", 3)
    run(recipe_from_dict(with_(base, "w2_to_w1", parallel="fsdp2")), resume=True)
    R["w1_load"] = w1_load

    # world size 1 -> 2, launch B
    copy_run_at(runs_dir / "w1_fsdp", runs_dir / "w1_to_w2_load", 3)
    copy_run_at(runs_dir / "w1_fsdp", runs_dir / "w1_to_w2", 3)
    launch([
        {"kind": "train", "recipe": with_(base, "w1_to_w2_load", parallel="fsdp2", max_steps=3, **half),
         "resume": True, "out": str(root / "w1_to_w2_load")},
        {"kind": "train", "recipe": with_(base, "w1_to_w2", parallel="fsdp2", **half), "resume": True,
         "out": str(root / "w1_to_w2")},
    ], root, "launch_b")
    torch.set_num_threads(threads)
    return R


def test_ddp_world2_equals_world1(runs):
    """World size 2 x micro-batch 2 == world size 1 x micro-batch 4 == world size 1 x micro-batch 2 x accum 2."""
    r = runs["root"] / "runs"
    ref = losses(r / "ref")
    assert len(ref) == STEPS
    for other in ("ref_ga2", "ddp", "fsdp"):
        got = losses(r / other)
        assert got.keys() == ref.keys(), other
        diffs = [abs(got[s] - ref[s]) for s in ref]
        print(f"[dist] {other} vs ref: max |d loss| per step = {max(diffs):.2e}")
        assert max(diffs) <= 1e-5, (other, diffs)


def test_only_rank0_writes(runs):
    r = runs["root"] / "runs" / "ddp"
    assert (r / "final" / "model.safetensors").exists() and (r / "summary.json").exists()
    assert len((r / "metrics.jsonl").read_text().splitlines()) == STEPS  # one writer: no doubled rows
    ckpt = r / "checkpoints" / f"step_{STEPS:08d}"
    assert sorted(p.name for p in ckpt.glob("data_state_*.json")) == ["data_state_0.json", "data_state_1.json"]
    # the exported model is the trained one: the same weights as the world size 1 reference within fp32 noise
    assert_same(load_file(r / "final" / "model.safetensors"),
                load_file(runs["root"] / "runs" / "ref" / "final" / "model.safetensors"), atol=1e-5)


def test_ranks_read_disjoint_documents_that_make_the_single_stream(runs):
    got = summaries(runs["root"] / "docs")
    assert [g["world"] for g in got] == [2, 2]
    a, b = got[0]["digests"], got[1]["digests"]
    assert a and b and not set(a) & set(b)
    single = recipe_from_dict(runs["docs_recipe"])
    stream = [_digest(t).hex() for t in Documents(single.data, "train").iterate()]
    assert sorted(a + b) == sorted(stream)  # together: the single-process stream, each document once
    assert len(stream) == 120 - 10  # all documents but the held-out validation ones


def test_fsdp2_shards_every_design(runs):
    """FSDP2 (``fully_shard`` per decoder layer, then the root) on every registered design, on CPU over gloo: the
    loss and every gradient equal the unsharded model's on the same batch (fp32)."""
    import hf_depth

    for got in summaries(runs["root"] / "fsdp_parity"):
        assert set(got["designs"]) == set(hf_depth.DESIGNS)
        for design, r in got["designs"].items():
            assert "error" not in r, (design, r)
            assert r["sharded"].startswith("FSDP"), (design, r)
            print(f"[dist] fsdp2 {design}: max |diff| loss/grad = {r['max_diff']:.1e}")
            assert r["max_diff"] <= 1e-5, (design, r)


def test_fsdp2_resume_is_bit_exact(runs):
    r = runs["root"] / "runs"
    assert summaries(runs["root"] / "fsdp_cut_a")[0]["summary"]["status"] == "interrupted"
    assert summaries(runs["root"] / "fsdp_cut_b")[0]["summary"]["status"] == "finished"
    assert losses(r / "fsdp_cut") == losses(r / "fsdp")
    assert_same(load_file(r / "fsdp_cut" / "final" / "model.safetensors"),
                load_file(r / "fsdp" / "final" / "model.safetensors"))
    ckpt = r / "fsdp" / "checkpoints" / f"step_{STEPS:08d}"
    assert (ckpt / "model_and_optim" / ".metadata").exists()  # a sharded DCP checkpoint, not a full state file
    assert not (ckpt / "model.safetensors").exists()
    # the export is a normal save_pretrained folder
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(r / "fsdp" / "final")
    assert type(m).__name__ == "PreLNForCausalLM"


def test_fsdp2_checkpoint_resumes_across_world_sizes(runs, tmp_path):
    r = runs["root"] / "runs"
    # 2 -> 1: the weights loaded at world size 1 are the ones world size 2 saved
    saved = dcp_weights(r / "fsdp" / "checkpoints" / "step_00000003", tmp_path)
    loaded = load_file(runs["w1_load"] / "final" / "model.safetensors")
    assert_same({k: loaded[k] for k in saved}, saved)
    # ... and the continued run follows the world size 2 curve
    got, ref = losses(r / "w2_to_w1"), losses(r / "fsdp")
    assert max(abs(got[s] - ref[s]) for s in ref) <= 1e-5
    # 1 -> 2
    saved = dcp_weights(r / "w1_fsdp" / "checkpoints" / "step_00000003", tmp_path)
    loaded = load_file(r / "w1_to_w2_load" / "final" / "model.safetensors")
    assert_same({k: loaded[k] for k in saved}, saved)
    got, ref = losses(r / "w1_to_w2"), losses(r / "ref")
    assert max(abs(got[s] - ref[s]) for s in ref) <= 1e-5


def test_nan_on_one_rank_stops_every_rank_with_one_message(runs):
    got = summaries(runs["root"] / "nan")
    assert [g["summary"]["status"] for g in got] == ["diverged", "diverged"]
    messages = {g["summary"]["message"] for g in got}
    assert len(messages) == 1, messages
    (message,) = messages
    assert "step 3 on rank(s) [1]" in message and "step_00000002" in message
    assert got[0]["summary"]["steps"] == 2


@pytest.mark.parametrize("name, ref", [("compile", "ref"), ("compile_attnres", "ref_attnres")])
def test_compiled_ddp_matches_eager(runs, name, ref):
    """``train.compile=true`` under DDP (inductor on CPU) follows the eager world size 1 curve."""
    r = runs["root"] / "runs"
    got, want = losses(r / name), losses(r / ref)
    assert got.keys() == want.keys()
    assert max(abs(got[s] - want[s]) for s in want) <= 1e-4


def test_multinode_launch_commands():
    """2 nodes x 8 GPUs rendered from the multinode recipe: same command on every node but the machine rank."""
    plan = plan_launch(str(ROOT / "recipes/train/depthbench_400m/pre_ln_L24.yaml"),
                       str(ROOT / "recipes/accelerate/multinode.yaml"), nodes=2, gpus_per_node=8,
                       main_ip="10.0.0.1", global_batch=512)
    assert plan.grad_accum == 2 and plan.global_batch == 512 and plan.tokens_per_step == 512 * 2048
    assert len(plan.accelerate) == len(plan.torchrun) == 2
    for rank, (acc, tr) in enumerate(zip(plan.accelerate, plan.torchrun)):
        assert f"--machine_rank {rank}" in acc and "--num_processes 16" in acc and "--num_machines 2" in acc
        assert "--main_process_ip 10.0.0.1 --main_process_port 29500" in acc
        assert f"--node-rank {rank}" in tr and "--nproc-per-node 8" in tr and "--rdzv-endpoint 10.0.0.1:29500" in tr
        assert acc.endswith("-m hf_depth.training.train " + str(ROOT / "recipes/train/depthbench_400m/pre_ln_L24.yaml")
                            + " train.grad_accum=2")
    assert plan.accelerate[0].replace("--machine_rank 0", "") == plan.accelerate[1].replace("--machine_rank 1", "")
    with pytest.raises(ValueError, match="not a multiple"):
        plan_launch(str(ROOT / "recipes/train/depthbench_400m/pre_ln_L24.yaml"),
                    str(ROOT / "recipes/accelerate/multinode.yaml"), nodes=2, gpus_per_node=8, main_ip="10.0.0.1",
                    global_batch=500)
