"""MoDA, Mixture-of-Depths Attention (DepthBench ``moda``, pre-norm).

    h <- h + Attn_l(N(h)),  Attn_l: softmax over [ q_t k_j (j <= t, causal sequence) | q_t K_{t,s} (s < 2l) ]
                                     -> sum_j p_j v_j + sum_s p_s V_{t,s}                  (ONE softmax per head)
    h <- h + FFN_l(N(h))

(K_{t,s}, V_{t,s}) are the *depth* key/value of token t written by earlier sublayer s: an attention sublayer
writes its own key (after RoPE) and value; an FFN sublayer writes ``kv_proj(N(h))`` (an extra projection
d -> 2 n_kv head_dim of the FFN's normed input; the last block's FFN has none, as no attention follows it).
Block 0's attention has no depth keys (plain causal attention).

Choices (documented, DepthBench has no qk-norm so "post-k-norm" is simply "the projected key"):

* Depth keys carry RoPE at the token's own position (attention keys as they enter the sequence softmax, FFN
  keys rotated the same way), so every depth score q_t . K_{t,s} equals the unrotated product (relative
  distance 0) and never depends on the absolute position (``moda_depth_rope="rotated"``, the default).
  ``moda_depth_rope="unrotated"`` is DepthBench's forward (``keyu-wang-2002/DepthBench`` @ 100da5f,
  ``nn/moda.py``): attention depth keys are cached *before* RoPE and the FFN ``kv_proj`` keys are never
  rotated, while the query is, so a depth score is R(t) q_t . K_{t,s}; ``hf-depth convert-olmo-core`` sets it.
* Depth K/V are per token and only the token itself reads them, so a KV-cached decode step recomputes the
  new token's depth K/V within its own forward; past tokens' depth K/V are never read again. **Nothing
  beyond the ordinary sequence KV cache is cached** and generation with a cache equals generation without.
* The attention runs MoDA's own softmax (``dispatch.moda_attention``, eager math in fp32) whatever
  ``attn_implementation`` says (the masks of ``eager`` and ``sdpa`` are both understood).

Extra parameters: 2 d n_kv head_dim per block except the last (48.2M at L=24, d=1024, MHA: 12% of 405M);
``hf_depth.shapes.iso_width`` includes them. Zhu et al. 2026, Mixture-of-Depths Attention (arXiv 2603.15619).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from .configuration_depth import DepthConfig, _choice
from .depth_ops import attach_moda_banks, moda_attention, moda_ffn_depth_kv
from .modeling_depth import DepthForCausalLM, DepthModel, rotate
from .olmo_rules import OlmoRules, one, pre_norms
from .residual import STREAM_BYTES, AttentionCarry, Design, ResidualStream, SublayerConnection, register

MODA_DEPTH_ROPE = ("rotated", "unrotated")


class MoDAConfig(DepthConfig):
    """MoDA decoder (pre-norm): every attention sublayer also attends to the same-token K/V of all earlier
    sublayers, in one softmax; ``attention_dropout`` must be 0.

    Args:
        moda_depth_rope: ``"rotated"`` (default): depth keys carry RoPE at the token's own position (depth scores
            are position independent). ``"unrotated"``: depth keys are never rotated and meet the rotated query,
            DepthBench's forward (set for converted DepthBench checkpoints).
    """

    model_type = "hf_depth_moda"
    design = "moda"

    moda_depth_rope: str = "rotated"

    def validate_design(self):
        _choice("moda_depth_rope", self.moda_depth_rope, MODA_DEPTH_ROPE)
        if self.attention_dropout != 0:
            raise ValueError(
                f"`attention_dropout` must be 0 for MoDA (no dropout in its softmax), got {self.attention_dropout!r}"
            )


class MoDAStream(ResidualStream):
    """State = (h, K_0, V_0, K_1, V_1, ...): the residual stream and the depth K/V written so far, per token;
    collapse and final see the residual stream h only."""

    def init(self, embeds):
        return (embeds,)

    def collapse(self, state):
        return state[0]


class DepthKV(AttentionCarry):
    """The carry of a MoDA attention sublayer: the depth K/V of the earlier sublayers. The shared attention calls
    ``attend``, which runs the one softmax over [sequence | depth] and keeps this sublayer's own K/V for ``write``.

    ``moda_depth_rope="rotated"``: the depth key is the key as it enters the sequence softmax (post-RoPE); the
    FFN's key is rotated the same way, at the token's own position, when the FFN writes it (``MoDAConnection``
    hands the FFN these positions). ``"unrotated"`` (DepthBench): depth keys are never rotated (the attention's own
    key is taken before RoPE)."""

    def __init__(self, depth: tuple, mask_depth: bool, rotate: bool):
        self.depth, self.mask_depth, self.rotate, self.own, self.positions = depth, mask_depth, rotate, None, None

    def attend(self, module, q, k_new, v_new, k, v, attention_mask, position_embeddings, raw_k=None):
        own_k = k_new if self.rotate or raw_k is None else raw_k
        self.own = (own_k, v_new)  # this token's depth K/V
        self.positions = position_embeddings  # for the FFN's depth key (``MoDAConnection.write_then_read``)
        if not self.depth:  # the first depth K/V of the forward carry the banks every later one is copied into, once
            self.own = attach_moda_banks(own_k, v_new, 2 * module.config.num_hidden_layers - 1)
        if attention_mask is not None and attention_mask.dim() != 4:
            raise ValueError("MoDA needs a 4-D attention mask: use attn_implementation 'eager' or 'sdpa'")
        mask = torch.zeros(len(self.depth) // 2, dtype=torch.bool, device=q.device) if self.mask_depth else None
        # saved for backward: q, k, v and the depth banks (one storage each per forward), never a stacked copy
        return moda_attention(q, k, v, self.depth, attention_mask, module.scaling, mask)


class FFNInput(NamedTuple):
    """The carry of a MoDA FFN sublayer: its normed input (``kv_proj``'s input) and the (cos, sin) of the tokens'
    positions that the attention before it saw (None where the FFN was read on its own: its key cannot be rotated)."""

    x: torch.Tensor
    positions: tuple | None = None


class MoDAConnection(SublayerConnection):
    """Pre-LN read/write of h; the attention sublayer hands its depth K/V to the attention (``DepthKV``) and
    appends its own; the FFN sublayer appends ``kv_proj(N(h))`` (the layer's ``kv_proj``, none in the last block).

    ``layer.mask_depth = True`` masks every depth slot out of the softmax (then the attention is Pre-LN's)."""

    def __init__(self, config, sublayer_idx):
        super().__init__(config, sublayer_idx)
        self.is_attention = sublayer_idx % 2 == 0
        self.num_kv_heads, self.head_dim = config.num_key_value_heads, config.head_dim
        self.has_kv_proj = not self.is_attention and sublayer_idx // 2 < config.num_hidden_layers - 1
        self.kv_shape = (config.hidden_size, 2 * config.num_key_value_heads * config.head_dim)
        self.rotate = config.moda_depth_rope == "rotated"

    def layer_modules(self):
        """Built once by the layer, which registers them (Llama-style keys: ``model.layers.i.kv_proj``)."""
        if self.is_attention:
            return {"mask_depth": False}
        return {"kv_proj": nn.Linear(*self.kv_shape, bias=False) if self.has_kv_proj else None}

    def read(self, state, norm):
        x = norm(state[0])
        if self.is_attention:
            return x, DepthKV(tuple(state[1:]), self.layer.mask_depth, self.rotate)
        return x, FFNInput(x)

    def write_then_read(self, state, out, carry, following, norm):
        """The attention's write, then the FFN's read, whose carry also takes the positions the attention saw."""
        state = self.write(state, out, carry)
        x, ffn = following.read(state, norm)
        return state, x, ffn._replace(positions=carry.positions)

    def write(self, state, out, carry):
        h = state[0] + out
        if self.is_attention:
            return (h, *carry.depth, *carry.own)
        proj = self.layer.kv_proj
        if proj is None:
            return (h, *state[1:])
        if self.rotate and carry.positions is None:
            raise ValueError("MoDA's FFN writes its depth key rotated at the tokens' positions: run it after the "
                             "attention (``write_then_read``), which hands it the positions")
        kv = proj(carry.x)
        positions = carry.positions if self.rotate else None
        fused = moda_ffn_depth_kv(kv, self.num_kv_heads, positions)  # one native pass each way (CPU fp32)
        if fused is not None:
            return (h, *state[1:], *fused)
        k, v = kv.view(*kv.shape[:-1], 2, self.num_kv_heads, self.head_dim).transpose(1, 3).unbind(2)
        if positions is not None:  # rotated at the token's own position, as the attention keys are (distance 0)
            k = rotate(k, *positions)
        return (h, *state[1:], k, v)

    def skipped(self, state):
        """DepthBench: a removed block writes no depth K/V, its slots stay zero (they still enter the softmax)."""
        if not self.is_attention and not self.has_kv_proj:
            return state
        h = state[0]
        zero = h.new_zeros(h.shape[0], self.num_kv_heads, h.shape[1], self.head_dim)
        return (*state, zero, zero)


def moda_extra_params(config) -> int:
    """kv_proj: d -> 2 n_kv head_dim in every block but the last (no bias)."""
    return (config.num_hidden_layers - 1) * 2 * config.hidden_size * config.num_key_value_heads * config.head_dim


def moda_extra_flops(config, T: int, model=None) -> dict:
    """The FFN K/V projections (matmuls) and the depth part of the combined softmax: Q K^T and P V over the 2i
    earlier depth slots of block i (other: kernel-specific)."""
    d, H, hd = config.hidden_size, config.num_attention_heads, config.head_dim
    kv, L = config.num_key_value_heads * hd, config.num_hidden_layers
    depth = sum(4 * T * H * hd * (2 * i) for i in range(1, L))
    return {"matmul": (L - 1) * 2 * T * d * 2 * kv, "other": depth}


def moda_depth_kv_bytes(config, seq_len: int, batch: int, bytes_per: int) -> int:
    """The depth K/V buffers ``[B, T, 2L, kv_heads, hd]`` (one slot per sublayer, K and V)."""
    return 2 * config.num_sublayers * seq_len * config.num_key_value_heads * config.head_dim * bytes_per * batch


def moda_extra_activation_bytes(config, batch: int, seq_len: int, compute_bytes: int) -> int:
    """Beyond Pre-LN: the two depth banks of ``2L - 1`` slots (K, V; kept once per forward, read as views; none at
    L = 1, where nothing reads them; the flash path saves the output and log-sum-exp as SDPA does), and, under
    autocast, q and k saved in fp32 (RoPE's fp32 cos/sin promote them; MoDA's softmax runs with autocast off), the
    fp32 attention output (o_proj saves its own bf16 copy), the rotated K bank in fp32, one more cast copy of the
    FFN input per ``kv_proj`` and its bf16 weight copy."""
    L, d, H = config.num_hidden_layers, config.hidden_size, config.num_attention_heads
    q, kv = H * config.head_dim, config.num_key_value_heads * config.head_dim
    c, N = compute_bytes, batch * seq_len
    k_bytes = STREAM_BYTES if config.moda_depth_rope == "rotated" else c
    banks = (2 * L - 1) * kv * (k_bytes + c) * N if L > 1 else 0
    total = banks
    if c != STREAM_BYTES:
        total += L * (q + kv) * (STREAM_BYTES - c) * N  # q, k in fp32 instead of SDPA's cast copies
        total += L * q * 4 * N  # the fp32 output the flash backward reads
        total += (L - 1) * (d * c * N + c * d * 2 * kv)  # kv_proj: its input cast, its weight copy
    return total


class MoDAModel(DepthModel):  # MoDA decoder (no LM head)
    config_class = MoDAConfig


class MoDAForCausalLM(DepthForCausalLM):  # MoDA causal LM
    config_class, base_model_class = MoDAConfig, MoDAModel


def olmo_layer(config, i: int, options: dict) -> list:
    """DepthBench ``moda``: the input norms plus the FFN's depth K/V projection ``feed_forward.kv_proj`` [2 n_kv hd,
    d] (rows [k | v]; absent in the last block) -> ``model.layers.i.kv_proj``."""
    rules = pre_norms(config, i)
    if i < config.num_hidden_layers - 1:
        rules.append(one(f"blocks.{i}.feed_forward.kv_proj.weight", f"model.layers.{i}.kv_proj.weight"))
    return rules


#: the block wraps attention and FFN one level deeper; DepthBench caches depth keys before RoPE (``nn/moda.py``)
OLMO = OlmoRules("moda", layer=olmo_layer, attention="attention.attention", feed_forward="feed_forward.feed_forward",
                 defaults=lambda sd, backend: {"moda_depth_rope": "unrotated"}, forward_fields=("moda_depth_rope",))

DESIGN = register(Design(
    "moda",
    MoDAConfig,
    MoDAModel,
    MoDAForCausalLM,
    param_roles={},
    connection=MoDAConnection,
    stream=MoDAStream,
    extra_params=moda_extra_params,
    extra_flops=moda_extra_flops,
    extra_kv_bytes=moda_depth_kv_bytes,
    olmo=OLMO,
    extra_activation_bytes=moda_extra_activation_bytes,
    summary="attention softmax over [causal sequence KV | same-token depth KV of earlier sublayers]",
    paper="Zhu et al. 2026, Mixture-of-Depths Attention (arXiv 2603.15619)",
))
