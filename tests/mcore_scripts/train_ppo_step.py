"""One PPO update through ActorRolloutRefWorker under torchrun; rank 0 saves what the test compares.

Every rank computes log-probs for the full batch (DP replicas are independent for forward), then
takes its DP shard for the update, the way DP_COMPUTE_PROTO would hand it out.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from train_common import actor_config, hf_state, make_rl_batch, ppo_inputs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--sp", action="store_true")
    ap.add_argument("--loss-agg-mode", default="token-mean")
    ap.add_argument("--drop-rows", default="", help="comma-separated rows whose response_mask is zeroed")
    args = ap.parse_args()
    drop_rows = tuple(int(r) for r in args.drop_rows.split(",") if r)

    from hybridflow.protocol import DataProto
    from megatron_workers.actor_rollout_ref import ActorRolloutRefWorker

    worker = ActorRolloutRefWorker(actor_config(args.model, args.tp, args.pp, args.sp,
                                                loss_agg_mode=args.loss_agg_mode), role="actor_ref")
    worker.init_model()
    coords = worker.get_mesh_coords("actor")
    vocab = json.load(open(f"{args.model}/config.json"))["vocab_size"]
    batch = make_rl_batch(vocab)
    full = DataProto.from_dict(batch, meta_info={"temperature": 1.0})
    old = worker.compute_log_prob(full)
    ref = worker.compute_ref_log_prob(full)
    train = DataProto.from_dict(ppo_inputs(batch, old.batch["old_log_probs"], ref.batch["ref_log_prob"],
                                           drop_rows=drop_rows), meta_info={"temperature": 1.0})
    shard = train.chunk(coords.dp_size)[coords.dp_rank]
    metrics = worker.update_actor(shard).meta_info["metrics"]
    worker.export_hf(f"{args.out}.hf")
    if dist.get_rank() == 0:
        torch.save({"old_log_probs": old.batch["old_log_probs"], "entropys": old.batch["entropys"],
                    "ref_log_prob": ref.batch["ref_log_prob"], "metrics": metrics,
                    "params": hf_state(f"{args.out}.hf")}, args.out)
    dist.barrier()


if __name__ == "__main__":
    main()
