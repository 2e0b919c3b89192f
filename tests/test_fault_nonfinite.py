"""Non-finite updates, on the real Megatron engine (2 DP ranks, gloo, fp32): skipped and counted, then fatal.

Megatron's optimizer skips a step on found_inf only with fp16's grad scaler; with fp32 (as here) or bf16 it
would clip by a NaN norm and step, turning every weight NaN. megatron_workers/nonfinite.py checks first.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "mcore_scripts"))
from train_common import run_torchrun  # noqa: E402


@pytest.mark.fault
@pytest.mark.slow
def test_nonfinite_update_is_skipped_counted_and_fatal_after_k_in_a_row(tmp_path, monkeypatch):
    from hybridflow.models.tiny import save_tiny_model

    model = save_tiny_model(tmp_path / "llama", preset="tiny", arch="llama")
    out = tmp_path / "nonfinite.pt"
    monkeypatch.setenv("HYBRIDFLOW_MAX_NONFINITE", "3")
    t = time.perf_counter()
    run_torchrun("train_nonfinite.py", 2, ["--model", str(model), "--out", str(out)], timeout=300)
    print(f"\nnon-finite engine test: {time.perf_counter() - t:.1f} s (2 ranks)")
    r = torch.load(out, weights_only=True)
    # Rank 1's NaN loss stopped rank 0 as well: nothing moved, and the LR schedule did not advance.
    assert r["skipped"]["actor/nonfinite_skipped"] == 1.0
    assert r["unchanged"] and r["lr_steps_after_skip"] == 0
    assert r["trained"]["actor/nonfinite_skipped"] == 0.0 and r["changed"] and r["finite"]
    # Three in a row (steps 3, 4, 5) abort with the stage, the rank and the offending tensor's stats.
    assert r["error_step"] == 5, r["error"]
    for part in ("3 updates in a row", "trainer.fault.max_nonfinite=3", "update_actor rank 0", "loss = nan",
                 "grad of ", " NaN, "):
        assert part in r["error"], (part, r["error"])
