"""Training data: corpora, document split, packing with a loss mask, resumable loader (issue 4, deliverable 2).

Corpora (defined in :mod:`k3.train.corpus`, re-exported here)
    :func:`stdlib_documents` — the default corpus: the running Python's own standard-library source
    (always present, no download). :func:`load_documents` — user data: text files, folders,
    ``.jsonl`` (a ``text`` field per line) and ``.parquet`` (a ``text`` column); binary files rejected; bounded by
    a data limit and by the memory tokenizing takes. :func:`load_corpus` — either, as ``k3 train --data`` picks.

Split
    :func:`split_documents` — deterministic train/validation split *by document*, from a SHA-256 of
    ``(seed, document name)``; independent of the input order and of ``PYTHONHASHSEED``. When that
    leaves a side empty (e.g. a single document), the longest document is cut into a training and a
    validation window instead.

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
    :func:`masked_loss_sum` — its ``(sum, count)``: a training step's loss is ``Σ sums / Σ counts`` over
    its micro-batches, so gradient accumulation never reweights a position (``k3.train.pretrain``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from k3.train.corpus import (STDLIB_EXCLUDED_DIRS, TEXT_EXTENSIONS, Document, load_corpus, load_documents,
                             stdlib_documents)

__all__ = [
    "Document",
    "STDLIB_EXCLUDED_DIRS",
    "TEXT_EXTENSIONS",
    "stdlib_documents",
    "load_documents",
    "load_corpus",
    "MIN_SPLIT_CHARS",
    "split_documents",
    "tokenize_documents",
    "PackedLoader",
    "eval_batches",
    "masked_mean_loss",
    "masked_loss_sum",
]


# ------------------------------------------------------------------------------------------------
# split


def _unit_hash(seed: int, name: str) -> float:
    h = hashlib.sha256(f"{int(seed)}\x00{name}".encode("utf-8", errors="surrogatepass")).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64


#: Batches are made on the host and moved to the model's device by the trainer (`k3.train.pretrain.Run.share`).
HOST = torch.device("cpu")
#: The fewest characters a document needs to be cut into a training and a validation window.
MIN_SPLIT_CHARS = 2


def split_documents(
    docs: Sequence[Document], val_fraction: float = 0.05, seed: int = 0
) -> tuple[list[Document], list[Document]]:
    """Deterministic train/validation split: ``(train, val)``, both non-empty.

    By document: a document goes to validation iff ``sha256(seed, name)`` (as a number in [0, 1)) is
    below ``val_fraction``; each list keeps the input order; documents with empty text are dropped. A
    document's side depends only on its name and ``seed`` — not on the other documents, their order or
    the Python hash seed.

    When that leaves one side empty (always with a single document), the longest document (ties: the
    first name in sorted order) is cut instead into two contiguous windows, ``name[train]`` (its head)
    and ``name[val]`` (its tail), whose concatenation is its text; it takes its place in the full
    side, the other window alone forms the empty one. The cut puts ``round(val_fraction * total
    characters)`` in validation (at least one character in each window), moved to the nearest line
    start when one is near (see :func:`_window_cut`). With a single document, ``seed`` has no effect.
    ``ValueError`` if there is no text, or the longest document has fewer than
    :data:`MIN_SPLIT_CHARS` characters.
    """
    if not 0.0 < float(val_fraction) < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    docs = list(docs)
    if not docs:
        raise ValueError("no documents to split")
    texts = [d for d in docs if d.text]
    if not texts:
        raise ValueError(f"no text to split: all {len(docs)} documents are empty")
    is_val = [_unit_hash(seed, d.name) < val_fraction for d in texts]
    if any(is_val) and not all(is_val):
        return [d for d, v in zip(texts, is_val) if not v], [d for d, v in zip(texts, is_val) if v]
    return _split_longest(texts, float(val_fraction), all_val=all(is_val))


def _split_longest(docs: list[Document], val_fraction: float, all_val: bool) -> tuple[list[Document], list[Document]]:
    """``docs`` all on one side (validation iff ``all_val``): cut the longest into a train and a val window."""
    i = min(range(len(docs)), key=lambda k: (-len(docs[k].text), docs[k].name))
    doc, total = docs[i], sum(len(d.text) for d in docs)
    if len(doc.text) < MIN_SPLIT_CHARS:
        what = "the only document" if len(docs) == 1 else f"the longest of {len(docs)} documents"
        raise ValueError(
            f"{doc.name} ({what}) has {len(doc.text)} character(s): too short to split into a training and a "
            f"validation window, which needs at least {MIN_SPLIT_CHARS} characters"
        )
    val_chars = round(val_fraction * total)
    head = (total if all_val else len(doc.text)) - val_chars  # the head is all of training when all_val
    cut = _window_cut(doc.text, head)
    train = Document(f"{doc.name}[train]", doc.text[:cut])
    val = Document(f"{doc.name}[val]", doc.text[cut:])
    if all_val:
        return [train], docs[:i] + [val] + docs[i + 1 :]
    return docs[:i] + [train] + docs[i + 1 :], [val]


def _window_cut(text: str, target: int) -> int:
    """Where to cut ``text`` (≥ 2 characters) near ``target``: a position strictly inside it.

    ``target`` is clamped to ``[1, len - 1]``; the nearest line start (just after a ``"\\n"``) replaces
    it if within half the smaller part's length, so each part keeps at least half its intended size;
    otherwise the cut is at ``target`` itself (any character boundary).
    """
    n = len(text)
    target = min(max(target, 1), n - 1)
    slack = min(target, n - target) // 2
    before = text.rfind("\n", 0, target) + 1  # a line start in [1, target], or 0 if none
    after = text.find("\n", target, n - 1) + 1  # a line start in [target + 1, n - 1], or 0 if none
    near = [p for p in (before, after) if p and abs(p - target) <= slack]
    return min(near, key=lambda p: abs(p - target), default=target)


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
    """Token documents stored flat (one int64 array + offsets), with a fingerprint for checkpoints.

    ``role`` ("training", "validation") names the data in the error raised when it has no tokens."""

    def __init__(self, token_docs: Iterable[Any], eos_id: int, role: str) -> None:
        given = [_as_token_array(d, i) for i, d in enumerate(token_docs)]
        arrays = [a for a in given if a.size > 0]  # empty documents contribute nothing
        if not arrays:
            why = f"all {len(given)} of its documents are empty" if given else "it has no documents"
            raise ValueError(f"the {role} data has no tokens: {why}")
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
        self._corpus = _Corpus(token_docs, eos_id, "training")
        self.batch_size = batch_size
        self.eos_id = int(eos_id)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.mask_special = bool(mask_special)
        if special_ids is None:
            from k3.tokenization.bpe import NUM_SPECIAL_TOKENS

            special_ids = range(NUM_SPECIAL_TOKENS)
        self._special = torch.tensor(sorted({int(i) for i in special_ids}), dtype=torch.int64, device=HOST)
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
                order = torch.randperm(n, generator=g, device=HOST).tolist()
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
        base = torch.arange(b, dtype=torch.int64, device=HOST)[:, None] * shard + self.position
        idx = base + torch.arange(t + 1, dtype=torch.int64, device=HOST)[None, :]
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
    corpus = _Corpus(token_docs, eos_id, "validation")
    tokens, starts = corpus.stream(range(corpus.num_docs))
    n = tokens.numel()
    n_win = max(1, -(-(n - 1) // seq_len))
    total = n_win * seq_len + 1
    padded = torch.full((total,), int(pad_id), dtype=torch.int64, device=HOST)
    padded[:n] = tokens
    valid = torch.zeros(total, dtype=torch.bool, device=HOST)
    valid[:n] = True
    st = torch.zeros(total, dtype=torch.bool, device=HOST)
    st[:n] = starts
    if special_ids is None:
        from k3.tokenization.bpe import NUM_SPECIAL_TOKENS

        special_ids = range(NUM_SPECIAL_TOKENS)
    special = (torch.tensor(sorted({int(i) for i in special_ids}), dtype=torch.int64, device=HOST) if mask_special
               else None)
    idx = torch.arange(n_win, device=HOST)[:, None] * seq_len + torch.arange(seq_len + 1, device=HOST)[None, :]
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
