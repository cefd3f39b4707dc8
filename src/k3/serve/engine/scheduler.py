"""Which requests run in the next step, and how much of each (SPEC §8): the engine's scheduler.

Waiting requests are kept per *group* (the choices of one HTTP request) and groups take turns for free batch slots
(up to ``max_batch`` running), so one request's fan-out cannot starve a later short one; the waiting queue is
bounded (`QueueFull`). An admitted request starts from an empty state, or from the longest cached prefix of its
prompt (`PrefixCache`; not when it wants prompt log-probabilities, which need every position's logits). The cache
learns from every request (issue 36): checkpoints at its cuts, its prompt's pages when the prefill ends, and when it
finishes (stop or length) the pages of what it generated with a checkpoint exactly where its state stands, so a
conversation's next turn resumes right after this answer.

`schedule` returns a `StepPlan`: every request with a sampled token pending decodes, and the prefilling requests
read pieces of at most ``prefill_chunk`` prompt tokens in all, in arrival order (``idle_prefill`` when nothing
decodes: there is no latency to protect), each piece cut at the prefix cache's cuts — or, with ``replay_chunk``,
reading past them, their checkpoints rolled back from the piece's `Replay` (no model call of their own). A long
prompt thus advances a piece per step and never stalls the others. `update` records what a pass computed: states,
prefill progress, and the cache checkpoints reached.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace

from k3.model.state import DecoderState
from k3.serve.engine.cache import PrefixCache
from k3.serve.engine.request import QueueFull, Request

__all__ = ["Scheduler", "StepPlan"]


@dataclass
class StepPlan:
    """One step's work: prefill ``pieces`` (a request and its next prompt tokens) and the ``decoding`` requests
    (each feeds its pending token; some may speculate, `k3.serve.engine.drafting`)."""

    pieces: list[tuple[Request, list[int]]] = field(default_factory=list)
    decoding: list[Request] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.pieces or self.decoding)

    def requests(self) -> list[Request]:
        return [*self.decoding, *(request for request, _ in self.pieces)]

    def alone(self) -> list[StepPlan]:
        """The plan split into one plan per request (decoding first), to find which request makes a pass fail."""
        return [StepPlan(decoding=[r]) for r in self.decoding] + [StepPlan(pieces=[p]) for p in self.pieces]


class Scheduler:
    """Waiting and running requests (see the module docstring). ``lock`` guards the waiting queue; everything
    else runs on the engine's step."""

    idle_prefill = 1024  # prompt tokens per step while no request is decoding

    def __init__(self, max_batch: int, prefill_chunk: int, max_waiting: int, new_state,
                 prefix_cache: PrefixCache | None = None, replay_chunk: int | None = None) -> None:
        """``new_state(batch_size)`` makes an empty `DecoderState` (the model's ``new_state``). ``replay_chunk``: None
        ends prefill pieces at the prefix cache's cuts, so each checkpoint is a piece's own state (compiled graphs;
        a drafter that reads the target keeps its own state beside each); the KDA layers' chunk size lets a piece
        run past cuts — the runner records its `Replay` and each cut's checkpoint is rolled back from it
        (`DecoderState.prefix`), so a checkpoint costs no model call of its own."""
        if min(max_batch, prefill_chunk, max_waiting) < 1:
            raise ValueError(f"max_batch, prefill_chunk and max_waiting must be positive, got {max_batch}, "
                             f"{prefill_chunk}, {max_waiting}")
        self.max_batch, self.prefill_chunk, self.max_waiting = max_batch, prefill_chunk, max_waiting
        self.prefix_cache, self.replay_chunk = prefix_cache, replay_chunk
        self.running: dict[str, Request] = {}  # admitted (prefilling or decoding), in arrival order
        self.lock = threading.Lock()
        self._new_state = new_state
        self._waiting: OrderedDict[str, deque[Request]] = OrderedDict()  # per group, groups in turn order

    # ------------------------------------------------------------------ the queue
    @property
    def num_waiting(self) -> int:
        return sum(map(len, self._waiting.values()))

    def has_work(self) -> bool:
        return bool(self.running or self._waiting)

    def add(self, requests: list[Request]) -> None:
        """Queue the requests of one group atomically (caller holds ``lock``): all, or none with `QueueFull` or a
        ValueError for an id already in use."""
        waiting = self.num_waiting
        if waiting + len(requests) > self.max_waiting:
            raise QueueFull(waiting, len(requests), self.max_waiting,
                            retry_after=1 + (waiting + len(requests)) // self.max_batch)
        taken = set(self.running) | {r.id for q in self._waiting.values() for r in q}
        for request in requests:
            if request.id in taken:
                raise ValueError(f"request_id: {request.id!r} is already in use")
            taken.add(request.id)
        for request in requests:
            self._waiting.setdefault(request.group, deque()).append(request)

    def unqueue(self, request_id: str) -> Request | None:
        """Remove a waiting request (caller holds ``lock``)."""
        for group, queue in self._waiting.items():
            request = next((r for r in queue if r.id == request_id), None)
            if request is not None:
                queue.remove(request)
                if not queue:
                    del self._waiting[group]
                return request
        return None

    def finish(self, request: Request, completed: bool = False) -> bytes | None:
        """The request ended: it leaves the batch, its state is freed and its cache pins released. A ``completed``
        request (stop or length) first gives the prefix cache what it generated (module docstring); the key of a
        checkpoint written exactly where its state stood is returned (a drafter keeps its own state beside it)."""
        if self.running.get(request.id) is request:
            del self.running[request.id]
        key = None
        if completed and self.prefix_cache is not None and request.state is not None and request.prompt_done:
            key = self._keep_output(request)
        request.state = request.boundary = None
        if request.pins:
            self.prefix_cache.release(request.pins)
            request.pins = []
        return key

    # ------------------------------------------------------------------ a step
    def schedule(self) -> StepPlan:
        """Admit waiting requests, then plan the step: every request with a pending token decodes, and the
        prefilling ones read their next pieces."""
        self._admit()
        decoding = [r for r in self.running.values() if r.pending is not None]
        return StepPlan(self._pieces(bool(decoding)), decoding)

    def update(self, request: Request, state: DecoderState, read: int = 0) -> bytes | None:
        """``request`` continues from ``state`` after a pass that read ``read`` more prompt tokens. A cut just
        reached is checkpointed in the prefix cache (its key is returned), so is each cut the piece passed (rolled
        back from the piece's `Replay`), a prompt just read gives its pages, and a decode landing on a block boundary
        is remembered for `finish`."""
        before, passed = request.prefilled, request.cuts_inside(read)
        request.prefilled += read
        for cut in passed:
            self.prefix_cache.insert(request.prompt[:cut], state.prefix(cut - before, self.replay_chunk),
                                     request.salt)
        # a decode row's state is kept as it is: the runner continues its stacked batch while the rows are its own
        request.state = state = state if state.replay is None else replace(state, replay=None)
        cache = self.prefix_cache
        if cache is None:
            return None
        if not read:
            if state.position % cache.block == 0 and state.position > len(request.prompt):
                request.boundary = state.recurrent()
            return None
        key = None
        if request.prefilled in request.cuts:
            key = cache.insert(request.prompt[:request.prefilled], state, request.salt)
        if request.prompt_done:
            cache.insert(request.prompt, state, request.salt, checkpoint=len(request.prompt) % cache.block == 0)
        return key

    def _keep_output(self, request: Request) -> bytes | None:
        """The pages of everything the finished ``request`` consumed and a checkpoint exactly where its state stands
        (its key is returned); when the state stands past the emitted tokens (a stop inside a verified run), the
        checkpoint is the last block boundary its decoding passed (None is returned)."""
        cache = self.prefix_cache
        consumed = (request.prompt + request.output_ids)[:request.state.position]
        if len(consumed) == request.state.position:
            return cache.insert(consumed, request.state, request.salt)
        boundary = request.boundary if request.boundary and request.boundary.position <= len(consumed) else None
        if boundary is not None:
            cache.insert(consumed[:boundary.position], boundary.with_attention(request.state), request.salt)
        cache.insert(consumed, request.state, request.salt, checkpoint=False)  # the pages of its full blocks
        return None

    def _admit(self) -> None:
        """Fill free batch slots from the waiting groups in turn (one request per group per turn)."""
        with self.lock:
            while self._waiting and len(self.running) < self.max_batch:
                group, queue = next(iter(self._waiting.items()))
                request = queue.popleft()
                if queue:
                    self._waiting.move_to_end(group)
                else:
                    del self._waiting[group]
                self._start(request)
                self.running[request.id] = request

    def _start(self, request: Request) -> None:
        """A fresh state, or the longest cached prefix of the prompt; prefill is cut at the cache's checkpoint
        boundaries."""
        cache = self.prefix_cache
        request.state = self._new_state(1)
        if cache is None:
            return
        hit = cache.lookup(request.prompt, request.salt) if request.prompt_logprobs is None else None
        request.cuts = cache.cuts(len(request.prompt), 0 if hit is None else hit.frontier, request.marks,
                                  request.params.max_tokens)
        if hit is not None and hit.state is not None:
            request.state, request.prefilled, request.cached, request.pins = hit.state, hit.length, hit.length, \
                hit.keys
            request.resumed = hit.keys[-1][1]

    def _pieces(self, decoding: bool) -> list[tuple[Request, list[int]]]:
        """Up to ``prefill_chunk`` prompt tokens (``idle_prefill`` when nothing is decoding), from the
        prefilling requests in arrival order, each piece ending at the next checkpoint boundary (without
        ``replay_chunk``)."""
        budget, pieces = self.prefill_chunk if decoding else max(self.prefill_chunk, self.idle_prefill), []
        for request in self.running.values():
            n = min(budget, len(request.prompt) - request.prefilled)
            cut = None if self.replay_chunk else next((c for c in request.cuts if c > request.prefilled), None)
            n = n if cut is None else min(n, cut - request.prefilled)
            if n > 0:
                pieces.append((request, request.prompt[request.prefilled:request.prefilled + n]))
                budget -= n
        return pieces
