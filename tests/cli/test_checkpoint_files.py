"""Files the CLI reads (issue 35, item 4): ``k3 generate``, ``k3 eval`` and ``k3 serve`` on a checkpoint whose
config, tokenizer, weights, training files or ``latest`` are a link to ``/dev/zero``, a FIFO or a huge file; whose
``latest`` leads out of the run directory; whose manifest was deleted; or whose config describes an absurd model —
each is a clean error (exit status 2, the file named) at once, nothing hangs and nothing is allocated: no tensor
larger than `LARGEST` is made before the refusal."""

from __future__ import annotations

import io
import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deadline import finishes
from k3.cli import main
from k3.model.checkpoint import write_manifest
from k3.train.pretrain import train
from training import config

STEP = "step-0000001"
LOADERS = ("generate", "serve", "eval")  # eval reads the training files too
TIMES: list[tuple[str, float]] = []  # each refusal's seconds, printed at the end of the module (pytest -s)
LARGEST = 2**24  # bytes: the tiny run's largest tensor is far smaller; a crafted config's model is far larger


class Allocations(TorchDispatchMode):
    """The bytes of the largest tensor any operation makes while it is active (in its own thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus) -> Path:
    """A run directory with one training checkpoint, step-0000001."""
    out = tmp_path_factory.mktemp("checkpoint-files") / "run"
    train(config(out, corpus, steps=1, ckpt_every=1, eval_every=1, curriculum=[[0.0, 32]]))
    for command in LOADERS:  # import what each command imports, so the timed calls below time only the refusal
        main(argv(command, out / "nowhere"))
    return out


@pytest.fixture(scope="module", autouse=True)
def report_times():
    yield
    for command in LOADERS:
        seconds = sorted(s for c, s in TIMES if c == command)
        if seconds:
            print(f"\nk3 {command}: {len(seconds)} refusals, median {seconds[len(seconds) // 2] * 1000:.0f} ms, "
                  f"slowest {seconds[-1] * 1000:.0f} ms")


@pytest.fixture
def run(trained, tmp_path) -> Path:
    """A copy of the trained run to spoil."""
    return Path(shutil.copytree(trained, tmp_path / "run", symlinks=True))


def argv(command: str, ckpt: Path, *extra: str) -> list[str]:
    more = {"generate": ["--max-tokens", "2"], "serve": ["--port", "0", "--threads", "1"], "eval": ["--batches", "1"]}
    return [command, "--ckpt", str(ckpt), *more[command], *extra]


def refused(command: str, ckpt: Path, capsys, *expected: str) -> None:
    """``k3 COMMAND --ckpt CKPT`` exits 2 without hanging (`finishes`) and without making a tensor larger than
    `LARGEST`, its error naming each of ``expected``."""
    allocations = Allocations()

    def call() -> int:
        with allocations:
            return main(argv(command, ckpt))

    started = time.monotonic()
    assert finishes(call) == 2
    seconds = time.monotonic() - started
    err = capsys.readouterr().err
    assert err.startswith(f"k3 {command}: error: ") and "Traceback" not in err, err
    for text in expected:
        assert text in err, (text, err)
    assert allocations.largest <= LARGEST, f"k3 {command} made a {allocations.largest:,}-byte tensor before refusing"
    TIMES.append((command, seconds))


def spoil(path: Path, kind: str) -> None:
    path.unlink()
    if kind == "link to /dev/zero":
        path.symlink_to("/dev/zero")
    elif kind == "FIFO":
        os.mkfifo(path)  # no writer: a plain open() blocks forever
    else:
        with open(path, "wb") as f:
            f.truncate(64 * 2**30)  # sparse: 64 GiB that take no disk


@pytest.mark.parametrize("kind", ["link to /dev/zero", "FIFO", "huge"])
@pytest.mark.parametrize("name", ["latest", "config.json", "tokenizer.json", "model.safetensors", "train.json",
                                  "state.json"])
def test_a_file_that_is_not_a_small_regular_file_is_refused_at_once(run, capsys, name, kind):
    path = run / name if name == "latest" else run / STEP / name
    spoil(path, kind)
    why = "not a regular file: refused" if kind != "huge" else "-byte limit for this file"
    if name == "model.safetensors" and kind == "huge":  # no fixed limit: the config's parameters bound it
        why = "68,719,476,736 bytes, far more than the 326,998 parameters"
    for command in LOADERS if name not in ("train.json", "state.json") else ("eval",):
        refused(command, run, capsys, str(path), why)


@pytest.mark.parametrize("where", ["../elsewhere", "absolute", "a link out"])
def test_latest_names_only_a_checkpoint_inside_its_run_directory(run, tmp_path, capsys, where):
    elsewhere = Path(shutil.copytree(run / STEP, tmp_path / "elsewhere"))  # a valid checkpoint, outside the run
    if where == "a link out":
        (run / "step-0000009").symlink_to(elsewhere)
        (run / "latest").write_text("step-0000009")
        expected = "a link to " + str(elsewhere.resolve()) + ", outside the run directory"
    else:
        named = "../elsewhere" if where == "../elsewhere" else str(elsewhere)
        (run / "latest").write_text(named)
        expected = f"names {named!r}, not a checkpoint directory of {run}"
    for command in LOADERS:
        refused(command, run, capsys, str(run / "latest"), expected)


def test_a_deleted_manifest_is_an_error_unless_no_verify_is_given(run, capsys):
    (run / STEP / "checksums.json").unlink()
    for command in LOADERS:
        refused(command, run, capsys, f"{run / STEP / 'checksums.json'}: missing", "--no-verify")
    assert finishes(lambda: main(argv("generate", run, "--no-verify", "--prompt", "def"))) == 0
    captured = capsys.readouterr()
    assert f"WARNING: loading {run / STEP} WITHOUT verifying its checksums (--no-verify)" in captured.err
    assert captured.out.startswith("def")


@pytest.mark.parametrize("field, value, expected", [
    ("context_length", 2**40, "config.context_length = 1099511627776 is invalid: must be at most 134,217,728"),
    ("hidden_size", 2**30, "config.hidden_size = 1073741824 is invalid: must be at most 131,072"),
    ("vocab_size", 2**22, "cannot hold: the config does not belong to these weights"),  # valid, but 2 GiB
])
def test_a_crafted_config_is_refused_before_anything_is_allocated(run, capsys, field, value, expected):
    path = run / STEP / "config.json"
    data = json.loads(path.read_text())
    data[field] = value
    path.write_text(json.dumps(data))
    (run / STEP / "checksums.json").unlink()
    write_manifest(run / STEP)  # checksums that match: only the config's own checks can object
    for command in ("generate", "serve"):
        refused(command, run, capsys, str(path), expected)
    refused("eval", run, capsys, str(path))  # eval compares the checkpoint's config with the run's


@pytest.mark.parametrize("command", ["eval", "convert-ckpt"])
def test_a_crafted_config_in_a_sharded_checkpoint_is_refused_before_its_model_is_built(run, tmp_path, capsys, command):
    sharded = tmp_path / "sharded" / STEP
    assert main(["convert-ckpt", "--ckpt", str(run), "--out", str(sharded)]) == 0
    capsys.readouterr()
    path = sharded / "config.json"
    data = json.loads(path.read_text())
    data["vocab_size"] = 2**22
    path.write_text(json.dumps(data))
    (sharded / "checksums.json").unlink()
    write_manifest(sharded)
    allocations = Allocations()

    def call() -> int:
        with allocations:
            more = ["--batches", "1"] if command == "eval" else ["--out", str(tmp_path / "back")]
            return main([command, "--ckpt", str(sharded), *more])

    assert finishes(call) == 2
    err = capsys.readouterr().err
    assert f"{path}: describes a model of" in err and "cannot hold" in err, err
    assert allocations.largest <= LARGEST, allocations.largest


class _Runs:
    """A pickled value that, unpickled by ``pickle.load``, creates the directory ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def test_a_sharded_checkpoint_never_runs_code_from_its_pickles(run, tmp_path, capsys):
    """DCP unpickles ``.metadata`` with ``pickle.load`` and its non-tensor values with ``weights_only=False``: a crafted
    sharded checkpoint ran what it named (here: ``os.mkdir``) on ``k3 convert-ckpt`` or ``k3 eval``. Both are read
    by allowlists now (`k3.train.dcp_files`), and what they refuse is an error naming the file."""
    import pickle

    from k3.train.dcp_files import LoadPlanner

    sharded = tmp_path / "sharded" / STEP
    assert main(["convert-ckpt", "--ckpt", str(run), "--out", str(sharded)]) == 0
    capsys.readouterr()
    marker = tmp_path / "ran"
    metadata = sharded / "dcp" / ".metadata"
    metadata.write_bytes(pickle.dumps(_Runs(marker)))
    (sharded / "dcp" / "checksums.json").unlink()
    write_manifest(sharded / "dcp")  # checksums that match: only the reading itself can object
    for command, more in (("convert-ckpt", ["--out", str(tmp_path / "back")]), ("eval", ["--batches", "1"])):
        assert main([command, "--ckpt", str(sharded), *more]) == 2
        err = capsys.readouterr().err
        assert f"{metadata}: not DCP metadata (UnpicklingError: posix.mkdir is not a DCP metadata class" in err, err
        assert not marker.exists()

    payload = io.BytesIO()
    torch.save(_Runs(marker), payload)
    payload.seek(0)
    item = type("Item", (), {"dest_index": type("Index", (), {"fqn": "optim.param_groups.0.lr"})()})()
    with pytest.raises(ValueError, match=r"optim\.param_groups\.0\.lr: not a plain value \(UnpicklingError"):
        LoadPlanner().load_bytes(item, payload)
    assert not marker.exists()

