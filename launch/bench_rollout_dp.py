"""What vLLM's data-parallel coupling costs a rollout replica: the same generation alone and as one of two replicas.

    python launch/bench_rollout_dp.py [--preset tiny] [--prompts 16] [--samples 4] [--tokens 128]

With t_g=1 on 2 worker processes, each process is a rollout replica. vLLM's `external_launcher` needs
`data_parallel_size=2` for that (FACTS.md), and vLLM's data-parallel engines then agree on every engine step with
gloo all-reduces over the trainer's processes, so the two replicas step in lockstep. VLLMRollout therefore
builds, on CPU, one independent in-process engine per process instead. This script measures,
on the bench_vs_trl workload of one replica (16 prompts x 4 samples x 128 tokens, ignore_eos, fp32):
- `alone_s`: VLLMRollout in one process (t_g=1, no DP), the second of two generate calls;
- `dp2_s`: both ranks of a 2-process gloo group (torchrun), two vLLM data-parallel replicas (external_launcher,
  data_parallel_size=2), each generating its own copy of the batch, with the number and the seconds of
  torch.distributed wait/all_reduce calls inside one generate (cProfile on rank 0);
- `independent_s`: the same two ranks with VLLMRollout's CPU default for t_g=1, an in-process engine per
  process (no collectives).
Both runs share the machine the same way (2 processes for dp2; alone runs twice side by side). One JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _batch(prompts: int):
    import torch

    from hybridflow.protocol import DataProto

    ids = torch.arange(3, 3 + 17).repeat(prompts, 1)
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                        "position_ids": torch.arange(17).repeat(prompts, 1)})


# vLLM's own data-parallel replicas, as VLLMRollout built them for t_g=1 before it made each process an engine of
# its own (the CPU default now): the coupled baseline this script compares against
COUPLED = {"distributed_executor_backend": "external_launcher", "data_parallel_size": 2}


def _rollout(model: str, n: int, tokens: int, coupled: bool = False):
    from hybridflow.config.schema import RolloutConfig
    from hybridflow.rollout.vllm_rollout import VLLMRollout

    cfg = RolloutConfig(tensor_model_parallel_size=1, response_length=tokens, ignore_eos=True, seed=7, n=n,
                        kv_cache_memory_bytes=256 * 1024 * 1024)
    # one core per replica, as each worker of a 2-process pool has
    return VLLMRollout(model, cfg, threads=1, engine_kwargs=COUPLED if coupled else None)


def worker(model: str, prompts: int, n: int, tokens: int, out: str) -> None:
    """One process: alone (no process group) or a rank of torchrun's 2-process gloo group."""
    import cProfile
    import pstats

    import torch.distributed as dist

    ranked = "RANK" in os.environ
    if ranked:
        dist.init_process_group("gloo")
    coupled = os.environ.get("BENCH_COUPLED") == "1"
    rollout, batch = _rollout(model, n, tokens, coupled), _batch(prompts)
    rollout.generate_sequences(batch)  # warm-up
    t = time.perf_counter()
    rollout.generate_sequences(batch)
    seconds = time.perf_counter() - t
    prof = cProfile.Profile()
    prof.enable()
    rollout.generate_sequences(batch)
    prof.disable()
    calls, coll_s = 0, 0.0
    for (_, _, name), (_, ncalls, tottime, _, _) in pstats.Stats(prof).stats.items():
        if name in ("<built-in method torch._C._distributed_c10d.wait>",
                    "<built-in method torch._C._distributed_c10d.allreduce>"):
            calls, coll_s = calls + ncalls, coll_s + tottime
    rank = dist.get_rank() if ranked else 0
    Path(f"{out}.{rank}.json").write_text(json.dumps({"seconds": seconds, "collective_calls": calls,
                                                      "collective_s": coll_s, "replicas": rollout.num_replicas}))
    if ranked:
        dist.barrier()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", dest="n", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--timeout-s", type=int, default=600)
    ap.add_argument("--worker", nargs=2, metavar=("MODEL", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker[0], args.prompts, args.n, args.tokens, args.worker[1])
    from hybridflow.models.tiny import save_tiny_model

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(save_tiny_model(f"{tmp}/model", preset=args.preset, arch="llama", seed=0))
        common = [__file__, "--prompts", str(args.prompts), "--samples", str(args.n), "--tokens", str(args.tokens)]
        alone = [subprocess.Popen([sys.executable, *common, "--worker", model, f"{tmp}/alone{i}"], env=env)
                 for i in range(2)]  # two side by side: the machine is shared as in the DP run
        for p in alone:
            if p.wait(timeout=args.timeout_s) != 0:
                raise SystemExit(f"the alone run failed (rc {p.returncode})")
        for name, coupled in (("dp", "1"), ("indep", "0")):
            run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                  "--master-port", str(_free_port()), *common, "--worker", model, f"{tmp}/{name}"],
                                 env={**env, "BENCH_COUPLED": coupled}, timeout=args.timeout_s)
            if run.returncode != 0:
                raise SystemExit(f"the 2-process {name} run failed (rc {run.returncode})")
        read = lambda name: json.loads(Path(f"{tmp}/{name}.json").read_text())
        alone_runs, dp_runs = [read("alone0.0"), read("alone1.0")], [read("dp.0"), read("dp.1")]
        indep_runs = [read("indep.0"), read("indep.1")]
    alone_s = sum(r["seconds"] for r in alone_runs) / 2
    dp_s = max(r["seconds"] for r in dp_runs)
    indep_s = max(r["seconds"] for r in indep_runs)
    print(json.dumps({"preset": args.preset, "rows_per_replica": args.prompts * args.n, "tokens": args.tokens,
                      "alone_s": round(alone_s, 3), "dp2_s": round(dp_s, 3), "dp2_over_alone": round(dp_s / alone_s, 3),
                      "dp2_collective_calls_per_generate": dp_runs[0]["collective_calls"],
                      "dp2_collective_s_per_generate": round(dp_runs[0]["collective_s"], 3),
                      "dp2_replicas": dp_runs[0]["replicas"],
                      "independent_s": round(indep_s, 3), "independent_over_alone": round(indep_s / alone_s, 3),
                      "independent_collective_calls_per_generate": indep_runs[0]["collective_calls"]}))


def _free_port() -> int:
    from hybridflow.controller.worker import free_port

    return free_port()


if __name__ == "__main__":
    main()
