"""Manifold-constrained Hyper-Connections, mHC (DepthBench ``mhc``; Xie et al., DeepSeek, arXiv 2512.24880).

n streams H in R^{n x d} per token; for every sublayer s, with x~ = vec(H) in R^{nd} and r = rms(x~):

    [h_pre, h_post, h_res] = (1/r) [a_pre x~ phi_pre, a_post x~ phi_post, a_res x~ phi_res] + b
    H_pre  = sigmoid(h_pre)                    in R^n        (read weights)
    H_post = 2 sigmoid(h_post)                 in R^n        (write weights)
    H_res  = SinkhornKnopp(h_res)              in R^{n x n}  (doubly stochastic; log domain, fp32, 20 iterations)
    H'     = H_res H + H_post^T F_s(N_s(H_pre H))

phi in R^{nd x (n^2 + 2n)} (split order [pre | post | res], h_res reshaped row-major, H_res applied from the
left), three gates a (init 0.01), b in R^{n^2 + 2n}. No tanh (``mhc_dynamic_tanh=True``: a tanh(x~ phi / r) + b, the
forward of DepthBench's pure-torch ``mhc`` backend, ``nn/hyper_connections.py`` @ 8cc2fd7, set by
``hf-depth convert-olmo-core`` for its checkpoints). The routing (coefficients, Sinkhorn, mixing)
runs with autocast disabled: coefficients and Sinkhorn in fp32, mixing in the state's dtype.

Initialization, ``mhc_init`` (the references disagree, ARCHITECTURES.md 3.7):

* ``"uniform"`` (default): b = 0, phi ~ N(0, 0.02^2): H_pre = 1/2, H_post = 1, H_res ~ J/n. This is
  DepthBench's Liger backend (``liger_mhc``), the one its 400M launcher ran.
* ``"identity"``: DepthBench's pure-torch backend: phi = 0, b_pre = +8 at s mod n and -8 elsewhere, b_post = 0,
  b_res = +8 on the diagonal and -8 off it (H_res ~ I). Known pitfall: the saturated +-8 logits give H_res
  vanishing gradients, so it tends to stay at identity.

With either init the replicated streams stay (nearly) equal: exactly with phi = 0 (the +-8 sigmoids only move
the scale of the branch input, which the branch norm removes), approximately with small random phi.
Final reduce ``mhc_final_reduce``: ``"mean_then_norm"`` (default, DepthBench liger_mhc) or
``"sum_of_normed"`` (its torch backend). W_o and W_down init / sqrt(n) (``mhc_scale_output_init``, DepthBench).

Extra parameters per sublayer: n d (n^2 + 2n) + n^2 + 2n + 3 (98 331 at d = 1024, n = 4). DepthBench LR 2e-3.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import initialization as init

from .configuration_depth import DepthConfig, check_fields, field_alias
from .depth_ops import _sum_to, native_fused_op, native_stream_op
from .design_hc import (
    FINAL_REDUCES,
    MULTI_STREAM,
    MULTI_STREAM_OLMO,
    MultiStreamConnection,
    multi_stream_flops,
    normalized_projection,
    normalized_projection_backward,
    olmo_connections,
    olmo_reduce,
    stream_extra_activation_bytes,
)
from .dispatch import mhc_coefficients, mhc_depth, mhc_width, sinkhorn
from .functional import _acc
from .modeling_depth import DepthForCausalLM, DepthModel
from .olmo_rules import OlmoRules, Rule, one, pre_norms
from .residual import Design, register

MHC_INITS = ("uniform", "identity")
MHC_SINKHORN_ORDERS = ("rows_first", "columns_first")


class MHCConfig(DepthConfig):
    """mHC decoder. Each field is documented below it."""

    model_type = "hf_depth_mhc"
    design = "mhc"

    mhc_streams: int = 4
    """Number of residual streams n (4)."""
    mhc_sinkhorn_iters: int = 20
    """Sinkhorn-Knopp iterations t_max (20)."""
    mhc_init: str = "uniform"
    """``"uniform"`` (default; zero biases, phi ~ N(0, ``mhc_phi_init_std``^2): what DepthBench's 400M runs used, Liger
    backend) or ``"identity"`` (phi = 0, +-``mhc_identity_logit`` biases: H_pre one-hot at s mod n, H_res ~ I;
    DepthBench's torch backend)."""
    mhc_gate_init: float = 0.01
    """Init of the three gates a_pre, a_post, a_res (0.01)."""
    mhc_phi_init_std: float = 0.02
    """Std of phi under ``"uniform"`` init (0.02)."""
    mhc_identity_logit: float = 8.0
    """Magnitude of the biases of the ``"identity"`` init (8)."""
    mhc_final_reduce: str = "mean_then_norm"
    """``"mean_then_norm"`` (default, DepthBench liger_mhc) or ``"sum_of_normed"``."""
    mhc_scale_output_init: bool = True
    """Divide the init std of W_o and W_down by sqrt(n) (DepthBench default)."""
    mhc_norm_eps: float = 1e-6
    """Eps of the RMS r of the flattened streams (1e-6, DepthBench liger_rms_eps)."""
    mhc_dynamic_tanh: bool = False
    """``False`` (default, the paper and Liger): gate * projection + bias. ``True``: gate * tanh(projection) + bias,
    DepthBench's pure-torch ``mhc`` backend (converted checkpoints)."""
    mhc_sinkhorn_order: str = "rows_first"
    """``"rows_first"`` (default: each iteration normalizes rows, then columns) or ``"columns_first"``. DepthBench's
    torch backends apply R[s, t] from the right; hf_depth stores R^T, and the transpose of a rows-first Sinkhorn is
    a columns-first one: set for converted ``mhc`` / ``mhc_static`` checkpoints, it makes H_res equal DepthBench's
    exactly, 20-iteration residual included."""

    def validate_design(self):
        check_fields(self, ints=["mhc_streams", "mhc_sinkhorn_iters"], flags=["mhc_scale_output_init", "mhc_dynamic_tanh"],
                     non_negative=["mhc_gate_init", "mhc_phi_init_std", "mhc_identity_logit"], eps=["mhc_norm_eps"],
                     choices={"mhc_init": MHC_INITS, "mhc_final_reduce": FINAL_REDUCES,
                              "mhc_sinkhorn_order": MHC_SINKHORN_ORDERS})

    num_streams = field_alias("mhc_streams")
    final_reduce = field_alias("mhc_final_reduce")
    scale_output_init = field_alias("mhc_scale_output_init")


class MHCConnection(MultiStreamConnection):
    """mHC connection of sublayer ``s``. Parameters (and roles): ``dynamic_phi`` [n d, n^2 + 2n]
    (routing_dynamic), ``static_bias`` [n^2 + 2n] (routing_static), ``alpha_scale`` [3] = a_pre, a_post, a_res
    (routing_scale)."""

    param_roles = {"dynamic_phi": "routing_dynamic", "static_bias": "routing_static", "alpha_scale": "routing_scale"}

    def __init__(self, config: MHCConfig, sublayer_idx: int):
        super().__init__(config, sublayer_idx)
        n, d = self.n, config.hidden_size
        self.iters, self.eps = config.mhc_sinkhorn_iters, config.mhc_norm_eps
        self.tanh, self.columns_first = config.mhc_dynamic_tanh, config.mhc_sinkhorn_order == "columns_first"
        self.init_kind, self.gate_init = config.mhc_init, config.mhc_gate_init
        self.phi_std, self.identity_logit = config.mhc_phi_init_std, config.mhc_identity_logit
        self.dynamic_phi = nn.Parameter(torch.empty(n * d, n * n + 2 * n))
        self.static_bias = nn.Parameter(torch.empty(n * n + 2 * n))
        self.alpha_scale = nn.Parameter(torch.empty(3))
        with torch.no_grad():
            self.reset_design_parameters()

    def static_bias_init(self) -> torch.Tensor:
        n, c = self.n, self.identity_logit
        b = torch.zeros(n * n + 2 * n, device=self.static_bias.device)
        if self.init_kind == "identity":
            pre = torch.full((n,), -c, device=b.device)
            pre[self.sublayer_idx % n] = c
            eye = torch.eye(n, device=b.device)
            b[:n] = pre
            b[2 * n :] = (c * eye - c * (1 - eye)).flatten()
        return b

    def reset_design_parameters(self) -> None:
        if self.init_kind == "identity":
            init.zeros_(self.dynamic_phi)
        else:
            init.normal_(self.dynamic_phi, mean=0.0, std=self.phi_std)
        init.copy_(self.static_bias, self.static_bias_init())
        init.constant_(self.alpha_scale, self.gate_init)

    def coefficients(self, H: torch.Tensor):
        """(H_pre [..., n], H_post [..., n], H_res [..., n, n]) in fp32."""
        return mhc_coefficients(H, self.dynamic_phi, self.alpha_scale, self.static_bias, self.iters, self.eps,
                                 tanh=self.tanh, columns_first=self.columns_first)

    def route(self, H):
        pre, post, res = self.coefficients(H)
        x, mixed = mhc_width(H, pre, res)
        return x, mixed, post, {"pre": pre, "res": res, "post": post}

    def _gates(self, proj: torch.Tensor):
        """(pre, post, logits, t) from the normalized projection ``proj`` = (vec(H) phi) / r, [..., n^2 + 2n], with
        the ops of ``functional.mhc_gates`` before its Sinkhorn; ``logits`` [..., n, n] as the Sinkhorn takes them
        (rows normalized first: transposed for ``columns_first``)."""
        n, a, b = self.n, _acc(self.alpha_scale), _acc(self.static_bias)
        t = torch.tanh(proj) if self.tanh else proj
        pre = torch.sigmoid(a[0] * t[..., :n] + b[:n])
        post = 2.0 * torch.sigmoid(a[1] * t[..., n : 2 * n] + b[n : 2 * n])
        logits = (a[2] * t[..., 2 * n :] + b[2 * n :]).unflatten(-1, (n, n))
        return pre, post, (logits.transpose(-1, -2) if self.columns_first else logits), t

    def routing_saved(self, H):
        # functional.mhc_coefficients to fp32 rounding: 1 / rms by one norm, then the gates and a Sinkhorn faster
        # than the reference's: the native per-token kernel on CPU where it runs (streams of a training shape),
        # else ``sinkhorn_iterates`` (one fused ``log_softmax`` per half-step instead of the log-domain form's seven)
        r, proj = normalized_projection(_acc(H.flatten(-2)), _acc(self.dynamic_phi).T, self.eps)
        pre, post, logits, _ = self._gates(proj)
        res = native_stream_op(H, "sinkhorn", logits, self.iters)
        res = sinkhorn_iterates(logits, self.iters) if res is None else res
        res = res.transpose(-1, -2) if self.columns_first else res
        M = torch.cat((pre.unsqueeze(-2), res), dim=-2)
        return M, post, {"pre": pre, "res": res, "post": post}, (r, proj, M)

    def routing_rebuild(self, saved):
        pre, post, logits, t = self._gates(saved[1])
        return saved[2], (pre, post, t, logits)  # the forward's M: the streams are rebuilt bit-identical

    def routing_backward(self, H, saved, state, dM, dw, dH):
        n, a = self.n, _acc(self.alpha_scale)
        r, proj, _ = saved
        pre, post, t, logits = state
        du_pre = dM[..., 0, :] * pre * (1 - pre)
        du_post = dw * post * (1 - 0.5 * post)  # d(2 sigmoid(u))/du = 2 s (1 - s), s = post / 2
        dres = dM[..., 1:, :]
        dres = dres.transpose(-1, -2) if self.columns_first else dres  # as the logits
        dlogits = native_stream_op(H, "sinkhorn_backward", dres, logits, self.iters)  # the forward's rule
        if dlogits is None:
            keep = []
            sinkhorn_iterates(logits, self.iters, keep)
            dlogits = sinkhorn_backward(dres, keep)
        dlogits = (dlogits.transpose(-1, -2) if self.columns_first else dlogits).flatten(-2)
        du = torch.cat((du_pre, du_post, dlogits), dim=-1)  # gradient of a t + b, [..., n^2 + 2n]
        da = torch.stack([(du[..., :n] * t[..., :n]).sum(), (du_post * t[..., n : 2 * n]).sum(),
                          (dlogits * t[..., 2 * n :]).sum()])
        gate = torch.cat((a[0].expand(n), a[1].expand(n), a[2].expand(n * n)))
        dt = du * gate
        dproj = dt * (1 - t * t) if self.tanh else dt
        dphiT = normalized_projection_backward(H.flatten(-2), r, proj, dproj, _acc(self.dynamic_phi).T,
                                               dH.view(*H.shape[:-2], -1))
        return {"dynamic_phi": dphiT.T, "static_bias": _sum_to(du, self.static_bias), "alpha_scale": da}

    def _fused_args(self) -> tuple:
        return self.static_bias, self.alpha_scale, self.tanh, self.columns_first, self.iters

    def fused_route(self, H):
        # the projection's product by the library (a GEMM), 1 / rms and the rest in one native pass per token
        if H.dtype != torch.float32 or not H.is_cpu:  # streams the native kernels decline: no product for nothing
            return None
        X = _acc(H.flatten(-2))
        proj = (X.reshape(-1, X.shape[-1]) @ _acc(self.dynamic_phi)).view(*X.shape[:-1], -1)
        out = native_fused_op("mhc_route", H, proj, *self._fused_args(), self.eps)
        if out is None:
            return None
        x, mixed, M, post, r = out
        return x, mixed, post, lambda: {"pre": M[..., 0, :], "res": M[..., 1:, :], "post": post}, (r, proj, M)

    def fused_rebuild(self, H, saved, w, y):
        return native_fused_op("stream_mix_write", saved[2], H, w, y)

    def fused_backward(self, H, saved, dx, dmixed, dw):
        r, proj, M = saved
        out = native_fused_op("mhc_route_backward", H, proj, r, M, *self._fused_args(), dx, dmixed, dw)
        if out is None:
            return None
        dH, dQ, dbias, dalpha = out
        X = _acc(H.flatten(-2)).reshape(-1, H.shape[-2] * H.shape[-1])
        dH.view(-1, X.shape[-1]).addmm_(dQ, _acc(self.dynamic_phi).T)  # the projection's part of dH; d phi = X^T dQ
        return dH, {"dynamic_phi": (dQ.T @ X).T, "static_bias": dbias, "alpha_scale": dalpha}

    def depth(self, mixed, post, out):
        return mhc_depth(mixed, post, out)

    def static_weights(self):
        n, b = self.n, self.static_bias.detach().float()
        logits = b[2 * n :].unflatten(-1, (n, n))
        if self.columns_first:
            res = sinkhorn(logits.T, self.iters).T
        else:
            res = sinkhorn(logits, self.iters)
        return {"pre": torch.sigmoid(b[:n]), "res": res, "post": 2.0 * torch.sigmoid(b[n : 2 * n])}

    def extra_repr(self) -> str:
        return f"sublayer={self.sublayer_idx}, streams={self.n}, init={self.init_kind}, sinkhorn_iters={self.iters}"


def sinkhorn_iterates(logits: torch.Tensor, iters: int, keep: list | None = None) -> torch.Tensor:
    """``functional.sinkhorn`` (rows, then columns, ``iters`` times): each half-step z <- z - logsumexp(z) is one
    ``log_softmax`` (the same log-domain iterate, fused into one op instead of logsumexp's six), at least in fp32.

    The matrices are laid out token-last, [n, n, tokens], so that every row / column reduction runs over whole
    token vectors (on CPU, about half the time of a reduction over 4 adjacent numbers per token), and every later
    op, the backward's included, inherits that contiguous layout. ``keep`` (a list) receives every iterate, in
    that layout, for ``sinkhorn_backward``. Returns the result as ``logits`` ([..., n, n], their dtype)."""
    n = logits.shape[-1]
    dt = torch.promote_types(logits.dtype, torch.float32)
    z = logits.to(dt).reshape(-1, n, n).permute(1, 2, 0).contiguous()  # [row, column, token]
    for _ in range(iters):
        for dim in (1, 0):  # normalize the rows (over columns), then the columns (over rows)
            z = torch.log_softmax(z, dim)
            if keep is not None:
                keep.append(z)
    return z.exp().permute(2, 0, 1).reshape(logits.shape).to(logits.dtype)


def sinkhorn_backward(dres: torch.Tensor, keep: list) -> torch.Tensor:
    """Gradient of the logits of ``sinkhorn_iterates`` (exact through every iteration, not the implicit one).

    res = exp(z_K), so dz_K = dres * res; each half-step z' = log_softmax(z) has dz = dz' - exp(z') sum(dz'),
    which is aten's fused ``_log_softmax_backward_data`` on the kept iterate z' (token-last, as ``keep``
    holds them)."""
    n, z = dres.shape[-1], keep[-1]
    dz = dres.to(z.dtype).reshape(-1, n, n).permute(1, 2, 0).contiguous() * z.exp()
    for k in range(len(keep) - 1, -1, -1):
        dz = torch._log_softmax_backward_data(dz, keep[k], 1 if k % 2 == 0 else 0, z.dtype)
    return dz.permute(2, 0, 1).reshape(dres.shape).to(dres.dtype)


def mhc_extra_flops(config, T: int, model=None) -> dict:
    """mHC (functional.mhc_*): per sublayer vec(H) phi [n d] x [n d, n^2 + 2n], the read and the H_res mix;
    other: the Sinkhorn iterations."""
    n, S = config.num_streams, config.num_sublayers
    sinkhorn = 2 * config.mhc_sinkhorn_iters * 3 * n * n * T
    return {"matmul": S * multi_stream_flops(config, T, n * n + 2 * n), "other": S * sinkhorn}


def mhc_extra_activation_bytes(config, batch: int, seq_len: int, compute_bytes: int) -> int:
    """``stream_extra_activation_bytes`` with mHC's saved 1/rms (1), projections (n^2 + 2n) and [H_pre; H_res]
    (n^2 + n)."""
    n = config.num_streams
    return stream_extra_activation_bytes(config, batch, seq_len, compute_bytes, 2 * n * n + 3 * n + 1)


def mhc_extra_params(config: MHCConfig) -> int:
    n, d = config.mhc_streams, config.hidden_size
    return config.num_sublayers * (n * d * (n * n + 2 * n) + n * n + 2 * n + 3)


class MHCModel(DepthModel):  # mHC decoder (no LM head)
    config_class = MHCConfig


class MHCForCausalLM(DepthForCausalLM):  # mHC causal LM
    config_class, base_model_class = MHCConfig, MHCModel


# ---- DepthBench / OLMo-core names: three parameter layouts (backends) of one function (``docs/olmo_core.md``)
#: hf_depth mHC parameters: one projection [n d, 2n + n^2] in the order [pre | post | res], gates, biases
MHC_NAMES = {"phi": "dynamic_phi", "alpha": "alpha_scale", "bias": "static_bias"}
MHC_BACKENDS = ("liger_mhc", "mhc", "mhc_static")
#: hf_depth mHC fields that follow DepthBench's backend unless given (final reduce, RMS eps, tanh, Sinkhorn order)
MHC_BACKEND_FIELDS = {
    "liger_mhc": {"mhc_final_reduce": "mean_then_norm", "mhc_norm_eps": 1e-6},
    "mhc": {"mhc_final_reduce": "sum_of_normed", "mhc_norm_eps": 1e-8, "mhc_dynamic_tanh": True,
            "mhc_sinkhorn_order": "columns_first"},
    "mhc_static": {"mhc_final_reduce": "sum_of_normed", "mhc_sinkhorn_order": "columns_first"},
}


def detect_backend(sd: dict) -> str | None:
    if any(k.endswith("_hyper_connection.phi") for k in sd):
        return "liger_mhc"
    if any(k.endswith("_hyper_connection.H_res_logits") for k in sd):
        return "mhc_static"
    if any(k.endswith("_hyper_connection.residual_dynamic_proj") for k in sd):
        return "mhc"
    return None


def _res_t(flat: torch.Tensor, n: int) -> torch.Tensor:
    """Swap the (s, t) order of n*n columns (last dim): DepthBench's R[s, t] <-> hf_depth's R[t, s]."""
    return flat.unflatten(-1, (n, n)).transpose(-1, -2).flatten(-2)


def _gates(ts):
    return [torch.stack([t.reshape(()) for t in ts])]


def _logit(p: torch.Tensor) -> torch.Tensor:
    return torch.log(p) - torch.log1p(-p)


def _static_to_dynamic(n: int, d: int, tau: float):
    """DepthBench ``mhc_static`` (softmax pre/post, Sinkhorn(res/tau), input independent) -> hf_depth's mHC form
    with phi = 0: sigmoid(b_pre) = softmax(pre), 2 sigmoid(b_post) = softmax(post), b_res = (res / tau)^T."""

    def to_hf(ts):
        pre, post, res = (t.double() for t in ts)
        b = torch.cat([_logit(torch.softmax(pre, -1)), _logit(torch.softmax(post, -1) / 2), (res / tau).T.flatten()])
        phi = torch.zeros(n * d, n * n + 2 * n, dtype=ts[0].dtype)
        return [phi, b.to(ts[0].dtype), torch.full((3,), 0.01, dtype=ts[0].dtype)]

    def to_olmo(ts):
        phi, b, _ = ts  # the gates multiply phi = 0: they carry no information here
        pre, post = torch.sigmoid(b[:n].double()), 2 * torch.sigmoid(b[n : 2 * n].double())
        if torch.count_nonzero(phi) or abs(float(pre.sum()) - 1) > 1e-5 or abs(float(post.sum()) - 1) > 1e-5:
            raise ValueError(
                "`mhc_backend`='mhc_static' cannot hold this model: it needs phi = 0 and read/write weights that "
                f"sum to 1 (got sum(H_pre)={float(pre.sum()):.4f}, sum(H_post)={float(post.sum()):.4f}); "
                "export with mhc_backend='liger_mhc' or 'mhc'"
            )
        res = b[2 * n :].unflatten(0, (n, n)).T * tau
        return [torch.log(pre).to(b.dtype), torch.log(post).to(b.dtype), res]

    return to_hf, to_olmo


def _connection_rules(olmo: str, hf: str, backend: str, n: int, d: int, tau: float = 1.0) -> list:
    H = {k: f"{hf}.{v}" for k, v in MHC_NAMES.items()}
    unbind = lambda ts: list(ts[0].unbind(0))  # noqa: E731
    if backend == "liger_mhc":  # Liger splits [pre | post | res] and applies H_res from the left, as here
        return [one(f"{olmo}.phi", H["phi"]), one(f"{olmo}.b", H["bias"]),
                Rule(tuple(f"{olmo}.alpha_{p}" for p in ("pre", "post", "res")), (H["alpha"],), to_hf=_gates,
                     to_olmo=unbind)]
    if backend == "mhc":  # DepthBench's torch backend applies H_res as mixed_t = sum_s R[s, t] H_s: transposed
        return [
            Rule(tuple(f"{olmo}.{p}_dynamic_proj" for p in ("pre", "post", "residual")), (H["phi"],),
                 to_hf=lambda ts: [torch.cat([ts[0], ts[1], _res_t(ts[2], n)], dim=-1)],
                 to_olmo=lambda ts: [ts[0][:, :n], ts[0][:, n : 2 * n], _res_t(ts[0][:, 2 * n :], n)]),
            Rule(tuple(f"{olmo}.{p}_bias" for p in ("pre", "post", "residual")), (H["bias"],),
                 to_hf=lambda ts: [torch.cat([ts[0], ts[1], ts[2].transpose(0, 1).flatten()])],
                 to_olmo=lambda ts: [ts[0][:n], ts[0][n : 2 * n], ts[0][2 * n :].unflatten(0, (n, n)).transpose(0, 1)]),
            Rule(tuple(f"{olmo}.{p}_gate" for p in ("pre", "post", "residual")), (H["alpha"],), to_hf=_gates,
                 to_olmo=unbind),
        ]
    if backend == "mhc_static":
        to_hf, to_olmo = _static_to_dynamic(n, d, tau)
        return [Rule(tuple(f"{olmo}.H_{p}_logits" for p in ("pre", "post", "res")), (H["phi"], H["bias"], H["alpha"]),
                     to_hf=to_hf, to_olmo=to_olmo)]
    raise ValueError(f"`mhc_backend` must be one of {list(MHC_BACKENDS)}, got {backend!r}")


def olmo_layer(config, i: int, options: dict) -> list:
    rules = pre_norms(config, i)
    for olmo, hf in olmo_connections(i):
        rules += _connection_rules(olmo, hf, options["backend"], config.num_streams, config.hidden_size,
                                   options["sinkhorn_tau"])
    return rules


def olmo_streams(sd: dict) -> dict:
    """n from the first connection: ``pre_bias`` / ``H_pre_logits`` [n], or Liger's ``b`` [n^2 + 2n]."""
    c = "blocks.0.attention_hyper_connection"
    for k in (f"{c}.pre_bias", f"{c}.H_pre_logits"):
        if k in sd:
            return {"mhc_streams": int(sd[k].shape[0])}
    if f"{c}.b" in sd:
        return {"mhc_streams": int(round(math.sqrt(int(sd[f"{c}.b"].shape[0]) + 1) - 1))}
    return {}


def olmo_json(block: dict) -> dict:
    hc = block.get("hyper_connections") or {}
    out = olmo_reduce(block, "mhc_final_reduce")
    if hc.get("kind") in MHC_BACKENDS:
        out["mhc_backend"] = hc["kind"]
    if hc.get("sinkhorn_tau") is not None:
        out["sinkhorn_tau"] = float(hc["sinkhorn_tau"])
    return out


OLMO = OlmoRules(
    "mhc", layer=olmo_layer, **MULTI_STREAM_OLMO, infer=olmo_streams,
    json_fields=olmo_json, backends=MHC_BACKENDS, detect_backend=detect_backend,
    defaults=lambda sd, backend: dict(MHC_BACKEND_FIELDS[backend]),
    forward_fields=("mhc_dynamic_tanh", "mhc_sinkhorn_order", "mhc_final_reduce", "mhc_norm_eps"),
    record=lambda config, backend: {"mhc_backend": backend},
)

MHC_IDENTITY_BOUND = 1e-4
"""fp32 max |delta logits| allowed when upcycling to mHC ``identity``: measured at most 6e-7 on the tiny test configs
(logits up to ~0.4); the sigmoid(-8) = 3.4e-4 leak of the init, which the branch norms remove up to eps, is the scale
of what the init could allow; 1e-4 keeps a 100x margin over the measurement and sits below that leak."""


def mhc_upcycle_closeness(config) -> tuple[str, float] | None:
    """Identity init (phi = 0, +-8 biases) with ``mean_then_norm``: Pre-LN's function up to the sigmoid(-8) leak."""
    ok = config.mhc_init == "identity" and config.mhc_final_reduce == "mean_then_norm"
    return ("bounded", MHC_IDENTITY_BOUND) if ok else None


DESIGN = register(Design(
    "mhc", MHCConfig, MHCModel, MHCForCausalLM, connection=MHCConnection, param_roles=MHCConnection.param_roles,
    upcycle_fields={"mhc_init": "identity"}, upcycle_closeness=mhc_upcycle_closeness,
    extra_params=mhc_extra_params, extra_flops=mhc_extra_flops, extra_activation_bytes=mhc_extra_activation_bytes,
    olmo=OLMO, **MULTI_STREAM,
    summary="H' = H_res H + H_post^T F(N(H_pre H)); H_res = Sinkhorn (doubly stochastic), H_pre = sigmoid, "
    "H_post = 2 sigmoid",
    paper="Xie et al. 2025, mHC: Manifold-Constrained Hyper-Connections (DeepSeek, arXiv 2512.24880)",
))
