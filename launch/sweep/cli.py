"""Command line of launch.sweep (see the package docstring)."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from launch.sweep import __doc__ as DOC


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m launch.sweep", usage=DOC.split("\n\n")[0],
                                 description=DOC.split("\n\n")[1])
    ap.add_argument("--config", default=None, help="the trainer's YAML config (configs/*.yaml)")
    ap.add_argument("overrides", nargs="*", help="dotlist overrides every trial gets, as the trainer takes them")
    ap.add_argument("--space", action="append", default=[], metavar="KEY=KIND(ARGS)",
                    help="a swept key, e.g. actor_rollout_ref.actor.optim.lr=loguniform(1e-6,1e-4); repeat it")
    ap.add_argument("--num-samples", type=int, default=1, help="trials sampled (times each grid point)")
    ap.add_argument("--metric", default="critic/score/mean", help="a step metric, e.g. val-core/<source>/reward/mean@1")
    ap.add_argument("--mode", default="max", choices=("max", "min"))
    ap.add_argument("--scheduler", default="fifo", choices=("fifo", "asha"), help="asha: stop weak trials early")
    ap.add_argument("--grace-period", type=int, default=1, help="asha: steps before a trial may be stopped")
    ap.add_argument("--reduction-factor", type=int, default=2, help="asha: the fraction kept at each rung is 1/this")
    ap.add_argument("--max-failures", type=int, default=0, help="times Tune retries a failed trial")
    ap.add_argument("--max-concurrent", type=int, default=None, help="trials at once (default: as many as fit)")
    ap.add_argument("--sweep-dir", default=None, help="default: runs/sweep/<time>")
    ap.add_argument("--resume", metavar="SWEEP_DIR", default=None,
                    help="restore an interrupted sweep from its directory (the other flags are its sweep.json's)")
    ap.add_argument("--restart-errored", action="store_true", help="with --resume: run the ERROR trials again")
    args = ap.parse_args(argv)
    if not args.resume and not args.space:
        ap.error("give at least one --space KEY=KIND(ARGS), or --resume SWEEP_DIR")
    return args


def main(argv: list[str] | None = None) -> int:
    from launch.sweep.run import run_sweep, sweep_spec

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        spec = None if args.resume else sweep_spec(
            args.config, args.overrides, args.space, args.sweep_dir or f"runs/sweep/{time.strftime('%Y%m%d-%H%M%S')}",
            args.metric, args.mode, args.num_samples, args.scheduler, args.grace_period, args.reduction_factor,
            args.max_failures, args.max_concurrent)
        out = run_sweep(spec, resume=args.resume, restart_errored=args.restart_errored)
    except (ValueError, FileNotFoundError, KeyError) as e:  # config and space errors, before any trial starts
        print(f"sweep error: {e}", file=sys.stderr)
        return 2
    print(out["table"])
    for kind, path in out["paths"].items():
        print(f"{kind}: {path}")
    return 0 if out["best"] is not None else 1  # no trial reported the metric (all failed, or a wrong name)
