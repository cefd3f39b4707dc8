"""`DecoderState`: the model's whole causal state as one explicit, copyable value.

It holds every layer's KDA state (ShortConv window + recurrent state) or MLA latent cache, the Block
AttnRes depth sources of the last position, and the number of tokens consumed. Serving checkpoints it
at token boundaries, restores it from a prefix cache, replays it after speculative drafts and ships
it between ranks, so it is plain tensors: `clone`, `to`, `select` (batch rows), `save` / `load`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from k3.model.sequence.kda import KDAState
from k3.model.sequence.mla import MLACache

LayerState = KDAState | MLACache
_KINDS = {"kda": KDAState, "mla": MLACache}


def _map(state: LayerState, fn) -> LayerState:
    return replace(state, **{f.name: fn(getattr(state, f.name)) for f in fields(state)})


@dataclass
class DecoderState:
    layers: list[LayerState]
    depth: Tensor | None = None  # [B, S, d]: depth sources at the last position after the final layer
    position: int = 0  # tokens consumed

    @property
    def batch_size(self) -> int:
        first = self.layers[0]
        return (first.conv if isinstance(first, KDAState) else first.latent).shape[0]

    def apply(self, fn) -> DecoderState:
        """A new state with ``fn`` applied to every tensor."""
        return DecoderState([_map(s, fn) for s in self.layers], None if self.depth is None else fn(self.depth),
                            self.position)

    def clone(self) -> DecoderState:
        return self.apply(torch.clone)

    def to(self, device: torch.device | str | None = None) -> DecoderState:
        return self.apply(lambda t: t.to(device))

    def select(self, rows: Tensor | list[int] | slice) -> DecoderState:
        """The batch rows ``rows`` (index list/tensor or slice) as a new state."""
        if isinstance(rows, slice):
            return self.apply(lambda t: t[rows])
        index = torch.as_tensor(rows, dtype=torch.long)
        return self.apply(lambda t: t.index_select(0, index.to(t.device)))

    # ------------------------------------------------------------------ serialisation
    def tensors(self) -> dict[str, Tensor]:
        out = {f"layers.{i}.{f.name}": getattr(s, f.name) for i, s in enumerate(self.layers) for f in fields(s)}
        if self.depth is not None:
            out["depth"] = self.depth
        return {name: t.contiguous() for name, t in out.items()}

    def save(self, path: str | os.PathLike) -> None:
        """Write a safetensors file atomically (temporary file, then rename)."""
        kinds = ["kda" if isinstance(s, KDAState) else "mla" for s in self.layers]
        meta = {"format": "k3.DecoderState", "kinds": json.dumps(kinds), "position": str(self.position)}
        tmp = Path(f"{os.fspath(path)}.tmp")
        save_file(self.tensors(), str(tmp), metadata=meta)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> DecoderState:
        """Read a file written by `save`; a corrupt or foreign file raises ValueError naming it."""
        path = os.fspath(path)
        try:
            tensors = load_file(path)
            with safe_open(path, "pt") as f:
                meta = f.metadata() or {}
        except (SafetensorError, OSError) as err:
            raise ValueError(f"{path}: not a readable safetensors file ({err})") from err
        if meta.get("format") != "k3.DecoderState":
            raise ValueError(f"{path}: not a k3 DecoderState file (metadata 'format' is {meta.get('format')!r})")
        layers = []
        try:
            for i, kind in enumerate(json.loads(meta["kinds"])):
                cls_ = _KINDS[kind]
                layers.append(cls_(**{f.name: tensors[f"layers.{i}.{f.name}"] for f in fields(cls_)}))
            position = int(meta["position"])
        except (KeyError, ValueError, TypeError) as err:
            raise ValueError(f"{path}: malformed DecoderState ({type(err).__name__}: {err})") from err
        return cls(layers, tensors.get("depth"), position)
