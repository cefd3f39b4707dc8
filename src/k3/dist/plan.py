"""``k3 plan --gpus N``: the per-rank memory and communication of training a configuration (SPEC §0, §7, §8).

Pure functions of a `K3Config`, a `ParallelLayout` (`k3.dist.layout`), the sequence length and the sequences per
data rank (one micro-batch = one optimiser step, no gradient accumulation); no process group is touched.

Mixed precision (FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``): every rank keeps its shard
of the fp32 master parameters and fp32 gradients; a unit's weights are all-gathered in bf16 for compute (forward,
and again in backward), gradients reduce-scattered in fp32. Optimiser (SPEC §7, `k3.train.optim`): Muon keeps one
fp32 momentum per hidden matrix (routed experts included), AdamW two fp32 moments for embeddings, LM head, 1-D
parameters, the KDA ShortConv and the vision patch / position tables.

Sharding (`k3.dist.layout`): routed experts are split over ``ep`` and FSDP-sharded over ``dp_shard × cp``; every
other parameter is FSDP-sharded over ``dp_shard × ep × cp``; both are replicated over ``dp_replicate``. A shard is an
even split of the element count (FSDP2's dim-0 padding, at most n − 1 rows per tensor, is not counted).

Communication is counted as **bytes one rank receives from the other ranks** (what a collective writes into its
output minus the rank's own piece; ring algorithms for all-gather, reduce-scatter and all-reduce): all-gather of a
tensor of total size S over n ranks → (n − 1)/n·S; reduce-scatter → (n − 1)/n·S; all-reduce → 2(n − 1)/n·S;
all-to-all with balanced routing (MoonEP, SPEC §8) → (n − 1)/n of the buffer. Bytes are integers (floored).

Without a layout, `propose_layouts` plans every factorisation of the GPUs the model admits and keeps those that fit,
least communication per token first (``k3 plan --gpus N`` with no layout flag).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from k3.config import K3Config
from k3.sizing.params import (
    kda_layer_parameters,
    mla_layer_parameters,
    moe_layer_parameters,
    parameter_breakdown,
    routed_expert_parameters,
)
from k3.dist.layout import MESH_DIMS, ParallelLayout

FP32 = 4
GIB = 2**30


def parameter_split(config: K3Config) -> dict[str, int]:
    """Elements by optimiser and sharding class, as `k3.train.optim.build_optimizers` groups them: ``experts``
    (routed experts, Muon), ``muon`` (every other hidden matrix: projections, router, shared experts, latent
    projections, dense FFN, vision linears) and ``adamw`` (embeddings, LM head, 1-D gains, ``A_log``, ``dt_bias``,
    ShortConv, vision patch embedding and position table)."""
    c = config.validate()
    k, m, v = c.kda, c.mla, c.vision
    kinds, ffns = c.layer_kinds(), c.ffn_kinds()
    parts = parameter_breakdown(c)
    hk, hv = k.num_heads * k.head_dim, k.num_heads * k.value_head_dim
    kda = k.conv_size * (2 * hk + hv) + (k.num_heads if k.a_log_size is None else k.a_log_size) \
        + (hk if k.decay == "channel" else k.num_heads) + k.value_head_dim  # ShortConv, A_log, dt_bias, o_norm
    mla = (m.q_lora_rank or 0) + m.kv_lora_rank  # q_a and kv_a latent norms
    vision = 0
    if v.enabled:
        vision = v.in_channels * v.patch_size**2 * v.hidden_size + v.pos_emb_size**2 * v.hidden_size \
            + (2 * v.num_layers + 1) * v.hidden_size + v.out_dim  # patch conv, position table, norms
    adamw = parts["embedding + lm head"][0] + parts["norms + attnres"][0] + kinds.count("kda") * kda \
        + kinds.count("mla") * mla + ffns.count("moe") * (c.moe.latent_dim or 0) + vision
    routed = routed_expert_parameters(c)
    return {"experts": routed, "muon": parts["total"][0] - routed - adamw, "adamw": adamw}


def _share(total: int, n: int, index: int) -> int:
    """Elements of ``total`` held by member ``index`` of ``n`` (an even split, the first ones one more)."""
    return total // n + (index < total % n)


def _ring(size: int, n: int) -> int:
    """Bytes a rank receives in an all-gather or reduce-scatter of ``size`` total bytes over ``n`` ranks."""
    return size * (n - 1) // n


def shard_elements(config: K3Config, layout: ParallelLayout, rank: int = 0) -> dict[str, int]:
    """Elements of each `parameter_split` class that ``rank`` holds (mesh coordinates row-major over
    ``MESH_DIMS``): its ``ep`` group's experts split over ``dp_shard × cp``, the rest split over
    ``dp_shard × ep × cp``."""
    split = parameter_split(config)
    coords = dict(zip(MESH_DIMS, _coords(layout, rank)))
    dense = (coords["dp_shard"] * layout.ep + coords["ep"]) * layout.cp + coords["cp"]
    expert = coords["dp_shard"] * layout.cp + coords["cp"]
    n = layout.dp_shard * layout.ep * layout.cp
    return {"experts": _share(split["experts"] // layout.ep, layout.dp_shard * layout.cp, expert),
            "muon": _share(split["muon"], n, dense), "adamw": _share(split["adamw"], n, dense)}


def _coords(layout: ParallelLayout, rank: int) -> tuple[int, ...]:
    if not 0 <= rank < layout.world:
        raise ValueError(f"rank {rank} is outside the {layout.world} ranks of the layout")
    out = []
    for size in reversed(layout.shape):
        rank, i = divmod(rank, size)
        out.append(i)
    return tuple(reversed(out))


def state_bytes(config: K3Config, layout: ParallelLayout, rank: int = 0) -> dict[str, int]:
    """Persistent bytes on ``rank``: fp32 master shard, fp32 gradient shard, optimiser moments (Muon 1, AdamW 2)."""
    s = shard_elements(config, layout, rank)
    held = sum(s.values())
    return {"parameters": held * FP32, "gradients": held * FP32,
            "optimizer": (s["experts"] + s["muon"]) * FP32 + s["adamw"] * 2 * FP32}


def fsdp_units(config: K3Config, layout: ParallelLayout) -> dict[str, int]:
    """Elements a rank all-gathers per FSDP unit: each decoder layer (mixer, FFN with its ``ep`` group's experts,
    norms, AttnRes queries), the embedding, the LM head (+ final norm and query), the vision model."""
    c = config.validate()
    d, e = c.hidden_size, c.moe
    width = d if e.latent_dim is None else e.latent_dim
    local_experts = e.num_experts // layout.ep * 3 * width * e.expert_hidden
    moe = moe_layer_parameters(c)[0] - e.num_experts * 3 * width * e.expert_hidden + local_experts
    retrieval = (2 if c.attn_res.key_gain else 1) * d if c.attn_res.enabled else 0
    units = {}
    for i, (kind, ffn) in enumerate(zip(c.layer_kinds(), c.ffn_kinds())):
        mixer = kda_layer_parameters(c) if kind == "kda" else mla_layer_parameters(c)
        units[f"layer {i + 1} ({kind}+{ffn})"] = mixer + (moe if ffn == "moe" else 3 * d * e.dense_hidden) \
            + 2 * d + 2 * retrieval
    units["embedding"] = c.vocab_size * d
    units["lm head"] = (0 if c.tie_word_embeddings else c.vocab_size * d) + d + retrieval
    parts = parameter_breakdown(c)
    if c.vision.enabled:
        units["vision"] = parts["vision encoder"][0] + parts["vision projector"][0]
    return units


def fsdp_bytes(config: K3Config, layout: ParallelLayout, param_bytes: int = 2,
               grad_bytes: int = FP32) -> dict[str, int]:
    """FSDP2 bytes received per rank per step: ``all_gather`` of every unit's ``param_bytes`` weights in forward
    and again in backward (``reshard_after_forward``; a full recompute runs inside the backward gather, adding
    none) — except the root unit (embedding, LM head, final norm), which FSDP2 keeps gathered from forward to
    backward —, ``reduce_scatter`` of the ``grad_bytes`` gradients once, and with
    ``dp_replicate > 1`` the HSDP ``all_reduce`` of the gradient shard across replicas. Non-expert units gather
    over ``dp_shard × ep × cp`` ranks, the ``ep`` group's experts over ``dp_shard × cp``. The vision encoder is its
    own unit, counted as used (a text-only run never gathers it: plan with ``vision.enabled = false``)."""
    split, units = parameter_split(config), fsdp_units(config, layout)
    dense, experts = split["muon"] + split["adamw"], split["experts"] // layout.ep
    n_dense, n_expert = layout.dp_shard * layout.ep * layout.cp, layout.dp_shard * layout.cp
    root = units["embedding"] + units["lm head"]
    gathered = 2 * (_ring(dense * param_bytes, n_dense) + _ring(experts * param_bytes, n_expert)) \
        - _ring(root * param_bytes, n_dense)
    r = layout.dp_replicate
    shard = sum(shard_elements(config, layout).values()) * grad_bytes
    return {"all_gather": gathered,
            "reduce_scatter": _ring(dense * grad_bytes, n_dense) + _ring(experts * grad_bytes, n_expert),
            "replicate_all_reduce": 2 * shard * (r - 1) // r}


def muon_bytes(config: K3Config, layout: ParallelLayout, grad_bytes: int = FP32) -> dict[str, int]:
    """Muon's owner strategy, bytes received per rank per step: each hidden matrix's full gradient is gathered on
    one owner rank of its shard group (``gather``: the owner receives (n − 1)/n of it) and the orthogonalised update
    scattered back (``scatter``: each other rank receives its 1/n) — 2(n − 1)/n × size per matrix across the
    group (`k3.dist.muon.owner_update`); owners rotate over the matrices, so one rank receives 1/n of the group's
    total on average. Groups: non-expert matrices over ``dp_shard × ep × cp``, the ``ep`` group's experts over
    ``dp_shard × cp``; direction and update in ``grad_bytes``. Row padding to a multiple of n is not counted."""
    split = parameter_split(config)
    per_rank = 0
    for elements, n in ((split["muon"], layout.dp_shard * layout.ep * layout.cp),
                        (split["experts"] // layout.ep, layout.dp_shard * layout.cp)):
        per_rank += elements * grad_bytes * (n - 1) // (n * n)
    return {"gather": per_rank, "scatter": per_rank}


def all_to_all_bytes(config: K3Config, layout: ParallelLayout, tokens_per_rank: int, dtype_bytes: int = 2,
                     recompute: bool = False) -> int:
    """MoE all-to-all bytes received per rank per step, all MoE layers: each of the rank's ``tokens_per_rank``
    tokens goes to K experts at the routed width ℓ (``moe.latent_dim``; d for a plain MoE) in ``dtype_bytes``.
    With balanced routing (MoonEP: every rank processes exactly tokens × K assignments) a rank receives
    (ep − 1)/ep of its tokens × K × ℓ per exchange; four exchanges per layer — dispatch and combine in forward,
    their gradients in backward — and two more with a full recompute (the forward runs again). Not counted
    (`k3.dist.expert`): the int64 load counts all-gathered per layer and MoonEP's redundant expert weight copies."""
    e, moes = config.moe, config.ffn_kinds().count("moe")
    width = config.hidden_size if e.latent_dim is None else e.latent_dim
    buffer = tokens_per_rank * e.num_experts_per_token * width * dtype_bytes
    return (6 if recompute else 4) * moes * (buffer * (layout.ep - 1) // layout.ep)


def cp_bytes_per_layer(config: K3Config, layout: ParallelLayout, seq: int, sequences: int = 1, dtype_bytes: int = 2,
                       backward: bool = False) -> dict[str, int]:
    """Context-parallel bytes received per rank per layer (SPEC §8, `k3.dist.context`) for ``sequences`` sequences of
    ``seq`` tokens cut into ``cp`` segments. Forward: ``kda`` all-gathers the fp32 segment summary ``H·K·(K + V)``
    (M and U) and the ShortConv halo ``(W − 1)·(2H·K + H·V)`` in ``dtype_bytes`` per sequence, plus an int64 count —
    independent of ``seq``; ``mla`` all-gathers ``kv_lora_rank + qk_shared_head_dim`` scalars per token of the
    longest segment, ⌈seq/cp⌉, plus an int64 length — linear in ``seq``. ``backward``: `all_gather_grad`'s
    all-reduce of the cp gathered gradients (ring), twice the forward's differentiable bytes, counts excluded."""
    k, m, n = config.kda, config.mla, layout.cp
    state = sequences * k.num_heads * k.head_dim * (k.head_dim + k.value_head_dim) * FP32
    halo = sequences * (k.conv_size - 1) * k.num_heads * (2 * k.head_dim + k.value_head_dim) * dtype_bytes
    entries = sequences * math.ceil(seq / n) * m.cache_scalars_per_token() * dtype_bytes
    if backward:
        return {"kda": 2 * (n - 1) * (state + halo), "mla": 2 * (n - 1) * entries}
    return {"kda": (n - 1) * (state + halo + 8), "mla": (n - 1) * (entries + 8)}


def activation_bytes_per_token(config: K3Config, dtype_bytes: int = 2, context: int | None = None) -> dict[str, int]:
    """Bytes kept for backward per token (the tensors autograd saves in an eager implementation, ``a`` =
    ``dtype_bytes``, fp32 where the model computes in fp32), per layer kind:

    * ``kda``: q/k/v projections, ShortConv output, SiLU output (3 × (2HK + HV)·a), L2-normed q, k (2HK·a), decay
      low rank, z (a) and g (fp32), β (a + fp32), kernel output, o_norm output, gate sigmoid (3HV fp32), gate and
      o_proj input (2HV·a). The chunked kernel recomputes its chunk states in backward (as fla's kernels do).
    * ``mla``: query latent and its norm, q, KV latent + shared key, its norm, kv_b output, k, v, attention output,
      gate, o_proj input (a), gate sigmoid and log-sum-exp (fp32) — flash attention. With ``context`` (no flash),
      also the H × context softmax probabilities (a).
    * ``moe``: router logits and scores (2E fp32), latent down, norm and combined output (3ℓ·a), K dispatched inputs
      and expert outputs (2Kℓ·a), expert gate, up and activation (3KF·a), shared experts (3·n_s·F_s·a).
    * ``dense``: gate, up and activation (3F·a). ``layer``: per layer the two AttnRes retrievals, their RMSNorms and
      the partial sum (5d·a). ``checkpoint``: what a full recompute keeps per layer, its input partial sum (d·a).
    * once per model: ``sources`` (AttnRes block sums and their normed keys, 2·sources·d·a; the residual d·a
      without AttnRes) and ``head`` (final retrieval and norm 2d·a, bf16 logits and the fp32 log-softmax the
      cross-entropy saves, V·(a + 4)).
    """
    c, a = config, dtype_bytes
    k, m, e, d = c.kda, c.mla, c.moe, c.hidden_size
    hk, hv = k.num_heads * k.head_dim, k.num_heads * k.value_head_dim
    c3 = 2 * hk + hv
    kda = a * (3 * c3 + 2 * hk + k.decay_rank + hk + k.num_heads + 2 * hv) + FP32 * (hk + k.num_heads + 3 * hv)
    qk, hvm = m.num_heads * (m.qk_nope_head_dim + m.qk_shared_head_dim), m.num_heads * m.v_head_dim
    mla = a * (2 * (m.q_lora_rank or 0) + 2 * qk + 2 * m.kv_lora_rank + m.qk_shared_head_dim
               + m.num_heads * (m.qk_nope_head_dim + m.v_head_dim) + 4 * hvm) + FP32 * (m.num_heads + hvm)
    if context is not None:
        mla += a * m.num_heads * context
    width = d if e.latent_dim is None else e.latent_dim
    moe = FP32 * 2 * e.num_experts + a * ((0 if e.latent_dim is None else 3 * width)
                                          + e.num_experts_per_token * (2 * width + 3 * e.expert_hidden)
                                          + 3 * e.num_shared_experts * e.shared_hidden)
    sources = 2 * c.depth_sources() * d * a if c.attn_res.enabled else d * a
    return {"kda": kda, "mla": mla, "moe": moe, "dense": 3 * e.dense_hidden * a, "layer": 5 * d * a,
            "checkpoint": d * a, "sources": sources, "head": 2 * d * a + c.vocab_size * (a + FP32)}


def activation_bytes(config: K3Config, tokens: int, dtype_bytes: int = 2, recompute: bool = True,
                     context: int | None = None) -> dict[str, int]:
    """Activations of ``tokens`` tokens on one rank: ``stored`` (kept through the forward: every layer's activations,
    or with a full recompute every layer's checkpoint; plus sources and head) and ``recompute_layer`` (the largest
    layer's activations, rebuilt one at a time in backward; 0 without recompute)."""
    t = activation_bytes_per_token(config, dtype_bytes, context)
    layers = [t[kind] + t[ffn] + t["layer"] for kind, ffn in zip(config.layer_kinds(), config.ffn_kinds())]
    once = t["sources"] + t["head"]
    if recompute:
        return {"stored": tokens * (len(layers) * t["checkpoint"] + once), "recompute_layer": tokens * max(layers)}
    return {"stored": tokens * (sum(layers) + once), "recompute_layer": 0}


def build_layout(config: K3Config, gpus: int, seq: int, dp_replicate: int | None = None,
                 dp_shard: int | None = None, ep: int | None = None, cp: int | None = None) -> ParallelLayout:
    """`ParallelLayout.for_world(...).validate(config)` with the world size named ``--gpus`` in errors. Nothing
    splits heads (no tensor parallelism), so only the experts (``ep``) and the sequence (``cp``) are checked."""
    try:
        return ParallelLayout.for_world(gpus, dp_replicate, dp_shard, ep, cp).validate(config, seq_lens=[seq])
    except ValueError as err:
        raise ValueError(str(err).replace(" (--nproc)", "").replace("the world size", "--gpus")
                         .replace("--nproc", "--gpus")) from err


def training_plan(config: K3Config, layout: ParallelLayout, seq: int, sequences: int = 1,
                  gpu_memory_gb: float | None = None, dtype_bytes: int = 2, recompute: bool = True,
                  flash: bool = True) -> dict[str, Any]:
    """Per-rank memory and communication of one step (SPEC §7, §8); with ``gpu_memory_gb`` (GiB), a ValueError
    naming the flag to change when the peak does not fit. Peak = model state + stored activations + the FSDP
    transient (two gathered units in ``dtype_bytes`` — the current one and the prefetched next — plus one unit's
    unsharded gradient in ``dtype_bytes`` and its fp32 reduce-scatter input) + the larger of the recomputed layer
    and, without ``flash``, one MLA layer's fp32 scores (queries of the segment × H × ``seq`` keys)."""
    c = config.validate()
    if seq < 1 or sequences < 1:
        raise ValueError(f"--seq {seq} and --batch-seqs {sequences} must be positive")
    tokens = sequences * math.ceil(seq / layout.cp)
    state = state_bytes(c, layout)
    acts = {mode: activation_bytes(c, tokens, dtype_bytes, mode, None if flash else seq) for mode in (True, False)}
    unit = max(fsdp_units(c, layout).values())
    transient = {"fsdp_units": unit * (3 * dtype_bytes + FP32),
                 "mla_scores": 0 if flash else tokens * c.mla.num_heads * seq * FP32}
    model_state = sum(state.values())
    totals = {mode: model_state + acts[mode]["stored"] + transient["fsdp_units"]
              + max(acts[mode]["recompute_layer"], transient["mla_scores"]) for mode in (True, False)}
    cp_layers = {n: {"forward": cp_bytes_per_layer(c, layout, n, sequences, dtype_bytes),
                     "backward": cp_bytes_per_layer(c, layout, n, sequences, dtype_bytes, backward=True)}
                 for n in (seq, 4 * seq)}
    kinds = c.layer_kinds()
    fwd, bwd = cp_layers[seq]["forward"], cp_layers[seq]["backward"]
    cp_step = sum(kinds.count(kind) * ((2 if recompute else 1) * fwd[kind] + bwd[kind]) for kind in ("kda", "mla"))
    p = {"layout": dict(zip(MESH_DIMS, layout.shape)), "gpus": layout.world, "data_ranks": layout.data_ranks,
         "seq": seq, "sequences_per_data_rank": sequences, "tokens_per_rank": tokens,
         "tokens_per_step": layout.data_ranks * sequences * seq, "recompute": recompute, "flash": flash,
         "parameter_split": parameter_split(c), "shard": shard_elements(c, layout), **state,
         "activation_per_token": activation_bytes_per_token(c, dtype_bytes, None if flash else seq),
         "activations_recompute": acts[True], "activations_no_recompute": acts[False],
         "largest_fsdp_unit": unit, "transient": transient, "total": totals[recompute],
         "total_recompute": totals[True], "total_no_recompute": totals[False],
         "moe_all_to_all": all_to_all_bytes(c, layout, tokens, dtype_bytes, recompute),
         "fsdp": fsdp_bytes(c, layout, dtype_bytes), "muon": muon_bytes(c, layout),
         "cp_per_layer": {str(n): v for n, v in cp_layers.items()}, "cp_per_step": cp_step}
    if gpu_memory_gb is not None:
        p["budget"] = int(gpu_memory_gb * GIB)
        _check_fits(p, recompute)
    return p


def all_layouts(gpus: int) -> Iterator[ParallelLayout]:
    """Every layout of ``gpus`` ranks: each ordered factorisation ``dp_replicate × dp_shard × ep × cp``."""
    divisors = [n for n in range(1, gpus + 1) if gpus % n == 0]
    for replicate in divisors:
        for ep in (n for n in divisors if gpus // replicate % n == 0):
            for cp in (n for n in divisors if gpus // (replicate * ep) % n == 0):
                yield ParallelLayout(replicate, gpus // (replicate * ep * cp), ep, cp)


def communication_bytes(p: dict[str, Any]) -> int:
    """Bytes one rank receives per step in plan ``p``: MoE all-to-all, FSDP, Muon and context parallelism."""
    return p["moe_all_to_all"] + sum(p["fsdp"].values()) + sum(p["muon"].values()) + p["cp_per_step"]


def propose_layouts(config: K3Config, gpus: int, seq: int, sequences: int = 1, gpu_memory_gb: float = 80.0,
                    dtype_bytes: int = 2, recompute: bool = True, flash: bool = True) -> list[dict[str, Any]]:
    """The `training_plan` of every layout of ``gpus`` that the model admits (`build_layout`'s checks) and whose
    per-rank peak fits ``gpu_memory_gb``, each with its ``communication`` (`communication_bytes`), ranked by bytes
    received per token a rank trains (a layout that trains fewer tokens per rank, more ``cp``, must move fewer bytes
    to rank ahead), then by memory. None fits: a ValueError on the layout with the smallest peak, saying what to
    change."""
    c = config.validate()
    fitting, closest = [], None
    for layout in all_layouts(gpus):
        try:
            layout.validate(c, seq_lens=[seq])
        except ValueError:
            continue
        p = training_plan(c, layout, seq, sequences, None, dtype_bytes, recompute, flash)
        p["budget"], p["communication"] = int(gpu_memory_gb * GIB), communication_bytes(p)
        if p["total"] <= p["budget"]:
            fitting.append(p)
        elif closest is None or p["total"] < closest["total"]:
            closest = p
    if not fitting:
        if closest is None:
            raise ValueError(f"no layout of --gpus {gpus} suits this model at --seq {seq}")
        try:
            _check_fits(closest, recompute)
        except ValueError as err:
            layout = " × ".join(f"{k} {v}" for k, v in closest["layout"].items())
            raise ValueError(f"no layout of --gpus {gpus} fits --gpu-memory-gb {gpu_memory_gb:g} (more GPUs might); "
                             f"the closest, {layout}: {err}") from err
    return sorted(fitting, key=lambda p: (p["communication"] / p["tokens_per_rank"], p["total"]))


def format_layouts(plans: list[dict[str, Any]], title: str, shown: int = 10) -> str:
    """`propose_layouts`' plans as a table, the best first, and the command that details the best."""
    first = plans[0]
    lines = [f"Training layouts — {title}: the {len(plans):,} layouts of {first['gpus']:,} GPUs that fit "
             f"{first['budget'] / GIB:g} GiB per GPU ({first['seq']:,}-token sequences, "
             f"{first['sequences_per_data_rank']} per data rank), least communication per token first", "",
             f"  {'dp_replicate':>12} {'ep':>5} {'dp_shard':>8} {'cp':>5} {'tokens/step':>13} {'memory/rank':>13} "
             f"{'received/rank/step':>19} {'bytes/token':>12}"]
    for p in plans[:shown]:
        r, ep, shard, cp = p["layout"].values()
        lines.append(f"  {r:>12} {ep:>5} {shard:>8} {cp:>5} {p['tokens_per_step']:>13,} {_gib(p['total']):>13} "
                     f"{_gib(p['communication']):>19} {p['communication'] // p['tokens_per_rank']:>12,}")
    if len(plans) > shown:
        lines.append(f"  … {len(plans) - shown:,} more (--json lists them all)")
    r, ep, shard, cp = first["layout"].values()
    lines += ["", f"the first in detail: the same command with --dp-replicate {r} --dp-shard {shard} --ep {ep} --cp {cp}"]
    return "\n".join(lines)


def _check_fits(p: dict[str, Any], recompute: bool) -> None:
    """ValueError saying by how much the peak exceeds ``--gpu-memory-gb``, its largest term and what to change."""
    over = p["total"] - p["budget"]
    if over <= 0:
        return
    acts = p["activations_recompute" if recompute else "activations_no_recompute"]
    terms = {"model state (fp32 parameters, gradients, optimiser moments)":
             (p["parameters"] + p["gradients"] + p["optimizer"], "raise --dp-shard or --ep, or lower --dp-replicate"),
             "stored activations": (acts["stored"], "raise --cp or lower --batch-seqs"
                                    + ("" if recompute else ", or recompute (drop --no-recompute)")),
             "recomputed layer": (acts["recompute_layer"], "raise --cp or lower --batch-seqs"),
             "gathered FSDP units": (p["transient"]["fsdp_units"], "raise --ep (fewer local experts per layer)"),
             "MLA scores without flash attention": (p["transient"]["mla_scores"], "drop --no-flash")}
    name, (size, advice) = max(terms.items(), key=lambda kv: kv[1][0])
    raise ValueError(f"per-rank memory {_gib(p['total'])} exceeds --gpu-memory-gb {p['budget'] / GIB:g} by "
                     f"{_gib(over)}; the largest term is {name} ({_gib(size)}): {advice}")


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB" if n >= GIB else f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n:,} B"


def format_training_plan(p: dict[str, Any], title: str) -> str:
    """The plan as text: memory per rank, then bytes received per rank."""
    layout = " × ".join(f"{k} {v}" for k, v in p["layout"].items())
    lines = [f"Training plan — {title}: {p['gpus']:,} GPUs = {layout}",
             f"  {p['data_ranks']:,} data ranks × {p['sequences_per_data_rank']} sequence(s) of {p['seq']:,} tokens "
             f"= {p['tokens_per_step']:,} tokens per step; {p['tokens_per_rank']:,} tokens per rank",
             "  precision: bf16 compute weights (FSDP2 all-gather), fp32 master shard, fp32 gradient reduce-scatter; "
             "Muon 1 fp32 moment, AdamW 2", "", "Memory per rank (rank 0)"]
    row = lambda k, v: lines.append(f"  {k:<56} {v}")  # noqa: E731
    s, split = p["shard"], p["parameter_split"]
    row("model parameters: routed experts / Muon / AdamW", " / ".join(f"{split[k]:,}" for k in s))
    row("held by this rank", " / ".join(f"{s[k]:,}" for k in s))
    row("parameters (fp32 master shard)", _gib(p["parameters"]))
    row("gradients (fp32 shard)", _gib(p["gradients"]))
    row("optimiser (Muon momentum, AdamW 2 moments, fp32)", _gib(p["optimizer"]))
    per = p["activation_per_token"]
    row("activations per token: KDA / MLA layer", f"{per['kda']:,} / {per['mla']:,} bytes")
    row("activations per token: MoE / dense FFN / AttnRes+norms", f"{per['moe']:,} / {per['dense']:,} / "
        f"{per['layer']:,} bytes")
    row("activations per token: checkpoint / sources / head", f"{per['checkpoint']:,} / {per['sources']:,} / "
        f"{per['head']:,} bytes")
    for mode, name in (("recompute", "full recompute"), ("no_recompute", "no recompute")):
        a = p[f"activations_{mode}"]
        row(f"activations stored, {name}", _gib(a["stored"]))
    row("transient: recomputed layer (largest)", _gib(p["activations_recompute"]["recompute_layer"]))
    row(f"transient: FSDP units ({p['largest_fsdp_unit']:,} params gathered)", _gib(p["transient"]["fsdp_units"]))
    row("transient: MLA scores" + (" (flash: none)" if p["flash"] else " (fp32, one layer)"),
        _gib(p["transient"]["mla_scores"]))
    for mode, name in (("recompute", "full recompute"), ("no_recompute", "no recompute")):
        chosen = " (planned)" if p["recompute"] == (mode == "recompute") else ""
        row(f"total, {name}{chosen}", _gib(p[f"total_{mode}"]))
    if "budget" in p:
        row("--gpu-memory-gb", f"{_gib(p['budget'])}: fits, {_gib(p['budget'] - p['total'])} free")
    lines += ["", "Communication per rank per step (bytes received from other ranks)"]
    again = " + recompute" if p["recompute"] else ""
    row(f"MoE all-to-all (dispatch + combine, fwd + bwd{again})", _gib(p["moe_all_to_all"]))
    for name, size in p["fsdp"].items():
        row(f"FSDP {name.replace('_', '-')}", _gib(size))
    row("Muon gather / scatter (owner strategy)", f"{_gib(p['muon']['gather'])} / {_gib(p['muon']['scatter'])}")
    for n, v in p["cp_per_layer"].items():
        row(f"CP per layer at {int(n):,} tokens: KDA / MLA (forward)",
            f"{_gib(v['forward']['kda'])} / {_gib(v['forward']['mla'])}")
    row(f"CP per step (all layers, fwd + bwd{again})", _gib(p["cp_per_step"]))
    return "\n".join(lines)
