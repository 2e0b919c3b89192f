"""A driver for tests/test_launch_cluster.py: one Ray task pinned to each alive node reports where it ran.

    RAY_ADDRESS=HOST:PORT python tests/launch_cluster_driver.py [--exit-code N]

Prints `RESULT {"tasks": [[node_id, node_ip], ...], "pids": [[pid, create_time], ...]}`; the pids are every
process of the nodes that launch.cluster started on this host (from its pid files), so that the test can check
that all of them are gone after teardown.
"""

import argparse
import json
import os

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from launch.cluster import node


@ray.remote(num_cpus=1)
def where():
    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--exit-code", type=int, default=0)
    a = ap.parse_args()
    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    alive = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    refs = [where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False)).remote()
            for nid in alive]
    tasks = ray.get(refs, timeout=120)
    ray.shutdown()
    pids = [[p.pid, p.create_time()] for rec in node.read_records(node.state_dir())
            for p in node.node_processes(rec)]
    print("RESULT " + json.dumps({"targets": alive, "tasks": tasks, "pids": pids}), flush=True)
    return a.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
