"""Structured output through the HTTP API (issue 12, item 2): ``response_format``, ``guided_json`` and forced tool
calls on the tiny random model — whatever the model prefers, a completed answer parses and validates."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

import serving
from k3.serve.api.app import BackgroundServer, create_app
from k3.serve.engine import Engine
from http_api import MODEL, raw

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"], "properties": {
    "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["a", "b"]}}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"]}}}]
ASK = [{"role": "user", "content": "Tell me."}]


@pytest.fixture(scope="module")
def server():
    engine = Engine(serving.model(), serving.tokenizer(), max_model_len=2048).start()
    with BackgroundServer(create_app(engine, MODEL)) as server:
        yield server
    engine.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_answers_validate(client, seed):
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=1200, temperature=1.0, seed=seed,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)


def test_guided_json_in_completions_and_streaming(client, server):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    reply = client.completions.create(model=MODEL, prompt="x =", max_tokens=600, temperature=0,
                                      extra_body={"guided_json": schema})
    assert json.loads(reply.choices[0].text) in ({"ok": True}, {"ok": False})
    chunks = list(client.completions.create(model=MODEL, prompt="x =", max_tokens=600, temperature=0, stream=True,
                                            extra_body={"guided_json": schema}))
    assert "".join(c.choices[0].text for c in chunks) == reply.choices[0].text


def test_forced_tool_calls(client):
    named = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=600, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments) in ({"utc": True}, {"utc": False})
    required = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=1200, temperature=1,
                                              seed=4, tool_choice="required", parallel_tool_calls=False)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    name = choice.message.tool_calls[0].function.name
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
    jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), schema)
    streamed = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=600,
                                                   temperature=0, stream=True, tool_choice={
                                                       "type": "function", "function": {"name": "get_time"}}))
    calls = [tc for c in streamed for tc in c.choices[0].delta.tool_calls or []]
    assert [c.function.name for c in calls] == ["get_time"] and streamed[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}}, "guided_json"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
])
def test_bad_structure_requests_are_400s(server, body, param):
    code, data = raw(server.url, "POST", "/v1/chat/completions",
                     json.dumps({"model": MODEL, "messages": ASK, **body}).encode())
    assert code == 400 and data["error"]["param"] == param, data
