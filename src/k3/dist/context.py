"""Context parallelism (SPEC §8; issue 17, item 4): a sequence cut into contiguous segments, one per rank.

The recurrence. A segment acts on its incoming state as ``S ↦ M S + U`` (`k3.ops.kda.segment_summary`), a summary
of fixed size — ``H·K·(K + V)`` scalars per sequence whatever the segment's length. Every rank computes its own,
all ranks all-gather them, and rank r composes the summaries of ranks ``0 … r−1`` (in fp32, or fp64 for fp64
inputs) onto the initial state to get its incoming state, then runs `k3.ops.kda.chunked` on its segment from it.
Bytes moved per layer: ``world × H·K·(K + V) × 4`` per sequence — independent of the sequence length.

The ShortConv. Rank r's first outputs need the ``W − 1`` inputs before its segment (its halo), which may span
several earlier ranks when segments are shorter than the window (fla PR#774's case): every rank all-gathers the
last ``W − 1`` rows of its segment (zero-padded) with their count, and each builds its halo from the ranks before
it, nearest first; zeros where the sequence starts.

MLA. Every rank all-gathers its tokens' cache entries (``kv_lora_rank + qk_shared_head_dim`` scalars per token, 576
for the release: the compressed cache, not per-head keys and values), padded to the longest segment, and attends
over the earlier ranks' entries followed by its own (`k3.model.sequence.mla.GatedMLA` with that prefix as its
cache). Bytes moved per layer: ``world × max segment × 576 × dtype`` per sequence — linear in the length, but 53×
less than gathering expanded keys and values.

Backward is exact on every rank (not only the last, fla#1115's case): the gathers are `all_gather_grad`, whose
backward sums each rank's gradient with respect to every gathered piece (an all-reduce) and returns the owner's
share — gloo has no reduce-scatter and no list all-to-all, so this is the portable form. A collective's backward
must run on every rank, also where the local result does not depend on the other ranks' pieces (rank 0's
incoming state, say): each result is therefore tied to all the pieces it gathered with weight zero (`_tied`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from k3.model.sequence.kda import KDALayer
from k3.model.sequence.mla import GatedMLA, MLACache
from k3.ops import kda


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group) -> tuple[Tensor, ...]:  # noqa: ANN001
        ctx.group = group
        pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, x.contiguous(), group=group)
        return tuple(pieces)

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple[Tensor, None]:  # noqa: ANN001
        total = torch.stack([g.contiguous() for g in grads])
        dist.all_reduce(total, group=ctx.group)  # every rank's gradient with respect to every piece, summed
        return total[dist.get_rank(ctx.group)], None


def all_gather_grad(x: Tensor, group: dist.ProcessGroup | None = None) -> list[Tensor]:
    """Every rank's ``x`` (same shape on all ranks), differentiable: the gradient of this rank's ``x`` is the sum
    over ranks of their gradients with respect to it. With grad enabled the backward takes part on every rank,
    also one whose ``x`` is a constant (an empty segment's summary)."""
    if torch.is_grad_enabled() and not x.requires_grad:
        x = x.detach().requires_grad_()
    return list(_AllGather.apply(x, group))


def _tied(result: Tensor, pieces: list[Tensor]) -> Tensor:
    """``result`` unchanged, made to depend on every gathered piece (weight zero), so the gather's backward — a
    collective — runs on every rank whatever the loss uses."""
    return result + 0.0 * torch.stack(pieces).sum().to(result.dtype)


def conv_halo(x: Tensor, width: int, group: dist.ProcessGroup | None = None) -> Tensor:
    """The ``width − 1`` inputs before this rank's segment ``x`` ``[B, T, C]`` → ``[B, width − 1, C]`` (zeros
    before the sequence's start), gathered from the ranks before it however short their segments are."""
    B, T, C = x.shape
    need = width - 1
    tail = x[:, max(0, T - need):]
    tail = torch.cat([x.new_zeros(B, need - tail.shape[1], C), tail], dim=1)  # right-aligned, zero-padded
    tails = all_gather_grad(tail, group)
    counts = torch.tensor([min(T, need)], device=x.device)
    sizes = [torch.empty_like(counts) for _ in tails]
    dist.all_gather(sizes, counts, group=group)
    rows, have = [], 0
    for r in range(dist.get_rank(group) - 1, -1, -1):  # nearest earlier rank first
        take = min(int(sizes[r]), need - have)
        if take:
            rows.insert(0, tails[r][:, need - take:])
            have += take
        if have == need:
            break
    return _tied(torch.cat([x.new_zeros(B, need - have, C), *rows], dim=1), tails)


def kda_context_parallel(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None = None,
                         initial_state: Tensor | None = None, chunk_size: int = 64,
                         group: dist.ProcessGroup | None = None) -> tuple[Tensor, Tensor]:
    """KDA over a sequence split across the ranks of ``group`` in order: this rank's segment ``q, k, g [B, T_r, H,
    K]``, ``v [B, T_r, H, V]``, ``beta [B, T_r, H]`` (``T_r`` may differ between ranks, 0 included) →
    ``(o [B, T_r, H, V], final state of the whole sequence [B, H, K, V])``, equal to `k3.ops.kda.chunked` on the
    whole sequence. ``initial_state`` (the state before rank 0's segment) must be the same on every rank."""
    M, U = kda.segment_summary(k, g, beta, v, chunk_size)
    B, H, K, V = U.shape
    pieces = all_gather_grad(torch.cat([M.flatten(2), U.flatten(2)], dim=-1), group)  # one collective
    summaries = [(p[..., :K * K].view(B, H, K, K), p[..., K * K:].view(B, H, K, V)) for p in pieces]
    S = M.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(M.dtype)
    rank = dist.get_rank(group)
    for M_r, U_r in summaries[:rank]:
        S = M_r @ S + U_r
    o, _ = kda.chunked(q, k, v, g, beta, scale, initial_state=S, chunk_size=chunk_size)
    final = S
    for M_r, U_r in summaries[rank:]:
        final = M_r @ final + U_r
    return _tied(o, pieces), _tied(final, pieces)


def mla_context_parallel(layer: GatedMLA, x: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """``layer`` (causal MLA) over a sequence split across the ranks of ``group`` in order: this rank's segment ``x``
    ``[B, T_r, d]`` (``T_r`` may differ, 0 included) → its output ``[B, T_r, d]``, equal to ``layer`` on the whole
    sequence."""
    B, T, _ = x.shape
    mine = layer.cache_entries(x)
    entries = torch.cat([mine.latent, mine.shared_key], dim=-1)  # [B, T, r + s]
    lengths = [torch.empty(1, dtype=torch.long, device=x.device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(lengths, torch.tensor([T], device=x.device), group=group)
    longest = max(int(n) for n in lengths)
    padded = torch.cat([entries, entries.new_zeros(B, longest - T, entries.shape[-1])], dim=1)
    pieces = all_gather_grad(padded, group)
    prefix = torch.cat([padded[:, :0], *(p[:, :int(n)] for p, n in zip(pieces[:dist.get_rank(group)], lengths))],
                       dim=1)  # rank 0: empty
    if T == 0:
        return _tied(x.new_zeros(B, 0, x.shape[-1]), pieces)
    cache = MLACache(*prefix.to(mine.latent.dtype).split([mine.latent.shape[-1], mine.shared_key.shape[-1]], -1))
    y, _ = layer(x, state=cache, path="full")
    return _tied(y, pieces)


class ContextParallel:
    """The sequence mixers of `k3.model.lm.K3ForCausalLM` over a sequence split across the ranks of ``group``
    (``model(input_ids, context=ContextParallel(group))``, each rank passing its own contiguous segment): token-wise
    layers run on the segment alone, each KDA and MLA layer through this object. Layer for layer the outputs (and,
    by backward, the gradients) are the whole-sequence model's."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group

    def kda(self, layer: KDALayer, x: Tensor) -> Tensor:
        """One KDA layer on this rank's segment ``x`` ``[B, T_r, d]``: the ShortConv continues from the halo of the
        earlier ranks' projected inputs, the recurrence from the composed summaries (`kda_context_parallel`)."""
        projected = layer.projections(x)
        halo = conv_halo(projected.conv_in, layer.conv.weight.shape[1], self.group)
        f, _ = layer.features(projected, halo)
        o, _ = kda_context_parallel(f.q, f.k, f.v, f.g, f.beta, chunk_size=layer.chunk_size, group=self.group)
        return layer.readout(projected, o)

    def mla(self, layer: GatedMLA, x: Tensor) -> Tensor:
        """One MLA layer on this rank's segment (`mla_context_parallel`)."""
        return mla_context_parallel(layer, x, self.group)
