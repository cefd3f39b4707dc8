"""What the route families share: the engine, the served model's name, the limits, and the request steps
that must happen off the event loop or before any expensive work (issue 9).

CPU work — parsing and validating the body, tokenizing, rendering a conversation — runs in the thread
pool, so one large request never stalls `/health` or other clients' streams. Before tokenizing, a cheap
bound refuses prompts that cannot fit: text of ``n`` characters has at least ``n / max_token_bytes``
tokens, so a prompt whose bound already exceeds the context is a 400 ``context_length_exceeded`` in
O(1), however many megabytes it is.

Answers are bounded before any work starts and built off the event loop (issue 35): a request whose answer would
hold more log-probability entries than `Limits.max_logprob_entries` is a 400 naming the field that asks for most
(`check_logprobs`); an output carrying a prompt's log-probabilities is turned into events in the thread pool, and
whole answers are serialised there (`json_response`). Conversations with images are rendered (their images
decoded) by at most `Limits.max_image_decodes` requests at once (`decoding`); the others wait without a thread.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from k3.tokenization.image import VisualInput
from k3.serve.engine import Engine, Output, Processor, SamplingParams
from k3.serve.asgi.guard import Limits
from k3.serve.api.images import ImageParts, has_images
from k3.serve.api.jobs import Jobs, error_of
from k3.serve.api.encoding import dumps
from k3.serve.api.metrics import Metrics
from k3.serve.api.protocol import APIError, parse_body, sse, usage

__all__ = ["Reply", "Route", "Serving", "json_response", "logprob_entries", "offload"]

B = TypeVar("B", bound=BaseModel)
R = TypeVar("R")


def logprob_entries(tokens: int, top: int | None) -> int:
    """Log-probability entries of ``tokens`` scored with ``top`` alternatives each (None: not scored)."""
    return 0 if top is None else tokens * (top + 1)


async def offload(heavy: bool, fn: Callable[..., R], *args: Any) -> R:
    """``fn(*args)``, in the thread pool when ``heavy`` (work that grows with a prompt), else at once."""
    return await run_in_threadpool(fn, *args) if heavy else fn(*args)


async def json_response(body: dict) -> Response:
    """``body`` as a JSON response, encoded in pieces in the thread pool (an answer of many megabytes stalls
    neither the event loop nor, holding the GIL, its other threads)."""
    text = await run_in_threadpool(dumps, body, False)
    return Response(text.encode(), media_type="application/json")


class Serving:
    """Shared state and steps of the chat and completion handlers."""

    def __init__(self, engine: Engine, model_name: str, limits: Limits, default_mode: str = "instruct",
                 separate_reasoning: bool = True) -> None:
        self.engine, self.model_name, self.limits, self.default_mode = engine, model_name, limits, default_mode
        self.separate_reasoning = separate_reasoning
        self.metrics = Metrics(engine)
        self.tokenizer = engine.tokenizer
        self.created = int(time.time())
        self.decodes = asyncio.Semaphore(limits.max_image_decodes)
        self.compiling = asyncio.Lock()  # one grammar compile at a time; waiters hold no worker thread

    async def body(self, request: Request, model: type[B]) -> B:
        """The request's JSON body validated as ``model`` (in a worker thread)."""
        raw = await request.body()
        body = await run_in_threadpool(parse_body, raw, model)
        if body.model is not None and body.model != self.model_name:  # optional only for tokenizer requests
            raise APIError(404, f"The model `{body.model}` does not exist; this server serves `{self.model_name}`.",
                           param="model", code="model_not_found")
        body.unsupported()
        return body

    def encode_prompt(self, text: str) -> list[int]:
        """A text prompt's ids, by the one rule of ``/v1/completions`` and ``/tokenize`` (vLLM's, whose Hugging Face
        tokenizers parse special tokens in text): special-token literals (``<|eos|>``) become their ids and nothing
        is added around the text. Chat content, rendered by the chat format, never yields special ids."""
        return self.tokenizer.encode(text, True)

    def check_chars(self, chars: int, param: str) -> None:
        """Refuse, without tokenizing, text that has more tokens than the context holds (module docstring)."""
        least = -(-chars // self.tokenizer.max_token_bytes)
        if least > self.engine.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.engine.max_model_len} tokens. "
                                f"However, your {param} has {chars} characters, which is at least {least} tokens. "
                                f"Please reduce the {param}.", param=param, code="context_length_exceeded")

    def check_messages(self, messages: list) -> None:
        """`check_chars` for a conversation: the characters of its messages' text content."""
        self.check_chars(sum(map(_content_chars, messages)), "messages")

    def check_choices(self, count: int) -> None:
        if count > self.limits.max_choices:
            raise APIError(400, f"n: this request asks for {count} generations (prompts × n); this server allows "
                                f"at most {self.limits.max_choices} per request", param="n")

    def check_logprobs(self, entries: dict[str, int]) -> None:
        """Refuse a request whose answer would hold more log-probability entries than the server allows; ``entries``
        maps each field asking for some to their number over every choice (`logprob_entries`). The 400 names the
        field asking for most."""
        total, limit = sum(entries.values()), self.limits.max_logprob_entries
        if total > limit:
            param = max(entries, key=entries.__getitem__)
            asked = ", ".join(f"{name} {count:,}" for name, count in entries.items() if count)
            raise APIError(400, f"{param}: this request asks for {total:,} log-probability entries (a token or an "
                                f"alternative, over every choice: {asked}); this server returns at most {limit:,} per "
                                f"request. Ask for fewer tokens (max_tokens), alternatives or choices", param=param)

    def max_tokens(self, requested: int | None, prompt_tokens: int) -> int:
        """``requested``, or what the context leaves after the prompt (at least 1)."""
        return requested if requested is not None else max(1, self.engine.max_model_len - prompt_tokens)

    async def constraint(self, schema: dict | None, stop_ids: tuple[int, ...], param: str) -> Callable[[], Any]:
        """A grammar-matcher factory for JSON (``schema`` None: any object) from the engine's cache, else compiled
        under its budget off the event loop, one at a time (`k3.serve.engine.structured`); an unusable schema is a
        400 naming ``param``."""
        grammars = self.engine.grammars
        try:
            factory = await run_in_threadpool(grammars.cached, schema, stop_ids)
            if factory is None:
                async with self.compiling:
                    factory = await run_in_threadpool(grammars.constraint, schema, stop_ids)
        except ValueError as err:
            raise APIError(400, f"{param}: {err}", param=param) from err
        return factory

    def submit(self, jobs: list[tuple[list[int], SamplingParams, Processor | None]],
               images: list[VisualInput] | None = None, marks: tuple[int, ...] = ()) -> Jobs:
        """Queue the request's jobs as one group, with the server's request timeout; ``images`` fill the prompt's
        media placeholders, ``marks`` are prompt positions worth a prefix-cache checkpoint."""
        return Jobs(self.engine, jobs, group=uuid.uuid4().hex, timeout=self.limits.request_timeout,
                    timer=self.metrics.timer(), images=images, marks=marks)

    def image_parts(self) -> ImageParts | None:
        """A collector for a request's ``image_url`` parts, if the model has a vision encoder."""
        if self.engine.model.vision is None:
            return None
        return ImageParts(self.engine.model.config.vision.patch_budget, self.limits.max_images,
                          self.limits.max_decoded_image_bytes)

    @asynccontextmanager
    async def decoding(self, messages: Any) -> AsyncIterator[None]:
        """One of the server's image-decoding slots, held while a conversation with images is rendered (a
        conversation without images passes at once)."""
        if not has_images(messages):
            yield
            return
        async with self.decodes:
            yield


def _content_chars(message: Any) -> int:
    """Characters of a message's text content (what is certainly encoded as text; for the cheap bound)."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


class Route:
    """A route family: an async callable over the shared `Serving`."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        self.tokenizer = serving.tokenizer


class Reply:
    """What the responses of one request share: id, creation time, model, and usage per choice."""

    OBJECT = PREFIX = ""  # OpenAI's object name of a (streamed) response, and the id prefix
    grammar: str | None = None  # the request field whose grammar constrains the output, if any

    def __init__(self, model_name: str, body: Any, choices: int, prompt_tokens: int) -> None:
        self.model_name, self.body = model_name, body
        self.id, self.created = f"{self.PREFIX}-{uuid.uuid4().hex}", int(time.time())
        self.completion_tokens = [0] * choices
        self.cached = [0] * choices  # prompt tokens each choice resumed from the prefix cache
        self.per_prompt = choices  # choices that share one prompt (completions with several prompts: n)
        self.prompt_tokens = prompt_tokens

    def chunk(self, choices: list[dict], usage_: dict | None = None, object_: str | None = None) -> dict:
        """A response object; ``usage`` is present when given, and in every chunk of a stream that asked for it."""
        out = {"id": self.id, "object": object_ or self.OBJECT, "created": self.created, "model": self.model_name,
               "choices": choices}
        if usage_ is not None or self.body.include_usage:
            out["usage"] = usage_
        return out

    def record(self, index: int, output: Output) -> None:
        """Count an output of choice ``index`` for ``usage``."""
        self.completion_tokens[index] = output.completion_tokens
        self.cached[index] = output.cached_tokens

    def usage(self) -> dict:
        k = self.per_prompt
        cached = sum(max(self.cached[i:i + k]) for i in range(0, len(self.cached), k))
        return usage(self.prompt_tokens, sum(self.completion_tokens), cached)

    def opening(self) -> list[str]:
        """SSE events sent before any output."""
        return []

    def heavy(self, index: int, output: Output) -> bool:
        """Whether turning an output into a response grows with the prompt (then it is done off the event loop)."""
        return output.prompt_logprobs is not None

    def events(self, index: int, output: Output) -> list[str]:
        """SSE events for one output of choice ``index``."""
        raise NotImplementedError

    async def stream(self, run: Jobs) -> AsyncIterator[str]:
        """The SSE stream: `opening`, `events` per output, an error event when a choice fails or the
        request times out, the usage chunk when asked for, then ``[DONE]``."""
        for event in self.opening():
            yield event
        try:
            async for i, output in run.outputs():
                self.record(i, output)
                if (err := error_of(output, self.grammar)) is not None:
                    yield sse(err.body(), "error")
                    return
                for event in await offload(self.heavy(i, output), self.events, i, output):
                    yield event
        except APIError as err:  # the request timed out
            yield sse(err.body(), "error")
            return
        if self.body.include_usage:
            yield sse(self.chunk([], self.usage()))
        yield sse("[DONE]")
