"""k3.train.balance: quantile balancing (SPEC §5, Appendix C–D) and the bias-step baseline."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from k3 import K3ForCausalLM
from k3.config import preset
from k3.model.width import Router
from k3.train.balance import (
    QuantileBalancer,
    bias_step,
    exact_threshold,
    histogram_counts,
    histogram_range,
    histogram_threshold,
    margins,
    next_bias,
)


# ---------------------------------------------------------------------- independent references
def hinge(ms: list[Fraction], q: Fraction, theta: Fraction) -> Fraction:
    """The coordinate objective L(θ) = q·θ + Σ max(m_i − θ, 0), exactly."""
    return q * theta + sum((max(m - theta, 0) for m in ms), Fraction(0))


def strict(ms, theta) -> int:
    return sum(1 for m in ms if m > theta)


def weak(ms, theta) -> int:
    return sum(1 for m in ms if m >= theta)


def brackets(ms, q, theta) -> bool:
    return strict(ms, theta) <= q <= weak(ms, theta)


def minimisers(ms: list[Fraction], q: Fraction, grid: list[Fraction]) -> set[Fraction]:
    """The grid points minimising L; for 0 ≤ q ≤ m the minimum of the convex hinge sum is at a margin value."""
    best = min(hinge(ms, q, m) for m in ms)
    assert all(hinge(ms, q, t) >= best for t in grid)
    return {t for t in grid if hinge(ms, q, t) == best}


def dyadic_scores_without_ties(m: int, n: int, k: int, seed: int) -> torch.Tensor:
    """m = n tokens whose (k+1)-th ranked experts are all different, scores on a 2⁻¹⁰ grid (exact arithmetic)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(m):
        values = (torch.randperm(1023, generator=g)[:n] + 1).double().sort(descending=True).values / 1024
        others = [j for j in range(n) if j != i]
        order = torch.tensor(others)[torch.randperm(n - 1, generator=g)].tolist()
        row = torch.empty(n, dtype=torch.float64)
        row[i] = values[k]  # expert i holds token i's (k+1)-th place
        row[order] = torch.cat([values[:k], values[k + 1:]])
        rows.append(row)
    return torch.stack(rows)


# ---------------------------------------------------------------------- the seed fixture
def test_fixed_cutoff_target_count_without_ties():
    """No ties, integer q, cutoffs held fixed: exactly q margins above θ, and −θ routes exactly q tokens."""
    m = n = 8
    k, q = 2, 2  # q = m·k/n
    scores = dyadic_scores_without_ties(m, n, k, seed=0)
    old = torch.zeros(n, dtype=torch.float64)
    mg = margins(scores, old, k)
    for j in range(n):
        assert len(set(mg[:, j].tolist())) == m  # the no-ties precondition holds
    theta = exact_threshold(mg, m * k / n)
    assert ((mg > theta).sum(0) == q).all()
    cutoff = (scores + old).sort(-1, descending=True).values[:, k:k + 1]
    assert torch.equal(cutoff.squeeze(1), scores.diagonal())
    routed = (cutoff < scores - theta).sum(0)  # routedTokenCount(rawScore, cutoff, −θ)
    assert (routed == q).all()
    nb = next_bias(scores, old, k)
    assert torch.equal(nb, (-theta - (-theta).mean()).float())


def test_seed_fixture_repeated_cutoff_margins():
    """The seed's 8×4, k = 1 fixture: every token's cutoff expert has margin 0, so by pigeonhole some
    expert has tied margins; strict counts never exceed q, and fall short exactly where θ sits in a tie."""
    torch.manual_seed(0)
    m, n, k = 8, 4, 1
    q = m * k // n
    scores = torch.rand(m, n, dtype=torch.float64)
    mg = margins(scores, torch.zeros(n), k)
    assert ((mg == 0).sum(1) == 1).all() and ((mg == 0).sum(0) >= 2).any()
    theta = exact_threshold(mg, q)
    counts = (mg > theta).sum(0)
    assert (counts <= q).all() and ((mg >= theta).sum(0) >= q).all()
    ordered = mg.sort(0, descending=True).values
    assert torch.equal(counts == q, ordered[q - 1] != ordered[q])


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(2, 9), st.integers(1, 12), st.integers(0, 2**31 - 1))
def test_bracket_and_fixed_cutoff_count_on_random_scores(k_, n, m, seed):
    k = min(k_, n - 1)
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(m, n, generator=g, dtype=torch.float64)
    old = torch.randn(n, generator=g, dtype=torch.float64) * 0.1
    mg = margins(scores, old, k)
    q = m * k / n
    theta = exact_threshold(mg, q)
    strict_, weak_ = (mg > theta).sum(0), (mg >= theta).sum(0)
    assert (strict_ <= q).all() and (q <= weak_).all()
    if q == int(q):
        ordered = mg.sort(0, descending=True).values
        distinct = ordered[int(q) - 1] != ordered[int(q)] if q >= 1 else torch.ones(n, dtype=torch.bool)
        assert torch.equal(strict_ == q, distinct)


# ---------------------------------------------------------------------- the corrected minimiser condition
@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(-4, 4), min_size=1, max_size=6), st.data())
def test_minimisers_are_exactly_the_bracket(ints, data):
    ms = [Fraction(i, 2) for i in ints]  # half-integers: ties are frequent
    q = data.draw(st.fractions(0, len(ms), max_denominator=4))
    grid = [Fraction(i, 8) for i in range(8 * math.floor(min(ms) - 1), 8 * math.ceil(max(ms) + 1) + 1)]
    assert minimisers(ms, q, grid) == {t for t in grid if brackets(ms, q, t)}
    theta = Fraction(float(exact_threshold(torch.tensor([float(x) for x in ms], dtype=torch.float64), float(q))))
    assert brackets(ms, q, theta) and theta in ms


def test_endpoint_counterexample():
    """Margins {1, 0}, q = 1: all of [0, 1] minimises; at θ = 1 the strict count is 0, so "exactly q margins
    above θ" misses a minimiser, but the bracket 0 ≤ 1 ≤ 1 holds. The rule picks the report's θ = 0."""
    ms, q = [Fraction(1), Fraction(0)], Fraction(1)
    grid = [Fraction(i, 8) for i in range(-16, 17)]
    assert minimisers(ms, q, grid) == {t for t in grid if 0 <= t <= 1}
    assert hinge(ms, q, Fraction(1)) == 1 and strict(ms, 1) == 0 and weak(ms, 1) == 1
    assert float(exact_threshold(torch.tensor([1.0, 0.0]), 1)) == 0.0


def test_tie_example():
    """Margins {0, 0}, q = 1: θ = 0 minimises with strict count 0 and weak count 2."""
    ms, q = [Fraction(0), Fraction(0)], Fraction(1)
    grid = [Fraction(i, 8) for i in range(-16, 17)]
    assert minimisers(ms, q, grid) == {Fraction(0)}
    assert (strict(ms, 0), weak(ms, 0)) == (0, 2)
    assert float(exact_threshold(torch.tensor([0.0, 0.0]), 1)) == 0.0


@pytest.mark.parametrize("q, theta", [(0, 3.0), (1, 2.0), (1.5, 2.0), (2, 2.0), (2.5, 2.0), (3, 2.0), (4, 1.0),
                                      (4.5, 1.0), (5, 1.0)])
def test_tie_rule_takes_the_tied_value(q, theta):
    """θ = the (⌊q⌋+1)-th largest (clipped to the smallest at q = m): a tie at θ is excluded as a whole,
    so q = 2 routes 1 strictly (under-fills) rather than 4 (over-fills)."""
    ms = torch.tensor([3.0, 2.0, 2.0, 2.0, 1.0])
    got = exact_threshold(ms, q)
    assert float(got) == theta
    assert (ms > got).sum() <= q <= (ms >= got).sum()


def test_exact_threshold_batched_and_invalid():
    mg = torch.randn(7, 5)
    assert torch.equal(exact_threshold(mg, 3), torch.stack([exact_threshold(mg[:, j], 3) for j in range(5)]))
    for q in (-0.5, 7.5):
        with pytest.raises(ValueError, match="target load"):
            exact_threshold(mg, q)
    with pytest.raises(ValueError, match="top-k"):
        margins(torch.rand(3, 4), torch.zeros(4), 4)


# ---------------------------------------------------------------------- histogram
def test_shard_counts_pool_exactly_and_clamp():
    g = torch.Generator().manual_seed(1)
    mg = torch.randn(100, 6, generator=g) * 0.7  # some beyond [−1, 1]
    total = histogram_counts(mg, 32, -1.0, 1.0)
    assert total.dtype == torch.int64 and total.shape == (6, 32)
    assert torch.equal(histogram_counts(mg[:37], 32, -1.0, 1.0) + histogram_counts(mg[37:], 32, -1.0, 1.0), total)
    assert (total.sum(1) == 100).all()
    assert torch.equal(total[:, 0], (mg < -1 + 2 / 32).sum(0)) and torch.equal(total[:, -1], (mg >= 1 - 2 / 32).sum(0))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 80), st.integers(1, 5), st.integers(1, 300), st.data())
def test_histogram_threshold_within_one_bin(m, n, bins, data):
    seed = data.draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    raw = torch.rand(m, n, generator=g) * 2 - 1
    mg = torch.where(torch.rand(m, n, generator=g) < 0.3, raw.round(decimals=1), raw)  # ties, some on edges
    q = data.draw(st.floats(0, m))
    width = 2 / bins
    exact = exact_threshold(mg, q)
    hist = histogram_threshold(histogram_counts(mg, bins, -1.0, 1.0), -1.0, 1.0, q)
    assert hist.dtype == torch.float32
    assert ((hist - exact).abs() <= width + 1e-5).all()


def test_histogram_converges_with_more_bins():
    g = torch.Generator().manual_seed(2)
    mg = torch.rand(512, 8, generator=g, dtype=torch.float64) * 2 - 1
    exact = exact_threshold(mg, 64)
    errors = []
    for bins in (8, 64, 512, 4096, 32768):
        hist = histogram_threshold(histogram_counts(mg, bins, -1.0, 1.0), -1.0, 1.0, 64)
        errors.append(float((hist.double() - exact).abs().max()))
        assert errors[-1] <= 2 / bins + 1e-6
    assert errors[-1] < 1e-4


def test_next_bias_histogram_close_to_exact():
    scores = torch.rand(256, 8, generator=torch.Generator().manual_seed(3))
    old = torch.randn(8) * 0.05
    exact, hist = next_bias(scores, old, 2), next_bias(scores, old, 2, mode="histogram", bins=256)
    assert (exact - hist).abs().max() <= 2 * 2 / 256 + 1e-6  # each θ within a bin, the means within a bin


def sorted_threshold(scores: np.ndarray, bias: np.ndarray, k: int) -> np.ndarray:
    """The seed's rule by sorting: cutoff = (k+1)-th largest of s + b, θ = the (⌊q⌋+1)-th largest margin."""
    m, n = scores.shape
    cutoff = np.sort(scores + bias, axis=1)[:, -(k + 1)]
    mg = scores - cutoff[:, None]
    return np.sort(mg, axis=0)[::-1][math.floor(m * k / n)]


def large_bias(scale: float) -> torch.Tensor:
    """Mean-zero biases ±scale (and ±scale/2): the (k+1)-th largest sits far from 0 for k = 2."""
    return torch.tensor([1.0, 1.0, 1.0, 0.5, -0.5, -1.0, -1.0, -1.0], dtype=torch.float64) * scale


def test_histogram_range_holds_every_margin_and_is_attained():
    """Bias (3, 1.5, −1.5, −3), k = 1: c = 1.5, range [−2.5, −0.5]. A token scoring (0, 1, 1, 0) has cutoff
    2.5 and margin −2.5 on expert 0 (the lower end); one scoring (1, 0, 0, 0) has cutoff 1.5 and margin
    −0.5 on expert 0 (the upper end). Today's fixed [−1, 1] would miss every one of these margins."""
    bias = torch.tensor([3.0, 1.5, -1.5, -3.0])
    assert histogram_range(bias, 1) == (-2.5, -0.5)
    scores = torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    assert margins(scores, bias, 1)[:, 0].tolist() == [-2.5, -0.5]
    g = torch.Generator().manual_seed(6)
    for scale in (0.1, 1.5, 3.0, 10.0):
        scores = torch.rand(400, 8, generator=g)
        lo, hi = histogram_range(large_bias(scale), 2)
        mg = margins(scores, large_bias(scale), 2)
        assert hi - lo == 2.0 and lo <= float(mg.min()) and float(mg.max()) <= hi


@pytest.mark.parametrize("scale", [1.5, 3.0, 10.0, 100.0])
def test_histogram_threshold_within_one_bin_under_large_biases(scale):
    """SPEC §5 with biases ±1.5 and beyond: the histogram θ (256 bins, "a few hundred") is within one bin
    width 2/256 of the threshold found by sorting, and the centred bias within two (θ and the mean)."""
    g = torch.Generator().manual_seed(int(scale * 10))
    m, n, k, bins = 512, 8, 2, 256
    scores, bias = torch.rand(m, n, generator=g, dtype=torch.float64), large_bias(scale)
    expected = sorted_threshold(scores.numpy(), bias.numpy(), k)
    lo, hi = histogram_range(bias, k)
    theta = histogram_threshold(histogram_counts(margins(scores, bias, k), bins, lo, hi), lo, hi, m * k / n)
    assert np.abs(theta.double().numpy() - expected).max() <= 2 / bins + 1e-6
    centred = -expected + expected.mean()
    got = next_bias(scores, bias, k, mode="histogram", bins=bins).double().numpy()
    assert np.abs(got - centred).max() <= 2 * 2 / bins + 1e-6


def test_histogram_mode_refuses_scores_outside_the_sigmoid_range():
    with pytest.raises(ValueError, match=r"scores must be sigmoid router scores in \[0, 1\]"):
        next_bias(torch.rand(8, 4) + 1, torch.zeros(4), 1, mode="histogram")


# ---------------------------------------------------------------------- what balancing does not do
def test_identical_future_tokens_choose_the_same_expert():
    """Seed counterexample: under a fixed balanced bias a repeated score row routes every token alike."""
    scores = torch.rand(8, 4, generator=torch.Generator().manual_seed(4))
    nb = next_bias(scores, torch.zeros(4), 1)
    future = torch.tensor([0.9, 0.8, 0.2, 0.1]).repeat(8, 1)
    counts = torch.bincount((future + nb).argmax(1), minlength=4)
    assert counts.max() == 8 and not torch.equal(counts, torch.tensor([2, 2, 2, 2]))
    router = Router(16, 8, 2)
    with torch.no_grad():
        router.balance_bias.copy_(next_bias(torch.rand(64, 8), torch.zeros(8), 2))
    router(torch.randn(1, 16).repeat(32, 1))
    assert router.last_load.max() == 32 and (router.last_load > 0).sum() == 2


def test_next_bias_is_centred_fp32_and_selection_only():
    torch.manual_seed(5)
    router = Router(16, 8, 3).double()
    x = torch.randn(40, 16, dtype=torch.float64)
    weights0, idx0, scores = router(x)
    nb = next_bias(scores, router.balance_bias, router.k)
    assert nb.dtype == torch.float32 and abs(float(nb.mean())) < 1e-7
    with torch.no_grad():
        router.balance_bias.copy_(nb)
    weights, idx, scores1 = router(x)
    assert torch.equal(scores1, scores) and not torch.equal(idx, idx0)
    chosen = scores.gather(-1, idx)
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True), rtol=0, atol=0)
    same = (idx.sort(-1).values == idx0.sort(-1).values).all(-1)  # tokens whose expert set did not change
    assert same.any()
    by_expert = lambda w, i: torch.zeros(40, 8, dtype=w.dtype).scatter(-1, i, w)  # noqa: E731
    torch.testing.assert_close(by_expert(weights, idx)[same], by_expert(weights0, idx0)[same], rtol=0, atol=1e-15)
    with torch.no_grad():  # a common offset (what mean-centring removes) never changes the selection
        router.balance_bias.add_(0.25)
    assert torch.equal(router(x)[1], idx)


def test_bias_step():
    load = torch.tensor([10, 2, 4, 0])  # mean 4
    new = bias_step(load, torch.tensor([0.5, 0.0, -0.5, 0.0]), 0.01)
    assert new.dtype == torch.float32
    torch.testing.assert_close(new, torch.tensor([0.49, 0.01, -0.5, 0.01]))


# ---------------------------------------------------------------------- the balancer
def tiny_batch(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("mode", ["exact", "histogram"])
def test_balancer_on_tiny_model(mode):
    torch.manual_seed(0)
    model = K3ForCausalLM(preset("tiny"))
    balancer = QuantileBalancer(model, mode=mode)
    routers = balancer.routers
    assert len(routers) == 3  # layers 2–4 are MoE
    before = {name: r.balance_bias.clone() for name, r in routers.items()}
    model.train()
    logits, _ = model(tiny_batch())
    logits.float().square().mean().backward()
    balancer.update()
    for name, r in routers.items():
        assert not torch.equal(r.balance_bias, before[name])
        assert r.balance_bias.dtype == torch.float32 and abs(float(r.balance_bias.mean())) < 1e-6
    stats = balancer.load_stats()
    for name in routers:
        assert stats[f"load_max_mean/{name}"] >= 1.0 and 0 <= stats[f"load_idle/{name}"] < 4
    assert stats["load_max_mean"] == max(stats[f"load_max_mean/{n}"] for n in routers)

    frozen = {name: r.balance_bias.clone() for name, r in routers.items()}
    model.eval()
    with torch.no_grad():
        model(tiny_batch(1))
    balancer.update()
    model.train()
    with torch.no_grad():  # no-grad forwards are not collected either
        model(tiny_batch(2))
    balancer.update()
    for name, r in routers.items():
        assert torch.equal(r.balance_bias, frozen[name])


def test_balancer_accumulates_micro_batches():
    """update() after two micro-batches equals next_bias on their concatenated scores."""
    torch.manual_seed(0)
    model = K3ForCausalLM(preset("tiny")).train()
    balancer = QuantileBalancer(model)
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in balancer.routers}
    for name, r in balancer.routers.items():
        r.register_forward_hook(lambda mod, a, out, name=name: seen[name].append(out[2].detach()))
    old = {name: r.balance_bias.clone() for name, r in balancer.routers.items()}
    loads = {name: torch.zeros(4, dtype=torch.int64) for name in balancer.routers}
    for seed in (3, 4):
        model(tiny_batch(seed))[0].sum().backward()
        for name, r in balancer.routers.items():
            loads[name] += r.last_load
    balancer.update()
    for name, r in balancer.routers.items():
        expected = next_bias(torch.cat(seen[name]), old[name], r.k)
        torch.testing.assert_close(r.balance_bias, expected, rtol=0, atol=1e-7)
        load = loads[name].float()
        assert balancer.load_stats()[f"load_max_mean/{name}"] == pytest.approx(float(load.max() / load.mean()))


class RouterOnly(nn.Module):
    def __init__(self, d: int, n: int, k: int) -> None:
        super().__init__()
        self.router = Router(d, n, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.router(x)[0]


@pytest.mark.parametrize("mode", ["exact", "histogram"])
def test_balancing_a_skewed_router(mode):
    """Expert 0's raw score is boosted for every token; ~20 steps of forward + update (no parameter
    updates, fresh batches) bring its load and the max/mean load ratio down to near balance."""
    torch.manual_seed(0)
    d, n, k, m = 16, 8, 2, 256
    model = RouterOnly(d, n, k).train()
    shift = torch.randn(d)
    with torch.no_grad():
        model.router.weight[0] += 3 * shift / shift.square().sum()  # logit_0 ≈ 3 + noise
    balancer = QuantileBalancer(model, mode=mode)
    ratios, expert0 = [], []
    for _ in range(20):
        model(torch.randn(m, d) + shift)
        balancer.update()
        stats = balancer.load_stats()
        ratios.append(stats["load_max_mean"])
        expert0.append(int(model.router.last_load[0]))
    assert ratios[0] > 3.5 and expert0[0] > 0.9 * m  # n/k = 4: expert 0 takes almost every token
    assert max(ratios[-5:]) < 1.5 and max(expert0[-5:]) < 1.5 * m * k / n
    assert stats["load_idle"] == 0


@pytest.mark.parametrize("scale", [1.5, 3.0])
def test_balancer_histogram_mode_under_large_biases(scale):
    """The balancer's histogram mode (two micro-batches, counts pooled) lands within two bins of the sorted
    reference on the pooled scores when the router's bias is ±scale."""
    torch.manual_seed(8)
    model = RouterOnly(16, 8, 2).train()
    with torch.no_grad():
        model.router.balance_bias.copy_(large_bias(scale).float())
    balancer = QuantileBalancer(model, mode="histogram", bins=256)
    seen = []
    for _ in range(2):
        model(torch.randn(128, 16) * 20)  # spread-out scores
        seen.append(model.router.last_scores.double())
    expected = sorted_threshold(torch.cat(seen).numpy(), large_bias(scale).float().double().numpy(), 2)
    balancer.update()
    got = model.router.balance_bias.double().numpy()
    assert np.abs(got - (-expected + expected.mean())).max() <= 2 * 2 / 256 + 1e-6


def test_load_stats_counts_idle_experts():
    model = RouterOnly(16, 8, 2).train()
    balancer = QuantileBalancer(model)
    model(torch.randn(1, 16).repeat(10, 1))  # one token repeated: 2 experts take all 10, 6 idle
    balancer.update()
    stats = balancer.load_stats()
    assert stats["load_idle/router"] == 6 and stats["load_idle"] == 6
    assert stats["load_max_mean"] == pytest.approx(10 / (20 / 8))


def test_bias_step_mode_moves_by_gamma():
    torch.manual_seed(1)
    model = RouterOnly(16, 8, 2).train()
    with torch.no_grad():
        model.router.weight[0] += 0.5
    balancer = QuantileBalancer(model, mode="bias-step", gamma=1e-3)
    x = torch.randn(64, 16).abs()
    model(x)
    load = model.router.last_load.clone()
    balancer.update()
    moved = model.router.balance_bias
    torch.testing.assert_close(moved, -1e-3 * torch.sign(load.float() - load.float().mean()))
    assert float(moved[0]) == pytest.approx(-1e-3)  # the boosted expert is overloaded: pushed down


def test_balancer_rejects_bad_mode_and_remove_detaches():
    model = RouterOnly(16, 8, 2).train()
    with pytest.raises(ValueError, match="mode"):
        QuantileBalancer(model, mode="softmax")
    balancer = QuantileBalancer(model)
    balancer.remove()
    model(torch.randn(8, 16))
    balancer.update()
    assert torch.equal(model.router.balance_bias, torch.zeros(8)) and balancer.load_stats() == {}


def test_full_k_router_is_rejected_for_quantile_modes():
    model = RouterOnly(16, 4, 4)
    with pytest.raises(ValueError, match="top-k"):
        QuantileBalancer(model)
    QuantileBalancer(model, mode="bias-step")  # the baseline needs no cutoff
