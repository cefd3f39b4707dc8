"""Compiled models (issue 18): a model's steps on `k3.model.compiled_step.CompiledStep` graphs over bucketed shapes.

`CompiledModel` keeps the shape keys a server reaches to a set it can build before serving (`warm_up`, ``k3 serve
--compile``): the first tokens of a sequence (a cache of 0 or 1 positions) run eagerly, and a decode batch always
carries its padding. It buckets the keys: decode batches are padded up to the next of `DECODE_BATCHES` with copies
of row 0 (vLLM's capture sizes), and a prefill chunk runs as pieces of the `PREFILL_PIECES` lengths (37 = 16 + 16 +
4 + 1) — exact, since the state carries across pieces, and no padding token ever enters a state.

Start-up (issue 37). Tuned graphs are compiled by every process; *precompiled* steps (`k3.model.precompiled`: the
weights are graph inputs, the whole step is saved to a file) load in seconds instead: ``k3 generate --compile``
decodes on one (`CompiledModel.precompile`), and a server builds its graphs in the background while it serves
eagerly (`CompiledModel.compile_in_background`): the precompiled graph of every family first (compiled by a process
of its own on the CPU, `k3.model.graph_worker`), then the tuned decode and verification graphs that replace them.
With ``packaged`` (``--compile-packages``) those tuned steps are AOTInductor packages (`k3.model.packaged`), which a
later process loads in seconds instead of compiling them again, and whose calls skip dynamo's frame evaluation.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor

from k3.model.background import Gate
from k3.model.compiled_step import CASCADE_SUM, CompiledStep, background_begins, cached
from k3.model.graph_plan import GraphPlan
from k3.model.lm import K3ForCausalLM
from k3.model.packaged import PackagedStep
from k3.model.state import DecoderState

__all__ = ["DECODE_BATCHES", "PREFILL_PIECES", "CompiledModel", "pieces"]

DECODE_BATCHES = (1, 2, 4, 8, 16, 32)
PREFILL_PIECES = (64, 16, 4, 1)


def pieces(length: int, sizes: tuple[int, ...] = PREFILL_PIECES) -> list[int]:
    """``length`` as a sum of ``sizes`` (which hold 1), largest first: the compiled prefill's chunk pieces."""
    out = []
    for size in sorted(sizes, reverse=True):
        out += [size] * (length // size)
        length %= size
    return out


def _zeros(model: K3ForCausalLM, batch: int, length: int) -> Tensor:
    """Token ids ``[batch, length]`` of zeros, on the model's device."""
    return torch.zeros(batch, length, dtype=torch.long, device=model.device)


def _context(step: CompiledStep | PackagedStep, length: int, chunk: int = 512) -> DecoderState:
    """The state after ``length`` zero tokens, prefilled eagerly (``step.eager``) in chunks of ``chunk``."""
    state = step.model.new_state(1)
    for start in range(0, length, chunk):
        state = step.eager(_zeros(step.model, 1, min(chunk, length - start)), state)[1]
    return state


def _stepping(method: Callable) -> Callable:
    """A `CompiledModel` step: the background compilation waits while it runs (`k3.model.background.Gate`)."""
    @functools.wraps(method)
    def run(self: CompiledModel, input_ids: Tensor, state: DecoderState, *args) -> tuple[Tensor, DecoderState]:
        with self.gate.busy():
            return method(self, input_ids, state, *args)

    return run


class CompiledModel:
    """A model's decode and prefill-chunk steps, compiled over bucketed shapes (``k3 generate / serve / chat
    --compile``, ``Engine(compile=True)``). Called like the model (``compiled(input_ids, state)``, `decode`,
    `prefill`) they return what ``model(input_ids, state=state)`` gives at the last position: logits ``[B, 1, V]``
    and the state; `step` gives the logits ``[B, V]`` of `K3ForCausalLM.forward_groups` (the engine's form)."""

    def __init__(self, model: K3ForCausalLM, batches: tuple[int, ...] = DECODE_BATCHES,
                 sizes: tuple[int, ...] = PREFILL_PIECES, tuned: bool = True, packaged: bool = False) -> None:
        """``packaged``: the decode and verification steps run on AOTInductor packages (`k3.model.packaged`), saved
        for the next process, instead of graphs traced by dynamo in this one."""
        if 1 not in sizes or min(batches, default=0) < 1:
            raise ValueError(f"sizes must hold 1 and batches be positive, got sizes={sizes}, batches={batches}")
        self.model, self.batches, self.sizes = model, tuple(sorted(batches)), tuple(sizes)
        self.gate = Gate()  # a background compilation runs only between steps
        self.decode_step: CompiledStep | PackagedStep = PackagedStep(model, tuned=tuned) if packaged else \
            CompiledStep(model, tuned, gate=self.gate)
        self.prefill_step = CompiledStep(model, gate=self.gate)
        self.verify_step: CompiledStep | PackagedStep = PackagedStep(model, replayed=True, tuned=tuned) if packaged \
            else CompiledStep(model, tuned, replayed=True, gate=self.gate)
        # the last padded decode: (the rows returned, the whole bucket), so a batch that is not a bucket continues
        # its filler rows too and its caches keep growing in place instead of being stacked anew every step
        self._padded: tuple[DecoderState, DecoderState] | None = None
        self.plan: GraphPlan | None = None  # what `precompile` / `compile_in_background` build, and how far they are
        self.eager_calls = self.graph_calls = 0  # steps run eagerly (no graph for them, or not ready yet) / on graphs

    def _steps(self) -> dict[str, CompiledStep | PackagedStep]:
        """Every compiled step by name: the traced ones and the precompiled ones."""
        precompiled = {} if self.plan is None else self.plan.precompiled
        return {"decode": self.decode_step, "prefill": self.prefill_step, "verify": self.verify_step,
                **{f"precompiled {kind}": step for kind, step in precompiled.items()}}

    @property
    def compilations(self) -> int:
        return sum(step.compilations for step in self._steps().values())

    @property
    def cache_hits(self) -> int:
        """Of the `compilations`, the graphs loaded from an on-disk cache (`persistent_cache`, `GraphFiles`)."""
        return sum(step.cache_hits for step in self._steps().values())

    @property
    def compile_seconds(self) -> dict[tuple, float]:
        return {(name, *k): s for name, step in self._steps().items() for k, s in step.compile_seconds.items()}

    def bucket(self, batch: int) -> int:
        """The decode batch size ``batch`` rows run at (a larger batch than every bucket: its own size)."""
        return next((b for b in self.batches if b >= batch), batch)

    def step(self, input_ids: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        """The last-position logits ``[B, V]`` and the state: `decode_rows` for one token per row, `prefill_rows`
        otherwise."""
        return (self.decode_rows if input_ids.shape[1] == 1 else self.prefill_rows)(input_ids, state)

    def __call__(self, input_ids: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        """`step` with the model's logits shape ``[B, 1, V]`` (its forward's last position)."""
        logits, state = self.step(input_ids, state)
        return logits.unsqueeze(1), state

    def decode(self, input_ids: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        """`decode_rows` with the model's logits shape ``[B, 1, V]``."""
        logits, state = self.decode_rows(input_ids, state)
        return logits.unsqueeze(1), state

    def prefill(self, input_ids: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        """`prefill_rows` with the model's logits shape ``[B, 1, V]`` (the chunk's last position)."""
        logits, state = self.prefill_rows(input_ids, state)
        return logits.unsqueeze(1), state

    @_stepping
    def decode_rows(self, input_ids: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        """One token per row, ``input_ids [B, 1]``; the batch padded to its bucket with copies of row 0. An unpadded
        state runs as one padded by zeros (the same attention: one graph per bucket, not two); a step on a cache of
        0 or 1 positions (the first tokens of a sequence) runs eagerly, so that every graph a server can reach is
        one that `warm_up` builds."""
        graph = self._graph(("decode", self.bucket(input_ids.shape[0]), cached(state)), self.decode_step)
        if cached(state) < 2 or graph is None:
            return self._eager(input_ids, state)
        batch, kept = input_ids.shape[0], self._padded
        # the rows this returned last step: continue its whole bucket
        logits, out, after = self._on_bucket(graph, input_ids, state, kept[1] if kept and kept[0] is state else None)
        self._padded = (out, after) if self.bucket(batch) > batch else None
        return logits[:batch], out

    @_stepping
    def verify(self, input_ids: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        """A speculative verification ``input_ids [B, T]`` (each row's pending token and drafts, right-padded):
        the logits of every position ``[B·T, V]`` (rows first) and the state with its `Replay`, as
        ``forward_groups(..., full=[True], replay=[True])``. Rows are padded to the decode bucket with copies of
        row 0, one graph per (bucket, T); on a cache of 0 or 1 positions it runs eagerly, as `decode`."""
        batch, tokens = input_ids.shape
        graph = self._graph(("verify", self.bucket(batch), tokens, cached(state, tokens)), self.verify_step)
        if cached(state, tokens) < 2 or graph is None:
            self.eager_calls += 1
            with torch.no_grad():
                return self.model.forward_groups([(input_ids, state)], full=[True], replay=[True])[0]
        logits, out, _ = self._on_bucket(graph, input_ids, state)
        return logits[:batch * tokens], out

    def _on_bucket(self, graph: CompiledStep | PackagedStep, input_ids: Tensor, state: DecoderState,
                   bucket: DecoderState | None = None) -> tuple[Tensor, DecoderState, DecoderState]:
        """``graph`` on the rows padded to their bucket with copies of row 0 (``bucket``: the whole padded state the
        rows ``state`` came from, continued instead), an unpadded state as one padded by zeros: the graph's logits,
        the rows' state (unpadded as it came) and the bucket's."""
        batch, unpadded = input_ids.shape[0], state.padding is None
        extra = self.bucket(batch) - batch
        if extra:
            state = bucket if bucket is not None else DecoderState.stack([state, *[state.select(slice(0, 1))] * extra])
            input_ids = torch.cat([input_ids, input_ids[:1].expand(extra, -1)])
        elif unpadded:
            state = replace(state, padding=state.row_padding())
        self.graph_calls += 1
        logits, after = graph(input_ids, state)
        out = after.select(slice(0, batch)) if extra else after
        return logits, replace(out, padding=None) if unpadded else out, after

    @_stepping
    def prefill_rows(self, input_ids: Tensor, state: DecoderState,
                     after_piece: Callable[[int], None] | None = None) -> tuple[Tensor, DecoderState]:
        """A chunk ``input_ids [B, T]`` as pieces of the bucket lengths (a 1-token piece is a decode step; a piece
        on a cache of exactly one position, after a 1-token first piece, runs eagerly like such a decode step);
        ``after_piece(size)`` is called after each piece (what a piece's graph kept is overwritten by the next)."""
        logits, start = None, 0
        for size in pieces(input_ids.shape[1], self.sizes):
            part = input_ids[:, start:start + size]
            if size == 1:
                logits, state = self.decode_rows(part, state)
            elif cached(state) == 1 or (graph := self._graph(("prefill", size, cached(state, size)),
                                                             self.prefill_step)) is None:
                logits, state = self._eager(part, state)
            else:
                self.graph_calls += 1
                logits, state = graph(part, state)
            if after_piece is not None:
                after_piece(size)
            start += size
        return logits, state

    @torch.no_grad()
    def _eager(self, input_ids: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        """The step uncompiled: the function the graphs are traced from, run as it is."""
        self.eager_calls += 1
        return self.decode_step.eager(input_ids, state)

    def families(self, max_batch: int, max_model_len: int | None = None, verify_tokens: int = 0,
                 prefill: bool = True) -> list[tuple]:
        """The graphs serving with at most ``max_batch`` requests reaches, most used first: ``("decode", bucket,
        side)`` for each decode bucket up to ``bucket(max_batch)``, ``("verify", bucket, verify_tokens, side)`` with
        ``verify_tokens``, and ``("prefill", size, side)`` for each prefill piece (unless ``prefill`` is False);
        ``side`` is `cached`'s: 0 an empty cache, 2 a cache, 3 one past `CASCADE_SUM` positions, built where a
        context of ``max_model_len`` tokens (default: the model's) reaches that far."""
        long = (max_model_len or self.model.config.context_length) > CASCADE_SUM
        buckets = [b for b in self.batches if b <= self.bucket(max_batch)]
        out: list[tuple] = []
        for side in (2, 3) if long else (2,):
            out += [("decode", b, side) for b in buckets]
            out += [("verify", b, verify_tokens, side) for b in buckets if verify_tokens]
            out += [("prefill", size, s) for size in self.sizes if prefill and size > 1
                    for s in ((0, 2) if side == 2 else (3,))]
        return out

    @torch.inference_mode()
    def warm_up(self, max_batch: int, max_model_len: int | None = None, verify_tokens: int = 0,
                prefill: bool = True) -> float:
        """Compile every graph of `families` before any request arrives (vLLM's capture at start-up), in inference
        mode as the engine steps. Returns the seconds taken; afterwards no traffic compiles."""
        start, contexts = time.perf_counter(), {}
        for family in self.families(max_batch, max_model_len, verify_tokens, prefill):
            self._build(family, contexts)
        return time.perf_counter() - start

    def precompile(self, families: list[tuple], built: Callable[[tuple], None] | None = None) -> float:
        """Build the precompiled graph (`k3.model.precompiled`) of each of ``families`` now — loaded in seconds
        where an earlier process saved it, else compiled and saved — and run those families on them; every other
        call runs eagerly (``k3 generate --compile``); ``built(family)`` after each. Returns the seconds taken."""
        start = time.perf_counter()
        with torch.inference_mode():
            self._plan(families, upgrade=False).build_all(built)
        return time.perf_counter() - start

    def compile_in_background(self, families: list[tuple], upgrade: bool = True,
                              process: bool = True) -> threading.Thread:
        """Build the graphs of ``families`` (`families`) on a thread of their own while the steps run: a call of a
        family not built yet runs eagerly (the function its graphs are traced from: the same tokens), then on its graph.
        First each family's precompiled graph (as `precompile`); then, with ``upgrade``, the tuned decode and
        verification graphs (frozen weights: ~2× faster; not saved on the CPU, where MKL's packed weights are in them),
        each replacing its precompiled one when built. The thread runs only while no step has run for a moment
        (`k3.model.background.Gate`): the steps keep their speed and the graphs take the idle time. With ``process`` (a
        model on the CPU), the precompiled graphs are compiled by a process of their own (`k3.model.graph_worker`: no
        interpreter lock shared with the steps) and this thread only loads them; where it cannot start or fails, this
        thread compiles what is left, with a warning. `plan` (`k3.model.graph_plan.GraphPlan`) maps each family to the
        step serving it (``ready``); an error stops the compilation with a warning (what is left runs as it is);
        `stop_background` parks it for good."""
        plan = self._plan(families, upgrade)
        background_begins()
        threads, process = torch.get_num_threads(), process and self.model.device.type == "cpu"
        plan.background = self.gate.start(lambda: plan.run(threads, process), "k3-compile")
        return plan.background

    def _plan(self, families: list[tuple], upgrade: bool) -> GraphPlan:
        """`plan`: each family's precompiled graph, then, with ``upgrade``, the tuned decode and verification graphs
        (`k3.model.graph_plan.GraphPlan`)."""
        if self.plan is not None:
            raise RuntimeError("CompiledModel: graphs have already been planned")
        traced = {"decode": self.decode_step, "prefill": self.prefill_step, "verify": self.verify_step}
        self.plan = GraphPlan(self.model, self.gate, families, upgrade, traced, self._build)
        return self.plan

    def wait_background(self, timeout: float | None = None) -> bool:
        """Wait (no step running) until the background compilation has ended; whether it has."""
        background = None if self.plan is None else self.plan.background
        if background is not None:
            background.join(timeout)
        return background is None or not background.is_alive()

    def stop_background(self) -> None:
        """Park the background compilation for good and end its graph process (the families not built run as they
        do)."""
        self.gate.close()
        if self.plan is not None:
            self.plan.stop()

    def _build(self, family: tuple, contexts: dict[int, DecoderState], step: CompiledStep | None = None) -> None:
        """Compile ``family``'s graph (on ``step``, default its traced one) on zero tokens after a context of its
        side (made once, kept in ``contexts``)."""
        kind, side = family[0], family[-1]
        step = step or self._steps()[kind]
        if side not in contexts:
            contexts[side] = _context(self.decode_step, {0: 0, 2: 2, 3: CASCADE_SUM}[side])
        if kind == "prefill":
            step(_zeros(self.model, 1, family[1]), contexts[side])
            return
        batch, tokens = family[1], 1 if kind == "decode" else family[2]
        state = DecoderState.stack([contexts[side]] * batch)
        step(_zeros(self.model, batch, tokens), state if state.padding is not None else
             replace(state, padding=state.row_padding()))

    def _graph(self, family: tuple, traced: CompiledStep) -> CompiledStep | None:
        """The step a call of ``family`` runs on: ``traced`` (compiled on first use), or while compiling in the
        background the one built for it so far (None: not yet, eagerly)."""
        return traced if self.plan is None else self.plan.ready.get(family)

