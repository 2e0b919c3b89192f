"""A worker group spanning a simulated 2-node Ray cluster on loopback forms one gloo group."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "launch"))
import sim_cluster  # noqa: E402


@pytest.mark.cluster
@pytest.mark.slow
def test_group_spans_two_nodes():
    from hybridflow.controller.worker import free_port

    port = free_port()
    with sim_cluster.SimCluster(2, port, cpus_per_node=2, object_store_bytes=256 * 1024**2) as cluster:
        env = dict(cluster.env, PYTHONPATH=os.pathsep.join([str(REPO / "tests"), str(REPO / "launch"), str(REPO)]))
        env.pop("RAY_ADDRESS", None)
        proc = subprocess.run([sys.executable, str(REPO / "tests" / "multinode_script.py"), cluster.address],
                              env=env, capture_output=True, text=True, timeout=300)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, f"driver failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    res = json.loads(line[0][len("RESULT "):])
    assert res["all_reduce"] == [10.0] * 4  # 1+2+3+4 across both nodes
    n0, n1 = res["nodes"]["node0"], res["nodes"]["node1"]
    assert n0 != n1
    assert res["actor_nodes"] == [n0, n0, n1, n1]
