"""What a `k3.model.compiled.CompiledModel` builds before or while it serves, and how far it has got (issue 37).

A `GraphPlan` lists each family's precompiled graph (`k3.model.precompiled`: loaded in seconds where an earlier
process saved it), then, with ``upgrade``, the tuned decode and verification graphs that replace them (`planned`).
`build_all` builds them in order and switches each family to its graph once built (`ready`); in the background
(`run`, on the `CompiledModel`'s gate thread) the precompiled graphs of a model on the CPU are compiled by a process
of their own (`k3.model.graph_worker`) and only loaded here.
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Callable

import torch

from k3.model.background import Gate
from k3.model.compiled_step import CompiledStep, background_ends
from k3.model.graph_worker import GraphWorker
from k3.model.lm import K3ForCausalLM
from k3.model.packaged import PackagedStep
from k3.model.precompiled import GraphFiles
from k3.model.state import DecoderState

__all__ = ["GraphPlan"]

Step = CompiledStep | PackagedStep
#: Builds a family's graph on a step: ``build(family, contexts, step)`` (`CompiledModel`'s).
Build = Callable[[tuple, dict[int, DecoderState], Step], None]


class GraphPlan:
    """The graphs to build for ``families`` (module docstring); ``traced`` maps each kind to the `CompiledModel`'s
    own (tuned) step, ``build`` compiles a family on a step."""

    def __init__(self, model: K3ForCausalLM, gate: Gate, families: list[tuple], upgrade: bool,
                 traced: dict[str, Step], build: Build) -> None:
        self.model, self.traced, self._build = model, traced, build
        self.files = GraphFiles(model)  # one layout digest for the three steps
        self.precompiled = {kind: CompiledStep(model, replayed=kind == "verify", gate=gate, files=self.files)
                            for kind in ("decode", "prefill", "verify")}
        upgraded = [f for f in families if upgrade and f[0] != "prefill"]
        self.planned = [(f, "precompiled") for f in families] + [(f, "traced") for f in upgraded]
        self.ready: dict[tuple, Step] = {}  # each family's best step built so far
        self.built = 0  # of `planned`, those done
        self.background: threading.Thread | None = None
        self.background_error: Exception | None = None
        self.worker: GraphWorker | None = None  # the process compiling the precompiled graphs (`failure`: why not)

    def step(self, family: tuple, tier: str) -> Step:
        """The step ``family``'s graph of ``tier`` (``precompiled`` or ``traced``) is built on."""
        return (self.precompiled if tier == "precompiled" else self.traced)[family[0]]

    @torch.inference_mode()
    def run(self, threads: int, process: bool) -> None:
        """The background thread: with ``process``, the precompiled graphs already saved are loaded and a graph
        process started for the others (`start_worker`); then `build_all`, stopped with a warning by an error."""
        torch.set_num_threads(threads)  # the caller's count (part of every graph's key), not a new thread's default
        try:
            contexts: dict[int, DecoderState] = {}
            if process:
                self.start_worker(contexts)
            self.build_all(contexts=contexts)
        except Exception as err:  # the steps go on as they are for what is left
            self.background_error = err
            print(f"k3: background compilation stopped, what is left runs as it is: {err!r}", file=sys.stderr,
                  flush=True)
        finally:
            background_ends()
            self.stop()

    def start_worker(self, contexts: dict[int, DecoderState]) -> None:
        """Load (and switch to) the planned precompiled graphs that are saved already; start a `GraphWorker` on the
        others (none where every one was saved; with a warning where it cannot start: this thread compiles them
        then)."""
        missing = []
        for family, tier in self.planned:
            if tier == "precompiled":
                step = self.precompiled[family[0]]
                step.load_only = True
                try:
                    self._build(family, contexts, step)
                    self.ready[family], self.built = step, self.built + 1
                except FileNotFoundError:
                    missing.append(family)
                finally:
                    step.load_only = False
        try:
            self.worker = GraphWorker.start(self.model, self.files.digest, missing) if missing else None
        except Exception as err:  # a model that does not pickle, no process: compile here instead
            warnings.warn(f"k3: no graph process ({err!r}); compiling in this process", RuntimeWarning, stacklevel=2)

    def build_all(self, built: Callable[[tuple], None] | None = None,
                  contexts: dict[int, DecoderState] | None = None) -> None:
        """Build the `planned` graphs in order, switching each family to its graph once built (a precompiled one
        the graph process builds: loaded once it is saved; one already serving its family: skipped); ``built(family)``
        after each."""
        contexts = {} if contexts is None else contexts
        for family, tier in self.planned:
            step = self.step(family, tier)
            if self.ready.get(family) is step:  # loaded by `start_worker`
                continue
            worker = self.worker if tier == "precompiled" else None
            if worker is not None and family in worker.families and worker.failure is None \
                    and not worker.wait_for(family):
                warnings.warn(f"k3: {worker.failure}; compiling the rest in this process", RuntimeWarning,
                              stacklevel=2)
            self._build(family, contexts, step)
            self.ready[family] = step
            self.built += 1
            if built is not None:
                built(family)

    def stop(self) -> None:
        """End the graph process, if one runs."""
        if self.worker is not None:
            self.worker.stop()
