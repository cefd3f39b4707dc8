"""Speculative decoding in the engine (issue 14): greedy tokens and logprobs equal plain decoding, the state after
every step equals sequential decoding of the accepted tokens, sampled tokens follow the target's distribution."""

from __future__ import annotations

import math

import pytest
import torch

import serving
from k3.model.sequence.kda import KDAState
from k3.model.sequence.mla import Storage
from k3.model.state import DecoderState
from k3.model.draft import DraftConfig, EagleDraft
from k3.serve.engine.drafting import Draft, EagleDrafter, ModelDrafter
from k3.serve.engine.ngram import NGramDrafter
from k3.serve.engine import Engine, SamplingParams
from k3.serve.engine.sampling import process
from k3.serve.engine.speculative import probabilities

PROMPTS = serving.prompts()[:4]


def drafters():
    return {"same weights (all accepted)": lambda target: ModelDrafter(serving.model(seed=0)),
            "other weights (mostly rejected)": lambda target: ModelDrafter(serving.model(seed=1)),
            "eagle-3 (untrained)": lambda target: EagleDrafter(EagleDraft(target, DraftConfig(layer_kind="kda")))}


def run(engine: Engine, jobs, check=None) -> list[tuple[list[int], list[float], str]]:
    out = [([], [], None) for _ in jobs]

    def callback(i):
        def push(o):
            out[i][0].extend(o.token_ids)
            out[i][1].extend(t.logprob for t in o.logprobs)
            if o.finish_reason is not None:
                out[i] = (out[i][0], out[i][1], o.finish_reason)
        return push

    engine.add_requests([(p, q, None, callback(i)) for i, (p, q) in enumerate(jobs)])
    while engine.has_work():
        engine.step()
        if check is not None:
            check(engine)
    return out


def reference_state(model, tokens: list[int]):
    """The state of reading ``tokens`` in one pass from scratch."""
    with torch.no_grad():
        return model(torch.tensor([tokens]), state=model.new_state(1))[1]


def assert_state_close(got, want) -> None:
    assert got.position == want.position
    for a, b in zip(got.layers, want.layers, strict=True):
        names = ("conv", "recurrent") if isinstance(a, KDAState) else ("latent", "shared_key")
        for name in names:
            torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=0, atol=2e-5)


@pytest.mark.parametrize("kind", list(drafters()))
@pytest.mark.parametrize("chunk", [8, 64])
def test_greedy_tokens_and_logprobs_equal_plain_decoding(model, tok, kind, chunk):
    params = SamplingParams(max_tokens=14, temperature=0, logprobs=2)
    plain = run(Engine(model, tok, prefill_chunk=chunk), [(p, params) for p in PROMPTS])
    spec = Engine(model, tok, prefill_chunk=chunk, drafter=drafters()[kind](model), num_draft_tokens=3)
    together = run(spec, [(p, params) for p in PROMPTS])
    alone = [run(spec, [(p, params)])[0] for p in PROMPTS]
    for (tokens, logprobs, reason), (t1, l1, r1), (t2, l2, r2) in zip(plain, together, alone, strict=True):
        assert tokens == t1 == t2 and reason == r1 == r2
        assert l1 == pytest.approx(logprobs, abs=1e-4) and l2 == pytest.approx(logprobs, abs=1e-4)


def test_speculating_and_plain_requests_share_batches(model, tok):
    greedy = SamplingParams(max_tokens=10, temperature=0)
    constrained_like = SamplingParams(max_tokens=10, temperature=0, repetition_penalty=1.3)
    jobs = [(PROMPTS[0], greedy), (PROMPTS[1], constrained_like), (PROMPTS[2], greedy)]
    plain = run(Engine(model, tok), jobs)
    spec = run(Engine(model, tok, drafter=ModelDrafter(serving.model(seed=1)), num_draft_tokens=4), jobs)
    assert [t for t, _, _ in plain] == [t for t, _, _ in spec]


@pytest.mark.parametrize("kind", ["other weights (mostly rejected)", "eagle-3 (untrained)"])
def test_speculating_requests_verify_in_one_replay_group(model, tok, monkeypatch, kind):
    """All speculating requests of a step, with drafts of unequal lengths (``max_tokens`` shortens the last ones),
    are verified in one replay group of one `forward_groups` call, and each still emits plain decoding's greedy
    tokens, with or without neighbours."""
    jobs = [(p, SamplingParams(max_tokens=n, temperature=0)) for p, n in zip(PROMPTS, (6, 9, 13, 17), strict=True)]
    plain = run(Engine(model, tok), jobs)
    engine = Engine(model, tok, drafter=drafters()[kind](model), num_draft_tokens=4, adaptive_draft=False)
    drafted, replayed = [], []
    propose, forward_groups = engine.speculator.propose, model.forward_groups

    def record_drafts(requests):
        drafts = propose(requests)
        drafted.append(sorted(len(d.tokens) for d in drafts.values()))
        return drafts

    def record_groups(groups, full=None, replay=None):
        replayed.append([ids.shape for (ids, _), r in zip(groups, replay or [False] * len(groups)) if r])
        return forward_groups(groups, full, replay)

    monkeypatch.setattr(engine.speculator, "propose", record_drafts)
    monkeypatch.setattr(model, "forward_groups", record_groups)
    together = run(engine, jobs)
    assert len(drafted) == len(replayed)
    for lengths, shapes in zip(drafted, replayed, strict=True):
        assert shapes == ([(len(lengths), max(lengths) + 1)] if lengths else [])
    assert any(len(set(lengths)) > 1 for lengths in drafted) and max(map(len, drafted)) == len(jobs)
    alone = [run(engine, [job])[0] for job in jobs]
    assert [t for t, _, _ in plain] == [t for t, _, _ in together] == [t for t, _, _ in alone]


@pytest.mark.parametrize("kind", list(drafters()))
def test_the_state_after_every_step_equals_sequential_decoding(model, tok, kind):
    """Zero drafts (a request near max_tokens), all rejected, all accepted plus bonus, a stop string or
    max_tokens inside an accepted run, requests joining and leaving: after every step each running request's
    state is that of sequential decoding of what it consumed."""
    engine = Engine(model, tok, drafter=drafters()[kind](model), num_draft_tokens=4, adaptive_draft=False)
    text = "".join(t for o in Engine(model, tok).generate(PROMPTS[1], SamplingParams(max_tokens=12, temperature=0))
                   for _, t in o.deltas)
    stop = text[4:6]
    jobs = [(PROMPTS[0], SamplingParams(max_tokens=13, temperature=0)),
            (PROMPTS[1], SamplingParams(max_tokens=30, temperature=0, stop=(stop,))),
            (PROMPTS[2], SamplingParams(max_tokens=2, temperature=0)),
            (PROMPTS[3], SamplingParams(max_tokens=9, temperature=0.8, seed=4)),
            (PROMPTS[0], SamplingParams(max_tokens=6, temperature=0))]
    checked = [0]

    def check(e: Engine) -> None:
        for r in e.running.values():
            if r.pending is None:
                continue
            consumed = r.prompt + r.output_ids[:-1]
            assert_state_close(r.state, reference_state(model, consumed))
            checked[0] += 1

    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=40, temperature=0), request_id="leaves")
    engine.step()
    engine.step()  # prefilled, then one speculative step
    assert engine.abort("leaves") and engine.finished["abort"] == 1
    out = run(engine, jobs, check)
    assert checked[0] > 5
    stats = engine.speculation
    assert stats["runs"] > 5 and (stats["accepted"] == stats["drafted"] if kind.startswith("same")
                                  else stats["accepted"] < stats["drafted"])
    assert out[1][2] == "stop" and out[2][0] and len(out[2][0]) == 2


class EveryOtherStep(NGramDrafter):
    """Prompt lookup on every other step only: verifications and plain steps alternate."""

    calls = 0

    def propose(self, *args, **kwargs):
        self.calls += 1
        return super().propose(*args, **kwargs) if self.calls % 2 else None


def test_a_lone_request_decodes_on_in_its_own_storage_after_each_verification(tok, monkeypatch):
    """At batch 1 the decode group is the request's own state, not a stack of one: the plain step after a
    verification appends into the accepted state's MLA storage, so the caches are copied only when they outgrow it
    (as in plain decoding), never per verification."""
    model, params = serving.Cycling(), SamplingParams(max_tokens=48, temperature=0)
    copies = []
    holding = Storage.holding.__func__
    monkeypatch.setattr(Storage, "holding",
                        classmethod(lambda cls, cache, n: copies.append(n) or holding(cls, cache, n)))
    monkeypatch.setattr(DecoderState, "stack", classmethod(lambda cls, states: pytest.fail("a stack at batch 1")))
    plain = run(Engine(model, tok), [(PROMPTS[3], params)])
    plain_copies, copies[:] = list(copies), []
    engine = Engine(model, tok, drafter=EveryOtherStep(), num_draft_tokens=4, adaptive_draft=False)
    spec = run(engine, [(PROMPTS[3], params)])
    stats = engine.speculation
    assert spec[0][0] == plain[0][0] and stats["runs"] >= 4 and stats["plain"] >= 4  # steps of both kinds
    assert len(copies) == len(plain_copies)


def test_sampled_tokens_follow_the_target_distribution(model, tok):
    """The first two sampled tokens (top_k 3, temperature 1.3), speculating with a different draft model: counts
    over 1,200 runs against the exact joint distribution of the target (chi-square, 8 degrees of freedom)."""
    params = SamplingParams(max_tokens=2, temperature=1.3, top_k=3)
    prompt = PROMPTS[1]
    with torch.no_grad():
        logits, state = model(torch.tensor([prompt]), state=model.new_state(1))
        p0 = probabilities(process(logits[0, -1].float(), params, prompt, []), params)
        joint = {}
        for a in p0.nonzero().flatten().tolist():
            logits1, _ = model(torch.tensor([[a]]), state=state)
            p1 = probabilities(process(logits1[0, -1].float(), params, prompt, [a]), params)
            for b in p1.nonzero().flatten().tolist():
                joint[(a, b)] = float(p0[a] * p1[b])
    engine = Engine(model, tok, drafter=ModelDrafter(serving.model(seed=1)), num_draft_tokens=1, adaptive_draft=False)
    n = 1200
    counts: dict[tuple[int, int], int] = {}
    for seed in range(n):
        tokens = run(engine, [(prompt, SamplingParams(max_tokens=2, temperature=1.3, top_k=3, seed=seed))])[0][0]
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    assert set(counts) <= set(joint)
    chi2 = sum((counts.get(cell, 0) - n * p) ** 2 / (n * p) for cell, p in joint.items())
    dof = len(joint) - 1
    # Wilson–Hilferty: the chi-square quantile at p = 0.001 for `dof` degrees of freedom
    z = 3.09
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < limit, (chi2, limit, counts, joint)


def test_k3_chat_with_a_draft_checkpoint_answers_as_without(tmp_path, monkeypatch, capsys):
    import io
    import sys

    from k3.cli import main
    from k3.model.checkpoint import save_model

    target = save_model(tmp_path / "target", serving.model(), serving.tokenizer())
    draft = save_model(tmp_path / "draft", serving.model(seed=1), serving.tokenizer())
    answers = []
    for extra in ([], ["--draft", str(draft), "--num-draft-tokens", "3"]):
        monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n/quit\n"))
        assert main(["chat", "--ckpt", str(target), "--max-tokens", "12", "--temperature", "0", *extra]) == 0
        answers.append(capsys.readouterr().out)
    assert answers[0] == answers[1]
    eagle = EagleDraft(serving.model(), DraftConfig(layer_kind="mla")).save(tmp_path / "eagle")
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n/quit\n"))
    assert main(["chat", "--ckpt", str(target), "--max-tokens", "12", "--temperature", "0", "--draft", str(eagle)]) == 0
    assert capsys.readouterr().out == answers[0]
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "draft.json").write_text("{}")
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert main(["chat", "--ckpt", str(target), "--draft", str(tmp_path / "broken")]) == 2
    assert "draft" in capsys.readouterr().err


def counting_reads(draft: EagleDraft) -> list[int]:
    """Record the positions of each `EagleDraft.read` call made after this (by drafters built after it)."""
    reads, read = [], draft.read

    def counted(tokens, hidden, state):
        reads.append(tokens.shape[1])
        return read(tokens, hidden, state)

    draft.read = counted
    return reads


def test_lazy_draft_reads_equal_a_read_per_step_and_a_teacher_forced_pass():
    """EAGLE's reads wait for the next proposal (or ``read_every`` positions): the proposal equals one made by a
    drafter that read every piece at once, and the draft's own full pass over the sequence (its first q)."""
    torch.manual_seed(0)
    target = serving.model()
    draft = EagleDraft(target, DraftConfig(layer_kind="kda")).eval()
    d = draft.in_proj.weight.shape[0]
    pieces = [20, *[1] * 10, 3, 1]  # a prefill chunk, decode steps, a verified run, a decode step
    tokens = [[int(t) for t in torch.randint(0, 200, (n,))] for n in pieces]
    features = [torch.randn(n, 3, d) for n in pieces]
    every = EagleDrafter(draft, read_every=1)
    reads = counting_reads(draft)
    lazy = EagleDrafter(draft)
    for piece, f in zip(tokens, features):
        every.observe("r", piece, f)
        lazy.observe("r", piece, f)
    assert reads == []
    params = SamplingParams(temperature=0)
    want = every.propose("r", [], 7, params, [], [], None, 3)
    got = lazy.propose("r", [], 7, params, [], [], None, 3)
    assert reads == [sum(pieces) - 1]
    assert got.tokens == want.tokens and got.q is None  # greedy: the chain, no q
    sampled = SamplingParams(temperature=1.0)  # step by step, with each step's distribution q
    want, got = (drafter.propose("r", [], 7, sampled, [], [], torch.Generator().manual_seed(1), 3)
                 for drafter in (every, lazy))
    torch.testing.assert_close(got.q, want.q, rtol=0, atol=1e-5)

    flat = [t for piece in tokens for t in piece]
    with torch.no_grad():
        hidden = draft.fuse(list(torch.cat(features).unbind(-2)))
        logits, _, _ = draft(torch.tensor([flat[1:] + [7]]), hidden[None])
    row = draft.to_target(logits[0, -1])
    torch.testing.assert_close(got.q[0], probabilities(row, sampled), rtol=0, atol=1e-5)
    assert lazy.propose("r", [], 7, params, [], [], None, 3).tokens[0] == int(row.argmax())


def test_lazy_draft_reads_are_bounded():
    """Steps that draft nothing read the draft once per ``read_every`` positions (the first has no feature before
    it): what waits stays bounded."""
    draft = EagleDraft(serving.model(), DraftConfig(layer_kind="kda"))
    reads = counting_reads(draft)
    drafter = EagleDrafter(draft, read_every=16)
    for t in range(100):
        drafter.observe("r", [t], torch.randn(1, 3, draft.in_proj.weight.shape[0]))
    assert reads == [15] + [16] * 5


def test_the_draft_reads_on_after_positions_it_was_not_given():
    """Positions observed without features (a paused request's steps) are a gap: the draft reads the runs on either
    side as one sequence without the gap, the first position after it unpaired (its predecessor's feature unknown),
    so a proposal equals the draft's own teacher-forced pass over that sequence; no proposal while the last
    position's feature is unknown; consecutive gaps keep nothing waiting."""
    torch.manual_seed(0)
    draft = EagleDraft(serving.model(), DraftConfig(layer_kind="kda")).eval()
    d = draft.in_proj.weight.shape[0]
    before, after = [int(t) for t in torch.randint(0, 200, (12,))], [int(t) for t in torch.randint(0, 200, (5,))]
    f_before, f_after = torch.randn(12, 3, d), torch.randn(5, 3, d)
    drafter = EagleDrafter(draft)
    params = SamplingParams(temperature=0)
    drafter.observe("r", before, f_before)
    for t in range(30):
        drafter.observe("r", [t], None)
    assert len(drafter._sequences["r"].unread) == 2  # the run before the gap and one gap mark
    assert drafter.propose("r", [], 7, params, [], [], None, 3) is None
    drafter.observe("r", after[:2], f_after[:2])
    drafter.observe("r", after[2:], f_after[2:])
    got = drafter.propose("r", [], 7, params, [], [], None, 3)
    sampled = SamplingParams(temperature=1.0)
    q = drafter.propose("r", [], 7, sampled, [], [], torch.Generator().manual_seed(1), 3).q

    with torch.no_grad():
        fused_before = draft.fuse(list(f_before.unbind(-2)))
        fused_after = draft.fuse(list(f_after.unbind(-2)))
        hidden = torch.cat([fused_before[:-1], fused_after])
        logits, _, _ = draft(torch.tensor([before[1:] + after[1:] + [7]]), hidden[None])
    row = draft.to_target(logits[0, -1])
    torch.testing.assert_close(q[0], probabilities(row, sampled), rtol=0, atol=1e-5)
    assert got.tokens[0] == int(row.argmax())


def test_a_paused_eagle_request_decodes_without_capturing_features(model, tok, monkeypatch):
    """Adaptive EAGLE with a draft that always loses pauses: its paused steps run the target without capturing features
    (the capture is off during exactly the steps whose features the draft is not given), the draft gets them again
    `READ_AHEAD` steps before each probe, probes still draft, and the tokens are plain decoding's."""
    from k3.serve.engine.payoff import READ_AHEAD

    params = SamplingParams(max_tokens=96, temperature=0)
    plain = [t for o in Engine(model, tok).generate(PROMPTS[0], params) for t in o.token_ids]
    drafter = EagleDrafter(EagleDraft(model, DraftConfig(layer_kind="kda")).eval())
    # the draft runs as it would, but proposes a token plain decoding never emits: every run loses (acceptance 0,
    # whatever the machine's timings make of the price), so the request pauses between probes
    never = next(t for t in range(tok.vocab_size) if t not in plain)
    propose = drafter.propose

    def losing(*args):
        draft = propose(*args)
        return draft and Draft([never] * len(draft.tokens))

    drafter.propose = losing
    given = []
    observe = drafter.observe
    drafter.observe = lambda request_id, tokens, features: (given.append(features is not None),
                                                             observe(request_id, tokens, features))
    capturing, verifying, forward_groups = [], [], model.forward_groups

    def recorded(*args, **kwargs):
        capturing.append(any(layer.capture is not None for layer in model.layers))
        verifying.append(any(kwargs.get("replay") or ()))
        return forward_groups(*args, **kwargs)

    monkeypatch.setattr(model, "forward_groups", recorded)
    engine = Engine(model, tok, drafter=drafter, num_draft_tokens=3)
    tokens = [t for o in engine.generate(PROMPTS[0], params) for t in o.token_ids]
    monkeypatch.undo()
    assert tokens == plain
    counts = engine.speculation
    assert counts["accepted"] == 0 and counts["plain"] > 48 and counts["runs"] >= 3
    assert capturing.count(False) == given.count(False) > 32
    # each run's READ_AHEAD steps before it captured; at least two runs came after a pause (how many runs come back
    # to back before the first pause depends on the price this machine's timings give a run)
    runs = [i for i, v in enumerate(verifying) if v]
    assert len(runs) == counts["runs"] and all(all(capturing[max(i - READ_AHEAD, 0):i]) for i in runs)
    assert sum(not all(capturing[a + 1:b]) for a, b in zip(runs, runs[1:])) >= 2


def test_the_draft_states_kept_beside_checkpoints_are_bounded_in_bytes():
    """An MLA draft's state grows with the context: beyond ``max_saved_bytes`` the least recently saved go. Bytes
    are counted independently: (kv_lora_rank + qk_shared_head_dim) fp32 scalars per position, plus the feature."""
    target = serving.model()
    draft = EagleDraft(target, DraftConfig(layer_kind="mla"))
    mla, d = target.config.mla, draft.in_proj.weight.shape[0]
    per_position = 4 * (mla.kv_lora_rank + mla.qk_shared_head_dim)
    state_bytes = lambda positions: per_position * positions + 4 * d  # noqa: E731
    drafter = EagleDrafter(draft, read_every=1, max_saved_bytes=state_bytes(90) + state_bytes(70))
    proposals = []
    for i in range(5):  # states of 19, 39, 59, 79, 99 positions (the first token has no feature before it)
        drafter.observe("r", list(range(20)), torch.randn(20, 3, d))
        drafter.save("r", bytes([i]))
        proposals.append(drafter.propose("r", [], 7, SamplingParams(temperature=0), [], [], None, 2).tokens)
    assert drafter.saved_bytes == state_bytes(99)  # 79 and 99 positions would pass the budget
    drafter.restore("again", bytes([4]))
    assert drafter.propose("again", [], 7, SamplingParams(temperature=0), [], [], None, 2).tokens == proposals[4]
