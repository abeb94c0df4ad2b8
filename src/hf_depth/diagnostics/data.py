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
        with path.open() as fh:
            for line in fh:
                if line.strip():
                    yield json.loads(line)
    elif suffix == ".pt":
        obj = torch.load(path, map_location="cpu")
        ids = obj["input_ids"] if isinstance(obj, dict) else obj
        mask = obj.get("attention_mask") if isinstance(obj, dict) else None
        for i in range(ids.shape[0]):
            row = ids[i] if mask is None else ids[i][mask[i].bool()]
            yield {"input_ids": row.tolist()}
    elif suffix == ".npy":
        import numpy as np

        arr = np.load(path)
        for row in arr.reshape(-1, arr.shape[-1]) if arr.ndim > 1 else [arr]:
            yield {"input_ids": [int(x) for x in row]}
    elif suffix in (".txt", ".md", ""):
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
            raise ValueError(f"calibration record has neither 'text' nor 'input_ids': keys {sorted(rec)}")
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
