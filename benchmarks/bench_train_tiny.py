"""Training throughput of the tiny CPU recipe, per design, measured in one run (ratios vs Pre-LN).

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_train_tiny.py --designs pre_ln lns --steps 30

Each design trains ``--steps`` steps of recipes/train/tiny_cpu.yaml (same data, seed and shape); the first
5 steps are not timed; the figure is the median tokens/s over 5-step windows. Designs are interleaved ``--rounds`` times so that machine load hits them alike.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np  # noqa: E402

from hf_depth.training.recipe import load_recipe  # noqa: E402
from hf_depth.training.train import run  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="recipes/train/tiny_cpu.yaml")
    ap.add_argument("--designs", nargs="+", default=["pre_ln", "hc", "attnres"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    tps = {d: [] for d in a.designs}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(a.rounds):
            for d in a.designs:
                r = load_recipe(a.recipe, [f"model.design={d}", f"train.max_steps={a.steps}", "train.progress=false",
                                           "train.log_every=5", f"train.eval_every={10 * a.steps}",
                                           f"train.save_every={10 * a.steps}", f"run_dir={tmp}/{d}_{rnd}"])
                s = run(r)
                rows = [json.loads(x) for x in (Path(tmp) / f"{d}_{rnd}" / "metrics.jsonl").read_text().splitlines()]
                windows = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r][1:]  # 5-step windows, first dropped
                tps[d].append(float(np.median(windows)))
                print(f"round {rnd} {d}: {tps[d][-1]:,.0f} tok/s (median of {len(windows)} windows of 5 steps), "
                      f"loss {s['final_loss']:.3f}", flush=True)
    base = max(tps["pre_ln"]) if "pre_ln" in tps else None
    print("| design | tokens/s (best round) | vs pre_ln |\n|---|---:|---:|")
    for d, v in tps.items():
        print(f"| {d} | {max(v):,.0f} | {max(v) / base:.2f}x |" if base else f"| {d} | {max(v):,.0f} | - |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
