"""``hf-depth diagnose MODEL --data FILE --out DIR``: the full depth-diagnostics report of one model.

MODEL is a saved model folder or a Hub id: any hf_depth design, or a decoder of a supported family (Llama,
Mistral, Qwen2, Qwen3, Gemma2/3, Phi3, OLMo2, GPT-2, GPT-NeoX/Pythia; ``adapters.py``); any other family is
refused with one line, and a folder that asks to run its own code (``auto_map``) is refused unless
``--trust-remote-code`` is given (:mod:`hf_depth.loading`). The report lands in
``DIR/report.json``, ``DIR/report.md`` and ``DIR/*.png``; the headline numbers are printed as JSON.

    hf-depth diagnose runs/tiny-pre-ln --data calib.jsonl --out diag/ --seq-len 128 --num-samples 16
"""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import arg_number
from ..loading import RemoteCodeRefused, add_trust_remote_code
from .conventions import CONVENTIONS, DEFAULT
from .data import DEFAULT_DATASET, load_calibration
from .report import MEASUREMENTS, headline, run_diagnostics, write_report


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-depth diagnose", description=__doc__.splitlines()[0])
    p.add_argument("model", help="saved model folder or Hub id (hf_depth design or a supported decoder family)")
    p.add_argument("--data", default=DEFAULT_DATASET,
                   help=f"calibration data: .txt/.jsonl/.json/.pt/.npy, or hf:NAME[:CONFIG[:SPLIT]] (default {DEFAULT_DATASET})")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder/name (default: the model folder's)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per calibration sequence (DepthBench: 512)")
    p.add_argument("--num-samples", type=int, default=128, help="calibration sequences (DepthBench: 128)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", nargs="+", choices=MEASUREMENTS, default=list(MEASUREMENTS),
                   help="measurements to run (default: all)")
    p.add_argument("--flops-seq-len", type=arg_number(int, 1), default=4096, help="T of the analytic prefill FLOPs (default 4096)")
    p.add_argument("--no-measure-cost", action="store_true", help="analytic cost only (no timing runs)")
    p.add_argument("--measure-seq-len", type=arg_number(int, 1), default=128, help="sequence length of the timing runs")
    p.add_argument("--repeats", type=arg_number(int, 1), default=3, help="timed repetitions per cost measurement (median)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--convention", choices=CONVENTIONS, default=DEFAULT,
                   help="skip/swap/state semantics: depthbench (DepthBench's analysis code, default) or branch")
    p.add_argument("--no-progress", action="store_true")
    add_trust_remote_code(p)
    return p


def _load(args):
    import torch
    from transformers import AutoConfig

    from ..loading import check_remote_code, load_model, load_tokenizer
    from .adapters import adapter_class, supported_families

    trust = check_remote_code(args.model, args.trust_remote_code)  # before any of the folder's code can run

    try:
        config = AutoConfig.from_pretrained(args.model, trust_remote_code=trust)
    except (OSError, ValueError, KeyError) as e:  # an unknown model_type, a missing folder
        raise ValueError(f"cannot read the config of {args.model!r} ({type(e).__name__}); the diagnostics know "
                         f"{supported_families()}") from None
    adapter_class(config)  # refuse an unknown family before loading any weight
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(args.model, trust_remote_code=args.trust_remote_code,
                       dtype=getattr(torch, args.dtype)).to(device).eval()
    tok = None
    try:
        tok = load_tokenizer(args.tokenizer or args.model, trust_remote_code=args.trust_remote_code)
    except RemoteCodeRefused:
        raise                           # a refused tokenizer is never silently replaced by raw bytes
    except Exception:
        if args.tokenizer:
            raise
    return model, tok


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        model, tok = _load(args)
    except ValueError as e:
        print(f"hf-depth diagnose: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    batches = load_calibration(args.data, tok, args.seq_len, args.num_samples, args.batch_size, args.seed, pad,
                               vocab_size=model.config.vocab_size)
    device = next(model.parameters()).device
    batches = [b.to(device) for b in batches]
    report = run_diagnostics(model, batches, args.only, args.flops_seq_len, not args.no_measure_cost,
                             args.measure_seq_len, args.repeats, show_progress=not args.no_progress,
                             convention=args.convention)
    report["args"] = {k: v for k, v in vars(args).items()}
    files = write_report(report, args.out)
    print(json.dumps({"headline": headline(report), "files": files, "seconds": report["timing_s"]["total"]},
                     default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
