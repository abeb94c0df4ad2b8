"""Hyper-Connections, HC (DepthBench ``hc``; Zhu et al., arXiv 2409.19606, Appendix J Algorithm 2).

n residual streams H in R^{n x d} per token; for every sublayer s (attention 2l, FFN 2l+1):

    A    = A_static + s_a tanh(N̄(H) W_a)          A in R^{n x (n+1)},  W_a in R^{d x (n+1)}   (width)
    beta = B_static + s_b tanh(N̄(H) w_b)          beta in R^n,         w_b in R^d             (depth)
    x    = sum_i A[i, 0] H_i                       branch input, then y = F_s(N_s(x))  (pre-norm branch)
    H'_t = sum_i A[i, t+1] H_i + beta_t y          (H' = A_r^T H + beta y^T)

N̄ is an unweighted per-stream RMS normalization with eps ``hc_norm_eps`` (1e-8, DepthBench).

Init (DepthBench / the paper): A_static[:, 0] = e_(s mod n) (s = the sublayer index, never random),
A_static[:, 1:] = I_n, B_static = 1, W_a = w_b = 0, s_a = s_b = 0.01; W_o and W_down divided by sqrt(n)
(``hc_scale_output_init``). With these values the n replicated streams stay equal, so HC computes Pre-LN's
function with the same branch weights, up to the final reduce:

* ``hc_final_reduce="sum_of_normed"`` (default, DepthBench ``collapse="auto"``): the final norm is applied to
  every stream and the streams are summed, so at init the logits are n x Pre-LN's.
* ``"mean_then_norm"`` (fla, Liger): the final norm of the stream mean; equal to Pre-LN at init.

``collapse`` (``output_hidden_states`` and diagnostics) is the stream mean, one [B, T, d] per layer boundary.
``hc_dynamic=False`` gives static HC (SHC): no W_a, w_b, s_a, s_b.
``hc_stream_mixing=False`` drops the stream-mixing part of the width weights, H'_t = H_t + beta_t y (A[:, 1:]
is kept as a parameter but read as I): the forward of an earlier DepthBench ``hyper_connections.py``
(``keyu-wang-2002/DepthBench`` @ 5152cab, ``output = residuals + beta y``), set by ``hf-depth convert-olmo-core``
for such checkpoints. New models keep the paper's mixing (default ``True``).

Extra parameters per sublayer: n(n+1) + n static, plus d(n+1) + d + 2 dynamic = d(n+2) + n^2 + 2n + 2
(6d + 26 at n = 4). DepthBench LR 2e-3; static routing parameters are not weight-decayed: every routing
parameter is tagged by ``param_roles`` (see :class:`HCConnection`).
"""

from __future__ import annotations

import abc
import math
import re

import torch
from torch import nn
from transformers import initialization as init

from .configuration_depth import DepthConfig, check_fields, field_alias
from .depth_ops import SEGMENT, _sum_to, native_fused_op, stream_route, stream_write
from .dispatch import hc_coefficients, hc_depth, hc_width
from .functional import _acc, inv_rms
from .modeling_depth import DepthForCausalLM, DepthModel
from .olmo_rules import OlmoRules, fold_aliases, one, pre_norms
from .residual import (
    STREAM_BYTES,
    UPCYCLE_EXACT_TOL,
    Design,
    ResidualStream,
    SublayerConnection,
    register,
    rms_norm_saved_bytes,
)

FINAL_REDUCES = ("sum_of_normed", "mean_then_norm")
ROUTING_ROLES = ("routing_static", "routing_dynamic", "routing_scale")
_OUTPUT_PROJECTIONS = ("o_proj", "down_proj")


class HCConfig(DepthConfig):
    """Hyper-Connections decoder. Each field is documented below it."""

    model_type = "hf_depth_hc"
    design = "hc"

    hc_streams: int = 4
    """Number of residual streams n (4 in DepthBench and the paper)."""
    hc_dynamic: bool = True
    """Dynamic HC (input-dependent tanh terms, DepthBench) or static HC (``False``)."""
    hc_alpha_scale_init: float = 0.01
    """Init of the learnable width-gate scale s_a (0.01)."""
    hc_beta_scale_init: float = 0.01
    """Init of the learnable depth-gate scale s_b (0.01)."""
    hc_final_reduce: str = "sum_of_normed"
    """``"sum_of_normed"`` (default, DepthBench: final norm per stream, then sum; logits are n x Pre-LN's at init) or
    ``"mean_then_norm"`` (final norm of the stream mean; Pre-LN at init)."""
    hc_scale_output_init: bool = True
    """Divide the init std of W_o and W_down by sqrt(n) (DepthBench default)."""
    hc_norm_eps: float = 1e-8
    """Eps of the unweighted per-stream RMS normalization feeding the dynamic weights (1e-8)."""
    hc_stream_mixing: bool = True
    """``True`` (default, the paper): H' = A_r^T H + beta y. ``False``: H' = H + beta y, the earlier DepthBench version
    (A_r unused), for converted checkpoints of that version."""

    def validate_design(self):
        check_fields(self, ints=["hc_streams"], flags=["hc_dynamic", "hc_scale_output_init", "hc_stream_mixing"],
                     non_negative=["hc_alpha_scale_init", "hc_beta_scale_init"], eps=["hc_norm_eps"],
                     choices={"hc_final_reduce": FINAL_REDUCES})

    # the names MultiStream / output_init_scale read (shared with mHC)
    num_streams = field_alias("hc_streams")
    final_reduce = field_alias("hc_final_reduce")
    scale_output_init = field_alias("hc_scale_output_init")


# ------------------------------------------------------------------------------------- shared with mHC
class MultiStream(ResidualStream):
    """n replicated streams [B, T, n, d]; collapse = stream mean; final per ``config.final_reduce``."""

    def __init__(self, config):
        super().__init__(config)
        self.n = config.num_streams
        self.reduce = config.final_reduce

    def init(self, embeds: torch.Tensor) -> torch.Tensor:
        return embeds.unsqueeze(-2).expand(*embeds.shape[:-1], self.n, embeds.shape[-1])

    def collapse(self, state: torch.Tensor) -> torch.Tensor:
        return state.mean(-2)

    def depth_state(self, state: torch.Tensor) -> torch.Tensor:
        return state.flatten(-2)  # DepthBench: the n streams concatenated, [B, T, n d]

    def final(self, state: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        if self.reduce == "sum_of_normed":
            return norm(state).sum(-2)
        return norm(state.mean(-2))

    def extra_repr(self) -> str:
        return f"streams={self.n}, final_reduce={self.reduce}"


def output_init_scale(config, layer_idx: int, name: str) -> float:
    """1/sqrt(n) for W_o and W_down when ``config.scale_output_init`` (DepthBench ``scale_output_init_by_sqrt_n``)."""
    if config.scale_output_init and name.split(".")[-1] in _OUTPUT_PROJECTIONS:
        return 1.0 / math.sqrt(config.num_streams)
    return 1.0


def routing_precision(x: torch.Tensor):
    """Routing runs outside autocast: coefficients in fp32, mixing in the state's dtype (fp32 under AMP)."""
    return torch.autocast(device_type=x.device.type, enabled=False)


def _token_mean(v: torch.Tensor, trailing: int) -> torch.Tensor:
    """Mean over every leading (batch, token) dim, keeping the last ``trailing`` dims."""
    lead = v.dim() - trailing
    return v if lead == 0 else v.reshape(-1, *v.shape[lead:]).mean(0)


def normalized_projection(X: torch.Tensor, WT: torch.Tensor, eps: float):
    """(r [..., 1], P [..., c]) of rows X [..., k] (fp32): r = 1 / rms(X), P = (X W) r for WT = W^T [c, k] (= rms(X) W,
    functional.hc_coefficients' projection to fp32 rounding), with two passes over the rows: 1 / rms by one norm (no
    squared copy), then one product of the raw rows (no normalized copy; the weight read transposed, the fast
    layout of this thin product on CPU)."""
    r = inv_rms(X, eps)
    return r, (X.reshape(-1, X.shape[-1]) @ WT.T).view(*X.shape[:-1], -1).mul_(r)


def normalized_projection_backward(X, r, P, dP, WT, dX):
    """dW^T of P = (X W) r, r = 1 / rms(X) [..., 1] (= rms(X) W), for rows X [..., k] and WT = W^T [c, k],
    given the gradient dP of P [..., c]; the gradient of X is added into ``dX`` (X's shape, contiguous, X's
    dtype), in place. fp32. ``X^T dQ`` as ``(dQ^T X)^T`` and ``dQ W^T`` accumulated by ``addmm_``: the fast
    layouts of these thin products on CPU, and no stream-sized temporary."""
    Xf = _acc(X)
    k, c = Xf.shape[-1], WT.shape[0]
    dQ = (dP * r).reshape(-1, c)  # gradient of the unnormalized product X W
    dWT = dQ.T @ Xf.reshape(-1, k)
    # through r: dr/dX = -r^3 X / k and dL/dr = sum_c dP_c P_c / r
    dX.view(-1, k).addmm_(dQ.to(dX.dtype), WT.to(dX.dtype))
    dX.addcmul_(X, ((dP * P).sum(-1, keepdim=True) * (r * r / k)).to(dX.dtype), value=-1.0)
    return dWT


class MultiStreamConnection(SublayerConnection, abc.ABC):
    """``read`` computes the routing once and hands (mixed streams, write weights) to ``write`` as its carry.

    Subclasses implement ``route(H) -> (x, mixed, write_weights, seen)`` where ``seen`` is a dict of routing
    tensors whose token means ``path_weights`` reports (the last forward's, kept for diagnostics only).

    ``param_roles`` maps each routing parameter name of the module to ``"routing_static"`` (input-independent
    routing: no weight decay in DepthBench), ``"routing_dynamic"`` (projections producing input-dependent
    weights) or ``"routing_scale"`` (learnable gates). Optimizer code builds groups from it.
    """

    param_roles: dict[str, str] = {}

    def __init__(self, config, sublayer_idx: int):
        super().__init__(config, sublayer_idx)
        self.n = config.num_streams
        self._seen = None  # the last forward's routing weights: a dict, or a function of no argument returning one

    @abc.abstractmethod
    def route(self, H: torch.Tensor):
        """(branch input x, mixed streams, write weights, {"pre", "res", "post"} per token) of streams H."""

    @abc.abstractmethod
    def static_weights(self) -> dict[str, torch.Tensor]:
        """The input-independent ``pre`` / ``res`` / ``post`` weights."""

    # The CPU training path (``depth_ops._Route``) differentiates the routing by hand, in three steps:
    @abc.abstractmethod
    def routing_saved(self, H: torch.Tensor):
        """(M [..., n+1, n], write weights w [..., n], seen, saved) of streams H, fp32: [x; mixed] = M H.
        ``saved``: the small tensors (a few n-sized vectors per token) that the coefficients are recomputed from
        in backward, after the products with the streams."""

    @abc.abstractmethod
    def routing_rebuild(self, saved: tuple):
        """(M, state for ``routing_backward``) from ``saved``, without touching the streams."""

    @abc.abstractmethod
    def routing_backward(self, H: torch.Tensor, saved: tuple, state, dM: torch.Tensor, dw: torch.Tensor,
                         dH: torch.Tensor) -> dict:
        """{parameter name: gradient} from the gradients of M (summed to M's shape) and of w; the gradient of H
        through the coefficients is added into ``dH`` (H's shape and dtype), in place."""

    # Optionally, one native kernel does all three steps (``depth_ops`` calls these where its CPU path runs the
    # native kernels; None: the steps above run):
    def fused_route(self, H: torch.Tensor):
        """(x, mixed, w, seen, saved) of streams H in one pass (``saved``: what ``fused_mixing`` and
        ``fused_backward`` take; ``seen``: the routing's dict, or a function of no argument returning it, formed
        when a diagnostic asks), or None."""
        return None

    def fused_mixing(self, H: torch.Tensor, saved: tuple) -> torch.Tensor:
        """M [..., n+1, n] of streams H from the ``saved`` of ``fused_route``, the same bits as it used (the
        segment's streams are rebuilt with it). By default ``routing_rebuild``'s M: right where ``fused_route``
        saves what ``routing_saved`` saves and the rebuild returns the forward's M (mHC); a design whose rebuild
        recomputes M overrides this with the fused kernel's arithmetic (HC)."""
        return self.routing_rebuild(saved)[0]

    def fused_rebuild(self, H: torch.Tensor, saved: tuple, w: torch.Tensor, y: torch.Tensor):
        """The streams after this sublayer (its mixing of H, then ``+ w ⊗ y``, the write of the branch output y),
        from the ``saved`` of ``fused_route``, bit for bit as the forward formed them, in one pass; or None (then
        ``fused_mixing`` and the forward's ops run)."""
        return None

    def fused_backward(self, H: torch.Tensor, saved: tuple, dx, dmixed, dw):
        """(dH, {parameter name: gradient}) of ``fused_route`` in one pass, given the gradients of x, mixed and w,
        or None (then ``fused_mixing`` + the by-hand steps run)."""
        return None

    def read(self, state: torch.Tensor, norm: nn.Module | None):
        # saved for backward: H at segment starts, y and the write weights per sublayer (depth_ops.stream_route)
        x, mixed, write_weights, seen = stream_route(self, self.sublayer_idx, state)
        if not torch.compiler.is_compiling():
            # last-seen weights (per token [B, T, ...] where input-dependent), for diagnostics only: the fused routing
            # hands a function that forms them from its outputs when asked (no per-sublayer views); a dict is
            # detached where there is a graph to cut (the CPU path forms them inside its autograd Function, and
            # decoding runs without grad; a detach is one op each)
            # (a plain attribute: nn.Module.__setattr__ costs more, per sublayer)
            self.__dict__["_seen"] = seen if callable(seen) else {k: v.detach() if v.requires_grad else v
                                                                  for k, v in seen.items()}
        return (x if norm is None else norm(x)), (mixed, write_weights)

    def write(self, state: torch.Tensor, out: torch.Tensor, carry) -> torch.Tensor:
        mixed, write_weights = carry
        return stream_write(self, self.sublayer_idx, mixed, write_weights, out)

    @abc.abstractmethod
    def depth(self, mixed, write_weights, out):
        """Write the branch output ``out`` into the mixed streams: ``mixed + write_weights ⊗ out`` (the form
        ``depth_ops`` differentiates by hand; on CPU, with or without autograd, ``depth_ops`` writes that form in
        place by ``functional.write_streams``; this hook serves ``torch.compile`` and the Triton path)."""

    def path_weights(self) -> dict[str, torch.Tensor]:
        """Mixing weights in one convention for HC and mHC (fp32, detached):

        ``pre`` [n]: branch input x = sum_i pre_i H_i; ``res`` [n, n]: H'_t = sum_i res[t, i] H_i + post_t y;
        ``post`` [n]. Keys ``static_*`` are the input-independent parts (the weights at a zero dynamic term);
        ``pre``/``res``/``post`` (present after a forward) are the token means of the last forward's weights and
        ``read``/``mix``/``write`` the same weights per token (``[B, T, ...]``; static where input-independent).
        """
        out = {f"static_{k}": v for k, v in self.static_weights().items()}
        seen = self._seen() if callable(self._seen) else self._seen
        if seen is not None:
            out.update({k: _token_mean(v, 2 if k == "res" else 1).float() for k, v in seen.items()})
            # the same weights per token, as the canonical transport (``diagnostics.paths``): products of mixing
            # matrices are formed token by token (Figure 10's effective rank), not from token means
            out.update({"read": seen["pre"].float(), "mix": seen["res"].float(), "write": seen["post"].float()})
        return out

    def parameter_roles(self) -> dict[str, str]:
        """{own parameter name: role} for the parameters this module has."""
        return {name: self.param_roles[name] for name, _ in self.named_parameters(recurse=False)}


# ------------------------------------------------------------------------------------- HC
class HCConnection(MultiStreamConnection):
    """HC width + depth connection of sublayer ``s``. Parameters (and roles):

    ``static_alpha`` [n, n+1], ``static_beta`` [n] (routing_static); ``dynamic_alpha`` [d, n+1],
    ``dynamic_beta`` [d] (routing_dynamic); ``alpha_scale``, ``beta_scale`` scalars (routing_scale).
    """

    param_roles = {
        "static_alpha": "routing_static",
        "static_beta": "routing_static",
        "dynamic_alpha": "routing_dynamic",
        "dynamic_beta": "routing_dynamic",
        "alpha_scale": "routing_scale",
        "beta_scale": "routing_scale",
    }

    def __init__(self, config: HCConfig, sublayer_idx: int):
        super().__init__(config, sublayer_idx)
        n, d = self.n, config.hidden_size
        self.dynamic, self.eps = config.hc_dynamic, config.hc_norm_eps
        self.stream_mixing = config.hc_stream_mixing
        self.alpha_scale_init, self.beta_scale_init = config.hc_alpha_scale_init, config.hc_beta_scale_init
        self.static_alpha = nn.Parameter(torch.empty(n, n + 1))
        self.static_beta = nn.Parameter(torch.empty(n))
        if self.dynamic:
            self.dynamic_alpha = nn.Parameter(torch.empty(d, n + 1))
            self.dynamic_beta = nn.Parameter(torch.empty(d))
            self.alpha_scale = nn.Parameter(torch.empty(()))
            self.beta_scale = nn.Parameter(torch.empty(()))
        with torch.no_grad():
            self.reset_design_parameters()

    def static_alpha_init(self) -> torch.Tensor:
        n = self.n
        dev = self.static_alpha.device
        first = torch.zeros(n, 1, device=dev)
        first[self.sublayer_idx % n] = 1.0
        return torch.cat([first, torch.eye(n, device=dev)], dim=1)

    def reset_design_parameters(self) -> None:
        init.copy_(self.static_alpha, self.static_alpha_init())
        init.ones_(self.static_beta)
        if self.dynamic:
            init.zeros_(self.dynamic_alpha)
            init.zeros_(self.dynamic_beta)
            init.constant_(self.alpha_scale, self.alpha_scale_init)
            init.constant_(self.beta_scale, self.beta_scale_init)

    def coefficients(self, H: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [..., n, n+1], beta [..., n]) in fp32 (static HC: the parameters, H unused)."""
        if not self.dynamic:
            return self.static_alpha.float(), self.static_beta.float()
        return hc_coefficients(
            H, self.static_alpha, self.dynamic_alpha, self.alpha_scale,
            self.static_beta, self.dynamic_beta, self.beta_scale, self.eps,
        )  # fmt: skip

    def _unmixed(self, A: torch.Tensor) -> torch.Tensor:
        """Earlier DepthBench (``stream_mixing=False``): the streams pass unmixed (A_r read as I, exactly H)."""
        if self.stream_mixing:
            return A
        eye = torch.eye(self.n, dtype=A.dtype, device=A.device).expand(*A.shape[:-1], self.n)
        return torch.cat([A[..., :1], eye], dim=-1)

    def route(self, H):
        A, beta = self.coefficients(H)
        A = self._unmixed(A)
        x, mixed = hc_width(H, A)
        return x, mixed, beta, self._seen_of(A, beta)

    @staticmethod
    def _seen_of(A, beta):
        return {"pre": A[..., 0], "res": A[..., 1:].transpose(-1, -2), "post": beta}

    def _projection(self) -> torch.Tensor:
        """[W_a | w_b]^T, [n + 2, d] in fp32: the dynamic projections of A and beta as one matrix."""
        return torch.cat((_acc(self.dynamic_alpha).T, _acc(self.dynamic_beta).unsqueeze(0)))

    def _gates(self, P: torch.Tensor):
        """(A, beta, tanh(P)) from the normalized projections P = N̄(H) [W_a | w_b], [..., n, n + 2]."""
        T = torch.tanh(P)
        A = _acc(self.static_alpha) + _acc(self.alpha_scale) * T[..., :-1]
        beta = _acc(self.static_beta) + _acc(self.beta_scale) * T[..., -1]
        return A, beta, T

    def routing_saved(self, H):
        if not self.dynamic:
            A, beta = self.coefficients(H)
            A = self._unmixed(A)
            return A.transpose(-1, -2), beta, self._seen_of(A, beta), ()
        # functional.hc_coefficients to fp32 rounding: the two projections as one, P = (H [W_a | w_b]) / rms(H)
        r, P = normalized_projection(_acc(H), self._projection(), self.eps)
        A, beta, _ = self._gates(P)
        A = self._unmixed(A)
        return A.transpose(-1, -2), beta, self._seen_of(A, beta), (r, P)

    def routing_rebuild(self, saved):
        if not self.dynamic:
            A, beta = self.coefficients(None)
            return self._unmixed(A).transpose(-1, -2), None
        A, _, T = self._gates(saved[1])
        return self._unmixed(A).transpose(-1, -2), T

    def routing_backward(self, H, saved, T, dM, dw, dH):
        dA = dM.transpose(-1, -2)
        if not self.stream_mixing:  # the mixing columns are replaced by I: no gradient reaches them
            dA = torch.cat((dA[..., :1], torch.zeros_like(dA[..., 1:])), dim=-1)
        grads = {"static_alpha": _sum_to(dA, self.static_alpha), "static_beta": _sum_to(dw, self.static_beta)}
        if not self.dynamic:
            return grads
        r, P = saved
        grads["alpha_scale"] = (dA * T[..., :-1]).sum()
        grads["beta_scale"] = (dw * T[..., -1]).sum()
        dT = torch.cat((dA * _acc(self.alpha_scale), (dw * _acc(self.beta_scale)).unsqueeze(-1)), dim=-1)
        dW = normalized_projection_backward(H, r, P, dT * (1 - T * T), self._projection(), dH)
        grads["dynamic_alpha"], grads["dynamic_beta"] = dW[:-1].T, dW[-1]
        return grads

    def _gate_params(self) -> tuple:
        return self.static_alpha, self.static_beta, self.alpha_scale, self.beta_scale

    def fused_route(self, H):
        if not (self.dynamic and self.stream_mixing):
            return None
        out = native_fused_op("hc_route", H, self.dynamic_alpha, self.dynamic_beta, *self._gate_params(), self.eps)
        if out is None:
            return None
        x, mixed, A, beta, r, P = out
        return x, mixed, beta, lambda: self._seen_of(A, beta), (r, P)

    def fused_mixing(self, H, saved):
        return native_fused_op("hc_mixing", saved[1], *self._gate_params())[0]

    def fused_rebuild(self, H, saved, w, y):
        return native_fused_op("hc_rebuild", H, saved[1], *self._gate_params(), w, y)

    def fused_backward(self, H, saved, dx, dmixed, dw):
        out = native_fused_op("hc_route_backward", H, self.dynamic_alpha, self.dynamic_beta, *self._gate_params(),
                               *saved, dx, dmixed, dw)
        if out is None:
            return None
        dH, dWa, dwb, dsa, dsb, das, dbs = out
        return dH, {"static_alpha": dsa, "static_beta": dsb, "dynamic_alpha": dWa, "dynamic_beta": dwb,
                    "alpha_scale": das, "beta_scale": dbs}

    def depth(self, mixed, beta, out):
        return hc_depth(mixed, beta, out)

    def static_weights(self):
        A = self.static_alpha.detach().float()
        res = A[:, 1:].T if self.stream_mixing else torch.eye(self.n, device=A.device)
        return {"pre": A[:, 0], "res": res, "post": self.static_beta.detach().float()}

    def extra_repr(self) -> str:
        mixing = "" if self.stream_mixing else ", stream_mixing=False"
        return f"sublayer={self.sublayer_idx}, streams={self.n}, dynamic={self.dynamic}{mixing}"


def multi_stream_flops(config, T: int, coefficient_width: int) -> int:
    """Matmuls shared by HC and mHC per sublayer: the coefficient projection [T, n d] x [n d, c] (HC: n rows of
    [d] x [d, c]), the branch read (n d) and the stream mix (n^2 d)."""
    n, d = config.num_streams, config.hidden_size
    return 2 * T * n * d * coefficient_width + 2 * T * n * d + 2 * T * n * n * d


def hc_extra_flops(config, T: int, model=None) -> dict:
    """HC (functional.hc_*): per sublayer N̄(H) W_alpha [n, d] x [d, n + 1], the read and the stream mix;
    other: N̄(H) w_beta, a matrix-vector product (not counted by FLOP counters)."""
    n, S = config.num_streams, config.num_sublayers
    return {"matmul": S * multi_stream_flops(config, T, n + 1), "other": S * 2 * T * n * config.hidden_size}


def hc_extra_params(config: HCConfig) -> int:
    n, d = config.hc_streams, config.hidden_size
    per = n * (n + 1) + n + ((n + 1) * d + d + 2 if config.hc_dynamic else 0)
    return config.num_sublayers * per


class HCModel(DepthModel):  # Hyper-Connections decoder (no LM head)
    config_class = HCConfig


class HCForCausalLM(DepthForCausalLM):  # Hyper-Connections causal LM
    config_class, base_model_class = HCConfig, HCModel


# ---- DepthBench / OLMo-core names (shared with mHC: the same connection modules and branch aliases)
def olmo_connections(i: int):
    """(OLMo-core, hf_depth) module paths of block ``i``'s two connections."""
    L = f"model.layers.{i}"
    return ((f"blocks.{i}.attention_hyper_connection", f"{L}.attn_connection"),
            (f"blocks.{i}.feed_forward_hyper_connection", f"{L}.mlp_connection"))


#: the HC module registers its branch too, so an OLMo-core state dict holds each branch weight twice
_BRANCH_ALIASES = (
    (r"^blocks\.(\d+)\.attention_hyper_connection\.branch\.norm\.(.+)$", "blocks.{}.attention_norm.{}"),
    (r"^blocks\.(\d+)\.attention_hyper_connection\.branch\.attention\.(.+)$", "blocks.{}.attention.{}"),
    (r"^blocks\.(\d+)\.feed_forward_hyper_connection\.branch\.norm\.(.+)$", "blocks.{}.feed_forward_norm.{}"),
    (r"^blocks\.(\d+)\.feed_forward_hyper_connection\.branch\.feed_forward\.(.+)$", "blocks.{}.feed_forward.{}"),
)


def fold_branch_aliases(sd: dict) -> tuple[dict, list[str]]:
    """The ``*_hyper_connection.branch.*`` aliases folded into the canonical keys (checked equal)."""
    return fold_aliases(sd, _BRANCH_ALIASES)


def branch_aliases(sd: dict) -> dict:
    """The ``*_hyper_connection.branch.*`` aliases that an OLMo-core HC/mHC ``state_dict()`` also contains."""
    out = {}
    for k, v in sd.items():
        m = re.match(r"^blocks\.(\d+)\.(attention_norm|attention|feed_forward_norm|feed_forward)\.(.+)$", k)
        if m:
            i, mod, rest = m.groups()
            hc = "attention" if mod.startswith("attention") else "feed_forward"
            out[f"blocks.{i}.{hc}_hyper_connection.branch.{'norm' if mod.endswith('_norm') else mod}.{rest}"] = v
    return out


#: DepthBench ``hyper_connections.reduce_mode`` -> hf_depth's final reduce
DEPTHBENCH_REDUCE = {"sum": "sum_of_normed", "mean": "mean_then_norm", "auto": "sum_of_normed"}


def olmo_reduce(block: dict, field: str) -> dict:
    reduce = DEPTHBENCH_REDUCE.get((block.get("hyper_connections") or {}).get("reduce_mode"))
    return {} if reduce is None else {field: reduce}


#: DepthBench HyperConnection(kind="hc") -> hf_depth HC connection
HC_NAMES = {"static_alpha": "static_alpha", "dynamic_alpha_proj": "dynamic_alpha", "dynamic_alpha_scale": "alpha_scale",
            "static_beta": "static_beta", "dynamic_beta_proj": "dynamic_beta", "dynamic_beta_scale": "beta_scale"}
#: the HC version, never guessed: True = ``H' = A_r^T H + beta y`` (hyper_connections.py @ 8cc2fd7), False =
#: ``H' = H + beta y`` (the earlier version @ 5152cab); the state dicts of both are identical
HC_VERSION = "hc_stream_mixing"


def olmo_layer(config, i: int, options: dict) -> list:
    rules = pre_norms(config, i)
    for olmo, hf in olmo_connections(i):
        rules += [one(f"{olmo}.{o}", f"{hf}.{h}") for o, h in HC_NAMES.items()]
    return rules


def stream_extra_activation_bytes(config, batch: int, seq_len: int, compute_bytes: int,
                                  routing_floats: int = 0) -> int:
    """HC and mHC (``depth_ops.stream_route``/``stream_write``), per token: every sublayer's branch output y
    (compute dtype), write weights w (n, fp32) and ``routing_floats`` fp32 coefficient inputs
    (``routing_saved``; the CPU path: the Triton path recomputes them); the n streams H (fp32) at every segment
    start after the first (``SEGMENT`` sublayers per segment; the first one's H is the embedding's broadcast,
    d); with ``sum_of_normed`` the final norm of all n streams instead of one vector."""
    n, d, S = config.num_streams, config.hidden_size, config.num_sublayers
    per_token = S * (d * compute_bytes + (n + routing_floats) * 4)
    per_token += ((S - 1) // SEGMENT) * n * d * STREAM_BYTES + d * STREAM_BYTES
    if config.final_reduce == "sum_of_normed":
        per_token += (n - 1) * rms_norm_saved_bytes(d)
    return per_token * batch * seq_len


def hc_extra_activation_bytes(config, batch: int, seq_len: int, compute_bytes: int) -> int:
    """``stream_extra_activation_bytes`` with dynamic HC's saved 1/rms (n) and projections (n (n + 2))."""
    n = config.num_streams
    return stream_extra_activation_bytes(config, batch, seq_len, compute_bytes,
                                         n * (n + 3) if config.hc_dynamic else 0)


#: what HC and mHC share: the n-stream state and its init, and the OLMo-core branch aliases of their blocks
MULTI_STREAM = dict(stream=MultiStream, init_scale=output_init_scale)
MULTI_STREAM_OLMO = dict(fold=fold_branch_aliases, aliases=branch_aliases)

OLMO = OlmoRules(
    "hc", layer=olmo_layer, **MULTI_STREAM_OLMO,
    infer=lambda sd: ({"hc_streams": int(sd["blocks.0.attention_hyper_connection.static_alpha"].shape[0])}
                      if "blocks.0.attention_hyper_connection.static_alpha" in sd else {}),
    json_fields=lambda block: olmo_reduce(block, "hc_final_reduce"),
    forward_fields=(HC_VERSION, "hc_final_reduce"),
    required={HC_VERSION: f"{HC_VERSION}=true for H' = A_r^T H + beta y, false for the earlier H' = H + beta y"},
    record=lambda config, backend: {"hc_version": (
        "H' = A_r^T H + beta y (hyper_connections.py @ 8cc2fd7)" if config.hc_stream_mixing
        else "H' = H + beta y, no stream mixing (earlier hyper_connections.py @ 5152cab)")},
)

def hc_upcycle_closeness(config) -> tuple[str, float] | None:
    """``mean_then_norm``: the n equal streams reduce to Pre-LN's stream exactly (routing at its init)."""
    return ("exact", UPCYCLE_EXACT_TOL) if config.hc_final_reduce == "mean_then_norm" else None


DESIGN = register(Design(
    "hc", HCConfig, HCModel, HCForCausalLM, connection=HCConnection, param_roles=HCConnection.param_roles,
    upcycle_fields={"hc_final_reduce": "mean_then_norm"}, upcycle_closeness=hc_upcycle_closeness,
    extra_params=hc_extra_params, extra_flops=hc_extra_flops, extra_activation_bytes=hc_extra_activation_bytes,
    olmo=OLMO, **MULTI_STREAM,
    summary="x = sum_i A_i0 H_i, H' = A_r^T H + beta F(N(x)); A, beta static + 0.01 tanh(dynamic), n = 4 streams",
    paper="Zhu et al. 2025, Hyper-Connections (ICLR 2025, arXiv 2409.19606)",
))
