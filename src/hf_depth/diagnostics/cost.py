"""System cost per design and shape (DepthBench Figure 11): analytic prefill FLOPs, KV-cache and parameter bytes,
and measured activation memory, peak memory and tokens/s on the current device.

**FLOPs** are counted per sequence of ``T`` tokens (default 4096), 2 FLOPs per multiply-add, matmuls only:

* ``linear``: q/k/v/o and the three SwiGLU projections of every layer, ``2 T (d q + 2 d kv + q d + 3 d f)``
  (two FFN matrices for GPT-2 / GPT-NeoX's GELU MLP; the family's adapter says which);
* ``attention_full``: ``Q K^T`` and ``P V`` over the full ``T x T`` square, ``4 T^2 H hd`` per layer (what a FLOP
  counter sees for eager or SDPA attention); ``attention_causal`` counts only the ``T (T + 1) / 2`` visible pairs;
* ``lm_head``: ``2 T d V``;
* ``extra_matmul``: the design's routing matmuls, declared by the design itself
  (``Design.extra_flops(config, T, model) -> {"matmul": int, "other": int}``, in its ``design_<name>.py``); the
  default counts every ``nn.Linear`` of the model outside the standard projections;
* ``extra_other``: design work that is not a matmul (AttnRes depth softmax and weighted sums, MoDA's depth
  attention, HC's matrix-vector beta), reported apart.

``total_matmul = linear + attention_full + lm_head + extra_matmul`` is what
``torch.utils.flop_counter.FlopCounterMode`` counts for a forward (mm/bmm/addmm/SDPA); it excludes norms, RoPE,
softmax, SwiGLU's elementwise product, residual adds, and matrix-vector products (``aten.mv`` is not counted).
``depthbench = linear + attention_causal + extra_matmul + extra_other`` leaves out the LM head, which is the
convention that reproduces the paper's 3.0 -> 4.4 TFLOPs at T = 4096 for L16/d1216 -> L70/d640
(this module gives 2.98 and 4.33 TFLOPs for Pre-LN).
"""

from __future__ import annotations

import math
import statistics
import time

import torch
from torch import nn

from ..models.residual import DESIGNS
from ..models.residual import extra_linear_flops as _extra_linear_flops
from .adapters import adapter_class, is_hf_depth


def _dims(config) -> dict:
    d, H = config.hidden_size, config.num_attention_heads
    hd = getattr(config, "head_dim", None) or d // H
    kvh = getattr(config, "num_key_value_heads", None) or H
    family = adapter_class(config)  # the FFN's width and matrix count (SwiGLU 3, GPT-2 / NeoX GELU MLP 2)
    return dict(d=d, H=H, hd=hd, q=H * hd, kv=kvh * hd, kvh=kvh, f=family.ffn_width(config),
                ffn_matrices=family.ffn_matrices, V=config.vocab_size, L=config.num_hidden_layers)


def _design_name(config) -> str:
    return getattr(config, "design", None) or getattr(config, "model_type", "llama")


def _design(config, model: nn.Module | None = None):
    """The ``Design`` of ``model`` (its class's), else the registered one of ``config`` (``None`` for a
    non-hf_depth model, e.g. Llama)."""
    own = getattr(type(model), "design", None) if model is not None else None
    if own is not None:
        return own
    name = getattr(config, "design", None)
    return DESIGNS.get(name) if isinstance(name, str) else None


def extra_linear_flops(model: nn.Module | None, T: int) -> int:
    """2 T in out for every ``nn.Linear`` of ``model`` that is not a standard projection or the LM head."""
    return _extra_linear_flops(None, T, model)["matmul"]


def design_extra_flops(config, T: int, model: nn.Module | None = None) -> dict:
    """The design's own count (``Design.extra_flops``); other hf_depth models: their non-standard ``nn.Linear``;
    a Hub family (fused or Conv1D projections): no design extras."""
    if not is_hf_depth(config):
        return {"matmul": 0, "other": 0}
    design = _design(config, model)
    count = design.extra_flops if design is not None else _extra_linear_flops
    return dict(count(config, T, model))


def prefill_flops(config, seq_len: int = 4096, model: nn.Module | None = None) -> dict:
    """Analytic prefill FLOPs of one sequence of ``seq_len`` tokens (see the module docstring)."""
    T, g = seq_len, _dims(config)
    L = g["L"]
    linear = L * 2 * T * (g["d"] * g["q"] + 2 * g["d"] * g["kv"] + g["q"] * g["d"] + g["ffn_matrices"] * g["d"] * g["f"])
    attn_full = L * 4 * T * T * g["H"] * g["hd"]
    attn_causal = L * 4 * (T * (T + 1) // 2) * g["H"] * g["hd"]
    head = 2 * T * g["d"] * g["V"]
    extra = design_extra_flops(config, T, model)
    return {
        "seq_len": T,
        "linear": linear,
        "attention_full": attn_full,
        "attention_causal": attn_causal,
        "lm_head": head,
        "extra_matmul": int(extra.get("matmul", 0)),
        "extra_other": int(extra.get("other", 0)),
        "total_matmul": linear + attn_full + head + int(extra.get("matmul", 0)),
        "depthbench": linear + attn_causal + int(extra.get("matmul", 0)) + int(extra.get("other", 0)),
    }


def kv_cache_bytes(config, seq_len: int = 4096, batch: int = 1, bytes_per: int = 2) -> dict:
    """KV cache of ``batch`` sequences of ``seq_len`` tokens, plus the design's own buffers
    (``Design.extra_kv_bytes``: MoDA's depth K/V)."""
    g = _dims(config)
    seq = 2 * g["L"] * seq_len * g["kv"] * bytes_per * batch
    design = _design(config)
    extra = design.extra_kv_bytes if design is not None else None
    depth = extra(config, seq_len, batch, bytes_per) if extra is not None else 0
    return {"sequence_kv": seq, "depth_kv": depth, "total": seq + depth}


def parameter_bytes(model: nn.Module) -> dict:
    n = sum(p.numel() for p in model.parameters())
    return {"params": n, "bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def activation_bytes(model: nn.Module, batch: int = 1, seq_len: int = 128) -> int:
    """Measured bytes of the tensors autograd saves for backward in one forward (distinct storages)."""
    ids = torch.randint(0, model.config.vocab_size, (batch, seq_len), device=next(model.parameters()).device)
    seen: dict[int, int] = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter):
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return t

    was = model.training
    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.enable_grad():
        model(input_ids=ids, use_cache=False)
    model.train(was)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(v for k, v in seen.items() if k not in params)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, repeats: int) -> tuple[float, int | None]:
    fn()  # warm-up
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return statistics.median(times), peak


def measure_throughput(model: nn.Module, batch: int = 1, seq_len: int = 128, new_tokens: int = 16,
                       repeats: int = 3) -> dict:
    """Tokens/s and peak memory (CUDA only; ``None`` on CPU) for forward, forward+backward and greedy generation
    with the KV cache, on the model's device and dtype."""
    device = next(model.parameters()).device
    ids = torch.randint(2, model.config.vocab_size, (batch, seq_len), device=device)
    out = {"device": str(device), "dtype": str(next(model.parameters()).dtype), "batch": batch, "seq_len": seq_len}
    was = model.training

    def fwd():
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)

    def fwd_bwd():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    def gen():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=0)

    model.eval()
    t, peak = _timed(fwd, device, repeats)
    out["forward"] = {"tokens_per_s": batch * seq_len / t, "seconds": t, "peak_bytes": peak}
    model.train()
    t, peak = _timed(fwd_bwd, device, repeats)
    model.zero_grad(set_to_none=True)
    out["forward_backward"] = {"tokens_per_s": batch * seq_len / t, "seconds": t, "peak_bytes": peak}
    model.eval()
    t, peak = _timed(gen, device, repeats)
    out["generate"] = {"tokens_per_s": batch * new_tokens / t, "seconds": t, "peak_bytes": peak,
                       "new_tokens": new_tokens}
    model.train(was)
    return out


def system_cost(model: nn.Module, seq_len: int = 4096, measure: bool = True, measure_seq_len: int = 128,
                measure_batch: int = 1, new_tokens: int = 16, repeats: int = 3) -> dict:
    """Every cost number of Figure 11 for this model (analytic at ``seq_len``; measured at ``measure_seq_len``)."""
    cfg = model.config
    dtype_bytes = next(model.parameters()).element_size()
    out = {
        "design": _design_name(cfg),
        "shape": {"L": cfg.num_hidden_layers, "d": cfg.hidden_size, "d_over_L": cfg.hidden_size / cfg.num_hidden_layers},
        "prefill_flops": prefill_flops(cfg, seq_len, model),
        "kv_cache_bytes": kv_cache_bytes(cfg, seq_len, 1, dtype_bytes),
        "parameters": parameter_bytes(model),
    }
    if measure:
        out["activation_bytes"] = {"batch": measure_batch, "seq_len": measure_seq_len,
                                   "saved_for_backward": activation_bytes(model, measure_batch, measure_seq_len)}
        out["measured"] = measure_throughput(model, measure_batch, measure_seq_len, new_tokens, repeats)
    return out


def tflops(x: float) -> float:
    return x / 1e12 if math.isfinite(x) else x
