"""Non-finite updates on 2 DP ranks: a NaN loss on rank 1 only makes both ranks skip the update (weights,
Adam state and LR step unchanged), a finite one then trains, and max_nonfinite NaN updates in a row raise
with a diagnosis. Rank 0 saves what it saw."""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from train_ckpt import update
from train_common import actor_config


def snapshot(worker) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in worker.actor.model[0].named_parameters()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import json

    from hybridflow.controller import fault_inject
    from megatron_workers.actor_rollout_ref import ActorRolloutRefWorker
    from megatron_workers.nonfinite import NonFiniteUpdateError

    vocab = json.load(open(f"{args.model}/config.json"))["vocab_size"]
    worker = ActorRolloutRefWorker(actor_config(args.model, lr=1e-2), role="actor")
    worker.init_model()
    rank = dist.get_rank()
    out = {}
    before = snapshot(worker)
    fault_inject.set_nan(rank == 1)  # only rank 1's loss is NaN: the all-reduced flag must stop rank 0 too
    out["skipped"] = update(worker, vocab, 1)
    after = snapshot(worker)
    out["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    out["lr_steps_after_skip"] = worker.actor.scheduler.num_steps if hasattr(worker.actor.scheduler, "num_steps") \
        else -1
    fault_inject.set_nan(False)
    out["trained"] = update(worker, vocab, 2)
    trained = snapshot(worker)
    out["changed"] = any(not torch.equal(after[k], trained[k]) for k in after)
    out["finite"] = all(torch.isfinite(v).all().item() for v in trained.values())
    fault_inject.set_nan(rank == 0)  # rank 0 (which saves) is the one with the diagnosis this time
    out["error"] = ""
    for step in (3, 4, 5):
        try:
            update(worker, vocab, step)
        except NonFiniteUpdateError as e:
            out["error"], out["error_step"] = str(e), step
            break
    if rank == 0:
        torch.save(out, args.out)
    dist.barrier()


if __name__ == "__main__":
    main()
