"""Cross-pool weight sync end to end on CPU: a Megatron training pool and a separate vLLM rollout pool.

Usage: python check_cross_pool.py train|rollout RANK OUT_DIR W0 W1 T P TG R TRAIN_PORT ROLLOUT_PORT SYNC_PORT

Two pools of real processes. The training pool (T = t*P ranks, its own gloo world on TRAIN_PORT) builds a
Megatron GPT (layout t x P, fp32) from the weights W1 and holds no vLLM engine; the rollout pool (R ranks; a
world of its own on ROLLOUT_PORT for vLLM's external_launcher when TG > 1, independent "uni" engines when TG = 1)
starts vLLM from other weights W0 and holds no Megatron model. The sync group (SYNC_PORT) spans both.

  1. trainer: log-probs lp1 of a fixed batch (Megatron forward); rollout: the same batch's prompt log-probs
     before any sync (must differ), then TrainerSender.send() / RolloutReceiver.receive_into(vLLM): equal lp1
  2. trainer: a deterministic perturbation (an "update"), lp2; send(wait=False), then at once a second
     perturbation while the bytes are in flight (the next update), lp3, then wait. Rollout: its stale log-probs
     (must differ from lp2: a sync that did nothing fails), then receive: equal lp2, not lp3.
Training rank 0 and rollout rank 0 also measure the link (64 MiB gloo messages). Each process writes
OUT_DIR/<role><rank>.json; tests/test_cross_pool_sync.py compares them.
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from pathlib import Path

import torch

# The fixed batch: token ids < 104 (the tiny tokenizer's vocab), different lengths.
SEQS = [[1, 10, 20, 30, 40, 50, 60, 70], [1, 50, 51, 52, 53], [1, 7, 7, 7, 7, 7, 60, 61, 62, 90, 100],
        [1, 33, 34]]
BANDWIDTH_BYTES = 64 << 20


def perturb(model, dims, step: int) -> None:
    """A deterministic update: the same on every data replica, each TP shard its own (a valid model)."""
    from hybridflow.resharding.cross_pool import megatron_named_params

    tp = dims.coords(torch.distributed.get_rank())["tp"]
    with torch.no_grad():
        for name, p in megatron_named_params([model]):
            split = bool(getattr(p, "tensor_model_parallel", False))
            seed = zlib.crc32(f"{name}/{tp if split else 0}/{step}".encode())
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed), dtype=p.dtype))


def trainer_logprobs(model) -> list[list[float]]:
    from megatron_workers.logprob import forward_logprobs

    width = max(map(len, SEQS))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in SEQS])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in SEQS])
    lp, _ = forward_logprobs(model, ids, mask, compute_entropy=False)
    return [lp[i, : len(s) - 1].tolist() for i, s in enumerate(SEQS)]


def vllm_logprobs(llm) -> list[list[float]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in SEQS], params, use_tqdm=False)
    return [[o.prompt_logprobs[k][s[k]].logprob for k in range(1, len(s))] for o, s in zip(outs, SEQS)]


def run_trainer(rank: int, a) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(a.T), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(a.train_port))
    from hybridflow.parallel.dims import ParallelDims
    from hybridflow.resharding.cross_pool import TrainerSender, make_sync_group, measure_bandwidth
    from megatron_workers.hf_io import load_hf_into_mcore, read_hf_config
    from megatron_workers.model_builder import build_gpt_model
    from megatron_workers.parallel_init import init_distributed, init_model_parallel

    dims = ParallelDims(tp=a.T // a.P, pp=a.P)
    init_distributed(timeout_s=300)
    init_model_parallel(dims)
    cfg = read_hf_config(a.w1)
    model = build_gpt_model(cfg, dims)
    load_hf_into_mcore([model], a.w1, cfg)

    group = make_sync_group("127.0.0.1", a.sync_port, rank, a.T + a.R, timeout_s=300)
    sender = TrainerSender.for_megatron(dims, [model], cfg, group)
    out = {"role": "train", "rank": rank, "vllm_imported": "vllm" in sys.modules,
           "send_bytes": sender.plan.send_bytes(rank)}
    if rank == 0:
        out["bandwidth_Bps"] = measure_bandwidth(group, 0, a.T, BANDWIDTH_BYTES)
    out["lp1"] = trainer_logprobs(model)
    out["sync1"] = sender.send().as_dict()
    perturb(model, dims, 1)
    out["lp2"] = trainer_logprobs(model)
    pending = sender.send(wait=False)
    perturb(model, dims, 2)  # the next update overlaps the send
    out["lp3"] = trainer_logprobs(model)
    out["sync2"] = pending.wait().as_dict()
    return out


def run_rollout(rank: int, a) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(rank % max(1, os.cpu_count() or 1)))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    if a.TG > 1:  # external_launcher: the rollout pool's own world (vLLM creates it from these)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(a.R), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(a.rollout_port))
    from hybridflow.resharding.cross_pool import RolloutReceiver, make_sync_group, measure_bandwidth
    from hybridflow.resharding.cross_pool_plan import RolloutLayout
    from hybridflow.rollout.vllm_engine import build_llm
    from megatron_workers.hf_io import read_hf_config

    kwargs = dict(model=a.w0, tokenizer=a.w0, dtype="float32", tensor_parallel_size=a.TG, enforce_eager=True,
                  kv_cache_memory_bytes=64 << 20, seed=0, max_model_len=128, enable_prefix_caching=False,
                  distributed_executor_backend="external_launcher" if a.TG > 1 else "uni")
    if a.TG > 1 and a.R > a.TG:
        kwargs["data_parallel_size"] = a.R // a.TG
    llm = build_llm(kwargs).llm  # segments named per job: the next layout's engine must not meet this one's
    cfg = read_hf_config(a.w1)  # the same architecture; the weights come from the trainer

    group = make_sync_group("127.0.0.1", a.sync_port, a.T + rank, a.T + a.R, timeout_s=300)
    receiver = RolloutReceiver.connect(group, RolloutLayout(ranks=a.R, tp=a.TG), rank, bucket_bytes=64 << 10)
    plan = receiver.plan
    replica, gen_tp = plan.rollout.coords(rank)
    out = {"role": "rollout", "rank": rank, "megatron_imported": "megatron.core" in sys.modules,
           "replica": replica, "gen_tp": gen_tp, "model_bytes": plan.model_bytes,
           "planned_bytes": plan.recv_bytes(rank), "shard_bytes": plan.expected_recv_bytes(rank),
           "buckets": len(plan.buckets),
           "replicated_bytes": sum(s.nbytes for s in plan.specs if not s.tensor_parallel)}
    if rank == 0:
        out["bandwidth_Bps"] = measure_bandwidth(group, 0, a.T, BANDWIDTH_BYTES)
    out["lp_before"] = vllm_logprobs(llm)
    out["sync1"] = receiver.receive_into(llm, cfg, device_kind="cpu").as_dict()
    out["lp_after1"] = vllm_logprobs(llm)
    out["sync2"] = receiver.receive_into(llm, cfg, device_kind="cpu").as_dict()
    out["lp_after2"] = vllm_logprobs(llm)
    return out


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["train", "rollout"])
    ap.add_argument("rank", type=int)
    for name in ("out", "w0", "w1"):
        ap.add_argument(name)
    for name in ("T", "P", "TG", "R", "train_port", "rollout_port", "sync_port"):
        ap.add_argument(name, type=int)
    a = ap.parse_args()
    torch.set_num_threads(1)
    out = run_trainer(a.rank, a) if a.role == "train" else run_rollout(a.rank, a)
    Path(a.out, f"{a.role}{a.rank}.json").write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
