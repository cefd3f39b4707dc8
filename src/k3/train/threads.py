"""Torch's intra-op threads sized to the cores other processes leave free (issue 10, item 8).

PyTorch's CPU operators run on GNU OpenMP, whose idle workers spin before they sleep. Alone, two threads
make a `small` training step 1.8× faster than one; but when another busy process shares the cores the
spinning workers take the time the working ones need, and the same step runs 3.3–4.3× slower than
alone, while one thread is unaffected (`benchmarks/contention.py`). The wait policy cannot change once the
runtime is loaded, and ``OMP_WAIT_POLICY=PASSIVE`` costs 1.6× alone, so `CoreShare` adapts the thread
count instead: from ``/proc/stat`` and this process's own CPU time it measures how many cores *other*
processes kept busy over the last window (a few seconds of steps) and uses the rest, at least one.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

__all__ = ["CoreShare", "busy_cores"]

_TICK = os.sysconf("SC_CLK_TCK")


def _busy_seconds() -> float | None:
    """CPU seconds all processes spent busy since boot (the ``cpu`` line of /proc/stat), or None off Linux."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / _TICK


def _own_seconds() -> float:
    times = os.times()
    return times.user + times.system


def busy_cores(window_s: float) -> float | None:
    """Cores kept busy by other processes over ``window_s`` seconds of sleeping (for tools and tests)."""
    start = _busy_seconds()
    if start is None:
        return None
    own, wall = _own_seconds(), time.monotonic()
    time.sleep(window_s)
    return _others(start, own, wall)


def _others(busy: float, own: float, wall: float) -> float:
    elapsed = time.monotonic() - wall
    return max(0.0, (_busy_seconds() - busy - (_own_seconds() - own)) / max(elapsed, 1e-9))


class CoreShare:
    """Call `update` between steps; every ``window_s`` seconds it sets ``torch.set_num_threads`` to the cores
    this process may use (its CPU affinity) minus those other processes kept busy, at least one."""

    def __init__(self, window_s: float = 5.0) -> None:
        self.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.window_s = window_s
        self.threads = torch.get_num_threads()
        self.others = 0.0
        self._mark()

    def _mark(self) -> None:
        self._busy, self._own, self._wall = _busy_seconds(), _own_seconds(), time.monotonic()

    def update(self) -> int:
        """The thread count now in force (changed only at the end of a window)."""
        if self._busy is None or time.monotonic() - self._wall < self.window_s:
            return self.threads
        self.others = _others(self._busy, self._own, self._wall)
        threads = max(1, min(self.cores, round(self.cores - self.others)))
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads
        self._mark()
        return self.threads
