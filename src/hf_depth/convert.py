"""Converters between ``transformers.LlamaForCausalLM`` and hf_depth's Pre-LN.

Pre-LN uses Llama's module names, so the state dicts map one to one; what needs converting is the config
(Llama keeps RoPE in ``rope_parameters``; hf_depth requires untied embeddings and no MLP bias).
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from .models.design_pre_ln import DESIGN as PRE_LN

# Fields with the same name and meaning in LlamaConfig and DepthConfig.
SHARED_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "initializer_range",
    "attention_bias", "attention_dropout", "pad_token_id", "bos_token_id", "eos_token_id",
)  # fmt: skip


def llama_config_to_pre_ln(config: LlamaConfig, **overrides):
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"`rope_parameters.rope_type` must be 'default' to convert, got {rope.get('rope_type')!r}")
    if getattr(config, "tie_word_embeddings", False):
        raise ValueError("`tie_word_embeddings` must be False: hf_depth models use untied embeddings")
    if getattr(config, "mlp_bias", False):
        raise ValueError("`mlp_bias` must be False: hf_depth's SwiGLU has no biases")
    fields = {k: getattr(config, k) for k in SHARED_FIELDS}
    fields["attention_dropout"] = float(fields["attention_dropout"] or 0.0)
    fields["rope_theta"] = float(rope.get("rope_theta", 10000.0))
    fields.update(overrides)
    return PRE_LN.config_class(**fields)


def pre_ln_config_to_llama(config) -> LlamaConfig:
    if config.design != PRE_LN.name or config.scale_vector != "standard":
        raise ValueError(
            f"only design='pre_ln' with scale_vector='standard' is a Llama; got design={config.design!r}, "
            f"scale_vector={config.scale_vector!r}"
        )
    for name in ("qkv_bias", "use_qk_norm"):  # Qwen2's / Qwen3's attention: no LlamaConfig field expresses them
        if getattr(config, name, False):
            raise ValueError(f"`{name}=True` has no Llama equivalent: only a Pre-LN without it converts to Llama")
    return LlamaConfig(
        **{k: getattr(config, k) for k in SHARED_FIELDS},
        rope_parameters={"rope_type": "default", "rope_theta": float(config.rope_theta)},
        tie_word_embeddings=False,
    )


def _check_keys(src: dict, dst_model: torch.nn.Module, what: str) -> None:
    want = set(dst_model.state_dict())
    have = set(src)
    missing, unexpected = sorted(want - have), sorted(have - want)
    if missing or unexpected:
        raise ValueError(f"cannot convert {what}: missing keys {missing[:8]}, unexpected keys {unexpected[:8]}")


def llama_to_pre_ln(llama: LlamaForCausalLM):
    """A ``PreLNForCausalLM`` computing the same function as ``llama`` (weights copied)."""
    config = llama_config_to_pre_ln(llama.config)
    model = PRE_LN.causal_lm_class(config).to(llama.dtype)
    sd = llama.state_dict()
    _check_keys(sd, model, "LlamaForCausalLM -> hf_depth pre_ln")
    model.load_state_dict(sd, strict=True)
    return model


def pre_ln_to_llama(model) -> LlamaForCausalLM:
    """A ``LlamaForCausalLM`` computing the same function as an hf_depth Pre-LN model (weights copied)."""
    llama = LlamaForCausalLM(pre_ln_config_to_llama(model.config)).to(model.dtype)
    sd = model.state_dict()
    _check_keys(sd, llama, "hf_depth pre_ln -> LlamaForCausalLM")
    llama.load_state_dict(sd, strict=True)
    return llama
