"""What every tokenizer the model and server use shares: a vocabulary size and named special ids."""

from __future__ import annotations


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

