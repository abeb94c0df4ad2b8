"""Which *state* is measured, what *skipping* and *swapping* a block mean: the two diagnostics conventions.

``convention="depthbench"`` (default) reproduces DepthBench's analysis code (``analysis/depth_probes.py`` at
keyu-wang-2002/DepthBench@f807aa279d04ffd6d08bc3d9f2c3a97985a1e980, ``analysis/layer_score_utils.py`` and
``analysis/compute_causal_score.py`` for the global aggregates), so numbers compare with its Figures 5, 6, 8:

* **state** ``z_0 .. z_L``: ``z_0`` the input of block 0, ``z_{l+1}`` the output of block ``l`` as the design's
  ``stream.depth_state`` sees it: the residual stream for the Pre-LN family and MoDA, the ``n`` HC/mHC streams
  concatenated (``[B, T, n d]``), the running partial sum for AttnRes, except at a true AttnRes boundary (block
  ``l``'s attention sublayer starts a source block, and ``l = L``) where ``z_l`` is the raw depth mix that block's
  attention (the final aggregation) computes.
* **skip** block ``l``: the whole block returns its input state (``layer.skipped``; MoDA appends zero depth K/V
  slots). AttnRes: nothing is added to the source bank, and the next consumer, if it is a boundary mix (block
  ``l + 1``'s attention or the final aggregation), becomes the identity on its newest source.
* **swap** blocks ``i, j``: every tensor of the two blocks (branches, norms, HC/mHC routing, KEEL/DeepNorm post
  norms; keys one block lacks stay in place) and the position scalars the design lists (LNS 1/sqrt(l)). AttnRes:
  a block's own attention-side mixer stays, the mixer that reads its output (the next block's attention mixer or
  the final one) travels with it.

``convention="branch"`` is hf_depth's branch-level view (``common``): branches output zeros, only branch weights
and input norms move, the state is the collapsed stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from . import common
from .common import Batch, base_model, decoder_layers

CONVENTIONS = ("depthbench", "branch")
DEFAULT = "depthbench"


def check(convention: str) -> str:
    if convention not in CONVENTIONS:
        raise ValueError(f"`convention` must be one of {list(CONVENTIONS)}, got {convention!r}")
    return convention


def _stream(model):
    return getattr(base_model(model), "stream", None)


def _depth_state_fn(model):
    stream = _stream(model)
    if stream is not None and hasattr(stream, "depth_state"):
        return stream.depth_state
    return lambda s: s[0] if isinstance(s, (tuple, list)) else s


def _attention_connection(layer):
    conns = layer.connections() if hasattr(layer, "connections") else ()
    return conns[0] if conns else None


def _mixer(owner, boundary: bool) -> nn.Module | None:
    if owner is None:
        return None
    fn = getattr(owner, "boundary_mixer" if boundary else "depth_mixer", None)
    return fn() if fn is not None else None


def boundary_mixers(model) -> dict[int, nn.Module]:
    """{state index: mixer whose raw output is that state}: blocks 1..L-1 whose attention starts a source block,
    and L (the final aggregation)."""
    layers = decoder_layers(model)
    out = {}
    for idx in range(1, len(layers)):
        m = _mixer(_attention_connection(layers[idx]), boundary=True)
        if m is not None:
            out[idx] = m
    final = _mixer(_stream(model), boundary=False)
    if final is not None:
        out[len(layers)] = final
    return out


def next_consumer(model, layer_idx: int) -> nn.Module | None:
    """The boundary mix that reads block ``layer_idx``'s output, if any (DepthBench ``_next_boundary_query``)."""
    layers = decoder_layers(model)
    if layer_idx + 1 == len(layers):
        return _mixer(_stream(model), boundary=False)
    return _mixer(_attention_connection(layers[layer_idx + 1]), boundary=True)


@torch.no_grad()
def forward_states(model: nn.Module, batch: Batch, convention: str = DEFAULT, states: bool = True) -> common.Forward:
    """One forward: the convention's states ``z_0 .. z_L``, logits and the summed loss over real tokens."""
    if check(convention) == "branch" or not states:
        return common.forward_states(model, batch, states)
    layers = decoder_layers(model)
    L = len(layers)
    z: list[torch.Tensor | None] = [None] * (L + 1)
    depth_state = _depth_state_fn(model)
    handles = []

    def pre(_m, args, kwargs):
        if z[0] is None:
            z[0] = depth_state(args[0] if args else kwargs["state"])

    handles.append(layers[0].register_forward_pre_hook(pre, with_kwargs=True))
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_hook(lambda _m, _a, out, i=i: z.__setitem__(i + 1, depth_state(out))))
    mixes: dict[int, torch.Tensor] = {}
    for idx, mixer in boundary_mixers(model).items():
        handles.append(mixer.register_forward_hook(lambda _m, _a, out, idx=idx: mixes.__setitem__(idx, out)))
    try:
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    for idx, m in mixes.items():
        z[idx] = m
    s, n = common.token_loss(out.logits, batch)
    return common.Forward(list(z), out.logits, s, n)


def _newest_source(_module, args, _out):
    return args[0][-1]


@contextlib.contextmanager
def skip_layer(model: nn.Module, layer_idx: int, convention: str = DEFAULT) -> Iterator[None]:
    """Remove block ``layer_idx`` in the convention's sense (see the module docstring)."""
    if check(convention) == "branch":
        with common.skip_layer(model, layer_idx):
            yield
        return
    layer = decoder_layers(model)[layer_idx]
    skipped = getattr(layer, "skipped", None) or (lambda state: state)
    own_mix = _mixer(_attention_connection(layer), boundary=True) if layer_idx > 0 else None
    handles = []
    consumer = next_consumer(model, layer_idx)
    if consumer is not None:
        handles.append(consumer.register_forward_hook(_newest_source))

    def forward(state, *args, **kwargs):
        if own_mix is not None:
            own_mix(state)  # still formed, so that the block's left boundary state z_l is observed (DepthBench)
        return skipped(state)

    layer.forward = forward
    try:
        yield
    finally:
        del layer.forward
        for h in handles:
            h.remove()


def _module_tensors(module: nn.Module | None) -> dict[str, torch.Tensor]:
    if module is None:
        return {}
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def _block_tensors(model, idx: int) -> dict[str, torch.Tensor]:
    """What travels with block ``idx``: all its tensors but its attention-side depth mixer, plus the mixer that
    reads its output."""
    layers = decoder_layers(model)
    layer = layers[idx]
    stay = {id(t) for t in _module_tensors(_mixer(_attention_connection(layer), boundary=False)).values()}
    out = {k: v for k, v in _module_tensors(layer).items() if id(v) not in stay}
    if idx + 1 < len(layers):
        reader = _mixer(_attention_connection(layers[idx + 1]), boundary=False)
    else:
        reader = _mixer(_stream(model), boundary=False)
    out.update({f"<output mixer>.{k}": v for k, v in _module_tensors(reader).items()})
    return out


def _swap_pairs(model, i: int, j: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    a, b = _block_tensors(model, i), _block_tensors(model, j)
    return [(t, b[k]) for k, t in a.items() if k in b and b[k].shape == t.shape and b[k].dtype == t.dtype]


def _scalar_pairs(model, i: int, j: int) -> list[tuple[nn.Module, nn.Module, str]]:
    layers = decoder_layers(model)
    out = []
    if not (hasattr(layers[i], "connections") and hasattr(layers[j], "connections")):
        return out
    for ca, cb in zip(layers[i].connections(), layers[j].connections()):
        out += [(ca, cb, name) for name in getattr(ca, "position_scalars", ()) if hasattr(cb, name)]
    return out


def swappable(model: nn.Module, i: int, j: int, convention: str = DEFAULT) -> bool:
    if check(convention) == "branch":
        return common.swappable(model, i, j)
    return i != j  # DepthBench swaps whatever the two blocks share; keys one lacks stay in place


def _exchange(model, i, j):
    for a, b in _swap_pairs(model, i, j):
        a.data, b.data = b.data, a.data
    for ca, cb, name in _scalar_pairs(model, i, j):
        va, vb = getattr(ca, name), getattr(cb, name)
        setattr(ca, name, vb)
        setattr(cb, name, va)


@contextlib.contextmanager
def swap_layers(model: nn.Module, i: int, j: int, convention: str = DEFAULT) -> Iterator[None]:
    """Exchange blocks ``i`` and ``j`` in place (tensor pointers, no copies) and back on exit."""
    if check(convention) == "branch":
        with common.swap_layers(model, i, j):
            yield
        return
    _exchange(model, i, j)
    try:
        yield
    finally:
        _exchange(model, i, j)


# ----------------------------------------------------------------------------------------------- global aggregates
def global_causal_score(scores: torch.Tensor) -> dict:
    """DepthBench ``compute_global_causal_score``: per skipped layer s < L - 1 the mean of C(s, l > s); the global
    score is (1 / sqrt(L)) (1 / L) times their sum."""
    L = scores.shape[0]
    per = []
    for s in range(L - 1):
        row = scores[s, s + 1:].double()
        row = row[~torch.isnan(row)]
        per.append(float(row.mean()) if row.numel() else 0.0)
    g = (1.0 / L**0.5) * (1.0 / L) * sum(per) if L else 0.0
    return {"global_causal_score": g, "avg_effect_per_layer": per + ([0.0] if L else [])}


def global_permutation_scores(scores: torch.Tensor) -> dict:
    """DepthBench ``compute_global_permutation_score`` over the measured pairs (i < j): mean, sum / (L (L-1) / 2),
    and the mean over layers of (mean score of the pairs containing the layer) x 0.9^layer."""
    L = scores.shape[0]
    pairs = [(a, b, float(scores[a, b])) for a in range(L) for b in range(a + 1, L) if not torch.isnan(scores[a, b])]
    if not pairs:
        return {"global_score_mean": 0.0, "global_score_normalized": 0.0, "global_score_weighted": 0.0,
                "layer_avg_scores": []}
    vals = [v for _, _, v in pairs]
    sums, counts = [0.0] * L, [0] * L
    for a, b, v in pairs:
        for k in (a, b):
            sums[k] += v * 0.9**k
            counts[k] += 1
    avg = [sums[k] / counts[k] if counts[k] else 0.0 for k in range(L)]
    max_pairs = L * (L - 1) / 2
    return {"global_score_mean": sum(vals) / len(vals),
            "global_score_normalized": sum(vals) / max_pairs if max_pairs else 0.0,
            "global_score_weighted": sum(avg) / L, "layer_avg_scores": avg}
