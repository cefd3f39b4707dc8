"""A request in the engine (SPEC §8): what a caller hands the engine, what the engine keeps per request while it
runs, and what it reports back after every step (`Output`).

`Request` is the one per-request record the engine's seams share (vLLM v1 keeps the same shape): the scheduler
moves it between waiting and running and advances its prefill, the runner reads its state and tokens, the
sampler its parameters and generator, the outputs its processor and stop-string hold-back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from k3.model.state import DecoderState
from k3.serve.engine.sampling import SamplingParams, TokenLogprob
from k3.tokenization.bpe import Tokenizer
from k3.tokenization.detok import IncrementalDetokenizer
from k3.tokenization.image import VisualInput

__all__ = ["ContextLengthExceeded", "Joined", "Output", "Processor", "QueueFull", "Request", "TextProcessor",
           "new_request"]


@dataclass
class Output:
    """What one step produced for one request: text deltas per channel, the new token ids, and,
    on the last output, ``finish_reason`` ("stop", "length", "abort" or "error" with ``error``; ``invalid`` when the
    request's own input caused it, a grammar that failed while generating).
    ``prompt_logprobs`` (one per prompt token, None for the first) comes once, with the first output after
    the prompt was read; ``cumulative_logprob`` sums the generated tokens' log-probabilities so far."""

    request_id: str
    deltas: list[tuple[str, str]]
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None = None
    error: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cumulative_logprob: float = 0.0
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache
    invalid: bool = False


class Processor(Protocol):
    """Turns generated ids into ``(channel, text)`` deltas; ``channel`` is where the next text goes (a grammar
    constrains only the answer: "text" or "content", `k3.chat.Parser`)."""

    channel: str | None

    def feed(self, token_id: int) -> list[tuple[str, str]]: ...

    def flush(self) -> list[tuple[str, str]]: ...


class TextProcessor:
    """Plain completions: one "text" channel; special tokens produce no text unless ``skip_special_tokens`` is
    False (then their literals)."""

    channel = "text"

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._special = set(tokenizer.special_ids.values()) if skip_special_tokens else set()
        self._detok = IncrementalDetokenizer(tokenizer)

    def feed(self, token_id: int) -> list[tuple[str, str]]:
        if token_id in self._special:
            return []
        text = self._detok.push(token_id)
        return [("text", text)] if text else []

    def flush(self) -> list[tuple[str, str]]:
        text = self._detok.flush()
        return [("text", text)] if text else []


class ContextLengthExceeded(ValueError):
    """A prompt plus ``max_tokens`` longer than the model's context length."""

    def __init__(self, prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
        self.prompt_tokens, self.max_tokens, self.max_model_len = prompt_tokens, max_tokens, max_model_len
        super().__init__(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                         f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} in the "
                         f"completion). Please reduce the prompt or max_tokens.")


class QueueFull(RuntimeError):
    """The engine's waiting queue cannot take the requests; ``retry_after`` is a suggested wait in seconds."""

    def __init__(self, waiting: int, wanted: int, limit: int, retry_after: int) -> None:
        self.retry_after = retry_after
        super().__init__(f"the server is busy: {waiting} requests are waiting and this request needs {wanted} more "
                         f"places (the queue holds {limit}); retry after {retry_after} s")


class Joined(Sequence[int]):
    """Token lists read as their concatenation, its first ``length`` tokens, without copying them: a request's
    context for a drafter costs O(1) to make and O(k) to read k tokens of, whatever the context's length."""

    def __init__(self, parts: tuple[Sequence[int], ...], length: int | None = None) -> None:
        total = sum(map(len, parts))
        self.parts, self.length = parts, total if length is None else min(length, total)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self.length)
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            out: list[int] = []
            for part in self.parts:  # each part's overlap with [start, stop), offsets moving past it
                out += part[max(start, 0):max(min(stop, len(part)), 0)]
                start, stop = start - len(part), stop - len(part)
            return out
        if not -self.length <= index < self.length:
            raise IndexError("Joined index out of range")
        index %= self.length
        for part in self.parts:
            if index < len(part):
                return part[index]
            index -= len(part)
        raise AssertionError("unreachable: the length is within the parts")


@dataclass(eq=False)
class Request:
    """One request while the engine holds it (compared by identity: an id may be reused once it has ended)."""

    id: str
    group: str
    prompt: list[int]
    params: SamplingParams
    processor: Processor
    callback: Callable[[Output], None]
    generator: torch.Generator | None
    state: DecoderState | None = None
    prefilled: int = 0
    pending: int | None = None  # the last sampled token, to be fed at the next decode
    output_ids: list[int] = field(default_factory=list)
    held: tuple[str, str] | None = None  # (channel, text) withheld while it may start a stop string
    constraint: Any | None = None  # the request's grammar matcher (`k3.serve.engine.structured`)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # filled while the prompt is read, sent once
    cumulative_logprob: float = 0.0
    cached: int = 0  # prompt tokens restored from the prefix cache
    pins: list = field(default_factory=list)  # prefix-cache entries held while the request runs
    cuts: list[int] = field(default_factory=list)  # prompt positions checkpointed in the prefix cache
    marks: tuple[int, ...] = ()  # prompt positions the caller asks to checkpoint (a chat's shared head)
    resumed: bytes | None = None  # the key of the prefix-cache checkpoint the request resumed from
    boundary: DecoderState | None = None  # the recurrent state at the last block boundary decoding landed on
    images: list[VisualInput] | None = None  # what fills the prompt's media placeholders, in order
    image_key: str | None = None  # digest of the prompt's images: prefixes are shared only with the same images
    embeds: Tensor | None = None  # [T, d] prompt embeddings with the images encoded in (at the first prefill)

    @property
    def salt(self) -> str | None:
        """The prefix-cache salt: the request's ``cache_salt``, and its images (the placeholder ids alone do not
        say which image fills them)."""
        if self.image_key is None:
            return self.params.cache_salt
        return f"{self.params.cache_salt or ''}|images:{self.image_key}"

    @property
    def history(self) -> Joined:
        """The tokens the state has read or will read before ``pending``: the prompt and the output but its last
        token (``pending`` itself), as a view (`Joined`)."""
        return Joined((self.prompt, self.output_ids), len(self.prompt) + len(self.output_ids) - 1)

    @property
    def prompt_done(self) -> bool:
        return self.prefilled == len(self.prompt)

    def cuts_inside(self, tokens: int) -> list[int]:
        """The cuts a prefill piece of ``tokens`` from here passes (not the one it ends at): their checkpoints are
        rolled back from the piece's `Replay` (`Scheduler.update`)."""
        return [c for c in self.cuts if self.prefilled < c < self.prefilled + tokens]


def new_request(prompt: list[int], params: SamplingParams, processor: Processor | None,
                callback: Callable[[Output], None] | None, request_id: str, group: str, tokenizer: Tokenizer,
                vocab_size: int, max_model_len: int, device: torch.device | None = None) -> Request:
    """A checked `Request`: a non-empty prompt of ids in ``[0, vocab_size)``, valid parameters, and room for
    ``max_tokens`` in the context (`ContextLengthExceeded`); otherwise a ValueError naming the field. A sampling
    request's generator is on ``device`` (the model's): a seed gives the same tokens on the same kind of device."""
    if not isinstance(prompt, list) or not prompt:
        raise ValueError("prompt: expected a non-empty list of token ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in prompt):
        raise ValueError(f"prompt: token ids must be integers in [0, {vocab_size})")
    params.check(vocab_size)
    if len(prompt) + params.max_tokens > max_model_len:
        raise ContextLengthExceeded(len(prompt), params.max_tokens, max_model_len)
    generator = None
    if params.temperature > 0:
        generator = torch.Generator(device=device)  # on the model's device, where the sampled rows are
        generator.manual_seed(params.seed % 2**64) if params.seed is not None else generator.seed()
    return Request(request_id, group, list(prompt), params, processor or TextProcessor(tokenizer),
                   callback or (lambda _: None), generator,
                   constraint=None if params.constraint is None else params.constraint(),
                   prompt_logprobs=None if params.prompt_logprobs is None else [None])
