"""Issue 12 (MoDA time): the native CPU kernel of MoDA's depth part (``hf_depth.native``, C compiled on first use)
equals the eager form and the reference, output and every gradient: bank and stacked paths, GQA, masked depth
slots, token counts that are no multiple of a work item, more slots than a slot block, strided queries, one or
several threads, native and eager consumers mixed in one backward; without a compiler (or switched off) the eager
form runs and ``status()`` says why."""

import warnings

import pytest
import torch
from helpers import tiny_model
from test_moda_flash import _reference

from hf_depth import native
from hf_depth.models import depth_ops

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"native kernels unavailable: {native.status()}")


def _inputs(B, H, Hkv, T, D, hd, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=dtype).requires_grad_()  # noqa: E731
    # q as the attention makes it: a transposed [B, T, H, hd] projection (strided)
    q = torch.randn(B, T, H, hd, generator=g, dtype=dtype).transpose(1, 2).requires_grad_()
    k, v = mk(B, Hkv, T, hd), mk(B, Hkv, T, hd)
    depth = tuple(t for _ in range(D) for t in (mk(B, Hkv, T, hd), mk(B, Hkv, T, hd)))
    return q, k, v, depth


def _grads(fn, q, k, v, depth, depth_mask, banks=False):
    if banks and depth:  # the model's path: depth K/V read from write-once banks, slot gradients handed on once
        dk, dv = depth_ops.attach_moda_banks(depth[0], depth[1], len(depth) // 2)
        depth = (dk, dv, *depth[2:])
    out = fn(q, k, v, depth, None, 0.35, depth_mask)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v, *depth), allow_unused=True)
    return out, grads


def _leaves(inputs, dtype):
    return tuple(t.detach().to(dtype).requires_grad_() for t in inputs[:3]) + (
        tuple(t.detach().to(dtype).requires_grad_() for t in inputs[3]),)


SHAPES = {
    "mha": dict(B=2, H=4, Hkv=4, T=37, D=3, hd=16),
    "gqa": dict(B=1, H=6, Hkv=2, T=45, D=5, hd=8),
    "mqa_odd_hd": dict(B=3, H=4, Hkv=1, T=9, D=2, hd=12),
    "many_slots": dict(B=1, H=2, Hkv=2, T=70, D=19, hd=32),
    "one_slot_one_token": dict(B=2, H=2, Hkv=2, T=1, D=1, hd=8),
}


@pytest.mark.parametrize("banks", [False, True])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_native_equals_eager_and_reference(shape, masked, banks, monkeypatch):
    s = SHAPES[shape]
    inputs = _inputs(**s)
    depth_mask = None
    if masked:
        depth_mask = torch.arange(s["D"]) % 2 == 0
    calls = []
    real = native.moda_depth_forward
    monkeypatch.setattr(native, "moda_depth_forward", lambda *a: (calls.append(1), real(*a))[1])
    out, grads = _grads(depth_ops.moda_attention, *inputs, depth_mask, banks)
    assert calls, "the native kernel did not run"
    monkeypatch.setenv("HF_DEPTH_NATIVE", "0")
    eout, egrads = _grads(depth_ops.moda_attention, *inputs, depth_mask, banks)
    ref_in = _leaves(inputs, torch.float64)
    rout, rgrads = _grads(_reference, *ref_in, depth_mask)
    torch.testing.assert_close(out, eout, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), rout, atol=1e-5, rtol=1e-5)
    for g, e, r in zip(grads, egrads, rgrads):
        assert (g is None) == (e is None) == (r is None)
        if g is not None:
            torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(g.double(), r, atol=1e-5, rtol=1e-5)


def test_threads_split_the_work_without_changing_a_bit():
    """Work items are independent (each writes its own rows), so the result is the same for any thread count."""
    inputs = _inputs(B=2, H=4, Hkv=2, T=130, D=6, hd=16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _grads(depth_ops.moda_attention, *inputs, None, True)
        torch.set_num_threads(3)
        three = _grads(depth_ops.moda_attention, *inputs, None, True)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one[0], three[0])
    for a, b in zip(one[1], three[1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("layers", [1, 2, 7])
def test_model_native_equals_eager(layers, monkeypatch):
    """A MoDA model (GQA, left padding, one layer with its depth slots masked): logits and every parameter gradient
    with the native kernel equal the eager form's; and with native and eager consumers mixed in one backward
    (their slot gradients meet in ``SourceBank.slot_grads``)."""
    model = tiny_model("moda", num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2)
    if layers > 2:
        model.model.layers[2].mask_depth = True
    x = torch.randint(2, 97, (2, 11), generator=torch.Generator().manual_seed(2))
    attn = torch.ones_like(x)
    attn[0, :3] = 0

    def run():
        model.zero_grad(set_to_none=True)
        out = model(x, attention_mask=attn, labels=x, use_cache=False)
        (out.logits.pow(2).mean() + out.loss).backward()
        return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    logits, grads = run()
    real, flip = depth_ops._native, iter(range(10**6))
    monkeypatch.setattr(depth_ops, "_native", lambda *a: next(flip) % 2 == 0 and real(*a))
    mixed_logits, mixed = run()
    monkeypatch.setattr(depth_ops, "_native", lambda *a: False)
    eager_logits, eager = run()
    for got, got_grads in ((logits, grads), (mixed_logits, mixed)):
        torch.testing.assert_close(got, eager_logits, atol=1e-6, rtol=1e-6)
        assert got_grads.keys() == eager.keys()
        for name in eager:
            torch.testing.assert_close(got_grads[name], eager[name], atol=1e-6, rtol=1e-5, msg=name)


def test_switched_off_or_without_a_compiler_the_eager_form_runs(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DEPTH_NATIVE", "0")
    assert native.library() is None
    assert native.status() == {"enabled": False, "available": False, "ops": list(native.OPS),
                               "why": "disabled (HF_DEPTH_NATIVE=0 or HF_DEPTH_KERNELS=torch)"}
    monkeypatch.setenv("HF_DEPTH_NATIVE", "1")
    monkeypatch.setenv("HF_DEPTH_KERNELS", "torch")
    assert native.library() is None
    monkeypatch.delenv("HF_DEPTH_KERNELS")
    # no compiler: one warning, the reason in status(), and MoDA still runs (eager)
    monkeypatch.setattr(native, "_LIB", None)
    monkeypatch.setattr(native, "_compiler", lambda: None)
    with pytest.warns(RuntimeWarning, match="no C compiler"):
        assert native.library() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.library() is None  # warned once
        st = native.status()
    assert st["enabled"] and not st["available"] and "no C compiler" in st["why"]
    model = tiny_model("moda", num_hidden_layers=2)
    model(torch.randint(2, 97, (1, 5)), labels=torch.randint(2, 97, (1, 5))).loss.backward()


def test_the_library_is_built_once_into_its_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DEPTH_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_LIB", None)
    lib = native.library()
    assert lib is not None
    built = list(tmp_path.glob("hf_depth_native_*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(native, "_LIB", None)
    assert native.library() is not None
    assert [p.stat().st_mtime_ns for p in tmp_path.glob("hf_depth_native_*.so")] == [stamp]  # reused, not rebuilt
    assert not list(tmp_path.glob("*.tmp*")) and len(list(tmp_path.iterdir())) == 1  # no partial files left


@pytest.mark.parametrize("var,value", [("HF_DEPTH_NATIVE", "maybe"), ("HF_DEPTH_NATIVE", "off"),
                                       ("HF_DEPTH_KERNELS", "cuda")])
def test_an_unknown_switch_value_is_refused_by_name(var, value, monkeypatch):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=f"`{var}` must be one of"):
        native.enabled()


def test_the_kernel_report_says_whether_the_native_kernels_run(monkeypatch):
    from hf_depth.models import dispatch

    assert dispatch.kernel_report()["native"] == native.status()
    assert "native CPU kernels (moda_depth): in use" in dispatch.format_kernel_report()
    monkeypatch.setenv("HF_DEPTH_NATIVE", "0")
    assert dispatch.kernel_report()["native"]["available"] is False
    assert "native CPU kernels (moda_depth): not used (disabled" in dispatch.format_kernel_report()
