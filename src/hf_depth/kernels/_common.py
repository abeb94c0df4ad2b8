"""Shared helpers of the Triton kernels: output allocation (NaN-poisoned under a debug flag), rounding that
matches PyTorch's round-to-nearest-even also in the interpreter, block sizes, and ``torch.library`` registration.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

#: ``HF_DEPTH_KERNELS_POISON=1`` (or setting this attribute) fills every kernel output with NaN before launch,
#: so an element a kernel forgets to write fails the parity tests instead of passing by luck.
POISON = os.environ.get("HF_DEPTH_KERNELS_POISON", "0") == "1"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def new(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An output buffer the kernel must fully write (NaN-filled when POISON is on)."""
    if POISON:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


def rows_per_program(block_d: int, budget: int = 4096, cap: int = 64) -> int:
    """How many rows one program handles so that a [rows, block_d] tile stays around ``budget`` elements."""
    return max(1, min(cap, budget // block_d))


def programs(device: torch.device, blocks: int, per_sm: int = 4) -> int:
    """Grid of a persistent kernel: a few programs per SM (4 in the interpreter), never more than the blocks."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    return max(1, min(blocks, per_sm * sms))


def warps(elements: int) -> int:
    return 4 if elements <= 2048 else (8 if elements <= 8192 else 16)


def register(name: str, fake):
    """Decorator: ``fn`` becomes the custom op ``hf_depth::name`` (opaque to torch.compile / FSDP2) with ``fake``
    as its meta implementation."""

    def wrap(fn):
        op = torch.library.custom_op(f"hf_depth::{name}", mutates_args=())(fn)
        op.register_fake(fake)
        return op

    return wrap


def rows(x: torch.Tensor) -> torch.Tensor:
    """x as a contiguous [M, d] matrix."""
    return x.reshape(-1, x.shape[-1]).contiguous()


@triton.jit
def rnd(x, dtype: tl.constexpr):
    """Round fp32 ``x`` to ``dtype`` and back (RTNE, like torch). The interpreter truncates on bf16 casts and
    stores, so bf16 is rounded by hand; storing the result into a ``dtype`` pointer is then exact everywhere."""
    if dtype == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16  # shifts, not a 0xFFFF0000 mask: that literal is int64
        return b.to(tl.float32, bitcast=True)
    elif dtype == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def store(ptr, x, mask):
    """``tl.store`` with the value rounded to the pointer's dtype first (see :func:`rnd`)."""
    tl.store(ptr, rnd(x, ptr.dtype.element_ty), mask=mask)
