"""Chat formats (SPEC §7, Appendix F, §10): OpenAI-style messages <-> token ids, and the streaming parse of a
generated assistant turn. Two formats speak the `ChatFormat` protocol: ours (`k3.chat.native`, Appendix F) and the
released Kimi K3's XTML (`k3.chat.xtml`); `chat_format` picks the one a tokenizer speaks (a released checkpoint's
`KimiTokenizer` says ``chat_format = "xtml"``). The message checks both share are `k3.chat.messages`.

This package sits below the model, serving and training: it imports only `k3.tokenization`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from k3.chat import native, xtml
from k3.chat.messages import Media

__all__ = ["ChatFormat", "Parser", "chat_format", "shared_head"]


class Parser(Protocol):
    """An incremental parser of generated ids: ``feed(id)`` -> ``[(channel, text delta), ...]``; ``channel`` is the
    channel the next text goes to ("reasoning", "content", "tools"); ``ended`` once the turn's end was read."""

    channel: str | None
    ended: bool

    def feed(self, token_id: int) -> list[tuple[str, str]]: ...

    def flush(self) -> list[tuple[str, str]]: ...

    def tool_calls(self) -> list[dict] | None:
        """The tools channel read so far, parsed from the ids as OpenAI tool calls (None: none, or malformed)."""


class ChatFormat(Protocol):
    """What a chat format module offers (`k3.chat.native`, `k3.chat.xtml`)."""

    MODES: tuple[str, ...]
    IMAGES: bool

    def render(self, messages: Sequence[dict], tokenizer: Any, mode: str = ..., tools: list[dict] | None = ...,
               add_generation_prompt: bool = ..., *args: Any, media: Media | None = ...,
               **kwargs: Any) -> list[int]: ...

    def render_text(self, messages: Sequence[dict], tokenizer: Any, *args: Any, **kwargs: Any) -> str: ...

    def parse_tool_calls(self, text: str) -> list[dict] | None: ...

    def stop_ids(self, tokenizer: Any) -> tuple[int, ...]: ...

    def AssistantParser(self, tokenizer: Any, mode: str = ...) -> Parser: ...  # noqa: N802 (the class itself)


def chat_format(tokenizer: Any) -> ChatFormat:
    """`k3.chat.xtml` for a tokenizer with ``chat_format == "xtml"``, else `k3.chat.native`."""
    return xtml if getattr(tokenizer, "chat_format", None) == "xtml" else native


def shared_head(fmt: ChatFormat, messages: Sequence[dict], prompt: list[int], tokenizer: Any, mode: str,
                tools: list[dict] | None = None) -> int:
    """How many tokens of ``prompt`` (``messages`` rendered by ``fmt``) render its leading system messages: the head
    that conversations share, worth a prefix-cache checkpoint (issue 36). 0 when there is none, or when the head
    rendered alone is not a prefix of ``prompt``."""
    k = next((i for i, m in enumerate(messages) if not isinstance(m, dict) or m.get("role") != "system"), 0)
    if k == 0:
        return 0
    try:
        head = fmt.render(messages[:k], tokenizer, mode, tools, add_generation_prompt=False)
    except ValueError:
        return 0
    return len(head) if prompt[:len(head)] == head else 0
