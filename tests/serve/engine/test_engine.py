"""The continuous-batching engine: per-request state, chunked prefill, batch invariance, sampling, cancellation."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from k3.serve.engine import ContextLengthExceeded, Engine, SamplingParams
import serving

GREEDY = SamplingParams(max_tokens=12, temperature=0)


def run_together(engine: Engine, prompts, params) -> tuple[list[list[int]], list[str | None], int]:
    """Submit all, step until done; returns token ids, finish reasons and the number of steps."""
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    finish: dict[int, str | None] = {}
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        def callback(o, i=i):
            tokens[i].extend(o.token_ids)
            if o.finish_reason:
                finish[i] = o.finish_reason
        engine.add_request(prompt, p, callback=callback)
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    return [tokens[i] for i in range(len(prompts))], [finish.get(i) for i in range(len(prompts))], steps


def alone(engine: Engine, prompt, params) -> list[int]:
    return [t for o in engine.generate(prompt, params) for t in o.token_ids]


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by explicit full-sequence recomputation (no state, no batching)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(torch.tensor([ids]))
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_greedy_equals_full_recomputation(model, tok):
    engine = Engine(model, tok, prefill_chunk=16)
    for prompt in serving.prompts()[:4]:
        assert alone(engine, prompt, GREEDY) == reference_greedy(model, prompt, GREEDY.max_tokens)


def test_a_reused_request_id_starts_from_its_own_prompt(model, tok):
    """A library user may reuse an id once its request ended: the new request decodes from its own prompt, never
    from the ended request's stacked decode state (tokens equal full recomputation)."""
    engine = Engine(model, tok, prefill_chunk=16)
    first, second = serving.prompts()[:2]
    for prompt in (first, second, first):
        tokens = [t for o in engine.generate(prompt, GREEDY, request_id="same") for t in o.token_ids]
        assert tokens == reference_greedy(model, prompt, GREEDY.max_tokens)


def test_batch_invariance(model, tok):
    """Greedy tokens of each request are the same alone and in a batch of unequal lengths (MLA padding)."""
    prompts = serving.prompts()
    engine = Engine(model, tok, prefill_chunk=64)
    singles = [alone(engine, p, GREEDY) for p in prompts]
    together, finish, _ = run_together(engine, prompts, GREEDY)
    assert together == singles
    assert finish == ["length"] * len(prompts)
    # staggered arrivals: requests join a running batch between steps
    tokens: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, GREEDY, callback=lambda o, i=i: tokens.setdefault(i, []).extend(o.token_ids))
        engine.step()
    while engine.has_work():
        engine.step()
    assert [tokens[i] for i in range(len(prompts))] == singles


def test_batched_logprobs_match_alone(model, tok):
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=3)
    prompts = serving.prompts()[:5]
    engine = Engine(model, tok)
    single = [[lp for o in engine.generate(p, params) for lp in o.logprobs] for p in prompts]
    batched: dict[int, list] = {i: [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add_request(p, params, callback=lambda o, i=i: batched[i].extend(o.logprobs))
    while engine.has_work():
        engine.step()
    for a_list, b_list in zip(single, batched.values()):
        for a, b in zip(a_list, b_list, strict=True):
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_chunked_prefill_gives_the_same_tokens_and_interleaves(model, tok):
    prompts = serving.prompts()
    whole, _, _ = run_together(Engine(model, tok, prefill_chunk=10_000), prompts, GREEDY)
    small_chunks = Engine(model, tok, prefill_chunk=7)
    small_chunks.scheduler.idle_prefill = 7  # chunk even while nothing decodes
    chunked, _, steps = run_together(small_chunks, prompts, GREEDY)
    assert chunked == whole and steps >= sum(map(len, prompts)) // 7
    # A long prompt arriving while a short request decodes: the short one gets a token every step.
    engine = Engine(model, tok, prefill_chunk=16)
    long_prompt, short = serving.prompts()[5], serving.prompts()[1]
    events: list[tuple[int, str]] = []
    step = [0]
    engine.add_request(short, SamplingParams(max_tokens=20, temperature=0),
                       callback=lambda o: events.append((step[0], "short")))
    engine.step()
    engine.add_request(long_prompt, SamplingParams(max_tokens=2, temperature=0),
                       callback=lambda o: events.append((step[0], "long")))
    while engine.has_work():
        step[0] += 1
        engine.step()
    first_long = min(s for s, who in events if who == "long")
    assert first_long == -(-len(long_prompt) // 16)  # one chunk of 16 per step
    short_steps = {s for s, who in events if who == "short"}
    assert set(range(1, first_long + 1)) <= short_steps  # never stalled by the prefill
    # with nothing decoding, there is no latency to protect: the whole prompt is prefilled at once
    events.clear()
    step[0] = 0
    engine.add_request(long_prompt, SamplingParams(max_tokens=2, temperature=0),
                       callback=lambda o: events.append((step[0], "long")))
    engine.step()
    assert events == [(0, "long")]


def test_sampling_is_per_request_and_seeded(model, tok):
    engine = Engine(model, tok)
    prompt = serving.prompts()[3]
    seeded = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    first = alone(engine, prompt, seeded)
    # the same seed reproduces the output even with other requests in the batch
    together, _, _ = run_together(engine, [prompt] + serving.prompts()[:3],
                                  [seeded] + [SamplingParams(max_tokens=10, temperature=1.0)] * 3)
    assert together[0] == first
    assert alone(engine, prompt, SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=8)) != first
    assert alone(engine, prompt, SamplingParams(max_tokens=10, temperature=0.7, top_k=1, seed=1)) == \
        alone(engine, prompt, SamplingParams(max_tokens=10, temperature=0))


def test_stop_strings_are_cut_and_never_streamed(model, tok):
    engine = Engine(model, tok)
    prompt = serving.prompts()[4]
    outputs = list(engine.generate(prompt, SamplingParams(max_tokens=40, temperature=0)))
    text = "".join(t for o in outputs for _, t in o.deltas)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert len(stop) == 3 and text.find(stop) > 0
    outputs = list(engine.generate(prompt, SamplingParams(max_tokens=40, temperature=0, stop=("\x00", stop))))
    streamed = [t for o in outputs for _, t in o.deltas]
    assert "".join(streamed) == text[:text.find(stop)]
    assert outputs[-1].finish_reason == "stop"
    assert not any(stop in t for t in streamed)


def test_stop_token_ids_and_max_tokens(model, tok):
    engine = Engine(model, tok)
    prompt = serving.prompts()[2]
    greedy = alone(engine, prompt, SamplingParams(max_tokens=10, temperature=0))
    stop_at = max(i for i, t in enumerate(greedy) if greedy.index(t) == i)  # a token's first occurrence, late
    outputs = list(engine.generate(prompt, SamplingParams(max_tokens=10, temperature=0,
                                                          stop_token_ids=(greedy[stop_at],))))
    assert [t for o in outputs for t in o.token_ids] == greedy[:stop_at + 1]  # the stop token is reported
    assert outputs[-1].finish_reason == "stop" and outputs[-1].completion_tokens == stop_at + 1
    outputs = list(engine.generate(prompt, SamplingParams(max_tokens=3, temperature=0)))
    assert outputs[-1].finish_reason == "length" and outputs[-1].completion_tokens == 3


def test_logprobs_are_the_models(model, tok):
    engine = Engine(model, tok)
    prompt = serving.prompts()[2]
    out = list(engine.generate(prompt, SamplingParams(max_tokens=1, temperature=0, logprobs=4)))[0]
    with torch.no_grad():
        ref = model(torch.tensor([prompt]))[0][0, -1].float().log_softmax(-1)
    (lp,) = out.logprobs
    assert lp.token_id == int(ref.argmax()) and lp.logprob == pytest.approx(float(ref.max()), abs=1e-5)
    assert [t for t, _ in lp.top] == ref.topk(4).indices.tolist()


def test_cancellation_frees_state_at_once(model, tok):
    engine = Engine(model, tok, max_batch=2)
    finished: dict[str, str] = {}
    ids = [engine.add_request(p, SamplingParams(max_tokens=50, temperature=0),
                              callback=lambda o: o.finish_reason and finished.__setitem__(o.request_id,
                                                                                          o.finish_reason))
           for p in serving.prompts()[:3]]
    engine.step()
    engine.step()
    assert set(engine.running) == set(ids[:2]) and engine.num_waiting == 1
    request = engine.running[ids[0]]
    assert engine.abort(ids[0]) and request.state is None and ids[0] not in engine.running
    assert engine.abort(ids[2]) and engine.num_waiting == 0  # a waiting request
    assert not engine.abort(ids[0]) and not engine.abort("nope")
    assert finished == {ids[0]: "abort", ids[2]: "abort"}
    while engine.has_work():
        engine.step()
    assert finished[ids[1]] == "length" and not engine.running


def test_background_thread_and_non_blocking_abort(model, tok):
    engine = Engine(model, tok).start()
    try:
        outputs = list(engine.generate(serving.prompts()[1], GREEDY))
        assert outputs[-1].finish_reason == "length" and sum(len(o.token_ids) for o in outputs) == 12
        started = threading.Event()
        rid = engine.add_request(serving.prompts()[2], SamplingParams(max_tokens=4000, temperature=0),
                                 callback=lambda o: started.set())
        assert started.wait(10)
        assert engine.abort(rid, wait=False)
        deadline = time.monotonic() + 10
        while engine.running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.running
    finally:
        engine.stop()


def test_a_failing_step_ends_requests_with_an_error_not_the_engine(model, tok, monkeypatch):
    engine = Engine(model, tok)
    calls = [0]
    forward = type(model).forward_groups

    def flaky(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("boom")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward_groups", flaky)
    outputs = list(engine.generate(serving.prompts()[1], GREEDY))
    assert outputs[-1].finish_reason == "error" and "boom" in outputs[-1].error
    monkeypatch.undo()
    assert alone(engine, serving.prompts()[1], GREEDY) == reference_greedy(model, serving.prompts()[1], 12)


def test_context_limit(model, tok):
    engine = Engine(model, tok, max_model_len=40)
    with pytest.raises(ContextLengthExceeded, match="maximum context length is 40 tokens.*requested 45 tokens "
                                                    r"\(33 in the prompt, 12 in the completion\)"):
        engine.add_request(serving.prompts()[3], GREEDY)
    outputs = list(engine.generate(serving.prompts()[3], SamplingParams(max_tokens=7, temperature=0)))
    assert outputs[-1].finish_reason == "length" and outputs[-1].completion_tokens == 7


@pytest.mark.parametrize("params, message", [
    (SamplingParams(max_tokens=-1), "max_tokens: expected a non-negative integer"),
    (SamplingParams(min_p=1.5), "min_p"), (SamplingParams(repetition_penalty=0), "repetition_penalty"),
    (SamplingParams(presence_penalty=3), "presence_penalty"), (SamplingParams(logit_bias=((600, 1.0),)), "logit_bias"),
    (SamplingParams(max_tokens=4, min_tokens=5), "min_tokens"), (SamplingParams(prompt_logprobs=21), "prompt_logprobs"),
    (SamplingParams(max_tokens=True), "max_tokens"),
    (SamplingParams(temperature=-1), "temperature"),
    (SamplingParams(top_p=0), "top_p"),
    (SamplingParams(top_k=-2), "top_k"),
    (SamplingParams(seed=1.5), "seed"),
    (SamplingParams(stop=("",)), "stop"),
    (SamplingParams(stop_token_ids=(512,)), "stop_token_ids"),
    (SamplingParams(logprobs=21), "logprobs"),
])
def test_bad_sampling_params_are_named(model, tok, params, message):
    engine = Engine(model, tok)
    with pytest.raises(ValueError, match=message):
        engine.add_request([1, 2], params)
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request([], GREEDY)
    with pytest.raises(ValueError, match="prompt: token ids"):
        engine.add_request([1, 512], GREEDY)
    assert not engine.has_work()
    engine.add_request([1, 2], GREEDY, request_id="mine")
    with pytest.raises(ValueError, match="request_id: 'mine' is already in use"):
        engine.add_request([3], GREEDY, request_id="mine")
    assert engine.num_waiting == 1
