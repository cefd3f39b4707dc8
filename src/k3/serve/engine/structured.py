"""Constrained decoding for structured output: OpenAI ``response_format`` (``json_object``, ``json_schema``) and forced
tool calls, as a per-request token mask over the model's logits.

``json_constraint(tokenizer, schema, stop_ids)`` compiles a JSON schema once (``None``: any JSON object) and returns a
factory of fresh per-request :class:`Constraint` objects. Each decode step the engine calls ``mask_`` on that request's
logits row, samples, then passes the token to ``accept``; once the value is complete only ``stop_ids`` stay allowed and
``done()`` is true (the engine may finish there without sampling a stop token; a value that could still grow, such as a
top-level number, lets the stop ids in beside its continuations). ``mask_`` raises ``RuntimeError`` if llguidance hits
one of its per-step resource limits (a pathological schema): fail that request. Compiled grammars are cached per
tokenizer object (an LRU of :data:`MAX_CACHED_GRAMMARS` canonical schemas; the key is the schema's compact JSON with its
key order kept, since property order is generation order).

Grammar engine: llguidance, chosen by ``benchmarks/structured.py`` (``benchmarks/results/structured.json``) against
xgrammar 0.2.9 and outlines-core 0.2.14: 2 CPU cores, random-logit walks over 4 schemas (any object, flat, nested,
tool arguments), per token the engine's mask computation + accept, median; one decode step of the ``small`` preset
(batch 1, 64-token prompt) took 11.7 ms there.

===============  ===============  ===============  ===============  ===============
engine           compile, 4k ids  compile, 56k     µs/token, 4k     µs/token, 56k
===============  ===============  ===============  ===============  ===============
llguidance       0.4-0.7 ms       0.4-0.7 ms       3.0-10.3         5.4-14.6
xgrammar         1.8-3.0 ms       15-20 ms         7.8-13.6         30-54
outlines-core    14-97 ms         0.3-1.7 s        1.7-5.6          3.5-60
===============  ===============  ===============  ===============  ===============

(``json_object`` is included for llguidance and xgrammar; outlines-core takes 39-43 s to compile it.)

Through this module (``mask_`` + ``accept``, so also writing the mask onto the logits row) llguidance costs 14-23 µs
per token at 4k ids (0.12-0.20 % of that decode step) and 54-62 µs at 56k (about 0.5 %), mostly the bit expansion.

* Overhead: llguidance computes masks lazily (Earley parser over a derivative-based lexer, with a token trie), so a
  schema compiles in under a millisecond with no per-vocabulary precomputation and a token costs a few µs, nearly
  flat in the vocabulary size; xgrammar precomputes per-rule masks (compile and mask grow with the vocabulary);
  outlines-core builds a whole regex DFA index per schema (compile grows with the schema: tens of seconds for the
  depth-limited ``json_object`` regex, since a regex cannot nest without bound).
* Batching: one matcher per request, a mask per row; a fresh matcher is a ``deep_copy`` of the compiled template
  (about 1 µs). llguidance's ``LLExecutor`` can also fill a whole batch's masks on parallel threads.
* Speculative decoding: an ``LLMatcher`` can ``rollback(n)`` accepted tokens, ``deep_copy()`` (fork) and
  ``validate_tokens`` a draft, and ``LLExecutor`` fills masks along draft tokens; xgrammar has the same (``rollback``,
  ``fork``, ``traverse_draft_tree``), outlines-core only a bounded ``rollback_state``.
* Dependencies: llguidance is one self-contained wheel; xgrammar pulls in transformers, triton and tvm-ffi.

Termination: whitespace between JSON tokens is the engine's flexible set (space, tab, CR, LF) but at most
:data:`MAX_WHITESPACE` characters per gap, so a model that favours whitespace cannot loop on it: every gap is bounded
and the structure must advance. String contents stay the schema's own: a model repeating itself inside a string is
stopped by the request's ``max_tokens``, as without a schema. The options are passed as llguidance *overrides*, so a
schema's ``x-guidance`` key cannot lift the bound. Unsupported or invalid schema keywords are errors (``lenient`` off),
never silently ignored. Special tokens have no bytes (``token_bytes`` gives ``b""``), so they are never allowed inside
the value.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import llguidance
import numpy as np
import torch
from torch import Tensor

__all__ = ["MAX_CACHED_GRAMMARS", "MAX_WHITESPACE", "Constraint", "json_constraint"]

#: Most whitespace characters allowed between two JSON tokens (a pretty-printed line break plus indentation fits).
MAX_WHITESPACE = 32
#: Compiled schemas kept per tokenizer (least recently used dropped first).
MAX_CACHED_GRAMMARS = 256
_OPTIONS = {
    "whitespace_flexible": True,
    "whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{MAX_WHITESPACE}}}",
    "item_separator": ",",
    "key_separator": ":",
    "lenient": False,
    "coerce_one_of": False,
}
_ANY_OBJECT = {"type": "object"}


class Constraint(Protocol):
    """One request's grammar state."""

    def mask_(self, logits: Tensor) -> None:
        """Set every entry of ``logits`` ([V] float32, V ≥ the tokenizer's size) the grammar forbids now to -inf."""

    def accept(self, token_id: int) -> None:
        """Advance by ``token_id``; ``ValueError`` if it was not allowed."""

    def done(self) -> bool:
        """Whether a complete value has been accepted (only stop tokens remain allowed)."""


class _EncodeText:
    """What llguidance needs of a tokenizer: each id's bytes, the EOS id and ``__call__(text) -> ids``; it holds the
    tokenizer weakly, so the cache entry never keeps it alive."""

    def __init__(self, tokenizer: Any, token_bytes: list[bytes]) -> None:
        self.tokens, self.eos_token_id, self.bos_token_id = token_bytes, tokenizer.eos_id, None
        self.special_token_ids: list[int] = []  # specials have no bytes, so the engine never allows them
        self._tokenizer = weakref.ref(tokenizer)

    def __call__(self, text: str) -> list[int]:
        tokenizer = self._tokenizer()
        if tokenizer is None:
            raise RuntimeError("the tokenizer of this grammar was garbage-collected")
        return tokenizer.encode(text)


class _Vocab:
    """A tokenizer's llguidance view and its compiled grammars (LRU of templates, each ``deep_copy``-ed per request)."""

    def __init__(self, tokenizer: Any) -> None:
        token_bytes = tokenizer.token_bytes()
        self.size, self.eos = len(token_bytes), tokenizer.eos_id
        self.engine = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_EncodeText(tokenizer, token_bytes)),
                                             n_vocab=self.size)
        self.grammars: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()


_LOCK = threading.Lock()
_VOCABS: dict[int, tuple[weakref.ref, _Vocab]] = {}


def _vocab(tokenizer: Any) -> _Vocab:
    key = id(tokenizer)
    with _LOCK:
        entry = _VOCABS.get(key)
        if entry is not None and entry[0]() is tokenizer:
            return entry[1]
        vocab = _Vocab(tokenizer)
        _VOCABS[key] = (weakref.ref(tokenizer, lambda _: _VOCABS.pop(key, None)), vocab)
        return vocab


def _compile(vocab: _Vocab, canonical: str) -> llguidance.LLMatcher:
    """The cached template matcher of ``canonical`` (compiled outside the lock: llguidance releases the GIL)."""
    with _LOCK:
        template = vocab.grammars.get(canonical)
        if template is not None:
            vocab.grammars.move_to_end(canonical)
            return template
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(canonical, overrides=_OPTIONS)
    except ValueError as exc:
        raise ValueError(f"invalid JSON schema: {exc}") from exc
    template = llguidance.LLMatcher(vocab.engine, grammar, log_level=0)
    if template.is_error():
        raise ValueError(f"invalid or unsupported JSON schema: {template.get_error()}")
    with _LOCK:
        template = vocab.grammars.setdefault(canonical, template)
        vocab.grammars.move_to_end(canonical)
        while len(vocab.grammars) > MAX_CACHED_GRAMMARS:
            vocab.grammars.popitem(last=False)
    return template


def _canonical(schema: dict | None) -> str:
    if schema is None:
        schema = _ANY_OBJECT
    if not isinstance(schema, dict):
        raise ValueError(f"JSON schema must be an object, got {type(schema).__name__}")
    try:
        return json.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"JSON schema is not serialisable as JSON: {exc}") from exc


class _JsonConstraint:
    """A :class:`Constraint` over one llguidance matcher; stop tokens are handled here, not by the engine."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: _Vocab, stop_ids: tuple[int, ...]) -> None:
        self._matcher, self._size, self._eos = matcher, vocab.size, vocab.eos
        self._stop_ids, self._stops = frozenset(stop_ids), np.array(stop_ids)
        self._words = np.zeros((vocab.size + 31) // 32, dtype=np.int32)
        self._words_ptr = self._words.ctypes.data
        self._stopped = False

    def mask_(self, logits: Tensor) -> None:
        if logits.dim() != 1 or logits.shape[0] < self._size:
            raise ValueError(f"logits must be [V] with V >= {self._size}, got {tuple(logits.shape)}")
        forbidden, head = self._forbidden(), logits[:self._size].detach()
        if head.device.type == "cpu" and head.dtype == torch.float32:
            np.putmask(head.numpy(), forbidden, -np.inf)  # one thread: torch's parallel fill stalls when cores are busy
        else:
            head.masked_fill_(torch.from_numpy(forbidden).to(head.device), float("-inf"))
        if logits.shape[0] > self._size:
            logits[self._size:] = float("-inf")

    def _forbidden(self) -> np.ndarray:
        """``[size]`` bool: the tokens not allowed now (numpy: its small edits cost far less than torch's)."""
        if self.done():
            forbidden = np.ones(self._size, dtype=np.bool_)
            forbidden[self._stops] = False
            return forbidden
        self._matcher.unsafe_compute_mask_ptr(self._words_ptr, self._words.nbytes)
        if self._matcher.is_error():
            raise RuntimeError(f"structured output: grammar engine failed: {self._matcher.get_error()}")
        # bit j of little-endian mask byte k is token 8 k + j; invert the bytes, not the (8x more) bools
        forbidden = np.unpackbits(np.invert(self._words.view(np.uint8)), count=self._size, bitorder="little")
        forbidden = forbidden.view(np.bool_)
        forbidden[self._eos] = True  # the engine's own EOS bit; ours are the stop ids
        if self._matcher.is_accepting():
            forbidden[self._stops] = False
        return forbidden

    def accept(self, token_id: int) -> None:
        if self._stopped:
            raise ValueError(f"token {token_id} after a stop token")
        if token_id in self._stop_ids:
            if not self._matcher.is_accepting():
                raise ValueError(f"stop token {token_id} before the JSON value is complete")
            self._stopped = True
            return
        valid = token_id != self._eos and 0 <= token_id < self._size
        if not (valid and self._matcher.try_consume_tokens([token_id])):
            raise ValueError(f"token {token_id} is not allowed by the JSON grammar here")

    def done(self) -> bool:
        return self._stopped or self._matcher.is_stopped()


def json_constraint(tokenizer: Any, schema: dict | None, stop_ids: Sequence[int]) -> Callable[[], Constraint]:
    """Compile ``schema`` (``None``: any JSON object) for ``tokenizer`` (``token_bytes()``, ``eos_id``, ``encode``)
    once, cached; return a factory of fresh per-request constraints. After the value only ``stop_ids`` are allowed.

    ``ValueError`` naming the problem for an invalid or unsupported schema, or bad ``stop_ids``.
    """
    canonical = _canonical(schema)
    vocab = _vocab(tokenizer)
    stops = tuple(int(i) for i in stop_ids)
    if not stops or not all(0 <= i < vocab.size for i in stops):
        raise ValueError(f"stop_ids must be non-empty token ids in [0, {vocab.size}), got {list(stop_ids)}")
    template = _compile(vocab, canonical)
    return lambda: _JsonConstraint(template.deep_copy(), vocab, stops)
