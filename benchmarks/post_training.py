"""Post-training at toy scale (SPEC §7, issue 19): SFT → nine RL teachers (3 domains × 3 efforts) → MOPD, on the
locally generated, locally verified math / code / agentic tasks, with a ``tiny`` model on this CPU.

1. Data and base: ``k3 chats``-style records (``--n-per`` train tasks per domain, each as one thinking chat per
   effort and one instruct chat), a 512-token BPE trained on them, and a randomly initialised ``tiny`` model. (No
   pre-training corpus holds these tasks, so SFT is what teaches the format and the answers.)
2. SFT (`k3.rl.sft`, ``--sft-steps``), its held-out loss before and after.
3. Nine RL runs (`k3.rl.grpo`, one per domain × effort, from the SFT model, ``--rl-steps`` iterations of N=8
   prompts × K=4 samples, λ = 0.75): the teachers.
4. MOPD (`k3.rl.distill`, ``--distill-steps`` iterations) of the SFT model from the nine teachers.
5. Held-out, greedy, on the test split (``--eval-tasks`` per domain): accuracy per domain and effort, mean
   response tokens per effort (the budgets ``τ·b0`` must separate them), after SFT, for the teacher of the
   (domain, effort), and after MOPD; and each RL run's own held-out metric, its expected budget reward (K = 4
   samples per test task at temperature 1), at its start and end.
6. Rollout throughput of the SFT policy at effort max (``--rollout-max-tokens`` tokens a trajectory), N=8 × K=4 on
   the serving engine, with partial rollouts (λ = 0.5) and without (λ = 1), over the same number of iterations:
   sampled tokens/s and the fraction of batch slots left idle (the paper's motivation: long-tail trajectories idle
   the fleet).

    python benchmarks/post_training.py            # ~11 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import machine, table, write_results  # noqa: E402

from k3.config import preset  # noqa: E402
from k3.model.checkpoint import load_model, save_model  # noqa: E402
from k3.model.lm import K3ForCausalLM  # noqa: E402
from k3.rl.chats import chat_records, plain_texts, write_chats  # noqa: E402
from k3.rl.distill import DistillConfig, run_distill  # noqa: E402
from k3.rl.domains import DOMAINS, EFFORTS, generate  # noqa: E402
from k3.rl.episode import Episodes, evaluate, prompt_ids, sampling  # noqa: E402
from k3.rl.grpo import RLConfig, run_rl  # noqa: E402
from k3.rl.rewards import EFFORT_TAU  # noqa: E402
from k3.rl.rollout import PartialRollouts, run_iteration  # noqa: E402
from k3.rl.sft import SFTConfig, run_sft  # noqa: E402
from k3.serve.engine import Engine  # noqa: E402
from k3.tokenization.bpe import Tokenizer  # noqa: E402


def held_out(ckpt: Path, eval_tasks: int, max_tokens: int,
             pairs: list[tuple[str, str]]) -> dict[tuple[str, str], dict[str, float]]:
    """Greedy held-out metrics of a checkpoint per (domain, effort) of ``pairs``."""
    model, tokenizer = load_model(ckpt)
    engine = Engine(model, tokenizer, max_batch=32, prefill_chunk=256)
    return {(d, e): evaluate(engine, generate(d, eval_tasks, 0, "test"), e, max_tokens, EFFORT_TAU[e])
            for d, e in pairs}


def rl_reward(run_dir: Path, domain: str) -> tuple[float, float]:
    """The RL run's own held-out metric, its expected budget reward (K samples per test task), first and last."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evaluated = [r[f"eval_{domain}_reward"] for r in rows if f"eval_{domain}_reward" in r]
    return evaluated[0], evaluated[-1]


def rollout_throughput(ckpt: Path, lam: float, iterations: int, max_tokens: int, seed: int = 0) -> dict[str, float]:
    """Sampled tokens/s and idle batch slots of ``iterations`` rollout iterations (no update) at effort max."""
    model, tokenizer = load_model(ckpt)
    engine = Engine(model, tokenizer, max_batch=32, prefill_chunk=256)
    rollouts, episodes = PartialRollouts(8, 4), Episodes(tokenizer)
    stream = [t for row in zip(*(generate(d, 64, seed, "train") for d in DOMAINS)) for t in row]
    tokens = seconds = 0.0
    idle, completed = [], 0
    for it in range(iterations):
        taken = stream[:8 - rollouts.groups_in_flight]
        stream = stream[len(taken):]
        for group, task in zip(rollouts.fill([prompt_ids(t, "max", tokenizer) for t in taken]), taken):
            episodes.add(group, task, "max")
        stats = run_iteration(engine, rollouts, sampling(tokenizer, 1.0, seed=seed + it), 0, lam, max_tokens,
                              episodes.observe)
        tokens, seconds = tokens + stats.tokens, seconds + stats.seconds
        idle.append(stats.idle)
        for group in rollouts.complete_groups():
            episodes.judge_group(group)
            completed += 1
    episodes.close()
    return {"lam": lam, "iterations": iterations, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "idle": statistics.fmean(idle), "groups_completed": completed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n-per", type=int, default=300)
    parser.add_argument("--sft-steps", type=int, default=500)
    parser.add_argument("--rl-steps", type=int, default=30)
    parser.add_argument("--distill-steps", type=int, default=20)
    parser.add_argument("--eval-tasks", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-4, help="RL and MOPD learning rate (AdamW)")
    parser.add_argument("--rollout-iterations", type=int, default=4)
    parser.add_argument("--rollout-max-tokens", type=int, default=192)
    parser.add_argument("--keep", help="keep the runs in this directory (default: a temporary one)")
    args = parser.parse_args()
    root = Path(args.keep or tempfile.mkdtemp(prefix="k3-post-training-"))
    root.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}

    records = chat_records(n_per=args.n_per, seed=0)
    tokenizer = Tokenizer.train(plain_texts(records), 512)
    write_chats(root / "chats.jsonl", records)
    torch.manual_seed(0)
    save_model(root / "base", K3ForCausalLM(preset("tiny")), tokenizer)

    start = time.perf_counter()
    sft = run_sft(SFTConfig(ckpt=str(root / "base"), data=str(root / "chats.jsonl"), out=str(root / "sft"),
                            steps=args.sft_steps, batch_size=16, lr=3e-3, optimizer="adamw", seq_len=512,
                            eval_every=max(1, args.sft_steps // 4), ckpt_every=args.sft_steps, progress=False))
    timings["sft_s"] = time.perf_counter() - start
    sft_rows = [json.loads(line) for line in sft.metrics_path.read_text().splitlines()]
    sft_loss = (sft_rows[0]["val_loss"], sft_rows[-1]["val_loss"])
    pairs = [(d, e) for d in DOMAINS for e in EFFORTS]
    after_sft = held_out(root / "sft", args.eval_tasks, args.max_tokens, pairs)
    print(f"SFT {timings['sft_s']:.0f} s: held-out loss {sft_loss[0]:.3f} -> {sft_loss[1]:.3f}", flush=True)

    start = time.perf_counter()
    teachers = root / "teachers"
    teacher_eval: dict[tuple[str, str], dict[str, float]] = {}
    for d in DOMAINS:
        for e in EFFORTS:
            run_rl(RLConfig(ckpt=str(root / "sft"), out=str(teachers / f"{d}-{e}"), domains=[d], effort=e,
                            steps=args.rl_steps, prompts=8, samples=4, lam=0.75, max_tokens=args.max_tokens,
                            lr=args.lr, eval_tasks=args.eval_tasks, eval_every=args.rl_steps, ckpt_every=args.rl_steps,
                            progress=False))
            before, after = rl_reward(teachers / f"{d}-{e}", d)
            greedy = held_out(teachers / f"{d}-{e}", args.eval_tasks, args.max_tokens, [(d, e)])[(d, e)]
            teacher_eval[(d, e)] = {**greedy, "rl_reward_before": before, "rl_reward_after": after}
            print(f"teacher {d}-{e}: {json.dumps(teacher_eval[(d, e)])}", flush=True)
    timings["rl_s"] = time.perf_counter() - start

    start = time.perf_counter()
    run_distill(DistillConfig(ckpt=str(root / "sft"), teachers=str(teachers), out=str(root / "mopd"),
                              steps=args.distill_steps, prompts=18, max_tokens=args.max_tokens, lr=args.lr,
                              eval_tasks=args.eval_tasks, eval_every=args.distill_steps,
                              ckpt_every=args.distill_steps, progress=False))
    timings["distill_s"] = time.perf_counter() - start
    mopd_rows = [json.loads(line) for line in (root / "mopd" / "metrics.jsonl").read_text().splitlines()]
    after_mopd = held_out(root / "mopd", args.eval_tasks, args.max_tokens, pairs)
    gap = (mopd_rows[0]["eval_teacher_gap"], mopd_rows[-1]["eval_teacher_gap"])

    rollouts = [rollout_throughput(root / "sft", lam, args.rollout_iterations, args.rollout_max_tokens)
                for lam in (1.0, 0.5)]

    rows = []
    for d in DOMAINS:
        for e in EFFORTS:
            rows.append({"domain": d, "effort": e, "budget_tau": EFFORT_TAU[e],
                         "sft_accuracy": after_sft[(d, e)]["accuracy"],
                         "teacher_accuracy": teacher_eval[(d, e)]["accuracy"],
                         "mopd_accuracy": after_mopd[(d, e)]["accuracy"],
                         "sft_tokens": after_sft[(d, e)]["mean_tokens"],
                         "teacher_tokens": teacher_eval[(d, e)]["mean_tokens"],
                         "mopd_tokens": after_mopd[(d, e)]["mean_tokens"],
                         "sft_within_budget": after_sft[(d, e)]["within_budget"],
                         "teacher_within_budget": teacher_eval[(d, e)]["within_budget"],
                         "rl_reward_before": teacher_eval[(d, e)]["rl_reward_before"],
                         "rl_reward_after": teacher_eval[(d, e)]["rl_reward_after"]})
    per_domain = [{"domain": d, **{f"{stage}_accuracy": statistics.fmean(r[f"{stage}_accuracy"] for r in rows
                                                                         if r["domain"] == d)
                                   for stage in ("sft", "teacher", "mopd")}} for d in DOMAINS]
    per_effort = [{"effort": e, **{f"{stage}_tokens": statistics.fmean(r[f"{stage}_tokens"] for r in rows
                                                                       if r["effort"] == e)
                                   for stage in ("sft", "teacher", "mopd")}} for e in EFFORTS]
    print()
    print(f"SFT held-out loss {sft_loss[0]:.3f} -> {sft_loss[1]:.3f}; MOPD held-out teacher gap {gap[0]:.4f} -> "
          f"{gap[1]:.4f}; stage times {json.dumps({k: round(v) for k, v in timings.items()})}")
    print("\nheld-out accuracy per domain (greedy; mean over the three efforts):")
    print(table(per_domain, [("domain", "domain"), ("sft_accuracy", "after SFT"),
                             ("teacher_accuracy", "after RL (its teacher)"), ("mopd_accuracy", "after MOPD")]))
    print("\nmean response tokens per effort (held-out, greedy):")
    print(table(per_effort, [("effort", "effort"), ("sft_tokens", "after SFT"), ("teacher_tokens", "RL teachers"),
                             ("mopd_tokens", "after MOPD")]))
    print("\nper domain and effort:")
    print(table(rows, [("domain", "domain"), ("effort", "effort"), ("budget_tau", "τ"),
                       ("sft_accuracy", "acc SFT"), ("teacher_accuracy", "acc teacher"),
                       ("mopd_accuracy", "acc MOPD"), ("sft_within_budget", "in budget SFT"),
                       ("teacher_within_budget", "in budget teacher"),
                       ("rl_reward_before", "RL held-out reward, start"),
                       ("rl_reward_after", "RL held-out reward, end")]))
    print("\nrollout throughput at effort max (SFT policy, N=8 × K=4):")
    print(table(rollouts, [("lam", "λ"), ("iterations", "iterations"), ("tokens", "tokens"),
                           ("tokens_per_s", "tokens/s"), ("idle", "idle slots"),
                           ("groups_completed", "groups completed")]))
    path = write_results("post_training", {"machine": machine(), "args": vars(args), "sft_val_loss": sft_loss,
                                           "mopd_teacher_gap": gap, "rows": rows, "per_domain": per_domain,
                                           "per_effort": per_effort, "rollouts": rollouts, "timings": timings})
    print(f"wrote {path} (runs in {root})")


if __name__ == "__main__":
    main()
