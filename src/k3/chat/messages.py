"""OpenAI chat messages, checked (the parts both chat formats share, `k3.chat.native` and `k3.chat.xtml`): roles,
content strings and content-part lists (text, and images through a `Media` callback), tool calls and tool
definitions, compact JSON (parsed only up to :data:`MAX_JSON_DEPTH` levels deep). Every problem is a ValueError
naming the field (``messages[2].content[0].text``)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from k3.tokenization.image import VisualInput

MODES = ("thinking", "instruct")
ROLES = ("system", "developer", "user", "assistant", "tool")
#: Lone surrogates: text that no UTF-8 tokenizer can encode.
SURROGATE = re.compile(r"[\ud800-\udfff]")


#: Deepest nesting of the JSON parsed from text here (tool-call arguments, a tools channel): deeper text is not
#: parsed, so neither the parser nor what later walks the value can exhaust Python's recursion limit.
MAX_JSON_DEPTH = 128
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def parse_json(text: str) -> Any:
    """The JSON value of ``text``; ``ValueError`` if it is not JSON or nests deeper than :data:`MAX_JSON_DEPTH`."""
    if _too_deep(text):
        raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return json.loads(text)


def _too_deep(text: str) -> bool:
    """Whether brackets outside the strings of ``text`` nest deeper than :data:`MAX_JSON_DEPTH`."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:  # the common case, without a scan
        return False
    brackets = np.frombuffer(_NOT_BRACKET.sub("", _STRING.sub("", text)).encode("ascii"), np.uint8)
    steps = np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1)
    return int(np.cumsum(steps).max(initial=0)) > MAX_JSON_DEPTH


def loads(text: Any) -> Any:
    """The JSON value of ``text``, or ``None`` if it is not a string holding JSON within :data:`MAX_JSON_DEPTH`."""
    try:
        return parse_json(text) if isinstance(text, str) else None
    except ValueError:
        return None


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")


#: Turns an ``image_url`` content part (and where it is) into the image's model input (`VisualInput.tokens` slots).
Media = Callable[[dict, str], VisualInput]


def content_text(content: Any, where: str) -> str:
    """A string, or the concatenated text of an OpenAI content-part list."""
    return "".join(content_pieces(content, where, None))


def content_pieces(content: Any, where: str, media: Media | None) -> list[str | VisualInput]:
    """A string, or an OpenAI content-part list as text pieces and, where ``media`` is given, the images of its
    ``image_url`` parts (refused without it)."""
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        got = "nothing" if content is None else type(content).__name__
        raise ValueError(f"{where}: expected a string or a list of content parts, got {got}")
    pieces: list[str | VisualInput] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image_url" and media is not None:
            pieces.append(media(part, f"{where}[{j}]"))
            continue
        if kind != "text":
            if isinstance(kind, str):
                raise ValueError(f"{where}[{j}]: content part type {kind!r} is not supported by this server"
                                 + (" for this model" if kind == "image_url" else ""))
            raise ValueError(f"{where}[{j}]: expected a content part object with a 'type'")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{j}].text: expected a string")
        pieces.append(part["text"])
    return pieces


def checked_calls(calls: Any, where: str, id_required: bool = True) -> list[tuple[int, dict, dict]]:
    """``(j, call, function)`` of each OpenAI tool call, its shape checked (``ValueError`` naming the field)."""
    if not isinstance(calls, list):
        raise ValueError(f"{where}: expected a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        cid = call.get("id") if isinstance(call, dict) else None
        if (not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or call.get("type", "function") !=
                "function" or not (isinstance(cid, str) or (cid is None and not id_required))):
            raise ValueError(f"{where}[{j}]: expected {{'id': str, 'type': 'function', 'function': {{'name': str}}}}")
        out.append((j, call, fn))
    return out


def message_role(i: int, m: Any) -> tuple[str, str]:
    """``(where, role)`` of message ``i``: an object with a known role whose optional fields have their types
    (``name``, ``tool_call_id``, ``reasoning_content``: strings; ``tool_calls``: a list), else ``ValueError`` naming
    the field."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise ValueError(f"{where}: expected an object, got {type(m).__name__}")
    role = m.get("role")
    if role not in ROLES:
        raise ValueError(f"{where}.role: unknown role {role!r}; expected one of {', '.join(ROLES)}")
    for key, kind, name in (("name", str, "a string"), ("tool_call_id", str, "a string"),
                            ("reasoning_content", str, "a string"), ("tool_calls", list, "a list of tool calls")):
        if m.get(key) is not None and not isinstance(m[key], kind):
            raise ValueError(f"{where}.{key}: expected {name}, got {type(m[key]).__name__}")
    return where, role


def functions(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise ValueError(f"tools: expected a list, got {type(tools).__name__}")
    fns = []
    for j, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type") != "function" or not isinstance(fn.get("name"), str):
            raise ValueError(f"tools[{j}]: expected {{'type': 'function', 'function': {{'name': str, ...}}}}")
        fns.append(fn)
    return fns
