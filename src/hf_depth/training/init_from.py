"""Continue training from a ``save_pretrained`` folder: ``model.init_from=PATH`` in a recipe.

The folder is an upcycled model (``hf-depth upcycle``'s output), a Pre-LN run's ``final/``, or a Llama / Mistral /
Qwen2 / Qwen3 folder. The run's config is the folder's decoder (``rms_norm_eps``, ``rope_theta``, biases, QK-norm,
its design fields when it is of the recipe's design; else ``hf_depth.upcycling.design_config`` with the
function-preserving fields), the recipe's ``model.fields`` on top. The recipe's shape fields must agree with the
folder (a mismatch is refused naming ``model.<field>``; ``null`` / unset takes the folder's); every weight of the
folder is loaded and a weight of another shape is refused naming the parameter. The parameters the folder lacks --
and those its ``upcycle.json`` lists as new -- are the *new* parameters, at the design's init, which
``optim.new_param_lr_mult`` and ``optim.warmup_new_params_only`` act on.

Before the first step and after the last, the run measures the depth diagnostics of the model on held-out
sequences and writes them to ``RUN/upcycle_diagnostics.json``; the run's model card (``RUN/final/README.md``, and
``hf-depth export``'s) shows them side by side.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

SHAPE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
DIAGNOSTICS = "upcycle_diagnostics.json"
DIAGNOSTIC_MEASUREMENTS = ("angular", "causal", "pruning", "permutation", "logit_lens")


def check_folder(path: str) -> None:
    p = Path(path)
    if not (p / "config.json").is_file() or not any((p / f).is_file() for f in WEIGHT_FILES):
        raise ValueError(f"`model.init_from` must be a save_pretrained folder (config.json and model.safetensors), "
                         f"got {path!r}")


def init_config(recipe, vocab_size: int):
    """(the run's config, notes) for ``recipe`` with ``model.init_from``."""
    from transformers import AutoConfig

    import hf_depth  # noqa: F401  (registers the hf_depth configs)

    from ..errors import reading_model
    from ..upcycling import design_config
    from .recipe import model_config

    m = recipe.model
    with reading_model(m.init_from):
        src = AutoConfig.from_pretrained(m.init_from)
    own = model_config(recipe, vocab_size)  # the recipe as written (validated)
    asked = {k: getattr(m, k) for k in SHAPE_FIELDS}
    asked["vocab_size"] = own.vocab_size
    cfg, preset, notes = design_config(src, m.design, {"max_position_embeddings": own.max_position_embeddings,
                                                        **m.fields})
    for key, value in asked.items():
        if value is not None and value != getattr(cfg, key):
            raise ValueError(f"`model.{key}` is {value} but the `model.init_from` folder has {getattr(cfg, key)}: set "
                             f"model.{key}={getattr(cfg, key)} (or leave it unset)")
    if m.scale_vector != cfg.scale_vector:
        raise ValueError(f"`model.scale_vector` is {m.scale_vector!r} but the `model.init_from` folder has "
                         f"{cfg.scale_vector!r}")
    if preset:
        notes.append("set so that the design computes the folder's function at init: "
                     + ", ".join(f"{k}={v!r}" for k, v in preset.items()))
    return cfg, notes


def load_init(model, path: str) -> tuple[list[str], list[str]]:
    """Load the folder's weights into ``model``: (names of the new parameters, notes). Refuses a weight of another
    shape or without a place, naming it."""
    from transformers import AutoModelForCausalLM

    from ..errors import reading_model
    from ..upcycling import carry_weights

    with reading_model(path):
        source = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    notes: list[str] = []
    try:
        _, missing = carry_weights(source, model, notes, what=f"the `model.init_from` folder {path!r}")
    except ValueError as e:
        raise ValueError(str(e).replace("cannot upcycle: ", "`model.init_from`: ")) from None
    params = dict(model.named_parameters())
    new = [k for k in missing if k in params]
    record = Path(path) / "upcycle.json"
    if record.is_file():  # an upcycled folder holds its new parameters at their init: still new
        new += [k for k in json.loads(record.read_text()).get("new_parameter_names", []) if k in params and k not in new]
    return new, notes


def diagnostics(model, val: torch.Tensor, max_sequences: int = 8) -> dict:
    """Headline depth diagnostics (``hf_depth.diagnostics.report.headline``) on the first held-out sequences."""
    from ..diagnostics.common import Batch
    from ..diagnostics.report import headline, run_diagnostics

    x = val[:max_sequences].to(next(model.parameters()).device)
    batches = [Batch(x[i:i + 4], torch.ones_like(x[i:i + 4])) for i in range(0, len(x), 4)]
    was = model.training
    rep = run_diagnostics(model, batches, measurements=DIAGNOSTIC_MEASUREMENTS, measure_cost=False,
                          show_progress=False)
    model.train(was)
    out = headline(rep)
    kl = rep["logit_lens"]["kl"]
    out["logit_lens_kl_mid"] = kl[len(kl) // 2]
    out["mean_angular_step"] = _mean_step(rep["angular"]["matrix"])
    return out


def _mean_step(matrix) -> float | None:
    """Mean angular distance between consecutive layer states (column 1 of the angular matrix)."""
    vals = [row[1] for row in matrix if len(row) > 1 and row[1] is not None]
    return sum(vals) / len(vals) if vals else None


ROWS = (("loss", "calibration loss"), ("R_causal", "R_causal"), ("R_perm", "R_perm"),
        ("global_causal_score", "global causal score"), ("global_permutation_weighted", "0.9^l-weighted permutation"),
        ("logit_lens_kl_mid", "LogitLens KL at L/2"), ("mean_angular_step", "mean angular step"))


def section(run_dir) -> str | None:
    """Markdown table of ``RUN/upcycle_diagnostics.json`` (before the first step | after the last)."""
    path = Path(run_dir) / DIAGNOSTICS
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    before, after = data.get("before") or {}, data.get("after") or {}

    def cell(d, k):
        v = d.get(k)
        return f"{v:.4f}" if isinstance(v, (int, float)) and math.isfinite(v) else "n/a"

    rows = [f"Started from `{data.get('init_from')}` ({data.get('new_parameters', 0):,} new parameters at the "
            f"design's init; {data.get('steps', '?')} steps).", "",
            "| measure | before | after |", "|---|---|---|"]
    rows += [f"| {label} | {cell(before, k)} | {cell(after, k)} |" for k, label in ROWS if k in before or k in after]
    for k, label in (("pruning_delta", "loss increase when layer l is pruned"),):
        if before.get(k) is not None or after.get(k) is not None:
            fmt = lambda v: ", ".join(f"{x:+.3f}" for x in v) if v else "n/a"  # noqa: E731
            rows.append(f"| {label} | {fmt(before.get(k))} | {fmt(after.get(k))} |")
    rows += ["", f"On {data.get('sequences', '?')} held-out sequences, DepthBench's conventions (`hf-depth diagnose`); "
             "n/a: not measurable at this depth (R_causal, R_perm count late-layer pairs)."]
    return "\n".join(rows)
