"""dist_checkpointing save at TP2xPP2 (+SP, distributed optimizer) and resume at TP2xPP2 and at TP1xPP2.

- Loaded weights equal the saved ones bit for bit, at either layout.
- Resuming at the same layout continues bit-exactly: the next update's metrics and parameters
  equal the uninterrupted run's.
- Resuming at TP1xPP2 continues within 1e-6 (TP changes only the reduction order), with the
  LR schedule and the caller's extra state (step, dataloader position) restored.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "mcore_scripts"))
from train_common import run_torchrun  # noqa: E402

from megatron_workers.optimizer import LRSchedule  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from hybridflow.models.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("ckpt")
    model = save_tiny_model(root / "llama", preset="tiny", arch="llama")
    ckpt, saved, resumed = root / "ckpt", root / "save.pt", root / "resume.pt"
    common = ["--model", str(model), "--ckpt", str(ckpt)]
    save = [*common, "--out", str(saved), "--phase", "save", "--tp", "2", "--pp", "2", "--sp"]
    run_torchrun("train_ckpt.py", 4, save, timeout=240)
    run_torchrun("train_ckpt.py", 2, [*common, "--out", str(resumed), "--phase", "resume", "--tp", "1", "--pp", "2"])
    return torch.load(saved), torch.load(resumed), ckpt


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.slow
def test_checkpoint_reloads_bit_exact_at_both_layouts(runs):
    saved, resumed, ckpt = runs
    assert json.loads((ckpt / "hybridflow_layout.json").read_text())["tp"] == 2
    expected_extra = {"step": 2, "dataloader": {"epoch": 0, "index": 16}}
    assert saved["extra"] == expected_extra and resumed["extra"] == expected_extra
    assert _max_diff(saved["saved"], saved["reloaded"]) == 0.0
    assert _max_diff(saved["saved"], resumed["reloaded"]) == 0.0
    # the update after the save really moved the weights, so the comparisons below mean something
    assert _max_diff(saved["saved"], saved["step3_params"]) > 1e-4


def _measured_out(metrics: dict) -> dict:
    """The update's metrics without the worker's own timings and peak memory (actor/perf/*), which vary."""
    return {k: v for k, v in metrics.items() if "/perf/" not in k}


@pytest.mark.slow
def test_same_layout_resume_continues_bit_exact(runs):
    saved, _, _ = runs
    assert _measured_out(saved["step3_again"]) == _measured_out(saved["step3"])
    assert _max_diff(saved["step3_params"], saved["step3_again_params"]) == 0.0


@pytest.mark.slow
def test_tp1_pp2_resume_continues(runs):
    saved, resumed, _ = runs
    # the schedule resumed at update index 2 (cosine after one warmup step over 6 steps)
    lr = LRSchedule(2e-3, "cosine", warmup_steps=1, total_steps=6, min_lr_ratio=0.1).lr_at(2)
    assert resumed["step3"]["actor/lr"] == saved["step3"]["actor/lr"] == pytest.approx(lr, rel=1e-12)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss"):
        assert resumed["step3"][key] == pytest.approx(saved["step3"][key], rel=1e-6), key
    assert _max_diff(saved["step3_params"], resumed["step3_params"]) < 1e-6
