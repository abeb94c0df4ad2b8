"""HiRes, Hierarchical Residuals: a D-wide outer residual around blocks of k d-wide Pre-LN layers.

    h <- R_b X                                   read  D -> d  at the entry of block b (block 0: h = embedding)
    h <- h + F_l(N_l(h))                         the k standard Pre-LN sublayer pairs of block b, width d
    X <- N_D( X + W_b (h_end - h_start) )        write d -> D of the block's update, PostNorm on the outer stream

X_0 = [e ; 0] (the d-wide embedding zero-padded to D). Only dense projections and norms: no special kernel.
The summary ("Hierarchical Residuals: A Minimalist Decoupling of Residual Width from Compute Width", 1.30x FLOPs
efficiency) leaves the details below open; each is a config field (``HiResConfig``):

* widths: embedding and LM head at d (vocab parameters as the d-wide model); outer width D = 2d by default.
* first read: block 0 starts from the embedding itself (no R_0; with ``hires_embed="project"`` a learned
  d -> D write of the embedding builds X_0 instead of zero padding).
* what is written: the block's *update* h_end - h_start (the sum of its branch outputs, accumulated exactly),
  not h_end, which would write R X back into X a second time.
* last block: by default (``hires_final="inner"``) it writes nothing; the final norm and the LM head read its
  inner d-wide stream. ``"outer"``: it writes like the others and the head reads R_B X through the final norm.
* init (``hires_init="identity"``): R = [I_d | 0] (reads the first d coordinates) and W = [I_d ; E] with E
  trunc-normal(initializer_range), so the extra D - d rows start near zero and are read by nothing: at init the
  model computes its d-wide Pre-LN with a PostNorm every k layers, and the extra width receives gradients from
  the first step. (A zero W would make every block restart from the embedding: a depth-k model at init.)
  ``"normal"``: R and W trunc-normal like every other linear map.

``collapse`` (``output_hidden_states``, diagnostics) is the inner d-wide stream h (= R_b X at a block entry).
Extra parameters: per block boundary 2 D d + D (the N_D gamma); (ceil(L/k) - 1) boundaries by default.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from .configuration_depth import DepthConfig, _choice, _positive_int
from .modeling_depth import DepthForCausalLM, DepthModel
from .norms import make_norm, norm_param_count
from .residual import Design, ResidualStream, SublayerConnection, register

HIRES_INITS = ("identity", "normal")
HIRES_EMBEDS = ("pad", "project")
HIRES_FINALS = ("inner", "outer")


class HiResConfig(DepthConfig):
    """HiRes decoder (see the module docstring for the equations and the reasons behind each default).

    Args:
        hires_outer_size: outer residual width D (> hidden_size); ``None`` means 2 * hidden_size.
        hires_block_layers: k, decoder layers per block (default 4); the last block holds the remainder when k
            does not divide L; k >= L gives a single block, i.e. exactly Pre-LN.
        hires_init: ``"identity"`` (default: R = [I | 0], W = [I ; small normal]) or ``"normal"``.
        hires_embed: ``"pad"`` (default: X_0 = [e ; 0], no parameters) or ``"project"`` (X_0 = W_e e, a learned
            d -> D map initialized like W).
        hires_final: ``"inner"`` (default: the last block does not write; the head reads its inner stream) or
            ``"outer"`` (the last block writes and the head reads R X).
    """

    model_type = "hf_depth_hires"
    design = "hires"

    hires_outer_size: int | None = None
    hires_block_layers: int = 4
    hires_init: str = "identity"
    hires_embed: str = "pad"
    hires_final: str = "inner"

    def validate_design(self):
        D = self.hires_outer_size
        if D is not None and (not isinstance(D, int) or isinstance(D, bool) or D <= self.hidden_size):
            raise ValueError(
                f"`hires_outer_size` must be None (2 * hidden_size) or an integer > hidden_size={self.hidden_size}, "
                f"got {D!r}"
            )
        _positive_int("hires_block_layers", self.hires_block_layers)
        _choice("hires_init", self.hires_init, HIRES_INITS)
        _choice("hires_embed", self.hires_embed, HIRES_EMBEDS)
        _choice("hires_final", self.hires_final, HIRES_FINALS)

    @property
    def outer_size(self) -> int:
        return self.hires_outer_size if self.hires_outer_size is not None else 2 * self.hidden_size

    @property
    def num_blocks(self) -> int:
        return math.ceil(self.num_hidden_layers / self.hires_block_layers)

    @property
    def num_boundaries(self) -> int:
        """Blocks that end with a write (every block but the last, unless ``hires_final="outer"``)."""
        return self.num_blocks - 1 + (self.hires_final == "outer")


def hires_write(X: torch.Tensor, update: torch.Tensor, write: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """X' = N_D(X + W update): the outer residual step at a block boundary (W: [D, d])."""
    return norm(X + F.linear(update, write))


def identity_like(weight: torch.Tensor, config, extra_random: bool) -> torch.Tensor:
    """[I | 0] for a read [d, D]; [I ; E] for a write [D, d], E trunc-normal(initializer_range) if requested."""
    out = torch.zeros_like(weight)
    d = min(weight.shape)
    out[:d, :d] = torch.eye(d, dtype=weight.dtype, device=weight.device)
    if extra_random and weight.shape[0] > d:
        std, cut = config.initializer_range, config.init_cutoff_factor
        nn.init.trunc_normal_(out[d:], std=std, a=-cut * std, b=cut * std)
    return out


def reset_projection(weight: nn.Parameter, config, is_write: bool) -> None:
    """Initialize a read/write matrix with ``transformers.initialization`` (skips weights loaded from a checkpoint)."""
    if config.hires_init == "normal":
        std, cut = config.initializer_range, config.init_cutoff_factor
        init.trunc_normal_(weight, mean=0.0, std=std, a=-cut * std, b=cut * std)
    else:
        init.copy_(weight, identity_like(weight, config, extra_random=is_write))


class HiResConnection(SublayerConnection):
    """Pre-LN inside a block; the FFN sublayer that ends a block also writes X and reads the next block's h."""

    def __init__(self, config, sublayer_idx):
        super().__init__(config, sublayer_idx)
        self.config = config
        layer, k, L = sublayer_idx // 2, config.hires_block_layers, config.num_hidden_layers
        block = layer // k
        ends_block = sublayer_idx % 2 == 1 and layer == min((block + 1) * k, L) - 1
        self.boundary = ends_block and (block < config.num_blocks - 1 or config.hires_final == "outer")
        if self.boundary:
            d, D = config.hidden_size, config.outer_size
            self.write_proj = nn.Parameter(torch.empty(D, d))
            self.read_proj = nn.Parameter(torch.empty(d, D))
            self.outer_norm = make_norm(config, D, role="output")  # PostNorm on the residual stream itself

    def reset_design_parameters(self):
        if self.boundary:
            reset_projection(self.write_proj, self.config, is_write=True)
            reset_projection(self.read_proj, self.config, is_write=False)

    def read(self, state, norm):
        return norm(state[1]), None

    def write(self, state, out, carry=None):
        X, h, update = state
        h, update = h + out, update + out
        if not self.boundary:
            return X, h, update
        X = hires_write(X, update, self.write_proj, self.outer_norm)
        h = F.linear(X, self.read_proj)
        return X, h, torch.zeros_like(h)

    def extra_repr(self):
        return "boundary (write, N_D, read)" if self.boundary else ""


class HiResStream(ResidualStream):
    """State = (X [B,T,D] outer, h [B,T,d] inner, update [B,T,d] since the block began); collapse = h."""

    def __init__(self, config):
        super().__init__(config)
        self.config = config
        self.pad = config.outer_size - config.hidden_size
        if config.hires_embed == "project":
            self.embed_proj = nn.Parameter(torch.empty(config.outer_size, config.hidden_size))

    def reset_design_parameters(self):
        if self.config.hires_embed == "project":
            reset_projection(self.embed_proj, self.config, is_write=True)

    def init(self, embeds):
        X = F.linear(embeds, self.embed_proj) if self.config.hires_embed == "project" else F.pad(embeds, (0, self.pad))
        return X, embeds, torch.zeros_like(embeds)

    def collapse(self, state):
        return state[1]


def hires_extra_flops(config, T: int, model=None) -> dict:
    """Extra FLOPs per sequence of T tokens over Pre-LN: at each boundary the write W [D, d] and the read R [d, D]
    (2 T d D each) and the D-wide outer add + PostNorm (~5 ops per element); the ``project`` embedding write."""
    d, D = config.hidden_size, config.outer_size
    matmul = 2 * T * d * D * (2 * config.num_boundaries + (config.hires_embed == "project"))
    other = config.num_boundaries * T * (D + 4 * D)  # residual add, then the norm's ~4 ops per element
    return {"matmul": matmul, "other": other}


def hires_extra_params(config) -> int:
    d, D = config.hidden_size, config.outer_size
    per_boundary = 2 * D * d + norm_param_count(config, D, role="output")
    return config.num_boundaries * per_boundary + (D * d if config.hires_embed == "project" else 0)


class HiResModel(DepthModel):  # HiRes decoder (no LM head)
    config_class = HiResConfig


class HiResForCausalLM(DepthForCausalLM):  # HiRes causal LM
    config_class, base_model_class = HiResConfig, HiResModel


DESIGN = register(Design(
    "hires",
    HiResConfig,
    HiResModel,
    HiResForCausalLM,
    connection=HiResConnection,
    stream=HiResStream,
    # the outer read/write maps are decayed like the other matrices
    param_roles={"write_proj": "design", "read_proj": "design", "embed_proj": "design"},
    extra_params=hires_extra_params,
    extra_flops=hires_extra_flops,
    summary="X <- N_D(X + W Block_d(R X)): a D-wide PostNorm outer residual around blocks of k Pre-LN layers",
    paper="Hierarchical Residuals: A Minimalist Decoupling of Residual Width from Compute Width (HiRes, 2026)",
))
