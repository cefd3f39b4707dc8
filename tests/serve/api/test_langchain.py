"""LangChain's ``ChatOpenAI`` against a real server (issue 12): ``with_structured_output`` in all three of its
methods and ``bind_tools(tool_choice="any")``, on the tiny random model — the answers are valid because decoding
is constrained, not because the model knows anything."""

from __future__ import annotations

import json
from typing import Literal

import pytest
from pydantic import BaseModel

import serving
from k3.chat import native as chat
from k3.serve.api.app import BackgroundServer, create_app
from k3.serve.engine import Engine

langchain_openai = pytest.importorskip("langchain_openai")


class Verdict(BaseModel):
    """A small answer the grammar closes quickly (no free-form strings)."""

    ok: bool
    colour: Literal["red", "green", "blue"]


@pytest.fixture(scope="module")
def llm():
    engine = Engine(serving.model(), serving.tokenizer(), max_model_len=2048).start()
    with BackgroundServer(create_app(engine, "k3-tiny")) as server:
        yield langchain_openai.ChatOpenAI(model="k3-tiny", base_url=server.url + "/v1", api_key="unused",
                                          max_tokens=1500, temperature=0, max_retries=0, timeout=300)
    engine.stop()


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_returns_a_valid_object(llm, method):
    result = llm.with_structured_output(Verdict, method=method).invoke("Is the sky green?")
    assert isinstance(result, Verdict)


def test_json_mode_parses_into_the_schema():
    """json_mode promises a JSON object, not the schema (the prompt must ask for it): a model scripted to write
    the object, through the constrained route, parses into ``Verdict``. (That the constraint forces validity is
    tested above and in tests/serve/engine/test_structured.py; free-form keys would not close in a test's token
    budget.)"""
    tok = serving.tokenizer()
    question = [{"role": "user", "content": "Answer in JSON."}]
    script = tok.encode(' {"ok": true,\n "colour": "blue"}') + [tok.special_id("end")]
    engine = Engine(serving.Scripted(len(chat.render(question, tok, "instruct")), script), tok).start()
    with BackgroundServer(create_app(engine, "k3-tiny")) as server:
        llm = langchain_openai.ChatOpenAI(model="k3-tiny", base_url=server.url + "/v1", api_key="unused",
                                          max_tokens=100, temperature=0, max_retries=0)
        out = llm.with_structured_output(Verdict, method="json_mode", include_raw=True).invoke("Answer in JSON.")
    engine.stop()
    assert out["parsed"] == Verdict(ok=True, colour="blue") and json.loads(out["raw"].content) == {
        "ok": True, "colour": "blue"}


def test_bind_tools_with_tool_choice_any_calls_a_tool(llm):
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        return "sunny"

    def get_time(zone: Literal["CET", "UTC"]) -> str:
        """The time in a zone."""
        return "noon"

    # strict: closed argument objects (an open one lets a model write further keys of any length)
    message = llm.bind_tools([get_weather, get_time], tool_choice="any", strict=True).invoke("Weather in Paris?")
    assert message.tool_calls and all(call["name"] in ("get_weather", "get_time") for call in message.tool_calls)
    call = message.tool_calls[0]
    assert call["args"] in ({"city": "Paris"}, {"city": "Oslo"}, {"zone": "CET"}, {"zone": "UTC"})
