"""Where each decoder family keeps what the diagnostics touch: one small adapter class per family.

An adapter answers, for one model: the decoder (``decoder()``) and its layer list (``layers()``); the
*branches* of a layer (the modules whose outputs are added to the residual stream: skipping a layer makes them
output zeros) and the *branch norms* (moved with the branches when two layers are swapped); how a layer's output
becomes one ``[B, T, d]`` residual state (``collapse``); and the readout of a residual state into logits
(``logits``: the family's final norm, LM head and final logit softcapping, exactly as the model's own forward).
The embedding scale (Gemma's ``sqrt(d)``) lives in the family's embedding module, so ``hidden_states[0]`` is the
scaled embedding the first layer reads, as in the model.

Families (``model_type``) and what differs from Llama's Pre-LN ``h + F(N(h))``:

* ``hf_depth`` (every registered design): the state may be streams or sources (``model.model.stream.collapse``).
* ``llama``, ``mistral``, ``qwen2``, ``qwen3`` (QK-norm inside ``self_attn``), ``phi3`` (fused ``qkv_proj`` /
  ``gate_up_proj``): Llama's layout.
* ``gemma2``, ``gemma3_text``: ``h + N_post(F(N_pre(h)))`` (sandwich norms, ``(1 + w)`` RMSNorm), scaled
  embedding, ``final_logit_softcapping`` (``tanh(z / c) c``); the post norms are branch norms (a zero branch
  output stays zero through them).
* ``olmo2``: ``h + N(F(h))`` (the norm after the branch, no input norm).
* ``gpt2``: ``transformer.h[i]`` with ``ln_1``/``attn``/``ln_2``/``mlp``, learned positions, final ``ln_f``,
  head tied to ``wte``; a GELU MLP of two matrices.
* ``gpt_neox`` (Pythia): ``gpt_neox.layers[i]`` with ``attention``/``mlp`` (parallel residual
  ``h + F_attn(N_1(h)) + F_mlp(N_2(h))`` by default), ``final_layer_norm``, head ``embed_out``.

Any other family is refused with one line naming the supported ones (:func:`adapter_for`).
"""

from __future__ import annotations

import torch
from torch import nn


class Adapter:
    """Llama's layout; every family overrides only what differs."""

    family = "llama"
    model_types: tuple[str, ...] = ("llama",)
    decoder_attr = "model"
    layers_attr = "layers"
    final_norm_attr = "norm"
    branches: tuple[str, ...] = ("self_attn", "mlp")
    branch_norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    #: matrices of the FFN (SwiGLU / GeGLU: gate, up, down; GELU MLP: up, down), for the analytic FLOPs
    ffn_matrices = 3

    def __init__(self, model: nn.Module):
        self.model = model

    # ------------------------------------------------------------------ structure
    def decoder(self) -> nn.Module:
        return getattr(self.model, self.decoder_attr, self.model)

    def layers(self) -> nn.ModuleList:
        return getattr(self.decoder(), self.layers_attr)

    def final_norm(self) -> nn.Module:
        return getattr(self.decoder(), self.final_norm_attr)

    def head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def collapse(self, layer_output) -> torch.Tensor:
        """A decoder layer's output -> the ``[B, T, d]`` residual state."""
        return layer_output[0] if isinstance(layer_output, (tuple, list)) else layer_output

    # ------------------------------------------------------------------ readout
    def softcap(self) -> float | None:
        return getattr(self.model.config, "final_logit_softcapping", None)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The model's readout of a residual state: final norm, LM head, softcapping (as the model's forward)."""
        z = self.head()(self.final_norm()(h))
        cap = self.softcap()
        return z if not cap else torch.tanh(z / cap) * cap

    # ------------------------------------------------------------------ shapes (analytic cost)
    @classmethod
    def ffn_width(cls, config) -> int:
        return config.intermediate_size


class HfDepthAdapter(Adapter):
    """Every hf_depth design: Llama's names; the state is collapsed by the design's ``stream``."""

    family = "hf_depth"
    model_types = ()

    def layers(self) -> nn.ModuleList:
        return self.decoder().get_decoder_layers()

    def collapse(self, layer_output) -> torch.Tensor:
        return self.decoder().stream.collapse(layer_output)

    def softcap(self) -> float | None:
        return None


class MistralAdapter(Adapter):
    family, model_types = "mistral", ("mistral",)


class Qwen2Adapter(Adapter):
    family, model_types = "qwen2", ("qwen2",)


class Qwen3Adapter(Adapter):
    family, model_types = "qwen3", ("qwen3",)  # q_norm / k_norm sit inside self_attn: they move with the branch


class Phi3Adapter(Adapter):
    family, model_types = "phi3", ("phi3",)


class GemmaAdapter(Adapter):
    family, model_types = "gemma", ("gemma2", "gemma3_text")
    branch_norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                    "post_feedforward_layernorm")


class Olmo2Adapter(Adapter):
    family, model_types = "olmo2", ("olmo2",)
    branch_norms = ("post_attention_layernorm", "post_feedforward_layernorm")


class GPT2Adapter(Adapter):
    family, model_types = "gpt2", ("gpt2",)
    decoder_attr, layers_attr, final_norm_attr = "transformer", "h", "ln_f"
    branches, branch_norms = ("attn", "mlp"), ("ln_1", "ln_2")
    ffn_matrices = 2

    @classmethod
    def ffn_width(cls, config) -> int:
        return config.n_inner or 4 * config.n_embd


class GPTNeoXAdapter(Adapter):
    family, model_types = "gpt_neox", ("gpt_neox",)
    decoder_attr, final_norm_attr = "gpt_neox", "final_layer_norm"
    branches = ("attention", "mlp")
    ffn_matrices = 2


ADAPTERS: tuple[type[Adapter], ...] = (Adapter, MistralAdapter, Qwen2Adapter, Qwen3Adapter, Phi3Adapter, GemmaAdapter,
                                       Olmo2Adapter, GPT2Adapter, GPTNeoXAdapter)
BY_MODEL_TYPE = {t: a for a in ADAPTERS for t in a.model_types}


def supported_families() -> list[str]:
    return ["hf_depth", *BY_MODEL_TYPE]


def is_hf_depth(config) -> bool:
    """An hf_depth design's config (also when loaded by remote code, where the class is a copy)."""
    return isinstance(getattr(config, "design", None), str) and str(getattr(config, "model_type", "")).startswith(
        "hf_depth")


def adapter_class(config) -> type[Adapter]:
    """The adapter of a config's family; ``ValueError`` (one line, naming the supported families) otherwise."""
    if is_hf_depth(config):
        return HfDepthAdapter
    model_type = getattr(config, "model_type", None)
    if model_type not in BY_MODEL_TYPE:
        raise ValueError(f"unsupported model family {model_type!r}: the diagnostics know {supported_families()}")
    return BY_MODEL_TYPE[model_type]


def adapter_for(model: nn.Module) -> Adapter:
    """The adapter of ``model`` (a CausalLM of a supported family, or any hf_depth design)."""
    config = getattr(model, "config", None)
    base = getattr(model, "model", None)
    if is_hf_depth(config) or (base is not None and hasattr(base, "stream") and hasattr(base, "get_decoder_layers")):
        return HfDepthAdapter(model)
    if config is None:
        raise ValueError(f"unsupported model {type(model).__name__}: no `config` (a transformers CausalLM is needed)")
    try:
        return adapter_class(config)(model)
    except ValueError as e:
        raise ValueError(f"{e} (got {type(model).__name__})") from None
