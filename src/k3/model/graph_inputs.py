"""How a step's state enters a compiled graph (`k3.model.compiled_step`): MLA caches as `MLASlots` the graph writes its
new entries into, with their length dimensions marked dynamic, and every other tensor with a fresh tensor's strides
and the grad mode's kind, so that dynamo's guards hold across calls."""

from __future__ import annotations

from dataclasses import fields, replace

import torch
from torch import Tensor

from k3.model.sequence.kda import KDAState
from k3.model.sequence.mla import MLACache, MLASlots
from k3.model.state import DecoderState

__all__ = ["cache_slots", "canonical", "graph_state"]


def graph_state(state: DecoderState, slots: list) -> DecoderState:
    """``state`` as a graph input, its layers ``slots`` (`cache_slots`): no position (bookkeeping outside the
    graph), MLA slots without their Python bookkeeping, the rest canonical."""
    depth, padding = (None if t is None else canonical(t) for t in (state.depth, state.padding))
    return DecoderState([_graph_input(layer) for layer in slots], depth, 0, padding)


def cache_slots(state: DecoderState, tokens: int) -> list:
    """Each MLA layer's cache as `MLASlots` with room for ``tokens`` entries (the graph writes them in place), all of
    one capacity (a graph's symbolic sizes of equal values are one symbol, which later calls must keep equal)."""
    slots = [layer.slots(tokens) if isinstance(layer, MLACache) else layer for layer in state.layers]
    if len({s.latent_storage.shape[1] for s in slots if isinstance(s, MLASlots)}) > 1:
        slots = [MLACache(s.latent, s.shared_key).slots(tokens) if isinstance(s, MLASlots) else s for s in slots]
    return slots


def _graph_input(layer: KDAState | MLASlots) -> KDAState | MLASlots:
    """A layer's state as a graph input: `MLASlots` without its Python bookkeeping, the storage's length dimension
    and the length carrier marked dynamic; a KDA state with canonical strides."""
    if not isinstance(layer, MLASlots):
        return replace(layer, **{f.name: canonical(getattr(layer, f.name)) for f in fields(layer)})
    for t in (layer.latent_storage, layer.key_storage):
        torch._dynamo.maybe_mark_dynamic(t, 1)
    torch._dynamo.maybe_mark_dynamic(layer.filled, 0)
    return replace(layer, storage=None)


def canonical(t: Tensor) -> Tensor:
    """``t`` with a fresh tensor's strides (dynamo guards on every stride, size-1 dimensions' included): a slice of
    a prompt or a ShortConv window cut from a chunk would otherwise make a graph of its own; and a tensor of the grad
    mode's kind (an inference tensor inside `torch.inference_mode`, a normal one outside: dynamo guards on that too),
    so a state made in one mode and stepped in the other runs on warm graphs."""
    expected, step = [], 1
    for size in reversed(t.shape):
        expected.append(step)
        step *= size
    fresh = t.stride() == tuple(reversed(expected)) and t.is_inference() == torch.is_inference_mode_enabled()
    return t if fresh else t.clone(memory_format=torch.contiguous_format)
