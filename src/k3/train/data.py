"""Training data: corpora, document split, packing with a loss mask, resumable loader (issue 4, deliverable 2).

Corpora
    :func:`stdlib_documents` — the default corpus: the running Python's own standard-library source
    (always present, no download). :func:`load_documents` — user data: text files, folders,
    ``.jsonl`` (a ``text`` field per line) and ``.parquet`` (a ``text`` column).

Split
    :func:`split_documents` — deterministic train/validation split *by document*, from a SHA-256 of
    ``(seed, document name)``; independent of the input order and of ``PYTHONHASHSEED``.

Packing (SPEC §7: mean cross-entropy over *supervised* positions only)
    :class:`PackedLoader` — documents (token lists) are joined into one stream, each followed by
    ``eos_id``; fixed-length windows of ``seq_len + 1`` tokens give ``inputs = w[:-1]``,
    ``targets = w[1:]`` and a boolean ``loss_mask``. The mask is False where the *target* is the first
    token of a document (predicting the next document from the previous one's ``eos`` is not a real
    prediction) and, with ``mask_special=True``, where the target is a special/protocol token.
    Masked positions still feed context. The loader never pads (see the class docstring);
    :func:`eval_batches` does pad the final window and masks the padding.

Loss
    :func:`masked_mean_loss` — mean cross-entropy over positions where the mask is True.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "Document",
    "STDLIB_EXCLUDED_DIRS",
    "TEXT_EXTENSIONS",
    "stdlib_documents",
    "load_documents",
    "split_documents",
    "tokenize_documents",
    "PackedLoader",
    "eval_batches",
    "masked_mean_loss",
    "masked_loss_sum",
]


@dataclass(frozen=True)
class Document:
    """One training document: a stable ``name`` (used for the split) and its ``text``."""

    name: str
    text: str


# ------------------------------------------------------------------------------------------------
# the default corpus: the running Python's standard library

#: Directory names skipped anywhere under the stdlib root: third-party packages, the (huge) test
#: suites, the IDLE and turtle demos, generated tables (``encodings`` codec maps, ``pydoc_data``
#: topics), the legacy ``lib2to3`` and build artefacts.
STDLIB_EXCLUDED_DIRS: frozenset[str] = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idlelib",
        "turtledemo",
        "encodings",
        "pydoc_data",
        "lib2to3",
        "__pycache__",
        "lib-dynload",
    }
)


def _stdlib_excluded(rel_parts: tuple[str, ...]) -> bool:
    for part in rel_parts[:-1]:
        if part in STDLIB_EXCLUDED_DIRS or part.startswith("config-") or part.startswith("."):
            return True
    # _sysconfigdata_*.py is generated per build/platform: excluded so the corpus is the same source text
    return rel_parts[-1].startswith("_sysconfigdata")


def stdlib_documents(limit_bytes: int | None = None) -> list[Document]:
    """The running Python's standard-library ``*.py`` files as documents, in sorted path order.

    Root: ``sysconfig.get_paths()["stdlib"]``. Skips every directory in :data:`STDLIB_EXCLUDED_DIRS`
    (and ``config-*``, hidden directories, the platform-generated ``_sysconfigdata*.py``). ``name`` is
    the POSIX path relative to the root (e.g. ``"json/decoder.py"``). Files are decoded as UTF-8 (invalid
    bytes, if any, become U+FFFD); empty files are skipped. ``limit_bytes`` stops after the first files
    whose UTF-8 text totals at most that many bytes (at least one file is always returned). Raises
    ``ValueError`` if nothing is found.
    """
    if limit_bytes is not None and limit_bytes <= 0:
        raise ValueError(f"limit_bytes must be positive, got {limit_bytes}")
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise ValueError(f"standard-library directory not found: {root}")
    files: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        # prune excluded directories in place (deterministic: we sort the final list anyway)
        dirnames[:] = [
            d
            for d in dirnames
            if d not in STDLIB_EXCLUDED_DIRS and not d.startswith("config-") and not d.startswith(".")
        ]
        for fn in filenames:
            if not fn.endswith(".py"):
                continue
            rel = (rel_dir / fn).as_posix()
            if _stdlib_excluded(tuple(rel.split("/"))):
                continue
            files.append((rel, Path(dirpath) / fn))
    files.sort(key=lambda x: x[0])
    docs: list[Document] = []
    total = 0
    for rel, path in files:
        text = path.read_bytes().decode("utf-8", errors="replace")
        if not text:
            continue
        size = len(text.encode("utf-8"))
        if limit_bytes is not None and docs and total + size > limit_bytes:
            break
        docs.append(Document(rel, text))
        total += size
    if not docs:
        raise ValueError(f"no documents found in the standard library at {root}")
    return docs


# ------------------------------------------------------------------------------------------------
# user data

#: Extensions read as whole-file text documents when scanning a folder. ``.jsonl`` and ``.parquet``
#: files found in a folder are read in their record formats; everything else in a folder is ignored,
#: as are hidden files and directories (names starting with "."). A file named explicitly is read as
#: text whatever its extension (unless it is ``.jsonl``/``.parquet``).
TEXT_EXTENSIONS: frozenset[str] = frozenset({".txt", ".text", ".md", ".markdown", ".rst", ".py"})
_RECORD_EXTENSIONS = frozenset({".jsonl", ".parquet"})


def _read_text_file(path: Path) -> str:
    """UTF-8 (a leading BOM is dropped). Undecodable bytes become U+FFFD with a warning naming the file."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        warnings.warn(
            f"{path}: not valid UTF-8 (first bad byte at offset {exc.start}); invalid bytes replaced by U+FFFD",
            stacklevel=3,
        )
        return raw.decode("utf-8-sig", errors="replace")


def _read_jsonl(path: Path, prefix: str) -> list[Document]:
    docs: list[Document] = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path}, line {lineno}: not valid UTF-8 ({exc})") from exc
            if not line.strip():
                continue  # blank lines (e.g. a trailing newline) are allowed
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}, line {lineno}: invalid JSON ({exc.msg})") from exc
            if not isinstance(record, dict) or "text" not in record:
                raise ValueError(f"{path}, line {lineno}: no 'text' field")
            text = record["text"]
            if not isinstance(text, str):
                raise ValueError(f"{path}, line {lineno}: 'text' is {type(text).__name__}, expected a string")
            if text:
                docs.append(Document(f"{prefix}:{lineno}", text))
    return docs


def _read_parquet(path: Path, prefix: str) -> list[Document]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for a bad file
        raise ValueError(f"{path}: not a readable parquet file ({exc})") from exc
    if "text" not in pf.schema_arrow.names:
        raise ValueError(f"{path}: no 'text' column (columns: {', '.join(pf.schema_arrow.names) or 'none'})")
    field = pf.schema_arrow.field("text")
    if not (pa.types.is_string(field.type) or pa.types.is_large_string(field.type)):
        raise ValueError(f"{path}: 'text' column has type {field.type}, expected string")
    docs: list[Document] = []
    row = 0
    for batch in pf.iter_batches(columns=["text"]):
        for text in batch.column(0).to_pylist():
            if text:  # None (null) and "" are skipped
                docs.append(Document(f"{prefix}:{row}", text))
            row += 1
    return docs


def _read_file(path: Path, name: str) -> list[Document]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(path, name)
    if suffix == ".parquet":
        return _read_parquet(path, name)
    text = _read_text_file(path)
    return [Document(name, text)] if text else []


def load_documents(paths: Sequence[str | os.PathLike[str]] | str | os.PathLike[str]) -> list[Document]:
    """Documents from files and folders, in argument order (folders scanned in sorted path order).

    * a text file → one document (UTF-8; undecodable bytes → U+FFFD and a warning naming the file);
    * ``.jsonl`` → one document per non-blank line, from its ``text`` field (a line that is not a JSON
      object with a string ``text`` → ``ValueError`` naming the file and line);
    * ``.parquet`` → one document per row of the ``text`` column (no such column → ``ValueError``
      naming the file; null/empty rows skipped);
    * a folder → recursively, files with :data:`TEXT_EXTENSIONS`, ``.jsonl`` and ``.parquet``; hidden
      entries skipped.

    Names (used by :func:`split_documents`) do not depend on the working directory: a file argument is
    named by its base name, a file found in a folder by ``<folder base name>/<relative path>``; records
    get ``:<line number>`` (``.jsonl``, 1-based) or ``:<row>`` (``.parquet``, 0-based) appended.
    Empty documents are dropped. A missing path → ``FileNotFoundError``; no documents at all →
    ``ValueError("no documents found in …")``.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = list(paths)
    if not paths:
        raise ValueError("no data paths given")
    docs: list[Document] = []
    for arg in paths:
        p = Path(arg)
        if not p.exists():
            raise FileNotFoundError(f"data path does not exist: {p}")
        if p.is_dir():
            base = p.resolve().name or p.resolve().as_posix()
            found: list[tuple[str, Path]] = []
            for dirpath, dirnames, filenames in os.walk(p):
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
                for fn in filenames:
                    fp = Path(dirpath) / fn
                    if fn.startswith(".") or fp.suffix.lower() not in TEXT_EXTENSIONS | _RECORD_EXTENSIONS:
                        continue
                    found.append((fp.relative_to(p).as_posix(), fp))
            found.sort(key=lambda x: x[0])
            for rel, fp in found:
                docs.extend(_read_file(fp, f"{base}/{rel}"))
        elif p.is_file():
            docs.extend(_read_file(p, p.name))
        else:
            raise ValueError(f"data path is neither a file nor a folder: {p}")
    if not docs:
        raise ValueError(f"no documents found in {', '.join(str(x) for x in paths)}")
    return docs


# ------------------------------------------------------------------------------------------------
# split


def _unit_hash(seed: int, name: str) -> float:
    h = hashlib.sha256(f"{int(seed)}\x00{name}".encode("utf-8", errors="surrogatepass")).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64


def split_documents(
    docs: Sequence[Document], val_fraction: float = 0.05, seed: int = 0
) -> tuple[list[Document], list[Document]]:
    """Deterministic train/validation split by document: ``(train, val)``.

    A document goes to validation iff ``sha256(seed, name)`` (as a number in [0, 1)) is below
    ``val_fraction``; documents are never cut, and each list keeps the input order. The assignment of a
    document depends only on its name and ``seed`` — not on the other documents, their order or the
    Python hash seed — except for the guarantee that with ≥ 2 documents both sides are non-empty: if
    one side is empty, the document whose hash is closest to the cut moves across (ties by text hash).
    With exactly one document, it is the training set and validation is empty (with a warning).
    """
    if not 0.0 < float(val_fraction) < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    docs = list(docs)
    if not docs:
        raise ValueError("no documents to split")
    if len(docs) == 1:
        warnings.warn("only one document: validation split is empty", stacklevel=2)
        return docs, []
    keys = [_unit_hash(seed, d.name) for d in docs]
    is_val = [k < val_fraction for k in keys]

    def tiebreak(i: int) -> tuple[float, str]:
        return keys[i], hashlib.sha256(docs[i].text.encode("utf-8", errors="surrogatepass")).hexdigest()

    if not any(is_val):
        is_val[min(range(len(docs)), key=tiebreak)] = True
    elif all(is_val):
        is_val[max(range(len(docs)), key=tiebreak)] = False
    train = [d for d, v in zip(docs, is_val) if not v]
    val = [d for d, v in zip(docs, is_val) if v]
    return train, val


def tokenize_documents(tokenizer: Any, docs: Sequence[Document | str]) -> list[list[int]]:
    """Token ids of each document (plain text: special-token literals are NOT mapped to special ids)."""
    texts = [d.text if isinstance(d, Document) else d for d in docs]
    return tokenizer.encode_batch(texts, allow_special=False)


# ------------------------------------------------------------------------------------------------
# packing


def _as_token_array(doc: Any, index: int) -> np.ndarray:
    if isinstance(doc, torch.Tensor):
        doc = doc.detach().cpu().numpy()
    if isinstance(doc, np.ndarray):
        a = doc
    else:
        seq = doc if hasattr(doc, "__len__") else list(doc)
        try:
            a = np.array(seq, dtype=np.int64) if len(seq) else np.zeros(0, dtype=np.int64)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"document #{index}: expected a 1-D sequence of integer token ids ({exc})") from exc
    if a.size == 0:
        return np.zeros(0, dtype=np.int64)
    if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"document #{index}: expected a 1-D sequence of integer token ids, got {a.dtype} {a.shape}")
    return a.astype(np.int64, copy=False)


class _Corpus:
    """Token documents stored flat (one int64 array + offsets), with a fingerprint for checkpoints."""

    def __init__(self, token_docs: Iterable[Any], eos_id: int) -> None:
        arrays = [_as_token_array(d, i) for i, d in enumerate(token_docs)]
        arrays = [a for a in arrays if a.size > 0]  # empty documents contribute nothing
        if not arrays:
            raise ValueError("no tokens: every document is empty")
        self.lengths = np.array([a.size for a in arrays], dtype=np.int64)
        self.flat = np.concatenate(arrays)
        if int(self.flat.min()) < 0:
            raise ValueError("negative token id in documents")
        self.offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=self.offsets[1:])
        self.eos_id = int(eos_id)
        self.num_docs = len(arrays)
        self.stream_len = int(self.flat.size) + self.num_docs  # each document + one eos
        h = hashlib.blake2b(digest_size=16)
        h.update(self.lengths.tobytes())
        h.update(self.flat.tobytes())
        h.update(str(self.eos_id).encode())
        self.fingerprint = h.hexdigest()

    def stream(self, order: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens, doc_start)`` of the stream ``doc[order[0]] eos doc[order[1]] eos …``."""
        eos = np.array([self.eos_id], dtype=np.int64)
        parts: list[np.ndarray] = []
        for i in order:
            parts.append(self.flat[self.offsets[i] : self.offsets[i + 1]])
            parts.append(eos)
        tokens = np.concatenate(parts)
        lens = self.lengths[np.asarray(order, dtype=np.int64)] + 1
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
        doc_start = np.zeros(self.stream_len, dtype=bool)
        doc_start[starts] = True
        return torch.from_numpy(tokens), torch.from_numpy(doc_start)


def _target_mask(
    targets: torch.Tensor, starts: torch.Tensor, special: torch.Tensor | None
) -> torch.Tensor:
    mask = ~starts
    if special is not None and special.numel() > 0:
        mask &= ~torch.isin(targets, special)
    return mask


class PackedLoader:
    """Infinite, resumable iterator of packed batches ``(inputs, targets, loss_mask)``, each ``[B, T]``.

    Layout. Each epoch the documents are shuffled (``torch.Generator`` seeded with ``seed + epoch``;
    ``shuffle=False`` keeps the given order) and joined into one stream ``d₀ eos d₁ eos …``. The stream
    is cut into ``batch_size`` equal contiguous *shards* of ``L = len(stream) // batch_size`` tokens
    (the ≤ ``batch_size - 1`` leftover tokens at the end are unused that epoch). Row ``r`` of a batch
    at stream position ``p`` with ``T = seq_len`` is the window ``shard_r[p : p + T + 1]``:
    ``inputs = window[:-1]``, ``targets = window[1:]``; then ``p += T``. Consecutive windows of a row
    overlap by one token, so every token of a shard is a target exactly once per epoch. The rows of a
    batch come from distant parts of the shuffled stream (decorrelated), and ``set_seq_len`` takes
    effect exactly at the current position ``p`` — the curriculum re-cuts the rest of the epoch
    without skipping or repeating tokens. When ``p + T + 1 > L`` the epoch ends: the < ``T + 1``
    remaining tokens of each shard are dropped (never padded — so the loss mask never has to hide
    padding here), ``epoch += 1``, ``p = 0``, documents are reshuffled.

    Loss mask: False where the target is the first token of a document (the boundary crossing
    ``eos → next document``); with ``mask_special=True`` also where the target is in ``special_ids``
    (default: ids ``0 .. NUM_SPECIAL_TOKENS - 1``, the tokenizer's protocol tokens — ``eos`` included).
    With ``mask_special=False`` the ``eos`` target that ends a document is supervised.

    Checkpointing: :meth:`state_dict` holds plain ints/strings (``epoch``, ``position``, ``seq_len``,
    ``batch_size``, ``seed``, ``shuffle`` and a fingerprint of the token data); :meth:`load_state_dict`
    on a loader built from the same documents resumes the exact batch sequence, and raises
    ``ValueError`` naming the field if the data, ``batch_size``, ``seed`` or ``shuffle`` differ.
    """

    STATE_VERSION = 1

    def __init__(
        self,
        token_docs: Iterable[Sequence[int] | torch.Tensor],
        seq_len: int,
        batch_size: int,
        eos_id: int,
        seed: int = 0,
        *,
        shuffle: bool = True,
        mask_special: bool = False,
        special_ids: Iterable[int] | None = None,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        self._corpus = _Corpus(token_docs, eos_id)
        self.batch_size = batch_size
        self.eos_id = int(eos_id)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.mask_special = bool(mask_special)
        if special_ids is None:
            from k3.train.tokenizer import NUM_SPECIAL_TOKENS

            special_ids = range(NUM_SPECIAL_TOKENS)
        self._special = torch.tensor(sorted({int(i) for i in special_ids}), dtype=torch.int64)
        self._check_seq_len(seq_len)
        self.seq_len = int(seq_len)
        self.epoch = 0
        self.position = 0
        self._cache_epoch: int | None = None
        self._tokens: torch.Tensor | None = None
        self._starts: torch.Tensor | None = None

    # -- sizes -----------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        """Tokens in one epoch's stream (document tokens + one ``eos`` per document)."""
        return self._corpus.stream_len

    @property
    def num_documents(self) -> int:
        return self._corpus.num_docs

    @property
    def shard_len(self) -> int:
        return self._corpus.stream_len // self.batch_size

    def batches_per_epoch(self, seq_len: int | None = None) -> int:
        """Full batches in one epoch at ``seq_len`` (default: the current one), from position 0."""
        t = self.seq_len if seq_len is None else int(seq_len)
        return (self.shard_len - 1) // t

    def _check_seq_len(self, seq_len: int) -> None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        need = self.batch_size * (seq_len + 1)
        if self._corpus.stream_len < need:
            raise ValueError(
                f"not enough data for seq_len={seq_len}, batch_size={self.batch_size}: the stream has "
                f"{self._corpus.stream_len} tokens, one batch needs at least {need}"
            )

    def set_seq_len(self, seq_len: int) -> None:
        """Use windows of ``seq_len`` from the current stream position on (curriculum)."""
        self._check_seq_len(seq_len)
        self.seq_len = int(seq_len)

    # -- iteration -------------------------------------------------------------------------------
    def _epoch_stream(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cache_epoch != self.epoch:
            n = self._corpus.num_docs
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + self.epoch)
                order = torch.randperm(n, generator=g).tolist()
            else:
                order = list(range(n))
            self._tokens, self._starts = self._corpus.stream(order)
            self._cache_epoch = self.epoch
        assert self._tokens is not None and self._starts is not None
        return self._tokens, self._starts

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.next_batch()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The next ``(inputs [B, T], targets [B, T], loss_mask [B, T])``; int64, int64, bool."""
        t, b, shard = self.seq_len, self.batch_size, self.shard_len
        if self.position + t + 1 > shard:
            self.epoch += 1
            self.position = 0
        tokens, starts = self._epoch_stream()
        base = torch.arange(b, dtype=torch.int64)[:, None] * shard + self.position
        idx = base + torch.arange(t + 1, dtype=torch.int64)[None, :]
        window = tokens[idx]
        inputs, targets = window[:, :-1].contiguous(), window[:, 1:].contiguous()
        special = self._special if self.mask_special else None
        mask = _target_mask(targets, starts[idx[:, 1:]], special)
        self.position += t
        return inputs, targets, mask

    # -- checkpoint ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": self.STATE_VERSION,
            "epoch": self.epoch,
            "position": self.position,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_documents": self._corpus.num_docs,
            "num_tokens": self._corpus.stream_len,
            "fingerprint": self._corpus.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; ``ValueError`` naming the field on any mismatch."""
        if not isinstance(state, dict):
            raise ValueError(f"loader state must be a dict, got {type(state).__name__}")
        required = ("version", "epoch", "position", "seq_len", "batch_size", "seed", "shuffle",
                    "num_documents", "num_tokens", "fingerprint")  # fmt: skip
        for key in required:
            if key not in state:
                raise ValueError(f"loader state: missing field {key!r}")
        if state["version"] != self.STATE_VERSION:
            raise ValueError(f"loader state field 'version' is {state['version']!r}, expected {self.STATE_VERSION}")
        mine = self.state_dict()
        for key in ("num_documents", "num_tokens", "fingerprint", "batch_size", "seed", "shuffle"):
            if state[key] != mine[key]:
                raise ValueError(
                    f"loader state field {key!r} is {state[key]!r}, but this loader has {mine[key]!r} "
                    "(different data or configuration)"
                )
        for key in ("epoch", "position", "seq_len"):
            v = state[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"loader state field {key!r} must be a non-negative int, got {v!r}")
        self._check_seq_len(state["seq_len"])
        if state["position"] > self.shard_len:
            raise ValueError(
                f"loader state field 'position' is {state['position']}, beyond the shard length {self.shard_len}"
            )
        self.epoch = state["epoch"]
        self.position = state["position"]
        self.seq_len = state["seq_len"]


def eval_batches(
    token_docs: Iterable[Sequence[int] | torch.Tensor],
    seq_len: int,
    batch_size: int,
    eos_id: int,
    pad_id: int = 0,
    *,
    mask_special: bool = False,
    special_ids: Iterable[int] | None = None,
    max_batches: int | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One deterministic pass for validation: the stream (documents in the given order, each followed
    by ``eos``) cut into consecutive windows of ``seq_len + 1`` (overlapping by one token, so every
    token after the first is a target exactly once); the final partial window is padded with
    ``pad_id`` and the padding masked; the last batch may have fewer than ``batch_size`` rows.
    The loss mask follows :class:`PackedLoader`. ``max_batches`` truncates the pass.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    corpus = _Corpus(token_docs, eos_id)
    tokens, starts = corpus.stream(range(corpus.num_docs))
    n = tokens.numel()
    n_win = max(1, -(-(n - 1) // seq_len))
    total = n_win * seq_len + 1
    padded = torch.full((total,), int(pad_id), dtype=torch.int64)
    padded[:n] = tokens
    valid = torch.zeros(total, dtype=torch.bool)
    valid[:n] = True
    st = torch.zeros(total, dtype=torch.bool)
    st[:n] = starts
    if special_ids is None:
        from k3.train.tokenizer import NUM_SPECIAL_TOKENS

        special_ids = range(NUM_SPECIAL_TOKENS)
    special = torch.tensor(sorted({int(i) for i in special_ids}), dtype=torch.int64) if mask_special else None
    idx = torch.arange(n_win)[:, None] * seq_len + torch.arange(seq_len + 1)[None, :]
    inputs, targets = padded[idx[:, :-1]], padded[idx[:, 1:]]
    mask = _target_mask(targets, st[idx[:, 1:]], special) & valid[idx[:, 1:]]
    out = []
    for i in range(0, n_win, batch_size):
        if max_batches is not None and len(out) >= max_batches:
            break
        sl = slice(i, i + batch_size)
        out.append((inputs[sl].contiguous(), targets[sl].contiguous(), mask[sl].contiguous()))
    return out


# ------------------------------------------------------------------------------------------------
# loss


def _check_loss_args(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> None:
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    if targets.shape != logits.shape[:2] or mask.shape != logits.shape[:2]:
        raise ValueError(
            f"shape mismatch: logits {tuple(logits.shape)}, targets {tuple(targets.shape)}, mask {tuple(mask.shape)}"
        )
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool, got {mask.dtype}")


def masked_loss_sum(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(sum of cross-entropy over supervised positions, number of them)``, computed in float32.

    For gradient accumulation: the mean over several micro-batches is ``Σ sums / Σ counts``.
    Only the supervised positions' logits enter the softmax computation.
    """
    _check_loss_args(logits, targets, mask)
    count = int(mask.sum())
    if count == 0:
        return logits.sum() * 0.0, 0
    sel_logits = logits[mask].float()
    sel_targets = targets[mask].long()
    return F.cross_entropy(sel_logits, sel_targets, reduction="sum"), count


def masked_mean_loss(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over positions where ``mask`` is True (SPEC §7), float32 scalar.

    Masked positions (document boundaries, padding, protocol tokens) contribute nothing; an all-False
    mask raises ``ValueError`` (no supervised positions).
    """
    total, count = masked_loss_sum(logits, targets, mask)
    if count == 0:
        raise ValueError("loss mask selects no supervised positions")
    return total / count
