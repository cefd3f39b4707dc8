"""Shared pieces of the HTTP API tests: the served model name, a chat and tools to send, a standard-library
request, a server whose model emits a script (`serving.Scripted`), and a real `k3 serve` process."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from urllib.parse import urlparse

import serving
from gloo import free_port
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


def start_server(ckpt, *flags: str) -> tuple[subprocess.Popen, int]:
    """A real `k3 serve` process (API key "k") on a free port, once it answers."""
    port = free_port()
    command = [sys.executable, "-m", "k3.cli", "serve", "--ckpt", str(ckpt), "--port", str(port), "--api-key", "k",
               *flags]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert "model 'k3-tiny'" in proc.stdout.readline()
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc, port
        except OSError:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
