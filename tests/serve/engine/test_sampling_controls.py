"""Sampling controls and prompt log-probabilities in the engine (issue 12, items 1 and 3): each has an observable
effect, equals a direct reference, is batch-invariant and seed-reproducible."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import serving
from k3.serve.engine import Engine, SamplingParams
from k3.serve.engine.sampling import process

PROMPTS = [p for p in serving.prompts() if len(p) >= 5][:4]


def run(engine: Engine, jobs: list[tuple[list[int], SamplingParams]]) -> list:
    """Run ``jobs`` together; per job (token ids, finish reason, outputs)."""
    results = [([], None, []) for _ in jobs]

    def callback(i):
        def push(output):
            results[i][0].extend(output.token_ids)
            results[i][2].append(output)
            if output.finish_reason is not None:
                results[i] = (results[i][0], output.finish_reason, results[i][2])
        return push

    engine.add_requests([(p, q, None, callback(i)) for i, (p, q) in enumerate(jobs)])
    while engine.has_work():
        engine.step()
    return results


def reference(model, prompt: list[int], params: SamplingParams, n: int) -> list[int]:
    """Greedy decoding by full recomputation, with the penalties written out token by token."""
    ids: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids]))[0][0, -1].double()
        for token, bias in params.logit_bias:
            logits[token] += bias
        for token in set(prompt) | set(ids):
            r = params.repetition_penalty
            logits[token] = logits[token] / r if logits[token] > 0 else logits[token] * r
        for token in set(ids):
            logits[token] -= params.frequency_penalty * ids.count(token) + params.presence_penalty
        if len(ids) < params.min_tokens:
            for token in params.stop_token_ids:
                logits[token] = -math.inf
        token = int(logits.argmax())
        if token in params.stop_token_ids:
            break
        ids.append(token)
    return ids


@pytest.mark.parametrize("change", [
    {"repetition_penalty": 1.8}, {"presence_penalty": 1.5}, {"frequency_penalty": 2.0},
    {"logit_bias": ((7, 5.0), (40, -100.0))}, {"presence_penalty": -1.0, "repetition_penalty": 0.7},
])
def test_penalties_equal_the_reference_and_change_the_output(model, tok, change):
    engine = Engine(model, tok)
    prompt = tok.encode("x = 1")  # greedy repeats tokens within 24 steps here
    base = SamplingParams(max_tokens=24, temperature=0)
    params = SamplingParams(max_tokens=24, temperature=0, **change)
    plain = run(engine, [(prompt, base)])[0][0]
    got = run(engine, [(prompt, params)])[0][0]
    assert got == reference(model, prompt, params, 24)
    assert got != plain


def test_controls_are_batch_invariant_and_seed_reproducible(model, tok):
    engine = Engine(model, tok)
    jobs = [(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.9, seed=3, repetition_penalty=1.3, min_p=0.05)),
            (PROMPTS[1], SamplingParams(max_tokens=8, temperature=0, frequency_penalty=1.0)),
            (PROMPTS[2], SamplingParams(max_tokens=8, temperature=1.2, top_k=20, seed=9, presence_penalty=0.5,
                                        logit_bias=((3, 2.0),))),
            (PROMPTS[3], SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, seed=1, min_tokens=4))]
    together = [r[0] for r in run(engine, jobs)]
    alone = [run(engine, [job])[0][0] for job in jobs]
    assert together == alone
    assert [r[0] for r in run(engine, jobs)] == together


def test_min_p_one_is_greedy_and_min_p_trims(model, tok):
    engine = Engine(model, tok)
    greedy = run(engine, [(PROMPTS[1], SamplingParams(max_tokens=8, temperature=0))])[0][0]
    sampled = run(engine, [(PROMPTS[1], SamplingParams(max_tokens=8, temperature=1.0, min_p=1.0, seed=5))])[0][0]
    assert sampled == greedy


def test_min_tokens_forbid_stopping_and_ignore_eos_is_the_routes_choice(model, tok):
    engine = Engine(model, tok)
    eos = tok.eos_id
    forced_end = ((eos, 100.0),)
    stops = run(engine, [(PROMPTS[0], SamplingParams(max_tokens=9, temperature=0, stop_token_ids=(eos,),
                                                     logit_bias=forced_end))])[0]
    assert stops[0] == [eos] and stops[1] == "stop"
    held = run(engine, [(PROMPTS[0], SamplingParams(max_tokens=9, temperature=0, stop_token_ids=(eos,),
                                                    logit_bias=forced_end, min_tokens=5))])[0]
    assert len(held[0]) == 6 and held[0][-1] == eos and eos not in held[0][:5] and held[1] == "stop"


def test_include_stop_str_in_output(model, tok):
    engine = Engine(model, tok)
    base = run(engine, [(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0))])[0]
    text = "".join(t for o in base[2] for _, t in o.deltas)
    stop = text[3:5]
    cut = run(engine, [(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, stop=(stop,)))])[0]
    kept = run(engine, [(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, stop=(stop,),
                                                    include_stop_str_in_output=True))])[0]
    assert "".join(t for o in cut[2] for _, t in o.deltas) == text[:text.index(stop)]
    assert "".join(t for o in kept[2] for _, t in o.deltas) == text[:text.index(stop) + len(stop)]


@pytest.mark.parametrize("chunk", [4, 64])
def test_prompt_logprobs_equal_one_full_forward(model, tok, chunk):
    engine = Engine(model, tok, prefill_chunk=chunk)
    prompt = PROMPTS[2]
    out = run(engine, [(prompt, SamplingParams(max_tokens=0, prompt_logprobs=3))])[0]
    assert out[1] == "length" and out[0] == []
    scored = next(o.prompt_logprobs for o in out[2] if o.prompt_logprobs is not None)
    with torch.no_grad():
        expected = model(torch.tensor([prompt]))[0][0].double().log_softmax(-1)
    assert scored[0] is None and len(scored) == len(prompt)
    for t, entry in enumerate(scored[1:]):
        assert entry.token_id == prompt[t + 1]
        assert entry.logprob == pytest.approx(float(expected[t, prompt[t + 1]]), abs=1e-4)
        assert [i for i, _ in entry.top] == expected[t].topk(3).indices.tolist()
        assert entry.rank == 1 + int((expected[t] > expected[t, prompt[t + 1]] + 1e-9).sum())


def test_prompt_logprobs_with_generation_and_cumulative_logprob(model, tok):
    engine = Engine(model, tok)
    out = run(engine, [(PROMPTS[1], SamplingParams(max_tokens=5, temperature=0, logprobs=0, prompt_logprobs=0))])[0]
    firsts = [o for o in out[2] if o.prompt_logprobs is not None]
    assert len(firsts) == 1 and len(firsts[0].prompt_logprobs) == len(PROMPTS[1])
    lps = [t.logprob for o in out[2] for t in o.logprobs]
    assert out[2][-1].cumulative_logprob == pytest.approx(sum(lps), abs=1e-5)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 15), max_size=12), st.lists(st.integers(0, 15), max_size=6),
       st.floats(0.3, 3.0), st.floats(-2, 2), st.floats(-2, 2), st.integers(0, 3))
def test_process_equals_the_formulas(prompt, output, rep, pres, freq, min_tokens):
    row = torch.randn(16, generator=torch.Generator().manual_seed(len(prompt) * 31 + len(output)))
    params = SamplingParams(max_tokens=8, repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq,
                            min_tokens=min_tokens, stop_token_ids=(2,), logit_bias=((5, 1.5),))
    got = process(row, params, prompt, output)
    want = row.double().tolist()
    want[5] += 1.5
    for t in set(prompt) | set(output):
        want[t] = want[t] / rep if want[t] > 0 else want[t] * rep
    for t in set(output):
        want[t] -= freq * output.count(t) + pres
    if len(output) < min_tokens:
        want[2] = -math.inf
    assert got.tolist() == pytest.approx(want, abs=1e-5)
