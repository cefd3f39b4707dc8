"""``k3 export`` (issue 39, item 4): the release layout plus a Hugging Face tokenizer and chat template.

The chat template is held to our renderer (`k3.chat.native.render`) through transformers' ``apply_chat_template`` on
generated conversations; an exported trained ``tiny`` model loads in mlx-lm (`kimi_k3`) and in kimi-k3 and both
decode the same greedy text."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import serving
import training
from k3.chat import native
from k3.cli import main
from k3.interop.export import write_tokenizer
from k3.model.checkpoint import load_model
from k3.tokenization.bpe import Tokenizer

TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=24).filter(lambda t: "<|" not in t)
WORD = st.text(st.characters(codec="ascii", categories=("L", "N")), min_size=1, max_size=8)
ARGUMENTS = st.dictionaries(WORD, st.one_of(st.integers(-5, 99), TEXT, st.booleans()), max_size=3)


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    directory = tmp_path_factory.mktemp("hf-tokenizer")
    write_tokenizer(serving.tokenizer(), directory, 4096)
    return transformers.AutoTokenizer.from_pretrained(str(directory))


def content() -> st.SearchStrategy:
    """A message's content: a string or a list of text parts."""
    return st.one_of(TEXT, st.lists(st.builds(lambda t: {"type": "text", "text": t}, TEXT), max_size=3))


@st.composite
def message(draw, first: bool) -> dict:
    roles = ["system", "developer", "user"] + ([] if first else ["assistant", "tool"])
    role = draw(st.sampled_from(roles))
    if role == "tool":
        return {"role": "tool", "tool_call_id": draw(WORD), "content": draw(content())}
    if role != "assistant":
        return {"role": role, "content": draw(content())}
    out = {"role": "assistant", "content": draw(st.one_of(st.none(), content()))}
    if draw(st.booleans()):
        out["reasoning_content"] = draw(TEXT)
    calls = draw(st.lists(st.tuples(WORD, WORD, ARGUMENTS), max_size=2))
    if calls:
        out["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                             for i, n, a in calls]
    return out


@st.composite
def conversations(draw) -> tuple[list[dict], list[dict] | None]:
    messages = [draw(message(True))] + draw(st.lists(message(False), max_size=4))
    tools = draw(st.one_of(st.none(), st.lists(st.builds(
        lambda name, text: {"type": "function", "function": {"name": name, "description": text,
                                                             "parameters": {"type": "object", "properties": {}}}},
        WORD, TEXT), max_size=2)))
    return messages, tools


def openai_form(messages: list[dict]) -> list[dict]:
    """The messages with tool-call arguments as JSON strings (OpenAI's form, which our renderer takes)."""
    out = []
    for m in messages:
        m = dict(m)
        if "tool_calls" in m:
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conversation=conversations(), thinking=st.booleans(), prompt=st.booleans())
def test_the_chat_template_renders_our_chat_format(hf_tokenizer, conversation, thinking, prompt):
    messages, tools = conversation
    tok = serving.tokenizer()
    mode = "thinking" if thinking else "instruct"
    ours = native.render(openai_form(messages), tok, mode, tools, add_generation_prompt=prompt)
    text = hf_tokenizer.apply_chat_template(messages, tools=tools, thinking=thinking, add_generation_prompt=prompt,
                                            tokenize=False)
    assert text == tok.decode(ours)
    assert hf_tokenizer.encode(text, add_special_tokens=False) == ours


def test_the_chat_template_refuses_images(hf_tokenizer):
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]
    with pytest.raises(Exception, match="images need kimi-k3"):
        hf_tokenizer.apply_chat_template(image, tokenize=False)


@pytest.fixture(scope="module")
def exported(corpus, tmp_path_factory):
    """A ``tiny`` model trained for 6 steps, exported with ``k3 export``."""
    from k3.train.pretrain import train

    root = tmp_path_factory.mktemp("export")
    train(training.config(root / "run", corpus))
    assert main(["export", "--ckpt", str(root / "run"), "--out", str(root / "out")]) == 0
    return root


def test_export_writes_the_release_layout_and_a_tokenizer_we_load_back(exported):
    from k3.serve.options import load

    out = exported / "out"
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= names
    assert json.loads((out / "config.json").read_text())["model_type"] == "kimi_k3"
    model, tokenizer = load(str(out), device="cpu")
    _, trained = load_model(exported / "run")
    text = "def f(x):\n    return x  # <|end|>"
    assert isinstance(tokenizer, Tokenizer) and tokenizer.encode(text) == trained.encode(text)
    assert model.config.vocab_size == trained.vocab_size


def test_mlx_lm_decodes_our_greedy_text_from_the_export(exported):
    mx = pytest.importorskip("mlx.core")
    mlx_lm = pytest.importorskip("mlx_lm")
    generate_step = pytest.importorskip("mlx_lm.generate").generate_step
    import torch

    from k3.generation import stream
    from k3.serve.options import load

    out = exported / "out"
    model, tokenizer = load(str(out), device="cpu", dtype="float32")
    prompt = tokenizer.encode("def parse(text):\n    ")
    ours = list(stream(model, prompt, 24, temperature=0.0))
    theirs_model, theirs_tokenizer = mlx_lm.load(str(out))
    theirs_model.set_dtype(mx.float32)
    theirs = [int(t) for t, _ in generate_step(mx.array(prompt), theirs_model, max_tokens=len(ours),
                                               sampler=lambda x: mx.argmax(x, axis=-1))]
    assert theirs == ours
    assert theirs_tokenizer.decode(theirs) == tokenizer.decode(ours)
    assert torch.equal(torch.tensor(theirs_tokenizer.encode("def parse(text):\n    ", add_special_tokens=False)),
                       torch.tensor(prompt))


def test_export_refuses_an_existing_directory_and_a_config_the_release_cannot_describe(exported, tmp_path, capsys):
    assert main(["export", "--ckpt", str(exported / "run"), "--out", str(exported / "out")]) == 2
    assert "already exists" in capsys.readouterr().err
    from k3.config import preset
    from k3.model.checkpoint import save_model
    from k3.model.lm import K3ForCausalLM

    ckpt = save_model(tmp_path / "mini", K3ForCausalLM(preset("mini")), serving.tokenizer())
    assert main(["export", "--ckpt", str(ckpt), "--out", str(tmp_path / "out")]) == 2
    assert "decay_rank" in capsys.readouterr().err and not (tmp_path / "out").exists()
