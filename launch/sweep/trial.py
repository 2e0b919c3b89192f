"""One sweep trial: the trainer's own run (hybridflow.trainer.main.trainer_session + RayPPOTrainer.fit) with the
trial's overrides, in the trial's placement group, reporting every step's metrics to Tune.

Runs inside Tune's trial actor (a Ray worker already connected to the sweep's cluster, so the trainer's
init_ray is a no-op). The run directory is <sweep dir>/trials/<trial id> and the experiment name the trial
id: trials never share checkpoints, and a trial that `--resume` restarts finds its own (trainer.resume_mode
auto, with trainer.save_freq > 0) and goes on from its last saved step.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from launch.sweep.space import override

TIME_ATTR = "training/global_step"  # every step's row has it (ppo_trainer.step); ASHA's time axis


def trial_dir(sweep_dir: str | Path, trial_id: str) -> Path:
    return Path(sweep_dir) / "trials" / trial_id


def trial_overrides(spec: dict, values: dict, trial_id: str) -> list[str]:
    """The user's overrides, the trial's values, then its own run directory and experiment name."""
    return [*spec["overrides"], *(override(k, v) for k, v in values.items()),
            f"trainer.default_local_dir={trial_dir(spec['sweep_dir'], trial_id)}",
            f"trainer.experiment_name={trial_id}"]


def tune_metrics(metrics: dict) -> dict[str, float]:
    """A step's finite scalars, as Tracking logs them."""
    out = {}
    for k, v in metrics.items():
        try:
            f = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(f):
            out[k] = f
    return out


def run_trial(config: dict, spec: dict) -> None:
    """Tune's function trainable. `config`: {"overrides": {key: value}} (the sampled space); `spec`: the sweep's
    launch.sweep.run.sweep_spec (config file, base overrides, sweep dir, the driver's working directory)."""
    from ray import tune
    from ray.util import get_current_placement_group

    from hybridflow.config.load import load_config
    from hybridflow.trainer.main import trainer_session, validate, validate_cluster
    from launch.sweep.resources import reserved_pools, trial_bundles

    if os.path.isdir(spec["cwd"]):  # relative paths in the config mean what they meant to the sweep's caller
        os.chdir(spec["cwd"])
    trial_id = tune.get_context().get_trial_id()
    cfg = load_config(spec["config"], trial_overrides(spec, config["overrides"], trial_id))
    if "jsonl" not in cfg.trainer.logger:  # the trial's own record of every step, kept across a resume
        cfg.trainer.logger.append("jsonl")
    validate(cfg)
    validate_cluster(cfg)
    bundles, first = trial_bundles(cfg)
    pg = get_current_placement_group()
    if pg is None or [dict(b) for b in pg.bundle_specs] != bundles:
        raise ValueError(f"trial {trial_id}: its overrides {config['overrides']} need bundles {bundles}, but the "
                         f"sweep reserved {None if pg is None else pg.bundle_specs}: sweep keys that keep the pools")
    with trainer_session(cfg, validated=True, reserved=reserved_pools(pg, first)) as trainer:
        trainer.on_step = lambda step, m: tune.report(tune_metrics(m))
        trainer.fit()
