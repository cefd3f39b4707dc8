"""What the tools users point at a server need (issue 12): prompt log-probabilities (echo, vLLM's prompt_logprobs),
the tokenizer endpoints, every request field honoured or refused, reasoning in content, CORS, model lookup, version.
"""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlparse

import openai
import pytest
import torch

import serving
from k3.chat import native as chat
from k3.serve.api.app import BackgroundServer, create_app
from k3.serve.engine import Engine
from http_api import HELLO, MODEL, TOOLS, raw

PROMPT = "def load(path):\n    with open(path) as f:"


@pytest.fixture(scope="module")
def engine():
    engine = Engine(serving.model(), serving.tokenizer(), prefill_chunk=16, max_model_len=512).start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def server(engine):
    with BackgroundServer(create_app(engine, MODEL, allowed_origins=["http://app.example"])) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def post(server, path: str, body: dict) -> tuple[int, dict]:
    return raw(server.url, "POST", path, json.dumps(body).encode())


def full_logprobs(ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return serving.model()(torch.tensor([ids]))[0][0].double().log_softmax(-1)


# ---------------------------------------------------------------------------------------------- echo / prompt logprobs
def test_echo_with_logprobs_scores_the_prompt_as_one_forward(client):
    tok = serving.tokenizer()
    ids = tok.encode(PROMPT)
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1,
                                       echo=True)
    choice = result.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT) and len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = full_logprobs(ids)
    for t in range(1, len(ids)):
        assert lp.token_logprobs[t] == pytest.approx(float(expected[t - 1, ids[t]]), abs=1e-4)
        assert max(lp.top_logprobs[t].values()) == pytest.approx(float(expected[t - 1].max()), abs=1e-4)
    assert lp.text_offset[:3] == [0, len(tok.decode(ids[:1])), len(tok.decode(ids[:2]))]
    assert "".join(lp.tokens[:len(ids)]) == PROMPT


def test_echo_max_tokens_zero_and_streamed_echo(client, server):
    code, data = post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 0, "echo": True,
                                                  "logprobs": 0})
    assert code == 200 and data["choices"][0]["text"] == PROMPT and data["usage"]["completion_tokens"] == 0
    assert data["choices"][0]["finish_reason"] == "length"
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                            stream=True))
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    code, data = post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 0})
    assert code == 400 and data["error"]["param"] == "max_tokens"


def test_vllm_prompt_logprobs_in_completions_and_chat(server):
    tok = serving.tokenizer()
    code, data = post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2,
                                                  "temperature": 0, "prompt_logprobs": 2})
    ids = tok.encode(PROMPT)
    scored = data["choices"][0]["prompt_logprobs"]
    expected = full_logprobs(ids)
    assert code == 200 and scored[0] is None and len(scored) == len(ids)
    for t in range(1, len(ids)):
        entry = scored[t][str(ids[t])]
        assert entry["logprob"] == pytest.approx(float(expected[t - 1, ids[t]]), abs=1e-4)
        assert entry["rank"] == 1 + int((expected[t - 1] > expected[t - 1, ids[t]] + 1e-9).sum())
        assert len(scored[t]) in (2, 3)  # the two most likely, plus the prompt token when it is not one of them
    code, data = post(server, "/v1/chat/completions", {"model": MODEL, "messages": HELLO, "max_tokens": 2,
                                                       "prompt_logprobs": 0})
    assert code == 200 and len(data["prompt_logprobs"]) == len(chat.render(HELLO, tok, "instruct"))


def test_best_of_returns_the_most_likely_choices(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 1.0, "seed": 11, "logprobs": 0}
    _, every = post(server, "/v1/completions", {**body, "n": 4})
    _, best = post(server, "/v1/completions", {**body, "n": 2, "best_of": 4})
    scores = sorted(((sum(c["logprobs"]["token_logprobs"]), c["text"]) for c in every["choices"]), reverse=True)
    assert sorted(c["text"] for c in best["choices"]) == sorted(text for _, text in scores[:2])
    code, data = post(server, "/v1/completions", {**body, "n": 3, "best_of": 2})
    assert code == 400 and data["error"]["param"] == "best_of"


# ---------------------------------------------------------------------------------------------- tokenizer endpoints
def test_tokenize_detokenize_and_tokenizer_info(server, engine):
    tok = serving.tokenizer()
    code, data = post(server, "/tokenize", {"prompt": "hello <|eos|>", "add_special_tokens": False})
    assert code == 200 and data["tokens"] == tok.encode("hello <|eos|>", allow_special=True)
    assert data["count"] == len(data["tokens"]) and data["max_model_len"] == engine.max_model_len
    code, data = post(server, "/tokenize", {"model": MODEL, "messages": HELLO, "return_token_strs": True})
    assert data["tokens"] == chat.render(HELLO, tok, "instruct") and len(data["token_strs"]) == data["count"]
    code, data = post(server, "/detokenize", {"tokens": tok.encode("x = [1, 2]")})
    assert code == 200 and data == {"prompt": "x = [1, 2]"}
    assert post(server, "/detokenize", {"tokens": [10**6]})[0] == 400
    assert post(server, "/tokenize", {"prompt": "a", "messages": HELLO})[0] == 400
    assert post(server, "/tokenize", {"prompt": "a", "model": "other"})[0] == 404
    code, info = raw(server.url, "GET", "/tokenizer_info")
    assert code == 200 and info["eos_token"] == "<|eos|>" and info["bos_token"] == "<|bos|>"


def test_lm_eval_remote_tokenizer_works_against_the_server(server):
    utils = pytest.importorskip("lm_eval.utils")
    assert utils.check_remote_tokenizer_support(server.url + "/v1/completions")
    remote = utils.RemoteTokenizer(server.url + "/v1/completions")
    tok = serving.tokenizer()
    assert remote.encode("import json") == tok.encode("import json")
    assert remote.decode(tok.encode("import json")) == "import json"
    assert remote.eos_token_id == tok.eos_id


# ---------------------------------------------------------------------------------------------- every field
OPENAI_COMPLETION_FIELDS = ["best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
                            "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix",
                            "temperature", "top_p", "user"]
OPENAI_CHAT_FIELDS = ["audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
                      "max_completion_tokens", "max_tokens", "metadata", "modalities", "n", "parallel_tool_calls",
                      "prediction", "presence_penalty", "reasoning_effort", "response_format", "seed",
                      "service_tier", "stop", "store", "stream", "stream_options", "temperature", "tool_choice",
                      "tools", "top_logprobs", "top_p", "user", "web_search_options", "verbosity"]
VLLM_FIELDS = ["use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
               "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
               "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids",
               "bad_words", "echo", "add_generation_prompt", "continue_final_message", "add_special_tokens",
               "documents", "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "guided_json",
               "guided_regex", "guided_choice", "guided_grammar", "structural_tag", "guided_decoding_backend",
               "guided_whitespace_pattern", "priority", "logits_processors", "return_tokens_as_token_ids",
               "cache_salt", "structured_outputs", "kv_transfer_params", "vllm_xargs"]

def effects(route: str) -> dict[str, tuple[dict, dict]]:
    """Per honoured field: (the field's setting, extra settings of both requests) such that the response differs
    from the same request without the field. Fields that restrict sampling are set on a seeded temperature-1
    request, where they must give back the greedy answer."""
    tok = serving.tokenizer()
    end = tok.eos_id if route == "/v1/completions" else tok.special_id("end")
    ends = {"logit_bias": {str(end): 100}}  # the model wants to stop at once
    forced = {"logit_bias": {"50": 100}}
    chat = route == "/v1/chat/completions"
    return {
        "frequency_penalty": ({"frequency_penalty": 2.0}, {}), "presence_penalty": ({"presence_penalty": 2.0}, {}),
        "repetition_penalty": ({"repetition_penalty": 3.0}, {}), "logit_bias": ({"logit_bias": {"7": 100}}, {}),
        "temperature": ({"temperature": 1.0, "seed": 1}, {}), "max_tokens": ({"max_tokens": 2}, {}),
        "max_completion_tokens": ({"max_completion_tokens": 2}, {}), "n": ({"n": 2}, {}),
        "stop": ({"stop": ["e"]}, {}), "stop_token_ids": ({"stop_token_ids": [50]}, forced),
        "min_tokens": ({"min_tokens": 6}, ends), "ignore_eos": ({"ignore_eos": True}, ends),
        "include_stop_str_in_output": ({"include_stop_str_in_output": True}, {"stop": ["e"]}),
        "logprobs": ({"logprobs": True if chat else 1}, {}), "top_logprobs": ({"top_logprobs": 2}, {"logprobs": True}),
        "truncate_prompt_tokens": ({"truncate_prompt_tokens": 2}, {}), "prompt_logprobs": ({"prompt_logprobs": 0}, {}),
        "skip_special_tokens": ({"skip_special_tokens": False}, {**ends, "ignore_eos": True}),
        "echo": ({"echo": True}, {}), "guided_json": ({"guided_json": {"type": "object"}}, {}),
        "response_format": ({"response_format": {"type": "json_object"}}, {}), "tools": ({"tools": TOOLS}, {}),
        "tool_choice": ({"tool_choice": "required"}, {"tools": TOOLS}),
        "chat_template_kwargs": ({"chat_template_kwargs": {"thinking": True}}, {}),
    }


# Honoured without a visible difference in one greedy response, each tested on its own elsewhere in this file or in
# tests/serve/engine/test_sampling_controls.py / tests/serve/api/test_structured_api.py: sampling restrictions
# (checked below against greedy), best_of, parallel_tool_calls, streaming, and `user` (an id for the operator's
# records, by design).
SAMPLING_LIMITS = {"top_k": 1, "top_p": 1e-9, "min_p": 1.0}
ELSEWHERE = {"seed", "best_of", "parallel_tool_calls", "stream", "stream_options", "user"}


@pytest.mark.parametrize("route, fields", [("/v1/completions", OPENAI_COMPLETION_FIELDS + VLLM_FIELDS),
                                           ("/v1/chat/completions", OPENAI_CHAT_FIELDS + VLLM_FIELDS)])
def test_every_openai_and_vllm_field_is_honoured_or_refused(server, route, fields):
    base = {"model": MODEL, "max_tokens": 24, "temperature": 0}
    base |= {"prompt": "x = 1"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "x = 1"}]}
    table = effects(route)
    greedy = post(server, route, base)[1]["choices"]
    sampled = post(server, route, {**base, "temperature": 1.0, "seed": 3})[1]["choices"]
    assert sampled != greedy
    refused = []
    for field in sorted(set(fields)):
        if field in SAMPLING_LIMITS:
            code, data = post(server, route, {**base, "temperature": 1.0, "seed": 3, field: SAMPLING_LIMITS[field]})
            assert code == 200 and data["choices"] == greedy, field
            continue
        setting, extra = table.get(field, ({field: {"x": 1} if field not in ELSEWHERE else "v"}, {}))
        if field in ELSEWHERE and field not in ("user",):
            continue
        code, data = post(server, route, {**base, **extra, **setting})
        if code == 400:
            assert data["error"]["param"] == field, (field, data)
            refused.append(field)
            continue
        assert code == 200, (field, data)
        if field == "user":
            continue
        without = post(server, route, {**base, **extra})[1]
        assert data["choices"] != without["choices"] or data["usage"] != without["usage"] or \
            set(data) != set(without), field
    assert {"use_beam_search", "guided_regex", "logits_processors"} <= set(refused)
    chat_only = {"chat_template_kwargs", "response_format", "tools", "tool_choice", "max_completion_tokens",
                 "top_logprobs"}
    completions_only = {"echo", "skip_special_tokens"}
    honoured_here = set(table) - (chat_only if route == "/v1/completions" else completions_only)
    assert not set(refused) & honoured_here, set(refused) & honoured_here


def test_unknown_fields_are_refused_by_name(server):
    code, data = post(server, "/v1/chat/completions", {"model": MODEL, "messages": HELLO, "temprature": 0.2})
    assert code == 400 and data["error"]["param"] == "temprature" and "unknown" in data["error"]["message"]


def test_ignore_eos_and_skip_special_tokens_in_completions(server):
    tok = serving.tokenizer()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logit_bias": {str(tok.eos_id): 100}}
    code, data = post(server, "/v1/completions", body)
    assert data["usage"]["completion_tokens"] == 1 and data["choices"][0]["finish_reason"] == "stop"
    code, data = post(server, "/v1/completions", {**body, "ignore_eos": True})
    assert data["usage"]["completion_tokens"] == 5 and data["choices"][0]["finish_reason"] == "length"
    code, data = post(server, "/v1/completions", {**body, "ignore_eos": True, "skip_special_tokens": False})
    assert data["choices"][0]["text"] == "<|eos|>" * 5
    code, data = post(server, "/v1/completions", {**body, "truncate_prompt_tokens": 3})
    assert data["usage"]["prompt_tokens"] == 3


# ---------------------------------------------------------------------------------------------- reasoning, CORS, models
def test_reasoning_in_content_per_request_and_by_default():
    from http_api import scripted_server

    tok = serving.tokenizer()
    engine, server = scripted_server(["Let me think.", tok.special_id("response"), "Done.", tok.special_id("end")])
    with server:
        base = {"model": MODEL, "messages": HELLO, "tools": TOOLS, "max_tokens": 50, "mode": "thinking"}
        _, separate = post(server, "/v1/chat/completions", base)
        _, inline = post(server, "/v1/chat/completions", {**base, "separate_reasoning": False})
    engine.stop()
    assert separate["choices"][0]["message"]["reasoning_content"] == "Let me think."
    assert separate["choices"][0]["message"]["content"] == "Done."
    assert inline["choices"][0]["message"] == {"role": "assistant", "content": "<think>Let me think.</think>Done.",
                                               "reasoning_content": None, "tool_calls": None}


def test_cors_preflight_and_simple_requests(server):
    parts = urlparse(server.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    conn.request("OPTIONS", "/v1/chat/completions", headers={
        "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    preflight = conn.getresponse()
    preflight.read()
    assert preflight.status == 200 and preflight.getheader("access-control-allow-origin") == "http://app.example"
    assert "authorization" in preflight.getheader("access-control-allow-headers").lower()
    conn.request("GET", "/v1/models", headers={"Origin": "http://app.example"})
    response = conn.getresponse()
    response.read()
    assert response.getheader("access-control-allow-origin") == "http://app.example"
    conn.request("OPTIONS", "/v1/models", headers={"Origin": "http://evil.example", "Access-Control-Request-Method":
                                                   "GET"})
    denied = conn.getresponse()
    denied.read()
    assert denied.status == 400 and denied.getheader("access-control-allow-origin") is None
    conn.close()


def test_cors_is_off_by_default(engine):
    with BackgroundServer(create_app(engine, MODEL)) as plain:
        parts = urlparse(plain.url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        conn.request("OPTIONS", "/v1/chat/completions", headers={"Origin": "http://app.example",
                                                                  "Access-Control-Request-Method": "POST"})
        response = conn.getresponse()
        response.read()
        conn.close()
    assert response.status == 405 and response.getheader("access-control-allow-origin") is None


def test_model_lookup_and_version(client, server):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    code, data = raw(server.url, "GET", "/version")
    assert code == 200 and data["version"].count(".") >= 1
