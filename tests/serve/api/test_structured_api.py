"""Structured output through the HTTP API (issue 12, item 2): ``response_format``, ``guided_json`` and forced tool
calls on the tiny random model — whatever the model prefers, a completed answer parses and validates. Issue 35:
hostile schemas are 400s naming their field, compiles are bounded and off the event loop, a grammar that fails
mid-way ends its request alone with a 400, pydantic's $defs work in forced tool calls, and the grammar's end ends
the answer under min_tokens / ignore_eos."""

from __future__ import annotations

import http.client
import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Literal
from urllib.parse import urlparse

import jsonschema
import openai
import pydantic
import pytest

import hostile_schemas
import serving
from k3.serve.api.app import BackgroundServer, create_app
from k3.serve.engine import Engine
from http_api import MODEL, raw

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"], "properties": {
    "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["a", "b"]}}}}
#: Closed objects (``additionalProperties: false``), as the tests' exact expectations of the arguments assume: an open
#: one lets a model write further keys of any length, which no token budget bounds.
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
             "additionalProperties": False}}}]
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


# ---------------------------------------------------------------------------------------------- bounded work (issue 35)
def structured_request(field: str, schema: dict) -> tuple[str, dict]:
    """A request (route, body) whose ``field`` carries ``schema``."""
    if field == "guided_json":
        return "/v1/completions", {"model": MODEL, "prompt": "x =", "max_tokens": 8, "guided_json": schema}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}} \
        if field == "response_format" else {"tools": tools, "tool_choice": "required" if field == "required" else {
            "type": "function", "function": {"name": "f"}}}
    return "/v1/chat/completions", {"model": MODEL, "messages": ASK, "max_tokens": 8, **extra}


FIELDS = ["response_format", "guided_json", "named", "required"]


@pytest.mark.parametrize("name", list(hostile_schemas.REFUSED))
def test_hostile_schemas_are_400s_naming_the_field(server, name):
    field = FIELDS[list(hostile_schemas.REFUSED).index(name) % len(FIELDS)]
    path, body = structured_request(field, hostile_schemas.REFUSED[name])
    code, data = raw(server.url, "POST", path, json.dumps(body).encode())
    param = "tool_choice" if field in ("named", "required") else field
    assert code == 400 and data["error"]["param"] == param, data
    assert data["error"]["message"].startswith(f"{param}: ")


@pytest.mark.parametrize("name", list(hostile_schemas.BOUNDED))
def test_bounded_schemas_compile_within_the_budget_and_work(client, server, name):
    schema = hostile_schemas.BOUNDED[name]
    code, data = raw(server.url, "POST", "/v1/chat/completions", json.dumps({
        "model": MODEL, "messages": ASK, "max_tokens": 400, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}).encode())
    if code == 400:  # a slower machine: over the time budget
        assert data["error"]["param"] == "response_format" and "budget" in data["error"]["message"], data
        return
    assert code == 200, data
    if data["choices"][0]["finish_reason"] == "stop":
        jsonschema.validate(json.loads(data["choices"][0]["message"]["content"]), schema)


def test_health_answers_while_a_hostile_schema_compiles(server):
    """The compile runs in a child process under its budget, off the event loop and the engine thread."""
    path, body = structured_request("response_format", hostile_schemas.REFUSED["8,000 optional properties"])
    with ThreadPoolExecutor(1) as pool:
        hostile = pool.submit(raw, server.url, "POST", path, json.dumps(body).encode())
        time.sleep(0.3)
        started = time.monotonic()
        while not hostile.done():
            code, _ = raw(server.url, "GET", "/health")
            assert code == 200 and time.monotonic() - started < 5.0
            started = time.monotonic()
            time.sleep(0.1)
        code, data = hostile.result()
    assert code == 400 and "budget" in data["error"]["message"]


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    kind: Literal["capital", "town"]


class Trip(pydantic.BaseModel):
    """Plan a trip."""
    stops: list[City] = pydantic.Field(max_length=2)
    back: City | None = None


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "Trip"}}])
def test_forced_tool_calls_take_pydantic_schemas_with_defs(client, tool_choice):
    """`openai.pydantic_function_tool` and `model_json_schema` put shared models under $defs and refer to them."""
    tools = [openai.pydantic_function_tool(Trip), {"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}}}}},
             {"type": "function", "function": {"name": "city", "parameters": City.model_json_schema()}}]
    assert "$defs" in tools[0]["function"]["parameters"]
    for seed in range(3):
        reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice=tool_choice,
                                               max_tokens=1200, temperature=1, seed=seed)
        for call in reply.choices[0].message.tool_calls or []:
            schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call.function.name)
            jsonschema.validate(json.loads(call.function.arguments), schema)
        assert reply.choices[0].finish_reason in ("tool_calls", "length")


def test_the_grammars_end_ends_the_answer_under_min_tokens_and_ignore_eos(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    for extra in ({"min_tokens": 300}, {"ignore_eos": True}, {"min_tokens": 300, "ignore_eos": True}):
        reply = client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, max_tokens=600,
                                               temperature=0, extra_body=extra)
        assert reply.choices[0].finish_reason == "stop"
        assert json.loads(reply.choices[0].message.content) in ({"ok": True}, {"ok": False})
        done = client.completions.create(model=MODEL, prompt="x =", max_tokens=600, temperature=0,
                                         extra_body={"guided_json": {"type": "boolean"}, **extra})
        assert done.choices[0].finish_reason == "stop" and json.loads(done.choices[0].text) in (True, False)
        assert done.usage.completion_tokens < 300


def test_a_grammar_that_fails_while_generating_ends_its_request_with_a_400():
    """The trial walk stays inside "a" (200 characters at least); the model then writes into "b", whose nested counted
    pattern exhausts the lexer: that request ends with a 400 naming guided_json (an `event: error` when streamed), and
    the engine serves on. (One request at a time: the scripted model places its script by the batch's position.)"""
    tok = serving.tokenizer()
    schema = {"type": "object", "properties": {"a": {"type": "string", "minLength": 200}, "b": {
        "type": "string", "pattern": "^(.{1,100}){1,100}$"}}, "required": ["a", "b"], "additionalProperties": False}
    prompt = "x ="
    script = tok.encode('{"a": "' + "q" * 210 + '", "b": "' + "ab" * 100)
    engine = Engine(serving.Scripted(len(tok.encode(prompt)), script), tok, max_model_len=1024).start()
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 400, "temperature": 0, "guided_json": schema}
    try:
        with BackgroundServer(create_app(engine, MODEL)) as server:
            code, data = raw(server.url, "POST", "/v1/completions", json.dumps(body).encode())
            assert code == 400 and data["error"]["param"] == "guided_json", data
            assert "grammar" in data["error"]["message"]
            code, data = raw(server.url, "POST", "/v1/completions", json.dumps(
                {**body, "guided_json": None, "max_tokens": 300}).encode())
            assert code == 200 and data["choices"][0]["finish_reason"] == "length", data
            events = stream_events(server.url, {**body, "stream": True})
            assert events[-1][0] == "error" and events[-1][1]["error"]["param"] == "guided_json"
    finally:
        engine.stop()


def stream_events(url: str, body: dict) -> list[tuple[str | None, dict | str]]:
    """A streamed completion's SSE events as (event name, data)."""
    parts = urlparse(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"})
    text = conn.getresponse().read().decode()
    conn.close()
    events = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        data = lines["data"]
        events.append((lines.get("event"), data if data == "[DONE]" else json.loads(data)))
    return events
