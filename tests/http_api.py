"""Shared pieces of the HTTP API tests: the served model name, a chat and tools to send, a standard-library
request, a server whose model emits a script (`serving.Scripted`), and a real `k3 serve` process."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlparse

import serving
from k3.chat import native as chat
from k3.serve.api.app import create_app
from k3.serve.asgi.server import BackgroundServer
from k3.serve.engine import Engine

MODEL = "k3-tiny"
HELLO = [{"role": "user", "content": "def load(path):"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def raw(url: str, method: str, path: str, body: bytes | None = None,
        headers: dict | None = None) -> tuple[int, dict]:
    """One HTTP request with the standard library; returns (status, JSON body)."""
    parts = urlparse(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    conn.request(method, path, body=body, headers={"content-type": "application/json", **(headers or {})})
    response = conn.getresponse()
    status, data = response.status, json.loads(response.read() or b"null")
    conn.close()
    return status, data


def scripted_server(script_text: list[str | int], fail_after: int | None = None):
    """A server whose model emits ``script_text`` (text pieces and special ids) after HELLO's thinking prompt."""
    tok = serving.tokenizer()
    script = [t for piece in script_text for t in ([piece] if isinstance(piece, int) else tok.encode(piece))]
    start = len(chat.render(HELLO, tok, "thinking", tools=TOOLS))
    engine = Engine(serving.Scripted(start, script, fail_after), tok).start()
    return engine, BackgroundServer(create_app(engine, MODEL))
