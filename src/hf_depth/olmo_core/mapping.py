"""OLMo-core / DepthBench state dict <-> hf_depth state dict and model, by the designs' own name rules."""

from __future__ import annotations

import torch

from ..models.olmo_rules import Rule, norm, one
from ..models.registry import DESIGNS, MODEL_CLASSES
from .checkpoints import strip_prefixes
from .infer import REQUIRED, _fields_of, build_config, olmo_rules, refuse_to_guess, resolve_backend


def _options(config, sd: dict | None, mhc_backend: str | None, fused_qkv: bool | None,
             sinkhorn_tau: float = 1.0) -> dict:
    if fused_qkv is None:
        fused_qkv = sd is not None and any(k.endswith("attention.w_qkv.weight") for k in sd)
    backend = resolve_backend(olmo_rules(config.design), mhc_backend, sd)
    return {"fused_qkv": bool(fused_qkv), "backend": backend, "sinkhorn_tau": float(sinkhorn_tau)}


def _check_keys(what: str, have, needed, known=None) -> None:
    """Refuse, naming them, the ``needed`` keys not in ``have`` and the keys of ``have`` not in ``known``."""
    missing, unexpected = set(needed) - set(have), set(have) - set(needed if known is None else known)
    parts = []
    if missing:
        parts.append(f"missing keys ({len(missing)}): {sorted(missing)[:12]}")
    if unexpected:
        parts.append(f"unmapped keys ({len(unexpected)}): {sorted(unexpected)[:12]}")
    if parts:
        raise ValueError(f"cannot convert {what}: " + "; ".join(parts) + " (no weight is dropped or invented)")


def _final_norm(config) -> list[Rule]:
    kind = getattr(config, "final_norm_kind", None) or getattr(config, "norm_kind", "rms")
    if kind != "layer":
        return norm("lm_head.norm", "model.norm", config)
    # a final LayerNorm must come with its bias: without one the checkpoint's final norm is an RMSNorm
    return [one("lm_head.norm.weight", "model.norm.weight"), one("lm_head.norm.bias", "model.norm.bias")]


def rules_for(config, options: dict) -> list[Rule]:
    """Every mapping rule of a model of ``config`` (its design's ``Design.olmo`` rules, all blocks)."""
    rules_of = olmo_rules(config.design)
    rules = [one("embeddings.weight", "model.embed_tokens.weight"), one("lm_head.w_out.weight", "lm_head.weight")]
    rules += _final_norm(config)
    for i in range(config.num_hidden_layers):
        rules += rules_of.rules(config, i, options)
    if rules_of.model is not None:
        rules += rules_of.model(config, options)
    return rules


def _resolve_aliases(sd: dict, design: str) -> dict:
    """Fold the design's checkpoint aliases / buffers into canonical keys (HC branch aliases, LNS scale buffers)."""
    fold = olmo_rules(design).fold
    if fold is None:
        return sd
    out, bad = fold(sd)
    if bad:
        raise ValueError(f"inconsistent OLMo-core checkpoint: {bad[:8]}")
    return out


def olmo_core_to_hf_state_dict(sd: dict, config, *, mhc_backend: str | None = None, fused_qkv: bool | None = None,
                               sinkhorn_tau: float = 1.0):
    """Map an OLMo-core state dict to hf_depth names for ``config`` (refuses unmapped or missing keys)."""
    sd = _resolve_aliases(strip_prefixes(dict(sd)), config.design)
    rules = rules_for(config, _options(config, sd, mhc_backend, fused_qkv, sinkhorn_tau))
    _check_keys(f"an OLMo-core {config.design!r} checkpoint", sd, {k for r in rules if not r.optional for k in r.olmo},
                {k for r in rules for k in r.olmo})
    out = {}
    for r in rules:
        if any(k not in sd for k in r.olmo):
            tensors = r.fill()
        else:
            src = [sd[k] for k in r.olmo]
            tensors = r.to_hf(src) if r.to_hf else src
        out.update(zip(r.hf, tensors))
    return out


def olmo_core_to_hf_depth(state_dict: dict, design: str, *, mhc_backend: str | None = None,
                          fused_qkv: bool | None = None, sinkhorn_tau: float = 1.0, dtype: torch.dtype | None = None,
                          **config_fields):
    """Build the hf_depth causal LM of an OLMo-core / DepthBench state dict.

    ``design`` is a DepthBench block type (``default``, ``peri_norm``, ...) or an hf_depth design name;
    ``config_fields`` are hf_depth config fields (heads, RoPE theta, design fields); shapes supply the rest.
    ``mhc_backend`` (``liger_mhc`` / ``mhc`` / ``mhc_static``) and ``fused_qkv`` are detected from the keys;
    ``sinkhorn_tau`` is DepthBench's ``mhc_static`` Sinkhorn temperature (1.0 unless configured).
    """
    refuse_to_guess(design, config_fields)
    stripped = strip_prefixes(dict(state_dict))
    config = build_config(design, stripped, mhc_backend=mhc_backend, **config_fields)
    hf_sd = olmo_core_to_hf_state_dict(stripped, config, mhc_backend=mhc_backend, fused_qkv=fused_qkv,
                                       sinkhorn_tau=sinkhorn_tau)
    from transformers.initialization import no_init_weights

    target = dtype or next(iter(hf_sd.values())).dtype
    target = target if target.is_floating_point else torch.float32
    previous = torch.get_default_dtype()
    try:  # built directly in the target dtype, without the random init: every parameter is loaded below
        torch.set_default_dtype(target)
        with no_init_weights():
            model = MODEL_CLASSES[config.design][1](config)
    finally:
        torch.set_default_dtype(previous)
    ref = model.state_dict()
    # a table out of step with the design: say so, never load partially
    _check_keys(f"into hf_depth {config.design!r} (table vs model)", hf_sd, ref)
    for k, v in hf_sd.items():
        if tuple(v.shape) != tuple(ref[k].shape):
            raise ValueError(f"shape mismatch for {k}: checkpoint {tuple(v.shape)} vs model {tuple(ref[k].shape)}")
    model.load_state_dict({k: v.to(ref[k].dtype) for k, v in hf_sd.items()}, strict=True)
    model.config.dtype = target  # parameters are already in `target`; fp32 buffers (RoPE inv_freq) stay fp32
    gc = model.generation_config
    gc.eos_token_id, gc.pad_token_id = config.eos_token_id, config.pad_token_id
    model.olmo_core_source = source_record(design, config, stripped, mhc_backend)
    return model.eval()


def forward_fields() -> tuple[str, ...]:
    """Every hf_depth field that some design sets to express DepthBench's forward (recorded in model cards)."""
    out: dict[str, None] = {}
    for d in DESIGNS.values():
        if d.olmo is not None:
            out.update(dict.fromkeys((*d.olmo.required, *d.olmo.forward_fields)))
    return tuple(out)


def source_record(block: str, config, sd: dict | None = None, mhc_backend: str | None = None) -> dict:
    """What a converted model came from and which hf_depth fields make it compute that forward."""
    rules = olmo_rules(config.design)
    rec = {"format": "OLMo-core / DepthBench (keyu-wang-2002/DepthBench)", "block_type": block,
           "hf_depth_design": config.design}
    if rules.record is not None:
        rec.update(rules.record(config, resolve_backend(rules, mhc_backend, sd)))
    known = _fields_of(type(config))
    rec["fields"] = {k: getattr(config, k) for k in (*REQUIRED, *rules.required, *rules.forward_fields) if k in known}
    return rec


def hf_depth_to_olmo_core(model, *, mhc_backend: str = "liger_mhc", fused_qkv: bool = False,
                          hc_branch_aliases: bool = False, sinkhorn_tau: float = 1.0) -> dict:
    """The OLMo-core / DepthBench state dict of an hf_depth model (inverse of :func:`olmo_core_to_hf_depth`).

    ``hc_branch_aliases=True`` also writes the duplicated aliases that an OLMo-core model's ``state_dict()``
    contains (HC / mHC: ``*_hyper_connection.branch.*``).
    """
    config = model.config
    sd = model.state_dict()
    rules_of = olmo_rules(config.design)
    rules = rules_for(config, _options(config, None, mhc_backend, fused_qkv, sinkhorn_tau))
    _check_keys(f"hf_depth {config.design!r} -> OLMo-core", sd, {k for r in rules for k in r.hf})
    out = {}
    for r in rules:
        src = [sd[k] for k in r.hf]
        out.update(zip(r.olmo, [t.clone() for t in (r.to_olmo(src) if r.to_olmo else src)]))
    if hc_branch_aliases and rules_of.aliases is not None:
        out.update(rules_of.aliases(out))
    return out
