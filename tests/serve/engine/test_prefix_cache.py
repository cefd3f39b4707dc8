"""The KDA-aware prefix cache (issue 13): cache on equals cache off, checkpoints equal full prefills, lookup picks
the longest boundary with a checkpoint, pins return to zero, aborted prefills leave nothing half-written."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import serving
from k3.model.sequence.kda import KDAState
from k3.serve.engine.cache import PrefixCache
from k3.serve.engine import Engine, SamplingParams

BLOCK = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0, logprobs=0)


def new_cache(model, budget: int = 64 * 2**20, every: int = 2) -> PrefixCache:
    return PrefixCache(model.config.layer_kinds(), budget, block_tokens=BLOCK, checkpoint_every=every)


def run(engine: Engine, jobs: list[tuple[list[int], SamplingParams]]) -> list[tuple[list[int], list[float], int]]:
    """Run ``jobs`` together; per job (tokens, logprobs, cached tokens)."""
    out = [([], [], 0) for _ in jobs]

    def callback(i):
        def push(o):
            out[i][0].extend(o.token_ids)
            out[i][1].extend(t.logprob for t in o.logprobs)
            out[i] = (out[i][0], out[i][1], o.cached_tokens)
        return push

    engine.add_requests([(p, q, None, callback(i)) for i, (p, q) in enumerate(jobs)])
    while engine.has_work():
        engine.step()
    return out


def full_prefill(model, tokens: list[int], cuts: list[int]):
    """The state after ``tokens``, prefilled in the engine's chunks (cut at ``cuts``)."""
    state, start = model.new_state(1), 0
    with torch.no_grad():
        for end in [c for c in cuts if c < len(tokens)] + [len(tokens)]:
            _, state = model(torch.tensor([tokens[start:end]]), state=state)
            start = end
    return state


def words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(12, serving.VOCAB) for _ in range(n)]


# ---------------------------------------------------------------------------------------------- equivalence
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 10**6), st.sampled_from([0, 40_000, 400_000, 64 * 2**20]), st.booleans())
def test_cache_on_equals_cache_off_over_conversation_trees(model, tok, seed, budget, concurrent):
    """Branching multi-turn histories (a shared system prompt, turns appended, branches forking from earlier
    turns), budgets that force eviction, requests run one by one or together: same greedy tokens, same logprobs."""
    rng = random.Random(seed)
    root = words(rng, rng.randrange(5, 60))
    conversations = [root]
    for _ in range(rng.randrange(3, 7)):
        parent = rng.choice(conversations)
        conversations.append(parent + words(rng, rng.randrange(3, 30)))
    jobs = [(c, GREEDY) for c in conversations]
    cache = new_cache(model, budget)
    on, off = Engine(model, tok, prefix_cache=cache), Engine(model, tok)
    got = run(on, jobs) if concurrent else [run(on, [job])[0] for job in jobs]
    want = [run(off, [job])[0] for job in jobs]
    for (tokens, logprobs, _), (tokens_, logprobs_, _) in zip(got, want, strict=True):
        assert tokens == tokens_
        assert logprobs == pytest.approx(logprobs_, abs=1e-4)
    assert cache.pinned() == 0 and cache.bytes_used <= budget


def test_multi_turn_reuse_grows(model, tok):
    """Each turn resumes exactly where the previous turn's state stood: its prompt and answer but the answer's last
    token (sampled, never fed), mostly inside a block (a tail checkpoint)."""
    rng = random.Random(1)
    cache = new_cache(model)
    engine, history, cached, consumed = Engine(model, tok, prefix_cache=cache), words(rng, 40), [], [0]
    for _ in range(5):
        history = history + words(rng, 20)
        tokens, _, hit = run(engine, [(history, GREEDY)])[0]
        cached.append(hit)
        history = history + tokens
        consumed.append(len(history) - 1)
    assert cached == consumed[:-1]
    assert any(hit % BLOCK for hit in cached)


# ---------------------------------------------------------------------------------------------- checkpoints
def test_a_checkpoint_equals_a_full_prefill_tensor_by_tensor(model, tok):
    rng = random.Random(2)
    prompt = words(rng, 90)
    cache = new_cache(model)
    run(Engine(model, tok, prefix_cache=cache), [(prompt, GREEDY)])
    cuts = cache.cuts(len(prompt), max_tokens=GREEDY.max_tokens)
    assert cuts == [32, 64, 80]
    for boundary in cuts:
        hit = cache.lookup(prompt[:boundary + 1])
        assert hit.length == boundary
        want = full_prefill(model, prompt[:boundary], cuts)
        for got_layer, want_layer in zip(hit.state.layers, want.layers, strict=True):
            for name in ("conv", "recurrent") if isinstance(got_layer, KDAState) else ("latent", "shared_key"):
                torch.testing.assert_close(getattr(got_layer, name), getattr(want_layer, name), rtol=0, atol=1e-5)
        cache.release(hit.keys)
    assert cache.pinned() == 0


def test_a_tail_checkpoint_equals_a_full_prefill_tensor_by_tensor(model):
    """Checkpoints inside blocks (tails after the root, after block 1 and after block 3): a lookup resumes at the
    furthest one that its prompt matches, with every layer's state as a prefill of that prefix leaves it."""
    rng = random.Random(4)
    tokens = words(rng, 80)
    cache = new_cache(model, every=4)
    states = {n: full_prefill(model, tokens[:n], []) for n in (9, 20, 27, 61)}
    for n, state in states.items():
        assert cache.insert(tokens[:n], state) is not None
    for prompt_end, want in [(10, 9), (9, 0), (21, 20), (27, 20), (28, 27), (62, 61), (80, 61)]:
        hit = cache.lookup(tokens[:prompt_end])
        if want == 0:
            assert hit is None or hit.length == 0
            continue
        assert hit.length == hit.state.position == want
        for got_layer, want_layer in zip(hit.state.layers, states[want].layers, strict=True):
            for name in ("conv", "recurrent") if isinstance(got_layer, KDAState) else ("latent", "shared_key"):
                torch.testing.assert_close(getattr(got_layer, name), getattr(want_layer, name), rtol=0, atol=1e-5)
        cache.release(hit.keys)
    changed = tokens[:25] + [(tokens[25] + 1) % serving.VOCAB] + tokens[26:40]  # inside the 27-token tail
    hit = cache.lookup(changed)
    assert hit.length == 20
    cache.release(hit.keys)
    other = new_cache(model, every=4)
    other.insert(tokens[:20], states[20])
    assert other.lookup(tokens[:30], salt="another user") is None
    assert cache.pinned() == 0


def test_an_evicted_tail_leaves_its_siblings_findable(model):
    """Two tails of the same length after the same boundary (different tokens): evicting one (least recently used)
    keeps the other reachable, and the cache's bytes and entries return to what the survivor holds."""
    rng = random.Random(5)
    head = words(rng, 16)
    a, b = head + words(rng, 5), head + words(rng, 5)
    probe = PrefixCache(model.config.layer_kinds(), 2**30, block_tokens=BLOCK)
    probe.insert(a, full_prefill(model, a, []))
    one_tail = probe.bytes_used
    probe.insert(b, full_prefill(model, b, []))
    tail_bytes = probe.bytes_used - one_tail
    cache = PrefixCache(model.config.layer_kinds(), one_tail + tail_bytes // 2, block_tokens=BLOCK)
    cache.insert(a, full_prefill(model, a, []))
    cache.insert(b, full_prefill(model, b, []))  # over budget: a's tail (least recently used) goes
    assert cache.stats.evictions == 1 and cache.bytes_used == one_tail
    miss = cache.lookup(a + [1])  # its page still matches; nothing resumes there
    assert miss.length == 0 and miss.state is None
    hit = cache.lookup(b + [1])
    assert hit.length == len(b)
    cache.release(hit.keys)


def test_lookup_resumes_at_the_longest_boundary_with_a_checkpoint(model):
    """SPEC §8's example scaled (block 16 instead of 512): 176 matching tokens, checkpoints at 64 and 128 only →
    the request resumes at 128; a prefix diverging mid-block matches up to the block before; a prompt shorter than
    a block, or differing in the first block, misses."""
    rng = random.Random(3)
    tokens = words(rng, 200)
    cache = new_cache(model, every=4)
    states = {b: full_prefill(model, tokens[:b], [64, 128]) for b in (64, 128, 176)}
    cache.insert(tokens[:64], states[64])
    cache.insert(tokens[:128], states[128])
    cache.insert(tokens[:176], states[176], checkpoint=False)  # pages only: the checkpoint at 176 is gone
    hit = cache.lookup(tokens[:190])
    assert hit.length == 128 and hit.state.position == 128
    cache.release(hit.keys)
    diverged = tokens[:70] + [(tokens[70] + 1) % serving.VOCAB] + tokens[71:190]
    hit = cache.lookup(diverged)
    assert hit.length == 64
    cache.release(hit.keys)
    assert cache.lookup(tokens[:10]) is None
    assert cache.lookup([(tokens[0] + 1) % serving.VOCAB] + tokens[1:190]) is None
    assert cache.lookup(tokens[:190], salt="someone else") is None
    assert cache.pinned() == 0


def test_eviction_frees_unpinned_entries_and_keeps_chains_from_the_front(model):
    rng = random.Random(4)
    tokens = words(rng, 130)
    cache = new_cache(model, budget=10**9)
    state = full_prefill(model, tokens[:128], [64])
    cache.insert(tokens[:128], state)
    pages = [e for k, e in cache._entries.items() if k[0] == "page"]
    checkpoint = next(e.nbytes for k, e in cache._entries.items() if k[0] == "checkpoint")
    assert len(pages) == 2 and [len(p.slots) for p in pages] == [4, 4]  # 8 blocks in 2 physical pages of 4
    hit = cache.lookup(tokens)
    cache.budget = pages[0].nbytes + checkpoint  # room for one page: the later one goes first
    cache.release(hit.keys)
    assert cache.bytes_used <= cache.budget and cache.stats.evictions == 1
    assert cache.lookup(tokens).state is None  # the pages match, but nothing is left to resume from
    cache.budget = 0
    cache.release([])
    assert len(cache) == 0 and cache.bytes_used == 0


def test_pages_are_physical_allocations_shared_until_a_chain_diverges(model):
    """A page holds 4 hash blocks of one chain and is charged whole; a chain diverging inside it continues in a
    page of its own while the shared blocks stay where they are."""
    rng = random.Random(7)
    tokens = words(rng, 100)
    other = tokens[:40] + words(rng, 60)  # shares blocks 0-1, diverges in block 2 (inside page 0)
    cache = new_cache(model)
    cache.insert(tokens[:64], full_prefill(model, tokens[:64], [32]))
    charged = cache.bytes_used
    cache.insert(other[:64], full_prefill(model, other[:64], [32]))
    pages = {k: e for k, e in cache._entries.items() if k[0] == "page"}
    assert len(pages) == 2 and sorted(len(e.slots) for e in pages.values()) == [2, 4]
    page = next(iter(pages.values())).nbytes
    assert {e.nbytes for e in pages.values()} == {page}  # a partly used page costs a whole page
    checkpoint = next(e.nbytes for k, e in cache._entries.items() if k[0] == "checkpoint")
    assert cache.bytes_used - charged == page + checkpoint  # the diverging chain: one new page, one checkpoint
    for prompt in (tokens[:70], other[:70]):
        hit = cache.lookup(prompt)
        assert hit.length == 64
        want = full_prefill(model, prompt[:64], [32])
        for got, ref in zip(hit.state.layers, want.layers, strict=True):
            if not isinstance(got, KDAState):
                torch.testing.assert_close(got.latent, ref.latent, rtol=0, atol=1e-5)
        cache.release(hit.keys)
    assert cache.pinned() == 0


# ---------------------------------------------------------------------------------------------- pins and aborts
def test_pins_return_to_zero_after_finish_and_abort(model, tok):
    rng = random.Random(5)
    prompt = words(rng, 70)
    cache = new_cache(model)
    engine = Engine(model, tok, prefix_cache=cache, prefill_chunk=16)
    run(engine, [(prompt, GREEDY)])
    rid = engine.add_request(prompt + words(rng, 5), SamplingParams(max_tokens=50, temperature=0))
    engine.step()
    assert cache.pinned() > 0  # the running request holds its hit
    engine.abort(rid)
    assert cache.pinned() == 0


def test_an_aborted_prefill_leaves_only_complete_boundaries(model, tok):
    rng = random.Random(6)
    prompt = words(rng, 100)
    cache = new_cache(model)
    engine = Engine(model, tok, prefix_cache=cache, prefill_chunk=16)
    engine.scheduler.idle_prefill = 40
    rid = engine.add_request(prompt, GREEDY)
    engine.step()  # a piece of 40 of 100 tokens passes the cut at 32: its checkpoint is rolled back from the piece
    assert engine.running[rid].prefilled == 40
    engine.abort(rid)
    hit = cache.lookup(prompt)
    assert hit.length == 32
    want = full_prefill(model, prompt[:32], cache.cuts(len(prompt), max_tokens=GREEDY.max_tokens))
    torch.testing.assert_close(hit.state.layers[0].recurrent, want.layers[0].recurrent, rtol=0, atol=1e-5)
    cache.release(hit.keys)
    assert cache.pinned() == 0 and cache.stats.checkpoints_added == 1


def test_sizes_count_a_tail_checkpoints_recurrent_part(model):
    """`sizes` reports a KDA checkpoint's bytes — every KDA layer's window and state and the depth sources — also
    when the cache holds only tail checkpoints (whose MLA rows are not part of it)."""
    rng = random.Random(6)
    tokens = words(rng, 40)  # two blocks (a page) and a tail of 8
    state = full_prefill(model, tokens, [])
    cache = new_cache(model)
    cache.insert(tokens, state)
    want = sum(t.numel() * t.element_size() for layer in state.layers if isinstance(layer, KDAState)
               for t in (layer.conv, layer.recurrent)) + state.depth.numel() * state.depth.element_size()
    assert cache.sizes()["kda_checkpoint_bytes"] == want
