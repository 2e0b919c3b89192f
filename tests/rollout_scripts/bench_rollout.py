"""Rollout throughput on this machine: vLLM in-process vs HF generate, one process, fp32.

    python tests/rollout_scripts/bench_rollout.py [--preset small] [--prompts 32] [--tokens 64]

Prints engine start, first-generate (warm-up) time, steady tokens/s for both engines, and the
time of a full-model load_weights. Sampling at temperature 1 with ignore_eos, so every sample
has exactly --tokens tokens.
"""

import argparse
import tempfile
import time

import torch
from reference import make_prompts
from safetensors.torch import load_file

from hybridflow.config.schema import RolloutConfig
from hybridflow.models.tiny import build_tokenizer, save_tiny_model


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="small")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args()
    tok = build_tokenizer()
    texts = [f"prompt number {i}: " + "abc" * (i % 7) for i in range(args.prompts)]
    prompts = make_prompts(tok, texts=texts)
    cfg = RolloutConfig(response_length=args.tokens, ignore_eos=True, kv_cache_memory_bytes=256 * 1024 * 1024)
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_model(f"{tmp}/m", preset=args.preset, arch="llama")
        from hybridflow.rollout.hf_rollout import HFRollout

        hf = HFRollout(str(path), cfg)
        hf.generate_sequences(prompts[:2])
        hf.generate_sequences(prompts)
        print(f"HF   {args.preset}: {hf.last_stats['tokens_per_s']:.0f} tok/s ({args.prompts} x {args.tokens})")

        from hybridflow.rollout.vllm_rollout import VLLMRollout

        t0 = time.perf_counter()
        rollout = VLLMRollout(str(path), cfg)  # imports vLLM first (~13 s when the machine is idle)
        construct_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        rollout.generate_sequences(prompts)
        first_s = time.perf_counter() - t1
        rates = []
        for _ in range(2):
            rollout.generate_sequences(prompts)
            rates.append(rollout.last_stats["tokens_per_s"])
        weights = load_file(f"{path}/model.safetensors")
        rollout.load_weights(weights.items())
        n_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        print(f"vLLM {args.preset}: constructor {construct_s:.1f} s (engine start {rollout.engine_start_s:.1f} s), "
              f"first generate {first_s:.1f} s, steady {max(rates):.0f} tok/s, "
              f"load_weights {rollout.last_weight_load_s * 1000:.0f} ms for {n_bytes / 2**20:.1f} MiB "
              f"(threads {rollout.threads}, torch {torch.get_num_threads()})")
        rollout.shutdown()


if __name__ == "__main__":
    main()
