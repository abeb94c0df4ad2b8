"""Interop every design must support like a Llama: PEFT LoRA, pipelines, attention backends, sharded loading,
torch.compile, a complete Hub folder."""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import batch, tiny_model
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, pipeline

import hf_depth
from hf_depth.tokenization import GPT2_VOCAB_SIZE, offline_gpt2_tokenizer

DESIGNS = sorted(hf_depth.DESIGNS)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def design_module_names(model) -> list[str]:
    """Names (suffixes) of the design-specific modules that hold parameters (HC routing, AttnRes queries...)."""
    names = set()
    for name, mod in model.named_modules():
        if any(True for _ in mod.parameters(recurse=False)) and (
            "connection" in name or name.endswith("stream") or ".stream." in name
        ):
            names.add(name.split(".")[-1])
    return sorted(names)


@pytest.mark.parametrize("design", DESIGNS)
def test_lora_train_save_reload_merge(design, tmp_path):
    model = tiny_model(design)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, lora_dropout=0.0, task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, lora)
    n_lora = sum(1 for n, _ in peft_model.named_parameters() if "lora_" in n)
    assert n_lora == 2 * len(LORA_TARGETS) * model.config.num_hidden_layers
    x, _ = batch(left_pad=(0, 0, 0))
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        loss = peft_model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    peft_model.eval()
    with torch.no_grad():
        unmerged = peft_model(input_ids=x).logits
    peft_model.save_pretrained(tmp_path / "adapter")
    fresh = tiny_model(design)  # same seed -> same base weights
    reloaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=x).logits, unmerged, rtol=1e-5, atol=1e-5)
        merged = reloaded.merge_and_unload()
        torch.testing.assert_close(merged(input_ids=x).logits, unmerged, rtol=1e-4, atol=1e-5)
    assert type(merged) is type(model)


@pytest.mark.parametrize("design", DESIGNS)
def test_design_parameters_targetable_by_name(design):
    """Design-specific modules can be trained alongside LoRA (modules_to_save) or stay frozen by default."""
    model = tiny_model(design)
    extra = design_module_names(model)
    lora = LoraConfig(r=2, target_modules=LORA_TARGETS, modules_to_save=extra or None, task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, lora)
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    for name in extra:
        assert any(f".{name}." in n and "modules_to_save" in n for n in trainable), name
    frozen = get_peft_model(tiny_model(design), LoraConfig(r=2, target_modules=LORA_TARGETS, task_type="CAUSAL_LM"))
    assert all("lora_" in n for n, p in frozen.named_parameters() if p.requires_grad)


@pytest.mark.parametrize("design", DESIGNS)
def test_eager_equals_sdpa(design):
    model = tiny_model(design)
    x, mask = batch()
    out = {}
    for impl in ("eager", "sdpa"):
        model.config._attn_implementation = impl
        with torch.no_grad():
            out[impl] = model(x, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(out["eager"][valid], out["sdpa"][valid], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("design", DESIGNS)
def test_sharded_low_cpu_mem_reload(design, tmp_path):
    model = tiny_model(design)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    again = AutoModelForCausalLM.from_pretrained(tmp_path, low_cpu_mem_usage=True, device_map="auto").eval()
    x, mask = batch()
    with torch.no_grad():
        torch.testing.assert_close(again(x, attention_mask=mask).logits, model(x, attention_mask=mask).logits,
                                   rtol=0, atol=0)


@pytest.mark.parametrize("design", DESIGNS)
def test_bf16_dtype_loading(design, tmp_path):
    tiny_model(design).save_pretrained(tmp_path)
    m = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    x, mask = batch()
    assert torch.isfinite(m(x, attention_mask=mask).logits.float()).all()


@pytest.mark.parametrize("design", DESIGNS)
def test_torch_compile_forward(design):
    model = tiny_model(design)
    x, mask = batch()
    torch._dynamo.reset()
    # aot_eager traces the whole forward through dynamo + AOTAutograd (what inductor consumes) in seconds on CPU
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # fullgraph: no data-dependent branch
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, attention_mask=mask).logits, model(x, attention_mask=mask).logits,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("design", DESIGNS)
def test_torch_compile_training_step(design):
    """A training step traced whole (``fullgraph``: no graph break) gives eager's loss and every gradient, with
    left padding (the masked rows are where data-dependent branches hide)."""
    model = tiny_model(design).train()
    x, mask = batch()
    labels = x.masked_fill(mask == 0, -100)
    model(x, attention_mask=mask, labels=labels).loss.backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    loss = compiled(x, attention_mask=mask, labels=labels).loss
    loss.backward()
    torch.testing.assert_close(loss, model(x, attention_mask=mask, labels=labels).loss, rtol=1e-5, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, eager[n], rtol=1e-4, atol=1e-6, msg=n)


def test_torch_compile_inductor_pre_ln():
    model = tiny_model("pre_ln")
    x, _ = batch(left_pad=(0, 0, 0))
    torch._dynamo.reset()
    compiled = torch.compile(model)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x).logits, model(x).logits, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def tokenizer():
    return offline_gpt2_tokenizer()


@pytest.mark.parametrize("design", DESIGNS)
def test_pipeline_matches_generate(design, tokenizer):
    model = tiny_model(design, vocab_size=GPT2_VOCAB_SIZE, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.eos_token_id)
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    prompt = "def add(a, b):"
    text = pipe(prompt, max_new_tokens=6, do_sample=False, return_full_text=True)[0]["generated_text"]
    ids = tokenizer(prompt, return_tensors="pt")
    gen = model.generate(**ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert text == tokenizer.decode(gen[0], skip_special_tokens=True)


def test_hub_folder_complete_and_loads_without_package(tmp_path, tokenizer):
    """What push_to_hub would upload: weights, config with auto_map, code, tokenizer, generation config."""
    model = tiny_model("sandwich_ln", vocab_size=GPT2_VOCAB_SIZE, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.eos_token_id)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    files = set(os.listdir(tmp_path))
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "modeling_depth.py",
            "configuration_depth.py", "design_sandwich.py"} <= files
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["auto_map"] == {
        "AutoConfig": "design_sandwich.SandwichLNConfig",
        "AutoModel": "design_sandwich.SandwichLNModel",  # classes live in their design file (issue 15)
        "AutoModelForCausalLM": "design_sandwich.SandwichLNForCausalLM",
    }
    ids = tokenizer("The quick brown fox", return_tensors="pt")
    want = model.generate(**ids, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    code = f"""
import sys, torch
from transformers import AutoModelForCausalLM, AutoModel, AutoTokenizer
p = {str(tmp_path)!r}
tok = AutoTokenizer.from_pretrained(p, trust_remote_code=True)
m = AutoModelForCausalLM.from_pretrained(p, trust_remote_code=True)
base = AutoModel.from_pretrained(p, trust_remote_code=True)
ids = tok("The quick brown fox", return_tensors="pt")
out = m.generate(**ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.eos_token_id)
assert 'hf_depth' not in sys.modules
print("IDS", out[0].tolist())
"""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "hf_depth.py").write_text("raise ImportError('hf_depth must not be imported')\n")
    env = {**os.environ, "PYTHONPATH": str(hide), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("IDS ")]
    assert lines, (r.stdout[-2000:], r.stderr[-2000:])
    line = lines[-1]
    assert json.loads(line[4:]) == want[0].tolist()
