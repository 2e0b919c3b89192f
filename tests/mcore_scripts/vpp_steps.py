"""Virtual pipeline end to end through ActorRolloutRefWorker under torchrun; rank 0 saves what the test compares.

--vpp 2 (with --pp 2): log-probs; one update (4 micro-batches); a checkpoint; a second update (1 micro-batch,
                       padded to pp for the interleaved schedule); the 3D-HybridEngine's
                       generation shards (t_g = 1 and 2) with their byte counts.
--vpp 1 (PP1 here)   : the same first update from the same weights; then it resumes from the VPP run's
                       checkpoint (a different layout) and makes the same second update.
Parameters are compared as HF exports (gathered over PP), so layouts are comparable.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist
from train_ckpt import export, update
from train_common import actor_config, make_rl_batch

# step 2 runs the whole mini-batch (8 rows) as one micro-batch: under VPP the engine pads it to pp=2
STEP2_MICRO = 8


def reshard_case(worker, t_g: int) -> dict:
    """Generation shards and bytes of the HybridEngine over this rank's model chunks (no vLLM engine needed)."""
    from hybridflow.parallel.dims import GenerationDims
    from hybridflow.resharding.hybrid_engine import HybridEngine
    from megatron_workers.hf_io import read_hf_config

    hf_config = read_hf_config(worker.config.model.path)
    hybrid = HybridEngine(worker.dims, GenerationDims(t_g), worker.actor.model, hf_config)
    shards = {}
    for bucket in hybrid.gen_shards():
        shards.update({k: v.clone() for k, v in bucket.items()})
    st = hybrid.engine.stats
    total = sum(s.nbytes for s in hybrid.plan.specs)
    return {"t_g": t_g, "bytes_recv": st.bytes_recv, "model_bytes": total, "shards": shards,
            "expected_recv_bytes": hybrid.plan.expected_recv_bytes(dist.get_rank())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--vpp", type=int, default=1)
    args = ap.parse_args()
    sys.modules.setdefault("vllm", None)  # no generation engine here: vLLM's vocab pad falls back to its constant

    from hybridflow.protocol import DataProto
    from megatron_workers.actor_rollout_ref import ActorRolloutRefWorker

    config = actor_config(args.model, pp=args.pp, lr=2e-3)
    config["actor"]["megatron"]["virtual_pipeline_model_parallel_size"] = args.vpp
    worker = ActorRolloutRefWorker(config, role="actor")
    worker.init_model()
    vocab = json.load(open(f"{args.model}/config.json"))["vocab_size"]
    result = {"chunks": len(worker.actor.model)}
    if args.vpp > 1:
        batch = make_rl_batch(vocab)
        data = DataProto.from_dict(batch, meta_info={"temperature": 1.0})
        result["log_prob"] = worker.compute_log_prob(data).batch["old_log_probs"]
        result["step1"] = update(worker, vocab, 1)
        result["step1_params"] = export(worker, args.out + ".step1")
        worker.save_checkpoint(args.ckpt, extra={"step": 1})
        worker.config.actor.ppo_micro_batch_size_per_gpu = STEP2_MICRO
        result["step2"] = update(worker, vocab, 2)
        result["step2_params"] = export(worker, args.out + ".step2")
        result["reshard"] = [reshard_case(worker, t_g) for t_g in (1, 2)]
    else:
        result["step1"] = update(worker, vocab, 1)
        result["step1_params"] = export(worker, args.out + ".step1")
        result["extra"] = worker.load_checkpoint(args.ckpt)
        worker.config.actor.ppo_micro_batch_size_per_gpu = STEP2_MICRO
        result["step2"] = update(worker, vocab, 2)
        result["step2_params"] = export(worker, args.out + ".step2")
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result.get("reshard"))
    if dist.get_rank() == 0:
        result["reshard_all"] = gathered
        torch.save(result, args.out)
    dist.barrier()


if __name__ == "__main__":
    main()
