"""Collect finished runs into DepthBench's tables, figures and scaling fits.

    hf-depth results runs/sweep_tiny [--out runs/sweep_tiny/results] [--compare pre_ln hc]

Writes ``best.csv`` / ``best.md`` (best validation loss per design and shape, the best learning rate kept),
``val_loss_vs_aspect_ratio.png`` (the paper's Figure 2: loss against d/L, one line per design), and, for designs
with at least three model sizes, fitted scaling laws ``L(N) = a * N^-alpha + c`` in parameters and
``L(C) = a * C^-alpha + c`` in training compute C (PFLOP/s-days) (``scaling.json``/``.md``), and the
compute-efficiency ratio between two designs at equal loss, C_a(ℓ) / C_b(ℓ) from the compute fits (the
scale-vector paper's "1.22x PFLOP/s-days", HiRes's "1.30x FLOPs").

Training compute is analytic, per design (``training_flops``): 3 x the forward FLOPs (forward + backward) of every
trained token, the forward from ``hf_depth.diagnostics.cost.prefill_flops`` at the run's sequence length: every
matmul (projections, full attention scores and values, LM head) plus the design's own work (routing matmuls, depth
softmax, MoDA depth attention, ...). Not 6 N D: attention and design FLOPs grow with L d at fixed N.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

import numpy as np

from ..errors import command, command_parser

PFLOPS_DAY = 1e15 * 86400


def training_flops(config, tokens: int, seq_len: int) -> int:
    """Analytic training FLOPs of ``tokens`` tokens in sequences of ``seq_len``: 3 x forward (see module docstring)."""
    from ..diagnostics.cost import prefill_flops

    f = prefill_flops(config, seq_len)
    per_token = (f["total_matmul"] + f["extra_other"]) / seq_len
    return int(round(3 * per_token * tokens))


SUMMARY_FIELDS = {"design": str, "num_hidden_layers": int, "hidden_size": int, "lr": float, "best_val_loss": float,
                  "params": int, "tokens": int}
"""What a finished run's ``summary.json`` must hold for the tables (``train.py`` writes it)."""
EVERY_RUN = ("design", "num_hidden_layers", "hidden_size", "lr")
"""The fields every summary (diverged runs too) must hold: runs are grouped by them."""


def check_summary(path, s: dict) -> dict:
    """A summary holds :data:`EVERY_RUN`, and a finished run's every field of :data:`SUMMARY_FIELDS`, each a finite
    value of its type; otherwise a :class:`~hf_depth.errors.UserError` naming the file and the field."""
    from ..errors import UserError

    finished = s.get("status") == "finished" and s.get("best_val_loss") is not None
    for key, tp in SUMMARY_FIELDS.items():
        if not finished and key not in EVERY_RUN:
            continue
        v = s.get(key)
        ok = isinstance(v, str) if tp is str else (
            isinstance(v, (int, float) if tp is float else int) and not isinstance(v, bool) and math.isfinite(v))
        if not ok:
            raise UserError(f"{str(path)!r}: a run summary needs `{key}` ({tp.__name__}), got {v!r}; "
                            "re-run or delete the run folder")
    if s.get("train_flops") is not None and not (isinstance(s["train_flops"], (int, float)) and s["train_flops"] >= 0):
        raise UserError(f"{str(path)!r}: `train_flops` must be a number >= 0, got {s['train_flops']!r}")
    return s


def collect(root: str | Path) -> list[dict]:
    """Every ``summary.json`` under ``root`` (finished and diverged runs); a malformed one is an error naming it."""
    from ..errors import read_json

    rows = []
    for p in sorted(Path(root).rglob("summary.json")):
        s = check_summary(p, read_json(p, "run summary"))
        s["run_dir"] = str(p.parent)
        rows.append(s)
    return rows


def arm(r: dict) -> str:
    """A run's design label: the design, with its scale-vector variant unless ``standard`` (``pre_ln+best``)."""
    sv = r.get("scale_vector", "standard")
    return r["design"] if sv in (None, "standard") else f"{r['design']}+{sv}"


def best_per_shape(rows: list[dict]) -> list[dict]:
    """One row per (design label, L, d): the learning rate with the lowest best validation loss."""
    rows = [{**r, "design": arm(r)} for r in rows]
    best: dict[tuple, dict] = {}
    for r in rows:
        if r.get("status") != "finished" or r.get("best_val_loss") is None:
            continue
        key = (r["design"], r["num_hidden_layers"], r["hidden_size"])
        if key not in best or r["best_val_loss"] < best[key]["best_val_loss"]:
            best[key] = r
    out = []
    for (design, L, d), r in sorted(best.items()):
        lrs = sorted({x["lr"] for x in rows if (x["design"], x["num_hidden_layers"], x["hidden_size"]) == (design, L, d)})
        row = {"design": design, "L": L, "d": d, "aspect_ratio": round(d / L, 3), "params": r["params"],
               "best_lr": r["lr"], "val_loss": round(r["best_val_loss"], 4), "lrs_tried": len(lrs),
               "tokens": r["tokens"]}
        if r.get("train_flops") is not None:
            row["pflops_days"] = float(f"{r['train_flops'] / PFLOPS_DAY:.4g}")
        out.append(row)
    return out


def to_markdown(rows: list[dict], columns: list[str] | None = None) -> str:
    if not rows:
        return "(no finished runs)\n"
    columns = columns or list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r[c]) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, int) and v > 10**5:
        return f"{v / 1e6:.2f}M"
    return str(v)


def plot_vs_aspect_ratio(rows: list[dict], path: Path) -> Path:
    from ..plotting import pyplot, save_figure

    fig, ax = pyplot().subplots(figsize=(6, 4))
    for design in sorted({r["design"] for r in rows}):
        pts = sorted((r["aspect_ratio"], r["val_loss"]) for r in rows if r["design"] == design)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=design)
    ax.set_xscale("log")
    ticks = sorted({r["aspect_ratio"] for r in rows})
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("aspect ratio d/L")
    ax.set_ylabel("best validation loss")
    ax.set_title("validation loss vs aspect ratio (best LR per point)")
    save_figure(fig, path, dpi=120, ax=ax)
    return path


# ---------------------------------------------------------------------------------------------- scaling laws
def fit_scaling_law(n: np.ndarray, loss: np.ndarray) -> dict:
    """Least-squares fit of L(N) = a * N^-alpha + c (N in parameters); needs >= 3 distinct sizes."""
    from scipy.optimize import curve_fit

    n, loss = np.asarray(n, dtype=float), np.asarray(loss, dtype=float)
    if len(np.unique(n)) < 3:
        raise ValueError(f"a scaling law needs at least 3 model sizes, got {len(np.unique(n))}")
    scale = float(np.median(n))

    def f(x, a, alpha, c):
        return a * (x / scale) ** (-alpha) + c

    c0 = float(loss.min()) - 0.1 * float(np.ptp(loss) + 1e-3)
    p, _ = curve_fit(f, n, loss, p0=(float(loss.max() - c0), 0.3, c0), bounds=([0, 0, 0], [np.inf, 5, np.inf]),
                     maxfev=20000)
    a, alpha, c = (float(x) for x in p)
    resid = loss - f(n, *p)
    return {"a": a * scale**alpha, "alpha": alpha, "c": c, "rmse": float(np.sqrt(np.mean(resid**2))),
            "points": len(n)}


def params_at_loss(fit: dict, loss: float) -> float:
    """x such that a x^-alpha + c = loss for a fit in x (parameters or compute); inf at or below the floor c."""
    if loss <= fit["c"]:
        return math.inf
    return (fit["a"] / (loss - fit["c"])) ** (1 / fit["alpha"])


def compute_efficiency(compute_fit_a: dict, compute_fit_b: dict, loss: float, param_fit_a: dict | None = None,
                       param_fit_b: dict | None = None) -> dict:
    """How much more training compute design a needs than design b to reach ``loss``: C_a(loss) / C_b(loss) from
    scaling laws fitted on compute (PFLOP/s-days); with parameter fits also the parameter ratio N_a / N_b."""
    ca, cb = params_at_loss(compute_fit_a, loss), params_at_loss(compute_fit_b, loss)
    out = {"loss": loss, "pflops_days_a": ca, "pflops_days_b": cb, "compute_ratio": ca / cb}
    if param_fit_a is not None and param_fit_b is not None:
        na, nb = params_at_loss(param_fit_a, loss), params_at_loss(param_fit_b, loss)
        out.update({"params_a": na, "params_b": nb, "param_ratio": na / nb})
    return out


def _main(argv: list[str] | None = None) -> int:
    from ..errors import UserError, arg_number

    ap = command_parser("results", __doc__)
    ap.add_argument("root", help="folder holding run folders (searched recursively for summary.json)")
    ap.add_argument("--out", help="output folder (default ROOT/results)")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compute-efficiency of design B over A")
    ap.add_argument("--loss", type=arg_number(float, 0, strict=True),
                    help="loss at which to compare (default: the best loss A reached)")
    a = ap.parse_args(argv)
    if not Path(a.root).is_dir():
        raise UserError(f"{a.root!r} is not a folder: give the folder holding the run folders (their summary.json)")
    rows = collect(a.root)
    if not rows:
        print(f"hf-depth results: no summary.json under {a.root}", file=sys.stderr)
        return 2
    out = Path(a.out or Path(a.root) / "results")
    out.mkdir(parents=True, exist_ok=True)
    best = best_per_shape(rows)
    with open(out / "best.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(best[0]) if best else ["design"])
        w.writeheader()
        w.writerows(best)
    md = to_markdown(best)
    (out / "best.md").write_text(md)
    print(md)
    if best:
        print(f"plot: {plot_vs_aspect_ratio(best, out / 'val_loss_vs_aspect_ratio.png')}")
    fits, compute_fits = {}, {}
    for design in sorted({r["design"] for r in best}):
        pts = [r for r in best if r["design"] == design]
        try:
            fits[design] = fit_scaling_law([r["params"] for r in pts], [r["val_loss"] for r in pts])
            if all("pflops_days" in r for r in pts):
                compute_fits[design] = fit_scaling_law([r["pflops_days"] for r in pts], [r["val_loss"] for r in pts])
        except ValueError as e:
            print(f"scaling law for {design}: skipped ({e})")
    report = {"fits": fits, "compute_fits": compute_fits}
    if a.compare:
        da, db = a.compare
        if da in compute_fits and db in compute_fits:
            loss = a.loss or min(r["val_loss"] for r in best if r["design"] == da)
            report["efficiency"] = {"a": da, "b": db, **compute_efficiency(
                compute_fits[da], compute_fits[db], loss, fits.get(da), fits.get(db))}
            e = report["efficiency"]
            print(f"{db} reaches loss {loss:.4f} with {e['compute_ratio']:.3f}x less training compute "
                  f"(PFLOP/s-days) than {da}")
        else:
            print(f"compute efficiency: needs compute scaling fits for both {da} and {db} (>= 3 sizes each, runs "
                  "with train_flops in summary.json)")
    if fits:
        lines = [f"| {d} | {f['a']:.4g} | {f['alpha']:.4f} | {f['c']:.4f} | {f['rmse']:.2e} | {f['points']} |"
                 for d, f in fits.items()]
        (out / "scaling.md").write_text("| design | a | alpha | c | rmse | sizes |\n|---|---|---|---|---|---|\n"
                                        + "\n".join(lines) + "\n")
        print((out / "scaling.md").read_text())
    (out / "scaling.json").write_text(json.dumps(report, indent=1))
    return 0


main = command("results", _main, "exit 0 done, 2 bad input (one line naming the file, see ``hf_depth.errors``).")

if __name__ == "__main__":
    sys.exit(main())
