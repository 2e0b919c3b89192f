"""`hybridflow <command> [args ...]`: one front door for the project's commands.

Each command is a module that also runs as `python -m <module>`. The rest of the command line goes to that
module's main() unchanged, so `hybridflow train --config c.yaml x=1` is `python -m hybridflow.trainer.main
--config c.yaml x=1` (and `hybridflow torchrun ... -- script.py` keeps its `--`). A command's module is
imported only when it runs: `hybridflow --help` imports no torch, Ray or megatron.

setup.py declares the console script (hybridflow=hybridflow.cli:main); without an install,
`python -m hybridflow.cli` is the same command.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NamedTuple


class Command(NamedTuple):
    module: str  # what `python -m` runs for the same command
    main: str  # "module:function", called with the rest of the command line
    summary: str  # one line for `hybridflow --help`


COMMANDS: dict[str, Command] = {
    "train": Command("hybridflow.trainer.main", "hybridflow.trainer.main:main",
                     "train a policy with PPO or GRPO from a config"),
    "plan": Command("launch.plan", "launch.plan.__main__:main",
                    "will a config fit its GPUs, how long is a step (no GPU)"),
    "bench": Command("launch.benchmark", "launch.benchmark.__main__:main",
                     "time a config's steps per stage (warm-up, then timed)"),
    "cluster": Command("launch.cluster", "launch.cluster.cli:main", "start, inspect and stop a multi-node Ray cluster"),
    "submit": Command("launch.submit", "launch.submit:main", "run the trainer as a Ray job on an existing cluster"),
    "torchrun": Command("launch.torchrun_ray", "launch.torchrun_ray.launcher:main",
                        "run an SPMD script with torchrun on N Ray nodes"),
    "sweep": Command("launch.sweep", "launch.sweep.cli:main", "hyper-parameter sweeps with Ray Tune"),
    "convert": Command("megatron_workers.convert", "megatron_workers.convert:main",
                       "convert checkpoints: HF <-> Megatron, re-layout"),
    "export": Command("hybridflow.trainer.export", "hybridflow.trainer.export:main",
                      "export a trained actor as a Hugging Face directory"),
}


def build_parser() -> argparse.ArgumentParser:
    """Only for the help text and errors: a command's own arguments are never parsed here."""
    name_w = max(map(len, COMMANDS))
    summary_w = max(len(c.summary) for c in COMMANDS.values())
    rows = [f"  {name:<{name_w}}  {c.summary:<{summary_w}}  python -m {c.module}" for name, c in COMMANDS.items()]
    return argparse.ArgumentParser(
        prog="hybridflow", usage="hybridflow <command> [args ...]",
        description="HybridFlow's commands, one front door: `hybridflow <command> ARGS` is `python -m <module> ARGS`.",
        epilog="commands:\n" + "\n".join(rows) + "\n\n`hybridflow <command> --help` shows that command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter)


def resolve(name: str):
    """The function a command calls (imports its module)."""
    module, _, func = COMMANDS[name].main.partition(":")
    return getattr(importlib.import_module(module), func)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0].startswith("-"):
        parser = build_parser()
        parser.parse_args(argv)  # -h/--help prints the commands and exits 0; any other option is an error
        parser.error("a command is required")
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        build_parser().error(f"unknown command {name!r} (choose from {', '.join(COMMANDS)})")
    fn = resolve(name)
    saved = sys.argv
    sys.argv = [f"hybridflow {name}", *rest]  # argparse's default prog, and what a main(None) would read
    try:
        code = fn(rest)
    finally:
        sys.argv = saved
    return code if isinstance(code, int) else 0  # some mains return a result (a dict) or None: success


if __name__ == "__main__":
    sys.exit(main())
