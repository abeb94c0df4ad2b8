"""Issue 12 (MoDA time): the CPU flash path of ``depth_ops.moda_attention`` (sequence part in the flash kernel,
merged with the depth scores by log-sum-exp) equals the explicit-softmax path and the reference, output and every
gradient, for causal / bool padding / additive masks, cached queries (T < Tk), GQA and masked depth slots; rows
that the kernel cannot reproduce (fully masked, no live depth slot) take the explicit path."""

import pytest
import torch

from hf_depth.models import depth_ops, functional


def _inputs(B=2, H=4, Hkv=2, T=5, Tk=5, D=3, hd=8, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=dtype, requires_grad=True)  # noqa: E731
    q, k, v = mk(B, H, T, hd), mk(B, Hkv, Tk, hd), mk(B, Hkv, Tk, hd)
    depth = tuple(t for _ in range(D) for t in (mk(B, Hkv, T, hd), mk(B, Hkv, T, hd)))
    return q, k, v, depth


def _padding(B, T, Tk, pad):
    causal = torch.ones(T, Tk, dtype=torch.bool).tril(Tk - T)
    keys = torch.ones(B, Tk, dtype=torch.bool)
    keys[0, :pad] = False
    return causal & keys[:, None, None, :]


def _run(fn, q, k, v, depth, mask, depth_mask):
    out = fn(q, k, v, depth, mask, 0.3, depth_mask)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v, *depth), allow_unused=True)
    return out, grads


def _reference(q, k, v, depth, mask, scaling, depth_mask):
    dk = torch.stack(depth[0::2]) if depth else None
    dv = torch.stack(depth[1::2]) if depth else None
    return functional.moda_attention(q, k, v, dk, dv, mask, scaling, depth_mask)


CASES = {
    "causal": dict(mask=None),
    "causal_gqa_mha": dict(mask=None, Hkv=4),
    "cached": dict(mask=None, T=2, Tk=6),
    "bool_padding": dict(mask="bool"),
    "additive_padding": dict(mask="float"),
    "masked_depth": dict(mask=None, depth_mask=torch.tensor([True, False, True])),
    "no_depth": dict(mask=None, D=0),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_flash_path_equals_reference(case, dtype):
    c = dict(CASES[case])
    kind, depth_mask = c.pop("mask"), c.pop("depth_mask", None)
    q, k, v, depth = _inputs(dtype=dtype, **c)
    B, T, Tk = q.shape[0], q.shape[2], k.shape[2]
    mask = None
    if kind is not None:
        mask = _padding(B, T, Tk, pad=2)
        if kind == "float":
            mask = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)
    assert depth_ops._flash_exact(q, mask, depth_mask, len(depth))
    out, grads = _run(depth_ops.moda_attention, q, k, v, depth, mask, depth_mask)
    ref, rgrads = _run(_reference, q, k, v, depth, mask, depth_mask)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    for g, r in zip(grads, rgrads):
        torch.testing.assert_close(g, r, atol=tol, rtol=tol)


@pytest.mark.parametrize("depth_mask", [None, torch.tensor([False, False])])
def test_fully_masked_rows_without_live_depth_take_the_explicit_path(depth_mask):
    D = 0 if depth_mask is None else 2
    q, k, v, depth = _inputs(D=D)
    mask = _padding(2, 5, 5, pad=2)  # batch 0: its first two query rows see no key at all
    assert not depth_ops._flash_exact(q, mask, depth_mask, len(depth))
    assert depth_ops._flash_exact(q, _padding(2, 5, 5, pad=0), depth_mask, len(depth))
    out, grads = _run(depth_ops.moda_attention, q, k, v, depth, mask, depth_mask)
    ref, rgrads = _run(_reference, q, k, v, depth, mask, depth_mask)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    for g, r in zip(grads, rgrads):
        torch.testing.assert_close(g, r, atol=1e-12, rtol=1e-12)


def test_flash_path_is_taken_on_cpu(monkeypatch):
    calls = []
    real = depth_ops._MoDAFlash.apply
    monkeypatch.setattr(depth_ops._MoDAFlash, "apply", lambda *a: calls.append(1) or real(*a))
    q, k, v, depth = _inputs()
    depth_ops.moda_attention(q, k, v, depth, None, 0.3)
    assert calls == [1]
