"""The contract between the shared decoder and a residual design.

A design decides three things, and nothing else in the decoder changes between designs:

* ``ResidualStream`` (one per model): how the embedding becomes the residual *state*, how the state is
  *collapsed* to one ``[B, T, d]`` view (``output_hidden_states``, diagnostics), and how the final norm is
  applied before the LM head.
* ``SublayerConnection`` (one per sublayer, index s = 2*layer + {0: attention, 1: FFN}): ``read`` turns the
  state into the branch input (it receives the layer's input norm, or ``None`` for Post-LN designs) and
  ``write`` folds the branch output back into the state.
* ``Design`` (registry entry): which classes to use, whether sublayers have an input norm, and init rules.

The state is whatever the design needs: a ``[B, T, d]`` tensor (Pre-LN), ``[B, T, n, d]`` streams (HC), a
tuple of sources (AttnRes). It must be a tensor or a (nested) tuple of tensors so that gradient
checkpointing can carry it.

The default classes below *are* Pre-LN: ``h <- h + F(N(h))``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn


class SublayerConnection(nn.Module):
    """Pre-LN connection of sublayer ``sublayer_idx``: read N(h), write h + F(N(h))."""

    def __init__(self, config, sublayer_idx: int):
        super().__init__()
        self.sublayer_idx = sublayer_idx

    def read(self, state, norm: nn.Module | None) -> torch.Tensor:
        return state if norm is None else norm(state)

    def write(self, state, out: torch.Tensor):
        return state + out

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


class ResidualStream(nn.Module):
    """Model-level part of a design: embedding -> state, state -> [B, T, d], final norm."""

    def __init__(self, config):
        super().__init__()

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


@dataclass(frozen=True)
class Design:
    """A registry entry. Adding a design = one file defining these pieces + one line in ``registry.py``."""

    name: str
    config_class: type
    connection: type = SublayerConnection
    stream: type = ResidualStream
    #: build the branch input norm of a sublayer: ``fn(config, sublayer_idx) -> nn.Module | None``
    input_norm: Callable | None = None
    #: init multiplier of a branch weight: ``fn(config, layer_idx, name) -> float`` (DeepNorm's beta, HC's 1/sqrt(n))
    init_scale: Callable | None = None
    #: parameters beyond a Pre-LN model of the same config: ``fn(config) -> int`` (exact; see ``hf_depth.shapes``)
    extra_params: Callable | None = None
    #: optional replacements of the decoder layer / attention class (MoDA): a class or a factory called as
    #: ``layer_class(config, layer_idx, design)`` / ``attention_class(config, layer_idx)``
    layer_class: type | None = None
    attention_class: type | None = None
    summary: str = ""
    paper: str = ""
    extra: dict = field(default_factory=dict)
