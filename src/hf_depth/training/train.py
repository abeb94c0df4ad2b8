"""Pretrain one design from a recipe: the whole loop, in one file.

    hf-depth train recipes/train/tiny_cpu.yaml [model.hidden_size=256 optim.lr=1e-3 ...] [--resume]
    accelerate launch -m hf_depth.training.train recipes/train/depthbench_400m/pre_ln_L24.yaml

AdamW(0.9, 0.95, eps 1e-8) with the recipe's weight-decay policy, cosine with linear warmup (10%) down to 10% of
the peak, grad clip 1.0, gradient accumulation, bf16 autocast on GPU (fp32 on CPU), a token budget of 20
tokens per parameter unless the recipe says otherwise. The run folder holds the resolved recipe, version, git
sha and environment (``run.json``), metrics (``metrics.jsonl``), atomic checkpoints (``checkpoints/step_N``,
last ``keep_last`` kept) with model, optimizer, RNG states and the data position, and ``final/`` (a
``save_pretrained`` folder with the tokenizer) plus ``summary.json`` when done.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from ..utils import flatten_dict
from . import distributed
from .data import TokenStream, load_tokenizer, validation_set
from .optim import describe_param_groups, make_optimizer
from .recipe import Recipe, load_recipe, model_config


class Diverged(RuntimeError):
    """A non-finite loss: the run stops and keeps its last good checkpoint."""


# ---------------------------------------------------------------------------------------------- pieces
def lr_at(step: int, total_steps: int, peak: float, warmup_frac: float = 0.1, final_frac: float = 0.1) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup, then cosine from peak to final_frac*peak."""
    warmup = max(1, math.ceil(warmup_frac * total_steps)) if warmup_frac > 0 else 0
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def lm_loss(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of packed sequences (the model shifts the labels)."""
    return model(input_ids=input_ids, labels=input_ids).loss


def git_sha() -> str | None:
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=here, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if sha.returncode != 0:
        return None
    return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def environment(accelerator) -> dict:
    import accelerate
    import datasets
    import transformers

    return {
        "python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
        "transformers": transformers.__version__, "accelerate": accelerate.__version__, "datasets": datasets.__version__,
        "device": str(accelerator.device), "num_processes": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type), "mixed_precision": accelerator.mixed_precision,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "argv": sys.argv,
    }


def checkpoints(run_dir: Path) -> list[Path]:
    found = [p for p in (run_dir / "checkpoints").glob("step_*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def save_checkpoint(accelerator, run_dir: Path, step: int, trainer_state: dict, data_state: dict, keep_last: int,
                    sharded: tuple | None = None):
    """Write ``checkpoints/step_N`` atomically: everything goes to a temporary folder that is renamed at the end.

    ``sharded=(model, optimizer)`` (FSDP2) writes model and optimizer as a DCP folder instead of accelerate's
    full-state files; the RNG states are per process in both cases."""
    final = run_dir / "checkpoints" / f"step_{step:08d}"
    tmp = final.with_name(final.name + ".tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    if sharded is not None:
        distributed.save_sharded(*sharded, tmp)
    accelerator.save_state(str(tmp))  # model and optimizer (when prepared), RNG states (per process)
    (tmp / f"data_state_{accelerator.process_index}.json").write_text(json.dumps(data_state))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def _reset_accelerate() -> None:
    """Several runs in one process (sweeps, tests): forget the previous Accelerator's singletons."""
    from accelerate.state import AcceleratorState, GradientState

    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


@torch.no_grad()
def evaluate(accelerator, model, val: torch.Tensor, batch_size: int, max_batches: int | None = None) -> float:
    """Mean token loss over this process's held-out sequences, averaged over all processes."""
    model.eval()
    total = torch.zeros(2, device=accelerator.device, dtype=torch.float64)
    for i, start in enumerate(range(0, len(val), batch_size)):
        if max_batches is not None and i >= max_batches:
            break
        x = val[start : start + batch_size].to(accelerator.device)
        with accelerator.autocast():
            loss = lm_loss(model, x)
        total += torch.tensor([loss.item() * len(x), len(x)], device=accelerator.device, dtype=torch.float64)
    total = accelerator.reduce(total, reduction="sum")
    model.train()
    return (total[0] / total[1].clamp_min(1)).item()


def plan(recipe: Recipe, n_params: int, world: int) -> dict:
    t = recipe.train
    tokens_per_step = t.micro_batch_size * t.grad_accum * world * recipe.data.seq_len
    budget = t.max_tokens if t.max_tokens is not None else int(t.tokens_per_param * n_params)
    steps = t.max_steps if t.max_steps is not None else max(1, math.ceil(budget / tokens_per_step))
    return {"params": n_params, "tokens_per_step": tokens_per_step, "steps": steps, "tokens": steps * tokens_per_step}


# ---------------------------------------------------------------------------------------------- the loop
def run(recipe: Recipe, resume: bool = False, stop_after: int | None = None) -> dict:
    """Train ``recipe``; returns the run summary. ``stop_after`` ends the process-level loop early (as a crash
    would), leaving the checkpoints for ``resume=True``."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from ..shapes import count_params

    t, o = recipe.train, recipe.optim
    run_dir = recipe.resolved_run_dir
    mixed = t.mixed_precision if t.mixed_precision != "auto" else ("bf16" if torch.cuda.is_available() else "no")
    trackers = [name for name in t.trackers if _installed(name)]
    _reset_accelerate()
    accelerator = Accelerator(
        mixed_precision=mixed, gradient_accumulation_steps=t.grad_accum, cpu=not torch.cuda.is_available(),
        log_with=trackers or None, project_dir=str(run_dir),
    )
    main_proc = accelerator.is_main_process
    say = accelerator.print
    if run_dir.exists() and checkpoints(run_dir) and not resume:
        raise ValueError(f"run folder {str(run_dir)!r} already has checkpoints: pass --resume, or a new `run_dir`")
    if main_proc:
        run_dir.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()

    # tokenizer, model, optimizer
    tokenizer = load_tokenizer(recipe.data, run_dir if main_proc else None)
    accelerator.wait_for_everyone()
    if not main_proc:
        tokenizer = load_tokenizer(recipe.data, run_dir)
    config = model_config(recipe, vocab_size=len(tokenizer))
    config.eos_token_id, config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    set_seed(t.seed)
    import hf_depth

    model = hf_depth.MODEL_CLASSES[config.design][1](config)
    fsdp = t.parallel == "fsdp2"
    if fsdp:  # shard before the optimizer is built, so that it holds the sharded parameters
        model = distributed.shard(model.to(accelerator.device))
    n_params = count_params(config)
    p = plan(recipe, n_params, accelerator.num_processes)
    optimizer = make_optimizer(model, lr=o.lr, weight_decay=o.weight_decay, policy=o.policy,
                               betas=(o.beta1, o.beta2), eps=o.eps)
    for g in optimizer.param_groups:
        g.setdefault("lr_scale", g["lr"] / o.lr)  # the policy may scale a group's learning rate
    say(f"[hf-depth] {recipe.name}: {config.design} L={config.num_hidden_layers} d={config.hidden_size} "
        f"params={n_params:,} steps={p['steps']} tokens={p['tokens']:,} ({p['tokens'] / n_params:.1f}/param) "
        f"precision={mixed} processes={accelerator.num_processes}")
    say(f"[hf-depth] optimizer groups (policy={o.policy}):\n{describe_param_groups(optimizer.param_groups)}")
    if t.compile:
        model = torch.compile(model)
    if not fsdp:  # FSDP2 modules are already distributed: accelerate would wrap them in DDP
        model, optimizer = accelerator.prepare(model, optimizer)

    train_stream = TokenStream(recipe.data, tokenizer, "train", accelerator.process_index, accelerator.num_processes)
    val = validation_set(recipe.data, tokenizer, accelerator.process_index, accelerator.num_processes)

    # run folder bookkeeping / resume
    metrics_path = run_dir / "metrics.jsonl"
    step, tokens_seen, best_val = 0, 0, float("inf")
    if resume and checkpoints(run_dir):
        ckpt = checkpoints(run_dir)[-1]
        state = json.loads((ckpt / "trainer_state.json").read_text())
        saved = [json.loads((ckpt / f"data_state_{r}.json").read_text())
                 for r in range(state.get("processes", accelerator.num_processes))]
        train_stream.load_state_dict(distributed.reshard_data_state(
            saved, accelerator.num_processes, accelerator.process_index, recipe.data.source))
        if fsdp:
            distributed.load_sharded(model, optimizer, ckpt)
        if len(saved) == accelerator.num_processes:
            accelerator.load_state(str(ckpt))
        elif fsdp:  # weights and optimizer are world-size free; the RNG streams are one per saved process
            say(f"[hf-depth] checkpoint written by {len(saved)} process(es), resumed by {accelerator.num_processes}: "
                "weights, optimizer and data position restored; per-process RNG states are not")
        else:
            raise ValueError(f"checkpoint {str(ckpt)!r} was written by {len(saved)} process(es) and this run has "
                             f"{accelerator.num_processes}: resume a `train.parallel: ddp` run with the same number "
                             "of processes, or train with `train.parallel: fsdp2` (sharded, world-size free checkpoints)")
        step, tokens_seen, best_val = state["step"], state["tokens"], state["best_val_loss"]
        if main_proc and metrics_path.exists():  # drop what was logged after the checkpoint
            rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
            metrics_path.write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] <= step))
        say(f"[hf-depth] resumed from {ckpt} at step {step}")
    elif main_proc:
        metrics_path.write_text("")
    if main_proc:
        (run_dir / "recipe.yaml").write_text(recipe.to_yaml())
        meta = {"version": hf_depth.__version__, "git_sha": git_sha(), "environment": environment(accelerator),
                "plan": p, "design": config.design, "config": config.to_dict(), "resumed_at": step if resume else None}
        (run_dir / "run.json").write_text(json.dumps(meta, indent=1, default=str))
    if trackers:
        accelerator.init_trackers(recipe.name.replace("/", "_"), config=_flat(recipe.to_dict()))

    def log(row: dict):
        if main_proc:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")
        if trackers:
            accelerator.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    def checkpoint():
        trainer_state = {"step": step, "tokens": tokens_seen, "best_val_loss": best_val, "plan": p,
                         "processes": accelerator.num_processes, "parallel": t.parallel}
        save_checkpoint(accelerator, run_dir, step, trainer_state, train_stream.state_dict(), t.keep_last,
                        sharded=(model, optimizer) if fsdp else None)

    bar = None
    if main_proc and t.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=p["steps"], initial=step, desc=recipe.name, unit="step", dynamic_ncols=True)
    status, message, tps, val_loss = "finished", "", 0.0, None
    window_start, window_tokens = time.perf_counter(), 0
    model.train()
    while step < p["steps"]:
        if stop_after is not None and step >= stop_after:
            status = "interrupted"
            break
        lr = lr_at(step, p["steps"], o.lr, o.warmup_frac, o.final_lr_frac)
        for g in optimizer.param_groups:
            g["lr"] = lr * g["lr_scale"]
        loss_sum = 0.0
        for _ in range(t.grad_accum):
            x = train_stream.next_batch(t.micro_batch_size).to(accelerator.device)
            with accelerator.accumulate(model):
                loss = lm_loss(model, x)
                bad = distributed.ranks_where(not torch.isfinite(loss.detach()).all(), accelerator.device)
                if bad:  # every rank sees the same list, so all stop here together
                    status = "diverged"
                    last = checkpoints(run_dir)
                    message = (f"non-finite loss at step {step + 1} on rank(s) {bad}: stopped; the last good "
                               f"checkpoint is {last[-1] if last else 'none (no step was saved)'}")
                    break
                accelerator.backward(loss)
                grad_norm = None
                if accelerator.sync_gradients and o.grad_clip > 0:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), o.grad_clip)
                if accelerator.sync_gradients:  # a prepared optimizer skips the others itself; a sharded one not
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.item() / t.grad_accum
        if status == "diverged":
            break
        loss_sum = distributed.mean_over_ranks(loss_sum, accelerator.device)  # the global batch's loss
        step += 1
        tokens_seen += p["tokens_per_step"]
        window_tokens += p["tokens_per_step"]
        row = {"step": step, "tokens": tokens_seen, "loss": loss_sum, "lr": lr}
        if grad_norm is not None:
            row["grad_norm"] = distributed.full_value(grad_norm)
        tps = window_tokens / max(time.perf_counter() - window_start, 1e-9)
        if step % t.log_every == 0 or step == p["steps"]:
            row["tokens_per_s"] = tps
            window_start, window_tokens = time.perf_counter(), 0
        if step % t.eval_every == 0 or step == p["steps"]:
            val_loss = evaluate(accelerator, model, val, t.micro_batch_size, t.eval_batches)
            best_val = min(best_val, val_loss)
            row["val_loss"] = val_loss
        log(row)
        if bar is not None:
            bar.set_postfix(loss=f"{loss_sum:.3f}", tok_s=f"{tps:,.0f}", lr=f"{lr:.2e}", refresh=False)
            bar.update(1)
        if step % t.save_every == 0 or step == p["steps"]:
            checkpoint()
    if bar is not None:
        bar.close()

    summary = {
        "name": recipe.name, "status": status, "design": config.design, "num_hidden_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size, "aspect_ratio": config.hidden_size / config.num_hidden_layers,
        "params": n_params, "lr": o.lr, "steps": step, "tokens": tokens_seen, "final_loss": None,
        "final_val_loss": val_loss, "best_val_loss": best_val if math.isfinite(best_val) else None,
        "tokens_per_s": tps, "message": message,
    }
    if status == "diverged":
        say(f"[hf-depth] ERROR: {message}")
    elif status == "finished":
        accelerator.wait_for_everyone()
        state_dict = distributed.full_state_dict(model) if fsdp else accelerator.get_state_dict(model)
        if main_proc:
            final = run_dir / "final"
            accelerator.unwrap_model(model).save_pretrained(final, state_dict=state_dict)
            tokenizer.save_pretrained(final)
    if main_proc and status != "interrupted":
        rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
        summary["final_loss"] = rows[-1]["loss"] if rows else None
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    if trackers:
        accelerator.end_training()
    accelerator.wait_for_everyone()
    return summary


def _installed(tracker: str) -> bool:
    import importlib.util

    module = {"tensorboard": "tensorboard", "wandb": "wandb"}[tracker]
    if importlib.util.find_spec(module) is None:
        print(f"[hf-depth] tracker {tracker!r} requested but {module} is not installed: skipped", file=sys.stderr)
        return False
    return True


def _flat(d: dict) -> dict:
    """Recipe dict -> flat tracker config (non-scalar values as strings)."""
    return flatten_dict(d, lambda v: v if isinstance(v, (int, float, str, bool)) else str(v))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hf-depth train", description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", help="recipe YAML (see recipes/train/)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.hidden_size=256 optim.lr=1e-3")
    ap.add_argument("--resume", action="store_true", help="continue from the run folder's last checkpoint")
    a = ap.parse_intermixed_args(argv)  # overrides may come after options
    try:
        recipe = load_recipe(a.recipe, a.overrides)
    except ValueError as e:
        print(f"hf-depth train: bad recipe: {e}", file=sys.stderr)
        return 2
    summary = run(recipe, resume=a.resume)
    if summary["status"] == "diverged":
        print(f"hf-depth train: {summary['message']}", file=sys.stderr)
        return 1
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({k: summary[k] for k in ("name", "status", "steps", "tokens", "final_loss", "best_val_loss",
                                                   "tokens_per_s")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
