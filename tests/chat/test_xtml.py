"""The K3 release chat format (XTML): golden renderings, tool-call parsing (ours and mlx-lm's), the streaming parser."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3.chat.xtml import MODES, AssistantParser, parse_tool_calls, render, render_text, stop_ids
from k3.tokenization.kimi import KimiTokenizer
from kimi_fixtures import TEXTS, build_kimi_tokenizer_files

U = '<|open|>message role="user"<|sep|>'
A = '<|open|>message role="assistant"<|sep|>'
END = "<|close|>message<|sep|><|end_of_msg|>"
EFFORT = ('<|open|>message role="system" type="thinking-effort"<|sep|>`thinking_effort` guides on how much to think '
          "in your thinking channel (not including the response channel), supported values include `low`, `medium`, "
          "`high`, and `max`.\nNow the system is invoked with `thinking_effort=max`.<|close|>message<|sep|>"
          "<|end_of_msg|>")  # what the release's apply_chat_template adds in thinking mode (default effort "max")


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> KimiTokenizer:
    return build_kimi_tokenizer_files(tmp_path_factory.mktemp("kimi"), [f"{t} {i}" for i in range(5) for t in TEXTS])


def check(tok, golden: str, messages, mode="thinking", tools=None, add_generation_prompt=True):
    """The rendering is ``golden``, with the markers as special ids and every text run encoded as plain text."""
    assert render_text(messages, tok, mode, tools, add_generation_prompt) == golden
    assert render(messages, tok, mode, tools, add_generation_prompt) == tok.encode(golden, allow_special=True)


# ------------------------------------------------------------------------------------------------
# rendering: hand-written goldens

def test_system_user_generation_prompt(tok):
    messages = [{"role": "system", "content": "You are K3."}, {"role": "user", "content": "Hi there"}]
    head = ('<|open|>message role="system"<|sep|>You are K3.<|close|>message<|sep|><|end_of_msg|>'
            '<|open|>message role="user"<|sep|>Hi there<|close|>message<|sep|><|end_of_msg|>')
    check(tok, EFFORT + head + '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>', messages, "thinking")
    check(tok, head + '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>', messages, "instruct")
    check(tok, EFFORT + head, messages, add_generation_prompt=False)
    low = EFFORT.replace("thinking_effort=max", "thinking_effort=low")
    assert render_text(messages, tok, thinking_effort="low") == low + head + A + "<|open|>think<|sep|>"
    with pytest.raises(ValueError, match="thinking_effort: expected one of"):
        render(messages, tok, thinking_effort="medium")  # advertised in the release's text, refused by its code


def test_multi_turn_with_reasoning(tok):
    messages = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "reasoning_content": "Greet back.", "content": "Hi!"},
        {"role": "user", "content": "Again"},
        {"role": "assistant", "reasoning_content": " \n ", "content": [{"type": "text", "text": "Hi "},
                                                                      {"type": "text", "text": "again!"}]},
        {"role": "developer", "content": "Be brief."},
    ]
    check(tok, EFFORT + (
        "<|open|>message role=\"user\"<|sep|>Hello<|close|>message<|sep|><|end_of_msg|>"
        "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>Greet back.<|close|>think<|sep|>"
        "<|open|>response<|sep|>Hi!<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
        "<|open|>message role=\"user\"<|sep|>Again<|close|>message<|sep|><|end_of_msg|>"
        "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|><|close|>think<|sep|>"
        "<|open|>response<|sep|>Hi again!<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
        "<|open|>message role=\"system\"<|sep|>Be brief.<|close|>message<|sep|><|end_of_msg|>"
        "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>"
    ), messages)
    check(tok, (
        f"{U}Hello{END}{A}<|open|>response<|sep|>Hi!<|close|>response<|sep|>{END}{U}Again{END}"
        f"{A}<|open|>response<|sep|>Hi again!<|close|>response<|sep|>{END}"
        f'<|open|>message role="system"<|sep|>Be brief.{END}{A}<|open|>response<|sep|>'
    ), messages, "instruct")


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALLS = [
    {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                  "arguments": '{"city": "Paris", "days": 3, "opts": {"unit": "C"}}'}},
    {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}},
]
TOOL_TURN = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "reasoning_content": "Need tools.", "content": "Checking.", "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
    {"role": "tool", "tool_call_id": "c1", "content": "18°C"},
]
CALLS_TEXT = (
    '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
    '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
    '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>'
    '<|open|>argument key="opts" type="object"<|sep|>{"unit": "C"}<|close|>argument<|sep|>'
    '<|close|>call<|sep|><|open|>call tool="get_time" index="2"<|sep|>'
    '<|open|>argument key="zone" type="string"<|sep|>CET<|close|>argument<|sep|><|close|>call<|sep|>'
    "<|close|>tools<|sep|>"
)


def test_tool_calls_results_and_declaration(tok):
    declare = (
        '<|open|>message role="system" type="tool-declare"<|sep|># Tools\n'
        "Here are the available tools, described in JSONSchema.\n\n```json\n"
        '[{"function":{"description":"Current weather","name":"get_weather","parameters":{"properties":'
        '{"city":{"type":"string"}},"required":["city"],"type":"object"}},"type":"function"}]\n```'
        "<|close|>message<|sep|><|end_of_msg|>"
    )
    body = (
        f"{U}Weather in Paris?{END}{A}<|open|>think<|sep|>Need tools.<|close|>think<|sep|>"
        f"<|open|>response<|sep|>Checking.<|close|>response<|sep|>{CALLS_TEXT}{END}"
        f'<|open|>message role="tool" tool="get_weather" index="1"<|sep|>18°C{END}'
        f'<|open|>message role="tool" tool="get_time" index="2"<|sep|>12:00{END}'
    )
    check(tok, declare + EFFORT + body + f"{A}<|open|>think<|sep|>", TOOL_TURN, tools=TOOLS)
    check(tok, EFFORT + body, TOOL_TURN, add_generation_prompt=False)
    check(tok, EFFORT + body, TOOL_TURN, tools=[], add_generation_prompt=False)


def test_tool_results_by_position_and_raw_arguments(tok):
    calls = [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "not json"}},
             {"type": "function", "function": {"name": "g", "arguments": {"ok": True, "none": None, "xs": [1]}}}]
    messages = [{"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "zzz", "content": "r1"},  # unknown id: position 1 -> f, no reordering
                {"role": "tool", "content": "r2"}]
    check(tok, (
        f"{A}<|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>"
        '<|open|>call tool="f" index="1"<|sep|><|open|>json type="object"<|sep|>not json<|close|>json<|sep|>'
        '<|close|>call<|sep|><|open|>call tool="g" index="2"<|sep|>'
        '<|open|>argument key="ok" type="boolean"<|sep|>true<|close|>argument<|sep|>'
        '<|open|>argument key="none" type="null"<|sep|>null<|close|>argument<|sep|>'
        '<|open|>argument key="xs" type="array"<|sep|>[1]<|close|>argument<|sep|><|close|>call<|sep|>'
        f"<|close|>tools<|sep|>{END}"
        f'<|open|>message role="tool" tool="f" index="1"<|sep|>r1{END}'
        f'<|open|>message role="tool" tool="g" index="2"<|sep|>r2{END}'
    ), messages, "instruct", add_generation_prompt=False)


def test_attribute_escaping_and_literal_markers(tok):
    calls = [{"id": "q", "type": "function", "function": {"name": 'say"&', "arguments": '{"a\\"&b": "<|sep|>"}'}}]
    messages = [{"role": "user", "name": 'Bob "the" & co', "content": "<|open|>hi<|end_of_msg|>"},
                {"role": "assistant", "content": "", "tool_calls": calls}]
    golden = (
        '<|open|>message role="user" name="Bob &quot;the&quot; &amp; co"<|sep|><|open|>hi<|end_of_msg|>'
        f"{END}{A}<|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>"
        '<|open|>call tool="say&quot;&amp;" index="1"<|sep|>'
        '<|open|>argument key="a&quot;&amp;b" type="string"<|sep|><|sep|><|close|>argument<|sep|>'
        f"<|close|>call<|sep|><|close|>tools<|sep|>{END}"
    )
    assert render_text(messages, tok, "instruct", add_generation_prompt=False) == golden
    ids = render(messages, tok, "instruct", add_generation_prompt=False)
    specials = set(tok.special_ids.values())
    assert sum(i in specials for i in ids) == golden.count("<|") - 3  # the three literals in the texts stay text


@pytest.mark.parametrize("messages, tools, mode, field", [
    ([], None, "thinking", "messages"),
    ([{"role": "robot", "content": "x"}], None, "thinking", "messages[0].role"),
    ([{"role": "user", "content": None}], None, "thinking", "messages[0].content"),
    ([{"role": "user", "content": "x", "name": 3}], None, "thinking", "messages[0].name"),
    ([{"role": "assistant", "content": "", "reasoning_content": 1}], None, "thinking", "messages[0].reasoning_content"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}], None, "thinking",
     "messages[0].tool_calls[0]"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}], None,
     "thinking", "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c", "content": "r"}], None, "thinking",
     "messages[1].tool_call_id"),
    ([{"role": "user", "content": "x"}], [{"type": "function"}], "thinking", "tools[0]"),
    ([{"role": "user", "content": "x"}], None, "chatty", "mode"),
    ([{"role": "user", "content": "bad \ud800"}], None, "thinking", "surrogate"),
])
def test_invalid_input_names_the_field(tok, messages, tools, mode, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        render(messages, tok, mode, tools)


# ------------------------------------------------------------------------------------------------
# tool-call parsing

def _section(text: str) -> str:
    start = text.index("<|open|>tools<|sep|>")
    end = text.index("<|close|>tools<|sep|>") + len("<|close|>tools<|sep|>")
    return text[start:end]


texts = st.text(st.characters(codec="utf-8"), max_size=8)  # valid Unicode: no lone surrogates
json_values = st.recursive(st.none() | st.booleans() | st.integers() | texts
                           | st.floats(allow_nan=False, allow_infinity=False),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
                           max_leaves=6)
names = st.text(st.characters(codec="utf-8", exclude_characters="<"), min_size=1, max_size=10)
keys = st.text(st.characters(codec="utf-8", exclude_characters="<"), max_size=6)
call_lists = st.lists(st.tuples(names, st.dictionaries(keys, json_values, max_size=4)), min_size=1, max_size=3)


@settings(max_examples=60, deadline=None)
@given(call_lists)
def test_mlx_lm_parses_our_tools_section(tok, calls):
    kimi_k3 = pytest.importorskip("mlx_lm.tool_parsers.kimi_k3")
    openai_calls = [{"id": f"c{k}", "type": "function",
                     "function": {"name": name, "arguments": json.dumps(args)}} for k, (name, args) in enumerate(calls)]
    text = render_text([{"role": "assistant", "content": "ok", "tool_calls": openai_calls}], tok, "instruct",
                       add_generation_prompt=False)
    section = _section(text)
    assert [(c["name"], c["arguments"]) for c in kimi_k3.parse_tool_call(section)] == calls
    ours = parse_tool_calls(section)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in ours] == calls


marker_text = st.lists(st.sampled_from(["<|open|>", "<|close|>", "<|sep|>", "argument", "call", "tools", "json",
                                         ' key="admin" type="boolean"', '"', "x", "\n", "true"]),
                       max_size=8).map("".join)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(names, st.dictionaries(keys | marker_text, marker_text | json_values, max_size=3)),
                min_size=1, max_size=2))
def test_the_parser_reads_calls_from_the_ids_whatever_their_text_spells(tok, calls):
    """Argument keys and values that spell markers are rendered as text ids; the streaming parser, which sees the
    ids, gives back exactly the calls (text parsing cannot: `parse_tool_calls` reads those literals as markers)."""
    openai_calls = [{"id": f"c{k}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
                    for k, (name, args) in enumerate(calls)]
    ids = render([{"role": "assistant", "content": "ok", "tool_calls": openai_calls}], tok, "instruct",
                 add_generation_prompt=False)
    parser = AssistantParser(tok, "instruct")
    streamed = "".join(text for t in ids for channel, text in parser.feed(t) if channel == "tools")
    assert parser.ended
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parser.tool_calls()] == calls
    text = tok.decode(ids)  # what a malformed section would show, as before
    assert streamed == text[text.index("<|open|>tools<|sep|>"):text.rindex("<|close|>tools<|sep|>") + 21]


def test_a_special_token_inside_a_tools_section_spoils_it(tok):
    head = '<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|><|open|>argument key="a" type="string"<|sep|>'
    tail = "<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>"
    for middle, calls in (("x", [("f", {"a": "x"})]), ("x<|media_pad|>y", None)):
        parser = AssistantParser(tok, "instruct")
        for t in tok.encode(head + middle + tail, allow_special=True):
            parser.feed(t)
        found = parser.tool_calls()
        assert (found if found is None else [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                             for c in found]) == calls


def test_parse_hand_written_tools_section():
    text = (
        '<|open|>tools<|sep|>\n<|open|>call tool="search&amp;go" index="1"<|sep|>\n'
        '  <|open|>argument key="q" type="string"<|sep|>say "hi"\n<|close|>argument<|sep|>\n'
        '  <|open|>argument key="n" type="number"<|sep|>2.5<|close|>argument<|sep|>\n'
        '  <|open|>argument key="flag" type="boolean"<|sep|>false<|close|>argument<|sep|>\n'
        '  <|open|>argument key="tags" type="array"<|sep|>["a", "b"]<|close|>argument<|sep|>\n'
        '<|close|>call<|sep|><|open|>call tool="noop" index="2"<|sep|><|close|>call<|sep|>'
        '<|open|>call tool="raw" index="3"<|sep|><|open|>json type="object"<|sep|>{"x": {"y": null}}'
        "<|close|>json<|sep|><|close|>call<|sep|>\n<|close|>tools<|sep|>"
    )
    assert parse_tool_calls(text) == [
        {"id": "call_0", "type": "function", "function": {
            "name": "search&go", "arguments": '{"q":"say \\"hi\\"\\n","n":2.5,"flag":false,"tags":["a","b"]}'}},
        {"id": "call_1", "type": "function", "function": {"name": "noop", "arguments": "{}"}},
        {"id": "call_2", "type": "function", "function": {"name": "raw", "arguments": '{"x":{"y":null}}'}},
    ]


@pytest.mark.parametrize("text", [
    "",
    "just words",
    '<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|><|open|>argument key="a" type="string"<|sep|>x',
    '<|open|>call index="1"<|sep|><|close|>call<|sep|>',
    '<|open|>call tool="f"<|sep|><|open|>argument type="string"<|sep|>x<|close|>argument<|sep|><|close|>call<|sep|>',
    '<|open|>call tool="f"<|sep|><|open|>argument key="a" type="number"<|sep|>x<|close|>argument<|sep|>'
    "<|close|>call<|sep|>",
    '<|open|>call tool="f"<|sep|><|open|>json type="object"<|sep|>[1]<|close|>json<|sep|><|close|>call<|sep|>',
    '<|open|>call tool="f"<|sep|><|close|>call<|sep|>trailing text',
])
def test_parse_rejects_malformed(text):
    assert parse_tool_calls(text) is None


# ------------------------------------------------------------------------------------------------
# the streaming parser

def _run(parser: AssistantParser, ids: list[int]) -> dict[str, str]:
    out = {"reasoning": "", "content": "", "tools": ""}
    for t in ids:
        for channel, delta in parser.feed(t):
            out[channel] += delta
    for channel, delta in parser.flush():
        out[channel] += delta
    return out


def _generated(tok, reasoning: str, content: str, tools_text: str | None, mode: str) -> list[int]:
    """Ids a model would write after the generation prompt: text runs as plain text, markers as ids."""
    m = {name: tok.special_id(name) for name in ("open", "close", "sep", "end_of_msg")}
    tag = lambda kind, name: [m[kind], *tok.encode(name), m["sep"]]
    ids = [*tok.encode(reasoning), *tag("close", "think"), *tag("open", "response")] if mode == "thinking" else []
    ids += [*tok.encode(content), *tag("close", "response")]
    ids += tok.encode(tools_text, allow_special=True) if tools_text else []
    return ids + [*tag("close", "message"), m["end_of_msg"]]


@settings(max_examples=80, deadline=None)
@given(st.text(max_size=30) | st.sampled_from(["", "<|open|>think<|sep|>", "🙂 中文"]), st.text(max_size=30),
       st.sampled_from(MODES), st.booleans())
def test_parser_splits_channels_exactly(tok, reasoning, content, mode, with_tools):
    section = CALLS_TEXT if with_tools else None
    parser = AssistantParser(tok, mode)
    got = _run(parser, _generated(tok, reasoning, content, section, mode) + tok.encode("ignored after the end"))
    assert parser.ended
    assert got == {"reasoning": reasoning if mode == "thinking" else "", "content": content, "tools": section or ""}
    if with_tools:
        assert [c["function"]["name"] for c in parse_tool_calls(got["tools"])] == ["get_weather", "get_time"]


def test_parser_stops_and_flush(tok):
    assert stop_ids(tok) == (tok.special_id("end_of_msg"), tok.eos_id)
    parser = AssistantParser(tok, "instruct")
    emoji = list("🙂".encode())  # single-byte tokens have rank == byte
    assert parser.feed(emoji[0]) == []  # an incomplete character is held back
    assert _run(parser, [*emoji[1:], tok.special_id("close"), *tok.encode("resp")]) == {
        "reasoning": "", "content": "🙂", "tools": ""}  # the unfinished tag is dropped at flush
    parser = AssistantParser(tok, "thinking")
    assert _run(parser, [*tok.encode("why"), tok.eos_id, *tok.encode("more")]) == {
        "reasoning": "why", "content": "", "tools": ""}
    assert parser.ended
    parser = AssistantParser(tok, "instruct")
    cut = tok.encode('x<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="f"', allow_special=True)
    assert _run(parser, cut) == {"reasoning": "", "content": "x",
                                 "tools": '<|open|>tools<|sep|><|open|>call tool="f"'}
    assert parse_tool_calls('<|open|>tools<|sep|><|open|>call tool="f"') is None


def test_arguments_that_are_json_but_not_an_object_are_refused(tok):
    calls = [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "[1, 2]"}}]
    with pytest.raises(ValueError, match=r"messages\[0\]\.tool_calls\[0\]\.function\.arguments: must be a JSON object"):
        render([{"role": "assistant", "content": "", "tool_calls": calls}], tok)


def test_tool_choice_and_response_format_messages(tok):
    """The release's encoder appends these system messages after the conversation (written out by hand)."""
    messages = [{"role": "user", "content": "Hi"}]
    choice = ('<|open|>message role="system" type="tool-choice"<|sep|>The system is invoked with '
              "`tool_choice=required`.\nYou MUST call tools in the next message.<|close|>message<|sep|><|end_of_msg|>")
    raw = ("The system is invoked with `response_format=json_schema`.\nYour response must be raw JSON data without "
           "markdown code blocks (```json) or any additional formatting.\nThe JSON data must match the following "
           'schema:\n```json\n{"properties":{"a":{"type":"integer"}},"type":"object"}\n```')
    fmt = f'<|open|>message role="system" type="response-format"<|sep|>{raw}<|close|>message<|sep|><|end_of_msg|>'
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    got = render_text(messages, tok, "instruct", tool_choice="required",
                      response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert got == f"{U}Hi{END}{choice}{fmt}{A}<|open|>response<|sep|>"
    none = render_text(messages, tok, "instruct", tool_choice="none", response_format={"type": "json_object"})
    assert "You MUST NOT call any tools in the next message." in none and "`response_format=json_object`" in none
