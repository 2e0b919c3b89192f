"""The one place that turns a `model.dtype` key into a dtype, for every role and the rollout.

`auto` follows the hardware, the way our GPU users already run: bf16 on CUDA, and bf16 on a CPU whose
instruction set multiplies bf16 natively (`amx_bf16` or `avx512_bf16` in /proc/cpuinfo); fp32 elsewhere.
On such a CPU torch's bf16 matmul is 2-9x its fp32 one (measured: AMD EPYC with avx512_bf16 2.8x at the 17.8M
model's MLP shape on 2 threads, launch/bench_vs_trl.py's `bound`; a Xeon with AMX 8.6x at n=1024, FACTS.md), and
CI then runs the GPU's precision path: bf16 params,
fp32 main params and Adam state in the distributed optimizer, gradients reduced in fp32, log-probs and
losses in fp32 from bf16 logits.

A CPU without those flags emulates bf16 through fp32 and is slower in bf16 than in fp32, so an explicit
bf16 there is refused unless `trainer.force_slow_bf16` is set (preflight measures the slowdown and warns).

Pure and cheap: no torch import at module level (the driver's config checks call it before Ray).
"""

from __future__ import annotations

import functools
import os

# Every spelling accepted in a `*.model.dtype` key, to its canonical name.
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}
CHOICES = ("auto", *DTYPES)
# cpuinfo flags with native bf16 dot products, best first. AVX512_BF16 has VDPBF16PS; AMX has tile matmuls.
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
# HYBRIDFLOW_CPU_BF16=0 makes `auto` pick fp32 on any CPU (=1: bf16 even without the flags).
ENV_OVERRIDE = "HYBRIDFLOW_CPU_BF16"


class PrecisionError(ValueError):
    """A dtype key this machine or this code cannot run; the message names the key."""


def canonical(name: str, key: str = "model.dtype") -> str:
    """'bf16' -> 'bfloat16', 'auto' stays 'auto'; anything else raises naming `key`."""
    if name == "auto":
        return name
    if name not in DTYPES:
        raise PrecisionError(f"{key}={name!r} is not one of {list(CHOICES)}")
    return DTYPES[name]


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first processor's flags ('' on systems without /proc/cpuinfo)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def _machine_flags() -> frozenset[str]:
    return cpu_flags()


def cpu_bf16_flag(flags: frozenset[str] | None = None) -> str | None:
    """The cpuinfo flag that gives this CPU native bf16 math, or None. `flags` for tests; else this machine's,
    with $HYBRIDFLOW_CPU_BF16 (0/1) overriding the detection."""
    if flags is None:
        env = os.environ.get(ENV_OVERRIDE, "").strip()
        if env in ("0", "1"):
            return f"{ENV_OVERRIDE}={env}" if env == "1" else None
        flags = _machine_flags()
    return next((f for f in BF16_CPU_FLAGS if f in flags), None)


def resolve(name: str, device: str, key: str = "model.dtype", bf16_flag: str | None | bool = True) -> str:
    """The canonical dtype that `name` means on `device` ('cpu' or 'cuda').

    bf16_flag: the CPU's bf16 flag (cpu_bf16_flag()); True (default) detects it here.
    """
    name = canonical(name, key)
    if name != "auto":
        return name
    if device == "cuda":
        return "bfloat16"
    flag = cpu_bf16_flag() if bf16_flag is True else bf16_flag
    return "bfloat16" if flag else "float32"


def why(name: str, device: str, bf16_flag: str | None | bool = True) -> str:
    """One line for the logs: what `auto` chose and why (or that the dtype was set)."""
    if canonical(name) != "auto":
        return f"{canonical(name)} (set)"
    flag = cpu_bf16_flag() if bf16_flag is True else bf16_flag
    if device == "cuda":
        return "bfloat16 (auto: CUDA)"
    return f"bfloat16 (auto: CPU has {flag})" if flag else "float32 (auto: this CPU has no native bf16)"


def torch_dtype(name: str):
    """Canonical (or accepted) name -> torch dtype; 'auto' must be resolved first."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[canonical(name)]


def local_device() -> str:
    """This process's device kind ('cuda' or 'cpu'); the workers' too (hybridflow.controller.worker.detect_device)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_local(name: str, key: str = "model.dtype"):
    """`name` resolved for this process's device, as a torch dtype: what a worker builds its model in."""
    return torch_dtype(resolve(name, local_device(), key))


def check_roles(roles: dict[str, tuple[str, bool]], device: str, bf16_flag: str | None | bool = True,
                force_slow_bf16: bool = False) -> dict[str, str]:
    """Resolve every role's dtype for `device` and refuse what this code or this machine cannot run.

    roles: {'<role>.model.dtype' key: (value, trained)}; trained roles (actor, critic) run an optimizer.
    Returns {key: resolved dtype}. Raises PrecisionError naming the key for:
    - fp16 on CPU (no GPU user's path, and bf16 is the CPU's half precision);
    - fp16 for a trained role: megatron's fp16 path needs a loss scaler, which our optimizer does not build
      (an inference-only reward model in fp16 on GPU is fine, its scores are read in fp32);
    - bf16 asked for explicitly on a CPU without native bf16, unless force_slow_bf16.
    """
    flag = cpu_bf16_flag() if bf16_flag is True else bf16_flag
    out = {}
    for key, (name, trained) in roles.items():
        dtype = resolve(name, device, key, bf16_flag=flag)
        if dtype == "float16" and device != "cuda":
            raise PrecisionError(f"{key}={name}: fp16 is not supported on CPU; use bfloat16 (or auto)")
        if dtype == "float16" and trained:
            raise PrecisionError(f"{key}={name}: training in fp16 needs a loss scaler, which this optimizer does not "
                                 "build; use bfloat16 (auto does on GPU)")
        if dtype == "bfloat16" and device != "cuda" and not flag and not force_slow_bf16:
            raise PrecisionError(f"{key}={name}: this CPU has no native bf16 ({' or '.join(BF16_CPU_FLAGS)} not in "
                                 "/proc/cpuinfo), so bf16 runs emulated and slower than fp32; use float32 or auto, "
                                 "or set trainer.force_slow_bf16=true to run it anyway")
        out[key] = dtype
    return out


def measured_bf16_slowdown(n: int = 256, reps: int = 5) -> float:
    """fp32 time / bf16 time of one n x n matmul on this CPU, measured now (< 0.1 s): < 1 means bf16 is slower."""
    import time

    import torch

    times = {}
    for dt in (torch.float32, torch.bfloat16):
        a = torch.randn(n, n).to(dt)
        a @ a  # warm-up: oneDNN picks its kernel on the first call
        t = time.perf_counter()
        for _ in range(reps):
            a @ a
        times[dt] = time.perf_counter() - t
    return times[torch.float32] / times[torch.bfloat16]
