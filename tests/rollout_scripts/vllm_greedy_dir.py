"""Greedy generation with plain vLLM (in-process engine, fp32) from an HF directory, on given prompt token ids.

    python vllm_greedy_dir.py MODEL_DIR PROMPTS_JSON MAX_TOKENS OUT_JSON

PROMPTS_JSON is a list of token-id lists; OUT_JSON gets the generated token ids per prompt. vLLM's own API with
plain arguments (LLM + SamplingParams), as a user loading an exported model would; the LLM is built through
hybridflow.rollout.vllm_engine.build_llm, like every engine in the repository, which adds only the per-job shm
segment names and their removal.
"""

from __future__ import annotations

import json
import os
import sys

if __name__ == "__main__":  # vLLM may spawn processes: keep the guard
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    model_dir, prompts_file, max_tokens, out_file = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    from vllm import SamplingParams

    from hybridflow.rollout.vllm_engine import build_llm

    prompts = json.load(open(prompts_file))
    llm = build_llm(dict(model=model_dir, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=256 * 1024**2,
                         seed=0)).llm
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False))
    json.dump([list(o.outputs[0].token_ids) for o in outs], open(out_file, "w"))
