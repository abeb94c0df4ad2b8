"""The papers' protocol: FLOP-based compute efficiency, DepthBench's suites as recipes, the scale-vector arms."""

import pytest
import torch
from helpers import tiny_model
from torch.utils.flop_counter import FlopCounterMode

from hf_depth.training import results


@pytest.mark.parametrize("design", ["pre_ln", "attnres"])
def test_training_flops_match_counted_forward_backward(design):
    """3 x forward: FlopCounterMode over a real forward + backward agrees with the analytic count."""
    model = tiny_model(design, num_hidden_layers=3, attn_implementation="eager").train()
    B, T = 2, 16
    x = torch.randint(2, 97, (B, T))
    with FlopCounterMode(display=False) as counter:
        model(x, labels=x, use_cache=False).loss.backward()
    analytic = results.training_flops(model.config, B * T, T)
    assert analytic == pytest.approx(counter.get_total_flops(), rel=0.05)


def test_training_flops_grow_with_depth_at_equal_params():
    """Not 6 N D: beyond 6 N D the attention term grows with L d, and a design's routing adds its own FLOPs."""
    def excess(design, L, d, T=512, D=10**6):
        m = tiny_model(design, num_hidden_layers=L, hidden_size=d)
        n = sum(p.numel() for n_, p in m.named_parameters() if "embed_tokens" not in n_)
        return results.training_flops(m.config, D, T) / (6 * n * D)

    assert excess("pre_ln", 8, 32) > excess("pre_ln", 2, 64) > 1.0
    assert excess("hc", 2, 64) > excess("pre_ln", 2, 64)


# ----------------------------------------------------------------------------------------------- recipes
import math  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402

import yaml  # noqa: E402

from hf_depth.shapes import count_params, make_config  # noqa: E402
from hf_depth.training.recipe import load_recipe  # noqa: E402

RECIPES = pathlib.Path("recipes/train")
SHARED = pathlib.Path("../shared/docs")
# DepthBench's configs/README.md (keyu-wang-2002/DepthBench@f807aa279d04ffd6d08bc3d9f2c3a97985a1e980), transcribed
# row by row: config -> (layers, hidden, intermediate, head_dim, backbone M, total M)
UPSTREAM = {
    "llama_400m_L16": (16, 1216, 3248, 76, 284, 407), "llama_400m_L20": (20, 1120, 2992, 70, 301, 414),
    "llama_400m_L24": (24, 1024, 2736, 64, 302, 405), "llama_400m_L28": (28, 960, 2560, 60, 310, 406),
    "llama_400m_L32": (32, 896, 2400, 56, 309, 399), "llama_400m_L42": (42, 800, 2144, 50, 324, 404),
    "llama_400m_L70": (70, 640, 1712, 40, 345, 409),
    "llama_300m_backbone_L16": (16, 1248, 3328, 78, 299, 425), "llama_300m_backbone_L24": (24, 1024, 2736, 64, 302, 405),
    "llama_300m_backbone_L32": (32, 896, 2400, 56, 309, 399), "llama_300m_backbone_L42": (42, 768, 2048, 48, 297, 375),
    "llama_300m_backbone_L70": (70, 608, 1632, 38, 312, 373), "llama_300m_backbone_L84": (84, 544, 1456, 34, 299, 354),
    "llama_200m_L24": (24, 672, 1792, 42, 130, 198), "llama_200m_L18": (18, 768, 2048, 48, 127, 205),
    "llama_200m_L12": (12, 896, 2400, 56, 116, 206), "llama_300m_L28": (28, 800, 2144, 50, 216, 296),
    "llama_300m_L21": (21, 896, 2400, 56, 203, 293), "llama_300m_L14": (14, 1056, 2816, 66, 187, 294),
    "llama_500m_L34": (34, 992, 2656, 62, 403, 502), "llama_500m_L26": (26, 1120, 2992, 70, 392, 504),
    "llama_500m_L17": (17, 1344, 3584, 84, 368, 504),
    "llama_1600m_L28": (28, 2048, 6144, 128, 1409, 1615), "llama_1600m_L40": (40, 1728, 5184, 108, 1433, 1607),
    "llama_1600m_L54": (54, 1504, 4512, 94, 1466, 1617),
}
STEPS = {"200m": 3800, "300m": 5700, "400m": 7600, "500m": 9500, "1600m": 30400}
TABLE4_LR = {"lns": 1e-2, "deepnorm": 1e-3}
SUITES = ("depthbench_400m", "iso_backbone_300m", "multiscale", "1.6b")


def source_row(path):
    m = re.search(r"^# source: .*row (\w+)\.json", path.read_text(), re.M)
    assert m, f"{path} does not record its source table row"
    return m.group(1)


def suite_recipes(suite):
    return sorted((RECIPES / suite).glob("*.yaml"))


@pytest.mark.parametrize("suite", SUITES)
def test_every_recipe_matches_its_source_row(suite):
    files = suite_recipes(suite)
    assert files
    for path in files:
        row = source_row(path)
        L, d, f, hd, backbone, total = UPSTREAM[row]
        m = yaml.safe_load(path.read_text())["model"]
        m.setdefault("intermediate_size", make_config("pre_ln", m["hidden_size"], 1).intermediate_size)
        assert (m["num_hidden_layers"], m["hidden_size"], m["intermediate_size"]) == (L, d, f), path
        assert d // m["num_attention_heads"] == hd and m["num_attention_heads"] == 16
        cfg = make_config("pre_ln", d, L, intermediate_size=f, num_key_value_heads=m.get("num_key_value_heads"))
        n = count_params(cfg)  # the shared backbone: DepthBench's table counts Pre-LN
        emb = 2 * 50280 * d
        # the table's M (1.6B: 1e-3 B) figures, rounded or truncated
        assert abs((n - emb) / 1e6 - backbone) < 1.0 and abs(n / 1e6 - total) < 1.0, (path, n, emb)
        r = load_recipe(path)
        assert r.train.max_steps == STEPS[row.split("_")[1]], path  # DepthBench's fixed step budget
        assert r.optim.warmup_frac == 0.1 and r.optim.final_lr_frac == 0.1 and r.optim.policy == "depthbench"
        if suite == "1.6b":
            assert r.optim.lr == 5e-4 and r.model.num_key_value_heads == 8 and f == 3 * d
        else:
            assert r.optim.lr == TABLE4_LR.get(m["design"], 2e-3)


def _model(p):
    m = yaml.safe_load(p.read_text())["model"]
    m.setdefault("intermediate_size", make_config("pre_ln", m["hidden_size"], 1).intermediate_size)
    return m


def test_suites_have_depthbench_shapes_and_designs():
    main = {yaml.safe_load(p.read_text())["model"]["design"]: None for p in suite_recipes("depthbench_400m")}
    assert len(main) == 10  # ten architectures
    shapes = {}
    for p in suite_recipes("depthbench_400m"):
        m = _model(p)
        shapes.setdefault(m["num_hidden_layers"], set()).add((m["hidden_size"], m["intermediate_size"]))
    assert all(len(v) == 1 for v in shapes.values())  # one shape per depth, shared by every design
    assert sorted(shapes) == [16, 20, 24, 28, 32, 42, 70]
    totals = [count_params(make_config("pre_ln", d, L, intermediate_size=f)) for L, v in shapes.items() for d, f in v]
    mid = count_params(make_config("pre_ln", 1024, 24, intermediate_size=2736))
    assert max(abs(t / mid - 1) for t in totals) < 0.02145  # the paper's +-2.14%
    # multi-scale: three aspect ratios (~28, ~43, ~75) at each of 200M..500M
    ladder = {}
    for p in suite_recipes("multiscale"):
        m = yaml.safe_load(p.read_text())["model"]
        ladder.setdefault(source_row(p).split("_")[1], set()).add(round(m["hidden_size"] / m["num_hidden_layers"]))
    assert sorted(ladder) == ["200m", "300m", "400m", "500m"]
    for ratios in ladder.values():
        assert len(ratios) == 3 and min(ratios) in range(28, 30) and max(ratios) in range(74, 80)
    # iso-backbone: the non-embedding count is what is held (~300M), not the total
    backbones = []
    for p in suite_recipes("iso_backbone_300m"):
        m = _model(p)
        n = count_params(make_config("pre_ln", m["hidden_size"], m["num_hidden_layers"],
                                     intermediate_size=m["intermediate_size"]))
        backbones.append(n - 2 * 50280 * m["hidden_size"])
    assert all(abs(b / 302e6 - 1) < 0.035 for b in backbones)


def test_recipes_agree_with_architectures_md_and_the_seeds():
    arch = SHARED / "ARCHITECTURES.md"
    if not arch.exists():
        pytest.skip("../shared not available")
    rows = re.findall(r"^\| (\d+) \| (\d+) \| (\d+) \| (\d+) \| [\d.]+ \| ([\d.]+)M \|$", arch.read_text(), re.M)
    table = {int(L): (int(d), int(f), float(t)) for L, d, f, _hd, t in rows}
    assert len(table) == 9
    for p in suite_recipes("depthbench_400m"):
        m = _model(p)
        d, f, t = table[m["num_hidden_layers"]]
        assert (m["hidden_size"], m["intermediate_size"]) == (d, f)
        n = count_params(make_config("pre_ln", d, m["num_hidden_layers"], intermediate_size=f))
        assert round(n / 1e6, 1) == t
    seeds = " ".join(p.read_text() for p in (SHARED / "seeds").glob("*.txt"))
    assert "3.006→2.950→2.937" in seeds  # the 1.6B suite of Figure 3: aspect ratios 27.9 .. 73.1
    ratios = sorted(round(yaml.safe_load(p.read_text())["model"]["hidden_size"]
                          / yaml.safe_load(p.read_text())["model"]["num_hidden_layers"], 1) for p in suite_recipes("1.6b"))
    assert sorted(set(ratios)) == [27.9, 43.2, 73.1]
    for r in ("27.9", "73.1"):
        assert r in seeds
    assert "(16, 1216)" in seeds and "(70, 640)" in seeds and "9.14" in seeds  # Table 3's extremes


def test_llama_1b_count_of_the_scale_vector_paper():
    """Llama-1B (L22, d1792, V50304, d_ff 4778): the paper's 1,028,065,024 parameters, 80,640 of them gammas."""
    cfg = make_config("pre_ln", 1792, 22, vocab_size=50304, intermediate_size=4778)
    none = make_config("pre_ln", 1792, 22, vocab_size=50304, intermediate_size=4778, scale_vector="none")
    assert count_params(cfg) == 1_028_065_024 and count_params(cfg) - count_params(none) == 80_640
    assert math.isclose(80_640 / 1_028_065_024, 7.844e-5, rel_tol=1e-3)
    r = load_recipe(RECIPES / "scale_vector" / "dense_1b_best.yaml")
    assert (r.model.num_hidden_layers, r.model.hidden_size, r.model.vocab_size, r.model.intermediate_size) == (
        22, 1792, 50304, 4778)
    assert r.train.tokens_per_param == 100 and r.optim.final_lr_frac == 0.05  # ~100 tokens/param, cosine to lr/20


# ----------------------------------------------------------------------------------------------- scale-vector arms
from training_helpers import hf_depth_cache  # noqa: E402,F401

from hf_depth.training import optim as optim_mod  # noqa: E402
from hf_depth.training.train import lr_at, run  # noqa: E402

TINY_ARM = ["model.hidden_size=32", "model.num_hidden_layers=2", "model.num_attention_heads=4",
            "model.intermediate_size=64", "model.vocab_size=null", "model.max_position_embeddings=64",
            "data.source=embedded", "data.path=null", "data.name=null", "data.tokenizer=embedded",
            "data.tokenizer_vocab_size=300", "data.seq_len=32", "data.val_docs=5", "data.val_sequences=4",
            "train.max_steps=3", "train.micro_batch_size=2", "train.grad_accum=1", "train.eval_every=3",
            "train.save_every=3", "train.log_every=1", "train.trackers=[]", "train.progress=false",
            "train.mixed_precision=auto"]


@pytest.mark.parametrize("arm", ["dense_0.12b_best", "wd_output_norm_only_0.5b_10b", "muon_0.12b_best",
                                 "wsd_0.12b_standard", "llama_large_0.12b"])
def test_scale_vector_arms_train_on_the_embedded_default(arm, tmp_path):
    r = load_recipe(RECIPES / "scale_vector" / f"{arm}.yaml", [*TINY_ARM, f"run_dir={tmp_path}/{{name}}"])
    summary = run(r)
    assert summary["status"] == "finished" and summary["steps"] == 3 and math.isfinite(summary["final_loss"])
    assert summary["train_flops"] > 0


def test_output_norm_only_policy_decays_output_gammas_only():
    model = tiny_model("sandwich_ln", num_hidden_layers=2)
    groups = optim_mod.build_param_groups(model, "output_norm_only", 0.1)
    by_role = {(g["role"], g["weight_decay"]) for g in groups}
    assert ("output_norm", 0.1) in by_role and ("input_norm", 0.0) in by_role and ("matrix", 0.1) in by_role
    assert ("input_norm", 0.1) not in by_role and ("output_norm", 0.0) not in by_role
    with pytest.raises(ValueError, match="`policy` must be one of .*output_norm_only"):
        optim_mod.build_param_groups(model, "decay_some", 0.1)


def test_muon_for_block_matrices_adamw_for_the_rest():
    assert hasattr(torch.optim, "Muon")  # torch >= 2.9 ships it (this venv: 2.13)
    model = tiny_model("pre_ln", num_hidden_layers=2)
    opt = optim_mod.make_optimizer(model, lr=1e-3, optimizer="muon")
    muon = {id(p) for g in opt.muon.param_groups for p in g["params"]}
    adamw = {id(p) for g in opt.adamw.param_groups for p in g["params"]}
    assert id(model.model.layers[0].self_attn.q_proj.weight) in muon
    for p in (model.model.embed_tokens.weight, model.lm_head.weight, model.model.layers[0].input_layernorm.weight):
        assert id(p) in adamw and id(p) not in muon
    assert muon | adamw == {id(p) for p in model.parameters()} and not muon & adamw
    x = torch.randint(2, 97, (2, 8))
    before = model.model.layers[0].self_attn.q_proj.weight.clone()
    for g in opt.param_groups:  # the training loop sets the LR through param_groups
        g["lr"] = 2e-3
    model(x, labels=x).loss.backward()
    opt.step()
    assert not torch.equal(before, model.model.layers[0].self_attn.q_proj.weight)
    assert all(g["lr"] == 2e-3 for g in opt.muon.param_groups + opt.adamw.param_groups)
    sd = opt.state_dict()
    opt2 = optim_mod.make_optimizer(model, lr=1e-3, optimizer="muon")
    opt2.load_state_dict(sd)
    assert len(opt2.muon.state) == len(opt.muon.state) > 0
    with pytest.raises(ValueError, match="`optimizer` must be one of"):
        optim_mod.make_optimizer(model, lr=1e-3, optimizer="sgd")


def test_wsd_schedule():
    total, peak = 100, 1.0
    lrs = [lr_at(s, total, peak, 0.1, 0.05, "wsd", 0.2) for s in range(total)]
    assert lrs[9] == peak and all(v == peak for v in lrs[10:80])  # warmup 10, stable until the last 20
    assert lrs[-1] == pytest.approx(0.05) and all(a > b for a, b in zip(lrs[80:], lrs[81:]))
    cos = [lr_at(s, total, peak, 0.1, 0.05) for s in range(total)]
    assert cos[50] < peak and cos[-1] == pytest.approx(0.05, abs=1e-3)


def test_deepnorm_layernorm_without_bias_follows_depthbench():
    with_bias = tiny_model("deepnorm", num_hidden_layers=3)
    model = tiny_model("deepnorm", num_hidden_layers=3, deepnorm_norm_bias=False)
    names = [n for n, _ in model.named_parameters()]
    assert not any(n.endswith("connection.norm.bias") for n in names)
    assert any(n.endswith("connection.norm.bias") for n, _ in with_bias.named_parameters())  # default unchanged
    n = sum(p.numel() for p in model.parameters())
    # 2L block LayerNorms and the final one (a LayerNorm too unless deepnorm_final_norm="rms") lose d each
    assert n == count_params(model.config) == sum(p.numel() for p in with_bias.parameters()) - (2 * 3 + 1) * 32
    with pytest.raises(ValueError, match="deepnorm_norm_bias"):
        tiny_model("deepnorm", deepnorm_norm_bias="no")


def test_olmo_core_deepnorm_converts_bias_free_on_request():
    from hf_depth.olmo_core import hf_depth_to_olmo_core, olmo_core_to_hf_depth

    model = tiny_model("deepnorm", num_hidden_layers=2, deepnorm_norm_bias=False, deepnorm_final_norm="rms")
    sd = hf_depth_to_olmo_core(model)
    assert not any(k.endswith("attention_norm.bias") for k in sd)
    conv = olmo_core_to_hf_depth(sd, "deepnorm", deepnorm_norm_bias=False, num_attention_heads=4, rope_theta=10000.0, rms_norm_eps=1e-6,
                                 num_key_value_heads=2)
    assert conv.config.deepnorm_norm_bias is False
    x = torch.randint(2, 97, (2, 7))
    torch.testing.assert_close(conv.eval()(x).logits, model(x).logits, rtol=0, atol=0)


def test_hires_extra_flops_are_counted():
    """The analytic extra matmul FLOPs of HiRes (read/write projections) equal what FlopCounterMode measures over
    a Pre-LN model of the same shape, and enter the training FLOPs."""
    from hf_depth.diagnostics.cost import prefill_flops

    kw = dict(num_hidden_layers=4, attn_implementation="eager")
    hires, pre = tiny_model("hires", hires_block_layers=2, **kw), tiny_model("pre_ln", **kw)
    T = 16
    x = torch.randint(2, 97, (1, T))
    counted = []
    for m in (hires, pre):
        with torch.no_grad(), FlopCounterMode(display=False) as c:
            m(x, use_cache=False)
        counted.append(c.get_total_flops())
    f = prefill_flops(hires.config, T)
    assert f["extra_matmul"] > 0 and f["extra_matmul"] == pytest.approx(counted[0] - counted[1], rel=0.01)
    assert results.training_flops(hires.config, 10**6, T) > results.training_flops(pre.config, 10**6, T)


def test_results_separate_scale_vector_arms():
    rows = [{"status": "finished", "design": "pre_ln", "num_hidden_layers": 2, "hidden_size": 32, "params": 10,
             "lr": 1e-3, "best_val_loss": 3.0 + i, "tokens": 100, "train_flops": 10**18, "scale_vector": sv}
            for i, sv in enumerate(("standard", "best"))]
    best = results.best_per_shape(rows)
    assert sorted(r["design"] for r in best) == ["pre_ln", "pre_ln+best"]
    assert all(r["pflops_days"] == pytest.approx(10**18 / results.PFLOPS_DAY, rel=1e-3) for r in best)


def test_muon_with_fsdp2_is_refused_at_config_time():
    with pytest.raises(ValueError, match="`optim.optimizer` 'muon' needs `train.parallel` 'ddp'"):
        load_recipe(RECIPES / "scale_vector" / "muon_0.12b_best.yaml", ["train.parallel=fsdp2"])
