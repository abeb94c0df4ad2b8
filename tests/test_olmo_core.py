"""DepthBench / OLMo-core checkpoint converter: exact logits, refusals, round trips, CLI."""

import json
import math
import os

import pytest
import torch

import hf_depth
from hf_depth import olmo_core
from hf_depth.olmo_core import hf_depth_to_olmo_core, olmo_core_to_hf_depth

D, L, H, V, F = 32, 2, 4, 97, 96  # tiny: hidden 32, 2 blocks, 4 heads (head_dim 8), vocab 97, FFN 96
FIELDS = dict(num_attention_heads=H, rope_theta=10000.0, rms_norm_eps=1e-6, pad_token_id=1, eos_token_id=3)
HC = dict(hc_stream_mixing=True)  # the HC version: never guessed by the converter


def _ids():
    return torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(3))


def _logits(model):
    with torch.no_grad():
        return model(_ids(), use_cache=False).logits


def _need(design):
    if design not in hf_depth.DESIGNS:
        pytest.skip(f"design {design!r} is not registered on this branch")


def _randomize(model, seed=0):
    """Move every parameter off its init so that a wrong mapping changes the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


# ----------------------------------------------------------------------------------------------- hand-written
def _t(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.1


def _fixture_default():
    """An OLMo-core Pre-LN ``TransformerBlock`` state dict, names and shapes as written in DepthBench's source."""
    sd, s = {}, 0
    sd["embeddings.weight"] = _t(V, D, seed=(s := s + 1))
    for i in range(L):
        for n, shape in (("attention.w_q", (D, D)), ("attention.w_k", (D, D)), ("attention.w_v", (D, D)),
                         ("attention.w_out", (D, D)), ("feed_forward.w1", (F, D)), ("feed_forward.w2", (D, F)),
                         ("feed_forward.w3", (F, D))):
            sd[f"blocks.{i}.{n}.weight"] = _t(*shape, seed=(s := s + 1))
        sd[f"blocks.{i}.attention_norm.weight"] = 1 + _t(D, seed=(s := s + 1))
        sd[f"blocks.{i}.feed_forward_norm.weight"] = 1 + _t(D, seed=(s := s + 1))
    sd["lm_head.norm.weight"] = 1 + _t(D, seed=(s := s + 1))
    sd["lm_head.w_out.weight"] = _t(V, D, seed=(s := s + 1))
    return sd


def _direct(design, sd, extra=()):
    """The same model built by hand: hf_depth names written out here, independently of the converter's tables."""
    model = hf_depth.model_for(design, vocab_size=V, hidden_size=D, num_hidden_layers=L, **FIELDS).eval()
    m = model.model
    with torch.no_grad():
        m.embed_tokens.weight.copy_(sd["embeddings.weight"])
        model.lm_head.weight.copy_(sd["lm_head.w_out.weight"])
        m.norm.weight.copy_(sd["lm_head.norm.weight"])
        for i, layer in enumerate(m.layers):
            b = f"blocks.{i}."
            layer.self_attn.q_proj.weight.copy_(sd[b + "attention.w_q.weight"])
            layer.self_attn.k_proj.weight.copy_(sd[b + "attention.w_k.weight"])
            layer.self_attn.v_proj.weight.copy_(sd[b + "attention.w_v.weight"])
            layer.self_attn.o_proj.weight.copy_(sd[b + "attention.w_out.weight"])
            layer.mlp.gate_proj.weight.copy_(sd[b + "feed_forward.w1.weight"])
            layer.mlp.down_proj.weight.copy_(sd[b + "feed_forward.w2.weight"])
            layer.mlp.up_proj.weight.copy_(sd[b + "feed_forward.w3.weight"])
            layer.input_layernorm.weight.copy_(sd[b + "attention_norm.weight"])
            layer.post_attention_layernorm.weight.copy_(sd[b + "feed_forward_norm.weight"])
            for olmo, get in extra:
                if b + olmo in sd:
                    get(layer).copy_(sd[b + olmo])
    return model


def test_default_hand_written_fixture_exact_logits():
    sd = _fixture_default()
    conv = olmo_core_to_hf_depth(sd, "default", **FIELDS)
    assert type(conv).__name__ == "PreLNForCausalLM"
    assert conv.config.num_hidden_layers == L and conv.config.intermediate_size == F
    torch.testing.assert_close(_logits(conv), _logits(_direct("pre_ln", sd)), rtol=0, atol=0)


def test_peri_norm_and_keel_hand_written_fixture():
    for block, design, conn in (("peri_norm", "sandwich_ln", "output_norm"), ("keel", "keel", "post_norm")):
        sd = _fixture_default()
        for i in range(L):
            if not (block == "keel" and i == 0):  # KEEL block 0 has no post-attention norm
                sd[f"blocks.{i}.post_attention_norm.weight"] = 1 + _t(D, seed=100 + i)
            sd[f"blocks.{i}.post_feed_forward_norm.weight"] = 1 + _t(D, seed=200 + i)
        extra = (("post_attention_norm.weight", lambda ly, c=conn: getattr(ly.attn_connection, c).weight),
                 ("post_feed_forward_norm.weight", lambda ly, c=conn: getattr(ly.mlp_connection, c).weight))
        conv = olmo_core_to_hf_depth(sd, block, **FIELDS)
        torch.testing.assert_close(_logits(conv), _logits(_direct(design, sd, extra)), rtol=0, atol=0)


def test_deepnorm_fixture_norms_are_post_add_layernorms():
    sd = _fixture_default()
    for i in range(L):
        sd[f"blocks.{i}.attention_norm.bias"] = _t(D, seed=300 + i)
        sd[f"blocks.{i}.feed_forward_norm.bias"] = _t(D, seed=400 + i)
    sd["lm_head.norm.bias"] = _t(D, seed=500)
    conv = olmo_core_to_hf_depth(sd, "deepnorm", **FIELDS)
    m = conv.model
    assert torch.equal(m.layers[1].attn_connection.norm.weight, sd["blocks.1.attention_norm.weight"])
    assert torch.equal(m.layers[1].mlp_connection.norm.bias, sd["blocks.1.feed_forward_norm.bias"])
    assert torch.equal(m.norm.bias, sd["lm_head.norm.bias"])
    assert conv.config.final_norm_kind == "layer"
    # DepthBench's launcher: block LayerNorms, final RMSNorm (no lm_head.norm.bias) -> deepnorm_final_norm="rms"
    del sd["lm_head.norm.bias"]
    conv = olmo_core_to_hf_depth(sd, "deepnorm", **FIELDS)
    assert conv.config.deepnorm_final_norm == "rms" and getattr(conv.model.norm, "bias", None) is None
    direct = hf_depth.model_for("deepnorm", vocab_size=V, hidden_size=D, num_hidden_layers=L,
                                deepnorm_final_norm="rms", **FIELDS).eval()
    direct.load_state_dict(conv.state_dict())
    final = direct.model.norm
    h = torch.randn(3, D)
    ref = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + direct.config.rms_norm_eps) * sd["lm_head.norm.weight"]
    torch.testing.assert_close(final(h), ref, rtol=1e-6, atol=1e-6)  # an RMSNorm, as DepthBench's lm_head.norm
    torch.testing.assert_close(_logits(conv), _logits(direct), rtol=0, atol=0)
    # a block LayerNorm saved without bias converts with a zero bias (the same function)
    for k in [k for k in sd if k.endswith("norm.bias")]:
        del sd[k]
    conv = olmo_core_to_hf_depth(sd, "deepnorm", **FIELDS)
    assert torch.count_nonzero(conv.model.layers[0].attn_connection.norm.bias) == 0


def test_fused_qkv_equals_separate():
    sd = _fixture_default()
    fused = dict(sd)
    for i in range(L):
        b = f"blocks.{i}.attention."
        fused[b + "w_qkv.weight"] = torch.cat([fused.pop(b + f"w_{p}.weight") for p in "qkv"], dim=0)
    a, b = olmo_core_to_hf_depth(sd, "default", **FIELDS), olmo_core_to_hf_depth(fused, "default", **FIELDS)
    torch.testing.assert_close(_logits(a), _logits(b), rtol=0, atol=0)
    back = hf_depth_to_olmo_core(b, fused_qkv=True)
    assert set(back) == set(fused) and all(torch.equal(back[k], fused[k]) for k in fused)


def test_refuses_unknown_and_missing_keys_naming_them():
    sd = _fixture_default()
    sd["blocks.0.attention_hyper_connection.static_alpha"] = torch.zeros(4, 5)
    with pytest.raises(ValueError, match=r"unmapped keys.*blocks\.0\.attention_hyper_connection\.static_alpha"):
        olmo_core_to_hf_depth(sd, "default", **FIELDS)
    sd = _fixture_default()
    del sd["blocks.1.feed_forward_norm.weight"]
    with pytest.raises(ValueError, match=r"missing keys.*blocks\.1\.feed_forward_norm\.weight"):
        olmo_core_to_hf_depth(sd, "default", **FIELDS)
    sd = _fixture_default()  # a Peri-LN checkpoint read as Pre-LN would drop its post norms: refused
    sd["blocks.0.post_attention_norm.weight"] = torch.ones(D)
    with pytest.raises(ValueError, match="post_attention_norm"):
        olmo_core_to_hf_depth(sd, "default", **FIELDS)
    with pytest.raises(ValueError, match="`design`"):
        olmo_core_to_hf_depth(_fixture_default(), "nGPT", **FIELDS)


def test_prefixes_and_lns_buffer():
    sd = {f"model.{k.replace('blocks.0.', 'blocks.0._checkpoint_wrapped_module.')}": v
          for k, v in _fixture_default().items()}
    conv = olmo_core_to_hf_depth(sd, "default", **FIELDS)
    torch.testing.assert_close(_logits(conv), _logits(_direct("pre_ln", _fixture_default())), rtol=0, atol=0)
    sd = _fixture_default()
    sd["blocks.0.ln_scale"], sd["blocks.1.ln_scale"] = torch.tensor(1.0), torch.tensor(2**-0.5)
    assert type(olmo_core_to_hf_depth(sd, "default_scaled", **FIELDS)).__name__ == "LNSForCausalLM"
    sd["blocks.1.ln_scale"] = torch.tensor(0.3)
    with pytest.raises(ValueError, match="ln_scale"):
        olmo_core_to_hf_depth(sd, "default_scaled", **FIELDS)


# ----------------------------------------------------------------------------------------------- round trips
ROUND_TRIP = [
    ("default", {}), ("peri_norm", {}), ("default_scaled", {}), ("deepnorm", {}), ("keel", {}),
    ("hc", {}), ("mhc", {"mhc_backend": "liger_mhc"}), ("mhc", {"mhc_backend": "mhc"}),
    ("attnres", {"attnres_block_size": 1}),
    ("attnres", {"attnres_block_size": 2}), ("moda", {}),
]


@pytest.mark.parametrize("block,kw", ROUND_TRIP, ids=[f"{b}-{'-'.join(map(str, k.values()))}" for b, k in ROUND_TRIP])
def test_round_trip_identical_logits(block, kw):
    kw = dict(kw)
    backend = kw.pop("mhc_backend", None)
    design = olmo_core._design_name(block, kw)
    _need(design)
    if design == "attnres":
        kw.pop("attnres_block_size")
    cfg = {**FIELDS, **kw}
    torch.manual_seed(0)
    model = _randomize(hf_depth.model_for(design, vocab_size=V, hidden_size=D, num_hidden_layers=L, **cfg).eval())
    sd = hf_depth_to_olmo_core(model, **({"mhc_backend": backend} if backend else {}))
    assert all(k.startswith(("embeddings.", "blocks.", "lm_head.", "res_")) for k in sd)
    # the fields that follow DepthBench's forward by default (mHC backend, AttnRes eps, MoDA depth RoPE, HC
    # version): pin them to the model's
    cfg.update({k: getattr(model.config, k) for k in olmo_core._FORWARD_FIELDS if hasattr(model.config, k)})
    back = olmo_core_to_hf_depth(sd, block, mhc_backend=backend, **cfg)
    assert back.config.design == design
    torch.testing.assert_close(_logits(back), _logits(model), rtol=0, atol=0)
    again = hf_depth_to_olmo_core(back, **({"mhc_backend": backend} if backend else {}))
    assert set(again) == set(sd) and all(torch.equal(again[k], sd[k]) for k in sd)
    # no key is ever dropped: removing any one OLMo-core key is refused, naming it
    k = sorted(sd)[len(sd) // 2]
    with pytest.raises(ValueError, match=k.replace(".", r"\.")):
        olmo_core_to_hf_depth({x: v for x, v in sd.items() if x != k}, block, mhc_backend=backend, **cfg)
    with pytest.raises(ValueError, match=r"unmapped keys.*blocks\.0\.bogus"):
        olmo_core_to_hf_depth({**sd, "blocks.0.bogus": torch.zeros(1)}, block, mhc_backend=backend, **cfg)


def test_hc_branch_aliases_checked():
    _need("hc")
    torch.manual_seed(0)
    model = _randomize(hf_depth.model_for("hc", vocab_size=V, hidden_size=D, num_hidden_layers=L, **FIELDS).eval())
    sd = hf_depth_to_olmo_core(model, hc_branch_aliases=True)
    assert "blocks.0.attention_hyper_connection.branch.attention.w_q.weight" in sd
    assert "blocks.1.feed_forward_hyper_connection.branch.norm.weight" in sd
    back = olmo_core_to_hf_depth(sd, "hc", **FIELDS, **HC)
    torch.testing.assert_close(_logits(back), _logits(model), rtol=0, atol=0)
    sd["blocks.0.attention_hyper_connection.branch.attention.w_q.weight"] = torch.zeros(D, D)
    with pytest.raises(ValueError, match="branch.attention.w_q.weight"):
        olmo_core_to_hf_depth(sd, "hc", **FIELDS, **HC)


def test_mhc_torch_layout_transposes_h_res():
    """DepthBench's torch mHC applies R[s, t] (mixed_t = sum_s R[s,t] H_s); hf_depth R[t, s]: the mapping transposes."""
    _need("mhc")
    torch.manual_seed(0)
    model = _randomize(hf_depth.model_for("mhc", vocab_size=V, hidden_size=D, num_hidden_layers=L, **FIELDS).eval())
    sd = hf_depth_to_olmo_core(model, mhc_backend="mhc")
    conn = model.model.layers[0].attn_connection
    n = sd["blocks.0.attention_hyper_connection.pre_bias"].shape[0]
    bias = getattr(conn, olmo_core.MHC_NAMES["bias"])
    torch.testing.assert_close(sd["blocks.0.attention_hyper_connection.residual_bias"],
                               bias[2 * n:].reshape(n, n).T, rtol=0, atol=0)


def _depthbench_sinkhorn(z, iters=20):
    """DepthBench's ``sinkhorn_log`` (u/v potentials, marginals 1/n, times n), written from its source."""
    n = z.shape[-1]
    u, v = torch.zeros(n, dtype=z.dtype), torch.zeros(n, dtype=z.dtype)
    for _ in range(iters):
        u = -math.log(n) - torch.logsumexp(z + v[None, :], dim=-1)
        v = -math.log(n) - torch.logsumexp(z + u[:, None], dim=-2)
    return torch.exp(z + u[:, None] + v[None, :]) * n


def test_mhc_static_maps_to_equal_routing_weights():
    """``mhc_static``: H_pre = softmax, H_post = softmax, H_res = Sinkhorn, input independent; mixed_t = sum_s R[s,t]."""
    _need("mhc")
    torch.manual_seed(0)
    model = _randomize(hf_depth.model_for("mhc", vocab_size=V, hidden_size=D, num_hidden_layers=L, **FIELDS).eval())
    sd = {k: v for k, v in hf_depth_to_olmo_core(model).items() if "hyper_connection" not in k}
    g, n = torch.Generator().manual_seed(5), 4
    for i in range(L):
        for s in ("attention", "feed_forward"):
            p = f"blocks.{i}.{s}_hyper_connection."
            sd[p + "H_pre_logits"] = torch.randn(n, generator=g)
            sd[p + "H_post_logits"] = torch.randn(n, generator=g)
            sd[p + "H_res_logits"] = torch.randn(n, n, generator=g)  # moderate logits: Sinkhorn converged
    conv = olmo_core_to_hf_depth(sd, "mhc", **FIELDS)
    assert conv.config.mhc_final_reduce == "sum_of_normed"
    for i, layer in enumerate(conv.model.layers):
        for s, conn in (("attention", layer.attn_connection), ("feed_forward", layer.mlp_connection)):
            p = f"blocks.{i}.{s}_hyper_connection."
            w = conn.static_weights()
            torch.testing.assert_close(w["pre"], torch.softmax(sd[p + "H_pre_logits"], -1), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(w["post"], torch.softmax(sd[p + "H_post_logits"], -1), rtol=1e-5, atol=1e-6)
            # hf_depth's R[t, s] is DepthBench's R[s, t] (same up to Sinkhorn's 20-iteration residual)
            torch.testing.assert_close(w["res"], _depthbench_sinkhorn(sd[p + "H_res_logits"].double()).T.float(),
                                       rtol=1e-5, atol=1e-5)
            assert torch.count_nonzero(getattr(conn, olmo_core.MHC_NAMES["phi"])) == 0
    back = hf_depth_to_olmo_core(conv, mhc_backend="mhc_static")
    for k, v in sd.items():
        if k.endswith(("pre_logits", "post_logits")):  # logits are defined up to a shift: compare the softmax
            torch.testing.assert_close(torch.softmax(back[k], -1), torch.softmax(v, -1), rtol=1e-5, atol=1e-6)
        else:
            torch.testing.assert_close(back[k], v, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="mhc_static"):  # a general mHC model has no static form: refused
        hf_depth_to_olmo_core(model, mhc_backend="mhc_static")


# ----------------------------------------------------------------------------------------------- files / CLI
def test_cli_pt_safetensors_and_config_json(tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    sd = _fixture_default()
    ref = _logits(_direct("pre_ln", sd))
    torch.save({"model": sd}, tmp_path / "ckpt.pt")
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    save_file(sd, str(src_dir / "model.safetensors"))
    olmo_cfg = {"model": {"d_model": D, "n_layers": L, "vocab_size": V,
                          "block": {"name": "default", "sequence_mixer": {"n_heads": H, "rope": {"theta": 10000}},
                                    "layer_norm": {"eps": 1e-6}}}}
    (src_dir / "config.json").write_text(json.dumps(olmo_cfg))
    runs = [
        [str(tmp_path / "ckpt.pt"), str(tmp_path / "out_pt"), "--design", "default", "--set", f"num_attention_heads={H}",
         "--set", "rope_theta=10000", "--set", "rms_norm_eps=1e-6", "--set", "pad_token_id=1", "--set", "eos_token_id=3"],
        [str(src_dir), str(tmp_path / "out_st"), "--set", "pad_token_id=1", "--set", "eos_token_id=3"],
    ]
    for argv in runs:
        assert olmo_core.main(argv) == 0
        out = AutoModelForCausalLM.from_pretrained(argv[1]).eval()
        assert type(out).__name__ == "PreLNForCausalLM"
        assert out.generation_config.pad_token_id == 1
        torch.testing.assert_close(_logits(out), ref, rtol=0, atol=0)
    bad = dict(sd, **{"blocks.0.extra.weight": torch.zeros(1)})
    torch.save(bad, tmp_path / "bad.pt")
    assert olmo_core.main([str(tmp_path / "bad.pt"), str(tmp_path / "no"), "--design", "default",
                           "--set", f"num_attention_heads={H}", "--set", "rope_theta=1e4", "--set", "rms_norm_eps=1e-6"]) == 2
    assert not os.path.exists(tmp_path / "no")


def test_distributed_checkpoint_folder(tmp_path):
    import torch.distributed.checkpoint as dcp

    sd = _fixture_default()
    state = {"model": {k: v.clone() for k, v in sd.items()}, "optim": {"step": torch.tensor(3)}}
    try:
        dcp.save(state, checkpoint_id=str(tmp_path / "step3" / "model_and_optim"))
    except Exception as e:  # pragma: no cover - depends on the torch build
        pytest.skip(f"torch.distributed.checkpoint unavailable here: {e}")
    loaded = olmo_core.load_state_dict(str(tmp_path / "step3"))
    assert set(loaded) == set(sd)
    conv = olmo_core_to_hf_depth(loaded, "default", **FIELDS)
    torch.testing.assert_close(_logits(conv), _logits(_direct("pre_ln", sd)), rtol=0, atol=0)


def test_tokenizer_defaults():
    sd = _fixture_default()
    conv = olmo_core_to_hf_depth(sd, "default", num_attention_heads=H, rope_theta=1e4, rms_norm_eps=1e-6)
    assert conv.config.pad_token_id == olmo_core.TOKENIZER["pad_token_id"]
    assert conv.config.eos_token_id == olmo_core.TOKENIZER["eos_token_id"]
    assert hf_depth.config_for("pre_ln").vocab_size == olmo_core.TOKENIZER["vocab_size"]
