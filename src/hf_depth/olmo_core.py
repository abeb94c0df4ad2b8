"""DepthBench / OLMo-core checkpoints <-> hf_depth.

DepthBench (``keyu-wang-2002/DepthBench``, a vendored OLMo-core) trains every design as an OLMo-core
``Transformer``. OLMo-core's own HF converter (``olmo_core/nn/hf/convert.py``) maps only the Llama keys, so it
silently drops the post norms of Peri-LN / KEEL, the HC / mHC routing, the AttnRes queries and the MoDA FFN
K/V projection. This module maps *every* parameter of every DepthBench block type, one table per design, and
refuses (``ValueError`` naming the keys) a checkpoint with a key it does not map or without a key it needs.

Python API::

    model = olmo_core_to_hf_depth(state_dict, "default", num_attention_heads=16)   # -> PreLNForCausalLM
    state_dict = hf_depth_to_olmo_core(model)                                      # the inverse
    hf-depth convert-olmo-core SRC OUT --design default [--config config.json] [--set key=value ...]

Names (``i`` = block index, ``s`` in ``attention`` / ``feed_forward`` for the two sublayers; ``c`` =
``attn_connection`` / ``mlp_connection``; all OLMo-core linears are ``nn.Linear``, so no transposes unless
stated). Shared by every design:

==========================================  ===============================================  =====================
DepthBench (OLMo-core)                      hf_depth                                         layout
==========================================  ===============================================  =====================
``embeddings.weight``                       ``model.embed_tokens.weight``                    same
``lm_head.w_out.weight``                    ``lm_head.weight``                               same (untied)
``lm_head.norm.weight`` (``.bias`` for LN)  ``model.norm.weight`` (``.bias``)                same
``blocks.i.attention.w_q.weight``           ``model.layers.i.self_attn.q_proj.weight``       same (RoPE halves,
``blocks.i.attention.w_k.weight``           ``model.layers.i.self_attn.k_proj.weight``       as HF Llama: no
``blocks.i.attention.w_v.weight``           ``model.layers.i.self_attn.v_proj.weight``       permutation)
``blocks.i.attention.w_qkv.weight``         q_proj / k_proj / v_proj                         FusedAttention: rows
                                                                                             [q | k | v], split
``blocks.i.attention.w_out.weight``         ``model.layers.i.self_attn.o_proj.weight``       same
``blocks.i.attention.w_*.bias``             ``..._proj.bias`` (only with attention_bias)     same
``blocks.i.feed_forward.w1.weight``         ``model.layers.i.mlp.gate_proj.weight``          same
``blocks.i.feed_forward.w3.weight``         ``model.layers.i.mlp.up_proj.weight``            same
``blocks.i.feed_forward.w2.weight``         ``model.layers.i.mlp.down_proj.weight``          same
==========================================  ===============================================  =====================

Per design (DepthBench block type -> hf_depth design):

* ``default`` -> ``pre_ln``; ``default_scaled`` (LNS) -> ``lns``: ``blocks.i.attention_norm`` ->
  ``input_layernorm``, ``blocks.i.feed_forward_norm`` -> ``post_attention_layernorm``. LNS's 1/sqrt(i+1) is a
  constant in hf_depth; older DepthBench saves it as a buffer ``blocks.i.ln_scale``: its value is checked
  (refused if it is not 1/sqrt(i+1)) and it is not stored.
* ``peri_norm`` -> ``sandwich_ln``: as ``default`` plus ``blocks.i.post_attention_norm`` ->
  ``layers.i.attn_connection.output_norm``, ``blocks.i.post_feed_forward_norm`` ->
  ``layers.i.mlp_connection.output_norm``.
* ``deepnorm`` -> ``deepnorm``: DepthBench's DeepNorm block re-uses the input-norm modules as the post-add
  norms (``LN(alpha x + F(x))``): ``blocks.i.attention_norm.{weight,bias}`` -> ``layers.i.attn_connection.norm``,
  ``blocks.i.feed_forward_norm.{weight,bias}`` -> ``layers.i.mlp_connection.norm`` (LayerNorm; a block LayerNorm
  saved without bias gets a zero bias, the same function; pass ``deepnorm_norm_bias=False`` for DepthBench's
  bias-free LayerNorm exactly). ``examples/pretrain_deepnorm.py`` switches only the
  *block* norms to LayerNorm, so ``lm_head.norm`` is an RMSNorm (weight only): the config gets
  ``deepnorm_final_norm="rms"``; with ``lm_head.norm.bias`` present it stays a LayerNorm.
* ``keel`` -> ``keel``: as ``default`` plus ``blocks.i.post_attention_norm`` (i > 0; block 0 has none, as in
  hf_depth) -> ``layers.i.attn_connection.post_norm``, ``blocks.i.post_feed_forward_norm`` ->
  ``layers.i.mlp_connection.post_norm``.
* ``hc`` -> ``hc`` (``blocks.i.{s}_hyper_connection.*``, per sublayer; n = streams):
  ``static_alpha`` [n, n+1] -> ``c.static_alpha``; ``dynamic_alpha_proj`` [d, n+1] -> ``c.dynamic_alpha``
  (same [d, n+1] matmul layout, no transpose); ``dynamic_alpha_scale`` [] -> ``c.alpha_scale``;
  ``static_beta`` [n] -> ``c.static_beta``; ``dynamic_beta_proj`` [d] -> ``c.dynamic_beta``;
  ``dynamic_beta_scale`` [] -> ``c.beta_scale``. Column 0 of alpha is the branch-input mix, columns 1..n the
  stream mix (``mixed_t = sum_s A[s, t+1] H_s``), both sides. Stream order: DepthBench folds streams into the
  batch as ``(B*n, T, d)`` with the stream index inner to the batch index (``reshape(B, n, T, d)``); hf_depth
  keeps ``[B, T, n, d]`` with the same stream index, so no reordering.
  The branch is registered inside the HC module too, so an OLMo-core state dict holds each branch weight
  twice: ``blocks.i.attention_hyper_connection.branch.{norm,attention}.*`` and
  ``blocks.i.feed_forward_hyper_connection.branch.{norm,feed_forward}.*`` are aliases of
  ``blocks.i.attention_norm`` / ``attention`` / ``feed_forward_norm`` / ``feed_forward``: they are checked equal
  to the canonical key (refused otherwise) and written back on export (``hc_branch_aliases=True``).
  Config: ``hc_streams`` from ``static_alpha``; ``hc_final_reduce="sum_of_normed"`` (DepthBench ``sum``).
* ``mhc`` -> ``mhc``. hf_depth keeps one projection ``c.dynamic_phi`` [n*d, 2n + n^2] in the order
  [pre | post | res] (flattened streams stream-major: index ``s*d + j``; res row-major), gates ``c.alpha_scale``
  [3] = (pre, post, res) and biases ``c.static_bias`` [2n + n^2] (same order), with H_res applied from the left
  (``mixed_t = sum_s R[t, s] H_s``).

  - backend ``liger_mhc`` (the 400M launcher): ``phi`` [n*d, 2n+n^2] -> ``c.dynamic_phi`` (same layout: Liger
    splits [pre | post | res] and applies H_res from the left; bf16 in DepthBench, cast to the model dtype);
    ``b`` -> ``c.static_bias``; ``alpha_pre, alpha_post, alpha_res`` (scalars) -> ``c.alpha_scale`` (stacked).
    Config: ``mhc_final_reduce="mean_then_norm"``, ``mhc_norm_eps=1e-6`` unless given.
  - backend ``mhc`` (pure torch): ``pre_dynamic_proj`` [n*d, n], ``post_dynamic_proj`` [n*d, n],
    ``residual_dynamic_proj`` [n*d, n^2] -> ``c.dynamic_phi`` (concatenated; the res columns are
    **transposed** (s, t) -> (t, s) because DepthBench applies H_res as ``mixed_t = sum_s R[s, t] H_s``);
    ``pre_bias`` [n], ``post_bias`` [n], ``residual_bias`` [n, n] (transposed, flattened) -> ``c.static_bias``;
    ``pre_gate, post_gate, residual_gate`` -> ``c.alpha_scale``. Config: ``mhc_final_reduce="sum_of_normed"``,
    ``mhc_norm_eps=1e-8`` (DepthBench's unweighted RMS) unless given.
  - backend ``mhc_static`` (input independent): ``H_pre_logits`` [n], ``H_post_logits`` [n], ``H_res_logits``
    [n, n] -> the same function in hf_depth's form: ``c.dynamic_phi`` = 0, ``c.static_bias`` =
    [logit(softmax(pre)), logit(softmax(post) / 2), (res / tau)^T], ``c.alpha_scale`` = 0.01 (multiplies
    phi = 0). Export back needs phi = 0 and read/write weights summing to 1 (else refused); pre/post logits come
    back shift-normalized (softmax-equal).

  Transposing H_res reverses the order of Sinkhorn's row/column steps, so the mHC ``mhc`` / ``mhc_static``
  H_res equals DepthBench's only up to DepthBench's own 20-iteration Sinkhorn residual (measured max |dR|:
  2.5e-8 at the +-8 init, 3e-7 for N(0, 1) logits, 1e-2 for N(0, 4), 9e-2 for N(0, 64)).
* ``attnres`` (``attnres_block_size`` S, in sublayers) -> ``attnres`` (S = 1, Full) or ``block_attnres``
  (S > 1, ``attnres_block_size=S``; DepthBench's boundaries (2i) % S == 0 / (2i+1) % S == 0 are hf_depth's
  s % S == 0): ``blocks.i.attn_res_proj.weight`` [1, d] (i > 0) -> ``layers.i.attn_connection.aggregate.query``
  [d] (row squeezed); ``blocks.i.attn_res_norm.weight`` -> ``layers.i.attn_connection.aggregate.key_norm.weight``;
  ``blocks.i.mlp_res_proj.weight`` [1, d] -> ``layers.i.mlp_connection.aggregate.query``;
  ``blocks.i.mlp_res_norm.weight`` -> ``layers.i.mlp_connection.aggregate.key_norm.weight``; model level
  ``res_proj.weight`` [1, d] -> ``model.stream.aggregate.query``, ``res_norm.weight`` ->
  ``model.stream.aggregate.key_norm.weight``. Logit form ``<w, g * N(v)>`` on both sides (no bias, no 1/sqrt(d)).
  Input norms as ``default`` (DepthBench passes them to the kernel as ``output_rms_weight``; the final one is
  ``lm_head.norm``).
* ``moda`` -> ``moda``: the block wraps attention and FFN, so the Llama keys gain a level:
  ``blocks.i.attention.attention.w_{q,k,v,out}`` and ``blocks.i.feed_forward.feed_forward.w{1,2,3}``;
  ``blocks.i.feed_forward.kv_proj.weight`` [2 * n_kv * hd, d] (rows [k | v]; absent in the last block) ->
  ``model.layers.i.kv_proj.weight`` (same layout).

Where DepthBench's forward differs from hf_depth's defaults, the converter sets the config fields that express
DepthBench's function (given fields win; new hf_depth models keep the defaults). Each is tested against an
independent re-implementation of DepthBench's forward written from its source (``tests/depthbench_reference.py``):

* AttnRes (``kernels/attnres.py``; norms built without an eps in ``block.py``): ``attnres_norm_eps=1e-5`` for the
  key norms and the fused output norm of every aggregation.
* MoDA (``nn/moda.py``: depth keys cached before RoPE, FFN ``kv_proj`` keys never rotated):
  ``moda_depth_rope="unrotated"``.
* HC: two stored ``hyper_connections.py`` versions, ``H' = A_r^T H + beta y`` (@ 8cc2fd7) and the earlier
  ``H' = H + beta y`` (@ 5152cab), with identical state dicts: the version is **never guessed**,
  ``hc_stream_mixing`` (True / False) must be given.
* mHC torch backends (``mhc``, ``mhc_static``): ``mhc_sinkhorn_order="columns_first"`` (hf_depth stores R^T, and
  the transpose of DepthBench's rows-first Sinkhorn is a columns-first one, so H_res is equal, 20-iteration
  residual included); ``mhc``: ``mhc_dynamic_tanh=True`` (``gate * tanh(proj) + bias``), ``mhc_norm_eps=1e-8``.
  ``liger_mhc``: Liger's Sinkhorn (exp + 1e-6 per step) vs hf_depth's log domain: the same limit,
  ~1e-5 logit differences at the tested scale.

Values that change the logits and no tensor shape tells -- ``num_attention_heads``, ``rope_theta`` (OLMo-core's
default is 500000, hf_depth's 10000), ``rms_norm_eps`` (and the HC version) -- are read from OLMo-core's
``config.json`` (``model.block.sequence_mixer.n_heads`` / ``.rope.theta``, ``model.block.layer_norm.eps``; a saved
``eps: null`` is OLMo-core's 1e-5) or given (``--set``, keyword arguments); otherwise the conversion is refused in
one line naming them. A converted model carries ``model.olmo_core_source`` (block type, backend, HC version, the
fields set), which the CLI writes into the folder's model card (``hub.write_conversion_card``).

Prefixes ``model.`` (trainer state), ``_orig_mod.`` (``torch.compile``) and ``_checkpoint_wrapped_module.``
(activation checkpointing) are stripped on load. Tokenizer settings: DepthBench's GPT-NeoX/OLMo tokenizer,
vocab 50280, eos 50279, pad 1 (``DepthConfig`` defaults; vocab_size follows the embedding rows).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .models.registry import DESIGNS, MODEL_CLASSES
from .utils import DROP, flatten_dict

#: DepthBench ``TransformerBlockType`` -> hf_depth design name
BLOCK_TYPES = {
    "default": "pre_ln",
    "peri_norm": "sandwich_ln",
    "default_scaled": "lns",
    "deepnorm": "deepnorm",
    "keel": "keel",
    "hc": "hc",
    "mhc": "mhc",
    "attnres": "attnres",
    "moda": "moda",
}
MHC_BACKENDS = ("liger_mhc", "mhc", "mhc_static")
TOKENIZER = {"vocab_size": 50280, "eos_token_id": 50279, "pad_token_id": 1}
OLMO_CORE_NORM_EPS = 1e-5  # olmo_core.nn.layer_norm: the eps of a norm built without one

_STRIP_PREFIXES = ("model.", "module.")
_STRIP_INFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.")

# hf_depth parameter names of the designs being written in parallel (one place to update them)
HC_NAMES = {  # DepthBench HyperConnection(kind="hc") -> hf_depth HC connection
    "static_alpha": "static_alpha",
    "dynamic_alpha_proj": "dynamic_alpha",
    "dynamic_alpha_scale": "alpha_scale",
    "static_beta": "static_beta",
    "dynamic_beta_proj": "dynamic_beta",
    "dynamic_beta_scale": "beta_scale",
}
MHC_NAMES = {"phi": "dynamic_phi", "alpha": "alpha_scale", "bias": "static_bias"}
ATTNRES_NAMES = {"query": "aggregate.query", "key_norm": "aggregate.key_norm", "stream": "model.stream"}
MODA_KV = "kv_proj.weight"  # on the decoder layer: model.layers.i.kv_proj.weight


# ----------------------------------------------------------------------------------------------- rules
@dataclass
class Rule:
    """``olmo`` keys <-> ``hf`` keys, with the layout change both ways (identity when ``None``)."""

    olmo: tuple[str, ...]
    hf: tuple[str, ...]
    to_hf: Callable | None = None  # list[Tensor] (olmo order) -> list[Tensor] (hf order)
    to_olmo: Callable | None = None
    optional: bool = False  # may be absent from the OLMo-core side (e.g. a LayerNorm saved without bias)
    fill: Callable | None = None  # builds the hf tensors when an optional source is absent


def _one(olmo: str, hf: str, **kw) -> Rule:
    return Rule((olmo,), (hf,), **kw)


def _linear(olmo: str, hf: str, bias: bool) -> list[Rule]:
    rules = [_one(f"{olmo}.weight", f"{hf}.weight")]
    if bias:
        rules.append(_one(f"{olmo}.bias", f"{hf}.bias"))
    return rules


def _norm(olmo: str, hf: str, config, layer_norm: bool = False) -> list[Rule]:
    """A norm's scale (and bias for LayerNorm); nothing when the design has no learnable scale."""
    if "none" in config.scale_vector_parts:
        return []
    rules = [_one(f"{olmo}.weight", f"{hf}.weight")]
    if layer_norm:
        rules.append(
            _one(f"{olmo}.bias", f"{hf}.bias", optional=True, fill=lambda: [torch.zeros(config.hidden_size)])
        )
    return rules


def _split_rows(*sizes):
    return lambda ts: list(torch.split(ts[0], list(sizes), dim=0))


def _cat_rows(ts):
    return [torch.cat(ts, dim=0)]


def _attention(config, prefix: str, hf: str, fused_qkv: bool) -> list[Rule]:
    h, kv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    bias = bool(config.attention_bias)
    rules = []
    if fused_qkv:
        names = ("weight", "bias") if bias else ("weight",)
        for n in names:
            rules.append(
                Rule(
                    (f"{prefix}.w_qkv.{n}",),
                    tuple(f"{hf}.{p}_proj.{n}" for p in "qkv"),
                    to_hf=_split_rows(h * hd, kv * hd, kv * hd),
                    to_olmo=_cat_rows,
                )
            )
    else:
        for o, p in (("w_q", "q"), ("w_k", "k"), ("w_v", "v")):
            rules += _linear(f"{prefix}.{o}", f"{hf}.{p}_proj", bias)
    rules += _linear(f"{prefix}.w_out", f"{hf}.o_proj", bias)
    return rules


def _ffn(prefix: str, hf: str) -> list[Rule]:
    return [
        _one(f"{prefix}.w1.weight", f"{hf}.gate_proj.weight"),
        _one(f"{prefix}.w3.weight", f"{hf}.up_proj.weight"),
        _one(f"{prefix}.w2.weight", f"{hf}.down_proj.weight"),
    ]


def _branches(config, i: int, fused_qkv: bool, attn: str = "attention", ffn: str = "feed_forward") -> list[Rule]:
    L = f"model.layers.{i}"
    return _attention(config, f"blocks.{i}.{attn}", f"{L}.self_attn", fused_qkv) + _ffn(f"blocks.{i}.{ffn}", f"{L}.mlp")


def _pre_norms(config, i: int) -> list[Rule]:
    L = f"model.layers.{i}"
    return _norm(f"blocks.{i}.attention_norm", f"{L}.input_layernorm", config) + _norm(
        f"blocks.{i}.feed_forward_norm", f"{L}.post_attention_layernorm", config
    )


# ----------------------------------------------------------------------------------------------- per design
def _layer_default(config, i, opts):
    return _branches(config, i, opts["fused_qkv"]) + _pre_norms(config, i)


def _layer_peri_norm(config, i, opts):
    L = f"model.layers.{i}"
    return (
        _layer_default(config, i, opts)
        + _norm(f"blocks.{i}.post_attention_norm", f"{L}.attn_connection.output_norm", config)
        + _norm(f"blocks.{i}.post_feed_forward_norm", f"{L}.mlp_connection.output_norm", config)
    )


def _layer_deepnorm(config, i, opts):
    L, ln = f"model.layers.{i}", config.norm_kind == "layer" and config.norm_bias
    return (
        _branches(config, i, opts["fused_qkv"])
        + _norm(f"blocks.{i}.attention_norm", f"{L}.attn_connection.norm", config, layer_norm=ln)
        + _norm(f"blocks.{i}.feed_forward_norm", f"{L}.mlp_connection.norm", config, layer_norm=ln)
    )


def _layer_keel(config, i, opts):
    L = f"model.layers.{i}"
    rules = _layer_default(config, i, opts)
    if i > 0:
        rules += _norm(f"blocks.{i}.post_attention_norm", f"{L}.attn_connection.post_norm", config)
    return rules + _norm(f"blocks.{i}.post_feed_forward_norm", f"{L}.mlp_connection.post_norm", config)


def _hc_connections(i):
    L = f"model.layers.{i}"
    return ((f"blocks.{i}.attention_hyper_connection", f"{L}.attn_connection"),
            (f"blocks.{i}.feed_forward_hyper_connection", f"{L}.mlp_connection"))


def _layer_hc(config, i, opts):
    rules = _layer_default(config, i, opts)
    for olmo, hf in _hc_connections(i):
        rules += [_one(f"{olmo}.{o}", f"{hf}.{h}") for o, h in HC_NAMES.items()]
    return rules


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


def _mhc_rules(olmo: str, hf: str, backend: str, n: int, d: int, tau: float = 1.0) -> list[Rule]:
    H = {k: f"{hf}.{v}" for k, v in MHC_NAMES.items()}
    if backend == "liger_mhc":
        return [
            _one(f"{olmo}.phi", H["phi"]),
            _one(f"{olmo}.b", H["bias"]),
            Rule(tuple(f"{olmo}.alpha_{p}" for p in ("pre", "post", "res")), (H["alpha"],), to_hf=_gates,
                 to_olmo=lambda ts: list(ts[0].unbind(0))),
        ]
    if backend == "mhc":
        return [
            Rule(
                tuple(f"{olmo}.{p}_dynamic_proj" for p in ("pre", "post", "residual")),
                (H["phi"],),
                to_hf=lambda ts: [torch.cat([ts[0], ts[1], _res_t(ts[2], n)], dim=-1)],
                to_olmo=lambda ts: [ts[0][:, :n], ts[0][:, n : 2 * n], _res_t(ts[0][:, 2 * n :], n)],
            ),
            Rule(
                tuple(f"{olmo}.{p}_bias" for p in ("pre", "post", "residual")),
                (H["bias"],),
                to_hf=lambda ts: [torch.cat([ts[0], ts[1], ts[2].transpose(0, 1).flatten()])],
                to_olmo=lambda ts: [ts[0][:n], ts[0][n : 2 * n], ts[0][2 * n :].unflatten(0, (n, n)).transpose(0, 1)],
            ),
            Rule(tuple(f"{olmo}.{p}_gate" for p in ("pre", "post", "residual")), (H["alpha"],), to_hf=_gates,
                 to_olmo=lambda ts: list(ts[0].unbind(0))),
        ]
    if backend == "mhc_static":
        to_hf, to_olmo = _static_to_dynamic(n, d, tau)
        return [
            Rule(tuple(f"{olmo}.H_{p}_logits" for p in ("pre", "post", "res")), (H["phi"], H["bias"], H["alpha"]),
                 to_hf=to_hf, to_olmo=to_olmo)
        ]
    raise ValueError(f"`mhc_backend` must be one of {list(MHC_BACKENDS)}, got {backend!r}")


def _layer_mhc(config, i, opts):
    rules = _layer_default(config, i, opts)
    for olmo, hf in _hc_connections(i):
        rules += _mhc_rules(olmo, hf, opts["mhc_backend"], opts["streams"], config.hidden_size, opts["sinkhorn_tau"])
    return rules


def _squeeze_row(ts):
    return [ts[0].reshape(-1)]


def _unsqueeze_row(ts):
    return [ts[0].reshape(1, -1)]


def _attnres_query(olmo_prefix: str, hf_prefix: str, config) -> list[Rule]:
    return [
        _one(f"{olmo_prefix}_proj.weight", f"{hf_prefix}.{ATTNRES_NAMES['query']}", to_hf=_squeeze_row,
             to_olmo=_unsqueeze_row),
        *_norm(f"{olmo_prefix}_norm", f"{hf_prefix}.{ATTNRES_NAMES['key_norm']}", config),
    ]


def _layer_attnres(config, i, opts):
    L = f"model.layers.{i}"
    rules = _layer_default(config, i, opts)
    if i > 0:
        rules += _attnres_query(f"blocks.{i}.attn_res", f"{L}.attn_connection", config)
    return rules + _attnres_query(f"blocks.{i}.mlp_res", f"{L}.mlp_connection", config)


def _model_attnres(config, opts):
    return _attnres_query("res", ATTNRES_NAMES["stream"], config)


def _layer_moda(config, i, opts):
    rules = _branches(config, i, opts["fused_qkv"], attn="attention.attention", ffn="feed_forward.feed_forward")
    rules += _pre_norms(config, i)
    if i < config.num_hidden_layers - 1:
        rules.append(_one(f"blocks.{i}.feed_forward.kv_proj.weight", f"model.layers.{i}.{MODA_KV}"))
    return rules


#: one table per hf_depth design: (per-layer rules, extra model-level rules)
TABLES: dict[str, tuple[Callable, Callable | None]] = {
    "pre_ln": (_layer_default, None),
    "lns": (_layer_default, None),
    "sandwich_ln": (_layer_peri_norm, None),
    "deepnorm": (_layer_deepnorm, None),
    "keel": (_layer_keel, None),
    "hc": (_layer_hc, None),
    "mhc": (_layer_mhc, None),
    "attnres": (_layer_attnres, _model_attnres),
    "block_attnres": (_layer_attnres, _model_attnres),
    "moda": (_layer_moda, None),
}


def _final_norm(config, design: str) -> list[Rule]:
    kind = getattr(config, "final_norm_kind", None) or getattr(config, "norm_kind", "rms")
    if kind != "layer":
        return _norm("lm_head.norm", "model.norm", config)
    # a final LayerNorm must come with its bias: without one the checkpoint's final norm is an RMSNorm
    return [_one("lm_head.norm.weight", "model.norm.weight"), _one("lm_head.norm.bias", "model.norm.bias")]


def rules_for(config, options: dict) -> list[Rule]:
    """Every mapping rule of a model of ``config`` (the full table of its design)."""
    design = config.design
    if design not in TABLES:
        raise ValueError(f"`design` {design!r} has no OLMo-core table; allowed: {sorted(TABLES)}")
    layer_fn, model_fn = TABLES[design]
    rules = [_one("embeddings.weight", "model.embed_tokens.weight"), _one("lm_head.w_out.weight", "lm_head.weight")]
    rules += _final_norm(config, design)
    for i in range(config.num_hidden_layers):
        rules += layer_fn(config, i, options)
    if model_fn is not None:
        rules += model_fn(config, options)
    return rules


# ----------------------------------------------------------------------------------------------- aliases / buffers
_HC_BRANCH_ALIASES = (
    (re.compile(r"^blocks\.(\d+)\.attention_hyper_connection\.branch\.norm\.(.+)$"), "blocks.{}.attention_norm.{}"),
    (re.compile(r"^blocks\.(\d+)\.attention_hyper_connection\.branch\.attention\.(.+)$"), "blocks.{}.attention.{}"),
    (re.compile(r"^blocks\.(\d+)\.feed_forward_hyper_connection\.branch\.norm\.(.+)$"),
     "blocks.{}.feed_forward_norm.{}"),
    (re.compile(r"^blocks\.(\d+)\.feed_forward_hyper_connection\.branch\.feed_forward\.(.+)$"),
     "blocks.{}.feed_forward.{}"),
)
_LNS_BUFFER = re.compile(r"^blocks\.(\d+)\.ln_scale$")


def _resolve_aliases(sd: dict, design: str) -> dict:
    """Fold HC/mHC branch aliases into their canonical keys (checked equal) and check LNS scale buffers."""
    out, bad = {}, []
    for k, v in sd.items():
        canon = None
        if design in ("hc", "mhc"):
            for pat, fmt in _HC_BRANCH_ALIASES:
                m = pat.match(k)
                if m:
                    canon = fmt.format(*m.groups())
                    break
        if canon is not None:
            if canon in sd and not torch.equal(sd[canon], v):
                bad.append(f"{k} != {canon}")
            elif canon not in sd:
                out[canon] = v
            continue
        m = _LNS_BUFFER.match(k) if design == "lns" else None
        if m:
            want = 1.0 / math.sqrt(int(m.group(1)) + 1)
            if v.numel() != 1 or abs(float(v) - want) > 1e-6:
                bad.append(f"{k}={v.flatten()[:1].tolist()} (LNS expects 1/sqrt({int(m.group(1)) + 1})={want:.6f})")
            continue
        out[k] = v
    if bad:
        raise ValueError(f"inconsistent OLMo-core checkpoint: {bad[:8]}")
    return out


def _strip(sd: dict) -> dict:
    out = {}
    for k, v in sd.items():
        for inf in _STRIP_INFIXES:
            k = k.replace(inf, "")
        out[k] = v
    for p in _STRIP_PREFIXES:
        if out and all(k.startswith(p) for k in out):
            out = {k[len(p):]: v for k, v in out.items()}
    return out


# ----------------------------------------------------------------------------------------------- config
def _design_name(design: str, fields: dict | None = None) -> str:
    """hf_depth design of a DepthBench block type; ``attnres`` with ``attnres_block_size`` S > 1 is Block AttnRes."""
    fields = fields or {}
    if design == "attnres":
        size = fields.get("attnres_block_size")
        return "block_attnres" if size is not None and size != 1 else "attnres"
    if design in BLOCK_TYPES:
        return BLOCK_TYPES[design]
    if design in DESIGNS:
        return design
    raise ValueError(
        f"`design` must be a DepthBench block type {list(BLOCK_TYPES)} or an hf_depth design {sorted(DESIGNS)}, "
        f"got {design!r}"
    )


def _fields_of(cls) -> set[str]:
    names = set()
    for c in cls.__mro__:
        names |= set(getattr(c, "__annotations__", {}))
    return names


def infer_fields(sd: dict, design: str, given: dict) -> dict:
    """Config fields readable from tensor shapes (vocab, width, depth, FFN, KV heads, HC streams)."""
    f: dict = {}
    emb = sd.get("embeddings.weight")
    if emb is None:
        raise ValueError("cannot convert: missing keys ['embeddings.weight']")
    f["vocab_size"], f["hidden_size"] = int(emb.shape[0]), int(emb.shape[1])
    layers = {int(m.group(1)) for k in sd if (m := re.match(r"^blocks\.(\d+)\.", k))}
    if layers:
        f["num_hidden_layers"] = max(layers) + 1
    for k in ("blocks.0.feed_forward.w1.weight", "blocks.0.feed_forward.feed_forward.w1.weight"):
        if k in sd:
            f["intermediate_size"] = int(sd[k].shape[0])
    heads = given.get("num_attention_heads", 16)
    f["num_attention_heads"] = heads
    hd = given.get("head_dim")
    for k in ("blocks.0.attention.w_q.weight", "blocks.0.attention.attention.w_q.weight"):
        if k in sd and hd is None:
            hd = int(sd[k].shape[0]) // heads
    for k in ("blocks.0.attention.w_k.weight", "blocks.0.attention.attention.w_k.weight"):
        if k in sd and hd:
            f["num_key_value_heads"] = int(sd[k].shape[0]) // hd
    if hd and hd != f["hidden_size"] // heads:
        f["head_dim"] = hd
    if any(k.endswith("attention.w_q.bias") or k.endswith("attention.w_qkv.bias") for k in sd):
        f["attention_bias"] = True
    sa = sd.get("blocks.0.attention_hyper_connection.static_alpha")
    if sa is not None:
        f["_streams"] = int(sa.shape[0])
    for k in ("blocks.0.attention_hyper_connection.pre_bias", "blocks.0.attention_hyper_connection.H_pre_logits"):
        if k in sd:
            f["_streams"] = int(sd[k].shape[0])
    if "blocks.0.attention_hyper_connection.b" in sd:
        m = int(sd["blocks.0.attention_hyper_connection.b"].shape[0])
        f["_streams"] = int(round(math.sqrt(m + 1) - 1))  # m = n^2 + 2n
    return f


def _detect_backend(sd: dict) -> str | None:
    if any(k.endswith("_hyper_connection.phi") for k in sd):
        return "liger_mhc"
    if any(k.endswith("_hyper_connection.H_res_logits") for k in sd):
        return "mhc_static"
    if any(k.endswith("_hyper_connection.residual_dynamic_proj") for k in sd):
        return "mhc"
    return None


#: hf_depth mHC fields that follow DepthBench's backend unless given (final reduce, RMS eps of the routing)
MHC_BACKEND_FIELDS = {
    "liger_mhc": {"mhc_final_reduce": "mean_then_norm", "mhc_norm_eps": 1e-6},
    "mhc": {"mhc_final_reduce": "sum_of_normed", "mhc_norm_eps": 1e-8, "mhc_dynamic_tanh": True,
            "mhc_sinkhorn_order": "columns_first"},
    "mhc_static": {"mhc_final_reduce": "sum_of_normed", "mhc_sinkhorn_order": "columns_first"},
}

#: hf_depth fields that make a converted model compute DepthBench's own forward where it differs from
#: hf_depth's defaults (set unless given): AttnRes's aggregation norms have OLMo-core's default eps 1e-5
#: (``block.py`` builds them without one); MoDA's depth keys are never rotated (``nn/moda.py``).
DEPTHBENCH_FORWARD = {
    "attnres": {"attnres_norm_eps": 1e-5},
    "block_attnres": {"attnres_norm_eps": 1e-5},
    "moda": {"moda_depth_rope": "unrotated"},
}

#: values that change the logits and that no tensor shape tells: never guessed (config.json or given)
REQUIRED = {
    "num_attention_heads": "attention heads (config: model.block.sequence_mixer.n_heads)",
    "rope_theta": "RoPE theta (model.block.sequence_mixer.rope.theta; OLMo-core's default is 500000)",
    "rms_norm_eps": "block norm eps (model.block.layer_norm.eps)",
}
#: the HC version: True = ``H' = A_r^T H + beta y`` (hyper_connections.py @ 8cc2fd7), False = ``H' = H + beta y``
#: (the earlier version @ 5152cab); the state dicts of both are identical
HC_VERSION = "hc_stream_mixing"


def missing_required(design: str, fields: dict) -> list[str]:
    """The logit-changing fields (:data:`REQUIRED`, plus the HC version for ``hc``) absent from ``fields``."""
    names = [k for k in REQUIRED if fields.get(k) is None]
    if _design_name(design, fields) == "hc" and fields.get(HC_VERSION) is None:
        names.append(HC_VERSION)
    return names


def refuse_to_guess(design: str, fields: dict, how: str = "keyword arguments") -> None:
    """Raise one ``ValueError`` line naming every logit-changing value not given."""
    names = missing_required(design, fields)
    if names:
        raise ValueError(
            f"refusing to guess {', '.join(names)} (they change the logits and no tensor shape tells them): give "
            f"them as {how} or pass OLMo-core's config.json"
            + (f"; {HC_VERSION}=true for H' = A_r^T H + beta y, false for the earlier H' = H + beta y"
               if HC_VERSION in names else "")
        )


def build_config(design: str, sd: dict, mhc_backend: str | None = None, **fields):
    """The hf_depth config of an OLMo-core state dict: shapes first, then ``fields`` (which win)."""
    block = design
    design = _design_name(design, fields)
    if design not in DESIGNS:
        raise ValueError(f"DepthBench block type {block!r} needs hf_depth design {design!r}, not registered here; "
                         f"registered: {sorted(DESIGNS)}")
    if design == "attnres":
        fields = {k: v for k, v in fields.items() if k != "attnres_block_size"}  # Full AttnRes: S = 1
    if design == "deepnorm" and "deepnorm_final_norm" in _fields_of(cls := DESIGNS[design].config_class):
        # DepthBench's DeepNorm makes only the block norms LayerNorms: its final norm (no bias) is an RMSNorm
        fields = {"deepnorm_final_norm": "layer" if "lm_head.norm.bias" in sd else "rms", **fields}
    if design == "mhc":
        backend = mhc_backend or _detect_backend(sd) or "liger_mhc"
        fields = {**MHC_BACKEND_FIELDS.get(backend, {}), **fields}
    fields = {**DEPTHBENCH_FORWARD.get(design, {}), **fields}
    cls = DESIGNS[design].config_class
    inferred = infer_fields(sd, design, fields)
    streams = inferred.pop("_streams", None)
    merged = {**inferred, **fields}
    known = _fields_of(cls)
    if streams is not None:
        for name in ("hc_streams", "mhc_streams", "num_streams", "hc_num_streams"):
            if name in known and name not in fields:
                merged[name] = streams
    unknown = sorted(k for k in merged if k not in known)
    if unknown:
        raise ValueError(f"unknown config fields for design {design!r}: {unknown}; allowed: {sorted(known)}")
    return cls(**merged)


def _olmo_json_fields(cfg: dict) -> tuple[str | None, dict]:
    """(block type, hf_depth fields) from an OLMo-core experiment/model config JSON (lenient)."""
    model = cfg.get("model", cfg)
    block = model.get("block", {}) or {}
    attn = block.get("sequence_mixer") or block.get("attention") or {}
    fields: dict = {}
    for src, dst in (("d_model", "hidden_size"), ("n_layers", "num_hidden_layers"), ("vocab_size", "vocab_size")):
        if model.get(src) is not None:
            fields[dst] = model[src]
    if attn.get("n_heads") is not None:
        fields["num_attention_heads"] = attn["n_heads"]
    if attn.get("n_kv_heads") is not None:
        fields["num_key_value_heads"] = attn["n_kv_heads"]
    if attn.get("head_dim") is not None:
        fields["head_dim"] = attn["head_dim"]
    if attn.get("bias") is not None:
        fields["attention_bias"] = bool(attn["bias"])
    rope = attn.get("rope") or {}
    if rope.get("theta") is not None:
        fields["rope_theta"] = float(rope["theta"])
    ln = block.get("layer_norm") or {}
    if "eps" in ln:  # a saved ``eps: null`` is OLMo-core's module default
        fields["rms_norm_eps"] = OLMO_CORE_NORM_EPS if ln["eps"] is None else float(ln["eps"])
    ff = block.get("feed_forward") or {}
    if ff.get("hidden_size") is not None:
        fields["intermediate_size"] = ff["hidden_size"]
    extra = {}
    if block.get("attnres_block_size") is not None:
        extra["attnres_block_size"] = block["attnres_block_size"]
    hc = block.get("hyper_connections") or {}
    if hc.get("kind") in MHC_BACKENDS:
        extra["mhc_backend"] = hc["kind"]
    reduce = {"sum": "sum_of_normed", "mean": "mean_then_norm", "auto": "sum_of_normed"}.get(hc.get("reduce_mode"))
    if reduce is not None:
        extra["hc_final_reduce" if hc.get("kind") == "hc" else "mhc_final_reduce"] = reduce
    if hc.get("sinkhorn_tau") is not None:
        extra["sinkhorn_tau"] = float(hc["sinkhorn_tau"])
    name = block.get("name")
    return name, {**fields, **extra}


# ----------------------------------------------------------------------------------------------- convert
def _options(config, sd: dict | None, mhc_backend: str | None, fused_qkv: bool | None,
             sinkhorn_tau: float = 1.0) -> dict:
    if fused_qkv is None:
        fused_qkv = sd is not None and any(k.endswith("attention.w_qkv.weight") for k in sd)
    if mhc_backend is None:
        mhc_backend = (_detect_backend(sd) if sd is not None else None) or "liger_mhc"
    if mhc_backend not in MHC_BACKENDS:
        raise ValueError(f"`mhc_backend` must be one of {list(MHC_BACKENDS)}, got {mhc_backend!r}")
    streams = None
    for name in ("hc_streams", "mhc_streams", "num_streams", "hc_num_streams"):
        streams = streams or getattr(config, name, None)
    return {"fused_qkv": bool(fused_qkv), "mhc_backend": mhc_backend, "streams": streams or 4,
            "sinkhorn_tau": float(sinkhorn_tau)}


def _keys_error(what: str, missing, unexpected) -> ValueError:
    parts = []
    if missing:
        parts.append(f"missing keys ({len(missing)}): {sorted(missing)[:12]}")
    if unexpected:
        parts.append(f"unmapped keys ({len(unexpected)}): {sorted(unexpected)[:12]}")
    return ValueError(f"cannot convert {what}: " + "; ".join(parts) + " (no weight is dropped or invented)")


def olmo_core_to_hf_state_dict(sd: dict, config, *, mhc_backend: str | None = None, fused_qkv: bool | None = None,
                               sinkhorn_tau: float = 1.0):
    """Map an OLMo-core state dict to hf_depth names for ``config`` (refuses unmapped or missing keys)."""
    sd = _resolve_aliases(_strip(dict(sd)), config.design)
    opts = _options(config, sd, mhc_backend, fused_qkv, sinkhorn_tau)
    rules = rules_for(config, opts)
    needed = {k for r in rules if not r.optional for k in r.olmo}
    known = {k for r in rules for k in r.olmo}
    missing, unexpected = needed - set(sd), set(sd) - known
    if missing or unexpected:
        raise _keys_error(f"an OLMo-core {config.design!r} checkpoint", missing, unexpected)
    out = {}
    for r in rules:
        if any(k not in sd for k in r.olmo):
            tensors = r.fill()
        else:
            src = [sd[k] for k in r.olmo]
            tensors = r.to_hf(src) if r.to_hf else src
        out.update(zip(r.hf, tensors))
    return out


def olmo_core_to_hf_depth(state_dict: dict, design: str, *, mhc_backend: str | None = None,
                          fused_qkv: bool | None = None, sinkhorn_tau: float = 1.0, dtype: torch.dtype | None = None,
                          **config_fields):
    """Build the hf_depth causal LM of an OLMo-core / DepthBench state dict.

    ``design`` is a DepthBench block type (``default``, ``peri_norm``, ...) or an hf_depth design name;
    ``config_fields`` are hf_depth config fields (heads, RoPE theta, design fields); shapes supply the rest.
    ``mhc_backend`` (``liger_mhc`` / ``mhc`` / ``mhc_static``) and ``fused_qkv`` are detected from the keys;
    ``sinkhorn_tau`` is DepthBench's ``mhc_static`` Sinkhorn temperature (1.0 unless configured).
    """
    refuse_to_guess(design, config_fields)
    stripped = _strip(dict(state_dict))
    config = build_config(design, stripped, mhc_backend=mhc_backend, **config_fields)
    hf_sd = olmo_core_to_hf_state_dict(stripped, config, mhc_backend=mhc_backend, fused_qkv=fused_qkv,
                                       sinkhorn_tau=sinkhorn_tau)
    from transformers.initialization import no_init_weights

    target = dtype or next(iter(hf_sd.values())).dtype
    target = target if target.is_floating_point else torch.float32
    previous = torch.get_default_dtype()
    try:  # built directly in the target dtype, without the random init: every parameter is loaded below
        torch.set_default_dtype(target)
        with no_init_weights():
            model = MODEL_CLASSES[config.design][1](config)
    finally:
        torch.set_default_dtype(previous)
    want = set(model.state_dict())
    missing, unexpected = want - set(hf_sd), set(hf_sd) - want
    if missing or unexpected:  # a table out of step with the design: say so, never load partially
        raise _keys_error(f"into hf_depth {config.design!r} (table vs model)", missing, unexpected)
    ref = model.state_dict()
    for k, v in hf_sd.items():
        if tuple(v.shape) != tuple(ref[k].shape):
            raise ValueError(f"shape mismatch for {k}: checkpoint {tuple(v.shape)} vs model {tuple(ref[k].shape)}")
    model.load_state_dict({k: v.to(ref[k].dtype) for k, v in hf_sd.items()}, strict=True)
    model.config.dtype = target  # parameters are already in `target`; fp32 buffers (RoPE inv_freq) stay fp32
    gc = model.generation_config
    gc.eos_token_id, gc.pad_token_id = config.eos_token_id, config.pad_token_id
    model.olmo_core_source = source_record(design, config, stripped, mhc_backend)
    return model.eval()


#: the hf_depth fields that express DepthBench's forward, per design (recorded in a converted model's card)
_FORWARD_FIELDS = ("attnres_norm_eps", "moda_depth_rope", HC_VERSION, "mhc_dynamic_tanh", "mhc_sinkhorn_order",
                   "mhc_final_reduce",
                   "mhc_norm_eps", "hc_final_reduce", "deepnorm_final_norm")


def source_record(block: str, config, sd: dict | None = None, mhc_backend: str | None = None) -> dict:
    """What a converted model came from and which hf_depth fields make it compute that forward."""
    rec = {"format": "OLMo-core / DepthBench (keyu-wang-2002/DepthBench)", "block_type": block,
           "hf_depth_design": config.design}
    if config.design == "mhc":
        rec["mhc_backend"] = mhc_backend or (_detect_backend(sd) if sd is not None else None) or "liger_mhc"
    if config.design == "hc":
        rec["hc_version"] = ("H' = A_r^T H + beta y (hyper_connections.py @ 8cc2fd7)" if config.hc_stream_mixing
                             else "H' = H + beta y, no stream mixing (earlier hyper_connections.py @ 5152cab)")
    if config.design in ("attnres", "block_attnres"):
        rec["attnres_block_size"] = config.attnres_block_sublayers
    known = _fields_of(type(config))
    rec["fields"] = {k: getattr(config, k) for k in (*REQUIRED, *_FORWARD_FIELDS) if k in known}
    return rec


def hf_depth_to_olmo_core(model, *, mhc_backend: str = "liger_mhc", fused_qkv: bool = False,
                          hc_branch_aliases: bool = False, sinkhorn_tau: float = 1.0) -> dict:
    """The OLMo-core / DepthBench state dict of an hf_depth model (inverse of :func:`olmo_core_to_hf_depth`).

    ``hc_branch_aliases=True`` also writes the duplicated ``*_hyper_connection.branch.*`` keys that an
    OLMo-core HC/mHC model's ``state_dict()`` contains.
    """
    config = model.config
    sd = model.state_dict()
    rules = rules_for(config, _options(config, None, mhc_backend, fused_qkv, sinkhorn_tau))
    produced = {k for r in rules for k in r.hf}
    missing, unexpected = produced - set(sd), set(sd) - produced
    if missing or unexpected:
        raise _keys_error(f"hf_depth {config.design!r} -> OLMo-core", missing, unexpected)
    out = {}
    for r in rules:
        src = [sd[k] for k in r.hf]
        out.update(zip(r.olmo, [t.clone() for t in (r.to_olmo(src) if r.to_olmo else src)]))
    if hc_branch_aliases and config.design in ("hc", "mhc"):
        for k in list(out):
            m = re.match(r"^blocks\.(\d+)\.(attention_norm|attention|feed_forward_norm|feed_forward)\.(.+)$", k)
            if m:
                i, mod, rest = m.groups()
                hc = "attention" if mod.startswith("attention") else "feed_forward"
                sub = "norm" if mod.endswith("_norm") else mod
                out[f"blocks.{i}.{hc}_hyper_connection.branch.{sub}.{rest}"] = out[k]
    return out


# ----------------------------------------------------------------------------------------------- files
def _load_dcp(path: str) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "sd.pt")
        dcp_to_torch_save(path, out)
        sd = torch.load(out, map_location="cpu", weights_only=True)
    return sd


def _flatten(d: dict) -> dict:
    """Nested state dict -> flat ``{"a.b": tensor}`` (non-tensor entries such as step counters dropped)."""
    return flatten_dict(d, lambda v: v if isinstance(v, torch.Tensor) else DROP)


def load_state_dict(src: str) -> dict:
    """Load an OLMo-core state dict from a .pt/.bin file, a .safetensors file, a folder holding either (sharded
    safetensors included), or a torch.distributed checkpoint folder (``.metadata``; optimizer state ignored)."""
    if os.path.isdir(src):
        if os.path.exists(os.path.join(src, ".metadata")):
            sd = _flatten(_load_dcp(src))
            model_keys = {k[len("model."):]: v for k, v in sd.items() if k.startswith("model.")}
            return model_keys or sd
        for sub in ("model_and_optim", "model"):
            if os.path.exists(os.path.join(src, sub, ".metadata")):
                return load_state_dict(os.path.join(src, sub))
        files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
        if not files:
            files = sorted(f for f in os.listdir(src) if f.endswith((".pt", ".bin", ".pth")))
        if not files:
            raise ValueError(f"no .safetensors/.pt/.bin file or .metadata (distributed checkpoint) in {src!r}")
        sd = {}
        for f in files:
            sd.update(load_state_dict(os.path.join(src, f)))
        return sd
    if src.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(src)
    obj = torch.load(src, map_location="cpu", weights_only=True)
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
        obj = obj["model"]
    if not isinstance(obj, dict):
        raise ValueError(f"{src!r} does not hold a state dict")
    return _flatten(obj)


def _parse_value(v: str):
    try:
        return json.loads(v)
    except json.JSONDecodeError:
        return v


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hf-depth convert-olmo-core", description=__doc__.split("\n")[0])
    p.add_argument("src", help="OLMo-core state dict: .pt / .safetensors file, or a folder (also a DCP folder)")
    p.add_argument("out", help="output folder (save_pretrained)")
    p.add_argument("--design", help=f"DepthBench block type {list(BLOCK_TYPES)} or hf_depth design; "
                   "default: the block name in --config")
    p.add_argument("--config", help="OLMo-core config JSON (default: SRC/config.json when present)")
    p.add_argument("--mhc-backend", choices=MHC_BACKENDS, help="mHC parameter layout (default: detected)")
    p.add_argument("--attnres-block-size", type=int, help="AttnRes block size S in sublayers (1 = Full)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="dtype of the saved weights")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="an hf_depth config field, e.g. --set num_attention_heads=16 (JSON values)")
    p.add_argument("--max-shard-size", default="5GB")
    a = p.parse_args(argv)

    fields: dict = {}
    cfg_path = a.config or (os.path.join(a.src, "config.json") if os.path.isdir(a.src) else None)
    block_name = None
    if cfg_path and os.path.exists(cfg_path):
        with open(cfg_path) as f:
            block_name, fields = _olmo_json_fields(json.load(f))
    mhc_backend = a.mhc_backend or fields.pop("mhc_backend", None)
    sinkhorn_tau = fields.pop("sinkhorn_tau", 1.0)
    if a.attnres_block_size is not None:
        fields["attnres_block_size"] = a.attnres_block_size
    for item in a.set:
        if "=" not in item:
            p.error(f"--set takes FIELD=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        fields[k.strip()] = _parse_value(v)
    design = a.design or block_name
    if design is None:
        p.error("--design is required (no block name in a config JSON)")
    if design != "attnres" and _design_name(design, fields) != "block_attnres":
        fields.pop("attnres_block_size", None)
    from .errors import reading

    with reading(a.src, "the OLMo-core checkpoint", "give a .pt/.safetensors state dict, or a (distributed) "
                 "checkpoint folder; a truncated file: re-save or re-download it"):
        sd = load_state_dict(a.src)
    try:
        refuse_to_guess(design, fields, how="--set FIELD=VALUE")
    except ValueError as e:
        print(f"hf-depth convert-olmo-core: {e}", file=sys.stderr)
        return 2
    dtype = getattr(torch, a.dtype) if a.dtype else None
    try:
        model = olmo_core_to_hf_depth(sd, design, mhc_backend=mhc_backend, sinkhorn_tau=sinkhorn_tau, dtype=dtype,
                                      **fields)
    except ValueError as e:
        print(f"hf-depth convert-olmo-core: {e}", file=sys.stderr)
        return 2
    tmp = a.out.rstrip("/") + ".tmp"
    model.save_pretrained(tmp, max_shard_size=a.max_shard_size)
    from .hub import write_conversion_card

    write_conversion_card(tmp, model, model.olmo_core_source, src=a.src)
    if os.path.exists(a.out):
        import shutil

        shutil.rmtree(a.out)
    os.replace(tmp, a.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"converted {len(sd)} tensors ({n:,} parameters) -> {type(model).__name__} in {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
