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


def main_params_hf(engine, model_dir: str) -> dict[str, torch.Tensor]:
    """The optimizer's fp32 main params under HF names (one process: each shard is the whole parameter).

    These, not the bf16 model params, are what a bf16 update is compared on: the model params are them rounded.
    """
    from megatron_workers.hf_io import read_hf_config
    from megatron_workers.hf_mapping import global_named_parameters, mcore_full_to_hf

    assert dist.get_world_size() == 1, "main params are sharded over DP; compare them in one process"
    names = {id(p): n for chunk in engine.model for n, p in global_named_parameters(chunk)}
    opt = engine.optimizer
    out = {}
    for o in getattr(opt, "chained_optimizers", [opt]):
        for model_group, main_group in ((o.model_float16_groups, o.shard_fp32_from_float16_groups),
                                        (o.model_fp32_groups, o.shard_fp32_groups)):
            for params, mains in zip(model_group, main_group):
                for p, m in zip(params, mains):
                    assert m.dtype == torch.float32 and m.numel() == p.numel(), (names[id(p)], m.dtype)
                    out.update(mcore_full_to_hf(names[id(p)], m.detach().view(p.shape).clone(),
                                                read_hf_config(model_dir)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--sp", action="store_true")
    ap.add_argument("--loss-agg-mode", default="token-mean")
    ap.add_argument("--dtype", default="float32", help="the actor's model.dtype (bfloat16: the GPU's precision path)")
    ap.add_argument("--drop-rows", default="", help="comma-separated rows whose response_mask is zeroed")
    args = ap.parse_args()
    drop_rows = tuple(int(r) for r in args.drop_rows.split(",") if r)

    from hybridflow.protocol import DataProto
    from megatron_workers.actor_rollout_ref import ActorRolloutRefWorker

    worker = ActorRolloutRefWorker(actor_config(args.model, args.tp, args.pp, args.sp,
                                                loss_agg_mode=args.loss_agg_mode, dtype=args.dtype), role="actor_ref")
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
    main = main_params_hf(worker.actor, args.model) if args.dtype != "float32" else None
    if dist.get_rank() == 0:
        torch.save({"old_log_probs": old.batch["old_log_probs"], "entropys": old.batch["entropys"],
                    "ref_log_prob": ref.batch["ref_log_prob"], "metrics": metrics,
                    "params": hf_state(f"{args.out}.hf"), "main_params": main}, args.out)
    dist.barrier()


if __name__ == "__main__":
    main()
