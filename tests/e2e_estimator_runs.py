"""Every advantage estimator and every actor loss_agg_mode, end to end, on one set of warm worker groups.

    python tests/e2e_estimator_runs.py --out OUT --config configs/grpo_tiny_cpu.yaml [key=value ...]

One driver (hybridflow.trainer.main.worker_session): Ray, the Megatron TP=2 actor+ref with vLLM in its processes, and
a critic, built once for the config given (which must make a critic: adv_estimator=gae). Then one RayPPOTrainer per
RUNS entry over those groups, one after another, each with its own estimator, loss_agg_mode and run directory; the
weights go on from one run to the next. The first run is ReMax's learning run: it validates before its first step
and after its last (trainer.total_training_steps from --learn-steps); the others run 2 steps each.

Each run leaves under OUT/<estimator>/: run/ (metrics.jsonl, config.yaml), samples/ (trainer.rollout_data_dir:
step_<N>.jsonl, and ReMax's baseline_step_<N>.jsonl) and adv_step_<N>.pt, the batch's tensors right after the adv
stage (scores, rewards, response mask, values, reward baselines, advantages, returns; uid), which
tests/test_e2e_estimators.py recomputes by hand. OUT/summary.json: each run's seconds and the session's.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

# (estimator, actor.loss_agg_mode): every estimator once and every mode at least once. Paired so that the reported
# pg_loss tells the mode apart: whitened advantages (gae, reinforce_plus_plus*) sum to 0 over the batch's tokens, so
# only seq-mean-token-mean is nonzero there; grpo's and rloo's are zero-mean per prompt, so seq-mean-token-mean is 0
# there. token-sum reports the token mean (megatron_workers/engine.py micro_agg_mode); its update shows in grad_norm.
RUNS = (("remax", "seq-mean-token-sum-norm"), ("gae", "seq-mean-token-mean"), ("grpo", "token-mean"),
        ("rloo", "seq-mean-token-sum"), ("reinforce_plus_plus", "token-sum"),
        ("reinforce_plus_plus_baseline", "seq-mean-token-mean"))
ADV_KEYS = ("token_level_scores", "token_level_rewards", "response_mask", "values", "reward_baselines", "advantages",
            "returns")


def record_advantages(trainer, out: Path) -> None:
    """Wrap the trainer's adv stage so that each step's inputs and outputs are saved as they were computed."""
    import torch

    compute = trainer.compute_advantages

    def recorded(batch):
        metrics = compute(batch)
        tensors = {k: batch.batch[k].clone() for k in ADV_KEYS if k in batch.batch}
        torch.save({**tensors, "uid": [str(u) for u in batch.non_tensor_batch["uid"]]},
                   out / f"adv_step_{trainer.global_step}.pt")
        return metrics

    trainer.compute_advantages = recorded


def variant(base_args: list[str], config: str, root: Path, estimator: str, agg: str, steps: int, learn: bool):
    from hybridflow.config.load import load_config

    overrides = [*base_args, f"algorithm.adv_estimator={estimator}", f"actor_rollout_ref.actor.loss_agg_mode={agg}",
                 f"trainer.default_local_dir={root / 'run'}", f"trainer.rollout_data_dir={root / 'samples'}",
                 f"trainer.experiment_name={estimator}", f"trainer.total_training_steps={steps}",
                 "trainer.save_freq=-1",
                 "critic.enable=null"]  # on for gae only (preflight), so the others leave the critic group unused
    overrides += ["trainer.val_before_train=true", f"trainer.test_freq={steps}"] if learn else [
        "trainer.val_before_train=false", "trainer.test_freq=-1"]
    return load_config(config, overrides)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--learn-steps", type=int, default=8, help="ReMax's learning run (the others run 2 steps)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from hybridflow.config.load import load_config
    from hybridflow.trainer.main import worker_session

    out = Path(args.out)
    t0 = time.perf_counter()
    # gae: the groups get a critic; val_before_train: the session reads the val set (ReMax's run validates)
    built = load_config(args.config, [*args.overrides, f"trainer.default_local_dir={out / 'session'}",
                                      "algorithm.adv_estimator=gae", "trainer.save_freq=-1",
                                      "trainer.val_before_train=true"])
    summary = {"runs": {}}
    with worker_session(built) as make_trainer:
        summary["start_s"] = time.perf_counter() - t0
        for estimator, agg in RUNS:
            t = time.perf_counter()
            learn = estimator == "remax"
            root = out / estimator
            root.mkdir(parents=True, exist_ok=True)
            trainer = make_trainer(variant(args.overrides, args.config, root, estimator, agg,
                                           args.learn_steps if learn else 2, learn))
            record_advantages(trainer, root)
            trainer.fit()
            summary["runs"][estimator] = {"loss_agg_mode": agg, "seconds": time.perf_counter() - t}
    summary["total_s"] = time.perf_counter() - t0
    (out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
