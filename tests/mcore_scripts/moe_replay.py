"""Routing replay through ActorRolloutRefWorker.compute_log_prob under torchrun; rank 0 saves what the test compares.

The batch carries `routed_experts` drawn at random (experts the model would mostly not choose), with -1 at each
row's last token (what a rollout leaves unrecorded). Every rank computes the full batch's log-probs twice:
with actor.router_replay.mode=R3 (the routers take those experts) and with the same weights routing by themselves.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from train_common import actor_config, make_rl_batch


def random_routing(batch: dict, layers: int, experts: int, k: int, seed: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows, cols = batch["input_ids"].shape
    routed = torch.rand(rows, cols, layers, experts, generator=g).argsort(dim=-1)[..., :k].to(torch.int16)
    last = batch["attention_mask"].shape[1] - 1 - batch["attention_mask"].flip(1).argmax(dim=1)
    routed[torch.arange(rows), last] = -1
    return routed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--sp", action="store_true")
    args = ap.parse_args()

    from hybridflow.protocol import DataProto
    from megatron_workers.actor_rollout_ref import ActorRolloutRefWorker

    hf = json.load(open(f"{args.model}/config.json"))
    experts = hf.get("num_experts") or hf["num_local_experts"]
    cfg = actor_config(args.model, args.tp, sp=args.sp)
    cfg["actor"]["megatron"]["expert_model_parallel_size"] = args.ep
    cfg["actor"]["router_replay"] = {"mode": "R3"}
    worker = ActorRolloutRefWorker(cfg, role="actor")
    worker.init_model()
    batch = make_rl_batch(hf["vocab_size"])
    routed = random_routing(batch, hf["num_hidden_layers"], experts, hf["num_experts_per_tok"])
    data = DataProto.from_dict({**batch, "routed_experts": routed}, meta_info={"temperature": 1.0})
    results = {"routed": routed.tolist()}
    for mode in ("R3", "disabled"):  # the same weights, replaying or routing by themselves
        worker.config.actor.router_replay.mode = mode
        results[mode] = worker.compute_log_prob(data).batch["old_log_probs"].tolist()
    if dist.get_rank() == 0:
        json.dump(results, open(args.out, "w"))


if __name__ == "__main__":
    main()
