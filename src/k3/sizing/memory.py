"""Refuse a model that would not fit in memory, before allocating it.

`check_fits(config, device, copies)` estimates the bytes of ``copies`` full copies of the language
model's parameters analytically (`k3.config.parameter_breakdown`, no tensor allocated) at the default
dtype, and compares them with the memory available on ``device``: ``MemAvailable`` of
``/proc/meminfo`` for the CPU, ``torch.cuda.mem_get_info`` for a CUDA device. Where that is unknown
(another OS or device kind, or the ``meta`` device, which allocates nothing) the check is skipped.
Activations, caches and allocator overhead are not counted, so passing is necessary, not sufficient.
"""

from __future__ import annotations

from pathlib import Path

import torch

from k3.config import K3Config
from k3.sizing.params import parameter_breakdown


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def model_parameters(config: K3Config) -> int:
    """Parameters `K3ForCausalLM` allocates: the analytic total (the vision encoder and projector included when
    ``vision.enabled``)."""
    return parameter_breakdown(config)["total"][0]


def available_bytes(device: torch.device) -> int | None:
    """Free memory on ``device`` in bytes, or None where it is unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            return int(value.split()[0]) * 1024  # reported in kB
    return None


def check_fits(config: K3Config, device: torch.device | str | None = None, copies: int = 1,
               what: str = "its parameters") -> None:
    """`ValueError` stating both sizes if ``copies`` × the parameter bytes exceed the memory available on
    ``device`` (default: the current default device)."""
    device = torch.get_default_device() if device is None else torch.device(device)
    available = available_bytes(device)
    if available is None:
        return
    needed = copies * model_parameters(config) * torch.get_default_dtype().itemsize
    if needed > available:
        raise ValueError(f"model needs {_size(needed)} for {what}, only {_size(available)} available on {device}")
