"""Partial rollouts (SPEC §7) over the continuous-batching engine (`k3.serve.engine.Engine`).

An RL iteration keeps N prompt groups × K samples in flight. It runs until a fraction λ of its trajectories
finished, then pauses the rest: they keep their tokens and resume first at the next iteration (their request is
the prompt plus the tokens so far, with the remaining token budget), so one long response never holds the whole
batch. A group is handed to the optimiser only once all K of its samples finished, and every token records the
policy version that sampled it (tokens of one trajectory may come from several versions).

A multi-turn (agentic) trajectory continues after a segment stops: ``run_iteration(observe=...)`` appends the
environment's reply (tool results and the next generation prompt, tagged `ENVIRONMENT`, never trained) and submits
the trajectory again within the same iteration.

`PartialRollouts` is the bookkeeping (no model); `run_iteration` drives an engine through one iteration.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from k3.serve.engine import Engine, Output, SamplingParams

__all__ = ["ENVIRONMENT", "Trajectory", "PartialRollouts", "IterationStats", "run_iteration"]

#: The version tag of tokens the environment wrote into a trajectory (tool results): context, never trained.
ENVIRONMENT = -1


@dataclass
class Trajectory:
    """Sample ``index`` (0..K−1) of prompt group ``group``: its tokens so far, the policy version that sampled each
    and its log-probability under that policy at sampling time. ``iterations`` counts the iterations it took part
    in; an unfinished trajectory with ``iterations > 0`` is paused."""

    group: int
    index: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    iterations: int = 0

    @property
    def id(self) -> str:
        return f"{self.group}/{self.index}"


class PartialRollouts:
    """Partial-rollout bookkeeping: ``num_prompts`` groups × ``num_samples`` trajectories in flight."""

    def __init__(self, num_prompts: int, num_samples: int) -> None:
        if num_prompts < 1 or num_samples < 1:
            raise ValueError(f"num_prompts and num_samples: expected positive integers, got {num_prompts} and "
                             f"{num_samples}")
        self.num_prompts, self.num_samples = num_prompts, num_samples
        self._groups: dict[int, list[Trajectory]] = {}  # in flight, in creation order
        self._next_group = 0
        self._iteration: list[Trajectory] = []  # scheduled by the last `schedule`
        self._scheduled_ids: set[str] = set()

    @property
    def groups_in_flight(self) -> int:
        return len(self._groups)

    def in_flight(self) -> list[Trajectory]:
        """The trajectories of the groups in flight, by group then sample index."""
        return [t for group in self._groups.values() for t in group]

    def fill(self, prompts: Sequence[Sequence[int]]) -> list[int]:
        """Start new groups from the first prompts until ``num_prompts`` are in flight; returns their group ids
        (one per prompt taken, in order; the caller keeps the prompts not taken)."""
        taken = list(prompts[: self.num_prompts - len(self._groups)])
        for i, prompt in enumerate(taken):
            if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise ValueError(f"prompts[{i}]: expected a non-empty list of token ids")
        ids = []
        for prompt in taken:
            group, self._next_group = self._next_group, self._next_group + 1
            self._groups[group] = [Trajectory(group, k, list(prompt)) for k in range(self.num_samples)]
            ids.append(group)
        return ids

    def trajectory(self, traj_id: str) -> Trajectory:
        group, _, index = traj_id.partition("/")
        try:
            return self._groups[int(group)][int(index)]
        except (KeyError, IndexError, ValueError):
            raise KeyError(f"trajectory {traj_id!r} is not in flight") from None

    def schedule(self) -> list[Trajectory]:
        """Start an iteration: every unfinished trajectory, the paused ones first (in their original order), then
        the new ones."""
        pending = [t for t in self.in_flight() if not t.finished]
        self._iteration = [t for t in pending if t.iterations] + [t for t in pending if not t.iterations]
        self._scheduled_ids = {t.id for t in self._iteration}
        for t in self._iteration:
            t.iterations += 1
        return list(self._iteration)

    def _scheduled(self, traj_id: str) -> Trajectory:
        traj = self.trajectory(traj_id)
        if traj_id not in self._scheduled_ids:
            raise ValueError(f"trajectory {traj_id!r} is not scheduled in this iteration")
        if traj.finished:
            raise ValueError(f"trajectory {traj_id!r} already finished ({traj.finish_reason})")
        return traj

    def record(self, traj_id: str, tokens: Sequence[int], logprobs: Sequence[float], version: int) -> None:
        """Append sampled tokens with their sampling-time log-probabilities, tagged with policy ``version``."""
        if len(tokens) != len(logprobs):
            raise ValueError(f"tokens and logprobs: expected one log-probability per token, got {len(tokens)} and "
                             f"{len(logprobs)}")
        traj = self._scheduled(traj_id)
        traj.tokens += [int(t) for t in tokens]
        traj.logprobs += [float(p) for p in logprobs]
        traj.versions += [int(version)] * len(tokens)

    def observe(self, traj_id: str, tokens: Sequence[int]) -> None:
        """Append the environment's reply to a trajectory (tagged `ENVIRONMENT`, log-probability 0)."""
        traj = self._scheduled(traj_id)
        traj.tokens += [int(t) for t in tokens]
        traj.logprobs += [0.0] * len(tokens)
        traj.versions += [ENVIRONMENT] * len(tokens)

    def finish(self, traj_id: str, reason: str) -> None:
        traj = self._scheduled(traj_id)
        traj.finished, traj.finish_reason = True, reason

    def pause_point(self, lam: float) -> bool:
        """True once a fraction ``lam`` ∈ (0, 1] of this iteration's trajectories finished."""
        if not 0 < lam <= 1:
            raise ValueError(f"lam: expected a fraction in (0, 1], got {lam!r}")
        if not self._iteration:
            return True
        return sum(t.finished for t in self._iteration) / len(self._iteration) >= lam

    def complete_groups(self) -> list[list[Trajectory]]:
        """Remove and return the groups whose K trajectories all finished (each ordered by sample index)."""
        done = [g for g, group in self._groups.items() if all(t.finished for t in group)]
        return [self._groups.pop(g) for g in done]

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (between iterations: the next one starts with `schedule`)."""
        return {"num_prompts": self.num_prompts, "num_samples": self.num_samples, "next_group": self._next_group,
                "groups": [[asdict(t) for t in group] for group in self._groups.values()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["num_prompts"], state["num_samples"]) != (self.num_prompts, self.num_samples):
            raise ValueError(f"state: saved for {state['num_prompts']} prompts × {state['num_samples']} samples, "
                             f"this run has {self.num_prompts} × {self.num_samples}")
        groups = [[Trajectory(**t) for t in group] for group in state["groups"]]
        for group in groups:
            if [t.index for t in group] != list(range(self.num_samples)) or len({t.group for t in group}) != 1:
                raise ValueError(f"state: group {group[0].group if group else '?'} is not samples 0..K−1 of one "
                                 f"group")
        self._groups = {group[0].group: group for group in groups}
        self._next_group = state["next_group"]
        self._iteration, self._scheduled_ids = [], set()


@dataclass(frozen=True)
class IterationStats:
    """One iteration: tokens generated, engine steps, wall seconds, trajectories finished and paused, and the
    fraction of batch slots left idle over the steps (``1 − Σ occupied / (steps · max_batch)``)."""

    tokens: int
    steps: int
    seconds: float
    finished: int
    paused: int
    idle: float


def _segment_params(params: SamplingParams, traj: Trajectory, remaining: int) -> SamplingParams:
    """``params`` for the next segment of ``traj``: the remaining token budget, the sampled tokens' log-probabilities,
    and (when seeded) a seed of its own per trajectory and segment, so the K samples of a prompt differ."""
    seed = params.seed
    if seed is not None:
        key = f"{seed}/{traj.id}/{len(traj.tokens)}".encode()
        seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return replace(params, max_tokens=remaining, seed=seed, logprobs=params.logprobs or 0)


def run_iteration(engine: Engine, rollouts: PartialRollouts, params: SamplingParams, version: int, lam: float,
                  max_tokens: int, observe: Callable[[Trajectory], list[int] | None] | None = None
                  ) -> IterationStats:
    """Run one iteration of ``rollouts`` on ``engine`` (stepped inline: no background thread may run it).

    The scheduled trajectories are submitted in schedule order (the engine admits in arrival order, so paused ones
    go first), each with its prompt plus its tokens so far and ``max_tokens`` minus their number (a trajectory
    already at ``max_tokens`` finishes with "length"). The engine steps until `PartialRollouts.pause_point`
    (``lam = 1``: every trajectory finishes, no partial rollouts); the rest are aborted and stay paused with what
    they generated. Every new token is tagged ``version``. ``params`` holds the sampling settings (the chat format's
    ``stop_token_ids`` come from `k3.chat.native.stop_ids`). A request the engine ends with an error raises
    RuntimeError. ``observe`` (multi-turn tasks) is asked whenever a segment stops: ids it returns are appended as
    the environment's reply and the trajectory goes on, as a new request, in this iteration; None finishes it.
    """
    if not 0 < lam <= 1:
        raise ValueError(f"lam: expected a fraction in (0, 1], got {lam!r}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens: expected a positive integer, got {max_tokens!r}")
    start = time.perf_counter()
    scheduled = rollouts.schedule()
    active: dict[str, str] = {}  # engine request id -> trajectory id
    errors: list[str] = []
    generated = 0

    stopped: list[str] = []  # trajectories whose segment stopped during the last step, for `observe`

    def callback(traj_id: str, output: Output) -> None:
        nonlocal generated
        try:
            if output.token_ids:
                rollouts.record(traj_id, output.token_ids, [lp.logprob for lp in output.logprobs], version)
                generated += len(output.token_ids)
            if output.finish_reason == "error":
                errors.append(f"trajectory {traj_id}: {output.error}")
            elif output.finish_reason is not None:
                active.pop(output.request_id, None)
                if output.finish_reason == "stop" and observe is not None:
                    stopped.append(traj_id)
                elif output.finish_reason != "abort":  # our own abort at the pause point
                    rollouts.finish(traj_id, output.finish_reason)
        except Exception as err:  # the engine would swallow it and cancel the request
            errors.append(f"trajectory {traj_id}: {type(err).__name__}: {err}")

    def submit(trajectories: list[Trajectory]) -> None:
        jobs, ids = [], []
        for traj in trajectories:
            if len(traj.tokens) >= max_tokens:
                rollouts.finish(traj.id, "length")
                continue
            request_id = f"rl-{traj.id}-{len(traj.tokens)}"
            jobs.append((traj.prompt + traj.tokens, _segment_params(params, traj, max_tokens - len(traj.tokens)),
                         None, lambda output, traj_id=traj.id: callback(traj_id, output)))
            active[request_id] = traj.id
            ids.append(request_id)
        if jobs:
            engine.add_requests(jobs, group="rl", request_ids=ids)

    def continue_stopped() -> None:
        again = []
        for traj_id in stopped:
            traj = rollouts.trajectory(traj_id)
            reply = observe(traj)
            if reply:
                rollouts.observe(traj_id, reply)
                again.append(traj)
            else:
                rollouts.finish(traj_id, "stop")
        stopped.clear()
        submit(again)

    submit(scheduled)
    steps = occupied = 0
    try:
        while active and not errors and not rollouts.pause_point(lam):
            occupied += min(engine.max_batch, len(engine.running) + engine.num_waiting)
            engine.step()
            steps += 1
            if stopped and not errors:
                continue_stopped()
    finally:
        for request_id in list(active):
            engine.abort(request_id)
    if errors:
        raise RuntimeError("rollout failed: " + "; ".join(errors))
    finished = sum(t.finished for t in scheduled)
    return IterationStats(generated, steps, time.perf_counter() - start, finished, len(scheduled) - finished,
                          1.0 - occupied / (steps * engine.max_batch) if steps else 0.0)
