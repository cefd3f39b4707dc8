"""Expert parallelism for the routed experts: plain EP and MoonEP (SPEC §8).

The ``ep`` ranks of a process group each own ``L = E/ep`` routed experts (rank r: experts ``r·L … (r+1)·L − 1``) and
``S`` tokens (``N`` in the code) with ``K`` experts each. A forward

1. all-gathers every rank's per-expert counts (``ep × (E + 2)`` int64: the global load, the same counts the balancer
   sums from `k3.model.width.Router.last_load`) and plans a `Placement` from them — identical on every rank;
2. dispatches each token–expert assignment (the token's row) with one ``all_to_all_single`` to the rank that
   processes it, and, in the same autograd step, the weights of the redundant copies from their owners;
3. runs every expert on its received rows (`Experts.expert`, so MX fake-quantization is the same) and returns the
   rows with a second ``all_to_all_single`` (the combine); the weighted sum is formed at the source, in the order of
   `Experts.forward`.

Plain EP (``redundant_slots = 0``): every expert runs at home, so a rank receives as many rows as its experts were
routed — uneven under skew. MoonEP (``redundant_slots > 0``): hot experts get redundant copies so that every rank
processes exactly ``S·K`` assignments; its token receive buffer has exactly ``S·K`` rows, whatever the routing or
the number of slots (DeepEP's layout reserves ``S·K·R``, R senders each possibly sending its full ``S·K``).

Interpretation of "at most E/R redundant slots per rank": R is the number of EP ranks (``ep``), so E/R = L, the number
of experts a rank owns; ``redundant_slots`` may be 1 … L. With L slots planning always succeeds (see `plan_placement`);
with fewer it raises ValueError when the greedy plan needs more.

Backward mirrors the forward (the same two exchanges, reversed): every rank's input, routing-weight and owned-expert
gradients are exact; a copy's gradient goes back to its owner and is summed into the owner's parameters. Bytes a rank
sends per forward (rows it keeps are not sent): ``(N·K − own)·W·b`` dispatched, ``(recv − own)·W·b`` combined and
``c_out·3·F·W·b_w`` for the copies it sends; it receives the same with ``c_in``, the copies it hosts. Its backward sends
what its forward received and receives what it sent. ``recv`` is ``S·K`` in MoonEP; ``own`` the assignments it keeps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from k3.model.packed import PackedExperts, replace_experts
from k3.model.width import Experts
from k3.ops import mx

HOST = torch.device("cpu")  # routing plans (placements, flows) are made on the host: small, read by Python


@dataclass(frozen=True, eq=False)
class Placement:
    """Which rank processes how many of each expert's assignments (SPEC §8).

    ``amounts[r, e]`` (int64 ``[ep, E]``): the assignments of expert ``e`` processed on rank ``r``. A rank other than
    ``e``'s owner with ``amounts[r, e] > 0`` holds a redundant copy of ``e``. Expert ``e``'s assignments in global
    order (by source rank, then the source's order) are cut among its copies in rank order: rank r takes positions
    ``Σ_{r'<r} amounts[r', e] …`` onwards.
    """

    amounts: Tensor

    @property
    def work(self) -> list[int]:
        """Assignments processed by each rank."""
        return self.amounts.sum(1).tolist()

    def copies(self, rank: int) -> list[int]:
        """The experts of other ranks that ``rank`` holds a copy of (its used redundant slots), ascending."""
        ep, n = self.amounts.shape
        return [e for e in self.amounts[rank].nonzero().flatten().tolist() if e // (n // ep) != rank]


def _check_load(load: Tensor, ep: int) -> None:
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"ep = {ep!r} is invalid: must be a positive integer")
    if load.dim() != 1 or load.is_floating_point() or load.is_complex() or load.dtype == torch.bool:
        raise ValueError(f"load must be an integer tensor [E], got {load.dtype} {tuple(load.shape)}")
    if load.numel() % ep:
        raise ValueError(f"ep = {ep} ranks do not divide the {load.numel()} routed experts")
    if load.numel() and int(load.min()) < 0:
        raise ValueError("load must be non-negative")


def _home(load: Tensor, ep: int) -> Placement:
    """Every expert's whole load on its owner: plain EP."""
    n = load.numel()
    amounts = torch.zeros(ep, n, dtype=torch.long, device=HOST)
    experts = torch.arange(n, device=HOST)
    amounts[experts // (n // ep), experts] = load.cpu().long()
    return Placement(amounts)


def _plan(load: Tensor, ep: int, capacity: int, redundant_slots: int) -> Placement:
    """`plan_placement` after validation, with ``capacity = S·K``."""
    if not redundant_slots:
        return _home(load, ep)
    loads = load.tolist()
    per = len(loads) // ep
    amounts = [[0] * len(loads) for _ in range(ep)]
    left = list(loads)  # what each expert still has at home
    work = [sum(loads[r * per:(r + 1) * per]) for r in range(ep)]
    hottest = [sorted(range(r * per, (r + 1) * per), key=lambda e: (-loads[e], e)) for r in range(ep)]
    while short := [r for r in range(ep) if work[r] < capacity]:
        taker = min(short, key=lambda r: (work[r], r))  # the largest deficit
        giver = max((r for r in range(ep) if work[r] > capacity), key=lambda r: (work[r], -r))  # the largest surplus
        need = capacity - work[taker]
        work[giver] -= need
        work[taker] = capacity
        for e in hottest[giver]:  # the giver sheds its hottest experts first, keeps the coldest
            take = min(left[e], need)
            amounts[taker][e] += take
            left[e] -= take
            need -= take
    for e, n in enumerate(left):
        amounts[e // per][e] += n
    placement = Placement(torch.tensor(amounts, dtype=torch.long, device=HOST).reshape(ep, len(loads)))
    for r in range(ep):
        if (used := len(placement.copies(r))) > redundant_slots:
            raise ValueError(f"this load needs {used} redundant slots on rank {r}, more than redundant_slots = "
                             f"{redundant_slots}; E/ep = {per} slots always suffice")
    return placement


def plan_placement(load: Tensor, ep: int, tokens_per_rank: int, k: int, redundant_slots: int) -> Placement:
    """MoonEP's placement (SPEC §8) for the global per-expert ``load`` [E] (int, summing to ``ep·S·K``) such that
    every rank processes exactly ``capacity = S·K`` assignments, using at most ``redundant_slots`` copies per rank.

    The algorithm is Walker's alias method over ranks: a rank's *work* starts as its home load. While some rank is
    short, the rank with the largest deficit (ties: lowest rank) is filled up to ``capacity`` by the rank with the
    largest surplus (ties: lowest rank), which gives away its hottest experts first (whole, the last one split) and
    may itself become short. A rank is filled once, from one giver, and only ranks that never received give, so
    every copy on a rank is of its one giver's experts: at most E/ep of them, so ``redundant_slots = E/ep``
    always suffices (the report's E/R bound). At most ``ep − 1`` fills; integer-exact and deterministic.
    ``redundant_slots = 0`` gives plain EP's placement (everything at home; per-rank work follows the load).
    Raises ValueError for a bad load, ``ep`` not dividing E, a slot count outside ``[0, E/ep]``, or a plan
    that needs more slots than allowed.
    """
    _check_load(load, ep)
    per = load.numel() // ep
    if not 0 <= redundant_slots <= per:
        raise ValueError(f"redundant_slots = {redundant_slots} is invalid: must be in [0, E/ep = {per}]")
    if tokens_per_rank < 0 or k < 1:
        raise ValueError(f"tokens_per_rank = {tokens_per_rank} must be ≥ 0 and k = {k} ≥ 1")
    if (total := int(load.sum())) != ep * tokens_per_rank * k:
        raise ValueError(f"the load sums to {total}, not ep·S·K = {ep}·{tokens_per_rank}·{k}")
    return _plan(load.cpu(), ep, tokens_per_rank * k, redundant_slots)


def _flows(counts: Tensor, amounts: Tensor) -> Tensor:
    """``[source, processing rank, E]``: assignments of each expert each source sends to each rank. Source s holds
    positions ``[start, start + counts)`` of an expert's global order, rank r processes ``[first, first + amounts)``."""
    start, first = counts.cumsum(0) - counts, amounts.cumsum(0) - amounts
    lo = torch.maximum(start[:, None], first[None])
    hi = torch.minimum((start + counts)[:, None], (first + amounts)[None])
    return (hi - lo).clamp_min(0)


def _inverse(perm: Tensor) -> Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


@dataclass
class CommStats:
    """One rank's all-to-all traffic for the last forward (and its backward once run): bytes to and from other
    ranks (rows a rank sends itself are not counted), the dispatch receive buffer's rows (``S·K`` in MoonEP), how
    many of them came from each source, and how many redundant copies the rank received."""

    sent_bytes: int = 0
    received_bytes: int = 0
    recv_rows: int = 0
    recv_from: list[int] = field(default_factory=list)
    copies: int = 0


def _all_to_all(t: Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup | None,
                stats: CommStats) -> Tensor:
    out = t.new_empty(sum(recv), *t.shape[1:])
    dist.all_to_all_single(out, t.contiguous(), recv, send, group=group)
    me, row = dist.get_rank(group), math.prod(t.shape[1:]) * t.element_size()
    stats.sent_bytes += (sum(send) - send[me]) * row
    stats.received_bytes += (sum(recv) - recv[me]) * row
    return out


class _Exchange(torch.autograd.Function):
    """All-to-alls of several tensors (rows cut by ``(send, recv)`` split sizes), in order; backward sends the
    gradients back the same way, reversed — one autograd node, so every rank runs its collectives in one order."""

    @staticmethod
    def forward(ctx, group, stats: CommStats, splits: tuple, *tensors: Tensor) -> tuple[Tensor, ...]:  # noqa: ANN001
        ctx.group, ctx.stats, ctx.splits = group, stats, splits
        return tuple(_all_to_all(t, s, r, group, stats) for t, (s, r) in zip(tensors, splits))

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple:  # noqa: ANN001
        back = (_all_to_all(g, r, s, ctx.group, ctx.stats) for g, (s, r) in zip(grads, ctx.splits))
        return None, None, None, *back


class ExpertParallelExperts(Experts):
    """This rank's share of a routed `Experts` (SPEC §8): ``gate_up [E/ep, 2F, W]`` and ``down [E/ep, W, F]`` of
    experts ``rank·E/ep …``; `forward` has `Experts.forward`'s contract on this rank's tokens and is a collective.

    ``redundant_slots = 0``: plain EP (token counts may differ between ranks). ``> 0``: MoonEP, needing the same
    token count on every rank. ``placement`` and ``comm`` (`CommStats`) describe the last forward.
    """

    def __init__(self, experts: Experts, group: dist.ProcessGroup | None = None, redundant_slots: int = 0) -> None:
        nn.Module.__init__(self)
        if isinstance(experts, PackedExperts):
            raise ValueError("packed experts are not trainable: shard an unpacked `Experts` (PackedExperts.unpack)")
        ep, n = dist.get_world_size(group), experts.num_experts
        if n % ep:
            raise ValueError(f"ep = {ep} ranks do not divide the {n} routed experts")
        if not 0 <= redundant_slots <= n // ep:
            raise ValueError(f"redundant_slots = {redundant_slots} is invalid: must be in [0, E/ep = {n // ep}]")
        for name in ("activation", "gate_cap", "up_cap", "num_experts", "width", "hidden", "std", "weight_format",
                     "input_format"):
            setattr(self, name, getattr(experts, name))
        self.group, self.ep, self.rank, self.redundant_slots = group, ep, dist.get_rank(group), redundant_slots
        self.first, self.local = self.rank * (n // ep), n // ep
        own = slice(self.first, self.first + self.local)
        self.gate_up = nn.Parameter(experts.gate_up.detach()[own].clone(), experts.gate_up.requires_grad)
        self.down = nn.Parameter(experts.down.detach()[own].clone(), experts.down.requires_grad)
        self.placement: Placement | None = None
        self.comm = CommStats()
        self._copies: dict[int, tuple[Tensor, Tensor]] = {}

    @classmethod
    def from_experts(cls, experts: Experts, group: dist.ProcessGroup | None = None,
                     redundant_slots: int = 0) -> ExpertParallelExperts:
        """This rank's shard of ``experts`` (the same full weights on every rank) over ``group``."""
        return cls(experts, group, redundant_slots)

    def replan(self, load: Tensor) -> Placement:
        """The placement for the global ``load`` [E] (summed over ranks; identical on all ranks), kept in
        ``placement``. `forward` calls it with its batch's load, as exact balance needs this batch's counts."""
        _check_load(load, self.ep)
        if self.redundant_slots and int(load.sum()) % self.ep:
            raise ValueError(f"MoonEP: the load's {int(load.sum())} assignments do not split over {self.ep} ranks")
        self.placement = _plan(load.cpu(), self.ep, int(load.sum()) // self.ep, self.redundant_slots)
        return self.placement

    def expert_weights(self, e: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Expert ``e`` (global id; owned, or a copy received in this forward) as it computes, MX as in `Experts`."""
        if 0 <= e - self.first < self.local:
            gate_up, down = self.gate_up[e - self.first], self.down[e - self.first]
        else:
            gate_up, down = self._copies[e]
        if self.weight_format is None:
            return gate_up, down
        return mx.fake_quantize(gate_up, self.weight_format), mx.fake_quantize(down, self.weight_format)

    def _problem(self, x: Tensor, weights: Tensor, indices: Tensor) -> str | None:
        if x.dim() != 2 or x.shape[1] != self.width:
            return f"x must be [N, width = {self.width}], got {tuple(x.shape)}"
        if indices.dim() != 2 or indices.shape[0] != x.shape[0] or weights.shape != indices.shape:
            return f"weights and indices must be [N = {x.shape[0]}, k], got {tuple(weights.shape)}, " \
                   f"{tuple(indices.shape)}"
        if indices.is_floating_point() or indices.dtype == torch.bool:
            return f"indices must be integers, got {indices.dtype}"
        if indices.numel() and not (0 <= int(indices.min()) and int(indices.max()) < self.num_experts):
            return f"indices must be expert ids in [0, {self.num_experts})"
        return None

    def _counts(self, x: Tensor, weights: Tensor, indices: Tensor) -> Tensor:
        """Every rank's per-expert counts ``[ep, E]``; every rank raises the same way if any rank's inputs are bad."""
        n = self.num_experts
        problem = self._problem(x, weights, indices)
        mine = torch.zeros(n + 2, dtype=torch.long, device=x.device)
        if problem is None:
            mine[:n] = torch.bincount(indices.reshape(-1), minlength=n)
            mine[n] = x.shape[0]
        else:
            mine[n + 1] = 1
        rows = [torch.empty_like(mine) for _ in range(self.ep)]
        dist.all_gather(rows, mine, group=self.group)
        table = torch.stack(rows).cpu()
        if problem is not None:
            raise ValueError(problem)
        if bad := table[:, n + 1].nonzero().flatten().tolist():
            raise ValueError(f"rank(s) {bad} of the expert-parallel group passed invalid inputs")
        if self.redundant_slots and len(sizes := set(table[:, n].tolist())) > 1:
            raise ValueError(f"MoonEP (redundant_slots = {self.redundant_slots}) needs the same number of tokens on "
                             f"every rank, got {sorted(sizes)}; plain EP (redundant_slots = 0) allows unequal counts")
        return table[:, :n]

    def forward(self, x: Tensor, weights: Tensor, indices: Tensor) -> Tensor:
        """x [N, W], weights [N, k], indices [N, k] (global expert ids) → Σ_j weights_j · Expert_{indices_j}(x)."""
        counts = self._counts(x, weights, indices)
        amounts = self.replan(counts.sum(0)).amounts.tolist()
        flows = _flows(counts, self.placement.amounts)
        n, k, me, ep, dev = self.num_experts, indices.shape[1], self.rank, self.ep, x.device
        flat = indices.reshape(-1)
        order = torch.argsort(flat, stable=True)  # by expert, as `Experts.forward`
        dest = torch.repeat_interleave(torch.arange(ep, device=HOST).repeat(n), flows[me].T.reshape(-1)).to(dev)
        send = order[torch.argsort(dest * n + flat[order], stable=True)]  # by destination, then expert
        send_rows, recv_rows = flows[me].sum(1).tolist(), flows[:, me].sum(1).tolist()
        hosted = self.placement.copies(me)
        give = [[e for e in range(self.first, self.first + self.local) if amounts[d][e]] if d != me else []
                for d in range(ep)]
        ids = torch.tensor([e - self.first for g in give for e in g], dtype=torch.long, device=dev)
        packed = torch.cat([self.gate_up[ids].flatten(1), self.down[ids].flatten(1)], 1)
        self.comm = CommStats(recv_rows=sum(recv_rows), recv_from=recv_rows, copies=len(hosted))
        recv_x, recv_w = _Exchange.apply(
            self.group, self.comm,
            ((send_rows, recv_rows), ([len(g) for g in give], [sum(e // self.local == s for e in hosted)
                                                               for s in range(ep)])),
            x[send // k], packed)
        F, W = self.hidden, self.width
        gate_up, down = recv_w.split([2 * F * W, W * F], 1)
        self._copies = {e: (gate_up[i].view(2 * F, W), down[i].view(W, F)) for i, e in enumerate(hosted)}
        by_expert = torch.argsort(torch.repeat_interleave(torch.arange(n, device=HOST).repeat(ep),
                                                          flows[:, me].reshape(-1)),
                                  stable=True).to(dev)
        xs = recv_x[by_expert]
        try:
            outs = [self.expert(e, part) for e, part in enumerate(xs.split(flows[:, me].sum(0).tolist()))
                    if part.shape[0]]
        finally:
            self._copies = {}
        (back,) = _Exchange.apply(self.group, self.comm, ((recv_rows, send_rows),),
                                  torch.cat([xs[:0], *outs])[_inverse(by_expert)])
        acc = torch.promote_types(x.dtype, weights.dtype)
        y = back[_inverse(send)[order]].to(acc) * weights.reshape(-1)[order, None].to(acc)
        out = torch.zeros(x.shape[0], x.shape[-1], dtype=acc, device=dev)
        return out.index_add_(0, order // k, y).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, ep={self.ep}, rank={self.rank}, redundant_slots={self.redundant_slots}"


def shard_experts(model: nn.Module, group: dist.ProcessGroup | None = None, redundant_slots: int = 0) -> None:
    """Replace every routed `Experts` of ``model`` (each `LatentMoE.experts`), in place, by this rank's
    `ExpertParallelExperts` over ``group``; already-sharded ones are kept."""
    replace_experts(model, lambda e: e if isinstance(e, ExpertParallelExperts)
                    else ExpertParallelExperts.from_experts(e, group, redundant_slots))


@torch.no_grad()
def gather_experts(module: ExpertParallelExperts) -> tuple[Tensor, Tensor]:
    """The full ``(gate_up [E, 2F, W], down [E, W, F])`` on every rank (a collective)."""
    full = []
    for t in (module.gate_up, module.down):
        pieces = [torch.empty_like(t) for _ in range(module.ep)]
        dist.all_gather(pieces, t.detach().contiguous(), group=module.group)
        full.append(torch.cat(pieces))
    return full[0], full[1]


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """``model.state_dict()`` with every sharded expert tensor gathered whole: the state dict of the unsharded
    model, for a single-file checkpoint (a collective: every rank calls it)."""
    state = model.state_dict()
    for name, module in model.named_modules():
        if isinstance(module, ExpertParallelExperts):
            prefix = f"{name}." if name else ""
            state[prefix + "gate_up"], state[prefix + "down"] = gather_experts(module)
    return state
