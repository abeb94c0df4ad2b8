"""``hf-depth`` command line: one entry point, subcommands implemented by the modules that own them.

Each subcommand imports its module lazily, so ``hf-depth shapes`` never imports lm-eval or Triton.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "shapes": ("hf_depth.shapes", "iso-parameter shape spectrum"),
    "train": ("hf_depth.training.train", "pretrain a design from a recipe YAML (accelerate)"),
    "launch-commands": ("hf_depth.training.launch", "per-node multi-process launch commands for a recipe"),
    "sweep": ("hf_depth.training.sweep", "expand designs x shapes x learning rates into runs"),
    "results": ("hf_depth.training.results", "collect finished runs into tables, plots and scaling fits"),
    "export": ("hf_depth.hub", "write a Hub-ready folder (and model card) from a run; --push to upload"),
    "eval": ("hf_depth.evaluation.cli", "lm-eval tasks (NLL and generative) on a model"),
    "val-loss": ("hf_depth.evaluation.perplexity", "validation loss / perplexity on held-out text"),
    "diagnose": ("hf_depth.diagnostics.cli", "depth diagnostics report (angular, causal, permutation, ...)"),
    "convert-olmo-core": ("hf_depth.olmo_core", "convert a DepthBench / OLMo-core checkpoint to hf_depth"),
}


def usage() -> str:
    lines = ["usage: hf-depth COMMAND [args...]", "", "commands:"]
    lines += [f"  {name:<18} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"hf-depth: unknown command {cmd!r}; allowed: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[cmd][0])
    result = module.main(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
