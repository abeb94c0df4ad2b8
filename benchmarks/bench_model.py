"""Our Pre-LN vs transformers.LlamaForCausalLM of the same shape and weights, measured in one run.

Times forward+backward and greedy generation (with KV cache) for both, interleaved, and prints the ratio
ours / Llama (target <= 1.05). Works on CPU and GPU.

    python benchmarks/bench_model.py --hidden 256 --layers 4 --seq 256 --batch 4
"""

from __future__ import annotations

import argparse

import torch
from _timing import add_shape_args, best_time

import hf_depth
from hf_depth.convert import pre_ln_to_llama


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p, repeats=7)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    a = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, a.dtype)
    torch.manual_seed(0)
    ours = hf_depth.model_for(
        "pre_ln", vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=a.heads,
        pad_token_id=0, eos_token_id=1,
    )
    llama = pre_ln_to_llama(ours)
    ours, llama = ours.to(device, dtype), llama.to(device, dtype)
    for m in (ours, llama):
        m.config._attn_implementation = a.attn
    x = torch.randint(2, a.vocab, (a.batch, a.seq), device=device)

    def fwd_bwd(m):
        def run():
            m.zero_grad(set_to_none=True)
            m(x, labels=x).loss.backward()
        return run

    def gen(m):
        prompt = x[:, : a.seq // 2]
        def run():
            with torch.no_grad():
                m.generate(prompt, max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, do_sample=False,
                           pad_token_id=0)
        return run

    print(f"device={device} dtype={a.dtype} attn={a.attn} d={a.hidden} L={a.layers} B={a.batch} T={a.seq}")
    print("| op | hf_depth pre_ln (ms) | LlamaForCausalLM (ms) | ratio |")
    print("|---|---:|---:|---:|")
    for name, make in (("forward+backward", fwd_bwd), ("greedy generate", gen)):
        # interleave the two to share thermal / cache state
        ta, tb = [], []
        for _ in range(3):
            ta.append(best_time(make(ours), device, a.repeats, warmup=2))
            tb.append(best_time(make(llama), device, a.repeats, warmup=2))
        ma, mb = min(ta), min(tb)
        print(f"| {name} | {ma * 1e3:.2f} | {mb * 1e3:.2f} | {ma / mb:.3f} |")


if __name__ == "__main__":
    main()
