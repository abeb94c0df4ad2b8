"""The cross-layer designs as they were before their O(L)-memory paths (hf_depth before issue 12), kept as the
reference that tests/test_depth_cost.py compares the current implementation against.

Each function is the original method body: AttnRes stacked every source per sublayer, MoDA stacked the depth
K/V per layer, and both ran plain autograd over ``hf_depth.models.functional``. ``reference_paths()`` swaps
them in for the duration of a ``with`` block.
"""

from __future__ import annotations

import contextlib

import torch

from hf_depth.models import design_attnres, design_hc, design_moda, functional
from hf_depth.models.modeling_depth import apply_rotary_pos_emb
from hf_depth.models.residual import SublayerConnection


def attnres_aggregate(self, sources, stable=None):
    out, p = functional.depth_softmax(self.query, self.key_norm.gamma(), torch.stack(sources), self.eps)
    self._last_weights = p.detach().flatten(0, -2).float().mean(0)
    return out


def attnres_init(self, embeds):
    return (embeds,)


def moda_attend(self, module, q, k_new, v_new, k, v, attention_mask, position_embeddings, raw_k=None):
    self.own = (k_new if self.rotate or raw_k is None else raw_k, v_new)
    if attention_mask is not None and attention_mask.dim() != 4:
        raise ValueError("MoDA needs a 4-D attention mask: use attn_implementation 'eager' or 'sdpa'")
    depth = self.depth
    if depth and self.rotate:
        cos, sin = position_embeddings
        depth = self.depth = (*depth[:-2], apply_rotary_pos_emb(depth[-2], depth[-2], cos, sin)[0], depth[-1])
    dk = torch.stack(depth[0::2]) if depth else None
    dv = torch.stack(depth[1::2]) if depth else None
    mask = torch.zeros(len(depth) // 2, dtype=torch.bool, device=q.device) if self.mask_depth else None
    return functional.moda_attention(q, k, v, dk, dv, attention_mask, module.scaling, mask)


def moda_read(self, state, norm):
    x = norm(state[0])
    if self.is_attention:
        return x, design_moda.DepthKV(tuple(state[1:]), self.layer.mask_depth, self.rotate)
    return x, x


_MODA_WRITE = design_moda.MoDAConnection.write  # the attention's write and a last FFN's are unchanged


def moda_write(self, state, out, carry):  # the FFN's key unrotated: the next attention rotates it (``moda_attend``)
    if self.is_attention or self.layer.kv_proj is None:
        return _MODA_WRITE(self, state, out, carry)
    kv = self.layer.kv_proj(carry)
    k, v = kv.view(*carry.shape[:-1], 2, self.num_kv_heads, self.head_dim).transpose(1, 3).unbind(2)
    return (state[0] + out, *state[1:], k, v)


def multistream_read(self, state, norm):
    with design_hc.routing_precision(state):
        x, mixed, write_weights, seen = self.route(state)
    if not torch.compiler.is_compiling():
        self._seen = {k: v.detach() for k, v in seen.items()}
    return (x if norm is None else norm(x)), (mixed, write_weights)


def multistream_write(self, state, out, carry):
    mixed, write_weights = carry
    with design_hc.routing_precision(mixed):
        return self.depth(mixed, write_weights, out)


PATCHES = [
    (design_hc.MultiStreamConnection, "read", multistream_read),
    (design_hc.MultiStreamConnection, "write", multistream_write),
    (design_attnres.DepthAggregation, "forward", attnres_aggregate),
    (design_attnres.AttnResStream, "init", attnres_init),
    (design_moda.DepthKV, "attend", moda_attend),
    (design_moda.MoDAConnection, "read", moda_read),
    (design_moda.MoDAConnection, "write", moda_write),
    (design_moda.MoDAConnection, "write_then_read", SublayerConnection.write_then_read),
]


@contextlib.contextmanager
def reference_paths():
    """Run every design through its pre-issue-12 implementation inside the block."""
    saved = [(cls, name, cls.__dict__[name]) for cls, name, _ in PATCHES]
    try:
        for cls, name, fn in PATCHES:
            setattr(cls, name, fn)
        yield
    finally:
        for cls, name, fn in saved:
            setattr(cls, name, fn)
