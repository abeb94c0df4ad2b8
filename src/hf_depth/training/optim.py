"""AdamW parameter groups by parameter role (the weight-decay policies of DepthBench, the scale-vector paper, nanoGPT).

Roles come from :func:`hf_depth.models.norms.parameter_roles` (norms, scale vectors, matrices, embeddings, and
design parameters through a module's ``param_roles``). A policy maps a role (and, for nanoGPT, the tensor rank)
to decayed or not:

* ``"iwd"`` -- Individual Weight Decay (scale-vector paper): Input-Norm scale vectors decayed, Output-Norm ones
  never (QK-norm, post-projection scales, the output norms of Sandwich/KEEL/Post-LN/DeepNorm); matrices and
  embeddings decayed as in DepthBench; HC/mHC static routing not decayed.
* ``"depthbench"`` -- DepthBench's protocol: every parameter at ``weight_decay`` except HC/mHC static routing.
* ``"no_norm_decay"`` -- nanoGPT: no decay on any norm / scale vector / bias (nor on any other 1-D tensor, nor on
  static routing); >=2-D tensors decayed.

    groups = build_param_groups(model, "iwd", 0.1)
    print(describe_param_groups(groups))
    opt = make_optimizer(model, lr=2e-3, weight_decay=0.1, policy="iwd")
"""

from __future__ import annotations

import re
from collections import Counter

import torch
from torch import nn

from ..models.norms import parameter_roles

POLICIES = ("iwd", "depthbench", "no_norm_decay")
_ROLE_ORDER = ("matrix", "embedding", "bias", "input_norm", "output_norm", "routing_static", "design")
_NEVER_DECAYED = ("routing_static",)


def _check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"`policy` must be one of {list(POLICIES)}, got {policy!r}")


def decays(policy: str, role: str, param: torch.Tensor) -> bool:
    """Whether ``policy`` applies weight decay to a parameter of ``role``."""
    _check_policy(policy)
    if role in _NEVER_DECAYED:
        return False
    if policy == "depthbench":
        return True
    if policy == "iwd":
        return role != "output_norm"
    return role not in ("input_norm", "output_norm", "bias") and param.dim() >= 2


def build_param_groups(model: nn.Module, policy: str, weight_decay: float) -> list[dict]:
    """AdamW groups, one per (role, decay): dicts with ``params``, ``weight_decay``, ``names``, ``role``.

    Only trainable parameters are included (a PEFT model's frozen base is left out).
    """
    _check_policy(policy)
    if not isinstance(weight_decay, (int, float)) or isinstance(weight_decay, bool) or weight_decay < 0:
        raise ValueError(f"`weight_decay` must be a non-negative number, got {weight_decay!r}")
    roles = parameter_roles(model)
    groups: dict[tuple[str, float], dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        role = roles[name]
        wd = float(weight_decay) if decays(policy, role, p) else 0.0
        g = groups.setdefault((role, wd), {"params": [], "weight_decay": wd, "names": [], "role": role})
        g["params"].append(p)
        g["names"].append(name)

    def order(key):
        role, wd = key
        return (_ROLE_ORDER.index(role) if role in _ROLE_ORDER else len(_ROLE_ORDER), role, -wd)

    return [groups[k] for k in sorted(groups, key=order)]


def _patterns(names: list[str], limit: int = 4) -> str:
    """``model.layers.*.input_layernorm.weight x24, ...``: names with layer indices folded."""
    counts = Counter(re.sub(r"\.\d+\.", ".*.", n) for n in names)
    items = [f"{k} x{v}" if v > 1 else k for k, v in counts.items()]
    more = f", ... (+{len(items) - limit} patterns)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def describe_param_groups(groups: list[dict]) -> str:
    """A table of the groups (role, weight decay, tensors, parameters, names) to print at the start of training."""
    header = f"{'role':<15} {'decay':>7} {'tensors':>8} {'params':>13}  names"
    rows = [header, "-" * len(header)]
    total = decayed = 0
    for g in groups:
        n = sum(p.numel() for p in g["params"])
        total += n
        decayed += n if g["weight_decay"] > 0 else 0
        rows.append(f"{g['role']:<15} {g['weight_decay']:>7g} {len(g['params']):>8} {n:>13,}  {_patterns(g['names'])}")
    rows.append(f"{'total':<15} {'':>7} {sum(len(g['params']) for g in groups):>8} {total:>13,}  "
                f"({decayed:,} decayed, {total - decayed:,} not)")
    return "\n".join(rows)


def make_optimizer(
    model: nn.Module,
    lr: float,
    weight_decay: float = 0.1,
    policy: str = "depthbench",
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    **adamw_kwargs,
) -> torch.optim.AdamW:
    """AdamW over :func:`build_param_groups` (extra keyword arguments go to ``torch.optim.AdamW``)."""
    groups = build_param_groups(model, policy, weight_decay)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **adamw_kwargs)
