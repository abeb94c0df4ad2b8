"""``hf-depth eval MODEL --tasks hfd_all [--limit N] [--confirm-run-unsafe-code]``.

MODEL is resolved by :func:`resolve_model`:

* a folder with ``config.json`` -> that folder;
* a run folder (no ``config.json``) -> its ``final/`` subfolder if that holds a model, else the latest
  checkpoint subfolder holding a ``config.json`` (highest trailing number: ``checkpoint-1200``, ``step_00800``);
* anything else -> a Hub id (``AutoModelForCausalLM.from_pretrained``; needs network or the HF cache).

The model is loaded once (``trust_remote_code=True``; ``import hf_depth`` registers our designs), wrapped in
lm-eval's ``HFLM`` (``backend="causal"``) and passed to ``simple_evaluate`` with the tasks of ``eval/tasks``.
Writes ``<output>/results.json`` (lm-eval's results dict) and ``<output>/summary.md`` (one table).
"""

from __future__ import annotations

import argparse
import json
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


def summary_table(results: dict) -> str:
    """One markdown table: task | metric | value, for every task (not groups) in lm-eval's results."""
    rows = ["| task | metric | value |", "|---|---|---|"]
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            if "," not in key or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            rows.append(f"| {task} | {key.split(',')[0]} | {value:.4f} |")
    return "\n".join(rows) + "\n"


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
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_depth  # noqa: F401  (registers the designs with the Auto classes)

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
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=args.batch_size, backend="causal",
              max_length=args.max_length or getattr(model.config, "max_position_embeddings", None), device=device)
    metadata = {"tokenizer": tok_path, "trust_remote_code": True}
    if args.data_dir:
        metadata["data_dir"] = str(Path(args.data_dir).resolve())
    tm = TaskManager(include_path=args.include_path, include_defaults=False, metadata=metadata)
    try:
        results = simple_evaluate(
            model=lm, tasks=args.tasks.split(","), task_manager=tm, limit=args.limit, bootstrap_iters=0,
            confirm_run_unsafe_code=args.confirm_run_unsafe_code,
            gen_kwargs={"max_gen_toks": args.max_gen_toks} if args.max_gen_toks else None,
        )
    except ValueError as e:
        if "unsafe" in str(e) and not args.confirm_run_unsafe_code:
            print(f"hf-depth eval: {e}\n{REFUSAL}", file=sys.stderr)
            return 2
        raise
    out = Path(args.output or Path("eval_results") / Path(model_path.rstrip("/")).name)
    out.mkdir(parents=True, exist_ok=True)
    _write_atomic(out / "results.json", json.dumps(results, indent=2, default=str))
    table = summary_table(results)
    _write_atomic(out / "summary.md", f"# {args.model}\n\n{table}")
    print(table)
    print(f"wrote {out / 'results.json'} and {out / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
