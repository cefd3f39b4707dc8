"""The continuous-batching inference engine (issue 5): requests join and leave a running batch between steps.

Each request owns a `DecoderState`. One `Engine.step`:

1. admits waiting requests (up to ``max_batch`` running) with an empty state;
2. makes **one** model call (`K3ForCausalLM.forward_groups`) holding every request that has a
   sampled token pending — their states stacked (`DecoderState.stack`, MLA caches left-padded and
   masked; the stacked state is reused while the set is unchanged) and unstacked afterwards — plus
   chunks of at most ``prefill_chunk`` prompt tokens in all, taken from the prefilling requests in
   arrival order. A long prompt thus advances a chunk per step and never stalls the others; the
   request whose prompt completes samples its first token. With no request decoding there is no
   latency to protect, and the budget grows to ``IDLE_PREFILL`` tokens.

A row's result does not depend on its batch neighbours (up to float reduction order), so greedy
output is batch-invariant. Sampling is per request (`SamplingParams`, a private generator per seed).
Generated ids go through the request's `Processor` (text, or the chat channels), stop strings are
matched on the visible channels with a hold-back so a stop string is never streamed, and every step
reports an `Output` per request to its callback. `start` runs steps on a background thread;
`generate` is a blocking iterator that works with or without it.

With a `PrefixCache` (issue 13) a request resumes from the longest cached prefix of its prompt (MLA pages and a KDA
checkpoint, `k3.serve.engine.cache`), and its prefill is cut at the cache's block boundaries, where the state is
checkpointed for the requests that follow.

One request never harms another (issue 9): sampling is safe for every accepted parameter value
(`k3.generation.sample_next`); a failure while sampling or processing one request's token ends that
request only; a failed model call holding several requests is retried once per request, alone, and only
the requests that still fail end with ``finish_reason="error"``. Waiting requests are kept per *group*
(the choices of one HTTP request) and groups take turns for free batch slots, so one request's fan-out
cannot starve a later short one; the waiting queue is bounded (`QueueFull`).
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from k3.model.compiled import CompiledModel
from k3.tokenization.image import VisualInput
from k3.model.lm import K3ForCausalLM
from k3.model.state import DecoderState
from k3.serve.engine.cache import PrefixCache
from k3.tokenization.detok import IncrementalDetokenizer
from k3.serve.engine.drafting import Draft, Drafter, proposals, verify_run
from k3.serve.engine.images import check_prompt, image_digest, prompt_embeddings
from k3.serve.engine.sampling import SamplingParams, TokenLogprob, choose, process, score_prompt
from k3.tokenization.bpe import Tokenizer

__all__ = ["SamplingParams", "TokenLogprob", "Output", "Processor", "TextProcessor", "ContextLengthExceeded",
           "QueueFull", "Engine"]

#: Channels on which stop strings are matched (plain completions, and the chat response).
STOP_CHANNELS = ("text", "content")


@dataclass
class Output:
    """What one step produced for one request: text deltas per channel, the new token ids, and,
    on the last output, ``finish_reason`` ("stop", "length", "abort" or "error" with ``error``).
    ``prompt_logprobs`` (one per prompt token, None for the first) comes once, with the first output after
    the prompt was read; ``cumulative_logprob`` sums the generated tokens' log-probabilities so far."""

    request_id: str
    deltas: list[tuple[str, str]]
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None = None
    error: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cumulative_logprob: float = 0.0
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache


class Processor(Protocol):
    """Turns generated ids into ``(channel, text)`` deltas."""

    def feed(self, token_id: int) -> list[tuple[str, str]]: ...

    def flush(self) -> list[tuple[str, str]]: ...


class TextProcessor:
    """Plain completions: one "text" channel; special tokens produce no text unless ``skip_special_tokens`` is
    False (then their literals)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._special = set(tokenizer.special_ids.values()) if skip_special_tokens else set()
        self._detok = IncrementalDetokenizer(tokenizer)

    def feed(self, token_id: int) -> list[tuple[str, str]]:
        if token_id in self._special:
            return []
        text = self._detok.push(token_id)
        return [("text", text)] if text else []

    def flush(self) -> list[tuple[str, str]]:
        text = self._detok.flush()
        return [("text", text)] if text else []


class ContextLengthExceeded(ValueError):
    """A prompt plus ``max_tokens`` longer than the model's context length."""

    def __init__(self, prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
        self.prompt_tokens, self.max_tokens, self.max_model_len = prompt_tokens, max_tokens, max_model_len
        super().__init__(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                         f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} in the "
                         f"completion). Please reduce the prompt or max_tokens.")


class QueueFull(RuntimeError):
    """The engine's waiting queue cannot take the requests; ``retry_after`` is a suggested wait in seconds."""

    def __init__(self, waiting: int, wanted: int, limit: int, retry_after: int) -> None:
        self.retry_after = retry_after
        super().__init__(f"the server is busy: {waiting} requests are waiting and this request needs {wanted} more "
                         f"places (the queue holds {limit}); retry after {retry_after} s")


@dataclass(eq=False)
class _Request:
    id: str
    group: str
    prompt: list[int]
    params: SamplingParams
    processor: Processor
    callback: Callable[[Output], None]
    generator: torch.Generator | None
    state: DecoderState | None = None
    prefilled: int = 0
    pending: int | None = None  # the last sampled token, to be fed at the next decode
    output_ids: list[int] = field(default_factory=list)
    held: tuple[str, str] | None = None  # (channel, text) withheld while it may start a stop string
    constraint: Any | None = None  # the request's grammar matcher (`k3.serve.engine.structured`)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # filled while the prompt is read, sent once
    cumulative_logprob: float = 0.0
    cached: int = 0  # prompt tokens restored from the prefix cache
    pins: list = field(default_factory=list)  # prefix-cache entries held while the request runs
    cuts: list[int] = field(default_factory=list)  # prompt positions where prefill chunks end (cache checkpoints)
    images: list[VisualInput] | None = None  # what fills the prompt's media placeholders, in order
    image_key: str | None = None  # digest of the prompt's images: prefixes are shared only with the same images
    embeds: Tensor | None = None  # [T, d] prompt embeddings with the images encoded in (at the first prefill)

    @property
    def salt(self) -> str | None:
        """The prefix-cache salt: the request's ``cache_salt``, and its images (the placeholder ids alone do not
        say which image fills them)."""
        if self.image_key is None:
            return self.params.cache_salt
        return f"{self.params.cache_salt or ''}|images:{self.image_key}"


class Engine:
    """Continuous batching over a `K3ForCausalLM` (see the module docstring)."""

    IDLE_PREFILL = 1024  # prompt tokens per step while no request is decoding

    def __init__(self, model: K3ForCausalLM, tokenizer: Tokenizer, *, max_model_len: int | None = None,
                 max_batch: int = 32, prefill_chunk: int = 64, max_waiting: int = 1024,
                 prefix_cache: PrefixCache | None = None, drafter: Drafter | None = None,
                 num_draft_tokens: int = 4, compile: bool | CompiledModel = False) -> None:
        """``compile``: decode rows and prefill chunks run through compiled graphs (`k3.model.compiled.CompiledModel`
        with its default buckets, or the one given); speculative verification, prompt logprobs, image chunks and
        drafter features stay eager."""
        if tokenizer.vocab_size > model.config.vocab_size:
            raise ValueError(f"tokenizer: {tokenizer.vocab_size} ids but the model has vocab_size "
                             f"{model.config.vocab_size}")
        if min(max_batch, prefill_chunk, max_waiting) < 1:
            raise ValueError(f"max_batch, prefill_chunk and max_waiting must be positive, got {max_batch}, "
                             f"{prefill_chunk}, {max_waiting}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.prefix_cache = prefix_cache
        self.drafter, self.num_draft_tokens = drafter, num_draft_tokens
        self.compiled = CompiledModel(self.model) if compile is True else compile or None
        self.speculation: Counter[str] = Counter()  # runs verified, tokens drafted, drafts accepted
        self.max_model_len = min(max_model_len or model.config.context_length, model.config.context_length)
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.max_waiting = max_waiting
        self.running: dict[str, _Request] = {}  # admitted (prefilling or decoding), in arrival order
        self._waiting: OrderedDict[str, deque[_Request]] = OrderedDict()  # per group, groups in turn order
        self.finished: Counter[str] = Counter()  # requests ended, by finish reason
        self._ids = itertools.count()
        self._queue_lock = threading.Lock()  # guards _waiting (held briefly)
        self._step_lock = threading.RLock()  # held for a whole step; abort takes it to free state at once
        self._wake = threading.Condition(self._queue_lock)
        self._cancelled: set[str] = set()  # aborts requested while a step was running
        self._batch: tuple[list[str], DecoderState] | None = None  # last decode group: request ids, stacked state
        self._thread: threading.Thread | None = None
        self._stopping = False

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

    def add_requests(self, jobs: list[tuple[list[int], SamplingParams, Processor | None,
                                            Callable[[Output], None] | None]], *, group: str | None = None,
                     request_ids: list[str] | None = None, images: list[VisualInput] | None = None) -> list[str]:
        """Queue several requests of one group atomically: all are validated first, and either all are
        queued or none (ValueError naming the problem, `QueueFull`). ``images`` belong to every job's prompt."""
        requests = []
        key = image_digest(images) if images else None
        for i, (prompt, params, processor, callback) in enumerate(jobs):
            request_id = request_ids[i] if request_ids else f"req-{next(self._ids)}"
            request = self._request(prompt, params, processor, callback, request_id, group or request_id)
            if images:
                check_prompt(self.model, prompt, images)
                request.images, request.image_key = images, key
            requests.append(request)
        with self._wake:
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
            self._wake.notify()
        return [r.id for r in requests]

    def _request(self, prompt: list[int], params: SamplingParams, processor: Processor | None,
                 callback: Callable[[Output], None] | None, request_id: str, group: str) -> _Request:
        if not isinstance(prompt, list) or not prompt:
            raise ValueError("prompt: expected a non-empty list of token ids")
        vocab = self.model.config.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt: token ids must be integers in [0, {vocab})")
        params.check(vocab)
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ContextLengthExceeded(len(prompt), params.max_tokens, self.max_model_len)
        generator = None
        if params.temperature > 0:
            generator = torch.Generator()
            generator.manual_seed(params.seed % 2**64) if params.seed is not None else generator.seed()
        return _Request(request_id, group, list(prompt), params, processor or TextProcessor(self.tokenizer),
                        callback or (lambda _: None), generator,
                        constraint=None if params.constraint is None else params.constraint(),
                        prompt_logprobs=None if params.prompt_logprobs is None else [None])

    def abort(self, request_id: str, wait: bool = True) -> bool:
        """Cancel a request; its state is freed before this returns. False if it is unknown or done.

        With ``wait=False`` (for event loops) it never blocks: when a step is in progress the request
        is freed as soon as that step ends, and True is returned.
        """
        if not self._step_lock.acquire(blocking=wait):
            with self._queue_lock:
                self._cancelled.add(request_id)
            return True
        try:
            with self._queue_lock:
                request = self._unqueue(request_id)
            request = request or self.running.pop(request_id, None)
            if request is None:
                return False
            request.state = None
            self._release(request)
            if self._batch is not None and request_id in self._batch[0]:
                self._batch = None  # the stacked decode state held its row too
            self.finished["abort"] += 1
            self._deliver(request, self._output(request, [], None, [], "abort"))
            return True
        finally:
            self._step_lock.release()

    def _unqueue(self, request_id: str) -> _Request | None:
        """Remove a waiting request (caller holds the queue lock)."""
        for group, queue_ in self._waiting.items():
            request = next((r for r in queue_ if r.id == request_id), None)
            if request is not None:
                queue_.remove(request)
                if not queue_:
                    del self._waiting[group]
                return request
        return None

    @property
    def num_waiting(self) -> int:
        return sum(map(len, self._waiting.values()))

    def has_work(self) -> bool:
        return bool(self.running or self._waiting)

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def step(self) -> None:
        """Admit, prefill one chunk budget, decode all ready requests in one batch; report outputs."""
        with self._step_lock:
            self._abort_cancelled()
            self._admit()
            ready = [r for r in self.running.values() if r.pending is not None]
            self._run(ready, self._prefill_chunks(bool(ready)))
            self._abort_cancelled()

    def _admit(self) -> None:
        """Fill free batch slots from the waiting groups in turn (one request per group per turn), so one
        request's fan-out cannot keep a later, short request waiting behind all of its choices."""
        with self._queue_lock:
            while self._waiting and len(self.running) < self.max_batch:
                group, queue_ = next(iter(self._waiting.items()))
                request = queue_.popleft()
                if queue_:
                    self._waiting.move_to_end(group)
                else:
                    del self._waiting[group]
                self._start(request)
                self.running[request.id] = request

    def _start(self, request: _Request) -> None:
        """A fresh state, or the longest cached prefix of the prompt (not for prompt log-probabilities, which
        need every position's logits); prefill is cut at the cache's checkpoint boundaries."""
        cache = self.prefix_cache
        request.state = self.model.new_state(1)
        if cache is None:
            return
        request.cuts = cache.boundaries(len(request.prompt))
        hit = cache.lookup(request.prompt, request.salt) if request.prompt_logprobs is None else None
        if hit is not None:
            request.state, request.prefilled, request.cached, request.pins = hit.state, hit.length, hit.length, \
                hit.keys

    def _checkpoint(self, request: _Request) -> None:
        """Give the prefix cache the state at a boundary the prefill just reached."""
        if self.prefix_cache is not None and request.prefilled in request.cuts:
            self.prefix_cache.insert(request.prompt[:request.prefilled], request.state, request.salt)

    def _abort_cancelled(self) -> None:
        with self._queue_lock:
            cancelled, self._cancelled = self._cancelled, set()
        for request_id in cancelled:
            self.abort(request_id)

    def _prefill_chunks(self, decoding: bool) -> list[tuple[_Request, list[int]]]:
        """Up to ``prefill_chunk`` prompt tokens (``IDLE_PREFILL`` when nothing is decoding), from the
        prefilling requests in arrival order."""
        budget, chunks = self.prefill_chunk if decoding else max(self.prefill_chunk, self.IDLE_PREFILL), []
        for request in self.running.values():
            n = min(budget, len(request.prompt) - request.prefilled)
            cut = next((c for c in request.cuts if c > request.prefilled), None)
            n = n if cut is None else min(n, cut - request.prefilled)
            if n > 0:
                chunks.append((request, request.prompt[request.prefilled:request.prefilled + n]))
                budget -= n
        return chunks

    def _run(self, ready: list[_Request], chunks: list[tuple[_Request, list[int]]]) -> None:
        """One model pass for the step; if it fails with several requests in it, each request is retried
        alone, so a failure ends only the requests that cause it."""
        if not ready and not chunks:
            return
        alone = len(ready) + len(chunks) == 1
        blame = (ready or [request for request, _ in chunks])[0] if alone else None
        if self._attempt(ready, chunks, blame) or alone:
            return
        for request in ready:
            self._attempt([request], [], request)
        for request, chunk in chunks:
            self._attempt([], [(request, chunk)], request)

    def _attempt(self, ready: list[_Request], chunks: list[tuple[_Request, list[int]]],
                 blame: _Request | None) -> bool:
        """`_forward`; on failure end ``blame`` (if given) with the error and return False."""
        if blame is not None and blame.id not in self.running:  # ended during an earlier retry (its callback)
            return True
        try:
            self._forward(ready, chunks)
            return True
        except Exception as err:
            self._batch = None
            if blame is not None:
                self._fail(blame, err)
            return False

    def _forward(self, ready: list[_Request], chunks: list[tuple[_Request, list[int]]]) -> None:
        """One model pass: the decode rows as one group (states stacked), each prefill chunk as a group (with the
        logits of every position when its request wants prompt log-probabilities), each speculating request's
        pending token and drafts as a group (`k3.serve.engine.drafting`). The model call leaves every request's state
        untouched until it returns (so a failed pass can be retried); sampling is then per request."""
        drafts = proposals(self.drafter, ready, self.num_draft_tokens, self.max_model_len)
        ready = [r for r in ready if r.id not in drafts]
        self._encode_images([request for request, _ in chunks])
        groups = [(torch.tensor([chunk]) if request.embeds is None else
                   request.embeds[request.prefilled:request.prefilled + len(chunk)].unsqueeze(0), request.state)
                  for request, chunk in chunks]
        full = [request.prompt_logprobs is not None for request, _ in chunks]
        speculating = [r for r in self.running.values() if r.id in drafts]
        groups += [(torch.tensor([[r.pending, *drafts[r.id].tokens]]), r.state) for r in speculating]
        full += [True] * len(speculating)
        replay = [False] * len(chunks) + [True] * len(speculating)
        if ready:
            ids = [r.id for r in ready]
            if self._batch is None or self._batch[0] != ids:  # reuse last step's stacked state when unchanged
                self._batch = (ids, DecoderState.stack([r.state for r in ready]))
            groups.append((torch.tensor([[r.pending] for r in ready]), self._batch[1]))
            full.append(False)
            replay.append(False)
        consumed = [chunk for _, chunk in chunks] + [[r.pending, *drafts[r.id].tokens] for r in speculating] + \
            [[r.pending] for r in ready]
        results, features = self._call(groups, full, replay, consumed)
        observe = self.drafter.observe if features is not None else (lambda *_: None)
        for (request, chunk), f in zip(chunks, features or []):
            observe(request.id, chunk, f)
        for r, f in zip(ready, (features or [])[len(chunks) + len(speculating):]):
            observe(r.id, [r.pending], f)
        if ready:
            logits, state = results.pop()
            self._batch = (self._batch[0], state)
            for request, row_state in zip(ready, state.unstack()):
                request.state = row_state
        for (request, chunk), (logits_, state) in zip(chunks, results):
            if request.prompt_logprobs is not None:
                request.prompt_logprobs += score_prompt(request.prompt, logits_, request.prefilled,
                                                        request.params.prompt_logprobs)
            request.state, request.prefilled = state, request.prefilled + len(chunk)
            self._checkpoint(request)
            if request.prefilled == len(request.prompt):
                if request.params.max_tokens == 0:  # only the prompt's log-probabilities were asked for
                    self._finish(request, [], None, [], "length")
                else:
                    self._sample([request], logits_[-1:])
        for i, (request, (logits_, state)) in enumerate(zip(speculating, results[len(chunks):])):
            self._verify(request, logits_, state, drafts[request.id],
                         None if features is None else features[len(chunks) + i])
        if ready:
            self._sample(ready, logits)

    def _encode_images(self, prefilling: list[_Request]) -> None:
        """Encode the images of requests starting their prefill (the choices of one request share the work)."""
        done: dict[tuple, Tensor] = {}
        for request in prefilling:
            if request.images and request.embeds is None:
                key = (request.image_key, tuple(request.prompt))
                if key not in done:
                    done[key] = prompt_embeddings(self.model, request.prompt, request.images)
                request.embeds = done[key]

    def _call(self, groups: list, full: list[bool], replay: list[bool],
              consumed: list[list[int]]) -> tuple[list, list[Tensor] | None]:
        """`forward_groups`; for a drafter that reads the target, also each group's features ``[T, layers, d]``
        at its consumed tokens (a decode group's rows one by one)."""
        layers = None if self.drafter is None else self.drafter.feature_layers
        if self.compiled is not None and not layers:
            return self._call_compiled(groups, full, replay), None
        if not layers:
            return self.model.forward_groups(groups, full=full, replay=replay), None
        with self.model.capture(list(layers)) as captured:
            results = self.model.forward_groups(groups, full=full, replay=replay)
            features = torch.stack([layer.captured[0] for layer in captured], dim=-2)  # [N, layers, d]
        return results, list(features.split([len(c) for c in consumed]))

    def _call_compiled(self, groups: list, full: list[bool], replay: list[bool]) -> list:
        """`forward_groups` with the decode group and the prefill chunks on compiled graphs (each group's result
        is its own: the engine is batch-invariant); the groups a graph does not cover run eagerly, together."""
        eager = [g for g, (ids, _) in enumerate(groups) if full[g] or replay[g] or ids.is_floating_point()]
        results = dict(zip(eager, self.model.forward_groups([groups[g] for g in eager], full=[full[g] for g in eager],
                                                            replay=[replay[g] for g in eager]) if eager else []))
        return [results[g] if g in results else self.compiled(*group) for g, group in enumerate(groups)]

    def _verify(self, request: _Request, logits: Tensor, state: DecoderState, draft: Draft,
                features: Tensor | None) -> None:
        """Keep the accepted drafts and the corrected or bonus token; emit them in order (a stop can end the run)."""
        try:
            pending = request.pending
            tokens, request.state, logprobs = verify_run(logits, state, draft, request.params, request.prompt,
                                                          request.output_ids, request.generator)
            self.drafter.accept(request.id, len(tokens) - 1)
            if features is not None:  # the target kept `pending` and the accepted drafts
                self.drafter.observe(request.id, [pending, *tokens[:-1]], features[:len(tokens)])
            self.speculation.update(runs=1, drafted=len(draft.tokens), accepted=len(tokens) - 1)
            for token, row in zip(tokens, logprobs):
                if request.id not in self.running:
                    break
                self._emit(request, token, row)
        except Exception as err:
            self._fail(request, err)

    def _sample(self, requests: list[_Request], logits: Tensor) -> None:
        """Sample and emit each request's next token; a failure (non-finite logits, a processor, sampling or
        grammar error) ends that request alone."""
        logits = logits.float()
        if logits.shape[-1] > self.tokenizer.vocab_size:  # a padded vocabulary: ids the tokenizer cannot decode
            logits[:, self.tokenizer.vocab_size:] = float("-inf")
        finite = torch.isfinite(logits[:, : self.tokenizer.vocab_size]).all(-1).tolist()
        logprobs = logits.log_softmax(-1)
        greedy = logits.argmax(-1).tolist()
        for b, request in enumerate(requests):
            try:
                if not finite[b]:
                    raise FloatingPointError("the model produced non-finite logits for this request")
                self._emit(request, self._choose(request, logits[b], greedy[b]), logprobs[b])
            except Exception as err:
                self._fail(request, err)

    @staticmethod
    def _choose(request: _Request, row: Tensor, greedy: int) -> int:
        """The request's next token; its grammar applies once its output reaches the answer (``content``), so a
        thinking model reasons freely first."""
        p = request.params
        constraint = request.constraint if getattr(request.processor, "channel", "text") in ("text", "content") \
            else None
        if constraint is None and not p.processed and p.temperature == 0:
            return greedy
        token = choose(process(row, p, request.prompt, request.output_ids, constraint), p, request.generator)
        if constraint is not None:
            constraint.accept(token)
        return token

    def _fail(self, request: _Request, err: Exception) -> None:
        if request.id in self.running:
            self._finish(request, [], None, [], "error", f"{type(err).__name__}: {err}")

    # ------------------------------------------------------------------ outputs
    def _emit(self, request: _Request, token: int, logprobs: Tensor) -> None:
        p = request.params
        request.cumulative_logprob += float(logprobs[token])
        info = []
        if p.logprobs is not None:
            top = logprobs.topk(p.logprobs) if p.logprobs else None
            alternatives = () if top is None else tuple(zip(top.indices.tolist(), top.values.tolist()))
            info = [TokenLogprob(token, float(logprobs[token]), alternatives)]
        request.output_ids.append(token)
        stopped = token in p.stop_token_ids
        deltas, stopped = self._match_stops(request, request.processor.flush() if stopped
                                            else request.processor.feed(token), stopped)
        if stopped:
            return self._finish(request, deltas, token, info, "stop")
        if len(request.output_ids) >= p.max_tokens or request.state.position + 1 >= self.max_model_len:
            more, _ = self._match_stops(request, request.processor.flush(), False)
            return self._finish(request, deltas + more, token, info, "length")
        request.pending = token
        self._deliver(request, self._output(request, deltas, token, info, None))

    def _match_stops(self, request: _Request, deltas: list[tuple[str, str]],
                     stopped: bool) -> tuple[list[tuple[str, str]], bool]:
        """Pass deltas through the stop-string filter; True once a stop string matched (text cut before it)."""
        stops = request.params.stop
        out: list[tuple[str, str]] = []
        for channel, text in deltas:
            if request.held and request.held[0] != channel:
                out.append(request.held)
                request.held = None
            if not stops or channel not in STOP_CHANNELS:
                out.append((channel, text))
                continue
            text = (request.held[1] if request.held else "") + text
            request.held = None
            hits = [(i, -len(s)) for i, s in ((text.find(s), s) for s in stops) if i >= 0]
            if hits:
                at, length = min(hits)  # the first stop string in the text (the longest if several start there)
                out.append((channel, text[:at - length if request.params.include_stop_str_in_output else at]))
                return [d for d in out if d[1]], True
            keep = min(len(text), max(map(len, stops)) - 1)
            out.append((channel, text[:len(text) - keep]))
            if keep:
                request.held = (channel, text[len(text) - keep:])
        if stopped and request.held:
            out.append(request.held)
            request.held = None
        return [d for d in out if d[1]], stopped

    def _finish(self, request: _Request, deltas: list[tuple[str, str]], token: int | None,
                info: list[TokenLogprob], reason: str, error: str | None = None) -> None:
        if request.held and reason != "stop":
            deltas = deltas + [request.held]
        request.held = None
        self.running.pop(request.id, None)
        request.state = None
        self._release(request)
        self.finished[reason] += 1
        self._deliver(request, self._output(request, deltas, token, info, reason, error))

    def _release(self, request: _Request) -> None:
        if self.drafter is not None:
            self.drafter.end(request.id)
        if request.pins:
            self.prefix_cache.release(request.pins)
            request.pins = []

    def _deliver(self, request: _Request, output: Output) -> None:
        """Hand an output to the request's callback; a failing callback (a gone client) cancels the request."""
        try:
            request.callback(output)
        except Exception:
            if output.finish_reason is None:
                with self._queue_lock:
                    self._cancelled.add(request.id)

    @staticmethod
    def _output(request: _Request, deltas: list[tuple[str, str]], token: int | None, info: list[TokenLogprob],
                reason: str | None, error: str | None = None) -> Output:
        scored, request.prompt_logprobs = request.prompt_logprobs, None  # sent once
        if scored is not None and request.prefilled < len(request.prompt) and reason is None:
            request.prompt_logprobs, scored = scored, None  # not complete yet
        return Output(request.id, deltas, [] if token is None else [token], info, len(request.prompt),
                      len(request.output_ids), reason, error, scored, request.cumulative_logprob, request.cached)

    # ------------------------------------------------------------------ driving
    def start(self) -> Engine:
        """Run steps on a background thread whenever there is work."""
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="k3-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

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
