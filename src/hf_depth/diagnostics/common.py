"""What every diagnostic needs from a model, for any hf_depth design and any supported Hub decoder family.

Where a family keeps its layers, branches, norms and readout is its adapter's business (``adapters.py``:
Llama, Mistral, Qwen2/3, Gemma2/3, Phi3, OLMo2, GPT-2, GPT-NeoX); below in Llama's names. Only generic
interfaces are used:

* ``model(input_ids, attention_mask, output_hidden_states=True).hidden_states``: L + 1 entries ``[B, T, d]``.
  The last entry is *after* the final norm (Llama and hf_depth alike), so :func:`forward_states` replaces it
  with the last decoder layer's raw output (collapsed with ``model.model.stream.collapse`` for hf_depth
  designs whose state is not one tensor). Every diagnostic thus sees ``h_0 .. h_L`` on the residual path.
* the decoder layer list ``model.model.layers``; in each layer the branches ``self_attn`` and ``mlp`` and
  their input norms ``input_layernorm`` / ``post_attention_layernorm`` (absent for Post-LN designs);
* ``model.model.norm`` and ``model.lm_head`` (LogitLens).

**Skipping a layer** (causal score, pruning) means *its branches contribute nothing*: forward hooks make
``self_attn`` and ``mlp`` of that layer return zeros, and the layer's connections then write a zero update.
Per design that is: Pre-LN / LNS / Sandwich-LN ``h <- h`` (the identity); Post-LN ``h <- N(h)``, DeepNorm
``h <- LN(alpha h)``, KEEL ``h <- N_post(alpha h)`` (the post-add norm still runs: it sits on the residual path,
not in the branch); HC ``H <- A_r^T H`` (streams still mix, beta * 0 is written); mHC ``H <- H_res H``; AttnRes
a zero source is appended (it still takes softmax weight, as a removed layer in a trained model would leave a
zero output); MoDA the attention/FFN outputs are zero but their depth K/V are still written. This is *not*
"return the input state", which for HC/AttnRes would also drop the layer's routing.

**Swapping two layers** (permutation score) moves *branch* weights only: every parameter and buffer of
``self_attn``, ``mlp``, ``input_layernorm`` and ``post_attention_layernorm`` is exchanged in place (tensor
pointers swapped, no copy) while everything position-dependent stays where it is: the connections
(``layer.connections()``: LNS's 1/sqrt(l), HC's one-hot stream index and routing, AttnRes queries, KEEL's and
DeepNorm's post norms, mHC's phi), the attention's ``layer_idx`` (cache slot) and model-level parameters.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..utils import next_token_nll
from .adapters import adapter_for

BRANCHES = ("self_attn", "mlp")
BRANCH_NORMS = ("input_layernorm", "post_attention_layernorm")


@dataclass
class Batch:
    """Calibration batch: ``input_ids`` and ``attention_mask`` ``[B, T]`` (1 = real token, 0 = padding)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor

    def to(self, device) -> Batch:
        return Batch(self.input_ids.to(device), self.attention_mask.to(device))

    @property
    def tokens(self) -> torch.Tensor:
        return self.attention_mask.bool()


def as_batches(batches) -> list[Batch]:
    """Accept ``Batch`` objects, ``(ids, mask)`` pairs or bare id tensors (no padding)."""
    out = []
    for b in batches:
        if isinstance(b, Batch):
            out.append(b)
        elif isinstance(b, (tuple, list)):
            out.append(Batch(b[0], b[1]))
        else:
            out.append(Batch(b, torch.ones_like(b)))
    return out


def base_model(model: nn.Module) -> nn.Module:
    """The decoder (``model.model`` for CausalLM wrappers)."""
    return getattr(model, "model", model)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return adapter_for(model).layers()


def num_layers(model: nn.Module) -> int:
    return len(decoder_layers(model))


def late_start(num: int) -> int:
    """First index of the last 3/4 of the network, ceil(L/4) (DepthBench)."""
    return math.ceil(num / 4)


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _collapse_fn(model):
    return adapter_for(model).collapse


@contextlib.contextmanager
def capture_last_layer(model: nn.Module) -> Iterator[dict]:
    """Record the last decoder layer's output, collapsed to ``[B, T, d]`` (the pre-final-norm ``h_L``)."""
    box, collapse = {}, _collapse_fn(model)

    def hook(module, args, out):
        box["h"] = collapse(out)

    handle = decoder_layers(model)[-1].register_forward_hook(hook)
    try:
        yield box
    finally:
        handle.remove()


@dataclass
class Forward:
    states: list[torch.Tensor]  # h_0 .. h_L, [B, T, d], residual path (h_L before the final norm)
    logits: torch.Tensor
    loss_sum: float  # summed next-token CE over real target tokens
    loss_count: int


def token_loss(logits: torch.Tensor, batch: Batch) -> tuple[float, int]:
    """Summed next-token cross entropy over positions whose input and target are real tokens."""
    return next_token_nll(logits, batch.input_ids, batch.tokens)


@torch.no_grad()
def forward_states(model: nn.Module, batch: Batch, states: bool = True) -> Forward:
    """One forward: residual states h_0..h_L (optional), logits and the summed loss."""
    with capture_last_layer(model) as box:
        out = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=states,
            use_cache=False,
        )
    hs = []
    if states:
        hs = list(out.hidden_states)
        hs[-1] = box["h"]
    s, n = token_loss(out.logits, batch)
    return Forward(hs, out.logits, s, n)


@torch.no_grad()
def mean_loss(model: nn.Module, batches: Iterable[Batch]) -> float:
    tot, cnt = 0.0, 0
    for b in batches:
        f = forward_states(model, b, states=False)
        tot, cnt = tot + f.loss_sum, cnt + f.loss_count
    return tot / max(cnt, 1)


def _zero_output(module, args, out):
    if isinstance(out, tuple):
        return (torch.zeros_like(out[0]), *out[1:])
    return torch.zeros_like(out)


@contextlib.contextmanager
def skip_layer(model: nn.Module, layer_idx: int) -> Iterator[None]:
    """Make layer ``layer_idx``'s branches (``self_attn`` and ``mlp``) output zeros (see the module docstring)."""
    adapter = adapter_for(model)
    layer = adapter.layers()[layer_idx]
    handles = []
    for name in adapter.branches:
        mod = getattr(layer, name, None)
        if mod is None:
            raise ValueError(f"layer {layer_idx} of {type(model).__name__} has no `{name}` branch")
        handles.append(mod.register_forward_hook(_zero_output))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def branch_tensors(layer: nn.Module, names=(*BRANCHES, *BRANCH_NORMS)) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of a layer's branches and their norms (``names``: the family's), by name."""
    out = {}
    for name in names:
        mod = getattr(layer, name, None)
        if mod is None:
            continue
        for n, p in mod.named_parameters():
            out[f"{name}.{n}"] = p
        for n, b in mod.named_buffers():
            out[f"{name}.{n}"] = b
    return out


def _branch_pair(model: nn.Module, i: int, j: int):
    adapter = adapter_for(model)
    layers, names = adapter.layers(), (*adapter.branches, *adapter.branch_norms)
    return branch_tensors(layers[i], names), branch_tensors(layers[j], names)


def swappable(model: nn.Module, i: int, j: int) -> bool:
    a, b = _branch_pair(model, i, j)
    return a.keys() == b.keys() and all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype for k in a)


def _swap_data(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for k in a:
        a[k].data, b[k].data = b[k].data, a[k].data


@contextlib.contextmanager
def swap_layers(model: nn.Module, i: int, j: int) -> Iterator[None]:
    """Exchange the branch weights of layers ``i`` and ``j`` in place (pointer swap), and back on exit."""
    if not swappable(model, i, j):
        raise ValueError(f"layers {i} and {j} have branch tensors of different names/shapes: cannot swap")
    a, b = _branch_pair(model, i, j)
    _swap_data(a, b)
    try:
        yield
    finally:
        _swap_data(a, b)


def progress(iterable, total=None, desc="", enabled=True):
    """tqdm progress bar (to stderr) when enabled."""
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, leave=False, dynamic_ncols=True)


def nan_to_none(x):
    """JSON-safe nested lists/dicts: tensors -> lists, NaN/inf -> None."""
    if isinstance(x, torch.Tensor):
        x = x.tolist()
    if isinstance(x, dict):
        return {k: nan_to_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [nan_to_none(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
