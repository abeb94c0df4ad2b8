"""The contract between the shared decoder and a residual design, and the registry of designs.

A design decides what varies between designs, and nothing else in the decoder changes:

* ``ResidualStream`` (one per model): how the embedding becomes the residual *state*, how the state is
  *collapsed* to one ``[B, T, d]`` view (``output_hidden_states``, diagnostics), and how the final norm is
  applied before the LM head.
* ``SublayerConnection`` (one per sublayer, index s = 2*layer + {0: attention, 1: FFN}), with an explicit
  hand-over::

      x, carry = connection.read(state, norm)        # the branch input (norm: the layer's input norm or None)
      y        = branch(x)                           # attention (which also sees ``carry``) or SwiGLU FFN
      state    = connection.write(state, y, carry)   # fold the branch output back into the state

  ``carry`` is whatever ``write`` needs from ``read`` (HC's mixed streams and write weights, MoDA's depth
  K/V); nothing is kept on the module between the two calls. ``write_then_read`` chains the attention's write
  and the FFN's read; for the Pre-LN pair it is the fused residual add + RMSNorm (``dispatch.add_rms_norm``), and
  MoDA's hands the FFN's carry the positions the attention saw (its depth key is rotated when written).
* ``Design``: the single record of everything that varies by design (classes, norms, init, exact extra
  parameters and FLOPs, parameter roles, default learning rates, OLMo-core name rules), declared in the
  design's own ``design_<name>.py`` and registered with :func:`register`.

The state is whatever the design needs: a ``[B, T, d]`` tensor (Pre-LN), ``[B, T, n, d]`` streams (HC), a
tuple of sources (AttnRes). It must be a tensor or a (nested) tuple of tensors so that gradient
checkpointing can carry it.

The default classes below *are* Pre-LN: ``h <- h + F(N(h))``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import torch
from torch import nn

from .dispatch import add_rms_norm
from .norms import RMSNorm

#: DepthBench's learning-rate grid (sweeps extend it per design with ``Design.sweep_lrs``)
DEPTHBENCH_LRS = (5e-4, 1e-3, 2e-3, 5e-3)
#: the roles a design may declare for its own parameters (``hf_depth.training.optim`` decides the decay)
DESIGN_ROLES = ("design", "routing_static", "routing_dynamic", "routing_scale")
#: the Llama projections and the LM head: the backbone's matmuls, counted by ``diagnostics.cost``
STANDARD_LINEARS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"})


class SublayerConnection(nn.Module):
    """Pre-LN connection of sublayer ``sublayer_idx``: read N(h), write h + F(N(h))."""

    def __init__(self, config, sublayer_idx: int):
        super().__init__()
        self.sublayer_idx = sublayer_idx

    def read(self, state, norm: nn.Module | None):
        """(branch input, carry for ``write``)."""
        return (state if norm is None else norm(state)), None

    def write(self, state, out: torch.Tensor, carry=None):
        return state + out

    def write_then_read(self, state, out: torch.Tensor, carry, following: SublayerConnection, norm: nn.Module | None):
        """``write`` this sublayer's output, then ``following.read``: (state, x, carry). Fused into one
        add + RMSNorm when both halves are the Pre-LN defaults (Triton on CUDA, the reference elsewhere)."""
        if (type(self).write is SublayerConnection.write and type(following).read is SublayerConnection.read
                and type(norm) is RMSNorm):
            state, x = add_rms_norm(state, out, norm.gamma(), norm.eps)
            return state, x, None
        state = self.write(state, out, carry)
        return (state, *following.read(state, norm))

    def path_weights(self) -> dict[str, torch.Tensor] | None:
        """Explicit residual-path weights of this sublayer (AttnRes softmax, HC mixing), ``None`` if implicit."""
        return None

    # ---- what the DepthBench diagnostics convention needs to know (``hf_depth.diagnostics.conventions``)
    #: names of position-derived Python scalars that travel with a block when two blocks are swapped (LNS 1/sqrt(l))
    position_scalars: tuple[str, ...] = ()

    def depth_mixer(self) -> nn.Module | None:
        """The module that mixes earlier sources into this sublayer's input (AttnRes depth softmax; its forward
        returns the raw, pre-norm mix), ``None`` where the input is not a depth mix."""
        return None

    def boundary_mixer(self) -> nn.Module | None:
        """``depth_mixer()`` where this sublayer starts a source block (a true AttnRes boundary), else ``None``."""
        return None

    def skipped(self, state):
        """This sublayer's write when DepthBench's analysis removes its block: none (MoDA: zero depth K/V)."""
        return state

    def layer_modules(self) -> dict[str, nn.Module | None]:
        """Modules this connection uses that the decoder layer registers under these names (MoDA's FFN K/V
        projection is ``model.layers.i.kv_proj``)."""
        return {}


class ResidualStream(nn.Module):
    """Model-level part of a design: embedding -> state, state -> [B, T, d], final norm."""

    def __init__(self, config):
        super().__init__()

    def bind(self, layers: nn.ModuleList) -> None:
        """Called once, when the decoder's layers exist (AttnRes learns its aggregations' static queries)."""

    def init(self, embeds: torch.Tensor):
        return embeds

    def collapse(self, state) -> torch.Tensor:
        return state

    def final(self, state, norm: nn.Module) -> torch.Tensor:
        return norm(self.collapse(state))

    def path_weights(self) -> dict[str, torch.Tensor] | None:
        """Explicit weights of the final aggregation (AttnRes), ``None`` if implicit."""
        return None

    def depth_state(self, state) -> torch.Tensor:
        """The state DepthBench's analysis measures (``depth_probes.forward_depth_states``): by default the
        collapsed ``[B, T, d]`` view; HC/mHC the n streams side by side ``[B, T, n d]``; AttnRes the running
        partial sum (a block's plain output)."""
        return self.collapse(state)

    def depth_mixer(self) -> nn.Module | None:
        """The final depth mix (AttnRes), whose raw output is DepthBench's ``z_L``; ``None`` if there is none."""
        return None


class AttentionCarry(abc.ABC):
    """A carry that the attention consults (MoDA's depth K/V). The shared attention calls ``attend`` after RoPE
    and the cache update, instead of its own attention function."""

    @abc.abstractmethod
    def attend(self, module: nn.Module, q, k_new, v_new, k, v, attention_mask, position_embeddings,
               raw_k=None) -> torch.Tensor:
        """Attention output [B, T, heads, head_dim] (``k_new``/``v_new``: this forward's keys/values after RoPE;
        ``k``/``v``: with the cached past; ``raw_k``: this forward's keys before RoPE)."""


UPCYCLE_EXACT_TOL = 1e-5
"""fp32 max |delta logits| of an ``exact`` upcycling (``Design.upcycle_closeness``)."""


def upcycle_exact(config) -> tuple[str, float]:
    """``Design.upcycle_closeness`` of a design that is Pre-LN's function whatever its fields (Pre-LN itself)."""
    return "exact", UPCYCLE_EXACT_TOL


def extra_linear_flops(config, T: int, model: nn.Module | None = None) -> dict:
    """The default ``Design.extra_flops``: 2 T in out for every ``nn.Linear`` of ``model`` outside the Llama
    projections (0 without a model)."""
    total = 0
    for name, mod in (model.named_modules() if model is not None else ()):
        if isinstance(mod, nn.Linear) and name.split(".")[-1] not in STANDARD_LINEARS:
            total += 2 * T * mod.in_features * mod.out_features
    return {"matmul": total, "other": 0}


#: bytes of the activations that the trainer keeps in the parameters' dtype (fp32: the residual stream, norm
#: statistics and normalized values) whatever the autocast dtype
STREAM_BYTES = 4


def rms_norm_saved_bytes(d: int, input_bytes: int = STREAM_BYTES) -> int:
    """Per token, what the reference RMSNorm saves (``functional.rms_norm``): its input in fp32 (the input itself,
    or its fp32 copy), 1/rms (fp32) and the normalized value in the input's dtype (for the gamma product)."""
    return d * STREAM_BYTES + 4 + d * input_bytes


def no_extra_params(config) -> int:
    return 0


@dataclass(frozen=True)
class Design:
    """A registry entry: everything that varies by design. Adding a design = one ``design_<name>.py`` file that
    builds one of these with :func:`register` + one import line in ``registry.py``."""

    name: str
    config_class: type
    #: ``<Name>Model`` / ``<Name>ForCausalLM``, declared in the design file (``register`` binds them here)
    model_class: type | None = None
    causal_lm_class: type | None = None
    _: KW_ONLY
    #: {local parameter name: role} of every parameter the design adds that is not a Linear / Embedding / norm
    #: (roles in ``DESIGN_ROLES``; required: a model refuses to build with an undeclared parameter)
    param_roles: dict[str, str]
    connection: type = SublayerConnection
    stream: type = ResidualStream
    #: build the branch input norm of a sublayer: ``fn(config, sublayer_idx) -> nn.Module | None``
    input_norm: Callable | None = None
    #: init multiplier of a branch weight: ``fn(config, layer_idx, name) -> float`` (DeepNorm's beta, HC's 1/sqrt(n))
    init_scale: Callable | None = None
    #: parameters beyond a Pre-LN model of the same config: ``fn(config) -> int`` (exact; see ``hf_depth.shapes``)
    extra_params: Callable = no_extra_params
    #: prefill FLOPs beyond Pre-LN per sequence: ``fn(config, T, model=None) -> {"matmul": int, "other": int}``
    extra_flops: Callable = extra_linear_flops
    #: KV-cache bytes beyond the sequence KV: ``fn(config, seq_len, batch, bytes_per) -> int``
    extra_kv_bytes: Callable | None = None
    #: saved-activation bytes of one training forward beyond Pre-LN's (negative: fewer), analytic:
    #: ``fn(config, batch, seq_len, compute_bytes) -> int`` (``compute_bytes``: 2 under bf16 autocast, 4 in fp32;
    #: the residual stream stays fp32); see ``hf_depth.diagnostics.cost.analytic_activation_bytes``
    extra_activation_bytes: Callable | None = None
    #: learning rate of the generated recipes, and the grid of sweeps (DepthBench's, per design)
    lr: float = 2e-3
    sweep_lrs: tuple[float, ...] = DEPTHBENCH_LRS
    #: DepthBench / OLMo-core name rules (``olmo_rules.OlmoRules``), ``None``: not convertible
    olmo: Any = None
    #: upcycling (``hf_depth.upcycling``): the config fields that make the design compute Pre-LN's function at its
    #: init (set unless the caller gives them), and ``fn(config) -> ("exact" | "bounded", fp32 max |delta logits|
    #: bound)`` where the config does so, else ``None`` ("differs"); ``None``: never promised
    upcycle_fields: dict = field(default_factory=dict)
    upcycle_closeness: Callable | None = None
    summary: str = ""
    paper: str = ""

    def __post_init__(self):
        bad = {k: v for k, v in self.param_roles.items() if v not in DESIGN_ROLES}
        if bad:
            raise ValueError(f"design {self.name!r}: `param_roles` values must be in {list(DESIGN_ROLES)}, got {bad}")


#: every registered design by name, and its (model, causal LM) classes
DESIGNS: dict[str, Design] = {}
MODEL_CLASSES: dict[str, tuple[type, type]] = {}


def register(design: Design) -> Design:
    """Add ``design`` to the registry and bind it to its model classes (their ``design`` attribute)."""
    if design.model_class is None or design.causal_lm_class is None:
        raise ValueError(f"design {design.name!r} needs `model_class` and `causal_lm_class`")
    if getattr(design.config_class, "design", None) != design.name:
        raise ValueError(f"design {design.name!r}: `{design.config_class.__name__}.design` must be {design.name!r}")
    old = DESIGNS.get(design.name)
    if old is not None and old.config_class.__qualname__ != design.config_class.__qualname__:
        raise ValueError(f"a different design named {design.name!r} is already registered")
    design.model_class.design = design.causal_lm_class.design = design
    DESIGNS[design.name] = design
    MODEL_CLASSES[design.name] = (design.model_class, design.causal_lm_class)
    return design
