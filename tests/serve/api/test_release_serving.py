"""`k3 serve` / `k3 chat` / `k3 info` / `k3 plan` on a released-layout directory (issue 11, item 5)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time

import openai
import pytest
import torch

from k3.cli import main
from k3.model.lm import K3ForCausalLM
from k3.chat import xtml
from kimi_fixtures import build_kimi_tokenizer_files
from release_fixture import write_release
from gloo import free_port


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("release") / "Kimi-K3-reduced"
    tokenizer = build_kimi_tokenizer_files(directory)
    write_release(directory, vocab_size=tokenizer.vocab_size)
    return directory


def test_k3_serve_answers_chat_in_the_release_format(release_dir):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "k3.cli", "serve", "--ckpt", str(release_dir), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
        assert "model 'Kimi-K3-reduced'" in line, line
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=20)
        deadline = time.monotonic() + 60
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.2)
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello world"}]
        reply = client.chat.completions.create(model="Kimi-K3-reduced", messages=messages, max_tokens=6,
                                               temperature=0)
        golden = ('<|open|>message role="system"<|sep|>Be brief.<|close|>message<|sep|><|end_of_msg|>'
                  '<|open|>message role="user"<|sep|>hello world<|close|>message<|sep|><|end_of_msg|>'
                  '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>')  # k3 serve's default: instruct
        from k3.tokenization.kimi import KimiTokenizer

        tokenizer = KimiTokenizer.load(release_dir)
        prompt = tokenizer.encode(golden, allow_special=True)
        assert reply.usage.prompt_tokens == len(prompt)
        assert reply.choices[0].finish_reason in ("length", "stop")
        # the served greedy tokens are the model's own greedy continuation of the XTML prompt
        model = K3ForCausalLM.from_pretrained(str(release_dir))
        ids, state, generated = torch.tensor([prompt]), model.new_state(1), []
        with torch.no_grad():
            for _ in range(reply.usage.completion_tokens):
                logits, state = model(ids, state=state)
                generated.append(int(logits[0, -1].argmax()))
                ids = torch.tensor([[generated[-1]]])
        parser = xtml.AssistantParser(tokenizer, "instruct")
        parts = {"reasoning": "", "content": "", "tools": ""}
        for channel, text in [d for t in generated for d in parser.feed(t)] + parser.flush():
            parts[channel] += text
        message = reply.choices[0].message
        assert (getattr(message, "reasoning_content", None) or "") == parts["reasoning"]
        assert (message.content or "") == parts["content"] + parts["tools"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_k3_chat_on_a_release(release_dir, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n/mode instruct\nagain\n/quit\n"))
    assert main(["chat", "--ckpt", str(release_dir), "--max-tokens", "4", "--seed", "0"]) == 0
    out = capsys.readouterr().out
    assert "k3 chat (thinking mode)" in out and "(instruct mode)" in out


def test_k3_info_and_plan_read_a_release_config(release_dir, capsys):
    assert main(["info", "--config", str(release_dir / "config.json"), "--json"]) == 0
    audit = json.loads(capsys.readouterr().out)
    assert audit["mla_indices"] == [4, 6] and audit["layers"] == 6 and audit["depth_sources"] == 4
    assert main(["plan", "--config", str(release_dir / "config.json"), "--json", "--context", "1000"]) == 0
    plan = json.loads(capsys.readouterr().out)
    # 5 MoE layers x 4 experts x 3 matrices of 64 x 64, at 4.25 bits
    assert plan["packed_experts"] == 5 * 4 * 3 * 64 * 64 * 4.25 / 8
    assert plan["mla_cache_per_token"] == 2 * (32 + 8) * 2


def test_an_image_in_the_release_format(release_dir):
    """The release's layout: <|media_begin|>image WxH<|media_content|>, one <|media_pad|> per visual token,
    <|media_end|>; the answer is the model's own greedy continuation with the image spliced in."""
    import base64

    from PIL import Image

    from k3.tokenization.image import batch, image_input
    from k3.serve.api.app import BackgroundServer, create_app
    from k3.serve.engine import Engine
    from k3.tokenization.kimi import KimiTokenizer

    model, tokenizer = K3ForCausalLM.from_pretrained(str(release_dir)), KimiTokenizer.load(release_dir)
    picture = Image.linear_gradient("L").resize((60, 40)).convert("RGB")
    out = io.BytesIO()
    picture.save(out, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
    engine = Engine(model, tokenizer, max_model_len=512).start()
    try:
        with BackgroundServer(create_app(engine, "k3")) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
            reply = client.chat.completions.create(model="k3", max_tokens=5, temperature=0, messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "hello world"}]}])
    finally:
        engine.stop()
    visual = image_input(picture, model.config.vision.patch_budget)
    golden = ('<|open|>message role="user"<|sep|><|media_begin|>image 60x40<|media_content|>'
              + "<|media_pad|>" * visual.tokens + '<|media_end|>hello world<|close|>message<|sep|><|end_of_msg|>'
              '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>')
    prompt = tokenizer.encode(golden, allow_special=True)
    assert reply.usage.prompt_tokens == len(prompt) and visual.tokens == 6  # padded to 84×56: 6×4 patches
    pixels, grids = batch([visual])
    with torch.no_grad():
        logits, state = model(inputs_embeds=model.embed_multimodal(torch.tensor([prompt]), pixels, grids),
                              state=model.new_state(1))
        generated = []
        for _ in range(reply.usage.completion_tokens):
            generated.append(int(logits[0, -1].argmax()))
            logits, state = model(torch.tensor([[generated[-1]]]), state=state)
    parser = xtml.AssistantParser(tokenizer, "instruct")
    text = "".join(t for ch, t in [d for g in generated for d in parser.feed(g)] + parser.flush() if ch == "content")
    assert (reply.choices[0].message.content or "") == text
