"""Parameter overhead of each scale-vector variant on the DepthBench L=24, d=1024 Pre-LN shape (markdown table).

    PYTHONPATH=src python benchmarks/scale_vector_table.py
"""

from hf_depth import shapes

VARIANTS = ["standard", "none", "HG", "AP", "DP", "DNP", "OR", "ER", "HG+DP", "HG+DNP", "best", "HG+DNP+ER"]


def main(design: str = "pre_ln", hidden: int = 1024, layers: int = 24) -> None:
    def count(sv):
        return shapes.count_params(shapes.make_config(design, hidden, layers, scale_vector=sv))

    base, none = count("standard"), count("none")
    print("| scale_vector | params | vs standard | scale-vector params | fraction of total |")
    print("|---|---:|---:|---:|---:|")
    for sv in VARIANTS:
        n = count(sv)
        label = "best (HG+DNP+OR)" if sv == "best" else sv
        print(f"| {label} | {n:,} | {n - base:+,} | {n - none:,} | {(n - none) / n:.3e} |")


if __name__ == "__main__":
    main()
