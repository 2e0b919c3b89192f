"""Command line of launch.benchmark (see the package docstring)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from launch.benchmark import __doc__ as DOC


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m launch.benchmark", description=DOC.split("\n\n")[1],
                                 usage=DOC.split("\n\n")[0])
    ap.add_argument("config", nargs="?", help="a HybridFlow YAML config (configs/*.yaml, configs/recipes/*.yaml)")
    ap.add_argument("overrides", nargs="*", help="dotlist overrides, as the trainer takes them")
    ap.add_argument("--warmup", type=int, default=10, help="warm-up steps, not timed (the paper's 10)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps (the paper's 5)")
    ap.add_argument("--out", default=None, help="also write the result JSON to this file")
    ap.add_argument("--compare", nargs="+", metavar="RESULT", default=None,
                    help="result files (--out, or a benchmark's captured output) to print side by side")
    ap.add_argument("--ablation", choices=["long_tail", "agent_tools", "async"], default=None,
                    help="long_tail: the before/after rows on the long-tailed workload (launch/benchmark/long_tail.py);"
                         " agent_tools: 64 agent trajectories with a 50 ms tool, concurrent vs sequential "
                         "(launch/benchmark/agent_tools.py); async: colocated vs split pools, sync, one step off "
                         "policy and fully async (launch/benchmark/async_ablation.py); no CONFIG")
    args = ap.parse_args(argv)
    if args.ablation and args.config:
        ap.error("--ablation runs its own config (configs/ppo_tiny_cpu.yaml or configs/grpo_agent_tiny_cpu.yaml + the "
                 "workload); give no CONFIG")
    if args.compare is None and not args.config and not args.ablation:
        ap.error("give a CONFIG to run, --ablation long_tail, or --compare RESULT ...")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # first: --help and a bad command line cost no torch import (report imports it)
    from launch.benchmark.report import compare, load_result, render

    if args.compare is not None:
        try:
            stems = [Path(p).stem for p in args.compare]
            # a column per file: the file's stem, or its path where two files share a stem (a/result, b/result)
            results = {(stem if stems.count(stem) == 1 else p): load_result(p)
                       for stem, p in zip(stems, args.compare, strict=True)}
        except (OSError, ValueError) as e:
            print(f"benchmark: {e}", file=sys.stderr)
            return 2
        print(compare(results))
        return 0
    if args.ablation == "async":
        from launch.benchmark.async_ablation import main as async_main

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return async_main(args.warmup if args.warmup != 10 else 2, args.steps if args.steps != 5 else 4, args.out)
    if args.ablation == "agent_tools":
        from launch.benchmark.agent_tools import main as agent_tools_main

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return agent_tools_main(args.out)
    if args.ablation:
        from launch.benchmark.long_tail import main as ablation_main

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return ablation_main(args.warmup, args.steps, args.out)
    from launch.benchmark.run import run_benchmark

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        result = run_benchmark(args.config, args.overrides, args.warmup, args.steps)
    except (ValueError, FileNotFoundError, KeyError) as e:  # config errors, raised before any worker starts
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(render(result))
    line = json.dumps(result, sort_keys=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(line + "\n")
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
