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

from ..models.residual import DESIGNS, STREAM_BYTES, rms_norm_saved_bytes
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


def activation_bytes(model: nn.Module, batch: int = 1, seq_len: int = 128, autocast: torch.dtype | None = None,
                     labels: bool = False) -> int:
    """Measured bytes of the tensors autograd saves for backward in one forward (distinct storages).

    ``autocast``: run the forward under ``torch.autocast(<device>, autocast)`` (the trainer's bf16 mixed
    precision, fp32 parameters; the bf16 weight copies autocast keeps for backward are counted);
    ``labels``: also compute the loss (its saved log-softmax)."""
    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (batch, seq_len), device=device)
    seen: dict[int, int] = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter):
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return t

    was = model.training
    model.train()
    amp = torch.autocast(device.type, dtype=autocast, enabled=autocast is not None)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.enable_grad(), amp:
        model(input_ids=ids, labels=ids if labels else None, use_cache=False)
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


# ---------------------------------------------------------------------------------------------- analytic memory
PRECISIONS = {"bf16": 2, "fp32": 4}


def linear_input_bytes(d: int, consumers: int, compute_bytes: int) -> int:
    """Per token, the saved input of ``consumers`` linear maps reading one ``d``-vector: one shared tensor in fp32;
    one cast copy per consumer under autocast (the cast of an activation is not cached)."""
    return d * STREAM_BYTES if compute_bytes == STREAM_BYTES else consumers * d * compute_bytes


def analytic_activation_bytes(config, batch: int = 1, seq_len: int = 2048, precision: str = "bf16",
                              labels: bool = True) -> dict:
    """Analytic bytes autograd saves in one training forward of ``batch`` sequences of ``seq_len`` tokens.

    ``precision``: ``"bf16"`` (the trainer's mixed precision on GPU: fp32 parameters, bf16 autocast) or
    ``"fp32"``. The backbone is Pre-LN with the reference ops (``functional.py``, SDPA attention), per token:

    * every input norm: ``rms_norm_saved_bytes`` + its linear inputs (``linear_input_bytes``: q/k/v, gate/up);
    * attention: q, k, v as SDPA saves them, its output and log-sum-exp (fp32);
    * FFN: gate, up, silu(gate) and the SwiGLU product (compute dtype);
    * final norm + LM-head input; with ``labels`` the loss's fp32 log-softmax ``B T V`` and the shifted labels;
    * once: the input ids, RoPE's cos/sin (fp32) and, under autocast, the bf16 copy of every projection weight;

    plus the design's own term (``Design.extra_activation_bytes(config, batch, seq_len, compute_bytes)``, declared
    in its ``design_<name>.py``; negative where it saves less). Transient workspace (the backward's gradients of
    activations, the attention kernel's scratch) is not included. Tested against ``activation_bytes`` for every
    registered design (tests/test_fit_check.py)."""
    if precision not in PRECISIONS:
        raise ValueError(f"`precision` must be one of {list(PRECISIONS)}, got {precision!r}")
    c, g = PRECISIONS[precision], _dims(config)
    d, f, q, kv, H, hd, V, L = (g[k] for k in ("d", "f", "q", "kv", "H", "hd", "V", "L"))
    N = batch * seq_len
    attn = rms_norm_saved_bytes(d) + linear_input_bytes(d, 3, c) + (q + 2 * kv) * c + q * c + H * 4
    ffn = rms_norm_saved_bytes(d) + linear_input_bytes(d, 2, c) + 4 * f * c
    final = rms_norm_saved_bytes(d) + linear_input_bytes(d, 1, c)
    per_token = L * (attn + ffn) + final
    fixed = 8 * N + 2 * seq_len * hd * STREAM_BYTES
    if c != STREAM_BYTES:  # autocast keeps one bf16 copy of every weight it casts
        fixed += c * (L * (d * q + 2 * d * kv + q * d + 3 * d * f) + d * V)
    loss = (V * 4 + 8) * N if labels else 0
    design = _design(config)
    extra_fn = design.extra_activation_bytes if design is not None else None
    extra = int(extra_fn(config, batch, seq_len, c)) if extra_fn is not None else 0
    total = per_token * N + fixed + loss + extra
    return {"backbone": per_token * N + fixed, "loss": loss, "design": extra, "total": total}


#: DDP: fp32 parameters, fp32 gradients and AdamW's two fp32 moments (the trainer keeps no separate master copy)
TRAINING_STATE_BYTES_PER_PARAM = 16
#: the default device memory of the fit check (an H200), overridden by ``HF_DEPTH_DEVICE_MEMORY_GB``
DEFAULT_DEVICE_GB = 141.0


def device_memory_bytes(gb: float | None = None) -> int:
    """``gb`` GB (10^9 bytes), else ``$HF_DEPTH_DEVICE_MEMORY_GB``, else 141 (H200)."""
    import os

    if gb is None:
        raw = os.environ.get("HF_DEPTH_DEVICE_MEMORY_GB", "").strip()
        try:
            gb = float(raw) if raw else DEFAULT_DEVICE_GB
        except ValueError:
            raise ValueError(f"`HF_DEPTH_DEVICE_MEMORY_GB` must be a number of GB, got {raw!r}") from None
    if not math.isfinite(gb) or gb <= 0:
        raise ValueError(f"device memory must be a positive number of GB, got {gb!r}")
    return int(gb * 1e9)


def fit_check(config, micro_batch: int, seq_len: int, parallel: str = "ddp", world_size: int = 1,
              precision: str = "bf16", device_gb: float | None = None) -> dict:
    """Analytic memory of one training device: saved activations of one micro-batch
    (``analytic_activation_bytes``) + parameters, gradients and AdamW moments (16 bytes per parameter,
    divided by ``world_size`` under ``fsdp2``), against the device memory (``device_memory_bytes``)."""
    from ..shapes import count_params

    if parallel not in ("ddp", "fsdp2"):
        raise ValueError(f"`parallel` must be 'ddp' or 'fsdp2', got {parallel!r}")
    if world_size < 1:
        raise ValueError(f"`world_size` must be >= 1, got {world_size!r}")
    act = analytic_activation_bytes(config, micro_batch, seq_len, precision)["total"]
    params = count_params(config)
    states = TRAINING_STATE_BYTES_PER_PARAM * params // (world_size if parallel == "fsdp2" else 1)
    device = device_memory_bytes(device_gb)
    total = act + states
    return {"micro_batch": micro_batch, "seq_len": seq_len, "params": params, "activation_bytes": act,
            "state_bytes": states, "total_bytes": total, "device_bytes": device, "fits": total <= device}


def fit_line(name: str, fit: dict) -> str:
    """One human line of a ``fit_check`` result (with a WARNING when it does not fit)."""
    gb = 1e9
    text = (f"{name}: micro-batch {fit['micro_batch']} x {fit['seq_len']}: activations {fit['activation_bytes'] / gb:.1f} GB"
            f" + params/grads/AdamW {fit['state_bytes'] / gb:.1f} GB = {fit['total_bytes'] / gb:.1f} GB"
            f" of {fit['device_bytes'] / gb:.0f} GB")
    if not fit["fits"]:
        text += " -- WARNING: does not fit one device (lower train.micro_batch_size, raise train.grad_accum)"
    return text
