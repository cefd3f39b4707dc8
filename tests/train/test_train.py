"""k3.train.pretrain and checkpoints: exact resume, atomic saves, clear errors, the CLI (SPEC §7; issue 4)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from deadline import finishes
from k3.cli import main
from k3.train import checkpoint as ckpt
from k3.model import checkpoint as model_ckpt
from k3.train.pretrain import train
from k3.train.rundir import read_metrics
from training import config


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl")]


def test_resumed_run_continues_exactly(tmp_path, corpus):
    """Interrupt a run twice (a zero time budget stops after one step with a checkpoint), then resume it
    across the curriculum change: the loss sequence equals the uninterrupted run's."""
    whole = train(config(tmp_path / "whole", corpus))
    for _ in range(3):
        part = train(config(tmp_path / "split", corpus, max_minutes=0.0), resume=True)
    assert part.step_index == 3
    resumed = train(config(tmp_path / "split", corpus), resume=True)
    assert resumed.step_index == 6
    a, b = losses(tmp_path / "whole"), losses(tmp_path / "split")
    assert len(a) == len(b) == 6
    assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-6
    assert whole.evaluate().loss == pytest.approx(resumed.evaluate().loss, abs=1e-6)
    assert (tmp_path / "whole" / "curves.png").stat().st_size > 0
    rows = read_metrics(tmp_path / "whole" / "metrics.jsonl")
    assert all({"step", "loss", "lr", "seq_len"} <= r.keys() for r in rows)
    assert [r["seq_len"] for r in rows] == [32, 32, 32, 64, 64, 64]
    assert any("val_loss" in r for r in rows) and "load_max_mean" in rows[0]


def test_interrupted_save_leaves_the_previous_checkpoint(tmp_path, corpus, monkeypatch):
    """An exception in the middle of a save (here after the weights are written) removes the partial
    directory and leaves ``latest`` on the previous checkpoint."""
    out = tmp_path / "run"
    train(config(out, corpus, steps=3))
    before = ckpt.latest_checkpoint(out)
    from k3.train.pretrain import Run

    run = Run(config(out, corpus))
    run.prepare(resume=True)
    run.log(run.step())

    def killed(*args, **kwargs):  # interrupted while writing the training state
        assert (out / "step-0000004.tmp" / "model.safetensors").exists()
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt.state_codec, "encode", killed)
    with pytest.raises(KeyboardInterrupt):
        run.save()
    monkeypatch.undo()
    assert ckpt.latest_checkpoint(out) == before
    assert not (out / "step-0000004.tmp").exists() and not (out / "step-0000004").exists()
    resumed = train(config(out, corpus), resume=True)
    assert resumed.step_index == 6


def test_kill_9_during_a_save_leaves_a_loadable_checkpoint(tmp_path, corpus):
    """A real `k3 train` process is SIGKILLed while a checkpoint directory is being written; the latest
    complete checkpoint still loads and the run resumes from it."""
    out = tmp_path / "killed"
    command = [sys.executable, "-m", "k3.cli", "train", "--preset", "tiny", "--steps", "400", "--out", str(out),
               "--data", str(corpus), "--tokens-per-step", "512", "--curriculum", "0:32", "--eval-every", "1000",
               "--ckpt-every", "1", "--no-progress"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            saving = [p for p in out.glob("step-*.tmp") if p.is_dir()]
            if saving and ckpt.latest_checkpoint(out) is not None:
                os.kill(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.0005)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before a save could be interrupted"
    latest = ckpt.latest_checkpoint(out)
    step = int(latest.name.split("-")[1])
    from k3.model.lm import K3ForCausalLM

    model_ckpt.load_weights(latest, K3ForCausalLM(model_ckpt.read_config(latest)))
    assert ckpt.load_state(latest) and ckpt.read_train(latest)["steps"] == 400
    assert main(["train", "--preset", "tiny", "--steps", str(step + 1), "--out", str(out), "--data", str(corpus),
                 "--tokens-per-step", "512", "--curriculum", "0:32", "--eval-every", "1000", "--ckpt-every", "1",
                 "--no-progress", "--resume"]) == 0
    assert ckpt.latest_checkpoint(out).name == f"step-{step + 1:07d}"


def test_checkpoint_errors_name_the_file_and_field(tmp_path, corpus):
    out = tmp_path / "run"
    train(config(out, corpus, steps=3))
    with pytest.raises(ValueError, match="pass --resume"):
        train(config(out, corpus), resume=False)
    with pytest.raises(ValueError, match=r"config.json: field 'hidden_size'"):
        small = config(out, corpus)
        small.model = {**json.loads((ckpt.latest_checkpoint(out) / "config.json").read_text()), "hidden_size": 32}
        small.model["vision"]["out_dim"] = 32
        train(small, resume=True)
    weights = ckpt.latest_checkpoint(out) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="model.safetensors"):
        train(config(out, corpus), resume=True)
    state = ckpt.latest_checkpoint(out) / "state.json"
    state.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="state.json: checksum mismatch"):
        ckpt.load_state(ckpt.latest_checkpoint(out))
    model_ckpt.write_manifest(ckpt.latest_checkpoint(out))  # checksums that match: the content check objects
    with pytest.raises(ValueError, match="state.json: cannot read the training state"):
        ckpt.load_state(ckpt.latest_checkpoint(out))


def test_missing_or_empty_data_fails_before_training(tmp_path):
    with pytest.raises((ValueError, FileNotFoundError), match="nowhere"):
        train(config(tmp_path / "a", tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no documents"):
        train(config(tmp_path / "b", tmp_path / "empty"))
    assert not (tmp_path / "b" / "latest").exists()


def test_bad_training_config_names_the_field(tmp_path, corpus):
    with pytest.raises(ValueError, match="train.steps"):
        train(config(tmp_path, corpus, steps=0))
    with pytest.raises(ValueError, match="train.curriculum"):
        train(config(tmp_path, corpus, tokens_per_step=100))
    with pytest.raises(ValueError, match="train.balance"):
        train(config(tmp_path, corpus, balance="magic"))


def test_cli_train_eval_generate(tmp_path, corpus, capsys):
    out = tmp_path / "cli"
    args = ["train", "--preset", "tiny", "--steps", "2", "--out", str(out), "--data", str(corpus),
            "--tokens-per-step", "512", "--curriculum", "0:32", "--eval-every", "2", "--ckpt-every", "2",
            "--no-progress"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    logged = read_metrics(out / "metrics.jsonl")[-1]  # bits per byte and its anchors beside the loss (issue 38)
    assert "validation loss" in printed and f"{logged['val_bpb']:.3f} bits per byte" in printed
    assert f"zlib -9 {logged['zlib_bpb']:.3f}, xz -9e {logged['xz_bpb']:.3f}" in printed
    assert 0 < logged["xz_bpb"] < 8 and 0 < logged["zlib_bpb"] < 8 and logged["val_bytes"] > 0
    assert main(args) == 2  # a second run without --resume refuses to overwrite
    assert "pass --resume" in capsys.readouterr().err
    assert main(["eval", "--ckpt", str(out), "--batches", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["step"] == 2 and result["val_loss"] > 0
    assert result["val_bpb"] > 0 and {"zlib_bpb", "xz_bpb", "zlib_window_bpb", "xz_window_bpb"} <= result.keys()
    assert main(["eval", "--ckpt", str(out), "--all"]) == 0  # the whole held-out text: more windows than one batch
    assert json.loads(capsys.readouterr().out)["val_bytes"] > result["val_bytes"]
    assert main(["generate", "--ckpt", str(out), "--prompt", "def ", "--max-tokens", "5", "--seed", "0"]) == 0
    first = capsys.readouterr().out
    assert main(["generate", "--ckpt", str(out), "--prompt", "def ", "--max-tokens", "5", "--seed", "0"]) == 0
    assert capsys.readouterr().out == first and first.startswith("def ")


def test_a_run_resumes_and_evaluates_after_its_preset_changed(tmp_path, corpus, capsys, monkeypatch):
    """A run named by its preset keeps the model its checkpoint holds when a later version changes the preset (issue
    38 changed ``vision.norm_eps``; `make demo`'s existing run then failed to resume or evaluate)."""
    import dataclasses

    import k3.train.pretrain as pretrain

    out = tmp_path / "run"
    args = ["train", "--preset", "tiny", "--steps", "2", "--out", str(out), "--data", str(corpus),
            "--tokens-per-step", "512", "--curriculum", "0:32", "--eval-every", "2", "--ckpt-every", "2",
            "--no-progress"]
    assert main(args) == 0
    original = pretrain.preset

    def changed(name):
        config = original(name)
        return dataclasses.replace(config, vision=dataclasses.replace(config.vision, norm_eps=0.25))

    monkeypatch.setattr(pretrain, "preset", changed)
    assert main([*args[:4], "4", *args[5:], "--resume"]) == 0
    assert model_ckpt.read_config(out / "step-0000004").vision.norm_eps == original("tiny").vision.norm_eps
    capsys.readouterr()
    assert main(["eval", "--ckpt", str(out), "--batches", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 4


def test_sampling_rules():
    from k3.generation import sample_next

    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0]])
    assert sample_next(logits, temperature=0).item() == 2
    gen = torch.Generator().manual_seed(0)
    picks = {sample_next(logits, 1.0, top_p=0.5, generator=gen).item() for _ in range(50)}
    assert picks == {2}  # top-p 0.5 keeps only the most likely token here (p ≈ 0.64)
    picks = {sample_next(logits, 1.0, top_k=2, generator=gen).item() for _ in range(100)}
    assert picks == {2, 3}
    with pytest.raises(ValueError, match="sampling"):
        sample_next(logits, temperature=-1)


def test_bf16_autocast_and_gradient_accumulation(tmp_path, corpus):
    run = train(config(tmp_path / "bf16", corpus, steps=2, bf16=True, grad_accum=2, eval_every=2))
    rows = read_metrics(tmp_path / "bf16" / "metrics.jsonl")
    assert run.step_index == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert rows[-1]["tokens"] == 512 and "val_loss" in rows[-1]


def test_a_step_larger_than_the_training_stream_is_refused_before_it_is_held(tmp_path, corpus):
    """``--grad-accum 10**9`` held a billion micro-batches in memory at once (each step gathers its micro-batches
    before the first forward): a step needing more tokens than the stream holds is refused, as a batch is."""
    from k3.train.pretrain import Run

    run = Run(config(tmp_path, corpus, grad_accum=10**6, tokens_per_step=32 * 10**6, curriculum=[[0.0, 32]]))
    with pytest.raises(ValueError, match=r"one step of grad_accum=1000000 micro-batches of 1 × 32 tokens: the stream "
                                         r"has \d+ tokens, the step needs at least 33000000"):
        finishes(lambda: run.prepare(resume=False), seconds=60)


def test_eval_reads_the_checkpoint_it_is_given_and_writes_nothing(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--steps", "4", "--out", str(out), "--data", str(corpus),
                 "--tokens-per-step", "512", "--curriculum", "0:32", "--eval-every", "100", "--ckpt-every", "2",
                 "--no-progress"]) == 0
    capsys.readouterr()
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    results = []
    for target in (out / "step-0000002", out / "step-0000004", out):
        assert main(["eval", "--ckpt", str(target), "--batches", "1"]) == 0
        results.append(json.loads(capsys.readouterr().out))
    assert [r["step"] for r in results] == [2, 4, 4]
    assert results[0]["val_loss"] != results[1]["val_loss"] == results[2]["val_loss"]
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files


class FixedBatches:
    """A stand-in for the training loader: yields the given micro-batches in turn."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], seq_len: int) -> None:
        self.batches, self.seq_len = iter(batches), seq_len

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return next(self.batches)


def uneven_batch(rows: int = 8, length: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random tokens; rows 0–1 fully supervised, every other row only 1–3 positions: split into micro-batches
    of 2 rows, the first holds 64 supervised positions and each of the others at most 6."""
    g = torch.Generator().manual_seed(7)
    inputs, targets = torch.randint(0, 512, (2, rows, length), generator=g)
    mask = torch.zeros(rows, length, dtype=torch.bool)
    mask[:2] = True
    for r in range(2, rows):
        mask[r, torch.randperm(length, generator=g)[: 1 + r % 3]] = True
    return inputs, targets, mask


Step = tuple[float, dict[str, torch.Tensor], list[torch.Tensor], list[torch.Tensor]]


def one_step(tmp_path, corpus, monkeypatch, micro: int) -> Step:
    """One `Run.step` over `uneven_batch` cut into ``micro`` micro-batches: the logged loss, the parameter
    gradients the optimisers receive (before clipping) and the gradient reaching each micro-batch's logits."""
    from k3.train.pretrain import Run

    run = Run(config(tmp_path, corpus, grad_accum=micro, curriculum=[[0.0, 32]]))
    run.prepare(resume=False)
    inputs, targets, mask = uneven_batch()
    run.train_loader = FixedBatches(list(zip(inputs.chunk(micro), targets.chunk(micro), mask.chunk(micro))), 32)
    logits: list[torch.Tensor] = []

    def keep(module, args, out) -> None:
        out[0].retain_grad()
        logits.append(out[0])

    run.model.register_forward_hook(keep)
    grads: dict[str, torch.Tensor] = {}
    clip = torch.nn.utils.clip_grad_norm_

    def record(params, max_norm):
        grads.update({name: p.grad.clone() for name, p in run.model.named_parameters() if p.grad is not None})
        return clip(params, max_norm)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", record)
    loss = run.step()["loss"]
    monkeypatch.undo()
    return loss, grads, [x.detach() for x in logits], [x.grad for x in logits]


def test_gradient_accumulation_does_not_change_the_objective(tmp_path, corpus, monkeypatch):
    """SPEC §7: the loss is the mean over all the step's supervised positions, so one batch of 8 rows and
    4 micro-batches of 2 give the same loss and gradients even when the micro-batches' supervised counts
    differ 64 : ≤6. The seeds' masked-gradient formula: the gradient of a logit is (softmax − one-hot)
    averaged over *all* trained positions of the step, zero at masked ones."""
    loss1, grads1, logits1, dlogits1 = one_step(tmp_path, corpus, monkeypatch, micro=1)
    loss4, grads4, logits4, dlogits4 = one_step(tmp_path, corpus, monkeypatch, micro=4)
    _, targets, mask = uneven_batch()
    logits = torch.cat(logits4)
    torch.testing.assert_close(logits, logits1[0], rtol=1e-5, atol=1e-5)  # the same forward, cut differently
    supervised = int(mask.sum())
    probs = torch.softmax(logits.double(), -1)
    expected_loss = float(-probs.log().gather(-1, targets[..., None]).squeeze(-1)[mask].sum() / supervised)
    assert loss1 == pytest.approx(expected_loss, rel=1e-5) and loss4 == pytest.approx(expected_loss, rel=1e-5)
    onehot = torch.nn.functional.one_hot(targets, probs.shape[-1]).double()
    expected_dlogits = (probs - onehot) * mask[..., None] / supervised
    for got in (dlogits1[0], torch.cat(dlogits4)):
        torch.testing.assert_close(got.double(), expected_dlogits, rtol=1e-4, atol=1e-8)
    assert grads1.keys() == grads4.keys() and len(grads1) > 10
    for name, grad in grads1.items():
        # fp32 sums in another order: an entry that cancels to ~0 keeps an error of the summed terms' size, so the
        # absolute floor follows the tensor's scale (a 1.6e-7 miss on one of 32,768 entries of a 0.46-scale
        # embedding gradient on an AMD EPYC host with atol=1e-7 alone)
        torch.testing.assert_close(grads4[name], grad, rtol=1e-4, atol=1e-7 + 1e-6 * float(grad.abs().max()),
                                   msg=name)


def test_paper_curriculum_is_the_papers_shape():
    """SPEC §7 / report §§3.3–3.4: 8K → 64K pre-training, 256K → 1M cooldown (1M = the paper's context,
    1,048,576 = 2²⁰), i.e. 8×, 4×, 4×; stages start at 0, 50%, 90% and 97% of the steps (loop.py's choice)."""
    from k3.config import K3Config
    from k3.train.pretrain import paper_curriculum

    paper = paper_curriculum()
    assert paper == [[0.0, 8192], [0.5, 65536], [0.9, 262144], [0.97, 1048576]]
    assert paper[-1][1] == 2**20 == K3Config().context_length
    lengths = [length for _, length in paper]
    assert [b / a for a, b in zip(lengths, lengths[1:])] == [8, 4, 4]
    assert paper_curriculum(32) == [[0.0, 32], [0.5, 256], [0.9, 1024], [0.97, 4096]]
    for bad in (0, -8, 1.5, True):
        with pytest.raises(ValueError, match="paper curriculum base"):
            paper_curriculum(bad)


def test_default_curriculum_is_the_paper_shape_scaled_to_the_presets():
    """TrainConfig's and `k3 train`'s default: the paper's four stages from 32 tokens (32 → 256 → 1024 → 4096,
    fitting the tiny preset's 4096 context), written out as the explicit list."""
    from k3.cli.train import _curriculum
    from k3.train.pretrain import TrainConfig

    expected = [[0.0, 32], [0.5, 256], [0.9, 1024], [0.97, 4096]]
    assert TrainConfig().curriculum == expected
    assert TrainConfig(preset="tiny").validate().curriculum == expected
    assert _curriculum("paper:32") == expected and _curriculum("paper")[-1] == [0.97, 1048576]
    assert _curriculum("0:32,0.5:64") == [[0.0, 32], [0.5, 64]]


def test_curriculum_longer_than_the_context_is_refused(tmp_path, corpus, capsys):
    """The unscaled paper curriculum (1M) does not fit the tiny preset (context 4096): refused before any
    data is read, naming the field, the flag and the limit; so are malformed paper:BASE and falling fractions."""
    from k3.train.pretrain import paper_curriculum

    with pytest.raises(ValueError, match=r"train.curriculum \(--curriculum\) reaches length 8192, beyond the "
                                         r"model's context_length 4096.*paper:32"):
        train(config(tmp_path / "a", corpus, tokens_per_step=8192, curriculum=paper_curriculum(64)))
    assert main(["train", "--preset", "tiny", "--out", str(tmp_path / "b"), "--curriculum", "paper",
                 "--tokens-per-step", str(2**20), "--no-progress"]) == 2
    assert "--curriculum) reaches length 1048576, beyond the model's context_length 4096" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
    for bad in ("paper:0", "paper:x"):
        with pytest.raises(SystemExit):
            main(["train", "--curriculum", bad])
        assert "expected paper or paper:BASE" in capsys.readouterr().err
    with pytest.raises(ValueError, match="fractions must increase"):
        train(config(tmp_path / "c", corpus, curriculum=[[0.0, 32], [0.6, 64], [0.5, 32]]))


def test_cli_run_passes_through_the_four_paper_stages(tmp_path, corpus):
    """`k3 train --curriculum paper:8` for 34 steps: stage i runs from step ⌈fraction_i·34⌉ (0, 17, 31, 33),
    so the metrics show 17 steps at 8 tokens, 14 at 64, 2 at 256 and 1 at 1024; train.json keeps the
    explicit stages."""
    out = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--steps", "34", "--out", str(out), "--data", str(corpus),
                 "--tokens-per-step", "1024", "--curriculum", "paper:8", "--eval-every", "100",
                 "--ckpt-every", "100", "--no-progress"]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["seq_len"] for r in rows] == [8] * 17 + [64] * 14 + [256] * 2 + [1024]
    assert all(r["tokens"] == 1024 and math.isfinite(r["loss"]) for r in rows)
    assert ckpt.read_train(ckpt.latest_checkpoint(out))["curriculum"] == [[0.0, 8], [0.5, 64], [0.9, 256],
                                                                           [0.97, 1024]]


def test_validation_windows_do_not_depend_on_the_curriculum(tmp_path, corpus):
    """Validation uses ``eval_seq_len`` windows whatever the curriculum, so runs with different curricula
    compare: the same initial weights give the same validation loss."""
    from k3.train.pretrain import Run

    losses = []
    for i, curriculum in enumerate(([[0.0, 32]], [[0.0, 64], [0.5, 128]])):
        run = Run(config(tmp_path / str(i), corpus, curriculum=curriculum, eval_seq_len=128))
        run.prepare(resume=False)
        losses.append(run.evaluate().loss)
    assert losses[0] == losses[1]
    with pytest.raises(ValueError, match="eval_seq_len"):
        Run(config(tmp_path / "long", corpus, eval_seq_len=10**6))
