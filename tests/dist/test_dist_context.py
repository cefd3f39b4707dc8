"""KDA context parallelism (issue 17, item 4; SPEC §8) on real gloo process groups of 2 and 4 processes: each rank's
segment output, the final state, and every rank's gradients equal single-process `kda.chunked` on the whole
sequence — uneven segments, an empty one, H > 1, and ShortConv halos spanning ranks shorter than the window."""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from k3.dist.context import conv_halo, kda_context_parallel
from k3.ops import kda

B, H, K, V, WIDTH, C = 2, 3, 8, 6, 4, 5


def _inputs(total: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"q": kda.l2norm(torch.randn(B, total, H, K, generator=g, dtype=torch.float64)),
            "k": kda.l2norm(torch.randn(B, total, H, K, generator=g, dtype=torch.float64)),
            "v": torch.randn(B, total, H, V, generator=g, dtype=torch.float64),
            "g": -F.softplus(torch.randn(B, total, H, K, generator=g, dtype=torch.float64)),
            "beta": torch.sigmoid(torch.randn(B, total, H, generator=g, dtype=torch.float64)),
            "x": torch.randn(B, total, C, generator=g, dtype=torch.float64),
            "w": torch.randn(C, WIDTH, generator=g, dtype=torch.float64),
            "out_q": torch.randn(B, total, H, V, generator=g, dtype=torch.float64),
            "out_y": torch.randn(B, total, C, generator=g, dtype=torch.float64),
            "out_s": torch.randn(B, H, K, V, generator=g, dtype=torch.float64)}


def _conv(x: torch.Tensor, window: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    full = torch.cat([window, x], dim=1)
    if x.shape[1] == 0:  # an empty segment: no outputs (conv1d refuses an input shorter than its kernel)
        return x + 0.0 * full.sum()
    return F.silu(F.conv1d(full.transpose(1, 2), w.unsqueeze(1), groups=C).transpose(1, 2))


def _loss(t: dict, o: torch.Tensor, final: torch.Tensor | None, y: torch.Tensor, sl: slice) -> torch.Tensor:
    loss = (o * t["out_q"][:, sl]).sum() + (y * t["out_y"][:, sl]).sum()
    return loss if final is None else loss + (final * t["out_s"]).sum()


def _worker(rank: int, world: int, lengths: list[int], init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))  # a stuck collective fails the test, never hangs it
    try:
        t = _inputs(sum(lengths))
        start = sum(lengths[:rank])
        sl = slice(start, start + lengths[rank])
        mine = {n: t[n][:, sl].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "x")}
        o, final = kda_context_parallel(*(mine[n] for n in ("q", "k", "v", "g", "beta")), chunk_size=16)
        y = _conv(mine["x"], conv_halo(mine["x"], WIDTH), t["w"])
        _loss(t, o, final if rank == world - 1 else None, y, sl).backward()
        torch.save({"o": o.detach(), "y": y.detach(), "final": final.detach(),
                    **{f"grad_{n}": torch.zeros_like(p) if p.grad is None else p.grad for n, p in mine.items()}},
                   Path(out) / f"rank{rank}.pt")  # an empty segment's inputs get no gradient
    finally:
        dist.destroy_process_group()


def _reference(lengths: list[int]) -> dict[str, torch.Tensor]:
    t = _inputs(sum(lengths))
    whole = {n: t[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "x")}
    o, final = kda.chunked(*(whole[n] for n in ("q", "k", "v", "g", "beta")), chunk_size=16)
    y = _conv(whole["x"], whole["x"].new_zeros(B, WIDTH - 1, C), t["w"])
    _loss(t, o, final, y, slice(None)).backward()
    return {"o": o.detach(), "y": y.detach(), "final": final.detach(),
            **{f"grad_{n}": p.grad for n, p in whole.items()}}


@pytest.mark.parametrize("lengths", [[20, 13], [9, 1, 0, 30]], ids=["2 ranks", "4 ranks, short and empty"])
def test_context_parallel_kda_and_conv_equal_one_process(lengths):
    world = len(lengths)
    with tempfile.TemporaryDirectory() as out:
        init = f"file://{os.path.join(out, 'rendezvous')}"
        mp.spawn(_worker, args=(world, lengths, init, out), nprocs=world, join=True)
        ranks = [torch.load(Path(out) / f"rank{r}.pt") for r in range(world)]
    ref = _reference(lengths)
    for key in ("o", "y", *(f"grad_{n}" for n in ("q", "k", "v", "g", "beta", "x"))):
        got = torch.cat([r[key] for r in ranks], dim=1)
        torch.testing.assert_close(got, ref[key], rtol=1e-10, atol=1e-10, msg=key)
    for r in ranks:  # every rank knows the whole sequence's final state
        torch.testing.assert_close(r["final"], ref["final"], rtol=1e-10, atol=1e-10)
    first = torch.cat([r["grad_k"] for r in ranks[:-1]], dim=1)  # non-last ranks' gradients (fla#1115's case)
    assert first.abs().sum() > 0


def _mla(seed: int = 3):
    from k3.config import preset
    from k3.model.sequence.mla import GatedMLA

    torch.manual_seed(seed)
    layer = GatedMLA(preset("tiny")).double()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, 40, layer.hidden_size, generator=g, dtype=torch.float64)
    return layer, x, torch.randn(B, 40, layer.hidden_size, generator=g, dtype=torch.float64)


def _mla_worker(rank: int, world: int, lengths: list[int], init: str, out: str) -> None:
    from k3.dist.context import mla_context_parallel

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        layer, x, weight = _mla()
        start = sum(lengths[:rank])
        mine = x[:, start:start + lengths[rank]].clone().requires_grad_()
        y = mla_context_parallel(layer, mine)
        (y * weight[:, start:start + lengths[rank]]).sum().backward()
        grads = {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in layer.named_parameters()}
        torch.save({"y": y.detach(), "grad_x": torch.zeros_like(mine) if mine.grad is None else mine.grad,
                    "params": grads}, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("lengths", [[25, 15], [7, 1, 0, 32]], ids=["2 ranks", "4 ranks, short and empty"])
def test_context_parallel_mla_equals_one_process(lengths):
    world = len(lengths)
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_mla_worker, args=(world, lengths, f"file://{os.path.join(out, 'rendezvous')}", out), nprocs=world,
                 join=True)
        ranks = [torch.load(Path(out) / f"rank{r}.pt") for r in range(world)]
    layer, x, weight = _mla()
    x = x.requires_grad_()
    y, _ = layer(x)
    (y * weight).sum().backward()
    torch.testing.assert_close(torch.cat([r["y"] for r in ranks], 1), y.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(torch.cat([r["grad_x"] for r in ranks], 1), x.grad, rtol=1e-10, atol=1e-10)
    for name, p in layer.named_parameters():  # each rank holds a share of every weight's gradient: they sum to it
        torch.testing.assert_close(sum(r["params"][name] for r in ranks), p.grad, rtol=1e-10, atol=1e-10, msg=name)
