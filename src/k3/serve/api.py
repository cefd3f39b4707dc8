"""An OpenAI-compatible HTTP API over the `Engine` (issue 5): FastAPI app, served by uvicorn.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, ``GET /health``.
Streaming uses Server-Sent Events in OpenAI's chunk shapes, ending with ``data: [DONE]``; the chat
think channel streams as ``reasoning_content``. Errors carry OpenAI's body
``{"error": {"message", "type", "param", "code"}}``: 400 for invalid requests (a prompt plus
``max_tokens`` beyond the context length is ``context_length_exceeded``), 401 for a missing or wrong
bearer token (``--api-key``), 404 for an unknown model; an error after a stream started is sent as an
``event: error``. A client that disconnects cancels its requests (the engine frees their state).

Extensions beyond OpenAI's fields (as in vLLM): ``top_k``, ``stop_token_ids``, and for chat ``mode``
("thinking" | "instruct") or ``chat_template_kwargs: {"thinking": bool}``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.exceptions import HTTPException

from k3.serve import chat
from k3.serve.engine import ContextLengthExceeded, Engine, Output, Processor, SamplingParams

__all__ = ["APIError", "create_app", "BackgroundServer"]

class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _invalid(err: ValueError) -> APIError:
    """A ValueError whose message starts with ``field:`` → 400 naming that field."""
    if isinstance(err, ContextLengthExceeded):
        return APIError(400, str(err), param="max_tokens", code="context_length_exceeded")
    head = str(err).split(":", 1)[0]
    return APIError(400, str(err), param=head if head.replace("_", "").replace(".", "").isalnum() else None)


# ---------------------------------------------------------------------- request bodies
class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")  # other OpenAI fields are accepted when left at their defaults

    model: str
    max_tokens: StrictInt | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: StrictInt = 0
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] = []
    n: int = Field(default=1, strict=True, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None

    @property
    def include_usage(self) -> bool:
        """A streamed response ends with a usage chunk (and every chunk carries ``usage``)."""
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def unsupported(self) -> None:
        """Reject OpenAI features this server does not implement, rather than silently ignoring them."""
        extra = self.model_extra or {}
        for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0), ("logit_bias", None),
                              ("echo", False), ("best_of", 1), ("suffix", None), ("response_format", None)):
            value = extra.get(name, neutral)
            if value not in (neutral, None) and not (name == "response_format" and value == {"type": "text"}):
                raise APIError(400, f"{name}: not supported by this server (got {value!r})", param=name)

    def sampling(self, max_tokens: int, stop_ids: tuple[int, ...], logprobs: int | None) -> list[SamplingParams]:
        """One `SamplingParams` per choice; choice i samples with ``seed + i``."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return [SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                               top_k=self.top_k, seed=None if self.seed is None else self.seed + i, stop=stop,
                               stop_token_ids=stop_ids + tuple(self.stop_token_ids), logprobs=logprobs)
                for i in range(self.n)]


class CompletionBody(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None


class ChatBody(_Sampling):
    messages: list[dict[str, Any]]
    max_completion_tokens: StrictInt | None = None
    logprobs: bool = False
    top_logprobs: StrictInt | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    mode: Literal["thinking", "instruct"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# ---------------------------------------------------------------------- running requests
class _Jobs:
    """The engine requests behind one HTTP request: outputs arrive as ``(choice index, Output)``."""

    def __init__(self, engine: Engine, jobs: list[tuple[list[int], SamplingParams, Processor | None]]) -> None:
        self.engine = engine
        self.queue: asyncio.Queue[tuple[int, Output]] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self.ids: list[str] = []
        try:
            for i, (prompt, params, processor) in enumerate(jobs):
                def callback(output: Output, i: int = i) -> None:
                    loop.call_soon_threadsafe(self.queue.put_nowait, (i, output))

                self.ids.append(engine.add_request(prompt, params, processor=processor, callback=callback))
        except ValueError as err:
            self.close()
            raise _invalid(err) from err
        self.open = len(jobs)

    async def outputs(self, request: Request | None = None) -> AsyncIterator[tuple[int, Output]]:
        """Outputs until every job finished; with ``request``, a client found disconnected (checked every
        half second) ends it, cancelling the jobs."""
        checked = time.monotonic()
        try:
            while self.open:
                try:
                    i, output = await asyncio.wait_for(self.queue.get(), timeout=0.5)
                except TimeoutError:
                    output = None
                if request is not None and time.monotonic() - checked >= 0.5:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        return
                if output is not None:
                    self.open -= output.finish_reason is not None
                    yield i, output
        finally:
            self.close()

    def close(self) -> None:
        for request_id in self.ids:
            self.engine.abort(request_id, wait=False)


def _error_of(output: Output) -> APIError | None:
    if output.finish_reason == "error":
        return APIError(500, f"generation failed: {output.error}", type="server_error")
    if output.finish_reason == "abort":
        return APIError(503, "the request was cancelled by the server", type="server_error")
    return None


def _sse(data: dict | str, event: str | None = None) -> str:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return (f"event: {event}\n" if event else "") + f"data: {text}\n\n"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# ---------------------------------------------------------------------- the app
def create_app(engine: Engine, model_name: str, *, api_key: str | None = None,
               default_mode: str = "thinking") -> FastAPI:
    """The FastAPI app serving ``engine`` as model ``model_name``; the engine must be `start`-ed."""
    if default_mode not in chat.MODES:
        raise ValueError(f"default_mode: expected one of {chat.MODES}, got {default_mode!r}")
    tokenizer = engine.tokenizer
    created = int(time.time())
    app = FastAPI(title="kimi-k3", version="0.1.0")

    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            message, param = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}", None
        else:  # name the top-level field (deeper locations include pydantic's union-member tags)
            param = loc[0] if loc else None
            message = f"{param}: {first['msg']}" if param else first["msg"]
        return JSONResponse(APIError(400, message, param=param).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, err: HTTPException) -> JSONResponse:
        return JSONResponse(APIError(err.status_code, str(err.detail)).body(), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def server_error(_: Request, err: Exception) -> JSONResponse:
        return JSONResponse(APIError(500, f"{type(err).__name__}: {err}", type="server_error").body(), 500)

    def authorize(request: Request) -> None:
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            raise APIError(401, "invalid or missing API key (expected 'Authorization: Bearer <key>')",
                           code="invalid_api_key")

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{model_name}`.",
                           param="model", code="model_not_found")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "running": len(engine.running), "waiting": engine.num_waiting,
                "finished": dict(engine.finished)}

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "kimi-k3", "max_model_len": engine.max_model_len}]}

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: CompletionBody, request: Request):
        check_model(body.model)
        body.unsupported()
        prompts = _prompts(body.prompt, tokenizer.encode)
        jobs = []
        for prompt in prompts:
            max_tokens = body.max_tokens if body.max_tokens is not None else max(1, engine.max_model_len - len(prompt))
            for params in body.sampling(max_tokens, (tokenizer.eos_id,), body.logprobs):
                jobs.append((prompt, params, None))
        run = _Jobs(engine, jobs)
        rid = f"cmpl-{uuid.uuid4().hex}"
        completion_tokens = [0] * len(jobs)
        prompt_tokens = sum(map(len, prompts))

        def logprobs(output: Output, offset: int) -> dict | None:
            """The output's token log-probabilities; ``offset`` is where its text starts in the choice's text."""
            if body.logprobs is None:
                return None
            return {"tokens": [tokenizer.decode([t.token_id]) for t in output.logprobs],
                    "token_logprobs": [t.logprob for t in output.logprobs],
                    "top_logprobs": [{tokenizer.decode([i]): lp for i, lp in t.top} for t in output.logprobs],
                    "text_offset": [offset] * len(output.logprobs)}

        def chunk(choices: list[dict], usage: dict | None = None) -> dict:
            out = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                   "choices": choices}
            if usage is not None or body.include_usage:
                out["usage"] = usage
            return out

        if body.stream:
            async def events() -> AsyncIterator[str]:
                sent = [0] * len(jobs)  # characters streamed per choice
                async for i, output in run.outputs():
                    completion_tokens[i] = output.completion_tokens
                    if (err := _error_of(output)) is not None:
                        yield _sse(err.body(), "error")
                        return
                    text = "".join(t for _, t in output.deltas)
                    if text or output.finish_reason or body.logprobs is not None:
                        yield _sse(chunk([{"index": i, "text": text, "logprobs": logprobs(output, sent[i]),
                                           "finish_reason": output.finish_reason}]))
                    sent[i] += len(text)
                if body.include_usage:
                    yield _sse(chunk([], _usage(prompt_tokens, sum(completion_tokens))))
                yield _sse("[DONE]")

            return StreamingResponse(events(), media_type="text/event-stream")

        texts, finish, lps = [""] * len(jobs), [None] * len(jobs), [{} for _ in jobs]
        async for i, output in run.outputs(request):
            if (err := _error_of(output)) is not None:
                raise err
            completion_tokens[i] = output.completion_tokens
            _extend(lps[i], logprobs(output, len(texts[i])))
            texts[i] += "".join(t for _, t in output.deltas)
            finish[i] = output.finish_reason
        choices = [{"index": i, "text": texts[i], "logprobs": lps[i] if body.logprobs is not None else None,
                    "finish_reason": finish[i]} for i in range(len(jobs))]
        return chunk(choices, _usage(prompt_tokens, sum(completion_tokens)))

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(body: ChatBody, request: Request):
        check_model(body.model)
        body.unsupported()
        if body.tool_choice not in (None, "auto", "none"):
            raise APIError(400, f"tool_choice: only 'auto' and 'none' are supported (got {body.tool_choice!r})",
                           param="tool_choice")
        mode = body.mode or default_mode
        if body.chat_template_kwargs and "thinking" in body.chat_template_kwargs:
            mode = "thinking" if body.chat_template_kwargs["thinking"] else "instruct"
        tools = None if body.tool_choice == "none" else body.tools
        try:
            prompt = chat.render(body.messages, tokenizer, mode, tools)
        except ValueError as err:
            raise APIError(400, str(err), param="messages") from err
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = requested if requested is not None else max(1, engine.max_model_len - len(prompt))
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
            raise APIError(400, f"top_logprobs: expected an integer in [0, 20], got {body.top_logprobs}",
                           param="top_logprobs")
        top = (body.top_logprobs or 0) if body.logprobs else None
        stop_ids = (tokenizer.special_id("end"), tokenizer.eos_id)
        run = _Jobs(engine, [(prompt, params, chat.AssistantParser(tokenizer, mode))
                             for params in body.sampling(max_tokens, stop_ids, top)])
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        completion_tokens = [0] * body.n

        def logprobs(output: Output) -> dict | None:
            if not body.logprobs:
                return None
            return {"content": [_chat_logprob(tokenizer.decode, t.token_id, t.logprob, t.top)
                                for t in output.logprobs]}

        def chunk(choices: list[dict], usage: dict | None = None) -> dict:
            out = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                   "model": model_name, "choices": choices}
            if body.include_usage:
                out["usage"] = usage
            return out

        if body.stream:
            async def events() -> AsyncIterator[str]:
                tool_text = [""] * body.n
                for i in range(body.n):
                    yield _sse(chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None}]))
                async for i, output in run.outputs():
                    completion_tokens[i] = output.completion_tokens
                    if (err := _error_of(output)) is not None:
                        yield _sse(err.body(), "error")
                        return
                    for channel, text in output.deltas:
                        if channel == "tools":
                            tool_text[i] += text
                        else:
                            key = "reasoning_content" if channel == "reasoning" else "content"
                            yield _sse(chunk([{"index": i, "delta": {key: text}, "logprobs": None,
                                               "finish_reason": None}]))
                    if body.logprobs and output.logprobs:
                        yield _sse(chunk([{"index": i, "delta": {}, "logprobs": logprobs(output),
                                           "finish_reason": None}]))
                    if output.finish_reason is not None:
                        calls, reason = _tool_calls(tool_text[i], output.finish_reason)
                        delta = ({"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]} if calls
                                 else {"content": tool_text[i]} if tool_text[i] else {})
                        yield _sse(chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": reason}]))
                if body.include_usage:
                    yield _sse(chunk([], _usage(len(prompt), sum(completion_tokens))))
                yield _sse("[DONE]")

            return StreamingResponse(events(), media_type="text/event-stream")

        parts = [{"reasoning": "", "content": "", "tools": ""} for _ in range(body.n)]
        finish: list[str | None] = [None] * body.n
        lps: list[dict[str, list]] = [{} for _ in range(body.n)]
        async for i, output in run.outputs(request):
            if (err := _error_of(output)) is not None:
                raise err
            completion_tokens[i] = output.completion_tokens
            for channel, text in output.deltas:
                parts[i][channel] += text
            finish[i] = output.finish_reason
            _extend(lps[i], logprobs(output))
        choices = []
        for i, p in enumerate(parts):
            calls, reason = _tool_calls(p["tools"], finish[i])
            message = {"role": "assistant", "content": p["content"] + (p["tools"] if calls is None else ""),
                       "reasoning_content": p["reasoning"] if mode == "thinking" else None, "tool_calls": calls}
            choices.append({"index": i, "message": message, "logprobs": lps[i] if body.logprobs else None,
                            "finish_reason": reason})
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_name,
                "choices": choices, "usage": _usage(len(prompt), sum(completion_tokens))}

    return app


# ---------------------------------------------------------------------- helpers
def _prompts(prompt: str | list, encode: Callable[[str], list[int]]) -> list[list[int]]:
    """The completions ``prompt`` field (text, token ids, or a list of either) as token-id lists."""
    if isinstance(prompt, str):
        prompts = [encode(prompt)]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    else:
        prompts = [encode(p) if isinstance(p, str) else list(p) for p in prompt]
    if not prompts or not all(prompts):
        raise APIError(400, "prompt: must be non-empty (an empty text encodes to no tokens)", param="prompt")
    return prompts


def _extend(merged: dict[str, list], part: dict[str, list] | None) -> None:
    """Append a logprobs part to the merged one (each list extended)."""
    for key, value in (part or {}).items():
        merged.setdefault(key, []).extend(value)


def _chat_logprob(decode: Callable[[list[int]], str], token: int, logprob: float,
                  top: tuple[tuple[int, float], ...]) -> dict:
    def entry(t: int, lp: float) -> dict:
        text = decode([t])
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {**entry(token, logprob), "top_logprobs": [entry(t, lp) for t, lp in top]}


def _tool_calls(tool_text: str, finish_reason: str | None) -> tuple[list[dict] | None, str | None]:
    """The tools channel parsed to OpenAI tool calls (finish reason "tool_calls"), or None (kept as content)."""
    calls = chat.parse_tool_calls(tool_text) if tool_text else None
    return (calls, "tool_calls") if calls else (None, finish_reason)


class BackgroundServer:
    """Serve an app with uvicorn on a background thread (tests, benchmarks); port 0 picks a free port."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.url = f"http://{host}:{self.socket.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the server at {self.url} did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.socket.close()
