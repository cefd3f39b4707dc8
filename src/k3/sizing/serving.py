"""``k3 plan``: the memory to serve a configuration on one machine (SPEC §8, §10), computed from the config.

Weights are split the way `K3ForCausalLM.from_pretrained` holds a release: routed experts stay MXFP4-packed
in memory-mapped shards (4.25 bits per weight: 4-bit elements + one 8-bit scale per 32), read from disk as
tokens choose them; everything else is resident at the serving dtype. Per sequence: the KDA recurrent
states (fp32) and convolution windows, and the MLA cache (latent + shared key) per token of context.
"""

from __future__ import annotations

from typing import Any

import torch

from k3.sizing.params import MXFP4_BITS, routed_expert_parameters
from k3.config import K3Config
from k3.sizing.memory import available_bytes, model_parameters


def plan(config: K3Config, context: int, batch: int = 1, dtype_bytes: int = 2) -> dict[str, Any]:
    """Bytes of each part of serving ``config`` to ``batch`` sequences of ``context`` tokens."""
    c = config.validate()
    kinds, e = c.layer_kinds(), c.moe
    routed = routed_expert_parameters(c)
    resident = (model_parameters(c) - routed) * dtype_bytes
    packed = routed * MXFP4_BITS / 8
    kda = c.kda
    kda_state = kinds.count("kda") * (kda.num_heads * kda.head_dim * kda.value_head_dim * 4 + (kda.conv_size - 1)
                                      * kda.num_heads * (2 * kda.head_dim + kda.value_head_dim) * dtype_bytes)
    mla_per_token = kinds.count("mla") * c.mla.cache_scalars_per_token() * dtype_bytes
    per_sequence = kda_state + mla_per_token * context
    touched = routed * e.num_experts_per_token / e.num_experts * MXFP4_BITS / 8
    return {
        "resident_weights": resident, "packed_experts": packed, "kda_state_per_sequence": kda_state,
        "mla_cache_per_token": mla_per_token, "per_sequence": per_sequence, "sequences": batch,
        "context": context, "caches": batch * per_sequence, "resident_total": resident + batch * per_sequence,
        "all_in_memory": resident + packed + batch * per_sequence, "experts_read_per_token": touched,
        "machine_available": available_bytes(torch.device("cpu")),
    }


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def format_plan(p: dict[str, Any], title: str) -> str:
    lines = [f"Serving memory plan — {title} ({p['sequences']} sequence(s) of {p['context']:,} tokens)", ""]
    row = lambda k, v: lines.append(f"  {k:<40} {v}")  # noqa: E731
    row("resident weights (non-expert, bf16)", _gib(p["resident_weights"]))
    row("routed experts, MXFP4 packed (mmap)", _gib(p["packed_experts"]))
    row("KDA state per sequence (fp32 + conv)", _gib(p["kda_state_per_sequence"]))
    row("MLA cache per token (bf16)", f"{p['mla_cache_per_token']:,} bytes")
    row("caches, all sequences", _gib(p["caches"]))
    row("must be resident", _gib(p["resident_total"]))
    row("everything in memory (experts cached)", _gib(p["all_in_memory"]))
    row("expert bytes read per decoded token", _gib(p["experts_read_per_token"]))
    if p["machine_available"] is not None:
        avail = p["machine_available"]
        row("this machine: memory available", _gib(avail))
        verdict = ("fits entirely" if p["all_in_memory"] <= avail else "fits with experts paged from disk"
                   if p["resident_total"] <= avail else "does not fit: the resident part alone exceeds memory")
        row("verdict", verdict)
    return "\n".join(lines)
