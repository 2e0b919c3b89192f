"""fully_async: the rollout pool produces continuously while the trainer trains; one producer thread.

The producer runs an asyncio loop in a thread of the driver. It keeps the rollout server (hybridflow/rollout/
server.py) running on the rollout pool for the whole run, draws the prompt batches of steps k = start+1, start+2,
... in the synchronous loop's order (the same sampler, the same per-trajectory seeds (rollout.seed, k, row, j)),
and runs each batch's trajectories through the agent loops as soon as admission allows. The trainer takes batch k
at step k (`take`), whole and in draw order, and runs the same stages after gen as every other mode.

Admission control (AReaL's rule, by prompt groups): group i of batch k (B groups a batch) may start once
(k-1)B + i < (v + staleness_threshold) B, where v is the rollout's weight version (the weights of step v: the ones
a synchronous run would sample step v with). So every token of batch k was sampled by weights at most
`staleness_threshold` versions older than k's (partial rollouts only ever make them newer), the producer waits
rather than drops, and staleness 0 is the synchronous loop: batch k starts only once the weights of step k have
arrived.

Weight updates (`update_weights`, called by the trainer every trigger_parameter_sync_step steps) go through the
server: in-flight requests are interrupted; with partial_rollout they continue under the new weights from the
tokens they have, without it the trajectory is sampled again from its prompt under the new weights (counted in
rollout/interrupted_dropped: dropped, not silently requeued with mixed versions).

A checkpoint of step k resumes by drawing batch k+1 again (`sampler_state_before(k+1)`): the batches generated
ahead are regenerated after a restart, never skipped and never trained twice. Any failure in the producer (a dead
rollout worker) is raised in the trainer's thread at its next `take` or `update_weights`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from hybridflow.agent.loop import run_many
from hybridflow.protocol import DataProto
from hybridflow.rollout.server_api import RequestInterrupted

log = logging.getLogger(__name__)


class ProducerError(RuntimeError):
    pass


class AsyncProducer:
    """Args:
        draw: draw(k) -> the prompt DataProto of step k (the trainer's next_batch: sampler + data trace).
        sampler: the sampler `draw` advances (its state is kept before every draw, for checkpoints).
        agent_rollout: the AgentRollout whose server and agent loops generate.
        first_step, last_step: the batches to produce (the steps after the resumed one, up to the total).
        version: the rollout pool's weight version now (the weights of that step).
        staleness: async_training.staleness_threshold (>= 0; fractions admit part of a batch early).
        batch_groups: prompt groups per batch (data.train_batch_size).
        partial_rollout: continue interrupted requests (True) or sample them again (False).
        timeout_s: the limit of each blocking wait of the trainer on the producer.
    """

    def __init__(self, draw, sampler, agent_rollout, *, first_step: int, last_step: int, version: int,
                 staleness: float, partial_rollout: bool, batch_groups: int, timeout_s: float = 3600.0):
        if staleness < 0:
            raise ValueError(f"async_training.staleness_threshold={staleness} must be >= 0")
        self.draw, self.sampler, self.ar = draw, sampler, agent_rollout
        self.first_step, self.last_step = first_step, last_step
        self.version, self.staleness, self.partial = version, staleness, partial_rollout
        self.batch_groups = batch_groups
        self.timeout_s = timeout_s
        self._ready: dict[int, tuple[DataProto, dict]] = {}
        self._states: dict[int, dict] = {}  # sampler state before batch k was drawn, for batches not yet trained
        self._cond = threading.Condition()  # guards _ready, _states, _error, the sampler's draws
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._admit: asyncio.Condition | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._idle_s = 0.0  # time the producer waited for admission (the rollout pool had nothing admitted to do)
        self._started = threading.Event()

    # ---- the trainer's side ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._thread_main, name="fully-async-producer", daemon=True)
        self._thread.start()
        if not self._started.wait(self.timeout_s):
            raise ProducerError(f"the fully_async producer did not start within {self.timeout_s:.0f} s")
        self._raise_if_failed()

    def take(self, step: int) -> tuple[DataProto, dict[str, float]]:
        """Batch `step`, whole, once every trajectory of it is done; waits at most timeout_s."""
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while step not in self._ready:
                self._raise_if_failed()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ProducerError(f"fully_async: batch {step} was not ready within {self.timeout_s:.0f} s "
                                        f"(rollout weight version {self.version}, staleness {self.staleness})")
                self._cond.wait(min(left, 5.0))
            batch, metrics = self._ready.pop(step)
            self._states.pop(step, None)
        return batch, metrics

    def update_weights(self, transfer, new_version: int) -> dict:
        """Runs transfer() (the weight sync) between two ticks of the server, then admits what the new version
        allows. Returns the server's update record (interrupt_s, interrupted, transfer: transfer()'s value)."""
        self._raise_if_failed()
        fut = asyncio.run_coroutine_threadsafe(self._update(transfer, new_version), self._loop)
        try:
            return fut.result(self.timeout_s)
        except TimeoutError:
            raise ProducerError(f"fully_async: the weight update to version {new_version} took over "
                                f"{self.timeout_s:.0f} s") from None

    def sampler_state_before(self, step: int) -> dict:
        """The sampler as it was before batch `step` was drawn (its current state if not drawn yet)."""
        with self._cond:
            return self._states[step] if step in self._states else self.sampler.state_dict()

    def idle_s(self) -> float:
        return self._idle_s

    def close(self) -> None:
        """Stops producing, aborts what is in flight, ends the serving phase; waits at most timeout_s."""
        if self._thread is None:
            return
        if self._loop is not None and self._stop is not None:
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # its loop has ended already (the producer failed, or finished)
                pass
        self._thread.join(self.timeout_s)
        if self._thread.is_alive():
            log.error("the fully_async producer did not stop within %.0f s; leaving its thread", self.timeout_s)
        self._thread = None

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    # ---- the producer's thread --------------------------------------------------------------------------------
    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # noqa: BLE001 - handed to the trainer's thread, which raises it
            log.error("fully_async producer failed: %s: %s", type(e).__name__, e)
            with self._cond:
                self._error = e
                self._cond.notify_all()
        finally:
            self._started.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._admit, self._stop = asyncio.Condition(), asyncio.Event()
        self._failed: asyncio.Future = self._loop.create_future()
        self._batches: set[asyncio.Task] = set()
        slots = asyncio.Semaphore(self.ar.rollout_cfg.agent.max_concurrent_trajectories)
        with self.ar.attached(self._loop):  # validation's batches run on this loop, through the same server
            async with self.ar.server.running(weight_version=self.version):
                self._started.set()
                producing = asyncio.create_task(self._guard(self._produce(slots)))
                stopping = asyncio.create_task(self._stop.wait())
                await asyncio.wait({stopping, self._failed}, return_when=asyncio.FIRST_COMPLETED)
                for t in (producing, stopping, *self._batches):
                    t.cancel()
                await asyncio.gather(producing, *self._batches, return_exceptions=True)
        if self._failed.done():
            raise self._failed.result()

    async def _guard(self, work) -> None:
        """A failure anywhere in the producer ends it: the trainer hears of it (the original error, so that a
        dead worker is restarted by trainer.max_restarts)."""
        try:
            await work
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001
            if not self._failed.done():
                self._failed.set_result(root_cause(e))

    def _admitted(self, k: int, group: int) -> bool:
        """AReaL's capacity rule with B prompt groups a batch: group i of batch k (the ((k-1)B + i)-th drawn) may
        start while (k-1)B + i < (version + staleness) B. Staleness 0: batch k waits for the weights of step k."""
        b = self.batch_groups
        return (k - 1) * b + group < (self.version + self.staleness) * b

    async def _wait_admitted(self, k: int, group: int) -> None:
        t = time.perf_counter()
        async with self._admit:
            await self._admit.wait_for(lambda: self._admitted(k, group))
        self._idle_s += time.perf_counter() - t

    async def _produce(self, slots: asyncio.Semaphore) -> None:
        for k in range(self.first_step, self.last_step + 1):
            await self._wait_admitted(k, 0)
            with self._cond:
                self._states[k] = self.sampler.state_dict()
                batch = self.draw(k)
            task = asyncio.create_task(self._guard(self._batch(k, batch, slots)), name=f"batch-{k}")
            self._batches.add(task)
            task.add_done_callback(self._batches.discard)

    async def _batch(self, k: int, batch: DataProto, slots: asyncio.Semaphore) -> None:
        samples = self.ar.samples_of(batch)
        restarts = [0]

        def restarted() -> None:  # partial_rollout=false: sampled again, whole, by the new weights
            restarts[0] += 1

        t = time.perf_counter()
        trajectories = await run_many(self.ar.loop_for(batch), samples, self.ar.server, self.ar.tools,
                                      timeout_s=self.timeout_s, slots=slots,
                                      admit=lambda group: self._wait_admitted(k, group),
                                      group_size=len(samples) // len(batch), sample_again_on=(RequestInterrupted,),
                                      on_sample_again=restarted)
        out, metrics = self.ar.assemble(batch, trajectories, {"rollout/gen_s_per_batch": time.perf_counter() - t})
        metrics["rollout/interrupted_dropped"] = float(restarts[0])
        if "rollout/weight_version_min" in metrics:  # how many versions behind batch k's own its tokens are
            metrics["rollout/staleness_max"] = k - metrics["rollout/weight_version_min"]
            metrics["rollout/staleness_mean"] = k - metrics["rollout/weight_version_mean"]
        with self._cond:
            self._ready[k] = (out, metrics)
            self._cond.notify_all()

    async def _update(self, transfer, new_version: int) -> dict:
        record = await self.ar.server.update_weights(transfer, new_version, partial_rollout=self.partial,
                                                     timeout_s=self.timeout_s)
        async with self._admit:
            self.version = int(new_version)
            self._admit.notify_all()
        return record


def root_cause(e: BaseException) -> BaseException:
    """The worker error behind a failure, if there is one: the first of an exception group, then the cause of a
    server error (the ticker's WorkerDiedError), so the restart logic sees what it knows."""
    from hybridflow.controller.errors import WorkerDiedError, WorkerError, WorkerTimeoutError

    seen = set()
    while id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, WorkerDiedError | WorkerTimeoutError | WorkerError):
            return e
        if isinstance(e, BaseExceptionGroup) and e.exceptions:
            e = e.exceptions[0]
        elif e.__cause__ is not None:
            e = e.__cause__
        else:
            break
    return e
