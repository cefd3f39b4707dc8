"""Compiled decoding only where it pays (issue 37): `k3 generate --compile` is never slower than eager once a run
on the machine has loaded its graphs.

A compiled decode step is 2–5× faster than an eager one, but loading it costs a fixed time ``L``. For a run of ``n``
more tokens it pays when ``L + n·c < n·e``, ``c`` and ``e`` being a compiled and an eager step. The step is the tuned
decode step as an AOTInductor package (`k3.model.packaged`: frozen weights, loaded by a C++ loader in well under a
second), or for a model the packages refuse (packed MXFP4 experts) the precompiled decode graph (`k3.model.precompiled`:
~2.7 s to import dynamo and inductor and load the graph's kernels, ``benchmarks/startup.py``). `PayingStep` times
the run's own first `EAGER_STEPS` decode steps eagerly (they are tokens of the run, not a probe) for ``e``, and reads
``L`` and ``c`` from the last run that loaded this layout's step (`Record`: ``payoff.json`` beside the packages or
graphs, one entry per thread count). Without a record it loads the step (or compiles it, on a first run) as before;
a run that loaded it leaves a record, and a run that decides for eager says why.
"""

from __future__ import annotations

import json
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from k3.files import open_regular, write_text
from k3.model.lm import K3ForCausalLM
from k3.model.state import DecoderState

__all__ = ["EAGER_STEPS", "PayingStep", "Record"]

EAGER_STEPS = 3  # decode steps timed eagerly before deciding (the fastest of them is ``e``)
_RECORD_LIMIT = 64 * 1024  # bytes: a record larger than this is not ours


@dataclass(frozen=True)
class Record:
    """What loading this layout's graphs cost the last time (``load_s``) and what a compiled step took (``step_s``)."""

    load_s: float
    step_s: float

    @staticmethod
    def path(directory: Path) -> Path:
        return directory / "payoff.json"

    @classmethod
    def read(cls, directory: Path, threads: int) -> Record | None:
        """The record for ``threads`` threads, or None (absent, unreadable, or not two positive finite numbers)."""
        try:
            entry = _entries(cls.path(directory))[str(threads)]
            record = cls(float(entry["load_s"]), float(entry["step_s"]))
        except (KeyError, TypeError, ValueError):
            return None
        finite = all(0 < v < float("inf") for v in (record.load_s, record.step_s))
        return record if finite else None

    def write(self, directory: Path, threads: int) -> None:
        """Keep this record for ``threads`` threads (other thread counts' entries stay)."""
        path = self.path(directory)
        entries = _entries(path)
        entries[str(threads)] = {"load_s": self.load_s, "step_s": self.step_s}
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps(entries))  # whole or not at all, whatever other runs write beside it

    def pays(self, tokens: int, eager_s: float) -> bool:
        """Whether loading the graphs and decoding ``tokens`` on them beats decoding them eagerly."""
        return self.load_s + tokens * self.step_s < tokens * eager_s


def _entries(path: Path) -> dict:
    """The records kept at ``path`` by thread count; empty where it is absent, unreadable or not a JSON object."""
    try:
        with open_regular(path, _RECORD_LIMIT) as f:
            entries = json.load(f)
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


class PayingStep:
    """A `k3.generation.stream` step for one run of at most ``max_tokens``: the prompt and the first `EAGER_STEPS`
    decode steps eagerly, then — if the record says they pay for the rest (or there is no record) — the packaged
    tuned decode step (`k3.model.packaged.PackagedStep`, loaded at its first call, without importing dynamo or
    inductor; ``packaged=False`` or a model with packed experts: the precompiled decode graph of ``families``,
    `CompiledModel.precompile`), else eagerly to the end.

    A step's time is from its start to the next step's start (sampling included, and on an accelerator the wait
    for the step's results, which the sampler's read of the token makes). A packaged run's load time is its first
    compiled step's (the package loaded, or compiled on a first run, and one step)."""

    def __init__(self, model: K3ForCausalLM, max_tokens: int, families: Callable[[object], list[tuple]],
                 packaged: bool = True) -> None:
        from k3.model.packaged import PackagedStep
        from k3.model.precompiled import GraphFiles, layout_digest

        self.model, self.max_tokens, self.families = model, max_tokens, families
        self.packaged = packaged and PackagedStep.takes(model)
        self.directory = PackagedStep.layout_directory(layout_digest(model)) if self.packaged \
            else GraphFiles(model).directory
        self.threads = torch.get_num_threads()
        self.record = Record.read(self.directory, self.threads)
        self.compiled = None  # the `PackagedStep` or `CompiledModel`, once chosen
        self.eager_s: list[float] = []  # the decode steps timed, eager and compiled
        self.compiled_s: list[float] = []
        self.load_s: float | None = None
        self.decided = False
        self.steps = self.compiled_steps = 0  # decode steps so far, and of them those compiled
        self._last: float | None = None  # when the last decode step started

    def __call__(self, input_ids: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        if input_ids.shape[1] > 1:
            return self._eager(input_ids, state)
        now = time.perf_counter()
        if self._last is not None:
            if self.compiled is None:
                self.eager_s.append(now - self._last)
            elif self.load_s is None:  # a package's first step: its load
                self.load_s = now - self._last
            else:
                self.compiled_s.append(now - self._last)
        if len(self.eager_s) >= EAGER_STEPS and not self.decided:
            self._decide()
            now = time.perf_counter()
        self._last = now
        self.steps += 1
        if self.compiled is None:
            return self._eager(input_ids, state)
        self.compiled_steps += 1
        return (self.compiled if self.packaged else self.compiled.step)(input_ids, state)

    def _eager(self, input_ids: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        logits, state = self.model(input_ids, state=state)
        return logits[:, -1], state

    @property
    def left(self) -> int:
        """The decode steps after the eager ones: a run of ``max_tokens`` decodes all but the first (the prompt's
        step gives it; `k3.generation.stream` runs no step after the last)."""
        return self.max_tokens - 1 - EAGER_STEPS

    def _decide(self) -> None:
        self.decided = True
        if self.record is not None and not self.record.pays(self.left, min(self.eager_s)):
            return
        if self.packaged:
            from k3.model.packaged import PackagedStep

            self.compiled = PackagedStep(self.model)
            return
        from k3.model.compiled import CompiledModel

        self.compiled = CompiledModel(self.model)
        self.load_s = self.compiled.precompile(self.families(self.compiled))

    def finish(self) -> str:
        """Record what this run measured (when it loaded its compiled step from disk) and say how it decoded."""
        if self.compiled is None:
            if not self.decided:
                return f"k3: --compile: the run ended within its first {EAGER_STEPS} eager steps (no graph loaded)"
            record = self.record
            return (f"k3: --compile: decoded eagerly: loading the graphs took {record.load_s:.1f} s last time, more "
                    f"than {self.left} tokens save ({record.step_s * 1e3:.1f} against "
                    f"{min(self.eager_s) * 1e3:.1f} ms a token; {Record.path(self.directory)})")
        c = self.compiled
        if c.compilations == c.cache_hits and self.compiled_s and self.load_s is not None:
            try:
                Record(self.load_s, statistics.median(self.compiled_s)).write(self.directory, self.threads)
            except OSError as err:  # a read-only cache: the next run decides without it
                warnings.warn(f"k3: could not keep {Record.path(self.directory)} ({err})", RuntimeWarning,
                              stacklevel=2)
        what, calls = ("packages", self.compiled_steps) if self.packaged else ("graphs", c.graph_calls)
        load = "" if self.load_s is None else f" ({self.load_s:.1f} s)"
        return (f"k3: {calls} steps compiled, {self.steps - calls} eager; {c.compilations} {what}, {c.cache_hits} of "
                f"them loaded from the on-disk cache{load}")
