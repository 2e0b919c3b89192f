"""What the sampler's log-probs cost a rollout replica: the same generation with and without them, in one process.

    python launch/bench_rollout_logprobs.py [--preset tiny] [--prompts 16] [--samples 4] [--tokens 128]

One VLLMRollout (t_g=1, one thread, in-process engine, as each worker of a 2-process CPU pool has) generates
the bench_vs_trl workload of one replica (16 prompts x 4 samples x 128 tokens, ignore_eos, fp32), alternating
actor_rollout_ref.rollout.calculate_log_probs on and off with the same per-call seed, so both settings draw
the same tokens. Prints one JSON line: median seconds of each setting and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4, help="timed calls per setting, after one warm-up each")
    a = ap.parse_args()
    from hybridflow.config.schema import RolloutConfig
    from hybridflow.models.tiny import save_tiny_model
    from hybridflow.rollout.vllm_rollout import VLLMRollout
    from launch.bench_rollout_dp import _batch

    model = save_tiny_model(Path(tempfile.mkdtemp()) / "model", preset=a.preset, arch="llama", seed=0)
    cfg = RolloutConfig(tensor_model_parallel_size=1, response_length=a.tokens, ignore_eos=True, seed=7,
                        n=a.samples, kv_cache_memory_bytes=256 * 1024 * 1024)
    rollout = VLLMRollout(str(model), cfg, threads=1)
    times: dict[bool, list[float]] = {True: [], False: []}
    outputs = {}
    try:
        for i in range(a.rounds + 1):
            for on in (True, False):
                rollout.config.calculate_log_probs = on
                batch = _batch(a.prompts)
                batch.meta_info["global_step"] = i + 1  # the same step: the same seed for both settings
                t = time.perf_counter()
                outputs[on] = rollout.generate_sequences(batch)
                if i:
                    times[on].append(time.perf_counter() - t)
            assert outputs[True].batch["responses"].equal(outputs[False].batch["responses"])
    finally:
        rollout.shutdown()
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(json.dumps({"preset": a.preset, "rows": a.prompts * a.samples, "tokens": a.tokens,
                      "with_log_probs_s": round(on, 3), "without_log_probs_s": round(off, 3),
                      "without_vs_with": round(off / on, 3)}))


if __name__ == "__main__":
    main()
