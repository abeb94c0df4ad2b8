"""Collect finished runs into DepthBench's tables, figures and scaling fits.

    hf-depth results runs/sweep_tiny [--out runs/sweep_tiny/results] [--compare pre_ln hc]

Writes ``best.csv`` / ``best.md`` (best validation loss per design and shape, the best learning rate kept),
``val_loss_vs_aspect_ratio.png`` (the paper's Figure 2: loss against d/L, one line per design), and, for designs
with at least three model sizes, a fitted scaling law ``L(N) = a * N^-alpha + c`` (``scaling.json``/``.md``) and
the compute-efficiency ratio between two designs at equal loss: with a fixed number of tokens per parameter
compute is C = 6 N D ∝ N², so the ratio is (N_a(ℓ) / N_b(ℓ))² at the loss ℓ both reach.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from pathlib import Path

import numpy as np


def collect(root: str | Path) -> list[dict]:
    """Every ``summary.json`` under ``root`` (finished and diverged runs)."""
    rows = []
    for p in sorted(Path(root).rglob("summary.json")):
        s = json.loads(p.read_text())
        s["run_dir"] = str(p.parent)
        rows.append(s)
    return rows


def best_per_shape(rows: list[dict]) -> list[dict]:
    """One row per (design, L, d): the learning rate with the lowest best validation loss."""
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
        out.append({"design": design, "L": L, "d": d, "aspect_ratio": round(d / L, 3), "params": r["params"],
                    "best_lr": r["lr"], "val_loss": round(r["best_val_loss"], 4), "lrs_tried": len(lrs),
                    "tokens": r["tokens"]})
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
    """N such that a N^-alpha + c = loss (inf when the loss is at or below the fit's floor c)."""
    if loss <= fit["c"]:
        return math.inf
    return (fit["a"] / (loss - fit["c"])) ** (1 / fit["alpha"])


def compute_efficiency(fit_a: dict, fit_b: dict, loss: float) -> dict:
    """How much more compute design a needs than design b to reach ``loss`` (tokens/param fixed: C ∝ N²)."""
    na, nb = params_at_loss(fit_a, loss), params_at_loss(fit_b, loss)
    return {"loss": loss, "params_a": na, "params_b": nb, "param_ratio": na / nb, "compute_ratio": (na / nb) ** 2}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hf-depth results", description=__doc__.split("\n\n")[0])
    ap.add_argument("root", help="folder holding run folders (searched recursively for summary.json)")
    ap.add_argument("--out", help="output folder (default ROOT/results)")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compute-efficiency of design B over A")
    ap.add_argument("--loss", type=float, help="loss at which to compare (default: the best loss A reached)")
    a = ap.parse_args(argv)
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
    fits = {}
    for design in sorted({r["design"] for r in best}):
        pts = [r for r in best if r["design"] == design]
        try:
            fits[design] = fit_scaling_law([r["params"] for r in pts], [r["val_loss"] for r in pts])
        except ValueError as e:
            print(f"scaling law for {design}: skipped ({e})")
    report = {"fits": fits}
    if a.compare:
        da, db = a.compare
        if da in fits and db in fits:
            loss = a.loss or min(r["val_loss"] for r in best if r["design"] == da)
            report["efficiency"] = {"a": da, "b": db, **compute_efficiency(fits[da], fits[db], loss)}
            e = report["efficiency"]
            print(f"{db} reaches loss {loss:.4f} with {e['param_ratio']:.3f}x fewer parameters than {da}: "
                  f"{e['compute_ratio']:.3f}x compute efficiency")
        else:
            print(f"compute efficiency: needs scaling fits for both {da} and {db} (>= 3 sizes each)")
    if fits:
        lines = [f"| {d} | {f['a']:.4g} | {f['alpha']:.4f} | {f['c']:.4f} | {f['rmse']:.2e} | {f['points']} |"
                 for d, f in fits.items()]
        (out / "scaling.md").write_text("| design | a | alpha | c | rmse | sizes |\n|---|---|---|---|---|---|\n"
                                        + "\n".join(lines) + "\n")
        print((out / "scaling.md").read_text())
    (out / "scaling.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
