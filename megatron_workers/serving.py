"""Server mode on a worker (actor_rollout_ref.rollout.mode=async; hybridflow/rollout/server.py drives these), shared
by the colocated rollout (megatron_workers/rollout_role.py, which reshards in `begin_serving`) and the rollout pool's
RolloutWorker (megatron_workers/rollout_worker.py, whose weights arrive by `receive_weights`).

Needs `self.rollout` (a VLLMRollout) and `self.weight_version`; `begin_serving` is the host's own and must call
`_start_serving_clock`.
"""

from __future__ import annotations

import time

import torch

from hybridflow.controller import Dispatch, register

ROLLOUT_MESH = "rollout"


class ServingRole:
    rollout = None
    weight_version = 0

    def _start_serving_clock(self) -> None:
        self._serve_t0 = time.perf_counter()
        self._serve_busy_s = 0.0

    @register(dispatch=Dispatch.DP_PER_REPLICA, mesh=ROLLOUT_MESH)
    def serve_tick(self, requests: list[dict], max_steps: int = 16, meta: dict | None = None) -> list[dict]:
        """One tick of this replica's engine: add `requests`, step until one finishes (see VLLMRollout.serve_tick);
        each finished request comes back tagged with the weight version that sampled it. `meta`
        ({"global_step": the step the weights serve}) only names the call's step (fault injection, logs).

        Every rank of every replica is called each tick, an empty list where its replica got nothing: vLLM's
        data-parallel engines (every multi-replica layout on GPU, t_g > 1 on CPU) step as one collective, and
        the engine itself tells serve_tick to keep them in lockstep (VLLMRollout.steps_in_lockstep)."""
        t = time.perf_counter()
        with torch.profiler.record_function("serve_tick"):
            done = self.rollout.serve_tick(requests, max_steps=max_steps)
        self._serve_busy_s += time.perf_counter() - t
        for d in done:
            d["weight_version"] = self.weight_version
        return done

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def interrupt_serving(self) -> list[dict]:
        """Aborts every request in flight and returns what each sampled so far with the current weights (tagged
        with their version): a weight update in the middle of serving (fully_async). Every TP rank of a
        replica returns the same list."""
        partial = self.rollout.interrupt()
        for d in partial:
            d["weight_version"] = self.weight_version
        return partial

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def end_serving(self) -> dict:
        """Drops whatever is still in flight (the driver only ends a phase once every request it sent came back,
        so anything here is an error path) and releases the engine."""
        aborted = self.rollout.abort_in_flight()
        wall = time.perf_counter() - getattr(self, "_serve_t0", time.perf_counter())
        self.rollout.release()
        return {"rollout/aborted_requests": float(len(aborted)),
                "rollout/engine_busy_frac": getattr(self, "_serve_busy_s", 0.0) / wall if wall > 0 else 0.0}
