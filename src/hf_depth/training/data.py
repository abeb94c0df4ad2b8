"""Token streams for pretraining: documents -> tokens -> packed sequences, sharded across processes.

Three sources, one contract (``TokenStream``: ``next_batch(batch_size) -> LongTensor [B, seq_len]``,
``state_dict()`` / ``load_state_dict()`` so the stream position is part of a checkpoint):

- ``embedded``: the Python standard library's own sources (every Python install has them), with a byte-level BPE
  trained on them in seconds and cached, so a tiny run needs no download;
- ``hf``: a ``datasets`` stream (``HuggingFaceFW/fineweb-edu`` / ``sample-10BT``, or ``json``/``parquet`` files);
- ``memmap``: pre-tokenized ``.bin`` (raw ``token_dtype``) or ``.npy`` token files, memory-mapped.

Packing: documents are concatenated with an EOS after each and cut into sequences of ``seq_len`` tokens (the
model shifts labels itself). Nothing is lost or duplicated: the concatenation of the sequences is the token
stream, and the leftover of a document carries into the next sequence. Sharding is by document (``hf``:
``datasets.distributed.split_dataset_by_node``; ``embedded``: every ``world``-th file), so processes never see
the same document. The first ``val_docs`` documents (or ``val_data_files``) are held out for validation.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError, reading
from .recipe import DataRecipe

EOS, PAD = "<|endoftext|>", "<|padding|>"
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "turtledemo", "__pycache__", "lib2to3"}


# ---------------------------------------------------------------------------------------------- embedded corpus
def embedded_corpus_files() -> list[Path]:
    """The standard library's ``.py`` sources (no tests), sorted: the embedded corpus (tens of MB)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("config-"))
        files += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    if not files:
        raise RuntimeError(f"no Python sources found under {root}: the embedded corpus needs the stdlib's .py files")
    return files


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def embedded_documents(seed: int) -> list[Path]:
    """The corpus files in a fixed, seeded order (the held-out documents are the first ones)."""
    files = embedded_corpus_files()
    random.Random(seed).shuffle(files)
    return files


# ---------------------------------------------------------------------------------------------- tokenizers
def cache_dir() -> Path:
    return Path(os.environ.get("HF_DEPTH_CACHE", Path.home() / ".cache" / "hf_depth"))


def train_embedded_tokenizer(vocab_size: int, out_dir: Path, max_bytes: int | None = None):
    """A byte-level BPE (GPT-2 style, ``<|endoftext|>`` = EOS, ``<|padding|>`` = pad) trained on up to
    ``max_bytes`` (default: 2 KiB per vocabulary entry, at most 8 MiB) of the embedded corpus; seconds."""
    max_bytes = max_bytes or min(8 << 20, 2048 * vocab_size)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = embedded_documents(seed=0)

    def texts():
        total = 0
        for f in files:
            t = _read(f)
            total += len(t)
            yield t
            if total > max_bytes:
                return

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS, PAD], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(texts(), trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=EOS, pad_token=PAD, bos_token=EOS, unk_token=None)
    tok.model_max_length = 1 << 30
    tok.save_pretrained(out_dir)
    return tok


def load_tokenizer(data: DataRecipe, run_dir: Path | None = None):
    """The run's tokenizer: the copy in ``run_dir/tokenizer`` when present (resume), else built and copied there.

    ``embedded`` is trained once per (Python version, vocabulary size) and cached under ``$HF_DEPTH_CACHE``.
    """
    from transformers import AutoTokenizer

    local = run_dir / "tokenizer" if run_dir is not None else None
    if local is not None and (local / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(local)
    if data.tokenizer == "embedded":
        key = hashlib.sha256(f"{sys.version}|{data.tokenizer_vocab_size}|v1".encode()).hexdigest()[:16]
        cached = cache_dir() / "tokenizers" / f"stdlib-bpe{data.tokenizer_vocab_size}-{key}"
        if not (cached / "tokenizer.json").exists():
            tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
            train_embedded_tokenizer(data.tokenizer_vocab_size, tmp)
            tmp.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.replace(tmp, cached)
            except OSError:  # another process won the race
                shutil.rmtree(tmp, ignore_errors=True)
        tok = AutoTokenizer.from_pretrained(cached)
    else:
        tok = AutoTokenizer.from_pretrained(data.tokenizer)
    if tok.eos_token_id is None:
        raise ValueError(f"`data.tokenizer` {data.tokenizer!r} has no EOS token; packing needs one between documents")
    if local is not None:
        tok.save_pretrained(local)
    return tok


# ---------------------------------------------------------------------------------------------- documents
def _hf_dataset(data: DataRecipe, files: list[str] | None):
    from datasets import load_dataset

    kwargs = {"data_files": files} if files else {}
    with reading(files or data.path, "the `data` files" if files else "the dataset `data.path`",
                 "check that they exist, are not empty and are of the builder `data.path` (json lines, parquet...)"):
        return load_dataset(data.path, data.name, split=data.split, streaming=True, **kwargs)


class Documents:
    """Texts of one split, sharded by document over ``world`` processes; ``iterate(epoch, skip)`` resumes."""

    def __init__(self, data: DataRecipe, split: str, rank: int = 0, world: int = 1):
        if split not in ("train", "val"):
            raise ValueError(f"`split` must be 'train' or 'val', got {split!r}")
        self.data, self.split, self.rank, self.world = data, split, rank, world

    def iterate(self, epoch: int = 0, skip: int = 0) -> Iterator[str]:
        d, held_out = self.data, self.data.val_data_files is None
        if d.source == "embedded":
            files = embedded_documents(d.shuffle_seed)
            files = files[: d.val_docs] if self.split == "val" else files[d.val_docs :]
            if self.split == "train" and epoch > 0:
                random.Random(d.shuffle_seed * 1000 + epoch).shuffle(files)
            for f in files[self.rank :: self.world][skip:]:
                yield _read(f)
            return
        if d.source != "hf":
            raise ValueError(f"`data.source` {d.source!r} has no documents (memmap holds tokens)")
        from datasets.distributed import split_dataset_by_node

        if self.split == "val":
            ds = _hf_dataset(d, d.val_data_files or d.data_files)
            yield from self._texts(ds.take(d.val_docs) if held_out else ds)
            return
        # The held-out documents are the first `val_docs` of the whole (unsplit) stream, whatever the number of
        # processes: each process reads them once and drops them from its shard by content hash.
        held = {_digest(t) for t in Documents(d, "val").iterate()} if held_out and d.val_docs else set()
        ds = _hf_dataset(d, d.data_files)
        if epoch > 0:
            ds = ds.shuffle(seed=d.shuffle_seed + epoch, buffer_size=1000)
        if self.world > 1:
            ds = split_dataset_by_node(ds, rank=self.rank, world_size=self.world)
        kept = 0
        for text in self._texts(ds):
            if held and _digest(text) in held:
                continue
            kept += 1
            if kept > skip:
                yield text

    def _texts(self, ds) -> Iterator[str]:
        rows = iter(ds)
        while True:
            with reading(_where(self.data), "the documents of", "check that the files exist, are not empty and are "
                         "of the builder `data.path` (json lines, parquet...)"):
                try:
                    row = next(rows)
                except StopIteration:
                    return
            text = row.get(self.data.text_field)
            if not isinstance(text, str):
                raise ValueError(f"`data.text_field` {self.data.text_field!r} is not a text column; row keys: {list(row)}")
            yield text


def _where(data: DataRecipe) -> str:
    files = data.data_files or []
    return f"`data.source`={data.source!r}" + (f", `data.data_files`={files}" if files else "") + (
        f", `data.path`={data.path!r}" if data.path else "")


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "replace"), digest_size=16).digest()


# ---------------------------------------------------------------------------------------------- packing
def pack(token_docs, seq_len: int, carry: list[int] | None = None) -> Iterator[tuple[list[int], int, list[int]]]:
    """Concatenate token documents (each already ending in EOS) into sequences of ``seq_len`` tokens.

    Yields ``(sequence, documents_consumed, carry)`` where ``carry`` is the part of the stream after the sequence
    (it belongs to the next one): feeding ``carry`` back in with the remaining documents resumes exactly.
    """
    buf = list(carry or [])
    consumed = 0
    for ids in token_docs:
        buf.extend(ids)
        consumed += 1
        while len(buf) >= seq_len:
            seq, buf = buf[:seq_len], buf[seq_len:]
            yield seq, consumed, buf


class TokenStream:
    """Packed training or validation sequences for one process, with a resumable position."""

    def __init__(self, data: DataRecipe, tokenizer, split: str = "train", rank: int = 0, world: int = 1):
        self.data, self.tok, self.split, self.rank, self.world = data, tokenizer, split, rank, world
        self.eos = tokenizer.eos_token_id if tokenizer is not None else None
        self.state = {"epoch": 0, "docs": 0, "carry": [], "sequences": 0}
        self._it = None
        if data.source == "memmap":
            self._tokens = memmap_tokens(data.val_data_files if split == "val" and data.val_data_files else data.data_files,
                                         data.token_dtype)
        else:
            self.docs = Documents(data, split, rank, world)

    # -- documents -> tokens -> sequences
    def _tokenize(self, texts):
        for text in texts:
            yield self.tok(text, add_special_tokens=False)["input_ids"] + [self.eos]

    def _sequences(self):
        if self.data.source == "memmap":
            yield from self._memmap_sequences()
            return
        while True:
            s = self.state
            texts = self.docs.iterate(epoch=s["epoch"], skip=s["docs"])
            base, produced = s["docs"], False
            for seq, consumed, carry in pack(self._tokenize(texts), self.data.seq_len, s["carry"]):
                produced = True
                s["docs"], s["carry"] = base + consumed, carry
                s["sequences"] += 1
                yield seq
            if self.split == "val":
                return
            if not produced and s["docs"] == base:
                raise ValueError(
                    f"the training stream of process {self.rank} has no documents left for a sequence of "
                    f"{self.data.seq_len} tokens; give more data or lower `data.seq_len`"
                )
            s["epoch"], s["docs"] = s["epoch"] + 1, 0  # another pass (the carry continues across it)

    def _memmap_sequences(self):
        n = len(self._tokens) // self.data.seq_len
        held = 0 if self.data.val_data_files else min(self.data.val_sequences, n // 2)
        idx = np.arange(n - held, n) if self.split == "val" else np.arange(0, n - held)
        if len(idx) == 0:
            raise UserError(f"the memmap files ({_where(self.data)}) hold {len(self._tokens)} tokens: not one {self.split} "
                            f"sequence of `data.seq_len`={self.data.seq_len}; give more tokens or lower `data.seq_len`")
        while True:
            s = self.state
            order = idx if self.split == "val" else np.random.default_rng(self.data.shuffle_seed + s["epoch"]).permutation(idx)
            order = order[self.rank :: self.world]
            for i in order[s["docs"] :]:
                s["docs"] += 1
                s["sequences"] += 1
                yield self._tokens[i * self.data.seq_len : (i + 1) * self.data.seq_len].astype(np.int64).tolist()
            if self.split == "val":
                return
            s["epoch"], s["docs"] = s["epoch"] + 1, 0

    def next_batch(self, batch_size: int) -> torch.Tensor:
        if self._it is None:
            self._it = self._sequences()
        rows = []
        for _ in range(batch_size):
            try:
                rows.append(next(self._it))
            except StopIteration:
                raise UserError(f"the {self.split} stream ({_where(self.data)}) ran out of sequences of "
                                f"`data.seq_len`={self.data.seq_len} tokens: give more data or lower the length") from None
        return torch.tensor(rows, dtype=torch.long)

    def take(self, n: int) -> list[list[int]]:
        """Up to ``n`` sequences (validation: the fixed held-out set)."""
        out = []
        for seq in self._sequences():
            out.append(seq)
            if len(out) == n:
                break
        return out

    def state_dict(self) -> dict:
        return json.loads(json.dumps(self.state))

    def load_state_dict(self, state: dict) -> None:
        self.state = {**self.state, **state}
        self._it = None


def memmap_tokens(files: list[str], dtype: str = "uint16") -> np.ndarray:
    """Concatenated token files (``.npy`` with their own dtype, anything else raw ``dtype``), memory-mapped."""
    arrays = []
    for f in files:
        p = Path(f)
        if not p.is_file():
            raise UserError(f"`data.data_files` entry {f!r} does not exist (or is not a file)")
        if p.stat().st_size == 0:
            raise UserError(f"`data.data_files` entry {f!r} is empty: a memmap file holds pre-tokenized ids")
        hint = (f"a .npy must be a 1-D integer array (np.save), any other file raw `data.token_dtype`={dtype!r} ids")
        with reading(f, "`data.data_files` entry", hint):
            a = np.load(p, mmap_mode="r", allow_pickle=False) if p.suffix == ".npy" else np.memmap(p, dtype=dtype, mode="r")
        if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
            raise UserError(f"`data.data_files` entry {f!r} holds a {a.ndim}-D {a.dtype} array: {hint}")
        arrays.append(a)
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def validation_set(data: DataRecipe, tokenizer, rank: int = 0, world: int = 1) -> torch.Tensor:
    """The fixed held-out sequences (``val_sequences`` of them) this process evaluates: every ``world``-th."""
    seqs = TokenStream(data, tokenizer, "val").take(data.val_sequences)
    if not seqs:
        raise UserError(f"the validation stream ({_where(data)}) holds no sequence of `data.seq_len`={data.seq_len} "
                        "tokens: check the data files are not empty, raise `data.val_docs` or give `data.val_data_files`")
    mine = seqs[rank::world]
    return torch.tensor(mine, dtype=torch.long) if mine else torch.empty(0, data.seq_len, dtype=torch.long)
