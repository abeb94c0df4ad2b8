"""Normalization layers and the RMSNorm scale-vector family (Wang et al. 2026, arXiv 2605.26895).

Every scale vector is a factor of the unified reparameterization of a linear map that reads from (or writes
after) a norm::

    W_c  ->  diag(u_c) W_c diag(v_c)          c in {q, k, v} (attention) or {gate, up} (SwiGLU FFN)

``config.scale_vector`` (components joined by ``+``, preset ``best`` = ``HG+DNP+OR``) chooses, once and for
every residual design, which factors exist and how they are parameterized:

* ``standard`` -- Llama: one gamma per norm (the shared input-side v of every projection reading from it).
* ``none``     -- the ablation: no gamma anywhere (input, output and final norms alike).
* ``HG``       -- heterogeneous: separate input-side gammas v_q, v_k, v_v and v_gate, v_up computed from ONE
  normalization of the input; the sublayer's input norm then has no gamma (its gammas live in
  ``ProjectionScales`` as ``<proj>_in``).
* ``AP``       -- the scale moved to the output side of each projection: y_c = u_c * (W_c N(x)); the input
  norm has no gamma. The output side is per projection by construction, so ``HG+AP`` equals ``AP``.
* ``DP``       -- both sides: y_c = u_c * (W_c (v * N(x))) (v shared in the norm, or per projection with HG).
* ``DNP``      -- both sides with a normalization in between: y_c = u_c * N(W_c (v * N(x))). N runs per head
  (over ``head_dim``) for q, k and v -- on Q/K this is exactly QK-norm; v is normalized the same way, so
  each head's values have RMS |u| -- and over the whole ``intermediate_size`` for gate and up. u_c has one
  entry per output channel of W_c (``d_out``), as in DP, i.e. a per-head (not head-shared) QK-norm gamma.
  The normalization removes the overall magnitude of the input side (the sublayer norm's gamma, or HG's
  v_c): under DNP an OR/ER input-side scale is therefore direction-only (no beta, which would get exactly
  zero gradient and, decayed by IWD with nothing pulling back, shrink towards the eps of the norm).
* ``OR``       -- every gamma (norm weights and projection scales) is ``beta * alpha / rms(alpha)``: a scalar
  magnitude beta (init 1) and a direction alpha (init ones). With ``rms`` in place of ``||.||`` (the ``Norm``
  of RMSNorm) beta is the RMS of gamma, and gamma = 1 exactly at init.
* ``ER``       -- every gamma is ``exp(beta) * exp(alpha - mean(alpha))`` (alpha = 0, beta = 0 at init).

The final norm (read by the LM head, a single consumer) keeps a norm gamma under HG/AP/DP/DNP; Output-Norms
(QK-norm's u, Sandwich/KEEL/Post-LN/DeepNorm output norms, post-projection scales) always keep theirs.
OR/ER reparameterize every gamma of the model.

Every norm and every scale vector reports its **role** for the IWD weight-decay rule of the paper:

* ``"input"``  -- an *Input-Norm*: its output feeds a linear map (pre-norm gammas, HG/DP input-side scales,
  the final norm). Its scale folds into that map as W diag(gamma): no expressivity, a self-amplifying
  preconditioner. Weight decay helps it.
* ``"output"`` -- an *Output-Norm*: not followed by a linear map of its own (QK-norm and DNP's u, AP/DP's
  post-projection scales, the output norms of Sandwich-LN / KEEL / Post-LN / DeepNorm). Weight decay hurts it.

``parameter_roles(model)`` gives the role of every parameter of a model (norms, scales, matrices, embeddings
and design parameters, honouring a module's ``param_roles`` class attribute); ``hf_depth.training.optim``
builds the AdamW groups (IWD / DepthBench / nanoGPT policies) from it.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import initialization as init

from .dispatch import rms_norm

NORM_ROLES = ("input", "output")

#: roles reported by :func:`parameter_roles`; designs may add their own through ``param_roles``
PARAM_ROLES = (
    "input_norm",  # Input-Norm scale vectors (and the bias of an input LayerNorm)
    "output_norm",  # Output-Norm scale vectors (and the bias of an output LayerNorm)
    "matrix",  # weights of linear maps, including the LM head
    "bias",  # biases of linear maps (attention_bias)
    "embedding",  # the input embedding table
    "routing_static",  # static routing of HC / mHC (never decayed)
    "design",  # any other design parameter without a declared role
)


def _check_role(role: str) -> None:
    if role not in NORM_ROLES:
        raise ValueError(f"`role` must be one of {list(NORM_ROLES)}, got {role!r}")


# --------------------------------------------------------------------------------- the variant, decoded
def scale_vector_spec(config) -> dict:
    """Decode ``config.scale_vector`` into what exists where (one place for modules and counts alike).

    Keys: ``gammas`` (any scale vector at all), ``reparam`` (None, "OR" or "ER"), ``norm_input_gamma`` (the
    sublayer input norms keep a gamma), ``proj_input`` (per-projection input-side scales, HG),
    ``proj_output`` (per-projection output-side scales, AP/DP/DNP), ``mid_norm`` (DNP's normalization),
    ``input_magnitude`` (input-side OR/ER scales have a magnitude beta: not under DNP).
    """
    parts = set(config.scale_vector_parts)
    gammas = "none" not in parts
    placement = next((p for p in ("AP", "DP", "DNP") if p in parts), None)
    return {
        "gammas": gammas,
        "reparam": next((p for p in ("OR", "ER") if p in parts), None),
        "norm_input_gamma": gammas and "HG" not in parts and placement != "AP",
        "proj_input": "HG" in parts and placement != "AP",
        "proj_output": placement is not None,
        "mid_norm": placement == "DNP",
        "input_magnitude": placement != "DNP",
    }


def scale_param_count(config, n: int, magnitude: bool = True) -> int:
    """Parameters of one scale vector of length ``n`` (``n`` plain; ``n + 1`` under OR / ER with a magnitude)."""
    return n + 1 if scale_vector_spec(config)["reparam"] and magnitude else n


# --------------------------------------------------------------------------------- one scale vector
class ScaleVector(nn.Module):
    """A learnable scale vector gamma of length ``dim`` with its IWD ``role``.

    ``reparam=None`` stores ``weight`` (init 1); ``"OR"`` stores a direction ``alpha`` (init 1) and a scalar
    magnitude ``beta`` (init 1): gamma = beta * alpha / rms(alpha); ``"ER"`` stores ``alpha`` (init 0) and
    ``beta`` (init 0): gamma = exp(beta) * exp(alpha - mean(alpha)). In both, gamma = 1 exactly at init.
    ``magnitude=False`` drops beta (direction only; DNP's input side, where the magnitude is normalized away).
    """

    def __init__(self, dim: int, role: str = "input", reparam: str | None = None, magnitude: bool = True):
        super().__init__()
        _check_role(role)
        if reparam not in (None, "OR", "ER"):
            raise ValueError(f"`reparam` must be one of [None, 'OR', 'ER'], got {reparam!r}")
        self.dim, self.role, self.reparam = dim, role, reparam
        if reparam is None:
            self.weight = nn.Parameter(torch.ones(dim))
        else:
            start = 1.0 if reparam == "OR" else 0.0
            self.alpha = nn.Parameter(torch.full((dim,), start))
            self.beta = nn.Parameter(torch.full((), start)) if magnitude else None

    def forward(self) -> torch.Tensor:
        if self.reparam is None:
            return self.weight
        if self.reparam == "OR":
            a = self.alpha
            direction = a * torch.rsqrt(a.pow(2).mean().clamp_min(1e-12))
            return direction if self.beta is None else self.beta * direction
        direction = torch.exp(self.alpha - self.alpha.mean())
        return direction if self.beta is None else torch.exp(self.beta) * direction

    def reset_design_parameters(self) -> None:
        if self.reparam is None:
            init.ones_(self.weight)
        else:
            fill = init.ones_ if self.reparam == "OR" else init.zeros_
            fill(self.alpha)
            if self.beta is not None:
                fill(self.beta)

    def extra_repr(self) -> str:
        magnitude = "" if self.reparam is None or self.beta is not None else ", direction only"
        return f"{self.dim}, role={self.role}, reparam={self.reparam}{magnitude}"


# --------------------------------------------------------------------------------- norms
class _ScaledNorm(nn.Module):
    """Shared part of the norms: a plain ``weight`` (Llama's state dict) or a reparameterized ``scale``."""

    def __init__(self, dim, eps, role, elementwise_affine: bool, reparam: str | None, magnitude: bool = True):
        super().__init__()
        _check_role(role)
        self.dim, self.eps, self.role = dim, eps, role
        plain = elementwise_affine and reparam is None
        self.weight = nn.Parameter(torch.ones(dim)) if plain else None
        reparam = reparam if elementwise_affine else None
        self.scale = ScaleVector(dim, role, reparam, magnitude) if reparam is not None else None

    def gamma(self) -> torch.Tensor | None:
        """The effective scale vector (``None`` without one)."""
        return self.scale() if self.scale is not None else self.weight

    def reset_design_parameters(self) -> None:
        if self.weight is not None:
            init.ones_(self.weight)

    def extra_repr(self) -> str:
        reparam = None if self.scale is None else self.scale.reparam
        affine = self.weight is not None or self.scale is not None
        return f"{self.dim}, eps={self.eps}, role={self.role}, affine={affine}, reparam={reparam}"


class RMSNorm(_ScaledNorm):
    """RMSNorm in Llama's cast order, with a learnable scale (``weight``, an OR/ER ``scale``, or none)."""

    def __init__(
        self, dim: int, eps: float = 1e-6, role: str = "input", elementwise_affine=True, reparam=None, magnitude=True
    ):
        super().__init__(dim, eps, role, elementwise_affine, reparam, magnitude)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.gamma(), self.eps)


class LayerNorm(_ScaledNorm):
    """LayerNorm (with bias) carrying a role; DeepNorm uses it as in the DeepNet paper and DepthBench.

    Normalizes in fp32 like RMSNorm. Without a scale vector (``none``) it has no bias either; ``bias=False``
    drops the bias alone (DepthBench's DeepNorm).
    """

    def __init__(
        self, dim: int, eps: float = 1e-6, role: str = "output", elementwise_affine=True, reparam=None, magnitude=True,
        bias: bool = True,
    ):
        super().__init__(dim, eps, role, elementwise_affine, reparam, magnitude)
        self.bias = nn.Parameter(torch.zeros(dim)) if elementwise_affine and bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.gamma()
        acc = torch.promote_types(x.dtype, torch.float32)  # fp32 for narrower floats, float64 kept
        w = None if g is None else g.to(acc)
        b = None if self.bias is None else self.bias.to(acc)
        return nn.functional.layer_norm(x.to(acc), (self.dim,), w, b, self.eps).to(x.dtype)

    def reset_design_parameters(self) -> None:
        super().reset_design_parameters()
        if self.bias is not None:
            init.zeros_(self.bias)


def _norm_gamma(config, role: str, final: bool) -> tuple[bool, bool]:
    """(has a gamma, the gamma has an OR/ER magnitude) for a norm of ``role``."""
    spec = scale_vector_spec(config)
    if role == "output" or final:
        return spec["gammas"], True
    return spec["norm_input_gamma"], spec["input_magnitude"]


def make_norm(
    config, dim: int | None = None, role: str = "input", kind: str | None = None, final: bool = False
) -> nn.Module:
    """Build a norm of width ``dim`` (default hidden_size) for ``role`` following ``config.scale_vector``.

    ``kind`` is ``"rms"`` or ``"layer"`` (LayerNorm, DeepNorm's default); ``None`` takes ``config.norm_kind``.
    ``role="input"`` is a sublayer input norm read by the branch projections: it loses its gamma under
    HG/AP (the gammas move into ``ProjectionScales``). ``final=True`` marks the norm before the LM head (a
    single consumer): it keeps its gamma under HG/AP. With ``none`` no norm has a gamma (the ablation).
    """
    _check_role(role)
    dim = config.hidden_size if dim is None else dim
    kind = kind or getattr(config, "norm_kind", "rms")
    if kind not in ("rms", "layer"):
        raise ValueError(f"`kind` must be one of ['rms', 'layer'], got {kind!r}")
    affine, magnitude = _norm_gamma(config, role, final)
    reparam = scale_vector_spec(config)["reparam"]
    if kind == "layer":
        return LayerNorm(dim, config.rms_norm_eps, role, elementwise_affine=affine, reparam=reparam,
                         magnitude=magnitude, bias=getattr(config, "norm_bias", True))
    return RMSNorm(dim, config.rms_norm_eps, role, elementwise_affine=affine, reparam=reparam, magnitude=magnitude)


def norm_param_count(
    config, dim: int | None = None, kind: str | None = None, role: str = "input", final: bool = False
) -> int:
    """Exact parameter count of ``make_norm(config, dim, role, kind, final)``."""
    dim = config.hidden_size if dim is None else dim
    affine, magnitude = _norm_gamma(config, role, final)
    if not affine:
        return 0
    layer = (kind or getattr(config, "norm_kind", "rms")) == "layer"
    bias = dim if layer and getattr(config, "norm_bias", True) else 0
    return scale_param_count(config, dim, magnitude) + bias


# --------------------------------------------------------------------------------- projection scales
def projection_scales_param_count(config, projections: dict[str, tuple[int, int]]) -> int:
    """Exact parameter count of ``ProjectionScales(config, projections)``."""
    spec = scale_vector_spec(config)
    total = 0
    for d_in, d_out in projections.values():
        total += scale_param_count(config, d_in, spec["input_magnitude"]) if spec["proj_input"] else 0
        total += scale_param_count(config, d_out) if spec["proj_output"] else 0
    return total


class ProjectionScales(nn.Module):
    """Scale vectors around the linear maps that read from one norm: W_c -> diag(u_c) W_c diag(v_c).

    ``inputs(x)`` returns one branch input per projection name: ``v_c * x`` under HG (``<name>_in``, an
    Input-Norm scale; x is the gamma-less normalization, computed once), else x itself. ``outputs(name, y)``
    applies the output side: ``u_c * y`` (AP/DP, ``<name>_out``) or ``u_c * N(y)`` (DNP; N over the last dim
    of y, i.e. per head for attention's ``[..., heads, head_dim]``); ``u_c`` is an Output-Norm scale of
    length ``d_out``. For ``standard``/``none`` both are the identity and this module holds no parameters,
    so the state dict equals Llama's.
    """

    def __init__(self, config, projections: dict[str, tuple[int, int]]):
        super().__init__()
        self.names = tuple(projections)
        spec = scale_vector_spec(config)
        self.eps = config.rms_norm_eps
        self.mid_norm = spec["mid_norm"]
        self.has_inputs, self.has_outputs = spec["proj_input"], spec["proj_output"]
        for name, (d_in, d_out) in projections.items():
            if self.has_inputs:
                setattr(self, f"{name}_in", ScaleVector(d_in, "input", spec["reparam"], spec["input_magnitude"]))
            if self.has_outputs:
                setattr(self, f"{name}_out", ScaleVector(d_out, "output", spec["reparam"]))

    def inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not self.has_inputs:
            return (x,) * len(self.names)
        return tuple(getattr(self, f"{name}_in")() * x for name in self.names)

    def outputs(self, name: str, y: torch.Tensor) -> torch.Tensor:
        if not self.has_outputs:
            return y
        u = getattr(self, f"{name}_out")()
        if u.numel() != y.shape[-1]:  # attention: y is [..., heads, head_dim], u has heads * head_dim entries
            u = u.view(-1, y.shape[-1])
        if self.mid_norm:
            return u * rms_norm(y, None, self.eps)
        return u * y

    def extra_repr(self) -> str:
        return f"{list(self.names)}, inputs={self.has_inputs}, outputs={self.has_outputs}, mid_norm={self.mid_norm}"


# --------------------------------------------------------------------------------- roles of every parameter
def _module_param_role(module: nn.Module, local: str, design_roles: dict[str, str]) -> str | None:
    """The role of ``module``'s own parameter ``local``; ``None`` if nothing declares it."""
    declared = getattr(module, "param_roles", None)
    if declared and local in declared:
        return declared[local]
    if isinstance(module, (ScaleVector, _ScaledNorm)):
        return f"{module.role}_norm"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, nn.Linear):
        return "matrix" if local == "weight" else "bias"
    return design_roles.get(local)


def _design_roles(model: nn.Module) -> dict[str, str]:
    """``Design.param_roles`` of the (first) hf_depth model inside ``model`` (a PEFT wrapper, a causal LM...)."""
    for module in model.modules():
        design = getattr(type(module), "design", None)
        if design is not None and hasattr(design, "param_roles"):
            return design.param_roles
    return {}


def parameter_roles(model: nn.Module, design_roles: dict[str, str] | None = None, strict: bool = False
                    ) -> dict[str, str]:
    """The role of every parameter of ``model``, by its ``named_parameters`` name.

    Norm weights/biases and scale vectors: ``"input_norm"`` / ``"output_norm"`` (the IWD split); linear
    weights ``"matrix"`` (LM head included), their biases ``"bias"``; ``nn.Embedding`` ``"embedding"``. A
    module's ``param_roles: dict[local_name, role]`` class attribute wins (e.g. HC's static routing ->
    ``"routing_static"``); other parameters take the role their design declares (``Design.param_roles``, by
    local name; ``design_roles`` defaults to the model's). A parameter nothing declares is ``"design"``, or a
    ``ValueError`` naming it when ``strict`` (what every hf_depth model checks when it is built). Shared
    parameters are reported once.
    """
    design_roles = _design_roles(model) if design_roles is None else design_roles
    owner, undeclared = {}, []
    for mod_name, module in model.named_modules():
        for local, p in module.named_parameters(recurse=False):
            full = f"{mod_name}.{local}" if mod_name else local
            role = _module_param_role(module, local, design_roles)
            if role is None:
                undeclared.append(full)
                role = "design"
            owner.setdefault(id(p), (full, role))
    if strict and undeclared:
        raise ValueError(
            f"parameters without a declared role: {undeclared[:8]}; declare each local name in the design's "
            "`param_roles` (e.g. {'query': 'design'}: decayed; 'routing_static': never decayed)"
        )
    return {name: owner[id(p)][1] for name, p in model.named_parameters()}
