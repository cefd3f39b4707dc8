"""The Kimi Linear synthetic tasks (k3.train.synthetic; issue 38, item 2): each generated answer checked by reading the
sequence as a person would, and a short run in which KDA learns Palindrome."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from k3.model.lm import K3ForCausalLM
from k3.train.synthetic import MARKERS, PAD, POP, PUSH, SEP, STACKS, VOCAB, SyntheticRun, TASKS, model_config

lengths = st.integers(min_value=9, max_value=300)


def batch(task: str, length: int, seed: int, rows: int = 3):
    tokens, answer = TASKS[task](rows, length, torch.Generator().manual_seed(seed))
    assert tokens.shape == answer.shape == (rows, length) and tokens.dtype == torch.int64
    assert int(tokens.min()) >= 0 and int(tokens.max()) < VOCAB
    return tokens.tolist(), answer.tolist()


@settings(max_examples=30, deadline=None)
@given(lengths, st.integers(0, 10**6))
def test_a_palindrome_answers_with_the_symbols_reversed(length, seed):
    for row, marks in zip(*batch("palindrome", length, seed)):
        sep = row.index(SEP)
        first = row[:sep]
        assert all(t >= MARKERS for t in first)
        assert first and [t for t, a in zip(row, marks) if a] == first[::-1]
        assert all(t == PAD for t in row[sep + 1 + len(first):])


@settings(max_examples=30, deadline=None)
@given(lengths, st.integers(0, 10**6))
def test_an_mqar_answer_is_the_value_stored_with_the_asked_key(length, seed):
    for row, marks in zip(*batch("mqar", length, seed)):
        sep = row.index(SEP)
        stored = dict(zip(row[0:sep:2], row[1:sep:2]))
        assert len(stored) == sep // 2  # distinct keys
        answers = [i for i, a in enumerate(marks) if a]
        assert answers and all(i > sep for i in answers)
        assert all(row[i] == stored[row[i - 1]] for i in answers)


@settings(max_examples=30, deadline=None)
@given(lengths, st.integers(0, 10**6))
def test_a_stack_answer_is_the_value_its_pop_removes(length, seed):
    for row, marks in zip(*batch("stack", length, seed)):
        stacks: dict[int, list[int]] = {MARKERS + s: [] for s in range(STACKS)}
        for i in range(0, length - 2, 3):
            op, s, value = row[i:i + 3]
            if op == PAD:
                break
            if op == PUSH:
                stacks[s].append(value)
                assert not marks[i + 2]
            else:
                assert op == POP and marks[i + 2] and stacks[s] and stacks[s].pop() == value


def test_the_same_seed_gives_the_same_batch():
    for task in TASKS:
        assert batch(task, 64, 7) == batch(task, 64, 7) != batch(task, 64, 8)


@pytest.mark.parametrize("mixer", ["kda", "gdn", "mla"])
def test_each_mixer_is_the_only_sequence_mixer_of_its_model(mixer):
    config = model_config(mixer)
    assert config.layer_kinds() == ["mla" if mixer == "mla" else "kda"] * 2
    assert config.kda.decay == ("head" if mixer == "gdn" else "channel")
    assert config.vocab_size == VOCAB and config.hidden_size == 256 and not config.attn_res.enabled


def test_kda_learns_mqar_with_the_bounded_gate():
    """K3's bounded gate (the default) at its init: 7 stored key–value pairs recalled by 8 queries (32 tokens), width
    64, 800 steps (~40 s on one thread): the greedy accuracy of the values on held-out sequences reaches 0.9 (0.999
    measured; chance is 1/62). The bounded gate's previous init (log-retention uniform over its range) reached 0.16."""
    torch.manual_seed(0)
    run = SyntheticRun("mqar", 32, K3ForCausalLM(model_config("kda", width=64, head_dim=32, context=64)),
                       batch=32, lr=3e-3)
    losses = run.train(800)
    assert losses[-1] < losses[0] / 10
    assert run.accuracy() >= 0.9


def test_a_batch_in_pieces_has_the_whole_batchs_mean_loss_and_gradient():
    """`SyntheticRun.backward` accumulates pieces of rows (each its answers' summed loss over the whole batch's count):
    the loss and gradient of the whole batch's mean, here on Stack, whose rows hold different numbers of answers."""
    torch.manual_seed(0)
    model = K3ForCausalLM(model_config("kda", width=64, head_dim=32, context=64)).double()
    tokens, answer = TASKS["stack"](6, 32, torch.Generator().manual_seed(3))
    counts = answer[:, 1:].sum(1)
    assert len(set(counts.tolist())) > 1
    logits, _ = model(tokens[:, :-1])
    whole = torch.nn.functional.cross_entropy(logits[answer[:, 1:]], tokens[:, 1:][answer[:, 1:]])
    expected = torch.autograd.grad(whole, list(model.parameters()), allow_unused=True)
    run = SyntheticRun("stack", 32, model, batch=6, micro_tokens=64)  # 3 pieces of 2 rows
    loss = run.backward(tokens, answer)
    assert abs(loss - whole.item()) < 1e-12
    for p, g in zip(model.parameters(), expected, strict=True):
        if g is None:
            assert p.grad is None or not p.grad.any()
        else:
            assert torch.allclose(p.grad, g, rtol=1e-10, atol=1e-13)
