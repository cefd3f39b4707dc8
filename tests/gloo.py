"""Real gloo process groups for the distributed tests and `benchmarks/distributed.py`: a free loopback port, and
this process joining a run's `k3.dist.mesh.World` from the environment torchrun would give it."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

from k3.dist.layout import ParallelLayout
from k3.dist.mesh import World, init_world


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join(rank: int, world: int, port: int, layout: dict, timeout_s: float = 120) -> World:
    """Rank ``rank`` of ``world`` local processes meeting on ``port``; collectives time out after ``timeout_s``."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return init_world(ParallelLayout.for_world(world, **layout), timeout=timedelta(seconds=timeout_s))
