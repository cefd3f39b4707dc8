"""Depth: how a layer reads the layers below it (SPEC §3, Eq. 8–10).

`BlockAttnRes` keeps the depth sources of every position — the embedding, the completed block sums and
the current block's partial sum — and retrieves a softmax mixture of them with a learned pseudo-query:

    retrieve(w) = Σ_i softmax_i(w · RMSNorm(b_i)) · b_i        (keys normalised with unit gain, values raw)

`Residual` is the plain residual stream (Kimi Linear and other peers) behind the same interface, so a
backbone layer is written once: retrieve → mixer → retrieve_after → FFN → commit.
Both are immutable values: every method returns a new state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from k3.model.norm import rms_norm


def retrieve(query: Tensor, values: list[Tensor], keys: list[Tensor]) -> Tensor:
    """``Σ_i softmax_i(query · keys_i) values_i`` over the source list; scores and softmax in ≥ fp32."""
    dtype = torch.promote_types(values[0].dtype, torch.float32)
    scores = torch.stack([k.to(dtype) @ query.to(dtype) for k in keys])  # [S, ...]
    weights = scores.softmax(dim=0).to(values[0].dtype)
    out = weights[0].unsqueeze(-1) * values[0]
    for w, v in zip(weights[1:], values[1:]):
        out = out + w.unsqueeze(-1) * v
    return out


@dataclass(frozen=True)
class BlockAttnRes:
    """Block AttnRes depth state at every position: ``sources`` = (embedding, completed block sums...)."""

    sources: tuple[Tensor, ...]
    keys: tuple[Tensor, ...]  # RMSNorm(sources), computed once per source
    partial: Tensor | None  # the current block's partial sum; None while the block is empty
    count: int  # layers committed to the partial block, always < block_size
    block_size: int
    eps: float

    @classmethod
    def start(cls, embedding: Tensor, block_size: int, eps: float) -> BlockAttnRes:
        return cls((embedding,), (rms_norm(embedding, None, eps),), None, 0, block_size, eps)

    def _with(self, last: Tensor | None) -> tuple[list[Tensor], list[Tensor]]:
        if last is None:
            return list(self.sources), list(self.keys)
        return [*self.sources, last], [*self.keys, rms_norm(last, None, self.eps)]

    def retrieve(self, query: Tensor) -> Tensor:
        """Input of a sequence mixer (or, after the last layer, of the final norm)."""
        return retrieve(query, *self._with(self.partial))

    def retrieve_after(self, a: Tensor, query: Tensor) -> Tensor:
        """Input of the FFN: the partial sum now includes the sequence mixer's output ``a``."""
        return retrieve(query, *self._with(a if self.partial is None else self.partial + a))

    def commit(self, a: Tensor, f: Tensor) -> BlockAttnRes:
        """Add the layer's two outputs to the partial sum once; a full block becomes a source and resets."""
        partial = a + f if self.partial is None else self.partial + a + f
        if self.count + 1 == self.block_size:
            return BlockAttnRes((*self.sources, partial), (*self.keys, rms_norm(partial, None, self.eps)), None, 0,
                                self.block_size, self.eps)
        return BlockAttnRes(self.sources, self.keys, partial, self.count + 1, self.block_size, self.eps)

    def block_output(self) -> Tensor:
        """The output of the block the last committed layer belongs to: its sum when that layer completed it,
        else the partial sum so far (a model's last, partial block)."""
        return self.sources[-1] if self.partial is None else self.partial

    def stacked(self) -> Tensor:
        """All current sources ``[S, ...]`` (embedding, completed blocks, non-empty partial)."""
        return torch.stack(self._with(self.partial)[0])


@dataclass(frozen=True)
class Residual:
    """The plain residual stream behind the `BlockAttnRes` interface (queries are ignored)."""

    stream: Tensor

    @classmethod
    def start(cls, embedding: Tensor) -> Residual:
        return cls(embedding)

    def retrieve(self, query: Tensor | None) -> Tensor:
        return self.stream

    def retrieve_after(self, a: Tensor, query: Tensor | None) -> Tensor:
        return self.stream + a

    def commit(self, a: Tensor, f: Tensor) -> Residual:
        return Residual(self.stream + a + f)

    def block_output(self) -> Tensor:
        """The stream after the last committed layer (every layer is its own block)."""
        return self.stream

    def stacked(self) -> Tensor:
        return self.stream.unsqueeze(0)
