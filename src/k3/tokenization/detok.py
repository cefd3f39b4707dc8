"""Incremental detokenization: token ids in, text deltas out, never splitting a UTF-8 character.

A byte-level BPE token can end in the middle of a multi-byte character; decoding such a prefix gives
U+FFFD. `IncrementalDetokenizer` holds those tokens back until the character completes, and decodes
only a short window (the tokens since the previous complete boundary) per call, so each push costs
O(1) regardless of the length generated so far.
"""

from __future__ import annotations

from k3.tokenization.bpe import Tokenizer

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """``push(id) -> str`` returns the text that became final with ``id``; ``flush()`` the remainder.

    The concatenation of every returned delta equals ``tokenizer.decode(ids)`` of all pushed ids
    (for ids that decode to complete characters; an incomplete tail is flushed as U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # start of the decode window: a character boundary
        self._read = 0  # ids before this have been returned as text

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        decode = self.tokenizer.decode
        done = decode(self.ids[self._prefix:self._read])
        full = decode(self.ids[self._prefix:])
        if full.endswith(_REPLACEMENT) or len(full) < len(done):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return full[len(done):]

    def flush(self) -> str:
        """Text of the held-back ids (an incomplete character becomes U+FFFD); the window is then empty."""
        decode = self.tokenizer.decode
        text = decode(self.ids[self._prefix:])[len(decode(self.ids[self._prefix:self._read])):]
        self._prefix = self._read = len(self.ids)
        return text
