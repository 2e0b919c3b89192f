"""The cross-pool transport alone (no Megatron, no vLLM): one process per sync rank, synthetic shards.

Usage: python cross_pool_transport.py MODE SYNC_RANK PORT OUT_DIR T P TG R
  MODE check    two syncs; every rollout rank's shards must equal the rows of the known full tensors; the
                second sync is send(wait=False) followed at once by an in-place update, which must not leak
  MODE bench    one warm-up and 3 timed syncs of a 25.8M-parameter fp32 model (the tiny presets' "small"
                shape) and the link bandwidth between training rank 0 and rollout rank 0 (64 MiB messages)
  MODE timeout  training ranks never send; rollout ranks must fail within the 3 s timeout, naming the message
Training ranks (t = T/P, d = 1) are sync ranks 0..T-1, rollout ranks T..T+R-1.
Each process writes OUT_DIR/<sync rank>.json.
"""

from __future__ import annotations

import json
import sys
import time
import zlib
from pathlib import Path

import torch

from hybridflow.parallel.dims import ParallelDims
from hybridflow.resharding.cross_pool import (
    RolloutReceiver,
    TrainerSender,
    handshake,
    make_sync_group,
    measure_bandwidth,
)
from hybridflow.resharding.cross_pool_plan import CrossPoolError, RolloutLayout
from hybridflow.resharding.planner import ParamSpec


def model_specs(p: int, big: bool) -> list[ParamSpec]:
    h, f, heads_rows, vocab, layers = (512, 1408, 1024, 8000, 6) if big else (8, 16, 16, 100, 2)
    specs = [ParamSpec("embedding.word_embeddings.weight", (-(-vocab // 256) * 256, h), 4, True, 0, 1, 0,
                       valid_size=vocab, gen_pad_multiple=1)]
    for layer in range(layers):
        stage = layer * p // layers
        pre = f"decoder.layers.{layer}."
        specs += [
            ParamSpec(pre + "input_layernorm.weight", (h,), 4, False, 0, 1, stage),
            ParamSpec(pre + "self_attention.linear_qkv.weight", (heads_rows, h), 4, True, 0, 1, stage),
            ParamSpec(pre + "self_attention.linear_proj.weight", (h, h), 4, True, 1, 1, stage),
            ParamSpec(pre + "mlp.linear_fc1.weight", (2 * f, h), 4, True, 0, 2, stage),
            ParamSpec(pre + "mlp.linear_fc2.weight", (h, f), 4, True, 1, 1, stage),
        ]
    specs += [ParamSpec("decoder.final_layernorm.weight", (h,), 4, False, 0, 1, p - 1),
              ParamSpec("output_layer.weight", (-(-vocab // 256) * 256, h), 4, True, 0, 1, p - 1,
                        valid_size=vocab, gen_pad_multiple=1)]
    return specs


def full_tensor(spec: ParamSpec) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(spec.name.encode()))
    return torch.randn(spec.full_shape, generator=g)


def rows(t: torch.Tensor, spec: ParamSpec, layout) -> torch.Tensor:
    x, dim = (t.reshape(1), 0) if not spec.full_shape else (t, spec.partition_dim)
    return torch.cat([x.narrow(dim, a, b - a) for a, b in layout], dim=dim) if layout else x.narrow(dim, 0, 0)


def main() -> int:
    mode, sync_rank, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    T, P, t_g, R = map(int, sys.argv[5:9])
    torch.set_num_threads(1)
    dims = ParallelDims(tp=T // P, pp=P)
    layout = RolloutLayout(ranks=R, tp=t_g)
    big = mode == "bench"
    group = make_sync_group("127.0.0.1", port, sync_rank, T + R, timeout_s=3.0 if mode == "timeout" else 120.0)
    specs = model_specs(P, big)
    is_train = sync_rank < T
    trainer = {"dims": dims, "specs": specs, "dtypes": ["float32"] * len(specs), "model": None}
    rollout = {"layout": layout, "vocab_pad": 64, "bucket_bytes": (64 << 20) if big else 200}
    plan = handshake(group, num_train=T if is_train else None, trainer=trainer if sync_rank == 0 else None,
                     rollout=rollout if sync_rank == T else None)
    result: dict = {"sync_rank": sync_rank, "buckets": len(plan.buckets), "model_bytes": plan.model_bytes}
    if is_train:
        shards = {s.name: rows(full_tensor(s), s, plan.holds(sync_rank, s)).contiguous()
                  for s in specs if plan.holds(sync_rank, s)}
        sender = TrainerSender(plan, sync_rank, lambda: shards, group)
        if mode == "timeout":
            time.sleep(8)  # never sends; stays alive past the rollout's timeout
        elif mode == "check":
            result["sync1"] = sender.send().as_dict()
            for v in shards.values():
                v.add_(1.0)
            pending = sender.send(wait=False)
            for v in shards.values():  # the next update, while the bytes are in flight
                v.add_(100.0)
            result["sync2"] = pending.wait().as_dict()
        else:
            if sync_rank == 0:
                result["bandwidth_Bps"] = measure_bandwidth(group, 0, T)
            result["syncs"] = [sender.send().as_dict() for _ in range(4)]
    else:
        r = sync_rank - T
        receiver = RolloutReceiver(plan, r, group)
        if mode == "timeout":
            try:
                receiver.receive()
                result["error"] = None
            except CrossPoolError as e:
                result["error"] = str(e)
        elif mode == "check":
            for k, shift in enumerate((0.0, 1.0)):
                got = receiver.receive()
                bad = [s.name for s in plan.specs
                       if not torch.equal(got[s.name], rows(full_tensor(s) + shift, s, plan.needs(r, s)))]
                result[f"sync{k + 1}"] = {**receiver.stats.as_dict(), "mismatched": bad}
        else:
            if r == 0:
                result["bandwidth_Bps"] = measure_bandwidth(group, 0, T)
            syncs = []
            for _ in range(4):
                receiver.receive()
                syncs.append(receiver.stats.as_dict())
            result["syncs"] = syncs
            result["expected_recv_bytes"] = plan.expected_recv_bytes(r)
    (out / f"{sync_rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
