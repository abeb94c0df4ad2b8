"""Small shared helpers for the test-suite."""

import torch

import hf_depth

TINY = dict(
    vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=64, pad_token_id=0, eos_token_id=1,
)


def tiny_config(design: str, **kw):
    return hf_depth.config_for(design, **{**TINY, **kw})


def tiny_model(design: str, seed: int = 0, **kw):
    torch.manual_seed(seed)
    return hf_depth.model_for(design, **{**TINY, **kw}).eval()


def batch(vocab=97, b=3, t=9, seed=1, left_pad=(3, 1, 0)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(2, vocab, (b, t), generator=g)
    mask = torch.ones_like(x)
    for i, p in enumerate(left_pad[:b]):
        mask[i, :p] = 0
        x[i, :p] = 0
    return x, mask


def train_steps(model, x, opt, steps: int) -> list[float]:
    """Full-batch training steps on ``x`` (labels = inputs); returns the losses."""
    losses = []
    for _ in range(steps):
        loss = model(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def run_without_hf_depth(folder, code: str):
    """Run ``code`` in a fresh Python where ``import hf_depth`` fails (offline Hub), from ``folder``: what a user
    without the package sees when loading a saved folder by remote code. Returns the CompletedProcess."""
    import os
    import subprocess
    import sys

    hide = folder / "hide"
    hide.mkdir(exist_ok=True)
    (hide / "hf_depth.py").write_text("raise ImportError('hf_depth must not be imported')\n")
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONPATH": str(hide), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=folder, env=env, timeout=300)


def count_native_calls(monkeypatch, ops) -> list:
    """Wrap each ``hf_depth.native.<op>`` of ``ops`` so that a call appends the op's name to the returned list (the
    op still runs): which native kernels a step really took."""
    from hf_depth import native

    calls = []
    for op in ops:
        real = getattr(native, op)
        monkeypatch.setattr(native, op, lambda *a, _op=op, _real=real, **k: calls.append(_op) or _real(*a, **k))
    return calls
