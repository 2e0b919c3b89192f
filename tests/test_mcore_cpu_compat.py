"""cpu_compat in fresh processes: idempotent, narrow (no global torch changes), inert for CUDA when CUDA is present."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROBE = Path(__file__).resolve().parent / "mcore_scripts" / "compat_probe.py"


def _run_both() -> dict[str, dict]:
    procs = {mode: subprocess.Popen([sys.executable, str(PROBE), mode], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for mode in ("cpu", "cuda")}
    results = {}
    for mode, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        results[mode] = json.loads(out.strip().splitlines()[-1])
    return results


def test_cpu_compat_patches():
    res = _run_both()
    cpu, cuda = res["cpu"], res["cuda"]
    # idempotent: a second call installs nothing new
    assert cpu["first"] == cpu["second"] and len(set(cpu["first"])) == len(cpu["first"])
    for needed in ("cpu-device:megatron.core.models.common.embeddings.rotary_pos_embedding",
                   "cpu-device:megatron.core.pipeline_parallel.schedules", "rng:_set_cuda_rng_state",
                   "cuda_type_strings:megatron.core.optimizer.clip_grads..clip_grad_by_total_norm_fp32"):
        assert needed in cpu["first"]
    # megatron's modules see CUDA requests served on the CPU ...
    assert cpu["view_zeros_device"] == "cpu" and cpu["view_current_device"] == "cpu" and cpu["view_tensor_is_real"]
    # ... while the real torch is untouched and the scoped Tensor.type patch is gone after the call
    assert cpu["global_current_device"] == "AssertionError"
    assert cpu["type_after"] == "torch.FloatTensor"
    assert max(abs(g - 2.0 / (4.0 + 1e-6)) for g in cpu["clipped_grad"]) < 1e-6  # clipping still happens
    # the SP-capable torch norm: same module type, weights tagged, caller's config not modified
    assert cpu["sp_norm"] == ["RMSNorm", True, True]
    # with CUDA present only the device-independent fixes are installed: the SP norm, and MoE's names without TE
    # (this venv has no transformer_engine)
    assert cuda["first"] == ["sp-norm:WrappedTorchNorm", "moe-without-te:megatron.core.transformer.moe.moe_utils"]
    assert cuda["rotary_torch_is_real"]
    assert cuda["sp_norm"] == ["RMSNorm", True, True]


def test_mixed_dtype_param_all_gather_is_exact_on_gloo():
    """megatron's distributed optimizer all-gathers its param buffers inside a coalescing manager; on gloo that
    returns garbage when the buffers differ in dtype (bf16 weights, fp32 norms). With cpu_compat the buffers come
    back exact; without it they do not (torch 2.13), which is why the patch exists."""
    sys.path.insert(0, str(PROBE.parent))
    from train_common import run_torchrun

    def gather(mode: str) -> dict:
        return json.loads(run_torchrun("gloo_coalescing.py", 2, [mode], timeout=120).strip().splitlines()[-1])

    assert gather("patched")["exact"] == [True, True]
    raw = gather("raw")
    assert raw["exact"] != [True, True], f"gloo's coalesced mixed-dtype all-gather is exact now ({raw}): " \
        "the cpu_compat patch may be dropped"
