"""Small helpers shared across hf_depth's subpackages."""

from __future__ import annotations

from collections.abc import Callable
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
