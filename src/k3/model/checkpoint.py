"""Model checkpoints: a directory of weights, config and tokenizer — written atomically, verified when read, data
only (nothing in it runs code). Training adds its state to the same directory (`k3.train.checkpoint`); serving
reads only what is here, so it runs without the training package.

A checkpoint directory holds ``model.safetensors`` (weights and persistent buffers), ``config.json`` (the
complete model config; with routed experts stored MXFP4-packed — `k3.model.quantize` — also the release's
compressed-tensors ``quantization_config``, and the experts as ``…experts.packed.E.w{1,2,3}.weight_{packed,scale}``
uint8 tensors, the release's per-expert layout, loaded by the same `k3.model.packed.PackedExperts`),
``tokenizer.json`` and ``checksums.json`` (``{"algorithm": "sha256", "files": {name: hex
digest}}`` of every other file). It is written into ``NAME.tmp`` (each file through `k3.files.atomic_write`, the
manifest last) and renamed when complete; a failed write removes the temporary directory and raises an OSError
naming the file. A run directory holds ``step-NNNNNNN`` checkpoints and ``latest`` (replaced atomically) naming the
newest.
Every read checks its file against ``checksums.json`` (when there is one) and weights must be finite; a
mismatch is a ValueError naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from k3.config import K3Config
from k3.config.hf import mx_from_quantization, quantization_config
from k3.files import atomic_write, write_text
from k3.model.lm import K3ForCausalLM
from k3.model.packed import PackedExperts, use_packed_experts
from k3.ops import mx
from k3.tokenization.bpe import Tokenizer

LATEST = "latest"
MANIFEST = "checksums.json"
WEIGHTS = "model.safetensors"
SHARDED = "dcp"  # the folder of a sharded training checkpoint's tensors (`k3.train.sharded`)
MODEL_FILES = (WEIGHTS, "config.json", "tokenizer.json")
QUANTIZATION = "quantization_config"


# ---------------------------------------------------------------------- writing
def _sha256(path: Path, sync: bool = False) -> str:
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        if sync:
            os.fsync(f.fileno())
    return digest


def write_manifest(directory: Path) -> None:
    """``checksums.json``: the sha256 of every file in ``directory``, each fsynced first."""
    files = {p.name: _sha256(p, sync=True) for p in sorted(directory.iterdir()) if p.is_file()}
    write_text(directory / MANIFEST, json.dumps({"algorithm": "sha256", "files": files}, indent=2))


@contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """A fresh ``final.tmp`` to fill (its files through `k3.files.atomic_write`); when the block completes its
    manifest is added and it is renamed to ``final``. On any error ``final.tmp`` is removed and ``final`` left as
    it was; an OSError of the directory itself names it."""
    tmp = final.with_name(final.name + ".tmp")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        with _naming(tmp):
            tmp.mkdir(parents=True)
        yield tmp
        write_manifest(tmp)
        shutil.rmtree(final, ignore_errors=True)
        with _naming(final):
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def _naming(directory: Path) -> Iterator[None]:
    """An OSError of the block re-raised as one naming ``directory`` (files name themselves: `atomic_write`)."""
    try:
        yield
    except OSError as err:
        raise OSError(f"cannot write {directory}: {err}") from err


def non_finite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The name of the first floating-point tensor holding a NaN or an infinity, if any."""
    return next((name for name, t in tensors.items() if t.is_floating_point() and not bool(t.isfinite().all())),
                None)


def write_model(directory: Path, model: torch.nn.Module, config: K3Config) -> None:
    """``model.safetensors`` (weights and persistent buffers, which must be finite) and ``config.json`` (with a
    ``quantization_config`` when the routed experts are packed)."""
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    bad = non_finite(tensors)
    if bad is not None:
        raise ValueError(f"{directory.with_suffix('')}: not saved: weight {bad!r} has non-finite values "
                         f"(NaN or infinity)")
    with atomic_write(directory / WEIGHTS) as path:
        save_file(tensors, str(path))
    write_config(directory, config, packed=any(isinstance(m, PackedExperts) for m in model.modules()))


def write_config(directory: Path, config: K3Config, packed: bool = False) -> None:
    """``config.json``, with the ``quantization_config`` of MXFP4-packed routed experts when ``packed``."""
    data = config.to_dict()
    if packed:
        data[QUANTIZATION] = quantization_config(config.mx)
    write_text(directory / "config.json", json.dumps(data, indent=2))


def save_model(directory: Path, model: torch.nn.Module, tokenizer: Tokenizer) -> Path:
    """Write an inference checkpoint (weights, config, tokenizer, manifest; no training state) atomically."""
    directory = Path(directory)
    with atomic_directory(directory) as tmp:
        write_model(tmp, model, model.config)
        tokenizer.save(tmp)
    return directory


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


def verify_model(ckpt: Path) -> None:
    """The files a model checkpoint needs are present and match ``checksums.json``; else a ValueError."""
    for name in MODEL_FILES:
        verified(ckpt, name)


# ---------------------------------------------------------------------- finding
def checkpoints(out: Path) -> list[Path]:
    """The complete checkpoint directories ``step-NNNNNNN`` under ``out``, oldest first."""
    return sorted(p for p in out.glob("step-???????") if p.is_dir())


def latest_checkpoint(out: Path, verify: Callable[[Path], None] = verify_model) -> Path | None:
    """The checkpoint ``out/latest`` names. If that pointer is missing or names nothing, the newest
    ``step-*`` that ``verify`` accepts (said on stderr), or a ValueError listing why none does; None when ``out``
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
            verify(path)
        except ValueError as err:
            problems.append(str(err))
            continue
        print(f"k3: {pointer} {why}; using {path.name}, the newest checkpoint that verifies", file=sys.stderr)
        return path
    raise ValueError(f"{pointer} {why} and no checkpoint in {out} verifies: " + "; ".join(problems))


def resolve(path: Path) -> Path:
    """A checkpoint directory from a run directory (its newest checkpoint) or a checkpoint directory."""
    found = path if (path / WEIGHTS).exists() or (path / SHARDED).is_dir() else (
        latest_checkpoint(path) if path.is_dir() else None)
    if found is None:
        raise ValueError(f"{path}: no checkpoint here (expected a run directory with '{LATEST}' or step-* "
                         f"checkpoints, or a checkpoint directory with {WEIGHTS})")
    if not (found / WEIGHTS).exists() and (found / SHARDED).is_dir():  # `k3.train.sharded`: a distributed run's
        raise ValueError(f"{found}: a sharded (torch.distributed.checkpoint) training checkpoint; write it as "
                         f"single-process files first: k3 convert-ckpt --ckpt {found} --out DIR")
    return found


# ---------------------------------------------------------------------- reading
def load_model(path: Path) -> tuple[K3ForCausalLM, Tokenizer]:
    """The model (in eval mode) and tokenizer of a checkpoint or run directory (its newest checkpoint); routed
    experts stored packed stay packed."""
    ckpt = resolve(Path(path))
    config, packed = _read_config(ckpt)
    model = K3ForCausalLM(config)
    if packed:
        use_packed_experts(model)
    load_weights(ckpt, model)
    return model.eval(), read_tokenizer(ckpt)


def read_config(ckpt: Path) -> K3Config:
    """The model config; every field must be present (no paper-size defaults)."""
    return _read_config(ckpt)[0]


def _read_config(ckpt: Path) -> tuple[K3Config, bool]:
    """The model config and whether the routed experts are stored packed (a ``quantization_config``, which must
    agree with the config's ``mx``)."""
    path = verified(ckpt, "config.json")
    try:
        data = json.loads(path.read_text())
        quant = data.pop(QUANTIZATION, None) if isinstance(data, dict) else None
        config = K3Config.from_dict(data, complete=True).validate()
        if quant is not None and mx_from_quantization(quant) != config.mx:
            raise ValueError(f"{QUANTIZATION} describes {mx_from_quantization(quant)} but the config's mx is "
                             f"{config.mx}")
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"{path}: {err}") from err
    return config, quant is not None


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
        if tensors[name].is_floating_point() != t.is_floating_point() or (
                not t.is_floating_point() and tensors[name].dtype != t.dtype):
            raise ValueError(f"{path}: tensor {name!r} is {tensors[name].dtype}, the model expects {t.dtype}")
        if name.endswith(".weight_scale") and bool((tensors[name] == mx.NAN_SCALE).any()):
            raise ValueError(f"{path}: tensor {name!r} holds the E8M0 NaN scale byte (255): the packed weights "
                             f"are corrupt")
    extra = sorted(tensors.keys() - expected.keys())
    if extra:
        raise ValueError(f"{path}: unexpected tensor {extra[0]!r}")
    bad = non_finite(tensors)
    if bad is not None:
        raise ValueError(f"{path}: tensor {bad!r} has non-finite values (NaN or infinity)")
    model.load_state_dict(tensors, strict=True)
