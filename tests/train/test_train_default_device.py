"""Device-agnostic training (issue 39, item 1): the steps make no tensor off the model's device.

With ``torch.set_default_device("meta")`` in effect and the model on the CPU, a tensor made without an explicit device
lands on ``meta`` and fails the step. A training run — one process, and two gloo processes (FSDP, expert parallelism)
— must give the losses it gives without the trap: the CPU proof that training on CUDA makes its tensors there.
Batches are made on the host on purpose (`k3.train.data.HOST`) and moved by the trainer.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gloo import free_port, join
from k3.train.pretrain import Run, TrainConfig
from training import config as train_config

STEPS = 2


def _losses(run: Run, trapped: bool) -> list[float]:
    """``STEPS`` steps and an evaluation, under the meta trap or not (the run is prepared outside it)."""
    if trapped:
        torch.set_default_device("meta")
        assert torch.empty(1).is_meta
    try:
        return [run.step()["loss"] for _ in range(STEPS)] + [run.evaluate().loss]
    finally:
        torch.set_default_device(None)


@pytest.mark.parametrize("changes", [{}, {"qat": "mx"}, {"multimodal": True, "multimodal_batch": 2}, {"grad_accum": 2}],
                         ids=["default", "qat", "multimodal", "grad_accum"])
def test_a_training_run_makes_no_tensor_off_the_models_device(corpus, tmp_path, changes):
    results = []
    for name, trapped in (("plain", False), ("trapped", True)):
        run = Run(train_config(tmp_path / name, corpus, **changes))
        run.prepare(False)
        results.append(_losses(run, trapped))
    assert results[1] == results[0]


def _trapped_rank(rank: int, world: int, port: int, layout: dict, config: dict, out: str) -> None:
    from k3.train.distributed import DistributedRun

    w = join(rank, world, port, layout)
    try:
        run = DistributedRun(TrainConfig.from_dict(config), w)
        run.prepare(False)
        torch.save(_losses(run, True), Path(out) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("layout", [{}, {"ep": 2}], ids=["fsdp", "expert parallel"])
def test_distributed_training_makes_no_tensor_off_the_models_device(corpus, tmp_path, layout):
    """Two gloo ranks under the trap: the one process's losses (as `test_dist_train` without the trap)."""
    reference = Run(train_config(tmp_path / "one", corpus))
    reference.prepare(False)
    want = _losses(reference, False)
    config = train_config(tmp_path / "many", corpus)
    (tmp_path / "many").mkdir()
    shutil.copytree(tmp_path / "one" / "tokenizer", tmp_path / "many" / "tokenizer")
    mp.spawn(_trapped_rank, args=(2, free_port(), layout, config.to_dict(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        assert torch.load(tmp_path / f"{rank}.pt") == pytest.approx(want, rel=1e-5)
