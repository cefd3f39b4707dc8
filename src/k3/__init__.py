"""kimi-k3: the Kimi K3 model, training recipe and serving stack in PyTorch."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["K3ForCausalLM", "K3Config", "__version__", "preset"]

try:
    __version__ = version("kimi-k3")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"


def __getattr__(name: str):
    # Lazy, so that `k3.config` and the CLI do not pay for importing the model.
    if name == "K3ForCausalLM":
        from k3.model.lm import K3ForCausalLM

        return K3ForCausalLM
    if name in ("K3Config", "preset"):
        from k3 import config

        return getattr(config, name)
    raise AttributeError(f"module 'k3' has no attribute {name!r}")
