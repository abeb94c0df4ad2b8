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


def add_shape_args(parser, hidden=256, layers=4, heads=8, vocab=8192, seq=256, batch=4, repeats=5) -> None:
    """The model/batch shape options every benchmark takes."""
    parser.add_argument("--hidden", type=int, default=hidden)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--heads", type=int, default=heads)
    parser.add_argument("--vocab", type=int, default=vocab)
    parser.add_argument("--seq", type=int, default=seq)
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--repeats", type=int, default=repeats)


def interleaved_median(fns: dict, device, rounds: int, warmup: int = 1) -> dict:
    """Median wall time of each fn over ``rounds`` rounds, one call of every fn per round (interleaved, so that
    they share the machine's state), after ``warmup`` calls of each."""
    import statistics

    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            sync(device)
            t = time.perf_counter()
            fn()
            sync(device)
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}
