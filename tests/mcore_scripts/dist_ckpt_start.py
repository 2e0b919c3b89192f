"""verl's use_dist_checkpointing / dist_checkpointing_path, through build_role_engine under torchrun (2 ranks).

Converts HF model A to a Megatron dist checkpoint at TP2 (the converter, as a user would), then builds roles at
TP1 x PP2 whose model.path is another model B of the same shape: with use_dist_checkpointing the actor and the
critic's body must hold A's weights (so they came from the checkpoint, at another layout), without it B's.
Rank 0 prints one `RESULT {json}` line.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist


def params(engine) -> dict[str, torch.Tensor]:
    return {f"{i}.{k}": v.detach().clone() for i, chunk in enumerate(engine.model)
            for k, v in getattr(chunk, "module", chunk).named_parameters()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf-a", required=True)
    ap.add_argument("--hf-b", required=True)
    ap.add_argument("--ckpt", required=True)
    args = ap.parse_args()

    from hybridflow.config.schema import MegatronConfig, OptimConfig
    from megatron_workers import convert, parallel_init
    from megatron_workers.engine import build_role_engine, init_megatron

    parallel_init.init_distributed()
    convert.run(convert.plan(convert.parse_args(["hf-to-mcore", "--hf", args.hf_a, "--out", args.ckpt, "--tp", "2"])))
    layout = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    from_ckpt = MegatronConfig(**layout, use_dist_checkpointing=True, dist_checkpointing_path=args.ckpt)
    dims = init_megatron(from_ckpt)
    started = params(build_role_engine(args.hf_b, dims, "float32", optim=OptimConfig(), megatron_cfg=from_ckpt))
    a = params(build_role_engine(args.hf_a, dims, "float32", megatron_cfg=MegatronConfig(**layout)))
    b = params(build_role_engine(args.hf_b, dims, "float32", megatron_cfg=MegatronConfig(**layout)))
    critic = params(build_role_engine(args.hf_b, dims, "float32", megatron_cfg=from_ckpt, scalar_head=True))
    body = [k for k in critic if "output_layer" not in k]
    local = {
        "same_names": sorted(started) == sorted(a) == sorted(b),
        "actor_equals_a": all(torch.equal(started[k], a[k]) for k in a),
        "actor_differs_from_b": sum(not torch.equal(started[k], b[k]) for k in b),
        "critic_body_equals_a": bool(body) and all(torch.equal(critic[k], a[k]) for k in body),
        "critic_has_head": any("output_layer" in k for k in critic) or dims.coords(dist.get_rank())["pp"] == 0,
    }
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, local)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(results), flush=True)
    parallel_init.destroy()


if __name__ == "__main__":
    main()
