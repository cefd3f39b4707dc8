"""Checkpoints: written atomically, read back with errors that name the file and the field.

A checkpoint is a directory ``DIR/step-NNNNNNN`` holding

* ``model.safetensors`` — weights and persistent buffers (the balancing biases included);
* ``config.json`` — the model config; ``train.json`` — the training config;
* ``tokenizer.json`` — the tokenizer the model was trained with;
* ``state.pt`` — optimisers, schedulers, data-loader position, RNG states, step and metrics position.

It is written into ``step-NNNNNNN.tmp`` first and renamed when complete; ``DIR/latest`` (itself
replaced atomically) names the newest complete checkpoint. A run killed during a save therefore
leaves ``latest`` pointing at the previous, complete checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from k3.config import K3Config
from k3.model.lm import K3ForCausalLM
from k3.train.tokenizer import Tokenizer

LATEST = "latest"


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@contextmanager
def _atomic_directory(final: Path) -> Iterator[Path]:
    """A fresh ``final.tmp`` to fill, renamed to ``final`` only when the block completes (an interrupted
    write leaves the temporary directory aside and ``final`` untouched)."""
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    yield tmp
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)


def _write_model(directory: Path, model: torch.nn.Module, config: K3Config) -> None:
    """``model.safetensors`` (weights and persistent buffers) and ``config.json``."""
    save_file({name: t.detach().contiguous() for name, t in model.state_dict().items()},
              str(directory / "model.safetensors"))
    (directory / "config.json").write_text(config.to_json())


def save_checkpoint(out: Path, step: int, model: torch.nn.Module, config: K3Config, train: dict[str, Any],
                    tokenizer_dir: Path, state: dict[str, Any], keep: int = 2) -> Path:
    """Write checkpoint ``step`` under ``out`` atomically; keep the newest ``keep`` checkpoints."""
    final = out / f"step-{step:07d}"
    with _atomic_directory(final) as tmp:
        _write_model(tmp, model, config)
        (tmp / "train.json").write_text(json.dumps(train, indent=2))
        shutil.copyfile(tokenizer_dir / "tokenizer.json", tmp / "tokenizer.json")
        torch.save(state, tmp / "state.pt")
    _write_text(out / LATEST, final.name)
    for old in sorted(out.glob("step-???????"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save_model(directory: Path, model: torch.nn.Module, tokenizer: Tokenizer) -> Path:
    """Write an inference checkpoint (weights, config, tokenizer; no training state) atomically."""
    directory = Path(directory)
    with _atomic_directory(directory) as tmp:
        _write_model(tmp, model, model.config)
        tokenizer.save(tmp)
    return directory


def load_model(path: Path) -> tuple[K3ForCausalLM, Tokenizer]:
    """The model (in eval mode) and tokenizer of a checkpoint or run directory (its newest checkpoint)."""
    ckpt = resolve(Path(path))
    model = K3ForCausalLM(read_config(ckpt))
    load_weights(ckpt, model)
    return model.eval(), Tokenizer.load(ckpt)


def latest_checkpoint(out: Path) -> Path | None:
    """The newest complete checkpoint under ``out`` (via ``latest``), or None if there is none."""
    pointer = out / LATEST
    if not pointer.exists():
        return None
    path = out / pointer.read_text().strip()
    if not path.is_dir():
        raise ValueError(f"{pointer}: names {path.name}, which does not exist")
    return path


def resolve(path: Path) -> Path:
    """A checkpoint directory from a run directory (its newest checkpoint) or a checkpoint directory."""
    if (path / "model.safetensors").exists():
        return path
    found = latest_checkpoint(path) if path.is_dir() else None
    if found is None:
        raise ValueError(f"{path}: no checkpoint here (expected a run directory with '{LATEST}' "
                         f"or a checkpoint directory with model.safetensors)")
    return found


def read_config(ckpt: Path) -> K3Config:
    path = ckpt / "config.json"
    try:
        return K3Config.from_json(path.read_text()).validate()
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: {err}") from err


def read_train(ckpt: Path) -> dict[str, Any]:
    path = ckpt / "train.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: cannot read the training config ({err})") from err


def load_weights(ckpt: Path, model: torch.nn.Module) -> None:
    """Load ``model.safetensors`` strictly; a missing, corrupt or mismatched tensor names file and field."""
    path = ckpt / "model.safetensors"
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path}: cannot read weights ({err})") from err
    expected = model.state_dict()
    for name, t in expected.items():
        if name not in tensors:
            raise ValueError(f"{path}: missing tensor {name!r}")
        if tensors[name].shape != t.shape:
            raise ValueError(f"{path}: tensor {name!r} has shape {list(tensors[name].shape)}, "
                             f"the model expects {list(t.shape)}")
    extra = sorted(tensors.keys() - expected.keys())
    if extra:
        raise ValueError(f"{path}: unexpected tensor {extra[0]!r}")
    model.load_state_dict(tensors, strict=True)


def load_state(ckpt: Path) -> dict[str, Any]:
    path = ckpt / "state.pt"
    try:
        return torch.load(path, weights_only=False)
    except Exception as err:  # torch.load raises many types on a truncated or foreign file
        raise ValueError(f"{path}: cannot read the training state ({type(err).__name__}: {err})") from err


def check_same_config(ckpt: Path, saved: K3Config, requested: K3Config) -> None:
    """Resuming with a different model config is an error naming the first differing field."""
    a, b = asdict(saved), asdict(requested)
    for key in a:
        if a[key] != b.get(key):
            raise ValueError(f"{ckpt / 'config.json'}: field {key!r} is {a[key]!r} in the checkpoint but "
                             f"{b.get(key)!r} was requested")
