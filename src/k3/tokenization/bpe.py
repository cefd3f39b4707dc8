"""Byte-level BPE tokenizer with the chat-format special tokens (issue 4, deliverable 1; SPEC §7–8).

The model is trained with the Hugging Face ``tokenizers`` library:

* pre-tokenizer ``ByteLevel(add_prefix_space=False, use_regex=True)`` (GPT-2 split regex, bytes
  mapped to printable characters), decoder ``ByteLevel``, no normaliser — so the text is never
  altered before it is split;
* ``BpeTrainer`` seeded with the full 256-symbol byte alphabet, so every byte sequence (hence every
  Unicode string) is encodable and ``decode(encode(x)) == x`` exactly;
* the special tokens of :data:`SPECIAL_TOKENS` occupy ids ``0 .. len(SPECIAL_TOKENS) - 1`` in that
  fixed order, then come the 256 byte symbols, then the merges.

Protocol-token injection: ``encode(text)`` treats the literal string ``"<|user|>"`` in ``text`` as
plain text (it is split into ordinary byte-level tokens, never the special id); only
``encode(text, allow_special=True)`` maps such literals to their special ids. Internally two
``tokenizers.Tokenizer`` objects share the same model, one with ``encode_special_tokens = True``
(plain) and one without (protocol). ``decode`` renders special ids as their literal strings.

``save(directory)`` writes ``directory/tokenizer.json`` atomically (`k3.files.atomic_write`);
``load(directory)`` reads it back and checks the special-token layout, raising ``ValueError`` naming
the path for a missing, corrupt or mismatched file.
"""

from __future__ import annotations

import functools

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as _HFTokenizer

from k3.files import DATA_LIMIT, read_text, write_text
from k3.tokenization.base import Vocabulary

__all__ = [
    "SPECIAL_TOKENS",
    "NUM_SPECIAL_TOKENS",
    "MIN_VOCAB_SIZE",
    "TOKENIZER_FILE",
    "Tokenizer",
]

#: Special tokens of the chat format, in their fixed order; token ``SPECIAL_TOKENS[i]`` has id ``i``.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|pad|>",  # 0  padding (never supervised)
    "<|bos|>",  # 1  beginning of a sequence
    "<|eos|>",  # 2  end of a document (separator when packing)
    "<|system|>",  # 3  role: system
    "<|user|>",  # 4  role: user
    "<|assistant|>",  # 5  role: assistant
    "<|tool|>",  # 6  role: tool result
    "<|think|>",  # 7  assistant channel: reasoning
    "<|response|>",  # 8  assistant channel: visible answer
    "<|tools|>",  # 9  assistant channel: tool calls
    "<|end|>",  # 10 end of a message / channel
    "<|media|>",  # 11 placeholder for one visual slot
)
NUM_SPECIAL_TOKENS = len(SPECIAL_TOKENS)
#: The smallest allowed vocabulary: the 256 byte symbols plus the special tokens.
MIN_VOCAB_SIZE = 256 + NUM_SPECIAL_TOKENS
#: File name written by :meth:`Tokenizer.save` inside the target directory.
TOKENIZER_FILE = "tokenizer.json"
#: Ids beyond which `Tokenizer.decode` uses the ``tokenizers`` call that releases the GIL (issue 35).
DECODE_IN_BATCH = 1024


def _special_name(name: str) -> str:
    """``"user"`` or ``"<|user|>"`` → ``"<|user|>"``."""
    if name.startswith("<|") and name.endswith("|>"):
        return name
    return f"<|{name}|>"


class Tokenizer(Vocabulary):
    """Byte-level BPE with the chat special tokens at ids ``0 .. NUM_SPECIAL_TOKENS - 1``.

    Build one with :meth:`train` or :meth:`load` (or :meth:`from_json`); the constructor wraps an
    already-built ``tokenizers.Tokenizer`` and validates its special-token layout.
    """

    def __init__(self, hf: _HFTokenizer, *, source: str = "<memory>") -> None:
        _check_layout(hf, source)
        self._hf = hf  # special literals → special ids
        self._plain = _HFTokenizer.from_str(hf.to_str())  # special literals → ordinary bytes
        self._plain.encode_special_tokens = True
        self._size = hf.get_vocab_size(with_added_tokens=True)
        self._special_ids = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}

    # ----------------------------------------------------------------------------------------
    # training
    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> Tokenizer:
        """Train a byte-level BPE of at most ``vocab_size`` tokens on ``texts``.

        ``vocab_size`` counts the special tokens and the 256 byte symbols, so it must be at least
        :data:`MIN_VOCAB_SIZE`. On a small corpus the trainer may run out of pairs to merge, in which
        case the result has fewer tokens than requested (see :attr:`vocab_size`). Deterministic: the
        same texts in the same order give the same vocabulary and merges.
        """
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
            raise ValueError(f"vocab_size must be an int, got {vocab_size!r}")
        if vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(
                f"vocab_size={vocab_size} is too small: need at least {MIN_VOCAB_SIZE} "
                f"(256 byte symbols + {NUM_SPECIAL_TOKENS} special tokens)"
            )
        if isinstance(texts, str):
            texts = [texts]
        hf = _HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=0,
            special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )

        def checked(it: Iterable[str]) -> Iterable[str]:
            for i, t in enumerate(it):
                if not isinstance(t, str):
                    raise TypeError(f"training text #{i} is {type(t).__name__}, expected str")
                yield t

        hf.train_from_iterator(checked(texts), trainer=trainer)
        return cls(hf, source="<trained>")

    # ----------------------------------------------------------------------------------------
    # encode / decode
    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids of ``text``; special-token literals map to special ids only if ``allow_special``."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        hf = self._hf if allow_special else self._plain
        # the batch call releases the GIL (a long text does not stall the server's other threads) and is the
        # faster one even for a short text
        return hf.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def encode_batch(self, texts: Sequence[str], allow_special: bool = False) -> list[list[int]]:
        """:meth:`encode` for many texts at once (parallel in the ``tokenizers`` library)."""
        texts = list(texts)
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise TypeError(f"encode_batch: text #{i} is {type(t).__name__}, expected str")
        hf = self._hf if allow_special else self._plain
        return [e.ids for e in hf.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special ids become their literal strings. Unknown ids → ``ValueError``.

        Ids forming an incomplete UTF-8 sequence decode to U+FFFD (only possible for id sequences
        that :meth:`encode` never produces, e.g. a prefix cut mid-character).
        """
        out: list[int] = []
        for i in ids:
            j = int(i)
            if j != i or not 0 <= j < self._size:
                raise ValueError(f"token id {i!r} out of range [0, {self._size})")
            out.append(j)
        if len(out) > DECODE_IN_BATCH:  # the batch call releases the GIL; for a few ids the plain one is faster
            return self._hf.decode_batch([out], skip_special_tokens=False)[0]
        return self._hf.decode(out, skip_special_tokens=False)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry (byte-level symbols, or a special literal) of ``token_id``."""
        if not 0 <= int(token_id) < self._size:
            raise ValueError(f"token id {token_id!r} out of range [0, {self._size})")
        return self._hf.id_to_token(int(token_id))

    # ----------------------------------------------------------------------------------------
    # properties
    @property
    def pad_id(self) -> int:
        return self._special_ids["<|pad|>"]

    @property
    def bos_id(self) -> int:
        return self._special_ids["<|bos|>"]

    @property
    def eos_id(self) -> int:
        return self._special_ids["<|eos|>"]

    def special_id(self, name: str) -> int:
        """Id of a special token, by literal (``"<|user|>"``) or bare name (``"user"``)."""
        key = _special_name(name)
        if key not in self._special_ids:
            raise KeyError(f"unknown special token {name!r}; known: {', '.join(SPECIAL_TOKENS)}")
        return self._special_ids[key]

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token stands for (byte-level symbols are one byte each; special literals
        count their length): text of ``n`` characters has at least ``n / max_token_bytes`` tokens."""
        return max(len(token) for token in self.get_vocab())

    def token_bytes(self) -> list[bytes]:
        """The bytes each id stands for, indexed by id; special ids give ``b""`` (they are protocol markers, not
        text, so a grammar engine that builds text from these bytes can never produce them inside a value)."""
        from k3.tokenization.kimi import byte_symbols

        byte_of = {symbol: b for b, symbol in enumerate(byte_symbols())}
        out = [b""] * self._size
        for token, i in self.get_vocab().items():
            if i >= NUM_SPECIAL_TOKENS:
                out[i] = bytes(byte_of[symbol] for symbol in token)
        return out

    def get_vocab(self) -> dict[str, int]:
        """``{token string: id}`` for the whole vocabulary (byte-level symbols as the model stores them)."""
        return self._hf.get_vocab(with_added_tokens=True)

    def merges(self) -> list[tuple[str, str]]:
        """The BPE merges in rank order, as pairs of vocabulary entries."""
        merges = json.loads(self.to_json())["model"]["merges"]
        return [tuple(m.split(" ", 1)) if isinstance(m, str) else (m[0], m[1]) for m in merges]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Tokenizer):
            return NotImplemented
        return self.to_json() == other.to_json()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self._size}, special={NUM_SPECIAL_TOKENS})"

    # ----------------------------------------------------------------------------------------
    # persistence
    def to_json(self) -> str:
        """The ``tokenizer.json`` text (stable for a given vocabulary)."""
        return self._hf.to_str()

    @classmethod
    def from_json(cls, text: str, *, source: str = "<string>") -> Tokenizer:
        """Inverse of :meth:`to_json`; ``ValueError`` naming ``source`` if the text is not a valid tokenizer."""
        try:
            json.loads(text)
            hf = _HFTokenizer.from_str(text)
        except Exception as exc:  # json.JSONDecodeError, tokenizers' Exception
            raise ValueError(f"corrupt tokenizer file {source}: {exc}") from exc
        return cls(hf, source=source)

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``directory/tokenizer.json`` atomically (`k3.files.atomic_write`)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        path = d / TOKENIZER_FILE
        write_text(path, self.to_json())
        return path

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> Tokenizer:
        """Read ``directory/tokenizer.json`` (``directory`` may also be the file itself).

        Missing, unreadable, corrupt or mismatched (wrong special tokens) → ``ValueError`` naming the path.
        """
        p = Path(directory)
        path = p if p.is_file() else p / TOKENIZER_FILE
        try:
            text = read_text(path, DATA_LIMIT)
        except FileNotFoundError as exc:
            raise ValueError(f"tokenizer file not found: {path}") from exc
        except OSError as exc:
            raise ValueError(f"cannot read tokenizer file {path}: {exc}") from exc
        return cls.from_json(text, source=str(path))


def _check_layout(hf: _HFTokenizer, source: str) -> None:
    """The special tokens must be exactly :data:`SPECIAL_TOKENS` at ids 0.. and the model byte-level."""
    if not isinstance(hf, _HFTokenizer):
        raise TypeError(f"expected a tokenizers.Tokenizer, got {type(hf).__name__}")
    size = hf.get_vocab_size(with_added_tokens=True)
    if size < MIN_VOCAB_SIZE:
        raise ValueError(f"tokenizer {source}: vocab_size={size} is below the minimum {MIN_VOCAB_SIZE}")
    for i, tok in enumerate(SPECIAL_TOKENS):
        got = hf.id_to_token(i)
        if got != tok:
            raise ValueError(f"tokenizer {source}: special token id {i} is {got!r}, expected {tok!r}")
    added = {i: t for i, t in hf.get_added_tokens_decoder().items() if t.special}
    missing = [tok for i, tok in enumerate(SPECIAL_TOKENS) if i not in added or added[i].content != tok]
    if missing:
        raise ValueError(f"tokenizer {source}: tokens {missing} are not registered as special tokens")
    if not isinstance(hf.pre_tokenizer, pre_tokenizers.ByteLevel) or not isinstance(hf.decoder, decoders.ByteLevel):
        raise ValueError(f"tokenizer {source}: not a byte-level tokenizer (pre_tokenizer/decoder must be ByteLevel)")
    if hf.normalizer is not None:
        raise ValueError(f"tokenizer {source}: a normalizer is set; byte-level round trip requires none")
