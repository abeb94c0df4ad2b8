"""``hf-depth`` command line: one entry point, subcommands implemented by the modules that own them.

Each subcommand imports its module lazily, so ``hf-depth shapes`` never imports lm-eval or Triton. Every
subcommand runs behind one error path (``hf_depth.errors.run_command``): an expected failure prints
``hf-depth COMMAND: <what is wrong and what to do>`` on one line and exits 2; ``--debug`` (anywhere on the
command line) or ``HF_DEPTH_DEBUG=1`` shows the traceback instead.
"""

from __future__ import annotations

import importlib
import sys

#: subcommand, the module whose ``main(argv)`` runs it, and its one-line help
_TABLE = """
shapes             hf_depth.shapes                 iso-parameter shape spectrum
train              hf_depth.training.train         pretrain a design from a recipe YAML (accelerate)
launch-commands    hf_depth.training.launch        per-node multi-process launch commands for a recipe
sweep              hf_depth.training.sweep         expand designs x shapes x learning rates into runs
results            hf_depth.training.results       collect finished runs into tables, plots and scaling fits
export             hf_depth.hub                    write a Hub-ready folder (and model card) from a run; --push to upload
eval               hf_depth.evaluation.cli         lm-eval tasks (NLL and generative) on a model
val-loss           hf_depth.evaluation.perplexity  validation loss / perplexity on held-out text
diagnose           hf_depth.diagnostics.cli        depth diagnostics report (angular, causal, permutation, ...)
upcycle            hf_depth.upcycling              turn a Llama / Mistral / Qwen2 / Qwen3 model into a depth design (same weights)
convert-olmo-core  hf_depth.olmo_core              convert a DepthBench / OLMo-core checkpoint to hf_depth
kernels            hf_depth.models.dispatch        which implementation (Triton kernel or PyTorch reference) serves each op
"""
COMMANDS = {name: (module, help_) for name, module, help_ in (row.split(None, 2) for row in _TABLE.strip().splitlines())}


def usage() -> str:
    lines = ["usage: hf-depth COMMAND [args...] [--debug]", "", "commands:"]
    lines += [f"  {name:<18} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "--debug (or HF_DEPTH_DEBUG=1): show the traceback of a failure instead of its one-line message"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--debug"]:  # hf-depth --debug COMMAND ...: the flag is the command's
        argv = argv[1:2] + ["--debug"] + argv[2:]
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"hf-depth: unknown command {cmd!r}; allowed: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    from .errors import run_command

    return run_command(cmd, lambda args: importlib.import_module(COMMANDS[cmd][0]).main(args), rest)


if __name__ == "__main__":
    sys.exit(main())
