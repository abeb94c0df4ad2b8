"""Sweeps: designs x shapes x learning rates, expanded into runs of one recipe.

    hf-depth sweep recipes/train/tiny_cpu.yaml --designs pre_ln lns --shapes 4x128 8x96 --lrs 1e-3 2e-3 \\
        --out runs/sweep_tiny [overrides...]              # runs them one after the other, here
    hf-depth sweep recipes/sweeps/depthbench_400m.yaml --print   # one launch command per run, for a scheduler

A shape is ``LxD`` (depth x width), or ``--target N --depths 16 24 32`` picks the iso-parameter width per design
and depth (``hf_depth.shapes.iso_width``). Without ``--lrs`` the DepthBench grid {5e-4, 1e-3, 2e-3, 5e-3} is used,
extended to 1e-2 and 2e-2 for LNS. A sweep file (YAML) holds the same fields: recipe, designs, shapes or
target+depths, lrs, out, overrides. Each run goes to ``OUT/<design>_L<L>_d<d>_lr<lr>``; finished runs are skipped,
so re-running a sweep resumes it. Collect with ``hf-depth results OUT``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..models.residual import DEPTHBENCH_LRS as DEFAULT_LRS  # noqa: F401  (the grid every design starts from)


def default_lrs(design: str) -> tuple[float, ...]:
    """The design's own sweep grid (``Design.sweep_lrs``: DepthBench's, extended for LNS)."""
    from ..models.registry import DESIGNS

    return tuple(DESIGNS[design].sweep_lrs)


@dataclass(frozen=True)
class SweepRun:
    design: str
    num_hidden_layers: int
    hidden_size: int
    lr: float
    run_dir: str

    def overrides(self) -> list[str]:
        return [f"model.design={self.design}", f"model.num_hidden_layers={self.num_hidden_layers}",
                f"model.hidden_size={self.hidden_size}", f"optim.lr={self.lr:g}", f"run_dir={self.run_dir}",
                f"name={Path(self.run_dir).name}"]


def parse_shape(text: str) -> tuple[int, int]:
    try:
        depth, width = (int(x) for x in str(text).lower().split("x"))
    except ValueError:
        raise ValueError(f"shape {text!r} must look like LxD, e.g. 24x1024 (depth x width)") from None
    if depth <= 0 or width <= 0:
        raise ValueError(f"shape {text!r}: depth and width must be positive")
    return depth, width


def expand(designs, shapes=None, lrs=None, out="runs/sweep", target=None, depths=None, **shape_kwargs) -> list[SweepRun]:
    """Every (design, shape, lr) of the sweep, in a stable order."""
    from ..models.registry import DESIGNS
    from ..shapes import iso_width

    if not designs:
        raise ValueError("a sweep needs at least one design (`designs`)")
    for d in designs:
        if d not in DESIGNS:
            raise ValueError(f"`designs` entry {d!r} is not a registered design; allowed: {sorted(DESIGNS)}")
    if (shapes is None) == (target is None):
        raise ValueError("give either `shapes` (LxD) or `target` with `depths` (iso-parameter widths)")
    runs = []
    for design in designs:
        if shapes is not None:
            design_shapes = [parse_shape(s) for s in shapes]
        else:
            design_shapes = [(s.num_hidden_layers, s.hidden_size)
                             for s in (iso_width(design, float(target), L, **shape_kwargs) for L in depths)]
        for L, d in design_shapes:
            for lr in (lrs or default_lrs(design)):
                runs.append(SweepRun(design, L, d, float(lr), str(Path(out) / f"{design}_L{L}_d{d}_lr{float(lr):g}")))
    return runs


def launch_command(recipe: str, run: SweepRun, overrides: list[str], launcher: str) -> str:
    return " ".join([launcher, "-m hf_depth.training.train", shlex.quote(recipe),
                     *(shlex.quote(o) for o in overrides + run.overrides())])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hf-depth sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", help="a training recipe YAML, or a sweep YAML (with a `recipe:` field)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides applied to every run")
    ap.add_argument("--designs", nargs="+")
    ap.add_argument("--shapes", nargs="+", help="LxD shapes, e.g. 24x1024 32x896")
    ap.add_argument("--target", type=float, help="parameter budget for iso-parameter widths")
    ap.add_argument("--depths", type=int, nargs="+")
    ap.add_argument("--lrs", type=float, nargs="+")
    ap.add_argument("--out", help="sweep folder (default runs/sweep)")
    ap.add_argument("--print", dest="print_only", action="store_true", help="print launch commands, run nothing")
    ap.add_argument("--launcher", default="accelerate launch", help="prefix of the printed commands")
    a = ap.parse_intermixed_args(argv)  # overrides may come after options
    spec = {}
    text = yaml.safe_load(Path(a.recipe).read_text()) if Path(a.recipe).is_file() else None
    if isinstance(text, dict) and "recipe" in text:
        spec = text
        unknown = set(spec) - {"recipe", "designs", "shapes", "target", "depths", "lrs", "out", "overrides",
                               "vocab_size", "num_attention_heads", "num_key_value_heads"}
        if unknown:
            print(f"hf-depth sweep: unknown sweep keys {sorted(unknown)}", file=sys.stderr)
            return 2
    recipe = spec.get("recipe", a.recipe)
    overrides = list(spec.get("overrides", [])) + a.overrides
    shape_kwargs = {k: spec[k] for k in ("vocab_size", "num_attention_heads", "num_key_value_heads") if k in spec}
    try:
        runs = expand(a.designs or spec.get("designs"), a.shapes or spec.get("shapes"), a.lrs or spec.get("lrs"),
                      a.out or spec.get("out", "runs/sweep"), a.target or spec.get("target"),
                      a.depths or spec.get("depths"), **shape_kwargs)
    except ValueError as e:
        print(f"hf-depth sweep: {e}", file=sys.stderr)
        return 2
    if a.print_only:
        for r in runs:
            print(launch_command(recipe, r, overrides, a.launcher))
        return 0
    from .recipe import load_recipe
    from .train import run

    status = {}
    for i, r in enumerate(runs):
        summary_path = Path(r.run_dir) / "summary.json"
        if summary_path.exists() and json.loads(summary_path.read_text()).get("status") in ("finished", "diverged"):
            print(f"[sweep {i + 1}/{len(runs)}] {r.run_dir}: done, skipped")
            continue
        print(f"[sweep {i + 1}/{len(runs)}] {r.run_dir}")
        rec = load_recipe(recipe, overrides + r.overrides())
        resume = (Path(r.run_dir) / "checkpoints").exists()
        status[r.run_dir] = run(rec, resume=resume)["status"]
    print(json.dumps(status, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
