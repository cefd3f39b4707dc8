"""Shared benchmark plumbing: timing, the machine's matmul rate, isolated cases, tables and JSON results."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from k3.files import write_text

RESULTS = Path(__file__).resolve().parent / "results"


def median_seconds(fn: Callable[[], Any], min_repeats: int = 3, budget_s: float = 2.0) -> tuple[float, int]:
    """Median wall time of ``fn`` after one warm-up call, repeating until ``budget_s`` (at least ``min_repeats``)."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_repeats or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 50:
            break
    times.sort()
    return times[len(times) // 2], len(times)


def matmul_gflops(dtype: torch.dtype = torch.float32, n: int = 2048) -> float:
    """The machine's measured dense matmul rate (GFLOP/s) for an n×n×n product."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    seconds, _ = median_seconds(lambda: a @ b, min_repeats=5, budget_s=1.0)
    return 2 * n**3 / seconds / 1e9


def copy_gbps(mib: int = 256) -> float:
    """The machine's measured memory bandwidth (GB/s) for a large fp32 copy: bytes read plus bytes written per
    second — what a step that streams its weights and states through memory can reach at best."""
    src = torch.randn(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    seconds, _ = median_seconds(lambda: dst.copy_(src), min_repeats=5, budget_s=1.0)
    return 2 * src.numel() * 4 / seconds / 1e9


def reset_peak_rss() -> None:
    """Reset this process's resident-set high-water mark to its current size (Linux ≥ 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_rss_mib() -> float:
    """This process's resident-set high-water mark (Linux VmHWM) since the last `reset_peak_rss`, MiB."""
    return _status_kib("VmHWM") / 1024


def rss_mib() -> float:
    return _status_kib("VmRSS") / 1024


def _status_kib(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return float(line.split()[1])
    raise RuntimeError(f"{key} not found in /proc/self/status")


def run_isolated(script: Path, args: list[str], timeout_s: float) -> dict[str, Any]:
    """Run one benchmark case in a fresh interpreter (clean peak memory); it prints one JSON line last."""
    try:
        done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f}s"}
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"exit {done.returncode}: {tail[0][:200]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "processor": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
    }


def write_results(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    write_text(path, json.dumps(payload, indent=2))
    return path


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    """A Markdown table of ``rows`` with (key, header) ``columns``."""
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:,.1f}" if abs(value) >= 10 else f"{value:.3g}"
        return "" if value is None else str(value)

    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(k)) for k, _ in columns) + " |" for r in rows]
    return "\n".join(lines)
