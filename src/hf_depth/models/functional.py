"""Pure-PyTorch references of the hot, memory-bound operations.

These are the CPU path of every model and the ground truth that each Triton kernel in
``hf_depth.kernels`` is tested against. They follow Llama's cast order: normalize in fp32, cast back to
the input dtype, then multiply by the weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_FP32_ACC = frozenset({torch.float32, torch.bfloat16, torch.float16})


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32 for fp32 and narrower floats, float64 kept (so gradcheck runs in float64).
    (The common dtypes skip ``torch.promote_types``, a dispatcher call per norm of every decoding step.)"""
    return torch.float32 if dtype in _FP32_ACC else torch.promote_types(dtype, torch.float32)


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, or ``x`` itself without a dispatcher call where it already has that dtype (per sublayer and
    parameter in the hand-written backward passes)."""
    return x if x.dtype == dtype else x.to(dtype)


def _acc(x: torch.Tensor) -> torch.Tensor:
    """``x`` in its accumulation dtype (see ``_acc_dtype``); ``x`` itself, without a dispatcher call, when it is
    already in it (the routing calls this on every parameter and stream of every sublayer)."""
    return _as(x, _acc_dtype(x.dtype))


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """y = weight * (x / rms(x)), normalized in fp32 and cast back before the weight (Llama order)."""
    dtype = x.dtype
    h = _acc(x)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = h.to(dtype)
    return h if weight is None else weight * h


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up."""
    return F.silu(gate) * up


def add_rms_norm(
    residual: torch.Tensor, update: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + update, rms_norm(residual + update)): the fused Pre-LN step between two sublayers."""
    h = residual + update
    return h, rms_norm(h, weight, eps)


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Unweighted RMS normalization N̄(x) over the last dim (fp32 inside, input dtype out)."""
    return rms_norm(x, None, eps)


def inv_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(x^2) + eps) over the last dim, keepdim, by one norm (no squared copy of x); x's dtype."""
    return torch.rsqrt(torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(x.shape[-1]).add_(eps))


def rms_norm_multi(x: torch.Tensor, weights: list[torch.Tensor | None], eps: float) -> list[torch.Tensor]:
    """One normalization of x, several gamma-scaled outputs (the HG scale vectors): [w_i * N̄(x)]."""
    h = rms(x, eps)
    return [h if w is None else w * h for w in weights]


# --------------------------------------------------------------------------- Hyper-Connections (HC)
# Streams H: [..., n, d]. Width weights A: [..., n, n+1] (column 0 mixes the branch input, columns 1..n the
# streams among themselves); depth weights beta: [..., n].


def hc_coefficients(
    H: torch.Tensor,
    static_alpha: torch.Tensor,
    dynamic_alpha: torch.Tensor,
    alpha_scale: torch.Tensor,
    static_beta: torch.Tensor,
    dynamic_beta: torch.Tensor,
    beta_scale: torch.Tensor,
    eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic HC coefficients: A = A_static + s_a tanh(N̄(H) W_a), beta = B_static + s_b tanh(N̄(H) w_b).

    Shapes: static_alpha [n, n+1], dynamic_alpha [d, n+1], static_beta [n], dynamic_beta [d], scales scalar.
    Computed in fp32 (float64 stays float64); returned in that dtype.
    """
    Hn = rms(_acc(H), eps)
    A = _acc(static_alpha) + _acc(alpha_scale) * torch.tanh(Hn @ _acc(dynamic_alpha))
    beta = _acc(static_beta) + _acc(beta_scale) * torch.tanh(Hn @ _acc(dynamic_beta))
    return A, beta


#: streams of fewer elements than this are mixed by the batched product (dispatch-bound, not memory-bound)
_ONE_PASS_MIN = 1 << 16


def mix_streams(M: torch.Tensor, H: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """M H per token: [..., r, n] @ [..., n, d] -> [..., r, d], in the streams' dtype (``out``: added to it, in
    place, and returned).

    fp32 / float64 streams of a training shape: sum_s M[:, s] H_s as n broadcast passes (one product, n - 1
    fused multiply-adds in place), several times faster on CPU than the batched product, whose [r, n] @ [n, d]
    per token runs far below bandwidth once the streams have left the cache (einsum is slower still: a
    per-token path). Half precision, and decoding (a few tokens): the batched product (one rounding per output)."""
    M = M.to(H.dtype)
    if H.dtype not in (torch.float32, torch.float64) or H.numel() < _ONE_PASS_MIN:
        return M @ H if out is None else out.add_(M @ H)
    cols, slots = M.unsqueeze(-1).unbind(-2), H.unsqueeze(-2).unbind(-3)  # [..., r, 1] and [..., 1, d] views
    start = out is None  # a fresh output starts as the first slot's product
    if start:
        out = cols[0] * slots[0]
    for c, h in zip(cols[start:], slots[start:]):
        out.addcmul_(c, h)
    return out


def read_and_mix(M: torch.Tensor, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, mixed) = (row 0, rows 1..n) of M H for M [..., n+1, n], each on its own storage (the branch norm saves
    x; no copy of it off a joint product): the CPU training path (``depth_ops._Route``). ``hc_width`` /
    ``mhc_width`` (reference, decoding) keep the joint product."""
    return mix_streams(M[..., :1, :], H).squeeze(-2), mix_streams(M[..., 1:, :], H)


def hc_width(H: torch.Tensor, A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Branch input x = sum_s A[s, 0] H_s, and mixed streams H'_t = sum_s A[s, t+1] H_s. Returns (x, H')."""
    full = mix_streams(A.transpose(-1, -2), H)
    return full[..., 0, :].contiguous(), full[..., 1:, :]  # x on its own storage: the branch norm saves it


def hc_depth(mixed: torch.Tensor, beta: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Write the branch output into every stream: H'_t = mixed_t + beta_t * y."""
    return write_streams(mixed, beta, y)


def write_streams(mixed: torch.Tensor, w: torch.Tensor, y: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """``mixed + w.to(mixed.dtype).unsqueeze(-1) * y.unsqueeze(-2)`` (HC and mHC's write) as one ``addcmul``:
    one pass over the streams instead of a stream-sized temporary and two passes (and faster on CPU than a
    batched ``[n, 1] @ [1, d]`` product per token). ``inplace``: into ``mixed`` (the same arithmetic; no fresh
    stream-sized output, the costlier write on CPU)."""
    w = w.to(mixed.dtype).unsqueeze(-1)
    if mixed.dtype != y.dtype:
        return mixed.add_(w * y.unsqueeze(-2)) if inplace else mixed + w * y.unsqueeze(-2)
    return mixed.addcmul_(w, y.unsqueeze(-2)) if inplace else torch.addcmul(mixed, w, y.unsqueeze(-2))


# --------------------------------------------------------------------------- mHC
def sinkhorn(logits: torch.Tensor, iters: int = 20) -> torch.Tensor:
    """Log-domain Sinkhorn-Knopp in fp32: exp(logits) alternately row- then column-normalized ``iters`` times.

    logits: [..., n, n]. Each half-step z <- z - logsumexp(z) is ``log_softmax`` (the same iterate as one fused op,
    not logsumexp's several plus a subtraction: a decoding step runs 2 ``iters`` of them per sublayer). After the
    last (column) step every column sums to 1 exactly; rows converge to 1.
    """
    z = _acc(logits)
    for _ in range(iters):
        z = torch.log_softmax(torch.log_softmax(z, dim=-1), dim=-2)
    return z.exp()


def mhc_coefficients(
    H: torch.Tensor, phi: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor, iters: int = 20, eps: float = 1e-6,
    tanh: bool = False, columns_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC routing (DeepSeek arXiv 2512.24880 Eqs. 7-9), fp32 inside.

    H [..., n, d]; phi [n*d, n*n + 2n] in the order [pre | post | res]; alpha [3]; bias [n*n + 2n].
    Returns H_pre = sigmoid [..., n], H_post = 2 sigmoid [..., n], H_res = Sinkhorn [..., n, n].
    """
    n = H.shape[-2]
    x = _acc(H.flatten(-2))
    inv_r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return mhc_gates((x @ _acc(phi)) * inv_r, _acc(alpha), _acc(bias), n, iters, tanh, columns_first)


def mhc_gates(proj: torch.Tensor, a: torch.Tensor, b: torch.Tensor, n: int, iters: int, tanh: bool,
              columns_first: bool, sinkhorn=sinkhorn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(H_pre, H_post, H_res) from the normalized projection ``proj`` [..., n^2 + 2n] = (x phi) / r, the gates
    ``a`` [3] and biases ``b`` (shared by the reference and the kernel path, which passes its own ``sinkhorn``)."""
    if tanh:  # DepthBench's torch backend: gate * tanh(projection) + bias
        proj = torch.tanh(proj)
    pre = torch.sigmoid(a[0] * proj[..., :n] + b[:n])
    post = 2.0 * torch.sigmoid(a[1] * proj[..., n : 2 * n] + b[n : 2 * n])
    res_logits = (a[2] * proj[..., 2 * n :] + b[2 * n :]).unflatten(-1, (n, n))
    if columns_first:  # Sinkhorn starting with the column step: the row-first one of the transpose, transposed
        return pre, post, sinkhorn(res_logits.transpose(-1, -2), iters).transpose(-1, -2)
    return pre, post, sinkhorn(res_logits, iters)


def mhc_width(H: torch.Tensor, pre: torch.Tensor, res: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x = sum_s pre_s H_s and mixed_t = sum_s res[t, s] H_s (H_res applied from the left). Returns (x, mixed)."""
    full = mix_streams(torch.cat((pre.unsqueeze(-2), res), dim=-2), H)  # [pre; res] @ H, as hc_width
    return full[..., 0, :].contiguous(), full[..., 1:, :]


def mhc_depth(mixed: torch.Tensor, post: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """H'_t = mixed_t + post_t * y."""
    return write_streams(mixed, post, y)


# --------------------------------------------------------------------------- AttnRes
def depth_softmax(
    query: torch.Tensor, key_weight: torch.Tensor | None, sources: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over depth: p_s = softmax_s(<query, key_weight * N̄(v_s)>), out = sum_s p_s v_s.

    query, key_weight: [d]; sources: [S, ..., d] (embedding and earlier sublayer outputs / block sums).
    Keys are RMS-normalized, values are not; no 1/sqrt(d). Returns (out [..., d], weights [..., S]) with the
    softmax in fp32.
    """
    acc = _acc_dtype(sources.dtype)
    keys = rms_norm(sources, key_weight, eps)
    logits = (keys.to(acc) * query.to(acc)).sum(-1)
    p = torch.softmax(logits, dim=0)
    out = (p.unsqueeze(-1) * sources.to(acc)).sum(0).to(sources.dtype)
    return out, p.movedim(0, -1)


# --------------------------------------------------------------------------- MoDA
def moda_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    depth_key: torch.Tensor | None,
    depth_value: torch.Tensor | None,
    mask: torch.Tensor | None,
    scaling: float,
    depth_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mixture-of-Depths attention: ONE softmax over [causal sequence keys | same-token depth keys].

    query [B, H, T, hd]; key, value [B, Hkv, Tk, hd] (the sequence, cache included, queries are its last T);
    depth_key, depth_value [D, B, Hkv, T, hd] or None: the keys/values that D earlier sublayers wrote for the
    *same* token; mask: None (plain causal), bool [B, 1, T, Tk] (True = attend) or additive float;
    depth_mask: optional bool [D] (True = attend). Softmax in fp32 (float64 kept). Returns [B, T, H, hd].
    """
    with torch.autocast(query.device.type, enabled=False):  # the fp32 math must stay fp32 under autocast
        return _moda_attention(query, key, value, depth_key, depth_value, mask, scaling, depth_mask)


def _masked_scores(q, k, mask, scaling, low):
    """``q k^T * scaling`` with the attention mask applied (``None``: causal; bool: False -> ``low``; float:
    added). Returns (scores, the bool mask, or None for an additive one)."""
    scores = (q @ k.transpose(-1, -2)) * scaling
    t, tk = scores.shape[-2:]
    if mask is None:
        mask = torch.ones(t, tk, dtype=torch.bool, device=scores.device).tril(tk - t)
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, low), mask
    return scores + mask.to(q.dtype), None


def _moda_attention(query, key, value, depth_key, depth_value, mask, scaling, depth_mask):
    acc = _acc_dtype(query.dtype)
    n_rep = query.shape[1] // key.shape[1]
    low = torch.finfo(acc).min
    q = query.to(acc)
    scores, _ = _masked_scores(q, key.repeat_interleave(n_rep, dim=1).to(acc), mask, scaling, low)  # [B, H, T, Tk]
    tk = scores.shape[-1]
    if depth_key is None or depth_key.shape[0] == 0:
        p = torch.softmax(scores, dim=-1)
        out = p @ value.repeat_interleave(n_rep, dim=1).to(acc)
        return out.transpose(1, 2).to(query.dtype)
    dk = depth_key.repeat_interleave(n_rep, dim=2).to(acc)  # [D, B, H, T, hd]
    depth_scores = ((q.unsqueeze(0) * dk).sum(-1) * scaling).movedim(0, -1)  # [B, H, T, D]
    if depth_mask is not None:
        depth_scores = depth_scores.masked_fill(~depth_mask.to(torch.bool), low)
    p = torch.softmax(torch.cat((scores, depth_scores), dim=-1), dim=-1)
    p_seq, p_depth = p[..., :tk], p[..., tk:]
    out = p_seq @ value.repeat_interleave(n_rep, dim=1).to(acc)
    dv = depth_value.repeat_interleave(n_rep, dim=2).to(acc)
    out = out + (p_depth.movedim(-1, 0).unsqueeze(-1) * dv).sum(0)
    return out.transpose(1, 2).to(query.dtype)


#: every reference above, by name (``dispatch.py`` looks ops up here)
REFERENCES = {
    k: v
    for k, v in dict(globals()).items()
    if callable(v) and getattr(v, "__module__", None) == __name__ and not k.startswith("_")
}
