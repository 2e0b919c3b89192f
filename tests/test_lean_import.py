"""megatron_workers/lean_import.py: the first `import megatron.core` skips torch._dynamo and wandb, and nothing
megatron computes changes (the parity tests, e.g. test_mcore_parity.py, run through the same import)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_workers.lean_import import ENV, deferred_compile, lean

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import json, sys
import megatron_workers
import megatron.core
from megatron.core.fusions import fused_bias_geglu
import torch
out = {"dynamo_at_import": "torch._dynamo" in sys.modules, "wandb_at_import": "wandb" in sys.modules,
       "geglu_deferred": getattr(fused_bias_geglu.geglu, "deferred_compile", False),
       "compile_restored": torch.compile.__module__ == "torch"}
import importlib.resources  # the wrapped loader still answers for the package's files
out["package_files"] = any(p.name == "__init__.py" for p in importlib.resources.files("megatron.core").iterdir())
import wandb  # our tracking's import still gets the real package
out["wandb_after"] = wandb.__name__
print(json.dumps(out))
"""


def _probe(**env) -> dict:
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", PROBE], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_first_megatron_import_skips_dynamo_and_wandb_then_both_work():
    pytest.importorskip("wandb")
    assert _probe() == {"dynamo_at_import": False, "wandb_at_import": False, "geglu_deferred": True,
                        "compile_restored": True, "package_files": True, "wandb_after": "wandb"}


def test_switched_off_the_import_is_megatrons_own():
    """The yardstick for the test above: without the hook megatron's import pulls in dynamo and wandb."""
    pytest.importorskip("wandb")
    got = _probe(**{ENV: "0"})
    assert got["dynamo_at_import"] and got["wandb_at_import"] and not got["geglu_deferred"], got


def test_deferred_compile_compiles_once_at_the_first_call_with_the_same_options():
    calls = []

    def real(model, **options):
        calls.append(options)
        return torch.compile(model, **options)

    def f(x):
        return torch.tanh(x) * 2

    stand_in = deferred_compile(real)
    g = stand_in(backend="eager")(f)  # decorator form with options, as megatron's @jit_fuser(...) would be
    h = stand_in(f, backend="eager", dynamic=False)
    assert calls == [] and g.__name__ == "f"  # nothing compiled at decoration
    x = torch.linspace(-2, 2, 7)
    assert torch.equal(g(x), f(x)) and torch.equal(g(x + 1), f(x + 1))
    assert torch.equal(h(x), f(x))
    assert calls == [{"backend": "eager"}, {"backend": "eager", "dynamic": False}]


def test_lean_restores_compile_and_wandb_even_when_the_import_fails():
    real = torch.compile
    had, entry = "wandb" in sys.modules, sys.modules.get("wandb")
    with pytest.raises(RuntimeError, match="boom"), lean():
        assert torch.compile is not real
        raise RuntimeError("boom")
    assert torch.compile is real
    assert ("wandb" in sys.modules) == had and sys.modules.get("wandb") is entry
