"""Every Triton kernel vs its PyTorch reference (forward and gradients), run on CPU under TRITON_INTERPRET=1.

Shapes are tiny but awkward (non-power-of-two widths, row counts that leave a partial last block, one row,
n=1 / n=4 streams, S=1 / S=70 sources); every kernel output is NaN-poisoned before launch so an unwritten
element fails. fp32 is compared tightly, bf16 by RMS-relative error. The whole-model test runs every
registered design with HF_DEPTH_KERNELS=triton against HF_DEPTH_KERNELS=torch.
"""

import platform

import pytest
import torch
from helpers import batch, tiny_model

if platform.system() != "Linux" or platform.machine() not in ("x86_64", "aarch64"):  # pyproject's triton marker
    pytest.importorskip("triton", reason="no Triton wheel for this platform: every op runs its PyTorch reference")

import hf_depth  # noqa: E402
import hf_depth.kernels as K  # noqa: E402  (Linux x86_64 / aarch64: triton is a dependency, never skipped on CI)
from hf_depth.kernels import _common  # noqa: E402
from hf_depth.models import dispatch  # noqa: E402
from hf_depth.models import functional as F  # noqa: E402

TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2}  # fp32: max abs err / (max |ref| + 1); bf16: RMS-relative


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(_common, "POISON", True)


def _close(out, ref, dtype, what):
    out, ref = out.double(), ref.double()
    assert out.shape == ref.shape, what
    assert torch.isfinite(out).all(), f"{what}: non-finite values (unwritten output?)"
    if dtype == torch.float32:
        err = ((out - ref).abs().max() / (ref.abs().max() + 1)).item()
    else:
        err = ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-12)).item()
    assert err < TOL[dtype], f"{what}: error {err:.2e} >= {TOL[dtype]:.0e}"


def _run(fn, args, dtype, compute, seed):
    """fn on leaves = args rounded to ``dtype`` then cast to ``compute``; returns (outputs, grads of the leaves)."""
    leaf = lambda x: x.to(dtype).to(compute).detach().requires_grad_() if isinstance(x, torch.Tensor) else x
    leaves = [[leaf(x) for x in a] if isinstance(a, list) else leaf(a) for a in args]
    out = fn(*leaves)
    out = list(out) if isinstance(out, (tuple, list)) else [out]
    g = torch.Generator().manual_seed(seed)
    loss = sum((o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64)).sum() for o in out)
    flat = [x for a in leaves for x in (a if isinstance(a, list) else [a]) if isinstance(x, torch.Tensor)]
    return out, torch.autograd.grad(loss, flat)


def check(name, args, dtype=torch.float32, seed=0):
    """Compare the kernel's outputs and the grads of every tensor input with the reference's: fp32 against the
    fp32 reference; bf16 against the reference evaluated in fp64 on the same bf16 inputs (the bf16 reference
    rounds more than the kernels do), with dtypes checked against the bf16 reference."""
    out, grads = _run(getattr(K, name), args, dtype, dtype, seed)
    ref_out, _ = _run(getattr(F, name), args, dtype, dtype, seed)
    for i, (o, r) in enumerate(zip(out, ref_out, strict=True)):
        assert o.dtype == r.dtype, f"{name} output {i}: dtype {o.dtype} != {r.dtype}"
    if dtype != torch.float32:
        ref_out, _ = _run(getattr(F, name), args, dtype, torch.float64, seed)
    ref_grads = _run(getattr(F, name), args, dtype, ref_out[0].dtype if dtype == torch.float32 else torch.float64,
                     seed)[1]
    for i, (o, r) in enumerate(zip(out, ref_out)):
        _close(o, r, dtype, f"{name} output {i}")
    for i, (o, r) in enumerate(zip(grads, ref_grads, strict=True)):
        _close(o, r, dtype, f"{name} grad {i}")


def rnd(*shape, scale=1.0):
    return torch.randn(*shape) * scale


DTYPES = [torch.float32, torch.bfloat16]


# --------------------------------------------------------------------------- norms, SwiGLU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 37), (70, 37), (3, 7, 1000)])  # 1 row; partial block; 6 blocks > 4 programs
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm(shape, weighted, dtype):
    torch.manual_seed(0)
    w = 1 + 0.1 * rnd(shape[-1]) if weighted else None
    check("rms_norm", [rnd(*shape, scale=3), w, 1e-6], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_multi(dtype):
    torch.manual_seed(1)
    d = 45
    check("rms_norm_multi", [rnd(3, 11, d), [1 + 0.1 * rnd(d), None, rnd(d)], 1e-6], dtype)
    check("rms_norm_multi", [rnd(1, d), [None, None], 1e-6], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 37), (70, 37)])
@pytest.mark.parametrize("weighted", [True, False])
def test_add_rms_norm(shape, weighted, dtype):
    torch.manual_seed(2)
    w = 1 + 0.1 * rnd(shape[-1]) if weighted else None
    check("add_rms_norm", [rnd(*shape), rnd(*shape), w, 1e-6], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 7), (3, 1500)])  # 4500 elements: a partial second block of 4096
def test_swiglu(shape, dtype):
    torch.manual_seed(3)
    check("swiglu", [rnd(*shape, scale=3), rnd(*shape)], dtype)


# --------------------------------------------------------------------------- HC / mHC
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("lead,d", [((1,), 37), ((5,), 300)])  # d=300: two column blocks of 256; 5 = 2+2+1
def test_hc_width_depth(n, lead, d, dtype):
    torch.manual_seed(4)
    check("hc_width", [rnd(*lead, n, d), rnd(*lead, n, n + 1)], dtype)
    check("hc_depth", [rnd(*lead, n, d), rnd(*lead, n), rnd(*lead, d)], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 4])
def test_mhc_width_depth(n, dtype):
    torch.manual_seed(5)
    lead, d = (3, 7), 45
    res = F.sinkhorn(rnd(*lead, n, n))
    check("mhc_width", [rnd(*lead, n, d), torch.rand(*lead, n), res], dtype)
    check("mhc_depth", [rnd(*lead, n, d), 2 * torch.rand(*lead, n), rnd(*lead, d)], dtype)


@pytest.mark.parametrize("n,m,iters", [(1, 3, 20), (3, 5, 7), (4, 21, 20), (4, 2, 0)])  # 21 > 16 per program
def test_sinkhorn(n, m, iters):
    torch.manual_seed(6)
    check("sinkhorn", [rnd(m, n, n, scale=2), iters])
    check("sinkhorn", [rnd(2, m, n, n), iters], torch.bfloat16)


@pytest.mark.parametrize("n", [1, 4])
def test_mhc_coefficients(n):
    torch.manual_seed(7)
    d = 13
    k = n * n + 2 * n
    check("mhc_coefficients", [rnd(2, 5, n, d), rnd(n * d, k, scale=0.2), torch.rand(3), rnd(k), 20, 1e-6])


@pytest.mark.parametrize("tanh,columns_first", [(True, False), (False, True), (True, True)])
def test_mhc_coefficients_depthbench_forms(tanh, columns_first):
    """DepthBench's torch backend forms (``mhc_dynamic_tanh``, ``mhc_sinkhorn_order="columns_first"``)."""
    torch.manual_seed(7)
    n, d = 4, 13
    k = n * n + 2 * n
    check("mhc_coefficients", [rnd(2, 5, n, d), rnd(n * d, k, scale=0.2), torch.rand(3), rnd(k), 20, 1e-6, tanh,
                               columns_first])


def test_hc_coefficients_stays_in_torch():
    # documented choice (kernels/hc.md): the dynamic HC coefficients are a skinny GEMM left to PyTorch
    assert K.hc_coefficients is F.hc_coefficients


# --------------------------------------------------------------------------- AttnRes
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("S,lead,d", [(1, (200,), 37), (1, (1,), 64), (70, (2, 3), 37)])  # 200 tokens: 7 blocks
@pytest.mark.parametrize("weighted", [True, False])
def test_depth_softmax(S, lead, d, weighted, dtype):
    torch.manual_seed(8)
    w = 1 + 0.1 * rnd(d) if weighted else None
    check("depth_softmax", [rnd(d, scale=0.3), w, rnd(S, *lead, d, scale=2), 1e-6], dtype)


# --------------------------------------------------------------------------- plumbing
def test_bf16_stores_round_to_nearest_even():
    """bf16 outputs equal torch's (RTNE) rounding, not the interpreter's truncation: near bit-exact RMSNorm."""
    torch.manual_seed(9)
    x = torch.randn(16, 37).bfloat16()
    out, ref = K.rms_norm(x, None, 1e-6), F.rms_norm(x, None, 1e-6)
    assert (out != ref).float().mean() < 0.02  # only where fp32 rsqrt sits on a rounding boundary
    x = torch.randn(4096)
    y = K.swiglu(x.bfloat16(), torch.ones(4096, dtype=torch.bfloat16))
    assert (y == F.swiglu(x.bfloat16().float(), torch.ones(4096)).bfloat16()).all()


def test_poison_fills_outputs():
    assert torch.isnan(_common.new((3, 2), torch.bfloat16, "cpu")).all()


def test_custom_ops_trace_under_compile():
    """The custom ops' fake implementations let torch.compile trace forward and backward without graph breaks."""
    x = torch.randn(5, 37, requires_grad=True)
    w = torch.randn(37, requires_grad=True)
    fn = torch.compile(lambda x, w: K.rms_norm(x, w, 1e-6).square().sum(), backend="aot_eager", fullgraph=True)
    gx, gw = torch.autograd.grad(fn(x, w), (x, w))
    rx, rw = torch.autograd.grad(F.rms_norm(x, w, 1e-6).square().sum(), (x, w))
    torch.testing.assert_close((gx, gw), (rx, rw), atol=2e-5, rtol=1e-4)


def _op_cases():
    r = torch.randn
    M, D, n = 5, 12, 3
    yield "rms_norm_fwd", (r(M, D), r(M, D), r(2, D), 2, 1e-6)
    yield "rms_norm_fwd", (r(M, D).bfloat16(), None, None, 1, 1e-6)
    yield "rms_norm_bwd", (r(2, M, D), r(M, D), r(M, D), r(2, D), r(M).abs())
    yield "rms_norm_bwd", (r(1, M, D), None, r(M, D), None, r(M).abs())
    yield "swiglu_fwd", (r(M, D), r(M, D))
    yield "swiglu_bwd", (r(M, D), r(M, D), r(M, D))
    yield "mix_width_fwd", (r(M, n, D), r(M, n, n + 1))
    yield "mix_width_bwd", (r(M, D), r(M, n, D), r(M, n, D), r(M, n, n + 1))
    yield "mix_depth_fwd", (r(M, n, D), r(M, n), r(M, D))
    yield "mix_depth_bwd", (r(M, n, D), r(M, n), r(M, D))
    yield "sinkhorn_fwd", (r(M, n, n), 3)
    yield "sinkhorn_bwd", (r(M, n, n), r(M, n, n), torch.rand(M, n, n), 3)
    yield "depth_softmax_fwd", (r(D), r(D), r(4, M, D), 1e-6)
    yield "depth_softmax_bwd", (r(M, D), r(M, 4), r(D), None, r(4, M, D), r(M, D), torch.rand(M, 4), 1e-6)


@pytest.mark.parametrize("name,args", list(_op_cases()), ids=lambda v: v if isinstance(v, str) else "")
def test_custom_op_fake_matches(name, args):
    """Fake (meta) implementations give the real outputs' shapes and dtypes (what torch.compile / FSDP2 trust)."""
    for op in K.OPS:  # the op modules load lazily; loading them registers the custom ops
        getattr(K, op)
    torch.library.opcheck(getattr(torch.ops.hf_depth, name), args, test_utils=("test_schema", "test_faketensor"))


def test_env_var(monkeypatch):
    x = torch.randn(2, 8)
    monkeypatch.setenv("HF_DEPTH_KERNELS", "cuda")
    with pytest.raises(ValueError, match="HF_DEPTH_KERNELS"):
        dispatch.rms_norm(x, None, 1e-6)
    monkeypatch.setenv("HF_DEPTH_KERNELS", "torch")
    assert not dispatch.use_triton(x)
    monkeypatch.setenv("HF_DEPTH_KERNELS", "triton")
    assert dispatch.use_triton(x)  # CPU + TRITON_INTERPRET=1 (conftest)
    monkeypatch.setenv("HF_DEPTH_KERNELS", "auto")
    assert not dispatch.use_triton(x)  # auto never interprets on CPU
    monkeypatch.setenv("HF_DEPTH_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="CUDA"):
        dispatch.rms_norm(x, None, 1e-6)


class _Spy:
    """Stands in for hf_depth.kernels in dispatch and counts which kernels the model really called (an op with no
    kernel, e.g. one a design adds to dispatch later, runs its reference and is counted under ``reference:``)."""

    def __init__(self):
        self.calls = {}

    def __getattr__(self, name):
        fn = getattr(K, name) if name in K.OPS else F.REFERENCES[name]
        name = name if name in K.OPS else f"reference:{name}"

        def call(*a, **kw):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*a, **kw)

        return call


def _train_step(design, monkeypatch, mode):
    monkeypatch.setenv("HF_DEPTH_KERNELS", mode)
    model = tiny_model(design).train()
    ids, mask = batch()
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


@pytest.mark.parametrize("design", sorted(hf_depth.DESIGNS))
def test_model_kernels_equal_torch(design, monkeypatch):
    ref_logits, ref_loss, ref_grads = _train_step(design, monkeypatch, "torch")
    spy = _Spy()
    monkeypatch.setattr(dispatch, "_KERNELS", spy)
    logits, loss, grads = _train_step(design, monkeypatch, "triton")
    assert any(not k.startswith("reference:") for k in spy.calls), f"{design}: no op went through Triton"
    torch.testing.assert_close(logits, ref_logits, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(loss, ref_loss, atol=2e-5, rtol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for k in grads:
        torch.testing.assert_close(grads[k], ref_grads[k], atol=2e-5, rtol=1e-3, msg=lambda m, k=k: f"{k}: {m}")


def test_every_dispatched_op_is_bound_under_its_own_name():
    """``dispatch.py`` binds the ops by family in tuple assignments: each module attribute is the op of its name."""
    bound = {a: v for a, v in vars(dispatch).items() if getattr(v, "__qualname__", "") == "op.<locals>.call"}
    assert len(bound) == 13
    for attr, fn in bound.items():
        assert fn.__name__ == attr and fn.__doc__ == dispatch.REFERENCES[attr].__doc__
