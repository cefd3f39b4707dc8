"""Training on N processes (issue 17; SPEC §8): `DistributedRun` and the ``k3 train --nproc`` launcher.

Every rank builds the same model from the seed and reads the same global batches; the `ParallelLayout` decides its
share: batch rows by data rank (``dp_replicate × dp_shard × ep``), a contiguous segment of every sequence by context
rank (``cp``). Each rank backpropagates its share's loss sum divided by the step's global count of supervised
positions (known from the masks on every rank), FSDP2 sums the gradients (`k3.dist.fsdp`), Muon orthogonalises
whole matrices on owner ranks (`k3.dist.muon`), the balancer pools the routers' statistics over all ranks (every
rank then writes the same bias), QK-clip uses the largest logit any rank saw. The step's loss, gradients and
parameters are therefore the single-process run's on the same batch, up to float summation order.

Rank 0 writes the run's files (tokenizer, metrics, plot); checkpoints are sharded (`k3.train.sharded`), written by
all ranks. A 1-process run never comes here: it is `k3.train.pretrain.Run`, with no distributed call.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from k3.dist.context import ContextParallel
from k3.dist.expert import ExpertParallelExperts, shard_experts
from k3.dist.fsdp import shard_model
from k3.dist.muon import clip_grad_norm
from k3.dist.layout import ParallelLayout
from k3.dist.mesh import World
from k3.sizing.machine import MOST_PER_MACHINE, PER_CORE
from k3.train import sharded
from k3.train.driver import drive
from k3.train.pretrain import DEFAULT_TOKENS_PER_RANK, PANELS, Run, TrainConfig, resumed, tokens_per_step_for, train


def check_layout(config: TrainConfig, layout: ParallelLayout) -> ParallelLayout:
    """The layout against the run (``config`` `TrainConfig.resolved` for it) before any process exists: ``ep``
    against the experts, every curriculum stage's batch rows against the data ranks, its sequence length against
    ``cp``. Errors name the flag, and for a step that does not split the value that would."""
    if layout.distributed and config.multimodal:
        raise ValueError("--multimodal is not supported with more than one process yet")
    config = config.resolved(layout.data_ranks).validate()
    lengths = [int(length) for _, length in config.curriculum]
    layout.validate(config.model_config(), seq_lens=lengths)
    for length in lengths:
        rows = config.tokens_per_step // (length * config.grad_accum)
        if rows % layout.data_ranks:
            fits = tokens_per_step_for(config.curriculum, config.grad_accum, layout.data_ranks,
                                       config.tokens_per_step)
            raise ValueError(f"--tokens-per-step {config.tokens_per_step} (with --grad-accum {config.grad_accum}) "
                             f"gives the {length}-token curriculum stage {rows} sequence(s) per micro-batch, which "
                             f"do not split over the {layout.data_ranks} data-parallel ranks (--dp-replicate × "
                             f"--dp-shard × --ep): give --tokens-per-step {fits}, or leave it out for the default "
                             f"({DEFAULT_TOKENS_PER_RANK} tokens per data rank, rounded to split)")
    return layout


class DistributedRun(Run):
    """`Run` on one rank of ``world``: same data, its share of each step, sharded model and checkpoints."""

    def __init__(self, config: TrainConfig, world: World, redundant_slots: int | None = None) -> None:
        """``redundant_slots`` (``ep`` > 1): MoonEP's redundant expert slots per rank; None: E/ep (every plan
        feasible), 0: plain expert parallelism."""
        check_layout(config, world.layout)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world.layout.world))
        config = dataclasses.replace(config.resolved(world.layout.data_ranks),
                                     progress=config.progress and world.rank == 0,
                                     threads=config.threads or threads_per_rank(local_world))
        super().__init__(config)
        self.world, self.device = world, world.device
        self.metrics.writes = world.rank == 0
        self.model.to(self.device)
        lay = world.layout
        self.experts: list[ExpertParallelExperts] = []
        self.expert_mesh = None
        if lay.ep > 1:  # each rank keeps E/ep experts, FSDP-sharded over the ranks that share them
            local = self.model_config.moe.num_experts // lay.ep
            shard_experts(self.model, world.group("ep"), local if redundant_slots is None else redundant_slots)
            self.experts = [m for m in self.model.modules() if isinstance(m, ExpertParallelExperts)]
            self.expert_mesh = world.expert_mesh()
        shard_model(self.model, world.fsdp_mesh(), config.bf16,
                    None if self.expert_mesh is None else (self.expert_mesh, self.experts))
        self.context = ContextParallel(world.group("cp")) if lay.cp > 1 else None

    def prepare_data(self, resume: bool) -> Path | None:
        """Rank 0 first (it may train and write the tokenizer), then the others, which read what it wrote; an error
        on rank 0 is raised on every rank."""
        outcome: list[str | None] = [None]
        existing = None
        if self.writes:
            try:
                existing = super().prepare_data(resume)
            except (ValueError, OSError) as err:
                outcome = [f"{type(err).__name__}: {err}"]
                dist.broadcast_object_list(outcome, src=0)
                raise
        dist.broadcast_object_list(outcome, src=0)
        if outcome[0] is not None:
            raise ValueError(f"rank 0 could not prepare the run: {outcome[0]}")
        return existing if self.writes else super().prepare_data(resume)

    def _load_single(self, path: Path, state: dict[str, Any]) -> None:
        raise ValueError(f"{path}: a single-process checkpoint; a distributed run resumes from a sharded one — "
                         f"convert it first: k3 convert-ckpt --ckpt {path} --out DIR")

    def share(self, t: Tensor) -> Tensor:
        """This rank's rows (data rank) and contiguous segment (context rank) of a global ``[B, T]`` batch tensor."""
        lay = self.world.layout
        rows = t.tensor_split(lay.data_ranks)[self.world.data_index]
        return rows.tensor_split(lay.cp, dim=1)[self.world.cp_index].to(self.device)

    def reduce_loss(self, total: Tensor) -> Tensor:
        """Every rank's loss sum added (the step's objective has the global supervised count as denominator)."""
        dist.all_reduce(total)
        return total

    def clip_gradients(self, max_norm: float) -> float:
        """The global norm: expert shards' squares summed over their mesh and over the ranks holding other experts."""
        extra = {self.expert_mesh: self.world.group("ep")} if self.experts else None
        return clip_grad_norm(list(self.model.parameters()), max_norm, extra)

    def save(self) -> Path:
        return sharded.save(self.out, self.step_index, self.model, self.optimizers, self.model_config,
                            self.config.to_dict(), self.tok_dir, self.train_state(), self._expert_shards())

    def _load_sharded(self, path: Path) -> None:
        sharded.load(path, self.model, self.optimizers, self._expert_shards())

    def _expert_shards(self) -> sharded.ExpertShards | None:
        """Where this rank's expert-parallel experts sit in the full expert tensors (for DCP), if any."""
        if not self.experts:
            return None
        names = [f"{name}.{p}" for name, m in self.model.named_modules() if isinstance(m, ExpertParallelExperts)
                 for p in ("gate_up", "down")]
        return sharded.ExpertShards(self.world.mesh["ep"], names)


def train_distributed(config: TrainConfig, world: World, resume: bool = False,
                      redundant_slots: int | None = None) -> DistributedRun:
    """`k3.train.pretrain.train` on this rank of ``world``: every rank calls it."""
    run = DistributedRun(resumed(config, resume), world, redundant_slots)
    run.prepare(resume)
    drive(run, PANELS)
    return run


def train_command(config: TrainConfig, resume: bool, argv: list[str], nproc: int | None = None,
                  redundant_slots: int | None = None, **layout: int | None) -> Run | int:
    """``k3 train``: the layout (``dp_replicate``, ``dp_shard``, ``ep``, ``cp``) is checked before anything starts;
    then one process trains alone (`k3.train.pretrain.train`), or under torchrun (``WORLD_SIZE`` set) this process
    trains its rank, or with ``nproc`` > 1 it launches torchrun on ``argv``. Returns the run whose result this
    process reports, or an exit status (the launcher's; 0 on ranks other than 0)."""
    world = int(os.environ.get("WORLD_SIZE", nproc or 1))  # torchrun sets WORLD_SIZE on every rank
    if nproc is not None and nproc != world:
        raise ValueError(f"--nproc {nproc} disagrees with WORLD_SIZE={world} set by the launcher")
    if nproc is not None and "WORLD_SIZE" not in os.environ:
        check_local_world(nproc)
    parallel = check_layout(config, ParallelLayout.for_world(world, **layout))
    if redundant_slots is not None:
        local = config.model_config().moe.num_experts // parallel.ep
        if parallel.ep == 1 or redundant_slots > local:
            raise ValueError(f"--ep-slots {redundant_slots} is invalid: it needs --ep > 1 and may be at most E/ep = "
                             f"{local} (0: plain expert parallelism)")
    if not parallel.distributed:
        return train(config, resume=resume)
    if "WORLD_SIZE" not in os.environ:
        return launch(_without_flag(argv, "--nproc"), world)
    from k3.dist.mesh import init_world

    run = train_distributed(config, init_world(parallel), resume, redundant_slots)
    return run if run.writes else 0


def _without_flag(argv: list[str], flag: str) -> list[str]:
    """``argv`` without ``flag`` and its value (``--flag V`` or ``--flag=V``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out


def check_local_world(nproc: int) -> None:
    """Refuse ``--nproc`` beyond what this machine can run: one process per accelerator where there are any, else
    `k3.sizing.memory.PER_CORE` per CPU core (each rank holds its own Python, torch and shard; ``--nproc 1000``
    on 2 cores ran the machine out of memory). More ranks than that: torchrun across machines."""
    if torch.accelerator.is_available():
        count, what = torch.accelerator.device_count(), f"{torch.accelerator.current_accelerator().type} devices"
    else:
        count, what = MOST_PER_MACHINE, f"CPU processes ({PER_CORE} per core)"
    if nproc > count:
        raise ValueError(f"--nproc {nproc}: this machine runs at most {count} {what}; for more, start torchrun on "
                         f"several machines")


def threads_per_rank(local_world: int) -> int:
    """Torch threads for each of ``local_world`` processes on this machine: the cores shared out, at least one."""
    return max(1, (os.cpu_count() or 1) // local_world)


def launch(argv: list[str], nproc: int) -> int:
    """Run ``k3 <argv>`` on ``nproc`` local processes with ``torchrun`` (``torch.distributed.run --standalone``);
    returns its exit status (non-zero when any rank failed: torchrun then stops the others)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "--max-restarts=0", "-m", "k3", *argv]
    return subprocess.run(command, check=False).returncode
