"""`k3.dist.plan`'s communication formulae against the bytes a 2-process gloo training step really hands to the
collectives (`k3.dist.comm.CommLedger`), and the ledger itself against hand-counted collectives (issue 17)."""

from __future__ import annotations

import dataclasses
import shutil
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3.config import preset
from k3.dist import plan
from k3.dist.comm import CommLedger
from k3.dist.layout import ParallelLayout
from k3.train.pretrain import Run, TrainConfig
from gloo import free_port, join
from training import config as train_config


def _ledger_worker(rank: int, world: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        with CommLedger() as ledger:
            dist.all_gather([torch.empty(10) for _ in range(world)], torch.ones(10))  # receives 10 fp32 from the other
            dist.all_reduce(torch.ones(6, dtype=torch.float64))  # ring: 2·(n − 1)/n · 48 bytes
            dist.gather(torch.ones(3), [torch.empty(3) for _ in range(world)] if rank == 0 else None, group_dst=0)
            dist.scatter(torch.empty(5), [torch.ones(5)] * world if rank == 1 else None, group_src=1)
            splits = [1, 3] if rank == 0 else [2, 2]  # rank r receives splits[r] rows from each rank
            recv = [1, 2] if rank == 0 else [3, 2]
            dist.all_to_all_single(torch.empty(sum(recv), 4), torch.ones(sum(splits), 4), recv, splits)
        torch.save(dict(ledger.received["other"]), f"{out}/{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_the_ledger_counts_bytes_received(tmp_path, monkeypatch):
    monkeypatch.setattr("k3.dist.comm.PARTS", (("", "other"),))  # the test's own calls (module __mp_main__)
    mp.spawn(_ledger_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    rank0, rank1 = (torch.load(tmp_path / f"{r}.pt") for r in (0, 1))
    assert rank0["all_gather"] == rank1["all_gather"] == 40
    assert rank0["all_reduce"] == rank1["all_reduce"] == 48
    assert rank0["gather"] == 12 and rank1["gather"] == 0  # the destination alone receives
    assert rank0["scatter"] == 20 and rank1["scatter"] == 0  # all but the source receive
    assert rank0["all_to_all_single"] == 2 * 16 and rank1["all_to_all_single"] == 3 * 16  # the others' rows


def _step_worker(rank: int, world: int, port: int, layout: dict, config: dict, out: str) -> None:
    from k3.train.distributed import DistributedRun

    w = join(rank, world, port, layout)
    try:
        run = DistributedRun(TrainConfig.from_dict(config), w)
        run.prepare(False)
        run.step()
        with CommLedger() as ledger:
            run.step()
        torch.save({part: ledger.total(part) for part in ("fsdp", "muon", "context", "expert")},
                   f"{out}/{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("flags", [{"cp": 2}, {"ep": 2}], ids=["dp 1 x cp 2", "ep 2"])
def test_plan_predicts_the_bytes_a_training_step_moves(flags, corpus, tmp_path):
    config = train_config(tmp_path / "run", corpus, curriculum=[[0.0, 32]], steps=4, eval_every=100, ckpt_every=100)
    seed = Run(train_config(tmp_path / "tok", corpus))
    seed.prepare(False)
    (tmp_path / "run").mkdir()
    shutil.copytree(tmp_path / "tok" / "tokenizer", tmp_path / "run" / "tokenizer")
    mp.spawn(_step_worker, args=(2, free_port(), flags, config.to_dict(), str(tmp_path)), nprocs=2)
    measured = {part: (torch.load(tmp_path / "0.pt")[part] + torch.load(tmp_path / "1.pt")[part]) / 2
                for part in ("fsdp", "muon", "context", "expert")}  # mean over the ranks, as the plan counts
    tiny = preset("tiny")  # a text-only step never gathers, reduces or updates the vision encoder (its own unit)
    text = dataclasses.replace(tiny, vision=dataclasses.replace(tiny.vision, enabled=False))
    layout = ParallelLayout.for_world(2, **flags)
    sequences = config.tokens_per_step // 32 // layout.data_ranks
    assert measured["fsdp"] == sum(plan.fsdp_bytes(text, layout, param_bytes=4, grad_bytes=4).values())
    assert measured["muon"] == pytest.approx(sum(plan.muon_bytes(text, layout).values()), rel=1e-3)
    if layout.cp > 1:  # exactly the formula: summaries and halos, their backward all-reduces, the int64 counts
        forward = plan.cp_bytes_per_layer(text, layout, 32, sequences, dtype_bytes=4)
        backward = plan.cp_bytes_per_layer(text, layout, 32, sequences, dtype_bytes=4, backward=True)
        assert measured["context"] == sum(forward[kind] + backward[kind] for kind in text.layer_kinds())
    else:  # MoonEP moves the balanced token rows of the plan, plus hot experts' weight copies and load counts
        tokens = sequences * 32
        predicted = plan.all_to_all_bytes(text, layout, tokens, dtype_bytes=4)
        assert predicted <= measured["expert"] <= 1.25 * predicted
