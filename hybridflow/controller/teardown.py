"""Taking a driver's workers down: on a normal end, on an error, and on SIGTERM (`ray job stop`).

`ray job stop` sends the entrypoint SIGTERM, waits RAY_JOB_STOP_WAIT_TIME_S (3 s by default), then SIGKILL.
The handler turns SIGTERM into SystemExit in the main thread, so the driver unwinds through its `finally`
blocks (the tracker closes its files) and `Teardown.close()` kills every worker group and removes every
placement group the driver made. Nothing here is detached: if SIGKILL comes first, Ray's own cleanup of a
dead driver's actors and placement groups does the same.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time

log = logging.getLogger(__name__)


class Teardown:
    """The worker groups and resource pools a driver created, in creation order."""

    def __init__(self):
        self.groups: list = []
        self.pools: list = []

    def add_pool(self, pool) -> None:
        if all(p is not pool for p in self.pools):
            self.pools.append(pool)

    def add_group(self, group) -> None:
        self.groups.append(group)

    def close(self) -> None:
        """Kill the groups (newest first), then remove the pools' placement groups; each step on its own, so one
        failure (e.g. Ray already gone) does not leave the rest up."""
        t0 = time.monotonic()
        n_groups, n_pools = len(self.groups), len(self.pools)
        for group in reversed(self.groups):
            try:
                group.kill()
            except Exception as e:  # noqa: BLE001 - teardown goes on
                log.warning("killing worker group %s: %s", getattr(group, "role", group), e)
        for pool in reversed(self.pools):
            try:
                pool.remove()
            except Exception as e:  # noqa: BLE001
                log.warning("removing placement groups of pool %s: %s", getattr(pool, "name", pool), e)
        self.groups.clear()
        self.pools.clear()
        if n_groups or n_pools:
            log.info("teardown: %d worker groups killed, %d pools' placement groups removed in %.2f s", n_groups,
                     n_pools, time.monotonic() - t0)


@contextlib.contextmanager
def exit_on_sigterm():
    """Within the block, SIGTERM raises SystemExit(143) in the main thread, so the block unwinds through its
    `finally`s (put the Teardown there). Once out of the block the process ends at once: os._exit after
    ray.shutdown and a flush, because the interpreter's own exit (atexit hooks, torch and friends' finalizers)
    took 2.5 s of Ray's 3 s grace on a loaded machine and the job was SIGKILLed. A second SIGTERM during the
    unwinding is ignored so the teardown can finish. Without a signal the previous handler comes back.

    Install it after ray.init: Ray's init sets its own SIGTERM handler (a bare sys.exit).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = []

    def handler(signum, frame):
        if fired:
            return
        fired.append(signum)
        log.warning("received %s: stopping the worker groups and removing the placement groups",
                    signal.Signals(signum).name)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        if fired:
            _exit_now(128 + fired[0])
        signal.signal(signal.SIGTERM, previous)


def _exit_now(code: int) -> None:
    import ray

    try:
        ray.shutdown()  # the job's driver leaves the cluster cleanly (Ray would notice its death anyway)
    finally:
        log.info("exiting with %d", code)
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
