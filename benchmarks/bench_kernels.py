"""Each fused op at DepthBench shapes: time and achieved bandwidth of torch eager, torch.compile, Liger-Kernel
(where it has the op) and our Triton kernel, as ratios measured in one run.

    python benchmarks/bench_kernels.py                 # GPU: tokens 8 x 2048, d in {640, 1024, 1216}, S up to 140
    python benchmarks/bench_kernels.py --quick         # tiny shapes (CPU smoke run: the references only)

Bandwidth is the ideal forward traffic (every input read once, every output written once) over the forward
time; compare it with the device's measured copy bandwidth (printed first on GPU). On CPU only the PyTorch
references run: kernel timings need a GPU.
"""

from __future__ import annotations

import argparse
import math

import torch
from bench_model import _sync, timeit

from hf_depth.models import functional as F

N_STREAMS = 4


def cases(d: int, tokens: int, sources: list[int], dtype, device):
    """(name, make_args() -> (args, grad_inputs), forward bytes) for every op at width d."""
    r = lambda *s, scale=1.0: (torch.randn(*s, device=device) * scale).to(dtype).requires_grad_()
    f = lambda *s: torch.randn(*s, device=device).requires_grad_()
    n, e = N_STREAMS, torch.finfo(dtype).bits // 8
    ffn = 16 * math.ceil(8 * d / 3 / 16)
    M = tokens
    yield "rms_norm", lambda: [r(M, d), r(d), 1e-6], 2 * M * d * e
    yield "rms_norm_multi(3)", lambda: [r(M, d), [r(d), r(d), r(d)], 1e-6], 4 * M * d * e
    yield "add_rms_norm", lambda: [r(M, d), r(M, d), r(d), 1e-6], 4 * M * d * e
    yield "swiglu", lambda: [r(M, ffn), r(M, ffn)], 3 * M * ffn * e
    yield "hc_width", lambda: [r(M, n, d), f(M, n, n + 1)], (2 * n + 1) * M * d * e
    yield "hc_depth", lambda: [r(M, n, d), f(M, n), r(M, d)], (2 * n + 1) * M * d * e
    yield "mhc_width", lambda: [r(M, n, d), f(M, n), F.sinkhorn(torch.randn(M, n, n, device=device))
                                .requires_grad_()], (2 * n + 1) * M * d * e
    yield "sinkhorn(20)", lambda: [f(M, n, n), 20], 2 * M * n * n * 4
    k = n * n + 2 * n
    yield "mhc_coefficients", lambda: [r(M, n, d), f(n * d, k), f(3), f(k), 20, 1e-6], M * n * d * e
    for S in sources:
        yield f"depth_softmax(S={S})", lambda S=S: [r(d, scale=0.1), r(d), r(S, M, d), 1e-6], (S + 1) * M * d * e


def _op_name(case: str) -> str:
    return case.split("(")[0]


def liger(name: str):
    """Liger-Kernel's version of ``name`` with our reference's signature, or None."""
    try:
        if name == "rms_norm":
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction

            return lambda x, w, eps: LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama")
        if name == "swiglu":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction

            return LigerSiLUMulFunction.apply
    except ImportError:
        return None
    return None  # Liger's mHC / AttnRes use other layouts: not wired here


def impls(name: str, device, compile_: bool):
    out = {"eager": getattr(F, name)}
    if compile_:
        out["compile"] = torch.compile(getattr(F, name))
    if device.type == "cuda":
        if (lg := liger(name)) is not None:
            out["liger"] = lg
        from hf_depth import kernels

        out["ours"] = getattr(kernels, name)
    return out


def _outputs(y):
    return [t for t in (y if isinstance(y, (tuple, list)) else [y]) if t.requires_grad]


def bench(fn, args, device, repeats):
    leaves = [a for x in args for a in (x if isinstance(x, list) else [x]) if isinstance(a, torch.Tensor)]
    grads = [torch.randn_like(o) for o in _outputs(fn(*args))]

    def fwd():
        with torch.no_grad():
            fn(*args)

    def fwd_bwd():
        torch.autograd.grad(_outputs(fn(*args)), [x for x in leaves if x.requires_grad], grads)

    return timeit(fwd, device, repeats), timeit(fwd_bwd, device, repeats)


def copy_bandwidth(device, nbytes=2**30) -> float:
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    t = timeit(lambda: y.copy_(x), device, 10)
    return 2 * nbytes / t / 1e9


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8 * 2048)
    p.add_argument("--widths", type=int, nargs="+", default=[640, 1024, 1216])
    p.add_argument("--sources", type=int, nargs="+", default=[17, 140], help="AttnRes sources S")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--ops", nargs="*", help="only these ops (names as printed, before any parenthesis)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile (slow to compile on CPU)")
    p.add_argument("--quick", action="store_true", help="tiny shapes, 2 repeats, no compile (a smoke run)")
    a = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if a.quick:
        a.tokens, a.widths, a.sources, a.repeats, a.no_compile = 64, [40], [3, 9], 2, True
    dtype = getattr(torch, a.dtype)
    compile_ = not a.no_compile and device.type == "cuda"
    if device.type != "cuda":
        print("No GPU: timing the PyTorch references only; kernel timings (ours, Liger, compile) need a GPU.")
    else:
        print(f"{torch.cuda.get_device_name()}: measured copy bandwidth {copy_bandwidth(device):.0f} GB/s")
    print(f"tokens={a.tokens} dtype={a.dtype} streams n={N_STREAMS}")
    head = f"{'op':24} {'d':>5} {'impl':8} {'fwd ms':>9} {'GB/s':>7} {'fwd+bwd ms':>11} {'fwd x eager':>12} {'f+b x eager':>12}"
    print(head)
    print("-" * len(head))
    for d in a.widths:
        for name, make, nbytes in cases(d, a.tokens, a.sources, dtype, device):
            if a.ops and _op_name(name) not in a.ops:
                continue
            base = None
            for impl, fn in impls(_op_name(name), device, compile_).items():
                torch.manual_seed(0)
                args = make()
                t_f, t_fb = bench(fn, args, device, a.repeats)
                base = base or (t_f, t_fb)
                print(f"{name:24} {d:5} {impl:8} {t_f * 1e3:9.3f} {nbytes / t_f / 1e9:7.1f} {t_fb * 1e3:11.3f}"
                      f" {base[0] / t_f:12.2f} {base[1] / t_fb:12.2f}")
                _sync(device)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
