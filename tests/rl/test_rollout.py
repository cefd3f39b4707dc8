"""Partial rollouts (SPEC §7): the bookkeeping (groups complete only when all K finished, paused trajectories resume
first, per-token policy versions, resumable state) and iterations on the real engine with a tiny model (pausing is
exact: a resumed greedy trajectory equals an uninterrupted generation)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3.rl.rollout import PartialRollouts, Trajectory, run_iteration
from k3.serve.engine import Engine, SamplingParams
import serving


# ---------------------------------------------------------------------------------------------------- bookkeeping
def test_fill_up_to_n_groups():
    ro = PartialRollouts(num_prompts=3, num_samples=2)
    assert ro.fill([[1], [2, 3]]) == [0, 1]
    assert ro.fill([[4], [5], [6]]) == [2]  # one place left
    assert ro.fill([[7]]) == []
    assert ro.groups_in_flight == 3
    assert [(t.id, t.prompt) for t in ro.schedule()] == [("0/0", [1]), ("0/1", [1]), ("1/0", [2, 3]),
                                                       ("1/1", [2, 3]), ("2/0", [4]), ("2/1", [4])]
    with pytest.raises(ValueError, match=r"prompts\[0\]"):
        PartialRollouts(1, 1).fill([[]])
    with pytest.raises(ValueError, match="num_samples"):
        PartialRollouts(1, 0)


def test_paused_resume_first_in_original_order():
    ro = PartialRollouts(num_prompts=3, num_samples=2)
    ro.fill([[1], [2], [3]])
    ro.schedule()
    for traj_id in ("0/0", "1/1", "2/0"):
        ro.finish(traj_id, "stop")
    assert [g[0].group for g in ro.complete_groups()] == []  # no group has both samples finished
    ro.finish("0/1", "length")
    assert [[t.id for t in g] for g in ro.complete_groups()] == [["0/0", "0/1"]]
    assert ro.fill([[4], [5]]) == [3]
    assert [t.id for t in ro.schedule()] == ["1/0", "2/1", "3/0", "3/1"]  # paused first, then new
    ro.finish("3/1", "stop")
    assert [t.id for t in ro.schedule()] == ["1/0", "2/1", "3/0"]


def test_versions_across_pause_and_resume():
    ro = PartialRollouts(num_prompts=1, num_samples=2)
    ro.fill([[9, 9]])
    ro.schedule()
    ro.record("0/0", [5, 6], [-0.5, -0.25], version=0)
    ro.record("0/1", [7], [-1.0], version=0)
    ro.finish("0/1", "stop")
    ro.schedule()  # iteration 1: 0/0 resumes
    ro.record("0/0", [8], [-2.0], version=1)
    ro.schedule()
    ro.record("0/0", [1, 2], [-3.0, -4.0], version=2)
    ro.finish("0/0", "length")
    [group] = ro.complete_groups()
    assert (group[0].tokens, group[0].versions, group[0].logprobs) == ([5, 6, 8, 1, 2], [0, 0, 1, 2, 2],
                                                                      [-0.5, -0.25, -2.0, -3.0, -4.0])
    assert (group[0].iterations, group[1].iterations) == (3, 1)
    assert (group[1].tokens, group[1].versions, group[1].finish_reason) == ([7], [0], "stop")


def test_misuse_is_rejected():
    ro = PartialRollouts(num_prompts=2, num_samples=2)
    ro.fill([[1]])
    with pytest.raises(ValueError, match="not scheduled"):
        ro.record("0/0", [1], [0.0], 0)
    ro.schedule()
    ro.fill([[2]])  # group 1 joins after the iteration started: not part of it
    with pytest.raises(ValueError, match="not scheduled"):
        ro.finish("1/0", "stop")
    with pytest.raises(ValueError, match="logprobs"):
        ro.record("0/0", [1, 2], [0.0], 0)
    with pytest.raises(KeyError, match="not in flight"):
        ro.record("7/0", [1], [0.0], 0)
    ro.finish("0/0", "stop")
    with pytest.raises(ValueError, match="already finished"):
        ro.record("0/0", [1], [0.0], 0)
    with pytest.raises(ValueError, match="lam"):
        ro.pause_point(0.0)


def test_pause_point_fraction():
    ro = PartialRollouts(num_prompts=2, num_samples=5)
    ro.fill([[1], [2]])
    assert ro.pause_point(0.3)  # nothing scheduled yet: nothing to wait for
    ro.schedule()
    for i in range(3):
        assert not ro.pause_point(0.3)
        ro.finish(f"0/{i}", "stop")
    assert ro.pause_point(0.3) and not ro.pause_point(0.4)  # 3 of 10
    for i in range(3, 5):
        ro.finish(f"0/{i}", "stop")
    ro.complete_groups()  # a group handed over mid-iteration still counts for the iteration
    assert ro.pause_point(0.5) and not ro.pause_point(1.0)


def test_state_dict_round_trip():
    ro = PartialRollouts(num_prompts=2, num_samples=2)
    ro.fill([[1, 2], [3]])
    ro.schedule()
    ro.record("0/0", [4, 5], [-0.1, -0.2], 3)
    ro.record("1/1", [6], [-0.3], 3)
    ro.finish("1/1", "stop")
    state = json.loads(json.dumps(ro.state_dict()))
    back = PartialRollouts(num_prompts=2, num_samples=2)
    back.load_state_dict(state)
    assert back.state_dict() == ro.state_dict()
    assert [t.id for t in back.schedule()] == [t.id for t in ro.schedule()] == ["0/0", "0/1", "1/0"]
    assert back.trajectory("0/0") == Trajectory(0, 0, [1, 2], [4, 5], [3, 3], [-0.1, -0.2], False, None, 2)
    assert back.fill([[7]]) == []
    with pytest.raises(ValueError, match="samples"):
        PartialRollouts(num_prompts=2, num_samples=3).load_state_dict(state)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.lists(st.lists(st.booleans(), min_size=9, max_size=9), max_size=8))
def test_groups_complete_only_when_all_k_finished(n, k, iterations):
    """Whatever finishes when, a group comes out exactly once, after all its K trajectories finished, and every
    token of a trajectory is tagged with the iteration that produced it."""
    ro = PartialRollouts(n, k)
    seen: set[int] = set()
    for v, finishes in enumerate([*iterations, [True] * 9]):
        ro.fill([[g] for g in range(n)])
        for i, traj in enumerate(ro.schedule()):
            ro.record(traj.id, [v], [-1.0], v)
            if finishes[i % 9]:
                ro.finish(traj.id, "stop")
        for group in ro.complete_groups():
            assert len(group) == k and all(t.finished for t in group)
            assert group[0].group not in seen
            seen.add(group[0].group)
            for t in group:
                assert t.versions == t.tokens and t.versions == sorted(set(t.versions))
    assert ro.groups_in_flight == 0 and seen == set(range(len(seen)))


# ---------------------------------------------------------------------------------------------------- on the engine
MAX_TOKENS = 12


def reference(model, tok, prompt: list[int], params: SamplingParams) -> tuple[list[int], list[float]]:
    """An uninterrupted generation (its own engine) and its tokens' log-probabilities."""
    outputs = list(Engine(model, tok).generate(prompt, params))
    return [t for o in outputs for t in o.token_ids], [lp.logprob for o in outputs for lp in o.logprobs]


def test_partial_rollouts_on_engine_are_exact(model, tok):
    """λ = 0.5, K = 2, N = 3 over three iterations: groups complete only with K finished samples, paused trajectories
    resume and end with the tokens (and log-probabilities) of an uninterrupted greedy generation, tokens tagged with
    the version of the iteration that sampled them."""
    prompts = serving.prompts()
    chosen = [prompts[1], prompts[5], prompts[2], prompts[3]]
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=0)
    first, _ = reference(model, tok, chosen[0], greedy)
    params = SamplingParams(temperature=0, stop_token_ids=(first[2],))  # group 0 stops early: others pause mid-way
    expected = [reference(model, tok, p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
                                                         stop_token_ids=params.stop_token_ids)) for p in chosen]
    engine = Engine(model, tok, max_batch=4, prefill_chunk=8)
    ro = PartialRollouts(num_prompts=3, num_samples=2)
    ro.fill(chosen[:3])
    done, counts, resumed_mid_way, seen = [], [], 0, {}
    for version in range(3):
        scheduled = sum(not t.finished for t in ro.in_flight())
        stats = run_iteration(engine, ro, params, version, lam=0.5, max_tokens=MAX_TOKENS)
        assert stats.finished + stats.paused == scheduled and stats.steps > 0 and not engine.has_work()
        assert stats.finished / scheduled >= 0.5 and 0 <= stats.idle <= 1
        paused = [t for t in ro.in_flight() if not t.finished]
        resumed_mid_way += sum(0 < len(t.tokens) < len(expected[t.group][0]) for t in paused)
        seen |= {t.id: t for t in ro.in_flight()}
        counts.append({i: len(t.tokens) for i, t in seen.items()})  # tokens held after each iteration
        for group in ro.complete_groups():
            assert len(group) == 2 and all(t.finished for t in group)
            done += group
        ro.fill(chosen[3:] if version == 0 else [])
    assert resumed_mid_way > 0 and {t.group for t in done} == {0, 1, 2, 3}
    for t in done:
        tokens, logprobs = expected[t.group]
        assert t.tokens == tokens
        assert t.logprobs == pytest.approx(logprobs, abs=1e-4)
        assert t.finish_reason == ("stop" if tokens[-1] in params.stop_token_ids else "length")
        held = [0] + [counts[v].get(t.id, 0) for v in range(3)]
        assert t.versions == [v for v in range(3) for _ in range(held[v + 1] - held[v])]


def test_lam_one_waits_for_all_and_seeds_differ_per_sample(model, tok):
    """λ = 1: one iteration finishes everything (no partial rollouts). A seeded run is reproducible, and the K
    samples of a prompt get their own seeds."""
    prompts = serving.prompts()[1:3]
    params = SamplingParams(temperature=1.0, seed=7)
    runs = []
    for _ in range(2):
        ro = PartialRollouts(num_prompts=2, num_samples=2)
        ro.fill(prompts)
        stats = run_iteration(Engine(model, tok, max_batch=2), ro, params, version=5, lam=1.0, max_tokens=8)
        assert (stats.finished, stats.paused, stats.tokens) == (4, 0, 32)
        groups = ro.complete_groups()
        assert [len(g) for g in groups] == [2, 2] and all(t.versions == [5] * 8 for g in groups for t in g)
        runs.append([t.tokens for g in groups for t in g])
    assert runs[0] == runs[1]
    assert runs[0][0] != runs[0][1] and runs[0][2] != runs[0][3]


def test_engine_error_raises():
    model = serving.Scripted(start=5, script=[1, 2, 3], fail_after=2)
    ro = PartialRollouts(num_prompts=1, num_samples=1)
    ro.fill([serving.prompts()[1]])
    engine = Engine(model, serving.tokenizer())
    with pytest.raises(RuntimeError, match="rollout failed: trajectory 0/0"):
        run_iteration(engine, ro, SamplingParams(temperature=0), 0, lam=1.0, max_tokens=8)
    assert not engine.has_work()
