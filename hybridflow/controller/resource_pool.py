"""Resource pools: Ray placement groups with one bundle per worker process.

A pool is one or several nodes. Worker groups created on the same pool are
colocated (they share bundles, each taking a fraction); a pool per role is the
split placement. On CPU, processes get fractional CPUs; a node can be pinned
through a custom resource (e.g. "node0" on a simulated loopback cluster).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Slot:
    pg: object
    bundle_index: int
    node_index: int
    local_rank: int


@dataclass
class ResourcePool:
    name: str
    procs_per_node: list[int]
    use_gpu: bool | None = None  # None: GPUs when this driver's cluster has any
    cpus_per_proc: float = 0.5
    max_colocate: int = 3  # how many worker groups may share one bundle
    node_resources: list[str] | None = None  # custom resource per node to pin that node
    timeout_s: float = 300.0
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
        import ray
        from ray.util.placement_group import placement_group

        if self.node_resources is not None and len(self.node_resources) != len(self.procs_per_node):
            raise ValueError(f"pool '{self.name}': node_resources has {len(self.node_resources)} entries "
                             f"for {len(self.procs_per_node)} nodes")
        if not self._pgs:
            for i, n in enumerate(self.procs_per_node):
                self._pgs.append(placement_group([self.bundle(i)] * n, strategy="STRICT_PACK",
                                                 name=f"hybridflow_{self.name}_{i}_{time.time_ns()}"))
            ready = [pg.ready() for pg in self._pgs]
            done, pending = ray.wait(ready, num_returns=len(ready), timeout=self.timeout_s)
            if pending:
                missing = [i for i, r in enumerate(ready) if r in pending]
                raise TimeoutError(
                    f"pool '{self.name}': nodes {missing} could not get bundles {self.bundle(missing[0])} "
                    f"within {self.timeout_s:.0f} s; cluster resources: {ray.cluster_resources()}"
                )
        return [Slot(pg, b, i, b) for i, (pg, n) in enumerate(zip(self._pgs, self.procs_per_node, strict=True))
                for b in range(n)]

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for pg in self._pgs:
            remove_placement_group(pg)
        self._pgs.clear()
