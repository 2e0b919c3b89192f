"""Multi-process check of the resharding engine on gloo (spawns its own processes).

Usage: python tests/reshard_scripts/run_engine_cases.py [--world 4] [--cases t,p,tg ...]

Every rank builds the same synthetic Llama-shaped full tensors from a seed, keeps the Megatron
training shard of its stage (cut here by plain chunking, independently of the planner) as
parameters carrying Megatron's TP attributes, and goes through the adapter -> planner -> engine.
The result is compared with the generation shard cut directly from the full tensor (vLLM's vocab
split for the vocab matrices). The naive all-gather
baseline is checked the same way. One JSON line per case and rank goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
import zlib

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridflow.ports import free_port

H, NH, NG, HD, F, V, LAYERS = 8, 4, 4, 2, 16, 200, 4
VLLM_VOCAB_PAD = 64


def full_tensors(t: int) -> dict[str, tuple[torch.Tensor, dict]]:
    """name -> (full tensor, Megatron attributes incl. stage-free layer index). Vocab padded to 8*t rows."""
    v_pad = -(-V // (8 * t)) * (8 * t)
    qkv_rows = NG * (NH // NG + 2) * HD
    out = {}

    def add(name, shape, tp=False, dim=0, stride=1, dtype=torch.float32):
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))  # same on every process
        out[name] = (torch.randn(shape, generator=g).to(dtype), dict(tp=tp, dim=dim, stride=stride))

    add("embedding.word_embeddings.weight", (v_pad, H), tp=True)
    for i in range(LAYERS):
        p = f"decoder.layers.{i}."
        add(p + "input_layernorm.weight", (H,))
        add(p + "self_attention.linear_qkv.weight", (qkv_rows, H), tp=True)
        add(p + "self_attention.linear_qkv.bias", (qkv_rows,), tp=True, dtype=torch.float64)
        add(p + "self_attention.linear_proj.weight", (H, NH * HD), tp=True, dim=1)
        add(p + "pre_mlp_layernorm.weight", (H,), dtype=torch.bfloat16)
        add(p + "mlp.linear_fc1.weight", (2 * F, H), tp=True, stride=2)
        add(p + "mlp.linear_fc2.weight", (H, F), tp=True, dim=1)
    add("decoder.final_layernorm.weight", (H,))
    add("output_layer.weight", (v_pad, H), tp=True)
    return out


def cut(full: torch.Tensor, attrs: dict, parts: int, index: int) -> torch.Tensor:
    """Megatron's shard, by plain chunking: each stride block split in `parts`, blocks concatenated."""
    if not attrs["tp"]:
        return full
    blocks = full.chunk(attrs["stride"], dim=attrs["dim"])
    return torch.cat([b.chunk(parts, dim=attrs["dim"])[index] for b in blocks], dim=attrs["dim"])


def vllm_vocab_rows(full: torch.Tensor, t_g: int, j: int) -> torch.Tensor:
    padded = -(-V // VLLM_VOCAB_PAD) * VLLM_VOCAB_PAD
    per = padded // t_g
    return full[j * per: min((j + 1) * per, V)]


def stage_of(name: str, p: int) -> int:
    if name.startswith("embedding"):
        return 0
    if name.startswith("decoder.layers."):
        return int(name.split(".")[2]) // (LAYERS // p)
    return p - 1


def stage_params(fulls, t: int, p: int, tp_rank: int, pp_rank: int) -> list[tuple[str, torch.nn.Parameter]]:
    """(global name, parameter) of this rank's stage, each tagged with Megatron's TP attributes."""
    out = []
    for name, (full, attrs) in fulls.items():
        if stage_of(name, p) != pp_rank:
            continue
        param = torch.nn.Parameter(cut(full, attrs, t, tp_rank).clone(), requires_grad=False)
        if attrs["tp"]:
            param.tensor_model_parallel = True
            param.partition_dim, param.partition_stride = attrs["dim"], attrs["stride"]
        out.append((name, param))
    return out


def run_case(rank: int, t: int, p: int, t_g: int, world: int) -> dict:
    from hybridflow.parallel.dims import GenerationDims, ParallelDims
    from hybridflow.resharding.engine import ReshardEngine
    from hybridflow.resharding.megatron_specs import gather_param_specs, param_specs
    from hybridflow.resharding.naive import NaiveAllGather
    from hybridflow.resharding.planner import plan_resharding

    d = world // (t * p)
    dims, gen = ParallelDims(tp=t, pp=p, dp=d), GenerationDims(tp=t_g)
    me = dims.coords(rank)
    fulls = full_tensors(t)
    named = stage_params(fulls, t, p, me["tp"], me["pp"])
    local_specs, shards = param_specs(named, t, me["pp"], vocab_size=V, gen_vocab_pad_multiple=VLLM_VOCAB_PAD)
    plan = plan_resharding(dims, gen, gather_param_specs(local_specs))
    j = plan.placements[rank].gen_tp

    def reference(name):
        full, attrs = fulls[name]
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            return vllm_vocab_rows(full, t_g, j)
        return cut(full, attrs, t_g, j)

    def compare(got: dict) -> list[str]:
        def same(n):
            return got[n].dtype == fulls[n][0].dtype and torch.equal(got[n], reference(n))

        return [n for n in fulls if n not in got or not same(n)]

    result = {"case": [t, p, d, t_g], "rank": rank, "gen_tp": j, "replica": plan.placements[rank].replica}
    small = ReshardEngine(plan, bucket_bytes=2048)
    streamed, n_yields = {}, 0
    for part in small.iter_shards(shards):
        streamed.update(part)
        n_yields += 1
    big = ReshardEngine(plan, bucket_bytes=1 << 30)
    materialised = big.run(shards)
    naive = NaiveAllGather(plan)
    naive_out = naive.run(shards)
    max_param_cost = max(small._cost(rank, s) for s in plan.specs)
    aliased = [n for n in shards if materialised[n].data_ptr() == shards[n].data_ptr()]
    own_stage = [s.name for s in plan.specs if s.pp_stage == me["pp"]]
    result.update(
        mismatched_small_buckets=compare(streamed),
        mismatched_one_bucket=compare(materialised),
        mismatched_naive=compare(naive_out),
        buckets_small=small.stats.num_buckets,
        yields_small=n_yields,
        buckets_big=big.stats.num_buckets,
        recv_measured=small.stats.bytes_recv,
        recv_measured_big=big.stats.bytes_recv,
        sent_measured=small.stats.bytes_sent,
        recv_planned=plan.recv_bytes(rank),
        sent_planned=plan.send_bytes(rank),
        recv_lower_bound=plan.expected_recv_bytes(rank),
        naive_recv=naive.stats.bytes_recv,
        model_bytes=sum(s.nbytes for s in plan.specs),
        peak_extra_small=small.stats.peak_extra_bytes,
        bucket_bytes_small=2048,
        max_param_cost=max_param_cost,
        aliased=sorted(aliased),
        own_stage_params=sorted(own_stage),
        aliased_bytes=big.stats.bytes_aliased,
        specs=len(plan.specs),
    )
    return result


def worker(rank: int, world: int, port: int, cases: list, out_dir: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=__import__("datetime").timedelta(seconds=60))
    lines = []
    for t, p, t_g in cases:
        try:
            lines.append(run_case(rank, t, p, t_g, world))
        except Exception as e:  # report, keep the other ranks from hanging on this case as well as possible
            lines.append({"case": [t, p, world // (t * p), t_g], "rank": rank, "error": repr(e),
                          "traceback": traceback.format_exc()})
            break
        dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.jsonl"), "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    dist.destroy_process_group()


DEFAULT_CASES = [(2, 1, 1), (2, 1, 2), (1, 2, 1), (2, 2, 1), (1, 1, 2), (4, 1, 2), (2, 1, 4),
                 (4, 1, 4), (1, 2, 2), (2, 2, 2), (4, 1, 1), (1, 4, 1), (1, 4, 2)]


def main() -> int:
    import tempfile

    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--cases", nargs="*", default=None, help="t,p,tg triples")
    args = parser.parse_args()
    cases = [tuple(int(x) for x in c.split(",")) for c in args.cases] if args.cases else DEFAULT_CASES
    cases = [c for c in cases if args.world % (c[0] * c[1]) == 0 and args.world % c[2] == 0]
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(worker, args=(args.world, port, cases, out_dir), nprocs=args.world, join=True)
        for r in range(args.world):
            with open(os.path.join(out_dir, f"rank{r}.jsonl")) as f:
                sys.stdout.write(f.read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
