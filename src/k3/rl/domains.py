"""The verifiable toy domains of post-training (SPEC §7; issue 19 deliverable 2): generated and checked locally.

* ``math`` — arithmetic (``3+4``, ``12-5``, ``6*7``, ``(3+4)*2``) and templated word problems, exact integer answers;
* ``code`` — tiny Python functions from templates, checked by hidden unit tests run in a `Sandbox`;
* ``agentic`` — key–value store puzzles solved with tool calls; the environment is `k3.rl.agent`.

The easy tiers (single-digit sums, ``x+k`` functions, copying one key) are within reach of the ``tiny`` model.
Three reasoning efforts condition the system prompt; the reference chain of thought grows with the effort (low:
empty, high: the steps, max: the steps and a check), so the nine teachers (3 domains × 3 efforts) have separable
response lengths. A task's reference is a list of assistant turns (one for math and code; one per tool call plus a
final answer for agentic), each with its ``steps`` and ``check`` sentences.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
import secrets
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

from k3.rl.sandbox import Limits, Sandbox
from k3.chat.native import MODES

__all__ = ["ANSWER_KEY", "CODE_TIMEOUT", "DOMAINS", "EFFORTS", "MAX_TASKS", "SPLITS", "TEST_EVERY", "Task", "Verdict",
           "assistant_message", "generate", "reasoning", "reference_call", "system_prompt", "verify"]

DOMAINS = ("math", "code", "agentic")
EFFORTS = ("low", "high", "max")
SPLITS = ("train", "test")
#: A task is in the test split iff its content hash is 0 modulo this (one task in five).
TEST_EVERY = 5
#: The most tasks one call of `generate` draws (``k3 chats --n-per``, ``--eval-tasks``): at the defaults ``k3 chats``
#: writes ~14 KB of chats a task per domain, so 50,000 stay within what `k3.rl.sft.load_chats` reads (1 GiB).
MAX_TASKS = 50_000
#: Wall-clock seconds a code answer's hidden tests may run.
CODE_TIMEOUT = 2.0
#: The key an agentic task's answer must be put under.
ANSWER_KEY = "answer"


@dataclass(frozen=True)
class Verdict:
    """A verifier's judgement: ``correct`` and a short human-readable ``reason``."""

    correct: bool
    reason: str


@dataclass(frozen=True)
class Task:
    """One verifiable task. ``answer`` is what the verifier needs (JSON data), ``reference`` the reference solution:
    ``{"turns": [{"steps": [str], "check": str}, ...], "content": str[, "calls": [{"name", "arguments"}, ...]]}``.
    ``id`` is a hash of ``(domain, prompt, answer)``, which also decides the split."""

    id: str
    domain: str
    kind: str
    prompt: str
    answer: dict
    reference: dict

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> Task:
        """Inverse of :meth:`to_dict`; ``ValueError`` naming the problem for anything else."""
        names = [f.name for f in fields(cls)]
        if not isinstance(data, dict) or sorted(data) != sorted(names):
            got = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"task: expected an object with fields {names}, got {got}")
        for name in names:
            want = dict if name in ("answer", "reference") else str
            if not isinstance(data[name], want):
                raise ValueError(f"task.{name}: expected {want.__name__}, got {type(data[name]).__name__}")
        if data["domain"] not in DOMAINS:
            raise ValueError(f"task.domain: expected one of {DOMAINS}, got {data['domain']!r}")
        turns = data["reference"].get("turns")
        if not isinstance(turns, list) or not turns or not isinstance(data["reference"].get("content"), str):
            raise ValueError("task.reference: expected {'turns': [non-empty list], 'content': str, ...}")
        if data["id"] != _task_id(data["domain"], data["prompt"], data["answer"]):
            raise ValueError(f"task.id: {data['id']!r} does not match the task's content")
        return cls(**data)


def _digest(domain: str, prompt: str, answer: dict) -> str:
    return hashlib.sha256(json.dumps([domain, prompt, answer], sort_keys=True).encode()).hexdigest()


def _task_id(domain: str, prompt: str, answer: dict) -> str:
    return f"{domain}-{_digest(domain, prompt, answer)[:12]}"


def _split(task: Task) -> str:
    return "test" if int(task.id.rsplit("-", 1)[1], 16) % TEST_EVERY == 0 else "train"


def _task(domain: str, kind: str, prompt: str, answer: dict, turns: list[dict], content: str,
          calls: list[dict] | None = None) -> Task:
    reference = {"turns": turns, "content": content, **({"calls": calls} if calls is not None else {})}
    return Task(_task_id(domain, prompt, answer), domain, kind, prompt, answer, reference)


def _turn(steps: list[str], check: str) -> dict:
    return {"steps": steps, "check": check}


# ------------------------------------------------------------------------------------------------------------------
# math

_INVERSE = {"+": "-", "-": "+", "*": "/"}
_WORDS = (  # (template, operator, why)
    ("{n} has {a} {i}s and buys {b} more. How many {i}s now?", "+", "Buying adds."),
    ("{n} has {a} {i}s and gives away {b}. How many {i}s are left?", "-", "Giving away subtracts."),
    ("A bag holds {a} {i}s. How many {i}s are in {b} bags?", "*", "Bags multiply."),
)
_NAMES = ("Ann", "Bo", "Cy", "Dee", "Eve")
_ITEMS = ("apple", "pen", "cup", "egg", "book")


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def _step(a: int, op: str, b: int) -> tuple[int, str, str]:
    """``(result, "a op b = result.", its inverse check)``."""
    r = _apply(a, op, b)
    return r, f"{a}{op}{b}={r}.", f"{r}{_INVERSE[op]}{b}={a}."


def _math_task(kind: str, prompt: str, value: int, turn: dict) -> Task:
    return _task("math", kind, prompt, {"value": str(value)}, [turn], str(value))


def _math(rng: random.Random) -> Task:
    kind = rng.choices(("add1", "sub1", "add2", "mul1", "two", "word"), (3, 2, 1, 2, 1, 2))[0]
    if kind == "two":
        a, b, c = rng.randint(1, 9), rng.randint(1, 9), rng.randint(2, 5)
        s, first, _ = _step(a, "+", b)
        r, second, check = _step(s, "*", c)
        return _math_task(kind, f"What is ({a}+{b})*{c}?", r, _turn([first, second], check))
    if kind == "word":
        template, op, why = rng.choice(_WORDS)
        a, b = (rng.randint(2, 9), rng.randint(2, 5)) if op == "*" else (rng.randint(3, 12), rng.randint(1, 9))
        a = max(a, b) if op == "-" else a
        r, step, check = _step(a, op, b)
        prompt = template.format(n=rng.choice(_NAMES), i=rng.choice(_ITEMS), a=a, b=b)
        return _math_task(kind, prompt, r, _turn([why, step], check))
    a, op, b = {"add1": lambda: (rng.randint(0, 9), "+", rng.randint(0, 9)),
                "sub1": lambda: (rng.randint(0, 18), "-", rng.randint(0, 9)),
                "add2": lambda: (rng.randint(10, 99), "+", rng.randint(1, 9)),
                "mul1": lambda: (rng.randint(2, 9), "*", rng.randint(2, 9))}[kind]()
    a = max(a, b) if op == "-" else a  # no negative differences
    r, step, check = _step(a, op, b)
    return _math_task(kind, f"What is {a}{op}{b}?", r, _turn([step], check))


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _verify_math(task: Task, completion: dict) -> Verdict:
    content = completion.get("content")
    if not isinstance(content, str):
        return Verdict(False, "no content")
    numbers = _NUMBER.findall(content)
    if not numbers:
        return Verdict(False, "no number in the content")
    want = task.answer["value"]
    return Verdict(numbers[-1] == want, f"final number {numbers[-1]}, expected {want}")


# ------------------------------------------------------------------------------------------------------------------
# code

@dataclass(frozen=True)
class _Template:
    params: str  # the signature's parameters; also names the argument generator
    body: str  # the returned expression, may use {k}
    does: str  # "returns ...", may use {k}
    how: str  # the reasoning step, may use {k}
    ks: tuple[int, ...] = (0,)  # values of k


_CODE = {
    "add": _Template("x", "x+{k}", "returns x plus {k}", "Add {k} to x.", tuple(range(1, 10))),
    "sub": _Template("x", "x-{k}", "returns x minus {k}", "Subtract {k} from x.", tuple(range(1, 10))),
    "mul": _Template("x", "x*{k}", "returns x times {k}", "Multiply x by {k}.", tuple(range(2, 10))),
    "even": _Template("x", "x%2==0", "returns True if x is even, else False", "Test x%2==0."),
    "max": _Template("xs", "max(xs)", "returns the largest number in the list xs", "Use max."),
    "min": _Template("xs", "min(xs)", "returns the smallest number in the list xs", "Use min."),
    "sum": _Template("xs", "sum(xs)", "returns the sum of the list xs", "Use sum."),
    "len": _Template("xs", "len(xs)", "returns the length of the list xs", "Use len."),
    "rev": _Template("s", "s[::-1]", "returns the string s reversed", "Slice with step -1."),
    "upper": _Template("s", "s.upper()", "returns s in upper case", "Use upper."),
    "repeat": _Template("s", "s*{k}", "returns s repeated {k} times", "Multiply s by {k}.", (2, 3)),
    "larger": _Template("a, b", "max(a, b)", "returns the larger of a and b", "Use max."),
    "count": _Template("s, c", "s.count(c)", "returns how many times c occurs in s", "Use count."),
}
_CODE_WEIGHTS = {"add": 4, "sub": 2, "mul": 2}
_FUNCTION_NAMES = ("f", "g", "h")


def _letters(rng: random.Random) -> str:
    return "".join(rng.choice("abcd") for _ in range(rng.randint(1, 5)))


_ARGUMENTS: dict[str, Callable[[random.Random], list]] = {
    "x": lambda rng: [rng.randint(-9, 30)],
    "xs": lambda rng: [[rng.randint(0, 9) for _ in range(rng.randint(1, 5))]],
    "s": lambda rng: [_letters(rng)],
    "a, b": lambda rng: [rng.randint(-9, 9), rng.randint(-9, 9)],
    "s, c": lambda rng: [_letters(rng), rng.choice("abcd")],
}
#: The example of each signature that the ``max`` effort's check runs by hand.
_EXAMPLES = {"x": [2], "xs": [[3, 1, 2]], "s": ["abc"], "a, b": [4, 7], "s, c": ["abca", "a"]}
#: Hidden tests every task of a signature has (both parities, both orders, an absent letter), before random ones.
_EDGES = {"x": [[0], [7]], "xs": [[[5]]], "s": [["ab"]], "a, b": [[3, -2], [-2, 3]], "s, c": [["abc", "d"]]}
_TESTS_PER_TASK = 6


def _code(rng: random.Random) -> Task:
    kind = rng.choices(list(_CODE), [_CODE_WEIGHTS.get(k, 1) for k in _CODE])[0]
    t, name = _CODE[kind], rng.choice(_FUNCTION_NAMES)
    k = rng.choice(t.ks)
    prompt = f"Write {name}({t.params}) that {t.does.format(k=k)}."
    solution = f"def {name}({t.params}):\n    return {t.body.format(k=k)}"
    namespace: dict[str, Any] = {}
    exec(solution, namespace)  # our own template: computes the hidden tests' expected values
    fn = namespace[name]
    cases, args = random.Random(prompt), list(_EDGES[t.params])  # tests are a function of the prompt
    while len(args) < _TESTS_PER_TASK:
        if (a := _ARGUMENTS[t.params](cases)) not in args:
            args.append(a)
    example = _EXAMPLES[t.params]
    shown = ", ".join(map(repr, example))
    turn = _turn([f"{name} takes {t.params}.", t.how.format(k=k)], f"Check: {name}({shown})={fn(*example)!r}.")
    return _task("code", kind, prompt, {"name": name, "tests": [[a, fn(*a)] for a in args]}, [turn], solution)


_FENCED = re.compile(r"```[a-zA-Z]*[ \t]*\n(.*?)```", re.DOTALL)
_HARNESS = r'''
import json, os, sys
data = json.loads(sys.stdin.read())
out, sys.stdout = sys.stdout, open(os.devnull, "w")
def report(**verdict):
    out.write(json.dumps({"nonce": data["nonce"], **verdict}) + "\n")
    out.flush()
    os._exit(0)
def describe(e):
    try:
        return f"{type(e).__name__}: {str(e)[:80]}"
    except BaseException:
        return type(e).__name__
ns = {"__name__": "solution"}
try:
    exec(compile(data["source"], "<solution>", "exec"), ns)
except BaseException as e:
    report(error="the code does not run: " + describe(e))
fn = ns.get(data["name"])
if not callable(fn):
    report(error=f"no function {data['name']} defined")
for i, (args, want) in enumerate(data["tests"]):
    try:
        got = fn(*args)
        ok = type(got) is type(want) and got == want
    except BaseException as e:
        report(error=f"test {i}: " + describe(e))
    if not ok:
        got = repr(got)[:60] if type(got) is type(want) else "a " + type(got).__name__
        report(error=f"test {i}: returned {got}, expected {want!r}")
report(passed=len(data["tests"]))
'''


def _source(content: str) -> str:
    """The code of a code answer: its first fenced block, else the whole content."""
    fenced = _FENCED.search(content)
    return fenced.group(1) if fenced else content


def _verify_code(task: Task, completion: dict, timeout: float) -> Verdict:
    content = completion.get("content")
    if not isinstance(content, str) or not content.strip():
        return Verdict(False, "no content")
    nonce = secrets.token_hex(8)
    payload = json.dumps({"nonce": nonce, "source": _source(content), **task.answer})
    with Sandbox(Limits(wall_seconds=timeout, cpu_seconds=math.ceil(timeout))) as box:
        result = box.run_python(_HARNESS, stdin=payload, timeout=timeout)
    if result.timed_out:
        return Verdict(False, f"timed out after {timeout:g} s")
    lines = result.stdout.strip().splitlines()
    try:
        report = json.loads(lines[-1]) if lines else None
    except ValueError:
        report = None
    if not isinstance(report, dict) or report.get("nonce") != nonce:
        return Verdict(False, f"no test report (exit code {result.returncode}): {result.stderr.strip()[-120:]}")
    if "error" in report:
        return Verdict(False, str(report["error"]))
    return Verdict(True, f"passed {report['passed']} tests")


# ------------------------------------------------------------------------------------------------------------------
# agentic (the environment and its tools are in k3.rl.agent)

_KEYS = tuple(f"{c}{d}" for c in "bcdfgkmpqrstvwxz" for d in range(1, 10))


def _get(key: str) -> dict:
    return {"name": "get", "arguments": {"key": key}}


def _put(value: str) -> dict:
    return {"name": "put", "arguments": {"key": ANSWER_KEY, "value": value}}


def _agentic(rng: random.Random) -> Task:
    kind = rng.choices(("copy", "sum", "chain"), (2, 1, 2))[0]
    names = rng.sample(_KEYS, 5)
    store = {names[4]: str(rng.randint(10, 99))}  # a distractor
    if kind == "copy":
        key, value = names[0], str(rng.randint(10, 99))
        store[key] = value
        prompt = f"Copy the value of key {key} to key {ANSWER_KEY}."
        calls = [_get(key), _put(value)]
        turns = [_turn([f"Read {key}."], f"The goal is the value of {key}."),
                 _turn([f"{key} is {value}.", f"Put {value} under {ANSWER_KEY}."], f"{value} came from {key}.")]
    elif kind == "sum":
        (p, q), (u, v) = names[:2], (rng.randint(0, 9), rng.randint(0, 9))
        store.update({p: str(u), q: str(v)})
        value = str(u + v)
        prompt = f"Put the sum of keys {p} and {q} under key {ANSWER_KEY}."
        calls = [_get(p), _get(q), _put(value)]
        turns = [_turn([f"Read {p}."], f"Both {p} and {q} are needed."),
                 _turn([f"{p} is {u}.", f"Read {q}."], f"{p} is done, {q} is left."),
                 _turn([f"{q} is {v}.", f"{u}+{v}={value}.", f"Put {value} under {ANSWER_KEY}."],
                       f"Check: {value}-{v}={u}.")]
    else:
        chain = ["start", *names[: rng.randint(1, 2)]]
        value = str(rng.randint(10, 99))
        store.update(zip(chain, [*chain[1:], value], strict=True))
        prompt = f"From key start, follow key names to a number and put it under key {ANSWER_KEY}."
        calls = [*map(_get, chain), _put(value)]
        turns = [_turn(["Read start."], "Key names are followed, numbers are kept.")]
        turns += [_turn([f"{a} holds {b}, a key.", f"Read {b}."], f"{b} is not a number.")
                  for a, b in zip(chain, chain[1:])]
        turns += [_turn([f"{chain[-1]} holds {value}, a number.", f"Put {value} under {ANSWER_KEY}."],
                        f"{value} is a number.")]
    turns.append(_turn([f"{ANSWER_KEY} is set."], f"Check: {ANSWER_KEY}={value}."))
    answer = {"store": dict(sorted(store.items())), "key": ANSWER_KEY, "value": value}
    return _task("agentic", kind, prompt, answer, turns, f"Done: {ANSWER_KEY} is {value}.", calls)


def _verify_agentic(task: Task, completion: dict) -> Verdict:
    state = completion.get("state")
    if not isinstance(state, dict):
        raise ValueError("an agentic completion is {'state': {key: value}}, the final store of an episode")
    key, want = task.answer["key"], task.answer["value"]
    changed = sorted(k for k, v in task.answer["store"].items() if state.get(k) != v)
    if changed:
        return Verdict(False, f"keys changed or deleted: {', '.join(changed)}")
    if key not in state:
        return Verdict(False, f"nothing stored under {key}")
    return Verdict(state[key] == want, f"{key} holds {str(state[key])[:40]!r}, expected {want!r}")


# ------------------------------------------------------------------------------------------------------------------
# the public interface

_GENERATORS: dict[str, Callable[[random.Random], Task]] = {"math": _math, "code": _code, "agentic": _agentic}


def _check(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}: expected one of {allowed}, got {value!r}")


def generate(domain: str, n: int, seed: int = 0, split: str = "train") -> list[Task]:
    """``n`` tasks of ``domain`` in ``split``, deterministic in ``(domain, seed, split)``. Tasks are drawn
    independently (a small task space may repeat one); the split is decided by the task's content hash, so the
    train and test sets never share a task, whatever the seeds."""
    _check("domain", domain, DOMAINS)
    _check("split", split, SPLITS)
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_TASKS:
        raise ValueError(f"n: expected an int in [0, {MAX_TASKS:,}] (MAX_TASKS), got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed: expected an int, got {seed!r}")
    rng, tasks = random.Random(f"{domain}:{seed}"), []
    while len(tasks) < n:
        task = _GENERATORS[domain](rng)
        if _split(task) == split:
            tasks.append(task)
    return tasks


def system_prompt(effort: str) -> str:
    """The system message that sets the reasoning effort."""
    _check("effort", effort, EFFORTS)
    return f"effort: {effort}"


def reasoning(task: Task, effort: str, turn: int = 0) -> str:
    """The reference chain of thought of assistant turn ``turn``: empty (low), the steps (high), the steps and a
    check (max)."""
    _check("effort", effort, EFFORTS)
    t = _turn_at(task, turn)
    return " ".join({"low": [], "high": t["steps"], "max": [*t["steps"], t["check"]]}[effort])


def _turn_at(task: Task, turn: int) -> dict:
    turns = task.reference["turns"]
    if isinstance(turn, bool) or not isinstance(turn, int) or not 0 <= turn < len(turns):
        raise ValueError(f"turn: task {task.id} has turns 0..{len(turns) - 1}, got {turn!r}")
    return turns[turn]


def reference_call(task: Task, turn: int) -> dict:
    """The reference OpenAI tool call of agentic turn ``turn`` (id ``call_<turn>``, JSON-string arguments)."""
    call = task.reference["calls"][turn]
    fn = {"name": call["name"], "arguments": json.dumps(call["arguments"], separators=(",", ":"))}
    return {"id": f"call_{turn}", "type": "function", "function": fn}


def assistant_message(task: Task, effort: str, mode: str, turn: int = 0) -> dict:
    """The reference assistant message of ``turn``: reasoning in ``thinking`` mode only (none in ``instruct``),
    then the tool call of that turn (agentic turns before the last) or the final content."""
    _check("mode", mode, MODES)
    _check("effort", effort, EFFORTS)
    _turn_at(task, turn)
    message: dict[str, Any] = {"role": "assistant"}
    if mode == "thinking":
        message["reasoning_content"] = reasoning(task, effort, turn)
    if turn < len(task.reference.get("calls", ())):
        message.update(content="", tool_calls=[reference_call(task, turn)])
    else:
        message["content"] = task.reference["content"]
    return message


def verify(task: Task, completion: dict, timeout: float = CODE_TIMEOUT) -> Verdict:
    """Judge ``completion`` on ``task``; a wrong, crashing, looping or garbled answer is incorrect, never an error.

    * math: ``completion`` is a parsed assistant message; the *last* number of its content (``-?digits[.digits]``,
      whitespace around it ignored) must equal the answer string exactly (``"7.0"`` and ``"07"`` are not ``"7"``);
    * code: the content (its first ````` fenced block if it has one) must define the function, and every hidden test
      must return a value of exactly the expected type and value, within ``timeout`` seconds in a fresh `Sandbox`;
    * agentic: ``completion`` is ``{"state": store}``, the final key–value store of an episode (`k3.rl.agent`):
      the goal key must hold the answer and every key of the initial store must be unchanged.
    """
    if not isinstance(completion, dict):
        raise ValueError(f"completion: expected a dict, got {type(completion).__name__}")
    if task.domain == "math":
        return _verify_math(task, completion)
    if task.domain == "code":
        return _verify_code(task, completion, timeout)
    return _verify_agentic(task, completion)
