"""Speculative decoding at the edges users reach (issue 36): the context limit, a padded vocabulary and non-finite
logits on the verification path, each against plain decoding of the same request."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import serving
from k3 import K3ForCausalLM
from k3.config import preset
from k3.serve.engine import Engine, SamplingParams
from k3.serve.engine.drafting import Draft, ModelDrafter
from k3.serve.engine.request import new_request
from k3.serve.engine.sampler import Sampler

PADDED = 8  # model ids past the tokenizer's 512


def run(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple[list[int], str, str | None]:
    tokens, reason, error = [], None, None
    for output in engine.generate(prompt, params):
        tokens += output.token_ids
        reason, error = output.finish_reason, output.error
    return tokens, reason, error


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_run_that_reaches_the_context_limit_emits_every_token(model, tok, temperature):
    """max_tokens fills the context exactly (what a chat completion without max_tokens asks for): every drafted
    token is accepted (the draft is the target), and the request still ends at the limit, not γ tokens early."""
    prompt, limit = serving.prompts()[2], 40
    params = SamplingParams(max_tokens=limit - len(prompt), temperature=temperature, seed=3)
    plain = run(Engine(model, tok, max_model_len=limit), prompt, params)
    spec = Engine(model, tok, max_model_len=limit, drafter=ModelDrafter(serving.model()), num_draft_tokens=4,
                  adaptive_draft=False)
    got = run(spec, prompt, params)
    assert len(got[0]) == len(plain[0]) == limit - len(prompt) and got[1] == plain[1] == "length"
    assert got == plain or temperature > 0  # sampled runs draw their uniforms differently: equal in distribution
    assert spec.speculation["accepted"] > 0


def padded_model(favourite: int) -> K3ForCausalLM:
    """``tiny`` with a vocabulary 8 ids wider than the tokenizer's, whose logits favour ``favourite`` (an id the
    tokenizer cannot decode) at every position."""
    torch.manual_seed(0)
    m = K3ForCausalLM(dataclasses.replace(preset("tiny"), vocab_size=serving.VOCAB + PADDED)).eval()
    bias = torch.zeros(serving.VOCAB + PADDED)
    bias[favourite] = 1e3
    m.lm_head.register_forward_hook(lambda module, args, out: out + bias)
    return m


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_ids_past_the_tokenizer_are_never_verified_into_the_output(tok, temperature):
    """The draft (the same padded model) proposes the padded id every time; verification masks it as plain
    sampling does, so the request gives plain decoding's tokens instead of failing on an id out of range."""
    target = padded_model(serving.VOCAB + 3)
    prompt, params = serving.prompts()[3], SamplingParams(max_tokens=12, temperature=temperature, seed=1)
    plain = run(Engine(target, tok), prompt, params)
    spec = Engine(target, tok, drafter=ModelDrafter(padded_model(serving.VOCAB + 3)), num_draft_tokens=3,
                  adaptive_draft=False)
    got = run(spec, prompt, params)
    assert (got == plain or temperature > 0) and got[1] == plain[1] == "length" and max(got[0]) < serving.VOCAB
    assert spec.speculation["drafted"] > 0


class _Verified:
    """A verified run's state: what `Sampler.verify` hands ``accept``."""

    def accept(self, n: int) -> int:
        return n


def verify(logits: torch.Tensor, draft: list[int], temperature: float = 0.0):
    request = new_request([1, 2, 3], SamplingParams(max_tokens=10, temperature=temperature, seed=0), None, None,
                          "r", "r", serving.tokenizer(), logits.shape[1], 100)
    q = torch.zeros(len(draft), logits.shape[1], dtype=torch.float64)
    q[torch.arange(len(draft)), torch.tensor(draft, dtype=torch.long)] = 1.0
    return Sampler(logits.shape[1]).verify(request, logits, _Verified(), Draft(draft, q))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_non_finite_row_fails_the_request_only_where_plain_sampling_reaches_it(temperature):
    """Row 2 is NaN. Drafts that the target rejects before it never need that row (plain decoding would never
    have computed it); drafts accepted up to it need it, and the request fails as plain sampling would."""
    logits = torch.full((4, serving.VOCAB), -30.0)
    logits[0, 10] = logits[1, 11] = logits[3, 13] = 30.0  # the target's near-certain choices
    logits[2] = float("nan")
    tokens, n, _ = verify(logits, [10, 99, 12], temperature)  # d_2 rejected at row 1: row 2 unused
    assert tokens == [10, 11] and n == 2
    with pytest.raises(FloatingPointError):
        verify(logits, [10, 11, 12], temperature)  # d_1, d_2 accepted: row 2 must give the next token
    with pytest.raises(FloatingPointError):
        verify(logits[2:3], [], temperature)


class _FirstRowPoisoned(serving.Cycling):
    """`serving.Cycling` whose verification groups of several rows give NaN logits at every position of row 0."""

    def forward_groups(self, groups, full=None, replay=None):
        results = super().forward_groups(groups, full, replay)
        for (ids, _), (logits, _), every in zip(groups, results, full or [False] * len(groups)):
            if every and ids.shape[0] > 1:
                logits[:ids.shape[1]] = float("nan")
        return results


def test_a_run_that_fails_to_verify_ends_only_its_own_request(tok):
    """Two requests verified in one group, the first row's logits NaN: that request ends with an error and the other
    keeps plain decoding's tokens (its row of the group's state is accepted beside the failed one)."""
    from k3.serve.engine.ngram import NGramDrafter

    model = _FirstRowPoisoned()
    prompts = [serving.prompts()[3] + serving.CYCLE * 2, serving.prompts()[4] + serving.CYCLE * 2]
    params = SamplingParams(max_tokens=24, temperature=0)
    engine = Engine(model, tok, drafter=NGramDrafter(), num_draft_tokens=4,
                    adaptive_draft=False)
    outputs: dict[int, list] = {0: [], 1: []}
    engine.add_requests([(p, params, None, outputs[i].append) for i, p in enumerate(prompts)])
    while engine.has_work():
        engine.step()
    ends = {i: (o[-1].finish_reason, [t for x in o for t in x.token_ids]) for i, o in outputs.items()}
    assert sorted(reason for reason, _ in ends.values()) == ["error", "length"]
    survivor = next(i for i, (reason, _) in ends.items() if reason == "length")
    plain = [t for o in Engine(serving.Cycling(), tok).generate(prompts[survivor], params) for t in o.token_ids]
    assert ends[survivor][1] == plain and engine.speculation["accepted"] > 8
