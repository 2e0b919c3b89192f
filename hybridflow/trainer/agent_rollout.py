"""The `gen` stage in server mode (actor_rollout_ref.rollout.mode=async): agent loops over the rollout server.

`AgentGeneration` (hybridflow/trainer/generation/batch.py) calls `AgentRollout.generate(batch)` where the batch
mode calls `generate_sequences`; what comes back has the same keys and shapes (hybridflow/rollout/base.py), with
`response_mask` 0 on tool tokens, so every stage after `gen` (reward, old_log_prob, ref, values, adv, updates) runs
unchanged: one trainer.

Each prompt row i is sampled n times; trajectory (i, j) gets its own seed from (rollout.seed, step, i, j), so
its draws do not depend on what else is in flight, and its route key is the row's uid, so the n samples of a
prompt share one replica and its prefix cache. The loops run as asyncio tasks on the driver.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import numpy as np

from hybridflow.agent.loop import stable_seed
from hybridflow.config.server_mode_checks import turn_budget
from hybridflow.protocol import DataProto
from hybridflow.rollout.server import RolloutServer
from hybridflow.rollout.server_api import TurnSampling

log = logging.getLogger(__name__)


def trajectory_seed(seed: int, step: int, row: int, sample: int, validation: bool) -> int:
    """From (rollout.seed, step, row, sample) as every seed of the agent loops is made; validation draws from a
    stream of its own."""
    return stable_seed(seed, step, row, sample, 1 if validation else 0)


def prompt_ids_of(batch: DataProto) -> list[list[int]]:
    """Each row's prompt without its left padding."""
    ids, mask = batch.batch["input_ids"].tolist(), batch.batch["attention_mask"].tolist()
    return [[t for t, m in zip(r, mk, strict=True) if m] for r, mk in zip(ids, mask, strict=True)]


class AgentRollout:
    def __init__(self, cfg, group, tokenizer):
        self.cfg = cfg
        self.rollout_cfg = r = cfg.actor_rollout_ref.rollout
        self.tokenizer = tokenizer
        self.group = group
        self.server = RolloutServer(group, group.world_size // r.tensor_model_parallel_size,
                                    max_steps_per_tick=r.agent.max_steps_per_tick,
                                    request_timeout_s=r.agent.request_timeout_s)
        mt = r.multi_turn
        self.tools = None
        if mt.enable:
            from hybridflow.agent.tools import ToolSet, load_tools

            self.tools = (load_tools(mt.tool_config_path, timeout_s=mt.tool_timeout_s, memory_mb=mt.tool_memory_mb)
                          if mt.tool_config_path else ToolSet())

    def sampling(self, meta: dict) -> tuple[TurnSampling, int, bool]:
        """(the turns' sampling, n, is validation) from the config and a call's meta_info overrides (the keys
        of hybridflow.rollout.base.SAMPLING_OVERRIDE_KEYS, as the batch mode reads them)."""
        r = self.rollout_cfg
        do_sample = bool(meta.get("do_sample", True))
        s = TurnSampling(max_tokens=min(turn_budget(r), int(meta.get("response_length", r.response_length))),
                         temperature=float(meta.get("temperature", r.temperature)),
                         top_p=float(meta.get("top_p", r.top_p)), top_k=int(meta.get("top_k", r.top_k)),
                         greedy=not do_sample, stop_token_ids=tuple(r.stop_token_ids))
        return s, int(meta.get("n", r.n)), bool(meta.get("validate", False))

    def make_loop(self, sampling: TurnSampling, response_length: int):
        from hybridflow.agent.loop import SingleTurnAgentLoop, ToolAgentLoop

        r = self.rollout_cfg
        mt = r.multi_turn
        if self.tools is None:
            return SingleTurnAgentLoop(response_length, sampling, request_timeout_s=r.agent.request_timeout_s)
        return ToolAgentLoop(self.tokenizer, mt.format, response_length=response_length, sampling=sampling,
                             max_assistant_turns=mt.max_assistant_turns, max_parallel_calls=mt.max_parallel_calls,
                             max_tool_response_length=mt.max_tool_response_length,
                             tool_response_truncate_side=mt.tool_response_truncate_side,
                             request_timeout_s=r.agent.request_timeout_s)

    def generate(self, batch: DataProto) -> tuple[DataProto, dict[str, float]]:
        """One batch through the server: its own serving phase (`server.running`), or, while fully_async's
        producer keeps the server running in its thread (`attached_loop`), a coroutine on that loop."""
        if self.attached_loop is not None:
            return asyncio.run_coroutine_threadsafe(self.run_batch(batch), self.attached_loop).result(
                TRAJECTORY_TIMEOUT_S)
        return asyncio.run(self._generate(batch))

    attached_loop: asyncio.AbstractEventLoop | None = None

    @contextlib.contextmanager
    def attached(self, loop: asyncio.AbstractEventLoop):
        """While fully_async's producer keeps the server running on `loop`, every batch (validation's too) runs
        there, through the same server."""
        self.attached_loop = loop
        try:
            yield
        finally:
            self.attached_loop = None

    def busy_s(self) -> float:
        """The server's busy time so far (its ticks), summed over the run."""
        return self.server.stats["tick_s"]

    def server_metrics(self) -> dict[str, float]:
        return self.server.metrics()

    def samples_of(self, batch: DataProto) -> list[dict]:
        """One sample per (row, j): the row's fields, its unpadded prompt, its seed and its route key."""
        r = self.rollout_cfg
        _, n, validation = self.sampling(batch.meta_info)
        step = int(batch.meta_info.get("global_step", 0))
        uids = batch.non_tensor_batch.get("uid")
        # validation walks the val set in chunks: its rows' dataset index keeps their seeds apart across chunks
        index = batch.non_tensor_batch.get("index") if validation else None
        samples = []
        for i, ids in enumerate(prompt_ids_of(batch)):
            row = int(index[i]) if index is not None else i
            for j in range(n):
                samples.append({**{k: v[i] for k, v in batch.non_tensor_batch.items()},
                                "prompt_ids": ids, "uid": f"{row}.{j}",
                                "route_key": str(uids[i]) if uids is not None else f"row{row}",
                                "seed": trajectory_seed(r.seed, step, row, j, validation)})
        return samples

    def loop_for(self, batch: DataProto):
        sampling, _, _ = self.sampling(batch.meta_info)
        return self.make_loop(sampling, int(batch.meta_info.get("response_length", self.rollout_cfg.response_length)))

    async def run_batch(self, batch: DataProto) -> tuple[DataProto, dict[str, float]]:
        """The batch's trajectories on a server that is running already."""
        from hybridflow.agent.loop import run_many

        t = time.perf_counter()
        trajectories = await run_many(self.loop_for(batch), self.samples_of(batch), self.server, self.tools,
                                      concurrency=self.rollout_cfg.agent.max_concurrent_trajectories,
                                      timeout_s=TRAJECTORY_TIMEOUT_S)
        return self.assemble(batch, trajectories, {"rollout/gen_s_per_replica": time.perf_counter() - t})

    async def _generate(self, batch: DataProto) -> tuple[DataProto, dict[str, float]]:
        step = int(batch.meta_info.get("global_step", 0))
        async with self.server.running(weight_version=step) as begin:
            out, metrics = await self.run_batch(batch)
        metrics.update(_mean_over_ranks(begin))
        metrics.update(_mean_over_ranks(self.server.end_metrics))
        metrics.update(self.server.metrics())
        return out, metrics

    def assemble(self, batch: DataProto, trajectories, metrics: dict[str, float]) -> tuple[DataProto, dict]:
        """The verl-shaped rollout batch of `batch`'s trajectories (row i's n samples together, in order) and
        gen's metrics: the agent metrics and the weight versions the model tokens were sampled by."""
        from hybridflow.agent.loop import agent_metrics
        from hybridflow.agent.trajectory import to_batch

        _, n, _ = self.sampling(batch.meta_info)
        response_length = int(batch.meta_info.get("response_length", self.rollout_cfg.response_length))
        rows = batch.repeat(n, interleave=True) if n > 1 else batch[:]
        out = to_batch(trajectories, self.tokenizer.pad_token_id, batch.batch["input_ids"].shape[1], response_length)
        for k, v in rows.non_tensor_batch.items():
            out.non_tensor_batch[k] = v
        out.meta_info.update(batch.meta_info)
        if self.tools is not None:
            metrics.update(agent_metrics(trajectories))
        lo = [tr.min_weight_version for tr in trajectories if tr.min_weight_version is not None]
        hi = [tr.max_weight_version for tr in trajectories if tr.max_weight_version is not None]
        if lo:
            metrics.update({"rollout/weight_version_min": float(min(lo)), "rollout/weight_version_max": float(max(hi)),
                            "rollout/weight_version_mean": float(np.mean(lo + hi))})
        return out, metrics


# One trajectory's backstop: each request and each tool call has its own, tighter limit.
TRAJECTORY_TIMEOUT_S = 3600.0


def _mean_over_ranks(parts) -> dict[str, float]:
    from hybridflow.trainer.metrics import reduce_worker_metrics

    return reduce_worker_metrics(parts if isinstance(parts, list) else [parts])
