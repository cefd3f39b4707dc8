"""The compiled steps (`k3.model.compiled`, issue 18) against eager: the same greedy tokens and logits within fp32
reassociation (stated: 1e-4 absolute on logits of magnitude ~1) for chunked prefill, decode, the serving engine's
mixed steps with requests joining and leaving and a QAT/MX model; a graph per shape key and never another after
warm-up; and ``k3 generate --compile`` giving eager's text while the plain command imports no compiler. Frozen
weights that change and packed experts: `test_compiled_weights.py`."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

import serving
from compiled_steps import LOGIT_TOLERANCE, generate_both
from k3 import K3ForCausalLM
from k3.config import preset
from k3.model.compiled import CompiledModel, pieces
from k3.model.sequence.mla import MLACache
from k3.model.state import DecoderState

def test_pieces_are_bucket_lengths_largest_first():
    assert pieces(37) == [16, 16, 4, 1] and pieces(64) == [64] and pieces(130) == [64, 64, 1, 1] and pieces(0) == []
    assert pieces(7, (4, 1)) == [4, 1, 1, 1]
    with pytest.raises(ValueError, match="sizes must hold 1"):
        CompiledModel(serving.model(), sizes=(16, 4))


def test_compiled_prefill_and_decode_equal_eager_with_one_graph_per_shape_key():
    model = serving.model()
    compiled = CompiledModel(model, tuned=False)
    text = serving.prompts()[5]  # 120 tokens
    eager, fast, worst = generate_both(model, compiled, torch.tensor([text[:21]]), steps=10)  # 16 + 4 + 1
    assert fast == eager and worst < LOGIT_TOLERANCE
    # a 16-piece on an empty cache, a 4-piece on a cache, one-token steps on a cache of any length (it grows)
    assert compiled.compilations == 3
    eager, fast, worst = generate_both(model, compiled, torch.tensor([text[40:77]]), steps=4)  # 16 + 16 + 4 + 1
    assert fast == eager and worst < LOGIT_TOLERANCE
    assert compiled.compilations == 4  # only the 16-piece on a non-empty cache is new
    generate_both(model, compiled, torch.tensor([text[1:38]]), steps=3)
    assert compiled.compilations == 4  # warm: no graph however the lengths vary
    pair = torch.tensor([text[:9], text[50:59]])  # 4 + 4 + 1 on two rows; decode at batch 2
    eager, fast, worst = generate_both(model, compiled, pair, steps=4)
    assert fast == eager and worst < LOGIT_TOLERANCE
    assert compiled.compilations == len(compiled.compile_seconds)  # every graph built once, for its own key
    with pytest.raises(ValueError, match="token ids"):
        compiled(torch.tensor([[10**6]]), model.new_state(1))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        compiled.decode_step(torch.zeros(1, 1, 3), model.new_state(1))


@pytest.mark.parametrize("inference_first", [False, True])
def test_a_state_made_in_one_grad_mode_decodes_on_warm_graphs_in_the_other(inference_first):
    """A state (and ids) made under ``no_grad`` decodes inside ``torch.inference_mode()``, and one made inside it
    decodes under ``no_grad``: each step's inputs are the mode's own kind of tensor, so a warm graph's guards hold.
    Before, the second step failed ("Recompilation triggered with skip_guard_eval_unsafe"): its inputs were
    inference tensors where the graph had been traced on normal ones, or the other way round."""
    model = serving.model()
    compiled = CompiledModel(model, tuned=False)
    prompt = torch.tensor([serving.prompts()[5][:12]])
    made, stepped = ((torch.inference_mode, torch.no_grad) if inference_first else
                     (torch.no_grad, torch.inference_mode))
    with made():
        logits, state = model(prompt, state=model.new_state(1))
        token = logits[:, -1].argmax(-1, keepdim=True)
    eager = state
    with stepped():
        for _ in range(4):
            (fast, state), (slow, eager) = compiled.decode(token, state), model(token, state=eager)
            assert float((fast - slow).abs().max()) < LOGIT_TOLERANCE
            token = slow[:, -1].argmax(-1, keepdim=True)
    assert compiled.compilations == 1 and compiled.eager_calls == 0


def test_a_changed_thread_count_runs_a_graph_of_its_own():
    """dynamo guards on the thread count (its global state): a warm step after ``torch.set_num_threads`` raised
    "Recompilation triggered with skip_guard_eval_unsafe" until the count joined the shape key."""
    model = serving.model()
    compiled = CompiledModel(model, sizes=(4, 1), tuned=False)
    prompt = torch.tensor([serving.prompts()[2][:5]])
    threads = torch.get_num_threads()
    try:
        for count in (threads, 1, threads):
            torch.set_num_threads(count)
            eager, fast, worst = generate_both(model, compiled, prompt, steps=3)
            assert fast == eager and worst < LOGIT_TOLERANCE
    finally:
        torch.set_num_threads(threads)
    assert compiled.compilations == (4 if threads > 1 else 2)  # a 4-piece and a decode step per thread count


def test_a_thread_at_dynamos_default_recompile_limit_still_builds_a_graph_per_shape_key():
    """dynamo's recompile limit is per thread: a background thread compiled under the default (8) although the
    constructor had raised it, and past 8 graphs of `CompiledStep.eager` in the process (every instance's count)
    its step silently ran eagerly, was marked built and later picked another instance's graph (stop 51's CI). Here
    the thread's limit is 1: each shape key still gets its own graph, and the tokens are eager's."""
    model = serving.model()
    compiled = CompiledModel(model, sizes=(4, 1), tuned=False)
    prompt = torch.tensor([serving.prompts()[2][:5]])
    with torch._dynamo.config.patch(recompile_limit=1, accumulated_recompile_limit=1):
        eager, fast, worst = generate_both(model, compiled, prompt, steps=3)
    assert fast == eager and worst < LOGIT_TOLERANCE
    assert compiled.compilations == 2  # the 4-piece on an empty cache, then decode steps on a cache


@pytest.mark.slow
def test_compiled_decode_of_a_qat_model_equals_eager():
    from k3.train.pretrain import QAT_MX

    config = dataclasses.replace(preset("tiny"), mx=dataclasses.replace(QAT_MX))
    torch.manual_seed(0)
    model = K3ForCausalLM(config).eval()
    eager, fast, worst = generate_both(model, CompiledModel(model, tuned=False), torch.tensor([[5, 9, 3, 7]]), 6)
    assert fast == eager and worst < LOGIT_TOLERANCE


@pytest.mark.slow
def test_k3_generate_compile_gives_the_eager_text_and_loads_packages_only_where_they_pay(tmp_path):
    """A first `k3 generate --compile` compiles the packaged decode step, a second loads it — importing neither
    dynamo nor inductor — and records what that cost (`k3.model.payoff.Record`); a later run decodes eagerly where
    the record says loading would cost more than the run's tokens save, and loads the package where it pays (and
    records again). Every run's text is the eager run's."""
    from k3.model.checkpoint import save_model
    from k3.model.payoff import Record

    save_model(tmp_path / "ckpt", serving.model(), serving.tokenizer())
    command = [sys.executable, "-c", "import sys; from k3.cli import main; rc = main(sys.argv[1:]); "
               "print('compiler imported:', {'torch._dynamo', 'torch._inductor'} & set(sys.modules) != set()); "
               "sys.exit(rc)", "generate", "--ckpt", str(tmp_path / "ckpt"), "--prompt", "def decode(self, s):",
               "--max-tokens", "12", "--temperature", "0"]
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}

    def run(*extra: str, compiler: bool = False) -> tuple[str, str]:
        done = subprocess.run([*command, *extra], capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        assert f"compiler imported: {compiler}" in done.stdout
        return done.stdout.replace(f"compiler imported: {compiler}", ""), done.stderr

    text, _ = run()
    compiled, account = run("--compile", compiler=True)  # export and AOTInductor
    assert compiled == text and "1 packages, 0 of them loaded from the on-disk cache" in account
    assert not list((tmp_path / "cache").rglob("payoff.json"))  # a compiling run has no load time to record
    loaded, account = run("--compile")  # no record: load the package, and record
    assert loaded == text and "1 packages, 1 of them loaded from the on-disk cache" in account
    assert "8 steps compiled, 3 eager" in account  # 12 tokens: the prompt's step gives the first, then 3 eager, 8
    (path,) = (tmp_path / "cache").rglob("payoff.json")
    (threads, _), = json.loads(path.read_text()).items()
    assert Record.read(path.parent, int(threads)) is not None
    Record(1e9, 1e-3).write(path.parent, int(threads))  # loading the package would never pay
    slow_load, account = run("--compile")
    assert slow_load == text and "decoded eagerly" in account
    Record(1e-9, 1e-9).write(path.parent, int(threads))  # loading it always pays
    fast_load, account = run("--compile")
    assert fast_load == text and "1 packages, 1 of them loaded from the on-disk cache" in account
    assert Record.read(path.parent, int(threads)).load_s > 1e-6  # the load just measured


def test_engine_compiled_gives_eager_tokens_in_mixed_steps_with_a_graph_per_bucket(tok):
    """Requests of unequal lengths join a running batch one per step — their 16-token prefill chunks run in the
    same steps as the others' decode rows — and leave as they finish: decode batches of 1 to 6 rows padded to the
    buckets 1, 2, 4 and 8, prefill chunks cut into 16-, 4- and 1-token pieces. Every request's greedy tokens equal
    the eager engine's, and no shape key is ever compiled twice."""
    from k3.serve.engine import Engine, SamplingParams
    from k3.serve.api.metrics import Metrics

    model = serving.model()
    prompts = [p for p in serving.prompts() if len(p) > 1][:6]  # 5, 17, 33, 64, 120, 9 tokens
    params = [SamplingParams(max_tokens=6 + 2 * i, temperature=0) for i in range(len(prompts))]

    def run(engine: Engine) -> list[list[int]]:
        tokens: dict[int, list[int]] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            engine.add_request(prompt, p, callback=lambda o, i=i: tokens.setdefault(i, []).extend(o.token_ids))
            engine.step()
        while engine.has_work():
            engine.step()
        return [tokens[i] for i in range(len(prompts))]

    compiled = CompiledModel(model, tuned=False)
    engine = Engine(model, tok, prefill_chunk=16, compile=compiled)
    assert run(engine) == run(Engine(model, tok, prefill_chunk=16))
    keys = compiled.compile_seconds
    assert compiled.compilations == len(keys)
    scraped = Metrics(engine).render().decode()  # GET /metrics tells a compile stall from a slow step
    assert f"k3_compiled_graphs_total {float(len(keys))}" in scraped and "k3_compile_seconds_total" in scraped
    assert "k3_compiled_graphs" not in Metrics(Engine(model, tok)).render().decode()
    assert {key[1] for key in keys if key[0] == "decode"} <= {1, 2, 4, 8}
    assert {key[2] for key in keys if key[0] == "prefill"} <= {16, 4}


def test_warm_up_builds_every_graph_a_server_reaches(tok):
    """`warm_up` compiles each prefill piece (on an empty and a longer cache) and each decode bucket up to the
    engine's batch; then requests that arrive one per step with prompts of 1 to 21 tokens — whose chunks, cut by a
    4-token budget, start pieces on caches of 0, 1 and more positions, decode alone or stacked, padded or not — give
    the eager engine's tokens and compile nothing more (a graph built while serving stalls every request)."""
    from k3.serve.engine import Engine, SamplingParams

    model = serving.model()
    compiled = CompiledModel(model, batches=(1, 2, 4), sizes=(4, 1), tuned=False)
    assert compiled.warm_up(max_batch=2) > 0
    keys = compiled.compile_seconds
    assert all(key[-1] for key in keys)  # built in inference mode, as the engine steps
    assert sorted((kind, batch, length, cache) for kind, batch, length, cache, *_ in keys) == [
        ("decode", 1, 1, 2), ("decode", 2, 1, 2), ("prefill", 1, 4, 0), ("prefill", 1, 4, 2)]
    text = serving.prompts()[5]
    prompts = [text[:1], text[3:5], text[10:21], text[30:33], text[40:49], text[60:61]]

    def run(engine: Engine) -> list[list[int]]:
        tokens: dict[int, list[int]] = {}
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, SamplingParams(max_tokens=3 + i % 3, temperature=0),
                               callback=lambda o, i=i: tokens.setdefault(i, []).extend(o.token_ids))
            engine.step()
        while engine.has_work():
            engine.step()
        return [tokens[i] for i in range(len(prompts))]

    eager = run(Engine(model, tok, max_batch=2, prefill_chunk=4))
    assert run(Engine(model, tok, max_batch=2, prefill_chunk=4, compile=compiled)) == eager
    assert compiled.compilations == 4


def test_caches_longer_than_the_cascade_sum_length_run_graphs_that_warm_up_built():
    """Inductor's C++ code sums more than `CASCADE_SUM` fp32 terms in chunks, so a graph compiled on a short cache
    guards on the attention's length staying at most 4,096: a warm decode step that crossed it raised dynamo's
    "Recompilation triggered with skip_guard_eval_unsafe" (a failed request under ``k3 serve --compile``). With a
    context past it, `warm_up` builds each piece and bucket again on a 4,096-position cache; a decode step and a
    prefill piece crossing the length then give eager's tokens and compile nothing."""
    torch.manual_seed(0)
    model = K3ForCausalLM(dataclasses.replace(preset("tiny"), context_length=8192)).eval()
    compiled = CompiledModel(model, batches=(1,), sizes=(4, 1), tuned=False)
    compiled.warm_up(max_batch=1)
    assert sorted(key[:4] for key in compiled.compile_seconds) == [
        ("decode", 1, 1, 2), ("decode", 1, 1, 3), ("prefill", 1, 4, 0), ("prefill", 1, 4, 2), ("prefill", 1, 4, 3)]
    text = torch.randint(0, model.config.vocab_size, (1, 4101), generator=torch.Generator().manual_seed(0))
    # decode steps from 4,090 cached positions to 4,098; then 4-pieces up to a cache of 4,100 (the last one long)
    for prompt, steps in ((text[:, :4090], 8), (text, 2)):
        with torch.inference_mode():  # as the engine steps, and as warm_up built the graphs
            eager, fast, worst = generate_both(model, compiled, prompt, steps)
        assert fast == eager and worst < LOGIT_TOLERANCE
    assert compiled.compilations == 5


def test_compiled_decode_writes_the_caches_in_place_and_a_second_continuation_gets_its_own():
    """Decode steps write each MLA cache's new entry in place into its storage (no copy of the cache per step);
    continuing an earlier state again (as the prefix cache and speculation do) moves it to new storage and leaves
    every cache already returned unchanged."""
    model = serving.model()
    compiled = CompiledModel(model, sizes=(4, 1), tuned=False)
    logits, state = compiled(torch.tensor([serving.prompts()[3][:6]]), model.new_state(1))
    token = logits[:, -1].argmax(-1, keepdim=True)
    _, one = compiled(token, state)
    _, two = compiled(token, one)
    mla = [i for i, layer in enumerate(state.layers) if isinstance(layer, MLACache)]
    assert mla and all(two.layers[i].storage is one.layers[i].storage is not None for i in mla)
    assert all(two.layers[i].latent.data_ptr() == one.layers[i].latent.data_ptr() for i in mla)
    kept = [two.layers[i].latent.clone() for i in mla]
    other = (token + 1) % model.config.vocab_size
    fork_logits, fork = compiled(other, one)
    with torch.no_grad():
        eager_logits, eager = model(other, state=one)
    assert fork_logits.shape == eager_logits.shape  # the model's [B, 1, V] (issue 37)
    assert float((fork_logits - eager_logits).abs().max()) < LOGIT_TOLERANCE
    for i, latent in zip(mla, kept, strict=True):
        assert fork.layers[i].storage is not one.layers[i].storage
        assert torch.equal(two.layers[i].latent, latent) and torch.equal(two.layers[i].latent[:, :-1],
                                                                         one.layers[i].latent)
        torch.testing.assert_close(fork.layers[i].latent, eager.layers[i].latent, atol=1e-5, rtol=1e-5)


def test_a_batch_between_buckets_keeps_its_caches_growing_in_place(monkeypatch):
    """Three rows run at the 4-row bucket: after the first step the padded bucket is continued as it is, so no MLA
    cache is stacked or moved to new storage again (before: two copies of every cache per step), and each row's
    logits stay eager's."""
    from k3.model.sequence import mla as mla_module

    model = serving.model()
    compiled = CompiledModel(model, batches=(1, 2, 4), sizes=(4, 1), tuned=False)
    prompts = [serving.prompts()[i][:6] for i in (3, 4, 5)]
    states, tokens = [], []
    for prompt in prompts:
        logits, state = compiled.step(torch.tensor([prompt]), model.new_state(1))
        states.append(state)
        tokens.append(logits.argmax(-1, keepdim=True))
    state, token = DecoderState.stack(states), torch.cat(tokens)
    eager = state
    moved = []
    real = mla_module.Storage.holding.__func__
    monkeypatch.setattr(mla_module.Storage, "holding", classmethod(lambda cls, *a: moved.append(1) or real(cls, *a)))
    for step in range(4):
        before = len(moved)
        logits, state = compiled.step(token, state)
        with torch.no_grad():
            eager_logits, eager = model(token, state=eager)
        assert float((logits - eager_logits[:, -1]).abs().max()) < LOGIT_TOLERANCE
        if step:
            assert len(moved) == before, f"step {step}: {len(moved) - before} caches moved to new storage"
        token = logits.argmax(-1, keepdim=True)
    assert logits.shape[0] == 3 and state.batch_size == 3


def _together(engine, prompts: list[list[int]], params: list) -> list[list[int]]:
    """Run ``prompts`` (with ``params``) together; their tokens."""
    tokens: dict[int, list[int]] = {}
    engine.add_requests([(p, q, None, lambda o, i=i: tokens.setdefault(i, []).extend(o.token_ids))
                         for i, (p, q) in enumerate(zip(prompts, params))])
    while engine.has_work():
        engine.step()
    return [tokens[i] for i in range(len(prompts))]


def test_compiled_verification_gives_plain_decoding_and_warm_up_builds_its_graphs(tok):
    """Speculation on compiled graphs (issue 36): an n-gram drafter drafting γ = 3 every step, its verification rows
    (right-padded to γ + 1, stacked, the batch padded to its bucket when one request runs alone) through the
    compiled verification graph, exact against plain eager decoding; `Engine.warm_up` builds that graph beside the
    decode one, and serving compiles nothing more."""
    from k3.serve.engine import Engine, SamplingParams
    from k3.serve.engine.ngram import NGramDrafter

    model = serving.Cycling()  # answers repeat the cycle: the n-gram index finds drafts the target accepts
    text = serving.prompts()[5]
    prompts = [text[:40] + serving.CYCLE * 2, text[50:90] + serving.CYCLE[:4]]
    params = [SamplingParams(max_tokens=n, temperature=0) for n in (24, 12)]  # the second ends first: a row alone

    compiled = CompiledModel(model, batches=(2,), sizes=(1,), tuned=False)
    engine = Engine(model, tok, max_batch=2, compile=compiled, drafter=NGramDrafter(),
                    num_draft_tokens=3, adaptive_draft=False)
    assert engine.warm_up() > 0
    built = compiled.compilations
    assert sorted((kind, batch, length) for kind, batch, length, *_ in compiled.compile_seconds) == [
        ("decode", 2, 1), ("verify", 2, 4)]
    assert _together(engine, prompts, params) == _together(Engine(model, tok, max_batch=2), prompts, params)
    assert engine.speculation["runs"] > 0 and engine.speculation["accepted"] > 0
    assert compiled.compilations == built


def test_a_tuned_verification_graph_gives_the_eager_logits():
    """The verification graph as `k3 serve --compile` builds it (tuned: frozen weights, C++ GEMM templates, C++
    wrapper) gives eager's logits at every position after 60 cached tokens. While the batched-GEMM template read MLA's
    ``W_uv`` view without its offset (torch 2.13; `k3.model.projections.constant`) they were off by 0.056 here
    (0.02-1.1 on `mini`): greedy speculation then emitted other tokens than plain decoding."""
    model = serving.model()
    compiled = CompiledModel(model, batches=(1,))
    torch.manual_seed(0)
    ids = torch.randint(0, serving.VOCAB, (1, 65))
    with torch.no_grad():
        _, state = model(ids[:, :60], state=model.new_state(1))
        eager, _ = model.forward_groups([(ids[:, 60:], state)], full=[True], replay=[True])[0]
        logits, _ = compiled.verify(ids[:, 60:], state)
    assert compiled.graph_calls == 1
    torch.testing.assert_close(logits, eager.reshape(logits.shape), atol=LOGIT_TOLERANCE, rtol=0)


def _draft_graphs() -> dict[str, int]:
    """The graphs dynamo holds of the EAGLE draft's compiled reads, steps and greedy chains."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list as graphs_of

    from k3.model.draft import EagleDraft

    return {f.__name__: len(graphs_of(f.__code__)) for f in (EagleDraft.read, EagleDraft.forward, EagleDraft.greedy)}


def test_compiled_eagle_speculation_reads_the_features_eager_speculation_reads(tok):
    """An EAGLE-3 draft reading AttnRes block outputs (a 4-block target) on a compiled engine: decode,
    verification and prefill graphs keep the target features (the capture is part of their shape key: a graph built
    without it is never reused with it; a prefill chunk keeps each piece's) and the draft's own steps are compiled,
    so every proposal equals the eager engine's — the same tokens, q within 1e-4 — and the answers equal plain
    decoding; after `Engine.warm_up` nothing compiles, the draft's reads of a 30-token prompt included."""
    from k3.model.draft import EagleDraft
    from k3.serve.engine import Engine, SamplingParams
    from k3.serve.engine.drafting import EagleDrafter

    Recording = serving.recording(EagleDrafter)
    tiny = preset("tiny")
    torch.manual_seed(0)
    model = K3ForCausalLM(dataclasses.replace(tiny, attn_res=dataclasses.replace(tiny.attn_res, block_size=1)))
    draft = EagleDraft(model.eval())
    assert draft.config.feature_source == "blocks"
    prompts = [serving.prompts()[3], serving.prompts()[5][:30]]
    params = [SamplingParams(max_tokens=n, temperature=0) for n in (14, 8)]

    compiled = CompiledModel(model, batches=(2,), sizes=(1, 4), tuned=False)
    with torch.no_grad():
        context = model(torch.zeros(1, 2, dtype=torch.long), state=model.new_state(1))[1]
    compiled.decode(torch.zeros(2, 1, dtype=torch.long), DecoderState.stack([context] * 2))  # no capture
    built = compiled.compilations
    fast, eager = Recording(draft, compile=True, tuned=False), Recording(draft)  # the draft's steps compiled too
    engine = Engine(model, tok, max_batch=2, compile=compiled, drafter=fast, num_draft_tokens=3, adaptive_draft=False)
    engine.warm_up()
    fast.proposals.clear()  # the draft's warm-up proposal
    assert compiled.compilations == built + 4  # decode, verification, prefill pieces on an empty cache and a cache
    warm, drafts = compiled.compilations, _draft_graphs()
    assert _together(engine, prompts, params) == _together(Engine(model, tok, max_batch=2), prompts, params)
    _together(Engine(model, tok, max_batch=2, drafter=eager, num_draft_tokens=3, adaptive_draft=False), prompts,
              params)
    assert compiled.compilations == warm and _draft_graphs() == drafts  # the draft's reads and chain too
    assert len(fast.proposals) == len(eager.proposals) > 0
    for a, b in zip(fast.proposals, eager.proposals, strict=True):
        assert a.tokens == b.tokens
        torch.testing.assert_close(a.q, b.q, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_a_tuned_greedy_chain_drafts_the_eager_chains_tokens_and_compiles_only_at_warm_up():
    """`EagleDrafter(compile=True)`, tuned (the default): `warm_up` builds the greedy chain of γ draft steps as one
    graph whose weights are constants (inductor's C++ GEMM templates); at other context lengths its drafts are the
    eager drafter's (fewer than γ too, from the γ-step chain), and nothing of the draft compiles after `warm_up`."""
    from k3.model.draft import EagleDraft
    from k3.serve.engine import SamplingParams
    from k3.serve.engine.drafting import EagleDrafter

    torch.manual_seed(3)
    model = serving.model()
    draft = EagleDraft(model).eval()
    assert draft.config.layer_kind == "mla"
    fast, eager = EagleDrafter(draft, compile=True), EagleDrafter(draft)
    fast.warm_up(3)
    built = _draft_graphs()
    assert built["greedy"] >= 1
    chained, chain = [], fast._greedy
    fast._greedy = lambda *args: (chained.append(args[-1]), chain(*args))[1]  # the steps of each compiled call
    g = torch.Generator().manual_seed(0)
    width, vocab = model.config.hidden_size, model.config.vocab_size
    for length, gamma in ((4, 3), (37, 3), (90, 2)):  # 2: fewer near an answer's end, the first of the chain's 3
        tokens = torch.randint(0, vocab, (length,), generator=g).tolist()
        features = torch.randn(length, 3, width, generator=g)
        proposals = []
        for drafter in (fast, eager):
            with torch.inference_mode():  # as `Engine.step` calls them
                drafter.observe("r", tokens, features)
                proposals.append(drafter.propose("r", [], tokens[-1], SamplingParams(temperature=0), [], [], None,
                                                 gamma))
            drafter.end("r")
        assert proposals[0].tokens == proposals[1].tokens and len(proposals[0].tokens) == gamma
    assert _draft_graphs() == built and chained == [3, 3, 3]


def test_paused_eagle_steps_run_the_plain_graphs_built_at_warm_up(tok):
    """Adaptive EAGLE on a compiled engine (issue 36): `Engine.warm_up` builds the decode graph without features
    beside the ones keeping them, so the steps of a paused request (an untrained draft loses its probes) run the
    plain graph, the steps just before a probe the feature-keeping one, nothing compiles while serving, and the
    tokens are plain eager decoding's."""
    from k3.model.draft import DraftConfig, EagleDraft
    from k3.serve.engine import Engine, SamplingParams
    from k3.serve.engine.drafting import EagleDrafter

    model = serving.model()
    compiled = CompiledModel(model, batches=(1,), sizes=(1,), tuned=False)
    drafter = EagleDrafter(EagleDraft(model, DraftConfig(layer_kind="kda")).eval())
    engine = Engine(model, tok, compile=compiled, drafter=drafter, num_draft_tokens=3)
    engine.warm_up()
    warm = compiled.compilations
    capturing, step = [], compiled.step
    compiled.step = lambda *args: (capturing.append(any(layer.capture for layer in model.layers)), step(*args))[1]
    params = SamplingParams(max_tokens=80, temperature=0)
    prompt = serving.prompts()[3]
    tokens = [t for o in engine.generate(prompt, params) for t in o.token_ids]
    assert tokens == [t for o in Engine(model, tok).generate(prompt, params) for t in o.token_ids]
    assert compiled.compilations == warm
    assert engine.speculation["runs"] >= 2 and capturing.count(False) > 40 and capturing.count(True) > 0


def test_a_draft_model_drafting_on_compiled_graphs_proposes_what_it_proposes_eagerly(tok):
    """`ModelDrafter(compile=True)`: the draft model's catch-up reads and draft steps run on its own compiled graphs
    (here one untuned decode graph, for speed); its proposals are the eager drafter's, tokens and q within 1e-4."""
    from k3.serve.engine import Engine, SamplingParams
    from k3.serve.engine.drafting import ModelDrafter

    Recording = serving.recording(ModelDrafter)
    model, draft_model = serving.model(), serving.model(seed=1)
    fast, eager = Recording(draft_model, compile=True), Recording(draft_model)
    fast.compiled = CompiledModel(draft_model, batches=(1,), sizes=(1,), tuned=False)
    prompt, params = serving.prompts()[3], SamplingParams(max_tokens=10, temperature=0)
    answers = [[t for o in Engine(model, tok, drafter=d, num_draft_tokens=3, adaptive_draft=False).generate(
        prompt, params) for t in o.token_ids] for d in (fast, eager)]
    assert answers[0] == answers[1] == [t for o in Engine(model, tok).generate(prompt, params) for t in o.token_ids]
    assert fast.compiled.compilations > 0 and len(fast.proposals) == len(eager.proposals) > 0
    for a, b in zip(fast.proposals, eager.proposals, strict=True):
        assert a.tokens == b.tokens
        torch.testing.assert_close(a.q, b.q, atol=1e-4, rtol=0)
