"""Post-training rewards (SPEC §7): budget reward and τ schedule, verbosity rule, group advantages, MOPD token
rewards, the clipped policy loss."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3.rl.rewards import (EFFORT_TAU, apply_verbosity, budget_reward, group_advantages, mopd_token_rewards,
                           policy_loss, tau_schedule)


# ---------------------------------------------------------------------------------------------------- budget
def test_budget_reward_boundary():
    assert budget_reward(1.0, 20, b0=10, tau=2.0) == 1.0  # T == τ·b0 is within budget
    assert budget_reward(0.5, 19, b0=10, tau=2.0) == 0.5
    assert budget_reward(1.0, 21, b0=10, tau=2.0) == -1.0
    assert budget_reward(0.0, 21, b0=10, tau=2.0) == -1.0
    assert budget_reward(1.0, 0, b0=0.5, tau=1.0) == 1.0


@pytest.mark.parametrize("args, name", [((1.5, 3, 10, 1), "correctness"), ((float("nan"), 3, 10, 1), "correctness"),
                                        ((1, -1, 10, 1), "tokens"), ((1, 2.0, 10, 1), "tokens"),
                                        ((1, 3, 0, 1), "b0"), ((1, 3, 10, -1), "tau")])
def test_budget_reward_rejects(args, name):
    with pytest.raises(ValueError, match=name):
        budget_reward(*args)


def test_tau_schedule_thirds():
    got = [tau_schedule(s, 9) for s in range(9)]
    assert got == [("max", 4.0)] * 3 + [("high", 2.0)] * 3 + [("low", 1.0)] * 3
    assert [tau_schedule(s, 10)[0] for s in range(10)] == ["max"] * 4 + ["high"] * 3 + ["low"] * 3
    assert tau_schedule(0, 1) == ("max", EFFORT_TAU["max"])
    assert [tau_schedule(s, 4, ("high", "low"))[0] for s in range(4)] == ["high", "high", "low", "low"]
    assert EFFORT_TAU["max"] > EFFORT_TAU["high"] > EFFORT_TAU["low"] > 0


@pytest.mark.parametrize("step, total, efforts", [(9, 9, ("max",)), (-1, 9, ("max",)), (0, 0, ("max",)),
                                                  (0, 3, ()), (0, 3, ("medium",))])
def test_tau_schedule_rejects(step, total, efforts):
    with pytest.raises(ValueError):
        tau_schedule(step, total, efforts)


# ---------------------------------------------------------------------------------------------------- verbosity
def test_verbosity_hand_made():
    # σ·ℓ0 = 10: lengths 11 and 30 are verbose, 10 is not
    got = apply_verbosity([1.0, 0.0, 1.0, 0.5], [5, 10, 11, 30], l0=5, sigma=2)
    # shift = max verbose (1.0) − min plain (0.0) + 1 = 2
    assert got == [1.0, 0.0, -1.0, -1.5]
    assert apply_verbosity([1.0, 0.0], [1, 2], l0=5, sigma=2) == [1.0, 0.0]  # none verbose
    assert apply_verbosity([1.0, 0.0, 0.5], [50, 60, 70], l0=5, sigma=2) == [1.0, 0.0, 0.5]  # all verbose
    assert apply_verbosity([0.3, 0.3], [1, 99], l0=5, sigma=2) == [0.3, 0.3 - 1.0]  # a tie is broken
    assert apply_verbosity([], [], l0=1, sigma=1) == []


@pytest.mark.parametrize("kwargs, name", [
    (dict(rewards=[1.0], lengths=[1, 2], l0=1, sigma=1), "lengths"),
    (dict(rewards=[float("inf")], lengths=[1], l0=1, sigma=1), "rewards"),
    (dict(rewards=[1.0], lengths=[-1], l0=1, sigma=1), "lengths"),
    (dict(rewards=[1.0], lengths=[1], l0=0, sigma=1), "l0"),
    (dict(rewards=[1.0], lengths=[1], l0=1, sigma=-2), "sigma")])
def test_verbosity_rejects(kwargs, name):
    with pytest.raises(ValueError, match=name):
        apply_verbosity(**kwargs)


groups = st.lists(st.tuples(st.floats(-2, 2, allow_nan=False), st.integers(0, 40)), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(groups)
def test_verbose_below_every_plain_candidate(group):
    rewards, lengths = [r for r, _ in group], [n for _, n in group]
    got = apply_verbosity(rewards, lengths, l0=10, sigma=2)
    verbose = [n > 20 for n in lengths]
    plain = [g for g, v in zip(got, verbose) if not v]
    for i, v in enumerate(verbose):
        if not v:
            assert got[i] == rewards[i]
        elif plain:
            assert got[i] < min(plain)
    for i in range(len(got)):  # the order among verbose candidates is kept (a common shift: ties only by rounding)
        for j in range(len(got)):
            if verbose[i] and verbose[j] and rewards[i] < rewards[j]:
                assert got[i] <= got[j]


# ---------------------------------------------------------------------------------------------------- advantages
def test_group_advantages_hand_made():
    # mean 0.5, population std 0.5
    a = group_advantages([1.0, 0.0, 1.0, 0.0], eps=1e-12)
    torch.testing.assert_close(a, torch.tensor([1.0, -1.0, 1.0, -1.0]))
    # r = [3, 0, 0]: mean 1, deviations [2, -1, -1], population std sqrt(6/3) = sqrt(2)
    a = group_advantages(torch.tensor([3.0, 0.0, 0.0]), eps=1e-6)
    s = math.sqrt(2) + 1e-6
    torch.testing.assert_close(a, torch.tensor([2 / s, -1 / s, -1 / s]))
    assert group_advantages([0.7, 0.7, 0.7]).tolist() == [0.0, 0.0, 0.0]
    assert group_advantages([0.1] * 3).tolist() == [0.0] * 3
    assert group_advantages([5.0]).tolist() == [0.0]
    assert group_advantages([1, 0]).dtype == torch.float32


@pytest.mark.parametrize("rewards", [[], [[1.0, 2.0]], [1.0, float("nan")]])
def test_group_advantages_rejects(rewards):
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(rewards)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-10, 10, allow_nan=False), min_size=1, max_size=16))
def test_group_advantages_centred(rewards):
    a = group_advantages(torch.tensor(rewards, dtype=torch.float64))
    assert abs(float(a.mean())) < 1e-6
    assert float(a.square().mean()) <= 1 + 1e-9  # unit population variance, less the eps
    for i, r in enumerate(rewards):  # the order of the rewards is kept
        assert all(a[i] <= a[j] for j, q in enumerate(rewards) if r < q)


# ---------------------------------------------------------------------------------------------------- MOPD
def test_mopd_token_rewards_clip_and_stop_gradient():
    teacher = torch.tensor([-1.0, -0.5, -3.0, -0.1], requires_grad=True)
    student = torch.tensor([-2.0, -4.0, -0.5, -0.1], requires_grad=True)
    r = mopd_token_rewards(teacher, student, clip=2.0)
    assert r.tolist() == [1.0, 2.0, -2.0, 0.0]  # differences 1, 3.5, −2.5, 0
    assert not r.requires_grad
    with pytest.raises(ValueError, match="shapes"):
        mopd_token_rewards(teacher, student[:2], clip=1.0)
    with pytest.raises(ValueError, match="clip"):
        mopd_token_rewards(teacher, student, clip=0.0)


# ---------------------------------------------------------------------------------------------------- policy loss
def test_policy_loss_on_policy_gradient():
    """With π == π_old the gradient w.r.t. the logits is −(1/n) Σ A ∇log π (explicit: A·(onehot − softmax))."""
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5, requires_grad=True)
    targets = torch.tensor([[1, 4, 0], [2, 2, 3]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    advantages = torch.tensor([0.8, -1.5])
    logprobs = logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    loss = policy_loss(logprobs, logprobs.detach(), advantages, mask)
    loss.backward()
    expected = torch.zeros(2, 3, 5)
    p = logits.detach().softmax(-1)
    for b in range(2):
        for t in range(3):
            if mask[b, t]:
                onehot = torch.zeros(5)
                onehot[targets[b, t]] = 1.0
                expected[b, t] = -advantages[b] * (onehot - p[b, t]) / 5  # n = 5 masked tokens
    torch.testing.assert_close(logits.grad, expected)
    assert loss.item() == pytest.approx(-(2 * 0.8 + 3 * -1.5) / 5)


def test_policy_loss_clipping_and_masking():
    # ratio e^{0.5} ≈ 1.65 with A > 0: clipped at 1.2, no gradient; ratio e^{−0.5} with A > 0: unclipped
    lp = torch.tensor([[0.0, -1.0, float("-inf")]], requires_grad=True)
    old = torch.tensor([[-0.5, -0.5, float("-inf")]])
    mask = torch.tensor([[True, True, False]])
    loss = policy_loss(lp, old, torch.tensor([2.0]), mask)
    assert loss.item() == pytest.approx(-(1.2 * 2 + math.exp(-0.5) * 2) / 2)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -math.exp(-0.5) * 2 / 2, 0.0]]))
    # per-token advantages [B, T] (MOPD): negative A with ratio < 1 − ε is clipped at 0.8
    loss = policy_loss(torch.tensor([[-1.0, 0.0]]), torch.tensor([[0.0, 0.0]]), torch.tensor([[-1.0, 3.0]]),
                       torch.tensor([[True, True]]))
    assert float(loss) == pytest.approx(-(-0.8 + 3.0) / 2)


def test_policy_loss_rejects():
    x = torch.zeros(2, 3)
    ok = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="mask"):
        policy_loss(x, x, torch.zeros(2), torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask"):
        policy_loss(x, x, torch.zeros(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(x, x, torch.zeros(3), ok)
    with pytest.raises(ValueError, match="old_logprobs"):
        policy_loss(x, torch.zeros(2, 4), torch.zeros(2), ok)
    with pytest.raises(ValueError, match="clip_eps"):
        policy_loss(x, x, torch.zeros(2), ok, clip_eps=0.0)
