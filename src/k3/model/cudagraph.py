"""Compiled decode steps replayed as CUDA graphs (issue 39, item 2; vLLM's and SGLang's CUDA-graph runners).

A compiled decode step still launches every kernel from Python: ~7 ms a step for ``small`` on an H200, three orders
above its HBM roofline. A CUDA graph records the launches once and replays them in one call. It needs the same shapes
and addresses at every replay, so the step runs on `GraphedDecode`'s own buffers:

* each MLA cache becomes an `k3.model.sequence.mla.MLAWindow` — storage of a fixed capacity whose length is a device
  scalar, written in place at that position, attention masked past it — so one graph serves every length up to the
  capacity (`Storage.holding`'s: the length plus a quarter, at least `SLACK`);
* ids, KDA states, depth sources and padding are copied into the graph's inputs before each replay (a few MB), and
  what the graph returns is copied out (the graph writes the same outputs at the next replay).

The MLA storage belongs to the graph, and the states a step returns view it like any `Storage` (`MLACache`'s
rules: entries are appended, never rewritten). A step whose state continues the graph's storage — the state the last
replay returned, or one a verification or `accept` advanced in place — replays at once; any other state (a batch that
changed rows, a cache past the capacity) captures a new graph on new storage holding its entries: a few ms, the cost
vLLM avoids with a paged cache and a block table. One graph is kept per batch shape; the compiled function itself is
traced once for all capacities (the storage's length dimension is dynamic).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor

from k3.model.sequence.kda import KDAState
from k3.model.sequence.mla import MLACache, MLAWindow, Storage
from k3.model.state import DecoderState

Step = Callable[[Tensor, DecoderState], tuple[Tensor, DecoderState]]
Capture = Callable[[Callable[[], tuple[Tensor, DecoderState]]], tuple[tuple[Tensor, DecoderState], Callable[[], None]]]
_POOL: list = []  # one CUDA graph memory pool for the process: graphs replay one at a time


def cuda_capture(run: Callable[[], tuple[Tensor, DecoderState]]
                 ) -> tuple[tuple[Tensor, DecoderState], Callable[[], None]]:
    """Record ``run()`` as a CUDA graph: ``(its outputs, replay)``, where ``replay()`` writes new outputs into the same
    tensors. A first call on a side stream compiles, autotunes and grows the allocator outside the graph (it writes
    what the graph's first replay writes again)."""
    if not _POOL:
        _POOL.append(torch.cuda.graph_pool_handle())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=_POOL[0]):
        outputs = run()
    return outputs, graph.replay


def mla_length(state: DecoderState) -> int:
    """The length of the state's MLA caches (all equal in a batch: left padding), 0 without MLA layers."""
    return next((layer.length for layer in state.layers if isinstance(layer, MLACache)), 0)


class _Graph:
    """One recorded decode step: its input buffers, the MLA storage it appends into, and its outputs."""

    def __init__(self, step: Step, capture: Capture, input_ids: Tensor, state: DecoderState) -> None:
        length = mla_length(state)
        self.stores = [_zeroed(Storage.holding(layer, length + 1)) if isinstance(layer, MLACache) else None
                       for layer in state.layers]
        self.end = torch.tensor(length, dtype=torch.long, device=input_ids.device)
        self.ids = input_ids.clone(memory_format=torch.contiguous_format)
        layers = [_copy(layer) if store is None else MLAWindow(store.latent, store.shared_key, self.end)
                  for layer, store in zip(state.layers, self.stores, strict=True)]
        for store in filter(None, self.stores):
            for t in (store.latent, store.shared_key):
                torch._dynamo.maybe_mark_dynamic(t, 1)  # one traced function for every capacity
        self.inputs = DecoderState(layers, _copy(state.depth), 0, _copy(state.padding))
        self.outputs, self.replay = capture(lambda: step(self.ids, self.inputs))

    def continues(self, state: DecoderState) -> bool:
        """Whether ``state``'s MLA caches are the longest views of this graph's storage, with room for one more."""
        return all(store is None or layer.storage is store and store.length == layer.length
                   and layer.length < store.latent.shape[1] for layer, store in zip(state.layers, self.stores))

    def step(self, input_ids: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        """Replay on ``state`` (which `continues` this graph): the logits ``[B, V]`` and the state after the token."""
        length = mla_length(state)
        self.ids.copy_(input_ids)
        for mine, theirs in zip(self.inputs.layers, state.layers, strict=True):
            if isinstance(mine, KDAState):
                mine.conv.copy_(theirs.conv)
                mine.recurrent.copy_(theirs.recurrent)
        for mine, theirs in ((self.inputs.depth, state.depth), (self.inputs.padding, state.padding)):
            if mine is not None:
                mine.copy_(theirs)
        self.end.fill_(length)
        self.replay()
        logits, after = self.outputs
        layers = [_copy(out) if store is None else store.advance(MLACache(store.latent[:, :length + 1],
                                                                           store.shared_key[:, :length + 1]))
                  for out, store in zip(after.layers, self.stores, strict=True)]
        return logits.clone(), DecoderState(layers, _copy(after.depth), state.position + 1, state.padding)


class GraphedDecode:
    """Decode steps ``(input_ids [B, 1], state) -> (logits [B, V], state)`` replayed from recorded graphs (module
    docstring); ``capture`` records one (default: `cuda_capture`). ``captures`` and ``replays`` count its work."""

    def __init__(self, capture: Capture = cuda_capture) -> None:
        self.capture = capture
        self.graphs: dict[tuple, _Graph] = {}
        self.captures = self.replays = 0

    def __call__(self, input_ids: Tensor, state: DecoderState, step: Step) -> tuple[Tensor, DecoderState]:
        """``step`` on ``state``: a replay of the graph this state continues, else of one ``step`` is recorded into
        now (``step`` must take `MLAWindow` caches; it is traced or compiled once per new shape, outside the graph)."""
        if state.replay is not None or input_ids.shape != (state.batch_size, 1):
            raise ValueError("GraphedDecode: one token per row of a state without a pending replay")
        key = (state.batch_size, state.depth is None, state.padding is None, torch.is_inference_mode_enabled(),
               tuple(None if isinstance(layer, MLACache) else layer.recurrent.dtype for layer in state.layers))
        graph = self.graphs.get(key)
        if graph is None or not graph.continues(state):
            self.graphs.pop(key, None)  # its buffers go before the new graph's are made
            graph = self.graphs[key] = _Graph(step, self.capture, input_ids, state)
            self.captures += 1
        self.replays += 1
        return graph.step(input_ids, state)

    def clear(self) -> None:
        """Drop every graph (the weights they were recorded with changed)."""
        self.graphs.clear()


def _zeroed(store: Storage) -> Storage:
    """``store`` with the positions past its entries zeroed: attention over a window multiplies them by 0, which an
    uninitialised NaN would survive."""
    store.latent[:, store.length:].zero_()
    store.shared_key[:, store.length:].zero_()
    return store


def _copy(value):  # noqa: ANN001, ANN202
    """A contiguous copy of a tensor or of a KDA state's tensors (None stays None)."""
    if value is None:
        return None
    if isinstance(value, KDAState):
        return replace(value, conv=_copy(value.conv), recurrent=_copy(value.recurrent))
    return value.clone(memory_format=torch.contiguous_format)
