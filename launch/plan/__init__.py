"""launch.plan: will a HybridFlow config fit its GPUs, and roughly how long is one step? No GPU, no weights.

    python -m launch.plan configs/recipes/llama3_70b_ppo_16nodes.yaml --recompute selective
    python -m launch.plan --against-published

Modules: shapes (model shapes: config.json or a known table), devices (GPU/network table), memory (bytes per
parameter, activation formulas, KV cache), fit (per-stage memory peak and the fit check), lengths (response-length
distributions), batching (vLLM's admission and preemption over the KV cache), step_time (seconds per stage),
async_step (split pools: overlap, weight sync, idle shares), published (published figures, leave-one-source-out),
report (tables, recipe headers).
`make_plan` is what the CLI and the tests call.
"""

from __future__ import annotations

from dataclasses import dataclass

from launch.plan.fit import MemoryPlan, plan_memory
from launch.plan.job import Job, Options, PlanInputError, read_job
from launch.plan.step_time import StageTime, step_times


@dataclass(frozen=True)
class Plan:
    job: Job
    memory: MemoryPlan
    stages: tuple[StageTime, ...]

    @property
    def step_s(self) -> float:
        """The stages one after another; on the async layout, async_step_s of generation, training and the sync."""
        if self.job.rollout_pool:
            from launch.plan.async_step import async_step_s

            return async_step_s(*self.async_parts, self.job.async_mode, self.job.staleness)
        return sum(s.seconds for s in self.stages)

    @property
    def async_parts(self) -> tuple[float, float, float]:
        """(generation on the rollout pool, training stages on the actor's pool, weight sync per step) seconds."""
        gen = sum(s.seconds for s in self.stages if s.name == "generate")
        sync = sum(s.seconds for s in self.stages if s.name in ("weight_sync", "transition"))
        return gen, sum(s.seconds for s in self.stages) - gen - sync, sync

    @property
    def idle_fractions(self) -> tuple[float, float] | None:
        """(rollout pool, training pool) idle shares of the step on the async layout; None otherwise."""
        if not self.job.rollout_pool:
            return None
        from launch.plan.async_step import idle_fractions

        return idle_fractions(*self.async_parts, self.job.async_mode, self.job.staleness)

    @property
    def tokens(self) -> float:
        """Real prompt + response tokens of one step (verl's perf/total_num_tokens): the response-length distribution's
        mean (every response at the budget when none is given)."""
        return self.job.sequences * self.job.mean_tokens

    @property
    def tokens_per_gpu_s(self) -> float:
        """verl's perf/throughput: tokens / (step time * GPUs)."""
        return self.tokens / (self.step_s * self.job.total_gpus)


def plan_config(cfg, options: Options | None = None) -> Plan:
    """Plan a loaded HybridFlowConfig."""
    job = read_job(cfg, options or Options())
    try:
        stages = tuple(step_times(job))
    except ValueError as e:
        raise PlanInputError(str(e)) from None
    return Plan(job, plan_memory(job), stages)


def make_plan(config_path, overrides: list[str] | None = None, options: Options | None = None) -> Plan:
    """Load a config file (+ dotlist overrides) with the trainer's loader and plan it."""
    from hybridflow.config.load import ConfigError, load_config

    try:
        cfg = load_config(config_path, overrides or [])
    except ConfigError as e:
        raise PlanInputError(str(e)) from None
    return plan_config(cfg, options)


__all__ = ["Job", "MemoryPlan", "Options", "Plan", "PlanInputError", "StageTime", "make_plan", "plan_config"]
