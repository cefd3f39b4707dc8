"""An OpenAI-compatible HTTP API over the `Engine` (issues 5, 9): a FastAPI app behind its `Guard`.

Routes: ``POST /v1/chat/completions`` (`ChatCompletions`), ``POST /v1/completions`` (`Completions`), ``GET
/v1/models`` and ``/v1/models/{id}``, ``POST /tokenize`` / ``/detokenize`` and ``GET /tokenizer_info`` (vLLM's,
`k3.serve.api.tokenize`), ``GET /version``, ``GET /health``, ``GET /metrics`` (Prometheus, `k3.serve.api.metrics`), the
chat page ``/`` and ``/docs`` (`k3.serve.api.pages`). Streaming uses Server-Sent Events in OpenAI's chunk shapes,
ending with ``data: [DONE]``. Errors carry OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400
for invalid requests, naming the field (a prompt plus ``max_tokens`` beyond the context length is
``context_length_exceeded``), 401 for a missing or wrong bearer token (``--api-key``; checked before the body is
read), 404 for an unknown model, 408 for a body or a generation that takes too long, 413 for a body over the size
limit, 429 with ``Retry-After`` when the queue is full, 503 while shutting down; an error after a stream started is
sent as an ``event: error``. A client that disconnects cancels its requests (the engine frees their state). The
limits are `Limits` (README, "Limits").
"""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from k3 import __version__

from k3.chat import native as chat
from k3.serve.api.chat import ChatCompletions
from k3.serve.api.completions import Completions
from k3.serve.engine import Engine
from k3.serve.asgi.guard import Guard, Limits
from k3.serve.api.serving import Serving
from k3.serve.asgi.server import BackgroundServer
from k3.serve.api.pages import add_pages
from k3.serve.api.protocol import (MESSAGE_SCHEMA, TOOL_SCHEMA, APIError, ChatBody, CompletionBody, request_body,
                                   schemas)
from k3.serve.api.tokenize import Detokenize, DetokenizeBody, Tokenize, TokenizeBody, tokenizer_info

__all__ = ["APIError", "BackgroundServer", "Limits", "create_app"]


def create_app(engine: Engine, model_name: str, *, api_key: str | None = None, default_mode: str = "instruct",
               limits: Limits | None = None, separate_reasoning: bool = True,
               allowed_origins: Sequence[str] = ()) -> Guard | CORSMiddleware:
    """The API serving ``engine`` as model ``model_name`` (the engine must be `start`-ed): an ASGI app, the
    FastAPI app (``.app``) wrapped in the `Guard` that enforces ``limits`` and ``api_key``, itself wrapped in
    CORS handling (whose ``.app`` is the guard) when ``allowed_origins`` is not empty (``"*"``: any origin) —
    outside the guard, so a browser's preflight ``OPTIONS`` (which carries no credentials) is answered before
    authentication.

    ``default_mode`` is instruct: the answer is in ``content`` straight away, which is what tools that ignore
    ``reasoning_content`` read; thinking is one request field away (``mode``, ``chat_template_kwargs.thinking``).
    ``separate_reasoning=False`` puts thinking into ``content`` as ``<think>…</think>`` by default."""
    if default_mode not in chat.MODES:
        raise ValueError(f"default_mode: expected one of {chat.MODES}, got {default_mode!r}")
    limits = limits or Limits()
    serving = Serving(engine, model_name, limits, default_mode, separate_reasoning)
    app = FastAPI(title="kimi-k3", version="0.1.0", docs_url=None, redoc_url=None)
    _errors(app)
    _routes(app, serving)
    add_pages(app)
    _openapi(app, model_name)
    guard = Guard(app, limits, api_key)
    if not allowed_origins:
        return guard
    return CORSMiddleware(guard, allow_origins=list(allowed_origins), allow_methods=["GET", "POST", "OPTIONS"],
                          allow_headers=["Authorization", "Content-Type"], max_age=600)


def _errors(app: FastAPI) -> None:
    """Every error as OpenAI's error body; nothing escapes as a traceback."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in first.get("loc", ())]
        message = f"{'.'.join(loc)}: {first['msg']}" if loc else first["msg"]
        return JSONResponse(APIError(400, message, param=loc[-1] if loc else None).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, err: HTTPException) -> JSONResponse:
        return JSONResponse(APIError(err.status_code, str(err.detail)).body(), status_code=err.status_code,
                            headers=err.headers)

    @app.exception_handler(Exception)
    async def server_error(_: Request, err: Exception) -> JSONResponse:
        return JSONResponse(APIError(500, f"{type(err).__name__}: {err}", type="server_error").body(), 500)


def _routes(app: FastAPI, serving: Serving) -> None:
    engine = serving.engine
    app.add_api_route("/v1/completions", Completions(serving), methods=["POST"], response_model=None,
                      openapi_extra=request_body(CompletionBody), summary="Create a completion")
    app.add_api_route("/v1/chat/completions", ChatCompletions(serving), methods=["POST"], response_model=None,
                      openapi_extra=request_body(ChatBody), summary="Create a chat completion")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "running": len(engine.running), "waiting": engine.num_waiting,
                "finished": dict(engine.finished)}

    app.add_api_route("/tokenize", Tokenize(serving), methods=["POST"], response_model=None,
                      openapi_extra=request_body(TokenizeBody), summary="Tokenize a prompt or a conversation")
    app.add_api_route("/detokenize", Detokenize(serving), methods=["POST"], response_model=None,
                      openapi_extra=request_body(DetokenizeBody), summary="Token ids to text")
    model = {"id": serving.model_name, "object": "model", "created": serving.created, "owned_by": "kimi-k3",
             "max_model_len": engine.max_model_len}

    @app.get("/tokenizer_info")
    async def info() -> dict:
        return tokenizer_info(serving.tokenizer, engine.max_model_len)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model]}

    @app.get("/v1/models/{model_id:path}")
    async def model_by_id(model_id: str) -> dict:
        if model_id != serving.model_name:
            raise APIError(404, f"The model `{model_id}` does not exist; this server serves `{serving.model_name}`.",
                           param="model", code="model_not_found")
        return model

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _openapi(app: FastAPI, model_name: str) -> None:
    """The OpenAPI document with the request bodies the routes parse themselves (``model`` can only be the
    served model; messages as the chat format accepts them)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            bodies = schemas(CompletionBody, ChatBody, TokenizeBody, DetokenizeBody)
            for name in ("CompletionBody", "ChatBody"):
                bodies[name]["properties"]["model"]["enum"] = [model_name]
            bodies["ChatBody"]["properties"]["messages"] = {"type": "array", "minItems": 1, "items": MESSAGE_SCHEMA}
            for name in ("ChatBody", "TokenizeBody"):
                bodies[name]["properties"]["tools"] = {"anyOf": [{"type": "array", "items": TOOL_SCHEMA},
                                                                 {"type": "null"}]}
            document.setdefault("components", {}).setdefault("schemas", {}).update(bodies)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
