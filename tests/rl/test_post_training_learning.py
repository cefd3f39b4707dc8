"""Each on-policy stage improves its own held-out metric on a tiny model in a short run (issue 19).

The policy is SFT'd to reason at effort ``max`` length when the system prompt says ``low``, so its sampled answers
overrun the low-effort budget ``τ_low · b0`` and earn −1 (SPEC §7's budget reward). RL at effort low must raise the
held-out expected reward (K samples per test task); MOPD from that RL policy as the (math, low) teacher must shrink
the held-out teacher gap ``mean(log π_student − log π_teacher)`` over the student's answers.
"""

from __future__ import annotations

import json

import pytest
import torch

from k3.config import preset
from k3.model.checkpoint import save_model
from k3.model.lm import K3ForCausalLM
from k3.rl.chats import chat_records, plain_texts, write_chats
from k3.rl.distill import DistillConfig, run_distill
from k3.rl.domains import assistant_message, generate, system_prompt
from k3.rl.grpo import RLConfig, run_rl
from k3.rl.sft import SFTConfig, run_sft
from k3.tokenization.bpe import Tokenizer


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def verbose_policy(tmp_path_factory):
    """A tiny model SFT'd on math chats whose ``low``-effort answers carry the ``max``-effort reasoning."""
    root = tmp_path_factory.mktemp("learning")
    tokenizer = Tokenizer.train(plain_texts(chat_records(["math"], n_per=50)), 512)
    records = [{"messages": [{"role": "system", "content": system_prompt("low")},
                             {"role": "user", "content": task.prompt}, assistant_message(task, "max", "thinking")],
                "mode": "thinking", "domain": "math", "effort": "low", "task": task.to_dict()}
               for task in generate("math", 200, 0, "train")]
    write_chats(root / "chats.jsonl", records)
    torch.manual_seed(0)
    save_model(root / "base", K3ForCausalLM(preset("tiny")), tokenizer)
    run_sft(SFTConfig(ckpt=str(root / "base"), data=str(root / "chats.jsonl"), out=str(root / "sft"), steps=60,
                      batch_size=8, lr=3e-3, optimizer="adamw", seq_len=256, eval_every=60, ckpt_every=60,
                      progress=False, threads=1))
    return root


@pytest.fixture(scope="module")
def rl_run(verbose_policy):
    root = verbose_policy
    run_rl(RLConfig(ckpt=str(root / "sft"), out=str(root / "rl"), domains=["math"], effort="low", steps=10,
                    prompts=8, samples=4, lam=1.0, max_tokens=64, lr=1e-3, eval_tasks=16, eval_every=10,
                    ckpt_every=10, progress=False, threads=1))
    return root / "rl"


def test_rl_raises_the_held_out_budget_reward(rl_run):
    rows = _rows(rl_run / "metrics.jsonl")
    first, last = rows[0], rows[-1]
    assert first["step"] == 0 and last["step"] == 10
    assert first["eval_within_budget"] < 0.8  # the SFT policy overruns the low-effort budget
    assert last["eval_reward"] > first["eval_reward"] + 0.2
    assert last["eval_within_budget"] > first["eval_within_budget"]
    assert last["eval_mean_tokens"] < first["eval_mean_tokens"]
    assert (rl_run / "curves.png").stat().st_size > 0


def test_mopd_shrinks_the_held_out_teacher_gap(verbose_policy, rl_run):
    root = verbose_policy
    (root / "teachers").mkdir()
    (root / "teachers" / "math-low").symlink_to(rl_run, target_is_directory=True)
    run_distill(DistillConfig(ckpt=str(root / "sft"), teachers=str(root / "teachers"), out=str(root / "mopd"),
                              domains=["math"], efforts=["low"], steps=10, prompts=16, max_tokens=64, lr=1e-3,
                              eval_tasks=16, eval_every=10, ckpt_every=10, progress=False, threads=1))
    rows = _rows(root / "mopd" / "metrics.jsonl")
    first, last = rows[0], rows[-1]
    assert first["eval_teacher_gap"] > 0.3  # the student is far from its teacher on its own answers
    assert abs(last["eval_teacher_gap"]) < first["eval_teacher_gap"] / 3
