"""Fuzzing the HTTP API with schemathesis against the server's own OpenAPI document (issue 9): schema-valid
and schema-violating requests to every operation of a real server on loopback never get a 5xx."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode

import serving
from k3.serve.api.app import BackgroundServer, Limits, create_app
from k3.serve.engine import Engine

EXAMPLES = 40  # per operation and generation mode: bounded in time (about a minute on 2 cores)


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

