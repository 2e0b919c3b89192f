"""Activation recompute (override_transformer_config), TP2 on a 4-layer Llama, one torchrun launch.

For full/uniform, full/block and selective (the last on the unfused attention it is made for): the
loss and every gradient equal the run without recompute (<= 1e-6 relative), and autograd keeps fewer
activation bytes for backward (counted with torch.autograd.graph.saved_tensors_hooks; parameters not
counted). The numbers are printed (pytest -s).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "mcore_scripts"))
from train_common import run_torchrun  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from hybridflow.models.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("recompute")
    model = save_tiny_model(root / "llama4", preset="tiny4l", arch="llama")
    run_torchrun("recompute_grads.py", 2, ["--model", str(model), "--out", str(root / "r.pt"), "--tp", "2"],
                 timeout=240)
    return torch.load(root / "r.pt")


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["full_uniform", "full_block", "selective"])
def test_recompute_same_loss_and_grads_fewer_saved_bytes(results, setting):
    # selective recomputes the unfused core attention: compared with that attention without recompute
    off, on = results["off_unfused" if setting == "selective" else "off"], results[setting]
    print(f"\n{setting}: saved for backward {on['saved_bytes']} bytes vs {off['saved_bytes']} without recompute "
          f"({on['saved_bytes'] / off['saved_bytes']:.3f}x)")
    assert on["loss"] == pytest.approx(off["loss"], rel=1e-6)
    assert set(on["grads"]) == set(off["grads"])
    for name, g in off["grads"].items():
        assert g.abs().max() > 0, name  # every parameter got a gradient, so the comparison means something
        err = (on["grads"][name] - g).norm() / g.norm()
        assert err <= 1e-6, (setting, name, float(err))
    assert on["saved_bytes"] < off["saved_bytes"]
    if setting == "full_uniform":  # one layer per checkpoint, all 4 layers: only the layer inputs stay
        assert on["saved_bytes"] < 0.25 * off["saved_bytes"]


@pytest.mark.slow
def test_fused_sdpa_attention_same_loss_and_grads_as_unfused_and_keeps_less(results):
    """The default core attention (torch SDPA) against megatron's unfused one, whole 4-layer TP2 model."""
    fused, unfused = results["off"], results["off_unfused"]
    print(f"\nsaved for backward: fused {fused['saved_bytes']} bytes, unfused {unfused['saved_bytes']}")
    assert fused["loss"] == pytest.approx(unfused["loss"], rel=1e-6)
    for name, g in unfused["grads"].items():
        err = (fused["grads"][name] - g).norm() / g.norm()
        assert err <= 1e-5, (name, float(err))
    assert fused["saved_bytes"] < unfused["saved_bytes"]  # no s x s scores or probabilities kept
