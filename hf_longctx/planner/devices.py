"""Device profiles of `hf-longctx plan`: usable capacity and the memory no tensor formula sees."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceProfile:
    """One accelerator (or the CPU): usable capacity and the memory no tensor formula sees.

    `runtime_gib` is the fixed cost (CUDA context, NCCL communicators, cuBLAS workspaces; on CPU the
    process growth of the first step); `fragmentation` is the allocator's slack as a fraction of the
    step's activation memory. `host_is_device` marks the CPU, where offloading moves nothing.
    """

    name: str
    capacity_gib: float
    runtime_gib: float
    fragmentation: float
    host_is_device: bool = False

    def with_capacity(self, capacity_gib: float) -> DeviceProfile:
        """The same profile with another capacity (`--gpu-memory`)."""
        return DeviceProfile(self.name, capacity_gib, self.runtime_gib, self.fragmentation, self.host_is_device)


# Capacities are what nvidia-smi reports as total memory (MiB / 1024). Runtime: CUDA context (~0.5 GiB)
# plus NCCL communicator buffers and cuBLAS workspaces (~1 GiB); fragmentation: the caching
# allocator's slack over the activation working set (a few percent with expandable segments).
# The CPU runtime term is calibrated once from one measured point (docs/planner.md).
DEVICES: dict[str, DeviceProfile] = {
    "h100": DeviceProfile("h100", 81559 / 1024, 1.5, 0.05),
    "h200": DeviceProfile("h200", 143771 / 1024, 1.5, 0.05),
    "a100-80": DeviceProfile("a100-80", 81920 / 1024, 1.5, 0.05),
    "cpu": DeviceProfile("cpu", 0.0, 0.052, 0.0, host_is_device=True),
}
