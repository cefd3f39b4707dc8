"""One request must never harm another (issue 9): numerically safe sampling, per-request failure isolation
with separate retries of a failed batch, fair admission between requests' fan-outs, and a bounded queue."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import serving
from k3 import K3ForCausalLM
from k3.config import preset
from k3.generation import sample_next
from k3.serve.engine import Engine, QueueFull, SamplingParams, TextProcessor

GREEDY = SamplingParams(max_tokens=8, temperature=0)
POISON, TRIGGER, NAN_TRIGGER = 7, 9, 11  # token ids with a scripted effect in `Faulty`


class Faulty(K3ForCausalLM):
    """The tiny K3 with injected faults: a forward over any group holding ``POISON`` raises; a group whose
    input holds ``TRIGGER`` is made to emit ``POISON`` next (so the failure reaches a decode batch); a group
    holding ``NAN_TRIGGER`` gets NaN logits."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(preset("tiny"))
        with torch.no_grad():
            self.lm_head.weight.mul_(8.0)
        self.eval()

    def forward_groups(self, groups, full=None, replay=None):
        if any((ids == POISON).any() for ids, _ in groups):
            raise RuntimeError("poisoned input")
        results = super().forward_groups(groups, full, replay)
        for (ids, _), (logits, _) in zip(groups, results):
            logits[:, (POISON, TRIGGER, NAN_TRIGGER)] = -1e4  # scripted ids appear only where scripted
            rows = (ids == TRIGGER).any(-1)
            logits[rows, POISON] = 1e4
            logits[(ids == NAN_TRIGGER).any(-1)] = float("nan")
        return results


def clean(prompt: list[int]) -> list[int]:
    """A prompt without the scripted ids."""
    return [t for t in prompt if t not in (POISON, TRIGGER, NAN_TRIGGER)] or [1]


def collect(engine: Engine, jobs: list[tuple[list[int], SamplingParams]], processors=None):
    tokens = {i: [] for i in range(len(jobs))}
    finish, errors = {}, {}
    for i, (prompt, params) in enumerate(jobs):
        def callback(o, i=i):
            tokens[i].extend(o.token_ids)
            if o.finish_reason:
                finish[i], errors[i] = o.finish_reason, o.error
        engine.add_request(prompt, params, callback=callback, processor=(processors or {}).get(i))
    while engine.has_work():
        engine.step()
    n = len(jobs)
    return [tokens[i] for i in range(n)], [finish[i] for i in range(n)], [errors[i] for i in range(n)]


def alone(engine: Engine, prompt, params) -> list[int]:
    return [t for o in engine.generate(prompt, params) for t in o.token_ids]


# ---------------------------------------------------------------------------------------------- sampling
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-400, 400).map(lambda v: v / 8), min_size=2, max_size=40, unique=True),  # gaps >= 1/8
       st.sampled_from([5e-324, 1e-300, 1e-45, 1e-30, 1e-12]), st.sampled_from([1.0, 0.5, 1e-9]),
       st.integers(0, 5), st.integers(0, 2**32))
def test_tiny_temperatures_sample_the_argmax(values, temperature, top_p, top_k, seed):
    """A temperature that underflows fp32 (1e-300) used to give inf/NaN probabilities; a temperature far below
    every gap between logits samples the argmax."""
    logits = torch.tensor([values], dtype=torch.float32)
    token = sample_next(logits, temperature, top_p, top_k, torch.Generator().manual_seed(seed))
    assert int(token) == max(range(len(values)), key=values.__getitem__)


def test_extreme_logits_and_large_temperatures_sample_valid_tokens():
    generator = torch.Generator().manual_seed(0)
    logits = torch.tensor([[3e38, -3e38, 0.0, 1.0]])
    assert int(sample_next(logits, 1e-300, generator=generator)) == 0
    for temperature in (100.0, 1.0, 1e-300):
        tokens = {int(sample_next(torch.tensor([[1.0, 1.0, -2.0]]), temperature, generator=generator))
                  for _ in range(50)}
        assert tokens <= {0, 1, 2} and (tokens == {0, 1} if temperature < 1 else len(tokens) >= 2)


# ---------------------------------------------------------------------------------------------- isolation
def test_a_tiny_temperature_in_a_batch_harms_no_one():
    model, tok = serving.model(), serving.tokenizer()
    engine = Engine(model, tok)
    prompts = [clean(p) for p in serving.prompts()[:5]]
    params = [GREEDY, SamplingParams(max_tokens=8, temperature=1e-300, seed=3), GREEDY,
              SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, seed=5), GREEDY]
    singles = [alone(engine, p, q) for p, q in zip(prompts, params)]
    tokens, finish, _ = collect(engine, list(zip(prompts, params)))
    assert finish == ["length"] * 5 and tokens == singles
    assert tokens[1] == alone(engine, prompts[1], GREEDY)  # a vanishing temperature is greedy


def test_a_failing_forward_is_retried_per_request_and_ends_only_its_cause():
    engine = Engine(Faulty(), serving.tokenizer(), prefill_chunk=16)
    good = [clean(p) for p in serving.prompts()[1:6]]
    singles = [alone(engine, p, GREEDY) for p in good]
    jobs = [(good[0], GREEDY), ([5, POISON, 6], GREEDY), (good[1], GREEDY), ([5, TRIGGER], GREEDY),
            (good[2], GREEDY), (good[3] + [NAN_TRIGGER], GREEDY), (good[4], GREEDY)]
    tokens, finish, errors = collect(engine, jobs)
    assert [tokens[i] for i in (0, 2, 4, 6)] == singles[:3] + singles[4:]
    assert [finish[i] for i in (0, 2, 4, 6)] == ["length"] * 4
    assert finish[1] == "error" and "poisoned input" in errors[1]  # failed in a prefill chunk
    assert finish[3] == "error" and tokens[3] == [POISON] and "poisoned input" in errors[3]  # in a decode batch
    assert finish[5] == "error" and "non-finite logits" in errors[5]
    assert not engine.running and engine.finished["error"] == 3


def test_a_failing_processor_ends_only_its_request():
    model, tok = serving.model(), serving.tokenizer()
    engine = Engine(model, tok)

    class Broken(TextProcessor):
        def feed(self, token_id: int):
            raise UnicodeError("broken processor")

    prompts = [clean(p) for p in serving.prompts()[:3]]
    singles = [alone(engine, p, GREEDY) for p in prompts]
    tokens, finish, errors = collect(engine, [(p, GREEDY) for p in prompts], processors={1: Broken(tok)})
    assert finish == ["length", "error", "length"] and "broken processor" in errors[1]
    assert [tokens[0], tokens[2]] == [singles[0], singles[2]]


# ---------------------------------------------------------------------------------------------- admission
def test_one_requests_fan_out_cannot_starve_a_short_request():
    """Groups take turns for free batch slots: a request arriving behind another request's 12 choices is
    admitted at the first free slot, not after all of them."""
    engine = Engine(serving.model(), serving.tokenizer(), max_batch=2)
    order: list[str] = []
    params = SamplingParams(max_tokens=3, temperature=0)

    def done(name: str):
        return lambda o: o.finish_reason and order.append(name)

    engine.add_requests([([1, 2, 3], params, None, done("fan-out")) for _ in range(12)], group="big")
    engine.add_request([4, 5], params, callback=done("short"), group="small")
    while engine.has_work():
        engine.step()
    assert len(order) == 13 and order.index("short") <= 1, order


def test_the_queue_is_bounded_and_atomic():
    model, tok = serving.model(), serving.tokenizer()
    engine = Engine(model, tok, max_batch=2, max_waiting=4)
    job = ([1, 2], GREEDY, None, None)
    with pytest.raises(QueueFull, match="needs 5 more places.*holds 4") as info:
        engine.add_requests([job] * 5)
    assert info.value.retry_after >= 1 and engine.num_waiting == 0
    with pytest.raises(ValueError, match="max_tokens"):  # one invalid job: none is queued
        engine.add_requests([job, ([1], SamplingParams(max_tokens=-1), None, None)])
    assert engine.num_waiting == 0
    ids = engine.add_requests([job] * 4)
    with pytest.raises(QueueFull):
        engine.add_request([3], GREEDY)
    assert engine.abort(ids[0]) and engine.add_request([3], GREEDY)
    while engine.has_work():
        engine.step()
    assert engine.finished == {"length": 4, "abort": 1}
