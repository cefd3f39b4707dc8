"""Quantile balancing of the MoE routers (SPEC §5; Appendix C–D) and DeepSeek-V3's bias-step baseline.

For a step's ``m`` tokens, ``n`` experts and top-``k``, the target load is ``q = m·k/n``. Each token's
cutoff is the (k+1)-th largest of ``s + b_old``; expert j's margins are ``s_ij − cutoff_i``. A threshold
``θ_j`` with about ``q`` margins strictly above it becomes the next bias ``b_j = −θ_j`` (mean-centred;
a common offset never changes a top-k selection): with the cutoffs held fixed, token i is routed to j
iff ``cutoff_i < s_ij + b_j`` iff ``m_ij > θ_j``. θ_j minimises the hinge objective
``L(θ) = q·θ + Σ_i max(m_ij − θ, 0)`` exactly when ``#(m > θ) ≤ q ≤ #(m ≥ θ)``.

The new bias is written into ``Router.balance_bias`` after the step, so it acts from the next step on,
and is frozen at inference. Balancing aims one step's load at the target: it does not balance every
future batch (identical tokens still all choose the same experts).

Histogram mode (the report's production form: a few hundred bins per expert) bins the margins over
`histogram_range`, an interval fixed by the old bias that provably holds every margin of sigmoid scores,
so the estimate is within one bin width of the exact threshold however large the biases grow.

Distributed (``torch.distributed`` initialised, over ``group``): histogram mode sums the per-expert
counts with one all-reduce before thresholding; exact mode all-gathers the margins; `QuantileBalancer`
also sums each step's load (which bias-step mode and `load_stats` use). Every rank gets the same bias.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from k3.model.width import Router

MODES = ("exact", "histogram", "bias-step")


def margins(scores: Tensor, bias: Tensor, k: int) -> Tensor:
    """scores [m, n], bias [n] → margins ``scores − cutoff`` [m, n] in ≥ fp32.

    ``cutoff_i`` is the (k+1)-th largest of ``scores_i + bias``; requires ``0 < k < n``.
    """
    n = scores.shape[-1]
    if not 0 < k < n:
        raise ValueError(f"top-k = {k} is invalid for quantile balancing: must be in (0, n_experts={n})")
    s = scores.detach().to(torch.promote_types(scores.dtype, torch.float32))
    cutoff = (s + bias.to(s.dtype)).topk(k + 1, dim=-1).values[..., -1:]
    return s - cutoff


def exact_threshold(margins: Tensor, q: float) -> Tensor:
    """The ``(⌊q⌋+1)``-th largest margin along dim 0: margins [m] → θ [] or [m, n] → θ [n].

    Requires ``m > 0`` and ``0 ≤ q ≤ m``; for ``q = m`` the rank is clipped to the m-th largest, the smallest.
    The bracket ``#(m > θ) ≤ q ≤ #(m ≥ θ)`` always holds, so θ minimises the hinge objective. With
    distinct margins and integer q exactly q margins lie strictly above θ (the lower end of the
    minimising interval, as in Appendix C); with distinct margins and fractional q, θ is the unique
    minimiser, the ``⌈q⌉``-th largest. ``q = 0`` gives the largest margin (nothing strictly above). Ties: θ is the
    tied value itself, so the whole tie is left out by the strict routing rule (a strict threshold
    cannot select part of a tie) and the strict count can fall below q while the weak count exceeds it.
    For ``q > m`` no threshold satisfies the bracket (L is unbounded below) and a ValueError is raised.
    """
    m = margins.shape[0]
    if m == 0 or not 0 <= q <= m:
        raise ValueError(f"target load q = {q} is invalid for {m} margins: must be in [0, m] with m > 0")
    rank = min(math.floor(q), m - 1)  # 0-based rank from the top
    return margins.kthvalue(m - rank, dim=0).values


def histogram_range(bias: Tensor, k: int) -> tuple[float, float]:
    """The bin range ``(−1 − c, 1 − c)`` for sigmoid scores under ``bias`` [n], ``c`` its (k+1)-th largest value.

    Router scores are sigmoids (SPEC §4), so ``0 ≤ s ≤ 1``. Then ``s + b ≥ b`` entrywise, so each token's
    cutoff (the (k+1)-th largest of ``s + b``) lies in ``[c, 1 + c]`` and every margin ``s − cutoff`` in
    ``[−1 − c, 1 − c]``: all margins are binned without clamping, which is what the one-bin bound of
    `histogram_threshold` needs. The width is 2 whatever the bias (bin width ``2/bins``). Why this and
    not the batch's min/max: it depends only on the old bias, which every micro-batch of the step and
    every data-parallel rank shares, so the edges are fixed before any margin is seen and the counts of
    all micro-batches and ranks still add up by one sum, with no extra communication.
    """
    n = bias.shape[-1]
    if not 0 < k < n:
        raise ValueError(f"top-k = {k} is invalid for quantile balancing: must be in (0, n_experts={n})")
    c = float(bias.detach().double().topk(k + 1).values[-1])
    return -1.0 - c, 1.0 - c


def histogram_counts(margins: Tensor, bins: int, lo: float, hi: float) -> Tensor:
    """margins [m, n] → per-expert counts [n, bins] int64 over ``bins`` equal bins spanning [lo, hi].

    Values outside [lo, hi] are clamped into the end bins. The edges are fixed, so the counts of
    several shards add up exactly to the counts of their union (what one all-reduce sums).
    """
    if bins < 1 or not lo < hi:
        raise ValueError(f"histogram: need bins ≥ 1 and lo < hi, got bins={bins}, lo={lo}, hi={hi}")
    n = margins.shape[-1]
    index = ((margins.float() - lo) * (bins / (hi - lo))).floor().clamp_(0, bins - 1).long()
    index = index + torch.arange(n, device=margins.device) * bins
    return torch.bincount(index.flatten(), minlength=n * bins).view(n, bins)


def histogram_threshold(counts: Tensor, lo: float, hi: float, q: float) -> Tensor:
    """Pooled counts [n, bins] → θ [n] fp32, interpolated inside the bin holding the exact threshold.

    The chosen bin is the one containing the ``(⌊q⌋+1)``-th largest margin (the `exact_threshold`
    rank), i.e. where the count from the top first exceeds ⌊q⌋. Inside it the margins are taken as
    uniform, and θ is placed so that ``above + count·(upper_edge − θ)/width = q``. θ and the exact
    threshold lie in the same bin whenever the margins lie in [lo, hi], so the error is at most one
    bin width ``(hi − lo)/bins``.
    """
    n, bins = counts.shape
    width = (hi - lo) / bins
    total = counts.sum(-1)
    m = int(total.min())
    if m == 0 or int(total.max()) != m or not 0 <= q <= m:
        raise ValueError(f"histogram: target load q = {q} is invalid for per-expert totals "
                         f"{sorted(set(total.tolist()))}: the totals must be equal, positive and ≥ q ≥ 0")
    at_or_above = counts.flip(-1).cumsum(-1).flip(-1)
    rank = min(math.floor(q), m - 1)
    b = (at_or_above > rank).sum(-1, keepdim=True) - 1
    above = (at_or_above - counts).gather(-1, b).squeeze(-1).double()
    in_bin = counts.gather(-1, b).squeeze(-1).double()
    frac = ((q - above) / in_bin).clamp(0, 1)
    return (lo + (b.squeeze(-1).double() + 1 - frac) * width).float()


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _gather_rows(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Concatenate every rank's ``x`` [m_r, n] along dim 0 (ranks may hold different m_r)."""
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=x.device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([x.shape[0]], device=x.device), group=group)
    rows = [int(s) for s in sizes]
    padded = x.new_zeros(max(rows), *x.shape[1:])
    padded[: x.shape[0]] = x
    gathered = [torch.empty_like(padded) for _ in rows]
    dist.all_gather(gathered, padded, group=group)
    return torch.cat([g[:r] for g, r in zip(gathered, rows)])


def _exact_theta(margins: Tensor, k: int, group: dist.ProcessGroup | None) -> Tensor:
    if _distributed():
        margins = _gather_rows(margins, group)
    m, n = margins.shape
    return exact_threshold(margins, m * k / n)


def _histogram_theta(counts: Tensor, k: int, lo: float, hi: float, group: dist.ProcessGroup | None) -> Tensor:
    if _distributed():
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    n = counts.shape[0]
    return histogram_threshold(counts, lo, hi, int(counts[0].sum()) * k / n)


def _centred_bias(theta: Tensor) -> Tensor:
    bias = -theta.float()
    return bias - bias.mean()


def next_bias(scores: Tensor, bias: Tensor, k: int, mode: str = "exact", bins: int = 256,
              group: dist.ProcessGroup | None = None) -> Tensor:
    """scores [m, n] (sigmoid, in [0, 1]), old bias [n] → the next bias [n] fp32: ``−θ`` mean-centred,
    target ``q = m·k/n``.

    ``mode="exact"`` uses `exact_threshold`; ``"histogram"`` uses ``bins`` bins over `histogram_range`
    (each θ within one bin width, ``2/bins``, of the exact one).
    """
    mg = margins(scores, bias, k)
    if mode == "exact":
        return _centred_bias(_exact_theta(mg, k, group))
    if mode == "histogram":
        if not bool(((scores >= 0) & (scores <= 1)).all()):
            raise ValueError("scores must be sigmoid router scores in [0, 1] for histogram balancing")
        lo, hi = histogram_range(bias, k)
        return _centred_bias(_histogram_theta(histogram_counts(mg, bins, lo, hi), k, lo, hi, group))
    raise ValueError(f"mode = {mode!r} is invalid: must be 'exact' or 'histogram'")


def bias_step(load: Tensor, bias: Tensor, gamma: float) -> Tensor:
    """DeepSeek-V3's rule: ``b_j − γ·sign(load_j − mean load)`` (overloaded down, underloaded up), fp32."""
    load = load.double()
    return (bias.double() - gamma * torch.sign(load - load.mean())).float()


@dataclass
class _Pending:
    """What one router saw since the last update: summed load and margins (exact) or counts (histogram)
    and their bin range (fixed by the bias, which does not change until the update)."""

    load: Tensor | None = None
    margins: list[Tensor] = field(default_factory=list)
    counts: Tensor | None = None
    edges: tuple[float, float] | None = None


class QuantileBalancer:
    """Balances every `Router` of ``model`` once per optimiser step.

    Forward hooks collect, for each training-mode forward with grad enabled (all micro-batches of a
    step), the load and the margins under the current bias (exact mode keeps them; histogram mode
    keeps only the per-expert counts over `histogram_range`). `update()`, called once after the step's
    backward, turns them into the next biases and writes them in place into ``router.balance_bias`` (so
    they act from the next step on). Eval-mode or no-grad forwards are not collected, so inference never
    moves a bias. ``mode="bias-step"`` applies `bias_step` with ``gamma`` instead. Each router's own k is
    used.

    The balancer keeps no state across steps beyond the last step's loads for `load_stats` (the
    biases are model buffers and are checkpointed with the weights), so it has no ``state_dict``.
    """

    def __init__(self, model: nn.Module, mode: str = "exact", bins: int = 256, gamma: float = 1e-3,
                 group: dist.ProcessGroup | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode = {mode!r} is invalid: must be one of {MODES}")
        self.mode, self.bins, self.gamma, self.group = mode, bins, gamma, group
        self.routers = {name: m for name, m in model.named_modules() if isinstance(m, Router)}
        for name, router in self.routers.items():
            if mode != "bias-step" and router.k >= router.weight.shape[0]:
                raise ValueError(f"{name}: top-k = {router.k} must be < n_experts for quantile balancing")
        self._pending = {name: _Pending() for name in self.routers}
        self._step_load: dict[str, Tensor] = {}
        self._hooks = [r.register_forward_hook(self._collector(name)) for name, r in self.routers.items()]

    def _collector(self, name: str) -> Callable[[Router, tuple, tuple], None]:
        def hook(router: Router, args: tuple, output: tuple) -> None:
            if not (router.training and torch.is_grad_enabled()):
                return
            p = self._pending[name]
            p.load = router.last_load.clone() if p.load is None else p.load + router.last_load
            if self.mode == "bias-step":
                return
            mg = margins(router.last_scores, router.balance_bias, router.k)
            if self.mode == "exact":
                p.margins.append(mg)
            elif p.counts is None:
                p.edges = histogram_range(router.balance_bias, router.k)
                p.counts = histogram_counts(mg, self.bins, *p.edges)
            else:
                p.counts += histogram_counts(mg, self.bins, *p.edges)

        return hook

    @torch.no_grad()
    def update(self) -> None:
        """Write each router's next bias from what it saw since the last call; routers that saw nothing keep theirs."""
        for name, router in self.routers.items():
            p = self._pending[name]
            if p.load is None:
                continue
            if _distributed():
                dist.all_reduce(p.load, op=dist.ReduceOp.SUM, group=self.group)
            if self.mode == "exact":
                new = _centred_bias(_exact_theta(torch.cat(p.margins), router.k, self.group))
            elif self.mode == "histogram":
                new = _centred_bias(_histogram_theta(p.counts, router.k, *p.edges, self.group))
            else:
                new = bias_step(p.load, router.balance_bias, self.gamma)
            router.balance_bias.copy_(new)
            self._step_load[name] = p.load
            self._pending[name] = _Pending()

    def load_stats(self) -> dict[str, float | int]:
        """The last updated step's loads (all micro-batches): per router ``load_max_mean/<name>`` (max/mean
        load) and ``load_idle/<name>`` (experts with no token), and overall ``load_max_mean`` (worst
        router) and ``load_idle`` (summed over routers). Empty before the first `update()`."""
        stats: dict[str, float | int] = {}
        for name, load in self._step_load.items():
            stats[f"load_max_mean/{name}"] = float(load.max() / load.float().mean())
            stats[f"load_idle/{name}"] = int((load == 0).sum())
        if self._step_load:
            stats["load_max_mean"] = max(v for key, v in stats.items() if key.startswith("load_max_mean/"))
            stats["load_idle"] = sum(v for key, v in stats.items() if key.startswith("load_idle/"))
        return stats

    def remove(self) -> None:
        """Detach the collection hooks from the model."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
