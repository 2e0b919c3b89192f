"""Activation recompute (override_transformer_config), TP2 on a 4-layer Llama, one torchrun launch.

For full/uniform, full/block and selective: the loss and every gradient equal the run without recompute
(<= 1e-6 relative), and autograd keeps fewer activation bytes for backward (counted with
torch.autograd.graph.saved_tensors_hooks; parameters not counted). The numbers are printed (pytest -s).
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
    off, on = results["off"], results[setting]
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
