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


def attnres_aggregate(self, sources, stable=None):
    out, p = functional.depth_softmax(self.query, self.key_norm.gamma(), torch.stack(sources), self.key_norm.eps)
    self._last_weights = p.detach().flatten(0, -2).float().mean(0)
    return out


def attnres_init(self, embeds):
    return (embeds,)


def moda_attention_forward(self, x, position_embeddings, attention_mask=None, cache=None, depth=(), depth_mask=None,
                           **kwargs):
    q, k, v = self.project_qkv(x)
    cos, sin = position_embeddings
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    new_kv = (k, v)
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx)
    if attention_mask is not None and attention_mask.dim() != 4:
        raise ValueError("MoDA needs a 4-D attention mask: use attn_implementation 'eager' or 'sdpa'")
    dk = torch.stack(depth[0::2]) if depth else None
    dv = torch.stack(depth[1::2]) if depth else None
    out = functional.moda_attention(q, k, v, dk, dv, attention_mask, self.scaling, depth_mask)
    return self.o_proj(out.reshape(*x.shape[:-1], -1).contiguous()), new_kv


def multistream_read(self, state, norm):
    with design_hc.routing_precision(state):
        x, mixed, write_weights, seen = self.route(state)
    self._pending = (mixed, write_weights)
    if not torch.compiler.is_compiling():
        self._seen = {k: design_hc._token_mean(v.detach(), 2 if k == "res" else 1) for k, v in seen.items()}
    return x if norm is None else norm(x)


def multistream_write(self, state, out):
    (mixed, write_weights), self._pending = self._pending, None
    with design_hc.routing_precision(mixed):
        return self.depth(mixed, write_weights, out)


PATCHES = [
    (design_hc.MultiStreamConnection, "read", multistream_read),
    (design_hc.MultiStreamConnection, "write", multistream_write),
    (design_attnres.DepthAggregation, "forward", attnres_aggregate),
    (design_attnres.AttnResStream, "init", attnres_init),
    (design_moda.MoDAAttention, "forward", moda_attention_forward),
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
