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

import torch
from torch import nn

from .configuration_depth import DepthConfig, _choice
from .dispatch import moda_attention
from .residual import Design, ResidualStream

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
    """State = (h, depth K/V...); collapse and final see the residual stream h only."""

    def init(self, embeds):
        return (embeds,)

    def collapse(self, state):
        return state[0]


def moda_extra_params(config) -> int:
    """kv_proj: d -> 2 n_kv head_dim in every block but the last (no bias)."""
    return (config.num_hidden_layers - 1) * 2 * config.hidden_size * config.num_key_value_heads * config.head_dim


DESIGN = Design(
    "moda",
    MoDAConfig,
    stream=MoDAStream,
    layer_class=lambda config, layer_idx, design: MoDADecoderLayer(config, layer_idx, design),
    attention_class=lambda config, layer_idx: MoDAAttention(config, layer_idx),
    extra_params=moda_extra_params,
    summary="attention softmax over [causal sequence KV | same-token depth KV of earlier sublayers]",
    paper="Zhu et al. 2026, Mixture-of-Depths Attention (arXiv 2603.15619)",
)

# The layer classes subclass the shared decoder's; modeling_depth imports the registry (hence this file) only after
# defining them, so importing it here, below DESIGN, has no cycle whichever file is loaded first (trust_remote_code
# loads this file first for AutoConfig). DESIGN refers to the classes through lambdas, resolved at build time.
from .modeling_depth import DepthAttention, DepthDecoderLayer, apply_rotary_pos_emb  # noqa: E402


class MoDAAttention(DepthAttention):
    """Causal attention whose softmax also covers the depth K/V of the current token."""

    def forward(self, x, position_embeddings, attention_mask=None, cache=None, depth=(), depth_mask=None, **kwargs):
        q, k, v = self.project_qkv(x)
        raw_k = k
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        # this token's depth K/V: the key as it enters the sequence softmax (post-RoPE) or, DepthBench, pre-RoPE
        new_kv = (k if self.config.moda_depth_rope == "rotated" else raw_k, v)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        if attention_mask is not None and attention_mask.dim() != 4:
            raise ValueError("MoDA needs a 4-D attention mask: use attn_implementation 'eager' or 'sdpa'")
        dk = torch.stack(depth[0::2]) if depth else None
        dv = torch.stack(depth[1::2]) if depth else None
        out = moda_attention(q, k, v, dk, dv, attention_mask, self.scaling, depth_mask)
        return self.o_proj(out.reshape(*x.shape[:-1], -1).contiguous()), new_kv


class MoDADecoderLayer(DepthDecoderLayer):
    """Pre-LN block whose state is (h, K_0, V_0, K_1, V_1, ...): the depth K/V written so far, per token."""

    def __init__(self, config, layer_idx, design):
        super().__init__(config, layer_idx, design)
        self.num_kv_heads, self.head_dim = config.num_key_value_heads, config.head_dim
        last = layer_idx == config.num_hidden_layers - 1
        kv = config.num_key_value_heads * config.head_dim
        self.kv_proj = None if last else nn.Linear(config.hidden_size, 2 * kv, bias=False)
        self.rotate_depth = config.moda_depth_rope == "rotated"
        self.mask_depth = False  # True: every depth slot masked out of the softmax (then == Pre-LN attention)

    def skipped(self, state):
        """DepthBench: a removed block writes no depth K/V, its slots stay zero (they still enter the softmax)."""
        h = state[0]
        zero = h.new_zeros(h.shape[0], self.num_kv_heads, h.shape[1], self.head_dim)
        return (*state, *([zero] * (2 if self.kv_proj is None else 4)))

    def forward(self, state, attention_mask=None, position_embeddings=None, cache=None, **kwargs):
        h, depth = state[0], tuple(state[1:])
        x = self.attn_connection.read(h, self.input_layernorm)
        mask = torch.zeros(len(depth) // 2, dtype=torch.bool, device=h.device) if self.mask_depth else None
        y, new_kv = self.self_attn(
            x, position_embeddings, attention_mask=attention_mask, cache=cache, depth=depth, depth_mask=mask, **kwargs
        )
        h = self.attn_connection.write(h, y)
        depth = depth + new_kv
        x = self.mlp_connection.read(h, self.post_attention_layernorm)
        if self.kv_proj is not None:
            k, v = self.kv_proj(x).view(*x.shape[:-1], 2, self.num_kv_heads, self.head_dim).transpose(1, 3).unbind(2)
            if self.rotate_depth:
                cos, sin = position_embeddings
                k, _ = apply_rotary_pos_emb(k, k, cos, sin)  # same position as the query: relative distance 0
            depth = depth + (k, v)
        return (self.mlp_connection.write(h, self.mlp(x)), *depth)
