"""The layer contracts (.importlinter, run by `make lint`) hold, and break when an import crosses a layer: checked on
a copy of the three packages with one import added, as a contributor's change would add it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")
PACKAGES = ("hybridflow", "megatron_workers", "launch")


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT), "--no-cache", "--no-logo", "--config", str(root / ".importlinter")], cwd=root,
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def tree(tmp_path):
    for name in PACKAGES:
        shutil.copytree(REPO / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(REPO / ".importlinter", tmp_path / ".importlinter")
    return tmp_path


def test_the_contracts_hold_on_this_tree():
    result = _lint(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize("module, line, imported, contracts", [
    ("hybridflow/algorithms/masked.py", "import megatron_workers.hf_io", "megatron_workers.hf_io",
     ["The pure core", "The controller side"]),
    ("hybridflow/algorithms/masked.py", "from hybridflow.config import schema", "hybridflow.config.schema",
     ["The pure core"]),
    ("hybridflow/config/load.py", "import vllm", "vllm",
     ["Config and its checks import no training or rollout engine", "The controller side"]),
    ("hybridflow/trainer/metrics.py", "import megatron_workers.hf_io", "megatron_workers.hf_io",
     ["The controller side"]),
    ("megatron_workers/engine.py", "import hybridflow.trainer.metrics", "hybridflow.trainer.metrics",
     ["The SPMD side"]),
    ("hybridflow/trainer/metrics.py", "import launch.plan", "launch.plan", ["launch/ is how jobs start"]),
    ("launch/plan/memory.py", "import launch.plan.report", "launch.plan.report", ["No import cycles"]),
    ("hybridflow/config/verl_compat.py", "from hybridflow.config import load", "hybridflow.config.load",
     ["No import cycles"]),
])
def test_an_import_across_a_layer_breaks_its_contract(tree, module, line, imported, contracts):
    path = tree / module
    # inside a function, where an import is easiest to overlook: grimp reads it all the same
    path.write_text(path.read_text() + f"\n\ndef _added_by_the_test():\n    {line}\n")
    result = _lint(tree)
    assert result.returncode == 1, result.stdout
    assert f"{len(contracts)} broken" in result.stdout
    report = result.stdout.split("Broken contracts", 1)[1]
    headers = [ln for ln in report.splitlines() if ln and not ln.startswith(("-", " ", "hybridflow", "megatron"))]
    for contract in contracts:
        assert any(h.startswith(contract) for h in headers), (contract, headers)
    source = module.removesuffix(".py").replace("/", ".")
    relative = f".{source.rsplit('.', 1)[-1]} -> .{imported.rsplit('.', 1)[-1]}"  # how a cycle is reported
    assert f"{source} -> {imported}" in report or relative in report, report
