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


def _moda_nodes(loss) -> list:
    """The MoDA attention nodes of ``loss``'s graph."""
    seen, todo, found = set(), [loss.grad_fn], []
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ in ("_MoDAFlashBackward", "_MoDAAttentionBackward"):
            found.append(node)
        todo.extend(n for n, _ in node.next_functions)
    return found


@pytest.mark.parametrize("layers", [2, 7])
def test_a_consumer_is_an_edge_only_of_the_depth_slots_it_wrote(layers):
    """With banks, a slot's gradient reaches its producer through its first reader (``SourceBank.grad``), so each
    MoDA attention is handed only the slots it wrote (the previous attention's own K/V and its block's FFN K/V):
    the same number of edges for every consumer, not one per slot and reader (O(L^2) in all); the gradients equal
    the eager form's (``test_native``) and the reference's (this file)."""
    from helpers import tiny_model

    model = tiny_model("moda", num_hidden_layers=layers).train()
    x = torch.randint(2, 90, (2, 7), generator=torch.Generator().manual_seed(0))
    loss = model(x, labels=x).loss
    nodes = _moda_nodes(loss)
    assert len(nodes) == layers
    edges = sorted(len(n.next_functions) for n in nodes)  # one per tensor argument (or None) of the Function
    # block 0 reads no depth; every later consumer the same few, whatever the depth (before: 4 more per block)
    assert len(set(edges[1:])) <= 1 and (layers == 1 or edges[-1] - edges[0] <= 6), edges
    loss.backward()  # every kv_proj still gets its gradient
    for i in range(layers - 1):
        g = model.model.layers[i].kv_proj.weight.grad
        assert g is not None and g.abs().sum() > 0, i


def test_without_grad_no_autograd_function_runs(monkeypatch):
    """A prompt or a decoding step (no grad) runs the flash path's arithmetic without an autograd Function: the same
    output, bit for bit, as with grad."""
    q, k, v, depth = _inputs(dtype=torch.float32)
    with_grad = depth_ops.moda_attention(q, k, v, depth, None, 0.3)
    calls = []
    real = depth_ops._MoDAFlash.apply
    monkeypatch.setattr(depth_ops._MoDAFlash, "apply", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        without = depth_ops.moda_attention(q, k, v, depth, None, 0.3)
    assert calls == [] and not without.requires_grad
    assert torch.equal(with_grad.detach(), without)
