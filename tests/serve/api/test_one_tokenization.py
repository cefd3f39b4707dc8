"""One tokenization (issue 35, item 3): ``/tokenize`` and ``/v1/completions`` encode a prompt string alike — special
token literals become their ids in both, as vLLM's Hugging Face tokenizers parse them — so a client's perplexities do
not depend on whether it sends text or the ids ``/tokenize`` gave it (lm-eval's ``tokenized_requests``)."""

from __future__ import annotations

import json

import pytest

import serving
from http_api import MODEL, raw
from k3.serve.api.app import BackgroundServer, create_app
from k3.serve.engine import Engine

PROMPTS = ["import json\nx = 1", "a<|eos|>b", "<|user|>hello<|end|><|assistant|>", "half <|eos| literal <|nope|>"]


@pytest.fixture(scope="module")
def server():
    engine = Engine(serving.model(), serving.tokenizer(), max_model_len=256).start()
    with BackgroundServer(create_app(engine, MODEL)) as server:
        yield server
    engine.stop()


def post(server, path: str, body: dict) -> dict:
    code, data = raw(server.url, "POST", path, json.dumps({"model": MODEL, **body}).encode())
    assert code == 200, data
    return data


@pytest.mark.parametrize("prompt", PROMPTS)
def test_tokenize_and_completions_encode_a_prompt_alike(server, prompt):
    tok = serving.tokenizer()
    ids = post(server, "/tokenize", {"prompt": prompt})["tokens"]
    assert ids == tok.encode(prompt, allow_special=True)
    scored = {"max_tokens": 0, "echo": True, "logprobs": 0}
    by_text = post(server, "/v1/completions", {"prompt": prompt, **scored})
    by_ids = post(server, "/v1/completions", {"prompt": ids, **scored})
    assert by_text["usage"]["prompt_tokens"] == by_ids["usage"]["prompt_tokens"] == len(ids)
    text, given = by_text["choices"][0]["logprobs"], by_ids["choices"][0]["logprobs"]
    assert text["tokens"] == given["tokens"] == [tok.decode([i]) for i in ids]
    assert text["token_logprobs"] == given["token_logprobs"]
    assert by_text["choices"][0]["text"] == by_ids["choices"][0]["text"] == prompt


def test_special_literals_are_special_ids_in_both_routes(server):
    tok = serving.tokenizer()
    ids = post(server, "/tokenize", {"prompt": "a<|eos|>b"})["tokens"]
    assert tok.eos_id in ids and len(ids) == 3
    done = post(server, "/v1/completions", {"prompt": "a<|eos|>b", "max_tokens": 1, "temperature": 0})
    assert done["usage"]["prompt_tokens"] == 3
    assert post(server, "/tokenize", {"prompt": "a<|eos|>b", "add_special_tokens": True})["tokens"] == [tok.bos_id,
                                                                                                       *ids]
