"""Driver for the simulated 2-node test: a worker group spanning both nodes forms one gloo group."""

import json
import sys

import ray
from ray_workers import EchoWorker
from sim_cluster import wait_for_nodes

from hybridflow.controller import RayWorkerGroup, ResourcePool

ray.init(address=sys.argv[1], _node_ip_address="127.0.0.2", log_to_driver=False)
wait_for_nodes(2)
pool = ResourcePool("span", [2, 2], node_resources=["node0", "node1"], cpus_per_proc=0.5, max_colocate=1,
                    timeout_s=120)
group = RayWorkerGroup(pool, EchoWorker, role="span", timeout_s=180)
group.init_dist(60.0)
nodes_by_name = {
    f"node{i}": ray.get(ray.remote(num_cpus=0)(lambda: ray.get_runtime_context().get_node_id())
                        .options(resources={f"node{i}": 0.001}).remote(), timeout=60)
    for i in range(2)
}
actor_nodes = [p["node_id"] for p in ray.get([h.ping.remote() for h in group._hosts], timeout=60)]
print("RESULT " + json.dumps({"all_reduce": group.all_reduce(1.0), "nodes": nodes_by_name,
                              "actor_nodes": actor_nodes}))
