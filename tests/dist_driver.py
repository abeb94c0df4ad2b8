"""Run under a real launcher (``accelerate launch`` / ``torchrun``) by tests/test_distributed.py.

    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml tests/dist_driver.py SPEC.json

SPEC.json is a list of jobs, run in order in the same processes (one process group):
- ``{"kind": "train", "recipe": {...}, "resume": bool, "stop_after": int|null, "nan_rank": int|null,
  "nan_step": int|null, "out": path}``: ``hf_depth.training.train.run``; every rank writes ``out.rank{r}.json``
  with its summary (``nan_rank``/``nan_step`` make that rank's loss NaN at that optimizer step, as a diverging
  shard would).
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
        recipe = recipe_from_dict(job["recipe"])
        if job["kind"] == "docs":
            digests = [_digest(t).hex() for t in Documents(recipe.data, "train", rank, world).iterate()]
            out = {"rank": rank, "world": world, "digests": digests}
        else:
            calls = {"n": 0}

            def loss_fn(model, x, job=job, calls=calls):
                loss = real_loss(model, x)
                if not model.training:  # validation batches are not optimizer steps
                    return loss
                calls["n"] += 1
                step = (calls["n"] - 1) // recipe.train.grad_accum + 1
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


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main(sys.argv[1]))
