"""End-to-end weight sync on CPU under torchrun (2 processes): Megatron shards -> HybridEngine -> vLLM.

Usage: torchrun --nproc-per-node 2 tests/reshard_scripts/check_vllm_sync.py W0_DIR W1_DIR T P TG

Megatron (gloo, layout t x p) is loaded with the weights W1; a colocated vLLM engine (external_launcher,
TP = TG, created inside HybridEngine.group_order so its groups are the planned ones) starts from the
different weights W0. After `sync_to` with everything outside each rank's region filled with NaN,
vLLM's greedy tokens must equal HF transformers' greedy tokens for W1 (fp32) with log-probs within
1e-3, and before it they must differ (tokens, or log-probs by > 1e-2). Rank 0 prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys

import torch

PROMPTS = [[1, 10, 20, 30, 40], [1, 50, 51, 52], [1, 7, 7, 7, 7, 7, 60], [1, 33]]
NEW_TOKENS = 12


def hf_greedy(model_dir: str) -> tuple[list[list[int]], list[list[float]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # compare fixed-length continuations
    tokens, logps = [], []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True, pad_token_id=0)
            gen = out.sequences[0, len(p):].tolist()
            tokens.append(gen)
            logps.append([torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, gen)])
    return tokens, logps


def vllm_greedy(llm) -> tuple[list[list[int]], list[list[float]]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logps = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, toks)] for o, toks in zip(outs, tokens)]
    return tokens, logps


def main() -> int:
    w0, w1, t, p, t_g = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(rank % max(1, os.cpu_count() or 1)))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    from hybridflow.parallel.dims import GenerationDims, ParallelDims
    from hybridflow.resharding.hybrid_engine import HybridEngine
    from megatron_workers.hf_io import load_hf_into_mcore, read_hf_config
    from megatron_workers.model_builder import build_gpt_model
    from megatron_workers.parallel_init import init_distributed, init_model_parallel

    dims = ParallelDims(tp=t, pp=p, dp=world // (t * p))
    init_distributed(timeout_s=300)
    init_model_parallel(dims)
    cfg = read_hf_config(w1)
    model = build_gpt_model(cfg, dims)
    load_hf_into_mcore([model], w1, cfg)

    hybrid = HybridEngine(dims, GenerationDims(tp=t_g), [model], cfg, bucket_bytes=64 << 10, timeout_s=120)
    from hybridflow.rollout.vllm_engine import build_llm

    replicas = len(hybrid.plan.gen_tp_groups)
    kwargs = dict(model=w0, tokenizer=w0, dtype="float32", tensor_parallel_size=t_g, enforce_eager=True,
                  distributed_executor_backend="external_launcher", kv_cache_memory_bytes=64 << 20, seed=0,
                  max_model_len=128)
    if replicas > 1:
        kwargs["data_parallel_size"] = replicas
    llm = build_llm(kwargs, around=[hybrid.group_order()]).llm
    hybrid.verify_groups()

    ref_tokens, ref_logps = hf_greedy(w1)
    before, before_logps = vllm_greedy(llm)
    stats = hybrid.sync_to(llm, device_kind="cpu", poison=float("nan"))
    after, after_logps = vllm_greedy(llm)
    stats2 = hybrid.sync_to(llm, device_kind="cpu")  # the production path: untouched pages, no poison
    again, _ = vllm_greedy(llm)

    def max_diff(logps):
        return max(abs(a - b) for xs, ys in zip(logps, ref_logps) for a, b in zip(xs, ys))

    max_logp_diff = max_diff(after_logps)

    result = {
        "rank": rank, "layout": {"t": t, "p": p, "d": dims.dp, "t_g": t_g}, "groups": hybrid.plan.gen_tp_groups,
        "before_equals_reference": before == ref_tokens, "after_equals_reference": after == ref_tokens,
        # tiny random models can agree on greedy tokens by chance; their log-probs do not
        "max_logprob_diff_before": max_diff(before_logps) if before == ref_tokens else None,
        "unpoisoned_equals_reference": again == ref_tokens, "max_logprob_diff": max_logp_diff,
        "sync": stats, "sync_unpoisoned_s": stats2["seconds"],
    }
    results: list = [None] * world
    torch.distributed.all_gather_object(results, result)
    if rank == 0:
        print(json.dumps({"ranks": results}), flush=True)
    ok = all(r["after_equals_reference"] and r["unpoisoned_equals_reference"] and r["max_logprob_diff"] < 1e-3
             and (not r["before_equals_reference"] or r["max_logprob_diff_before"] > 1e-2) for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
