"""The multi-process parts of the training loop: agreement across ranks, FSDP2 sharding, sharded checkpoints.

``train.parallel: ddp`` (the default) is accelerate's data parallelism (``accelerate launch`` / ``torchrun``; one
process runs plainly). ``train.parallel: fsdp2`` shards every decoder layer and then the root with torch's own
``fully_shard``, applied here rather than through accelerate's FSDP plugin, which accelerate only enables on
accelerator devices: the same code runs on CPU (gloo) and GPU (nccl). Its checkpoints are
``torch.distributed.checkpoint`` folders keyed by parameter name (model and optimizer), which DCP reshards on
load, so a run saved at one world size resumes at another; with ``memmap`` data the stream position is global
(the global order of sequences does not depend on the world size) and is re-split over the new processes.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

SHARDED_DIR = "model_and_optim"  # the DCP folder inside checkpoints/step_N


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def ranks_where(flag: bool, device) -> list[int]:
    """The ranks on which ``flag`` is true, the same list on every rank (so that all stop together: no hang)."""
    if not initialized():
        return [0] if flag else []
    t = torch.zeros(dist.get_world_size(), device=device)
    t[dist.get_rank()] = 1.0 if flag else 0.0
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return [r for r, v in enumerate(t.tolist()) if v]


def mean_over_ranks(value: float, device) -> float:
    """The mean of a per-rank scalar (each rank's loss is a mean over the same number of tokens)."""
    if not initialized():
        return float(value)
    t = torch.tensor([float(value)], device=device, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return (t / dist.get_world_size()).item()


def full_value(x) -> float:
    """A scalar that may be a DTensor (FSDP2's grad norm) as a Python float."""
    if hasattr(x, "full_tensor"):
        x = x.full_tensor()
    return float(x)


def shard(model):
    """FSDP2: ``fully_shard`` each decoder layer, then the root (embedding, head, final norm, design parameters
    outside the layers). Needs an initialized process group; a single process is left as it is.

    ``fully_shard`` refuses 0-d parameters (HC's gate scales): they stay replicated, outside FSDP, and a hook
    averages their gradients over the ranks as soon as each is accumulated (DDP's rule for them)."""
    if not initialized() or dist.get_world_size() == 1:
        return model
    from torch.distributed.fsdp import fully_shard

    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"`train.parallel: fsdp2` cannot find the decoder layers of {type(model).__name__}")
    scalars = {p for p in model.parameters() if p.dim() == 0}
    for layer in layers:
        fully_shard(layer, ignored_params=scalars)
    fully_shard(model, ignored_params=scalars)
    world = dist.get_world_size()

    def average(param):
        dist.all_reduce(param.grad)
        param.grad.div_(world)

    for p in scalars:
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(average)
    return model


def save_sharded(model, optimizer, folder: Path) -> None:
    """Model and optimizer state as a DCP folder (every rank writes its shards; collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder / SHARDED_DIR))


def load_sharded(model, optimizer, folder: Path) -> None:
    """Load a DCP folder written by :func:`save_sharded` at any world size into this (sharded or plain) model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = folder / SHARDED_DIR
    if not path.is_dir():
        raise ValueError(f"checkpoint {str(folder)!r} has no sharded `{SHARDED_DIR}/` folder: it was not written by a "
                         "`train.parallel: fsdp2` run (resume it with the parallel mode it was saved with)")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def full_state_dict(model) -> dict:
    """The unsharded model state (collective; every rank gets it on CPU)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def reshard_data_state(states: list[dict], world: int, rank: int, source: str) -> dict:
    """This process's stream position when resuming ``states`` (one per saved process) at ``world`` processes.

    Same world size: the saved state of this rank. Another world size: only ``memmap`` streams, whose global order
    of sequences does not depend on the world size (rank r reads every world-th sequence of one permutation), so
    the global position is the sum of the per-rank positions and is split evenly again."""
    if len(states) == world:
        return states[rank]
    if source != "memmap":
        raise ValueError(
            f"the checkpoint was written by {len(states)} process(es) and this run has {world}: a `{source}` stream "
            "is sharded by document and cannot be re-split; resume with the same number of processes, or use "
            "`data.source: memmap` (a global order that does not depend on the world size)")
    epochs = {s["epoch"] for s in states}
    if len(epochs) != 1:
        raise ValueError(f"the saved processes are in different epochs {sorted(epochs)}: cannot re-split the stream")
    consumed = sum(s["docs"] for s in states)
    if consumed % world:
        raise ValueError(f"the saved position ({consumed} sequences) does not split over {world} processes")
    return {**states[0], "epoch": epochs.pop(), "docs": consumed // world,
            "sequences": sum(s["sequences"] for s in states) // world}
