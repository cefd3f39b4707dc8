"""Corpora: the default standard-library corpus and user data (text, folders, ``.jsonl``, ``.parquet``).

:func:`stdlib_documents` — the running Python's own standard-library source (always present, no
download). :func:`load_documents` — user data; a file whose bytes look binary is an error naming it.
Re-exported by :mod:`k3.train.data`.
"""

from __future__ import annotations

import json
import os
import sysconfig
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from k3.files import open_regular

__all__ = [
    "Document",
    "STDLIB_EXCLUDED_DIRS",
    "TEXT_EXTENSIONS",
    "stdlib_documents",
    "load_documents",
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


def _undecodable_bytes(raw: bytes) -> int:
    """How many bytes of ``raw`` are not part of a valid UTF-8 sequence."""
    escaped = raw.decode("utf-8", errors="surrogateescape")  # one lone surrogate per bad byte
    return len(raw) - len(escaped.encode("utf-8", errors="ignore"))


def _binary(path: Path, why: str) -> ValueError:
    return ValueError(f"{path}: looks like a binary file ({why}), not text")


def _read_text_file(path: Path) -> str:
    """UTF-8 (a leading BOM is dropped). Binary-looking bytes (see :data:`BINARY_SNIFF_BYTES`) →
    ``ValueError``; otherwise undecodable bytes become U+FFFD with a warning naming the file."""
    raw = path.read_bytes()
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
    open_regular(path).close()  # a FIFO or a device (a link to /dev/zero) is refused, not read forever
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(path, name)
    if suffix == ".parquet":
        return _read_parquet(path, name)
    text = _read_text_file(path)
    return [Document(name, text)] if text else []


def load_documents(paths: Sequence[str | os.PathLike[str]] | str | os.PathLike[str]) -> list[Document]:
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

