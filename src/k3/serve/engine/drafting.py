"""Speculative decoding in the engine (issue 14; SPEC §8): draft γ tokens, verify them in one target pass, replay.

Per step, each speculating request's `Drafter` proposes γ tokens with the distributions ``q`` it sampled them
from; the engine feeds all speculating requests' ``[pending, d_1 … d_γ]`` as one group of `forward_groups` (with
every position's logits and a `Replay`), next to the other requests' decode rows and prefill chunks. The sampler's
`verify` (`k3.serve.engine.sampler`) then applies the lossless rule (`k3.serve.engine.speculative.verify`) to the
target's *processed* distributions (penalties, temperature, top-k / top-p / min-p, exactly as plain sampling would
use them); the accepted tokens and the corrected or bonus token are emitted one by one (stop strings, stop ids and
``max_tokens`` can end the run inside it), and the target state advances to the accepted prefix with
``state.accept(n + 1)`` — a KDA replay from the recorded inputs, not a snapshot per drafted position. Greedy
requests accept while the target's argmax agrees, so their tokens are exactly those of plain decoding.

`EagleDrafter` drafts with an EAGLE-3 draft that reads the target's features (`observe`); `ModelDrafter` with a
small independent K3 model (classic speculative decoding), whose per-request draft states are immutable values,
so rolling the draft back to the accepted prefix is choosing one of them. `Speculator` is the engine's side: who
drafts in a step, and what the drafter is told of the target's features and of each verified run.
"""

from __future__ import annotations

import contextlib
import itertools
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Protocol

import torch
from torch import Tensor

from k3.model.compiled import CompiledModel
from k3.model.compiled_step import tuned_compiling
from k3.model.draft import DraftState, EagleDraft
from k3.model.lm import K3ForCausalLM
from k3.model.projections import fused
from k3.model.sequence.mla import ABSORBED_TOKENS, MLACache
from k3.model.state import DecoderState
from k3.serve.engine.payoff import READ_AHEAD, DraftLength, StepCost
from k3.serve.engine.sampling import SamplingParams, process
from k3.serve.engine.request import Request
from k3.serve.engine.speculative import probabilities

__all__ = ["Draft", "Drafter", "EagleDrafter", "ModelDrafter", "Speculator"]


@dataclass
class Draft:
    """γ proposed tokens and the draft distributions ``q`` [γ, V] they were sampled from; None for a deterministic
    draft (`distributions`: one-hot at its tokens, made only where a sampled verification reads it)."""

    tokens: list[int]
    q: Tensor | None = None

    def distributions(self, vocab_size: int, device: torch.device) -> Tensor:
        """``q`` ``[γ, vocab_size]`` (float64)."""
        if self.q is not None:
            return self.q
        q = torch.zeros(len(self.tokens), vocab_size, dtype=torch.float64, device=device)
        q[torch.arange(len(self.tokens), device=device), torch.tensor(self.tokens, device=device)] = 1.0
        return q


OUTPUT_BIN = 16  # output tokens per bin of the acceptance-by-output-length counts


class Drafter(Protocol):
    """Proposes tokens for one request at a time; keyed by the engine's request id. ``feature_layers`` (None for
    a drafter that does not read the target) are the target layers whose features `observe` receives: what
    `K3ForCausalLM.capture` keeps with ``feature_source``."""

    feature_layers: tuple[int, ...] | None
    feature_source: str | None
    cost: float  # a drafted position's price relative to a plain decode step (`k3.serve.engine.payoff`)
    free: bool  # proposing costs nothing (no model runs): a paused request's proposals are checked for free

    def observe(self, request_id: str, tokens: list[int], features: Tensor | None) -> None:
        """The target consumed ``tokens`` (a prefill chunk, a decode token, or a verified run's kept tokens) and
        produced ``features`` ``[T, len(feature_layers), d]`` at them; None: a drafter that reads features was not
        given them (`Speculator.reads`: the request was paused), a gap in what it read."""

    def propose(self, request_id: str, history: Sequence[int], pending: int, params: SamplingParams,
                prompt: list[int], output: list[int], generator: torch.Generator | None, gamma: int) -> Draft | None:
        """Up to ``gamma`` tokens after ``history`` + ``pending`` (None or no tokens: nothing to propose); ``history``
        may be a view of the request's tokens (`Request.history`): slicing it copies only the slice."""

    def accept(self, request_id: str, accepted: int) -> None:
        """The target kept ``pending`` and the first ``accepted`` drafted tokens of the last proposal."""

    def end(self, request_id: str) -> None:
        """The request finished or was aborted."""

    def save(self, request_id: str, key: bytes) -> None:
        """The request's prompt so far was checkpointed in the prefix cache under ``key``."""

    def restore(self, request_id: str, key: bytes) -> None:
        """The request resumes from the prefix-cache checkpoint ``key`` (before it reads anything)."""

    def warm_up(self, gamma: int) -> None:
        """Build what a first proposal of ``gamma`` tokens would compile (`Engine.warm_up`)."""


class ModelDrafter:
    """Drafts with an independent small `K3ForCausalLM` sharing the target's vocabulary (``cost``: a stated guess,
    a draft model's step at half a target step's price); with ``compile``, its steps run on compiled graphs
    (`k3.model.compiled.CompiledModel`, batch 1)."""

    feature_layers = feature_source = None
    cost = 0.5
    free = False

    def __init__(self, model: K3ForCausalLM, compile: bool = False) -> None:
        self.model = model.eval()
        self.compiled = CompiledModel(self.model, batches=(1,)) if compile else None
        self._states: dict[str, tuple[DecoderState, int]] = {}  # per request: a state and how many tokens it read
        self._proposed: dict[str, tuple[list[DecoderState], list[int], int]] = {}  # the last proposal: states,
        # tokens, and the tokens read before it

    def observe(self, request_id: str, tokens: list[int], features: Tensor | None) -> None:
        """The draft reads the tokens itself (`propose`, `accept`)."""

    @torch.inference_mode()
    def propose(self, request_id: str, history: Sequence[int], pending: int, params: SamplingParams,
                prompt: list[int], output: list[int], generator: torch.Generator | None, gamma: int) -> Draft:
        state, read = self._states.get(request_id) or (self.model.new_state(1), 0)
        if read < len(history):  # the first proposal, or steps decoded without drafting: catch up
            _, state = self._read(history[read:], state)
            self._states[request_id] = state, len(history)
        tokens, qs, states, token = [], [], [], pending
        for _ in range(gamma):
            logits, state = self._read([token], state)
            states.append(state)
            q = probabilities(process(logits.float(), params, prompt, output + tokens), params)
            token = int(q.argmax()) if params.temperature == 0 else int(torch.multinomial(q, 1, generator=generator))
            tokens.append(token)
            qs.append(q)
        self._proposed[request_id] = (states, tokens, len(history))  # states[i]: after pending, d_1 … d_i
        return Draft(tokens, torch.stack(qs))

    @torch.inference_mode()
    def accept(self, request_id: str, accepted: int) -> None:
        states, tokens, read = self._proposed.pop(request_id)
        if accepted < len(states):
            state = states[accepted]
        else:  # every draft was kept: the draft has not read its own last token yet
            _, state = self._read(tokens[-1:], state=states[-1])
        self._states[request_id] = state, read + 1 + accepted

    def _read(self, tokens: list[int], state: DecoderState) -> tuple[Tensor, DecoderState]:
        """The draft reads ``tokens``: the logits ``[V]`` after the last and the state."""
        ids = torch.tensor([tokens], device=self.model.device)
        logits, state = (self.compiled or self.model)(ids, state=state)
        return logits[0, -1], state

    @torch.inference_mode()
    def warm_up(self, gamma: int) -> None:
        """Compile the draft's decode graph and prefill pieces (`CompiledModel.warm_up`)."""
        if self.compiled is not None:
            self.compiled.warm_up(1)

    def end(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        self._proposed.pop(request_id, None)

    def save(self, request_id: str, key: bytes) -> None:
        """Nothing to keep: the draft reads a request's whole history at its first proposal."""

    def restore(self, request_id: str, key: bytes) -> None:
        """Nothing to restore (`save`)."""


@dataclass
class _Sequence:
    """A request's draft: its state, the fused target feature at the last position it read (None after a gap), and
    the positions the target consumed since (tokens and raw features, in order; None features: a gap), not read
    yet."""

    state: DraftState
    feature: Tensor | None = None
    unread: tuple[tuple[list[int], Tensor | None], ...] = ()

    def waiting(self) -> int:
        return sum(len(tokens) for tokens, features in self.unread if features is not None)

    def nbytes(self) -> int:
        """The bytes of its tensors: the draft state's, the feature and the waiting features."""
        state = [getattr(self.state, f.name) for f in fields(self.state)]
        tensors = [t for t in (*state, self.feature, *(f for _, f in self.unread)) if isinstance(t, Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)


class EagleDrafter:
    """Drafts with an EAGLE-3 draft (`k3.model.draft.EagleDraft`) from the target's own features: every position
    the target consumes is paired with the next token and read by the draft with its *true* fused feature, so
    after a verification the draft continues exactly from the accepted prefix. The reads are lazy: the positions
    wait until the next proposal or until ``read_every`` of them have come, then one call reads them
    (`EagleDraft.read`: no FFN, no LM head), so steps that draft nothing (an adaptive pause) cost the draft almost
    nothing.

    The target skips the positions a prefix-cache hit restores, so their features never reach the draft: the draft's
    own state is kept beside each checkpoint the cache writes (`save`: the last ``max_saved``, at most
    ``max_saved_bytes`` — an MLA draft's state grows with the context) and restored with it
    (vLLM caches the draft's KV blocks beside the target's). A hit whose draft state was dropped starts the draft
    from the positions the target reads (drafts stay verified: only acceptance suffers); so does a request whose
    features were not captured while it was paused (`Speculator.reads`): the draft reads on after the gap, its state
    holding the positions before it. With ``compile`` the draft's
    steps and reads run through ``torch.compile`` (dynamic shapes: one graph serves every context length; 4x faster
    proposals of `mini`'s draft on CPU), and a greedy proposal is one call of a graph of all γ steps
    (`EagleDraft.greedy`), ``tuned`` as the target's decode step is (`k3.model.compiled_step.tuned_compiling`: the
    weights constants, inductor's C++ GEMM templates; ``tuned=False``: inductor's defaults, quicker to build): 4 drafts
    of `mini`'s draft in 0.37–0.57 ms against 1.46–2.44 ms step by step, 0.72–0.80 ms untuned (``chain=False``: step
    by step, as sampled proposals run; README, "EAGLE's greedy drafts in one graph")."""

    cost = 0.25  # one draft layer and the LM head per drafted position, and its verified position (stated)
    free = False

    def __init__(self, draft: EagleDraft, max_saved: int = 256, compile: bool = False, read_every: int = 64,
                 max_saved_bytes: int = 2**28, tuned: bool = True, chain: bool = True) -> None:
        self.draft, self.tuned, self.chain = draft.eval(), tuned, chain
        self._step = torch.compile(self.draft.forward, dynamic=True) if compile else self.draft
        self._read = torch.compile(self.draft.read, dynamic=True) if compile else self.draft.read
        self._greedy = torch.compile(self.draft.greedy, dynamic=True) if compile else None
        self._built: set[tuple[int, int]] = set()  # (γ, cached length: 0, 1, 2 for more) of the greedy graphs built
        self.feature_layers, self.feature_source = draft.config.feature_layers, draft.config.feature_source
        self.max_saved, self.max_saved_bytes, self.read_every = max_saved, max_saved_bytes, read_every
        self._sequences: dict[str, _Sequence] = {}
        self._saved: OrderedDict[bytes, tuple[_Sequence, int]] = OrderedDict()  # checkpoint key -> (state, bytes),
        self._saved_bytes = 0  # least recently used first

    def observe(self, request_id: str, tokens: list[int], features: Tensor | None) -> None:
        seq = self._sequences.setdefault(request_id, _Sequence(self.draft.new_state(1)))
        if features is None:  # a gap: nothing to read; the position after it is read without its predecessor's
            if not seq.unread:
                seq.feature = None
            elif seq.unread[-1][1] is not None:
                seq.unread += ((tokens, None),)
            return
        seq.unread += ((tokens, features),)
        if seq.waiting() >= self.read_every:
            self._catch_up(seq)

    def _catch_up(self, seq: _Sequence) -> None:
        """Read the waiting positions, run by run between gaps."""
        unread, seq.unread = seq.unread, ()
        for gap, run in itertools.groupby(unread, key=lambda entry: entry[1] is None):
            if gap:
                seq.feature = None
            else:
                self._read_run(seq, list(run))

    @torch.inference_mode()
    def _read_run(self, seq: _Sequence, run: list[tuple[list[int], Tensor]]) -> None:
        """Read consecutive positions: each token paired with the fused feature of the position before it (the
        first one unpaired where that feature is unknown: the sequence's start, or after a gap)."""
        tokens = [t for piece, _ in run for t in piece]
        features = self.draft.fuse(list(torch.cat([f for _, f in run]).unbind(-2)))  # [T, d]
        previous = [] if seq.feature is None else [seq.feature[None]]
        hidden = torch.cat([*previous, features[:-1]])
        paired = tokens if seq.feature is not None else tokens[1:]
        if paired:
            seq.state = self._read(torch.tensor([paired], device=hidden.device), hidden[None], seq.state)
        seq.feature = features[-1].clone()  # its own storage: dynamo specialises a view's storage offset 0 and 1

    @torch.inference_mode()
    def propose(self, request_id: str, history: Sequence[int], pending: int, params: SamplingParams,
                prompt: list[int], output: list[int], generator: torch.Generator | None, gamma: int) -> Draft | None:
        seq = self._sequences[request_id]
        self._catch_up(seq)
        if seq.feature is None:  # the last position came without its feature (`Speculator.reads`)
            return None
        if params.temperature == 0 and self.chain:  # greedy verification reads no q (`Sampler.judge`)
            return Draft(self._chain(seq, pending, gamma))
        tokens, q, _ = self.draft.propose(seq.feature, pending, seq.state, gamma, params, probabilities, generator,
                                          self._step)
        return Draft(tokens, q)

    def _chain(self, seq: _Sequence, pending: int, gamma: int, build: bool = False) -> list[int]:
        """γ greedy drafts in one call (`EagleDraft.greedy`): on the compiled graph `warm_up` built for this shape
        (``build``) — a chain of more steps serves fewer, as greedy drafts are prefixes of longer ones (an answer's
        last tokens) — else eagerly (a tuned graph takes about a minute to build: never while serving)."""
        token = torch.tensor([[pending]], device=seq.feature.device)
        feature, state = seq.feature.reshape(1, 1, -1), seq.state
        cached = min(state.length, 2) if isinstance(state, MLACache) else 2  # a KDA state has one shape
        steps = gamma if build else min((g for g, c in self._built if c == cached and g >= gamma), default=None)
        if self._greedy is None or steps is None:
            return self.draft.greedy(token, feature, state, gamma).tolist()
        if self.tuned:
            context = tuned_compiling(self.draft, self.draft.target) if build else fused()
        else:
            context = contextlib.nullcontext()
        with context:
            drafted = self._greedy(token, feature, state, steps).tolist()
        self._built.add((steps, cached))
        return drafted[:gamma]

    @torch.inference_mode()  # as serving calls them: dynamo tells graphs built under no_grad apart
    def warm_up(self, gamma: int) -> None:
        """Compile the draft's steps: the reads serving makes — of a prompt (an empty state), of kept tokens or
        decoded ones, and of a paused request's catch-up, each up to and past MLA's absorbed form (`ABSORBED_TOKENS`
        new positions; dynamic shapes specialise sizes 0 and 1 apart from the rest) — then a proposal of ``gamma``
        through the sampled proposals' steps and (``chain``) through the greedy chain's graph."""
        weight = self.draft.in_proj.weight
        long = ABSORBED_TOKENS + 4
        features = torch.zeros(long + 1, 3, weight.shape[0], dtype=weight.dtype, device=weight.device)
        for name, lengths in ((" warm-up", (8, 3, 1, long)), (" warm-up, long prompt", (long + 1,))):
            for length in lengths:  # reads of 7 (an empty state), 3, 1 and ``long`` positions; ``long`` on an empty one
                self.observe(name, [0] * length, features[:length])
                self._catch_up(self._sequences[name])
        self.end(" warm-up, long prompt")
        seq = self._sequences[" warm-up"]  # the sampled proposals' steps, then the greedy chain
        self.draft.propose(seq.feature, 0, seq.state, gamma, SamplingParams(temperature=0), probabilities, None,
                           self._step)
        if self.chain:
            self._chain(seq, 0, gamma, build=True)
        self.end(" warm-up")

    def accept(self, request_id: str, accepted: int) -> None:
        """Nothing to undo: the draft reads the kept tokens with the target's features (`observe`)."""

    def end(self, request_id: str) -> None:
        self._sequences.pop(request_id, None)

    def save(self, request_id: str, key: bytes) -> None:
        """Keep the draft's state for the checkpoint ``key`` (its states are values: later reads never change it);
        the least recently used go first beyond ``max_saved`` states or ``max_saved_bytes`` bytes."""
        seq = self._sequences.get(request_id)
        if seq is None:
            return
        if key in self._saved:
            self._saved_bytes -= self._saved.pop(key)[1]
        size = seq.nbytes()
        self._saved[key] = (replace(seq), size)
        self._saved_bytes += size
        while self._saved and (len(self._saved) > self.max_saved or self._saved_bytes > self.max_saved_bytes):
            self._saved_bytes -= self._saved.popitem(last=False)[1][1]

    @property
    def saved_bytes(self) -> int:
        """The bytes of the draft states kept beside prefix-cache checkpoints."""
        return self._saved_bytes

    def restore(self, request_id: str, key: bytes) -> None:
        saved = self._saved.get(key)
        if saved is not None and request_id not in self._sequences:
            self._saved.move_to_end(key)
            self._sequences[request_id] = replace(saved[0])


class Speculator:
    """The engine's side of speculation: which decoding requests draft this step and how many tokens (``adaptive``:
    `k3.serve.engine.payoff.DraftLength` from each request's measured acceptance, else always ``num_draft_tokens``),
    what the target's features and verified runs tell the drafter, and the counts ``runs``, ``drafted``,
    ``accepted``, ``drafted_at_i`` / ``accepted_at_i`` (draft position i, from 1), ``runs_from_n`` / ``kept_from_n``
    (runs verified, and tokens they emitted, while the request's output held n to n + `OUTPUT_BIN` − 1 tokens),
    ``plain`` (a speculating drafter's request decoding plainly: no draft found, or adaptively paused), and
    ``shadowed`` / ``shadow_hits`` (a paused request's free proposals checked against the target's own token, and
    those it confirmed: `DraftLength.shadow`) and ``held`` (rows that would have drafted in a step whose
    verification group would not have paid for itself)."""

    def __init__(self, drafter: Drafter | None, num_draft_tokens: int, max_model_len: int,
                 adaptive: bool = True, padded: bool = False) -> None:
        self.drafter, self.gamma, self.max_model_len = drafter, num_draft_tokens, max_model_len
        self.padded = padded  # every verification row is γ + 1 wide (compiled graphs)
        self.feature_layers = None if drafter is None else drafter.feature_layers
        self.feature_source = None if drafter is None else drafter.feature_source
        self.lengths = DraftLength(num_draft_tokens, drafter.cost, padded=padded) \
            if drafter is not None and adaptive else None
        self.cost = StepCost(drafter.cost) if self.lengths is not None else None
        self.counts: Counter[str] = Counter()
        self._shadows: dict[str, tuple[int, int]] = {}  # a paused request's free proposal: (its output length, token)
        self._proposed = (0, 0, 0)  # the last `propose`: requests decoding, rows drafting, positions drafted

    def propose(self, requests: list[Request]) -> dict[Request, Draft]:
        """This step's drafts of the decoding ``requests`` that speculate: not under a grammar (its matcher would
        have to roll back), with room for a draft — no more drafts than tokens the request may still emit (one is
        the bonus) or the context holds — and a draft proposed (an n-gram drafter may find none). Adaptively, one
        step in `StepCost.every` drafts nothing, to time plain decoding (`timed`)."""
        if self.drafter is None:
            return {}
        out: dict[Request, Draft] = {}
        if self.lengths is not None:
            self.lengths.tick()
        if self.cost is not None and requests and self.cost.plain_step():
            self.counts["plain"] += len(requests)
            self._proposed = (len(requests), 0, 0)
            return out
        lengths = {}
        for r in requests:
            self._check_shadow(r)
            wanted = self.gamma if self.lengths is None else self.lengths.length(r.id, self._watched(r))
            room = min(r.params.max_tokens - len(r.output_ids) - 1, self.max_model_len - r.state.position - 2)
            lengths[r] = min(wanted, room) if r.params.constraint is None else 0
        if self.lengths is not None and not self._group_pays(lengths):
            lengths = dict.fromkeys(lengths, 0)
        for r, length in lengths.items():
            draft = None
            if length > 0:
                draft = self._propose(r, length)
            elif self.lengths is not None and self._watched(r):
                shadow = self._propose(r, 1)
                if shadow is not None and shadow.tokens:
                    self._shadows[r.id] = (len(r.output_ids), shadow.tokens[0])
            if draft is not None and draft.tokens:
                out[r] = draft
            else:
                self.counts["plain"] += 1
        positions = self.gamma * len(out) if self.padded else sum(len(d.tokens) for d in out.values())
        self._proposed = (len(requests), len(out), positions)
        return out

    def _group_pays(self, lengths: dict[Request, int]) -> bool:
        """Whether this step's verification group pays for itself (`k3.serve.engine.payoff`): its rows' expected
        gains exceed its own price ``G·B``, or a row probes (a probe is how prices are learnt). Otherwise the rows
        that would draft are held until their next probe."""
        drafting = [r for r, n in lengths.items() if n > 0]
        if not drafting or any(self.lengths.probing(r.id) for r in drafting):
            return True
        if sum(self.lengths.gain(r.id, lengths[r]) for r in drafting) > self.cost.value[0] * len(lengths):
            return True
        for r in drafting:
            self.lengths.hold(r.id)
        self.counts["held"] += len(drafting)
        return False

    def _watched(self, r: Request) -> bool:
        """Whether a paused ``r`` keeps proposing for free, its proposals checked against the target's own tokens
        (`DraftLength.shadow`): a free drafter, and no grammar (a grammar's request never drafts)."""
        return self.drafter.free and r.params.constraint is None

    def _propose(self, r: Request, length: int) -> Draft | None:
        return self.drafter.propose(r.id, r.history, r.pending, r.params, r.prompt, r.output_ids, r.generator, length)

    def _check_shadow(self, r: Request) -> None:
        """The token the target sampled last step against the free proposal made for it (`DraftLength.shadow`)."""
        shadow = self._shadows.pop(r.id, None)
        if shadow is not None and len(r.output_ids) == shadow[0] + 1:
            hit = r.pending == shadow[1]
            self.lengths.shadow(r.id, hit)
            self.counts.update(shadowed=1, shadow_hits=int(hit))

    def timed(self, seconds: float) -> None:
        """The step of the last `propose` (decoding only, no prefill in it) took ``seconds``: measure the price of
        verification (`StepCost`) and draft by it."""
        if self.cost is not None and self._proposed[0]:
            self.cost.record(*self._proposed, seconds)
            _, self.lengths.fixed, self.lengths.cost = self.cost.value

    def reads(self, request: Request) -> bool:
        """Whether the drafter reads the target's features at ``request``'s tokens this step: it reads features, and
        the request may draft within `READ_AHEAD` steps (`DraftLength.reading`; always without adaptive lengths).
        A paused request's steps then capture nothing (the target's plain graphs), and the draft reads on after the
        gap (`EagleDrafter`)."""
        if not self.feature_layers:
            return False
        return self.lengths is None or self.lengths.reading(request.id, READ_AHEAD)

    def observe(self, request: Request, tokens: list[int], features: Tensor | None) -> None:
        """The target consumed ``tokens`` of ``request`` with ``features`` (None where the drafter reads features but
        was not given them: `reads`); the first piece after a prefix-cache hit restores the drafter's state of that
        checkpoint first."""
        if self.feature_layers:
            if request.resumed is not None and request.prefilled == request.cached:
                self.drafter.restore(request.id, request.resumed)
            self.drafter.observe(request.id, tokens, features)

    def checkpointed(self, request: Request, key: bytes) -> None:
        """The prefix cache checkpointed ``request``'s prompt so far under ``key``."""
        if self.drafter is not None:
            self.drafter.save(request.id, key)

    def verified(self, request: Request, pending: int, drafted: int, kept: list[int], features: Tensor | None) -> None:
        """The target kept ``pending`` and the accepted drafts of a run of ``drafted`` (``kept``: the emitted tokens,
        the last of them the corrected or bonus token, not yet consumed)."""
        accepted = len(kept) - 1
        self.drafter.accept(request.id, accepted)
        if self.feature_layers:
            self.drafter.observe(request.id, [pending, *kept[:-1]], None if features is None else features[:len(kept)])
        if self.lengths is not None:
            self.lengths.update(request.id, drafted, accepted)
        self.counts.update(runs=1, drafted=drafted, accepted=accepted)
        self.counts.update({f"drafted_at_{i}": 1 for i in range(1, drafted + 1)})
        self.counts.update({f"accepted_at_{i}": 1 for i in range(1, accepted + 1)})
        n = len(request.output_ids) // OUTPUT_BIN * OUTPUT_BIN
        self.counts.update({f"runs_from_{n}": 1, f"kept_from_{n}": len(kept)})

    def end(self, request: Request) -> None:
        self._shadows.pop(request.id, None)
        if self.drafter is not None:
            self.drafter.end(request.id)
        if self.lengths is not None:
            self.lengths.end(request.id)
