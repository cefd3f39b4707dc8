"""Checkpoints: written atomically, verified when read, data only (nothing in them runs code).

A checkpoint is a directory ``DIR/step-NNNNNNN`` holding

* ``model.safetensors`` — weights and persistent buffers (the balancing biases included);
* ``config.json`` — the complete model config; ``train.json`` — the training config;
* ``tokenizer.json`` — the tokenizer the model was trained with;
* ``state.safetensors`` + ``state.json`` — optimisers, schedulers, data-loader position, RNG states and
  step: every tensor in the first, the rest in the second, which refers to them by name
  (`k3.train.state_codec`). Older checkpoints hold ``state.pt`` instead, read with
  ``torch.load(weights_only=True)``: a pickle that would call anything is refused;
* ``checksums.json`` — ``{"algorithm": "sha256", "files": {name: hex digest}}`` of every other file.

It is written into ``step-NNNNNNN.tmp`` (each file fsynced, the manifest last) and renamed when complete;
``DIR/latest`` (itself replaced atomically) names the newest complete checkpoint, and older ones beyond
``keep`` are pruned — never the one ``latest`` names. A failed write (a full disk) removes the
temporary directory and raises an OSError naming the file; a killed one leaves ``latest`` on the
previous checkpoint. Every read checks its file against ``checksums.json`` (when there is one) and
weights must be finite; a mismatch is a ValueError naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
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
from k3.train import state_codec
from k3.train.tokenizer import Tokenizer

LATEST = "latest"
MANIFEST = "checksums.json"
WEIGHTS = "model.safetensors"
STATE_TENSORS, STATE_JSON, LEGACY_STATE = "state.safetensors", "state.json", "state.pt"
STATE_FORMAT, STATE_VERSION = "k3-train-state", 1


# ---------------------------------------------------------------------- writing
@contextmanager
def _writing(path: Path) -> Iterator[Path]:
    """Report a failed write (a full disk, a read-only directory) as an OSError naming ``path``."""
    try:
        yield path
    except (OSError, SafetensorError) as err:
        raise OSError(f"cannot write {path}: {err}") from err


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with _writing(tmp):
            tmp.write_text(text)
            os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def _sha256(path: Path, sync: bool = False) -> str:
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        if sync:
            os.fsync(f.fileno())
    return digest


def _write_manifest(directory: Path) -> None:
    """``checksums.json``: the sha256 of every file in ``directory``, each fsynced first."""
    files = {p.name: _sha256(p, sync=True) for p in sorted(directory.iterdir()) if p.is_file()}
    with _writing(directory / MANIFEST) as path:
        path.write_text(json.dumps({"algorithm": "sha256", "files": files}, indent=2))


@contextmanager
def _atomic_directory(final: Path) -> Iterator[Path]:
    """A fresh ``final.tmp`` to fill; when the block completes its manifest is added and it is renamed to
    ``final``. On any error ``final.tmp`` is removed and ``final`` left as it was."""
    tmp = final.with_name(final.name + ".tmp")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        with _writing(tmp):
            tmp.mkdir(parents=True)
        yield tmp
        _write_manifest(tmp)
        shutil.rmtree(final, ignore_errors=True)
        with _writing(final):
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _non_finite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The name of the first floating-point tensor holding a NaN or an infinity, if any."""
    return next((name for name, t in tensors.items() if t.is_floating_point() and not bool(t.isfinite().all())),
                None)


def _write_model(directory: Path, model: torch.nn.Module, config: K3Config) -> None:
    """``model.safetensors`` (weights and persistent buffers, which must be finite) and ``config.json``."""
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    bad = _non_finite(tensors)
    if bad is not None:
        raise ValueError(f"{directory.with_suffix('')}: not saved: weight {bad!r} has non-finite values "
                         f"(NaN or infinity)")
    with _writing(directory / WEIGHTS) as path:
        save_file(tensors, str(path))
    with _writing(directory / "config.json") as path:
        path.write_text(config.to_json())


def _write_state(directory: Path, state: dict[str, Any]) -> None:
    """``state.safetensors`` (every tensor of ``state``) and ``state.json`` (the rest; see `state_codec`)."""
    data, tensors = state_codec.encode(state)
    with _writing(directory / STATE_TENSORS) as path:
        save_file(tensors, str(path))
    with _writing(directory / STATE_JSON) as path:
        path.write_text(json.dumps({"format": STATE_FORMAT, "version": STATE_VERSION, "state": data}))


def save_checkpoint(out: Path, step: int, model: torch.nn.Module, config: K3Config, train: dict[str, Any],
                    tokenizer_dir: Path, state: dict[str, Any], keep: int = 2) -> Path:
    """Write checkpoint ``step`` under ``out`` atomically, point ``latest`` at it, then `_prune` to ``keep``."""
    final = out / f"step-{step:07d}"
    with _atomic_directory(final) as tmp:
        _write_model(tmp, model, config)
        with _writing(tmp / "train.json") as path:
            path.write_text(json.dumps(train, indent=2))
        with _writing(tmp / "tokenizer.json") as path:
            shutil.copyfile(tokenizer_dir / "tokenizer.json", path)
        _write_state(tmp, state)
    _write_text(out / LATEST, final.name)
    _prune(out, keep, final.name)
    return final


def _prune(out: Path, keep: int, latest: str) -> None:
    """Remove all but the newest ``keep`` checkpoints, never ``latest``, and partial ``step-*.tmp`` left by
    killed saves."""
    for old in checkpoints(out)[:-keep]:
        if old.name != latest:
            shutil.rmtree(old, ignore_errors=True)
    for partial in out.glob("step-*.tmp"):
        shutil.rmtree(partial, ignore_errors=True)


def save_model(directory: Path, model: torch.nn.Module, tokenizer: Tokenizer) -> Path:
    """Write an inference checkpoint (weights, config, tokenizer, manifest; no training state) atomically."""
    directory = Path(directory)
    with _atomic_directory(directory) as tmp:
        _write_model(tmp, model, model.config)
        with _writing(tmp / "tokenizer.json"):
            tokenizer.save(tmp)
    return directory


# ---------------------------------------------------------------------- finding
def checkpoints(out: Path) -> list[Path]:
    """The complete checkpoint directories ``step-NNNNNNN`` under ``out``, oldest first."""
    return sorted(p for p in out.glob("step-???????") if p.is_dir())


def latest_checkpoint(out: Path) -> Path | None:
    """The checkpoint ``out/latest`` names. If that pointer is missing or names nothing, the newest
    ``step-*`` that verifies (said on stderr), or a ValueError listing why none does; None when ``out``
    holds no checkpoint."""
    pointer = out / LATEST
    try:
        named = pointer.read_text().strip() if pointer.exists() else ""
    except OSError as err:
        raise ValueError(f"{pointer}: cannot read ({err})") from err
    if named and (out / named).is_dir():
        return out / named
    found = checkpoints(out)
    why = f"names {named}, which does not exist" if named else "is missing"
    if not found:
        if named:
            raise ValueError(f"{pointer}: {why}, and {out} holds no other checkpoint")
        return None
    problems = []
    for path in reversed(found):
        try:
            verify_checkpoint(path)
        except ValueError as err:
            problems.append(str(err))
            continue
        print(f"k3: {pointer} {why}; using {path.name}, the newest checkpoint that verifies", file=sys.stderr)
        return path
    raise ValueError(f"{pointer} {why} and no checkpoint in {out} verifies: " + "; ".join(problems))


def resolve(path: Path) -> Path:
    """A checkpoint directory from a run directory (its newest checkpoint) or a checkpoint directory."""
    if (path / WEIGHTS).exists():
        return path
    found = latest_checkpoint(path) if path.is_dir() else None
    if found is None:
        raise ValueError(f"{path}: no checkpoint here (expected a run directory with '{LATEST}' or step-* "
                         f"checkpoints, or a checkpoint directory with {WEIGHTS})")
    return found


# ---------------------------------------------------------------------- verifying
def _manifest(ckpt: Path) -> dict[str, str] | None:
    """The ``{file: sha256}`` of ``ckpt/checksums.json``, or None for a checkpoint written without one."""
    path = ckpt / MANIFEST
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        files = data["files"]
        if data["algorithm"] != "sha256" or not all(isinstance(v, str) for v in files.values()):
            raise ValueError("expected {'algorithm': 'sha256', 'files': {name: hex digest}}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{path}: cannot read the checksums ({type(err).__name__}: {err})") from err
    return files


def verified(ckpt: Path, name: str) -> Path:
    """``ckpt/name`` after checking that it exists and matches the checkpoint's ``checksums.json``."""
    path = ckpt / name
    if not path.is_file():
        raise ValueError(f"{path}: missing")
    files = _manifest(ckpt)
    if files is None:
        return path
    if name not in files:
        raise ValueError(f"{path}: not listed in {MANIFEST}")
    try:
        digest = _sha256(path)
    except OSError as err:
        raise ValueError(f"{path}: cannot read ({err})") from err
    if digest != files[name]:
        raise ValueError(f"{path}: checksum mismatch: the file is corrupt (sha256 {digest[:16]}…, "
                         f"{MANIFEST} records {files[name][:16]}…)")
    return path


def state_file(ckpt: Path) -> Path:
    """The file holding the training state: ``state.json``, or ``state.pt`` in an older checkpoint."""
    legacy = not (ckpt / STATE_JSON).exists() and (ckpt / LEGACY_STATE).exists()
    return ckpt / (LEGACY_STATE if legacy else STATE_JSON)


def verify_checkpoint(ckpt: Path) -> None:
    """Every file a training checkpoint needs is present and matches ``checksums.json``; else a ValueError."""
    state = [LEGACY_STATE] if state_file(ckpt).name == LEGACY_STATE else [STATE_TENSORS, STATE_JSON]
    for name in (WEIGHTS, "config.json", "train.json", "tokenizer.json", *state):
        verified(ckpt, name)


# ---------------------------------------------------------------------- reading
def load_model(path: Path) -> tuple[K3ForCausalLM, Tokenizer]:
    """The model (in eval mode) and tokenizer of a checkpoint or run directory (its newest checkpoint)."""
    ckpt = resolve(Path(path))
    model = K3ForCausalLM(read_config(ckpt))
    load_weights(ckpt, model)
    return model.eval(), read_tokenizer(ckpt)


def read_config(ckpt: Path) -> K3Config:
    """The model config; every field must be present (no paper-size defaults)."""
    path = verified(ckpt, "config.json")
    try:
        return K3Config.from_json(path.read_text(), complete=True).validate()
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"{path}: {err}") from err


def read_train(ckpt: Path) -> dict[str, Any]:
    path = verified(ckpt, "train.json")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: cannot read the training config ({err})") from err


def read_tokenizer(ckpt: Path) -> Tokenizer:
    return Tokenizer.load(verified(ckpt, "tokenizer.json"))


def load_weights(ckpt: Path, model: torch.nn.Module) -> None:
    """Load ``model.safetensors`` strictly; a corrupt, missing, mismatched or non-finite tensor names the
    file and the tensor."""
    path = verified(ckpt, WEIGHTS)
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
    bad = _non_finite(tensors)
    if bad is not None:
        raise ValueError(f"{path}: tensor {bad!r} has non-finite values (NaN or infinity)")
    model.load_state_dict(tensors, strict=True)


def load_state(ckpt: Path) -> dict[str, Any]:
    """The training state, from ``state.json`` + ``state.safetensors`` or an older checkpoint's ``state.pt``."""
    path = state_file(ckpt)
    return _load_legacy_state(ckpt) if path.name == LEGACY_STATE else _load_state(ckpt)


def _load_state(ckpt: Path) -> dict[str, Any]:
    path, tensor_path = verified(ckpt, STATE_JSON), verified(ckpt, STATE_TENSORS)
    try:
        tensors = load_file(str(tensor_path))
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{tensor_path}: cannot read the training state's tensors ({err})") from err
    try:
        data = json.loads(path.read_text())
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
