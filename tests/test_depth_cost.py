"""Issue 12: cross-layer designs keep saved activations linear in depth and compute the same function.

The reference (tests/reference_designs.py) is the implementation before the O(L)-memory paths: every sublayer
stacked its sources / depth K/V and ran plain autograd.
"""

import pytest
import torch
from helpers import count_native_calls, tiny_model
from reference_designs import reference_paths

import hf_depth
from hf_depth.diagnostics.cost import activation_bytes
from hf_depth.models import functional


def _perturb(model, seed=0):
    """Random values for every parameter, so zero-init queries / gates do not hide a wrong path."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def assert_equal_fp32(a, b, msg=""):
    """Equal at fp32 rounding: |a - b| <= 1e-6 * max(1, max |b|) elementwise (+ 1e-5 relative)."""
    scale = max(1.0, b.abs().max().item())
    torch.testing.assert_close(a, b, atol=1e-6 * scale, rtol=1e-5, msg=msg or None)


def _logits_and_grads(model, x, mask):
    model.zero_grad(set_to_none=True)
    out = model(x, attention_mask=mask, labels=x, use_cache=False)
    (out.logits.pow(2).mean() + out.loss).backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_equals_reference(model, x, mask, logits, grads):
    """``logits`` and ``grads`` (this implementation's, on ``x``) equal the pre-issue reference's at fp32 rounding."""
    with reference_paths():
        ref_logits, ref_grads = _logits_and_grads(model, x, mask)
    assert_equal_fp32(logits, ref_logits, "logits")
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert_equal_fp32(grads[name], ref_grads[name], name)


@pytest.mark.parametrize("layers", [1, 2, 7, 16])
@pytest.mark.parametrize("design", sorted(hf_depth.DESIGNS))
def test_equals_reference_implementation(design, layers):
    model = _perturb(tiny_model(design, num_hidden_layers=layers)).train()
    x = torch.randint(2, 97, (2, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(x)
    mask[0, :2] = 0
    assert_equals_reference(model, x, mask, *_logits_and_grads(model, x, mask))


#: the native kernels each cross-layer design's training step runs on CPU at a training shape
NATIVE_OPS = {"hc": ("hc_route", "hc_rebuild", "hc_route_backward"),
              "mhc": ("mhc_route", "stream_mix_write", "mhc_route_backward"),
              "attnres": ("agg_forward", "agg_backward"), "block_attnres": ("agg_forward", "agg_backward"),
              "moda": ("moda_depth_forward", "moda_depth_backward", "moda_kv_write", "moda_kv_grad")}


@pytest.mark.parametrize("layers,kv_heads", [(5, 1), (9, 2)])
@pytest.mark.parametrize("design", sorted(NATIVE_OPS))
def test_native_kernels_equal_reference_at_a_training_shape(design, layers, kv_heads, monkeypatch):
    """The tiny models above stay below the sizes where the native kernels take over (HC / mHC's streams from
    ``functional._ONE_PASS_MIN`` elements). Here, at odd depths, with MQA / GQA, left padding and a sequence that is
    no multiple of the kernels' token chunks, every native op of the design runs (counted) and the logits and every
    gradient still equal the pre-issue reference at fp32 rounding."""
    from hf_depth import native

    if not native.status()["available"]:
        pytest.skip(f"native kernels unavailable: {native.status()['why']}")
    B, n, d = 2, 4, 64
    T = functional._ONE_PASS_MIN // (B * n * d) + 3  # HC / mHC streams just above the one-pass size
    model = _perturb(hf_depth.model_for(design, vocab_size=97, hidden_size=d, intermediate_size=176,
                                        num_attention_heads=4, num_key_value_heads=kv_heads, num_hidden_layers=layers,
                                        max_position_embeddings=2 * T)).train()
    x = torch.randint(2, 97, (B, T), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(x)
    mask[0, :5] = 0
    calls = count_native_calls(monkeypatch, NATIVE_OPS[design])
    logits, grads = _logits_and_grads(model, x, mask)
    assert set(calls) == set(NATIVE_OPS[design]), sorted(set(calls))
    assert_equals_reference(model, x, mask, logits, grads)


@pytest.mark.parametrize("design", sorted(hf_depth.DESIGNS))
def test_a_step_leaves_no_cyclic_garbage(design):
    """What one training step builds (source banks, two-phase logits, stream segments) is freed by reference
    counting with its graph: nothing holding a tensor is left for the garbage collector (at real sizes a bank and its
    logits are GBs, alive into the next step until a collection runs)."""
    import gc

    from hf_depth.models import depth_ops

    model = _perturb(tiny_model(design, num_hidden_layers=3)).train()
    x = torch.randint(2, 97, (2, 7), generator=torch.Generator().manual_seed(3))
    _logits_and_grads(model, x, None)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        _logits_and_grads(model, x, None)
        gc.collect()
        held = (torch.Tensor, depth_ops.SourceBank, depth_ops.TwoPhase, depth_ops._Segment)
        leaked = [type(o).__name__ for o in gc.garbage if isinstance(o, held)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert not leaked, leaked


def _saved_ratio(design, layers, d=64, t=32):
    torch.manual_seed(0)
    kw = dict(vocab_size=97, hidden_size=d, num_hidden_layers=layers, num_attention_heads=4, pad_token_id=0,
              eos_token_id=1)
    return activation_bytes(hf_depth.model_for(design, **kw), 1, t) / activation_bytes(
        hf_depth.model_for("pre_ln", **kw), 1, t)


#: saved activations / Pre-LN caps of issue 12 (others: only flat in depth)
CAPS = {"attnres": 1.35, "moda": 1.35, "block_attnres": 1.25}


@pytest.mark.parametrize("design", sorted(hf_depth.DESIGNS))
def test_saved_activations_flat_in_depth(design):
    shallow, deep = _saved_ratio(design, 8), _saved_ratio(design, 24)
    assert deep <= 1.05 * shallow, (shallow, deep)
    if design in CAPS:
        assert max(shallow, deep) <= CAPS[design], (shallow, deep)


def test_counter_sees_the_bank():
    """The bank of sources is saved through save_for_backward: the counter includes its (2L+1) slots."""
    torch.manual_seed(0)
    kw = dict(vocab_size=97, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, pad_token_id=0,
              eos_token_id=1)
    extra = activation_bytes(hf_depth.model_for("attnres", **kw), 1, 32) - activation_bytes(
        hf_depth.model_for("pre_ln", **kw), 1, 32)
    assert extra >= (2 * 4 + 1) * 32 * 64 * 4


@pytest.mark.parametrize("design", ["attnres", "block_attnres"])
def test_triton_depth_softmax_reads_the_bank_in_place(design, monkeypatch):
    """HF_DEPTH_KERNELS=triton (TRITON_INTERPRET=1 on CPU): the kernel's sources are the bank's own storage, and
    logits and gradients equal the torch path."""
    from hf_depth.models import depth_ops

    x = torch.randint(2, 97, (2, 7), generator=torch.Generator().manual_seed(3))
    model = _perturb(tiny_model(design, num_hidden_layers=3)).train()
    monkeypatch.setenv("HF_DEPTH_KERNELS", "torch")
    ref_logits, ref_grads = _logits_and_grads(model, x, None)
    monkeypatch.setenv("HF_DEPTH_KERNELS", "triton")
    ptrs, real = [], depth_ops._triton_ops

    class Ops:
        def __init__(self):
            self.ops = real()

        def depth_softmax_fwd(self, q, w, sources, eps):
            ptrs.append(sources.untyped_storage().data_ptr())
            return self.ops.depth_softmax_fwd(q, w, sources, eps)

        def __getattr__(self, name):
            return getattr(self.ops, name)

    banks = []
    attach = depth_ops.SourceBank.attach

    def spy_attach(holder, capacity, rms_eps=None):
        alias = attach(holder, capacity, rms_eps)
        banks.append(depth_ops.SourceBank.of(alias).data.untyped_storage().data_ptr())
        return alias

    monkeypatch.setattr(depth_ops, "_triton_ops", Ops)
    monkeypatch.setattr(depth_ops.SourceBank, "attach", staticmethod(spy_attach))
    logits, grads = _logits_and_grads(model, x, None)
    assert ptrs and len(banks) == 1
    if design == "attnres":  # every source is read in place (block: the running partial sum is one extra slot)
        assert set(ptrs) == {banks[0]}
    else:
        assert banks[0] in ptrs
    torch.testing.assert_close(logits, ref_logits, atol=2e-5, rtol=1e-4)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=2e-5, rtol=1e-3, msg=name)


@pytest.mark.parametrize("design", ["attnres", "block_attnres", "moda"])
def test_slot_gradients_accumulate_once_per_backward(design):
    """The bank's slot gradients are summed in place in one buffer per backward (``SourceBank.grad``) and handed on
    by each slot's first reader, never as one tensor per (reader, slot): two backward passes over one retained
    graph, and ``autograd.grad`` after them, each give the reference gradients (a buffer that outlived its
    backward would add the first pass into the second)."""
    from hf_depth.models import depth_ops

    model = _perturb(tiny_model(design, num_hidden_layers=3)).train()
    x = torch.randint(2, 97, (2, 7), generator=torch.Generator().manual_seed(3))
    with reference_paths():
        _, ref = _logits_and_grads(model, x, None)
    grads_seen, real_grad, real_records = [], depth_ops.SourceBank.grad, depth_ops.SourceBank.records

    def spy_grad(self, dtype):
        buf = real_grad(self, dtype)
        grads_seen.append(buf.data_ptr())
        return buf

    def spy_records(self, *args, **kwargs):  # the native kernels: the per-backward record of their consumers
        recs = real_records(self, *args, **kwargs)
        grads_seen.append(id(recs))
        return recs

    model.zero_grad(set_to_none=True)
    out = model(x, labels=x, use_cache=False)
    loss = out.logits.pow(2).mean() + out.loss
    params = [p for p in model.parameters() if p.requires_grad]
    depth_ops.SourceBank.grad, depth_ops.SourceBank.records = spy_grad, spy_records
    try:
        loss.backward(retain_graph=True)
        first = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        loss.backward(retain_graph=True)
        second = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        third = dict(zip([n for n, p in model.named_parameters() if p.requires_grad],
                         torch.autograd.grad(loss, params, allow_unused=True)))
    finally:
        depth_ops.SourceBank.grad, depth_ops.SourceBank.records = real_grad, real_records
    assert grads_seen, "the bank path was not taken"
    for got in (first, second, {n: g for n, g in third.items() if g is not None}):
        assert got.keys() == ref.keys()
        for name in ref:
            assert_equal_fp32(got[name], ref[name], name)


@pytest.mark.parametrize("design,kw", [
    ("hc", {"hc_dynamic": False}), ("hc", {"hc_stream_mixing": False}), ("hc", {"hc_final_reduce": "mean_then_norm"}),
    ("mhc", {"mhc_init": "identity"}), ("mhc", {"mhc_dynamic_tanh": True, "mhc_sinkhorn_order": "columns_first"}),
    ("mhc", {"mhc_final_reduce": "sum_of_normed"}),
])
def test_stream_routing_variants_equal_reference(design, kw):
    """HC / mHC's hand-written routing backward (``routing_backward``) for every variant of the routing."""
    model = _perturb(tiny_model(design, num_hidden_layers=7, **kw)).train()
    x = torch.randint(2, 97, (2, 7), generator=torch.Generator().manual_seed(3))
    # the forward is the reference's to fp32 rounding (HC's one projection of the raw streams, mHC's float64 Sinkhorn)
    assert_equals_reference(model, x, None, *_logits_and_grads(model, x, None))


@pytest.mark.parametrize("design,kw", [
    ("hc", {}), ("hc", {"hc_dynamic": False}), ("hc", {"hc_stream_mixing": False}), ("mhc", {}),
    ("mhc", {"mhc_dynamic_tanh": True, "mhc_sinkhorn_order": "columns_first"}),
])
def test_no_grad_forward_of_a_prompt_is_the_training_forward(design, kw, monkeypatch):
    """Without autograd (evaluation, a prompt's prefill), streams of at least ``_ONE_PASS_MIN`` elements are routed by
    the CPU training forward's ops (``routing_saved``): logits bit-equal to the training forward's, and the
    reference route's (``conn.route``, which decoding takes where the native kernels do not run) to fp32 rounding."""
    from hf_depth.models import depth_ops

    model = _perturb(tiny_model(design, num_hidden_layers=5, hidden_size=64, **kw))
    x = torch.randint(2, 97, (2, 128), generator=torch.Generator().manual_seed(3))  # streams: 2 * 128 * 4 * 64
    assert x.numel() * model.config.num_streams * 64 >= functional._ONE_PASS_MIN
    trained = model(x, use_cache=False).logits
    cls = type(model.model.layers[0].attn_connection)
    calls = {"route": 0}
    real = cls.route

    def spy(self, H):
        calls["route"] += 1
        return real(self, H)

    monkeypatch.setattr(cls, "route", spy)
    with torch.no_grad():
        evaluated = model(x, use_cache=False).logits
        assert calls["route"] == 0
        assert torch.equal(evaluated, trained.detach())
        monkeypatch.setattr(depth_ops, "_ONE_PASS_MIN", x.numel() * 10**6)  # every input routed as decoding's,
        monkeypatch.setattr(depth_ops, "_native_ok", lambda: False)  # without the native kernels
        reference = model(x, use_cache=False).logits
        assert calls["route"] == 10
    assert_equal_fp32(evaluated, reference)


@pytest.mark.parametrize("design", ["hc", "mhc"])
def test_stream_backward_never_reruns_the_routing_forward(design, monkeypatch):
    """The backward rebuilds the coefficients from their saved inputs (``routing_rebuild``): no second pass of the
    coefficient projection over the streams (``routing_saved`` / ``route`` run once per sublayer, in forward)."""
    from hf_depth.models.design_hc import MultiStreamConnection

    model = _perturb(tiny_model(design, num_hidden_layers=5)).train()
    x = torch.randint(2, 97, (2, 7), generator=torch.Generator().manual_seed(3))
    calls = {"saved": 0, "route": 0, "rebuild": 0}
    cls = type(model.model.layers[0].attn_connection)
    for key, name in (("saved", "routing_saved"), ("route", "route"), ("rebuild", "routing_rebuild")):
        real = getattr(cls, name)

        def spy(self, *a, _real=real, _key=key):
            calls[_key] += 1
            return _real(self, *a)

        monkeypatch.setattr(cls, name, spy)
    assert issubclass(cls, MultiStreamConnection)
    out = model(x, labels=x, use_cache=False)
    assert calls == {"saved": 10, "route": 0, "rebuild": 0}
    out.loss.backward()
    assert calls == {"saved": 10, "route": 0, "rebuild": 10}


def test_write_streams_is_the_broadcast_product():
    """``functional.write_streams`` (one addcmul) gives mixed + w y of the broadcast form, for
    per-token and static weights and a non-contiguous ``mixed`` (the rows of the width product)."""
    g = torch.Generator().manual_seed(0)
    full = torch.randn(2, 64, 5, 256, generator=g)
    mixed, y = full[..., 1:, :], torch.randn(2, 64, 256, generator=g)
    for w in (torch.randn(2, 64, 4, generator=g), torch.randn(4, generator=g)):
        ref = mixed + w.unsqueeze(-1) * y.unsqueeze(-2)
        torch.testing.assert_close(functional.write_streams(mixed, w, y), ref, rtol=0, atol=1e-6)
    # in place (the CPU training path's write and rebuild): the same arithmetic, bit for bit, into ``mixed``
    for y_dtype in (torch.float32, torch.bfloat16):
        m, w, yy = full[..., 1:, :].contiguous(), torch.randn(2, 64, 4, generator=g), y.to(y_dtype)
        ref = functional.write_streams(m, w, yy)
        assert functional.write_streams(m, w, yy, inplace=True) is m
        assert torch.equal(m, ref)


def test_sinkhorn_backward_is_the_unrolled_gradient():
    """``sinkhorn_iterates`` / ``sinkhorn_backward`` (mHC's hand-written backward) equal the reference Sinkhorn and
    autograd through its 20 log-domain iterations: to float64 rounding for float64 logits, and to fp32 rounding
    for fp32 logits (the routing's dtype), also for logits spread far beyond where exp overflows fp32."""
    from hf_depth.models.design_mhc import sinkhorn_backward, sinkhorn_iterates

    g = torch.Generator().manual_seed(0)
    z = (2.0 * torch.randn(6, 4, 4, generator=g, dtype=torch.float64)).requires_grad_()
    dres = torch.randn(6, 4, 4, generator=g, dtype=torch.float64)
    ref = functional.sinkhorn(z, 20)
    (ref_grad,) = torch.autograd.grad(ref, z, dres)
    keep = []
    res = sinkhorn_iterates(z.detach(), 20, keep)
    assert res.dtype == torch.float64 and all(k.dtype == torch.float64 for k in keep)
    torch.testing.assert_close(res, ref.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(sinkhorn_backward(dres, keep), ref_grad, rtol=0, atol=1e-12)
    dres = dres.repeat(11, 1, 1)[:64]
    for scale in (3.0, 200.0):  # exp(200 * 4 sigma) is inf in fp32: the log-domain iterates stay finite
        z = (scale * torch.randn(64, 4, 4, generator=g, dtype=torch.float64)).requires_grad_()
        ref = functional.sinkhorn(z, 20)
        (ref_grad,) = torch.autograd.grad(ref, z, dres)
        keep = []
        res = sinkhorn_iterates(z.detach().float(), 20, keep)
        grad = sinkhorn_backward(dres.float(), keep)
        assert res.dtype == grad.dtype == torch.float32 and len(keep) == 40
        torch.testing.assert_close(res.double(), ref.detach(), rtol=0, atol=2e-6)
        torch.testing.assert_close(grad.double(), ref_grad, rtol=0, atol=2e-6 * max(1.0, ref_grad.abs().max().item()))


@pytest.mark.parametrize("design", ["attnres", "block_attnres"])
def test_two_phase_logits_once_per_slot(design, monkeypatch):
    """Training forward: each source's logits against every later static query are one matmul when the slot is
    written (``depth_ops.TwoPhase``), every aggregation reads its column of them (no pass over its sources for the
    logits), the logits are dropped once the final aggregation has read them (not kept for backward), and
    gradients still equal the reference, with and without activation checkpointing."""
    from hf_depth.models import depth_ops, design_attnres

    model = _perturb(tiny_model(design, num_hidden_layers=3)).train()
    x = torch.randint(2, 97, (2, 7), generator=torch.Generator().manual_seed(3))
    with reference_paths():
        _, ref = _logits_and_grads(model, x, None)
    writes, calls, twos, banks = [], [], [], []
    real_write, real_apply, real_attach = depth_ops.TwoPhase.write, depth_ops._TwoPhaseAggregate.apply, \
        design_attnres.attach_queries

    def spy_write(self, lo, hi, col):
        writes.append((lo, hi))
        return real_write(self, lo, hi, col)

    def spy_apply(*args):
        calls.append(args[9])  # the consumer column
        return real_apply(*args)

    def spy_attach(holder, queries, key_weights):
        real_attach(holder, queries, key_weights)
        banks.append(depth_ops.SourceBank.of(holder))
        twos.append(banks[-1].two)

    monkeypatch.setattr(depth_ops.TwoPhase, "write", spy_write)
    monkeypatch.setattr(depth_ops._TwoPhaseAggregate, "apply", spy_apply)
    monkeypatch.setattr(design_attnres, "attach_queries", spy_attach)
    _, grads = _logits_and_grads(model, x, None)
    n_consumers = 2 * 3  # sublayers 1..2L-1 and the final aggregation
    assert calls == list(range(n_consumers))
    assert len(twos) == 1 and twos[0] is not None and twos[0].z is None  # dropped after the final read
    slots = [i for lo, hi in writes for i in range(lo, hi)]
    assert slots == list(range(banks[0].count))  # every slot's logits made once, in order
    model.activation_checkpointing_enable()
    _, ckpt = _logits_and_grads(model, x, None)
    for got in (grads, ckpt):
        assert got.keys() == ref.keys()
        for name in ref:
            assert_equal_fp32(got[name], ref[name], name)


def test_two_phase_falls_back_for_another_query(monkeypatch):
    """An aggregation called with a query other than its module's (an intervention) cannot use the precomputed
    logits: it computes its own, and the result is that of the model whose query has those values."""
    from hf_depth.models import design_attnres

    x = torch.randint(2, 97, (2, 7), generator=torch.Generator().manual_seed(3))
    model = _perturb(tiny_model("attnres", num_hidden_layers=3)).train()
    target = model.model.layers[1].attn_connection.aggregate.query
    real = design_attnres.depth_aggregate

    def scaled(query, key_weight, sources, eps, stable=None):
        return real(query * 1.5 if query is target else query, key_weight, sources, eps, stable)

    monkeypatch.setattr(design_attnres, "depth_aggregate", scaled)
    logits, grads = _logits_and_grads(model, x, None)
    monkeypatch.setattr(design_attnres, "depth_aggregate", real)
    with torch.no_grad():
        target.mul_(1.5)
    with reference_paths():
        ref_logits, ref = _logits_and_grads(model, x, None)
    name = "model.layers.1.attn_connection.aggregate.query"
    ref[name] = ref[name] * 1.5  # d/dq of f(1.5 q)
    assert_equal_fp32(logits, ref_logits)
    for n in ref:
        assert_equal_fp32(grads[n], ref[n], n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("tokens", [3, 64])  # below / above functional._ONE_PASS_MIN (the batched product / slots)
def test_mix_streams_is_the_batched_product(dtype, tokens):
    """``functional.mix_streams`` (HC / mHC's read and mix) is M @ H per token, also for a transposed M, and adds
    into ``out`` in place."""
    g = torch.Generator().manual_seed(0)
    H = torch.randn(2, tokens, 4, 256, generator=g).to(dtype)
    for M in (torch.randn(2, tokens, 5, 4, generator=g), torch.randn(2, tokens, 4, 5, generator=g).transpose(-1, -2)):
        ref = (M.to(dtype).double() @ H.double()).to(dtype)  # M in the streams' dtype, as mixed
        got = functional.mix_streams(M, H)
        assert got.dtype == dtype and got.shape == ref.shape
        tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2}[dtype]
        torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
        base = torch.randn(ref.shape, generator=g).to(dtype)
        into = base.clone()
        assert functional.mix_streams(M, H, out=into) is into  # accumulated in place
        torch.testing.assert_close(into, (base.double() + ref.double()).to(dtype), rtol=tol, atol=2 * tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_inv_rms_and_read_and_mix(dtype):
    """``functional.inv_rms`` is 1 / sqrt(mean(x^2) + eps) (one norm, no squared copy), and ``read_and_mix`` gives
    rows 0 and 1..n of M H, each on its own storage."""
    g = torch.Generator().manual_seed(1)
    H = (3 * torch.randn(2, 64, 4, 256, generator=g)).to(dtype)
    ref = torch.rsqrt(H.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    got = functional.inv_rms(H, 1e-6)
    assert got.dtype == dtype and got.shape == ref.shape
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=0)
    M = torch.randn(2, 64, 5, 4, generator=g).to(dtype)
    x, mixed = functional.read_and_mix(M, H)
    full = M.double() @ H.double()
    torch.testing.assert_close(x.double(), full[..., 0, :], rtol=tol * 10, atol=tol * 10)
    torch.testing.assert_close(mixed.double(), full[..., 1:, :], rtol=tol * 10, atol=tol * 10)
    assert x.is_contiguous() and x.untyped_storage().data_ptr() != mixed.untyped_storage().data_ptr()


@pytest.mark.parametrize("tokens", [3, 512])  # at most / more than depth_ops._FEW_TOKENS
@pytest.mark.parametrize("partial", [False, True])
def test_weighted_sum_both_forms(tokens, partial):
    """``depth_ops._weighted_sum`` (the depth softmax's sum_k p_k v_k, + p_K P): the batched product for a few tokens
    (decoding) and the per-slot in-place passes for more, both the float64 sum to fp32 rounding."""
    from hf_depth.models.depth_ops import _FEW_TOKENS, _weighted_sum

    g = torch.Generator().manual_seed(2)
    K, d = 9, 256
    V = torch.randn(K, tokens, d, generator=g)
    p = torch.softmax(torch.randn(K + partial, tokens, generator=g), 0)
    P = torch.randn(tokens, d, generator=g) if partial else None
    assert (tokens <= _FEW_TOKENS) == (tokens == 3)
    ref = (p[:K].double().unsqueeze(-1) * V.double()).sum(0)
    if partial:
        ref += p[K].double().unsqueeze(-1) * P.double()
    got = _weighted_sum(p, V, P)
    assert got.shape == (tokens, d) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tokens", [3, 128])  # a decoding-sized input (reference route) and a prompt
def test_no_grad_write_goes_into_the_routes_mixed_streams(tokens, monkeypatch):
    """Without autograd, the CPU write ``mixed + w y`` goes in place into the route's own mixed streams (as ``_Write``
    does in training): the written state is that tensor, no fresh stream-sized output per sublayer."""
    from hf_depth.models import depth_ops

    model = _perturb(tiny_model("hc", num_hidden_layers=3, hidden_size=64))
    x = torch.randint(2, 97, (2, tokens), generator=torch.Generator().manual_seed(3))
    seen = []
    real = depth_ops.write_streams

    def spy(mixed, w, y, inplace=False):
        out = real(mixed, w, y, inplace=inplace)
        seen.append(out.data_ptr() == mixed.data_ptr())
        return out

    monkeypatch.setattr(depth_ops, "write_streams", spy)
    with torch.no_grad():
        model(x, use_cache=False)
    assert seen == [True] * 6
