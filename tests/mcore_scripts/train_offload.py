"""Offload mechanics on CPU (force=True): workers whose state is offloaded between calls train exactly like one
that never offloads. Rank 0 saves the comparisons."""

from __future__ import annotations

import argparse
import json

import torch
from train_ckpt import update
from train_common import actor_config, make_rl_batch


def storage_sizes(worker) -> dict:
    chunk = worker.actor.model[0]
    return {"param": [b.param_data.untyped_storage().size() for b in chunk.buffers if b.param_data is not None],
            "grad": [b.grad_data.untyped_storage().size() for b in chunk.buffers]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from hybridflow.protocol import DataProto
    from megatron_workers.actor_rollout_ref import ActorRolloutRefWorker
    from megatron_workers.offload import Offloader

    vocab = json.load(open(f"{args.model}/config.json"))["vocab_size"]
    workers = {}
    for name, dist_opt in (("plain", True), ("offload", True), ("offload_no_distopt", False), ("plain_no_distopt",
                                                                                                False)):
        w = ActorRolloutRefWorker(actor_config(args.model, dist_opt=dist_opt), role="actor_ref")
        w.init_model()
        if name.startswith("offload"):
            w.actor_offload = Offloader(w.actor, params=True, grads=True, optimizer=True, force=True)
            w.ref_offload = Offloader(w.ref, params=True, grads=False, optimizer=False, force=True)
        workers[name] = w
    result = {}
    for name, w in workers.items():
        update(w, vocab, 1)
        w.actor_offload.offload()
        w.ref_offload.offload()
        result[f"{name}_offloaded_sizes"] = storage_sizes(w)
        result[f"{name}_ref_device_ok"] = all(p.device.type == "cpu" for p in w.ref.model[0].parameters())
        result[f"{name}_metrics2"] = update(w, vocab, 2)
        batch = DataProto.from_dict(make_rl_batch(vocab, seed=3))
        result[f"{name}_ref_lp"] = w.compute_ref_log_prob(batch).batch["ref_log_prob"]
        result[f"{name}_lp"] = w.compute_log_prob(batch).batch["old_log_probs"]
        w.actor_offload.reload()
        result[f"{name}_sizes"] = storage_sizes(w)
        result[f"{name}_params"] = [p.detach().clone() for p in w.actor.model[0].parameters()]
    torch.save(result, args.out)


if __name__ == "__main__":
    main()
