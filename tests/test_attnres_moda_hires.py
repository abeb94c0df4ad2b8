"""AttnRes (full, block), MoDA and HiRes: equalities with Pre-LN, references written from the equations, init
rules that must survive every sweep, gradchecks of the residual operators, config errors."""

import pytest
import torch
import torch.nn.functional as F
from helpers import batch, tiny_config, tiny_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import hf_depth
from hf_depth import shapes
from hf_depth.models.design_hires import hires_write
from hf_depth.models.functional import depth_softmax, moda_attention, rms_norm

EPS = 1e-10  # the Pre-LN equalities hold up to the RMSNorm eps (N(h / n) != N(h) by eps only)


def logits(model, x, mask=None):
    with torch.no_grad():
        return model(x, attention_mask=mask).logits


def with_pre_ln_weights(design, layers=3, **kw):
    """A Pre-LN model and a ``design`` model holding the same branch weights; returns (pre, other, missing)."""
    pre = tiny_model("pre_ln", num_hidden_layers=layers, rms_norm_eps=EPS)
    other = tiny_model(design, seed=1, num_hidden_layers=layers, rms_norm_eps=EPS, **kw)
    missing, unexpected = other.load_state_dict(pre.state_dict(), strict=False)
    assert not unexpected
    return pre, other, missing


# ============================================================================================ AttnRes
ATTNRES_VARIANTS = [
    ("attnres", {}),
    ("block_attnres", {}),
    ("block_attnres", {"attnres_block_size": 3}),
    ("block_attnres", {"attnres_block_size": 2}),
    ("block_attnres", {"attnres_schedule": "depth_aware", "attnres_num_blocks": 3, "attnres_reference_depth": 2}),
]


@pytest.mark.parametrize("design, kw", ATTNRES_VARIANTS)
def test_attnres_zero_queries_equal_pre_ln(design, kw):
    pre, res, missing = with_pre_ln_weights(design, layers=4, **kw)
    assert missing and all(k.endswith(("aggregate.query", "aggregate.key_norm.weight")) for k in missing)
    x, mask = batch()
    torch.testing.assert_close(logits(res, x, mask), logits(pre, x, mask), rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # collapse = sum of sources = the Pre-LN residual stream, boundary by boundary
        hs_res, hs_pre = (
            res(x, output_hidden_states=True).hidden_states,
            pre(x, output_hidden_states=True).hidden_states,
        )
    for a, b in zip(hs_res, hs_pre):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def attnres_reference(model, ids):
    """Block AttnRes written from the paper's equations (Kimi's partial-sum pseudo-code), independent of the model."""
    m, cfg = model.model, model.config
    size = cfg.attnres_block_sublayers
    emb = m.embed_tokens(ids)
    pe = m.rotary_emb(emb, torch.arange(ids.shape[1])[None])

    def aggregate(agg, srcs):
        V = torch.stack(srcs)
        K = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * agg.key_norm.weight
        p = torch.softmax((K * agg.query).sum(-1), dim=0)
        return (p.unsqueeze(-1) * V).sum(0)

    blocks, partial = [emb], None
    for s in range(cfg.num_sublayers):
        layer = m.layers[s // 2]
        if s % size == 0 and partial is not None:
            blocks.append(partial)
            partial = None
        srcs = blocks + ([partial] if partial is not None else [])
        h = srcs[0] if s == 0 else aggregate(layer.connections()[s % 2].aggregate, srcs)
        if s % 2 == 0:
            y = layer.self_attn(layer.input_layernorm(h), pe)[0]
        else:
            y = layer.mlp(layer.post_attention_layernorm(h))
        partial = y if partial is None else partial + y
    return model.lm_head(m.norm(aggregate(m.stream.aggregate, blocks + [partial])))


def random_attnres_parameters(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("aggregate.query"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("aggregate.key_norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_block_attnres_matches_equations(size):
    model = tiny_model("block_attnres", num_hidden_layers=3, attnres_block_size=size)
    random_attnres_parameters(model)
    x, _ = batch(left_pad=(0, 0, 0))
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, attnres_reference(model, x), rtol=1e-5, atol=1e-5)


def test_block_size_one_equals_full():
    full = tiny_model("attnres", num_hidden_layers=3)
    random_attnres_parameters(full)
    block = tiny_model("block_attnres", seed=5, num_hidden_layers=3, attnres_block_size=1)
    block.load_state_dict(full.state_dict())
    x, mask = batch()
    torch.testing.assert_close(logits(block, x, mask), logits(full, x, mask), rtol=0, atol=0)
    assert not torch.allclose(logits(full, x, mask), logits(tiny_model("pre_ln", num_hidden_layers=3), x, mask))


def test_block_schedules():
    c = lambda L, **kw: hf_depth.config_for(
        "block_attnres", num_hidden_layers=L, hidden_size=64, num_attention_heads=4, **kw
    )
    # fixed (DepthBench): 8 blocks whatever the depth, S = ceil(2L / 8) sublayers
    assert [c(L).attnres_block_sublayers for L in (16, 24, 32, 70)] == [4, 6, 8, 18]
    # depth-aware: the block length of L = 16 kept at every depth, so the number of blocks grows with L
    assert [c(L, attnres_schedule="depth_aware").attnres_block_sublayers for L in (16, 24, 32, 70)] == [4, 4, 4, 4]
    assert c(32, attnres_block_size=2, attnres_schedule="depth_aware").attnres_block_sublayers == 2
    assert hf_depth.config_for("attnres").attnres_block_sublayers == 1


@pytest.mark.parametrize("design", ["attnres", "block_attnres"])
def test_uniform_path_weights_at_init(design):
    model = (
        tiny_model(design, num_hidden_layers=3, attnres_block_size=2)
        if design == "block_attnres"
        else tiny_model(design, num_hidden_layers=3)
    )
    x, mask = batch()
    logits(model, x, mask)
    weights = model.model.residual_path_weights()
    # sublayer 0 has a single source and no softmax; key 6 = 2L is the final aggregation
    assert sorted(weights) == list(range(1, 7))
    for w in weights.values():
        assert w["members"].shape == (w["weights"].numel(), 7) and (w["members"].sum(0) <= 1).all()
        n = w["weights"].numel()
        torch.testing.assert_close(w["weights"], torch.full((n,), 1.0 / n))
    assert weights[5]["weights"].numel() == (6 if design == "attnres" else 4)  # emb, 2 blocks, partial
    final = model.model.stream.path_weights()["weights"]
    assert final.numel() == (7 if design == "attnres" else 4)


def query_params(model):
    return {n: p for n, p in model.named_parameters() if n.endswith("aggregate.query")}


@pytest.mark.parametrize("design", ["attnres", "block_attnres"])
def test_zero_queries_survive_init_sweeps(design):
    model = tiny_model(design)
    queries = query_params(model)
    assert queries and all(torch.equal(q, torch.zeros_like(q)) for q in queries.values())
    random_attnres_parameters(model)
    before = model.model.layers[0].self_attn.q_proj.weight.clone()
    model.apply(model._init_weights)  # the generic sweep, flags or not
    assert all(torch.equal(q, torch.zeros_like(q)) for q in queries.values())
    assert not torch.equal(before, model.model.layers[0].self_attn.q_proj.weight)  # the sweep really ran
    random_attnres_parameters(model)
    for mod in model.modules():
        mod._is_hf_initialized = False
    model.initialize_weights()
    assert all(torch.equal(q, torch.zeros_like(q)) for q in queries.values())


@pytest.mark.parametrize("design", ["attnres", "block_attnres"])
def test_from_pretrained_missing_queries_are_zero(design, tmp_path):
    model = tiny_model(design)
    random_attnres_parameters(model)
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    dropped = [k for k in weights if k.endswith("aggregate.query")]
    save_file(
        {k: v for k, v in weights.items() if k not in dropped},
        tmp_path / "model.safetensors",
        metadata={"format": "pt"},
    )
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    state = again.state_dict()
    for k in dropped:
        assert torch.equal(state[k], torch.zeros_like(state[k])), k
    for k, v in weights.items():  # loaded weights untouched (random key norms included)
        if k not in dropped:
            torch.testing.assert_close(state[k], v, rtol=0, atol=0, msg=k)


def test_depth_softmax_gradcheck_float64():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, dtype=torch.float64, generator=g, requires_grad=True)
    w = (1 + 0.2 * torch.randn(6, dtype=torch.float64, generator=g)).requires_grad_()
    v = torch.randn(4, 2, 3, 6, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, w, v: depth_softmax(q, w, v, 1e-6)[0], (q, w, v))
    out, p = depth_softmax(q, w, v, 1e-6)
    assert out.dtype == torch.float64 and p.shape == (2, 3, 4)
    torch.testing.assert_close(p.sum(-1), torch.ones(2, 3, dtype=torch.float64))


# ============================================================================================ MoDA
def moda_loop_reference(q, k, v, dk, dv, allowed, scaling):
    """One softmax per (batch, head, token) over its allowed sequence keys and its own depth keys, by loops."""
    B, H, T, hd = q.shape
    rep = H // k.shape[1]
    out = torch.zeros(B, T, H, hd, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                keys = torch.cat([k[b, h // rep][allowed[b, t]], dk[:, b, h // rep, t]])
                vals = torch.cat([v[b, h // rep][allowed[b, t]], dv[:, b, h // rep, t]])
                p = torch.softmax(keys.double() @ q[b, h, t].double() * scaling, dim=0)
                out[b, t, h] = p @ vals.double()
    return out


def test_moda_attention_is_one_softmax_over_sequence_and_depth():
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, T, past, hd, D = 2, 4, 2, 4, 2, 8, 3
    q = torch.randn(B, H, T, hd, generator=g)
    k, v = torch.randn(B, Hkv, past + T, hd, generator=g), torch.randn(B, Hkv, past + T, hd, generator=g)
    dk, dv = torch.randn(D, B, Hkv, T, hd, generator=g), torch.randn(D, B, Hkv, T, hd, generator=g)
    allowed = torch.ones(T, past + T, dtype=torch.bool).tril(past)[None].repeat(B, 1, 1)
    allowed[1, :, :3] = False  # row 1 left-padded by 3
    ref = moda_loop_reference(q, k, v, dk, dv, allowed, 0.3).float()
    got = moda_attention(q, k, v, dk, dv, allowed[:, None], 0.3)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[:, None]
    torch.testing.assert_close(moda_attention(q, k, v, dk, dv, additive, 0.3), got, rtol=1e-6, atol=1e-6)
    # every depth slot masked out: plain causal attention
    plain = F.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=allowed[:, None]
    ).transpose(1, 2)
    masked = moda_attention(q, k, v, dk, dv, allowed[:, None], hd**-0.5, torch.zeros(D, dtype=torch.bool))
    torch.testing.assert_close(masked[0], plain[0], rtol=1e-5, atol=1e-5)


def test_moda_attention_gradcheck_float64():
    g = torch.Generator().manual_seed(1)
    t = lambda *s: torch.randn(*s, dtype=torch.float64, generator=g, requires_grad=True)
    args = (t(1, 2, 3, 4), t(1, 1, 3, 4), t(1, 1, 3, 4), t(2, 1, 1, 3, 4), t(2, 1, 1, 3, 4))
    assert torch.autograd.gradcheck(lambda q, k, v, dk, dv: moda_attention(q, k, v, dk, dv, None, 0.5), args)


def test_moda_with_depth_masked_equals_pre_ln():
    pre, moda, missing = with_pre_ln_weights("moda", layers=3)
    assert sorted(missing) == ["model.layers.0.kv_proj.weight", "model.layers.1.kv_proj.weight"]
    assert moda.model.layers[2].kv_proj is None  # the last block's FFN feeds no attention
    x, mask = batch()
    with_depth = logits(moda, x, mask)
    for layer in moda.model.layers:
        layer.mask_depth = True
    real = mask.bool()  # padding rows attend to nothing real: their values are arbitrary in both models
    torch.testing.assert_close(logits(moda, x, mask)[real], logits(pre, x, mask)[real], rtol=1e-5, atol=1e-5)
    assert (with_depth - logits(pre, x, mask)).abs().max() > 1e-3  # the depth KV does enter the softmax


def test_moda_parameters_and_iso_width():
    cfg = shapes.make_config("moda", 1024, 24)
    extra = shapes.count_params(cfg) - shapes.count_params(shapes.make_config("pre_ln", 1024, 24))
    assert extra == 23 * 2 * 1024 * 1024 == 48_234_496
    narrower = shapes.iso_width("moda", 406e6, 24)
    assert narrower.hidden_size < shapes.iso_width("pre_ln", 406e6, 24).hidden_size
    assert abs(narrower.deviation) <= shapes.DEPTHBENCH_TOLERANCE


# ============================================================================================ HiRes
def hires_reference(model, ids):
    """HiRes from its equations: blocks of k Pre-LN layers, X <- N_D(X + W (h_end - h_start)), h <- R X."""
    m, cfg = model.model, model.config
    emb = m.embed_tokens(ids)
    pe = m.rotary_emb(emb, torch.arange(ids.shape[1])[None])
    k, L = cfg.hires_block_layers, cfg.num_hidden_layers
    X = (
        emb @ m.stream.embed_proj.T
        if cfg.hires_embed == "project"
        else F.pad(emb, (0, cfg.outer_size - cfg.hidden_size))
    )
    h = emb
    for b in range(cfg.num_blocks):
        start = h
        for layer in m.layers[b * k : min((b + 1) * k, L)]:
            h = h + layer.self_attn(layer.input_layernorm(h), pe)[0]
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        conn = m.layers[min((b + 1) * k, L) - 1].mlp_connection
        assert conn.boundary == (b < cfg.num_blocks - 1 or cfg.hires_final == "outer")
        if conn.boundary:
            Z = X + (h - start) @ conn.write_proj.T
            X = Z * torch.rsqrt(Z.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * conn.outer_norm.weight
            h = X @ conn.read_proj.T
    return model.lm_head(m.norm(h))


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"hires_block_layers": 2},
        {"hires_block_layers": 2, "hires_final": "outer", "hires_embed": "project", "hires_init": "normal"},
        {"hires_block_layers": 1, "hires_outer_size": 48, "hires_init": "normal"},
    ],
)
def test_hires_matches_equations(kw):
    model = tiny_model("hires", num_hidden_layers=3, **kw)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "outer_norm" in name:
                p.add_(0.1 * torch.randn(p.shape))
    x, _ = batch(left_pad=(0, 0, 0))
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, hires_reference(model, x), rtol=1e-5, atol=1e-5)


def test_hires_single_block_equals_pre_ln():
    pre, hires, missing = with_pre_ln_weights("hires", layers=3, hires_block_layers=3)
    assert missing == []  # one block, no boundary: no read/write at all
    x, mask = batch()
    torch.testing.assert_close(logits(hires, x, mask), logits(pre, x, mask), rtol=0, atol=0)


def test_hires_identity_init_and_counts():
    model = tiny_model("hires", num_hidden_layers=4, hires_block_layers=2)
    conn = model.model.layers[1].mlp_connection
    d, D = 32, 64
    assert conn.boundary and not model.model.layers[3].mlp_connection.boundary
    torch.testing.assert_close(conn.read_proj, torch.cat([torch.eye(d), torch.zeros(d, D - d)], 1))
    torch.testing.assert_close(conn.write_proj[:d], torch.eye(d))
    extra = conn.write_proj[d:]
    assert 0 < extra.std() < 0.03 and extra.abs().max() <= 0.06 + 1e-6  # trunc-normal(0.02), cut at 3 std
    # read/write reset by the sweep, loaded values kept by from_pretrained (init.* skip loaded weights)
    with torch.no_grad():
        conn.read_proj.normal_()
    model.apply(model._init_weights)
    torch.testing.assert_close(conn.read_proj, torch.cat([torch.eye(d), torch.zeros(d, D - d)], 1))
    cfg = shapes.make_config("hires", 1024, 24)
    extra_400m = shapes.count_params(cfg) - shapes.count_params(shapes.make_config("pre_ln", 1024, 24))
    assert extra_400m == 5 * (2 * 2048 * 1024 + 2048)


def test_hires_boundary_gradcheck_float64():
    g = torch.Generator().manual_seed(2)
    t = lambda *s: torch.randn(*s, dtype=torch.float64, generator=g, requires_grad=True)
    X, update, W, R, gamma = t(2, 3, 6), t(2, 3, 4), t(6, 4), t(4, 6), t(6)

    def step(X, update, W, R, gamma):
        Xn = hires_write(X, update, W, lambda z: rms_norm(z, gamma, 1e-6))
        return Xn, F.linear(Xn, R)

    assert torch.autograd.gradcheck(step, (X, update, W, R, gamma))


# ============================================================================================ configs
@pytest.mark.parametrize(
    "design, kw, field",
    [
        ("block_attnres", dict(attnres_block_size=0), "attnres_block_size"),
        ("block_attnres", dict(attnres_block_size=2.5), "attnres_block_size"),
        ("block_attnres", dict(attnres_num_blocks=0), "attnres_num_blocks"),
        ("block_attnres", dict(attnres_schedule="geometric"), "attnres_schedule"),
        ("block_attnres", dict(attnres_reference_depth=-4), "attnres_reference_depth"),
        ("moda", dict(attention_dropout=0.1), "attention_dropout"),
        ("hires", dict(hires_outer_size=32), "hires_outer_size"),
        ("hires", dict(hires_block_layers=0), "hires_block_layers"),
        ("hires", dict(hires_init="zero"), "hires_init"),
        ("hires", dict(hires_embed="wide"), "hires_embed"),
        ("hires", dict(hires_final="last"), "hires_final"),
    ],
)
def test_config_errors_name_the_field(design, kw, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        tiny_config(design, **kw)


def test_attnres_extra_params_are_4Ld():
    for design in ("attnres", "block_attnres"):
        cfg = shapes.make_config(design, 1024, 24)
        assert shapes.count_params(cfg) - shapes.count_params(shapes.make_config("pre_ln", 1024, 24)) == 4 * 24 * 1024


def test_moda_eager_and_sdpa_masks_agree():
    x, mask = batch()
    sdpa = tiny_model("moda", num_hidden_layers=3)
    eager = tiny_model("moda", num_hidden_layers=3, attn_implementation="eager")
    eager.load_state_dict(sdpa.state_dict())
    assert eager.config._attn_implementation == "eager"
    real = mask.bool()
    torch.testing.assert_close(logits(eager, x, mask)[real], logits(sdpa, x, mask)[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("design", ["attnres", "block_attnres", "moda", "hires"])
def test_bf16_autocast_training_step(design):
    """fp32 parameters under bf16 autocast (the DepthBench recipe): sources/depth K/V of mixed dtypes."""
    model = (
        tiny_model(design, num_hidden_layers=3, hires_block_layers=1)
        if design == "hires"
        else tiny_model(design, num_hidden_layers=3)
    )
    model.train()
    x, mask = batch()
    ref = model(x, attention_mask=mask, labels=x).loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x, attention_mask=mask, labels=x).loss
    loss.backward()
    assert abs(loss.item() - ref.item()) < 0.02 * ref.item()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
