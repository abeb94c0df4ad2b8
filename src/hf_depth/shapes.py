"""Exact parameter counts and the iso-parameter shape spectrum.

``count_params(config)`` is analytic (it never builds a model) and equals ``sum(p.numel())`` of the built
model for every registered design: the shared backbone is counted here, each design adds its own
``Design.extra_params``. ``iso_width(design, target, L)`` picks, for a parameter budget and a depth, the width
(a multiple of ``2 * heads`` so that head_dim is an even integer for RoPE) whose total is closest to the
budget, and refuses when no width lands within the tolerance (DepthBench: +-2.14%).

    python -m hf_depth.shapes --target 406e6 --depths 16 20 24 26 28 30 32 42 70
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from .models.configuration_depth import DepthConfig
from .models.norms import norm_param_count, projection_scales_param_count
from .models.registry import DESIGNS

DEPTHBENCH_DEPTHS = (16, 20, 24, 26, 28, 30, 32, 42, 70)
DEPTHBENCH_TOLERANCE = 0.0214
DEPTHBENCH_BACKBONE = dict(vocab_size=50280, num_attention_heads=16)


def backbone_params(config: DepthConfig) -> int:
    """Pre-LN parameter count of ``config``: embeddings, untied head, attention, SwiGLU, input norms, final norm."""
    d, f, V, L = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_hidden_layers
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    attn = d * q + 2 * d * kv + q * d
    if config.attention_bias or getattr(config, "qkv_bias", False):
        attn += q + 2 * kv + (d if config.attention_bias else 0)  # Qwen2's qkv_bias: none on o
    if getattr(config, "use_qk_norm", False):
        attn += 2 * config.head_dim  # the per-head q_norm / k_norm weights
    attn += projection_scales_param_count(config, {"q": (d, q), "k": (d, kv), "v": (d, kv)})
    mlp = 3 * d * f + projection_scales_param_count(config, {"gate": (d, f), "up": (d, f)})
    norms = 2 * norm_param_count(config, kind="rms")
    return 2 * V * d + L * (attn + mlp + norms) + norm_param_count(config, kind="rms", final=True)


def count_params(config: DepthConfig) -> int:
    """Exact total parameter count of the causal LM built from ``config`` (any registered design)."""
    design = DESIGNS[config.design]
    extra = design.extra_params(config) if design.extra_params is not None else 0
    return backbone_params(config) + extra


def make_config(design: str, hidden_size: int, num_hidden_layers: int, **kwargs) -> DepthConfig:
    if design not in DESIGNS:
        raise ValueError(f"`design` must be one of {sorted(DESIGNS)}, got {design!r}")
    fields = {**DEPTHBENCH_BACKBONE, **kwargs}
    return DESIGNS[design].config_class(hidden_size=hidden_size, num_hidden_layers=num_hidden_layers, **fields)


@dataclass(frozen=True)
class Shape:
    design: str
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    params: int
    target: int

    @property
    def aspect_ratio(self) -> float:
        return self.hidden_size / self.num_hidden_layers

    @property
    def deviation(self) -> float:
        return self.params / self.target - 1.0


def iso_width(
    design: str, target: float, num_hidden_layers: int, tolerance: float = DEPTHBENCH_TOLERANCE, **kwargs
) -> Shape:
    """The width whose total parameter count is closest to ``target`` at depth ``num_hidden_layers``.

    Widths are multiples of ``2 * num_attention_heads``. Raises ValueError if the best one is off by more than
    ``tolerance`` (relative), naming the closest widths found.
    """
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not math.isfinite(target) or target <= 0:
        raise ValueError(f"`target` must be a positive, finite parameter count, got {target!r}")
    if not isinstance(num_hidden_layers, int) or isinstance(num_hidden_layers, bool) or num_hidden_layers <= 0:
        raise ValueError(f"`num_hidden_layers` must be a positive integer, got {num_hidden_layers!r}")
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < math.inf:
        raise ValueError(f"`tolerance` must be a finite number >= 0 (relative), got {tolerance!r}")
    heads = kwargs.get("num_attention_heads", DEPTHBENCH_BACKBONE["num_attention_heads"])
    if not isinstance(heads, int) or isinstance(heads, bool) or heads <= 0:
        raise ValueError(f"`num_attention_heads` must be a positive integer, got {heads!r}")
    step = 2 * heads
    best, d = None, step
    while True:
        cfg = make_config(design, d, num_hidden_layers, **kwargs)
        n = count_params(cfg)
        if best is None or abs(n - target) < abs(best[1] - target):
            best = (cfg, n)
        if n > target:
            break
        d += step
    cfg, n = best
    shape = Shape(design, num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, n, int(target))
    if abs(shape.deviation) > tolerance:
        raise ValueError(
            f"no width within +-{tolerance:.2%} of {target:,.0f} parameters at num_hidden_layers={num_hidden_layers} "
            f"(closest: d={shape.hidden_size} with {n:,} = {shape.deviation:+.2%}); widen `tolerance` or change the depth"
        )
    return shape


def spectrum(design: str = "pre_ln", target: float = 406e6, depths=DEPTHBENCH_DEPTHS, **kwargs) -> list[Shape]:
    """The iso-parameter shape spectrum (DepthBench 400M: L=16,d=1216 ... L=70,d=640)."""
    return [iso_width(design, target, L, **kwargs) for L in depths]


def format_table(shapes: list[Shape]) -> str:
    rows = ["| design | L | d | d_ff | params | vs target | d/L |", "|---|---:|---:|---:|---:|---:|---:|"]
    for s in shapes:
        rows.append(
            f"| {s.design} | {s.num_hidden_layers} | {s.hidden_size} | {s.intermediate_size} | {s.params / 1e6:.1f}M "
            f"| {s.deviation:+.2%} | {s.aspect_ratio:.2f} |"
        )
    return "\n".join(rows)


def main(argv=None) -> None:
    from .errors import arg_number

    p = argparse.ArgumentParser(prog="hf-depth shapes", description="Iso-parameter shape spectrum")
    p.add_argument("--design", default="pre_ln", choices=sorted(DESIGNS))
    p.add_argument("--target", type=arg_number(float, 0, strict=True), default=406e6)
    p.add_argument("--depths", type=arg_number(int, 1), nargs="+", default=list(DEPTHBENCH_DEPTHS))
    p.add_argument("--tolerance", type=arg_number(float, 0), default=DEPTHBENCH_TOLERANCE)
    p.add_argument("--vocab-size", type=arg_number(int, 1), default=50280)
    p.add_argument("--heads", type=arg_number(int, 1), default=16)
    a = p.parse_args(argv)
    shapes = [
        iso_width(a.design, a.target, L, a.tolerance, vocab_size=a.vocab_size, num_attention_heads=a.heads)
        for L in a.depths
    ]
    print(format_table(shapes))


if __name__ == "__main__":
    main()
