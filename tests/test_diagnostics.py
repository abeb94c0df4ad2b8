"""Depth diagnostics on constructed models with known answers (hf_depth.diagnostics)."""

import json

import pytest
import torch
from helpers import batch, tiny_config, tiny_model
from torch.utils.flop_counter import FlopCounterMode

import hf_depth
from hf_depth.convert import pre_ln_to_llama
from hf_depth.diagnostics import angular, causal, cost, logit_lens, paths, permutation, pruning
from hf_depth.diagnostics.cli import main as diagnose
from hf_depth.diagnostics.common import decoder_layers, swap_layers
from hf_depth.diagnostics.data import load_calibration
from hf_depth.diagnostics.report import headline, run_diagnostics

DESIGNS = sorted(hf_depth.DESIGNS)


def data(t=10, seed=1):
    return [batch(t=t, seed=seed), batch(t=t, seed=seed + 1, left_pad=(0, 2, 4))]


def copy_branches(model, src=0):
    """Make every layer's branches (attention, FFN, input norms) identical to layer ``src``'s."""
    layers = decoder_layers(model)
    with torch.no_grad():
        for layer in layers:
            for name in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
                if getattr(layer, name, None) is not None:
                    getattr(layer, name).load_state_dict(getattr(layers[src], name).state_dict())
    return model


def zero_branch(model, layer_idx):
    with torch.no_grad():
        layer = decoder_layers(model)[layer_idx]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    return model


@pytest.mark.parametrize("design", DESIGNS)
def test_identical_layers_give_zero_permutation_score(design):
    model = copy_branches(tiny_model(design, num_hidden_layers=4))
    res = permutation.permutation_scores(model, data(), show_progress=False, convention="branch")
    off = ~torch.eye(4, dtype=torch.bool)
    torch.testing.assert_close(res["scores"][off], torch.zeros(12), rtol=0, atol=1e-6)
    assert permutation.r_perm(res["scores"]) == 0.0


def test_distinct_layers_give_nonzero_permutation_score():
    res = permutation.permutation_scores(tiny_model("pre_ln", num_hidden_layers=3), data(), show_progress=False,
                                         convention="branch")
    off = ~torch.eye(3, dtype=torch.bool)
    assert bool((res["scores"][off] > 1e-5).all())
    assert bool((res["scores"] == res["scores"].T)[off].all())


def test_swap_moves_branch_weights_only_and_restores():
    model = tiny_model("keel", num_hidden_layers=3)
    layers = decoder_layers(model)
    q0, q2 = layers[0].self_attn.q_proj.weight.clone(), layers[2].self_attn.q_proj.weight.clone()
    post = [layer.mlp_connection.post_norm.weight.data_ptr() for layer in layers]
    alphas = [layer.attn_connection.alpha for layer in layers]
    with swap_layers(model, 0, 2):
        torch.testing.assert_close(layers[0].self_attn.q_proj.weight, q2, rtol=0, atol=0)
        torch.testing.assert_close(layers[2].self_attn.q_proj.weight, q0, rtol=0, atol=0)
        assert [layer.mlp_connection.post_norm.weight.data_ptr() for layer in layers] == post
        assert [layer.attn_connection.alpha for layer in layers] == alphas
        assert [layer.self_attn.layer_idx for layer in layers] == [0, 1, 2]
    torch.testing.assert_close(layers[0].self_attn.q_proj.weight, q0, rtol=0, atol=0)


@pytest.mark.parametrize("design", ["pre_ln", "lns", "sandwich_ln", "post_ln"])
def test_zero_branch_gives_zero_angular_step(design):
    model = zero_branch(tiny_model(design, num_hidden_layers=3), 1)
    D = angular.angular_distance(model, data(), show_progress=False)
    assert float(D[1, 1]) < 1e-6
    assert float(D[0, 1]) > 1e-4 and float(D[2, 1]) > 1e-4
    assert torch.isnan(D[2, 2]) and float(D[0, 0]) == 0.0


@pytest.mark.parametrize("design", DESIGNS)
def test_zero_branch_gives_zero_causal_score_and_no_pruning_loss(design):
    model = zero_branch(tiny_model(design, num_hidden_layers=3), 1)
    c = causal.causal_scores(model, data(), show_progress=False, convention="branch")
    assert float(c["scores"][1, 2]) == pytest.approx(0.0, abs=1e-6)
    assert float(c["scores"][0, 2]) > 1e-3  # a live layer's skip changes a later live update
    # dead update: 0/0 -- except where the residual itself still moves (post-norms; mHC's Sinkhorn mixing keeps the
    # stream mean only up to rounding, so the "dead" update is ~1e-8 and the ratio is finite)
    assert design in ("deepnorm", "keel", "post_ln", "mhc") or torch.isnan(c["scores"][0, 1])
    assert torch.isnan(c["scores"][1, 1]) and torch.isnan(c["scores"][2, 0])
    pr = pruning.pruning_curve(model, data(), c["loss"], c["skip_loss"], convention="branch")
    assert pr["delta"][1] == pytest.approx(0.0, abs=1e-6)
    assert pruning.pruning_curve(model, data(), show_progress=False, convention="branch")["delta"] == pytest.approx(pr["delta"], abs=1e-6)


def test_reversing_layer_gives_angular_distance_one():
    model = tiny_model("pre_ln", num_hidden_layers=3)
    decoder_layers(model)[1].register_forward_hook(lambda m, args, out: -args[0])
    D = angular.angular_distance(model, data(), show_progress=False)
    assert float(D[1, 1]) == pytest.approx(1.0, abs=1e-3)
    assert float(D[0, 1]) < 0.9


def test_angular_ignores_padding():
    model = tiny_model("pre_ln", num_hidden_layers=3)
    x, mask = batch()
    padded = angular.angular_distance(model, [(x[:1], mask[:1])], show_progress=False)
    alone = angular.angular_distance(model, [x[:1, 3:]], show_progress=False)
    torch.testing.assert_close(padded, alone, rtol=1e-4, atol=1e-5, equal_nan=True)


def test_r_fractions_count_late_pairs_only():
    L = 8  # late start ceil(8/4) = 2: pairs (a, b) with 2 <= a < b < 8
    s = torch.full((L, L), 0.5)
    s[0, :] = 0.0
    s[:, :2] = 0.0
    assert causal.r_causal(s) == 1.0
    s[2, 3] = 0.1
    assert causal.r_causal(s) == pytest.approx(1 - 1 / 15)
    assert permutation.r_perm(s) == pytest.approx(1 - 1 / 15)


def test_llama_gives_the_same_diagnostics_as_pre_ln():
    model = tiny_model("pre_ln", num_hidden_layers=3)
    llama = pre_ln_to_llama(model).eval()
    kw = dict(measurements=("angular", "causal", "permutation", "logit_lens", "paths"), show_progress=False)
    a, b = run_diagnostics(model, data(), **kw), run_diagnostics(llama, data(), **kw)
    for key, sub in (("angular", "matrix"), ("causal", "scores"), ("permutation", "scores"), ("logit_lens", "kl")):
        ta = torch.tensor([[float("nan") if v is None else v for v in r] for r in a[key][sub]]) if sub != "kl" else \
            torch.tensor(a[key][sub])
        tb = torch.tensor([[float("nan") if v is None else v for v in r] for r in b[key][sub]]) if sub != "kl" else \
            torch.tensor(b[key][sub])
        torch.testing.assert_close(ta, tb, rtol=1e-4, atol=1e-5, equal_nan=True)
    assert a["paths"] is None and b["paths"] is None  # implicit residual paths
    llama.config._attn_implementation = "eager"
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        llama(input_ids=torch.randint(2, 97, (1, 12)), use_cache=False)
    assert cost.prefill_flops(llama.config, 12, llama)["total_matmul"] == pytest.approx(counter.get_total_flops(), rel=0.02)


def test_logit_lens_kl_is_zero_when_later_layers_are_dead():
    model = tiny_model("pre_ln", num_hidden_layers=3)
    zero_branch(zero_branch(model, 1), 2)
    kl = logit_lens.logit_lens_kl(model, data(), show_progress=False)
    assert kl[1] == pytest.approx(0.0, abs=1e-6) and kl[2] == pytest.approx(0.0, abs=1e-6) and kl[3] == 0.0
    assert kl[0] > 1e-4


# ------------------------------------------------------------------ explicit residual paths (constructed fakes)
def with_path_weights(model, fn):
    """Give a model ``residual_path_weights()`` computed by ``fn(B, T)`` from the last forward's input shape."""
    shape = {}
    model.register_forward_pre_hook(lambda m, args, kw: shape.update(bt=tuple(kw["input_ids"].shape)), with_kwargs=True)
    model.model.residual_path_weights = lambda: fn(*shape["bt"])
    return model


def test_attnres_uniform_weights_recognized():
    model = tiny_model("pre_ln", num_hidden_layers=3)
    S = 6
    with_path_weights(model, lambda B, T: {s: {"weights": torch.full((B, T, s + 1), 1.0 / (s + 1)),
                                                "members": torch.eye(s + 1, S + 1)} for s in range(S + 1)})
    res = paths.residual_paths(model, data(), show_progress=False)
    assert res["kind"] == "attnres"
    M = res["matrix"]
    for s in range(S + 1):
        torch.testing.assert_close(M[s, : s + 1], torch.full((s + 1,), 1.0 / (s + 1)))
        assert float(M[s, s + 1 :].abs().sum()) == 0.0
    assert res["dead_layers"] == 0


def test_block_attnres_dead_layers():
    S = 8  # L = 4; sources [embedding, partial sum of all earlier sublayers]
    def fn(B, T):
        out = {0: {"weights": torch.ones(1), "members": torch.eye(1, S + 1)}}
        for s in range(1, S):
            members = torch.zeros(2, S + 1)
            members[0, 0] = 1
            members[1, 1 : s + 1] = 1
            w = torch.tensor([0.95, 0.05]) if s < 4 else torch.tensor([0.2, 0.8])
            out[s] = {"weights": w.expand(B, T, 2), "members": members}
        return out
    model = with_path_weights(tiny_model("pre_ln", num_hidden_layers=4), fn)
    res = paths.residual_paths(model, data(), show_progress=False)
    assert res["dead_layer_list"] == [0, 1] and res["leading_dead_layers"] == 2
    assert float(res["matrix"][5, 0]) == pytest.approx(0.2) and float(res["matrix"][5, 3]) == pytest.approx(0.8)


def hc_init(n, S):
    """HC at its published init: A[:, 0] = e_{s mod n}, A_r = I, beta = 1."""
    out = {}
    for s in range(S):
        A = torch.zeros(n, n + 1)
        A[s % n, 0] = 1
        A[:, 1:] = torch.eye(n)
        out[s] = {"read": A[:, 0], "mix": A[:, 1:].T, "write": torch.ones(n)}
    return out


def test_hc_transport_at_init_and_effective_rank():
    n, S = 4, 6
    acc = paths.PathAccumulator(S)
    acc.add(hc_init(n, S), torch.ones(2, 5, dtype=torch.bool))
    res = acc.result()
    M = res["matrix"][:S]
    # every sublayer reads the embedding and every earlier output with weight 1 (identical streams = Pre-LN)
    expected = torch.tril(torch.ones(S, S + 1), diagonal=0)
    torch.testing.assert_close(M, expected)
    assert res["erank_final"] == pytest.approx(n)


def test_mhc_uniform_transport_has_rank_one():
    n, S = 4, 4
    J = torch.full((n, n), 1.0 / n)
    mhc = {s: {"read": torch.full((n,), 1.0 / n), "write": torch.ones(n), "mix": J} for s in range(S)}
    mask = torch.ones(1, 3, dtype=torch.bool)
    a = paths.PathAccumulator(S)
    a.add(mhc, mask)
    ra = a.result()
    assert ra["erank_final"] == pytest.approx(1.0, abs=1e-6)
    # per-token tensors ([B, T, ...]) give the same result as static ones
    c = paths.PathAccumulator(S)
    c.add({s: {k: v.expand(1, 3, *v.shape) for k, v in w.items()} for s, w in mhc.items()}, mask)
    torch.testing.assert_close(c.result()["matrix"], ra["matrix"], equal_nan=True)


# ------------------------------------------------------------------ cost
@pytest.mark.parametrize("design", DESIGNS)
def test_analytic_flops_match_flop_counter(design, monkeypatch):
    from hf_depth.models import depth_ops

    # the counter sees aten's matmuls: the reference ops (a native kernel's products are opaque to it)
    monkeypatch.setattr(depth_ops, "_native_ok", lambda: False)
    model = tiny_model(design, num_hidden_layers=3, attn_implementation="eager")
    T, B = 24, 2
    ids = torch.randint(2, 97, (B, T))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=ids, use_cache=False)
    analytic = cost.prefill_flops(model.config, T, model)["total_matmul"] * B
    assert analytic == pytest.approx(counter.get_total_flops(), rel=0.02)


def test_extra_linear_fallback_and_kv_bytes():
    model = tiny_model("pre_ln", num_hidden_layers=2)
    assert cost.extra_linear_flops(model, 10) == 0
    model.model.extra_router = torch.nn.Linear(32, 8, bias=False)  # what an unknown design adds
    assert cost.design_extra_flops(model.config, 10, model) == {"matmul": 2 * 10 * 32 * 8, "other": 0}
    kv = cost.kv_cache_bytes(model.config, seq_len=100, batch=1, bytes_per=2)
    assert kv["total"] == 2 * 2 * 100 * (2 * 8) * 2 and kv["depth_kv"] == 0
    assert cost.activation_bytes(model, 1, 8) > 0


def test_depthbench_flop_convention_matches_paper_range():
    lo = cost.prefill_flops(hf_depth.config_for("pre_ln", hidden_size=1216, num_hidden_layers=16))["depthbench"]
    hi = cost.prefill_flops(hf_depth.config_for("pre_ln", hidden_size=640, num_hidden_layers=70))["depthbench"]
    assert lo / 1e12 == pytest.approx(3.0, abs=0.1) and hi / 1e12 == pytest.approx(4.4, abs=0.1)


# ------------------------------------------------------------------ data, report, CLI
def test_calibration_data_is_seeded_and_padded(tmp_path):
    f = tmp_path / "ids.jsonl"
    f.write_text("\n".join(json.dumps({"input_ids": list(range(2, 2 + k))}) for k in range(3, 15)))
    a = load_calibration(str(f), seq_len=8, num_samples=5, batch_size=2, seed=3)
    b = load_calibration(str(f), seq_len=8, num_samples=5, batch_size=2, seed=3)
    assert [x.input_ids.tolist() for x in a] == [x.input_ids.tolist() for x in b]
    assert sum(x.input_ids.shape[0] for x in a) == 5 and max(x.input_ids.shape[1] for x in a) <= 8
    assert all(((x.input_ids == 0) == (x.attention_mask == 0)).all() for x in a)

    class Tok:
        eos_token_id = 1

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [2 + (ord(c) % 90) for c in text]}

    t = tmp_path / "a.txt"
    t.write_text("hello depth " * 20)
    c = load_calibration(str(t), Tok(), seq_len=16, num_samples=4, batch_size=4)
    assert c[0].input_ids.shape == (4, 16) and bool(c[0].attention_mask.all())
    with pytest.raises(ValueError, match="--data"):
        load_calibration(str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match="cannot load the Hub dataset"):  # offline (conftest): a clear error
        load_calibration("hf:HuggingFaceFW/fineweb-edu:sample-10BT:train", Tok())


@pytest.mark.parametrize("design", DESIGNS)
def test_cli_writes_report_and_plots(design, tmp_path, capsys):
    model = tiny_model(design, num_hidden_layers=3)
    model.save_pretrained(tmp_path / "m")
    f = tmp_path / "ids.jsonl"
    g = torch.Generator().manual_seed(0)
    f.write_text("\n".join(json.dumps({"input_ids": torch.randint(2, 97, (12,), generator=g).tolist()}) for _ in range(4)))
    out = tmp_path / "out"
    measure = ["--repeats", "1"] if design == "pre_ln" else ["--no-measure-cost"]  # timing runs once (slow on CPU)
    rc = diagnose([str(tmp_path / "m"), "--data", str(f), "--out", str(out), "--seq-len", "12", "--num-samples", "4",
                   "--batch-size", "2", "--measure-seq-len", "8", "--flops-seq-len", "64", "--no-progress", *measure])
    assert rc == 0
    for name in ("report.json", "report.md", "angular.png", "causal.png", "permutation.png", "pruning_logit_lens.png",
                 "cost.png"):
        assert (out / name).stat().st_size > 0, name
    rep = json.loads((out / "report.json").read_text())
    h = headline(rep)
    assert set(h) >= {"loss", "R_causal", "R_perm", "pruning_delta"} and len(h["pruning_delta"]) == 3
    assert rep["cost"]["prefill_flops"]["total_matmul"] > 0
    if design == "pre_ln":
        assert all(rep["cost"]["measured"][k]["tokens_per_s"] > 0 for k in ("forward", "forward_backward", "generate"))
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["headline"]["R_perm"] == h["R_perm"]


# ------------------------------------------------------------------ a constructed HC design (HC lives on another branch)
def fake_hc_model(n=4, layers=3):
    """A minimal dynamic-HC design built from ``functional.hc_*`` at its published init (one-hot read, A_r = I,
    beta = 1, dynamic weights 0), exposing ``path_weights() -> {"read", "mix", "write"}`` per token."""
    from torch import nn

    from hf_depth.models.design_hc import hc_extra_flops
    from hf_depth.models.design_pre_ln import PreLNConfig
    from hf_depth.models.functional import hc_coefficients, hc_depth, hc_width
    from hf_depth.models.modeling_depth import DepthForCausalLM, DepthModel
    from hf_depth.models.residual import Design, ResidualStream, SublayerConnection

    class FakeHCConfig(PreLNConfig):
        model_type = "hf_depth_fake_hc"
        design = "fake_hc"
        num_streams = n

    class Conn(SublayerConnection):
        def __init__(self, config, s):
            super().__init__(config, s)
            d = config.hidden_size
            A = torch.zeros(n, n + 1)
            A[s % n, 0], A[:, 1:] = 1.0, torch.eye(n)
            self.register_buffer("static_alpha", A)
            self.register_buffer("static_beta", torch.ones(n))
            self.dynamic_alpha = nn.Parameter(torch.zeros(d, n + 1))
            self.dynamic_beta = nn.Parameter(torch.zeros(d))
            self.register_buffer("scale", torch.tensor(0.01))

        def read(self, state, norm):
            A, beta = hc_coefficients(state, self.static_alpha, self.dynamic_alpha, self.scale, self.static_beta,
                                      self.dynamic_beta, self.scale)
            x, mixed = hc_width(state, A)
            self._A, self._beta = A, beta
            return norm(x), (mixed, beta)

        def write(self, state, out, carry):
            return hc_depth(*carry, out)

        def path_weights(self):
            return {"read": self._A[..., 0], "mix": self._A[..., 1:].transpose(-1, -2), "write": self._beta}

    class Stream(ResidualStream):
        def init(self, embeds):
            return embeds.unsqueeze(-2).expand(*embeds.shape[:-1], n, embeds.shape[-1]).contiguous()

        def collapse(self, state):
            return state.mean(-2)

    class FakeHCModel(DepthModel):
        config_class = FakeHCConfig

    class FakeHCForCausalLM(DepthForCausalLM):
        config_class = FakeHCConfig
        base_model_class = FakeHCModel

    design = Design("fake_hc", FakeHCConfig, FakeHCModel, FakeHCForCausalLM, connection=Conn, stream=Stream,
                    param_roles={"dynamic_alpha": "routing_dynamic", "dynamic_beta": "routing_dynamic"},
                    extra_flops=hc_extra_flops)
    FakeHCModel.design = FakeHCForCausalLM.design = design  # bound without registering (what `register` does)
    lm = FakeHCForCausalLM
    from helpers import TINY

    torch.manual_seed(0)
    return lm(FakeHCConfig(**{**TINY, "num_hidden_layers": layers}, attn_implementation="eager")).eval()


def test_fake_hc_design_flops_paths_and_report():
    model = fake_hc_model()
    T, B = 16, 2
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=torch.randint(2, 97, (B, T)), use_cache=False)
    f = cost.prefill_flops(model.config, T, model)
    assert f["extra_matmul"] > 0 and f["total_matmul"] * B == pytest.approx(counter.get_total_flops(), rel=0.02)
    rep = run_diagnostics(model, data(), measurements=("angular", "causal", "permutation", "paths"), show_progress=False)
    assert rep["paths"]["kind"] == "transport"
    assert rep["paths"]["erank_final"] == pytest.approx(4.0, abs=1e-4)  # A_r = I at init: full rank n
    M = torch.tensor([[float("nan") if v is None else v for v in r] for r in rep["paths"]["matrix"]])
    torch.testing.assert_close(M[:6], torch.tril(torch.ones(6, 7)), atol=1e-5, rtol=0)  # identical streams
    assert rep["causal"]["scores"][0][1] is not None


def test_real_attnres_at_init_has_uniform_path_weights():
    model = tiny_model("attnres", num_hidden_layers=3)
    res = paths.residual_paths(model, data(), show_progress=False)
    assert res["kind"] == "attnres" and res["dead_layers"] == 0
    M = res["matrix"]
    for s in range(1, 7):  # sublayer s reads the embedding and s outputs, uniformly (zero queries)
        torch.testing.assert_close(M[s, : s + 1], torch.full((s + 1,), 1.0 / (s + 1)))


def test_real_hc_at_init_transports_the_identity():
    model = tiny_model("hc", num_hidden_layers=2)
    res = paths.residual_paths(model, data(), show_progress=False)
    assert res["kind"] == "transport" and "dead_layers" not in res
    assert res["erank_final"] == pytest.approx(model.config.hc_streams, rel=1e-4)  # A_r = I at init


@pytest.mark.parametrize("design,kw", [
    ("hires", {"hires_block_layers": 1}),
    ("hires", {"hires_block_layers": 2, "hires_final": "outer", "hires_embed": "project"}),
    ("block_attnres", {"attnres_block_size": 2}),
    ("moda", {}),
])
def test_analytic_flops_match_flop_counter_multi_block(design, kw):
    """Multi-block HiRes (its read/write projections are F.linear matmuls) and Block AttnRes with S > 1."""
    model = tiny_model(design, num_hidden_layers=3, attn_implementation="eager", **kw)
    T, B = 24, 2
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=torch.randint(2, 97, (B, T)), use_cache=False)
    f = cost.prefill_flops(model.config, T, model)
    assert f["total_matmul"] * B == pytest.approx(counter.get_total_flops(), rel=0.02)
    assert cost.prefill_flops(model.config, T)["extra_matmul"] == f["extra_matmul"]  # analytic: no model needed
    if design == "hires":
        assert f["extra_matmul"] > 0


def test_block_attnres_flops_follow_its_block_size():
    """Block AttnRes counts its own sources (S = 2 sublayers: 1 + ceil(s / 2) per aggregation), not Full's."""
    T, d = 16, 32
    block = cost.prefill_flops(tiny_config("block_attnres", num_hidden_layers=3, attnres_block_size=2), T)
    full = cost.prefill_flops(tiny_config("attnres", num_hidden_layers=3), T)
    assert block["extra_other"] == 4 * T * d * sum(1 + -(-s // 2) for s in range(7)) == 4 * T * d * 19
    assert full["extra_other"] == 4 * T * d * sum(s + 1 for s in range(7))
    # the schedule default (no explicit size) is read through the config, not the raw field
    cfg = tiny_config("block_attnres", num_hidden_layers=16)
    assert cfg.attnres_block_size is None and cfg.attnres_block_sublayers == 4
    S = cfg.attnres_block_sublayers
    assert cost.prefill_flops(cfg, T)["extra_other"] == 4 * T * d * sum(1 + -(-s // S) for s in range(33))
