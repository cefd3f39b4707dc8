"""Answers bounded before the work starts and built off the event loop (issue 35, item 1), against real servers on
loopback: the log-probability entries of a request (echoed prompt, ``prompt_logprobs``, generated tokens, over every
choice) against `Limits.max_logprob_entries`, exactly; ``/tokenize`` and ``/detokenize`` within the context; and
large answers built and encoded on threads other than the event loop's."""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

import pytest

import serving
from http_api import MODEL, raw
from k3 import K3ForCausalLM
from k3.chat import chat_format
from k3.config import preset
from k3.serve.api import protocol
from k3.serve.api import serving as api_serving
from k3.serve.api.app import BackgroundServer, Limits, create_app
from k3.serve.engine import Engine


@pytest.fixture(scope="module")
def engine():
    engine = Engine(serving.model(), serving.tokenizer()).start()  # the tiny preset's context: 4,096 tokens
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def server(engine):
    with BackgroundServer(create_app(engine, MODEL)) as server:  # the default limits
        yield server


@pytest.fixture(scope="module")
def wide():
    """A server (default limits) whose model has a context of 2^20 tokens: long prompts, long texts to tokenize."""
    config = preset("tiny")
    config.context_length = 2**20
    engine = Engine(K3ForCausalLM(config).eval(), serving.tokenizer()).start()
    try:
        with BackgroundServer(create_app(engine, MODEL)) as server:
            yield server
    finally:
        engine.stop()


def text_of(tokens: int) -> str:
    """Real text of exactly ``tokens`` tokens (the tokenizer round-trips it)."""
    tok = serving.tokenizer()
    ids = tok.encode((Path(json.__file__).parent / "decoder.py").read_text() * 4)[:tokens]
    text = tok.decode(ids)
    assert len(tok.encode(text)) == tokens
    return text


def builders(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[tuple[int, int]]]:
    """Record, per call, the thread and the length of what builds an answer: its JSON text (`dumps`, where the
    routes call it) and each token's string (the tokenizer's ``decode``, shared by the servers' engines)."""
    calls: dict[str, list[tuple[int, int]]] = {"dumps": [], "decode": []}

    def recorded(name: str, fn: Callable[..., str]) -> Callable[..., str]:
        def call(*args: object) -> str:
            out = fn(*args)
            calls[name].append((threading.get_ident(), len(out)))
            return out
        return call

    for module in (api_serving, protocol):
        monkeypatch.setattr(module, "dumps", recorded("dumps", module.dumps))
    tok = serving.tokenizer()
    monkeypatch.setattr(tok, "decode", recorded("decode", tok.decode))
    return calls


def assert_off_the_loop(server: BackgroundServer, calls: dict[str, list[tuple[int, int]]], tokens: int) -> None:
    """Every JSON text over a megabyte, and every token string (at least ``tokens``), was built on a thread other
    than ``server``'s event loop."""
    loop = server.thread.ident  # the thread running the server's event loop
    large = [thread == loop for thread, size in calls["dumps"] if size > 2**20]
    assert large and not any(large), f"{sum(large)} of {len(large)} large JSON texts encoded on the event loop"
    decoded = [thread == loop for thread, _ in calls["decode"]]
    assert len(decoded) >= tokens and not any(decoded), f"{sum(decoded)} of {len(decoded)} decoded on the event loop"


def entries(logprobs: dict | None) -> int:
    """Log-probability entries in a completions choice's legacy ``logprobs``: each token and its alternatives."""
    if logprobs is None:
        return 0
    return len(logprobs["tokens"]) + sum(len(t or {}) for t in logprobs["top_logprobs"])


# ---------------------------------------------------------------------------------------------- the bound
def test_the_default_bound_refuses_prompt_logprobs_times_choices_up_front(server, engine):
    """4,000 prompt tokens echoed with 5 alternatives and as prompt_logprobs with 20, for three choices: 324,000
    entries, more than the default 262,144. Refused as a 400 naming the field asking for most, before anything is
    queued; so are chat requests asking for too many (with no max_tokens, the rest of the context counts)."""
    finished = sum(engine.finished.values())
    body = {"model": MODEL, "prompt": text_of(4000), "max_tokens": 0, "echo": True, "logprobs": 5,
            "prompt_logprobs": 20, "n": 3}
    status, data = raw(server.url, "POST", "/v1/completions", json.dumps(body).encode())
    assert status == 400 and data["error"]["param"] == "prompt_logprobs", data
    assert "324,000 log-probability entries" in data["error"]["message"] and "262,144" in data["error"]["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": text_of(1000)}], "max_tokens": 1,
            "prompt_logprobs": 20, "n": 16}
    status, data = raw(server.url, "POST", "/v1/chat/completions", json.dumps(chat).encode())
    assert status == 400 and data["error"]["param"] == "prompt_logprobs", data
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 20,
            "n": 4}  # no max_tokens: the rest of the context, 4,000-odd tokens, with 21 entries each, 4 times
    status, data = raw(server.url, "POST", "/v1/chat/completions", json.dumps(chat).encode())
    assert status == 400 and data["error"]["param"] == "logprobs" and "max_tokens" in data["error"]["message"], data
    assert sum(engine.finished.values()) == finished and not engine.running and not engine.num_waiting


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_the_bound_counts_every_entry_exactly(engine, route):
    """A request asking for exactly the limit's entries is served, and holds at most that many; one more entry is
    a 400. Counted: prompt tokens × (1 + alternatives) for echo and prompt_logprobs, max_tokens × (1 + alternatives)
    for the generated tokens, each times the choices."""
    tok = serving.tokenizer()
    if route == "completions":
        prompt = tok.encode("def load(path):\n    with open(path) as f:")
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "echo": True, "logprobs": 2, "prompt_logprobs": 1,
                "n": 2, "temperature": 0}
        asked = len(prompt) * 3 * 2 + len(prompt) * 2 * 2 + 5 * 3 * 2
    else:
        messages = [{"role": "user", "content": "def load(path):"}]
        prompt_tokens = len(chat_format(tok).render(messages, tok, "instruct"))
        body = {"model": MODEL, "messages": messages, "max_tokens": 4, "logprobs": True, "top_logprobs": 3,
                "prompt_logprobs": 0, "n": 2, "temperature": 0}
        asked = prompt_tokens * 1 * 2 + 4 * 4 * 2
    path = f"/v1/{'chat/' if route == 'chat' else ''}completions"
    with BackgroundServer(create_app(engine, MODEL, limits=Limits(max_logprob_entries=asked))) as exact:
        status, data = raw(exact.url, "POST", path, json.dumps(body).encode())
    assert status == 200, data
    if route == "completions":
        got = sum(entries(c["logprobs"]) + sum(len(p or {}) for p in c["prompt_logprobs"]) for c in data["choices"])
        # each field has the alternatives it asked for, though the engine scored the prompt once with the larger
        assert all(len(p) <= 1 + 1 for c in data["choices"] for p in c["prompt_logprobs"][1:])
        assert all(len(t) <= 2 for c in data["choices"] for t in c["logprobs"]["top_logprobs"][1:])
    else:
        got = sum(len(t["top_logprobs"]) + 1 for c in data["choices"] for t in c["logprobs"]["content"])
        got += sum(len(p or {}) for p in data["prompt_logprobs"]) * 2  # computed for both choices, sent once
    assert 0 < got <= asked
    with BackgroundServer(create_app(engine, MODEL, limits=Limits(max_logprob_entries=asked - 1))) as short:
        status, data = raw(short.url, "POST", path, json.dumps(body).encode())
    assert status == 400 and f"{asked:,} log-probability entries" in data["error"]["message"], data
    assert f"at most {asked - 1:,}" in data["error"]["message"]


# ---------------------------------------------------------------------------------------------- the event loop
@pytest.mark.parametrize("stream", [False, True])
def test_a_large_logprob_answer_is_built_off_the_event_loop(wide, stream, monkeypatch):
    """6,000 prompt tokens echoed with 20 alternatives and as prompt_logprobs with 20: 252,000 entries (within the
    default bound), some 20 MB of JSON in one answer or one event. Its token strings and its JSON are built in the
    thread pool, so the event loop (and /health) never waits on them."""
    body = {"model": MODEL, "prompt": text_of(6000), "max_tokens": 0, "echo": True, "logprobs": 20,
            "prompt_logprobs": 20, "stream": stream}
    calls = builders(monkeypatch)
    status, size = post_size(wide.url, "/v1/completions", body)
    assert status == 200 and size > 10 * 2**20
    assert_off_the_loop(wide, calls, 6000)


def post_size(url: str, path: str, body: dict) -> tuple[int, int]:
    """(status, bytes of the answer) of one POST."""
    parts = urlparse(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=300)
    conn.request("POST", path, body=json.dumps(body).encode(), headers={"content-type": "application/json"})
    response = conn.getresponse()
    size = len(response.read())
    conn.close()
    return response.status, size


# ---------------------------------------------------------------------------------------------- /tokenize, /detokenize
def test_detokenize_is_bounded_by_the_context(server, engine):
    limit = engine.max_model_len
    status, data = raw(server.url, "POST", "/detokenize", json.dumps({"tokens": [65] * (limit + 1)}).encode())
    assert status == 400 and data["error"]["param"] == "tokens" and f"{limit:,}" in data["error"]["message"], data
    status, data = raw(server.url, "POST", "/detokenize", json.dumps({"tokens": [65] * limit}).encode())
    assert status == 200 and data["prompt"] == serving.tokenizer().decode([65] * limit)


def test_tokenize_refuses_a_conversation_that_cannot_fit_before_rendering_it(server, engine):
    chars = engine.max_model_len * serving.tokenizer().max_token_bytes + 1
    messages = [{"role": "user", "content": [{"type": "text", "text": "x" * (chars // 2)}]},
                {"role": "user", "content": "y" * (chars - chars // 2)}]
    status, data = raw(server.url, "POST", "/tokenize", json.dumps({"messages": messages}).encode())
    assert status == 400 and data["error"]["param"] == "messages", data
    assert data["error"]["code"] == "context_length_exceeded"


def test_tokenize_builds_a_large_answer_off_the_event_loop(wide, monkeypatch):
    """A 2 MB prompt with its token strings (the context of 2^20 tokens lets it through the cheap bound): the token
    strings and the JSON are built in the thread pool, not on the event loop."""
    body = {"prompt": text_of(4000) * 210, "return_token_strs": True}
    assert len(body["prompt"]) > 2_000_000
    calls = builders(monkeypatch)
    status, size = post_size(wide.url, "/tokenize", body)
    assert status == 200 and size > 2_000_000
    assert_off_the_loop(wide, calls, 4000 * 210)
