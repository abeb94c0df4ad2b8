"""Run under a real launcher (``accelerate launch`` / ``torchrun``) by tests/test_distributed.py.

    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml tests/dist_driver.py SPEC.json

SPEC.json is a list of jobs, run in order in the same processes (one process group):
- ``{"kind": "train", "recipe": {...}, "resume": bool, "stop_after": int|null, "nan_rank": int|null,
  "nan_step": int|null, "out": path}``: ``hf_depth.training.train.run``; every rank writes ``out.rank{r}.json``
  with its summary (``nan_rank``/``nan_step`` make that rank's loss NaN at that optimizer step, as a diverging
  shard would).
- ``{"kind": "fsdp_parity", "out": path}``: for every registered design, loss and gradients of a tiny model
  sharded with ``train.parallel: fsdp2``'s ``shard`` against the same model unsharded, on the same batch.
- ``{"kind": "docs", "recipe": {...}, "out": path}``: the digests of the training documents (one epoch) this rank
  reads, as the training loop shards them.
"""

import json
import os
import sys

import torch


def main(spec_path: str) -> int:
    from accelerate import PartialState

    from hf_depth.training import train as train_mod
    from hf_depth.training.data import Documents, _digest
    from hf_depth.training.recipe import recipe_from_dict

    torch.set_num_threads(1)
    state = PartialState(cpu=True)
    rank, world = state.process_index, state.num_processes
    real_loss = train_mod.lm_loss
    for job in json.loads(open(spec_path).read()):
        if job["kind"] == "fsdp_parity":
            out = {"rank": rank, "world": world, "designs": fsdp_parity()}
            with open(f"{job['out']}.rank{rank}.json", "w") as f:
                json.dump(out, f)
            continue
        recipe = recipe_from_dict(job["recipe"])
        if job["kind"] == "docs":
            digests = [_digest(t).hex() for t in Documents(recipe.data, "train", rank, world).iterate()]
            out = {"rank": rank, "world": world, "digests": digests}
        else:
            calls = {"n": 0}

            def loss_fn(model, x, job=job, calls=calls, accum=recipe.train.grad_accum):
                loss = real_loss(model, x)
                if not model.training:  # validation batches are not optimizer steps
                    return loss
                calls["n"] += 1
                step = (calls["n"] - 1) // accum + 1
                if rank == job.get("nan_rank") and step == job.get("nan_step"):
                    loss = loss * float("nan")
                return loss

            train_mod.lm_loss = loss_fn
            try:
                summary = train_mod.run(recipe, resume=job.get("resume", False), stop_after=job.get("stop_after"))
            finally:
                train_mod.lm_loss = real_loss
            out = {"rank": rank, "world": world, "summary": summary}
        with open(f"{job['out']}.rank{rank}.json", "w") as f:
            json.dump(out, f)
    state.wait_for_everyone()
    return 0


def fsdp_parity() -> dict:
    """{design: max |diff| of loss and of every gradient} between the model sharded by ``train.parallel: fsdp2``'s
    ``shard`` (each rank on its own half of the batch) and the same model unsharded on the whole batch, or the
    error where sharding fails."""
    import copy

    import torch.distributed as dist

    import hf_depth
    from hf_depth.training.distributed import mean_over_ranks, shard

    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for design in sorted(hf_depth.DESIGNS):
        torch.manual_seed(0)
        model = hf_depth.model_for(design, vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                                   pad_token_id=0, eos_token_id=1)
        with torch.no_grad():  # routing away from its init, so that every parameter matters
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        x = torch.randint(2, 64, (2 * world, 16), generator=torch.Generator().manual_seed(1))
        ref = model(input_ids=x, labels=x).loss
        ref.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        try:
            sharded = copy.deepcopy(model)
            sharded.zero_grad(set_to_none=True)
            sharded = shard(sharded)
            mine = x[2 * rank : 2 * rank + 2]
            loss = sharded(input_ids=mine, labels=mine).loss
            loss.backward()
            diff = abs(mean_over_ranks(loss.item(), "cpu") - ref.item())
            for n, p in sharded.named_parameters():
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                diff = max(diff, (g - grads[n]).abs().max().item())
            results[design] = {"max_diff": diff, "sharded": type(sharded).__name__}
        except Exception as e:  # reported, and asserted on, by the test
            results[design] = {"error": f"{type(e).__name__}: {e}"}
    return results


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main(sys.argv[1]))
