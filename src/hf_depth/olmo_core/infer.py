"""Which hf_depth design and config an OLMo-core / DepthBench checkpoint is: block type, shapes, config JSON.

Every design-specific answer comes from the design's own ``Design.olmo`` (:class:`~hf_depth.models.olmo_rules.
OlmoRules`); nothing here names a design.
"""

from __future__ import annotations

import re

from ..models.registry import DESIGNS

TOKENIZER = {"vocab_size": 50280, "eos_token_id": 50279, "pad_token_id": 1}
OLMO_CORE_NORM_EPS = 1e-5  # olmo_core.nn.layer_norm: the eps of a norm built without one

#: values that change the logits and that no tensor shape tells: never guessed (config.json or given)
REQUIRED = {
    "num_attention_heads": "attention heads (config: model.block.sequence_mixer.n_heads)",
    "rope_theta": "RoPE theta (model.block.sequence_mixer.rope.theta; OLMo-core's default is 500000)",
    "rms_norm_eps": "block norm eps (model.block.layer_norm.eps)",
}


def convertible() -> dict:
    """{hf_depth design: its OLMo-core rules} of every registered design that declares them."""
    return {name: d.olmo for name, d in DESIGNS.items() if d.olmo is not None}


def block_types() -> dict[str, str]:
    """DepthBench ``TransformerBlockType`` -> hf_depth design (for a shared block type, the one ``{}`` selects)."""
    out: dict[str, str] = {}
    for name, rules in convertible().items():
        if rules.selects is None or rules.selects({}):
            out.setdefault(rules.block_type, name)
    return out


def olmo_rules(design: str):
    """The OLMo-core rules of hf_depth design ``design``; refused, naming the convertible designs, if it has none."""
    rules = convertible().get(design)
    if rules is None:
        raise ValueError(f"`design` {design!r} has no OLMo-core table; allowed: {sorted(convertible())}")
    return rules


def _design_name(design: str, fields: dict | None = None) -> str:
    """hf_depth design of a DepthBench block type (the one whose rules ``select`` the given fields, e.g.
    ``attnres`` with ``attnres_block_size`` S > 1 is Block AttnRes), or an hf_depth design name as is."""
    fields = fields or {}
    named = [n for n, r in convertible().items() if r.block_type == design]
    if named:
        return next((n for n in named if convertible()[n].selects is None or convertible()[n].selects(fields)),
                    named[0])
    if design in DESIGNS:
        return design
    raise ValueError(
        f"`design` must be a DepthBench block type {list(block_types())} or an hf_depth design {sorted(DESIGNS)}, "
        f"got {design!r}"
    )


def _fields_of(cls) -> set[str]:
    names = set()
    for c in cls.__mro__:
        names |= set(getattr(c, "__annotations__", {}))
    return names


def all_backends() -> tuple[str, ...]:
    return tuple(b for r in convertible().values() for b in r.backends)


def resolve_backend(rules, given: str | None, sd: dict | None) -> str | None:
    """The parameter layout of a design with several (mHC): given, else detected from the keys, else the first."""
    allowed = rules.backends or all_backends()
    if given is not None and given not in allowed:
        raise ValueError(f"`mhc_backend` must be one of {list(allowed)}, got {given!r}")
    if given is not None or not rules.backends:
        return given
    detected = rules.detect_backend(sd) if rules.detect_backend is not None and sd is not None else None
    return detected or rules.backends[0]


def infer_fields(sd: dict, design: str, given: dict) -> dict:
    """Config fields readable from tensor shapes (vocab, width, depth, FFN, KV heads; the design's own, e.g. HC
    streams)."""
    rules = convertible().get(design)
    attn, ffn = (rules.attention, rules.feed_forward) if rules is not None else ("attention", "feed_forward")
    f: dict = {}
    emb = sd.get("embeddings.weight")
    if emb is None:
        raise ValueError("cannot convert: missing keys ['embeddings.weight']")
    f["vocab_size"], f["hidden_size"] = int(emb.shape[0]), int(emb.shape[1])
    layers = {int(m.group(1)) for k in sd if (m := re.match(r"^blocks\.(\d+)\.", k))}
    if layers:
        f["num_hidden_layers"] = max(layers) + 1
    if f"blocks.0.{ffn}.w1.weight" in sd:
        f["intermediate_size"] = int(sd[f"blocks.0.{ffn}.w1.weight"].shape[0])
    heads = given.get("num_attention_heads", 16)
    f["num_attention_heads"] = heads
    hd = given.get("head_dim")
    if f"blocks.0.{attn}.w_q.weight" in sd and hd is None:
        hd = int(sd[f"blocks.0.{attn}.w_q.weight"].shape[0]) // heads
    if f"blocks.0.{attn}.w_k.weight" in sd and hd:
        f["num_key_value_heads"] = int(sd[f"blocks.0.{attn}.w_k.weight"].shape[0]) // hd
    if hd and hd != f["hidden_size"] // heads:
        f["head_dim"] = hd
    if any(k.endswith("attention.w_q.bias") or k.endswith("attention.w_qkv.bias") for k in sd):
        f["attention_bias"] = True
    if rules is not None and rules.infer is not None:
        f.update(rules.infer(sd))
    return f


def missing_required(design: str, fields: dict) -> list[str]:
    """The logit-changing fields (:data:`REQUIRED`, plus the design's own, e.g. the HC version) absent from
    ``fields``."""
    rules = convertible().get(_design_name(design, fields))
    own = rules.required if rules is not None else {}
    return [k for k in (*REQUIRED, *own) if fields.get(k) is None]


def refuse_to_guess(design: str, fields: dict, how: str = "keyword arguments") -> None:
    """Raise one ``ValueError`` line naming every logit-changing value not given."""
    names = missing_required(design, fields)
    if names:
        rules = convertible().get(_design_name(design, fields))
        hints = [hint for k, hint in (rules.required.items() if rules is not None else ()) if k in names]
        raise ValueError(
            f"refusing to guess {', '.join(names)} (they change the logits and no tensor shape tells them): give "
            f"them as {how} or pass OLMo-core's config.json" + "".join(f"; {h}" for h in hints)
        )


def build_config(design: str, sd: dict, mhc_backend: str | None = None, **fields):
    """The hf_depth config of an OLMo-core state dict: shapes first, then the design's DepthBench defaults, then
    ``fields`` (which win)."""
    design = _design_name(design, fields)
    rules = olmo_rules(design)
    fields = {k: v for k, v in fields.items() if k not in rules.ignores}
    if rules.defaults is not None:
        fields = {**rules.defaults(sd, resolve_backend(rules, mhc_backend, sd)), **fields}
    cls = DESIGNS[design].config_class
    merged = {**infer_fields(sd, design, fields), **fields}
    known = _fields_of(cls)
    unknown = sorted(k for k in merged if k not in known)
    if unknown:
        raise ValueError(f"unknown config fields for design {design!r}: {unknown}; allowed: {sorted(known)}")
    return cls(**merged)


def _olmo_json_fields(cfg: dict, design: str | None = None) -> tuple[str | None, dict]:
    """(block type, hf_depth fields) from an OLMo-core experiment/model config JSON (lenient); the design fields
    are read by the rules of ``design`` (default: the JSON's block name)."""
    model = cfg.get("model", cfg)
    block = model.get("block", {}) or {}
    attn = block.get("sequence_mixer") or block.get("attention") or {}
    fields: dict = {}
    for src, dst in (("d_model", "hidden_size"), ("n_layers", "num_hidden_layers"), ("vocab_size", "vocab_size")):
        if model.get(src) is not None:
            fields[dst] = model[src]
    for src, dst in (("n_heads", "num_attention_heads"), ("n_kv_heads", "num_key_value_heads"),
                     ("head_dim", "head_dim")):
        if attn.get(src) is not None:
            fields[dst] = attn[src]
    if attn.get("bias") is not None:
        fields["attention_bias"] = bool(attn["bias"])
    rope = attn.get("rope") or {}
    if rope.get("theta") is not None:
        fields["rope_theta"] = float(rope["theta"])
    ln = block.get("layer_norm") or {}
    if "eps" in ln:  # a saved ``eps: null`` is OLMo-core's module default
        fields["rms_norm_eps"] = OLMO_CORE_NORM_EPS if ln["eps"] is None else float(ln["eps"])
    ff = block.get("feed_forward") or {}
    if ff.get("hidden_size") is not None:
        fields["intermediate_size"] = ff["hidden_size"]
    name = block.get("name")
    which = design or name
    for n, rules in convertible().items():  # the design's own fields (a shared block type: every candidate's)
        if rules.json_fields is not None and which in (rules.block_type, n):
            fields.update(rules.json_fields(block))
    return name, fields
