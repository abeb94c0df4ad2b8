"""Every registered design vs Pre-LN, measured in one run.

1. Exact parameter counts at the DepthBench 400M shape (L=24, d=1024, vocab 50280, 16 heads) from
   ``hf_depth.shapes.count_params`` (no model is built), and the overhead over Pre-LN.
2. Forward+backward time of each design on one small shape, relative to Pre-LN (designs interleaved, best of
   rounds, so every design sees the same machine state).

    python benchmarks/bench_designs.py [--hidden 128 --layers 8 --seq 128 --batch 4]
"""

from __future__ import annotations

import argparse

import torch
from _timing import add_shape_args, best_time

import hf_depth
from hf_depth import shapes


def fwd_bwd_time(model, x, repeats: int) -> float:
    def step():
        model.zero_grad(set_to_none=True)
        model(x, labels=x).loss.backward()

    return best_time(step, x.device, repeats, warmup=0)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p, hidden=128, layers=8, heads=4, vocab=4096, seq=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--designs", nargs="*", default=sorted(hf_depth.DESIGNS))
    a = p.parse_args(argv)

    print("## Parameters at L=24, d=1024 (vocab 50280, 16 heads)\n")
    print("| design | params | extra vs pre_ln | extra fraction |")
    print("|---|---:|---:|---:|")
    base = shapes.count_params(shapes.make_config("pre_ln", 1024, 24))
    for name in a.designs:
        n = shapes.count_params(shapes.make_config(name, 1024, 24))
        print(f"| {name} | {n:,} | {n - base:+,} | {(n - base) / base:+.3%} |")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x = torch.randint(2, a.vocab, (a.batch, a.seq), device=device)
    models = {}
    for name in a.designs:
        torch.manual_seed(0)
        models[name] = hf_depth.model_for(
            name, vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=a.heads,
            pad_token_id=0, eos_token_id=1,
        ).to(device).train()
        fwd_bwd_time(models[name], x, 1)  # warm-up
    times = {name: float("inf") for name in a.designs}
    for _ in range(a.rounds):
        for name, m in models.items():
            times[name] = min(times[name], fwd_bwd_time(m, x, a.repeats))
    ref = times.get("pre_ln", next(iter(times.values())))
    print(f"\n## Forward+backward on {device}: d={a.hidden} L={a.layers} B={a.batch} T={a.seq} (best of "
          f"{a.rounds}x{a.repeats})\n")
    print("| design | ms | vs pre_ln |")
    print("|---|---:|---:|")
    for name in a.designs:
        print(f"| {name} | {times[name] * 1e3:.1f} | {times[name] / ref:.2f}x |")


if __name__ == "__main__":
    main()
