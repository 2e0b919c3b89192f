"""The single controller's RL loop: a plain Python loop of named stages, one worker-group call each.

    gen -> [gen_baseline] -> [rm] -> reward -> old_log_prob -> ref -> values -> adv -> update_critic -> update_actor
    (the weight resync to the rollout engine runs at the start of the next gen, inside the workers)

Validation (`validate`, timer `testing`) reuses gen -> [rm] -> reward on data.val_files with the
val_kwargs sampling, before the first step and every trainer.test_freq steps.

With the ref on a pool of its own (trainer.placement=standalone, or trainer.role_pools) it is its own worker
group; on the actor's pool (colocate, split) it runs in the actor's processes.

Everything heavy runs in the SPMD worker groups; the driver only holds batches,
computes rewards and advantages, and logs.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from pathlib import Path

import numpy as np
import torch

from hybridflow.algorithms import apply_kl_penalty, compute_advantage, make_kl_controller
from hybridflow.algorithms.rollout_correction import apply_rollout_correction
from hybridflow.algorithms.seqlen_balance import balance_batch, balance_parts, measure_imbalance
from hybridflow.config.load import to_dict
from hybridflow.config.schema import HybridFlowConfig
from hybridflow.controller.fault_inject import maybe_kill as fault_point
from hybridflow.protocol import DataProto
from hybridflow.rewards.overlong import shape_batch_scores
from hybridflow.trainer import remax, validation
from hybridflow.trainer.checkpoint import CheckpointManager
from hybridflow.trainer.generation import make_generation
from hybridflow.trainer.metrics import (
    data_metrics,
    reduce_worker_metrics,
    throughput_metrics,
    timing_metrics,
    token_counts,
    transformer_flops,
)
from hybridflow.trainer.peak_flops import device_peak_flops
from hybridflow.trainer.rollout_dump import rollout_records
from hybridflow.trainer.stages import stage, timer
from hybridflow.trainer.tracking import Tracking, prepare_jsonl, read_jsonl

log = logging.getLogger(__name__)

def dp_balance_parts(cfg: HybridFlowConfig) -> tuple[int, int]:
    """(parts to balance, the actor's DP size) for trainer.balance_batch: DP = a role's processes over its
    tp*pp*cp (hybridflow/parallel/dims.py's layout); parts also serve the critic's DP (balance_parts)."""
    from hybridflow.trainer.preflight import placement_of

    place = placement_of(cfg)

    def dp(role, m):
        return max(1, place.world(role) // (m.tensor_model_parallel_size * m.pipeline_model_parallel_size
                                            * m.context_parallel_size))

    actor = dp("actor_rollout", cfg.actor_rollout_ref.actor.megatron)
    critic = dp("critic", cfg.critic.megatron) if cfg.critic.enable and "critic" in place.role_pools else None
    rows = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n
    return balance_parts(rows, actor, critic), actor


def skips_old_log_prob(cfg: HybridFlowConfig) -> bool:
    """Whether the step skips the separate old-log-prob pass (also what launch.plan counts)."""
    a = cfg.actor_rollout_ref
    mode = str(a.recompute_old_log_prob).lower()
    rc = cfg.algorithm.rollout_correction  # bypass: old is the rollout's; decoupled IS: old is the proximal anchor
    if rc.bypass_mode or rc.rollout_is is not None:
        return bool(rc.bypass_mode)
    if mode in ("true", "1"):
        return False
    if mode in ("false", "0"):
        return True
    # auto: one epoch over one mini-batch is exactly on-policy, so the update's own forward is old_log_prob;
    # except that a KL penalty in the reward needs old log-probs before the update, which then come from the
    # rollout's (rollout.calculate_log_probs) or from the pass.
    if cfg.algorithm.use_kl_in_reward and not a.rollout.calculate_log_probs:
        return False
    return a.actor.ppo_epochs == 1 and a.actor.ppo_mini_batch_size == cfg.data.train_batch_size

class RayPPOTrainer:
    def __init__(self, cfg: HybridFlowConfig, tokenizer, train_dataset, sampler, reward_fn, actor_rollout_ref,
                 critic=None, ref=None, reward_model=None, val_dataset=None, rollout=None):
        """`ref`: the reference group on its own pool; None means the actor group hosts it (its pool).
        `reward_model`: a RewardModelWorker group, or None for rule/user scores only.
        `val_dataset`: an RLDataset of data.val_files, or None when no validation is configured.
        `rollout`: a RolloutWorker group on a pool of its own (trainer.role_pools.rollout), or None: the rollout
        runs in the actor's processes."""
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.dataset = train_dataset
        self.sampler = sampler
        self.reward_fn = reward_fn
        self.actor_rollout = actor_rollout_ref
        self.critic = critic
        self.use_critic = critic is not None
        self.ref = ref if ref is not None else actor_rollout_ref
        self.rm = reward_model
        self.use_ref = cfg.algorithm.use_kl_in_reward or cfg.actor_rollout_ref.actor.use_kl_loss
        self.kl_ctrl = make_kl_controller(cfg.algorithm.kl_ctrl)
        self.run_dir = Path(cfg.trainer.default_local_dir)
        self.ckpt = CheckpointManager(self.run_dir / "checkpoints", cfg.trainer.max_ckpt_to_keep)
        self.n_devices = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
        self.peak_flops, self.peak_source = device_peak_flops(cfg)
        self.val_dataset = val_dataset
        self.last_val_step: int | None = None  # the step whose policy was last validated (kept in checkpoints)
        self.global_step = 0
        self.n_params = None
        # The gen stage and the weights' way to the rollout: one type per generation mode, picked from the config
        # (colocated or on a rollout pool; batch or agent loops; synchronous, one step ahead or fully async).
        self.generation = make_generation(cfg, actor_rollout_ref, rollout, tokenizer, sampler, self.next_batch,
                                          self.total_steps())
        remax.validate_remax(cfg)  # ReMax: its greedy baseline needs the synchronous batch generation
        self.remax = remax.uses_remax(cfg)
        from hybridflow.trainer.timeline import StepTimeline

        groups = [actor_rollout_ref, critic, ref, reward_model]
        self.timeline = StepTimeline(cfg.trainer.timeline_dir, cfg.trainer.timeline_steps, groups,
                                     quiet_to=str(self.run_dir / "logs" / "driver_profiler.log"))
        self.on_resumed = None  # called with the step after resume (hybridflow/trainer/restart.py's log)
        self.on_step = None  # called with (step, metrics) after each step is logged (a launch.sweep trial reports)
        self.last_saved: Path | None = None  # this run's newest committed checkpoint (a restart resumes it)
        self.balance_parts = dp_balance_parts(cfg)

    # ---------------------------------------------------------------- data
    def total_steps(self) -> int:
        if self.cfg.trainer.total_training_steps:
            return int(self.cfg.trainer.total_training_steps)
        return len(self.sampler) * self.cfg.trainer.total_epochs

    def next_batch(self, step: int | None = None) -> DataProto:
        """The prompts of `step` (default: global_step, advanced before the call), which the trace names."""
        from hybridflow.data.rl_dataset import collate

        step = self.global_step if step is None else step
        idx = self.sampler.next_batch()
        # The data trace lets a resumed run be checked against an uninterrupted one (same positions).
        with open(self.run_dir / "data_trace.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "indices": [int(i) for i in idx]}) + "\n")
        rows = [self.dataset[i] for i in idx]
        tensors, objects = collate(rows, self.tokenizer.pad_token_id, self.cfg.data.max_prompt_length)
        objects["uid"] = np.array([str(uuid.uuid4()) for _ in rows], dtype=object)
        return DataProto.from_dict(tensors, objects, {"global_step": step})

    # ---------------------------------------------------------------- stages
    def response_texts(self, batch: DataProto) -> list[str]:
        """The valid response tokens decoded as the rule scorers see them (special tokens dropped)."""
        responses = batch.batch["responses"]
        mask = batch.batch["response_mask"].bool()
        return [self.tokenizer.decode(r[m].tolist(), skip_special_tokens=True)
                for r, m in zip(responses, mask, strict=True)]

    def rule_scores(self, batch: DataProto) -> tuple[torch.Tensor, dict]:
        from hybridflow.rewards.manager import scores_to_token_level

        texts = self.response_texts(batch)
        nt = batch.non_tensor_batch
        scores, metrics = self.reward_fn.score(texts, list(nt["ground_truth"]), list(nt["data_source"]),
                                               list(nt.get("extra_info", [None] * len(texts))))
        scores, extra = shape_batch_scores(self.cfg, batch, scores)  # reward_model.reward_manager (dapo: overlong)
        return scores_to_token_level(scores, batch.batch["response_mask"]), {**metrics, **extra}

    def compute_reward(self, batch: DataProto) -> tuple[torch.Tensor, dict]:
        """token_level_scores: the rule/user scores, the reward model's (`rm_scores`), or both
        (reward_model.reward_mode; see hybridflow.rewards.manager.combine_with_rm)."""
        from hybridflow.rewards.manager import combine_with_rm

        if "rm_scores" not in batch.batch:
            return self.rule_scores(batch)
        mode = self.cfg.reward_model.reward_mode
        if mode == "replace":  # the rule scorers are not called: data sources without one still train
            return combine_with_rm(None, batch.batch["rm_scores"], mode), {}
        rule, metrics = self.rule_scores(batch)
        return combine_with_rm(rule, batch.batch["rm_scores"], mode), metrics

    def compute_advantages(self, batch: DataProto) -> dict:
        alg = self.cfg.algorithm
        b = batch.batch
        out = {}
        if alg.use_kl_in_reward:
            rewards, kl_metrics = apply_kl_penalty(b["token_level_scores"], b["old_log_probs"], b["ref_log_prob"],
                                                   b["response_mask"], self.kl_ctrl, alg.kl_penalty)
            out.update(kl_metrics)
        else:
            rewards = b["token_level_scores"]
        adv, ret = compute_advantage(alg.adv_estimator, rewards, b["response_mask"], values=b.get("values"),
                                     index=batch.non_tensor_batch["uid"], reward_baselines=b.get("reward_baselines"),
                                     gamma=alg.gamma, lam=alg.lam, norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo)
        batch.batch["token_level_rewards"] = rewards
        batch.batch["advantages"] = adv
        batch.batch["returns"] = ret
        return out

    def add_reward_baselines(self, prompts: DataProto, batch: DataProto) -> None:
        """ReMax: the rollout `batch`'s `reward_baselines`, its prompts' greedy scores (hybridflow/trainer/remax.py)."""
        greedy = remax.generate_baseline(self.generation.group, prompts, lambda b: self.score(b)[0])
        batch.batch["reward_baselines"] = remax.per_sample_baselines(greedy, batch.non_tensor_batch["uid"])
        if self.cfg.trainer.rollout_data_dir:
            self.dump_samples(greedy, self.cfg.trainer.rollout_data_dir, stem=remax.BASELINE_STEM)

    def skip_old_log_prob(self) -> bool:
        return skips_old_log_prob(self.cfg)

    def updates_actor(self) -> bool:
        """verl's critic warm-up rule: the actor is updated at steps >= trainer.critic_warmup (global_step counts
        from 1), the critic at every step; critic_warmup=N thus trains only the critic for the first N-1 steps."""
        return self.cfg.trainer.critic_warmup <= self.global_step

    def step(self) -> dict:
        timings: dict[str, float] = {}
        metrics: dict[str, float] = {}
        t_step = time.perf_counter()
        with timer("gen", timings):
            gen = self.generation.next(self.global_step)
        batch = gen.batch
        metrics.update(gen.metrics)
        if self.remax:  # validate_remax admits only the modes that draw the step's prompts now (gen.prompts)
            with timer("gen_baseline", timings):
                self.add_reward_baselines(gen.prompts, batch)
        batch.meta_info["rollout_n"] = self.cfg.actor_rollout_ref.rollout.n  # mini-batches count prompts
        if self.rm is not None:
            with timer("rm", timings):
                batch.union(self.rm.compute_rm_score(batch))
        with timer("reward", timings):
            scores, reward_metrics = self.compute_reward(batch)
            batch.batch["token_level_scores"] = scores
        metrics.update(reward_metrics)
        if self.cfg.trainer.balance_batch:
            # Row order is free here: advantages group rows by uid (GRPO/RLOO/...) or work per row (GAE), and
            # every per-row tensor travels with its row; only which DP rank computes which row changes.
            metrics.update(balance_batch(batch, *self.balance_parts))
        else:  # measured anyway: the number that says whether turning it on would pay
            metrics.update(measure_imbalance(batch, self.balance_parts[1]))
        skip_old = self.skip_old_log_prob()
        if not skip_old:
            with timer("old_log_prob", timings):
                old = self.actor_rollout.compute_log_prob(batch)
                batch.union(old.select(batch_keys=["old_log_probs"]))
                metrics["actor/entropy_rollout"] = float(
                    (old.batch["entropys"] * batch.batch["response_mask"]).sum() / batch.batch["response_mask"].sum())
        else:
            # On-policy single update: the update computes the ratio against its own detached forward. The
            # rollout's log-probs, where computed, stand in until then (the KL penalty in the reward reads them,
            # and the update reports their distance to its forward).
            if "rollout_log_probs" in batch.batch:
                batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
            batch.meta_info["old_log_prob_from_update"] = True
        # algorithm.rollout_correction: bypass (old := rollout) or the decoupled IS weights, and their metrics
        metrics.update(apply_rollout_correction(batch, self.cfg.algorithm.rollout_correction))
        if self.use_ref:
            with timer("ref", timings):
                batch.union(self.ref.compute_ref_log_prob(batch))
        if self.use_critic:
            with timer("values", timings):
                batch.union(self.critic.compute_values(batch))
        with timer("adv", timings):
            metrics.update(self.compute_advantages(batch))
        if self.cfg.trainer.rollout_data_dir:
            self.dump_samples(batch, self.cfg.trainer.rollout_data_dir)
        if self.use_critic:
            with timer("update_critic", timings):
                out = self.critic.update_critic(batch)
                metrics.update(reduce_worker_metrics(_metrics_of(out)))
        actor_updated = self.updates_actor()
        if actor_updated:
            batch.meta_info["loss_agg_mode"] = self.cfg.actor_rollout_ref.actor.loss_agg_mode  # the worker reads it
            with timer("update_actor", timings):
                out = self.actor_rollout.update_actor(batch)
                metrics.update(reduce_worker_metrics(_metrics_of(out)))
        metrics.update(self.generation.after_update(self.global_step, timings))  # the mode's weight sync
        step_time = time.perf_counter() - t_step
        # forward-only stages report their padding share in meta_info (one key per stage, see the workers)
        metrics.update({k: float(v) for k, v in batch.meta_info.items() if k.startswith("perf/padding_fraction/")})
        n_prompt, n_resp = token_counts(batch)
        metrics.update(data_metrics(batch, self.use_critic, rollout_vs_old=not skip_old))
        if skip_old and "actor/rollout_logprob_diff" in metrics:
            metrics["rollout/logprob_diff_mean"] = metrics.pop("actor/rollout_logprob_diff")
        metrics.update(timing_metrics(timings, n_prompt, n_resp))
        # actor FLOPs: one forward per log-prob pass (old, ref) + 3 for the update (fwd + bwd)
        passes = (3 if actor_updated else 0) + (0 if skip_old else 1) + (1 if self.use_ref else 0)
        flops = transformer_flops(self.n_params or 0, n_prompt + n_resp, passes) if self.n_params else None
        metrics.update(throughput_metrics(n_prompt, n_resp, step_time, self.n_devices, flops, self.peak_flops))
        if "timing_s/reshard" in metrics:
            metrics["perf/transition_s"] = metrics["timing_s/reshard"]
        if "timing_s/gen_baseline" in metrics:  # ReMax's greedy generation, as verl names it too
            metrics["timing_s/gen_max"] = metrics["timing_s/gen_baseline"]
        metrics["training/global_step"] = float(self.global_step)
        metrics["training/epoch"] = float(self.sampler.epoch)
        metrics["actor/kl_coef"] = float(self.kl_ctrl.value)
        return metrics

    def dump_samples(self, batch: DataProto, directory: str, append: bool = False, stem: str = "step") -> Path:
        """<directory>/<stem>_<N>.jsonl, one line per sample: what was generated and how it scored.

        trainer.rollout_data_dir gets each training batch; trainer.validation_data_dir each validation
        (appended chunk by chunk). The token ids are there so a sample can be re-scored exactly (text does
        not round-trip every tokenizer).
        """
        out_dir = Path(directory)
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{stem}_{self.global_step}.jsonl"
        with open(path, "a" if append else "w") as f:
            for record in rollout_records(batch, self.tokenizer, self.response_texts(batch), self.global_step):
                f.write(json.dumps(record, default=str) + "\n")
        return path

    # ---------------------------------------------------------------- validation
    def validate(self) -> dict[str, float]:
        """Generate for every val prompt (dataset order, data.val_batch_size at a time) with the val_kwargs
        sampling, score as training does (reward model, then rule/user scorers per reward_model.reward_mode),
        and return verl-named metrics (hybridflow.trainer.validation) plus timing_s/testing.

        Leaves training as it was: the sampler is not used, the KL controller is not read or updated,
        and the rollout seeds validation calls from their own counter (SamplingSettings.is_validation).
        """
        if self.val_dataset is None:
            raise RuntimeError("validate() needs a val dataset: set data.val_files")
        t = time.perf_counter()
        sources, prompts, scores, calls, texts = [], [], [], [], []
        for k, rows in enumerate(validation.chunks(len(self.val_dataset), self.cfg.data.val_batch_size)):
            batch = self.generate_validation([self.val_dataset[i] for i in rows])
            batch.batch["token_level_scores"], _ = self.score(batch)
            calls += [int(c) for c in batch.non_tensor_batch.get("tool_calls", [])]
            sources += [str(s) for s in batch.non_tensor_batch["data_source"]]
            prompts += [int(i) for i in batch.non_tensor_batch["index"]]
            scores += batch.batch["token_level_scores"].sum(-1).tolist()
            if self.cfg.trainer.log_val_generations > 0:  # verl's: a few samples to the console and trackers
                texts += zip(validation.prompt_texts(batch, self.tokenizer), self.response_texts(batch))
            if self.cfg.trainer.validation_data_dir:
                self.dump_samples(batch, self.cfg.trainer.validation_data_dir, append=k > 0)
        metrics = validation.validation_metrics(sources, prompts, scores)
        self.val_generations = validation.pick_generations([i for i, _ in texts], [o for _, o in texts], scores,
                                                  self.cfg.trainer.log_val_generations)
        if calls:  # agent loops: how often the policy used a tool, and how many calls it made
            metrics["val-aux/tool/call_rate"] = sum(c > 0 for c in calls) / len(calls)
            metrics["val-aux/tool/calls_per_trajectory"] = sum(calls) / len(calls)
        metrics["timing_s/testing"] = time.perf_counter() - t
        return metrics

    def generate_validation(self, rows: list[dict]) -> DataProto:
        """The val rows generated with the val sampling (meta_info overrides) through this run's generation mode
        (hybridflow/trainer/generation/batch.py: one call padded to the group's size, or request by request)."""
        from hybridflow.data.rl_dataset import collate

        tensors, objects = collate(rows, self.tokenizer.pad_token_id, self.cfg.data.max_prompt_length)
        sampling = validation.sampling_meta(self.cfg.actor_rollout_ref.rollout.val_kwargs)
        meta = {"global_step": self.global_step, **sampling}
        return self.generation.generate_validation(DataProto.from_dict(tensors, objects, meta))

    def score(self, batch: DataProto) -> tuple[torch.Tensor, dict]:
        """token_level_scores for a batch outside the step (a val batch, ReMax's greedy one) on training's reward
        path: the reward model (the batch padded to its group's size), then compute_reward."""
        if self.rm is not None:
            padded, pad = batch.pad_to_divisor(self.rm.world_size)
            batch.union(self.rm.compute_rm_score(padded).unpad(pad))
        return self.compute_reward(batch)

    def run_validation(self) -> dict[str, float]:
        """validate() for the policy at global_step, remembered for resume, with a one-line console summary."""
        if self.cfg.trainer.validation_data_dir:  # a step validated again after a resume starts its file afresh
            (Path(self.cfg.trainer.validation_data_dir) / f"step_{self.global_step}.jsonl").unlink(missing_ok=True)
        metrics = self.validate()
        self.last_val_step = self.global_step
        from tqdm import tqdm

        tqdm.write(validation.summary_line(self.global_step, metrics, len(self.val_dataset),
                                  self.cfg.actor_rollout_ref.rollout.val_kwargs.n))
        return metrics

    # ---------------------------------------------------------------- checkpoints
    def save(self) -> Path:
        staging = self.ckpt.staging_dir(self.global_step)
        with stage("save_checkpoint"):
            self.actor_rollout.save_checkpoint(str(staging / "actor"), {"global_step": self.global_step})
            fault_point("ckpt_after_actor", self.global_step)
            if self.use_critic:
                self.critic.save_checkpoint(str(staging / "critic"), {"global_step": self.global_step})
        # The sampler as it was before any prompts drawn ahead of their step (one_step_off_policy, fully_async): a
        # resume draws and generates them again, never skipped, never trained twice.
        state = {"global_step": self.global_step, **self.generation.state(self.global_step),
                 "kl_coef": float(self.kl_ctrl.value), "torch_rng": torch.get_rng_state().tolist(),
                 "last_val_step": self.last_val_step}
        self.last_saved = self.ckpt.commit(self.global_step, staging, state)
        return self.last_saved

    def maybe_resume(self) -> int:
        mode = str(self.cfg.trainer.resume_mode)
        if mode == "disable":
            return 0
        if mode == "auto":
            found = self.ckpt.latest()
            if found is None:
                return 0
            step, path = found
        else:
            path = Path(mode)
            if not (path / "COMPLETE").is_file():
                raise FileNotFoundError(f"trainer.resume_mode={mode}: no complete checkpoint there")
        state = CheckpointManager.trainer_state(path)
        self.actor_rollout.load_checkpoint(str(path / "actor"))
        if self.use_critic:
            self.critic.load_checkpoint(str(path / "critic"))
        self.sampler.load_state_dict(state["sampler"])
        self.kl_ctrl.value = state["kl_coef"]
        torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
        self.global_step = int(state["global_step"])
        self.last_val_step = state.get("last_val_step")  # absent in checkpoints from before validation existed
        log.info("resumed from %s at step %d", path, self.global_step)
        return self.global_step

    # ---------------------------------------------------------------- loop
    def prometheus_options(self) -> dict:
        p = self.cfg.trainer.prometheus
        return {"mode": p.mode, "host": p.host, "port": p.port, "linger_s": p.linger_s,
                "joined_cluster": bool(self.cfg.trainer.ray.address)}

    def fit(self) -> list[dict]:
        total = self.total_steps()
        with stage("resume"):
            self.maybe_resume()
        self.generation.prepare(self.global_step)  # a rollout pool starts from the model path: the actor's weights
        # Steps after the checkpoint were done by a run that died; they are redone, so their trace goes
        # (as their metrics rows do, in Tracking).
        prepare_jsonl(self.run_dir / "data_trace.jsonl", self.global_step)
        if self.on_resumed is not None:
            self.on_resumed(self.global_step)
        log.info("perf/mfu/actor uses a peak of %.3g FLOP/s per device (%s)", self.peak_flops, self.peak_source)
        if self.cfg.trainer.critic_warmup > 1:
            log.info("trainer.critic_warmup=%d: steps 1-%d update only the critic, the actor from step %d on",
                     self.cfg.trainer.critic_warmup, self.cfg.trainer.critic_warmup - 1, self.cfg.trainer.critic_warmup)
        tracker = Tracking(self.cfg.trainer.logger, self.run_dir, self.cfg.trainer.project_name,
                           self.cfg.trainer.experiment_name, to_dict(self.cfg), total_steps=total,
                           start_step=self.global_step, prometheus=self.prometheus_options())
        history = []
        validating = self.val_dataset is not None
        try:
            if validating and validation.validate_before_training(self.cfg.trainer.val_before_train, self.global_step,
                                                         self.last_val_step):
                m = self.run_validation()
                tracker.log(m, self.global_step, advance=False)  # not a training step: the bar stays
                tracker.log_generations(self.val_generations, self.global_step)
                history.append({"step": self.global_step, **m})
            while self.global_step < total:
                self.global_step += 1
                with self.timeline.record(self.global_step):
                    m = self.step()
                if validating and validation.should_validate(self.global_step, total, self.cfg.trainer.test_freq):
                    m.update(self.run_validation())  # logged with the step it validates, as verl does
                    tracker.log_generations(self.val_generations, self.global_step)
                tracker.log(m, self.global_step)
                if self.on_step is not None:
                    self.on_step(self.global_step, m)
                history.append({"step": self.global_step, **m})
                sf = self.cfg.trainer.save_freq
                if sf > 0 and (self.global_step % sf == 0 or self.global_step == total):
                    self.save()
        finally:
            self.generation.close()
            tracker.finish()
        return history

    def finish(self, history: list[dict]) -> None:
        from hybridflow.trainer.plots import plot_curves
        from hybridflow.trainer.summary import print_summary

        rows = read_jsonl(self.run_dir / "metrics.jsonl") if (self.run_dir / "metrics.jsonl").is_file() else history
        if rows:
            png = plot_curves(rows, self.run_dir / "curves.png", title=self.cfg.trainer.experiment_name)
            log.info("curves: %s", png)
            print_summary(rows)


def _metrics_of(out) -> dict | list:
    if isinstance(out, DataProto):
        return out.meta_info.get("metrics", {})
    if isinstance(out, list):
        return [o.meta_info.get("metrics", {}) for o in out if isinstance(o, DataProto)]
    return {}
