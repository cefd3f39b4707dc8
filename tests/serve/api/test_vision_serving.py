"""Images over the API (issue 16, item 4): the official ``openai`` client sends ``image_url`` data URLs to a real
server; the answer equals the model's own greedy continuation of the spliced prompt; the prefix cache never
confuses two images; bad images, too many images and too many visual tokens are 400s with nothing left running."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
import torch
from PIL import Image

import serving
from k3.tokenization.image import batch, image_input
from k3.chat import native as chat
from k3.serve.api.app import BackgroundServer, create_app
from k3.serve.engine.cache import PrefixCache
from k3.serve.engine import Engine
from k3.serve.asgi.guard import Limits
from http_api import MODEL


def _data_url(image: Image.Image, fmt: str = "PNG") -> str:
    out = io.BytesIO()
    image.save(out, format=fmt)
    mime = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp"}[fmt]
    return f"data:image/{mime};base64," + base64.b64encode(out.getvalue()).decode()


def _picture(seed: int, size: tuple[int, int] = (60, 40), mode: str = "RGB") -> Image.Image:
    channels = 4 if mode == "RGBA" else 3
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    return Image.fromarray(pixels, mode)


def _messages(url: str, text: str = "What is in this picture?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


@pytest.fixture(scope="module")
def engine():
    model = serving.model()
    cache = PrefixCache(model.config.layer_kinds(), 2**26, block_tokens=4, checkpoint_every=1)
    engine = Engine(model, serving.tokenizer(), prefill_chunk=8, max_model_len=256, prefix_cache=cache).start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def server(engine):
    with BackgroundServer(create_app(engine, MODEL, limits=Limits(max_images=2))) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@torch.no_grad()
def _greedy(model, prompt: list[int], image: Image.Image, n: int) -> list[int]:
    """The model's own greedy continuation of the prompt with the image spliced in (no engine, no cache)."""
    pixels, grids = batch([image_input(image, model.config.vision.patch_budget)])
    logits, state = model(inputs_embeds=model.embed_multimodal(torch.tensor([prompt]), pixels, grids),
                          state=model.new_state(1))
    out = []
    for _ in range(n):
        out.append(int(logits[0, -1].argmax()))
        logits, state = model(torch.tensor([[out[-1]]]), state=state)
    return out


@pytest.mark.parametrize("fmt, mode", [("PNG", "RGB"), ("JPEG", "RGB"), ("WEBP", "RGB"), ("PNG", "RGBA")])
def test_the_openai_client_sends_an_image_and_gets_the_models_answer(client, engine, fmt, mode):
    image = _picture(1, mode=mode)
    url = _data_url(image, fmt)
    reply = client.chat.completions.create(model=MODEL, messages=_messages(url), max_tokens=6, temperature=0,
                                           extra_body={"mode": "instruct"})
    tok = engine.tokenizer
    decoded = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    visual = image_input(decoded, engine.model.config.vision.patch_budget)
    prompt = chat.render(_messages(url), tok, "instruct", media=lambda part, where: visual)
    assert reply.usage.prompt_tokens == len(prompt) and prompt.count(tok.special_id("media")) == visual.tokens
    expected = _greedy(engine.model, prompt, decoded, reply.usage.completion_tokens)
    parser = chat.AssistantParser(tok, "instruct")
    text = "".join(t for i in expected for ch, t in parser.feed(i) if ch == "content")
    text += "".join(t for ch, t in parser.flush() if ch == "content")
    assert reply.choices[0].message.content == text


def test_the_prefix_cache_keeps_two_images_apart(client, engine):
    """Same text, same placeholder ids, different pictures: the second answer is its own, not the first's."""
    answers = []
    for seed in (2, 3, 2):
        reply = client.chat.completions.create(model=MODEL, messages=_messages(_data_url(_picture(seed, (90, 60)))),
                                               max_tokens=5, temperature=0, extra_body={"mode": "instruct"})
        answers.append((reply.choices[0].message.content, reply.usage.prompt_tokens_details.cached_tokens
                        if reply.usage.prompt_tokens_details else 0))
    visual = image_input(_picture(3, (90, 60)), engine.model.config.vision.patch_budget)
    prompt = chat.render(_messages("x"), engine.tokenizer, "instruct", media=lambda part, where: visual)
    expected = _greedy(engine.model, prompt, _picture(3, (90, 60)), 5)
    parser = chat.AssistantParser(engine.tokenizer, "instruct")
    text = "".join(t for i in expected for ch, t in parser.feed(i) if ch == "content")
    assert answers[1][0] == text + "".join(t for ch, t in parser.flush() if ch == "content")
    assert answers[2][0] == answers[0][0] and answers[2][1] > 0  # the same image again is served from the cache


@pytest.mark.parametrize("content, message", [
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}], "cannot decode image"),
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}], "invalid base64"),
    ([{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}], "does not fetch"),
    ([{"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGVsbG8="}}], "data:image"),
    ([{"type": "image_url", "image_url": {"url": _data_url(_picture(0))}}] * 3, "more than 2 images"),
    ([{"type": "image_url", "image_url": {"url": _data_url(_picture(0, (900, 900)))}}], "context length"),
    ([{"type": "image_url", "image_url": {"url": _data_url(_picture(0)), "detail": "high"}}], "only 'auto'"),
    ([{"type": "image_url", "image_url": {"url": _data_url(_picture(0)), "crop": [0, 0]}}], "image_url.crop"),
])
def test_bad_images_are_400s_and_leave_nothing_running(client, engine, content, message):
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=4)
    assert not engine.running and engine.num_waiting == 0


def test_a_model_without_vision_refuses_images(tmp_path):
    import dataclasses

    from k3.config import preset
    from k3.model.lm import K3ForCausalLM

    config = preset("tiny")
    config.vision = dataclasses.replace(config.vision, enabled=False)
    engine = Engine(K3ForCausalLM(config).eval(), serving.tokenizer(), max_model_len=128).start()
    try:
        with BackgroundServer(create_app(engine, MODEL)) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            with pytest.raises(openai.BadRequestError, match="'image_url' is not supported by this server for this"):
                client.chat.completions.create(model=MODEL, messages=_messages(_data_url(_picture(0))), max_tokens=2)
    finally:
        engine.stop()


def test_k3_chat_shows_an_image_with_the_first_message(tmp_path, monkeypatch, capsys):
    import sys

    from k3.cli import main
    from k3.model.checkpoint import save_model

    ckpt = save_model(tmp_path / "k3-tiny", serving.model(), serving.tokenizer())
    picture = tmp_path / "shapes.png"
    _picture(5, (70, 50)).save(picture)
    monkeypatch.setattr(sys, "stdin", io.StringIO("what is this?\nand now?\n/reset\nagain\n/quit\n"))
    assert main(["chat", "--ckpt", str(ckpt), "--image", str(picture), "--max-tokens", "4", "--seed", "0",
                 "--mode", "instruct"]) == 0
    out = capsys.readouterr().out
    assert out.count("[content]") == 3 and "(history cleared)" in out
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG not really")
    assert main(["chat", "--ckpt", str(ckpt), "--image", str(broken)]) == 2
    assert f"--image {broken}: cannot decode image" in capsys.readouterr().err
