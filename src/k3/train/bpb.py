"""Validation in bits per byte, with the same bytes compressed by zlib -9 and xz -9e beside it (issue 38).

Nats per token depend on the tokenizer (``tiny``'s 512 ids and ``mini``'s 4,096 cut the same text into different
numbers of tokens); bits per byte do not. As nanochat counts them: each supervised target token stands for the
bytes its id decodes to (`Vocabulary.token_bytes`), and special ids (end of document, protocol markers) stand for
no bytes, so their loss is left out of the bits and they add nothing to the bytes:

    bits per byte = Σ loss over supervised targets with bytes  /  (ln 2 · Σ their bytes)

The *anchors* compress exactly those bytes, in stream order, once as one file (``zlib_bpb``, ``xz_bpb``) and once
window by window (``zlib_window_bpb``, ``xz_window_bpb``: a compressor that, like the model, sees only its window).
They are raw streams (deflate at level 9 = ``zlib -9``; LZMA2 at preset 9 | extreme = ``xz -9e``): the containers'
headers and checksums (6 bytes per zlib stream, ~60 per xz file) are not counted, which matters only per window.
"""

from __future__ import annotations

import functools
import lzma
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

#: xz -9e's dictionary (preset 9: 64 MiB).
XZ_9E_DICTIONARY = 64 << 20


def deflate_size(data: bytes) -> int:
    """Bytes of ``data`` compressed as zlib -9 does, without zlib's 2-byte header and 4-byte checksum."""
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    return len(packer.compress(data) + packer.flush())


def xz_size(data: bytes) -> int:
    """Bytes of ``data`` compressed as xz -9e does (LZMA2, preset 9, extreme), without the xz container. The
    dictionary is cut to the data (no match can reach further): the same bytes out, without allocating preset 9's
    64 MiB dictionary (and ~10 times that for its match finder) for every window."""
    dictionary = min(XZ_9E_DICTIONARY, max(4096, len(data)))
    filters = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME, "dict_size": dictionary}]
    return len(lzma.compress(data, format=lzma.FORMAT_RAW, filters=filters))


@functools.lru_cache(maxsize=4)
def anchors(windows: tuple[bytes, ...]) -> dict[str, float]:
    """Bits per byte of zlib -9 and xz -9e on ``windows`` joined (one file) and on each window apart (cached: every
    evaluation of a run compresses the same windows)."""
    whole = b"".join(windows)
    if not whole:
        raise ValueError("no validation bytes to compress")
    per_byte = 8 / len(whole)
    return {"zlib_bpb": deflate_size(whole) * per_byte, "xz_bpb": xz_size(whole) * per_byte,
            "zlib_window_bpb": sum(deflate_size(w) for w in windows if w) * per_byte,
            "xz_window_bpb": sum(xz_size(w) for w in windows if w) * per_byte}


@dataclass(frozen=True)
class Validation:
    """One pass over the validation windows: ``loss`` in nats per supervised token (end-of-document targets
    included, as before bits per byte existed), ``bits_per_byte`` over the targets that stand for text, and the
    compressors' `anchors` on the same bytes."""

    loss: float
    tokens: int
    bits_per_byte: float
    bytes: int
    anchors: dict[str, float]

    def record(self) -> dict[str, Any]:
        """The fields `metrics.jsonl` and `k3 eval` carry."""
        return {"val_loss": self.loss, "val_ppl": math.exp(min(self.loss, 50)), "val_bpb": self.bits_per_byte,
                "val_bytes": self.bytes, **self.anchors}


class ByteTally:
    """Sums a validation pass batch by batch: the loss of every supervised target, the loss and bytes of those
    that stand for text, and (for the anchors) each window's text bytes."""

    def __init__(self, token_bytes: Sequence[bytes], device: torch.device) -> None:
        self.token_bytes = token_bytes
        self.lengths = torch.tensor([len(b) for b in token_bytes], dtype=torch.int64, device=device)
        self.loss, self.tokens, self.text_loss, self.bytes = 0.0, 0, 0.0, 0
        self.windows: list[bytes] = []

    def add(self, logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> None:
        """One batch: ``logits [B, T, V]``, ``targets [B, T]``, ``mask [B, T]`` (the supervised targets)."""
        if targets.numel() and int(targets.max()) >= self.lengths.numel():
            raise ValueError(f"target id {int(targets.max())} is outside the tokenizer's {self.lengths.numel()} ids")
        losses = F.cross_entropy(logits[mask].float(), targets[mask].long(), reduction="none")
        lengths = self.lengths[targets[mask]]
        self.loss += float(losses.sum())
        self.tokens += losses.numel()
        self.text_loss += float(losses[lengths > 0].sum())
        self.bytes += int(lengths.sum())
        for row, keep in zip(targets.tolist(), mask.tolist()):
            self.windows.append(b"".join(self.token_bytes[t] for t, k in zip(row, keep) if k))

    def result(self) -> Validation:
        if self.tokens == 0:
            raise ValueError("validation data has no supervised positions")
        if self.bytes == 0:
            raise ValueError("validation targets stand for no text bytes (only special ids)")
        return Validation(self.loss / self.tokens, self.tokens, self.text_loss / (math.log(2) * self.bytes),
                          self.bytes, anchors(tuple(self.windows)))
