"""Sweeps expand into runs; results collect them into the table, the plot and scaling fits."""

import csv

import numpy as np
import pytest
import yaml
from training_helpers import hf_depth_cache, tiny_recipe, write_corpus  # noqa: F401

from hf_depth.training import results, sweep


def test_expand_grid_and_validation():
    runs = sweep.expand(["pre_ln", "lns"], shapes=["2x32", "4x32"], out="o")
    assert len([r for r in runs if r.design == "pre_ln"]) == 2 * 4  # DepthBench grid {5e-4, 1e-3, 2e-3, 5e-3}
    assert max(r.lr for r in runs if r.design == "lns") == 2e-2  # LNS goes up to 2e-2
    iso = sweep.expand(["pre_ln"], target=406e6, depths=[16, 70], lrs=[2e-3])
    assert [(r.num_hidden_layers, r.hidden_size) for r in iso] == [(16, 1216), (70, 640)]
    with pytest.raises(ValueError, match="not a registered design.*pre_ln"):
        sweep.expand(["resnet"], shapes=["2x32"])
    with pytest.raises(ValueError, match="LxD"):
        sweep.expand(["pre_ln"], shapes=["deep"])


def test_print_mode_gives_launch_commands(capsys):
    assert sweep.main(["recipes/train/tiny_cpu.yaml", "--designs", "pre_ln", "--shapes", "2x32", "--lrs", "1e-3",
                       "--out", "x", "--print", "train.max_steps=3"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["accelerate launch -m hf_depth.training.train recipes/train/tiny_cpu.yaml train.max_steps=3 model.design=pre_ln "
                   "model.num_hidden_layers=2 model.hidden_size=32 optim.lr=0.001 run_dir=x/pre_ln_L2_d32_lr0.001 "
                   "name=pre_ln_L2_d32_lr0.001"]


def test_tiny_sweep_then_results(tmp_path, capsys):
    files = write_corpus(tmp_path)
    recipe = tiny_recipe(tmp_path, files, train={"max_steps": 4, "eval_every": 4, "save_every": 4})
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = tmp_path / "sweep"
    args = [str(path), "--designs", "pre_ln", "lns", "--shapes", "2x32", "3x32", "--lrs", "1e-3", "5e-3",
            "--out", str(out)]
    assert sweep.main(args) == 0
    assert len(list(out.glob("*/summary.json"))) == 8
    assert sweep.main(args) == 0 and capsys.readouterr().out.count("done, skipped") == 8
    assert results.main([str(out)]) == 0
    rows = list(csv.DictReader(open(out / "results" / "best.csv")))
    assert sorted((r["design"], r["L"]) for r in rows) == [("lns", "2"), ("lns", "3"), ("pre_ln", "2"), ("pre_ln", "3")]
    every = results.collect(out)
    for r in rows:  # the best learning rate is kept
        same = [s["best_val_loss"] for s in every if s["design"] == r["design"] and s["num_hidden_layers"] == int(r["L"])]
        assert float(r["val_loss"]) == pytest.approx(min(same), abs=1e-4) and r["lrs_tried"] == "2"
    assert (out / "results" / "best.md").read_text().startswith("| design | L | d |")
    png = (out / "results" / "val_loss_vs_aspect_ratio.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_scaling_law_fit_and_compute_efficiency():
    n = np.array([50e6, 100e6, 200e6, 400e6, 800e6])
    a, alpha, c = 400.0, 0.34, 1.8
    fit = results.fit_scaling_law(n, a * n**-alpha + c)
    assert fit["alpha"] == pytest.approx(alpha, rel=1e-3) and fit["c"] == pytest.approx(c, abs=1e-3)
    better = results.fit_scaling_law(n, a * (1.3 * n) ** -alpha + c)  # 1.3x "effective parameters"
    C = 6 * n * 20 * n / results.PFLOPS_DAY  # compute of the same points (PFLOP/s-days); design b at 1.3^2 x less
    fit_c, better_c = results.fit_scaling_law(C, a * n**-alpha + c), results.fit_scaling_law(C / 1.69, a * n**-alpha + c)
    eff = results.compute_efficiency(fit_c, better_c, 2.5, fit, better)
    assert eff["param_ratio"] == pytest.approx(1.3, rel=1e-3) and eff["compute_ratio"] == pytest.approx(1.69, rel=2e-3)
    with pytest.raises(ValueError, match="at least 3 model sizes"):
        results.fit_scaling_law([1e6, 2e6], [3.0, 2.9])
