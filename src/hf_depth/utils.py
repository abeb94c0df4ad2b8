"""Small helpers shared across hf_depth's subpackages."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

DROP = object()
"""Returned by a ``flatten_dict`` leaf function to leave that leaf out."""


def flatten_dict(d: dict, leaf: Callable[[Any], Any] = lambda v: v, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` -> ``{"a.b": leaf(1)}``; leaves for which ``leaf`` returns ``DROP`` are left out."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten_dict(v, leaf, f"{prefix}{k}."))
        elif (value := leaf(v)) is not DROP:
            out[f"{prefix}{k}"] = value
    return out


def parse_set_items(items: list[str]) -> dict:
    """``--set FIELD=VALUE`` items as a dict: each VALUE is JSON (``2``, ``1e-5``, ``true``, ``null``, ``[1, 2]``),
    else the raw string. A malformed item raises ``ValueError`` naming it."""
    import json

    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set takes FIELD=VALUE (e.g. --set hc_streams=2), got {item!r}")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


def temporary_sibling(path) -> Path:
    """Where ``path`` is written before it is renamed into place: ``name.tmp.ext`` beside it (the suffix kept, so a
    writer that picks the format from it still can)."""
    path = Path(path)
    return path.with_name(f"{path.stem}.tmp{path.suffix}")


def replace_path(tmp, path) -> None:
    """Rename ``tmp`` to ``path``, replacing a file or a whole folder there."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    os.replace(tmp, path)


@contextmanager
def atomic_path(path):
    """Write a file or folder atomically: yields a temporary sibling to write to, renamed to ``path`` when the block
    succeeds and removed when it fails, so that ``path`` is either the old or the complete new content."""
    tmp = temporary_sibling(path)
    _remove(tmp)
    try:
        yield tmp
    except BaseException:
        _remove(tmp)
        raise
    replace_path(tmp, path)


def write_text_atomic(path, text: str) -> Path:
    """``path.write_text(text)``, atomically (see :func:`atomic_path`)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def next_token_nll(logits, input_ids, mask=None) -> tuple[float, int]:
    """Summed next-token cross entropy (fp32) and its count, over the positions whose input and target are both real
    tokens (``mask`` [B, T]: 1 for a real token; ``None``: all real). ``logits`` [B, T, V] predict ``input_ids``
    shifted by one."""
    import torch.nn.functional as F

    targets = input_ids[:, 1:]
    nll = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                          reduction="none").view_as(targets)
    if mask is not None:
        nll = nll[mask[:, 1:].bool() & mask[:, :-1].bool()]
    return float(nll.sum()), int(nll.numel())
