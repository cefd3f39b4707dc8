"""The server under load (issue 35), against a real server on loopback: `/health` is answered while every
connection slot is held, one client address cannot take every slot, and slow clients are cut by the header and
body deadlines while others are served. Clients come from distinct loopback addresses (127.0.0.2, 127.0.0.3 …:
Linux routes all of 127/8 to the loopback interface)."""

from __future__ import annotations

import json
import select
import socket
import time
from urllib.parse import urlparse

import pytest

import serving
from k3.serve.api.app import BackgroundServer, Limits, create_app
from k3.serve.engine import Engine

MODEL = "k3-tiny"
COMPLETION = json.dumps({"model": MODEL, "prompt": "def f(x):", "max_tokens": 2, "temperature": 0}).encode()
HELD_HEAD = b"GET /v1/models HTTP/1.1\r\nhost: x\r\n"  # a request head that never completes


@pytest.fixture(scope="module")
def engine():
    engine = Engine(serving.model(), serving.tokenizer(), max_model_len=256).start()
    yield engine
    engine.stop()


def connect(url: str, source: str) -> socket.socket:
    """A connection to the server at ``url`` from the loopback address ``source``."""
    parts = urlparse(url)
    s = socket.create_connection((parts.hostname, parts.port), timeout=10, source_address=(source, 0))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def read_response(s: socket.socket) -> tuple[int, dict, dict]:
    """Read one whole response (the server closes the connection after it, or sends Content-Length):
    (status, lower-cased headers, JSON body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"the connection closed before a response head: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        chunk = s.recv(65536)
        assert chunk, "the connection closed inside a response body"
        body += chunk
    return int(lines[0].split()[1]), headers, json.loads(body)


def request(url: str, source: str, method: str, path: str, body: bytes = b"") -> tuple[int, dict, dict]:
    with connect(url, source) as s:
        s.sendall(f"{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  f"content-length: {len(body)}\r\n\r\n".encode() + body)
        return read_response(s)


def test_health_answers_with_json_while_every_connection_slot_is_held(engine):
    limits = Limits(max_connections=6, max_connections_per_client=3, header_timeout=60)
    with BackgroundServer(create_app(engine, MODEL, limits=limits)) as server:
        held = [connect(server.url, source) for source in ("127.0.0.2",) * 3 + ("127.0.0.3",) * 3]
        try:
            for s in held:
                s.sendall(HELD_HEAD)
            status, headers, body = request(server.url, "127.0.0.2", "GET", "/v1/models")  # its 4th connection
            assert status == 429 and body["error"]["code"] == "too_many_connections", body
            assert headers["retry-after"] == "1" and headers["connection"] == "close"
            assert "--max-connections-per-client" in body["error"]["message"]
            status, headers, body = request(server.url, "127.0.0.4", "POST", "/v1/completions", COMPLETION)
            assert status == 503 and body["error"]["code"] == "server_busy", body  # every slot is taken
            assert headers["content-type"] == "application/json" and headers["retry-after"] == "1"
            for source in ("127.0.0.2", "127.0.0.4"):  # /health, from a capped client and from a new one
                with connect(server.url, source) as s:
                    s.settimeout(5)  # a generous bound: it is answered at once, not after a slot frees up
                    s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
                    status, headers, body = read_response(s)
                assert status == 200 and body["status"] == "ok" and headers["content-type"] == "application/json"
            held.pop().close()  # a slot frees up: the next connection is served
            deadline = time.monotonic() + 10
            while (status := request(server.url, "127.0.0.4", "GET", "/v1/models")[0]) == 503:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert status == 200
        finally:
            for s in held:
                s.close()


def trickle_until_answered(sockets: list[socket.socket], seconds: float) -> dict[socket.socket, bytes]:
    """Send one byte on each socket every 50 ms until the server answers it or closes it (at most ``seconds``);
    what each answered."""
    answers: dict[socket.socket, bytes] = {}
    deadline = time.monotonic() + seconds
    while len(answers) < len(sockets) and time.monotonic() < deadline:
        waiting = [s for s in sockets if s not in answers]
        readable, _, _ = select.select(waiting, [], [], 0.05)
        for s in readable:
            answers[s] = drain(s)
        for s in waiting:
            if s not in readable:
                try:
                    s.send(b" ")
                except OSError:  # closed by the server: its answer, if any, is still readable
                    answers[s] = drain(s)
    return answers


def drain(s: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return data


def test_slowloris_clients_are_cut_by_the_deadlines_and_others_are_served(engine):
    """One client trickles request heads and bodies byte by byte on more connections than it may hold: the
    extra ones are refused with 429, the heads are closed at the header deadline and the bodies answered 408
    at the body deadline however steadily the bytes come; another client is served meanwhile."""
    limits = Limits(max_connections=16, max_connections_per_client=4, header_timeout=1, body_timeout=1)
    with BackgroundServer(create_app(engine, MODEL, limits=limits)) as server:
        slow = [connect(server.url, "127.0.0.2") for _ in range(6)]
        try:
            for s in slow[:2]:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-slow: ")  # a head, byte by byte
            for s in slow[2:]:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                          b"content-length: 100000\r\n\r\n{")  # a body, byte by byte (the extra 2 are refused)
            status, _, body = request(server.url, "127.0.0.1", "POST", "/v1/completions", COMPLETION)
            assert status == 200 and body["usage"]["completion_tokens"] >= 1  # served while they trickle
            answers = trickle_until_answered(slow, seconds=30)
            assert len(answers) == len(slow)
            assert [answers[s] for s in slow[:2]] == [b"", b""]  # the heads: closed at the header deadline
            statuses = sorted(int(answers[s].split()[1]) for s in slow[2:])
            assert statuses == [408, 408, 429, 429], [answers[s][:200] for s in slow[2:]]
            for s in slow[2:]:
                error = json.loads(answers[s].partition(b"\r\n\r\n")[2])["error"]
                assert error["code"] in ("request_timeout", "too_many_connections"), error
            assert request(server.url, "127.0.0.2", "GET", "/v1/models")[0] == 200  # its slots came back
        finally:
            for s in slow:
                s.close()
