"""`k3.chat.shared_head` (issue 36): the tokens of a rendered conversation that its leading system messages render,
the head that conversations share and the prefix cache checkpoints, in both chat formats."""

from __future__ import annotations

import pytest
from kimi_fixtures import TEXTS, build_kimi_tokenizer_files

import serving
from k3.chat import chat_format, native, shared_head, xtml

SYSTEM = {"role": "system", "content": "You are a careful assistant. Answer in one line."}


@pytest.fixture(scope="module", params=["native", "xtml"])
def tok(request, tmp_path_factory):
    if request.param == "native":
        return serving.tokenizer()
    return build_kimi_tokenizer_files(tmp_path_factory.mktemp("kimi"), [f"{t} {i}" for i in range(5) for t in TEXTS])


@pytest.mark.parametrize("mode", ["thinking", "instruct"])
def test_two_conversations_share_exactly_the_head(tok, mode):
    fmt = chat_format(tok)
    assert fmt is (xtml if getattr(tok, "chat_format", None) == "xtml" else native)
    one = [SYSTEM, {"role": "user", "content": "What is 2 + 2?"}]
    two = [SYSTEM, {"role": "user", "content": "Name a colour."}]
    a, b = (fmt.render(m, tok, mode) for m in (one, two))
    head = shared_head(fmt, one, a, tok, mode)
    assert head == shared_head(fmt, two, b, tok, mode) > 0
    assert a[:head] == b[:head] and a[head:] != b[head:]
    assert fmt.render([SYSTEM], tok, mode, add_generation_prompt=False) == a[:head]


def test_no_system_message_no_head(tok):
    fmt = chat_format(tok)
    messages = [{"role": "user", "content": "hi"}]
    assert shared_head(fmt, messages, fmt.render(messages, tok, "instruct"), tok, "instruct") == 0


def test_a_head_that_is_not_a_prefix_of_the_prompt_is_not_marked(tok):
    fmt = chat_format(tok)
    messages = [SYSTEM, {"role": "user", "content": "hi"}]
    other = fmt.render([{"role": "user", "content": "something else entirely"}], tok, "instruct")
    assert shared_head(fmt, messages, other, tok, "instruct") == 0
