"""Refuse a model that would not fit in memory, before allocating it.

`check_fits(config, device, copies)` estimates the bytes of ``copies`` full copies of the language
model's parameters analytically (`k3.config.parameter_breakdown`, no tensor allocated) at the default
dtype, and compares them with the memory available on ``device``: ``MemAvailable`` of
``/proc/meminfo`` for the CPU, ``torch.cuda.mem_get_info`` for a CUDA device. Where that is unknown
(another OS or device kind, or the ``meta`` device, which allocates nothing) the check is skipped.
Activations, caches and allocator overhead are not counted, so passing is necessary, not sufficient. Whatever the
device, a model of more than `MAX_PARAMETERS` is refused, and `check_stored` refuses a config that describes more
parameters than its weight files can hold — both before anything is built, so a crafted ``config.json`` fails in
milliseconds.
"""

from __future__ import annotations

from pathlib import Path

import torch

from k3.config import K3Config
from k3.sizing.params import parameter_breakdown


#: The most parameters any model may have (2^46, about 70T: 25 times the published 2.78T).
MAX_PARAMETERS = 2**46


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
    ``device`` (default: the current default device), or if the model exceeds `MAX_PARAMETERS`."""
    parameters = model_parameters(config)
    if parameters > MAX_PARAMETERS:
        raise ValueError(f"model has {parameters:,} parameters, more than the {MAX_PARAMETERS:,} "
                         f"(k3.sizing.memory.MAX_PARAMETERS) any configuration may have")
    device = torch.get_default_device() if device is None else torch.device(device)
    available = available_bytes(device)
    if available is None:
        return
    needed = copies * parameters * torch.get_default_dtype().itemsize
    if needed > available:
        raise ValueError(f"model needs {_size(needed)} for {what}, only {_size(available)} available on {device}")


def check_stored(config: K3Config, stored: int, config_file: str, weights: str, whole: bool = False) -> None:
    """`ValueError` if ``stored`` bytes of weights (``weights``) cannot hold the parameters of ``config`` (read from
    ``config_file``) at half a byte each (MXFP4, the most compact format a checkpoint uses): the config describes
    another, larger model. With ``whole`` (the weights are this model's and nothing else: a kimi-k3 checkpoint), more
    than 8 bytes a parameter (fp64) and 128 MiB (buffers, the header) is refused too."""
    parameters = model_parameters(config)
    if stored < parameters // 2:
        raise ValueError(f"{config_file}: describes a model of {parameters:,} parameters, which {weights} "
                         f"({stored:,} bytes) cannot hold: the config does not belong to these weights")
    if whole and stored > 8 * parameters + 2**27:
        raise ValueError(f"{weights}: {stored:,} bytes, far more than the {parameters:,} parameters {config_file} "
                         f"describes can take: the weights do not belong to this config")
