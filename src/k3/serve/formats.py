"""The chat format a tokenizer speaks (issue 11): ours (SPEC Appendix F, `k3.serve.chat`) or the released
Kimi K3's XTML (SPEC §10, `k3.serve.xtml`). Both modules offer ``render``, ``AssistantParser``,
``parse_tool_calls`` and ``stop_ids``; a released checkpoint's `KimiTokenizer` selects XTML automatically."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from k3.serve import chat, xtml


def chat_format(tokenizer: Any) -> ModuleType:
    """`k3.serve.xtml` for a tokenizer with ``chat_format == "xtml"``, else `k3.serve.chat`."""
    return xtml if getattr(tokenizer, "chat_format", None) == "xtml" else chat
