"""Actor throughput: log-prob (forward) and PPO update (forward + backward + step) tokens per second.

    python launch/bench_actor.py                      # tiny + medium presets at TP1 / TP2 / PP2
    python launch/bench_actor.py --presets tiny --layouts 1x1

The driver spawns one torchrun job per (model, layout) and prints one JSON object per line:
model, mcore_params (with TP vocab padding), tp, pp, nproc, tokens per batch, logprob_tokens_per_s, update_tokens_per_s,
and on GPU `mfu` (model FLOPs of the update / time / peak, with the peak named in `mfu_peak`).
Tokens are the valid (non-padding) prompt + response tokens of the batch, summed over all
ranks: the paper's aggregate-throughput convention. Each job runs ActorRolloutRefWorker
(role "actor", distributed optimizer) exactly as training does.
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

from hybridflow.ports import free_port

REPO = Path(__file__).resolve().parents[1]


def model_flops_per_token(cfg: dict, seq_len: int) -> float:
    """Forward FLOPs per token: 2 x (matmul params) plus the attention score/value products."""
    h, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or h // heads
    attn = h * heads * head_dim * 2 + h * kv * head_dim * 2  # q, o and k, v projections
    mlp = 3 * h * cfg["intermediate_size"]
    matmul_params = layers * (attn + mlp) + h * vocab  # + the LM head
    attention = layers * 2 * 2 * seq_len * heads * head_dim  # QK^T and AV, full (not causal-halved)
    return 2.0 * matmul_params + attention


# ----------------------------------------------------------------------------- one torchrun job


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from hybridflow.protocol import DataProto
    from megatron_workers.actor_rollout_ref import ActorRolloutRefWorker

    cfg = json.loads((Path(args.model) / "config.json").read_text())
    megatron = {"tensor_model_parallel_size": args.tp, "pipeline_model_parallel_size": args.pp,
                "use_distributed_optimizer": True, **json.loads(args.megatron_extra)}
    config = {"model": {"path": args.model, "dtype": args.dtype},
              "actor": {"megatron": megatron, "optim": {"lr": 1e-6}, "ppo_mini_batch_size": args.batch,
                        "ppo_micro_batch_size_per_gpu": args.micro_batch},
              "rollout": {"n": 1, "log_prob_micro_batch_size_per_gpu": args.micro_batch}}
    w = ActorRolloutRefWorker(config, role="actor")
    w.init_model()
    coords = w.get_mesh_coords("actor")

    g = torch.Generator().manual_seed(0)
    b, p, r = args.batch, args.prompt_len, args.response_len
    ids = torch.randint(4, cfg["vocab_size"], (b, p + r), generator=g)
    mask = torch.ones(b, p + r, dtype=torch.long)
    for i in range(b):  # a realistic mix: some left padding, some short responses
        mask[i, : (i * 5) % (p // 2)] = 0
        mask[i, p + r - (i * 7) % (r // 2):] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
             "responses": ids[:, p:], "response_mask": mask[:, p:]}
    full = DataProto.from_dict(batch, meta_info={"temperature": 1.0})
    shard = full.chunk(coords.dp_size)[coords.dp_rank]

    def timed(fn, reps):
        """Median over reps (the CPU boxes are shared; the median resists other jobs' bursts)."""
        out = fn()  # warm-up
        times = []
        for _ in range(reps):
            dist.barrier()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            dist.barrier()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2], out

    lp_time, old = timed(lambda: w.compute_log_prob(shard), args.reps)
    train = DataProto.from_dict({**shard.batch, "old_log_probs": old.batch["old_log_probs"],
                                 "advantages": torch.randn(shard.batch["responses"].shape, generator=g)},
                                meta_info={"temperature": 1.0})
    up_time, _ = timed(lambda: w.update_actor(train), args.reps)

    tokens = int(mask.sum())  # all DP shards together = the whole batch
    params = sum(p.numel() for p in w.actor.model[0].parameters())
    params_t = torch.tensor([params], dtype=torch.float64,  # NCCL reduces device tensors only
                            device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(params_t)  # over every rank: TP/PP shards (DP replicas counted dp times)
    result = {"model": args.name, "mcore_params": int(params_t.cpu().item() / coords.dp_size), "tp": args.tp,
              "pp": args.pp,
              "nproc": dist.get_world_size(), "batch": b, "seq_len": p + r, "tokens_per_batch": tokens,
              "logprob_s": round(lp_time, 4), "update_s": round(up_time, 4),
              "logprob_tokens_per_s": round(tokens / lp_time, 1), "update_tokens_per_s": round(tokens / up_time, 1),
              "device": "cuda" if torch.cuda.is_available() else "cpu"}
    if torch.cuda.is_available():
        from hybridflow.trainer.metrics import known_peak_flops

        result["device_peak_bytes"] = int(torch.cuda.max_memory_allocated())

        # H200: dense bf16 989 TFLOP/s, the number FACTS.md says to use (a measured 8192^3 matmul reaches ~790).
        peak = known_peak_flops(torch.cuda.get_device_name())
        if peak is not None:
            flops = 3 * model_flops_per_token(cfg, p + r) * tokens  # forward + backward (2x)
            result["mfu"] = round(flops / up_time / (peak[0] * dist.get_world_size()), 4)
            result["mfu_peak"] = peak[1]
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(result))
    dist.barrier()


# ----------------------------------------------------------------------------- driver


def driver(args) -> None:
    from hybridflow.models.tiny import save_tiny_model

    layouts = [tuple(int(x) for x in s.split("x")) for s in args.layouts.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench_actor_") as tmp:
        for preset in args.presets.split(","):
            model = save_tiny_model(Path(tmp) / preset, preset=preset, arch="llama")
            for tp, pp in layouts:
                nproc = tp * pp * args.dp
                out = Path(tmp) / f"{preset}_{tp}x{pp}.json"
                cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                       "--master-addr=127.0.0.1", f"--master-port={free_port()}", __file__, "--worker",
                       "--name", preset, "--model", str(model), "--tp", str(tp), "--pp", str(pp), "--out", str(out),
                       "--batch", str(args.batch), "--micro-batch", str(args.micro_batch),
                       "--prompt-len", str(args.prompt_len), "--response-len", str(args.response_len),
                       "--reps", str(args.reps)]
                env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                           OMP_NUM_THREADS=str(args.threads or max(1, (os.cpu_count() or 1) // nproc)))
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env, cwd=REPO)
                if proc.returncode != 0 or not out.is_file():
                    tail = "\n".join(ln for ln in (proc.stdout + proc.stderr).splitlines() if "arning" not in ln)
                    print(json.dumps({"model": preset, "tp": tp, "pp": pp, "error": tail[-2000:]}), flush=True)
                    continue
                print(out.read_text(), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--presets", default="tiny,medium")
    ap.add_argument("--layouts", default="1x1,2x1,1x2", help="comma-separated TPxPP")
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--response-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="OMP threads per process (0: cores / processes)")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--name", default="")
    ap.add_argument("--model", default="")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--out", default="")
    ap.add_argument("--dtype", default="auto", help="model dtype (auto: bf16 on GPU, fp32 on CPU)")
    ap.add_argument("--megatron-extra", default="{}", help="JSON merged into the actor's megatron config")
    args = ap.parse_args()
    if args.worker:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
