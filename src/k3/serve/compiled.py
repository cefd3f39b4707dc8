"""The serving engine's compiled decode step (issue 18): `k3.model.compiled.CompiledDecode` over bucketed batches.

A step whose rows all decode one token (no prefill chunk, no speculation) runs the compiled graph. Its batch is
padded up to the next of `BUCKETS` with copies of its first row (vLLM's capture sizes), so requests joining and
leaving never trigger a compilation beyond one per bucket; the copies' outputs are dropped. A batch larger than
the largest bucket compiles for its own size.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3.model.compiled import CompiledDecode
from k3.model.lm import K3ForCausalLM
from k3.model.state import DecoderState

BUCKETS = (1, 2, 4, 8, 16, 32)


class BucketedDecode:
    """``decode(input_ids [B, 1], state) -> (logits [B, V], state)`` for a stacked decode batch, compiled."""

    def __init__(self, model: K3ForCausalLM, buckets: tuple[int, ...] = BUCKETS) -> None:
        self.step = CompiledDecode(model)
        self.buckets = tuple(sorted(buckets))

    def bucket(self, batch: int) -> int:
        return next((b for b in self.buckets if b >= batch), batch)

    def __call__(self, input_ids: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        batch = input_ids.shape[0]
        extra = self.bucket(batch) - batch
        if extra:
            first = state.select(slice(0, 1))
            state = DecoderState.stack([state, *[first] * extra])
            input_ids = torch.cat([input_ids, input_ids[:1].expand(extra, 1)])
        logits, after = self.step(input_ids, state)
        return logits[:batch, -1], after.select(slice(0, batch)) if extra else after
