"""Pretrain one design from a recipe: the whole loop, in one file.

    hf-depth train recipes/train/tiny_cpu.yaml [model.hidden_size=256 optim.lr=1e-3 ...] [--resume]
    accelerate launch -m hf_depth.training.train recipes/train/depthbench_400m/pre_ln_L24.yaml

AdamW(0.9, 0.95, eps 1e-8) with the recipe's weight-decay policy, cosine with linear warmup (10%) down to 10% of
the peak, grad clip 1.0, gradient accumulation, bf16 autocast on GPU (fp32 on CPU), a token budget of 20
tokens per parameter unless the recipe says otherwise. The run folder holds the resolved recipe, version, git
sha and environment (``run.json``), metrics (``metrics.jsonl``), atomic checkpoints (``checkpoints/step_N``,
last ``keep_last`` kept) with model, optimizer, RNG states and the data position, and ``final/`` (a
``save_pretrained`` folder with the tokenizer) plus ``summary.json`` when done.

Safety: one process owns a run folder for the run's life (an OS lock on ``RUN/.lock``; a second ``train`` or
``--resume`` on it refuses, naming the holder's PID). Nothing non-finite is ever saved: before a checkpoint or
``final/`` is written the parameters are checked (one fused norm) and so is the loss of one held-out batch with
them; a failure stops the run as ``diverged`` naming the last checkpoint that passed, which ``--resume`` (with a
lower ``optim.lr``) continues from. Resume drops a torn last line of ``metrics.jsonl`` (a kill mid-write), and
refuses a checkpoint whose RNG state cannot be restored unless ``--resume-ignore-rng``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import random
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

from ..errors import UserError, command, command_parser, reading
from ..utils import flatten_dict, replace_path, temporary_sibling
from . import distributed
from .data import TokenStream, load_tokenizer, validation_set
from .init_from import DIAGNOSTICS, init_config, load_init
from .init_from import diagnostics as init_diagnostics
from .optim import describe_param_groups, make_optimizer
from .recipe import Recipe, load_recipe, model_config
from .results import training_flops


class Diverged(RuntimeError):
    """A non-finite loss: the run stops and keeps its last good checkpoint."""


# ---------------------------------------------------------------------------------------------- run-folder safety
@contextlib.contextmanager
def run_folder_lock(run_dir: Path, enabled: bool = True):
    """Hold an exclusive OS lock on ``run_dir/.lock`` (with our PID in it) for the block; a second holder is
    refused with a UserError naming the PID that owns the folder. The lock dies with its process (kill -9 too)."""
    if not enabled:
        yield
        return
    import fcntl

    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / ".lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise UserError(f"run folder {str(run_dir)!r} is in use by process {holder} (another `hf-depth train` "
                            "or --resume): wait for it to end, stop it, or give this run another `run_dir`") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def read_metrics(path: Path, drop_torn: bool = False) -> list[dict]:
    """Rows of ``metrics.jsonl``. A line that is not JSON (a kill mid-write tears the last one) is dropped with a
    warning when ``drop_torn``; otherwise it is an error naming the file and line."""
    rows = []
    lines = path.read_text().splitlines() if path.exists() else []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError("not a metrics row")
        except ValueError:
            if not drop_torn:
                raise UserError(f"{str(path)!r} line {i + 1} is not a metrics row: {line[:80]!r}") from None
            warnings.warn(f"{path}: dropped line {i + 1} (torn or not a metrics row): {line[:80]!r}", stacklevel=2)
            continue
        rows.append(row)
    return rows


def params_finite(model) -> bool:
    """Whether every parameter (this rank's shards under FSDP2) is finite: one fused ``torch._foreach_norm``, one sync."""
    params = [p.detach() for p in model.parameters()]
    params = [p.to_local() if hasattr(p, "to_local") else p for p in params]  # FSDP2: this rank's shards
    if not params:
        return True
    norms = torch._foreach_norm(params) if hasattr(torch, "_foreach_norm") else [p.norm() for p in params]
    return bool(torch.isfinite(torch.stack([n.float().to(norms[0].device) for n in norms])).all())


def restore_rng(ckpt: Path, process_index: int, ignore: bool) -> None:
    """Restore the checkpoint's RNG states (python, numpy, torch, CUDA) or raise a UserError naming the file.

    accelerate's ``load_state`` skips an unreadable RNG file silently (a resumed run would then not be the
    uninterrupted one); here it is an error unless ``ignore`` (``--resume-ignore-rng``)."""
    import numpy as np
    from accelerate.utils import load

    path = ckpt / f"random_states_{process_index}.pkl"
    try:
        states = load(path, weights_only=True)
        random.setstate(states["random_state"])
        np.random.set_state(states["numpy_random_seed"])
        torch.set_rng_state(states["torch_manual_seed"])
        if torch.cuda.is_available() and "torch_cuda_manual_seed" in states:
            torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])
    except Exception as e:
        if ignore:
            warnings.warn(f"{path}: RNG state not restored ({type(e).__name__}); continuing (--resume-ignore-rng)",
                          stacklevel=2)
            return
        raise UserError(f"cannot restore the RNG state of checkpoint {str(ckpt)!r} from {path.name} "
                        f"({type(e).__name__}: {str(e)[:200]}): the resumed run would not match an uninterrupted one; "
                        "pass --resume-ignore-rng to continue anyway") from None


# ---------------------------------------------------------------------------------------------- pieces
def warmup_steps(total_steps: int, warmup_frac: float) -> int:
    """Optimizer steps of the linear warmup (at least one when ``warmup_frac`` > 0)."""
    return max(1, math.ceil(warmup_frac * total_steps)) if warmup_frac > 0 else 0


def lr_at(step: int, total_steps: int, peak: float, warmup_frac: float = 0.1, final_frac: float = 0.1,
          schedule: str = "cosine", decay_frac: float = 0.2) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup, then cosine from peak to final_frac*peak
    (``cosine``), or peak until the last ``decay_frac`` of the steps and a linear decay to final_frac*peak there
    (``wsd``, warmup-stable-decay)."""
    warmup = warmup_steps(total_steps, warmup_frac)
    if step < warmup:
        return peak * (step + 1) / warmup
    if schedule == "wsd":
        decay = max(1, math.ceil(decay_frac * total_steps)) if decay_frac > 0 else 0
        start = max(warmup, total_steps - decay)
        if step < start:
            return peak
        progress = min(1.0, (step - start + 1) / max(1, total_steps - start))
        return peak * (1 - (1 - final_frac) * progress)
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def group_lr(step: int, total_steps: int, optim, new: bool) -> float:
    """Learning rate (before the group's ``lr_scale``) of a group of new (``model.init_from``) or loaded parameters:
    with ``optim.warmup_new_params_only`` the loaded ones skip the warmup ramp (they start at its end)."""
    o = optim
    if not new and o.warmup_new_params_only:
        step = max(step, warmup_steps(total_steps, o.warmup_frac))
    return lr_at(step, total_steps, o.lr, o.warmup_frac, o.final_lr_frac, o.schedule, o.decay_frac)


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
    tmp = temporary_sibling(final)
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
        replace_path(tmp, final)
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
def run(recipe: Recipe, resume: bool = False, stop_after: int | None = None, ignore_rng: bool = False) -> dict:
    """Train ``recipe``; returns the run summary. ``stop_after`` ends the process-level loop early (as a crash
    would), leaving the checkpoints for ``resume=True``. The run folder is locked for the whole run."""
    main_proc = int(os.environ.get("RANK", "0")) == 0
    with run_folder_lock(recipe.resolved_run_dir, enabled=main_proc):
        return _run(recipe, resume, stop_after, ignore_rng)


def _run(recipe: Recipe, resume: bool, stop_after: int | None, ignore_rng: bool) -> dict:
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
        raise UserError(f"run folder {str(run_dir)!r} already has checkpoints: pass --resume, or a new `run_dir`")
    if main_proc:
        run_dir.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()

    # tokenizer, model, optimizer
    tokenizer = load_tokenizer(recipe.data, run_dir if main_proc else None)
    accelerator.wait_for_everyone()
    if not main_proc:
        tokenizer = load_tokenizer(recipe.data, run_dir)
    init_from, new_params, init_notes = recipe.model.init_from, [], []
    if init_from is not None:
        config, init_notes = init_config(recipe, len(tokenizer))
    else:
        config = model_config(recipe, vocab_size=len(tokenizer))
    if config.vocab_size < len(tokenizer):
        raise UserError(f"bad recipe: `model.vocab_size` ({config.vocab_size}) is smaller than the tokenizer's "
                        f"vocabulary ({len(tokenizer)} ids): raise it or leave it null (the tokenizer's size)")
    config.eos_token_id, config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    config.validate_token_range()
    set_seed(t.seed)
    import hf_depth

    model = hf_depth.MODEL_CLASSES[config.design][1](config)
    if init_from is not None:  # the folder's weights; the design's parameters it lacks stay at their init
        new_params, notes = load_init(model, init_from)
        init_notes += notes
        n_new = sum(p.numel() for n, p in model.named_parameters() if n in set(new_params))
        say(f"[hf-depth] init_from {init_from}: {n_new:,} new parameters at the design's init"
            + "".join(f"\n[hf-depth]   note: {n}" for n in init_notes))
    fsdp = t.parallel == "fsdp2"
    if fsdp:  # shard before the optimizer is built, so that it holds the sharded parameters
        model = distributed.shard(model.to(accelerator.device))
    n_params = count_params(config)
    p = plan(recipe, n_params, accelerator.num_processes)
    optimizer = make_optimizer(model, lr=o.lr, weight_decay=o.weight_decay, policy=o.policy,
                               betas=(o.beta1, o.beta2), eps=o.eps, optimizer=o.optimizer, new_params=set(new_params))
    for g in optimizer.param_groups:
        g.setdefault("lr_scale", g["lr"] / o.lr)  # the policy may scale a group's learning rate
        if g.get("new"):
            g["lr_scale"] *= o.new_param_lr_mult
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
    if init_from is not None and main_proc and not (resume and checkpoints(run_dir)):  # diagnostics before step 1
        (run_dir / DIAGNOSTICS).write_text(json.dumps({
            "init_from": init_from, "new_parameters": n_new, "sequences": min(8, len(val)), "notes": init_notes,
            "before": init_diagnostics(accelerator.unwrap_model(model), val)}, indent=1))

    # run folder bookkeeping / resume
    metrics_path = run_dir / "metrics.jsonl"
    step, tokens_seen, best_val = 0, 0, float("inf")
    if resume and checkpoints(run_dir):
        ckpt = checkpoints(run_dir)[-1]
        with reading(ckpt, "checkpoint", "resume from an earlier checkpoint (delete this one) or start a new run"):
            state = json.loads((ckpt / "trainer_state.json").read_text())
            saved = [json.loads((ckpt / f"data_state_{r}.json").read_text())
                     for r in range(int(state.get("processes", accelerator.num_processes)))]
            train_stream.load_state_dict(distributed.reshard_data_state(
                saved, accelerator.num_processes, accelerator.process_index, recipe.data.source))
            if fsdp:
                distributed.load_sharded(model, optimizer, ckpt)
            if len(saved) == accelerator.num_processes:
                accelerator.load_state(str(ckpt))
            step, tokens_seen, best_val = int(state["step"]), int(state["tokens"]), float(state["best_val_loss"])
        if len(saved) == accelerator.num_processes:
            restore_rng(ckpt, accelerator.process_index, ignore_rng)
        elif fsdp:  # weights and optimizer are world-size free; the RNG streams are one per saved process
            say(f"[hf-depth] checkpoint written by {len(saved)} process(es), resumed by {accelerator.num_processes}: "
                "weights, optimizer and data position restored; per-process RNG states are not")
        else:
            raise UserError(f"checkpoint {str(ckpt)!r} was written by {len(saved)} process(es) and this run has "
                            f"{accelerator.num_processes}: resume a `train.parallel: ddp` run with the same number "
                            "of processes, or train with `train.parallel: fsdp2` (sharded, world-size free checkpoints)")
        if main_proc and metrics_path.exists():  # drop what was logged after the checkpoint (and a torn line)
            rows = read_metrics(metrics_path, drop_torn=True)
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

    def last_good() -> str:
        found = checkpoints(run_dir)
        return str(found[-1]) if found else "none (no step was saved)"

    def unsaveable(evaluated_loss: float | None) -> str | None:
        """Why the current weights must not be saved (non-finite parameters, or a non-finite loss on one
        held-out batch with them), else None. Runs on every process (the reduce is collective)."""
        finite = torch.tensor(float(params_finite(model)), device=accelerator.device)
        if accelerator.reduce(finite, reduction="min").item() < 1:
            return "non-finite weights"
        if evaluated_loss is None:  # the loss of this step's batch was computed with the weights before it
            model.eval()
            with torch.no_grad(), accelerator.autocast():
                x = val[: t.micro_batch_size].to(accelerator.device)
                probe = model(input_ids=x, labels=x).loss.detach().float() if len(x) else torch.zeros(())
            model.train()
            probe = accelerator.reduce(probe.to(accelerator.device).reshape(1), reduction="sum")
            evaluated_loss = probe.item()
        if not math.isfinite(evaluated_loss):
            return f"a non-finite held-out loss ({evaluated_loss})"
        return None

    def stop_diverged(what: str) -> str:
        return (f"{what} at step {step}: stopped without saving them; the last good checkpoint is {last_good()} "
                f"(continue from it with a lower learning rate: hf-depth train RECIPE --resume optim.lr=...)")

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
        lr = group_lr(step, p["steps"], o, new=True)
        lr_loaded = group_lr(step, p["steps"], o, new=False)
        for g in optimizer.param_groups:
            g["lr"] = (lr if g.get("new") else lr_loaded) * g["lr_scale"]
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
                    # the update would poison every weight (fp16: the grad scaler skips such steps itself)
                    norm = distributed.full_value(grad_norm)
                    if mixed != "fp16" and not math.isfinite(norm):
                        status = "diverged"
                        message = (f"non-finite gradient norm ({norm}) at step {step + 1}: stopped before "
                                   f"the update; the last good checkpoint is {last_good()}")
                        break
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
        row = {"step": step, "tokens": tokens_seen, "loss": loss_sum, "lr": lr_loaded}
        if init_from is not None:  # the new parameters' own rate (warmup and multiplier), before policy scales
            row["lr_new"] = lr * o.new_param_lr_mult
        if grad_norm is not None:
            row["grad_norm"] = distributed.full_value(grad_norm)
        tps = window_tokens / max(time.perf_counter() - window_start, 1e-9)
        if step % t.log_every == 0 or step == p["steps"]:
            row["tokens_per_s"] = tps
            window_start, window_tokens = time.perf_counter(), 0
        evaluated = None
        if step % t.eval_every == 0 or step == p["steps"]:
            val_loss = evaluated = evaluate(accelerator, model, val, t.micro_batch_size, t.eval_batches)
            if math.isfinite(val_loss):
                best_val = min(best_val, val_loss)
            row["val_loss"] = val_loss
        log(row)
        if bar is not None:
            bar.set_postfix(loss=f"{loss_sum:.3f}", tok_s=f"{tps:,.0f}", lr=f"{lr:.2e}", refresh=False)
            bar.update(1)
        if step % t.save_every == 0 or step == p["steps"]:
            why = unsaveable(evaluated)
            if why is not None:
                status, message = "diverged", stop_diverged(why)
                break
            checkpoint()
    if bar is not None:
        bar.close()

    summary = {
        "name": recipe.name, "status": status, "design": config.design, "num_hidden_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size, "aspect_ratio": config.hidden_size / config.num_hidden_layers,
        "params": n_params, "lr": o.lr, "steps": step, "tokens": tokens_seen, "final_loss": None,
        "final_val_loss": val_loss, "best_val_loss": best_val if math.isfinite(best_val) else None,
        "tokens_per_s": tps, "message": message,
        "train_flops": training_flops(config, tokens_seen, recipe.data.seq_len),
        "scale_vector": recipe.model.scale_vector,
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
            if init_from is not None and (run_dir / DIAGNOSTICS).exists():  # before/after, for the model card
                upcycle_diag = json.loads((run_dir / DIAGNOSTICS).read_text())
                upcycle_diag["after"] = init_diagnostics(accelerator.unwrap_model(model), val)
                upcycle_diag["steps"] = step
                (run_dir / DIAGNOSTICS).write_text(json.dumps(upcycle_diag, indent=1))
    if main_proc and status != "interrupted":
        rows = read_metrics(metrics_path, drop_torn=True)
        summary["final_loss"] = rows[-1]["loss"] if rows else None
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        if status == "finished" and init_from is not None:
            from ..hub import write_model_card

            write_model_card(run_dir / "final", run_dir)  # with the before/after diagnostics of init_from
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


def _main(argv: list[str] | None = None) -> int:
    ap = command_parser("train", __doc__)
    ap.add_argument("recipe", help="recipe YAML (see recipes/train/)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.hidden_size=256 optim.lr=1e-3")
    ap.add_argument("--resume", action="store_true", help="continue from the run folder's last checkpoint")
    ap.add_argument("--resume-ignore-rng", action="store_true",
                    help="resume even if the checkpoint's RNG state cannot be restored (not reproducible)")
    a = ap.parse_intermixed_args(argv)  # overrides may come after options
    if a.resume_ignore_rng and not a.resume:
        ap.error("--resume-ignore-rng only applies with --resume")
    try:
        recipe = load_recipe(a.recipe, a.overrides)
    except ValueError as e:
        raise UserError(f"bad recipe: {e}") from e
    summary = run(recipe, resume=a.resume, ignore_rng=a.resume_ignore_rng)
    if summary["status"] == "diverged":
        print(f"hf-depth train: {summary['message']}", file=sys.stderr)
        return 1
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({k: summary[k] for k in ("name", "status", "steps", "tokens", "final_loss", "best_val_loss",
                                                   "tokens_per_s")}))
    return 0


main = command("train", _main, "exit 0 finished, 1 diverged, 2 bad input (one line, see ``hf_depth.errors``).")

if __name__ == "__main__":
    sys.exit(main())
