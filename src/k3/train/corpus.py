"""Corpora: the default standard-library corpus and user data (text, folders, ``.jsonl``, ``.parquet``).

:func:`stdlib_documents` — the running Python's own standard-library source (always present, no
download). :func:`load_documents` — user data; a file whose bytes look binary is an error naming it.
Re-exported by :mod:`k3.train.data`.
"""

from __future__ import annotations

import os
import sysconfig
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from k3.files import jsonl_records, open_regular
from k3.sizing.memory import available_bytes

__all__ = [
    "Document",
    "STDLIB_EXCLUDED_DIRS",
    "TEXT_EXTENSIONS",
    "stdlib_documents",
    "load_corpus",
    "load_documents",
    "tokenizable_bytes",
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


#: The binary-file rule for a text document: a NUL byte in its first ``BINARY_SNIFF_BYTES`` bytes, or
#: more than ``BINARY_MAX_BAD_FRACTION`` of its bytes (and at least ``BINARY_MIN_BAD_BYTES`` of them)
#: outside valid UTF-8 sequences. Text with occasional bad bytes is read with U+FFFD and a warning.
BINARY_SNIFF_BYTES = 8192
BINARY_MAX_BAD_FRACTION = 0.05
BINARY_MIN_BAD_BYTES = 8

#: Bytes of memory that tokenizing one byte of text takes at its peak: the token ids as Python lists before they are
#: packed (32 measured on the standard library with a 4,096-id tokenizer: 8.4 MiB of text, 266 MiB more at the peak).
TOKENIZE_BYTES_PER_BYTE = 32
#: Rows of a parquet file decoded at a time (its text counted before the next batch is decoded).
PARQUET_BATCH_ROWS = 256


def _undecodable_bytes(raw: bytes) -> int:
    """How many bytes of ``raw`` are not part of a valid UTF-8 sequence."""
    escaped = raw.decode("utf-8", errors="surrogateescape")  # one lone surrogate per bad byte
    return len(raw) - len(escaped.encode("utf-8", errors="ignore"))


def _binary(path: Path, why: str) -> ValueError:
    return ValueError(f"{path}: looks like a binary file ({why}), not text")


def _read_text_file(raw: bytes, path: Path) -> str:
    """UTF-8 (a leading BOM is dropped). Binary-looking bytes (see :data:`BINARY_SNIFF_BYTES`) →
    ``ValueError``; otherwise undecodable bytes become U+FFFD with a warning naming the file."""
    nul = raw.find(b"\0", 0, BINARY_SNIFF_BYTES)
    if nul >= 0:
        raise _binary(path, f"a NUL byte at offset {nul}")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        first_bad = exc.start
    bad = _undecodable_bytes(raw)
    if bad >= BINARY_MIN_BAD_BYTES and bad > BINARY_MAX_BAD_FRACTION * len(raw):
        raise _binary(path, f"{bad / len(raw):.1%} of its bytes are not valid UTF-8")
    warnings.warn(
        f"{path}: not valid UTF-8 (first bad byte at offset {first_bad}); invalid bytes replaced by U+FFFD",
        stacklevel=3,
    )
    return raw.decode("utf-8-sig", errors="replace")


def _read_jsonl(raw: bytes, path: Path, prefix: str) -> list[Document]:
    docs: list[Document] = []
    for lineno, record in jsonl_records(raw, path):
        if not isinstance(record, dict) or "text" not in record:
            raise ValueError(f"{path}, line {lineno}: no 'text' field")
        text = record["text"]
        if not isinstance(text, str):
            raise ValueError(f"{path}, line {lineno}: 'text' is {type(text).__name__}, expected a string")
        if text:
            docs.append(Document(f"{prefix}:{lineno}", text))
    return docs


def _parquet_file(f: BinaryIO, path: Path) -> Any:
    """The open parquet file ``f`` with a string ``text`` column, or a ValueError naming ``path``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(f)
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for a bad file
        raise ValueError(f"{path}: not a readable parquet file ({exc})") from exc
    if "text" not in pf.schema_arrow.names:
        raise ValueError(f"{path}: no 'text' column (columns: {', '.join(pf.schema_arrow.names) or 'none'})")
    field = pf.schema_arrow.field("text")
    if not (pa.types.is_string(field.type) or pa.types.is_large_string(field.type)):
        raise ValueError(f"{path}: 'text' column has type {field.type}, expected string")
    return pf


def _parquet_text_bytes(pf: Any) -> int:
    """The ``text`` column's bytes once decompressed, as the file's metadata states them: a floor of its text (a small
    file may hold much more text than its size; dictionary-encoded, more again)."""
    meta = pf.metadata
    groups = (meta.row_group(g) for g in range(meta.num_row_groups))
    return sum(group.column(c).total_uncompressed_size for group in groups for c in range(group.num_columns)
               if group.column(c).path_in_schema == "text")


def _read_parquet(pf: Any, prefix: str, room: int | None) -> tuple[int, list[Document] | None]:
    """The bytes of text of ``pf`` and its documents, or None for them once those bytes pass ``room``: counted batch by
    batch as decoded, before any becomes Python text (a value repeated through a dictionary costs its every copy)."""
    import pyarrow.compute as pc

    docs: list[Document] = []
    row = size = 0
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=["text"]):
        column = batch.column(0)
        size += pc.sum(pc.binary_length(column)).as_py() or 0
        if room is not None and size > room:
            return size, None
        for text in column.to_pylist():
            if text:  # None (null) and "" are skipped
                docs.append(Document(f"{prefix}:{row}", text))
            row += 1
    return size, docs


def _read_file(path: Path, name: str, room: int | None) -> tuple[int, list[Document] | None]:
    """The bytes of text ``path`` holds (at least: a parquet file stops being read once past) and its documents, or
    None for them when those bytes exceed ``room``. Read through the descriptor checked to be a regular file (a FIFO
    or a device — a link to /dev/zero — is refused, not read forever), at most its size when opened."""
    with open_regular(path) as f:
        if path.suffix.lower() == ".parquet":
            pf = _parquet_file(f, path)
            stated = _parquet_text_bytes(pf)
            return (stated, None) if room is not None and stated > room else _read_parquet(pf, name, room)
        size = os.fstat(f.fileno()).st_size
        if room is not None and size > room:
            return size, None
        raw = f.read(size)
    if path.suffix.lower() == ".jsonl":
        return size, _read_jsonl(raw, path, name)
    text = _read_text_file(raw, path)
    return size, [Document(name, text)] if text else []


def _data_files(paths: list[str | os.PathLike[str]]) -> list[tuple[str, Path]]:
    """``(name, path)`` of every file the data paths name, in argument order (folders scanned in sorted order)."""
    files: list[tuple[str, Path]] = []
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
                    found.append((f"{base}/{fp.relative_to(p).as_posix()}", fp))
            files.extend(sorted(found))
        elif p.is_file():
            files.append((p.name, p))
        else:
            raise ValueError(f"data path is neither a file nor a folder: {p}")
    return files


def _too_much(path: Path, total: int, limit_bytes: int | None, memory: int | None) -> ValueError:
    if limit_bytes is not None and total > limit_bytes:
        return ValueError(f"{path}: {total:,} bytes of text or more, past the data limit ({limit_bytes:,} bytes) "
                          f"on its own: raise the limit or split the file")
    return ValueError(f"the data up to {path} holds {total:,} bytes of text or more; tokenizing takes about "
                      f"{TOKENIZE_BYTES_PER_BYTE} bytes of memory a byte of text, and {memory:,} bytes of text is "
                      f"what the memory available allows: set a data limit (--data-limit-mb) to use the first files")


def tokenizable_bytes() -> int | None:
    """The most bytes of text this process may tokenize (`TOKENIZE_BYTES_PER_BYTE`): its share of the memory
    available, which the ranks of a distributed run on this machine (``LOCAL_WORLD_SIZE``, torchrun's), each loading
    the whole corpus, divide. None where the available memory is unknown."""
    available = available_bytes(torch.device("cpu"))
    try:
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        ranks = 1
    return None if available is None else available // (TOKENIZE_BYTES_PER_BYTE * ranks)


def load_documents(paths: Sequence[str | os.PathLike[str]] | str | os.PathLike[str],
                   limit_bytes: int | None = None) -> list[Document]:
    """Documents from files and folders, in argument order (folders scanned in sorted path order).

    * a text file → one document (UTF-8); a file that looks binary — a NUL byte in its first 8 KiB, or
      more than 5 % of its bytes (at least 8) not valid UTF-8 — → ``ValueError("<path>: looks like a
      binary file (…), not text")``; fewer undecodable bytes → U+FFFD and a warning naming the file;
    * ``.jsonl`` → one document per non-blank line, from its ``text`` field (a line that is not a JSON
      object with a string ``text`` → ``ValueError`` naming the file and line);
    * ``.parquet`` → one document per row of the ``text`` column (no such column → ``ValueError``
      naming the file; null/empty rows skipped);
    * a folder → recursively, files with :data:`TEXT_EXTENSIONS` (read as text files, binary check
      included), ``.jsonl`` and ``.parquet``; hidden entries skipped.

    Names (used by :func:`split_documents`) do not depend on the working directory: a file argument is
    named by its base name, a file found in a folder by ``<folder base name>/<relative path>``; records
    get ``:<line number>`` (``.jsonl``, 1-based) or ``:<row>`` (``.parquet``, 0-based) appended.
    Empty documents are dropped. A missing path → ``FileNotFoundError``; no documents at all →
    ``ValueError("no documents found in …")``.

    Bounded as it is read: ``limit_bytes`` keeps the first whole files whose text (a file's size; a parquet file's
    ``text`` column, counted as decoded) totals at most that many bytes — a first file larger than that is a
    ValueError naming it. Data that would not fit in memory once tokenized (`tokenizable_bytes`) is a ValueError
    naming the file that goes past, never a process killed for its memory.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = list(paths)
    if not paths:
        raise ValueError("no data paths given")
    if limit_bytes is not None and limit_bytes <= 0:
        raise ValueError(f"limit_bytes must be positive, got {limit_bytes}")
    memory = tokenizable_bytes()
    room = min((c for c in (limit_bytes, memory) if c is not None), default=None)
    docs: list[Document] = []
    total = 0
    for name, path in _data_files(paths):
        size, read = _read_file(path, name, None if room is None else room - total)
        if read is None:
            if limit_bytes is not None and total + size > limit_bytes and total:
                break  # the data limit: the first files
            raise _too_much(path, total + size, limit_bytes, memory)
        docs.extend(read)
        total += size
    if not docs:
        raise ValueError(f"no documents found in {', '.join(str(x) for x in paths)}")
    return docs


def load_corpus(data: Sequence[str | os.PathLike[str]] | None, limit_bytes: int | None = None) -> list[Document]:
    """The documents of the data paths given (`load_documents`), or the standard library's source
    (`stdlib_documents`) without any; ``limit_bytes`` bounds either (``--data-limit-mb``)."""
    return load_documents(data, limit_bytes) if data else stdlib_documents(limit_bytes)
