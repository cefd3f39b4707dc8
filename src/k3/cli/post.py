"""The post-training commands of ``k3`` (SPEC §7, issue 19): ``k3 chats`` (generated SFT data of the toy domains),
``k3 sft``, ``k3 rl`` and ``k3 distill``. Each stage is resumable (``--resume``) and writes ``metrics.jsonl`` and
``curves.png`` into its ``--out``."""

from __future__ import annotations

import argparse
from typing import Any

from k3.rl.domains import DOMAINS, EFFORTS
from k3.serve.options import SEED, THREADS, positive


def _chats(args: argparse.Namespace) -> int:
    from k3.rl.chats import chat_records, write_chats

    records = chat_records(args.domains, args.efforts, args.n_per, args.seed, args.split, args.modes)
    path = write_chats(args.out, records)
    print(f"wrote {len(records)} chats ({args.split} tasks of {', '.join(args.domains)}) to {path}")
    return 0


def _sft(args: argparse.Namespace) -> int:
    from k3.rl.sft import SFTConfig, run_sft

    config = SFTConfig(ckpt=args.ckpt, data=args.data, out=args.out, steps=args.steps, batch_size=args.batch_size,
                       lr=args.lr, optimizer=args.optimizer, seq_len=args.seq_len, eval_every=args.eval_every,
                       ckpt_every=args.ckpt_every, seed=args.seed, threads=args.threads,
                       progress=not args.no_progress)
    run = run_sft(config, resume=args.resume)
    print(f"step {run.step_index}/{config.steps}: held-out loss {run.evaluate():.4f}; checkpoint {run.out / 'latest'}, "
          f"metrics {run.metrics_path}")
    return 0


def _summary(run: Any, keys: tuple[str, ...]) -> str:
    rows = run.metrics.rows()
    first, last = rows[0], rows[-1]
    return ", ".join(f"{k} {first[k]:.3f} -> {last[k]:.3f}" for k in keys if k in first and k in last)


def _rl(args: argparse.Namespace) -> int:
    from k3.rl.grpo import RLConfig, run_rl

    config = RLConfig(ckpt=args.ckpt, out=args.out, domains=args.domains, effort=args.effort, steps=args.steps,
                      prompts=args.prompts, samples=args.samples, lam=args.lam, max_tokens=args.max_tokens,
                      temperature=args.temperature, lr=args.lr, sigma=args.sigma, eval_tasks=args.eval_tasks,
                      eval_every=args.eval_every, ckpt_every=args.ckpt_every, seed=args.seed, threads=args.threads,
                      progress=not args.no_progress)
    run = run_rl(config, resume=args.resume)
    print(f"iteration {run.iteration_index}/{config.steps} (policy version {run.version}); held-out "
          f"{_summary(run, ('eval_accuracy', 'eval_within_budget', 'eval_reward', 'eval_mean_tokens'))}; "
          f"checkpoint {run.out / 'latest'}")
    return 0


def _distill(args: argparse.Namespace) -> int:
    from k3.rl.distill import DistillConfig, run_distill

    config = DistillConfig(ckpt=args.ckpt, teachers=args.teachers, out=args.out, domains=args.domains,
                           efforts=args.efforts, steps=args.steps, prompts=args.prompts, lam=args.lam,
                           max_tokens=args.max_tokens, temperature=args.temperature, lr=args.lr,
                           reward_clip=args.reward_clip, eval_tasks=args.eval_tasks, eval_every=args.eval_every,
                           ckpt_every=args.ckpt_every, seed=args.seed, threads=args.threads,
                           progress=not args.no_progress)
    run = run_distill(config, resume=args.resume)
    print(f"iteration {run.iteration_index}/{config.steps}; held-out "
          f"{_summary(run, ('eval_teacher_gap', 'eval_accuracy', 'eval_mean_tokens'))}; "
          f"checkpoint {run.out / 'latest'}")
    return 0


def _common(p: argparse.ArgumentParser, steps: int) -> None:
    p.add_argument("--out", required=True, help="run directory: checkpoints, metrics.jsonl, curves.png")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its newest checkpoint")
    p.add_argument("--steps", type=positive(int), default=steps, help="optimiser steps / iterations "
                   "(default %(default)s)")
    p.add_argument("--eval-every", type=positive(int), default=5)
    p.add_argument("--ckpt-every", type=positive(int), default=5)
    p.add_argument("--seed", type=SEED, default=0)
    p.add_argument("--threads", type=THREADS, help="torch threads (default: torch's)")
    p.add_argument("--no-progress", action="store_true")


def _on_policy(p: argparse.ArgumentParser, prompts: int) -> None:
    p.add_argument("--prompts", type=positive(int), default=prompts, help="N: prompt groups in flight "
                   "(default %(default)s)")
    p.add_argument("--lam", type=positive(float), default=None, help="partial rollouts: pause an iteration once "
                   "this fraction of its trajectories finished; 1 waits for all")
    p.add_argument("--max-tokens", type=positive(int), default=96, help="tokens per trajectory (default %(default)s)")
    p.add_argument("--temperature", type=positive(float), default=1.0)
    p.add_argument("--lr", type=positive(float), default=5e-5)
    p.add_argument("--eval-tasks", type=positive(int), default=8, help="held-out tasks per domain")


def add_commands(commands: argparse._SubParsersAction) -> None:
    """Register ``chats``, ``sft``, ``rl`` and ``distill``."""
    ch = commands.add_parser("chats", help="generate SFT chats of the toy domains (math, code, agentic) as JSONL")
    ch.add_argument("--out", required=True, help="the .jsonl file to write")
    ch.add_argument("--domains", nargs="+", choices=DOMAINS, default=list(DOMAINS))
    ch.add_argument("--efforts", nargs="+", choices=EFFORTS, default=list(EFFORTS))
    ch.add_argument("--modes", nargs="+", choices=("thinking", "instruct"), default=["thinking", "instruct"])
    ch.add_argument("--n-per", type=positive(int), default=100, help="tasks per domain (default %(default)s)")
    ch.add_argument("--split", choices=("train", "test"), default="train")
    ch.add_argument("--seed", type=SEED, default=0)
    ch.set_defaults(run=_chats)

    sft = commands.add_parser("sft", help="supervised fine-tuning on K3 chats (loss on assistant channels only)")
    sft.add_argument("--ckpt", required=True, help="the base checkpoint or run directory")
    sft.add_argument("--data", required=True, help="chats.jsonl (k3 chats)")
    _common(sft, 200)
    sft.add_argument("--batch-size", type=positive(int), default=8)
    sft.add_argument("--lr", type=positive(float), default=1e-3)
    sft.add_argument("--optimizer", choices=("muon", "adamw"), default="muon")
    sft.add_argument("--seq-len", type=positive(int), default=1024, help="longer chats are skipped")
    sft.set_defaults(run=_sft)

    rl = commands.add_parser("rl", help="RL with group-normalised advantages, token budgets per effort, the "
                             "verbosity rule and partial rollouts (a teacher: one domain, one effort)")
    rl.add_argument("--ckpt", required=True, help="the policy to start from (an SFT run)")
    _common(rl, 30)
    _on_policy(rl, 8)
    rl.add_argument("--domains", nargs="+", choices=DOMAINS, default=list(DOMAINS))
    rl.add_argument("--effort", choices=(*EFFORTS, "anneal"), default="anneal",
                    help="the prompts' effort, or anneal max -> high -> low (default %(default)s)")
    rl.add_argument("--samples", type=positive(int), default=4, help="K: samples per prompt (default %(default)s)")
    rl.add_argument("--sigma", type=positive(float), default=2.0, help="verbosity: longer than sigma x the "
                    "reference loses its comparison (default %(default)s)")
    rl.set_defaults(run=_rl, lam=0.75)

    di = commands.add_parser("distill", help="multi-teacher on-policy distillation from the nine domain x effort "
                             "teachers")
    di.add_argument("--ckpt", required=True, help="the student to start from (an SFT run)")
    di.add_argument("--teachers", required=True, help="a directory with <domain>-<effort> teacher runs")
    _common(di, 30)
    _on_policy(di, 18)
    di.add_argument("--domains", nargs="+", choices=DOMAINS, default=list(DOMAINS))
    di.add_argument("--efforts", nargs="+", choices=EFFORTS, default=list(EFFORTS))
    di.add_argument("--reward-clip", type=positive(float), default=5.0, help="R of the token reward clip")
    di.set_defaults(run=_distill, lam=1.0)
