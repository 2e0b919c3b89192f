"""Megatron's schedule timers as torch.profiler ranges, so a timeline step shows forward and backward.

megatron-core's pipeline schedules call `config.timers(name).start()` / `.stop()` around every
micro-batch's forward ('forward-compute') and backward ('backward-compute'), and finalize_model_grads
around the gradient all-reduce; that hook is the one place that sees megatron's own backward call.
`ScheduleRanges` answers it with a `record_function` range, and only while a profiler is running
(a timeline step): on other steps a call returns at once.
"""

from __future__ import annotations

import torch

# megatron's timer names -> the span names of the timeline (others keep megatron's name)
RANGE_NAMES = {"forward-compute": "forward", "backward-compute": "backward",
               "forward-backward": "forward_backward", "all-grads-sync": "grad_sync"}


class _Range:
    def __init__(self, owner: ScheduleRanges, name: str):
        self.owner, self.name = owner, name

    def start(self, barrier: bool = False) -> None:
        if not torch.autograd._profiler_enabled() or self.name in self.owner.open:
            return
        rf = torch.profiler.record_function(RANGE_NAMES.get(self.name, self.name))
        rf.__enter__()
        self.owner.open[self.name] = rf

    def stop(self, barrier: bool = False) -> None:
        rf = self.owner.open.pop(self.name, None)
        if rf is not None:
            rf.__exit__(None, None, None)

    def elapsed(self, *args, **kwargs) -> float:  # megatron's Timer API; we keep no times of our own
        return 0.0


class ScheduleRanges:
    """Stands in for megatron.core.timers.Timers in TransformerConfig.timers (only the calls schedules make)."""

    def __init__(self):
        self.open: dict[str, torch.profiler.record_function] = {}

    def __call__(self, name: str, log_level: int | None = None) -> _Range:
        return _Range(self, name)
