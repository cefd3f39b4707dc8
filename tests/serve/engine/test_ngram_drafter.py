"""The prompt-lookup drafter (`k3.serve.engine.ngram`, issue 36): hand-worked proposals, and in the engine the same
greedy tokens as plain decoding, drafts accepted on repetitive text, and sampled requests still exact."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import serving
from k3.serve.engine import Engine, SamplingParams
from k3.serve.engine.drafting import Speculator
from k3.serve.engine.ngram import NGramDrafter
from k3.serve.engine.request import Joined, Request


def lookup(tokens: list[int], gamma: int = 4, **kwargs) -> list[int]:
    return NGramDrafter(**kwargs).lookup("r", tokens, gamma)


def test_the_longest_suffix_wins_over_a_later_shorter_match():
    # suffix [7, 8, 9]: its 3-gram occurred at the start (followed by 1 2); the 2-gram [8, 9] also later (then 5)
    assert lookup([7, 8, 9, 1, 2, 0, 8, 9, 5, 6, 7, 8, 9], gamma=2) == [1, 2]


def test_the_most_recent_occurrence_wins():
    assert lookup([3, 4, 10, 11, 3, 4, 20, 21, 3, 4], gamma=2, min_n=2) == [20, 21]


def test_a_match_running_into_the_end_continues_periodically():
    # [5, 6] last occurred ending at index 4; what followed is 5 6 (the suffix), then the period-2 pattern goes on
    assert lookup([9, 5, 6, 5, 6, 5, 6], gamma=5) == [5, 6, 5, 6, 5]


def test_no_match_of_min_n_tokens_proposes_nothing():
    assert lookup([1, 2, 3, 4, 5, 3], min_n=2) == []  # only the 1-gram [3] repeats
    assert lookup([1, 2, 3, 4, 5, 3], min_n=1) == [4, 5, 3, 4]
    assert lookup([1]) == []
    # the default looks up 3 tokens at least (README: a 2-token match is wrong too often to pay): the 2-gram is not
    assert lookup([3, 4, 10, 11, 3, 4]) == [] and lookup([3, 4, 10, 11, 3, 4], min_n=2) == [10, 11, 3, 4]
    assert lookup([5, 3, 4, 10, 11, 5, 3, 4]) == [10, 11, 5, 3]


def test_proposals_stop_at_gamma_and_follow_a_growing_history():
    drafter = NGramDrafter(min_n=2)
    history = [1, 2, 3, 4, 5, 6, 1, 2]
    assert drafter.lookup("r", history, 3) == [3, 4, 5]
    history += [3, 9, 1, 2]  # the index is extended, not rebuilt: [1, 2] now last occurred before 3 9
    assert drafter.lookup("r", history, 3) == [3, 9, 1]
    drafter.end("r")
    assert drafter.lookup("r", [1, 2], 3) == []


@given(st.lists(st.lists(st.integers(0, 9), max_size=6), max_size=4), st.integers(-1, 30), st.integers(-30, 30),
       st.integers(-30, 30), st.sampled_from([1, 1, 2, -1]))
def test_a_joined_view_reads_as_its_parts_concatenated(parts, length, start, stop, step):
    whole = [t for part in parts for t in part]
    whole = whole if length < 0 else whole[:length]
    view = Joined(tuple(parts), None if length < 0 else length)
    assert len(view) == len(whole)
    assert view[start:stop:step] == whole[start:stop:step]
    assert view[:] == whole and list(view) == whole
    for i in range(-len(whole), len(whole)):
        assert view[i] == whole[i]
    for i in (len(whole), -len(whole) - 1):
        with pytest.raises(IndexError):
            view[i]


def test_the_drafter_reads_a_request_through_a_view_of_its_tokens():
    # prompt 5 6 7 5 6, output 7 8 (8 pending): the history is the prompt and the 7; its suffix 6 7 -> 5 6 7 ...
    prompt, output = [5, 6, 7, 5, 6], [7, 8]
    history = Joined((prompt, output), len(prompt) + len(output) - 1)
    draft = NGramDrafter().propose("r", history, 8, SamplingParams(), prompt, output, None, 3)
    assert draft is None  # ... but with the pending 8 the suffix 7 8 never occurred
    request = Request("r", "r", prompt, SamplingParams(), None, None, None, pending=5, output_ids=[7, 5])
    assert list(request.history) == [5, 6, 7, 5, 6, 7]  # everything before the pending token
    assert NGramDrafter().propose("r", request.history, 5, SamplingParams(), prompt, [7, 5], None, 3).tokens == \
        [6, 7, 5]


def test_the_draft_distribution_is_one_hot_at_each_token():
    draft = NGramDrafter(min_n=2).propose("r", [4, 5, 6, 4], 5, SamplingParams(), [], [], None, 3)
    assert draft.tokens == [6, 4, 5] and draft.q is None  # deterministic: made only where a verification reads it
    expected = torch.zeros(3, 50, dtype=torch.float64)
    expected[0, 6] = expected[1, 4] = expected[2, 5] = 1.0
    assert torch.equal(draft.distributions(50, torch.device("cpu")), expected)


@pytest.mark.parametrize("adaptive", [True, False])
def test_greedy_tokens_equal_plain_decoding_and_repeats_are_accepted(tok, adaptive, monkeypatch):
    if adaptive:  # steps timed on a synthetic clock (cheap drafts): adaptive γ must not follow the machine's load
        timed = Speculator.timed
        monkeypatch.setattr(Speculator, "timed", lambda self, seconds: timed(self, 1.0 + 0.05 * self._proposed[2]))
    model = serving.Cycling()
    prompts = [serving.prompts()[3] + serving.CYCLE * 2, *serving.prompts()[2:5]]
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=1)
    plain = Engine(model, tok)
    spec = Engine(model, tok, drafter=NGramDrafter(), adaptive_draft=adaptive)
    for prompt in prompts:
        want = [(o.token_ids, [t.logprob for t in o.logprobs]) for o in plain.generate(prompt, params)]
        got = [(o.token_ids, [t.logprob for t in o.logprobs]) for o in spec.generate(prompt, params)]
        assert [t for ids, _ in got for t in ids] == [t for ids, _ in want for t in ids]
        assert [p for _, ps in got for p in ps] == pytest.approx([p for _, ps in want for p in ps], abs=1e-4)
    stats = spec.speculation
    assert stats["accepted"] > 0.9 * stats["drafted"] > 0 and stats["accepted_at_4"] > 0
    bins = {int(k.rsplit("_", 1)[1]) for k in stats if k.startswith("runs_from_")}  # acceptance by output length
    assert bins and bins <= {0, 16} and sum(stats[f"runs_from_{n}"] for n in bins) == stats["runs"]
    assert sum(stats[f"kept_from_{n}"] for n in bins) == stats["accepted"] + stats["runs"]


def test_sampled_requests_end_like_plain_ones(tok):
    """Sampling under speculation draws its uniforms differently, so only the distribution is shared (the rule's
    exactness is `test_speculative`'s); here: the request runs to max_tokens with valid ids and no error."""
    params = SamplingParams(max_tokens=20, temperature=0.7, seed=5)
    model = serving.Cycling()
    spec = Engine(model, tok, drafter=NGramDrafter(), adaptive_draft=False)
    outputs = list(spec.generate(serving.prompts()[3] + serving.CYCLE * 2, params))
    tokens = [t for o in outputs for t in o.token_ids]
    assert outputs[-1].finish_reason == "length" and len(tokens) == 20 and max(tokens) < tok.vocab_size
