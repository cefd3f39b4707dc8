"""Constrained decoding for structured output: OpenAI ``response_format`` (``json_object``, ``json_schema``) and forced
tool calls, as a per-request token mask over the model's logits.

:class:`Grammars` (one per engine: ``engine.grammars``) compiles a JSON schema once (``None``: any JSON object) and
returns a factory of fresh per-request :class:`Constraint` objects. Each decode step the engine calls ``mask_`` on that
request's logits row, samples, then passes the token to ``accept``; once the value is complete only the stop ids stay
allowed and ``done()`` is true, and the engine ends the request there (the grammar's end ends the answer, whatever
``min_tokens`` or ``ignore_eos`` say; a value that could still grow, such as a top-level number, lets the stop ids in
beside its continuations).

Bounded work (issue 35). A schema is refused (``ValueError``: the API's 400) before it costs the engine anything when
it counts beyond :data:`MAX_COUNT` (``maxLength``, ``minItems``, … or ``{n}`` in a pattern), or when, compiled first in
a child process (`k3.serve.engine.grammar_budget`), it takes more than :data:`COMPILE_SECONDS` or
:data:`COMPILE_BYTES`, has no first token mask (``{"$ref": "#"}``), or hits llguidance's limits within a short trial
walk (nested counted repetition in a ``pattern``). The grammar is then compiled here off the engine thread, its first
mask included, so nothing expensive happens lazily at a request's first step. Per step llguidance's fuel limits bound a
mask's time and :data:`LIMITS` the states its lexer may build (the memory a grammar grows while generating); a grammar
that hits one later raises :class:`GrammarError` from ``mask_`` / ``accept`` and that request alone ends with an error
naming its field. Compiled grammars are kept in an LRU bounded by bytes (each entry's measured size) and by count; the
key is the schema's compact JSON with its key order kept, since property order is generation order.

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
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import llguidance
import numpy as np
import torch
from torch import Tensor

from k3.serve.engine.grammar_budget import CompileBudget

__all__ = ["CACHE_BYTES", "COMPILE_BYTES", "COMPILE_SECONDS", "LIMITS", "MAX_CACHED_GRAMMARS", "MAX_COUNT",
           "MAX_WHITESPACE", "Constraint", "GrammarError", "Grammars"]

#: Most whitespace characters allowed between two JSON tokens (a pretty-printed line break plus indentation fits).
MAX_WHITESPACE = 32
#: Compiled schemas kept (least recently used dropped first), and the bytes they may hold together.
MAX_CACHED_GRAMMARS = 256
CACHE_BYTES = 256 * 2**20
#: A schema's compile budget: wall-clock seconds and bytes its compiled grammar may hold.
COMPILE_SECONDS = 2.0
COMPILE_BYTES = 64 * 2**20
#: Largest count a schema may ask for (``minLength`` … ``maxContains``, ``{n}`` in a pattern).
MAX_COUNT = 100_000
#: llguidance's parser limits (`llguidance.LLParserLimits`): the states a grammar's lexer may build while generating
#: (about 2 KB each: its memory bound); the per-step fuel keeps the library's defaults (about 15 ms a mask at most).
LIMITS = {"max_lexer_states": 16_384, "verbose_errors": False}
_OPTIONS = {
    "whitespace_flexible": True,
    "whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{MAX_WHITESPACE}}}",
    "item_separator": ",",
    "key_separator": ":",
    "lenient": False,
    "coerce_one_of": False,
}
_ANY_OBJECT = {"type": "object"}
_COUNTS = frozenset({"minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains",
                     "maxContains"})
_DATA = frozenset({"const", "enum", "default", "examples"})  # values, not schemas: never checked as one
_REPEAT = re.compile(r"\{(\d+)(?:,(\d*))?\}")


class GrammarError(RuntimeError):
    """A request's grammar failed while generating (it hit one of llguidance's per-step limits): the request's fault."""


class Constraint(Protocol):
    """One request's grammar state."""

    def mask_(self, logits: Tensor) -> None:
        """Set every entry of ``logits`` ([V] float32, V ≥ the tokenizer's size) the grammar forbids now to -inf."""

    def accept(self, token_id: int) -> None:
        """Advance by ``token_id``; ``ValueError`` if it was not allowed."""

    def done(self) -> bool:
        """Whether a complete value has been accepted (only stop tokens remain allowed)."""


class _EncodeText:
    """What llguidance needs of a tokenizer: each id's bytes, the EOS id and ``__call__(text) -> ids``."""

    def __init__(self, tokenizer: Any, token_bytes: list[bytes]) -> None:
        self.tokens, self.eos_token_id, self.bos_token_id = token_bytes, tokenizer.eos_id, None
        self.special_token_ids: list[int] = []  # specials have no bytes, so the engine never allows them
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text)


class _Vocab:
    """A tokenizer's llguidance view and the child process that tries its schemas first."""

    def __init__(self, tokenizer: Any, seconds: float, max_bytes: int) -> None:
        token_bytes = tokenizer.token_bytes()
        self.size, self.eos = len(token_bytes), tokenizer.eos_id
        self.engine = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_EncodeText(tokenizer, token_bytes)),
                                             n_vocab=self.size)
        self.budget = CompileBudget(token_bytes, self.eos, _OPTIONS, LIMITS, seconds, max_bytes)


class Grammars:
    """One tokenizer's JSON-schema grammars: each checked and compiled once, one compile at a time, and cached in an
    LRU of at most ``max_entries`` grammars and ``cache_bytes`` bytes (a grammar larger than that is compiled for its
    request and not kept)."""

    def __init__(self, tokenizer: Any, cache_bytes: int = CACHE_BYTES, *, seconds: float = COMPILE_SECONDS,
                 max_bytes: int = COMPILE_BYTES, max_entries: int = MAX_CACHED_GRAMMARS) -> None:
        self.tokenizer, self.cache_bytes, self.max_entries = tokenizer, cache_bytes, max_entries
        self.seconds, self.max_bytes = seconds, max_bytes
        self.bytes = 0  # what the cached grammars hold
        self._entries: OrderedDict[str, tuple[llguidance.LLMatcher, int]] = OrderedDict()
        self._lock = threading.Lock()  # the cache
        self._compiling = threading.Lock()  # one compile at a time
        self._vocab: _Vocab | None = None  # built at the first compile

    def cached(self, schema: dict | None, stop_ids: Sequence[int]) -> Callable[[], Constraint] | None:
        """`constraint`'s factory if ``schema`` is compiled already, else None (never compiles)."""
        canonical, stops = _canonical(schema), self._stops(stop_ids)
        template = self._lookup(canonical)
        return None if template is None else self._factory(template, stops)

    def constraint(self, schema: dict | None, stop_ids: Sequence[int]) -> Callable[[], Constraint]:
        """A factory of fresh constraints to ``schema`` (``None``: any JSON object) that allow only ``stop_ids`` after
        the value. ``ValueError`` naming the problem for an invalid, unsupported or too costly schema (module
        docstring) or bad ``stop_ids``."""
        canonical, stops = _canonical(schema), self._stops(stop_ids)
        template = self._lookup(canonical)
        if template is None:
            with self._compiling:
                template = self._lookup(canonical)
                if template is None:
                    template = self._compile(schema, canonical)
        return self._factory(template, stops)

    def close(self) -> None:
        """Stop the compile child process (a later compile starts another)."""
        if self._vocab is not None:
            self._vocab.budget.close()

    def _stops(self, stop_ids: Sequence[int]) -> tuple[int, ...]:
        stops = tuple(int(i) for i in stop_ids)
        size = self.tokenizer.vocab_size
        if not stops or not all(0 <= i < size for i in stops):
            raise ValueError(f"stop_ids must be non-empty token ids in [0, {size}), got {list(stop_ids)}")
        return stops

    def _factory(self, template: llguidance.LLMatcher, stops: tuple[int, ...]) -> Callable[[], Constraint]:
        size, eos = self.tokenizer.vocab_size, self.tokenizer.eos_id
        return lambda: _JsonConstraint(template.deep_copy(), size, eos, stops)

    def _lookup(self, canonical: str) -> llguidance.LLMatcher | None:
        with self._lock:
            entry = self._entries.get(canonical)
            if entry is None:
                return None
            self._entries.move_to_end(canonical)
            return entry[0]

    def _compile(self, schema: dict | None, canonical: str) -> llguidance.LLMatcher:
        """Check ``schema`` (counts, then the child's compile), compile it here with its first mask, and cache it."""
        _check_counts(schema)
        if self._vocab is None:
            self._vocab = _Vocab(self.tokenizer, self.seconds, self.max_bytes)
        size = self._vocab.budget.check(canonical)
        grammar = llguidance.LLMatcher.grammar_from_json_schema(canonical, overrides=_OPTIONS)
        template = llguidance.LLMatcher(self._vocab.engine, grammar, log_level=0,
                                        limits=llguidance.LLParserLimits(**LIMITS))
        template.compute_bitmask()  # the first mask now, not on the engine thread (each copy starts from it)
        if template.is_error():  # the child compiled it: only a mismatch between the two would get here
            raise ValueError(f"invalid or unsupported JSON schema: {_message(template)}")
        with self._lock:
            if size <= self.cache_bytes:
                self._entries[canonical] = (template, size)
                self.bytes += size
            while self.bytes > self.cache_bytes or len(self._entries) > self.max_entries:
                self.bytes -= self._entries.popitem(last=False)[1][1]
        return template


def _check_counts(schema: Any) -> None:
    """``ValueError`` naming the keyword and where it is if ``schema`` counts beyond :data:`MAX_COUNT`."""
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, path = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            where = f"{path}/{key}"
            if key in _DATA and isinstance(node, dict):
                continue
            counts = [value] if key in _COUNTS and isinstance(value, int) and not isinstance(value, bool) else []
            if key == "pattern" and isinstance(value, str):
                counts = [int(n) for m in _REPEAT.finditer(value) for n in m.groups() if n]
            if key == "patternProperties" and isinstance(value, dict):
                counts = [int(n) for p in value for m in _REPEAT.finditer(p) for n in m.groups() if n]
            if any(n > MAX_COUNT for n in counts):
                raise ValueError(f"{key} at {where or '/'} counts {max(counts)}, more than this server's limit of "
                                 f"{MAX_COUNT:,} for repetition counts")
            stack.append((value, where))


def _canonical(schema: dict | None) -> str:
    if schema is None:
        schema = _ANY_OBJECT
    if not isinstance(schema, dict):
        raise ValueError(f"JSON schema must be an object, got {type(schema).__name__}")
    try:
        return json.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"JSON schema is not serialisable as JSON: {exc}") from exc


def _message(matcher: llguidance.LLMatcher) -> str:
    return matcher.get_error().removesuffix("\n<non-verbose/>")


class _JsonConstraint:
    """A :class:`Constraint` over one llguidance matcher; stop tokens are handled here, not by the engine."""

    def __init__(self, matcher: llguidance.LLMatcher, size: int, eos: int, stop_ids: tuple[int, ...]) -> None:
        self._matcher, self._size, self._eos = matcher, size, eos
        self._stop_ids, self._stops = frozenset(stop_ids), np.array(stop_ids)
        self._words = np.zeros((size + 31) // 32, dtype=np.int32)
        self._words_ptr = self._words.ctypes.data
        self._stopped = False
        self._accepted = 0

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
        self._check()
        # bit j of little-endian mask byte k is token 8 k + j; invert the bytes, not the (8x more) bools
        forbidden = np.unpackbits(np.invert(self._words.view(np.uint8)), count=self._size, bitorder="little")
        forbidden = forbidden.view(np.bool_)
        forbidden[self._eos] = True  # the engine's own EOS bit; ours are the stop ids
        if self._matcher.is_accepting():
            forbidden[self._stops] = False
        return forbidden

    def _check(self) -> None:
        if self._matcher.is_error():
            raise GrammarError(f"the schema's grammar exceeded the grammar engine's limits after {self._accepted} "
                               f"tokens ({_message(self._matcher)})")

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
            self._check()
            raise ValueError(f"token {token_id} is not allowed by the JSON grammar here")
        self._accepted += 1

    def done(self) -> bool:
        return self._stopped or (self._matcher.is_stopped() and not self._matcher.is_error())
