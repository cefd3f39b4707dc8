"""The prefix cache at the CLI defaults (issue 36: block 64, a checkpoint every 8 blocks, pages of 4 blocks, prefill
chunk 64): shared prefixes shorter than a checkpoint interval are reused, a conversation's next turn resumes after
the previous answer, a first turn makes no extra model call, a chat's shared head is checkpointed, and an EAGLE
draft resumes with the target. Every output equals the cache-off engine's."""

from __future__ import annotations

import random

import pytest
import torch

import serving
from k3.model.draft import DraftConfig, EagleDraft
from k3.model.sequence.kda import KDAState
from k3.model.state import DecoderState
from k3.serve.engine import Engine, SamplingParams
from k3.serve.engine.cache import PrefixCache
from k3.serve.engine.drafting import EagleDrafter
from k3.serve.options import EngineOptions

BLOCK = EngineOptions.cache_block_tokens


def engine(model, tok, cache: bool = True, **kwargs) -> Engine:
    """The engine of the CLI's defaults (`EngineOptions`); with ``kwargs``, an `Engine` of them with the defaults'
    prefill chunk and prefix cache."""
    options = EngineOptions(prefix_cache=cache, prefix_cache_gb=0.25)
    if not kwargs:
        return options.build(model, tok)
    prefix_cache = PrefixCache.for_model(model, tok, 2**28, options.cache_block_tokens, options.cache_checkpoint_every,
                                         options.cache_page_blocks) if cache else None
    return Engine(model, tok, prefill_chunk=options.prefill_chunk, prefix_cache=prefix_cache, **kwargs)


def words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(12, serving.VOCAB) for _ in range(n)]


def run(e: Engine, prompts: list[list[int]], max_tokens: int = 8) -> list[tuple[list[int], int]]:
    """Run ``prompts`` together (greedy); per prompt (tokens, cached prompt tokens)."""
    out: list[tuple[list[int], int]] = [([], 0) for _ in prompts]

    def callback(i):
        def push(o):
            out[i] = (out[i][0] + o.token_ids, o.cached_tokens)
        return push

    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    e.add_requests([(p, params, None, callback(i)) for i, p in enumerate(prompts)])
    while e.has_work():
        e.step()
    return out


@pytest.mark.parametrize("blocks", range(1, 9))
def test_a_shared_prefix_of_1_to_8_blocks_is_reused(model, tok, blocks):
    """Three concurrent requests share ``blocks`` blocks and a few tokens more, then diverge: none can hit (nothing
    is cached yet), but their pages are (their answers pass a block boundary, so they cut nowhere else). The next
    request matches those pages past its last checkpoint and cuts its prefill at that frontier; from then on every
    request sharing the prefix resumes there."""
    rng = random.Random(blocks)
    shared = words(rng, blocks * BLOCK + 20)
    prompts = [shared + words(rng, 30 + 7 * i) for i in range(6)]
    lengths = [70] * 3 + [8] * 3
    on, off = engine(model, tok), engine(model, tok, cache=False)
    try:
        got = run(on, prompts[:3], 70) + run(on, prompts[3:4]) + run(on, prompts[4:])
        want = [run(off, [p], n)[0] for p, n in zip(prompts, lengths)]
    finally:
        on.stop()
        off.stop()
    assert [t for t, _ in got] == [t for t, _ in want]
    assert [c for _, c in got[:3]] == [0, 0, 0]
    assert got[3][1] == (BLOCK * 8 if blocks == 8 else 0)  # only a checkpoint-interval boundary existed
    assert [c for _, c in got[4:]] == [blocks * BLOCK] * 2
    assert on.prefix_cache.pinned() == 0


def test_each_turn_resumes_after_the_previous_answer(model, tok):
    """Turn n + 1 = turn n's prompt, its answer and a new message: it resumes exactly where turn n's state stood
    (its answer but the last token, which is sampled and never fed), mostly inside a block (a tail checkpoint)."""
    rng = random.Random(11)
    history = words(rng, 150)
    on, off = engine(model, tok), engine(model, tok, cache=False)
    reached = 0
    try:
        for turn, max_tokens in enumerate([70, 8, 90, 5, 40]):
            [(tokens, cached)] = run(on, [history], max_tokens)
            assert tokens == run(off, [history], max_tokens)[0][0]
            assert cached == reached, f"turn {turn}"
            reached = len(history) + len(tokens) - 1  # what the state consumed: the last token is never fed
            history = history + tokens + words(rng, 25)
    finally:
        on.stop()
        off.stop()


def test_a_boundary_kept_while_decoding_holds_neither_the_batch_nor_the_context(model, tok):
    """What a request keeps of the last block boundary it passed (for its finish) is its own copy of the KDA states
    and depth sources: not a view of the stacked batch, and no MLA cache."""
    rng = random.Random(15)
    e = engine(model, tok)
    params = SamplingParams(max_tokens=60, temperature=0)
    e.add_requests([(words(rng, 40 + 10 * i), params, None, None) for i in range(3)])
    seen = 0
    try:
        while e.has_work():
            e.step()
            for request in e.running.values():
                if request.boundary is None:
                    continue
                seen += 1
                for layer in request.boundary.layers:
                    for t in (layer.conv, layer.recurrent) if isinstance(layer, KDAState) else (layer.latent,):
                        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
                        assert isinstance(layer, KDAState) or t.shape[1] == 0
    finally:
        e.stop()
    assert seen > 0


def test_a_first_turn_makes_no_extra_model_call(model, tok, monkeypatch):
    """With nothing due (no checkpoint interval, no mark, decoding passes a block boundary), the cache only records:
    the prompt is read in as many model calls as without the cache."""
    rng = random.Random(12)
    prompt = words(rng, 300)
    calls = []
    forward_groups = model.forward_groups
    monkeypatch.setattr(model, "forward_groups", lambda *a, **k: calls.append(1) or forward_groups(*a, **k))
    counts = []
    for cache in (False, True):
        e = engine(model, tok, cache=cache)
        try:
            calls.clear()
            run(e, [prompt], max_tokens=40)
            counts.append(len(calls))
        finally:
            e.stop()
    assert counts[0] == counts[1]


def test_due_checkpoints_cost_no_model_call_of_their_own(model, tok, monkeypatch):
    """A prompt read in one piece past its cuts — a mark (40), the checkpoint interval (512) and its last block
    boundary (640) — takes as many model calls as without the cache: each checkpoint is rolled back from the piece
    (`DecoderState.prefix`). Later prompts resume at each, with the cache-off engine's outputs."""
    rng = random.Random(13)
    prompt = words(rng, 700)
    calls = []
    forward_groups = model.forward_groups
    monkeypatch.setattr(model, "forward_groups", lambda *a, **k: calls.append(1) or forward_groups(*a, **k))
    on, off = engine(model, tok), engine(model, tok, cache=False)
    params = SamplingParams(max_tokens=3, temperature=0)  # decoding will not reach 704: 640 is due
    try:
        counts = []
        for e in (off, on):
            calls.clear()
            e.add_requests([(prompt, params, None, None)], marks=(40,))
            while e.has_work():
                e.step()
            counts.append(len(calls))
        assert counts[0] == counts[1] == 1 + 2  # one prefill call, then a decode step per further token
        later = [prompt[:n] + words(rng, 9) for n in (45, 600, 690)]
        got, want = run(on, later), [run(off, [p])[0] for p in later]
    finally:
        on.stop()
        off.stop()
    assert [t for t, _ in got] == [t for t, _ in want]
    assert [c for _, c in got] == [40, 512, 640]


@pytest.mark.parametrize("length", [40, 300])
def test_a_marked_head_is_checkpointed_for_the_next_conversation(model, tok, length):
    """A chat's shared head (its system messages, `k3.chat.shared_head`) is a mark: the first conversation
    checkpoints it exactly (inside a block: a tail checkpoint; shorter than a block too), and a second
    conversation's first turn resumes there and answers as without the cache."""
    rng = random.Random(13)
    head = words(rng, length)
    first, second = head + words(rng, 40), head + words(rng, 50)
    e = engine(model, tok)
    try:
        params = SamplingParams(max_tokens=80, temperature=0)
        for prompt in (first, second):
            out = list(e.generate(prompt, params)) if prompt is second else None
            if out is None:
                e.add_requests([(prompt, params, None, None)], marks=(len(head),))
                while e.has_work():
                    e.step()
        assert out[-1].cached_tokens == len(head)
        assert [t for o in out for t in o.token_ids] == run(engine(model, tok, cache=False), [second], 80)[0][0]
    finally:
        e.stop()


Recording = serving.recording(EagleDrafter)  # an EAGLE drafter that keeps every proposal


def eagle_engine(model, tok, layer_kind: str) -> tuple[EagleDraft, Recording, Engine]:
    """An untrained EAGLE draft (seed 0), its recording drafter, and a cache-on engine drafting 3 tokens with it."""
    torch.manual_seed(0)
    draft = EagleDraft(model, DraftConfig(layer_kind=layer_kind))
    on = Recording(draft)
    return draft, on, engine(model, tok, drafter=on, num_draft_tokens=3, adaptive_draft=False)


def assert_proposed_as_without_cache(model, tok, draft: EagleDraft, prompt: list[int], tokens: list[int],
                                     on: Recording) -> None:
    """A cache-off engine with ``draft`` gives ``prompt`` the same 12 tokens and proposals as ``on`` recorded."""
    off = Recording(draft)
    [(tokens_off, _)] = run(Engine(model, tok, drafter=off, num_draft_tokens=3, adaptive_draft=False), [prompt],
                            max_tokens=12)
    assert tokens == tokens_off
    assert len(on.proposals) == len(off.proposals) > 0
    for a, b in zip(on.proposals, off.proposals, strict=True):
        assert a.tokens == b.tokens
        torch.testing.assert_close(a.q, b.q, atol=1e-5, rtol=0)


def test_an_eagle_draft_resumes_with_the_target_after_a_cache_hit(model, tok):
    """The target skips the positions a hit restores; the draft restores its own state of that checkpoint, so it
    proposes exactly what it proposes without the cache (before: it had read only the positions after the hit)."""
    rng = random.Random(14)
    prompt = words(rng, 200)
    draft, on, with_cache = eagle_engine(model, tok, "mla")
    run(with_cache, [prompt + words(rng, 30)], max_tokens=4)  # leaves a checkpoint at 192 (prompt's last boundary)
    on.proposals.clear()
    [(tokens, cached)] = run(with_cache, [prompt + [5]], max_tokens=12)
    assert cached == 192
    assert_proposed_as_without_cache(model, tok, draft, prompt + [5], tokens, on)


def test_an_eagle_draft_resumes_after_the_previous_answer(model, tok):
    """A finished turn checkpoints where its state stands, and the draft keeps its own state beside it: the next
    turn's draft proposes exactly what it proposes without the cache (before: it had read only the new message)."""
    rng = random.Random(15)
    prompt = words(rng, 100)
    draft, on, with_cache = eagle_engine(model, tok, "kda")
    [(answer, _)] = run(with_cache, [prompt], max_tokens=9)
    on.proposals.clear()
    turn = prompt + answer + words(rng, 5)
    [(tokens, cached)] = run(with_cache, [turn], max_tokens=12)
    assert cached == len(prompt) + len(answer) - 1
    assert_proposed_as_without_cache(model, tok, draft, turn, tokens, on)


def test_decoding_rows_keep_their_stacked_batch_with_the_cache_on(model, tok, monkeypatch):
    """Recording states (and rolling checkpoints back) leaves decode states as the pass returned them, so the runner
    continues its stacked batch instead of stacking (copying every MLA cache) at every step."""
    rng = random.Random(16)
    stacks = []
    stack = DecoderState.stack.__func__
    monkeypatch.setattr(DecoderState, "stack", classmethod(lambda cls, states: stacks.append(1) or stack(cls, states)))
    e = engine(model, tok)
    try:
        run(e, [words(rng, 30 + 7 * i) for i in range(3)], max_tokens=20)
    finally:
        e.stop()
    assert len(stacks) <= 3  # the batch forms (after each prefill), never once per step
