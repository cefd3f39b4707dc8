"""What RL (`k3.rl.grpo`) and MOPD (`k3.rl.distill`) share (SPEC §7): a policy that samples its own training data
on the serving engine with partial rollouts, one optimiser step per iteration, held-out evaluation, and exact
resumption — weights, optimiser, RNG, the trajectories in flight and their paused environments (SPEC §8: each a
sandbox checkpoint on disk, no process held). The loop is `k3.train.driver.drive`'s: an iteration is its step.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from k3.model import checkpoint as model_ckpt
from k3.model.packed import PackedExperts
from k3.rl.domains import MAX_TASKS, Task
from k3.rl.episode import Episodes, prompt_ids, sampling
from k3.rl.policy import pad_sequences
from k3.rl.rollout import ENVIRONMENT, IterationStats, PartialRollouts, Trajectory, run_iteration
from k3.serve.engine import Engine
from k3.train import checkpoint as train_ckpt
from k3.train.driver import Loop, Stage, drive
from k3.train.optim import apply_step
from k3.train.rundir import Metrics, Panel, open_run

#: The most trajectories an iteration keeps in flight (``--prompts`` × ``--samples``): each holds a decoding state
#: while it samples and a row of the update's whole batch.
MAX_TRAJECTORIES = 1024


def check_work(config: Any, prefix: str) -> None:
    """ValueError naming the field unless an iteration's work is bounded before the run starts: ``prompts`` ×
    ``samples`` at most `MAX_TRAJECTORIES`, ``train_tasks`` and ``eval_tasks`` at most `MAX_TASKS`
    (``--samples 10**9`` was a MemoryError, ``--eval-tasks 10**9`` drew tasks for ever)."""
    if config.prompts * config.samples > MAX_TRAJECTORIES:
        raise ValueError(f"{prefix}.prompts × {prefix}.samples = {config.prompts} × {config.samples} is invalid: at "
                         f"most {MAX_TRAJECTORIES:,} trajectories in flight")
    for name in ("train_tasks", "eval_tasks"):
        if getattr(config, name) > MAX_TASKS:
            raise ValueError(f"{prefix}.{name} = {getattr(config, name)!r} is invalid: at most {MAX_TASKS:,}")


#: Settings a resumed run may change (paths, length, cadence, threads).
RESUMABLE_CHANGES = ("ckpt", "teachers", "out", "steps", "eval_every", "ckpt_every", "threads", "progress")


def training_batch(trajectories: list[Trajectory], pad_id: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(inputs, targets, mask, old_logprobs)`` ``[B, L]`` of trajectories: the targets are prompt and tokens
    shifted by one, ``mask`` True on the sampled tokens (not the prompt, environment replies or padding), and
    ``old_logprobs`` their log-probabilities recorded at sampling."""
    sequences = [(t.prompt + t.tokens, [False] * len(t.prompt) + [v != ENVIRONMENT for v in t.versions])
                 for t in trajectories]
    inputs, targets, mask = pad_sequences(sequences, pad_id)
    old = torch.zeros(mask.shape)
    for b, t in enumerate(trajectories):
        start = len(t.prompt) - 1
        old[b, start: start + len(t.tokens)] = torch.tensor(t.logprobs)
    return inputs, targets, mask, old


class OnPolicyRun(Stage):
    """The run skeleton: ``config`` has ckpt, out, prompts, samples (K), lam, max_tokens, temperature, lr,
    clip_grad, seed. Subclasses choose the next prompts (`next_prompts`), the update (`update`) and the held-out
    metrics (`evaluation`)."""

    stage_name = "on-policy"

    def __init__(self, config: Any) -> None:
        self.config = config.validate()
        self.out = Path(config.out)
        self.metrics = Metrics(self.out / "metrics.jsonl")
        self.model, self.tokenizer = model_ckpt.load_model(Path(config.ckpt))
        if any(isinstance(m, PackedExperts) for m in self.model.modules()):
            raise ValueError(f"{config.ckpt}: the routed experts are stored MXFP4-packed; {self.stage_name} trains "
                             f"float weights")
        self.step_index = 0  # iterations run
        self.version = 0  # optimiser steps taken: the policy version every sampled token records
        self.cursor = 0  # position in the stream of training prompts

    @property
    def iteration_index(self) -> int:
        """Iterations run (the loop's ``step_index``: an iteration is its step)."""
        return self.step_index

    @property
    def loop(self) -> Loop:
        """Every iteration logged; progress as each record's JSON line."""
        cfg = self.config
        return Loop(cfg.steps, cfg.ckpt_every, eval_every=cfg.eval_every, threads=cfg.threads, progress=cfg.progress,
                    lines=True)

    def prepare(self, resume: bool) -> None:
        cfg = self.config
        existing = open_run(self.out, resume)
        self.tok_dir = self.out / "tokenizer"
        self.tokenizer.save(self.tok_dir)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=0.0)
        self.engine = Engine(self.model, self.tokenizer, max_batch=cfg.prompts * cfg.samples, prefill_chunk=256)
        self.rollouts = PartialRollouts(cfg.prompts, cfg.samples)
        self.episodes = Episodes(self.tokenizer)
        torch.manual_seed(cfg.seed)
        if existing is not None:
            self._restore(existing)
        self.metrics.start(None if existing is None else self.step_index)

    # ------------------------------------------------------------------ one iteration
    def next_prompts(self, n: int) -> list[tuple[Task, str]]:
        """The next ``n`` (task, effort) pairs of the training stream."""
        raise NotImplementedError

    def update(self, groups: list[list[Trajectory]]) -> dict[str, Any]:
        """One optimiser step on complete groups; returns its metrics."""
        raise NotImplementedError

    def evaluation(self) -> dict[str, Any]:
        """Held-out metrics."""
        raise NotImplementedError

    def opening(self) -> dict[str, Any]:
        """The starting policy's held-out metrics."""
        return {"step": 0, **self.evaluation()}

    def rollout(self) -> tuple[IterationStats, list[list[Trajectory]]]:
        """Fill the rollouts up to N groups, run one partial-rollout iteration; the groups that completed."""
        cfg = self.config
        chosen = self.next_prompts(cfg.prompts - self.rollouts.groups_in_flight)
        self.cursor += len(chosen)
        groups = self.rollouts.fill([prompt_ids(task, effort, self.tokenizer) for task, effort in chosen])
        for group, (task, effort) in zip(groups, chosen):
            self.episodes.add(group, task, effort)
        self.model.eval()
        params = sampling(self.tokenizer, cfg.temperature, seed=cfg.seed * 1_000_003 + self.step_index)
        stats = run_iteration(self.engine, self.rollouts, params, self.version, cfg.lam, cfg.max_tokens,
                              self.episodes.observe)
        return stats, self.rollouts.complete_groups()

    def step(self) -> dict[str, Any]:
        """One iteration: roll out, then one optimiser step on the groups that completed (none: no step, the version
        stays)."""
        stats, groups = self.rollout()
        self.step_index += 1
        record: dict[str, Any] = {"step": self.step_index, "version": self.version,
                                  "rollout_tokens": stats.tokens, "rollout_s": stats.seconds,
                                  "rollout_tokens_per_s": stats.tokens / max(stats.seconds, 1e-9),
                                  "finished": stats.finished, "paused": stats.paused, "idle": stats.idle,
                                  "groups": len(groups)}
        if groups:
            record.update(self.update(groups))
            trained = [v for group in groups for t in group for v in t.versions if v != ENVIRONMENT]
            record["stale_token_fraction"] = sum(v < self.version for v in trained) / max(len(trained), 1)
            self.version += 1
        return record

    def step_optimizer(self, loss: Tensor) -> float:
        """Backward ``loss``, clip, step; returns the gradient norm before clipping."""
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.clip_grad))
        apply_step([self.optimizer])
        self.model.eval()
        return grad_norm

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        sandboxes = self.out / "sandboxes" / f"step-{self.step_index:07d}"
        envs = {}
        for traj_id in self.episodes.envs:
            sandboxes.mkdir(parents=True, exist_ok=True)
            path = sandboxes / traj_id.replace("/", "-")
            envs[traj_id] = {"sandbox": str(path.relative_to(self.out)), **self.episodes.save_env(traj_id, path)}
        progress = {"iteration": self.step_index, "version": self.version, "cursor": self.cursor,
                    "rollouts": self.rollouts.state_dict(),
                    "groups": {g: [task.to_dict(), effort] for g, (task, effort) in self.episodes.tasks.items()},
                    "envs": envs}
        state = {"optimizers": [self.optimizer.state_dict()], "rng": torch.get_rng_state(),
                 "step": self.step_index, "progress": json.dumps(progress)}
        path = train_ckpt.save_checkpoint(self.out, self.step_index, self.model, self.model.config,
                                          asdict(self.config), self.tok_dir, state)
        kept = {p.name for p in model_ckpt.checkpoints(self.out)}
        for directory in (self.out / "sandboxes").iterdir() if (self.out / "sandboxes").exists() else ():
            if directory.name not in kept:  # the environments of pruned checkpoints
                shutil.rmtree(directory, ignore_errors=True)
        return path

    def _restore(self, path: Path) -> None:
        train_ckpt.check_same_config(path, model_ckpt.read_config(path), self.model.config)
        train_ckpt.check_resumable(path, asdict(self.config), RESUMABLE_CHANGES)
        state = train_ckpt.load_state(path)
        train_ckpt.load_single(path, self.model, [self.optimizer], state)
        try:
            progress = json.loads(state["progress"])
            torch.set_rng_state(state["rng"])
            self.step_index, self.version = progress["iteration"], progress["version"]
            self.cursor = progress["cursor"]
            self.rollouts.load_state_dict(progress["rollouts"])
            for group, (task, effort) in progress["groups"].items():
                self.episodes.add(int(group), Task.from_dict(task), effort)
            for traj_id, env in progress["envs"].items():
                self.episodes.resume_env(traj_id, self.out / env["sandbox"], env["calls"], env["messages"])
        except (KeyError, ValueError, TypeError) as err:
            raise ValueError(f"{train_ckpt.state_file(path)}: does not match this run ({type(err).__name__}: "
                             f"{err})") from err

    def close(self) -> None:
        self.episodes.close()


def run_stage(run: OnPolicyRun, resume: bool, panels: Sequence[Panel]) -> OnPolicyRun:
    """Run (or continue) a stage (`k3.train.driver.drive`): held-out metrics first (a fresh run), then iterations
    with evaluations every ``eval_every`` and checkpoints every ``ckpt_every`` and at the end; then ``curves.png``
    of ``panels``."""
    run.prepare(resume)
    try:
        drive(run, panels)
    finally:
        run.close()
    return run
