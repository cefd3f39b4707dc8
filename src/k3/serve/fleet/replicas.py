"""The replica processes of ``k3 serve --replicas N``: started, watched, restarted when one dies, stopped.

A replica that dies while the fleet runs (a crash, a signal that kills it) is restarted on its port after a delay
that doubles with each death in a row (`FIRST_DELAY`, 2×, 4×, … up to `MAX_DELAY` seconds); one that ran for
`STABLE` seconds before it died starts again from `FIRST_DELAY`. A replica that exits with code 0 was stopped on
purpose (SIGTERM or Ctrl-C: it drained) and stays down. Every exit and restart is logged on stdout; the router's
health checks take a replica out of the ring while it is down and put it back once it answers.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable, Sequence

__all__ = ["FIRST_DELAY", "MAX_DELAY", "STABLE", "Replicas"]

FIRST_DELAY, MAX_DELAY, STABLE = 0.5, 30.0, 60.0  # seconds
POLL = 0.1  # seconds between looks at the processes


class Replicas:
    """One process per port, started by ``command(port)``; ``watch`` restarts those that die (module docstring)."""

    def __init__(self, ports: Sequence[int], command: Callable[[int], list[str]]) -> None:
        self.ports, self.command = list(ports), command
        self.processes: list[subprocess.Popen] = []
        self.started: list[float] = []  # when each current process started
        self.exits = [0] * len(self.ports)  # deaths in a row, for the backoff
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def start(self) -> None:
        for port in self.ports:
            self.processes.append(subprocess.Popen(self.command(port)))
            self.started.append(time.monotonic())

    def watch(self) -> None:
        """Restart replicas that die, on a background thread, until `stop`."""
        self._watcher = threading.Thread(target=self._watch, name="k3-replicas", daemon=True)
        self._watcher.start()

    def delay(self, index: int) -> float:
        """Seconds to wait before restarting replica ``index``, which just died (and count the death)."""
        if time.monotonic() - self.started[index] >= STABLE:
            self.exits[index] = 0
        self.exits[index] += 1
        return min(FIRST_DELAY * 2 ** (self.exits[index] - 1), MAX_DELAY)

    def _watch(self) -> None:
        due: dict[int, float] = {}  # replica index -> when to restart it
        stopped: set[int] = set()  # replicas that exited with code 0
        while not self._stop.wait(POLL):
            now = time.monotonic()
            for i, process in enumerate(self.processes):
                if i in due:
                    if now >= due[i]:
                        del due[i]
                        self._restart(i)
                elif i in stopped or process.poll() is None:
                    continue
                elif process.returncode == 0:
                    stopped.add(i)
                    print(f"k3 serve: replica {i} (port {self.ports[i]}) stopped (exit code 0); not restarting it",
                          flush=True)
                else:
                    wait = self.delay(i)
                    due[i] = now + wait
                    print(f"k3 serve: replica {i} (port {self.ports[i]}) exited with code {process.returncode}; "
                          f"restarting it in {wait:g} s", flush=True)

    def _restart(self, i: int) -> None:
        self.processes[i] = subprocess.Popen(self.command(self.ports[i]))
        self.started[i] = time.monotonic()
        print(f"k3 serve: replica {i} (port {self.ports[i]}) restarted, pid {self.processes[i].pid}", flush=True)

    def stop(self, timeout: float) -> None:
        """Stop watching, then terminate every replica (SIGTERM: they drain), killing those that outlast
        ``timeout`` seconds."""
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join()
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
