"""The K3 chat format (SPEC Appendix F): OpenAI-style messages <-> token ids, and a streaming output parser.

Special tokens are inserted as ids; every piece of text is encoded on its own with ``tokenizer.encode`` (so
literal ``"<|end|>"`` in content stays text). JSON is compact (``separators=(",", ":")``, ``ensure_ascii=False``).

* system / developer: ``<|system|>{content}[<|tools|>{functions}]<|end|>`` (tools only on the first message;
  an empty system message is prepended to carry them when the conversation does not start with one);
* user: ``<|user|>{content}<|end|>``; tool result: ``<|tool|>{tool_call_id}\\n{content}<|end|>``;
* assistant: ``<|assistant|>[<|think|>{reasoning}]<|response|>{content}[<|tools|>{calls}]<|end|>`` — the think
  channel is always present in thinking mode (even empty) and always absent in instruct mode;
* generation prompt: ``<|assistant|><|think|>`` (thinking) or ``<|assistant|><|response|>`` (instruct).

Fallback for a malformed tools section (cut short by the token limit, invalid JSON, not a list of
``{"id", "name", "arguments": {...}}`` calls, stray special tokens inside): :func:`parse_tool_calls` gives ``None``
and the chat route puts the section's raw text (the tools channel as `AssistantParser` streamed it) at the end of
``content``, with no ``tool_calls`` — never an empty call list with the text dropped. The tools channel is never
streamed as content while it is generated: whether it is calls is known only when it ends.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from k3.chat.messages import (
    MODES,
    SURROGATE,
    Media,
    check_mode,
    checked_calls,
    content_pieces,
    content_text,
    dumps,
    functions,
    loads,
    message_role,
)
from k3.tokenization.bpe import NUM_SPECIAL_TOKENS, SPECIAL_TOKENS, Tokenizer
from k3.tokenization.detok import IncrementalDetokenizer
from k3.tokenization.image import VisualInput

#: This format lays out images (``render(..., media=...)``).
IMAGES = True

__all__ = ["MODES", "AssistantParser", "format_tool_calls", "normalize", "parse", "parse_tool_calls", "render",
           "render_text", "stop_ids"]

_EOS, _SYSTEM, _USER, _ASSISTANT, _TOOL, _THINK, _RESPONSE, _TOOLS, _END = (
    SPECIAL_TOKENS.index(f"<|{name}|>")
    for name in ("eos", "system", "user", "assistant", "tool", "think", "response", "tools", "end")
)
_Segments = list[tuple[int | None, list[int]]]  # (channel marker or None for the leading text, text ids)
_CHANNELS = {_THINK: "reasoning", _RESPONSE: "content", _TOOLS: "tools"}
# allowed channel layouts of a parsed message; None is the text right after the role token
_LAYOUTS = {_SYSTEM: {(None,), (None, _TOOLS)}, _USER: {(None,)}, _TOOL: {(None,)},
            _ASSISTANT: {(None, *c, _RESPONSE, *t) for c in ((), (_THINK,)) for t in ((), (_TOOLS,))}}


def _tool_calls(calls: Any, where: str) -> list[dict]:
    """Validated OpenAI tool_calls with canonically re-serialised arguments."""
    out = []
    for j, call, fn in checked_calls(calls, where):
        args = fn.get("arguments")
        if not isinstance(obj := loads(args), dict):
            raise ValueError(f"{where}[{j}].function.arguments: expected a JSON object string, got {args!r:.80}")
        out.append({"id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": dumps(obj)}})
    return out


def _message(i: int, m: Any, mode: str, media: Media | None = None) -> dict:
    where, role = message_role(i, m)
    if role != "assistant":
        pieces = content_pieces(m.get("content"), f"{where}.content", media if role == "user" else None)
        out = {"role": "system" if role == "developer" else role,
               "content": "".join(p for p in pieces if isinstance(p, str))}
        if any(isinstance(p, VisualInput) for p in pieces):
            out["pieces"] = pieces  # text and images in order (`render` lays images out as placeholder slots)
        if role == "tool":
            cid = m.get("tool_call_id")
            if not isinstance(cid, str) or not cid or "\n" in cid:
                raise ValueError(f"{where}.tool_call_id: required, a non-empty string without newlines, got {cid!r}")
            out["tool_call_id"] = cid
        return out
    content = m.get("content")
    out = {"role": "assistant", "content": "" if content is None else content_text(content, f"{where}.content")}
    if mode == "thinking":
        out["reasoning_content"] = m.get("reasoning_content") or ""
    if m.get("tool_calls"):
        out["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
    return out


def normalize(messages: Sequence[dict], mode: str = "thinking", tools: list[dict] | None = None,
              media: Media | None = None) -> list[dict]:
    """The messages as ``parse(render(messages, mode=mode, tools=tools))`` returns them.

    Content becomes a string, developer becomes system, reasoning is dropped (instruct) or defaults to ``""``
    (thinking), tool-call arguments are re-serialised canonically, and with tools a leading empty system message
    before a non-system one is dropped (it is indistinguishable from the one render adds to carry the tools).
    """
    check_mode(mode)
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages: expected a non-empty list")
    return _drop_carrier([_message(i, m, mode, media) for i, m in enumerate(messages)], tools)


def _drop_carrier(msgs: list[dict], tools: Any) -> list[dict]:
    """Without the empty system message that render puts before a non-system first message to carry the tools."""
    carrier = tools and len(msgs) > 1 and msgs[0] == {"role": "system", "content": ""} and msgs[1]["role"] != "system"
    return msgs[1:] if carrier else msgs


def format_tool_calls(tool_calls: list[dict]) -> str:
    """OpenAI tool_calls -> the tools-channel JSON ``[{"id", "name", "arguments": {...}}, ...]``."""
    calls = _tool_calls(tool_calls, "tool_calls")
    return dumps([{"id": c["id"], "name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                   for c in calls])


def parse_tool_calls(text: str) -> list[dict] | None:
    """Tools-channel JSON (a list of calls or one call) -> OpenAI tool_calls; ``None`` if it is not tool-call JSON."""
    data = loads(text)
    items = [data] if isinstance(data, dict) else data
    if not isinstance(items, list) or not items:
        return None
    calls = []
    for i, item in enumerate(items):
        if not (isinstance(item, dict) and isinstance(item.get("name"), str)
                and isinstance(item.get("arguments"), dict) and isinstance(item.get("id", ""), str)):
            return None
        fn = {"name": item["name"], "arguments": dumps(item["arguments"])}
        calls.append({"id": item.get("id", f"call_{i}"), "type": "function", "function": fn})
    return calls


def render(messages: Sequence[dict], tokenizer: Tokenizer, mode: str = "thinking", tools: list[dict] | None = None,
           add_generation_prompt: bool = True, tool_choice: str = "auto",
           response_format: dict | None = None, media: Media | None = None) -> list[int]:
    """Token ids of a conversation in the K3 chat format; ``ValueError`` naming the field for invalid input.

    ``tool_choice="none"`` leaves the tools out. The format has no words for a forced tool call or a
    ``response_format``: those are enforced by constrained decoding alone (`k3.serve.engine.structured`). With
    ``media``, a user message's ``image_url`` parts become ``<|media|>`` slots, one per visual token, in place."""
    tools = None if tool_choice == "none" else tools
    msgs = normalize(messages, mode, media=media)
    slot = tokenizer.special_id("media")
    thinking = mode == "thinking"
    tool_text = dumps(functions(tools)) if tools is not None else None
    if tools and msgs[0]["role"] != "system":
        msgs.insert(0, {"role": "system", "content": ""})
    ids: list[int] = []

    def emit(*pieces: str | int | list[int]) -> None:
        for p in pieces:
            if isinstance(p, int):
                ids.append(p)
            elif isinstance(p, list):
                ids.extend(p)
            elif SURROGATE.search(p):
                raise ValueError(f"text {p[:40]!r}... contains a lone surrogate, which is not valid Unicode")
            else:
                ids.extend(tokenizer.encode(p))

    for i, m in enumerate(msgs):
        if m["role"] == "system":
            emit(_SYSTEM, m["content"], *((_TOOLS, tool_text) if tools and i == 0 else ()), _END)
        elif m["role"] == "user":
            emit(_USER, *(p if isinstance(p, str) else [slot] * p.tokens for p in m.get("pieces", [m["content"]])),
                 _END)
        elif m["role"] == "tool":
            emit(_TOOL, f"{m['tool_call_id']}\n{m['content']}", _END)
        else:
            emit(_ASSISTANT, *((_THINK, m["reasoning_content"]) if thinking else ()), _RESPONSE, m["content"])
            emit(*((_TOOLS, format_tool_calls(m["tool_calls"])) if "tool_calls" in m else ()), _END)
    if add_generation_prompt:
        emit(_ASSISTANT, _THINK if thinking else _RESPONSE)
    return ids


def render_text(messages: Sequence[dict], tokenizer: Tokenizer, mode: str = "thinking",
                tools: list[dict] | None = None, add_generation_prompt: bool = True) -> str:
    """:func:`render` decoded to text, special tokens as literals (for display and debugging)."""
    return tokenizer.decode(render(messages, tokenizer, mode, tools, add_generation_prompt))


def parse(ids: Iterable[int], tokenizer: Tokenizer) -> tuple[list[dict], list[dict] | None]:
    """Inverse of :func:`render` (without generation prompt): ``(normalised messages, tools or None)``."""
    raw: list[tuple[int, _Segments]] = []  # (role id, segments) of each complete message
    cur: tuple[int, _Segments] | None = None
    for pos, t in enumerate(map(int, ids)):
        if cur is None:
            if t not in _LAYOUTS:
                raise ValueError(f"token {pos} (id {t}): expected a role token")
            cur = (t, [(None, [])])
        elif t == _END:
            raw.append(cur)
            cur = None
        elif t in _CHANNELS:
            cur[1].append((t, []))
        elif t < NUM_SPECIAL_TOKENS:
            raise ValueError(f"token {pos}: unexpected {SPECIAL_TOKENS[t]} inside a message")
        else:
            cur[1][-1][1].append(t)
    if cur is not None:
        raise ValueError("unterminated message: no <|end|> at the end")
    messages: list[dict] = []
    tools = None
    for k, (role, segments) in enumerate(raw):
        text = {marker: tokenizer.decode(seg) for marker, seg in segments}
        if (tuple(marker for marker, _ in segments) not in _LAYOUTS[role] or (role == _ASSISTANT and text[None])
                or (role == _SYSTEM and _TOOLS in text and k > 0)):
            raise ValueError(f"message {k}: malformed {SPECIAL_TOKENS[role]} message")
        if role == _ASSISTANT:
            msg = {"role": "assistant", "content": text[_RESPONSE]}
            if _THINK in text:
                msg["reasoning_content"] = text[_THINK]
            if _TOOLS in text:
                if (calls := parse_tool_calls(text[_TOOLS])) is None:
                    raise ValueError(f"message {k}: the tools channel is not valid tool-call JSON")
                msg["tool_calls"] = calls
            messages.append(msg)
        elif role == _TOOL:
            cid, sep, content = text[None].partition("\n")
            if not sep or not cid:
                raise ValueError(f"message {k}: a tool message must start with '<tool_call_id>\\n'")
            messages.append({"role": "tool", "tool_call_id": cid, "content": content})
        else:
            messages.append({"role": "system" if role == _SYSTEM else "user", "content": text[None]})
            if _TOOLS in text:  # only the first system message may carry them (checked above)
                fns = loads(text[_TOOLS])
                if not isinstance(fns, list) or not all(isinstance(f, dict) for f in fns):
                    raise ValueError(f"message {k}: the tools channel is not a JSON list of function objects")
                tools = [{"type": "function", "function": f} for f in fns]
    return _drop_carrier(messages, tools), tools


def stop_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """Ids that end an assistant message: ``<|end|>`` and ``<|eos|>``."""
    return tokenizer.special_id("end"), tokenizer.eos_id


class AssistantParser:
    """Incremental parser of generated ids: ``feed(id)`` -> ``[(channel, text delta), ...]``.

    Channels are ``"reasoning"``, ``"content"`` and ``"tools"``; generation starts in reasoning (thinking mode) or
    content (instruct). ``<|think|>``/``<|response|>``/``<|tools|>`` switch channel, ``<|end|>``/``<|eos|>`` end the
    message (``ended``; later ids are ignored), other special tokens are dropped, except in the tools channel, which
    writes them as their literals (a section holding one is malformed: it stays text, see the module's fallback).
    `tool_calls` parses the tools channel from the ids.
    """

    def __init__(self, tokenizer: Tokenizer, mode: str = "thinking") -> None:
        check_mode(mode)
        self.tokenizer = tokenizer
        self.channel = "reasoning" if mode == "thinking" else "content"
        self.ended = False
        self._detok = IncrementalDetokenizer(tokenizer)
        self._tools: list[str] = []  # the tools channel's text
        self._stray = False  # a special token inside the tools channel: the section is malformed

    def tool_calls(self) -> list[dict] | None:
        """The tools channel read so far as OpenAI tool calls; ``None`` when there is none or it is malformed (not
        valid tool-call JSON, or holding a special token: its literal inside a JSON string would read as text)."""
        return None if self._stray or not self._tools else parse_tool_calls("".join(self._tools))

    def feed(self, token_id: int) -> list[tuple[str, str]]:
        t = int(token_id)
        if self.ended:
            return []
        if t in _CHANNELS:
            out = self.flush()
            self.channel, self._detok = _CHANNELS[t], IncrementalDetokenizer(self.tokenizer)
            return out
        if t in (_END, _EOS):
            self.ended = True
            return self.flush()
        if t < NUM_SPECIAL_TOKENS:  # stray markup: dropped, but kept as its literal where it spoils a tools section
            if self.channel != "tools":
                return []
            self._stray = True
            return self.flush() + self._delta(SPECIAL_TOKENS[t])
        return self._delta(self._detok.push(t))

    def flush(self) -> list[tuple[str, str]]:
        """The held-back remainder of the current channel (an incomplete character becomes U+FFFD)."""
        return self._delta(self._detok.flush())

    def _delta(self, text: str) -> list[tuple[str, str]]:
        if self.channel == "tools" and text:
            self._tools.append(text)
        return [(self.channel, text)] if text else []
