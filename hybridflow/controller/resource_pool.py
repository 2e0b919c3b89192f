"""Resource pools: Ray placement groups with one bundle per worker process.

A pool is one or several nodes. Worker groups created on the same pool are
colocated (they share bundles, each taking a fraction); which roles share a pool is
hybridflow/trainer/placement.py's (trainer.placement presets or trainer.resource_pools).
On CPU, processes get fractional CPUs; a node can be pinned
through a custom resource (e.g. "node0" on a simulated loopback cluster).
Without one, each node's bundle set is kept off the nodes the pool already holds
(a label selector on Ray's node id), so an N-node pool lands on N distinct nodes.

A pool can instead take bundles that someone else reserved (`Reserved`: a Ray Tune trial's placement group,
launch/sweep): Ray has no nested placement groups, so one created inside a trial would draw on the
cluster's free resources, outside the trial's (measured on Ray 2.60), and Tune's accounting would be wrong.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

_NODE_ID_LABEL = "ray.io/node-id"  # the label Ray puts on every node


def _node_of(pg) -> str:
    """The node a ready STRICT_PACK placement group's bundles are on."""
    from ray.util import placement_group_table

    return placement_group_table(pg)["bundles_to_node_id"][0]


@dataclass
class Slot:
    pg: object
    bundle_index: int
    node_index: int
    local_rank: int


@dataclass(frozen=True)
class Reserved:
    """Bundles first..first+world_size-1 of a placement group the pool does not own (nor remove), all on one node."""
    pg: object
    first: int


@dataclass
class ResourcePool:
    name: str
    procs_per_node: list[int]
    use_gpu: bool | None = None  # None: GPUs when this driver's cluster has any
    cpus_per_proc: float = 0.5
    max_colocate: int = 3  # how many worker groups may share one bundle
    node_resources: list[str] | None = None  # custom resource per node to pin that node
    timeout_s: float = 300.0
    reserved: Reserved | None = None  # use these bundles instead of making placement groups
    _pgs: list = field(default_factory=list, repr=False)

    @property
    def world_size(self) -> int:
        return sum(self.procs_per_node)

    def gpu(self) -> bool:
        if self.use_gpu is None:
            import ray

            self.use_gpu = ray.cluster_resources().get("GPU", 0) > 0
        return self.use_gpu

    def bundle(self, node_index: int) -> dict:
        b = {"CPU": self.cpus_per_proc * self.max_colocate}
        if self.gpu():
            b["GPU"] = 1.0
        if self.node_resources:
            b[self.node_resources[node_index]] = 0.001
        return b

    def actor_resources(self) -> dict:
        """What one worker of one group takes from its bundle."""
        res = {"num_cpus": self.cpus_per_proc}
        if self.gpu():
            res["num_gpus"] = 1.0 / self.max_colocate
        return res

    def slots(self) -> list[Slot]:
        """Create the placement groups once (with a timeout) and list the slots in rank order."""
        if self.reserved is not None:
            if len(self.procs_per_node) != 1:
                raise ValueError(f"pool '{self.name}': reserved bundles are on one node; the pool spans "
                                 f"{len(self.procs_per_node)}")
            return [Slot(self.reserved.pg, self.reserved.first + b, 0, b) for b in range(self.world_size)]
        if self.node_resources is not None and len(self.node_resources) != len(self.procs_per_node):
            raise ValueError(f"pool '{self.name}': node_resources has {len(self.node_resources)} entries "
                             f"for {len(self.procs_per_node)} nodes")
        if not self._pgs:
            spread = self.node_resources is None and len(self.procs_per_node) > 1
            deadline = time.monotonic() + self.timeout_s
            if not spread:  # pinned by custom resources (or one node): Ray may place them all at once
                self._pgs = [self._create(i, n) for i, n in enumerate(self.procs_per_node)]
                self._wait_ready(self._pgs, list(range(len(self._pgs))), deadline)
            else:  # one node at a time, each kept off the nodes already taken
                taken: list[str] = []
                for i, n in enumerate(self.procs_per_node):
                    pg = self._create(i, n, avoid=taken)
                    self._pgs.append(pg)
                    self._wait_ready([pg], [i], deadline)
                    taken.append(_node_of(pg))
        return [Slot(pg, b, i, b) for i, (pg, n) in enumerate(zip(self._pgs, self.procs_per_node, strict=True))
                for b in range(n)]

    def _create(self, i: int, n: int, avoid: list[str] = ()):
        from ray.util.placement_group import placement_group

        # STRICT_PACK: this node's ranks share one machine (local ranks, one NCCL/gloo island per node).
        selector = [{_NODE_ID_LABEL: f"!in({','.join(avoid)})"}] * n if avoid else None
        return placement_group([self.bundle(i)] * n, strategy="STRICT_PACK", bundle_label_selector=selector,
                               name=f"hybridflow_{self.name}_{i}_{time.time_ns()}")

    def _wait_ready(self, pgs: list, nodes: list[int], deadline: float) -> None:
        import ray

        ready = [pg.ready() for pg in pgs]
        _, pending = ray.wait(ready, num_returns=len(ready), timeout=max(0.0, deadline - time.monotonic()))
        if pending:
            missing = [i for i, r in zip(nodes, ready, strict=True) if r in pending]
            alive = sum(1 for node in ray.nodes() if node["Alive"])
            raise TimeoutError(
                f"pool '{self.name}': nodes {missing} could not get bundles {self.bundle(missing[0])} "
                f"within {self.timeout_s:.0f} s (the pool spans {len(self.procs_per_node)} distinct nodes, "
                f"the cluster has {alive} alive); cluster resources: {ray.cluster_resources()}"
            )

    def node_ids(self) -> list[str]:
        """The Ray node id each of the pool's nodes landed on (after slots())."""
        if self.reserved is not None:
            from ray.util import placement_group_table

            return [placement_group_table(self.reserved.pg)["bundles_to_node_id"][self.reserved.first]]
        return [_node_of(pg) for pg in self._pgs]

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for pg in self._pgs:  # never a reserved one: its owner removes it
            remove_placement_group(pg)
        self._pgs.clear()
