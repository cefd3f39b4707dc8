"""Prompt-lookup (n-gram) drafting for speculative decoding (SPEC §8, issue 36; vLLM's ``ngram`` method).

Code edits, retrieval-augmented answers and agent turns repeat their input. `NGramDrafter` needs no model: for a
request's tokens so far (prompt, output and the pending token) it finds the most recent earlier occurrence of the
longest suffix of ``max_n`` down to ``min_n`` tokens and proposes the γ tokens that followed it. When the match runs
into the suffix itself the sequence repeats with period (end − match), and the proposal continues that repetition.

Its drafts are deterministic, so ``q`` is one-hot at each proposed token: the lossless rule accepts ``d_i`` with
probability ``p_i(d_i)`` and on rejection samples ``p_i`` with ``d_i`` removed — exact for sampled requests too.

Work per step is bounded: each request keeps its tokens and an index of every n-gram (``min_n`` ≤ n ≤ ``max_n``) →
the end of its latest occurrence, both extended by the tokens that arrived since the last step (read from a view of
the request's tokens, `k3.serve.engine.request.Joined`; ``max_n − min_n + 1`` dictionary writes per token), so a
lookup is ``max_n − min_n + 1`` dictionary reads whatever the context length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from k3.serve.engine.drafting import Draft
from k3.serve.engine.sampling import SamplingParams

__all__ = ["NGramDrafter"]


@dataclass
class _Index:
    """A request's n-gram index over its first ``indexed`` positions: n-gram → end of its latest occurrence; and
    the request's tokens so far (`propose` copies only those that arrived since its last call)."""

    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0
    tokens: list[int] = field(default_factory=list)


class NGramDrafter:
    """Prompt-lookup drafts (module docstring). ``cost`` is the stated price of a drafted position relative to a
    plain decode step, for the adaptive draft length (`k3.serve.engine.payoff`): drafting is a few dictionary reads,
    so only the verified position's share of the target pass is charged."""

    feature_layers = feature_source = None
    cost = 0.1
    free = True  # a lookup: a paused request keeps proposing, checked against the target's own tokens

    MAX_N, MIN_N = 4, 3  # the lookup's default bounds (`k3.serve.options`: --prompt-lookup-max/-min; README)

    def __init__(self, max_n: int = MAX_N, min_n: int = MIN_N) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram: need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n
        self._indexes: dict[str, _Index] = {}

    def lookup(self, request_id: str, tokens: Sequence[int], gamma: int) -> list[int]:
        """Up to ``gamma`` tokens that followed the latest earlier occurrence of the longest matching suffix of
        ``tokens`` (empty when no suffix of ``min_n`` or more tokens occurred before)."""
        index = self._indexes.setdefault(request_id, _Index())
        end = len(tokens)
        for stop in range(index.indexed + 1, end):  # n-grams ending before the last position (not the suffix)
            for n in range(self.min_n, min(self.max_n, stop) + 1):
                index.ends[tuple(tokens[stop - n:stop])] = stop
        index.indexed = max(index.indexed, end - 1)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            match = index.ends.get(tuple(tokens[end - n:]))
            if match is not None:
                out: list[int] = []
                for k in range(gamma):  # past the end, the repetition of period end − match continues
                    out.append(tokens[match + k] if match + k < end else out[match + k - end])
                return out
        return []

    def warm_up(self, gamma: int) -> None:
        """Nothing compiles."""

    def observe(self, request_id: str, tokens: list[int], features: torch.Tensor | None) -> None:
        """Nothing to read: `propose` is given the request's tokens."""

    def propose(self, request_id: str, history: Sequence[int], pending: int, params: SamplingParams,
                prompt: list[int], output: list[int], generator: torch.Generator | None, gamma: int) -> Draft | None:
        mirror = self._indexes.setdefault(request_id, _Index()).tokens
        mirror += history[len(mirror):]  # a request's history only grows
        mirror.append(pending)
        try:
            tokens = self.lookup(request_id, mirror, gamma)
        finally:
            mirror.pop()
        return Draft(tokens) if tokens else None  # deterministic: q is one-hot at the tokens

    def accept(self, request_id: str, accepted: int) -> None:
        """Nothing to undo: the next lookup reads the tokens the request kept."""

    def end(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    def save(self, request_id: str, key: bytes) -> None:
        """Nothing to keep: the index is rebuilt from the tokens."""

    def restore(self, request_id: str, key: bytes) -> None:
        """Nothing to restore (`save`)."""
