"""Triton kernels of the hot, memory-bound ops, each with the name and signature of its PyTorch reference in
``hf_depth.models.functional`` (``hf_depth.models.dispatch`` routes to them on CUDA, or on CPU with
``HF_DEPTH_KERNELS=triton`` under ``TRITON_INTERPRET=1``).

Importing this package imports Triton (so a missing Triton makes ``dispatch`` fall back to the references) but
none of the kernel files: each op's module loads on first use. Every kernel's forward and backward run as
``torch.library`` custom ops (``torch.ops.hf_depth.*``, with fake implementations for torch.compile / FSDP2)
inside a ``torch.autograd.Function``. Derivations: the top-level ``kernels/<op>.md``.
"""

from __future__ import annotations

import importlib

try:  # fail here, at import, when Triton is absent (no wheel for this platform): dispatch then uses the references
    import triton  # noqa: F401  (its version: dispatch.kernel_report())
except ImportError as e:
    raise ImportError(
        "hf_depth.kernels needs Triton (a dependency on Linux x86_64 / aarch64 only); without it every op runs its "
        "PyTorch reference (hf_depth.models.dispatch.kernel_report())"
    ) from e

#: op name -> module ``<module>_op.py`` that implements it (the suffix keeps modules and functions apart)
OPS = {
    "rms_norm": "rms_norm",
    "rms_norm_multi": "rms_norm",
    "add_rms_norm": "add_rms_norm",
    "swiglu": "swiglu",
    "hc_coefficients": "hc",
    "hc_width": "hc",
    "hc_depth": "hc",
    "sinkhorn": "sinkhorn",
    "mhc_coefficients": "mhc",
    "mhc_width": "mhc",
    "mhc_depth": "mhc",
    "depth_softmax": "depth_softmax",
}

__all__ = list(OPS)


def __getattr__(name: str):
    if name not in OPS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    fn = getattr(importlib.import_module(f"{__name__}.{OPS[name]}_op"), name)
    globals()[name] = fn
    return fn
