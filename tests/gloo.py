"""Real gloo process groups for the distributed tests and `benchmarks/distributed.py`: a free loopback port, and
this process joining a run's `k3.dist.mesh.World` from the environment torchrun would give it."""

from __future__ import annotations

import os
import random
import socket
from datetime import timedelta
from pathlib import Path

from k3.dist.layout import ParallelLayout
from k3.dist.mesh import World, init_world


def free_port(count: int = 1) -> int:
    """A port P with P … P+count-1 free on loopback, drawn below the kernel's ephemeral range: outgoing connections
    (this suite's other workers, a launcher polling its replicas) take their local ports from that range, so a port
    picked there can be taken between this check and the server's bind (stop 53's CI failure)."""
    low = _ephemeral_low()
    draw = random.SystemRandom()  # not `random`: a test that seeds it would give every worker the same ports
    while True:
        base = draw.randrange(10000, low - count) if low - count > 10000 else _any_port()
        if base + count > 65536:  # the fallback's port may sit too near the top for count ports
            continue
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _any_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join(rank: int, world: int, port: int, layout: dict, timeout_s: float = 120) -> World:
    """Rank ``rank`` of ``world`` local processes meeting on ``port``; collectives time out after ``timeout_s``."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return init_world(ParallelLayout.for_world(world, **layout), timeout=timedelta(seconds=timeout_s))
