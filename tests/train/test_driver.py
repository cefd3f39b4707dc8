"""k3.train.driver and k3.train.rundir on a stage that trains nothing: the cadence of evaluations, logs and
checkpoints (at the end and when time runs out), resuming where the stage stands with its metrics cut back, the
step-0 record of a fresh run, torch's threads set and restored, the progress display, the plot."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from k3.train.driver import Loop, Stage, check_counts, drive
from k3.train.rundir import Metrics, open_run, read_metrics


class Counting(Stage):
    """A stage whose step only counts; it notes what the loop asked of it."""

    def __init__(self, out: Path, loop: Loop, start: int = 0, opening: bool = False) -> None:
        self.out, self._loop, self.step_index, self._opening = out, loop, start, opening
        out.mkdir(exist_ok=True)
        self.metrics = Metrics(out / "metrics.jsonl")
        self.metrics.start(start or None)
        self.evaluated: list[int] = []
        self.saved: list[int] = []
        self.threads: list[int] = []

    @property
    def loop(self) -> Loop:
        return self._loop

    def step(self) -> dict[str, Any]:
        self.step_index += 1
        self.threads.append(torch.get_num_threads())
        return {"step": self.step_index, "loss": 1 / self.step_index}

    def evaluation(self) -> dict[str, Any]:
        self.evaluated.append(self.step_index)
        return {"val_loss": 0.5}

    def opening(self) -> dict[str, Any] | None:
        return {"step": 0, "val_loss": 1.0} if self._opening else None

    def save(self) -> Path:
        self.saved.append(self.step_index)
        return self.out


def logged(stage: Counting) -> list[int]:
    return [r["step"] for r in stage.metrics.rows()]


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield threads
    torch.set_num_threads(threads)


def test_cadence_and_the_end_of_the_run(tmp_path):
    stage = Counting(tmp_path, Loop(steps=10, ckpt_every=4, eval_every=3, log_every=2, progress=False))
    drive(stage)
    assert stage.step_index == 10
    assert stage.evaluated == [3, 6, 9, 10]
    assert logged(stage) == [2, 3, 4, 6, 8, 9, 10]  # every log_every steps, every evaluation, the end
    assert stage.saved == [4, 8, 10]
    assert [r["step"] for r in stage.metrics.rows() if "val_loss" in r] == stage.evaluated


def test_without_eval_every_nothing_is_evaluated(tmp_path):
    stage = Counting(tmp_path, Loop(steps=5, ckpt_every=2, log_every=2, progress=False))
    drive(stage)
    assert stage.evaluated == [] and logged(stage) == [2, 4, 5] and stage.saved == [2, 4, 5]


@pytest.mark.parametrize("eval_every", [3, None])
def test_out_of_time_evaluates_saves_and_stops(tmp_path, eval_every):
    """A zero budget runs out after the first step: an evaluation (if the loop has them), a checkpoint, the end."""
    stage = Counting(tmp_path, Loop(steps=10, ckpt_every=4, eval_every=eval_every, log_every=2, max_minutes=0.0,
                                    progress=False))
    drive(stage)
    assert stage.step_index == 1 and stage.saved == [1]
    if eval_every is None:  # logged only at log_every or at the end, as the draft's loop does
        assert stage.evaluated == [] and logged(stage) == []
    else:  # an evaluation is always logged
        assert stage.evaluated == [1] and logged(stage) == [1]


def test_resume_starts_where_the_stage_stands_and_cuts_the_metrics_back(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0}) for s in (0, 1, 2, 3, 4, 5)]
    path.write_text("\n".join(lines) + '\n\n{"step": 6, "lo')  # steps after the checkpoint, a torn last line
    stage = Counting(tmp_path, Loop(steps=6, ckpt_every=2, progress=False), start=3, opening=True)
    assert logged(stage) == [0, 1, 2, 3]
    drive(stage)
    assert logged(stage) == [0, 1, 2, 3, 4, 5, 6] and stage.saved == [4, 6]  # no second step-0 record
    assert read_metrics(path) == stage.metrics.rows()

    path.write_text(lines[0] + "\nnot json\n" + lines[1] + "\n")  # damage that is no crash's: an error
    with pytest.raises(ValueError, match=re.escape(f"{path}: line 2 is not a metrics record")):
        Metrics(path).start(1)


def test_resume_reads_the_metrics_only_from_a_regular_file(tmp_path):
    """A ``metrics.jsonl`` that is a link to ``/dev/zero`` was read until memory ran out: refused by name, and left
    as it was."""
    path = tmp_path / "metrics.jsonl"
    path.symlink_to("/dev/zero")
    with pytest.raises(ValueError, match=re.escape(f"{path}: a character device, not a regular file: refused")):
        Metrics(path).start(1)
    with pytest.raises(ValueError, match=re.escape(f"{path}: a character device")):
        read_metrics(path)
    assert path.is_symlink()


def test_a_fresh_run_logs_its_opening_record_first(tmp_path):
    stage = Counting(tmp_path, Loop(steps=2, ckpt_every=2, eval_every=2, progress=False), opening=True)
    drive(stage)
    assert stage.metrics.rows()[0] == {"step": 0, "val_loss": 1.0} and logged(stage) == [0, 1, 2]


def test_a_finished_run_takes_no_step_and_does_not_plot(tmp_path):
    stage = Counting(tmp_path, Loop(steps=3, ckpt_every=1, progress=False), start=3)
    drive(stage, (("loss", ("loss",)),))
    assert stage.saved == [] and logged(stage) == [] and not (tmp_path / "curves.png").exists()


def test_the_plot_of_a_run_that_advanced(tmp_path):
    stage = Counting(tmp_path, Loop(steps=3, ckpt_every=3, eval_every=2, progress=False))
    drive(stage, (("loss", ("loss", ("val_loss", "validation"))), ("empty", ("absent",))))
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png", "metrics.jsonl"]


def test_a_process_that_does_not_write_leaves_the_files_alone(tmp_path):
    stage = Counting(tmp_path, Loop(steps=2, ckpt_every=2, progress=False))
    stage.metrics.writes = False
    drive(stage, (("loss", ("loss",)),))
    assert stage.step_index == 2 and (tmp_path / "metrics.jsonl").read_text() == ""
    assert not (tmp_path / "curves.png").exists()


def test_threads_are_set_and_restored(tmp_path, restore_threads):
    torch.set_num_threads(2)
    stage = Counting(tmp_path, Loop(steps=2, ckpt_every=2, threads=1, progress=False))
    drive(stage)
    assert stage.threads == [1, 1] and torch.get_num_threads() == 2
    assert "threads" not in stage.metrics.rows()[0]

    class Failing(Counting):
        def step(self) -> dict[str, Any]:
            raise RuntimeError("diverged")

    with pytest.raises(RuntimeError, match="diverged"):
        drive(Failing(tmp_path, Loop(steps=2, ckpt_every=2, threads=1, progress=False)))
    assert torch.get_num_threads() == 2


def test_adapted_threads_are_noted_in_every_record(tmp_path, restore_threads):
    adapted = Counting(tmp_path / "adapted", Loop(steps=2, ckpt_every=2, adapt_threads=True, progress=False))
    drive(adapted)
    assert [r["threads"] for r in adapted.metrics.rows()] == adapted.threads  # CoreShare's count, unchanged at first
    fixed = Counting(tmp_path / "fixed", Loop(steps=2, ckpt_every=2, threads=1, adapt_threads=True, progress=False))
    drive(fixed)
    assert [r["threads"] for r in fixed.metrics.rows()] == [1, 1]


def test_progress_as_json_lines_or_a_bar(tmp_path, capsys):
    drive(Counting(tmp_path / "lines", Loop(steps=3, ckpt_every=3, lines=True)))
    lines = capsys.readouterr().err.splitlines()
    assert [json.loads(line) for line in lines] == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5},
                                                     {"step": 3, "loss": 0.3333}]
    drive(Counting(tmp_path / "bar", Loop(steps=3, ckpt_every=3)))
    bar = capsys.readouterr().err
    assert "3/3" in bar and "loss=0.333" in bar  # the stage's postfix


def test_open_run_refuses_to_overwrite_a_run(tmp_path):
    out = tmp_path / "run"
    assert open_run(out, resume=False) is None and out.is_dir()
    assert open_run(out, resume=True) is None  # nothing to resume: a fresh start
    (out / "step-0000002").mkdir()
    with pytest.raises(ValueError, match=r"already holds a checkpoint \(step-0000002\); pass --resume"):
        open_run(out, resume=False)
    assert open_run(out, resume=True, verify=lambda path: None) == out / "step-0000002"


def test_check_counts_names_the_field():
    class Config:
        steps, threads = 3, None

    check_counts(Config(), "x", ("steps",))
    for minutes in (None, 0.0, 0.5, 30):  # 0: stop after the first step
        config = Config()
        config.max_minutes = minutes
        check_counts(config, "x", ("steps",))
    for name, value, match in (("steps", 0, "x.steps = 0"), ("steps", True, "x.steps = True"),
                               ("threads", 0, "x.threads = 0 is invalid: a positive integer or None"),
                               ("max_minutes", float("nan"), "x.max_minutes = nan is invalid"),
                               ("max_minutes", float("inf"), "x.max_minutes = inf is invalid"),
                               ("max_minutes", -1.0, "x.max_minutes = -1.0 is invalid"),
                               ("max_minutes", "5", "x.max_minutes = '5' is invalid")):
        config = Config()
        setattr(config, name, value)
        with pytest.raises(ValueError, match=re.escape(match)):
            check_counts(config, "x", ("steps",))
