"""kimi-k3: the Kimi K3 model, training recipe and serving stack in PyTorch."""

from __future__ import annotations

__all__ = ["K3ForCausalLM", "K3Config", "preset"]


def __getattr__(name: str):
    # Lazy, so that `k3.config` and the CLI do not pay for importing the model.
    if name == "K3ForCausalLM":
        from k3.model.lm import K3ForCausalLM

        return K3ForCausalLM
    if name in ("K3Config", "preset"):
        from k3 import config

        return getattr(config, name)
    raise AttributeError(f"module 'k3' has no attribute {name!r}")
