"""Our Pre-LN vs transformers.LlamaForCausalLM of the same shape and weights, measured in one run.

Times forward+backward and greedy generation (with KV cache) for both, interleaved in one process (one call of
each per round, ``--rounds`` rounds after a warm-up, median), and prints the ratio ours / Llama (targets:
<= 1.05 for forward+backward, <= 1.00 for generation). On CPU it runs on one thread (``OMP_NUM_THREADS=1``,
``torch.set_num_threads(1)``) unless ``--threads`` says otherwise, so that the two models share one core the
same way. Works on CPU and GPU.

    python benchmarks/bench_model.py --hidden 256 --layers 4 --seq 256 --batch 4 --new-tokens 64
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch starts its thread pool

import torch  # noqa: E402
from _timing import add_shape_args, interleaved_median  # noqa: E402

import hf_depth  # noqa: E402
from hf_depth.convert import pre_ln_to_llama  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p, repeats=7)
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (median; at least 5)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    a = p.parse_args(argv)
    if a.rounds < 5:
        p.error("--rounds must be at least 5 (the ratio is a median of interleaved rounds)")
    torch.set_num_threads(a.threads)
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

    print(f"device={device} threads={torch.get_num_threads()} dtype={a.dtype} attn={a.attn} d={a.hidden} "
          f"L={a.layers} B={a.batch} T={a.seq} new_tokens={a.new_tokens} rounds={a.rounds} (interleaved, median)")
    print("| op | hf_depth pre_ln (ms) | LlamaForCausalLM (ms) | ratio |")
    print("|---|---:|---:|---:|")
    for name, make in (("forward+backward", fwd_bwd), ("greedy generate", gen)):
        t = interleaved_median({"ours": make(ours), "llama": make(llama)}, device, a.rounds, warmup=2)
        print(f"| {name} | {t['ours'] * 1e3:.2f} | {t['llama'] * 1e3:.2f} | {t['ours'] / t['llama']:.3f} |")


if __name__ == "__main__":
    main()
