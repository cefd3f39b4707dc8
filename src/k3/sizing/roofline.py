"""The roofline of one decode step (issue 18; SPEC §8): the bytes it must read and the FLOPs it must do.

A decode step of ``batch`` sequences, each with ``context`` tokens behind it, cannot take less than
``max(bytes / copy bandwidth, FLOPs / matmul rate)``; a benchmark reports its measured step time as a fraction of
that limit. Counted, from the configuration alone:

* **weights read once per step**: every language-model weight except the routed experts and the embedding table
  (attention, shared experts, routers, latent projections, dense FFNs, norms and AttnRes queries), the LM head
  (the tied table, or its own matrix) and the ``batch`` embedding rows looked up;
* **routed experts**: the experts the step's tokens select, in expectation under uniform routing — each MoE layer
  touches ``E·(1 − (1 − K/E)^batch)`` of its E experts (K for one token, all E for many); `experts_touched`;
* **recurrent state**: each KDA layer reads and writes its fp32 state ``H·K·V`` and its ShortConv window
  ``(W − 1)·C`` per sequence;
* **MLA cache**: each MLA layer reads ``context`` cache entries (latent + shared key) and writes one per sequence.

FLOPs: two per multiply-add of every weight a token touches (`count_parameters`' active parameters without the
embedding lookup), the MLA latent-space attention (``2·context·H·(2·r + s)`` per layer and sequence: scores over
``r + s`` scalars, then the weighted sum of ``r``-wide latents) and the KDA recurrence (``7·H·K·V``: decay, erase,
write, read). Activations (the AttnRes depth sources, a few ``d``-wide vectors per layer) are left out: they are
small next to the weights at decode.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3.config import K3Config
from k3.sizing.params import parameter_breakdown, routed_expert_parameters


def experts_touched(num_experts: int, k: int, tokens: int) -> float:
    """Expected distinct experts ``tokens`` tokens select, each choosing ``k`` of ``num_experts`` uniformly."""
    if not 1 <= k <= num_experts or tokens < 0:
        raise ValueError(f"experts_touched: need 1 ≤ k={k} ≤ num_experts={num_experts} and tokens={tokens} ≥ 0")
    return num_experts * (1 - (1 - k / num_experts) ** tokens)


@dataclass(frozen=True)
class DecodeCost:
    """Bytes (by part) and FLOPs of one decode step; `seconds` is its roofline on a machine."""

    weights: float
    experts: float
    kda_state: float
    mla_cache: float
    flops: float

    @property
    def bytes(self) -> float:
        return self.weights + self.experts + self.kda_state + self.mla_cache

    def seconds(self, bandwidth: float, flops_rate: float) -> float:
        """The limit: ``max(bytes / bandwidth, FLOPs / flops_rate)`` (bytes/s and FLOP/s)."""
        return max(self.bytes / bandwidth, self.flops / flops_rate)

    def bound(self, bandwidth: float, flops_rate: float) -> str:
        """Which roof the step is under: ``"memory"`` or ``"compute"``."""
        return "memory" if self.bytes / bandwidth >= self.flops / flops_rate else "compute"


def decode_cost(config: K3Config, batch: int, context: int, weight_bytes: int = 4, cache_bytes: int = 4) -> DecodeCost:
    """`DecodeCost` of one decode step of ``batch`` sequences with ``context`` tokens each behind them; weights in
    ``weight_bytes``, the ShortConv windows and MLA caches in ``cache_bytes`` (the KDA state is fp32 at least)."""
    c = config.validate()
    if batch < 1 or context < 0:
        raise ValueError(f"decode_cost: batch = {batch} must be ≥ 1 and context = {context} ≥ 0")
    d, v, e = c.hidden_size, c.vocab_size, c.moe
    parts = parameter_breakdown(c)
    language = parts["total"][0] - parts["vision encoder"][0] - parts["vision projector"][0]
    table = v * d * (1 if c.tie_word_embeddings else 2)  # embedding table (+ untied head)
    routed = routed_expert_parameters(c)
    weights = (language - routed - table + v * d + min(batch, v) * d) * weight_bytes
    moes = c.ffn_kinds().count("moe")
    per_expert = routed // max(1, moes * e.num_experts)
    touched = experts_touched(e.num_experts, e.num_experts_per_token, batch) if moes else 0.0
    experts = moes * touched * per_expert * weight_bytes
    kinds, k, m = c.layer_kinds(), c.kda, c.mla
    channels = k.num_heads * (2 * k.head_dim + k.value_head_dim)
    kda_state = kinds.count("kda") * batch * 2 * (k.num_heads * k.head_dim * k.value_head_dim * max(4, cache_bytes)
                                                  + (k.conv_size - 1) * channels * cache_bytes)
    mla_cache = kinds.count("mla") * batch * (context + 1) * m.cache_scalars_per_token() * cache_bytes
    active = parts["total"][1] - (v * d if not c.tie_word_embeddings else 0)  # the lookup is no matmul
    attention = kinds.count("mla") * batch * 2 * context * m.num_heads * (2 * m.kv_lora_rank + m.qk_shared_head_dim)
    recurrence = kinds.count("kda") * batch * 7 * k.num_heads * k.head_dim * k.value_head_dim
    return DecodeCost(weights, experts, kda_state, mla_cache, 2 * batch * active + attention + recurrence)
