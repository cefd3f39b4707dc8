"""Optimisers (SPEC §7, §9): Per-Head Muon, Muon, AdamW, QK-clip for MLA, warmup + cosine schedule.

* `Muon`: Nesterov momentum, then quintic Newton–Schulz orthogonalisation of each matrix (stacked 3-D
  parameters are a batch of matrices), Moonlight's RMS matching ``0.2·√max(rows, cols)`` and decoupled
  weight decay. With ``num_heads`` set (Per-Head Muon, K3) the update is split into head blocks along the
  output rows, each block orthogonalised and scaled on its own, and merged back; ``head_split`` further
  cuts each head's rows into parts that are separate projections (MLA's ``[W_uk_h ; W_uv_h]``).
* `build_optimizers` routes attention Q/K/V projections to Per-Head Muon (MLA: each head's query, key
  and value blocks separately), the other hidden matrices — router included — to Muon, and embeddings,
  LM head, 1-D parameters and the KDA ShortConv to AdamW.
* `qk_clip_mla`: Kimi K2's QK-clip for MLA heads whose max pre-softmax logit exceeded τ (on by default,
  τ = 100).
* `lr_lambda` / `schedulers`: 1% linear warmup, cosine decay to a floor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from k3.config import K3Config
from k3.dist.fsdp import local_rows, local_shard
from k3.dist.muon import owner_update
from k3.model.sequence.kda import KDALayer
from k3.model.sequence.mla import GatedMLA
from k3.model.width import Experts, Router

__all__ = [
    "NS_COEFFICIENTS",
    "Muon",
    "OptimConfig",
    "build_optimizers",
    "lr_lambda",
    "merge_heads",
    "newton_schulz",
    "qk_clip_mla",
    "schedulers",
    "split_heads",
]

# Quintic Newton–Schulz coefficients (KellerJordan/Muon, Moonlight): the slope 3.4445 at 0 lifts small
# singular values fast; the iteration then oscillates around 1 instead of converging to it.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
RMS_MATCH = 0.2  # Moonlight: 0.2·√max(A, B) gives the update an AdamW-like RMS of ~0.2·lr


def newton_schulz(G: Tensor, steps: int = 5, eps: float = 1e-7) -> Tensor:
    """Approximate the polar factor ``U Vᵀ`` of ``G = U S Vᵀ`` for ``[..., m, n]`` (SPEC §7, §9 "Muon").

    Frobenius pre-normalisation puts every singular value in [0, 1]; each quintic step maps
    σ ↦ aσ + bσ³ + cσ⁵. The iteration runs on the short side (transposed when m > n) in at least fp32;
    the result has G's dtype. Singular values end near, not at, 1 (about 0.7–1.2), which Muon tolerates.
    A zero matrix stays zero.
    """
    if G.dim() < 2:
        raise ValueError(f"newton_schulz: expected a [..., m, n] tensor, got shape {list(G.shape)}")
    a, b, c = NS_COEFFICIENTS
    X = G.to(torch.promote_types(G.dtype, torch.float32))
    tall = X.shape[-2] > X.shape[-1]
    if tall:
        X = X.mT
    X = X / (torch.linalg.matrix_norm(X, keepdim=True) + eps)
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * (A @ A)) @ X
    return (X.mT if tall else X).to(G.dtype)


def split_heads(W: Tensor, num_heads: int) -> Tensor:
    """A Linear weight ``[..., H·dh, d_in]`` as head blocks ``[..., H, dh, d_in]`` along the output rows (a view)."""
    if W.dim() < 2 or num_heads < 1 or W.shape[-2] % num_heads:
        raise ValueError(f"split_heads: cannot split rows of shape {list(W.shape)} into {num_heads} heads")
    return W.unflatten(-2, (num_heads, W.shape[-2] // num_heads))


def merge_heads(blocks: Tensor) -> Tensor:
    """Inverse of `split_heads`: ``[..., H, dh, d_in]`` → ``[..., H·dh, d_in]``."""
    if blocks.dim() < 3:
        raise ValueError(f"merge_heads: expected [..., H, dh, d_in], got shape {list(blocks.shape)}")
    return blocks.flatten(-3, -2)


def _scaled_orthogonal(block: Tensor, steps: int) -> Tensor:
    """``0.2·√max(rows, cols)·NS(block)`` for ``[..., rows, cols]``, in at least fp32."""
    rows, cols = block.shape[-2:]
    update = newton_schulz(block.to(torch.promote_types(block.dtype, torch.float32)), steps)
    return update * (RMS_MATCH * math.sqrt(max(rows, cols)))


def _orthogonal_update(direction: Tensor, num_heads: int | None, head_split: tuple[int, ...] | None,
                       steps: int) -> Tensor:
    """`_scaled_orthogonal` of the whole matrix, or of each head block (``num_heads``) — or of each of a
    head's ``head_split`` row parts — merged back into ``direction``'s layout."""
    if num_heads is None:
        return _scaled_orthogonal(direction, steps)
    heads = split_heads(direction, num_heads)
    parts = (heads,) if head_split is None else heads.split(list(head_split), dim=-2)
    return merge_heads(torch.cat([_scaled_orthogonal(part, steps) for part in parts], dim=-2))


class Muon(torch.optim.Optimizer):
    """Muon / Per-Head Muon for 2-D and stacked 3-D parameters (SPEC §7, §9 "Muon").

    Per step and parameter: ``buf ← μ·buf + g``; Nesterov direction ``g + μ·buf``; orthogonalise it
    (whole matrices, or head blocks of ``num_heads`` along the output rows, each head's rows optionally cut
    into ``head_split`` parts); ``p ← p·(1 − lr·wd)``; ``p ← p − lr·0.2·√max(rows, cols)·NS(direction)``
    with each block's own rows and cols. A stacked ``[E, m, n]`` parameter is E matrices. The momentum
    buffer lives in the standard optimizer state (saved by `state_dict`).
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[dict], lr: float, momentum: float = 0.95,
                 weight_decay: float = 0.1, ns_steps: int = 5, num_heads: int | None = None,
                 head_split: tuple[int, ...] | None = None) -> None:
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, ns_steps=ns_steps, num_heads=num_heads,
                        head_split=head_split)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        try:
            self._check_group(self.param_groups[-1])
        except ValueError:
            self.param_groups.pop()
            raise

    @staticmethod
    def _check_group(group: dict) -> None:
        if not (isinstance(group["lr"], float | int) and 0 <= group["lr"] < math.inf):
            raise ValueError(f"Muon: lr must be finite and >= 0, got {group['lr']!r}")
        if not 0 <= group["momentum"] < 1:
            raise ValueError(f"Muon: momentum must lie in [0, 1), got {group['momentum']!r}")
        if not 0 <= group["weight_decay"] < math.inf:
            raise ValueError(f"Muon: weight_decay must be finite and >= 0, got {group['weight_decay']!r}")
        if not (isinstance(group["ns_steps"], int) and group["ns_steps"] >= 1):
            raise ValueError(f"Muon: ns_steps must be a positive integer, got {group['ns_steps']!r}")
        heads, split = group["num_heads"], group["head_split"]
        if heads is not None and not (isinstance(heads, int) and heads >= 1):
            raise ValueError(f"Muon: num_heads must be a positive integer or None, got {heads!r}")
        if split is not None and not (heads is not None and isinstance(split, tuple | list) and split
                                      and all(isinstance(n, int) and n >= 1 for n in split)):
            raise ValueError(f"Muon: head_split must be None or positive row counts with num_heads set, got {split!r}")
        for p in group["params"]:
            if p.dim() not in (2, 3):
                raise ValueError(f"Muon: parameters must be 2-D or stacked 3-D, got shape {list(p.shape)}")
            if heads is not None and p.shape[-2] % heads:
                raise ValueError(f"Muon: {p.shape[-2]} output rows do not split into num_heads={heads} heads")
            if split is not None and p.shape[-2] != heads * sum(split):
                raise ValueError(f"Muon: {p.shape[-2]} output rows are not num_heads={heads} × head_split={split}")

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        owner = 0  # FSDP-sharded parameters: whole matrices orthogonalised on rotating owner ranks (`owner_update`)
        for group in self.param_groups:
            lr, mu = group["lr"], group["momentum"]
            orthogonal = partial(_orthogonal_update, num_heads=group["num_heads"], head_split=group["head_split"],
                                 steps=group["ns_steps"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.mul_(mu).add_(p.grad)
                direction = p.grad.add(buf, alpha=mu)
                if isinstance(direction, DTensor):
                    update, owner = owner_update(direction, owner, orthogonal), owner + 1
                else:
                    update = orthogonal(direction)
                target = local_shard(p)
                target.mul_(1 - lr * group["weight_decay"])
                target.add_(update.to(target.dtype), alpha=-lr)
        return loss


@torch.no_grad()
def qk_clip_mla(attn: GatedMLA, max_logits: Tensor, threshold: float) -> Tensor:
    """Kimi K2's QK-clip for one MLA layer (SPEC §7, §9 "QK-clip"); returns γ ``[H]`` (1 where not clipped).

    For each head with max pre-softmax logit ``S_max > τ``, ``γ = τ / S_max``: the head's content query
    rows and its ``W_uk`` rows of ``kv_b_proj`` are scaled by √γ each, its shared-key query rows by γ,
    so every logit of the head scales by γ. The shared key (``kv_a_proj``) and ``W_uv`` are untouched;
    unclipped heads are multiplied by exactly 1 (bit-identical). ``max_logits`` is what
    ``GatedMLA.record_max_logits`` collected.
    """
    H, nope, shared, v = attn.num_heads, attn.nope_dim, attn.shared_dim, attn.v_dim
    if not (isinstance(threshold, float | int) and threshold > 0):
        raise ValueError(f"qk_clip_mla: threshold must be > 0, got {threshold!r}")
    if max_logits.shape != (H,):
        raise ValueError(f"qk_clip_mla: max_logits must be [num_heads={H}], got {list(max_logits.shape)}")
    q_weight = (attn.q_proj if attn.q_lora_rank is None else attn.q_b_proj).weight
    s = max_logits.detach().to(device=q_weight.device, dtype=torch.promote_types(max_logits.dtype, torch.float32))
    gamma = torch.where(s > threshold, threshold / s, torch.ones_like(s))
    root, ones = gamma.sqrt()[:, None], torch.ones_like(gamma)[:, None]
    q_scale = torch.cat([root.expand(H, nope), gamma[:, None].expand(H, shared)], dim=1).reshape(-1, 1)
    kv_scale = torch.cat([root.expand(H, nope), ones.expand(H, v)], dim=1).reshape(-1, 1)
    _scale_rows(q_weight, q_scale)
    _scale_rows(attn.kv_b_proj.weight, kv_scale)
    return gamma


def _scale_rows(weight: Tensor, scale: Tensor) -> None:
    """``weight *= scale`` (``scale`` ``[rows, 1]``) in place, on this rank's rows of an FSDP-sharded weight."""
    local_shard(weight).mul_(scale[local_rows(weight)].to(weight.dtype))


@dataclass
class OptimConfig:
    """Optimiser hyper-parameters (SPEC §7). ``optimizer="adamw"`` and ``per_head=False`` are ablations.

    ``qk_clip`` is τ of Kimi K2's QK-clip (`qk_clip_mla` after every step), part of K3's recipe ("K3 also
    keeps K2's weight clipping", paper §3.3–3.4 in seeds/001, which adds that the clipping threshold is not
    specified). τ = 100 is Kimi K2's (K2 report, MuonClip). ``0`` or ``None`` turns the clip off (stored as
    None).
    """

    lr: float = 3e-3  # Muon
    adam_lr: float = 3e-3
    weight_decay: float = 0.1
    momentum: float = 0.95
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_frac: float = 0.01
    min_lr_ratio: float = 0.1
    qk_clip: float | None = 100.0  # τ for `qk_clip_mla`; 0 or None: off
    optimizer: str = "muon"  # "muon" or "adamw" (everything AdamW)
    per_head: bool = True  # False: plain Muon on Q/K/V too

    def __post_init__(self) -> None:
        self.betas = tuple(float(b) for b in self.betas)  # a JSON round trip turns the tuple into a list
        if self.optimizer not in ("muon", "adamw"):
            raise ValueError(f"optimizer: expected 'muon' or 'adamw', got {self.optimizer!r}")
        for name in ("lr", "adam_lr", "weight_decay", "eps"):  # an infinite rate trains a step of NaNs
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, float | int) or not 0 <= value < math.inf:
                raise ValueError(f"{name}: expected a finite number >= 0, got {value!r}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum: expected [0, 1), got {self.momentum!r}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas: expected two values in [0, 1), got {self.betas!r}")
        if not 0 <= self.warmup_frac < 1:
            raise ValueError(f"warmup_frac: expected [0, 1), got {self.warmup_frac!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio: expected [0, 1], got {self.min_lr_ratio!r}")
        if self.qk_clip is not None and not (isinstance(self.qk_clip, float | int) and self.qk_clip >= 0):
            raise ValueError(f"qk_clip: expected τ > 0, or 0 / None for off, got {self.qk_clip!r}")
        if self.qk_clip == 0:
            self.qk_clip = None


Layout = tuple[str, int | None, tuple[int, ...] | None]  # (Muon group name, num_heads, head_split)
MUON_GROUPS = ("muon", "muon_kda_heads", "muon_mla_q_heads", "muon_mla_kv_heads", "muon_experts_gate_up")


def _per_head_weights(model: nn.Module, config: K3Config) -> dict[int, Layout]:
    """id(weight) → layout for the attention projections Per-Head Muon splits (SPEC §7).

    KDA ``q/k/v_proj``: H blocks. MLA query (``q_proj`` or ``q_b_proj``): H blocks, head h's query
    ``[W_qc_h ; W_qs_h]``. MLA ``kv_b_proj``: 2H blocks — each head's key part ``W_uk_h`` and value part
    ``W_uv_h`` separately (they are the head's K and V projections, packed in one Linear only for storage).
    Not split: ``q_a_proj`` (the query latent) and ``kv_a_proj`` (``[W_dkv | W_ks]``: the KV latent and the
    shared key) serve all heads alike and have no head structure — plain Muon, one matrix each, as stored
    in the release (``kv_a_proj_with_mqa``).
    """
    kda, mla = config.kda, config.mla
    per_head: dict[int, Layout] = {}
    for module in model.modules():
        if isinstance(module, KDALayer):
            for proj in (module.q_proj, module.k_proj, module.v_proj):
                per_head[id(proj.weight)] = ("muon_kda_heads", kda.num_heads, None)
        elif isinstance(module, GatedMLA):
            query = module.q_proj if module.q_lora_rank is None else module.q_b_proj
            per_head[id(query.weight)] = ("muon_mla_q_heads", mla.num_heads, None)
            per_head[id(module.kv_b_proj.weight)] = ("muon_mla_kv_heads", mla.num_heads,
                                                     (mla.qk_nope_head_dim, mla.v_head_dim))
    return per_head


def _packed_weights(model: nn.Module) -> dict[int, Layout]:
    """id(weight) → layout for parameters that pack separate matrices: the routed experts' ``gate_up``
    ``[E, 2F, W]`` is ``W_gate`` and ``W_up``, orthogonalised apart like the dense FFN's and shared
    experts' separate ``gate_proj`` / ``up_proj``."""
    return {id(m.gate_up): ("muon_experts_gate_up", 1, (m.hidden, m.hidden))
            for m in model.modules() if isinstance(m, Experts)}


def _muon_weights(model: nn.Module) -> set[int]:
    """ids of the matrices Muon may take: Linear weights, router weights and stacked expert tensors, minus LM heads."""
    heads = {id(m.lm_head.weight) for m in model.modules() if isinstance(getattr(m, "lm_head", None), nn.Linear)}
    ids = set()
    for module in model.modules():
        if isinstance(module, nn.Linear | Router):
            ids.add(id(module.weight))
        elif isinstance(module, Experts):
            ids.update((id(module.gate_up), id(module.down)))
    return ids - heads


def build_optimizers(model: nn.Module, config: K3Config, optim: OptimConfig) -> list[torch.optim.Optimizer]:
    """``[Muon, AdamW]`` (or ``[AdamW]`` for ``optim.optimizer == "adamw"``) over the trainable parameters.

    Every trainable parameter lands in exactly one named group (``group["name"]``):

    * Per-Head Muon (`_per_head_weights`): ``muon_kda_heads`` (KDA ``q/k/v_proj``, H blocks),
      ``muon_mla_q_heads`` (MLA ``q_proj`` or ``q_b_proj``, H blocks) and ``muon_mla_kv_heads`` (MLA
      ``kv_b_proj``, H key blocks and H value blocks). With ``per_head=False`` they join ``muon``.
    * ``muon_experts_gate_up``: the routed experts' packed ``[W_gate ; W_up]``, two matrices per expert.
    * ``muon``: every other Linear weight, the router weight (a hidden ``[E, d]`` matrix; the paper keeps
      AdamW for embeddings, head and gains only) and the routed experts' ``down``.
    * ``adamw_decay``: remaining ≥2-D parameters — embeddings, LM head, KDA ShortConv.
    * ``adamw_no_decay``: 1-D parameters — norm gains, ``A_log``, ``dt_bias``, AttnRes pseudo-queries.
    """
    muon = optim.optimizer == "muon"
    layouts = {**_packed_weights(model), **(_per_head_weights(model, config) if optim.per_head else {})} if muon else {}
    muon_ids = _muon_weights(model) if muon else set()
    splits: dict[str, Layout] = {"muon": ("muon", None, None), **{lay[0]: lay for lay in layouts.values()}}
    groups: dict[str, list[nn.Parameter]] = {}
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if id(p) in layouts:
            name = layouts[id(p)][0]
        elif id(p) in muon_ids:
            name = "muon"
        else:
            name = "adamw_decay" if p.dim() >= 2 else "adamw_no_decay"
        groups.setdefault(name, []).append(p)

    optimizers: list[torch.optim.Optimizer] = []
    muon_groups = [dict(name=name, params=groups[name], num_heads=splits[name][1], head_split=splits[name][2])
                   for name in MUON_GROUPS if name in groups]
    if muon_groups:
        optimizers.append(Muon(muon_groups, lr=optim.lr, momentum=optim.momentum, weight_decay=optim.weight_decay))
    adam_groups = [dict(name=n, params=groups[n], weight_decay=wd)
                   for n, wd in (("adamw_decay", optim.weight_decay), ("adamw_no_decay", 0.0)) if n in groups]
    if adam_groups:
        optimizers.append(torch.optim.AdamW(adam_groups, lr=optim.adam_lr, betas=optim.betas, eps=optim.eps))
    return optimizers


def lr_lambda(step: int, total_steps: int, warmup_frac: float, min_lr_ratio: float) -> float:
    """LR multiplier (SPEC §7): linear warmup then cosine decay to ``min_lr_ratio``.

    With ``W = max(1, round(warmup_frac·total_steps))``: ``(step + 1) / W`` for step < W (so step W − 1
    reaches 1.0), then ``min + (1 − min)·(1 + cos(π·(step − W) / (total_steps − W))) / 2``, which is 1 at
    step W and ``min_lr_ratio`` from ``total_steps`` on.
    """
    if total_steps < 1:
        raise ValueError(f"total_steps: expected >= 1, got {total_steps!r}")
    warmup = max(1, round(warmup_frac * total_steps))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def schedulers(optimizers: list[torch.optim.Optimizer], total_steps: int, optim: OptimConfig) -> list[LambdaLR]:
    """One `LambdaLR` per optimiser following `lr_lambda`."""
    fn = partial(lr_lambda, total_steps=total_steps, warmup_frac=optim.warmup_frac, min_lr_ratio=optim.min_lr_ratio)
    return [LambdaLR(opt, fn) for opt in optimizers]


def apply_step(optimizers: Sequence[torch.optim.Optimizer], schedulers: Sequence[LambdaLR] = ()) -> float:
    """The update of an optimiser step (SPEC §7), its gradients already clipped: every optimiser steps and drops
    its gradients, then every scheduler advances; returns the learning rate the step used (the first group's)."""
    lr = optimizers[0].param_groups[0]["lr"]
    for opt in optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)
    for sched in schedulers:
        sched.step()
    return lr
