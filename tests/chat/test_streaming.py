"""Issue 38, item 4: the streaming parse of a rendered assistant turn, for both chat formats, gives exactly the turn
that was rendered (reasoning, content, tool calls), fed one id at a time, under any tokenization of its text.

The engine feeds `AssistantParser` one sampled id at a time and the HTTP route streams each id's text deltas as they
come (`k3.serve.engine.outputs`), so the splits a client sees are token boundaries; a model may sample any
tokenization of a text, not BPE's, so the texts are also re-tokenized at arbitrary byte offsets (a piece that is not
whole UTF-8 as single-byte tokens). The expected values come from the generated message, not from the parsers, and
are compared exactly: no marker text reaches content or reasoning unless the message's own text spells it.
"""

from __future__ import annotations

import json
from types import ModuleType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3.chat import native, xtml
from k3.tokenization.bpe import SPECIAL_TOKENS
from kimi_fixtures import SPECIALS, TEXTS, build_kimi_tokenizer_files

USER = {"role": "user", "content": "hello world"}
#: Markup-looking text, this project's and the release's special-token literals and XTML tags among it.
FRAGMENTS = ["<", ">", "&", '"', "'", "\n", "\\", "&amp;", "&quot;", "<think>", "</tool_call>", '{"a": 1}', "[", "🙂",
             "中文", "é", " ", "\t", '="x"', *SPECIAL_TOKENS, *SPECIALS.values(), '<|open|>call tool="f"<|sep|>',
             "<|close|>argument<|sep|>", "<|close|>call<|sep|>", "<|close|>tools<|sep|>"]
TEXT = st.lists(st.text(st.characters(codec="utf-8"), max_size=6) | st.sampled_from(FRAGMENTS), max_size=5).map(
    "".join)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3), max_leaves=8)
CALLS = st.lists(st.tuples(TEXT.filter(bool), TEXT, st.dictionaries(TEXT, JSON, max_size=4)), max_size=3)
#: The XTML markers' literals: in a tools section's text they cannot be told from the markers (see `k3.chat.xtml`).
XTML_MARKERS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")


def parsable(fmt: ModuleType, calls: list) -> bool:
    """Whether ``calls`` can be told apart from markup in ``fmt``'s tools section (always, but for XTML literals)."""
    return fmt is native or not any(m in repr(calls) for m in XTML_MARKERS)


@pytest.fixture(scope="module")
def chats(tok, tmp_path_factory) -> dict[str, tuple[ModuleType, object]]:
    """Each format with its tokenizer: ours with the serving tests' BPE, the release's with the Kimi fixture's."""
    kimi = build_kimi_tokenizer_files(tmp_path_factory.mktemp("kimi"), [f"{t} {i}" for i in range(5) for t in TEXTS])
    return {"native": (native, tok), "xtml": (xtml, kimi)}


def turn(reasoning: str, content: str, calls: list[tuple[str, str, dict]]) -> dict:
    """The OpenAI assistant message generated for a test."""
    tool_calls = [{"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
                  for name, cid, args in calls]
    return {"role": "assistant", "reasoning_content": reasoning, "content": content, "tool_calls": tool_calls}


def expected(fmt: ModuleType, mode: str, message: dict) -> dict:
    """What the parse must give: the message's reasoning (thinking mode; XTML writes a blank one empty), content and
    calls (XTML has no call ids: they are numbered)."""
    reasoning = message["reasoning_content"] if mode == "thinking" else ""
    reasoning = reasoning if fmt is native or reasoning.strip() else ""
    calls = [{"id": c["id"] if fmt is native else f"call_{k}", "type": "function", "function": {
        "name": c["function"]["name"], "arguments": json.dumps(json.loads(c["function"]["arguments"]),
                                                               ensure_ascii=False, separators=(",", ":"))}}
             for k, c in enumerate(message["tool_calls"])]
    return {"reasoning": reasoning, "content": message["content"], "tool_calls": calls or None}


def generated(fmt: ModuleType, tok, mode: str, message: dict) -> list[int]:
    """The ids a model writes after the generation prompt to produce ``message``: its rendering's tail."""
    prompt = fmt.render([USER], tok, mode)
    ids = fmt.render([USER, message], tok, mode, add_generation_prompt=False)
    assert ids[:len(prompt)] == prompt
    return ids[len(prompt):]


def whole(fmt: ModuleType, tok, mode: str, message: dict) -> dict | list[dict] | None:
    """The non-incremental parse of the rendered ``message``: `native.parse`'s message, or the tool calls of the
    XTML tools section cut from the decoded text (the last one: content may spell its tags, calls do not here)."""
    ids = fmt.render([USER, message], tok, mode, add_generation_prompt=False)
    if fmt is native:
        m = native.parse(ids, tok)[0][-1]
        return {"reasoning": m.get("reasoning_content", ""), "content": m["content"], "tool_calls": m.get("tool_calls")}
    if not message["tool_calls"]:
        return None
    text, start, end = tok.decode(ids), "<|open|>tools<|sep|>", "<|close|>tools<|sep|>"
    return xtml.parse_tool_calls(text[text.rindex(start):text.rindex(end) + len(end)])


def stream(fmt: ModuleType, tok, mode: str, ids: list[int]) -> dict:
    """The channel texts of ``ids`` fed one at a time, then a flush, as the engine does (each delta non-empty)."""
    parser, got = fmt.AssistantParser(tok, mode), {"reasoning": "", "content": "", "tools": "", "ended": False}
    for channel, text in [d for t in ids for d in parser.feed(t)] + parser.flush():
        assert text
        got[channel] += text
    return {**got, "ended": parser.ended}


def parsed(fmt: ModuleType, tok, mode: str, ids: list[int]) -> dict:
    """The streamed turn of a complete message, its tools channel parsed as the route does."""
    got = stream(fmt, tok, mode, ids)
    assert got.pop("ended")
    tools = got.pop("tools")
    return {**got, "tool_calls": fmt.parse_tool_calls(tools) if tools else None}


def retokenized(tok, ids: list[int], data: st.DataObject) -> list[int]:
    """``ids`` with each run of text between special ids cut at drawn byte offsets and each piece tokenized alone
    (a piece that is not whole UTF-8 as single-byte tokens): another tokenization a model may sample."""
    pieces = tok.token_bytes()
    byte_id = {p[0]: i for i, p in enumerate(pieces) if len(p) == 1}
    out: list[int] = []
    run = b""
    for t in [*ids, None]:
        if t is not None and pieces[t]:
            run += pieces[t]
            continue
        cuts = sorted(data.draw(st.sets(st.integers(0, len(run)), max_size=6)) | {0, len(run)})
        for a, b in zip(cuts, cuts[1:]):
            try:
                out += tok.encode(run[a:b].decode())
            except UnicodeDecodeError:
                out += [byte_id[x] for x in run[a:b]]
        out += [] if t is None else [t]
        run = b""
    assert tok.decode(out) == tok.decode(ids)
    return out


@pytest.mark.parametrize("name", ["native", "xtml"])
@settings(max_examples=150, deadline=None)
@given(mode=st.sampled_from(native.MODES), reasoning=TEXT, content=TEXT, data=st.data())
def test_streamed_turn_is_the_rendered_turn(chats, name, mode, reasoning, content, data):
    fmt, tok = chats[name]
    calls = data.draw(CALLS.filter(lambda calls: parsable(fmt, calls)), "calls")
    message = turn(reasoning, content, calls)
    ids = generated(fmt, tok, mode, message)
    want = expected(fmt, mode, message)
    assert parsed(fmt, tok, mode, ids) == want
    assert whole(fmt, tok, mode, message) == (want if fmt is native else want["tool_calls"])
    assert parsed(fmt, tok, mode, retokenized(tok, ids, data)) == want


@pytest.mark.parametrize("name", ["native", "xtml"])
@settings(max_examples=100, deadline=None)
@given(mode=st.sampled_from(native.MODES), content=TEXT, data=st.data())
def test_a_tools_section_cut_by_the_token_limit_is_kept_as_text(chats, name, mode, content, data):
    """The engine flushes the parser when ``max_tokens`` cuts the turn (anywhere; right after a marker, where the
    parsers decide, as often): the tools channel holds the section's text up to the cut (XTML's with its opening tag,
    ours without its marker) and does not parse, so the route falls back to it."""
    fmt, tok = chats[name]
    calls = data.draw(CALLS.filter(lambda calls: calls and parsable(fmt, calls)), "calls")
    without = generated(fmt, tok, mode, turn("", content, []))
    ids = generated(fmt, tok, mode, turn("", content, calls))
    start = next(k for k, (a, b) in enumerate(zip(without, ids)) if a != b)  # where the tools section opens
    opened = start + 1 if fmt is native else ids.index(tok.special_id("sep"), start) + 1  # its opening markup read
    end = len(ids) - len(without) + start  # where it closes
    pieces = tok.token_bytes()
    after_markup = [k + 1 for k in range(opened, end - 1) if not pieces[ids[k]]]
    cut = data.draw(st.integers(opened, end - 1) | st.sampled_from(after_markup or [opened]), "cut")
    got = stream(fmt, tok, mode, ids[:cut])
    assert (got["content"], got["ended"]) == (content, False)
    assert got["tools"] == tok.decode(ids[start if fmt is xtml else opened:cut])  # XTML's keeps its tags
    assert not got["tools"] or fmt.parse_tool_calls(got["tools"]) is None


# ------------------------------------------------------------------------------------------------
# malformed tool sections: the raw section text is kept (the route puts it in content), no calls

CALL = '<|open|>call tool="f" index="1"<|sep|>'
ARG = '<|open|>argument key="a" type="{}"<|sep|>{}<|close|>argument<|sep|>'
MALFORMED = {  # the generated turn after the instruct prompt's "response" opening, and its raw tools section
    "native": [
        ('Checking.<|tools|>[{"name":"f","arguments":{"a":', '[{"name":"f","arguments":{"a":'),  # cut by max_tokens
        ('Checking.<|tools|>[{"name":"f","arguments":{a:1}}]<|end|>', '[{"name":"f","arguments":{a:1}}]'),
        ('Checking.<|tools|>[{"name":"f","arguments":"{}"}]<|end|>', '[{"name":"f","arguments":"{}"}]'),
        ("Checking.<|tools|>[]<|end|>", "[]"),
        ('Checking.<|tools|><tool_call>{"name":"f"}</tool_call><|end|>', '<tool_call>{"name":"f"}</tool_call>'),
        ('Checking.<|tools|>[{"name":"f",<|user|>"arguments":{}}]<|end|>',  # unknown markup inside
         '[{"name":"f",<|user|>"arguments":{}}]'),
    ],
    "xtml": [
        (f"Checking.<|close|>response<|sep|><|open|>tools<|sep|>{CALL}<|close|>call<|sep|>",  # cut by max_tokens
         f"<|open|>tools<|sep|>{CALL}<|close|>call<|sep|>"),
        ('Checking.<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="f',  # cut inside a tag
         '<|open|>tools<|sep|><|open|>call tool="f'),
        (f"Checking.<|close|>response<|sep|><|open|>tools<|sep|>{CALL}<|close|>call<|sep|>"  # the turn closes it
         "<|close|>message<|sep|><|end_of_msg|>", f"<|open|>tools<|sep|>{CALL}<|close|>call<|sep|>"),
        (f"Checking.<|close|>response<|sep|><|open|>tools<|sep|>{CALL}<|open|>argument key=\"a\" type=\"string\"<|sep|>"
         "x<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>",  # unclosed argument
         f'<|open|>tools<|sep|>{CALL}<|open|>argument key="a" type="string"<|sep|>x<|close|>call<|sep|>'
         "<|close|>tools<|sep|>"),
        (f"Checking.<|close|>response<|sep|><|open|>tools<|sep|>{CALL}{ARG.format('number', 'x')}<|close|>call<|sep|>"
         "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>",
         f"<|open|>tools<|sep|>{CALL}{ARG.format('number', 'x')}<|close|>call<|sep|><|close|>tools<|sep|>"),
        (f"Checking.<|close|>response<|sep|><|open|>tools<|sep|>{CALL}<|open|>json type=\"object\"<|sep|>{{a}}"
         "<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>",
         f'<|open|>tools<|sep|>{CALL}<|open|>json type="object"<|sep|>{{a}}<|close|>json<|sep|><|close|>call<|sep|>'
         "<|close|>tools<|sep|>"),
        (f"Checking.<|close|>response<|sep|><|open|>tools<|sep|>{CALL}<|open|>note<|sep|>hi<|close|>note<|sep|>"
         "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>",  # unknown markup inside
         f"<|open|>tools<|sep|>{CALL}<|open|>note<|sep|>hi<|close|>note<|sep|><|close|>call<|sep|>"
         "<|close|>tools<|sep|>"),
        ("Checking.<|close|>response<|sep|><|open|>tools<|sep|><|close|>tools<|sep|><|close|>message<|sep|>"
         "<|end_of_msg|>", "<|open|>tools<|sep|><|close|>tools<|sep|>"),
    ],
}


@pytest.mark.parametrize("name, turn_text, section", [pytest.param(n, *c, id=f"{n}-{k}")
                                                      for n, cases in MALFORMED.items() for k, c in enumerate(cases)])
def test_a_malformed_tools_section_is_kept_as_text(chats, name, turn_text, section):
    fmt, tok = chats[name]
    got = stream(fmt, tok, "instruct", tok.encode(turn_text, allow_special=True))
    assert (got["content"], got["tools"]) == ("Checking.", section)
    assert fmt.parse_tool_calls(section) is None


def test_a_call_outside_a_tools_section_is_a_call(chats):
    """The release's wrapper is optional (as for `xtml.parse_tool_calls`): the model's call is not dropped."""
    fmt, tok = chats["xtml"]
    turn_text = f"Checking.<|close|>response<|sep|>{CALL}{ARG.format('string', '<b>')}<|close|>call<|sep|>"
    got = parsed(fmt, tok, "instruct", tok.encode(turn_text + "<|close|>message<|sep|><|end_of_msg|>",
                                                     allow_special=True))
    assert got == {"reasoning": "", "content": "Checking.", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": '{"a":"<b>"}'}}]}
