"""Checkpoint hardening (issue 9): data-only training state, checksums and finite weights, resuming without
``latest``, complete configs, and a full disk during a save."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3.cli import main
from k3.config import preset
from k3.model.lm import K3ForCausalLM
from k3.train import checkpoint as ckpt
from k3.model import checkpoint as model_ckpt
from k3.train import state_codec
from k3.train.pretrain import Run, train
from k3.train.rundir import read_metrics
from k3.tokenization.bpe import Tokenizer
from training import config

CLI_TRAIN = ["train", "--preset", "tiny", "--data", "{corpus}", "--tokens-per-step", "512", "--curriculum", "0:32",
             "--eval-every", "1000", "--ckpt-every", "1", "--no-progress"]


def cli_train(corpus: Path, out: Path, steps: int, *extra: str) -> list[str]:
    return [a.format(corpus=corpus) for a in CLI_TRAIN] + ["--out", str(out), "--steps", str(steps), *extra]


@pytest.fixture
def run3(tmp_path, corpus) -> Path:
    """A run directory with one checkpoint, step-0000003."""
    out = tmp_path / "run"
    train(config(out, corpus, steps=3))
    return out


def flip_tensor_bytes(path: Path) -> None:
    """Invert a few bytes in the middle of the tensor data of a safetensors file; its header stays valid."""
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")  # u64 header length, then the header, then the data
    middle = (start + len(data)) // 2
    data[middle:middle + 4] = bytes(b ^ 0xFF for b in data[middle:middle + 4])
    path.write_bytes(bytes(data))


# ---------------------------------------------------------------------- training state as data
def test_state_codec_round_trips_types_exactly():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    tree = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": t}, 7: {}},
            "param_groups": [{"params": [0, 7], "betas": (0.9, 0.95), "lr": 1e-3, "foreach": None,
                              "amsgrad": False, "name": "adamw"}],
            "lr_lambdas": [{}], "last_epoch": 4, "__odd": 1.0, "rng": torch.tensor([1, 2], dtype=torch.uint8)}
    data, tensors = state_codec.encode(tree)
    back = state_codec.decode(json.loads(json.dumps(data)), tensors)
    assert list(back["state"]) == [0, 7] and back["param_groups"][0]["betas"] == (0.9, 0.95)
    assert type(back["last_epoch"]) is int and type(back["__odd"]) is float and back["lr_lambdas"] == [{}]
    assert back["param_groups"][0] == tree["param_groups"][0]
    assert torch.equal(back["state"][0]["exp_avg"], t) and back["rng"].dtype == torch.uint8
    assert sorted(tensors) == ["rng", "state/0/exp_avg", "state/0/step"]
    with pytest.raises(TypeError, match="at /x: cannot store a set"):
        state_codec.encode({"x": {1}})


def test_checkpoint_files(run3):
    c = run3 / "step-0000003"
    names = {"model.safetensors", "config.json", "train.json", "tokenizer.json", "state.safetensors",
             "state.json", "checksums.json"}
    assert {p.name for p in c.iterdir()} == names
    manifest = json.loads((c / "checksums.json").read_text())
    assert manifest["algorithm"] == "sha256" and set(manifest["files"]) == names - {"checksums.json"}
    state = json.loads((c / "state.json").read_text())
    assert (state["format"], state["version"], state["state"]["step"]) == ("k3-train-state", 1, 3)
    assert "optimizers/1/state/0/exp_avg" in load_file(c / "state.safetensors")


class RunsCode:
    """Unpickling this calls ``open(marker, "w")``, creating the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def legacy(c: Path, state: object) -> None:
    """Make ``c`` an older checkpoint: ``state.pt`` (pickle) instead of state.json + state.safetensors."""
    for name in ("state.json", "state.safetensors", "checksums.json"):
        (c / name).unlink()
    torch.save(state, c / "state.pt")


def test_a_malicious_state_pt_runs_nothing(run3, corpus, tmp_path, capsys):
    c = run3 / "step-0000003"
    marker = tmp_path / "marker"
    legacy(c, {"step": RunsCode(marker)})
    with pytest.raises(ValueError, match=r"state\.pt: refused: not plain data \(unpickling it would call"):
        ckpt.load_state(c)
    assert main(cli_train(corpus, run3, 4, "--resume")) == 2
    assert main(["eval", "--ckpt", str(run3), "--batches", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("state.pt: refused") == 2 and "Traceback" not in err
    assert not marker.exists()


def test_an_older_state_pt_still_resumes(run3, corpus):
    """Regression guard: a checkpoint with a plain-data ``state.pt`` (the previous format) resumes."""
    c = run3 / "step-0000003"
    legacy(c, ckpt.load_state(c))
    assert train(config(run3, corpus, steps=4), resume=True).step_index == 4


# ---------------------------------------------------------------------- checksums and finite weights
def test_corrupt_bytes_are_detected_at_load(run3, capsys):
    c = run3 / "step-0000003"
    flip_tensor_bytes(c / "model.safetensors")
    assert set(load_file(c / "model.safetensors")) == set(K3ForCausalLM(preset("tiny")).state_dict())
    with pytest.raises(ValueError, match=r"step-0000003/model\.safetensors: checksum mismatch: the file is corrupt"):
        model_ckpt.load_model(run3)
    assert main(["eval", "--ckpt", str(run3), "--batches", "1"]) == 2
    assert "model.safetensors: checksum mismatch" in capsys.readouterr().err
    flip_tensor_bytes(c / "state.safetensors")
    with pytest.raises(ValueError, match=r"state\.safetensors: checksum mismatch"):
        ckpt.load_state(c)
    (c / "config.json").write_text((c / "config.json").read_text().replace('"vocab_size": 512', '"vocab_size": 513'))
    with pytest.raises(ValueError, match=r"config\.json: checksum mismatch"):
        model_ckpt.read_config(c)
    (c / "tokenizer.json").write_text((c / "tokenizer.json").read_text() + " ")
    with pytest.raises(ValueError, match=r"tokenizer\.json: checksum mismatch"):
        model_ckpt.read_tokenizer(c)


def test_non_finite_weights_are_rejected(run3, tmp_path):
    c = run3 / "step-0000003"
    tensors = load_file(c / "model.safetensors")
    tensors["layers.1.ffn_norm.weight"][3] = float("nan")
    save_file(tensors, c / "model.safetensors")
    model_ckpt.write_manifest(c)  # checksums that match: only the finite check can object
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'layers\.1\.ffn_norm\.weight' has "
                                         r"non-finite values"):
        model_ckpt.load_model(run3)
    model = K3ForCausalLM(preset("tiny"))
    with torch.no_grad():
        model.norm.weight[0] = float("inf")
    with pytest.raises(ValueError, match=r"not saved: weight 'norm\.weight' has non-finite values"):
        model_ckpt.save_model(tmp_path / "diverged", model, Tokenizer.load(c))
    assert not list(tmp_path.glob("diverged*"))


# ---------------------------------------------------------------------- resuming without `latest`
def test_resume_without_latest_uses_the_newest_checkpoint_that_verifies(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    train(config(out, corpus, steps=6))  # checkpoints step-3 and step-6
    metrics = (out / "metrics.jsonl").read_text()
    (out / "metrics.jsonl").write_text(metrics + '{"step": 7, "lo')  # a line cut short by a crash
    (out / "latest").unlink()
    with pytest.raises(ValueError, match=r"already holds a checkpoint \(step-0000003, step-0000006\); pass --resume"):
        Run(config(out, corpus)).prepare(resume=False)
    run = Run(config(out, corpus))
    run.prepare(resume=True)
    assert run.step_index == 6 and (out / "metrics.jsonl").read_text() == metrics
    assert "latest is missing; using step-0000006" in capsys.readouterr().err

    (out / "latest").write_text("step-0000099")
    flip_tensor_bytes(out / "step-0000006" / "model.safetensors")
    run = Run(config(out, corpus))
    run.prepare(resume=True)
    assert run.step_index == 3 and [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]
    assert "latest names step-0000099, which does not exist; using step-0000003" in capsys.readouterr().err

    (out / "step-0000003" / "train.json").write_text("{}")
    with pytest.raises(ValueError, match=r"no checkpoint in .* verifies: .*step-0000006/model\.safetensors: "
                                         r"checksum mismatch.*step-0000003/train\.json: checksum mismatch"):
        Run(config(out, corpus)).prepare(resume=True)


def test_pruning_never_deletes_the_checkpoint_latest_names(tmp_path):
    out = tmp_path / "run"
    for name in ("step-0000010", "step-0000011", "step-0000005.tmp"):  # newer ones, and a killed save
        (out / name).mkdir(parents=True)
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    model = K3ForCausalLM(preset("tiny"))
    saved = ckpt.save_checkpoint(out, 3, model, model.config, {}, tok, {"step": 3}, keep=2)
    assert (out / "latest").read_text() == "step-0000003" and saved.is_dir()
    assert sorted(p.name for p in out.iterdir()) == ["latest", "step-0000003", "step-0000010", "step-0000011"]


# ---------------------------------------------------------------------- complete model configs
def test_a_partial_config_in_a_checkpoint_names_the_missing_fields(run3, capsys):
    c = run3 / "step-0000003"
    data = json.loads((c / "config.json").read_text())
    del data["hidden_size"], data["moe"]["num_experts"]
    (c / "config.json").write_text(json.dumps(data))
    model_ckpt.write_manifest(c)
    with pytest.raises(ValueError, match=r"config\.json: missing fields: hidden_size, moe\.num_experts$"):
        model_ckpt.load_model(run3)
    assert main(["eval", "--ckpt", str(run3)]) == 2
    assert "config.json: missing fields: hidden_size, moe.num_experts" in capsys.readouterr().err
    partial = config(run3, "unused")
    partial.model = data
    with pytest.raises(ValueError, match=r"train\.model: missing fields: hidden_size, moe\.num_experts"):
        Run(partial)


# ---------------------------------------------------------------------- a full disk
@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs mounted in ``tmp_path`` (root only; skipped where mounting is not permitted)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], capture_output=True,
                            text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {result.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_during_a_save_is_a_clean_error(small_disk, corpus):
    """`k3 train` whose second checkpoint overflows the disk: exit 2 with one line naming the file and the OS
    reason, no partial directory left, and the first checkpoint (and ``latest``) intact and loadable."""
    out = small_disk / "run"
    assert main(cli_train(corpus, out, 1)) == 0
    first = out / "step-0000001"
    size = sum(p.stat().st_size for p in first.iterdir())
    fs = os.statvfs(small_disk)
    used = (fs.f_blocks - fs.f_bfree) * fs.f_frsize
    subprocess.run(["mount", "-o", f"remount,size={used + size // 2}", str(small_disk)], check=True)
    result = subprocess.run([sys.executable, "-m", "k3.cli", *cli_train(corpus, out, 3, "--resume")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[-1].startswith("k3 train: error: cannot write ")
    assert "Traceback" not in result.stderr
    assert "/step-0000002.tmp/" in result.stderr and "No space left on device" in result.stderr
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("step-")) == ["step-0000001"]
    assert not list(out.rglob("*.tmp")) and (out / "latest").read_text() == "step-0000001"
    ckpt.verify_checkpoint(first)
    model_ckpt.load_model(out)
    assert ckpt.load_state(first)["step"] == 1


def test_save_model_refuses_a_tokenizer_load_model_cannot_read_back(tmp_path):
    """A checkpoint's tokenizer is ``tokenizer.json`` (kimi-k3's byte-level BPE). Before, a `KimiTokenizer` was saved
    as its own files and the checkpoint then failed to load ("tokenizer.json: missing"); now it is refused first."""
    from k3.tokenization.kimi import KimiTokenizer
    from kimi_fixtures import build_kimi_tokenizer_files

    build_kimi_tokenizer_files(tmp_path / "kimi")
    tokenizer = KimiTokenizer.load(tmp_path / "kimi")
    with pytest.raises(ValueError, match="got KimiTokenizer .nothing was written."):
        model_ckpt.save_model(tmp_path / "ckpt", K3ForCausalLM(preset("tiny")), tokenizer)
    assert not (tmp_path / "ckpt").exists() and not list(tmp_path.glob(".*"))


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_load_model_builds_nothing_it_then_overwrites(tmp_path, gate):
    """A float checkpoint loads like a packed one (`k3.model.packed.skeleton`): the model is made on the meta device
    without initialising it (the random initialisation of d=1024, ~1 s, was thrown away), so loading draws no random
    number and imports no compiler (meta's random kernels import dynamo), and the model holds the file's values."""
    import dataclasses

    import serving

    cfg = preset("tiny")
    cfg = dataclasses.replace(cfg, kda=dataclasses.replace(cfg.kda, gate=gate))
    torch.manual_seed(1)
    model = K3ForCausalLM(cfg).eval()
    model_ckpt.save_model(tmp_path / "ckpt", model, serving.tokenizer())
    code = ("import sys, torch; from pathlib import Path; from k3.model.checkpoint import load_model; "
            "torch.manual_seed(0); model, _ = load_model(Path(sys.argv[1])); drawn = torch.rand(4); "
            "torch.manual_seed(0); assert torch.equal(drawn, torch.rand(4)), 'loading drew random numbers'; "
            "assert 'torch._dynamo' not in sys.modules, 'loading imported dynamo'; "
            "torch.save(model.state_dict(), sys.argv[2])")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ckpt"), str(tmp_path / "loaded.pt")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = torch.load(tmp_path / "loaded.pt")
    assert loaded.keys() == model.state_dict().keys()
    assert all(torch.equal(loaded[name], t) and not loaded[name].is_meta for name, t in model.state_dict().items())


def test_a_verified_load_names_its_weights_by_the_checked_file_until_one_changes(tmp_path):
    """`load_model` vouches for the weights it read from a file whose sha256 it checked (`precompiled.vouch`), so a
    compiled step's key names them without hashing 650 MB again; a write to any weight, or another dtype, and the
    values are hashed as for any model (without ``verify``: hashed from the start)."""
    import serving
    from k3.model.precompiled import weights_digest

    model_ckpt.save_model(tmp_path / "ckpt", serving.model(), serving.tokenizer())
    model, _ = model_ckpt.load_model(tmp_path / "ckpt")
    unverified, _ = model_ckpt.load_model(tmp_path / "ckpt", verify=False)
    hashed = weights_digest(unverified)
    assert hashed == weights_digest(serving.model())  # the same values, hashed
    vouched = weights_digest(model)
    assert vouched != hashed and weights_digest(model) == vouched
    other = tmp_path / "other"
    model_ckpt.save_model(other, K3ForCausalLM(preset("tiny")), serving.tokenizer())
    assert weights_digest(model_ckpt.load_model(other)[0]) not in (vouched, hashed)  # another file, another name
    with torch.no_grad():
        next(model.parameters()).mul_(1.0)  # written (to the same values)
    assert weights_digest(model) == hashed
    assert weights_digest(unverified.to(torch.float64)) != hashed
