"""SFT chat data of the toy domains (SPEC §7, Appendix F; issue 19 deliverable 1): ``chats.jsonl`` for ``k3 sft``.

One record per line::

    {"messages": [system(effort), user, assistant, (tool, assistant)...], "mode": "thinking" | "instruct",
     "tools": [...] (agentic only), "domain": d, "effort": e, "task": Task.to_dict()}

A thinking record carries its effort's reference reasoning in ``reasoning_content``; an instruct record has none
and uses the system prompt of effort ``low``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from k3.rl.agent import TOOLS, episode_messages
from k3.rl.domains import DOMAINS, EFFORTS, MAX_TASKS, SPLITS, Task, assistant_message, generate, system_prompt
from k3.chat.native import MODES, format_tool_calls, normalize
from k3.files import DATA_LIMIT, jsonl_records, read_bytes, write_text

__all__ = ["chat_records", "plain_texts", "read_chats", "record", "write_chats"]


def record(task: Task, effort: str, mode: str) -> dict:
    """The chat record of ``task``'s reference solution at ``effort`` in ``mode``."""
    if task.domain == "agentic":
        messages = episode_messages(task, effort, mode)
    else:
        messages = [{"role": "system", "content": system_prompt(effort)}, {"role": "user", "content": task.prompt},
                    assistant_message(task, effort, mode)]
    tools = {"tools": TOOLS} if task.domain == "agentic" else {}
    return {"messages": messages, "mode": mode, **tools, "domain": task.domain, "effort": effort,
            "task": task.to_dict()}


def chat_records(domains: Sequence[str] = DOMAINS, efforts: Sequence[str] = EFFORTS, n_per: int = 100, seed: int = 0,
                 split: str = "train", modes: Sequence[str] = MODES) -> list[dict]:
    """For each domain, ``n_per`` tasks of ``split`` (`generate`), each as one thinking record per effort and one
    instruct record (effort ``low``), as ``modes`` ask."""
    for name, values, allowed in (("domains", domains, DOMAINS), ("efforts", efforts, EFFORTS),
                                  ("modes", modes, MODES)):
        if isinstance(values, str) or not set(values) <= set(allowed):
            raise ValueError(f"{name}: expected a sequence of {allowed}, got {values!r}")
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")
    if isinstance(n_per, bool) or not isinstance(n_per, int) or not 0 <= n_per <= MAX_TASKS:
        raise ValueError(f"n_per: expected an int in [0, {MAX_TASKS:,}] tasks per domain (MAX_TASKS), got {n_per!r}")
    out = []
    for domain in domains:
        for task in generate(domain, n_per, seed, split):
            out += [record(task, e, "thinking") for e in efforts] if "thinking" in modes else []
            out += [record(task, "low", "instruct")] if "instruct" in modes else []
    return out


def _check(rec: Any, where: str) -> None:
    """``ValueError`` naming ``where`` and the field unless ``rec`` is a well-formed chat record."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    for key, allowed in (("mode", MODES), ("domain", DOMAINS), ("effort", EFFORTS)):
        if rec.get(key) not in allowed:
            raise ValueError(f"{where}: {key}: expected one of {allowed}, got {rec.get(key)!r}")
    extra = set(rec) - {"messages", "mode", "tools", "domain", "effort", "task"}
    if extra:
        raise ValueError(f"{where}: unknown fields {sorted(extra)}")
    try:
        task = Task.from_dict(rec.get("task"))
        normalize(rec.get("messages"), rec["mode"], rec.get("tools"))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
    if task.domain != rec["domain"]:
        raise ValueError(f"{where}: domain {rec['domain']!r} but the task's is {task.domain!r}")


def write_chats(path: str | os.PathLike[str], records: Sequence[dict]) -> Path:
    """Write ``records`` as JSONL (atomically), each checked first; returns the path."""
    for i, rec in enumerate(records):
        _check(rec, f"record {i}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


def read_chats(path: str | os.PathLike[str]) -> list[dict]:
    """The records of a ``chats.jsonl`` (blank lines skipped); ``ValueError`` naming ``path`` and the line for a bad
    one. A regular file of at most `DATA_LIMIT` bytes: a FIFO or a device is refused, not read."""
    records = []
    for number, record in jsonl_records(read_bytes(path, DATA_LIMIT), path):
        _check(record, f"{os.fspath(path)}, line {number}")
        records.append(record)
    return records


def plain_texts(records: Sequence[dict]) -> list[str]:
    """Each record as readable text, one ``role: text`` line per channel (tools and tool calls as the compact JSON
    the chat format renders), for training a tokenizer or a base model on the domains' text."""
    out = []
    for rec in records:
        lines = []
        if rec.get("tools"):
            lines.append("tools: " + json.dumps([t["function"] for t in rec["tools"]], separators=(",", ":")))
        for m in rec["messages"]:
            if m.get("reasoning_content") is not None:
                lines.append(f"think: {m['reasoning_content']}")
            lines.append(f"{m['role']}: {m['content']}")
            if m.get("tool_calls"):
                lines.append(f"calls: {format_tool_calls(m['tool_calls'])}")
        out.append("\n".join(lines))
    return out
