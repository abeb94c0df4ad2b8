"""Upcycling Llama / Mistral / Qwen2 / Qwen3 (tiny random configs, built locally) into every design.

The attention features hf_depth grew for it (Llama's ``attention_bias`` on q/k/v/o, Qwen2's q/k/v-only biases,
Qwen3's per-head QK-norm before RoPE) are written from transformers' own source:
huggingface/transformers @ 000c33fdfde12e1ffafbfcdb3c926df5727a00b6, src/transformers/models/qwen3/modeling_qwen3.py
(``Qwen3Attention``: ``q_norm``/``k_norm`` = ``Qwen3RMSNorm(head_dim)`` applied to ``q_proj(x).view(..., head_dim)``
before ``apply_rotary_pos_emb``; q/k/v/o ``bias=config.attention_bias``), and
@ 00d4b3d2142cb4ced2f51b90614b5d26bc045015, src/transformers/models/qwen2/modeling_qwen2.py (``Qwen2Attention``:
q/k/v ``bias=True``, o ``bias=False``). The equality checks compare against the transformers models themselves.
"""

import json

import pytest
import torch
import transformers as tr
from family_helpers import FAMILIES
from helpers import run_without_hf_depth, tiny_config

import hf_depth
from hf_depth.upcycling import EXACT_TOL, MHC_IDENTITY_BOUND, expected_closeness, source_fields

UPCYCLED = ("llama", "mistral", "qwen2", "qwen3")
EXACT = ("pre_ln", "attnres", "block_attnres", "hc")
CHANGING = ("lns", "sandwich_ln", "keel", "moda", "post_ln", "deepnorm")


def source(family: str, seed: int = 0, **overrides):
    """Tiny random ``family`` model, L = 2, with random norms and biases (so a dropped one is caught)."""
    cfg = FAMILIES[family]()
    cfg.num_hidden_layers = 2
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:2]
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    model = tr.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    return model


def ids(vocab=97, t=8, seed=3):
    return torch.randint(0, vocab, (2, t), generator=torch.Generator().manual_seed(seed))


def logits(model, x):
    with torch.no_grad():
        return model(input_ids=x, use_cache=False).logits


# ------------------------------------------------------------------------------------------ family x design
@pytest.mark.parametrize("family", UPCYCLED)
@pytest.mark.parametrize("design", EXACT)
def test_function_preserving_designs_are_exact(family, design):
    src = source(family, attention_bias=True) if family == "llama" else source(family)
    x = ids()
    model, rep = hf_depth.upcycle(src, design, sample=x, verbose=False)
    assert rep.expected == "exact" and rep.bound == EXACT_TOL
    diff = (logits(model, x) - logits(src, x)).abs().max().item()
    assert diff <= EXACT_TOL and rep.max_abs_logit_diff == pytest.approx(diff, abs=1e-7)
    assert "exactly equal" in rep.verdict
    # the new parameters are the design's own, at its init; every source weight was copied
    assert rep.copied_parameters == sum(p.numel() for p in src.parameters()) + (
        src.lm_head.weight.numel() if src.config.tie_word_embeddings else 0)
    assert all("_connection." in k or k.startswith("model.stream.") for k in rep.new_parameter_names)


@pytest.mark.parametrize("family", UPCYCLED)
def test_mhc_identity_within_its_bound(family):
    src, x = source(family), ids()
    model, rep = hf_depth.upcycle(src, "mhc", sample=x, verbose=False)
    assert rep.expected == "bounded" and rep.fields["mhc_init"] == "identity"
    diff = (logits(model, x) - logits(src, x)).abs().max().item()
    assert diff <= MHC_IDENTITY_BOUND and rep.max_abs_logit_diff <= MHC_IDENTITY_BOUND


@pytest.mark.parametrize("family", UPCYCLED)
@pytest.mark.parametrize("design", CHANGING)
def test_function_changing_designs_say_so_with_the_kl(family, design):
    src, x = source(family), ids()
    model, rep = hf_depth.upcycle(src, design, sample=x, verbose=False)
    a, b = logits(src, x).log_softmax(-1), logits(model, x).log_softmax(-1)
    kl = (a.exp() * (a - b)).sum(-1).mean().item()
    assert rep.expected == "differs" and rep.verdict.startswith("differs, continue training")
    assert rep.kl == pytest.approx(kl, rel=1e-3, abs=1e-8) and rep.kl > 1e-7


@pytest.mark.parametrize("family", UPCYCLED)
def test_hires_is_not_promised_even_where_it_is_equal(family):
    """HiRes at L = 2 is one block (Pre-LN): equal on the batch, but the design guarantees nothing: continue training."""
    _, rep = hf_depth.upcycle(source(family), "hires", sample=ids(), verbose=False)
    assert rep.expected == "differs" and rep.bound is None
    assert rep.max_abs_logit_diff <= EXACT_TOL and "does not guarantee" in rep.verdict and "continue training" in rep.verdict


def test_without_the_presets_attnres_and_hc_are_not_exact():
    """The fields ``upcycle`` sets are what make AttnRes / HC exact: the paper defaults miss (mean: eps; HC
    ``sum_of_normed``: n x the logits)."""
    src, x = source("llama"), ids()
    _, rep = hf_depth.upcycle(src, "attnres", sample=x, verbose=False, attnres_scale_by_sources=False)
    assert rep.expected == "differs" and rep.max_abs_logit_diff > 10 * EXACT_TOL
    _, rep = hf_depth.upcycle(src, "hc", sample=x, verbose=False, hc_final_reduce="sum_of_normed")
    assert rep.expected == "differs" and rep.max_abs_logit_diff > 1e-2


def test_upcycle_an_hf_depth_pre_ln_model():
    pre = hf_depth.model_for("pre_ln", **{**tiny_config("pre_ln").to_diff_dict(), "scale_vector": "standard"}).eval()
    x = ids()
    model, rep = hf_depth.upcycle(pre, "block_attnres", sample=x, verbose=False, attnres_block_size=2)
    assert rep.source_family == "hf_depth_pre_ln" and model.config.attnres_block_size == 2
    assert (logits(model, x) - logits(pre, x)).abs().max() <= EXACT_TOL


# ------------------------------------------------------------------------------------------ source features
def test_biases_and_qk_norm_carried():
    assert source_fields(source("qwen2").config)[0]["qkv_bias"] is True
    f = source_fields(source("qwen3").config)[0]
    assert f["use_qk_norm"] is True and f["attention_bias"] is False and f["head_dim"] == 8
    f = source_fields(source("llama", attention_bias=True).config)[0]
    assert f["attention_bias"] is True and "qkv_bias" not in f
    q2 = hf_depth.upcycle(source("qwen2"), "pre_ln", verbose=False)[0].model.layers[0].self_attn
    assert q2.q_proj.bias is not None and q2.v_proj.bias is not None and q2.o_proj.bias is None


def test_qk_norm_is_per_head_before_rope():
    """Reference from Qwen3Attention: q = RoPE(q_norm(q_proj(x).view(..., H, hd))); without the norm it differs."""
    cfg = tiny_config("pre_ln", use_qk_norm=True, head_dim=8)
    torch.manual_seed(0)
    m = hf_depth.model_for("pre_ln", **cfg.to_diff_dict()).eval()
    att = m.model.layers[0].self_attn
    with torch.no_grad():
        att.q_norm.weight.uniform_(0.5, 1.5)
        x = torch.randn(1, 5, 32)
        q, k, _ = att.project_qkv(x)
        ref = att.q_proj(x).view(1, 5, -1, 8)
        ref = ref * torch.rsqrt(ref.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * att.q_norm.weight
        torch.testing.assert_close(q, ref.transpose(1, 2), rtol=1e-6, atol=1e-6)


def test_gqa_and_tied_embeddings():
    src = source("qwen2", tie_word_embeddings=True, num_key_value_heads=1)
    src.tie_weights()
    x = ids()
    model, rep = hf_depth.upcycle(src, "hc", sample=x, verbose=False)
    assert model.config.num_key_value_heads == 1 and not model.config.tie_word_embeddings
    assert any("tie_word_embeddings" in n for n in rep.notes)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert (logits(model, x) - logits(src, x)).abs().max() <= EXACT_TOL


def test_rope_theta_and_eps_carried():
    src = source("llama", rms_norm_eps=1e-5)
    src.config.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    src = tr.AutoModelForCausalLM.from_config(src.config).eval()
    model, rep = hf_depth.upcycle(src, "pre_ln", sample=ids(), verbose=False)
    assert model.config.rope_theta == 500000.0 and model.config.rms_norm_eps == 1e-5
    assert rep.max_abs_logit_diff <= EXACT_TOL


def test_linear_rope_scaling_carried_exactly():
    """transformers' linear RoPE (modeling_rope_utils._compute_linear_scaling_rope_parameters: inv_freq /= factor)."""
    cfg = FAMILIES["llama"]()
    cfg.num_hidden_layers, cfg.layer_types = 2, None
    cfg.rope_parameters = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    torch.manual_seed(0)
    src = tr.AutoModelForCausalLM.from_config(cfg).eval()
    x = ids(t=40)  # positions far enough for the scaling to matter
    model, rep = hf_depth.upcycle(src, "attnres", sample=x, verbose=False)
    assert model.config.rope_scaling_factor == 4.0 and rep.max_abs_logit_diff <= EXACT_TOL
    with pytest.raises(RuntimeError, match="should be exact"):  # unscaled RoPE: another function, caught
        hf_depth.upcycle(src, "pre_ln", sample=x, verbose=False, rope_scaling_factor=1.0)


@pytest.mark.parametrize("change, field", [
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}), "rope_parameters.rope_type"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
     "rope_parameters.partial_rotary_factor"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_refused_with_one_line_naming_the_field(change, field):
    cfg = FAMILIES["llama"]()
    for k, v in change.items():
        setattr(cfg, k, v)
    with pytest.raises(ValueError, match=f"cannot upcycle: `{field}`") as e:
        source_fields(cfg)
    assert "\n" not in str(e.value)


def test_mistral_sliding_window():
    short = FAMILIES["mistral"]()
    short.sliding_window = 16  # < max_position_embeddings = 64: another function beyond 16 tokens
    with pytest.raises(ValueError, match=r"`sliding_window` \(16\) is shorter than the context"):
        source_fields(short)
    fields, notes = source_fields(short, {"max_position_embeddings": 16})
    assert any("no effect, ignored" in n for n in notes)
    long_ = FAMILIES["mistral"]()
    long_.sliding_window = 64
    assert any("sliding_window" in n for n in source_fields(long_)[1])


def test_unsupported_source_refused():
    with pytest.raises(ValueError, match="unsupported source model_type 'gpt2'"):
        hf_depth.upcycle(tr.GPT2LMHeadModel(FAMILIES["gpt2"]()), "hc", verbose=False)
    with pytest.raises(ValueError, match="`design` must be one of"):
        hf_depth.upcycle(source("llama"), "hyper", verbose=False)


def test_expected_closeness_table():
    assert expected_closeness(tiny_config("attnres", attnres_scale_by_sources=True))[0] == "exact"
    assert expected_closeness(tiny_config("attnres"))[0] == "differs"
    assert expected_closeness(tiny_config("mhc", mhc_init="identity"))[0] == "bounded"
    assert expected_closeness(tiny_config("lns"))[0] == "differs"


# ------------------------------------------------------------------------------------------ config support
def test_attention_fields_validated():
    with pytest.raises(ValueError, match="`qkv_bias`.*`attention_bias`.*exclude each other"):
        tiny_config("pre_ln", qkv_bias=True, attention_bias=True)
    with pytest.raises(ValueError, match="`use_qk_norm` must be True or False"):
        tiny_config("pre_ln", use_qk_norm="yes")
    with pytest.raises(ValueError, match="`rope_scaling_factor` must be a positive number"):
        tiny_config("pre_ln", rope_scaling_factor=0.0)
    with pytest.raises(ValueError, match="`attnres_scale_by_sources` must be True or False"):
        tiny_config("attnres", attnres_scale_by_sources=1)


def test_defaults_leave_the_decoder_unchanged():
    names = set(hf_depth.model_for("pre_ln", **tiny_config("pre_ln").to_diff_dict()).state_dict())
    assert not any(k.endswith(("q_norm.weight", "k_norm.weight", "q_proj.bias")) for k in names)


# ------------------------------------------------------------------------------------------ CLI
def test_cli_writes_a_remote_code_folder(tmp_path, capsys):
    from hf_depth.cli import main

    src = source("qwen3")
    src.save_pretrained(tmp_path / "src")
    (tmp_path / "src" / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    rc = main(["upcycle", str(tmp_path / "src"), str(tmp_path / "out"), "--design", "block_attnres",
               "--set", "attnres_block_size=2"])
    out = capsys.readouterr().out
    assert rc == 0 and "exactly equal" in out
    assert (tmp_path / "out" / "tokenizer_config.json").exists() and (tmp_path / "out" / "generation_config.json").exists()
    rep = json.loads((tmp_path / "out" / "upcycle.json").read_text())
    assert rep["expected"] == "exact" and rep["fields"]["attnres_block_size"] == 2
    assert "exactly equal" in (tmp_path / "out" / "README.md").read_text()
    x = ids()
    torch.save(x, tmp_path / "x.pt")
    code = f"""
import sys, torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained({str(tmp_path / "out")!r}, trust_remote_code=True).eval()
assert 'hf_depth' not in sys.modules
with torch.no_grad():
    torch.save(m(input_ids=torch.load({str(tmp_path / "x.pt")!r}), use_cache=False).logits, {str(tmp_path / "y.pt")!r})
"""
    r = run_without_hf_depth(tmp_path, code)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (torch.load(tmp_path / "y.pt") - logits(src, x)).abs().max() <= EXACT_TOL


def test_cli_refusal_is_one_line(tmp_path, capsys):
    from hf_depth.cli import main

    src = source("mistral", sliding_window=8)
    src.save_pretrained(tmp_path / "src")
    capsys.readouterr()
    assert main(["upcycle", str(tmp_path / "src"), str(tmp_path / "out"), "--design", "hc"]) == 2
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if "Loading weights" not in ln]
    assert len(err) == 1 and "sliding_window" in err[0] and "max_position_embeddings=8" in err[0]
    assert main(["upcycle", str(tmp_path / "src"), str(tmp_path / "out"), "--design", "hc",
                 "--set", "max_position_embeddings=8"]) == 0


@pytest.mark.parametrize("field", ["qkv_bias", "use_qk_norm"])
def test_llama_converter_refuses_qwen_attention(field):
    from hf_depth.convert import pre_ln_to_llama

    model = hf_depth.model_for("pre_ln", **tiny_config("pre_ln", **{field: True}).to_diff_dict())
    with pytest.raises(ValueError, match=f"`{field}=True` has no Llama equivalent"):
        pre_ln_to_llama(model)
