"""Run in a fresh process by tests/test_mcore_cpu_compat.py: what apply_cpu_compat changes, and what it leaves alone.

argv[1] == "cuda" pretends CUDA is available. Prints one JSON object.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

if sys.argv[1:] == ["cuda"]:
    torch.cuda.is_available = lambda: True

from megatron.core.models.common.embeddings import rotary_pos_embedding  # noqa: E402
from megatron.core.optimizer import clip_grads  # noqa: E402
from megatron.core.transformer.torch_norm import WrappedTorchNorm  # noqa: E402

from megatron_workers import cpu_compat  # noqa: E402

first = list(cpu_compat.apply_cpu_compat())
second = list(cpu_compat.apply_cpu_compat())
view = rotary_pos_embedding.torch
out = {"first": first, "second": second, "rotary_torch_is_real": view is torch}
if view is not torch:
    out["view_zeros_device"] = str(view.zeros(2, device="cuda").device)
    out["view_current_device"] = view.cuda.current_device()
    out["view_tensor_is_real"] = view.Tensor is torch.Tensor
    try:
        torch.cuda.current_device()
        out["global_current_device"] = "no error"
    except (AssertionError, RuntimeError) as e:  # the real torch still has no CUDA
        out["global_current_device"] = type(e).__name__
    grad_param = torch.nn.Parameter(torch.ones(3))
    grad_param.grad = torch.full((3,), 2.0)
    clip_grads.clip_grad_by_total_norm_fp32([grad_param], max_norm=1.0, total_norm=4.0)
    out["clipped_grad"] = grad_param.grad.tolist()
    out["type_after"] = grad_param.type()
cfg = types.SimpleNamespace(layernorm_zero_centered_gamma=False, persist_layer_norm=False, sequence_parallel=True,
                            memory_efficient_layer_norm=False, normalization="RMSNorm")
norm = WrappedTorchNorm(cfg, 8, eps=1e-5)
out["sp_norm"] = [type(norm).__name__, getattr(norm.weight, "sequence_parallel", None), cfg.sequence_parallel]
print(json.dumps(out))
