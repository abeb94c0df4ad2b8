"""Native CPU kernels: fused C loops for CPU work that eager PyTorch can only do in several memory-bound passes.

``OPS`` lists them: MoDA's depth part (``moda_depth.c``), the per-token scores against the depth K/V banks, their
merge with the sequence softmax and the weighted sum of the depth values, and its backward, reading each bank once
per direction (eager PyTorch streams them four to five times per step, through per-token batched products at a
fraction of the memory bandwidth); HC / mHC's stream mixing, its backward and the write's backward, one pass per
token, and mHC's Sinkhorn with its backward (``stream_mix.c``); AttnRes' depth softmax and weighted sum over the
sources, and their backward, one pass per token (``attnres_agg.c``). ``hf_depth.models.depth_ops`` calls them on CPU
for fp32; the eager forms stay the reference and the fallback (tests compare both).

The C source ships with the package and is compiled on first use with the system C compiler (``$CC``, else
``cc`` / ``gcc`` / ``clang``; ``-O3 -march=native``, no Python or torch headers, loaded with ``ctypes``, which
releases the GIL, so ``torch.get_num_threads()`` threads split the work) into a cache folder
(``$HF_DEPTH_NATIVE_CACHE``, else ``$XDG_CACHE_HOME/hf_depth/native`` or ``~/.cache/hf_depth/native``), keyed by
the source, the compiler, its flags and the CPU, and written atomically. Without a compiler, or when compiling
fails, a warning says why (once) and the eager form runs: the result is the same function either way.

``HF_DEPTH_KERNELS=torch`` (the references only) or ``HF_DEPTH_NATIVE=0`` turn the native path off; ``status()``
(and ``hf-depth kernels``) says whether it is in use and why not. A folder saved for ``trust_remote_code`` does
not carry this package: there the eager form runs.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

SOURCES = ("moda_depth.c", "stream_mix.c", "attnres_agg.c")
#: included by the sources (part of the build key: a change rebuilds)
HEADERS = ("common.h",)
#: the native ops, by what they serve
OPS = {"moda_depth": "MoDA's depth scores, merge and mix, and their backward (depth_ops._MoDAFlash); an FFN's depth "
                     "K/V (split, transposed, the key rotated) and its backward (depth_ops.moda_ffn_depth_kv)",
       "stream_mix": "HC / mHC stream mixing and the write's and the mixing's backward (depth_ops._Route, _Write)",
       "sinkhorn": "mHC's Sinkhorn-Knopp and its backward, per token (design_mhc, through depth_ops.native_stream_op)",
       "hc_route": "dynamic HC's whole routing (1/rms, projection, gates, mixing) and its backward, per token "
                   "(design_hc.HCConnection.fused_route / fused_rebuild / fused_backward)",
       "mhc_route": "mHC's routing after its projection (gates, Sinkhorn, mixing) and its backward up to the "
                    "projection's products (design_mhc.MHCConnection.fused_route / fused_rebuild / fused_backward)",
       "attnres_agg": "AttnRes' depth softmax over the sources (and the running partial sum) and its weighted sum, and "
                      "their backward, per token (depth_ops._TwoPhaseAggregate, _DepthAggregate)"}
_FLAGS = ("-O3", "-fPIC", "-shared", "-std=c99")
_ARCH = ("-march=native",)

_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None | bool = None  # None: not tried; False: unavailable (see _WHY)
_WHY: str | None = None
_POOL: ThreadPoolExecutor | None = None


#: ``HF_DEPTH_NATIVE``: "1" (default) uses the native kernels where they apply, "0" never
NATIVE_VALUES = ("0", "1")


_DECIDED: tuple = ()  # (HF_DEPTH_NATIVE, HF_DEPTH_KERNELS, enabled()) as last read: every native call asks
_ENV = None  # hf_depth.models.dispatch.env, bound on the first call


def enabled() -> bool:
    """Whether the environment allows the native path (it may still be unavailable: ``status()``). Raises
    ``ValueError`` naming the variable for a value of ``HF_DEPTH_NATIVE`` (or ``HF_DEPTH_KERNELS``) it does not know."""
    global _DECIDED, _ENV
    if _ENV is None:
        from hf_depth.models.dispatch import env as _ENV
    raw = (_ENV("HF_DEPTH_NATIVE"), _ENV("HF_DEPTH_KERNELS"))
    if _DECIDED[:2] == raw:
        return _DECIDED[2]
    from hf_depth.models.dispatch import mode

    value = (raw[0] or "1").strip() or "1"
    if value not in NATIVE_VALUES:
        raise ValueError(f"`HF_DEPTH_NATIVE` must be one of {list(NATIVE_VALUES)}, got {value!r}")
    _DECIDED = (*raw, value == "1" and mode() != "torch")
    return _DECIDED[2]


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc.split()[0]):
            return cc
    return None


def _cpu_id() -> str:
    try:  # the CPU's instruction-set flags: an -march=native library never runs on a CPU that lacks them
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def cache_dir() -> Path:
    env = os.environ.get("HF_DEPTH_NATIVE_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hf_depth" / "native"


def _build() -> ctypes.CDLL:
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found ($CC, cc, gcc, clang)")
    here = Path(__file__).parent
    source = b"".join((here / s).read_bytes() for s in (*SOURCES, *HEADERS))
    version = subprocess.run([*cc.split(), "--version"], capture_output=True, text=True, timeout=60).stdout
    errors = []
    for arch in (_ARCH, ()):  # -march=native first; a compiler that does not know it builds generic code
        flags = (*_FLAGS, *arch)
        key = hashlib.sha256(b"\0".join([source, cc.encode(), version.encode(), " ".join(flags).encode(),
                                          _cpu_id().encode()])).hexdigest()[:16]
        folder = cache_dir()
        target = folder / f"hf_depth_native_{key}.so"
        if not target.exists():
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError:
                folder = Path(tempfile.gettempdir()) / "hf_depth_native"
                folder.mkdir(parents=True, exist_ok=True)
                target = folder / target.name
        if not target.exists():
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
            os.close(fd)
            cmd = [*cc.split(), *flags, "-o", tmp, *(str(here / s) for s in SOURCES), "-lm"]
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if run.returncode != 0:
                os.unlink(tmp)
                errors.append(f"{' '.join(cmd)}: {run.stderr.strip()[-400:]}")
                continue
            os.replace(tmp, target)  # atomic: a concurrent process sees the old state or the whole library
        return _bind(ctypes.CDLL(str(target)))
    raise RuntimeError("compiling the native kernels failed: " + " | ".join(errors))


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    P, N, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float  # pointer, integer, float
    lib.hfd_moda_depth_fwd.argtypes = [P, P, P, P, P, P, P, P, P, P, N, N, N, N, N, N, F, N, N]
    lib.hfd_moda_depth_bwd.argtypes = [P, P, P, P, P, P, P, P, P, P, P, P, P, P, P, P, N, N, N, N, N, N, F, N, N]
    lib.hfd_moda_slot_grads.argtypes = [N, P, P, P, P, P, N, N, N, N, N, N, N, N, N, N]
    lib.hfd_stream_mix.argtypes = [P, N, N, N, P, N, N, P, P, N, N, N, N, N, N]
    lib.hfd_stream_mix_bwd.argtypes = [P, N, N, N, P, N, N, P, N, N, P, N, N, P, P, N, N, N, N, N, N]
    lib.hfd_stream_write_bwd.argtypes = [P, N, N, P, N, N, P, N, P, P, N, N, N, N]
    lib.hfd_sinkhorn.argtypes = [P, N, N, N, P, N, N, N, N]
    lib.hfd_sinkhorn_bwd.argtypes = [P, N, N, N, P, P, N, N, N, N]
    lib.hfd_hc_route.argtypes = [P, N, N, P, P, P, P, P, P, F, P, P, P, P, P, P, N, N, N, N]
    lib.hfd_hc_gates.argtypes = [P, P, P, P, P, P, P, N, N, N]
    lib.hfd_hc_rebuild.argtypes = [P, N, N, P, P, P, P, P, P, N, N, P, N, P, N, N, N, N]
    lib.hfd_stream_mix_write.argtypes = [P, N, N, N, P, N, N, P, N, N, P, N, P, N, N, N, N]
    lib.hfd_mhc_route.argtypes = [P, N, N, P, P, F, P, P, N, N, N, P, P, P, P, N, N, N, N]
    lib.hfd_mhc_route_bwd.argtypes = [P, N, N, P, P, P, P, P, N, N, N, P, N, P, N, N, P, P, P, P, N, N, N, N, N]
    lib.hfd_block_sums.argtypes = [P, N, N, P]
    lib.hfd_hc_route_bwd.argtypes = [P, N, N, P, P, P, P, P, P, P, P, P, N, P, N, N, P, P, P, P, N, N, N, N, N]
    lib.hfd_hc_route_bwd_sums.argtypes = [P, P, N, N, N, P]
    lib.hfd_agg_fwd.argtypes = [P, N, P, N, N, P, P, F, P, P, P, P, N, N, N]
    lib.hfd_slot_write.argtypes = [P, N, P, P, F, N, N, N]
    lib.hfd_agg_bwd.argtypes = [P, N, P, N, N, P, P, P, P, P, P, N, P, N, P, N, P, P, N, N, N]
    lib.hfd_moda_kv_write.argtypes = [P, P, P, P, P, P, P, N, N, N, N, N]
    lib.hfd_moda_kv_grad.argtypes = [P, P, P, P, P, P, P, P, N, N, N, N, N]
    lib.hfd_exp_shift_rows.argtypes = [P, P, F, N]
    for fn in (lib.hfd_moda_depth_fwd, lib.hfd_moda_depth_bwd, lib.hfd_moda_slot_grads, lib.hfd_stream_mix,
               lib.hfd_stream_mix_bwd, lib.hfd_stream_write_bwd, lib.hfd_sinkhorn, lib.hfd_sinkhorn_bwd,
               lib.hfd_hc_route, lib.hfd_hc_gates, lib.hfd_hc_rebuild, lib.hfd_hc_route_bwd, lib.hfd_hc_route_bwd_sums,
               lib.hfd_stream_mix_write, lib.hfd_mhc_route, lib.hfd_mhc_route_bwd, lib.hfd_block_sums,
               lib.hfd_agg_fwd, lib.hfd_agg_bwd, lib.hfd_slot_write, lib.hfd_moda_kv_write, lib.hfd_moda_kv_grad,
               lib.hfd_exp_shift_rows):
        fn.restype = ctypes.c_int
    lib.hfd_moda_items.argtypes, lib.hfd_moda_grad_items.argtypes = [N, N, N], [N, N]
    lib.hfd_moda_items.restype = lib.hfd_moda_grad_items.restype = N
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled library, or None (disabled, or unavailable: ``status()`` says why; warned once)."""
    global _LIB, _WHY
    if not enabled():
        return None
    if _LIB is None:
        with _LOCK:
            if _LIB is None:
                try:
                    _LIB = _build()
                except Exception as e:  # no compiler, a failed build, an unwritable cache: the eager form runs
                    _LIB, _WHY = False, f"{type(e).__name__}: {e}"
                    warnings.warn(f"hf_depth native CPU kernels unavailable, using the PyTorch forms ({_WHY})",
                                  RuntimeWarning, stacklevel=2)
    return _LIB or None


def status() -> dict:
    """``{"enabled", "available", "why"}`` for the native path, building it if enabled and not yet tried."""
    on = enabled()
    lib = library() if on else None
    why = None if lib is not None else ("disabled (HF_DEPTH_NATIVE=0 or HF_DEPTH_KERNELS=torch)" if not on else _WHY)
    return {"enabled": on, "available": lib is not None, "why": why, "ops": list(OPS)}


def _parallel(fn, items: int, min_items: int = 8) -> None:
    """``fn(lo, hi)`` over [0, items), split over ``torch.get_num_threads()`` threads (ctypes drops the GIL)."""
    global _POOL
    threads = min(torch.get_num_threads(), items // min_items)
    if threads <= 1:
        _check(fn(0, items))
        return
    if _POOL is None or _POOL._max_workers < threads:
        _POOL = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="hf_depth_native")
    bounds = [items * i // threads for i in range(threads + 1)]
    for f in [_POOL.submit(fn, lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]:
        _check(f.result())


def _check(rc: int) -> None:
    if rc != 0:
        raise MemoryError("hf_depth native kernel: workspace allocation failed")


def _ptr(t: torch.Tensor | None):
    """A tensor's data pointer for a ``c_void_p`` argument (``argtypes`` convert the int; None: NULL)."""
    return None if t is None else t.data_ptr()


def _strides(t: torch.Tensor):
    return (ctypes.c_int64 * t.dim())(*t.stride())


def moda_depth_supported(q, K, V, o, lse, live) -> bool:
    """Whether the native MoDA depth kernel takes these (fp32 CPU tensors in its layouts; see ``moda_depth.c``)."""
    B, H, T, hd = q.shape
    D, Hkv = K.shape[0], K.shape[2]
    return (all(t.is_cpu and t.dtype == torch.float32 for t in (q, K, V, o, lse))
            and K.shape == V.shape == (D, B, Hkv, T, hd) and H % Hkv == 0 and K.stride(-1) == V.stride(-1) == 1
            and o.shape == (B, T, H, hd) and o.is_contiguous() and lse.shape == (B, H, T)
            and (live is None or (live.shape == (D,) and live.dtype == torch.uint8 and live.is_contiguous())))


def _moda_min_items(T: int, D: int) -> int:
    """Fewest work items per thread of the MoDA depth kernels: an item is a (b, kv head) and up to 128 tokens, so a
    training item (T D >= 2048 slot rows) is worth a thread; a decoding step's are not."""
    return 1 if T * D >= 2048 else 8


def moda_depth_forward(q, K, V, o, lse, live, scaling: float) -> None:
    """In place: ``o`` [B, T, H, hd] and ``lse`` [B, H, T] (the sequence attention's; any strides) become the joint
    softmax's over [sequence | the depth slots of K, V [D, B, Hkv, T, hd] (any strides, the last 1)]; ``live`` [D]
    uint8 or None."""
    lib = library()
    B, H, T, hd = q.shape
    D, Hkv = K.shape[0], K.shape[2]
    sq, sl = _strides(q), _strides(lse)
    args = (_ptr(q), sq, _ptr(K), _strides(K), _ptr(V), _strides(V), _ptr(o), _ptr(lse), sl, _ptr(live), D, B, H,
            Hkv, T, hd, scaling)
    _parallel(lambda lo, hi: lib.hfd_moda_depth_fwd(*args, lo, hi), lib.hfd_moda_items(B, Hkv, T), _moda_min_items(T, D))


def moda_depth_backward(q, dout, dq, K, V, o, lse, live, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: ``dq`` [B, H, T, hd] += the depth part of the query gradient. Returns (p, dd) [D, B, H, T]: the
    depth probabilities and score gradients, from which ``moda_slot_grads`` sums the slots' gradients once.
    ``o``, ``lse``: the joint output and log-sum-exp; ``dout`` [B, H, T, hd] the output gradient (fp32)."""
    lib = library()
    B, H, T, hd = q.shape
    D, Hkv = K.shape[0], K.shape[2]
    if not (dout.dtype == dq.dtype == torch.float32 and dq.shape == dout.shape == q.shape):
        raise ValueError("moda_depth_backward: dq and dout must be fp32 tensors of q's shape")
    p, dd = (torch.empty((D, B, H, T), dtype=torch.float32) for _ in range(2))
    sq, sd, sg, sl = _strides(q), _strides(dout), _strides(dq), _strides(lse)
    args = (_ptr(q), sq, _ptr(dout), sd, _ptr(dq), sg, _ptr(K), _strides(K), _ptr(V), _strides(V), _ptr(o),
            _ptr(lse), sl, _ptr(live), _ptr(p), _ptr(dd), D, B, H, Hkv, T, hd, scaling)
    _parallel(lambda lo, hi: lib.hfd_moda_depth_bwd(*args, lo, hi), lib.hfd_moda_items(B, Hkv, T), _moda_min_items(T, D))
    return p, dd


def _positions(cos, sin, B: int, T: int, hd: int):
    """(cos, sin, strides) for the kernels' [B, T, hd] tables (a batch of 1 broadcasts: stride 0), or False where
    they do not fit (another shape, dtype or device, a last stride other than 1, cos and sin strided apart)."""
    if cos is None:
        return None, None, None
    ok = all(t.is_cpu and t.dtype == torch.float32 and t.dim() == 3 and t.shape[0] in (1, B) and t.shape[1:] == (T, hd)
             and t.stride(-1) == 1 for t in (cos, sin)) and cos.stride() == sin.stride()
    if not ok:
        return False
    st = cos.stride()
    return cos, sin, (ctypes.c_int64 * 3)(0 if cos.shape[0] == 1 else st[0], st[1], 1)


def exp_shift(x: torch.Tensor, m: float = 0.0) -> torch.Tensor:
    """e^(x - m) for a 1-D fp32 CPU tensor, by the vector exponential of MoDA's native depth softmax
    (``hfd_exp_shift`` in ``common.h``, whose ``hfd_exp8`` is also the stream kernels' tanh's): the tests hold it to
    expf's accuracy and its edges (0 below -88 and for -inf, NaN kept)."""
    if not (x.dim() == 1 and x.dtype == torch.float32 and x.is_cpu):
        raise ValueError(f"exp_shift: x must be a 1-D fp32 CPU tensor, got {list(x.shape)} {x.dtype} on {x.device}")
    lib = library()
    if lib is None:
        raise RuntimeError(f"exp_shift needs the native kernels, which are not in use: {status()['why']}")
    x = x.contiguous()
    y = torch.empty_like(x)
    _check(lib.hfd_exp_shift_rows(_ptr(x), _ptr(y), m, x.numel()))
    return y


def moda_kv_supported(kv: torch.Tensor, kv_heads: int, cos=None, sin=None) -> bool:
    """Whether ``moda_kv_write`` takes these: fp32 CPU ``kv`` [B, T, 2 Hkv hd] (last stride 1, hd even) and, where
    given, fp32 CPU ``cos``, ``sin`` [B or 1, T, hd] with the same strides, the last 1."""
    if kv.dim() != 3 or kv_heads < 1 or kv.shape[-1] % (2 * kv_heads):
        return False
    B, T, width = kv.shape
    hd = width // (2 * kv_heads)
    return (kv.is_cpu and kv.dtype == torch.float32 and kv.stride(-1) == 1 and hd % 2 == 0
            and _positions(cos, sin, B, T, hd) is not False)


def moda_kv_write(kv: torch.Tensor, kv_heads: int, cos=None, sin=None, checked: bool = False):
    """(K, V) [B, Hkv, T, hd] contiguous from an FFN's ``kv_proj`` output ``kv`` [B, T, 2 Hkv hd] (rows [k | v]), K
    rotated by RoPE at the token's position where ``cos``, ``sin`` [B or 1, T, hd] are given (``rotate``'s values,
    bit for bit), in one pass; None where the kernel declines the tensors (``moda_kv_supported``; ``checked``: the
    caller has asked it already)."""
    if not (checked or moda_kv_supported(kv, kv_heads, cos, sin)):
        return None
    lib = library()
    B, T, width = kv.shape
    hd = width // (2 * kv_heads)
    cos, sin, sc = _positions(cos, sin, B, T, hd)
    K, V = (torch.empty((B, kv_heads, T, hd), dtype=torch.float32) for _ in range(2))
    s = (ctypes.c_int64 * 4)(kv.stride(0), kv.stride(1), kv_heads * hd, hd)
    args = (_ptr(kv), s, _ptr(cos), _ptr(sin), sc, _ptr(K), _ptr(V), T, kv_heads, hd)
    _parallel(lambda lo, hi: lib.hfd_moda_kv_write(*args, lo, hi), B * T, min_items=256)
    return K, V


def moda_kv_grad(gK, gV, cos, sin, B: int, T: int, kv_heads: int, hd: int):
    """``moda_kv_write``'s backward: the gradient [B, T, 2 Hkv hd] of ``kv`` from those of K and V ([B, Hkv, T, hd],
    either None for zero; fp32 CPU, the last stride 1) and the forward's ``cos``, ``sin``."""
    pos = _positions(cos, sin, B, T, hd)
    grads = [g for g in (gK, gV) if g is not None]
    if pos is False or not all(g.is_cpu and g.dtype == torch.float32 and g.shape == (B, kv_heads, T, hd)
                               and g.stride(-1) == 1 for g in grads):
        raise ValueError(f"moda_kv_grad: gK and gV must be fp32 CPU tensors [{B}, {kv_heads}, {T}, {hd}] with a last "
                         "stride of 1, and cos, sin the forward's tables")
    lib = library()
    g = torch.empty((B, T, 2 * kv_heads * hd), dtype=torch.float32)
    sk, sv = (None if x is None else _strides(x) for x in (gK, gV))
    args = (_ptr(gK), sk, _ptr(gV), sv, _ptr(pos[0]), _ptr(pos[1]), pos[2], _ptr(g), T, kv_heads, hd)
    _parallel(lambda lo, hi: lib.hfd_moda_kv_grad(*args, lo, hi), B * T, min_items=256)
    return g


class SlotGrads:
    """The depth-slot gradients of one bank in one backward: each native consumer ``add`` s its (weights
    [D_i, B, H, T], x [B, H, T, hd]) -- (dd, q) for keys, (p, dO) for values (MoDA); (p, dO) with B = H = 1 and the
    tokens as T (AttnRes) -- and a slot's first reader asks ``grads(lo, hi)``: sum_i sum_(heads of a kv head)
    weights_i[j] x_i for slots [lo, hi) (no per-consumer read and write of the whole gradient bank).

    Without ``into``, every record is kept until its slots are asked for, and each ask's slots are written once into a
    fresh [hi - lo, B, Hkv, T, hd] fp32 buffer (MoDA: its consumers' q is saved for backward anyway; one buffer of the
    bank's size, written slot by slot over the backward, took a fresh 16 MB at L = 32, d = 256, T = 128, B = 2: up
    to ~4k page faults per bank and step, and every row written into a cold line; a pair's 512 KB comes back from
    the allocator still in cache). With ``into``
    (the bank's gradient accumulator, [capacity, B, Hkv, T, hd] fp32 contiguous, where eager consumers add in place),
    at most ``group`` records are pending: the group is then added into the accumulator in one pass (each slot row
    read and written once per group, not once per consumer), and ``grads`` adds the pending records' part of slots
    [lo, hi) and returns the accumulator's rows. Slots handed on are never added to again (a consumer whose backward
    runs later reads only earlier slots), so a flush stops below the lowest slot handed on: extra memory is
    ``group`` records, whatever the depth."""

    def __init__(self, bank_shape, into: torch.Tensor | None = None, group: int = 8):
        self.shape = tuple(bank_shape)
        if into is not None and (tuple(into.shape) != self.shape or not into.is_contiguous()
                                 or into.dtype != torch.float32 or group < 1):
            raise ValueError(f"SlotGrads: into must be a contiguous fp32 {list(self.shape)} accumulator and "
                             f"group >= 1, got {list(into.shape)} {into.dtype} and group {group}")
        self.into, self.group = into, group
        self.limit = self.shape[0]  # slots [limit, capacity) are handed on: never added to again
        self._clear()

    def _clear(self) -> None:
        self.keep, self.w, self.x, self.n_slots, self.strides = [], [], [], [], []

    def add(self, w: torch.Tensor, x: torch.Tensor) -> None:
        _, B, Hkv, T, hd = self.shape
        if not (w.is_contiguous() and w.dtype == x.dtype == torch.float32 and w.is_cpu and x.is_cpu
                and w.shape[1:] == x.shape[:3] and x.shape[0] == B and x.shape[2] == T and x.shape[3] == hd
                and x.shape[1] % Hkv == 0 and (not self.keep or x.shape[1] == self.keep[0][1].shape[1])):
            raise ValueError(f"SlotGrads.add: weights [D, B, H, T] contiguous fp32 and x [B, H, T, hd] fp32 (the same H "
                             f"for every consumer) for a bank {list(self.shape)}, got {list(w.shape)} and {list(x.shape)}")
        self.keep.append((w, x))
        self.w.append(w.data_ptr())
        self.x.append(x.data_ptr())
        self.n_slots.append(w.shape[0])
        self.strides.extend(x.stride())
        if self.into is not None and len(self.keep) >= self.group:
            top = min(self.limit, max(self.n_slots))
            self._sum(self.into[:top], 0, top, accumulate=True)
            self._clear()

    def grads(self, lo: int, hi: int) -> torch.Tensor:
        """[hi - lo, B, Hkv, T, hd] fp32 (zeros for a slot no consumer read): a view of ``into``, else a fresh buffer."""
        if self.into is not None:
            G = self.into[lo:hi]
            self._sum(G, lo, hi, accumulate=True)
            self.limit = min(self.limit, lo)
            return G
        G = torch.empty((max(hi - lo, 0), *self.shape[1:]), dtype=torch.float32)
        if hi > lo:
            if self.keep:
                self._sum(G, lo, hi, accumulate=False)
            else:
                G.zero_()
        return G

    def _sum(self, G: torch.Tensor, lo: int, hi: int, accumulate: bool) -> None:
        """``G`` (slots [lo, hi): ``into``'s rows or a fresh buffer) := (or, ``accumulate``, +=) the kept records' sums
        (``hfd_moda_slot_grads``)."""
        if hi <= lo or not self.keep:
            return
        _, B, Hkv, T, hd = self.shape
        lib, n = library(), len(self.w)
        H = self.keep[0][1].shape[1]
        args = (n, (ctypes.c_void_p * n)(*self.w), (ctypes.c_int64 * n)(*self.n_slots), (ctypes.c_void_p * n)(*self.x),
                (ctypes.c_int64 * (4 * n))(*self.strides), _ptr(G), lo, hi, B, H, Hkv, T, hd,
                int(accumulate))
        _parallel(lambda a, b: lib.hfd_moda_slot_grads(*args, a, b), lib.hfd_moda_grad_items(B, T), min_items=1)


def moda_slot_grads(weights, xs, lo: int, hi: int, kv_heads: int) -> torch.Tensor:
    """``SlotGrads.grads`` of the consumers (weights[i], xs[i]) for slots [lo, hi) (a fresh buffer)."""
    B, H, T, hd = xs[0].shape
    acc = SlotGrads((max(w.shape[0] for w in weights), B, kv_heads, T, hd))
    for w, x in zip(weights, xs):
        acc.add(w, x)
    return acc.grads(lo, hi)


# --------------------------------------------------------------------------- HC / mHC stream mixing (stream_mix.c)
def _token_view(t: torch.Tensor):
    """(tensor, token, row and column strides, tokens) of ``t`` [..., a, b] read as [tokens, a, b]: ``t`` itself where
    it is contiguous (its pointer is what the kernel reads: no view op), else a view; None where the strides allow
    none."""
    a, b = t.shape[-2:]
    if t.is_contiguous():
        tok = t.numel() // (a * b) if a * b else 0
        return t, a * b if tok > 1 else 0, b, 1, tok
    flat = _flat(t)
    return None if flat is None else (flat, flat.stride(0) if flat.shape[0] > 1 else 0, flat.stride(1),
                                      flat.stride(2), flat.shape[0])


def _token_rows(t: torch.Tensor | None, rows: int, width: int, copy: bool = False):
    """(tensor, token stride, row stride, tokens) of ``t`` [..., rows, width] read as [tokens, rows, width] without a
    copy (fp32 CPU, the last dim contiguous; ``_token_view``), else None; ``copy``: a contiguous copy where the
    strides allow no view."""
    if copy:
        return _token_rows(t, rows, width) or (None if t is None else _token_rows(t.contiguous(), rows, width))
    if t is None or t.dtype != torch.float32 or not t.is_cpu or t.shape[-2:] != (rows, width):
        return None
    if t.dim() == 2:
        return (t, 0, t.stride(0), 1) if t.stride(-1) == 1 or width == 1 else None
    v = _token_view(t)
    return None if v is None or (v[3] != 1 and width > 1) else (v[0], v[1], v[2], v[4])


def _vec_rows(t: torch.Tensor | None, width: int, copy: bool = False):
    """``_token_rows(t.unsqueeze(-2), 1, width, copy)`` of per-token vectors ``t`` [..., width], without the view for
    a contiguous ``t`` (the common case)."""
    if copy:
        return _vec_rows(t, width) or (None if t is None else _vec_rows(t.contiguous(), width))
    if (t is not None and t.dim() > 1 and t.is_contiguous() and t.dtype == torch.float32 and t.is_cpu
            and t.shape[-1] == width):
        tok = t.numel() // width
        return t, width if tok > 1 else 0, width, tok
    return None if t is None else _token_rows(t.unsqueeze(-2), 1, width)


def _flat(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` [..., a, b] as a [tokens, a, b] view, or None where its strides allow no view."""
    try:
        return t.view(-1, *t.shape[-2:])
    except RuntimeError:
        return None


def _matrices(M: torch.Tensor, lead: torch.Size):
    """(tensor, token, row and column strides, tokens) of the fp32 CPU matrices M [*lead, r, n] (any strides; or
    [r, n], one for every token) read as [tokens, r, n] without a copy (``_token_view``), else None."""
    if M.dtype != torch.float32 or not M.is_cpu:
        return None
    if M.dim() == 2:
        return M, 0, M.stride(0), M.stride(1), 1
    return _token_view(M) if M.shape[:-2] == lead else None


def stream_mix(M: torch.Tensor, H: torch.Tensor, split: int) -> tuple[torch.Tensor, ...] | None:
    """``M H`` per token for M [..., r, n] (fp32; or [r, n], one for every token) and streams H [..., n, d] (fp32),
    as ``functional.mix_streams`` forms it (its rows bit for bit), in one pass per token. ``split`` 0: returns
    (out [..., r, d],); 1: (row 0 [..., d], rows 1.. [..., r - 1, d]) on their own storage (``read_and_mix``).
    None when the kernel does not take these tensors (the caller runs the eager form)."""
    lib = library()
    r, n, d = M.shape[-2], H.shape[-2], H.shape[-1]
    h = _token_rows(H, n, d)
    m = _matrices(M, H.shape[:-2])
    if lib is None or h is None or m is None or M.shape[-1] != n:
        return None
    lead, tok = H.shape[:-2], h[3]
    if split:
        outs = (torch.empty(*lead, d, dtype=torch.float32), torch.empty(*lead, r - 1, d, dtype=torch.float32))
    else:
        outs = (torch.empty(*lead, r, d, dtype=torch.float32),)
    o0, o1 = (None, outs[0]) if not split else outs
    args = (_ptr(m[0]), m[1], m[2], m[3], _ptr(h[0]), h[1], h[2], _ptr(o0), _ptr(o1), split, r, n, d)
    _parallel(lambda lo, hi: lib.hfd_stream_mix(*args, lo, hi), tok)
    return outs


#: the most rows (r) and streams (n) ``stream_mix_backward`` takes (``stream_mix.c``'s SM_MAX_ROWS; more: eager)
MAX_STREAM_ROWS = 16


def stream_mix_backward(M: torch.Tensor, H: torch.Tensor, G0: torch.Tensor | None, G1: torch.Tensor):
    """The backward of ``[G0-rows; G1-rows] = M H`` per token: (dM [tokens, r, n], dH [..., n, d]) fp32, given the
    gradients of the first ``r0`` rows G0 [..., r0, d] (None: no such rows) and of the others G1 [..., r - r0, d].
    None when the kernel does not take these tensors."""
    lib = library()
    r, n, d = M.shape[-2], H.shape[-2], H.shape[-1]
    r0 = 0 if G0 is None else G0.shape[-2]
    h, b = _token_rows(H, n, d), _token_rows(G1, r - r0, d)
    a = (None, 0, 0, 0) if G0 is None else _token_rows(G0, r0, d)
    m = _matrices(M, H.shape[:-2])
    if lib is None or None in (h, a, b, m) or M.shape[-1] != n or max(r, n) > MAX_STREAM_ROWS:
        return None
    tok = h[3]
    dM, dH = torch.empty(tok, r, n, dtype=torch.float32), torch.empty(H.shape, dtype=torch.float32)
    args = (_ptr(m[0]), m[1], m[2], m[3], _ptr(h[0]), h[1], h[2], _ptr(a[0]), a[1], a[2], _ptr(b[0]), b[1],
            b[2], _ptr(dM), _ptr(dH), r0, r, n, d)
    _parallel(lambda lo, hi: lib.hfd_stream_mix_bwd(*args, lo, hi), tok)
    return dM, dH


def stream_write_backward(w: torch.Tensor, dH: torch.Tensor, y: torch.Tensor):
    """The backward of H' = mixed + w y per token (w [..., n] or [n], y [..., d], dH [..., n, d], fp32):
    (dy [..., d], dw [..., n], per token). None when the kernel does not take these tensors."""
    lib = library()
    n, d = dH.shape[-2], dH.shape[-1]
    g, yt = _token_rows(dH, n, d), _vec_rows(y, d)
    wt = _vec_rows(w, n) if w.dim() > 1 else (w, 0, 0, 1) if w.dtype == torch.float32 else None
    if lib is None or None in (g, yt, wt) or y.shape[:-1] != dH.shape[:-2] or w.stride(-1) != 1 and n > 1:
        return None
    tok = g[3]
    dy, dw = torch.empty(y.shape, dtype=torch.float32), torch.empty(dH.shape[:-1], dtype=torch.float32)
    args = (_ptr(wt[0]), wt[1], w.stride(-1), _ptr(g[0]), g[1], g[2], _ptr(yt[0]), yt[1], _ptr(dy), _ptr(dw), n, d)
    _parallel(lambda lo, hi: lib.hfd_stream_write_bwd(*args, lo, hi), tok)
    return dy, dw


def _logit_matrices(L: torch.Tensor):
    """``_matrices`` of per-token logits [..., n, n] (at least one leading dim: a 2-d L is not one per token)."""
    return _matrices(L, L.shape[:-2]) if L.dim() >= 3 else None


def _run_tokens(fn, tok: int, min_items: int = 8) -> bool:
    """``fn(lo, hi)`` over the tokens (or blocks of them), split over threads as ``_parallel``; False when some part
    returned 1 (out of the kernel's range; another nonzero status is a failed allocation: raised)."""
    status = []

    def part(lo, hi):
        status.append(fn(lo, hi))
        return 0 if status[-1] == 1 else status[-1]

    _parallel(part, tok, min_items)
    return 1 not in status


def sinkhorn(logits: torch.Tensor, iters: int) -> torch.Tensor | None:
    """Sinkhorn-Knopp of fp32 logits [..., n, n] (rows normalized first, ``iters`` times rows then columns), as
    ``design_mhc.sinkhorn_iterates`` to fp32 rounding, contiguous. None when the kernel does not take these logits:
    not fp32 CPU, or some token's logits spanning more than ``stream_mix.c``'s SK_RANGE (the log-domain form then
    keeps the tiny entries the linear domain would lose)."""
    lib, m = library(), _logit_matrices(logits)
    if lib is None or m is None or logits.shape[-1] != logits.shape[-2] or iters < 1:
        return None
    n, tok = logits.shape[-1], m[4]
    res = torch.empty(logits.shape, dtype=torch.float32)
    ok = _run_tokens(lambda lo, hi: lib.hfd_sinkhorn(_ptr(m[0]), m[1], m[2], m[3], _ptr(res), n, iters, lo, hi), tok)
    return res if ok else None


def sinkhorn_backward(dres: torch.Tensor, logits: torch.Tensor, iters: int) -> torch.Tensor | None:
    """The gradient of the logits of ``sinkhorn(logits, iters)`` given that of its result ``dres`` (exact through
    every iteration; the iterates recomputed per token, nothing saved), contiguous fp32; None as ``sinkhorn``."""
    lib, m = library(), _logit_matrices(logits)
    if lib is None or m is None or dres.shape != logits.shape or dres.dtype != torch.float32 or iters < 1:
        return None
    n, tok = logits.shape[-1], m[4]
    g, dL = dres.contiguous(), torch.empty(logits.shape, dtype=torch.float32)
    ok = _run_tokens(lambda lo, hi: lib.hfd_sinkhorn_bwd(_ptr(m[0]), m[1], m[2], m[3], _ptr(g), _ptr(dL), n, iters,
                                                        lo, hi), tok)
    return dL if ok else None


# --------------------------------------------------------------------------- dynamic HC's routing (stream_mix.c)
#: the most streams ``hc_route`` takes (``stream_mix.c``'s HC_MAX_STREAMS; more: the eager form)
MAX_HC_STREAMS = 8
#: tokens per partial sum of ``hc_route_backward``'s parameter gradients: threads take whole blocks, so the thread
#: count changes no bit
HC_SUM_BLOCK = 64


def _f32(t) -> torch.Tensor:
    """``t`` as an fp32 contiguous CPU tensor for a kernel's pointer: itself when it is one (no op), else a copy (a
    Python number: a one-element tensor)."""
    if not isinstance(t, torch.Tensor):
        return torch.tensor([float(t)], dtype=torch.float32)
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.detach().float().contiguous()


def _hc_params(W, static_alpha, static_beta, alpha_scale, beta_scale, n: int, d: int):
    """(W_a, w_b, sa, sb, alpha_scale, beta_scale) for the projections W = (W_a [d, n + 1], w_b [d]) as the module holds
    them (the kernels form [W_a | w_b]^T themselves), (sa, ..., beta_scale) for W None (not needed); fp32
    contiguous, the two gate scales one element each (read through their pointers); or None for shapes the kernels
    do not take."""
    if static_alpha.shape != (n, n + 1) or static_beta.shape != (n,):
        return None
    gates = (_f32(static_alpha), _f32(static_beta), _f32(alpha_scale), _f32(beta_scale))
    if gates[2].numel() != 1 or gates[3].numel() != 1:
        return None
    if W is None:
        return gates
    if W[0].shape != (d, n + 1) or W[1].shape != (d,):
        return None
    return (_f32(W[0]), _f32(W[1]), *gates)


def _hc_inputs(H, W, static_alpha, static_beta, alpha_scale, beta_scale):
    """(library, H's token rows, ``_hc_params``) for the HC kernels, or None where they do not take these."""
    lib = library()
    n, d = H.shape[-2], H.shape[-1]
    if lib is None or n > MAX_HC_STREAMS:
        return None
    h = _token_rows(H, n, d)
    prm = None if h is None else _hc_params(W, static_alpha, static_beta, alpha_scale, beta_scale, n, d)
    return None if prm is None else (lib, h, prm)


def hc_route(H: torch.Tensor, W_a: torch.Tensor, w_b: torch.Tensor, static_alpha, static_beta, alpha_scale,
             beta_scale, eps: float):
    """Dynamic HC's routing of streams H [..., n, d] (fp32) in one pass per token (``stream_mix.c``): returns
    (x [..., d], mixed [..., n, d], A [..., n, n + 1], beta [..., n], r [..., n, 1], P [..., n, n + 2]) with
    r = 1 / rms(H), P = (H WT^T) r for WT = [W_a | w_b]^T (W_a [d, n + 1], w_b [d]),
    A = static_alpha + alpha_scale tanh(P[..., :n + 1]), beta = static_beta + beta_scale tanh(P[..., n + 1]), x = A[..., 0]^T H and mixed = A[..., 1:]^T H: the function
    of ``HCConnection.routing_saved`` and ``read_and_mix`` (to fp32 rounding; the mixing's rows formed as
    ``mix_streams`` forms them from A). None when the kernel does not take these tensors."""
    got = _hc_inputs(H, (W_a, w_b), static_alpha, static_beta, alpha_scale, beta_scale)
    if got is None:
        return None
    lib, h, prm = got
    n, d, lead, tok = H.shape[-2], H.shape[-1], H.shape[:-2], h[3]
    x, mixed, A, beta, r, P = (torch.empty(*lead, *shape, dtype=torch.float32)
                               for shape in ((d,), (n, d), (n, n + 1), (n,), (n, 1), (n, n + 2)))
    args = (_ptr(h[0]), h[1], h[2], *(_ptr(t) for t in prm), eps,
            *(_ptr(t) for t in (x, mixed, A, beta, r, P)), n, d)
    _parallel(lambda lo, hi: lib.hfd_hc_route(*args, lo, hi), tok)
    return x, mixed, A, beta, r, P


def hc_mixing(P: torch.Tensor, static_alpha, static_beta, alpha_scale, beta_scale):
    """(M = A^T [..., n + 1, n], beta [..., n]) from the saved P [..., n, n + 2] of ``hc_route``, formed as it
    formed them (the same bits), or None."""
    lib = library()
    n = P.shape[-2]
    prm = _hc_params(None, static_alpha, static_beta, alpha_scale, beta_scale, n, 0)
    if lib is None or prm is None or P.dtype != torch.float32 or not P.is_contiguous() or n > MAX_HC_STREAMS:
        return None
    M, beta = torch.empty(*P.shape[:-2], n + 1, n, dtype=torch.float32), torch.empty(P.shape[:-1], dtype=torch.float32)
    args = (_ptr(P), *(_ptr(t) for t in prm), _ptr(M), _ptr(beta), n)
    _parallel(lambda lo, hi: lib.hfd_hc_gates(*args, lo, hi), P[..., 0, 0].numel())
    return M, beta


def hc_rebuild(H: torch.Tensor, P: torch.Tensor, static_alpha, static_beta, alpha_scale, beta_scale, w, y):
    """The streams after the sublayer whose ``hc_route`` of H [..., n, d] saved P: its mixing, formed from P as the
    route formed it, plus w [..., n] ⊗ y [..., d] (the write), each row as ``write_streams`` adds it in place: the
    forward's streams, bit for bit, in one pass per token. None when the kernel does not take these tensors."""
    lib = library()
    n, d = H.shape[-2], H.shape[-1]
    h, yt = _token_rows(H, n, d), _vec_rows(y, d)
    wt = _vec_rows(w, n)
    prm = _hc_params(None, static_alpha, static_beta, alpha_scale, beta_scale, n, d)
    if (lib is None or None in (h, yt, wt, prm) or n > MAX_HC_STREAMS or P.dtype != torch.float32
            or not P.is_contiguous() or P.shape != (*H.shape[:-2], n, n + 2) or y.shape[:-1] != H.shape[:-2]
            or w.shape != H.shape[:-1]):
        return None
    out = torch.empty(H.shape, dtype=torch.float32)
    args = (_ptr(h[0]), h[1], h[2], _ptr(P), *(_ptr(t) for t in prm), _ptr(wt[0]), wt[1],
            w.stride(-1), _ptr(yt[0]), yt[1], _ptr(out), n, d)
    _parallel(lambda lo, hi: lib.hfd_hc_rebuild(*args, lo, hi), h[3])
    return out


def hc_route_backward(H, W_a, w_b, static_alpha, static_beta, alpha_scale, beta_scale, r, P, dx, dmixed, dbeta):
    """The backward of ``hc_route`` through its recomputed gates, one pass per token: (dH [H's shape], d W_a [d,
    n + 1], d w_b [d], d static_alpha [n, n + 1], d static_beta [n], d alpha_scale [], d beta_scale []), fp32, given the
    gradients of x (dx [..., d]), of mixed (dmixed [..., n, d]) and of beta (dbeta [..., n]) and the saved r, P
    (contiguous). The parameter gradients are sums over the tokens, in blocks of ``HC_SUM_BLOCK`` tokens summed in
    block order (the thread count changes no bit), laid out as the parameters (views of one buffer). None when the
    kernel does not take these tensors."""
    got = _hc_inputs(H, (W_a, w_b), static_alpha, static_beta, alpha_scale, beta_scale)
    if got is None:
        return None
    lib, h, prm = got
    n, d = H.shape[-2], H.shape[-1]
    a, b = _vec_rows(dx, d, copy=True), _token_rows(dmixed, n, d, copy=True)
    db = _f32(dbeta)
    if a is None or b is None or not (r.is_contiguous() and P.is_contiguous()):
        return None
    tok = h[3]
    blocks = -(-tok // HC_SUM_BLOCK)
    dH = torch.empty(H.shape, dtype=torch.float32)
    dWT = torch.zeros(blocks, n + 2, d, dtype=torch.float32)
    red = torch.zeros(blocks, n * (n + 1) + n + 2, dtype=torch.float64)
    args = (_ptr(h[0]), h[1], h[2], *(_ptr(t) for t in prm), _ptr(r), _ptr(P), _ptr(a[0]), a[1],
            _ptr(b[0]), b[1], b[2], _ptr(db), _ptr(dH), _ptr(dWT), _ptr(red), HC_SUM_BLOCK, n, d)
    _parallel(lambda lo, hi: lib.hfd_hc_route_bwd(*args, lo * HC_SUM_BLOCK, min(hi * HC_SUM_BLOCK, tok)), blocks, 1)
    m = n + 1
    out = torch.empty(d * m + d + n * m + n + 2, dtype=torch.float32)
    _check(lib.hfd_hc_route_bwd_sums(_ptr(dWT), _ptr(red), blocks, n, d, _ptr(out)))
    dWa, dwb, dsa, dsb, das, dbs = out.split_with_sizes((d * m, d, n * m, n, 1, 1))
    return dH, dWa.view(d, m), dwb, dsa.view(n, m), dsb, das.view(()), dbs.view(())


# --------------------------------------------------------------------------- mHC's routing (stream_mix.c)
#: the most streams ``mhc_route`` takes (``stream_mix.c``'s MHC_MAX_STREAMS; more: the eager form)
MAX_MHC_STREAMS = 8


def stream_mix_write(M: torch.Tensor, H: torch.Tensor, w: torch.Tensor, y: torch.Tensor):
    """``write_streams(M[..., 1:, :] H, w, y)`` (the next streams from the mixing matrices M [..., n + 1, n], H
    [..., n, d], w [..., n], y [..., d], fp32) in one pass per token, each row as the forward's mixing and in-place
    write form it (bit for bit). None when the kernel does not take these tensors."""
    lib = library()
    n, d = H.shape[-2], H.shape[-1]
    h, yt, wt = _token_rows(H, n, d), _vec_rows(y, d), _vec_rows(w, n)
    mm = _matrices(M, H.shape[:-2])
    if (lib is None or None in (h, yt, wt, mm) or M.shape[-2:] != (n + 1, n) or y.shape[:-1] != H.shape[:-2]
            or w.shape != H.shape[:-1]):
        return None
    out = torch.empty(H.shape, dtype=torch.float32)
    args = (_ptr(mm[0]), *mm[1:4], _ptr(h[0]), h[1], h[2], _ptr(wt[0]), wt[1], w.stride(-1), _ptr(yt[0]), yt[1],
            _ptr(out), n, d)
    _parallel(lambda lo, hi: lib.hfd_stream_mix_write(*args, lo, hi), h[3])
    return out


def _mhc_inputs(H, proj, bias, alpha, iters):
    """(library, H's token rows, proj, bias, alpha) for the mHC kernels, or None where they do not take these."""
    lib = library()
    n, d = H.shape[-2], H.shape[-1]
    C = n * n + 2 * n
    h = _token_rows(H, n, d)
    if (lib is None or h is None or n > MAX_MHC_STREAMS or iters < 1 or proj.dtype != torch.float32
            or proj.shape != (*H.shape[:-2], C) or not proj.is_contiguous() or bias.shape != (C,)
            or alpha.shape != (3,)):
        return None
    return lib, h, proj, _f32(bias), _f32(alpha)


def mhc_route(H: torch.Tensor, proj: torch.Tensor, bias, alpha, tanh: bool, columns_first: bool, iters: int,
              eps: float):
    """mHC's routing of streams H [..., n, d] (fp32) from the product of its projection proj [..., n^2 + 2n] =
    vec(H) phi, which becomes the normalized projection (vec(H) phi) r in place, r = 1 / rms(vec(H)) (``eps``):
    returns (x [..., d], mixed [..., n, d], M [..., n + 1, n] = [pre; res], post [..., n], r [..., 1]), with
    u = tanh(proj) (``tanh``) or proj, pre = sigmoid(a0 u + b), post = 2 sigmoid(a1 u + b), res = the
    linear-domain Sinkhorn of a2 u + b (``iters`` rounds, rows first; ``columns_first``: of the transposed logits,
    transposed back), x = pre^T H, mixed = res H: ``MHCConnection.routing_saved`` and ``read_and_mix`` after the
    product (to fp32 rounding), in one pass per token. None when the kernel does not take these tensors, or when
    some token's logits are out of the linear-domain Sinkhorn's range (``sinkhorn``; proj is then partly scaled)."""
    got = _mhc_inputs(H, proj, bias, alpha, iters)
    if got is None:
        return None
    lib, h, proj, b, a = got
    n, d, lead = H.shape[-2], H.shape[-1], H.shape[:-2]
    x, mixed, M, post, r = (torch.empty(*lead, *shape, dtype=torch.float32)
                            for shape in ((d,), (n, d), (n + 1, n), (n,), (1,)))
    args = (_ptr(h[0]), h[1], h[2], _ptr(proj), _ptr(r), eps, _ptr(b), _ptr(a), int(tanh), int(columns_first), iters,
            *(_ptr(t) for t in (x, mixed, M, post)), n, d)
    ok = _run_tokens(lambda lo, hi: lib.hfd_mhc_route(*args, lo, hi), h[3])
    return (x, mixed, M, post, r) if ok else None


def mhc_route_backward(H, proj, r, M, bias, alpha, tanh: bool, columns_first: bool, iters: int, dx, dmixed, dpost):
    """The backward of ``mhc_route`` through the recomputed gates and Sinkhorn, given the gradients of x, mixed and
    post and the forward's r = 1 / rms(vec(H)) [..., 1] and M: (dH [H's shape] without the projection's part,
    dQ [tokens, n^2 + 2n] (the gradient of vec(H) phi), d bias [n^2 + 2n], d alpha [3]), fp32. The caller adds
    dQ phi^T to dH and forms d phi = vec(H)^T dQ (two products). d bias and d alpha are token sums in blocks of
    ``HC_SUM_BLOCK`` tokens (double), added in block order (the thread count changes no bit), views of one buffer.
    None when the kernels do not take these tensors."""
    got = _mhc_inputs(H, proj, bias, alpha, iters)
    if got is None:
        return None
    lib, h, proj, b, a = got
    n, d = H.shape[-2], H.shape[-1]
    C = n * n + 2 * n
    ga, gb = _vec_rows(dx, d, copy=True), _token_rows(dmixed, n, d, copy=True)
    if (ga is None or gb is None or not (r.is_contiguous() and M.is_contiguous()) or r.dtype != torch.float32
            or M.dtype != torch.float32 or M.shape != (*H.shape[:-2], n + 1, n)):
        return None
    tok = h[3]
    blocks = -(-tok // HC_SUM_BLOCK)
    dH, dQ = torch.empty(H.shape, dtype=torch.float32), torch.empty(tok, C, dtype=torch.float32)
    reds = torch.empty(blocks, C + 3, dtype=torch.float64)  # each block's row starts from zero in the kernel
    dp = _f32(dpost)
    args = (_ptr(h[0]), h[1], h[2], _ptr(proj), _ptr(r), _ptr(M), _ptr(b), _ptr(a), int(tanh), int(columns_first),
            iters, _ptr(ga[0]), ga[1], _ptr(gb[0]), gb[1], gb[2], _ptr(dp), _ptr(dH), _ptr(dQ), _ptr(reds),
            HC_SUM_BLOCK, n, d)
    ok = _run_tokens(lambda lo, hi: lib.hfd_mhc_route_bwd(*args, lo * HC_SUM_BLOCK, min(hi * HC_SUM_BLOCK, tok)),
                     blocks, 1)
    if not ok:
        return None
    out = torch.empty(C + 3, dtype=torch.float32)
    _check(lib.hfd_block_sums(_ptr(reds), blocks, C + 3, _ptr(out)))
    dbias, dalpha = out.split_with_sizes((C, 3))
    return dH, dQ, dbias, dalpha


# --------------------------------------------------------------------------- AttnRes' depth softmax (attnres_agg.c)
#: fewest tokens per thread of the aggregation kernels
_AGG_MIN_TOKENS = 32


def _f32_cpu(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.is_cpu


def _agg_inputs(z: torch.Tensor, V: torch.Tensor, P: torch.Tensor | None, qg: torch.Tensor):
    """The library, if the aggregation kernels take these: fp32 CPU logits z [K, N] (tokens contiguous), sources
    V [K, N, d] (rows contiguous), the partial sum P [N, d] contiguous or None, the query qg [d] contiguous."""
    lib = library()
    if lib is None or V.dim() != 3 or z.dim() != 2:
        return None
    K, N, d = V.shape
    ok = (_f32_cpu(z) and _f32_cpu(V) and _f32_cpu(qg) and (P is None or _f32_cpu(P))
          and z.shape == (K, N) and z.stride(1) == 1 and V.stride(2) == 1 and V.stride(1) == d
          and qg.shape == (d,) and qg.is_contiguous() and K >= 1
          and (P is None or (P.shape == (N, d) and P.is_contiguous())))
    return lib if ok else None


def slot_write(x: torch.Tensor, data: torch.Tensor, rinv: torch.Tensor, i: int, eps: float) -> bool:
    """Slot ``i`` of a bank (``depth_ops.SourceBank``: ``data`` [capacity, *x.shape], ``rinv`` [capacity,
    *x.shape[:-1]], both fp32 contiguous) := x (fp32 CPU, rows contiguous), with each row's 1 / rms (``eps``), in one
    pass (``attnres_agg.c``); False (nothing written) when the kernel does not take these tensors."""
    lib = library()
    d = x.shape[-1]
    rows = _vec_rows(x, d)
    if (lib is None or rows is None or not (_f32_cpu(data) and _f32_cpu(rinv)) or data.shape[1:] != x.shape
            or rinv.shape[1:] != x.shape[:-1] or not (data.is_contiguous() and rinv.is_contiguous())):
        return False
    n, f = rows[3], data.element_size()  # rows per slot, bytes per float
    _parallel(lambda lo, hi: lib.hfd_slot_write(_ptr(rows[0]), rows[1], data.data_ptr() + f * i * n * d,
                                                rinv.data_ptr() + f * i * n, eps, d, lo, hi), n, _AGG_MIN_TOKENS)
    return True


def agg_forward(z: torch.Tensor, V: torch.Tensor, P: torch.Tensor | None, qg: torch.Tensor, eps: float):
    """AttnRes' depth softmax per token (``attnres_agg.c``): given the stable sources' logits z [K, N] and V
    [K, N, d] (and the running partial sum P [N, d], whose logit r_P qg . P it forms, r_P = 1 / rms(P) with
    ``eps``), returns (out [N, d] = sum_k p_k V_k (+ p_K P), p [N, S] (token-major, S = K (+ 1)), r_P [N], z_P [N];
    these two None without P). The eager ``_agg_softmax`` and ``_weighted_sum`` to fp32 rounding. None when the
    kernel does not take these tensors."""
    lib = _agg_inputs(z, V, P, qg)
    if lib is None:
        return None
    K, N, d = V.shape
    out, p = torch.empty(N, d, dtype=torch.float32), torch.empty(N, K + (P is not None), dtype=torch.float32)
    rp, zp = (None, None) if P is None else (torch.empty(N, dtype=torch.float32) for _ in range(2))
    args = (_ptr(z), z.stride(0), _ptr(V), V.stride(0), K, _ptr(P), _ptr(qg), eps, _ptr(out), _ptr(p), _ptr(rp),
            _ptr(zp), d)
    _parallel(lambda lo, hi: lib.hfd_agg_fwd(*args, lo, hi), N, _AGG_MIN_TOKENS)
    return out, p, rp, zp


def agg_backward(z, V, P, qg, rp, zp, dout, DZ, dV, PW=None):
    """The backward of ``agg_forward`` (its softmax recomputed from z and the saved z_P), given the output
    gradient dout [N, d]: writes the stable logits' gradients into DZ [K, N] (tokens contiguous), adds p_k dout
    into the gradient accumulator dV [K, N, d] (rows contiguous) -- or, with dV None, writes the weights p_k into PW
    [K, N] (tokens contiguous) for a deferred sum (``SlotGrads`` with an accumulator) -- and returns (dP [N, d],
    a [N] = dz_P r_P) for the partial sum (the caller adds a's part of the query gradient, a sum over tokens),
    (None, None) without one. None when the kernel does not take these tensors (nothing written)."""
    lib = _agg_inputs(z, V, P, qg)
    K, N, d = V.shape

    def rows(t, shape, dense):  # fp32, the given shape, the last dim contiguous (and rows of d contiguous)
        return t.dtype == torch.float32 and t.shape == shape and t.stride(-1) == 1 and (not dense or t.stride(1) == d)

    if (lib is None or dout.shape != (N, d) or not dout.is_contiguous() or dout.dtype != torch.float32
            or not rows(DZ, (K, N), False) or (dV is None and PW is None)
            or (dV is not None and not rows(dV, (K, N, d), True)) or (PW is not None and not rows(PW, (K, N), False))
            or (P is not None and not (rp.is_contiguous() and zp.is_contiguous() and rp.shape == zp.shape == (N,)))):
        return None
    dP, a = (None, None) if P is None else (torch.empty(N, d, dtype=torch.float32), torch.empty(N, dtype=torch.float32))
    args = (_ptr(z), z.stride(0), _ptr(V), V.stride(0), K, _ptr(P), _ptr(qg), _ptr(rp), _ptr(zp), _ptr(dout),
            _ptr(DZ), DZ.stride(0), _ptr(dV), 0 if dV is None else dV.stride(0), _ptr(PW),
            0 if PW is None else PW.stride(0), _ptr(dP), _ptr(a), d)
    _parallel(lambda lo, hi: lib.hfd_agg_bwd(*args, lo, hi), N, _AGG_MIN_TOKENS)
    return dP, a
