"""Shared pieces of the training tests: a small training config over a fixed corpus."""

from __future__ import annotations

from pathlib import Path

from k3.train.pretrain import TrainConfig
from k3.train.optim import OptimConfig


def config(out: Path, corpus: Path, **changes) -> TrainConfig:
    base = dict(out=str(out), preset="tiny", steps=6, tokens_per_step=512, curriculum=[[0.0, 32], [0.5, 64]],
                eval_every=3, eval_batches=2, ckpt_every=3, data=[str(corpus)], progress=False,
                optim=OptimConfig(lr=0.01, adam_lr=0.01), threads=1)  # results independent of other processes
    base.update(changes)
    return TrainConfig(**base)
