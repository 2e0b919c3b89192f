"""Errors the driver sees from worker groups: always naming the role, the rank and the method."""


class WorkerError(RuntimeError):
    """A worker method raised; carries the worker-side traceback."""

    def __init__(self, role: str, rank: int, method: str, remote_traceback: str):
        self.role, self.rank, self.method = role, rank, method
        self.remote_traceback = remote_traceback
        super().__init__(f"worker '{role}' rank {rank} raised in {method}():\n{remote_traceback}")


class WorkerDiedError(RuntimeError):
    """A worker process died (killed, OOM, segfault)."""

    def __init__(self, role: str, rank: int, method: str, detail: str = ""):
        self.role, self.rank, self.method = role, rank, method
        super().__init__(f"worker '{role}' rank {rank} died during {method}(): {detail}".rstrip(": "))


class WorkerTimeoutError(TimeoutError):
    """A blocking wait on workers ran past its timeout."""

    def __init__(self, role: str, method: str, pending_ranks: list[int], timeout_s: float):
        self.role, self.method, self.pending_ranks = role, method, pending_ranks
        super().__init__(
            f"worker '{role}' {method}() did not finish within {timeout_s:.0f} s; ranks still pending: {pending_ranks}"
        )
