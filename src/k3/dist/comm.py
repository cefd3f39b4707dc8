"""Bytes a rank receives through ``torch.distributed`` collectives, counted at the calls (issue 17's measurements).

`CommLedger` wraps the collectives of the ``torch.distributed`` module while it is active and adds, per call, the
bytes this rank receives from the others under the convention of `k3.dist.plan` (ring algorithms): all-gather
``(n − 1)·b`` of an input of ``b`` bytes; reduce-scatter ``(n − 1)/n·b``; all-reduce ``2(n − 1)/n·b``; all-to-all the
output minus this rank's own piece; gather ``(n − 1)·b`` on the destination; scatter and broadcast ``b`` off the
source. Each call is filed under the part of the system that made it, found from the caller's module: ``fsdp``
(FSDP2's parameter all-gathers and gradient reduce-scatters), ``muon`` (`k3.dist.muon`), ``context``
(`k3.dist.context`), ``expert`` (`k3.dist.expert`), ``balance`` (`k3.train.balance`), else ``other``. The sizes are
those of the tensors actually handed to the collectives (FSDP2's padding included).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Callable

import torch.distributed as dist
from torch import Tensor

#: Caller modules (prefixes) → part; the first frame whose module matches files the call.
PARTS = (("torch.distributed.fsdp", "fsdp"), ("k3.dist.muon", "muon"), ("k3.dist.context", "context"),
         ("k3.dist.expert", "expert"), ("k3.train.balance", "balance"), ("k3.", "other"))


def _bytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _received(name: str, args: tuple, kwargs: dict) -> int:
    """Bytes this rank receives in collective ``name`` called with ``args`` / ``kwargs``."""
    group = kwargs.get("group")
    n, me = dist.get_world_size(group), dist.get_rank(group)
    if name in ("all_gather", "all_gather_into_tensor", "all_gather_single"):
        piece = args[1] if len(args) > 1 else kwargs.get("tensor", kwargs.get("input_tensor"))
        return (n - 1) * _bytes(piece)
    if name in ("reduce_scatter_tensor", "reduce_scatter_single"):
        whole = args[1] if len(args) > 1 else kwargs["input"]
        return (n - 1) * _bytes(whole) // n
    if name == "all_reduce":
        return 2 * (n - 1) * _bytes(args[0] if args else kwargs["tensor"]) // n
    if name == "all_to_all_single":
        out = args[0] if args else kwargs["output"]
        splits = kwargs.get("output_split_sizes", args[2] if len(args) > 2 else None)
        own = _bytes(out) // n if not splits else _bytes(out) // max(1, out.shape[0]) * splits[me]
        return _bytes(out) - own
    if name == "gather":
        dst = kwargs.get("group_dst", kwargs.get("dst"))
        return (n - 1) * _bytes(args[0] if args else kwargs["tensor"]) if dst == me else 0
    if name in ("scatter", "broadcast"):
        src = kwargs.get("group_src", kwargs.get("src"))
        return 0 if src == me else _bytes(args[0] if args else kwargs["tensor"])
    return 0


COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
               "reduce_scatter_single", "all_reduce", "all_to_all_single", "gather", "scatter", "broadcast")


def _part() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        for prefix, part in PARTS:
            if module.startswith(prefix):
                return part
        frame = frame.f_back
    return "other"


class CommLedger:
    """``with CommLedger() as ledger: …`` — ``ledger.received[part][collective]``: bytes this rank received; ``calls``
    counts the calls the same way. Only one ledger may be active at a time."""

    def __init__(self) -> None:
        self.received: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.calls: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._saved: dict[str, Callable] = {}

    def __enter__(self) -> CommLedger:
        if any(getattr(getattr(dist, name), "_k3_ledger", False) for name in COLLECTIVES):
            raise RuntimeError("CommLedger: another ledger is already active")
        for name in COLLECTIVES:
            self._saved[name] = getattr(dist, name)
            setattr(dist, name, self._counting(name, self._saved[name]))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved.clear()

    def _counting(self, name: str, fn: Callable) -> Callable:
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            part = _part()
            self.received[part][name] += _received(name, args, kwargs)
            self.calls[part][name] += 1
            return fn(*args, **kwargs)

        call._k3_ledger = True
        return call

    def total(self, part: str | None = None) -> int:
        """Bytes received, by one part or by all."""
        parts = [part] if part is not None else list(self.received)
        return sum(sum(self.received[p].values()) for p in parts)
