"""The closeness table of docs/upcycling.md: fp32 max |delta logits| and KL of ``hf_depth.upcycle`` per source
family x design, on the tiny random configs of the tests (L = 2, d = 32, GQA 4/2 heads, T = 8, random norms and
biases, Llama with ``attention_bias``; nothing downloaded).

    python benchmarks/upcycle_table.py
"""

from __future__ import annotations

import pathlib
import sys

import torch

import hf_depth

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from test_upcycle import UPCYCLED, ids, source  # noqa: E402


def main() -> None:
    designs = sorted(hf_depth.DESIGNS)
    print("| design | expected | " + " | ".join(UPCYCLED) + " |")
    print("|---|---|" + "---|" * len(UPCYCLED))
    for design in designs:
        cells, expected = [], "?"
        for family in UPCYCLED:
            src = source(family, attention_bias=True) if family == "llama" else source(family)
            try:
                _, rep = hf_depth.upcycle(src, design, sample=ids(), verbose=False)
            except ValueError as e:  # a refusal names what is missing
                cells.append(f"refused: {str(e)[:60]}")
                continue
            expected = rep.expected
            cells.append(f"{rep.max_abs_logit_diff:.1e}" + (f" (KL {rep.kl:.1e})" if rep.expected != "exact" else ""))
        print(f"| {design} | {expected} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
