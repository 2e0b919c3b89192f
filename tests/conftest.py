"""Shared fixtures: one local Ray cluster for the whole session, tiny models created once."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """A real local Ray cluster shared by every test that needs one (starting one costs 7-16 s)."""
    import ray

    from hybridflow.controller import init_ray

    # Ray workers import test helper modules (tests/ray_workers.py) by name.
    pythonpath = os.pathsep.join([str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")])
    os.environ["PYTHONPATH"] = pythonpath
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    init_ray(num_cpus=16, object_store_memory=1024**3, run_dir=tmp_path_factory.mktemp("ray_run"),
             env_vars={"PYTHONPATH": pythonpath})
    yield ray
    ray.shutdown()
