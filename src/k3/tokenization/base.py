"""What every tokenizer the model and server use shares: a vocabulary size and named special ids."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


class Vocabulary:
    """``vocab_size`` / ``len`` and ``special_ids`` from ``_size`` and ``_special_ids`` (literal → id)."""

    _size: int
    _special_ids: dict[str, int]

    @property
    def vocab_size(self) -> int:
        """Number of token ids (special tokens included); ids are ``0 .. vocab_size - 1``."""
        return self._size

    def __len__(self) -> int:
        return self._size

    @property
    def special_ids(self) -> dict[str, int]:
        """``{literal: id}`` for every special token."""
        return dict(self._special_ids)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same directory, fsync and ``os.replace``: readers see
    the old file or the new one, never a part."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
