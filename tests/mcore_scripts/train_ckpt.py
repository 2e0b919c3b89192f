"""Checkpoint save / resume through ActorRolloutRefWorker under torchrun; rank 0 saves what the test compares.

--phase save   : 2 updates, save, a 3rd update; then load the checkpoint in the same processes and
                 redo the 3rd update (same-layout resume).
--phase resume : fresh processes (any layout): load the checkpoint, then the 3rd update.
Exports (HF layout, gathered over TP/PP) make parameters comparable across layouts.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from train_common import actor_config, hf_state, make_rl_batch

SCHEDULE = {"lr_scheduler": "cosine", "lr_warmup_steps": 1, "total_training_steps": 6, "min_lr_ratio": 0.1}


def step_batch(vocab: int, step: int):
    """A fixed PPO batch per step: inputs do not depend on the model, so runs are comparable bit for bit."""
    from hybridflow.protocol import DataProto

    batch = make_rl_batch(vocab, seed=step)
    g = torch.Generator().manual_seed(100 + step)
    mask = batch["response_mask"].float()
    old = (-4.6 + 0.3 * torch.randn(mask.shape, generator=g)) * mask
    batch.update(old_log_probs=old, ref_log_prob=old + 0.05 * mask,
                 advantages=torch.randn(mask.shape, generator=g) * mask)
    return DataProto.from_dict(batch, meta_info={"temperature": 1.0})


def update(worker, vocab: int, step: int) -> dict:
    coords = worker.get_mesh_coords("actor")
    shard = step_batch(vocab, step).chunk(coords.dp_size)[coords.dp_rank]
    return worker.update_actor(shard).meta_info["metrics"]


def export(worker, path: str) -> dict | None:
    worker.export_hf(path)
    return hf_state(path) if dist.get_rank() == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--phase", choices=("save", "resume"), required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--sp", action="store_true")
    ap.add_argument("--ep", type=int, default=1, help="expert parallel (an MoE model)")
    args = ap.parse_args()

    from megatron_workers.actor_rollout_ref import ActorRolloutRefWorker

    config = actor_config(args.model, args.tp, args.pp, args.sp, lr=2e-3, **SCHEDULE)
    config["actor"]["megatron"]["expert_model_parallel_size"] = args.ep
    worker = ActorRolloutRefWorker(config, role="actor")
    worker.init_model()
    vocab = json.load(open(f"{args.model}/config.json"))["vocab_size"]
    result = {}
    if args.phase == "save":
        result["metrics"] = [update(worker, vocab, 1), update(worker, vocab, 2)]
        worker.save_checkpoint(args.ckpt, extra={"step": 2, "dataloader": {"epoch": 0, "index": 16}})
        result["saved"] = export(worker, args.out + ".saved")
        result["step3"] = update(worker, vocab, 3)
        result["step3_params"] = export(worker, args.out + ".step3")
        result["extra"] = worker.load_checkpoint(args.ckpt)
        result["reloaded"] = export(worker, args.out + ".reloaded")
        result["step3_again"] = update(worker, vocab, 3)
        result["step3_again_params"] = export(worker, args.out + ".step3_again")
    else:
        result["extra"] = worker.load_checkpoint(args.ckpt)
        result["reloaded"] = export(worker, args.out + ".reloaded")
        result["step3"] = update(worker, vocab, 3)
        result["step3_params"] = export(worker, args.out + ".step3")
    if dist.get_rank() == 0:
        torch.save(result, args.out)
    dist.barrier()


if __name__ == "__main__":
    main()
