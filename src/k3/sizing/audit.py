"""The configuration audit printed by ``k3 info`` (SPEC §0): schedule, caches, depth, routing, parameters."""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Any

from k3.config import (
    ASSUMPTIONS,
    PUBLISHED_ACTIVE,
    PUBLISHED_TOTAL,
    PUBLISHED_VISION,
    RELEASE_DECISIONS,
    K3Config,
    preset,
)
from k3.sizing.params import checkpoint_bytes, parameter_breakdown, vision_parameters


def _mixed(fraction: Fraction) -> str:
    whole, rest = divmod(fraction.numerator, fraction.denominator)
    return f"{whole} {rest}/{fraction.denominator}" if rest else str(whole)


def audit(config: K3Config) -> dict[str, Any]:
    """Every audited quantity of a (validated) config, as plain data."""
    config.validate()
    kinds = config.layer_kinds()
    mla, kda, moe = config.mla, config.kda, config.moe
    full, partial = divmod(config.num_layers, config.attn_res.block_size)
    breakdown = parameter_breakdown(config)
    total, active = breakdown["total"]
    paper = preset("paper")
    # the release lists its MLA layers explicitly; the same schedule as the period rule is the same model
    is_paper = dataclasses.replace(config, mla_layers=None) == paper and config.layer_kinds() == paper.layer_kinds()
    return {
        "layers": config.num_layers,
        "kda_layers": kinds.count("kda"),
        "mla_layers": kinds.count("mla"),
        "mla_indices": [i + 1 for i, kind in enumerate(kinds) if kind == "mla"],
        "dense_layers": config.ffn_kinds().count("dense"),
        "mla_cache_per_token": mla.cache_scalars_per_token(),
        "mla_expanded_per_token": mla.expanded_scalars_per_token(),
        "mla_cache_ratio": Fraction(mla.expanded_scalars_per_token(), mla.cache_scalars_per_token()),
        "kda_state_per_layer": kda.num_heads * kda.head_dim * kda.value_head_dim,
        "kda_conv_window_per_layer": (kda.conv_size - 1) * kda.num_heads * (2 * kda.head_dim + kda.value_head_dim),
        "attn_res": config.attn_res.enabled,
        "depth_sources": config.depth_sources(),
        "complete_blocks": full,
        "partial_block_layers": partial,
        "routed_fraction": Fraction(moe.num_experts_per_token, moe.num_experts),
        "active_fraction": active / total,
        "total": total,
        "active": active,
        "vision": vision_parameters(config)[0],
        "breakdown": breakdown,
        "checkpoint_bytes": checkpoint_bytes(config),
        "published": {"total": PUBLISHED_TOTAL, "active": PUBLISHED_ACTIVE, "vision": PUBLISHED_VISION}
        if is_paper else None,
        "assumptions": ASSUMPTIONS if is_paper else {},
        "release": RELEASE_DECISIONS if is_paper else {},
        "context_length": config.context_length,
    }


def _ranges(indices: list[int]) -> str:
    return ", ".join(str(i) for i in indices)


def _human(n: float) -> str:
    """2.78e12 → '2.78T', 104.2e9 → '104.2B', 401e6 → '401M'."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if n >= size:
            return f"{n / size:.4g}{unit}"
    return f"{n:,.0f}"


def _bytes(n: float) -> str:
    """1.5e12 → '1.36 TiB' (binary units)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n / 2**10:.3g} KiB"


def format_audit(a: dict[str, Any], title: str) -> str:
    """The audit as a human-readable table."""
    lines = [f"Kimi K3 configuration audit — {title}", ""]
    row = lambda k, v: lines.append(f"  {k:<28} {v}")  # noqa: E731
    row("layers", f"{a['layers']} = {a['kda_layers']} KDA + {a['mla_layers']} MLA")
    row("MLA layer indices (1-based)", _ranges(a["mla_indices"]))
    row("FFN", f"{a['dense_layers']} dense + {a['layers'] - a['dense_layers']} MoE")
    row("MLA cache / token / layer", f"{a['mla_cache_per_token']:,} scalars (latent + shared key)")
    row("  expanded per-head layout", f"{a['mla_expanded_per_token']:,} scalars; ratio {_mixed(a['mla_cache_ratio'])}")
    row("KDA state / layer", f"{a['kda_state_per_layer']:,} scalars + conv window {a['kda_conv_window_per_layer']:,}")
    if a["attn_res"]:
        row("AttnRes sources (end)", f"{a['depth_sources']} = embedding + {a['complete_blocks']} complete blocks"
            + (f" + 1 partial ({a['partial_block_layers']} layers)" if a["partial_block_layers"] else ""))
    else:
        row("AttnRes", "off (plain residual stream)")
    rf = a["routed_fraction"]
    row("routed fraction", f"{rf.numerator}/{rf.denominator} = {float(rf):.2%} of routed experts per token")
    row("active / total", f"{a['active_fraction']:.2%} of parameters per token")
    row("context", f"{a['context_length']:,} tokens")
    lines += ["", f"  {'parameters':<26} {'counted':>18} {'published':>12} {'difference':>11}"]
    published = a["published"] or {}
    for key in ("total", "active", "vision encoder"):
        ours, theirs = a[key.split()[0]], published.get(key.split()[0])
        diff = f"{ours / theirs - 1:+.2%}" if theirs else ""
        lines.append(f"  {key:<26} {ours:>18,} {_human(theirs) if theirs else '':>12} {diff:>11}")
    lines += ["", f"  {'component':<26} {'total':>18} {'active':>18}"]
    for name, (total, active) in a["breakdown"].items():
        if name != "total":
            lines.append(f"  {name:<26} {total:>18,} {active:>18,}")
    size = a["checkpoint_bytes"]
    lines += ["", f"  {'checkpoint size':<26} {'bytes':>18}",
              f"  {'all weights bf16':<26} {size['bf16']:>18,.0f} {_bytes(size['bf16']):>12}",
              f"  {'routed experts MXFP4':<26} {size['mxfp4_experts']:>18,.0f} {_bytes(size['mxfp4_experts']):>12}"
              f"  ({size['routed_experts'] / a['total']:.1%} of parameters at 4.25 bits, the rest bf16)"]
    if a["release"]:
        lines += ["", "  from the release (moonshotai/Kimi-K3), where the paper is silent or differs:"]
        lines += [f"    - {name}: {why}" for name, why in a["release"].items()]
    if a["assumptions"]:
        lines += ["", "  assumed (not published):"]
        lines += [f"    - {name}: {why}" for name, why in a["assumptions"].items()]
    return "\n".join(lines)
