"""``hf-depth convert-olmo-core SRC OUT``: a DepthBench / OLMo-core checkpoint to an hf_depth folder."""

from __future__ import annotations

import argparse
import os
import sys

import torch

from ..errors import command
from ..models.registry import DESIGNS
from ..utils import parse_set_items
from .checkpoints import load_state_dict, save_converted
from .infer import _design_name, _fields_of, _olmo_json_fields, all_backends, block_types, refuse_to_guess
from .mapping import olmo_core_to_hf_depth


def _check_set_fields(design: str, fields: dict) -> None:
    """``--set`` names a field of the design (did-you-mean otherwise)."""
    import difflib

    from ..models.configuration_depth import _describe, _type_ok, depth_fields, transformers_names

    name = _design_name(design, fields)
    annotations = depth_fields(DESIGNS[name].config_class)
    for k, v in fields.items():
        if k not in annotations and k not in transformers_names():
            close = difflib.get_close_matches(k, sorted(annotations), n=1, cutoff=0.7)
            hint = f" (did you mean `{close[0]}`?)" if close else f"; the design's fields: {sorted(annotations)}"
            raise ValueError(f"`--set {k}=...`: `{k}` is not a config field of design {name!r}{hint}")
        if k in annotations and _type_ok(v, annotations[k]) is False:
            raise ValueError(f"`--set {k}=...`: `{k}` must be {_describe(annotations[k])}, got {v!r}")


def _main(argv: list[str] | None = None) -> int:
    from ..errors import arg_number, read_json, reading, replaceable_output

    p = argparse.ArgumentParser(prog="hf-depth convert-olmo-core",
                                description="DepthBench / OLMo-core checkpoints <-> hf_depth.")
    p.add_argument("src", help="OLMo-core state dict: .pt / .safetensors file, or a folder (also a DCP folder)")
    p.add_argument("out", help="output folder (save_pretrained)")
    p.add_argument("--design", help=f"DepthBench block type {list(block_types())} or hf_depth design; "
                   "default: the block name in --config")
    p.add_argument("--config", help="OLMo-core config JSON (default: SRC/config.json when present)")
    p.add_argument("--mhc-backend", choices=all_backends(), help="mHC parameter layout (default: detected)")
    p.add_argument("--attnres-block-size", type=arg_number(int, 1), help="AttnRes block size S in sublayers (1 = Full)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="dtype of the saved weights")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="an hf_depth config field, e.g. --set num_attention_heads=16 (JSON values)")
    p.add_argument("--max-shard-size", default="5GB")
    a = p.parse_args(argv)

    fields: dict = {}
    cfg_path = a.config or (os.path.join(a.src, "config.json") if os.path.isdir(a.src) else None)
    block_name = None
    if cfg_path and (a.config or os.path.exists(cfg_path)):  # an explicit --config must exist
        cfg = read_json(cfg_path, "OLMo-core config")
        with reading(cfg_path, "OLMo-core config", "give OLMo-core's config.json (model.block... fields)"):
            block_name, fields = _olmo_json_fields(cfg, a.design)
    mhc_backend = a.mhc_backend or fields.pop("mhc_backend", None)
    sinkhorn_tau = fields.pop("sinkhorn_tau", 1.0)
    if a.attnres_block_size is not None:
        fields["attnres_block_size"] = a.attnres_block_size
    try:
        fields.update(parse_set_items(a.set))
    except ValueError as e:
        p.error(str(e))
    design = a.design or block_name
    if design is None:
        p.error("--design is required (no block name in a config JSON)")
    _check_set_fields(design, {k: v for k, v in fields.items() if k in {i.split("=", 1)[0].strip() for i in a.set}})
    replaceable_output(a.out, "out", protect=[a.src])
    with reading(a.src, "the OLMo-core checkpoint", "give a .pt/.safetensors state dict, or a (distributed) "
                 "checkpoint folder; a truncated file: re-save or re-download it"):
        sd = load_state_dict(a.src)
    try:
        name = _design_name(design, fields)
        if "attnres_block_size" not in _fields_of(DESIGNS[name].config_class):  # the flag of another design
            fields.pop("attnres_block_size", None)
        refuse_to_guess(design, fields, how="--set FIELD=VALUE")
        dtype = getattr(torch, a.dtype) if a.dtype else None
        model = olmo_core_to_hf_depth(sd, design, mhc_backend=mhc_backend, sinkhorn_tau=sinkhorn_tau, dtype=dtype,
                                      **fields)
    except ValueError as e:
        print(f"hf-depth convert-olmo-core: {e}", file=sys.stderr)
        return 2
    with reading(a.max_shard_size, "`--max-shard-size`", "give a size such as 5GB or 500MB"):
        from transformers.utils.hub import convert_file_size_to_int

        convert_file_size_to_int(a.max_shard_size)
    save_converted(model, a.out, src=a.src, max_shard_size=a.max_shard_size)
    n = sum(p.numel() for p in model.parameters())
    print(f"converted {len(sd)} tensors ({n:,} parameters) -> {type(model).__name__} in {a.out}")
    return 0


main = command("convert-olmo-core", _main, "exit 0 converted, 2 bad input (one line, see ``hf_depth.errors``).")

if __name__ == "__main__":
    sys.exit(main())
