"""An independent re-implementation of DepthBench's forward pass, for the converter's exactness tests.

Written from DepthBench's own source (``keyu-wang-2002/DepthBench``, its vendored OLMo-core under
``pretrain/OLMo-core/src/olmo_core``), read with the search tools; nothing here imports hf_depth, so a converted
model is compared with DepthBench's function, not with a second copy of our own. Sources, by part:

* blocks: ``nn/transformer/block.py`` @ 6bdf2ad92d06a935b90244e3a6fac94ff0cee10d (``TransformerBlock``,
  ``LayerNormScaledTransformerBlock``, ``PeriNormTransformerBlock``, ``DeepNormTransformerBlock``,
  ``KeelTransformerBlock``, ``AttnResTransformerBlock``, ``MoDATransformerBlock``,
  ``HyperConnectionsTransformerBlock``);
* model: ``nn/transformer/model.py`` @ 5152cab0e999b293c13c8087aa7e893bbe6a0768 (stream expand / reduce,
  the final AttnRes aggregation, ``skip_norm``);
* HC / mHC: ``nn/hyper_connections.py`` @ 8cc2fd74cf048ac79600f5c9b4c472c404ce7878 (HC with
  ``H' = A_r^T H + beta y``) and @ 5152cab0e999b293c13c8087aa7e893bbe6a0768 (the earlier HC, ``H' = H + beta y``);
  the ``liger_mhc`` backend calls Liger's kernels: ``linkedin/Liger-Kernel`` ``src/liger_kernel/triton/mhc.py``
  @ bb372857d49c193ec182a2bf81853c4daa343cd3 (``mhc_mm_norm_fwd``, ``_mhc_split_sinkhorn_fwd_kernel``) and
  ``liger_mhc_post_res`` (``x_out[o] = sum_i h_res[o, i] x[i] + h_post[o] f``);
* AttnRes: ``kernels/attnres.py`` @ aba1f65206d65db12d5a86df6b9f6f88fdb657c3 (``fused_attnres``: logits
  ``<v_l, q * w> * rsqrt(mean(v_l^2) + eps)``, softmax over sources, then the output RMSNorm with the *same* eps);
* MoDA: ``nn/moda.py`` @ 100da5f4579a1cd136d7e08f08a6b8d2c924b74b (``MoDAAttention``: depth keys cached from
  ``raw_k``, i.e. before RoPE; ``MoDAFeedForwardDepthCache``: ``kv_proj`` rows [k | v], never rotated; one
  softmax over the causal sequence keys and the token's own depth slots ``< current_depth = 2 i``);
* RoPE: OLMo-core ``RotaryEmbedding`` (``allenai/OLMo-core`` ``src/olmo_core/nn/rope.py``
  @ 02f432f63216c755451143e0413ec0abcac034b2): rotate-half, ``inv_freq = theta^(-2j / hd)`` (default theta
  500000), fp32.

OLMo-core's ``RMSNorm``/``LayerNorm`` compute ``x * rsqrt(mean(x^2) + eps) * w`` / ``F.layer_norm``; the
aggregation norms of AttnRes are built without an eps (``LayerNormConfig(name=rms, bias=False)``), so OLMo-core's
default 1e-5 applies there (``cfg.attnres_eps``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class DBConfig:
    block: str = "default"  # TransformerBlockType name
    vocab: int = 97
    d: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 4
    ffn: int = 96
    rope_theta: float = 500_000.0
    eps: float = 1e-6  # block / lm_head norm eps
    layer_norm: str = "rms"  # "rms" or "layer" (DeepNorm's launcher: block LayerNorms, final RMSNorm)
    final_norm: str = "rms"
    hc_kind: str = "hc"  # hc | mhc | mhc_static | liger_mhc
    hc_stream_mixing: bool = True  # False: the earlier hyper_connections.py (H' = H + beta y)
    streams: int = 4
    reduce: str = "sum"  # HyperConnectionStreamReduce mode
    sinkhorn_iters: int = 20
    sinkhorn_tau: float = 1.0
    liger_rms_eps: float = 1e-6
    liger_sinkhorn_eps: float = 1e-6
    attnres_block_size: int = 1
    attnres_eps: float = 1e-5  # OLMo-core LayerNormConfig default eps

    @property
    def head_dim(self) -> int:
        return self.d // self.n_heads


# ----------------------------------------------------------------------------------------------- state dicts
def init_state_dict(cfg: DBConfig, seed: int = 0, dtype=torch.float32) -> dict:
    """A DepthBench state dict with DepthBench's names and shapes, its init values moved by random perturbations
    (so that a wrong mapping or a wrong forward changes the logits)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=0.1):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * std).to(dtype)

    def norm(prefix, sd, bias=None):
        sd[f"{prefix}.weight"] = 1 + rnd(cfg.d)
        if (cfg.layer_norm == "layer") if bias is None else bias:
            sd[f"{prefix}.bias"] = rnd(cfg.d)

    d, hd, L, n = cfg.d, cfg.head_dim, cfg.n_layers, cfg.streams
    sd = {"embeddings.weight": rnd(cfg.vocab, d, std=1.0)}
    moda = cfg.block == "moda"
    for i in range(L):
        b = f"blocks.{i}."
        att = b + ("attention.attention." if moda else "attention.")
        ff = b + ("feed_forward.feed_forward." if moda else "feed_forward.")
        sd[att + "w_q.weight"] = rnd(cfg.n_heads * hd, d, std=d**-0.5)
        sd[att + "w_k.weight"] = rnd(cfg.n_kv_heads * hd, d, std=d**-0.5)
        sd[att + "w_v.weight"] = rnd(cfg.n_kv_heads * hd, d, std=d**-0.5)
        sd[att + "w_out.weight"] = rnd(d, cfg.n_heads * hd, std=d**-0.5)
        sd[ff + "w1.weight"] = rnd(cfg.ffn, d, std=d**-0.5)
        sd[ff + "w3.weight"] = rnd(cfg.ffn, d, std=d**-0.5)
        sd[ff + "w2.weight"] = rnd(d, cfg.ffn, std=cfg.ffn**-0.5)
        norm(b + "attention_norm", sd)
        norm(b + "feed_forward_norm", sd)
        if cfg.block == "peri_norm" or (cfg.block == "keel" and i > 0):
            norm(b + "post_attention_norm", sd)
        if cfg.block in ("peri_norm", "keel"):
            norm(b + "post_feed_forward_norm", sd)
        if moda and i < L - 1:  # the last block's FFN has no kv_proj (skip_ffn_kv)
            sd[b + "feed_forward.kv_proj.weight"] = rnd(2 * cfg.n_kv_heads * hd, d, std=d**-0.5)
        if cfg.block == "attnres":
            if i > 0:
                sd[b + "attn_res_proj.weight"] = rnd(1, d, std=0.5)
                norm(b + "attn_res_norm", sd, bias=False)
            sd[b + "mlp_res_proj.weight"] = rnd(1, d, std=0.5)
            norm(b + "mlp_res_norm", sd, bias=False)
        if cfg.block in ("hc", "mhc"):
            for s, sub in enumerate(("attention", "feed_forward")):
                p = f"{b}{sub}_hyper_connection."
                sel = (2 * i + s) % n
                if cfg.hc_kind == "hc":
                    a = torch.zeros(n, n + 1, dtype=dtype)
                    a[sel, 0] = 1.0
                    a[:, 1:] = torch.eye(n, dtype=dtype)
                    sd[p + "static_alpha"] = a + rnd(n, n + 1, std=0.3)
                    sd[p + "dynamic_alpha_proj"] = rnd(d, n + 1, std=0.3)
                    sd[p + "dynamic_alpha_scale"] = 0.01 + rnd((), std=0.2).abs()
                    sd[p + "static_beta"] = 1 + rnd(n, std=0.3)
                    sd[p + "dynamic_beta_proj"] = rnd(d, std=0.3)
                    sd[p + "dynamic_beta_scale"] = 0.01 + rnd((), std=0.2).abs()
                elif cfg.hc_kind == "mhc":
                    pre = torch.full((n,), -8.0, dtype=dtype)
                    pre[sel] = 8.0
                    res = torch.full((n, n), -8.0, dtype=dtype)
                    res.fill_diagonal_(8.0)
                    sd[p + "pre_bias"] = pre + rnd(n, std=1.0)
                    sd[p + "post_bias"] = rnd(n, std=1.0)
                    sd[p + "residual_bias"] = res / 4 + rnd(n, n, std=1.0)  # moderate: Sinkhorn converged
                    sd[p + "pre_dynamic_proj"] = rnd(n * d, n, std=0.3)
                    sd[p + "post_dynamic_proj"] = rnd(n * d, n, std=0.3)
                    sd[p + "residual_dynamic_proj"] = rnd(n * d, n * n, std=0.3)
                    for gname in ("pre_gate", "post_gate", "residual_gate"):
                        sd[p + gname] = 0.01 + rnd((), std=0.3).abs()
                elif cfg.hc_kind == "mhc_static":
                    res = torch.full((n, n), -8.0, dtype=dtype)
                    res.fill_diagonal_(0.0)
                    pre = torch.full((n,), -8.0, dtype=dtype)
                    pre[sel] = 0.0
                    sd[p + "H_res_logits"] = res / 4 + rnd(n, n, std=1.0)
                    sd[p + "H_pre_logits"] = pre / 4 + rnd(n, std=1.0)
                    sd[p + "H_post_logits"] = rnd(n, std=1.0)
                elif cfg.hc_kind == "liger_mhc":
                    m = n * n + 2 * n
                    sd[p + "phi"] = rnd(n * d, m, std=0.3)
                    sd[p + "b"] = rnd(m, std=1.0)
                    for gname in ("alpha_pre", "alpha_post", "alpha_res"):
                        sd[p + gname] = 0.01 + rnd((), std=0.3).abs()
                else:
                    raise ValueError(f"unknown hc_kind {cfg.hc_kind!r}")
    if cfg.block == "attnres":
        sd["res_proj.weight"] = rnd(1, d, std=0.5)
        norm("res_norm", sd, bias=False)
    norm("lm_head.norm", sd, bias=cfg.final_norm == "layer")
    sd["lm_head.w_out.weight"] = rnd(cfg.vocab, d, std=d**-0.5)
    return sd


def with_hc_branch_aliases(sd: dict) -> dict:
    """What ``state_dict()`` of an OLMo-core HC/mHC model holds: the branch modules registered twice
    (``*_hyper_connection.branch.{norm, attention | feed_forward}`` = the block's own modules)."""
    out = dict(sd)
    for k, v in sd.items():
        parts = k.split(".")
        if len(parts) > 3 and parts[0] == "blocks" and parts[2] in (
            "attention", "attention_norm", "feed_forward", "feed_forward_norm"
        ):  # fmt: skip
            sub = "attention" if parts[2].startswith("attention") else "feed_forward"
            mod = "norm" if parts[2].endswith("_norm") else parts[2]
            out[f"blocks.{parts[1]}.{sub}_hyper_connection.branch.{mod}.{'.'.join(parts[3:])}"] = v
    return out


# ----------------------------------------------------------------------------------------------- pieces
def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 if w is None else w)


def _norm(sd, prefix, x, cfg, kind=None):
    kind = kind or cfg.layer_norm
    if kind == "layer":
        return F.layer_norm(x, (x.shape[-1],), sd[f"{prefix}.weight"], sd.get(f"{prefix}.bias"), cfg.eps)
    return _rms(x, sd[f"{prefix}.weight"], cfg.eps)


def _rope(x, theta):
    """OLMo-core RotaryEmbedding on [B, T, H, hd]: x cos + rotate_half(x) sin at positions 0..T-1."""
    T, hd = x.shape[1], x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))  # OLMo-core: fp32 tables
    freqs = torch.einsum("i,j->ij", torch.arange(T, dtype=torch.float), inv)
    ang = torch.cat([freqs, freqs], dim=-1)[None, :, None, :]
    sin, cos = ang.sin().to(x.dtype), ang.cos().to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _project(sd, prefix, x, cfg):
    B, T, _ = x.shape
    hd = cfg.head_dim
    q = (x @ sd[f"{prefix}.w_q.weight"].T).view(B, T, cfg.n_heads, hd)
    k = (x @ sd[f"{prefix}.w_k.weight"].T).view(B, T, cfg.n_kv_heads, hd)
    v = (x @ sd[f"{prefix}.w_v.weight"].T).view(B, T, cfg.n_kv_heads, hd)
    return q, k, v


def _attend(q, k, v, cfg, depth_k=None, depth_v=None):
    """Causal softmax attention (GQA: query head h reads kv head h // group); with depth K/V [B, T, S, Hkv, hd]
    one softmax over [sequence keys j <= t | the token's own depth slots] (MoDA)."""
    B, T, Hq, hd = q.shape
    group = Hq // cfg.n_kv_heads
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scale = 1.0 / math.sqrt(hd)
    seq = torch.einsum("bthd,bshd->bhts", q, k) * scale
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    seq = seq.masked_fill(~causal, float("-inf"))
    if depth_k is None:
        p = torch.softmax(seq, dim=-1)
        return torch.einsum("bhts,bshd->bthd", p, v)
    dk, dv = depth_k.repeat_interleave(group, dim=3), depth_v.repeat_interleave(group, dim=3)
    dep = torch.einsum("bthd,btshd->bhts", q, dk) * scale  # [B, H, T, S]
    p = torch.softmax(torch.cat([seq, dep], dim=-1), dim=-1)
    out = torch.einsum("bhts,bshd->bthd", p[..., :T], v)
    return out + torch.einsum("bhts,btshd->bthd", p[..., T:], dv)


def _attention(sd, prefix, x, cfg):
    q, k, v = _project(sd, prefix, x, cfg)
    out = _attend(_rope(q, cfg.rope_theta), _rope(k, cfg.rope_theta), v, cfg)
    return out.reshape(*x.shape[:-1], -1) @ sd[f"{prefix}.w_out.weight"].T


def _ffn(sd, prefix, x):
    return (F.silu(x @ sd[f"{prefix}.w1.weight"].T) * (x @ sd[f"{prefix}.w3.weight"].T)) @ sd[f"{prefix}.w2.weight"].T


def _sinkhorn_log(z, iters, tau=1.0):
    """``sinkhorn_log`` of hyper_connections.py: log potentials u (rows), v (columns), marginals 1/n, times n."""
    n = z.shape[-1]
    z = z / tau
    u = torch.zeros(z.shape[:-1], dtype=z.dtype)
    v = torch.zeros(z.shape[:-2] + z.shape[-1:], dtype=z.dtype)
    for _ in range(iters):
        u = -math.log(n) - torch.logsumexp(z + v.unsqueeze(-2), dim=-1)
        v = -math.log(n) - torch.logsumexp(z + u.unsqueeze(-1), dim=-2)
    return torch.exp(z + u.unsqueeze(-1) + v.unsqueeze(-2)) * n


def _liger_sinkhorn(logits, iters, eps):
    """Liger's ``_mhc_split_sinkhorn_fwd_kernel``: row softmax + eps, column step, then iters - 1 row/column steps,
    each dividing by (sum + eps)."""
    mat = torch.softmax(logits, dim=-1) + eps
    mat = mat / (mat.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        mat = mat / (mat.sum(-1, keepdim=True) + eps)
        mat = mat / (mat.sum(-2, keepdim=True) + eps)
    return mat


def _hyper_connection(sd, p, H, branch, cfg):
    """One HC / mHC sublayer on streams H [B, T, n, d]; ``branch`` maps [B, T, d] -> [B, T, d]."""
    n = cfg.streams
    if cfg.hc_kind == "hc":
        normed = _rms(H, None, 1e-8)
        alpha = sd[p + "dynamic_alpha_scale"] * torch.tanh(normed @ sd[p + "dynamic_alpha_proj"]) + sd[p + "static_alpha"]
        mixed = torch.einsum("...st,...sd->...td", alpha, H)
        y = branch(mixed[..., 0, :])
        beta = sd[p + "static_beta"] + sd[p + "dynamic_beta_scale"] * torch.tanh(normed @ sd[p + "dynamic_beta_proj"])
        written = y.unsqueeze(-2) * beta.unsqueeze(-1)
        return (mixed[..., 1:, :] if cfg.hc_stream_mixing else H) + written
    flat = H.flatten(-2)
    if cfg.hc_kind == "mhc":
        normed = _rms(flat, None, 1e-8)
        pre = torch.sigmoid(sd[p + "pre_gate"] * torch.tanh(normed @ sd[p + "pre_dynamic_proj"]) + sd[p + "pre_bias"])
        post = 2 * torch.sigmoid(sd[p + "post_gate"] * torch.tanh(normed @ sd[p + "post_dynamic_proj"])
                                 + sd[p + "post_bias"])
        res = (sd[p + "residual_gate"] * torch.tanh(normed @ sd[p + "residual_dynamic_proj"])).unflatten(-1, (n, n))
        h_res = _sinkhorn_log(res + sd[p + "residual_bias"], cfg.sinkhorn_iters, cfg.sinkhorn_tau)
        mixed = torch.einsum("...st,...sd->...td", h_res, H)  # DepthBench torch: mixed_t = sum_s R[s, t] H_s
    elif cfg.hc_kind == "mhc_static":
        h_res = _sinkhorn_log(sd[p + "H_res_logits"], cfg.sinkhorn_iters, cfg.sinkhorn_tau)
        pre = torch.softmax(sd[p + "H_pre_logits"], -1)
        post = torch.softmax(sd[p + "H_post_logits"], -1)
        mixed = torch.einsum("st,...sd->...td", h_res, H)
    else:  # liger_mhc: mix = (x @ phi) * rsqrt(mean(x^2) + eps) over the flattened streams, no tanh
        mix = (flat @ sd[p + "phi"]) * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + cfg.liger_rms_eps)
        b = sd[p + "b"]
        pre = torch.sigmoid(mix[..., :n] * sd[p + "alpha_pre"] + b[:n])  # pre_eps = 0
        post = 2 * torch.sigmoid(mix[..., n : 2 * n] * sd[p + "alpha_post"] + b[n : 2 * n])
        logits = (mix[..., 2 * n :] * sd[p + "alpha_res"] + b[2 * n :]).unflatten(-1, (n, n))
        h_res = _liger_sinkhorn(logits, cfg.sinkhorn_iters, cfg.liger_sinkhorn_eps)
        mixed = torch.einsum("...oi,...id->...od", h_res, H)  # liger_mhc_post_res: x_out[o] = sum_i R[o, i] x[i]
    y = branch(torch.einsum("...s,...sd->...d", pre, H))
    return mixed + y.unsqueeze(-2) * post.unsqueeze(-1)


def _attnres(query, residuals, key_w, out_w, eps):
    """``fused_attnres``: p = softmax_l(<v_l, q * w> rsqrt(mean(v_l^2) + eps)), o = RMSNorm_eps(sum_l p_l v_l) * ow."""
    V = torch.stack(residuals)  # [S, B, T, d]
    logits = (V @ (query.reshape(-1) * key_w)) * torch.rsqrt(V.pow(2).mean(-1) + eps)
    o = (torch.softmax(logits, dim=0).unsqueeze(-1) * V).sum(0)
    return o if out_w is None else _rms(o, out_w, eps)


# ----------------------------------------------------------------------------------------------- forward
@torch.no_grad()
def forward(sd: dict, cfg: DBConfig, ids: torch.Tensor) -> torch.Tensor:
    """DepthBench ``Transformer.forward(ids)`` logits for a DepthBench state dict (no dropout, no doc masks)."""
    L, blk = cfg.n_layers, cfg.block
    h = sd["embeddings.weight"][ids]
    if blk in ("hc", "mhc"):
        h = h.unsqueeze(-2).expand(*h.shape[:-1], cfg.streams, h.shape[-1])  # HyperConnectionStreamExpand
    states = None  # AttnRes sources
    depth_k, depth_v = [], []  # MoDA depth slots, in slot order
    for i in range(L):
        b = f"blocks.{i}."

        def attn(x, b=b):
            return _attention(sd, b + "attention", x, cfg)

        def ffn(x, b=b):
            return _ffn(sd, b + "feed_forward", x)

        def nrm(name, x, b=b):
            return _norm(sd, b + name, x, cfg)

        if blk == "default":
            h = h + attn(nrm("attention_norm", h))
            h = h + ffn(nrm("feed_forward_norm", h))
        elif blk == "default_scaled":  # LNS: norm outputs times 1/sqrt(block_idx + 1)
            s = 1.0 / math.sqrt(i + 1)
            h = h + attn(nrm("attention_norm", h) * s)
            h = h + ffn(nrm("feed_forward_norm", h) * s)
        elif blk == "peri_norm":
            h = h + nrm("post_attention_norm", attn(nrm("attention_norm", h)))
            h = h + nrm("post_feed_forward_norm", ffn(nrm("feed_forward_norm", h)))
        elif blk == "deepnorm":  # LN(alpha x + F(x)), alpha = (2 L)^(1/4), the input norms re-used post-add
            a = (2 * L) ** 0.25
            h = nrm("attention_norm", a * h + attn(h))
            h = nrm("feed_forward_norm", a * h + ffn(h))
        elif blk == "keel":  # alpha = 2 L; block 0: plain Pre-LN attention, Post-LN FFN without alpha
            a = float(2 * L)
            out = attn(nrm("attention_norm", h))
            h = h + out if i == 0 else nrm("post_attention_norm", a * h + out)
            out = ffn(nrm("feed_forward_norm", h))
            h = nrm("post_feed_forward_norm", (h if i == 0 else a * h) + out)
        elif blk in ("hc", "mhc"):
            h = _hyper_connection(sd, b + "attention_hyper_connection.", h,
                                  lambda x: attn(nrm("attention_norm", x)), cfg)
            h = _hyper_connection(sd, b + "feed_forward_hyper_connection.", h,
                                  lambda x: ffn(nrm("feed_forward_norm", x)), cfg)
        elif blk == "attnres":
            S, eps = cfg.attnres_block_size, cfg.attnres_eps
            prefix = h
            if states is None:
                x = nrm("attention_norm", prefix)
                states, prefix = [prefix], None
            else:
                residuals = [*states, prefix]
                if (2 * i) % S == 0:
                    states, prefix = residuals, None
                x = _attnres(sd[b + "attn_res_proj.weight"], residuals, sd[b + "attn_res_norm.weight"],
                             sd[b + "attention_norm.weight"], eps)
            out = attn(x)
            prefix = out if prefix is None else prefix + out
            residuals = [*states, prefix]
            if (2 * i + 1) % S == 0:
                states, prefix = residuals, None
            x = _attnres(sd[b + "mlp_res_proj.weight"], residuals, sd[b + "mlp_res_norm.weight"],
                         sd[b + "feed_forward_norm.weight"], eps)
            out = ffn(x)
            h = out if prefix is None else prefix + out
        elif blk == "moda":
            x = nrm("attention_norm", h)
            q, k, v = _project(sd, b + "attention.attention", x, cfg)
            raw_k = k
            q, k = _rope(q, cfg.rope_theta), _rope(k, cfg.rope_theta)
            if i == 0:
                att = _attend(q, k, v, cfg)
            else:  # depth slots 0 .. 2i - 1 (every earlier attention and FFN), keys never rotated
                att = _attend(q, k, v, cfg, torch.stack(depth_k, 2), torch.stack(depth_v, 2))
            h = h + att.reshape(*x.shape[:-1], -1) @ sd[b + "attention.attention.w_out.weight"].T
            depth_k.append(raw_k)
            depth_v.append(v)
            x = nrm("feed_forward_norm", h)
            kv = sd.get(b + "feed_forward.kv_proj.weight")
            if kv is not None:
                B, T, _ = x.shape
                k2, v2 = (x @ kv.T).view(B, T, 2, cfg.n_kv_heads, cfg.head_dim).unbind(2)
                depth_k.append(k2)
                depth_v.append(v2)
            h = h + _ffn(sd, b + "feed_forward.feed_forward", x)
        else:
            raise ValueError(f"unknown block type {blk!r}")
    if blk == "attnres":  # final aggregation fused with lm_head.norm (skip_norm)
        h = _attnres(sd["res_proj.weight"], [*states, h], sd["res_norm.weight"], sd["lm_head.norm.weight"],
                     cfg.attnres_eps)
    elif blk in ("hc", "mhc"):
        if cfg.reduce == "mean":
            h = _norm(sd, "lm_head.norm", h.mean(-2), cfg, cfg.final_norm)
        else:
            h = _norm(sd, "lm_head.norm", h, cfg, cfg.final_norm).sum(-2)
    else:
        h = _norm(sd, "lm_head.norm", h, cfg, cfg.final_norm)
    return h @ sd["lm_head.w_out.weight"].T
