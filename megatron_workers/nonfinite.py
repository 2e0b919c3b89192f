"""Skip an optimizer update whose loss or gradients are not finite, and give up after K in a row.

Megatron's optimizer already skips on found_inf, but only with a grad scaler (fp16). With fp32 or bf16
(no scaler) it clips by a NaN norm and steps, and the weights turn NaN. `NonFiniteGuard.check` runs after
the backward and before `optimizer.step()`: every rank looks at its loss and its gradient buffers, and one
all-reduce (MAX, over the role's whole world, so every rank of every replica decides alike) says whether
any rank saw a non-finite value. The caller then skips the step (no optimizer or LR-scheduler step).

Settings (trainer.fault.skip_nonfinite / max_nonfinite) reach the workers as HYBRIDFLOW_SKIP_NONFINITE and
HYBRIDFLOW_MAX_NONFINITE, set by the trainer's worker groups.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist


class NonFiniteUpdateError(RuntimeError):
    """max_nonfinite updates in a row were skipped: the run cannot make progress."""


def tensor_stats(name: str, t: torch.Tensor) -> str:
    """`name` shape, NaN and inf counts, and the range of its finite values: what a diagnosis needs."""
    t = t.detach().float()
    finite = t[torch.isfinite(t)]
    rng = f"finite range [{finite.min().item():.4g}, {finite.max().item():.4g}]" if finite.numel() else "no finite"
    return (f"{name} shape {tuple(t.shape)}: {int(torch.isnan(t).sum())} NaN, {int(torch.isinf(t).sum())} inf, "
            f"{rng}")


class NonFiniteGuard:
    def __init__(self, stage: str, enabled: bool | None = None, max_in_a_row: int | None = None):
        self.stage = stage
        self.enabled = (os.environ.get("HYBRIDFLOW_SKIP_NONFINITE", "1") == "1") if enabled is None else enabled
        self.max_in_a_row = int(os.environ.get("HYBRIDFLOW_MAX_NONFINITE", 3)) if max_in_a_row is None else max_in_a_row
        self.streak = 0

    def _local_problem(self, model: list, loss: float) -> str | None:
        """This rank's loss if it is not finite, and the first gradient that is not, with its stats."""
        problems = [f"loss = {loss}"] if not math.isfinite(loss) else []
        for chunk in model:
            for name, p in chunk.named_parameters():
                g = getattr(p, "main_grad", None)
                g = p.grad if g is None else g
                if g is not None and not torch.isfinite(g).all():
                    problems.append("grad of " + tensor_stats(name, g))
                    return "; ".join(problems)
        return "; ".join(problems) or None

    def check(self, model: list, loss: float) -> str | None:
        """Collective. None if every rank's loss and grads are finite, else this rank's diagnosis (or a note
        that another rank saw it). Counts the streak; raises NonFiniteUpdateError at max_in_a_row."""
        if not self.enabled:
            return None
        problem = self._local_problem(model, loss)
        flag = torch.tensor([0.0 if problem is None else 1.0])
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() == 0:
            self.streak = 0
            return None
        self.streak += 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        where = f"{self.stage} rank {rank}: {problem}" if problem else f"{self.stage}: another rank's values"
        if self.max_in_a_row > 0 and self.streak >= self.max_in_a_row:
            raise NonFiniteUpdateError(f"{self.streak} updates in a row had a non-finite loss or gradient "
                                       f"(trainer.fault.max_nonfinite={self.max_in_a_row}); last: {where}")
        return where
