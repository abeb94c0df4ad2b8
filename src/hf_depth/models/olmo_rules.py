"""DepthBench / OLMo-core name rules: the pieces a design's ``Design(olmo=OlmoRules(...))`` is built from.

A design declares, in its own file, how its parameters are named in a DepthBench (OLMo-core) checkpoint: which
block type it is, the per-block and model-level key rules, the config fields DepthBench's forward implies, the
values it refuses to guess and the checkpoint aliases it folds. ``hf_depth.olmo_core`` applies them; the full key
tables are in ``docs/olmo_core.md``. Only torch is needed here (this file travels with remote-code folders).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class Rule:
    """``olmo`` keys <-> ``hf`` keys, with the layout change both ways (identity when ``None``)."""

    olmo: tuple[str, ...]
    hf: tuple[str, ...]
    to_hf: Callable | None = None  # list[Tensor] (olmo order) -> list[Tensor] (hf order)
    to_olmo: Callable | None = None
    optional: bool = False  # may be absent from the OLMo-core side (e.g. a LayerNorm saved without bias)
    fill: Callable | None = None  # builds the hf tensors when an optional source is absent


def one(olmo: str, hf: str, **kw) -> Rule:
    return Rule((olmo,), (hf,), **kw)


def linear(olmo: str, hf: str, bias: bool) -> list[Rule]:
    rules = [one(f"{olmo}.weight", f"{hf}.weight")]
    if bias:
        rules.append(one(f"{olmo}.bias", f"{hf}.bias"))
    return rules


def norm(olmo: str, hf: str, config, layer_norm: bool = False) -> list[Rule]:
    """A norm's scale (and bias for LayerNorm); nothing when the design has no learnable scale."""
    if "none" in config.scale_vector_parts:
        return []
    rules = [one(f"{olmo}.weight", f"{hf}.weight")]
    if layer_norm:
        rules.append(one(f"{olmo}.bias", f"{hf}.bias", optional=True, fill=lambda: [torch.zeros(config.hidden_size)]))
    return rules


def _split_rows(*sizes):
    return lambda ts: list(torch.split(ts[0], list(sizes), dim=0))


def _cat_rows(ts):
    return [torch.cat(ts, dim=0)]


def attention(config, prefix: str, hf: str, fused_qkv: bool) -> list[Rule]:
    """OLMo-core attention ``w_q/w_k/w_v/w_out`` (or FusedAttention ``w_qkv``, rows [q | k | v]) <-> Llama names."""
    h, kv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    bias = bool(config.attention_bias)
    rules = []
    if fused_qkv:
        for n in ("weight", "bias") if bias else ("weight",):
            rules.append(Rule((f"{prefix}.w_qkv.{n}",), tuple(f"{hf}.{p}_proj.{n}" for p in "qkv"),
                              to_hf=_split_rows(h * hd, kv * hd, kv * hd), to_olmo=_cat_rows))
    else:
        for o, p in (("w_q", "q"), ("w_k", "k"), ("w_v", "v")):
            rules += linear(f"{prefix}.{o}", f"{hf}.{p}_proj", bias)
    return rules + linear(f"{prefix}.w_out", f"{hf}.o_proj", bias)


def ffn(prefix: str, hf: str) -> list[Rule]:
    return [one(f"{prefix}.w1.weight", f"{hf}.gate_proj.weight"), one(f"{prefix}.w3.weight", f"{hf}.up_proj.weight"),
            one(f"{prefix}.w2.weight", f"{hf}.down_proj.weight")]


def pre_norms(config, i: int) -> list[Rule]:
    """The two input norms of block ``i`` (``attention_norm`` / ``feed_forward_norm``)."""
    L = f"model.layers.{i}"
    return (norm(f"blocks.{i}.attention_norm", f"{L}.input_layernorm", config)
            + norm(f"blocks.{i}.feed_forward_norm", f"{L}.post_attention_layernorm", config))


def norms_layer(pairs: dict[str, str], inputs: bool = True, layer_norm: Callable | None = None,
                absent: Callable | None = None) -> Callable:
    """A ``layer`` rule function: (the input norms, then) ``blocks.i.{olmo}`` -> ``model.layers.i.{hf}`` for each
    ``pairs`` item; ``layer_norm(config)``: whether they are LayerNorms (with bias); ``absent(i, olmo)``: a norm
    block ``i`` does not have."""

    def layer(config, i: int, options: dict) -> list[Rule]:
        ln = bool(layer_norm(config)) if layer_norm is not None else False
        rules = pre_norms(config, i) if inputs else []
        for olmo, hf in pairs.items():
            if absent is None or not absent(i, olmo):
                rules += norm(f"blocks.{i}.{olmo}", f"model.layers.{i}.{hf}", config, layer_norm=ln)
        return rules

    return layer


@dataclass(frozen=True)
class OlmoRules:
    """How one hf_depth design reads and writes a DepthBench / OLMo-core checkpoint (the ``Design.olmo`` slot)."""

    #: DepthBench ``TransformerBlockType`` of this design (``default``, ``peri_norm``, ...)
    block_type: str
    #: extra per-block rules beyond the branches: ``fn(config, i, options) -> list[Rule]`` (default: input norms)
    layer: Callable = lambda config, i, options: pre_norms(config, i)
    #: model-level rules beyond embeddings / LM head / final norm: ``fn(config, options) -> list[Rule]``
    model: Callable | None = None
    #: the block's attention / FFN module paths (MoDA wraps them one level deeper)
    attention: str = "attention"
    feed_forward: str = "feed_forward"
    #: for a block type shared by several designs: ``fn(fields) -> bool``, whether ``fields`` select this one
    selects: Callable | None = None
    #: given config fields this design ignores (Full AttnRes: ``attnres_block_size``)
    ignores: tuple[str, ...] = ()
    #: config fields set unless given, so the model computes DepthBench's forward: ``fn(sd, backend) -> dict``
    defaults: Callable | None = None
    #: config fields read from tensor shapes beyond the shared ones: ``fn(sd) -> dict`` (HC streams)
    infer: Callable | None = None
    #: design fields read from the block of OLMo-core's config JSON: ``fn(block: dict) -> dict``
    json_fields: Callable | None = None
    #: hf_depth fields that express DepthBench's forward (recorded in a converted model's card)
    forward_fields: tuple[str, ...] = ()
    #: logit-changing values no tensor shape tells, never guessed: {field: hint shown when it is missing}
    required: dict[str, str] = field(default_factory=dict)
    #: fold checkpoint aliases / buffers into the canonical keys: ``fn(sd) -> (sd, [inconsistency, ...])``
    fold: Callable | None = None
    #: the aliases an OLMo-core ``state_dict()`` also holds: ``fn(sd) -> {alias: tensor}`` (written on request)
    aliases: Callable | None = None
    #: parameter layouts of this block type (mHC's backends; the first is the default) and their detection
    backends: tuple[str, ...] = ()
    detect_backend: Callable | None = None
    #: what a converted model's record says beyond the block type: ``fn(config, backend) -> dict``
    record: Callable | None = None

    def rules(self, config, i: int, options: dict) -> list[Rule]:
        """Every rule of block ``i``: attention, FFN and the design's own."""
        L, b = f"model.layers.{i}", f"blocks.{i}"
        return (attention(config, f"{b}.{self.attention}", f"{L}.self_attn", options["fused_qkv"])
                + ffn(f"{b}.{self.feed_forward}", f"{L}.mlp") + self.layer(config, i, options))


def fold_aliases(sd: dict, patterns) -> tuple[dict, list[str]]:
    """Fold keys matching ``patterns`` (``(regex, canonical format)``) into their canonical keys, checked equal."""
    out, bad = {}, []
    for k, v in sd.items():
        canon = next((fmt.format(*m.groups()) for pat, fmt in patterns if (m := re.match(pat, k))), None)
        if canon is None:
            out[k] = v
        elif canon in sd and not torch.equal(sd[canon], v):
            bad.append(f"{k} != {canon}")
        elif canon not in sd:
            out[canon] = v
    return out, bad
