"""Training step time of a scale-vector variant (default HG+DNP+OR) vs ``standard``, measured in one run.

One step = forward + backward + AdamW step (IWD groups), same shape, same design, interleaved repeats; prints
the median (over rounds, of the best of repeats) step time of both and the ratio variant / standard (the paper reports 1.04x wall-clock on GPU for
Dense-1B). Works on CPU and GPU.

    python benchmarks/bench_scale_vectors.py --hidden 256 --layers 4 --seq 256 --batch 4
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _timing import add_shape_args, best_time

import hf_depth
from hf_depth.training.optim import make_optimizer


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p)
    p.add_argument("--variant", default="HG+DNP+OR")
    p.add_argument("--design", default="pre_ln")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median over rounds of the best of repeats)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x = torch.randint(2, a.vocab, (a.batch, a.seq), device=device)
    steps = {}
    for sv in ("standard", a.variant):
        torch.manual_seed(0)
        model = hf_depth.model_for(
            a.design, vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers,
            num_attention_heads=a.heads, pad_token_id=0, eos_token_id=1, scale_vector=sv,
        ).to(device, getattr(torch, a.dtype)).train()
        opt = make_optimizer(model, lr=1e-4, weight_decay=0.1, policy="iwd")

        def step(model=model, opt=opt):
            loss = model(x, labels=x, use_cache=False).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        steps[sv] = step
    times = {sv: [] for sv in steps}
    for _ in range(a.rounds):
        for sv, step in steps.items():
            times[sv].append(best_time(step, device, a.repeats, warmup=1))
    med = {sv: statistics.median(t) for sv, t in times.items()}
    print(f"device={device.type} design={a.design} d={a.hidden} L={a.layers} B={a.batch} T={a.seq} dtype={a.dtype}")
    for sv, t in med.items():
        print(f"{sv:>12}: {t * 1e3:8.1f} ms / step (fwd+bwd+AdamW)")
    print(f"ratio {a.variant} / standard = {med[a.variant] / med['standard']:.3f}x")


if __name__ == "__main__":
    main()
