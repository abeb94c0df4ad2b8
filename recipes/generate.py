"""Generate the recipe YAMLs under recipes/train/ (recipes are data; this script is how they are made).

    PYTHONPATH=src python recipes/generate.py            # rewrites recipes/train/{depthbench_400m,...}/

DepthBench's suites use ONE shape table shared by every design (its launchers pass the same
``configs/llama_*.json`` to every architecture); the tables below are DepthBench's ``configs/README.md``
(keyu-wang-2002/DepthBench@f807aa279d04ffd6d08bc3d9f2c3a97985a1e980), and each recipe's header records the table
and row it comes from. Budgets are DepthBench's fixed step counts (global batch 512 x 2048 tokens, ~1M tokens per
step; 10% warmup; cosine to 10%). Learning rates: DepthBench Table 4 (2e-3; LNS 1e-2; DeepNorm 1e-3), 5e-4 for
every 1.6B model. The global batch is written for one GPU (``micro_batch_size x grad_accum`` = 512); on 8 GPUs pass
``train.grad_accum=4`` (``=8`` at 1.6B).

The scale-vector paper's arms (``scale_vector/``) are described in docs/protocol.md with what is and is not
published: shapes other than Llama-1B's and tuned LRs other than 0.12B's are hf_depth's choices, said so in the
recipe headers.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from hf_depth.models.registry import DESIGNS
from hf_depth.shapes import count_params, make_config

ROOT = Path(__file__).resolve().parent / "train"
SOURCE = "DepthBench configs/README.md @f807aa27"
DEPTHBENCH_DESIGNS = ("pre_ln", "sandwich_ln", "lns", "deepnorm", "keel", "hc", "mhc", "attnres", "block_attnres", "moda")
WIDER_RANGE = ("pre_ln", "hc", "attnres")  # DepthBench Figures 2 (right) and 3: the designs of the extra suites

# (config, layers, hidden, intermediate) per table of DepthBench's configs/README.md
TABLES = {
    "400M: fixed total size": [
        ("llama_400m_L16", 16, 1216, 3248), ("llama_400m_L20", 20, 1120, 2992), ("llama_400m_L24", 24, 1024, 2736),
        ("llama_400m_L28", 28, 960, 2560), ("llama_400m_L32", 32, 896, 2400), ("llama_400m_L42", 42, 800, 2144),
        ("llama_400m_L70", 70, 640, 1712)],
    "300M backbone: fixed backbone size": [
        ("llama_300m_backbone_L16", 16, 1248, 3328), ("llama_300m_backbone_L24", 24, 1024, 2736),
        ("llama_300m_backbone_L32", 32, 896, 2400), ("llama_300m_backbone_L42", 42, 768, 2048),
        ("llama_300m_backbone_L70", 70, 608, 1632), ("llama_300m_backbone_L84", 84, 544, 1456)],
    "Depth scaling ladder": [
        ("llama_200m_L24", 24, 672, 1792), ("llama_200m_L18", 18, 768, 2048), ("llama_200m_L12", 12, 896, 2400),
        ("llama_300m_L28", 28, 800, 2144), ("llama_300m_L21", 21, 896, 2400), ("llama_300m_L14", 14, 1056, 2816),
        ("llama_400m_L32", 32, 896, 2400), ("llama_400m_L24", 24, 1024, 2736), ("llama_400m_L16", 16, 1216, 3248),
        ("llama_500m_L34", 34, 992, 2656), ("llama_500m_L26", 26, 1120, 2992), ("llama_500m_L17", 17, 1344, 3584)],
    "1.6B": [("llama_1600m_L28", 28, 2048, 6144), ("llama_1600m_L40", 40, 1728, 5184),
             ("llama_1600m_L54", 54, 1504, 4512)],
}
STEPS = {"200m": 3800, "300m": 5700, "400m": 7600, "500m": 9500, "1600m": 30400}  # README "Training budgets"
MAIN_DEPTHS = (16, 20, 24, 28, 32)  # all ten designs; L42 / L70 for WIDER_RANGE only (Figure 2, right)

DATA = {"source": "hf", "path": "HuggingFaceFW/fineweb-edu", "name": "sample-10BT", "text_field": "text",
        "tokenizer": "EleutherAI/gpt-neox-20b", "seq_len": 2048, "val_docs": 2000, "val_sequences": 512}
TRAIN = {"micro_batch_size": 16, "grad_accum": 32, "seed": 42, "mixed_precision": "auto",
         "eval_every": 500, "eval_batches": 32, "save_every": 500, "keep_last": 2, "log_every": 10,
         "trackers": ["tensorboard"]}


def tier(config: str) -> str:
    return config.split("_")[1]


def default_ffn(d: int) -> int:
    return make_config("pre_ln", d, 1).intermediate_size  # ceil16(8d/3), DepthBench's rule


def recipe(name: str, design: str, L: int, d: int, lr: float, steps: int | None = None, **model) -> dict:
    if model.get("intermediate_size") == default_ffn(d):
        del model["intermediate_size"]  # derived from d (so a sweep over widths keeps DepthBench's rule)
    train = dict(TRAIN)
    if steps is not None:
        train = {"max_steps": steps, **train}
    else:
        train = {"tokens_per_param": 20, **train}
    return {"name": name, "run_dir": "runs/{name}",
            "model": {"design": design, "hidden_size": d, "num_hidden_layers": L, "num_attention_heads": 16,
                      "vocab_size": 50280, "max_position_embeddings": 4096, **model},
            "data": dict(DATA), "optim": {"lr": lr, "weight_decay": 0.1, "policy": "depthbench"}, "train": train}


def write(folder: str, r: dict, source: str, note: str = "") -> None:
    path = ROOT / folder / f"{r['name']}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    if r["model"]["design"] not in DESIGNS:
        note = (note + "; " if note else "") + f"design {r['model']['design']!r} not registered when generated"
    header = "# generated by recipes/generate.py; do not edit by hand\n" f"# source: {source}\n"
    header += f"# NOTE: {note}\n" if note else ""
    path.write_text(header + yaml.safe_dump(r, sort_keys=False))


def depthbench(n: int = 0) -> int:
    for table, folder in (("400M: fixed total size", "depthbench_400m"),
                          ("300M backbone: fixed backbone size", "iso_backbone_300m"),
                          ("Depth scaling ladder", "multiscale"), ("1.6B", "1.6b")):
        for config, L, d, f in TABLES[table]:
            if table == "400M: fixed total size":
                designs = DEPTHBENCH_DESIGNS if L in MAIN_DEPTHS else WIDER_RANGE
            else:
                designs = WIDER_RANGE
            for design in designs:
                gqa = {"num_key_value_heads": 8} if table == "1.6B" else {}
                lr = 5e-4 if table == "1.6B" else DESIGNS[design].lr  # Design.lr: DepthBench Table 4
                name = f"{design}_L{L}" if folder != "multiscale" else f"{design}_{tier(config)}_L{L}"
                r = recipe(name, design, L, d, lr, STEPS[tier(config)], intermediate_size=f, **gqa)
                if table == "1.6B":
                    r["train"]["micro_batch_size"], r["train"]["grad_accum"] = 8, 64
                write(folder, r, f"{SOURCE}, table '{table}', row {config}.json")
                n += 1
    for L, d, f in ((16, 1216, 3248), (24, 1024, 2736), (32, 896, 2400)):  # HiRes on the 400M shapes (not in DepthBench)
        write("hires", recipe(f"hires_L{L}", "hires", L, d, 2e-3, STEPS["400m"], intermediate_size=f),
              f"{SOURCE}, table '400M: fixed total size', row llama_400m_L{L}.json",
              "HiRes is not part of DepthBench: its default outer width on DepthBench's shape")
        n += 1
    return n


# ------------------------------------------------------------------------------------ the scale-vector paper's arms
SV_SOURCE = "scale-vector paper (arXiv 2605.26895) summary, docs/seeds; docs/protocol.md"
SV_DATA = dict(DATA, path="HuggingFaceFW/fineweb-edu", tokenizer="EleutherAI/gpt-neox-20b")
# dense ladder: (name, L, d, peak LR). Llama-1B is the paper's (L22, d1792, V50304, d_ff floor(8d/3) = 4778:
# 1,028,065,024 parameters); 0.12B's tuned LR 4e-3 is the paper's; the other shapes and LRs are hf_depth's choices.
LADDER = [("0.12b", 12, 640, 4e-3), ("0.25b", 16, 896, 3e-3), ("0.5b", 20, 1280, 2e-3), ("0.75b", 22, 1536, 1.5e-3),
          ("1b", 22, 1792, 1e-3)]
SV_VOCAB = 50304


def sv_recipe(name: str, L: int, d: int, lr: float, scale_vector: str, design: str = "pre_ln", policy: str = "iwd",
              tokens_per_param: float = 100, **optim) -> dict:
    r = {"name": name, "run_dir": "runs/{name}",
         "model": {"design": design, "hidden_size": d, "num_hidden_layers": L, "num_attention_heads": 16,
                   "vocab_size": SV_VOCAB, "intermediate_size": (8 * d) // 3, "max_position_embeddings": 4096,
                   "scale_vector": scale_vector},
         "data": dict(SV_DATA),
         "optim": {"lr": lr, "weight_decay": 0.1, "policy": policy, "final_lr_frac": 0.05, **optim},
         "train": {"tokens_per_param": tokens_per_param, **TRAIN}}
    return r


def llama_large_ffn(L: int, d: int, target: int) -> int:
    """The FFN width whose standard Llama matches ``target`` parameters best (Figure 10's Llama-large)."""
    def total(f):
        return count_params(make_config("pre_ln", d, L, vocab_size=SV_VOCAB, intermediate_size=f))
    return min(range((8 * d) // 3, 4 * d), key=lambda f: abs(total(f) - target))


def scale_vector(n: int = 0) -> int:
    shape_note = "shape and LR are hf_depth's choice (the paper's Table 4 is not in the seeds)"
    for size, L, d, lr in LADDER:  # Figure 6: tuned Llama baseline vs the unified strategy, ~100 tokens/param
        note = "" if size in ("1b",) else shape_note
        note = "LR 4e-3 is the paper's; shape is hf_depth's choice" if size == "0.12b" else note
        note = note or "Llama-1B shape is the paper's (1,028,065,024 params); LR is hf_depth's choice"
        for sv, policy in (("standard", "depthbench"), ("best", "iwd")):
            write("scale_vector", sv_recipe(f"dense_{size}_{sv}", L, d, lr, sv, policy=policy),
                  f"{SV_SOURCE}: Figure 6 dense ladder", note)
            n += 1
    # Figure 3: the four weight-decay arms on a Gemma-like model (Sandwich norms give Output-Norm scale vectors)
    for tokens, budget in ((20, "10b"), (100, "50b")):
        for policy in ("depthbench", "iwd", "output_norm_only", "no_norm_decay"):
            r = sv_recipe(f"wd_{policy}_0.5b_{budget}", 20, 1280, 2e-3, "standard", design="sandwich_ln",
                          policy=policy, tokens_per_param=tokens)
            write("scale_vector", r, f"{SV_SOURCE}: Figure 3 weight-decay arms ({budget} tokens)",
                  "Gemma-0.5B approximated by hf_depth's sandwich_ln at d1280/L20 (Output-Norm gammas present)")
            n += 1
    # Figure 8 (Muon, AdamW for 1-D and embeddings) and Figure 9 (WSD) at 0.12B and 0.5B
    for size, L, d, lr in (LADDER[0], LADDER[2]):
        for sv, policy in (("standard", "depthbench"), ("best", "iwd")):
            write("scale_vector", sv_recipe(f"muon_{size}_{sv}", L, d, lr, sv, policy=policy, optimizer="muon"),
                  f"{SV_SOURCE}: Figure 8 Muon", shape_note)
            write("scale_vector", sv_recipe(f"wsd_{size}_{sv}", L, d, lr, sv, policy=policy, schedule="wsd",
                                            decay_frac=0.2), f"{SV_SOURCE}: Figure 9 WSD", shape_note)
            n += 2
    # Figure 10: the unified strategy vs a Llama whose FFN is widened to the same parameter count
    size, L, d, lr = LADDER[0]
    best = count_params(make_config("pre_ln", d, L, vocab_size=SV_VOCAB, intermediate_size=(8 * d) // 3,
                                    scale_vector="best"))
    f = llama_large_ffn(L, d, best)
    r = sv_recipe(f"llama_large_{size}", L, d, lr, "standard", policy="depthbench")
    r["model"]["intermediate_size"] = f
    write("scale_vector", r, f"{SV_SOURCE}: Figure 10 parameter-matched Llama-large",
          f"d_ff {f} matches dense_{size}_best's {best:,} parameters")
    n += 1
    for sv in ("standard", "HG", "HG+DNP", "HG+DNP+OR", "HG+OR"):  # Figure 5 step by step, on DepthBench's L24 shape
        r = recipe(f"pre_ln_L24_{sv.replace('+', '_').lower()}", "pre_ln", 24, 1024, 2e-3, STEPS["400m"],
                   intermediate_size=2736, scale_vector=sv)
        r["optim"]["policy"] = "iwd"
        write("scale_vector", r, f"{SV_SOURCE}: Figure 5 step-by-step, on {SOURCE} row llama_400m_L24.json")
        n += 1
    return n


def main() -> int:
    for folder in ("depthbench_400m", "iso_backbone_300m", "multiscale", "1.6b", "hires", "scale_vector"):
        for old in (ROOT / folder).glob("*.yaml"):
            old.unlink()
    n = depthbench() + scale_vector()
    print(f"wrote {n} recipes under {ROOT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
