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
* ``"output_norm_only"`` -- the scale-vector paper's Figure 3 arm "no wd: Input-Norm": Output-Norm scale vectors
  decayed, Input-Norm ones never; everything else as DepthBench. With ``depthbench`` (decay every gamma), ``iwd``
  (Input-Norm only) and ``no_norm_decay`` these are the paper's four weight-decay arms.

``make_optimizer(..., optimizer="muon")`` trains every 2-D weight matrix of the blocks with ``torch.optim.Muon``
(``adjust_lr_fn="match_rms_adamw"``, so one learning rate serves both) and the rest -- 1-D tensors, the input
embedding and the LM head -- with AdamW, as the scale-vector paper's Muon runs (Figure 8) do.

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

POLICIES = ("iwd", "depthbench", "no_norm_decay", "output_norm_only")
OPTIMIZERS = ("adamw", "muon")
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
    if policy == "output_norm_only":
        return role != "input_norm"
    return role not in ("input_norm", "output_norm", "bias") and param.dim() >= 2


def build_param_groups(model: nn.Module, policy: str, weight_decay: float,
                       new_params: set[str] | frozenset[str] = frozenset()) -> list[dict]:
    """AdamW groups, one per (role, decay, new): dicts with ``params``, ``weight_decay``, ``names``, ``role``,
    ``new`` (the parameter is in ``new_params``: newly initialized, e.g. by ``model.init_from``).

    Only trainable parameters are included (a PEFT model's frozen base is left out).
    """
    _check_policy(policy)
    if not isinstance(weight_decay, (int, float)) or isinstance(weight_decay, bool) or weight_decay < 0:
        raise ValueError(f"`weight_decay` must be a non-negative number, got {weight_decay!r}")
    roles = parameter_roles(model)
    groups: dict[tuple[str, float, bool], dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        role = roles[name]
        wd = float(weight_decay) if decays(policy, role, p) else 0.0
        new = name in new_params
        g = groups.setdefault((role, wd, new), {"params": [], "weight_decay": wd, "names": [], "role": role, "new": new})
        g["params"].append(p)
        g["names"].append(name)

    def order(key):
        role, wd, new = key
        return (new, _ROLE_ORDER.index(role) if role in _ROLE_ORDER else len(_ROLE_ORDER), role, -wd)

    return [groups[k] for k in sorted(groups, key=order)]


def _patterns(names: list[str], limit: int = 4) -> str:
    """``model.layers.*.input_layernorm.weight x24, ...``: names with layer indices folded."""
    counts = Counter(re.sub(r"\.\d+\.", ".*.", n) for n in names)
    items = [f"{k} x{v}" if v > 1 else k for k, v in counts.items()]
    more = f", ... (+{len(items) - limit} patterns)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def describe_param_groups(groups: list[dict]) -> str:
    """A table of the groups (role, weight decay, tensors, parameters, names) to print at the start of training."""
    header = f"{'role':<21} {'decay':>7} {'tensors':>8} {'params':>13}  names"
    rows = [header, "-" * len(header)]
    total = decayed = 0
    for g in groups:
        n = sum(p.numel() for p in g["params"])
        total += n
        decayed += n if g["weight_decay"] > 0 else 0
        role = g["role"] + (" (new)" if g.get("new") else "")
        rows.append(f"{role:<21} {g['weight_decay']:>7g} {len(g['params']):>8} {n:>13,}  {_patterns(g['names'])}")
    rows.append(f"{'total':<21} {'':>7} {sum(len(g['params']) for g in groups):>8} {total:>13,}  "
                f"({decayed:,} decayed, {total - decayed:,} not)")
    return "\n".join(rows)


class MuonAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` on the groups in ``muon_groups`` and AdamW on ``adamw_groups``, stepped together.

    ``param_groups`` are the two optimizers' own group dicts (setting a group's ``lr`` reaches the optimizer that
    owns it); ``state_dict`` holds both states."""

    def __init__(self, muon_groups: list[dict], adamw_groups: list[dict], lr: float, betas=(0.9, 0.95),
                 eps: float = 1e-8, momentum: float = 0.95):
        if not hasattr(torch.optim, "Muon"):
            raise ValueError(f"`optimizer` 'muon' needs torch.optim.Muon (torch >= 2.9), this is torch {torch.__version__}")
        self.muon = torch.optim.Muon(muon_groups, lr=lr, momentum=momentum, adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW(adamw_groups, lr=lr, betas=betas, eps=eps)
        super().__init__([p for g in (*muon_groups, *adamw_groups) for p in g["params"]], {"lr": lr})
        self.param_groups = self.muon.param_groups + self.adamw.param_groups

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def state_dict(self):
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict):
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])


def _split_for_muon(model: nn.Module, groups: list[dict]) -> tuple[list[dict], list[dict]]:
    """Each group -> its 2-D block matrices (Muon) and the rest (AdamW: 1-D, input embedding, LM head)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    skip = {id(head.weight)} if head is not None else set()
    muon, adamw = [], []
    for g in groups:
        for target, keep in ((muon, True), (adamw, False)):
            sel = [(p, n) for p, n in zip(g["params"], g["names"])
                   if (g["role"] == "matrix" and p.dim() == 2 and id(p) not in skip) == keep]
            if sel:
                target.append({**g, "params": [p for p, _ in sel], "names": [n for _, n in sel],
                               "optimizer": "muon" if keep else "adamw"})
    return muon, adamw


def make_optimizer(
    model: nn.Module,
    lr: float,
    weight_decay: float = 0.1,
    policy: str = "depthbench",
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    optimizer: str = "adamw",
    new_params: set[str] | frozenset[str] = frozenset(),
    **adamw_kwargs,
) -> torch.optim.Optimizer:
    """AdamW over :func:`build_param_groups` (extra keyword arguments go to ``torch.optim.AdamW``), or with
    ``optimizer="muon"`` a :class:`MuonAdamW` over the same groups; ``new_params`` get groups of their own."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"`optimizer` must be one of {list(OPTIMIZERS)}, got {optimizer!r}")
    groups = build_param_groups(model, policy, weight_decay, new_params)
    if optimizer == "muon":
        muon, adamw = _split_for_muon(model, groups)
        return MuonAdamW(muon, adamw, lr=lr, betas=betas, eps=eps)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **adamw_kwargs)
