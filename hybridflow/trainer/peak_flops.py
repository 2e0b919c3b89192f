"""The per-device peak behind perf/mfu/*: a table on GPU, this CPU's own matmul rate measured on CPU.

A CPU has no datasheet peak that torch reaches: its rate depends on the dtype (AMX or AVX-512 BF16 against
fp32 FMA), the threads each worker process gets and the GEMM's shape. So on CPU the peak is measured at start,
in the driver, at the actor's own largest GEMM (the MLP's fc1: micro-batch tokens x hidden -> 2 x ffn / tp),
in the actor's resolved dtype, on one worker's share of the cores; `source` names what was measured.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class GemmShape:
    m: int  # tokens in one micro-batch
    k: int  # hidden
    n: int  # 2 x ffn / tp: the gated MLP's fc1 on one TP rank

    @property
    def flops(self) -> int:
        return 2 * self.m * self.k * self.n

    def __str__(self) -> str:
        return f"[{self.m}x{self.k}] @ [{self.k}x{self.n}]"


def actor_gemm_shape(hf_config: dict, tp: int, micro_batch: int, seq_len: int, max_tokens: int = 4096) -> GemmShape:
    """The actor's fc1 GEMM at its micro-batch (capped at max_tokens rows, where the rate has long levelled)."""
    m = max(1, min(micro_batch * seq_len, max_tokens))
    return GemmShape(m, int(hf_config["hidden_size"]), max(1, 2 * int(hf_config["intermediate_size"]) // tp))


def threads_per_device(n_devices_per_node: int) -> int:
    """One worker's share of this node's cores, as the workers take it (vllm_launch.prepare_cpu_threads)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // max(1, n_devices_per_node))


def measure_gemm_flops(shape: GemmShape, dtype: str, threads: int, min_s: float = 0.2, warmup: int = 2) -> float:
    """FLOP/s of `a @ b` at `shape` in `dtype` ('float32' | 'bfloat16') on `threads` threads: the best of
    repeated timings over at least min_s (the best, since a peak is what the hardware can do, not the mean
    under other load)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dt = getattr(torch, dtype)
        a, b = torch.randn(shape.m, shape.k).to(dt), torch.randn(shape.k, shape.n).to(dt)
        for _ in range(warmup):
            a @ b
        best, spent = float("inf"), 0.0
        while spent < min_s or best == float("inf"):
            t = time.perf_counter()
            a @ b
            dt_s = time.perf_counter() - t
            best, spent = min(best, dt_s), spent + dt_s
        return shape.flops / best
    finally:
        torch.set_num_threads(before)


# Where the actor's config cannot be read (a driver built around stand-in workers): a square product.
FALLBACK_SHAPE = GemmShape(1024, 1024, 1024)


def cpu_peak_flops(hf_config: dict | None, tp: int, micro_batch: int, seq_len: int, dtype: str,
                   n_devices_per_node: int) -> tuple[float, str]:
    """(FLOP/s per device, source): measured now, at the actor's own GEMM shape (hf_config None: FALLBACK_SHAPE)
    and dtype."""
    shape = actor_gemm_shape(hf_config, tp, micro_batch, seq_len) if hf_config else FALLBACK_SHAPE
    threads = threads_per_device(n_devices_per_node)
    flops = measure_gemm_flops(shape, dtype, threads)
    return flops, f"measured {dtype} matmul {shape}, {threads} thread{'s' * (threads > 1)} (this CPU, at start)"


def device_peak_flops(cfg) -> tuple[float, str]:
    """perf/mfu/*'s peak per device: the config's, a GPU's from the table, or this CPU's measured now
    (cpu_peak_flops: the actor's own GEMM in its dtype, on one worker's share of the cores)."""
    if cfg.trainer.device_peak_flops:
        return float(cfg.trainer.device_peak_flops), "config"
    import torch

    from hybridflow.trainer.metrics import known_peak_flops

    if torch.cuda.is_available():  # which peak was used is logged at start
        return known_peak_flops(torch.cuda.get_device_name()) or (989e12, "unknown GPU, H100 dense bf16 assumed")
    from hybridflow.precision import resolve
    from megatron_workers.hf_io import CheckpointError, read_hf_config

    a, d = cfg.actor_rollout_ref, cfg.data
    try:
        hf_config = read_hf_config(a.model.path)
    except CheckpointError:  # preflight has checked a real job's path; this is a driver over stand-in workers
        hf_config = None
    return cpu_peak_flops(hf_config, a.actor.megatron.tensor_model_parallel_size,
                          a.actor.ppo_micro_batch_size_per_gpu or 1, d.max_prompt_length + d.max_response_length,
                          resolve(a.model.dtype, "cpu"), cfg.trainer.n_gpus_per_node)
