"""Per-request sampling parameters and logits processing (issue 12): what the engine does with one row of logits.

`process` turns the model's logits for one request into the logits it samples from, in this order:
``logit_bias`` (added), ``repetition_penalty`` (vLLM / Hugging Face: over prompt and output tokens, positive
logits divided by it, negative ones multiplied), ``frequency_penalty`` and ``presence_penalty`` (OpenAI: over
output tokens, ``−f·count − p·[count > 0]``), ``min_tokens`` (the stop ids are forbidden until that many tokens
were generated; not under a grammar, whose end ends the answer) and a grammar ``constraint``
(`k3.serve.engine.structured`). `choose` then takes the argmax
(``temperature == 0``) or samples with temperature, ``min_p``, ``top_k`` and ``top_p``
(`k3.generation.sample_next`). Everything is per row, so a request's tokens do not depend on its batch
neighbours, and a seeded request is reproducible.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from k3.generation import sample_next

__all__ = ["SamplingParams", "TokenLogprob", "check_allowed", "choose", "process", "score_prompt"]


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the most likely alternatives, best first
    rank: int | None = None  # 1 + the number of more likely tokens (reported for prompt tokens)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. ``temperature == 0`` is greedy; ``logprobs=k`` reports the chosen token's
    log-probability and the k most likely alternatives (None: off); ``prompt_logprobs=k`` the same for every
    prompt token after the first. ``max_tokens=0`` only scores the prompt. ``constraint`` makes a fresh grammar
    matcher per request (`k3.serve.engine.structured`)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    constraint: Callable[[], Any] | None = None
    cache_salt: str | None = None  # requests share cached prefixes only under the same salt (`k3.serve.engine.cache`)

    def check(self, vocab_size: int) -> None:
        """Raise ValueError naming the first invalid field."""
        def bad(name: str, want: str) -> ValueError:
            return ValueError(f"{name}: expected {want}, got {getattr(self, name)!r}")

        def integer(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def number(x: object, low: float, high: float) -> bool:
            return isinstance(x, int | float) and not isinstance(x, bool) and low <= x <= high

        if not integer(self.max_tokens) or self.max_tokens < 0:
            raise bad("max_tokens", "a non-negative integer")
        for name, low, high in (("temperature", 0, 100), ("min_p", 0, 1), ("presence_penalty", -2, 2),
                                ("frequency_penalty", -2, 2)):
            if not number(getattr(self, name), low, high):
                raise bad(name, f"a number in [{low}, {high}]")
        if not number(self.top_p, 0, 1) or self.top_p == 0:
            raise bad("top_p", "a number in (0, 1]")
        if not number(self.repetition_penalty, 0, 100) or self.repetition_penalty == 0:
            raise bad("repetition_penalty", "a number in (0, 100]")
        if not integer(self.top_k) or self.top_k < 0:
            raise bad("top_k", "a non-negative integer (0 = off)")
        if not integer(self.min_tokens) or not 0 <= self.min_tokens <= max(self.max_tokens, 0):
            raise bad("min_tokens", f"an integer in [0, max_tokens={self.max_tokens}]")
        if self.seed is not None and not integer(self.seed):
            raise bad("seed", "an integer or None")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "non-empty strings")
        if not all(integer(t) and 0 <= t < vocab_size for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"token ids in [0, {vocab_size})")
        if not all(integer(t) and 0 <= t < vocab_size and number(b, -100, 100) for t, b in self.logit_bias):
            raise bad("logit_bias", f"token ids in [0, {vocab_size}) with biases in [-100, 100]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not integer(value) or not 0 <= value <= 20):
                raise bad(name, "an integer in [0, 20] or None")

    @property
    def processed(self) -> bool:
        """Whether `process` changes anything (greedy rows without it take the batch's argmax)."""
        return bool(self.logit_bias or self.repetition_penalty != 1 or self.presence_penalty
                    or self.frequency_penalty or self.min_tokens or self.constraint is not None)


def process(row: Tensor, params: SamplingParams, prompt: Sequence[int], output: Sequence[int],
            constraint: Any | None = None) -> Tensor:
    """The logits one request samples from: ``row`` ``[V]`` (float32) after the module docstring's steps."""
    row = row.clone()
    if params.logit_bias:
        ids, biases = zip(*params.logit_bias)
        row[list(ids)] += torch.tensor(biases, dtype=row.dtype, device=row.device)
    if params.repetition_penalty != 1:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long, device=row.device)
        values = row[seen]
        row[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and output:
        counts = torch.bincount(torch.tensor(output, device=row.device), minlength=row.shape[0])[: row.shape[0]]
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    if len(output) < params.min_tokens and params.stop_token_ids and constraint is None:
        row[list(params.stop_token_ids)] = float("-inf")
    # an extreme penalty (repetition_penalty near 0) can overflow: keep every value ordered and finite or -inf
    row = torch.nan_to_num(row, nan=float("-inf"), posinf=torch.finfo(row.dtype).max, neginf=float("-inf"))
    if constraint is not None:
        constraint.mask_(row)
    return row


def check_allowed(row: Tensor) -> None:
    """Raise ValueError when processed logits ``row`` leave no token to choose (every logit is -inf)."""
    if not bool(torch.isfinite(row).any()):
        raise ValueError("no token is allowed here (every logit is -inf after processing)")


def choose(row: Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The next token from processed logits ``row`` ``[V]``: argmax at temperature 0, else a sample."""
    check_allowed(row)
    if params.temperature == 0:
        return int(row.argmax())
    return int(sample_next(row[None], params.temperature, params.top_p, params.top_k, generator, params.min_p))


def score_prompt(prompt: Sequence[int], logits: Tensor, start: int, k: int) -> list[TokenLogprob]:
    """Log-probabilities (with the ``k`` most likely alternatives and the rank) of the prompt tokens that the
    positions ``start..`` of a prefill chunk predict, from that chunk's logits ``[T, V]``."""
    logprobs = logits.float().log_softmax(-1)
    out = []
    for t in range(logits.shape[0]):
        if start + t + 1 < len(prompt):
            target = prompt[start + t + 1]
            top = logprobs[t].topk(k) if k else None
            value = logprobs[t, target]
            out.append(TokenLogprob(target, float(value), () if top is None else tuple(
                zip(top.indices.tolist(), top.values.tolist())), 1 + int((logprobs[t] > value).sum())))
    return out
