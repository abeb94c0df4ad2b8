"""Reading OLMo-core / DepthBench checkpoints (.pt / .safetensors files, folders, torch.distributed checkpoint
folders) and writing converted hf_depth folders."""

from __future__ import annotations

import os
import tempfile

import torch

from ..utils import DROP, atomic_path, flatten_dict

_STRIP_PREFIXES = ("model.", "module.")
_STRIP_INFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.")


def strip_prefixes(sd: dict) -> dict:
    """Drop ``torch.compile`` / activation-checkpointing infixes and a trainer-state prefix common to every key."""
    out = {}
    for k, v in sd.items():
        for inf in _STRIP_INFIXES:
            k = k.replace(inf, "")
        out[k] = v
    for p in _STRIP_PREFIXES:
        if out and all(k.startswith(p) for k in out):
            out = {k[len(p):]: v for k, v in out.items()}
    return out


def _load_dcp(path: str) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "sd.pt")
        dcp_to_torch_save(path, out)
        sd = torch.load(out, map_location="cpu", weights_only=True)
    return sd


def _flatten(d: dict) -> dict:
    """Nested state dict -> flat ``{"a.b": tensor}`` (non-tensor entries such as step counters dropped)."""
    return flatten_dict(d, lambda v: v if isinstance(v, torch.Tensor) else DROP)


def load_state_dict(src: str) -> dict:
    """Load an OLMo-core state dict from a .pt/.bin file, a .safetensors file, a folder holding either (sharded
    safetensors included), or a torch.distributed checkpoint folder (``.metadata``; optimizer state ignored)."""
    if os.path.isdir(src):
        if os.path.exists(os.path.join(src, ".metadata")):
            sd = _flatten(_load_dcp(src))
            model_keys = {k[len("model."):]: v for k, v in sd.items() if k.startswith("model.")}
            return model_keys or sd
        for sub in ("model_and_optim", "model"):
            if os.path.exists(os.path.join(src, sub, ".metadata")):
                return load_state_dict(os.path.join(src, sub))
        files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
        if not files:
            files = sorted(f for f in os.listdir(src) if f.endswith((".pt", ".bin", ".pth")))
        if not files:
            raise ValueError(f"no .safetensors/.pt/.bin file or .metadata (distributed checkpoint) in {src!r}")
        sd = {}
        for f in files:
            sd.update(load_state_dict(os.path.join(src, f)))
        return sd
    if src.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(src)
    obj = torch.load(src, map_location="cpu", weights_only=True)
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
        obj = obj["model"]
    if not isinstance(obj, dict):
        raise ValueError(f"{src!r} does not hold a state dict")
    return _flatten(obj)


def save_converted(model, out: str, src: str | None = None, max_shard_size: str = "5GB") -> None:
    """Write a converted model as a ``save_pretrained`` folder with its conversion model card, atomically (``out``
    is replaced only once the folder is complete)."""
    from ..hub import write_conversion_card

    with atomic_path(out.rstrip("/")) as tmp:
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        write_conversion_card(tmp, model, model.olmo_core_source, src=src)
