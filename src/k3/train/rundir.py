"""A run's directory (SPEC §7), what every training stage shares — pretraining, the EAGLE-3 draft, SFT, RL and
MOPD: ``step-NNNNNNN`` checkpoints and ``latest`` (`k3.train.checkpoint`), ``metrics.jsonl`` (one JSON object per
logged step, each with its ``step``) and ``curves.png``.

A run directory that holds a checkpoint is never overwritten: it is continued with ``--resume`` (`open_run`), from
the newest checkpoint that verifies. A resumed run's ``metrics.jsonl`` is cut back to the checkpoint's step
(`Metrics.start`): the lines an interrupted attempt logged after it are dropped, and a last line torn by a crash.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from k3.files import DATA_LIMIT, atomic_write, jsonl_records, read_bytes, read_text, write_text
from k3.model import checkpoint as model_ckpt
from k3.train import checkpoint as train_ckpt

#: A curve of a panel: a metric's name, or ``(name, label)``.
Series = str | tuple[str, str]
#: A panel of ``curves.png``: ``(title, series)``.
Panel = tuple[str, Sequence[Series]]


def open_run(out: Path, resume: bool, verify: Callable[[Path], None] = train_ckpt.verify_checkpoint) -> Path | None:
    """Create ``out``; the checkpoint to resume (``resume`` and one exists: `k3.model.checkpoint.latest_checkpoint`
    with ``verify``), else None. Without ``resume`` a directory that holds a checkpoint is refused (ValueError), so
    a finished run is never overwritten."""
    out.mkdir(parents=True, exist_ok=True)
    found = model_ckpt.checkpoints(out)
    if not resume and (found or (out / model_ckpt.LATEST).exists()):
        names = ", ".join(p.name for p in found) or model_ckpt.LATEST
        raise ValueError(f"{out} already holds a checkpoint ({names}); pass --resume to continue it or choose "
                         f"another --out")
    return model_ckpt.latest_checkpoint(out, verify) if resume else None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (blank lines skipped); a line that is not JSON is a ValueError naming it."""
    return [record for _, record in jsonl_records(read_bytes(path, DATA_LIMIT), path)]


class Metrics:
    """``metrics.jsonl``: one JSON object per line with a ``step``. ``writes`` False (a distributed run's ranks
    other than 0): nothing is written."""

    def __init__(self, path: Path, writes: bool = True) -> None:
        self.path = path
        self.writes = writes

    def start(self, resumed_step: int | None) -> None:
        """An empty file for a fresh run; on resume, only the records up to ``resumed_step`` are kept (a last line
        cut short by a crash is dropped; any other unreadable line is an error naming the file and line)."""
        if not self.writes:
            return
        kept = [] if resumed_step is None else self._records_until(resumed_step)
        write_text(self.path, "".join(line + "\n" for line in kept))

    def _records_until(self, step: int) -> list[str]:
        lines = read_text(self.path, DATA_LIMIT).splitlines() if self.path.exists() else []
        kept = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                logged = int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError) as err:
                if number == len(lines):
                    break
                raise ValueError(f"{self.path}: line {number} is not a metrics record ({err})") from err
            if logged <= step:
                kept.append(line)
        return kept

    def log(self, record: dict[str, Any]) -> None:
        """Append ``record`` (a line, so a crash tears at most the last one; see `start`)."""
        if not self.writes:
            return
        try:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as err:
            raise OSError(f"cannot write {self.path}: {err}") from err

    def rows(self) -> list[dict[str, Any]]:
        return read_metrics(self.path)


def plot_metrics(metrics: Path, png: Path, panels: Sequence[Panel]) -> None:
    """One PNG (written atomically) with a panel per ``(title, series)``: each series' values over ``step`` in the
    records of ``metrics`` that hold it (with markers while there are few points)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    try:
        for ax, (title, series) in zip(axes[0], panels):
            for entry in series:
                name, label = (entry, entry) if isinstance(entry, str) else entry
                points = [(r["step"], r[name]) for r in rows if r.get(name) is not None]
                if points:
                    ax.plot(*zip(*points), "o-" if len(points) < 30 else "-", label=label, markersize=3)
            ax.set(title=title, xlabel="step")
            if ax.lines:
                ax.legend(fontsize=8)
        fig.tight_layout()
        with atomic_write(png) as tmp:
            fig.savefig(tmp, format="png", dpi=100)
    finally:
        plt.close(fig)
