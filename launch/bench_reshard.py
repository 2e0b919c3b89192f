"""Benchmark: the 3D-HybridEngine's resharding vs. the naive all-gather, on gloo, 8 ranks by default.

    python launch/bench_reshard.py [--world 8] [--layouts 4,1,2,2 ...] [--synthetic] [--bucket-mb 32]

Spawns its own processes. For every layout (t, p, d, t_g) each rank builds its Megatron shard of a
Llama-shaped model (~58M parameters: vocab 32000, hidden 512, 8 layers, 16 heads of 32, 8 KV heads,
FFN 1536, untied), with megatron-core's GPTModel (`megatron_workers.model_builder.build_gpt_model`)
or, with --synthetic, plain tensors of the same shapes carrying the same TP attributes. Then it runs
the resharding engine and the naive all-gather (every rank gathers the full model, then slices) once
to warm up gloo and once timed, and prints one JSON line per layout:

  layout                      {t, p, d, t_g}
  param_bytes                 model bytes M (Megatron shapes, vocab padding included)
  engine_bytes_per_rank       measured bytes received by the busiest rank (the engine)
  optimal_bytes_per_rank      closed form M/t_g - M/(p*max(t, t_g))
  lower_bound_bytes_per_rank  the planner's exact per-rank minimum (busiest rank), which differs from the
                              closed form by the vocab rows: Megatron pads the vocab per TP rank, vLLM
                              splits the real vocab padded to 64, so those shards do not nest
  naive_bytes_per_rank        measured bytes received by the busiest rank (naive all-gather)
  engine_peak_extra_bytes     new generation shards + staging buffers of the largest bucket
  engine_aliased_bytes_per_rank  generation shards that ARE the training tensors (zero copy)
  engine_sent_bytes_min_max   how evenly the senders are loaded
  engine_s / naive_s          wall time of the slowest rank
  ratio_measured_over_optimal, naive_over_engine_time
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridflow.ports import free_port  # noqa: E402

HF_CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 512,
    "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 32,
    "intermediate_size": 1536, "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "tie_word_embeddings": False,
    "initializer_range": 0.02,
}
DEFAULT_LAYOUTS = [(4, 1, 2, 2), (4, 2, 1, 2), (2, 2, 2, 1), (2, 1, 4, 4), (8, 1, 1, 2), (2, 4, 1, 1), (2, 2, 2, 4),
                   (4, 1, 2, 4)]  # the last: t_g == t, p == 1: every generation shard aliases its training shard


def megatron_named_params(dims):
    """(global name, parameter) of this rank's shard of a real megatron-core GPTModel."""
    from megatron.core import parallel_state

    from megatron_workers import hf_mapping
    from megatron_workers.model_builder import build_gpt_model
    from megatron_workers.parallel_init import init_model_parallel

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    init_model_parallel(dims, timeout_s=600)
    model = build_gpt_model(HF_CONFIG, dims)
    return list(hf_mapping.global_named_parameters(model))


def synthetic_named_params(dims, rank):
    """The same shapes and TP attributes as megatron's GPTModel, as plain tensors (no megatron import)."""
    from megatron_workers.model_builder import padded_vocab_size

    c, t = HF_CONFIG, dims.tp
    me = dims.coords(rank)
    h, hd, ffn = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    qkv_rows = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * hd
    per_stage = c["num_hidden_layers"] // dims.pp
    out = []

    def add(name, full_shape, tp=False, dim=0, stride=1):
        shape = list(full_shape)
        if tp:
            shape[dim] //= t
        p = torch.nn.Parameter(torch.randn(shape), requires_grad=False)
        if tp:
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, stride
        out.append((name, p))

    v_pad = padded_vocab_size(c["vocab_size"], t)
    if me["pp"] == 0:
        add("embedding.word_embeddings.weight", (v_pad, h), tp=True)
    for i in range(me["pp"] * per_stage, (me["pp"] + 1) * per_stage):
        n = f"decoder.layers.{i}."
        add(n + "input_layernorm.weight", (h,))
        add(n + "self_attention.linear_qkv.weight", (qkv_rows, h), tp=True)
        add(n + "self_attention.linear_proj.weight", (h, c["num_attention_heads"] * hd), tp=True, dim=1)
        add(n + "pre_mlp_layernorm.weight", (h,))
        add(n + "mlp.linear_fc1.weight", (2 * ffn, h), tp=True, stride=2)
        add(n + "mlp.linear_fc2.weight", (h, ffn), tp=True, dim=1)
    if me["pp"] == dims.pp - 1:
        add("decoder.final_layernorm.weight", (h,))
        add("output_layer.weight", (v_pad, h), tp=True)
    return out


def _comm_device() -> str:
    """NCCL reduces device tensors only (launch/gpu_check.py runs bench_layout on NCCL)."""
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.barrier()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=_comm_device())
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def bench_layout(rank, world, layout, synthetic, bucket_bytes):
    from hybridflow.parallel.dims import GenerationDims, ModelShape, ParallelDims
    from hybridflow.resharding.engine import ReshardEngine
    from hybridflow.resharding.megatron_specs import gather_param_specs, param_specs
    from hybridflow.resharding.naive import NaiveAllGather
    from hybridflow.resharding.planner import optimal_recv_bytes, plan_resharding
    from hybridflow.resharding.vllm_layout import vllm_vocab_pad

    t, p, d, t_g = layout
    dims, gen = ParallelDims(tp=t, pp=p, dp=d), GenerationDims(tp=t_g)
    named = synthetic_named_params(dims, rank) if synthetic else megatron_named_params(dims)
    local, shards = param_specs(named, t, dims.coords(rank)["pp"], vocab_size=HF_CONFIG["vocab_size"],
                                gen_vocab_pad_multiple=vllm_vocab_pad())
    plan = plan_resharding(dims, gen, gather_param_specs(local), ModelShape.from_hf_config(HF_CONFIG))
    engine = ReshardEngine(plan, bucket_bytes=bucket_bytes, timeout_s=600)
    naive = NaiveAllGather(plan, timeout_s=600)

    def drain(it):
        for _ in it:  # stream and drop, as a loader would
            pass

    drain(engine.iter_shards(shards))  # warm-up: gloo pair connections, allocator
    engine_s = timed(lambda: drain(engine.iter_shards(shards)))
    drain(naive.iter_shards(shards))
    naive_s = timed(lambda: drain(naive.iter_shards(shards)))

    mine = torch.tensor([engine.stats.bytes_recv, naive.stats.bytes_recv, engine.stats.peak_extra_bytes,
                         plan.expected_recv_bytes(rank), engine.stats.bytes_aliased, engine.stats.bytes_sent],
                        dtype=torch.float64, device=_comm_device())
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    table = torch.stack(everyone).cpu()
    M = sum(s.nbytes for s in plan.specs)
    optimal = optimal_recv_bytes(M, t, p, t_g)
    engine_max = int(table[:, 0].max())
    row = {
        "layout": {"t": t, "p": p, "d": d, "t_g": t_g},
        "params": "synthetic" if synthetic else "megatron-core GPTModel",
        "param_bytes": M,
        "engine_bytes_per_rank": engine_max,
        "engine_bytes_mean": float(table[:, 0].mean()),
        "optimal_bytes_per_rank": optimal,
        "lower_bound_bytes_per_rank": int(table[:, 3].max()),
        "naive_bytes_per_rank": int(table[:, 1].max()),
        "engine_peak_extra_bytes": int(table[:, 2].max()),
        "engine_aliased_bytes_per_rank": int(table[:, 4].max()),
        "engine_sent_bytes_min_max": [int(table[:, 5].min()), int(table[:, 5].max())],
        "engine_s": round(engine_s, 4),
        "naive_s": round(naive_s, 4),
        "ratio_measured_over_optimal": round(engine_max / optimal, 4) if optimal else None,
        "naive_over_engine_time": round(naive_s / engine_s, 3) if engine_s else None,
        "buckets": engine.stats.num_buckets,
        "groups_ascending": plan.groups_ascending,
    }
    return row


def worker(rank, world, port, layouts, synthetic, bucket_bytes):
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=900))
    for layout in layouts:
        row = bench_layout(rank, world, layout, synthetic, bucket_bytes)
        if rank == 0:
            print(json.dumps(row), flush=True)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--layouts", nargs="*", default=None, help="t,p,d,tg (t*p*d must equal --world)")
    ap.add_argument("--synthetic", action="store_true", help="plain tensors with megatron's shapes/attributes")
    ap.add_argument("--bucket-mb", type=float, default=32.0)
    args = ap.parse_args()
    layouts = [tuple(int(x) for x in s.split(",")) for s in args.layouts] if args.layouts else DEFAULT_LAYOUTS
    bad = [lay for lay in layouts if lay[0] * lay[1] * lay[2] != args.world]
    if bad:
        ap.error(f"layouts {bad}: t*p*d must equal --world {args.world}")
    port = free_port()
    mp.spawn(worker, args=(args.world, port, layouts, args.synthetic, int(args.bucket_mb * 2**20)),
             nprocs=args.world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
