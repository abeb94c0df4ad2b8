"""Stand-in for ``hf_depth.training.optim`` (written on another branch) while it is not merged.

Same API. Only the ``depthbench`` policy (weight decay on every parameter, as DepthBench's OLMo-core recipe) is
implemented; the other policies raise, naming the module that provides them. Delete this file once
``optim.py`` is on main: ``train.py`` imports it only when ``hf_depth.training.optim`` is missing.
"""

from __future__ import annotations

import torch

POLICIES = ("depthbench",)


def build_param_groups(model: torch.nn.Module, policy: str = "depthbench", weight_decay: float = 0.1) -> list[dict]:
    if policy not in POLICIES:
        raise ValueError(
            f"`policy` must be one of {list(POLICIES)} without hf_depth.training.optim (IWD lives there), got {policy!r}"
        )
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": params, "weight_decay": weight_decay, "name": "all"}]


def describe_param_groups(groups: list[dict]) -> str:
    return "\n".join(
        f"  {g.get('name', i)}: {len(g['params'])} tensors, {sum(p.numel() for p in g['params']):,} params, "
        f"weight_decay={g['weight_decay']}"
        for i, g in enumerate(groups)
    )


def make_optimizer(model, lr, weight_decay=0.1, policy="depthbench", betas=(0.9, 0.95), eps=1e-8):
    groups = build_param_groups(model, policy, weight_decay)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)
