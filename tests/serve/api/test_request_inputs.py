"""What reaches the parsers (issue 35, item 2): deeply nested JSON anywhere in a request — the body, tool-call
``arguments`` strings, schemas, tool ``parameters``, the model's own tools channel — is a 400 (or plain content),
never a RecursionError 500; message and tool fields are strictly typed; ``stream_options`` needs ``stream``."""

from __future__ import annotations

import json

import pytest

import serving
from http_api import HELLO, MODEL, TOOLS, raw, scripted_server
from k3.chat.messages import MAX_JSON_DEPTH, loads, parse_json
from k3.serve.api.app import BackgroundServer, create_app
from k3.serve.engine import Engine

DEEP = "[" * 5000 + "]" * 5000
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    engine = Engine(serving.model(), serving.tokenizer(), max_model_len=256).start()
    with BackgroundServer(create_app(engine, MODEL)) as server:
        yield server
    engine.stop()


def post(server, path: str, body: dict | bytes) -> tuple[int, dict]:
    """POST ``body`` (with the model, and ``max_tokens: 2`` on the generating routes) to ``path``."""
    if not isinstance(body, bytes):
        body = json.dumps({"model": MODEL, **({"max_tokens": 2} if path.startswith("/v1/") else {}), **body}).encode()
    return raw(server.url, "POST", path, body)


def call_message(arguments: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def test_parse_json_refuses_deep_nesting_without_recursing():
    assert parse_json("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH) is not None
    with pytest.raises(ValueError, match="nested deeper"):
        parse_json("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1))
    with pytest.raises(ValueError, match="nested deeper"):
        parse_json('{"a": ' + DEEP + "}")
    assert loads(DEEP) is None and loads('"' + "[" * 5000 + '"') == "[" * 5000  # brackets inside strings are text
    assert loads('{"k": "[[[[", "v": [[1]]}' + " " * 10) == {"k": "[[[[", "v": [[1]]}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": USER + [call_message(DEEP)]}, "messages"),
    ("/v1/chat/completions", {"messages": USER + [call_message('{"a": ' + DEEP + "}")]}, "messages"),
    ("/tokenize", {"messages": USER + [call_message('{"a": ' + DEEP + "}")]}, "messages"),
    ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": nested_schema(150)}}}, "response_format"),
    ("/v1/completions", {"prompt": "x", "guided_json": nested_schema(150)}, "guided_json"),
    ("/v1/chat/completions", {"messages": USER, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": nested_schema(150)}}]}, "tool_choice"),
])
def test_deep_nesting_is_a_400_naming_the_field(server, path, body, param):
    code, data = post(server, path, body)
    assert code == 400 and data["error"]["param"] == param, data


def test_deep_bodies_are_400s(server):
    body = b'{"model": "' + MODEL.encode() + b'", "prompt": "x", "guided_json": {"a": ' + DEEP.encode() + b"}}"
    code, data = post(server, "/v1/completions", body)
    assert code == 400 and "recursion" in data["error"]["message"]


def test_deeply_nested_tool_channel_output_is_content_not_a_500():
    """The model writes 1,000 nested arrays into its tools channel: not tool calls, and no RecursionError."""
    tok = serving.tokenizer()
    engine, server = scripted_server([tok.special_id("tools"), "[" * 1000, tok.special_id("end")])
    with server:
        code, data = raw(server.url, "POST", "/v1/chat/completions", json.dumps({
            "model": MODEL, "messages": HELLO, "tools": TOOLS, "max_tokens": 1200, "temperature": 0,
            "mode": "thinking"}).encode())
        assert code == 200, data
        message = data["choices"][0]["message"]
        assert message["tool_calls"] is None and message["content"].endswith("[" * 1000)
    engine.stop()


@pytest.mark.parametrize("path, body, param, text", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": 5}]}, "messages",
     "messages[0].name: expected a string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, "messages", "messages[0].content"),
    ("/v1/chat/completions", {"messages": USER + [{"role": "assistant", "content": "x", "tool_calls": 5}]},
     "messages", "messages[1].tool_calls: expected a list"),
    ("/v1/chat/completions", {"messages": USER + [{"role": "assistant", "content": "x", "reasoning_content": 5}]},
     "messages", "messages[1].reasoning_content: expected a string"),
    ("/tokenize", {"messages": [{"role": "system", "content": "s", "name": ["x"]}]}, "messages", "name"),
    ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": 5}}]}, "tools", "tools[0].function.parameters: expected a JSON schema object"),
    ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": ["x"]}}]}, "tools", "parameters"),
    ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {"name": 3}}]}, "tools",
     "tools[0].function.name: expected a string"),
    ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "description": {"x": 1}}}]}, "tools", "description"),
    ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "retrieval"}]}, "tools", "tools[0]"),
    ("/tokenize", {"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
     "tools", "strict"),
    ("/v1/chat/completions", {"messages": USER, "stream_options": {"include_usage": True}}, "stream_options",
     "stream_options"),
    ("/v1/completions", {"prompt": "x", "stream": False, "stream_options": {"include_usage": True}},
     "stream_options", "stream_options"),
])
def test_lax_fields_are_typed(server, path, body, param, text):
    code, data = post(server, path, body)
    assert code == 400 and data["error"]["param"] == param and text in data["error"]["message"], data


def test_well_typed_optional_fields_still_pass(server):
    messages = [{"role": "user", "content": "hi", "name": "ann"},
                {"role": "assistant", "content": None, "tool_calls": None, "reasoning_content": None}, *USER]
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"},
                                               "strict": True}}]
    for path, body in (("/v1/chat/completions", {"messages": messages, "tools": tools}),
                       ("/tokenize", {"messages": messages, "tools": tools}),
                       ("/v1/completions", {"prompt": "x", "stream_options": None})):
        code, data = post(server, path, body)
        assert code == 200, data
