"""The RL stage (SPEC §7; ``k3 rl --ckpt SFT --out DIR``): on-policy policy gradient with group-normalised
advantages over K samples per prompt, token budgets per effort, the verbosity rule and partial rollouts.

One *iteration*: new prompts (train tasks of the run's domains, cycled in a fixed order) fill the `PartialRollouts`
up to N groups, each at the effort of the moment (fixed, or annealed max → high → low by `tau_schedule`); the
serving engine (`k3.serve.engine.Engine`, continuous batching) samples until a fraction λ of the iteration's
trajectories finished, the rest pause and resume first next iteration. Each group whose K samples all finished is
judged (`k3.rl.episode`): reward = `budget_reward` (−1 over ``τ·b0``), then `apply_verbosity` (longer than
``σ·ℓ0``, ℓ0 the reference response at the group's effort, loses), advantages `group_advantages`. One optimiser
step minimises `policy_loss` over every sampled token of those groups, with the log-probabilities recorded at
sampling (tokens of older policy versions are weighted by the clipped ratio). The policy version is the number of
optimiser steps taken; every token carries the version that sampled it.

Held-out: K sampled answers to each of the domains' test tasks at the evaluation effort and the run's temperature
(a fixed seed) — accuracy, mean tokens, share within budget and budget reward, the policy's expected reward that
RL maximises — at the start and every ``eval_every`` iterations. A run resumes exactly from its newest
checkpoint: weights, optimiser, RNG, the rollouts in flight with their paused environments (sandbox checkpoints).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import torch

from k3.rl.domains import DOMAINS, EFFORTS, Task, generate
from k3.rl.episode import budget_base, evaluate, reference_tokens
from k3.rl.onpolicy import OnPolicyRun, check_work, run_stage, training_batch
from k3.rl.policy import token_logprobs
from k3.rl.rewards import EFFORT_TAU, apply_verbosity, budget_reward, group_advantages, policy_loss, tau_schedule
from k3.rl.rollout import Trajectory
from k3.train.driver import check_counts

ANNEAL = "anneal"


@dataclass
class RLConfig:
    """An RL run (module docstring). ``effort``: one of `EFFORTS` (a teacher of that effort) or ``"anneal"``;
    ``prompts`` × ``samples`` = N × K; ``lam`` the partial-rollout pause fraction (1: wait for every trajectory);
    ``max_tokens`` bounds a whole trajectory, environment replies included. The log-probabilities recorded at
    sampling are the untempered policy's, so a ``temperature`` other than 1 makes the update slightly off-policy."""

    ckpt: str = ""
    out: str = "runs/rl"
    domains: list[str] = field(default_factory=lambda: list(DOMAINS))
    effort: str = ANNEAL
    steps: int = 30
    prompts: int = 8
    samples: int = 4
    lam: float = 0.75
    max_tokens: int = 96
    temperature: float = 1.0
    lr: float = 5e-5
    clip_eps: float = 0.2
    clip_grad: float = 1.0
    sigma: float = 2.0
    train_tasks: int = 256
    eval_tasks: int = 16
    eval_every: int = 5
    ckpt_every: int = 5
    seed: int = 0
    threads: int | None = None
    progress: bool = True

    def validate(self) -> RLConfig:
        check_counts(self, "rl", ("steps", "prompts", "samples", "max_tokens", "train_tasks", "eval_tasks",
                                        "eval_every", "ckpt_every"))
        check_work(self, "rl")
        if not self.ckpt or not self.out:
            raise ValueError("rl.ckpt and rl.out are required: paths")
        if not self.domains or not set(self.domains) <= set(DOMAINS) or len(set(self.domains)) != len(self.domains):
            raise ValueError(f"rl.domains = {self.domains!r} is invalid: distinct names from {DOMAINS}")
        if self.effort not in (*EFFORTS, ANNEAL):
            raise ValueError(f"rl.effort = {self.effort!r} is invalid: one of {(*EFFORTS, ANNEAL)}")
        if not 0 < self.lam <= 1:
            raise ValueError(f"rl.lam = {self.lam!r} is invalid: a fraction in (0, 1]")
        if not self.temperature > 0 or not self.lr > 0 or not self.clip_eps > 0 or not self.sigma > 0:
            raise ValueError("rl: temperature, lr, clip_eps and sigma must be positive")
        return self

    @property
    def eval_effort(self) -> str:
        """The effort of held-out evaluation: the run's, or ``low`` (where annealing ends)."""
        return "low" if self.effort == ANNEAL else self.effort


class RLRun(OnPolicyRun):
    """One RL run; `iteration()` rolls out, judges the complete groups and takes one optimiser step."""

    stage_name = "RL"

    def __init__(self, config: RLConfig) -> None:
        super().__init__(config)
        cfg = self.config
        self.train_tasks = _interleave([generate(d, cfg.train_tasks, cfg.seed, "train") for d in cfg.domains])
        self.eval_tasks = {d: generate(d, cfg.eval_tasks, cfg.seed, "test") for d in cfg.domains}

    def effort(self) -> str:
        """The effort of prompts started now: the run's, or annealed max → high → low over the iterations."""
        return tau_schedule(self.step_index, self.config.steps)[0] if self.config.effort == ANNEAL \
            else self.config.effort

    def next_prompts(self, n: int) -> list[tuple[Task, str]]:
        effort = self.effort()
        return [(self.train_tasks[(self.cursor + i) % len(self.train_tasks)], effort) for i in range(n)]

    def _rewards(self, group: list[Trajectory]) -> tuple[list[float], list[bool], list[int]]:
        """The group's rewards after the budget and verbosity rules, correctness and sampled lengths."""
        task, effort, outcomes = self.episodes.judge_group(group)
        b0, l0 = budget_base(task, self.tokenizer), reference_tokens(task, effort, self.tokenizer)
        lengths = [o.tokens for o in outcomes]
        rewards = [budget_reward(float(o.correct), o.tokens, b0, EFFORT_TAU[effort]) for o in outcomes]
        return apply_verbosity(rewards, lengths, l0, self.config.sigma), [o.correct for o in outcomes], lengths

    def update(self, groups: list[list[Trajectory]]) -> dict[str, Any]:
        trajectories, advantages, rewards, correct, lengths = [], [], [], [], []
        for group in groups:
            r, c, n = self._rewards(group)
            trajectories += group
            advantages += group_advantages(r).tolist()
            rewards, correct, lengths = rewards + r, correct + c, lengths + n
        inputs, targets, mask, old = training_batch(trajectories, self.tokenizer.pad_id)
        self.model.train()
        logprobs = token_logprobs(self.model, inputs, targets, self.tokenizer.vocab_size)
        loss = policy_loss(logprobs, old, torch.tensor(advantages), mask, self.config.clip_eps)
        return {"loss": float(loss.detach()), "grad_norm": self.step_optimizer(loss),
                "reward": statistics.fmean(rewards), "accuracy": statistics.fmean(correct),
                "mean_tokens": statistics.fmean(lengths)}

    def evaluation(self) -> dict[str, Any]:
        """Held-out metrics per domain at the evaluation effort — the policy's expected reward, from K samples per
        test task at the run's temperature (a fixed seed, the same at every evaluation) — and their means."""
        cfg = self.config
        effort = cfg.eval_effort
        out: dict[str, float] = {}
        for domain, tasks in self.eval_tasks.items():
            for key, value in evaluate(self.engine, tasks, effort, cfg.max_tokens, EFFORT_TAU[effort],
                                       cfg.temperature, cfg.samples, cfg.seed).items():
                out[f"eval_{domain}_{key}"] = value
        for key in ("accuracy", "mean_tokens", "within_budget", "reward"):
            out[f"eval_{key}"] = statistics.fmean(out[f"eval_{d}_{key}"] for d in self.eval_tasks)
        return out


def _interleave(lists: list[list[Task]]) -> list[Task]:
    return [task for row in zip(*lists) for task in row]


PANELS = (("held-out (K samples per task)", ("eval_accuracy", "eval_within_budget", "eval_reward")),
          ("training rollouts", ("reward", "accuracy")),
          ("response tokens", ("mean_tokens", "eval_mean_tokens")),
          ("partial rollouts", ("idle", "stale_token_fraction")))


def run_rl(config: RLConfig, resume: bool = False) -> RLRun:
    """Run (or continue) RL (`k3.rl.onpolicy.run_stage`)."""
    return run_stage(RLRun(config), resume, PANELS)
