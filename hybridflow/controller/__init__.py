"""The single controller: worker groups on Ray, dispatch modes, resource pools."""

from hybridflow.controller.decorator import Dispatch, Execute, register
from hybridflow.controller.dispatch import MeshCoords, register_dispatch_mode
from hybridflow.controller.errors import WorkerDiedError, WorkerError, WorkerTimeoutError
from hybridflow.controller.ray_env import init_ray
from hybridflow.controller.resource_pool import ResourcePool
from hybridflow.controller.worker import Worker
from hybridflow.controller.worker_group import RayWorkerGroup

__all__ = [
    "Dispatch", "Execute", "register", "MeshCoords", "register_dispatch_mode", "WorkerDiedError", "WorkerError",
    "WorkerTimeoutError", "init_ray", "ResourcePool", "Worker", "RayWorkerGroup",
]
