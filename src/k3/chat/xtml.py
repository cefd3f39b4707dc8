"""The Kimi K3 release chat format ("XTML"): OpenAI-style messages -> token ids, and a streaming output parser.

The serving interface of :mod:`k3.chat.native` (``MODES``, ``render``, ``AssistantParser``, ...) for tokenizers with
``chat_format == "xtml"``. Markers are the special tokens ``<|open|>``, ``<|sep|>``, ``<|close|>``, ``<|end_of_msg|>``:
a tag opens as ``<|open|>NAME key="value"<|sep|>`` (values escape ``&`` then ``"``) and closes as
``<|close|>NAME<|sep|>``. Markers are inserted as ids; the text is encoded with ``tokenizer.encode`` in the
segments the release's encoder (``encoding_k3.build_chat_segments``) cuts it into, each on its own so that no merge
crosses from one into the next: a tag's name; per attribute `` key``, ``="``, the value, ``"``; each text part of a
content; a reasoning; an argument's value (so a literal ``"<|open|>"`` in content stays text).

* user / system (a developer message is a system message): ``<|open|>message role="user"[ name="..."]<|sep|>``,
  the content, ``<|close|>message<|sep|><|end_of_msg|>`` (an empty name is no attribute); with tools, a first
  system message ``role="system" type="tool-declare"`` lists them as sorted compact JSON; in thinking mode a system
  message ``type="thinking-effort"`` follows (effort ``max`` by default); a system message with ``tools`` declares
  them where it stands instead ("## New Tools Available", the release's lazy loading);
* assistant: ``message role="assistant"[ name="..."]`` holding ``think`` (thinking mode, always; ``reasoning_content``
  or ``reasoning``), ``response`` and, with tool calls, ``tools`` of ``call tool="NAME" index="k"`` blocks of typed
  ``argument key="K" type="T"`` blocks (absent or blank arguments: none; text that is not JSON: a ``json`` block);
* tool result: ``message role="tool" tool="NAME" index="n"``, ``n`` counting the results since the assistant
  message. A run of consecutive results whose ids all name its calls is put in call order and named by them; in any
  other run each result is named by its ``name``, else by the call at its position;
* images, in any message's content: ``<|media_begin|>image WxH<|media_content|>``, one ``<|media_pad|>`` per visual
  token, ``<|media_end|>``, asked of ``media`` in the order the prompt holds them;
* generation prompt: ``<|open|>message role="assistant"<|sep|>`` + ``<|open|>think<|sep|>`` (thinking) or
  ``<|open|>response<|sep|>`` (instruct).

Fallback for a malformed tools section (cut short by the token limit, an unclosed tag, an argument whose text is not
of its ``type``, a ``json`` block that is not an object, markup other than ``call``/``argument``/``json``, no call):
:func:`parse_tool_calls` gives ``None`` and the chat route puts the section's raw text (the tools channel as
`AssistantParser` streamed it, its markers written as literals) at the end of ``content``, with no ``tool_calls`` —
never an empty call list with the text dropped. The section is not streamed as content while it is generated: whether
it is calls is known only when it ends. The chat route parses the section from the ids (`AssistantParser.tool_calls`):
a marker is a marker only where the model emitted its special token, so text that spells ``<|close|>argument<|sep|>``
inside an argument stays that argument's text; a stray special token inside the section makes it malformed. Parsing
text (:func:`parse_tool_calls`, and the release's own parsers) cannot tell such text from the markers.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Sequence
from typing import Any

from k3.chat.messages import (
    MODES,
    SURROGATE,
    Media,
    check_mode,
    checked_calls,
    content_pieces,
    dumps,
    functions,
    loads,
    message_role,
    parse_json,
)
from k3.tokenization.detok import IncrementalDetokenizer
from k3.tokenization.image import VisualInput

__all__ = ["MODES", "AssistantParser", "parse_tool_calls", "render", "render_text", "stop_ids"]

#: This format lays out images (``render(..., media=...)``): ``<|media_begin|>image WxH<|media_content|>``, one
#: ``<|media_pad|>`` per visual token, ``<|media_end|>`` (the release's processor; W×H the original size), in any
#: message.
IMAGES = True


class _Marker(str):
    """The bare name of a marker special token (``"open"`` -> ``<|open|>``), as opposed to text."""


OPEN, CLOSE, SEP, END = _Marker("open"), _Marker("close"), _Marker("sep"), _Marker("end_of_msg")
_Parts = list[str]  # text and _Marker items
_TOOLS_HEAD = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n"
_NEW_TOOLS_HEAD = ("## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
                   "You have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n"
                   "```json\n")
_JSON_TYPES = ((bool, "boolean"), (type(None), "null"), ((int, float), "number"), (str, "string"), (dict, "object"),
               (list, "array"))
_CHANNELS = {"think": "reasoning", "response": "content", "tools": "tools", "call": "tools"}  # opening tag -> channel
EFFORTS = ("low", "high", "max")
_RAW_JSON = ("The system is invoked with `response_format={}`.\nYour response must be raw JSON data without markdown "
             "code blocks (```json) or any additional formatting.")
_EFFORT = ("`thinking_effort` guides on how much to think in your thinking channel (not including the response "
           "channel), supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked with "
           "`thinking_effort={}`.")
# A tools section is parsed in its *form*: each marker one lone surrogate (`_FORM`), which no decoded text holds, so
# text never reads as a marker; `_STRAY` stands for any other special token, which spoils the section.
_FORM = {OPEN: "\ud800", CLOSE: "\ud801", SEP: "\ud802"}
_STRAY = "\ud803"
_WRAP = ("\ud800tools\ud802", "\ud801tools\ud802")
_CALL = re.compile("\\s*\ud800call([^\ud802]*)\ud802(.*?)\ud801call\ud802", re.S)
_ARG = re.compile("\\s*\ud800(argument|json)([^\ud802]*)\ud802(.*?)\ud801\\1\ud802", re.S)
_ATTR = re.compile(r' (\w+)="([^"]*)"')


def stop_ids(tokenizer: Any) -> tuple[int, ...]:
    """Ids that end an assistant message: ``<|end_of_msg|>`` and eos."""
    return tokenizer.special_id(END), tokenizer.eos_id


# ------------------------------------------------------------------------------------------------
# validation


def _call_arguments(args: Any, where: str) -> dict | str:
    """A call's arguments as the release reads them: absent or blank -> ``{}``, a JSON object (text or dict) -> keyed
    arguments, text that is not JSON -> kept raw (a ``json`` block); JSON that is no object is refused."""
    if args is None or isinstance(args, str) and not args.strip():
        return {}
    if isinstance(args, dict):
        return args
    if not isinstance(args, str):
        raise ValueError(f"{where}: expected a JSON string, got {type(args).__name__}")
    try:
        value = parse_json(args)
    except ValueError:  # not JSON (or nested deeper than MAX_JSON_DEPTH): the raw text
        return args
    if not isinstance(value, dict):
        raise ValueError(f"{where}: must be a JSON object, got {args!r:.80}")
    return value


def _calls(calls: Any, where: str) -> list[dict]:
    """``[{"id": str | None, "name": str, "arguments": dict | str}]``."""
    return [{"id": call.get("id"), "name": fn["name"], "arguments": _call_arguments(
                fn.get("arguments"), f"{where}[{j}].function.arguments")}
            for j, call, fn in checked_calls(calls, where, id_required=False)]


def _message(i: int, m: Any) -> dict:
    """Message ``i`` checked, with what the release reads of it; its content is read while rendering (images then
    come in the order the prompt holds them)."""
    where, role = message_role(i, m)
    out = {"role": "system" if role == "developer" else role, "where": where, "content": m.get("content")}
    if m.get("name") is not None:
        out["name"] = m["name"]
    if role == "assistant":
        reasoning = m.get("reasoning_content") or m.get("reasoning")  # the release reads either name
        if reasoning is not None and not isinstance(reasoning, str):
            raise ValueError(f"{where}.reasoning: expected a string, got {type(reasoning).__name__}")
        out["reasoning"] = reasoning or ""
        out["calls"] = _calls(m.get("tool_calls") or [], f"{where}.tool_calls")
    elif role == "tool":
        out["tool_call_id"] = m.get("tool_call_id")
    elif out["role"] == "system" and m.get("tools"):  # tools declared mid-conversation (the release's lazy loading)
        try:
            functions(m["tools"])
        except ValueError as err:
            raise ValueError(f"{where}.{err}") from None
        out["tools"] = m["tools"]
    return out


def _resolve_results(msgs: list[dict]) -> list[dict]:
    """``msgs`` with each tool result given its ``tool`` name and 1-based ``index`` among the results since the last
    assistant message, as the release: a run of consecutive results whose ids all name that message's calls is put in
    call order and named by them; any other run keeps its order, each result named by its ``name``, else by the call
    at its position."""
    out: list[dict] = []
    calls: list[dict] = []
    position: dict[str, int] = {}
    n = 0
    for results, run in itertools.groupby(msgs, lambda m: m["role"] == "tool"):
        run = list(run)
        if not results:
            for m in run:
                if m["role"] == "assistant":  # the first of repeated ids names the call
                    calls, n = m["calls"], 0
                    position = {c["id"]: k for k, c in reversed(list(enumerate(calls))) if c["id"] is not None}
            out += run
            continue
        by_id = all(r["tool_call_id"] in position for r in run)
        if by_id:
            run.sort(key=lambda r: position[r["tool_call_id"]])
        for r in run:
            n += 1
            k = position[r["tool_call_id"]] if by_id else n - 1
            name = calls[k]["name"] if by_id else r.get("name", calls[k]["name"] if k < len(calls) else None)
            if name is None:
                raise ValueError(f"{r['where']}.tool_call_id: {r['tool_call_id']!r} names no tool call of the "
                                 f"preceding assistant message, which has no call #{n} either, and the result has no "
                                 "name")
            out.append({**r, "tool": name, "index": n})
    return out


# ------------------------------------------------------------------------------------------------
# rendering


def _escape(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def _open(name: str, *attrs: tuple[str, str]) -> _Parts:
    """A tag, each attribute four segments as the release cuts them: `` key``, ``="``, the escaped value, ``"``."""
    return [OPEN, name, *(p for k, v in attrs for p in (f" {k}", '="', _escape(v), '"')), SEP]


def _block(name: str, body: _Parts, *attrs: tuple[str, str]) -> _Parts:
    return [*_open(name, *attrs), *body, CLOSE, name, SEP]


def _system(kind: str, body: str) -> _Parts:
    """A system message the format adds itself (``type="tool-declare"``, ``"thinking-effort"``)."""
    return [*_block("message", [body], ("role", "system"), ("type", kind)), END]


def _declare(head: str, tools: list[dict]) -> _Parts:
    return _system("tool-declare", head + json.dumps(tools, ensure_ascii=False, separators=(",", ":"),
                                                     sort_keys=True) + "\n```")


def _json_type(value: Any) -> str:
    return next(name for kind, name in _JSON_TYPES if isinstance(value, kind))


def _call(k: int, call: dict) -> _Parts:
    args = call["arguments"]
    if isinstance(args, dict):
        body = [p for key, v in args.items() for p in _block(
            "argument", [v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)], ("key", key),
            ("type", _json_type(v)))]
    else:
        body = _block("json", [args], ("type", "object"))
    return _block("call", body, ("tool", call["name"]), ("index", str(k)))


def _content(m: dict, media: Media | None) -> _Parts:
    """A message's content, each text part a segment of its own and each image laid out (asked of ``media`` now:
    images are read in the order the prompt holds them)."""
    if m["content"] is None and m["role"] == "assistant":
        return []
    pieces = content_pieces(m["content"], f"{m['where']}.content", media)
    return [q for p in pieces for q in ([p] if isinstance(p, str) else _image(p))]


def _render_message(m: dict, thinking: bool, media: Media | None) -> _Parts:
    role = m["role"]
    if "tools" in m:
        return _declare(_NEW_TOOLS_HEAD, m["tools"])
    attrs = [("role", role)]
    if role == "tool":
        attrs += [("tool", m["tool"]), ("index", str(m["index"]))]
    elif m.get("name"):  # an empty name is no attribute, as the release
        attrs.append(("name", m["name"]))
    body = _content(m, media)
    if role == "assistant":
        body = _block("response", body)
        if thinking:
            body = _block("think", [m["reasoning"] if m["reasoning"].strip() else ""]) + body
        if m["calls"]:
            body += _block("tools", [p for k, call in enumerate(m["calls"], 1) for p in _call(k, call)])
    return [*_block("message", body, *attrs), END]


def _image(image: VisualInput) -> _Parts:
    width, height = image.size
    return [_Marker("media_begin"), f"image {width}x{height}", _Marker("media_content"),
            *[_Marker("media_pad")] * image.tokens, _Marker("media_end")]


def _response_schema(response_format: Any) -> Any:
    """The schema of a ``json_schema`` response format as the release reads it: ``json_schema.schema``, else the
    ``json_schema`` object's own ``json_schema``, else that object itself."""
    spec = response_format.get("json_schema") if isinstance(response_format, dict) else None
    return spec.get("schema", spec.get("json_schema", spec)) if isinstance(spec, dict) else spec


def _encode(parts: _Parts, tokenizer: Any) -> list[int]:
    """Marker ids, and each text piece encoded on its own as plain text (the release's segments: merges never cross
    from one piece into the next)."""
    ids: list[int] = []
    for p in parts:
        if isinstance(p, _Marker):
            ids.append(tokenizer.special_id(p))
            continue
        if SURROGATE.search(p):
            raise ValueError(f"text {p[:40]!r}... contains a lone surrogate, which is not valid Unicode")
        ids += tokenizer.encode(p)
    return ids


def render(messages: Sequence[dict], tokenizer: Any, mode: str = "thinking", tools: list[dict] | None = None,
           add_generation_prompt: bool = True, thinking_effort: str = "max", tool_choice: str = "auto",
           response_format: dict | str | None = None, media: Media | None = None) -> list[int]:
    """Token ids of a conversation in the XTML format; ``ValueError`` naming the field for invalid input.

    In thinking mode a ``thinking-effort`` system message follows the tool declaration, as the release's
    ``apply_chat_template`` writes it (its default effort is ``"max"``; ``"low"`` and ``"high"`` are accepted).
    After the conversation, as the release's encoder does: a ``tool-choice`` message for ``tool_choice``
    ``"required"`` or ``"none"`` and a ``response-format`` message for a JSON ``response_format`` (an object with a
    ``type``, or the type alone). ``media`` turns the ``image_url`` parts of any message into images.
    """
    check_mode(mode)
    if thinking_effort not in EFFORTS:
        raise ValueError(f"thinking_effort: expected one of {EFFORTS}, got {thinking_effort!r}")
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages: expected a non-empty list")
    msgs = _resolve_results([_message(i, m) for i, m in enumerate(messages)])
    thinking = mode == "thinking"
    parts: _Parts = []
    if tools is not None and functions(tools):
        parts += _declare(_TOOLS_HEAD, tools)
    if thinking:
        parts += _system("thinking-effort", _EFFORT.format(thinking_effort))
    for m in msgs:
        parts += _render_message(m, thinking, media)
    if tool_choice in ("required", "none"):
        parts += _system("tool-choice", f"The system is invoked with `tool_choice={tool_choice}`.\nYou MUST "
                                        f"{'call tools' if tool_choice == 'required' else 'NOT call any tools'} in the "
                                        "next message.")
    kind = response_format.get("type") if isinstance(response_format, dict) else response_format
    if kind in ("json_object", "json_schema"):
        body = _RAW_JSON.format(kind)
        if kind == "json_schema":
            body += ("\nThe JSON data must match the following schema:\n```json\n"
                     + json.dumps(_response_schema(response_format), ensure_ascii=False, separators=(",", ":"),
                                  sort_keys=True) + "\n```")
        parts += _system("response-format", body)
    if add_generation_prompt:
        parts += [*_open("message", ("role", "assistant")), *_open("think" if thinking else "response")]
    return _encode(parts, tokenizer)


def render_text(messages: Sequence[dict], tokenizer: Any, mode: str = "thinking", tools: list[dict] | None = None,
                add_generation_prompt: bool = True, **options: Any) -> str:
    """:func:`render` decoded to text, special tokens as literals (for display and debugging)."""
    return tokenizer.decode(render(messages, tokenizer, mode, tools, add_generation_prompt, **options))


# ------------------------------------------------------------------------------------------------
# parsing


def _attrs(text: str) -> dict[str, str]:
    return {k: v.replace("&quot;", '"').replace("&amp;", "&") for k, v in _ATTR.findall(text)}


def _blocks(pattern: re.Pattern[str], text: str) -> list[re.Match[str]] | None:
    """Consecutive matches of ``pattern`` covering ``text`` up to whitespace, or ``None``."""
    found, pos = [], 0
    while text[pos:].strip():
        if (m := pattern.match(text, pos)) is None:
            return None
        found.append(m)
        pos = m.end()
    return found


def _arguments(body: str) -> dict | None:
    blocks = _blocks(_ARG, body)
    if blocks is None:
        return None
    if any(b[1] == "json" for b in blocks):
        value = loads(blocks[0][3]) if len(blocks) == 1 else None
        return value if isinstance(value, dict) else None
    args = {}
    for b in blocks:
        attrs = _attrs(b[2])
        if "key" not in attrs:
            return None
        try:
            args[attrs["key"]] = b[3] if attrs.get("type", "string") == "string" else parse_json(b[3])
        except ValueError:
            return None
    return args


def parse_tool_calls(text: str) -> list[dict] | None:
    """A tools section's text (``call`` blocks, with both ``tools`` tags or neither, markers as their literals) ->
    OpenAI tool_calls, every marker literal read as a marker (`AssistantParser.tool_calls` reads the ids instead).

    ``None`` unless the text is well-formed calls only: not for a section cut off by the token limit (one ``tools``
    tag alone), an unclosed tag, an invalid argument, other markup, or no call at all.
    """
    if SURROGATE.search(text):
        return None
    for marker, char in _FORM.items():
        text = text.replace(f"<|{marker}|>", char)
    return _parse_form(text)


def _parse_form(form: str) -> list[dict] | None:
    """`parse_tool_calls` of a section's form (`_FORM`)."""
    if _STRAY in form:
        return None
    body = form.strip()
    wrapped = body.startswith(_WRAP[0]), body.endswith(_WRAP[1])
    if wrapped[0] != wrapped[1]:
        return None
    body = body[len(_WRAP[0]):-len(_WRAP[1])] if wrapped[0] else body
    calls = []
    for i, m in enumerate(_blocks(_CALL, body) or ()):
        name, args = _attrs(m[1]).get("tool"), _arguments(m[2])
        if not name or args is None:
            return None
        calls.append({"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": dumps(args)}})
    return calls or None


class AssistantParser:
    """Incremental parser of generated ids: ``feed(id)`` -> ``[(channel, text delta), ...]``.

    Generation starts in ``"reasoning"`` (thinking) or ``"content"`` (instruct). A tag (``<|open|>`` or ``<|close|>``
    up to ``<|sep|>``) is held back until complete: opening ``think``/``response``/``tools`` switches to the
    reasoning/content/tools channel, any other tag leaves text unrouted until the next one. The tools section (opened
    by ``tools``, or by a ``call`` that lacks it) goes to ``"tools"`` verbatim, its markers as literals (the text
    shown when it does not parse), until ``tools`` closes (included) or the message does (not included); other marker
    text is never emitted. `tool_calls` parses the section from the ids. ``<|end_of_msg|>`` or eos ends the message
    (``ended``; later ids are ignored).
    """

    def __init__(self, tokenizer: Any, mode: str = "thinking") -> None:
        check_mode(mode)
        self.tokenizer = tokenizer
        self.channel: str | None = "reasoning" if mode == "thinking" else "content"
        self.ended = False
        self._open, self._close, self._sep = (tokenizer.special_id(m) for m in (OPEN, CLOSE, SEP))
        self._stops = set(stop_ids(tokenizer))
        self._special = set(tokenizer.special_ids.values())
        self._tag: list[int] | None = None  # ids of the tag being read
        self._detok = IncrementalDetokenizer(tokenizer)
        self._form: list[str] = []  # the tools section's form (`_FORM`), built from the ids

    def tool_calls(self) -> list[dict] | None:
        """The tools section read so far as OpenAI tool calls, markers taken only from marker ids; ``None`` when
        there is none or it is malformed (`parse_tool_calls`)."""
        return _parse_form("".join(self._form)) if self._form else None

    def feed(self, token_id: int) -> list[tuple[str, str]]:
        t = int(token_id)
        if self.ended:
            return []
        if t in self._stops:
            self.ended = True
            return self.flush()
        if self._tag is not None:
            self._tag.append(t)
            return self._end_tag() if t == self._sep else []
        if t in (self._open, self._close):
            self._tag = [t]
            return self._drain()
        if t in self._special:
            return self._drain() + self._emit(self.tokenizer.decode([t]), _STRAY) if self.channel == "tools" else []
        return self._emit(self._detok.push(t))

    def flush(self) -> list[tuple[str, str]]:
        """The held-back remainder: pending text (an incomplete character becomes U+FFFD) and, in the tools
        section, an unfinished tag."""
        out = self._drain()
        if self._tag is not None and self.channel == "tools":
            out += self._emit(self.tokenizer.decode(self._tag), _STRAY)
        self._tag = None
        return out

    def _end_tag(self) -> list[tuple[str, str]]:
        ids, self._tag = self._tag, None
        opening, inner = ids[0] == self._open, self.tokenizer.decode(ids[1:-1])
        name = inner.split(" ", 1)[0]
        form = _STRAY if self._special.intersection(ids[1:-1]) else (
            _FORM[OPEN if opening else CLOSE] + inner + _FORM[SEP])
        if self.channel == "tools":
            if not opening and name == "message":  # the turn ends a section left open (which then does not parse)
                self.channel = None
                return []
            out = self._emit(self.tokenizer.decode(ids), form)
            if not opening and name == "tools":
                self.channel = None
            return out
        self.channel = _CHANNELS.get(name) if opening else None
        return self._emit(self.tokenizer.decode(ids), form) if self.channel == "tools" else []

    def _drain(self) -> list[tuple[str, str]]:
        out = self._emit(self._detok.flush())
        self._detok = IncrementalDetokenizer(self.tokenizer)
        return out

    def _emit(self, text: str, form: str | None = None) -> list[tuple[str, str]]:
        """``text`` on the current channel; in the tools section, ``form`` (else the text itself) joins its form."""
        if self.channel == "tools" and text:
            self._form.append(text if form is None else form)
        return [(self.channel, text)] if text and self.channel else []
