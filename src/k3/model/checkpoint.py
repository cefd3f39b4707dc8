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
Every read checks its file against ``checksums.json`` and weights must be finite; a mismatch is a ValueError naming
the file. Every checkpoint directory kimi-k3 writes has had a manifest since the format began (model and training
checkpoints, sharded ``dcp/`` folders, drafts), so a missing one is an error too — the file was deleted or the copy
is incomplete — except in the pre-manifest format, which holds ``state.pt``. ``verify=False`` (``--no-verify``)
loads a checkpoint without reading its manifest, with a warning. Files are read as regular files of bounded size
(`k3.files.read_bytes`): a link to ``/dev/zero`` or a FIFO is refused, not read. ``latest`` may only name a
checkpoint inside its run directory.
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
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from k3.config import K3Config
from k3.config.hf import mx_from_quantization, quantization_config
from k3.files import (CONFIG_LIMIT, DATA_LIMIT, POINTER_LIMIT, atomic_write, open_regular, read_bytes, read_json,
                      read_text, write_text)
from k3.model.lm import K3ForCausalLM
from k3.model.packed import PackedExperts, skeleton
from k3.model.precompiled import vouch
from k3.model.safetensors_io import owned
from k3.ops import mx
from k3.sizing.memory import check_stored
from k3.tokenization.bpe import Tokenizer

LATEST = "latest"
MANIFEST = "checksums.json"
WEIGHTS = "model.safetensors"
SHARDED = "dcp"  # the folder of a sharded training checkpoint's tensors (`k3.train.sharded`)
MODEL_FILES = (WEIGHTS, "config.json", "tokenizer.json")
LEGACY_STATE = "state.pt"  # the training state of checkpoints written before manifests existed
QUANTIZATION = "quantization_config"


# ---------------------------------------------------------------------- writing
def _sha256(path: Path, sync: bool = False) -> str:
    with open_regular(path) as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        if sync:
            os.fsync(f.fileno())
    return digest


def write_manifest(directory: Path) -> None:
    """``checksums.json``: the sha256 of every other file in ``directory``, each fsynced first."""
    files = {p.name: _sha256(p, sync=True) for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST}
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
    tensors = {name: owned(t) for name, t in model.state_dict().items()}
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
    """Write an inference checkpoint (weights, config, tokenizer, manifest; no training state) atomically.
    ``tokenizer`` must be kimi-k3's byte-level BPE, the one `load_model` reads back; any other is refused first."""
    if not isinstance(tokenizer, Tokenizer):
        raise ValueError(f"save_model: a checkpoint holds kimi-k3's byte-level BPE tokenizer (tokenizer.json), which "
                         f"load_model reads back; got {type(tokenizer).__name__} (nothing was written)")
    directory = Path(directory)
    with atomic_directory(directory) as tmp:
        write_model(tmp, model, model.config)
        tokenizer.save(tmp)
    return directory


# ---------------------------------------------------------------------- verifying
def _manifest(ckpt: Path) -> dict[str, str] | None:
    """The ``{file: sha256}`` of ``ckpt/checksums.json``; None for a pre-manifest checkpoint (it holds
    ``state.pt``); a ValueError for any other checkpoint without one."""
    path = ckpt / MANIFEST
    if not path.exists() and not path.is_symlink():
        if (ckpt / LEGACY_STATE).is_file():
            return None
        raise ValueError(f"{path}: missing: every checkpoint kimi-k3 writes has one, so a file of {ckpt} was deleted "
                         f"or the copy is incomplete, and nothing in it can be verified (k3 generate / serve / chat "
                         f"--no-verify load it anyway)")
    try:
        data = read_json(path, CONFIG_LIMIT)
        files = data["files"]
        if data["algorithm"] != "sha256" or not all(isinstance(v, str) for v in files.values()):
            raise ValueError("expected {'algorithm': 'sha256', 'files': {name: hex digest}}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{path}: cannot read the checksums ({type(err).__name__}: {err})") from err
    return files


def _limit(name: str) -> int | None:
    """The most bytes checkpoint file ``name`` may have: JSON files are small (`k3.files.CONFIG_LIMIT`; a tokenizer
    `k3.files.DATA_LIMIT`), tensor files unbounded."""
    if name.endswith("tokenizer.json"):
        return DATA_LIMIT
    return CONFIG_LIMIT if name.endswith(".json") else None


def _recorded(ckpt: Path, name: str, verify: bool) -> str | None:
    """The sha256 ``checksums.json`` records for ``ckpt/name`` (None without ``verify`` or for a pre-manifest
    checkpoint); a ValueError if the file is missing or not listed."""
    path = ckpt / name
    if not path.exists() and not path.is_symlink():
        raise ValueError(f"{path}: missing")
    files = _manifest(ckpt) if verify else None
    if files is None:
        return None
    if name not in files:
        raise ValueError(f"{path}: not listed in {MANIFEST}")
    return files[name]


def _compare(path: Path, digest: str, recorded: str | None) -> None:
    if recorded is not None and digest != recorded:
        raise ValueError(f"{path}: checksum mismatch: the file is corrupt (sha256 {digest[:16]}…, "
                         f"{MANIFEST} records {recorded[:16]}…)")


def verified(ckpt: Path, name: str, verify: bool = True) -> Path:
    """``ckpt/name`` after checking that it is a regular file (JSON: of bounded size) and, with ``verify``, that it
    matches the checkpoint's ``checksums.json``."""
    path, recorded = ckpt / name, _recorded(ckpt, name, verify)
    try:
        with open_regular(path, _limit(name)) as f:
            if recorded is not None:
                _compare(path, hashlib.file_digest(f, "sha256").hexdigest(), recorded)
    except OSError as err:
        raise ValueError(f"{path}: cannot read ({err})") from err
    return path


def read_verified(ckpt: Path, name: str, verify: bool = True) -> bytes:
    """The bytes of ``ckpt/name``, checked as `verified` checks the file and read once: what was checked is what is
    returned."""
    path, recorded = ckpt / name, _recorded(ckpt, name, verify)
    try:
        data = read_bytes(path, _limit(name) or DATA_LIMIT)
    except OSError as err:
        raise ValueError(f"{path}: cannot read ({err})") from err
    _compare(path, hashlib.sha256(data).hexdigest(), recorded)
    return data


def read_verified_json(ckpt: Path, name: str, verify: bool = True) -> Any:
    """The JSON value of `read_verified`; invalid JSON is a ValueError naming the file."""
    data = read_verified(ckpt, name, verify)
    try:
        return json.loads(data)
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{ckpt / name}: not valid JSON ({err})") from err


def verify_model(ckpt: Path) -> None:
    """The files a model checkpoint needs are regular files and match ``checksums.json``; else a ValueError."""
    for name in MODEL_FILES:
        verified(ckpt, name)


# ---------------------------------------------------------------------- finding
def checkpoints(out: Path) -> list[Path]:
    """The complete checkpoint directories ``step-NNNNNNN`` under ``out``, oldest first."""
    return sorted(p for p in out.glob("step-???????") if p.is_dir())


def latest_checkpoint(out: Path, verify: Callable[[Path], None] = verify_model) -> Path | None:
    """The checkpoint ``out/latest`` names (a directory inside ``out``: a name with a path in it, or a link leading
    out of ``out``, is a ValueError). If that pointer is missing or names nothing, the newest ``step-*`` that
    ``verify`` accepts (said on stderr), or a ValueError listing why none does; None when ``out`` holds no
    checkpoint."""
    pointer = out / LATEST
    try:
        named = read_text(pointer, POINTER_LIMIT).strip() if pointer.exists() or pointer.is_symlink() else ""
    except OSError as err:
        raise ValueError(f"{pointer}: cannot read ({err})") from err
    if named and _inside(out, named):
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


def _inside(out: Path, named: str) -> bool:
    """Whether ``out/named`` is a directory inside ``out``; a ValueError if ``named`` is not a plain name or leads
    out of ``out`` (a ``latest`` written by hand or by an attacker), False if it does not exist."""
    target = out / named
    if named in (".", "..") or Path(named).name != named:
        raise ValueError(f"{out / LATEST}: names {named!r}, not a checkpoint directory of {out} (expected a plain "
                         f"name such as step-0000003)")
    if not target.is_dir():
        return False
    resolved, root = target.resolve(), out.resolve()
    if resolved == root or not resolved.is_relative_to(root):
        raise ValueError(f"{out / LATEST}: names {named}, a link to {resolved}, outside the run directory "
                         f"{out}: refused")
    return True


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
def load_model(path: Path, verify: bool = True) -> tuple[K3ForCausalLM, Tokenizer]:
    """The model (in eval mode) and tokenizer of a checkpoint or run directory (its newest checkpoint); routed
    experts stored packed stay packed. ``verify=False`` skips the checksums (a warning on stderr says so); the
    config is validated before the model is built."""
    ckpt = resolve(Path(path))
    if not verify:
        print(f"k3: WARNING: loading {ckpt} WITHOUT verifying its checksums (--no-verify): a corrupt, truncated or "
              f"altered file is not detected", file=sys.stderr)
    config, packed = _read_config(ckpt, verify)
    tokenizer = read_tokenizer(ckpt, verify)
    check_size(ckpt, config)  # before anything is allocated
    model = skeleton(K3ForCausalLM, config, packed)  # on meta: nothing is initialised only to be overwritten
    load_weights(ckpt, model, verify, assign=True)
    recorded = _recorded(ckpt, WEIGHTS, verify)
    if recorded is not None:  # checked as the file was read: compiled steps' keys need not hash the values again
        vouch(model, f"{WEIGHTS} sha256 {recorded}")
    return model.eval(), tokenizer


def read_config(ckpt: Path) -> K3Config:
    """The model config; every field must be present (no paper-size defaults)."""
    return _read_config(ckpt)[0]


def _read_config(ckpt: Path, verify: bool = True) -> tuple[K3Config, bool]:
    """The model config, validated, and whether the routed experts are stored packed (a ``quantization_config``,
    which must agree with the config's ``mx``)."""
    path = ckpt / "config.json"
    data = read_verified_json(ckpt, "config.json", verify)
    try:
        quant = data.pop(QUANTIZATION, None) if isinstance(data, dict) else None
        config = K3Config.from_dict(data, complete=True).validate()
        if quant is not None and mx_from_quantization(quant) != config.mx:
            raise ValueError(f"{QUANTIZATION} describes {mx_from_quantization(quant)} but the config's mx is "
                             f"{config.mx}")
    except (ValueError, TypeError) as err:
        raise ValueError(f"{path}: {err}") from err
    return config, quant is not None


def read_tokenizer(ckpt: Path, verify: bool = True) -> Tokenizer:
    path = ckpt / "tokenizer.json"
    try:
        text = read_verified(ckpt, "tokenizer.json", verify).decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text ({err})") from err
    return Tokenizer.from_json(text, source=str(path))


def check_size(ckpt: Path, config: K3Config) -> None:
    """``model.safetensors`` is a regular file whose size fits ``config``'s parameters
    (`k3.sizing.memory.check_stored`): a crafted config, or a huge file, is refused before anything is allocated or
    hashed."""
    try:
        with open_regular(ckpt / WEIGHTS) as f:
            size = os.fstat(f.fileno()).st_size
    except OSError as err:
        raise ValueError(f"{ckpt / WEIGHTS}: cannot read ({err})") from err
    check_stored(config, size, str(ckpt / "config.json"), str(ckpt / WEIGHTS), whole=True)


def load_weights(ckpt: Path, model: torch.nn.Module, verify: bool = True, assign: bool = False) -> None:
    """Load ``model.safetensors`` strictly; a corrupt, missing, mismatched or non-finite tensor names the
    file and the tensor. ``assign``: the file's tensors (in the model's dtypes) become the model's, as for a
    `k3.model.packed.skeleton` on the meta device."""
    check_size(ckpt, model.config)  # before the file is hashed
    path = verified(ckpt, WEIGHTS, verify)
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
    if assign:
        tensors = {name: tensors[name].to(t.dtype) for name, t in expected.items()}
    model.load_state_dict(tensors, strict=True, assign=assign)
