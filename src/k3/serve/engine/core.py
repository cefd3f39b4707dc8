"""The continuous-batching inference engine (SPEC §8): requests join and leave a running batch between steps.

Each request owns a `DecoderState`. One `Engine.step` passes values between four seams (vLLM v1's):

1. the `Scheduler` admits waiting requests and returns a `StepPlan`: every request with a sampled token pending
   decodes, and the prefilling ones read pieces of their prompts (`k3.serve.engine.scheduler`);
2. the `Runner` makes **one** model call for the plan — decode rows stacked, prefill pieces, speculative runs —
   and returns logits and next states (`k3.serve.engine.runner`);
3. the `Sampler` turns them into each request's tokens: sampling, grammar masks, draft verification
   (`k3.serve.engine.sampler`);
4. the scheduler records the new states (and prefix-cache checkpoints), and `Outputs` turns the tokens into text
   deltas, stop strings and finish reasons (`k3.serve.engine.outputs`); the core hands each `Output` to its
   request's callback and ends finished requests.

One request never harms another (issue 9): sampling is safe for every accepted parameter value; a failure while
sampling or processing one request's token ends that request only; a failed model call holding several requests is
retried once per request, alone, and only the requests that still fail end with ``finish_reason="error"``; a
failing callback (a gone client) cancels its request. `start` runs steps on a background thread; `generate` is a
blocking iterator that works with or without it.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

import torch

from k3.model.compiled import CompiledModel
from k3.model.lm import K3ForCausalLM
from k3.serve.engine.cache import PrefixCache
from k3.serve.engine.drafting import Drafter, Speculator
from k3.serve.engine.images import check_prompt, image_digest
from k3.serve.engine.outputs import Outputs
from k3.serve.engine.request import (
    ContextLengthExceeded,
    Output,
    Processor,
    QueueFull,
    Request,
    TextProcessor,
    new_request,
)
from k3.serve.engine.runner import Forward, Runner
from k3.serve.engine.sampler import Sampled, Sampler
from k3.serve.engine.sampling import SamplingParams, TokenLogprob
from k3.serve.engine.scheduler import Scheduler, StepPlan
from k3.serve.engine.structured import Grammars
from k3.tokenization.bpe import Tokenizer
from k3.tokenization.image import VisualInput

__all__ = ["ContextLengthExceeded", "Engine", "Output", "Processor", "QueueFull", "SamplingParams", "TextProcessor",
           "TokenLogprob"]

Job = tuple[list[int], SamplingParams, Processor | None, Callable[[Output], None] | None]


class Engine:
    """Continuous batching over a `K3ForCausalLM` (see the module docstring)."""

    def __init__(self, model: K3ForCausalLM, tokenizer: Tokenizer, *, max_model_len: int | None = None,
                 max_batch: int = 32, prefill_chunk: int = 64, max_waiting: int = 1024,
                 prefix_cache: PrefixCache | None = None, drafter: Drafter | None = None,
                 num_draft_tokens: int = 4, compile: bool | CompiledModel = False,
                 grammars: Grammars | None = None, adaptive_draft: bool = True) -> None:
        """``compile``: decode rows and prefill chunks run through compiled graphs (`k3.model.compiled.CompiledModel`
        with its default buckets, or the one given), and so does speculative verification; prompt logprobs and image
        chunks stay eager. ``grammars``: the structured-output grammars and their cache (default: a
        `Grammars` of the tokenizer with the default budgets). ``adaptive_draft``: each request drafts as many tokens
        as its measured acceptance pays for, down to none (`k3.serve.engine.payoff`); False: always
        ``num_draft_tokens``."""
        if tokenizer.vocab_size > model.config.vocab_size:
            raise ValueError(f"tokenizer: {tokenizer.vocab_size} ids but the model has vocab_size "
                             f"{model.config.vocab_size}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.grammars = grammars if grammars is not None else Grammars(tokenizer)
        context = model.config.context_length
        if max_model_len is not None and not 1 <= max_model_len <= context:
            raise ValueError(f"max_model_len (--max-model-len): {max_model_len} is not within 1..{context}, the "
                             f"model's context")
        self.max_model_len = context if max_model_len is None else max_model_len
        self.drafter = drafter
        self.compiled = CompiledModel(self.model) if compile is True else compile or None
        reads_target = drafter is not None and drafter.feature_layers
        self.scheduler = Scheduler(max_batch, prefill_chunk, max_waiting, self.model.new_state, prefix_cache,
                                   None if self.compiled or reads_target else model.config.kda.chunk_size)
        self.speculator = Speculator(drafter, num_draft_tokens, self.max_model_len, adaptive_draft,
                                     padded=self.compiled is not None)
        self.runner = Runner(self.model, self.speculator, self.compiled)
        self.sampler = Sampler(tokenizer.vocab_size)
        self.outputs = Outputs(self.max_model_len)
        self.finished: Counter[str] = Counter()  # requests ended, by finish reason
        self._ids = itertools.count()
        self._step_lock = threading.RLock()  # held for a whole step; abort takes it to free state at once
        self._wake = threading.Condition(self.scheduler.lock)
        self._cancelled: set[str] = set()  # aborts requested while a step was running (guarded by the queue lock)
        self._thread: threading.Thread | None = None
        self._stopping = False

    @property
    def running(self) -> dict[str, Request]:
        """Admitted requests (prefilling or decoding) by id, in arrival order."""
        return self.scheduler.running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def max_batch(self) -> int:
        return self.scheduler.max_batch

    @property
    def prefill_chunk(self) -> int:
        return self.scheduler.prefill_chunk

    @property
    def max_waiting(self) -> int:
        return self.scheduler.max_waiting

    @property
    def num_draft_tokens(self) -> int:
        return self.speculator.gamma

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self.scheduler.prefix_cache

    def warm_up(self, background: bool = False) -> float:
        """Build every compiled graph serving reaches (`CompiledModel.families`): decode buckets and prefill pieces,
        with a drafter the ``γ + 1``-token verification per bucket and the drafter's own graphs (`Drafter.warm_up`)
        — keeping the target features a drafter reads, as serving does, and the decode buckets without them too
        (with adaptive drafting, the steps of paused requests: `Speculator.reads`). With ``background`` the target's
        graphs are built on a thread of their own while the engine serves (`CompiledModel.compile_in_background`: a
        step of a family not built yet runs eagerly), unless a drafter reads the target's features (their capture is
        a switch on the model's modules, shared with the steps): then everything is built first. Returns the seconds
        this call took (0 without ``compile``)."""
        if self.compiled is None:
            return 0.0
        start = time.perf_counter()
        if self.speculator.drafter is not None:
            self.speculator.drafter.warm_up(self.speculator.gamma)
        layers = self.speculator.feature_layers
        verify = self.runner.verify_width or 0
        if background and not layers:
            self.compiled.compile_in_background(self.compiled.families(self.max_batch, self.max_model_len, verify))
        else:
            with self.model.capture(list(layers), self.speculator.feature_source) if layers else \
                    contextlib.nullcontext():
                self.compiled.warm_up(self.max_batch, self.max_model_len, verify)
            if layers and self.speculator.lengths is not None:  # adaptive drafting pauses
                self.compiled.warm_up(self.max_batch, self.max_model_len, prefill=False)
        return time.perf_counter() - start

    @property
    def speculation(self) -> Counter[str]:
        """Speculative runs verified, tokens drafted, drafts accepted."""
        return self.speculator.counts

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: list[int], params: SamplingParams, *, request_id: str | None = None,
                    processor: Processor | None = None, callback: Callable[[Output], None] | None = None,
                    group: str | None = None, images: list[VisualInput] | None = None) -> str:
        """Queue a request (thread-safe); ``callback`` receives its `Output` after every step. Requests of
        one ``group`` (e.g. the choices of one HTTP request; default: the request alone) take turns with
        other groups for admission. ``images`` fill the prompt's media placeholders in order. Raises ValueError
        for an invalid request, `QueueFull` when the waiting queue is full."""
        return self.add_requests([(prompt, params, processor, callback)], group=group,
                                 request_ids=None if request_id is None else [request_id], images=images)[0]

    def add_requests(self, jobs: list[Job], *, group: str | None = None, request_ids: list[str] | None = None,
                     images: list[VisualInput] | None = None, marks: tuple[int, ...] = ()) -> list[str]:
        """Queue several requests of one group atomically: all are validated first, and either all are
        queued or none (ValueError naming the problem, `QueueFull`). ``images`` belong to every job's prompt;
        ``marks`` are prompt positions worth a prefix-cache checkpoint (a rendered chat's shared head)."""
        requests = []
        key = image_digest(images) if images else None
        for i, (prompt, params, processor, callback) in enumerate(jobs):
            request_id = request_ids[i] if request_ids else f"req-{next(self._ids)}"
            request = new_request(prompt, params, processor, callback, request_id, group or request_id,
                                  self.tokenizer, self.model.config.vocab_size, self.max_model_len, self.model.device)
            if images:
                check_prompt(self.model, prompt, images)
                request.images, request.image_key = images, key
            request.marks = tuple(marks)
            requests.append(request)
        with self._wake:
            self.scheduler.add(requests)
            self._wake.notify()
        return [r.id for r in requests]

    def abort(self, request_id: str, wait: bool = True) -> bool:
        """Cancel a request; its state is freed before this returns. False if it is unknown or done.

        With ``wait=False`` (for event loops) it never blocks: when a step is in progress the request
        is freed as soon as that step ends, and True is returned.
        """
        if not self._step_lock.acquire(blocking=wait):
            with self._wake:
                self._cancelled.add(request_id)
            return True
        try:
            with self._wake:
                request = self.scheduler.unqueue(request_id)
            request = request or self.running.get(request_id)
            if request is None:
                return False
            self._end(request, self.outputs.finish(request, "abort"))
            return True
        finally:
            self._step_lock.release()

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def step(self) -> None:
        """Schedule, run one model pass, sample, and report every request's outputs (module docstring)."""
        with self._step_lock, self.compiled.gate.busy() if self.compiled else contextlib.nullcontext():
            self._abort_cancelled()
            plan, start = self.scheduler.schedule(), time.perf_counter()
            for forward in self._passes(plan):
                for sampled in self.sampler.sample(forward):
                    self._commit(sampled)
            if plan.decoding and not plan.pieces:  # a pure decode step prices speculation (`Speculator.timed`)
                self.speculator.timed(time.perf_counter() - start)
            self._abort_cancelled()

    def _passes(self, plan: StepPlan) -> Iterator[Forward]:
        """The plan's model pass; if it fails with several requests in it, each request is run alone, so a failure
        ends only the requests that cause it."""
        if not plan:
            return
        try:
            forward = self.runner.run(plan)
        except Exception as err:
            if len(plan.requests()) == 1:
                self._fail(plan.requests()[0], err)
                return
            forward = None
        if forward is not None:
            yield forward
            return
        for part in plan.alone():
            request = part.requests()[0]
            if self.running.get(request.id) is not request:  # ended during an earlier part (its callback)
                continue
            try:
                forward = self.runner.run(part)
            except Exception as err:
                self._fail(request, err)
                continue
            yield forward

    def _commit(self, sampled: Sampled) -> None:
        """Record what a pass gave one request, and report its outputs (a failure ends that request alone)."""
        request = sampled.request
        try:
            if sampled.state is not None:
                checkpoint = self.scheduler.update(request, sampled.state, sampled.read)
                if checkpoint is not None:
                    self.speculator.checkpointed(request, checkpoint)
            if sampled.verified is not None:
                self.speculator.verified(request, sampled.verified[0], sampled.verified[1], sampled.tokens,
                                         sampled.verified[2])
        except Exception as err:
            return self._fail(request, err)
        for output in self.outputs.emit(sampled):
            if output.finish_reason is not None:
                return self._end(request, output)
            self._deliver(request, output)

    def _fail(self, request: Request, err: Exception) -> None:
        if self.running.get(request.id) is request:
            self._end(request, self.outputs.finish(request, "error", error=err))

    def _end(self, request: Request, output: Output) -> None:
        """The request ended with ``output`` (its finish reason): free what it held, then report it."""
        checkpoint = self.scheduler.finish(request, completed=output.finish_reason in ("stop", "length"))
        if checkpoint is not None:  # the next turn resumes there, and its drafter with it
            self.speculator.checkpointed(request, checkpoint)
        self.runner.forget(request)
        self.speculator.end(request)
        self.finished[output.finish_reason] += 1
        self._deliver(request, output)

    def _deliver(self, request: Request, output: Output) -> None:
        """Hand an output to the request's callback; a failing callback (a gone client) cancels the request."""
        try:
            request.callback(output)
        except Exception:
            if output.finish_reason is None:
                with self._wake:
                    self._cancelled.add(request.id)

    def _abort_cancelled(self) -> None:
        with self._wake:
            cancelled, self._cancelled = self._cancelled, set()
        for request_id in cancelled:
            self.abort(request_id)

    # ------------------------------------------------------------------ driving
    def start(self) -> Engine:
        """Run steps on a background thread whenever there is work."""
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="k3-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        if self.compiled is not None:
            self.compiled.stop_background()
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.grammars.close()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self.has_work():
                    self._wake.wait()
                if self._stopping:
                    return
            self.step()

    def generate(self, prompt: list[int], params: SamplingParams, processor: Processor | None = None,
                 request_id: str | None = None, images: list[VisualInput] | None = None) -> Iterator[Output]:
        """Yield the request's outputs until it finishes; steps inline when no background thread runs."""
        outputs: queue.SimpleQueue[Output] = queue.SimpleQueue()
        rid = self.add_request(prompt, params, request_id=request_id, processor=processor, callback=outputs.put,
                               images=images)
        try:
            while True:
                if self._thread is None:
                    while outputs.empty():
                        self.step()
                output = outputs.get()
                yield output
                if output.finish_reason is not None:
                    return
        finally:
            self.abort(rid)
