"""The training loop, once (SPEC §7, §8): every stage — pretraining (`k3.train.pretrain`, on N processes
`k3.train.distributed`), the EAGLE-3 draft (`k3.train.draft`), SFT, RL and MOPD (`k3.rl`) — supplies its own step,
evaluation, checkpoint and records (a `Stage`), and `drive` runs it from where it stands (a resumed stage has
restored its ``step_index``):

* a fresh stage may log a step-0 record first (`Stage.opening`: the starting point's evaluation);
* after each step: an evaluation every ``eval_every`` steps, at the end and when time runs out; the record logged
  every ``log_every`` steps, at the end and whenever it holds an evaluation; a checkpoint every ``ckpt_every``
  steps, at the end and when time runs out (``max_minutes`` of wall time), which stops the run;
* torch's thread count is the stage's, or adapted between steps by `CoreShare`, and restored afterwards;
* progress is a tqdm bar with the stage's postfix, or each record as a JSON line;
* ``curves.png`` is plotted from ``metrics.jsonl`` when steps were taken.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from k3.train.rundir import Metrics, Panel, plot_metrics
from k3.train.threads import CoreShare

#: What shows a step's record: a progress bar's update, a JSON line, or nothing.
Show = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class Loop:
    """How a stage's loop runs (from the stage's own config)."""

    steps: int  # the run ends when ``step_index`` reaches it
    ckpt_every: int
    eval_every: int | None = None  # None: no evaluation inside the loop
    log_every: int = 1
    max_minutes: float | None = None  # stop, with a checkpoint, after this much wall time
    threads: int | None = None  # torch intra-op threads while the loop runs; None: as they are, or adapted
    adapt_threads: bool = False  # with threads None `CoreShare` adapts them; every record notes the count
    progress: bool = True
    lines: bool = False  # progress as each record's JSON line on stderr, instead of a bar


class Stage(Protocol):
    """What `drive` needs of a training stage; a stage inherits the defaults by naming `Stage` as its base."""

    out: Path  # the run directory
    metrics: Metrics  # its ``metrics.jsonl``
    step_index: int  # steps taken: where the loop starts (0: a fresh run) and stands

    @property
    def loop(self) -> Loop:
        """Cadence, deadline, threads and progress, from the stage's config."""
        ...

    @property
    def metrics_path(self) -> Path:
        """The metrics file (what the commands report)."""
        return self.metrics.path

    def step(self) -> dict[str, Any]:
        """One step (``step_index`` advances by one); its record, with ``step``."""
        ...

    def save(self) -> Path:
        """A checkpoint of the stage at ``step_index``."""
        ...

    def evaluation(self) -> dict[str, Any]:
        """What an evaluation adds to a step's record (called only when the loop has an ``eval_every``)."""
        return {}

    def opening(self) -> dict[str, Any] | None:
        """A fresh run's first record (step 0, before any step), or None."""
        return None

    def postfix(self, record: dict[str, Any]) -> dict[str, object]:
        """The progress bar's postfix for a step's record."""
        return {"loss": f"{record['loss']:.3f}"}


def drive(stage: Stage, panels: Sequence[Panel] = ()) -> None:
    """Run ``stage`` from its ``step_index`` to its loop's ``steps`` (or until time runs out; module docstring);
    then, when steps were taken, plot ``panels`` (none: no plot) as ``curves.png`` beside the metrics."""
    loop, start = stage.loop, stage.step_index
    with _threads(loop) as share:
        opening = stage.opening() if start == 0 else None
        if opening is not None:
            stage.metrics.log(opening)
        with _progress(stage, loop, start) as show:
            deadline = None if loop.max_minutes is None else time.time() + 60 * loop.max_minutes
            while stage.step_index < loop.steps:
                record = stage.step()
                if loop.adapt_threads:
                    record["threads"] = share.update() if share is not None else loop.threads
                if not _after_step(stage, loop, record, deadline, show):
                    break
    if panels and stage.step_index > start and stage.metrics.writes:
        plot_metrics(stage.metrics.path, stage.out / "curves.png", panels)


def _after_step(stage: Stage, loop: Loop, record: dict[str, Any], deadline: float | None, show: Show) -> bool:
    """Evaluate, log, show and save as the cadence asks after a step; False when time ran out."""
    step = stage.step_index
    last = step == loop.steps
    out_of_time = deadline is not None and time.time() >= deadline
    evaluated = loop.eval_every is not None and (step % loop.eval_every == 0 or last or out_of_time)
    if evaluated:
        record.update(stage.evaluation())
    if step % loop.log_every == 0 or last or evaluated:
        stage.metrics.log(record)
    show(record)
    if step % loop.ckpt_every == 0 or last or out_of_time:
        stage.save()
    return not out_of_time


@contextmanager
def _threads(loop: Loop) -> Iterator[CoreShare | None]:
    """Torch's thread count set to ``loop.threads`` (or adapted: the `CoreShare` yielded), restored afterwards."""
    saved = torch.get_num_threads()
    try:
        if loop.threads is not None:
            torch.set_num_threads(loop.threads)
        yield CoreShare() if loop.adapt_threads and loop.threads is None else None
    finally:
        torch.set_num_threads(saved)


@contextmanager
def _progress(stage: Stage, loop: Loop, start: int) -> Iterator[Show]:
    """What shows a step's record: a tqdm bar (the stage's postfix), a JSON line on stderr, or nothing."""
    if not loop.progress:
        yield lambda record: None
    elif loop.lines:
        yield lambda record: print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                               for k, v in record.items()}), file=sys.stderr)
    else:
        from tqdm import tqdm

        bar = tqdm(total=loop.steps, initial=start, unit="step", dynamic_ncols=True, file=sys.stderr)

        def show(record: dict[str, Any]) -> None:
            bar.update(1)
            bar.set_postfix(**stage.postfix(record))

        try:
            yield show
        finally:
            bar.close()


def check_counts(config: Any, prefix: str, names: Sequence[str]) -> None:
    """Each of ``names`` a positive integer, ``config.threads`` None or one, and ``config.max_minutes`` (where the
    stage has it) None or a finite number >= 0 (ValueError naming the field)."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{prefix}.{name} = {value!r} is invalid: must be a positive integer")
    threads = config.threads
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"{prefix}.threads = {threads!r} is invalid: a positive integer or None")
    minutes = getattr(config, "max_minutes", None)
    if minutes is not None and (isinstance(minutes, bool) or not isinstance(minutes, int | float)
                                or not 0 <= minutes < math.inf):
        raise ValueError(f"{prefix}.max_minutes = {minutes!r} is invalid: a finite number of minutes >= 0 (0: stop "
                         f"after the first step) or None")
