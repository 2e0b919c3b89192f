"""SDPADotProductAttention (megatron_workers/sdpa_attention.py) against megatron's own DotProductAttention.

The models built here use it through the local layer spec, so the HF-logit parity tests (test_mcore_parity)
cover it end to end; this checks the module alone: outputs and q/k/v gradients equal megatron's unfused
attention for plain and grouped-query heads, and a case it must not take (an explicit mask) goes to
megatron's forward instead of being computed as plain causal attention.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.ports import free_port

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


@pytest.fixture(scope="module")
def cases() -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(TESTS / "mcore_scripts" / "sdpa_check.py"), str(free_port())],
                          capture_output=True, text=True, timeout=180, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["mha", "gqa"])
def test_sdpa_attention_equals_megatrons_unfused_attention(cases, name):
    c = cases[name]
    assert c["used_sdpa"], "the causal, unmasked case must take the fused path"
    assert c["shape"] == c["ref_shape"]
    assert c["scale"] > 0.5  # a real signal, not zeros
    for key in ("out", "dq", "dk", "dv"):
        assert c[key] < 1e-5, (name, key, c[key])


def test_an_explicit_mask_goes_to_megatrons_own_forward(cases):
    c = cases["explicit_mask"]
    assert not c["used_sdpa"]
    assert c["out"] == 0.0 and c["dq"] == 0.0
