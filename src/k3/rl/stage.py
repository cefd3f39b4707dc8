"""What every post-training stage's run directory shares (``k3 sft / rl / distill``): refusing to overwrite a run,
finding the checkpoint to resume, ``metrics.jsonl`` (cut back to the resumed step) and ``curves.png``."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from k3.files import atomic_write, write_text
from k3.model import checkpoint as model_ckpt
from k3.train import checkpoint as train_ckpt


def open_run(out: Path, resume: bool) -> Path | None:
    """Create ``out``; the checkpoint to resume (``resume`` and one exists), else None. Without ``resume`` a
    directory that holds a checkpoint is refused (ValueError), so a finished run is never overwritten."""
    out.mkdir(parents=True, exist_ok=True)
    found = model_ckpt.checkpoints(out)
    if not resume and (found or (out / model_ckpt.LATEST).exists()):
        names = ", ".join(p.name for p in found) or model_ckpt.LATEST
        raise ValueError(f"{out} already holds a checkpoint ({names}); pass --resume to continue it or choose "
                         f"another --out")
    return train_ckpt.latest_checkpoint(out) if resume else None


def check_resumable(path: Path, saved: dict[str, Any], config: dict[str, Any], may_change: Sequence[str]) -> None:
    """A resumed run's settings must be the checkpoint's, except ``may_change`` (ValueError naming the field)."""
    for key, value in config.items():
        if key not in may_change and saved.get(key) != value:
            raise ValueError(f"{path / 'train.json'}: field {key!r} is {saved.get(key)!r} in the checkpoint but "
                             f"{value!r} was requested")


def check_counts(config: Any, prefix: str, names: Sequence[str]) -> None:
    """Each of ``names`` a positive integer and ``config.threads`` None or one (ValueError naming the field)."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{prefix}.{name} = {value!r} is invalid: must be a positive integer")
    threads = config.threads
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"{prefix}.threads = {threads!r} is invalid: a positive integer or None")


def _logged_step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return sys.maxsize  # a line cut short by a crash: dropped with the steps after the checkpoint


class Metrics:
    """``metrics.jsonl``: one JSON object per line with a ``step``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def start(self, resumed_step: int | None) -> None:
        """An empty file for a fresh run; on resume, only the lines up to the checkpoint's step are kept."""
        if resumed_step is None:
            write_text(self.path, "")
            return
        lines = self.path.read_text().splitlines() if self.path.exists() else []
        kept = [line for line in lines if line.strip() and _logged_step(line) <= resumed_step]
        write_text(self.path, "".join(line + "\n" for line in kept))

    def log(self, record: dict[str, Any]) -> None:
        try:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as err:
            raise OSError(f"cannot write {self.path}: {err}") from err

    def rows(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def plot(metrics: Metrics, png: Path, panels: Sequence[tuple[str, Sequence[str]]]) -> None:
    """One PNG with a panel per ``(title, metric names)``: each name's values over ``step`` where present."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = metrics.rows()
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (title, names) in zip(axes[0], panels):
        for name in names:
            points = [(r["step"], r[name]) for r in rows if r.get(name) is not None]
            if points:
                ax.plot(*zip(*points), "o-" if len(points) < 30 else "-", label=name, markersize=3)
        ax.set(title=title, xlabel="step")
        ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_write(png) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
