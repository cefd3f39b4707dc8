"""Sharded training checkpoints with `torch.distributed.checkpoint` (issue 17, item 5).

A distributed run's checkpoint ``step-NNNNNNN`` holds what a single-process one holds (`k3.train.checkpoint`)
except the tensors of the model and optimisers, which live in ``dcp/`` as DCP shards: every rank writes its own
shards of the weights, Muon momenta and AdamW moments (FSDP2 DTensors, keyed by parameter name), and DCP's metadata
records each tensor's global shape, so a checkpoint saved on N ranks loads on M ranks — any layout, a single process
included — by resharding. ``state.json`` / ``state.safetensors`` keep the schedulers, data-loader position, RNG
and step; ``config.json``, ``tokenizer.json``, ``train.json`` and ``checksums.json`` are the single-process files.

Saving is atomic across ranks: all ranks write into ``step-NNNNNNN.tmp``, rank 0 renames it after a barrier and only
then moves ``latest``, so a rank killed mid-save (kill -9) leaves ``latest`` on the previous, complete checkpoint.

`convert` turns one format into the other in one process (``k3 convert-ckpt``).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from k3.config import K3Config
from k3.dist.fsdp import local_rows, local_shard
from k3.model.checkpoint import (MANIFEST, SHARDED, atomic_directory, check_size, latest_checkpoint, read_config,
                                 verified, write_config, write_manifest, write_model)
from k3.model.lm import K3ForCausalLM
from k3.sizing.memory import check_stored
from k3.train import checkpoint as ckpt
from k3.train.dcp_files import LoadPlanner, Reader
from k3.train.optim import OptimConfig, build_optimizers

SHARDS = SHARDED
METADATA = ".metadata"


def is_sharded(path: Path) -> bool:
    return (Path(path) / SHARDS).is_dir()


def verify_sharded(path: Path) -> None:
    """The files of a sharded checkpoint are there and match their checksums; DCP's metadata is present."""
    for name in ("config.json", "tokenizer.json", "train.json", ckpt.STATE_TENSORS, ckpt.STATE_JSON):
        verified(path, name)
    if not (path / SHARDS / METADATA).is_file():
        raise ValueError(f"{path / SHARDS}: DCP metadata {METADATA} is missing (an incomplete save)")
    for name in sorted(p.name for p in (path / SHARDS).iterdir() if p.name != MANIFEST):
        verified(path / SHARDS, name)  # every shard file, against dcp/checksums.json


def read_sized_config(path: Path) -> K3Config:
    """The checkpoint's model config, once its stored tensors are known to be able to hold that model
    (`k3.sizing.memory.check_stored`; a sharded checkpoint's shards hold the optimiser moments too, so only the lower
    bound applies): a crafted config is refused before its model is built."""
    config = read_config(path)
    if not is_sharded(path):
        check_size(path, config)
        return config
    stored = sum(p.lstat().st_size for p in (path / SHARDS).iterdir() if p.is_file() and not p.is_symlink())
    check_stored(config, stored, str(path / "config.json"), str(path / SHARDS))
    return config


def verify_any(path: Path) -> None:
    """`verify_sharded` or `k3.train.checkpoint.verify_checkpoint`, whichever format ``path`` has."""
    (verify_sharded if is_sharded(path) else ckpt.verify_checkpoint)(path)


@dataclass
class ExpertShards:
    """Expert-parallel experts (`k3.dist.expert`): ep rank r holds rows ``r·E/ep …`` of the full expert tensors, FSDP-
    sharded over the ranks sharing them. Saved gathered per ep rank as DTensors over the ``ep`` mesh, so the checkpoint
    holds the full ``[E, …]`` tensors whatever the layout."""

    mesh: DeviceMesh  # the ep mesh
    names: list[str]  # the parameters' names, in one order on every rank (each is gathered by a collective)

    def whole(self, t: Tensor) -> Tensor:
        """This ep rank's experts (gathered from their FSDP shards) as its piece of the full tensor."""
        local = t.full_tensor() if isinstance(t, DTensor) else t.detach()
        return DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False)


def _state(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    model_state, optim_state = get_state_dict(model, optimizers)
    return {"model": model_state, "optim": optim_state}


def _experts(state: dict[str, Any], experts: ExpertShards, fn) -> dict[str, Any]:  # noqa: ANN001
    """A copy of `_state`'s dicts with ``fn(original)`` for every expert tensor (weights and optimiser moments)."""
    model_state = dict(state["model"])
    optim = dict(state["optim"])
    optim["state"] = {name: dict(entry) for name, entry in optim.get("state", {}).items()}
    for name in experts.names:
        model_state[name] = fn(state["model"][name])
        entry = optim["state"].get(name, {})
        entry.update({key: fn(v) for key, v in entry.items() if isinstance(v, Tensor) and v.dim()})
    return {"model": model_state, "optim": optim}


@torch.no_grad()
def _copy_back(loaded: dict[str, Any], state: dict[str, Any], experts: ExpertShards) -> None:
    """Write the loaded whole expert tensors into this rank's shards of them (in ``state``: the model's own)."""
    def back(original: Tensor, whole: Tensor) -> None:
        local_shard(original).copy_(whole.to_local()[local_rows(original)])

    for name in experts.names:
        back(state["model"][name], loaded["model"][name])
        for key, value in state["optim"].get("state", {}).get(name, {}).items():
            if isinstance(value, Tensor) and value.dim():
                back(value, loaded["optim"]["state"][name][key])


def save(out: Path, step: int, model: nn.Module, optimizers: list[torch.optim.Optimizer], config: K3Config,
         train: dict[str, Any], tokenizer_dir: Path, state: dict[str, Any], experts: ExpertShards | None = None,
         keep: int = 2) -> Path:
    """Write sharded checkpoint ``step`` under ``out`` on every rank (a collective); rank 0 writes the small files
    (each through `k3.files.atomic_write`), renames the directory and `k3.train.checkpoint.publish`es it."""
    main = not dist.is_initialized() or dist.get_rank() == 0
    final = out / f"step-{step:07d}"
    tmp = final.with_name(final.name + ".tmp")
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    state_dicts = _state(model, optimizers)
    if experts is not None:
        state_dicts = _experts(state_dicts, experts, experts.whole)
    dcp.save(state_dicts, checkpoint_id=str(tmp / SHARDS), no_dist=not dist.is_initialized())
    if main:
        _write_small_files(tmp, config, train, tokenizer_dir, state)
        write_manifest(tmp / SHARDS)  # every rank's shards are complete once dcp.save has returned
        write_manifest(tmp)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        ckpt.publish(out, final, keep)
    _barrier()
    return final


def _write_small_files(directory: Path, config: K3Config, train: dict[str, Any], tokenizer_dir: Path,
                       state: dict[str, Any]) -> None:
    """Every file of a sharded checkpoint but its shards: ``config.json`` and the run's files."""
    write_config(directory, config)
    ckpt.write_run_files(directory, train, tokenizer_dir, state)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def load(path: Path, model: nn.Module, optimizers: list[torch.optim.Optimizer],
         experts: ExpertShards | None = None) -> None:
    """Load the model's and optimisers' tensors of sharded checkpoint ``path`` into this process's shards
    (resharding from whatever layout saved them; a plain, unsharded model in a single process too)."""
    verify_sharded(path)
    state = _state(model, optimizers)
    tensors = state if experts is None else _experts(state, experts, experts.whole)
    saved = Reader(str(path / SHARDS)).read_metadata().state_dict_metadata
    missing = sorted(f"model.{name}" for name in tensors["model"] if f"model.{name}" not in saved)
    if missing:
        raise ValueError(f"{path / SHARDS}: holds no tensor {missing[0]!r} ({len(missing)} of the model's missing)")
    try:  # parameters that never had a gradient (e.g. an unused vision tower) have no optimiser state saved
        dcp.load(tensors, storage_reader=Reader(str(path / SHARDS)), planner=LoadPlanner(allow_partial_load=True),
                 no_dist=not dist.is_initialized())
    except Exception as err:  # DCP raises CheckpointException (or RuntimeError) for mismatched tensors
        raise ValueError(f"{path / SHARDS}: cannot load into this model ({type(err).__name__}: {err})") from err
    if experts is not None:
        _copy_back(tensors, state, experts)
    set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"])


def resolve(path: Path) -> Path:
    """A training checkpoint directory (either format), or a run directory's newest one."""
    path = Path(path)
    if (path / ckpt.STATE_JSON).exists() or (path / ckpt.LEGACY_STATE).exists():
        return path
    found = latest_checkpoint(path, verify_any) if path.is_dir() else None
    if found is None:
        raise ValueError(f"{path}: no training checkpoint here (a run directory or a step-* checkpoint directory)")
    return found


def convert(source: Path, out: Path) -> Path:
    """Write training checkpoint ``source`` (or a run directory's newest) in the other format as ``out``, in this
    process: sharded → single-process files, single-process → sharded. ``out`` must not exist."""
    source, out = resolve(source), Path(out)
    if out.exists():
        raise ValueError(f"{out}: already exists; choose a new --out (nothing was written)")
    state, train = ckpt.load_state(source), ckpt.read_train(source)
    config = read_sized_config(source)
    model = K3ForCausalLM(config)
    optimizers = build_optimizers(model, config, OptimConfig(**train.get("optim", {})))
    sharded = is_sharded(source)
    if sharded:
        load(source, model, optimizers)
        state["optimizers"] = [opt.state_dict() for opt in optimizers]
    else:
        ckpt.load_single(source, model, optimizers, state)
        del state["optimizers"]  # the shards hold them
    with atomic_directory(out) as tmp:
        if sharded:
            write_model(tmp, model, config)
        else:
            dcp.save(_state(model, optimizers), checkpoint_id=str(tmp / SHARDS), no_dist=not dist.is_initialized())
            write_manifest(tmp / SHARDS)
        _write_small_files(tmp, config, train, source, state)
    return out
