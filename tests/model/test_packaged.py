"""Packaged tuned steps (`k3.model.packaged`, issue 37): AOTInductor packages of the decode and verification steps
give the eager step's logits and states, write the MLA entries into the caches' storage, keep the drafter's
features, and are loaded by the next step object (a later process) instead of compiled, but never for other
weights; an engine speculating on them gives plain eager decoding's tokens."""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import fields

import pytest
import torch
from torch._subclasses.fake_tensor import is_fake

import serving
from compiled_steps import LOGIT_TOLERANCE
from k3.model.compiled import CompiledModel
from k3.model.packaged import PackagedStep, bound, kept_bytes
from k3.model.sequence.mla import MLACache
from k3.model.state import DecoderState
from k3.serve.engine import Engine, SamplingParams
from k3.serve.engine.ngram import NGramDrafter


def _states_close(a: DecoderState, b: DecoderState) -> float:
    """The largest difference between two states' tensors (layers and depth sources)."""
    worst = (a.depth - b.depth).abs().max().item()
    for x, y in zip(a.layers, b.layers, strict=True):
        assert type(x) is type(y)
        worst = max(worst, *((getattr(x, f.name) - getattr(y, f.name)).abs().max().item() for f in fields(x)))
    return worst


def _context(model, lengths: list[int]) -> tuple[DecoderState, torch.Tensor]:
    """Rows of unequal context lengths stacked (left-padded MLA caches), and each row's next 3 tokens."""
    prompts = serving.prompts()[3:]  # 33, 64 and 120 tokens
    states = []
    with torch.no_grad():
        for row, length in enumerate(lengths):
            states.append(model(torch.tensor([prompts[row][:length]]), state=model.new_state(1))[1])
    stacked = DecoderState.stack(states)
    nxt = torch.tensor([prompts[row][length:length + 3] for row, length in enumerate(lengths)])
    return stacked, nxt


def test_packaged_decode_and_verification_equal_the_eager_step_and_load_for_the_same_weights_only(tmp_path):
    """Decode (1 token) and verification (3 tokens, with its `Replay`, keeping a drafter's features) of two padded
    rows: the package's logits, states, every row's accepted prefix and the features equal the eager step's; the next
    step writes its MLA entries into the storage the returned caches view (no copy); a second step object loads the
    package (a cache hit); after a weight changes, the package of the old weights is not loaded: a new one is built,
    with the new weights' logits."""
    model = serving.model()
    state, nxt = _context(model, [9, 6])
    # a step that ran while a package was exported (serving on another thread) read fake weights: export swaps them
    # into the module it traces, which must not be the model's (the hook is copied into what export traces)
    fake: list[bool] = []
    hook = model.lm_head.register_forward_pre_hook(lambda *_: fake.append(is_fake(model.lm_head.weight)))
    with torch.no_grad():
        for tokens, replayed in ((1, False), (3, True)):
            step = PackagedStep(model, replayed=replayed, directory=tmp_path, tuned=False)
            # a verification keeps the drafter's features, as an eager step does
            with model.capture([0, len(model.layers) - 1], "blocks") if replayed else nullcontext() as layers:
                (expected, after_eager), = model.forward_groups([(nxt[:, :tokens], state)], full=[replayed],
                                                               replay=[replayed])
                captured = [layer.captured.clone() for layer in layers or []]
                logits, after = step(nxt[:, :tokens], state)
                assert all((layer.captured - c).abs().max().item() < 1e-4 for layer, c in zip(layers or [], captured))
            assert (logits - expected).abs().max().item() < LOGIT_TOLERANCE
            assert _states_close(after, after_eager) < 1e-4 and after.position == after_eager.position
            if not replayed:  # the next step writes into the storage these caches view: nothing is copied
                _, later = step(nxt[:, 1:2], after)
                mla = [(old, new) for old, new in zip(after.layers, later.layers) if isinstance(old, MLACache)]
                assert mla and all(new.latent.untyped_storage().data_ptr() == old.latent.untyped_storage().data_ptr()
                                   and new.length == old.length + 1 for old, new in mla)
            if replayed:
                for kept in ([1, 3], [2, 2], [3, 1]):
                    for row, row_eager in zip(after.accept_rows(kept), after_eager.accept_rows(kept)):
                        assert _states_close(row, row_eager) < 1e-4
            assert (step.compilations, step.cache_hits) == (1, 0)
            again = PackagedStep(model, replayed=replayed, directory=tmp_path, tuned=False)
            for saved in tmp_path.glob("*/*/*.pt2"):  # a load renews the file's time (`bound` removes the oldest)
                os.utime(saved, (0, 0))
            with model.capture([0, len(model.layers) - 1], "blocks") if replayed else nullcontext():
                assert (again(nxt[:, :tokens], state)[0] - expected).abs().max().item() < LOGIT_TOLERANCE
            assert (again.compilations, again.cache_hits) == (1, 1)
            assert [f.stat().st_mtime > 0 for f in tmp_path.glob("*/*/*.pt2")].count(True) == 1
        decode = PackagedStep(model, directory=tmp_path, tuned=False)
        decode(nxt[:, :1], state)  # loaded
        model.lm_head.weight.mul_(-1.0)
        try:
            expected = model.forward_groups([(nxt[:, :1], state)])[0][0]
            logits, _ = decode(nxt[:, :1], state)
            assert (logits - expected).abs().max().item() < LOGIT_TOLERANCE
            assert len(list(tmp_path.glob("*/*/step-*.pt2"))) == 2  # one package per weights
            # the step lets the old weights' package go (each holds a copy of its weights)
            assert (decode.compilations, decode.cache_hits, decode.held) == (2, 1, 1)
        finally:
            model.lm_head.weight.mul_(-1.0)
            hook.remove()
    assert fake and not any(fake)


def _answers(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """The requests' generated tokens, run together."""
    out: list[list[int]] = [[] for _ in prompts]
    engine.add_requests([(p, q, None, lambda o, i=i: out[i].extend(o.token_ids))
                         for i, (p, q) in enumerate(zip(prompts, params))])
    while engine.has_work():
        engine.step()
    return out


def test_an_engine_speculating_on_packaged_steps_gives_plain_eager_decodings_tokens(tmp_path, monkeypatch):
    """`CompiledModel(packaged=True)` in the engine, an n-gram drafter drafting γ = 3 every step: greedy answers
    equal plain eager decoding's, verification runs on its package, and a second model's warm-up loads every package
    the first one built instead of compiling it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model, tokenizer = serving.Cycling(), serving.tokenizer()  # answers repeat the cycle: drafts are accepted
    text = serving.prompts()[5]
    prompts = [text[:40] + serving.CYCLE * 2, text[50:90] + serving.CYCLE[:4]]
    params = [SamplingParams(max_tokens=n, temperature=0) for n in (16, 8)]
    expected = _answers(Engine(model, tokenizer, max_batch=2), prompts, params)

    def engine() -> tuple[Engine, CompiledModel]:
        compiled = CompiledModel(model, batches=(2,), sizes=(1,), tuned=False, packaged=True)
        built = Engine(model, tokenizer, max_batch=2, compile=compiled, drafter=NGramDrafter(), num_draft_tokens=3,
                       adaptive_draft=False)
        built.warm_up()
        return built, compiled

    first, compiled = engine()
    assert (compiled.compilations, compiled.cache_hits) == (2, 0)  # decode and verification, batch 2
    assert _answers(first, prompts, params) == expected
    assert first.speculation["runs"] > 0 and first.speculation["accepted"] > 0
    assert compiled.compilations == 2 and compiled.graph_calls > 0
    _, second = engine()
    assert (second.compilations, second.cache_hits) == (2, 2)


def test_bound_removes_the_least_recently_used_packages_but_the_one_just_saved(tmp_path):
    """Packages beyond the limit go oldest first (by modification time, which a load renews); the package just saved
    stays even when it is the oldest or alone exceeds the limit; partial files, links and records are not packages."""
    def package(where: str, size: int, when: float) -> object:
        path = tmp_path / where
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\0" * size)
        os.utime(path, (when, when))
        return path

    saved = package("layout/w1/step-a.pt2", 100, 1)
    older, newer = package("layout/w1/step-b.pt2", 100, 2), package("layout/w2/replayed-c.pt2", 100, 3)
    partial = package("layout/w2/step-d.123.partial.pt2", 10_000, 0)
    record = package("layout/payoff.json", 10_000, 0)
    (tmp_path / "layout/w2/step-e.pt2").symlink_to(older)
    assert bound(tmp_path, saved, 300) == []
    assert bound(tmp_path, saved, 250) == [older]
    assert bound(tmp_path, saved, 0) == [newer]
    assert saved.exists() and partial.exists() and record.exists()
    assert bound(tmp_path, saved, 0) == []


@pytest.mark.parametrize("text, expected", [(None, 8 * 2**30), ("0.5", 2**29), ("0", 0)])
def test_the_packages_kept_are_bounded_by_k3_packages_gb(monkeypatch, text, expected):
    if text is None:
        monkeypatch.delenv("K3_PACKAGES_GB", raising=False)
    else:
        monkeypatch.setenv("K3_PACKAGES_GB", text)
    assert kept_bytes() == expected


@pytest.mark.parametrize("text", ["-1", "nan", "inf", "8GB", ""])
def test_an_unusable_k3_packages_gb_is_refused_by_name(monkeypatch, text):
    monkeypatch.setenv("K3_PACKAGES_GB", text)
    with pytest.raises(ValueError, match="K3_PACKAGES_GB"):
        kept_bytes()
