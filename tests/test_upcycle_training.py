"""Continue training an upcycled model (``model.init_from``, ``optim.new_param_lr_mult``,
``optim.warmup_new_params_only``), and the end-to-end run on the embedded default data: train the tiny Pre-LN
recipe, upcycle it to AttnRes and HC (logits equal), continue 50 steps, the loss keeps falling, report and card."""

import json
import os

import pytest
import torch
from training_helpers import hf_depth_cache, tiny_recipe, write_corpus  # noqa: F401
from transformers import AutoConfig, AutoModelForCausalLM

import hf_depth
from hf_depth.cli import main as cli
from hf_depth.training.init_from import init_config, load_init
from hf_depth.training.optim import make_optimizer
from hf_depth.training.recipe import load_recipe, recipe_from_dict
from hf_depth.training.train import group_lr, lr_at, run
from hf_depth.upcycling import EXACT_TOL


@pytest.fixture(scope="module")
def pre_ln_run(tmp_path_factory):
    """A finished tiny Pre-LN run (json corpus, 4 steps): its ``final/`` is what the tests upcycle."""
    root = tmp_path_factory.mktemp("pre")
    old = os.environ.get("HF_DEPTH_CACHE")
    os.environ["HF_DEPTH_CACHE"] = str(tmp_path_factory.getbasetemp() / "hf_depth_cache")
    torch.set_num_threads(1)
    try:
        files = write_corpus(root)
        summary = run(recipe_from_dict(tiny_recipe(root, files, name="pre", train={"max_steps": 4})))
    finally:
        if old is None:
            os.environ.pop("HF_DEPTH_CACHE")
        else:
            os.environ["HF_DEPTH_CACHE"] = old
    assert summary["status"] == "finished"
    return root, files


def continued(root, files, init_from, **sections):
    return recipe_from_dict(tiny_recipe(root, files, name=sections.pop("name", "cont"),
                                        model={"init_from": str(init_from), **sections.pop("model", {})}, **sections))


# ------------------------------------------------------------------------------------------ init_from
def test_init_from_a_pre_ln_final_loads_every_weight_and_keeps_the_design_new(pre_ln_run):
    root, files = pre_ln_run
    final = root / "runs" / "pre" / "final"
    recipe = continued(root, files, final, model={"design": "attnres"})
    pre = AutoModelForCausalLM.from_pretrained(final)
    cfg, notes = init_config(recipe, pre.config.vocab_size)
    assert cfg.attnres_scale_by_sources is True and any("attnres_scale_by_sources" in n for n in notes)
    model = hf_depth.MODEL_CLASSES["attnres"][1](cfg).eval()
    new, _ = load_init(model, str(final))
    assert new and all(k.endswith(("aggregate.query", "aggregate.key_norm.weight")) for k in new)
    for k, v in pre.state_dict().items():
        if "inv_freq" not in k:
            torch.testing.assert_close(model.state_dict()[k], v, rtol=0, atol=0)
    x = torch.randint(0, cfg.vocab_size, (2, 8))
    with torch.no_grad():
        assert (model(x).logits - pre(x).logits).abs().max() <= EXACT_TOL  # the init is Pre-LN's function


def test_init_from_mismatches_are_refused_naming_them(pre_ln_run, tmp_path):
    root, files = pre_ln_run
    final = root / "runs" / "pre" / "final"
    with pytest.raises(ValueError, match=r"`model.hidden_size` is 64 but the `model.init_from` folder has 32"):
        init_config(continued(root, files, final, model={"hidden_size": 64}), 300)
    other = hf_depth.model_for("pre_ln", **{**AutoConfig.from_pretrained(final).to_diff_dict(),
                                            "intermediate_size": 48})
    with pytest.raises(ValueError, match=r"`model.init_from`: `model.layers.0.mlp.gate_proj.weight` has shape"):
        load_init(other, str(final))
    with pytest.raises(ValueError, match="`model.init_from` must be a save_pretrained folder"):
        continued(root, files, tmp_path)


@pytest.mark.parametrize("optim, needle", [
    ({"new_param_lr_mult": 3.0}, "`optim.new_param_lr_mult` acts on the parameters `model.init_from`"),
    ({"warmup_new_params_only": True}, "`optim.warmup_new_params_only` acts on"),
])
def test_new_param_options_need_init_from(tmp_path, optim, needle):
    with pytest.raises(ValueError, match=needle):
        recipe_from_dict(tiny_recipe(tmp_path, ["x.jsonl"], optim=optim))


def test_new_param_lr_mult_must_be_positive(pre_ln_run):
    root, files = pre_ln_run
    with pytest.raises(ValueError, match="`optim.new_param_lr_mult` must be positive"):
        continued(root, files, root / "runs" / "pre" / "final", optim={"new_param_lr_mult": 0})


def test_new_parameters_get_their_own_groups_and_schedule():
    model = hf_depth.model_for("attnres", vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               pad_token_id=0, eos_token_id=1)
    new = {n for n, _ in model.named_parameters() if "aggregate" in n}
    opt = make_optimizer(model, lr=1e-3, new_params=new)
    grouped = {n: g["new"] for g in opt.param_groups for n in g["names"]}
    assert {n for n, is_new in grouped.items() if is_new} == new
    o = recipe_from_dict({"optim": {"lr": 1e-3, "warmup_frac": 0.5}}).optim
    o.warmup_new_params_only = True
    assert group_lr(0, 10, o, new=True) == pytest.approx(lr_at(0, 10, 1e-3, 0.5)) == pytest.approx(2e-4)
    assert group_lr(0, 10, o, new=False) == pytest.approx(1e-3)  # loaded: no ramp
    assert group_lr(7, 10, o, new=False) == group_lr(7, 10, o, new=True)  # after the warmup: one schedule
    o.warmup_new_params_only = False
    assert group_lr(0, 10, o, new=False) == pytest.approx(2e-4)


# ------------------------------------------------------------------------------------------ end to end
def test_end_to_end_upcycle_and_continue_on_the_embedded_data(tmp_path, capsys):
    """tiny_cpu.yaml (embedded stdlib corpus) shrunk to seconds: Pre-LN 30 steps -> upcycle to attnres and hc ->
    logits equal at conversion -> 50 more steps each: the loss keeps falling; upcycle.json, cards written."""
    shrink = ["model.hidden_size=64", "model.num_hidden_layers=2", "model.max_position_embeddings=64",
              "data.seq_len=64", "data.tokenizer_vocab_size=512", "data.val_docs=8", "data.val_sequences=16",
              "train.micro_batch_size=16", "train.eval_every=1", "train.eval_batches=1", "train.save_every=1000",
              "train.progress=false", "train.log_every=1"]
    pre = load_recipe("recipes/train/tiny_cpu.yaml", [*shrink, "train.max_steps=30", f"run_dir={tmp_path}/pre"])
    assert run(pre)["status"] == "finished"
    final = tmp_path / "pre" / "final"
    for design in ("attnres", "hc"):
        out = tmp_path / f"up_{design}"
        assert cli(["upcycle", str(final), str(out), "--design", design]) == 0
        assert "exactly equal" in capsys.readouterr().out
        rep = json.loads((out / "upcycle.json").read_text())
        assert rep["expected"] == "exact" and rep["max_abs_logit_diff"] <= EXACT_TOL
        assert (out / "tokenizer.json").exists() and (out / "README.md").exists()
        up = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
        src = AutoModelForCausalLM.from_pretrained(final).eval()
        x = torch.randint(0, up.config.vocab_size, (2, 32))
        with torch.no_grad():
            assert (up(x).logits - src(x).logits).abs().max() <= EXACT_TOL
        cont = load_recipe("recipes/train/tiny_cpu.yaml", [
            *shrink, "train.max_steps=50", f"run_dir={tmp_path}/cont_{design}", "data.shuffle_seed=1",
            f"model.design={design}", f"model.init_from={out}", "optim.new_param_lr_mult=2.0",
            "optim.warmup_new_params_only=true"])
        summary = run(cont)
        assert summary["status"] == "finished"
        rows = [json.loads(x) for x in (tmp_path / f"cont_{design}" / "metrics.jsonl").read_text().splitlines()]
        # the held-out loss after every step: the training loss of the embedded stream jumps with the file it is in
        # (whole stdlib files packed in order), the held-out batch is the same at every step
        total = 50
        assert rows[0]["lr"] == pytest.approx(cont.optim.lr)  # loaded: the warmup is skipped
        assert rows[0]["lr_new"] == pytest.approx(2.0 * lr_at(0, total, cont.optim.lr, cont.optim.warmup_frac))
        val = [r["val_loss"] for r in rows]
        assert len(val) == 50
        first, last = sum(val[:10]) / 10, sum(val[-10:]) / 10
        assert last < first - 0.05, (design, first, last)
        train_first, train_last = (sum(r["loss"] for r in rows[:10]) / 10, sum(r["loss"] for r in rows[-10:]) / 10)
        diag = json.loads((tmp_path / f"cont_{design}" / "upcycle_diagnostics.json").read_text())
        assert diag["before"]["loss"] > diag["after"]["loss"] and diag["new_parameters"] > 0
        card = (tmp_path / f"cont_{design}" / "final" / "README.md").read_text()
        assert "diagnostics before / after" in card and "| calibration loss |" in card
        print(f"E2E {design}: upcycle max|dlogits|={rep['max_abs_logit_diff']:.2e}; held-out loss first10={first:.4f} "
              f"last10={last:.4f}; train loss first10={train_first:.4f} last10={train_last:.4f}; "
              f"before={diag['before']} after={diag['after']}")
