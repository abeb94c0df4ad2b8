"""Calibration data for the diagnostics: a local file or a Hub dataset, tokenized, windowed and sampled with a seed.

Sources (``--data``):

* ``*.txt``: plain text; ``*.jsonl`` / ``*.json``: one record per line with ``"text"`` or pre-tokenized
  ``"input_ids"``; ``*.pt``: a ``[N, T]`` id tensor or ``{"input_ids", "attention_mask"}``; ``*.npy``: ids.
* ``hf:NAME[:CONFIG[:SPLIT]]``: a Hub dataset streamed through ``datasets`` (default
  ``hf:HuggingFaceFW/fineweb-edu:sample-10BT:train``, DepthBench's calibration family; needs network access).

Text is tokenized with the model folder's tokenizer (or ``--tokenizer``), documents are joined with EOS and cut
into windows of ``seq_len`` tokens; ``num_samples`` windows are drawn with ``seed``. Pre-tokenized records
keep their own lengths (truncated to ``seq_len``, right-padded with attention mask 0).
"""

from __future__ import annotations

import json
import pathlib
import random

import torch

from ..errors import UserError, reading
from .common import Batch

DEFAULT_DATASET = "hf:HuggingFaceFW/fineweb-edu:sample-10BT:train"


def _records(source: str, max_docs: int):
    if source.startswith("hf:"):
        parts = source[3:].split(":")
        name, config = parts[0], (parts[1] if len(parts) > 1 and parts[1] else None)
        split = parts[2] if len(parts) > 2 else "train"
        try:
            import datasets

            ds = datasets.load_dataset(name, config, split=split, streaming=True)
        except Exception as e:  # offline, unknown name...
            raise ValueError(f"`--data` {source!r}: cannot load the Hub dataset ({type(e).__name__}: {e}); "
                             "give a local .txt/.jsonl/.pt/.npy file instead") from e
        for i, rec in enumerate(ds):
            if i >= max_docs:
                break
            yield rec
        return
    path = pathlib.Path(source)
    if not path.exists():
        raise ValueError(f"`--data` {source!r} does not exist (a .txt/.jsonl/.json/.pt/.npy file or hf:NAME)")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        with path.open(encoding="utf-8", errors="replace") as fh:
            for n, line in enumerate(fh):
                if line.strip():
                    try:
                        rec = json.loads(line)
                    except ValueError as e:
                        raise UserError(f"`--data` {source!r} line {n + 1} is not JSON ({e}): one record per line, "
                                        'e.g. {"text": ...} or {"input_ids": [...]}') from None
                    if not isinstance(rec, dict):
                        raise UserError(f"`--data` {source!r} line {n + 1} is not a JSON object with 'text' or 'input_ids'")
                    yield rec
    elif suffix == ".pt":
        # weights_only: a user's file is data, never code (a pickle payload in it is refused, not run)
        with reading(source, "`--data` file", "a .pt must hold a [N, T] id tensor or {'input_ids', 'attention_mask'}"):
            obj = torch.load(path, map_location="cpu", weights_only=True)
        ids = obj.get("input_ids") if isinstance(obj, dict) else obj
        mask = obj.get("attention_mask") if isinstance(obj, dict) else None
        if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.is_floating_point() or (
                mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != ids.shape)):
            raise UserError(f"`--data` {source!r} must hold a [N, T] integer id tensor or {{'input_ids', "
                            f"'attention_mask'}} of one shape, got {type(obj).__name__}")
        for i in range(ids.shape[0]):
            row = ids[i] if mask is None else ids[i][mask[i].bool()]
            yield {"input_ids": row.tolist()}
    elif suffix == ".npy":
        import numpy as np

        with reading(source, "`--data` file", "a .npy must hold an integer id array (np.save)"):
            arr = np.load(path, allow_pickle=False)
        if arr.ndim == 0 or not np.issubdtype(arr.dtype, np.integer):
            raise UserError(f"`--data` {source!r} must hold integer token ids, got a {arr.ndim}-D {arr.dtype} array")
        for row in arr.reshape(-1, arr.shape[-1]) if arr.ndim > 1 else [arr]:
            yield {"input_ids": [int(x) for x in row]}
    elif suffix in (".txt", ".md", ""):
        if path.is_dir():
            raise UserError(f"`--data` {source!r} is a folder: give a .txt/.jsonl/.json/.pt/.npy file or hf:NAME")
        yield {"text": path.read_text(encoding="utf-8", errors="replace")}
    else:
        raise ValueError(f"`--data` {source!r}: unsupported extension {suffix!r}; allowed .txt .md .jsonl .json .pt .npy")


def load_calibration(source: str = DEFAULT_DATASET, tokenizer=None, seq_len: int = 512, num_samples: int = 128,
                     batch_size: int = 8, seed: int = 0, pad_token_id: int = 0, max_docs: int = 20000) -> list[Batch]:
    """Calibration batches (``Batch`` of ids and mask), ``num_samples`` sequences of at most ``seq_len`` tokens."""
    for name, v in (("seq_len", seq_len), ("num_samples", num_samples), ("batch_size", batch_size)):
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"`{name}` must be a positive integer, got {v!r}")
    rng = random.Random(seed)
    pretok, stream = [], []
    eos = getattr(tokenizer, "eos_token_id", None)
    for rec in _records(source, max_docs):
        if "input_ids" in rec:
            pretok.append([int(x) for x in rec["input_ids"]][:seq_len])
        elif "text" in rec:
            if tokenizer is None:
                raise ValueError("text calibration data needs a tokenizer (`--tokenizer`, or one in the model folder)")
            stream.extend(tokenizer(rec["text"], add_special_tokens=False)["input_ids"])
            if eos is not None:
                stream.append(eos)
        else:
            raise UserError(f"`--data` {source!r}: a calibration record has neither 'text' nor 'input_ids' "
                            f"(keys {sorted(rec)})")
    windows = [stream[i : i + seq_len] for i in range(0, len(stream) - seq_len + 1, seq_len)]
    seqs = [s for s in pretok + windows if len(s) >= 2]
    if not seqs:
        raise ValueError(f"`--data` {source!r} gave no sequence of >= 2 tokens (seq_len={seq_len})")
    if len(seqs) > num_samples:
        seqs = rng.sample(seqs, num_samples)
    batches = []
    for i in range(0, len(seqs), batch_size):
        chunk = seqs[i : i + batch_size]
        T = max(len(s) for s in chunk)
        ids = torch.full((len(chunk), T), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), T), dtype=torch.long)
        for j, s in enumerate(chunk):
            ids[j, : len(s)] = torch.tensor(s)
            mask[j, : len(s)] = 1
        batches.append(Batch(ids, mask))
    return batches
