"""Run every diagnostic on one model and write ``DIR/report.json``, ``DIR/*.png`` and ``DIR/report.md``.

``headline(report)`` returns the numbers the model-card writer shows (R_causal, R_perm, the pruning curve).
"""

from __future__ import annotations

import json
import math
import pathlib
import time

from ..utils import write_text_atomic
from . import angular, causal, conventions, cost, logit_lens, paths, permutation, plots, pruning
from .adapters import adapter_for
from .common import as_batches, late_start, mean_loss, nan_to_none, num_layers

MEASUREMENTS = ("angular", "causal", "pruning", "permutation", "logit_lens", "paths", "cost")


def run_diagnostics(model, batches, measurements=MEASUREMENTS, flops_seq_len: int = 4096, measure_cost: bool = True,
                    measure_seq_len: int = 128, repeats: int = 3, show_progress: bool = True,
                   convention: str = conventions.DEFAULT) -> dict:
    """Every requested measurement; tensors are returned as nested lists (NaN -> None).

    ``convention`` (``"depthbench"``, default, or ``"branch"``): what skipping / swapping a layer and the measured
    state mean (``hf_depth.diagnostics.conventions``); ``depthbench`` gives numbers comparable with the paper."""
    conventions.check(convention)
    unknown = set(measurements) - set(MEASUREMENTS)
    if unknown:
        raise ValueError(f"`measurements` must be a subset of {list(MEASUREMENTS)}, got unknown {sorted(unknown)}")
    batches = as_batches(batches)
    model.eval()
    L = num_layers(model)
    cfg = model.config
    rep: dict = {
        "model": {
            "class": type(model).__name__,
            "family": adapter_for(model).family,
            "design": getattr(cfg, "design", None) or getattr(cfg, "model_type", None),
            "num_hidden_layers": L,
            "hidden_size": cfg.hidden_size,
        },
        "data": {"batches": len(batches), "sequences": sum(b.input_ids.shape[0] for b in batches),
                 "tokens": int(sum(int(b.attention_mask.sum()) for b in batches))},
        "late_start": late_start(L),
        "convention": convention,
        "timing_s": {},
    }
    t0 = time.perf_counter()

    def timed(name, fn):
        t = time.perf_counter()
        out = fn()
        rep["timing_s"][name] = time.perf_counter() - t
        return out

    base_loss = None
    if "angular" in measurements:
        D = timed("angular", lambda: angular.angular_distance(model, batches, show_progress, convention))
        rep["angular"] = {"matrix": nan_to_none(D), **angular.summary(D)}
    skip_loss = None
    if "causal" in measurements:
        c = timed("causal", lambda: causal.causal_scores(model, batches, show_progress, convention))
        base_loss, skip_loss = c["loss"], c["skip_loss"]
        rep["causal"] = {"scores": nan_to_none(c["scores"]), "threshold": causal.THRESHOLD,
                         "R_causal": causal.r_causal(c["scores"]),
                         **{k: c[k] for k in ("global_causal_score", "avg_effect_per_layer") if k in c}}
    if base_loss is None and ({"pruning", "permutation"} & set(measurements)):
        base_loss = timed("loss", lambda: mean_loss(model, batches))
    if base_loss is not None:
        rep["loss"] = base_loss
    if "pruning" in measurements:
        rep["pruning"] = timed("pruning", lambda: pruning.pruning_curve(
            model, batches, base_loss, skip_loss, show_progress, convention))
    if "permutation" in measurements:
        p = timed("permutation", lambda: permutation.permutation_scores(
            model, batches, base_loss, show_progress=show_progress, convention=convention))
        rep["permutation"] = {"scores": nan_to_none(p["scores"]), "threshold": permutation.THRESHOLD,
                              "R_perm": permutation.r_perm(p["scores"]),
                              **{k: p[k] for k in ("global_score_mean", "global_score_normalized",
                                                   "global_score_weighted", "layer_avg_scores")}}
    if "logit_lens" in measurements:
        rep["logit_lens"] = {"kl": timed("logit_lens", lambda: logit_lens.logit_lens_kl(model, batches, show_progress))}
    if "paths" in measurements:
        pw = timed("paths", lambda: paths.residual_paths(model, batches, show_progress=show_progress))
        rep["paths"] = None if pw is None else {k: nan_to_none(v) for k, v in pw.items()}
    if "cost" in measurements:
        rep["cost"] = timed("cost", lambda: cost.system_cost(
            model, flops_seq_len, measure=measure_cost, measure_seq_len=measure_seq_len, repeats=repeats))
    rep["timing_s"]["total"] = time.perf_counter() - t0
    return rep


def headline(report: dict) -> dict:
    """R_causal, R_perm, the pruning curve (and the loss) for the model card; only what was measured."""
    out = {}
    if "convention" in report:
        out["convention"] = report["convention"]
    if "loss" in report:
        out["loss"] = report["loss"]
    if "causal" in report:
        out["R_causal"] = report["causal"]["R_causal"]
        if "global_causal_score" in report["causal"]:
            out["global_causal_score"] = report["causal"]["global_causal_score"]
    if "permutation" in report:
        out["R_perm"] = report["permutation"]["R_perm"]
        if "global_score_weighted" in report["permutation"]:
            out["global_permutation_weighted"] = report["permutation"]["global_score_weighted"]
    if "pruning" in report:
        out["pruning_delta"] = report["pruning"]["delta"]
    if report.get("paths"):
        for k in ("erank_final", "dead_layers"):
            if k in report["paths"]:
                out[k] = report["paths"][k]
    return out


def _fmt(x, nd=4):
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return f"{x:.{nd}g}" if isinstance(x, float) else str(x)


def markdown(report: dict, images: dict[str, str]) -> str:
    m = report["model"]
    lines = [f"# Depth diagnostics: {m['class']} ({m['design']}, L={m['num_hidden_layers']}, d={m['hidden_size']})", ""]
    d = report["data"]
    lines += [f"Calibration: {d['sequences']} sequences, {d['tokens']} tokens. Late layers: l >= {report['late_start']}."
              f" Convention: {report.get('convention', 'branch')}.", ""]
    h = headline(report)
    lines += ["| number | value |", "|---|---|"]
    for k in ("loss", "R_causal", "R_perm", "global_causal_score", "global_permutation_weighted", "erank_final",
              "dead_layers"):
        if k in h:
            lines.append(f"| {k} | {_fmt(h[k])} |")
    if "cost" in report:
        f = report["cost"]["prefill_flops"]
        lines.append(f"| prefill FLOPs/seq (T={f['seq_len']}, DepthBench convention) | {f['depthbench']:.4g} |")
        lines.append(f"| prefill matmul FLOPs/seq (incl. LM head, full attention) | {f['total_matmul']:.4g} |")
        lines.append(f"| KV cache bytes/seq | {report['cost']['kv_cache_bytes']['total']} |")
        lines.append(f"| parameters | {report['cost']['parameters']['params']} |")
        meas = report["cost"].get("measured")
        if meas:
            for k in ("forward", "forward_backward", "generate"):
                lines.append(f"| {k} tokens/s ({meas['device']}) | {meas[k]['tokens_per_s']:.4g} |")
    if "pruning" in report:
        lines += ["", "Pruning (loss increase per removed layer): "
                  + ", ".join(_fmt(x, 3) for x in report["pruning"]["delta"])]
    if "logit_lens" in report:
        lines += ["", "LogitLens KL(p_final || p_l): " + ", ".join(_fmt(x, 3) for x in report["logit_lens"]["kl"])]
    lines += ["", "Timing (s): " + ", ".join(f"{k} {v:.2f}" for k, v in report["timing_s"].items()), ""]
    for name, img in images.items():
        lines += [f"![{name}]({pathlib.Path(img).name})", ""]
    return "\n".join(lines)


def write_report(report: dict, out_dir) -> dict[str, str]:
    """Write report.json, the plots and report.md into ``out_dir``; returns {name: path} of everything written."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    title = f"{report['model']['design']} L={report['model']['num_hidden_layers']}"
    images = {}
    if "angular" in report:
        images["angular"] = plots.angular_heatmap(report["angular"]["matrix"], out / "angular.png", f"angular, {title}")
    if "causal" in report:
        images["causal"] = plots.pair_map(report["causal"]["scores"], out / "causal.png", f"causal C(s, l), {title}",
                                          "later layer l", "skipped layer s", causal.THRESHOLD)
    if "permutation" in report:
        images["permutation"] = plots.pair_map(report["permutation"]["scores"], out / "permutation.png",
                                               f"permutation P, {title}", "layer", "layer", permutation.THRESHOLD)
    if "pruning" in report or "logit_lens" in report:
        images["pruning_logit_lens"] = plots.pruning_and_lens(
            report.get("pruning"), (report.get("logit_lens") or {}).get("kl"), out / "pruning_logit_lens.png", title)
    if report.get("paths"):
        images["paths"] = plots.path_weights(report["paths"], out / "paths.png")
    if {"angular", "causal", "permutation", "pruning"} & report.keys():
        images["overview"] = plots.overview(report, out / "overview.png")
    if "cost" in report:
        images["cost"] = plots.cost_bars(report["cost"], out / "cost.png")
    write_text_atomic(out / "report.json", json.dumps(nan_to_none(report), indent=1, allow_nan=False))
    write_text_atomic(out / "report.md", markdown(report, images))
    return {"report.json": str(out / "report.json"), "report.md": str(out / "report.md"), **images}

