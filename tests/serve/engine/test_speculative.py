"""Speculative decoding's lossless acceptance rule (SPEC §8, `k3.serve.engine.speculative`): exact by enumeration,
`verify` by Monte-Carlo, `probabilities` against `choose`, and the greedy reduction."""

from __future__ import annotations

import itertools
import math
from collections import defaultdict

import numpy as np
import pytest
import torch

from k3.serve.engine.sampling import SamplingParams, choose
from k3.serve.engine.speculative import probabilities, verify, verify_greedy


def _wilson_hilferty_sf(stat: float, dof: int) -> float:
    """Chi-square survival by Wilson–Hilferty: ``(X/k)^(1/3)`` is about normal(1 − 2/(9k), 2/(9k))."""
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


try:
    from scipy.stats import chi2

    _chi2_sf = chi2.sf
except ImportError:  # no scipy: the Wilson–Hilferty approximation instead
    _chi2_sf = _wilson_hilferty_sf


def _pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit of ``counts`` to ``probs``; the least likely bins are pooled until the pool
    expects at least 5, and a count where the probability is 0 fails outright."""
    assert counts[probs == 0].sum() == 0, "a zero-probability outcome occurred"
    expected = probs * counts.sum()
    order = np.argsort(expected)
    pooled = np.cumsum(expected[order])
    cut = int(np.searchsorted(pooled, 5.0)) + 1
    observed = np.append(counts[order[cut:]], counts[order[:cut]].sum())
    expected = np.append(expected[order[cut:]], pooled[cut - 1])
    return float(_chi2_sf(((observed - expected) ** 2 / expected).sum(), len(observed) - 1))


def test_wilson_hilferty_tracks_scipy():
    stats = pytest.importorskip("scipy.stats")
    for stat, dof in ((3.0, 4), (30.0, 20), (1100.0, 999), (1200.0, 999)):
        assert _wilson_hilferty_sf(stat, dof) == pytest.approx(stats.chi2.sf(stat, dof), rel=0.05, abs=1e-4)


# -- exactness by enumeration (V = 5, a context-independent toy target: p0 first, p1 after) --------------------

V = 5


def _round(p_rows: list[np.ndarray], q_rows: list[np.ndarray]) -> dict[tuple[int, ...], float]:
    """The exact distribution of the tokens one speculation round emits, enumerated from the rule: every draft
    sequence (with its q probability), every accept / reject branch, the residual or the bonus distribution."""
    out: dict[tuple[int, ...], float] = defaultdict(float)
    gamma = len(q_rows)
    for draft in itertools.product(range(V), repeat=gamma):
        weight = math.prod(q_rows[i][d] for i, d in enumerate(draft))
        if weight == 0:
            continue
        for i, d in enumerate(draft):
            accept = min(1.0, p_rows[i][d] / q_rows[i][d])
            residual = np.maximum(p_rows[i] - q_rows[i], 0.0)
            residual = residual / residual.sum() if residual.sum() > 0 else p_rows[i]
            for token in range(V):
                out[draft[:i] + (token,)] += weight * (1 - accept) * residual[token]
            weight *= accept
        for token in range(V):
            out[draft + (token,)] += weight * p_rows[gamma][token]
    return out


def _distribution(rng: np.random.Generator, zero: bool) -> np.ndarray:
    x = rng.dirichlet(np.full(V, 0.7))
    if zero:
        x[rng.integers(V)] = 0.0
    return x / x.sum()


@pytest.mark.parametrize("gamma", [1, 2, 3])
@pytest.mark.parametrize("seed", range(6))
def test_enumeration_is_the_target_distribution(seed: int, gamma: int):
    rng = np.random.default_rng(seed)
    p0, p1 = _distribution(rng, zero=seed % 2 == 0), _distribution(rng, zero=seed % 3 == 0)
    q_rows = [_distribution(rng, zero=seed % 2 == 1) for _ in range(gamma)]
    if seed == 5:
        q_rows[0] = p0.copy()  # draft equal to target: never rejected, the residual is all zero
    first_round = _round([p0] + [p1] * gamma, q_rows)
    assert sum(first_round.values()) == pytest.approx(1.0, abs=1e-12)
    next_first = np.zeros(V)  # the next round's first token (its target is p1 throughout)
    for emitted, weight in _round([p1] * (gamma + 1), q_rows).items():
        next_first[emitted[0]] += weight
    joint = np.zeros((V, V))
    for emitted, weight in first_round.items():
        if len(emitted) >= 2:
            joint[emitted[0], emitted[1]] += weight
        else:
            joint[emitted[0]] += weight * next_first
    assert np.abs(joint - np.outer(p0, p1)).max() < 1e-9


# -- verify itself, by Monte-Carlo (V = 1,000, γ = 4) ----------------------------------------------------------

def test_verify_matches_the_target_by_monte_carlo():
    vocab, gamma, trials = 1000, 4, 20_000
    torch.manual_seed(0)
    target_logits = torch.randn(gamma + 1, vocab, dtype=torch.float64) * 2.5
    p = target_logits.softmax(-1)
    q = (target_logits[:gamma] + torch.randn(gamma, vocab, dtype=torch.float64)).softmax(-1)
    drafts = torch.multinomial(q, trials, replacement=True, generator=torch.Generator().manual_seed(1)).T.tolist()
    generator = torch.Generator().manual_seed(2)
    first, accepted = np.zeros(vocab), np.zeros(gamma + 1)
    for draft in drafts:
        n, token = verify(p, q, draft, generator)
        first[draft[0] if n else token] += 1
        accepted[n] += 1
    alpha = torch.minimum(p[:gamma], q).sum(-1).tolist()  # each position's acceptance probability
    survive = np.cumprod([1.0] + alpha)
    want = survive * np.append(1 - np.array(alpha), 1.0)
    assert _pvalue(first, p[0].numpy()) > 1e-3
    assert _pvalue(accepted, want) > 1e-3


# -- probabilities against choose ------------------------------------------------------------------------------

@pytest.mark.parametrize(("temperature", "top_k", "top_p", "min_p"), [
    (1.0, 0, 1.0, 0.0), (0.7, 10, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.05), (0.5, 20, 0.9, 0.02)])
def test_probabilities_is_what_choose_samples(temperature: float, top_k: int, top_p: float, min_p: float):
    row = torch.randn(40, generator=torch.Generator().manual_seed(3)) * 2
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    probs = probabilities(row, params)
    assert probs.dtype == torch.float64 and float(probs.sum()) == pytest.approx(1.0, abs=1e-12)
    if top_k:
        assert int((probs > 0).sum()) <= top_k
    generator = torch.Generator().manual_seed(4)
    counts = np.bincount([choose(row, params, generator) for _ in range(20_000)], minlength=40)
    assert _pvalue(counts, probs.numpy()) > 1e-3


def test_probabilities_is_one_hot_when_greedy():
    row = torch.tensor([0.5, 2.0, -1.0, 2.0, float("-inf")])
    probs = probabilities(row, SamplingParams(temperature=0))
    assert probs.tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]
    assert choose(row, SamplingParams(temperature=0), None) == 1
    tiny = probabilities(row, SamplingParams(temperature=1e-300))  # finite: the tied maxima share the mass
    assert tiny.tolist() == [0.0, 0.5, 0.0, 0.5, 0.0]
    with pytest.raises(ValueError, match="no token is allowed"):
        probabilities(torch.full((3,), float("-inf")), SamplingParams())


def test_verify_with_one_hot_target_is_verify_greedy():
    rng = np.random.default_rng(5)
    generator = torch.Generator().manual_seed(6)
    for _ in range(300):
        gamma = int(rng.integers(0, 5))
        rows = torch.randn(gamma + 1, 8, dtype=torch.float64)
        argmax = rows.argmax(-1).tolist()
        draft = [a if rng.random() < 0.7 else int(rng.integers(8)) for a in argmax[:gamma]]
        q = torch.tensor(rng.dirichlet(np.ones(8), size=gamma)).reshape(gamma, 8)
        p = torch.stack([probabilities(r, SamplingParams(temperature=0)) for r in rows])
        assert verify(p, q, draft, generator) == verify_greedy(argmax, draft)
    assert verify_greedy([3, 4, 5], [3, 4]) == (2, 5)
    assert verify_greedy([3, 4, 5], [3, 1]) == (1, 4)
    assert verify_greedy([7], []) == (0, 7)


# -- edge cases ------------------------------------------------------------------------------------------------

def test_no_drafts_samples_the_target():
    p = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]])
    generator = torch.Generator().manual_seed(7)
    results = [verify(p, torch.empty(0, 5), [], generator) for _ in range(20_000)]
    assert {n for n, _ in results} == {0}
    assert _pvalue(np.bincount([t for _, t in results], minlength=5), p[0].numpy()) > 1e-3


def test_draft_the_draft_model_could_not_sample_is_rejected():
    for seed in range(50):
        generator = torch.Generator().manual_seed(seed)
        # the residual max(p − q, 0) is p's mass on token 0: the rejected token itself is re-emitted
        assert verify(torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]), torch.tensor([[0.0, 1.0, 0.0]]), [0],
                      generator) == (0, 0)
        # p == q: the residual is all zero, so the next token comes from p
        assert verify(torch.tensor([[0.0, 1.0, 0.0]] * 2), torch.tensor([[0.0, 1.0, 0.0]]), [0], generator) == (0, 1)
        # the first draft is accepted for sure (p == q), the second had q = 0
        p = torch.tensor([[0.6, 0.4, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
        assert verify(p, torch.tensor([[0.6, 0.4, 0.0], [0.5, 0.5, 0.0]]), [0, 2], generator) == (1, 2)


def test_draft_the_target_gives_no_mass_is_rejected():
    for seed in range(50):
        generator = torch.Generator().manual_seed(seed)
        assert verify(torch.tensor([[0.0, 1.0], [0.5, 0.5]]), torch.tensor([[0.5, 0.5]]), [0], generator) == (0, 1)
        p = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.2, 0.8], [1.0, 0.0, 0.0]])
        q = torch.tensor([[0.5, 0.5, 0.0], [0.9, 0.1, 0.0]])
        n, token = verify(p, q, [1, 0], generator)
        assert n == 1 and token in (1, 2)


def test_verify_checks_shapes():
    with pytest.raises(ValueError, match="need p"):
        verify(torch.ones(2, 4) / 4, torch.ones(2, 4) / 4, [0], None)
    with pytest.raises(ValueError, match="need γ"):
        verify_greedy([1, 2], [1, 2])
