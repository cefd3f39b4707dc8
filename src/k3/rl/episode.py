"""Tasks as policy episodes (SPEC §7): prompt ids, the environment's replies in multi-turn (agentic) tasks, and the
judged outcome of a finished trajectory — shared by RL (`k3.rl.grpo`), MOPD (`k3.rl.distill`) and evaluation.

A trajectory of a task is the rendered conversation ``[system(effort), user]`` with the generation prompt, then the
sampled assistant message; in an agentic task each assistant message with tool calls is answered by the task's
`AgentEnv` (a sandbox per trajectory), whose rendered tool messages and the next generation prompt are appended as
environment tokens. A trajectory ends at an assistant message without tool calls, a malformed one (one ended by
``<|eos|>`` instead of ``<|end|>`` included: it is judged incorrect), or its budget.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from k3.rl.agent import TOOLS, AgentEnv
from k3.rl.rewards import budget_reward
from k3.rl.domains import EFFORTS, Task, assistant_message, system_prompt, verify
from k3.rl.rollout import ENVIRONMENT, PartialRollouts, Trajectory, run_iteration
from k3.chat.native import parse, render, stop_ids
from k3.serve.engine import Engine, SamplingParams
from k3.tokenization.bpe import Tokenizer

MODE = "thinking"


def _opening(task: Task, effort: str) -> list[dict]:
    return [{"role": "system", "content": system_prompt(effort)}, {"role": "user", "content": task.prompt}]


def _tools(task: Task) -> list[dict] | None:
    return TOOLS if task.domain == "agentic" else None


def prompt_ids(task: Task, effort: str, tokenizer: Tokenizer) -> list[int]:
    """The task's prompt at ``effort``: system and user messages, then ``<|assistant|><|think|>``."""
    return render(_opening(task, effort), tokenizer, MODE, _tools(task))


def reference_tokens(task: Task, effort: str, tokenizer: Tokenizer) -> int:
    """Tokens of the reference response at ``effort`` (all assistant turns; what the model would sample)."""
    messages = _opening(task, effort)
    turns = len(task.reference["turns"])
    total = 0
    for turn in range(turns):
        before = render(messages, tokenizer, MODE, _tools(task))
        messages = [*messages, assistant_message(task, effort, MODE, turn)]
        total += len(render(messages, tokenizer, MODE, _tools(task), add_generation_prompt=False)) - len(before)
        if turn < turns - 1:  # the tool result the environment would return; content does not count
            messages.append({"role": "tool", "tool_call_id": f"call_{turn}", "content": ""})
    return total


@dataclass(frozen=True)
class Outcome:
    """A finished trajectory, judged: ``correct``, sampled ``tokens`` (environment tokens excluded), ``reason``."""

    correct: bool
    tokens: int
    reason: str


class Episodes:
    """The tasks of a set of trajectories, their environments (agentic) and their judging.

    ``observe`` is `k3.rl.rollout.run_iteration`'s hook: it parses the assistant message a segment ended, runs its
    tool calls in the trajectory's `AgentEnv`, and returns the rendered replies (None: the episode is over). Paused
    environments are sandboxes on disk, holding no process (SPEC §8)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tasks: dict[int, tuple[Task, str]] = {}  # group id -> (task, effort)
        self.envs: dict[str, AgentEnv] = {}
        self.messages: dict[str, list[dict]] = {}  # agentic trajectories: the conversation so far
        self._assistant = render([{"role": "user", "content": ""}], tokenizer, MODE)[-2:]  # <|assistant|><|think|>

    def add(self, group: int, task: Task, effort: str) -> None:
        if effort not in EFFORTS:
            raise ValueError(f"effort: expected one of {EFFORTS}, got {effort!r}")
        self.tasks[group] = (task, effort)

    def _segment(self, traj: Trajectory) -> list[int]:
        """The ids of the last sampled assistant message (after the last environment reply)."""
        start = max((i + 1 for i, v in enumerate(traj.versions) if v == ENVIRONMENT), default=0)
        return traj.tokens[start:]

    def _message(self, traj: Trajectory) -> dict | None:
        try:
            (message,), _ = parse(self._assistant + self._segment(traj), self.tokenizer)
        except ValueError:
            return None
        return message

    def _env(self, traj: Trajectory) -> AgentEnv:
        if traj.id not in self.envs:
            task, effort = self.tasks[traj.group]
            env = AgentEnv()
            env.reset(task)
            self.envs[traj.id] = env
            self.messages[traj.id] = _opening(task, effort)
        return self.envs[traj.id]

    def observe(self, traj: Trajectory) -> list[int] | None:
        task, _ = self.tasks[traj.group]
        message = self._message(traj)
        if task.domain != "agentic" or message is None or not message.get("tool_calls"):
            return None
        env = self._env(traj)
        if env.done:
            return None
        messages = [*self.messages[traj.id], message]
        rendered = render(messages, self.tokenizer, MODE, TOOLS, add_generation_prompt=False)
        messages += env.respond(message["tool_calls"])
        self.messages[traj.id] = messages
        return render(messages, self.tokenizer, MODE, TOOLS)[len(rendered):]

    def judge(self, traj: Trajectory) -> Outcome:
        """Verify a finished trajectory and release its environment."""
        task, _ = self.tasks[traj.group]
        tokens = sum(v != ENVIRONMENT for v in traj.versions)
        message = self._message(traj) if traj.finish_reason == "stop" else None
        try:
            if message is None:
                return Outcome(False, tokens, f"no complete assistant message ({traj.finish_reason})")
            if task.domain == "agentic":
                if message.get("tool_calls"):
                    return Outcome(False, tokens, "the episode ended on a tool call")
                verdict = self._env(traj).judge()
            else:
                verdict = verify(task, message)
            return Outcome(verdict.correct, tokens, verdict.reason)
        finally:
            self.release(traj.id)

    def judge_group(self, group: list[Trajectory]) -> tuple[Task, str, list[Outcome]]:
        """Judge a complete group (its trajectories share one prompt) and forget it: (task, effort, outcomes)."""
        task, effort = self.tasks[group[0].group]
        outcomes = [self.judge(t) for t in group]
        del self.tasks[group[0].group]
        return task, effort, outcomes

    def release(self, traj_id: str) -> None:
        env = self.envs.pop(traj_id, None)
        if env is not None:
            env.close()
        self.messages.pop(traj_id, None)

    def resume_env(self, traj_id: str, sandbox: Path, calls: int, messages: list[dict]) -> None:
        """Bring back a paused trajectory's environment from its sandbox checkpoint (`Episodes.save_env`)."""
        task, _ = self.tasks[int(traj_id.partition("/")[0])]
        self.envs[traj_id] = AgentEnv.resume(task, sandbox, calls)
        self.messages[traj_id] = messages

    def save_env(self, traj_id: str, path: Path) -> dict:
        """Checkpoint a trajectory's environment into ``path``; what `resume_env` needs besides the path."""
        env = self.envs[traj_id]
        env.sandbox.checkpoint(path)
        return {"calls": env.calls, "messages": self.messages[traj_id]}

    def close(self) -> None:
        for traj_id in list(self.envs):
            self.release(traj_id)


def sampling(tokenizer: Tokenizer, temperature: float, seed: int | None = None) -> SamplingParams:
    """Rollout sampling: plain softmax at ``temperature`` (1 keeps the sampled log-probabilities the policy's), the
    chat format's stop ids, each token's log-probability reported."""
    return SamplingParams(temperature=temperature, seed=seed, stop_token_ids=stop_ids(tokenizer), logprobs=0,
                          max_tokens=1)


def budget_base(task: Task, tokenizer: Tokenizer) -> int:
    """``b0(x)`` of the budget reward (SPEC §7): the reference response's tokens at effort ``high``; an effort's
    budget is ``τ · b0`` (`k3.rl.rewards.EFFORT_TAU`)."""
    return reference_tokens(task, "high", tokenizer)


def evaluate(engine: Engine, tasks: Sequence[Task], effort: str, max_tokens: int, tau: float,
             temperature: float = 0.0, samples: int = 1, seed: int = 0) -> dict[str, float]:
    """Held-out evaluation at ``effort`` over ``samples`` responses per task (greedy at ``temperature`` 0, else
    sampled with ``seed``: the policy's expected reward): accuracy, mean response tokens, the share within the
    budget ``τ·b0`` and the mean budget reward (`k3.rl.rewards.budget_reward`)."""
    judged = sampled(engine, tasks, effort, max_tokens, temperature, samples, seed)
    bases = [budget_base(t, engine.tokenizer) for t in tasks for _ in range(samples)]
    outcomes = [o for _, o in judged]
    return {"accuracy": statistics.fmean(o.correct for o in outcomes),
            "mean_tokens": statistics.fmean(o.tokens for o in outcomes),
            "within_budget": statistics.fmean(o.tokens <= tau * b for o, b in zip(outcomes, bases)),
            "reward": statistics.fmean(budget_reward(float(o.correct), o.tokens, b, tau)
                                       for o, b in zip(outcomes, bases))}


def greedy(engine: Engine, tasks: Sequence[Task], effort: str, max_tokens: int) -> list[tuple[Trajectory, Outcome]]:
    """Each task's greedy trajectory at ``effort`` and its judgement."""
    return sampled(engine, tasks, effort, max_tokens, 0.0, 1, 0)


def sampled(engine: Engine, tasks: Sequence[Task], effort: str, max_tokens: int, temperature: float, samples: int,
            seed: int) -> list[tuple[Trajectory, Outcome]]:
    """``samples`` trajectories per task at ``effort`` (task-major order) and their judgements; multi-turn tasks
    run their environment."""
    if not tasks:
        raise ValueError("no tasks to evaluate")
    episodes = Episodes(engine.tokenizer)
    rollouts = PartialRollouts(len(tasks), samples)
    groups = rollouts.fill([prompt_ids(t, effort, engine.tokenizer) for t in tasks])
    for group, task in zip(groups, tasks):
        episodes.add(group, task, effort)
    params = sampling(engine.tokenizer, temperature, seed=seed if temperature > 0 else None)
    try:
        run_iteration(engine, rollouts, params, 0, 1.0, max_tokens, episodes.observe)
        return [(traj, episodes.judge(traj)) for group in rollouts.complete_groups() for traj in group]
    finally:
        episodes.close()
