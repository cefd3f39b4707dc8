"""Training checkpoints: a model checkpoint (`k3.model.checkpoint`) plus the training config and state.

A checkpoint is a directory ``DIR/step-NNNNNNN`` holding the model checkpoint's files (``model.safetensors``,
``config.json``, ``tokenizer.json``, ``checksums.json``) and

* ``train.json`` — the training config;
* ``state.safetensors`` + ``state.json`` — optimisers, schedulers, data-loader position, RNG states and
  step: every tensor in the first, the rest in the second, which refers to them by name
  (`k3.train.state_codec`). Older checkpoints hold ``state.pt`` instead, read with
  ``torch.load(weights_only=True)``: a pickle that would call anything is refused.

It is written atomically (`k3.model.checkpoint.atomic_directory`); ``DIR/latest`` names the newest complete
checkpoint, and older ones beyond ``keep`` are pruned — never the one ``latest`` names. A killed write leaves
``latest`` on the previous checkpoint.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from k3.config import K3Config
from k3.files import atomic_write, write_text
from k3.model import checkpoint as model_checkpoint
from k3.model.checkpoint import (LATEST, LEGACY_STATE, MODEL_FILES, atomic_directory, checkpoints, read_verified,
                                 read_verified_json, verified, write_model)
from k3.train import state_codec

STATE_TENSORS, STATE_JSON = "state.safetensors", "state.json"
STATE_FORMAT, STATE_VERSION = "k3-train-state", 1


def write_state(directory: Path, state: dict[str, Any]) -> None:
    """``state.safetensors`` (every tensor of ``state``) and ``state.json`` (the rest; see `state_codec`)."""
    data, tensors = state_codec.encode(state)
    with atomic_write(directory / STATE_TENSORS) as path:
        save_file(tensors, str(path))
    write_text(directory / STATE_JSON, json.dumps({"format": STATE_FORMAT, "version": STATE_VERSION, "state": data}))


def save_checkpoint(out: Path, step: int, model: torch.nn.Module, config: K3Config, train: dict[str, Any],
                    tokenizer_dir: Path, state: dict[str, Any], keep: int = 2) -> Path:
    """Write checkpoint ``step`` under ``out`` atomically, then `publish` it."""
    final = out / f"step-{step:07d}"
    with atomic_directory(final) as tmp:
        write_model(tmp, model, config)
        write_run_files(tmp, train, tokenizer_dir, state)
    publish(out, final, keep)
    return final


def publish(out: Path, final: Path, keep: int = 2) -> None:
    """Point ``out/latest`` at the complete checkpoint ``final`` (atomically), then `prune` to ``keep``."""
    write_text(out / LATEST, final.name)
    prune(out, keep, final.name)


def write_run_files(directory: Path, train: dict[str, Any], tokenizer_dir: Path, state: dict[str, Any]) -> None:
    """What a training checkpoint holds beside the model's files: ``train.json``, ``tokenizer.json`` (copied from
    ``tokenizer_dir``) and the training state."""
    write_text(directory / "train.json", json.dumps(train, indent=2))
    with atomic_write(directory / "tokenizer.json") as path:
        shutil.copyfile(tokenizer_dir / "tokenizer.json", path)
    write_state(directory, state)


def load_single(ckpt: Path, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
                state: dict[str, Any]) -> None:
    """Weights and optimiser states of a single-process checkpoint (``state``: its `load_state`) into ``model`` and
    ``optimizers``; a mismatch is a ValueError naming the file."""
    model_checkpoint.load_weights(ckpt, model)
    try:
        for opt, saved in zip(optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(saved)
    except (KeyError, ValueError, TypeError, RuntimeError) as err:
        raise ValueError(f"{state_file(ckpt)}: does not match this run ({type(err).__name__}: {err})") from err


def prune(out: Path, keep: int, latest: str) -> None:
    """Remove all but the newest ``keep`` checkpoints, never ``latest``, and partial ``step-*.tmp`` left by
    killed saves."""
    for old in checkpoints(out)[:-keep]:
        if old.name != latest:
            shutil.rmtree(old, ignore_errors=True)
    for partial in out.glob("step-*.tmp"):
        shutil.rmtree(partial, ignore_errors=True)


def state_file(ckpt: Path) -> Path:
    """The file holding the training state: ``state.json``, or ``state.pt`` in an older checkpoint."""
    legacy = not (ckpt / STATE_JSON).exists() and (ckpt / LEGACY_STATE).exists()
    return ckpt / (LEGACY_STATE if legacy else STATE_JSON)


def verify_checkpoint(ckpt: Path) -> None:
    """Every file a training checkpoint needs is present and matches ``checksums.json``; else a ValueError."""
    state = [LEGACY_STATE] if state_file(ckpt).name == LEGACY_STATE else [STATE_TENSORS, STATE_JSON]
    for name in (*MODEL_FILES, "train.json", *state):
        verified(ckpt, name)


def latest_checkpoint(out: Path) -> Path | None:
    """The newest complete training checkpoint under ``out`` (`k3.model.checkpoint.latest_checkpoint`)."""
    return model_checkpoint.latest_checkpoint(out, verify_checkpoint)


def read_train(ckpt: Path) -> dict[str, Any]:
    data = read_verified_json(ckpt, "train.json")
    if not isinstance(data, dict):
        raise ValueError(f"{ckpt / 'train.json'}: cannot read the training config (a JSON object expected)")
    return data


def check_resumable(ckpt: Path, config: dict[str, Any], may_change: Sequence[str],
                    added: dict[str, Any] | None = None) -> None:
    """A resumed run's settings ``config`` (as JSON stores them: tuples become lists) must be the checkpoint's
    ``train.json``, except ``may_change`` (ValueError naming the field). ``added``: fields newer than some
    checkpoints, with the value a checkpoint without them trained with."""
    saved, requested = {**(added or {}), **read_train(ckpt)}, json.loads(json.dumps(config))
    for key, value in requested.items():
        if key not in may_change and saved.get(key) != value:
            raise ValueError(f"{ckpt / 'train.json'}: field {key!r} is {saved.get(key)!r} in the checkpoint but "
                             f"{value!r} was requested")


def load_state(ckpt: Path) -> dict[str, Any]:
    """The training state, from ``state.json`` + ``state.safetensors`` or an older checkpoint's ``state.pt``."""
    path = state_file(ckpt)
    return _load_legacy_state(ckpt) if path.name == LEGACY_STATE else _load_state(ckpt)


def _load_state(ckpt: Path) -> dict[str, Any]:
    path, raw, tensor_path = ckpt / STATE_JSON, read_verified(ckpt, STATE_JSON), verified(ckpt, STATE_TENSORS)
    try:
        tensors = load_file(str(tensor_path))
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{tensor_path}: cannot read the training state's tensors ({err})") from err
    try:
        data = json.loads(raw)
        if data.get("format") != STATE_FORMAT or data.get("version") != STATE_VERSION:
            raise ValueError(f"expected format {STATE_FORMAT!r} version {STATE_VERSION}")
        return state_codec.decode(data["state"], tensors)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{path}: cannot read the training state ({type(err).__name__}: {err})") from err


def _load_legacy_state(ckpt: Path) -> dict[str, Any]:
    """``state.pt`` through ``torch.load(weights_only=True)``: tensors and plain containers only."""
    path = verified(ckpt, LEGACY_STATE)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch.load raises many types on a truncated, foreign or malicious file
        refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        if refused:
            raise ValueError(f"{path}: refused: not plain data (unpickling it would call {refused.group(1)}); "
                             f"training state is read only as tensors and plain values") from err
        raise ValueError(f"{path}: cannot read the training state ({type(err).__name__}: {err})") from err


def check_same_config(ckpt: Path, saved: K3Config, requested: K3Config) -> None:
    """Resuming with a different model config is an error naming the first differing field."""
    a, b = asdict(saved), asdict(requested)
    for key in a:
        if a[key] != b.get(key):
            raise ValueError(f"{ckpt / 'config.json'}: field {key!r} is {a[key]!r} in the checkpoint but "
                             f"{b.get(key)!r} was requested")
