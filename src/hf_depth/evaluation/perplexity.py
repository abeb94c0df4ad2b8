"""``hf-depth val-loss MODEL --data FILE``: validation loss and perplexity on held-out text.

FILE is ``.jsonl`` (one document per line, the ``--text-field`` column, default ``text``) or plain text
(``.txt``: one document per blank-line-separated paragraph). Documents are tokenized, each followed by EOS,
concatenated and cut into non-overlapping blocks of ``--seq-len`` tokens (the last, shorter block is kept);
the loss is the mean next-token NLL over every predicted token. ``evaluate_loss`` is the reusable core (the
training loop calls it with its own batches).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F


@torch.no_grad()
def evaluate_loss(model, token_batches: Iterable, device=None) -> dict:
    """Mean next-token NLL over ``token_batches`` (LongTensor [B, T], or dicts with ``input_ids`` and optional
    ``attention_mask``; masked positions are neither inputs nor targets).
    Returns ``{"loss", "perplexity", "tokens"}``; restores the model's train/eval mode."""
    was_training = model.training
    model.eval()
    device = device or next(model.parameters()).device
    total, count = 0.0, 0
    try:
        for batch in token_batches:
            if isinstance(batch, dict):
                ids, mask = batch["input_ids"], batch.get("attention_mask")
            else:
                ids, mask = batch, None
            ids = ids.to(device)
            mask = mask.to(device) if mask is not None else None
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            targets = ids[:, 1:]
            nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="none")
            if mask is not None:
                keep = (mask[:, 1:] * mask[:, :-1]).reshape(-1).bool()
                nll = nll[keep]
            total += nll.sum().item()
            count += nll.numel()
    finally:
        model.train(was_training)
    loss = total / count if count else float("nan")
    return {"loss": loss, "perplexity": math.exp(loss) if count else float("nan"), "tokens": count}


def read_documents(path: str | Path, text_field: str = "text") -> list[str]:
    from ..errors import UserError

    path = Path(path)
    if not path.is_file():
        raise UserError(f"`--data` {str(path)!r} does not exist (or is not a file): give a .jsonl or .txt file")
    if path.suffix == ".jsonl":
        docs = []
        with open(path, encoding="utf-8", errors="replace") as f:
            for i, line in enumerate(f):
                if line.strip():
                    try:
                        row = json.loads(line)
                    except ValueError as e:
                        raise UserError(f"`--data` {str(path)!r} line {i + 1} is not JSON ({e})") from None
                    if not isinstance(row, dict) or text_field not in row:
                        raise ValueError(f"`--text-field` {text_field!r} missing in line {i + 1} of {path}")
                    docs.append(row[text_field])
        return docs
    if path.suffix in (".txt", ".md", ""):
        return [p.strip() for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    raise ValueError(f"`--data` must be a .jsonl or .txt file, got {path.name!r}")


def token_blocks(tokenizer, documents: Iterable[str], seq_len: int, batch_size: int,
                 max_tokens: int | None = None) -> list[torch.Tensor]:
    """Tokenize + EOS, concatenate, cut into ``seq_len`` blocks and group them into batches."""
    ids: list[int] = []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for doc in documents:
        ids += tokenizer(doc, add_special_tokens=False)["input_ids"] + eos
        if max_tokens and len(ids) >= max_tokens:
            ids = ids[:max_tokens]
            break
    blocks = [ids[i:i + seq_len] for i in range(0, len(ids), seq_len)]
    blocks = [b for b in blocks if len(b) > 1]
    batches = []
    for i in range(0, len(blocks), batch_size):
        group = blocks[i:i + batch_size]
        same = [b for b in group if len(b) == len(group[0])]
        batches.append(torch.tensor(same))
        if len(same) < len(group):           # the short last block goes alone
            batches.append(torch.tensor([group[-1]]))
    return batches


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hf-depth val-loss", description=__doc__.split("\n")[0])
    ap.add_argument("model", help="model folder, run folder (final/ or latest checkpoint) or Hub id")
    ap.add_argument("--data", required=True, help="held-out text: .jsonl (--text-field) or .txt")
    ap.add_argument("--text-field", default="text")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=None, help="stop after this many tokens")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--output", default=None, help="also write the result as JSON here")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if args.seq_len < 2 or args.batch_size < 1:
        ap.error("`--seq-len` must be >= 2 and `--batch-size` >= 1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_depth  # noqa: F401

    from ..errors import UserError, reading, reading_model
    from .cli import resolve_model, resolve_tokenizer

    documents = read_documents(args.data, args.text_field)
    model_path = resolve_model(args.model)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    with reading_model(model_path):
        model = AutoModelForCausalLM.from_pretrained(model_path, trust_remote_code=True).to(device)
    tok_path = args.tokenizer or resolve_tokenizer(model_path, args.model)
    with reading(tok_path, "the tokenizer", "give --tokenizer, or save one next to the model"):
        tok = AutoTokenizer.from_pretrained(tok_path)
    seq_len = min(args.seq_len, getattr(model.config, "max_position_embeddings", args.seq_len))
    batches = token_blocks(tok, documents, seq_len, args.batch_size, args.max_tokens)
    if not batches:  # a loss over no token is no result: never print or write one
        raise UserError(f"`--data` {str(args.data)!r} holds no text to score (no block of >= 2 tokens): "
                        "give a file with documents")
    result = {"model": args.model, "data": str(args.data), "seq_len": seq_len, **evaluate_loss(model, batches)}
    print(f"val loss {result['loss']:.4f}  perplexity {result['perplexity']:.3f}  ({result['tokens']} tokens)")
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
