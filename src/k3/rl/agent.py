"""The agentic environment (SPEC §8 AgentENV; issue 19 deliverable 2c): a key–value store puzzle played through the
tools channel with the tools ``get(key)``, ``put(key, value)`` and ``keys()``.

The store is one file of the episode's `Sandbox`, ``store.json`` (a JSON object of string values), and the tools are
plain file operations on the sandbox root through `Sandbox.read` / `Sandbox.write`: no process runs, and the whole
state of the environment is the sandbox's files, so an episode is snapshotted, checkpointed, resumed and forked with
its sandbox. Judging reads the store of a fork, which leaves the episode's sandbox untouched.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from k3.rl.domains import Task, Verdict, assistant_message, system_prompt, verify
from k3.rl.sandbox import Sandbox

__all__ = ["MAX_CALLS", "STORE", "TOOLS", "AgentEnv", "episode_messages"]

#: The sandbox file holding the key–value store.
STORE = "store.json"
#: Tool calls one episode may make.
MAX_CALLS = 8
_MAX_KEYS, _MAX_VALUE = 32, 64
_KEY = re.compile(r"[A-Za-z0-9_]{1,16}")


def _tool(name: str, description: str, *params: str) -> dict:
    schema = {"type": "object", "properties": {p: {"type": "string"} for p in params}}
    schema.update({"required": list(params)} if params else {})
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


#: The environment's tools as OpenAI function tools (rendered into the system message of an agentic chat).
TOOLS = [_tool("get", "Value of a key.", "key"), _tool("put", "Set a key.", "key", "value"),
         _tool("keys", "All keys.")]
_PARAMS = {t["function"]["name"]: list(t["function"]["parameters"]["properties"]) for t in TOOLS}


class _ToolError(ValueError):
    """A bad tool call; its message goes back to the model as the tool result."""


def _unpack(tool_call: Any) -> tuple[str, dict[str, str]]:
    """``(name, arguments)`` of an OpenAI tool call, checked against the tool's parameters."""
    fn = tool_call.get("function") if isinstance(tool_call, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or name not in _PARAMS:
        raise _ToolError(f"unknown tool {name!r}; the tools are {', '.join(_PARAMS)}")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            args = None
    if not isinstance(args, dict):
        raise _ToolError(f"{name}: the arguments must be a JSON object")
    want = _PARAMS[name]
    if sorted(args) != sorted(want) or not all(isinstance(v, str) for v in args.values()):
        raise _ToolError(f"{name} takes " + (f"the string arguments {', '.join(want)}" if want else "no arguments"))
    return name, args


def _load(box: Sandbox) -> dict[str, str]:
    return json.loads(box.read(STORE))


def _check_agentic(task: Task) -> None:
    if task.domain != "agentic":
        raise ValueError(f"task {task.id}: expected an agentic task, got domain {task.domain!r}")


class AgentEnv:
    """One episode of a key–value puzzle in its own `Sandbox`: ``reset(task)`` (or ``resume`` a checkpointed one),
    then ``call`` per tool call until the model answers or ``done``; ``judge()`` verifies the final store. A context
    manager (``close`` deletes the sandbox). Bad tool calls are answered with an ``"error: ..."`` string, never an
    exception."""

    def __init__(self, max_calls: int = MAX_CALLS) -> None:
        if isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 1:
            raise ValueError(f"max_calls: expected a positive int, got {max_calls!r}")
        self.max_calls = max_calls
        self.calls = 0
        self.task: Task | None = None
        self._box: Sandbox | None = None

    def reset(self, task: Task) -> None:
        """Start an episode of ``task`` in a fresh sandbox holding its initial store."""
        _check_agentic(task)
        self.close()
        self._box = Sandbox()
        self._box.write(STORE, json.dumps(task.answer["store"]))
        self.task, self.calls = task, 0

    @classmethod
    def resume(cls, task: Task, checkpoint: Path, calls: int, max_calls: int = MAX_CALLS) -> AgentEnv:
        """The episode of ``task`` continued from its sandbox's checkpoint (`Sandbox.checkpoint`) after ``calls``
        tool calls; ``ValueError`` naming the checkpoint if it is missing, corrupt or holds no store."""
        _check_agentic(task)
        env = cls(max_calls)
        if isinstance(calls, bool) or not isinstance(calls, int) or not 0 <= calls <= max_calls:
            raise ValueError(f"calls: expected an int in [0, {max_calls}], got {calls!r}")
        try:
            env._box = Sandbox.resume(checkpoint)
            if not isinstance(env.state(), dict):
                raise ValueError(f"{STORE} is not a JSON object")
        except (OSError, ValueError) as e:
            env.close()
            raise ValueError(f"checkpoint {checkpoint}: {e}") from e
        env.task, env.calls = task, calls
        return env

    @property
    def sandbox(self) -> Sandbox:
        """The episode's sandbox (``RuntimeError`` before ``reset``)."""
        if self._box is None:
            raise RuntimeError("no episode: call reset(task) first")
        return self._box

    @property
    def done(self) -> bool:
        """Whether the episode's tool calls are used up."""
        return self.calls >= self.max_calls

    def state(self) -> dict[str, str]:
        """The current key–value store."""
        return _load(self.sandbox)

    def call(self, tool_call: dict) -> str:
        """Execute one OpenAI tool call; the result (or ``"error: ..."``) is the tool message's content."""
        box = self.sandbox
        if self.done:
            return f"error: the {self.max_calls} tool calls of this episode are used up"
        self.calls += 1
        try:
            name, args = _unpack(tool_call)
            store = _load(box)
            if name == "keys":
                return " ".join(sorted(store))
            key = args["key"]
            if name == "get":
                if key not in store:
                    raise _ToolError(f"no key {key[:20]!r}")
                return store[key]
            if not _KEY.fullmatch(key):
                raise _ToolError("a key is 1-16 letters, digits or _")
            if len(args["value"]) > _MAX_VALUE or (key not in store and len(store) >= _MAX_KEYS):
                raise _ToolError(f"the store holds at most {_MAX_KEYS} keys of values up to {_MAX_VALUE} chars")
            box.write(STORE, json.dumps({**store, key: args["value"]}))
            return "ok"
        except _ToolError as e:
            return f"error: {e}"

    def respond(self, tool_calls: list[dict]) -> list[dict]:
        """The tool messages answering an assistant message's ``tool_calls``, executed in order."""
        out = []
        for i, call in enumerate(tool_calls):
            cid = call.get("id") if isinstance(call, dict) else None
            cid = cid if isinstance(cid, str) and cid and "\n" not in cid else f"call_{i}"
            out.append({"role": "tool", "tool_call_id": cid, "content": self.call(call)})
        return out

    def judge(self) -> Verdict:
        """`verify` the final store, read from a fork of the sandbox (side-effect-free for the episode)."""
        with self.sandbox.fork() as fork:
            return verify(self.task, {"state": _load(fork)})

    def close(self) -> None:
        if self._box is not None:
            self._box.close()
            self._box = None

    def __enter__(self) -> AgentEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def episode_messages(task: Task, effort: str = "high", mode: str = "thinking") -> list[dict]:
    """The reference conversation of an agentic task for SFT: system (effort), user, then per reference tool call
    an assistant message and the tool result the environment really returns, then the final answer."""
    messages = [{"role": "system", "content": system_prompt(effort)}, {"role": "user", "content": task.prompt}]
    with AgentEnv() as env:
        env.reset(task)
        for turn in range(len(task.reference["calls"])):
            message = assistant_message(task, effort, mode, turn)
            messages += [message, *env.respond(message["tool_calls"])]
    return [*messages, assistant_message(task, effort, mode, len(task.reference["calls"]))]
