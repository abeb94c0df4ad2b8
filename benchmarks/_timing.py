"""Timing helpers shared by the benchmark scripts (never used by tests)."""

from __future__ import annotations

import time

import torch


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def best_time(fn, device, repeats: int, warmup: int = 1) -> float:
    """Best wall time of ``fn()`` over ``repeats`` calls, after ``warmup`` calls, with device syncs."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t)
    return best
