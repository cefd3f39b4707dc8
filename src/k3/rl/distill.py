"""Multi-Teacher On-Policy Distillation (SPEC §7; ``k3 distill --ckpt SFT --teachers DIR --out DIR``).

Nine teachers — one RL run per domain × effort (``DIR/<domain>-<effort>``, e.g. ``math-low``) — and one student
that samples its own responses (on-policy, on the serving engine, partial rollouts as in RL with K = 1). Each
sampled token ``y_t`` of a prompt of domain d at effort e is rewarded by the teacher of (d, e):

    r_t = clip(sg(log π_teacher(y_t) − log π_student(y_t)), −R, R)

and the student minimises `policy_loss` with ``r_t`` as the token's advantage (the clipped ratio against the
log-probability recorded at sampling): the gradient of the reverse KL to that teacher, token by token.

Held-out, per domain × effort at the start and every ``eval_every`` iterations: the student's greedy answers to
the test tasks (accuracy, mean tokens) and the *teacher gap*, the mean ``log π_student − log π_teacher`` over
those answers' tokens (0 when the student samples as its teacher would).
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from k3.model import checkpoint as model_ckpt
from k3.model.lm import K3ForCausalLM
from k3.rl.domains import DOMAINS, EFFORTS, Task, generate
from k3.rl.episode import greedy
from k3.rl.onpolicy import OnPolicyRun, check_work, run_stage, training_batch
from k3.rl.policy import token_logprobs
from k3.rl.rewards import mopd_token_rewards, policy_loss
from k3.rl.rollout import Trajectory
from k3.train.driver import check_counts


@dataclass
class DistillConfig:
    """A MOPD run (module docstring): ``prompts`` per iteration, cycling over the domain × effort pairs;
    ``reward_clip`` is R; ``lam`` the partial-rollout pause fraction."""

    ckpt: str = ""
    teachers: str = ""
    out: str = "runs/distill"
    domains: list[str] = field(default_factory=lambda: list(DOMAINS))
    efforts: list[str] = field(default_factory=lambda: list(EFFORTS))
    steps: int = 30
    prompts: int = 18
    samples: int = 1  # K = 1: MOPD's reward is per token, no group to normalise over
    lam: float = 1.0
    max_tokens: int = 96
    temperature: float = 1.0
    lr: float = 5e-5
    reward_clip: float = 5.0
    clip_eps: float = 0.2
    clip_grad: float = 1.0
    train_tasks: int = 256
    eval_tasks: int = 8
    eval_every: int = 5
    ckpt_every: int = 5
    seed: int = 0
    threads: int | None = None
    progress: bool = True

    def validate(self) -> DistillConfig:
        if self.samples != 1:
            raise ValueError(f"distill.samples = {self.samples!r} is invalid: MOPD samples once per prompt")
        check_counts(self, "distill", ("steps", "prompts", "max_tokens", "train_tasks", "eval_tasks",
                                             "eval_every", "ckpt_every"))
        check_work(self, "distill")
        if not self.ckpt or not self.teachers or not self.out:
            raise ValueError("distill.ckpt, distill.teachers and distill.out are required: paths")
        for name, values, allowed in (("domains", self.domains, DOMAINS), ("efforts", self.efforts, EFFORTS)):
            if not values or not set(values) <= set(allowed) or len(set(values)) != len(values):
                raise ValueError(f"distill.{name} = {values!r} is invalid: distinct names from {allowed}")
        if not 0 < self.lam <= 1:
            raise ValueError(f"distill.lam = {self.lam!r} is invalid: a fraction in (0, 1]")
        if not min(self.temperature, self.lr, self.reward_clip, self.clip_eps) > 0:
            raise ValueError("distill: temperature, lr, reward_clip and clip_eps must be positive")
        return self

    @property
    def pairs(self) -> list[tuple[str, str]]:
        return list(itertools.product(self.domains, self.efforts))


def load_teachers(directory: Path, pairs: list[tuple[str, str]]) -> dict[tuple[str, str], K3ForCausalLM]:
    """The teacher of each (domain, effort): ``directory/<domain>-<effort>`` (a run directory or a checkpoint)."""
    missing = [f"{d}-{e}" for d, e in pairs if not (directory / f"{d}-{e}").exists()]
    if missing:
        raise FileNotFoundError(f"{directory}: no teacher for {', '.join(missing)} (expected one directory per "
                                f"domain-effort, e.g. math-low, from `k3 rl --domains math --effort low`)")
    teachers = {}
    for d, e in pairs:
        model, _ = model_ckpt.load_model(directory / f"{d}-{e}")
        teachers[(d, e)] = model.eval().requires_grad_(False)
    return teachers


class DistillRun(OnPolicyRun):
    """One MOPD run; `iteration()` samples on-policy and takes one optimiser step on the teachers' token rewards."""

    stage_name = "MOPD"

    def __init__(self, config: DistillConfig) -> None:
        super().__init__(config)
        cfg = self.config
        self.teachers = load_teachers(Path(cfg.teachers), cfg.pairs)
        for (d, e), teacher in self.teachers.items():
            if teacher.config.vocab_size != self.model.config.vocab_size:
                raise ValueError(f"teacher {d}-{e}: vocab_size {teacher.config.vocab_size} differs from the "
                                 f"student's {self.model.config.vocab_size}")
        train = {d: generate(d, cfg.train_tasks, cfg.seed, "train") for d in cfg.domains}
        self.stream = [(train[d][i], e) for i in range(cfg.train_tasks) for d, e in cfg.pairs]
        self.eval_tasks = {d: generate(d, cfg.eval_tasks, cfg.seed, "test") for d in cfg.domains}

    def next_prompts(self, n: int) -> list[tuple[Task, str]]:
        return [self.stream[(self.cursor + i) % len(self.stream)] for i in range(n)]

    def _by_teacher(self, keys: list[tuple[str, str]], inputs: torch.Tensor, targets: torch.Tensor,
                    model: K3ForCausalLM | None = None) -> torch.Tensor:
        """Each row's log-probabilities ``[B, L]``, the rows of each (domain, effort) read as one batch: under
        that pair's teacher, or under ``model`` (the student). Teacher and student see the same batches, so a
        student equal to its teacher gets a reward of exactly 0 (the forward is not batch-invariant)."""
        out = torch.zeros(targets.shape, device=targets.device)
        for key in dict.fromkeys(keys):
            rows = torch.tensor([b for b, k in enumerate(keys) if k == key], device=targets.device)
            scorer = self.teachers[key] if model is None else model
            with torch.set_grad_enabled(model is not None):
                out = out.index_put((rows,), token_logprobs(scorer, inputs[rows], targets[rows],
                                                            self.tokenizer.vocab_size))
        return out

    def update(self, groups: list[list[Trajectory]]) -> dict[str, Any]:
        trajectories = [traj for (traj,) in groups]
        inputs, targets, mask, old = training_batch(trajectories, self.tokenizer.pad_id)
        pairs = [self.episodes.tasks[t.group] for t in trajectories]
        keys = [(task.domain, effort) for task, effort in pairs]
        teacher = self._by_teacher(keys, inputs, targets)
        self.model.train()
        student = self._by_teacher(keys, inputs, targets, self.model)
        rewards = mopd_token_rewards(teacher, student, self.config.reward_clip).masked_fill(~mask, 0.0)
        loss = policy_loss(student, old, rewards, mask, self.config.clip_eps)
        record = {"loss": float(loss.detach()), "grad_norm": self.step_optimizer(loss),
                  "token_reward": float(rewards[mask].mean()),
                  "teacher_gap": float((student.detach() - teacher)[mask].mean())}
        outcomes = [o for group in groups for o in self.episodes.judge_group(group)[2]]
        return {**record, "accuracy": statistics.fmean(o.correct for o in outcomes),
                "mean_tokens": statistics.fmean(o.tokens for o in outcomes)}

    def evaluation(self) -> dict[str, Any]:
        """Held-out accuracy, mean tokens and teacher gap per domain × effort, and their means."""
        out: dict[str, float] = {}
        for domain, effort in self.config.pairs:
            judged = greedy(self.engine, self.eval_tasks[domain], effort, self.config.max_tokens)
            inputs, targets, mask, _ = training_batch([t for t, _ in judged], self.tokenizer.pad_id)
            with torch.no_grad():
                student = token_logprobs(self.model, inputs, targets, self.tokenizer.vocab_size)
                teacher = token_logprobs(self.teachers[(domain, effort)], inputs, targets, self.tokenizer.vocab_size)
            name = f"eval_{domain}_{effort}"
            out[f"{name}_accuracy"] = statistics.fmean(o.correct for _, o in judged)
            out[f"{name}_mean_tokens"] = statistics.fmean(o.tokens for _, o in judged)
            out[f"{name}_teacher_gap"] = float((student - teacher)[mask].mean()) if mask.any() else 0.0
        for key in ("accuracy", "mean_tokens", "teacher_gap"):
            out[f"eval_{key}"] = statistics.fmean(out[f"eval_{d}_{e}_{key}"] for d, e in self.config.pairs)
        return out


PANELS = (("held-out teacher gap (log π_s − log π_t)", ("eval_teacher_gap", "teacher_gap")),
          ("held-out accuracy", ("eval_accuracy", "accuracy")),
          ("response tokens", ("eval_mean_tokens", "mean_tokens")))


def run_distill(config: DistillConfig, resume: bool = False) -> DistillRun:
    """Run (or continue) MOPD (`k3.rl.onpolicy.run_stage`)."""
    return run_stage(DistillRun(config), resume, PANELS)
