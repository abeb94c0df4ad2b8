"""The shared hf_depth decoder.

A LLaMA-like decoder with Llama's module names (``model.layers.N.self_attn.q_proj``, ``input_layernorm``,
``mlp.gate_proj``...), so that PEFT ``target_modules``, TP plans and the Llama converter just work. Its
only varying part is the residual design (``residual.py``): each sublayer asks its connection to
``read`` the residual state into a branch input and to ``write`` the branch output back::

    x, carry = connection.read(state, input_norm)     # Pre-LN: N(h), None
    y        = branch(x)                              # attention (sees ``carry``) or SwiGLU FFN
    state    = connection.write(state, y, carry)      # Pre-LN: h + y

Each design file declares its ``<Name>Model(DepthModel)`` and ``<Name>ForCausalLM(DepthForCausalLM)`` (e.g.
``design_pre_ln.PreLNForCausalLM``), registered with the Auto classes by ``import hf_depth`` and loadable with
``trust_remote_code=True`` from a saved folder without the package.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .configuration_depth import DepthConfig
from .dispatch import swiglu
from .norms import ProjectionScales, RMSNorm, make_norm, parameter_roles
from .residual import AttentionCarry, Design

_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


# ----------------------------------------------------------------------------------------------- RoPE
class DepthRotaryEmbedding(nn.Module):
    """Default RoPE, identical to Llama's (cos/sin computed in fp32, cast to the activation dtype); with
    ``rope_scaling_factor`` != 1 Llama's ``linear`` scaling."""

    def __init__(self, config: DepthConfig):
        super().__init__()
        self.config = config
        self.inv_freq = nn.Buffer(self.compute_inv_freq(config), persistent=False)

    @staticmethod
    def compute_inv_freq(config: DepthConfig) -> torch.Tensor:
        dim = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        factor = getattr(config, "rope_scaling_factor", 1.0)
        return inv_freq if factor == 1.0 else inv_freq / factor  # linear scaling (transformers' rope_type "linear")

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # an outer product written as a broadcast multiply (Llama's form): the same fp32 values as the matmul
        # inv_freq @ pos (one product per entry), no autocast guard needed (mul is not autocast), fewer ops per step
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, per_head: bool = False) -> torch.Tensor:
    """RoPE of one [B, H, T, hd] tensor (``cos``/``sin`` are [B, T, hd]; ``per_head``: already [B, 1, T, hd])."""
    if not per_head:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (x * cos) + (rotate_half(x) * sin)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # once for both (every decoding step runs this per layer)
    return rotate(q, cos, sin, per_head=True), rotate(k, cos, sin, per_head=True)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    b, h, t, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    key, value = repeat_kv(key, module.num_key_value_groups), repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask
    probs = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


# ----------------------------------------------------------------------------------------------- branches
class DepthAttention(nn.Module):
    """Multi-head attention with optional GQA, RoPE and a KV cache; the same module for every design."""

    def __init__(self, config: DepthConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.head_dim = config.head_dim
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_kv_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        d, q_out, kv_out = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv_bias = config.attention_bias or getattr(config, "qkv_bias", False)  # Llama: q/k/v/o; Qwen2: q/k/v
        self.q_proj = nn.Linear(d, q_out, bias=qkv_bias)
        self.k_proj = nn.Linear(d, kv_out, bias=qkv_bias)
        self.v_proj = nn.Linear(d, kv_out, bias=qkv_bias)
        self.o_proj = nn.Linear(q_out, d, bias=config.attention_bias)
        if getattr(config, "use_qk_norm", False):  # Qwen3: per-head RMSNorm on q and k, before RoPE
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps, role="output")  # IWD: an Output-Norm
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps, role="output")
        else:
            self.q_norm = self.k_norm = None
        self.scales = ProjectionScales(config, {"q": (d, q_out), "k": (d, kv_out), "v": (d, kv_out)})

    def project_qkv(self, x: torch.Tensor):
        """q, k, v as [B, heads, T, head_dim] before RoPE (scale vectors applied around the projections, then the
        QK-norm where ``use_qk_norm``)."""
        shape = (*x.shape[:-1], -1, self.head_dim)
        xq, xk, xv = self.scales.inputs(x)
        q = self.scales.outputs("q", self.q_proj(xq).view(shape))
        k = self.scales.outputs("k", self.k_proj(xk).view(shape))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        v = self.scales.outputs("v", self.v_proj(xv).view(shape))
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x, position_embeddings, attention_mask=None, cache: Cache | None = None,
                carry: AttentionCarry | None = None, **kwargs):
        """(output, attention probabilities or None). ``carry``: the connection's carry; an ``AttentionCarry``
        (MoDA's depth K/V) computes the attention itself from q and the keys/values."""
        q, k, v = self.project_qkv(x)
        raw_k = k
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k_new, v_new = k, v
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        if isinstance(carry, AttentionCarry):
            out = carry.attend(self, q, k_new, v_new, k, v, attention_mask, position_embeddings, raw_k)
            return self.o_proj(out.reshape(*x.shape[:-1], -1).contiguous()), None
        attention = eager_attention_forward
        impl = self.config._attn_implementation
        if impl not in (None, "eager"):
            attention = ALL_ATTENTION_FUNCTIONS[impl]
        out, probs = attention(
            self,
            q,
            k,
            v,
            attention_mask,
            dropout=self.config.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            **kwargs,
        )
        return self.o_proj(out.reshape(*x.shape[:-1], -1).contiguous()), probs


class DepthMLP(nn.Module):
    """SwiGLU FFN: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: DepthConfig):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        self.scales = ProjectionScales(config, {"gate": (d, f), "up": (d, f)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xg, xu = self.scales.inputs(x)
        gate = self.scales.outputs("gate", self.gate_proj(xg))
        up = self.scales.outputs("up", self.up_proj(xu))
        return self.down_proj(swiglu(gate, up))


# ----------------------------------------------------------------------------------------------- layer
def build_input_norm(design: Design, config: DepthConfig, sublayer_idx: int) -> nn.Module | None:
    if design.input_norm is not None:
        return design.input_norm(config, sublayer_idx)
    return make_norm(config, role="input")


class DepthDecoderLayer(GradientCheckpointingLayer):
    """One block = attention sublayer (index 2i) + FFN sublayer (index 2i+1), each through its connection."""

    def __init__(self, config: DepthConfig, layer_idx: int, design: Design):
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = DepthAttention(config, layer_idx)
        self.mlp = DepthMLP(config)
        # Llama's names: `input_layernorm` is the attention's input norm, `post_attention_layernorm` the FFN's.
        self.input_layernorm = build_input_norm(design, config, 2 * layer_idx)
        self.post_attention_layernorm = build_input_norm(design, config, 2 * layer_idx + 1)
        self.attn_connection = design.connection(config, 2 * layer_idx)
        self.mlp_connection = design.connection(config, 2 * layer_idx + 1)
        for conn in self.connections():
            object.__setattr__(conn, "layer", self)  # a back-reference, not a submodule: the modules registered here
            for name, value in conn.layer_modules().items():
                setattr(self, name, value)

    def forward(self, state, attention_mask=None, position_embeddings=None, cache=None, **kwargs):
        x, carry = self.attn_connection.read(state, self.input_layernorm)
        y, _ = self.self_attn(x, position_embeddings, attention_mask=attention_mask, cache=cache, carry=carry,
                              **kwargs)
        state, x, carry = self.attn_connection.write_then_read(
            state, y, carry, self.mlp_connection, self.post_attention_layernorm
        )
        return self.mlp_connection.write(state, self.mlp(x), carry)

    def connections(self) -> tuple[nn.Module, nn.Module]:
        return self.attn_connection, self.mlp_connection

    def skipped(self, state):
        """The block's output when DepthBench's analysis removes it: its input state, plus what its connections
        write even then (``SublayerConnection.skipped``; MoDA's zero depth K/V)."""
        return self.mlp_connection.skipped(self.attn_connection.skipped(state))


# ----------------------------------------------------------------------------------------------- models
class DepthPreTrainedModel(PreTrainedModel):
    config_class = DepthConfig
    design: Design | None = None
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DepthDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = False
    _supports_attention_backend = True
    _can_compile_fullgraph = False

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Truncated normal (std ``initializer_range``, cut at ``init_cutoff_factor`` stds) for every linear and
        embedding, scaled by the design's per-branch ``init_scale``; norms at 1; design parameters through their
        own ``reset_design_parameters`` (e.g. AttnRes queries stay zero, HC static routing one-hot)."""
        cfg = self.config
        std, cut = cfg.initializer_range, cfg.init_cutoff_factor
        if isinstance(module, (nn.Linear, nn.Embedding)):
            s = std * getattr(module, "init_scale", 1.0)
            init.trunc_normal_(module.weight, mean=0.0, std=s, a=-cut * s, b=cut * s)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
        elif isinstance(module, DepthRotaryEmbedding):
            init.copy_(module.inv_freq, module.compute_inv_freq(cfg))
        elif isinstance(module, nn.LayerNorm) and module.weight is not None:
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, RMSNorm) and module.weight is not None:
            init.ones_(module.weight)
        if hasattr(module, "reset_design_parameters"):
            module.reset_design_parameters()

    @classmethod
    def is_remote_code(cls) -> bool:
        """Saved with its code (``trust_remote_code``) unless the design's file lives outside this folder.
        (``generate`` asks at every decoding step: the file check is cached per class.)"""
        design = cls.design
        return super().is_remote_code() and (
            design is None or _beside_this_file(design.causal_lm_class, design.config_class))

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Save weights, config and the modeling code, with an ``auto_map`` for every Auto class we support, so the
        folder loads with ``trust_remote_code=True`` where hf_depth is not installed."""
        if not self.is_remote_code():
            # a design registered at run time from elsewhere: its code cannot travel as a flat folder
            self.config._auto_class = None
            try:
                return super().save_pretrained(save_directory, *args, **kwargs)
            finally:
                del self.config._auto_class
        self.config.auto_map = {
            "AutoConfig": _qualified(type(self.config)),
            "AutoModel": _qualified(self.design.model_class),
            "AutoModelForCausalLM": _qualified(self.design.causal_lm_class),
        }
        return super().save_pretrained(save_directory, *args, **kwargs)


class DepthModel(DepthPreTrainedModel):
    """The decoder without the LM head; ``last_hidden_state`` is after the final norm."""

    _auto_class = "AutoModel"

    def __init__(self, config: DepthConfig):
        super().__init__(config)
        design = self.design
        if design is None:
            raise ValueError("DepthModel is abstract: build a design's model, e.g. PreLNForCausalLM(config)")
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.stream = design.stream(config)
        self.layers = nn.ModuleList(DepthDecoderLayer(config, i, design) for i in range(config.num_hidden_layers))
        self.stream.bind(self.layers)
        # the final norm feeds the LM head: an Input-Norm (a design may pick its kind: DepthBench's DeepNorm keeps RMS)
        self.norm = make_norm(config, role="input", kind=getattr(config, "final_norm_kind", None), final=True)
        self.rotary_emb = DepthRotaryEmbedding(config)
        self.gradient_checkpointing = False
        self._apply_init_scales()
        parameter_roles(self, design.param_roles, strict=True)  # every design parameter has a declared role
        self.post_init()

    def _apply_init_scales(self) -> None:
        """Tag branch weights with the design's init multiplier (read by ``_init_weights``)."""
        if self.design.init_scale is None:
            return
        for i, layer in enumerate(self.layers):
            for name, mod in layer.named_modules():
                if isinstance(mod, nn.Linear):
                    mod.init_scale = float(self.design.init_scale(self.config, i, name))

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ):
        cache = cache if cache is not None else past_key_values
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Specify exactly one of `input_ids` or `inputs_embeds`")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if self.gradient_checkpointing and self.training:
            use_cache = False
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if not use_cache:
            cache = None
        if output_hidden_states is None:
            output_hidden_states = getattr(self.config, "output_hidden_states", False)
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device)[None] + past
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
        )
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)

        state = self.stream.init(inputs_embeds)
        hidden_states = [self.stream.collapse(state)] if output_hidden_states else None
        for layer in self.layers:
            state = layer(state, attention_mask=mask, position_embeddings=position_embeddings, cache=cache, **kwargs)
            if output_hidden_states:
                hidden_states.append(self.stream.collapse(state))
        last = self.stream.final(state, self.norm)
        if output_hidden_states:  # as Llama: L + 1 entries, the last one after the final norm
            hidden_states[-1] = last
        out = BaseModelOutputWithPast(
            last_hidden_state=last,
            hidden_states=tuple(hidden_states) if output_hidden_states else None,
            **{_CACHE_FIELD: cache},
        )
        return out if return_dict is not False else out.to_tuple()

    # ------------------------------------------------------------------ diagnostics
    def get_decoder_layers(self) -> nn.ModuleList:
        return self.layers

    def residual_path_weights(self) -> dict[int, dict[str, torch.Tensor]]:
        """Explicit residual-path weights per sublayer index (empty for designs with implicit paths); key 2L is the
        final aggregation. Formats: see ``hf_depth.diagnostics.paths``."""
        out = {}
        for layer in self.layers:
            for conn in layer.connections():
                w = conn.path_weights()
                if w is not None:
                    out[conn.sublayer_idx] = w
        final = self.stream.path_weights()
        if final is not None:  # the final aggregation reads as sublayer 2L
            out[self.config.num_sublayers] = final
        return out


class DepthForCausalLM(DepthPreTrainedModel, GenerationMixin):
    """Decoder + untied LM head."""

    _tied_weights_keys = {}
    _auto_class = "AutoModelForCausalLM"
    _tp_plan = {"lm_head": "colwise_gather_output"}

    def __init__(self, config: DepthConfig):
        super().__init__(config)
        self.model = self.base_model_class(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    base_model_class: type = DepthModel

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def get_decoder(self):
        return self.model

    def forward(
        self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None, cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None, labels: torch.LongTensor | None = None,
        use_cache: bool | None = None, output_hidden_states: bool | None = None, return_dict: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0, past_key_values: Cache | None = None, **kwargs,
    ):
        kwargs.pop("output_attentions", None)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache if cache is not None else past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            **{k: v for k, v in kwargs.items() if k != "num_items_in_batch"},
        )
        hidden = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        out = CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            **{_CACHE_FIELD: getattr(outputs, _CACHE_FIELD)},
        )
        return out if return_dict is not False else out.to_tuple()


@functools.cache
def _beside_this_file(*classes: type) -> bool:
    """Whether every class is defined in this folder (what ``trust_remote_code`` can copy); a class's file never
    moves, so the answer is cached."""
    here = os.path.dirname(os.path.abspath(__file__))
    files = [getattr(sys.modules.get(c.__module__), "__file__", None) for c in classes]  # None: a REPL, ``python -c``
    return all(f is not None and os.path.dirname(os.path.abspath(f)) == here for f in files)


# ``generate`` reads ``inspect.signature(model.forward)`` at every decoding step of a remote-code model (to look
# for a ``cache_position`` argument): hand it the signature computed once instead of re-parsing the function.
for _forward in (DepthModel.forward, DepthForCausalLM.forward):
    _forward.__signature__ = inspect.signature(_forward)
del _forward


def _qualified(cls: type) -> str:
    """``module.Class`` as ``auto_map`` names it: the file in the saved folder, then the class."""
    return f"{cls.__module__.split('.')[-1]}.{cls.__name__}"
