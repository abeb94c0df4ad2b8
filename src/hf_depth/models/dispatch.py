"""Kernel dispatch: Triton on CUDA, the PyTorch reference (``functional.py``) elsewhere.

``HF_DEPTH_KERNELS=torch|triton|auto`` (default ``auto``) overrides at run time; the choice is never stored in
a config, so a checkpoint never decides whether Triton runs. ``hf_depth.kernels`` is imported lazily, on the
first call that wants it, inside ``try`` (transformers' remote-code loader ignores such imports, so a saved
folder still loads without the package and simply runs the references).

Every op here has the signature of its reference in ``functional.py``; a model is numerically the same function
either way (tested in tests/test_kernels_*.py under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os

import torch

from .functional import REFERENCES

MODES = ("auto", "torch", "triton")
_KERNELS = None
_KERNELS_ERROR = None  # why ``hf_depth.kernels`` could not be imported (e.g. Triton absent), for kernel_report()


_ENV_KEYS: dict = {}  # variable name -> its key in os.environ's own mapping


def env(name: str, default: str | None = None) -> str | None:
    """``os.environ.get(name, default)``, read on every call (a change takes effect at once) but without the
    ``KeyError`` that ``os.environ.get`` raises and catches for an unset variable, the common case: the look-up goes
    to ``os.environ``'s own mapping where it has one (CPython's ``os._Environ``), else to ``os.environ.get``. Hot
    paths (every op's dispatch, every native kernel call) ask."""
    data, codec = getattr(os.environ, "_data", None), getattr(os.environ, "decodevalue", None)
    if data is None or codec is None:
        return os.environ.get(name, default)
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = os.environ.encodekey(name)
    raw = data.get(key)
    return default if raw is None else codec(raw)


def mode() -> str:
    m = env("HF_DEPTH_KERNELS", "auto").strip().lower() or "auto"
    if m not in MODES:
        raise ValueError(f"`HF_DEPTH_KERNELS` must be one of {list(MODES)}, got {m!r}")
    return m


def _kernels():
    global _KERNELS, _KERNELS_ERROR
    if _KERNELS is None:
        try:
            from hf_depth import kernels as k  # lazy: imports triton
        except Exception as e:  # package or triton absent (no wheel for this platform): references only
            cause = f" [{type(e.__cause__).__name__}: {e.__cause__}]" if e.__cause__ else ""
            k, _KERNELS_ERROR = False, f"{type(e).__name__}: {e}{cause}"
        _KERNELS = k
    return _KERNELS


def _reference_only(x: torch.Tensor | None) -> bool:
    """CPU tensors under the default mode: they never leave the references (no mode parsing, no import)."""
    return x is not None and not x.is_cuda and env("HF_DEPTH_KERNELS", "auto") == "auto"


def use_triton(x: torch.Tensor) -> bool:
    """Whether the Triton path serves tensors like ``x`` now."""
    if _reference_only(x):
        return False
    m = mode()
    if m == "torch":
        return False
    ok = x.is_cuda or (m == "triton" and env("TRITON_INTERPRET") == "1")
    if m == "triton":
        if not ok:
            raise RuntimeError("HF_DEPTH_KERNELS=triton needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
        if not _kernels():
            raise RuntimeError(f"HF_DEPTH_KERNELS=triton but hf_depth.kernels / triton cannot be imported ({_KERNELS_ERROR})")
        return True
    return ok and bool(_kernels())


def op(name: str):
    """The implementation of ``name`` for tensors like the first argument: ``op("rms_norm")(x, w, eps)``."""
    ref = REFERENCES[name]

    def call(*args, **kwargs):
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is None:
            x = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if _reference_only(x):
            return ref(*args, **kwargs)
        if x is not None and use_triton(x):
            fn = getattr(_kernels(), name, None)
            if fn is not None:
                return fn(*args, **kwargs)
            if mode() == "triton":
                raise RuntimeError(f"HF_DEPTH_KERNELS=triton but no Triton kernel implements {name!r}")
        return ref(*args, **kwargs)

    call.__name__ = name
    call.__doc__ = ref.__doc__
    return call


# the dispatched ops, by family: each bound under its REFERENCES key (tests/test_kernels.py checks it)
rms_norm, rms_norm_multi, swiglu, add_rms_norm = map(op, ["rms_norm", "rms_norm_multi", "swiglu", "add_rms_norm"])
hc_coefficients, hc_width, hc_depth = map(op, ["hc_coefficients", "hc_width", "hc_depth"])
sinkhorn, mhc_coefficients, mhc_width, mhc_depth = map(op, ["sinkhorn", "mhc_coefficients", "mhc_width", "mhc_depth"])
depth_softmax, moda_attention = map(op, ["depth_softmax", "moda_attention"])


def kernel_report() -> dict:
    """Which implementation serves each op now, for CUDA and for CPU tensors, under the current environment.

    ``{"mode", "triton" (its version, or None), "unavailable" (why the kernels cannot be imported, or None),
    "ops": {op: {"kernel": bool, "cuda": ..., "cpu": ...}}}``: each path is ``"triton"``, ``"reference"`` or
    ``"error"`` (what ``HF_DEPTH_KERNELS=triton`` raises where Triton cannot serve the op). Imports nothing new
    when Triton is absent; ``hf-depth kernels`` prints it. ``"native"``: the native CPU kernels'
    ``hf_depth.native.status()`` (MoDA's depth part on CPU; ``HF_DEPTH_NATIVE=0`` turns them off).
    """
    m = mode()
    k = _kernels()
    ops_with_kernel = set(getattr(k, "OPS", ())) if k else set()
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    ops = {}
    for name in REFERENCES:
        has = name in ops_with_kernel
        if m == "torch":
            cuda = cpu = "reference"
        elif m == "auto":
            cuda, cpu = ("triton" if has else "reference"), "reference"
        else:
            cuda = "triton" if has else "error"
            cpu = "triton" if has and interpret else "error"
        ops[name] = {"kernel": has, "cuda": cuda, "cpu": cpu}
    return {"mode": m, "triton": getattr(getattr(k, "triton", None), "__version__", None) if k else None,
            "unavailable": None if k else _KERNELS_ERROR, "ops": ops, "native": _native_status()}


def _native_status() -> dict:
    """``hf_depth.native.status()``: the native CPU kernels (MoDA's depth part), built on first use."""
    try:
        from hf_depth import native
    except ImportError as e:  # a folder saved for trust_remote_code: no such package, the eager forms run
        return {"enabled": False, "available": False, "why": f"ImportError: {e}", "ops": []}
    return native.status()


def format_kernel_report(report: dict | None = None) -> str:
    """``kernel_report()`` as a few lines of text."""
    r = kernel_report() if report is None else report
    head = f"HF_DEPTH_KERNELS={r['mode']}; triton " + (r["triton"] or f"unavailable ({r['unavailable']})")
    rows = [f"  {name:<17} cuda: {o['cuda']:<9} cpu: {o['cpu']}" for name, o in r["ops"].items()]
    n = r.get("native")
    if n is not None:
        state = "in use" if n["available"] else f"not used ({n['why']})"
        rows.append(f"native CPU kernels ({', '.join(n['ops']) or '-'}): {state}")
    return "\n".join([head, *rows])


def main(argv: list[str] | None = None) -> int:
    """``hf-depth kernels [--json]``: print ``kernel_report()``."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="hf-depth kernels", description=main.__doc__)
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    print(json.dumps(kernel_report(), indent=1) if args.json else format_kernel_report())
    return 0
