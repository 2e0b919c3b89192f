"""Offload on CPU: a logged no-op by default; with force=True the buffer mechanics run and change nothing.

The forced run frees the DDP param/grad buffers (storage size 0) between calls and restores them,
for the distributed optimizer and the plain one, and moves the forward-only reference model's
parameters; training and log-probs stay bit-identical to workers that never offload.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "mcore_scripts"))
from train_common import run_torchrun  # noqa: E402


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    from hybridflow.models.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("offload")
    model = save_tiny_model(root / "llama", preset="tiny", arch="llama")
    out = root / "offload.pt"
    run_torchrun("train_offload.py", 1, ["--model", str(model), "--out", str(out)])
    return torch.load(out)


@pytest.mark.slow
@pytest.mark.parametrize("suffix", ["", "_no_distopt"])
def test_forced_offload_frees_buffers_and_changes_nothing(result, suffix):
    plain, off = f"plain{suffix}", f"offload{suffix}"
    # while offloaded: every DDP buffer's storage is freed; the untouched worker keeps its buffers
    assert all(size == 0 for sizes in result[f"{off}_offloaded_sizes"].values() for size in sizes)
    assert result[f"{off}_offloaded_sizes"]["grad"], "expected at least one grad buffer"
    assert all(size > 0 for sizes in result[f"{plain}_offloaded_sizes"].values() for size in sizes)
    # restored to the same sizes
    assert result[f"{off}_sizes"] == result[f"{plain}_sizes"]
    # training through offload/reload cycles is bit-identical
    drop = lambda m: {k: v for k, v in m.items() if "/perf/" not in k}  # the update's own timings and peak memory vary
    assert drop(result[f"{off}_metrics2"]) == drop(result[f"{plain}_metrics2"])
    assert all(torch.equal(a, b) for a, b in zip(result[f"{plain}_params"], result[f"{off}_params"]))
    assert torch.equal(result[f"{plain}_lp"], result[f"{off}_lp"])
    assert torch.equal(result[f"{plain}_ref_lp"], result[f"{off}_ref_lp"])


def test_offload_without_cuda_is_a_noop(caplog):
    from types import SimpleNamespace

    from megatron_workers.offload import Offloader

    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    layer = torch.nn.Linear(2, 2)
    before = layer.weight.detach().clone()
    engine = SimpleNamespace(model=[layer], optimizer=None)
    with caplog.at_level("INFO", logger="megatron_workers.offload"):
        off = Offloader(engine, params=True, grads=True, optimizer=True)
    assert not off.enabled and "already in host memory" in caplog.text
    with off.resident():
        off.offload()
    assert not off.offloaded and torch.equal(layer.weight, before)
