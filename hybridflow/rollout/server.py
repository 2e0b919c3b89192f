"""Server mode (actor_rollout_ref.rollout.mode=async): requests one at a time, token ids in and out.

The driver's agent loops call `RolloutServer.generate` concurrently (asyncio). The server keeps, per
generation replica, the requests not yet sent; one task ("the ticker") sends them all in one worker-group
call, `serve_tick` (dispatch DP_PER_REPLICA: replica d's list goes to every TP rank of replica d), which adds
them to each replica's running vLLM engine and steps it until a request finishes. The finished ones resolve
their callers' futures; the unfinished stay in the engine. So trajectories enter and leave the engine's
continuous batch every few decode steps, and a tool call that runs on the driver overlaps the other
trajectories' decoding instead of stalling a whole batch.

Routing: a `route_key` (an agent loop passes its trajectory id) sticks to the replica it was first sent
to, so each turn of a trajectory finds its prefix in that replica's KV cache; a new key goes to the replica
with the fewest requests in flight (ties: the lowest index), which keeps replicas even.

Weights do not change while the server runs: `begin` reshards them once (the 3D-HybridEngine, colocated) and
tags every output with that version; `end` releases the engine. Every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import asdict

from hybridflow.rollout.server_api import TokenOutput, TurnSampling

log = logging.getLogger(__name__)


class ServerError(RuntimeError):
    pass


class RolloutServer:
    """Args:
        group: the actor-rollout worker group (methods begin_serving, serve_tick, end_serving).
        num_replicas: its rollout mesh's dp size.
        max_steps_per_tick: engine steps per tick at most; a new request waits at most this many steps.
        tick_timeout_s: one tick's limit (a tick is at most max_steps_per_tick decode steps).
        request_timeout_s: one request's limit, from generate() to its tokens.
    """

    def __init__(self, group, num_replicas: int, *, max_steps_per_tick: int = 16, tick_timeout_s: float = 300.0,
                 request_timeout_s: float = 900.0):
        if num_replicas < 1 or max_steps_per_tick < 1:
            raise ValueError(f"RolloutServer: num_replicas={num_replicas} and max_steps_per_tick="
                             f"{max_steps_per_tick} must be >= 1")
        self.group = group
        self.num_replicas = num_replicas
        self.max_steps_per_tick = max_steps_per_tick
        self.tick_timeout_s = tick_timeout_s
        self.request_timeout_s = request_timeout_s
        self._ids = itertools.count()
        self._route: dict[str, int] = {}
        self._reset_counters()

    def _reset_counters(self) -> None:
        self._pending: list[list[dict]] = [[] for _ in range(self.num_replicas)]
        self._in_flight = [0] * self.num_replicas
        self._futures: dict[str, asyncio.Future] = {}
        self.stats = {"ticks": 0, "requests": 0, "tick_s": 0.0, "idle_ticks": 0}

    # ---- routing (pure) ----------------------------------------------------------------------------
    def replica_for(self, route_key: str) -> int:
        if route_key not in self._route:
            load = [self._in_flight[r] + len(self._pending[r]) for r in range(self.num_replicas)]
            self._route[route_key] = min(range(self.num_replicas), key=lambda r: (load[r], r))
        return self._route[route_key]

    # ---- the agent loops' side ---------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], sampling: TurnSampling, route_key: str) -> TokenOutput:
        if self._wake is None:
            raise ServerError("RolloutServer.generate outside `async with server.running(...)`")
        if sampling.max_tokens < 1:
            raise ValueError(f"a request needs max_tokens >= 1, got {sampling.max_tokens}")
        rid = f"r{next(self._ids)}"
        fut = asyncio.get_running_loop().create_future()
        self._futures[rid] = fut
        request = {"request_id": rid, "prompt_ids": [int(t) for t in prompt_ids], **asdict(sampling)}
        request["stop_token_ids"] = list(sampling.stop_token_ids)
        self._pending[self.replica_for(route_key)].append(request)
        self.stats["requests"] += 1
        self._wake.set()
        try:
            return await asyncio.wait_for(fut, self.request_timeout_s)
        except TimeoutError:
            raise ServerError(f"request {rid} (route {route_key!r}) got no tokens within "
                              f"{self.request_timeout_s:.0f} s (rollout.agent.request_timeout_s)") from None

    # ---- the ticker ----------------------------------------------------------------------------------
    _wake: asyncio.Event | None = None

    @contextlib.asynccontextmanager
    async def running(self, weight_version: int):
        """Reshards the weights in (`begin_serving`), runs the ticker while the body runs, and ends the phase.
        Yields begin_serving's per-rank metrics (reshard timing, bytes); `end_metrics` holds end_serving's."""
        self._reset_counters()
        begin = await asyncio.to_thread(lambda: self.group.begin_serving.remote(weight_version).get())
        self._wake = asyncio.Event()
        self._stopping = False
        ticker = asyncio.create_task(self._ticker(), name="rollout-server-ticker")
        t0 = time.perf_counter()
        try:
            yield begin
        finally:
            self._stopping = True
            self._wake.set()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(ticker, self.tick_timeout_s)
            self._wake = None
            self.stats["wall_s"] = time.perf_counter() - t0
            self.end_metrics = await asyncio.to_thread(lambda: self.group.end_serving.remote().get())
            for f in self._futures.values():  # only on an error path: a caller that gave up, or the ticker failed
                if not f.done():
                    f.set_exception(ServerError("the rollout server stopped with this request in flight"))

    async def _ticker(self) -> None:
        try:
            while True:
                if self._stopping and not self._futures:  # nobody waits any more (end_serving aborts leftovers)
                    return
                if not any(self._pending) and not any(self._in_flight):
                    if self._stopping:
                        return
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                batch, self._pending = self._pending, [[] for _ in range(self.num_replicas)]
                for r, reqs in enumerate(batch):
                    self._in_flight[r] += len(reqs)
                t = time.perf_counter()
                outs = await asyncio.to_thread(self._tick, batch)
                self.stats["tick_s"] += time.perf_counter() - t
                self.stats["ticks"] += 1
                self._deliver(outs)
                # Let the loops whose turn just ended send their next turn before the next tick goes out.
                await asyncio.sleep(0)
        except BaseException as e:  # noqa: BLE001 - every waiting caller must hear of it, then it propagates
            for f in self._futures.values():
                if not f.done():
                    f.set_exception(ServerError(f"rollout server tick failed: {type(e).__name__}: {e}"))
            self._futures.clear()
            raise

    def _tick(self, batch: list[list[dict]]) -> list[list[dict]]:
        fut = self.group.serve_tick.remote(batch, max_steps=self.max_steps_per_tick)
        return fut.get(self.tick_timeout_s)

    def _deliver(self, outs: list[list[dict]]) -> None:
        if len(outs) != self.num_replicas:
            raise ServerError(f"serve_tick returned {len(outs)} replica outputs, expected {self.num_replicas}")
        if not any(outs):
            self.stats["idle_ticks"] += 1
        for r, done in enumerate(outs):
            for d in done:
                self._in_flight[r] -= 1
                fut = self._futures.pop(d["request_id"], None)
                if fut is None:
                    raise ServerError(f"replica {r} returned request {d['request_id']!r}, which no caller waits for")
                if not fut.done():
                    fut.set_result(TokenOutput(token_ids=list(d["token_ids"]), log_probs=d.get("log_probs"),
                                               finish_reason=d["finish_reason"],
                                               weight_version=int(d.get("weight_version", 0))))

    def metrics(self) -> dict[str, float]:
        s = self.stats
        out = {"rollout/server_ticks": float(s["ticks"]), "rollout/server_requests": float(s["requests"]),
               "rollout/server_tick_s_mean": s["tick_s"] / s["ticks"] if s["ticks"] else 0.0}
        if s.get("wall_s"):
            # the share of the phase the driver spent waiting on ticks (the rest: tools, loops, the event loop)
            out["rollout/server_tick_frac"] = s["tick_s"] / s["wall_s"]
        return out
