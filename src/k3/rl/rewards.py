"""Rewards and the policy-gradient objective of post-training (SPEC §7): the budget reward with its annealed
multiplier τ, the verbosity rule, group-normalised advantages (GRPO-style, over the K samples of one prompt),
MOPD's token reward and the clipped-ratio policy loss. Pure functions; each validates its input.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["EFFORT_TAU", "budget_reward", "tau_schedule", "apply_verbosity", "group_advantages",
           "mopd_token_rewards", "policy_loss"]

#: Budget multiplier τ per effort: a response may spend up to ``τ · b0(x)`` tokens.
EFFORT_TAU: dict[str, float] = {"max": 4.0, "high": 2.0, "low": 1.0}


def budget_reward(correctness: float, tokens: int, b0: float, tau: float) -> float:
    """SPEC §7 budget: ``r = −1`` when ``T(y) > τ · b0(x)``, else the task reward ``correctness`` ∈ [0, 1].
    ``T(y) == τ · b0(x)`` is within budget."""
    if not 0.0 <= correctness <= 1.0:
        raise ValueError(f"correctness: expected a number in [0, 1], got {correctness!r}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"tokens: expected a non-negative integer, got {tokens!r}")
    if not (math.isfinite(b0) and b0 > 0) or not (math.isfinite(tau) and tau > 0):
        raise ValueError(f"b0 and tau: expected positive finite numbers, got b0={b0!r}, tau={tau!r}")
    return -1.0 if tokens > tau * b0 else float(correctness)


def tau_schedule(step: int, total_steps: int, efforts: Sequence[str] = ("max", "high", "low")) -> tuple[str, float]:
    """The effort and its τ (`EFFORT_TAU`) at ``step`` of ``total_steps``: τ is annealed through ``efforts`` in
    equal parts of training (SPEC §7, max → high → low in thirds): step ``s`` is in part ``⌊s · E / total⌋``."""
    if total_steps < 1 or not 0 <= step < total_steps:
        raise ValueError(f"step: expected 0 <= step < total_steps, got step={step}, total_steps={total_steps}")
    if not efforts or any(e not in EFFORT_TAU for e in efforts):
        raise ValueError(f"efforts: expected a non-empty sequence of {sorted(EFFORT_TAU)}, got {efforts!r}")
    effort = efforts[step * len(efforts) // total_steps]
    return effort, EFFORT_TAU[effort]


def apply_verbosity(rewards: Sequence[float], lengths: Sequence[int], l0: float, sigma: float) -> list[float]:
    """SPEC §7 verbosity: a candidate longer than ``σ · ℓ0`` (strictly) loses its comparison with every
    non-verbose candidate of its group.

    The verbose rewards are shifted down by one common amount, so the most rewarded verbose candidate ends exactly 1
    below the least rewarded non-verbose one: ``r_v − (max r_verbose − min r_plain + 1)``. Non-verbose rewards are
    unchanged, and so is the order among verbose candidates (they still compete with each other); a group with no
    verbose, or only verbose, candidates is returned unchanged.
    """
    if len(rewards) != len(lengths):
        raise ValueError(f"rewards and lengths: expected one length per reward, got {len(rewards)} and "
                         f"{len(lengths)}")
    if not all(math.isfinite(r) for r in rewards):
        raise ValueError(f"rewards: expected finite numbers, got {list(rewards)!r}")
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in lengths):
        raise ValueError(f"lengths: expected non-negative integers, got {list(lengths)!r}")
    if not (math.isfinite(l0) and l0 > 0) or not (math.isfinite(sigma) and sigma > 0):
        raise ValueError(f"l0 and sigma: expected positive finite numbers, got l0={l0!r}, sigma={sigma!r}")
    verbose = [n > sigma * l0 for n in lengths]
    plain = [r for r, v in zip(rewards, verbose) if not v]
    if not plain or len(plain) == len(rewards):
        return [float(r) for r in rewards]
    shift = max(r for r, v in zip(rewards, verbose) if v) - min(plain) + 1.0
    return [float(r) - shift if v else float(r) for r, v in zip(rewards, verbose)]


def group_advantages(rewards: Tensor | Sequence[float], eps: float = 1e-6) -> Tensor:
    """GRPO advantages of one prompt's K samples: ``A_i = (r_i − mean r) / (std r + eps)`` with the population
    standard deviation ``std r = sqrt(mean((r − mean r)²))``. A group whose rewards are all equal (including K = 1)
    carries no signal: all zeros."""
    r = torch.as_tensor(rewards)
    r = r.float() if not r.is_floating_point() else r
    if r.dim() != 1 or r.numel() == 0:
        raise ValueError(f"rewards: expected a non-empty 1-D group, got shape {tuple(r.shape)}")
    if not bool(torch.isfinite(r).all()):
        raise ValueError(f"rewards: expected finite values, got {r.tolist()}")
    if not eps > 0:
        raise ValueError(f"eps: expected a positive number, got {eps!r}")
    if bool((r == r[0]).all()):
        return torch.zeros_like(r)
    centred = r - r.mean()
    return centred / (centred.square().mean().sqrt() + eps)


def mopd_token_rewards(teacher_logprobs: Tensor, student_logprobs: Tensor, clip: float) -> Tensor:
    """MOPD token reward (SPEC §7): ``r_t = clip(sg(log π_teacher(y_t) − log π_student(y_t)), −R, R)`` with
    ``R = clip``; the result is detached (stop-gradient) whatever its inputs."""
    if teacher_logprobs.shape != student_logprobs.shape:
        raise ValueError(f"teacher_logprobs and student_logprobs: shapes differ, {tuple(teacher_logprobs.shape)} "
                         f"and {tuple(student_logprobs.shape)}")
    if not (math.isfinite(clip) and clip > 0):
        raise ValueError(f"clip: expected a positive finite number, got {clip!r}")
    return (teacher_logprobs.detach() - student_logprobs.detach()).clamp(-clip, clip)


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                clip_eps: float = 0.2) -> Tensor:
    """Token-level clipped-ratio objective (PPO / GRPO), to minimise:

    ``L = −(1/n) Σ_{masked t} min(ρ_t A_t, clip(ρ_t, 1 − ε, 1 + ε) A_t)``, ``ρ_t = exp(log π(y_t) − log π_old(y_t))``,

    ``n`` the number of masked tokens. ``logprobs``, ``old_logprobs`` and ``mask`` are ``[B, T]``; ``advantages``
    is ``[B]`` (one per sequence, as GRPO) or ``[B, T]`` (per token, as MOPD). ``old_logprobs`` and ``advantages``
    are constants. On-policy (``π == π_old``) the gradient is ``−(1/n) Σ A_t ∇ log π(y_t)``."""
    if logprobs.dim() != 2 or old_logprobs.shape != logprobs.shape or mask.shape != logprobs.shape:
        raise ValueError(f"logprobs, old_logprobs and mask: expected the same [B, T] shape, got "
                         f"{tuple(logprobs.shape)}, {tuple(old_logprobs.shape)} and {tuple(mask.shape)}")
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
        raise ValueError(f"advantages: expected shape {tuple(logprobs.shape[:1])} or {tuple(logprobs.shape)}, got "
                         f"{tuple(advantages.shape)}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask: expected a bool tensor, got {mask.dtype}")
    if not 0 < clip_eps < 1:
        raise ValueError(f"clip_eps: expected a number in (0, 1), got {clip_eps!r}")
    n = int(mask.sum())
    if n == 0:
        raise ValueError("mask: selects no token")
    a = advantages.detach()
    a = a.unsqueeze(1).expand_as(logprobs) if a.dim() == 1 else a
    ratio = torch.where(mask, logprobs - old_logprobs.detach(), 0.0).exp()  # masked-out positions never NaN
    objective = torch.minimum(ratio * a, ratio.clamp(1 - clip_eps, 1 + clip_eps) * a)
    return -torch.where(mask, objective, 0.0).sum() / n
