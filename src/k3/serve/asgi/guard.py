"""The server's limits and the ASGI middleware that enforces them before any route runs.

In order, for every HTTP request: a draining server (SIGTERM received) answers 503; a server with an API
key checks ``Authorization: Bearer <key>`` (scheme case-insensitive, constant-time comparison) before the
body is read — `/health` and the chat page (``/``, ``/static/*``: a browser navigation cannot send a token;
the page sends the key its user types) are always open, `/docs` (with its assets, ``/docs/*``) and
`/openapi.json` only with ``public_docs``; a body is read in full before the route sees it, refused with 413
when it exceeds ``max_body_bytes`` (at once when ``Content-Length`` says it is more than twice that; a smaller
excess is read and discarded first, so the client is not reset mid-send) and with 408 when it takes longer
than ``body_timeout`` to arrive. A Server-Sent Events stream that is still running when the server, draining,
cancels it ends with an ``event: error`` (OpenAI's error body, code ``shutting_down``) and ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Limits", "Guard", "error_body", "send_json", "sse_error"]

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DOCS_PATHS, DOCS_PREFIX = ("/docs", "/openapi.json"), "/docs/"
OPEN_PATHS, OPEN_PREFIX = ("/health", "/"), "/static/"
FINAL_EVENT_SECONDS = 1.0  # how long a cancelled stream's closing events may wait for a slow reader


@dataclass(frozen=True)
class Limits:
    """What one client may ask of the server (README, "Limits")."""

    max_body_bytes: int = 16 * 2**20  # request body size (413 beyond)
    max_choices: int = 64  # prompts × n in one request (400 beyond)
    header_timeout: float = 10.0  # seconds for a connection to send a request's headers (closed after)
    body_timeout: float = 30.0  # seconds for a request body to arrive in full (408 after)
    keep_alive_timeout: float = 5.0  # idle seconds before a keep-alive connection is closed
    request_timeout: float | None = 600.0  # seconds for a generation to finish (408 after, work cancelled)
    max_connections: int = 512  # connections served at once (503 beyond; /health is always answered)
    max_connections_per_client: int = 128  # connections from one peer address (429 beyond)
    drain_timeout: float = 30.0  # seconds a SIGTERM waits for running requests before cancelling them
    public_docs: bool = False  # serve /docs and /openapi.json without the API key
    max_images: int = 8  # image_url parts in one request (400 beyond)
    # bounded answers and decoding (issue 35): log-probability entries (a token or an alternative) in one request's
    # answer, over every choice; decoded image bytes per request (pixels plus their RGB(A) copy); decodes at once
    max_logprob_entries: int = 2**18  # (400 beyond)
    max_decoded_image_bytes: int = 256 * 2**20  # (400 beyond, refused from the image's header)
    max_image_decodes: int = 2  # requests decoding images at once, across all requests (the others wait)

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_choices", "max_connections", "max_connections_per_client", "max_images",
                     "max_logprob_entries", "max_decoded_image_bytes", "max_image_decodes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive integer, got {getattr(self, name)!r}")
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout", "request_timeout", "drain_timeout"):
            value = getattr(self, name)
            if not (value is None and name == "request_timeout") and not (isinstance(value, int | float) and value > 0):
                raise ValueError(f"{name}: expected a positive number of seconds, got {value!r}")


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error body (the one shape of every error this server answers)."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


async def send_json(send: Send, status: int, body: dict, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """A whole JSON response on a raw ASGI ``send``."""
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": data})


def sse_error(body: dict) -> bytes:
    """An ``event: error`` of a Server-Sent Events stream carrying ``body``."""
    return f"event: error\ndata: {json.dumps(body)}\n\n".encode()


async def _reply(send: Send, status: int, message: str, type_: str, code: str,
                 headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    await send_json(send, status, error_body(message, type_, code=code), headers)


class Guard:
    """ASGI middleware: draining, authentication and bounded body reading (see the module docstring)."""

    def __init__(self, app: ASGIApp, limits: Limits, api_key: str | None = None) -> None:
        if api_key is not None and not api_key.strip():  # it would let an empty bearer token in
            raise ValueError("api_key: empty; pass None for a server without a key")
        self.app, self.limits, self.api_key = app, limits, api_key
        self.draining = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.draining:
            return await _reply(send, 503, "the server is shutting down", "server_error", "shutting_down",
                                ((b"connection", b"close"),))
        if not self._authorized(scope):
            return await _reply(send, 401, "invalid or missing API key (expected 'Authorization: Bearer <key>')",
                                "invalid_request_error", "invalid_api_key", ((b"www-authenticate", b"Bearer"),))
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return await _reply(send, 400, "Content-Length is not a number", "invalid_request_error",
                                    "bad_content_length")
            if int(length) > 2 * self.limits.max_body_bytes:  # too much to drain: answer at once
                return await self._too_large(send, int(length))
        if scope["method"] in ("GET", "HEAD", "OPTIONS") and length is None and b"transfer-encoding" not in headers:
            return await self._respond(scope, receive, send)
        body = await self._read_body(receive, send)
        if body is None:
            return
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self._respond(scope, replay, send)

    async def _respond(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the app; when the drain cancels it mid-stream, end the stream properly (module docstring)."""
        streaming = False

        async def watched(message: Message) -> None:
            nonlocal streaming
            if message["type"] == "http.response.start":
                streaming = dict(message.get("headers", ())).get(b"content-type", b"").startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                streaming = False
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except asyncio.CancelledError:
            if not (streaming and self.draining):
                raise
            asyncio.current_task().uncancel()  # handled here: the closing events below may still be awaited
            ending = sse_error(error_body(f"the server shut down before this stream finished (it lets streams run "
                                          f"{self.limits.drain_timeout:g} s after SIGTERM: --drain-timeout)",
                                          "server_error", code="shutting_down")) + b"data: [DONE]\n\n"
            with contextlib.suppress(TimeoutError, OSError, RuntimeError):
                await asyncio.wait_for(send({"type": "http.response.body", "body": ending}), FINAL_EVENT_SECONDS)
            # The response is complete and the server is stopping: the cancellation has done its work.

    def _authorized(self, scope: Scope) -> bool:
        path = scope["path"]
        if self.api_key is None or path in OPEN_PATHS or path.startswith(OPEN_PREFIX):
            return True
        if self.limits.public_docs and (path in DOCS_PATHS or path.startswith(DOCS_PREFIX)):
            return True
        value = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = value.strip().partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    async def _read_body(self, receive: Receive, send: Send) -> bytes | None:
        """The whole body, or None after answering 413 / 408 (or when the client left). A body over the
        limit is read on and discarded, up to as much again, before the 413: a client still sending when
        the connection closes would see a reset instead of the answer."""
        chunks, size = [], 0
        deadline = time.monotonic() + self.limits.body_timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), timeout=max(deadline - time.monotonic(), 0))
            except TimeoutError:
                await _reply(send, 408, f"the request body did not arrive within {self.limits.body_timeout:g} s",
                             "invalid_request_error", "request_timeout", ((b"connection", b"close"),))
                return None
            if message["type"] == "http.disconnect":
                return None
            chunk, more = message.get("body", b""), message.get("more_body", False)
            size += len(chunk)
            if size > self.limits.max_body_bytes:
                chunks = []  # discard
                if not more or size > 2 * self.limits.max_body_bytes:
                    await self._too_large(send, size, at_least=more)
                    return None
            else:
                chunks.append(chunk)
            if not more:
                return b"".join(chunks)

    async def _too_large(self, send: Send, size: int, at_least: bool = False) -> None:
        await _reply(send, 413, f"the request body is {'over ' if at_least else ''}{size} bytes; this server accepts "
                                f"at most {self.limits.max_body_bytes} (--max-body-mb)",
                     "invalid_request_error", "request_too_large", ((b"connection", b"close"),))
