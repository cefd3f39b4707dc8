"""The prefix cache through the HTTP API (issue 13): OpenAI's ``cached_tokens``, vLLM's ``cache_salt``, and
``GET /metrics`` in Prometheus' text format."""

from __future__ import annotations

import http.client
from urllib.parse import urlparse

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import serving
from k3.serve.api.app import BackgroundServer, create_app
from k3.serve.engine.cache import PrefixCache
from k3.serve.engine import Engine

MODEL = "k3-tiny"
SYSTEM = {"role": "system", "content": "You answer questions about the json module. " * 6}


@pytest.fixture(scope="module")
def served():
    model, tok = serving.model(), serving.tokenizer()
    cache = PrefixCache.for_model(model, tok, 32 * 2**20, block_tokens=16, checkpoint_every=2)
    engine = Engine(model, tok, prefix_cache=cache, max_model_len=1024).start()
    with BackgroundServer(create_app(engine, MODEL)) as server:
        yield server, cache
    engine.stop()


def metrics(url: str) -> dict[str, float]:
    parts = urlparse(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    conn.request("GET", "/metrics")
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("content-type").startswith("text/plain")
    samples = {s.name + str(sorted(s.labels.items()) if s.labels else ""): s.value
               for family in text_string_to_metric_families(response.read().decode()) for s in family.samples}
    conn.close()
    return samples


def test_multi_turn_chat_reports_cached_tokens_and_metrics(served):
    server, cache = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    history, cached = [SYSTEM], []
    for turn in range(4):
        history.append({"role": "user", "content": f"Turn {turn}: how does loads handle floats?"})
        reply = client.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0,
                                               extra_body={"ignore_eos": True})  # 8 tokens whatever the weights
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        history.append({"role": "assistant", "content": reply.choices[0].message.content})
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]) and cached[1:] == sorted(cached[1:])
    samples = metrics(server.url)
    assert samples["k3_prefix_cache_hits_total"] >= 3 and samples["k3_prefix_cache_reused_tokens_total"] >= sum(cached)
    assert 0 < samples["k3_prefix_cache_hit_rate"] < 1
    assert samples["k3_prefix_cache_bytes"] == cache.bytes_used > 0
    assert samples["k3_time_to_first_token_seconds_count"] >= 4
    assert samples["k3_inter_token_latency_seconds_count"] >= 4 * 7
    assert samples["k3_requests_running"] == 0 and samples["k3_requests_finished_total[('reason', 'length')]"] >= 4
    assert cache.pinned() == 0


def test_cache_salt_keeps_prefixes_apart(served):
    server, _ = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [SYSTEM, {"role": "user", "content": "A question about dumps and indent."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body={
        "cache_salt": "tenant-a"})
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body={
        "cache_salt": "tenant-a"})
    other = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body={
        "cache_salt": "tenant-b"})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert other.usage.prompt_tokens_details.cached_tokens == 0
