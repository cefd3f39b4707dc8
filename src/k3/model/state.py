"""`DecoderState`: the model's whole causal state as one explicit, copyable value.

It holds every layer's KDA state (ShortConv window + recurrent state) or MLA latent cache, the Block
AttnRes depth sources of the last position, and the number of tokens consumed. Sequences of unequal
lengths share one batch (`stack`) by left-padding the MLA caches; ``padding[b]`` counts row b's padded
leading positions, which attention masks out, and `unstack` strips them again (splitting a stacked
speculative verification's `Replay` by row). Serving checkpoints it at token boundaries, restores it from
a prefix cache, replays it after speculative drafts and ships it between ranks, so it is plain tensors:
`clone`, `to`, `select` (batch rows), `save` / `load`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from k3.files import atomic_write, open_regular
from k3.model.sequence import kda
from k3.model.sequence.kda import KDAReplay, KDAState
from k3.model.sequence.mla import MLACache

LayerState = KDAState | MLACache
_KINDS = {"kda": KDAState, "mla": MLACache}


def _cat(states: list[LayerState]) -> LayerState:
    return replace(states[0], **{f.name: torch.cat([getattr(s, f.name) for s in states]) for f in fields(states[0])})


def _map(state: LayerState | KDAReplay, fn) -> LayerState | KDAReplay:
    """A copy of a per-layer record with ``fn`` applied to each of its tensor fields."""
    return replace(state, **{f.name: fn(getattr(state, f.name)) for f in fields(state)})


@dataclass
class Replay:
    """How a state that consumed a run of drafted tokens is rolled back to any prefix of the run (SPEC §8): the
    state before the run, each KDA layer's `KDAReplay` (None for MLA layers, whose caches are truncated) and the
    depth sources at every position of the run ``[B, T, S, d]``."""

    before: DecoderState
    kda: list[KDAReplay | None]
    depth: Tensor


@dataclass
class DecoderState:
    layers: list[LayerState]
    depth: Tensor | None = None  # [B, S, d]: depth sources at the last position after the final layer
    position: int = 0  # tokens consumed (by the longest row when padded)
    padding: Tensor | None = None  # [B] int64: leading cache positions of each row that are padding
    replay: Replay | None = None  # set by `K3ForCausalLM.forward_groups(..., replay=...)`: see `accept`

    def accept(self, n: int) -> DecoderState:
        """The state after only the first ``n`` tokens of the run this state consumed (batch 1, from
        ``forward_groups(..., replay=[...])``): KDA layers replay their recorded inputs from the state before the
        run token by token, MLA caches are truncated (keeping their in-place storage: `MLACache.truncate`, so this
        state must not be continued after ``accept``), the depth sources are those of position ``n − 1``."""
        return self._rolled_back(n, "accept", None)

    def prefix(self, n: int, chunk_size: int) -> DecoderState:
        """`accept`'s state after the first ``n`` tokens of the run, leaving this state as it is (a prefill piece
        that passed a prefix-cache cut: the request continues from this state, the cache copies the prefix's): KDA
        layers run the chunked form over their recorded inputs (``chunk_size``: the layers' `KDALayer.chunk_size`,
        as a prefill of those tokens would), MLA caches are views of their first rows."""
        return self._rolled_back(n, "prefix", chunk_size)

    def accept_rows(self, ns: list[int]) -> list[DecoderState]:
        """Each row of a stacked verification as its own batch-1 state after the first ``ns[b]`` tokens of its run:
        `unstack` and then each row's `accept`, with every row's KDA layers replayed as one recurrence (a row that
        keeps its whole run takes its state as it is). Batch 1 is `accept` (the MLA caches keep their storage)."""
        r = self.replay
        if r is None or len(ns) != self.batch_size:
            raise ValueError(f"accept_rows: needs a state from forward_groups(..., replay=...) and one count per row "
                             f"({self.batch_size}), got {len(ns)}")
        if self.batch_size == 1:
            return [self.accept(ns[0])]
        run = self.position - r.before.position
        if not all(1 <= n <= run for n in ns):
            raise ValueError(f"accept_rows: each count must be in [1, {run}] (the run's length), got {ns}")
        kda_layers = [i for i, record in enumerate(r.kda) if record is not None]
        replayed = kda.advance_rows([r.kda[i] for i in kda_layers], [r.before.layers[i] for i in kda_layers],
                                    [0 if n == run else n for n in ns])  # a whole run's row is this state's
        rows = []
        for b, (n, pad) in enumerate(zip(ns, self.row_padding().tolist())):
            kept = iter(replayed[b])
            row: list[LayerState] = []
            for before, now in zip(r.before.layers, self.layers, strict=True):
                if isinstance(now, MLACache):
                    end = before.length + n
                    row.append(MLACache(now.latent[b:b + 1, pad:end], now.shared_key[b:b + 1, pad:end]))
                else:
                    replayed_row = next(kept)
                    row.append(KDAState(now.conv[b:b + 1], now.recurrent[b:b + 1]) if n == run else replayed_row)
            rows.append(DecoderState(row, r.depth[b:b + 1, n - 1], r.before.position - pad + n))
        return rows

    def _rolled_back(self, n: int, name: str, chunk_size: int | None) -> DecoderState:
        r = self.replay
        if r is None or self.batch_size != 1 or self.padding is not None:
            raise ValueError(f"{name}: needs a batch-1, unpadded state from forward_groups(..., replay=...)")
        run = self.position - r.before.position
        if not 1 <= n <= run:
            raise ValueError(f"{name}: n must be in [1, {run}] (the run's length), got {n}")
        if n == run:
            return replace(self, replay=None)
        replayed = iter(kda.advance([record for record in r.kda if record is not None],
                                    [b for b, record in zip(r.before.layers, r.kda) if record is not None],
                                    n, chunk_size))
        layers: list[LayerState] = []
        for before, now, record in zip(r.before.layers, self.layers, r.kda, strict=True):
            if record is not None:
                layers.append(next(replayed))
            elif chunk_size is None:
                layers.append(now.truncate(before.length + n))
            else:
                layers.append(now.first(before.length + n))
        return DecoderState(layers, r.depth[:, n - 1], r.before.position + n)

    @property
    def batch_size(self) -> int:
        first = self.layers[0]
        return (first.conv if isinstance(first, KDAState) else first.latent).shape[0]

    @property
    def device(self) -> torch.device:
        """Where the state's tensors are (those of its model)."""
        first = self.layers[0]
        return (first.conv if isinstance(first, KDAState) else first.latent).device

    def apply(self, fn) -> DecoderState:
        """A new state with ``fn`` applied to every tensor (a pending `Replay` included)."""
        def opt(t: Tensor | None) -> Tensor | None:
            return None if t is None else fn(t)

        replay = None if self.replay is None else Replay(self.replay.before.apply(fn), [
            None if r is None else _map(r, fn) for r in self.replay.kda], fn(self.replay.depth))
        return DecoderState([_map(s, fn) for s in self.layers], opt(self.depth), self.position, opt(self.padding),
                            replay)

    def clone(self) -> DecoderState:
        return self.apply(torch.clone)

    def recurrent(self) -> DecoderState:
        """A copy of this state's fixed-size part — KDA layers and depth sources — with empty MLA caches: what a
        prefix-cache checkpoint keeps of a position passed while decoding, without holding the context's caches (or
        the batch they are views of) alive. `with_attention` puts the caches back."""
        layers = [_map(s, torch.clone) if isinstance(s, KDAState) else MLACache(s.latent[:, :0].clone(),
                                                                                s.shared_key[:, :0].clone())
                  for s in self.layers]
        return DecoderState(layers, None if self.depth is None else self.depth.clone(), self.position)

    def with_attention(self, later: DecoderState) -> DecoderState:
        """This (`recurrent`) state with the MLA caches of ``later``, a continuation of it, cut at this position."""
        if later.position < self.position or later.padding is not None:
            raise ValueError(f"with_attention: needs an unpadded continuation at position >= {self.position}, got "
                             f"{later.position}")
        n = self.position
        layers = [s if isinstance(s, KDAState) else a.first(n) for s, a in zip(self.layers, later.layers, strict=True)]
        return DecoderState(layers, self.depth, self.position)

    def to(self, device: torch.device | str | None = None) -> DecoderState:
        return self.apply(lambda t: t.to(device))

    def select(self, rows: Tensor | list[int] | slice) -> DecoderState:
        """The batch rows ``rows`` (index list/tensor or slice) as a new state."""
        if isinstance(rows, slice):
            return self.apply(lambda t: t[rows])
        index = torch.as_tensor(rows, dtype=torch.long)
        return self.apply(lambda t: t.index_select(0, index.to(t.device)))

    # ------------------------------------------------------------------ batching unequal lengths
    @classmethod
    def stack(cls, states: list[DecoderState]) -> DecoderState:
        """One batch of all rows of ``states`` (any positions): MLA caches left-padded to the longest.

        Continuing the stacked state gives each row what continuing it alone would give (up to float
        reduction order); `unstack` recovers the per-sequence states.
        """
        if not states:
            raise ValueError("stack: expected at least one DecoderState")
        if any(st.replay is not None for st in states):
            raise ValueError("stack: a state with a pending replay must be `accept`-ed first")
        kinds = [type(s) for s in states[0].layers]
        for i, st in enumerate(states):
            if [type(s) for s in st.layers] != kinds or (st.depth is None) != (states[0].depth is None):
                raise ValueError(f"stack: state {i} has a different layer layout than state 0")
        position = max(st.position for st in states)
        shift = [position - st.position for st in states]
        padding = torch.cat([st.row_padding() + k for st, k in zip(states, shift)])
        layers: list[LayerState] = []
        for i, kind in enumerate(kinds):
            if kind is MLACache:
                layers.append(MLACache(*(torch.cat([F.pad(getattr(st.layers[i], name), (0, 0, k, 0))
                                                    for st, k in zip(states, shift)])
                                         for name in ("latent", "shared_key"))))
            else:
                layers.append(_cat([st.layers[i] for st in states]))
        depth = None if states[0].depth is None else torch.cat([st.depth for st in states])
        return cls(layers, depth, position, padding)

    def unstack(self) -> list[DecoderState]:
        """Each row as its own batch-1 state, its padding stripped (inverse of `stack`). A pending `Replay` of a
        stacked verification (SPEC §8) is split too: each row keeps its own before-state, KDA records and depth
        sources, so it can `accept` its own prefix as if it had been verified alone. An unpadded row alone is this
        state's own caches (their in-place storage kept: its next step appends without copying them)."""
        padding = self.row_padding().tolist()
        if padding == [0] and self.replay is None:
            return [DecoderState(list(self.layers), self.depth, self.position)]
        rows = []
        for b, pad in enumerate(padding):
            row = self.select(slice(b, b + 1))
            layers = [MLACache(s.latent[:, pad:], s.shared_key[:, pad:]) if isinstance(s, MLACache) else s
                      for s in row.layers]
            replay = None if row.replay is None else replace(row.replay, before=row.replay.before.unstack()[0])
            rows.append(DecoderState(layers, row.depth, self.position - pad, replay=replay))
        return rows

    def row_padding(self) -> Tensor:
        """``[B]`` leading padded positions per row (zeros when unpadded)."""
        if self.padding is not None:
            return self.padding
        return torch.zeros(self.batch_size, dtype=torch.long, device=self.device)

    # ------------------------------------------------------------------ serialisation
    def tensors(self) -> dict[str, Tensor]:
        out = {f"layers.{i}.{f.name}": getattr(s, f.name) for i, s in enumerate(self.layers) for f in fields(s)}
        if self.depth is not None:
            out["depth"] = self.depth
        if self.padding is not None:
            out["padding"] = self.padding
        return {name: t.contiguous() for name, t in out.items()}

    def save(self, path: str | os.PathLike) -> None:
        """Write a safetensors file atomically (`k3.files.atomic_write`)."""
        kinds = ["kda" if isinstance(s, KDAState) else "mla" for s in self.layers]
        meta = {"format": "k3.DecoderState", "kinds": json.dumps(kinds), "position": str(self.position)}
        with atomic_write(path) as tmp:
            save_file(self.tensors(), str(tmp), metadata=meta)

    @classmethod
    def load(cls, path: str | os.PathLike) -> DecoderState:
        """Read a file written by `save`; a corrupt or foreign file raises ValueError naming it."""
        path = os.fspath(path)
        try:
            open_regular(path).close()  # a FIFO or a device is refused, not read
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
        return cls(layers, tensors.get("depth"), position, tensors.get("padding"))
