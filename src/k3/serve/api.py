"""An OpenAI-compatible HTTP API over the `Engine` (issues 5, 9): a FastAPI app behind its `Guard`.

Routes: ``POST /v1/chat/completions`` (`ChatCompletions`), ``POST /v1/completions`` (`Completions`),
``GET /v1/models``, ``GET /health``. Streaming uses Server-Sent Events in OpenAI's chunk shapes, ending
with ``data: [DONE]``. Errors carry OpenAI's body ``{"error": {"message", "type", "param", "code"}}``:
400 for invalid requests, naming the field (a prompt plus ``max_tokens`` beyond the context length is
``context_length_exceeded``), 401 for a missing or wrong bearer token (``--api-key``; checked before the
body is read), 404 for an unknown model, 408 for a body or a generation that takes too long, 413 for a
body over the size limit, 429 with ``Retry-After`` when the queue is full, 503 while shutting down; an
error after a stream started is sent as an ``event: error``. A client that disconnects cancels its
requests (the engine frees their state). The limits are `Limits` (README, "Limits").
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from k3.serve import chat
from k3.serve.chat_completions import ChatCompletions
from k3.serve.completions import Completions
from k3.serve.engine import Engine
from k3.serve.guard import Guard, Limits
from k3.serve.handler import Serving
from k3.serve.http import BackgroundServer
from k3.serve.protocol import MESSAGE_SCHEMA, APIError, ChatBody, CompletionBody, request_body, schemas

__all__ = ["APIError", "BackgroundServer", "Limits", "create_app"]


def create_app(engine: Engine, model_name: str, *, api_key: str | None = None, default_mode: str = "thinking",
               limits: Limits | None = None) -> Guard:
    """The API serving ``engine`` as model ``model_name`` (the engine must be `start`-ed): an ASGI app, the
    FastAPI app (``.app``) wrapped in the `Guard` that enforces ``limits`` and ``api_key``."""
    if default_mode not in chat.MODES:
        raise ValueError(f"default_mode: expected one of {chat.MODES}, got {default_mode!r}")
    limits = limits or Limits()
    serving = Serving(engine, model_name, limits, default_mode)
    app = FastAPI(title="kimi-k3", version="0.1.0")
    _errors(app)
    _routes(app, serving)
    _openapi(app, model_name)
    return Guard(app, limits, api_key)


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

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": serving.model_name, "object": "model", "created": serving.created,
                                            "owned_by": "kimi-k3", "max_model_len": engine.max_model_len}]}


def _openapi(app: FastAPI, model_name: str) -> None:
    """The OpenAPI document with the request bodies the routes parse themselves (``model`` can only be the
    served model; messages as the chat format accepts them)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            bodies = schemas(CompletionBody, ChatBody)
            for name in ("CompletionBody", "ChatBody"):
                bodies[name]["properties"]["model"]["enum"] = [model_name]
            bodies["ChatBody"]["properties"]["messages"] = {"type": "array", "minItems": 1, "items": MESSAGE_SCHEMA}
            document.setdefault("components", {}).setdefault("schemas", {}).update(bodies)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
