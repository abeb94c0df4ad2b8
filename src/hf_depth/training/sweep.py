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

import json
import math
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import command, command_parser
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


SWEEP_KEYS = ("recipe", "designs", "shapes", "target", "depths", "lrs", "out", "overrides", "vocab_size",
              "num_attention_heads", "num_key_value_heads")
"""The fields of a sweep YAML."""


def _list_of(name: str, value, ok, what: str) -> None:
    if value is None:
        return
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or not all(ok(v) for v in value):
        raise ValueError(f"`{name}` must be a list of {what}, got {value!r}")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_sweep_spec(spec: dict) -> None:
    """A sweep YAML's fields: known keys (with did-you-mean), each of the right type (raises ValueError naming it)."""
    from .recipe import _did_you_mean

    for key in spec:
        if key not in SWEEP_KEYS:
            raise ValueError(f"unknown sweep key `{key}`{_did_you_mean(key, SWEEP_KEYS)}; allowed: {list(SWEEP_KEYS)}")
    if not isinstance(spec.get("recipe"), str) or not spec["recipe"]:
        raise ValueError(f"`recipe` must be the path of a training recipe YAML, got {spec.get('recipe')!r}")
    _list_of("designs", spec.get("designs"), lambda v: isinstance(v, str), "design names")
    _list_of("shapes", spec.get("shapes"), lambda v: isinstance(v, str), "LxD strings (e.g. '24x1024')")
    _list_of("lrs", spec.get("lrs"), lambda v: _number(v) and v > 0, "positive finite learning rates")
    _list_of("depths", spec.get("depths"), lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
             "positive integers")
    _list_of("overrides", spec.get("overrides"), lambda v: isinstance(v, str), "`section.key=value` strings")
    if spec.get("out") is not None and not isinstance(spec["out"], str):
        raise ValueError(f"`out` must be a folder path (a string), got {spec['out']!r}")
    for key in ("vocab_size", "num_attention_heads", "num_key_value_heads"):
        v = spec.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            raise ValueError(f"`{key}` must be a positive integer, got {v!r}")


def expand(designs, shapes=None, lrs=None, out="runs/sweep", target=None, depths=None, **shape_kwargs) -> list[SweepRun]:
    """Every (design, shape, lr) of the sweep, in a stable order."""
    from ..models.registry import DESIGNS
    from ..shapes import iso_width

    if not designs:
        raise ValueError("a sweep needs at least one design (`designs`)")
    if isinstance(designs, str):
        raise ValueError(f"`designs` must be a list of design names, got the string {designs!r}")
    for lr in lrs or ():
        if not _number(lr) or lr <= 0:
            raise ValueError(f"`lrs` entry {lr!r} must be a positive, finite learning rate")
    for L in depths or ():
        if not isinstance(L, int) or isinstance(L, bool) or L <= 0:
            raise ValueError(f"`depths` entry {L!r} must be a positive integer")
    if target is not None and (not _number(target) or target <= 0):
        raise ValueError(f"`target` must be a positive, finite parameter count, got {target!r}")
    if target is not None and not depths:
        raise ValueError("`target` needs `depths` (the depths whose iso-parameter widths are swept)")
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
    seen = set()
    for r in runs:
        if r.run_dir in seen:
            raise ValueError(f"run {Path(r.run_dir).name} appears twice: `designs`, `shapes`/`depths` and `lrs` must "
                             "not repeat an entry")
        seen.add(r.run_dir)
    return runs


def launch_command(recipe: str, run: SweepRun, overrides: list[str], launcher: str) -> str:
    return " ".join([launcher, "-m hf_depth.training.train", shlex.quote(recipe),
                     *(shlex.quote(o) for o in overrides + run.overrides())])


def _main(argv: list[str] | None = None) -> int:
    from ..errors import UserError, arg_number, read_json, read_yaml

    ap = command_parser("sweep", __doc__)
    ap.add_argument("recipe", help="a training recipe YAML, or a sweep YAML (with a `recipe:` field)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides applied to every run")
    ap.add_argument("--designs", nargs="+")
    ap.add_argument("--shapes", nargs="+", help="LxD shapes, e.g. 24x1024 32x896")
    ap.add_argument("--target", type=arg_number(float, 0, strict=True), help="parameter budget for iso-parameter widths")
    ap.add_argument("--depths", type=arg_number(int, 1), nargs="+")
    ap.add_argument("--lrs", type=arg_number(float, 0, strict=True), nargs="+")
    ap.add_argument("--out", help="sweep folder (default runs/sweep)")
    ap.add_argument("--print", dest="print_only", action="store_true", help="print launch commands, run nothing")
    ap.add_argument("--launcher", default="accelerate launch", help="prefix of the printed commands")
    a = ap.parse_intermixed_args(argv)  # overrides may come after options
    spec = {}
    text = read_yaml(a.recipe, "sweep or recipe YAML", expect=None)
    if isinstance(text, dict) and "recipe" in text:
        spec = text
        try:
            check_sweep_spec(spec)
        except ValueError as e:
            raise UserError(f"sweep file {a.recipe!r}: {e}") from None
    recipe = spec.get("recipe", a.recipe)
    overrides = list(spec.get("overrides") or []) + a.overrides
    shape_kwargs = {k: spec[k] for k in ("vocab_size", "num_attention_heads", "num_key_value_heads") if k in spec}
    runs = expand(a.designs or spec.get("designs"), a.shapes or spec.get("shapes"), a.lrs or spec.get("lrs"),
                  a.out or spec.get("out", "runs/sweep"), a.target or spec.get("target"),
                  a.depths or spec.get("depths"), **shape_kwargs)
    from .recipe import load_recipe

    recipes = []
    for r in runs:  # every run validated before any runs
        try:
            recipes.append(load_recipe(recipe, overrides + r.overrides()))
        except ValueError as e:
            raise UserError(f"run {Path(r.run_dir).name} (design {r.design}, shape {r.num_hidden_layers}x"
                            f"{r.hidden_size}, lr {r.lr:g}): {e}") from e
    if a.print_only:
        from ..diagnostics.cost import fit_line
        from .recipe import load_recipe, recipe_fit

        for r in runs:
            print(launch_command(recipe, r, overrides, a.launcher))
            try:
                fit = recipe_fit(load_recipe(recipe, overrides + r.overrides()))
            except ValueError as e:
                print(f"hf-depth sweep: {e}", file=sys.stderr)
                return 2
            # the fit check goes to stderr: stdout stays one launch command per line, for a scheduler
            print(f"#   fit check: {fit_line(Path(r.run_dir).name, fit)}", file=sys.stderr)
        return 0
    from .train import run

    status = {}
    for i, (r, rec) in enumerate(zip(runs, recipes)):
        summary_path = Path(r.run_dir) / "summary.json"
        if summary_path.exists() and read_json(summary_path, "run summary").get("status") in ("finished", "diverged"):
            print(f"[sweep {i + 1}/{len(runs)}] {r.run_dir}: done, skipped")
            continue
        print(f"[sweep {i + 1}/{len(runs)}] {r.run_dir}")
        resume = (Path(r.run_dir) / "checkpoints").exists()
        status[r.run_dir] = run(rec, resume=resume)["status"]
    print(json.dumps(status, indent=1))
    return 0


main = command(
    "sweep", _main, "exit 0 done, 2 bad input (one line naming the file or field, see ``hf_depth.errors``).")

if __name__ == "__main__":
    sys.exit(main())
