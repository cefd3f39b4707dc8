"""Our chat format (`k3.chat.native`, SPEC Appendix F) as a Jinja chat template, for engines that render chats from
``tokenizer_config.json`` (transformers' ``apply_chat_template``, vLLM, SGLang, mlx-lm, llama.cpp's Jinja).

Rendered to text and tokenized with the special tokens recognised, it gives `k3.chat.native.render`'s ids (tested on
generated conversations through transformers). The template variables are the usual ones: ``messages``, ``tools``,
``add_generation_prompt``, and ``thinking`` (default true: our ``thinking`` mode; false: ``instruct``), which vLLM and
SGLang pass as ``chat_template_kwargs``. Tool-call ``arguments`` may be objects (transformers' convention) or JSON
strings (OpenAI's), which are written as given: our renderer re-serialises them compactly, so a string that is not
compact JSON renders differently. Two things only `k3.chat.native` does: images (a template cannot know how many
visual slots an image takes, so an image part is an error here) and refusing malformed input with the field named;
and, as with every chat template, message text holding a special token's literal (``<|end|>``) is tokenized as
that token, where our renderer keeps it text.
"""

from __future__ import annotations

__all__ = ["CHAT_TEMPLATE"]

_COMPACT = "tojson(separators=(',', ':'))"

CHAT_TEMPLATE = (
    "{%- set thinking = thinking if thinking is defined else true -%}"
    "{%- macro text(content) -%}"
    "{%- if content is none -%}"
    "{%- elif content is string -%}{{ content }}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part.type == 'text' -%}{{ part.text }}"
    "{%- else -%}{{ raise_exception('only text content parts render here: images need kimi-k3 (k3 serve)') }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- macro functions() -%}"
    "{%- set ns = namespace(fns=[]) -%}"
    "{%- for tool in tools -%}{%- set ns.fns = ns.fns + [tool.function] -%}{%- endfor -%}"
    "{{ ns.fns | " + _COMPACT + " }}"
    "{%- endmacro -%}"
    "{%- if tools and messages[0].role not in ('system', 'developer') -%}"
    "<|system|><|tools|>{{ functions() }}<|end|>"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role in ('system', 'developer') -%}"
    "<|system|>{{ text(message.content) }}{%- if tools and loop.first -%}<|tools|>{{ functions() }}{%- endif -%}"
    "<|end|>"
    "{%- elif message.role == 'user' -%}<|user|>{{ text(message.content) }}<|end|>"
    "{%- elif message.role == 'tool' -%}<|tool|>{{ message.tool_call_id }}\n{{ text(message.content) }}<|end|>"
    "{%- elif message.role == 'assistant' -%}<|assistant|>"
    "{%- if thinking -%}<|think|>{{ message.reasoning_content or '' }}{%- endif -%}"
    "<|response|>{{ text(message.content) }}"
    "{%- if message.tool_calls -%}<|tools|>["
    "{%- for call in message.tool_calls -%}"
    "{%- if not loop.first -%},{%- endif -%}"
    "{\"id\":{{ call.id | " + _COMPACT + " }},\"name\":{{ call.function.name | " + _COMPACT + " }},\"arguments\":"
    "{%- if call.function.arguments is string -%}{{ call.function.arguments }}"
    "{%- else -%}{{ call.function.arguments | " + _COMPACT + " }}{%- endif -%}}"
    "{%- endfor -%}]"
    "{%- endif -%}<|end|>"
    "{%- else -%}{{ raise_exception('unknown role: ' + message.role) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{{ '<|think|>' if thinking else '<|response|>' }}{%- endif -%}"
)
