"""The depth-cost benchmark's schedule and tables (no timing is asserted: benchmarks are never timed tests)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    try:
        import bench_depth_cost
    finally:
        sys.path.remove(str(BENCH))
    return bench_depth_cost


def recording(names):
    calls = []
    return calls, {n: (lambda n=n: calls.append(n)) for n in names}


@pytest.mark.parametrize("round_robin", [False, True])
def test_every_timed_step_follows_a_step_of_its_own_model(bench, round_robin):
    calls, fns = recording(["base", "a", "b"])
    ratios, base_t, faults = bench.paired_ratios(fns, "base", torch.device("cpu"), 3, round_robin)
    pair = {k: [k, k] for k in fns}
    one_at_a_time = [c for k in ("a", "b") for _ in range(3) for c in pair["base"] + pair[k]]
    every_round = [c for _ in range(3) for k in ("a", "b") for c in pair["base"] + pair[k]]
    assert calls == (every_round if round_robin else one_at_a_time)
    assert set(ratios) == {"a", "b"} and base_t > 0
    assert all(0 < q1 <= med <= q3 for q1, med, q3 in ratios.values())
    assert set(faults) == {"base", "a", "b"}
    assert all(f is None or (isinstance(f, int) and f >= 0) for f in faults.values())


def test_minor_faults_count_first_touches(bench):
    before = bench.minor_faults()
    if before is None:
        pytest.skip("no resource module on this OS")
    buf = torch.empty(64 << 20, dtype=torch.uint8)  # 64 MB: mmapped fresh, its pages touched by the fill
    buf.fill_(1)
    assert bench.minor_faults() - before >= 16  # 16384 with 4 KB pages, 32 with 2 MB huge pages


def test_tables_print_the_schedule_and_faults(bench, capsys):
    bench.main(["--designs", "pre_ln", "hc", "--layers", "1", "2", "--mem-hidden", "32", "--mem-seq", "8",
                "--time-layers", "2", "--hidden", "32", "--seq", "8", "--vocab", "64", "--rounds", "2",
                "--gen-layers", "1", "--new-tokens", "2"])
    out = capsys.readouterr().out
    assert "interquartile range of 2 paired ratios, one design at a time; faults: minor page faults of one step" in out
    assert "| design | L=2 | IQR L=2 | FLOP floor L=2 | faults/step L=2 |" in out
    assert "| hc | saved <= 1.35 at every L |" in out
    assert "greedy generation time / Pre-LN" in out and "one design at a time)" in out


def test_quartiles_are_the_median_and_its_spread(bench):
    assert bench.quartiles([1.3]) == (1.3, 1.3, 1.3)
    values = [1.10, 1.30, 1.20, 1.50, 1.25]
    q1, med, q3 = bench.quartiles(values)
    assert med == pytest.approx(1.25) and (q1, q3) == (pytest.approx(1.20), pytest.approx(1.30))


@pytest.mark.parametrize("rounds", ["0", "-2"])
def test_rounds_below_one_is_refused_before_any_model(bench, capsys, rounds):
    with pytest.raises(SystemExit):
        bench.main(["--rounds", rounds])
    err = capsys.readouterr().err
    assert f"--rounds: must be at least 1 (paired ratios per design), got {rounds}" in err


def test_marginal_splits_each_time_into_a_fixed_part_and_a_part_per_token(bench):
    # Pre-LN 100 ms + 2 ms per token, the design 130 ms + 2.5 ms per token: the two points give back both lines
    base, design = (lambda T: 0.100 + 0.002 * T), (lambda T: 0.130 + 0.0025 * T)
    ratio, fixed = bench.marginal(design(128), design(32), base(128), base(32), 128, 32)
    assert ratio == pytest.approx(1.25) and fixed == pytest.approx(0.030)
    assert bench.marginal(base(128), base(32), base(128), base(32), 128, 32) == (pytest.approx(1.0), pytest.approx(0.0))
    assert bench.line(base(128), base(32), 128, 32) == (pytest.approx(0.100), pytest.approx(0.002))


def test_marginal_columns_come_from_a_second_shorter_run(bench, capsys):
    bench.main(["--designs", "pre_ln", "hc", "--skip-memory", "--time-layers", "2", "--hidden", "32", "--seq", "8",
                "--vocab", "64", "--rounds", "1", "--gen-layers", "--marginal-seq", "4"])
    out = capsys.readouterr().out
    assert "| design | L=2 | IQR L=2 | FLOP floor L=2 | faults/step L=2 | marginal L=2 | fixed L=2 |" in out
    assert "from a second run at T=4)" in out
    row = next(line for line in out.splitlines() if line.startswith("| hc |"))
    assert row.split("|")[-2].strip().endswith(" ms")


@pytest.mark.parametrize("seq", ["0", "8", "9"])
def test_marginal_seq_outside_one_to_seq_is_refused(bench, capsys, seq):
    with pytest.raises(SystemExit):
        bench.main(["--seq", "8", "--marginal-seq", seq])
    assert f"--marginal-seq: must be between 1 and --seq - 1 = 7 (a second, shorter sequence length), got {seq}" in (
        capsys.readouterr().err)


def test_the_first_line_names_the_allocator_settings(bench):
    assert bench.allocator_env({}) == "default"
    env = {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1", "PATH": "/bin", "LD_PRELOAD": ""}
    assert bench.allocator_env(env) == "GLIBC_TUNABLES=glibc.malloc.trim_threshold=1"


def test_a_time_target_inside_the_spread_says_so(bench):
    """A timed target inside the IQR of its paired ratios is marked as decided by this run's median only; outside it,
    and for the (deterministic) memory targets, the verdict is plain."""
    times = {("mhc", 32): (1.24, 1.2512, 1.27), ("hc", 32): (1.15, 1.19, 1.20), ("moda", 32): (1.35, 1.38, 1.40),
             ("block_attnres", 32): (1.12, 1.14, 1.15)}
    out = bench.targets(["pre_ln", "mhc", "hc", "moda", "block_attnres"], [8], {}, times)
    assert "| mhc | time L=32 <= 1.25 | 1.251 (IQR 1.24-1.27) | FAIL, within the IQR |" in out
    assert "| hc | time L=32 <= 1.25 | 1.190 (IQR 1.15-1.20) | PASS |" in out
    assert "| moda | time L=32 <= 1.30 | 1.380 (IQR 1.35-1.40) | FAIL |" in out
    assert "| block_attnres | time L=32 <= 1.15 | 1.140 (IQR 1.12-1.15) | PASS, within the IQR |" in out
    mem = {(n, L): r for n, r in (("pre_ln", 1.0), ("hc", 1.22)) for L in (8, 64)}
    out = bench.targets(["pre_ln", "hc"], [8, 64], mem, {})
    assert "| hc | saved <= 1.35 at every L | 1.22 | PASS |" in out
    assert "| hc | saved L=64 <= 1.05 x L=8 | 1.22 vs 1.28 | PASS |" in out
