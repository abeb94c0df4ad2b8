"""Train a tiny model on CPU, then run the full ``hf-depth diagnose`` suite on it and time it.

The text is local (this repository's own source and docs by default), byte-level tokenized (vocab 258: 0 = pad,
1 = EOS, bytes + 2), so nothing is downloaded. The last 10% of the text is held out as calibration data.

    python benchmarks/diagnose_tiny.py --design pre_ln --layers 8 --hidden 64 --steps 150 --out runs/diag-tiny
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import torch

import hf_depth
from hf_depth.diagnostics.cli import main as diagnose

ROOT = pathlib.Path(__file__).resolve().parents[1]


def corpus(paths: list[str]) -> torch.Tensor:
    files = []
    for p in paths:
        p = pathlib.Path(p)
        files += sorted(p.rglob("*.py")) + sorted(p.rglob("*.md")) if p.is_dir() else [p]
    data = b"\n".join(f.read_bytes() for f in files)
    return torch.tensor(list(data), dtype=torch.long) + 2


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--design", default="pre_ln", choices=sorted(hf_depth.DESIGNS))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--text", nargs="+", default=[str(ROOT / "src"), str(ROOT / "README.md")])
    p.add_argument("--calib-samples", type=int, default=32)
    p.add_argument("--out", default="runs/diag-tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    ids = corpus(args.text)
    split = int(0.9 * len(ids))
    train, held = ids[:split], ids[split:]
    model = hf_depth.model_for(args.design, vocab_size=258, hidden_size=args.hidden, num_hidden_layers=args.layers,
                               num_attention_heads=args.heads, max_position_embeddings=max(args.seq, 128),
                               pad_token_id=0, eos_token_id=1)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / (args.steps // 10 + 1)))
    g = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    model.train()
    for step in range(args.steps):
        starts = torch.randint(0, len(train) - args.seq, (args.batch,), generator=g)
        x = torch.stack([train[s : s + args.seq] for s in starts])
        loss = model(input_ids=x, labels=x, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step} loss {loss.item():.3f}", flush=True)
    train_s = time.perf_counter() - t0
    model.eval().save_pretrained(out / "model")
    n = min(args.calib_samples, len(held) // args.seq)
    torch.save(held[: n * args.seq].view(n, args.seq), out / "calib.pt")
    t0 = time.perf_counter()
    diagnose([str(out / "model"), "--data", str(out / "calib.pt"), "--out", str(out / "diag"), "--seq-len",
              str(args.seq), "--num-samples", str(n), "--measure-seq-len", str(args.seq), "--no-progress"])
    diag_s = time.perf_counter() - t0
    rep = json.loads((out / "diag" / "report.json").read_text())
    print(json.dumps({"design": args.design, "train_seconds": round(train_s, 1), "diagnose_seconds": round(diag_s, 1),
                      "timing_s": {k: round(v, 2) for k, v in rep["timing_s"].items()},
                      "R_causal": rep["causal"]["R_causal"], "R_perm": rep["permutation"]["R_perm"],
                      "loss": rep["loss"]}))


if __name__ == "__main__":
    main()
