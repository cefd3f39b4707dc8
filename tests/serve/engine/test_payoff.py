"""The adaptive draft length (`k3.serve.engine.payoff`, issue 36): expected tokens by enumeration, γ chosen from
measured acceptance, a pause that probes again, and the engine's tokens unchanged by it."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from k3.serve.engine.payoff import DraftLength, StepCost, expected_tokens


@given(st.floats(0, 1), st.integers(0, 6))
def test_expected_tokens_is_the_enumerated_mean(alpha, gamma):
    """Sum over every accept/reject pattern of γ drafts: a run keeps the accepted prefix and one more token."""
    mean = 0.0
    for pattern in itertools.product([True, False], repeat=gamma):
        accepted = next((i for i, ok in enumerate(pattern) if not ok), gamma)
        probability = 1.0
        for ok in pattern:
            probability *= alpha if ok else 1 - alpha
        mean += probability * (accepted + 1)
    assert expected_tokens(alpha, gamma) == pytest.approx(mean, abs=1e-9)


def test_full_acceptance_drafts_the_most_and_none_stops():
    lengths = DraftLength(gamma=4, cost=0.1)
    for _ in range(10):
        lengths.update("good", 4, 4)
        lengths.update("bad", 4, 0)
    assert lengths.length("good") == 4
    assert lengths.length("bad") == 0


def steps(lengths: DraftLength, request: str, n: int, watched: bool = False) -> list[int]:
    """The draft lengths of ``request`` in the next ``n`` engine steps."""
    out = []
    for _ in range(n):
        lengths.tick()
        out.append(lengths.length(request, watched))
    return out


def test_a_paused_request_probes_after_the_pause_and_the_pause_doubles():
    lengths = DraftLength(gamma=3, cost=0.25, prior=0.0, pause=4, max_pause=8)
    lengths.update("r", 3, 0)  # nothing accepted: below the break-even point, paused until step 4
    assert steps(lengths, "r", 4) == [0, 0, 0, 3]  # a probe drafts as long a run as drafting would
    lengths.update("r", 3, 0)  # the probe lost (step 4): twice as long, to the next multiple of 8
    assert steps(lengths, "r", 4) == [0, 0, 0, 3]
    lengths.update("r", 3, 0)  # step 8: capped at max_pause, next probe at 16
    assert steps(lengths, "r", 8) == [0] * 7 + [3]


def test_a_paused_request_reads_the_targets_features_only_just_before_its_probe():
    """`DraftLength.reading`: a new request reads (nothing says it is paused); a paused one only in the ``ahead``
    steps before its probe, and in the probe's own step; a request that drafts reads."""
    lengths = DraftLength(gamma=3, cost=0.25, prior=0.0, pause=8, max_pause=8)
    assert lengths.reading("r", 2)
    lengths.update("r", 3, 0)  # step 0: paused until step 8
    reading = []
    for _ in range(8):
        lengths.tick()
        lengths.length("r")
        reading.append(lengths.reading("r", 2))
    assert reading == [False] * 5 + [True] * 3  # steps 6 and 7 (6 + 2 reaches 8), and 8, which probes
    lengths.update("r", 3, 3)  # the probe won: no pause
    lengths.tick()
    assert lengths.length("r") > 0 and lengths.reading("r", 0)


def test_paused_requests_probe_in_the_same_steps():
    """Requests that lost at different steps probe together: their pauses end at multiples of their length."""
    lengths = DraftLength(gamma=4, cost=0.1, prior=0.0, pause=8)
    probes: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    lost = {"a": 1, "b": 3, "c": 6}
    for step in range(1, 40):
        lengths.tick()
        for request in probes:
            if step == lost[request]:
                lengths.update(request, 4, 0)
            elif step > lost[request] and lengths.length(request):
                probes[request].append(step)
                lengths.update(request, 1, 0)
    assert probes["a"] == probes["b"] == probes["c"] == [8, 16, 32]  # pauses of 8, 16, 32


def test_a_new_request_starts_from_the_pause_the_last_losing_probe_reached_until_a_probe_wins():
    lengths = DraftLength(gamma=4, cost=0.1, prior=0.0, pause=4, max_pause=64)
    for _ in range(3):
        lengths.update("a", 4, 0)  # losses: pauses of 4, 8, 16
    assert lengths.population_pause == 16
    assert steps(lengths, "b", 16) == [0] * 15 + [4]  # b probes once in its first 16 steps, not at step 4 and 8
    lengths.update("b", 4, 0)
    assert lengths.population_pause == 32  # b's own pause doubled from the population's
    for _ in range(3):
        lengths.update("c", 4, 4)  # c's runs win: the population's pause is gone
    assert lengths.population_pause == 0 and lengths.length("d") == 4


def test_recovering_acceptance_drafts_again():
    lengths = DraftLength(gamma=4, cost=0.1, prior=0.0, pause=2)
    lengths.update("r", 4, 0)
    assert steps(lengths, "r", 2) == [0, 4]
    for _ in range(5):
        lengths.update("r", 4, 4)
    assert lengths.length("r") >= 3


def test_a_new_request_starts_from_the_acceptance_of_the_requests_before_it():
    """The population's α (every run, decayed 0.95 per run) is a new request's prior: after runs that all lost, a new
    request starts paused and probes; after runs that all won, it drafts the full γ at once."""
    lengths = DraftLength(gamma=4, cost=0.1, pause=4)
    assert lengths.acceptance("new") == pytest.approx(0.6)  # the stated prior before any run
    for _ in range(20):
        lengths.update("lost", 4, 0)  # one examined position each, none accepted
    lengths.end("lost")
    # accepted 2.4·0.95²⁰ = 0.8604; examined 4·0.95²⁰ + (1 − 0.95²⁰)/0.05 = 1.4340 + 12.8302
    assert lengths.acceptance("new") == pytest.approx(0.8604 / 14.2642, abs=1e-4)
    # paused from its first step, as long as the last losing probe's pause (4, doubled per loss up to 256): one probe
    assert steps(lengths, "new", 256) == [0] * 255 + [4]
    for _ in range(40):
        lengths.update("won", 4, 4)
    assert lengths.acceptance("fresh") > 0.97
    assert lengths.length("fresh") == 4


@given(st.floats(0, 1))
def test_best_never_loses_to_plain_decoding(alpha):
    lengths = DraftLength(gamma=5, cost=0.3)
    gamma = lengths.best(alpha)
    assert gamma == 0 or expected_tokens(alpha, gamma) / (1 + 0.3 * gamma) > 1


def test_an_engine_whose_drafts_always_lose_stops_drafting(model, tok):
    """A draft model with other weights is mostly rejected: adaptively, it drafts far less than always."""
    import serving
    from k3.serve.engine import Engine, SamplingParams
    from k3.serve.engine.drafting import ModelDrafter

    params = SamplingParams(max_tokens=40, temperature=0)
    counts = {}
    for adaptive in (False, True):
        engine = Engine(model, tok, drafter=ModelDrafter(serving.model(seed=1)), num_draft_tokens=4,
                        adaptive_draft=adaptive)
        list(engine.generate(serving.prompts()[3], params))
        counts[adaptive] = engine.speculation
    assert counts[False]["accepted"] < counts[False]["drafted"] / 2
    assert counts[True]["drafted"] < counts[False]["drafted"] / 2 and counts[True]["plain"] > 0


def test_a_model_drafter_catches_up_after_steps_without_drafts():
    """Paused steps emit tokens the draft model never read: its next proposal reads them first, so it proposes what
    a drafter that read the whole history proposes."""
    import torch

    import serving
    from k3.serve.engine import SamplingParams
    from k3.serve.engine.drafting import ModelDrafter

    tokens, params = serving.prompts()[5], SamplingParams(temperature=0)
    paused, fresh = ModelDrafter(serving.model(seed=1)), ModelDrafter(serving.model(seed=1))
    paused.propose("r", tokens[:10], tokens[10], params, tokens[:10], [], None, 3)
    paused.accept("r", 0)  # read 11 tokens; then 9 tokens are decoded plainly
    a = paused.propose("r", tokens[:20], tokens[20], params, tokens[:10], tokens[10:21], None, 3)
    b = fresh.propose("r", tokens[:20], tokens[20], params, tokens[:10], tokens[10:21], None, 3)
    assert a.tokens == b.tokens
    torch.testing.assert_close(a.q, b.q, atol=1e-5, rtol=0)


def test_step_cost_fits_a_fixed_and_a_per_position_price_from_timed_steps():
    """Each speculative step r plain steps long at batch B, with k verified rows and n drafted positions, is one
    observation (r − 1)·B = f·k + c·n, complete once the step after it is timed; ``value`` is the decayed
    least-squares (f, c): the stated (0, c) until a plain step of that batch size was timed, f = 0 while every run
    had one width, both once two widths were seen, and all of it in f when a wider run costs no more. The first step
    and one in ``every`` are plain ones."""
    cost = StepCost(0.1, every=4, decay=0.5)
    cost.record(1, 1, 4, 2.0)  # no plain step of batch 1 yet
    cost.record(1, 0, 0, 1.0)
    assert cost.value == (0.0, 0.0, 0.1)
    cost.record(1, 1, 4, 2.0)
    assert cost.value == (0.0, 0.0, 0.1)  # held until the next step is timed
    cost.record(1, 0, 0, 1.0)  # a plain step's time after it: 1 = 4c, one width
    assert cost.value == pytest.approx((0.0, 0.0, 0.25))
    cost.record(1, 1, 1, 1.5)
    cost.record(1, 1, 4, 2.0)  # a verification right after one: the first is complete as it was, 0.5 = f + c
    assert cost.value == pytest.approx((0.0, 1 / 3, 1 / 6))  # with 1 = f + 4c (at batch 1, G and f are one)
    cost.record(8, 0, 0, 2.0)  # completes the batch-1 verification (1 = f + 4c again), then times batch 8
    cost.record(8, 4, 16, 3.0)
    cost.record(8, 0, 0, 2.0)  # (1.5 − 1)·8 = 4 = 4f + 16c: the same prices
    assert cost.value == pytest.approx((0.0, 1 / 3, 1 / 6))
    assert [cost.plain_step() for _ in range(8)] == [True, False, False, False] * 2
    flat = StepCost(0.1, decay=0.5)
    flat.record(1, 0, 0, 1.0)
    flat.record(1, 1, 4, 2.0)
    flat.record(1, 1, 1, 2.5)
    flat.record(1, 0, 0, 1.0)  # the shorter run cost more: no per-position price, f = (0.5·1 + 1.5) / (0.5 + 1)
    assert flat.value == pytest.approx((0.0, 4 / 3, 0.0))


def test_a_verifications_price_includes_the_step_after_it():
    """A verification of 4 drafts costs 1.5 plain steps, and the plain step after it 1.5 (its row rejoins the decode
    batch): the run's price is 1 plain step, c = 1/4, and the plain steps' time stays 1 (the step after a verification
    is no plain step's sample)."""
    cost = StepCost(0.1, decay=0.5)
    cost.record(1, 0, 0, 1.0)
    for _ in range(3):
        cost.record(1, 1, 4, 1.5)
        cost.record(1, 0, 0, 1.5)
    assert cost.value == pytest.approx((0.0, 0.0, 0.25))
    cost.record(1, 0, 0, 1.0)  # a plain step after a plain one: the plain time is still 1
    cost.record(1, 1, 4, 1.5)
    cost.record(1, 0, 0, 1.5)
    assert cost.value == pytest.approx((0.0, 0.0, 0.25))


@pytest.mark.parametrize("price", [0.05, 2.0])
def test_the_measured_price_of_a_draft_decides_whether_to_draft(tok, monkeypatch, price):
    """Drafts the target always accepts (`serving.Cycling`, an n-gram drafter), steps timed as if a drafted position
    cost ``price`` plain steps (a synthetic clock: tests never read wall time): cheap drafts keep drafting, and at
    2 plain steps a position even fully accepted drafts lose — (γ + 1) / (1 + 2γ) < 1 — so drafting all but stops,
    while the tokens stay plain decoding's."""
    import serving
    from k3.serve.engine import Engine, SamplingParams
    from k3.serve.engine.drafting import Speculator
    from k3.serve.engine.ngram import NGramDrafter

    timed = Speculator.timed
    monkeypatch.setattr(Speculator, "timed", lambda self, seconds: timed(self, 1.0 + price * self._proposed[2]))
    model = serving.Cycling()
    prompt, params = serving.prompts()[3] + serving.CYCLE * 2, SamplingParams(max_tokens=80, temperature=0)
    engine = Engine(model, tok, drafter=NGramDrafter(), num_draft_tokens=4)
    tokens = [t for o in engine.generate(prompt, params) for t in o.token_ids]
    assert tokens == [t for o in Engine(model, tok).generate(prompt, params) for t in o.token_ids]
    stats = engine.speculation
    assert engine.speculator.cost.measured == pytest.approx((0.0, 0.0, price), abs=1e-9)
    if price < 1:
        assert stats["accepted"] > 40
    else:
        assert stats["runs"] <= 4 and stats["plain"] > 30  # a few probes (pauses of 16, 32, 64 steps)


def test_a_probe_that_drafts_nothing_is_followed_by_another():
    """An n-gram drafter may find no match at the probe: no run is verified, so no update comes. The request must
    still probe again later (before, it decoded plainly for good: a code edit lost its 1.78x)."""
    lengths = DraftLength(gamma=4, cost=0.1, prior=0.0, pause=4)
    lengths.update("r", 4, 0)
    assert steps(lengths, "r", 4) == [0, 0, 0, 4]  # the probe: the drafter finds nothing
    assert steps(lengths, "r", 8) == [0, 0, 0, 4] * 2  # paused to step 8 again (not doubled), then to 12
    lengths.update("r", 4, 4)
    lengths.update("r", 4, 4)
    assert lengths.length("r") > 0


def test_a_price_rise_without_runs_still_probes():
    """The measured price can make drafting lose before any run: the request still probes after a pause."""
    lengths = DraftLength(gamma=4, cost=0.1, pause=4)
    lengths.cost = 10.0
    assert steps(lengths, "r", 4) == [0, 0, 0, 4]


def test_padded_verification_drafts_all_or_nothing_and_probes_full_width():
    """On compiled graphs every verification is γ + 1 wide: any γ > 0 costs 1 + c·γ, so the choice is γ or 0, and
    a probe drafts γ (one draft would cost the same)."""
    lengths = DraftLength(gamma=4, cost=0.25, prior=0.0, pause=4, padded=True)
    assert {lengths.best(a / 20) for a in range(21)} == {0, 4}
    lengths.update("r", 4, 0)
    assert steps(lengths, "r", 4) == [0, 0, 0, 4]


@pytest.mark.parametrize("padded", [False, True])
def test_a_fixed_price_verification_is_priced_as_fixed(padded):
    """A verification step costs 2 plain steps whatever is drafted (a padded, compiled one; or one whose fixed part
    — accept, bookkeeping — dominates); drafts are always accepted. Probing at the full γ and fitting (f, c), a γ-wide
    run is priced at its 2 steps and drafting pays (≈2.5 tokens per plain step's time). (Before: eager probes drafted
    one token, the price was counted per drafted position, a position looked to cost 1 plain step, and the request
    stayed paused.)"""
    lengths, cost = DraftLength(gamma=4, cost=0.25, prior=0.0, pause=4, padded=padded), StepCost(0.25)
    tokens = seconds = 0.0
    for _ in range(400):
        lengths.tick()
        if cost.plain_step():
            cost.record(1, 0, 0, 1.0)
            tokens, seconds = tokens + 1, seconds + 1
            continue
        drafted = lengths.length("r")
        if drafted:
            cost.record(1, 1, 4 if padded else drafted, 2.0)
            _, lengths.fixed, lengths.cost = cost.value
            lengths.update("r", drafted, drafted)
        tokens, seconds = tokens + 1 + drafted, seconds + (2.0 if drafted else 1.0)
    assert tokens / seconds > 2.2


def test_step_cost_separates_a_groups_price_from_its_rows_and_positions():
    """At batch 8, steps verifying 1, 2 and 4 rows of runs of 3 and 8 drafts, timed as G = 0.5 plain steps per group,
    f = 0.25 per row and c = 0.0625 per position: the fit recovers the three prices."""
    cost = StepCost(0.1, decay=0.9)
    cost.record(8, 0, 0, 1.0)
    for rows, width in [(1, 8), (2, 8), (4, 8), (1, 3), (4, 3), (2, 3)]:
        cost.record(8, rows, rows * width, 1.0 + (0.5 * 8 + 0.25 * rows + 0.0625 * rows * width) / 8)
        cost.record(8, 0, 0, 1.0)
    assert cost.value == pytest.approx((0.5, 0.25, 0.0625))


def test_shadow_evidence_ends_a_pause_only_when_drafting_pays():
    """A paused request's free proposals checked against the target's own tokens: misses keep it paused (to its
    probe), a few hits end the pause at once."""
    lengths = DraftLength(gamma=4, cost=0.1, prior=0.0, pause=16)
    lengths.update("r", 4, 0)
    for _ in range(3):
        lengths.shadow("r", False)
        assert steps(lengths, "r", 1) == [0]
    hits = 0
    while lengths.length("r") == 0:
        lengths.shadow("r", True)
        hits += 1
    assert hits <= 3 and lengths.now < 16  # drafting again, as long as the evidence so far pays for
    for _ in range(8):
        lengths.shadow("r", True)
    assert lengths.length("r") == 4


def test_a_watched_request_never_probes_and_drafts_again_on_its_shadow_evidence():
    """A request whose free proposals are checked against the target's tokens (`watched`) pays for no probe: paused,
    it decodes plainly through the steps where an unwatched request probes (4, 8, 16, ...), however long, and drafts
    again as soon as its shadow hits make drafting pay."""
    lengths = DraftLength(gamma=4, cost=0.1, prior=0.0, pause=4)
    lengths.update("r", 4, 0)
    lengths.update("s", 4, 0)
    assert steps(lengths, "s", 4) == [0, 0, 0, 4]  # unwatched: the probe at step 4
    assert lengths.length("r", watched=True) == 0
    assert steps(lengths, "r", 300, watched=True) == [0] * 300
    for _ in range(2):
        lengths.shadow("r", True)
    assert lengths.length("r", watched=True) > 0


def test_a_watched_request_starts_paused_and_drafts_on_a_shadow_hit_never_on_a_miss():
    """The prior is no evidence: a new watched request decodes plainly until its free proposals hit. A miss leaves
    it paused even while its estimate (the prior decayed by the miss) would still pay; the next hit ends the pause."""
    lengths = DraftLength(gamma=4, cost=0.1, prior=0.9, pause=4)
    assert lengths.length("unwatched") == 4  # the prior pays: an unwatched request drafts from its first step
    assert steps(lengths, "r", 40, watched=True) == [0] * 40
    lengths.shadow("r", False)
    assert lengths.best(lengths.acceptance("r")) > 0  # the estimate still pays after the miss ...
    assert steps(lengths, "r", 1, watched=True) == [0]  # ... but a miss does not end the pause
    lengths.shadow("r", True)
    assert lengths.length("r", watched=True) == 4


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_paused_request_drafts_again_when_its_text_starts_repeating(tok, monkeypatch, temperature):
    """An n-gram drafter (free proposals) on a request that starts paused (no acceptance credited): its proposals
    are checked against the target's tokens while it decodes plainly, and it drafts within a few steps, not at the
    first probe 16 steps later — a sampled request too (the target samples the cycle's token: probability ~1).
    Tokens stay plain decoding's."""
    import serving
    from k3.serve.engine import Engine, SamplingParams
    from k3.serve.engine.drafting import Speculator
    from k3.serve.engine.ngram import NGramDrafter

    timed = Speculator.timed
    monkeypatch.setattr(Speculator, "timed", lambda self, seconds: timed(self, 1.0 + 0.05 * self._proposed[2]))
    model = serving.Cycling()
    prompt = serving.prompts()[3] + serving.CYCLE * 2
    params = SamplingParams(max_tokens=40, temperature=temperature, seed=0)
    engine = Engine(model, tok, drafter=NGramDrafter(), num_draft_tokens=4)
    engine.speculator.lengths.population = [0.0, 2.0]  # α starts at 0: the request pauses at its first step
    tokens = [t for o in engine.generate(prompt, params) for t in o.token_ids]
    assert tokens == [t for o in Engine(model, tok).generate(prompt, params) for t in o.token_ids]
    stats = engine.speculation
    assert stats["shadowed"] >= 1 and stats["shadow_hits"] == stats["shadowed"]
    assert stats["plain"] < 8 and stats["accepted"] > 20


class _Row:
    def __init__(self, request_id: str) -> None:
        self.id = request_id


def test_a_verification_group_runs_only_when_its_rows_gain_more_than_its_price():
    """A group price G = 1 plain step is paid once per step by all B = 4 rows: one row keeping 5 tokens per run (its
    own price 1.4) gains 3.6 < G·B = 4 and is held until its next probe; two such rows gain 7.2 and verify; a probe
    always verifies."""
    from k3.serve.engine.drafting import Speculator
    from k3.serve.engine.ngram import NGramDrafter

    speculator = Speculator(NGramDrafter(), 4, 1000)
    speculator.cost.measured = (1.0, 0.0, 0.1)
    lengths = speculator.lengths
    lengths.fixed, lengths.cost = 0.0, 0.1
    rows = [_Row(name) for name in "abcd"]
    for row in rows:
        for _ in range(20):
            lengths.update(row.id, 4, 4)
    assert lengths.gain("a", 4) == pytest.approx(3.6, abs=0.01)
    assert speculator._group_pays({rows[0]: 4, rows[1]: 4, rows[2]: 0, rows[3]: 0})
    assert not speculator._group_pays({rows[0]: 4, rows[1]: 0, rows[2]: 0, rows[3]: 0})
    assert speculator.counts["held"] == 1 and steps(lengths, "a", 1) == [0]  # held: paused to its next probe
    while lengths.length("a") == 0:
        lengths.tick()
    assert lengths.probing("a") and speculator._group_pays({rows[0]: 4, rows[1]: 0, rows[2]: 0, rows[3]: 0})
