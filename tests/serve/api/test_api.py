"""The OpenAI-compatible server, started for real on loopback and driven with the official `openai` client."""

from __future__ import annotations

import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import openai
import pytest

import serving
from http_api import HELLO, MODEL, TOOLS, raw, scripted_server
from k3.chat import native as chat
from k3.serve.api.app import BackgroundServer, create_app
from k3.serve.engine import Engine


@pytest.fixture(scope="module")
def engine():
    engine = Engine(serving.model(), serving.tokenizer(), prefill_chunk=32, max_model_len=512).start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def server(engine):
    with BackgroundServer(create_app(engine, MODEL)) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def wait_idle(engine: Engine, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while (engine.running or engine.num_waiting) and time.monotonic() < deadline:
        time.sleep(0.02)


def test_models_and_health(client, server):
    (model,) = client.models.list().data
    assert model.id == MODEL and model.owned_by == "kimi-k3"
    status, health = raw(server.url, "GET", "/health")
    assert status == 200 and (health["status"], health["running"], health["waiting"]) == ("ok", 0, 0)


@pytest.mark.parametrize("mode, channel", [("thinking", "reasoning_content"), ("instruct", "content")])
def test_chat_non_streaming_and_streaming_agree(client, mode, channel):
    tok = serving.tokenizer()
    kwargs = dict(model=MODEL, messages=HELLO, max_tokens=16, temperature=0, extra_body={"mode": mode})
    full = client.chat.completions.create(**kwargs)
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert full.usage.prompt_tokens == len(chat.render(HELLO, tok, mode))
    assert full.usage.completion_tokens == 16 and full.usage.total_tokens == full.usage.prompt_tokens + 16
    text = getattr(choice.message, channel, None) or ""
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    streamed = "".join(getattr(c.choices[0].delta, channel, None) or "" for c in chunks if c.choices)
    assert streamed == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_logprobs_and_several_choices(client):
    result = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, temperature=0, logprobs=True,
                                            top_logprobs=3, n=2, extra_body={"mode": "instruct"})
    assert [c.index for c in result.choices] == [0, 1]
    first, second = result.choices
    assert first.message.content == second.message.content  # greedy: both choices agree
    entries = first.logprobs.content
    assert len(entries) == result.usage.completion_tokens // 2
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == pytest.approx(e.logprob) for e in entries)


def test_completions_non_streaming_and_streaming(client):
    full = client.completions.create(model=MODEL, prompt="import json\n", max_tokens=10, temperature=0, logprobs=2)
    choice = full.choices[0]
    assert full.object == "text_completion" and choice.finish_reason == "length"
    assert full.usage.prompt_tokens == len(serving.tokenizer().encode("import json\n"))
    assert full.usage.completion_tokens == 10 and len(choice.logprobs.token_logprobs) == 10
    assert all(1 <= len(top) <= 2 for top in choice.logprobs.top_logprobs)  # keyed by text: may collide
    offsets = choice.logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(choice.text)
    stream = client.completions.create(model=MODEL, prompt="import json\n", max_tokens=10, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream) == choice.text
    # token-id prompts and several prompts / choices in one request
    ids = serving.tokenizer().encode("import json\n")
    batch = client.completions.create(model=MODEL, prompt=[ids, serving.tokenizer().encode("x = 1")], max_tokens=5,
                                      temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == client.completions.create(
        model=MODEL, prompt="import json\n", max_tokens=5, temperature=0).choices[0].text


def test_stop_strings(client):
    base = client.completions.create(model=MODEL, prompt="import json", max_tokens=30, temperature=0)
    text = base.choices[0].text
    stop = text[10:13]
    cut = client.completions.create(model=MODEL, prompt="import json", max_tokens=30, temperature=0,
                                    stop=[stop, "\x00"])
    assert cut.choices[0].text == text[:text.find(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt="import json", max_tokens=30, temperature=0,
                                         stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_seeds_reproduce_outputs(client):
    def sample(seed):
        return client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=1.0,
                                              seed=seed, extra_body={"mode": "instruct"}).choices[0].message.content

    assert sample(5) == sample(5)
    assert sample(5) != sample(6)


def test_sixteen_concurrent_clients_get_their_alone_outputs(client, engine):
    prompts = [{"role": "user", "content": f"def f{i}(x):" + " return x" * (i % 5)} for i in range(16)]

    def ask(message):
        return client.chat.completions.create(model=MODEL, messages=[message], max_tokens=12, temperature=0,
                                              extra_body={"mode": "instruct"}).choices[0].message.content

    alone = [ask(p) for p in prompts]
    steps = []
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(ask, p) for p in prompts]
        while not all(f.done() for f in futures):
            steps.append(len(engine.running))
            time.sleep(0.005)
        together = [f.result() for f in futures]
    assert together == alone
    assert max(steps) > 1  # they really ran in one batch


def test_over_long_prompt_is_400_context_length_exceeded(client):
    long = [{"role": "user", "content": "x = 1\n" * 400}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=long, max_tokens=100)
    error = info.value.body
    assert error["code"] == "context_length_exceeded" and error["type"] == "invalid_request_error"
    prompt = len(chat.render(long, serving.tokenizer(), "thinking"))
    assert "maximum context length is 512 tokens" in error["message"]
    assert f"requested {prompt + 100} tokens ({prompt} in the prompt, 100 in the completion)" in error["message"]


@pytest.mark.parametrize("body, status, param", [
    (b'{"model": "k3-tiny", "messages": [', 400, None),
    (json.dumps({"model": MODEL, "messages": HELLO, "max_tokens": "ten"}).encode(), 400, "max_tokens"),
    (json.dumps({"model": MODEL, "messages": HELLO, "max_tokens": -3}).encode(), 400, "max_tokens"),
    (json.dumps({"model": MODEL, "messages": HELLO, "temperature": [1]}).encode(), 400, "temperature"),
    (json.dumps({"model": MODEL, "messages": "hi"}).encode(), 400, "messages"),
    (json.dumps({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}).encode(), 400, "messages"),
    (json.dumps({"messages": HELLO}).encode(), 400, "model"),
    (json.dumps({"model": "gpt-9", "messages": HELLO}).encode(), 404, "model"),
    (json.dumps({"model": MODEL, "messages": HELLO, "presence_penalty": 3}).encode(), 400, "presence_penalty"),
        (json.dumps({"model": MODEL, "messages": HELLO, "frobnicate": 1}).encode(), 400, "frobnicate"),
    (json.dumps({"model": MODEL, "messages": HELLO, "n": 0}).encode(), 400, "n"),
    (json.dumps({"model": MODEL, "messages": HELLO, "tool_choice": "required"}).encode(), 400, "tool_choice"),
    (json.dumps({"model": MODEL, "messages": [], "max_tokens": 2}).encode(), 400, "messages"),
    (json.dumps({"model": MODEL, "messages": HELLO, "top_logprobs": 50, "logprobs": True}).encode(), 400,
     "top_logprobs"),
])
def test_bad_requests_get_openai_errors(server, engine, body, status, param):
    code, data = raw(server.url, "POST", "/v1/chat/completions", body)
    assert code == status
    assert set(data) == {"error"} and set(data["error"]) == {"message", "type", "param", "code"}
    assert data["error"]["param"] == param and data["error"]["message"]
    assert not engine.running and not engine.num_waiting


def test_bad_completion_requests(client):
    with pytest.raises(openai.BadRequestError, match="prompt"):
        client.completions.create(model=MODEL, prompt="", max_tokens=3)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="x", max_tokens=3)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)


def test_a_disconnected_stream_frees_its_state(server, engine):
    aborted = engine.finished["abort"]
    parts = urlparse(server.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    body = {"model": MODEL, "prompt": "import json\n", "max_tokens": 500, "temperature": 0, "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    first = response.readline()
    assert first.startswith(b"data: ") and json.loads(first[6:])["choices"][0]["finish_reason"] is None
    assert len(engine.running) == 1  # greedy runs the full 500 tokens: this request is still decoding
    conn.sock.shutdown(2)
    conn.close()
    wait_idle(engine)
    assert not engine.running and engine.finished["abort"] == aborted + 1  # cancelled, not run to the end


def test_a_disconnected_non_streaming_request_is_cancelled(server, engine):
    aborted = engine.finished["abort"]
    parts = urlparse(server.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    body = {"model": MODEL, "prompt": "x = 1", "max_tokens": 400, "temperature": 0}  # greedy: 400 tokens, no eos
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"})
    deadline = time.monotonic() + 10
    while not engine.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.running
    conn.sock.shutdown(2)
    conn.close()
    wait_idle(engine)
    assert not engine.running and engine.finished["abort"] == aborted + 1


def test_api_key(engine):
    with BackgroundServer(create_app(engine, MODEL, api_key="sesame")) as server:
        assert raw(server.url, "GET", "/v1/models")[0] == 401
        status, data = raw(server.url, "GET", "/v1/models", headers={"authorization": "Bearer wrong"})
        assert status == 401 and data["error"]["code"] == "invalid_api_key"
        good = openai.OpenAI(base_url=server.url + "/v1", api_key="sesame", max_retries=0)
        assert good.models.list().data[0].id == MODEL
        assert raw(server.url, "GET", "/health")[0] == 200


def test_tool_calls_and_reasoning_from_generated_channels():
    tok = serving.tokenizer()
    think, response, tools, end = (tok.special_id(n) for n in ("think", "response", "tools", "end"))
    script = ["I should look it up.", response, "Checking.", tools,
              '[{"name":"get_weather","arguments":{"city":"Paris"}}]', end]
    engine, server = scripted_server(script)
    with server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        result = client.chat.completions.create(model=MODEL, messages=HELLO, tools=TOOLS, max_tokens=200,
                                                temperature=0, extra_body={"mode": "thinking"})
        choice = result.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.reasoning_content == "I should look it up."
        assert choice.message.content == "Checking."
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
        chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, tools=TOOLS, max_tokens=200,
                                                     temperature=0, stream=True, extra_body={"mode": "thinking"}))
        deltas = [c.choices[0].delta for c in chunks]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "I should look it up."
        assert "".join(d.content or "" for d in deltas) == "Checking."
        (streamed_call,) = [tc for d in deltas for tc in d.tool_calls or []]
        assert streamed_call.function.name == "get_weather" and streamed_call.index == 0
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert result.usage.completion_tokens == len(tok.encode(script[0])) + len(tok.encode(script[2])) + \
            len(tok.encode(script[4])) + 3
    engine.stop()


def test_an_error_after_streaming_started_is_an_error_event():
    engine, server = scripted_server(["abc def ghi"], fail_after=1)
    with server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(model=MODEL, messages=HELLO, tools=TOOLS, max_tokens=20,
                                                temperature=0, stream=True)
        received = []
        with pytest.raises(openai.APIError, match="scripted failure"):
            for chunk in stream:
                received.append(chunk)
        assert received and received[0].choices[0].delta.role == "assistant"
        with pytest.raises(openai.InternalServerError, match="scripted failure"):
            client.chat.completions.create(model=MODEL, messages=HELLO, tools=TOOLS, max_tokens=20, temperature=0)
        wait_idle(engine)
        assert not engine.running
    engine.stop()


def test_engine_keeps_serving_while_clients_come_and_go(client, engine):
    """Streams abandoned half-way (the client closes them) never leak state; the others finish normally."""
    def abandon():
        stream = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=300, temperature=0,
                                                stream=True)
        next(iter(stream))
        stream.close()

    aborted = engine.finished["abort"]
    threads = [threading.Thread(target=abandon) for _ in range(4)]
    for t in threads:
        t.start()
    finished = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0)
    for t in threads:
        t.join()
    assert finished.choices[0].finish_reason == "length"
    wait_idle(engine)
    assert not engine.running and engine.finished["abort"] == aborted + 4
