"""Gated Multi-head Latent Attention without positional encoding (SPEC §2, Eq. 7).

Per token ``x`` (width d), per head h::

    c_q  = RMSNorm(x W_dq)                    q_h = [c_q W_qc_h ; c_q W_qs_h]     (content ; shared-key part)
    c_kv = RMSNorm(x W_dkv)   k_s = x W_ks    k_h = [c_kv W_uk_h ; k_s]           v_h = c_kv W_uv_h
    o_h  = softmax_causal(q_h · k_h · (d_nope + d_shared)^-1/2) v_h
    y    = Σ_h (sigmoid(x W_gate)_h ⊙ o_h) W_o_h

Nothing is rotated (NoPE): the shared key ``k_s`` carries no position and is shared by all heads.
The per-layer cache is ``(c_kv, k_s)``: ``kv_lora_rank + qk_shared_head_dim`` scalars per token
(576 at paper size). Two equal ways to attend over it:

* `GatedMLA._attend_full` reconstructs per-head keys and values (training, prefill);
* `GatedMLA._attend_absorbed` stays in latent space (decode, speculative verification): ``W_uk`` is absorbed into
  the query and ``W_uv`` applied after the weighted sum, so each cached token costs one 576-wide dot (SPEC §9).

With a cache of L positions and T new tokens, the full path up-projects all L positions (``L·r·H·(nope + v)``
multiply-adds, then attends), the absorbed one reads the latent cache once per query row (``T·H·L·(2r + shared)``).
Short blocks after cached positions — ``T ≤ ABSORBED_TOKENS``: a decode step, a verification of γ + 1 tokens, a
short prefill piece continuing a prompt — take the absorbed path, which costs O(T·L) instead of O(L) up-projections
that grow with the context (paper size: absorbed is cheaper for T below ~170; as vLLM's and FlashMLA's decode
kernels, multi-token ones included). A prompt's first block takes the full path, as a forward without a state does,
so the two give the same logits bit for bit (a single token is absorbed either way).

Weight names follow the peers (transformers ``KimiLinearAttention``, DeepSeek-V3): ``kv_b_proj``'s
output is ``[k_content ; v]`` per head, ``W_dkv`` and ``W_ks`` are the two column blocks of ``kv_a_proj``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from k3.config import K3Config
from k3.model.norm import RMSNorm
from k3.model.projections import constant, project

__all__ = ["ABSORBED_TOKENS", "MLACache", "MLASlots", "MLAWindow", "Storage", "GatedMLA"]

PATHS = ("full", "absorbed")
ABSORBED_TOKENS = 16  # new tokens per row up to which a forward over a cache attends in latent space
RECORD_BLOCK = 512  # query rows per block when recording QK-clip's max logits


SLACK = 256  # positions reserved (at least, rounded to a multiple) past a cache's length when it moves to new storage


@dataclass(eq=False)
class Storage:
    """Preallocated positions behind MLA caches (vLLM's preallocated KV cache, kept immutable to its readers):
    ``latent [B, C, kv_lora_rank]`` and ``shared_key [B, C, qk_shared_head_dim]`` of capacity C, whose first
    ``length`` positions are written — the entries of the longest cache that views it."""

    latent: Tensor
    shared_key: Tensor
    length: int

    @classmethod
    def holding(cls, cache: MLACache, needed: int) -> Storage:
        """New storage holding ``cache``'s entries, with room for ``needed`` positions and `SLACK` or a quarter more."""
        B, L, _ = cache.latent.shape
        capacity = -(-(needed + max(SLACK, needed // 4)) // SLACK) * SLACK
        out = cls(*(t.new_empty(B, capacity, t.shape[2]) for t in (cache.latent, cache.shared_key)), L)
        out.latent[:, :L] = cache.latent
        out.shared_key[:, :L] = cache.shared_key
        return out

    def advance(self, cache: MLACache) -> MLACache:
        """``cache`` (a view of this storage's first positions, just written) as its longest view: appendable."""
        self.length = cache.length
        object.__setattr__(cache, "_storage", self)
        return cache


@dataclass(frozen=True)
class MLACache:
    """The whole per-layer MLA cache (SPEC §2): ``kv_lora_rank + qk_shared_head_dim`` scalars per token.

    ``latent`` ``[B, L, kv_lora_rank]`` is the RMS-normalised ``c_kv``; ``shared_key``
    ``[B, L, qk_shared_head_dim]`` is the unrotated shared key ``k_s``. Values are immutable: `append` returns a new
    cache, and a cache's entries never change. With grad mode off (``torch.no_grad``, inference mode: decoding) the
    entries live in a `Storage` with room to grow, and `append` writes the new entries in place past them — only
    when no cache viewing that storage is longer (the storage's ``length`` equals this cache's), so that no cache
    sees a position change; otherwise (a second continuation of one state, a cache built from plain tensors) the
    entries move to new storage first.
    """

    latent: Tensor
    shared_key: Tensor

    @property
    def length(self) -> int:
        """Number of cached tokens L."""
        return self.latent.shape[1]

    end = None  # every position of the cache is an entry (an `MLAWindow` holds its entries' end as data)

    @property
    def storage(self) -> Storage | None:
        """The storage this cache views and may append into (None: a cache built from plain tensors)."""
        return self.__dict__.get("_storage")

    def append(self, latent: Tensor, shared_key: Tensor) -> MLACache:
        """A new cache with ``[B, T, ·]`` entries appended after the current L."""
        if torch.compiler.is_compiling() or torch.is_grad_enabled():  # autograd may hold views of the cache
            return MLACache(torch.cat([self.latent, latent], dim=1), torch.cat([self.shared_key, shared_key], dim=1))
        return self.slots(latent.shape[1]).append(latent, shared_key)

    def first(self, length: int) -> MLACache:
        """The first ``length`` entries, as views (a cache of plain tensors: its next append copies)."""
        return MLACache(self.latent[:, :length], self.shared_key[:, :length])

    def truncate(self, length: int) -> MLACache:
        """The first ``length`` entries, appendable in place in this cache's storage (a rejected speculative run:
        the positions past ``length`` are written over by the next append, so this cache must not be read after)."""
        out = self.first(length)
        store = self.storage
        return out if store is None or store.length != self.length else store.advance(out)

    def slots(self, tokens: int) -> MLASlots:
        """This cache's entries with room for ``tokens`` more written in place: in its own storage where it is the
        longest cache viewing it, the storage has room and is of the grad mode's kind (inference tensors inside
        `torch.inference_mode`, which outside it cannot be written; normal ones outside, which a compiled step's
        guards tell apart), else in new storage."""
        L, store = self.length, self.storage
        writable = (store is not None and store.length == L and store.latent.shape[1] >= L + tokens
                    and store.latent.is_inference() == torch.is_inference_mode_enabled())
        if not writable:
            store = Storage.holding(self, L + tokens)
        return MLASlots(store.latent, store.shared_key, store.latent.new_empty(1).expand(L), store)


@dataclass(frozen=True)
class MLASlots:
    """An MLA cache of ``filled.shape[0]`` entries at the front of preallocated ``latent_storage [B, C, r]`` and
    ``key_storage [B, C, s]`` (`MLACache.slots`; a compiled step's input, `k3.model.compiled_step`, whose graph writes
    the new entries in place). ``filled`` carries the length as a size (a zero-stride tensor), which a compiled
    graph keeps symbolic; ``storage`` (None inside a graph) is advanced by `append`."""

    latent_storage: Tensor
    key_storage: Tensor
    filled: Tensor
    storage: Storage | None = None

    @property
    def length(self) -> int:
        return self.filled.shape[0]

    @property
    def latent(self) -> Tensor:
        return self.latent_storage[:, :self.length]

    @property
    def shared_key(self) -> Tensor:
        return self.key_storage[:, :self.length]

    def append(self, latent: Tensor, shared_key: Tensor) -> MLACache:
        """Write ``[B, T, ·]`` entries at positions L..L+T−1; returns the cache of L + T entries that views them."""
        for name, new, storage in (("latent", latent, self.latent_storage), ("shared_key", shared_key,
                                                                               self.key_storage)):
            if new.dim() != 3 or new.shape[0] != storage.shape[0] or new.shape[2] != storage.shape[2]:
                raise ValueError(f"append: {name} must be [B={storage.shape[0]}, T, {storage.shape[2]}], "
                                 f"got {list(new.shape)}")
        end = self.length + latent.shape[1]
        self.latent_storage[:, self.length:end].copy_(latent)
        self.key_storage[:, self.length:end].copy_(shared_key)
        out = MLACache(self.latent_storage[:, :end], self.key_storage[:, :end])
        return out if self.storage is None else self.storage.advance(out)


@dataclass(frozen=True)
class MLAWindow:
    """An MLA cache whose length is data, not a shape: entries at the positions before ``end`` (an int64 scalar
    tensor) of ``latent_storage [B, C, r]`` and ``key_storage [B, C, s]``, the rest masked out of attention. A step
    on it has the same shapes at every length, so one CUDA graph replays it (`k3.model.cudagraph`); attention spans
    all C positions. Positions at or past ``end`` must hold finite values (they are multiplied by zero)."""

    latent_storage: Tensor
    key_storage: Tensor
    end: Tensor

    @property
    def length(self) -> int:
        """The window's capacity C: the positions attention spans (those at or past `end` masked)."""
        return self.latent_storage.shape[1]

    @property
    def latent(self) -> Tensor:
        return self.latent_storage

    @property
    def shared_key(self) -> Tensor:
        return self.key_storage

    def append(self, latent: Tensor, shared_key: Tensor) -> MLAWindow:
        """Write ``[B, T, ·]`` entries in place at positions end … end+T−1 (indices computed on the device)."""
        positions = self.end + torch.arange(latent.shape[1], device=self.end.device)
        self.latent_storage.index_copy_(1, positions, latent)
        self.key_storage.index_copy_(1, positions, shared_key)
        return MLAWindow(self.latent_storage, self.key_storage, self.end + latent.shape[1])


def _known_equal(a: int, b: int) -> bool:
    """``a == b`` where known: a compiled graph's symbolic cache length is not known to equal T (keep the mask)."""
    if not torch.compiler.is_compiling():
        return a == b
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(a == b)


class GatedMLA(nn.Module):
    """Gated MLA sequence mixer (SPEC §2, Eq. 7): ``forward(x, state) -> (y, state)``.

    Parameters (all bias-free): the query ``q_proj`` or ``q_a_proj → q_a_norm → q_b_proj``;
    ``kv_a_proj`` (``[W_dkv | W_ks]``), ``kv_a_norm``; ``kv_b_proj`` (``[W_uk_h ; W_uv_h]`` per head);
    ``g_proj`` (the sigmoid output gate, only with ``mla.output_gate``); ``o_proj``.
    """

    def __init__(self, config: K3Config) -> None:
        super().__init__()
        m = config.mla
        d, H = config.hidden_size, m.num_heads
        self.hidden_size = d
        self.num_heads = H
        self.q_lora_rank = m.q_lora_rank
        self.kv_lora_rank = m.kv_lora_rank
        self.nope_dim = m.qk_nope_head_dim
        self.shared_dim = m.qk_shared_head_dim
        self.v_dim = m.v_head_dim
        self.scale = (m.qk_nope_head_dim + m.qk_shared_head_dim) ** -0.5
        self.initializer_range = config.initializer_range
        qk = H * (m.qk_nope_head_dim + m.qk_shared_head_dim)

        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(d, qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, m.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(m.q_lora_rank, eps=m.norm_eps)
            self.q_b_proj = nn.Linear(m.q_lora_rank, qk, bias=False)
        self.kv_a_proj = nn.Linear(d, m.kv_lora_rank + m.qk_shared_head_dim, bias=False)
        self.kv_a_norm = RMSNorm(m.kv_lora_rank, eps=m.norm_eps)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, H * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.g_proj = nn.Linear(d, H * m.v_head_dim, bias=False) if m.output_gate else None
        self.o_proj = nn.Linear(H * m.v_head_dim, d, bias=False)
        # QK-clip observation (SPEC §9): when set, `_attend_full` folds each head's max pre-softmax logit
        # into `max_logits` [H] (elementwise max over calls; the caller resets it to None).
        self.record_max_logits = False
        self.max_logits: Tensor | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Linear weights ~ N(0, initializer_range); RMSNorm gains 1."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=self.initializer_range)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def new_state(self, batch_size: int, device: torch.device | str | None = None,
                  dtype: torch.dtype | None = None) -> MLACache:
        """An empty cache (L = 0) on the parameters' device and dtype unless given."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size: expected a positive integer, got {batch_size!r}")
        weight = self.kv_a_proj.weight
        device = weight.device if device is None else device
        dtype = weight.dtype if dtype is None else dtype
        return MLACache(torch.zeros(batch_size, 0, self.kv_lora_rank, device=device, dtype=dtype),
                        torch.zeros(batch_size, 0, self.shared_dim, device=device, dtype=dtype))

    def forward(self, x: Tensor, state: MLACache | None = None, *, path: str | None = None,
                padding: Tensor | None = None) -> tuple[Tensor, MLACache | None]:
        """Attend causally over ``x`` ``[B, T, d]`` and, given a state, over the cache before it.

        ``state=None`` (training): causal within x; returns ``(y, None)``. With a state the tokens'
        ``(c_kv, k_s)`` are appended before attending (query i sees cache positions ≤ L0 + i) and the
        new cache is returned; the passed-in state is untouched. ``path`` forces "full" or
        "absorbed"; by default one token with a state, or a short block after cached positions (T ≤
        `ABSORBED_TOKENS`: verification), is absorbed and everything else full.
        ``padding`` ``[B]`` (with a state): row b's first ``padding[b]`` cache positions are left
        padding of a batch of unequal lengths and are masked out.
        """
        self._check_inputs(x, state, path, padding)
        B, T, _ = x.shape
        q, c_kv, k_s, gate = self._project(x)
        cache = MLACache(c_kv, k_s) if state is None else state.append(c_kv, k_s)
        absorbed = path == "absorbed" if path is not None else state is not None and (
            T == 1 or T <= ABSORBED_TOKENS and not _known_equal(cache.length, T))
        o = self._attend_absorbed(q, cache, padding) if absorbed else self._attend_full(q, cache, padding)
        if gate is not None:
            o = o * torch.sigmoid(gate).view(B, T, self.num_heads, self.v_dim)
        y = self.o_proj(o.reshape(B, T, self.num_heads * self.v_dim))
        return y, (None if state is None else cache)

    def cache_entries(self, x: Tensor) -> MLACache:
        """The cache entries ``(c_kv, k_s)`` of the tokens ``x`` ``[B, T, d]`` — what context parallelism shares."""
        _, c_kv, k_s, _ = self._project(x)
        return MLACache(c_kv, k_s)

    def chain_step(self, x: Tensor, prefix: MLACache, chain: list[MLACache]) -> tuple[Tensor, MLACache]:
        """EAGLE-3's training-time attention (its "training-time test" mask; SPEC §8): ``x`` ``[B, n, d]`` holds, at
        position i, the next token of the chain drafted after prefix position i. It sees the ``prefix`` entries
        ≤ i (``[B, ≥ n, ·]``: the positions the target consumed), its chain's earlier entries at i (``chain``: one
        cache ``[B, ≥ n, ·]`` per earlier step) and its own entry — what a draft decoding after position i attends
        to. Returns the output ``[B, n, d]`` and x's entries (the next step's last ``chain`` element)."""
        B, n, _ = x.shape
        q, c_kv, k_s, gate = self._project(x)
        own = MLACache(c_kv, k_s)
        k_prefix, v_prefix = self._keys_values(prefix.latent[:, :n], prefix.shared_key[:, :n])
        diagonal = [self._keys_values(c.latent[:, :n], c.shared_key[:, :n]) for c in [*chain, own]]
        causal = torch.arange(n, device=x.device)[None, :] <= torch.arange(n, device=x.device)[:, None]
        scores = torch.cat([(q @ k_prefix.transpose(-1, -2)).masked_fill(~causal, float("-inf")),
                            torch.stack([(q * k).sum(-1) for k, _ in diagonal], dim=-1)], dim=-1) * self.scale
        probs = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1).to(q.dtype)
        o = probs[..., :n] @ v_prefix + sum(probs[..., n + s, None] * v for s, (_, v) in enumerate(diagonal))
        o = o.transpose(1, 2)
        if gate is not None:
            o = o * torch.sigmoid(gate).view(B, n, self.num_heads, self.v_dim)
        return self.o_proj(o.reshape(B, n, self.num_heads * self.v_dim)), own

    # ------------------------------------------------------------------ pieces of Eq. 7
    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """Queries ``[B, H, T, nope + shared]``, the tokens' cache entries c_kv ``[B, T, r]``, k_s ``[B, T, s]``, and
        the output gate's logits ``[B, T, H·v]`` (None without a gate) — x's products in one `project` call."""
        B, T, _ = x.shape
        first = self.q_proj if self.q_lora_rank is None else self.q_a_proj
        q, kv, *gate = project(x, first, self.kv_a_proj, *([] if self.g_proj is None else [self.g_proj]))
        q = q if self.q_lora_rank is None else self.q_b_proj(self.q_a_norm(q))
        q = q.view(B, T, self.num_heads, self.nope_dim + self.shared_dim).transpose(1, 2)
        c_kv, k_s = kv.split([self.kv_lora_rank, self.shared_dim], dim=-1)
        return q, self.kv_a_norm(c_kv), k_s, gate[0] if gate else None

    def _keys_values(self, latent: Tensor, shared_key: Tensor) -> tuple[Tensor, Tensor]:
        """Per-head keys ``[c_kv W_uk_h ; k_s]`` ``[B, H, L, nope + shared]`` and values ``c_kv W_uv_h``
        ``[B, H, L, v]`` of the cache entries ``latent`` ``[B, L, r]``, ``shared_key`` ``[B, L, s]``."""
        B, L, H = latent.shape[0], latent.shape[1], self.num_heads
        kv = self.kv_b_proj(latent).view(B, L, H, self.nope_dim + self.v_dim).transpose(1, 2)
        k_content, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        return torch.cat([k_content, shared_key.unsqueeze(1).expand(B, H, L, self.shared_dim)], dim=-1), v

    def _up_weights(self) -> tuple[Tensor, Tensor]:
        """Views ``W_uk`` ``[H, nope, r]`` and ``W_uv`` ``[H, v, r]`` of ``kv_b_proj.weight`` (no copies; in a graph
        with constant weights, constants of their own: `k3.model.projections.constant`)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return constant(w[:, : self.nope_dim]), constant(w[:, self.nope_dim :])

    @staticmethod
    def _visible(T: int, L: int, device: torch.device, end: Tensor | None = None) -> Tensor:
        """``[T, L]`` boolean mask: query i (absolute position E - T + i, E = ``end`` or L) sees cache positions
        ≤ E - T + i."""
        last = torch.arange(L - T, L, device=device) if end is None else end - T + torch.arange(T, device=device)
        return torch.arange(L, device=device) <= last[:, None]

    @classmethod
    def _mask(cls, T: int, L: int, padding: Tensor | None, device: torch.device,
              end: Tensor | None = None) -> Tensor | None:
        """Visibility ``[T, L]`` (``[B, 1, T, L]`` with padding), or None when everything is visible; ``end``: the
        entries end there (`MLAWindow`), not at L."""
        if padding is None:
            return None if T == 1 and end is None else cls._visible(T, L, device, end)
        real = torch.arange(L, device=device) >= padding.to(device)[:, None]  # [B, L]
        return real[:, None, None, :] & cls._visible(T, L, device, end)

    def _attend_full(self, q: Tensor, cache: MLACache, padding: Tensor | None = None) -> Tensor:
        """Per-head keys ``[c_kv W_uk_h ; k_s]`` and values ``c_kv W_uv_h`` for all L positions, then SDPA.

        ``q`` ``[B, H, T, nope + shared]`` are the last T positions of ``cache``; returns ``[B, T, H, v]``.
        SDPA keeps the softmax in at least fp32 on every backend (half inputs are accumulated in fp32).
        """
        T, L = q.shape[2], cache.length
        k, v = self._keys_values(cache.latent, cache.shared_key)
        mask = self._mask(T, L, padding, q.device, cache.end)
        if self.record_max_logits:
            self._record_max_logits(q, k, mask)
        causal = mask is not None and mask.dim() == 2 and cache.end is None and _known_equal(L, T)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=None if causal else mask, is_causal=causal,
                                           scale=self.scale)
        return o.transpose(1, 2)

    @torch.no_grad()
    def _record_max_logits(self, q: Tensor, k: Tensor, mask: Tensor | None) -> None:
        """Fold the per-head max of the visible scaled logits ``q·k·scale`` (≥ fp32) into `max_logits`.

        Queries go in blocks of `RECORD_BLOCK`, so the transient scores are ``[B, H, block, L]``, not ``T × L``.
        """
        dtype = torch.promote_types(q.dtype, torch.float32)
        k_t = k.to(dtype).transpose(-1, -2)
        T = q.shape[2]
        current = None
        for start in range(0, T, RECORD_BLOCK):
            rows = slice(start, min(start + RECORD_BLOCK, T))
            scores = (q[:, :, rows].to(dtype) @ k_t) * self.scale
            if mask is not None:
                scores = scores.masked_fill(~mask[..., rows, :], float("-inf"))
            block = scores.amax(dim=(0, 2, 3))
            current = block if current is None else torch.maximum(current, block)
        self.max_logits = current if self.max_logits is None else torch.maximum(self.max_logits, current)

    def _attend_absorbed(self, q: Tensor, cache: MLACache, padding: Tensor | None = None) -> Tensor:
        """Latent-space attention: score ``q̃_h · c_kv + q_shared_h · k_s`` with ``q̃_h = W_uk_hᵀ q_content_h``.

        The weighted sum of c_kv is taken in latent space and ``W_uv_h`` applied last. Same inputs
        and output layout as `_attend_full`. Computes in at least fp32, like SDPA: fp16/bf16 operands
        are upcast (a no-op for fp32/fp64), since 576-wide scores rounded to bf16 before the softmax
        are about ten times less accurate than the full path.
        """
        B, H, T, _ = q.shape
        dtype = torch.promote_types(q.dtype, torch.float32)
        w_uk, w_uv = (w.to(dtype) for w in self._up_weights())
        latent, shared_key = cache.latent.to(dtype), cache.shared_key.to(dtype)  # [B, L, ·]: shared by all heads
        q_content, q_shared = q.to(dtype).split([self.nope_dim, self.shared_dim], dim=-1)
        # heads and positions share the cache, so they form one query axis of H·T rows (no per-head copies)
        q_latent = torch.einsum("bhtn,hnr->bhtr", q_content, w_uk).reshape(B, H * T, -1)
        q_shared = q_shared.reshape(B, H * T, -1)
        # compiled, the products over the cache are generated reductions, parallel over its positions: MKL's
        # batched products with H·T = 4 query rows read `small`'s cache at half the rate on CPU (issue 18)
        reduce = torch.compiler.is_compiling()
        if reduce:
            scores = ((q_latent[:, :, None] * latent[:, None]).sum(-1)
                      + (q_shared[:, :, None] * shared_key[:, None]).sum(-1))
        else:
            scores = torch.baddbmm(q_latent @ latent.transpose(1, 2), q_shared, shared_key.transpose(1, 2))
        scores = scores.view(B, H, T, -1) * self.scale
        mask = self._mask(T, cache.length, padding, q.device, cache.end)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(B, H * T, -1)
        o_latent = (probs[..., None] * latent[:, None]).sum(2) if reduce else probs @ latent  # [B, H·T, r]
        return torch.einsum("bhtr,hvr->bthv", o_latent.view(B, H, T, -1), w_uv).to(q.dtype)

    # ------------------------------------------------------------------ validation
    def _check_inputs(self, x: Tensor, state: MLACache | None, path: str | None, padding: Tensor | None) -> None:
        d = self.hidden_size
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != d or not x.is_floating_point():
            got = f"{x.dtype} {list(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x: expected a float tensor [B, T, hidden_size={d}], got {got}")
        if x.shape[0] == 0 or x.shape[1] == 0:
            raise ValueError(f"x: expected at least one sequence and one token, got shape {list(x.shape)}")
        if path is not None and path not in PATHS:
            raise ValueError(f"path: expected one of {PATHS} or None, got {path!r}")
        if state is None:
            if padding is not None:
                raise ValueError("padding: only meaningful with a state (a padded cache)")
            return
        if not isinstance(state, MLACache | MLASlots | MLAWindow):
            raise ValueError(f"state: expected an MLACache or None, got {type(state).__name__}")
        B = x.shape[0]
        for name, t, width in (("latent", state.latent, self.kv_lora_rank),
                               ("shared_key", state.shared_key, self.shared_dim)):
            if not isinstance(t, Tensor) or t.dim() != 3 or t.shape[0] != B or t.shape[2] != width:
                got = list(t.shape) if isinstance(t, Tensor) else type(t).__name__
                raise ValueError(f"state: {name} must be [B={B}, L, {width}], got {got}")
            if t.dtype != x.dtype or t.device != x.device:
                raise ValueError(f"state: {name} is {t.dtype} on {t.device}, x is {x.dtype} on {x.device}")
        if state.shared_key.shape[1] != state.latent.shape[1]:
            raise ValueError(f"state: latent holds {state.latent.shape[1]} tokens, "
                             f"shared_key {state.shared_key.shape[1]}")
        values_checked = not torch.compiler.is_compiling()  # a compiled step's padding is DecoderState.stack's
        if padding is not None and (not isinstance(padding, Tensor) or padding.shape != (B,)
                                    or padding.dtype != torch.int64 or values_checked and (
                                        bool((padding < 0).any()) or bool((padding > state.length).any()))):
            raise ValueError(f"padding: expected int64 [B={B}] in [0, L={state.length}], got {padding!r}")
