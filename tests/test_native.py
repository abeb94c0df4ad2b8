"""Issue 12 (MoDA time): the native CPU kernel of MoDA's depth part (``hf_depth.native``, C compiled on first use)
equals the eager form and the reference, output and every gradient: bank and stacked paths, GQA, masked depth
slots, token counts that are no multiple of a work item, more slots than a slot block, strided queries, one or
several threads, native and eager consumers mixed in one backward; without a compiler (or switched off) the eager
form runs and ``status()`` says why."""

import warnings

import pytest
import torch
from helpers import count_native_calls, tiny_model
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
    "two_chunks_gqa": dict(B=1, H=4, Hkv=2, T=150, D=10, hd=8),  # a 128-token work item and 22 left over
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
    inputs = _inputs(B=2, H=4, Hkv=2, T=130, D=16, hd=16)  # T D >= 2048: training items, split over threads
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


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place between fp32 tensors of one sign (their bit patterns as integers)."""
    return (a.view(torch.int32).long() - b.view(torch.int32).long()).abs()


def test_the_kernels_exponential_is_expf_to_one_ulp():
    """MoDA's native depth softmax takes e^x from a vector exponential (``hfd_exp_shift``, eight lanes at a time,
    clamped so that a masked slot's -inf gives 0; its ``hfd_exp8`` is also the stream kernels' tanh's): from -87 to
    88.37 (e^x normal and finite), every 61st float, it is within 1 ulp of the correctly rounded value (what
    glibc's expf gives to within a half ulp), whatever shift is subtracted first; -inf and anything below -88 give 0,
    0 gives 1, NaN stays NaN, and the tail of a row (n not a multiple of 8) is computed as its head."""
    top = torch.tensor([88.37], dtype=torch.float32).view(torch.int32).item()
    mags = torch.arange(0, top, 61, dtype=torch.int32).view(torch.float32)  # every 61st float in [0, 88.37)
    x = torch.cat([-mags[mags <= 87], mags])
    exact = x.double().exp().float()  # correctly rounded but for double rounding, which is rarer than the 1 ulp allowed
    assert _ulps(native.exp_shift(x), exact).max().item() <= 1
    m = 3.25  # e^(x - m): the shift is subtracted in fp32, as the kernels do
    assert _ulps(native.exp_shift(x[:4001], m), (x[:4001] - m).double().exp().float()).max().item() <= 1
    edges = torch.tensor([float("-inf"), -88.5, -1e30, float("nan"), 0.0, -0.0, 1.0, -1.0, 88.0, -87.5, 2.0])
    got = native.exp_shift(edges)
    assert got[:3].eq(0).all() and got[3].isnan() and got[4] == got[5] == 1
    assert (_ulps(got[6:], edges[6:].double().exp().float()) <= 1).all()
    with pytest.raises(ValueError, match="1-D fp32 CPU"):
        native.exp_shift(x[:8].double())
    with pytest.MonkeyPatch.context() as mp:  # switched off: said so, not an AttributeError on None
        mp.setenv("HF_DEPTH_NATIVE", "0")
        with pytest.raises(RuntimeError, match="exp_shift needs the native kernels.*HF_DEPTH_NATIVE=0"):
            native.exp_shift(x[:8])
    for n in (1, 7, 9, 15):  # the tail goes through a padded block
        row = torch.linspace(-5, 5, 23)[:n]
        assert torch.equal(native.exp_shift(row), native.exp_shift(torch.linspace(-5, 5, 23))[:n])


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


KV_WRITE_CASES = {"mha-rotated": (2, 13, 4, 16, "batch"), "gqa-rotated-broadcast": (3, 7, 2, 8, "one"),
                  "mqa-unrotated": (2, 5, 1, 32, None), "one-token": (1, 1, 3, 6, "one")}


def _kv_write_ops(kv, kv_heads, positions):
    """What MoDA's FFN write did before the kernel: the views of ``kv`` and ``rotate`` of the key."""
    from hf_depth.models.modeling_depth import rotate

    B, T, width = kv.shape
    k, v = kv.view(B, T, 2, kv_heads, width // (2 * kv_heads)).transpose(1, 3).unbind(2)
    return (k if positions is None else rotate(k, *positions)), v


@pytest.mark.parametrize("case", sorted(KV_WRITE_CASES))
def test_ffn_depth_kv_kernel_equals_the_ops_bit_for_bit(case):
    """``moda_ffn_depth_kv`` (the split, transposed and rotated FFN key and value in one native pass, and its backward)
    gives the ops' K, V and the ops' gradient of kv bit for bit: MHA, GQA, MQA, unrotated, one token, a position table
    broadcast over the batch, a strided kv (a slice of a wider product), and either gradient missing."""
    B, T, kvh, hd, pos = KV_WRITE_CASES[case]
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(B, T, 2 * kvh * hd + 5, generator=g)
    positions = None
    if pos is not None:
        table = torch.randn(2, 1 if pos == "one" else B, T, hd, generator=g)
        positions = (table[0], table[1])
    gk, gv = torch.randn(B, kvh, T, hd, generator=g), torch.randn(B, kvh, T, hd, generator=g)
    for grads in ((gk, gv), (gk, None), (None, gv)):
        got, want = [], []
        for fn, out in ((depth_ops.moda_ffn_depth_kv, got), (_kv_write_ops, want)):
            kv = wide[..., 3 : 3 + 2 * kvh * hd].detach().requires_grad_(True)
            k, v = fn(kv, kvh, positions)
            pairs = [(t, gr) for t, gr in zip((k, v), grads) if gr is not None]
            torch.autograd.backward([t for t, _ in pairs], [gr for _, gr in pairs])
            out += [k.detach(), v.detach(), kv.grad]
        assert got[0].is_contiguous() and got[1].is_contiguous()
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def test_ffn_depth_kv_kernel_declines_what_it_does_not_take():
    """bf16, an odd head size, a table of another length or a last stride other than 1: the ops run (None)."""
    kv, cos = torch.randn(2, 5, 32), torch.randn(1, 5, 8)
    assert depth_ops.moda_ffn_depth_kv(kv, 2, (cos, cos)) is not None
    assert depth_ops.moda_ffn_depth_kv(kv.bfloat16(), 2, (cos.bfloat16(), cos.bfloat16())) is None
    assert depth_ops.moda_ffn_depth_kv(torch.randn(2, 5, 30), 3, None) is None  # head size 5
    assert depth_ops.moda_ffn_depth_kv(kv, 2, (cos[:, :4], cos[:, :4])) is None
    assert depth_ops.moda_ffn_depth_kv(torch.randn(2, 32, 5).transpose(1, 2), 2, None) is None
    assert not native.moda_kv_supported(kv, 3, None)  # 32 is not 2 x 3 x hd


def test_an_ffn_read_on_its_own_cannot_write_an_unrotated_key():
    """``moda_depth_rope="rotated"``: the FFN's key needs the positions the attention hands over in
    ``write_then_read``; an FFN connection called on its own says so instead of writing the key unrotated."""
    model = tiny_model("moda", num_hidden_layers=2)
    layer = model.model.layers[0]
    h = torch.randn(1, 3, model.config.hidden_size)
    x, carry = layer.mlp_connection.read((h,), layer.post_attention_layernorm)
    with pytest.raises(ValueError, match="write_then_read"):
        layer.mlp_connection.write((h,), layer.mlp(x), carry)


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


def test_a_changed_header_rebuilds_the_library(monkeypatch, tmp_path):
    """The build key covers the headers the sources include, not only the sources."""
    cache, extra = tmp_path / "cache", tmp_path / "extra.h"
    monkeypatch.setenv("HF_DEPTH_NATIVE_CACHE", str(cache))
    monkeypatch.setattr(native, "HEADERS", (*native.HEADERS, str(extra)))  # an absolute path: read as it is
    for version in ("/* one */", "/* two */"):
        extra.write_text(version)
        monkeypatch.setattr(native, "_LIB", None)
        assert native.library() is not None
    assert len(list(cache.glob("hf_depth_native_*.so"))) == 2


@pytest.mark.parametrize("var,value", [("HF_DEPTH_NATIVE", "maybe"), ("HF_DEPTH_NATIVE", "off"),
                                       ("HF_DEPTH_KERNELS", "cuda")])
def test_an_unknown_switch_value_is_refused_by_name(var, value, monkeypatch):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=f"`{var}` must be one of"):
        native.enabled()


def test_the_switches_are_read_on_every_call(monkeypatch):
    """``dispatch.env`` (every op's dispatch and every native call read the switches through it) sees a change at
    once, gives the default for an unset variable, and reads a replaced ``os.environ`` (a plain dict) as well."""
    import os

    from hf_depth.models import dispatch

    monkeypatch.delenv("HF_DEPTH_NATIVE", raising=False)
    assert dispatch.env("HF_DEPTH_NATIVE") is None and dispatch.env("HF_DEPTH_NATIVE", "1") == "1"
    assert native.enabled() == (dispatch.mode() != "torch")
    monkeypatch.setenv("HF_DEPTH_NATIVE", "0")
    assert dispatch.env("HF_DEPTH_NATIVE") == "0" and not native.enabled() and native.library() is None
    monkeypatch.setenv("HF_DEPTH_NATIVE", "1")
    assert dispatch.env("HF_DEPTH_NATIVE", "x") == "1"
    monkeypatch.setattr(os, "environ", {"HF_DEPTH_KERNELS": "torch"})
    assert dispatch.env("HF_DEPTH_KERNELS") == "torch" and dispatch.mode() == "torch" and not native.enabled()
    assert not dispatch.use_triton(torch.zeros(1))


def test_the_kernel_report_says_whether_the_native_kernels_run(monkeypatch):
    from hf_depth.models import dispatch

    assert dispatch.kernel_report()["native"] == native.status()
    ops = ", ".join(native.OPS)
    assert f"native CPU kernels ({ops}): in use" in dispatch.format_kernel_report()
    monkeypatch.setenv("HF_DEPTH_NATIVE", "0")
    assert dispatch.kernel_report()["native"]["available"] is False
    assert f"native CPU kernels ({ops}): not used (disabled" in dispatch.format_kernel_report()


# --------------------------------------------------------------------------- HC / mHC stream mixing
def _close(a, b, msg=""):
    """fp32 rounding: the kernels' dot products sum in lanes, the eager products in their own order."""
    scale = max(1.0, b.abs().max().item())
    torch.testing.assert_close(a, b, atol=2e-6 * scale, rtol=1e-5, msg=msg or None)


def _stream_cases():
    g = torch.Generator().manual_seed(5)
    B, T, n, d = 2, 9, 4, 40  # d not a multiple of the kernels' 8 lanes: their tails run too
    H = torch.randn(B, T, n, d, generator=g)
    yield "dynamic", torch.randn(B, T, n, n + 1, generator=g).transpose(-1, -2), H  # M as routing_saved gives it
    yield "contiguous", torch.randn(B, T, n + 1, n, generator=g), H
    yield "static", torch.randn(n + 1, n, generator=g), H
    yield "broadcast streams", torch.randn(B, T, n + 1, n, generator=g), torch.randn(B, T, 1, d, generator=g).expand(
        B, T, n, d)  # MultiStream.init: the embedding read n times (stride 0)
    yield "one token", torch.randn(1, 1, n + 1, n, generator=g), torch.randn(1, 1, n, d, generator=g)


@pytest.mark.parametrize("case", range(5))
def test_stream_kernels_equal_the_eager_forms(case):
    from hf_depth.models.functional import mix_streams, read_and_mix

    name, M, H = list(_stream_cases())[case]
    x, mixed = native.stream_mix(M, H, 1)
    ref_x, ref_mixed = read_and_mix(M, H)
    _close(x, ref_x, name)
    _close(mixed, ref_mixed, name)
    (out,) = native.stream_mix(M[..., 1:, :], H, 0)
    _close(out, mix_streams(M[..., 1:, :], H), name)
    # backward of [x; mixed] = M H, with and without separate first rows
    g = torch.Generator().manual_seed(6)
    dx, dmixed = torch.randn(x.shape, generator=g), torch.randn(mixed.shape, generator=g)
    Md, Hd = M.detach().clone().requires_grad_(), H.detach().clone().requires_grad_()
    full = Md @ Hd
    torch.autograd.backward([full[..., 0, :], full[..., 1:, :]], [dx, dmixed])
    dM, dH = native.stream_mix_backward(M, H, dx.unsqueeze(-2), dmixed)
    _close(dM.view(H.shape[:-2] + M.shape[-2:]).sum(0).sum(0) if M.dim() == 2 else dM.view(M.shape), Md.grad, name)
    _close(dH, Hd.grad, name)
    dM1, dH1 = native.stream_mix_backward(M, H, None, torch.cat((dx.unsqueeze(-2), dmixed), -2))
    _close(dM1, dM, name)
    _close(dH1, dH, name)
    # the write H' = mixed + w y: per-token and static weights
    y = torch.randn(x.shape, generator=g)
    for w in (torch.randn(H.shape[:-1], generator=g), torch.randn(H.shape[-2], generator=g)):
        wd, yd = w.clone().requires_grad_(), y.clone().requires_grad_()
        (mixed + wd.unsqueeze(-1) * yd.unsqueeze(-2)).backward(dmixed[..., :1, :].expand(mixed.shape).contiguous())
        dy, dw = native.stream_write_backward(w, dmixed[..., :1, :].expand(mixed.shape).contiguous(), y)
        _close(dy, yd.grad, name)
        _close(dw.view(mixed.shape[:-1]).reshape(-1, w.shape[-1]).sum(0) if w.dim() == 1 else dw.view(w.shape),
               wd.grad, name)


def test_stream_kernels_decline_what_they_do_not_take():
    """Half precision, float64 and a mismatched M: None (the caller runs the eager form), never a wrong result."""
    M, H = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 4, 8)
    assert native.stream_mix(M.double(), H.double(), 1) is None
    assert native.stream_mix(M.bfloat16(), H.bfloat16(), 1) is None
    assert native.stream_mix(torch.randn(3, 3, 5, 4), H, 1) is None
    assert native.stream_mix_backward(M, H, None, torch.randn(2, 3, 5, 8).half()) is None
    assert native.stream_write_backward(torch.randn(2, 3, 4).double(), torch.randn(2, 3, 4, 8), torch.randn(2, 3, 8)) is None
    wide = native.MAX_STREAM_ROWS  # more streams than the backward's fixed buffers: declined, never overrun
    Mw, Hw = torch.randn(2, wide + 1, wide), torch.randn(2, wide, 8)
    assert native.stream_mix_backward(Mw, Hw, None, torch.randn(2, wide + 1, 8)) is None
    x, mixed = native.stream_mix(Mw, Hw, 1)  # the forward has no such buffers
    torch.testing.assert_close(mixed, Mw[:, 1:] @ Hw)


def test_native_sinkhorn_equals_the_reference():
    """The linear-domain kernel (rows first; logits read through their strides) against ``functional.sinkhorn`` in
    float64 and its autograd gradient; logits out of its range (or not finite) are declined, never rounded to 0."""
    from hf_depth.models.functional import sinkhorn

    g = torch.Generator().manual_seed(7)
    for n in (2, 4, 5):
        L = torch.randn(3, 37, n, n, generator=g) * 4  # 111 tokens: full and partial lane blocks
        for logits in (L, L.transpose(-1, -2)):
            ref = logits.double().requires_grad_()
            dres = torch.randn(logits.shape, generator=g)
            out = sinkhorn(ref, 20)
            out.backward(dres.double())
            got = native.sinkhorn(logits, 20)
            torch.testing.assert_close(got.double(), out.detach(), rtol=0, atol=1e-6)
            grad = native.sinkhorn_backward(dres, logits, 20)
            torch.testing.assert_close(grad.double(), ref.grad, rtol=0, atol=1e-6 * max(1.0, ref.grad.abs().max().item()))
    wide = torch.zeros(2, 9, 4, 4)
    wide[1, 3, 2, 0] = -61.0
    assert native.sinkhorn(wide, 20) is None and native.sinkhorn_backward(wide, wide, 20) is None
    wide[1, 3, 2, 0] = float("nan")
    assert native.sinkhorn(wide, 20) is None
    assert native.sinkhorn(wide.double(), 20) is None
    assert native.sinkhorn(L, 0) is None  # no iteration: exp(logits) unnormalized, the eager form's


def _routed_model(design: str, layers: int, seed: int, **extra):
    """A tiny ``design`` model whose routing parameters are moved away from their init (where the dynamic projections
    are zero and tanh(0) = 0 exactly): input-dependent gates, so kernels and eager forms are compared on real work."""
    model = tiny_model(design, num_hidden_layers=layers, **extra)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if "connection" in name:
                p.add_(torch.randn(p.shape, generator=g) * (0.1 if p.dim() < 2 else 0.05))
    return model


def _native_then_eager(run, op: str, monkeypatch, decline: bool = False):
    """(``run()`` with ``native.<op>`` watched (every call declined with ``decline``), then ``run()`` on the eager
    path of the streams); the op was called in the first."""
    calls = []
    real = getattr(native, op)
    monkeypatch.setattr(native, op, lambda *a: calls.append(1) or (None if decline else real(*a)))
    first = run()
    assert calls
    monkeypatch.setattr(depth_ops, "_native_streams", lambda H: False)
    return first, run()


def _model_kernels_equal_eager(model, x, ops, to_eager, monkeypatch):
    """The native ``ops`` run (counted) in a training step of ``model`` on ``x``; 2 threads and activation
    checkpointing change no bit of the logits or any parameter gradient; after ``to_eager()`` (the eager form) they
    agree at fp32 rounding (1e-6)."""
    calls = count_native_calls(monkeypatch, ops)

    def run():
        model.zero_grad(set_to_none=True)
        out = model(x, labels=x, use_cache=False)
        (out.logits.pow(2).mean() + out.loss).backward()
        return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    logits, grads = run()
    assert set(calls) == set(ops), calls
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        logits2, grads2 = run()
    finally:
        torch.set_num_threads(before)
    assert torch.equal(logits, logits2) and all(torch.equal(grads[k], grads2[k]) for k in grads)
    model.activation_checkpointing_enable()  # the recomputed forward runs the same kernels: the same gradients
    ckpt_logits, ckpt = run()
    model.activation_checkpointing_disable()
    assert torch.equal(logits, ckpt_logits) and all(torch.equal(grads[k], ckpt[k]) for k in grads)
    to_eager()
    eager_logits, eager = run()
    torch.testing.assert_close(logits, eager_logits, atol=1e-6 * max(1.0, eager_logits.abs().max().item()), rtol=1e-6)
    assert grads.keys() == eager.keys()
    for name in eager:
        scale = max(1.0, eager[name].abs().max().item())
        torch.testing.assert_close(grads[name], eager[name], atol=1e-6 * scale, rtol=1e-5, msg=name)


@pytest.mark.parametrize("design,extra", [("hc", {}), ("mhc", {}), ("mhc", {"mhc_sinkhorn_order": "columns_first"})])
@pytest.mark.parametrize("layers", [1, 2, 7])
def test_model_stream_kernels_equal_eager(design, extra, layers, monkeypatch):
    """HC / mHC (the streams' one-pass kernels in forward, rebuild and backward; dynamic HC's fused routing, mHC's
    Sinkhorn), with routing weights away from their init: logits and every parameter gradient equal the eager
    form's at fp32 rounding; neither the thread count nor activation checkpointing changes a bit."""
    model = _routed_model(design, layers, 5, **extra)
    x = torch.randint(2, 97, (8, 64), generator=torch.Generator().manual_seed(3))  # 8 x 64 x 4 x 32: one-pass size
    fused = {"hc": ("hc_route", "hc_rebuild", "hc_route_backward"),
             "mhc": ("mhc_route", "stream_mix_write", "mhc_route_backward")}[design]
    def to_eager():
        monkeypatch.setattr(depth_ops, "_native_streams", lambda H: False)

    _model_kernels_equal_eager(model, x, fused, to_eager, monkeypatch)


@pytest.mark.parametrize("design", ["hc", "mhc"])
def test_decoding_takes_the_fused_routing(design, monkeypatch):
    """Without grad, every size takes the fused native routing (one call per sublayer, a decoding step's one token per
    row included): greedy generation's tokens equal the reference routing's (native off) and its scores agree at fp32
    rounding."""
    model = _routed_model(design, 2, 6).eval()
    x = torch.randint(2, 97, (2, 5), generator=torch.Generator().manual_seed(7))
    kw = dict(attention_mask=torch.ones_like(x), max_new_tokens=4, do_sample=False, pad_token_id=0,
              output_scores=True, return_dict_in_generate=True)
    sizes = []
    real = getattr(native, f"{design}_route")
    monkeypatch.setattr(native, f"{design}_route", lambda H, *a: sizes.append(H.shape[:-2].numel()) or real(H, *a))
    with torch.no_grad():
        fused = model.generate(x, **kw)
    assert sizes == [10] * 4 + [2] * 4 * 3  # the prompt, then 3 decoding steps: 2 layers x 2 sublayers each
    monkeypatch.setattr(depth_ops, "_native_ok", lambda: False)
    with torch.no_grad():
        ref = model.generate(x, **kw)
    assert torch.equal(fused.sequences, ref.sequences)
    for a, b in zip(fused.scores, ref.scores):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * max(1.0, b.abs().max().item()))


def test_mhc_fused_routing_declines_streams_before_its_product():
    """Streams the native kernels do not take (bf16, float64): mHC's fused routing returns None before the projection's
    product, so a bf16 decoding step pays no fp32 GEMM for a kernel call that would decline."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_depth.models.design_hc import MultiStreamConnection

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    conn = next(m for m in _routed_model("mhc", 1, 3).modules() if isinstance(m, MultiStreamConnection))
    H = torch.randn(2, 1, conn.n, 32)
    assert conn.fused_route(H) is not None
    for other in (H.bfloat16(), H.double()):
        with Ops() as ops:
            assert conn.fused_route(other) is None
        assert not ops.names, ops.names


@pytest.mark.parametrize("design", ["hc", "mhc"])
def test_the_training_routing_runs_outside_autocast(design):
    """Under bf16 autocast the CPU training path's routing (``depth_ops._Route``: the native kernels, mHC's projection
    product) computes in fp32, the same bits as without autocast (the autocast context is entered only where one is
    on: ``depth_ops._outside_autocast``)."""
    from hf_depth.models.depth_ops import stream_route
    from hf_depth.models.design_hc import MultiStreamConnection

    model = _routed_model(design, 1, 3)
    conn = next(m for m in model.modules() if isinstance(m, MultiStreamConnection))
    n, d = model.config.num_streams, model.config.hidden_size
    H = torch.randn(8, 2048 // d * 8, n, d, generator=torch.Generator().manual_seed(4)).requires_grad_()  # native path
    ref = stream_route(conn, 1, H)[:3]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = stream_route(conn, 1, H)[:3]
    assert all(a.dtype == torch.float32 and torch.equal(a, b) for a, b in zip(got, ref))


@pytest.mark.parametrize("design", ["hc", "mhc"])
def test_the_fused_routing_reports_the_weights_it_used(design, monkeypatch):
    """After a training step on the native path, ``path_weights`` (formed from the fused routing's outputs when asked)
    gives the routing weights of that step: the eager path's at fp32 rounding, per token and as token means."""
    model = _routed_model(design, 2, 8)
    x = torch.randint(2, 97, (8, 64), generator=torch.Generator().manual_seed(5))

    def weights():
        model(x, labels=x, use_cache=False).loss.backward()
        return {s: {k: v.clone() for k, v in w.items()} for s, w in model.model.residual_path_weights().items()}

    fused, eager = _native_then_eager(weights, f"{design}_route", monkeypatch)
    assert fused.keys() == eager.keys()
    for s in eager:
        assert fused[s].keys() == eager[s].keys() and {"read", "mix", "write", "pre", "res", "post"} <= eager[s].keys()
        for k in eager[s]:
            torch.testing.assert_close(fused[s][k], eager[s][k], rtol=1e-5, atol=1e-6, msg=f"{s} {k}")


def test_mhc_logits_out_of_the_kernels_range_take_the_log_domain_form(monkeypatch):
    """An mHC whose Sinkhorn logits span more than the linear domain holds (a large static bias): forward and
    backward both run the log-domain form (the same rule on the same logits), with finite results equal to eager."""
    model = tiny_model("mhc", num_hidden_layers=2)
    n = model.config.mhc_streams
    with torch.no_grad():
        for layer in model.model.layers:
            for conn in (layer.attn_connection, layer.mlp_connection):
                conn.static_bias[2 * n :: n + 1] += 80.0  # a dominant diagonal: logits 80 apart
    x = torch.randint(2, 97, (8, 64), generator=torch.Generator().manual_seed(4))
    seen = []
    real = native.sinkhorn
    monkeypatch.setattr(native, "sinkhorn", lambda *a: seen.append(real(*a)) or seen[-1])

    def run():
        model.zero_grad(set_to_none=True)
        model(x, labels=x, use_cache=False).loss.backward()
        return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    grads = run()
    assert seen and all(r is None for r in seen)
    monkeypatch.setattr(depth_ops, "_native_streams", lambda H: False)
    eager = run()
    for k in eager:
        assert torch.isfinite(grads[k]).all()
        torch.testing.assert_close(grads[k], eager[k], atol=1e-6 * max(1.0, eager[k].abs().max().item()), rtol=1e-5)


def _hc_reference(H, WT, sa, sb, a_scale, b_scale, eps):
    """Dynamic HC's routing from the paper's equations (Zhu et al., Algorithm 2), in H's dtype: r = 1 / rms(H),
    P = (H W) r, A = sa + a tanh(P[:, :n+1]), beta = sb + b tanh(P[:, n+1]), x = A[:, 0]^T H, mixed = A[:, 1:]^T H."""
    n = H.shape[-2]
    r = torch.rsqrt(H.pow(2).mean(-1, keepdim=True) + eps)
    P = (H @ WT.T) * r
    T = torch.tanh(P)
    A = sa + a_scale * T[..., : n + 1]
    beta = sb + b_scale * T[..., n + 1]
    return torch.einsum("...s,...sd->...d", A[..., 0], H), torch.einsum("...si,...sd->...id", A[..., 1:], H), A, beta, r, P


@pytest.mark.parametrize("n,d,lead,broadcast", [(4, 64, (3, 37), False), (4, 37, (1, 1), False), (2, 40, (2, 70), False),
                                                (5, 33, (111,), False), (4, 64, (2, 40), True)])
def test_fused_hc_routing_equals_the_equations(n, d, lead, broadcast):
    """``native.hc_route`` / ``hc_mixing`` / ``hc_route_backward`` against the equations in float64 and their
    autograd gradients (H, W = [W_a | w_b], static alpha and beta, both gate scales): d no multiple of 8, one token,
    several 64-token sum blocks, a broadcast first H (the embedding's n copies). ``hc_mixing`` forms the same M bits
    as the route, the mixing's rows equal ``stream_mix`` of that M bit for bit and ``hc_rebuild`` the forward's
    mixing and write; two threads change no bit."""
    from hf_depth.models.functional import write_streams

    g = torch.Generator().manual_seed(n * d)
    H = torch.randn(*lead, 1 if broadcast else n, d, generator=g) * 2
    H = H.expand(*lead, n, d) if broadcast else H
    WT, sa, sb = torch.randn(n + 2, d, generator=g) * 0.1, torch.randn(n, n + 1, generator=g), torch.randn(n, generator=g)
    a_scale, b_scale, eps = torch.tensor(0.3), torch.tensor(-0.2), 1e-8
    leaves = [t.double().requires_grad_() for t in (H, WT, sa, sb, a_scale, b_scale)]
    ref = _hc_reference(*leaves, eps)
    Wa, wb = WT[:-1].T.contiguous(), WT[-1]  # the parameters as HCConnection holds them: W_a [d, n + 1], w_b [d]
    got = native.hc_route(H, Wa, wb, sa, sb, a_scale, b_scale, eps)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.double(), b.detach(), rtol=1e-5, atol=1e-5 * max(1.0, b.abs().max().item()))
    x, mixed, A, beta, r, P = got
    M, beta2 = native.hc_mixing(P, sa, sb, a_scale, b_scale)
    assert torch.equal(M, A.transpose(-1, -2)) and torch.equal(beta2, beta)
    x2, mixed2 = native.stream_mix(M, H, 1)  # the segment rebuild's mixing (training shapes): the same bits
    assert torch.equal(x2, x) and torch.equal(mixed2, mixed)
    y = torch.randn(*lead, d, generator=g)  # the next streams, rebuilt from P: the forward's write, bit for bit
    after = write_streams(mixed.clone(), beta, y, inplace=True)
    assert torch.equal(native.hc_rebuild(H, P, sa, sb, a_scale, b_scale, beta, y), after)
    assert native.hc_rebuild(H, P, sa, sb, a_scale, b_scale, beta, y.bfloat16()) is None
    dx, dmixed, dbeta = (torch.randn(t.shape, generator=g) for t in (x, mixed, beta))
    want = torch.autograd.grad(ref[:4], leaves, (dx.double(), dmixed.double(), torch.zeros_like(ref[2]), dbeta.double()))
    out = native.hc_route_backward(H, Wa, wb, sa, sb, a_scale, b_scale, r, P, dx, dmixed, dbeta)
    dH, dWa, dwb, dsa, dsb, das, dbs = out  # the projections' gradients laid out as the parameters
    assert dWa.shape == Wa.shape and dwb.shape == wb.shape and das.shape == dbs.shape == a_scale.shape
    want = (want[0], want[1][:-1].T, want[1][-1], *want[2:])
    for name, a, b in zip(("H", "W_a", "w_b", "static_alpha", "static_beta", "alpha_scale", "beta_scale"),
                          (dH, dWa, dwb, dsa, dsb, das, dbs), want):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5 * max(1.0, b.abs().max().item()), msg=name)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        again = native.hc_route_backward(H, Wa, wb, sa, sb, a_scale, b_scale, r, P, dx, dmixed, dbeta)
        assert all(torch.equal(a, b) for a, b in zip(out, again))
        assert all(torch.equal(a, b) for a, b in zip(got, native.hc_route(H, Wa, wb, sa, sb, a_scale, b_scale, eps)))
    finally:
        torch.set_num_threads(before)


def test_fused_hc_routing_declines_what_it_does_not_take(monkeypatch):
    """More streams than the kernel's buffers, half precision, mismatched weights: None (the caller's eager steps
    run). In a model, static HC and ``hc_stream_mixing=False`` keep the by-hand steps; dynamic HC fuses."""
    H = torch.randn(2, 9, 9, 16)
    Wa, wb, sa, sb, s = torch.randn(16, 10), torch.randn(16), torch.randn(9, 10), torch.randn(9), torch.tensor(0.1)
    assert native.hc_route(H, Wa, wb, sa, sb, s, s, 1e-8) is None  # n = 9 > MAX_HC_STREAMS
    H4, Wa = torch.randn(2, 9, 4, 16), Wa[:, :5].contiguous()
    assert native.hc_route(H4.bfloat16(), Wa, wb, sa[:4, :5], sb[:4], s, s, 1e-8) is None
    assert native.hc_route(H4, Wa[:, :4], wb, sa[:4, :5], sb[:4], s, s, 1e-8) is None  # W_a of n columns, not n + 1
    assert native.hc_route(H4, Wa, wb[:15], sa[:4, :5], sb[:4], s, s, 1e-8) is None
    assert native.hc_route(H4, Wa, wb, sa[:4, :5], sb[:4], torch.ones(2), s, 1e-8) is None  # a scale of 2 values
    got = native.hc_route(H4, Wa, wb, sa[:4, :5], sb[:4], s, s, 1e-8)
    # the gate scales are read through their pointers: a Python number, a 1-element or a float64 tensor alike; a
    # non-contiguous or float64 W_a is read from an fp32 contiguous copy
    for args in ((Wa, wb, 0.1, s), (Wa, wb, s.view(1), s), (Wa, wb, s.double(), s), (Wa.T.contiguous().T, wb, s, s),
                 (Wa.double(), wb, s, s)):
        assert all(torch.equal(a, b) for a, b in zip(got, native.hc_route(H4, args[0], args[1], sa[:4, :5], sb[:4],
                                                                          *args[2:], 1e-8)))
    calls = []
    real = native.hc_route
    monkeypatch.setattr(native, "hc_route", lambda *a: calls.append(1) or real(*a))
    x = torch.randint(2, 97, (8, 64), generator=torch.Generator().manual_seed(3))
    for extra, fused in (({}, True), ({"hc_dynamic": False}, False), ({"hc_stream_mixing": False}, False)):
        calls.clear()
        model = tiny_model("hc", num_hidden_layers=1, **extra)
        model(x, labels=x, use_cache=False).loss.backward()
        assert bool(calls) == fused, extra


def _mhc_reference(H, proj, bias, alpha, tanh, columns_first, iters):
    """mHC's routing after its projection from the equations (Xie et al.): u = tanh(proj) or proj, pre = sigmoid(a0 u
    + b), post = 2 sigmoid(a1 u + b), res = Sinkhorn(a2 u + b as n x n; of the transpose, transposed back, for
    columns first), x = pre^T H, mixed = res H; functional.sinkhorn (log domain) in H's dtype."""
    from hf_depth.models.functional import sinkhorn

    n = H.shape[-2]
    u = torch.tanh(proj) if tanh else proj
    pre = torch.sigmoid(alpha[0] * u[..., :n] + bias[:n])
    post = 2 * torch.sigmoid(alpha[1] * u[..., n : 2 * n] + bias[n : 2 * n])
    logits = (alpha[2] * u[..., 2 * n :] + bias[2 * n :]).unflatten(-1, (n, n))
    res = sinkhorn(logits.transpose(-1, -2), iters).transpose(-1, -2) if columns_first else sinkhorn(logits, iters)
    return torch.einsum("...s,...sd->...d", pre, H), res @ H, torch.cat((pre.unsqueeze(-2), res), -2), post


@pytest.mark.parametrize("n,d,lead,tanh,columns_first", [(4, 64, (3, 37), False, False), (4, 37, (1, 1), True, False),
                                                         (2, 40, (2, 70), False, True), (5, 33, (111,), True, True)])
def test_fused_mhc_routing_equals_the_equations(n, d, lead, tanh, columns_first):
    """``native.mhc_route`` / ``mhc_route_backward`` (plus the caller's two projection products) against the
    equations in float64 and their autograd gradients (H through the mixing and the projection, phi, bias, the three
    gate scales); ``stream_mix_write`` is the forward's mixing and write bit for bit; two threads change no bit;
    logits out of the linear-domain range, more than 8 streams or no Sinkhorn round are declined."""
    from hf_depth.models.design_hc import normalized_projection
    from hf_depth.models.functional import write_streams

    g = torch.Generator().manual_seed(n * d + 1)
    C, iters = n * n + 2 * n, 20
    H = torch.randn(*lead, n, d, generator=g)
    phi, bias, alpha = torch.randn(n * d, C, generator=g) * 0.1, torch.randn(C, generator=g), torch.tensor([0.7, -0.5, 1.3])
    leaves = [t.double().requires_grad_() for t in (H, phi, bias, alpha)]
    X64 = leaves[0].flatten(-2)
    proj64 = X64 @ leaves[1] * torch.rsqrt(X64.pow(2).mean(-1, keepdim=True) + 1e-6)
    ref = _mhc_reference(leaves[0], proj64, leaves[2], leaves[3], tanh, columns_first, iters)
    r, proj = normalized_projection(H.flatten(-2), phi.T, 1e-6)
    args = (bias, alpha, tanh, columns_first, iters)
    raw = H.flatten(-2) @ phi  # the kernel normalizes the product in place and returns r
    got = native.mhc_route(H, raw, *args, 1e-6)
    torch.testing.assert_close(raw, proj, rtol=1e-5, atol=1e-5 * proj.abs().max().item())
    torch.testing.assert_close(got[4], r, rtol=1e-6, atol=0)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.double(), b.detach(), rtol=1e-5, atol=1e-5 * max(1.0, b.abs().max().item()))
    x, mixed, M, post, _ = got
    y = torch.randn(*lead, d, generator=g)
    # the one-pass mixing (``mix_streams``' rows at training shapes, the kernel's here), then the in-place write
    assert torch.equal(native.stream_mix_write(M, H, post, y), write_streams(native.stream_mix(M, H, 1)[1], post, y, inplace=True))
    dx, dmixed, dpost = (torch.randn(t.shape, generator=g) for t in (x, mixed, post))
    want = torch.autograd.grad((ref[0], ref[1], ref[3]), leaves, (dx.double(), dmixed.double(), dpost.double()))
    out = native.mhc_route_backward(H, proj, r, M, *args, dx, dmixed, dpost)
    dH, dQ, dbias, dalpha = out
    X = H.flatten(-2).reshape(-1, n * d)
    dH = dH.clone()
    dH.view(-1, n * d).addmm_(dQ, phi.T)
    for name, a, b in zip(("H", "phi", "bias", "alpha"), (dH, (dQ.T @ X).T, dbias, dalpha), want):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5 * max(1.0, b.abs().max().item()), msg=name)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert all(torch.equal(a, b) for a, b in zip(out, native.mhc_route_backward(H, proj, r, M, *args, dx, dmixed, dpost)))
        assert all(torch.equal(a, b) for a, b in zip(got, native.mhc_route(H, H.flatten(-2) @ phi, *args, 1e-6)))
    finally:
        torch.set_num_threads(before)
    wide = bias.clone()
    wide[2 * n] = 80.0  # one logit 80 above the others: out of the linear domain's range, for forward and backward
    assert native.mhc_route(H, proj.clone(), wide, *args[1:], 1e-6) is None
    assert native.mhc_route_backward(H, proj, r, M, wide, *args[1:], dx, dmixed, dpost) is None
    assert native.mhc_route(H, proj.clone(), bias, alpha, tanh, columns_first, 0, 1e-6) is None


def test_fused_mhc_routing_declines_more_streams_than_its_buffers():
    n, d = 9, 16
    H = torch.randn(2, 5, n, d)
    proj, bias = torch.randn(2, 5, n * n + 2 * n), torch.randn(n * n + 2 * n)
    assert native.mhc_route(H, proj, bias, torch.ones(3), False, False, 20, 1e-6) is None


@pytest.mark.parametrize("design,op", [("hc", "hc_route_backward"), ("mhc", "mhc_route_backward")])
def test_a_fused_forward_whose_backward_declines_takes_the_by_hand_steps(design, op, monkeypatch):
    """The fused forward ran but its backward returns None: the by-hand backward from the same M gives the eager
    gradients (1e-6); the rebuild still runs the fused rebuild."""
    model = _routed_model(design, 2, 9)
    x = torch.randint(2, 97, (8, 64), generator=torch.Generator().manual_seed(4))

    def grads():
        model.zero_grad(set_to_none=True)
        model(x, labels=x, use_cache=False).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    declined, eager = _native_then_eager(grads, op, monkeypatch, decline=True)
    assert declined.keys() == eager.keys()
    for name in eager:
        scale = max(1.0, eager[name].abs().max().item())
        torch.testing.assert_close(declined[name], eager[name], atol=1e-6 * scale, rtol=1e-5, msg=name)


# --------------------------------------------------------------------------- AttnRes' depth softmax (attnres_agg.c)
def _agg_reference(z, V, P, qg, eps, dout):
    """float64 autograd of the kernels' function: the logits z [K, N] and the sources V [K, N, d] as independent
    leaves (the caller's products own d z / d v), the partial P [N, d] through its logit and its weight."""
    z, V, qg, dout = (t.double().detach().requires_grad_() for t in (z, V, qg, dout))
    P = None if P is None else P.double().detach().requires_grad_()
    logits, terms = z, (V,)
    rp = zp = None
    if P is not None:
        rp = torch.rsqrt(P.pow(2).mean(-1) + eps)
        zp = rp * (P @ qg)
        zp.retain_grad()
        logits, terms = torch.cat((z, zp.unsqueeze(0))), (V, P.unsqueeze(0))
    p = torch.softmax(logits, dim=0)
    out = (p.unsqueeze(-1) * torch.cat(terms)).sum(0)
    (out * dout).sum().backward()
    a = None if P is None else zp.grad * rp
    return {"out": out, "p": p.t(), "rp": rp, "zp": zp, "DZ": z.grad, "dV": V.grad,
            "dP": None if P is None else P.grad, "a": a}


@pytest.mark.parametrize("K,N,d,partial", [(1, 5, 20, True), (3, 70, 64, False), (9, 37, 37, True), (1, 1, 8, False),
                                           (4, 130, 48, True), (70, 21, 24, True)])
def test_aggregation_kernels_equal_the_equations(K, N, d, partial):
    """``agg_forward`` / ``agg_backward`` against float64 autograd of AttnRes' depth softmax: the output, the weights
    (token-major), the partial's 1 / rms and logit, the logits' and the sources' gradients (added into the
    accumulator in place) and the partial's, for one or several sources, with and without a partial sum, d no
    multiple of the 8 lanes, one token, token counts no multiple of a chunk, several threads' worth, 70 sources;
    slot strides of the caller's buffers."""
    g = torch.Generator().manual_seed(K * 100 + N)
    Vbank = torch.randn(K + 2, N, d, generator=g)  # a bank's first K slots
    V = Vbank[:K]
    qg = torch.randn(d, generator=g) * 0.5
    zbuf = torch.randn(3, K + 4, N, generator=g)
    z = zbuf[1, :K]  # a consumer's row of the two-phase logits [C, capacity, N]
    P = torch.randn(N, d, generator=g) * 3 if partial else None
    dout = torch.randn(N, d, generator=g)
    ref = _agg_reference(z, V, P, qg, 1e-6, dout)
    out, p, rp, zp = native.agg_forward(z, V, P, qg, 1e-6)
    _close(out, ref["out"].float())
    _close(p, ref["p"].float())
    if partial:
        _close(rp, ref["rp"].float())
        _close(zp, ref["zp"].float())
    else:
        assert rp is None and zp is None and p.shape == (N, K)
    DZ = torch.full((2, K + 1, N), float("nan"))
    dV0 = torch.randn(K + 3, N, d, generator=g)
    dV = dV0.clone()
    dP, a = native.agg_backward(z, V, P, qg, rp, zp, dout, DZ[1, :K], dV[:K])
    _close(DZ[1, :K], ref["DZ"].float())
    assert torch.isnan(DZ[0]).all() and torch.isnan(DZ[1, K:]).all()  # only the consumer's row is written
    _close(dV[:K] - dV0[:K], ref["dV"].float())
    assert torch.equal(dV[K:], dV0[K:])
    if partial:
        _close(dP, ref["dP"].float())
        _close(a, ref["a"].float())
    else:
        assert dP is None and a is None
    # the deferred form: no accumulator, the weights written slot-major for a later sum (the same logit gradients)
    PW, DZp = torch.full((K + 2, N), float("nan")), torch.full((K, N), float("nan"))
    deferred = native.agg_backward(z, V, P, qg, rp, zp, dout, DZp, None, PW[1:K + 1])
    assert torch.equal(DZp, DZ[1, :K])
    assert all(x is None and y is None or torch.equal(x, y) for x, y in zip((dP, a), deferred))
    _close(PW[1:K + 1], ref["p"][:, :K].t().float())
    assert torch.isnan(PW[0]).all() and torch.isnan(PW[K + 1]).all()
    before = torch.get_num_threads()
    try:  # tokens split over threads: the same bits
        torch.set_num_threads(2)
        again = native.agg_forward(z, V, P, qg, 1e-6)
        dV2 = dV0.clone()
        DZ2 = torch.full((2, K + 1, N), float("nan"))
        back2 = native.agg_backward(z, V, P, qg, rp, zp, dout, DZ2[1, :K], dV2[:K])
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(x, y) for x, y in zip((out, p), again[:2]))
    assert torch.equal(dV2, dV) and torch.equal(DZ2[1, :K], DZ[1, :K])
    assert all(x is None and y is None or torch.equal(x, y) for x, y in zip((dP, a), back2))


def test_aggregation_kernels_decline_what_they_do_not_take():
    K, N, d = 3, 6, 16
    z, V, P, qg = torch.randn(K, N), torch.randn(K, N, d), torch.randn(N, d), torch.randn(d)
    assert native.agg_forward(z, V.bfloat16(), P, qg, 1e-6) is None
    assert native.agg_forward(z.t().contiguous().t(), V, P, qg, 1e-6) is None  # tokens not contiguous
    assert native.agg_forward(z, V.transpose(1, 2).contiguous().transpose(1, 2), P, qg, 1e-6) is None
    assert native.agg_forward(z, V, P[:-1], qg, 1e-6) is None
    assert native.agg_forward(z, V, P, qg[:-1], 1e-6) is None
    assert native.agg_forward(z[:-1], V, P, qg, 1e-6) is None
    assert native.agg_forward(z[:0], V[:0], P, qg, 1e-6) is None  # no stable source
    _, _, rp, zp = native.agg_forward(z, V, P, qg, 1e-6)
    dV, DZ = torch.zeros(K, N, d), torch.zeros(K, N)
    assert native.agg_backward(z, V, P, qg, rp, zp, torch.randn(N, d).t().contiguous().t(), DZ, dV) is None
    assert native.agg_backward(z, V, P, qg, rp, zp, torch.randn(N, d), DZ, dV.double()) is None
    assert native.agg_backward(z, V, P, qg, rp, zp, torch.randn(N, d), DZ[:, :-1], dV) is None
    assert native.agg_backward(z, V, P, qg, rp, zp, torch.randn(N, d), DZ, None) is None  # neither dV nor PW
    assert native.agg_backward(z, V, P, qg, rp, zp, torch.randn(N, d), DZ, None, torch.zeros(K, N + 1)) is None
    assert not dV.any() and not DZ.any()  # a declined call writes nothing


@pytest.mark.parametrize("group", [1, 3, 8, 100])
@pytest.mark.parametrize("pattern", ["full", "block"])
def test_grouped_slot_grads_sum_every_consumer_once(group, pattern):
    """``SlotGrads`` with an accumulator (AttnRes' bank gradients), driven as a backward drives it: consumers in
    reverse forward order, each adding its (weights, x) and, where it is a slot's first reader, asking for the slots
    it wrote; some consumers add into the accumulator themselves (the eager form). Every handed-on slot equals the
    float64 sum of every consumer's part (K no multiple of 4, d no multiple of 8); a slot handed on never changes
    again; at most ``group`` records are held at any time."""
    g = torch.Generator().manual_seed(group)
    cap, N, d = 11, 37, 21
    if pattern == "full":  # consumer c reads slots 0..c and wrote slot c
        reads, wrote = [c + 1 for c in range(cap)], [(c, c + 1) for c in range(cap)]
    else:  # blocks: a block's consumers read the same slots; its first consumer wrote the new one
        reads = [1, 1, 2, 2, 2, 4, 4, 7, 7, 7, 7, 9]
        wrote = [(0, 1), None, (1, 2), None, None, (2, 4), None, (4, 7), None, None, None, (7, 9)]
    into = torch.zeros(cap, 1, 1, N, d)
    recs = native.SlotGrads(into.shape, into=into, group=group)
    want = torch.zeros(cap, N, d, dtype=torch.float64)
    handed, held = {}, []
    for c in reversed(range(len(reads))):
        K = reads[c]
        w, x = torch.rand(K, 1, 1, N, generator=g), torch.randn(1, 1, N, d, generator=g)
        want[:K] += w.double().view(K, N, 1) * x.double().view(1, N, d)
        if c % 3 == 1:  # an eager consumer: its part straight into the accumulator
            into[:K] += (w.view(K, N, 1) * x.view(1, N, d)).view(K, 1, 1, N, d)
        else:
            recs.add(w, x)
        held.append(len(recs.keep))
        if wrote[c] is not None:
            lo, hi = wrote[c]
            got = recs.grads(lo, hi)
            assert got.data_ptr() == into[lo].data_ptr()  # the accumulator's own rows
            for j in range(lo, hi):
                handed[j] = got[j - lo].clone()
    assert max(held) <= group
    assert sorted(handed) == list(range(max(r for r in reads)))
    for j, t in handed.items():
        torch.testing.assert_close(t.view(N, d).double(), want[j], atol=1e-5, rtol=1e-5, msg=f"slot {j}")
        assert torch.equal(into[j], t)  # never added to after it was handed on


def test_slot_grads_refuse_a_wrong_accumulator():
    with pytest.raises(ValueError, match="into must be a contiguous fp32"):
        native.SlotGrads((4, 1, 1, 5, 8), into=torch.zeros(4, 1, 1, 5, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="group >= 1"):
        native.SlotGrads((4, 1, 1, 5, 8), into=torch.zeros(4, 1, 1, 5, 8), group=0)


SLOT_GRAD_CASES = {  # (B, H, Hkv, T, hd, slots read per consumer): the tile (tokens of all kv heads) in every form
    "mha_model_layout": (2, 4, 4, 300, 64, (2, 4, 6, 8, 10)),  # 128-token chunks, 44 left over; 25-token tiles
    "gqa_rep3": (1, 6, 2, 45, 8, (3, 7, 1, 9, 9, 4)),  # heads of a kv head summed in order
    "one_token_tiles": (1, 2, 1, 37, 96, (40, 13, 41)),  # nj x hd above the tile: one token per tile
    "mqa_odd_hd": (3, 4, 1, 9, 12, (2, 1, 2)),
}


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("case", sorted(SLOT_GRAD_CASES))
def test_moda_slot_grads_equal_the_sums(case, strided):
    """``moda_slot_grads`` (each slot summed once over its consumers, a tile of tokens at a time) against float64
    sums G[j] = sum_i sum_(heads of a kv head) W_i[j] X_i, for slot ranges that start at 0, in the middle and at the
    last slot; X as the attention makes it (a transposed [B, T, H, hd], strided) or with a strided last dim (the
    per-element form); ``SlotGrads`` with an accumulator adds the same sums into it."""
    B, H, Hkv, T, hd, reads = SLOT_GRAD_CASES[case]
    g = torch.Generator().manual_seed(len(case))
    ws = [torch.rand(k, B, H, T, generator=g) for k in reads]
    xs = [torch.randn(B, T, H, hd, generator=g).transpose(1, 2) for _ in reads]
    if strided:
        xs = [x.transpose(2, 3).contiguous().transpose(2, 3) for x in xs]  # last-dim stride T
    cap = max(reads)
    want = torch.zeros(cap, B, Hkv, T, hd, dtype=torch.float64)
    for w, x in zip(ws, xs):
        part = w.double().unsqueeze(-1) * x.double().unsqueeze(0)  # [k, B, H, T, hd]
        want[: w.shape[0]] += part.view(w.shape[0], B, Hkv, H // Hkv, T, hd).sum(3)
    for lo, hi in ((0, cap), (1, min(3, cap)), (cap - 1, cap)):
        got = native.moda_slot_grads(ws, xs, lo, hi, Hkv)
        torch.testing.assert_close(got.double(), want[lo:hi], atol=1e-5, rtol=1e-5, msg=f"slots {lo}:{hi}")
    into = torch.randn(cap, B, Hkv, T, hd, generator=g)
    base = into.double()
    acc = native.SlotGrads(into.shape, into=into, group=2)
    for w, x in zip(ws, xs):
        acc.add(w, x)
    acc.grads(0, cap)
    torch.testing.assert_close(into.double(), base + want, atol=1e-5, rtol=1e-5)


def test_slot_grads_of_an_ask_own_their_buffer():
    """Without an accumulator, each ask's slot gradients are a buffer of the ask's size (the allocator hands back the
    previous pair's, still in cache; nothing bank-sized lives until the backward ends), and a later ask writes no
    earlier one."""
    B, H, Hkv, T, hd = 2, 4, 2, 9, 8
    g = torch.Generator().manual_seed(5)
    acc = native.SlotGrads((6, B, Hkv, T, hd))
    for k in (6, 4, 2):
        acc.add(torch.rand(k, B, H, T, generator=g), torch.randn(B, H, T, hd, generator=g))
    first = acc.grads(4, 6)
    kept = first.clone()
    second, empty = acc.grads(2, 4), acc.grads(3, 3)
    for G, n in ((first, 2), (second, 2), (empty, 0)):
        assert G.shape == (n, B, Hkv, T, hd) and G.is_contiguous()
        assert G.untyped_storage().nbytes() == G.numel() * 4  # not a view of a bank-sized buffer
    assert torch.equal(first, kept)


@pytest.mark.parametrize("design", ["attnres", "block_attnres"])
@pytest.mark.parametrize("group", [1, 3])
def test_model_bank_gradient_groups_equal_eager(design, group, monkeypatch):
    """AttnRes' bank gradients summed by groups of ``group`` native consumers (a flush after every consumer, and
    flushes that fall between slots' hand-overs) give the eager form's logits and gradients at fp32 rounding, with
    2 threads and activation checkpointing bit for bit."""
    monkeypatch.setattr(depth_ops, "AGG_GROUP", group)
    model = tiny_model(design, num_hidden_layers=7, **({"attnres_block_size": 3} if design == "block_attnres" else {}))
    _aggregation_model_equals_eager(model, 5, monkeypatch)


def test_the_slot_write_kernel_copies_and_normalizes():
    """``native.slot_write``: slot i of a bank := x, each row's 1 / rms equal to ``depth_ops._rinv``'s at fp32
    rounding, the other slots untouched; rows a view can reach are read in place; what it does not take is declined
    with nothing written."""
    from hf_depth.models.depth_ops import _rinv

    g = torch.Generator().manual_seed(11)
    data, rinv = torch.zeros(4, 3, 5, 16), torch.zeros(4, 3, 5)
    x = torch.randn(3, 5, 16, generator=g) * 3
    strided = torch.randn(3, 10, 16, generator=g)[:, ::2]  # rows 2 apart: a [15, 16] view with a row stride of 32
    for i, src in ((2, x), (0, strided)):
        assert native.slot_write(src, data, rinv, i, 1e-6)
        assert torch.equal(data[i], src)
        torch.testing.assert_close(rinv[i], _rinv(src, 1e-6), rtol=1e-6, atol=0)
    assert not data[[1, 3]].any() and not rinv[[1, 3]].any()
    before = data.clone(), rinv.clone()
    for src, bank, r in ((x.bfloat16(), data, rinv), (x, data.double(), rinv), (x[:, :4], data, rinv),
                         (x.transpose(0, 1).contiguous().transpose(0, 1)[:, ::2], data[:, :, :3], rinv[:, :, :3]),
                         (x, data, rinv[:, :, :4])):
        assert not native.slot_write(src, bank, r, 1, 1e-6)
    assert torch.equal(data, before[0]) and torch.equal(rinv, before[1])


@pytest.mark.parametrize("design,extra", [("attnres", {}), ("block_attnres", {"attnres_block_size": 2}),
                                          ("block_attnres", {"attnres_block_size": 3})])
@pytest.mark.parametrize("layers", [1, 2, 7])
def test_model_aggregation_kernels_equal_eager(design, extra, layers, monkeypatch):
    """Full and Block AttnRes with queries and key norms away from their init (zero queries give uniform weights,
    which would hide a softmax error): logits and every parameter gradient equal the eager form's at fp32 rounding;
    neither the thread count nor activation checkpointing changes a bit."""
    extra = {k: min(v, 2 * layers) for k, v in extra.items()}  # a block holds at most every sublayer
    _aggregation_model_equals_eager(tiny_model(design, num_hidden_layers=layers, **extra), 3, monkeypatch)


def _aggregation_model_equals_eager(model, seed: int, monkeypatch):
    """``_model_kernels_equal_eager`` for AttnRes' aggregation kernels, queries and key norms moved off their init."""
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        for name, p in model.named_parameters():
            if "query" in name or "key_norm" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randint(2, 97, (4, 40), generator=torch.Generator().manual_seed(seed))
    ops = ("agg_forward", "agg_backward")

    def to_eager():
        for op in ops:
            monkeypatch.setattr(native, op, lambda *a: None)  # every call declines: the eager form
        monkeypatch.setattr(native, "slot_write", lambda *a: False)  # and the bank's slots: copy and 1 / rms by ops

    _model_kernels_equal_eager(model, x, ops, to_eager, monkeypatch)
