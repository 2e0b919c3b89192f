"""Server mode (actor_rollout_ref.rollout.mode=async): requests one at a time, token ids in and out.

The driver's agent loops call `RolloutServer.generate` concurrently (asyncio). The server keeps, per
generation replica, the requests not yet sent; one task ("the ticker") sends them all in one worker-group
call, `serve_tick` (dispatch DP_PER_REPLICA: replica d's list goes to every TP rank of replica d), which adds
them to each replica's running vLLM engine and steps it until a request finishes (vLLM's data-parallel replicas,
whose steps are collectives, step together: until a request finishes on any of them). Every replica gets the call,
with an empty list where it has nothing new. The finished ones resolve their callers' futures; the unfinished stay
in the engine. So trajectories enter and leave the engine's continuous batch every few decode steps, and a tool
call that runs on the driver overlaps the other trajectories' decoding instead of stalling a whole batch.

Routing: a `route_key` (an agent loop passes its trajectory id) sticks to the replica it was first sent
to, so each turn of a trajectory finds its prefix in that replica's KV cache; a new key goes to the replica
with the fewest requests in flight (ties: the lowest index), which keeps replicas even.

Weights: colocated, they do not change while the server runs: `begin` reshards them once (the 3D-HybridEngine)
and tags every output with that version; `end` releases the engine. On a rollout pool of its own (fully_async)
`update_weights` changes them between two ticks: it pauses the ticker, interrupts what is in flight
(`interrupt_serving`), runs the weight transfer, and resumes. With partial rollouts an interrupted request is
continued under the new weights from the tokens it has (prompt + those tokens, the rest of its max_tokens) and
its caller gets the whole, with each token's version; without, its caller gets RequestInterrupted and the tokens
are dropped. Every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import time
from dataclasses import asdict

from hybridflow.rollout.server_api import RequestInterrupted, TokenOutput, TurnSampling

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
        self._requests: dict[str, tuple[int, dict]] = {}  # caller's id -> (replica, its request as first sent)
        self._carry: dict[str, tuple[list[int], list[float] | None, list[int]]] = {}  # partial rollouts so far
        self._alias: dict[str, str] = {}  # a continuation's engine id -> the caller's id
        self._paused = False
        self.version: int | None = None
        self.stats = {"ticks": 0, "requests": 0, "tick_s": 0.0, "idle_ticks": 0, "interrupted": 0,
                      "continued": 0, "dropped": 0}

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
        replica = self.replica_for(route_key)
        self._requests[rid] = (replica, request)
        self._pending[replica].append(request)
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
        self.version = int(weight_version)
        self._tick_lock = asyncio.Lock()
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
                if self._stopping and all(f.done() for f in self._futures.values()):
                    # nobody waits any more (callers that were cancelled left their futures); end_serving aborts
                    # what is still in the engine
                    return
                if self._paused or not any(self._pending) and not any(self._in_flight):
                    if self._stopping and not self._paused:
                        return
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                async with self._tick_lock:  # update_weights waits for the tick in progress, then holds the lock
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
                    err = ServerError(f"rollout server tick failed: {type(e).__name__}: {e}")
                    err.__cause__ = e  # the worker error itself, for the restart logic (trainer.max_restarts)
                    f.set_exception(err)
            self._futures.clear()
            raise

    def _tick(self, batch: list[list[dict]]) -> list[list[dict]]:
        fut = self.group.serve_tick.remote(batch, max_steps=self.max_steps_per_tick,
                                           meta={"global_step": self.version})
        return fut.get(self.tick_timeout_s)

    def _deliver(self, outs: list[list[dict]]) -> None:
        if len(outs) != self.num_replicas:
            raise ServerError(f"serve_tick returned {len(outs)} replica outputs, expected {self.num_replicas}")
        if not any(outs):
            self.stats["idle_ticks"] += 1
        for r, done in enumerate(outs):
            for d in done:
                self._in_flight[r] -= 1
                rid = self._alias.pop(d["request_id"], d["request_id"])
                fut = self._futures.pop(rid, None)
                self._requests.pop(rid, None)
                if fut is None:
                    raise ServerError(f"replica {r} returned request {d['request_id']!r}, which no caller waits for")
                if not fut.done():
                    fut.set_result(self._stitched(rid, d))

    def _stitched(self, rid: str, d: dict) -> TokenOutput:
        """What the caller gets: the tokens of every version the request ran under, in order."""
        version = int(d.get("weight_version", 0))
        toks, lps = list(d["token_ids"]), d.get("log_probs")
        if rid not in self._carry:
            return TokenOutput(token_ids=toks, log_probs=lps, finish_reason=d["finish_reason"], weight_version=version)
        c_toks, c_lps, c_versions = self._carry.pop(rid)
        log_probs = None if c_lps is None or lps is None else c_lps + list(lps)
        return TokenOutput(token_ids=c_toks + toks, log_probs=log_probs, finish_reason=d["finish_reason"],
                           weight_version=version, token_versions=c_versions + [version] * len(toks))

    # ---- weight updates while serving (a rollout pool of its own) --------------------------------------------
    async def update_weights(self, transfer, new_version: int, *, partial_rollout: bool,
                             timeout_s: float = 900.0) -> dict[str, float]:
        """Between two ticks: interrupt what is in flight, run `transfer()` (blocking: the weight sync, in a thread;
        its return value comes back in "transfer"), tag what follows with `new_version`, resume. Interrupted
        requests are continued (partial_rollout) or fail with RequestInterrupted."""
        if self._wake is None:
            raise ServerError("RolloutServer.update_weights outside `async with server.running(...)`")
        self._paused = True
        try:
            async with self._tick_lock:
                t = time.perf_counter()
                ranks = await asyncio.to_thread(lambda: self.group.interrupt_serving.remote().get(timeout_s))
                partial = {d["request_id"]: d for rank in ranks for d in rank}  # TP ranks of a replica agree
                for eng_id, d in partial.items():
                    self._requeue_or_drop(eng_id, d, partial_rollout)
                interrupt_s = time.perf_counter() - t
                result = await asyncio.to_thread(transfer)
                self.version = int(new_version)
        finally:
            self._paused = False
            self._wake.set()
        return {"interrupt_s": interrupt_s, "interrupted": float(len(partial)), "transfer": result}

    def _requeue_or_drop(self, eng_id: str, d: dict, partial_rollout: bool) -> None:
        rid = self._alias.pop(eng_id, eng_id)
        if rid not in self._futures:
            return  # its caller gave up already
        replica, request = self._requests[rid]
        self._in_flight[replica] -= 1
        self.stats["interrupted"] += 1
        if not partial_rollout:
            self.stats["dropped"] += 1
            self._requests.pop(rid)
            self._carry.pop(rid, None)
            fut = self._futures.pop(rid)
            if not fut.done():
                fut.set_exception(RequestInterrupted(f"request {rid} was interrupted by the update to weight version "
                                                     f"{self.version}; partial_rollout is off, so its tokens are "
                                                     "dropped"))
            return
        c_toks, c_lps, c_versions = self._carry.get(rid, ([], [], []))
        toks, lps = list(d["token_ids"]), d.get("log_probs")
        c_toks = c_toks + toks
        c_lps = None if c_lps is None or lps is None else c_lps + list(lps)
        c_versions = c_versions + [int(d.get("weight_version", 0))] * len(toks)
        self._carry[rid] = (c_toks, c_lps, c_versions)
        self.stats["continued"] += 1
        left = int(request["max_tokens"]) - len(c_toks)
        if left < 1:  # cannot happen (a request at max_tokens has finished); do not send an empty request
            raise ServerError(f"request {rid}: interrupted with {len(c_toks)} of max_tokens={request['max_tokens']}")
        cont_id = f"{rid}+{len(c_versions)}"
        self._alias[cont_id] = rid
        seed = request.get("seed")
        cont = {**request, "request_id": cont_id, "prompt_ids": request["prompt_ids"] + c_toks, "max_tokens": left,
                "seed": None if seed is None else _continuation_seed(seed, len(c_toks))}
        self._pending[replica].append(cont)

    def metrics(self) -> dict[str, float]:
        s = self.stats
        out = {"rollout/server_ticks": float(s["ticks"]), "rollout/server_requests": float(s["requests"]),
               "rollout/server_tick_s_mean": s["tick_s"] / s["ticks"] if s["ticks"] else 0.0}
        if s["interrupted"]:  # weight updates while serving (fully_async)
            out.update({"rollout/interrupted_requests": float(s["interrupted"]),
                        "rollout/continued_requests": float(s["continued"]),
                        "rollout/dropped_requests": float(s["dropped"])})
        if s.get("wall_s"):
            # the share of the phase the driver spent waiting on ticks (the rest: tools, loops, the event loop)
            out["rollout/server_tick_frac"] = s["tick_s"] / s["wall_s"]
        return out


def _continuation_seed(seed: int, done_tokens: int) -> int:
    """A continued request's seed: its own stream (reusing the request's would replay the draws of its start)."""
    digest = hashlib.blake2b(f"{int(seed)}+{int(done_tokens)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF
