"""Process groups and the device mesh of a training run (issue 17; torchtitan's layout, SPEC §8).

`init_world` joins the process group that ``torchrun`` (or ``k3 train --nproc``) describes in the environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``) — NCCL on GPUs, gloo on CPUs, the device taken
from the local rank — and builds a `DeviceMesh` of shape `ParallelLayout.shape` named `MESH_DIMS`. Every collective
has a timeout, so a rank that dies makes the others fail with an error instead of waiting forever.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from k3.dist.layout import MESH_DIMS, ParallelLayout

#: How long a collective may wait for the other ranks before failing (a dead or stuck rank).
DEFAULT_TIMEOUT = timedelta(minutes=5)


def device_for(local_rank: int) -> torch.device:
    """This process's device: the accelerator with index ``local_rank`` when there is one, else the CPU."""
    if torch.accelerator.is_available():
        kind = torch.accelerator.current_accelerator().type
        torch.accelerator.set_device_index(local_rank)
        return torch.device(kind, local_rank)
    return torch.device("cpu")


@dataclass
class World:
    """This process's place in the run: the layout, the mesh, its device and coordinates."""

    layout: ParallelLayout
    mesh: DeviceMesh
    device: torch.device

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def coordinate(self) -> dict[str, int]:
        return dict(zip(MESH_DIMS, self.mesh.get_coordinate(), strict=True))

    @property
    def data_index(self) -> int:
        """Which share of the batch rows this rank holds (0 … data_ranks − 1)."""
        c, lay = self.coordinate, self.layout
        return (c["dp_replicate"] * lay.ep + c["ep"]) * lay.dp_shard + c["dp_shard"]

    @property
    def cp_index(self) -> int:
        return self.coordinate["cp"]

    def group(self, dim: str) -> dist.ProcessGroup:
        """The process group along one mesh dimension (this rank and the ranks differing only there)."""
        return self.mesh.get_group(dim)

    def fsdp_mesh(self) -> DeviceMesh:
        """Where the non-expert parameters live: sharded over ``ep × dp_shard × cp`` (flattened), replicated over
        ``dp_replicate`` (HSDP) — a 1-D mesh when there are no replicas."""
        return self._hsdp(self.mesh["ep", "dp_shard", "cp"]._flatten("fsdp"), "fsdp")

    def expert_mesh(self) -> DeviceMesh:
        """Where each rank's expert-parallel experts live: sharded over ``dp_shard × cp`` (the ranks with the same
        ``ep`` coordinate), replicated over ``dp_replicate``."""
        return self._hsdp(self.mesh["dp_shard", "cp"]._flatten("expert_fsdp"), "expert_fsdp")

    def _hsdp(self, shard: DeviceMesh, name: str) -> DeviceMesh:
        return self.mesh["dp_replicate", name] if self.layout.dp_replicate > 1 else shard


def init_world(layout: ParallelLayout, timeout: timedelta = DEFAULT_TIMEOUT) -> World:
    """Join the process group described by the environment and build the mesh; the world size must be the
    layout's (checked before any group is made)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != layout.world:
        raise ValueError(f"the layout ({layout.describe()}) needs {layout.world} processes but WORLD_SIZE is {world}")
    device = device_for(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(dist.get_default_backend_for_device(device), timeout=timeout)
    mesh = init_device_mesh(device.type, layout.shape, mesh_dim_names=MESH_DIMS)
    return World(layout, mesh, device)
