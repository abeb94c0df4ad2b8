"""Export a run to a Hub-ready folder, write its model card, push it.

    hf-depth export runs/tiny_cpu [--out runs/tiny_cpu/export] [--push user/tiny-pre-ln] [--private]

The folder holds ``model.safetensors``, ``config.json`` with ``auto_map`` and the modeling code (it loads with
``trust_remote_code=True`` where hf_depth is not installed), the tokenizer, ``generation_config.json``, the
recipe, ``loss_curve.png`` and ``README.md``: a model card from ``model_cards/template.md`` whose YAML front
matter carries ``library_name``, ``tags``, ``datasets`` and a ``model-index`` with the validation loss and any
evaluation results found in the run folder (``eval_results.json``: ``{task: {metric: value}}``, written by
``hf-depth eval RUN``), which also make its "Evaluation" section.
Diagnostics add their headline numbers with ``write_model_card(folder, run_dir, {"Depth diagnostics": text})``.
"""

from __future__ import annotations

import shutil
import string
import sys
from importlib import resources
from pathlib import Path

import yaml

from .errors import command, command_parser
from .utils import atomic_path

LOCAL_BUILDERS = {"json", "parquet", "csv", "text", "arrow"}


def _read_run(run_dir: Path) -> tuple[dict, dict, dict, list[dict]]:
    if not (run_dir / "final" / "config.json").exists():
        raise ValueError(f"{str(run_dir)!r} has no final/ model: is it a finished hf-depth run folder?")
    from .errors import UserError, read_json, read_jsonl, read_yaml

    summary = {}
    if (run_dir / "summary.json").exists():
        from .training.results import check_summary

        summary = check_summary(run_dir / "summary.json", read_json(run_dir / "summary.json", "run summary"))
    meta = read_json(run_dir / "run.json", "run record") if (run_dir / "run.json").exists() else {}
    recipe = read_yaml(run_dir / "recipe.yaml", "recipe", empty={}) if (run_dir / "recipe.yaml").exists() else {}
    metrics = read_jsonl(run_dir / "metrics.jsonl", "metrics file") if (run_dir / "metrics.jsonl").exists() else []
    for i, m in enumerate(metrics):
        bad = [k for k in ("tokens", "loss") if isinstance(m.get(k), bool) or not isinstance(m.get(k), (int, float))]
        if bad:
            raise UserError(f"{str(run_dir / 'metrics.jsonl')!r}: row {i + 1} has no numeric `{bad[0]}` "
                            f"(a metrics row holds step, tokens, loss): {m!r:.80}")
    return summary, meta, recipe, metrics


def plot_loss_curve(metrics: list[dict], path: Path) -> Path:
    from .plotting import pyplot, save_figure

    fig, ax = pyplot().subplots(figsize=(6, 3.5))
    ax.plot([m["tokens"] for m in metrics], [m["loss"] for m in metrics], label="train", lw=1)
    val = [m for m in metrics if "val_loss" in m]
    if val:
        ax.plot([m["tokens"] for m in val], [m["val_loss"] for m in val], "o-", label="validation")
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss")
    save_figure(fig, path, dpi=110, ax=ax)
    return path


def _dataset_name(recipe: dict) -> tuple[str, list[str]]:
    data = recipe.get("data", {})
    if data.get("source") == "hf" and data.get("path") and data["path"] not in LOCAL_BUILDERS:
        return data["path"] + (f" ({data['name']})" if data.get("name") else ""), [data["path"]]
    if data.get("source") == "embedded":
        return "the Python standard library's sources (hf_depth's embedded corpus)", []
    return "local data", []


def front_matter(summary: dict, meta: dict, recipe: dict, repo_id: str) -> dict:
    dataset, datasets = _dataset_name(recipe)
    design = summary.get("design") or meta.get("design", "unknown")
    results = []
    if summary.get("best_val_loss") is not None:
        results.append({"task": {"type": "text-generation", "name": "Language modeling"},
                        "dataset": {"name": dataset, "type": datasets[0] if datasets else "local", "split": "validation"},
                        "metrics": [{"type": "loss", "name": "validation loss",
                                     "value": round(float(summary["best_val_loss"]), 4)}]})
    for task, metrics in meta.get("eval_results", {}).items():
        results.append({"task": {"type": "text-generation", "name": task}, "dataset": {"name": task, "type": task},
                        "metrics": [{"type": k, "name": k, "value": v} for k, v in metrics.items()]})
    fm = {"library_name": "transformers", "license": "apache-2.0", "pipeline_tag": "text-generation",
          "tags": ["hf_depth", f"hf_depth_{design}", "custom_code", "depth-scaling", "causal-lm"]}
    if datasets:
        fm["datasets"] = datasets
    if results:
        fm["model-index"] = [{"name": repo_id.split("/")[-1], "results": results}]
    return fm


EVAL_RESULTS = "eval_results.json"   # `hf-depth eval RUN` writes it ({task: {metric: value}}) next to RUN/eval/


def eval_section(run_dir: str | Path) -> str | None:
    """Markdown table of ``RUN/eval_results.json`` (task | metric | value), with the ``--limit`` it ran under."""
    path = Path(run_dir) / EVAL_RESULTS
    if not path.exists():
        return None
    from .errors import read_json, reading

    results = read_json(path, "evaluation results")
    rows = ["| task | metric | value |", "|---|---|---|"]
    with reading(path, "evaluation results", "it must map each task to {metric: number}, as `hf-depth eval` writes"):
        rows += [f"| {task} | {metric} | {float(value):.4f} |" for task, metrics in results.items()
                 for metric, value in metrics.items()]
    full = Path(run_dir) / "eval" / "results.json"
    limit = None
    if full.exists():
        with reading(full, "lm-eval results"):
            limit = (read_json(full, "lm-eval results").get("config") or {}).get("limit")
            limit = None if limit is None else float(limit)
    note = f" on the first {limit:g} documents of each task (`--limit`: a smoke test, not a score)" if limit else ""
    return "\n".join(rows) + f"\n\nFrom `hf-depth eval`{note}; prompts and metrics: hf_depth's `eval/tasks`."


DIAGNOSTICS_REPORT = "diagnostics/report.json"  # `hf-depth diagnose RUN/final --out RUN/diagnostics`


def diagnostics_section(run_dir: str | Path) -> str | None:
    """Markdown with the headline depth diagnostics (R_causal, R_perm, pruning curve) of ``RUN/diagnostics``."""
    path = Path(run_dir) / DIAGNOSTICS_REPORT
    if not path.exists():
        return None
    from .diagnostics.report import headline
    from .errors import read_json, reading

    with reading(path, "diagnostics report", "re-run `hf-depth diagnose` or delete the file"):
        return _diagnostics_rows(headline(read_json(path, "diagnostics report")))


def _diagnostics_rows(h: dict) -> str:
    rows = ["| measure | value |", "|---|---|"]
    for key, label in (("R_causal", "R_causal (late pairs with causal score > 0.45)"),
                       ("R_perm", "R_perm (late pairs with permutation score > 0.15)"), ("loss", "calibration loss")):
        if h.get(key) is not None:
            rows.append(f"| {label} | {h[key]:.4f} |")
    if h.get("pruning_delta") is not None:
        rows.append("| loss increase when layer l is pruned | " + ", ".join(f"{x:+.3f}" for x in h["pruning_delta"]) + " |")
    for key, label in (("global_causal_score", "global causal score (DepthBench)"),
                       ("global_permutation_weighted", "0.9^l-weighted permutation score (DepthBench)")):
        if h.get(key) is not None:
            rows.append(f"| {label} | {h[key]:.4f} |")
    conv = h.get("convention", "branch")
    note = ("DepthBench's analysis conventions (comparable with its Figures 5, 6, 8)" if conv == "depthbench"
            else "the branch convention (branches zeroed / swapped): not comparable with DepthBench's figures")
    return "\n".join(rows) + f"\n\nFrom `hf-depth diagnose` (`diagnostics/report.json` of the run), {note}."


def write_model_card(folder: str | Path, run_dir: str | Path, extra_sections: dict | None = None,
                     repo_id: str | None = None, template: str | Path | None = None) -> Path:
    """Write ``folder/README.md`` from the run folder; ``extra_sections`` maps a heading to Markdown text."""
    from .models.registry import DESIGNS

    folder, run_dir = Path(folder), Path(run_dir)
    summary, meta, recipe, metrics = _read_run(run_dir)
    if (run_dir / EVAL_RESULTS).exists():
        from .errors import read_json

        meta["eval_results"] = read_json(run_dir / EVAL_RESULTS, "evaluation results")
    repo_id = repo_id or f"hf-depth/{summary.get('name', run_dir.name)}"
    design = summary.get("design") or meta.get("design", "unknown")
    entry = DESIGNS.get(design)
    if template is not None:
        text = Path(template).read_text()
    else:
        text = resources.files("hf_depth").joinpath("data/model_card_template.md").read_text()
    if metrics and not (folder / "loss_curve.png").exists():
        plot_loss_curve(metrics, folder / "loss_curve.png")
    sections = dict(extra_sections or {})
    evals = eval_section(run_dir)
    if evals is not None:
        sections.setdefault("Evaluation", evals)
    diag = diagnostics_section(run_dir)
    if diag is not None:
        sections.setdefault("Depth diagnostics", diag)
    from .training.init_from import section as init_from_section

    upcycled = init_from_section(run_dir)
    if upcycled is not None:
        sections.setdefault("Continued from an upcycled model: diagnostics before / after", upcycled)
    extra = "".join(f"\n## {k}\n\n{v.strip()}\n" for k, v in sections.items())
    dataset, _ = _dataset_name(recipe)

    def num(key, fmt="{:.4f}"):
        return fmt.format(summary[key]) if summary.get(key) is not None else "n/a"

    card = string.Template(text).safe_substitute(
        front_matter=yaml.safe_dump(front_matter(summary, meta, recipe, repo_id), sort_keys=False).strip(),
        title=repo_id.split("/")[-1], design=design, layers=summary.get("num_hidden_layers", "?"),
        hidden=summary.get("hidden_size", "?"), params=num("params", "{:,}"), aspect_ratio=num("aspect_ratio", "{:.2f}"),
        version=meta.get("version", "?"), tokens=num("tokens", "{:,}"), dataset=dataset,
        design_summary=(entry.paper if entry and entry.paper else f"The `{design}` residual design."),
        equation=entry.summary if entry and entry.summary else design, repo_id=repo_id, steps=summary.get("steps", "?"),
        final_loss=num("final_loss"), best_val_loss=num("best_val_loss"), lr=num("lr", "{:g}"),
        git_sha=meta.get("git_sha") or "unknown", recipe=yaml.safe_dump(recipe, sort_keys=False).strip(),
        extra_sections=extra,
    )
    path = folder / "README.md"
    path.write_text(card)
    return path


def write_conversion_card(folder: str | Path, model, source: dict, src: str | None = None,
                          repo_id: str | None = None) -> Path:
    """Write ``folder/README.md`` for a converted checkpoint: its source (format, block type, backend, version)
    and the config fields set to match the source's forward (``source`` from ``olmo_core.source_record``)."""
    from . import __version__
    from .models.registry import DESIGNS

    folder, cfg = Path(folder), model.config
    design = cfg.design
    entry = DESIGNS.get(design)
    repo_id = repo_id or f"hf-depth/{Path(str(src or folder)).name}-{design}"
    rows = [("source format", source.get("format", "?")), ("source checkpoint", f"`{src}`" if src else "n/a")]
    rows += [(k.replace("_", " "), f"`{v}`") for k, v in source.items() if k not in ("format", "fields")]
    fm = {"library_name": "transformers", "license": "apache-2.0", "pipeline_tag": "text-generation",
          "tags": ["hf_depth", f"hf_depth_{design}", "custom_code", "depth-scaling", "causal-lm", "olmo-core",
                   "depthbench"]}
    text = resources.files("hf_depth").joinpath("data/converted_card_template.md").read_text()
    card = string.Template(text).safe_substitute(
        front_matter=yaml.safe_dump(fm, sort_keys=False).strip(), title=repo_id.split("/")[-1], design=design,
        layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, params=f"{sum(p.numel() for p in model.parameters()):,}",
        format=source.get("format", "OLMo-core"), block_type=source.get("block_type", "?"), version=__version__,
        design_summary=(entry.paper if entry and entry.paper else f"The `{design}` residual design."),
        equation=entry.summary if entry and entry.summary else design,
        source_rows="\n".join(f"| {k} | {v} |" for k, v in rows),
        field_rows="\n".join(f"| `{k}` | `{v}` |" for k, v in source.get("fields", {}).items()), repo_id=repo_id,
    )
    path = folder / "README.md"
    path.write_text(card)
    return path


def export(run_dir: str | Path, out: str | Path | None = None, repo_id: str | None = None) -> Path:
    """Write the Hub-ready folder of a finished run (default ``RUN/export``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    import hf_depth  # noqa: F401  (registers the designs with the Auto classes)

    from .errors import reading, reading_model, replaceable_output

    run_dir = Path(run_dir)
    summary, meta, recipe, metrics = _read_run(run_dir)
    out = Path(out or run_dir / "export")
    replaceable_output(out, "--out", protect=[run_dir])
    with reading_model(run_dir / "final"):
        model = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    with reading(run_dir / "final", "the run's tokenizer", "the final/ folder of a run holds its tokenizer files"):
        tokenizer = AutoTokenizer.from_pretrained(run_dir / "final")
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        do_sample=True, temperature=0.8, top_p=0.95, max_new_tokens=128,
    )
    with atomic_path(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if (run_dir / "recipe.yaml").exists():
            shutil.copy(run_dir / "recipe.yaml", tmp / "recipe.yaml")
        write_model_card(tmp, run_dir, repo_id=repo_id)
    return out


def push(folder: str | Path, repo_id: str, private: bool = False) -> str:
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo_id, private=private, exist_ok=True)
    info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, commit_message="hf-depth export")
    return str(getattr(info, "commit_url", info))


def _main(argv: list[str] | None = None) -> int:
    ap = command_parser("export", __doc__)
    ap.add_argument("run", help="a finished run folder (holds final/, summary.json, metrics.jsonl)")
    ap.add_argument("--out", help="export folder (default RUN/export)")
    ap.add_argument("--push", metavar="REPO", help="push the folder to this Hub repo (user/name)")
    ap.add_argument("--private", action="store_true")
    a = ap.parse_args(argv)
    folder = export(a.run, a.out, repo_id=a.push)
    print(f"exported {folder}")
    if a.push:
        print(f"pushed: {push(folder, a.push, a.private)}")
    return 0


main = command("export", _main, "exit 0 done, 2 bad input (one line naming the file, see ``hf_depth.errors``).")

if __name__ == "__main__":
    sys.exit(main())
