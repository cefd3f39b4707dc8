"""One model pass for a step (SPEC §8): the only caller of `K3ForCausalLM.forward_groups`, eager or compiled.

A `StepPlan` becomes groups of one `forward_groups` call: each prefill piece (with the logits of every position
when its request wants prompt log-probabilities; the prompt's embeddings with its images encoded in, for an image
prompt), all speculating requests' ``[pending, d_1 … d_γ]`` as one group (right-padded to the longest draft,
states stacked; every position's logits and a `Replay`, from which each row accepts its own prefix in one
`DecoderState.accept_rows`), and the other decoding requests as one group (states stacked with
`DecoderState.stack`, MLA caches left-padded and masked).
A row's result does not depend on its batch neighbours (up to float reduction order), so greedy output is
batch-invariant. With a `CompiledModel` the decode group and plain prefill pieces run on its graphs and the rest
eagerly, together. A drafter that reads the target gets each group's features at the tokens it consumed while its
request may draft soon (`Speculator.reads`); a group whose requests are all paused captures nothing.

The pass leaves every request untouched: it returns a `Forward` (logits and next states), so a failed pass can be
retried request by request. The stacked decode state is kept for the next step while the decoding requests, and
the states they continue from, are the very ones it was made from.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import torch
from torch import Tensor

from k3.model.compiled import CompiledModel
from k3.model.lm import K3ForCausalLM
from k3.model.state import DecoderState
from k3.serve.engine.drafting import Draft, Speculator
from k3.serve.engine.images import prompt_embeddings
from k3.serve.engine.request import Request
from k3.serve.engine.scheduler import StepPlan

__all__ = ["Forward", "Runner"]


@dataclass
class Forward:
    """A pass's results: per prefill piece ``(request, tokens, logits [T, V], state)``; per speculating request
    ``(request, draft, logits [γ+1, V], features)`` and their stacked state with its `Replay` (``verified``: row b
    is the b-th request's; `DecoderState.accept_rows`); the decoding requests with their logits ``[B, V]`` and next
    states."""

    pieces: list[tuple[Request, list[int], Tensor, DecoderState]] = field(default_factory=list)
    verifying: list[tuple[Request, Draft, Tensor, Tensor | None]] = field(default_factory=list)
    verified: DecoderState | None = None
    decoding: list[Request] = field(default_factory=list)
    logits: Tensor | None = None
    states: list[DecoderState] = field(default_factory=list)


class Runner:
    """Runs `StepPlan`s on ``model`` (through ``compiled`` where it has graphs)."""

    def __init__(self, model: K3ForCausalLM, speculator: Speculator, compiled: CompiledModel | None = None) -> None:
        self.model, self.speculator, self.compiled = model, speculator, compiled
        self._batch: tuple[list[Request], list[DecoderState], DecoderState] | None = None  # rows, their states, stack

    @property
    def verify_width(self) -> int | None:
        """The tokens of every verification row when verification runs on compiled graphs: the longest run,
        ``γ + 1``, so one graph per batch bucket serves every γ the adaptive rule picks; None when verification runs
        eagerly (rows as long as the longest run)."""
        if not self.speculator.padded or self.speculator.drafter is None:
            return None
        return self.speculator.gamma + 1

    def run(self, plan: StepPlan) -> Forward:
        """The pass for ``plan`` (module docstring); on failure the stacked decode state is dropped."""
        try:
            return self._run(plan)
        except Exception:
            self._batch = None
            raise

    def forget(self, request: Request) -> None:
        """``request`` ended: the stacked decode state held its row too, so it is freed now."""
        if self._batch is not None and any(r is request for r in self._batch[0]):
            self._batch = None

    def _run(self, plan: StepPlan) -> Forward:
        drafts = self.speculator.propose(plan.decoding)
        verifying = list(drafts.items())
        decoding = [r for r in plan.decoding if r not in drafts]
        self._encode_images([request for request, _ in plan.pieces])
        ids = functools.partial(torch.tensor, device=self.model.device)
        groups = [(ids([piece]) if r.embeds is None else r.embeds[r.prefilled:r.prefilled + len(piece)][None],
                   r.state) for r, piece in plan.pieces]
        full = [r.prompt_logprobs is not None for r, _ in plan.pieces]
        replay = [bool(r.cuts_inside(len(piece))) for r, piece in plan.pieces]  # a prefix-cache checkpoint inside
        consumed = [piece for _, piece in plan.pieces]
        reads = [self.speculator.reads(r) for r, _ in plan.pieces]
        runs = [[r.pending, *d.tokens] for r, d in verifying]
        if verifying:
            rows = _right_padded(runs, self.verify_width)
            groups.append((ids(rows), _stacked_states([r for r, _ in verifying])))
            full.append(True)
            replay.append(True)
            consumed += rows
            reads += [self.speculator.reads(r) for r, _ in verifying]
        if decoding:
            groups.append((ids([[r.pending] for r in decoding]), self._stacked(decoding)))
            full.append(False)
            replay.append(False)
            consumed += [[r.pending] for r in decoding]
            reads += [self.speculator.reads(r) for r in decoding]
        results, features = self._call(groups, full, replay, consumed, reads)
        forward = Forward(decoding=decoding)
        for (request, piece), (logits, state), f in zip(plan.pieces, results, features):
            self.speculator.observe(request, piece, f)
            forward.pieces.append((request, piece, logits, state))
        if verifying:
            logits, forward.verified = results[len(plan.pieces)]
            forward.verifying = _split_verification(verifying, runs, logits,
                                                    features[len(plan.pieces):len(plan.pieces) + len(runs)])
        if decoding:
            forward.logits, stacked = results[-1]
            forward.states = stacked.unstack()
            self._batch = (decoding, forward.states, stacked)
            for request, f in zip(decoding, features[-len(decoding):]):
                self.speculator.observe(request, [request.pending], f)
        return forward

    def _stacked(self, decoding: list[Request]) -> DecoderState:
        """The decode group's stacked state: last step's, while its rows are the same requests continuing from the
        states it returned (an ended request's id may come back on a new request: identity, not ids, decides)."""
        batch = self._batch
        if batch is None or len(batch[0]) != len(decoding) or not all(
                r is old and r.state is state for r, old, state in zip(decoding, batch[0], batch[1])):
            states = [r.state for r in decoding]
            self._batch = batch = (decoding, states, _stacked_states(decoding))
        return batch[2]

    def _encode_images(self, prefilling: list[Request]) -> None:
        """Encode the images of requests starting their prefill (the choices of one request share the work)."""
        done: dict[tuple, Tensor] = {}
        for request in prefilling:
            if request.images and request.embeds is None:
                key = (request.image_key, tuple(request.prompt))
                if key not in done:
                    done[key] = prompt_embeddings(self.model, request.prompt, request.images)
                request.embeds = done[key]

    def _call(self, groups: list, full: list[bool], replay: list[bool], consumed: list[list[int]],
              reads: list[bool]) -> tuple[list, list[Tensor | None]]:
        """`forward_groups`, and the features ``[T, layers, d]`` at each consumed row's tokens (the verification and
        decode groups' rows one by one) whose request's drafter reads them this step (``reads``:
        `Speculator.reads`), None for the others. A group none of whose rows reads captures nothing: on compiled
        graphs it runs the target's plain graph."""
        bounds = list(itertools.accumulate([0] + [ids.shape[0] for ids, _ in groups]))  # each group's rows
        capture = [any(reads[bounds[g]:bounds[g + 1]]) for g in range(len(groups))]
        call = self._call_compiled if self.compiled is not None else self._call_eager
        results, features = call(groups, full, replay, capture)
        rows: list[Tensor | None] = []
        for g, f in enumerate(features):
            lengths = [len(c) for c in consumed[bounds[g]:bounds[g + 1]]]
            rows += [None] * len(lengths) if f is None else f.split(lengths)
        return results, [f if read else None for f, read in zip(rows, reads, strict=True)]

    def _call_eager(self, groups: list, full: list[bool], replay: list[bool], capture: list[bool]
                    ) -> tuple[list, list[Tensor | None]]:
        """One eager `forward_groups` call, and each group's features ``[N_g, layers, d]`` where any group captures
        (every group's then), else None."""
        if not any(capture):
            return self.model.forward_groups(groups, full=full, replay=replay), [None] * len(groups)
        with self._capture() as captured:
            results = self.model.forward_groups(groups, full=full, replay=replay)
            features = self._features(captured)
        return results, list(features.split([ids.shape[0] * ids.shape[1] for ids, _ in groups]))

    def _call_compiled(self, groups: list, full: list[bool], replay: list[bool], capture: list[bool]
                       ) -> tuple[list, list[Tensor | None]]:
        """`forward_groups` with the decode group, the verification group and the prefill pieces on compiled graphs
        (each group's result is its own: the engine is batch-invariant); the groups a graph does not cover run
        eagerly, together. Each group that ``capture``s also gives its features ``[N_g, layers, d]`` (a prefill chunk
        piece by piece: `_prefill_captured`)."""
        eager = [g for g, (ids, _) in enumerate(groups) if full[g] and not replay[g] or ids.is_floating_point()]
        results: dict[int, tuple] = {}
        features: dict[int, Tensor | None] = {}
        if eager:
            out, captured = self._call_eager([groups[g] for g in eager], [full[g] for g in eager],
                                             [replay[g] for g in eager], [capture[g] for g in eager])
            results.update(zip(eager, out))
            features.update(zip(eager, captured))
        for g, (ids, state) in enumerate(groups):
            if g in results:
                continue
            step = self.compiled.verify if replay[g] else self.compiled.step
            if not capture[g]:
                results[g], features[g] = step(ids, state), None
            elif replay[g] or ids.shape[1] == 1:
                with self._capture() as captured:
                    results[g] = step(ids, state)
                    # the graph's rows past the group's own are its bucket's filler
                    features[g] = self._features(captured)[:ids.shape[0] * ids.shape[1]]
            else:
                results[g], features[g] = self._prefill_captured(ids, state)
        return [results[g] for g in range(len(groups))], [features[g] for g in range(len(groups))]

    def _prefill_captured(self, ids: Tensor, state: DecoderState) -> tuple[tuple[Tensor, DecoderState], Tensor]:
        """A prefill chunk ``[1, T]`` on the compiled graphs (`CompiledModel.prefill_rows`), keeping each piece's
        features as it ends (a graph keeps only its own call's): the last position's logits and the state, and the
        features ``[T, layers, d]``."""
        kept = []
        with self._capture() as captured:
            result = self.compiled.prefill_rows(ids, state, lambda size: kept.append(self._features(captured)[:size]))
        return result, torch.cat(kept)

    def _capture(self):
        """`K3ForCausalLM.capture` of the drafter's feature layers."""
        return self.model.capture(list(self.speculator.feature_layers), self.speculator.feature_source)

    @staticmethod
    def _features(captured: list) -> Tensor:
        """The captured layers' features of the last call, ``[N, layers, d]``."""
        return torch.stack([layer.captured[0] for layer in captured], dim=-2)


def _right_padded(runs: list[list[int]], width: int | None = None) -> list[list[int]]:
    """The runs ``[pending, d_1 … d_γ]`` right-padded to ``width`` (default: the longest) by repeating their last
    token: the model is causal, so a run's valid positions do not see the padding, and `DecoderState.accept` keeps
    only a prefix."""
    width = width or max(map(len, runs))
    return [run + run[-1:] * (width - len(run)) for run in runs]


def _stacked_states(requests: list[Request]) -> DecoderState:
    """A group's state: the requests' states stacked; one state as it is (a batch of one needs no padding, and its
    MLA caches keep their in-place storage instead of being copied)."""
    return requests[0].state if len(requests) == 1 else DecoderState.stack([r.state for r in requests])


def _split_verification(verifying: list[tuple[Request, Draft]], runs: list[list[int]], logits: Tensor,
                        features: list[Tensor | None]) -> list[tuple[Request, Draft, Tensor, Tensor | None]]:
    """Per speculating request, from the one verification group's logits ``[B·T, V]``: the logits and features at
    its own ``γ + 1`` positions (SPEC §8)."""
    width = logits.shape[0] // len(runs)
    return [(request, draft, logits[b * width:b * width + len(run)], None if f is None else f[:len(run)])
            for b, ((request, draft), run, f) in enumerate(zip(verifying, runs, features, strict=True))]
