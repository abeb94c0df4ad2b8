"""Attention Residuals: Full AttnRes and Block AttnRes (DepthBench ``attnres``).

    x_l = N_l( sum_i p_{l,i} v_i ),   p_{l,.} = softmax_i( <w_l, g_l * N̄(v_i)> )          (no 1/sqrt(d))
    Full:   sources v_0 = embedding, v_i = raw output of sublayer i-1, for i <= l (not cumulative sums)
    Block:  sources = [embedding, completed block sums b_1..b_k, running partial sum of the current block]
    final:  h_out = N( sum_i softmax_i(<w_f, g_f * N̄(v_i)>) v_i )   over every source, a model-level query

``w_l`` is a per-sublayer pseudo-query, zero at init (uniform weights: the model then equals Pre-LN with the
same branch weights, up to eps, since RMSNorm ignores the 1/n of a mean) and kept zero by every init sweep
(``reset_design_parameters``); ``g_l`` the key RMSNorm weight (ones). Sublayer 0 has a single source (the
embedding) and therefore no query: extra parameters are 2d per sublayer except sublayer 0, plus 2d for the
final aggregation = 4Ld in all (98,304 at L=24, d=1024), independent of the block size.

Block boundaries (DepthBench rule, sizes counted in sublayers): sublayer s is a boundary iff s % S == 0;
at a boundary (s > 0) the running partial sum is committed as a new source before sublayer s reads.
S = 1 commits every output on its own: Block AttnRes with S = 1 is Full AttnRes.

``attnres_norm_eps`` (default ``None`` = ``rms_norm_eps``) is the eps of every aggregation's key norm N̄ and of
the norm N_l / N applied to an aggregation's output (sublayer 0 reads the embedding through its plain input norm).
DepthBench builds these norms without an eps, so OLMo-core's 1e-5 applies to both (``kernels/attnres.py``:
one ``rms_eps`` for keys and fused output norm); ``hf-depth convert-olmo-core`` sets 1e-5 for its checkpoints.

The residual state is a flat tuple of source tensors (each [B, T, d]); its layout at each sublayer is static.
Mixing is within a token, so incremental decoding needs nothing beyond the attention KV cache.
Kimi Team, "Attention Residuals" (arXiv 2603.15031).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import initialization as init

from .configuration_depth import DepthConfig, _choice, check_fields
from .depth_ops import SourceBank, attach_queries, depth_aggregate
from .dispatch import rms_norm
from .modeling_depth import DepthForCausalLM, DepthModel
from .norms import RMSNorm, make_norm, norm_param_count
from .olmo_rules import OlmoRules, norm, one, pre_norms
from .residual import STREAM_BYTES, UPCYCLE_EXACT_TOL, Design, ResidualStream, SublayerConnection, register

ATTNRES_SCHEDULES = ("fixed", "depth_aware")


class AttnResConfig(DepthConfig):
    """Full AttnRes decoder: every sublayer attends (softmax over depth) to the embedding and every earlier
    sublayer output; see ``BlockAttnResConfig`` for the block variant.

    Args:
        attnres_norm_eps: eps of the aggregation key norms and of the norm of each aggregation's output;
            ``None`` (default) uses ``rms_norm_eps``. DepthBench checkpoints: 1e-5 (OLMo-core's default).
        attnres_scale_by_sources: multiply each depth mix by its number of sources K (a constant of the
            sublayer) before its norm. With zero queries the mix is then the plain sum of the sources, i.e. the
            Pre-LN residual stream, and the model equals Pre-LN exactly, eps included (the default mean, 1/K of
            it, equals Pre-LN only up to eps: N(h / K) != N(h) where |h|^2 / d is not >> K^2 eps).
            ``hf_depth.upcycle`` sets it so that an upcycled model computes its source's function. Default
            False: the paper's and DepthBench's mean.
    """

    model_type = "hf_depth_attnres"
    design = "attnres"

    attnres_norm_eps: float | None = None
    attnres_scale_by_sources: bool = False

    def validate_design(self):
        v = self.attnres_norm_eps
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < 1):
            raise ValueError(f"`attnres_norm_eps` must be None (= rms_norm_eps) or a number in (0, 1), got {v!r}")

    @property
    def attnres_eps(self) -> float:
        """The eps of the aggregation norms (``attnres_norm_eps``, else ``rms_norm_eps``)."""
        return self.rms_norm_eps if self.attnres_norm_eps is None else self.attnres_norm_eps

    @property
    def attnres_block_sublayers(self) -> int:
        """Block size S in sublayers (1 = every output is its own source)."""
        return 1


class BlockAttnResConfig(AttnResConfig):
    """Block AttnRes decoder: the same depth softmax over [embedding, completed block sums, partial sum].

    Args:
        attnres_block_size: block size S in **sublayers** (attention and FFN count one each, as DepthBench and
            fla); sublayer s starts a block iff s % S == 0. ``None`` (default) derives S from the schedule.
            1 gives Full AttnRes.
        attnres_num_blocks: number of blocks of the ``fixed`` schedule (default 8, DepthBench: 8 blocks
            whatever the depth, S = ceil(2L / 8)); Kimi: ~8 blocks recover most of Full AttnRes.
        attnres_schedule: ``"fixed"`` (default, DepthBench) or ``"depth_aware"``, our addition against the
            "dead segment" DepthBench reports (the first block's layers keep re-reading the embedding: 2 / 5 / 8
            layers at L = 16 / 24 / 32). ``depth_aware`` grows the number of blocks with depth,
            N = max(num_blocks, ceil(num_blocks * L / attnres_reference_depth)), so the block length stays that
            of the reference depth (S = 4 sublayers at the defaults) instead of growing as 2L/8. It is the first
            thing to try when going deep. Ignored when ``attnres_block_size`` is given.
        attnres_reference_depth: the depth L at which ``depth_aware`` matches ``fixed`` (default 16, the
            shallowest DepthBench shape, where the dead segment is shortest).
    """

    model_type = "hf_depth_block_attnres"
    design = "block_attnres"

    attnres_block_size: int | None = None
    attnres_num_blocks: int = 8
    attnres_schedule: str = "fixed"
    attnres_reference_depth: int = 16

    def validate_design(self):
        super().validate_design()
        v = self.attnres_block_size
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            raise ValueError(f"`attnres_block_size` must be None (from the schedule) or a positive integer, got {v!r}")
        check_fields(self, ints=["attnres_num_blocks", "attnres_reference_depth"])
        _choice("attnres_schedule", self.attnres_schedule, ATTNRES_SCHEDULES)

    @property
    def attnres_block_sublayers(self) -> int:
        if self.attnres_block_size is not None:
            return self.attnres_block_size
        n, L = self.attnres_num_blocks, self.num_hidden_layers
        if self.attnres_schedule == "depth_aware":
            n = max(n, math.ceil(n * L / self.attnres_reference_depth))
        return max(1, math.ceil(2 * L / n))


def source_groups(s: int, block_size: int) -> list[list[int]]:
    """The one source layout: the sublayer outputs summed by each source read at sublayer ``s`` (``s = 2L``: the
    final aggregation) after the embedding: groups of ``block_size`` consecutive outputs, the last one partial
    when ``s`` is not a boundary."""
    return [list(range(g, min(g + block_size, s))) for g in range(0, s, block_size)]


def source_layout(config, sublayer_idx: int) -> tuple[int, bool]:
    """(completed sources, has partial) visible to sublayer ``sublayer_idx`` after any commit at its boundary.

    Completed sources count the embedding. Full AttnRes (S = 1): (s + 1, False).
    """
    size = config.attnres_block_sublayers
    partial = sublayer_idx % size != 0
    return 1 + len(source_groups(sublayer_idx, size)) - partial, partial


class DepthAggregation(nn.Module):
    """p = softmax_i(<w, g * N̄(v_i)>), out = sum_i p_i v_i; ``query`` w (zero at init), ``key_norm`` g (ones)."""

    def __init__(self, config):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(config.hidden_size))
        # an Input-Norm (its gamma folds into the query) with one consumer: it keeps its gamma under HG/AP
        self.key_norm = make_norm(config, role="input", final=True)
        self.eps = config.attnres_eps
        self.scale_by_sources = bool(getattr(config, "attnres_scale_by_sources", False))
        self._last_weights: torch.Tensor | None = None

    def reset_design_parameters(self):
        init.zeros_(self.query)  # the paper's init; survives every sweep (init.* skips loaded weights)

    def forward(self, sources: tuple[torch.Tensor, ...], stable: int | None = None) -> torch.Tensor:
        """``sources[:stable]`` (default all) never change after this call; at most one partial sum follows.
        Saved for backward: the sources once per forward (their bank), never a stacked copy per sublayer."""
        out, p = depth_aggregate(self.query, self.key_norm.gamma(), sources, self.eps, stable)
        if self.scale_by_sources:  # K * mean at zero queries: the plain sum of the sources (attnres_scale_by_sources)
            out = out * len(sources)
        # token-averaged, for diagnostics (p is marked non-differentiable: a detach only where it is not)
        # (a plain attribute: nn.Module.__setattr__ costs more, per sublayer)
        self.__dict__["_last_weights"] = (p.detach() if p.requires_grad else p).flatten(0, -2).mean(0).float()
        return out

    def path_weights(self) -> dict[str, torch.Tensor] | None:
        return None if self._last_weights is None else {"weights": self._last_weights}


class AttnResConnection(SublayerConnection):
    """Read N_l(depth softmax over the sources); write commits at block boundaries and accumulates outputs."""

    def __init__(self, config, sublayer_idx):
        super().__init__(config, sublayer_idx)
        self.block_size = config.attnres_block_sublayers
        self.completed, self.has_partial = source_layout(config, sublayer_idx)
        self.aggregate = DepthAggregation(config) if sublayer_idx > 0 else None  # one source: no softmax
        self.total = config.num_sublayers

    def read(self, state, norm):
        if self.aggregate is None:
            return norm(state[0]), None
        return aggregate_norm(norm, self.aggregate(state, self.completed), self.aggregate.eps), None

    def write(self, state, out, carry=None):
        # a sublayer that starts a block opens a new partial sum (the previous one stays behind as a completed
        # source); any other adds to the open one. S = 1: every output is its own source.
        if self.sublayer_idx % self.block_size != 0:
            return (*state[:-1], state[-1] + out)
        return (*state, out)

    def depth_mixer(self):
        return self.aggregate

    def boundary_mixer(self):
        return self.aggregate if self.sublayer_idx % self.block_size == 0 else None

    def path_weights(self):
        """``{"weights": [K], "members": [K, 2L + 1]}`` (token-mean softmax of the last forward; which base
        sources -- embedding, sublayer outputs -- each aggregated source sums), or None for sublayer 0."""
        w = None if self.aggregate is None else self.aggregate.path_weights()
        return None if w is None else {**w, "members": source_members(self.sublayer_idx, self.block_size, self.total)}

    def extra_repr(self):
        return f"sources={self.completed}{'+partial' if self.has_partial else ''}, block_size={self.block_size}"


class AttnResStream(ResidualStream):
    """State = tuple of sources. Collapse = their sum (the Pre-LN residual stream h, whatever the queries);
    final = N(depth softmax over every source with the model-level query)."""

    def __init__(self, config):
        super().__init__(config)
        self.aggregate = DepthAggregation(config)
        self.block_size, self.total = config.attnres_block_sublayers, config.num_sublayers
        # most sources any aggregation reads (the final one reads them all)
        self.capacity = bank_capacity(config)

    def bind(self, layers: nn.ModuleList) -> None:
        """Know every aggregation of the decoder in reading order (sublayers 1..2L-1, then the final one): their
        static queries let each source's logits be computed once, when it is written (``depth_ops.TwoPhase``)."""
        mixers = [c.aggregate for layer in layers for c in layer.connections() if c.aggregate is not None]
        self._consumers = (*mixers, self.aggregate)  # a plain tuple: not submodules (no second registration)

    def init(self, embeds):
        # the sources of this forward are kept once, in a bank hung on the embedding (see depth_ops.SourceBank)
        h = SourceBank.attach(embeds, self.capacity, self.aggregate.eps)
        consumers = getattr(self, "_consumers", ())
        if consumers:
            attach_queries(h, [m.query for m in consumers], [m.key_norm.gamma() for m in consumers])
        return (h,)

    def collapse(self, state):
        return torch.stack(state).sum(0)

    def depth_state(self, state):
        return state[-1]  # DepthBench's block output: the running partial sum (the last source)

    def depth_mixer(self):
        return self.aggregate

    def final(self, state, norm):
        return aggregate_norm(norm, self.aggregate(state), self.aggregate.eps)

    def path_weights(self):
        w = self.aggregate.path_weights()
        return None if w is None else {**w, "members": source_members(self.total, self.block_size, self.total)}


def aggregate_norm(norm: nn.Module, x: torch.Tensor, eps: float) -> torch.Tensor:
    """``norm(x)`` with the aggregation eps (``attnres_norm_eps``) in place of the norm's own."""
    if getattr(norm, "eps", eps) == eps:
        return norm(x)
    if not isinstance(norm, RMSNorm):
        raise ValueError(f"`attnres_norm_eps` needs RMSNorm input norms, got {type(norm).__name__}")
    return rms_norm(x, norm.gamma(), eps)


def source_members(s: int, block_size: int, total: int) -> torch.Tensor:
    """[K, total + 1] 0/1 matrix: which base sources (column 0 = embedding, i + 1 = output of sublayer i) each of
    the K sources read by sublayer ``s`` sums: the embedding, then groups of ``block_size`` consecutive outputs."""
    groups = source_groups(s, block_size)
    m = torch.zeros(1 + len(groups), total + 1)
    m[0, 0] = 1.0
    for k, members in enumerate(groups, start=1):
        m[k, [i + 1 for i in members]] = 1.0
    return m


def attnres_extra_params(config) -> int:
    """(2L - 1) sublayer aggregations + 1 final one, each a query (d) and a key norm: 4Ld with standard norms."""
    return config.num_sublayers * (config.hidden_size + norm_param_count(config, final=True))


def attnres_extra_flops(config, T: int, model=None) -> dict:
    """AttnRes (functional.depth_softmax): per aggregation over k sources, the logits <w, N̄(v_i)> and the
    weighted sum, 4 T k d, elementwise (not matmuls); every sublayer input and the final aggregation."""
    size, d = config.attnres_block_sublayers, config.hidden_size
    sources = [1 + len(source_groups(s, size)) for s in range(config.num_sublayers + 1)]
    return {"matmul": 0, "other": sum(4 * T * k * d for k in sources)}


def bank_capacity(config) -> int:
    """Slots of the forward's source bank: the most sources any aggregation reads (the final one reads them all)."""
    return max(sum(source_layout(config, s)) for s in range(config.num_sublayers + 1))


def attnres_extra_activation_bytes(config, batch: int, seq_len: int, compute_bytes: int) -> int:
    """The source bank, kept once per forward (``depth_ops.SourceBank``): ``capacity`` slots of d (stream dtype)
    and their 1/rms (fp32) per token; each aggregation's output replaces the residual add Pre-LN's norm saves.
    An aggregation that reads a running partial sum also keeps its 1/rms and logit (fp32) per token."""
    partials = sum(source_layout(config, s)[1] for s in range(1, config.num_sublayers + 1))
    per_token = bank_capacity(config) * (config.hidden_size * STREAM_BYTES + 4) + partials * 2 * 4
    return per_token * batch * seq_len


class AttnResModel(DepthModel):  # Full AttnRes decoder (no LM head)
    config_class = AttnResConfig


class AttnResForCausalLM(DepthForCausalLM):  # Full AttnRes causal LM
    config_class, base_model_class = AttnResConfig, AttnResModel


class BlockAttnResModel(DepthModel):  # Block AttnRes decoder (no LM head)
    config_class = BlockAttnResConfig


class BlockAttnResForCausalLM(DepthForCausalLM):  # Block AttnRes causal LM
    config_class, base_model_class = BlockAttnResConfig, BlockAttnResModel


#: the pseudo-query w is decayed like a matrix (DepthBench decays everything but HC/mHC static routing)
ATTNRES_PARAM_ROLES = {"query": "design"}


def _olmo_query(olmo: str, hf: str, config) -> list:
    """``{olmo}_proj.weight`` [1, d] -> ``{hf}.aggregate.query`` [d] (row squeezed), ``{olmo}_norm`` -> key norm."""
    return [one(f"{olmo}_proj.weight", f"{hf}.aggregate.query", to_hf=lambda ts: [ts[0].reshape(-1)],
                to_olmo=lambda ts: [ts[0].reshape(1, -1)]),
            *norm(f"{olmo}_norm", f"{hf}.aggregate.key_norm", config)]


def olmo_layer(config, i: int, options: dict) -> list:
    L = f"model.layers.{i}"
    rules = pre_norms(config, i)
    if i > 0:  # the first sublayer reads the embedding alone: no query
        rules += _olmo_query(f"blocks.{i}.attn_res", f"{L}.attn_connection", config)
    return rules + _olmo_query(f"blocks.{i}.mlp_res", f"{L}.mlp_connection", config)


def _olmo_full(fields: dict) -> bool:
    """DepthBench's ``attnres_block_size`` S (sublayers): S = 1 (or unset) is Full AttnRes, S > 1 Block AttnRes."""
    return fields.get("attnres_block_size") in (None, 1)


_OLMO = dict(layer=olmo_layer, model=lambda config, options: _olmo_query("res", "model.stream", config),
             # ``kernels/attnres.py``'s norms are built without an eps in ``block.py``: OLMo-core's 1e-5
             defaults=lambda sd, backend: {"attnres_norm_eps": 1e-5}, forward_fields=("attnres_norm_eps",),
             json_fields=lambda block: ({"attnres_block_size": block["attnres_block_size"]}
                                        if block.get("attnres_block_size") is not None else {}),
             record=lambda config, backend: {"attnres_block_size": config.attnres_block_sublayers})
OLMO = OlmoRules("attnres", selects=_olmo_full, ignores=("attnres_block_size",), **_OLMO)
BLOCK_OLMO = OlmoRules("attnres", selects=lambda fields: not _olmo_full(fields), **_OLMO)


#: what Full and Block AttnRes share (one connection, stream, counts; the block size is the config's)
_SHARED = dict(param_roles=ATTNRES_PARAM_ROLES, connection=AttnResConnection, stream=AttnResStream,
               extra_params=attnres_extra_params, extra_flops=attnres_extra_flops,
               extra_activation_bytes=attnres_extra_activation_bytes,
               paper="Kimi Team 2026, Attention Residuals (arXiv 2603.15031)")

def attnres_upcycle_closeness(config) -> tuple[str, float] | None:
    """Zero queries and ``attnres_scale_by_sources``: every mix is the plain sum, Pre-LN's stream, eps included (with
    the aggregation eps equal to the branch norms')."""
    same_eps = config.attnres_norm_eps in (None, config.rms_norm_eps)
    return ("exact", UPCYCLE_EXACT_TOL) if config.attnres_scale_by_sources and same_eps else None


DESIGN = register(Design(
    "attnres", AttnResConfig, AttnResModel, AttnResForCausalLM, olmo=OLMO, **_SHARED,
    upcycle_fields={"attnres_scale_by_sources": True}, upcycle_closeness=attnres_upcycle_closeness,
    summary="x_l = N_l(sum_i softmax_i(<w_l, g_l N̄(v_i)>) v_i) over the embedding and every sublayer output",
))

BLOCK_DESIGN = register(Design(
    "block_attnres", BlockAttnResConfig, BlockAttnResModel, BlockAttnResForCausalLM, olmo=BLOCK_OLMO, **_SHARED,
    upcycle_fields={"attnres_scale_by_sources": True}, upcycle_closeness=attnres_upcycle_closeness,
    summary="AttnRes over [embedding, completed block sums, partial sum]; blocks of S sublayers",
))
