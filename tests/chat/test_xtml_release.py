"""Issue 38, item 3 (the chat half): `k3.chat.xtml` renders what the release's own encoder renders, token for token.

The oracle is ``encoding_k3`` as mlx-vlm 0.7.10 ships it (``mlx_vlm.models.kimi_k3``): ``build_chat_segments`` gives
``EncodeSegment(text, allow_special)`` items, and the release's processor encodes each segment on its own (control
segments with special tokens allowed, the others as plain text). An image is the processor's ``make_image_prompt``,
one control segment ``<|media_begin|>image WxH<|media_content|>`` + a ``<|media_pad|>`` per visual token +
``<|media_end|>``; ours is the `VisualInput` our ``media`` callback returns, laid out the same way. The tokenizer is
trained on text whose merges straddle the release's segment boundaries, so a run encoded whole and one encoded segment
by segment give different ids here.

Hypothesis conversations (system and developer messages, turns, reasoning, typed tool calls, tool results by id,
tools, efforts, modes, images, tool_choice, response_format) and one explicit case per feature. The conventions where
we deliberately differ from the release's encoder are pinned at the end.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3.chat.xtml import EFFORTS, MODES, render, render_text
from k3.tokenization.image import VisualInput
from k3.tokenization.kimi import KimiTokenizer
from kimi_fixtures import TEXTS, build_kimi_tokenizer_files

encoding_k3 = pytest.importorskip("mlx_vlm.models.kimi_k3.encoding_k3",
                                  reason="the release's XTML encoder ships with mlx-vlm (a test-only dependency)")

#: Text whose BPE merges cross the release's segment boundaries: content parts ("Hi " | "again!"), an attribute value
#: and its quotes ('="' | "-1" | '"'), an escape and what follows it.
BOUNDARY = ['Hi again! again!', 'name="Bob &quot;the&quot; &amp; co"', 'key="a.b" type="string"',
            'tool="f-1" index="12"', 'value="ok." q="&quot;x&quot;"', 'x="-1" y="2.5"', "  spaced  out  "]
FRAGMENTS = ["Hi ", "again!", " ", "  ", "\n", "&", '"', "&quot;", "<", ">", "<|open|>", "<|sep|>", "</x>", '="',
             "a.b", "-1", "ok.", "中文", "🙂", "naïve", "{", "}", "[1]", "\\", "'", "Paris"]
IMAGE = "https://images.test/{w}x{h}/{gh}x{gw}.png"  # our media callback's test image: size and patch grid


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> KimiTokenizer:
    texts = [f"{t} {i}" for i in range(5) for t in TEXTS + BOUNDARY]
    return build_kimi_tokenizer_files(tmp_path_factory.mktemp("kimi"), texts, 800)


def test_the_tokenizer_tells_the_segmentations_apart(tok):
    """Without merges across segment boundaries the comparison could not see how text is cut into segments."""
    assert tok.encode("Hi again!") != tok.encode("Hi ") + tok.encode("again!")
    assert tok.encode('ok."') != tok.encode("ok.") + tok.encode('"')


# ------------------------------------------------------------------------------------------------
# the two renderings


def _image(part: dict) -> VisualInput:
    """The test image an ``image_url`` part names (no pixels: rendering reads only its size and grid)."""
    w, h, gh, gw = map(int, re.fullmatch(r".*/(\d+)x(\d+)/(\d+)x(\d+)\.png", part["image_url"]["url"]).groups())
    return VisualInput(torch.zeros(0), (1, gh, gw), (w, h))


def image_part(w: int, h: int, gh: int, gw: int) -> dict:
    return {"type": "image_url", "image_url": {"url": IMAGE.format(w=w, h=h, gh=gh, gw=gw)}}


def image_prompt(image: VisualInput) -> str:
    """The release processor's ``make_image_prompt(width, height, num_tokens)``."""
    width, height = image.size
    return f"<|media_begin|>image {width}x{height}<|media_content|>{'<|media_pad|>' * image.tokens}<|media_end|>"


def release(tok: KimiTokenizer, messages: list[dict], mode: str = "thinking", tools: list[dict] | None = None,
            add_generation_prompt: bool = True, images: Sequence[VisualInput] = (), thinking_effort: str = "max",
            **options: Any) -> tuple[list[int], str]:
    """The release's ids (each segment encoded on its own) and text; ``thinking_effort`` defaults as its processor's
    ``apply_chat_template`` does."""
    prompts = [image_prompt(v) for v in images]
    segments = encoding_k3.build_chat_segments(messages, tools, add_generation_prompt=add_generation_prompt,
                                               thinking=mode == "thinking", image_prompts=prompts,
                                               thinking_effort=thinking_effort, **options)
    ids = [i for s in segments for i in tok.encode(s.text, allow_special=s.allow_special)]
    return ids, "".join(s.text for s in segments)


def ours(tok: KimiTokenizer, messages: list[dict], mode: str = "thinking", tools: list[dict] | None = None,
         add_generation_prompt: bool = True, **options: Any) -> tuple[list[int], list[VisualInput]]:
    """Our ids, and the images in the order the ``media`` callback was asked for them."""
    seen: list[VisualInput] = []

    def media(part: dict, where: str) -> VisualInput:
        seen.append(_image(part))
        return seen[-1]

    return render(messages, tok, mode, tools, add_generation_prompt, media=media, **options), seen


def images_in_order(messages: list[dict]) -> list[VisualInput]:
    """The images of ``messages`` as both render them (tool results, which may be reordered, carry none here)."""
    return [_image(p) for m in messages if isinstance(m.get("content"), list) for p in m["content"]
            if p.get("type") == "image_url"]


def as_release(messages: list[dict]) -> list[dict]:
    """Our messages as the release's encoder reads them: a developer message is a system message (its encoder drops
    the role; its server folds it into the system message first)."""
    return [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]


def check(tok: KimiTokenizer, messages: list[dict], mode: str = "thinking", tools: list[dict] | None = None,
          add_generation_prompt: bool = True, images: Sequence[VisualInput] | None = None, **options: Any) -> None:
    """Ours equals the release: as text (a readable failure), then id for id; images asked for in rendering order."""
    images = images_in_order(messages) if images is None else images
    want, text = release(tok, as_release(messages), mode, tools, add_generation_prompt, images, **options)
    got, seen = ours(tok, messages, mode, tools, add_generation_prompt, **options)
    assert tok.decode(got) == text
    assert got == want
    assert [(v.size, v.grid) for v in seen] == [(v.size, v.grid) for v in images]


# ------------------------------------------------------------------------------------------------
# hypothesis conversations

texts = st.lists(st.sampled_from(FRAGMENTS), max_size=5).map("".join) | st.text(st.characters(codec="utf-8"),
                                                                                max_size=10)
names = st.none() | st.sampled_from(["", "Bob", 'Bob "the" & co', "ok."]) | texts
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**15, 10**15) | st.floats() | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3), max_leaves=6)
argument_dicts = st.dictionaries(texts, json_values, max_size=4)
arguments = (argument_dicts | argument_dicts.map(json.dumps) | argument_dicts.map(lambda d: json.dumps(d, indent=1))
             | st.sampled_from(["", "  ", "not json", "{oops", "[1", None]))
text_parts = st.lists(texts.map(lambda t: {"type": "text", "text": t}), min_size=1, max_size=3)
pictures = st.builds(image_part, st.integers(1, 4000), st.integers(1, 4000), st.integers(2, 8), st.integers(2, 8))
contents = texts | text_parts
visual_contents = contents | st.lists(st.one_of(texts.map(lambda t: {"type": "text", "text": t}), pictures),
                                      min_size=1, max_size=4)
schemas = st.recursive(st.sampled_from([{"type": t} for t in ("string", "integer", "number", "boolean", "null")]),
                       lambda inner: st.builds(lambda ps: {"type": "object", "properties": ps,
                                                           "required": sorted(ps)[:1]},
                                               st.dictionaries(texts, inner, max_size=3))
                       | st.builds(lambda s: {"type": "array", "items": s}, inner), max_leaves=5)
tool_lists = st.lists(st.builds(lambda name, doc, schema: {"type": "function", "function": {
    "name": name, "description": doc, "parameters": {"type": "object", "properties": schema}}},
    texts, texts, st.dictionaries(texts, schemas, max_size=3)), min_size=1, max_size=3)


def _with(draw: st.DrawFn, message: dict, key: str, values: st.SearchStrategy) -> dict:
    value = draw(values)
    return message if value is None else {**message, key: value}


@st.composite
def calls(draw: st.DrawFn) -> list[dict]:
    out = []
    for k in range(draw(st.integers(1, 3))):
        call_id = draw(st.sampled_from([f"c{k}", f"c{k}", f"c{k}", "c0", None]))  # sometimes repeated or absent
        function = {"name": draw(texts)}
        args = draw(arguments)
        if not (args is None and draw(st.booleans())):  # sometimes no "arguments" key at all
            function["arguments"] = args
        out.append({"type": "function", "function": function} | ({} if call_id is None else {"id": call_id}))
    return out


@st.composite
def assistant_turn(draw: st.DrawFn) -> list[dict]:
    """An assistant message and, when it calls tools, some of their results in any order (by id, an unknown id
    leaving the run to be named by position, as the release does)."""
    message = {"role": "assistant", "content": draw(st.none() | contents)}
    message = _with(draw, message, draw(st.sampled_from(["reasoning_content", "reasoning"])), st.none() | texts)
    message = _with(draw, message, "name", names)
    if not draw(st.integers(0, 2)):
        return [message]
    tool_calls = draw(calls())
    turn = [{**message, "tool_calls": tool_calls}]
    order = draw(st.permutations(range(len(tool_calls))))
    for k in order[:draw(st.integers(0, len(tool_calls)))]:
        call_id = draw(st.sampled_from([tool_calls[k].get("id")] * 4 + ["unknown"]))
        result = {"role": "tool", "content": draw(contents)} | ({} if call_id is None else {"tool_call_id": call_id})
        turn.append(_with(draw, result, "name", names))
    return turn


@st.composite
def conversations(draw: st.DrawFn) -> list[dict]:
    messages = []
    if draw(st.booleans()):
        messages.append(_with(draw, {"role": "system", "content": draw(visual_contents)}, "name", names))
    for _ in range(draw(st.integers(1, 3))):
        role = draw(st.sampled_from(["user", "user", "user", "developer", "system"]))
        messages.append(_with(draw, {"role": role, "content": draw(visual_contents)}, "name", names))
        if draw(st.integers(0, 3)):
            messages += draw(assistant_turn())
    return messages


response_formats = st.one_of(
    st.none(), st.just({"type": "text"}), st.just({"type": "json_object"}),
    st.builds(lambda s: {"type": "json_schema", "json_schema": {"name": "answer", "schema": s}}, schemas),
    st.just({"type": "json_schema", "json_schema": {"name": "answer", "strict": True}}))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(conversations(), st.none() | tool_lists, st.sampled_from(MODES), st.sampled_from(EFFORTS),
       st.sampled_from(["auto", "required", "none"]), response_formats, st.booleans())
def test_hypothesis_conversations_render_as_the_release(tok, messages, declared, mode, effort, tool_choice,
                                                        response_format, add_generation_prompt):
    check(tok, messages, mode, declared, add_generation_prompt, thinking_effort=effort, tool_choice=tool_choice,
          response_format=response_format)


# ------------------------------------------------------------------------------------------------
# one explicit case per feature

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
USER = {"role": "user", "content": "Weather in Paris?"}


def _call(call_id: str | None, name: str, arguments: Any) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}} | (
        {} if call_id is None else {"id": call_id})


TYPED = {"s": 'say "hi" <|close|>argument<|sep|> & <b>', "i": -3, "f": 2.5e-07, "t": True, "n": None,
         "o": {"b": [1, {"c": "d"}], "a": 1.0}, "l": [1, "x", None, False]}
CASES = {
    "system, user": ([{"role": "system", "content": "You are K3."}, USER], {}),
    "named messages, escaped": ([{"role": "system", "name": 'Ops "&" co', "content": "x"},
                                 {"role": "user", "name": "ok.", "content": "Hi"}], {}),
    "an empty name is no attribute": ([{"role": "user", "name": "", "content": "Hi"}], {}),
    "multi-turn with reasoning": ([USER, {"role": "assistant", "reasoning_content": "Look it up.", "content": "Sunny."},
                                   {"role": "user", "content": "And tomorrow?"},
                                   {"role": "assistant", "reasoning_content": " \n", "content": "Rain."}], {}),
    "reasoning under the name 'reasoning'": ([USER, {"role": "assistant", "reasoning": "Think.", "content": "x"}], {}),
    "a named assistant": ([USER, {"role": "assistant", "name": "k3", "content": "Hi"}], {}),
    "content parts are separate segments": ([{"role": "user", "content": [{"type": "text", "text": "Hi "},
                                                                          {"type": "text", "text": "again!"}]},
                                             {"role": "assistant", "content": [{"type": "text", "text": "ok."},
                                                                               {"type": "text", "text": '"'}]}], {}),
    "attribute values are separate segments": (
        [USER, {"role": "assistant", "content": "", "tool_calls": [_call("a", "ok.", '{"a.b": "ok."}')]}], {}),
    "typed arguments, string and object": ([USER, {"role": "assistant", "content": None, "tool_calls": [
        _call("a", "f", json.dumps(TYPED)), _call("b", "g", TYPED)]}], {"tools": TOOLS}),
    "raw, blank and absent arguments": ([USER, {"role": "assistant", "content": "", "tool_calls": [
        _call("a", "f", "not json"), _call("b", "g", "  "), _call("c", "h", None),
        {"id": "d", "type": "function", "function": {"name": "i"}}]}], {}),
    "tool results put in call order": ([USER, {"role": "assistant", "content": "", "tool_calls": [
        _call("a", "f", "{}"), _call("b", "g", "{}")]}, {"role": "tool", "tool_call_id": "b", "content": "2"},
        {"role": "tool", "tool_call_id": "a", "content": "1"}], {}),
    "an unknown id names the whole run by position": ([USER, {"role": "assistant", "content": "", "tool_calls": [
        _call("a", "f", "{}"), _call("b", "g", "{}")]}, {"role": "tool", "tool_call_id": "b", "content": "2"},
        {"role": "tool", "tool_call_id": "zzz", "content": "?"}], {}),
    "a result's name when its run is not resolved": ([USER, {"role": "assistant", "content": "", "tool_calls": [
        _call("a", "f", "{}")]}, {"role": "tool", "tool_call_id": "zzz", "name": "lookup", "content": "?"}], {}),
    "a resolved run takes the calls' names": ([USER, {"role": "assistant", "content": "", "tool_calls": [
        _call("a", "f", "{}")]}, {"role": "tool", "tool_call_id": "a", "name": "stale", "content": "1"}], {}),
    "results around a user message are sorted run by run": ([USER, {"role": "assistant", "content": "", "tool_calls": [
        _call("a", "f", "{}"), _call("b", "g", "{}"), _call("c", "h", "{}")]},
        {"role": "tool", "tool_call_id": "c", "content": "3"}, {"role": "user", "content": "hurry"},
        {"role": "tool", "tool_call_id": "b", "content": "2"}, {"role": "tool", "tool_call_id": "a", "content": "1"}],
        {}),
    "tools declared, instruct": ([USER], {"tools": TOOLS, "mode": "instruct"}),
    "tools declared by a system message (lazy-loaded)": ([{"role": "system", "tools": TOOLS}, USER], {}),
    "effort low": ([USER], {"thinking_effort": "low"}),
    "effort high": ([USER], {"thinking_effort": "high"}),
    "effort max": ([USER], {"thinking_effort": "max"}),
    "instruct mode drops the think channel": ([USER, {"role": "assistant", "reasoning_content": "x", "content": "y"}],
                                              {"mode": "instruct"}),
    "no generation prompt": ([USER], {"add_generation_prompt": False}),
    "tool_choice required": ([USER], {"tools": TOOLS, "tool_choice": "required"}),
    "tool_choice none": ([USER], {"tools": TOOLS, "tool_choice": "none"}),
    "response_format json_object": ([USER], {"response_format": {"type": "json_object"}}),
    "response_format json_schema": ([USER], {"response_format": {"type": "json_schema", "json_schema": {
        "name": "w", "schema": {"type": "object", "properties": {"z": {}, "a": {"type": "string"}}}}}}),
    "response_format json_schema without a schema": ([USER], {"response_format": {"type": "json_schema",
                                                                                  "json_schema": {"name": "w"}}}),
    "response_format as a bare string": ([USER], {"response_format": "json_object"}),
    "images in user content": ([{"role": "user", "content": [image_part(640, 480, 6, 8), {"type": "text",
                                                                                            "text": "and"},
                                                               image_part(30, 20, 2, 2)]}], {}),
    "an image in a system message and in an assistant's content": (
        [{"role": "system", "content": [image_part(64, 64, 4, 4)]}, USER,
         {"role": "assistant", "content": [{"type": "text", "text": "see"}, image_part(28, 28, 2, 2)]}], {}),
}


@pytest.mark.parametrize("case", CASES)
def test_feature_renders_as_the_release(tok, case):
    messages, options = CASES[case]
    options = dict(options)
    check(tok, messages, options.pop("mode", "thinking"), options.pop("tools", None),
          options.pop("add_generation_prompt", True), **options)


def test_images_in_reordered_tool_results_are_asked_for_in_rendering_order(tok):
    """A screenshot tool's results, put in call order: the media callback sees the images in the order the prompt
    holds their slots (the order the engine pairs them in)."""
    first, second = image_part(100, 50, 2, 4), image_part(60, 60, 4, 4)
    messages = [USER, {"role": "assistant", "content": "", "tool_calls": [_call("a", "shot", "{}"),
                                                                             _call("b", "shot", "{}")]},
                {"role": "tool", "tool_call_id": "b", "content": [second]},
                {"role": "tool", "tool_call_id": "a", "content": [{"type": "text", "text": "A:"}, first]}]
    check(tok, messages, images=[_image(first), _image(second)])


# ------------------------------------------------------------------------------------------------
# inputs both refuse, and where we deliberately differ


def _refused_by_both(tok: KimiTokenizer, messages: list[dict], match: str, **options: Any) -> None:
    with pytest.raises((ValueError, AssertionError)):
        release(tok, messages, **options)
    with pytest.raises(ValueError, match=match):
        render(messages, tok, **options)


def test_inputs_both_refuse(tok):
    for arguments in ("[1, 2]", '"text"', "3", "null"):
        calls = [_call("a", "f", arguments)]
        _refused_by_both(tok, [USER, {"role": "assistant", "content": "", "tool_calls": calls}],
                         r"messages\[1\]\.tool_calls\[0\]\.function\.arguments: must be a JSON object")
    _refused_by_both(tok, [USER], "thinking_effort", thinking_effort="medium")  # advertised in its text only
    _refused_by_both(tok, [USER, {"role": "tool", "tool_call_id": "a", "content": "r"}], r"messages\[1\]\.tool_call_id")


@pytest.mark.parametrize("messages, field", [
    ([{"role": "user", "content": None}], r"messages\[0\]\.content"),
    ([{"role": "user", "content": [{"type": "input_text", "text": "x"}]}], r"messages\[0\]\.content\[0\]"),
    ([], "messages"),
    ([USER, {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": {}}]}],
     r"messages\[1\]\.tool_calls\[0\]"),
])
def test_we_refuse_what_the_release_reads_loosely(tok, messages, field):
    """A missing content (rendered empty), any part type but images read as text, no messages, a call without its
    ``function`` object: the release renders them; we answer 400 naming the field, as for other malformed input."""
    release(tok, messages)
    with pytest.raises(ValueError, match=field):
        render(messages, tok)


def test_deliberate_differences(tok):
    # a developer message: the release's encoder drops it without a word; we render it as a system message in place
    developer = [{"role": "developer", "content": "Be brief."}, USER]
    assert "Be brief." not in release(tok, developer)[1]
    assert render_text(developer, tok) == release(tok, as_release(developer))[1]
    # the release's own keys on a tool message (``tool`` for its name, ``id`` for ``tool_call_id``) are not OpenAI's
    calls = [_call("a", "f", "{}"), _call("b", "g", "{}")]
    keyed = [USER, {"role": "assistant", "content": "", "tool_calls": calls},
             {"role": "tool", "id": "b", "tool": "g", "content": "2"}]
    assert 'tool="g"' in release(tok, keyed)[1] and 'tool="f"' in render_text(keyed, tok)
    # the processor's placeholder literal in a user's text is text to us, not an image
    literal = [{"role": "user", "content": [{"type": "text", "text": encoding_k3.IMAGE_PLACEHOLDER}]}]
    assert "<|media_begin|>" in release(tok, literal, images=[_image(image_part(28, 28, 2, 2))])[1]
    assert encoding_k3.IMAGE_PLACEHOLDER in render_text(literal, tok)
    # an effort is always one of EFFORTS: the release ignores one unchecked in instruct mode, and None (its
    # processor's default is "max") leaves the effort message out
    release(tok, [USER], "instruct", thinking_effort="medium")
    assert "thinking-effort" not in release(tok, [USER], thinking_effort=None)[1]
    for effort in ("medium", None):
        with pytest.raises(ValueError, match="thinking_effort"):
            render([USER], tok, "instruct" if effort else "thinking", thinking_effort=effort)
