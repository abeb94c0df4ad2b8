"""Every hfd_* task loads through lm-eval's TaskManager from eval/tasks and runs end to end (--limit) on a tiny
hf_depth model and a tiny LlamaForCausalLM, with datasets pointed at local files; plus `hf-depth eval` and the
plain `lm_eval --model hf ... --include_path eval/tasks` route."""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from eval_helpers import gpt2_tokenizer, make_data_dir, tiny_hf_depth, tiny_llama

from hf_depth.evaluation.tasks import BENCHES, GROUPS, continuation_tokens

ROOT = pathlib.Path(__file__).resolve().parents[1]
TASKS = ROOT / "eval" / "tasks"
SHARED = ROOT.parent / "shared" / "data" / "evals"
METRICS = {"nll": ["nll_per_token", "nll_per_char", "nll_per_byte", "bits_per_byte"], "mc": ["acc", "acc_norm"],
           "gen": {"gsm8k": ["exact_match"], "math500": ["math_verify"], "mbpp": ["pass@1"],
                   "humaneval": ["pass@1"], "sciq": ["acc_letter"], "gpqa": ["acc_letter"]}}


def task_names(benches):
    names = []
    for b in benches:
        names += [f"hfd_{b}_nll", f"hfd_{b}_gen"] + ([f"hfd_{b}_mc"] if b in ("sciq", "gpqa") else [])
    return names


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("evaldata")
    return d, make_data_dir(d, SHARED if SHARED.exists() else None)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    gpt2_tokenizer().save_pretrained(d)
    return str(d)


def test_all_tasks_and_groups_are_indexed():
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(TASKS), include_defaults=False)
    expected = set(task_names(BENCHES)) | set(GROUPS) | {"hfd_all"}
    assert expected <= set(tm.all_tasks)


def _evaluate(model, tasks, data, tok_dir, **kw):
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=model, tokenizer=gpt2_tokenizer(), batch_size=4, max_length=1024, backend="causal")
    tm = TaskManager(include_path=str(TASKS), include_defaults=False, metadata={"tokenizer": tok_dir, "data_dir": str(data)})
    return simple_evaluate(model=lm, tasks=tasks, task_manager=tm, limit=2, bootstrap_iters=0,
                           gen_kwargs={"max_gen_toks": 8}, **kw)


@pytest.mark.parametrize("make_model", [tiny_hf_depth, tiny_llama], ids=["hf_depth_pre_ln", "llama"])
def test_every_task_runs_end_to_end(make_model, data_dir, tokenizer_dir):
    data, available = data_dir
    tasks = task_names(sorted(available))
    out = _evaluate(make_model(), tasks, data, tokenizer_dir, confirm_run_unsafe_code=True)
    for name in tasks:
        bench, kind = name[4:].rsplit("_", 1)
        metrics = METRICS[kind] if kind != "gen" else METRICS["gen"][bench]
        res = out["results"][name]
        for m in metrics:
            value = res[f"{m},none"]
            assert math.isfinite(value), (name, m, value)
            assert (0.0 <= value <= 1.0) if kind != "nll" else value > 0, (name, m, value)
        assert len(out["samples"][name]) == 2


def test_nll_per_token_equals_a_direct_computation(data_dir, tokenizer_dir):
    data, _ = data_dir
    model, tok = tiny_hf_depth(), gpt2_tokenizer()
    out = _evaluate(model, ["hfd_sciq_nll"], data, tokenizer_dir)
    bench = BENCHES["sciq"]
    docs = [json.loads(line) for line in open(data / "sciq_test.jsonl")][:2]
    nll = ntok = nbytes = 0
    for d in docs:
        ctx, cont = bench.nll_context(d), bench.nll_target(d)
        n = continuation_tokens(tok, ctx, cont)
        ids = tok(ctx + cont, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
        targets = ids[0, 1:]
        nll -= logp[-n:].gather(-1, targets[-n:, None]).sum().item()
        ntok, nbytes = ntok + n, nbytes + len(cont.encode())
    res = out["results"]["hfd_sciq_nll"]
    assert res["nll_per_token,none"] == pytest.approx(nll / ntok, rel=1e-4)
    assert res["nll_per_byte,none"] == pytest.approx(nll / nbytes, rel=1e-4)
    assert res["bits_per_byte,none"] == pytest.approx(nll / nbytes / math.log(2), rel=1e-4)


def _save_tiny_run(path: pathlib.Path, tok_dir: str) -> pathlib.Path:
    final = path / "final"
    tiny_hf_depth().save_pretrained(final)
    gpt2_tokenizer().save_pretrained(final)
    return final


def test_hf_depth_eval_cli_on_a_run_folder(tmp_path, data_dir, tokenizer_dir, capsys):
    from hf_depth.evaluation import cli

    data, _ = data_dir
    run = tmp_path / "run"
    _save_tiny_run(run, tokenizer_dir)
    (run / "checkpoint-5").mkdir()
    assert cli.resolve_model(str(run)) == str(run / "final")
    out = tmp_path / "out"
    common = [str(run), "--limit", "2", "--data-dir", str(data), "--max-length", "1024", "--max-gen-toks", "8",
              "--device", "cpu", "--output", str(out)]
    # code execution is refused without the flag, with the reason
    assert cli.main([*common, "--tasks", "hfd_humaneval_gen"]) == 2
    assert "untrusted" in capsys.readouterr().err
    assert cli.main([*common, "--tasks", "hfd_gpqa_nll,hfd_sciq_mc,hfd_humaneval_gen",
                     "--confirm-run-unsafe-code"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert {"hfd_gpqa_nll", "hfd_sciq_mc", "hfd_humaneval_gen"} <= set(results["results"])
    summary = (out / "summary.md").read_text()
    assert "| hfd_gpqa_nll | nll_per_token |" in summary and "| hfd_humaneval_gen | pass@1 |" in summary


def test_resolve_model_errors(tmp_path):
    from hf_depth.evaluation.cli import resolve_model

    assert resolve_model("org/some-model") == "org/some-model"
    with pytest.raises(ValueError, match="MODEL"):
        resolve_model(str(tmp_path))
    for step in (100, 1200, 800):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == str(tmp_path / "checkpoint-1200")


def test_plain_lm_eval_route(tmp_path, data_dir, tokenizer_dir):
    """`lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True --include_path eval/tasks ...`."""
    data, _ = data_dir
    final = _save_tiny_run(tmp_path / "run", tokenizer_dir)
    env = {**os.environ, "HF_DEPTH_EVAL_DATA_DIR": str(data),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "lm_eval", "--model", "hf",
           "--model_args", f"pretrained={final},trust_remote_code=True,max_length=1024",
           "--include_path", str(TASKS), "--tasks", "hfd_sciq_nll,hfd_gpqa_gen,hfd_humaneval_gen",
           "--limit", "2", "--device", "cpu", "--batch_size", "2", "--confirm_run_unsafe_code",
           "--gen_kwargs", "max_gen_toks=8", "--output_path", str(tmp_path / "out")]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = list((tmp_path / "out").rglob("results_*.json"))
    assert found, proc.stdout[-2000:]
    res = json.loads(found[0].read_text())["results"]
    assert math.isfinite(res["hfd_sciq_nll"]["nll_per_token,none"])   # tokenizer came from --model_args
    assert 0.0 <= res["hfd_humaneval_gen"]["pass@1,none"] <= 1.0
