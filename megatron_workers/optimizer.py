"""Megatron DDP wrapping, the Megatron optimizer, and the learning-rate schedule.

The schedule is our own small class rather than megatron's OptimizerParamScheduler:
that one starts warmup at lr=init_lr (a wasted first step at lr 0), asserts
warmup < decay steps even for a constant schedule, and its keyword list changes
between megatron-core releases. Ours is a pure function of the step, so the test
can compare it with hand-computed numbers, and it applies the per-group
`lr_mult` / `wd_mult` that megatron's parameter groups carry (no weight decay on
biases and norm weights).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

LR_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    """lr for the k-th optimizer update (k = 0 for the first one).

    - warmup, k < warmup_steps: base_lr * (k + 1) / warmup_steps (the first update already moves);
    - constant: base_lr afterwards;
    - linear / cosine: from base_lr down to base_lr * min_lr_ratio over the steps
      [warmup_steps, total_steps]; progress = (k - warmup_steps) / (total_steps - warmup_steps),
      clamped to [0, 1]; cosine uses 0.5 * (1 + cos(pi * progress)) as the decay factor.
    """

    base_lr: float
    style: str = "constant"
    warmup_steps: int = 0
    total_steps: int = -1
    min_lr_ratio: float = 0.0

    def __post_init__(self):
        if self.style not in LR_STYLES:
            raise ValueError(f"optim.lr_scheduler={self.style!r} is not one of {LR_STYLES}")
        if not math.isfinite(self.base_lr) or self.base_lr < 0:  # a NaN compares False with everything
            raise ValueError(f"optim.lr={self.base_lr} must be a finite number >= 0")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.lr_warmup_steps={self.warmup_steps} must be >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if self.style != "constant" and self.total_steps <= self.warmup_steps:
            raise ValueError(
                f"optim.lr_scheduler={self.style!r} needs total_training_steps > lr_warmup_steps "
                f"(got total_training_steps={self.total_steps}, lr_warmup_steps={self.warmup_steps})"
            )

    def lr_at(self, step: int) -> float:
        if step < 0:
            raise ValueError(f"lr step {step} must be >= 0")
        if step < self.warmup_steps:
            return self.base_lr * (step + 1) / self.warmup_steps
        if self.style == "constant":
            return self.base_lr
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        if self.style == "linear":
            decay = 1.0 - progress
        else:
            decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.base_lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * decay)

    @classmethod
    def from_optim_config(cls, optim) -> LRSchedule:
        return cls(
            base_lr=float(optim.lr),
            style=getattr(optim, "lr_decay_style", None) or optim.lr_scheduler,  # verl's name wins when given
            warmup_steps=int(optim.lr_warmup_steps),
            total_steps=int(optim.total_training_steps),
            min_lr_ratio=float(optim.min_lr_ratio),
        )


class LRScheduler:
    """Writes LRSchedule's value into the optimizer's parameter groups; its state is the step count."""

    def __init__(self, optimizer, schedule: LRSchedule, weight_decay: float):
        self.optimizer = optimizer
        self.schedule = schedule
        self.weight_decay = weight_decay
        self.num_steps = 0
        self._apply()

    def _apply(self) -> None:
        lr = self.schedule.lr_at(self.num_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.weight_decay * group.get("wd_mult", 1.0)

    def current_lr(self) -> float:
        """The lr the next optimizer.step() will use (before any per-group multiplier)."""
        return self.schedule.lr_at(self.num_steps)

    def step(self) -> None:
        """Call after each optimizer update: moves to the lr of the next one."""
        self.num_steps += 1
        self._apply()

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = int(state["num_steps"])
        self._apply()


def wrap_ddp(model_chunks: list, use_distributed_optimizer: bool, overlap: bool = False) -> list:
    """Wrap each model chunk in megatron's DistributedDataParallel.

    Gradients accumulate in fp32 buffers (grad_reduce_in_fp32) so bf16 training on
    GPU reduces in fp32. Overlapped grad reduce / param gather stay off unless asked
    for: on CPU with gloo they only add threads, and the engine calls
    finish_grad_sync through the schedule anyway.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    wrapped = []
    for i, chunk in enumerate(model_chunks):
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=overlap,
            overlap_param_gather=overlap and use_distributed_optimizer,
            use_distributed_optimizer=use_distributed_optimizer,
        )
        ddp = DistributedDataParallel(
            config=chunk.config,
            ddp_config=ddp_config,
            module=chunk,
            # Bucketing only matters for overlap; chunks after the first never overlap in megatron either.
            disable_bucketing=(i > 0) or not overlap,
        )
        # Replicas may differ in randomly initialised heads; make them agree before training.
        ddp.broadcast_params()
        wrapped.append(ddp)
    return wrapped


def _use_dp_group_as_gloo_group(optimizer) -> None:
    """Without CUDA every process group is gloo, and parallel_init skips megatron's extra gloo groups.

    The distributed optimizer's checkpoint gather (`get_parameter_state_dp_zero`) needs a gloo
    data-parallel group on CPU (its NCCL path calls `.cuda()`); the ordinary DP group is that group.
    """
    if torch.cuda.is_available():
        return
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(opt, "data_parallel_group_gloo") and opt.data_parallel_group_gloo is None:
            opt.data_parallel_group_gloo = opt.data_parallel_group


def build_optimizer(model_chunks: list, optim, use_distributed_optimizer: bool, bf16: bool = False):
    """Megatron Adam(W) over DDP-wrapped chunks, plus our LR scheduler. Returns (optimizer, scheduler).

    `optim` is an OptimConfig (hybridflow.config.schema): lr, betas, weight_decay, clip_grad
    and the schedule keys. clip_grad <= 0 turns clipping off (megatron's convention).
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from hybridflow.config.megatron_checks import optimizer_fields

    schedule = LRSchedule.from_optim_config(optim)
    beta1, beta2 = (float(b) for b in optim.betas)
    # Any other OptimizerConfig field from optim.override_optimizer_config wins over the defaults below (the ones
    # set from our keys are refused at load); the CUDA-only ones (the CPU offload of the state) only on a GPU.
    section = getattr(optim, "override_optimizer_config", None)
    overrides = optimizer_fields(section, torch.cuda.is_available()) if section is not None else {}
    config = OptimizerConfig(**{**dict(
        optimizer="adam",
        lr=schedule.lr_at(0),
        min_lr=schedule.base_lr * schedule.min_lr_ratio,
        weight_decay=float(optim.weight_decay),
        adam_beta1=beta1,
        adam_beta2=beta2,
        adam_eps=1e-8,
        clip_grad=float(optim.clip_grad),
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=use_distributed_optimizer,
    ), **overrides})
    optimizer = get_megatron_optimizer(config, model_chunks)
    _use_dp_group_as_gloo_group(optimizer)
    scheduler = LRScheduler(optimizer, schedule, weight_decay=float(optim.weight_decay))
    logger.info("optimizer: adam betas=(%s, %s) wd=%s clip=%s dist_opt=%s schedule=%s",
                beta1, beta2, optim.weight_decay, optim.clip_grad, use_distributed_optimizer, schedule)
    return optimizer, scheduler
