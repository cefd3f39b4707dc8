"""The K3 prefix cache (issue 13; SPEC §8): reuse a prompt's prefix across requests, MLA pages and KDA checkpoints.

A prompt is cut into *hash blocks* of ``block_tokens`` tokens; block i's key is a chained hash over the namespace
(model fingerprint, chat-format version, the request's ``cache_salt``), every earlier block and its own token ids,
so two requests share a block only when their whole prefixes are identical. Two kinds of entry share one byte
budget and one LRU order:

* an **MLA page**: a physical allocation of ``page_blocks`` hash blocks (the paper pages 1,024–6,144 tokens over
  512-token hashes) holding, for the blocks of one chain, their rows in every MLA layer's cache (KV latent + shared
  key) — what a pure-attention server caches. A page is charged whole when allocated; its blocks become matchable
  one by one as they are written. A chain that diverges from another inside a page continues in a page of its
  own (the shared blocks stay where they are);
* a **KDA checkpoint**: the model's whole non-attention state exactly after a block boundary — every KDA layer's
  recurrent state and ShortConv window, and the AttnRes depth sources of the last position. Restoring a hybrid
  model at a boundary needs one; a boundary without one cannot be resumed however many pages match;
* a **tail checkpoint**: a KDA checkpoint ``r`` tokens (0 < r < ``block_tokens``) past a block boundary, with the MLA
  rows of those ``r`` tokens, keyed by the boundary's block key and the tail's token ids. It resumes a request at a
  position no block boundary reaches: a chat message's end (a shared head, the end of a finished answer).

Where checkpoints are written (`cuts`, issue 36): every ``checkpoint_every`` blocks; at the **matched frontier**
(SGLang's branch-point rule: a request whose prompt matches pages past its last usable checkpoint cuts its prefill
there, so the next request sharing that prefix resumes at it — no floor of ``checkpoint_every`` blocks); and at
positions the caller marks, exactly (a rendered chat's shared head, the K3 report's turn-boundary rule: a tail
checkpoint when the mark is inside a block). A prompt's pages are written when its prefill ends, and a finished
request's generated tokens too, with a checkpoint exactly where its state stands (`insert` of a whole conversation
so far), so a conversation's next turn prefills only its new message.

`lookup` finds the longest run of matching pages, then the furthest position within it that has a checkpoint — a
tail past a matched boundary, else a boundary (SPEC §8's 2,800-token hit that resumes at 2,560) — and builds the
request's private `DecoderState`: pages are concatenated into new MLA caches and checkpoint tensors are shared
read-only (the model never writes into a state it was given; every forward returns new tensors). Hit entries stay
pinned until the request ends (`release`) and are never evicted while pinned. Entries are added only after the chunk
that produced them completed, so an aborted prefill leaves nothing half-written; a checkpoint is one entry, so its
layers are evicted together. Eviction is least-recently-used among unpinned entries, later blocks of a chain before
earlier ones (so chains shrink from the end).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from k3.model.sequence.kda import KDAState
from k3.model.sequence.mla import MLACache
from k3.model.state import DecoderState

__all__ = ["CHAT_FORMAT_VERSION", "CacheStats", "Hit", "PrefixCache"]

#: Bumped whenever a chat format's rendering changes, so cached prefixes of the old rendering are never reused.
CHAT_FORMAT_VERSION = 2  # 2: XTML text encoded in the release encoder's segments (issue 38)


@dataclass
class CacheStats:
    lookups: int = 0
    hits: int = 0
    tokens_looked_up: int = 0
    tokens_reused: int = 0
    pages_added: int = 0
    checkpoints_added: int = 0
    evictions: int = 0


@dataclass
class _Entry:
    tensors: tuple[Tensor, ...]  # a page: (latent, shared_key) per MLA layer; a checkpoint: see `_checkpoint`
    nbytes: int
    pins: int = 0
    slots: dict[int, bytes] = field(default_factory=dict)  # a page: slot -> the block key written there
    tail: tuple[bytes, int] | None = None  # a tail checkpoint: (the block key it follows, its length)


@dataclass
class Hit:
    """A lookup that matched pages: the request resumes at ``length`` tokens with ``state`` (0 and None when no
    matched boundary has a checkpoint); ``keys`` are pinned, the last the checkpoint's; ``frontier`` is where the
    matched pages end (the next checkpoint worth writing)."""

    length: int
    state: DecoderState | None
    keys: list[tuple[str, bytes]] = field(default_factory=list)
    frontier: int = 0


def _nbytes(tensors: tuple[Tensor, ...]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class PrefixCache:
    """Pages and checkpoints of one model under a byte budget (thread-safe)."""

    def __init__(self, kinds: list[str], budget_bytes: int, block_tokens: int = 64, checkpoint_every: int = 8,
                 namespace: str = "", page_blocks: int = 4) -> None:
        if block_tokens < 1 or checkpoint_every < 1 or page_blocks < 1 or budget_bytes < 0:
            raise ValueError(f"prefix cache: need block_tokens, checkpoint_every, page_blocks >= 1 and budget >= 0; "
                             f"got {block_tokens}, {checkpoint_every}, {page_blocks}, {budget_bytes}")
        self.kinds, self.budget, self.block, self.page_blocks = kinds, budget_bytes, block_tokens, page_blocks
        self.checkpoint_every, self.namespace = checkpoint_every, namespace
        self.stats = CacheStats()
        self._entries: OrderedDict[tuple[str, bytes], _Entry] = OrderedDict()  # LRU first
        self._blocks: dict[bytes, tuple[tuple[str, bytes], int]] = {}  # written block -> (its page, slot)
        self._tails: dict[bytes, dict[int, int]] = {}  # block key (or the root) -> {tail length: tails of it}
        self._bytes = 0
        self._lock = threading.Lock()

    @classmethod
    def for_model(cls, model: torch.nn.Module, tokenizer: object, budget_bytes: int, block_tokens: int = 64,
                  checkpoint_every: int = 8, page_blocks: int = 4) -> PrefixCache:
        """A cache whose namespace fingerprints ``model`` (config and a sample of its weights) and the chat
        format version, so entries can never be reused across models or formats."""
        h = hashlib.sha256(model.config.to_json().encode())
        h.update(f"|{getattr(tokenizer, 'chat_format', 'k3')}|{CHAT_FORMAT_VERSION}|{tokenizer.vocab_size}".encode())
        for t in list(model.state_dict().values())[:8]:
            h.update(t.detach().reshape(-1)[:64].float().numpy().tobytes())
        return cls(model.config.layer_kinds(), budget_bytes, block_tokens, checkpoint_every, h.hexdigest(),
                   page_blocks)

    # ------------------------------------------------------------------ keys and boundaries
    def root(self, salt: str | None = None) -> bytes:
        """The key every chain of ``salt`` starts from (what a tail at position < ``block`` follows)."""
        return hashlib.sha256(f"k3-prefix|{self.namespace}|{salt or ''}".encode()).digest()

    def hashes(self, tokens: list[int], salt: str | None = None) -> list[bytes]:
        """The chained key of every full hash block of ``tokens``."""
        out, parent = [], self.root(salt)
        for start in range(0, len(tokens) - self.block + 1, self.block):
            h = hashlib.sha256(parent)
            h.update(b"".join(t.to_bytes(4, "little") for t in tokens[start:start + self.block]))
            parent = h.digest()
            out.append(parent)
        return out

    def _tail_keys(self, parent: bytes, tokens: list[int], lengths: set[int] | dict[int, int]) -> dict[int, bytes]:
        """The key of each tail of ``tokens`` (the tokens after ``parent``'s boundary) whose length is in
        ``lengths``: one incremental hash over at most ``block - 1`` tokens."""
        h, out = hashlib.sha256(b"tail|" + parent), {}
        for r, token in enumerate(tokens[:self.block - 1], 1):
            h.update(token.to_bytes(4, "little"))
            if r in lengths:
                out[r] = h.copy().digest()
        return out

    def cuts(self, prompt_tokens: int, frontier: int = 0, marks: list[int] | tuple[int, ...] = (),
             max_tokens: int = 0) -> list[int]:
        """Where a prompt's prefill is cut and checkpointed (module docstring): every ``checkpoint_every`` blocks, the
        matched ``frontier``, each of ``marks`` (a tail checkpoint inside a block), and the prompt's last block
        boundary when decoding ``max_tokens`` cannot pass another one (the request's last chance to leave a checkpoint
        near its end) — all before the prompt's last token (a resumed request must still compute its logits)."""
        last = (prompt_tokens - 1) // self.block * self.block
        every = self.block * self.checkpoint_every
        due = {*range(every, last + 1, every), frontier, *marks}
        if prompt_tokens % self.block and last + self.block > prompt_tokens + max_tokens - 1:
            due.add(last)
        return sorted(c for c in due if 0 < c < prompt_tokens)

    def sizes(self) -> dict[str, float]:
        """Bytes per cached token: of an MLA page, of a KDA checkpoint spread over the ``checkpoint_every`` blocks it
        serves, both together, and of a pure-MLA model of the same depth (every layer paged); with the size of one
        checkpoint. Measured on the entries held (empty until a page and a checkpoint exist)."""
        with self._lock:
            page = next((e.nbytes for k, e in self._entries.items() if k[0] == "page"), None)
            checkpoint = next((_nbytes(e.tensors[:1 + 2 * self.kinds.count("kda")]) for k, e in self._entries.items()
                               if k[0] in ("checkpoint", "tail")), None)  # a tail's KDA part
        if page is None or checkpoint is None:
            return {}
        per_token = page / (self.block * self.page_blocks)
        spread = checkpoint / (self.block * self.checkpoint_every)
        mla = self.kinds.count("mla")
        return {"mla_page_bytes_per_token": per_token, "kda_checkpoint_bytes": checkpoint,
                "kda_checkpoint_bytes_per_token_at_default_spacing": spread,
                "hybrid_bytes_per_token": per_token + spread,
                "pure_mla_bytes_per_token": per_token * len(self.kinds) / mla if mla else float("nan")}

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def pinned(self) -> int:
        """Total pins held (zero once every request using the cache has ended)."""
        with self._lock:
            return sum(e.pins for e in self._entries.values())

    # ------------------------------------------------------------------ lookup
    def lookup(self, tokens: list[int], salt: str | None = None) -> Hit | None:
        """The longest reusable prefix of ``tokens`` (at most ``len(tokens) - 1`` tokens), pinned; None when nothing
        matches."""
        keys = self.hashes(tokens[:-1], salt)
        with self._lock:
            self.stats.lookups += 1
            self.stats.tokens_looked_up += len(tokens)
            matched = 0
            while matched < len(keys) and keys[matched] in self._blocks:
                matched += 1
            blocks = next((j for j in range(matched, 0, -1) if ("checkpoint", keys[j - 1]) in self._entries), 0)
            blocks, tail = self._furthest_tail(tokens, keys, matched, blocks, salt)
            if blocks == 0 and tail is None:
                return Hit(0, None, frontier=matched * self.block) if matched else None
            checkpoint = ("checkpoint", keys[blocks - 1]) if tail is None else tail
            places = [self._blocks[k] for k in keys[:blocks]]
            hit_keys = list(dict.fromkeys(page for page, _ in places)) + [checkpoint]
            for key in reversed(hit_keys):  # the chain's first page ends most recently used
                self._entries[key].pins += 1
                self._entries.move_to_end(key)
            length = blocks * self.block + (0 if tail is None else self._entries[tail].tail[1])
            state = self._restore(places, self._entries[checkpoint], length)
            self.stats.hits += 1
            self.stats.tokens_reused += length
        return Hit(length, state, hit_keys, matched * self.block)

    def _furthest_tail(self, tokens: list[int], keys: list[bytes], matched: int, blocks: int, salt: str | None
                       ) -> tuple[int, tuple[str, bytes] | None]:
        """The furthest tail checkpoint that follows a matched boundary at or past ``blocks`` (the furthest block
        checkpoint) and ends before the last token: (its boundary in blocks, its key), else (``blocks``, None)."""
        for b in range(matched, blocks - 1, -1):
            parent = keys[b - 1] if b else self.root(salt)
            lengths = {r for r in self._tails.get(parent, ()) if b * self.block + r < len(tokens)}
            found = self._tail_keys(parent, tokens[b * self.block:], lengths) if lengths else {}
            for r in sorted(found, reverse=True):
                if ("tail", found[r]) in self._entries:
                    return b, ("tail", found[r])
        return blocks, None

    def _restore(self, places: list[tuple[tuple[str, bytes], int]], checkpoint: _Entry, length: int) -> DecoderState:
        """The state of a hit: the MLA rows of ``places`` (and of a tail checkpoint's tokens), the checkpoint's KDA
        states and depth sources."""
        kda_layers = self.kinds.count("kda")
        kda = iter(zip(checkpoint.tensors[1:1 + 2 * kda_layers:2], checkpoint.tensors[2:2 + 2 * kda_layers:2]))
        rows = [(self._entries[page].tensors, slice(slot * self.block, (slot + 1) * self.block))
                for page, slot in places]
        if checkpoint.tail is not None:
            rows.append((checkpoint.tensors[1 + 2 * kda_layers:], slice(None)))
        layers, mla = [], 0
        for kind in self.kinds:
            if kind == "kda":
                conv, recurrent = next(kda)
                layers.append(KDAState(conv, recurrent))
            else:
                layers.append(MLACache(torch.cat([t[2 * mla][:, r] for t, r in rows], dim=1),
                                       torch.cat([t[2 * mla + 1][:, r] for t, r in rows], dim=1)))
                mla += 1
        depth = checkpoint.tensors[0]
        return DecoderState(layers, None if depth.numel() == 0 else depth, length)

    def release(self, keys: list[tuple[str, bytes]]) -> None:
        """Unpin the entries of a `Hit` (the request ended)."""
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None and entry.pins > 0:
                    entry.pins -= 1
            self._evict()

    # ------------------------------------------------------------------ insertion
    def insert(self, tokens: list[int], state: DecoderState, salt: str | None = None,
               checkpoint: bool = True) -> bytes | None:
        """Store the prefix ``tokens`` of a batch-1 ``state`` that consumed them (and maybe more): the MLA pages of
        their full blocks not cached yet, and unless ``checkpoint`` is False a checkpoint at their end (``state`` must
        then stand exactly there) — a tail checkpoint when they end inside a block. Returns the checkpoint's key
        (None without one)."""
        if state.position < len(tokens) or state.batch_size != 1 or checkpoint and state.position != len(tokens):
            raise ValueError(f"prefix cache: insert needs a batch-1 state at (or, for pages only, past) the end of the "
                             f"tokens, got {len(tokens)} tokens, position {state.position}, batch {state.batch_size}")
        keys = self.hashes(tokens, salt)
        tail = len(tokens) % self.block
        if not keys and not (checkpoint and tail):
            return None
        mla = [s for s in state.layers if isinstance(s, MLACache)]
        with self._lock:
            touched: list[tuple[str, bytes]] = []
            for i, key in enumerate(keys):
                if key not in self._blocks:
                    self._write_block(keys, i, mla)
                touched.append(self._blocks[key][0])
            for page in reversed(list(dict.fromkeys(touched))):  # later pages are evicted first
                self._entries.move_to_end(page)
            key = None
            if checkpoint and tail:
                key = self._add_tail(keys[-1] if keys else self.root(salt), tokens[len(tokens) - tail:], state, mla)
            elif checkpoint:
                key = ("checkpoint", keys[-1])
                if key not in self._entries:
                    self._add(key, self._checkpoint(state))
                    self.stats.checkpoints_added += 1
            self._evict()
        return None if key is None else key[1]

    def _add_tail(self, parent: bytes, tail: list[int], state: DecoderState, mla: list[MLACache]
                  ) -> tuple[str, bytes]:
        """A tail checkpoint of the ``tail`` tokens after ``parent``'s boundary (caller holds the lock)."""
        key = ("tail", self._tail_keys(parent, tail, {len(tail)})[len(tail)])
        if key not in self._entries:
            rows = slice(state.position - len(tail), state.position)
            self._add(key, self._checkpoint(state) + tuple(t[:, rows].clone() for s in mla
                                                              for t in (s.latent, s.shared_key)))
            self._entries[key].tail = (parent, len(tail))
            lengths = self._tails.setdefault(parent, {})
            lengths[len(tail)] = lengths.get(len(tail), 0) + 1
            self.stats.checkpoints_added += 1
        return key

    def _write_block(self, keys: list[bytes], i: int, mla: list[MLACache]) -> None:
        """Write block ``i`` into its chain's page for this page range: the previous block's page when that page
        covers ``i`` and its slot is free, else a new page (caller holds the lock)."""
        slot = i % self.page_blocks
        page = self._blocks[keys[i - 1]][0] if slot and keys[i - 1] in self._blocks else None
        if page is None or slot in self._entries[page].slots:  # no page yet, or another chain's block is there
            page = ("page", keys[i])
            size = self.page_blocks * self.block
            self._add(page, tuple(torch.zeros(1, size, *t.shape[2:], dtype=t.dtype, device=t.device)
                                  for s in mla for t in (s.latent, s.shared_key)))
            self.stats.pages_added += 1
        rows = slice(i * self.block, (i + 1) * self.block)
        target = slice(slot * self.block, (slot + 1) * self.block)
        for buffer, t in zip(self._entries[page].tensors, (t for s in mla for t in (s.latent, s.shared_key))):
            buffer[:, target] = t[:, rows]
        self._entries[page].slots[slot] = keys[i]
        self._blocks[keys[i]] = (page, slot)

    @staticmethod
    def _checkpoint(state: DecoderState) -> tuple[Tensor, ...]:
        """(depth, then conv and recurrent of each KDA layer), copied: a state's tensors may be views of a batch."""
        depth = state.depth if state.depth is not None else torch.empty(0, device=state.device)
        return tuple(t.clone() for t in (depth, *(t for s in state.layers if isinstance(s, KDAState)
                                                   for t in (s.conv, s.recurrent))))

    def _add(self, key: tuple[str, bytes], tensors: tuple[Tensor, ...]) -> None:
        entry = _Entry(tensors, _nbytes(tensors))
        self._entries[key] = entry
        self._bytes += entry.nbytes

    def _evict(self) -> None:
        """Drop least-recently-used unpinned entries until the budget holds (caller holds the lock)."""
        if self._bytes <= self.budget:
            return
        for key in [k for k, e in self._entries.items() if e.pins == 0]:
            if self._bytes <= self.budget:
                break
            entry = self._entries.pop(key)
            for block in entry.slots.values():  # a page's blocks stop matching with it
                self._blocks.pop(block, None)
            if entry.tail is not None:
                parent, length = entry.tail
                lengths = self._tails[parent]
                lengths[length] -= 1
                if not lengths[length]:
                    del lengths[length]
                if not lengths:
                    del self._tails[parent]
            self._bytes -= entry.nbytes
            self.stats.evictions += 1
