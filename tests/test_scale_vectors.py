"""The RMSNorm scale-vector family (HG, AP/DP/DNP, OR/ER) x every residual design, and the IWD groups."""

import itertools
import re

import pytest
import torch
from helpers import batch, tiny_config, tiny_model, train_steps
from torch import nn
from transformers import AutoModelForCausalLM

import hf_depth
from hf_depth import shapes
from hf_depth.models.norms import ProjectionScales, ScaleVector, parameter_roles
from hf_depth.training.optim import POLICIES, build_param_groups, describe_param_groups, make_optimizer

DESIGNS = sorted(hf_depth.DESIGNS)
#: every valid combination: standard, none, and HG x {-, AP, DP, DNP} x {-, OR, ER} (not all empty)
ALL_COMBOS = ["standard", "none"] + [
    "+".join(p for p in combo if p)
    for combo in itertools.product(("", "HG"), ("", "AP", "DP", "DNP"), ("", "OR", "ER"))
    if any(combo)
]
#: trained on Pre-LN: one per component, the paper's best and the heaviest mix (`standard` x every design: test_designs)
TRAIN_COMBOS = ["none", "HG", "AP", "DP", "DNP", "OR", "ER", "best", "HG+DP+ER"]


def built_count(config) -> int:
    with torch.device("meta"):
        model = hf_depth.MODEL_CLASSES[config.design][1](config)
    return sum(p.numel() for p in model.parameters())


def randomize_scales(model, seed=0):
    """Move every scale vector / norm weight away from its init (so tests see them act)."""
    g = torch.Generator().manual_seed(seed)
    roles = parameter_roles(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if roles[name] in ("input_norm", "output_norm"):
                p.add_(0.3 * torch.randn(p.shape, generator=g))


# ----------------------------------------------------------------------------------------------- counts
def test_all_combos_enumerated():
    assert len(ALL_COMBOS) == 25 and "HG+DNP+OR" in ALL_COMBOS
    for sv in ALL_COMBOS:
        tiny_config("pre_ln", scale_vector=sv)  # every one parses


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("scale_vector", ALL_COMBOS + ["best"])
def test_count_matches_built_model(design, scale_vector):
    cfg = tiny_config(design, scale_vector=scale_vector)
    assert shapes.count_params(cfg) == built_count(cfg)


def test_count_overheads_at_depthbench_shape():
    """Exact overhead of HG+DNP+OR on L=24, d=1024 (GQA off): hand count of every scale vector."""
    base = shapes.count_params(shapes.make_config("pre_ln", 1024, 24))
    best = shapes.count_params(shapes.make_config("pre_ln", 1024, 24, scale_vector="best"))
    d, f, L = 1024, 2736, 24
    # HG inputs (direction only under DNP); q/k/v and gate/up outputs (OR: + a magnitude beta each)
    per_layer = 5 * d + 3 * (d + 1) + 2 * (f + 1)
    assert best - base == L * (per_layer - 2 * d) + 1  # input norms lose d each; the final norm gains beta


# ----------------------------------------------------------------------------------------------- equivalences
def test_standard_folded_equals_none_folded():
    """Theorem 2.2 premise: in Pre-LN the gammas fold into the next linear maps (W diag(gamma))."""
    std = tiny_model("pre_ln", scale_vector="standard")
    randomize_scales(std)
    none = tiny_model("pre_ln", scale_vector="none")
    sd = dict(std.state_dict())
    folded = {}
    for i in range(std.config.num_hidden_layers):
        p = f"model.layers.{i}."
        for norm, projs in (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                            ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"))):
            gamma = sd.pop(p + norm + ".weight")
            for proj in projs:
                folded[p + proj + ".weight"] = sd[p + proj + ".weight"] * gamma[None, :]
    folded["lm_head.weight"] = sd["lm_head.weight"] * sd.pop("model.norm.weight")[None, :]
    sd.update(folded)
    none.load_state_dict(sd, strict=True)
    x, mask = batch()
    with torch.no_grad():
        torch.testing.assert_close(none(x, attention_mask=mask).logits, std(x, attention_mask=mask).logits,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reparam", ["OR", "ER", "HG+DNP+OR", "HG+DP+ER"])
def test_reparam_gamma_one_at_init_and_gradients_reach_alpha_beta(reparam):
    model = tiny_model("sandwich_ln", scale_vector=reparam).train()
    vectors = [m for m in model.modules() if isinstance(m, ScaleVector)]
    assert vectors and all(v.reparam == reparam.split("+")[-1] for v in vectors)
    for v in vectors:
        assert torch.equal(v(), torch.ones(v.dim)), v  # exactly 1
    x, _ = batch(left_pad=(0, 0, 0))
    model(x, labels=x).loss.backward()
    for name, p in model.named_parameters():
        if name.endswith((".alpha", ".beta")):
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_reparam_formulas():
    torch.manual_seed(0)
    o, e = ScaleVector(8, reparam="OR"), ScaleVector(8, reparam="ER")
    with torch.no_grad():
        for v in (o, e):
            v.alpha.normal_()
            v.beta.fill_(0.7)
    a = o.alpha.detach()
    torch.testing.assert_close(o(), 0.7 * a / a.norm() * 8**0.5)  # beta * alpha/||alpha||, beta = rms(gamma)
    torch.testing.assert_close(o().pow(2).mean().sqrt(), torch.tensor(0.7))
    a = e.alpha.detach()
    torch.testing.assert_close(e(), torch.exp(torch.tensor(0.7)) * torch.exp(a - a.mean()))


@pytest.mark.parametrize("design", ["pre_ln", "keel"])
def test_hg_at_init_equals_standard(design):
    std, hg = tiny_model(design, scale_vector="standard"), tiny_model(design, scale_vector="HG")
    hg_sd = hg.state_dict()
    shared = {k: v for k, v in std.state_dict().items() if k in hg_sd}
    assert not any(k.endswith("layernorm.weight") for k in hg_sd)  # the input norms lost their gamma
    assert any(".scales.q_in.weight" in k for k in hg_sd) and any(".scales.up_in.weight" in k for k in hg_sd)
    hg.load_state_dict(shared, strict=False)
    x, mask = batch()
    with torch.no_grad():
        torch.testing.assert_close(hg(x, attention_mask=mask).logits, std(x, attention_mask=mask).logits,
                                   rtol=0, atol=0)


def _rms(t, eps):
    return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)


def test_dnp_attention_equals_explicit_qk_norm_reference():
    """DNP on attention: q = u_q * N_head(W_q (gamma * N(x))), same for k (QK-norm) and v; then RoPE, softmax."""
    model = tiny_model("pre_ln", scale_vector="DNP")
    randomize_scales(model)
    cfg, layer = model.config, model.model.layers[0]
    attn, eps, H, KV, hd = layer.self_attn, cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    x = torch.randn(2, 7, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    pos = torch.arange(7)[None].expand(2, 7)
    cos, sin = model.model.rotary_emb(x, pos)
    with torch.no_grad():
        got, _ = attn(layer.input_layernorm(x), (cos, sin), attention_mask=None)
        h = layer.input_layernorm.weight * _rms(x, eps)

        def head(w, u, n):  # per-head RMSNorm with a per-channel gamma (QK-norm)
            y = (h @ w.T).view(2, 7, n, hd)
            return (_rms(y, eps) * u.view(n, hd)).transpose(1, 2)

        s = attn.scales
        q = head(attn.q_proj.weight, s.q_out.weight, H)
        k = head(attn.k_proj.weight, s.k_out.weight, KV)
        v = head(attn.v_proj.weight, s.v_out.weight, KV)
        rot = lambda t: torch.cat((-t[..., hd // 2:], t[..., : hd // 2]), -1)  # noqa: E731
        c, sn = cos[:, None], sin[:, None]
        q, k = q * c + rot(q) * sn, k * c + rot(k) * sn
        k, v = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
        scores = (q @ k.transpose(-1, -2)) / hd**0.5
        scores = scores.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 7, -1)
        ref = out @ attn.o_proj.weight.T
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_dnp_mlp_and_ap_dp_formulas():
    torch.manual_seed(0)
    x = torch.randn(3, 32)
    for sv, expect in (("AP", lambda y, u: u * y), ("DP", lambda y, u: u * y), ("DNP", lambda y, u: u * _rms(y, 1e-6))):
        cfg = tiny_config("pre_ln", scale_vector=sv)
        s = ProjectionScales(cfg, {"gate": (32, 96)})
        with torch.no_grad():
            s.gate_out.weight.normal_()
        assert s.inputs(x) == (x,)  # no input side without HG
        y = torch.randn(3, 96)
        torch.testing.assert_close(s.outputs("gate", y), expect(y, s.gate_out.weight))


def test_standard_state_dict_is_llamas():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = tiny_model("pre_ln")
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=model.config.intermediate_size, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in llama.state_dict().items() if "rotary" not in k}
    assert ours == theirs


# ----------------------------------------------------------------------------------------------- every design
def _combos_for(design):
    """Pre-LN trains every combination in TRAIN_COMBOS; the other designs (CPU budget) two that between them
    hold every kind of parameter: AP+ER (output-side scales, ER) and best (HG inputs, DNP, OR)."""
    return TRAIN_COMBOS if design == "pre_ln" else ["AP+ER", "best"]


@pytest.mark.parametrize("design,scale_vector", [(d, sv) for d in DESIGNS for sv in _combos_for(d)])
def test_combo_trains_and_reloads(design, scale_vector, tmp_path):
    model = tiny_model(design, scale_vector=scale_vector).train()
    x = torch.randint(2, 97, (2, 12), generator=torch.Generator().manual_seed(3))
    losses = train_steps(model, x, make_optimizer(model, lr=3e-3, weight_decay=0.1, policy="iwd"), 20)
    assert losses[-1] < 0.8 * losses[0], losses
    model.eval().save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    x, mask = batch()
    with torch.no_grad():
        torch.testing.assert_close(again(x, attention_mask=mask).logits, model(x, attention_mask=mask).logits,
                                   rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------- roles and groups
@pytest.mark.parametrize("design", ["sandwich_ln", "keel"])
def test_iwd_groups_split_input_and_output_norms(design):
    model = tiny_model(design, scale_vector="best")
    L, wd = model.config.num_hidden_layers, 0.1
    groups = build_param_groups(model, "iwd", wd)
    by_name = {n: (g["role"], g["weight_decay"]) for g in groups for n in g["names"]}
    assert len(by_name) == len(list(model.parameters()))
    out_pat = re.compile(r"(scales\.\w+_out\.|connection\.(output_norm|post_norm)\.scale\.)(alpha|beta)$")
    in_pat = re.compile(r"(scales\.\w+_in\.|^model\.norm\.scale\.)(alpha|beta)$")
    outputs = [n for n in by_name if out_pat.search(n)]
    inputs = [n for n in by_name if in_pat.search(n)]
    n_post = 2 * L if design == "sandwich_ln" else 2 * L - 1  # KEEL's sublayer 0 has no post norm
    assert len(outputs) == 2 * (5 * L + n_post)  # q,k,v,gate,up output scales + output norms, alpha and beta
    assert len(inputs) == 5 * L + 2  # HG input scales (alpha only under DNP) + the final norm (alpha, beta)
    assert all(by_name[n] == ("output_norm", 0.0) for n in outputs)
    assert all(by_name[n] == ("input_norm", wd) for n in inputs)
    norm_like = {n for n, (r, _) in by_name.items() if r.endswith("_norm")}
    assert norm_like == set(outputs) | set(inputs)  # nothing else is a norm; nothing missed
    assert all(w == wd for n, (r, w) in by_name.items() if r in ("matrix", "embedding"))
    table = describe_param_groups(groups)
    assert "output_norm" in table and "input_norm" in table


def test_policies():
    model = tiny_model("deepnorm", scale_vector="standard")  # LayerNorm output norms with biases
    roles = parameter_roles(model)
    assert roles["model.layers.0.attn_connection.norm.bias"] == "output_norm"
    assert roles["model.norm.weight"] == "input_norm" and roles["lm_head.weight"] == "matrix"
    assert roles["model.embed_tokens.weight"] == "embedding"
    for policy in POLICIES:
        decay = {n: g["weight_decay"] for g in build_param_groups(model, policy, 0.1) for n in g["names"]}
        norms = [n for n, r in roles.items() if r.endswith("_norm")]
        if policy == "depthbench":
            assert set(decay.values()) == {0.1}
        elif policy == "iwd":
            assert all(decay[n] == (0.1 if roles[n] == "input_norm" else 0.0) for n in norms)
        elif policy == "output_norm_only":
            assert all(decay[n] == (0.1 if roles[n] == "output_norm" else 0.0) for n in norms)
        else:
            assert all(decay[n] == 0.0 for n in norms)
        assert decay["model.layers.1.mlp.up_proj.weight"] == 0.1
    with pytest.raises(ValueError, match="`policy` must be one of"):
        build_param_groups(model, "adamw", 0.1)
    with pytest.raises(ValueError, match="`weight_decay`"):
        make_optimizer(model, 1e-3, weight_decay=-1)


def test_declared_param_roles_are_honoured():
    """A design module's ``param_roles`` class attribute (HC's static routing) wins, and DepthBench skips it."""

    class Routing(nn.Module):
        param_roles = {"static_alpha": "routing_static"}

        def __init__(self):
            super().__init__()
            self.static_alpha = nn.Parameter(torch.ones(2, 3))
            self.dynamic_alpha = nn.Parameter(torch.zeros(4, 3))

    model = tiny_model("pre_ln")
    model.model.layers[0].attn_connection.routing = Routing()
    roles = parameter_roles(model)
    assert roles["model.layers.0.attn_connection.routing.static_alpha"] == "routing_static"
    assert roles["model.layers.0.attn_connection.routing.dynamic_alpha"] == "design"
    for policy in POLICIES:
        groups = build_param_groups(model, policy, 0.1)
        static = [g for g in groups if g["role"] == "routing_static"]
        assert len(static) == 1 and static[0]["weight_decay"] == 0.0


def test_bad_scale_vector_rejected():
    for bad in ("HG+XX", "AP+DP", "OR+ER", "none+HG", "HG+HG", ""):
        with pytest.raises(ValueError, match="`scale_vector`"):
            tiny_config("pre_ln", scale_vector=bad)
