"""The toy domains, the agentic environment and the SFT chat data (issue 19, deliverables 1–2; SPEC §7, §8)."""

from __future__ import annotations

import json
import os
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deadline import finishes

from k3.rl.agent import MAX_CALLS, STORE, TOOLS, AgentEnv, episode_messages
from k3.rl.chats import chat_records, plain_texts, read_chats, write_chats
from k3.rl.distill import DistillConfig
from k3.rl.domains import (DOMAINS, EFFORTS, MAX_TASKS, Task, assistant_message, generate, reasoning, system_prompt,
                           verify)
from k3.rl.grpo import RLConfig
from k3.rl.sandbox import Sandbox
from k3.chat.native import normalize, parse, render
from k3.tokenization.bpe import Tokenizer

ADD = Task("math-hand", "math", "add1", "What is 3+4?", {"value": "7"},
           {"turns": [{"steps": ["3+4=7."], "check": "7-4=3."}], "content": "7"})
CODE = Task("code-hand", "code", "add", "Write f(x) that returns x+3.",
            {"name": "f", "tests": [[[0], 3], [[5], 8], [[-2], 1]]},
            {"turns": [{"steps": ["Add 3."], "check": "f(2)=5."}], "content": "def f(x):\n    return x+3"})


def answer(content: str) -> dict:
    return {"role": "assistant", "content": content, "reasoning_content": ""}


# ------------------------------------------------------------------------------------------------------------------
# math

@pytest.mark.parametrize("content, correct", [
    ("7", True), ("  7\n", True), ("The answer is 7.", True), ("3+4=7", True), ("3 + 4 =\n 7 apples", True),
    ("8", False), ("7 or 8", False), ("7.0", False), ("07", False), ("-7", False), ("seven", False), ("", False),
])
def test_math_verifier(content, correct):
    assert verify(ADD, answer(content)).correct is correct


def test_math_verifier_garbage():
    for completion in ({}, {"content": None}, {"content": 7}, {"content": ["7"]}):
        assert not verify(ADD, completion).correct
    with pytest.raises(ValueError, match="completion"):
        verify(ADD, "7")


@settings(max_examples=50, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Nd",)), max_size=20).filter(lambda s: "." not in s))
def test_math_final_number_decides(prefix):
    assert verify(ADD, answer(f"{prefix} 7")).correct
    assert not verify(ADD, answer(f"7 {prefix} 9")).correct


def _math_reference(prompt: str) -> int:
    """An independent answer: Python evaluates the expression, or the word problem's numbers by its verb."""
    if m := re.fullmatch(r"What is ([\d+\-*()]+)\?", prompt):
        return eval(m.group(1))
    a, b = map(int, re.findall(r"\d+", prompt))
    return a + b if "buys" in prompt else a - b if "gives away" in prompt else a * b


def test_math_tasks_are_right_and_short():
    tasks = generate("math", 200, seed=1)
    assert {t.kind for t in tasks} == {"add1", "sub1", "add2", "mul1", "two", "word"}
    for t in tasks:
        assert t.answer["value"] == str(_math_reference(t.prompt)) == t.reference["content"], t.prompt
        assert verify(t, assistant_message(t, "max", "thinking")).correct
        assert len(t.prompt) < 80
    assert sum(t.kind == "add1" for t in tasks) > 30  # the easy tier is common


# ------------------------------------------------------------------------------------------------------------------
# code

@pytest.mark.parametrize("content", [
    "def f(x):\n    return x+3",
    "Here:\n```python\ndef f(x):\n    return 3 + x\n```\nDone.",
    "import math\ndef f(x):\n    print('noise' * 1000)\n    return int(math.floor(x)) + 3",
])
def test_code_verifier_accepts(content):
    verdict = verify(CODE, answer(content))
    assert verdict.correct, verdict.reason


@pytest.mark.parametrize("content, reason", [
    ("def f(x):\n    return x+2", "test 0"),
    ("def f(x):\n    return x+3.0", "returned a float"),
    ("def f(x):\n    raise ValueError('no')", "ValueError"),
    ("def f(x) return x", "does not run"),
    ("def g(x):\n    return x+3", "no function f"),
    ("", "no content"),
    ("import sys\nsys.exit(0)", "does not run"),
    ("import os\ndef f(x):\n    os._exit(0)", "no test report"),
    ("import json, os\nprint(json.dumps({'passed': 3}))\nos._exit(0)", "no test report"),
    ("class A:\n    def __eq__(self, o):\n        return True\ndef f(x):\n    return A()", "returned a A"),
    ("x = ' ' * (1 << 34)", "MemoryError"),
])
def test_code_verifier_rejects(content, reason):
    verdict = verify(CODE, answer(content))
    assert not verdict.correct and reason in verdict.reason, verdict.reason


def test_code_verifier_infinite_loop_times_out():
    verdict = verify(CODE, answer("def f(x):\n    while True:\n        pass"), timeout=1.0)
    assert not verdict.correct and "timed out" in verdict.reason


def test_code_tasks_reference_passes_and_tests_are_right():
    tasks = generate("code", 40, seed=2)
    for t in tasks:
        if m := re.fullmatch(r"Write (\w)\(x\) that returns x (plus|minus|times) (\d)\.", t.prompt):
            op, k = {"plus": "+", "minus": "-", "times": "*"}[m.group(2)], m.group(3)
            assert t.answer["name"] == m.group(1)
            assert all(out == eval(f"({x}){op}{k}") for (x,), out in t.answer["tests"])
    seen = set()
    for t in tasks:
        if t.kind not in seen:  # one sandbox run per kind keeps this fast
            seen.add(t.kind)
            verdict = verify(t, assistant_message(t, "low", "instruct"))
            assert verdict.correct, (t.prompt, verdict.reason)
    assert len(seen) >= 8


def test_code_hidden_tests_reject_shortcuts():
    tasks = generate("code", 300, seed=3)
    for kind, body in (("even", "True"), ("even", "False"), ("larger", "a"), ("larger", "b"), ("count", "1")):
        t = next(t for t in tasks if t.kind == kind)
        params = re.search(r"\((.*?)\)", t.prompt).group(1)
        assert not verify(t, answer(f"def {t.answer['name']}({params}):\n    return {body}")).correct, (kind, body)


# ------------------------------------------------------------------------------------------------------------------
# agentic

def _solve(task: Task) -> str:
    """An independent solver of the puzzle from the prompt and the initial store."""
    store = task.answer["store"]
    if m := re.fullmatch(r"Copy the value of key (\w+) to key answer\.", task.prompt):
        return store[m.group(1)]
    if m := re.fullmatch(r"Put the sum of keys (\w+) and (\w+) under key answer\.", task.prompt):
        return str(int(store[m.group(1)]) + int(store[m.group(2)]))
    value = store["start"]
    while not value.isdigit():
        value = store[value]
    return value


def _call(name: str, **args) -> dict:
    return {"id": "c", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def test_agentic_reference_episodes_solve_their_tasks():
    tasks = generate("agentic", 30, seed=3)
    assert {t.kind for t in tasks} == {"copy", "sum", "chain"}
    for t in tasks:
        assert t.answer["value"] == _solve(t)
        assert 2 <= len(t.reference["calls"]) <= 4
        messages = episode_messages(t, "max")
        with AgentEnv() as env:
            env.reset(t)
            for m in messages:
                for call in m.get("tool_calls", ()):
                    env.call(call)
            assert env.judge().correct
        results = [m["content"] for m in messages if m["role"] == "tool"]
        assert results[-1] == "ok" and not any(r.startswith("error") for r in results)


def test_agentic_wrong_final_put_fails_and_judging_uses_a_fork():
    task = next(t for t in generate("agentic", 20, seed=4) if t.kind == "chain")
    with AgentEnv() as env:
        env.reset(task)
        assert env.call(_call("get", key="start")) == task.answer["store"]["start"]
        assert env.call(_call("put", key="answer", value="0")) == "ok"
        before = (env.sandbox.listdir(), env.sandbox.read(STORE))
        verdict = env.judge()
        assert not verdict.correct and "expected" in verdict.reason
        assert (env.sandbox.listdir(), env.sandbox.read(STORE)) == before
        assert env.state() == {**task.answer["store"], "answer": "0"}
        assert env.call(_call("put", key="answer", value=task.answer["value"])) == "ok"
        assert env.judge().correct


def test_agentic_state_is_the_sandbox():
    task = generate("agentic", 1, seed=5)[0]
    with AgentEnv() as env:
        env.reset(task)
        snap = env.sandbox.snapshot()
        env.call(_call("put", key="answer", value=task.answer["value"]))
        assert env.judge().correct
        env.sandbox.restore(snap)
        assert env.state() == task.answer["store"] and not env.judge().correct


def test_agentic_bad_tool_calls_return_errors():
    task = generate("agentic", 1, seed=6)[0]
    bad = [
        (_call("delete", key="start"), "unknown tool"),
        ({"function": {"name": "get", "arguments": "{not json"}}, "JSON object"),
        ({"function": {"name": "get", "arguments": "[1]"}}, "JSON object"),
        (_call("get"), "key"),
        (_call("get", key="start", extra="1"), "key"),
        (_call("put", key="answer", value=7), "string arguments key, value"),
        (_call("keys", key="x"), "no arguments"),
        (_call("get", key="nope"), "no key"),
        (_call("put", key="a/b", value="1"), "a key is"),
        (_call("put", key="answer", value="9" * 65), "at most"),
        ("get start", "unknown tool"),
        ({"function": None}, "unknown tool"),
    ]
    with AgentEnv(max_calls=len(bad) + 1) as env:
        env.reset(task)
        for call, message in bad:
            result = env.call(call)
            assert result.startswith("error: ") and message in result, (call, result)
        assert env.state() == task.answer["store"]
        assert env.call(_call("keys")) == " ".join(sorted(task.answer["store"]))
        assert env.done
        assert "used up" in env.call(_call("keys"))
    assert MAX_CALLS >= 4


def test_agentic_verifier_and_env_misuse():
    task = generate("agentic", 1, seed=7)[0]
    store, value = task.answer["store"], task.answer["value"]
    assert verify(task, {"state": {**store, "answer": value}}).correct
    assert not verify(task, {"state": {**store, "answer": value + "0"}}).correct
    assert not verify(task, {"state": store}).correct
    assert not verify(task, {"state": {"answer": value}}).correct  # the initial keys must stay
    with pytest.raises(ValueError, match="state"):
        verify(task, {"content": value})
    with pytest.raises(ValueError, match="agentic"):
        AgentEnv().reset(ADD)
    with pytest.raises(RuntimeError, match="reset"):
        AgentEnv().call(_call("keys"))


# ------------------------------------------------------------------------------------------------------------------
# generation, efforts

def test_generation_is_deterministic_and_splits_are_disjoint():
    for domain in DOMAINS:
        train, test = generate(domain, 150, seed=0), generate(domain, 50, seed=0, split="test")
        assert train == generate(domain, 150, seed=0) and train != generate(domain, 150, seed=1)
        assert not {t.id for t in train} & {t.id for t in generate(domain, 50, seed=9, split="test")}
        key = (lambda t: t.prompt) if domain != "agentic" else (lambda t: (t.prompt, json.dumps(t.answer)))
        assert not {key(t) for t in train} & {key(t) for t in test}
        assert all(Task.from_dict(json.loads(json.dumps(t.to_dict()))) == t for t in test)
    with pytest.raises(ValueError, match="domain"):
        generate("poetry", 1)
    with pytest.raises(ValueError, match="split"):
        generate("math", 1, split="dev")
    with pytest.raises(ValueError, match="n"):
        generate("math", -1)


def test_task_from_dict_rejects_bad_data():
    good = generate("math", 1)[0].to_dict()
    for bad, message in (({**good, "id": "math-0"}, "does not match"), ({**good, "domain": "art"}, "domain"),
                         ({k: v for k, v in good.items() if k != "prompt"}, "fields"), ([], "fields"),
                         ({**good, "answer": "7"}, "answer"), ({**good, "reference": {}}, "reference")):
        with pytest.raises(ValueError, match=message):
            Task.from_dict(bad)


def test_reasoning_grows_with_effort():
    assert system_prompt("max") == "effort: max"
    with pytest.raises(ValueError, match="effort"):
        system_prompt("medium")
    for domain in DOMAINS:
        tasks = generate(domain, 40, seed=8)
        lengths = {e: [sum(len(reasoning(t, e, i)) for i in range(len(t.reference["turns"]))) for t in tasks]
                   for e in EFFORTS}
        assert all(a < b < c for a, b, c in zip(*lengths.values())), domain
        assert sum(lengths["low"]) == 0
    with pytest.raises(ValueError, match="turn"):
        reasoning(tasks[0], "high", 9)


# ------------------------------------------------------------------------------------------------------------------
# chats

@pytest.fixture(scope="module")
def records():
    return chat_records(n_per=4, seed=0)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.train(plain_texts(chat_records(n_per=30, seed=1)), vocab_size=512)


def test_chat_records_shape(records):
    assert len(records) == 3 * 4 * 4
    for r in records:
        assistant = [m for m in r["messages"] if m["role"] == "assistant"]
        assert r["messages"][0] == {"role": "system", "content": system_prompt(r["effort"])}
        assert ("tools" in r) == (r["domain"] == "agentic")
        if r["mode"] == "instruct":
            assert r["effort"] == "low" and not any("reasoning_content" in m for m in assistant)
        else:
            assert all("reasoning_content" in m for m in assistant)
        task = Task.from_dict(r["task"])
        if task.domain == "math":
            assert verify(task, assistant[-1]).correct


def test_chat_records_render_and_round_trip(records, tokenizer):
    longest = {d: 0 for d in DOMAINS}
    for r in records:
        ids = render(r["messages"], tokenizer, r["mode"], r.get("tools"), add_generation_prompt=False)
        assert parse(ids, tokenizer) == (normalize(r["messages"], r["mode"], r.get("tools")), r.get("tools"))
        longest[r["domain"]] = max(longest[r["domain"]], len(ids))
    assert longest["math"] < 100 and longest["code"] < 150 and longest["agentic"] < 400, longest


def test_write_and_read_chats(records, tmp_path):
    path = write_chats(tmp_path / "chats.jsonl", records)
    assert read_chats(path) == records
    lines = path.read_text().splitlines()
    for n, bad in ((2, "{oops"), (3, json.dumps({**records[0], "mode": "chatty"})),
                   (2, json.dumps({**records[0], "messages": [{"role": "bot"}]})), (1, "[1]")):
        broken = tmp_path / "broken.jsonl"
        broken.write_text("\n".join(lines[: n - 1] + [bad] + lines[n:]) + "\n")
        with pytest.raises(ValueError, match=f"broken.jsonl, line {n}:"):
            read_chats(broken)
    deep = tmp_path / "deep.jsonl"
    deep.write_text(lines[0] + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")  # was a RecursionError
    with pytest.raises(ValueError, match="deep.jsonl, line 2: invalid JSON"):
        read_chats(deep)
    with pytest.raises(ValueError, match="record 1"):
        write_chats(tmp_path / "x.jsonl", [records[0], {**records[1], "domain": "art"}])


def test_read_chats_refuses_what_is_not_a_regular_file(tmp_path):
    """``read_chats`` of a FIFO blocked forever and of ``/dev/zero`` read until memory ran out: both are refused."""
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    (tmp_path / "zero.jsonl").symlink_to("/dev/zero")
    for path, kind in ((fifo, "a FIFO"), (tmp_path / "zero.jsonl", "a character device")):
        with pytest.raises(ValueError, match=re.escape(f"{path}: {kind}, not a regular file: refused")):
            read_chats(path)


def test_plain_texts_and_tools(records):
    texts = plain_texts(records)
    assert len(texts) == len(records)
    agentic = next(t for t, r in zip(texts, records) if r["domain"] == "agentic")
    assert '"name":"get"' in agentic and "calls: " in agentic and "tool: " in agentic
    assert {t["function"]["name"] for t in TOOLS} == {"get", "put", "keys"}
    with pytest.raises(ValueError, match="efforts"):
        chat_records(efforts=["huge"])


def test_agentic_episode_checkpoint_and_resume(tmp_path):
    task = next(t for t in generate("agentic", 20, seed=10) if t.kind == "sum")
    first, put = task.reference["calls"][0]["arguments"], task.reference["calls"][2]["arguments"]
    with AgentEnv(max_calls=3) as env:
        env.reset(task)
        env.call(_call("get", **first))
        env.call(_call("put", key="answer", value="x"))
        env.sandbox.checkpoint(tmp_path / "episode.ckpt")
    with AgentEnv.resume(task, tmp_path / "episode.ckpt", calls=2, max_calls=3) as env:
        assert env.state() == {**task.answer["store"], "answer": "x"} and not env.done
        assert env.call(_call("put", **put)) == "ok" and env.done and env.judge().correct
    with pytest.raises(ValueError, match="calls"):
        AgentEnv.resume(task, tmp_path / "episode.ckpt", calls=4, max_calls=3)
    (tmp_path / "junk.ckpt").write_bytes(b"junk")
    for path in (tmp_path / "junk.ckpt", tmp_path / "missing.ckpt"):
        with pytest.raises(ValueError, match="checkpoint"):
            AgentEnv.resume(task, path, calls=0)
    with Sandbox() as empty:
        empty.checkpoint(tmp_path / "empty.ckpt")
    with pytest.raises(ValueError, match="store.json"):
        AgentEnv.resume(task, tmp_path / "empty.ckpt", calls=0)


def test_work_is_bounded_before_it_starts():
    """``k3 chats --n-per 10**11`` and ``k3 rl --eval-tasks 10**9`` drew tasks for ever, ``k3 rl --samples 10**9``
    was a MemoryError: each is refused by name before any task is drawn or model loaded."""
    cases = [(lambda: generate("math", 10**11), r"n: expected an int in \[0, 50,000\]"),
             (lambda: chat_records(n_per=10**11), r"n_per: expected an int in \[0, 50,000\] tasks per domain")]
    for config, match in ((RLConfig(ckpt="c", samples=10**9), r"rl\.prompts × rl\.samples = 8 × 1000000000"),
                          (RLConfig(ckpt="c", prompts=257), r"rl\.prompts × rl\.samples = 257 × 4"),
                          (RLConfig(ckpt="c", eval_tasks=10**9), r"rl\.eval_tasks = 1000000000 is invalid"),
                          (DistillConfig(ckpt="c", teachers="t", prompts=1025), r"distill\.prompts × "),
                          (DistillConfig(ckpt="c", teachers="t", train_tasks=MAX_TASKS + 1),
                           r"distill\.train_tasks = 50001 is invalid")):
        cases.append((config.validate, match))
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            finishes(call, seconds=10)
    assert RLConfig(ckpt="c", prompts=256, samples=4, eval_tasks=MAX_TASKS).validate()
    assert len(generate("math", 3)) == 3
