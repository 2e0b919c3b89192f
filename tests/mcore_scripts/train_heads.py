"""Critic values + one critic update, and reward-model scores, through the workers under torchrun.

Rank 0 saves the outputs and the critic's (freshly initialised) head weight for the test's
plain-PyTorch reference.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from train_common import make_rl_batch


def megatron_cfg(tp: int, pp: int, sp: bool) -> dict:
    return {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "sequence_parallel": sp,
            "use_distributed_optimizer": True, "seed": 3}


def critic_inputs(batch: dict) -> dict:
    g = torch.Generator().manual_seed(5)
    mask = batch["response_mask"].float()
    return {**batch, "values": 0.5 * torch.randn(mask.shape, generator=g) * mask,
            "returns": torch.randn(mask.shape, generator=g) * mask}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--rm", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--sp", action="store_true")
    args = ap.parse_args()

    from hybridflow.protocol import DataProto
    from megatron_workers.critic import CriticWorker
    from megatron_workers.reward_model import RewardModelWorker

    m = megatron_cfg(args.tp, args.pp, args.sp)
    critic = CriticWorker({"model": {"path": args.model, "dtype": "float32"}, "megatron": m,
                           "optim": {"lr": 1e-3, "clip_grad": 100.0}, "ppo_mini_batch_size": 8,
                           "ppo_micro_batch_size_per_gpu": 4, "cliprange_value": 0.5})
    critic.init_model()
    rm = RewardModelWorker({"model": {"path": args.rm, "dtype": "float32"}, "megatron": m,
                            "micro_batch_size_per_gpu": 4})
    rm.init_model()
    coords = critic.get_mesh_coords("critic")
    vocab = json.load(open(f"{args.model}/config.json"))["vocab_size"]
    batch = make_rl_batch(vocab, seed=11)
    full = DataProto.from_dict(batch)
    values = critic.compute_values(full).batch["values"]
    scores = rm.compute_rm_score(full).batch["rm_scores"]
    head = critic.engine.module.output_layer.weight.detach().clone() if coords.is_collect else None
    shard = DataProto.from_dict(critic_inputs(batch)).chunk(coords.dp_size)[coords.dp_rank]
    metrics = critic.update_critic(shard).meta_info["metrics"]
    # collect ranks hold the head (last PP stage); send it to rank 0
    holder = [head]
    if dist.get_world_size() > 1:
        src = dist.get_world_size() - args.tp * 1  # tp rank 0 of the last stage, dp rank of the last replica
        dist.broadcast_object_list(holder, src=src)
    if dist.get_rank() == 0:
        torch.save({"values": values, "rm_scores": scores, "head": holder[0], "metrics": metrics}, args.out)
    dist.barrier()


if __name__ == "__main__":
    main()
