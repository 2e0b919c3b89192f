"""The devices and networks the planner knows: one table, the source of every number next to it.

Bandwidths are per GPU and per direction (bytes/s), which is what a point-to-point receive or a ring
collective's bus bandwidth is limited by. The dense bf16 peaks come from the trainer's MFU table
(`hybridflow.trainer.metrics.PEAK_FLOPS`), so the planner and perf/mfu/actor use the same peak.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.trainer.metrics import PEAK_FLOPS

GiB = 1024**3


class UnknownDeviceError(ValueError):
    pass


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: int  # what torch.cuda.get_device_properties().total_memory reports
    peak_flops: float  # dense bf16
    hbm_bytes_s: float
    nvlink_bytes_s: float  # per GPU, per direction
    internode_bytes_s: float  # per GPU, per direction (the node's NICs shared by its GPUs)
    pcie_bytes_s: float  # host <-> GPU, per direction (what offload moves over)
    sources: tuple[tuple[str, str], ...]  # (quantity, where it comes from)


DEVICES: dict[str, Device] = {
    "a100": Device(
        "A100-SXM4-80GB", memory_bytes=85_100_000_000, peak_flops=PEAK_FLOPS["A100"], hbm_bytes_s=2.039e12,
        nvlink_bytes_s=300e9, internode_bytes_s=25e9, pcie_bytes_s=32e9,
        sources=(("PCIe", "Gen4 x16: 32 GB/s per direction"),
                 ("memory", "80 GB HBM2e; CUDA reports ~79.2 GiB (85.1e9 B)"),
                 ("bf16 peak", "312 TFLOP/s dense, NVIDIA A100 datasheet (hybridflow.trainer.metrics.PEAK_FLOPS)"),
                 ("HBM", "2,039 GB/s, NVIDIA A100 80GB SXM datasheet"),
                 ("NVLink", "600 GB/s total per GPU (NVLink 3, datasheet) = 300 GB/s per direction"),
                 ("inter-node", "DGX A100: one 200 Gb/s HDR NIC per GPU = 25 GB/s per GPU"))),
    "h100": Device(
        "H100-SXM5-80GB", memory_bytes=85_000_000_000, peak_flops=PEAK_FLOPS["H100"], hbm_bytes_s=3.35e12,
        nvlink_bytes_s=450e9, internode_bytes_s=50e9, pcie_bytes_s=64e9,
        sources=(("PCIe", "Gen5 x16: 64 GB/s per direction"),
                 ("memory", "80 GB HBM3; CUDA reports ~79.1 GiB (85.0e9 B)"),
                 ("bf16 peak", "989 TFLOP/s dense, NVIDIA H100 SXM datasheet (hybridflow.trainer.metrics.PEAK_FLOPS)"),
                 ("HBM", "3.35 TB/s, NVIDIA H100 SXM datasheet"),
                 ("NVLink", "900 GB/s total per GPU (NVLink 4, datasheet) = 450 GB/s per direction"),
                 ("inter-node", "DGX H100: one 400 Gb/s NDR NIC per GPU = 50 GB/s per GPU"))),
    "h200": Device(
        "H200-SXM-141GB", memory_bytes=150_000_000_000, peak_flops=PEAK_FLOPS["H200"], hbm_bytes_s=4.8e12,
        nvlink_bytes_s=450e9, internode_bytes_s=50e9, pcie_bytes_s=64e9,
        sources=(("PCIe", "Gen5 x16: 64 GB/s per direction"),
                 ("memory", "141 GB HBM3e; CUDA reports ~139.7 GiB (FACTS.md: about 139 GiB on the lent H200)"),
                 ("bf16 peak", "989 TFLOP/s dense, NVIDIA H200 datasheet (hybridflow.trainer.metrics.PEAK_FLOPS)"),
                 ("HBM", "4.8 TB/s, NVIDIA H200 datasheet"),
                 ("NVLink", "900 GB/s total per GPU (NVLink 4) = 450 GB/s per direction"),
                 ("inter-node", "DGX H200: one 400 Gb/s NDR NIC per GPU = 50 GB/s per GPU"))),
}


def device_key(cuda_name: str) -> str:
    """The DEVICES key of a GPU as torch.cuda.get_device_name() names it ("NVIDIA H200" -> "h200")."""
    for key in DEVICES:
        if key.upper() in cuda_name.upper():
            return key
    raise UnknownDeviceError(f"device {cuda_name!r} is none the planner knows; known: {', '.join(DEVICES)}")


def get_device(name: str, internode_gbps_per_node: float | None = None, gpus_per_node: int = 8,
               source: str = "--gpu") -> Device:
    """The table's device; `internode_gbps_per_node` replaces its network with a node-level figure (e.g. the
    HybridFlow paper's testbed: 200 Gb/s between machines, shared by 8 GPUs). `source` is where the name came from
    (the flag or the config key), for the error."""
    key = name.lower()
    if key not in DEVICES:
        raise UnknownDeviceError(f"{source} {name!r} is not a known device; known: {', '.join(DEVICES)}")
    dev = DEVICES[key]
    if internode_gbps_per_node is None:
        return dev
    per_gpu = internode_gbps_per_node * 1e9 / 8 / gpus_per_node
    return Device(dev.name, dev.memory_bytes, dev.peak_flops, dev.hbm_bytes_s, dev.nvlink_bytes_s, per_gpu,
                  dev.pcie_bytes_s, tuple(s for s in dev.sources if s[0] != "inter-node")
                  + (("inter-node", f"{internode_gbps_per_node:g} Gb/s per node shared by {gpus_per_node} GPUs "
                                    f"= {per_gpu / 1e9:.3g} GB/s per GPU"),))
