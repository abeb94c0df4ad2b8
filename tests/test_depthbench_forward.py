"""Converted DepthBench checkpoints compute DepthBench's own forward, for every block type and backend.

The reference (``tests/depthbench_reference.py``) is written from DepthBench's source, cited there by repository,
file and commit: ``keyu-wang-2002/DepthBench`` ``nn/transformer/block.py`` @ 6bdf2ad, ``nn/hyper_connections.py``
@ 8cc2fd7 (and the earlier HC @ 5152cab), ``nn/moda.py`` @ 100da5f, ``kernels/attnres.py`` @ aba1f65,
``nn/transformer/model.py`` @ 5152cab; Liger's mHC kernels ``linkedin/Liger-Kernel``
``src/liger_kernel/triton/mhc.py`` @ bb37285. State dicts carry DepthBench's names, shapes and init values moved
by random perturbations (routing away from identity, AttnRes queries non-zero, MoDA with GQA and the last
block's missing ``kv_proj``).
"""

import json

import pytest
import torch
from depthbench_reference import DBConfig, forward, init_state_dict, with_hc_branch_aliases

import hf_depth
from hf_depth import olmo_core
from hf_depth.olmo_core import hf_depth_to_olmo_core, olmo_core_to_hf_depth

# name -> (reference config, converter keyword arguments, fp64 tolerance)
CASES = {
    "default": (dict(block="default"), {}, 1e-8),
    "peri_norm": (dict(block="peri_norm"), {}, 1e-8),
    "keel": (dict(block="keel"), {}, 1e-8),
    "default_scaled": (dict(block="default_scaled"), {}, 1e-8),
    "deepnorm": (dict(block="deepnorm", layer_norm="layer"), {}, 1e-8),
    "hc": (dict(block="hc", hc_kind="hc"), {"hc_stream_mixing": True}, 1e-8),
    "hc-no-mixing": (dict(block="hc", hc_kind="hc", hc_stream_mixing=False), {"hc_stream_mixing": False}, 1e-8),
    # Liger's Sinkhorn (exp, + 1e-6 per step) and hf_depth's log-domain one share the limit, not the iterates
    "mhc-liger_mhc": (dict(block="mhc", hc_kind="liger_mhc", reduce="mean"), {}, 1e-4),
    "mhc-mhc": (dict(block="mhc", hc_kind="mhc"), {}, 1e-8),
    "mhc-mhc_static": (dict(block="mhc", hc_kind="mhc_static"), {}, 1e-8),
    "attnres-1": (dict(block="attnres", attnres_block_size=1, n_layers=3), {}, 1e-8),
    "attnres-2": (dict(block="attnres", attnres_block_size=2, n_layers=3), {"attnres_block_size": 2}, 1e-8),
    "attnres-4": (dict(block="attnres", attnres_block_size=4, n_layers=3), {"attnres_block_size": 4}, 1e-8),
    "moda": (dict(block="moda", n_layers=3), {}, 1e-8),
    "moda-gqa": (dict(block="moda", n_layers=3, n_kv_heads=2), {}, 1e-8),
}
#: what the converter sets to match DepthBench, and hf_depth's default for each (the defaults do NOT match)
HF_DEFAULTS = {
    "hc-no-mixing": {"hc_stream_mixing": True},
    "mhc-mhc": {"mhc_dynamic_tanh": False, "mhc_sinkhorn_order": "rows_first"},
    "attnres-1": {"attnres_norm_eps": None},
    "attnres-4": {"attnres_norm_eps": None},
    "moda": {"moda_depth_rope": "rotated"},
    "moda-gqa": {"moda_depth_rope": "rotated"},
}


def _ids():
    return torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))


def _case(name, dtype):
    ref_kw, conv_kw, _ = CASES[name]
    cfg = DBConfig(**ref_kw)
    sd = init_state_dict(cfg, seed=0, dtype=dtype)
    if cfg.block in ("hc", "mhc"):
        sd = with_hc_branch_aliases(sd)  # as OLMo-core's state_dict() holds them
    given = dict(num_attention_heads=cfg.n_heads, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.eps, **conv_kw)
    return cfg, sd, given


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


@pytest.mark.parametrize("name", list(CASES))
def test_converted_logits_equal_depthbench_forward(name):
    ids = _ids()
    for dtype, tol in ((torch.float32, 1e-4), (torch.float64, CASES[name][2])):
        cfg, sd, given = _case(name, dtype)
        ref = forward(sd, cfg, ids)
        model = olmo_core_to_hf_depth(sd, cfg.block, dtype=dtype, **given)
        err = float((_logits(model, ids) - ref).abs().max())
        assert err <= tol, f"{name} {dtype}: max |logit diff| {err:.3g} > {tol:g}"


@pytest.mark.parametrize("name", list(HF_DEFAULTS))
def test_hf_depth_defaults_differ_from_depthbench(name):
    """The fields the converter sets are needed: with hf_depth's defaults the logits leave DepthBench's (beyond the fp32 tolerance)."""
    ids = _ids()
    cfg, sd, given = _case(name, torch.float64)
    model = olmo_core_to_hf_depth(sd, cfg.block, dtype=torch.float64, **{**given, **HF_DEFAULTS[name]})
    assert float((_logits(model, ids) - forward(sd, cfg, ids)).abs().max()) > 1e-4  # fails even the fp32 tolerance


# the inverse direction: an hf_depth model with DepthBench's forward fields, exported, runs in DepthBench's forward
INVERSE = [
    ("default", "pre_ln", {}, {}, {}), ("peri_norm", "sandwich_ln", {}, {}, {}), ("keel", "keel", {}, {}, {}),
    ("default_scaled", "lns", {}, {}, {}),
    ("hc", "hc", {"hc_stream_mixing": False}, {"hc_kind": "hc", "hc_stream_mixing": False}, {}),
    ("mhc", "mhc", {"mhc_dynamic_tanh": True, "mhc_sinkhorn_order": "columns_first", "mhc_norm_eps": 1e-8,
                    "mhc_final_reduce": "sum_of_normed"}, {"hc_kind": "mhc"}, {"mhc_backend": "mhc"}),
    ("mhc", "mhc", {}, {"hc_kind": "liger_mhc", "reduce": "mean"}, {"mhc_backend": "liger_mhc"}),
    ("attnres", "block_attnres", {"attnres_block_size": 2, "attnres_norm_eps": 1e-5},
     {"attnres_block_size": 2, "n_layers": 3}, {}),
    ("moda", "moda", {"moda_depth_rope": "unrotated", "num_key_value_heads": 2}, {"n_kv_heads": 2, "n_layers": 3},
     {}),
]


@pytest.mark.parametrize("block,design,fields,ref_kw,export_kw", INVERSE,
                         ids=[f"{b}-{'-'.join(map(str, e.values())) or d}" for b, d, _, _, e in INVERSE])
def test_exported_hf_depth_model_runs_in_depthbench_forward(block, design, fields, ref_kw, export_kw):
    torch.manual_seed(0)
    cfg = DBConfig(block=block, **ref_kw)
    model = hf_depth.model_for(design, vocab_size=cfg.vocab, hidden_size=cfg.d, num_hidden_layers=cfg.n_layers,
                               num_attention_heads=cfg.n_heads, intermediate_size=cfg.ffn, rope_theta=cfg.rope_theta,
                               **fields).double().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("alpha_scale") and export_kw.get("mhc_backend") == "liger_mhc":
                continue
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    sd = hf_depth_to_olmo_core(model, **export_kw)
    ids = _ids()
    err = float((forward(sd, cfg, ids) - _logits(model, ids)).abs().max())
    assert err <= (1e-4 if export_kw.get("mhc_backend") == "liger_mhc" else 1e-8), f"{block}: {err:.3g}"


# ----------------------------------------------------------------------------------------------- refusals
def test_refuses_to_guess_logit_changing_values():
    cfg, sd, given = _case("hc", torch.float32)
    for drop in ("num_attention_heads", "rope_theta", "rms_norm_eps", "hc_stream_mixing"):
        with pytest.raises(ValueError, match=f"refusing to guess.*{drop}"):
            olmo_core_to_hf_depth(sd, "hc", **{k: v for k, v in given.items() if k != drop})
    with pytest.raises(ValueError, match="refusing to guess num_attention_heads, rope_theta, rms_norm_eps \\("):
        olmo_core_to_hf_depth(init_state_dict(DBConfig()), "default")


def test_cli_refuses_in_one_line_then_reads_config_json(tmp_path, capsys):
    cfg = DBConfig(block="attnres", attnres_block_size=2, n_layers=3)
    sd = init_state_dict(cfg)
    src = tmp_path / "step10"
    src.mkdir()
    torch.save(sd, src / "model.pt")
    assert olmo_core.main([str(src), str(tmp_path / "out"), "--design", "attnres"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "num_attention_heads, rope_theta, rms_norm_eps" in err and "--set FIELD=VALUE" in err
    assert not (tmp_path / "out").exists()
    # OLMo-core's config.json: heads, theta, block name and size; a saved `eps: null` is OLMo-core's 1e-5
    (src / "config.json").write_text(json.dumps({"model": {
        "d_model": cfg.d, "n_layers": cfg.n_layers, "vocab_size": cfg.vocab,
        "block": {"name": "attnres", "attnres_block_size": 2, "layer_norm": {"name": "rms", "eps": None},
                  "sequence_mixer": {"n_heads": cfg.n_heads, "rope": {"theta": cfg.rope_theta}}}}}))
    assert olmo_core.main([str(src), str(tmp_path / "out")]) == 0
    from transformers import AutoModelForCausalLM

    out = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert out.config.rms_norm_eps == 1e-5 and out.config.attnres_norm_eps == 1e-5
    assert out.config.rope_theta == cfg.rope_theta and out.config.attnres_block_size == 2
    ids = _ids()
    ref = forward(sd, DBConfig(block="attnres", attnres_block_size=2, n_layers=3, eps=1e-5), ids)
    assert float((_logits(out, ids) - ref).abs().max()) <= 1e-4
    card = (tmp_path / "out" / "README.md").read_text()
    assert "block type `attnres`" in card and "| `attnres_norm_eps` | `1e-05` |" in card
    assert "| `rope_theta` | `500000.0` |" in card and str(src) in card


def test_model_card_records_mhc_backend_and_hc_version(tmp_path):
    from hf_depth.hub import write_conversion_card

    cfg, sd, given = _case("mhc-mhc", torch.float32)
    model = olmo_core_to_hf_depth(sd, "mhc", **given)
    assert model.olmo_core_source["mhc_backend"] == "mhc"
    assert model.olmo_core_source["fields"]["mhc_sinkhorn_order"] == "columns_first"
    card = write_conversion_card(tmp_path, model, model.olmo_core_source).read_text()
    assert "| mhc backend | `mhc` |" in card and "| `mhc_dynamic_tanh` | `True` |" in card
    cfg, sd, given = _case("hc-no-mixing", torch.float32)
    rec = olmo_core_to_hf_depth(sd, "hc", **given).olmo_core_source
    assert "no stream mixing" in rec["hc_version"] and rec["fields"]["hc_stream_mixing"] is False


def test_forward_fields_are_validated():
    for design, field, bad in (("hc", "hc_stream_mixing", "yes"), ("attnres", "attnres_norm_eps", 0),
                               ("block_attnres", "attnres_norm_eps", 2.0), ("moda", "moda_depth_rope", "none"),
                               ("mhc", "mhc_dynamic_tanh", 1), ("mhc", "mhc_sinkhorn_order", "cols")):
        with pytest.raises(ValueError, match=f"`{field}`"):
            hf_depth.config_for(design, **{field: bad})
    # new models keep hf_depth's defaults
    assert hf_depth.config_for("hc").hc_stream_mixing is True
    assert hf_depth.config_for("attnres").attnres_norm_eps is None
    assert hf_depth.config_for("moda").moda_depth_rope == "rotated"
    assert hf_depth.config_for("mhc").mhc_sinkhorn_order == "rows_first"
