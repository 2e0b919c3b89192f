"""MoE weight sync on CPU under torchrun: Megatron (EP x ETP x TP x PP) -> HybridEngine -> vLLM, through VLLMRollout.

Usage: torchrun --nproc-per-node N tests/reshard_scripts/check_vllm_sync_moe.py W0_DIR W1_DIR T P TG EP [ETP]

Megatron (gloo) is loaded with the MoE weights W1; the colocated VLLMRollout (the trainer's engine: t_g=1 gives
independent single-rank engines, t_g > 1 external_launcher in the planned groups) starts from W0. After `sync_to`
with everything outside each rank's region filled with NaN, vLLM's greedy tokens must equal HF's for W1 and its
log-probs must equal Megatron's own log-probs of the same tokens (fp32) within 1e-5; a second sync without poison
must give the same. Rank 0 prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_vllm_sync import NEW_TOKENS, PROMPTS, hf_greedy, vllm_greedy  # noqa: E402

TOLERANCE = 1e-5


def megatron_logprobs(model, tokens: list[list[int]]) -> list[list[float]]:
    """Megatron's log-prob of each generated token (prompt + tokens, teacher-forced), on every rank."""
    from megatron_workers.logprob import forward_logprobs

    rows = [p + t for p, t in zip(PROMPTS, tokens)]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    with torch.no_grad():
        lp, _ = forward_logprobs(model, ids, mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                                 compute_entropy=False)
    return [[lp[i, len(p) + k - 1].item() for k in range(len(t))] for i, (p, t) in enumerate(zip(PROMPTS, tokens))]


def main() -> int:
    w0, w1 = sys.argv[1], sys.argv[2]
    t, p, t_g, ep = map(int, sys.argv[3:7])
    etp = int(sys.argv[7]) if len(sys.argv) > 7 else None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(rank % max(1, os.cpu_count() or 1)))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    from hybridflow.config.schema import RolloutConfig
    from hybridflow.parallel.dims import GenerationDims, ParallelDims
    from hybridflow.resharding.hybrid_engine import HybridEngine
    from hybridflow.rollout.vllm_rollout import VLLMRollout
    from megatron_workers.hf_io import load_hf_into_mcore, read_hf_config
    from megatron_workers.model_builder import build_gpt_model
    from megatron_workers.parallel_init import init_distributed, init_model_parallel

    dims = ParallelDims(tp=t, pp=p, dp=world // (t * p), sp=t > 1, ep=ep, etp=etp)
    init_distributed(timeout_s=300)
    init_model_parallel(dims, seed=0)
    cfg = read_hf_config(w1)
    model = build_gpt_model(cfg, dims)
    load_hf_into_mcore([model], w1, cfg)
    model.eval()

    hybrid = HybridEngine(dims, GenerationDims(tp=t_g), [model], cfg, bucket_bytes=64 << 10, timeout_s=120)
    rcfg = RolloutConfig(tensor_model_parallel_size=t_g, response_length=NEW_TOKENS, n=1, seed=0,
                         kv_cache_memory_bytes=64 << 20)
    rollout = VLLMRollout(w0, rcfg, dtype="float32", max_model_len=128, group_order=hybrid.group_order,
                          cpu_shm_allreduce=False)
    if t_g > 1:
        hybrid.verify_groups()

    ref_tokens, _ = hf_greedy(w1)
    before, before_logps = vllm_greedy(rollout.llm)
    stats = hybrid.sync_to(rollout, device_kind="cpu", poison=float("nan"))
    after, after_logps = vllm_greedy(rollout.llm)
    stats2 = hybrid.sync_to(rollout, device_kind="cpu")  # the production path: untouched pages, no poison
    again, again_logps = vllm_greedy(rollout.llm)
    mcore = megatron_logprobs(model, after)

    def max_diff(a, b):
        return max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))

    result = {
        "rank": rank, "layout": {"t": t, "p": p, "d": dims.dp, "ep": ep, "etp": dims.expert_tp, "t_g": t_g},
        "groups": hybrid.plan.gen_tp_groups,
        "before_equals_reference": before == ref_tokens,
        "max_logprob_diff_before_vs_megatron": max_diff(before_logps, mcore) if before == after else None,
        "after_equals_reference": after == ref_tokens, "again_equals_after": again == after,
        "max_logprob_diff_vs_megatron": max_diff(after_logps, mcore),
        "max_logprob_diff_unpoisoned_vs_megatron": max_diff(again_logps, mcore),
        "sync": stats, "sync_unpoisoned_s": stats2["seconds"],
        "shm_active": rollout.shm_active,  # off here on every machine: the AVX2 path, forced on AVX-512/AMX too
    }
    results: list = [None] * world
    torch.distributed.all_gather_object(results, result)
    if rank == 0:
        print(json.dumps({"ranks": results}), flush=True)
    ok = all(r["after_equals_reference"] and r["again_equals_after"] and r["max_logprob_diff_vs_megatron"] < TOLERANCE
             and r["max_logprob_diff_unpoisoned_vs_megatron"] < TOLERANCE
             and r["sync"]["bytes_recv"] == r["sync"]["expected_recv_bytes"] for r in results)
    rollout.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
