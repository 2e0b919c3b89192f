"""Check a sweep before any trial starts, run it with Ray Tune (or restore an interrupted one), write its results.

Checked first, with no Ray: every --space spec and key (launch.sweep.space), every choice/grid value and range
bound loaded through the trainer's config loader with the base overrides, the whole config validated as the
trainer validates it, and every checked value leaving the trial's pools as they are (one placement group
layout for all trials). Then Tune runs the trials (launch.sweep.trial), ERROR trials do not end it, and the
sweep directory gets sweep.json (what --resume restores), results.{md,csv,json} and best.yaml.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from launch.sweep.space import Dim, SpaceError, override, parse_space

log = logging.getLogger("hybridflow.sweep")
SCHEDULERS = ("fifo", "asha")


def _load(config: str | None, overrides: list[str]):
    from hybridflow.config.load import load_config

    return load_config(config, overrides)


def check_space(config: str | None, overrides: list[str], dims: list[Dim]) -> None:
    """Each value of each dim loads as an override of its key (type, section-or-value), naming the spec."""
    from hybridflow.config.load import ConfigError

    for d in dims:
        for v in d.values_to_check():
            try:
                _load(config, [*overrides, override(d.key, v)])
            except ConfigError as e:
                raise SpaceError(f"--space {d.key}={d.kind}(...): value {v!r}: {e}") from None


def probe_overrides(dims: list[Dim]) -> list[list[str]]:
    """One override set per checked value (the others at their first value): the configs whose layout must agree."""
    first = {d.key: d.args[0] for d in dims}
    return [[override(k, v if k == d.key else first[k]) for k in first] for d in dims for v in d.values_to_check()]


def sweep_spec(config, overrides, specs, sweep_dir, metric, mode, num_samples, scheduler, grace_period,
               reduction_factor, max_failures, max_concurrent) -> dict:
    if mode not in ("max", "min"):
        raise ValueError(f"--mode {mode!r}: choose max or min")
    if scheduler not in SCHEDULERS:
        raise ValueError(f"--scheduler {scheduler!r}: choose one of {', '.join(SCHEDULERS)}")
    if num_samples < 1 or grace_period < 1 or reduction_factor < 2 or max_failures < 0:
        raise ValueError(f"--num-samples {num_samples} and --grace-period {grace_period} must be >= 1, "
                         f"--reduction-factor {reduction_factor} >= 2, --max-failures {max_failures} >= 0")
    return {"config": os.path.abspath(config) if config else None, "overrides": list(overrides), "space": list(specs),
            "sweep_dir": os.path.abspath(sweep_dir), "cwd": os.getcwd(), "metric": metric, "mode": mode,
            "num_samples": num_samples, "scheduler": scheduler, "grace_period": grace_period,
            "reduction_factor": reduction_factor, "max_failures": max_failures, "max_concurrent": max_concurrent}


def prepare(spec: dict):
    """Every check that needs no Ray; returns (dims, the config of the first values, validated)."""
    from hybridflow.config.load import is_valid_key
    from hybridflow.trainer.main import validate, validate_cluster
    from launch.sweep.resources import trial_bundles

    dims = parse_space(spec["space"], is_valid_key)
    check_space(spec["config"], spec["overrides"], dims)
    probes = probe_overrides(dims)
    layouts = {}
    for probe in probes:
        bundles, _ = trial_bundles(_load(spec["config"], [*spec["overrides"], *probe]), use_gpu=False)
        layouts.setdefault(json.dumps(bundles), probe)
    if len(layouts) > 1:
        raise ValueError("the swept values change a trial's pools (one placement group layout serves every trial): "
                         + "; ".join(f"{', '.join(p)} -> {b}" for b, p in layouts.items()))
    cfg = _load(spec["config"], [*spec["overrides"], *probes[0]])
    if spec["metric"].startswith("val-") and not (cfg.data.val_files and cfg.trainer.test_freq > 0):
        raise ValueError(f"--metric {spec['metric']} is a validation metric, but the trials do not validate during "
                         f"training: set data.val_files and trainer.test_freq > 0 (got {cfg.data.val_files}, "
                         f"{cfg.trainer.test_freq})")
    validate(cfg)
    validate_cluster(cfg)
    return dims, cfg


def _start_ray(cfg, sweep_dir: str) -> None:
    from hybridflow.controller import init_ray

    r = cfg.trainer.ray
    # The trainer's own rule (hybridflow.trainer.main._prepare_run): Ray's CPUs are logical on a local cluster.
    num_cpus = r.num_cpus or (None if r.address else max(16, os.cpu_count() or 1))
    init_ray(r.address, num_cpus, r.include_dashboard, r.object_store_memory, run_dir=sweep_dir)


def _tuner(spec: dict, dims: list[Dim], cfg, restore: bool, restart_errored: bool = False):
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    from launch.sweep.resources import trial_bundles
    from launch.sweep.trial import TIME_ATTR, run_trial

    bundles, _ = trial_bundles(cfg)
    trainable = tune.with_resources(tune.with_parameters(run_trial, spec=spec),
                                    tune.PlacementGroupFactory(bundles, strategy="STRICT_PACK"))
    if restore:
        return tune.Tuner.restore(spec["sweep_dir"], trainable, resume_unfinished=True,
                                  restart_errored=restart_errored)
    scheduler = FIFOScheduler() if spec["scheduler"] == "fifo" else ASHAScheduler(
        time_attr=TIME_ATTR, max_t=cfg.trainer.total_training_steps or 10**9, grace_period=spec["grace_period"],
        reduction_factor=spec["reduction_factor"])
    path = Path(spec["sweep_dir"])
    return tune.Tuner(
        trainable, param_space={"overrides": {d.key: d.to_tune() for d in dims}},
        tune_config=tune.TuneConfig(metric=spec["metric"], mode=spec["mode"], num_samples=spec["num_samples"],
                                    scheduler=scheduler, max_concurrent_trials=spec["max_concurrent"],
                                    trial_dirname_creator=_trial_dirname),
        run_config=tune.RunConfig(storage_path=str(path.parent), name=path.name, verbose=1,
                                  failure_config=tune.FailureConfig(max_failures=spec["max_failures"])))


def _trial_dirname(trial) -> str:
    """Tune's directory of a trial is named by its id alone, so a Result (restored ones too) says which it is."""
    return trial.trial_id


def collect(result_grid, sweep_dir: str) -> list[dict]:
    """ResultGrid -> launch.sweep.results trial records: each trial's steps, overrides and error's first line.

    The steps are the trial's own metrics.jsonl (every trial logs one, launch.sweep.trial): a trial that --resume
    restarted goes on from its checkpoint, and Tune's record of it (progress.csv) starts again there, while the
    trainer's file keeps the steps before. Without that file (a trial that never started): what Tune received."""
    from hybridflow.trainer.tracking import read_jsonl
    from launch.sweep.results import first_line
    from launch.sweep.trial import trial_dir

    trials = []
    for r in result_grid:
        own = trial_dir(sweep_dir, Path(r.path).name) / "metrics.jsonl"
        df = r.metrics_dataframe
        if own.is_file():
            history = read_jsonl(own)
        else:
            history = [] if df is None else [{k: v for k, v in row.items() if v == v} for row in df.to_dict("records")]
        # A trial restored by --resume that never reported has no config in its last result: Tune's params.json has it.
        params = r.config or json.loads((Path(r.path) / "params.json").read_text())
        trials.append({"trial": Path(r.path).name, "overrides": dict(params.get("overrides", {})), "history": history,
                       "error": first_line(r.error)})
    return sorted(trials, key=lambda t: t["trial"])


def write_best(spec: dict, best: dict, out: Path) -> Path:
    """best.yaml: the base config with the best trial's values, resolved, so `--config best.yaml` runs them."""
    from omegaconf import OmegaConf

    from hybridflow.config.load import to_dict

    cfg = _load(spec["config"], [*spec["overrides"], *(override(k, v) for k, v in best["overrides"].items())])
    head = (f"# launch.sweep {spec['sweep_dir']}: best trial {best['trial']} ({spec['metric']} {spec['mode']} "
            f"{best['best']:.6g} at step {best['best_step']})\n# its values: "
            + ", ".join(override(k, v) for k, v in best["overrides"].items()) + "\n")
    out.write_text(head + OmegaConf.to_yaml(OmegaConf.create(to_dict(cfg))))
    return out


def run_sweep(spec: dict | None = None, resume: str | None = None, restart_errored: bool = False) -> dict:
    """A new sweep (`spec`, launch.sweep.run.sweep_spec) or an interrupted one restored from its directory."""
    import ray

    from launch.sweep.results import best_row, render_markdown, table_rows, write_tables

    if resume:
        path = Path(resume) / "sweep.json"
        if not path.is_file():
            raise FileNotFoundError(f"--resume {resume}: no sweep.json there (not a launch.sweep directory)")
        spec = json.loads(path.read_text())
    # Tune's trials work in the caller's directory (relative config paths), not in a Tune trial directory.
    os.environ["RAY_CHDIR_TO_TRIAL_DIR"] = "0"
    # A validation metric is in the rows of validating steps only; Tune's default refuses the others.
    os.environ["TUNE_DISABLE_STRICT_METRIC_CHECKING"] = "1"
    t0 = time.perf_counter()
    dims, cfg = prepare(spec)
    sweep_dir = Path(spec["sweep_dir"])
    sweep_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        (sweep_dir / "sweep.json").write_text(json.dumps(spec, indent=1) + "\n")
    _start_ray(cfg, str(sweep_dir))
    try:
        grid = _tuner(spec, dims, cfg, restore=bool(resume), restart_errored=restart_errored).fit()
        trials = collect(grid, spec["sweep_dir"])
    finally:
        ray.shutdown()
    rows = table_rows(trials, spec["metric"], spec["mode"], cfg.trainer.total_training_steps or 0)
    paths = write_tables(rows, sweep_dir, spec["metric"], spec["mode"])
    best = best_row(rows, spec["mode"])
    if best is not None:
        paths["best"] = write_best(spec, best, sweep_dir / "best.yaml")
    else:
        seen = sorted({k for t in trials for row in t["history"] for k in row})
        log.warning("no trial reported %s; metrics reported: %s", spec["metric"], ", ".join(seen[:40]) or "none")
    return {"table": render_markdown(rows, spec["metric"], spec["mode"]), "rows": rows,
            "best": best and best["trial"], "paths": {k: str(v) for k, v in paths.items()}, "trials": trials,
            "wall_s": time.perf_counter() - t0}
