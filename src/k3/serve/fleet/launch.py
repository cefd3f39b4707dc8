"""A fleet of engine replicas behind the cache-aware `Router` (issue 13): ``k3 route`` in front of running
``k3 serve`` processes, and ``k3 serve --replicas N``, which starts N replica processes on 127.0.0.1 (ports
PORT+1 … PORT+N, each with the command's own flags), serves the router on ``--host``/``--port`` once they
answer, restarts a replica that dies (`k3.serve.fleet.replicas`: exponential backoff, logged), and terminates
them when the router stops (SIGTERM / SIGINT drain the router first). The router checks the API key itself
(``GET /router/status`` needs it) and passes it on to the replicas.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

import httpx

from k3.serve.asgi.guard import Guard, Limits
from k3.serve.asgi.server import Server
from k3.serve.fleet.replicas import Replicas
from k3.serve.fleet.router import Router

__all__ = ["replica_flags", "run_fleet", "run_router"]


def run_router(replicas: Sequence[str], host: str = "127.0.0.1", port: int = 8000, limits: Limits | None = None,
               api_key: str | None = None, **options) -> int:
    """Serve a `Router` over ``replicas`` (base URLs; ``options`` go to `Router`) until SIGTERM / SIGINT."""
    router = Router(replicas, **options)
    server = Server(Guard(router, limits or Limits(), api_key), host=host, port=port)

    async def serve() -> None:
        async with router:
            await server.serve()

    port = server.listen()  # port 0: the free port chosen, printed
    print(f"k3 route: {len(router.replicas)} replicas behind http://{host}:{port}/v1", flush=True)
    asyncio.run(serve())
    print("k3 route: stopped", flush=True)
    return 0


def replica_flags(serve_args: Sequence[str], replicas: int) -> list[str]:
    """A replica's ``k3 serve`` flags: the command's own, less those the fleet sets (``--replicas``,
    ``--host``, ``--port``, ``--ckpt``), with ``--threads`` defaulting to a share of the free cores and
    ``--max-connections-per-client`` raised to ``--max-connections``: the router is a replica's one client."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in ("--replicas", "--host", "--port", "--ckpt", "--max-connections-per-client"):
        parser.add_argument(flag)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--max-connections", default=str(Limits().max_connections))
    known, rest = parser.parse_known_args(serve_args)
    threads = known.threads or max(1, ((os.cpu_count() or 1) - 1) // replicas)
    return [*rest, "--threads", str(threads), "--max-connections", known.max_connections,
            "--max-connections-per-client", known.max_connections]


def _exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def run_fleet(ckpt: str | Path, replicas: int, base_port: int, serve_args: Sequence[str], *,
              host: str = "127.0.0.1", limits: Limits | None = None, api_key: str | None = None, **options) -> int:
    """`k3 serve --replicas N` (module docstring): ``serve_args`` are the command's flags, passed on to the
    replicas by `replica_flags`; ``limits``, ``api_key`` and ``options`` are the router's (`run_router`)."""
    limits = limits or Limits()
    flags = replica_flags(serve_args, replicas)
    ports = [base_port + i for i in range(1, replicas + 1)]
    fleet = Replicas(ports, lambda port: [sys.executable, "-m", "k3.cli", "serve", *flags, "--ckpt", str(ckpt),
                                          "--host", "127.0.0.1", "--port", str(port)])
    previous = signal.signal(signal.SIGTERM, _exit)  # a SIGTERM while the replicas start still stops them
    try:
        fleet.start()
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        _wait_until_ready(urls, fleet.processes)
        fleet.watch()
        return run_router(urls, host, base_port, limits, api_key, **options)
    finally:
        signal.signal(signal.SIGTERM, previous)
        fleet.stop(timeout=limits.drain_timeout + 10)


def _wait_until_ready(urls: Sequence[str], processes: Sequence[subprocess.Popen]) -> None:
    """Return once every replica's ``/health`` answers 200; a replica that exits first is an error."""
    waiting = dict(zip(urls, processes))
    with httpx.Client(timeout=1.0, trust_env=False) as client:
        while waiting:
            for url, process in list(waiting.items()):
                if process.poll() is not None:
                    raise ChildProcessError(f"the replica at {url} exited with code {process.returncode}")
                try:
                    if client.get(url + "/health").status_code == 200:
                        del waiting[url]
                except httpx.TransportError:
                    pass
            time.sleep(0.1)
