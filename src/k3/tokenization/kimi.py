"""The released Kimi tokenizer: tiktoken BPE ranks plus 256 reserved special ids.

A release directory holds ``tiktoken.model`` (one ``base64(token bytes) rank`` line per base token, ranks
``0 .. n-1``) and ``tokenizer_config.json`` (``added_tokens_decoder`` names some of the 256 special ids
``n .. n+255``; the others are ``<|reserved_token_{id}|>``; ``bos_token``/``eos_token``/``pad_token`` pick ids).
:class:`KimiTokenizer` offers the duck-typed interface of :class:`k3.tokenization.bpe.Tokenizer`, so serving code
uses either. Long texts are encoded in pieces (tiktoken's regex engine fails on huge inputs): chunks of at most
:data:`MAX_CHUNK_CHARS` characters, cut again inside runs of more than :data:`MAX_RUN_CHARS` consecutive
whitespace or non-whitespace characters.
"""

from __future__ import annotations

import base64
import binascii
import copy
import functools
import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import tiktoken

from k3.files import DATA_LIMIT, read_bytes, write_bytes, write_text
from k3.tokenization.base import Vocabulary

__all__ = ["CONFIG_FILE", "MODEL_FILE", "NUM_RESERVED", "PAT_STR", "KimiTokenizer"]

MODEL_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"
#: Special ids reserved after the base ranks.
NUM_RESERVED = 256
MAX_CHUNK_CHARS = 400_000
MAX_RUN_CHARS = 25_000
_LETTERS_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_LETTERS_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
#: The Kimi pre-tokenisation regex (tiktoken ``pat_str``).
PAT_STR = "|".join([
    r"[\p{Han}]+",
    rf"[^\r\n\p{{L}}\p{{N}}]?{_LETTERS_UPPER}*{_LETTERS_LOWER}+{_CONTRACTION}",
    rf"[^\r\n\p{{L}}\p{{N}}]?{_LETTERS_UPPER}+{_LETTERS_LOWER}*{_CONTRACTION}",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
_RUN = re.compile(r"\s+|\S+")


def byte_symbols() -> list[str]:
    """The GPT-2 byte-level alphabet: byte ``b`` -> a printable character (how vocabularies show bytes)."""
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    spare = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(spare)) for b in range(256)]


_SYMBOLS = byte_symbols()


def _token_name(value: Any) -> str | None:
    """``"[BOS]"`` or ``{"content": "[BOS]", ...}`` -> ``"[BOS]"``; anything else -> ``None``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _pieces(text: str) -> Iterator[str]:
    """``text`` cut into chunks tiktoken can take (cuts only inside over-long chunks and runs)."""
    for start in range(0, len(text), MAX_CHUNK_CHARS):
        chunk = text[start:start + MAX_CHUNK_CHARS]
        begin = 0
        for run in _RUN.finditer(chunk):
            for cut in range(run.start() + MAX_RUN_CHARS, run.end(), MAX_RUN_CHARS):
                yield chunk[begin:cut]
                begin = cut
        yield chunk[begin:]


class KimiTokenizer(Vocabulary):
    """Kimi's tiktoken BPE; special ids follow the ``len(ranks)`` base ranks. Build with :meth:`load`."""

    chat_format = "xtml"

    def __init__(self, ranks: dict[bytes, int], config: dict[str, Any], *, source: str = "<memory>") -> None:
        model_src, config_src = f"{source}/{MODEL_FILE}", f"{source}/{CONFIG_FILE}"
        base = len(ranks)
        if sorted(ranks.values()) != list(range(base)):
            raise ValueError(f"{model_src}: ranks must be 0 .. {base - 1}, each once")
        if missing := [b for b in range(256) if bytes([b]) not in ranks]:
            raise ValueError(f"{model_src}: single-byte tokens missing for bytes {missing[:8]}")
        specials = {base + k: f"<|reserved_token_{base + k}|>" for k in range(NUM_RESERVED)}
        added = config.get("added_tokens_decoder", {}) if isinstance(config, dict) else None
        if not isinstance(added, dict):
            raise ValueError(f"{config_src}: expected an object with an 'added_tokens_decoder' object")
        for key, entry in added.items():
            token_id, literal = int(key) if key.isascii() and key.isdigit() else -1, _token_name(entry)
            if token_id not in specials or not literal:
                raise ValueError(f"{config_src}: added token {key!r} must be an id in [{base}, {base + NUM_RESERVED})"
                                 " with a non-empty 'content'")
            specials[token_id] = literal
        self._special_ids = {literal: i for i, literal in specials.items()}
        if len(self._special_ids) != NUM_RESERVED:
            raise ValueError(f"{config_src}: special token contents are not unique")
        named = {}
        for role in ("bos", "eos", "pad"):
            literal = _token_name(config.get(f"{role}_token"))
            if literal not in self._special_ids:
                raise ValueError(f"{config_src}: {role}_token {config.get(f'{role}_token')!r} is not a special token")
            named[role] = self._special_ids[literal]
        self.bos_id, self.eos_id, self.pad_id = named["bos"], named["eos"], named["pad"]
        self._ranks, self._config = dict(ranks), copy.deepcopy(config)
        self._base, self._size = base, base + NUM_RESERVED
        self._enc = tiktoken.Encoding("kimi", pat_str=PAT_STR, mergeable_ranks=self._ranks,
                                      special_tokens=self._special_ids)
        literals = sorted(self._special_ids, key=len, reverse=True)
        self._special_re = re.compile("(" + "|".join(map(re.escape, literals)) + ")")

    # ----------------------------------------------------------------------------------------
    # encode / decode
    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids of ``text``; special-token literals map to special ids only if ``allow_special``."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        parts = self._special_re.split(text) if allow_special else [text]
        ids: list[int] = []
        for k, part in enumerate(parts):
            if k % 2:  # re.split puts the captured special literals at odd positions
                ids.append(self._special_ids[part])
            else:
                for piece in _pieces(part):
                    ids.extend(self._enc.encode_ordinary(piece))
        return ids

    def encode_batch(self, texts: Sequence[str], allow_special: bool = False) -> list[list[int]]:
        """:meth:`encode` for each of ``texts``."""
        out = []
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"encode_batch: text #{i} is {type(text).__name__}, expected str")
            out.append(self.encode(text, allow_special))
        return out

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``: special ids as their literals, invalid UTF-8 as U+FFFD; unknown id -> ``ValueError``."""
        checked = [self._check_id(i) for i in ids]
        return self._enc.decode_bytes(checked).decode("utf-8", errors="replace")

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry of ``token_id``: its bytes as GPT-2 byte-level symbols, or a special literal."""
        j = self._check_id(token_id)
        if j >= self._base:
            return self._enc.decode_single_token_bytes(j).decode("utf-8")
        return "".join(_SYMBOLS[b] for b in self._enc.decode_single_token_bytes(j))

    def _check_id(self, token_id: int) -> int:
        j = int(token_id)
        if j != token_id or not 0 <= j < self._size:
            raise ValueError(f"token id {token_id!r} out of range [0, {self._size})")
        return j

    # ----------------------------------------------------------------------------------------
    # properties
    def special_id(self, name: str) -> int:
        """Id of a special token, by literal (``"<|open|>"``, ``"[BOS]"``) or bare name (``"open"``)."""
        for key in (name, f"<|{name}|>"):
            if key in self._special_ids:
                return self._special_ids[key]
        raise KeyError(f"unknown special token {name!r}")

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one id stands for (special literals count their length)."""
        return max(max(map(len, self._ranks)), max(map(len, self._special_ids)))

    def token_bytes(self) -> list[bytes]:
        """The bytes each id stands for, indexed by id; the 256 special ids give ``b""`` (protocol markers, not text,
        so a grammar engine that builds text from these bytes can never produce them inside a value)."""
        out = [b""] * self._size
        for token, rank in self._ranks.items():
            out[rank] = token
        return out

    def get_vocab(self) -> dict[str, int]:
        """``{token string: id}`` for the whole vocabulary (base tokens as GPT-2 byte-level symbols)."""
        vocab = {"".join(_SYMBOLS[b] for b in token): rank for token, rank in self._ranks.items()}
        vocab.update(self._special_ids)
        return vocab

    def __repr__(self) -> str:
        return f"KimiTokenizer(vocab_size={self._size}, base={self._base})"

    # ----------------------------------------------------------------------------------------
    # persistence
    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``tiktoken.model`` and ``tokenizer_config.json`` into ``directory`` (each atomically)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        lines = (base64.b64encode(token) + b" %d\n" % rank
                 for token, rank in sorted(self._ranks.items(), key=lambda item: item[1]))
        write_bytes(d / MODEL_FILE, b"".join(lines))
        write_text(d / CONFIG_FILE, json.dumps(self._config, indent=2, ensure_ascii=False) + "\n")
        return d

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> KimiTokenizer:
        """Read a release directory; a missing, unreadable or corrupt file -> ``ValueError`` naming its path."""
        d = Path(directory)
        model, config = _read(d / MODEL_FILE), _read(d / CONFIG_FILE)
        ranks: dict[bytes, int] = {}
        for n, line in enumerate(model.splitlines(), 1):
            if not line:
                continue
            try:
                token, rank = line.split()
                token, rank = base64.b64decode(token, validate=True), int(rank)
            except (ValueError, binascii.Error) as exc:
                raise ValueError(f"{d / MODEL_FILE}: line {n} is not 'base64 rank': {line[:60]!r}") from exc
            if ranks.setdefault(token, rank) != rank:
                raise ValueError(f"{d / MODEL_FILE}: line {n} repeats token {token!r}")
        try:
            cfg = json.loads(config)
        except ValueError as exc:
            raise ValueError(f"{d / CONFIG_FILE}: not valid JSON: {exc}") from exc
        return cls(ranks, cfg, source=str(d))



def _read(path: Path) -> bytes:
    try:
        return read_bytes(path, DATA_LIMIT)
    except FileNotFoundError as exc:
        raise ValueError(f"tokenizer file not found: {path}") from exc
    except OSError as exc:
        raise ValueError(f"cannot read tokenizer file {path}: {exc}") from exc


