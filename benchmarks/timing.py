"""Decode timing shared by the benchmarks, with no torch import (`llamacpp_peer.py` runs without it)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def timed_decode(step: Callable[[], None], batch: int, steps: int = 32, blocks: int = 5) -> float:
    """Tokens/s of ``step`` (one batch-wide decode step, already warmed up): the median over ``blocks`` runs of
    ``steps`` steps, so a burst of load from another process on the shared cores does not decide the figure."""
    times = []
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        times.append(time.perf_counter() - start)
    return batch * steps / statistics.median(times)
