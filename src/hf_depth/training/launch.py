"""The exact per-node launch commands of a multi-process run, rendered from a recipe and an accelerate config.

    hf-depth launch-commands recipes/train/depthbench_400m/pre_ln_L24.yaml \\
        --accelerate-config recipes/accelerate/multinode.yaml --nodes 2 --gpus-per-node 8 \\
        --main-ip 10.0.0.1 --global-batch 512 [overrides...]

prints, for every node, the ``accelerate launch`` command (and its ``torchrun`` equivalent) with that node's
``--machine_rank``, the rendezvous address and port, the world size, and the ``train.grad_accum`` that keeps the
global batch at ``--global-batch`` sequences; nothing is run. Every node runs the same recipe and overrides; the
node whose address is ``--main-ip`` has rank 0 and writes the run folder (put it on a shared filesystem).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from ..errors import command, command_parser
from .recipe import load_recipe


@dataclass
class LaunchPlan:
    nodes: int
    gpus_per_node: int
    grad_accum: int
    global_batch: int
    tokens_per_step: int
    accelerate: list[str]  # one command per node
    torchrun: list[str]


def plan_launch(recipe_path: str, accelerate_config: str, nodes: int | None = None, gpus_per_node: int | None = None,
                main_ip: str | None = None, port: int | None = None, global_batch: int | None = None,
                overrides: list[str] | None = None) -> LaunchPlan:
    """Per-node commands for ``nodes`` x ``gpus_per_node`` processes (defaults: the accelerate config's)."""
    from ..errors import read_yaml

    path = Path(accelerate_config)
    if not path.exists():
        raise ValueError(f"accelerate config {str(path)!r} does not exist (see recipes/accelerate/)")
    cfg = read_yaml(path, "accelerate config", expect=dict, empty={})
    for key in ("num_machines", "num_processes", "main_process_port"):
        v = cfg.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"accelerate config {str(path)!r}: `{key}` must be a positive integer, got {v!r}")
    for name, value in (("nodes", nodes), ("gpus_per_node", gpus_per_node), ("port", port), ("global_batch", global_batch)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"`{name}` must be a positive integer, got {value!r}")
    nodes = nodes or int(cfg.get("num_machines", 1))
    total = int(cfg.get("num_processes", 1))
    gpus_per_node = gpus_per_node or max(1, total // max(1, int(cfg.get("num_machines", 1))))
    main_ip = main_ip or cfg.get("main_process_ip")
    port = port or int(cfg.get("main_process_port", 29500))
    if nodes > 1 and not main_ip:
        raise ValueError("a multi-node launch needs `--main-ip` (the address of the rank-0 node)")
    overrides = list(overrides or [])
    recipe = load_recipe(recipe_path, overrides)  # validated before anything is rendered
    world = nodes * gpus_per_node
    t = recipe.train
    grad_accum = t.grad_accum
    if global_batch is not None:
        per_step = t.micro_batch_size * world
        if global_batch % per_step:
            raise ValueError(f"`--global-batch` {global_batch} is not a multiple of micro_batch_size x processes "
                             f"= {t.micro_batch_size} x {world} = {per_step}")
        grad_accum = global_batch // per_step
        overrides = [o for o in overrides if not o.startswith("train.grad_accum=")] + [f"train.grad_accum={grad_accum}"]
    tail = ["-m", "hf_depth.training.train", recipe_path, *overrides]
    acc, tr = [], []
    for rank in range(nodes):
        a = ["accelerate", "launch", "--config_file", str(path), "--num_machines", str(nodes),
             "--num_processes", str(world), "--machine_rank", str(rank)]
        if main_ip:
            a += ["--main_process_ip", str(main_ip)]
        a += ["--main_process_port", str(port), *tail]
        acc.append(shlex.join(a))
        r = ["torchrun", "--nnodes", str(nodes), "--nproc-per-node", str(gpus_per_node), "--node-rank", str(rank)]
        if nodes > 1:
            r += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{main_ip}:{port}"]
        else:
            r += ["--master-port", str(port)]
        tr.append(shlex.join(r + tail))
    batch = t.micro_batch_size * grad_accum * world
    return LaunchPlan(nodes, gpus_per_node, grad_accum, batch, batch * recipe.data.seq_len, acc, tr)


def _main(argv: list[str] | None = None) -> int:
    from ..errors import arg_number

    ap = command_parser("launch-commands", __doc__)
    ap.add_argument("recipe")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--accelerate-config", default="recipes/accelerate/multinode.yaml")
    ap.add_argument("--nodes", type=arg_number(int, 1))
    ap.add_argument("--gpus-per-node", type=arg_number(int, 1))
    ap.add_argument("--main-ip")
    ap.add_argument("--port", type=arg_number(int, 1, maximum=65535))
    ap.add_argument("--global-batch", type=arg_number(int, 1), help="sequences per optimizer step; sets train.grad_accum")
    a = ap.parse_intermixed_args(argv)
    plan = plan_launch(a.recipe, a.accelerate_config, a.nodes, a.gpus_per_node, a.main_ip, a.port,
                       a.global_batch, a.overrides)
    print(f"# {plan.nodes} node(s) x {plan.gpus_per_node} process(es); global batch {plan.global_batch} sequences "
          f"({plan.tokens_per_step:,} tokens) per step, train.grad_accum={plan.grad_accum}")
    for rank, (acc, tr) in enumerate(zip(plan.accelerate, plan.torchrun)):
        print(f"# node {rank}:\n{acc}\n#   or: {tr}")
    return 0


main = command("launch-commands", _main, "exit 0, or 2 on bad input (one line on stderr, see ``hf_depth.errors``).")
