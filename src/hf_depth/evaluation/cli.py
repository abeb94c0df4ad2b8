"""``hf-depth eval MODEL --tasks hfd_all [--limit N] [--confirm-run-unsafe-code]``.

MODEL is resolved by :func:`resolve_model`:

* a folder with ``config.json`` -> that folder;
* a run folder (no ``config.json``) -> its ``final/`` subfolder if that holds a model, else the latest
  checkpoint subfolder holding a ``config.json`` (highest trailing number: ``checkpoint-1200``, ``step_00800``);
* anything else -> a Hub id (``AutoModelForCausalLM.from_pretrained``; needs network or the HF cache).

The model is loaded once (``trust_remote_code=True``; ``import hf_depth`` registers our designs), wrapped in
:class:`hf_depth.evaluation.lm.ContextFitHFLM` (lm-eval's ``HFLM``, ``backend="causal"``, with generation
budgets and gold-answer scoring fitted to the model's context) and passed to ``simple_evaluate`` with the tasks
of ``eval/tasks``. An ``hfd_*`` task whose benchmark data cannot be found is not run (one line says why and how
to get the file); the others are. Writes ``<output>/results.json`` (lm-eval's results dict, plus
``hfd_context``: per task, what fitting the context changed, and ``hfd_not_run``) and ``<output>/summary.md``.
The default output of a run folder is ``RUN/eval``, and ``RUN/eval_results.json`` (``{task: {metric: value}}``)
then feeds the model card of ``hf-depth export``; else ``eval_results/<model name>``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path

from .sandbox import REFUSAL

REPO_TASKS = Path(__file__).resolve().parents[3] / "eval" / "tasks"


def resolve_model(model: str) -> str:
    """A loadable folder (or Hub id) for MODEL: see the module docstring."""
    p = Path(model)
    if not p.is_dir():
        if p.exists() or model.startswith((".", "/")):
            raise ValueError(f"`MODEL` {model!r} is not a folder (expected a model folder, a run folder or a Hub id)")
        return model
    if (p / "config.json").exists():
        return str(p)
    if (p / "final" / "config.json").exists():
        return str(p / "final")
    ckpts = [c for c in p.iterdir() if c.is_dir() and (c / "config.json").exists()]

    def step(c: Path) -> int:
        m = re.search(r"(\d+)$", c.name)
        return int(m.group(1)) if m else -1

    if not ckpts:
        raise ValueError(f"`MODEL` folder {model!r} holds no config.json, no final/ and no checkpoint subfolder")
    return str(max(ckpts, key=step))


def resolve_tokenizer(model_path: str, run_folder: str) -> str:
    """The model folder if it has tokenizer files, else the run folder if it has them, else the model path."""
    for d in (model_path, run_folder):
        if Path(d).is_dir() and any((Path(d) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
            return d
    return model_path


def task_metrics(results: dict) -> dict[str, dict[str, float]]:
    """``{task: {metric: value}}`` of every task (not groups) in lm-eval's results (no stderr)."""
    out = {}
    for task, metrics in results.get("results", {}).items():
        vals = {k.split(",")[0]: float(v) for k, v in metrics.items()
                if "," in k and "_stderr" not in k and isinstance(v, (int, float))}
        if vals:
            out[task] = vals
    return out


def summary_table(results: dict) -> str:
    """One markdown table: task | metric | value, for every task (not groups) in lm-eval's results."""
    rows = ["| task | metric | value |", "|---|---|---|"]
    for task, metrics in task_metrics(results).items():
        rows += [f"| {task} | {metric} | {value:.4f} |" for metric, value in metrics.items()]
    return "\n".join(rows) + "\n"


def context_table(report: dict) -> str:
    """Markdown: the tasks whose generation budget, prompt or gold-answer scoring was fitted to the context."""
    rows = []
    for task, r in report.items():
        if r.get("docs_gen_capped") or r.get("docs_prompt_truncated"):
            rows.append(f"| {task} | {r['docs']} | generation budget {r['max_gen_toks']} capped (to >= "
                        f"{r['min_gen_toks_used']}) for {r['docs_gen_capped']}, prompt left-truncated for "
                        f"{r['docs_prompt_truncated']} |")
        elif r.get("docs_rolling") or r.get("docs_context_truncated"):
            parts = [f"gold answer scored in rolling windows for {r['docs_rolling']} ({r['rolling_windows']} "
                     "windows)"] if r["docs_rolling"] else []
            parts += [f"context left-truncated for {r['docs_context_truncated']}"] if r["docs_context_truncated"] else []
            rows.append(f"| {task} | {r['docs']} | {', '.join(parts)} |")
    if not rows:
        return ""
    length = next(iter(report.values()))["max_length"]
    return (f"\nFitted to the context ({length} tokens; docs affected, from `hfd_context` in results.json):\n\n"
            "| task | docs | changed |\n|---|---|---|\n" + "\n".join(rows) + "\n")


def runnable_tasks(tasks: list[str], data_dir: str | None) -> tuple[list[str], dict[str, str]]:
    """(tasks whose data is found, {task: why not} for the ``hfd_*`` tasks whose data is not)."""
    from .tasks import DataUnavailable, bench_of, expand_tasks

    keep, why = [], {}
    for task in expand_tasks(tasks):
        bench = bench_of(task)
        if bench is not None and bench.name not in why:
            path, name, split = bench.hub
            try:
                bench.rows(path, split, name, data_dir)
            except DataUnavailable as e:
                why[bench.name] = str(e)
        if bench is not None and bench.name in why:
            continue
        keep.append(task)
    not_run = {t: why[b.name] for t in expand_tasks(tasks) if (b := bench_of(t)) is not None and b.name in why}
    return keep, not_run


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="hf-depth eval", description=__doc__.split("\n")[0])
    ap.add_argument("model", help="model folder, run folder (final/ or latest checkpoint) or Hub id")
    ap.add_argument("--tasks", default="hfd_all", help="comma-separated tasks/groups (default hfd_all)")
    ap.add_argument("--limit", type=float, default=None, help="documents per task (testing only)")
    ap.add_argument("--confirm-run-unsafe-code", action="store_true",
                    help="allow executing model-generated code (HumanEval/MBPP) in hf_depth's sandbox")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=None, help="context length (default: the model's)")
    ap.add_argument("--max-gen-toks", type=int, default=None, help="override every task's max_gen_toks")
    ap.add_argument("--device", default=None, help="cpu / cuda (default: cuda if available)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder or id (default: the model's)")
    ap.add_argument("--include-path", default=str(REPO_TASKS), help="folder of task YAMLs (default eval/tasks)")
    ap.add_argument("--data-dir", default=None,
                    help="read benchmark files from this folder instead of the Hub (see eval/tasks/README.md)")
    ap.add_argument("--output", default=None, help="output folder (default eval_results/<model name>)")
    args = ap.parse_args(argv)
    if args.limit is not None and args.limit <= 0:
        ap.error("`--limit` must be > 0")
    if not Path(args.include_path).is_dir():
        ap.error(f"`--include-path` {args.include_path!r} is not a folder of task YAMLs")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_depth  # noqa: F401  (registers the designs with the Auto classes)

    from .lm import ContextFitHFLM

    data_dir = str(Path(args.data_dir).resolve()) if args.data_dir else None
    tasks, not_run = runnable_tasks(args.tasks.split(","), data_dir)
    for why in dict.fromkeys(not_run.values()):
        print(f"hf-depth eval: not run: {why}", file=sys.stderr)
    if not tasks:
        print("hf-depth eval: none of the requested tasks has its data", file=sys.stderr)
        return 2
    if not not_run:
        tasks = args.tasks.split(",")   # the names as given (groups stay groups in lm-eval's results)
    model_path = resolve_model(args.model)
    tok_path = args.tokenizer or resolve_tokenizer(model_path, args.model)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    from ..errors import reading_model

    with reading_model(model_path):
        model = AutoModelForCausalLM.from_pretrained(model_path, trust_remote_code=True, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(tok_path, trust_remote_code=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    lm = ContextFitHFLM(pretrained=model, tokenizer=tokenizer, batch_size=args.batch_size, backend="causal",
                        max_length=args.max_length or getattr(model.config, "max_position_embeddings", None), device=device)
    metadata = {"tokenizer": tok_path, "trust_remote_code": True}
    if data_dir:
        metadata["data_dir"] = data_dir
    tm = TaskManager(include_path=args.include_path, include_defaults=False, metadata=metadata)
    try:
        results = simple_evaluate(
            model=lm, tasks=tasks, task_manager=tm, limit=args.limit, bootstrap_iters=0,
            confirm_run_unsafe_code=args.confirm_run_unsafe_code,
            gen_kwargs={"max_gen_toks": args.max_gen_toks} if args.max_gen_toks else None,
        )
    except ValueError as e:
        if "unsafe" in str(e) and not args.confirm_run_unsafe_code:
            print(f"hf-depth eval: {e}\n{REFUSAL}", file=sys.stderr)
            return 2
        raise
    results["hfd_context"] = lm.context_report()
    results["hfd_not_run"] = not_run
    # MODEL named a run folder (resolved to its final/ or a checkpoint): results go next to the run
    run_folder = Path(args.model) if Path(model_path).parent.resolve() == Path(args.model).resolve() else None
    default_out = run_folder / "eval" if run_folder else Path("eval_results") / Path(model_path.rstrip("/")).name
    out = Path(args.output or default_out)
    out.mkdir(parents=True, exist_ok=True)
    _write_atomic(out / "results.json", json.dumps(results, indent=2, default=str))
    limit = f" (--limit {args.limit:g}: a smoke test, not a score)" if args.limit else ""
    table = summary_table(results) + context_table(results["hfd_context"])
    if not_run:
        table += "\nNot run (no data):\n\n" + "".join(f"- {why}\n" for why in dict.fromkeys(not_run.values()))
    _write_atomic(out / "summary.md", f"# {args.model}{limit}\n\n{table}")
    written = [out / "results.json", out / "summary.md"]
    if run_folder is not None:
        metrics = {t: {k: v for k, v in m.items() if math.isfinite(v)} for t, m in task_metrics(results).items()}
        _write_atomic(run_folder / "eval_results.json", json.dumps(metrics, indent=2))
        written.append(run_folder / "eval_results.json")
    print(table)
    print("wrote " + ", ".join(map(str, written)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
