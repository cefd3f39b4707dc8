"""Fuzzing the HTTP API with schemathesis against the server's own OpenAPI document (issue 9): schema-valid
and schema-violating requests to every operation of a real server on loopback never get a 5xx. Structured-output
bodies get their own generator (issue 35): random and hostile JSON schemas in every field that carries one."""

from __future__ import annotations

import json

import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

import serving
from http_api import raw
from k3.serve.api.app import BackgroundServer, Limits, create_app
from k3.serve.engine import Engine

EXAMPLES = 40  # per operation and generation mode: bounded in time (about a minute on 2 cores)
ASK = [{"role": "user", "content": "Tell me."}]


@pytest.fixture(scope="module")
def api_schema():
    # a short context keeps every accepted generation short
    engine = Engine(serving.model(), serving.tokenizer(), max_model_len=48, max_waiting=64).start()
    try:
        with BackgroundServer(create_app(engine, "k3-tiny", limits=Limits(request_timeout=30))) as server:
            schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
            schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                                            max_examples=EXAMPLES)
            yield schema
    finally:
        engine.stop()


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_request_gets_a_server_error(case):
    response = case.call(timeout=60)
    assert response.status_code < 500, (response.status_code, response.text[:500], case.body)
    if response.status_code >= 400:  # an OpenAI error body
        error = response.json()["error"]
        assert error["message"] and error["type"]



# ---------------------------------------------------------------------------------------------- structured output
# Random JSON schemas — hostile pieces included: huge counts, nested counted patterns, wide anyOf, recursive and
# dangling references — through every field that carries one. Never a 5xx; an accepted answer that completed validates.
LEAVES = st.one_of(
    st.sampled_from([{"type": "string"}, {"type": "integer"}, {"type": "boolean"}, {"type": "null"}, {},
                     {"$ref": "#"}, {"$ref": "#/$defs/missing"}, {"type": "string", "format": "date-time"},
                     {"type": "string", "pattern": "^((a{1,60}){1,60}){1,60}$"},
                     {"type": "string", "pattern": "^[a-z]{2,8}(-[a-z]{2,8})?$"}, {"type": "frob"}]),
    st.builds(lambda k, n: {"type": "string" if "Length" in k else "array", k: n},
              st.sampled_from(["minLength", "maxLength", "minItems", "maxItems"]),
              st.integers(0, 3) | st.integers(10**5, 10**10)),
    st.lists(st.text("abc", max_size=3), min_size=1, max_size=5).map(lambda v: {"enum": v}),
    st.integers(1, 3000).map(lambda n: {"anyOf": [{"const": i} for i in range(n)]}),
)
SCHEMAS = st.recursive(LEAVES, lambda inner: st.one_of(
    st.dictionaries(st.text("xyz", min_size=1, max_size=2), inner, max_size=3).flatmap(
        lambda props: st.builds(lambda req: {"type": "object", "properties": props, "required": req},
                                st.lists(st.sampled_from(sorted(props) or ["x"]), unique=True))),
    inner.map(lambda s: {"type": "array", "items": s, "maxItems": 3}),
    st.lists(inner, min_size=1, max_size=3).map(lambda alts: {"anyOf": alts}),
    st.tuples(inner, inner).map(lambda p: {"$defs": {"d": p[0]}, "allOf": [{"$ref": "#/$defs/d"}, p[1]]}),
), max_leaves=6)


@pytest.fixture(scope="module")
def structured_server():
    engine = Engine(serving.model(), serving.tokenizer(), max_model_len=1024).start()
    try:
        with BackgroundServer(create_app(engine, "k3-tiny", limits=Limits(request_timeout=60))) as server:
            yield server
    finally:
        engine.stop()


@given(schema=SCHEMAS, field=st.sampled_from(["response_format", "guided_json", "named", "required"]))
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_structured_output_bodies_never_get_a_server_error(structured_server, schema, field):
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    if field == "guided_json":
        path, body = "/v1/completions", {"prompt": "x =", "guided_json": schema}
    elif field == "response_format":
        path, body = "/v1/chat/completions", {"messages": ASK, "response_format": {
            "type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    else:
        path, body = "/v1/chat/completions", {"messages": ASK, "tools": tools, "tool_choice": "required" if field ==
                                              "required" else {"type": "function", "function": {"name": "f"}}}
    code, data = raw(structured_server.url, "POST", path, json.dumps(
        {"model": "k3-tiny", "max_tokens": 96, "temperature": 1, "seed": 0, **body}).encode())
    assert code < 500, (code, data)
    if code >= 400:
        # a tool's parameters are rendered into the prompt: a wide schema may not fit the context
        assert data["error"]["param"] in ("response_format", "guided_json", "tool_choice", "tools") \
            or data["error"]["code"] == "context_length_exceeded" and field in ("named", "required"), data
        return
    choice = data["choices"][0]
    if choice["finish_reason"] == "stop" and field == "guided_json":
        jsonschema.validate(json.loads(choice["text"]), schema)
    elif choice["finish_reason"] == "stop" and field == "response_format":
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    elif choice["finish_reason"] == "tool_calls":
        for call in choice["message"]["tool_calls"]:
            jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
